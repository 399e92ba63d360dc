"""The benchmark's result as files: bench.json, bench.md (tables) and two PNG plots.

Works on a saved result alone (`python -m bench run --render bench.json --out DIR`), so the
tables and plots can be drawn where matplotlib is installed, away from the GPU host.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from bench import diagnose

LABELS = {"plain": "plain", "eagle3": "EAGLE-3", "eagle3_adaptive": "EAGLE-3 adaptive (upstream)",
          "eagle3_thr": "EAGLE-3 + threshold", "eagle3_auto": "EAGLE-3 + auto"}
FIXED_MODES = ("plain", "eagle3")  # the two a threshold chooses between


def label(name: str) -> str:
    if name.startswith("eagle3_thr"):
        return f"EAGLE-3 + threshold {name.removeprefix('eagle3_thr')}"
    return LABELS.get(name, name)


def plain_step_note(st: dict[str, Any] | None) -> str:
    """What the server's plain step runs (its server info), where it says."""
    step = (st or {}).get("plain_step")
    if not isinstance(step, dict):
        return ""
    return "; plain step: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in step.items())


def per_round(ms: list[dict[str, Any]]) -> dict[int, float]:
    return {m["round"]: m["tok_per_s"] for m in ms if m.get("tok_per_s")}


def ratios_to_best(got: dict[int, float], others: list[dict[int, float]]) -> list[float]:
    """Per round: `got` over the best of `others` in that round (rounds all of them measured)."""
    return [got[k] / max(o[k] for o in others) for k in got if others and all(k in o for o in others)]


def auto_comparison(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per concurrency, auto against the alternatives a user has, each ratio taken within a round
    (median over the rounds): the better of plain and always-on EAGLE-3, and the fixed threshold
    with the highest median tokens/s at that concurrency."""
    out: dict[str, dict[str, Any]] = {}
    if "eagle3_auto" not in result.get("configs", []):
        return out
    for c, by_name in result.get("levels", {}).items():
        auto = per_round(by_name.get("eagle3_auto", []))
        if not auto:
            continue
        row: dict[str, Any] = {}
        fixed = [per_round(by_name[n]) for n in FIXED_MODES if n in by_name]
        vs = ratios_to_best(auto, fixed)
        row["vs_better_of_plain_eagle3"] = round(statistics.median(vs), 3) if vs else None
        thresholds = {n: per_round(ms) for n, ms in by_name.items() if n.startswith("eagle3_thr")}
        if thresholds:
            best = max(thresholds, key=lambda n: statistics.median(thresholds[n].values()))
            vs = ratios_to_best(auto, [thresholds[best]])
            fixed_n = best.removeprefix("eagle3_thr")
            row["best_fixed"] = int(fixed_n) if fixed_n.isdigit() else fixed_n
            row["vs_best_fixed"] = round(statistics.median(vs), 3) if vs else None
        out[c] = row
    return out


def level_table(result: dict[str, Any]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Per concurrency and config: median tokens/s over the rounds, the median of the per-round ratios
    to plain and their spread (min, max: the noise between rounds), the median accept length, the
    rounds measured."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for c, by_name in result.get("levels", {}).items():
        plain = {m["round"]: m["tok_per_s"] for m in by_name.get("plain", [])}
        row: dict[str, dict[str, float | None]] = {}
        for name, ms in by_name.items():
            ratios = [m["tok_per_s"] / plain[m["round"]] for m in ms if plain.get(m["round"])]
            accepts = [m["accept_length"] for m in ms if m.get("accept_length")]
            row[name] = {"tok_per_s": round(statistics.median(m["tok_per_s"] for m in ms), 1),
                         "vs_plain": round(statistics.median(ratios), 3) if ratios else None,
                         "vs_plain_min": round(min(ratios), 3) if ratios else None,
                         "vs_plain_max": round(max(ratios), 3) if ratios else None,
                         "accept_length": round(statistics.median(accepts), 2) if accepts else None,
                         "rounds": len(ms)}
        out[c] = row
    return out


def better_table(result: dict[str, Any]) -> dict[str, dict[str, dict[str, float | int]]]:
    """Per concurrency and switching config (a threshold, auto, adaptive): its tokens/s over the
    better of plain and always-on EAGLE-3 in the same round (the product's promise), median over
    the rounds and min-max; empty unless both plain and EAGLE-3 ran."""
    out: dict[str, dict[str, dict[str, float | int]]] = {}
    for c, by_name in result.get("levels", {}).items():
        fixed = [per_round(by_name.get(n, [])) for n in FIXED_MODES]
        if not all(fixed):
            continue
        row: dict[str, dict[str, float | int]] = {}
        for name, ms in by_name.items():
            if name in FIXED_MODES:
                continue
            ratios = ratios_to_best(per_round(ms), fixed)
            if ratios:
                row[name] = {"vs_better": round(statistics.median(ratios), 3),
                             "min": round(min(ratios), 3), "max": round(max(ratios), 3), "rounds": len(ratios)}
        if row:
            out[c] = row
    return out


def ramp_summary(result: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per config on the ramp: mean tokens/s, and per level window its share of the better of plain
    and always-on EAGLE-3 in the same window of the schedule (min and median), mode changes."""
    ramp = result.get("ramp", {})
    fixed = [ramp[n]["windows"] for n in FIXED_MODES if n in ramp]
    best = [max(ws[i]["tok_per_s"] for ws in fixed) for i in range(min(map(len, fixed)))] if fixed else []
    out = {}
    for name, r in ramp.items():
        windows = r["windows"]
        shares = [w["tok_per_s"] / b for w, b in zip(windows, best, strict=False) if b > 0]
        out[name] = {"mean_tok_per_s": round(statistics.mean(w["tok_per_s"] for w in windows), 1) if windows else None,
                     "min_share_of_better": round(min(shares), 3) if shares else None,
                     "median_share_of_better": round(statistics.median(shares), 3) if shares else None,
                     "mode_changes": r.get("mode_changes")}
    return out


def acceptance_note(state: dict[str, Any]) -> str:
    """The plugin's accept length before and after plain phases (server info), where measured."""
    acc = state.get("acceptance_around_plain") or {}
    if not acc.get("phases_measured"):
        return ""
    return (f"; accept length {acc['last_before']:.2f} in the last {acc['window_steps']} "
            f"speculative steps before a plain phase, {acc['last_after']:.2f} in the first "
            f"{acc['window_steps']} after it (worst of {acc['phases_measured']} phases: "
            f"{fmt2(acc.get('worst_after_over_before'))}x)")


def markdown(result: dict[str, Any]) -> str:
    names: list[str] = result.get("configs", [])
    model = result.get("model", {})
    lines = [f"# Decode throughput, {result.get('date', '')}", "",
             (f"Model: {model.get('size')}-shaped target ({model.get('layers')} layers, hidden {model.get('hidden')}), "
             f"{model.get('draft')} EAGLE-3 draft (designed accept length {fmt2(model.get('designed_accept_length'))}); "
             f"greedy, {result.get('output_len')} output tokens per request; for the closed loop every server up "
             "at once, each load sent to each in turn (order alternating)"
             + (f"; measured over {result['calls']} calls, the servers started again in each." if (result.get("calls") or 0) > 1
                else ".")), ""]
    table = level_table(result)
    if table:
        window = (f"; each window at least {result['window_s']:g} s and {result.get('window_waves')} requests per "
                  "client on each server" if result.get("window_s") else "")
        lines += [("Output tokens/s, closed loop (median of "
                  f"{result.get('rounds')} rounds{window}; x plain = median of the per-round ratios, then their "
                  "min-max over the rounds: the spread shows the run's noise):"), "",
                  "| concurrency | " + " | ".join(label(n) for n in names) + " |",
                  "|---:|" + "---:|" * len(names)]
        for c in sorted(table, key=int):
            rounds = max((cell.get("rounds") or 0 for cell in table[c].values()), default=0)
            partial = f" ({rounds} of {result.get('rounds')} rounds)" if rounds and rounds < (result.get("rounds") or 0) else ""
            cells = []
            for n in names:
                cell = table[c].get(n)
                if cell is None:
                    cells.append("-")
                    continue
                cells.append(f"{cell['tok_per_s']:.0f}{ratio_text(cell) if n != 'plain' else ''}")
            lines.append(f"| {c}{partial} | " + " | ".join(cells) + " |")
        lines.append("")
    better = better_table(result)
    if better:
        switching = [n for n in names if any(n in row for row in better.values())]
        lines += [("The same over the better of plain and always-on EAGLE-3 in each round (median over the "
                   "rounds, then min-max):"), "",
                  "| concurrency | " + " | ".join(label(n) for n in switching) + " |",
                  "|---:|" + "---:|" * len(switching)]
        for c in sorted(better, key=int):
            cells = [(f"{better[c][n]['vs_better']:.2f}x ({better[c][n]['min']:.2f}-{better[c][n]['max']:.2f})"
                      if n in better[c] else "-") for n in switching]
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("")
    auto = auto_comparison(result)
    if auto:
        lines += ["`auto` against the alternatives (ratios within a round, median over the rounds):", "",
                  "| concurrency | auto / better of plain and EAGLE-3 | best fixed threshold | auto / best fixed |",
                  "|---:|---:|---:|---:|"]
        for c in sorted(auto, key=int):
            a = auto[c]
            lines.append(f"| {c} | {fmt(a['vs_better_of_plain_eagle3'])} | {a.get('best_fixed', '-')} | "
                         f"{fmt(a.get('vs_best_fixed'))} |")
        lines.append("")
    ramp = ramp_summary(result)
    if ramp:
        lines += [(f"Ramp: clients step through {', '.join(map(str, result.get('concurrency', [])))} and back, "
                  f"{result.get('ramp_hold_s')} s a level; share = a level's tokens/s over the better of plain "
                  "and EAGLE-3 at the same level:"), "",
                  "| config | mean tok/s | min share | median share | mode changes |", "|---|---:|---:|---:|---:|"]
        for n in names:
            s = ramp.get(n)
            if s:
                lines.append(f"| {label(n)} | {s['mean_tok_per_s']:.0f} | {fmt(s['min_share_of_better'])} | "
                             f"{fmt(s['median_share_of_better'])} | {fmt(s['mode_changes'])} |")
        lines.append("")
    for name, info in result.get("servers", {}).items():
        lines.append(f"- {label(name)}: KV tokens in use after the load and a flush: "
                     f"{info.get('kv_used_after_flush')}; running-request limit "
                     f"{info.get('running_limit')}" + plain_step_note(info.get("speculative_disable")))
        st = info.get("speculative_disable")
        if st:
            crossover = f", crossover {st['crossover']}" if "crossover" in st else ""
            lines.append(f"- {label(name)}: threshold {st.get('threshold')}{crossover}, "
                         f"{st.get('speculative_steps')} speculative / {st.get('plain_steps')} plain steps, "
                         f"{st.get('mode_changes')} mode changes" + acceptance_note(st))
    lines += [f"- {label(n)} not run: {why}" for n, why in result.get("not_run", {}).items()]
    lines += [f"- remaining: {s}" for s in result.get("skipped", [])]
    lines += [f"- not measured: {s}" for s in result.get("not_measured", [])]
    lines += [f"- FAILED: {f.splitlines()[0]}" for f in result.get("failures", [])]
    if not result.get("failures") and (result.get("levels") or result.get("ramp")):
        compared = "plain" in result.get("servers", {}) or "plain" in result.get("configs", ())
        lines.append("- every output equal to plain decoding's; 0 request errors" if compared else
                     "- outputs NOT compared (no plain server in this run); 0 request errors")
    split = diagnose.gpu_split(result.get("levels", {}))
    if split:
        lines += ["", "GPU seconds per forward category in each window (device timer; median over rounds):", "",
                  *(f"    {line}" for line in split)]
    for name, diag in result.get("diagnose", {}).items():
        lines += ["", *diagnose.render(name, diag)]
    return "\n".join(lines).rstrip() + "\n"


def ratio_text(cell: dict[str, float | None]) -> str:
    """" (0.95x, 0.91-0.99)": the median ratio to plain and, over two rounds or more, its spread."""
    if cell.get("vs_plain") is None:
        return ""
    lo, hi = cell.get("vs_plain_min"), cell.get("vs_plain_max")
    spread = f", {lo:.2f}-{hi:.2f}" if lo is not None and hi is not None and (cell.get("rounds") or 0) > 1 else ""
    return f" ({cell['vs_plain']:.2f}x{spread})"


def fmt2(x: Any) -> str:
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def fmt(x: float | None) -> str:
    return "-" if x is None else (f"{x:.3f}" if isinstance(x, float) else str(x))


def plot_concurrency(result: dict[str, Any], path: Path) -> None:
    """Tokens/s against concurrency, one line per config; below, the same as a ratio to plain."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = level_table(result)
    levels = sorted(table, key=int)
    fig, (ax, ratio) = plt.subplots(2, 1, sharex=True, figsize=(7, 6.5), gridspec_kw={"height_ratios": [3, 2]})
    for name in result.get("configs", []):
        xs = [int(c) for c in levels if name in table[c]]
        ax.plot(xs, [table[str(c)][name]["tok_per_s"] or 0.0 for c in xs], marker="o", label=label(name))
        line = ratio.plot(xs, [table[str(c)][name]["vs_plain"] or 0.0 for c in xs], marker="o")[0]
        if name != "plain":  # the min-max of the per-round ratios: the noise
            ratio.fill_between(xs, [table[str(c)][name]["vs_plain_min"] or 0.0 for c in xs],
                               [table[str(c)][name]["vs_plain_max"] or 0.0 for c in xs],
                               color=line.get_color(), alpha=0.15, linewidth=0)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ratio.set_xticks([int(c) for c in levels], labels=levels)
    ratio.set_xlabel("concurrent requests (closed loop)")
    ax.set_ylabel("output tokens/s")
    ratio.set_ylabel("x plain (band: min-max\nover the rounds)", fontsize=8)
    ax.set_title(f"{result.get('model', {}).get('size')}-shaped model, {result.get('date', '')}")
    for a in (ax, ratio):
        a.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_ramp(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ramp = result.get("ramp", {})
    names = [n for n in result.get("configs", []) if n in ramp]
    switching = [n for n in names if any(w.get("plain_share") is not None for w in ramp[n]["windows"])]
    fig, axes = plt.subplots(2 + len(switching), 1, sharex=True, figsize=(9, 5 + 0.8 * len(switching)),
                             gridspec_kw={"height_ratios": [4, 1.2] + [0.8] * len(switching)})
    hold = float(result.get("ramp_hold_s") or 1)
    for name in names:
        ws = ramp[name]["windows"]
        axes[0].step([w["t"] for w in ws] + [ws[-1]["t"] + hold], [w["tok_per_s"] for w in ws] + [ws[-1]["tok_per_s"]],
                     where="post", label=label(name))
    axes[0].set_ylabel("output tokens/s")
    axes[0].legend(fontsize=8)
    axes[0].grid(alpha=0.3)
    first = ramp[names[0]]["windows"] if names else []
    axes[1].step([w["t"] for w in first] + [first[-1]["t"] + hold] if first else [],
                 [w["level"] for w in first] + [first[-1]["level"]] if first else [], where="post", color="black")
    axes[1].set_yscale("log", base=2)
    axes[1].set_ylabel("clients")
    for ax, name in zip(axes[2:], switching, strict=True):
        ws = ramp[name]["windows"]
        ax.bar([w["t"] for w in ws], [w.get("plain_share") or 0 for w in ws], width=hold, align="edge", color="tab:gray")
        for w in ws:
            if w.get("crossover") is not None:
                ax.text(w["t"] + hold / 2, 0.5, str(w["crossover"]), ha="center", va="center", fontsize=6)
        ax.set_ylim(0, 1)
        ax.set_ylabel(label(name).replace("EAGLE-3 + ", "") + "\nplain share", fontsize=7)
    axes[-1].set_xlabel("seconds into the ramp")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(result: dict[str, Any], out: Path) -> list[Path]:
    """bench.json, bench.md and, where matplotlib is installed, concurrency.png and ramp.png."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "bench.json", out / "bench.md"]
    paths[0].write_text(json.dumps(result, indent=1) + "\n")
    text = markdown(result)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        text += "\n(no plots: matplotlib is not installed here; `python -m bench run --render bench.json` draws them)\n"
    else:
        for key, name, plot, caption in (("levels", "concurrency.png", plot_concurrency, "tokens/s by concurrency"),
                                         ("ramp", "ramp.png", plot_ramp, "tokens/s on the ramp, with the mode")):
            if result.get(key):
                plot(result, out / name)
                paths.append(out / name)
                text += f"\n![{caption}]({name})\n"
    paths[1].write_text(text)
    return paths
