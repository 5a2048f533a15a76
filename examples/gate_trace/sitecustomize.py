"""Trace every draft-gate decision and credited round of an AdaFlash engine, for
`examples/gate_rounds.py`. Put this folder on PYTHONPATH and set
ADAFLASH_GATE_TRACE=PREFIX: each process that imports the gate appends to
PREFIX.<pid> (`vllm serve` engine cores included; other processes write nothing).

    PYTHONPATH=examples/gate_trace ADAFLASH_GATE_TRACE=/tmp/gate \
        python examples/compare_served.py --configs plain,cost_aware ...
    python examples/gate_rounds.py /tmp/gate

Lines: `S time num_reqs drafted following exploring held` for each decision,
then `G num_reqs step model_ratio passed_checks draft_rate skip_rate`: the state
of that batch size's gate after it (its own step count, the cost model's
estimate of drafting over plain, the due checks of skipping it passed so far,
and the two modes' measured tokens per ms; `-` where not yet known), and
`R time drafted tokens ms` for each round credited to the gate (the round of the
decision before it). A measurement aid: it wraps two methods of
`BatchSizeGates` at interpreter start and is never imported by the package.
"""

import os
import time

_PREFIX = os.environ.get("ADAFLASH_GATE_TRACE")


def _install(prefix: str) -> None:
    from adaflash_vllm.proposers import draft_gate

    gates = draft_gate.BatchSizeGates
    should_draft, record_round = gates.should_draft, gates.record_round
    state = {"file": None}

    def out():
        if state["file"] is None:  # opened on first use: only engine processes
            # kept open for the process's life (line-buffered)
            state["file"] = open(f"{prefix}.{os.getpid()}", "a", buffering=1)  # noqa: SIM115
        return state["file"]

    def traced_should_draft(self, num_reqs, plain_ms=None, can_check=True):
        draft = should_draft(self, num_reqs, plain_ms, can_check)
        g = self.current
        exploring = g.step < g.exploring_until
        out().write(
            f"S {time.perf_counter():.6f} {num_reqs} {int(draft)} "
            f"{int(g.drafting)} {int(exploring)} {int(g.held)}\n"
            f"G {num_reqs} {g.step} {_num(g.model_ratio)} "
            f"{sum(g.passed_checks.values())} {_num(g.draft_rate.ratio())} "
            f"{_num(g.skip_rate.ratio())}\n"
        )
        return draft

    def traced_record_round(self, *, drafted, tokens, ms):
        out().write(
            f"R {time.perf_counter():.6f} {int(drafted)} {tokens:.2f} {ms:.3f}\n"
        )
        return record_round(self, drafted=drafted, tokens=tokens, ms=ms)

    gates.should_draft = traced_should_draft
    gates.record_round = traced_record_round


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


if _PREFIX:
    _install(_PREFIX)
