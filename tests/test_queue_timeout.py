"""``admission.queue_timeout_s`` counts only while the queue stands still: a request that
waits behind a batch that keeps finishing rows and starting new ones is never refused;
one behind a queue that does not move is, after ``queue_timeout_s``.

The engine tests run on trio's ``MockClock`` with no real time in it: each decode step
of the fake runner jumps the clock by 0.1 s (``tests/clocked.py``), so "slow" is a count
of steps and the outcome does not depend on the machine's speed.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import msgspec
import pytest
import trio
import trio.testing
from mlxd.actors import admission, tokenizer
from mlxd.actors.admission import AdmissionOptions, AdmissionPolicy
from mlxd.actors.mailbox import Mailboxes
from mlxd.daemon.pipeline import Pipeline, Timeouts
from mlxd.daemon.settings import load_settings
from mlxd.daemon.supervisor import open_graph, run_actors
from mlxd.protocol.messages import (
    ChatRequest,
    Failed,
    Finished,
    Message,
    SamplingParams,
    Started,
)

from tests.clocked import ClockedRunner
from tests.conftest import chat, collect, running_graph, settings_with, text_of
from tests.fakes import fake_factory, fake_memory

# ---- the sync core --------------------------------------------------------------------------


def test_progress_ahead_restarts_a_waiting_requests_queue_timeout():
    timeouts = Timeouts(queue_timeout_s=10)
    timeouts.add("old", 0)
    timeouts.add("r1", 1)
    timeouts.add("r2", 5)
    assert timeouts.next_at() == 10  # nothing moved: from arrival
    timeouts.started("old", 8)  # ahead of both: both clocks start again
    assert timeouts.next_at() == 18
    assert timeouts.due(17.9) == ([], [])
    assert timeouts.due(18) == (["r1", "r2"], [])


def test_newer_requests_restart_its_clock_only_during_its_first_queue_timeout():
    """Newer requests may have reached the engine's queue first (prompts are built in
    parallel); a flow of them that keeps overtaking it keeps it waiting at most one
    more ``queue_timeout_s``."""
    timeouts = Timeouts(queue_timeout_s=10)
    timeouts.add("long", 0)
    for t in range(1, 30):  # a steady flow of newer short ones, each starting and ending
        timeouts.add(f"short{t}", t)
        timeouts.started(f"short{t}", t)
        timeouts.ended(f"short{t}", t, lambda rid, model: True)
        timeouts.remove(f"short{t}")
        if t == 18:
            assert timeouts.due(t + 0.9) == ([], [])  # restarted at 9, its last within 10 s
    assert timeouts.due(19) == (["long"], [])


def test_another_models_progress_counts_only_where_the_waiting_request_can_use_it():
    timeouts = Timeouts(queue_timeout_s=10)
    timeouts.add("a1", 0, "a")
    timeouts.add("b1", 1, "b")
    timeouts.add("b2", 2, "b")
    timeouts.started("a1", 5)  # model a's queue moved: nothing for b
    assert timeouts.next_at() == 11
    timeouts.ended("a1", 6, lambda rid, model: rid == "b2")  # only b2 can use what it frees
    assert timeouts.due(11) == (["b1"], [])
    assert timeouts.next_at() == 16


def test_a_request_that_started_has_no_queue_timeout():
    timeouts = Timeouts(queue_timeout_s=10)
    timeouts.add("r1", 0)
    timeouts.started("r1", 3)
    assert timeouts.due(100) == ([], [])


# ---- admission and the timer, on the autojump clock ----------------------------------------


def req(i: int) -> ChatRequest:
    return ChatRequest(
        request_id=f"r{i}",
        messages=(Message(role="user", content="x"),),
        sampling=SamplingParams(max_tokens=1),
    )


async def test_a_slot_queue_that_moves_never_refuses(autojump_clock):
    """One slot, six requests each running 20 s: the last waits 100 s, five times the
    30 s queue timeout, and is served, because a request finished every 20 s."""
    policy = AdmissionPolicy(max_running=1, max_waiting=8)
    admission_tx, admission_rx = trio.open_memory_channel(8)
    admitted_tx, admitted = trio.open_memory_channel(8)
    engine_tx, _engine_rx = trio.open_memory_channel(64)
    mailboxes = Mailboxes()
    pipeline = Pipeline(admission_tx, engine_tx, mailboxes, timeouts=Timeouts(30, 0))
    options = AdmissionOptions(max_running=1, max_waiting=8)

    async def engine() -> None:  # runs each admitted request for 20 s, one at a time
        async for request in admitted:
            rid = request.request_id
            mailboxes.deliver(Started(request_id=rid, prompt_tokens=1))
            await trio.sleep(20)
            done = Finished(finish_reason="stop", prompt_tokens=1, completion_tokens=1)
            mailboxes.deliver(done, rid)

    async with trio.open_nursery() as nursery:
        await nursery.start(admission.run, admission_rx, admitted_tx, mailboxes, policy, options)
        await nursery.start(pipeline.release_ended)
        await nursery.start(pipeline.expire)
        nursery.start_soon(engine)
        t0 = trio.current_time()
        sessions = [await pipeline.submit(req(i)) for i in range(6)]
        finals = [(await collect(s))[-1] for s in sessions]
        waited = trio.current_time() - t0
        nursery.cancel_scope.cancel()
    assert all(isinstance(f, Finished) for f in finals), finals
    assert waited >= 120 and pipeline.expired == 0


# ---- the whole actor graph, on the mock clock ----------------------------------------------


@pytest.fixture
def settle(monkeypatch) -> Callable[[], None]:
    """Makes building prompts take no mock time, however slow the machine: called on the
    generation thread before a step moves the clock, it returns once no request is being
    tokenized and every trio task waits. Without it a request whose prompt building the
    machine delays would see newer requests decode past it on the mock clock while it is
    not even in the engine's queue yet, and run out its queue timeout (their progress no
    longer restarts its clock), where a real clock would have moved microseconds."""
    building = [0]
    original = tokenizer._tokenize_one

    async def counted(*args, **kwargs) -> None:
        building[0] += 1
        try:
            await original(*args, **kwargs)
        finally:
            building[0] -= 1

    monkeypatch.setattr(tokenizer, "_tokenize_one", counted)

    def wait() -> None:
        give_up = time.monotonic() + 30
        while True:
            trio.from_thread.run(trio.testing.wait_all_tasks_blocked)
            if not building[0]:
                return
            assert time.monotonic() < give_up, "prompt building did not end in 30 s"
            time.sleep(0.001)

    return wait


@dataclass
class SettledRunner(ClockedRunner):
    """``ClockedRunner`` whose steps wait for ``settle`` before they move the clock."""

    settle: Callable[[], None] | None = None

    def decode(self):
        if self.settle is not None:
            self.settle()
        return super().decode()


async def test_sixteen_requests_behind_a_two_row_memory_budget_all_complete(mock_clock, settle):
    """Each row decodes 32 steps (3.2 s); two fit in memory at once: the last request
    waits about 25 s in all, over twice the 10 s queue timeout, and is served."""
    runner = SettledRunner(clock=mock_clock, step_s=0.1, settle=settle)
    memory = fake_memory(budget_bytes=2 * 90 * 1024)  # a row holds 48 + 40 tokens
    # one prompt builder: the engine's queue is in arrival order (with two, a request
    # whose prompt the machine is slow to build may land behind many newer ones)
    settings = settings_with(admission={"queue_timeout_s": 10.0}, tokenizer={"workers": 1})
    async with running_graph(settings, runner=runner, memory=memory) as (pipeline, _):
        t0 = trio.current_time()
        texts = [f"request {i:02d} " + "x" * 20 for i in range(16)]
        sessions = [
            await pipeline.submit(chat(f"r{i}", text, max_tokens=40))
            for i, text in enumerate(texts)
        ]
        results = [await collect(s) for s in sessions]
        waited = trio.current_time() - t0
        mock_clock.autojump_threshold = 0  # the idle check at exit polls with sleeps
    assert all(isinstance(r[-1], Finished) for r in results), [
        r[-1] for r in results if not isinstance(r[-1], Finished)
    ]
    assert [text_of(r) for r in results] == [t.upper() for t in texts]
    assert max(runner.batch_sizes) <= 2  # the memory budget held them back
    assert waited > 2 * 10.0 and pipeline.expired == 0


async def test_a_queue_that_does_not_move_still_refuses_after_queue_timeout_s(mock_clock):
    """The blocker decodes 300 steps (30 s) holding the memory; nothing else starts or
    ends: the patient request is refused 5 s after it arrived, mid-way through."""
    runner = ClockedRunner(clock=mock_clock, step_s=0.1)
    # each row counted for its whole prompt + max_tokens: the blocker's 617 tokens fit, not 29 more
    memory = replace(fake_memory(budget_bytes=630 * 1024), admission="reserve")
    settings = settings_with(admission={"queue_timeout_s": 5.0})
    async with running_graph(settings, runner=runner, memory=memory) as (pipeline, _):
        blocker = await pipeline.submit(chat("blocker", "q" * 300, max_tokens=300))
        blocker_events = blocker.events()
        seen = await anext(blocker_events)
        assert isinstance(seen[0], Started)  # in the engine, holding the memory
        arrived = trio.current_time()
        patient = await collect(await pipeline.submit(chat("patient", "hi", max_tokens=10)))
        waited = trio.current_time() - arrived
        blocker_busy = not blocker.mailbox.ended
        rest = [e async for batch in blocker_events for e in batch]
        mock_clock.autojump_threshold = 0  # the idle check at exit polls with sleeps
    (failed,) = patient
    assert isinstance(failed, Failed) and failed.reason == "queue_timeout"
    assert "admission.queue_timeout_s" in failed.message and failed.retry_after
    assert 5.0 <= waited < 10.0 and blocker_busy and pipeline.expired == 1
    assert isinstance(rest[-1], Finished)  # the blocker runs to its end


async def test_a_request_overtaken_by_a_steady_flow_is_refused_in_bounded_time(mock_clock):
    """Priority admission, two slots, four clients each sending a short request (3 s)
    as soon as their last ends (two always wait): a low-priority request is overtaken by
    every one of them. The shorts that arrived before it restart its clock when they
    end, the newer ones only during its first ``queue_timeout_s``: it is refused within
    twice that of its arrival (it used to wait for ever, every request's progress
    restarting its clock)."""
    policy = AdmissionPolicy(max_running=2, max_waiting=8, priority=True)
    admission_tx, admission_rx = trio.open_memory_channel(8)
    admitted_tx, admitted = trio.open_memory_channel(8)
    engine_tx, engine_rx = trio.open_memory_channel(64)  # each short's Abort: drained
    mailboxes = Mailboxes()
    pipeline = Pipeline(admission_tx, engine_tx, mailboxes, timeouts=Timeouts(10, 0))
    options = AdmissionOptions(max_running=2, max_waiting=8, priority=True)

    async def run_one(rid: str) -> None:
        mailboxes.deliver(Started(request_id=rid, prompt_tokens=1))
        await trio.sleep(3)
        done = Finished(finish_reason="stop", prompt_tokens=1, completion_tokens=1)
        mailboxes.deliver(done, rid)

    async def engine(nursery: trio.Nursery) -> None:
        async for request in admitted:
            nursery.start_soon(run_one, request.request_id)

    async def tick() -> None:  # time moves in 0.5 s steps once every task waits
        while True:
            await trio.testing.wait_all_tasks_blocked()
            mock_clock.jump(0.5)

    async def client(i: int) -> None:
        for n in itertools.count():
            short = msgspec.structs.replace(req(0), request_id=f"c{i}-{n}", priority=0)
            events = await collect(await pipeline.submit(short))
            assert isinstance(events[-1], Finished), events

    async with trio.open_nursery() as nursery:
        await nursery.start(admission.run, admission_rx, admitted_tx, mailboxes, policy, options)
        await nursery.start(pipeline.release_ended)
        await nursery.start(pipeline.expire)
        nursery.start_soon(engine, nursery)
        nursery.start_soon(tick)
        nursery.start_soon(_drain, engine_rx)
        for i in range(4):
            nursery.start_soon(client, i)
        await trio.sleep(1)
        arrived = trio.current_time()
        low = msgspec.structs.replace(req(99), request_id="low", priority=5)
        with trio.move_on_after(100):  # it used to wait for ever
            (failed,) = await collect(await pipeline.submit(low))
        waited = trio.current_time() - arrived
        nursery.cancel_scope.cancel()
    assert waited <= 2 * 10  # newer ones restart its clock during its first 10 s only
    assert isinstance(failed, Failed) and failed.reason == "queue_timeout", failed
    assert waited >= 10


async def _drain(channel: trio.MemoryReceiveChannel) -> None:
    async for _ in channel:
        pass


def _on(model: str, request: ChatRequest) -> ChatRequest:
    return msgspec.structs.replace(request, model=model)


async def test_model_b_is_refused_after_queue_timeout_s_while_model_a_streams(mock_clock, settle):
    """Two models, each with half the memory. Model b's blocker decodes 600 steps
    holding b's share; a request for b waits behind it while two clients keep model a
    streaming (a request started or ended every few steps). Model a's progress frees
    nothing b can use: the b request is refused once ``queue_timeout_s`` (5 s) has
    passed with no b request ahead of it moving (it used to wait until the blocker ended,
    every a request restarting its clock)."""
    a = SettledRunner(clock=mock_clock, step_s=0.1, settle=settle)
    b = SettledRunner(clock=mock_clock, step_s=0.1, settle=settle)
    memory = replace(fake_memory(budget_bytes=2 * 630 * 1024), admission="reserve")
    raw = msgspec.to_builtins(settings_with(admission={"queue_timeout_s": 5.0}))
    raw["models"] = [{"id": "a", "preload": True}, {"id": "b", "preload": True}]
    raw["model_pool"]["max_loaded"] = 2  # the KV budget is split in two
    settings = msgspec.convert(raw, type=type(load_settings()))
    factories = {"a": fake_factory(a, memory=memory), "b": fake_factory(b, memory=memory)}
    graph = open_graph(settings)
    pipeline, served = graph.pipeline, []

    async def stream_a(i: int) -> None:
        for n in itertools.count():
            events = await collect(await pipeline.submit(_on("a", chat(f"a{i}-{n}", "hi", 8))))
            served.append(events[-1])

    async with trio.open_nursery() as nursery:
        await nursery.start(run_actors, graph, settings, factories)
        blocker = await pipeline.submit(_on("b", chat("blocker", "q" * 300, max_tokens=600)))
        assert isinstance((await blocker.mailbox.get())[0], Started)  # holding b's memory
        for i in range(2):
            nursery.start_soon(stream_a, i)
        arrived = trio.current_time()
        patient = await collect(await pipeline.submit(_on("b", chat("patient", "hi", 10))))
        waited = trio.current_time() - arrived
        blocker_busy = not blocker.mailbox.ended
        nursery.cancel_scope.cancel()
    (failed,) = patient
    assert isinstance(failed, Failed) and failed.reason == "queue_timeout", failed
    assert 5.0 <= waited < 10.0 and blocker_busy
    assert len(served) > 5 and all(isinstance(e, Finished) for e in served)  # a streamed on


async def test_a_long_prompt_behind_a_steady_flow_of_short_ones_starts_in_bounded_time(
    mock_clock, settle
):
    """Three clients keep short requests flowing through a memory budget the long prompt
    fits only once they have drained. The engine's queue is in order: the shorts that
    arrive after it wait behind it, the ones ahead of it end, and it starts within a few
    short generations of its arrival, well inside ``queue_timeout_s``."""
    runner = SettledRunner(clock=mock_clock, step_s=0.1, settle=settle)
    memory = fake_memory(budget_bytes=560 * 1024)  # the long one (~520 tokens) fits alone
    settings = settings_with(admission={"queue_timeout_s": 10.0})
    done, served = trio.Event(), []

    async with running_graph(settings, runner=runner, memory=memory) as (pipeline, _):

        async def client(i: int) -> None:
            for n in itertools.count():
                if done.is_set():
                    return
                events = await collect(await pipeline.submit(chat(f"s{i}-{n}", "hi", 20)))
                served.append(events[-1])

        async with trio.open_nursery() as nursery:
            for i in range(3):
                nursery.start_soon(client, i)
            while len(served) < 3:
                await trio.sleep(0.1)
            arrived = trio.current_time()
            long = await pipeline.submit(chat("long", "L" * 480, max_tokens=20))
            (started, *_) = await long.mailbox.get()
            waited = trio.current_time() - arrived
            rest = await collect(long)
            done.set()
        mock_clock.autojump_threshold = 0  # the idle check at exit polls with sleeps
    assert isinstance(started, Started), started
    assert waited < 10.0 and isinstance(rest[-1], Finished)
    assert all(isinstance(e, Finished) for e in served)
