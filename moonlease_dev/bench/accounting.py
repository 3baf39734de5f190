"""Replay accounting: hit tokens, misses by the age of the missed state. Pure.

Definitions (the report's, and seed 002's "per-request audit against the trace"):
- a request's **ideal hit** is its hit against a store that never evicts (every key any
  earlier request stored): what the store *could* have served;
- its **missed tokens** are `ideal hit - hit` (never negative);
- the **age of the missed state** is the time since the state serving the ideal hit was last
  used: for each key the ideal load reads, the last time (before this request) an earlier
  request saved it (wrote it, or found it there: upstream's save checks every key it would
  write with a leasing `batch_is_exist`) or loaded it, in the never-evicting replay; the
  state's age is that of its stalest key (the hit needs every one). A lookup that only passes
  over a key does not count as a use: that is the lease modes' difference, and the age must
  not depend on mode.
Misses are reported in points of prompt tokens, bucketed `< 2 min`, `2-10 min`, `> 10 min`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from moonlease_dev.bench.stats import percentile

#: (label, lower bound inclusive, upper bound exclusive), seconds.
AGE_BUCKETS: tuple[tuple[str, float, float], ...] = (
    ("< 2 min", 0.0, 120.0),
    ("2-10 min", 120.0, 600.0),
    ("> 10 min", 600.0, float("inf")),
)


def age_bucket(age_s: float) -> str:
    for label, low, high in AGE_BUCKETS:
        if low <= age_s < high:
            return label
    raise ValueError(f"age {age_s} s is negative")


def state_age(load_keys: Iterable[str], last_use: Mapping[str, float], now: float) -> float | None:
    """Seconds since the stalest key of the state was last stored or loaded; None if no key."""
    stalest = min(map(last_use.__getitem__, load_keys), default=None)
    return None if stalest is None else now - stalest


@dataclass(frozen=True)
class RequestAccount:
    """One replayed request, as the accounting needs it."""

    prompt_tokens: int
    ideal_hit: int
    hit: int
    state_age_s: float | None  # of the ideal hit's state; None when the ideal hit is 0

    @property
    def missed_tokens(self) -> int:
        return max(0, self.ideal_hit - self.hit)


@dataclass(frozen=True)
class HitSummary:
    requests: int
    prompt_tokens: int
    hit_tokens: int
    ideal_tokens: int
    missed_by_age: dict[str, int]  # missed tokens per age bucket
    above_ideal: int  # requests whose hit exceeded the ideal (should be 0; shown if not)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ideal_rate(self) -> float:
        return self.ideal_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def missed_points(self) -> dict[str, float]:
        """Missed tokens per age bucket, in percentage points of prompt tokens."""
        total = self.prompt_tokens or 1
        return {label: 100.0 * tokens / total for label, tokens in self.missed_by_age.items()}


def summarize_hits(accounts: Sequence[RequestAccount]) -> HitSummary:
    missed = {label: 0 for label, _, _ in AGE_BUCKETS}
    for account in accounts:
        if account.missed_tokens:
            if account.state_age_s is None:
                raise ValueError("a request missed tokens of a state with no age")
            missed[age_bucket(account.state_age_s)] += account.missed_tokens
    return HitSummary(
        requests=len(accounts),
        prompt_tokens=sum(a.prompt_tokens for a in accounts),
        hit_tokens=sum(a.hit for a in accounts),
        ideal_tokens=sum(a.ideal_hit for a in accounts),
        missed_by_age=missed,
        above_ideal=sum(1 for a in accounts if a.hit > a.ideal_hit))


@dataclass
class LookupCosts:
    """Per-lookup cost samples: keys leased, store RPCs, latency."""

    keys_leased: list[int] = field(default_factory=list)
    rpcs: list[int] = field(default_factory=list)
    latency_us: list[float] = field(default_factory=list)

    def add(self, *, keys_leased: int, rpcs: int, latency_us: float) -> None:
        self.keys_leased.append(keys_leased)
        self.rpcs.append(rpcs)
        self.latency_us.append(latency_us)

    def summary(self) -> dict[str, float]:
        count = len(self.latency_us) or 1
        return {"lookups": len(self.latency_us),
                "keys_leased_per_lookup": sum(self.keys_leased) / count,
                "rpcs_per_lookup": sum(self.rpcs) / count,
                "latency_p50_us": percentile(self.latency_us, 50),
                "latency_p95_us": percentile(self.latency_us, 95)}


def summarize_survival(universe: Sequence[str], loaded: set[str], present: bytes
                       ) -> dict[str, dict[str, float]]:
    """Which of the keys the trace stores are still in the store at the end of a run. Pure.

    `universe` is every key the never-evicting replay stored, `loaded` those some of its
    lookups read, `present[i]` whether `universe[i]` is still stored (a lease-free probe).
    Two classes: `loaded`, and `passed_over` — stored but never read by any lookup (blocks
    outside a sliding window, checkpoints before the one resumed). Seed 002's mechanism is the
    gap between them: under lease-all, lookups renew the passed-over keys they find, so they
    survive eviction as well as the keys that are read; under selective lease they age out
    first.
    """
    counts = {"loaded": [0, 0], "passed_over": [0, 0]}
    for key, alive in zip(universe, present, strict=True):
        record = counts["loaded" if key in loaded else "passed_over"]
        record[0] += 1
        record[1] += 1 if alive else 0
    return {name: {"keys": keys, "present": alive, "fraction": alive / keys if keys else 0.0}
            for name, (keys, alive) in counts.items()}
