"""engine.kernel_cache_dir: MLX's GPU kernel cache outside the temp directory."""

from __future__ import annotations

import pytest
from mlxd.daemon import kernel_cache


@pytest.fixture(autouse=True)
def _no_variable(monkeypatch, tmp_path):
    # recorded, so whatever a test sets is undone afterwards
    monkeypatch.setenv(kernel_cache.VARIABLE, "")
    monkeypatch.delenv(kernel_cache.VARIABLE)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))


def test_auto_points_mlx_at_the_users_cache_dir(tmp_path):
    line = kernel_cache.use("auto")
    where = tmp_path / "xdg" / "mlxd" / "mlx-kernels"
    assert kernel_cache.os.environ[kernel_cache.VARIABLE] == str(where)
    assert where.is_dir() and str(where) in line


def test_a_path_is_used_and_created(tmp_path):
    kernel_cache.use(str(tmp_path / "k"))
    assert kernel_cache.os.environ[kernel_cache.VARIABLE] == str(tmp_path / "k")
    assert (tmp_path / "k").is_dir()


def test_the_environment_wins_and_empty_leaves_mlx_default(monkeypatch, tmp_path):
    monkeypatch.setenv(kernel_cache.VARIABLE, "/somewhere")
    assert "from the environment" in kernel_cache.use("auto")
    assert kernel_cache.os.environ[kernel_cache.VARIABLE] == "/somewhere"
    monkeypatch.delenv(kernel_cache.VARIABLE)
    kernel_cache.use("")
    assert kernel_cache.VARIABLE not in kernel_cache.os.environ


def test_an_unwritable_dir_falls_back_without_failing(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    line = kernel_cache.use(str(blocker / "sub"))
    assert "cannot be created" in line
    assert kernel_cache.VARIABLE not in kernel_cache.os.environ
