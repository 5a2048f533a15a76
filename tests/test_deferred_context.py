"""Skipped steps' context K/V: queued, then written in one pass in step order."""

import types

import torch
from adaflash_vllm.proposers.proposer import _DeferredContext


class _RecordingModel:
    """Stands in for the DFlash model's two context-only calls."""

    def __init__(self):
        self.writes = []

    def combine_hidden_states(self, states):
        return states * 2.0

    def precompute_and_store_context_kv(self, states, positions, slots):
        self.writes.append((states.clone(), positions.clone(), slots.clone()))


def test_steps_written_once_in_order_from_copies_of_reused_buffers():
    model, queue = _RecordingModel(), _DeferredContext()
    positions, slots = torch.arange(8), torch.arange(100, 108)  # runner buffers
    features = torch.ones(8, 3)
    queue.add(features[:2].clone(), positions[:2], slots[:2])
    positions += 10  # the runner reuses its buffers for the next step
    slots += 10
    queue.add(features[:3] * 3, positions[:3], slots[:3])
    assert queue.tokens == 5
    assert queue.write(model).steps == 2
    ((states, pos, slot),) = model.writes
    assert pos.tolist() == [0, 1, 10, 11, 12]
    assert slot.tolist() == [100, 101, 110, 111, 112]
    assert states[:, 0].tolist() == [2.0, 2.0, 6.0, 6.0, 6.0]
    assert queue.tokens == 0 and queue.write(model).steps == 0  # nothing twice
    assert len(model.writes) == 1


def test_a_view_of_the_model_output_is_copied():
    model, queue = _RecordingModel(), _DeferredContext()
    output = torch.zeros(4, 3)
    queue.add(output[:2], torch.arange(2), torch.arange(2))
    output.fill_(5.0)  # next forward overwrites the buffer
    queue.write(model)
    assert model.writes[0][0].eq(0.0).all()


def test_tokens_of_a_drafting_round_are_not_charged_to_skipping():
    """The first skipped step after a drafting one queues that round's verified
    tokens (1 + k per request): written with the rest, not charged to skipping."""
    model, queue = _RecordingModel(), _DeferredContext()
    queue.add(torch.ones(8, 3), torch.arange(8), torch.arange(8), charged=False)
    queue.add(torch.ones(2, 3), torch.arange(2), torch.arange(2))
    queue.add(torch.ones(2, 3), torch.arange(2), torch.arange(2))
    written = queue.write(model)
    assert (written.steps, written.tokens) == (3, 12)
    assert (written.charged_tokens, written.charged_steps) == (4, 2)
    assert queue.write(model).charged_tokens == 0


def test_a_skipped_step_queues_its_context_unless_upkeep_is_off():
    """adaflash_debug_context_upkeep(False) (measurements): a skipped step then
    queues nothing, and still verifies 0 drafts per request."""
    from adaflash_vllm.proposers.proposer import AdaFlashProposer, _Opened

    proposer = types.SimpleNamespace(
        _deferred=_DeferredContext(),
        context_upkeep=False,
        retire_when_skipping=False,
        draft_gate=types.SimpleNamespace(record_skip=lambda ms: None),
        device=torch.device("cpu"),
        _synced_clock=lambda: 1.0,
        _remember_propose=lambda *args: None,
    )
    opened = _Opened(0.5, ["a", "b"], frozenset({"a", "b"}), None, False)

    def skip():
        return AdaFlashProposer._skip_drafting(
            proposer,
            opened,
            num_speculative_tokens=3,
            target_positions=torch.arange(2),
            target_hidden_states=torch.zeros(2, 6),
            common_attn_metadata=types.SimpleNamespace(slot_mapping=torch.arange(2)),
        )

    skip()
    assert proposer._deferred.tokens == 0
    assert proposer._budgets == {"a": 0, "b": 0}
    proposer.context_upkeep = True
    skip()
    assert proposer._deferred.tokens == 2


def _retiring_proposer(decisive: bool):
    """A stand-in proposer with `retire_when_skipping` on: three requests, "p" in
    its prompt (3 tokens this step), "d1" and "d2" in decode (1 token each),
    cache blocks of 4 slots."""
    import numpy as np
    from adaflash_vllm.proposers.proposer import AdaFlashProposer

    proposer = types.SimpleNamespace(
        _deferred=_DeferredContext(),
        context_upkeep=True,
        retire_when_skipping=True,
        retire_always=False,
        retired=None,
        _steady=None,  # (the steady skipping state: tests/test_steady_skip.py)
        block_size=4,
        draft_gate=types.SimpleNamespace(
            record_skip=lambda ms: None,
            current=types.SimpleNamespace(
                drafting=False,
                held=False,
                check_waiting=False,
                skips_decisively=lambda margin=None: decisive,
                retire_margin=1.25,
            ),
        ),
        device=torch.device("cpu"),
        _synced_clock=lambda: 1.0,
        _remember_propose=lambda *args: None,
        _runner=types.SimpleNamespace(
            input_batch=types.SimpleNamespace(
                num_computed_tokens_cpu=np.array([0, 20, 30]),
                num_prompt_tokens=np.array([10, 12, 9]),
            )
        ),
    )
    proposer._retire_rows = lambda *a: AdaFlashProposer._retire_rows(proposer, *a)
    proposer._retire_every_row = lambda *a: AdaFlashProposer._retire_every_row(
        proposer, *a
    )
    proposer._retiring_now = lambda: AdaFlashProposer._retiring_now(proposer)
    proposer._every_row_retired = lambda ids: AdaFlashProposer._every_row_retired(
        proposer, ids
    )
    return proposer


def _skip_step(proposer, req_ids, context: bool = True):
    """A skipped step of the three requests; without `context`, as propose_early
    calls it where no row keeps its upkeep (no positions or features)."""
    from adaflash_vllm.proposers.proposer import AdaFlashProposer, _Opened

    AdaFlashProposer._skip_drafting(
        proposer,
        _Opened(0.5, req_ids, frozenset(req_ids), None, False),
        num_speculative_tokens=3,
        target_positions=torch.tensor([0, 1, 2, 20, 30]) if context else None,
        target_hidden_states=(
            torch.arange(5.0).unsqueeze(1).expand(5, 6) if context else None
        ),
        num_context=5,
        common_attn_metadata=types.SimpleNamespace(
            slot_mapping=torch.tensor([40, 41, 42, 9, 13]),
            query_start_loc_cpu=torch.tensor([0, 3, 4, 5]),
        ),
    )


def test_a_decisive_skip_retires_every_request_of_the_step():
    """Where the gate skips decisively, no row's context is queued, prompts'
    included (their requests retire, their blocks hold holes)."""
    proposer = _retiring_proposer(decisive=True)
    _skip_step(proposer, ["p", "d1", "d2"])
    assert proposer._deferred.tokens == 0
    assert proposer.retired.retired == {"p", "d1", "d2"}
    assert proposer.retired.holey == {10, 2, 3}  # slots 40-42, 9, 13: blocks of 4
    assert proposer._budgets == {"p": 0, "d1": 0, "d2": 0}


def test_retired_requests_stay_without_upkeep_once_skipping_is_not_decisive():
    proposer = _retiring_proposer(decisive=True)
    _skip_step(proposer, ["p", "d1", "d2"])
    proposer.draft_gate.current.skips_decisively = lambda margin=None: False
    proposer._deferred = _DeferredContext()
    proposer.retired.retired.discard("d2")  # as if d2 had not been retired
    _skip_step(proposer, ["p", "d1", "d2"])
    assert torch.cat(proposer._deferred.slots).tolist() == [13]


def test_no_retirement_while_skipping_is_not_decisive():
    proposer = _retiring_proposer(decisive=False)
    _skip_step(proposer, ["p", "d1", "d2"])
    assert proposer._deferred.tokens == 5
    assert not proposer.retired.retired and not proposer.retired.holey


def test_a_bucket_held_to_skipping_retires_too():
    """A larger batch held to skipping by a smaller one's decisive skipping
    (draft_gate.py) retires as that one would; not while it follows drafting
    (a skipped step there is a check of skipping)."""
    proposer = _retiring_proposer(decisive=False)
    proposer.draft_gate.current.held = True
    proposer.draft_gate.current.drafting = True
    _skip_step(proposer, ["p", "d1", "d2"])
    assert not proposer.retired.retired
    proposer.draft_gate.current.drafting = False
    _skip_step(proposer, ["p", "d1", "d2"])
    assert proposer.retired.retired == {"p", "d1", "d2"}


def test_no_new_retirement_while_a_check_of_drafting_waits():
    """A skipped step while a check of drafting waits for a batch without
    retired requests (draft_gate.py `check_waiting`): nobody new retires, and
    those still retired get no upkeep (in the engine `_open_step` has let the
    step's retired requests draft again first: `_settle_retired`)."""
    proposer = _retiring_proposer(decisive=True)
    _skip_step(proposer, ["p", "d1", "d2"])
    proposer.retired.retired.discard("d2")  # as if d2 had not been retired
    proposer._deferred = _DeferredContext()
    proposer.draft_gate.current.check_waiting = True
    _skip_step(proposer, ["p", "d1", "d2"])
    assert torch.cat(proposer._deferred.slots).tolist() == [13]
    assert proposer.retired.retired == {"p", "d1"}


def test_upkeep_tokens_kept_and_dropped_are_counted():
    proposer = _retiring_proposer(decisive=False)
    _skip_step(proposer, ["p", "d1", "d2"])
    assert proposer.retired.to_dict()["upkeep_kept_tokens"] == 5
    proposer.draft_gate.current.skips_decisively = lambda margin=None: True
    _skip_step(proposer, ["p", "d1", "d2"])
    state = proposer.retired.to_dict()
    assert state["upkeep_kept_tokens"] == 5 and state["upkeep_dropped_tokens"] == 5


def test_a_step_of_retired_requests_reads_no_context_while_a_check_waits():
    """Every request of the step retired already, the engine not retiring now
    (a check of drafting waits): no row keeps its upkeep, so propose_early
    gathers no context for it (`_every_row_retired`), and the step drops every
    row at once, marking their blocks. One request not retired: its row is
    kept, and the context is gathered."""
    proposer = _retiring_proposer(decisive=True)
    _skip_step(proposer, ["p", "d1", "d2"])
    proposer.draft_gate.current.check_waiting = True
    assert not proposer._retiring_now()
    assert proposer._every_row_retired(["p", "d1", "d2"])
    proposer.retired.holey.clear()
    _skip_step(proposer, ["p", "d1", "d2"], context=False)
    assert proposer._deferred.tokens == 0
    assert proposer.retired.holey == {10, 2, 3}
    assert proposer.retired.to_dict()["upkeep_dropped_tokens"] == 10
    proposer.retired.retired.discard("d2")
    assert not proposer._every_row_retired(["p", "d1", "d2"])
    proposer.retire_when_skipping = False  # retired ones stay, nobody drops rows
    proposer.retired.retired.add("d2")
    assert not proposer._every_row_retired(["p", "d1", "d2"])


def _settle(proposer, batch, draft: bool) -> bool:
    from adaflash_vllm.proposers.proposer import AdaFlashProposer

    return AdaFlashProposer._settle_retired(proposer, frozenset(batch), draft)


def test_retired_requests_draft_again_where_their_batch_size_drafts():
    """The gate says draft where the engine no longer retires (the load fell):
    the step's retired requests draft again, their blocks keep the holes."""
    proposer = _retiring_proposer(decisive=True)
    _skip_step(proposer, ["p", "d1", "d2"])
    proposer.draft_gate.current.drafting = True
    assert _settle(proposer, ["p", "d1"], draft=True)
    assert proposer.retired.retired == {"d2"}
    assert proposer.retired.unretired_total == 2
    assert proposer.retired.holey == {10, 2, 3}


def test_retired_requests_stay_retired_while_the_engine_retires():
    """Where skipping is still decisive a drafting step (an exploration) leaves
    them retired, and a batch of retired requests only does not draft."""
    proposer = _retiring_proposer(decisive=True)
    _skip_step(proposer, ["p", "d1", "d2"])
    assert not _settle(proposer, ["p", "d1"], draft=True)  # nobody would verify
    assert _settle(proposer, ["p", "new"], draft=True)  # "new" drafts, p does not
    assert not _settle(proposer, ["p", "d1"], draft=False)
    assert proposer.retired.retired == {"p", "d1", "d2"}
    assert proposer.retired.unretired_total == 0


def test_a_waiting_check_of_drafting_lets_the_retired_draft_again():
    """A check of drafting due at a batch with retired requests waits one step
    (`check_waiting`), in which they draft again: the check then runs on every
    request, instead of waiting until they finish (which, with two long
    requests alone at a skipping batch size, was never)."""
    proposer = _retiring_proposer(decisive=True)
    _skip_step(proposer, ["p", "d1", "d2"])
    proposer.draft_gate.current.check_waiting = True
    assert not _settle(proposer, ["d1", "d2"], draft=False)  # this step skips
    assert proposer.retired.retired == {"p"}
