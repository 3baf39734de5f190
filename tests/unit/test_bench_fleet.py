"""The replay's fleet (engine counts, routing) and the workloads' exact re-sends. No servers:
the fleet replay runs over the never-evicting in-memory store."""

from __future__ import annotations

from collections import defaultdict

import pytest

from moonlease_dev.bench.fleet import (
    DEFAULT_FLEET,
    SINGLE_ENGINE,
    FleetSpec,
    Router,
    parse_fleet,
)
from moonlease_dev.bench.replay import (
    MODES,
    build_belady_replay,
    build_ideal_replay,
    build_mode_result,
    build_repeat_summary,
    replay_requests,
)
from moonlease_dev.bench.saves import ValueSizes
from moonlease_dev.bench.stores import DictStore
from moonlease_dev.bench.workload import PRESET_RESEND, WORKLOADS, build_named_trace
from moonlease_connector.core.store_room import RecencyOrder

pytestmark = pytest.mark.unit


def test_fleet_specs_parse():
    assert parse_fleet("4p1d") == DEFAULT_FLEET == FleetSpec(4, 1)
    assert parse_fleet("3") == FleetSpec(2, 1)
    assert parse_fleet("1") == SINGLE_ENGINE == FleetSpec(1, 0)
    assert parse_fleet(" 2P0D ") == FleetSpec(2, 0)
    assert DEFAULT_FLEET.label == "4p1d" and DEFAULT_FLEET.engines == 5
    for bad in ("0p1d", "0", "", "4p", "p1d", "four"):
        with pytest.raises(ValueError, match="--engines"):
            parse_fleet(bad)


def test_routers():
    session = Router("session", 4)
    assert {session.pick("s7") for _ in range(10)} == {session.pick("s7")}
    assert len({session.pick(f"s{i}") for i in range(100)}) == 4
    robin = Router("round-robin", 3)
    assert [robin.pick("s0") for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    draws = [Router("random", 3, seed=5).pick("s0") for _ in range(2)]
    assert draws[0] == draws[1], "seeded"
    spread = Router("random", 3, seed=5)
    assert len({spread.pick("s0") for _ in range(100)}) == 3
    assert Router("random", 1).pick("x") == 0
    with pytest.raises(ValueError, match="unknown routing"):
        Router("least-loaded", 2)


def test_resends_repeat_an_earlier_prompt_of_their_session_exactly():
    trace = build_named_trace("agentic-swa", seed=2, duration_s=1800.0)
    assert WORKLOADS["agentic-swa"].p_resend == PRESET_RESEND > 0
    resends = [(i, r) for i, r in enumerate(trace.requests) if r.kind == "resend"]
    assert 0.02 < len(resends) / len(trace.requests) < 0.1
    low, high = WORKLOADS["agentic-swa"].resend_s
    for index, resend in resends:
        earlier = [r for r in trace.requests[:index] if r.session == resend.session
                   and r.block_hashes == resend.block_hashes and r.kind != "resend"]
        assert earlier, "a re-send repeats a prompt its session sent"
        assert low - 0.002 <= resend.arrival_s - earlier[-1].arrival_s <= high + 0.002
    off = build_named_trace("agentic-swa", seed=2, duration_s=1800.0, p_resend=0.0)
    assert [r for r in trace.requests if r.kind != "resend"] == list(off.requests), \
        "re-sends are added; the rest of the trace is the one drawn without them"


def test_a_fleet_over_a_never_evicting_store_reaches_the_ideal():
    trace = build_named_trace("agentic-swa", seed=4, duration_s=600.0, sessions_per_min=4.0)
    sizes = ValueSizes()
    ideal = build_ideal_replay(trace, junction_retention=False, sizes=sizes, decode=True)
    fleet = FleetSpec(3, 2)
    with pytest.raises(ValueError, match="decode"):
        replay_requests(trace, DictStore(), MODES["leaseAll"],
                        build_ideal_replay(trace, junction_retention=False, sizes=sizes), sizes, fleet=fleet)
    run = replay_requests(trace, DictStore(), MODES["leaseAll"], ideal, sizes, fleet=fleet, routing="session")
    assert [a.hit for a in run.accounts] == ideal.hits
    assert [a.hit for a in run.decode_accounts] == ideal.decode_hits
    # The decode engine finds what the prefill engine just saved: all but the recomputed block.
    assert all(hit >= a.prompt_tokens - 16 for hit, a in zip(ideal.decode_hits, run.accounts))
    assert sum(count[0] for count in run.engine_counts) == len(trace.requests)
    result = build_mode_result(run)["fleet"]
    assert result["engines"] == "3p2d" and result["routing"] == "session"
    assert result["decode_hit_rate"] == pytest.approx(result["decode_ideal_rate"])
    assert len(result["engine_hit_rates"]) == 3
    # Repeats average the per-engine lists and keep the labels.
    summary = build_repeat_summary([build_mode_result(run), build_mode_result(run)])
    assert summary["fleet"]["engines"] == "3p2d"
    assert summary["fleet"]["engine_requests"] == result["engine_requests"]
    # Belady's future holds the decode reads: at a capacity that holds everything it is the ideal.
    hits = build_belady_replay(trace, ideal, ideal.stored_bytes, junction_retention=False)
    assert hits.prefill == ideal.hits and hits.decode == ideal.decode_hits


def test_session_routing_keeps_a_session_on_one_prefill_engine_and_evict_state_per_engine():
    trace = build_named_trace("agentic-swa", seed=4, duration_s=600.0, sessions_per_min=4.0)
    sizes = ValueSizes()
    ideal = build_ideal_replay(trace, junction_retention=False, sizes=sizes)
    engines_of: dict[str, set[int]] = defaultdict(set)
    built = []

    class Recorder:
        """Stands in for `StoreEviction`: counts what each engine's saves told it."""

        removed_keys = refused_keys = 0

        def __init__(self) -> None:
            self.touched = self.loads = 0
            self.order = RecencyOrder()
            built.append(self)

        def saw_load(self, keys):
            assert keys, "a load that read nothing is not reported"
            self.loads += 1

        def saw_exist(self, keys, answers, shared=None):
            self.touched += 1

        def before_put(self, keys, sizes):
            return 0

        def after_put(self, keys, sizes, answers, shared=None):
            self.touched += 1

    router = Router("session", 3)
    for request in trace.requests:
        engines_of[request.session].add(router.pick(request.session))
    assert all(len(engines) == 1 for engines in engines_of.values())
    run = replay_requests(trace, DictStore(), MODES["leaseAll+evict"], ideal, sizes,
                          fleet=FleetSpec(3, 0), routing="session", new_eviction=Recorder)
    assert len(built) == 3 and all(recorder.touched for recorder in built)
    assert all(recorder.loads for recorder in built), "each engine's evict learns its own hits"
    assert sum(recorder.loads for recorder in built) == sum(1 for account in run.accounts if account.hit)
    assert run.decode_accounts == []
    assert run.removal_refused == 0
    shared = replay_requests(trace, DictStore(), MODES["leaseAll+evict@fleet"], ideal, sizes,
                             fleet=FleetSpec(3, 0), routing="session", new_eviction=Recorder)
    # On the fleet's order each engine still runs its own evict (a client of the one service
    # `run_mode` starts), as engines do: what differs is the order, not who removes.
    assert len(built) == 6 and [r.touched for r in built[3:]] == [r.touched for r in built[:3]]
    assert [r.loads for r in built[3:]] == [r.loads for r in built[:3]]
    assert shared.accounts == run.accounts
    assert [count[0] for count in run.engine_counts] == [
        sum(1 for r in trace.requests if Router("session", 3).pick(r.session) == engine) for engine in range(3)]


def test_what_a_load_reads_comes_in_prompt_order():
    """Evict learns a load's keys first block last (most recent): the replay hands them in the
    order of their blocks in the prompt, every key the receiver reads, once."""
    from moonlease_dev.bench.replay import _reference_lookup
    from moonlease_dev.bench.workers import (
        keys_the_load_reads,
        keys_the_load_reads_in_order,
        layout_by_name,
    )

    trace = build_named_trace("agentic-swa", seed=4, duration_s=300.0, sessions_per_min=4.0)
    store = DictStore()
    lookup = _reference_lookup(layout_by_name(trace.header.layout), store, trace, True)
    block = trace.header.hash_block_tokens
    checked = 0
    for request in trace.requests:
        hashes = request.hashes()
        result = lookup.lookup(request.prompt_tokens(block), hashes)
        ordered = keys_the_load_reads_in_order(lookup, hashes, result)
        assert len(ordered) == len(set(ordered))
        assert set(ordered) == keys_the_load_reads(lookup, hashes, result)
        place = {bytes(h).hex(): index for index, h in enumerate(hashes)}
        places = [place[key.rsplit("@", 1)[-1]] for key in ordered]
        assert places == sorted(places)
        checked += bool(ordered) and places[0] < places[-1]
        # Store every block's keys in every group: the next turns hit their whole prefix.
        store.keys.update(key for group in lookup.groups for h in hashes for key in group.keys_for(bytes(h)))
    assert checked > 10
