"""SIGHUP (``launchctl kill HUP``, a closed terminal, a log rotator) does not end `mlxd serve`:
it re-reads ``auth.api_key_file`` and serving goes on; SIGTERM still drains and exits 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.processes import free_port, wait_healthy

pytestmark = pytest.mark.mlx

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 300.0  # a hang, not a slow machine


def _status_with(url: str, key: str) -> int:
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{url}/v1/models", headers=headers, timeout=WAIT_S).status_code


def test_sighup_rereads_the_key_file_and_the_daemon_serves_on(tmp_path, tiny_models):
    keys = tmp_path / "keys"
    keys.write_text("old-key\n")
    config = tmp_path / "mlxd.toml"
    config.write_text(f'[auth]\napi_key_file = "{keys}"\n[model]\ncache_dir = "{tmp_path}"\n')
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "mlxd.log"
    command = [sys.executable, "-m", "mlxd.daemon.cli", "serve", str(tiny_models("llama"))]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*command, "--port", str(port), "--config", str(config)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    try:
        wait_healthy(url, lambda: proc.poll() is None, WAIT_S, log.read_text)
        assert _status_with(url, "old-key") == 200
        assert _status_with(url, "new-key") == 401
        keys.write_text("new-key\n")
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + WAIT_S
        while _status_with(url, "new-key") != 200:  # the signal is handled soon, not at once
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert _status_with(url, "old-key") == 401
        keys.write_text("# no key left\n")  # unreadable or empty: the keys in use stay
        proc.send_signal(signal.SIGHUP)
        while "kept the API keys in use" not in log.read_text():
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.1)
        assert _status_with(url, "new-key") == 200
        assert proc.poll() is None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        proc.kill()
        proc.wait()
    text = log.read_text()
    assert "SIGHUP: re-read the API keys from" in text
    assert "Traceback" not in text
