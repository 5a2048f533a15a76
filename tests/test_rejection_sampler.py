"""The rejection sampler's bonus-only path (every k_i = 0) against vLLM's full one,
on synthetic logits (no engine)."""

import pytest
import torch
from adaflash_vllm.proposers.rejection_sampler import AdaFlashRejectionSampler
from vllm.v1.sample.logits_processor import LogitsProcessors
from vllm.v1.sample.metadata import SamplingMetadata
from vllm.v1.sample.rejection_sampler import RejectionSampler
from vllm.v1.sample.sampler import Sampler
from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

B, V = 6, 50


@pytest.fixture(autouse=True, scope="module")
def _cpu_kernels():
    """What a CPU worker installs before its first step: vLLM's CPU overrides of
    its Triton kernels (and our fix of one of them); restored afterwards."""
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    from adaflash_vllm import patches

    saved = dict(dispatcher._registry)
    current_platform.register_triton_kernel_overrides()
    patches._fix_cpu_expand_kernel()
    yield
    dispatcher._registry.clear()
    dispatcher._registry.update(saved)
    patches._APPLIED.pop("W3", None)


def _sampling(temperature: float | None, seed: int, logprobs: int | None = None):
    greedy = temperature is None
    return SamplingMetadata(
        temperature=None if greedy else torch.full((B,), temperature),
        all_greedy=greedy,
        all_random=not greedy,
        top_p=None,
        top_k=None,
        generators={
            i: torch.Generator().manual_seed(seed + i) for i in range(B) if not greedy
        },
        max_num_logprobs=logprobs,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(B),
        presence_penalties=torch.zeros(B),
        repetition_penalties=torch.ones(B),
        output_token_ids=[[] for _ in range(B)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
        spec_token_ids=[[] for _ in range(B)],
    )


def _metadata(drafts: list[list[int]]) -> SpecDecodeMetadata:
    """What the model runner builds: request i owns logits rows
    [start_i, start_i + k_i], its k_i draft positions then its bonus position."""
    num = torch.tensor([len(d) for d in drafts], dtype=torch.int32)
    cu_sampled = torch.cumsum(num + 1, 0, dtype=torch.int32)
    starts = cu_sampled - num - 1
    target = [int(s) + j for s, k in zip(starts, num, strict=True) for j in range(k)]
    return SpecDecodeMetadata(
        draft_token_ids=torch.tensor(sum(drafts, []), dtype=torch.int32),
        num_draft_tokens=num.tolist(),
        cu_num_draft_tokens=torch.cumsum(num, 0, dtype=torch.int32),
        cu_num_sampled_tokens=cu_sampled,
        target_logits_indices=torch.tensor(target, dtype=torch.int32),
        bonus_logits_indices=(starts + num).int(),
        logits_indices=torch.arange(int(cu_sampled[-1]), dtype=torch.int32),
    )


def _run(sampler_cls, drafts, temperature, seed, logits, logprobs=None):
    sampler = sampler_cls(Sampler())
    metadata = _metadata(drafts)
    out = sampler(
        metadata, None, logits.clone(), _sampling(temperature, seed, logprobs)
    )
    return sampler, out


@pytest.mark.parametrize("temperature", [None, 0.8], ids=["greedy", "sampled"])
def test_bonus_only_step_equals_vllms_rejection_sampler(temperature):
    drafts = [[] for _ in range(B)]
    for seed in range(5):
        logits = torch.randn(B, V, generator=torch.Generator().manual_seed(seed))
        _, ours = _run(AdaFlashRejectionSampler, drafts, temperature, seed, logits)
        _, ref = _run(RejectionSampler, drafts, temperature, seed, logits)
        assert ours.sampled_token_ids.shape == ref.sampled_token_ids.shape == (B, 1)
        assert ours.sampled_token_ids.dtype == ref.sampled_token_ids.dtype
        assert torch.equal(ours.sampled_token_ids, ref.sampled_token_ids)
        assert ours.logprobs_tensors is None
    if temperature is None:
        assert torch.equal(ours.sampled_token_ids[:, 0], logits.argmax(-1).int())


def test_bonus_only_step_is_counted_as_zero_draft_rounds():
    logits = torch.randn(B, V)
    sampler, _ = _run(AdaFlashRejectionSampler, [[] for _ in range(B)], None, 0, logits)
    stats = sampler.stats()
    assert stats["verify_hist"][0] == B
    assert sum(stats["drafted"]) == 0
    assert sampler.accepted_total() == 0


def test_counts_add_up_across_bonus_only_and_drafting_steps():
    sampler = AdaFlashRejectionSampler(Sampler())
    for drafts in ([[] for _ in range(B)], [[1, 2]] + [[] for _ in range(B - 1)]):
        logits = torch.randn(B + sum(map(len, drafts)), V)
        sampler(_metadata(drafts), None, logits, _sampling(None, 0))
    stats = sampler.stats()
    assert stats["verify_hist"][0] == 2 * B - 1 and stats["verify_hist"][2] == 1
    assert stats["drafted"][:2] == [1, 1] and sum(stats["drafted"]) == 2


def test_steps_with_drafts_or_logprobs_take_vllms_path(monkeypatch):
    calls = []
    monkeypatch.setattr(
        AdaFlashRejectionSampler,
        "_sample_bonus_only",
        lambda *a, **k: calls.append(1),
    )
    drafts = [[1, 2]] + [[] for _ in range(B - 1)]  # one request verifies 2 drafts
    logits = torch.randn(B + 2, V)
    _, ours = _run(AdaFlashRejectionSampler, drafts, None, 0, logits)
    _, ref = _run(RejectionSampler, drafts, None, 0, logits)
    assert torch.equal(ours.sampled_token_ids, ref.sampled_token_ids)
    _, with_logprobs = _run(
        AdaFlashRejectionSampler, [[] for _ in range(B)], None, 0, logits[:B], 2
    )
    assert with_logprobs.logprobs_tensors is not None
    assert calls == []


def test_counts_per_position_match_the_verified_tokens():
    """Greedy drafts that match the target's argmax for a known prefix: the
    per-position counts and the accepted total are those prefixes, over steps
    with different K (the counters grow)."""
    sampler = AdaFlashRejectionSampler(Sampler())
    want_drafted, want_accepted, want_hist = [0] * 5, [0] * 5, [0] * 6
    gen = torch.Generator().manual_seed(0)
    for step, k_max in enumerate((3, 5, 2)):
        ks = [(i + step) % (k_max + 1) for i in range(B)]
        matches = [min(k, (i * 7 + step) % (k + 1)) for i, k in enumerate(ks)]
        logits = torch.randn(sum(ks) + B, V, generator=gen)
        drafts, row = [], 0
        for k, m in zip(ks, matches, strict=True):
            top = logits[row : row + k].argmax(-1).tolist()
            # Drafts 1..m are the target's argmax; draft m + 1 is not.
            drafts.append([t if j < m else (t + 1) % V for j, t in enumerate(top)])
            row += k + 1
        out = sampler(_metadata(drafts), None, logits, _sampling(None, 0))
        emitted = (out.sampled_token_ids >= 0).sum(-1) - 1
        assert emitted.tolist() == matches
        for k, m in zip(ks, matches, strict=True):
            want_hist[k] += 1
            for j in range(k):
                want_drafted[j] += 1
            for j in range(m):
                want_accepted[j] += 1
        assert sampler.accepted_total() == sum(want_accepted)  # after every step
        bonus_only = [[] for _ in range(B)]  # accepts nothing: the total holds
        sampler(_metadata(bonus_only), None, torch.randn(B, V), _sampling(None, 0))
        want_hist[0] += B
        assert sampler.accepted_total() == sum(want_accepted)
    stats = sampler.stats()
    assert stats["verify_hist"] == want_hist
    assert stats["drafted"] == want_drafted
    assert stats["accepted"] == want_accepted
    assert sampler.accepted_total() == sum(want_accepted)


def test_bonus_only_step_samples_the_logits_without_a_gather():
    seen = []

    class Recording(Sampler):
        def forward(self, logits, sampling_metadata, **kwargs):
            seen.append(logits)
            return super().forward(logits, sampling_metadata, **kwargs)

    sampler = AdaFlashRejectionSampler(Recording())
    logits = torch.randn(B, V)
    sampler(_metadata([[] for _ in range(B)]), None, logits, _sampling(None, 0))
    assert seen[0].data_ptr() == logits.data_ptr()
