"""Tool calls held to their grammar once the model opens one (``tool_choice: auto``).

The answer is free text until the model opens a call with its family's opener
(``formats.CallMarkup.openers``: ``<tool_call>``, ``[TOOL_CALLS]``,
``<｜tool▁calls▁begin｜>`` …). From the opener on, the rest of the answer is held to
one grammar: the call (an offered tool's name, arguments that match its schema, the
closing markup), then only another call (where the request allows parallel calls and
the markup has room for several: ``CallMarkup.between``) or the end of the turn.

Where a call opens. An opener that is one special token of the vocabulary (or starts
with one) opens a call only as that token id: the same text spelled in ordinary tokens
(prose or code that mentions ``<tool_call>``) is prose. An opener that is text (no such
token) opens a call only as the first non-blank bytes of the answer or of a line, and
never inside a fenced code block. A leading format (a bare JSON object: ``llama3``,
``json``) opens only at the answer's first non-blank byte. The reasoning block
(``<think>`` … ``</think>``, or one the prompt opened) never opens a call.

Why a trigger at the engine, not one llguidance grammar for the whole answer (free
text, then calls): a grammar over the free part would have to list every special token
the model may write there (``<think>``, end-of-turn tokens, channel markup), it would
mask every token of every tool request, and it would reach into the reasoning. Here the
free part costs a look at the tokens the engine reads back after each step anyway; the
grammar is the forced call's, so auto mode accepts what a forced call accepts.

When an opener completes, a fresh matcher (llguidance's ``reset()`` keeps an error
state) is fed the opener: the token ids themselves for a special opener, the text from
the opener on, re-tokenized, for a text opener (it may start inside a token; llguidance
reads bytes). Should that text not fit the grammar (the token that completed a text
opener went on off the markup), the call stays free: nothing sampled can be taken back.

Pure Python (llguidance, numpy): ``runner/logits.LazyCallProcessor`` wraps it for the
engine; tests drive it by hand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

log = logging.getLogger("mlxd.grammar")


@dataclass
class LazyGrammar:
    """A call grammar that waits for its opener; the matcher is a template, copied per call."""

    matcher: Any  # llguidance.LLMatcher: from the opener to the end of the answer
    tokenizer: Any  # llguidance.LLTokenizer: a token's bytes, and bytes back to tokens
    vocab_size: int
    eos_ids: tuple[int, ...]
    # opener → its special token's id and the opener's text after that token (b"": none)
    special: dict[int, bytes] = field(default_factory=dict)
    text_openers: tuple[bytes, ...] = ()  # openers with no special token of their own
    leading: bool = False  # the opener counts only as the answer's first non-blank bytes
    reasoning: tuple[bytes, bytes] | None = None  # the reasoning block's tags
    in_reasoning: bool = False  # the prompt opened the reasoning block
    # the grammar's mask right after a bare special opener (packed words, by opener id):
    # the engine applies it on the device when the row's last token is that id, with no
    # wait for the host (``runner/logits.py``)
    first_words: dict[int, np.ndarray] = field(default_factory=dict)
    # a text opener's guard: the line so far → tokens that would complete the opener and go
    # on off the call's markup (``OpenerGuard``); None: no text openers
    guard: Any = None
    # A replayed row (after a failed step) rebuilds it from the tokens it emitted: its
    # processor looks for the opener in them again (``runner/logits.LazyCallProcessor``).
    replayable: ClassVar[bool] = True


class Scanner:
    """Finds where the answer opens a call, outside the reasoning block and code blocks."""

    def __init__(self, grammar: LazyGrammar):
        self._special = grammar.special
        self._texts = grammar.text_openers
        self._leading = grammar.leading
        self._tags = grammar.reasoning
        self._in_reasoning = grammar.in_reasoning and grammar.reasoning is not None
        self._fresh = True  # no answer text yet (a reasoning block may still open)
        self._carry = b""  # reasoning-tag bytes an opener may still complete
        self._keep = max((len(t) for t in (self._tags or ())), default=1) - 1
        self._line = b""  # the current line's first bytes (to see a code fence)
        self._cand: bytes | None = b""  # the line so far while it may still open a call
        self._fence = False  # inside a ``` code block
        self._pending: tuple[int, bytes, list[int], bytes] | None = None  # special + its text

    def may_open(self) -> bool:
        """Whether the next token could complete an opener (the engine must then read it
        before the next mask); a bare special opener needs no look (see ``first_words``)."""
        if self._pending is not None:
            return True
        if self._in_reasoning or not self._texts:
            return False
        if self._leading:
            return self._fresh
        return self._cand is not None

    def in_reasoning(self) -> bool:
        """Inside the reasoning block (an opener there is reasoning text)."""
        return self._in_reasoning

    def partial(self) -> bytes | None:
        """The line so far, blanks stripped, where it may still grow into a text opener
        (None: it cannot, or the format's openers are not text)."""
        if self._cand is None or self._leading or self._in_reasoning or not self._texts:
            return None
        return self._cand.lstrip()

    def after_call(self) -> None:
        """The call could not be held: the answer goes on free (a new line may open one)."""
        self._cand, self._fresh, self._pending = None, False, None

    def feed(self, token: int, data: bytes) -> list[int] | bytes | None:
        """The opener, once complete: its token ids (a special opener) or the text from its
        start on (a text opener), to feed the grammar; None while no call opens."""
        if self._pending is not None:
            return self._rest(token, data)
        text = self._answer(data)
        if text is None:
            return None
        if token in self._special and text == data:
            self._fresh = False
            if not self._special[token]:
                return [token]
            self._pending = (token, self._special[token], [token], b"")
            return None
        return self._text(text)

    def _rest(self, token: int, data: bytes) -> list[int] | bytes | None:
        """A special opener followed by its text (harmony's ``<|channel|>commentary to=``)."""
        opener, rest, ids, seen = self._pending  # type: ignore[misc]
        seen, ids = seen + data, [*ids, token]
        if seen.startswith(rest):
            self._pending = None
            return ids
        if rest.startswith(seen):
            self._pending = (opener, rest, ids, seen)
            return None
        self._pending = None  # another channel, another recipient: prose
        return self._text(seen)

    def _answer(self, data: bytes) -> bytes | None:
        """``data`` less any reasoning block; None while inside one (or maybe its tag)."""
        text = self._carry + data
        self._carry = b""
        while True:
            if self._in_reasoning:
                close = self._tags[1]  # type: ignore[index]
                at = text.find(close)
                if at < 0:
                    self._carry = text[-self._keep :] if self._keep > 0 else b""
                    return None
                text, self._in_reasoning = text[at + len(close) :], False
                self._line, self._cand = b"", b""  # the answer starts here
                continue
            if self._fresh and self._tags:
                blank = text.lstrip()
                if blank.startswith(self._tags[0]):
                    text, self._in_reasoning = blank[len(self._tags[0]) :], True
                    continue
                if blank and self._tags[0].startswith(blank):
                    self._carry = text  # maybe the reasoning block's opening tag
                    return None
            return text

    def _text(self, text: bytes) -> bytes | None:
        """A text opener at the start of the answer or of a line, outside code blocks (an
        opener may hold newlines of its own: GigaChat 3's ``<|message_sep|>\\n\\n…``)."""
        if self._leading:
            return self._leading_opener(text)
        if not self._texts:
            return None
        for i in range(len(text)):
            byte = text[i : i + 1]
            if not byte.isspace():
                self._fresh = False
            if self._cand is not None:
                cand = self._cand + byte
                blank = cand.lstrip()
                if not blank or any(o.startswith(blank) for o in self._texts):
                    self._cand = cand
                    if blank in self._texts:
                        self._cand = None
                        return blank + text[i + 1 :]  # the opener and what the token adds
                    continue
                self._cand, self._line = None, cand[:-1]  # this line opens no call
            if byte == b"\n":
                self._newline()
            elif len(self._line) < 8:  # enough to see a fence
                self._line += byte
        return None

    def _newline(self) -> None:
        if self._line.lstrip().startswith(b"```"):
            self._fence = not self._fence
        self._line = b""
        self._cand = None if self._fence else b""

    def _leading_opener(self, text: bytes) -> bytes | None:
        if not self._fresh:
            return None
        self._line += text
        blank = self._line.lstrip()
        for opener in self._texts:
            if blank.startswith(opener):
                self._fresh = False
                return blank
        if not blank or any(o.startswith(blank) for o in self._texts):
            return None  # blank so far, or the start of the opener
        self._fresh = False
        return None


class LazyCalls:
    """One sequence's state: free text, or the rest of the answer under its call grammar.

    Tokens come in order, each once, from either side: the engine's read-back after each
    step (``readback``), or the row's own read of its newest token where the next mask
    depends on it (``consume_from``)."""

    def __init__(self, grammar: LazyGrammar):
        self._g = grammar
        self._matcher: Any = None
        self._scanner = Scanner(grammar)
        self._active = False
        self._bitmask = allocate_token_bitmask(1, grammar.vocab_size)
        self.consumed = 0  # tokens of the answer seen so far
        self._read = 0  # tokens the engine has read back

    @property
    def active(self) -> bool:
        """Whether the answer is under the call grammar (a call opened)."""
        return self._active

    def may_open(self) -> bool:
        return not self._active and self._scanner.may_open()

    def in_reasoning(self) -> bool:
        return self._scanner.in_reasoning()

    def readback(self, token: int) -> None:
        """The engine read this row's next sampled token back."""
        self._read += 1
        if self._read > self.consumed:
            self.consume([token])

    def consume_from(self, start: int, tokens: list[int]) -> None:
        """Tokens of the answer from index ``start`` on (those seen already are skipped)."""
        self.consume(tokens[max(0, self.consumed - start) :])

    def consume(self, tokens: list[int]) -> None:
        """The next sampled tokens, in order."""
        for token in tokens:
            self.consumed += 1
            if self._active:
                self._step(token)
                continue
            found = self._scanner.feed(token, self._g.tokenizer.decode_bytes([token]))
            if found is not None:
                self._start(found)

    def _start(self, found: list[int] | bytes) -> None:
        # A fresh copy for each call: llguidance's reset() keeps an error state.
        self._matcher = self._g.matcher.deep_copy()
        tokens = found if isinstance(found, list) else self._g.tokenizer.tokenize_bytes(found)
        if self._matcher.consume_tokens(tokens) and not self._matcher.is_error():
            self._active = True
        else:
            log.info("a call went on off its markup after the opener: left unconstrained")
            self._scanner.after_call()

    def _step(self, token: int) -> None:
        if self._matcher.is_stopped():
            return  # the grammar is done: only the end of the turn was allowed
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            # not sampled under this mask (a step taken before the opener was seen)
            log.warning(
                "grammar error in a call, left unconstrained: %s", self._matcher.get_error()
            )
            self._active = False
            self._scanner.after_call()

    def words(self) -> np.ndarray | None:
        """The tokens the grammar allows next, as packed int32 words (bit ``i`` of word
        ``j``: token ``32 j + i``), or None: free. While a line may still grow into a text
        opener, every token is allowed but those that would complete it and go on off the
        call's markup (``OpenerGuard``): a call that opens can always be held."""
        if not self._active:
            return self._guarded()
        if self._matcher.is_stopped():
            return eos_words(self._g.eos_ids, self._bitmask.shape[1])
        fill_next_token_bitmask(self._matcher, self._bitmask)
        return self._bitmask[0]

    def _guarded(self) -> np.ndarray | None:
        line = self._scanner.partial()
        if line is None or self._g.guard is None:
            return None
        banned = self._g.guard.forbidden(line)
        if not banned:
            return None
        words = np.full(self._bitmask.shape[1], 0xFFFFFFFF, dtype=np.uint32)
        for token in banned:
            words[token // 32] &= np.uint32(~(1 << (token % 32)) & 0xFFFFFFFF)
        return words.view(np.int32)

    def allowed(self, width: int) -> np.ndarray | None:
        """The tokens the grammar allows next (a bool row of ``width``), or None: free."""
        words = self.words()
        return None if words is None else unpack(words, width)


def eos_words(eos_ids: tuple[int, ...], n_words: int) -> np.ndarray:
    """Packed mask words that allow only the end of the turn."""
    words = np.zeros(n_words, dtype=np.uint32)
    for eos in eos_ids:
        if 0 <= eos < 32 * n_words:
            words[eos // 32] |= np.uint32(1 << (eos % 32))
    return words.view(np.int32)


def unpack(words: np.ndarray, width: int) -> np.ndarray:
    """Packed mask words as a bool row of ``width`` (tokens past the words: not allowed)."""
    bits = np.unpackbits(words.view(np.uint8), bitorder="little").astype(bool)
    allowed = np.zeros(width, dtype=bool)
    n = min(width, bits.shape[0])
    allowed[:n] = bits[:n]
    return allowed


class TokenIndex:
    """Every ordinary token's bytes, sorted: the tokens that start with given bytes, by
    bisection (one per tokenizer, built where a text opener is first compiled)."""

    def __init__(self, tokenizer: Any):
        pairs = sorted(
            (tokenizer.decode_bytes([t]), t)
            for t in range(tokenizer.vocab_size)
            if not tokenizer.is_special_token(t)
        )
        self._keys = [b for b, _ in pairs]
        self._ids = [t for _, t in pairs]

    def starting_with(self, prefix: bytes) -> list[tuple[bytes, int]]:
        import bisect

        at = bisect.bisect_left(self._keys, prefix)
        out = []
        while at < len(self._keys) and self._keys[at].startswith(prefix):
            out.append((self._keys[at], self._ids[at]))
            at += 1
        return out


class OpenerGuard:
    """The tokens that would complete a text opener and go on off the call's markup (a
    model echoing its prompt's ``<tool_call></tool_call>`` at the start of a line): such a
    token would open a call that cannot be held, and nothing sampled can be taken back."""

    def __init__(self, index: TokenIndex, matcher: Any, tokenizer: Any, openers: tuple[bytes, ...]):
        self._index, self._matcher, self._tokenizer = index, matcher, tokenizer
        self._openers = openers
        self._known: dict[bytes, tuple[int, ...]] = {}

    def forbidden(self, line: bytes) -> tuple[int, ...]:
        """``line``: the line so far, blanks stripped (a prefix of an opener)."""
        found = self._known.get(line)
        if found is None:
            found = self._known[line] = tuple(self._search(line))
        return found

    def _search(self, line: bytes) -> list[int]:
        out = []
        for opener in self._openers:
            if not opener.startswith(line):
                continue
            rest = opener[len(line) :]
            for data, token in self._index.starting_with(rest):
                tail = data[len(rest) :]
                if tail and not self._fits(opener + tail):
                    out.append(token)
        return out

    def _fits(self, text: bytes) -> bool:
        probe = self._matcher.deep_copy()
        tokens = self._tokenizer.tokenize_bytes(text)
        return bool(probe.consume_tokens(tokens)) and not probe.is_error()
