"""The interleaved offline sweep's parent side (`OfflineEngineProcess`) against
real child processes that speak its protocol without an engine: commands in,
DONE out, log lines kept, a child that dies reported (the real engines:
tests/engine/test_bench.py)."""

import io
import sys
import textwrap

import pytest

from adaflash_vllm.bench.offline import DONE, READY
from adaflash_vllm.bench.offline_interleaved import EngineExited, OfflineEngineProcess

CHILD = textwrap.dedent(
    f"""
    import json, sys
    mode = sys.argv[1]
    print("INFO loading the engine", flush=True)
    if mode == "no_start":
        sys.exit(3)
    print({READY!r}, flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "end":
            break
        if mode == "dies":
            sys.exit(4)
        print(f"[child] {{cmd['op']}} at {{cmd['level']}}", flush=True)
        print({DONE!r}, flush=True)
    print("saved", flush=True)
    """
)


def _child(tmp_path, mode: str) -> tuple[OfflineEngineProcess, io.StringIO]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    log = io.StringIO()
    return OfflineEngineProcess(
        "child", [sys.executable, str(script), mode], {}, log
    ), log


def test_commands_are_answered_and_the_log_kept(tmp_path, capsys):
    child, log = _child(tmp_path, "ok")
    child.start()
    child.call("warm", 4)
    child.call("pass", 4)
    assert child.finish() == 0
    text = log.getvalue()
    assert "INFO loading the engine" in text and "saved" in text
    assert "[child] pass at 4" in text and READY not in text and DONE not in text
    assert "[child] warm at 4" in capsys.readouterr().out  # progress on the console


def test_a_child_that_dies_is_reported(tmp_path):
    child, _ = _child(tmp_path, "dies")
    child.start()
    with pytest.raises(EngineExited, match="exited \\(code 4\\)"):
        child.call("pass", 1)
    assert child.finish() == 4


def test_a_child_that_never_starts_is_reported(tmp_path):
    child, log = _child(tmp_path, "no_start")
    with pytest.raises(EngineExited, match="code 3"):
        child.start()
    assert "loading the engine" in log.getvalue()
