"""The drafter trainer: ``dspark train -c run.yaml [key=value ...]``.

Single process on CPU or GPU, or under ``torchrun --nproc_per_node N`` (DDP, or FSDP with
``train.distributed=fsdp``; gloo on CPU, nccl on GPU), unchanged. Every random choice of
step ``s`` (batch order, anchors) is derived from ``(seed, s)``, so a run resumed from a
checkpoint continues exactly as the uninterrupted run would have.
"""
from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from .checkpoint import load_checkpoint, read_meta, save_checkpoint
from .config import RunConfig
from .data import FeatureCache, Record, iterate_batches, read_records
from .draft_vocab import choose_draft_vocab
from .loss import LossTerms
from .loss_steps import Batch, LossStep, target_at  # noqa: F401  (target_at: the trainer's public helpers)
from .markov_init import init_markov_from_bigrams
from .algorithms import algorithm
from .models import build_drafter, drafter_config_for
from .models.layers import copy_target_layers
from .recipe import check_resume, training_recipe

log = logging.getLogger(__name__)
MAX_TRAIN_TOKENS = 512


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        if dist.is_initialized() and torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Linear warmup then cosine decay to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / max(warmup, 1)
    progress = min((step - warmup) / max(total - warmup, 1), 1.0)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def collate(records: list[Record], idx: list[int], target, cache: FeatureCache | None, device) -> Batch:
    recs = [records[i] for i in idx]
    lens = [min(len(r.ids), MAX_TRAIN_TOKENS) for r in recs]
    T = max(lens)
    tokens = torch.zeros(len(recs), T, dtype=torch.long)
    for j, r in enumerate(recs):
        tokens[j, : lens[j]] = torch.tensor(r.ids[: lens[j]])
    lengths = torch.tensor(lens)
    prompt_lens = torch.tensor([len(r.prompt_ids) for r in recs])
    lse = top = None
    if cache is not None:
        aux = torch.zeros(len(recs), T, cache.manifest["aux_dim"])
        last = torch.zeros(len(recs), T, cache.manifest["last_dim"])
        if cache.has_target_stats:
            lse, top = torch.zeros(len(recs), T), torch.zeros(len(recs), T, dtype=torch.long)
        for j, i in enumerate(idx):
            a, l_ = cache.get(i)
            aux[j, : lens[j]], last[j, : lens[j]] = a[: lens[j]], l_[: lens[j]]
            if lse is not None:
                s_, t_ = cache.target_stats(i)
                lse[j, : lens[j]], top[j, : lens[j]] = s_[: lens[j]], t_[: lens[j]]
    else:
        mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
        f = target.features(tokens.to(device), mask.long().to(device))
        aux, last = f.aux, f.last
    return Batch(tokens.to(device), aux.to(device), last.to(device), lengths.to(device), prompt_lens.to(device),
                 None if lse is None else lse.to(device), None if top is None else top.to(device))


def new_drafter(cfg: RunConfig, target, records: list[Record], n_train: int) -> nn.Module:
    """A fresh drafter; with ``target.draft_vocab`` its vocabulary comes from the training records."""
    drafter = build_drafter(drafter_config_for(cfg, target), target)
    if cfg.train.init_layers == "target":
        ids = copy_target_layers(drafter.layers, target.layers)
        log.info("draft layers start from target layers %s", ids)
    train = records[:n_train]
    if drafter.cfg.draft_vocab_size:
        drafter.set_draft_vocab(choose_draft_vocab((r.answer_ids for r in train), (r.prompt_ids for r in train),
                                                   drafter.cfg.draft_vocab_size, target.vocab_size))
    if cfg.algo.markov_init == "bigram" and drafter.markov is not None:
        # the pairs the head predicts: (last prompt token, first answer token), then within answers
        init_markov_from_bigrams(drafter, (r.prompt_ids[-1:] + r.answer_ids for r in train))
    return drafter


class _TrainForward(nn.Module):
    """Routes DDP/FSDP's forward() to the drafter's training forward."""

    def __init__(self, drafter: nn.Module):
        super().__init__()
        self.drafter = drafter

    def forward(self, *args):
        return self.drafter.forward_train(*args)


def train_count(n_records: int, holdout_fraction: float) -> int:
    """How many of a run's records are trained on: the first ones; the rest (the last
    ``holdout_fraction``) are held out for estimates and STS calibration (engine/calibrate.py)."""
    return max(1, int(n_records * (1 - holdout_fraction)))


def _training_data(cfg: RunConfig, target, records: list[Record] | None = None
                   ) -> tuple[list[Record], int, FeatureCache | None]:
    """The run's records (all but the held-out tail are trained on) and its feature cache, if any."""
    data_dir = cfg.run_dir / "data"
    records = records if records is not None else read_records(data_dir / "records.jsonl")
    if not records:
        raise RuntimeError(f"no training records in {data_dir}: run `dspark prepare-data` first")
    n_train = train_count(len(records), cfg.data.holdout_fraction)
    cache = FeatureCache(data_dir / "features", expect_target=target.identity()) if cfg.data.features == "cache" else None
    return records, n_train, cache


def _optimizer(params: list[nn.Parameter], cfg: RunConfig):
    """AdamW with linear warmup then cosine decay over ``cfg.train.steps``."""
    opt = torch.optim.AdamW(params, lr=cfg.train.lr, weight_decay=cfg.train.weight_decay, betas=(0.9, 0.95))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.train.warmup_steps, cfg.train.steps, cfg.train.min_lr_ratio))
    return opt, sched


@dataclass
class _Session:
    """What one training process steps with, set up once (``_session``) for ``train`` and
    ``seconds_per_step`` alike."""
    drafter: nn.Module  # the drafter itself (saved, evaluated)
    model: nn.Module  # its training forward, wrapped once: DDP / FSDP under torchrun
    params: list[nn.Parameter]
    opt: torch.optim.Optimizer
    sched: Any  # the learning-rate schedule (LambdaLR)
    step_fn: LossStep  # the algorithm's loss step (training/algorithms.py)
    autocast: Any  # the autocast context the forward runs in (off in float32)

    def optimize(self, batch: Batch, cfg: RunConfig, gen: torch.Generator) -> tuple[LossTerms, torch.Tensor]:
        """One optimizer step: loss, backward, clip, update. Returns the loss terms and the grad norm."""
        with self.autocast:
            terms = self.step_fn(self.model, self.drafter, batch, cfg, gen)
        self.opt.zero_grad(set_to_none=True)
        terms.total.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(self.params, cfg.train.grad_clip)
        self.opt.step()
        self.sched.step()
        return terms, gnorm


def _session(cfg: RunConfig, drafter: nn.Module, device: torch.device, dtype: torch.dtype, world: int) -> _Session:
    """Move the drafter to ``device`` in training mode, wrap its training forward once (DDP or
    FSDP when ``world`` > 1), and build the optimizer and the algorithm's loss step."""
    drafter = drafter.to(device=device)
    drafter.train()
    model: nn.Module = _TrainForward(drafter)
    if world > 1:
        if cfg.train.distributed == "fsdp":
            from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
            model = FSDP(model, use_orig_params=True)
        else:
            from torch.nn.parallel import DistributedDataParallel as DDP
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, sched = _optimizer(params, cfg)
    return _Session(drafter, model, params, opt, sched, algorithm(drafter.cfg.algo).loss_step,
                    torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32))


@torch.no_grad()
def heldout_estimates(run: _Session, records: list[Record], holdout: range, target, cache: FeatureCache | None,
                      cfg: RunConfig, device: torch.device) -> dict[str, float | list[float]] | None:
    """Teacher-forced acceptance estimates on the held-out records, per draft position.

    ``top1``: agreement of the drafter's argmax with the target's (the greedy acceptance rate);
    ``accept_est``: mean ``c*`` (the T=1 acceptance rate); ``accept_len_est``:
    ``1 + sum_k prod_{i<=k} accept_est_i``. Anchors are seeded per batch, so evaluations at
    different steps see the same blocks; the training RNG is not touched. None if nothing is
    held out. Every rank must call it (FSDP's forward is collective).
    """
    if len(holdout) == 0:
        return None
    bs = cfg.train.batch_size
    top1, est = [], []  # per batch, weighted by its number of records
    run.drafter.eval()
    try:
        for j in range(0, len(holdout), bs):
            idx = list(holdout[j:j + bs])
            batch = collate(records, idx, target, cache, device)
            with run.autocast:
                terms = run.step_fn(run.model, run.drafter, batch, cfg, torch.Generator().manual_seed(j))
            top1.append(terms.top1_match.float().cpu() * len(idx))
            est.append(terms.accept_est.float().cpu() * len(idx))
    finally:
        run.drafter.train()
    top1, est = torch.stack(top1).sum(0) / len(holdout), torch.stack(est).sum(0) / len(holdout)
    return {"top1": top1.tolist(), "accept_est": est.tolist(),
            "accept_len_est": 1.0 + float(torch.cumprod(est, 0).sum())}


def seconds_per_step(cfg: RunConfig, target, probe_steps: int = 20) -> float:
    """Time this run's optimizer step on this machine: a throwaway drafter, warm-up steps (one on
    the CPU, five on CUDA), then the mean of ``probe_steps`` timed steps. Used to give drafters
    equal training time; other work on the machine during the probe skews the plan (the report
    keeps real times). On CUDA the first bf16 steps of an architecture are several times slower
    than the rest (library set-up, allocator growth, kernel choice per new shape), so one warm-up
    step is too few there (train_compare_h200.md).

    The mean, not the median: a step's time grows with its batch's longest record, so step
    times are skewed to the right and a run lasts steps x mean. Five steps and their median gave
    two drafters of a 720 s budget 884 s and 805 s (docs/benchmarks/train_compare.md)."""
    import statistics
    import time

    device = resolve_device(cfg.train.device)
    records, n_train, cache = _training_data(cfg, target)
    run = _session(cfg, new_drafter(cfg, target, records, n_train), device,
                   resolve_dtype(cfg.train.dtype, device), world=1)
    batches = iterate_batches(n_train, cfg.train.batch_size, cfg.train.seed)
    warmup = 5 if device.type == "cuda" else 1
    times = []
    for step in range(probe_steps + warmup):
        t0 = time.perf_counter()
        batch = collate(records, next(batches), target, cache, device)
        run.optimize(batch, cfg, torch.Generator().manual_seed(step))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.fmean(times[warmup:])


def _log_step(writer, step: int, terms: LossTerms, lr: float, gnorm: float) -> None:
    """A training batch's loss terms and per-position estimates (noisy: one small batch)."""
    for name in ("total", "ce", "l1", "conf"):
        writer.add_scalar(f"loss/{name}", getattr(terms, name).item(), step)
    writer.add_scalar("train/lr", lr, step)
    writer.add_scalar("train/grad_norm", gnorm, step)
    for k, (a, t) in enumerate(zip(terms.accept_est.tolist(), terms.top1_match.tolist()), start=1):
        writer.add_scalar(f"accept_est/pos{k}", a, step)
        writer.add_scalar(f"top1_match/pos{k}", t, step)


def _log_heldout(writer, step: int, val: dict) -> None:
    writer.add_scalar("val/accept_len_est", val["accept_len_est"], step)
    for k, (a, t) in enumerate(zip(val["accept_est"], val["top1"]), start=1):
        writer.add_scalar(f"val/accept_est/pos{k}", a, step)
        writer.add_scalar(f"val/top1_match/pos{k}", t, step)
    log.info("step %d: held-out accept_len_est %.3f, top1 by position %s", step,
             val["accept_len_est"], " ".join(f"{t:.2f}" for t in val["top1"]))


def _setup_distributed() -> tuple[int, int]:
    if "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def train(cfg: RunConfig, target=None, records: list[Record] | None = None, progress: bool = True,
          stop_after: int | None = None) -> Path:
    """Train a drafter; returns the latest checkpoint directory. Resumes from ``<run>/checkpoints/last``.

    ``stop_after`` ends this invocation after that many steps (a time-boxed job; the next
    call resumes where it stopped and ends exactly as one uninterrupted run).
    """
    from torch.utils.tensorboard import SummaryWriter

    from .target import load_target

    rank, world = _setup_distributed()
    device = resolve_device(cfg.train.device)
    dtype = resolve_dtype(cfg.train.dtype, device)
    torch.manual_seed(cfg.train.seed)
    target = target or load_target(cfg.target, device=device)
    run_dir = cfg.run_dir
    records, n_train, cache = _training_data(cfg, target, records)

    dcfg = drafter_config_for(cfg, target)
    recipe = training_recipe(cfg, dcfg)
    ckpt_dir = run_dir / "checkpoints"
    last_ckpt = ckpt_dir / "last"
    start_step = 0
    train_state = None
    if (last_ckpt / "drafter.json").is_file():
        drafter, dcfg, meta = load_checkpoint(last_ckpt, target)
        start_step = meta["step"]
        train_state = torch.load(last_ckpt / "train_state.pt", weights_only=False)
        if "recipe" in train_state:
            check_resume(train_state["recipe"], recipe, str(last_ckpt))
        elif rank == 0:
            log.warning("%s records no training recipe (an older kit): resuming without checking the settings",
                        last_ckpt)
        if rank == 0:
            log.info("resuming from %s at step %d", last_ckpt, start_step)
    else:
        drafter = new_drafter(cfg, target, records, n_train)
    run = _session(cfg, drafter, device, dtype, world)
    drafter, opt, sched = run.drafter, run.opt, run.sched
    total = cfg.train.steps
    if train_state is not None:
        opt.load_state_dict(train_state["optimizer"])
        sched.load_state_dict(train_state["scheduler"])

    def save(step: int) -> None:
        save_checkpoint(last_ckpt, drafter, dcfg, target.identity(), step,
                        {"optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "recipe": recipe})

    writer = SummaryWriter(str(run_dir / "tb")) if rank == 0 else None
    batches = iterate_batches(n_train, cfg.train.batch_size * world, cfg.train.seed, start_step)
    bar = tqdm(range(start_step, total), initial=start_step, total=total, desc=f"train {dcfg.algo}",
               disable=not progress or rank != 0, unit="step")
    val = None  # the latest held-out estimates (train.eval_every), shown on the progress bar
    for step in bar:
        if stop_after is not None and step - start_step >= stop_after:
            if rank == 0:
                save(step)
            break
        idx = next(batches)
        idx = idx[rank::world] or idx[:1]
        batch = collate(records, idx, target, cache, device)
        gen = torch.Generator().manual_seed(cfg.train.seed * 1_000_003 + step * world + rank)
        terms, gnorm = run.optimize(batch, cfg, gen)
        if writer is not None and (step % cfg.train.log_every == 0 or step == total - 1):
            _log_step(writer, step, terms, sched.get_last_lr()[0], float(gnorm))
            shown = {"loss": f"{terms.total.item():.3f}", "acc1": f"{terms.accept_est[0].item():.2f}"}
            if val is not None:
                shown["val_accept_len"] = f"{val['accept_len_est']:.3f}"
            bar.set_postfix(shown)
        done = step + 1
        if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == total):
            val = heldout_estimates(run, records, range(n_train, len(records)), target, cache, cfg, device)
            if writer is not None and val is not None:
                _log_heldout(writer, done, val)
        if rank == 0 and (done % cfg.train.save_every == 0 or done == total):
            save(done)
    if writer is not None:
        writer.close()
    if dist.is_initialized():
        dist.barrier()
    if rank == 0 and start_step >= total and not (last_ckpt / "drafter.json").is_file():
        raise RuntimeError("nothing trained")
    read_meta(last_ckpt)
    return last_ckpt
