"""The offline concurrency sweep with every configuration's engine up at once.

Each configuration's `LLM` lives in its own child process
(`python -m adaflash_vllm.bench.offline JOB.json`, as a shift stream's does), so
stock DFlash runs without AdaFlash's patches in its process. The children start
one after another and then wait on their stdin; at each concurrency the harness
has each warm up, then runs their timed passes in turn, repeat after repeat in a
rotating order (one engine busy at a time, all on the same cores), as the served
sweep does (`harness.run_sweep_interleaved`). A slow spell of a shared machine
then lands on every configuration alike: run one after another, plain's own two
runs in a sweep differed by up to 20% at a level (BENCHMARKS.md run 41).

The protocol (offline.py `SweepLevels.run_commands`): the child prints READY
once its engine is up, then reads one JSON command per line and prints DONE
after each; everything else it prints goes to its log, and its progress lines
(`[NAME] ...`) to the console too.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import IO, Any

from adaflash_vllm.bench.configs import BenchConfig, BenchSetup
from adaflash_vllm.bench.offline import DONE, READY
from adaflash_vllm.bench.workloads import Workload


class EngineExited(RuntimeError):
    """The child process ended before answering (its log says why)."""


class OfflineEngineProcess:
    """One configuration's offline engine in a child process, driven by
    commands on its stdin."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], log: IO[str]):
        self.name, self.cmd, self.env, self.log = name, cmd, env, log
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Spawn the child and wait until its engine is up (EngineExited if it
        ends first)."""
        self.proc = subprocess.Popen(
            self.cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
        )
        self._until(READY)

    def call(self, op: str, level: int | None = None) -> None:
        """Send one command and wait for it to finish."""
        assert self.proc is not None and self.proc.stdin is not None
        try:
            self.proc.stdin.write(json.dumps({"op": op, "level": level}) + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError) as e:
            raise EngineExited(f"{self.name}: engine process gone ({e})") from e
        self._until(DONE)

    def _until(self, sentinel: str) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.rstrip("\n") == sentinel:
                return
            self.log.write(line)
            if line.startswith(f"[{self.name}]"):
                print("  " + line.rstrip(), flush=True)
        self.log.flush()
        code = self.proc.wait()
        raise EngineExited(f"{self.name}: engine process exited (code {code})")

    def finish(self, timeout: float = 120.0) -> int:
        """Tell the child to stop (it saves its result) and wait for it; a child
        that does not stop in `timeout` seconds is killed. Returns its exit
        code."""
        assert self.proc is not None
        try:
            if self.proc.poll() is None and self.proc.stdin is not None:
                self.proc.stdin.write(json.dumps({"op": "end"}) + "\n")
                self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        if self.proc.stdout is not None:
            for line in self.proc.stdout:
                self.log.write(line)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def run_offline_sweep_interleaved(
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
    """Every configuration's offline engine up at once; at each concurrency a
    warm-up each, then the configurations' passes in turn, `repeats` rounds in
    a rotating order, then each level's point (the median of its passes). A
    configuration whose engine fails to start, or ends mid-sweep, is reported
    failed with the tail of its log; the others go on."""
    from adaflash_vllm.bench.harness import (
        child_result,
        engine_env,
        mark_failed,
        pinned,
        result_path,
        turn_order,
        workload_json,
    )

    wl = workload_json(workload)
    outs = {c.name: result_path(out_dir, c.name) for c in configs}
    children: dict[str, OfflineEngineProcess] = {}
    logs: dict[str, IO[str]] = {}
    errors: dict[str, str] = {}
    try:
        for c in configs:
            job = {
                "target": setup.target,
                "config": asdict(c),
                "workload": wl,
                "setup": asdict(setup),
                "engine": engine,
                "out": str(outs[c.name]),
                "command": command,
                "repeats": repeats,
                "commands": True,
            }
            job_path = outs[c.name].with_suffix(".job.json")
            job_path.write_text(json.dumps(job))
            cmd = [sys.executable, "-m", "adaflash_vllm.bench.offline", str(job_path)]
            logs[c.name] = outs[c.name].with_suffix(".log").open("w")
            child = OfflineEngineProcess(
                c.name,
                pinned(cmd, cores),
                {**os.environ, **engine_env(cores)},
                logs[c.name],
            )
            print(f"  [{c.name}] starting", flush=True)
            try:
                child.start()
                children[c.name] = child
            except EngineExited as e:
                errors[c.name] = str(e)
                child.finish()
        live = [c.name for c in configs if c.name in children]

        def call(name: str, op: str, level: int) -> None:
            try:
                children[name].call(op, level)
            except EngineExited as e:
                errors[name] = str(e)
                live.remove(name)

        for level in wl["concurrencies"]:
            for name in list(live):
                call(name, "warm", level)
            for rep in range(repeats):
                for name in turn_order(list(live), rep):
                    if name in live:  # (not one that died this round)
                        call(name, "pass", level)
            for name in list(live):
                call(name, "point", level)
    finally:
        codes = {name: child.finish() for name, child in children.items()}
        for log in logs.values():
            log.close()
    results = []
    for c in configs:
        outs[c.name].with_suffix(".job.json").unlink(missing_ok=True)
        result = child_result(outs[c.name], c, setup, wl, command)
        error = errors.get(c.name)
        if error is None and codes.get(c.name, 0) != 0:
            error = f"engine process exit code {codes[c.name]}"
        if error is not None:
            mark_failed(result, outs[c.name], c.name, error)
        results.append(result)
    return results
