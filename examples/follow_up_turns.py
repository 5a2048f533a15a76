"""Follow-up turns after a burst: what a prefix-cache hit on blocks with holes
should do. A burst of `--concurrency` prompts retires its requests from drafting
(`length.retire_when_skipping`): the cache blocks of their prompts and answers
hold no drafter K/V. Then each conversation sends a second turn (its prompt,
its answer and "Go on.", as token ids, so the first turn's full blocks are a
prefix-cache hit), `--follow-concurrency` in flight (a new one as soon as one
finishes, as a server with that many clients sees them), a load where the gate
drafts. With `--in-groups` they go as `LLM.generate` calls of that many
prompts instead, each call waiting for its slowest request: speculation makes
requests finish at different steps, so such calls spend their tails at smaller
batches than plain vLLM's (BENCHMARKS.md run 35). With `--first-concurrency K`
the first turns also run K in flight instead of as one burst (no request then
retires, so the second turns' hits have no holes), timed and compared with
plain like the second turns (BENCHMARKS.md run 36).

Engines (in this process, demo models, greedy; whole rounds in turn, the order
rotated by one each round):
- `plain`: vLLM without speculation (its hits are never cut);
- `cut`: `length.cut_holey_prefix_hits` on: a hit is cut before the first block
  with holes, the request recomputes from there and drafts with a whole context;
- `keep`: AdaFlash's default: the hit is kept whole; the request drafts over the
  holes as they are.

Per round and engine it prints one JSON line (the two phases' wall seconds,
each phase's drafts verified and accepted, the hits cut and the tokens they
recomputed, and the draft gate's drafted and skipped steps per batch size up to
4, counted since the engine was built); the engines' outputs must match, else
it stops. Then each engine's second-phase wall in all and its speed against
plain's (in all, and the mean and spread of the rounds' ratios), and the same
for the first phase with `--first-concurrency`. With `--twins` each engine is
built twice, at mirrored places, and a round's wall is the pair's sum.

Run (about 14 minutes on one core):
    VLLM_CPU_KVCACHE_SPACE=1 taskset -c 0 python examples/follow_up_turns.py \
        --rounds 3 --twins
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from compare_no_draft import _engine, demo_prompts, in_process_engines

from adaflash_vllm.bench.paired import round_order

ENGINES = "plain,cut=adaflash,keep=adaflash"
FOLLOW_UP = "<|im_end|>\n<|im_start|>user\nGo on.<|im_end|>\n<|im_start|>assistant\n"


def counts(worker) -> dict:
    """Drafts verified and accepted so far (zeros without a drafter)."""
    sampler = getattr(worker.model_runner, "rejection_sampler", None)
    if not hasattr(sampler, "stats"):
        return {"drafted": 0, "accepted": 0}
    stats = sampler.stats()
    return {"drafted": sum(stats["drafted"]), "accepted": sum(stats["accepted"])}


def gate_summary(worker) -> dict:
    """Per batch-size bucket of at most 4 requests: steps drafted and skipped."""
    gates = getattr(worker.model_runner.drafter.draft_gate, "gates", {})
    return {b: [g.drafted_steps, g.skipped_steps] for b, g in gates.items() if b <= 4}


def run_at_concurrency(llm, prompts, params, concurrency: int) -> list:
    """`prompts` through the engine with `concurrency` requests in flight: a new
    one is added as soon as one finishes, as a server with that many clients
    keeps it. Outputs in `prompts`' order."""
    engine = llm.llm_engine
    pending = iter(enumerate(prompts))
    index: dict[str, int] = {}
    done: dict[int, object] = {}
    in_flight = 0

    def add_next() -> bool:
        nxt = next(pending, None)
        if nxt is None:
            return False
        req_id = f"in-flight-{time.monotonic_ns()}-{nxt[0]}"
        index[req_id] = nxt[0]
        engine.add_request(req_id, nxt[1], params)
        return True

    while in_flight < concurrency and add_next():
        in_flight += 1
    while in_flight:
        for out in engine.step():
            if out.finished:
                done[index[out.request_id]] = out
                in_flight -= 1
                if add_next():
                    in_flight += 1
    return [done[i] for i in range(len(prompts))]


def scheduler_of(llm):
    return llm.llm_engine.engine_core.engine_core.scheduler


def cuts(llm) -> tuple[int, int]:
    holes = getattr(scheduler_of(llm), "holes", None)
    return (0, 0) if holes is None else (holes.cut_requests, holes.cut_tokens)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--follow-concurrency", type=int, default=2)
    p.add_argument(
        "--first-concurrency",
        type=int,
        help="run the first turns with this many in flight too (timed, and "
        "compared with plain like the second turns) instead of one burst of "
        "--concurrency; no request then retires",
    )
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument(
        "--engines",
        default=ENGINES,
        help="comma list of NAME=CONFIG (compare_no_draft.py's configurations; "
        "a bare NAME is its own CONFIG); `cut` turns cut_holey_prefix_hits on, "
        "`plain` is the baseline",
    )
    p.add_argument(
        "--in-groups",
        action="store_true",
        help="send the second turns as LLM.generate calls of --follow-concurrency "
        "prompts each (each call waits for its slowest request) instead of "
        "keeping --follow-concurrency requests in flight",
    )
    p.add_argument(
        "--twins",
        action="store_true",
        help="build each engine twice, in mirrored order (a, b, c, c, b, a), and "
        "pool each pair's walls: where an engine is built moves its step time",
    )
    args = p.parse_args()
    specs = dict(part.partition("=")[::2] for part in args.engines.split(",") if part)
    specs = {name: config or name for name, config in specs.items()}
    in_process_engines(2)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    names = list(specs)
    if args.twins:
        names = [f"{n}/a" for n in names] + [f"{n}/b" for n in reversed(names)]
    engines = {
        name: _engine(specs[name.partition("/")[0]], args.concurrency) for name in names
    }
    for name, llm in engines.items():
        if name.partition("/")[0] == "cut":
            llm.collective_rpc("adaflash_debug_prefix_cuts", args=(True,))
    tokenizer = next(iter(engines.values())).get_tokenizer()
    prompts = demo_prompts(tokenizer)
    follow_ids = tokenizer.encode(FOLLOW_UP, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    walls = {name: [0.0] * args.rounds for name in specs}  # per round
    first_walls = {name: [0.0] * args.rounds for name in specs}
    n, group = args.concurrency, args.follow_concurrency
    for r in range(args.rounds):
        start = (r * n) % max(1, len(prompts) - n)
        batch = prompts[start : start + n]
        hashes = set()
        # Rotated by one each round (`round_order`): when the order reversed
        # each round, a plain engine at a round's first place (it had also run
        # last in the round before) ran 7-11% faster than its twin at the last
        # place (BENCHMARKS.md run 35).
        for name in round_order(list(engines), r):
            llm = engines[name]
            start_counts = llm.collective_rpc(counts)[0]
            t = time.perf_counter()
            if args.first_concurrency:
                first = run_at_concurrency(llm, batch, params, args.first_concurrency)
            else:
                first = llm.generate(batch, params, use_tqdm=False)
            wall_a = time.perf_counter() - t
            first_walls[name.partition("/")[0]][r] += wall_a
            second_prompts = [
                TokensPrompt(
                    prompt_token_ids=list(o.prompt_token_ids)
                    + list(o.outputs[0].token_ids)
                    + follow_ids
                )
                for o in first
            ]
            before, cut_before = llm.collective_rpc(counts)[0], cuts(llm)
            t = time.perf_counter()
            if args.in_groups:
                second = []
                for i in range(0, n, group):
                    second += llm.generate(
                        second_prompts[i : i + group], params, use_tqdm=False
                    )
            else:
                second = run_at_concurrency(llm, second_prompts, params, group)
            wall_b = time.perf_counter() - t
            after, cut_after = llm.collective_rpc(counts)[0], cuts(llm)
            walls[name.partition("/")[0]][r] += wall_b
            tokens = tuple(tuple(o.outputs[0].token_ids) for o in first + second)
            hashes.add(hash(tokens))
            row = {
                "round": r,
                "engine": name,
                "burst_wall_s": round(wall_a, 2),
                "follow_up_wall_s": round(wall_b, 2),
                "first_drafted": before["drafted"] - start_counts["drafted"],
                "first_accepted": before["accepted"] - start_counts["accepted"],
                "drafted": after["drafted"] - before["drafted"],
                "accepted": after["accepted"] - before["accepted"],
                "hits_cut": cut_after[0] - cut_before[0],
                "tokens_recomputed": cut_after[1] - cut_before[1],
            }
            if not name.startswith("plain"):
                row["gate"] = llm.collective_rpc(gate_summary)[0]
            print(json.dumps(row), flush=True)
        if len(hashes) != 1:
            raise SystemExit(f"round {r}: the engines' outputs differ")
    phases = [("follow-up turns", walls)]
    if args.first_concurrency:
        phases.insert(0, ("first turns", first_walls))
    for phase, by_engine in phases:
        base = by_engine["plain"]
        for name, wall in by_engine.items():
            ratios = [b / w for b, w in zip(base, wall, strict=True)]
            mean = statistics.fmean(ratios)
            sd = statistics.stdev(ratios) if len(ratios) > 1 else 0.0
            print(
                f"{name}: {phase} {sum(wall):.1f} s in all, "
                f"{sum(base) / sum(wall):.3f}x plain's "
                f"(per round {mean:.3f} +- {sd:.3f})"
            )


if __name__ == "__main__":
    main()
