"""The exact least-recently-used store (`moonlease_dev.bench.recency`) and its replay. No servers."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from moonlease_dev.bench.recency import RecencyStore
from moonlease_dev.bench.replay import build_ideal_replay, build_recency_replay
from moonlease_dev.bench.saves import ValueSizes
from moonlease_dev.bench.workload import build_named_trace

pytestmark = pytest.mark.unit


def test_the_least_recently_used_key_leaves_first_and_a_conversation_leaves_tail_first():
    store = RecencyStore(4, {})
    store.admit(["a0", "a1"])  # a0 (the prompt's first block) ends most recent
    store.admit(["b0", "b1"])
    store.touch(["a0", "a1"])  # a load of conversation a: b is now the oldest
    store.admit(["c0"])
    assert store.present == {"a0", "a1", "b0", "c0"}, "b's tail left before its head"
    store.admit(["d0"])
    assert store.present == {"a0", "a1", "c0", "d0"}
    assert store.used_bytes == 4 and store.evictions == 2
    store.touch(["gone", "a1"])  # keys not stored are not adopted
    assert "gone" not in store.present


def test_the_shared_prefix_leaves_only_when_nothing_else_is_left():
    def fill(store: RecencyStore) -> set[str]:
        store.admit(["s0", "s1"], shared={"s0", "s1"})  # a system prompt, the oldest keys
        store.admit(["x0"])
        store.admit(["y0", "y1"])
        return set(store.present)

    assert fill(RecencyStore(3, {})) == {"x0", "y0", "y1"}, "a key like any other without keep_shared"
    kept = RecencyStore(3, {}, keep_shared=True)
    assert fill(kept) == {"s0", "s1", "y0"}, "even the newest save's tail leaves before it"
    kept.admit(["s2", "s3"], shared={"s2", "s3"})
    assert kept.present == {"s0", "s2", "s3"}, "then the shared prefix, oldest first (its tail)"


def test_sizes_and_the_free_share_bound_the_bytes():
    store = RecencyStore(100, {"big": 60}, default_size=10, free_share=0.2)
    assert store.limit_bytes == 80
    store.admit(["a", "b", "c"])  # 30 bytes, "c" the oldest
    store.admit(["big"])
    assert store.present == {"a", "b", "big"} and store.used_bytes == 80
    with pytest.raises(ValueError, match="free_share"):
        RecencyStore(100, {}, free_share=1.0)


def test_the_replay_reaches_the_ideal_when_everything_fits_and_never_exceeds_it():
    trace = build_named_trace("agentic-swa", seed=4, duration_s=600.0, sessions_per_min=4.0)
    sizes = ValueSizes()
    ideal = build_ideal_replay(trace, junction_retention=True, sizes=sizes, decode=True)
    assert build_recency_replay(trace, ideal, ideal.stored_bytes * 2, junction_retention=True) == ideal.hits
    small = ideal.stored_bytes // 20
    lru = build_recency_replay(trace, ideal, small, junction_retention=True)
    kept = build_recency_replay(trace, ideal, small, junction_retention=True, keep_shared=True)
    assert all(hit <= best for hit, best in zip(lru, ideal.hits, strict=True))
    assert sum(lru) < sum(ideal.hits) and lru != kept


def test_the_benchmark_renders_every_variant():
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "recency_ceiling.py"
    spec = importlib.util.spec_from_file_location("recency_ceiling", script)
    ceiling = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ceiling)
    column = {"ideal": 0.9, "belady": 0.7,
              "recency": [{"keep_shared": keep, "free_share": free, "hit_rate": 0.6}
                          for keep, free in ceiling.VARIANTS]}
    text = ceiling.render({"command": "python benchmarks/recency_ceiling.py --capacity 0.05", "date": "today",
                           "wall_s": 1.0, "cells": [{"workload": "agentic-swa", "capacity": 0.05, "seed": 1,
                                                     "requests": 3, "segment_mib": 16, "capacity_bytes": 10,
                                                     "objects_at_capacity": 1,
                                                     "columns": {"plain": column, "junctions": column}}]})
    assert text.count("| exact LRU") == len(ceiling.VARIANTS)
    assert "3% of the capacity kept free" in text and "| **Belady** | 70.0% |" in text
    assert "Junction retention stores the same here" in text, "one column when junctions change nothing"
    assert ".venv/bin/python benchmarks/recency_ceiling.py --capacity 0.05" in text
    other = {**column, "belady": 0.72}
    text = ceiling.render({"command": "python benchmarks/recency_ceiling.py", "date": "today", "wall_s": 1.0,
                           "cells": [{"workload": "agentic-swa", "capacity": 0.05, "seed": 1, "requests": 3,
                                      "segment_mib": 16, "capacity_bytes": 10, "objects_at_capacity": 1,
                                      "columns": {"plain": column, "junctions": other}}]})
    assert "| **Belady** | 70.0% | 72.0% |" in text and "| store | plain | junction tails |" in text
