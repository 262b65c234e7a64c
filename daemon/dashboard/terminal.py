"""``mlxd status``: the dashboard's summary of a running daemon, in a terminal.

It reads ``GET /v1/dashboard`` once (``--url``; the key from ``--api-key``) and prints
the models, the running and queued requests, the prompt cache and the last minute's
throughput. Standard library only (no HTTP client dependency).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import Any

_TIMEOUT_S = 10.0
_PAST_ALL = 10**15  # a cursor past every sample and request: the summary alone


def add_parser(sub) -> None:
    status = sub.add_parser("status", help="print a running daemon's summary (its dashboard)")
    status.add_argument(
        "--url", help="the daemon (default: http://HOST:PORT of the settings' [server])"
    )
    status.add_argument("--api-key", help="an API key, if the daemon wants one")


def default_url(host: str, port: int) -> str:
    """Where a daemon serving on ``host``:``port`` answers locally."""
    if host in ("", "0.0.0.0", "::"):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def fetch(url: str, api_key: str | None) -> dict[str, Any]:
    """``/v1/dashboard`` of the daemon at ``url`` (no samples or requests: ``since`` past
    them); raises ``OSError`` with a readable message."""
    target = url.rstrip("/") + f"/v1/dashboard?since={_PAST_ALL}&recent_since={_PAST_ALL}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(target, headers=headers), timeout=_TIMEOUT_S
        ) as response:
            return json.load(response)
    except urllib.error.HTTPError as exc:
        raise OSError(f"{target}: HTTP {exc.code}: {_message(exc)}") from None
    except urllib.error.URLError as exc:
        raise OSError(f"{url}: {exc.reason}") from None


def _message(exc: urllib.error.HTTPError) -> str:
    try:
        return json.load(exc)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return exc.reason


def render(url: str, view: dict[str, Any]) -> str:
    a, cache, minute = view["admission"], view["cache"], view["last_minute"]
    lines = [f"mlxd at {url}: {view['state']}, up {_duration(view['uptime_s'])}", "models:"]
    width = max([len(m["id"]) for m in view["models"]] + [5])
    for m in view["models"]:
        line = (
            f"  {m['id']:<{width}}  {m['state']:<8}  weights {_bytes(m['weights_bytes']):>9}"
            f"  requests {m['open_requests']} open, {m['finished_requests']} done"
        )
        lines.append(line + (f"\n    error: {m['error']}" if m["error"] else ""))
    lines.append(
        f"requests: {a['running']} running, {a['waiting']} queued "
        f"(of {a['max_running']} and {a['max_waiting']}); {a['rejected']} rejected"
    )
    hit = f"{cache['hit_rate']:.1%}" if cache["prompt_tokens"] else "-"
    prefix = f"; prefix cache {cache['entries']} entries, {_bytes(cache['bytes'])}"
    lines.append(
        f"cache: {hit} of prompt tokens cached "
        f"({cache['cached_tokens']} of {cache['prompt_tokens']})"
        + (prefix if cache["enabled"] else "")
    )
    memory = view["memory"]
    lines.append(
        f"memory: {_bytes(memory['active_bytes'])} active, {_bytes(memory['peak_bytes'])} peak"
    )
    lines.append(
        f"last minute: {minute['tokens_per_s']:.1f} tokens/s, {minute['requests']} requests, "
        f"TTFT p50 {_seconds(minute['ttft_p50'])}, p95 {_seconds(minute['ttft_p95'])}"
    )
    return "\n".join(lines)


def main(args: argparse.Namespace, url: str) -> int:
    try:
        view = fetch(url, args.api_key)
    except OSError as exc:
        print(f"mlxd status: {exc}", file=sys.stderr)
        return 1
    print(render(url, view))
    return 0


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def _seconds(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.2f} s"


def _duration(s: float) -> str:
    minutes, seconds = divmod(int(s), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s"
