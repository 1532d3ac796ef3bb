"""Algorithms are data (configs/algos/*.yaml) plus one immutable registry (training/algorithms.py)."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dspark.training import algorithms
from dspark.training.config import ConfigError, list_profiles, load_algo, load_run_config
from dspark.training.models import build_drafter, drafter_config_for
from dspark.training.trainer import train

from ..conftest import make_tiny_target, tiny_run_config

ROOT = Path(__file__).resolve().parents[2]


def test_every_bundled_profile_resolves_to_a_registered_algorithm_of_its_kind():
    assert set(list_profiles("algos")) == set(algorithms.REGISTRY.names())
    for name in list_profiles("algos"):
        profile = load_algo(name)
        entry = algorithms.algorithm(profile.algo)
        assert entry.name == name and entry.kind == profile.kind, f"configs/algos/{name}.yaml vs its registry entry"
        entry.check(profile)
        assert algorithms.from_profile(profile) == entry, "a profile alone gives its registry entry"


def test_the_registry_is_immutable_refuses_duplicates_and_names_the_known_algorithms():
    reg = algorithms.REGISTRY
    with pytest.raises(ValueError, match="registered twice"):
        reg.with_entries(algorithms.for_kind("dspark", "block"))
    with pytest.raises(ConfigError, match="unknown algorithm 'medusa'; known: dspark, dflash, eagle3"):
        reg.get("medusa")
    with pytest.raises(dataclasses.FrozenInstanceError):
        reg.get("dspark").kind = "autoregressive"
    with pytest.raises(TypeError):
        reg._by_name["medusa"] = reg.get("dspark")
    with pytest.raises(ValueError, match="unknown export formats"):
        dataclasses.replace(reg.get("dspark"), exports=("gguf",))
    assert "medusa" not in reg and reg.names() == ("dspark", "dflash", "eagle3")


def test_dflash_with_a_markov_head_is_built_as_configured():
    """A switched-on feature is never dropped by the algorithm's name: DFlash with the vanilla head
    is a block drafter with that head, and its drafts read it."""
    cfg = load_run_config(None, ["algo=dflash", "algo.markov_head=vanilla"])
    assert (cfg.algo.algo, cfg.algo.markov_head, cfg.algo.confidence_head) == ("dflash", "vanilla", False)
    target = make_tiny_target()
    run = tiny_run_config("dflash")
    run.algo.markov_head = "vanilla"
    d = build_drafter(drafter_config_for(run, target), target).eval()
    assert d.markov is not None and d.confidence is None and d.cfg.markov_head == "vanilla"
    plain = tiny_run_config("dflash")
    assert build_drafter(drafter_config_for(plain, target), target).markov is None


@pytest.mark.parametrize("override", ["algo.markov_head=vanilla", "algo.confidence_head=true"])
def test_a_feature_the_kind_cannot_carry_is_refused_with_the_fix(override):
    with pytest.raises(ConfigError, match=r"eagle3 \(autoregressive\) drafters have no Markov or confidence head; "
                                          r"set algo.markov_head=none algo.confidence_head=false"):
        load_run_config(None, ["algo=eagle3", override])
    run = tiny_run_config("eagle3")
    key, value = override.split("=")
    setattr(run.algo, key.split(".")[1], value if value != "true" else True)
    with pytest.raises(ConfigError, match="no Markov or confidence head"):
        drafter_config_for(run, make_tiny_target())


def test_a_profile_of_another_kind_than_its_algorithm_is_refused():
    with pytest.raises(ConfigError, match="algo.kind='autoregressive', but dflash drafters are 'block'"):
        load_run_config(None, ["algo=dflash", "algo.kind=autoregressive"])


def test_a_target_of_another_family_than_its_profile_is_refused():
    target = make_tiny_target("qwen3")
    drafter_config_for(tiny_run_config(), target)  # the tiny qwen3 target's profile says qwen3
    target.profile = dataclasses.replace(target.profile, family="llama")
    with pytest.raises(ConfigError, match="is for the 'llama' family, but its model is a 'qwen3'"):
        drafter_config_for(tiny_run_config(), target)


def _records():
    from dspark.training.data import Record
    return [Record(prompt_ids=[1, 3 + i, 4], answer_ids=[(5 + 3 * i + 7 * j) % 60 + 3 for j in range(20)])
            for i in range(4)]


def test_an_algorithm_added_as_one_yaml_and_one_entry_trains_exports_and_drafts_like_the_original(
        tmp_path, monkeypatch):
    """docs/algorithms.md's claim, checked: DFlash re-added under another name from its YAML alone
    (a copy of configs/algos/dflash.yaml and the entry that profile describes) trains to the same
    weights, builds the same engine and drafts the same tokens as the bundled dflash."""
    from dspark.engine.export.builder import build_engine
    from dspark.training.checkpoint import load_checkpoint

    raw = yaml.safe_load((ROOT / "configs" / "algos" / "dflash.yaml").read_text())
    raw["algo"] = "dflash_again"
    profile_path = tmp_path / "dflash_again.yaml"
    profile_path.write_text(yaml.safe_dump(raw))
    entry = algorithms.from_profile(load_algo(str(profile_path)))
    monkeypatch.setattr(algorithms, "REGISTRY", algorithms.REGISTRY.with_entries(entry))

    target = make_tiny_target()
    ckpts, engines = {}, {}
    for name, ref in (("dflash", "dflash"), ("dflash_again", str(profile_path))):
        cfg = load_run_config(None, [f"algo={ref}", f"output_root={tmp_path}", f"name={name}", "train.steps=3",
                                     "train.batch_size=2", "train.save_every=3", "data.features=online"])
        cfg.target = tiny_run_config().target
        ckpts[name] = train(cfg, target, _records(), progress=False)
        engines[name] = build_engine(drafter_dir=ckpts[name], output=tmp_path / f"eng-{name}", target=target,
                                     max_batch=2)
    a = load_file(str(ckpts["dflash"] / "model.safetensors"))
    b = load_file(str(ckpts["dflash_again"] / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "same profile, same weights"
    assert engines["dflash_again"]["drafter"]["algo"] == "dflash_again"
    assert {k: v.get("status", "built") for k, v in engines["dflash_again"]["built"].items()} == \
        {k: v.get("status", "built") for k, v in engines["dflash"]["built"].items()}
    assert (tmp_path / "eng-dflash_again" / "onnx" / "dspark_draft.onnx").is_file()
    assert (tmp_path / "eng-dflash_again" / "hf" / "model.safetensors").read_bytes() == \
        (tmp_path / "eng-dflash" / "hf" / "model.safetensors").read_bytes()
    drafts = {}
    for name, ck in ckpts.items():
        d, _, _ = load_checkpoint(ck, target)
        from dspark.engine.draft_runner import make_draft_runner
        runner = make_draft_runner(d.eval(), max_slots=1)
        aux = target.features(torch.tensor([[1, 3, 4, 9, 12]])).aux[0]
        runner.append([(0, aux, torch.zeros(5, dtype=torch.long))])
        drafts[name] = runner.propose([0], torch.tensor([12]), torch.zeros(1)).tokens
    assert torch.equal(drafts["dflash"], drafts["dflash_again"])


def test_no_code_outside_the_registry_compares_algorithm_names():
    """What an algorithm does is its registry entry or its profile, never an ``algo ==`` check."""
    check = re.compile(r"(?<!for )\b(cfg\.|dcfg\.|\.)?algo(\.algo)?\b\s*(==|!=|\bnot in\b|\bin\b)\s*[(\[{\"']")
    hits = []
    for top in ("training", "engine", "dspark"):
        for path in (ROOT / top).rglob("*.py"):
            if path.name == "algorithms.py" and path.parent.name == "training":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if check.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert hits == []
