"""Per-token logits work on the generation thread: grammar masks and logprobs.

``GrammarProcessor`` is an mlx-lm logits processor (one per constrained
request): before each sample it advances the request's llguidance matcher by
the tokens sampled since its last call, then masks every token the grammar
forbids. ``LazyCallProcessor`` does the same only while a tool call is open
(auto mode). ``token_logprobs`` turns the log-softmax rows that mlx-lm's
``BatchGenerator`` returns into the sampled token's logprob and the top
alternatives, in one batched ``argpartition`` for the requests that asked.
Engine thread only (MLX).
"""

from __future__ import annotations

import logging
import math

import mlx.core as mx
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from mlxd.actors.grammar import CompiledGrammar
from mlxd.actors.lazy_calls import LazyCalls, LazyGrammar
from mlxd.protocol.messages import TokenLogprob

log = logging.getLogger("mlxd.grammar")


class GrammarProcessor:
    """Masks the logits of one sequence to what its grammar allows next."""

    def __init__(self, grammar: CompiledGrammar):
        self._grammar = grammar
        self._matcher = grammar.matcher
        self._bitmask = allocate_token_bitmask(1, grammar.vocab_size)
        self._seen: int | None = None  # length of the token context at the last call

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        n = tokens.shape[0]
        # mlx-lm prepares the step after EOS before it reports EOS: a finished grammar takes no more.
        if self._seen is not None and n > self._seen and not self._matcher.is_stopped():
            # sync: the matcher (llguidance, on the host) must see the sampled tokens
            # before it can build the next mask
            self._matcher.consume_tokens(tokens[self._seen :].tolist())
        self._seen = n  # the first call sees the prompt only
        return mx.where(self._allowed(logits.shape[-1]), logits, -math.inf)

    def _allowed(self, width: int) -> mx.array:
        if self._matcher.is_error() or self._matcher.is_stopped():
            if self._matcher.is_error():
                log.warning("grammar error, ending the sequence: %s", self._matcher.get_error())
            allowed = np.zeros(width, dtype=bool)
            allowed[list(self._grammar.eos_ids)] = True
            return mx.array(allowed)
        fill_next_token_bitmask(self._matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        allowed = np.zeros(width, dtype=bool)
        n = min(width, self._grammar.vocab_size)
        allowed[:n] = bits[:n]
        return mx.array(allowed)


class LazyCallProcessor:
    """Free logits until the answer opens a tool call, then its call grammar's mask
    (``actors/lazy_calls.py``; ``tool_choice: auto``). ``resumed``: the context's last
    tokens were emitted by this row before a preemption, so they are replayed first."""

    def __init__(self, grammar: LazyGrammar, resumed: int = 0):
        self._calls = LazyCalls(grammar)
        self._resumed = resumed
        self._seen: int | None = None

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        n = tokens.shape[0]
        if self._seen is None:
            self._seen = n - self._resumed  # the first call sees the prompt (and the replay)
        if n > self._seen:
            # sync: the opener is looked for in the sampled tokens before this step's mask
            self._calls.consume(tokens[self._seen :].tolist())
        self._seen = n
        allowed = self._calls.allowed(logits.shape[-1])
        return logits if allowed is None else mx.where(mx.array(allowed), logits, -math.inf)


def token_logprobs(rows: list[mx.array], tokens: list[int], tops: list[int]) -> list[TokenLogprob]:
    """The sampled tokens' logprobs and each row's ``tops[i]`` best (finite) alternatives.

    The rows are already evaluated (mlx-lm evaluates them with the step), so
    this is done in numpy: an MLX op here would queue behind the next step that
    mlx-lm has already launched, and undo its overlap with this one.
    """
    out = []
    for row, token, k in zip(rows, tokens, tops, strict=True):
        values = np.asarray(row, dtype=np.float32)  # no wait: mlx-lm evaluated it with the step
        top: tuple[tuple[int, float], ...] = ()
        if k > 0:
            k = min(k, values.shape[-1])
            idx = np.argpartition(-values, k - 1)[:k]
            idx = idx[np.argsort(-values[idx], kind="stable")]
            top = tuple((int(i), float(values[i])) for i in idx if math.isfinite(values[i]))
        out.append(TokenLogprob(token=token, logprob=float(values[token]), top=top))
    return out
