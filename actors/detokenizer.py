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
    """Decode a token stream into text deltas, holding back incomplete characters.

    Special tokens are hidden unless ``hidden`` is given: then exactly those ids
    are hidden (a tool-call parser needs to see marker tokens such as
    ``[TOOL_CALLS]`` that are special in their tokenizer).
    """

    def __init__(self, tokenizer: Decoder, hidden: frozenset[int] | None = None):
        self._tokenizer = tokenizer
        self._hidden = hidden
        self._tokens: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens before this are emitted

    def _decode(self, start: int, stop: int | None = None) -> str:
        ids = self._tokens[start:stop]
        if self._hidden is None:
            return self._tokenizer.decode(ids, skip_special_tokens=True)
        return self._tokenizer.decode(ids, skip_special_tokens=False)

    def add(self, tokens: list[int] | tuple[int, ...]) -> str:
        """Append tokens; return the newly completed text (maybe empty)."""
        if self._hidden is not None:
            tokens = [t for t in tokens if t not in self._hidden]
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
        self.matched: str | None = None  # the stop string that ended the text

    def feed(self, text: str) -> str:
        """Return the text safe to show; sets ``stopped`` when a stop string appears."""
        if self.stopped:
            return ""
        buffer = self._held + text
        hits = [(i, s) for s in self._stops if (i := buffer.find(s)) >= 0]
        if hits:
            first, self.matched = min(hits)
            self.stopped = True
            self._held = ""
            return buffer[:first]
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


def _byte_level_table() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet: printable stand-in character → byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    table, extra = {chr(b): b for b in printable}, 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _byte_level_table()


class TokenTexts:
    """Each token id as text and as its exact bytes (for logprobs); cached per id.

    A token that is part of a multi-byte character decodes to U+FFFD alone; its
    bytes come from the vocabulary entry (byte-level BPE, or ``<0xNN>`` pieces).
    """

    def __init__(self, tokenizer: Decoder):
        self._tokenizer = tokenizer
        self._cache: dict[int, tuple[str, tuple[int, ...]]] = {}

    def __call__(self, token: int) -> tuple[str, tuple[int, ...]]:
        hit = self._cache.get(token)
        if hit is None:
            hit = self._cache[token] = self._piece(token)
        return hit

    def _piece(self, token: int) -> tuple[str, tuple[int, ...]]:
        text = self._tokenizer.decode([token], skip_special_tokens=False)
        raw = self._vocab_bytes(token) if _REPLACEMENT in text else None
        return text, tuple(raw if raw is not None else text.encode())

    def _vocab_bytes(self, token: int) -> bytes | None:
        convert = getattr(self._tokenizer, "convert_ids_to_tokens", None)
        piece = convert([token])[0] if convert else None
        if not isinstance(piece, str):
            return None
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        if all(ch in _BYTE_LEVEL for ch in piece):
            return bytes(_BYTE_LEVEL[ch] for ch in piece)
        return None


def special_ids(tokenizer: object) -> frozenset[int]:
    """Ids of the tokenizer's special added tokens (hidden from output text)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(i for i, t in added.items() if getattr(t, "special", False))


def marker_ids(tokenizer: object, markers: tuple[str, ...]) -> frozenset[int]:
    """Ids of special tokens whose text is one of ``markers`` or a piece of one (Kimi K3
    writes its reasoning tag ``<|open|>think<|sep|>`` as three tokens)."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    return frozenset(
        i
        for i, t in added.items()
        if (text := getattr(t, "content", None)) and any(text in m for m in markers)
    )
