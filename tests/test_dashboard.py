"""The dashboard (issue 24): the history rings by hand, its JSON and load / unload routes
over fake models, ``mlxd status``, and the page itself in a real browser (Debian's
``chromium`` driven by ``playwright``) against a real ``mlxd serve`` of tiny models.

Screenshots go to ``$MLXD_SCREENSHOTS`` (else pytest's tmp dir); nothing is committed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import msgspec
import pytest
import trio
from mlxd.daemon import cli
from mlxd.daemon.dashboard import terminal
from mlxd.daemon.history import History, percentile
from mlxd.daemon.settings import load_settings
from mlxd.daemon.telemetry import RequestTrace

from tests.conftest import real_server, settings_with
from tests.fakes import FakeRunner
from tests.processes import free_port, wait_healthy
from tests.test_models_multi import FakeModel, ask, multi_settings, served

CHAT = "/v1/chat/completions"
KEY = "dashboard-test-key"
WAIT_S = 120.0  # a hang, not a slow machine
ROOT = Path(__file__).resolve().parent.parent


def trace(rid, start, first=None, started=None, prompt=0, cached=0, model="m"):
    t = RequestTrace(rid, start, model=model, api="/v1/chat/completions")
    t.started_at, t.first_token_at = started, first
    t.prompt_tokens, t.cached_tokens = prompt, cached
    return t


# ---- the history, hand-fed ------------------------------------------------------------------


def test_a_sample_counts_each_event_in_the_period_it_happened():
    h = History(period_s=1.0, max_samples=10, max_requests=10)
    h.sample(0.0, 1000.0, [], 0, 0)  # the first period starts here
    h.add_tokens(30)
    h.add_tokens(20)
    running = trace("r1", 0.5, first=0.9, started=0.6, prompt=100, cached=75)
    closed = trace("r2", 0.2, first=0.4, started=0.3, prompt=100, cached=25)
    closed.close(0.8)
    h.request_done(closed, 1000.8)
    old = trace("r0", -5.0, first=-4.0, started=-4.5, prompt=50, cached=50)  # an earlier period
    s = h.sample(2.0, 1002.0, [running, old], running=1, queued=2, speculation={"m": (10, 7)})
    assert s.tokens_per_s == pytest.approx(25.0)  # 50 tokens over 2 s
    assert (s.running, s.queued, s.finished) == (1, 2, 1)
    assert s.ttft_p50 == pytest.approx(0.2) and s.ttft_p95 == pytest.approx(0.4)
    assert s.cache_hit_rate == pytest.approx(0.5)  # (75 + 25) / (100 + 100)
    assert s.spec_acceptance == pytest.approx(0.7)
    # nothing new: no rate where nothing happened; the drafts are counted once
    quiet = h.sample(3.0, 1003.0, [running], 1, 0, speculation={"m": (10, 7)})
    assert (quiet.tokens_per_s, quiet.ttft_p50, quiet.cache_hit_rate) == (0.0, None, None)
    assert quiet.spec_acceptance is None
    # a reloaded model's counters start again from zero
    assert h.sample(4.0, 1004.0, [], 0, 0, speculation={"m": (4, 1)}).spec_acceptance == 0.25
    minute = h.window(1004.0)
    assert minute.requests == 1 and minute.ttft_p95 == pytest.approx(0.4)
    assert minute.tokens_per_s == pytest.approx(50 / 5)  # 50 tokens in the 5 s sampled


def test_a_burst_between_two_samples_shows_in_the_period():
    """Requests that start and end between two samples: the period keeps the most seen
    after each engine step, then starts again from what is open."""
    h = History(period_s=1.0, max_samples=10, max_requests=10)
    h.sample(0.0, 1000.0, [], 0, 0)
    for running, queued in ((3, 0), (8, 5), (2, 0)):
        h.note_load(running, queued)
    burst = h.sample(1.0, 1001.0, [], 0, 0)  # all done by the sample
    assert (burst.running, burst.queued) == (8, 5)
    h.note_load(1, 0)
    assert (lambda s: (s.running, s.queued))(h.sample(2.0, 1002.0, [], 2, 0)) == (2, 0)
    assert (lambda s: (s.running, s.queued))(h.sample(3.0, 1003.0, [], 0, 0)) == (0, 0)


def test_the_rings_are_bounded_and_a_cursor_gets_only_newer_entries():
    h = History(period_s=1.0, max_samples=3, max_requests=2)
    for i in range(5):
        h.sample(float(i), 1000.0 + i, [], 0, 0)
        done = trace(f"r{i}", float(i))
        done.close(i + 0.5)
        h.request_done(done, 1000.5 + i)
    assert [s.seq for s in h.samples_since(0)] == [2, 3, 4]
    assert [s.seq for s in h.samples_since(4)] == [4]
    assert h.samples_since(h.next_sample) == []
    assert [r.id for r in h.requests_since(0)] == ["r3", "r4"]
    assert h.requests_since(h.next_request) == []
    assert percentile([3.0, 1.0, 2.0], 0.5) == 2.0 and percentile([], 0.5) is None


def test_the_dashboard_settings_are_named_and_checked():
    d = load_settings().dashboard
    assert d.enabled and d.max_samples == 900 and d.recent_requests == 100
    with pytest.raises(Exception, match="sample_period_s"):
        settings_with(dashboard={"sample_period_s": 0})


# ---- the JSON routes over fake models -----------------------------------------------------


def keyed(**sections):
    raw = msgspec.to_builtins(multi_settings({"id": "a", "preload": True}, "b"))
    raw["auth"]["api_keys"] = [KEY]
    raw["dashboard"]["sample_period_s"] = 0.1
    for section, values in sections.items():
        raw[section].update(values)
    return msgspec.convert(raw, type=type(load_settings()))


AUTH = {"Authorization": f"Bearer {KEY}"}


async def dashboard(c, query=""):
    r = await c.get(f"/v1/dashboard{query}", headers=AUTH)
    assert r.status_code == 200, await r.get_data()
    return json.loads(await r.get_data())


async def test_the_page_loads_without_a_key_but_no_data_route_does():
    async with served(keyed(), {"a": FakeModel(), "b": FakeModel()}) as (c, _):
        for path in ("/", "/dashboard/app.js", "/dashboard/style.css"):
            r = await c.get(path)
            assert r.status_code == 200, path
            assert "default-src 'none'" in r.headers["Content-Security-Policy"]
            assert KEY not in (await r.get_data()).decode()
        page = (await (await c.get("/")).get_data()).decode()
        assert "/dashboard/app.js" in page and "http" not in page.split("<body>")[1]
        assert (await c.get("/v1/dashboard")).status_code == 401
        for action in ("load", "unload"):
            r = await c.post(f"/v1/models/b/{action}", json={})
            assert r.status_code == 401
        assert (await c.get("/v1/dashboard", headers={"x-api-key": "wrong"})).status_code == 401
        assert (await dashboard(c))["state"] == "ready"


async def test_the_json_lists_finished_requests_and_samples_but_never_their_content():
    async with served(keyed(), {"a": FakeModel(), "b": FakeModel()}) as (c, p):
        for text in ("secret prompt one", "secret prompt two"):
            r = await c.post(CHAT, json=ask("a", text), headers=AUTH)
            assert r.status_code == 200
        with trio.fail_after(WAIT_S):
            while sum(s.finished for s in p.history.samples) < 2:
                await trio.sleep(0.05)
        view = await dashboard(c)
        raw = json.dumps(view).lower()
        assert "secret" not in raw and "prompt one" not in raw
        recent = view["recent"]
        assert [r["model"] for r in recent] == ["a", "a"]
        assert {r["api"] for r in recent} == {CHAT}
        assert all(r["status"] == 200 and r["finish_reason"] == "stop" for r in recent)
        assert all(r["prompt_tokens"] > 0 and r["generated_tokens"] > 0 for r in recent)
        assert all(r["ttft_s"] is not None for r in recent)
        assert sum(s["finished"] for s in view["samples"]) == 2
        assert sum(s["tokens_per_s"] for s in view["samples"]) > 0
        assert view["last_minute"]["requests"] == 2
        rows = {m["id"]: m for m in view["models"]}
        assert rows["a"]["finished_requests"] == 2 and rows["b"]["state"] == "unloaded"
        # the cursors: only what is newer
        newer = await dashboard(c, f"?since={view['next_sample']}&recent_since=2")
        assert newer["recent"] == [] and all(
            s["seq"] >= view["next_sample"] for s in newer["samples"]
        )
        r = await c.get("/v1/dashboard?since=-1", headers=AUTH)
        assert r.status_code == 400 and b"since" in await r.get_data()


async def test_load_and_unload_a_models_entry():
    b = FakeModel(runner=FakeRunner(step_delay=0.05))
    async with served(keyed(), {"a": FakeModel(), "b": b}) as (c, p):
        r = await c.post("/v1/models/b/load", json={}, headers=AUTH)
        assert r.status_code == 200, await r.get_data()
        assert json.loads(await r.get_data())["state"] == "loaded" and b.loads == 1

        async def slow() -> None:
            await c.post(CHAT, json=ask("b", "x" * 40), headers=AUTH)

        async with trio.open_nursery() as nursery:  # a request in flight: b stays
            nursery.start_soon(slow)
            with trio.fail_after(WAIT_S):
                while not p.sessions:
                    await trio.sleep(0.01)
            r = await c.post("/v1/models/b/unload", json={}, headers=AUTH)
            assert r.status_code == 409 and b"in flight" in await r.get_data()
        r = await c.post("/v1/models/b/unload", json={}, headers=AUTH)
        assert r.status_code == 200, await r.get_data()
        row = json.loads(await r.get_data())
        assert (row["state"], row["unloads"], row["last_unload_reason"]) == (
            "unloaded",
            1,
            "operator",
        )
        again = await c.post("/v1/models/b/unload", json={}, headers=AUTH)  # nothing to do
        assert again.status_code == 200
        r = await c.post("/v1/models/nope/load", json={}, headers=AUTH)
        assert r.status_code == 404
        assert (await c.post("/v1/models/b/load", headers=AUTH)).status_code == 415  # not JSON


async def test_an_embedding_models_entry_loads_by_hand_too():
    settings = msgspec.to_builtins(keyed())
    settings["models"].append({"id": "e", "kind": "embedding"})
    settings = msgspec.convert(settings, type=type(load_settings()))
    e = FakeModel()
    async with served(settings, {"a": FakeModel(), "b": FakeModel(), "e": e}) as (c, _):
        r = await c.post("/v1/models/e/load", json={}, headers=AUTH)
        assert r.status_code == 200, await r.get_data()
        assert json.loads(await r.get_data())["state"] == "loaded" and e.loads == 1


async def test_a_model_that_fails_to_load_says_why():
    broken = FakeModel(error=RuntimeError("no weights here"))
    async with served(keyed(), {"a": FakeModel(), "b": broken}) as (c, _):
        r = await c.post("/v1/models/b/load", json={}, headers=AUTH)
        assert r.status_code == 500 and b"no weights here" in await r.get_data()
        rows = {m["id"]: m for m in (await dashboard(c))["models"]}
        assert rows["b"]["state"] == "failed" and "no weights here" in rows["b"]["error"]


async def test_with_the_dashboard_off_there_is_no_page_and_no_sampling():
    settings = keyed(dashboard={"enabled": False})
    async with served(settings, {"a": FakeModel(), "b": FakeModel()}) as (c, p):
        assert p.history is None
        assert (await c.get("/", headers=AUTH)).status_code == 404
        assert (await c.get("/v1/dashboard", headers=AUTH)).status_code == 404
        assert (await c.post(CHAT, json=ask("a"), headers=AUTH)).status_code == 200


async def test_mlxd_status_prints_the_summary(capsys):
    settings = settings_with(auth={"api_keys": [KEY]}, dashboard={"sample_period_s": 0.1})
    async with real_server(settings) as (url, pipeline, _):
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=WAIT_S) as client:
            r = await client.post(CHAT, json=ask("fake-model", "hello there"))
            assert r.status_code == 200
        with trio.fail_after(WAIT_S):
            while not any(s.finished for s in pipeline.history.samples):
                await trio.sleep(0.05)

        def status(key):
            return terminal.main(argparse.Namespace(api_key=key), url)

        assert await trio.to_thread.run_sync(status, None) == 1
        assert "HTTP 401" in capsys.readouterr().err
        assert await trio.to_thread.run_sync(status, KEY) == 0
    out = capsys.readouterr().out
    assert f"mlxd at {url}: ready" in out
    assert "fake-model" in out and "loaded" in out and "1 done" in out
    assert "requests: 0 running, 0 queued" in out
    assert "cache:" in out and "last minute:" in out and "1 requests" in out


def test_mlxd_status_finds_the_daemon_from_the_settings(monkeypatch, capsys):
    assert terminal.default_url("0.0.0.0", 8123) == "http://127.0.0.1:8123"
    assert terminal.default_url("::1", 80) == "http://[::1]:80"
    port = free_port()  # nothing listens there: a clear error, exit 1
    monkeypatch.setenv("MLXD_SERVER__PORT", str(port))
    assert cli.main(["status"]) == 1
    assert f"mlxd status: http://127.0.0.1:{port}:" in capsys.readouterr().err


# ---- the page in a real browser, against `mlxd serve` ------------------------------------------


def _browser_or_skip():
    """Playwright and Debian's chromium; missing: skip, except in CI (``CI=true``)."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        sync_playwright = None
    chromium = shutil.which("chromium")
    if sync_playwright is None or chromium is None:
        why = "the dashboard's browser tests need playwright and chromium (scripts/install --test)"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    return sync_playwright, chromium


@pytest.fixture(scope="module")
def screenshots(tmp_path_factory) -> Path:
    where = os.environ.get("MLXD_SCREENSHOTS")
    path = Path(where) if where else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, tiny_models):
    """``mlxd serve`` of two ``[[models]]`` entries of the tiny llama (``tiny`` preloaded,
    ``spare`` on first use), with an API key and a fast sampler."""
    tmp = tmp_path_factory.mktemp("dashboard-serve")
    model = tiny_models("llama")
    config = tmp / "mlxd.toml"
    config.write_text(
        f'[auth]\napi_keys = ["{KEY}"]\n[model]\ncache_dir = "{tmp}"\n'
        "[dashboard]\nsample_period_s = 0.5\n"
        f'[[models]]\nid = "tiny"\npath = "{model}"\npreload = true\n'
        f'[[models]]\nid = "spare"\npath = "{model}"\n'
    )
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tmp / "mlxd.log"
    command = [sys.executable, "-m", "mlxd.daemon.cli", "serve", "--port", str(port)]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*command, "--config", str(config)],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    try:
        wait_healthy(url, lambda: proc.poll() is None, WAIT_S, log.read_text)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=WAIT_S)
    assert "Traceback" not in log.read_text()


@pytest.fixture(scope="module")
def browser():
    sync_playwright, chromium = _browser_or_skip()
    from playwright.sync_api import expect

    expect.set_options(timeout=WAIT_S * 1000)
    # OpenBLAS preloaded (scripts/test) breaks thread creation in playwright's node driver
    preload = os.environ.pop("LD_PRELOAD", None)
    try:
        p = sync_playwright().start()
    finally:
        if preload is not None:
            os.environ["LD_PRELOAD"] = preload
    try:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
        yield browser
        browser.close()
    finally:
        p.stop()


class Page:
    """A fresh tab on the dashboard; every request to anything but the daemon is blocked
    and recorded."""

    def __init__(self, browser, url: str):
        self.url, self.elsewhere, self.seen = url, [], []
        self.context = browser.new_context(viewport={"width": 1400, "height": 1200})
        self.context.route("**/*", self._route)
        self.page = self.context.new_page()
        self.page.set_default_timeout(WAIT_S * 1000)

    def _route(self, route):
        request_url = route.request.url
        if request_url.startswith(self.url + "/"):
            self.seen.append((route.request.method, request_url[len(self.url) :]))
            route.continue_()
        else:
            self.elsewhere.append(request_url)
            route.abort()

    def open(self, key: str | None = KEY):
        self.page.goto(self.url + "/")
        if key is not None:
            self.page.wait_for_selector("#key-panel:not([hidden])")
            self.page.fill("#key-input", key)
            self.page.click("#key-form button[type=submit]")
            self.page.wait_for_selector("#models tbody tr[data-model=tiny]")
        return self.page

    def close(self):
        self.context.close()
        assert self.elsewhere == [], f"requests left for elsewhere: {self.elsewhere}"


@pytest.fixture
def tab(browser, daemon):
    tab = Page(browser, daemon)
    yield tab
    tab.close()


@pytest.mark.slow  # a browser on a real mlxd serve
def test_the_page_asks_for_the_key_and_loads_nothing_from_elsewhere(tab, daemon, screenshots):
    assert httpx.get(f"{daemon}/v1/dashboard", timeout=WAIT_S).status_code == 401
    page = tab.open(key=None)
    page.wait_for_selector("#key-panel:not([hidden])")
    assert page.text_content("#state") == "locked"
    assert page.locator("#models tbody tr").count() == 0
    page.fill("#key-input", "not-the-key")
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("#key-error:not([hidden])")
    page.fill("#key-input", KEY)
    page.click("#key-form button[type=submit]")
    page.wait_for_selector("#models tbody tr[data-model=spare]")
    assert page.text_content("#state") == "ready"
    assert KEY not in page.content()  # kept in session storage, never in the page
    assert page.evaluate("sessionStorage.getItem('mlxd.apiKey')") == KEY
    page.screenshot(path=str(screenshots / "dashboard-key.png"))
    assert ("GET", "/v1/dashboard?since=0&recent_since=0") in tab.seen


def _load(url: str, requests: int = 8) -> list[int]:
    """``requests`` chat completions at once; their statuses."""
    statuses: list[int] = []

    def one(i: int) -> None:
        body = ask("tiny", f"count to {i}", max_tokens=24, temperature=0)
        r = httpx.post(f"{url}{CHAT}", json=body, headers=AUTH, timeout=WAIT_S)
        statuses.append(r.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(requests)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(WAIT_S)
    return statuses


@pytest.mark.slow  # a browser on a real mlxd serve
def test_the_charts_get_points_while_a_load_runs(tab, daemon, screenshots):
    from playwright.sync_api import expect

    page = tab.open()
    assert _load(daemon) == [200] * 8
    # (the page's CSP forbids eval, so no wait_for_function: attribute checks instead)
    nonzero = re.compile(r"[1-9]")
    expect(page.locator("#chart-tps")).to_have_attribute("data-max", nonzero)
    expect(page.locator("#chart-requests")).to_have_attribute("data-max", nonzero)
    expect(page.locator("#chart-ttft")).to_have_attribute("data-points", nonzero)
    page.wait_for_selector("#recent tbody tr")
    row = page.locator("#recent tbody tr").first.inner_text()
    assert "tiny" in row and CHAT in row and "200" in row
    assert "count to" not in page.content()  # no request's content anywhere
    assert page.locator("#chart-tps path").count() == 1
    page.screenshot(path=str(screenshots / "dashboard.png"), full_page=True)


@pytest.mark.slow  # a browser on a real mlxd serve
def test_a_playground_message_streams_an_answer(tab, daemon, screenshots):
    from playwright.sync_api import expect

    page = tab.open()
    page.select_option("#chat-model", "tiny")
    page.fill("#chat-system", "You are terse.")
    page.fill("#chat-temperature", "0")
    page.fill("#chat-max-tokens", "12")
    page.fill("#chat-message", "Hello there")
    page.click("#chat-send")
    expect(page.locator("#chat-stats")).to_contain_text("done")
    assert page.text_content("#chat-output").strip()
    stats = page.text_content("#chat-stats")
    assert "TTFT" in stats and "tokens" in stats
    assert page.is_hidden("#chat-error")
    assert ("POST", CHAT) in tab.seen  # streamed through the daemon's own API
    page.screenshot(path=str(screenshots / "dashboard-playground.png"), full_page=True)


@pytest.mark.slow  # a browser on a real mlxd serve
def test_the_unload_button_unloads_a_models_entry(tab, daemon):
    r = httpx.post(f"{daemon}/v1/models/spare/load", json={}, headers=AUTH, timeout=WAIT_S)
    assert r.status_code == 200 and r.json()["state"] == "loaded"
    page = tab.open()
    page.wait_for_selector("#models tr[data-model=spare] .badge.loaded")
    assert page.text_content("#models tr[data-model=spare] .activity").strip() == "idle"
    page.click("#models tr[data-model=spare] button[data-action=unload]")
    page.wait_for_selector("#models tr[data-model=spare] .badge.unloaded")
    view = httpx.get(f"{daemon}/v1/dashboard", headers=AUTH, timeout=WAIT_S).json()
    spare = next(m for m in view["models"] if m["id"] == "spare")
    assert (spare["state"], spare["last_unload_reason"]) == ("unloaded", "operator")
    assert ("POST", "/v1/models/spare/unload") in tab.seen
    page.click("#models tr[data-model=spare] button[data-action=load]")
    page.wait_for_selector("#models tr[data-model=spare] .badge.loaded")
