"""Two gloo processes train one drafter with DDP: gradients are synchronised, ranks agree."""
from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import dspark.training.trainer as trainer

from ..conftest import make_tiny_target, tiny_run_config
from .test_trainer_and_checkpoints import _records


def _worker(rank: int, world: int, out_dir: str, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    target = make_tiny_target()
    cfg = tiny_run_config("dspark")
    cfg.output_root, cfg.name = out_dir, "ddp"
    cfg.data.features = "online"
    cfg.train.steps, cfg.train.save_every, cfg.train.batch_size, cfg.train.blocks_per_seq = 4, 4, 2, 4
    built = []
    orig = trainer.build_drafter

    def capture(*a, **k):
        built.append(orig(*a, **k))
        torch.save({n: p.detach().clone() for n, p in built[0].state_dict().items()}, os.path.join(out_dir, f"init{rank}.pt"))
        return built[0]
    trainer.build_drafter = capture
    try:
        trainer.train(cfg, target, _records(), progress=False)
    finally:
        trainer.build_drafter = orig
    torch.save({n: p.detach().clone() for n, p in built[0].state_dict().items()}, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_with_two_gloo_processes_keeps_ranks_in_sync(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_worker, args=(2, str(tmp_path), port), nprocs=2, join=True)
    r0, r1 = torch.load(tmp_path / "rank0.pt"), torch.load(tmp_path / "rank1.pt")
    init = torch.load(tmp_path / "init0.pt")
    for k in r0:
        torch.testing.assert_close(r0[k], r1[k], rtol=0, atol=0, msg=f"ranks disagree on {k} after DDP training")
    assert any(not torch.equal(r0[k], init[k]) for k in r0), "training must change the weights"
    assert (tmp_path / "ddp" / "checkpoints" / "last" / "model.safetensors").is_file(), "rank 0 writes the checkpoint"
