"""The `mlxd` process: start-up failures and graceful drain on SIGTERM."""

from __future__ import annotations

import json
import os
import plistlib
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from mlxd.daemon.cli import _parser
from mlxd.daemon.service import render_plist, spec_from_args

ROOT = Path(__file__).resolve().parent.parent


def mlxd(*args, **kw):
    return subprocess.Popen(
        [sys.executable, "-m", "mlxd.daemon.cli", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kw,
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_missing_model_exits_nonzero_with_one_clear_line():
    proc = mlxd("serve", "/nonexistent/model.gguf", "--port", str(free_port()))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    errors = [line for line in out.splitlines() if "ERROR" in line]
    assert len(errors) == 1
    assert "model not found: /nonexistent/model.gguf" in errors[0]
    assert "Traceback" not in out


def test_bad_config_exits_nonzero(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("[server]\nprot = 1\n")
    proc = mlxd("serve", "--config", str(config))
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert "prot" in out


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def launchd_job(*argv: str) -> dict:
    """The LaunchAgent ``mlxd launchd install`` would write, parsed."""
    args = _parser().parse_args(["launchd", "install", "--print", *argv])
    return plistlib.loads(render_plist(spec_from_args(args)).encode())


@pytest.mark.mlx
def test_sigterm_drains_in_flight_request_then_exits_zero(tmp_path):
    """Started as the LaunchAgent starts it, stopped as launchd stops it (SIGTERM)."""
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    config = tmp_path / "c.toml"
    config.write_text(f'[model]\ncache_dir = "{tmp_path}"\n')
    job = launchd_job("--port", str(port), "--config", str(config))
    proc = subprocess.Popen(
        job["ProgramArguments"],
        cwd=job["WorkingDirectory"],
        env={**os.environ, **job["EnvironmentVariables"]},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if _get(f"{base}/health")[0] == 200:
                    break
            except OSError:
                pass
            time.sleep(0.2)
        body = json.dumps(
            {"prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "stream": True}
        )
        req = urllib.request.Request(
            f"{base}/v1/completions", body.encode(), {"Content-Type": "application/json"}
        )
        conn = urllib.request.urlopen(req, timeout=60)  # noqa: SIM115 - headers are in: it runs
        proc.send_signal(signal.SIGTERM)
        frames = [f for f in conn.read().decode().split("\n\n") if f]
        assert frames[-1] == "data: [DONE]"
        assert json.loads(frames[-2][6:])["choices"][0]["finish_reason"] == "length"
        out, _ = proc.communicate(timeout=job["ExitTimeOut"])  # before launchd's SIGKILL
        assert proc.returncode == 0
        assert "draining" in out
        (line,) = [ln for ln in out.splitlines() if "mlxd.requests" in ln]
        assert (
            "status=200" in line
            and "generated_tokens=40" in line
            and "finish_reason=length" in line
        )
    finally:
        proc.kill()


def test_unreadable_api_key_file_exits_nonzero_with_one_clear_line(tmp_path):
    config = tmp_path / "c.toml"
    config.write_text(f'[auth]\napi_key_file = "{tmp_path}/missing-keys"\n')
    proc = mlxd("serve", "--port", str(free_port()), "--config", str(config))
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1
    (error,) = [line for line in out.splitlines() if "ERROR" in line]
    assert "auth.api_key_file: cannot read" in error and "missing-keys" in error
    assert "Traceback" not in out
