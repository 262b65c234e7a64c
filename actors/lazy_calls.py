"""Tool calls constrained once the model starts one (``tool_choice: auto``).

The answer is free text until the family's call opener (``forced.OPENERS``:
``<tool_call>``, ``[TOOL_CALLS]``, ``<｜tool▁calls▁begin｜>`` …); from the opener
on, the call is held to the same grammar a forced call uses (an offered tool's
name, arguments that match its schema, the closing markup). When the call is
complete the answer is free again: the model may write another call (its opener
triggers the grammar again) or stop.

Why a trigger at the engine, not one llguidance grammar for the whole answer
(``free_text call*`` with lazy lexemes, llama.cpp's "lazy grammar" as one
grammar): a grammar over the free part would have to list every special token
the model may write there (``<think>``, end-of-turn tokens, a family's channel
markup), which a text regex cannot produce; it would mask every token of every
tool request, a cost paid also by answers that never call; and it would apply
inside the reasoning block. Here the free part costs one look at each sampled
token's bytes, reasoning is skipped by its tags, and the grammar is exactly the
forced call's, so what auto mode accepts is what a forced call accepts.

How the opener is seen: each sampled token's bytes (a special token's bytes are
its text) are scanned, so an opener that spans several tokens, or starts in the
middle of one, is found as well as one special token. When an opener completes,
the matcher is reset and fed the opener and whatever the same token wrote after
it, re-tokenized (llguidance reads bytes, so another tokenization of the same
text is accepted; a special token's text becomes its id, as in the grammar).
Leading formats (``llama3``, ``json``: a call is a JSON object that starts the
answer) trigger only on the answer's first non-blank byte. Bytes inside the
reasoning block (``<think>`` … ``</think>``, or a block the prompt opened) never
trigger. Should the re-fed text not fit the grammar (the token that completed a
text opener went on off the markup), that call stays free: nothing already
sampled can be taken back.

Pure Python (llguidance, numpy): the engine wraps ``LazyCalls`` in a logits
processor (``runner/logits.py``); tests drive it by hand.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

log = logging.getLogger("mlxd.grammar")


@dataclass
class LazyGrammar:
    """A call grammar that waits for its opener; one per sequence (it owns a matcher)."""

    matcher: Any  # llguidance.LLMatcher for one call, from the opener to its closing markup
    tokenizer: Any  # llguidance.LLTokenizer: a token's bytes, and bytes back to tokens
    vocab_size: int
    eos_ids: tuple[int, ...]
    openers: tuple[bytes, ...]
    leading: bool = False  # the opener counts only as the answer's first non-blank bytes
    reasoning: tuple[bytes, bytes] | None = None  # the reasoning block's tags
    in_reasoning: bool = False  # the prompt opened the reasoning block
    # A replayed row (after a failed step) rebuilds it from the tokens it emitted: its
    # processor looks for the opener in them again (``runner/logits.LazyCallProcessor``).
    replayable: ClassVar[bool] = True


class Scanner:
    """Finds a call opener in the answer's bytes, outside the reasoning block."""

    def __init__(self, grammar: LazyGrammar):
        self._openers = grammar.openers
        self._tags = grammar.reasoning
        self._leading = grammar.leading
        self._in_reasoning = grammar.in_reasoning and grammar.reasoning is not None
        self._fresh = True  # no answer text yet (a reasoning block may still open)
        self._carry = b""  # the unmatched tail that an opener may still complete
        self._keep = max(len(m) for m in (*self._openers, *(self._tags or ()))) - 1

    def after_call(self) -> None:
        """A call ended: the answer goes on (a leading format takes no second call)."""
        self._carry, self._fresh = b"", False

    def feed(self, data: bytes) -> bytes | None:
        """The bytes from a completed opener on (to feed the grammar), or None."""
        text = self._carry + data
        while True:
            if self._in_reasoning:
                close = self._tags[1]  # type: ignore[index]
                at = text.find(close)
                if at < 0:
                    return self._hold(text)
                text, self._in_reasoning = text[at + len(close) :], False
                continue
            blank = text.lstrip()
            if self._fresh and self._tags and blank.startswith(self._tags[0]):
                text, self._in_reasoning = blank[len(self._tags[0]) :], True
                continue
            if self._fresh and self._tags and self._tags[0].startswith(blank):
                return self._hold(text)  # maybe the reasoning block's opening tag
            return self._leading_opener(text) if self._leading else self._opener(text)

    def _opener(self, text: bytes) -> bytes | None:
        found = [(at, m) for m in self._openers if (at := text.find(m)) >= 0]
        if text.strip():
            self._fresh = False
        if found:
            self._carry = b""
            return text[min(found)[0] :]
        return self._hold(text)

    def _leading_opener(self, text: bytes) -> bytes | None:
        if not self._fresh:
            return None
        blank = text.lstrip()
        for m in self._openers:
            if blank.startswith(m):
                self._carry, self._fresh = b"", False
                return blank
        if any(m.startswith(blank) for m in self._openers):
            self._carry = text  # blank so far, or the start of an opener
            return None
        self._carry, self._fresh = b"", False
        return None

    def _hold(self, text: bytes) -> None:
        self._carry = text[-self._keep :] if self._keep > 0 else b""
        return None


class LazyCalls:
    """One sequence's state: free text, or a call under its grammar."""

    def __init__(self, grammar: LazyGrammar):
        self._g = grammar
        self._matcher = grammar.matcher
        self._scanner = Scanner(grammar)
        self._active = False
        self._bitmask = allocate_token_bitmask(1, grammar.vocab_size)

    @property
    def active(self) -> bool:
        """Whether a call is being written under the grammar."""
        return self._active

    def consume(self, tokens: list[int]) -> None:
        """The tokens sampled since the last call, in order."""
        for token in tokens:
            if self._active:
                self._step(token)
                continue
            found = self._scanner.feed(self._g.tokenizer.decode_bytes([token]))
            if found is not None:
                self._start(found)

    def _start(self, text: bytes) -> None:
        # A fresh copy for each call: llguidance's reset() keeps an error state, so after an
        # opener that went off its markup (a model echoing its prompt's "<tool_call></tool_call>")
        # every later call of the answer would be refused and left free.
        self._matcher = self._g.matcher.deep_copy()
        tokens = self._g.tokenizer.tokenize_bytes(text)
        if self._matcher.consume_tokens(tokens) and not self._matcher.is_error():
            self._active = True
            self._check_done()
        else:
            log.info("a call went on off its markup after the opener: left unconstrained")
            self._scanner.after_call()

    def _step(self, token: int) -> None:
        if not self._matcher.consume_token(token) or self._matcher.is_error():
            # not sampled under this mask (a step taken before the opener was seen)
            log.warning(
                "grammar error in a call, left unconstrained: %s", self._matcher.get_error()
            )
            self._active = False
            self._scanner.after_call()
            return
        self._check_done()

    def _check_done(self) -> None:
        """The call's grammar is complete: what follows is free (another call, or the end)."""
        if self._matcher.is_accepting() or self._matcher.is_stopped():
            self._active = False
            self._scanner.after_call()

    def allowed(self, width: int) -> np.ndarray | None:
        """The tokens the grammar allows next (a bool row of ``width``), or None: free."""
        if not self._active:
            return None
        fill_next_token_bitmask(self._matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        allowed = np.zeros(width, dtype=bool)
        n = min(width, self._g.vocab_size)
        allowed[:n] = bits[:n]
        return allowed
