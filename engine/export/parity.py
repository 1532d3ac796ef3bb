"""ONNX Runtime vs PyTorch parity of the exported drafter step, on a real target.

    python -m dspark.engine.export.parity [--checkpoint DIR | --engine-dir DIR] \
        [--cases 1x64,4x128,8x256,16x512] [--output-dir docs/benchmarks]

With ``--engine-dir`` (``scripts/build_engine.sh`` output) the check runs the engine's own
``onnx/dspark_draft.onnx`` against its ``drafter/`` checkpoint, with the SPS table and STS
temperatures the build embedded. Without either option the quickstart recipe's drafter is built with seeded random
weights (untrained; its Markov and confidence heads are then randomised too, since they
start at zero and would make the check trivial). Context features come from the target
itself on eval prompts (``data/eval``), or seeded random token ids when none are found.
Both runtimes use one thread. Writes ``onnx_parity.json`` and ``onnx_parity.md``.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

from .onnx_export import DraftStep, export_onnx, flat_sps_table, ort_session, parity_case


def _contexts(target, n: int, T: int, seed: int) -> torch.Tensor:
    """[n, T+1] token ids: chat prompts from the eval sets, repeated/cut to T+1, or random."""
    ids: list[int] = []
    try:
        from dspark.training.data import load_eval_prompts
        for task in ("math", "code", "chat"):
            for p in load_eval_prompts(task, 8, None):
                ids += target.chat_prompt_ids(p)
    except Exception:  # no data folder: random ids are still a valid parity input
        ids = []
    g = torch.Generator().manual_seed(seed)
    if len(ids) < T + 1:
        return torch.randint(0, target.vocab_size, (n, T + 1), generator=g)
    base = torch.tensor(ids)
    starts = torch.randint(0, max(1, len(ids) - T - 1), (n,), generator=g)
    return torch.stack([base[s:s + T + 1] if s + T + 1 <= len(ids) else base[:T + 1] for s in starts.tolist()])


def _engine_dir_inputs(engine_dir: Path, target):
    """-> (drafter, onnx path, dense SPS table, STS temperatures) exactly as the build used them."""
    from dspark.engine.sps import load_sps_table
    from dspark.engine.sts import StsCalibration
    from dspark.training.checkpoint import load_checkpoint

    from .manifest import validate_engine_dir

    validate_engine_dir(engine_dir, target, files="all")
    meta = json.loads((engine_dir / "engine.json").read_text())
    drafter, _, _ = load_checkpoint(engine_dir / meta.get("drafter_dir", "drafter"), target)
    n_tokens = meta["shapes"]["schedule_max_tokens"]
    table = (load_sps_table(engine_dir / meta["sps"]).as_tensor(max_tokens=n_tokens).tolist() if meta.get("sps")
             else flat_sps_table(n_tokens))
    sts = StsCalibration.load(engine_dir / meta["sts"]).temperatures if meta.get("sts") else None
    return drafter, engine_dir / "onnx" / "dspark_draft.onnx", table, sts


def run(checkpoint: str | None, cases: list[tuple[int, int]], out_dir: Path, seed: int = 0, repeats: int = 5,
        engine_dir: str | None = None) -> dict:
    from dspark.training.checkpoint import load_checkpoint
    from dspark.training.config import load_run_config
    from dspark.training.models import build_drafter, drafter_config_for
    from dspark.training.target import load_target

    torch.set_num_threads(1)
    run_cfg = load_run_config("quickstart")
    target = load_target(run_cfg.target)
    onnx_path, table, sts = None, None, None
    if engine_dir:
        drafter, onnx_path, table, sts = _engine_dir_inputs(Path(engine_dir), target)
        which = f"engine directory {engine_dir} (its drafter, ONNX file, SPS table and STS temperatures)"
    elif checkpoint:
        drafter, _, meta = load_checkpoint(Path(checkpoint), target)
        which = f"trained checkpoint {checkpoint} (step {meta.get('step')})"
    else:
        torch.manual_seed(seed)
        drafter = build_drafter(drafter_config_for(run_cfg, target), target).eval()
        with torch.no_grad():
            drafter.markov.w2.weight.normal_(0, 0.02)
            drafter.confidence.proj.weight.normal_(0, 0.05)
        which = "untrained quickstart drafter (seeded random weights, heads randomised)"
    K = drafter.cfg.block_size
    max_b = max(b for b, _ in cases)
    if table is None:
        table = [0.0] + [1000.0 / (20.0 + 0.05 * b) for b in range(1, max_b * (K + 1) + 1)]  # a falling SPS curve
    if len(table) < max_b * (K + 1) + 1:
        raise SystemExit(f"cases need up to {max_b * (K + 1)} batch tokens; the engine was built for {len(table) - 1}")
    with tempfile.TemporaryDirectory() as tmp:
        path = onnx_path or Path(tmp) / "dspark_draft.onnx"
        if onnx_path is None:
            export_onnx(drafter, path, sps_table=table)
        session = ort_session(path, threads=1)
        step = DraftStep(drafter, sts).eval()
        rows = []
        for R, T in cases:
            toks = _contexts(target, R, T, seed + R * 1000 + T)
            feats = target.features(toks[:, :T])
            lens = torch.randint(max(1, T // 2), T + 1, (R,), generator=torch.Generator().manual_seed(seed + T))
            anchor = toks.gather(1, lens.unsqueeze(-1)).squeeze(-1)
            case = parity_case(step, session, feats.aux.float(), lens, anchor, lens, table, repeats=repeats)
            rows.append(case.row())
            print(json.dumps(rows[-1]))
    result = {"command": "python -m dspark.engine.export.parity " + " ".join(sys.argv[1:]),
              "target": run_cfg.target.name, "drafter": which, "threads": 1,
              "notes": "max_abs_logit_diff over the Markov-corrected draft logits [R,K,V]; greedy_draft_match = "
                       "fraction of identical draft tokens; times are medians of the drafter step "
                       "(torch eager vs ONNX Runtime CPU incl. the DSparkSchedule custom op)",
              "cases": rows}
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "onnx_parity.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = ["# ONNX Runtime vs PyTorch: DSpark drafter step", "",
             f"Target: {result['target']}; drafter: {which}; 1 thread each; block size {K}.", "",
             f"Reproduce: `{result['command']}`", "",
             "| batch | context | max abs logit diff | greedy draft match | conf max abs diff | verify_lens match | ORT ms | torch ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['max_abs_logit_diff']:.2e} | {r['greedy_draft_match']:.4f} | "
                     f"{r['conf_max_abs_diff']:.1e} | {r['verify_lens_match']:.3f} | {r['ort_ms']:.2f} | {r['torch_ms']:.2f} |")
    (out_dir / "onnx_parity.md").write_text("\n".join(lines) + "\n")
    return result


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--checkpoint", help="a trained drafter checkpoint (exported to a temporary ONNX file)")
    src.add_argument("--engine-dir", help="an engine directory from scripts/build_engine.sh (its own ONNX file)")
    ap.add_argument("--cases", default="1x64,4x128,8x256,16x512", help="comma list of BATCHxCONTEXT")
    ap.add_argument("--output-dir", default="docs/benchmarks")
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args(argv)
    cases = [tuple(int(x) for x in c.split("x")) for c in a.cases.split(",")]
    run(a.checkpoint, cases, Path(a.output_dir), repeats=a.repeats, engine_dir=a.engine_dir)


if __name__ == "__main__":
    main()


def move_off_initial_values(drafter, head_std: float = 0.5) -> None:
    """Give a freshly built drafter non-trivial weights everywhere (in place), for parity checks:
    norms start at 1 and the Markov / confidence heads at 0, which would hide a mismatch there."""
    import torch

    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
        if drafter.markov is not None:
            drafter.markov.w2.weight.normal_(0, head_std)
        if drafter.confidence is not None:
            drafter.confidence.proj.weight.normal_(0, head_std)
