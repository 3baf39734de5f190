"""What the test bed itself costs at fleet scale (issue 16): the local API server, the simulated
Deployment controller and the simulated connectors, with no operator at all.

`benchmarks/operator_scale.py` runs the operator against this test bed; when the test bed is
busy, requests wait and the operator's figures are the test bed's. This script builds the same
fleet (realistic Deployments, resting policies) in one process and measures:

* **settle**: from the fleet's creation until the simulator and the simulated connectors have
  nothing left to do (every Deployment observed, its pods created and Ready) — or
  `--settle-timeout` seconds, whichever first (the code before issue 16 had no notion of idle:
  it always waited the timeout);
* **rest**: `--window` seconds afterwards, nothing changing: the process's CPU seconds, the
  simulator's ticks (it should tick every `--tick` s) and the event loop's worst lag (how
  late a request would be answered).

`--profile N` prints the N most expensive functions (cProfile, cumulative) of the rest window.

    .venv/bin/python benchmarks/testbed_cost.py --deployments 5000 --profile 30
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import pstats
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import operator_scale as fleet  # noqa: E402  (the fleet's objects come from the scale benchmark)

from moonlease_dev.testbed.connector_pods import ConnectorPods  # noqa: E402
from moonlease_dev.testbed.kube import local_api_server  # noqa: E402


async def _lag_probe(worst: list[float], period: float = 0.05) -> None:
    """Record how late the event loop wakes a sleeper: what any request would wait."""
    loop = asyncio.get_running_loop()
    while True:
        before = loop.time()
        await asyncio.sleep(period)
        worst[0] = max(worst[0], loop.time() - before - period)


async def measure(*, deployments: int, policies: int, window: float, settle_timeout: float, tick: float,
                  profile_top: int) -> dict[str, Any]:
    async with local_api_server(tick_interval=tick) as kube:
        connectors = ConnectorPods(kube, Path(tempfile.mkdtemp(prefix="moonlease-testbed-pods-")), interval=0.2)
        connectors.start()
        lag = [0.0]
        probe = asyncio.create_task(_lag_probe(lag))
        try:
            wall0, cpu0 = time.monotonic(), time.process_time()
            resting, _, size = await fleet._populate(kube, deployments, policies, 1, 100)
            for ns, name in resting:
                await kube.create(fleet.policy(name, ns, name.removeprefix("policy-"), approval=True))
            populate = {"wall_s": round(time.monotonic() - wall0, 1), "cpu_s": round(time.process_time() - cpu0, 1)}

            def idle() -> bool:  # (the code before issue 16's changes had no notion of idle)
                return bool(getattr(kube.simulator, "idle", False) and getattr(connectors, "idle", False))

            profiler = cProfile.Profile() if profile_top else None
            wall0, cpu0, ticks0, lag[0] = time.monotonic(), time.process_time(), kube.simulator.ticks, 0.0
            if profiler is not None:
                profiler.enable()
            while time.monotonic() - wall0 < settle_timeout and not idle():
                await asyncio.sleep(0.1)
            if profiler is not None:
                profiler.disable()
                print(f"== settle ({time.monotonic() - wall0:.1f} s)", file=sys.stderr)
                pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(profile_top)
            settle = {"wall_s": round(time.monotonic() - wall0, 1), "cpu_s": round(time.process_time() - cpu0, 1),
                      "ticks": kube.simulator.ticks - ticks0, "idle": idle(),
                      "worst_loop_lag_s": round(lag[0], 2)}
            await asyncio.sleep(1.0)  # the lag probe's sleep that spanned the settle ends

            profiler = cProfile.Profile() if profile_top else None
            wall0, cpu0, ticks0, lag[0] = time.monotonic(), time.process_time(), kube.simulator.ticks, 0.0
            if profiler is not None:
                profiler.enable()
            await asyncio.sleep(window)
            if profiler is not None:
                profiler.disable()
                print(f"== rest ({window:.1f} s)", file=sys.stderr)
            wall = time.monotonic() - wall0
            rest = {"wall_s": round(wall, 1), "cpu_s": round(time.process_time() - cpu0, 1),
                    "cpu_share": round((time.process_time() - cpu0) / wall, 3),
                    "ticks": kube.simulator.ticks - ticks0, "worst_loop_lag_s": round(lag[0], 2)}
            if profiler is not None:
                pstats.Stats(profiler, stream=sys.stderr).sort_stats("cumulative").print_stats(profile_top)
        finally:
            probe.cancel()
            await connectors.stop()
    return {"deployments": deployments, "policies": policies, "deployment_bytes_mean": size,
            "simulator_tick_s": tick, "populate": populate, "settle": settle, "rest": rest,
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deployments", type=int, default=5000)
    parser.add_argument("--policies", type=int, default=50)
    parser.add_argument("--window", type=float, default=20.0, help="seconds at rest (default 20)")
    parser.add_argument("--settle-timeout", type=float, default=120.0,
                        help="longest wait for the test bed to be idle (default 120 s)")
    parser.add_argument("--tick", type=float, default=0.5, help="simulated controller tick (s; the scale benchmark's)")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="print the N costliest functions")
    args = parser.parse_args(argv)
    result = asyncio.run(measure(deployments=args.deployments, policies=args.policies, window=args.window,
                                 settle_timeout=args.settle_timeout, tick=args.tick, profile_top=args.profile))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
