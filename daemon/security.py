"""API keys and CORS for the HTTP surface (pure helpers; ``app.py`` installs the hooks).

Keys come from ``auth.api_keys`` and ``auth.api_key_file`` (one per line, ``#``
comments). A client presents one as ``Authorization: Bearer KEY`` or
``x-api-key: KEY``; both sides are hashed before ``hmac.compare_digest`` and
every configured key is compared, so the time taken says nothing about any key.
CORS is off unless ``server.cors_origins`` lists origins (``"*"``: any).
``AllowedHosts`` checks the Host header against ``server.allowed_hosts`` or,
when that is empty, the bind address: a web page whose DNS name was rebound to
127.0.0.1 still sends its own name as Host, and is refused.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections.abc import Iterable, Mapping
from pathlib import Path

_CORS_METHODS = "GET, POST, OPTIONS"
_CORS_HEADERS = "Authorization, Content-Type, x-api-key"


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def read_key_file(path: str) -> list[str]:
    """Keys from a file; a file that cannot be read or holds no key is a start-up error."""
    file = Path(path).expanduser()
    try:
        lines = file.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"auth.api_key_file: cannot read {file}: {exc.strerror}") from exc
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise ValueError(f"auth.api_key_file: {file} holds no key")
    return keys


class ApiKeys:
    """The accepted keys, as digests; empty means the API is open."""

    def __init__(self, keys: Iterable[str]):
        self._digests = tuple(_digest(k) for k in keys if k)

    @classmethod
    def from_settings(cls, auth) -> ApiKeys:
        keys = list(auth.api_keys)
        if auth.api_key_file:
            keys += read_key_file(auth.api_key_file)
        return cls(keys)

    @property
    def enabled(self) -> bool:
        return bool(self._digests)

    def allows(self, headers: Mapping[str, str]) -> bool:
        presented = presented_key(headers)
        if presented is None:
            return False
        digest = _digest(presented)
        ok = False
        for accepted in self._digests:  # no early exit: every key is compared
            ok |= hmac.compare_digest(digest, accepted)
        return ok


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The key in ``Authorization: Bearer KEY`` or else ``x-api-key: KEY``."""
    auth = headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return headers.get("x-api-key") or None


class Cors:
    """Which browser origins may call the API, and the headers that say so."""

    def __init__(self, origins: Iterable[str]):
        self.origins = frozenset(origins)

    @property
    def enabled(self) -> bool:
        return bool(self.origins)

    def allows(self, origin: str | None) -> bool:
        return bool(origin) and ("*" in self.origins or origin in self.origins)

    def headers(self, origin: str) -> dict[str, str]:
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}

    def preflight_headers(self, origin: str) -> dict[str, str]:
        return {
            **self.headers(origin),
            "Access-Control-Allow-Methods": _CORS_METHODS,
            "Access-Control-Allow-Headers": _CORS_HEADERS,
            "Access-Control-Max-Age": "600",
        }


_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_ANY_ADDRESS = frozenset({"0.0.0.0", "::", ""})


_LABEL = r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
_HOST = re.compile(rf"(?:\[[0-9A-Fa-f:.]{{2,45}}\]|{_LABEL}(?:\.{_LABEL})*\.?)(?::[0-9]{{1,5}})?")


def well_formed_host(value: str) -> bool:
    """A DNS name or address, optionally with a port: what the URL router can parse."""
    return len(value) <= 261 and _HOST.fullmatch(value) is not None


def host_name(value: str) -> str:
    """``Host`` header or setting → the bare name: lower case, no port, no brackets."""
    value = value.strip().lower()
    if value.startswith("["):  # [::1]:8000
        return value[1:].partition("]")[0]
    if value.count(":") == 1:  # name:port (a bare IPv6 address has several colons)
        value = value.partition(":")[0]
    return value.rstrip(".")


def _is_loopback(name: str) -> bool:
    try:
        return name == "localhost" or ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


class AllowedHosts:
    """Host header names the server answers to; an empty set (or ``"*"``) accepts any."""

    def __init__(self, configured: Iterable[str], bind_host: str):
        names = {host_name(h) for h in configured}
        if not names:
            bind = host_name(bind_host)
            if bind not in _ANY_ADDRESS:
                names = {bind} | (_LOOPBACK_NAMES if _is_loopback(bind) else set())
        self.names = frozenset() if "*" in names else frozenset(names)

    def allows(self, host: str | None) -> bool:
        # No Host header at all (HTTP/1.0) is not a browser: nothing to rebind.
        return not self.names or not host or host_name(host) in self.names
