"""``encrypted_content`` of Responses reasoning items: signed, opaque to clients.

A client that keeps no server state (``store: false``) and asks for
``include: ["reasoning.encrypted_content"]`` gets each reasoning item with a
string it can send back later; mlxd reads the reasoning text out of it and
checks that it made the string itself. The text is signed with HMAC-SHA256, not
encrypted: the same item already carries the text in ``summary`` or
``content``. The key is random per daemon start unless
``responses.reasoning_key_file`` names a file that keeps it across restarts.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
import secrets
from pathlib import Path

import msgspec

_PREFIX = "mlxd1."
_KEY_BYTES = 32


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).decode().rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class _Payload(msgspec.Struct, kw_only=True):
    text: str


class ReasoningSeal:
    """Reasoning text → ``mlxd1.<payload>.<signature>`` and back."""

    def __init__(self, key: bytes):
        self.key = key

    @classmethod
    def from_key_file(cls, key_file: str) -> ReasoningSeal:
        """A random key, or the one kept in ``key_file`` (made, mode 0600, if missing)."""
        if not key_file:
            return cls(secrets.token_bytes(_KEY_BYTES))
        path = Path(key_file).expanduser()
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(_KEY_BYTES) + "\n")
        key = bytes.fromhex(path.read_text().strip())
        if len(key) < 16:
            raise ValueError(f"responses.reasoning_key_file: {path} holds under 16 bytes of key")
        return cls(key)

    def _sign(self, payload: str) -> str:
        return _b64(hmac.new(self.key, payload.encode(), hashlib.sha256).digest())

    def seal(self, text: str) -> str:
        payload = _PREFIX + _b64(msgspec.json.encode(_Payload(text=text)))
        return f"{payload}.{self._sign(payload)}"

    def open(self, token: str) -> str | None:
        """The reasoning text, or None when this daemon's key did not sign ``token``."""
        payload, _, signature = token.rpartition(".")
        expected = self._sign(payload).encode()
        if not payload.startswith(_PREFIX) or not hmac.compare_digest(signature.encode(), expected):
            return None
        try:
            return msgspec.json.decode(_unb64(payload[len(_PREFIX) :]), type=_Payload).text
        except (binascii.Error, ValueError, msgspec.DecodeError):
            return None
