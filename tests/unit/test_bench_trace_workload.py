"""Trace format (JSONL round trip, validation) and the agentic workload generator (pure)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from moonlease_dev.bench.trace import (
    Trace,
    TraceError,
    TraceHeader,
    TraceRequest,
    build_lines,
    parse_lines,
    read_trace,
    write_trace,
)
from moonlease_dev.bench.workload import WORKLOADS, WorkloadKnobs, build_named_trace, build_trace

pytestmark = pytest.mark.unit

SMALL = WorkloadKnobs(duration_s=1800, sessions_per_min=3.0, p_branch=0.3, p_long=0.1, p_pause=0.3)


def test_round_trip_plain_and_gzip(tmp_path: Path):
    trace = build_trace(SMALL, seed=3, workload="small")
    for name in ("t.jsonl", "t.jsonl.gz"):
        write_trace(trace, tmp_path / name)
        assert read_trace(tmp_path / name) == trace
    assert parse_lines(build_lines(trace)) == trace


def test_lines_are_the_documented_format():
    trace = Trace(TraceHeader(workload="w", layout="full+swa", retention="dense", seed=2),
                  (TraceRequest(1.5, "s0", ("aa", "bb"), 32, "new"),))
    header, line = build_lines(trace)
    assert '"type": "header"' in header and '"format": "moonlease-trace/1"' in header
    assert line == ('{"arrival_s": 1.5, "block_hashes": ["aa", "bb"], "kind": "new", '
                    '"output_tokens": 32, "session": "s0", "type": "request"}')
    assert trace.requests[0].prompt_tokens(16) == 32
    assert trace.requests[0].hashes() == [b"\xaa", b"\xbb"]


@pytest.mark.parametrize("lines, message", [
    ([], "no header"),
    (['{"type": "request", "arrival_s": 0, "session": "s", "block_hashes": ["aa"]}'], "header must come first"),
    (['{"type": "header", "workload": "w", "layout": "full", "retention": "some"}'], "retention"),
    (['{"type": "header", "workload": "w", "layout": "full", "format": "other/2"}'], "unknown trace format"),
    (['{"type": "header", "workload": "w", "layout": "full"}',
      '{"type": "request", "arrival_s": 5, "session": "s", "block_hashes": ["aa"]}',
      '{"type": "request", "arrival_s": 4, "session": "s", "block_hashes": ["aa"]}'], "out of arrival order"),
    (['{"type": "header", "workload": "w", "layout": "full"}',
      '{"type": "request", "arrival_s": 5, "session": "s", "block_hashes": []}'], "no block hashes"),
    (['{"type": "header", "workload": "w", "layout": "full"}', "{not json"], "line 2"),
])
def test_malformed_traces_are_refused_with_the_line(lines, message):
    with pytest.raises(TraceError, match=message):
        parse_lines(lines)


def test_same_seed_same_trace_other_seed_other_trace():
    assert build_trace(SMALL, seed=5) == build_trace(SMALL, seed=5)
    assert build_trace(SMALL, seed=5).requests != build_trace(SMALL, seed=6).requests


def test_arrivals_are_ordered_and_within_the_duration():
    trace = build_trace(SMALL, seed=1)
    arrivals = [r.arrival_s for r in trace.requests]
    assert arrivals == sorted(arrivals)
    assert 0 < arrivals[0] and arrivals[-1] < SMALL.duration_s


def by_session(trace: Trace) -> dict[str, list[TraceRequest]]:
    sessions: dict[str, list[TraceRequest]] = {}
    for request in trace.requests:
        sessions.setdefault(request.session, []).append(request)
    return sessions


def test_turns_extend_the_previous_prompt_with_the_answer_and_a_message():
    trace = build_trace(SMALL, seed=2)
    for requests in by_session(trace).values():
        for before, after in zip(requests, requests[1:]):
            grown = len(after.block_hashes) - len(before.block_hashes)
            assert after.block_hashes[:len(before.block_hashes)] == before.block_hashes
            answer = before.output_tokens // SMALL.hash_block_tokens
            assert answer + SMALL.turn_blocks[0] <= grown <= answer + SMALL.turn_blocks[1]


def test_sessions_share_system_prompts_and_branches_share_a_parents_prefix():
    trace = build_trace(SMALL, seed=2)
    firsts = [requests[0] for requests in by_session(trace).values()]
    system = {r.block_hashes[:SMALL.system_blocks] for r in firsts if r.kind in ("new", "long")}
    assert 1 < len(system) <= SMALL.agents
    earlier = [r for r in trace.requests]
    branches = [r for r in firsts if r.kind == "branch"]
    assert branches, "p_branch=0.3 draws sibling branches"
    for branch in branches:
        parents = [r for r in earlier if r.session != branch.session and r.arrival_s <= branch.arrival_s]
        cut = len(branch.block_hashes) - SMALL.turn_blocks[1]
        assert any(p.block_hashes[:cut] == branch.block_hashes[:cut] and
                   len(p.block_hashes) >= len(branch.block_hashes) - SMALL.turn_blocks[1]
                   for p in parents), "a branch forks an earlier prompt of another session"


def test_pauses_resume_after_minutes_and_long_contexts_are_long():
    trace = build_trace(SMALL, seed=2)
    resumes = []
    for requests in by_session(trace).values():
        for before, after in zip(requests, requests[1:]):
            gap = after.arrival_s - before.arrival_s
            if after.kind == "resume":
                resumes.append(gap)
                assert SMALL.pause_s[0] <= gap <= SMALL.pause_s[1] + 1e-3
            else:
                assert SMALL.think_s[0] <= gap <= SMALL.think_s[1] + 1e-3
    assert resumes and max(resumes) > 600, "some resumes come after more than 10 minutes"
    longs = [r for r in trace.requests if r.kind == "long"]
    assert longs and all(len(r.block_hashes) >= SMALL.system_blocks + SMALL.long_blocks[0] for r in longs)


@pytest.mark.parametrize("name", sorted(WORKLOADS))
def test_presets_write_their_layout_and_retention_into_the_header(name):
    trace = build_named_trace(name, seed=1, duration_s=600.0)
    assert trace.header.workload == name
    assert (trace.header.layout, trace.header.retention) == (WORKLOADS[name].layout, WORKLOADS[name].retention)
    assert trace.header.knobs == {k: list(v) if isinstance(v, tuple) else v
                                  for k, v in dataclasses.asdict(WORKLOADS[name]).items()} | {"duration_s": 600.0}
    with pytest.raises(ValueError, match="unknown workload"):
        build_named_trace("nope", seed=1)
