"""`moonlease bench generate|replay`: argument parsing and the run's files. I/O.

Imported by `moonlease.cli` only when a bench subcommand runs (the operator image has no
vLLM); the subparsers themselves import nothing heavy.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path("benchmarks/results/replay.md")
DEFAULT_WORKLOADS = ("agentic-swa", "agentic-hybrid")


def _floats(text: str) -> tuple[float, ...]:
    return tuple(float(x) for x in text.split(","))


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _names(text: str) -> tuple[str, ...]:
    return tuple(x for x in text.split(",") if x)


def _knob(text: str) -> tuple[str, str]:
    name, _, value = text.partition("=")
    if not value:
        raise argparse.ArgumentTypeError(f"--knob wants NAME=VALUE, got {text!r}")
    return name, value


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", default="agentic-swa",
                        help="preset: agentic-swa, agentic-hybrid, agentic-full (default agentic-swa)")
    parser.add_argument("--seed", type=int, default=1, help="random seed (default 1)")
    parser.add_argument("--knob", type=_knob, action="append", default=[], metavar="NAME=VALUE",
                        help="override a generator knob (repeatable), e.g. p_branch=0.3, "
                             "pause_s=60,3600; see moonlease_dev/bench/workload.py")
    parser.add_argument("--out", type=Path, required=True, help="trace file (.jsonl or .jsonl.gz)")


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--trace", type=Path, action="append", default=[],
                        help="trace file to replay (repeatable); default: generate --workloads")
    parser.add_argument("--workloads", type=_names, default=DEFAULT_WORKLOADS,
                        help="presets to generate and replay when no --trace is given "
                             "(default agentic-swa,agentic-hybrid)")
    parser.add_argument("--seed", type=int, default=1, help="seed of generated traces (default 1)")
    parser.add_argument("--knob", type=_knob, action="append", default=[], metavar="NAME=VALUE",
                        help="override a generator knob of every generated trace (repeatable), e.g. "
                             "p_resend=0 for the traces drawn before exact re-sends existed")
    parser.add_argument("--capacities", type=_floats,
                        help="shares of the trace's stored bytes that fit below the watermark "
                             "(default 0.05,0.15,0.4: high, medium, low pressure)")
    parser.add_argument("--modes", type=_names,
                        help="lease modes (default: every one that applies to the layout): leaseAll, "
                             "selective, lastHitOnly, leaseAll+junctions, selective+junctions, and "
                             "Moonlease retention: <leaseMode>[+junctions]+pin[+skip], leaseAll+skip "
                             "(moonlease_dev.bench.replay.MODES)")
    parser.add_argument("--wall-s-per-run", type=float,
                        help="wall seconds one mode's replay of a trace takes (default 25); sets "
                             "the time scale and so the scaled lease TTL")
    parser.add_argument("--repeats", type=int,
                        help="fresh runs per mode and capacity (default 1); the report shows the range")
    parser.add_argument("--lease-ttl-s", type=float, help="production lease TTL to scale (default 10)")
    parser.add_argument("--soft-pin-ttl-s", type=float,
                        help="production default_kv_soft_pin_ttl to scale (default 1800, Mooncake's)")
    parser.add_argument("--watermark", type=float, help="eviction_high_watermark_ratio (default 0.8)")
    parser.add_argument("--eviction-ratio", type=float,
                        help="the master's eviction_ratio: the share of its objects one eviction pass "
                             "removes (default 0.05, Mooncake's)")
    parser.add_argument("--engines",
                        help="the fleet sharing the store: <prefill>p<decode>d (e.g. 4p1d) or a count N "
                             "(N-1 prefill + 1 decode; 1: one engine alone); default 4p1d")
    parser.add_argument("--routing", choices=("session", "random", "round-robin"),
                        help="how requests reach engines: session (a session's turns to one engine), "
                             "random, round-robin (default session)")
    parser.add_argument("--value-bytes", type=_ints, metavar="ATTENTION,RECURRENT",
                        help="stand-in value sizes in bytes (default 16384,65536); smaller values put "
                             "more objects in the store at the same capacity (production density)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help=f"markdown report; raw .json and PNGs beside it (default {DEFAULT_OUT})")
    parser.add_argument("--log-dir", type=Path, help="server logs (default: a temp dir under the report's)")
    parser.add_argument("--keep-logs", action="store_true", help="keep server logs after a good run")
    parser.add_argument("--render", type=Path, metavar="JSON",
                        help="only rewrite the report and plots from an earlier run's raw JSON")


def _coerce(value: str, current: Any) -> Any:
    if isinstance(current, tuple):
        return tuple(type(current[0])(v) for v in value.split(","))
    if isinstance(current, bool):
        return value.lower() in ("1", "true", "yes")
    return type(current)(value)


def _build_preset_trace(workload: str, seed: int, overrides: list[tuple[str, str]]) -> Any:
    """A preset's trace with `--knob` overrides (a clear error for an unknown preset or knob)."""
    from moonlease_dev.bench.workload import WORKLOADS, build_trace

    if workload not in WORKLOADS:
        raise SystemExit(f"unknown workload {workload!r}; known: {', '.join(WORKLOADS)}")
    knobs = WORKLOADS[workload]
    known = {f.name for f in fields(knobs)}
    for name, value in overrides:
        if name not in known:
            raise SystemExit(f"unknown knob {name!r}; known: {', '.join(sorted(known))}")
        knobs = replace(knobs, **{name: _coerce(value, getattr(knobs, name))})
    return build_trace(knobs, seed=seed, workload=workload)


def run_generate(args: argparse.Namespace) -> int:
    from moonlease_dev.bench.trace import write_trace

    trace = _build_preset_trace(args.workload, args.seed, args.knob)
    write_trace(trace, args.out)
    print(f"{args.out}: {len(trace.requests)} requests over {trace.span_s / 60:.0f} virtual minutes",
          file=sys.stderr)
    return 0


def write_report(results: dict[str, Any], out: Path, report_module: str = "moonlease_dev.bench.report") -> None:
    """The raw JSON, the markdown and the plots of one run, side by side; `report_module` names
    the module with the run kind's `render_markdown` and `write_plots` (replay or serve)."""
    import importlib

    report = importlib.import_module(report_module)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    out.write_text(report.render_markdown(results, plot_prefix=out.stem))
    report.write_plots(results, out.parent, plot_prefix=out.stem)
    print(f"report: {out}", file=sys.stderr)


def run_replay(args: argparse.Namespace) -> int:
    if args.eviction_ratio is not None and not 0 < args.eviction_ratio <= 1:
        raise SystemExit("--eviction-ratio is a share of the master's objects: in (0, 1]")
    if args.render is not None:
        write_report(json.loads(args.render.read_text()), args.out)
        return 0
    # Quiet the in-process Mooncake client's INFO lines (they would break the progress bar);
    # must be set before the library loads.
    os.environ.setdefault("GLOG_minloglevel", "1")
    from moonlease_dev import devenv

    devenv.preload()
    from tqdm import tqdm

    from moonlease_dev.bench.environment import fetch_environment
    from moonlease_dev.bench.fleet import parse_fleet
    from moonlease_dev.bench.replay import MODES, ReplaySettings, count_runs, run_trace, settings_record
    from moonlease_dev.bench.saves import ValueSizes
    from moonlease_dev.bench.trace import read_trace

    settings = ReplaySettings()
    chosen = {"capacities": args.capacities, "modes": args.modes, "wall_s_per_run": args.wall_s_per_run,
              "lease_ttl_s": args.lease_ttl_s, "soft_pin_ttl_s": args.soft_pin_ttl_s, "watermark": args.watermark,
              "eviction_ratio": args.eviction_ratio, "repeats": args.repeats}
    settings = replace(settings, **{k: v for k, v in chosen.items() if v is not None})
    if args.engines is not None or args.routing is not None:
        settings = replace(settings, engines=args.engines or settings.engines,
                           routing=args.routing or settings.routing)
    try:
        parse_fleet(settings.engines)
    except ValueError as error:
        raise SystemExit(str(error)) from None
    if args.value_bytes is not None:
        if len(args.value_bytes) != 2 or min(args.value_bytes) <= 0:
            raise SystemExit("--value-bytes wants two positive sizes: ATTENTION,RECURRENT")
        settings = replace(settings, sizes=ValueSizes(*args.value_bytes))
    unknown = [m for m in settings.modes if m not in MODES]
    if unknown:
        raise SystemExit(f"unknown mode(s) {', '.join(unknown)}; known: {', '.join(MODES)}")
    if args.trace:
        traces = [read_trace(path) for path in args.trace]
    else:
        traces = [_build_preset_trace(name, args.seed, args.knob) for name in args.workloads]
    started = time.monotonic()
    log_root = args.log_dir or args.out.parent / "tmp"
    log_root.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="replay-", dir=log_root))
    print(f"logs: {log_dir} (kept only if the run fails or with --keep-logs)", file=sys.stderr)
    repo = Path(__file__).resolve().parents[2]
    environment = fetch_environment(repo)
    load_before = os.getloadavg()[0]
    with tqdm(total=count_runs(traces, settings), desc="replay", unit="req", file=sys.stderr) as progress:
        runs = [run_trace(trace, settings, log_dir, progress) for trace in traces]
    environment["load_average"] = (f"{load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end "
                                   "(1-minute; shared machine)")
    command = "moonlease bench replay " + " ".join(sys.argv[3:]) if sys.argv[1:3] == ["bench", "replay"] \
        else "moonlease bench replay"
    results = {"command": command.strip(), "environment": environment, "settings": settings_record(settings),
               "wall_seconds": time.monotonic() - started, "traces": runs}
    write_report(results, args.out)
    if not args.keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    return 0
