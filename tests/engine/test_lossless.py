"""AdaFlash in the real vLLM engine is lossless: token-identical at temperature 0,
distribution-identical at temperature 1, with fixed K and with ragged budgets."""

import pytest
from scipy.stats import chi2_contingency

from tests.engine.conftest import (
    LONG_PROMPTS,
    NUM_SAMPLES,
    SAMPLE_POSITIONS,
    SAMPLE_PROMPT,
)
from tests.helpers import (
    PROMPTS,
    greedy,
    greedy_with_cache_hits,
    make_llm,
    metrics,
    sample_tokens,
    shutdown,
)

pytestmark = pytest.mark.engine

K = 3


@pytest.fixture(
    scope="module",
    params=["fixed", "debug_ragged", "skips", "short_blocks", "retire"],
)
def adaflash(request, tiny):
    """One AdaFlash engine per length mode; `fixed` is given as a config FILE path,
    `debug_ragged` as a dict, so both ways users pass the config are exercised.
    `skips`: debug_ragged budgets with the drafter run on every other step only
    (the steps between verify 0 drafts, as skip_drafting does). `short_blocks`:
    debug_ragged budgets with the drafter run on blocks of 1, 2, ..., K slots in
    turn (as adaptive_block does under load). `retire`: debug_ragged budgets,
    every third step skipped, and every skipped step retiring its requests,
    prompts included (`retire_when_skipping`: no more context upkeep, no more
    drafts for them)."""
    mode = request.param
    length = "debug_ragged" if mode in ("skips", "short_blocks", "retire") else mode
    spec = tiny.spec(k=K, adaflash={"length": {"mode": length}})
    if mode == "fixed":
        spec = str(tiny.write_config("adaflash-fixed.json", spec))
    llm = make_llm(tiny.target, spec)
    if mode == "skips":
        llm.collective_rpc("adaflash_debug_draft_every", args=(2,))
    if mode == "retire":
        # A request admitted on a skipped step retires there and never drafts;
        # with one step in two skipped, batches of equal lengths could all be
        # admitted on skipped steps (their first ones race the engine). Two
        # steps in three draft: a batch's lifetime (32 steps) moves it to
        # another phase, so some batches are admitted on drafting steps.
        llm.collective_rpc("adaflash_debug_draft_pattern", args=("dds",))
    if mode == "retire":
        llm.collective_rpc("adaflash_debug_retire", args=(True, True))
    if mode == "short_blocks":
        llm.collective_rpc("adaflash_debug_block_lengths")
    result = {
        "mode": mode,
        "llm": llm,
        "greedy": greedy(llm, PROMPTS),
        "metrics": metrics(llm),
    }
    yield result
    shutdown(llm)


def two_sample_p_value(a: list[int], b: list[int]) -> float:
    """Chi-square test that two token samples come from one distribution (tokens
    seen fewer than 5 times in total are pooled)."""
    tokens = sorted(set(a) | set(b))
    counts = {t: (a.count(t), b.count(t)) for t in tokens}
    rows = [c for c in counts.values() if sum(c) >= 5]
    rest = [sum(c[i] for c in counts.values() if sum(c) < 5) for i in (0, 1)]
    if sum(rest) > 0:
        rows.append(tuple(rest))
    if len(rows) < 2:
        return 1.0
    return chi2_contingency(list(zip(*rows, strict=True))).pvalue


def test_not_vacuous(adaflash):
    """The drafter drafted and some drafts were accepted (else identity is trivial)."""
    m = adaflash["metrics"]
    assert m["vllm:spec_decode_num_draft_tokens"] > 0
    if adaflash["mode"] != "retire":  # there a request drafts in one round at most
        assert m["vllm:spec_decode_num_accepted_tokens"] > 0
    assert m["vllm:adaflash_rounds"] > 0
    if adaflash["mode"] in ("skips", "retire"):  # half the steps ran without it
        gate = adaflash["llm"].collective_rpc("adaflash_budget_state")[0]
        assert gate["draft_gate"]["skipped_steps"] > 10, gate
    if adaflash["mode"] == "retire":  # and requests retired, on /metrics too
        assert m["vllm:adaflash_retired_requests"] >= len(PROMPTS)
    if adaflash["mode"] == "short_blocks":  # and every block length ran
        used = adaflash["llm"].collective_rpc("adaflash_budget_state")[0][
            "block_length"
        ]["used"]
        assert all(used.get(str(n), 0) > 10 for n in range(1, K + 1)), used


def test_greedy_token_identical(adaflash, baseline):
    """Temperature 0: every output token equals plain vLLM's, for all prompts."""
    assert len(PROMPTS) >= 30
    for i, (got, want) in enumerate(
        zip(adaflash["greedy"], baseline["greedy"], strict=True)
    ):
        assert got == want, f"prompt {i} {PROMPTS[i]!r} diverged"


def test_ragged_budgets_really_ragged(adaflash):
    """debug_ragged verifies 0..K drafts per round (all of K for fixed)."""
    hist = adaflash["metrics"]["vllm:adaflash_verify_length"]
    counts = [
        hist[f"{float(n)}"] - hist.get(f"{float(n - 1)}", 0) for n in range(1, K + 2)
    ]
    if adaflash["mode"] == "fixed":
        assert counts[:K] == [0] * K and counts[K] > 0, counts
    else:
        assert all(c > 0 for c in counts), counts  # k_i = 0 .. K all occurred


def test_per_request_spec_metrics_in_response(adaflash):
    """Each response carries vLLM's per-request spec-decode metrics."""
    from vllm import SamplingParams

    out = adaflash["llm"].generate(
        PROMPTS[:2], SamplingParams(max_tokens=16, temperature=0)
    )
    sd = out[0].outputs[0].spec_decode_metrics
    assert sd is not None and sd.num_spec_tokens == K
    if adaflash["mode"] != "retire":  # there a request drafts in one round at most
        assert sum(sd.histogram) > 0


def test_sampling_distribution_matches(adaflash, baseline):
    """Temperature 1: token distributions at positions 0 and 3 match plain vLLM's
    (chi-square), while a T=0.7 control is detected as different (the test has
    power)."""
    samples = sample_tokens(
        adaflash["llm"], SAMPLE_PROMPT, NUM_SAMPLES, SAMPLE_POSITIONS
    )
    for pos in SAMPLE_POSITIONS:
        p_same = two_sample_p_value(samples[pos], baseline["samples"][pos])
        assert p_same > 1e-3, f"position {pos}: p={p_same}"
    p_control = two_sample_p_value(baseline["samples"][0], baseline["samples_cold"][0])
    assert p_control < 1e-3, f"control not detected: p={p_control}"


def test_prefix_cache_hits_like_plain(adaflash, baseline):
    """Prompts served a second time hit the prefix cache as in plain vLLM (AdaFlash
    keeps the trailing block vLLM drops for EAGLE-family drafters), and the outputs
    stay token-identical to plain vLLM's (drafts read the cached blocks' context
    K/V; with `skips`, K/V queued by steps without a draft)."""
    llm = adaflash["llm"]
    for i, (want, want_hits) in enumerate(baseline["long"]):
        got, hits = greedy_with_cache_hits(llm, LONG_PROMPTS)
        assert got == want, f"pass {i}: outputs differ from plain vLLM"
        assert hits == want_hits, f"pass {i}: cached tokens {hits} vs plain {want_hits}"
    assert sum(baseline["long"][0][1]) == 0 and min(baseline["long"][1][1]) >= 256


@pytest.mark.parametrize("adaflash", ["retire"], indirect=True)
def test_retired_blocks_keep_their_hits_or_are_recomputed(adaflash):
    """Requests retired (here every skipped step retires its requests, prompts
    included). While the engine retires, a follow-up whose prompt holds a
    retired request's output (its prefix-cache hit takes blocks whose drafter
    K/V has holes) is retired at admission and verifies no draft, with the hit
    plain vLLM would have. Once it no longer retires, by default the same
    follow-up keeps that hit and drafts over the holes. With
    `length.cut_holey_prefix_hits` its hit is cut before those blocks instead,
    which leave the prefix cache (patches.py E4): it recomputes them, drafts,
    and emits the same tokens; the next such follow-up hits the complete blocks
    it wrote, and drafts. Runs before the other retire test in the `retire`
    engine: it turns retirement off there."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    llm = adaflash["llm"]

    def retired() -> dict:
        return llm.collective_rpc("adaflash_budget_state")[0]["retired"]

    state = retired()
    assert state["retired_total"] > 0 and state["holey_blocks"] > 0, state
    bs = state["block_size"]
    greedy0 = SamplingParams(temperature=0.0, max_tokens=2 * bs + 4, ignore_eos=True)
    first = llm.generate([PROMPTS[1]], greedy0, use_tqdm=False)[0]
    turn = list(first.prompt_token_ids) + list(first.outputs[0].token_ids)
    follow_up = TokensPrompt(prompt_token_ids=turn + turn[:3])
    llm.collective_rpc("adaflash_debug_draft_every", args=(1,))  # draft every step

    def verified_drafts() -> int:  # the worker's count (rejection sampler)
        hist = llm.collective_rpc("adaflash_sampler_stats")[0]["verify_hist"]
        return sum(k * rounds for k, rounds in enumerate(hist))

    def run(prompt) -> tuple[int, int, list[int]]:
        before = verified_drafts()
        out = llm.generate(
            [prompt],
            SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True),
            use_tqdm=False,
        )[0]
        drafted = verified_drafts() - before
        return drafted, out.num_cached_tokens, list(out.outputs[0].token_ids)

    on_hit = retired()["retired_on_hit"]
    drafted, cached, tokens = run(follow_up)  # retiring: the hit retires it
    assert cached > len(first.prompt_token_ids), "the follow-up missed its output"
    assert retired()["retired_on_hit"] == on_hit + 1
    assert drafted == 0
    assert metrics(llm).get("vllm:adaflash_retired_prefix_cuts", 0) == 0

    llm.collective_rpc("adaflash_debug_retire", args=(False,))
    fresh, _, _ = run("Nothing here was served before, not a word of it.")
    assert fresh > 0  # this step's output told the scheduler: no longer retiring
    unretired = retired()["unretired_total"]
    drafted, kept, again = run(follow_up)  # the default: the hit is kept
    assert again == tokens and kept == cached and drafted > 0
    assert retired()["unretired_total"] > unretired  # retired on the hit, drafting
    assert metrics(llm).get("vllm:adaflash_retired_prefix_cuts", 0) == 0

    llm.collective_rpc("adaflash_debug_prefix_cuts", args=(True,))
    run("Nor was this, in any of the turns before it.")  # tells the scheduler
    drafted, cut, again = run(follow_up)
    assert again == tokens  # lossless either way
    assert cut < cached and cut % bs == 0, (cut, cached)
    # the kept hit retired the follow-up at admission; the cut one did not
    assert retired()["retired_on_hit"] == on_hit + 2
    assert drafted > 0
    assert metrics(llm)["vllm:adaflash_retired_prefix_cuts"] >= 1
    drafted, hit, third = run(follow_up)  # the blocks it recomputed are cached
    assert third == tokens and hit == cached and drafted > 0


@pytest.mark.parametrize("adaflash", ["retire"], indirect=True)
def test_a_retired_request_drafts_again_once_the_engine_drafts(adaflash, baseline):
    """A request retired mid-generation (every step skipped, the engine
    retiring) drafts again once the engine no longer retires and its steps
    draft: its holes stay, its drafts are verified, its tokens are plain vLLM's.
    Stepped one engine step at a time so that the mode changes inside one
    request's life. Runs after the prefix test (which turns retirement off)."""
    from vllm import SamplingParams

    llm = adaflash["llm"]
    engine = llm.llm_engine

    def state() -> dict:
        return llm.collective_rpc("adaflash_budget_state")[0]

    def verified_drafts() -> int:
        hist = llm.collective_rpc("adaflash_sampler_stats")[0]["verify_hist"]
        return sum(k * rounds for k, rounds in enumerate(hist))

    llm.collective_rpc("adaflash_debug_retire", args=(True, True))
    llm.collective_rpc("adaflash_debug_draft_every", args=(10**9,))  # skip all
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    engine.add_request("unretire-0", PROMPTS[2], params)
    outputs = []
    for _ in range(6):  # the prompt and five tokens, each step retiring
        outputs += engine.step()
    before = state()["retired"]
    assert before["retired_now"] >= 1, before
    drafted = verified_drafts()

    llm.collective_rpc("adaflash_debug_retire", args=(False,))
    llm.collective_rpc("adaflash_debug_draft_every", args=(1,))  # draft every step
    while engine.has_unfinished_requests():
        outputs += engine.step()
    after = state()["retired"]
    assert after["unretired_total"] == before["unretired_total"] + 1, after
    assert after["retired_now"] == before["retired_now"] - 1, after  # (ids of
    # finished requests stay in the set until it is trimmed: forget_finished)
    assert verified_drafts() > drafted  # it verified drafts again
    assert metrics(llm)["vllm:adaflash_unretired_requests"] >= 1
    final = [o for o in outputs if o.request_id == "unretire-0" and o.finished]
    assert list(final[0].outputs[0].token_ids) == baseline["greedy"][2]
