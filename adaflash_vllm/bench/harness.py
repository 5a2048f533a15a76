"""Run benchmark configurations back to back and report them side by side.

Each configuration gets a fresh engine (a child process, or a `vllm serve`
subprocess) pinned to the same CPU cores, so differences come from the
configuration alone. Results are written per configuration as soon as each
window/concurrency finishes; an interrupted run keeps what finished.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from adaflash_vllm.bench.configs import (
    BenchConfig,
    BenchSetup,
    build_config,
    with_fresh_online,
)
from adaflash_vllm.bench.report import (
    plot_acceptance,
    plot_shift,
    plot_sweep,
    plot_training,
    shift_table,
    swap_summary,
    sweep_table,
)
from adaflash_vllm.bench.results import (
    load_results,
    new_result,
    online_history,
    save_result,
)
from adaflash_vllm.bench.workloads import Workload
from adaflash_vllm.errors import AdaFlashConfigError

MAX_MODEL_LEN = 1024  # every benchmark engine's context length


def engine_kwargs(
    workload: Workload, max_model_len: int = MAX_MODEL_LEN
) -> dict[str, Any]:
    seqs = max(workload.concurrencies) if workload.kind == "sweep" else workload.window
    kwargs = {
        "dtype": "float32",
        "max_model_len": max_model_len,
        "enforce_eager": True,
        "seed": 0,
        "max_num_seqs": seqs,
        "disable_log_stats": False,
    }
    if workload.refill:  # each request's drafts, for tau per phase (refill.py)
        kwargs["per_request_spec_decode_metrics"] = "summary"
    return kwargs


def pinned(cmd: list[str], cores: str | None) -> list[str]:
    """Prefix `cmd` with taskset so the engine and its children stay on `cores`."""
    if cores and shutil.which("taskset"):
        return ["taskset", "-c", cores, *cmd]
    return cmd


def engine_env(cores: str | None) -> dict[str, str]:
    env = {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if cores:
        env["VLLM_CPU_OMP_THREADS_BIND"] = cores
    return env


def result_path(out_dir: Path, name: str) -> Path:
    """Where a configuration's result JSON goes (its log beside it, `.log`)."""
    return out_dir / f"{name.replace(':', '-')}.json"


def workload_json(workload: Workload) -> dict[str, Any]:
    data = asdict(workload)
    data["concurrencies"] = list(workload.concurrencies)
    return data


def run_offline_config(
    config: BenchConfig,
    *,
    setup: BenchSetup,
    workload: Workload,
    out: Path,
    cores: str | None,
    command: str,
    repeats: int,
    engine: dict[str, Any],
) -> dict:
    job = {
        "target": setup.target,
        "config": asdict(config),
        "workload": workload_json(workload),
        "setup": asdict(setup),
        "engine": engine,
        "out": str(out),
        "command": command,
        "repeats": repeats,
    }
    job_path = out.with_suffix(".job.json")
    job_path.write_text(json.dumps(job))
    cmd = pinned(
        [sys.executable, "-m", "adaflash_vllm.bench.offline", str(job_path)], cores
    )
    log_path = out.with_suffix(".log")
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **engine_env(cores)},
        )
        assert proc.stdout is not None
        for line in proc.stdout:  # everything to the log, progress to the console
            log.write(line)
            if line.startswith(f"[{config.name}]"):
                print("  " + line.rstrip(), flush=True)
        proc.wait()
    job_path.unlink(missing_ok=True)
    result = child_result(out, config, setup, job["workload"], command)
    if proc.returncode != 0:
        mark_failed(result, out, config.name, f"exit code {proc.returncode}")
    return result


def child_result(
    out: Path, config: BenchConfig, setup: BenchSetup, wl: dict, command: str
) -> dict:
    """What an offline child process saved at `out`, or an empty result where
    it saved nothing (it failed before its first point)."""
    if out.exists():
        return json.loads(out.read_text())
    return new_result(
        command=command, setup=asdict(setup), workload=wl, config=asdict(config)
    )


def mark_failed(result: dict, out: Path, name: str, error: str) -> None:
    """Record a configuration's failure (the child's own error where it saved
    one, else `error`), print it with the tail of its log (`out` .log), save."""
    log = out.with_suffix(".log")
    text = log.read_text(errors="replace") if log.exists() else ""
    tail = "\n".join(text.splitlines()[-15:])
    result["status"] = "failed"
    result["error"] = result.get("error") or error
    print(f"  [{name}] FAILED ({result['error']}); log tail:\n{tail}", flush=True)
    save_result(result, out)


def turn_order(names: list[str], repeat: int) -> list[str]:
    """The configurations' order in an interleaved sweep's `repeat`-th round:
    rotated by one each round, so none always runs first."""
    shift = repeat % max(1, len(names))
    return names[shift:] + names[:shift]


def _served_result(
    config: BenchConfig, setup: BenchSetup, workload: Workload, command: str
) -> dict:
    return new_result(
        command=command,
        setup=asdict(setup),
        workload=workload_json(workload),
        config=asdict(config),
    )


def config_server(
    config: BenchConfig,
    setup: BenchSetup,
    engine: dict[str, Any],
    cores: str | None,
    log_path: Path,
):
    """The (unstarted) `vllm serve` of one configuration, pinned to `cores`."""
    from adaflash_vllm.serve_process import ServeProcess

    args = [
        setup.target,
        "--dtype",
        engine["dtype"],
        "--max-model-len",
        str(engine["max_model_len"]),
        "--max-num-seqs",
        str(engine["max_num_seqs"]),
        "--seed",
        "0",
    ]
    if engine.get("enforce_eager"):
        args.append("--enforce-eager")
    if config.speculative_config is not None:
        args += ["--speculative-config", config.spec_json()]
    server = ServeProcess(args, env=engine_env(cores), log_path=log_path)
    server.args = pinned(server.args, cores)
    return server


def run_served_config(
    config: BenchConfig,
    *,
    setup: BenchSetup,
    workload: Workload,
    out: Path,
    cores: str | None,
    command: str,
    repeats: int,
    engine: dict[str, Any],
) -> dict:
    """The shift stream through one configuration's `vllm serve` (served sweeps
    run all configurations at once: `run_sweep_interleaved`)."""
    from adaflash_vllm.bench.online import run_shift_served
    from adaflash_vllm.serve_process import ServerStartError

    result = _served_result(config, setup, workload, command)
    server = config_server(config, setup, engine, cores, out.with_suffix(".log"))
    try:
        server.start()
        run_shift_served(
            server,
            setup.target,
            workload_json(workload),
            result,
            lambda: save_result(result, out),
            lambda m: print(f"  [{config.name}] {m}", flush=True),
        )
        result["status"] = "ok"
    except (ServerStartError, OSError) as e:
        result["status"], result["error"] = "failed", str(e).splitlines()[0]
        print(f"  [{config.name}] FAILED: {e}", flush=True)
    finally:
        server.stop()
        save_result(result, out)
    return result


def run_sweep_interleaved(
    configs: list[BenchConfig],
    *,
    setup: BenchSetup,
    workload: Workload,
    out_dir: Path,
    cores: str | None,
    command: str,
    repeats: int,
    engine: dict[str, Any],
) -> list[dict]:
    """The served concurrency sweep with every configuration's server up at once
    (all on the same cores, idle while another is measured) and, at each
    concurrency, the configurations measured in turn, repeat after repeat, in a
    rotating order. A slow spell of a shared machine then hits every configuration
    alike instead of whichever happened to run during it."""
    from adaflash_vllm.bench.online import (
        add_level_point,
        level_batch,
        measure_level,
        warm_up,
    )
    from adaflash_vllm.serve_process import ServerStartError

    wl = workload_json(workload)
    outs = {c.name: result_path(out_dir, c.name) for c in configs}
    results = {c.name: _served_result(c, setup, workload, command) for c in configs}
    servers = {}
    try:
        for c in configs:
            server = config_server(
                c, setup, engine, cores, outs[c.name].with_suffix(".log")
            )
            try:
                server.start()
                servers[c.name] = server
            except (ServerStartError, OSError) as e:
                server.stop()
                results[c.name]["status"] = "failed"
                results[c.name]["error"] = str(e).splitlines()[0]
                print(f"  [{c.name}] FAILED: {e}", flush=True)
        live = [c.name for c in configs if c.name in servers]
        prompts = wl["phases"][0]["prompts"]
        for level in wl["concurrencies"]:
            batch = level_batch(prompts, level, wl.get("requests_per_slot"))
            for name in live:
                warm_up(servers[name], setup.target, batch, level)
            runs: dict[str, list[float]] = {name: [] for name in live}
            last: dict[str, tuple] = {}
            for rep in range(repeats):
                for name in turn_order(live, rep):
                    tok_s, reqs, summary, extra = measure_level(
                        servers[name], setup.target, batch, level, wl
                    )
                    runs[name].append(tok_s)
                    last[name] = (reqs, summary, extra)
            for name in live:
                line = add_level_point(
                    results[name], wl, level, runs[name], *last[name]
                )
                save_result(results[name], outs[name])
                print(f"  [{name}] {line}", flush=True)
        for name in live:
            results[name]["status"] = "ok"
    finally:
        for server in servers.values():
            server.stop()
        for name, result in results.items():
            save_result(result, outs[name])
    return [results[c.name] for c in configs]


def numbered(configs: list[BenchConfig]) -> list[BenchConfig]:
    """A configuration named again runs again as NAME#2, NAME#3, ... (e.g. plain
    before and after the others, to see how far the machine drifted)."""
    seen: dict[str, int] = {}
    out = []
    for c in configs:
        seen[c.name] = seen.get(c.name, 0) + 1
        out.append(
            c if seen[c.name] == 1 else replace(c, name=f"{c.name}#{seen[c.name]}")
        )
    return out


def run_benchmark(
    *,
    setup: BenchSetup,
    config_names: list[str],
    workload: Workload,
    out_dir: str | Path,
    driver: str = "offline",
    repeats: int = 1,
    cores: str | None = None,
    command: str = "",
    title: str = "",
) -> dict[str, Any]:
    """Run every configuration, then write report.md, PNG plots and summary.json.

    Returns the summary (also printed as the last stdout line by the CLI).
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    configs = numbered([build_config(n, setup) for n in config_names])  # fail fast
    configs = [with_fresh_online(c, out_dir / f"{c.name}-online") for c in configs]
    engine = engine_kwargs(workload)
    if workload.kind == "sweep":
        print(f"[{len(configs)} configurations, interleaved]", flush=True)
        sweep = run_sweep_interleaved
        if driver != "serve":
            from adaflash_vllm.bench.offline_interleaved import (
                run_offline_sweep_interleaved as sweep,
            )
        results = sweep(
            configs,
            setup=setup,
            workload=workload,
            out_dir=out_dir,
            cores=cores,
            command=command,
            repeats=repeats,
            engine=engine,
        )
        return write_report(results, out_dir, workload.kind, title=title)
    runner = run_served_config if driver == "serve" else run_offline_config
    results = []
    for i, config in enumerate(configs, start=1):
        print(f"[{i}/{len(configs)}] {config.name}", flush=True)
        out = result_path(out_dir, config.name)
        result = runner(
            config,
            setup=setup,
            workload=workload,
            out=out,
            cores=cores,
            command=command,
            repeats=repeats,
            engine=engine,
        )
        online = ((config.speculative_config or {}).get("adaflash") or {}).get("online")
        if online and online.get("enabled"):
            result["online_versions"] = online_history(online["versions_dir"])
            save_result(result, out)
        results.append(result)
    return write_report(results, out_dir, workload.kind, title=title)


def write_report(
    results: list[dict], out_dir: Path, kind: str, title: str = ""
) -> dict[str, Any]:
    if kind == "shift":
        table, summary = shift_table(results)
        plots = [plot_shift(results, out_dir / "shift.png", title)]
    else:
        table, summary = sweep_table(results)
        plots = [plot_sweep(results, out_dir / "sweep.png", title)]
    plots.append(plot_acceptance(results, out_dir / "acceptance.png"))
    if any(r.get("online_versions") for r in results):
        plots.append(plot_training(results, out_dir / "training.png"))
    first = results[0] if results else {}
    header = [
        f"# {title or kind}",
        "",
        f"- command: `{first.get('command', '')}`",
        f"- git {first.get('git_sha')} | {first.get('created')} | "
        f"{(first.get('machine') or {}).get('cpu')} x "
        f"{(first.get('machine') or {}).get('cpu_count')} | vLLM "
        f"{(first.get('machine') or {}).get('vllm')} | torch "
        f"{(first.get('machine') or {}).get('torch')}",
        "",
        "",
    ]
    (out_dir / "report.md").write_text(
        "\n".join(header)
        + table
        + "\n\n"
        + "\n".join(f"![{p.stem}]({p.name})" for p in plots)
        + "\n"
    )
    full = {
        "kind": kind,
        "summary": summary,  # {config: {phase or C: metrics}}
        "swaps": swap_summary(results) if kind == "shift" else {},
        "report": str(out_dir / "report.md"),
        "plots": [str(p) for p in plots],
        "failed": [r["config"]["name"] for r in results if r.get("status") != "ok"],
    }
    (out_dir / "summary.json").write_text(json.dumps(full, indent=1))
    print(table, flush=True)
    return full


def rebuild_report(out_dir: str | Path, title: str = "") -> dict[str, Any]:
    """Re-plot a finished (or interrupted) run from its JSON files."""
    results = load_results(out_dir)
    if not results:
        raise AdaFlashConfigError(f"no benchmark results (*.json) in {out_dir}")
    return write_report(results, Path(out_dir), results[0]["workload"]["kind"], title)
