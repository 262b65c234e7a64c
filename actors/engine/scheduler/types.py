"""What the engine core and the rest of the daemon know of a model runner (no mlx here)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mlxd.actors.engine.scheduler.memory import MemoryModel
from mlxd.protocol.embeddings import EmbeddingInfo
from mlxd.protocol.messages import FinishReason, RunnerCounters, TokenizedRequest, TokenLogprob
from mlxd.protocol.status import ChatTemplateStatus


class InvalidRequest(ValueError):
    """A request the model cannot run as asked, found before any MLX op saw it: a 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Decoded:
    """One request's output from one decode step (``logprob`` only if the request asked)."""

    request_id: str
    token: int
    finish_reason: FinishReason | None
    logprob: TokenLogprob | None = None


class Runner(Protocol):
    """What the engine core needs from a model runner (the fake in tests implements it too)."""

    def start(self, request: TokenizedRequest) -> int: ...  # returns prompt tokens reused
    def skipped_tokens(self, request_id: str) -> int:
        """Prompt tokens a started request will not prefill (SpecPrefill); 0 normally."""
        ...

    def wait_for(self, request: TokenizedRequest) -> str | None:
        """The id of a request being prefilled whose prompt starts like this one's, further
        than the prefix cache holds: this one should start once that prefill has left a
        snapshot at their shared boundary (the runner has asked for one). None: start now."""
        ...

    def prefill(self, request_id: str, budget: int) -> int: ...
    @property
    def batch_prefill_pays(self) -> bool:
        """Whether batched prefill is faster on this backend (the engine's default)."""
        ...

    @property
    def batches_prefill(self) -> bool:
        """Whether ``prefill_batch`` runs several requests' chunks in one forward pass."""
        ...

    def prefill_batch(self, budgets: dict[str, int]) -> dict[str, int | Exception]:
        """``prefill`` for several requests at once (request → budget). Returns request →
        tokens left, or the exception that request's own prefill raised (it alone fails)."""
        ...

    def decode(self) -> list[Decoded]: ...
    def faults(self) -> dict[str, Exception]:
        """Rows whose own code (sampler, logits processors) failed in the last decode step;
        the step completed for every other row, and these rows' tokens are not to be used."""
        ...

    def remove(self, request_id: str) -> None: ...
    def preempt(self, request_id: str) -> int:
        """``remove`` a row to free its memory, keeping its cache as a prefix-cache snapshot
        at its tokens so far (its resume starts from it, or recomputes); the snapshot's bytes."""
        ...

    def clear_cache(self) -> None: ...

    @property
    def cache_held(self) -> int:
        """Bytes the prefix cache's snapshots hold; they count against the memory budget."""
        ...

    def shrink_cache(self, nbytes: int) -> int:
        """Evict snapshots to free at least ``nbytes`` (fewer if there are not that many)."""
        ...

    def reset(self) -> None:
        """Drop the decode batch after a failed step (its requests have been failed)."""

    def memory_stats(self) -> tuple[int, int]:
        """(active, peak) bytes of device memory, as the backend reports them."""
        ...

    def counters(self) -> RunnerCounters:
        """Copies of the prefix-cache, speculation and SpecPrefill counters (this thread's)."""
        ...

    def release_buffers(self) -> None:
        """Called when the engine goes idle: return cached free buffers to the system."""

    @property
    def decoding(self) -> int: ...


@dataclass(frozen=True)
class Warmup:
    """The warm-up a model ran before its first request (``warmup.py``): how long it
    took, the largest decode batch, and the prompt lengths it prefilled."""

    seconds: float
    max_batch: int
    prompt_tokens: tuple[int, ...]


@dataclass(frozen=True)
class ModelInfo:
    """What the rest of the daemon needs to know about the loaded model."""

    model_id: str
    model_dir: Path
    context_length: int
    vocab_size: int
    tokenizer: Any  # HF tokenizer (wrapped by mlx-lm); thread-safe for encode/decode
    backend: str
    kind: str = "text"  # "text", "vision" or "embedding"
    # A vision model's processor (chat template, image preprocessing, image-token
    # expansion); the tokenizer actor's worker threads use it. None for text models.
    processor: Any = None
    memory: MemoryModel | None = None  # None: no memory gate (estimates unknown)
    embedding: EmbeddingInfo | None = None  # an embedding model's traits (kind "embedding")
    warmup: Warmup | None = None  # None: the model was not warmed up
    chat_template: ChatTemplateStatus | None = None  # which template serves it, and why
    # LoRA adapters per request: the linear layers an adapter may target, module path →
    # (input dims, output dims); empty when this model's runner takes no adapters, and
    # ``adapters_refused`` then says why (a vision model, speculative decoding, ...)
    lora_targets: dict[str, tuple[int, int]] = field(default_factory=dict)
    adapters_refused: str = ""


KINDS = ("auto", "text", "vision", "embedding")


def model_kind(config: dict[str, Any], override: str = "auto") -> str:
    """ "vision" when the model's config describes a vision tower, else "text"
    ("embedding" only where ``override`` names it).

    Decided from the config, never from the model's name; ``override`` (the
    ``model.kind`` setting) wins unless it is "auto".
    """
    if override not in KINDS:
        raise ValueError(f"model kind must be one of {KINDS}, not {override!r}")
    if override != "auto":
        return override
    return "vision" if config.get("vision_config") else "text"
