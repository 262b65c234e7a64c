"""``admission.queue_timeout_s`` counts only while the queue stands still: a request that
waits behind a batch that keeps finishing rows and starting new ones is never refused;
one behind a queue that does not move is, after ``queue_timeout_s``.

The engine tests run on trio's ``MockClock`` with no real time in it: each decode step
of the fake runner jumps the clock by 0.1 s (``tests/clocked.py``), so "slow" is a count
of steps and the outcome does not depend on the machine's speed.
"""

from __future__ import annotations

from dataclasses import replace

import trio
from mlxd.actors import admission
from mlxd.actors.admission import AdmissionOptions, AdmissionPolicy
from mlxd.actors.mailbox import Mailboxes
from mlxd.daemon.pipeline import Pipeline, Timeouts
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
from tests.fakes import fake_memory

# ---- the sync core --------------------------------------------------------------------------


def test_progress_restarts_every_waiting_requests_queue_timeout():
    timeouts = Timeouts(queue_timeout_s=10)
    timeouts.add("r1", 0)
    timeouts.add("r2", 5)
    assert timeouts.next_at() == 10  # nothing moved: from arrival
    assert timeouts.next_at(moved_at=8) == 18  # the queue moved at 8
    assert timeouts.due(17.9, moved_at=8) == ([], [])
    assert timeouts.due(18, moved_at=8) == (["r1", "r2"], [])


def test_progress_before_a_request_arrived_does_not_shorten_its_wait():
    timeouts = Timeouts(queue_timeout_s=10)
    timeouts.add("r1", 5)
    assert timeouts.next_at(moved_at=2) == 15
    assert timeouts.due(14.9, moved_at=2) == ([], [])


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


async def test_sixteen_requests_behind_a_two_row_memory_budget_all_complete(mock_clock):
    """Each row decodes 32 steps (3.2 s); two fit in memory at once: the last request
    waits about 25 s in all, over twice the 10 s queue timeout, and is served."""
    runner = ClockedRunner(clock=mock_clock, step_s=0.1)
    memory = fake_memory(budget_bytes=2 * 90 * 1024)  # a row holds 48 + 40 tokens
    settings = settings_with(admission={"queue_timeout_s": 10.0})
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
    assert all(isinstance(r[-1], Finished) for r in results), [r[-1] for r in results]
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
