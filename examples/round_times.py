"""What a drafting round costs per block length, at one request on this machine:
paired round times with the lengths forced in a cycle.

The block length's trials (proposers/block_length.py) compare two lengths from
pairs of neighbouring rounds. This measures what they measure, for every length
of the cycle at once: an AdaFlash engine (`cost_aware`, draft gate off) whose
block length is replaced by a fixed cycle (default 5,4,5,6,5,7: every other
round at the reference length 5), run over demo prose prompts one at a time.
Each round that is not the reference is paired with the reference round next
to it; the report gives, per length, the mean and spread of ln(t / t_ref) over
its pairs (what a trial's gain subtracts, and the noise its standard error
comes from), the median round time per length, and the S_j the engine had at
the end. Greedy, ignore_eos; lossless as any AdaFlash engine is.

Run (about 2 minutes on one core):
    taskset -c 0 python examples/round_times.py --num-prompts 60 --out /tmp/rounds.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics

from compare_no_draft import _engine, demo_prompts, in_process_engines

LOG: list[tuple] = []  # ("round", length, ms, survival) in the order they ran


class CycledLength:
    """A block length that ignores timings: the cycle's lengths in turn, every
    round timed (`record_round`) logged."""

    def __init__(self, cycle: list[int], full: int):
        if max(cycle) > full:
            raise ValueError(f"lengths {cycle} exceed K = {full}")
        self.cycle, self.full, self.i = cycle, full, 0

    def next_length(self, num_reqs: int, after_full_accept: bool = False) -> int:
        length = self.cycle[self.i % len(self.cycle)]
        self.i += 1
        return length

    def record_round(self, *, length, num_reqs, round_ms, survival) -> None:
        # the proposer hands `PositionSurvival.survival` itself (BlockLength
        # reads it only when deciding); the log keeps each round's values
        survival = survival() if callable(survival) else survival
        LOG.append(("round", length, round_ms, survival))

    def to_dict(self) -> dict:
        return {"cycle": self.cycle}


def pair_report(rounds: list[tuple[int, float]], reference: int) -> dict:
    """Per length: pairs with an adjacent reference round, mean / sd / robust sd
    of ln(t / t_ref), and the median round time."""
    logs: dict[int, list[float]] = {}
    for (a, ta), (b, tb) in itertools.pairwise(rounds):
        if a == reference and b != reference:
            logs.setdefault(b, []).append(math.log(tb / ta))
        elif b == reference and a != reference:
            logs.setdefault(a, []).append(math.log(ta / tb))
    times: dict[int, list[float]] = {}
    for n, t in rounds:
        times.setdefault(n, []).append(t)
    out = {}
    for n in sorted(times):
        d = logs.get(n, [])
        row = {"rounds": len(times[n]), "median_ms": statistics.median(times[n])}
        if len(d) > 1:
            med = statistics.median(d)
            row.update(
                pairs=len(d),
                mean_log_ratio=statistics.fmean(d),
                sd=statistics.stdev(d),
                robust_sd=1.4826 * statistics.median(abs(x - med) for x in d),
            )
        out[n] = row
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--skip", type=int, default=100, help="prompts left out first")
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--cycle", default="5,4,5,6,5,7")
    p.add_argument("--out", help="also write the report and the rounds here")
    args = p.parse_args()
    cycle = [int(n) for n in args.cycle.split(",")]
    reference = statistics.mode(cycle)

    in_process_engines(1)  # GiB: one request
    from tqdm import tqdm
    from vllm import SamplingParams

    llm = _engine("adaflash:noskip", 1)

    def install(worker) -> bool:
        drafter = worker.model_runner.drafter
        drafter.block_length = CycledLength(cycle, drafter.block_length.full)
        return True

    llm.collective_rpc(install)
    prompts = demo_prompts(llm.get_tokenizer())[
        args.skip : args.skip + args.num_prompts
    ]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for prompt in tqdm(prompts, desc="prompts"):  # one request at a time
        llm.generate([prompt], params, use_tqdm=False)
    rounds = [(n, ms) for _, n, ms, _ in LOG]
    report = {
        "cycle": cycle,
        "reference": reference,
        "rounds": len(rounds),
        "survival_at_end": LOG[-1][3] if LOG else None,
        "lengths": pair_report(rounds, reference),
    }
    for n, row in report["lengths"].items():
        extra = (
            f", vs {reference}: {100 * row['mean_log_ratio']:+.1f}% "
            f"(sd {100 * row['sd']:.1f}%, robust {100 * row['robust_sd']:.1f}%, "
            f"{row['pairs']} pairs)"
            if "pairs" in row
            else ""
        )
        print(
            f"L = {n}: {row['rounds']} rounds, median {row['median_ms']:.2f} ms{extra}"
        )
    print(json.dumps({k: v for k, v in report.items() if k != "lengths"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**report, "log": rounds}, f)


if __name__ == "__main__":
    main()
