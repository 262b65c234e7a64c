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
from mlxd.actors.lazy_calls import LazyCalls, LazyGrammar, eos_words
from mlxd.protocol.messages import TokenLogprob

log = logging.getLogger("mlxd.grammar")


_SHIFTS: mx.array | None = None  # 0 … 31, made on the engine thread


def _apply_words(words: mx.array, shifts: mx.array, logits: mx.array) -> mx.array:
    """``logits`` where bit ``i`` of word ``j`` is set for token ``32 j + i``, else -inf."""
    bits = ((words[:, None] >> shifts) & 1).reshape(1, -1)[:, : logits.shape[-1]]
    return mx.where(bits != 0, logits, -math.inf)


def _apply_first(last: mx.array, ids: mx.array, allowed: mx.array, logits: mx.array) -> mx.array:
    """``logits`` masked to ``allowed[k]`` where ``last`` is opener ``ids[k]``, else as they are."""
    hit = last == ids
    keep = mx.any(hit[:, None] & allowed, axis=0) | ~mx.any(hit)
    return mx.where(keep, logits, -math.inf)


# One fused pass over the vocabulary each (``mx.compile``): on the CPU backend the masks
# cost about a tenth of the same ops run one by one.
_apply_words_fused = mx.compile(_apply_words)
_apply_first_fused = mx.compile(_apply_first)


def _padded(words: np.ndarray, width: int) -> np.ndarray:
    """Packed mask words as uint32, as many as ``width`` tokens need (missing ones: 0)."""
    n = -(-width // 32)
    out = np.zeros(n, dtype=np.uint32)
    k = min(n, words.shape[0])
    out[:k] = words[:k].view(np.uint32)
    return out


def _masked(logits: mx.array, words: np.ndarray) -> mx.array:
    """``logits`` masked by packed words: the host uploads 1/32 of a byte per token and the
    bits are expanded on the device, in the same pass that applies them."""
    global _SHIFTS
    if _SHIFTS is None:
        _SHIFTS = mx.arange(32, dtype=mx.uint32)
    width = logits.shape[-1]
    return _apply_words_fused(mx.array(_padded(words, width)), _SHIFTS, logits)


def expand(words: np.ndarray, width: int) -> mx.array:
    """Packed mask words as a bool row of ``width`` on the device."""
    return _masked(mx.zeros((1, width)), words)[0] == 0


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
        return _masked(logits, self._words())

    def _words(self) -> np.ndarray:
        if self._matcher.is_error() or self._matcher.is_stopped():
            if self._matcher.is_error():
                log.warning("grammar error, ending the sequence: %s", self._matcher.get_error())
            return eos_words(self._grammar.eos_ids, self._bitmask.shape[1])
        fill_next_token_bitmask(self._matcher, self._bitmask)
        return self._bitmask[0]


class LazyCallProcessor:
    """Free logits until the answer opens a tool call, then its call grammar's mask
    (``actors/lazy_calls.py``; ``tool_choice: auto``). ``resumed``: the context's last
    tokens were emitted by this row before a preemption, so they are replayed first.

    A free row costs no wait: the runner hands it each token it reads back after a step
    (``readback``). The mask for the token after a bare special opener is applied on the
    device, selected by the row's newest token (not yet on the host). Only where the next
    mask depends on that token (a call is open, or a text opener may complete) does the
    row read it here, which waits for the step that sampled it."""

    def __init__(self, grammar: LazyGrammar, resumed: int = 0, on_device: bool = True):
        self._grammar = grammar
        self._calls = LazyCalls(grammar)
        self._resumed = resumed
        # the backend table's ``opener_mask_on_device``: else a row whose format opens
        # with a special token reads its newest token each step (cheaper on the CPU)
        self._read_newest = bool(grammar.special) and not on_device
        self._start: int | None = None  # context length before the answer's first token
        self._first: tuple[mx.array, mx.array] | None = None  # opener ids, their masks

    def readback(self, token: int) -> None:
        """The token the engine read back for this row after a step."""
        self._calls.readback(token)

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        n = tokens.shape[0]
        if self._start is None:
            self._start = n - self._resumed  # the first call sees the prompt (and the replay)
        calls = self._calls
        answered = n - self._start  # the answer's tokens in the context, the newest unread
        wanted = calls.active or calls.may_open() or self._resumed or self._read_newest
        if calls.consumed < answered and wanted:
            self._resumed = 0
            # sync: the next mask depends on the newest token
            calls.consume_from(calls.consumed, tokens[self._start + calls.consumed :].tolist())
        words = calls.words()
        if words is not None:
            return _masked(logits, words)
        if self._read_newest:
            return logits  # the newest token is read: an opener has made the row active
        if self._grammar.first_words and answered > 0 and not calls.in_reasoning():
            return self._after_opener(tokens[-1], logits)
        return logits

    def _after_opener(self, last: mx.array, logits: mx.array) -> mx.array:
        """Where ``last`` is a bare special opener, the grammar's first mask (on the device)."""
        width = logits.shape[-1]
        if self._first is None or self._first[1].shape[-1] != width:
            ids = list(self._grammar.first_words)
            masks = [expand(self._grammar.first_words[i], width) for i in ids]
            self._first = (mx.array(ids), mx.stack(masks))
        ids, allowed = self._first
        return _apply_first_fused(last, ids, allowed, logits)


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
