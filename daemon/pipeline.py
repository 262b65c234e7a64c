"""The front door of the actor graph, as the HTTP handlers see it.

A ``Session`` is one request's life: its mailbox is registered and an ``Admit``
sent on entry; ``close()`` (shielded, idempotent) unregisters the mailbox, frees
the admission slot and, unless the sequence is already over (the engine ended it,
or the streamer aborted it at a stop string), aborts it.
A client disconnect cancels the handler, whose cleanup calls ``close()``: that is
the abort path. The slot and the sequence are freed earlier, by
``Pipeline.release_ended``, as soon as the request's final event reaches its
mailbox, so a client that stops reading holds neither.

Both timeouts live here, in one timer (``Pipeline.expire``), and nowhere else:
a request that has not started (no ``Started`` yet: queued for a slot,
tokenizing, or waiting in the engine for memory or a batch place) gets a 503
``queue_timeout`` with ``Retry-After`` once the queue has not moved for it for
``admission.queue_timeout_s``: its wait counts from its arrival, or from the last
time a request moved in a way that could admit it (its own model's, see
``Timeouts``), so a queue that moves behind a slow batch never refuses, and newer
requests that keep overtaking it cannot keep it waiting for ever. A request still open
``admission.request_timeout_s`` after its arrival gets a 504 ``request_timeout`` (an
error event once streaming), whether or not its client reads. The failure is put in
its mailbox, so ``release_ended`` frees
its slot and aborts whatever the admission queue, tokenizer or engine still
holds of it, as for any other failure. Each session keeps a ``RequestTrace``
that it hands to the telemetry when it closes.
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import trio
from mlxd.actors.admission import AdmissionPolicy
from mlxd.actors.engine.actor import EngineNews
from mlxd.actors.engine.scheduler.pool import ModelEvent
from mlxd.actors.engine.scheduler.types import ModelInfo
from mlxd.actors.mailbox import Bell, Mailbox, Mailboxes
from mlxd.actors.models import ModelRegistry
from mlxd.actors.tokenizer import PromptBuilder, bad_input
from mlxd.daemon.history import History
from mlxd.daemon.telemetry import API_ROUTE, Live, RequestTrace, Telemetry
from mlxd.protocol import status as wire
from mlxd.protocol.messages import (
    Abort,
    AdmissionInbox,
    Admit,
    AdmittedRequest,
    EngineInbox,
    EngineStats,
    Failed,
    Finished,
    MailboxEvent,
    Release,
)


class ServerState(enum.Enum):
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"


class Session:
    """One admitted request: its mailbox, and the cleanup that must always run."""

    def __init__(self, pipeline: Pipeline, mailbox: Mailbox, model: str = ""):
        self._pipeline = pipeline
        self.mailbox = mailbox
        self._closed = self._released = False
        self.trace = RequestTrace(
            mailbox.request_id, trio.current_time(), model=model, api=API_ROUTE.get()
        )

    @property
    def request_id(self) -> str:
        return self.mailbox.request_id

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        p = self._pipeline
        p.mailboxes.unregister(self.request_id)
        p.sessions.pop(self.request_id, None)
        p.timeouts.remove(self.request_id)
        self.trace.close(trio.current_time())
        p.telemetry.request_done(self.trace)
        if p.history is not None:
            p.history.request_done(self.trace, time.time())
        await self.release()

    async def release(self, *, shield: bool = True) -> None:
        """Abort the sequence unless it is over, and free the admission slot (once)."""
        if self._released:
            return
        self._released = True
        p = self._pipeline
        with trio.CancelScope(shield=shield):
            if not self.mailbox.engine_done:
                await p.engine.send(Abort(request_id=self.request_id))
            await p.admission.send(Release(request_id=self.request_id))

    async def events(self) -> AsyncIterator[list[MailboxEvent]]:
        """Batches of merged events until the final one; closes the session at the end."""
        try:
            while True:
                batch = await self._next_batch()
                self.trace.observe(batch, trio.current_time())
                yield batch
                if isinstance(batch[-1], Finished | Failed):
                    return
        finally:
            await self.close()

    def take(self) -> list[MailboxEvent]:
        """Pending events without waiting, seen by the trace."""
        events = self.mailbox.take()
        if events:
            self.trace.observe(events, trio.current_time())
        return events

    async def _next_batch(self) -> list[MailboxEvent]:
        return await self.mailbox.get()


class Timeouts:
    """When each open request's queue timeout and deadline fall (trio clock, seconds).

    A deadline falls ``request_timeout_s`` after the request's arrival. A queue timeout
    falls ``queue_timeout_s`` after a waiting request's clock last started: at its
    arrival, and again whenever another request moves in a way that could admit it:
    one for the same model starts (that model's queue moved up) or ends (its memory and
    batch place came back), or one for another model ends while ``could_use`` says the
    waiting request can use what that frees (an admission slot; room to load its
    model). Requests that arrived before it always count. Requests that arrived after
    it count only during its first ``queue_timeout_s``: prompts are built in parallel,
    so some may reach the engine's queue ahead of it, but a flow of newer requests that
    keeps overtaking it (another model's never count; higher ``priority``) cannot keep
    it waiting for ever. The requests ahead of it are finitely many, so it starts or is
    refused by ``2 * queue_timeout_s`` after its arrival, or ``queue_timeout_s`` after
    the last older request moved, whichever is later. Deadlines keep arrival order as
    expiry order (an insertion-ordered dict read from its oldest entry). A delay of 0
    turns that timeout off.
    """

    def __init__(self, queue_timeout_s: float = 0.0, request_timeout_s: float = 0.0):
        self.queue_timeout_s, self.request_timeout_s = queue_timeout_s, request_timeout_s
        # arrival order, model and arrival time, per open request
        self._open: dict[str, tuple[int, str, float]] = {}
        self._seq = itertools.count()
        self._queue: dict[str, float] = {}  # not started yet: when its clock last started
        self._deadline: dict[str, float] = {}

    def add(self, request_id: str, now: float, model: str = "") -> None:
        self._open[request_id] = (next(self._seq), model, now)
        if self.queue_timeout_s > 0:
            self._queue[request_id] = now
        if self.request_timeout_s > 0:
            self._deadline[request_id] = now + self.request_timeout_s

    def remove(self, request_id: str) -> None:
        self._open.pop(request_id, None)
        self._queue.pop(request_id, None)
        self._deadline.pop(request_id, None)

    def started(self, request_id: str, now: float) -> None:
        """It left the queues: the waiting requests for its model moved up."""
        self._queue.pop(request_id, None)
        self._restart(request_id, now, None)

    def ended(
        self, request_id: str, now: float, could_use: Callable[[str, str], bool] | None = None
    ) -> None:
        """A started request ended: the waiting requests for its model, and those of any
        model that ``could_use(request_id, model)`` what it freed, start their clocks again."""
        self._restart(request_id, now, could_use)

    def _restart(
        self, request_id: str, now: float, could_use: Callable[[str, str], bool] | None
    ) -> None:
        mover = self._open.get(request_id)
        if mover is None:
            return
        seq, model, _ = mover
        for waiting in self._queue:
            their_seq, their_model, arrival = self._open[waiting]
            ahead = seq < their_seq or now - arrival < self.queue_timeout_s
            usable = their_model == model or (
                could_use is not None and could_use(waiting, their_model)
            )
            if ahead and usable:
                self._queue[waiting] = now

    def next_at(self) -> float:
        """The earliest expiry (``inf``: none pending)."""
        queued = min(self._queue.values(), default=math.inf) + self.queue_timeout_s
        return min(queued, _first(self._deadline))

    def due(self, now: float) -> tuple[list[str], list[str]]:
        """Pop and return the requests whose queue timeout, and whose deadline, has come."""
        limit = now - self.queue_timeout_s
        queued = [rid for rid, since in self._queue.items() if since <= limit]
        for request_id in queued:
            del self._queue[request_id]
        return queued, _pop_due(self._deadline, now)


def _first(times: dict[str, float]) -> float:
    return next(iter(times.values()), math.inf)


def _pop_due(times: dict[str, float], now: float) -> list[str]:
    due = []
    while times and _first(times) <= now:
        request_id = next(iter(times))
        del times[request_id]
        due.append(request_id)
    return due


@dataclass
class Pipeline:
    """Channels into the actor graph, the shared mailbox registry, and read-only views
    of the actors' state for /metrics and /v1/status."""

    admission: trio.MemorySendChannel[AdmissionInbox]
    engine: trio.MemorySendChannel[EngineInbox]
    mailboxes: Mailboxes
    timeouts: Timeouts = field(default_factory=Timeouts)
    retry_after_s: float = 1.0  # a queue timeout's Retry-After
    keepalive_s: float = 0.0  # a started request quiet this long gets an empty batch (0: never)
    expired: int = 0  # requests failed by their queue timeout
    state: ServerState = ServerState.LOADING
    models: ModelRegistry | None = None  # the served models (set once the actors run)
    policy: AdmissionPolicy | None = None  # read only outside the admission actor
    model_stats: dict[str, EngineStats] = field(default_factory=dict)  # per loaded model
    speculative: dict[str, bool] = field(default_factory=dict)  # configured on, per model
    early_events: list[ModelEvent] = field(default_factory=list)  # before the registry exists
    sessions: dict[str, Session] = field(default_factory=dict)
    telemetry: Telemetry = field(default_factory=Telemetry)
    count_limiter: trio.CapacityLimiter | None = None  # its worker threads (tokenizer.workers)
    history: History | None = None  # the dashboard's samples and recent requests (None: off)

    @property
    def info(self) -> ModelInfo | None:
        """The default model's info (None until it has loaded once)."""
        return self.models.info(self.models.default) if self.models else None

    @property
    def builder(self) -> PromptBuilder | None:
        """The default model's prompt builder, the one the tokenizer actor uses."""
        return self.models.entries[self.models.default].builder if self.models else None

    def model_info(self, model: str) -> ModelInfo | None:
        return self.models.info(model) if self.models else None

    @property
    def engine_stats(self) -> EngineStats:
        """Every loaded model's snapshot added up (memory is the process's: the largest)."""
        return _sum_stats(list(self.model_stats.values()))

    def stats_of(self, model: str) -> EngineStats:
        """The engine's snapshot of ``model`` (an adapter's: its base's)."""
        return self.model_stats.get(self._base(model), EngineStats())

    def _base(self, model: str) -> str:
        """The entry serving ``model``: an adapter's base (its requests share its queue)."""
        return self.models.base_of(model) if self.models is not None else model

    async def count_tokens(self, request: AdmittedRequest) -> int:
        """Prompt tokens of a request, rendered as it would be served (worker thread).

        Raises ``PromptError`` (a 400) for a prompt that bad input cannot build, as the
        tokenizer actor fails such a request, and ``ModelUnavailable`` when its model
        cannot load; any other exception is a bug (a 500).
        """
        assert self.models is not None, "count_tokens before the actors run"
        model, rid = request.model or self.models.default, request.request_id
        try:  # the model stays loaded (pinned by the request id) until the Abort
            builder = await self.models.prepare(model, rid)
            tokens = await trio.to_thread.run_sync(
                builder.tokens, request, limiter=self.count_limiter
            )
        except Exception as exc:
            error = bad_input(exc)
            if error is None:
                raise
            raise error from exc
        finally:
            with trio.CancelScope(shield=True):
                await self.engine.send(Abort(request_id=rid))
        return len(tokens)

    async def release_ended(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Free the slot of each request whose final event reached its mailbox.

        The slot follows the generation, not the client: a client that reads
        nothing (its handler blocked writing to the socket) or has vanished keeps
        its connection, but its slot comes back when the engine ends the sequence
        (at the latest at the request's deadline). A failure the engine did not
        send (a timeout, a client that reads nothing) also aborts its sequence here.
        """
        task_status.started()
        while True:
            for box in await self.mailboxes.ended():
                session = self.sessions.get(box.request_id)
                if session is not None:  # unshielded: cancelled with the actors it sends to
                    await session.release(shield=False)

    def __post_init__(self) -> None:
        self._timer = Bell()
        self.telemetry.watch(self.live)
        self.mailboxes.on_moved = self._moved

    def _moved(self, request_id: str, ended: bool) -> None:
        """A request started, or a started one ended: the queue clocks it restarts."""
        now = trio.current_time()
        if ended:
            self.timeouts.ended(request_id, now, self._could_use)
        else:
            self.timeouts.started(request_id, now)

    def _could_use(self, request_id: str, model: str) -> bool:
        """Whether a waiting request can use what another model's ending request frees:
        it waits for an admission slot, or its model waits for room to load."""
        if self.policy is not None and request_id in self.policy.waiting:
            return True
        entry = self.models.entries.get(self._base(model)) if self.models is not None else None
        return entry is not None and entry.state == "unloaded"

    def live(self) -> Live:
        """What the telemetry reads: the engine's snapshots, admission counts, open
        requests, and every served model's state."""
        queued = self.policy.waiting if self.policy else {}
        requests = [(s.trace, rid in queued) for rid, s in self.sessions.items()]
        info, memory = self.info, self.info.memory if self.info else None
        model = None
        if info is not None and self.models is not None:
            default = self.models.default
            model = _model_status(
                default, info, _server_template(self.models, default), _fim(self.models, default)
            )
        return Live(
            state=self.state.value,
            engine=self.engine_stats,
            admission=self._admission(),
            requests=requests,
            model=model,
            kv_bytes_per_token=memory.kv_bytes_per_token if memory else 0,
            state_bytes=memory.state_bytes if memory else 0,
            models=self._models(),
            adapters=self._adapters(),
        )

    def _models(self) -> list[wire.ServedModel]:
        if self.models is None:
            return []
        return [
            wire.ServedModel(
                id=e.id,
                state=e.state,
                error=e.error,
                loads=e.loads,
                unloads=e.unloads,
                last_load_s=round(e.last_load_s, 3),
                last_unload_s=round(e.last_unload_s, 3),
                last_unload_reason=e.last_unload_reason,
                weights_bytes=e.weights_bytes,
                waiting_for_load=e.waiting,
                model=_model_status(
                    e.id, e.info, _server_template(self.models, e.id), _fim(self.models, e.id)
                )
                if e.info is not None
                else None,
                engine=self.model_stats.get(e.id) if e.state == "loaded" else None,
            )
            for e in self.models.entries.values()
        ]

    def _adapters(self) -> list[wire.ServedAdapter]:
        if self.models is None:
            return []
        return [
            wire.ServedAdapter(
                id=a.name,
                base=a.base,
                path=a.path,
                source=a.source,
                state=self.models.adapter_state(a),
                error=a.error,
                bytes=a.nbytes,
            )
            for a in self.models.adapters.values()
        ]

    def _admission(self) -> wire.AdmissionStatus:
        p = self.policy
        if p is None:
            return wire.AdmissionStatus(
                running=0, waiting=0, max_running=0, max_waiting=0, rejected=0, expired=0
            )
        return wire.AdmissionStatus(
            running=len(p.running),
            waiting=len(p.waiting),
            max_running=p.max_running,
            max_waiting=p.max_waiting,
            rejected=p.rejected,
            expired=self.expired,
        )

    def publish(self, news: EngineNews) -> None:
        """The engine's snapshots and model events after each step (on the trio thread)."""
        self.model_stats.update(news.stats)
        if self.history is not None:
            self.history.add_tokens(news.tokens)
            if self.policy is not None:
                self.history.note_load(len(self.policy.running), len(self.policy.waiting))
        for event in news.events:
            if event.state in ("unloaded", "failed"):
                self.model_stats.pop(event.model, None)
            if self.models is not None:
                self.models.on_event(event)
            else:  # the preloaded models' loads: replayed once the registry exists
                self.early_events.append(event)

    async def sample_history(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The dashboard's sampler: every ``dashboard.sample_period_s`` one sample of the
        open requests, the admission counts and the loaded models' counters."""
        history = self.history
        assert history is not None, "sampling with the dashboard off"
        task_status.started()
        next_at = trio.current_time()
        while True:  # a late wake-up (a busy thread) does not make up for lost periods
            next_at = max(next_at + history.period_s, trio.current_time() + history.period_s / 2)
            await trio.sleep_until(next_at)
            admission, speculation = self._admission(), {}
            for model, stats in self.model_stats.items():
                spec = stats.counters.speculative
                if spec is not None:
                    speculation[model] = (spec.drafted, spec.accepted)
            history.sample(
                trio.current_time(),
                time.time(),
                [s.trace for s in self.sessions.values()],
                admission.running,
                admission.waiting,
                speculation,
                self.engine_stats.memory_active,
            )

    async def expire(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """The timer: fail each request at its queue timeout (if it has not started) and
        at its deadline (if it has not ended); ``release_ended`` does the rest."""
        task_status.started()
        while True:
            self._timer.reset()
            queued, late = self.timeouts.due(trio.current_time())
            for request_id in queued:
                box = self.mailboxes.get(request_id)
                if box is not None and not box.began and not box.ended:
                    self.expired += 1
                    box.put(self._queue_timeout(request_id))
            for request_id in late:
                self.mailboxes.deliver(self._deadline_passed(request_id))
            # a wake-up before a timeout that progress moved later finds nothing due
            with trio.move_on_at(self.timeouts.next_at()):
                await self._timer.wait()  # rung when a request arrives

    def _queue_timeout(self, request_id: str) -> Failed:
        return Failed(
            request_id=request_id,
            reason="queue_timeout",
            message=(
                f"waited {self.timeouts.queue_timeout_s:g}s for a slot, memory or a batch "
                "place while no request that could make room for it started or finished "
                "(admission.queue_timeout_s); retry later"
            ),
            retry_after=self.retry_after_s,
        )

    def _deadline_passed(self, request_id: str) -> Failed:
        return Failed(
            request_id=request_id,
            reason="request_timeout",
            message=(
                f"the request did not finish within {self.timeouts.request_timeout_s:g}s "
                "(admission.request_timeout_s); generation was stopped"
            ),
        )

    def open_session(self, request_id: str, model: str) -> Session:
        """A session for a request that skips admission and the tokenizer actor (an
        embedding request, ``daemon/api/embeddings.py``): its mailbox, trace and timeouts."""
        mailbox = self.mailboxes.register(request_id)
        session = self.sessions[request_id] = Session(self, mailbox, model)
        self.timeouts.add(request_id, session.trace.start, self._base(model))
        self._timer.ring()
        return session

    async def submit(self, request: AdmittedRequest, bell: Bell | None = None) -> Session:
        """Register the request's mailbox (sharing ``bell`` with its siblings), start its
        timeouts and admit it."""
        mailbox = self.mailboxes.register(request.request_id, bell)
        model = request.model or (self.models.default if self.models else "")
        session = self.sessions[request.request_id] = Session(self, mailbox, model)
        self.timeouts.add(request.request_id, session.trace.start, self._base(model))
        self._timer.ring()
        try:
            await self.admission.send(Admit(request=request))
        except BaseException:
            await session.close()
            raise
        return session


def _model_status(
    model: str, info: ModelInfo, server_template: bool = False, fim: wire.FimStatus | None = None
) -> wire.ModelStatus:
    w, warmup = info.warmup, None
    if w is not None:
        warmup = wire.WarmupStatus(
            seconds=w.seconds, max_batch=w.max_batch, prompt_tokens=list(w.prompt_tokens)
        )
    template = info.chat_template
    if server_template and template is not None:  # model.chat_template replaces any
        template = wire.ChatTemplateStatus(source="setting", why="model.chat_template")
    return wire.ModelStatus(
        id=model,
        backend=info.backend,
        context_length=info.context_length,
        kind=info.kind,
        warmup=warmup,
        chat_template=template,
        fim=fim,
    )


def _fim(models: ModelRegistry, model: str) -> wire.FimStatus | None:
    """The model's FIM format, as its prompt builder found it (None before it has one)."""
    entry = models.entries.get(model)
    builder = entry.builder if entry is not None else None
    if builder is None:
        return None
    return wire.FimStatus(
        format=builder.fim.format.name if builder.fim.format else None, why=builder.fim.why
    )


def _server_template(models: ModelRegistry, model: str) -> bool:
    options = models.prompts.get(model)
    return bool(options and options.chat_template)


def _sum_stats(stats: list[EngineStats]) -> EngineStats:
    """Counts added up; memory figures are the process's (each model reports the same)."""
    if len(stats) == 1:
        return stats[0]
    if not stats:
        return EngineStats()
    largest = ("memory_active", "memory_peak", "expires_at")
    totals = {
        f.name: (max if f.name in largest else sum)(getattr(s, f.name) for s in stats)
        for f in msgspec.structs.fields(EngineStats)
        if f.name != "counters"
    }
    return EngineStats(**totals, counters=stats[0].counters)
