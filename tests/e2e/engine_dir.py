"""An engine directory for serving tests: the embedded target + an untrained DSpark drafter.

The speculative engine needs a drafter checkpoint; a trained one (``scripts/quickstart.sh``
then ``scripts/build_engine.sh``) can be passed with ``DSPARK_E2E_ENGINE_DIR``. Without
one, this writes the quickstart recipe's drafter with random weights: it accepts little,
but speculative decoding stays lossless, which is what the serving tests check (greedy
spec output == target-only output, streamed == non-streamed).
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path


def default_dir() -> Path:
    root = Path(os.environ.get("DSPARK_E2E_CACHE", Path.home() / ".cache" / "dspark-e2e"))
    return root / "engine-smollm2-untrained-dspark"


def build_untrained_engine_dir(out: Path | None = None, seed: int = 0) -> Path:
    out = Path(out or default_dir())
    if (out / "engine.json").is_file():
        return out
    import torch

    from dspark.training.checkpoint import save_checkpoint
    from dspark.training.config import load_run_config
    from dspark.training.models import build_drafter, drafter_config_for
    from dspark.training.target import load_target

    run = load_run_config("quickstart")
    target = load_target(run.target)
    torch.manual_seed(seed)
    cfg = drafter_config_for(run, target)
    drafter = build_drafter(cfg, target)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    save_checkpoint(tmp / "drafter", drafter, cfg, target.identity(), step=0)
    (tmp / "engine.json").write_text(json.dumps(
        {"target_profile": dataclasses.asdict(run.target), "drafter_dir": "drafter",
         "note": "untrained drafter for serving tests"}, indent=2))
    try:
        tmp.rename(out)
    except OSError:  # built concurrently by another process
        shutil.rmtree(tmp, ignore_errors=True)
    return out


if __name__ == "__main__":
    print(build_untrained_engine_dir())
