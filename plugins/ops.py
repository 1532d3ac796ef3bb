"""The verify step and the prefix scheduler as CUDA ops, with the reference's signatures.

``verify()`` and ``schedule_prefix()`` below take exactly the arguments of
``dspark.plugins.reference`` and return the same types. On CUDA tensors they run the
kernels of ``plugins/csrc`` (built on first use with ``torch.utils.cpp_extension.load`` for
the current GPU's architecture plus PTX, once, cached by torch afterwards); anywhere
else, or when the build is impossible, they run the reference and log a notice once.

What the kernel path guarantees against the reference:

- greedy rows (temperature 0): bit-identical ``num_accepted`` / ``output_tokens``;
- sampled rows: the same output distribution (lossless rejection sampling), from a
  different random stream (Philox4x32-10 keyed by ``(seed[r], offset[r])``), reproducible
  for a fixed seed and offset on the same device;
- rows with top-k (``0 < top_k < V``) or top-p (``top_p < 1``) are computed by the
  reference (one host sync to find them) and merged into the kernel's result;
- the scheduler: bit-identical lengths for ``R * K <= SCHEDULE_MAX_CANDIDATES``
  (``plugins/contract.py``; larger batches use the reference).

Differences (no host sync is spent on argument values; see docs/plugins.md): out-of-range
``verify_lens`` are clamped to ``[0, K]`` instead of raising, and ``draft_probs=None`` with
sampled rows verifies those rows as deterministic (one-hot) drafts, the exact rule for a
drafter that proposes without sampling, where the reference raises.

Example (greedy, K=2, V=3) on any device::

    >>> import torch
    >>> from dspark.plugins import ops
    >>> logits = torch.tensor([[[0., 0., 5.], [5., 0., 0.], [0., 5., 0.]]])
    >>> res = ops.verify(torch.tensor([[2, 1]]), None, logits, torch.tensor([2]), torch.tensor([0.0]))
    >>> res.num_accepted.tolist(), res.output_tokens.tolist()
    ([1], [[2, 0, -1]])
"""
from __future__ import annotations

import hashlib
import logging
import threading
from pathlib import Path

import torch

from . import reference
from .contract import SCHEDULE_MAX_CANDIDATES, kernel_define_flags
from .reference import VerifyResult

__all__ = ["verify", "schedule_prefix", "extension_available", "load_extension", "SCHEDULE_MAX_CANDIDATES"]

log = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("verify_torch.cpp", "verify.cu", "schedule.cu")  # headers: common/verify/schedule.cuh, dspark_kernels.h

_lock = threading.Lock()
_state: dict[str, object] = {"loaded": False, "error": None}
_noticed: set[str] = set()


def _notice_once(key: str, message: str) -> None:
    if key not in _noticed:
        _noticed.add(key)
        log.info(message)


def _arch_flags() -> list[str]:
    """-gencode flags for the current GPU (SASS) plus PTX of the same compute capability."""
    major, minor = torch.cuda.get_device_capability()
    cc = f"{major}{minor}"
    return [f"-gencode=arch=compute_{cc},code=sm_{cc}", f"-gencode=arch=compute_{cc},code=compute_{cc}"]


def _sources_digest() -> str:
    """Short hash of every file in csrc/ (headers included) and of the contract's defines:
    a changed header or limit means a new build."""
    h = hashlib.sha256(" ".join(kernel_define_flags()).encode())
    for path in sorted(CSRC.iterdir()):
        if path.is_file():
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:10]


def load_extension(verbose: bool = False) -> bool:
    """Build (first call only) and load the CUDA extension; True when ``torch.ops.dspark`` is ready."""
    with _lock:
        if _state["loaded"]:
            return True
        if _state["error"] is not None:
            return False
        if not torch.cuda.is_available():
            _state["error"] = "no CUDA device"
            return False
        try:
            from torch.utils.cpp_extension import load

            from .build_lock import build_directory, exclusive_build

            name = f"dspark_verify_ext_{_sources_digest()}"
            directory = build_directory(name)
            with exclusive_build(directory):
                load(
                    name=name,
                    build_directory=str(directory),
                    sources=[str(CSRC / s) for s in SOURCES],
                    extra_include_paths=[str(CSRC)],
                    extra_cflags=["-O3", *kernel_define_flags()],
                    extra_cuda_cflags=["-O3", *kernel_define_flags(), *_arch_flags()],
                    is_python_module=False,
                    verbose=verbose,
                )
            _state["loaded"] = True
            log.info("dspark CUDA extension loaded (%s)", ", ".join(SOURCES))
            return True
        except Exception as exc:  # build tools missing, compiler error, ...
            _state["error"] = f"{type(exc).__name__}: {exc}"
            log.warning("dspark CUDA extension unavailable, using the reference: %s", _state["error"])
            return False


def extension_available() -> bool:
    """True when the CUDA ops can be used (builds the extension on the first call)."""
    return load_extension()


def _use_kernel(t: torch.Tensor, what: str) -> bool:
    if t.is_cuda and load_extension():
        return True
    reason = "tensors are not on a CUDA device" if not t.is_cuda else f"extension unavailable ({_state['error']})"
    _notice_once(f"{what}:{reason}", f"dspark.plugins.ops.{what}: running the PyTorch reference ({reason})")
    return False


def _filtered_rows(top_k: torch.Tensor | None, top_p: torch.Tensor | None, V: int, R: int,
                   device: torch.device) -> torch.Tensor:
    """Indices of rows whose top-k / top-p filter is active (these go to the reference). [n]"""
    active = torch.zeros(R, dtype=torch.bool, device=device)
    if top_k is not None:
        k = top_k.to(device)
        active |= (k > 0) & (k < V)
    if top_p is not None:
        active |= top_p.to(device) < 1.0
    return active.nonzero().flatten()


def verify(
    draft_tokens: torch.Tensor,  # [R, K] int64
    draft_probs: torch.Tensor | None,  # [R, K, V] float, probabilities the drafts were sampled from
    target_logits: torch.Tensor,  # [R, K+1, V] float (fp32 / fp16 / bf16)
    verify_lens: torch.Tensor,  # [R] int64 in [0, K]
    temperature: torch.Tensor,  # [R] float, 0 = greedy
    top_k: torch.Tensor | None = None,  # [R] int64, 0 = off
    top_p: torch.Tensor | None = None,  # [R] float, 1.0 = off
    seed: torch.Tensor | None = None,  # [R] int64
    offset: torch.Tensor | None = None,  # [R] int64 (e.g. the request's step counter)
) -> VerifyResult:
    """Lossless speculative verification; same contract as ``reference.verify``.

    Returns ``VerifyResult(num_accepted [R], output_tokens [R, K+1] (-1 padded),
    num_emitted [R])``, all int64 on the logits' device. ``draft_probs`` None means one-hot
    drafts (the reference accepts None only when every row is greedy).
    """
    if not _use_kernel(target_logits, "verify"):
        return reference.verify(draft_tokens, draft_probs, target_logits, verify_lens, temperature,
                                top_k, top_p, seed, offset)
    R, K, V = reference.check_verify_shapes(draft_tokens, target_logits, verify_lens, draft_probs,
                                            check_range=False)
    device = target_logits.device
    temperature = temperature.to(device, torch.float32)
    seed = torch.zeros(R, dtype=torch.long, device=device) if seed is None else seed.to(device)
    offset = torch.zeros(R, dtype=torch.long, device=device) if offset is None else offset.to(device)

    num_accepted, output_tokens, num_emitted = torch.ops.dspark.verify(
        draft_tokens.to(device), draft_probs, target_logits, verify_lens.to(device), temperature, seed, offset)

    if top_k is not None or top_p is not None:
        rows = _filtered_rows(top_k, top_p, V, R, device)
        if rows.numel() > 0:
            _notice_once("verify:topk", "dspark.plugins.ops.verify: top-k/top-p rows run on the PyTorch reference")
            sub = reference.verify(
                draft_tokens[rows], None if draft_probs is None else draft_probs[rows], target_logits[rows],
                verify_lens[rows.to(verify_lens.device)].to(device), temperature[rows],
                None if top_k is None else top_k.to(device)[rows], None if top_p is None else top_p.to(device)[rows],
                seed[rows], offset[rows])
            num_accepted[rows] = sub.num_accepted
            output_tokens[rows] = sub.output_tokens
            num_emitted[rows] = sub.num_emitted
    return VerifyResult(num_accepted=num_accepted, output_tokens=output_tokens, num_emitted=num_emitted)


def schedule_prefix(
    confidence: torch.Tensor,  # [R, K] per-position confidences c in [0, 1]
    sps: torch.Tensor,  # [N+1] steps/s indexed by batch tokens B (sps[0] unused)
    max_lens: torch.Tensor | None = None,  # [R] int, cap per request
    early_stop: bool = True,
) -> torch.Tensor:
    """Report Algorithm 1 (see ``reference.schedule_prefix``): verify lengths [R] int64.

    Bit-identical to the reference; on CUDA with ``R * K <= SCHEDULE_MAX_CANDIDATES`` it is
    one kernel launch with no host sync.
    """
    R, K = confidence.shape
    if R * K > SCHEDULE_MAX_CANDIDATES or not _use_kernel(confidence, "schedule_prefix"):
        return reference.schedule_prefix(confidence, sps, max_lens, early_stop)
    device = confidence.device
    return torch.ops.dspark.schedule_prefix(
        confidence, sps.to(device), None if max_lens is None else max_lens.to(device), early_stop)
