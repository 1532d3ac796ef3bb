"""Trainer resume determinism and checkpoint validation (tiny random target, online features)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file

from dspark.training.checkpoint import CheckpointError, load_checkpoint
from dspark.training.config import ConfigError, load_run_config
from dspark.training.data import Record
from dspark.training.trainer import train

from ..conftest import make_tiny_target, tiny_run_config


def _records(n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        p = torch.randint(6, 64, (int(torch.randint(4, 10, (1,), generator=g)),), generator=g).tolist()
        a = torch.randint(6, 64, (int(torch.randint(10, 20, (1,), generator=g)),), generator=g).tolist()
        out.append(Record(p, a))
    return out


def _cfg(tmp_path, algo, name, steps, save_every):
    cfg = tiny_run_config(algo)
    cfg.output_root, cfg.name = str(tmp_path), name
    cfg.data.features = "online"
    cfg.train.steps, cfg.train.save_every, cfg.train.batch_size, cfg.train.blocks_per_seq = steps, save_every, 3, 4
    cfg.train.warmup_steps = 2
    return cfg


@pytest.mark.parametrize("algo,draft_vocab", [("dspark", 0), ("eagle3", 0), ("dspark", 24), ("eagle3", 24)])
def test_resuming_after_interruption_gives_the_same_weights(tmp_path, algo, draft_vocab):
    target, records = make_tiny_target(), _records()
    full_cfg = _cfg(tmp_path, algo, "full", 6, 6)
    full_cfg.target.draft_vocab = draft_vocab
    full = train(full_cfg, target, records, progress=False)
    part_cfg = _cfg(tmp_path, algo, "part", 6, 100)
    part_cfg.target.draft_vocab = draft_vocab
    train(part_cfg, target, records, progress=False, stop_after=3)  # interrupted after 3 steps
    resumed = train(part_cfg, target, records, progress=False)
    a, b = load_file(str(full / "model.safetensors")), load_file(str(resumed / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=f"{k} differs after resume")


def test_a_draft_vocabulary_is_chosen_from_the_training_records_only(tmp_path):
    from dspark.training.draft_vocab import choose_draft_vocab

    target, records = make_tiny_target(), _records()
    cfg = _cfg(tmp_path, "dspark", "dv", 2, 2)
    cfg.target.draft_vocab = 20
    loaded, dcfg, _ = load_checkpoint(train(cfg, target, records, progress=False), target)
    n_train = int(len(records) * (1 - cfg.data.holdout_fraction))
    want = choose_draft_vocab([r.answer_ids for r in records[:n_train]], [r.prompt_ids for r in records[:n_train]],
                              20, target.vocab_size)
    assert dcfg.draft_vocab_size == 20 and loaded.draft_ids.tolist() == want.tolist()
    assert want.tolist() != choose_draft_vocab([r.answer_ids for r in records], [r.prompt_ids for r in records],
                                               20, target.vocab_size).tolist()  # the held-out tail would change it


def test_heldout_estimates_are_logged_without_changing_the_training(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    target, records = make_tiny_target(), _records()
    plain = train(_cfg(tmp_path, "dspark", "plain", 4, 4), target, records, progress=False)
    cfg = _cfg(tmp_path, "dspark", "val", 4, 4)
    cfg.train.eval_every = 2
    watched = train(cfg, target, records, progress=False)
    a, b = load_file(str(plain / "model.safetensors")), load_file(str(watched / "model.safetensors"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=f"{k}: evaluating changed the training")
    ea = EventAccumulator(str(cfg.run_dir / "tb"))
    ea.Reload()
    est = [e.value for e in ea.Scalars("val/accept_len_est")]
    assert [e.step for e in ea.Scalars("val/accept_len_est")] == [2, 4]
    assert all(1.0 <= v <= 1.0 + cfg.target.block_size for v in est)
    assert 0.0 <= ea.Scalars("val/top1_match/pos1")[-1].value <= 1.0


def test_training_reduces_the_loss(tmp_path, monkeypatch):
    target, records = make_tiny_target(), _records(6)
    cfg = _cfg(tmp_path, "dspark", "fit", 40, 40)
    cfg.train.lr = 3e-3
    from dspark.training import algorithms
    losses = []
    orig = algorithms.algorithm("dspark").loss_step

    def spy(*a, **k):
        t = orig(*a, **k)
        losses.append(t.total.item())
        return t
    # the loss step is the registry entry's: spy on it there
    monkeypatch.setattr(algorithms, "REGISTRY", algorithms.Registry(tuple(
        dataclasses.replace(a, loss_step=spy) if a.name == "dspark" else a for a in algorithms.REGISTRY)))
    train(cfg, target, records, progress=False)
    assert sum(losses[-5:]) / 5 < 0.8 * sum(losses[:5]) / 5


def test_checkpoint_for_another_target_is_refused_with_the_field_named(tmp_path):
    target, records = make_tiny_target(), _records(4)
    ckpt = train(_cfg(tmp_path, "dspark", "c", 1, 1), target, records, progress=False)
    meta = json.loads((ckpt / "drafter.json").read_text())
    meta["target"]["vocab_size"] = 151936
    (ckpt / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="vocab_size"):
        load_checkpoint(ckpt, target)


def test_truncated_or_corrupt_checkpoint_gives_a_one_line_error(tmp_path):
    target, records = make_tiny_target(), _records(4)
    ckpt = train(_cfg(tmp_path, "dspark", "t", 1, 1), target, records, progress=False)
    w = ckpt / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated"):
        load_checkpoint(ckpt, target)
    (ckpt / "drafter.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(ckpt, target)


def test_checkpoint_of_another_architecture_is_refused(tmp_path):
    target, records = make_tiny_target(), _records(4)
    ckpt = train(_cfg(tmp_path, "dflash", "d", 1, 1), target, records, progress=False)
    meta = json.loads((ckpt / "drafter.json").read_text())
    meta["drafter"]["algo"] = "dspark"
    meta["drafter"]["markov_head"] = "vanilla"
    (ckpt / "drafter.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match="tensor names"):
        load_checkpoint(ckpt, target)


def test_config_rejects_unknown_keys_and_wrong_types():
    with pytest.raises(ConfigError, match="unknown config key 'train.stepz'"):
        load_run_config("quickstart", ["train.stepz=3"])
    with pytest.raises(ConfigError, match="train.steps: expected an integer"):
        load_run_config("quickstart", ["train.steps=abc"])
    with pytest.raises(ConfigError, match="no target profile 'nope'"):
        load_run_config("quickstart", ["target=nope"])
    cfg = load_run_config("quickstart", ["algo=dflash", "target.block_size=5"])
    assert cfg.algo.algo == "dflash" and cfg.target.block_size == 5 and cfg.target.layer_ids == [1, 8, 15, 22, 28]


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen3-4b", "qwen3-8b", "qwen3-14b", "gemma3-270m"])
def test_every_bundled_target_profile_resolves(name):
    cfg = load_run_config("quickstart", [f"target={name}"])
    assert cfg.target.name == name and cfg.target.layer_ids


def test_equal_time_budget_plans_steps_once_per_run(tmp_path):
    from dspark.engine.train_compare import plan_steps
    cfg = _cfg(tmp_path, "dspark", "budget", 6, 6)
    plan = plan_steps(cfg, None, 120.0, lambda c, t: 0.5)
    assert plan == {"budget_seconds": 120.0, "seconds_per_step": 0.5, "steps": 240}

    def must_not_probe(c, t):
        raise AssertionError("a planned run is not probed again")
    assert plan_steps(cfg, None, 120.0, must_not_probe)["steps"] == 240  # a rerun resumes the same plan
    with pytest.raises(RuntimeError, match="plans 120.0 s, not 60.0 s"):
        plan_steps(cfg, None, 60.0, must_not_probe)
    assert plan_steps(_cfg(tmp_path, "dspark", "slow", 6, 6), None, 1.0, lambda c, t: 10.0)["steps"] == 3  # > warmup


@pytest.mark.parametrize("algo", ["dspark", "eagle3"])
def test_step_probe_times_a_real_optimizer_step_without_touching_the_run(tmp_path, algo):
    from dspark.training.trainer import seconds_per_step
    cfg = _cfg(tmp_path, algo, "probe", 6, 6)
    data = cfg.run_dir / "data"
    data.mkdir(parents=True)
    (data / "records.jsonl").write_text("".join(
        json.dumps({"prompt_ids": r.prompt_ids, "answer_ids": r.answer_ids}) + "\n" for r in _records()))
    assert seconds_per_step(cfg, make_tiny_target(), probe_steps=2) > 0
    assert not (cfg.run_dir / "checkpoints").exists()


def test_optional_number_config_accepts_null():
    assert load_run_config("quickstart", ["train.budget_seconds=600"]).train.budget_seconds == 600.0
    assert load_run_config("quickstart", ["train.budget_seconds=null"]).train.budget_seconds is None
    with pytest.raises(ConfigError, match="train.budget_seconds: expected a number"):
        load_run_config("quickstart", ["train.budget_seconds=soon"])


def test_eagle3_keeps_one_layer_while_block_drafters_take_the_profiles_depth(tiny_target):
    from dspark.training.models import build_drafter, drafter_config_for
    depth = {}
    for algo in ("dspark", "dflash", "eagle3"):
        cfg = tiny_run_config(algo)
        cfg.target.draft_layers = 3
        depth[algo] = len(build_drafter(drafter_config_for(cfg, tiny_target), tiny_target).layers)
    assert depth == {"dspark": 3, "dflash": 3, "eagle3": 1}  # the report's arrangement
    assert load_run_config("quickstart", ["algo=eagle3"]).algo.draft_layers == 1
    assert load_run_config("quickstart", ["algo=eagle3", "algo.draft_layers=2"]).algo.draft_layers == 2
    with pytest.raises(ConfigError, match="algo.draft_layers must be >= 1"):
        load_run_config("quickstart", ["algo.draft_layers=0"])
    with pytest.raises(ConfigError, match="draft_layers must be >= 1, got 0"):
        load_run_config("quickstart", ["target.draft_layers=0"])


def test_float_config_accepts_exponent_without_a_dot():
    # YAML 1.1 reads `3e-3` as a string; a learning rate written that way must still work
    assert load_run_config("quickstart", ["train.lr=3e-3"]).train.lr == pytest.approx(0.003)


def test_bench_train_refuses_an_unknown_drafter_before_any_work(tmp_path):
    from dspark.cli import main
    with pytest.raises(SystemExit, match="--algos: expected a comma list of dspark, dflash, eagle3; got 'dspark,medusa'"):
        main(["bench-train", "--algos", "dspark,medusa", f"output_root={tmp_path}", "--output-dir", str(tmp_path)])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_draft_layers_can_start_from_the_targets_top_layers(model_type):
    from dspark.training.trainer import new_drafter

    target, records = make_tiny_target(model_type), _records()
    cfg = tiny_run_config("dspark")
    cfg.target.family = model_type
    cfg.train.init_layers = "target"
    drafter = new_drafter(cfg, target, records, len(records))
    src = target.layers[-1]
    torch.testing.assert_close(drafter.layers[0].q_proj.weight, src.self_attn.q_proj.weight, rtol=0, atol=0)
    torch.testing.assert_close(drafter.layers[0].mlp.down_proj.weight, src.mlp.down_proj.weight, rtol=0, atol=0)
    if model_type == "qwen3":
        torch.testing.assert_close(drafter.layers[0].k_norm.weight, src.self_attn.k_norm.weight, rtol=0, atol=0)
    cfg.train.init_layers = "random"
    fresh = new_drafter(cfg, target, records, len(records))
    assert not torch.equal(fresh.layers[0].q_proj.weight, src.self_attn.q_proj.weight)
    with pytest.raises(ConfigError, match="init_layers"):
        load_run_config(None, ["train.init_layers=pretrained"])


def test_copying_more_draft_layers_than_the_target_has_is_refused():
    from dspark.training.models.layers import copy_target_layers

    target = make_tiny_target()
    with pytest.raises(ValueError, match="4-layer target"):
        copy_target_layers(torch.nn.ModuleList([torch.nn.Linear(1, 1)] * 5), target.layers)


def test_comparison_keeps_finished_drafters_when_a_later_one_fails(tmp_path, monkeypatch):
    """bench-train writes its report after every drafter: hours of training survive a late crash."""
    import dspark.engine.evaluate as evaluate_mod
    import dspark.training.data as data_mod
    import dspark.training.target as target_mod
    import dspark.training.trainer as trainer_mod
    from dspark.engine.train_compare import run_comparison

    cfg = _cfg(tmp_path, "dspark", "cmp", 3, 3)
    data = cfg.run_dir / "data"
    data.mkdir(parents=True)
    (data / "records.jsonl").write_text("".join(
        json.dumps({"prompt_ids": r.prompt_ids, "answer_ids": r.answer_ids}) + "\n" for r in _records()))
    target = make_tiny_target()
    monkeypatch.setattr(target_mod, "load_target", lambda *a, **k: target)
    monkeypatch.setattr(data_mod, "prepare_data", lambda *a, **k: None)  # the records above are the data
    real_train = trainer_mod.train

    def train_or_crash(c, t, **kw):
        if c.algo.algo == "dflash":
            raise RuntimeError("killed mid-run")
        return real_train(c, t, **kw)
    monkeypatch.setattr(trainer_mod, "train", train_or_crash)
    # the tiny target has no tokenizer for the eval prompts: one row per drafter stands in for evaluate()
    monkeypatch.setattr(evaluate_mod, "evaluate", lambda t, drafter, *a, **k: [
        {"drafter": drafter.cfg.algo, "task": "overall", "temperature": 0.0, "accept_len": 1.0,
         "accept_rate_at_k": [0.0], "rounds": 1, "samples": 1}])
    out = tmp_path / "docs"
    with pytest.raises(RuntimeError, match="killed mid-run"):
        run_comparison(cfg, out, "dspark bench-train", ("dspark", "dflash"))
    report = json.loads((out / "train_compare.json").read_text())
    assert [r["drafter"] for r in report["results"]] == ["dspark"]
    assert report["budget"]["draft_layers"] == {"dspark": 1}  # the snapshot taken after DSpark
    assert (out / "train_compare.md").is_file() and (out / "train_compare.png").is_file()


def test_a_resume_under_other_settings_is_refused_naming_them(tmp_path):
    """Resuming promises one uninterrupted run's result: a changed recipe or architecture is an
    error, while cadence settings (checkpoint, logging, evaluation) may change."""
    from dspark.training.recipe import ResumeMismatch
    target, records = make_tiny_target(), _records()
    cfg = _cfg(tmp_path, "dspark", "resume", 6, 100)
    train(cfg, target, records, progress=False, stop_after=2)
    for key, value in (("lr", 5e-3), ("steps", 8)):
        changed = _cfg(tmp_path, "dspark", "resume", 6, 100)
        setattr(changed.train, key, value)
        with pytest.raises(ResumeMismatch, match=rf"train\.{key}: .* -> {value!r}.*new run name"):
            train(changed, target, records, progress=False)
    deeper = _cfg(tmp_path, "dspark", "resume", 6, 100)
    deeper.target.draft_layers = 2
    with pytest.raises(ResumeMismatch, match=r"drafter\.num_layers: 1 -> 2"):
        train(deeper, target, records, progress=False)
    lossy = _cfg(tmp_path, "dspark", "resume", 6, 100)
    lossy.algo.loss.l1_weight = 0.5
    with pytest.raises(ResumeMismatch, match=r"algo\.loss\.l1_weight"):
        train(lossy, target, records, progress=False)
    same = _cfg(tmp_path, "dspark", "resume", 6, 3)  # only the checkpoint cadence differs
    same.train.log_every = 1
    assert load_checkpoint(train(same, target, records, progress=False), target)[2]["step"] == 6
