"""``mlxd cluster``: SGLang's router in front of several mlxd daemons, as one process to run.

Each daemon serves the model on its own machine (or port); the router
(``pip install 'mlxd[cluster]'``, a Rust binary in the ``sglang-router`` wheel, which
exists for macOS arm64 and Linux) listens for clients and sends each request to one
daemon. Its ``cache_aware`` policy keeps an approximate prefix tree of the request text
per daemon, so an agent's next turn goes where its conversation is cached (past an
in-flight imbalance it sends new requests to the idlest); ``manual`` pins requests by
their ``X-SMG-Routing-Key`` header (a session key; none: a random daemon);
``round_robin`` ignores both.

The router polls each daemon's ``/health``: 503 while the model loads or while the
daemon drains (``server.drain_notice_s`` makes a daemon say so before it refuses any
request), 200 once it serves, so daemons join, leave and come back without a router
restart. It reads ``/server_info`` once per daemon for the model it lists, and probes
with gRPC over HTTP/2 first, which mlxd refuses (``supervisor.http_config``). This module only builds the router's command line from ``[cluster]`` and the
flags, and supervises the process: SIGTERM/SIGINT/SIGHUP pass to it, and a router that
exits on its own is started again after ``cluster.restart_delay_s``.
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mlxd.daemon.settings import ClusterSettings, Settings, SettingsError, load_settings

log = logging.getLogger("mlxd.cluster")
POLICIES = ("cache_aware", "round_robin", "manual")
INSTALL_HINT = ".venv/bin/pip install -e '.[cluster]' from a checkout (the sglang-router wheel)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``cluster`` subcommand; its flags override ``[cluster]``."""
    cluster = sub.add_parser(
        "cluster", help="run a router in front of several mlxd daemons (see --help)"
    )
    cluster.add_argument(
        "--worker", action="append", metavar="URL", help="a daemon's URL (repeat per daemon)"
    )
    cluster.add_argument("--policy", choices=POLICIES, help="routing policy (cluster.policy)")
    cluster.add_argument("--host", help="address the router listens on (cluster.host)")
    cluster.add_argument("--port", type=int, help="port the router listens on (cluster.port)")
    cluster.add_argument(
        "--metrics-port", type=int, help="the router's Prometheus port (cluster.metrics_port)"
    )
    cluster.add_argument("--config", type=Path, help="TOML file overriding config/default.toml")
    cluster.add_argument(
        "--print", action="store_true", help="print the router's command line; run nothing"
    )


def cluster_settings(args: argparse.Namespace) -> ClusterSettings:
    """``[cluster]`` from defaults < ``--config`` < ``MLXD_CLUSTER__*`` < flags."""
    flags: dict[str, Any] = {}
    for name in ("policy", "host", "port", "metrics_port"):
        if getattr(args, name, None) is not None:
            flags[name] = getattr(args, name)
    if args.worker:
        flags["workers"] = args.worker
    settings: Settings = load_settings(args.config, {"cluster": flags} if flags else {}, os.environ)
    c = settings.cluster
    if not c.workers:
        raise SettingsError("cluster: no daemon to route to; give --worker URL (one per daemon)")
    for url in c.workers:
        check_worker_url(url)
    return c


def check_worker_url(url: str) -> None:
    """A daemon URL the router can use: http(s)://HOST:PORT with nothing after it."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise SettingsError(f"cluster: worker {url!r}: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise SettingsError(f"cluster: worker {url!r} is not an http(s)://HOST:PORT URL")
    if port is None:
        raise SettingsError(f"cluster: worker {url!r} names no port (mlxd serves on 8000)")
    if parts.path.strip("/") or parts.query or parts.fragment:
        raise SettingsError(f"cluster: worker {url!r}: give the daemon's root URL, no path")


def router_executable() -> list[str] | None:
    """How to run the router: this interpreter when the wheel is installed beside mlxd,
    else the ``smg`` launcher on PATH; None when neither is there."""
    if importlib.util.find_spec("sglang_router") is not None:
        return [sys.executable, "-m", "sglang_router.launch_router"]
    found = shutil.which("smg")
    return [found, "launch"] if found else None


def router_arguments(c: ClusterSettings) -> list[str]:
    """The router's flags for ``[cluster]``: the daemons, the policy, fast health checks
    (a draining or dead daemon gets no new request within ``health_check_interval_s``
    times ``health_failure_threshold``), retries on another daemon, and no circuit
    breaker (health checks alone take a daemon out and bring it back)."""
    args = [
        "--host", c.host,
        "--port", str(c.port),
        "--worker-urls", *[u.rstrip("/") for u in c.workers],
        "--policy", c.policy,
        "--prometheus-port", str(c.metrics_port),
        "--health-check-endpoint", "/health",
        "--health-check-interval-secs", str(c.health_check_interval_s),
        "--health-failure-threshold", str(c.health_failure_threshold),
        "--health-success-threshold", str(c.health_success_threshold),
        "--retry-max-retries", str(c.max_retries),
        "--retry-initial-backoff-ms", str(round(c.retry_backoff_s * 1000)),
        "--retry-backoff-multiplier", "2",
        "--disable-circuit-breaker",
        "--request-timeout-secs", str(c.request_timeout_s),
        "--worker-startup-timeout-secs", str(c.worker_startup_timeout_s),
        "--worker-startup-check-interval", str(c.health_check_interval_s),
        "--log-level", c.log_level,
    ]  # fmt: skip
    if c.policy == "cache_aware":
        args += [
            "--cache-threshold", str(c.cache_threshold),
            "--balance-abs-threshold", str(c.balance_abs_threshold),
            "--balance-rel-threshold", str(c.balance_rel_threshold),
        ]  # fmt: skip
    return args


def router_command(c: ClusterSettings) -> list[str]:
    """The whole command line; ``SettingsError`` when the router is not installed."""
    executable = router_executable()
    if executable is None:
        raise SettingsError(f"cluster: the router is not installed: {INSTALL_HINT}")
    return [*executable, *router_arguments(c)]


class Supervisor:
    """Runs the router; passes the stop signals on; starts it again when it exits on its
    own (a crash), after ``restart_delay_s``. A router that exits within its first
    ``restart_delay_s`` * 5 seconds twice in a row (bad flags, a port in use) ends it."""

    def __init__(self, command: list[str], restart_delay_s: float):
        self.command, self.restart_delay_s = command, restart_delay_s
        self.proc: subprocess.Popen | None = None
        self.stopping: int | None = None

    def on_signal(self, signum: int, frame: object) -> None:
        if signum != signal.SIGHUP:
            self.stopping = signum
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signum)

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self.on_signal)
        quick_exits = 0
        while True:
            started = time.monotonic()
            self.proc = subprocess.Popen(self.command, preexec_fn=_die_with_parent)
            log.info("router started (pid %d)", self.proc.pid)
            code = self.proc.wait()
            if self.stopping is not None:
                return 0 if code in (0, -self.stopping) else code
            quick = time.monotonic() - started < self.restart_delay_s * 5
            quick_exits = quick_exits + 1 if quick else 0
            if quick_exits >= 2:
                log.error("the router exited with %s twice soon after starting; giving up", code)
                return code or 1
            log.warning("the router exited with %s; starting it again", code)
            time.sleep(self.restart_delay_s)
            if self.stopping is not None:
                return 0


def _die_with_parent() -> None:
    """Linux: the router gets SIGTERM when ``mlxd cluster`` dies, even by SIGKILL (macOS
    has no such call: there a killed wrapper leaves the router running)."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def cluster_command(args: argparse.Namespace) -> int:
    try:
        c = cluster_settings(args)
        command = router_command(c)
    except SettingsError as exc:
        print(f"mlxd: {exc}", file=sys.stderr)
        return 2
    if args.print:
        print(" ".join(command))
        return 0
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log.info("routing http://%s:%d to %s (%s)", c.host, c.port, ", ".join(c.workers), c.policy)
    return Supervisor(command, c.restart_delay_s).run()
