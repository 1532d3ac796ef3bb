"""scripts/gpu_train.sh, the one-call GPU training job, run on the CPU with a tiny budget: the same
code path (bench-train with online features and equal time per drafter, evaluation, pack into
$OUT within the device runner's limits), then scripts/gpu_train.py unpack at home.

The target is a small random Llama with SmolLM2's tokenizer and vocabulary (the tokenizer from the
embedded target's dequantised directory), so the job takes seconds; the device call uses the real one.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_train  # noqa: E402

LAYERS = "[0,1,2]"


@pytest.fixture(scope="module")
def tiny_target_dir(tmp_path_factory) -> Path:
    from transformers import AutoConfig, LlamaForCausalLM

    from dspark.training.target import resolve_hf_dir

    real = resolve_hf_dir("embedded:smollm2")
    out = tmp_path_factory.mktemp("tiny_smollm2")
    cfg = AutoConfig.from_pretrained(real)
    cfg.update({"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
                "num_key_value_heads": 2, "head_dim": 16})
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(out)
    for f in real.iterdir():
        if f.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(f, out / f.name)
    return out


def _records(path: Path, target_dir: Path, n: int = 12) -> Path:
    from transformers import AutoTokenizer

    from dspark.training.data import load_eval_prompts

    tok = AutoTokenizer.from_pretrained(target_dir)
    prompts = load_eval_prompts("math", n) + load_eval_prompts("chat", n)
    with open(path, "w") as f:
        for i, p in enumerate(prompts[:n]):
            ids = tok.encode(p)
            f.write(json.dumps({"prompt_ids": ids[:24], "answer_ids": ids[24:64] or ids[:16]}) + "\n")
    return path


def _run_job(tmp_path: Path, target_dir: Path) -> tuple[Path, Path]:
    out, runs = tmp_path / "out", tmp_path / "device_runs"
    records = _records(tmp_path / "records.jsonl", target_dir)
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    cmd = ["bash", str(ROOT / "scripts" / "gpu_train.sh"), "--device", "cpu", "--dtype", "float32", "--budget", "1",
           "--records", str(records), "--runs", str(runs), "--eval-samples", "1", "--eval-tokens", "4",
           "--eval-temperatures", "0.0", "--batch-size", "2", "--blocks-per-seq", "2", "--part-mib", "2",
           f"target.source={target_dir}", f"target.layer_ids={LAYERS}", "train.warmup_steps=1", "eval.tasks=[math]"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return out, runs


def test_the_gpu_training_job_runs_on_the_cpu_and_its_checkpoints_come_home(tmp_path, tiny_target_dir):
    from dspark.training.checkpoint import load_checkpoint
    from dspark.training.config import load_run_config
    from dspark.training.target import load_target

    out, device_runs = _run_job(tmp_path, tiny_target_dir)
    files = sorted(p.name for p in out.iterdir())
    # what the device runner brings back: at most 8 plain files of 16 MiB, 64 MiB in all
    assert len(files) <= gpu_train.MAX_FILES, files
    assert all((out / f).stat().st_size <= gpu_train.MAX_FILE_BYTES for f in files)
    assert sum((out / f).stat().st_size for f in files) <= gpu_train.MAX_TOTAL_BYTES
    for f in ("train_compare_h200.json", "train_compare_h200.md", "train_compare_h200.png", "gpu_train.json",
              "gpu_train.log"):
        assert f in files, files
    report = json.loads((out / "train_compare_h200.json").read_text())
    assert {r["drafter"] for r in report["results"]} == set(gpu_train.ALGOS)
    assert report["budget"]["budget_seconds"] == 1.0 and set(report["budget"]["steps"]) == set(gpu_train.ALGOS)
    info = json.loads((out / "gpu_train.json").read_text())
    assert "data.features=online" in info["bench_train"] and "error" not in info
    assert len(info["pack"]["parts"]) > 1  # 2 MiB parts: the split and the reassembly are exercised

    home = tmp_path / "home"
    got = gpu_train.unpack(out, home / "runs", home / "docs")
    assert sorted(Path(c).parts[-3] for c in got["checkpoints"]) == sorted(f"h200-{a}" for a in gpu_train.ALGOS)
    assert (home / "docs" / "train_compare_h200.md").is_file()
    cfg = load_run_config("quickstart", [f"target.source={tiny_target_dir}", f"target.layer_ids={LAYERS}"])
    target = load_target(cfg.target)
    for c in got["checkpoints"]:
        mine, _, meta = load_checkpoint(Path(c), target)
        theirs, _, _ = load_checkpoint(device_runs / Path(c).relative_to(home / "runs"), target)
        assert meta["step"] == report["budget"]["steps"][meta["drafter"]["algo"]]
        for (k, a), b in zip(mine.state_dict().items(), theirs.state_dict().values()):
            expect = b.to(torch.bfloat16).to(b.dtype) if got["rounded_to_bf16"] and b.is_floating_point() else b
            assert torch.equal(a, expect), k
    assert (home / "runs" / "h200" / "data" / "records.jsonl").is_file()


def test_one_drafter_for_a_fixed_step_count_trains_on_the_gzipped_records_prepare_carries(tmp_path, tiny_target_dir):
    import gzip

    plain = _records(tmp_path / "records.jsonl", tiny_target_dir)
    packed = tmp_path / "records.jsonl.gz"
    with open(plain, "rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    out, runs = tmp_path / "out", tmp_path / "device_runs"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable}
    cmd = ["bash", str(ROOT / "scripts" / "gpu_train.sh"), "--device", "cpu", "--dtype", "float32", "--steps", "3",
           "--algos", "dspark", "--name", "again", "--records", str(packed), "--runs", str(runs),
           "--eval-samples", "1", "--eval-tokens", "4", "--eval-temperatures", "0.0", "--batch-size", "2",
           "--blocks-per-seq", "2", f"target.source={tiny_target_dir}", f"target.layer_ids={LAYERS}",
           "train.warmup_steps=1", "eval.tasks=[math]"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads((out / "train_compare_h200.json").read_text())
    assert report["budget"]["steps"] == 3 and report["budget"]["budget_seconds"] is None
    assert {r["drafter"] for r in report["results"]} == {"dspark"}
    assert (runs / "again" / "data" / "records.jsonl").read_bytes() == plain.read_bytes()
    assert "Training: 3 steps each" in (out / "train_compare_h200.md").read_text()


def test_pack_rounds_to_bf16_when_fp32_does_not_fit_and_unpack_refuses_an_altered_part(tmp_path):
    from safetensors.torch import load_file, save_file

    runs = tmp_path / "runs"
    ckpt = runs / "job-dspark" / "checkpoints" / "last"
    ckpt.mkdir(parents=True)
    w = torch.randn(256, 256)
    save_file({"w": w, "ids": torch.arange(4)}, str(ckpt / "model.safetensors"))
    (ckpt / "drafter.json").write_text("{}")
    out = tmp_path / "out"
    out.mkdir()
    fp32 = gpu_train.pack(runs, "job", out, max_parts=3, budget=10 * gpu_train.MIB, part_bytes=200_000)
    assert not fp32["rounded_to_bf16"] and len(fp32["parts"]) == 2
    small = gpu_train.pack(runs, "job", out, max_parts=1, budget=10 * gpu_train.MIB, part_bytes=200_000)
    assert small["rounded_to_bf16"] and len(small["parts"]) == 1  # 256 KiB of fp32 -> 128 KiB of bf16
    assert sorted(p.name for p in out.glob("checkpoints.tar.part*")) == ["checkpoints.tar.part00"]
    (out / "gpu_train.json").write_text(json.dumps({"pack": small}))
    got = gpu_train.unpack(out, tmp_path / "home", None)
    back = load_file(str(Path(got["checkpoints"][0]) / "model.safetensors"))
    assert back["w"].dtype == torch.float32 and torch.equal(back["w"], w.to(torch.bfloat16).float())
    assert torch.equal(back["ids"], torch.arange(4))
    none = gpu_train.pack(runs, "job", out, max_parts=0, budget=10 * gpu_train.MIB)
    assert none["parts"] == [] and "do not fit" in none["note"]
    part = out / "checkpoints.tar.part00"
    data = bytearray(part.read_bytes())
    data[1000] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="does not match its sha256"):
        gpu_train.unpack(out, tmp_path / "home2", None)
