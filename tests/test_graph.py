"""The whole actor graph over a scripted fake runner: order, aborts, backpressure, drain."""

from __future__ import annotations

import msgspec
import trio
from mlxd.daemon.supervisor import drain
from mlxd.protocol.messages import Failed, Finished, Started, TextDelta

from tests.clocked import ClockedRunner
from tests.conftest import (
    AbortSent,
    chat,
    collect,
    running_graph,
    settings_with,
    text_of,
    wait_until,
)
from tests.fakes import fake_memory


async def test_streaming_order_started_text_finished():
    async with running_graph() as (pipeline, runner):
        session = await pipeline.submit(chat("a", "hello"))
        events = await collect(session)
    assert isinstance(events[0], Started)
    assert isinstance(events[-1], Finished)
    assert all(isinstance(e, TextDelta) for e in events[1:-1])
    assert text_of(events) == "HELLO"
    assert events[-1].finish_reason == "stop"
    assert events[-1].completion_tokens == 5  # EOS is not counted as output text


async def test_max_tokens_gives_length():
    async with running_graph() as (pipeline, runner):
        events = await collect(await pipeline.submit(chat("a", "hello", max_tokens=3)))
    assert text_of(events) == "HEL"
    assert events[-1].finish_reason == "length"


async def test_stop_string_ends_request_and_aborts_engine():
    async with running_graph() as (pipeline, runner):
        req = chat("a", "abcdefghij" * 20, stop=["DEF"])
        events = await collect(await pipeline.submit(req))
        with trio.fail_after(60):
            while "a" not in runner.removed:
                await trio.sleep(0.005)
    assert text_of(events) == "ABC"
    assert events[-1].finish_reason == "stop"


async def test_disconnect_aborts_in_engine_within_a_step():
    async with running_graph(runner=None) as (pipeline, runner):
        runner.step_delay = 0.01
        session = await pipeline.submit(chat("long", "x" * 3000))
        sent = AbortSent(pipeline.engine, runner)
        pipeline.engine = sent  # counts the engine's steps when the Abort is sent
        with trio.move_on_after(60) as scope:
            async for batch in session.events():
                if any(isinstance(e, TextDelta) for e in batch):
                    scope.cancel()  # the client hangs up mid-stream
                    await trio.lowlevel.checkpoint()
        with trio.fail_after(60):
            while "long" not in runner.removed:
                await trio.sleep(0.001)
        assert sent.steps_at_abort is not None
        assert runner.decode_steps - sent.steps_at_abort <= 1
        assert "long" not in runner.running


async def test_slow_reader_does_not_stall_others():
    async with running_graph() as (pipeline, runner):
        slow = await pipeline.submit(chat("slow", "s" * 400))
        fast = await pipeline.submit(chat("fast", "quick"))
        with trio.fail_after(60):
            fast_events = await collect(fast)  # completes while nobody reads "slow"
        assert text_of(fast_events) == "QUICK"
        with trio.fail_after(60):
            while "slow" in runner.running:
                await trio.sleep(0.01)
        slow_events = await collect(slow)  # merged deltas, nothing lost
        assert text_of(slow_events) == "S" * 400
        assert sum(isinstance(e, TextDelta) for e in slow_events) <= 3


async def test_concurrent_requests_share_decode_steps():
    async with running_graph() as (pipeline, runner):
        async with trio.open_nursery() as nursery:
            for i in range(8):
                nursery.start_soon(collect, await pipeline.submit(chat(f"r{i}", "y" * 50)))
    assert max(runner.batch_sizes) == 8


async def test_queue_full_rejects_with_429():
    settings = settings_with(admission={"max_running": 1, "max_waiting": 0})
    async with running_graph(settings) as (pipeline, runner):
        runner.step_delay = 0.01
        first = await pipeline.submit(chat("first", "z" * 100))
        second = await pipeline.submit(chat("second", "hi"))
        rejected = await collect(second)
        assert isinstance(rejected[-1], Failed)
        assert rejected[-1].reason == "queue_full"
        assert rejected[-1].retry_after
        await first.close()


async def test_queued_request_runs_when_slot_frees():
    settings = settings_with(admission={"max_running": 1, "max_waiting": 4})
    async with running_graph(settings) as (pipeline, runner):
        first = await pipeline.submit(chat("first", "abc"))
        second = await pipeline.submit(chat("second", "def"))
        assert text_of(await collect(first)) == "ABC"
        assert text_of(await collect(second)) == "DEF"


async def test_prefill_failure_fails_only_that_request():
    async with running_graph() as (pipeline, runner):
        sessions = [await pipeline.submit(chat(f"ok{i}", f"fine {i}")) for i in range(3)]
        bad = await pipeline.submit(chat("bad", "please FAIL"))
        sessions.append(await pipeline.submit(chat("ok3", "after")))
        results = [await collect(s) for s in sessions]
        failure = await collect(bad)
    assert [text_of(r) for r in results] == ["FINE 0", "FINE 1", "FINE 2", "AFTER"]
    assert isinstance(failure[-1], Failed)
    assert failure[-1].reason == "internal_error"
    assert "prefill" in failure[-1].message


async def test_template_error_is_a_400_for_that_request():
    from mlxd.protocol.messages import ChatRequest, Message, SamplingParams

    async with running_graph() as (pipeline, runner):
        req = ChatRequest(
            request_id="t",
            messages=(Message(role="user", content="q"), Message(role="wizard", content="x")),
            sampling=SamplingParams(),
        )
        events = await collect(await pipeline.submit(req))
    assert isinstance(events[-1], Failed)
    assert events[-1].reason == "invalid_request"
    assert "template" in events[-1].message


async def test_prompt_longer_than_context_is_a_400():
    # a max_tokens over the context is clamped by default (tests/test_max_tokens.py)
    refuse = settings_with(engine={"max_tokens_overflow": "refuse"})
    async with running_graph(refuse, context_length=64) as (pipeline, runner):
        too_long = await collect(await pipeline.submit(chat("long", "w" * 100)))
        too_much = await collect(await pipeline.submit(chat("much", "w", max_tokens=100)))
        defaulted = await collect(await pipeline.submit(chat("fits", "w" * 10)))
    assert too_long[-1].reason == "invalid_request" and "limit" in too_long[-1].message
    assert too_much[-1].reason == "invalid_request" and too_much[-1].param == "max_tokens"
    assert isinstance(defaulted[-1], Finished)


async def test_shutdown_drains_in_flight_requests():
    async with running_graph() as (pipeline, runner):
        runner.step_delay = 0.005
        session = await pipeline.submit(chat("inflight", "d" * 100))
        result = []

        async def consume():
            result.extend(await collect(session))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(consume)
            await trio.sleep(0.02)
            with trio.fail_after(90):  # the drain returns once the request is done
                await drain(pipeline, deadline_s=60)
        assert pipeline.state.value == "draining"
    assert text_of(result) == "D" * 100
    assert result[-1].finish_reason == "stop"


async def test_drain_deadline_cuts_off_stragglers():
    async with running_graph() as (pipeline, runner):
        runner.step_delay = 0.01
        session = await pipeline.submit(chat("straggler", "e" * 3000))
        with trio.fail_after(60):
            await drain(pipeline, deadline_s=0.2)
        assert len(pipeline.mailboxes) == 1
        await session.close()


async def test_long_prompt_prefill_is_chunked_between_decode_steps():
    settings = settings_with(engine={"prefill_chunk_tokens": 100})
    async with running_graph(settings) as (pipeline, runner):
        runner.step_delay = 0.001
        streaming = await pipeline.submit(chat("running", "r" * 300))
        events = streaming.events()
        await anext(events)  # it is running
        long = await pipeline.submit(chat("long", "p" * 1000, max_tokens=1000))
        long_events = await collect(long)
        rest = [e async for batch in events for e in batch]
    chunks = [step for rid, step in runner.prefill_log if rid == "long"]
    assert len(chunks) >= 10  # 1000+ prompt tokens, 100 per step
    assert len(set(chunks)) == len(chunks)  # one chunk per decode step: the stream kept flowing
    assert text_of(long_events) == "P" * 1000
    assert text_of(rest).endswith("R")


# ---- memory-aware admission, deadlines, failed steps --------------------------------------


async def test_memory_budget_caps_the_batch_and_everyone_finishes():
    # each request holds (prompt + 20) tokens × 1024 bytes; the budget fits about three
    memory = fake_memory(budget_bytes=3 * 60 * 1024)
    settings = settings_with(admission={"max_running": 10})
    async with running_graph(settings, memory=memory) as (pipeline, runner):
        sessions = [await pipeline.submit(chat(f"r{i}", "m" * 20, max_tokens=20)) for i in range(8)]
        results = [await collect(s) for s in sessions]
        assert pipeline.engine_stats.kv_budget == memory.budget_bytes
    assert [text_of(r) for r in results] == ["M" * 20] * 8
    assert max(runner.batch_sizes) == 3


async def test_request_that_can_never_fit_is_refused_at_tokenization_with_numbers():
    memory = fake_memory(budget_bytes=100 * 1024)
    # a max_tokens over the budget is clamped by default (tests/test_max_tokens.py)
    refuse = settings_with(engine={"max_tokens_overflow": "refuse"})
    async with running_graph(refuse, memory=memory) as (pipeline, runner):
        events = await collect(await pipeline.submit(chat("big", "b" * 50, max_tokens=200)))
        defaulted = await collect(await pipeline.submit(chat("dflt", "short")))
    failed = events[-1]
    assert isinstance(failed, Failed)
    assert (failed.reason, failed.param) == ("request_too_large", "max_tokens")
    assert "200 completion tokens" in failed.message and "0.1 MiB" in failed.message
    assert not runner.prefill_log or all(rid != "big" for rid, _ in runner.prefill_log)
    # no max_tokens named: the default shrinks to what the budget allows, and it runs
    assert isinstance(defaulted[-1], Finished)


async def test_deadline_aborts_generation_and_tells_the_client(mock_clock):
    # 3000 decode steps of 0.1 s on the mock clock: the 3 s deadline falls after ~30 tokens
    settings = settings_with(admission={"request_timeout_s": 3.0})
    runner = ClockedRunner(clock=mock_clock, step_s=0.1)
    async with running_graph(settings, runner=runner) as (pipeline, runner):
        events = await collect(await pipeline.submit(chat("slow", "s" * 3000)))
        mock_clock.autojump_threshold = 0  # the idle check at exit polls with sleeps
        await wait_until(lambda: "slow" in runner.removed)
    failed = events[-1]
    assert isinstance(failed, Failed)
    assert failed.reason == "request_timeout"
    assert "admission.request_timeout_s" in failed.message
    assert any(isinstance(e, TextDelta) for e in events)  # it was cut off mid-generation
    assert "slow" not in runner.running


async def test_deadline_also_covers_waiting_in_the_queue():
    settings = settings_with(
        admission={"max_running": 1, "max_waiting": 4, "request_timeout_s": 0.3}
    )
    async with running_graph(settings) as (pipeline, runner):
        runner.step_delay = 0.01
        blocker = await pipeline.submit(chat("blocker", "q" * 3000))
        queued = await collect(await pipeline.submit(chat("queued", "hi")))
        assert queued[-1].reason == "request_timeout"
        await blocker.close()


async def test_queue_timeout_covers_waiting_for_memory_in_the_engine():
    memory = fake_memory(budget_bytes=3100 * 1024)  # the blocker alone fits
    settings = settings_with(admission={"max_running": 4, "queue_timeout_s": 0.3})
    async with running_graph(settings, memory=memory) as (pipeline, runner):
        runner.step_delay = 0.01  # the blocker decodes for 30 s: nothing moves meanwhile
        blocker = await pipeline.submit(chat("blocker", "q" * 3000, max_tokens=3000))
        blocker_events = blocker.events()
        seen = await anext(blocker_events)
        assert isinstance(seen[0], Started)  # in the engine first, holding the memory
        patient = await collect(await pipeline.submit(chat("patient", "hi", max_tokens=50)))
        failed = patient[-1]
        assert isinstance(failed, Failed) and not any(isinstance(e, Started) for e in patient)
        assert (failed.reason, failed.retry_after) == ("queue_timeout", 1)
        assert pipeline.expired == 1
        # the blocker started long before its queue timeout: it still runs
        assert not blocker.mailbox.ended
        await blocker.close()


async def test_allocation_failure_in_a_step_fails_its_requests_and_serving_goes_on():
    async with running_graph() as (pipeline, runner):
        runner.step_delay = 0.005
        first = await pipeline.submit(chat("v1", "a" * 300))  # decodes long enough for v2 to join
        v1_events = first.events()
        seen = await anext(v1_events)
        while not any(isinstance(e, TextDelta) for e in seen):  # v1 is decoding
            seen = await anext(v1_events)
        second = await pipeline.submit(chat("v2", "OOM"))  # joins v1's decode batch
        v1_rest = [e async for batch in v1_events for e in batch]
        failures = [(seen + v1_rest)[-1], (await collect(second))[-1]]
        after = await collect(await pipeline.submit(chat("after", "still here")))
    assert all(isinstance(f, Failed) and f.reason == "out_of_memory" for f in failures)
    assert all(f.retry_after for f in failures)
    assert text_of(after) == "STILL HERE"
    assert runner.resets == 1
    assert pipeline.engine_stats.failed_steps == 1


async def test_a_crashing_row_fails_alone_and_a_running_stream_goes_on_seamlessly():
    settings = settings_with(memory={"release_after_idle_s": 0.02})
    async with running_graph(settings) as (pipeline, runner):
        runner.step_delay = 0.005
        first = await pipeline.submit(chat("v1", "a" * 400))  # decodes 2 s at least
        v1_events = first.events()
        seen = await anext(v1_events)
        while not any(isinstance(e, TextDelta) for e in seen):  # v1 is decoding
            seen = await anext(v1_events)
        bad = await collect(await pipeline.submit(chat("v2", "CRASH")))  # joins v1's batch
        released_while_busy = runner.released  # v1 still decodes: the engine never idled
        v1 = seen + [e async for batch in v1_events for e in batch]
        assert released_while_busy == 0
        await wait_until(lambda: runner.released >= 1)  # idle: it gave its free buffers back
    assert isinstance(bad[-1], Failed) and bad[-1].reason == "internal_error"
    assert isinstance(v1[-1], Finished) and text_of(v1) == "A" * 400  # no token lost or doubled
    assert pipeline.engine_stats.failed_steps >= 1


async def test_priority_setting_orders_queued_requests():
    settings = settings_with(admission={"max_running": 1, "max_waiting": 8, "priority": True})
    order = []
    async with running_graph(settings) as (pipeline, runner):
        runner.step_delay = 0.005
        blocker = await pipeline.submit(chat("blocker", "b" * 30))
        sessions = []
        for rid, priority in [("low", 9), ("high", 0), ("mid", 5)]:
            request = msgspec.structs.replace(chat(rid, "x"), priority=priority)
            sessions.append(await pipeline.submit(request))

        async def run(session):
            await collect(session)
            order.append(session.request_id)

        async with trio.open_nursery() as nursery:
            for s in [blocker, *sessions]:
                nursery.start_soon(run, s)
    assert order == ["blocker", "high", "mid", "low"]
