"""AdaFlash's rejection sampler against vLLM's, and a step without drafts sampled
by vLLM's plain sampler (patches.py W7) against vLLM's rejection sampler, on
synthetic logits (no engine)."""

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
def test_plain_sampling_of_a_step_without_drafts_equals_vllms_rejection_sampler(
    temperature,
):
    """W7 samples a step in which no request verifies a draft with the plain
    sampler: the same tokens as vLLM's rejection sampler with k_i = 0, from the
    same per-request generators (greedy, and sampled at temperature 0.8)."""
    drafts = [[] for _ in range(B)]
    for seed in range(5):
        logits = torch.randn(B, V, generator=torch.Generator().manual_seed(seed))
        plain = Sampler()(logits.clone(), _sampling(temperature, seed))
        _, ref = _run(RejectionSampler, drafts, temperature, seed, logits)
        assert plain.sampled_token_ids.shape == ref.sampled_token_ids.shape == (B, 1)
        assert torch.equal(
            plain.sampled_token_ids.to(ref.sampled_token_ids.dtype),
            ref.sampled_token_ids,
        )
    if temperature is None:
        assert torch.equal(plain.sampled_token_ids[:, 0].int(), logits.argmax(-1).int())


def test_steps_with_drafts_equal_vllms_rejection_sampler():
    drafts = [[1, 2]] + [[] for _ in range(B - 1)]  # one request verifies 2 drafts
    for temperature in (None, 0.8):
        logits = torch.randn(B + 2, V)
        _, ours = _run(AdaFlashRejectionSampler, drafts, temperature, 3, logits)
        _, ref = _run(RejectionSampler, drafts, temperature, 3, logits)
        assert torch.equal(ours.sampled_token_ids, ref.sampled_token_ids)


def test_a_step_without_drafts_is_counted_as_zero_draft_rounds():
    sampler = AdaFlashRejectionSampler(Sampler())
    sampler.record_bonus_only(B)
    stats = sampler.stats()
    assert stats["verify_hist"][0] == B
    assert sum(stats["drafted"]) == 0
    assert sampler.accepted_total() == 0
    sampler.recording = False  # dummy batches while profiling
    sampler.record_bonus_only(B)
    assert sampler.stats()["verify_hist"][0] == B


def test_counts_add_up_across_steps_without_and_with_drafts():
    sampler = AdaFlashRejectionSampler(Sampler())
    sampler.record_bonus_only(B)
    drafts = [[1, 2]] + [[] for _ in range(B - 1)]
    sampler(_metadata(drafts), None, torch.randn(B + 2, V), _sampling(None, 0))
    stats = sampler.stats()
    assert stats["verify_hist"][0] == 2 * B - 1 and stats["verify_hist"][2] == 1
    assert stats["drafted"][:2] == [1, 1] and sum(stats["drafted"]) == 2


@pytest.mark.parametrize("counts", ["host", "device"])
def test_counts_per_position_match_the_verified_tokens(counts):
    """Greedy drafts that match the target's argmax for a known prefix: the
    per-position counts and the accepted total are those prefixes, over steps
    with different K (the counters grow). `host`: a CPU's list counts;
    `device`: an accelerator's tensor counts, taken here on the CPU."""
    sampler = AdaFlashRejectionSampler(Sampler())
    if counts == "device":
        sampler._emitted = torch.zeros(1, dtype=torch.long)  # the tensor path
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
        # each request's tokens, once, for the length head's history
        taken = sampler.take_emitted()
        assert isinstance(taken, torch.Tensor) and (taken - 1).tolist() == matches
        assert sampler.take_emitted() is None
        for k, m in zip(ks, matches, strict=True):
            want_hist[k] += 1
            for j in range(k):
                want_drafted[j] += 1
            for j in range(m):
                want_accepted[j] += 1
        assert sampler.accepted_total() == sum(want_accepted)  # after every step
        sampler.record_bonus_only(B)  # accepts nothing: the total holds
        want_hist[0] += B
        assert sampler.accepted_total() == sum(want_accepted)
    stats = sampler.stats()
    assert stats["verify_hist"] == want_hist
    assert stats["drafted"] == want_drafted
    assert stats["accepted"] == want_accepted
    assert sampler.accepted_total() == sum(want_accepted)
    assert (sampler._emitted is None) == (counts == "host")
