"""Run a module pinned to CPU cores from its first import on.

    python -m adaflash_vllm.pinned 1,2 adaflash_vllm.cli trainer --config ...

The engine spawns the online trainer this way: importing torch and vLLM alone
takes seconds of CPU, which must not land on the engine's cores. (Pinning in a
`preexec_fn` would run Python between fork and exec of a threaded process.)
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python -m adaflash_vllm.pinned CORES MODULE [ARGS...]")
    cores, module, *rest = sys.argv[1:]
    os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    sys.argv = [module, *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
