"""Service files: the launchd plist and the systemd unit, rendered, parsed and (simulated) installed."""

from __future__ import annotations

import configparser
import plistlib
import subprocess
import sys
from pathlib import Path

import pytest
from mlxd.daemon import service
from mlxd.daemon.cli import main
from mlxd.daemon.settings import load_settings


def render(capsys, *argv: str) -> str:
    assert main(list(argv)) == 0
    return capsys.readouterr().out


def test_plist_parses_and_runs_this_venv_serving_with_the_given_options(capsys, tmp_path):
    config = tmp_path / "mlxd.toml"
    config.write_text("[server]\ndrain_timeout_s = 100.0\n")
    text = render(
        capsys,
        *("launchd", "install", "--print", "--port", "9001", "--config", str(config)),
        *("--env", "TOKEN=a&b<c", "--label", "org.example.mlxd", "--log-dir", str(tmp_path)),
    )
    plist = plistlib.loads(text.encode())
    assert plist["Label"] == "org.example.mlxd"
    assert plist["ProgramArguments"] == [
        sys.executable,
        *("-m", "mlxd.daemon.cli", "serve", "--config", str(config), "--port", "9001"),
    ]
    assert plist["RunAtLoad"] is True
    assert plist["KeepAlive"] == {"SuccessfulExit": False}  # crashes restart, a drain does not
    assert plist["EnvironmentVariables"]["TOKEN"] == "a&b<c"
    assert plist["EnvironmentVariables"]["PYTHONUNBUFFERED"] == "1"
    assert plist["StandardErrorPath"] == str(tmp_path / "org.example.mlxd.err.log")
    assert plist["StandardOutPath"] == str(tmp_path / "org.example.mlxd.out.log")
    # launchd sends SIGKILL ExitTimeOut seconds after SIGTERM: longer than the drain
    assert plist["ExitTimeOut"] > 100.0 + load_settings().server.flush_timeout_s
    assert plist["WorkingDirectory"] == str(Path.home())


@pytest.mark.slow  # runs mlxd as a process
def test_the_rendered_command_starts_the_cli(capsys):
    plist = plistlib.loads(render(capsys, "launchd", "install", "--print").encode())
    args = plist["ProgramArguments"]
    done = subprocess.run(
        [*args, "--help"], cwd=plist["WorkingDirectory"], capture_output=True, text=True
    )
    assert done.returncode == 0 and "--config" in done.stdout


def test_a_bad_config_is_refused_before_anything_is_written(capsys, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[server]\nprot = 1\n")
    assert main(["launchd", "install", "--print", "--config", str(bad)]) == 2
    assert "prot" in capsys.readouterr().err


@pytest.mark.skipif(sys.platform == "darwin", reason="off macOS only")
def test_launchd_install_off_macos_refuses_and_points_to_print_and_systemd(capsys):
    for action in ("install", "uninstall", "status"):
        assert main(["launchd", action]) == 2
        err = capsys.readouterr().err
        assert "macOS" in err and "--print" in err and "mlxd systemd print" in err


class FakeLaunchctl:
    def __init__(self, loaded=False):
        self.calls: list[tuple[str, ...]] = []
        self.loaded = loaded

    def __call__(self, *args):
        self.calls.append(args)
        if args[0] == "bootstrap":
            self.loaded = True
        if args[0] == "bootout":
            self.loaded = False
        ok = args[0] != "print" or self.loaded
        out = "\tstate = running\n\tpid = 4242\n" if ok and args[0] == "print" else ""
        return subprocess.CompletedProcess(args, 0 if ok else 113, out, "")


def test_install_status_uninstall_on_macos(monkeypatch, capsys, tmp_path):
    launchctl = FakeLaunchctl()
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(service, "launchctl", launchctl)
    path = tmp_path / "Library/LaunchAgents/com.mlxd.server.plist"

    assert main(["launchd", "install", "--port", "9005"]) == 0
    plist = plistlib.loads(path.read_bytes())
    assert plist["ProgramArguments"][-2:] == ["--port", "9005"]
    assert (tmp_path / "Library/Logs/mlxd").is_dir()
    assert ("bootstrap", f"gui/{service.os.getuid()}", str(path)) in launchctl.calls

    assert main(["launchd", "status"]) == 0
    assert "loaded: state running, pid 4242" in capsys.readouterr().out

    assert main(["launchd", "uninstall"]) == 0
    assert not path.exists() and not launchctl.loaded
    assert main(["launchd", "status"]) == 3
    assert "not installed" in capsys.readouterr().out


def test_systemd_unit_parses_with_literal_specials(capsys):
    text = render(capsys, "systemd", "print", "--port", "9002", "--env", "NOTE=50% of $HOME")
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.read_string(text)
    exec_start = unit["Service"]["ExecStart"]
    assert exec_start == f"{sys.executable} -m mlxd.daemon.cli serve --port 9002"
    assert 'Environment="NOTE=50%% of $HOME"' in text  # no $ expansion in Environment=
    assert unit["Service"]["KillSignal"] == "SIGTERM"
    s = load_settings().server
    assert int(unit["Service"]["TimeoutStopSec"]) > s.drain_timeout_s + s.flush_timeout_s
    assert unit["Install"]["WantedBy"] == "default.target"


def test_systemd_quoting():
    assert service.systemd_quote("/plain/path-1.2") == "/plain/path-1.2"
    assert service.systemd_quote('a "b" c') == '"a \\"b\\" c"'
    assert service.systemd_quote("$X 5%") == '"$$X 5%%"'
