"""Whether to run the drafter at all this step (`cost_aware` with `skip_drafting`).

Budgets can only trim verification; the drafter's own forward (a block of K + 1
query tokens per request plus K rows of lm_head) is paid before any budget is
chosen. When even the best budgets emit fewer tokens per millisecond than plain
decoding would, the step is better off without a draft: the proposer then only
writes the new context K/V (so the drafter's cache stays in sync) and every request
verifies 0 drafts, which the target serves as a plain decode step.

The decision needs an estimate for a step not taken, so the gate compares, at each
step that did draft,

    rate_draft = expected emitted tokens / (verify_ms(B + b*) + draft_ms)
    rate_plain = B / (verify_ms(B) + context_ms)

and after a losing draft step skips drafting for `interval` steps, then drafts once
more to re-measure (a probe). A probe that loses again doubles the interval (up to
`max_interval`), one that wins resets it. A batch that shrank by a quarter since
the decision probes at once: drafting gets cheaper relative to its gain as the
batch shrinks.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DraftGate:
    min_interval: int = 4
    max_interval: int = 64
    skipping: bool = False
    interval: int = 4
    step: int = 0
    probe_at: int = 0  # step at which the next probe drafts
    decided_batch: int = 0  # batch size when skipping was decided
    drafted_steps: int = 0
    skipped_steps: int = 0
    context_ms: float = 0.0  # EMA of a skipped step's context-only propose time

    def should_draft(self, num_reqs: int) -> bool:
        """Called once per step before proposing."""
        self.step += 1
        draft = (
            not self.skipping
            or self.step >= self.probe_at
            or 4 * num_reqs <= 3 * self.decided_batch
        )
        if draft:
            self.drafted_steps += 1
        else:
            self.skipped_steps += 1
        return draft

    def record_draft(
        self,
        *,
        num_reqs: int,
        expected_tokens: float,
        verify_ms: float,
        draft_ms: float,
        plain_verify_ms: float,
    ) -> bool:
        """After a drafting step: decide whether the next steps draft. Returns
        whether drafting won (its expected tokens per ms beat plain decoding's)."""
        rate_draft = expected_tokens / max(verify_ms + draft_ms, 1e-6)
        rate_plain = num_reqs / max(plain_verify_ms + self.context_ms, 1e-6)
        won = rate_draft >= rate_plain
        if won:
            self.skipping, self.interval = False, self.min_interval
            return True
        if self.skipping:  # a probe that lost again: back off
            self.interval = min(2 * self.interval, self.max_interval)
        else:
            self.interval = self.min_interval
        self.skipping = True
        self.probe_at = self.step + self.interval
        self.decided_batch = num_reqs
        return False

    def record_skip(self, context_ms: float, ema: float = 0.2) -> None:
        """After a skipped step: the context-only propose time it took."""
        if self.context_ms == 0.0:
            self.context_ms = context_ms
        else:
            self.context_ms += ema * (context_ms - self.context_ms)

    def to_dict(self) -> dict:
        return {
            "skipping": self.skipping,
            "interval": self.interval,
            "drafted_steps": self.drafted_steps,
            "skipped_steps": self.skipped_steps,
            "context_ms": self.context_ms,
        }


class ScriptedDraftGate:
    """Drafts on every `draft_every`-th step only, whatever the timings (tests and
    debugging: puts skipped steps at known places)."""

    def __init__(self, draft_every: int):
        if draft_every < 1:
            raise ValueError(f"draft_every must be >= 1, got {draft_every}")
        self.draft_every = draft_every
        self.step = self.drafted_steps = self.skipped_steps = 0

    def should_draft(self, num_reqs: int) -> bool:
        self.step += 1
        draft = self.step % self.draft_every == 0
        self.drafted_steps += draft
        self.skipped_steps += not draft
        return draft

    def record_draft(self, **_: float) -> bool:
        return True

    def record_skip(self, context_ms: float) -> None:
        pass

    def to_dict(self) -> dict:
        return {
            "draft_every": self.draft_every,
            "drafted_steps": self.drafted_steps,
            "skipped_steps": self.skipped_steps,
        }
