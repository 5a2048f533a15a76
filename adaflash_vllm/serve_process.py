"""Start and stop a real `vllm serve` subprocess (benchmarks, tests, the demo).

Example:
    >>> with ServeProcess(["MODEL", "--speculative-config", "adaflash.json"]) as srv:
    ...     requests.get(srv.url + "/health")
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from adaflash_vllm.errors import AdaFlashError


class ServerStartError(AdaFlashError, RuntimeError):
    """`vllm serve` exited or did not become healthy; the message has its log tail."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_executable() -> list[str]:
    exe = shutil.which("vllm") or str(Path(sys.executable).with_name("vllm"))
    return (
        [exe]
        if Path(exe).exists()
        else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    )


class ServeProcess:
    """`vllm serve ARGS --port P` in its own process group, log in a file.

    Args:
        args: arguments after `vllm serve` (model first).
        env: extra environment variables.
        startup_timeout_s: how long to wait for /health.
    """

    def __init__(
        self,
        args: list[str],
        *,
        env: dict[str, str] | None = None,
        startup_timeout_s: float = 300.0,
        port: int | None = None,
        log_path: str | Path | None = None,
    ):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [*vllm_executable(), "serve", *args, "--port", str(self.port)]
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.log_path = (
            Path(log_path)
            if log_path
            else Path(tempfile.mkstemp(prefix="vllm-serve-", suffix=".log")[1])
        )
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServeProcess:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.args,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServerStartError(
                    f"vllm serve exited with code {self.proc.returncode}:\n"
                    + self.log_tail()
                )
            if self.healthy():
                return
            time.sleep(1.0)
        self.stop()
        raise ServerStartError(
            f"vllm serve not healthy after {self.startup_timeout_s:.0f}s:\n"
            + self.log_tail()
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def metrics_text(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as r:
            return r.read().decode()


def parse_prometheus(text: str) -> dict[str, float]:
    """`name{labels}` -> value for every sample line (labels kept verbatim)."""
    values = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        try:
            values[key] = float(value)
        except ValueError:
            continue
    return values


def metric_sum(values: dict[str, float], name: str) -> float:
    """Sum of all samples of `name` (across label sets)."""
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))
