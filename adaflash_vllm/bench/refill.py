"""Per-window accounting of a refilled shift stream.

The whole stream (every phase's prompts, in order) is queued at once and the
engine keeps `window` requests in flight, taking the next from the queue as
soon as one finishes, as `vllm serve` does for `window` clients and as one
`LLM.generate` of the whole stream does with `max_num_seqs` = window. Requests
then end at different steps, so a phase's windows overlap in time with each
other and, at a phase boundary, with the next phase's.

`RefillWindows` turns the engine's steps into windows per phase: a phase's
window closes each time `window` more of its requests have finished (and at its
last request). Throughput is counted by time: each step's wall time is shared
among the phases by the number of that phase's requests in the step, and a
window's tok/s is its phase's tokens over its phase's share of the time since
its window before. tau and verify length are counted by request: over the whole
lives of the requests that finished in the window, from their outputs (decoding
steps: every output after the prompt's) and vLLM's per-request draft counts
(`per_request_spec_decode_metrics`), so near a phase boundary each phase keeps
its own. Closed windows come out in phase order: a window of a later phase that
closes while an earlier phase still has requests running waits until that
phase's last window has come out.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Drafts:
    """One finished request's drafts (vLLM's `RequestSpecDecodeMetrics`)."""

    drafted: int  # draft tokens verified
    rounds: int  # decoding steps that verified at least one draft
    accepted: int  # draft tokens accepted


@dataclass
class RefillWindow:
    phase: int  # index into the stream's phases
    index: int  # window number within its phase
    requests: int = 0  # the phase's requests that finished in the window
    tokens: int = 0  # output tokens the phase's requests received in it
    seconds: float = 0.0  # the phase's share of the window's step time
    # over the whole lives of the requests that finished in the window:
    decode_rows: int = 0  # (request, decoding step) pairs: rounds
    decode_tokens: int = 0  # tokens those steps emitted (cut at max_tokens)
    drafted: int = 0
    spec_rounds: int = 0
    accepted: int = 0
    has_drafts: bool = False  # some request reported its drafts

    @property
    def tau(self) -> float:
        """Tokens per round: 1 + accepted drafts per round where the engine
        counted drafts (as its counters do: an accepted draft cut off at
        max_tokens still counts), else tokens per round from the outputs."""
        if not self.decode_rows:
            return 1.0
        if self.has_drafts:
            return 1 + self.accepted / self.decode_rows
        return self.decode_tokens / self.decode_rows

    @property
    def verify_len(self) -> float:
        return 1 + self.drafted / self.decode_rows if self.decode_rows else 1.0

    @property
    def tau_speculative(self) -> float | None:
        return 1 + self.accepted / self.spec_rounds if self.spec_rounds else None

    @property
    def verify_len_speculative(self) -> float | None:
        return 1 + self.drafted / self.spec_rounds if self.spec_rounds else None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class RefillWindows:
    """Windows of `window` finished requests per phase, from engine steps.

    `phase_of[i]`: the phase index of request i (requests numbered in stream
    order). Feed every step to `add_step`; it returns the windows that came out.
    """

    def __init__(self, phase_of: list[int], window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.phase_of = list(phase_of)
        self.window = window
        phases = max(self.phase_of) + 1 if self.phase_of else 0
        if sorted(self.phase_of) != self.phase_of:
            raise ValueError("requests must come in phase order")
        self.size = [self.phase_of.count(p) for p in range(phases)]
        self.finished = [0] * phases
        self.open: list[RefillWindow | None] = [None] * phases
        self.next_index = [0] * phases
        self.pending: list[RefillWindow] = []  # closed, waiting for phase order
        self.next_phase_out = 0
        self.lives: dict[int, list[int]] = {}  # running: [rounds, decode tokens]
        self.done: set[int] = set()
        self.first_left = 0  # the oldest request not finished

    def _window(self, phase: int) -> RefillWindow:
        w = self.open[phase]
        if w is None:
            w = RefillWindow(phase, self.next_index[phase])
            self.next_index[phase] += 1
            self.open[phase] = w
        return w

    def add_step(
        self,
        seconds: float,
        outputs: list[tuple[int, int, bool, Drafts | None]],
    ) -> list[RefillWindow]:
        """One engine step of `seconds` (wall time since the step before) and its
        outputs: (request index, new tokens, finished, the request's drafts when
        it finished and the engine counted them) per request that got tokens.
        Returns the windows that came out, in phase order."""
        rows = [0] * len(self.size)
        if outputs:
            for i, *_ in outputs:
                rows[self.phase_of[i]] += 1
        else:  # a step with no output (a prompt chunk): the oldest request's phase
            left = next(
                (
                    i
                    for i in range(self.first_left, len(self.phase_of))
                    if i not in self.done
                ),
                None,
            )
            if left is not None:
                rows[self.phase_of[left]] = 1
        total = sum(rows)
        for phase, n in enumerate(rows):
            if n:
                self._window(phase).seconds += seconds * n / total
        closing: list[int] = []
        for i, new, finished, drafts in outputs:
            phase = self.phase_of[i]
            w = self._window(phase)
            w.tokens += new
            if i in self.lives:
                life = self.lives[i]
                life[0] += 1
                life[1] += new
            else:  # the prompt's step: its first token, not a round
                self.lives[i] = [0, 0]
            if not finished or i in self.done:
                continue
            self.done.add(i)
            while self.first_left in self.done:
                self.first_left += 1
            rounds, tokens = self.lives.pop(i)
            w.requests += 1
            w.decode_rows += rounds
            w.decode_tokens += tokens
            if drafts is not None:
                w.has_drafts = True
                w.drafted += drafts.drafted
                w.spec_rounds += drafts.rounds
                w.accepted += drafts.accepted
            self.finished[phase] += 1
            if (
                self.finished[phase] % self.window == 0
                or self.finished[phase] == self.size[phase]
            ) and phase not in closing:
                closing.append(phase)
        for phase in closing:
            w = self.open[phase]
            assert w is not None
            self.open[phase] = None
            self.pending.append(w)
        return self._release()

    def _release(self) -> list[RefillWindow]:
        out = []
        while self.next_phase_out < len(self.size):
            p = self.next_phase_out
            ready = [w for w in self.pending if w.phase == p]
            ready.sort(key=lambda w: w.index)
            out += ready
            self.pending = [w for w in self.pending if w.phase != p]
            if self.finished[p] < self.size[p]:
                break
            self.next_phase_out += 1
        return out
