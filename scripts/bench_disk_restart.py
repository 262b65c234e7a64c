"""Time to first token after a restart, with the prefix cache's disk tier against a cold run.

Starts ``mlxd serve`` (the default model unless one is given) with a fresh
``prefix_cache.disk_dir``, sends a conversation whose prompt is about ``--tokens`` long,
stops the daemon with SIGTERM (its snapshots go to disk), starts it again and sends the
next turn: that is the disk hit. Then both tiers are cleared and the same turn is sent
again: that is the cold run. One token each (``max_tokens`` 1), so the time is the TTFT.

    python scripts/bench_disk_restart.py [--model PATH] [--tokens 1600]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 600.0


def _port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: str, port: int, config: Path, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "mlxd.daemon.cli", "serve"]
    command += [model] if model else []
    command += ["--port", str(port), "--config", str(config)]
    with log.open("a") as out:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("the daemon did not start")


def _ask(port: int, messages: list[dict]) -> tuple[float, int, str]:
    body = {"messages": messages, "max_tokens": 1, "temperature": 0}
    started = time.perf_counter()
    r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=WAIT_S)
    seconds = time.perf_counter() - started
    r.raise_for_status()
    data = r.json()
    usage = data["usage"]
    cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return seconds, cached, f"{usage['prompt_tokens']} prompt tokens"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="", help="model path (default: SmolLM2-135M)")
    parser.add_argument("--tokens", type=int, default=1600)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="mlxd-bench-disk-"))
    config = tmp / "mlxd.toml"
    config.write_text(f'[prefix_cache]\ndisk_dir = "{tmp / "disk"}"\n')
    log = tmp / "mlxd.log"
    words = "the daemon keeps prompt snapshots on disk so agents restart warm ".split()
    system = " ".join(words[i % len(words)] for i in range(int(args.tokens * 0.9)))
    first = [{"role": "system", "content": system}, {"role": "user", "content": "Hello?"}]
    port = _port()
    proc = _start(args.model, port, config, log)
    try:
        cold1, _, size = _ask(port, first)
        print(f"turn 1 (cold, {size}): {cold1:.2f} s")
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=WAIT_S)
        disk = sum(p.stat().st_size for p in (tmp / "disk").rglob("*.kv"))
        print(f"after SIGTERM: {disk / 2**20:.0f} MiB on disk")
        proc = _start(args.model, port, config, log)
        second = [
            *first,
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "Go on."},
        ]
        warm, cached, size = _ask(port, second)
        print(f"turn 2 after restart (disk hit, {size}, {cached} cached): {warm:.2f} s")
        httpx.delete(f"http://127.0.0.1:{port}/v1/cache", timeout=WAIT_S).raise_for_status()
        cold, cached, size = _ask(port, second)
        print(f"turn 2 cold ({size}, {cached} cached): {cold:.2f} s")
        ram, cached, size = _ask(port, second)
        print(f"turn 2 again (RAM hit, {cached} cached): {ram:.2f} s")
        print(f"disk hit / cold TTFT: {warm / cold:.3f}; RAM hit / cold: {ram / cold:.3f}")
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=WAIT_S)
        if os.environ.get("KEEP") is None:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
