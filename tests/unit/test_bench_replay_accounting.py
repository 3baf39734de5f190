"""The replay's accounting against a tiny trace computed by hand (issue 10's "done when").

The real replay loop (`replay_requests`: our worker's lookup in a lease mode, upstream's
saves) runs over an in-memory store from which the test evicts chosen keys between requests,
so every hit, ideal hit, state age and miss bucket below can be worked out on paper.

Layout `full`: one full-attention group, 16-token blocks, one rank namespace, so a store key is
`<prefix>@<block hash>`. A prompt of n blocks hits at most n-1 blocks (the last token is
recomputed, and hits are block-aligned).

    request  t (s)  prompt      store before lookup          hit   ideal  ideal state's age
    r0          0   A B C       {}                             0      0   -
    r1         60   A B C D     {A B C}                       48     48   60 - 0   = 60   (< 2 min)
    r2        400   A B X       {A C D} (B evicted)           16     32   400 - 60 = 340  (2-10 min)
    r3       1200   A B C D E   {A B C X} (D evicted)         48     64   1200 - 60 = 1140 (> 10 min)

Ideal ages: a key's last use is the last request that stored or loaded it. Before r3, A and B
were last used by r2 (t=400), C and D by r1 (t=60; r2 neither read nor stored them), so the
stalest keys of r3's ideal load {A, B, C, D} were last used at t=60: 1200 - 60 = 1140 s.
"""

from __future__ import annotations

import pytest

from moonlease_dev.bench.accounting import summarize_hits
from moonlease_dev.bench.replay import (
    MODES,
    Pacer,
    build_ideal_replay,
    build_mode_result,
    build_repeat_summary,
    replay_requests,
)
from moonlease_dev.bench.saves import ValueSizes
from moonlease_dev.bench.stores import DictStore
from moonlease_dev.bench.trace import Trace, TraceHeader, TraceRequest

pytestmark = pytest.mark.unit

PREFIX = "tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@"
HASH = {name: bytes([index + 1]) * 16 for index, name in enumerate("ABCDEX")}


def key(name: str) -> str:
    return PREFIX + HASH[name].hex()


def request(at: float, blocks: str) -> TraceRequest:
    return TraceRequest(at, "s0", tuple(HASH[b].hex() for b in blocks), output_tokens=16)


TRACE = Trace(TraceHeader(workload="hand", layout="full", retention="sparse"),
              (request(0, "ABC"), request(60, "ABCD"), request(400, "ABX"), request(1200, "ABCDE")))
EVICT_BEFORE = {2: ["B"], 3: ["D"]}


def replay(mode: str) -> tuple[DictStore, object]:
    store = DictStore()
    ideal = build_ideal_replay(TRACE, junction_retention=False, sizes=ValueSizes())

    def evict(step: int) -> None:
        for name in EVICT_BEFORE.get(step, ()):
            store.keys.discard(key(name))

    run = replay_requests(TRACE, store, MODES[mode], ideal, ValueSizes(), before_request=evict)
    return store, run


def test_ideal_replay_by_hand():
    ideal = build_ideal_replay(TRACE, junction_retention=False, sizes=ValueSizes(attention=100))
    assert ideal.hits == [0, 48, 32, 64]
    assert ideal.ages == [None, 60, 340, 1140]
    assert ideal.reads == [[], sorted(key(b) for b in "ABC"), sorted(key(b) for b in "AB"),
                           sorted(key(b) for b in "ABCD")]
    # Stored: A B C D X E, each once, 100 bytes.
    assert ideal.key_sizes == {key(b): 100 for b in "ABCDXE"}
    assert ideal.stored_bytes == 600


@pytest.mark.parametrize("mode", ["leaseAll", "selective"])
def test_hits_and_misses_by_age_by_hand(mode):
    store, run = replay(mode)
    assert [(a.prompt_tokens, a.ideal_hit, a.hit) for a in run.accounts] == [
        (48, 0, 0), (64, 48, 48), (48, 32, 16), (80, 64, 48)]
    summary = summarize_hits(run.accounts)
    assert (summary.prompt_tokens, summary.hit_tokens, summary.ideal_tokens) == (240, 112, 144)
    assert summary.missed_by_age == {"< 2 min": 0, "2-10 min": 16, "> 10 min": 16}
    assert summary.missed_points() == pytest.approx({"< 2 min": 0.0, "2-10 min": 100 * 16 / 240,
                                                     "> 10 min": 100 * 16 / 240})
    assert summary.hit_rate == pytest.approx(112 / 240)
    assert summary.above_ideal == 0
    # Saves put back what was missing: B at r2, D at r3.
    assert store.keys == {key(b) for b in "ABCDXE"}
    assert run.keys_put == 3 + 1 + 2 + 2  # r0 ABC; r1 D; r2 B X; r3 D E
    assert run.put_failures == 0


def test_keys_leased_per_lookup_by_hand():
    _, lease_all = replay("leaseAll")
    _, selective = replay("selective")
    # Lease all: every existing candidate. r0 none; r1 A B C (D absent); r2 A (B evicted,
    # X absent); r3 A B C (D evicted, E absent).
    assert lease_all.costs.keys_leased == [0, 3, 1, 3]
    assert lease_all.costs.rpcs == [1, 1, 1, 1]
    # Selective: the hit's load set — the same blocks here, since full attention reads every
    # block of its hit; a probe then a lease (no lease RPC when nothing hits).
    assert selective.costs.keys_leased == [0, 3, 1, 3]
    assert selective.costs.rpcs == [1, 2, 2, 2]
    result = build_mode_result(lease_all)
    assert result["keys_leased_per_lookup"] == pytest.approx(7 / 4)
    assert result["missed_tokens_by_age"] == {"< 2 min": 0, "2-10 min": 16, "> 10 min": 16}


def test_pacer_scales_virtual_time_and_a_late_request_shifts_the_rest():
    now = [100.0]
    slept: list[float] = []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        now[0] += seconds

    pacer = Pacer(0.01, clock=lambda: now[0], sleep=sleep)
    pacer.wait(50.0)  # origin: no wait
    pacer.wait(150.0)  # due 1 s later
    now[0] += 3.0  # processing took 3 s of wall time: the next request is 2 s (200 virtual s) late
    pacer.wait(250.0)
    now[0] += 0.5  # on time again: the next one is due 1 s after the late one started, not before
    pacer.wait(350.0)
    assert slept == [pytest.approx(1.0), pytest.approx(0.5)]
    assert pacer.lags_s == [0.0, 0.0, pytest.approx(200.0), 0.0]
    assert pacer.stretch_s == pytest.approx(2.0)


def test_repeated_runs_average_every_number_and_keep_each_hit_rate():
    runs = [{"hit_rate": 0.5, "put_failures": 1, "missed_points_by_age": {"< 2 min": 1.0}},
            {"hit_rate": 0.7, "put_failures": 2, "missed_points_by_age": {"< 2 min": 3.0}}]
    assert build_repeat_summary(runs) == {
        "hit_rate": pytest.approx(0.6), "put_failures": 1.5, "missed_points_by_age": {"< 2 min": 2.0},
        "hit_rate_runs": [0.5, 0.7]}
    assert build_repeat_summary(runs[:1]) == {**runs[0], "hit_rate_runs": [0.5]}


def test_survival_splits_the_stored_keys_into_loaded_and_passed_over() -> None:
    from moonlease_dev.bench.accounting import summarize_survival

    universe = ["a", "b", "c", "d", "e"]
    survival = summarize_survival(universe, {"a", "b"}, bytes([1, 0, 1, 1, 0]))
    assert survival == {"loaded": {"keys": 2, "present": 1, "fraction": 0.5},
                        "passed_over": {"keys": 3, "present": 2, "fraction": 2 / 3}}
    assert summarize_survival([], set(), b"")["loaded"] == {"keys": 0, "present": 0, "fraction": 0.0}
