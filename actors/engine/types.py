"""What the engine core and the rest of the daemon know of a model runner (no mlx here)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from protocol.messages import FinishReason, TokenizedRequest, TokenLogprob


@dataclass(frozen=True)
class Decoded:
    """One request's output from one decode step (``logprob`` only if the request asked)."""

    request_id: str
    token: int
    finish_reason: FinishReason | None
    logprob: TokenLogprob | None = None


class Runner(Protocol):
    """What the engine core needs from a model runner (the fake in tests implements it too)."""

    def start(self, request: TokenizedRequest) -> None: ...
    def prefill(self, request_id: str, budget: int) -> int: ...
    def decode(self) -> list[Decoded]: ...
    def remove(self, request_id: str) -> None: ...
    @property
    def decoding(self) -> int: ...


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the daemon needs to know about the loaded model."""

    model_id: str
    model_dir: Path
    context_length: int
    vocab_size: int
    tokenizer: Any  # HF tokenizer (wrapped by mlx-lm); thread-safe for encode/decode
    backend: str
