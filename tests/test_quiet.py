"""Quiet commands: nothing from a library comes before an ``mlxd`` command's own output
(transformers' "PyTorch was not found" notice), and the library's other warnings still
reach the log (``daemon/quiet.py``)."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest


@pytest.mark.parametrize("command", [["config"], ["parse", "--help"], ["--help"]])
def test_a_command_prints_only_its_own_output(command):
    env_python = [sys.executable, "-c", "import sys; from mlxd.daemon.cli import main; "
                  "sys.exit(main(sys.argv[1:]))", *command]  # fmt: skip
    done = subprocess.run(env_python, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stderr == "", done.stderr
    assert "PyTorch" not in done.stdout


def test_the_notice_is_dropped_and_other_transformers_warnings_are_not(caplog):
    from mlxd.daemon import quiet

    quiet.install()
    quiet.install()  # once, however often
    logger = logging.getLogger("transformers")
    assert sum(isinstance(f, quiet.DropNotices) for f in logger.filters) == 1
    with caplog.at_level(logging.WARNING, logger="transformers"):
        logger.warning("PyTorch was not found. Models won't be available ...")
        logger.warning("a tokenizer file is missing")
    assert [r.getMessage() for r in caplog.records] == ["a tokenizer file is missing"]
