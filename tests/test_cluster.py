"""``mlxd cluster``: two real daemons on a tiny model behind the real SGLang router process.

Conversations stay on one daemon (per-daemon request counts from ``/metrics``); a
session header pins requests under ``manual``; a draining daemon (SIGTERM,
``server.drain_notice_s``) loses no request; a daemon killed mid-stream ends its stream
with an error, the other takes new requests, and the daemon rejoins when it is back;
a killed router is started again by ``mlxd cluster`` and the daemons keep their caches.
The router probes each daemon with a gRPC (HTTP/2) health check when it registers it:
mlxd refuses HTTP/2 streams, and serves on.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import metric
from tests.processes import free_port, wait_healthy

ROOT = Path(__file__).resolve().parent.parent
WAIT_S = 300.0  # a hang, not a slow machine


def _router_installed() -> None:
    from mlxd.daemon.cluster import INSTALL_HINT, router_executable

    if router_executable() is None:
        reason = f"the router is not installed ({INSTALL_HINT})"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


class Daemon:
    """``mlxd serve`` on a fixed loopback port, stopped and started again as a test needs."""

    def __init__(self, model: Path, tmp: Path, name: str):
        self.model, self.port, self.name = model, free_port(), name
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.launch()
        self.wait()

    def wait(self) -> None:
        wait_healthy(self.url, lambda: self.proc.poll() is None, WAIT_S, self.log.read_text)

    def launch(self) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "MLXD_SERVER__DRAIN_NOTICE_S": "3"}
        command = [sys.executable, "-m", "mlxd.daemon.cli", "serve", str(self.model)]
        with self.log.open("a") as out:
            self.proc = subprocess.Popen(
                [*command, "--port", str(self.port)],
                cwd=ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    def requests(self) -> float:
        """Requests this daemon has finished (0 when it is down)."""
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=WAIT_S).text
        except httpx.HTTPError:
            return 0.0
        return metric(text, "mlxd_requests_total") if "mlxd_requests_total{" in text else 0.0

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Router:
    """``mlxd cluster`` (the wrapper) in front of the daemons."""

    def __init__(self, daemons: list[Daemon], tmp: Path, policy: str):
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / f"router-{policy}.log"
        self.daemons = daemons
        workers = [a for d in daemons for a in ("--worker", d.url)]
        command = [sys.executable, "-m", "mlxd.daemon.cli", "cluster", *workers]
        command += ["--port", str(self.port), "--metrics-port", str(self.metrics_port)]
        env = {**os.environ, "MLXD_CLUSTER__RESTART_DELAY_S": "0.5"}
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                [*command, "--policy", policy], cwd=ROOT, stdout=out, stderr=out, env=env
            )
        self.wait_serving()

    def router_pids(self) -> list[int]:
        return [int(p) for p in re.findall(r"router started \(pid (\d+)\)", self.log.read_text())]

    def wait_serving(self) -> None:
        """Until the router serves and holds every daemon as healthy (a restarted router
        answers once it has registered one daemon, and registers the next a while later)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            try:
                models = httpx.get(f"{self.url}/v1/models", timeout=5)
                if models.status_code == 200 and all(
                    _healthy_in_router(self, d) for d in self.daemons
                ):
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            time.sleep(0.2)
        raise AssertionError(f"router not serving:\n{self.log.read_text()[-3000:]}")

    def stop(self) -> int:
        """SIGTERM (passed on to the router); a kill only if that does not end it."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=WAIT_S)
        finally:
            self.proc.kill()


# ---- the command line and the service files (no daemon) ------------------------------------


def test_the_router_command_line_comes_from_the_flags_and_settings(capsys, monkeypatch):
    from mlxd.daemon.cli import main

    _router_installed()
    monkeypatch.setenv("MLXD_CLUSTER__HEALTH_CHECK_INTERVAL_S", "3")
    argv = ["cluster", "--worker", "http://a.local:8000", "--worker", "http://b.local:8001/"]
    assert main([*argv, "--policy", "round_robin", "--port", "9000", "--print"]) == 0
    words = capsys.readouterr().out.split()
    at = words.index("--worker-urls")
    assert words[at + 1 : at + 3] == ["http://a.local:8000", "http://b.local:8001"]
    pairs = dict(zip(words, words[1:], strict=False))
    assert pairs["--policy"] == "round_robin" and pairs["--port"] == "9000"
    assert pairs["--health-check-interval-secs"] == "3"
    assert pairs["--health-check-endpoint"] == "/health"
    assert "--cache-threshold" not in words  # cache_aware's own flags only for it


@pytest.mark.parametrize(
    ("url", "why"),
    [("localhost:8000", "http(s)://HOST:PORT"), ("http://a.local", "no port"),
     ("http://a.local:8000/v1", "no path"), ("http://a.local:x", "worker")],
)  # fmt: skip
def test_a_worker_url_the_router_cannot_use_is_refused(capsys, url, why):
    from mlxd.daemon.cli import main

    assert main(["cluster", "--worker", url, "--print"]) == 2
    assert why in capsys.readouterr().err


def test_the_router_service_runs_mlxd_cluster(capsys):
    import configparser

    from mlxd.daemon.cli import main

    _router_installed()
    argv = ["systemd", "print", "--router", "--worker", "http://a.local:8000", "--host", "0.0.0.0"]
    assert main(argv) == 0
    unit = configparser.ConfigParser(interpolation=None, strict=False)
    unit.read_string(capsys.readouterr().out)
    exec_start = unit["Service"]["ExecStart"].split()
    assert exec_start[1:] == ["-m", "mlxd.daemon.cli", "cluster", "--worker",
                              "http://a.local:8000", "--host", "0.0.0.0"]  # fmt: skip
    assert unit["Service"]["Restart"] == "always"
    assert main(["systemd", "print", "--router"]) == 2  # no daemon to route to


# ---- two daemons behind the router -----------------------------------------------------------


@pytest.fixture(scope="module")
def cluster(tiny_models, tmp_path_factory):
    _router_installed()
    tmp = tmp_path_factory.mktemp("cluster")
    daemons = [Daemon(tiny_models("llama"), tmp, name) for name in ("a", "b")]
    routers: list[Router] = []
    try:
        for d in daemons:  # both load at once
            d.launch()
        for d in daemons:
            d.wait()
        routers.append(Router(daemons, tmp, "cache_aware"))
        yield daemons, routers[0], tmp
    finally:
        for r in routers:
            r.stop()
        for d in daemons:
            d.stop()


def _chat(url: str, messages: list[dict], max_tokens: int = 4, headers=None) -> dict:
    body = {"model": "llama", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/chat/completions", json=body, headers=headers, timeout=WAIT_S)
    assert r.status_code == 200, r.text
    return r.json()


def _system(tag: str) -> dict:
    """A system prompt of a few hundred tokens, its own for each conversation."""
    text = " ".join(f"{tag} rule {i}: keep the {tag} ledger balanced." for i in range(40))
    return {"role": "system", "content": text}


def _conversation(url: str, tag: str, turns: int, headers=None) -> list[dict]:
    messages, usages = [_system(tag)], []
    for t in range(turns):
        messages.append({"role": "user", "content": f"{tag} turn {t}: what next?"})
        answer = _chat(url, messages, headers=headers)
        usages.append(answer["usage"])
        messages.append(answer["choices"][0]["message"])
    return usages


def _counts(daemons: list[Daemon]) -> list[float]:
    return [d.requests() for d in daemons]


@pytest.mark.mlx
def test_an_http2_request_is_refused_and_the_daemon_serves_on(cluster):
    import socket

    import h2.config
    import h2.connection
    import h2.events

    daemon = cluster[0][0]
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    headers = [(":method", "POST"), (":path", "/v1/chat/completions"), (":scheme", "http"),
               (":authority", "127.0.0.1"), ("content-type", "application/grpc")]  # fmt: skip
    conn.send_headers(1, headers, end_stream=True)
    events = []
    with socket.create_connection(("127.0.0.1", daemon.port), timeout=WAIT_S) as sock:
        sock.sendall(conn.data_to_send())
        while not any(isinstance(e, h2.events.StreamReset | h2.events.ConnectionTerminated)
                      for e in events):  # fmt: skip
            data = sock.recv(65536)
            if not data:
                break
            events += conn.receive_data(data)
    assert not any(isinstance(e, h2.events.ResponseReceived) for e in events), events
    assert httpx.get(f"{daemon.url}/health", timeout=WAIT_S).status_code == 200


@pytest.mark.mlx
def test_the_router_lists_the_daemons_model(cluster):
    _, router, _ = cluster
    models = httpx.get(f"{router.url}/v1/models", timeout=WAIT_S).json()
    assert [m["id"] for m in models["data"]] == ["llama"]


@pytest.mark.mlx
def test_conversations_stay_on_the_daemon_that_holds_their_cache(cluster):
    daemons, router, _ = cluster
    for c in range(4):
        before = _counts(daemons)
        usages = _conversation(router.url, f"conv{c}", turns=3)
        delta = [after - b for after, b in zip(_counts(daemons), before, strict=True)]
        assert sorted(delta) == [0, 3], f"conversation {c} was split: {delta}"
        # turns 2 and 3 reuse the prefix cached on that daemon
        assert all((u["prompt_tokens_details"] or {})["cached_tokens"] > 0 for u in usages[1:])


@pytest.mark.mlx
def test_a_session_header_pins_requests_under_the_manual_policy(cluster):
    daemons, _, tmp = cluster
    router = Router(daemons, tmp, "manual")
    try:
        for session in ("alpha", "beta", "gamma"):
            before = _counts(daemons)
            for i in range(3):  # unrelated prompts: only the header ties them
                _chat(router.url, [{"role": "user", "content": f"{i} {session}"}],
                      headers={"X-SMG-Routing-Key": session})  # fmt: skip
            delta = [a - b for a, b in zip(_counts(daemons), before, strict=True)]
            assert sorted(delta) == [0, 3], f"session {session} was split: {delta}"
        assert router.stop() == 0
    finally:
        router.stop()


@pytest.mark.mlx
def test_a_killed_router_is_started_again_and_the_daemons_keep_their_caches(cluster):
    daemons, router, _ = cluster
    messages = [_system("restart"), {"role": "user", "content": "first"}]
    before = _counts(daemons)
    first = _chat(router.url, messages)
    served = [a - b for a, b in zip(_counts(daemons), before, strict=True)]
    holder = daemons[served.index(1)]
    caches = [httpx.get(f"{d.url}/v1/cache", timeout=WAIT_S).json() for d in daemons]
    pids = router.router_pids()
    os.kill(pids[-1], signal.SIGKILL)  # the router itself, not `mlxd cluster`
    deadline = time.monotonic() + WAIT_S
    while len(router.router_pids()) == len(pids):
        assert time.monotonic() < deadline, router.log.read_text()[-3000:]
        time.sleep(0.1)
    router.wait_serving()
    assert caches == [httpx.get(f"{d.url}/v1/cache", timeout=WAIT_S).json() for d in daemons]
    again = _chat(holder.url, messages)  # the conversation's prefix is still cached there
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= first["usage"]["prompt_tokens"] - 1
    _chat(router.url, messages)  # and the new router serves


@pytest.mark.mlx
def test_a_killed_daemon_fails_its_stream_and_rejoins(cluster):
    daemons, router, _ = cluster
    body = {"model": "llama", "max_tokens": 4000, "stream": True,
            "messages": [{"role": "user", "content": "a long story"}]}  # fmt: skip
    outcome: dict = {}

    def stream() -> None:
        lines = []
        try:
            with httpx.stream(
                "POST", f"{router.url}/v1/chat/completions", json=body, timeout=WAIT_S
            ) as r:
                for line in r.iter_lines():
                    lines.append(line)
            outcome["ended"] = "cleanly"
        except httpx.HTTPError as exc:
            outcome["ended"] = repr(exc)
        outcome["lines"] = lines

    reader = threading.Thread(target=stream)
    reader.start()
    deadline = time.monotonic() + WAIT_S
    victim = None
    while victim is None:
        assert time.monotonic() < deadline and reader.is_alive(), outcome
        for d in daemons:
            running = httpx.get(f"{d.url}/metrics", timeout=WAIT_S).text
            if metric(running, "mlxd_requests_running") > 0:
                victim = d
        time.sleep(0.05)
    victim.proc.kill()
    victim.proc.wait()
    reader.join(timeout=WAIT_S)
    # no silent truncation: the stream breaks (the router ends the chunked body early),
    # or ends with an error event; never a finish_reason and [DONE] as if it were whole
    data = [ln for ln in outcome["lines"] if ln.startswith("data:")]
    assert outcome["ended"] != "cleanly" or any('"error"' in ln for ln in data), data[-3:]
    assert "data: [DONE]" not in outcome["lines"]
    other = daemons[1 - daemons.index(victim)]
    before = other.requests()
    for i in range(4):  # new requests go to the daemon still up
        _chat(router.url, [{"role": "user", "content": f"after the kill {i}"}])
    assert other.requests() - before == 4
    victim.start()  # it rejoins, no router restart: healthy again, and it gets requests
    deadline = time.monotonic() + WAIT_S
    while not _healthy_in_router(router, victim):
        assert time.monotonic() < deadline, router.log.read_text()[-3000:]
        time.sleep(0.2)
    before = victim.requests()
    for burst in range(10):  # concurrent requests: the policy sends some to the idle daemon
        clients = [threading.Thread(target=_chat, args=(router.url, [
            {"role": "user", "content": f"rejoin {burst} {i}"}])) for i in range(4)]  # fmt: skip
        for t in clients:
            t.start()
        for t in clients:
            t.join(timeout=WAIT_S)
        if victim.requests() > before:
            break
    assert victim.requests() > before, "the restarted daemon got no request"


def _healthy_in_router(router: Router, daemon: Daemon) -> bool:
    workers = httpx.get(f"{router.url}/workers", timeout=WAIT_S).json()["workers"]
    return any(w["url"] == daemon.url and w["is_healthy"] for w in workers)


def _load(url: str, stop: threading.Event, results: list, tag: str) -> None:
    """Short requests one after another until ``stop``; each result is a status or error."""
    i = 0
    while not stop.is_set():
        body = {"model": "llama", "max_tokens": 2,
                "messages": [{"role": "user", "content": f"{tag} {i}"}]}  # fmt: skip
        try:
            r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=WAIT_S)
            results.append(r.status_code if r.status_code == 200 else f"{r.status_code} {r.text}")
        except httpx.HTTPError as exc:
            results.append(repr(exc))
        i += 1


@pytest.mark.mlx
def test_a_draining_daemon_loses_no_request(cluster):
    daemons, router, _ = cluster
    stop, results = threading.Event(), []
    clients = [threading.Thread(target=_load, args=(router.url, stop, results, f"c{i}"))
               for i in range(3)]  # fmt: skip
    for t in clients:
        t.start()
    try:
        while len(results) < 6:
            time.sleep(0.1)
        draining = daemons[0]
        draining.proc.send_signal(signal.SIGTERM)
        health = httpx.get(f"{draining.url}/health", timeout=WAIT_S)
        # said at once (a router stops sending), while requests are still admitted
        assert (health.status_code, health.json()) == (503, {"status": "draining"})
        assert draining.proc.wait(timeout=WAIT_S) == 0
        after = len(results)
        while len(results) < after + 6:  # the other daemon serves on
            time.sleep(0.1)
    finally:
        stop.set()
        for t in clients:
            t.join(timeout=WAIT_S)
    assert [r for r in results if r != 200] == []
    assert "draining in 3.0s" in draining.log.read_text()
