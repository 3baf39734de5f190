"""The development commands of `moonlease`: `demo` and `bench generate|replay|serve`.

A plugin of the product command line (entry-point group `moonlease.commands`, declared in
dev/pyproject.toml): installed with the development package, `moonlease demo` and `moonlease
bench ...` work as before; without it the product command line has neither. `python -m
moonlease_dev ...` runs the same command line with these commands, installed or not.
Parsing only: each command imports its modules when it runs.
"""

from __future__ import annotations

import argparse

from moonlease.cli import at_least


def _cmd_demo(args: argparse.Namespace) -> int:
    import dataclasses

    from moonlease_dev.demo import DemoOptions, run_demo

    options = DemoOptions.quick(args.workdir) if args.quick else DemoOptions(workdir=args.workdir)
    changes = {field: value for field, value in (("interval_seconds", args.interval), ("min_samples", args.min_samples),
                                                 ("max_samples", args.max_samples)) if value is not None}
    changes["second_act"] = args.second_act
    if changes.get("min_samples", options.min_samples) > changes.get("max_samples", options.max_samples):
        changes["max_samples"] = changes.get("min_samples", options.min_samples)
    return run_demo(dataclasses.replace(options, **changes))


def _cmd_bench_generate(args: argparse.Namespace) -> int:
    from moonlease_dev.bench.command import run_generate

    return run_generate(args)


def _cmd_bench_replay(args: argparse.Namespace) -> int:
    from moonlease_dev.bench.command import run_replay

    return run_replay(args)


def _cmd_bench_serve(args: argparse.Namespace) -> int:
    from moonlease_dev.bench.serve_command import run_serve

    return run_serve(args)


def _add_bench_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from moonlease_dev.bench.command import add_generate_arguments, add_replay_arguments

    bench = commands.add_parser("bench", help="lease-policy replay benchmark (traces, real store)")
    actions = bench.add_subparsers(dest="bench_command", required=True)
    generate = actions.add_parser("generate", help="write an agentic multi-turn trace (JSONL)")
    add_generate_arguments(generate)
    generate.set_defaults(func=_cmd_bench_generate)
    replay = actions.add_parser("replay", help="replay traces per lease mode against a real store")
    add_replay_arguments(replay)
    replay.set_defaults(func=_cmd_bench_replay)
    from moonlease_dev.bench.serve_command import add_serve_arguments

    serve = actions.add_parser("serve", help="TTFT per lease mode: real vllm serve engines, a real store "
                                             "under pressure, an agentic trace over the OpenAI API")
    add_serve_arguments(serve)
    serve.set_defaults(func=_cmd_bench_serve)


def _add_demo_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    demo = commands.add_parser("demo", help="run the end-to-end demo on this machine: an A/B test of "
                               "junction retention against lease-all, decided by the operator, then a bad "
                               "change it rolls back")
    demo.add_argument("--quick", action="store_true",
                      help="shorter: 5 s intervals, a shorter warm-up (about 3 minutes; what CI runs)")
    demo.add_argument("--interval", type=at_least(5), default=None,
                      help="seconds per analysis interval (default 10; 5 with --quick; at least 5)")
    demo.add_argument("--min-samples", type=at_least(2), default=None,
                      help="intervals before any verdict (default 5; 3 with --quick; at least 2)")
    demo.add_argument("--max-samples", type=at_least(2), default=None,
                      help="intervals after which an undecided test holds (default 30; 24 with --quick); "
                           "more makes the demo longer and a verdict likelier")
    demo.add_argument("--no-second-act", dest="second_act", action="store_false",
                      help="stop after the A/B verdict (skip the bad change and its rollback)")
    demo.add_argument("--workdir", default=None,
                      help="where logs, the engines' settings and the plot go (default: a temp dir)")
    demo.set_defaults(func=_cmd_demo)


def register(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """The `moonlease.commands` entry point: add `demo` and `bench` to the `moonlease` command."""
    _add_demo_parser(commands)
    _add_bench_parser(commands)
