"""The replay report: markdown tables and PNG plots from the raw results. No measuring.

`render_markdown(results)` is pure (results JSON -> text); `write_plots` draws with
matplotlib's Agg backend (files only, no display).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moonlease_dev.bench.accounting import AGE_BUCKETS

BASELINE = "leaseAll"


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _belady_for(capacity: dict[str, Any], mode: str) -> float:
    return capacity["belady"]["junctions" if "+junctions" in mode else "plain"]


def render_headline(results: dict[str, Any]) -> list[str]:
    """One sentence per workload and capacity, computed from the tables (nothing typed in)."""
    lines = ["## Headline", ""]
    for trace in results["traces"]:
        for capacity in trace["capacities"]:
            modes = capacity["modes"]
            base = modes.get(BASELINE)
            parts = []
            for name, mode in modes.items():
                delta = "" if base is None or name == BASELINE else \
                    f" ({100 * (mode['hit_rate'] - base['hit_rate']):+.2f} pt vs leaseAll)"
                parts.append(f"{name} {_pct(mode['hit_rate'])}{delta}")
            ideal = trace["ideal_rate"].get("plain", next(iter(trace["ideal_rate"].values())))
            lines.append(f"- `{trace['workload']}` at capacity {capacity['fits']:.2f} "
                         f"(Belady {_pct(capacity['belady']['plain'])}, ideal {_pct(ideal)}): "
                         + ", ".join(parts) + ".")
    lines.append("")
    return lines


def _hit_cell(mode: dict[str, Any]) -> str:
    runs = mode.get("hit_rate_runs", [])
    if len(runs) > 1:
        return f"{_pct(mode['hit_rate'])} ({_pct(min(runs))}–{_pct(max(runs))})"
    return _pct(mode["hit_rate"])


def _survival_cell(mode: dict[str, Any]) -> str:
    """Shares of the stored keys alive at the end of the run (runs before survival was
    recorded show a dash)."""
    survival = mode.get("survival")
    if not survival:
        return "–"
    return f"{_pct(survival['loaded']['fraction'])} / {_pct(survival['passed_over']['fraction'])}"


def render_losses(results: dict[str, Any]) -> list[str]:
    """Every cell where a mode does worse than lease-all, overall or in one age bucket."""
    buckets = [label for label, _, _ in AGE_BUCKETS]
    repeats = results["settings"].get("repeats", 1)
    lines = ["## Where a mode loses to leaseAll", "",
             "Computed from the tables below: each cell where a mode's hit rate is below "
             "leaseAll's, then each age bucket in which it missed more (points of prompt tokens). "
             + ("One run per cell (`replay_spread.md` repeats some cells, to show how far a rerun "
                "moves them)." if repeats == 1 else
                f"{repeats} runs per cell; hit rates are means (range across runs in the tables)."),
             ""]
    overall, by_bucket = [], []
    for trace in results["traces"]:
        for capacity in trace["capacities"]:
            base = capacity["modes"].get(BASELINE)
            if base is None:
                continue
            for name, mode in capacity["modes"].items():
                if name == BASELINE:
                    continue
                where = f"`{trace['workload']}` at {capacity['fits']:.2f}, {name}"
                if mode["hit_rate"] < base["hit_rate"]:
                    overall.append(f"- {where}: {_pct(mode['hit_rate'])} vs {_pct(base['hit_rate'])} "
                                   f"({100 * (mode['hit_rate'] - base['hit_rate']):+.2f} pt).")
                worse = [f"{b} {mode['missed_points_by_age'][b]:.2f} vs {base['missed_points_by_age'][b]:.2f}"
                         for b in buckets
                         if mode["missed_points_by_age"][b] > base["missed_points_by_age"][b] + 0.005]
                if worse:
                    by_bucket.append(f"- {where}: missed more in " + "; ".join(worse) + ".")
    lines += overall or ["- No cell: every mode's hit rate is at least leaseAll's."]
    lines += ["", "Age buckets in which a mode missed more than leaseAll (seed 002's trade-off: states "
              "only passed over by lookups are no longer protected). Junction modes' misses are "
              "counted against their own, higher ideal (junction tails stored), so they can miss "
              "states leaseAll never had:", ""]
    lines += by_bucket or ["- None."]
    lines.append("")
    return lines


#: The real master's metadata shards (no flag changes it): objects per shard = keys / this.
MASTER_SHARDS = 1024


def render_fleet(results: dict[str, Any]) -> list[str]:
    """Per workload and capacity: the fleet, its routing, each mode's decode hits and spread of
    prefill hit rates over the engines, and the master's objects per metadata shard at the end.
    Runs recorded before fleets existed (no `fleet` record) give nothing."""
    lines: list[str] = []
    for trace in results["traces"]:
        rows = []
        for capacity in trace["capacities"]:
            decode_ideal = trace.get("ideal_decode_rate", {}).get("plain")
            belady_decode = capacity.get("belady_decode", {}).get("plain")
            for name, mode in capacity["modes"].items():
                fleet = mode.get("fleet")
                if not fleet:
                    continue
                rates = fleet["engine_hit_rates"]
                decode = (f"{_pct(fleet['decode_hit_rate'])} (ideal {_pct(decode_ideal or 0.0)}, "
                          f"Belady {_pct(belady_decode or 0.0)})" if "decode_hit_rate" in fleet else "–")
                per_shard = mode["master"]["master_key_count"] / MASTER_SHARDS
                rows.append(f"| {capacity['fits']:.2f} | {name} | {_pct(mode['hit_rate'])} | "
                            f"{_pct(min(rates))}–{_pct(max(rates))} | {decode} | "
                            f"{mode['keys_removed']:g} ({fleet['removal_refused']:g}) | {per_shard:.1f} |")
        if not rows:
            continue
        lines += [f"## Fleet: `{trace['workload']}`, {trace.get('engines', '1p0d')} engines, "
                  f"routing `{trace.get('routing', 'session')}`", "",
                  "Every engine is a connector of its own (lookup, save path, retention state) on the "
                  "one store. Prefill hit rate over the fleet, its range over the prefill engines, "
                  "the decode engines' hit rate (the prompt a prefill engine just saved, looked up "
                  "again), keys evict removed (and keys it asked to remove that the master kept, "
                  "leased), and the master's objects per metadata shard at the end "
                  f"(`master_key_count` / {MASTER_SHARDS}; below about 200 the master's first "
                  "eviction pass is close to random, not oldest first).", "",
                  "| capacity | mode | prefill hit rate | per engine | decode hit rate | evict removed "
                  "(refused) | objects / shard |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: |", *rows, ""]
    return lines


def render_markdown(results: dict[str, Any], plot_prefix: str = "replay") -> str:
    env = results["environment"]
    settings = results["settings"]
    lines = [
        "# Lease-policy replay: prompt-token hit rate under store pressure, against Belady",
        "",
        f"Generated by `{results['command']}` on {env['date']} ({results['wall_seconds']:.0f} s wall). "
        "Every number below comes from that run; nothing is hand-edited.",
        "",
        "| | |", "| --- | --- |",
        *[f"| {name} | {value} |" for name, value in env.items() if name != "date"],
        "",
    ]
    lines += render_headline(results)
    lines += render_losses(results)
    lines += render_fleet(results)
    lines += [
        "## Method",
        "",
        "Each workload is a generated trace (`moonlease bench generate`, knobs below). For every "
        "lease mode that applies to its layout and every capacity, a fresh real Mooncake 0.3.14 "
        "master and store pool (loopback TCP) replays the whole trace: each request is looked up "
        "through `MoonleaseStoreWorker.lookup` in that mode (vLLM's real coordinator, no engine), "
        "then saved as upstream's worker saves (`batch_is_exist`, `put_batch` of what is "
        "missing). **Capacity** is the share of all bytes the trace ever stores that fits below "
        f"the eviction watermark (`eviction_high_watermark_ratio={settings['watermark']}`, "
        f"`eviction_ratio={settings['eviction_ratio']}`; segment at least 16 MiB). Values are "
        f"stand-ins: {settings['sizes']['attention']} B per attention block and rank, "
        f"{settings['sizes']['recurrent']} B per Mamba state and rank.",
        "",
        "**Virtual time.** Arrivals are virtual seconds; each run replays the trace "
        f"`time scale` times faster ({settings['wall_s_per_run']:g} s of wall time per run) and "
        f"the master's `default_kv_lease_ttl` is the production TTL ({settings['lease_ttl_s']:g} s) "
        "times the same scale, so the share of leased keys when eviction runs is the production "
        "one and eviction order follows the trace's time. A request the machine starts late "
        "shifts the rest of the schedule rather than letting later requests catch up back to "
        "back; `late`: how late requests started (virtual seconds, mean / max) and how much "
        "wall time the shifts added in all.",
        "",
        "**Alive at end**: after the last request, a lease-free probe (`batch_probe_key`, "
        "policy `none`) of every key the never-evicting replay stored; `loaded` are the keys some "
        "lookup of the trace reads, `passed over` the rest (sliding-window blocks outside every "
        "window, checkpoints before the one resumed, ...). Seed 002's mechanism is the gap: "
        "lease-all renews what a lookup passes over, so those keys survive as well as loaded "
        "ones; selective lease lets them age out first.",
        "",
        "**Ideal** is the hit rate against a store that never evicts; **Belady** is the hit rate "
        "when, at the same capacity in the same bytes, the store keeps what clairvoyant MIN keeps "
        "(evict the key read furthest in the future), through the same lookup and save code. "
        "With equal value sizes MIN maximizes *key* hits over every policy; for prompt-token hits "
        "(prefix-contiguous, needing a window tail or Mamba state too) and mixed sizes it is the "
        "classic reference rather than a proven bound, and it ignores leases and evicts exactly "
        "to capacity (both in its favour). **Missed** = ideal hit − hit, in points of prompt "
        "tokens, by the age of the missed state: time since the stalest key of the ideal load "
        "was last saved (written, or re-checked by a save) or loaded — lookups that only pass over "
        "a key do not count, so ages are the same in every mode — as in seed 002.",
        "",
        "**Put failures (keys)**: `put_batch` calls the store refused (in part), and the keys they "
        "did not store (a lease-free probe after the refusal; runs before this column changed "
        "counted every key of a refused call); for modes with retention `retry`, the keys still "
        "not stored after putting the refused ones again.",
        "",
    ]
    buckets = [label for label, _, _ in AGE_BUCKETS]
    for trace in results["traces"]:
        kinds = ", ".join(f"{count} {kind}" for kind, count in trace["kinds"].items())
        lines += [
            f"## `{trace['workload']}`: layout `{trace['layout']}`, {trace['retention']} retention",
            "",
            f"{trace['requests']} requests ({kinds}) over {trace['span_s'] / 60:.0f} virtual minutes, "
            f"{trace['prompt_tokens']:,} prompt tokens, {trace['stored_bytes'] / (1 << 20):.0f} MiB stored "
            f"in all; seed {trace['seed']}; time scale ×{1 / trace['time_scale']:.0f} "
            f"(lease TTL {trace['lease_ttl_ms']} ms). Ideal hit rate: "
            + ", ".join(f"{_pct(v)} ({'with junction tails' if k == 'junctions' else 'as stored'})"
                        for k, v in trace["ideal_rate"].items()) + ".",
            "",
            "| capacity (segment) | mode | hit rate | Δ vs leaseAll | of Belady | "
            + " | ".join(f"missed {b}" for b in buckets)
            + " | keys leased / lookup | lookup p50 / p95 µs | put failures (keys) | evicted keys "
            "| alive at end: loaded / passed over | late mean / max s (wall added) |",
            "| --- | --- | ---: | ---: | ---: | " + " | ".join("---:" for _ in buckets)
            + " | ---: | ---: | ---: | ---: | ---: | ---: |",
        ]
        for capacity in trace["capacities"]:
            label = f"{capacity['fits']:.2f} ({capacity['segment_mib']} MiB)"
            base = capacity["modes"].get(BASELINE)
            belady_delta = "" if base is None else \
                f"{100 * (capacity['belady']['plain'] - base['hit_rate']):+.2f} pt"
            lines.append(f"| {label} | **Belady** | {_pct(capacity['belady']['plain'])} | {belady_delta} | "
                         f"100% | " + " | ".join("" for _ in buckets) + " | | | | | | |")
            if "junctions" in capacity["belady"]:
                lines.append(f"| {label} | **Belady, junction tails stored** | "
                             f"{_pct(capacity['belady']['junctions'])} | | 100% | "
                             + " | ".join("" for _ in buckets) + " | | | | | | |")
            for name, mode in capacity["modes"].items():
                delta = "–" if base is None or name == BASELINE else \
                    f"{100 * (mode['hit_rate'] - base['hit_rate']):+.2f} pt"
                belady = _belady_for(capacity, name)
                missed = " | ".join(f"{mode['missed_points_by_age'][b]:.2f}" for b in buckets)
                lines.append(
                    f"| {label} | {name} | {_hit_cell(mode)} | {delta} | "
                    f"{_pct(mode['hit_rate'] / belady) if belady else '–'} | {missed} | "
                    f"{mode['keys_leased_per_lookup']:.0f} | {mode['latency_p50_us']:.0f} / "
                    f"{mode['latency_p95_us']:.0f} | {mode['put_failures']:g} ({mode['put_failed_keys']:g}) | "
                    f"{mode['master']['master_evicted_key_count']:.0f} | {_survival_cell(mode)} | "
                    f"{mode['lag_mean_s']:.1f} / {mode['lag_max_s']:.0f} ({mode.get('stretch_s', 0.0):.1f} s) |")
        knobs = ", ".join(f"`{k}={v}`" for k, v in trace["knobs"].items())
        lines += ["", f"Knobs: {knobs}.", ""]
    lines += [
        f"![hit rate vs capacity]({plot_prefix}_hit_rate.png)",
        "",
        f"![misses by age]({plot_prefix}_miss_age.png)",
        "",
        "## How to reproduce",
        "",
        "```bash",
        "make setup",
        f".venv/bin/{results['command']}",
        "```",
        "",
        "Traces are generated from their seeds (`moonlease bench generate --workload NAME --seed N "
        f"--out trace.jsonl` writes one to replay with `--trace`). Raw numbers: `{plot_prefix}.json` "
        f"beside this file; `--render {plot_prefix}.json --out {plot_prefix}.md` rewrites this page "
        "and the plots without measuring.",
        "",
        "## Limits",
        "",
        "- No engine: prefill time, decode KV (`save_decode_cache` off, upstream's default) and "
        "GPU-local prefix caching are not modelled; every request looks up the store. Saves "
        "happen right after the lookup, not after prefill.",
        "- One client replays requests one at a time (a fleet's engines share it; leases are the "
        "master's, per key); concurrency shows only through the trace's interleaving and the "
        "scaled lease TTL.",
        "- The machine is a shared 2-core one: latencies compare modes run the same way, not "
        "absolute capacity. The master evicts per metadata shard, so order is only approximately "
        "oldest-lease-first, in every mode alike.",
        "",
    ]
    return "\n".join(lines) + "\n"


def write_plots(results: dict[str, Any], folder: Path, plot_prefix: str = "replay") -> list[Path]:
    """`<prefix>_hit_rate.png` (hit rate vs capacity per mode, Belady and ideal lines) and
    `<prefix>_miss_age.png` (missed points by age per mode and capacity)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = results["traces"]
    hit_path, age_path = folder / f"{plot_prefix}_hit_rate.png", folder / f"{plot_prefix}_miss_age.png"
    figure, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.5), squeeze=False)
    for axis, trace in zip(axes[0], traces):
        capacities = [c["fits"] for c in trace["capacities"]]
        for name in trace["modes"]:
            axis.plot(capacities, [100 * c["modes"][name]["hit_rate"] for c in trace["capacities"]],
                      marker="o", label=name)
        axis.plot(capacities, [100 * c["belady"]["plain"] for c in trace["capacities"]],
                  "k--", marker="s", label="Belady (MIN)")
        if "junctions" in trace["capacities"][0]["belady"]:
            axis.plot(capacities, [100 * c["belady"]["junctions"] for c in trace["capacities"]],
                      "k-.", marker="D", label="Belady, junction tails stored")
        for kind, style in (("plain", ":"), ("junctions", (0, (1, 4)))):
            if kind in trace["ideal_rate"]:
                axis.axhline(100 * trace["ideal_rate"][kind], color="grey", linestyle=style,
                             label="ideal (no eviction)" + (", junction tails" if kind == "junctions" else ""))
        axis.set_xscale("log")
        axis.set_xticks(capacities, [f"{c:.2f}" for c in capacities])
        axis.minorticks_off()
        axis.set_xlabel("capacity (share of stored bytes below the watermark)")
        axis.set_ylabel("prompt-token hit rate (%)")
        axis.set_title(f"{trace['workload']} ({trace['layout']}, {trace['retention']})")
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(hit_path, dpi=110)
    plt.close(figure)

    buckets = [label for label, _, _ in AGE_BUCKETS]
    colours = ["#9ecae1", "#4292c6", "#08306b"]
    figure, axes = plt.subplots(1, len(traces), figsize=(6 * len(traces), 4.5), squeeze=False)
    for axis, trace in zip(axes[0], traces):
        labels, stacks = [], []
        for capacity in trace["capacities"]:
            for name in trace["modes"]:
                labels.append(f"{capacity['fits']:.2f}\n{name}")
                stacks.append([capacity["modes"][name]["missed_points_by_age"][b] for b in buckets])
        bottom = [0.0] * len(stacks)
        for index, (bucket, colour) in enumerate(zip(buckets, colours)):
            values = [stack[index] for stack in stacks]
            axis.bar(range(len(stacks)), values, bottom=bottom, color=colour, label=f"state age {bucket}")
            bottom = [b + v for b, v in zip(bottom, values)]
        axis.set_xticks(range(len(stacks)), labels, rotation=90, fontsize=7)
        axis.set_ylabel("missed points of prompt tokens")
        axis.set_title(f"{trace['workload']}: misses by age of the missed state")
        axis.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(age_path, dpi=110)
    plt.close(figure)
    return [hit_path, age_path]
