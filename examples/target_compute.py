"""Does the target's own compute run slower in an AdaFlash engine? Builds
engines in the given order (default plain, AdaFlash, AdaFlash, plain: twins
at mirrored places) and times, in turn, each engine's target on the same
fixed inputs outside any step: every layer's MLP and attention projections
(no attention itself: it needs a step's KV cache) and the logits. Prints
each engine's median per token count and each configuration's twins pooled
against plain's (the ratio of the mean of their medians).

Run (about 3 minutes):
    taskset -c 0 python examples/target_compute.py --rounds 400
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from compare_no_draft import _engine, in_process_engines


def _layers_and_logits(model, x):
    """The target's per-token compute but attention: each layer's MLP, then
    its QKV and output projections, then the logits."""
    h = x
    for layer in model.model.layers:
        h = layer.mlp(h)
        qkv = layer.self_attn.qkv_proj(h)[0]
        h = h + layer.self_attn.o_proj(qkv[:, : layer.self_attn.o_proj.input_size])[0]
    return model.compute_logits(h)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--order", default="plain,adaflash,adaflash,plain")
    p.add_argument("--rounds", type=int, default=400)
    p.add_argument("--tokens", default="8,256")
    args = p.parse_args()
    in_process_engines(1)
    import torch

    order = args.order.split(",")
    models = []
    for i, config in enumerate(order):
        llm = _engine(config, 8)
        core = llm.llm_engine.engine_core.engine_core
        runner = core.model_executor.driver_worker.worker.model_runner
        models.append((f"{config}{i}", config, runner.model))
    torch.manual_seed(0)
    hidden = models[0][2].config.hidden_size
    inputs = {int(n): torch.randn(int(n), hidden) for n in args.tokens.split(",")}
    times = {(name, n): [] for name, _, _ in models for n in inputs}
    rng = random.Random(0)
    with torch.inference_mode():
        for _, _, model in models:  # warm-up
            for x in inputs.values():
                for _ in range(20):
                    _layers_and_logits(model, x)
        for _ in range(args.rounds):
            for n, x in inputs.items():
                for name, _, model in rng.sample(models, len(models)):
                    started = time.perf_counter()
                    _layers_and_logits(model, x)
                    times[(name, n)].append(time.perf_counter() - started)
    for n in inputs:
        medians = {name: statistics.median(times[(name, n)]) for name, _, _ in models}
        print(
            f"{n} tokens: "
            + " ".join(f"{name}={1e3 * m:.3f} ms" for name, m in medians.items())
        )
        pooled = {
            c: statistics.fmean(medians[name] for name, cc, _ in models if cc == c)
            for c in dict.fromkeys(c for _, c, _ in models)
        }
        for config, value in pooled.items():
            if config != "plain" and "plain" in pooled:
                print(
                    f"  {config} / plain (twins pooled): {value / pooled['plain']:.4f}"
                )


if __name__ == "__main__":
    main()
