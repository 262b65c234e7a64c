"""The deploying page's reference of every ``/metrics`` series is the daemon's: each series
a live ``/metrics`` exposes is on the page with its type, and each series on the page is
one ``daemon/telemetry.py`` defines (some appear only with a disk tier or speculative
decoding)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from tests.conftest import real_server

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "deploying.md"
ROW = re.compile(r"^\| `(mlxd_[a-z0-9_]+)` \| (counter|gauge|histogram) \|([^|]*)\|", re.M)


def _documented() -> dict[str, tuple[str, str]]:
    return {name: (kind, labels.strip()) for name, kind, labels in ROW.findall(PAGE.read_text())}


async def _live() -> str:
    async with real_server() as (url, _, _), httpx.AsyncClient(base_url=url) as http:
        answer = await http.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        )
        assert answer.status_code == 200, answer.text
        return (await http.get("/metrics")).text


def _families(text: str) -> dict[str, str]:
    """Each exposed family as the page names it (a counter with ``_total``) and its type."""
    out = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)", text, flags=re.M):
        if name.endswith("_created"):
            continue  # prometheus_client's creation timestamps
        out[name] = kind
    return out


async def test_every_live_series_is_documented_with_its_type_and_labels():
    text = await _live()
    documented = _documented()
    live = _families(text)
    assert len(live) > 30
    missing = sorted(set(live) - set(documented))
    assert not missing, f"on /metrics, not on docs/deploying.md: {missing}"
    wrong = [n for n, kind in live.items() if documented[n][0] != kind]
    assert not wrong, wrong
    for name, (_, labels) in documented.items():
        samples = re.findall(rf"^{name}(?:_bucket|_count|_sum)?\{{([^}}]*)\}}", text, re.M)
        for sample in samples:
            keys = {kv.split("=")[0] for kv in sample.split(",")} - {"le"}
            assert keys == set(re.findall(r"`(\w+)`", labels)), (name, keys, labels)


def test_every_documented_series_is_one_the_daemon_defines():
    from mlxd.daemon import telemetry

    source = Path(telemetry.__file__).read_text()
    defined = set(re.findall(r'"(mlxd_[a-z0-9_]+)"', source))
    defined |= {f"mlxd_prefix_cache_disk_{name}" for name, _ in telemetry._DISK_COUNTERS}
    defined -= {"mlxd_api_route"}  # a ContextVar's name, not a series
    documented = _documented()
    unknown = [n for n, (kind, _) in documented.items() if n.removesuffix("_total") not in defined]
    assert not unknown, f"on the page, not in daemon/telemetry.py: {unknown}"
    counted = {n.removesuffix("_total") for n in documented}
    undocumented = sorted(defined - counted)
    assert not undocumented, f"defined, not on docs/deploying.md: {undocumented}"
