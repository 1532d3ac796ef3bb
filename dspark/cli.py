"""``dspark`` command line: parsing only; each subcommand calls into the library.

    dspark prepare-data -c quickstart [key=value ...]
    dspark train        -c quickstart [key=value ...]      (also under torchrun)
    dspark eval         -c quickstart [--checkpoint DIR]
    dspark quickstart   [key=value ...]                    prepare-data + train + eval
    dspark bench-train  [key=value ...]                    DSpark vs DFlash vs Eagle3
    dspark profile      -c quickstart                      SPS table (steps/s vs verify tokens)
    dspark calibrate    -c quickstart                      STS temperatures on held-out data
    dspark bench        -c quickstart --sps S --sts T      decode benchmark, side by side
    dspark build        --drafter DIR --output DIR         engine dir: ONNX (+plugin node), HF, TRT-LLM, TRT
    dspark profiles                                        bundled target/algo/run profiles

Every subcommand accepts ``--dry-run`` to print the resolved configuration and exit.
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the commands import what they need when they run: `dspark --help` stays fast
    from dspark.engine.sps import SpsTable

# the batch sizes `dspark profile` times and reports by default (the by-rows grid, the drafter's pass)
PROFILE_ROWS = (1, 2, 4, 8, 16, 32, 64)


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



def _checkpoint_dir(args, cfg) -> Path:
    """--checkpoint, or the run's latest checkpoint."""
    return Path(args.checkpoint) if args.checkpoint else cfg.run_dir / "checkpoints" / "last"


def _run_target_drafter(args, need_drafter: bool = True):
    """-> (run config, loaded target, drafter from --checkpoint or the run's latest), on --device;
    the drafter is None when ``need_drafter`` is False (proposers without the neural one)."""
    from dspark.training.checkpoint import load_checkpoint
    from dspark.training.target import load_target

    cfg = _load(args)
    device = getattr(args, "device", "cpu")
    target = load_target(cfg.target, device=device)
    if not need_drafter:
        return cfg, target, None
    drafter, _, _ = load_checkpoint(_checkpoint_dir(args, cfg), target)
    return cfg, target, drafter.to(device)


def _proposers_need_drafter(specs: list[str]) -> bool:
    """Whether any ``--proposers`` entry (``EngineConfig.proposers`` syntax) uses the neural drafter."""
    from dspark.engine.runtime import parse_proposers
    return any("neural" in parse_proposers(s) for s in specs)

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
    from dspark.engine.evaluate import run_eval

    cfg, target, drafter = _run_target_drafter(args, _proposers_need_drafter([args.proposers]))
    out = run_eval(cfg, target, drafter, _checkpoint_dir(args, cfg) if drafter is not None else None,
                   tasks=args.tasks.split(",") if args.tasks else None, proposers=args.proposers,
                   output=Path(args.output) if args.output else None)
    print(f"results: {out}")


def cmd_quickstart(args) -> None:
    from dspark.engine.evaluate import run_eval
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
    print("== 3/3 evaluate acceptance at batch 1 (dspark eval)")
    drafter, _, _ = load_checkpoint(ckpt, target)
    out = run_eval(cfg, target, drafter, ckpt)
    print(f"\ncheckpoint: {ckpt}\nresults: {out}")
    print("Scale up: more prompts/steps (data.max_prompts=2000 train.steps=3000), a GPU (train.device=cuda),"
          " several GPUs (torchrun --nproc_per_node 8 -m dspark.cli train ...), or a real target"
          " (target=qwen3-4b target.source=/path/to/Qwen3-4B).")


def cmd_bench_train(args) -> None:
    from dspark.engine.train_compare import run_comparison
    from dspark.training.models import DRAFTERS

    cfg = _load(args)
    algos = tuple(a.strip() for a in args.algos.split(",") if a.strip())
    if not algos or set(algos) - set(DRAFTERS):
        raise SystemExit(f"--algos: expected a comma list of {', '.join(DRAFTERS)}; got {args.algos!r}")
    run_comparison(cfg, Path(args.output_dir), " ".join(sys.argv), algos)


def cmd_profile(args) -> None:
    from dspark.engine.bench import profile_target_sps
    from dspark.engine.sps import plot_sps
    from dspark.training.target import load_target

    cfg = _load(args)
    target = load_target(cfg.target, device=args.device)
    rows = [int(r) for r in args.rows.split(",") if r] if args.rows else []
    table = profile_target_sps(target, cfg.target.block_size, context=args.context, max_tokens=args.max_tokens,
                               repeats=args.repeats, static_steps=args.static_steps, batch_rows=rows)
    ckpt = _checkpoint_dir(args, cfg)
    if ckpt.exists():  # the drafter's own cost lets the engine skip drafting where it cannot pay
        from dspark.engine.bench import profile_append_cost, profile_draft_cost
        from dspark.training.checkpoint import load_checkpoint

        drafter = load_checkpoint(ckpt, target)[0].to(args.device)
        rows = [r for r in PROFILE_ROWS if r * (cfg.target.block_size + 1) <= args.max_tokens] or [1]
        table.draft_requests = rows
        table.draft_seconds = profile_draft_cost(drafter, rows, context=args.context, repeats=args.repeats)
        table.draft_append_seconds = profile_append_cost(drafter, repeats=args.repeats)
        table.engine += f" + drafter {ckpt}"
    elif args.checkpoint:
        raise SystemExit(f"dspark profile: no drafter checkpoint at {ckpt}")
    else:
        print(f"no drafter checkpoint at {ckpt}: the table has no drafter cost (adaptive drafting stays off)")
    out = Path(args.output) if args.output else cfg.run_dir / "sps.json"
    table.save(out)
    plot_sps(table, out.with_suffix(".png"))
    for b, s in zip(table.tokens, table.steps_per_s):
        print(f"B={b:4d}  {s:8.2f} steps/s")
    for R, es, ss in zip(table.batch_rows or [], table.extra_tokens or [], table.rows_steps_per_s or []):
        print(f"rows R={R:3d}  " + "  ".join(f"+{e}: {1000 / s:.1f}" for e, s in zip(es, ss)) + "  ms/step")
    for r, s in zip(table.draft_requests or [], table.draft_seconds or []):
        print(f"drafter R={r:3d}  {1000 * s:8.2f} ms/pass")
    if table.draft_append_seconds is not None:
        print(f"drafter context append  {1e6 * table.draft_append_seconds:8.2f} us/position")
    print("\n".join(break_even_lines(table)))
    print(f"SPS table: {out} (plot {out.with_suffix('.png')})")


def break_even_lines(table: SpsTable) -> list[str]:
    """Where speculation can pay on the profiled host, per row count R: the survival probability a
    first draft beside R one-token rows needs before Algorithm 1 verifies it
    (``scheduler.first_draft_survival``), and the drafter pass's share of a plain step where the
    table has its cost. A draft's tokens cost compute, so on a CPU the bar rises with R."""
    from dspark.engine.scheduler import first_draft_survival, step_time
    from dspark.engine.sps import StepCosts

    costs = StepCosts(table)
    rows = table.batch_rows or [r for r in PROFILE_ROWS if r + 1 < table.tokens[-1]]
    lines = ["where a draft can pay: the survival a first draft beside R rows needs to be verified"]
    for R in rows:
        sps = costs(R)
        need = first_draft_survival(sps, R)
        verdict = f"above {need:.0%}" if need < 1.0 else "none (a draft costs more than a row's token)"
        line = f"rows R={R:3d}  {verdict}"
        if table.has_draft_cost:
            line += f"; drafter pass {table.draft_time(R) / step_time(sps, R):.0%} of a plain step"
        lines.append(line)
    return lines


def cmd_calibrate(args) -> None:
    from dspark.engine.calibrate import calibrate, held_out_prompts

    cfg, target, drafter = _run_target_drafter(args)
    out = Path(args.output) if args.output else cfg.run_dir / "sts.json"
    summary = calibrate(target, drafter, held_out_prompts(cfg, target, args.prompts), cfg.eval.max_new_tokens,
                        cfg.eval.seed, out, report_fraction=args.report_fraction)
    if args.docs:
        from dspark.engine.calibrate import write_calibration_docs
        write_calibration_docs(summary, Path(args.docs), "dspark " + " ".join(sys.argv[1:]))
    print(f"{'pos':>3} {'ECE before':>10} {'ECE after':>9} {'AUC':>6} {'Brier after':>11}")
    for p in summary["positions"]:
        print(f"{p['position'] + 1:>3} {p['ece_before']:>10.4f} {p['ece_after']:>9.4f} {p['auc_after']:>6.3f} {p['brier_after']:>11.4f}")
    print(f"STS temperatures: {out}")


def cmd_bench(args) -> None:
    from dspark.engine.bench import decode_benchmark, write_decode_results
    from dspark.engine.sps import load_sps_table
    from dspark.engine.sts import StsCalibration
    from dspark.training.data import load_eval_prompts

    from dspark.engine.bench import SYSTEM_OF_PROPOSERS
    from dspark.engine.proposers import SuffixConfig

    systems = args.systems.split(",")
    if args.proposers:  # the speculative rows by their proposers; target_only and the peers stay
        specs = args.proposers.split(",")
        unknown = [s for s in specs if s not in SYSTEM_OF_PROPOSERS]
        if unknown:
            raise SystemExit(f"--proposers: unknown entries {unknown}; known: {', '.join(SYSTEM_OF_PROPOSERS)}")
        systems = [s for s in systems if s in ("target_only", "hf_generate", "hf_prompt_lookup")]
        systems[1:1] = list(dict.fromkeys(SYSTEM_OF_PROPOSERS[s] for s in specs))
    need = any(s in ("spec_fixed", "spec_scheduled", "hybrid") for s in systems)
    cfg, target, drafter = _run_target_drafter(args, need_drafter=need)
    sps = load_sps_table(args.sps) if args.sps else None
    sts = StsCalibration.load(args.sts).temperatures if args.sts else None
    prompts = [target.chat_prompt_ids(p) for task in ("math", "code", "chat")
               for p in load_eval_prompts(task, args.prompts_per_task, cfg.data.data_root)]
    suffix = SuffixConfig(max_drafts=args.suffix_max_drafts, scope=args.suffix_scope)
    results = decode_benchmark(target, drafter, prompts, [int(b) for b in args.batches.split(",")], args.max_tokens,
                               sps=sps, sts=sts, requests_per_slot=args.requests_per_slot, static_steps=args.static_steps,
                               repeats=args.repeats, systems=tuple(systems), suffix=suffix)
    import torch
    from dspark.engine.host import cpu_label
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else cpu_label(torch.get_num_threads())
    write_decode_results(results, Path(args.output_dir), args.name, "dspark " + " ".join(sys.argv[1:]), device)
    print((Path(args.output_dir) / f"{args.name}.md").read_text())


def _suffix_settings(args) -> dict:
    """The suffix-proposer settings given on the command line (``SuffixConfig`` fields)."""
    keys = {"suffix_max_drafts": "max_drafts", "suffix_scope": "scope", "suffix_max_depth": "max_depth",
            "suffix_shared_max_outputs": "shared_max_outputs", "suffix_shared_max_tokens": "shared_max_tokens"}
    return {k: getattr(args, a) for a, k in keys.items() if getattr(args, a, None) is not None}


def cmd_build(args) -> None:
    from dspark.engine.export.builder import BuildError, build_engine
    from dspark.engine.export.manifest import EngineDirError
    from dspark.engine.export.trt_build import TensorRTUnavailable, TrtBuildError
    from dspark.engine.sps import SpsTableError
    from dspark.engine.sts import StsCalibrationError

    try:
        m = build_engine(drafter_dir=args.drafter, output=args.output, target_profile=args.target,
                         target_source=args.target_source, dtype=args.dtype, max_batch=args.max_batch,
                         max_context=args.max_context, block_size=args.block_size, what=args.what, sps=args.sps,
                         sts=args.sts, plugin_lib=args.plugin_lib, force=args.force,
                         trtllm_version=args.trtllm_version, proposers=args.proposers,
                         suffix=_suffix_settings(args))
    except TensorRTUnavailable as exc:
        print(f"dspark build: error: trt not built: {exc} (the other targets were built into {args.output})",
              file=sys.stderr)
        sys.exit(3)
    except (BuildError, EngineDirError, TrtBuildError, SpsTableError, StsCalibrationError) as exc:
        print(f"dspark build: error: {exc}", file=sys.stderr)
        sys.exit(2)
    built = [k for k, v in m["built"].items() if v.get("status") != "skipped"]
    print(f"engine: {args.output} (built {', '.join(built)}; {len(m['files'])} files hashed in engine.json)")
    for k, v in m["built"].items():
        if v.get("status") == "skipped":
            print(f"skipped {k}: {v['reason']}")


def cmd_profiles(_args) -> None:
    from dspark.training.config import list_profiles

    for kind in ("targets", "algos", "runs"):
        print(f"{kind}: {', '.join(list_profiles(kind))}")


def _static_steps_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--static-steps", default="auto", choices=("auto", "graphs", "eager", "off"),
                   help="fixed-shape decode steps: auto = CUDA graphs on a GPU, ragged eager on the CPU")


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
    p.add_argument("--proposers", default="neural",
                   help="drafting methods, '+'-joined: neural (the checkpoint) | suffix | neural+suffix (hybrid)")
    p.set_defaults(fn=cmd_eval)
    p = sub.add_parser("quickstart", help="prepare-data + train + eval on the embedded target")
    _common(p); p.set_defaults(fn=cmd_quickstart)
    p = sub.add_parser("bench-train", help="train and compare DSpark, DFlash and Eagle3 on one budget")
    _common(p)
    p.add_argument("--output-dir", default="docs/benchmarks")
    p.add_argument("--algos", default="dspark,dflash,eagle3", help="comma list of the drafters to train and compare")
    p.set_defaults(fn=cmd_bench_train)
    p = sub.add_parser("profile", help="profile the target's steps/s against verify-step tokens (SPS table)")
    _common(p)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--repeats", type=int, help="timed steps per point (default: 15 sweeps on the CPU, 20 on a GPU)")
    p.add_argument("--rows", default=",".join(map(str, PROFILE_ROWS)),
                   help="row counts of the by-rows grid (steps of R rows plus drafts; '' for none): size it to the "
                        "batches you serve")
    p.add_argument("--output", help="SPS JSON path (default: <run>/sps.json)")
    p.add_argument("--checkpoint", help="drafter whose pass is timed too (default: <run>/checkpoints/last if present)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N]: profile where you serve")
    _static_steps_arg(p)
    p.set_defaults(fn=cmd_profile)
    p = sub.add_parser("calibrate", help="fit STS temperatures on held-out data")
    _common(p)
    p.add_argument("--checkpoint")
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts to decode")
    p.add_argument("--output", help="STS JSON path (default: <run>/sts.json)")
    p.add_argument("--report-fraction", type=float, default=0.0,
                   help="share of the prompts kept out of the fit and reported on (0: report in sample)")
    p.add_argument("--docs", help="also write calibration.json / calibration.md into this folder")
    p.set_defaults(fn=cmd_calibrate)
    p = sub.add_parser("bench", help="decode benchmark: ours vs target-only vs transformers generate()")
    _common(p)
    p.add_argument("--checkpoint")
    p.add_argument("--sps", help="SPS table for the scheduled system (dspark profile)")
    p.add_argument("--sts", help="STS temperatures (dspark calibrate)")
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompts-per-task", type=int, default=4)
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (CUDA graphs on a GPU)")
    _static_steps_arg(p)
    p.add_argument("--requests-per-slot", type=float, default=2.0,
                   help="requests per batch slot (in-flight refills); each batch size runs max(ceil(this x batch), 4)")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds per system in rotating order; reports medians and per-round ratios (noisy hosts)")
    p.add_argument("--systems", default="target_only,spec_fixed,spec_scheduled,hf_generate,hf_prompt_lookup",
                   help="comma list of target_only,spec_fixed,spec_scheduled,suffix,hybrid,hf_generate,hf_prompt_lookup")
    p.add_argument("--proposers", default=None,
                   help="comma list of neural,suffix,neural+suffix: the speculative rows by their proposers "
                        "(spec_scheduled, suffix, hybrid), replacing those of --systems")
    p.add_argument("--suffix-max-drafts", type=int, default=3, help="the suffix proposer's K")
    p.add_argument("--suffix-scope", default="shared", help="shared | request (engine/proposers/suffix.py)")
    p.add_argument("--output-dir", default="docs/benchmarks")
    p.add_argument("--name", default="decode")
    p.set_defaults(fn=cmd_bench)
    p = sub.add_parser("build", help="build an engine directory from a drafter checkpoint (scripts/build_engine.sh)")
    p.add_argument("--target", default="smollm2-135m", help="target profile name or YAML path")
    p.add_argument("--target-source", help="override the profile's weights: HF directory or .gguf file")
    p.add_argument("--drafter", required=True, help="drafter checkpoint directory (model.safetensors + drafter.json)")
    p.add_argument("--output", required=True, help="engine directory to write")
    p.add_argument("--dtype", default="float32", help="float32 | float16 | bfloat16 (HF weights, TensorRT precision)")
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--max-context", type=int, default=2048)
    p.add_argument("--block-size", type=int, help="must equal the drafter's block size (checked)")
    p.add_argument("--what", default=None,
                   help="comma list of onnx,hf,trtllm,trt (default onnx,hf,trtllm; what the drafter cannot be "
                        "exported to is skipped with the reason, or refused when asked for)")
    p.add_argument("--trtllm-version", default=None,
                   help="TensorRT-LLM whose option spelling trtllm/ uses: main (upstream source, default) or 1.4")
    p.add_argument("--sps", help="SPS table JSON to copy in (dspark profile)")
    p.add_argument("--sts", help="STS calibration JSON to copy in (dspark calibrate)")
    p.add_argument("--plugin-lib", help="libdspark_trt_plugin.so for --what ...,trt")
    p.add_argument("--force", action="store_true", help="overwrite an existing engine directory")
    p.add_argument("--proposers", default="neural",
                   help="the engine's default drafting methods: neural | suffix | neural+suffix (hybrid)")
    p.add_argument("--suffix-max-drafts", type=int, help="the suffix proposer's K (default 3)")
    p.add_argument("--suffix-scope", help="shared | request: what the suffix index shares (docs/serving.md)")
    p.add_argument("--suffix-max-depth", type=int, help="longest context the suffix index matches")
    p.add_argument("--suffix-shared-max-outputs", type=int, help="outputs the shared suffix ring keeps")
    p.add_argument("--suffix-shared-max-tokens", type=int, help="tokens the shared suffix ring keeps")
    p.set_defaults(fn=cmd_build)
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
