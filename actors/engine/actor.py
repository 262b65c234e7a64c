"""Generation actor: owns every loaded model and every MLX call, on one long-lived thread.

The actor makes a single ``trio.to_thread.run_sync(_engine_loop, ...)`` call for
its whole life (MLX streams are thread-local; trio's thread cache could hand a
new thread to each call). Its models live in a ``ModelPool`` (``pool.py``): one
``EngineCore`` per loaded model, loaded on first use and unloaded when idle past
``idle_unload_s`` or when another model needs the room (least recently used
first). Loads run here too, between steps (other models' streams pause for it).

The loop blocks on the inbox only when idle; otherwise it runs one step of the
next model with work (round-robin), then in a single trip to the trio thread
sends that ``EngineStep`` downstream, publishes the news (each model's
``EngineStats``, a small snapshot that /metrics and /v1/status read, so no metric
is observed on the engine thread, and the models' load / unload events) and
drains the inbox without blocking. Cancellation is checked every step. Idle for
``release_after_idle_s``, it gives the runners' freed buffers back to the system,
so memory returns near idle after a burst.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import trio
from mlxd.actors.engine.scheduler.core import EngineCore
from mlxd.actors.engine.scheduler.pool import (
    ModelEvent,
    ModelPool,
    ModelSpec,
    PoolLimits,
    RunnerFactory,
)
from mlxd.actors.engine.scheduler.types import ModelInfo, Runner
from mlxd.protocol.messages import (
    Abort,
    ClearCache,
    EngineInbox,
    EngineStats,
    EngineStep,
    Load,
    Submit,
)

__all__ = ["EngineNews", "EngineOptions", "ModelSpec", "PoolLimits", "RunnerFactory", "run"]


@dataclass(frozen=True)
class EngineNews:
    """What the engine publishes after a step: the stats of the models it touched (all of
    them when idle) and the models' lifecycle events since the last news."""

    stats: dict[str, EngineStats]
    events: tuple[ModelEvent, ...] = ()


Publish = Callable[[EngineNews], None]


def _publish_nothing(news: EngineNews) -> None:
    pass


@dataclass(frozen=True)
class EngineOptions:
    """What the engine loop needs besides the models: limits, and where news goes."""

    max_batch: int
    prefill_chunk_tokens: int
    batch_prefill: bool | None = None  # several requests' chunks per forward pass (None: auto)
    retry_after_s: float = 1.0  # a 503's Retry-After (an allocation failed in a step)
    release_after_idle_s: float = 2.0  # idle this long: give freed buffers back (a burst ended)
    publish: Publish | None = None  # called on the trio thread after every step
    limits: PoolLimits = field(default_factory=PoolLimits)
    free_memory: Callable[[], None] = lambda: None  # after an unload (the real one: MLX's)


def _handle(pool: ModelPool, message: EngineInbox) -> None:
    match message:
        case Submit(request=request):
            pool.submit(request)
        case Abort(request_id=request_id):
            pool.abort(request_id)
        case ClearCache(model=model):
            pool.clear_cache(model)
        case Load(model=model, request_id=request_id):
            pool.want(model, request_id)


def _drain(inbox: trio.MemoryReceiveChannel[EngineInbox]) -> list[EngineInbox]:
    messages = []
    while True:
        try:
            messages.append(inbox.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return messages


_QUIET = object()  # ``_receive`` timed out: the engine has been idle a while


class _Loop:
    """The engine thread's side: the pool, the channels, and the trips to the trio thread."""

    def __init__(self, pool: ModelPool, options: EngineOptions, inbox, outbox):
        self.pool, self.options = pool, options
        self.inbox: trio.MemoryReceiveChannel[EngineInbox] = inbox
        self.outbox: trio.MemorySendChannel[EngineStep] = outbox
        self.publish = options.publish or _publish_nothing

    def news(self, models: list[str] | None = None) -> EngineNews:
        stats = self.pool.stats(models)
        events, self.pool.events = tuple(self.pool.events), []
        return EngineNews(stats=stats, events=events)

    async def _exchange(self, steps: list[EngineStep], news: EngineNews) -> list[EngineInbox]:
        """One trip per step: deliver the steps, publish the news, pick up messages."""
        self.publish(news)
        for step in steps:
            await self.outbox.send(step)
        return _drain(self.inbox)

    async def _receive(self, news: EngineNews, timeout_s: float) -> EngineInbox | object | None:
        """Idle: publish, then wait for a message (``_QUIET`` after ``timeout_s``; None
        when every sender closed)."""
        self.publish(news)
        try:
            with trio.move_on_after(timeout_s):
                return await self.inbox.receive()
            return _QUIET
        except trio.EndOfChannel:
            return None

    def exchange(self, steps: list[EngineStep], touched: list[str] | None) -> None:
        for message in trio.from_thread.run(self._exchange, steps, self.news(touched)):
            _handle(self.pool, message)

    def wait_idle(self) -> bool:
        """Block until a message comes (False: every sender closed). Meanwhile, after
        ``release_after_idle_s`` give freed buffers back; unload models idle past their TTL."""
        released, quiet_from = False, time.monotonic()
        while True:
            timeout = self.pool.next_expiry() - self.pool.clock()
            if not released:
                timeout = min(
                    timeout, quiet_from + self.options.release_after_idle_s - time.monotonic()
                )
            first = trio.from_thread.run(self._receive, self.news(), max(timeout, 0.0))
            if first is None:
                return False
            if first is not _QUIET:
                _handle(self.pool, first)  # type: ignore[arg-type]
                return True
            if not released and time.monotonic() - quiet_from >= self.options.release_after_idle_s:
                self.pool.release_buffers()
                released = True
            self.pool.expire()
            if not self.pool.idle:
                return True

    def load_wanted(self) -> list[EngineStep]:
        """Load every wanted model there is room for; the failures of those that fail."""
        failures = []
        while (model := self.pool.next_load()) is not None:
            self.pool.loading(model)
            self.exchange([], [])  # publish "loading" (and any unloads) before the slow part
            failed = self.pool.load(model)
            if failed is not None:
                failures.append(failed)
        return failures


def core_for(runner: Runner, info: ModelInfo, max_batch: int, options: EngineOptions):
    """A loaded model's engine core (``max_batch``: the model's own, 0: the engine's);
    ``mlxd bench --engine`` builds its core here too."""
    return EngineCore(
        runner,
        max_batch=max_batch or options.max_batch,
        prefill_chunk_tokens=options.prefill_chunk_tokens,
        batch_prefill=options.batch_prefill,
        memory=info.memory,
        retry_after_s=options.retry_after_s,
        vocab_size=info.vocab_size,
    )


def _ready(task_status: trio.TaskStatus[dict[str, ModelInfo]], infos, publish, news) -> None:
    publish(news)  # the idle snapshot (the memory the models alone take) before "ready"
    task_status.started(infos)


def _engine_loop(
    specs: list[ModelSpec],
    options: EngineOptions,
    inbox: trio.MemoryReceiveChannel[EngineInbox],
    outbox: trio.MemorySendChannel[EngineStep],
    task_status: trio.TaskStatus[dict[str, ModelInfo]],
) -> None:
    def make_core(runner: Runner, info: ModelInfo, max_batch: int) -> EngineCore:
        return core_for(runner, info, max_batch, options)

    pool = ModelPool.of(specs, options.limits, make_core, free_memory=options.free_memory)
    infos = pool.preload()
    loop = _Loop(pool, options, inbox, outbox)
    trio.from_thread.run_sync(_ready, task_status, infos, loop.publish, loop.news())
    steps: list[EngineStep] = []
    touched: list[str] | None = None
    while True:
        loop.exchange(steps, touched)
        steps = loop.load_wanted()
        pool.expire()
        if pool.idle and not steps and not loop.wait_idle():
            return  # every sender closed: shutdown
        steps += loop.load_wanted()
        trio.from_thread.check_cancelled()
        step = pool.step()
        touched = [step.model] if step is not None else None
        if step is not None and (step.started or step.tokens or step.failed):
            steps.append(step)


async def run(
    inbox: trio.MemoryReceiveChannel[EngineInbox],
    outbox: trio.MemorySendChannel[EngineStep],
    specs: list[ModelSpec],
    options: EngineOptions,
    *,
    task_status: trio.TaskStatus[dict[str, ModelInfo]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Load the preloaded models (``task_status.started(infos)`` once they are), then
    serve forever, loading the others on first use."""
    async with inbox, outbox:
        await trio.to_thread.run_sync(_engine_loop, specs, options, inbox, outbox, task_status)
