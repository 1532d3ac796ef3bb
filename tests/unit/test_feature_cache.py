"""The on-disk feature cache: target stats derived from it, refusal of damaged files, and
training from a cache with and without the stats (tiny random target)."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from dspark.training.data import DataError, FeatureCache, write_feature_cache, write_target_stats
from dspark.training.trainer import train

from ..conftest import make_tiny_target, tiny_run_config
from .test_trainer_and_checkpoints import _records


def _cache(tmp_path, target, records):
    d = tmp_path / "run" / "data" / "features"
    write_feature_cache(target, records, d, batch_size=4)
    return d


def test_target_stats_are_the_log_normalizer_and_argmax_of_the_cached_hidden_states(tmp_path):
    target, records = make_tiny_target(), _records()
    d = _cache(tmp_path, target, records)
    assert not FeatureCache(d).has_target_stats
    before = json.loads((d / "manifest.json").read_text())
    m = write_target_stats(d, target.lm_head, rows_per_chunk=7)  # chunks that split records
    assert m["target_stats"]["bytes"] > 0 and m["bytes_total"] > before["bytes_total"]
    cache = FeatureCache(d)
    for i in (0, 5, len(records) - 1):
        _, last = cache.get(i)
        with torch.no_grad():
            logits = target.lm_head(last)
        lse, top = cache.target_stats(i)
        torch.testing.assert_close(lse, torch.logsumexp(logits, -1), atol=1e-5, rtol=1e-5)
        assert torch.equal(top, logits.argmax(-1))
    assert not list(d.glob("*.partial.npy"))


def test_truncated_target_stats_are_refused_by_name(tmp_path):
    target, records = make_tiny_target(), _records()
    d = _cache(tmp_path, target, records)
    write_target_stats(d, target.lm_head)
    np.save(d / "lse.npy", np.zeros(3, dtype=np.float32))
    with pytest.raises(DataError, match="target stats"):
        FeatureCache(d)


@pytest.mark.parametrize("algo", ["dspark", "eagle3"])
def test_training_from_a_cache_with_target_stats_gives_the_same_weights(tmp_path, algo):
    """With a draft vocabulary the stats replace the full LM head in the loss's target
    distribution; the trained weights agree with the run that computes it from the LM head."""
    target, records = make_tiny_target(), _records()
    weights = {}
    for stats in (False, True):
        cfg = tiny_run_config(algo)
        cfg.output_root, cfg.name = str(tmp_path / f"stats{stats}"), "run"
        cfg.data.features = "cache"
        cfg.target.draft_vocab = 24
        cfg.train.steps, cfg.train.save_every, cfg.train.batch_size, cfg.train.blocks_per_seq = 4, 4, 3, 4
        d = _cache(tmp_path / f"stats{stats}", target, records)
        if stats:
            write_target_stats(d, target.lm_head)
        assert FeatureCache(d).has_target_stats == stats
        weights[stats] = load_file(str(train(cfg, target, records, progress=False) / "model.safetensors"))
    for k in weights[False]:
        torch.testing.assert_close(weights[True][k], weights[False][k], atol=1e-4, rtol=1e-4, msg=k)
