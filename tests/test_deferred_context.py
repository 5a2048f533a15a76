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
