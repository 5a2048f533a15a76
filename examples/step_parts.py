"""Where a step's time goes, engine by engine: plain vLLM and AdaFlash built
twice at mirrored places (`twin_build_order`: A P P' A'), stepped in turn at a
steady load as in `compare_steps.py`, each engine's step split into the engine
core's parts: the scheduler's `schedule`, the runner's `execute_model` (and the
target's forward inside it, `_model_forward`), `sample_tokens`, the
scheduler's `update_from_output`, and the rest of `LLM.step` (output
processing), `execute_model`'s time outside the forward, and the forward's
in the target's attention layers (forward hooks) and outside them. Prints each
part's median over the steps at the full batch without a new prompt (and
over those with one), per engine and pooled over twins, and AdaFlash's
excess over plain per part: what AdaFlash adds to a step of the steady
skipping state, and whether the target's forward itself runs slower in its
engine.

The parts are timed with `perf_counter` around the methods of each engine's
own objects (a few microseconds each, alike in every engine).

Two probes of the forward's excess (measurements only): `--kv-blocks N`
gives every engine N KV cache blocks (`num_gpu_blocks_override`: the AdaFlash
engine's group holds the drafter's layer too, so from the same memory it gets
fewer blocks than plain's), and `--aux-off-in-plain-steps` switches the
target's capture of the drafter's hidden states off for the steps W10 runs as
plain decoding (nothing reads them there).

Run (about 4 minutes at 8 requests, 1,500 steps):
    taskset -c 0 python examples/step_parts.py --concurrency 8 --steps 1500 \
        --domain math --out step_parts.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from compare_no_draft import _engine, demo_prompts, in_process_engines
from compare_steps import MAX_MODEL_LEN

# (label, object path from the engine core, method)
_PARTS = (
    ("schedule", "scheduler", "schedule"),
    ("execute_model", "runner", "execute_model"),
    ("forward", "runner", "_model_forward"),
    ("sample_tokens", "runner", "sample_tokens"),
    ("update", "scheduler", "update_from_output"),
)


def _timed(record: dict, label: str, method):
    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            record[label] += time.perf_counter() - started

    return timed


def _instrument(llm) -> dict[str, float]:
    """Time the parts of `llm`'s steps into a dict it returns (seconds of the
    step in progress, reset by the caller before each step), the target's
    attention layers inside its forward too (forward hooks)."""
    from vllm.model_executor.layers.attention.attention import Attention

    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    owners = {"scheduler": core.scheduler, "runner": runner}
    record = dict.fromkeys([label for label, _, _ in _PARTS] + ["attention"], 0.0)
    for label, owner, name in _PARTS:
        obj = owners[owner]
        setattr(obj, name, _timed(record, label, getattr(obj, name)))
    started = [0.0]

    def before(module, args):
        started[0] = time.perf_counter()

    def after(module, args, output):
        record["attention"] += time.perf_counter() - started[0]

    for module in runner.model.modules():  # the target's (not the drafter's)
        if isinstance(module, Attention):
            module.register_forward_pre_hook(before)
            module.register_forward_hook(after)
    return record


def _same_kv_blocks(num_blocks: int) -> None:
    """Every engine built from here on gets `num_blocks` KV cache blocks."""
    import vllm

    build = vllm.LLM.__init__

    def init(self, *args, **kwargs):
        kwargs["num_gpu_blocks_override"] = num_blocks
        build(self, *args, **kwargs)

    vllm.LLM.__init__ = init


def _aux_off_in_plain_steps() -> None:
    """W10's plain steps run the target without capturing the drafter's
    hidden states (the model's aux layers and the runner's flag hidden from
    `_runs_plain` saying yes to the end of the step)."""
    import adaflash_vllm.patches as patches

    runs_plain, end_plain_step = patches._runs_plain, patches._end_plain_step

    def _runs_plain(runner, drafter, scheduler_output):
        plain = runs_plain(runner, drafter, scheduler_output)
        if plain and runner.use_aux_hidden_state_outputs:
            model = runner.model.model
            runner._probe_aux = model.aux_hidden_state_layers
            model.aux_hidden_state_layers = ()
            runner.use_aux_hidden_state_outputs = False
        return plain

    def _end_plain_step(runner, scheduler_output):
        layers = runner.__dict__.pop("_probe_aux", None)
        if layers is not None:
            runner.model.model.aux_hidden_state_layers = layers
            runner.use_aux_hidden_state_outputs = True
        end_plain_step(runner, scheduler_output)

    patches._runs_plain, patches._end_plain_step = _runs_plain, _end_plain_step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--domain", default="prose", choices=("prose", "math", "code"))
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--warmup-steps", type=int, default=300)
    p.add_argument(
        "--config", default="adaflash", help="the configuration against plain"
    )
    p.add_argument("--out", help="write the per-part medians (JSON) here")
    p.add_argument("--kv-blocks", type=int, help="every engine's KV cache blocks")
    p.add_argument("--aux-off-in-plain-steps", action="store_true")
    args = p.parse_args()
    in_process_engines(1)
    if args.kv_blocks:
        _same_kv_blocks(args.kv_blocks)
    if args.aux_off_in_plain_steps:
        _aux_off_in_plain_steps()
    from tqdm import tqdm
    from vllm import SamplingParams

    from adaflash_vllm.bench.paired import staggered_lengths
    from adaflash_vllm.bench.stepped import (
        Stream,
        config_of,
        step_in_turn,
        twin_build_order,
    )

    names = twin_build_order([args.config, "plain"])
    built = {n: _engine(config_of(n), args.concurrency) for n in names}
    records = {n: _instrument(llm) for n, llm in built.items()}
    tokenizer = built["plain"].get_tokenizer()
    room = MAX_MODEL_LEN - 5 * args.max_tokens // 3
    prompts = [
        p
        for p in demo_prompts(tokenizer, args.domain)
        if len(tokenizer(p).input_ids) <= room
    ]
    warm = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for llm in built.values():
        llm.generate(prompts[:8], warm, use_tqdm=False)
    lengths = staggered_lengths(len(prompts), args.max_tokens)
    parts: dict[str, list[dict[str, float]]] = {n: [] for n in built}

    class PartStream(Stream):
        def step(self) -> None:
            record = records[self.name]
            for label in record:
                record[label] = 0.0
            super().step()
            parts[self.name].append(dict(record))

    streams = [
        PartStream(
            n,
            llm,
            args.concurrency,
            prompts,
            lengths,
            adaflash=not n.startswith("plain"),
        )
        for n, llm in built.items()
    ]
    step_in_turn(
        streams,
        args.steps,
        progress=lambda r: tqdm(r, desc="steps", unit="step", mininterval=10),
    )
    labels = (
        ["step"]
        + [label for label, _, _ in _PARTS]
        + ["attention", "forward_but_attention", "outside_forward", "rest"]
    )

    def rows(name: str, new_prompt: bool) -> list[dict[str, float]]:
        stream = next(s for s in streams if s.name == name)
        out = []
        for st, rec in list(zip(stream.steps, parts[name], strict=True))[
            args.warmup_steps :
        ]:
            if st.batch != args.concurrency or st.new_prompt != new_prompt:
                continue
            row = {"step": st.seconds, **rec}
            # execute_model's time holds the forward's: the rest is outside both
            row["outside_forward"] = rec["execute_model"] - rec["forward"]
            row["forward_but_attention"] = rec["forward"] - rec["attention"]
            row["rest"] = st.seconds - sum(
                rec[k] for k in ("schedule", "execute_model", "sample_tokens", "update")
            )
            out.append(row)
        return out

    summary: dict = {
        "concurrency": args.concurrency,
        "steps": args.steps,
        "domain": args.domain,
        "kv_blocks": args.kv_blocks,
        "aux_off_in_plain_steps": args.aux_off_in_plain_steps,
        "built": names,
        "medians_ms": {},
    }
    for new_prompt in (False, True):
        kind = "new_prompt" if new_prompt else "no_new_prompt"
        print(
            f"steps at {args.concurrency} requests, {kind.replace('_', ' ')} "
            "(median ms per part)"
        )
        medians = summary["medians_ms"][kind] = {}
        groups = {n: [n] for n in names}
        groups.update(
            {
                f"{c} (twins)": [n for n in names if config_of(n) == c]
                for c in (args.config, "plain")
            }
        )
        for label, twins in groups.items():
            data = [r for n in twins for r in rows(n, new_prompt)]
            if not data:
                continue
            m = {k: 1e3 * statistics.median(r[k] for r in data) for k in labels}
            m["n"] = len(data)
            medians[label] = m
            print(
                f"  {label:>22} n={m['n']:5d} "
                + " ".join(f"{k}={m[k]:.3f}" for k in labels)
            )
        a, b = medians.get(f"{args.config} (twins)"), medians.get("plain (twins)")
        if a and b:
            excess = {k: a[k] - b[k] for k in labels}
            medians["excess"] = excess
            print(
                f"  {args.config} - plain, ms: "
                + " ".join(f"{k}={excess[k]:+.3f}" for k in labels)
                + f" ({100 * excess['step'] / b['step']:+.1f}% of plain's step)"
            )
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
