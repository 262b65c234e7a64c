"""Finding the culprit of a failed batched decode step, and resuming everyone else.

A row whose own code fails (its sampler, its logits processors) is caught by
the runner's row guards and fails alone (``guards.py``). A step can still raise
as a whole, for a reason no guard saw (an error that surfaces only when the
batch is evaluated). Then the runner's batch is gone, and this bookkeeping
decides what happens to the rows that were in it:

- one row: it is the culprit; it fails.
- several: they are split in two halves, and each half is tried on its own (a
  *trial*: decode steps holding only that half and rows not under suspicion),
  one half after the other. A half whose rows all get through a step is
  cleared; a half that fails again is split again, down to single rows. A
  culprit is found in about log2(rows) extra steps, and only it fails.
- every row that is not failed is *replayed*: it re-enters as a request whose
  prompt is its prompt plus the tokens it already emitted (the prefix cache
  usually holds most of that) and whose ``max_tokens`` is what it has left, so
  its client sees the output go on where it stopped. Its penalties see the same
  tokens as before, and a seeded row's key goes on where it stopped (the runner
  skips one draw per token emitted, ``TokenizedRequest.resumed``), as in an
  uninterrupted run; under speculative
  decoding, whose draws per token vary, a replayed seeded row restarts its key
  from the seed. A row with a grammar or images cannot be rebuilt that way
  (the grammar's state, the image inputs); the engine fails it with a message
  that says so. A lazy tool-call grammar (``tool_choice: auto``) can: its
  processor replays the emitted tokens to find where the call stands.

While a trial runs, the engine admits and prefills nothing but replays, so a
trial step holds only rows it can blame. Allocation failures are no row's
fault and are not bisected: the engine fails that step's rows with a 503.

A row preempted for memory (``core.py``, ``memory.admission = "use"``) resumes
the same way, as its replay; its grammar state is rebuilt by the runner from the
tokens it emitted, so a constrained row can be preempted.

Plain bookkeeping: no trio, no mlx.
"""

from __future__ import annotations

from collections import deque

import msgspec
from mlxd.protocol.messages import TokenizedRequest


class Recovery:
    """Emitted tokens per running row; suspect groups, the trial, and rows to replay."""

    def __init__(self) -> None:
        self.origins: dict[str, TokenizedRequest] = {}  # each running request as submitted
        self.emitted: dict[str, list[int]] = {}  # tokens each running request has emitted
        self.suspects: deque[list[str]] = deque()  # groups waiting for their trial
        self.trial: list[str] | None = None  # the group on trial now
        self.parked: dict[str, TokenizedRequest] = {}  # replays not yet started
        self.rebuilding: set[str] = set()  # replays being prefilled

    @property
    def active(self) -> bool:
        """A trial runs or waits: the engine admits and prefills nothing but replays."""
        return self.trial is not None or bool(self.suspects)

    @property
    def idle(self) -> bool:
        return not (self.active or self.parked)

    def started(self, request: TokenizedRequest) -> bool:
        """Note a request entering the batch; False if it is a replay (no new ``Started``)."""
        rid = request.request_id
        if rid in self.origins:
            self.rebuilding.add(rid)
            return False
        self.origins[rid], self.emitted[rid] = request, []
        return True

    def decoded(self, request_id: str, tokens: list[int]) -> None:
        self.emitted[request_id].extend(tokens)
        self.rebuilding.discard(request_id)

    def forget(self, request_id: str) -> None:
        """The request ended (finished, failed or aborted)."""
        for table in (self.origins, self.emitted, self.parked):
            table.pop(request_id, None)
        self._unsuspect(request_id)

    def _unsuspect(self, request_id: str) -> None:
        self.rebuilding.discard(request_id)
        self.suspects = deque(
            g for g in ([r for r in g if r != request_id] for g in self.suspects) if g
        )
        if self.trial is not None and request_id in self.trial:
            self.trial = [r for r in self.trial if r != request_id] or None

    def resumable(self, request_id: str) -> bool:
        origin = self.origins.get(request_id)
        # a lazy call grammar (tool_choice auto) is rebuilt from the emitted tokens
        free = origin is not None and (
            origin.grammar is None or getattr(origin.grammar, "replayable", False)
        )
        return free and origin.vision is None  # type: ignore[union-attr]

    def failed_step(self, rows: list[str]) -> list[str]:
        """A decode step of ``rows`` (all resumable) raised; returns the guilty rows.

        In a trial step only the trial group is suspected; every other row is parked
        for a replay.
        """
        on_trial = [r for r in rows if self.trial is not None and r in self.trial]
        if on_trial:
            self.trial = None
        suspects = on_trial or rows
        guilty = suspects if len(suspects) == 1 else []
        if not guilty:
            half = len(suspects) // 2
            self.suspects.extendleft([suspects[half:], suspects[:half]])
        for rid in rows:
            if rid not in guilty:
                self.parked[rid] = self._replay(rid)
        return guilty

    def _replay(self, request_id: str) -> TokenizedRequest:
        origin, emitted = self.origins[request_id], self.emitted[request_id]
        sampling = origin.sampling
        left = (sampling.max_tokens or 0) - len(emitted)
        return msgspec.structs.replace(
            origin,
            prompt_tokens=origin.prompt_tokens + tuple(emitted),
            sampling=msgspec.structs.replace(sampling, max_tokens=left),
            checkpoints=(),
            resumed=len(emitted),
        )

    def preempt(self, request_id: str) -> TokenizedRequest:
        """The request a preempted row resumes as (its prompt + what it emitted); it stays
        known, so its resume sends no second ``Started``."""
        self._unsuspect(request_id)  # a trial must not wait for a row that is out
        return self._replay(request_id)

    def preemptable(self, request_id: str) -> bool:
        """Rebuilt from its tokens alone: images are not (a grammar is: ``resumed``)."""
        origin = self.origins.get(request_id)
        return origin is not None and origin.vision is None

    def next_replays(self) -> list[TokenizedRequest]:
        """Replays to start now: the next trial group's, and every row not under suspicion."""
        if self.trial is None and self.suspects:
            self.trial = self.suspects.popleft()
        held = {r for group in self.suspects for r in group}
        ready = [rid for rid in self.parked if rid not in held]
        return [self.parked.pop(rid) for rid in ready]

    def passed(self, in_step: set[str]) -> None:
        """A decode step succeeded: the trial group is cleared once all its rows were in one."""
        if self.trial is not None and all(r in in_step for r in self.trial):
            self.trial = None

    def may_prefill(self, request_id: str) -> bool:
        return not self.active or request_id in self.rebuilding
