"""The engine's public request/response types and the interface serving code relies on.

Serving (triton_repo/), benchmarks and scripts talk to an engine only through these
types, so they stay independent of how the runtime batches and schedules.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol


class RequestValidationError(ValueError):
    """A request that cannot be served; the message is meant for the client."""


@dataclass
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # 1.0 = off
    top_k: int = 0  # 0 = off
    seed: int | None = None  # same seed, prompt and parameters -> same tokens (docs/runtime.md); None: a random one
    stop_token_ids: list[int] = field(default_factory=list)  # e.g. end_id; the stop token is emitted
    stop_strings: list[str] = field(default_factory=list)

    def validate(self, max_context: int | None = None) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise RequestValidationError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if max_context is not None and self.max_tokens > max_context:
            raise RequestValidationError(f"max_tokens={self.max_tokens} exceeds the engine context of {max_context}")
        if not (self.temperature >= 0.0) or self.temperature > 100.0:
            raise RequestValidationError(f"temperature must be in [0, 100], got {self.temperature!r}")
        if not (0.0 < self.top_p <= 1.0):
            raise RequestValidationError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise RequestValidationError(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2**63):
            raise RequestValidationError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")


@dataclass
class RequestOutput:
    """One streamed update for a request: the tokens emitted since the previous update."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "length" | "stop" | "cancelled" | "error"
    error: str | None = None
    # acceptance statistics for this request so far
    num_steps: int = 0  # verify rounds
    num_draft_tokens: int = 0  # drafts sent to verification
    num_accepted_tokens: int = 0  # drafts accepted (bonus/recovered tokens not counted)

    @property
    def accept_len(self) -> float | None:
        """Mean tokens emitted per verify round (accepted + 1), or None before the first round
        (the one definition, ``engine/proposers/stats.py``)."""
        from .proposers.stats import accept_len
        return accept_len(self.num_accepted_tokens, self.num_steps)


OutputCallback = Callable[[RequestOutput], None]


class GenerationEngine(Protocol):
    """What serving needs from an engine. Implemented by dspark.engine.runtime.SpecEngine."""

    max_context: int

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               on_output: OutputCallback) -> None:
        """Queue a request; it joins the running batch at the next step. Raises RequestValidationError."""

    def cancel(self, request_id: str) -> None:
        """Stop a request; its callback gets a final update with finish_reason 'cancelled'."""

    def start(self) -> None:
        """Run the step loop in a background thread."""

    def stop(self) -> None:
        """Finish the loop thread; pending requests are cancelled."""
