#!/usr/bin/env python3
"""Fault suite: the faults a served kit must survive, against a real tritonserver.

    .venv/bin/python scripts/fault_suite.py --out docs/benchmarks/faults

Starts its own server (scripts/start_server.sh, ``--load-model ensemble``, a small
``max_batch`` so that bursts go over capacity), then runs, one case at a time:

- every bad input of ``dspark.engine.serving.faults.BAD_INPUTS`` (tensor, type, shape, range,
  encoding, parameter), to the ensemble and to the composing models directly;
- streaming abandonment (a client process killed mid-stream, a stream closed mid-stream);
- cancellation storms (many streams cancelled at once; stop requests for many streams);
- over-capacity bursts (3 x max_batch concurrent streams; the same with bad requests mixed in);
- tampered and mismatched engine directories (``load_engine(dir, mode="spec")`` in a
  subprocess, and one ``start_server.sh`` on a tampered directory);
- ``kill -9`` of the server mid-stream, then a restart on the same state directory.

Around each case: refused or served (and the one-line error), whether the server kept
serving, whether a fixed greedy check request still gives the same text, RSS of the server
and its stubs before/after, and leftover stubs, orphaned stubs and shared-memory regions.
Writes ``<out>.json`` and ``<out>.md``. Without ``--engine-dir`` it builds an engine directory
(``--what onnx``) from ``--drafter`` (default: the untrained drafter the e2e tests serve).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable


ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.e2e.engine_dir: the untrained drafter of the e2e tests

from dspark.engine.serving import faults as F  # noqa: E402
from dspark.engine.serving.faults import free_ports, wait_until  # noqa: E402
from dspark.engine.serving import stubs  # noqa: E402
from dspark.engine.serving.client import StreamClient, make_inputs  # noqa: E402

REPO = ROOT / "triton_repo"
CHECK_PROMPT, CHECK_TOKENS = "Say yes.", 8


# -- the server ----------------------------------------------------------------------------------
@dataclass
class Server:
    state: Path
    engine_dir: Path
    max_batch: int
    http: int = 0
    grpc: int = 0
    metrics: int = 0

    def __post_init__(self):
        self.http, self.grpc, self.metrics = free_ports(3)

    @property
    def url(self) -> str:
        return f"localhost:{self.grpc}"

    @property
    def metrics_url(self) -> str:
        return f"localhost:{self.metrics}"

    @property
    def pid(self) -> int | None:
        f = self.state / "server.pid"
        return int(f.read_text()) if f.is_file() else None

    @property
    def shm_prefix(self) -> str:
        return (self.state / "shm_prefix").read_text().strip()

    def start_args(self, engine_dir: Path | None = None) -> list[str]:
        return [str(ROOT / "scripts" / "start_server.sh"), "--http-port", str(self.http), "--grpc-port",
                str(self.grpc), "--metrics-port", str(self.metrics), "--state-dir", str(self.state),
                "--engine-dir", str(engine_dir or self.engine_dir), "--load-model", "ensemble",
                "--engine-kwargs", json.dumps({"max_batch": self.max_batch}), "--num-threads", "1",
                "--timeout", "420"]

    def start(self) -> subprocess.CompletedProcess:
        run = subprocess.run(self.start_args(), cwd=ROOT, capture_output=True, text=True,
                             env=dict(os.environ, PYTHON=sys.executable))
        if run.returncode != 0:
            raise SystemExit(f"start_server.sh failed:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}")
        return run

    def stop(self) -> str:
        run = subprocess.run([str(ROOT / "scripts" / "stop_server.sh"), "--state-dir", str(self.state)],
                             cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, PYTHON=sys.executable))
        return run.stdout.strip()

    def snapshot(self) -> F.Snapshot:
        return F.snapshot(self.pid, REPO, self.shm_prefix)

    def inflight(self) -> float:
        return F.metric(self.metrics_url, "dspark_inflight_requests", model="dspark_llm")

    def cancelled(self) -> float:
        return F.metric(self.metrics_url, "dspark_requests_total", model="dspark_llm", reason="cancelled")

    def drained(self, timeout: float = 60.0) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            try:
                if self.inflight() == 0:
                    return True
            except OSError:
                return False
            time.sleep(0.2)
        return False

    def check(self) -> str | None:
        """The fixed check request: greedy, non-streamed; its text, or None if it failed."""
        try:
            with StreamClient(self.url) as c:
                res = c.generate(CHECK_PROMPT, max_tokens=CHECK_TOKENS, stream=False, timeout=120)
        except Exception:  # noqa: BLE001 - a server that does not answer did not keep serving
            return None
        return None if res.error else res.text


# -- cases ---------------------------------------------------------------------------------------
class Suite:
    def __init__(self, server: Server):
        self.server = server
        self.cases: list[dict] = []
        self.baseline: str | None = None

    def case(self, name: str, kind: str, expected: str, fn: Callable[[], dict]) -> dict:
        srv = self.server
        before = srv.snapshot()
        t0 = time.perf_counter()
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - a case that raises did not survive; keep going
            result = {"outcome": "suite error", "message": f"{type(e).__name__}: {e}", "ok": False}
        seconds = time.perf_counter() - t0
        drained = srv.drained()
        check = srv.check()
        after = srv.snapshot()
        leaked = (after.stubs < before.stubs or bool(after.orphans) or len(after.shm) > len(before.shm)
                  or not drained)
        row = {
            "case": name, "kind": kind, "expected": expected, **result, "seconds": round(seconds, 2),
            "kept_serving": check is not None,
            "check_unchanged": check is not None and check == self.baseline,
            "drained": drained, "before": before.as_dict(), "after": after.as_dict(),
            "rss_delta_mb": round(after.rss_mb - before.rss_mb, 1), "leaked": leaked,
        }
        row["survived"] = bool(row["ok"] and row["kept_serving"] and row["check_unchanged"] and not leaked)
        self.cases.append(row)
        msg = (row.get("message") or "")[:100]
        print(f"[{'ok' if row['survived'] else 'FAIL':4s}] {kind:10s} {name:48s} {row['outcome']:10s} "
              f"{seconds:6.2f}s rss {before.rss_mb:7.0f}->{after.rss_mb:7.0f} MB  {msg}", flush=True)
        return row


def refused(ans: F.Answer, expect: str) -> dict:
    if ans.timed_out:
        return {"outcome": "hung", "message": "no answer within the timeout", "ok": False}
    if ans.error is None:
        return {"outcome": "served", "message": "", "ok": False}
    ok = expect in ans.error and F.is_one_line(ans.error)
    return {"outcome": "refused", "message": ans.error, "ok": ok}


def bad_input_cases(suite: Suite) -> None:
    for p in F.BAD_INPUTS:
        suite.case(f"{p.name} ({p.model})", p.kind, "refused",
                   lambda p=p: refused(F.send_once(suite.server.url, p.model, p.inputs(), p.parameters,
                                                   p.empty_final, timeout=60), p.expect))


def _cancelled_by(srv: Server, before: float, n: int, timeout: float = 90.0) -> bool:
    return wait_until(lambda: srv.cancelled() >= before + n and srv.inflight() == 0, timeout)


def abandon_killed_client(srv: Server) -> dict:
    before = srv.cancelled()
    proc = F.start_abandoning_client(srv.url)
    try:
        started = proc.stdout.readline().strip() == "streaming"
    finally:
        proc.kill()
        proc.wait()
    ok = started and _cancelled_by(srv, before, 1)
    return {"outcome": "cancelled" if ok else "kept generating", "ok": ok,
            "message": "client process killed after 2 chunks; the engine request was cancelled" if ok else ""}


def abandon_closed_stream(srv: Server) -> dict:
    before = srv.cancelled()
    c = StreamClient(srv.url)
    res = c.submit(make_inputs("Tell me a long story about a dragon.", 400, True))
    started = wait_until(lambda: len(res.chunks) >= 2, 120)
    c.close(cancel=True)
    ok = started and _cancelled_by(srv, before, 1)
    return {"outcome": "cancelled" if ok else "kept generating", "ok": ok,
            "message": "gRPC stream closed with cancel after 2 chunks" if ok else ""}


def cancel_storm(srv: Server, n: int) -> dict:
    before = srv.cancelled()
    c = StreamClient(srv.url)
    results = [c.submit(make_inputs(f"Tell me a long story about dragon number {i}.", 400, True)) for i in range(n)]
    started = wait_until(lambda: sum(1 for r in results if r.chunks) >= min(n, srv.max_batch), 120)
    c.close(cancel=True)
    ok = started and _cancelled_by(srv, before, n)
    got = srv.cancelled() - before
    return {"outcome": "cancelled" if ok else "kept generating", "ok": ok,
            "message": f"{n} streams ({srv.max_batch} running, the rest queued) cancelled at once; "
                       f"{got:.0f} cancelled in the engine"}


def stop_storm(srv: Server, n: int) -> dict:
    # one stream per request: an error response carries no request id to route it by
    clients = [StreamClient(srv.url) for _ in range(n)]
    try:
        results = [c.submit(make_inputs(f"Tell me a long story about knight {i}.", 400, True), request_id=f"storm{i}")
                   for i, c in enumerate(clients)]
        wait_until(lambda: sum(1 for r in results if r.chunks) >= min(n, srv.max_batch), 120)
        stops = [F.send_once(srv.url, "dspark_llm", [F.flag("stop", True)], request_id=f"storm{i}")
                 for i in range(n)]
        stopped = all(s.final and s.error is None for s in stops)
        ended = all(r.done.wait(90) for r in results)
    finally:
        for c in clients:
            c.close()
    streamed = sum(1 for r in results if r.error is None and r.finish_reason == "cancelled")
    early = sum(1 for r in results if r.error is not None and "request cancelled" in r.error)
    ok = stopped and ended and streamed + early == n
    return {"outcome": "cancelled" if ok else "not stopped", "ok": ok,
            "message": f"{n} streams stopped by request id (stop=true to dspark_llm): {streamed} ended with "
                       f"finish_reason cancelled, {early} (not started yet) with a 'request cancelled' error"}


def burst(srv: Server, n: int, baseline: str, bad: int = 0) -> dict:
    import concurrent.futures as cf

    with StreamClient(srv.url) as c, cf.ThreadPoolExecutor(max(bad, 1)) as pool:
        good = [c.submit(make_inputs(CHECK_PROMPT, CHECK_TOKENS, True)) for _ in range(n)]
        # bad requests on streams of their own: an error response carries no request id
        bads = [pool.submit(F.send_once, srv.url, "ensemble", [F.text("hi"), F.i32("max_tokens", 4),
                                                               F.i32("end_id", 10**6)]) for _ in range(bad)]
        done = all(r.done.wait(300) for r in good)
        answers = [b.result() for b in bads]
    same = sum(1 for r in good if r.error is None and r.text == baseline)
    refused_ok = sum(1 for a in answers if a.error and "end_id=1000000" in a.error)
    ok = done and same == n and refused_ok == bad
    extra = f", {refused_ok}/{bad} bad requests sent meanwhile refused" if bad else ""
    return {"outcome": "served" if ok else "failed", "ok": ok,
            "message": f"{n} concurrent streams over max_batch {srv.max_batch}: {same}/{n} streamed texts equal "
                       f"the check request's{extra}"}


# -- engine directories ----------------------------------------------------------------------------
def _edit_json(d: Path, edit: Callable[[dict], None]) -> None:
    meta = json.loads((d / "engine.json").read_text())
    edit(meta)
    (d / "engine.json").write_text(json.dumps(meta, indent=2))


def _flip_byte(f: Path, at: int = -1000) -> None:
    b = bytearray(f.read_bytes())
    b[at] ^= 0xFF
    f.write_bytes(bytes(b))


TAMPERS: dict[str, tuple[str, Callable[[Path], None], str]] = {
    # name: (expected, edit of a copy, substring of the error)
    "pristine copy": ("served", lambda d: None, ""),
    "target weight sha256 zeroed": ("refused", lambda d: _edit_json(
        d, lambda m: m["target"]["weights"][0].update(sha256="0" * 64)), "built for another checkpoint"),
    "target weight size changed": ("refused", lambda d: _edit_json(
        d, lambda m: m["target"]["weights"][0].update(bytes=m["target"]["weights"][0]["bytes"] + 1)),
        "built for another checkpoint"),
    "target weight file renamed": ("refused", lambda d: _edit_json(
        d, lambda m: m["target"]["weights"][0].update(path="other-model.gguf")), "does not have"),
    "drafter for another tokenizer": ("refused", lambda d: _edit_json(
        d, lambda m: m["target"]["identity"].update(tokenizer_hash="0" * 16)), "tokenizer_hash"),
    "drafter for another hidden size": ("refused", lambda d: _edit_json(
        d, lambda m: m["target"]["identity"].update(hidden_size=1024)), "hidden_size"),
    "drafter weights truncated": ("refused", lambda d: (d / "drafter" / "model.safetensors").write_bytes(
        (d / "drafter" / "model.safetensors").read_bytes()[:-4096]), "truncated"),
    "drafter weights modified, same size": ("refused", lambda d: _flip_byte(d / "drafter" / "model.safetensors"),
                                            "modified"),
    "drafter.json deleted": ("refused", lambda d: (d / "drafter" / "drafter.json").unlink(), "missing"),
    "unknown manifest_version": ("refused", lambda d: _edit_json(d, lambda m: m.update(manifest_version=99)),
                                 "manifest_version 99"),
    "engine.json not JSON": ("refused", lambda d: (d / "engine.json").write_text("{not json"), "not valid JSON"),
    "engine.json deleted": ("refused", lambda d: (d / "engine.json").unlink(), "no engine.json"),
}

LOAD_WORKER = """
import json, sys
from dspark.engine.runtime import load_engine
for d in sys.argv[1:]:
    try:
        load_engine(d, mode="spec", max_batch=2)
        out = {"dir": d, "loaded": True}
    except Exception as e:
        out = {"dir": d, "loaded": False, "error": f"{type(e).__name__}: {e}"}
    print("RESULT " + json.dumps(out), flush=True)
"""


def tampered_dirs(pristine: Path, work: Path) -> dict[str, Path]:
    out = {}
    for i, (name, (_, edit, _)) in enumerate(TAMPERS.items()):
        d = work / f"tampered-{i}"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(pristine, d)
        edit(d)
        out[name] = d
    return out


def load_all(dirs: list[Path]) -> dict[str, dict]:
    """``load_engine(dir, mode="spec")`` for each directory, in one subprocess (the target loads
    once per directory, as a server's model would)."""
    run = subprocess.run([sys.executable, "-c", LOAD_WORKER, *map(str, dirs)], capture_output=True, text=True,
                         cwd=ROOT, timeout=1800)
    results = {}
    for line in run.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            results[r["dir"]] = r
    return results


def engine_dir_cases(suite: Suite, pristine: Path, work: Path) -> None:
    dirs = tampered_dirs(pristine, work)
    print(f"loading {len(dirs)} engine directories in a subprocess ...", flush=True)
    loaded = load_all(list(dirs.values()))
    for name, d in dirs.items():
        expected, _, expect = TAMPERS[name]

        def fn(d=d, expected=expected, expect=expect):
            r = loaded.get(str(d), {"loaded": False, "error": "no result from the load worker"})
            if r["loaded"]:
                return {"outcome": "served", "message": "loaded", "ok": expected == "served"}
            err = r["error"]
            return {"outcome": "refused", "message": err,
                    "ok": expected == "refused" and expect in err and F.is_one_line(err)}
        suite.case(f"load_engine: {name}", "engine_dir", expected, fn)

    def start_tampered() -> dict:
        state = Path(tempfile.mkdtemp(prefix="tampered-server-", dir=work))
        other = Server(state, dirs["target weight sha256 zeroed"], suite.server.max_batch)
        run = subprocess.run(other.start_args(), cwd=ROOT, capture_output=True, text=True,
                             env=dict(os.environ, PYTHON=sys.executable), timeout=600)
        prefix = (state / "shm_prefix").read_text().strip()
        left = stubs.orphaned_stubs(REPO, prefix)
        regions = stubs.shm_regions(prefix)
        line = next((ln.strip() for ln in run.stderr.splitlines() if "another checkpoint" in ln), "")
        ok = run.returncode != 0 and bool(line) and not left and not regions and not (state / "server.pid").exists()
        return {"outcome": "refused" if run.returncode != 0 else "served", "ok": ok,
                "message": (line[line.find("TargetMismatchError"):] if "TargetMismatchError" in line else line)[:300],
                "tampered_server": {"exit_code": run.returncode, "orphaned_stubs": len(left),
                                    "shm_regions": len(regions)}}
    suite.case("start_server.sh on a directory with the target hash zeroed", "engine_dir", "refused", start_tampered)


# -- kill -9 ---------------------------------------------------------------------------------------
def kill9_and_restart(suite: Suite) -> None:
    srv = suite.server
    record: dict = {}

    def fn() -> dict:
        pid, prefix = srv.pid, srv.shm_prefix
        report = F.kill_mid_stream(srv.url, pid, prefix)
        record.update(killed_pid=pid, responses_before_kill=report.responses_before_kill,
                      stubs_at_kill=report.stubs_at_kill, orphaned_stubs_after_kill=len(report.orphans),
                      shm_regions_after_kill=len(report.shm),
                      seconds_to_clean=None if report.seconds_to_clean is None else round(report.seconds_to_clean, 2))
        t0 = time.perf_counter()
        run = srv.start()
        record["restart_s"] = round(time.perf_counter() - t0, 1)
        record["restart_reclaim"] = next((ln for ln in run.stdout.splitlines() if "reclaim:" in ln), "")
        ok = not report.orphans and not report.shm and report.responses_before_kill >= 3
        return {"outcome": "served", "ok": ok, **record,
                "message": f"killed after {report.responses_before_kill} responses; {report.stubs_at_kill} stubs "
                           f"exited and their regions went in {record['seconds_to_clean']} s; restarted in "
                           f"{record['restart_s']}s"}
    suite.case("kill -9 of the server mid-stream, then restart", "crash", "served", fn)


# -- report ----------------------------------------------------------------------------------------
def write_report(out: Path, suite: Suite, meta: dict, final: dict) -> dict:
    cases = suite.cases
    crash = next((c for c in cases if c["kind"] == "crash"), {})
    summary = {
        "cases": len(cases),
        "survived": sum(c["survived"] for c in cases),
        "all_survived": all(c["survived"] for c in cases),
        "refused": sum(c["outcome"] == "refused" for c in cases),
        "leaks": sum(c["leaked"] for c in cases),
        "nothing_leaked": not any(c["leaked"] for c in cases) and final["orphaned_stubs"] == 0
        and final["shm_regions"] == 0,
        "orphaned_stubs_after_kill9": crash.get("orphaned_stubs_after_kill", None),
        "shm_regions_after_kill9": crash.get("shm_regions_after_kill", None),
        "check_unchanged_everywhere": all(c["check_unchanged"] for c in cases),
        "rss_start_mb": cases[0]["before"]["rss_mb"] if cases else None,
        "rss_end_mb": cases[-1]["after"]["rss_mb"] if cases else None,
        "after_final_stop": final,
    }
    data = {**meta, "summary": summary, "cases": cases}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(data, indent=2) + "\n")

    lines = [
        "# Fault suite", "",
        f"`{meta['command']}` ({meta['date']}, {meta['machine']}).", "",
        f"Server: `scripts/start_server.sh --load-model ensemble`, engine `{meta['engine']}`, "
        f"max_batch {meta['max_batch']}, 1 torch thread per model. Check request: greedy "
        f"`{CHECK_PROMPT!r}`, {CHECK_TOKENS} tokens, non-streamed, sent after every case; its text before "
        f"any case was `{suite.baseline!r}`.", "",
        f"**{summary['survived']}/{summary['cases']} cases survived** (refused or served as expected, one-line "
        f"error, server kept serving, check text unchanged, nothing leaked). Leaks: {summary['leaks']}. "
        f"After `kill -9` mid-stream: {summary['orphaned_stubs_after_kill9']} orphaned stubs, "
        f"{summary['shm_regions_after_kill9']} shared-memory regions left. After the final stop_server.sh: "
        f"{final['orphaned_stubs']} orphaned stubs, {final['shm_regions']} regions. RSS (server + stubs) "
        f"{summary['rss_start_mb']} MB at the start, {summary['rss_end_mb']} MB at the end "
        "(the crash case restarts the server).", "",
        "A case *survived* when its outcome is the expected one, an error is one line (no traceback), "
        "a request afterwards is served with the same text as before any case, the LLM "
        "model has no request in flight, no stub of the server is gone, no stub is orphaned and no new "
        "shared-memory region is left.", "",
        "| case | kind | expected | outcome | survived | RSS MB before -> after | stubs | orphans | shm | message |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in cases:
        msg = (c.get("message") or "").replace("|", "\\|")
        if len(msg) > 140:
            msg = msg[:137] + "..."
        lines.append(f"| {c['case']} | {c['kind']} | {c['expected']} | {c['outcome']} | "
                     f"{'yes' if c['survived'] else '**no**'} | {c['before']['rss_mb']:.0f} -> "
                     f"{c['after']['rss_mb']:.0f} | {c['before']['stubs']} -> {c['after']['stubs']} | "
                     f"{c['after']['orphans']} | {c['before']['shm_regions']} -> {c['after']['shm_regions']} | {msg} |")
    if crash:
        lines += ["", "## kill -9 mid-stream", "",
                  f"Stream of 256 tokens; server pid {crash['killed_pid']} killed with SIGKILL after "
                  f"{crash['responses_before_kill']} responses. Stubs at the kill: {crash['stubs_at_kill']}; "
                  f"left after it: {crash['orphaned_stubs_after_kill']} stubs, {crash['shm_regions_after_kill']} "
                  f"regions (clean after {crash['seconds_to_clean']} s: each model's watchdog saw its parent "
                  f"go, unlinked its region and exited). Restart on the same state dir: "
                  f"{crash['restart_s']} s, `{crash['restart_reclaim'].strip()}`."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return summary


def build_engine_dir(drafter: Path | None, out: Path) -> Path:
    from dspark.engine.export.builder import build_engine

    if drafter is None:
        from tests.e2e.engine_dir import build_untrained_engine_dir

        drafter = build_untrained_engine_dir() / "drafter"
    shutil.rmtree(out, ignore_errors=True)
    build_engine(drafter_dir=drafter, output=out, target_profile="smollm2-135m", what="onnx", max_batch=4)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="output prefix: writes <out>.json and <out>.md")
    ap.add_argument("--engine-dir", type=Path, help="an engine directory built by scripts/build_engine.sh")
    ap.add_argument("--drafter", type=Path, help="drafter checkpoint to build the engine from (without --engine-dir)")
    ap.add_argument("--max-batch", type=int, default=4, help="the engine's max_batch (bursts send 3x this)")
    ap.add_argument("--work-dir", type=Path, help="scratch directory (default: a temporary one)")
    ap.add_argument("--only", default="", help="comma-separated groups to run (bad_input, abandon, cancel, burst, "
                                               "engine_dir, crash); default all (what the committed report needs)")
    args = ap.parse_args()
    only = {g for g in args.only.split(",") if g}

    def wanted(group: str) -> bool:
        return not only or group in only
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="dspark-faults-"))
    work.mkdir(parents=True, exist_ok=True)
    engine_dir = args.engine_dir or build_engine_dir(args.drafter, work / "engine")
    srv = Server(work / "state", engine_dir, args.max_batch)
    print(f"starting the server on {srv.url} (engine {engine_dir}) ...", flush=True)
    srv.start()
    suite = Suite(srv)
    try:
        suite.baseline = srv.check()
        if suite.baseline is None:
            raise SystemExit("the check request failed on a fresh server")
        if wanted("bad_input"):
            bad_input_cases(suite)
        if wanted("abandon"):
            suite.case("client process killed mid-stream", "abandon", "cancelled", lambda: abandon_killed_client(srv))
            suite.case("stream closed mid-stream", "abandon", "cancelled", lambda: abandon_closed_stream(srv))
        if wanted("cancel"):
            n = 4 * args.max_batch
            suite.case(f"cancellation storm: {n} streams", "cancel", "cancelled", lambda: cancel_storm(srv, n))
            suite.case(f"stop storm: {2 * args.max_batch} streams", "cancel", "cancelled",
                       lambda: stop_storm(srv, 2 * args.max_batch))
        if wanted("burst"):
            n = 3 * args.max_batch
            suite.case(f"burst: {n} streams", "burst", "served", lambda: burst(srv, n, suite.baseline))
            suite.case(f"burst: {n} streams + {n} bad requests", "burst", "served",
                       lambda: burst(srv, n, suite.baseline, bad=n))
        if wanted("engine_dir"):
            engine_dir_cases(suite, engine_dir, work)
        if wanted("crash"):
            kill9_and_restart(suite)
    finally:
        prefix = srv.shm_prefix
        stop = srv.stop()
        final = {"stop_server": stop.splitlines()[-1] if stop else "",
                 "orphaned_stubs": len(stubs.orphaned_stubs(REPO, prefix)),
                 "shm_regions": len(stubs.shm_regions(prefix))}
    meta = {
        "command": "python scripts/fault_suite.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]),
        "date": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, {platform.system()}",
        "engine": "untrained quickstart drafter, built with --what onnx" if not args.engine_dir else str(engine_dir),
        "max_batch": args.max_batch, "baseline_text": suite.baseline, "groups": sorted(only) or "all",
    }
    summary = write_report(Path(args.out), suite, meta, final)
    print(json.dumps({k: v for k, v in summary.items()}, indent=2))
    if not args.work_dir:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if summary["all_survived"] and summary["nothing_leaked"] else 1


if __name__ == "__main__":
    sys.exit(main())
