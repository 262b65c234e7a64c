"""Admission policy (sync core) and the admission actor on trio's fake clock; the queue
timeout (the pipeline's timer) in front of it."""

from __future__ import annotations

import trio
from mlxd.actors import admission
from mlxd.actors.admission import AdmissionOptions, AdmissionPolicy, Decision
from mlxd.actors.mailbox import Mailboxes
from mlxd.daemon.pipeline import Pipeline, Timeouts
from mlxd.protocol.messages import (
    Abort,
    Admit,
    CompletionRequest,
    Failed,
    Release,
    SamplingParams,
    Started,
)

OPTIONS = AdmissionOptions(retry_after_s=3)  # the actor reads only retry_after_s


def req(i):
    return CompletionRequest(request_id=f"r{i}", prompt="x", sampling=SamplingParams(max_tokens=1))


def test_runs_then_queues_then_rejects():
    policy = AdmissionPolicy(max_running=2, max_waiting=1)
    assert [policy.admit(req(i)) for i in range(4)] == [
        Decision.RUN,
        Decision.RUN,
        Decision.QUEUE,
        Decision.REJECT,
    ]


def test_release_hands_slot_to_oldest_waiter():
    policy = AdmissionPolicy(max_running=1, max_waiting=3)
    for i in range(3):
        policy.admit(req(i))
    assert [r.request_id for r in policy.release("r0")] == ["r1"]
    assert policy.running == {"r1"}
    assert list(policy.waiting) == ["r2"]


def test_release_of_waiting_request_frees_its_place():
    policy = AdmissionPolicy(max_running=1, max_waiting=1)
    policy.admit(req(0))
    policy.admit(req(1))
    assert policy.admit(req(2)) is Decision.REJECT
    assert policy.release("r1") == []
    assert policy.admit(req(2)) is Decision.QUEUE


def test_new_arrival_does_not_jump_the_queue():
    policy = AdmissionPolicy(max_running=1, max_waiting=2)
    policy.admit(req(0))
    policy.admit(req(1))
    policy.running.clear()  # a slot frees without a release having run yet
    assert policy.admit(req(2)) is Decision.QUEUE


# ---- queue timeout and priority (sync core) ---------------------------------------------


def preq(i, priority):
    return CompletionRequest(
        request_id=f"r{i}", prompt="x", sampling=SamplingParams(max_tokens=1), priority=priority
    )


def test_timeouts_fall_due_oldest_first():
    timeouts = Timeouts(queue_timeout_s=10, request_timeout_s=20)
    for rid, now in (("r0", 0), ("r1", 1), ("r2", 4)):
        timeouts.add(rid, now)
    timeouts.remove("r0")  # its session closed
    assert timeouts.next_at() == 11
    assert timeouts.due(10.9) == ([], [])
    assert timeouts.due(11) == (["r1"], [])
    assert timeouts.next_at() == 14
    assert timeouts.due(100) == (["r2"], ["r1", "r2"])
    assert timeouts.next_at() == float("inf")


def test_no_timeouts_never_fall_due():
    timeouts = Timeouts()
    timeouts.add("r0", 0)
    assert timeouts.due(10**9) == ([], []) and timeouts.next_at() == float("inf")


def test_priority_picks_the_lowest_value_then_the_oldest():
    policy = AdmissionPolicy(max_running=1, max_waiting=5, priority=True)
    policy.admit(preq(0, 0))
    for i, p in [(1, 5), (2, 1), (3, 0), (4, 1)]:
        policy.admit(preq(i, p))
    order = []
    running = "r0"
    while True:
        ready = policy.release(running)
        if not ready:
            break
        running = ready[0].request_id
        order.append(running)
    assert order == ["r3", "r2", "r4", "r1"]


def test_priority_is_ignored_unless_enabled():
    policy = AdmissionPolicy(max_running=1, max_waiting=5)
    policy.admit(preq(0, 0))
    policy.admit(preq(1, 9))
    policy.admit(preq(2, 0))
    assert [r.request_id for r in policy.release("r0")] == ["r1"]


# ---- the actor on trio's fake clock -------------------------------------------------------


async def _admission_actor(nursery, policy, mailboxes):
    inbox_tx, inbox_rx = trio.open_memory_channel(8)
    out_tx, out_rx = trio.open_memory_channel(8)
    await nursery.start(admission.run, inbox_rx, out_tx, mailboxes, policy, OPTIONS)
    return inbox_tx, out_rx


async def test_queue_timeout_on_the_fake_clock_is_a_503_with_retry_after(autojump_clock):
    policy = AdmissionPolicy(max_running=1, max_waiting=2)
    admission_tx, admission_rx = trio.open_memory_channel(8)
    admitted_tx, admitted = trio.open_memory_channel(8)
    engine_tx, engine_rx = trio.open_memory_channel(8)
    mailboxes = Mailboxes()
    pipeline = Pipeline(
        admission_tx, engine_tx, mailboxes, timeouts=Timeouts(30, 0), retry_after_s=3
    )
    async with trio.open_nursery() as nursery:
        await nursery.start(admission.run, admission_rx, admitted_tx, mailboxes, policy, OPTIONS)
        await nursery.start(pipeline.release_ended)
        await nursery.start(pipeline.expire)
        t0 = trio.current_time()
        first = await pipeline.submit(req(0))
        second = await pipeline.submit(req(1))
        assert (await admitted.receive()).request_id == "r0"
        mailboxes.deliver(Started(request_id="r0", prompt_tokens=1))  # the engine took it
        (event,) = await second.mailbox.get()  # nothing frees the slot: r1 times out
        waited = trio.current_time() - t0
        assert isinstance(event, Failed)
        assert (event.reason, event.retry_after) == ("queue_timeout", 3)
        assert 30 <= waited < 31 and pipeline.expired == 1
        # its slot is given back and anything the engine held of it aborted, unread
        assert await engine_rx.receive() == Abort(request_id="r1")
        await trio.sleep(1)
        assert not policy.waiting
        # a later release runs nothing stale: the expired request is gone
        await first.close()
        await second.close()
        await trio.sleep(1)
        assert policy.running == set() and not policy.waiting
        # the first request started before its queue timeout: it never had one
        assert pipeline.expired == 1
        nursery.cancel_scope.cancel()


async def test_release_before_the_timeout_runs_the_waiter(autojump_clock):
    mailboxes = Mailboxes()
    policy = AdmissionPolicy(max_running=1, max_waiting=2)
    async with trio.open_nursery() as nursery:
        inbox, admitted = await _admission_actor(nursery, policy, mailboxes)
        box = mailboxes.register("r1")
        await inbox.send(Admit(request=req(0)))
        await inbox.send(Admit(request=req(1)))
        await admitted.receive()
        await trio.sleep(29)
        await inbox.send(Release(request_id="r0"))
        assert (await admitted.receive()).request_id == "r1"
        await trio.sleep(60)
        assert box._final is None
        nursery.cancel_scope.cancel()


async def test_priority_on_the_fake_clock_serves_urgent_requests_first(autojump_clock):
    mailboxes = Mailboxes()
    policy = AdmissionPolicy(max_running=1, max_waiting=4, priority=True)
    async with trio.open_nursery() as nursery:
        inbox, admitted = await _admission_actor(nursery, policy, mailboxes)
        for i, p in [(0, 0), (1, 3), (2, 1), (3, 2)]:
            await inbox.send(Admit(request=preq(i, p)))
        order = [(await admitted.receive()).request_id]
        for _ in range(3):
            await trio.sleep(5)  # each runs a while, well inside the queue timeout
            await inbox.send(Release(request_id=order[-1]))
            order.append((await admitted.receive()).request_id)
        assert order == ["r0", "r2", "r3", "r1"]
        nursery.cancel_scope.cancel()
