"""Generation actor: owns the model and every MLX call, on one long-lived thread.

The actor makes a single ``trio.to_thread.run_sync(_engine_loop, ...)`` call for
its whole life (MLX streams are thread-local; trio's thread cache could hand a
new thread to each call). The loop blocks on the inbox only when idle; otherwise
it runs one engine step, then in a single trip to the trio thread sends that
``EngineStep`` downstream, publishes the engine's ``EngineStats`` (a small
snapshot that /metrics and /v1/status read, so no metric is observed on the
engine thread) and drains the inbox without blocking. Cancellation is checked
every step. Idle for ``release_after_idle_s``, it gives the runner's freed
buffers back to the system, so memory returns near idle after a burst.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import trio
from mlxd.actors.engine.core import EngineCore
from mlxd.actors.engine.types import ModelInfo, Runner
from mlxd.protocol.messages import Abort, ClearCache, EngineInbox, EngineStats, EngineStep, Submit

RunnerFactory = Callable[[], tuple[Runner, ModelInfo]]
Publish = Callable[[EngineStats], None]


@dataclass(frozen=True)
class EngineOptions:
    """What the engine loop needs besides the runner: limits, and where stats go."""

    max_batch: int
    prefill_chunk_tokens: int
    retry_after_s: float = 1.0  # a 503's Retry-After (an allocation failed in a step)
    release_after_idle_s: float = 2.0  # idle this long: give freed buffers back (a burst ended)
    publish: Publish | None = None  # called on the trio thread after every step


def _publish_nothing(stats: EngineStats) -> None:
    pass


def _handle(core: EngineCore, message: EngineInbox) -> None:
    match message:
        case Submit(request=request):
            core.submit(request)
        case Abort(request_id=request_id):
            core.abort(request_id)
        case ClearCache():
            core.runner.clear_cache()


def _drain(inbox: trio.MemoryReceiveChannel[EngineInbox]) -> list[EngineInbox]:
    messages = []
    while True:
        try:
            messages.append(inbox.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return messages


_QUIET = object()  # ``_receive`` timed out: the engine has been idle a while


async def _receive(
    inbox: trio.MemoryReceiveChannel[EngineInbox],
    publish: Publish,
    stats: EngineStats,
    timeout_s: float = math.inf,
) -> EngineInbox | object | None:
    """Idle: publish the idle snapshot, then wait for a message (``_QUIET`` after
    ``timeout_s``; None when every sender closed)."""
    publish(stats)
    try:
        with trio.move_on_after(timeout_s):
            return await inbox.receive()
        return _QUIET
    except trio.EndOfChannel:
        return None


def _wait_idle(core: EngineCore, inbox, publish: Publish, options: EngineOptions):
    """Block until a message comes; after ``release_after_idle_s`` of quiet, give the
    runner's freed buffers back to the system (memory returns near idle after a burst)."""
    first = trio.from_thread.run(
        _receive, inbox, publish, core.stats(), options.release_after_idle_s
    )
    if first is _QUIET:
        core.runner.release_buffers()
        first = trio.from_thread.run(_receive, inbox, publish, core.stats())
    return first


async def _exchange(
    outbox: trio.MemorySendChannel[EngineStep],
    step: EngineStep | None,
    inbox: trio.MemoryReceiveChannel[EngineInbox],
    publish: Publish,
    stats: EngineStats,
) -> list[EngineInbox]:
    """One trip to the trio thread per step: deliver the step, publish stats, pick up messages."""
    publish(stats)
    if step is not None:
        await outbox.send(step)
    return _drain(inbox)


def _ready(
    task_status: trio.TaskStatus[ModelInfo], info: ModelInfo, publish: Publish, stats: EngineStats
) -> None:
    publish(stats)  # the idle snapshot (the memory the model alone takes) before "ready"
    task_status.started(info)


def _make_core(runner: Runner, info: ModelInfo, options: EngineOptions) -> EngineCore:
    return EngineCore(
        runner,
        max_batch=options.max_batch,
        prefill_chunk_tokens=options.prefill_chunk_tokens,
        memory=info.memory,
        retry_after_s=options.retry_after_s,
        vocab_size=info.vocab_size,
    )


def _engine_loop(
    factory: RunnerFactory,
    options: EngineOptions,
    inbox: trio.MemoryReceiveChannel[EngineInbox],
    outbox: trio.MemorySendChannel[EngineStep],
    task_status: trio.TaskStatus[ModelInfo],
) -> None:
    runner, info = factory()
    core = _make_core(runner, info, options)
    publish = options.publish or _publish_nothing
    trio.from_thread.run_sync(_ready, task_status, info, publish, core.stats())
    step: EngineStep | None = None
    while True:
        exchange = (outbox, step, inbox, publish, core.stats())
        for message in trio.from_thread.run(_exchange, *exchange):
            _handle(core, message)
        if core.idle:
            first = _wait_idle(core, inbox, publish, options)
            if first is None:
                return  # every sender closed: shutdown
            _handle(core, first)
        trio.from_thread.check_cancelled()
        result = core.step()
        step = result if (result.started or result.tokens or result.failed) else None


async def run(
    inbox: trio.MemoryReceiveChannel[EngineInbox],
    outbox: trio.MemorySendChannel[EngineStep],
    factory: RunnerFactory,
    options: EngineOptions,
    *,
    task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Load the model (``task_status.started(info)`` once ready), then serve forever."""
    async with inbox, outbox:
        await trio.to_thread.run_sync(_engine_loop, factory, options, inbox, outbox, task_status)
