#!/usr/bin/env python3
"""gRPC streaming benchmark of a running server: spec vs target-only, concurrency sweep.

  # start the server first: scripts/start_server.sh --engine-dir ENGINE_DIR
  python scripts/benchmark_client.py --url localhost:8001 --concurrency 1,4,16,64 \
      --max-tokens 64 --out docs/benchmarks/serving
  python scripts/benchmark_client.py --soak 10 --streams 64 --out docs/benchmarks/soak

accept_len by proposer comes from the server's dspark_proposer_* counters (--metrics-url, default
the gRPC host's port 8002); a hybrid engine is served with scripts/start_server.sh --engine-dir DIR
and DSPARK_PROPOSERS=neural+suffix (or the engine directory's engine.json "proposers").

Writes <out>.json, <out>.md and <out>.png (sweep) or <out>.json and <out>.md (soak).
Prompts: the first turn of each {"turns": [...]} line of --prompts (JSONL files or
folders; default the kit's data/eval, or $DSPARK_DATA/eval, *.jsonl).
Logic: dspark.engine.serving.bench.
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from dspark.engine.serving import bench



def prompt_files(args_prompts: list[str]) -> list[Path]:
    if not args_prompts:
        files = bench.default_prompt_files()
        if not files:
            sys.exit("no prompts: pass --prompts FILE.jsonl (the kit's data/eval holds no *.jsonl)")
        return files
    files: list[Path] = []
    for p in map(Path, args_prompts):
        files += sorted(p.glob("*.jsonl")) if p.is_dir() else [p]
    return files


def server_pid(args) -> int | None:
    if args.server_pid:
        return args.server_pid
    pid_file = Path(args.state_dir or f"/tmp/dspark-triton-{args.url.rsplit(':', 1)[-1]}") / "server.pid"
    try:
        return int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="localhost:8001", help="gRPC host:port")
    ap.add_argument("--prompts", nargs="*", default=[], help="JSONL files or folders of {'turns': [...]} lines")
    ap.add_argument("--num-prompts", type=int, default=None, help="use only the first N prompts")
    ap.add_argument("--concurrency", default="1,4,16,64", help="comma-separated sweep")
    ap.add_argument("--systems", default="spec,target_only", help="spec (ensemble), target_only (ensemble_target_only)")
    ap.add_argument("--num-requests", type=int, default=None, help="requests per level (default 4 x concurrency, >= 12)")
    ap.add_argument("--repeats", type=int, default=1,
                    help="rounds per level (each runs every system once); rows are the median-throughput runs")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=None, help="default: greedy")
    ap.add_argument("--out", default="docs/benchmarks/serving", help="output path without suffix")
    ap.add_argument("--device", default=None, help="device label for the report (default: this host's CPU)")
    ap.add_argument("--metrics-url", default=None,
                    help="Triton metrics endpoint for accept_len by proposer (default http://<url host>:8002/metrics; "
                         "'' to skip)")
    ap.add_argument("--soak", type=float, default=None, metavar="MINUTES",
                    help="soak mode: streamed == non-streamed greedy text for MINUTES")
    ap.add_argument("--streams", type=int, default=64, help="soak: concurrent workers")
    ap.add_argument("--server-pid", type=int, default=None, help="soak: server pid for RSS (default: pid file)")
    ap.add_argument("--state-dir", default=None, help="start_server.sh --state-dir, to find the pid file")
    args = ap.parse_args(argv)

    prompts = bench.load_prompts(prompt_files(args.prompts), args.num_prompts)
    command = "python scripts/benchmark_client.py " + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv))
    out = Path(args.out)
    if args.soak is not None:
        pid = server_pid(args)
        report = bench.soak(args.url, prompts, args.soak, args.streams, args.max_tokens, pid)
        report = {"command": command, "device": args.device or bench.device_label(), **report}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
        out.with_suffix(".md").write_text(
            "# Soak run\n\nCommand: `{command}`\n\nDevice: {device}\n\n| streams | minutes | requests | failed | "
            "mismatched | RSS start MiB | RSS end MiB |\n|---:|---:|---:|---:|---:|---:|---:|\n"
            "| {streams} | {minutes} | {requests} | {failed} | {mismatched} | {rss_start_mb} | {rss_end_mb} |\n"
            .format(**report))
        print(json.dumps({k: v for k, v in report.items() if k != "examples"}, indent=2))
        return 0 if report["failed"] == 0 and report["mismatched"] == 0 else 1

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in bench.SYSTEMS]
    if unknown:
        sys.exit(f"unknown system(s) {unknown}; known: {', '.join(bench.SYSTEMS)}")
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if args.repeats < 1:
        sys.exit(f"--repeats must be >= 1, got {args.repeats}")
    metrics_url = args.metrics_url
    if metrics_url is None:
        metrics_url = f"http://{args.url.rsplit(':', 1)[0]}:8002/metrics"
    if metrics_url and bench.scrape_proposer_counters(metrics_url) is None:
        print(f"note: no proposer counters at {metrics_url}: the report has no accept_len by proposer", file=sys.stderr)
        metrics_url = ""
    rows = bench.sweep(args.url, prompts, concurrencies, systems, args.max_tokens, args.num_requests,
                       args.temperature, repeats=args.repeats, metrics_url=metrics_url or None)
    report = {"command": command, "device": args.device or bench.device_label(), "max_tokens": args.max_tokens,
              "repeats": args.repeats, "results": rows}
    for p in bench.write_report(report, out):
        print("wrote", p)
    print(bench.markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
