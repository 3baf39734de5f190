"""`moonlease bench serve`: argument parsing, the run's order, progress and files. I/O.

Cases run one after another (one `vllm serve` at a time: the machine's cores are the engine's),
each on a fresh master and store pool, every case of a workload replaying the same requests, so
the modes are compared side by side from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from moonlease_dev.bench.serve_plan import DEFAULT_CASES, DEFAULT_PRESSURES, SERVE_KNOBS
from moonlease_dev.bench.command import write_report

DEFAULT_OUT = Path("benchmarks/results/serve.md")


def _cases(text: str) -> Any:
    from moonlease_dev.bench.serve_plan import parse_cases

    try:
        return parse_cases(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _pressures(text: str) -> Any:
    from moonlease_dev.bench.serve_plan import parse_pressures

    try:
        return parse_pressures(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _engines(text: str) -> Any:
    from moonlease_dev.bench.serve_plan import parse_engines

    try:
        return parse_engines(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: want a whole number of at least 1")
    return value


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    default_cases = ",".join(f"{c.model}:{c.workload}:{c.label}" for c in DEFAULT_CASES)
    default_pressures = ",".join(f"{p.name}:{p.segment_mib}:{p.watermark}" for p in DEFAULT_PRESSURES)
    parser.add_argument("--cases", type=_cases, default=DEFAULT_CASES,
                        help="MODEL:WORKLOAD:MODE[+junctions][+nohandoff],... (+nohandoff: decode engines do "
                             "not wait for the prefill's save, upstream's race; default "
                             f"{default_cases})")
    parser.add_argument("--pressures", type=_pressures, default=DEFAULT_PRESSURES,
                        help="NAME:SEGMENT_MIB:WATERMARK,... store pool segment and the master's "
                             f"eviction_high_watermark_ratio (default {default_pressures})")
    parser.add_argument("--engines", type=_engines, metavar="PREFILL:DECODE",
                        help="serve each case through vllm-router with this many prefill engines "
                             "(kv_producer: look up, prefill the rest, save) and decode engines "
                             "(kv_consumer: load the prompt from the store, answer), e.g. 2:1; "
                             "default: one engine (kv_both) serving alone")
    parser.add_argument("--router-policy", default="round_robin",
                        help="vllm-router's load-balancing policy with --engines: round_robin "
                             "(default), random, consistent_hash, cache_aware or power_of_two")
    parser.add_argument("--seed", type=int, default=1, help="trace seed (default 1)")
    parser.add_argument("--duration-s", type=float, default=SERVE_KNOBS["duration_s"],
                        help=f"virtual seconds of trace arrivals (default {SERVE_KNOBS['duration_s']:g})")
    parser.add_argument("--wall-s", type=float, default=45.0,
                        help="wall seconds the trace's arrivals are scaled to (default 45)")
    parser.add_argument("--repeats", type=_positive, default=2,
                        help="replays of the trace per case and pressure, each from an empty store and "
                             "engine cache; the report pools them and shows their range (default 2)")
    parser.add_argument("--concurrency", type=int, default=4,
                        help="requests in flight at most (default 4)")
    parser.add_argument("--max-prompt-tokens", type=int, default=1536,
                        help="longer prompts of the trace are left out (default 1536)")
    parser.add_argument("--max-output-tokens", type=int, default=8,
                        help="answer length cap (default 8: TTFT is the point)")
    parser.add_argument("--kv-cache-mib", type=int,
                        help="the engine's own KV cache (default per model, about two of the longest "
                             "prompts: hybrid-serve 4 MiB, swa-serve 2 MiB; so most reuse has to come "
                             "from the store, as on a fleet where a session's next turn may land on "
                             "another engine)")
    parser.add_argument("--engine-prefix-cache", choices=("on", "off"), default="off",
                        help="the engine's own prefix cache. off (default): every reuse must come from the "
                             "store, as on a fleet where each request lands on an engine that has not seen "
                             "its prefix, so the store's contents (what the lease mode kept) decide each "
                             "hit; hybrid models keep it on whatever this says (vLLM's align mode for Mamba "
                             "needs it), with the engine's KV cache sized to about two prompts")
    parser.add_argument("--lease-ttl-ms", type=int, default=2000,
                        help="the master's default_kv_lease_ttl (default 2000)")
    parser.add_argument("--calibrate-tokens", type=int, default=1024,
                        help="prompt length of the prefill-vs-load measurement per model (0: skip)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"markdown report; raw .json and PNGs beside it (default {DEFAULT_OUT})")
    parser.add_argument("--log-dir", type=Path, help="server logs (default: a temp dir beside the report)")
    parser.add_argument("--keep-logs", action="store_true", help="keep server logs after a good run")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="only rewrite the report and plots from an earlier run's raw JSON")
    parser.add_argument("--notes", type=Path, metavar="MARKDOWN",
                        help="a paragraph on what the run shows, kept in the raw JSON and printed "
                             "under 'Reading this run' (with --render: replaces the JSON's)")


def run_serve(args: argparse.Namespace) -> int:
    if args.render is not None:
        results = json.loads(args.render.read_text())
        if args.notes is not None:
            results["notes"] = args.notes.read_text()
        write_report(results, args.out, "moonlease_dev.bench.serve_report")
        return 0
    os.environ.setdefault("GLOG_minloglevel", "1")
    engines = _with_policy(args.engines, args.router_policy)
    from moonlease_dev import devenv

    devenv.preload()
    from tqdm import tqdm

    from moonlease_dev.bench.environment import fetch_environment
    from moonlease_dev.bench.serve_plan import plan_requests
    from moonlease_dev.bench.serve_run import DENSE_RETENTION_INTERVAL, KV_CACHE_MIB, run_case
    from moonlease_dev.bench.workload import build_named_trace
    from moonlease_dev.testbed.processes import ServerStartError
    from moonlease_dev.testbed.tiny_models import build_tiny_model

    def say(message: str) -> None:
        tqdm.write(message, file=sys.stderr)

    log_root = args.log_dir or args.out.parent / "tmp"
    log_root.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="serve-", dir=log_root))
    say(f"logs: {log_dir} (kept only if the run fails or with --keep-logs)")
    for model in sorted({c.model for c in args.cases}):
        say(f"model {model}: {build_tiny_model(model)}")
    knobs = {**SERVE_KNOBS, "duration_s": args.duration_s}
    plans: dict[str, Any] = {}
    for workload in sorted({c.workload for c in args.cases}):
        trace = build_named_trace(workload, seed=args.seed, **knobs)
        planned, too_long = plan_requests(trace, wall_s=args.wall_s, max_prompt_tokens=args.max_prompt_tokens,
                                          max_output_tokens=args.max_output_tokens)
        plans[workload] = (trace, planned, too_long)
        say(f"trace {workload}: {len(planned)} requests ({too_long} longer than {args.max_prompt_tokens} "
            f"tokens left out), {sum(len(p.token_ids) for p in planned)} prompt tokens, "
            f"{trace.span_s:.0f} virtual s -> {args.wall_s:g} wall s")
    environment = fetch_environment(Path(__file__).resolve().parents[2])
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    runs: list[dict[str, Any]] = []
    calibrated: set[str] = set()
    failed: list[str] = []
    total = sum(len(plans[c.workload][1]) for c in args.cases) * len(args.pressures) * args.repeats
    interrupted = False
    with tqdm(total=total, desc="serve", unit="req", file=sys.stderr) as progress:
        try:
            for pressure in args.pressures:
                for case in args.cases:
                    progress.set_postfix_str(f"{case.model} {case.label} @ {pressure.name}")
                    calibrate = args.calibrate_tokens if case.model not in calibrated else 0
                    try:
                        record = run_case(case, pressure, plans[case.workload][1], log_dir,
                                          concurrency=args.concurrency,
                                          kv_cache_mib=args.kv_cache_mib or KV_CACHE_MIB.get(case.model, 4),
                                          max_model_len=args.max_prompt_tokens + args.max_output_tokens,
                                          lease_ttl_ms=args.lease_ttl_ms, calibrate_tokens=calibrate,
                                          repeats=args.repeats,
                                          local_prefix_cache=args.engine_prefix_cache == "on",
                                          retention_interval=DENSE_RETENTION_INTERVAL
                                          if plans[case.workload][0].header.retention == "dense" else None,
                                          say=say, on_done=lambda _r: progress.update(1),
                                          engines=engines)
                    except ServerStartError as error:
                        failed.append(f"{case.model} {case.label} @ {pressure.name}: {error}")
                        say(f"  FAILED to start, skipped:\n{error}")
                        continue
                    calibrated.add(case.model)
                    summary = record["summary"]
                    cal = record.get("calibration")
                    if cal:
                        say(f"  {case.model}: prefill {cal['prefill_ms_per_token']:.2f} ms/token, store load "
                            f"at most {_num(cal['load_ms_per_token'])} ms/token ({cal['prompt_tokens']}-token "
                            f"prompt, medians of {cal['repeats']})")
                    say(f"  {case.model} {case.label} @ {pressure.name} ({args.repeats} runs pooled): TTFT p50 "
                        f"{summary['ttft_p50_s']:.2f} s, p90 {summary['ttft_p90_s']:.2f} s; store hit rate "
                        f"{_pct(summary['store_hit_rate'])}"
                        + ("" if engines is None else f" (decode loads {_pct(summary.get('decode_load_rate'))})")
                        + f"; {summary['requests_failed']} failed")
                    runs.append(record)
        except KeyboardInterrupt:
            interrupted = True
            say("interrupted: every master, pool and engine this run started is stopped; "
                "writing what was measured so far")
    environment["load_average"] = (f"{load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end "
                                   "(1-minute; shared machine)")
    command = "moonlease bench serve " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "serve"] \
        else "moonlease bench serve"
    results = {"command": command.strip(), "environment": environment, "interrupted": interrupted,
               "settings": {"seed": args.seed, "knobs": {k: list(v) if isinstance(v, tuple) else v
                                                         for k, v in knobs.items()},
                            "wall_s": args.wall_s, "repeats": args.repeats, "concurrency": args.concurrency,
                            "max_prompt_tokens": args.max_prompt_tokens,
                            "max_output_tokens": args.max_output_tokens, "kv_cache_mib": args.kv_cache_mib,
                            "lease_ttl_ms": args.lease_ttl_ms, "engine_prefix_cache": args.engine_prefix_cache,
                            "engines": None if engines is None else asdict(engines),
                            "pressures": [asdict(p) for p in args.pressures]},
               "traces": {w: {"requests": len(p), "left_out": n, "prompt_tokens": sum(len(r.token_ids) for r in p),
                              "virtual_s": t.span_s, "layout": t.header.layout}
                          for w, (t, p, n) in plans.items()},
               "wall_seconds": time.monotonic() - started, "runs": runs, "failed_cases": failed}
    if args.notes is not None:
        results["notes"] = args.notes.read_text()
    if runs:
        write_report(results, args.out, "moonlease_dev.bench.serve_report")
    if not args.keep_logs and not interrupted and not failed:
        shutil.rmtree(log_dir, ignore_errors=True)
    if interrupted:
        return 130
    return 1 if failed else 0


def _with_policy(layout: Any, policy: str) -> Any:
    """`--engines` with `--router-policy` applied (a clear exit for an unknown policy)."""
    if layout is None:
        return None
    from moonlease_dev.bench.serve_plan import EngineLayout

    try:
        return EngineLayout(layout.prefill, layout.decode, policy)
    except ValueError as error:
        raise SystemExit(f"moonlease bench serve: --router-policy: {error}") from None


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def _num(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"
