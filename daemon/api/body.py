"""Request bodies checked before they are decoded: content type, UTF-8 and JSON depth.

msgspec (and ``json.loads`` later, for tool-call arguments) recurses once per
nesting level, so a deep enough document raises ``RecursionError``, in a
worker thread where nothing catches it. The depth is measured here on the raw
bytes instead: escaped backslashes and quotes are deleted (two
``bytes.replace``), the remaining quotes toggle "inside a string", brackets
outside strings step the depth up or down, and the depth is their cumulative
sum in numpy (a 4 MiB body of brackets and strings takes tens of milliseconds;
most bodies hold fewer brackets than the limit and return after two
``bytes.count`` calls).
"""

from __future__ import annotations

import numpy as np

_STEP = np.zeros(256, dtype=np.int8)
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


def json_depth(data: bytes, limit: int = 0) -> int:
    """The deepest nesting of arrays and objects in JSON text (0 for a scalar).

    With ``limit``, a document with at most ``limit`` brackets (strings included)
    returns 0 at once: it cannot be deeper than the limit.
    """
    if not data or (limit and data.count(b"[") + data.count(b"{") <= limit):
        return 0
    if b"\\" in data:  # drop escaped backslashes, then escaped quotes: neither is a bracket
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    chars = np.frombuffer(data, dtype=np.uint8)
    step = _STEP[chars]
    quotes = chars == ord('"')
    if quotes.any():
        in_string = (np.cumsum(quotes, dtype=np.int32) & 1).astype(bool)
        step[in_string] = 0
    return max(int(np.cumsum(step, dtype=np.int32).max()), 0)


def is_json_type(content_type: str | None) -> bool:
    """``application/json`` or ``application/<anything>+json``, any parameters (charset)."""
    mime = (content_type or "").partition(";")[0].strip().lower()
    kind, _, sub = mime.partition("/")
    return kind == "application" and (sub == "json" or sub.endswith("+json"))


def valid_utf8(data: bytes) -> bool:
    if data.isascii():
        return True
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True
