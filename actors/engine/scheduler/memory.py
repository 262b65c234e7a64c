"""Memory estimates for admission: what one request's KV cache and model state will cost.

Where the memory gate sits, and why. The admission controller
(``actors/admission.py``) runs before tokenization, when a request's prompt
length is not known yet, so it keeps only its slot and queue policy. The memory
gate sits where the token count is known:

- the tokenizer stage refuses a request that could never fit, even alone on an
  idle server (HTTP 400 with the numbers), and shrinks a defaulted
  ``max_tokens`` to what fits;
- the engine core (``core.py``) moves a waiting request into prefill only while
  the estimates of every sequence it holds, plus this one, stay under the
  budget; the others wait in its queue, in order, until finishing sequences
  free their share.

What a running sequence is counted for depends on ``memory.admission``. Under
"reserve" it is its whole prompt + ``max_tokens`` from the start, so no row can
outgrow its share, and most of the budget sits unused by answers shorter than
their ``max_tokens``. Under "use" (the default) it is what the sequence holds
(prompt + tokens generated, and the coming step's growth), never less than
prompt + ``memory.decode_reserve_tokens``: a request is admitted when that
margin fits, and before a step whose growth would not fit the engine preempts
the newest row (``core.py``), so the sum never passes the budget.

The engine is the one place that knows exactly which sequences hold memory and
frees their share in the same step they finish, abort or fail. Routing
tokenized requests back through the admission controller would need a second
trip per request and a release message per finished sequence, and the two
stages' views of "what is in memory" could drift apart.

The estimate for one request: every attention layer's KV bytes per token times
``prompt + max_tokens`` (rounded up to the KV cache's allocation step, capped
at a sliding-window layer's window), plus every recurrent (SSM) layer's fixed
state. The runner measures the per-layer numbers on the loaded model, on the
caches it really makes: with ``engine.kv_bits`` an attention layer's bytes per
token are its quantized packs plus their scales and biases. This
module is pure arithmetic, with no mlx import. The estimate is per sequence:
mlx-lm's batch cache pads every sequence to the longest one in the batch, and
prefill needs activations; ``memory.headroom_mb`` is kept free for both.
"""

from __future__ import annotations

from dataclasses import dataclass

# mlx-lm's KVCache grows in steps of this many tokens.
KV_STEP = 256
_MIB = 1 << 20


@dataclass(frozen=True)
class AttentionLayer:
    """A layer whose cache grows with the sequence: keys + values bytes per token."""

    bytes_per_token: int
    window: int | None = None  # a sliding-window layer never holds more tokens than this


@dataclass(frozen=True)
class StateLayer:
    """A recurrent (SSM / linear attention) layer: a fixed state per sequence."""

    state_bytes: int


Layer = AttentionLayer | StateLayer


def _round_up(tokens: int, step: int) -> int:
    return -(-tokens // step) * step


@dataclass(frozen=True)
class MemoryModel:
    """The per-request estimator and the budget all running requests share."""

    layers: tuple[Layer, ...]
    budget_bytes: int
    step: int = KV_STEP
    # "use": a row holds its prompt and what it has generated, never less than
    # ``reserve_tokens`` of growth; "reserve": its whole prompt + max_tokens from the start
    admission: str = "use"
    reserve_tokens: int = 256  # memory.decode_reserve_tokens

    def row_bytes(self, prompt_tokens: int, max_tokens: int, decoded: int, *, full: bool) -> int:
        """Bytes a running row is counted for once ``decoded`` tokens are in its cache (the
        coming step's growth included). Under "use" that is what it holds, but never less
        than ``reserve_tokens`` of growth (the margin it was admitted with); under "reserve",
        or ``full`` (a row that cannot be preempted), its whole ``max_tokens``."""
        if full or self.admission == "reserve":
            return self.request_bytes(prompt_tokens, max_tokens)
        floor = min(self.reserve_tokens, max_tokens)
        return self.request_bytes(prompt_tokens, max(min(decoded, max_tokens), floor))

    @property
    def kv_bytes_per_token(self) -> int:
        return sum(
            layer.bytes_per_token for layer in self.layers if isinstance(layer, AttentionLayer)
        )

    @property
    def state_bytes(self) -> int:
        return sum(layer.state_bytes for layer in self.layers if isinstance(layer, StateLayer))

    def request_bytes(self, prompt_tokens: int, max_tokens: int) -> int:
        """Bytes one sequence may hold by its last token."""
        tokens = _round_up(prompt_tokens + max_tokens, self.step)
        total = 0
        for layer in self.layers:
            if isinstance(layer, StateLayer):
                total += layer.state_bytes
            else:
                held = tokens if layer.window is None else min(tokens, layer.window)
                total += layer.bytes_per_token * held
        return total

    def max_tokens_fitting(self, prompt_tokens: int, limit: int) -> int:
        """The largest ``max_tokens`` (at most ``limit``) that fits the budget alone; 0: none."""
        if self.request_bytes(prompt_tokens, limit) <= self.budget_bytes:
            return limit
        lo, hi = 0, limit  # request_bytes is monotonic in max_tokens
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.request_bytes(prompt_tokens, mid) <= self.budget_bytes:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def too_large_message(self, prompt_tokens: int, max_tokens: int) -> str:
        """Why a request can never fit, with the numbers."""
        need = self.request_bytes(prompt_tokens, max_tokens)
        return (
            f"this request needs about {need / _MIB:.1f} MiB of KV cache and model state "
            f"({prompt_tokens} prompt + {max_tokens} completion tokens at "
            f"{self.kv_bytes_per_token} bytes per token, plus {self.state_bytes} bytes of "
            f"recurrent state), more than the server's whole budget of "
            f"{self.budget_bytes / _MIB:.1f} MiB (memory.kv_budget_mb / memory.device_fraction); "
            f"ask for fewer max_tokens or send a shorter prompt"
        )


def kv_budget(
    *,
    device_bytes: int,
    weights_bytes: int,
    fraction: float,
    headroom_bytes: int,
    explicit_bytes: int = 0,
) -> int:
    """The bytes requests may hold: an explicit budget, or the device share left after the weights."""
    if explicit_bytes > 0:
        return explicit_bytes
    budget = int(device_bytes * fraction) - weights_bytes - headroom_bytes
    if budget <= 0:
        raise ValueError(
            f"not enough memory to serve: {fraction:.0%} of {device_bytes / _MIB:.0f} MiB device "
            f"memory, minus {weights_bytes / _MIB:.0f} MiB of weights and "
            f"{headroom_bytes / _MIB:.0f} MiB headroom, leaves nothing for requests "
            f"(memory.device_fraction, memory.headroom_mb)"
        )
    return budget


_ALLOCATION_WORDS = ("out of memory", "memory limit", "allocat", "malloc", "resource limit")


def is_memory_error(exc: BaseException) -> bool:
    """Whether an exception from a model step is an allocation failure."""
    if isinstance(exc, MemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and any(word in text for word in _ALLOCATION_WORDS)
