"""Running mlxd as a service: a launchd LaunchAgent (macOS) or a systemd user unit (Linux).

``mlxd launchd install | uninstall | status`` writes, removes or reports
``~/Library/LaunchAgents/<label>.plist``, rendered from
``config/launchd.plist.template``; ``mlxd launchd install --print`` renders it
on any platform. ``mlxd systemd print`` renders ``config/systemd.service.template``.
Both run this venv's interpreter with ``-m mlxd.daemon.cli serve ...`` and give the
service manager a stop timeout longer than mlxd's drain, so SIGTERM drains. With
``--router`` they run ``mlxd cluster --worker URL ...`` instead (``daemon/cluster.py``),
from ``config/*.router.*.template``: always restarted, labelled ``com.mlxd.router``.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from string import Template
from xml.sax.saxutils import escape

from mlxd.daemon import cluster
from mlxd.daemon.settings import SettingsError, load_settings

# ``config/`` beside the packages: the checkout's, or ``mlxd/config`` in an installed wheel.
TEMPLATES = Path(__file__).resolve().parent.parent / "config"
DEFAULT_LABEL = "com.mlxd.server"


@dataclass(frozen=True)
class ServiceSpec:
    """What either service manager needs: the command line, environment, logs, stop timeout."""

    label: str
    arguments: tuple[str, ...]
    environment: dict[str, str]
    working_directory: Path
    log_dir: Path
    exit_timeout: int
    kind: str = "server"  # or "router": `mlxd cluster`, from the *.router.* templates


def add_parsers(sub: argparse._SubParsersAction) -> None:
    """The ``launchd`` and ``systemd`` subcommands."""
    launchd = sub.add_parser("launchd", help="install, remove or inspect the macOS LaunchAgent")
    actions = launchd.add_subparsers(dest="action", required=True)
    install = actions.add_parser("install", help="write the plist and load it with launchctl")
    _service_options(install, DEFAULT_LABEL)
    install.add_argument("--print", action="store_true", help="print the plist; change nothing")
    for name in ("uninstall", "status"):
        action = actions.add_parser(name, help=f"{name} the LaunchAgent")
        action.add_argument("--label", default=DEFAULT_LABEL)
    systemd = sub.add_parser("systemd", help="print a systemd user unit")
    systemd_actions = systemd.add_subparsers(dest="action", required=True)
    _service_options(systemd_actions.add_parser("print", help="print the unit file"), "mlxd")


def _service_options(parser: argparse.ArgumentParser, label: str) -> None:
    parser.add_argument("model", nargs="?", help="model to serve (default: the config's)")
    parser.add_argument("--label", default=label, help=f"service name (default: {label})")
    parser.add_argument("--config", type=Path, help="TOML settings file for the service")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--log-dir", type=Path, help="default: ~/Library/Logs/mlxd")
    parser.add_argument(
        "--env", action="append", default=[], metavar="KEY=VALUE", help="service environment"
    )
    router = parser.add_argument_group("router (`mlxd cluster` in front of several daemons)")
    router.add_argument("--router", action="store_true", help="run the router, not a daemon")
    router.add_argument("--worker", action="append", metavar="URL", help="a daemon's URL")
    router.add_argument("--policy", choices=cluster.POLICIES, help="routing policy")


def spec_from_args(args: argparse.Namespace) -> ServiceSpec:
    """The service's command line; the config is validated now, not at the first start."""
    config = args.config.expanduser().resolve() if args.config else None
    if args.router:
        return _router_spec(args, config)
    settings = load_settings(config)  # SettingsError: reported by the caller
    serve = [sys.executable, "-m", "mlxd.daemon.cli", "serve"]
    if args.model:
        model = Path(args.model).expanduser()
        serve.append(str(model.resolve()) if model.exists() else args.model)
    if config:
        serve += ["--config", str(config)]
    if args.host:
        serve += ["--host", args.host]
    if args.port is not None:
        serve += ["--port", str(args.port)]
    s = settings.server
    return ServiceSpec(
        label=args.label,
        arguments=tuple(serve),
        environment=_environment(args.env),
        working_directory=Path.home(),  # installed or not, the code is imported by name
        log_dir=(args.log_dir or Path("~/Library/Logs/mlxd")).expanduser(),
        exit_timeout=int(s.drain_timeout_s + s.flush_timeout_s) + 10,
    )


ROUTER_LABELS = {DEFAULT_LABEL: "com.mlxd.router", "mlxd": "mlxd-router"}


def _router_spec(args: argparse.Namespace, config: Path | None) -> ServiceSpec:
    """``mlxd cluster`` as the service: the flags given are checked now, as it would."""
    if args.model:
        raise SettingsError("--router runs no model: give the daemons' URLs with --worker")
    checked = argparse.Namespace(
        config=config, worker=args.worker, policy=args.policy, host=args.host, port=args.port,
        metrics_port=None,
    )  # fmt: skip
    cluster.router_command(cluster.cluster_settings(checked))  # the router installed, too
    command = [sys.executable, "-m", "mlxd.daemon.cli", "cluster"]
    for url in args.worker or []:
        command += ["--worker", url]
    for flag, value in (("--config", config), ("--policy", args.policy), ("--host", args.host)):
        command += [flag, str(value)] if value is not None else []
    command += ["--port", str(args.port)] if args.port is not None else []
    label = ROUTER_LABELS.get(args.label, args.label)
    return ServiceSpec(
        label=label,
        arguments=tuple(command),
        environment=_environment(args.env),
        working_directory=Path.home(),
        log_dir=(args.log_dir or Path("~/Library/Logs/mlxd")).expanduser(),
        exit_timeout=30,  # the router holds no request of its own past its clients' streams
        kind="router",
    )


def _environment(pairs: list[str]) -> dict[str, str]:
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin",
        "PYTHONUNBUFFERED": "1",
    }
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SettingsError(f"--env expects KEY=VALUE, got {pair!r}")
        env[key] = value
    return env


# ---- rendering ----------------------------------------------------------------------------


def _suffix(spec: ServiceSpec) -> str:
    """The template's name part: ``.router`` for the router's, none for the daemon's."""
    return ".router" if spec.kind == "router" else ""


def render_plist(spec: ServiceSpec) -> str:
    def string(value: str, indent: str) -> str:
        return f"{indent}<string>{escape(value)}</string>"

    env = "\n".join(
        f"        <key>{escape(k)}</key>\n{string(v, '        ')}"
        for k, v in spec.environment.items()
    )
    template = Template((TEMPLATES / f"launchd{_suffix(spec)}.plist.template").read_text())
    return template.substitute(
        label=escape(spec.label),
        program_arguments="\n".join(string(a, "        ") for a in spec.arguments),
        working_directory=escape(str(spec.working_directory)),
        environment=env,
        exit_timeout=spec.exit_timeout,
        stdout_path=escape(str(spec.log_dir / f"{spec.label}.out.log")),
        stderr_path=escape(str(spec.log_dir / f"{spec.label}.err.log")),
    )


_PLAIN = re.compile(r"[A-Za-z0-9_@+=:,./-]+")


def systemd_quote(arg: str, *, expands_variables: bool = True) -> str:
    """One ExecStart (or Environment) word, with specifiers (%) and variables ($) kept literal.

    systemd expands ``$VAR`` in ExecStart but not in Environment; ``%`` in both.
    """
    arg = arg.replace("%", "%%")
    if expands_variables:
        arg = arg.replace("$", "$$")
    if _PLAIN.fullmatch(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_unit(spec: ServiceSpec) -> str:
    env = "\n".join(
        f"Environment={systemd_quote(f'{k}={v}', expands_variables=False)}"
        for k, v in spec.environment.items()
    )
    template = Template((TEMPLATES / f"systemd{_suffix(spec)}.service.template").read_text())
    return template.substitute(
        label=spec.label,
        exec_start=" ".join(systemd_quote(a) for a in spec.arguments),
        working_directory=systemd_quote(str(spec.working_directory)),
        environment=env,
        exit_timeout=spec.exit_timeout,
    )


# ---- launchctl ----------------------------------------------------------------------------


def plist_path(label: str) -> Path:
    return Path("~/Library/LaunchAgents").expanduser() / f"{label}.plist"


def launchctl(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["launchctl", *args], capture_output=True, text=True, check=False)


def _domain() -> str:
    return f"gui/{os.getuid()}"


def _not_macos(action: str) -> int:
    print(
        f"mlxd: launchd {action} works on macOS only; on this system use "
        "`mlxd launchd install --print` to see the plist, or `mlxd systemd print` "
        "for a systemd user unit",
        file=sys.stderr,
    )
    return 2


def install(spec: ServiceSpec) -> int:
    path = plist_path(spec.label)
    path.parent.mkdir(parents=True, exist_ok=True)
    spec.log_dir.mkdir(parents=True, exist_ok=True)
    launchctl("bootout", f"{_domain()}/{spec.label}")  # a previous version, if loaded
    path.write_text(render_plist(spec))
    result = launchctl("bootstrap", _domain(), str(path))
    if result.returncode != 0:
        print(f"mlxd: wrote {path}, but launchctl bootstrap failed: {result.stderr.strip()}")
        return 1
    print(f"mlxd: installed and started {spec.label} ({path}); logs in {spec.log_dir}")
    return 0


def uninstall(label: str) -> int:
    path = plist_path(label)
    launchctl("bootout", f"{_domain()}/{label}")
    if not path.exists():
        print(f"mlxd: {label} is not installed ({path} does not exist)")
        return 0
    path.unlink()
    print(f"mlxd: stopped {label} and removed {path}")
    return 0


def status(label: str) -> int:
    path = plist_path(label)
    result = launchctl("print", f"{_domain()}/{label}")
    installed = "installed" if path.exists() else "not installed"
    if result.returncode != 0:
        print(f"{label}: {installed} ({path}); not loaded")
        return 0 if path.exists() else 3
    fields = dict(re.findall(r"^\s*(state|pid|last exit code) = (.*)$", result.stdout, re.M))
    details = ", ".join(f"{k} {v}" for k, v in fields.items())
    print(f"{label}: {installed} ({path}); loaded: {details}")
    return 0


# ---- commands -----------------------------------------------------------------------------


def launchd_command(args: argparse.Namespace) -> int:
    if args.action == "install":
        try:
            spec = spec_from_args(args)
        except SettingsError as exc:
            print(f"mlxd: bad config: {exc}", file=sys.stderr)
            return 2
        if args.print:
            sys.stdout.write(render_plist(spec))
            return 0
    if sys.platform != "darwin":
        return _not_macos(args.action)
    if args.action == "install":
        return install(spec)
    return uninstall(args.label) if args.action == "uninstall" else status(args.label)


def systemd_command(args: argparse.Namespace) -> int:
    try:
        spec = spec_from_args(args)
    except SettingsError as exc:
        print(f"mlxd: bad config: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(render_unit(spec))
    return 0
