"""Admission on use and preemption (``memory.admission``), over the scripted fake runner.

The engine core admits a request when its prompt plus ``decode_reserve_tokens`` fits,
counts rows for what they hold as they grow, and before a step that would not fit
preempts the newest row, which resumes (ahead of new arrivals) once it fits again and
goes on with the same output. Through the whole daemon: 16 streams with a large
``max_tokens`` over a budget that holds about three of them all get their full answer,
no 5xx and no 503, while the fake's memory stays within the budget.
"""

from __future__ import annotations

import dataclasses
import json

import httpx
import trio
from mlxd.actors.engine.scheduler.core import EngineCore
from mlxd.protocol.messages import SamplingParams, TokenizedRequest

from tests.conftest import real_server, settings_with
from tests.fakes import EOS, FakeRunner, fake_memory, reply_for

TOKEN = 1024  # the fake's bytes per token


def request(i: int, max_tokens: int = 200, priority: int = 0) -> TokenizedRequest:
    text = f"<user>agent {i:02d} asks something<assistant>"
    return TokenizedRequest(
        request_id=f"r{i:02d}",
        prompt_tokens=tuple(map(ord, text)),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        priority=priority,
    )


PROMPT = len(request(0).prompt_tokens)
THREE = 3 * (PROMPT + 4) + 2  # three rows admitted with a 4-token margin; they outgrow it


def answer(r: TokenizedRequest) -> str:
    return reply_for(r.prompt_tokens)


def memory(tokens: int, admission: str = "use", reserve: int = 8):
    base = fake_memory(budget_bytes=tokens * TOKEN, bytes_per_token=TOKEN, step=1)
    return dataclasses.replace(base, admission=admission, reserve_tokens=reserve)


def run(core: EngineCore, runner: FakeRunner, requests: list[TokenizedRequest]) -> dict:
    """Submit everything, step until idle; the texts, failures, and what the budget saw."""
    for r in requests:
        core.submit(r)
    text: dict[str, str] = {r.request_id: "" for r in requests}
    out = {"text": text, "failed": [], "peak_reserved": 0, "peak_rows": 0, "started": []}
    while not core.idle:
        step = core.step()
        out["started"] += [s.request_id for s in step.started]
        out["failed"] += list(step.failed)
        for t in step.tokens:
            text[t.request_id] += "".join(chr(c) for c in t.tokens if c != EOS)
        held = core.reserved_bytes + runner.cache_held
        out["peak_reserved"] = max(out["peak_reserved"], held)
        out["peak_rows"] = max(out["peak_rows"], len(core.decoding) + len(core.prefilling))
    return out


def core_for(runner: FakeRunner, budget_tokens: int, admission: str = "use", **kw) -> EngineCore:
    return EngineCore(
        runner,
        max_batch=16,
        prefill_chunk_tokens=512,
        memory=memory(budget_tokens, admission, **kw),
    )


def test_rows_admitted_on_use_are_preempted_and_resumed_with_the_same_output():
    runner = FakeRunner(step_delay=0)
    core = core_for(runner, budget_tokens=200)
    requests = [request(i) for i in range(16)]
    out = run(core, runner, requests)
    assert out["failed"] == []
    assert out["text"] == {r.request_id: answer(r) for r in requests}
    assert sorted(out["started"]) == sorted(r.request_id for r in requests)  # once each
    stats = core.stats()
    assert stats.preemptions > 0 and stats.resumes == stats.preemptions
    assert stats.preempted == 0 and stats.preempted_bytes > 0
    assert out["peak_reserved"] <= 200 * TOKEN
    assert runner.peak <= 200 * TOKEN  # what the fake really held
    assert out["peak_rows"] >= 4
    assert core.reserved_bytes == 0 and runner.decoding == 0


def test_reserve_admits_whole_reservations_and_never_preempts():
    runner = FakeRunner(step_delay=0)
    core = core_for(runner, budget_tokens=200, admission="reserve")
    requests = [request(i, max_tokens=40) for i in range(8)]  # 39 + 40 tokens each
    out = run(core, runner, requests)
    assert out["failed"] == []
    assert out["text"] == {r.request_id: answer(r) for r in requests}
    assert core.stats().preemptions == 0 and runner.preempted == []
    assert out["peak_rows"] == 200 // (len(requests[0].prompt_tokens) + 40)
    use = core_for(FakeRunner(step_delay=0), budget_tokens=200)
    assert run(use, use.runner, requests)["peak_rows"] > out["peak_rows"]


def test_the_victim_is_the_newest_row_of_the_lowest_priority():
    runner = FakeRunner(step_delay=0)
    core = core_for(runner, budget_tokens=THREE, reserve=4)
    # priority 1 (served after 0) arrives first: it goes before the newer priority-0 row
    requests = [request(0, priority=0), request(1, priority=1), request(2, priority=0)]
    out = run(core, runner, requests)
    assert out["failed"] == []
    assert runner.preempted and runner.preempted[0] == "r01"


def test_a_preempted_row_resumes_ahead_of_new_arrivals():
    runner = FakeRunner(step_delay=0)
    core = core_for(runner, budget_tokens=THREE, reserve=4)
    for r in (request(0), request(1), request(2)):
        core.submit(r)
    while not runner.preempted:
        core.step()
    late = request(9)
    core.submit(late)
    started = []
    while not core.idle:
        started += [s.request_id for s in core.step().started]
    first_back = runner.preempted[0]
    assert "r09" in started
    # the preempted row started again (a prefill of its replay) before the late one did
    log = [rid for rid, _ in runner.prefill_log]
    assert log.index(first_back, log.index(first_back) + 1) < log.index("r09")


def test_aborting_a_preempted_row_ends_it_and_counts_its_time_out():
    clock = [0.0]
    runner = FakeRunner(step_delay=0)
    core = EngineCore(
        runner, max_batch=16, prefill_chunk_tokens=512, memory=memory(THREE, reserve=4)
    )
    core.clock = lambda: clock[0]
    for r in (request(0), request(1), request(2)):
        core.submit(r)
    while not runner.preempted:
        core.step()
    clock[0] += 5.0
    core.abort(runner.preempted[0])
    while not core.idle:
        core.step()
    stats = core.stats()
    assert stats.preempted == 0 and stats.preempted_seconds == 5.0
    assert core.reserved_bytes == 0


def test_a_row_that_outgrows_the_budget_alone_fails_as_too_large():
    """The tokenizer stage refuses such requests; a core driven directly fails it."""
    runner = FakeRunner(step_delay=0)
    core = core_for(runner, budget_tokens=50, reserve=4)  # 39 prompt + a 19-token reply
    out = run(core, runner, [request(0)])
    assert [f.reason for f in out["failed"]] == ["request_too_large"]
    assert core.idle and core.reserved_bytes == 0


# ---- through the daemon -------------------------------------------------------------

STREAMS = 16


async def _stream(http: httpx.AsyncClient, i: int) -> dict:
    text = f"agent {i:02d} needs a long answer"
    body = {
        "messages": [{"role": "user", "content": text}],
        "stream": True,
        "temperature": 0,
        "max_tokens": 3000,
    }
    out = {"expected": text.upper(), "text": "", "finish": None, "errors": []}
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        out["status"] = r.status_code
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["errors"].append(event["error"])
                continue
            choice = event["choices"][0]
            out["text"] += choice["delta"].get("content") or ""
            out["finish"] = choice["finish_reason"] or out["finish"]
    return out


async def test_sixteen_streams_over_a_small_budget_all_complete():
    settings = settings_with(
        admission={"max_running": STREAMS, "max_waiting": STREAMS},
        engine={"max_batch": STREAMS},
    )
    budget = 160  # tokens: a prompt is ~40, an answer ~30; about three rows at once
    runner = FakeRunner(step_delay=0.001)
    results: list[dict] = []
    async with real_server(settings, runner=runner, memory=memory(budget)) as (url, _, _):
        async with httpx.AsyncClient(base_url=url, timeout=60) as http:

            async def one(i: int) -> None:
                results.append(await _stream(http, i))

            async with trio.open_nursery() as nursery:
                for i in range(STREAMS):
                    nursery.start_soon(one, i)
            status = (await http.get("/v1/status")).json()
            metrics = (await http.get("/metrics")).text
    assert len(results) == STREAMS
    for r in results:
        assert r["status"] == 200 and not r["errors"], r
        assert r["text"] == r["expected"] and r["finish"] == "stop"
    engine = status["models"][0]["engine"]
    assert engine["preemptions"] > 0 and engine["resumes"] == engine["preemptions"]
    assert engine["preempted_bytes"] > 0
    assert "mlxd_preemptions_total" in metrics and "mlxd_resumes_total" in metrics
    assert runner.peak <= budget * TOKEN
