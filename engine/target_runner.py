"""Target forward over a slot-based static KV cache with ragged per-request inputs.

Active requests occupy slots ``0..R-1`` (the engine compacts slots when a request
leaves), so a step attends over a view of the cache, never a copy. Each step writes the
new tokens' K/V at ``length[slot] + i``; the caller then *commits* how many of them are
kept (``set_length``): trimming rejected drafts costs nothing, their entries are simply
overwritten later.

A ragged step runs its tokens *packed*: the projections, MLPs and LM head see only the
real tokens (sum of the rows' lengths). Padding every row to the longest would make one
request verifying 7 drafts cost a 16-request batch 7 times the tokens, which is not the cost
the prefix scheduler is told (SPS of the batch's token count). On the CPU attention is packed
too (``cpu_attention.py``: each token reads its own row's keys up to its position, no mask,
no padded context); elsewhere, or with ``attention="sdpa"``, attention lays the tokens out
as [rows, longest row] under a mask. Fixed-shape steps (``forward_static``, CUDA graphs)
compute their whole grid.

Supported target architectures: the Llama family as implemented by transformers
(llama, mistral, qwen2, qwen3 incl. q/k norms). The weights are the target's own
modules; only caching and masking are ours.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from dspark.training.cpu_linear import project

from . import cpu_attention, cpu_decoder

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
ATTENTION_MODES = ("auto", "varlen", "sdpa")
LAYER_MODES = ("auto", "fused", "torch")


class RaggedOutput:
    """A ragged step's output for R rows of ``q_lens[r]`` new tokens each (Q the longest).

    ``aux [R, Q, m*d]`` (drafter features) and ``last [R, Q, d]`` (final hidden states, after
    the final norm) are grids whose cells past a row's length are padding. The logits are
    held as the step computed them: packed ``[N, V]`` (the real tokens, row after row) or as
    a grid ``[R, Q, V]``; ``token_logits`` and ``logits`` give either view, converting on
    first use. Verification reads the packed view: a padded logits grid of 64 rows over a
    49k vocabulary is some 50 MB to zero and fill that no rule reads. Given packed (with
    ``grid``, the rows' layout), ``aux`` and ``last`` are laid out on first use too: a step
    whose rows verify different numbers of drafts would otherwise pad both for every row,
    though the engine reads only the features, and only where a drafter needs them.

    ``aux`` may be given as the captured layers' hidden states, packed (a list of ``[N, d]``),
    joined on first use: ``aux_rows`` then joins only the rows a drafter keeps, so a step whose
    drafter keeps a few rows' context does not build every row's features."""

    def __init__(self, aux: torch.Tensor | list[torch.Tensor], last: torch.Tensor, *,
                 logits: torch.Tensor | None = None,
                 token_logits: torch.Tensor | None = None, q_lens: torch.Tensor | None = None,
                 grid: "_Grid | None" = None):
        if (logits is None) == (token_logits is None):
            raise ValueError("give the logits either as a grid or packed")
        if token_logits is not None and q_lens is None:
            raise ValueError("packed logits need the rows' lengths (q_lens)")
        self._aux, self._last, self._grid = aux, last, grid
        self._grid_logits, self._token_logits = logits, token_logits
        self.q_lens = q_lens

    def _laid_out(self, x: torch.Tensor) -> torch.Tensor:
        return self._grid.unpack(x) if self._grid is not None and x.dim() == 2 else x

    @property
    def aux(self) -> torch.Tensor:
        """[R, Q, m*d] drafter features."""
        if isinstance(self._aux, list):
            self._aux = torch.cat(self._aux, dim=-1)
        self._aux = self._laid_out(self._aux)
        return self._aux

    def aux_rows(self, rows: Sequence[int], width: int) -> torch.Tensor:
        """``[len(rows), width, m*d]``: the drafter features of the first ``width`` tokens of ``rows``
        (zeros past a row's length), built for those rows alone where the features are packed."""
        if not isinstance(self._aux, list) and self._aux.dim() == 3:
            return self._aux[torch.as_tensor(list(rows), dtype=torch.long), :width]
        lengths = self._row_lengths()
        starts = torch.cumsum(lengths, 0) - lengths
        want = torch.as_tensor(list(rows), dtype=torch.long)
        parts = self._aux if isinstance(self._aux, list) else [self._aux]
        if bool((lengths[want] >= width).all()):  # every row fills the width (a decode step's one token): no padding
            index = (starts[want].unsqueeze(1) + torch.arange(width)).flatten().to(self._last.device)
            return torch.cat([p.index_select(0, index) for p in parts], dim=-1).view(len(want), width, -1)
        cells = torch.arange(width).unsqueeze(0) < lengths[want].clamp(max=width).unsqueeze(1)  # [n, width]
        index = (starts[want].unsqueeze(1) + torch.arange(width).unsqueeze(0))[cells].to(self._last.device)
        picked = torch.cat([p.index_select(0, index) for p in parts], dim=-1)
        out = picked.new_zeros(len(want), width, picked.shape[-1])
        out[cells.to(out.device)] = picked
        return out

    def _row_lengths(self) -> torch.Tensor:
        """[R] new tokens per row (on the host)."""
        if self.q_lens is not None:
            return self.q_lens.cpu()
        if self._grid.valid is None:
            return torch.full((self._grid.rows,), self._grid.width)
        return self._grid.valid.sum(1).cpu()

    @property
    def last(self) -> torch.Tensor:
        """[R, Q, d] final hidden states."""
        self._last = self._laid_out(self._last)
        return self._last

    @property
    def logits(self) -> torch.Tensor:
        """[R, Q, V]; cells past a row's length are zeros (or, from a fixed-shape step, padding)."""
        if self._grid_logits is None:
            width = self._grid.width if self._grid is not None else self.aux.shape[1]
            self._grid_logits = _Grid.of(self.q_lens, width, self._token_logits.device).unpack(self._token_logits)
        return self._grid_logits

    @property
    def token_logits(self) -> torch.Tensor:
        """[N, V]: row r's ``q_lens[r]`` tokens, then row r+1's (all Q per row without ``q_lens``)."""
        if self._token_logits is None:
            R, Q = self._grid_logits.shape[:2]
            q_lens = self.q_lens if self.q_lens is not None else torch.full((R,), Q)
            self._token_logits = _Grid.of(q_lens, Q, self._grid_logits.device).pack(self._grid_logits)
        return self._token_logits


class TargetRunner:
    def __init__(self, target, max_slots: int, initial_capacity: int = 256, max_context: int = 2048,
                 attention: str = "auto", layers: str = "auto"):
        """``attention``: ``varlen`` (the packed CPU kernel of ``cpu_attention.py``), ``sdpa``
        (a padded grid under a mask), or ``auto``: varlen for a float32 target on the CPU
        where the kernel builds, else sdpa. ``layers``: ``fused`` (the decoder stack as one
        C++ call, ``cpu_decoder.py``; needs varlen attention), ``torch`` (the layers in
        PyTorch, ``_layer``), or ``auto``: fused where it builds and fits the target."""
        if attention not in ATTENTION_MODES:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_MODES)}, got {attention!r}")
        if layers not in LAYER_MODES:
            raise ValueError(f"layers must be one of {', '.join(LAYER_MODES)}, got {layers!r}")
        model_type = getattr(target.config, "model_type", "")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise NotImplementedError(
                f"the engine runs {', '.join(SUPPORTED_MODEL_TYPES)} targets; {model_type!r} is not supported yet")
        self.target = target
        self.layers = list(target.layers)
        attn = self.layers[0].self_attn
        self.head_dim = getattr(attn, "head_dim", target.hidden_size // target.config.num_attention_heads)
        self.n_heads = target.config.num_attention_heads
        self.n_kv = getattr(target.config, "num_key_value_heads", None) or self.n_heads
        self.layer_ids = list(target.profile.layer_ids)
        # decided once: the per-layer call on the hot path must not re-inspect the modules
        self.gated_mlp = all(_is_gated_mlp(layer.mlp) for layer in self.layers)
        self.max_slots = max_slots
        self.max_context = max_context
        p = next(target.model.parameters())
        self.device, self.dtype = p.device, p.dtype
        fits = self.device.type == "cpu" and self.dtype == torch.float32
        if attention == "varlen" and not (fits and cpu_attention.available()):
            raise ValueError("attention='varlen' needs a float32 target on the CPU and a C++ toolchain "
                             "(engine/cpu_attention.py)")
        self.varlen = attention == "varlen" or (attention == "auto" and fits and cpu_attention.available())
        self.lengths = torch.zeros(max_slots, dtype=torch.long)
        self._allocate_cache(min(initial_capacity, max_context))
        self.stack = self._fused_stack(target, layers)
        # varlen attention: most tokens of one row at consecutive positions that share one read of its
        # keys (a verify block reads its row's context once; 1: every token reads it itself)
        self.attention_block = cpu_attention.BLOCK

    def _allocate_cache(self, initial_capacity: int) -> None:
        """K/V caches ``[layers, slots, kv heads, capacity, head_dim]``.

        Varlen attention reads only positions a step has written, so on the CPU the cache is
        allocated for ``max_context`` at once and left uninitialised: the allocation maps
        address space, and the kernel faults in a page when a position on it is first written
        (resident memory follows the positions used, as with growth). Growing a cache instead
        copies all of it into a larger one, a pause in the middle of a decode that grows with
        the batch and the context. Where
        that much address space cannot be had, or attention reads the padded grid under a mask
        (whose masked cells must hold finite numbers), the cache starts at ``initial_capacity``
        zeroed and grows by doubling (``reserve``)."""
        L = len(self.layers)
        if self.varlen:
            shape = (L, self.max_slots, self.n_kv, self.max_context, self.head_dim)
            try:
                self.k = torch.empty(shape, dtype=self.dtype)
                self.v = torch.empty(shape, dtype=self.dtype)
                self.capacity = self.max_context
                return
            except RuntimeError:  # not enough address space: grow instead
                self.k = self.v = None
        self.capacity = initial_capacity
        shape = (L, self.max_slots, self.n_kv, self.capacity, self.head_dim)
        self.k = torch.zeros(shape, device=self.device, dtype=self.dtype)
        self.v = torch.zeros(shape, device=self.device, dtype=self.dtype)

    def _fused_stack(self, target, layers: str) -> cpu_decoder.DecoderStack | None:
        """The C++ decoder stack where ``layers`` asks for it and it can run this target exactly."""
        if layers == "torch":
            return None
        why = None if self.varlen else "the fused layers need varlen attention"
        why = why or cpu_decoder.supports(target)
        if why is None and not cpu_decoder.available():
            why = "the fused decoder stack did not build (it needs a C++ toolchain and AVX-512 or AVX2)"
        if why is not None:
            if layers == "fused":
                raise ValueError(f"layers='fused': {why}")
            return None
        return cpu_decoder.shared_stack(target, self.n_heads, self.n_kv, self.head_dim, self.layer_ids)

    # -- slot management ----------------------------------------------------------------------
    def _ensure_capacity(self, needed: int) -> None:
        if needed <= self.capacity:
            return
        if needed > self.max_context:
            raise ValueError(f"context of {needed} tokens exceeds max_context={self.max_context}")
        self.reserve(min(max(needed, 2 * self.capacity), self.max_context))

    def reserve(self, capacity: int) -> None:
        """Allocate the cache for ``capacity`` positions now (may exceed ``max_context`` by a
        query's slack); it never moves again unless more is needed (static-shape steps)."""
        if capacity > self.capacity:
            pad = capacity - self.capacity
            self.k = F.pad(self.k, (0, 0, 0, pad))
            self.v = F.pad(self.v, (0, 0, 0, pad))
            self.capacity = capacity

    def set_length(self, slot: int, length: int) -> None:
        self.lengths[slot] = length

    def advance_lengths(self, slots: list[int], counts: list[int]) -> None:
        """Commit ``counts[i]`` more positions of ``slots[i]`` (distinct slots), in one tensor update:
        a write per row costs microseconds, times 64 rows a step."""
        index = torch.tensor(slots, dtype=torch.long)
        self.lengths.index_add_(0, index, torch.tensor(counts, dtype=self.lengths.dtype))

    def move_slot(self, src: int, dst: int) -> None:
        """Compaction: the request in ``src`` now lives in ``dst``."""
        n = int(self.lengths[src])
        self.k[:, dst, :, :n] = self.k[:, src, :, :n]
        self.v[:, dst, :, :n] = self.v[:, src, :, :n]
        self.lengths[dst] = n
        self.lengths[src] = 0

    # -- forward ----------------------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, slots: list[int], tokens: list[list[int]], need_features: bool = True,
                last_logits_only: bool = False) -> RaggedOutput:
        """Run ``slots`` on their new tokens (ragged); K/V are written, lengths not advanced.

        When ``slots`` is ``0..R-1`` (the common case) attention reads views of the cache;
        otherwise the rows are gathered. ``last_logits_only`` (prefill) applies the LM head to
        each row's last new token only: ``logits`` is then [R, 1, V].
        """
        if last_logits_only:
            return self.forward_mixed(slots, tokens, 0, need_features)[1]
        return self.forward_mixed(slots, tokens, len(tokens), need_features)[0]

    @torch.no_grad()
    def forward_mixed(self, slots: list[int], tokens: list[list[int]], full_rows: int,
                      need_features: bool = True) -> tuple[RaggedOutput | None, RaggedOutput | None]:
        """One pass over every row, the first ``full_rows`` with logits at each new token (verify
        rows), the others at their last new token only (prefill chunks): -> (output of the
        first rows as ``forward``, output of the others as ``forward(last_logits_only=True)``),
        None for an empty group. A step that verifies some requests and prefills others reads
        the weights once instead of twice, and the LM head sees only the tokens whose logits
        are used.
        """
        R = len(tokens)
        slot_t = torch.tensor(slots, dtype=torch.long)
        q_lens = torch.tensor([len(t) for t in tokens])
        Q = int(q_lens.max())
        start = self.lengths[slot_t].clone()
        total = int((start + q_lens).max())
        self._ensure_capacity(total)
        pos = start.unsqueeze(1) + torch.arange(Q).unsqueeze(0)  # [R, Q]
        q_valid = torch.arange(Q).unsqueeze(0) < q_lens.unsqueeze(1)
        # key t visible to query (r, i) iff t <= start_r + i (causal; older entries are the cache)
        mask = None if self.varlen else (torch.arange(total).view(1, 1, total) <= pos.unsqueeze(-1)).to(self.device)
        rows = slot_t.unsqueeze(1).expand(R, Q)[q_valid]
        gather = None if slots == list(range(R)) else slot_t.to(self.device)
        ids = torch.tensor([t for row in tokens for t in row], dtype=torch.long, device=self.device)  # packed [N]
        wpos = pos[q_valid]
        grid = _Grid(R, Q, None if bool(q_valid.all()) else q_valid.to(self.device))
        last, aux = self._stack(ids, wpos.to(self.device), mask, rows, wpos, grid, total, need_features, gather)
        if full_rows == R:
            return RaggedOutput(token_logits=self.target.logits_from_last(last), q_lens=q_lens, aux=aux, last=last,
                                grid=grid), None
        # packed order is row-major: the full rows' tokens come first
        n_full = int(q_lens[:full_rows].sum())
        ends = (torch.cumsum(q_lens[full_rows:], 0) - 1 + n_full).to(self.device)  # the other rows' last tokens
        heads = torch.cat([torch.arange(n_full, device=self.device), ends])
        logits = self.target.logits_from_last(last[heads])
        rest = _Grid(R - full_rows, int(q_lens[full_rows:].max()), None).sub(q_lens[full_rows:], self.device)
        tail = RaggedOutput(logits=logits[n_full:].unsqueeze(1), aux=[a[n_full:] for a in aux], last=last[n_full:],
                            grid=rest)
        if full_rows == 0:
            return None, tail
        head = _Grid(full_rows, int(q_lens[:full_rows].max()), None).sub(q_lens[:full_rows], self.device)
        return RaggedOutput(token_logits=logits[:n_full], q_lens=q_lens[:full_rows], aux=[a[:n_full] for a in aux],
                            last=last[:n_full], grid=head), tail

    def _stack(self, ids, pos, mask, rows, wpos, grid, total, need_features, gather=None, apos=None):
        """Embedding -> decoder layers (writing the cache) -> final norm, on packed tokens
        ``ids [N]`` at positions ``pos [N]`` (cache slots ``rows``, written at ``wpos``);
        ``mask`` None: varlen attention of each token over its slot's keys up to ``apos``
        (default ``wpos``), at most ``total``; -> (last [N, d], the captured layers' states
        ``[N, d]`` each: ``aux`` unjoined, see ``RaggedOutput``)."""
        apos = wpos if apos is None else apos
        dec = self.target.decoder
        h = dec.embed_tokens(ids)
        cos, sin = (t[0] for t in dec.rotary_emb(h.unsqueeze(0), pos.unsqueeze(0)))
        # where each token's K/V rows go in a layer's cache seen as [slots * kv heads * capacity, head_dim]:
        # one index_copy_ per layer instead of a two-index scatter
        heads = torch.arange(self.n_kv, device=self.device)
        dest = ((rows.to(self.device).unsqueeze(1) * self.n_kv + heads) * self.capacity
                + wpos.to(self.device).unsqueeze(1)).reshape(-1)
        if self.stack is not None and mask is None:
            h, features = self.stack.forward(h, cos, sin, self.k, self.v, dest, rows.to(self.device), apos, total,
                                             self.attention_block)
            captured = dict(zip(self.layer_ids, features))
        else:
            captured = {}
            for li, layer in enumerate(self.layers):
                h = self._layer(li, layer, h, cos, sin, mask, rows, dest, grid, total, gather, apos)
                if need_features and li in self.layer_ids:
                    captured[li] = h
        last = dec.norm(h)
        aux = [captured[li] for li in self.layer_ids] if need_features else [last.new_zeros(last.shape[0], 0)]
        return last, aux

    @torch.no_grad()
    def forward_static(self, ids: torch.Tensor, start: torch.Tensor, ctx: int | None = None,
                       slots: torch.Tensor | None = None) -> RaggedOutput:
        """Rows ``0..Rb-1`` (or the cache slots in ``slots [Rb]``) on ``ids [Rb, Q]`` (device
        tensors) with fixed shapes, for CUDA graphs.

        Same result as ``forward`` for each row's valid queries, but nothing depends on the
        data on the host: every query writes its K/V at ``start[r] + i`` (padding queries land
        past the row's committed length, where they are overwritten later; positions are
        clamped into the cache) and attention reads the first ``ctx`` cache entries (default:
        all) under a mask; a row whose queries reach past ``ctx`` gets garbage, so the caller
        picks ``ctx`` above every real row's last position. The cache must not grow while
        graphs hold it: allocate ``capacity`` for ``max_context`` + Q.
        """
        Rb, Q = ids.shape
        C = min(ctx or self.capacity, self.capacity)
        pos = start.unsqueeze(1) + torch.arange(Q, device=ids.device).unsqueeze(0)  # [Rb, Q]
        wpos = pos.clamp(max=self.capacity - 1)
        rows = (torch.arange(Rb, device=ids.device) if slots is None else slots).unsqueeze(1).expand(Rb, Q)
        mask = None if self.varlen else torch.arange(C, device=ids.device).view(1, 1, C) <= pos.unsqueeze(-1)
        grid = _Grid(Rb, Q, None)  # the whole grid: shapes must not depend on the data
        # varlen attention reads keys up to each query's position, at most the first C
        last, aux = self._stack(ids.reshape(-1), pos.reshape(-1), mask, rows.reshape(-1), wpos.reshape(-1), grid, C,
                                need_features=True, gather=slots, apos=pos.reshape(-1))
        return RaggedOutput(logits=grid.unpack(self.target.logits_from_last(last)), aux=grid.unpack(torch.cat(aux, -1)),
                            last=grid.unpack(last))

    def _layer(self, li, layer, h, cos, sin, mask, rows, dest, grid, total, gather=None, apos=None):
        """One decoder layer on packed tokens ``h [N, d]``; attention packed (``mask`` None)
        or on the [R, Q] grid."""
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        N = x.shape[0]
        q = project(attn.q_proj, x).view(N, -1, self.head_dim)
        k = project(attn.k_proj, x).view(N, -1, self.head_dim)
        v = project(attn.v_proj, x).view(N, -1, self.head_dim)
        if hasattr(attn, "q_norm"):
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)  # [N, heads, hd]
        # write the new entries into the cache rows
        kc, vc = self.k[li], self.v[li]
        kc.view(-1, self.head_dim).index_copy_(0, dest, k.reshape(-1, self.head_dim))
        vc.view(-1, self.head_dim).index_copy_(0, dest, v.reshape(-1, self.head_dim))
        if mask is None:
            o = cpu_attention.varlen_attention(q, kc, vc, rows, apos, attn.scaling, total,
                                               self.attention_block).reshape(N, -1)
        else:
            R = grid.rows
            if gather is None:  # slots 0..R-1: views of the cache
                keys, vals = kc[:R, :, :total], vc[:R, :, :total]
            else:
                keys, vals = kc[gather, :, :total], vc[gather, :, :total]
            o = F.scaled_dot_product_attention(grid.unpack(q).transpose(1, 2), keys, vals, attn_mask=mask.unsqueeze(1),
                                               scale=attn.scaling, enable_gqa=self.n_heads != self.n_kv)
            o = grid.pack(o.transpose(1, 2)).reshape(N, -1)
        h = h + project(attn.o_proj, o)
        x = layer.post_attention_layernorm(h)
        return h + (_gated_mlp(layer.mlp, x) if self.gated_mlp else layer.mlp(x))


class _Grid:
    """Packed tokens [N, ...] <-> the [R, Q, ...] grid of rows padded to the longest.

    ``valid [R, Q]`` marks the real tokens, in row-major order; None means every cell is one
    (N = R * Q: packing is a reshape, which keeps CUDA graphs and ragged-free steps cheap)."""

    def __init__(self, rows: int, width: int, valid: torch.Tensor | None):
        self.rows, self.width, self.valid = rows, width, valid

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        if self.valid is None:
            return x.view(self.rows, self.width, *x.shape[1:])
        out = x.new_zeros(self.rows, self.width, *x.shape[1:])
        out[self.valid] = x
        return out

    @classmethod
    def of(cls, q_lens: torch.Tensor, width: int, device: torch.device) -> "_Grid":
        """The grid of rows of ``q_lens`` tokens each, ``width`` wide."""
        return cls(len(q_lens), width, None).sub(q_lens, device)

    def sub(self, q_lens: torch.Tensor, device: torch.device) -> "_Grid":
        """This grid's shape for rows of ``q_lens`` tokens each (valid None when all are full)."""
        valid = torch.arange(self.width).unsqueeze(0) < q_lens.unsqueeze(1)
        return _Grid(self.rows, self.width, None if bool(valid.all()) else valid.to(device))

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        if self.valid is None:
            return x.reshape(self.rows * self.width, *x.shape[2:])
        return x[self.valid]


def _is_gated_mlp(mlp: torch.nn.Module) -> bool:
    """The gated MLP layout of Llama / Qwen / Gemma (``_gated_mlp`` can run it)."""
    return all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn"))


def _gated_mlp(mlp: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``mlp(x)`` for a gated MLP, its projections through ``cpu_linear.project``."""
    return project(mlp.down_proj, mlp.act_fn(project(mlp.gate_proj, x)) * project(mlp.up_proj, x))
