"""A generator of agentic multi-turn traces. Pure and seeded: same knobs + seed, same trace.

The model of an agent fleet, every knob in `WorkloadKnobs`:
- **shared system prompts**: `agents` of them, `system_blocks` long; every new session starts
  with one (all sessions of an agent share that prefix);
- **sessions**: arrive as a Poisson process (`sessions_per_min`); each runs a geometric number
  of turns (mean `mean_turns`); a turn's prompt is the previous prompt, the answer
  (`output_blocks`) and a new user/tool message (`turn_blocks`);
- **resumes**: between turns a session thinks for `think_s` seconds (log-uniform), or, with
  `p_pause`, pauses for `pause_s` (log-uniform: "seconds to many minutes") and then resumes
  its whole context;
- **sibling branches**: with `p_branch` a new session forks an existing one at an earlier
  prompt boundary (parallel agents, retries, tree search) and continues from there;
- **very long contexts**: with `p_long` a new session starts with a document of `long_blocks`;
- **exact re-sends**: with `p_resend` a request is sent again, token for token, `resend_s`
  seconds later (log-uniform) — a client retry after a timeout, a "regenerate", the same
  question asked twice. The re-send is its own request (kind `resend`) and does not move its
  session on. Re-sends draw from a generator of their own, so turning them on only adds
  requests to the trace the same seed draws without them. Off by default; the presets send
  5 % of requests again within a minute;
- **layout** and **retention**: the model's KV-cache groups (`moonlease_dev.bench.workers.LAYOUTS`:
  `full`, `full+swa`, `full+mamba`, ...) and which tails/states a prompt stores, written into
  the trace header for the replay.

`WORKLOADS` names the presets the committed benchmark runs.
"""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import asdict, dataclass, field, replace

from moonlease_dev.bench.trace import Trace, TraceHeader, TraceRequest

HASH_BYTES = 16


@dataclass(frozen=True)
class WorkloadKnobs:
    layout: str = "full+swa"
    retention: str = "sparse"
    duration_s: float = 3600.0  # virtual seconds of arrivals
    sessions_per_min: float = 2.0
    agents: int = 4
    system_blocks: int = 48  # 16-token blocks
    first_blocks: tuple[int, int] = (8, 32)  # a new session's first user message
    turn_blocks: tuple[int, int] = (2, 8)  # each later user/tool message
    output_blocks: tuple[int, int] = (2, 16)  # each answer (becomes part of the next prompt)
    mean_turns: float = 8.0
    think_s: tuple[float, float] = (3.0, 60.0)
    p_pause: float = 0.2
    pause_s: tuple[float, float] = (120.0, 1800.0)
    p_branch: float = 0.15
    p_long: float = 0.05
    long_blocks: tuple[int, int] = (256, 768)
    hash_block_tokens: int = 16
    p_resend: float = 0.0  # share of requests sent again exactly (retries, regenerations)
    resend_s: tuple[float, float] = (2.0, 60.0)  # seconds until the re-send (log-uniform)


#: The presets: sliding-window model under vLLM's default sparse retention (where junction
#: retention applies), and a hybrid Mamba model storing a state at every boundary (seed 002's
#: per-boundary deployment; where last-hit-only applies).
#: Every preset re-sends `PRESET_RESEND` of its requests exactly (retries, regenerations).
PRESET_RESEND = 0.05

WORKLOADS: dict[str, WorkloadKnobs] = {
    "agentic-swa": WorkloadKnobs(layout="full+swa", retention="sparse", p_resend=PRESET_RESEND),
    "agentic-hybrid": WorkloadKnobs(layout="full+mamba", retention="dense", p_resend=PRESET_RESEND),
    "agentic-full": WorkloadKnobs(layout="full", retention="sparse", p_resend=PRESET_RESEND),
    # Issue 21's third shape: many short chat sessions over two very hot system prompts, and
    # long-document questions (a fresh 2k-8k-token document, then a follow-up or two) that
    # stream through the store without being read again by anyone else; a hybrid model storing
    # a state at every boundary, like `agentic-hybrid`.
    "hot-prompts-docs": WorkloadKnobs(layout="full+mamba", retention="dense", sessions_per_min=6.0,
                                      agents=2, system_blocks=64, first_blocks=(2, 8),
                                      turn_blocks=(1, 4), output_blocks=(2, 8), mean_turns=2.5,
                                      think_s=(3.0, 30.0), p_pause=0.1, pause_s=(60.0, 900.0),
                                      p_branch=0.05, p_long=0.3, long_blocks=(128, 512),
                                      p_resend=PRESET_RESEND),
}


@dataclass
class _Session:
    name: str
    context: list[str]
    turns_left: int
    boundaries: list[int] = field(default_factory=list)  # earlier prompts' lengths, in blocks


def _log_uniform(rng: random.Random, bounds: tuple[float, float]) -> float:
    low, high = bounds
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def build_trace(knobs: WorkloadKnobs, *, seed: int, workload: str = "custom") -> Trace:
    """Draw the trace (pure: a seeded `random.Random`, no clock, no I/O)."""
    rng = random.Random(seed)
    # Re-sends draw from their own generator: turning them on adds requests to the trace the
    # same seed draws without them, and changes nothing else.
    resend_rng = random.Random(f"{seed}-resend")

    def fresh(count: int) -> list[str]:
        return [rng.randbytes(HASH_BYTES).hex() for _ in range(count)]

    system_prompts = [fresh(knobs.system_blocks) for _ in range(knobs.agents)]
    sessions: list[_Session] = []
    pending: list[tuple[float, int, int, str]] = []  # (time, order, session index, kind)
    resends: dict[int, tuple[tuple[str, ...], int]] = {}  # order -> (prompt, output tokens)
    order = 0

    def schedule(at: float, index: int, kind: str) -> int:
        nonlocal order
        heapq.heappush(pending, (at, order, index, kind))
        order += 1
        return order - 1

    def turns() -> int:
        # Geometric with mean `mean_turns`, at least 1.
        p = 1.0 / max(1.0, knobs.mean_turns)
        return 1 + int(math.log(1.0 - rng.random()) / math.log(1.0 - p)) if p < 1 else 1

    def start_session(at: float) -> None:
        draw = rng.random()
        forkable = [s for s in sessions if len(s.boundaries) >= 2]
        if draw < knobs.p_branch and forkable:
            parent = rng.choice(forkable)
            cut = rng.choice(parent.boundaries[:-1])
            context, kind = parent.context[:cut] + fresh(rng.randint(*knobs.turn_blocks)), "branch"
        elif draw < knobs.p_branch + knobs.p_long:
            context = list(rng.choice(system_prompts)) + fresh(rng.randint(*knobs.long_blocks))
            kind = "long"
        else:
            context = list(rng.choice(system_prompts)) + fresh(rng.randint(*knobs.first_blocks))
            kind = "new"
        sessions.append(_Session(f"s{len(sessions)}", context, turns()))
        schedule(at, len(sessions) - 1, kind)

    # One event queue: session arrivals (index -1) and requests, in time order, so a branch
    # forks what its parent had sent by then.
    schedule(rng.expovariate(knobs.sessions_per_min / 60.0), -1, "arrival")
    requests: list[TraceRequest] = []
    while pending:
        at, number, index, kind = heapq.heappop(pending)
        if at >= knobs.duration_s:
            continue
        if index < 0:
            start_session(at)
            schedule(at + rng.expovariate(knobs.sessions_per_min / 60.0), -1, "arrival")
            continue
        session = sessions[index]
        if kind == "resend":
            prompt, output_tokens = resends.pop(number)
            requests.append(TraceRequest(round(at, 3), session.name, prompt, output_tokens, kind))
            continue
        output_blocks = rng.randint(*knobs.output_blocks)
        requests.append(TraceRequest(round(at, 3), session.name, tuple(session.context),
                                     output_blocks * knobs.hash_block_tokens, kind))
        if knobs.p_resend > 0 and resend_rng.random() < knobs.p_resend:
            later = schedule(at + _log_uniform(resend_rng, knobs.resend_s), index, "resend")
            resends[later] = (tuple(session.context), output_blocks * knobs.hash_block_tokens)
        session.boundaries.append(len(session.context))
        session.turns_left -= 1
        if session.turns_left <= 0:
            continue
        session.context = session.context + fresh(output_blocks) + fresh(rng.randint(*knobs.turn_blocks))
        if rng.random() < knobs.p_pause:
            schedule(at + _log_uniform(rng, knobs.pause_s), index, "resume")
        else:
            schedule(at + _log_uniform(rng, knobs.think_s), index, "turn")
    header = TraceHeader(workload=workload, layout=knobs.layout, retention=knobs.retention,
                         hash_block_tokens=knobs.hash_block_tokens, seed=seed,
                         knobs={k: list(v) if isinstance(v, tuple) else v
                                for k, v in asdict(knobs).items()})
    return Trace(header, tuple(requests))


def build_named_trace(workload: str, *, seed: int, **overrides: object) -> Trace:
    """A preset from `WORKLOADS`, with knobs overridden by name."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    knobs = replace(WORKLOADS[workload], **overrides)  # type: ignore[arg-type]
    return build_trace(knobs, seed=seed, workload=workload)
