"""Shared test helpers: tiny models, engine construction and teardown, metrics,
served trajectories and online-trainer configs."""

from __future__ import annotations

import gc
import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "cat",
    "hello",
    "world",
    "def",
    "add",
    "return",
    "print",
    "range",
    "for",
    "in",
    "if",
    "else",
    "while",
    "question",
    "answer",
    "plus",
    "minus",
    "one",
    "two",
    "three",
]


def make_prompts(
    n: int, seed: int, min_words: int = 1, max_words: int = 40
) -> list[str]:
    """Deterministic word-salad prompts of varied lengths."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words)))
        for _ in range(n)
    ]


PROMPTS = make_prompts(32, seed=1)
"""The prompts engine tests generate from (32, 1..40 words)."""


@dataclass
class TinyModels:
    root: Path
    target: Path
    drafter_random: Path
    drafter_trained: Path
    trained_tau: float  # greedy tau of the trained drafter on PROMPTS (offline eval)
    sequences: list  # the target's greedy continuations the drafter trained on
    random_tau: float  # the same evaluation before training (random init)
    train_losses: list[float]

    def spec(
        self,
        *,
        drafter: str = "trained",
        k: int = 3,
        adaflash: dict | None = None,
        **extra,
    ) -> dict:
        """A speculative config dict (adaflash section only when given)."""
        path = self.drafter_trained if drafter == "trained" else self.drafter_random
        spec = {
            "method": "dflash",
            "model": str(path),
            "num_speculative_tokens": k,
            **extra,
        }
        if adaflash is not None:
            spec["adaflash"] = adaflash
        return spec

    def write_config(self, name: str, spec: dict) -> Path:
        path = self.root / name
        path.write_text(json.dumps(spec))
        return path


def build_tiny_models(root: Path) -> TinyModels:
    """Build the tiny target, a random drafter and a drafter trained on it."""
    # One thread: tiny matrices gain nothing from more, and an oversubscribed
    # machine turns OpenMP spin-waits into minutes.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _build_tiny_models(root)
    finally:
        torch.set_num_threads(threads)


def _build_tiny_models(root: Path) -> TinyModels:
    from adaflash_vllm.training.data import Sequence
    from adaflash_vllm.training.features import TargetModel
    from adaflash_vllm.training.offline import (
        OfflineTrainConfig,
        OfflineTrainer,
        evaluate_tau,
        load_or_init_drafter,
    )

    from adaflash_vllm.tiny import build_drafter, build_target

    target = build_target(root / "target")
    drafter_random = build_drafter(root / "drafter-random", target, block_size=4)
    tgt = TargetModel(target)
    tok = _tokenizer(target)
    seqs = []
    for p in PROMPTS + make_prompts(32, seed=2):
        ids = tok(p, return_tensors="pt").input_ids
        out = tgt.model.generate(
            ids, max_new_tokens=48, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        seqs.append(Sequence(out[0].tolist(), ids.shape[1]))
    cfg = json.loads((drafter_random / "config.json").read_text())
    drafter = load_or_init_drafter(None, cfg)
    random_tau = evaluate_tau(drafter, tgt, seqs[: len(PROMPTS)], 3)["tau"]
    trainer = OfflineTrainer(
        tgt,
        drafter,
        OfflineTrainConfig(
            block_size=4,
            epochs=25,
            batch_size=8,
            num_anchors=24,
            lr=3e-3,
            save_every=10**9,
        ),
        root / "train",
    )
    state = trainer.train(seqs)
    tau = evaluate_tau(drafter, tgt, seqs[: len(PROMPTS)], 3)["tau"]
    trained = trainer.save_checkpoint(root / "drafter-trained")
    return TinyModels(
        root, target, drafter_random, trained, tau, seqs, random_tau, list(state.losses)
    )


def _tokenizer(target: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target)


def make_llm(target: Path, spec: dict | str | None = None, **overrides):
    """The one way tests build an engine (small KV, eager, fp32, stats on)."""
    from vllm import LLM

    kwargs = dict(
        model=str(target),
        dtype="float32",
        max_model_len=512,
        enforce_eager=True,
        seed=0,
        max_num_seqs=8,
        disable_log_stats=False,
    )
    kwargs.update(overrides)
    if spec is not None:
        kwargs["speculative_config"] = spec
    return LLM(**kwargs)


def shutdown(llm) -> None:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


def greedy(llm, prompts: list[str], max_tokens: int = 32) -> list[list[int]]:
    return greedy_with_cache_hits(llm, prompts, max_tokens)[0]


def greedy_with_cache_hits(
    llm, prompts: list[str], max_tokens: int = 32
) -> tuple[list[list[int]], list[int]]:
    """Greedy outputs and each request's prefix-cache hit (cached prompt tokens)."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs], [
        o.num_cached_tokens for o in outs
    ]


def sample_tokens(
    llm, prompt: str, n: int, positions: tuple[int, ...], temperature: float = 1.0
) -> dict[int, list[int]]:
    """Tokens at `positions` of n seeded samples of `prompt` at `temperature`."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            temperature=temperature,
            max_tokens=max(positions) + 1,
            ignore_eos=True,
            seed=1000 + i,
        )
        for i in range(n)
    ]
    outs = llm.generate([prompt] * n, params, use_tqdm=False)
    return {p: [o.outputs[0].token_ids[p] for o in outs] for p in positions}


def metrics(llm) -> dict[str, object]:
    """Name -> value (counter/gauge), list (per-position vector) or bucket dict."""
    result: dict[str, object] = {}
    for m in llm.get_metrics():
        if hasattr(m, "values"):
            result[m.name] = list(m.values)
        elif hasattr(m, "buckets"):
            result[m.name] = dict(m.buckets)
        elif m.name.endswith("_per_pos"):
            result.setdefault(m.name, []).append(m.value)
        else:
            result[m.name] = m.value
    return result


def torch_seed(seed: int = 0) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def served_trajectories(
    tiny: TinyModels,
    count: int,
    first: int = 0,
    drafts: int | None = None,
    accepted: int | None = None,
):
    """`count` of the tiny models' sequences from `first` on, as the engine
    logs them: a round every 3 output positions, each with `drafts` verified
    and `accepted` accepted (None: the counts not logged)."""
    from adaflash_vllm.buffer import Trajectory

    out = []
    for i, s in enumerate(tiny.sequences[first : first + count]):
        p = s.prompt_len
        positions = list(range(p + 1, len(s.token_ids) - 1, 3))
        n = len(positions)
        out.append(
            Trajectory(
                request_id=f"r{first + i}",
                prompt_token_ids=s.token_ids[:p],
                output_token_ids=s.token_ids[p:],
                round_positions=positions,
                round_drafts=[] if drafts is None else [drafts] * n,
                round_accepted=[] if accepted is None else [accepted] * n,
                drafter_version=0,
                temperature=0.0,
                finish_reason="length",
            )
        )
    return out


def trainer_config(buffer_dir: Path, versions_dir: Path, **online):
    """An online-training config for a trainer run in the test process: no
    push channel, the logged rounds only (no random anchors), one epoch;
    `online` sets or overrides `OnlineConfig` fields."""
    from adaflash_vllm.config import AdaFlashConfig, OnlineConfig

    settings = {"push": False, "num_anchors": 0, "epochs": 1, **online}
    return AdaFlashConfig(
        online=OnlineConfig(
            enabled=True,
            buffer_dir=str(buffer_dir),
            versions_dir=str(versions_dir),
            **settings,
        )
    )
