"""Incremental detokenization and stop strings: the sync core of the streamer.

``IncrementalDetokenizer`` turns a growing token list into text deltas that
never end in a partial UTF-8 character (byte-level BPE splits emoji and CJK
across tokens; decoding those alone yields U+FFFD). ``StopMatcher`` holds back
the tail of the text that could still become a stop string, so a stop string
split across tokens is never shown. No trio, no mlx.
"""

from __future__ import annotations

from typing import Protocol

_REPLACEMENT = "\ufffd"
# How many already-emitted tokens to re-decode as context; enough for any
# tokenizer's merge of leading spaces and multi-token characters.
_CONTEXT_TOKENS = 6


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Decode a token stream into text deltas, holding back incomplete characters."""

    def __init__(self, tokenizer: Decoder):
        self._tokenizer = tokenizer
        self._tokens: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens before this are emitted

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tokenizer.decode(self._tokens[start:stop], skip_special_tokens=True)

    def add(self, tokens: list[int] | tuple[int, ...]) -> str:
        """Append tokens; return the newly completed text (maybe empty)."""
        self._tokens.extend(tokens)
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset)
        if len(full) <= len(prefix) or full.endswith(_REPLACEMENT):
            return ""  # nothing new, or the last character is still incomplete
        new_text = full[len(prefix) :]
        self._read_offset = len(self._tokens)
        self._prefix_offset = max(self._read_offset - _CONTEXT_TOKENS, 0)
        return new_text

    def flush(self) -> str:
        """At the end of the stream, whatever is left (incomplete bytes included)."""
        prefix = self._decode(self._prefix_offset, self._read_offset)
        full = self._decode(self._prefix_offset)
        self._read_offset = len(self._tokens)
        return full[len(prefix) :]


class StopMatcher:
    """Find stop strings in streamed text; never release text that could start one."""

    def __init__(self, stops: tuple[str, ...] | list[str]):
        self._stops = [s for s in stops if s]
        self._held = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Return the text safe to show; sets ``stopped`` when a stop string appears."""
        if self.stopped:
            return ""
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            self.stopped = True
            self._held = ""
            return buffer[: min(hits)]
        keep = self._longest_partial(buffer)
        self._held = buffer[len(buffer) - keep :] if keep else ""
        return buffer[: len(buffer) - keep]

    def _longest_partial(self, buffer: str) -> int:
        """Length of the longest suffix of ``buffer`` that is a proper prefix of a stop."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(buffer)), best, -1):
                if buffer.endswith(stop[:n]):
                    best = n
                    break
        return best

    def flush(self) -> str:
        """The held-back tail, released when the stream ends without a stop."""
        held, self._held = self._held, ""
        return "" if self.stopped else held
