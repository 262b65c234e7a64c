"""Slowness that does not depend on the machine: a fake runner whose every decode step
takes ``step_s`` of trio's ``MockClock`` (jumped from the generation thread) and no real
time. Under a MockClock with no autojump, the clock moves only with the engine's steps:
a test says "this row decodes for 3 s" as a count of steps."""

from __future__ import annotations

from dataclasses import dataclass

import trio
from trio.testing import MockClock

from tests.fakes import FakeRunner


@dataclass
class ClockedRunner(FakeRunner):
    """``FakeRunner`` whose decode steps each jump ``clock`` by ``step_s``."""

    clock: MockClock | None = None
    step_s: float = 0.1
    step_delay: float = 0.0

    def decode(self):
        assert self.clock is not None, "ClockedRunner needs the test's MockClock"
        trio.from_thread.run_sync(self.clock.jump, self.step_s)
        return super().decode()
