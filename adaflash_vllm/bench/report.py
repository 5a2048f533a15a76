"""Turn benchmark results into a Markdown table, PNG plots and a JSON summary.

Every speed number is also given as a ratio to `plain` measured in the same run
(same machine, same prompts, same cores): that ratio is the headline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from adaflash_vllm.bench.paired import mean_ci


def _points(result: dict) -> list[dict]:
    return result.get("points", [])


def base_name(name: str) -> str:
    """The configuration a run is of: `plain#2` (plain's second run) -> plain."""
    return name.split("#")[0]


def plain_runs(results: list[dict]) -> list[dict]:
    """Every run of `plain` (a stream may run it before and after the others)."""
    return [r for r in results if base_name(r["config"]["name"]) == "plain"]


def mean_by_key(values: list[dict]) -> dict:
    """{key: mean} over the dicts that have the key (runs of one baseline)."""
    keys = {k for v in values for k in v}
    return {
        k: sum(v[k] for v in values if k in v) / sum(1 for v in values if k in v)
        for k in keys
    }


def phase_rollup(result: dict) -> dict[str, dict[str, float]]:
    """Per phase of a shift stream: tok/s and mean tau over the phase, verify
    length, tau and tok/s over the phase's last quarter (after adaptation), and
    requests until tau first reaches 95% of that plateau (running mean over a
    sixteenth of the phase, at least 3 windows). A phase whose set came earlier
    in the stream too is its own entry, `NAME (again)`. A phase longer than its
    set (prompts served a second time, which a drafter trained online on their
    first answers may have memorised) also gets `NAME [new prompts]`, the windows
    before the first repeat, and `NAME [repeats]`, the rest."""
    groups: list[tuple[str, list[dict]]] = []
    for p in _points(result):
        if not groups or p["phase"] != groups[-1][1][-1]["phase"]:
            label = p["phase"]
            while label in {g[0] for g in groups}:
                label += " (again)"
            groups.append((label, []))
        groups[-1][1].append(p)
    meta = (result.get("workload") or {}).get("phases") or []
    out = {}
    for i, (label, pts) in enumerate(groups):
        out[label] = _rollup(pts)
        info = meta[i] if len(meta) == len(groups) else {}
        if not info.get("repeated"):
            continue
        distinct, served, first = info["count"] - info["repeated"], 0, 0
        for p in pts:
            served += p["requests"]
            if served > distinct:
                break
            first += 1
        if first:
            out[f"{label} [new prompts]"] = _rollup(pts[:first])
        if first < len(pts):
            out[f"{label} [repeats]"] = _rollup(pts[first:])
    return out


def _round_weighted(pts: list[dict], field: str = "tau") -> float:
    """Mean of a per-window `field` (tau, verify length) weighted by rounds."""
    rounds = sum(p.get("rounds") or 0 for p in pts)
    if not rounds:
        return 1.0
    return sum((p.get(field) or 1.0) * (p.get("rounds") or 0) for p in pts) / rounds


def _tok_s(pts: list[dict]) -> float:
    wall = sum(p["wall_s"] for p in pts)
    return sum(p["output_tokens"] for p in pts) / wall if wall else 0.0


def _rollup(pts: list[dict]) -> dict[str, float]:
    tail = pts[len(pts) - max(1, len(pts) // 4) :]
    plateau = _round_weighted(tail)
    smooth = max(3, len(pts) // 16)
    adapt = None
    served = 0
    for i, p in enumerate(pts):
        served += p["requests"]
        recent = pts[max(0, i - smooth + 1) : i + 1]
        if adapt is None and _round_weighted(recent) >= 0.95 * plateau:
            adapt = served
    return {
        "tok_s": _tok_s(pts),
        "tau": _round_weighted(pts),
        "verify_len": _round_weighted(pts, "verify_len"),
        "tau_last_quarter": plateau,
        "tok_s_last_quarter": _tok_s(tail),
        "requests_to_95pct_plateau": adapt,
        "requests": sum(p["requests"] for p in pts),
        "failed_requests": sum(p.get("failed_requests") or 0 for p in pts),
    }


def swap_summary(results: list[dict]) -> dict[str, dict[str, Any]]:
    """`swap_rollup` of every config that has a drafter version (online runs)."""
    found = {r["config"]["name"]: swap_rollup(r) for r in results}
    return {name: v for name, v in found.items() if v}


def swap_rollup(result: dict) -> dict[str, Any] | None:
    """Online runs: versions reached, swaps, and latency in windows with a swap vs
    windows without one (p99 inter-token gap; served runs only)."""
    pts = [p for p in _points(result) if "drafter_version" in (p.get("extra") or {})]
    if not pts:
        return None
    with_swap = [p for p in pts if p["extra"].get("swaps")]
    without = [p for p in pts if not p["extra"].get("swaps")]

    def mean_itl(group: list[dict]) -> float | None:
        vals = [p["itl_ms_p99"] for p in group if p.get("itl_ms_p99") is not None]
        return sum(vals) / len(vals) if vals else None

    itl_swap, itl_none = mean_itl(with_swap), mean_itl(without)
    paired = neighbour_itl_ratios(pts)
    mean, half = mean_ci(paired) if paired else (None, None)
    return {
        "final_version": pts[-1]["extra"]["drafter_version"],
        "swaps": sum(p["extra"].get("swaps", 0) for p in pts),
        "windows_with_swap": len(with_swap),
        "itl_p99_ms_swap_windows": itl_swap,
        "itl_p99_ms_other_windows": itl_none,
        "itl_p99_ratio": itl_swap / itl_none if itl_swap and itl_none else None,
        "itl_p99_ratio_neighbours": mean,
        "itl_p99_ratio_neighbours_ci95": None if len(paired) < 2 else half,
        "neighbour_pairs": len(paired),
    }


def neighbour_itl_ratios(pts: list[dict]) -> list[float]:
    """Each swap window's p99 inter-token gap over that of its neighbours: the
    nearest window without a swap before it and after it in the same phase (the
    mean of the two, or the one there is). Windows next to each other share the
    drafter's state of adaptation and the traffic, which the mean over all other
    windows of a run does not (a drafter that has just improved drafts longer
    and steps longer)."""
    ratios = []
    for i, p in enumerate(pts):
        if not p["extra"].get("swaps") or p.get("itl_ms_p99") is None:
            continue
        near = []
        for step in (-1, 1):
            j = i + step
            while 0 <= j < len(pts) and pts[j]["extra"].get("swaps"):
                j += step
            if (
                0 <= j < len(pts)
                and pts[j]["phase"] == p["phase"]
                and pts[j].get("itl_ms_p99")
            ):
                near.append(pts[j]["itl_ms_p99"])
        if near:
            ratios.append(p["itl_ms_p99"] / (sum(near) / len(near)))
    return ratios


def shift_table(results: list[dict]) -> tuple[str, dict[str, Any]]:
    """Per config and phase; ratios against `plain` (the mean of its runs, when
    it ran more than once: then each plain run's own ratio shows the drift) and,
    when the run has one, against the config named `static` (the same drafter
    without online updates)."""
    static = next((r for r in results if r["config"]["name"] == "static"), None)
    base_tok_s = mean_by_key(
        [
            {phase: v["tok_s"] for phase, v in phase_rollup(r).items()}
            for r in plain_runs(results)
        ]
    )
    static_roll = phase_rollup(static) if static else {}
    lines = [
        "| config | phase | requests | tok/s | speedup vs plain | vs static | "
        "tok/s last quarter | vs static | tau | tau last quarter | vs static | "
        "verify len | requests to 95% plateau | failed |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary: dict[str, Any] = {}
    for r in results:
        name = r["config"]["name"]
        speculative = r["config"].get("speculative_config") is not None
        for phase, v in phase_rollup(r).items():
            ref = base_tok_s.get(phase)
            st = static_roll.get(phase, {}) if speculative else {}
            row = {
                **v,
                "speedup": v["tok_s"] / ref if ref else None,
                "tok_s_vs_static": v["tok_s"] / st["tok_s"] if st else None,
                "tau_last_quarter_vs_static": (
                    v["tau_last_quarter"] / st["tau_last_quarter"] if st else None
                ),
                "tok_s_last_quarter_vs_static": (
                    v["tok_s_last_quarter"] / st["tok_s_last_quarter"]
                    if st and st["tok_s_last_quarter"]
                    else None
                ),
            }
            lines.append(
                f"| {name} | {phase} | {v['requests']} | {v['tok_s']:.1f} | "
                f"{_fmt(row['speedup'], 'x')} | {_fmt(row['tok_s_vs_static'], 'x')} | "
                f"{v['tok_s_last_quarter']:.1f} | "
                f"{_fmt(row['tok_s_last_quarter_vs_static'], 'x')} | "
                f"{v['tau']:.2f} | {v['tau_last_quarter']:.2f} | "
                f"{_fmt(row['tau_last_quarter_vs_static'], 'x')} | "
                f"{v['verify_len']:.2f} | {v['requests_to_95pct_plateau'] or '-'} | "
                f"{v['failed_requests']} |"
            )
            summary.setdefault(name, {})[phase] = row
        if r.get("status") != "ok":
            lines.append(f"| {name} | (failed: {r.get('error')}) |" + " |" * 12)
    swaps = swap_summary(results)
    if swaps:
        lines += [
            "",
            "| config | final drafter version | swaps | windows with a swap | "
            "ITL p99 ms, swap windows | ITL p99 ms, other windows | ratio | "
            "ratio to neighbouring windows (95%) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, v in swaps.items():
            paired = _fmt(v.get("itl_p99_ratio_neighbours"), "x")
            if v.get("itl_p99_ratio_neighbours_ci95") is not None:
                paired += f" +- {v['itl_p99_ratio_neighbours_ci95']:.3f}"
            lines.append(
                f"| {name} | {v['final_version']} | {v['swaps']} | "
                f"{v['windows_with_swap']} | "
                f"{_fmt(v['itl_p99_ms_swap_windows'], '', 1)} | "
                f"{_fmt(v['itl_p99_ms_other_windows'], '', 1)} | "
                f"{_fmt(v['itl_p99_ratio'], 'x')} | {paired} |"
            )
    lines += training_table(results)
    return "\n".join(lines), summary


def training_table(results: list[dict]) -> list[str]:
    """One row per published version of every online run (the trainer's manifest)."""
    rows = [
        (r["config"]["name"], h)
        for r in results
        for h in r.get("online_versions") or []
    ]
    if not rows:
        return []
    lines = [
        "",
        "| config | version | trajectories | older passed over | loss | CE | rKL | "
        "clipped entries | accept before -> after | head MAE, unseen rounds "
        "(last round's median) | head ECE | train s | engine verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, h in rows:
        m = h["metrics"]
        clip = 100 * m["clip_fraction"] if "clip_fraction" in m else None
        lines.append(
            f"| {name} | {h['version']} | {m.get('trajectories', '-')} | "
            f"{m.get('stale_skipped', '-')} | "
            f"{_fmt(m.get('loss'), '', 3)} | {_fmt(m.get('ce'), '', 3)} | "
            f"{_fmt(m.get('rkl'), '', 3)} | "
            f"{_fmt(clip, '%')} | "
            f"{_fmt(m.get('accept_before'))} -> {_fmt(m.get('accept_after'))} | "
            f"{_fmt(m.get('head_served_mae'), '', 3)}"
            f"{_paren(m.get('head_served_mae_constant'))} | "
            f"{_fmt(m.get('head_served_ece'), '', 3)} | "
            f"{_fmt(m.get('seconds'), '', 0)} | {h.get('rejected') or 'kept'} |"
        )
    return lines


def sweep_table(results: list[dict]) -> tuple[str, dict[str, Any]]:
    base_by_c = plain_tok_s_by_level(results)
    lines = [
        "| config | C | tok/s (min-max) | speedup vs plain | tau | verify len | "
        "tau / verify len, speculating steps | TTFT p50 ms | TPOT p50 ms | failed |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    summary: dict[str, Any] = {}
    for r in results:
        name = r["config"]["name"]
        for p in _points(r):
            ref = base_by_c.get(p["key"])
            speedup = p["tok_s"] / ref if ref else None
            runs = p.get("tok_s_runs") or [p["tok_s"]]
            lines.append(
                f"| {name} | {p['key']} | {p['tok_s']:.1f} "
                f"({min(runs):.0f}-{max(runs):.0f}) | {_fmt(speedup, 'x')} | "
                f"{_fmt(p.get('tau'))} | "
                f"{_fmt(p.get('verify_len'))} | {_fmt(p.get('tau_speculative'))} / "
                f"{_fmt(p.get('verify_len_speculative'))} | "
                f"{_fmt(p.get('ttft_ms_p50'), '', 1)} | "
                f"{_fmt(p.get('tpot_ms_p50'), '', 2)} | {p.get('failed_requests', 0)} |"
            )
            summary.setdefault(name, {})[str(p["key"])] = {
                "tok_s": p["tok_s"],
                "speedup": speedup,
                "tau": p.get("tau"),
                "verify_len": p.get("verify_len"),
                "tau_speculative": p.get("tau_speculative"),
                "verify_len_speculative": p.get("verify_len_speculative"),
            }
        if r.get("status") != "ok":
            lines.append(f"| {name} | (failed: {r.get('error')}) | | | | | | | | |")
    return "\n".join(lines), summary


def plain_tok_s_by_level(results: list[dict]) -> dict:
    """{concurrency: tok/s} of plain, the mean of its runs."""
    return mean_by_key(
        [{p["key"]: p["tok_s"] for p in _points(r)} for r in plain_runs(results)]
    )


def _fmt(v: float | None, suffix: str = "", digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}{suffix}"


def _paren(v: float | None) -> str:
    return "" if v is None else f" ({v:.3f})"


def plot_shift(results: list[dict], path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_tau, ax_tps) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)
    ref = results[0] if results else {"points": []}
    shade_phases(ax_tau, ref)
    shade_phases(ax_tps, ref)
    for r in results:
        pts = _points(r)
        x = [sum(q["requests"] for q in pts[: i + 1]) for i in range(len(pts))]
        # Long streams: a running mean over ~1/60 of the windows (per-window
        # values of 8 requests swing more than the trends worth seeing).
        k = max(1, len(pts) // 60)
        runs = [pts[max(0, i - k + 1) : i + 1] for i in range(len(pts))]
        style = {"marker": "o", "ms": 3} if k == 1 else {"lw": 1.2}
        name = r["config"]["name"] + (f" ({k}-window mean)" if k > 1 else "")
        ax_tau.plot(x, [_round_weighted(w) for w in runs], label=name, **style)
        (line,) = ax_tps.plot(x, [_tok_s(w) for w in runs], label=name, **style)
        swaps = [
            xi
            for xi, p in zip(x, pts, strict=True)
            if (p.get("extra") or {}).get("swaps")
        ]
        if swaps:  # online runs: where a new drafter version went live
            ax_tau.plot(
                swaps,
                [ax_tau.get_ylim()[0]] * len(swaps),
                "^",
                color=line.get_color(),
                ms=6,
                clip_on=False,
                label=f"{r['config']['name']}: drafter swap",
            )
    ax_tau.set_ylabel("tau (tokens per target step)")
    ax_tps.set_ylabel("output tokens / s")
    ax_tps.set_xlabel("requests served")
    ax_tau.legend(loc="best", fontsize=8)
    ax_tau.set_title(title or "Domain-shift stream: acceptance and throughput")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def shade_phases(ax, result: dict) -> None:
    start, current, count = 0, None, 0
    colors = ["#eef3fb", "#fbf1e6", "#eaf6ec", "#f6eaf4"]
    spans = []
    for p in _points(result):
        if p["phase"] != current:
            if current is not None:
                spans.append((current, start, count))
            current, start = p["phase"], count
        count += p["requests"]
    if current is not None:
        spans.append((current, start, count))
    for i, (name, a, b) in enumerate(spans):
        ax.axvspan(a, b, color=colors[i % len(colors)], zorder=0)
        ax.text(
            (a + b) / 2,
            0.98,
            name,
            transform=ax.get_xaxis_transform(),
            ha="center",
            va="top",
            fontsize=8,
        )


def plot_sweep(results: list[dict], path: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base_by_c = plain_tok_s_by_level(results)
    fig, (ax_s, ax_v) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        pts = [p for p in _points(r) if p["key"] in base_by_c]
        if not pts:
            continue
        cs = [p["key"] for p in pts]
        ax_s.plot(
            cs,
            [p["tok_s"] / base_by_c[p["key"]] for p in pts],
            marker="o",
            label=r["config"]["name"],
        )
        ax_v.plot(
            cs,
            [p.get("verify_len") or 1.0 for p in pts],
            marker="o",
            label=r["config"]["name"],
        )
    for ax in (ax_s, ax_v):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency")
    ax_s.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax_s.set_ylabel("throughput / plain vLLM")
    ax_v.set_ylabel("tokens verified per round")
    ax_s.legend(fontsize=8)
    fig.suptitle(title or "Speedup vs concurrency")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_acceptance(results: list[dict], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    for r in results:
        rates: list[list[float]] = []
        for p in _points(r):
            if p.get("accept_per_pos"):
                rates.append(p["accept_per_pos"])
        if not rates:
            continue
        k = max(len(x) for x in rates)
        mean = [sum(x[j] for x in rates if j < len(x)) / len(rates) for j in range(k)]
        ax.plot(range(1, k + 1), mean, marker="o", label=r["config"]["name"])
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (of drafted)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax.set_title("Per-position acceptance")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_training(results: list[dict], path: Path) -> Path:
    """Online trainer, per published version: OPD loss, its CE and clipped
    reverse-KL parts, the clip fraction, greedy acceptance on the round's
    trajectories before and after training (x marks versions the engine rolled
    back or refused) and, with a length head, its MAE on the round's logged
    rounds before training on them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    heads = any(
        h["metrics"].get("head_served_mae") is not None
        for r in results
        for h in r.get("online_versions") or []
    )
    fig, axes = plt.subplots(
        3 if heads else 2, 1, figsize=(9, 9 if heads else 6.5), sharex=True
    )
    ax_loss, ax_acc = axes[0], axes[1]
    ax_clip = ax_loss.twinx()
    for r in results:
        hist = r.get("online_versions") or []
        if not hist:
            continue
        name = r["config"]["name"]
        v = [h["version"] for h in hist]
        m = [h["metrics"] for h in hist]
        ax_loss.plot(v, [x.get("loss") for x in m], "o-", label=f"{name}: loss")
        ax_loss.plot(v, [x.get("ce") for x in m], "s--", ms=3, label=f"{name}: CE")
        ax_loss.plot(v, [x.get("rkl") for x in m], "^--", ms=3, label=f"{name}: rKL")
        ax_clip.plot(
            v,
            [100 * (x.get("clip_fraction") or 0) for x in m],
            ":",
            color="grey",
            label=f"{name}: clipped entries %",
        )
        ax_acc.plot(
            v, [x.get("accept_before") for x in m], "o-", label=f"{name}: before"
        )
        ax_acc.plot(v, [x.get("accept_after") for x in m], "o-", label=f"{name}: after")
        bad = [h for h in hist if h.get("rejected")]
        ax_acc.plot(
            [h["version"] for h in bad],
            [h["metrics"].get("accept_after") for h in bad],
            "x",
            color="red",
            ms=9,
            label=f"{name}: rolled back / refused",
        )
        if heads:
            axes[2].plot(
                v, [x.get("head_served_mae") for x in m], "o-", label=f"{name}: head"
            )
            axes[2].plot(
                v,
                [x.get("head_served_mae_constant") for x in m],
                "s--",
                ms=3,
                label=f"{name}: last round's median",
            )
    if heads:
        axes[2].axhline(0.05, color="grey", ls=":", label="target 0.05")
        axes[2].set_ylabel("length head MAE\n(unseen logged rounds)")
        axes[2].legend(fontsize=7, loc="best")
    ax_loss.set_ylabel("loss (per weighted position)")
    ax_clip.set_ylabel("clipped reverse-KL entries (%)")
    ax_acc.set_ylabel("accepted drafts per block")
    axes[-1].set_xlabel("published drafter version")
    ax_loss.set_title("Online distillation: loss, clip fraction and acceptance")
    lines = ax_loss.get_legend_handles_labels()
    extra = ax_clip.get_legend_handles_labels()
    ax_loss.legend(lines[0] + extra[0], lines[1] + extra[1], fontsize=7, loc="best")
    ax_acc.legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
