"""The `adaflash` command: demo, drafter training, benchmarks, tiny models.

Each subcommand is a thin map onto package code; options have small defaults and
`--help` lists them.
"""

from __future__ import annotations

import argparse
import sys

from adaflash_vllm.errors import AdaFlashError


def _cmd_make_tiny(args: argparse.Namespace) -> None:
    from adaflash_vllm.tiny import build_tiny_pair

    target, drafter = build_tiny_pair(args.out)
    print(f"target:  {target}\ndrafter: {drafter}")


def _cmd_train_drafter(args: argparse.Namespace) -> None:
    from adaflash_vllm.training.train_drafter import main_train_drafter

    main_train_drafter(args)


def _cmd_eval_drafter(args: argparse.Namespace) -> None:
    from adaflash_vllm.training.train_drafter import main_eval_drafter

    main_eval_drafter(args)


def _cmd_demo(args: argparse.Namespace) -> None:
    from adaflash_vllm.demo import run_demo

    run_demo(args)


def _cmd_trainer(args: argparse.Namespace) -> None:
    from adaflash_vllm.training.online import main_trainer

    main_trainer(args)


def _cmd_bench(args: argparse.Namespace) -> None:
    from adaflash_vllm.bench.cli import run_bench

    run_bench(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adaflash", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("make-tiny", help="build a tiny target + random DFlash drafter")
    p.add_argument("out", help="output folder (gets target/ and drafter/)")
    p.set_defaults(func=_cmd_make_tiny)

    from adaflash_vllm.training.train_drafter import add_train_drafter_args

    p = sub.add_parser(
        "train-drafter",
        help="train a DFlash drafter for a target "
        "(regenerate with vLLM, train, evaluate tau, save)",
    )
    add_train_drafter_args(p)
    p.set_defaults(func=_cmd_train_drafter)

    from adaflash_vllm.training.train_drafter import add_eval_drafter_args

    p = sub.add_parser(
        "eval-drafter",
        help="tau of a drafter on target-regenerated responses, per prompt file",
    )
    add_eval_drafter_args(p)
    p.set_defaults(func=_cmd_eval_drafter)

    from adaflash_vllm.demo import add_demo_args

    p = sub.add_parser(
        "demo",
        help="the main job: plain vLLM vs stock DFlash vs "
        "AdaFlash on a domain-shift stream, bundled models",
    )
    add_demo_args(p)
    p.set_defaults(func=_cmd_demo)

    from adaflash_vllm.training.online import add_trainer_args

    p = sub.add_parser(
        "trainer",
        help="online distillation trainer: tail the buffer, "
        "train, publish and push drafter versions",
    )
    add_trainer_args(p)
    p.set_defaults(func=_cmd_trainer)

    from adaflash_vllm.bench.cli import add_bench_args

    p = sub.add_parser("bench", help="benchmark configurations side by side")
    add_bench_args(p)
    p.set_defaults(func=_cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except AdaFlashError as e:
        sys.exit(f"adaflash: error: {e}")


if __name__ == "__main__":
    main()
