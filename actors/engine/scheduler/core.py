"""Engine core: the scheduling policy of the generation actor, as a plain class.

Each ``step()`` moves waiting requests into prefill while the batch has room
and the memory budget allows (see ``memory.py`` for why the memory gate is
here), spends a prompt-token budget on
prefill (oldest request first, chunked, so a long prompt never stalls running
streams for more than one chunk), then runs one batched decode step, and
returns one ``EngineStep`` carrying the news for every request.

Under ``memory.admission = "use"`` (``memory.py``) a request is admitted when its
prompt plus a growth margin fits, and rows are counted for what they hold as
they grow. Before a decode step whose growth would not fit (after evicting
prefix-cache snapshots), the row that arrived last (of the lowest priority) is
*preempted*: the runner leaves its cache in the prefix cache as a snapshot at its
tokens so far (evicted to the disk tier or dropped under pressure, like any
snapshot) and frees it; its tokens, seed draws and grammar stay known here
(``Recovery``). It resumes ahead of new arrivals once it fits again, as its
replay: prompt + output so far, which hits the snapshot (a disk read waits off
this thread, ``Runner.wait_for``) or is recomputed by prefill, and goes on with
no ``Started`` and no token repeated. Rows with images cannot be rebuilt that way;
they are counted for their whole ``max_tokens`` and never preempted. Timeouts are
not kept here: the pipeline's timer fails a request that waited too long or
passed its deadline, and the engine honours the ``Abort`` that follows.

Failures stay per request: options the model cannot run are refused before
any MLX op sees them (``checks.check_sampling``, a 400); a runner error while
starting or prefilling a request fails that request alone; a row whose own
sampler or logits processors fail in a batched step fails alone while the step
completes for the others (the runner's row guards, ``Runner.faults``); a step
that raises as a whole drops the runner's batch, and ``recovery.py`` bisects
its rows to fail only the culprit and replays the rest, who go on where they
stopped (an allocation failure, no row's fault, fails that step's rows with a
503). No trio, no mlx: tests drive it with a fake runner.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from mlxd.actors.engine.scheduler.checks import check_sampling
from mlxd.actors.engine.scheduler.memory import MemoryModel, is_memory_error
from mlxd.actors.engine.scheduler.recovery import Recovery
from mlxd.actors.engine.scheduler.types import InvalidRequest, Runner
from mlxd.protocol.messages import (
    EngineStats,
    EngineStep,
    Failed,
    FinishReason,
    Started,
    TokenizedRequest,
    TokenLogprob,
    TokenStep,
)

log = logging.getLogger("mlxd.engine")

_NOT_RESUMABLE = (
    "a decode step failed, and this request (constrained output or images) cannot be "
    "rebuilt to go on"
)


@dataclass(order=True)
class _Waiting:
    """A submitted request not yet in the batch; sorts by (priority, arrival order)."""

    priority: int
    seq: int
    request: TokenizedRequest = field(compare=False)


class EngineCore:
    """Waiting → prefilling → decoding, with caps on batch size and on estimated memory."""

    def __init__(
        self,
        runner: Runner,
        *,
        max_batch: int,
        prefill_chunk_tokens: int,
        prefill_unsplit_tokens: int = 0,
        memory: MemoryModel | None = None,
        retry_after_s: float = 1.0,
        vocab_size: int | None = None,
        batch_prefill: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.runner = runner
        # None: where the runner says it pays (a GPU); False: one forward pass per request
        self.batch_prefill = batch_prefill
        self.vocab_size = vocab_size  # None: requests are not checked against a vocabulary
        self.max_batch = max_batch
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # a prompt with at most this many tokens left is prefilled whole, in one step
        self.prefill_unsplit_tokens = prefill_unsplit_tokens
        self.memory = memory
        self.retry_after_s = retry_after_s
        self.waiting: list[_Waiting] = []  # kept sorted
        self.prefilling: OrderedDict[str, TokenizedRequest] = OrderedDict()
        self.decoding: dict[str, TokenizedRequest] = {}
        self.reserved: dict[str, int] = {}  # estimated bytes of every sequence in the batch
        self.reserved_bytes = 0
        self._left: dict[str, int] = {}  # prompt tokens each prefilling request has yet to run
        self._seq = itertools.count()
        self._steps = self._decode_steps = self._batch_size = self._batch_tokens = 0
        self._failed_steps = 0
        self.recovery = Recovery()
        self.clock = clock
        # memory.admission "use": rows taken out for memory, back ahead of new arrivals
        self.preempted: list[_Waiting] = []  # kept sorted, as the rows first arrived
        self._order: dict[str, tuple[int, int]] = {}  # (priority, arrival) of each row
        self._decoded: dict[str, int] = {}  # tokens each row has decoded since it started
        self._out_since: dict[str, float] = {}  # when each preempted row went out
        self._growth = _step_growth(runner)
        self._preemptions = self._resumes = self._preempted_bytes = 0
        self._preempted_seconds = 0.0

    @property
    def idle(self) -> bool:
        busy = self.waiting or self.prefilling or self.decoding or self.preempted
        return not busy and self.recovery.idle

    def submit(self, request: TokenizedRequest) -> None:
        # Equal priorities keep their arrival order (``seq``).
        bisect.insort(self.waiting, _Waiting(request.priority, next(self._seq), request))

    def abort(self, request_id: str) -> None:
        self.waiting = [w for w in self.waiting if w.request.request_id != request_id]
        self.preempted = [w for w in self.preempted if w.request.request_id != request_id]
        self._back(request_id)
        self.prefilling.pop(request_id, None)
        self._left.pop(request_id, None)
        self.decoding.pop(request_id, None)
        self._forget(request_id)
        self._release(request_id)
        self.runner.remove(request_id)

    def step(self) -> EngineStep:
        started: list[Started] = []
        failed: list[Failed] = []
        self._resume(failed)
        if not self.recovery.active:
            self._admit(started, failed)
        self._prefill(failed)
        self._make_room(failed)
        tokens = self._decode(failed)
        self._steps += 1
        return EngineStep(started=tuple(started), tokens=tuple(tokens), failed=tuple(failed))

    def stats(self) -> EngineStats:
        active, peak = self.runner.memory_stats()
        return EngineStats(
            steps=self._steps,
            decode_steps=self._decode_steps,
            waiting=len(self.waiting),
            prefilling=len(self.prefilling),
            decoding=len(self.decoding),
            batch_size=self._batch_size,
            batch_tokens_total=self._batch_tokens,
            memory_active=active,
            memory_peak=peak,
            kv_reserved=self.reserved_bytes,
            kv_budget=self.memory.budget_bytes if self.memory else 0,
            failed_steps=self._failed_steps,
            preemptions=self._preemptions,
            resumes=self._resumes,
            preempted=len(self.preempted),
            preempted_bytes=self._preempted_bytes,
            preempted_seconds=self._preempted_seconds,
            counters=self.runner.counters(),
        )

    # ---- waiting → prefill ----------------------------------------------------------

    def _admit(self, started: list[Started], failed: list[Failed]) -> None:
        """Move waiting requests into prefill while the batch and the memory budget have room.

        A request whose prompt shares its start with one being prefilled right now waits
        (in its place) until that prefill has passed the shared part and left a snapshot
        there (``Runner.wait_for``): the shared prefix is computed once, not once each.
        """
        if not self._bring_back(failed):
            return  # a preempted row waits for room: new arrivals wait behind it
        held: list[_Waiting] = []
        try:
            while self.waiting and len(self.prefilling) + len(self.decoding) < self.max_batch:
                request = self.waiting[0].request
                if self.runner.wait_for(request) is not None:
                    held.append(self.waiting.pop(0))
                    continue
                need = self._estimate(request)
                if self.memory and not self._fits(need):
                    if self.reserved:
                        return  # it fits once running sequences finish: wait, in order
                    self.waiting.pop(0)
                    failed.append(self._too_large(request))
                    continue
                first = self.waiting.pop(0)
                self._order[request.request_id] = (first.priority, first.seq)
                self._start(request, need, started, failed)
        finally:
            self.waiting[:0] = held  # they keep their places at the front

    def _fits(self, need: int) -> bool:
        """Whether ``need`` more bytes fit the budget, which prefix-cache snapshots share:
        they are evicted (least recently used first) to make room for live requests."""
        assert self.memory is not None
        over = self.reserved_bytes + need + self.runner.cache_held - self.memory.budget_bytes
        if over > 0:
            self.runner.shrink_cache(over)
        return self.reserved_bytes + need + self.runner.cache_held <= self.memory.budget_bytes

    def _start(
        self, request: TokenizedRequest, need: int, started: list[Started], failed: list[Failed]
    ) -> None:
        rid = request.request_id
        try:
            if self.vocab_size is not None:
                check_sampling(request.sampling, request.prompt_tokens, self.vocab_size)
            cached = self.runner.start(request)
        except Exception as exc:  # noqa: BLE001 - any runner error fails this request only
            self._forget(rid)
            failed.append(self._failure(rid, "could not start", exc))
            return
        self.prefilling[rid] = request
        self.reserved[rid] = need
        self.reserved_bytes += need
        prompt = len(request.prompt_tokens)
        prefilled = prompt - cached - self.runner.skipped_tokens(rid)
        self._left[rid] = max(prefilled - 1, 0)  # the last prompt token goes in with decode
        if not self.recovery.started(request):
            return  # a replay: its client already has its Started
        started.append(
            Started(
                request_id=rid,
                prompt_tokens=prompt,
                cached_tokens=cached,
                prefilled_tokens=prefilled,
                output=request.output,
            )
        )

    def _estimate(self, request: TokenizedRequest, decoded: int = 0) -> int:
        """What a row is counted for once ``decoded`` tokens are in its cache (0: joining);
        a row that cannot be preempted (images) for its whole ``max_tokens``."""
        if self.memory is None:
            return 0
        full = request.vision is not None
        max_tokens = request.sampling.max_tokens or 0
        return self.memory.row_bytes(len(request.prompt_tokens), max_tokens, decoded, full=full)

    def _too_large(self, request: TokenizedRequest) -> Failed:
        assert self.memory is not None
        message = self.memory.too_large_message(
            len(request.prompt_tokens), request.sampling.max_tokens or 0
        )
        return Failed(
            request_id=request.request_id,
            reason="request_too_large",
            param="max_tokens",
            message=message,
        )

    def _release(self, request_id: str) -> None:
        self.reserved_bytes -= self.reserved.pop(request_id, 0)
        self._decoded.pop(request_id, None)

    def _forget(self, request_id: str) -> None:
        """The request ended (finished, failed or aborted): nothing will rebuild it."""
        self.recovery.forget(request_id)
        self._order.pop(request_id, None)

    # ---- preemption (memory.admission "use") ----------------------------------------

    def _make_room(self, failed: list[Failed]) -> None:
        """Before a decode step: count every row for what the step may add to it; while
        that does not fit (snapshots evicted first), preempt the newest row."""
        if self.memory is None:
            return
        while self.decoding:
            needs = {rid: self._need(rid) for rid in self.reserved}
            extra = sum(needs.values()) - self.reserved_bytes
            if extra <= 0 or self._fits(extra):
                self.reserved.update(needs)
                self.reserved_bytes += extra
                return
            victim = self._victim()
            if victim is None:
                if len(self.reserved) == 1:  # alone, it outgrows the whole budget
                    self._outgrown(failed)
                return
            self._preempt(victim)

    def _need(self, rid: str) -> int:
        request = self.decoding.get(rid) or self.prefilling[rid]
        return self._estimate(request, self._decoded.get(rid, 0) + self._growth)

    def _victim(self) -> str | None:
        """The row that arrived last (the lowest priority first), among those that can be
        rebuilt from their tokens; None when no other row is left to free memory."""
        rows = [r for r in self.reserved if self.recovery.preemptable(r)]
        if not rows or len(self.reserved) < 2:
            return None
        return max(rows, key=lambda r: self._order.get(r, (0, 0)))

    def _preempt(self, rid: str) -> None:
        """Take ``rid`` out of the batch: its cache becomes a snapshot (``Runner.preempt``),
        its tokens and state stay here until it resumes as its replay."""
        self.prefilling.pop(rid, None)
        self.decoding.pop(rid, None)
        self._left.pop(rid, None)
        self._release(rid)
        spilled = self.runner.preempt(rid)
        priority, seq = self._order.get(rid, (0, 0))
        bisect.insort(self.preempted, _Waiting(priority, seq, self.recovery.preempt(rid)))
        self._out_since[rid] = self.clock()
        self._preemptions += 1
        self._preempted_bytes += spilled
        log.info("request %s preempted for memory (%d snapshot bytes)", rid, spilled)

    def _bring_back(self, failed: list[Failed]) -> bool:
        """Resume preempted rows, first come first, while they fit; False while one waits."""
        while self.preempted:
            if len(self.prefilling) + len(self.decoding) >= self.max_batch:
                return False
            request = self.preempted[0].request
            if self.runner.wait_for(request) is not None:
                return False  # its snapshot is being read from disk, or shared soon
            need = self._estimate(request)
            if self.memory and not self._fits(need):
                return False
            self.preempted.pop(0)
            self._back(request.request_id)
            self._resumes += 1
            self._start(request, need, [], failed)
        return True

    def _back(self, rid: str) -> None:
        since = self._out_since.pop(rid, None)
        if since is not None:
            self._preempted_seconds += self.clock() - since

    def _outgrown(self, failed: list[Failed]) -> None:
        """The one row left cannot grow within the budget: it fails as too large (the
        tokenizer stage refuses such requests; this is for a core driven directly)."""
        rid = next(iter(self.reserved))
        request = self.decoding.get(rid) or self.prefilling[rid]
        self.prefilling.pop(rid, None)
        self.decoding.pop(rid, None)
        self._left.pop(rid, None)
        self._release(rid)
        self.runner.remove(rid)
        self._forget(rid)
        failed.append(self._too_large(request))

    # ---- prefill and decode ---------------------------------------------------------

    def _prefill(self, failed: list[Failed]) -> None:
        """Spend the step's prompt-token budget, oldest request first. Where the runner can,
        the requests given budget are prefilled together (``Runner.prefill_batch``: their
        chunks share forward passes); a request whose own prefill fails fails alone."""
        plan = self._prefill_plan()
        wanted = self.batch_prefill
        if wanted is None:
            wanted = self.runner.batch_prefill_pays
        if len(plan) > 1 and wanted and self.runner.batches_prefill:
            results = self.runner.prefill_batch(dict(plan))
            for rid, _ in plan:
                result = results[rid]
                if isinstance(result, Exception):
                    self._prefill_failed(rid, result, failed)
                else:
                    self._prefilled(rid, result)
            return
        for rid, budget in plan:
            try:
                left = self.runner.prefill(rid, budget)
            except Exception as exc:  # noqa: BLE001 - a prefill error fails this request only
                self._prefill_failed(rid, exc, failed)
            else:
                self._prefilled(rid, left)

    def _prefill_plan(self) -> list[tuple[str, int]]:
        """(request, token budget) for this step: oldest first, each charged for what it
        will run (a request with nothing left still needs its turn to join the batch).

        A short prompt (``prefill_unsplit_tokens`` or fewer left) that the rest of the
        budget cannot take whole waits for the next step rather than being split: its
        tail would ride in the next step's pass as a row of a few tokens padded to the
        others' length, over a cache the others are padded to meet (32 chat prompts of
        ~65 tokens: a step's 512-token pass took 1.4 s with such a row, 1.0 s without).
        The step's first request is always given the budget, so every step progresses."""
        budget, plan = self.prefill_chunk_tokens, []
        for rid in self.prefilling:
            if budget <= 0:
                break
            if not self.recovery.may_prefill(rid):
                continue  # a trial runs: its step must hold only rows it can blame
            left = self._left.get(rid, 0)
            if plan and budget < left <= self.prefill_unsplit_tokens:
                break  # whole, next step (oldest first: no younger request goes ahead)
            plan.append((rid, budget))
            budget -= max(min(left, budget), 1)
        return plan

    def _prefill_failed(self, rid: str, exc: Exception, failed: list[Failed]) -> None:
        self.prefilling.pop(rid)
        self._left.pop(rid, None)
        self._release(rid)
        self.runner.remove(rid)
        self._forget(rid)
        failed.append(self._failure(rid, "prefill failed", exc))

    def _prefilled(self, rid: str, left: int) -> None:
        self._left[rid] = left
        if left == 0:
            self.decoding[rid] = self.prefilling.pop(rid)
            self._left.pop(rid, None)

    def _decode(self, failed: list[Failed]) -> list[TokenStep]:
        """One decode step; a runner may emit several tokens per request (speculation)."""
        if not self.decoding:
            return []
        self._decode_steps += 1
        self._batch_size = len(self.decoding)
        self._batch_tokens += self._batch_size
        in_step = set(self.decoding)
        try:
            decoded = self.runner.decode()
        except Exception as exc:  # noqa: BLE001 - a failed step fails its requests, not the daemon
            self._fail_batch(exc, failed)
            return []
        faults = self.runner.faults()
        for rid, exc in faults.items():
            if self.decoding.pop(rid, None) is not None:
                self._release(rid)
                self.runner.remove(rid)
                self._forget(rid)
                failed.append(self._failure(rid, "sampling failed", exc))
        self.recovery.passed(in_step)
        tokens: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprob]] = {}
        finished: dict[str, FinishReason] = {}
        for d in decoded:
            if d.request_id not in self.decoding or d.request_id in faults:
                continue
            tokens.setdefault(d.request_id, [])
            logprobs.setdefault(d.request_id, [])
            if d.finish_reason != "stop":  # the stop token (EOS) is not part of the completion
                tokens[d.request_id].append(d.token)
                if d.logprob is not None:
                    logprobs[d.request_id].append(d.logprob)
            if d.finish_reason is not None:
                finished[d.request_id] = d.finish_reason
                del self.decoding[d.request_id]
                self._release(d.request_id)
        for rid, t in tokens.items():
            if rid in finished:
                self._forget(rid)
            else:
                self.recovery.decoded(rid, t)
                self._decoded[rid] = self._decoded.get(rid, 0) + len(t)
        return [
            TokenStep(
                request_id=rid,
                tokens=tuple(t),
                finish_reason=finished.get(rid),
                logprobs=tuple(logprobs[rid]),
            )
            for rid, t in tokens.items()
        ]

    def _fail_batch(self, exc: Exception, failed: list[Failed]) -> None:
        """A step raised as a whole: the runner drops its batch; find the culprit.

        An allocation failure is no row's fault: the step's rows get a 503. Otherwise
        ``Recovery`` bisects the rows (see ``recovery.py``): only a row found guilty,
        or one that cannot be rebuilt, fails; the others are replayed and go on.
        """
        self._failed_steps += 1
        rows = sorted(self.decoding)
        log.error("decode step failed for %d requests: %r", len(rows), exc)
        for rid in rows:
            self._release(rid)
        self.decoding.clear()
        self.runner.reset()
        memory = is_memory_error(exc)
        resumable = [r for r in rows if not memory and self.recovery.resumable(r)]
        guilty = set(self.recovery.failed_step(resumable)) if resumable else set()
        for rid in rows:
            if rid in guilty or rid not in resumable:
                what = "decode step failed" if memory or rid in guilty else _NOT_RESUMABLE
                failed.append(self._failure(rid, what, exc))
                self._forget(rid)
                self.runner.remove(rid)  # whatever the runner still keeps for it

    def _resume(self, failed: list[Failed]) -> None:
        """Start the replays of rows from a failed step (their clients saw no break)."""
        for request in self.recovery.next_replays():
            self._start(request, self._estimate(request), [], failed)

    def _failure(self, request_id: str, what: str, exc: Exception) -> Failed:
        log.warning("request %s: %s: %r", request_id, what, exc)
        if isinstance(exc, InvalidRequest):
            return Failed(
                request_id=request_id,
                reason="invalid_request",
                param=exc.param,
                message=str(exc),
            )
        if is_memory_error(exc):
            return Failed(
                request_id=request_id,
                reason="out_of_memory",
                message=f"{what}: out of memory ({exc}); retry later",
                retry_after=self.retry_after_s,
            )
        return Failed(request_id=request_id, reason="internal_error", message=f"{what}: {exc}")


def _step_growth(runner: Runner) -> int:
    """Tokens one decode step may add to a row's cache: 2 (a row that joined decodes twice,
    ``MlxRunner.decode``), or a speculative step's drafts and its bonus token."""
    spec = runner.counters().speculative
    return 1 + (spec.num_draft_tokens if spec is not None and spec.enabled else 1)
