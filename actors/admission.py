"""Admission controller: a bounded waiting queue in front of a cap on running requests.

``AdmissionPolicy`` is the sync core (FCFS; no trio): ``admit`` says run, queue
or reject; ``release`` frees a slot and hands back whatever may now run. The
actor adapts it to channels: admitted requests go to the tokenizer, rejections
become a 429 ``Failed`` in the request's mailbox.
"""

from __future__ import annotations

from collections import OrderedDict
from enum import Enum

import trio

from actors.mailbox import Mailboxes
from protocol.messages import AdmissionInbox, Admit, AdmittedRequest, Failed, Release


class Decision(Enum):
    RUN = "run"
    QUEUE = "queue"
    REJECT = "reject"


class AdmissionPolicy:
    """First come, first served, with ``max_running`` slots and ``max_waiting`` places."""

    def __init__(self, max_running: int, max_waiting: int):
        self.max_running = max_running
        self.max_waiting = max_waiting
        self.running: set[str] = set()
        self.waiting: OrderedDict[str, AdmittedRequest] = OrderedDict()

    def admit(self, request: AdmittedRequest) -> Decision:
        if len(self.running) < self.max_running and not self.waiting:
            self.running.add(request.request_id)
            return Decision.RUN
        if len(self.waiting) < self.max_waiting:
            self.waiting[request.request_id] = request
            return Decision.QUEUE
        return Decision.REJECT

    def release(self, request_id: str) -> list[AdmittedRequest]:
        """Forget a request (running or still waiting); return requests that may now run."""
        self.running.discard(request_id)
        self.waiting.pop(request_id, None)
        ready = []
        while self.waiting and len(self.running) < self.max_running:
            _, request = self.waiting.popitem(last=False)
            self.running.add(request.request_id)
            ready.append(request)
        return ready


async def run(
    inbox: trio.MemoryReceiveChannel[AdmissionInbox],
    outbox: trio.MemorySendChannel[AdmittedRequest],
    mailboxes: Mailboxes,
    policy: AdmissionPolicy,
    retry_after_s: float,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run, queue or reject each request; forward runnable ones to the tokenizer."""
    task_status.started()
    async with inbox, outbox:
        async for message in inbox:
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
        status=429,
        kind="rate_limit_exceeded",
        message=(
            f"server is at capacity ({policy.max_running} running, "
            f"{policy.max_waiting} waiting); retry later"
        ),
        retry_after=retry_after_s,
    )
