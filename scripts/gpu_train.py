"""DSpark, DFlash and Eagle3 trained at GPU scale in one prepared device call, and brought home.

The device call (``scripts/gpu_train.sh``) runs ``dspark bench-train`` (engine/train_compare.py:
the same records for every drafter, online target features, equal training time each from a
timed probe, then the batch-1 evaluation) and packs what comes back into ``$OUT``, inside the
device runner's limits (at most 8 files of 16 MiB, 64 MiB in all):

    train_compare_h200.json / .md / .png   the comparison (``dspark bench-train``'s report)
    gpu_train.json                         this call: settings, timings, the parts and their sha256
    gpu_train.log                          the whole log
    checkpoints.tar.partNN                 the three drafters (model.safetensors + drafter.json each),
                                           the run's records and budget plans, one tar split in parts;
                                           fp32 when that fits, else every float tensor rounded to bf16
                                           (``gpu_train.json`` says which; unpack widens them back to fp32)

Three steps, two machines:

    python scripts/gpu_train.py prepare --records runs/<name>/data/records.jsonl    # here
    # the device: two `run` calls back to back (docs/gpu.md "Training the drafters on the H200")
    python scripts/gpu_train.py unpack /work/.device/<...>/files                    # here again

``unpack`` checks every part's sha256, puts the checkpoints under ``runs/<name>-<algo>/checkpoints/last``
(the layout ``dspark eval / calibrate / profile / bench`` and ``scripts/build_engine.sh`` read) and the
comparison under ``docs/benchmarks``. The same ``run`` step runs on the CPU with a tiny budget
(``--device cpu``; tests/unit/test_gpu_train.py).
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ALGOS = ("dspark", "dflash", "eagle3")
RESULT_STEM = "train_compare_h200"
MIB = 1 << 20
# the device runner's limits on what comes back from $OUT (/work/.library/device/README.md)
MAX_FILES, MAX_FILE_BYTES, MAX_TOTAL_BYTES = 8, 16 * MIB, 64 * MIB
CARRY_LIMIT = 64 * MIB  # working tree + carried paths, per call
CARRY_DIR = ".gpu_train"  # git-ignored (.git/info/exclude); call 1 carries a/, call 2 carries b/
PART_A = "target.gguf.part_a"  # call 1 copies it to /tmp (carried folders are re-laid at every call)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(MIB), b""):
            h.update(chunk)
    return h.hexdigest()


# -- here, before the device call ---------------------------------------------------------------------

def _tree_bytes() -> int:
    """Bytes of what every device call sends besides the carried paths (tracked + untracked, not ignored)."""
    names = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.split(b"\0")
    return sum((ROOT / n.decode()).stat().st_size for n in names if n and (ROOT / n.decode()).is_file())


def _exclude_carry_dir() -> None:
    exclude = ROOT / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    lines = exclude.read_text().splitlines() if exclude.is_file() else []
    if f"/{CARRY_DIR}/" not in lines:
        exclude.write_text("\n".join(lines + [f"/{CARRY_DIR}/"]) + "\n")


def prepare(records: Path | None, gguf: Path | None, gguf_wheel: Path | None, out: Path) -> dict:
    """Lay out ``.gpu_train/{a,b}`` for the two device calls: the target's GGUF split so that each
    call fits the carry limit beside the working tree, the ``gguf`` wheel (not installed there) and
    the training records."""
    from dspark.training.target import resolve_source

    if gguf is None:
        directory, name = resolve_source("embedded:smollm2")
        gguf = directory / name
    if records is not None and not records.is_file():
        raise SystemExit(f"prepare: {records} is not a file (make it with `dspark prepare-data ...`)")
    if gguf_wheel is None:
        from importlib.metadata import version

        wheel_dir = out / "wheel"  # the version transformers reads GGUF files with here
        wheel_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q", "-d",
                        str(wheel_dir), f"gguf=={version('gguf')}"], check=True)
        gguf_wheel = next(wheel_dir.glob("gguf-*.whl"))
    shutil.rmtree(out / "a", ignore_errors=True)
    shutil.rmtree(out / "b", ignore_errors=True)
    (out / "a").mkdir(parents=True)
    (out / "b").mkdir(parents=True)
    _exclude_carry_dir()
    tree = _tree_bytes()
    size = gguf.stat().st_size
    margin = 2 * MIB
    first = CARRY_LIMIT - tree - margin
    rest = size - first
    out.mkdir(parents=True, exist_ok=True)
    packed_records = out / "records.jsonl.gz"  # JSON of token ids: gzip takes it to about a third
    packed_records.unlink(missing_ok=True)
    if records:
        with open(records, "rb") as src, gzip.open(packed_records, "wb") as dst:
            shutil.copyfileobj(src, dst)
    extra = gguf_wheel.stat().st_size + (packed_records.stat().st_size if records else 0)
    if first <= 0 or tree + rest + extra + margin > CARRY_LIMIT:
        raise SystemExit(f"prepare: the target ({size / MIB:.1f} MiB) does not fit two calls beside a "
                         f"{tree / MIB:.1f} MiB working tree and {extra / MIB:.1f} MiB of records and wheel")
    with open(gguf, "rb") as src:
        (out / "a" / PART_A).write_bytes(src.read(first))
        (out / "b" / "target.gguf.part_b").write_bytes(src.read())
    shutil.copy(gguf_wheel, out / "b" / gguf_wheel.name)
    if records:
        packed_records.replace(out / "b" / packed_records.name)
    manifest = {"target_gguf": gguf.name, "target_sha256": sha256(gguf), "target_bytes": size,
                "part_a_bytes": first, "gguf_wheel": gguf_wheel.name,
                "records": None if records is None else {"source": str(records),
                                                        "lines": sum(1 for _ in open(records))},
                "call_bytes": {"a": tree + first, "b": tree + rest + extra}}
    (out / "b" / "carry.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


# -- on the device (or the CPU): train, evaluate, pack -------------------------------------------------

def bench_train_argv(args, name: str, runs: Path, work: Path, max_prompts: int | None) -> list[str]:
    """The ``dspark bench-train`` call of this run: quickstart recipe at GPU-scale batch sizes,
    online features, equal time per drafter; ``args.override`` last, so any of it can be changed."""
    budget = f"train.steps={args.steps}" if args.steps else f"train.budget_seconds={args.budget}"
    o = [f"name={name}", f"output_root={runs}", "data.features=online", f"train.device={args.device}",
         f"train.dtype={args.dtype}", budget, f"train.batch_size={args.batch_size}",
         f"train.blocks_per_seq={args.blocks_per_seq}", "train.eval_every=0",
         f"eval.samples_per_task={args.eval_samples}", f"eval.max_new_tokens={args.eval_tokens}",
         f"eval.temperatures=[{args.eval_temperatures}]"]
    if args.target_source:
        o.append(f"target.source={args.target_source}")
    if max_prompts is not None:
        o.append(f"data.max_prompts={max_prompts}")
    return ["bench-train", "-c", "quickstart", *o, *args.override, "--output-dir", str(work),
            "--algos", args.algos]


def run(args) -> int:
    """Train and evaluate the three drafters, then pack everything into ``args.out``; the pack
    runs even when training fails, so whatever finished comes back."""
    out, runs = Path(args.out), Path(args.runs)
    out.mkdir(parents=True, exist_ok=True)
    work = runs / f"{args.name}-results"
    max_prompts = None
    if args.records:
        data = runs / args.name / "data"
        data.mkdir(parents=True, exist_ok=True)
        with (gzip.open if args.records.endswith(".gz") else open)(args.records, "rb") as src, \
                open(data / "records.jsonl", "wb") as dst:
            shutil.copyfileobj(src, dst)
        max_prompts = sum(1 for line in open(data / "records.jsonl") if line.strip())  # all of them, no generation
    argv = bench_train_argv(args, args.name, runs, work, max_prompts)
    info = {"command": " ".join([Path(sys.argv[0]).name] + sys.argv[1:]), "bench_train": "dspark " + " ".join(argv),
            "name": args.name, "overrides": [a for a in argv if "=" in a and not a.startswith("-")],
            "device": _device_name(args.device), "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    print("gpu_train: dspark " + " ".join(argv), flush=True)
    t0, status = time.time(), 0
    if args.wall_limit:  # stop bench-train in time for the pack (what finished comes back)
        def _stop(_sig, _frame):
            raise TimeoutError(f"--wall-limit {args.wall_limit:g} s reached")
        signal.signal(signal.SIGALRM, _stop)
        signal.setitimer(signal.ITIMER_REAL, args.wall_limit)
    try:
        from dspark.cli import main as dspark_main
        dspark_main(argv)
    except BaseException as exc:  # noqa: BLE001  (a crash or a timeout signal: pack what finished)
        status = 1
        info["error"] = f"{type(exc).__name__}: {exc}"[:500]
        print(f"gpu_train: bench-train failed: {info['error']}", flush=True)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    info["bench_train_seconds"] = round(time.time() - t0, 1)
    for ext in ("json", "md", "png"):
        src = work / f"train_compare.{ext}"
        if src.is_file():
            shutil.copy(src, out / f"{RESULT_STEM}.{ext}")
    results = [out / f"{RESULT_STEM}.{ext}" for ext in ("json", "md", "png") if (out / f"{RESULT_STEM}.{ext}").is_file()]
    reserved = len(results) + 2  # + gpu_train.json + gpu_train.log
    info["pack"] = pack(runs, args.name, out, max_parts=MAX_FILES - reserved,
                        budget=MAX_TOTAL_BYTES - sum(p.stat().st_size for p in results) - 2 * MIB,
                        part_bytes=int(args.part_mib * MIB), force_bf16=args.bf16)
    (out / "gpu_train.json").write_text(json.dumps(info, indent=2) + "\n")
    md = out / f"{RESULT_STEM}.md"
    if md.is_file():  # where it ran and what came back, beside the table
        rounded = info["pack"].get("rounded_to_bf16")
        plan = f"{args.steps} steps each" if args.steps else f"{args.budget:g} s each, planned"
        md.write_text(md.read_text() + f"\nDevice: {info['device']}. Training: {plan}. The rows above were "
                      f"measured there with the fp32 weights; the "
                      f"checkpoints came back {'rounded to bf16' if rounded else 'in fp32'} "
                      f"(gpu_train.json, scripts/gpu_train.py unpack).\n")
    print(json.dumps(info["pack"], indent=2), flush=True)
    return status if info["pack"]["parts"] else 1


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()} (torch {torch.__version__}, CUDA {torch.version.cuda})"
    return f"cpu (torch {torch.__version__})"


def _bf16_copy(src: Path, dst: Path) -> None:
    """model.safetensors with every fp32 tensor rounded to bf16 (ints, e.g. draft_ids, kept)."""
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(str(src))
    save_file({k: v.to(torch.bfloat16) if v.dtype == torch.float32 else v for k, v in state.items()}, str(dst),
              metadata={"dspark_gpu_train": "rounded_from_float32"})


def _members(runs: Path, name: str) -> list[tuple[Path, str]]:
    """(file, name in the tar) for each drafter's checkpoint, its budget plan and the run's records."""
    found = []
    for algo in ALGOS:
        run_dir = runs / f"{name}-{algo}"
        for f in ("checkpoints/last/model.safetensors", "checkpoints/last/drafter.json", "budget.json"):
            if (run_dir / f).is_file():
                found.append((run_dir / f, f"{name}-{algo}/{f}"))
    for f in ("data/records.jsonl", "data/summary.json"):
        if (runs / name / f).is_file():
            found.append((runs / name / f, f"{name}/{f}"))
    return found


def pack(runs: Path, name: str, out: Path, max_parts: int, budget: int, part_bytes: int = 15 * MIB,
         force_bf16: bool = False) -> dict:
    """One tar of the three runs, split into ``part_bytes`` parts: fp32 if at most ``max_parts``
    parts and ``budget`` bytes hold it, else with the weights rounded to bf16, else nothing."""
    part_bytes = min(part_bytes, MAX_FILE_BYTES)
    members = _members(runs, name)
    if not any(n.endswith("model.safetensors") for _, n in members):
        return {"parts": [], "note": "no checkpoint was written"}
    staging = runs / f"{name}-pack"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    tar_path = staging / "checkpoints.tar"

    def write_tar(rounded: bool) -> int:
        with tarfile.open(tar_path, "w") as tar:
            for path, arc in members:
                if rounded and arc.endswith("model.safetensors"):
                    tmp = staging / "bf16.safetensors"
                    _bf16_copy(path, tmp)
                    tar.add(tmp, arcname=arc)
                else:
                    tar.add(path, arcname=arc)
        return tar_path.stat().st_size

    def fits(n: int) -> bool:
        return -(-n // part_bytes) <= max_parts and n <= budget

    rounded = force_bf16
    size = write_tar(rounded)
    if not fits(size) and not rounded:
        rounded = True
        size = write_tar(True)
    if not fits(size):
        return {"parts": [], "note": f"{size / MIB:.1f} MiB of checkpoints do not fit {max_parts} parts / "
                                     f"{budget / MIB:.1f} MiB even rounded to bf16; nothing packed"}
    for old in out.glob("checkpoints.tar.part*"):
        old.unlink()
    parts = []
    with open(tar_path, "rb") as f:
        for i, chunk in enumerate(iter(lambda: f.read(part_bytes), b"")):
            p = out / f"checkpoints.tar.part{i:02d}"
            p.write_bytes(chunk)
            parts.append({"name": p.name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    info = {"parts": parts, "tar_bytes": size, "tar_sha256": sha256(tar_path), "rounded_to_bf16": rounded,
            "members": [arc for _, arc in members],
            "reassemble": "cat checkpoints.tar.part* > checkpoints.tar && tar -xf checkpoints.tar -C runs/ "
                          "(or: python scripts/gpu_train.py unpack <this folder>, which checks the sha256 and "
                          "widens bf16 weights back to fp32)"}
    shutil.rmtree(staging)
    return info


# -- here, after the device call -------------------------------------------------------------------------

def unpack(files: Path, runs: Path, docs: Path | None) -> dict:
    """Check and reassemble what a device call brought back: checkpoints under ``runs``, the
    comparison under ``docs`` (skipped when None). Refuses a missing or altered part."""
    manifest_path = files / "gpu_train.json"
    if not manifest_path.is_file():
        raise SystemExit(f"unpack: {manifest_path} is missing (not a gpu_train result folder?)")
    info = json.loads(manifest_path.read_text())
    packed = info.get("pack", {})
    if not packed.get("parts"):
        raise SystemExit(f"unpack: the device call packed no checkpoints ({packed.get('note', 'no parts listed')})")
    runs.mkdir(parents=True, exist_ok=True)
    tar_path = runs / "checkpoints.tar"
    h = hashlib.sha256()
    with open(tar_path, "wb") as out:
        for part in packed["parts"]:
            p = files / part["name"]
            if not p.is_file():
                raise SystemExit(f"unpack: part {p} is missing")
            data = p.read_bytes()
            if hashlib.sha256(data).hexdigest() != part["sha256"]:
                raise SystemExit(f"unpack: part {p} does not match its sha256 in gpu_train.json")
            out.write(data)
            h.update(data)
    if h.hexdigest() != packed["tar_sha256"]:
        raise SystemExit("unpack: the reassembled tar does not match its sha256 in gpu_train.json")
    with tarfile.open(tar_path) as tar:
        for m in tar.getmembers():
            if m.name.startswith("/") or ".." in Path(m.name).parts or not m.isfile():
                raise SystemExit(f"unpack: refusing tar member {m.name!r}")
        tar.extractall(runs)  # members checked above: plain files under runs only
    tar_path.unlink()
    checkpoints = [str(runs / m.rsplit("/", 1)[0]) for m in packed["members"] if m.endswith("/model.safetensors")]
    if packed.get("rounded_to_bf16"):
        for c in checkpoints:
            _widen_to_fp32(Path(c) / "model.safetensors")
    for c in checkpoints:  # each drafter's run reads the shared records as <run>/data (as bench-train links it)
        run_dir, shared = Path(c).parents[1], runs / info.get("name", "") / "data"
        if info.get("name") and shared.is_dir() and not (run_dir / "data").exists():
            (run_dir / "data").symlink_to(shared.resolve())
    copied = []
    if docs is not None:
        docs.mkdir(parents=True, exist_ok=True)
        for ext in ("json", "md", "png"):
            src = files / f"{RESULT_STEM}.{ext}"
            if src.is_file():
                shutil.copy(src, docs / src.name)
                copied.append(str(docs / src.name))
    return {"checkpoints": checkpoints, "docs": copied, "rounded_to_bf16": bool(packed.get("rounded_to_bf16")),
            "next": next_commands(info, runs) if info.get("name") else []}


def next_commands(info: dict, runs: Path) -> list[str]:
    """The CPU follow-up with the GPU-trained DSpark: its STS and SPS, the decode benchmark, an engine
    directory for serving; the run's data settings repeated so the held-out split is training's."""
    data = [o for o in info.get("overrides", []) if o.startswith(("data.", "target."))
            and not o.startswith(("data.features=", "target.source="))]
    run = f"-c quickstart name={info['name']}-dspark output_root={runs} " + " ".join(data)
    ckpt = runs / f"{info['name']}-dspark" / "checkpoints" / "last"
    rd = runs / f"{info['name']}-dspark"
    return [f"dspark eval {run}",
            f"dspark calibrate {run}",
            f"dspark profile {run} --checkpoint {ckpt}",
            f"dspark bench {run} --checkpoint {ckpt} --sps {rd}/sps.json --sts {rd}/sts.json --batches 1,4,16,64",
            f"scripts/build_engine.sh --drafter {ckpt} --sps {rd}/sps.json --sts {rd}/sts.json --output engines/{info['name']}"]


def _widen_to_fp32(path: Path) -> None:
    """bf16 tensors of a returned checkpoint back to fp32, the dtype the kit writes checkpoints in."""
    import torch
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    save_file({k: v.float() if v.dtype == torch.bfloat16 else v for k, v in state.items()}, str(path),
              metadata={"dspark_gpu_train": "bf16_rounded_then_widened"})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare", help="here: lay out .gpu_train/{a,b} for the two device calls")
    p.add_argument("--records", type=Path, help="records.jsonl from `dspark prepare-data` (else generated there)")
    p.add_argument("--gguf", type=Path, help="target GGUF file (default: the embedded SmolLM2)")
    p.add_argument("--gguf-wheel", type=Path, help="the gguf package's wheel (default: pip download of the installed version)")
    p.add_argument("--out", type=Path, default=ROOT / CARRY_DIR)
    p = sub.add_parser("run", help="train, evaluate and pack (the device call; --device cpu for a dry run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", help="training autocast dtype (train.dtype)")
    p.add_argument("--budget", type=float, default=80.0, help="training seconds per drafter (train.budget_seconds)")
    p.add_argument("--steps", type=int, default=0,
                   help="train every drafter for this many steps instead of --budget seconds (0: use --budget)")
    p.add_argument("--algos", default=",".join(ALGOS), help="the drafters to train, comma-separated")
    p.add_argument("--name", default="h200")
    p.add_argument("--runs", default=str(ROOT / "runs"), help="output_root of the three runs")
    p.add_argument("--out", default=os.environ.get("OUT") or str(ROOT / "runs" / "gpu_train_out"),
                   help="folder that comes back (default $OUT)")
    p.add_argument("--records", help="records.jsonl(.gz) to train on (all of its lines); default: generated")
    p.add_argument("--target-source", help="target.source (the GGUF assembled on the device)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--blocks-per-seq", type=int, default=16)
    p.add_argument("--eval-samples", type=int, default=10, help="eval.samples_per_task")
    p.add_argument("--eval-tokens", type=int, default=64, help="eval.max_new_tokens")
    p.add_argument("--eval-temperatures", default="0.0,1.0")
    p.add_argument("--wall-limit", type=float, default=0.0,
                   help="seconds after which bench-train is stopped and what finished is packed (0: none)")
    p.add_argument("--part-mib", type=float, default=15.5, help="size of each returned checkpoint part")
    p.add_argument("--bf16", action="store_true", help="round the returned weights to bf16 even when fp32 fits")
    p.add_argument("override", nargs="*", help="more dotted overrides for dspark bench-train (last wins)")
    p = sub.add_parser("unpack", help="here: check and reassemble a device call's files into runs/ and docs/benchmarks")
    p.add_argument("files", type=Path, help="the folder the device call's files landed in")
    p.add_argument("--runs", type=Path, default=ROOT / "runs")
    p.add_argument("--docs", type=Path, default=ROOT / "docs" / "benchmarks")
    args = ap.parse_args(argv)
    if args.cmd == "prepare":
        print(json.dumps(prepare(args.records, args.gguf, args.gguf_wheel, args.out), indent=2))
        return 0
    if args.cmd == "run":
        return run(args)
    done = unpack(args.files, args.runs, args.docs)
    print(json.dumps(done, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
