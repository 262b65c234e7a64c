"""What keeps one request's sampling options from harming the batch it joins.

MLX checks no indices: an out-of-range token id in a gather or scatter reads or
writes outside the buffer and can kill the process. And a row's own code in a
batched step (its sampler, its logits processors) runs in the middle of every
other row's step: if it raises, mlx-lm's ``BatchGenerator`` step raises for the
whole batch, and a failure inside one of mlx-lm's compiled samplers can leave
MLX's global random key a compile-time placeholder, so every later unseeded
draw fails too. Three layers keep a request's options its own business:

- ``scheduler/checks.py`` ``check_sampling`` refuses, before the request joins a
  batch, any option the model could not run (token ids outside the vocabulary,
  ``top_k`` not below it, an unusable seed, non-finite numbers): an
  ``InvalidRequest``, a 400.
- ``bias_processor`` replaces mlx-lm's logit-bias processor with one that checks
  its token ids against the logits it is given, on every call.
- ``RowGuard`` wraps each row's sampler and processors: an exception is recorded
  against that row, the global random key is re-seeded (from the guard's base
  seed, the row's id and a count: every rank of a group re-seeds alike, since
  they share the base and see the same faults), and the row gets a
  harmless stand-in (its logits unchanged, a greedy token) so the step
  completes for every other row, token for token as if the row were not there.
  The engine then fails that row alone (``Runner.faults``).

No trio here.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Callable
from typing import Any

from mlxd.actors.engine.scheduler.types import InvalidRequest


def bias_processor(bias: dict[int, float]) -> Callable[[Any, Any], Any]:
    """Add ``bias`` to the logits of its token ids, after checking them against the logits."""
    import mlx.core as mx

    ids, values = list(bias), list(bias.values())
    low, high = min(ids), max(ids)
    indices, adds = mx.array(ids), mx.array(values)

    def process(tokens: Any, logits: mx.array) -> mx.array:
        if low < 0 or high >= logits.shape[-1]:
            raise InvalidRequest(
                f"logit_bias token ids out of range [0, {logits.shape[-1]})", "logit_bias"
            )
        return logits.at[:, indices].add(adds)

    return process


class RowGuard:
    """Per-row sampler and processors that cannot fail a batched step; faults kept by row."""

    def __init__(self, base: int | None = None) -> None:
        self._faults: dict[str, Exception] = {}
        # Where re-seeds start from: secret to this process unless ranks share one.
        self.base = secrets.randbits(63) if base is None else base
        self._reseeds = 0

    def take(self) -> dict[str, Exception]:
        """The rows whose own code failed since the last call (first error of each)."""
        faults, self._faults = self._faults, {}
        return faults

    def _fault(self, request_id: str, exc: Exception) -> None:
        import mlx.core as mx

        self._faults.setdefault(request_id, exc)
        # A compiled sampler that raised may leave the global key a placeholder that
        # cannot be evaluated; unseeded draws need a fresh key (seeded ones keep their own).
        mx.random.seed(self.next_seed(request_id))

    def next_seed(self, request_id: str) -> int:
        """The next re-seed: the same on every rank with the same base and faults."""
        self._reseeds += 1
        text = f"{self.base}:{request_id}:{self._reseeds}".encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") >> 1

    def sampler(self, request_id: str, sample: Callable[[Any], Any]) -> Callable[[Any], Any]:
        import mlx.core as mx

        def guarded(logprobs: mx.array) -> mx.array:
            try:
                return sample(logprobs)
            except Exception as exc:  # noqa: BLE001 - this row's failure, recorded for the engine
                self._fault(request_id, exc)
                return mx.argmax(logprobs, axis=-1)

        return guarded

    def processor(self, request_id: str, process: Callable[[Any, Any], Any]) -> Callable:
        def guarded(tokens: Any, logits: Any) -> Any:
            try:
                out = process(tokens, logits)
            except Exception as exc:  # noqa: BLE001 - this row's failure, recorded for the engine
                self._fault(request_id, exc)
                return logits
            if out.shape != logits.shape:
                self._fault(request_id, ValueError(f"a logits processor returned {out.shape}"))
                return logits
            return out

        return guarded
