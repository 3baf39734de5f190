"""The pure parts of benchmarks/retention_capacity.py: what a stored key is, what a miss lost.

Hand-made two-session trace; keys spelled as the replay spells them (group, then block hash).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from moonlease_dev.bench.trace import Trace, TraceHeader, TraceRequest

pytestmark = pytest.mark.unit

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "retention_capacity.py"
spec = importlib.util.spec_from_file_location("retention_capacity", SCRIPT)
capacity = importlib.util.module_from_spec(spec)
spec.loader.exec_module(capacity)


def key(group: int, block: str) -> str:
    return f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:{group}@{block}"


def blocks(*names: str) -> tuple[str, ...]:
    return tuple(name * 32 for name in names)  # 16-byte hashes as hex


SYSTEM = blocks("a", "b")
TRACE = Trace(TraceHeader(workload="t", layout="full+swa"), (
    TraceRequest(0.0, "s1", SYSTEM + blocks("c")),
    TraceRequest(1.0, "s2", SYSTEM + blocks("d")),
    TraceRequest(2.0, "s1", SYSTEM + blocks("c", "e")),  # s1's next turn extends its first prompt
    TraceRequest(3.0, "s3", SYSTEM + blocks("f")),
    TraceRequest(4.0, "s4", SYSTEM + blocks("9")),
))
# The ideal loads: request 2 reads s1's first prompt (full blocks and the window tail at "c").
READS = [[], [key(0, "a" * 32)], [key(0, "a" * 32), key(0, "c" * 32), key(1, "c" * 32)], [], []]


def test_keys_are_classified_by_group_future_reads_and_sharing() -> None:
    classifier = capacity.Classifier(TRACE, READS)
    a, c, e = "a" * 32, "c" * 32, "e" * 32
    assert classifier.kind(key(0, a), 1) == "full-attention block, read again (shared prefix)"
    assert classifier.kind(key(0, c), 2) == "full-attention block, read again"
    assert classifier.kind(key(0, c), 3) == "full-attention block, never read again"
    # After request 2, s1's tail at "c" is superseded: s1 sent a longer prompt over it.
    assert classifier.kind(key(1, c), 3) == "sliding-window block, never read again: superseded tail"
    assert classifier.kind(key(1, e), 3) == "sliding-window block, never read again"


def test_a_miss_is_a_hole_when_later_keys_of_the_load_survive() -> None:
    request = TRACE.requests[2]
    want = [key(1, "c" * 32), key(0, "a" * 32), key(0, "c" * 32)]  # any order: sorted by prompt position
    assert capacity.classify_miss(request, want, bytes([1, 1, 1])) is None
    assert capacity.classify_miss(request, want, bytes([1, 0, 1])) == \
        "first missing key full-attention; later keys still stored (a hole)"
    assert capacity.classify_miss(request, want, bytes([0, 1, 0])) == \
        "first missing key full-attention; nothing after it stored"
    assert capacity.classify_miss(request, want, bytes([0, 1, 1])) == \
        "first missing key sliding-window; nothing after it stored"  # the tail ends the load
