"""A wheel that works (issue 14, item 5): built from this tree, installed into a fresh
venv, run from an unrelated directory.

The new venv sees the test venv's dependencies through a ``.pth`` path entry (a path
entry does not run the editable install's own ``.pth`` hook), so ``mlxd`` there can only
be the wheel's. No network: ``pip wheel --no-build-isolation`` uses this venv's setuptools
(the ``test`` extra pins one with ``bdist_wheel`` built in).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import httpx
import pytest

from tests.processes import free_port, wait_healthy

pytestmark = pytest.mark.mlx

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "daemon", "actors", "protocol", "scripts")
SOURCES += ("config",)
PACKAGES = {"daemon", "actors", "protocol", "scripts", "config"}


def run(*argv, cwd: Path, env: dict[str, str], timeout: float = 120):
    proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{argv}: {proc.stdout}\n{proc.stderr}"
    return proc.stdout


def build_wheel(tmp: Path, env: dict[str, str]) -> Path:
    """``pip wheel`` on a copy of the tree (setuptools writes build/ and egg-info beside it)."""
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        if (ROOT / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, src / name)
    pip = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q"]
    run(*pip, "-w", str(tmp / "dist"), str(src), cwd=tmp, env=env)
    (wheel,) = (tmp / "dist").glob("mlxd-*.whl")
    return wheel


def fresh_venv(tmp: Path, wheel: Path, env: dict[str, str]) -> Path:
    """A new venv with the wheel installed and this venv's packages on its path."""
    venv = tmp / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv), cwd=tmp, env=env)
    python = venv / "bin" / "python"
    site = run(str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])",
               cwd=tmp, env=env).strip()  # fmt: skip
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (Path(site) / "test-dependencies.pth").write_text("\n".join(sorted(ours)) + "\n")
    pip = [sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q"]
    run(*pip, str(wheel), cwd=tmp, env=env)
    return venv


def serve_once(mlxd: Path, model: Path, cwd: Path, env: dict[str, str]) -> tuple[int, str]:
    """``mlxd serve MODEL`` until one chat completion answers: its status and the log."""
    port = free_port()
    argv = [str(mlxd), "serve", str(model), "--port", str(port), "--served-model-name", "wheel"]
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, lambda: proc.poll() is None, 60)
        body = {"model": "wheel", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        status = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=30).status_code
        page = httpx.get(f"{base}/", timeout=30)  # the dashboard, from the wheel's own files
        assert page.status_code == 200 and "/dashboard/app.js" in page.text
    finally:
        proc.terminate()
        log = proc.communicate(timeout=60)[0]
    return status, log


def test_the_wheel_installs_into_a_fresh_venv_and_serves(tmp_path, tiny_models):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MLXD_", "PYTHON"))}
    env["HF_HUB_OFFLINE"] = "1"
    wheel = build_wheel(tmp_path, env)
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"mlxd", "mlxd-0.1.0.dist-info"}
    for data in ("default.toml", "launchd.plist.template", "systemd.service.template"):
        assert f"mlxd/config/{data}" in names
    for page in ("index.html", "app.js", "style.css"):  # the dashboard at /
        assert f"mlxd/daemon/dashboard/{page}" in names

    venv = fresh_venv(tmp_path, wheel, env)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    where = "import json, importlib.util as u, mlxd.daemon.cli as c; "
    where += "print(json.dumps([c.__file__, u.find_spec('daemon') is None]))"
    cli_file, no_daemon = json.loads(run(str(venv / "bin" / "python"), "-c", where,
                                         cwd=elsewhere, env=env))  # fmt: skip
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    assert cli_file == str(site / "site-packages" / "mlxd" / "daemon" / "cli.py")
    assert no_daemon and not PACKAGES & {p.name for p in (site / "site-packages").iterdir()}

    mlxd = venv / "bin" / "mlxd"
    printed = run(str(mlxd), "config", "--port", "9123", cwd=elsewhere, env=env)
    assert "port = 9123\n" in printed and "[engine]" in printed
    unit = run(str(mlxd), "systemd", "print", cwd=elsewhere, env=env)
    assert f"ExecStart={venv}/bin/python -m mlxd.daemon.cli serve" in unit

    status, log = serve_once(mlxd, tiny_models("llama"), elsewhere, env)
    assert status == 200, log
    assert "ready: serving wheel" in log  # --served-model-name
