"""SPS cost tables: how many engine steps per second the target runs at B batch tokens.

The prefix scheduler (``dspark.engine.scheduler``) maximises ``tau * SPS(B)``, so it needs
``SPS(B)`` for every batch-token count B it might choose. We profile the engine once at a
handful of token counts (``profile_sps``), store the result as a small JSON file, and
expand it to the dense array ``sps[0..N]`` the scheduler indexes (``SpsTable.as_tensor``).

File format (JSON object, UTF-8), format version 1::

    {
      "format": "dspark-sps",            # fixed marker
      "format_version": 1,               # refused if unknown
      "tokens": [1, 8, 64, 256],         # profiled batch-token counts, ints >= 1, strictly increasing
      "steps_per_s": [95.1, 94.0, 80.2, 41.7],  # measured steps/s at each count, finite, > 0
      "device": "NVIDIA H200",           # where it was measured
      "engine": "smollm2-135m bf16 graphs", # identity of the profiled engine (free text)
      "created_at": "2026-12-01T10:00:00+00:00",  # ISO 8601
      "meta": {"warmup": 3, "repeats": 10}, # optional: how it was profiled
      "draft_requests": [1, 4, 16, 64],  # optional: drafter pass timed at these batch sizes R
      "draft_seconds": [0.002, 0.002, 0.003, 0.006],  # optional: seconds of drafter work per drafted step at each R
      "draft_append_seconds": 2e-5,      # optional, with draft_*: seconds per context position appended to one row
      "batch_rows": [1, 16, 64],         # optional: steps timed at these row counts R (the batch's requests)
      "extra_tokens": [[0, 4, 8], [0, 8, 64], [0, 1, 8, 64]],  # with batch_rows: per R, drafts verified beyond R
      "rows_steps_per_s": [[95.0, 94.1, 93.9], [90.2, 89.0, 80.1], [70.3, 70.0, 66.2, 55.0]]  # steps/s at R + e
    }

The two optional ``draft_*`` keys (both or neither) give the cost of the drafter's own work
on a drafted step (``dspark.engine.bench.profile_draft_cost``: extending its context cache,
then the drafting pass), which runs before the verify step whenever the engine drafts. The
scheduler does not need it
(once drafts exist their cost is sunk); ``dspark.engine.draft_gate`` does, to decide whether
drafting pays at all on this hardware. ``draft_time(R)`` interpolates it like step time.
``draft_append_seconds`` (``profile_append_cost``) prices context the drafter must catch up
before it drafts: a row that the gate skipped for a while rebuilds its drafter cache from a
window of recent positions (``engine/proposers/neural.py``), and the gate's probe budget
counts that catch-up (``catchup_time``, 0 without the key).

The three optional ``batch_rows`` keys (all or none) say what a step costs by *rows and*
tokens: ``rows_steps_per_s[i][j]`` is the steps/s of a step of ``batch_rows[i]`` rows, each
verifying its anchor, that verifies ``extra_tokens[i][j]`` drafts more (in blocks of the
drafter's K on the first rows). The 1-D curve above is timed on rows of K+1 tokens, so its
64-token step is 8 rows; the engine's 64-token step is usually 64 rows of one token, which
costs more (a row's cache reads and per-row work), and a draft beside them costs more than
the curve's slope says: on a 2-core CPU the two differ by 40-60% at 64 rows. With the grid,
the schedulers and gates price a step of R rows by the curve of those rows
(``as_tensor(rows=R)``); without it, by the 1-D curve. ``dspark profile`` writes both.

Unknown keys are refused too (a misspelt key would otherwise be silently ignored).

Dense expansion (``as_tensor``), chosen on purpose:

- We work in step *time* ``1 / SPS``, which grows roughly linearly with tokens.
- Smoothing (default ``"isotonic"``): the profiled step times are replaced by their
  least-squares non-decreasing fit (pool-adjacent-violators), so SPS is monotone
  non-increasing. Timing noise is averaged rather than propagated (a running min/max
  would copy one outlier into every later/earlier point); real cliffs, which are drops
  in SPS, survive. ``"none"`` keeps the raw points (jagged tables, for experiments).
- Between profiled counts, step time is interpolated linearly. Below the first count it
  is held constant; above the last it grows in proportion to tokens (compute bound),
  a pessimistic guess: profile up to the largest batch you serve.
- ``sps[0]`` is unused by the scheduler (a batch always holds its R base tokens); it is
  set to ``sps[1]`` so the array has no holes.
- By rows (``as_tensor(rows=R)``, with the grid): entry B is a step of R rows and B tokens,
  ``t_R(B - R)``. Each profiled row count's curve is fitted convex in the extra tokens
  (``convex_from_start``): from the measured plain step, the price of one more draft never
  falls as drafts are added and is never negative, which is what the hardware does (a step
  goes from memory-bound to compute-bound as its tokens grow); timing noise or a tile size
  that makes one small extra count look free is pooled into its neighbours, so the first
  draft beside 64 rows is not priced at nothing. The fit is interpolated linearly between
  extra counts, past the last one along its last slope; between two profiled row counts the two curves are mixed linearly
  at the same extra count; past the largest row count the plain step grows in proportion to
  rows (pessimistic) and the drafts cost what they cost there. Entries below R hold ``t_R(0)``.

A table whose smoothed SPS hardly falls over the profiled range is refused with
``FlatCostTableError``: it would make every verify look free and only *look* profiled.
Typical causes are timing asynchronous GPU launches without a synchronise, or a token
range too narrow to reach the compute-bound region. ``allow_flat=True`` accepts it.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch

from dspark.training.jsonfile import read_json_file, write_json_file

__all__ = [
    "SPS_FORMAT",
    "SPS_FORMAT_VERSION",
    "SpsTableError",
    "FlatCostTableError",
    "SpsTable",
    "load_sps_table",
    "profile_sps",
    "time_interleaved",
    "SpsLike",
    "StepCosts",
    "dense_sps",
    "beside_prompt_sps",
    "seconds_at",
    "plot_sps",
    "isotonic_non_decreasing",
    "convex_from_start",
]

SPS_FORMAT = "dspark-sps"
SPS_FORMAT_VERSION = 1
DEFAULT_FLAT_RTOL = 0.02  # smoothed SPS must fall by at least 2% over the profiled range

_KEYS_REQUIRED = ("format", "format_version", "tokens", "steps_per_s", "device", "engine", "created_at")
_KEYS_OPTIONAL = ("meta", "draft_requests", "draft_seconds", "draft_append_seconds", "batch_rows", "extra_tokens",
                  "rows_steps_per_s")
_ROW_KEYS = ("batch_rows", "extra_tokens", "rows_steps_per_s")


class SpsTableError(ValueError):
    """An SPS table that cannot be used; the message names the file (or source) and the reason."""


class FlatCostTableError(SpsTableError):
    """The profile shows no cost growth with batch tokens, so it only looks profiled."""


def _now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def isotonic_non_decreasing(values: Sequence[float], weights: Sequence[float] | None = None) -> list[float]:
    """Least-squares non-decreasing fit of ``values`` (pool adjacent violators; equal weights
    unless ``weights`` are given)."""
    ws = [1.0] * len(values) if weights is None else [float(w) for w in weights]
    blocks: list[list[float]] = []  # [mean, weight, count]
    for v, w in zip(values, ws):
        blocks.append([float(v), w, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, n2 = blocks.pop()
            m1, w1, n1 = blocks.pop()
            blocks.append([(m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, n1 + n2])
    out: list[float] = []
    for mean, _, count in blocks:
        out.extend([mean] * count)
    return out


def convex_from_start(xs: Sequence[float], ts: Sequence[float]) -> list[float]:
    """``ts`` at ``xs`` refitted so that the slope between neighbours never falls and is never
    negative, from ``ts[0]``: the slopes' least-squares non-decreasing fit, each weighted by the
    interval it spans (a pooled stretch keeps its total rise), then clamped at 0."""
    slopes = [(t1 - t0) / (x1 - x0) for x0, x1, t0, t1 in zip(xs, xs[1:], ts, ts[1:])]
    fit = isotonic_non_decreasing(slopes, [x1 - x0 for x0, x1 in zip(xs, xs[1:])])
    out = [float(ts[0])]
    for x0, x1, slope in zip(xs, xs[1:], fit):
        out.append(out[-1] + max(slope, 0.0) * (x1 - x0))
    return out


@dataclass
class SpsTable:
    """A profiled steps-per-second curve of one engine on one device."""

    tokens: list[int]  # profiled batch-token counts, strictly increasing, >= 1
    steps_per_s: list[float]  # measured engine steps per second at each count, > 0
    device: str = "cpu"  # where it was measured
    engine: str = ""  # identity of the profiled engine (model, dtype, build options)
    created_at: str = field(default_factory=_now_iso)  # ISO 8601
    format_version: int = SPS_FORMAT_VERSION
    meta: dict[str, Any] = field(default_factory=dict)  # how it was profiled (warmup, repeats, ...)
    draft_requests: list[int] | None = None  # batch sizes R at which the drafter pass was timed
    draft_seconds: list[float] | None = None  # seconds per drafter pass at each of them
    draft_append_seconds: float | None = None  # seconds per context position appended to one row's drafter cache
    batch_rows: list[int] | None = None  # row counts R of the by-rows grid (module docstring)
    extra_tokens: list[list[int]] | None = None  # per R: drafts verified beyond the R anchors
    rows_steps_per_s: list[list[float]] | None = None  # per R: steps/s at each extra count
    source: str = field(default="<in-memory table>", repr=False, compare=False)  # for messages only

    def __post_init__(self) -> None:
        self.tokens = list(self.tokens)
        self.steps_per_s = list(self.steps_per_s)
        self._check_structure()

    # -- validation ---------------------------------------------------------------------

    def _fail(self, reason: str, cls: type[SpsTableError] = SpsTableError) -> None:
        raise cls(f"{self.source}: {reason}")

    def _check_structure(self) -> None:
        if self.format_version != SPS_FORMAT_VERSION:
            self._fail(f"unknown format_version {self.format_version!r} (this kit reads {SPS_FORMAT_VERSION})")
        if len(self.tokens) != len(self.steps_per_s):
            self._fail(f"'tokens' has {len(self.tokens)} entries but 'steps_per_s' has {len(self.steps_per_s)}")
        if len(self.tokens) < 2:
            self._fail(f"needs at least 2 profiled token counts, got {len(self.tokens)}")
        self._check_counts("tokens", self.tokens)
        self.steps_per_s = self._check_numbers("steps_per_s", self.steps_per_s, allow_zero=False)
        for name in ("device", "engine", "created_at"):
            if not isinstance(getattr(self, name), str):
                self._fail(f"'{name}' must be a string, got {getattr(self, name)!r}")
        if not isinstance(self.meta, dict):
            self._fail(f"'meta' must be an object, got {type(self.meta).__name__}")
        self._check_draft_cost()
        self._check_rows()

    def _check_rows(self) -> None:
        given = [getattr(self, k) is not None for k in _ROW_KEYS]
        if not any(given):
            return
        if not all(given):
            self._fail(f"{', '.join(repr(k) for k in _ROW_KEYS)} go together; "
                       f"missing {[k for k, g in zip(_ROW_KEYS, given) if not g]}")
        self.batch_rows = list(self.batch_rows)
        self._check_counts("batch_rows", self.batch_rows)
        n = len(self.batch_rows)
        if not (isinstance(self.extra_tokens, list) and isinstance(self.rows_steps_per_s, list)
                and len(self.extra_tokens) == n and len(self.rows_steps_per_s) == n):
            self._fail(f"'extra_tokens' and 'rows_steps_per_s' must be lists of {n} lists (one per batch_rows entry)")
        extras, rates = [], []
        for R, es, ss in zip(self.batch_rows, self.extra_tokens, self.rows_steps_per_s):
            if not (isinstance(es, list) and isinstance(ss, list)) or len(es) != len(ss) or len(es) < 2 or es[0] != 0:
                self._fail(f"rows {R}: 'extra_tokens' and 'rows_steps_per_s' need equal lists of >= 2 entries, "
                           f"extra tokens starting at 0; got {es!r} and {ss!r}")
            for e in es:
                if isinstance(e, bool) or not isinstance(e, int) or e < 0:
                    self._fail(f"rows {R}: 'extra_tokens' must be integers >= 0, got {e!r}")
            if any(b <= a for a, b in zip(es, es[1:])):
                self._fail(f"rows {R}: 'extra_tokens' must be strictly increasing, got {es}")
            extras.append(list(es))
            rates.append(self._check_numbers("rows_steps_per_s", ss, allow_zero=False))
        self.extra_tokens, self.rows_steps_per_s = extras, rates

    def set_rows_grid(self, batch_rows: list[int], extra_tokens: list[list[int]],
                      rows_steps_per_s: list[list[float]]) -> None:
        """Attach a by-rows grid (checked as a loaded one is)."""
        self.batch_rows, self.extra_tokens, self.rows_steps_per_s = batch_rows, extra_tokens, rows_steps_per_s
        self._check_rows()

    @property
    def has_rows(self) -> bool:
        """Whether the table prices steps by rows and tokens (the ``batch_rows`` grid)."""
        return self.batch_rows is not None

    def _check_draft_cost(self) -> None:
        if self.draft_requests is None and self.draft_seconds is None:
            if self.draft_append_seconds is not None:
                self._fail("'draft_append_seconds' needs 'draft_requests' and 'draft_seconds' (the drafter's pass)")
            return
        if self.draft_requests is None or self.draft_seconds is None:
            self._fail("'draft_requests' and 'draft_seconds' go together; one of them is missing")
        self.draft_requests, self.draft_seconds = list(self.draft_requests), list(self.draft_seconds)
        if not self.draft_requests or len(self.draft_requests) != len(self.draft_seconds):
            self._fail(f"'draft_requests' ({len(self.draft_requests)}) and 'draft_seconds' "
                       f"({len(self.draft_seconds)}) must be non-empty and of equal length")
        self._check_counts("draft_requests", self.draft_requests)
        self.draft_seconds = self._check_numbers("draft_seconds", self.draft_seconds, allow_zero=True)
        if self.draft_append_seconds is not None:
            self.draft_append_seconds = self._check_numbers("draft_append_seconds", [self.draft_append_seconds],
                                                            allow_zero=True)[0]

    def _check_counts(self, key: str, values: list) -> None:
        """``values`` are integers >= 1, strictly increasing (profiled token counts, batch sizes)."""
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                self._fail(f"'{key}' must be integers >= 1, got {v!r}")
        if any(b <= a for a, b in zip(values, values[1:])):
            self._fail(f"'{key}' must be strictly increasing, got {values}")

    def _check_numbers(self, key: str, values: list, allow_zero: bool) -> list[float]:
        """``values`` are finite numbers > 0 (>= 0 with ``allow_zero``) -> as floats."""
        for v in values:
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or v < 0 or (v == 0 and not allow_zero)):
                self._fail(f"'{key}' must be finite numbers {'>=' if allow_zero else '>'} 0, got {v!r}")
        return [float(v) for v in values]

    @property
    def has_draft_cost(self) -> bool:
        return self.draft_requests is not None

    def draft_time(self, requests: int) -> float:
        """Seconds of one drafter pass over ``requests`` rows: linear between profiled sizes,
        constant below the first, proportional to rows beyond the last (pessimistic)."""
        if not self.has_draft_cost:
            raise SpsTableError(f"{self.source}: no drafter cost profiled (draft_requests/draft_seconds)")
        xs, ts = self.draft_requests, self.draft_seconds
        if requests <= xs[0]:
            return ts[0]
        if requests >= xs[-1]:
            return ts[-1] * requests / xs[-1]
        i = next(k for k, x in enumerate(xs) if x >= requests)
        w = (requests - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ts[i - 1] + w * (ts[i] - ts[i - 1])

    def catchup_time(self, positions: int) -> float:
        """Seconds to append ``positions`` context positions (over any rows) to the drafter's
        cache: ``draft_append_seconds`` each, 0 for a table profiled without it."""
        return max(positions, 0) * (self.draft_append_seconds or 0.0)

    def smoothed_steps_per_s(self) -> list[float]:
        """SPS at the profiled counts after the isotonic fit of step time (non-increasing)."""
        times = isotonic_non_decreasing([1.0 / s for s in self.steps_per_s])
        return [1.0 / t for t in times]

    def check_profiled(self, flat_rtol: float = DEFAULT_FLAT_RTOL) -> None:
        """Raise FlatCostTableError unless smoothed SPS falls by > ``flat_rtol`` over the range."""
        fit = self.smoothed_steps_per_s()
        drop = 1.0 - fit[-1] / fit[0]
        if drop <= flat_rtol:
            self._fail(
                f"flat cost table: smoothed steps/s goes from {fit[0]:.4g} at {self.tokens[0]} tokens to "
                f"{fit[-1]:.4g} at {self.tokens[-1]} tokens (falls {100 * drop:.2f}% <= {100 * flat_rtol:.2f}%); "
                "was the step synchronised (sync=torch.cuda.synchronize) and the token range wide enough? "
                "pass allow_flat=True if the curve is real",
                FlatCostTableError,
            )

    # -- dense form for the scheduler -----------------------------------------------------

    def as_tensor(self, max_tokens: int | None = None, smooth: str = "isotonic", rows: int | None = None) -> torch.Tensor:
        """Dense ``sps[0..max_tokens]`` (float64, [max_tokens+1]) for the scheduler.

        ``max_tokens`` defaults to the largest profiled count. ``smooth`` is ``"isotonic"``
        (monotone non-increasing SPS, the default) or ``"none"``; see the module docstring.
        ``rows``: the steps of a batch of that many rows, from the by-rows grid where the table
        has one (else the 1-D curve, which does not depend on rows). ``StepCosts`` keeps them per R.
        """
        if max_tokens is None:
            max_tokens = self.tokens[-1]
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        if smooth not in ("isotonic", "none"):
            raise ValueError(f"smooth must be 'isotonic' or 'none', got {smooth!r}")
        if rows is not None and self.has_rows:
            if rows < 1:
                raise ValueError(f"rows must be >= 1, got {rows}")
            return self._dense_for_rows(rows, max_tokens, smooth)
        if smooth == "isotonic":
            sps = self.smoothed_steps_per_s()
        elif smooth == "none":
            sps = self.steps_per_s
        else:
            raise ValueError(f"smooth must be 'isotonic' or 'none', got {smooth!r}")
        xs = torch.tensor(self.tokens, dtype=torch.float64)
        ts = 1.0 / torch.tensor(sps, dtype=torch.float64)
        b = torch.arange(max_tokens + 1, dtype=torch.float64)
        # linear interpolation of step time; constant below the first count
        idx = torch.searchsorted(xs, b, right=True).clamp(1, xs.numel() - 1)
        x0, x1, t0, t1 = xs[idx - 1], xs[idx], ts[idx - 1], ts[idx]
        w = ((b - x0) / (x1 - x0)).clamp(0.0, 1.0)
        t = t0 + w * (t1 - t0)
        # beyond the last count: time proportional to tokens
        beyond = b > xs[-1]
        t = torch.where(beyond, ts[-1] * b / xs[-1], t)
        out = 1.0 / t
        out[0] = out[1]
        return out

    def _row_curve(self, i: int, extra: torch.Tensor, smooth: str) -> torch.Tensor:
        """Step seconds of profiled row count ``batch_rows[i]`` at ``extra`` drafts (float64)."""
        times = [1.0 / s for s in self.rows_steps_per_s[i]]
        if smooth == "isotonic":
            times = convex_from_start(self.extra_tokens[i], times)
        xs = torch.tensor(self.extra_tokens[i], dtype=torch.float64)
        ts = torch.tensor(times, dtype=torch.float64)
        idx = torch.searchsorted(xs, extra, right=True).clamp(1, xs.numel() - 1)
        x0, x1, t0, t1 = xs[idx - 1], xs[idx], ts[idx - 1], ts[idx]
        slope = ((t1 - t0) / (x1 - x0)).clamp(min=0.0)
        return t0 + slope * (extra - x0).clamp(min=0.0)  # past the last count: along the last slope

    def _dense_for_rows(self, rows: int, max_tokens: int, smooth: str) -> torch.Tensor:
        """``as_tensor(rows=rows)`` without the cache (see the module docstring)."""
        b = torch.arange(max_tokens + 1, dtype=torch.float64)
        extra = (b - rows).clamp(min=0.0)
        rs = self.batch_rows
        if rows <= rs[0]:
            t = self._row_curve(0, extra, smooth)
        elif rows >= rs[-1]:
            plain = self._row_curve(len(rs) - 1, torch.zeros(1, dtype=torch.float64), smooth)
            t = self._row_curve(len(rs) - 1, extra, smooth) + plain * (rows / rs[-1] - 1.0)
        else:
            i = next(k for k, r in enumerate(rs) if r >= rows)
            w = (rows - rs[i - 1]) / (rs[i] - rs[i - 1])
            t = (1.0 - w) * self._row_curve(i - 1, extra, smooth) + w * self._row_curve(i, extra, smooth)
        out = 1.0 / t
        out[0] = out[1]
        return out

    # -- JSON -----------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": SPS_FORMAT,
            "format_version": self.format_version,
            "tokens": list(self.tokens),
            "steps_per_s": list(self.steps_per_s),
            "device": self.device,
            "engine": self.engine,
            "created_at": self.created_at,
            "meta": dict(self.meta),
            **({"draft_requests": list(self.draft_requests), "draft_seconds": list(self.draft_seconds)}
               if self.has_draft_cost else {}),
            **({"draft_append_seconds": self.draft_append_seconds} if self.draft_append_seconds is not None else {}),
            **({"batch_rows": list(self.batch_rows), "extra_tokens": [list(e) for e in self.extra_tokens],
                "rows_steps_per_s": [list(s) for s in self.rows_steps_per_s]} if self.has_rows else {}),
        }

    @classmethod
    def from_dict(cls, data: Any, source: str = "<dict>", allow_flat: bool = False,
                  flat_rtol: float = DEFAULT_FLAT_RTOL) -> "SpsTable":
        """Build and check a table from parsed JSON; raises SpsTableError naming ``source``."""
        if not isinstance(data, dict):
            raise SpsTableError(f"{source}: expected a JSON object, got {type(data).__name__}")
        found = sorted(data)
        missing = [k for k in _KEYS_REQUIRED if k not in data]
        if missing:
            raise SpsTableError(f"{source}: missing key(s) {missing} (found keys: {found})")
        unknown = [k for k in data if k not in _KEYS_REQUIRED + _KEYS_OPTIONAL]
        if unknown:
            raise SpsTableError(f"{source}: unknown key(s) {sorted(unknown)} (found keys: {found})")
        if data["format"] != SPS_FORMAT:
            raise SpsTableError(f"{source}: 'format' is {data['format']!r}, expected {SPS_FORMAT!r}")
        for key in ("tokens", "steps_per_s"):
            if not isinstance(data[key], list):
                raise SpsTableError(f"{source}: '{key}' must be a list, got {type(data[key]).__name__}")
        table = cls(tokens=data["tokens"], steps_per_s=data["steps_per_s"], device=data["device"],
                    engine=data["engine"], created_at=data["created_at"],
                    format_version=data["format_version"], meta=data.get("meta", {}),
                    draft_requests=data.get("draft_requests"), draft_seconds=data.get("draft_seconds"),
                    draft_append_seconds=data.get("draft_append_seconds"), batch_rows=data.get("batch_rows"),
                    extra_tokens=data.get("extra_tokens"), rows_steps_per_s=data.get("rows_steps_per_s"),
                    source=source)
        if not allow_flat:
            table.check_profiled(flat_rtol)
        return table

    def save(self, path: str | Path) -> Path:
        """Write the table as JSON (see the module docstring for the schema)."""
        return write_json_file(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path, allow_flat: bool = False, flat_rtol: float = DEFAULT_FLAT_RTOL) -> "SpsTable":
        """Read and check a table; raises SpsTableError / FlatCostTableError naming the file."""
        path = Path(path)
        data = read_json_file(path, "SPS table", SpsTableError)
        return cls.from_dict(data, source=str(path), allow_flat=allow_flat, flat_rtol=flat_rtol)


def load_sps_table(path: str | Path, allow_flat: bool = False) -> SpsTable:
    """Shorthand for ``SpsTable.load``."""
    return SpsTable.load(path, allow_flat=allow_flat)


def profile_sps(
    step_fn: Callable[[int], None],
    token_counts: Iterable[int],
    warmup: int = 3,
    repeats: int = 10,
    *,
    sync: Callable[[], None] | None = None,
    device: str = "cpu",
    engine: str = "",
    progress: bool = True,
    allow_flat: bool = False,
    flat_rtol: float = DEFAULT_FLAT_RTOL,
    timer: Callable[[], float] = time.perf_counter,
) -> SpsTable:
    """Time ``step_fn(B)`` (one engine step at B batch tokens) for each B in ``token_counts``.

    Per count ``warmup`` untimed calls (e.g. graph capture); then ``repeats`` sweeps over all
    counts, each sweep starting one count further along, and the table stores ``1 / median``
    of each count's times. Interleaving matters on a shared or throttling host: timed one
    count after another, a slow minute would land on a few neighbouring counts and bend the
    curve the scheduler trades against (a flat stretch reads as free verify tokens); spread
    over sweeps, it lands on every count alike. For GPU engines pass
    ``sync=torch.cuda.synchronize`` so that each timed call includes the device work (it is
    called before the clock stops). Raises FlatCostTableError rather than return a table
    that only looks profiled.
    """
    counts = sorted(set(int(b) for b in token_counts))
    if len(counts) < 2 or counts[0] < 1:
        raise ValueError(f"token_counts needs at least 2 distinct counts >= 1, got {counts}")
    medians = time_interleaved(step_fn, counts, warmup, repeats, sync=sync, progress=progress, desc="profiling SPS",
                               timer=timer)
    sps: list[float] = []
    for b in counts:
        if not medians[b] > 0:
            raise SpsTableError(f"<profile of {engine or 'engine'}>: step at {b} tokens timed {medians[b]!r} s")
        sps.append(1.0 / medians[b])
    table = SpsTable(tokens=counts, steps_per_s=sps, device=device, engine=engine,
                     meta={"warmup": warmup, "repeats": repeats, "statistic": "median", "order": "interleaved sweeps"},
                     source=f"<profile of {engine or 'engine'} on {device}>")
    if not allow_flat:
        table.check_profiled(flat_rtol)
    return table


SpsLike = Any  # torch.Tensor [N+1] | SpsTable | sequence of floats


def dense_sps(sps: SpsLike, max_tokens: int | None = None) -> torch.Tensor:
    """Dense steps/s array [N+1] (float64, CPU); index = batch tokens, entry 0 unused.

    An ``SpsTable`` is expanded up to ``max_tokens`` (default: its largest profiled count);
    batches past the end of the array are never scheduled.
    """
    if isinstance(sps, SpsTable):
        sps = sps.as_tensor(max_tokens)
    elif max_tokens is not None:
        raise ValueError("max_tokens applies only to an SpsTable; slice a dense sps array yourself")
    t = torch.as_tensor(sps, dtype=torch.float64).detach().cpu().reshape(-1)
    if t.numel() < 2:
        raise ValueError(f"sps must cover at least batch size 1 (length >= 2), got length {t.numel()}")
    if not bool((torch.isfinite(t[1:]) & (t[1:] >= 0)).all()):
        raise ValueError("sps entries must be finite and >= 0")
    return t


def seconds_at(sps: torch.Tensor | Sequence[float], tokens: int) -> float:
    """Seconds of a step of ``tokens`` tokens by a dense steps/s array (a tensor or, on a host hot
    path, its ``tolist()``); past its end a step's time grows in proportion to its tokens, as it
    does where a step is compute bound (the end of a table is its largest profiled step)."""
    n = len(sps) - 1
    if tokens <= n:
        return 1.0 / float(sps[tokens])
    return tokens / (n * float(sps[n]))


def beside_prompt_sps(sps: torch.Tensor, rows: int, prompt_tokens: int) -> torch.Tensor:
    """The dense steps/s array a scheduler reads for a step of ``rows`` rows whose target pass also
    carries ``prompt_tokens`` prompt tokens (fused prefill): entry b is ``1 / (t(R) + t(b + P) -
    t(R + P))``. The prompt's own time is left out, since it is paid whatever is drafted, so an
    accepted token is worth what it is worth in a step of the rows alone; drafts cost what they
    add to the longer pass, where the step is further into its compute-bound slope."""
    if prompt_tokens <= 0:
        return sps
    n = sps.numel() - 1
    rates = sps.double()
    at = torch.arange(n + 1, dtype=torch.long) + prompt_tokens
    inside = at <= n
    later = torch.empty(n + 1, dtype=torch.float64)  # t(b + P) for every b, by seconds_at's rule
    later[inside] = 1.0 / rates[at[inside]]
    later[~inside] = at[~inside].double() / (n * float(rates[n]))
    seconds = later + (seconds_at(sps, rows) - seconds_at(sps, rows + prompt_tokens))
    out = 1.0 / seconds.clamp_min(1e-12)
    out[0] = 0.0
    return out


class StepCosts:
    """Dense steps/s arrays ``[N+1]`` for a batch of R rows (``costs(R)``): an ``SpsTable``'s curve
    for R rows where it has the by-rows grid, else one array for every R (a table's 1-D curve,
    a dense array or a sequence), expanded up to ``max_tokens`` (a table's default: its largest
    profiled count). Arrays are built once per R. ``costs(R, prompt_tokens=P)`` prices a step
    whose target pass also carries P prompt tokens (``beside_prompt_sps``): its drafts cost what
    they add to the longer pass."""

    def __init__(self, sps: SpsLike, max_tokens: int | None = None) -> None:
        if isinstance(sps, StepCosts):
            if max_tokens is not None:
                raise ValueError("max_tokens applies to an SpsTable, not to StepCosts")
            self.table, self.max_tokens, self._flat = sps.table, sps.max_tokens, sps._flat
        elif isinstance(sps, SpsTable) and sps.has_rows:
            self.table, self.max_tokens, self._flat = sps, max_tokens or sps.tokens[-1], None
        else:
            self.table, self.max_tokens, self._flat = None, max_tokens, dense_sps(sps, max_tokens)
        self._by_rows: dict[int, torch.Tensor] = {}

    @property
    def by_rows(self) -> bool:
        """Whether the price of a step depends on its rows (a by-rows grid)."""
        return self._flat is None

    def __call__(self, rows: int, prompt_tokens: int = 0) -> torch.Tensor:
        if self._flat is not None:
            t = self._flat
        else:
            t = self._by_rows.get(rows)
            if t is None:
                t = self._by_rows[rows] = dense_sps(self.table.as_tensor(self.max_tokens, rows=max(rows, 1)))
        return beside_prompt_sps(t, rows, prompt_tokens)


def time_interleaved(step_fn: Callable[[Any], None], keys: Sequence[Any], warmup: int, repeats: int, *,
                     sync: Callable[[], None] | None = None, progress: bool = True, desc: str = "profiling",
                     timer: Callable[[], float] = time.perf_counter) -> dict[Any, float]:
    """Median seconds of ``step_fn(key)`` per key: ``warmup`` untimed calls per key, then
    ``repeats`` sweeps over all keys, each starting one key further along (``profile_sps``
    says why); ``sync`` runs before each clock stop."""
    from tqdm.auto import tqdm

    keys = list(keys)
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got warmup={warmup} repeats={repeats}")
    for key in keys:
        for _ in range(warmup):
            step_fn(key)
        if sync is not None:
            sync()
    times: dict[Any, list[float]] = {key: [] for key in keys}
    with tqdm(total=repeats * len(keys), desc=desc, unit="step", disable=not progress) as bar:
        for sweep in range(repeats):
            k = sweep % len(keys)
            for key in keys[k:] + keys[:k]:
                t0 = timer()
                step_fn(key)
                if sync is not None:
                    sync()
                times[key].append(timer() - t0)
                bar.update()
    return {key: statistics.median(ts) for key, ts in times.items()}


def plot_sps(table: SpsTable, path: str | Path, max_tokens: int | None = None) -> Path:
    """Plot profiled points, the dense curve the scheduler uses, and tokens/s; with a by-rows grid,
    a second panel: each row count's step time against the drafts it verifies. Save to ``path``."""
    # a bare Figure on the Agg canvas: no pyplot state, no global backend switch
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    dense = table.as_tensor(max_tokens)
    b = torch.arange(dense.numel())
    panels = 2 if table.has_rows else 1
    fig = Figure(figsize=(7 * panels, 4.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, panels, 1)
    ax.plot(b[1:].numpy(), dense[1:].numpy(), color="C0", label="scheduler SPS (smoothed, interpolated)")
    ax.scatter(table.tokens, table.steps_per_s, color="C1", s=18, zorder=3, label="profiled")
    ax.set_xlabel("batch tokens B")
    ax.set_ylabel("steps / s")
    ax2 = ax.twinx()
    ax2.plot(b[1:].numpy(), (b[1:] * dense[1:]).numpy(), color="C2", linestyle="--", label="tokens / s")
    ax2.set_ylabel("tokens / s")
    lines = ax.get_legend_handles_labels()
    lines2 = ax2.get_legend_handles_labels()
    ax.legend(lines[0] + lines2[0], lines[1] + lines2[1], loc="best", fontsize=8)
    ax.set_title(f"SPS: {table.engine or 'engine'} on {table.device}", fontsize=10)
    if table.has_rows:
        ax3 = fig.add_subplot(1, 2, 2)
        for i, R in enumerate(table.batch_rows):
            extra = torch.arange(table.extra_tokens[i][-1] + 1)
            ax3.plot(extra.numpy(), (1000.0 / table.as_tensor(R + extra[-1].item(), rows=R)[R:]).numpy(),
                     color=f"C{i % 10}", label=f"{R} rows")
            ax3.scatter(table.extra_tokens[i], [1000.0 / s for s in table.rows_steps_per_s[i]], color=f"C{i % 10}", s=12)
        ax3.set_xscale("symlog", linthresh=1)
        ax3.set_xlabel("drafts verified beyond the rows' anchors")
        ax3.set_ylabel("ms / step")
        ax3.legend(fontsize=8)
        ax3.set_title("steps by rows (scheduler curves, profiled points)", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    return path
