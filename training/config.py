"""Typed run configuration: a target profile + an algorithm + run settings + dotted overrides.

Profiles live as YAML data under ``configs/`` (installed as ``dspark.configs``):
``targets/<name>.yaml`` (layer ids, mask token, defaults), ``algos/<algo>.yaml``,
``runs/<name>.yaml``. A run file names a target and an algo; ``key.sub=value`` overrides
are type-checked against the dataclasses below and unknown keys are rejected.
"""
from __future__ import annotations

import dataclasses
import importlib.resources
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


# decoder-layer styles of a drafter (training/models/layers.py holds what each means)
LAYER_STYLES = ("qwen3", "llama", "target")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says which key and why."""


@dataclass
class TargetProfile:
    name: str = "smollm2-135m"
    family: str = "llama"  # the target's model family: a model of another family is refused (models.check_target_family)
    source: str | None = "embedded:smollm2"  # local HF dir, a .gguf file, or embedded:<name>
    layer_ids: list[int] = field(default_factory=lambda: [1, 8, 15, 22, 28])
    mask_token_id: int = 16
    stop_token_ids: list[int] = field(default_factory=list)
    block_size: int = 7
    draft_layers: int = 1
    markov_rank: int = 128
    draft_vocab: int = 0  # drafters predict over this many frequent target ids; 0 = all (training/draft_vocab.py)
    # decoder-layer style of new drafters (training/models/layers.py): qwen3 (per-head q/k RMSNorm,
    # the layer vLLM's and TensorRT-LLM's DSpark loaders build) | llama | target (the family's own)
    layer_style: str = "qwen3"


@dataclass
class LossConfig:
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    conf_weight: float = 1.0
    gamma: float = 4.0
    ttt_steps: int = 7  # eagle3
    step_decay: float = 0.8  # eagle3


@dataclass
class AlgoConfig:
    algo: str = "dspark"  # a registered algorithm (training/algorithms.py): dspark | dflash | eagle3
    # the drafter kind (block | autoregressive); must be the registered algorithm's
    kind: str = "block"
    markov_head: str = "vanilla"  # vanilla | rnn | none (block drafters)
    confidence_head: bool = True  # block drafters
    # the vanilla Markov head starts at zero (DFlash behaviour), or as the training answers'
    # bigram table (training/markov_init.py)
    markov_init: str = "zero"  # zero | bigram
    # draft layers for this algorithm; None = the target profile's ``draft_layers``. The report
    # gives Eagle3 one layer and the block drafters five: eagle3.yaml pins 1
    draft_layers: int | None = None
    # decoder-layer style for this algorithm; None = the target profile's ``layer_style``.
    # eagle3.yaml pins llama: the EAGLE-3 midlayer vLLM and SGLang load has no q/k norm
    layer_style: str | None = None
    loss: LossConfig = field(default_factory=LossConfig)


@dataclass
class DataConfig:
    sources: list[str] = field(default_factory=lambda: ["gsm8k", "mbpp", "chat"])
    data_root: str | None = None  # folder holding gsm8k/, mbpp/, chat/, eval/; default: the kit's data/ ($DSPARK_DATA overrides)
    max_prompts: int = 240
    max_prompt_tokens: int = 256
    max_new_tokens: int = 160
    gen_batch_size: int = 16
    temperature: float = 0.7
    top_p: float = 0.8
    top_k: int = 20
    seed: int = 0
    features: str = "cache"  # cache | online
    holdout_fraction: float = 0.1  # records kept out of training for STS calibration


@dataclass
class TrainConfig:
    steps: int = 300
    # bench-train only: give each drafter this much training time on this machine instead of
    # the same step count (its steps come from a timed probe; see compare.py)
    budget_seconds: float | None = None
    batch_size: int = 8
    blocks_per_seq: int = 16
    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    # draft layers start as random weights, or as copies of the target's top decoder layers
    init_layers: str = "random"  # random | target
    seed: int = 0
    save_every: int = 100
    log_every: int = 10
    eval_every: int = 0  # steps between held-out acceptance estimates in TensorBoard (0 = never)
    dtype: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16
    device: str = "auto"
    distributed: str = "ddp"  # ddp | fsdp (used under torchrun)


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=lambda: ["math", "code", "chat"])
    samples_per_task: int = 10
    max_new_tokens: int = 96
    temperatures: list[float] = field(default_factory=lambda: [0.0, 1.0])
    seed: int = 0


@dataclass
class RunConfig:
    name: str = "run"
    output_root: str = "runs"
    target: TargetProfile = field(default_factory=TargetProfile)
    algo: AlgoConfig = field(default_factory=AlgoConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    @property
    def run_dir(self) -> Path:
        return Path(self.output_root) / self.name

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _configs_root() -> Path:
    return Path(str(importlib.resources.files("dspark.configs")))


def list_profiles(kind: str) -> list[str]:
    """Names of the bundled profiles of one kind: 'targets', 'algos' or 'runs'."""
    return sorted(p.stem for p in (_configs_root() / kind).glob("*.yaml"))


def _read_yaml(kind: str, name_or_path: str) -> dict[str, Any]:
    path = Path(name_or_path)
    if not path.suffix:
        path = _configs_root() / kind / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ConfigError(f"no {kind[:-1]} profile {name_or_path!r}; known: {', '.join(list_profiles(kind))}")
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at top level")
    return data


def _check_type(key: str, value: Any, annotation: Any) -> Any:
    ann = str(annotation)
    if value is None and "None" in ann:
        return None
    if ann.startswith("bool"):
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}: expected a boolean, got {value!r}")
    if ann.startswith("int") and "float" not in ann:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if ann.startswith("float"):
        if isinstance(value, str):  # YAML 1.1 reads `3e-3` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if ann.startswith("list"):
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return value
    if ann.startswith("str"):
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    return value


def _merge(obj: Any, data: dict[str, Any], prefix: str = "") -> None:
    fields = {f.name: f for f in dataclasses.fields(obj)}
    for key, value in data.items():
        full = f"{prefix}{key}"
        if key not in fields:
            raise ConfigError(f"unknown config key {full!r}; known: {', '.join(sorted(fields))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{full}: expected a mapping")
            _merge(current, value, full + ".")
        else:
            setattr(obj, key, _check_type(full, value, fields[key].type))


def parse_override(text: str) -> dict[str, Any]:
    """'train.steps=50' -> {'train': {'steps': 50}} (value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    key, raw = text.split("=", 1)
    value: Any = yaml.safe_load(raw) if raw else ""
    out: dict[str, Any] = {}
    node = out
    parts = key.strip().split(".")
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = value
    return out


def load_target_profile(name_or_path: str) -> TargetProfile:
    profile = TargetProfile(name=Path(name_or_path).stem)
    _merge(profile, _read_yaml("targets", name_or_path), "target.")
    validate_target_profile(profile)
    return profile


def load_algo(name_or_path: str) -> AlgoConfig:
    algo = AlgoConfig()
    _merge(algo, _read_yaml("algos", name_or_path), "algo.")
    return algo


def validate_target_profile(p: TargetProfile) -> None:
    if not p.layer_ids or len(set(p.layer_ids)) != len(p.layer_ids):
        raise ConfigError(f"target {p.name}: layer_ids must be non-empty and distinct, got {p.layer_ids}")
    if p.block_size < 1 or p.block_size > 32:
        raise ConfigError(f"target {p.name}: block_size must be in [1, 32], got {p.block_size}")
    if p.draft_layers < 1:
        raise ConfigError(f"target {p.name}: draft_layers must be >= 1, got {p.draft_layers}")
    if p.layer_style not in LAYER_STYLES:
        raise ConfigError(f"target {p.name}: layer_style must be one of {', '.join(LAYER_STYLES)}, got {p.layer_style!r}")
    if p.draft_vocab < 0:
        raise ConfigError(f"target {p.name}: draft_vocab must be >= 0 (0 = the whole vocabulary), got {p.draft_vocab}")


def load_run_config(path_or_name: str | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Resolve a run: run YAML (names a target and an algo) + dotted overrides."""
    raw = _read_yaml("runs", path_or_name) if path_or_name else {}
    merged: dict[str, Any] = dict(raw)
    for ov in overrides or []:
        _deep_update(merged, parse_override(ov))
    cfg = RunConfig()
    target_ref = merged.pop("target", "smollm2-135m")
    algo_ref = merged.pop("algo", "dspark")
    if isinstance(target_ref, str):
        cfg.target = load_target_profile(target_ref)
    elif isinstance(target_ref, dict):  # target: {profile: name, key: value...}
        base = target_ref.pop("profile", "smollm2-135m")
        cfg.target = load_target_profile(base)
        _merge(cfg.target, target_ref, "target.")
    else:
        raise ConfigError(f"target must be a profile name or a mapping, got {target_ref!r}")
    if isinstance(algo_ref, str):
        cfg.algo = load_algo(algo_ref)
    elif isinstance(algo_ref, dict):
        base = algo_ref.pop("profile", "dspark")
        cfg.algo = load_algo(base)
        _merge(cfg.algo, algo_ref, "algo.")
    else:
        raise ConfigError(f"algo must be a profile name or a mapping, got {algo_ref!r}")
    _merge(cfg, merged)
    from .algorithms import algorithm  # the registry imports the models, which import this module

    algorithm(cfg.algo.algo).check(cfg.algo)
    if cfg.algo.markov_head not in ("vanilla", "rnn", "none"):
        raise ConfigError(f"algo.markov_head must be vanilla, rnn or none, got {cfg.algo.markov_head!r}")
    if cfg.data.features not in ("cache", "online"):
        raise ConfigError(f"data.features must be cache or online, got {cfg.data.features!r}")
    if cfg.algo.markov_init not in ("zero", "bigram"):
        raise ConfigError(f"algo.markov_init must be zero or bigram, got {cfg.algo.markov_init!r}")
    if cfg.algo.markov_init == "bigram" and cfg.algo.markov_head != "vanilla":
        raise ConfigError(f"algo.markov_init=bigram starts the vanilla Markov head only, and algo.markov_head is "
                          f"{cfg.algo.markov_head!r}: add algo.markov_init=zero")
    if cfg.algo.draft_layers is not None and cfg.algo.draft_layers < 1:
        raise ConfigError(f"algo.draft_layers must be >= 1 (or unset: the target profile's), got {cfg.algo.draft_layers}")
    if cfg.algo.layer_style is not None and cfg.algo.layer_style not in LAYER_STYLES:
        raise ConfigError(f"algo.layer_style must be one of {', '.join(LAYER_STYLES)} (or unset: the target "
                          f"profile's), got {cfg.algo.layer_style!r}")
    if cfg.train.init_layers not in ("random", "target"):
        raise ConfigError(f"train.init_layers must be random or target, got {cfg.train.init_layers!r}")
    validate_target_profile(cfg.target)
    return cfg


def _deep_update(dst: dict[str, Any], src: dict[str, Any]) -> None:
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _deep_update(dst[k], v)
        elif isinstance(v, dict) and isinstance(dst.get(k), str):
            dst[k] = {"profile": dst[k], **v}
        else:
            dst[k] = v
