"""Shift-stream rollups without an engine: per-phase plateau and time to adapt,
ratios against `static`, and latency in windows with a drafter swap."""

from adaflash_vllm.bench.report import (
    neighbour_itl_ratios,
    phase_rollup,
    shift_table,
    swap_rollup,
)


def _pt(phase, tau, *, swaps=None, itl=None, rounds=10, version=0):
    p = {
        "phase": phase,
        "requests": 4,
        "output_tokens": 40,
        "wall_s": 1.0,
        "tok_s": 40.0,
        "tau": tau,
        "verify_len": 4.0,
        "rounds": rounds,
        "itl_ms_p99": itl,
    }
    if swaps is not None:
        p["extra"] = {"drafter_version": version, "swaps": swaps}
    return p


def _result(name, points):
    spec = None if name == "plain" else {"method": "dflash"}
    return {
        "config": {"name": name, "speculative_config": spec},
        "status": "ok",
        "points": points,
    }


def test_plateau_and_requests_to_adapt():
    taus = [1.0, 1.2, 1.6, 2.0, 2.0, 2.0, 2.0, 2.0]
    roll = phase_rollup(_result("online", [_pt("math", t) for t in taus]))["math"]
    assert roll["tau_last_quarter"] == 2.0
    # 3-window running means: ..., (1.6+2+2)/3 = 1.87 < 1.9, then 2.0 at window 6
    assert roll["requests_to_95pct_plateau"] == 6 * 4
    assert roll["requests"] == 32 and roll["tok_s"] == 40.0


def test_a_phase_served_again_is_its_own_entry():
    pts = [_pt("prose", 2.0), _pt("math", 1.0), _pt("prose", 3.0), _pt("prose", 3.0)]
    roll = phase_rollup(_result("online", pts))
    assert list(roll) == ["prose", "math", "prose (again)"]
    assert roll["prose"]["tau"] == 2.0 and roll["prose (again)"]["requests"] == 8


def test_a_phase_that_repeats_prompts_is_also_split_at_the_first_repeat():
    """10 prompts served as 16 requests (4 per window): windows 1-2 are new
    prompts only, windows 3-4 hold the repeats (and 2 new ones)."""
    result = _result("online", [_pt("code", t) for t in (1.0, 1.0, 3.0, 3.0)])
    result["workload"] = {"phases": [{"name": "code", "count": 16, "repeated": 6}]}
    roll = phase_rollup(result)
    assert list(roll) == ["code", "code [new prompts]", "code [repeats]"]
    assert roll["code [new prompts]"]["tau"] == 1.0
    assert roll["code [repeats]"]["requests"] == 8
    assert roll["code"]["tau"] == 2.0


def test_long_phase_adapts_on_a_smoothed_curve_and_reports_its_last_quarter():
    """64 windows: a 4-window running mean, so a lucky stretch of 3 windows is
    not 'adapted'; tok/s of the last quarter alone."""
    taus = [1.0, 2.0, 2.0, 2.0] + [1.0] * 28 + [2.0] * 32
    pts = [_pt("code", t) for t in taus]
    for p in pts[48:]:
        p["wall_s"] = 0.5  # the last quarter ran twice as fast
    roll = phase_rollup(_result("online", pts))["code"]
    assert roll["tau_last_quarter"] == 2.0
    # the running mean first reaches 1.9 at window 36 (all four at 2.0)
    assert roll["requests_to_95pct_plateau"] == 36 * 4
    assert roll["tok_s_last_quarter"] == 80.0


def test_tau_is_weighted_by_rounds():
    pts = [_pt("a", 3.0, rounds=30), _pt("a", 1.0, rounds=10)]
    assert phase_rollup(_result("x", pts))["a"]["tau"] == 2.5


def test_swap_windows_latency_ratio():
    pts = [
        _pt("a", 2.0, swaps=0, itl=10.0),
        _pt("a", 2.0, swaps=1, itl=13.0, version=1),
        _pt("a", 2.0, swaps=0, itl=12.0, version=1),
        _pt("a", 2.0, swaps=2, itl=15.0, version=3),
    ]
    s = swap_rollup(_result("online", pts))
    assert s["final_version"] == 3 and s["swaps"] == 3 and s["windows_with_swap"] == 2
    assert s["itl_p99_ms_swap_windows"] == 14.0
    assert s["itl_p99_ms_other_windows"] == 11.0
    assert abs(s["itl_p99_ratio"] - 14.0 / 11.0) < 1e-12
    # neighbours: window 1 against (10 + 12) / 2; window 3 against window 2 only
    assert s["neighbour_pairs"] == 2
    assert abs(s["itl_p99_ratio_neighbours"] - (13.0 / 11.0 + 15.0 / 12.0) / 2) < 1e-12
    assert s["itl_p99_ratio_neighbours_ci95"] > 0
    assert swap_rollup(_result("plain", [_pt("a", 1.0)])) is None


def test_neighbour_ratios_skip_swap_windows_and_stay_in_the_phase():
    pts = [
        _pt("a", 2.0, swaps=0, itl=10.0),
        _pt("a", 2.0, swaps=1, itl=20.0, version=1),
        _pt("a", 2.0, swaps=1, itl=30.0, version=2),  # neighbours: 10 and 40
        _pt("a", 2.0, swaps=0, itl=40.0, version=2),
        _pt("b", 2.0, swaps=1, itl=99.0, version=3),  # no neighbour in phase b
    ]
    assert neighbour_itl_ratios(pts) == [20.0 / 25.0, 30.0 / 25.0]


def test_shift_table_ratios_against_static():
    static = _result("static", [_pt("math", 1.5) for _ in range(4)])
    online = _result("online", [_pt("math", 1.5)] * 2 + [_pt("math", 1.8)] * 2)
    plain = _result("plain", [_pt("math", 1.0) for _ in range(4)])
    table, summary = shift_table([plain, static, online])
    assert summary["plain"]["math"]["tok_s_vs_static"] is None  # no speculation
    assert summary["online"]["math"]["tau_last_quarter_vs_static"] == 1.8 / 1.5
    assert summary["static"]["math"]["tok_s_vs_static"] == 1.0
    assert "| online | math | 16 |" in table


def test_shift_windows_cover_every_prompt_in_order():
    from adaflash_vllm.bench.offline import shift_windows

    workload = {
        "window": 3,
        "phases": [
            {"name": "a", "prompts": ["a0", "a1", "a2", "a3"]},
            {"name": "b", "prompts": ["b0", "b1"]},
        ],
    }
    assert list(shift_windows(workload)) == [
        (0, "a", ["a0", "a1", "a2"]),
        (1, "a", ["a3"]),
        (2, "b", ["b0", "b1"]),
    ]


def test_online_history_and_training_table(tmp_path):
    """Published versions (manifests) and the engine's verdicts become the report's
    training table; an incomplete version folder is skipped."""
    import json

    from adaflash_vllm.bench.report import training_table
    from adaflash_vllm.bench.results import online_history
    from adaflash_vllm.versions import mark_rejected, version_dirname

    for v in (1, 2, 3):
        d = tmp_path / version_dirname(v)
        d.mkdir()
        metrics = {
            "loss": 3.0 - v,
            "ce": 1.0,
            "rkl": 0.5,
            "clip_fraction": 0.01,
            "stale_skipped": 10 * v,
            "head_served_mae": 0.1 / v,
            "head_served_ece": 0.02,
            "head_served_mae_constant": None if v == 1 else 0.2,
        }
        (d / "manifest.json").write_text(json.dumps({"version": v, "metrics": metrics}))
        if v != 2:  # v2 never finished writing its weights
            (d / "model.safetensors").write_bytes(b"")
    (tmp_path / "LATEST").write_text("3")
    mark_rejected(tmp_path, 3, "rolled back: test")
    hist = online_history(tmp_path)
    assert [h["version"] for h in hist] == [1, 3]
    assert hist[0]["rejected"] is None and hist[1]["rejected"] == "rolled back: test"
    lines = training_table([{"config": {"name": "online"}, "online_versions": hist}])
    assert lines[3].startswith("| online | 1 | - | 10 |") and "| 2.000 |" in lines[3]
    assert "1.00%" in lines[3] and lines[4].endswith("| rolled back: test |")
    # head MAE (the last round's median as a forecast) and ECE
    assert "| 0.100 | 0.020 |" in lines[3] and "| 0.033 (0.200) |" in lines[4]
    assert training_table([{"config": {"name": "plain"}}]) == []
    from adaflash_vllm.bench.report import plot_training

    png = plot_training(
        [{"config": {"name": "online"}, "online_versions": hist}],
        tmp_path / "training.png",
    )
    assert png.stat().st_size > 0


def test_gate_extra_is_the_windows_skipped_share():
    from adaflash_vllm.bench.offline import gate_extra

    before = {"gate_drafted": 10.0, "gate_skipped": 5.0}
    after = {"gate_drafted": 12.0, "gate_skipped": 11.0}
    assert gate_extra(before, after) == {"gate_skipped_share": 6 / 8}
    assert gate_extra(before, before) == {}  # no step in the window
    assert gate_extra({}, {"drafter_version": 1}) == {}  # no gate exported


def test_spec_summary_over_speculating_steps():
    """AdaFlash: tau and verify length over all rounds and over speculating steps;
    stock DFlash (vLLM's counters only): every round speculates."""
    from adaflash_vllm.bench.offline import spec_summary

    ada = {
        "rounds": 10,
        "ada_accepted": 6,
        "verified": 4 + 6 + 6,  # 4 skipped rounds (1 each), 6 rounds of 1 + 1
        "spec_rounds": 6,
        "spec_verified": 12,
        "ada_drafted_per_pos": [6],
        "ada_accepted_per_pos": [6],
    }
    s = spec_summary(ada)
    assert s["tau"] == 1.6 and s["verify_len"] == 1.6
    assert s["tau_speculative"] == 2.0 and s["verify_len_speculative"] == 2.0
    stock = {"rounds": 0, "drafts": 4, "accepted": 6, "draft_tokens": 12}
    stock["accepted_per_pos"] = [3, 2, 1]
    s = spec_summary(stock)
    assert s["tau_speculative"] == s["tau"] == 2.5
    assert s["verify_len_speculative"] == s["verify_len"] == 4.0


def test_sweep_table_shows_speculating_steps():
    from adaflash_vllm.bench.report import sweep_table

    pt = {"key": 64, "tok_s": 100.0, "tau": 1.1, "verify_len": 1.2}
    pt |= {"tau_speculative": 3.0, "verify_len_speculative": 4.5}
    table, summary = sweep_table([_result("adaflash", [pt])])
    assert "| 1.10 | 1.20 | 3.00 / 4.50 |" in table
    assert summary["adaflash"]["64"]["tau_speculative"] == 3.0


def _tok_s_pt(phase, tok_s):
    return _pt(phase, 1.0) | {"wall_s": 40.0 / tok_s, "tok_s": tok_s}


def test_plain_run_twice_is_the_mean_baseline_and_shows_its_drift():
    before = _result("plain", [_tok_s_pt("prose", 90.0)])
    after = _result("plain#2", [_tok_s_pt("prose", 110.0)])
    ada = _result("adaflash", [_tok_s_pt("prose", 120.0)])
    table, summary = shift_table([before, ada, after])
    assert summary["adaflash"]["prose"]["speedup"] == 120.0 / 100.0
    assert summary["plain"]["prose"]["speedup"] == 0.9
    assert summary["plain#2"]["prose"]["speedup"] == 1.1
    assert "| plain#2 | prose | 4 | 110.0 | 1.10x |" in table


def test_sweep_baseline_is_the_mean_of_plain_runs():
    from adaflash_vllm.bench.report import sweep_table

    runs = [
        _result("plain", [{"key": 8, "tok_s": 90.0}]),
        _result("adaflash", [{"key": 8, "tok_s": 95.0}]),
        _result("plain#2", [{"key": 8, "tok_s": 110.0}]),
    ]
    _, summary = sweep_table(runs)
    assert summary["adaflash"]["8"]["speedup"] == 0.95


def test_a_configuration_named_again_runs_again_numbered():
    from adaflash_vllm.bench.configs import BenchConfig
    from adaflash_vllm.bench.harness import numbered

    names = [
        c.name
        for c in numbered(
            [BenchConfig(n, None) for n in ("plain", "dflash", "plain", "plain")]
        )
    ]
    assert names == ["plain", "dflash", "plain#2", "plain#3"]
