"""``scripts/install`` builds ``.venv`` with a Python >= 3.11 (``scripts/find_python``): the
newest of python3.13 / 3.12 / 3.11, then python3, or ``$PYTHON``; with none it stops with a
message that says which to install and how to point ``PYTHON=`` at it. Run with a PATH of
stand-in interpreters that print their version."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

FIND = Path(__file__).resolve().parent.parent / "scripts" / "find_python"


def _stand_ins(tmp_path: Path, versions: dict[str, str]) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, version in versions.items():
        path = bin_dir / name
        path.write_text(f"#!{shutil.which('bash')}\necho {version}\n")
        path.chmod(0o755)
    return bin_dir


def _find(bin_dir: Path, python: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {"PATH": str(bin_dir)} | ({"PYTHON": python} if python else {})
    bash = shutil.which("bash")
    assert bash
    return subprocess.run([bash, str(FIND)], env=env, capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    ("versions", "chosen"),
    [
        ({"python3": "3.9", "python3.12": "3.12", "python3.11": "3.11"}, "python3.12"),
        ({"python3": "3.9", "python3.11": "3.11"}, "python3.11"),
        ({"python3": "3.13"}, "python3"),
        ({"python3": "3.14", "python3.13": "3.13"}, "python3.13"),
    ],
)
def test_the_newest_named_python_of_at_least_3_11_is_chosen(tmp_path, versions, chosen):
    bin_dir = _stand_ins(tmp_path, versions)
    done = _find(bin_dir)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(bin_dir / chosen)


def test_a_stock_mac_s_python_3_9_stops_with_what_to_install(tmp_path):
    done = _find(_stand_ins(tmp_path, {"python3": "3.9"}))
    assert done.returncode == 1 and done.stdout == ""
    assert "Python 3.11 or newer" in done.stderr
    assert "python3 (" in done.stderr and ": 3.9" in done.stderr  # what it found
    assert "brew install python@3.12" in done.stderr
    assert "PYTHON=" in done.stderr


def test_no_python_at_all_says_so(tmp_path):
    done = _find(_stand_ins(tmp_path, {}))
    assert done.returncode == 1
    assert "Found none of: python3.13 python3.12 python3.11 python3" in done.stderr


def test_python_names_the_interpreter_and_is_checked_too(tmp_path):
    bin_dir = _stand_ins(tmp_path, {"python3.12": "3.12", "old": "3.10", "new": "3.11"})
    assert _find(bin_dir, str(bin_dir / "new")).stdout.strip() == str(bin_dir / "new")
    done = _find(bin_dir, str(bin_dir / "old"))
    assert done.returncode == 1 and ": 3.10" in done.stderr  # not python3.12 behind its back


def test_the_install_script_uses_it():
    install = (FIND.parent / "install").read_text()
    assert 'python="$(scripts/find_python)"' in install
    assert "python3 -m venv" not in install
