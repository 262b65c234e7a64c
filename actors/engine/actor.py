"""Generation actor: owns the model and every MLX call, on one long-lived thread.

The actor makes a single ``trio.to_thread.run_sync(_engine_loop, ...)`` call for
its whole life (MLX streams are thread-local; trio's thread cache could hand a
new thread to each call). The loop blocks on the inbox only when idle; otherwise
it runs one engine step, then in a single trip to the trio thread sends that
``EngineStep`` downstream and drains the inbox without blocking. Cancellation is checked every step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio

from actors.engine.core import EngineCore
from actors.engine.types import ModelInfo, Runner
from protocol.messages import Abort, ClearCache, EngineInbox, EngineStep, Submit

RunnerFactory = Callable[[], tuple[Runner, ModelInfo]]


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


async def _receive(inbox: trio.MemoryReceiveChannel[EngineInbox]) -> EngineInbox | None:
    try:
        return await inbox.receive()
    except trio.EndOfChannel:
        return None


async def _exchange(
    outbox: trio.MemorySendChannel[EngineStep],
    step: EngineStep | None,
    inbox: trio.MemoryReceiveChannel[EngineInbox],
) -> list[EngineInbox]:
    """One trip to the trio thread per step: deliver the step, pick up new messages."""
    if step is not None:
        await outbox.send(step)
    return _drain(inbox)


def _engine_loop(
    factory: RunnerFactory,
    settings: Any,
    inbox: trio.MemoryReceiveChannel[EngineInbox],
    outbox: trio.MemorySendChannel[EngineStep],
    task_status: trio.TaskStatus[ModelInfo],
) -> None:
    runner, info = factory()
    core = EngineCore(
        runner, max_batch=settings.max_batch, prefill_chunk_tokens=settings.prefill_chunk_tokens
    )
    trio.from_thread.run_sync(task_status.started, info)
    step: EngineStep | None = None
    while True:
        for message in trio.from_thread.run(_exchange, outbox, step, inbox):
            _handle(core, message)
        if core.idle:
            first = trio.from_thread.run(_receive, inbox)
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
    settings: Any,
    *,
    task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Load the model (``task_status.started(info)`` once ready), then serve forever."""
    async with inbox, outbox:
        await trio.to_thread.run_sync(_engine_loop, factory, settings, inbox, outbox, task_status)
