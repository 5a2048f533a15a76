"""Learned and cost-aware draft budgets in the real engine: lossless, really
ragged, consistent between scheduler and rejection sampler, safe under KV pressure;
a drafter checkpoint with a length head still loads in stock vLLM."""

import pytest

from tests.helpers import PROMPTS, greedy, make_llm, metrics, shutdown

pytestmark = pytest.mark.engine

K = 3


# cost_aware also chooses the drafter's block length (adaptive_block, on by
# default). Its draft gate skips most steps with this random drafter, and
# BudgetUse checks only every 16+ drafting steps, so whether a choosing step
# follows a verified round is up to timing there; without the gate every step
# drafts and the head's history path is exercised for sure.
LENGTH_CONFIGS = {
    "paper": {"mode": "paper"},
    "cost_aware": {"mode": "cost_aware"},
    "cost_aware_no_gate": {"mode": "cost_aware", "skip_drafting": False},
}


@pytest.fixture(scope="module", params=list(LENGTH_CONFIGS))
def policy_llm(request, tiny, tiny_head_drafter):
    length = {**LENGTH_CONFIGS[request.param], "k_min": 0}
    spec = tiny.spec(k=K, model=str(tiny_head_drafter), adaflash={"length": length})
    llm = make_llm(tiny.target, spec)
    result = {
        "mode": length["mode"],
        "gated": request.param == "cost_aware",
        "llm": llm,
        "greedy": greedy(llm, PROMPTS),
        "metrics": metrics(llm),
        "budget": llm.collective_rpc("adaflash_budget_state")[0],
        "sampler": llm.collective_rpc("adaflash_sampler_stats")[0],
    }
    yield result
    shutdown(llm)


def test_policy_lossless_and_not_vacuous(policy_llm, baseline):
    m = policy_llm["metrics"]
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0
    assert policy_llm["greedy"] == baseline["greedy"]


def test_head_loaded_and_budgets_ragged(policy_llm):
    """The head came through vLLM's loader and varied k_i across rounds; cost_aware
    also profiled the step-cost curve, refreshed it online and chose by it."""
    budget = policy_llm["budget"]
    assert budget["has_length_head"] is True
    # The survival head read the confidence of the drafts' own logits.
    assert budget["length_head_kind"] == "survival"
    assert budget["survival"] == "HeadSurvival"
    # It read each request's previous round (u = 1 rows) on choosing steps after
    # a drafting step that verified drafts (only choosing steps read the head).
    assert budget["length_head_history"] is True
    if policy_llm["gated"]:
        assert budget["history_steps"] <= budget["budget_use"]["chosen_steps"]
    else:
        assert budget["history_steps"] > 0, budget
    assert (
        budget["policy"]
        == {"paper": "PaperBudget", "cost_aware": "CostAwareBudget"}[policy_llm["mode"]]
    )
    hist = policy_llm["metrics"]["vllm:adaflash_verify_length"]
    counts = [
        hist[f"{float(n)}"] - hist.get(f"{float(n - 1)}", 0) for n in range(1, K + 2)
    ]
    assert sum(c > 0 for c in counts) >= 2, counts
    if policy_llm["mode"] == "cost_aware":  # it profiled step cost and used it
        assert budget["cost_profile_error"] is None
        cost = budget["cost_model"]
        assert cost["sizes"][0] == 1 and len(cost["sizes"]) >= 3
        assert all(t > 0 for t in cost["times_ms"]) and cost["observations"] > 0
        choice = budget["last_choice"]
        assert choice["tokens_per_ms"] >= choice["full_k_tokens_per_ms"]
        m, use = policy_llm["metrics"], budget["budget_use"]
        if policy_llm["gated"]:
            # The draft gate's counters reach /metrics (published by the
            # scheduler).
            gate = budget["draft_gate"]
            drafted = gate["drafted_steps"]
            assert drafted > 0
            assert m["vllm:adaflash_draft_gate_drafted_steps"] == drafted
            assert m["vllm:adaflash_draft_gate_skipped_steps"] == gate["skipped_steps"]
            assert m["vllm:adaflash_draft_gate_drafting"] == int(gate["drafting"])
            # Its measure of the text: every row that verified a draft, as the
            # rejection sampler counted them (but the last step's round, which
            # no later step credited), and the share that accepted its first.
            rows = policy_llm["sampler"]["drafted"][0]
            assert rows - len(PROMPTS) <= gate["first_accept_rows"] <= rows
            assert gate["first_accept_rows"] > 0 and 0 <= gate["first_accept"] <= 1
        else:  # no gate: every decode step drafted
            assert budget["draft_gate"] is None
            drafted = sum(
                b["drafting_steps"] for b in budget["block_length"]["buckets"].values()
            )
            assert drafted > 0, budget["block_length"]
        # Every drafting step asked BudgetUse whether to choose; some chose.
        assert use["chosen_steps"] > 0, use
        assert use["chosen_steps"] + use["full_k_steps"] == drafted, use
        # Every drafting step took its block length from its batch-size
        # bucket (adaptive_block is on by default), each within 1..K.
        buckets = budget["block_length"]["buckets"]
        assert buckets, budget["block_length"]
        assert all(1 <= b["length"] <= K for b in buckets.values()), buckets
        assert sum(b["drafting_steps"] for b in buckets.values()) == drafted, buckets
        # Chosen budgets capped the block of their bucket's next steps.
        caps = [b["cap"] for b in buckets.values() if b["cap"] is not None]
        assert caps and all(1 <= c <= K for c in caps), buckets
    else:
        assert budget["block_length"] is None


def test_drafts_come_with_the_step_output(policy_llm):
    """The engine core never asked the worker for drafts in a round trip of its
    own (patches.py E3), yet drafts were verified (and output stayed identical:
    test_policy_lossless_and_not_vacuous)."""
    assert policy_llm["budget"]["draft_round_trips"] == 0
    assert policy_llm["metrics"]["vllm:spec_decode_num_draft_tokens"] > 0


def test_sampler_counts_match_scheduler_counts(policy_llm):
    """The worker's rejection sampler and the scheduler saw the same ragged
    verification (per-position drafted and accepted tokens)."""
    m, s = policy_llm["metrics"], policy_llm["sampler"]

    def padded(xs):  # the sampler only grows to the longest draft it verified
        return (list(xs) + [0] * K)[:K]

    assert sum(s["drafted"]) > 0
    assert padded(s["drafted"]) == [
        int(x) for x in m["vllm:adaflash_drafted_tokens_per_pos"]
    ]
    assert padded(s["accepted"]) == [
        int(x) for x in m["vllm:adaflash_accepted_tokens_per_pos"]
    ]


def test_kv_pressure_and_token_budget(tiny, tiny_head_drafter, baseline):
    """A KV cache of a few blocks and a small token budget: requests wait or get
    preempted, none fails, no step exceeds the budget, output is still identical."""
    spec = tiny.spec(
        k=K,
        model=str(tiny_head_drafter),
        adaflash={
            "length": {"mode": "cost_aware"},
            "admission": {"token_budget": 64, "beta": 0.5},
        },
    )
    llm = make_llm(
        tiny.target,
        spec,
        num_gpu_blocks_override=12,
        max_num_seqs=16,
        max_num_batched_tokens=256,
    )
    try:
        outs = greedy(llm, PROMPTS)
        m = metrics(llm)
    finally:
        shutdown(llm)
    assert outs == baseline["greedy"]
    assert m["vllm:adaflash_max_step_tokens"] <= 64
    assert m["vllm:adaflash_admissions_total"] == len(PROMPTS)
    assert m["vllm:adaflash_requests_finished"] == len(PROMPTS)


def test_steady_skipping_is_lossless_and_counted(tiny, tiny_head_drafter, baseline):
    """A draft gate that follows skipping with no check of drafting ever due, in
    an engine that retires: skipped steps take the steady state's short path
    (proposers/steady_skip.py), each run by the runner as a plain decoding
    step (patches.py W10), or through its spec-decode path with that off.
    Output token-identical to plain vLLM, the gate's counters on /metrics
    exact; once the gate drafts again (retiring off) the state ends, requests
    draft, and the output is still identical."""
    spec = tiny.spec(
        k=K,
        model=str(tiny_head_drafter),
        adaflash={"length": {"mode": "cost_aware", "k_min": 0}},
    )
    llm = make_llm(tiny.target, spec)
    never = {"explore_at": 10**9}
    try:
        llm.collective_rpc("adaflash_debug_gate", args=({**never, "drafting": 0},))
        llm.collective_rpc("adaflash_debug_retire", args=(True, True))
        skipping = greedy(llm, PROMPTS)
        state = llm.collective_rpc("adaflash_budget_state")[0]
        m = metrics(llm)
        # the same steps through the runner's spec-decode path (no W10)
        llm.collective_rpc("adaflash_debug_steady_plain", args=(False,))
        spec_path = greedy(llm, PROMPTS)
        state2 = llm.collective_rpc("adaflash_budget_state")[0]
        llm.collective_rpc("adaflash_debug_steady_plain", args=(True,))
        llm.collective_rpc("adaflash_debug_retire", args=(False,))
        llm.collective_rpc("adaflash_debug_gate", args=({**never, "drafting": 1},))
        drafting = greedy(llm, PROMPTS)
        after = metrics(llm)
    finally:
        shutdown(llm)
    assert skipping == baseline["greedy"] and drafting == baseline["greedy"]
    assert spec_path == baseline["greedy"]
    steady, gate = state["steady_skip"], state["draft_gate"]
    assert steady["entries"] >= 1 and steady["steps"] > len(PROMPTS), steady
    # every step of the short path ran as plain decoding (patches.py W10) ...
    assert steady["plain_steps"] == steady["steps"], steady
    # ... and none once that is off
    steady2 = state2["steady_skip"]
    assert steady2["steps"] > steady["steps"], steady2
    assert steady2["plain_steps"] == steady["plain_steps"], steady2
    assert gate["drafted_steps"] == 0 and gate["skipped_steps"] > steady["steps"]
    assert m["vllm:adaflash_draft_gate_skipped_steps"] == gate["skipped_steps"]
    assert m["vllm:spec_decode_num_draft_tokens"] == 0
    assert after["vllm:spec_decode_num_draft_tokens"] > 0
    assert after["vllm:adaflash_draft_gate_drafted_steps"] > 0


def test_head_checkpoint_loads_in_stock_vllm(tiny, tiny_head_drafter, baseline):
    """Stock vLLM DFlash (no AdaFlash) loads the checkpoint with a length head."""
    llm = make_llm(tiny.target, tiny.spec(k=K, model=str(tiny_head_drafter)))
    try:
        outs = greedy(llm, PROMPTS[:8])
        m = metrics(llm)
    finally:
        shutdown(llm)
    assert m["vllm:spec_decode_num_accepted_tokens"] > 0
    assert outs == baseline["greedy"][:8]
