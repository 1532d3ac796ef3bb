"""Fixed-shape target steps, replayed from CUDA graphs on a GPU.

A decode step of a small target is bound by Python and kernel launches, not by the GPU:
transformers eager takes 21-36 ms per SmolLM2 forward on an H200 at any batch, while
reading the weights once takes about 65 us. ``StaticTarget`` wraps a ``TargetRunner`` and
runs decode steps through ``TargetRunner.forward_static`` at a few fixed shapes, the
buckets (rows, query length, attended context); a step is padded up to the smallest bucket
that holds it. The context buckets keep a step from reading the whole cache when every
request is short: attention is what grows with the batch.
On a CUDA device each bucket is captured once as a CUDA graph over static input buffers
and a step is a host-to-device copy of token ids and lengths plus one graph replay. On
the CPU the same buckets run eagerly, so the bucketing, padding and cache handling are
tested here (``tests/unit/test_static_target.py``); only the capture itself needs a GPU
(``tests/gpu/test_static_target_gpu.py``, run by ``scripts/gpu_check.sh``).

Prefill chunks run one request at a time through their own buckets (one row at any slot,
the chunk padded to 16, 32, ..., ``prefill_chunk`` tokens): a request joining a running
batch costs a graph replay, not an eager forward. Non-contiguous decode slots and steps
larger than the largest bucket fall back to the ragged eager ``forward``. The KV cache is
allocated at its full size up front (``max_context`` plus the largest decode query),
because graphs hold its address; padding queries past it are clamped onto its last entry,
which no request ever reaches.
"""
from __future__ import annotations

import bisect
from typing import Callable, Sequence

import torch

from .target_runner import RaggedOutput, TargetRunner

__all__ = ["StaticTarget", "with_static_steps", "default_row_buckets", "default_query_buckets",
           "default_ctx_buckets", "default_prefill_buckets"]


def default_row_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, ... up to and including ``max_rows``."""
    out, b = [], 1
    while b < max_rows:
        out.append(b)
        b *= 2
    return out + [max_rows]


def default_ctx_buckets(capacity: int, smallest: int = 512) -> list[int]:
    """512, 1024, ... while well below ``capacity`` (a bucket within 1.5x of it would cost
    nearly as much as it), then ``capacity`` itself."""
    out, c = [], smallest
    while c * 1.5 <= capacity:
        out.append(c)
        c *= 2
    return out + [capacity]


def default_prefill_buckets(prefill_chunk: int, smallest: int = 16) -> list[int]:
    """16, 32, ... below ``prefill_chunk``, then ``prefill_chunk`` itself."""
    out, q = [], smallest
    while q < prefill_chunk:
        out.append(q)
        q *= 2
    return out + [prefill_chunk]


def default_query_buckets(block_size: int) -> list[int]:
    """Decode query lengths: 1 (no drafts), 2, 4 and a full block of ``block_size`` drafts."""
    return sorted({1, 2, 4, block_size + 1}) if block_size else [1]


STATIC_STEP_MODES = ("auto", "graphs", "eager", "off")


def with_static_steps(runner: TargetRunner, mode: str, max_rows: int, block_size: int,
                      prefill_chunk: int | None = None) -> "TargetRunner | StaticTarget":
    """``runner`` wrapped for fixed-shape steps as ``mode`` asks (``EngineConfig.static_steps``):
    ``auto`` means CUDA graphs on a GPU and the plain ragged runner on the CPU; ``graphs`` and
    ``eager`` force the buckets; ``off`` never wraps."""
    if mode not in STATIC_STEP_MODES:
        raise ValueError(f"static_steps must be one of {', '.join(STATIC_STEP_MODES)}, got {mode!r}")
    if mode == "off" or (mode == "auto" and runner.device.type != "cuda"):
        return runner
    return StaticTarget(runner, default_row_buckets(max_rows), default_query_buckets(block_size),
                        use_graphs=mode != "eager",
                        prefill_buckets=default_prefill_buckets(prefill_chunk) if prefill_chunk else ())


_Step = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None", Callable[[], RaggedOutput]]


class StaticTarget:
    """A ``TargetRunner`` whose decode steps and prefill chunks run at fixed shapes (CUDA graphs on a GPU).

    Everything but ``forward`` is the wrapped runner's (lengths, slots, cache).
    """

    def __init__(self, runner: TargetRunner, row_buckets: Sequence[int], query_buckets: Sequence[int],
                 use_graphs: bool | None = None, ctx_buckets: Sequence[int] | None = None,
                 prefill_buckets: Sequence[int] = ()) -> None:
        self.runner = runner
        self.row_buckets = sorted(set(int(b) for b in row_buckets if 1 <= b <= runner.max_slots))
        self.query_buckets = sorted(set(int(q) for q in query_buckets if q >= 1))
        if not self.row_buckets or not self.query_buckets:
            raise ValueError(f"need row buckets in 1..{runner.max_slots} and query buckets >= 1, "
                             f"got {list(row_buckets)}, {list(query_buckets)}")
        self.use_graphs = runner.device.type == "cuda" if use_graphs is None else use_graphs
        if self.use_graphs and runner.device.type != "cuda":
            raise ValueError("CUDA graphs need the target on a CUDA device")
        runner.reserve(runner.max_context + self.query_buckets[-1])
        cap = runner.capacity
        self.ctx_buckets = sorted({min(int(c), cap) for c in (ctx_buckets or default_ctx_buckets(cap)) if c >= 1} | {cap})
        self._pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.prefill_buckets = sorted(set(int(q) for q in prefill_buckets if q >= 1))
        self._steps: dict[tuple[int, int, int], _Step] = {}
        self._prefills: dict[tuple[int, int], _Step] = {}
        self.replays = 0  # decode steps served from a bucket (the rest fell back to eager)
        self.prefill_replays = 0  # prefill chunks served from a bucket
        for rows in self.row_buckets:
            for q in self.query_buckets:
                for ctx in self.ctx_buckets:
                    self._steps[(rows, q, ctx)] = self._build(rows, q, ctx)
        for q in self.prefill_buckets:
            for ctx in self.ctx_buckets:
                self._prefills[(q, ctx)] = self._build(1, q, ctx, at_slot=True)

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def _build(self, rows: int, q: int, ctx: int, at_slot: bool = False) -> _Step:
        """Static input buffers and the step over them; ``at_slot``: the rows' cache slots are
        an input too (a prefill at any slot), else rows are slots 0..rows-1."""
        dev = self.runner.device
        ids = torch.zeros(rows, q, dtype=torch.long, device=dev)
        start = torch.zeros(rows, dtype=torch.long, device=dev)
        slots = torch.zeros(rows, dtype=torch.long, device=dev) if at_slot else None
        if not self.use_graphs:
            return ids, start, slots, lambda: self.runner.forward_static(ids, start, ctx, slots)
        # Warm up on a side stream (lazy inits, cuBLAS workspaces), then capture. This runs
        # before any request exists, so what the warm-up writes into the cache is unused.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.runner.forward_static(ids, start, ctx, slots)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self.runner.forward_static(ids, start, ctx, slots)

        def replay() -> RaggedOutput:
            graph.replay()
            return out
        return ids, start, slots, replay

    def bucket(self, rows: int, q: int, ctx: int | None = None) -> tuple[int, int, int] | None:
        """The smallest (rows, query, context) bucket holding a step; None past the largest."""
        i = bisect.bisect_left(self.row_buckets, rows)
        j = bisect.bisect_left(self.query_buckets, q)
        k = bisect.bisect_left(self.ctx_buckets, ctx if ctx is not None else self.ctx_buckets[-1])
        if i == len(self.row_buckets) or j == len(self.query_buckets) or k == len(self.ctx_buckets):
            return None
        return self.row_buckets[i], self.query_buckets[j], self.ctx_buckets[k]

    @torch.no_grad()
    def forward(self, slots: list[int], tokens: list[list[int]], need_features: bool = True,
                last_logits_only: bool = False) -> RaggedOutput:
        R = len(tokens)
        Q = max(len(t) for t in tokens)
        if last_logits_only:
            out = self._prefill(slots, tokens)
            return out if out is not None else self.runner.forward(slots, tokens, need_features, True)
        ctx = int(self.runner.lengths[:R].max()) + Q  # the keys the real rows attend to
        key = self.bucket(R, Q, ctx)
        if key is None or slots != list(range(R)):
            return self.runner.forward(slots, tokens, need_features, last_logits_only)
        ids, start, _, run = self._steps[key]
        rows_b, q_b = ids.shape
        host = torch.tensor([t + [0] * (q_b - len(t)) for t in tokens] + [[0] * q_b] * (rows_b - R), dtype=torch.long)
        ids.copy_(host, non_blocking=True)
        # rows past R are other slots (free, or mid-prefill): padding writes land past their
        # committed lengths, where the next real write overwrites them and no query looks
        start.copy_(self.runner.lengths[: key[0]], non_blocking=True)
        out = run()
        self.replays += 1
        # views of the graph's output buffers: valid until the next replay (the next step)
        return RaggedOutput(logits=out.logits[:R, :Q], aux=out.aux[:R, :Q], last=out.last[:R, :Q],
                            q_lens=torch.tensor([len(t) for t in tokens]))

    def _prefill(self, slots: list[int], tokens: list[list[int]]) -> RaggedOutput | None:
        """Prefill chunks through the one-row buckets, one replay per request; None when a
        chunk fits no bucket (the caller runs the ragged forward)."""
        keys = []
        for s, t in zip(slots, tokens):
            j = bisect.bisect_left(self.prefill_buckets, len(t))
            k = bisect.bisect_left(self.ctx_buckets, int(self.runner.lengths[s]) + len(t))
            if j == len(self.prefill_buckets) or k == len(self.ctx_buckets):
                return None
            keys.append((self.prefill_buckets[j], self.ctx_buckets[k]))
        Q = max(len(t) for t in tokens)
        logits, aux, last = [], [], []
        for s, t, key in zip(slots, tokens, keys):
            ids, start, slot, run = self._prefills[key]
            n = len(t)
            ids.copy_(torch.tensor([t + [0] * (key[0] - n)], dtype=torch.long), non_blocking=True)
            start.copy_(self.runner.lengths[s:s + 1], non_blocking=True)
            slot.fill_(s)
            out = run()
            # copies: the next replay of the same bucket overwrites the graph's output buffers
            logits.append(out.logits[0, n - 1:n].clone())
            aux.append(torch.nn.functional.pad(out.aux[0, :n], (0, 0, 0, Q - n)))
            last.append(torch.nn.functional.pad(out.last[0, :n], (0, 0, 0, Q - n)))
            self.prefill_replays += 1
        return RaggedOutput(logits=torch.stack(logits), aux=torch.stack(aux), last=torch.stack(last))
