"""vLLM binding of Moonlease retention (`core.retention`): the resume set, by vLLM's own rules.

Adapter (reads vLLM's coordinator; no store I/O). The resume set of a prompt is what vLLM's
load rule (`MooncakeStoreCoordinator.load_mask`) reads for a hit ending at the prompt's last
aligned boundary — where the next turn of the conversation resumes — and at each of the
request's shared-prefix junctions — where a sibling resumes. The send thread and the replay
benchmark both ask `build_resume_set`, then `core.retention.plan_save_retention`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec

from moonlease_connector.adapters.vllm_specs import unwrap_spec
from moonlease_connector.core.retention import ChunkKind


def chunk_kind(spec: Any) -> ChunkKind:
    """Full attention, a windowed group (sliding window, chunked local) or a recurrent one."""
    spec = unwrap_spec(spec)
    if isinstance(spec, MambaSpec):
        return ChunkKind.RECURRENT
    if isinstance(spec, SlidingWindowSpec) or getattr(spec, "attention_chunk_size", None):
        return ChunkKind.WINDOW
    return ChunkKind.FULL


def build_resume_set(coord: Any, block_hashes: Sequence[Any], num_tokens: int,
                     junctions: Sequence[int] = ()) -> frozenset[tuple[int, int]]:
    """`(group_id, chunk)` pairs a hit at the prompt's end, or at a junction, loads.

    The end is the prompt length aligned down to the coordinator's lcm block (what a longer
    prompt over this one can hit); junctions are aligned the same way.
    """
    lcm = coord.lcm_block_size
    ends = {num_tokens // lcm * lcm, *(j // lcm * lcm for j in junctions if 0 < j <= num_tokens)}
    resume: set[tuple[int, int]] = set()
    hashes = list(block_hashes)
    for end in sorted(e for e in ends if e > 0):
        for group_id, mask in enumerate(coord.load_mask(hashes, end)):
            resume.update((group_id, chunk) for chunk, loaded in enumerate(mask) if loaded)
    return frozenset(resume)
