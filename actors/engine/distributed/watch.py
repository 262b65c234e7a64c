"""Rank 0's watch on the other ranks of a distributed group (no mlx here).

Serving one model over several machines (``replica.py``), every engine step is a
collective: a follower that dies makes the next collective fail on rank 0 (the ring
backend raises once the peer's socket closes), and one that hangs makes it block.
The leader's runner proxy writes both into a ``Watch``: ``lost`` when a collective
failed (its generation thread then parks: nothing it could do would be matched by
the other ranks), and a deadline while a broadcast or a runner call runs. ``monitor``
polls the watch on the trio thread; a loss, or a deadline passed, fails
every open request with a 503, gives those answers ``exit_grace_s`` to reach their
clients, and ends the process with ``EXIT_PEER_LOST``: the generation thread may be
stuck inside a collective that nothing can cancel, so no orderly shutdown could finish.
The monitor runs outside the actors' cancel scope and keeps watching while a SIGTERM
(``mlx.launch`` sends one to every rank once one has died) shuts them down; a shutdown
during the grace ends the process at once.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import trio

log = logging.getLogger("mlxd.distributed")

EXIT_PEER_LOST = 3  # the exit status of a rank whose group lost a member


@dataclass
class Watch:
    """What the generation thread tells the monitor; written there, read on the trio thread.

    ``deadline``: while a broadcast or a runner call is under way, the monotonic time by
    which it must be over, and what to call it if it is not. A peer that dies while a
    decode step is in flight can leave the next collective blocked for good (the ring
    backend fails its pending tasks, then waits): the broadcast's own short timeout
    catches that within seconds.
    """

    lost: str | None = None  # why the group is broken, once it is
    deadline: tuple[float, str] | None = None

    def lose(self, reason: str) -> None:
        if self.lost is None:
            self.lost = reason

    def expect(self, within_s: float, what: str) -> None:
        self.deadline = (time.monotonic() + within_s, what)

    def done(self) -> None:
        self.deadline = None

    def trouble(self) -> str | None:
        """Why the group must be given up, or None while all is well."""
        if self.lost is not None:
            return self.lost
        deadline = self.deadline
        if deadline is not None and time.monotonic() > deadline[0]:
            return f"{deadline[1]} did not finish in time: a rank is gone or hangs"
        return None


def park() -> None:
    """Stop the calling (generation) thread for good: the monitor ends the process."""
    threading.Event().wait()


FailAll = Callable[[str], int]  # fails every open request with a 503 saying why; how many


async def monitor(
    watch: Watch,
    fail_all: FailAll,
    *,
    exit_grace_s: float,
    poll_s: float = 0.2,
    exit: Callable[[int], object] = os._exit,
) -> None:
    """Poll ``watch``; on trouble fail every open request, wait ``exit_grace_s``, exit."""
    # Polled: the watch is written on the generation thread, and a hang sets nothing.
    while (reason := watch.trouble()) is None:  # noqa: ASYNC110
        await trio.sleep(poll_s)
    failed = fail_all(reason)
    log.error("distributed group lost: %s; %d open requests failed with 503", reason, failed)
    try:
        await trio.sleep(exit_grace_s)
    finally:  # a shutdown (SIGTERM) cuts the grace short: it cannot end the parked thread
        log.error("exiting (status %d)", EXIT_PEER_LOST)
        logging.shutdown()
        exit(EXIT_PEER_LOST)
