"""Admission controller: a bounded waiting queue in front of a cap on running requests.

``AdmissionPolicy`` is the sync core (no trio): ``admit`` says run, queue or
reject; ``release`` frees a slot (or a queue place) and hands back whatever may
now run (first come, first served, or by the request's ``priority`` when that
is enabled). The actor adapts it to channels: admitted requests go to the
tokenizer, rejections become a 429 ``Failed`` with ``Retry-After`` in the
request's mailbox. A request that waits too long is failed by the pipeline's
timer (``admission.queue_timeout_s``), whose ``Release`` then drops it here.

This stage runs before tokenization, so it knows nothing of a request's size;
the memory gate is in the engine core (see ``actors/engine/scheduler/memory.py``).
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum

import trio
from mlxd.actors.mailbox import Mailboxes
from mlxd.protocol.messages import AdmissionInbox, Admit, AdmittedRequest, Failed, Release


class Decision(Enum):
    RUN = "run"
    QUEUE = "queue"
    REJECT = "reject"


@dataclass(frozen=True)
class _Queued:
    request: AdmittedRequest
    seq: int

    @property
    def order(self) -> tuple[int, int]:
        return self.request.priority, self.seq


@dataclass(frozen=True)
class AdmissionOptions:
    """The admission actor's options (the supervisor maps ``[admission]`` onto them)."""

    max_running: int = 32  # slots: requests past admission, up to the end of their generation
    max_waiting: int = 64  # queue places; beyond them a request is refused (429)
    priority: bool = False  # order the queue by each request's ``priority``
    retry_after_s: float = 1.0  # a refusal's Retry-After


class AdmissionPolicy:
    """``max_running`` slots and ``max_waiting`` places; FCFS unless ``priority`` is on."""

    @classmethod
    def from_options(cls, options: AdmissionOptions) -> AdmissionPolicy:
        return cls(options.max_running, options.max_waiting, priority=options.priority)

    def __init__(
        self,
        max_running: int,
        max_waiting: int,
        *,
        priority: bool = False,
    ):
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.priority = priority
        self.running: set[str] = set()
        self.waiting: OrderedDict[str, _Queued] = OrderedDict()  # in arrival order
        self.rejected = 0
        self._seq = itertools.count()

    def admit(self, request: AdmittedRequest) -> Decision:
        if len(self.running) < self.max_running and not self.waiting:
            self.running.add(request.request_id)
            return Decision.RUN
        if len(self.waiting) < self.max_waiting:
            self.waiting[request.request_id] = _Queued(request, next(self._seq))
            return Decision.QUEUE
        self.rejected += 1
        return Decision.REJECT

    def release(self, request_id: str) -> list[AdmittedRequest]:
        """Forget a request (running or still waiting); return requests that may now run."""
        self.running.discard(request_id)
        self.waiting.pop(request_id, None)
        ready = []
        while self.waiting and len(self.running) < self.max_running:
            request = self.waiting.pop(self._next()).request
            self.running.add(request.request_id)
            ready.append(request)
        return ready

    def _next(self) -> str:
        if not self.priority:
            return next(iter(self.waiting))
        return min(self.waiting.values(), key=lambda q: q.order).request.request_id


async def run(
    inbox: trio.MemoryReceiveChannel[AdmissionInbox],
    outbox: trio.MemorySendChannel[AdmittedRequest],
    mailboxes: Mailboxes,
    policy: AdmissionPolicy,
    options: AdmissionOptions,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run, queue or reject each request (``policy``, made from ``options``); forward
    runnable ones to the tokenizer."""
    task_status.started()
    async with inbox, outbox:
        async for message in inbox:
            await _handle(message, outbox, mailboxes, policy, options.retry_after_s)


async def _handle(
    message: AdmissionInbox,
    outbox: trio.MemorySendChannel[AdmittedRequest],
    mailboxes: Mailboxes,
    policy: AdmissionPolicy,
    retry_after_s: float,
) -> None:
    match message:
        case Admit(request=request):
            decision = policy.admit(request)
            if decision is Decision.RUN:
                await outbox.send(request)
            elif decision is Decision.REJECT:
                mailboxes.deliver(_rejection(request.request_id, policy, retry_after_s))
        case Release(request_id=request_id):
            for ready in policy.release(request_id):
                await outbox.send(ready)


def _rejection(request_id: str, policy: AdmissionPolicy, retry_after_s: float) -> Failed:
    return Failed(
        request_id=request_id,
        reason="queue_full",
        message=(
            f"server is at capacity ({policy.max_running} running, "
            f"{policy.max_waiting} waiting: admission.max_running, admission.max_waiting); "
            "retry later"
        ),
        retry_after=retry_after_s,
    )
