"""Budget policies on synthetic survivals and cost curves (no engine)."""

import random

import pytest
import torch
from adaflash_vllm.proposers.budget import (
    AcceptanceCalibration,
    BudgetUse,
    ConfidenceSurvival,
    CostAwareBudget,
    DebugRaggedBudget,
    HeadSurvival,
    PaperBudget,
    allocate_budgets,
    geometric_survival,
    make_budget_policy,
)
from adaflash_vllm.proposers.cost_model import (
    StepCostModel,
    profile_sizes,
    profile_step_costs,
)
from adaflash_vllm.proposers.length_head import LengthHead, draft_confidence

from adaflash_vllm.config import LengthConfig

K = 7


class _FixedSurvival:
    needs_confidence = False

    def __init__(self, s: torch.Tensor):
        self.s = s

    def __call__(self, hidden, confidence=None, history=None):
        return self.s

    def ratio(self, hidden, confidence=None, history=None):
        return self.s.sum(-1) / self.s.shape[-1]


def _fixed_survival(s: torch.Tensor) -> _FixedSurvival:
    return _FixedSurvival(s)


def _cost_aware(s, cost, k_min=0):
    paper = PaperBudget(_fixed_survival(s), gamma=1.0, k_min=k_min)
    return CostAwareBudget(
        _fixed_survival(s), lambda: cost, k_min=k_min, fallback=paper
    )


def test_geometric_survival_matches_expected_length_and_decays():
    a = torch.tensor([0.0, 0.3, 0.7, 1.0, 1e-4, 0.9999, 0.5])
    s = geometric_survival(a, K)
    assert s.shape == (len(a), K)
    assert torch.allclose(s.sum(-1), a * K, atol=1e-4)
    assert (s[:, 1:] <= s[:, :-1] + 1e-7).all()
    assert (s >= 0).all() and (s <= 1).all()
    assert torch.equal(s[0], torch.zeros(K)) and torch.equal(s[3], torch.ones(K))
    # A geometric decay: every ratio s_{j+1} / s_j is the same rho.
    ratios = s[1:3, 1:] / s[1:3, :-1]
    assert torch.allclose(ratios, ratios[:, :1].expand_as(ratios), atol=1e-5)


@pytest.mark.parametrize(
    "a_hat, gamma, k_min, want",
    [
        (0.6, 1.0, 1, 4),  # round(0.6 * 7) = 4
        (0.05, 1.0, 1, 1),  # clamped up to k_min
        (0.9, 1.3, 0, 7),  # clamped down to K
        (0.0, 1.0, 0, 0),  # k_i = 0 allowed
    ],
)
def test_paper_rule(a_hat, gamma, k_min, want):
    s = geometric_survival(torch.tensor([a_hat]), K)
    policy = PaperBudget(_fixed_survival(s), gamma=gamma, k_min=k_min)
    assert policy.choose(req_ids=["r"], num_drafts=K, hidden_states=None) == [want]


def test_cost_aware_takes_full_k_when_verification_is_flat():
    """Flat cost: every extra slot is free, so every request verifies all K."""
    s = geometric_survival(torch.tensor([0.2, 0.5, 0.9]), K)
    flat = StepCostModel([1, 64], [10.0, 10.0])
    assert _cost_aware(s, flat).choose(
        req_ids=["a", "b", "c"], num_drafts=K, hidden_states=None
    ) == [K, K, K]


def test_cost_aware_trims_when_verification_is_steep():
    """Steep cost: only likely slots pay; the confident request keeps more."""
    s = geometric_survival(torch.tensor([0.15, 0.85]), K)
    steep = StepCostModel([1, 64], [10.0, 73.0])  # 10 ms fixed + 1 ms per token
    k = _cost_aware(s, steep).choose(
        req_ids=["a", "b"], num_drafts=K, hidden_states=None
    )
    assert k[0] < k[1] <= K and k[0] < K


def test_cost_aware_maximises_tokens_per_time_exactly():
    """The chosen allocation beats every uniform k on expected tokens per ms."""
    torch.manual_seed(0)
    s = geometric_survival(torch.rand(16), K)
    cost = StepCostModel([1, 16, 64, 128], [5.0, 6.0, 12.0, 30.0])
    k = torch.tensor(
        _cost_aware(s, cost).choose(
            req_ids=[str(i) for i in range(16)], num_drafts=K, hidden_states=None
        )
    )

    def rate(ks):
        mask = torch.arange(K).unsqueeze(0) < ks.unsqueeze(-1)
        return float(16 + (s * mask).sum()) / cost(float(16 + ks.sum()))

    best_uniform = max(rate(torch.full((16,), u)) for u in range(K + 1))
    assert rate(k) >= best_uniform - 1e-9


def test_cost_aware_counts_the_rounds_drafting_time():
    """The round's drafting time is paid whatever the budgets: with it in the
    rate, marginal slots pay where verification alone would trim them, and the
    choice maximises tokens per ms of the whole round."""
    torch.manual_seed(0)
    s = geometric_survival(torch.rand(8), K)
    cost = StepCostModel([1, 8, 64], [10.0, 12.0, 40.0])
    reqs = [str(i) for i in range(8)]
    policy = _cost_aware(s, cost)
    alone = sum(policy.choose(req_ids=reqs, num_drafts=K, hidden_states=None))
    with_draft = policy.choose(
        req_ids=reqs, num_drafts=K, hidden_states=None, draft_ms=30.0
    )
    assert sum(with_draft) > alone
    k = torch.tensor(with_draft)

    def rate(ks):
        mask = torch.arange(K).unsqueeze(0) < ks.unsqueeze(-1)
        return float(8 + (s * mask).sum()) / (30.0 + cost(float(8 + ks.sum())))

    assert rate(k) >= max(rate(torch.full((8,), u)) for u in range(K + 1)) - 1e-9
    assert policy.last_choice["tokens_per_ms"] == pytest.approx(rate(k), rel=1e-5)
    assert policy.last_choice["verify_ms"] == pytest.approx(cost(8 + sum(with_draft)))


def test_cost_aware_respects_k_min_and_prefixes():
    s = geometric_survival(torch.tensor([0.01, 0.5]), K)
    steep = StepCostModel([1, 16], [1.0, 100.0])
    k = _cost_aware(s, steep, k_min=2).choose(
        req_ids=["a", "b"], num_drafts=K, hidden_states=None
    )
    assert all(2 <= x <= K for x in k)


def test_cost_aware_without_profile_uses_the_paper_rule():
    s = geometric_survival(torch.tensor([0.6]), K)
    paper = PaperBudget(_fixed_survival(s), gamma=1.0, k_min=1)
    policy = CostAwareBudget(_fixed_survival(s), lambda: None, k_min=1, fallback=paper)
    assert policy.choose(req_ids=["r"], num_drafts=K, hidden_states=None) == [4]


def test_vectorised_cost_equals_the_curve_everywhere():
    """`many` (what the budgets evaluate at every slot count) is the same curve
    as calling the model per point, past both ends of the table included."""
    model = StepCostModel([2, 8, 64, 128], [10.0, 12.0, 30.0, 31.0])
    n = [0.0, 1.0, 2.0, 3.5, 8.0, 9.0, 64.0, 100.0, 128.0, 500.0]
    assert model.many(n).tolist() == pytest.approx([model(x) for x in n], rel=1e-12)


def test_allocation_is_the_same_with_a_plain_callable_curve():
    torch.manual_seed(1)
    s = geometric_survival(torch.rand(64), K)
    model = StepCostModel([1, 16, 64, 256, 512], [5.0, 6.0, 12.0, 40.0, 90.0])
    fast, choice = allocate_budgets(s, model, 1, 3.0)
    slow, slow_choice = allocate_budgets(s, lambda n: model(n), 1, 3.0)
    assert fast == slow and choice["budget"] == slow_choice["budget"]


def test_profile_and_online_refresh():
    calls = []
    model = profile_step_costs(lambda n: calls.append(n), [1, 4, 16], passes=2)
    assert sorted(set(calls)) == [1, 4, 16] and model(8) >= model(4) > 0
    before = model(16)
    for _ in range(20):
        model.observe(16, before * 3)
    assert model(16) > 2 * before and model.observations == 20


def test_profile_sizes_are_every_count_up_to_the_bound_then_doubling():
    assert profile_sizes(2048, every_up_to=16) == [
        *range(1, 17),
        32,
        64,
        128,
        256,
        512,
        1024,
        2048,
    ]
    assert profile_sizes(10, every_up_to=16) == list(range(1, 11))
    assert profile_sizes(100, every_up_to=1) == [1, 2, 4, 8, 16, 32, 64, 100]


def test_budgets_see_a_kink_that_a_doubling_profile_misses():
    """One request; a forward costs the same for 1 to 6 tokens and 0.25 ms more
    per token from 7 (the CPU demo target's shape). Profiled at every count, the
    budgets verify the 5 free drafts and leave the two that cost more than they
    bring; profiled at 1, 2, 4, 8 the curve runs straight from 4 to 8 and the 5th
    draft looks as dear as the 7th."""

    def true_ms(n: float) -> float:
        return 4.0 + 0.25 * max(0.0, n - 6)

    s = torch.tensor([[0.7, 0.5, 0.4, 0.3, 0.2, 0.08, 0.05]])
    quiet = (0.0, 0.0)  # no slow spell
    m = _ContendedMachine(true_ms, quiet)
    fine = profile_step_costs(m.run, profile_sizes(8, every_up_to=16), clock=m.clock)
    m = _ContendedMachine(true_ms, quiet)
    coarse = profile_step_costs(m.run, profile_sizes(8), clock=m.clock)
    assert [fine(n) for n in range(1, 9)] == pytest.approx(
        [true_ms(n) for n in range(1, 9)]
    )
    k_fine, _ = allocate_budgets(s, fine, k_min=0, extra_ms=3.0)
    k_coarse, _ = allocate_budgets(s, coarse, k_min=0, extra_ms=3.0)
    assert k_fine == [5]
    assert k_coarse != [5]


class _ContendedMachine:
    """A fake clock and dummy forward: n tokens cost `true_ms(n)`, and twice
    that (another process on the core) during a slow spell [start, end) ms."""

    def __init__(self, true_ms, spell: tuple[float, float]):
        self.now_ms, self.true_ms, self.spell = 0.0, true_ms, spell

    def run(self, n: int) -> None:
        cost = self.true_ms(n)
        start, end = self.spell
        self.now_ms += 2 * cost if start <= self.now_ms < end else cost

    def clock(self) -> float:
        return self.now_ms / 1e3


def _true_step_ms(n: int) -> float:
    """Flat to 16 tokens (the step's fixed part), then 0.1 ms per token."""
    return 18.0 + 0.1 * max(0, n - 16)


SIZES = [1, 2, 4, 8, 16, 32, 64, 128]


@pytest.mark.parametrize("spell", [(0, 300), (60, 200), (300, 700), (600, 1000)])
def test_profile_is_not_bent_by_a_slow_spell(spell):
    """A slow spell during part of the profile (run 15: a served C = 1 profile
    read 41.4 ms at 1-4 tokens and 44.8 at 8, where a step takes ~18 ms) must not
    make a slope where steps cost the same; the real slope above 16 stays. Timed
    size by size (median of 3, as before 763f60d), the spells of 60-200 and
    300-700 ms made steps of 18 ms at 2 and at 16 tokens."""
    m = _ContendedMachine(_true_step_ms, spell)
    model = profile_step_costs(m.run, SIZES, clock=m.clock)
    assert m.now_ms > spell[1]  # the spell ended inside the profile
    assert [model(n) for n in (1, 2, 4, 8, 16)] == pytest.approx([18.0] * 5)
    assert model(128) - model(16) == pytest.approx(11.2, abs=1e-6)


def test_profile_errs_toward_flat_when_the_spell_covers_most_passes():
    """With one clean pass the noise is as large as the step itself: the curve
    comes out flat (budgets then verify those counts and steps lift it), never
    steeper than the truth."""
    m = _ContendedMachine(_true_step_ms, (0, 1200))
    model = profile_step_costs(m.run, SIZES, clock=m.clock)
    assert model(128) - model(1) <= 11.2 + 1e-6
    assert model(1) == pytest.approx(18.0)


def test_profile_takes_a_rise_within_the_noise_as_flat():
    """Sizes whose fastest samples are less apart than each size's fastest two
    are one cost; a rise beyond that stays."""
    jitter = [0.6, 0.0, 1.2, 0.9, 1.5, 0.6]  # warm-up, then passes 1-5 (ms)
    calls: dict[int, int] = {}
    now = [0.0]

    def run(n: int) -> None:
        i = calls[n] = calls.get(n, -1) + 1
        now[0] += 20.0 + 0.05 * n + (3.0 if n == 64 else 0.0) + jitter[i]

    model = profile_step_costs(run, [1, 2, 4, 8, 64], clock=lambda: now[0] / 1e3)
    assert model(8) == pytest.approx(model(1)) == pytest.approx(20.05)
    assert model(64) == pytest.approx(20.0 + 3.2 + 3.0)


def test_one_hiccup_moves_the_curve_a_bounded_step():
    """A single 100x step (a GC pause, the OS) moves cost(n) by at most
    (ema + shape_ema) * (max_step_ratio - 1); steady 3x steps still converge."""
    model = StepCostModel([1, 8, 64], [10.0, 12.0, 30.0], ema=0.3, shape_ema=0.02)
    model.observe(8, 1200.0)
    assert model(8) == pytest.approx(12.0 * 1.32, rel=1e-3)
    before = model(8)
    model.observe(8, before / 100)  # and a 100x too fast one
    assert model(8) == pytest.approx(before * (1 - 0.32 * 0.5), rel=1e-3)
    for _ in range(60):
        model.observe(8, 36.0)
    assert model(8) == pytest.approx(36.0, rel=1e-3)


def test_noise_where_steps_land_makes_no_slope():
    """Steps at one request verify 2-8 tokens and take 16 +- 3 ms (scheduling
    included, which the 10 ms profile is not): the whole curve rises, the count
    no step hits (1: no draft) with it, and noise between the points the steps
    hit makes no slope that would trim free slots."""
    rng = random.Random(0)
    model = StepCostModel([1, 2, 4, 8], [10.0, 10.0, 10.0, 10.0])
    for _ in range(300):
        model.observe(rng.choice((2, 4, 8)), rng.gauss(16.0, 3.0))
    assert model(4) == pytest.approx(16.0, abs=1.5)
    assert model(4) - model(1) < 1.0  # per-point refresh: 6 ms (cost(1) stayed 10)
    assert model(8) - model(2) < 1.0
    for _ in range(5000):  # and the points steps hit do not drift off the others
        model.observe(rng.choice((2, 4, 8)), rng.gauss(16.0, 3.0))
    assert model(4) - model(1) < 1.5


def test_a_real_slope_is_still_learnt():
    """Verification really costs more at more tokens than the profile said."""
    model = StepCostModel([1, 64], [10.0, 10.0])
    for _ in range(600):
        model.observe(1, 10.0)
        model.observe(64, 40.0)
    assert model(64) - model(1) > 20.0  # of 30 (the pull toward the profile)
    assert model(64) == pytest.approx(40.0, rel=0.1)


def test_a_slope_seen_on_rare_steps_is_kept_between_them():
    """Under load the gate skips most steps: 19 of 20 steps verify 16 tokens, and
    every 20th (a drafting step) 64. Real forwards cost 14 ms and 28 ms there,
    where the profile (dummy forwards without context) said 8 and 15: the curve
    learns the 14 ms slope, not the profile's 7 (decayed between drafting steps
    at every step, it kept ~10.5: BENCHMARKS.md run 31)."""
    model = StepCostModel([1, 16, 64], [6.0, 8.0, 15.0])
    for step in range(4000):
        if step % 20 == 19:
            model.observe(64, 28.0)
        else:
            model.observe(16, 14.0)
    assert model(64) - model(16) == pytest.approx(14.0, abs=1.5)
    assert model(16) == pytest.approx(14.0, abs=0.5)


def test_debug_ragged_covers_zero_to_k():
    policy = DebugRaggedBudget()
    seen = set()
    for _ in range(30):
        seen.update(
            policy.choose(
                req_ids=[f"r{i}" for i in range(8)], num_drafts=K, hidden_states=None
            )
        )
    assert seen == set(range(K + 1))


def test_confidence_survival_is_the_cumulative_top1_probability():
    """Without a head, survival is prod_{k <= j} p_top1(k) from the drafts' own
    logits (no second lm_head pass: the features come with the drafts)."""
    logits = torch.randn(2 * K, 50)
    conf = draft_confidence(logits).view(2, K, 3)
    policy = make_budget_policy(LengthConfig(mode="paper"), head=None)
    assert policy.needs_confidence
    p_top1 = logits.softmax(-1).max(-1).values.view(2, K)
    s = ConfidenceSurvival()(None, conf)
    assert torch.allclose(s, p_top1.cumprod(-1), atol=1e-6)


def test_survival_head_feeds_the_budgets_its_own_curve():
    """A survival head's curve reaches the cost-aware allocation unchanged (not a
    geometric fit of its mean)."""
    head = LengthHead(8, 4, num_drafts=K).eval()
    hidden, conf = torch.randn(3, K, 8), draft_confidence(torch.randn(3, K, 20))
    survival = HeadSurvival(head)
    assert survival.needs_confidence
    s = survival(hidden, conf)
    assert torch.allclose(s, head.survival(hidden, conf))
    assert (s[:, 1:] <= s[:, :-1]).all()
    assert torch.allclose(survival.ratio(hidden, conf), s.mean(-1))


def test_head_predictor_required_when_asked():
    with pytest.raises(ValueError, match="no length head"):
        make_budget_policy(LengthConfig(mode="paper", predictor="head"), head=None)


def test_acceptance_calibration_is_a_ratio_of_sums_within_bounds():
    cal = AcceptanceCalibration(ema=0.5, bounds=(0.1, 2.0))
    assert cal.factor == 1.0  # nothing seen yet
    cal.observe(predicted=10.0, realised=5.0)
    assert cal.factor == pytest.approx(0.5)
    # A small step weighs less than a large one (ratio of sums, not of ratios).
    cal.observe(predicted=2.0, realised=2.0)
    assert cal.factor == pytest.approx((0.5 * 5 + 0.5 * 2) / (0.5 * 10 + 0.5 * 2))
    for _ in range(40):
        cal.observe(predicted=1.0, realised=0.0)
    assert cal.factor == 0.1  # clamped
    assert cal.to_dict()["observations"] == 42


def _choice(gain: float, round_ms: float = 20.0) -> dict:
    """An allocation result whose budgets beat full K by `gain` (a fraction)."""
    return {
        "tokens_per_ms": 0.1 * (1 + gain),
        "full_k_tokens_per_ms": 0.1,
        "verify_ms": round_ms - 5.0,
        "draft_ms": 5.0,
    }


def test_budget_use_stops_choosing_where_it_costs_more_than_it_gains():
    """Per batch bucket: while the predicted gain (1%) is below the choice's own
    time (0.8 ms of a 20 ms round: 4%), steps choose only at checks, each check
    that confirms it doubling the wait (32, 64, ... up to 256 steps); where the
    gain is larger (10%, e.g. under load) every step chooses."""
    use = BudgetUse(check_every=16, max_check_every=256)
    assert use.active(1)  # nothing measured yet: choose
    use.record(1, _choice(0.01), choose_ms=0.8)
    gaps, waited = [], 0
    for _ in range(1500):
        if use.active(1):
            gaps.append(waited)
            waited = 0
            use.record(1, _choice(0.01), choose_ms=0.8)
        else:
            waited += 1
    assert gaps[:5] == [32, 64, 128, 256, 256]
    assert use.active(32)  # another bucket: measured apart
    use.record(32, _choice(0.10), choose_ms=0.8)
    assert all(use.active(32) for _ in range(64))
    state = use.to_dict()
    assert state["buckets"]["1"]["gain"] == pytest.approx(0.01)
    assert state["buckets"]["1"]["overhead"] == pytest.approx(0.04)
    assert state["buckets"]["1"]["every"] == 256
    assert state["buckets"]["32"]["every"] == 16


def test_budget_use_checks_closely_again_after_a_choice_that_paid():
    """A check whose own gain beats the overhead (the text turned easy, the batch
    grew within the bucket) brings the wait back to `check_every` even while the
    gain's EMA is still below the overhead."""
    use = BudgetUse(check_every=16, max_check_every=256)
    for _ in range(6):
        use.record(1, _choice(0.0), choose_ms=1.0)
    assert use.to_dict()["buckets"]["1"]["every"] == 256
    use.record(1, _choice(0.2), choose_ms=1.0)  # EMA 0.02 < 0.05, this one 0.2
    assert use.to_dict()["buckets"]["1"]["gain"] < 0.05
    assert use.to_dict()["buckets"]["1"]["every"] == 16


def test_budget_use_follows_a_gain_that_grows():
    """The checks keep measuring: once the gain passes the overhead, every step
    chooses again."""
    use = BudgetUse(ema=0.5, check_every=4)
    use.record(1, _choice(0.0), choose_ms=1.0)
    chose = 0
    for _ in range(200):
        if use.active(1):
            chose += 1
            use.record(1, _choice(0.2), choose_ms=1.0)
    assert chose > 150 and use.active(1)
