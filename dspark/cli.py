"""``dspark`` command line: parsing only; each subcommand calls into the library.

    dspark prepare-data -c quickstart [key=value ...]
    dspark train        -c quickstart [key=value ...]      (also under torchrun)
    dspark eval         -c quickstart [--checkpoint DIR]
    dspark quickstart   [key=value ...]                    prepare-data + train + eval
    dspark bench-train  [key=value ...]                    DSpark vs DFlash vs Eagle3
    dspark profiles                                        bundled target/algo/run profiles

Every subcommand accepts ``--dry-run`` to print the resolved configuration and exit.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path


def _common(p: argparse.ArgumentParser, default_config: str | None = "quickstart") -> None:
    p.add_argument("-c", "--config", default=default_config, help="run profile name or YAML path")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=50 algo=dflash")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")


def _load(args):
    from dspark.training.config import load_run_config

    cfg = load_run_config(args.config, args.overrides)
    if args.dry_run:
        print(json.dumps(cfg.to_dict(), indent=2))
        sys.exit(0)
    return cfg


def cmd_prepare_data(args) -> None:
    from dspark.training.data import prepare_data

    cfg = _load(args)
    summary = prepare_data(cfg)
    print(json.dumps(summary, indent=2))


def cmd_train(args) -> None:
    from dspark.training.trainer import train

    cfg = _load(args)
    print(f"checkpoint: {train(cfg)}")


def cmd_eval(args) -> None:
    from dspark.engine.evaluate import evaluate, print_table, write_results
    from dspark.training.checkpoint import load_checkpoint
    from dspark.training.target import load_target

    cfg = _load(args)
    target = load_target(cfg.target)
    ckpt = Path(args.checkpoint) if args.checkpoint else cfg.run_dir / "checkpoints" / "last"
    drafter, _, _ = load_checkpoint(ckpt, target)
    e = cfg.eval
    tasks = args.tasks.split(",") if args.tasks else e.tasks
    results = evaluate(target, drafter, tasks, e.temperatures, e.samples_per_task, e.max_new_tokens, e.seed,
                       cfg.data.data_root)
    print_table(results)
    out = Path(args.output) if args.output else cfg.run_dir / "eval.json"
    write_results(results, out, {"checkpoint": str(ckpt), "target": cfg.target.name})
    print(f"results: {out}")


def cmd_quickstart(args) -> None:
    from dspark.engine.evaluate import evaluate, print_table, write_results
    from dspark.training.checkpoint import load_checkpoint
    from dspark.training.data import prepare_data
    from dspark.training.target import load_target
    from dspark.training.trainer import train

    cfg = _load(args)
    target = load_target(cfg.target)
    print("== 1/3 prepare data (self-distilled answers + feature cache)")
    print(json.dumps(prepare_data(cfg, target), indent=2))
    print("== 2/3 train the drafter")
    ckpt = train(cfg, target)
    print("== 3/3 evaluate acceptance at batch 1")
    drafter, _, _ = load_checkpoint(ckpt, target)
    e = cfg.eval
    results = evaluate(target, drafter, e.tasks, e.temperatures, e.samples_per_task, e.max_new_tokens, e.seed,
                       cfg.data.data_root)
    print_table(results)
    write_results(results, cfg.run_dir / "eval.json", {"checkpoint": str(ckpt), "target": cfg.target.name})
    print(f"\ncheckpoint: {ckpt}\nresults: {cfg.run_dir / 'eval.json'}")
    print("Scale up: more prompts/steps (data.max_prompts=2000 train.steps=3000), a GPU (train.device=cuda),"
          " several GPUs (torchrun --nproc_per_node 8 -m dspark.cli train ...), or a real target"
          " (target=qwen3-4b target.source=/path/to/Qwen3-4B).")


def cmd_bench_train(args) -> None:
    from dspark.training.compare import run_comparison

    cfg = _load(args)
    run_comparison(cfg, Path(args.output_dir), " ".join(sys.argv))


def cmd_profiles(_args) -> None:
    from dspark.training.config import list_profiles

    for kind in ("targets", "algos", "runs"):
        print(f"{kind}: {', '.join(list_profiles(kind))}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dspark", description="Train, convert and serve DSpark drafters.")
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare-data", help="regenerate answers with the target; build the feature cache")
    _common(p); p.set_defaults(fn=cmd_prepare_data)
    p = sub.add_parser("train", help="train a drafter (DSpark, DFlash or Eagle3)")
    _common(p); p.set_defaults(fn=cmd_train)
    p = sub.add_parser("eval", help="acceptance evaluation at batch 1")
    _common(p)
    p.add_argument("--checkpoint", help="drafter checkpoint directory (default: <run>/checkpoints/last)")
    p.add_argument("--tasks", help="comma list of math,code,chat or JSONL paths")
    p.add_argument("--output", help="JSON output path (default: <run>/eval.json)")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("quickstart", help="prepare-data + train + eval on the embedded target")
    _common(p); p.set_defaults(fn=cmd_quickstart)
    p = sub.add_parser("bench-train", help="train and compare DSpark, DFlash and Eagle3 on one budget")
    _common(p)
    p.add_argument("--output-dir", default="docs/benchmarks")
    p.set_defaults(fn=cmd_bench_train)
    p = sub.add_parser("profiles", help="list bundled profiles")
    p.set_defaults(fn=cmd_profiles)
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from dspark.training.checkpoint import CheckpointError
    from dspark.training.config import ConfigError
    from dspark.training.data import DataError
    from dspark.training.target import TargetLoadError

    try:
        args.fn(args)
    except (ConfigError, CheckpointError, DataError, TargetLoadError) as exc:
        print(f"dspark {args.command}: error: {exc}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
