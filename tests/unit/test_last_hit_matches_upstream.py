"""Last-hit-only lookup against upstream's own lookup, for hybrid and recurrent-only layouts.

The store is a recorder that plays Mooncake's LastHitOnly probe under either contract: 0.3.14
answers per-key existence and leases the last complete candidate; an RFC 4255 store answers a
selected-only mask. For any existence pattern, with no eviction:
- the hit and tail keys equal upstream's default lookup (which leases every recurrent state);
- KV keys are leased as upstream leases them; of the recurrent keys, only the selected
  checkpoint's are leased, and those are exactly the recurrent keys the load reads.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from moonlease_settings.config import LeaseMode, MoonleaseConnectorConfig
from moonlease_connector.core.capabilities import StoreCapabilities
from moonlease_connector.core.lookup import MissReason
from tests.support.lookup_workers import (
    HASH_BLOCK,
    Layout,
    PatternStore,
    RecordingStore,
    build_lookup,
    build_upstream_lookup,
    every_possible_key,
    full_attention,
    keys_the_load_reads,
    mamba_align,
)

pytestmark = pytest.mark.compat

LAST_HIT = MoonleaseConnectorConfig.for_mode(LeaseMode.LAST_HIT_ONLY)
HYBRID_LAYOUTS = [
    Layout("full+mamba", (full_attention(), mamba_align(64)), 64, (1, 2)),
    Layout("full+mamba-eagle", (full_attention(), mamba_align(64)), 64, (1, 1), eagle=True),
    Layout("full+2mamba-unequal", (full_attention(), mamba_align(64), mamba_align(64)), 64, (1, 2, 1)),
    Layout("mamba-only", (mamba_align(64),), 64, (2,)),
    # Partial-hash hits: KV tails keyed under a later hash inside their block (physical keys).
    Layout("full-partial+mamba", (full_attention(64), mamba_align(64)), 64, (1, 2), partial_hits=True),
]


class LastHitStore(PatternStore):
    """Plays Mooncake's LastHitOnly probe under either contract; records what it leases.

    RFC 4255's selected-only contract is in no Mooncake release: this simulation is the only
    way to run it. Mooncake 0.3.14's per-key contract also runs against the real store
    (tests/connector/test_last_hit_real_store.py)."""

    def __init__(self, answer_for: dict[str, int], contract: str) -> None:
        super().__init__(dict(answer_for))
        self.contract = contract
        self.last_hit_leased: set[str] = set()

    def batch_probe_key(self, keys: list[str], policy: str = "none", candidate_size: int = 1) -> list[int]:
        answers = super().batch_probe_key(keys, policy, candidate_size)
        if policy != "LastHitOnly":
            return answers
        groups = [answers[i:i + candidate_size] for i in range(0, len(answers), candidate_size)]
        complete = [i for i, group in enumerate(groups) if all(a == 1 for a in group)]
        if complete:
            chosen = complete[-1]
            self.last_hit_leased |= {key for key in keys[chosen * candidate_size:(chosen + 1) * candidate_size]
                                     if not key.startswith("moonlease-contract-probe")}
        if self.contract == "selected-only":
            return [1 if complete and i // candidate_size == complete[-1] else 0 for i in range(len(keys))]
        return answers


def last_hit_worker(layout: Layout, store: PatternStore, config=LAST_HIT):
    """Our lookup as the worker's start-up leaves it: the store's contract detected from its
    answers (the version string says nothing), then the store's call record cleared."""
    lookup = build_lookup(layout, store, config,
                          capabilities=StoreCapabilities("unknown", True, ("none", "LastHitOnly")))
    assert lookup.probe_contract is not None and lookup.probe_contract.contract is not None
    store.calls.clear()
    return lookup


@st.composite
def cases(draw: st.DrawFn):
    layout = draw(st.sampled_from(HYBRID_LAYOUTS))
    num_hashes = draw(st.integers(min_value=1, max_value=40))
    hashes = [bytes([index, 9]) * 4 for index in range(num_hashes)]
    num_tokens = draw(st.integers(min_value=1, max_value=num_hashes * HASH_BLOCK))
    if num_hashes * HASH_BLOCK >= 64 and draw(st.integers(0, 2)) == 0:
        # Often a prompt that ends on a checkpoint: the state at num_tokens decides whether
        # upstream re-runs its rule for the final token (core.last_hit.plan_hit_passes).
        num_tokens = 64 * draw(st.integers(min_value=1, max_value=num_hashes * HASH_BLOCK // 64))
    rng = random.Random(draw(st.integers(min_value=0, max_value=2**32 - 1)))
    density = draw(st.sampled_from([1.0, 1.0, 0.95, 0.8, 0.5]))
    pattern = {key: int(rng.random() < density) for key in every_possible_key(layout, hashes)}
    contract = draw(st.sampled_from(["per-key-existence", "selected-only"]))
    return layout, num_tokens, hashes, pattern, contract


def partial_hits_final_state_case() -> tuple:
    """Found by a random run: partial-hash hits, a 256-token prompt whose state at 256 is
    missing but whose state at 240 exists. Upstream stays in its first pass and hits 240 (the KV
    block [192, 256) is keyed at 256); bounding the checkpoints by the recompute pass (as if the
    state at 256 existed) gave 192."""
    layout = next(layout for layout in HYBRID_LAYOUTS if layout.name == "full-partial+mamba")
    pattern = json.loads((Path(__file__).parent / "data" / "last_hit_partial_hits_divergence.json").read_text())
    hashes = [bytes([index, 9]) * 4 for index in range(28)]
    return layout, 256, hashes, pattern, "per-key-existence"


def with_final_state(case: tuple, present: int) -> tuple:
    """The same case with every key of the state at num_tokens set to `present`."""
    layout, num_tokens, hashes, pattern, contract = case
    final_hash = hashes[num_tokens // HASH_BLOCK - 1].hex()
    recurrent = [gid for gid, spec in enumerate(layout.specs) if type(spec).__name__ == "MambaSpec"]
    changed = dict(pattern)
    changed.update({key: present for key in pattern
                    if key.endswith(final_hash) and any(f"@group:{gid}@" in key for gid in recurrent)})
    return layout, num_tokens, hashes, changed, contract


PARTIAL_HITS_CASE = partial_hits_final_state_case()


# Random examples every run; cases random runs found in the past stay as fixed examples.
@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
@example(PARTIAL_HITS_CASE)
@example(with_final_state(PARTIAL_HITS_CASE, 1))
@example(PARTIAL_HITS_CASE[:4] + ("selected-only",))
@example(with_final_state(PARTIAL_HITS_CASE, 1)[:4] + ("selected-only",))
def test_last_hit_only_hit_equals_upstream_and_leases_one_checkpoint(case) -> None:
    layout, num_tokens, hashes, pattern, contract = case
    upstream_store = RecordingStore(pattern)
    upstream = build_upstream_lookup(layout, upstream_store)(num_tokens, hashes)

    store = LastHitStore(pattern, contract)
    worker = last_hit_worker(layout, store)
    assert worker.probe_contract.contract.value == contract
    ours = worker.lookup(num_tokens, hashes)
    event(f"{layout.name}: {'hit' if ours.hit_length else 'miss'}")

    assert (ours.hit_length, ours.tail_key_boundaries) == (upstream.hit_length, upstream.tail_key_boundaries)
    recurrent_ids = {gid for gid, spec in enumerate(layout.specs) if type(spec).__name__ == "MambaSpec"}
    is_recurrent = lambda key: any(f"@group:{gid}@" in key for gid in recurrent_ids)  # noqa: E731
    leased_by_exist = store.leased_keys()
    assert not any(is_recurrent(key) for key in leased_by_exist), "recurrent keys never go to batch_is_exist"
    # KV keys may be leased by batch_is_exist or inside a selected LastHitOnly candidate (the
    # one-candidate call: KV keys + one checkpoint); either way exactly upstream's KV leases.
    leased = leased_by_exist | store.last_hit_leased
    upstream_kv_leased = {key for name, keys in upstream_store.calls if name == "batch_is_exist"
                          for key in keys if pattern.get(key, 0) == 1 and not is_recurrent(key)}
    assert {key for key in leased if not is_recurrent(key)} == upstream_kv_leased
    recurrent_leased = {key for key in leased if is_recurrent(key)}
    reads = keys_the_load_reads(worker, hashes, ours)
    recurrent_reads = {key for key in reads if is_recurrent(key)}
    if ours.hit_length:
        assert recurrent_leased == recurrent_reads
    else:
        assert len(recurrent_leased) <= sum(layout.namespaces[g] for g in recurrent_ids)


@pytest.mark.parametrize("answer", [None, "short", "error-code", "two-selected"])
def test_a_broken_last_hit_answer_is_a_miss(answer) -> None:
    layout = HYBRID_LAYOUTS[0]
    hashes = [bytes([index, 9]) * 4 for index in range(16)]
    pattern = {key: 1 for key in every_possible_key(layout, hashes)}

    class Broken(LastHitStore):
        def batch_probe_key(self, keys, policy="none", candidate_size=1):
            if keys[0].startswith("moonlease-contract-probe"):
                return super().batch_probe_key(keys, policy, candidate_size)
            if answer is None:
                raise RuntimeError("master unreachable")
            if answer == "short":
                return [1] * (len(keys) - 1)
            if answer == "error-code":
                return [-600] * len(keys)
            if len(keys) == candidate_size:
                # The last checkpoint, asked about alone first: "not complete", so the lookup
                # goes on to probe the others together.
                return [0] * len(keys)
            return [1] * len(keys)  # every candidate "selected": breaks RFC 4255

    store = Broken(pattern, "selected-only")
    worker = last_hit_worker(layout, store)
    answer = worker.lookup(len(hashes) * HASH_BLOCK, hashes)
    assert answer.hit_length == 0
    assert answer.outcome.miss_reason is MissReason.STORE_ERROR
    assert not any("@group:1@" in key for name, keys in store.calls if name == "batch_is_exist" for key in keys), \
        "no lease-renewing existence fallback for recurrent keys"


def test_a_hybrid_sibling_gets_a_junction_in_last_hit_only_mode() -> None:
    """Full attention holds the shared prefix; the only recurrent state is at the other prompt's
    end, so there is no hit, but the lookup reports where the shared prefix stops (seed 004)."""
    from moonlease_connector.core.lookup_protocol import parse_wire_entries

    layout = HYBRID_LAYOUTS[0]  # full attention (16-token blocks) + Mamba (64-token checkpoints)
    config = MoonleaseConnectorConfig.for_mode(LeaseMode.LAST_HIT_ONLY, junction_retention=True)
    stored = [bytes([i]) * 8 for i in range(16)]                      # prompt A, 256 tokens
    sibling = stored[:8] + [bytes([100 + i]) * 8 for i in range(8)]  # shares 128 tokens
    answers = {f"tiny@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{h.hex()}": 1 for h in stored}
    answers.update({f"tiny@tp_rank:{rank}@pcp0@dcp0@pp_rank:0@group:1@{stored[15].hex()}": 1
                    for rank in range(2)})
    store = LastHitStore(answers, "per-key-existence")
    worker = last_hit_worker(layout, store, config)
    result = worker.lookup(len(sibling) * HASH_BLOCK, sibling)
    assert result.hit_length == 0
    response = parse_wire_entries(0, [(b.group_id, b.num_tokens) for b in result.tail_key_boundaries])
    assert response.junctions == (128,)
    assert store.last_hit_leased == set(), "no recurrent state of the sibling's prefix exists"


@pytest.mark.parametrize(("final_present", "upstream_hit"), [(0, 240), (1, 192)])
def test_the_state_at_num_tokens_picks_upstreams_pass_and_is_asked_without_a_lease(
        final_present, upstream_hit) -> None:
    """Partial-hash hits: whether upstream re-runs its hit rule for the final token depends on
    the state at num_tokens, and the two runs disagree here (240 vs 192); ours asks about that
    state with a lease-free probe and lands where upstream lands."""
    layout, num_tokens, hashes, pattern, contract = with_final_state(PARTIAL_HITS_CASE, final_present)
    upstream = build_upstream_lookup(layout, RecordingStore(pattern))(num_tokens, hashes)
    store = LastHitStore(pattern, contract)
    worker = last_hit_worker(layout, store)
    ours = worker.lookup(num_tokens, hashes)
    assert upstream.hit_length == upstream_hit
    assert (ours.hit_length, ours.tail_key_boundaries) == (upstream.hit_length, upstream.tail_key_boundaries)
    final_hash = hashes[num_tokens // HASH_BLOCK - 1].hex()
    final_probes = [keys for name, keys in store.calls if name == "batch_probe_key:none:1"]
    assert final_probes and all(key.endswith(final_hash) for key in final_probes[0])
    assert not any(key.endswith(final_hash) for key in store.last_hit_leased | store.leased_keys()
                   if "@group:1@" in key), "the state at num_tokens is never leased"
