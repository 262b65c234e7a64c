"""Model registry: the served models as the trio side sees them.

The generation actor owns the models (``actors/engine/scheduler/pool.py``) and publishes
their lifecycle (loading, loaded with its ``ModelInfo``, unloaded, failed); the
registry keeps each entry's state for ``/v1/models`` and ``/v1/status``, and gives
the tokenizer stage and the streamer what they need of a model: its
``PromptBuilder`` (tokenizer, chat template, grammar compiler, memory estimate)
and its ``StreamState`` (detokenizer). Tokenizers are no MLX, so they are used
off the generation thread; nothing here touches a model's weights.

``prepare`` is the waiting room of a model that is not loaded yet: it asks the
engine to load it (``Load``, which also keeps it loaded until the request is
submitted) and waits for the news, at most ``load_timeout_s``, with at most
``max_waiting`` requests per model; past either bound, and within
``failed_retry_s`` of a failed load, the request fails with a ``ModelUnavailable``
that names the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import trio
from mlxd.actors.engine.scheduler.pool import ModelEvent
from mlxd.actors.engine.scheduler.types import ModelInfo
from mlxd.actors.grammar import GrammarCompiler
from mlxd.actors.mailbox import Mailboxes
from mlxd.actors.streamer import StreamState
from mlxd.actors.tokenizer import ModelUnavailable, PromptBuilder, TokenizerOptions
from mlxd.protocol.messages import EngineInbox, EngineStep, Failed, Load

log = logging.getLogger("mlxd")


@dataclass(frozen=True)
class RegistryOptions:
    """Bounds on waiting for a model (the supervisor maps ``[model_pool]`` onto them)."""

    max_waiting: int = 32
    load_timeout_s: float = 30.0
    failed_retry_s: float = 30.0
    retry_after_s: float = 1.0


@dataclass
class Entry:
    """One served model's state; ``info`` is kept after an unload (tokenizers are cheap)."""

    id: str
    state: str = "unloaded"  # unloaded, loading, loaded or failed
    kind: str = "auto"  # as configured: an "embedding" model embeds and never chats
    info: ModelInfo | None = None
    error: str = ""
    failed_at: float = -float("inf")
    loads: int = 0
    unloads: int = 0
    last_load_s: float = 0.0
    last_unload_s: float = 0.0
    last_unload_reason: str = ""
    weights_bytes: int = 0
    waiting: int = 0  # requests in ``prepare``, waiting for the load
    changed: trio.Event = field(default_factory=trio.Event)
    builder: PromptBuilder | None = None  # for ``info`` (rebuilt when it changes)
    builder_of: ModelInfo | None = None
    grammars: GrammarCompiler | None = None  # kept across reloads of the same model
    stream: StreamState | None = None


class ModelRegistry:
    """Every served model's entry, in configuration order (the first is the default)."""

    def __init__(
        self,
        ids: list[str],
        engine: trio.MemorySendChannel[EngineInbox],
        mailboxes: Mailboxes,
        prompts: dict[str, TokenizerOptions],
        options: RegistryOptions,
        *,
        accept_other_ids: bool | str = "auto",
        kinds: dict[str, str] | None = None,
    ):
        self.entries = {i: Entry(i, kind=(kinds or {}).get(i, "auto")) for i in ids}
        self.default = ids[0]
        self.engine, self.mailboxes = engine, mailboxes
        self.prompts, self.options = prompts, options
        # "auto": a one-model daemon serves any id (clients hard-code theirs); with several
        # models an unknown id is more likely a typo than an alias.
        auto = accept_other_ids == "auto"
        self.accept_other_ids = len(ids) == 1 if auto else bool(accept_other_ids)

    # ---- lookups ---------------------------------------------------------------------

    def find(self, requested: str | None) -> str | None:
        """The entry a request's ``model`` selects: none named → the default; an unknown
        id → None (a 404), or the default when ``accept_other_ids``."""
        if not requested:
            return self.default
        if requested in self.entries:
            return requested
        return self.default if self.accept_other_ids else None

    def info(self, model: str) -> ModelInfo | None:
        """The model's last loaded info (None: never loaded yet)."""
        entry = self.entries.get(model)
        return entry.info if entry else None

    # ---- the engine's news (trio thread) ---------------------------------------------

    def on_event(self, event: ModelEvent) -> None:
        entry = self.entries[event.model]
        entry.state = event.state
        if event.state == "loaded":
            entry.info, entry.error, entry.loads = event.info, "", entry.loads + 1
            entry.last_load_s, entry.weights_bytes = event.seconds, event.weights_bytes
        elif event.state == "unloaded":
            entry.unloads += 1
            entry.last_unload_s, entry.last_unload_reason = event.seconds, event.reason
        elif event.state == "failed":
            entry.error, entry.failed_at = event.message, trio.current_time()
        entry.changed.set()
        entry.changed = trio.Event()

    # ---- the tokenizer stage -----------------------------------------------------------

    async def prepare(self, model: str, request_id: str | None) -> PromptBuilder:
        """The model's prompt builder once it is loaded (asking the engine to load it).

        Raises ``ModelUnavailable`` when the request may not wait (too many wait, the
        load takes too long, or the model failed to load), or for an embedding model."""
        entry = self.entries[model]
        if entry.kind == "embedding":
            raise ModelUnavailable(
                Failed(
                    request_id=request_id or "",
                    reason="invalid_request",
                    param="model",
                    message=f"model {model!r} is an embedding model: it serves /v1/embeddings "
                    "only, not chat or completions",
                )
            )
        await self.loaded(model, request_id)
        return await self.builder(entry)

    async def loaded(self, model: str, request_id: str | None) -> ModelInfo:
        """The model's info once it is loaded (asking the engine to load it; ``request_id``
        keeps it loaded until that request is submitted or aborted). Raises
        ``ModelUnavailable`` as ``prepare`` does."""
        entry = self.entries[model]
        self._check_failed(entry, request_id)
        await self.engine.send(Load(model=model, request_id=request_id))
        if entry.state != "loaded":
            await self._wait_loaded(entry, request_id)
        assert entry.info is not None, "a loaded model without its info"
        return entry.info

    def _check_failed(self, entry: Entry, request_id: str | None) -> None:
        since = trio.current_time() - entry.failed_at
        if entry.state == "failed" and since < self.options.failed_retry_s:
            raise ModelUnavailable(self._load_failed(entry, request_id))

    async def _wait_loaded(self, entry: Entry, request_id: str | None) -> None:
        o = self.options
        if entry.waiting >= o.max_waiting:
            raise ModelUnavailable(
                self._loading(
                    request_id,
                    f"model {entry.id!r} is loading and {entry.waiting} requests already "
                    f"wait for it (model_pool.max_waiting); retry later",
                )
            )
        entry.waiting += 1
        try:
            with trio.move_on_after(o.load_timeout_s):
                while entry.state != "loaded":
                    await entry.changed.wait()
                    if entry.state == "failed":
                        raise ModelUnavailable(self._load_failed(entry, request_id))
                return
        finally:
            entry.waiting -= 1
        raise ModelUnavailable(
            self._loading(
                request_id,
                f"model {entry.id!r} did not load within {o.load_timeout_s:g}s "
                "(model_pool.load_timeout_s); retry later",
            )
        )

    def _loading(self, request_id: str | None, message: str) -> Failed:
        return Failed(
            request_id=request_id or "",
            reason="model_loading",
            message=message,
            retry_after=self.options.retry_after_s,
        )

    def _load_failed(self, entry: Entry, request_id: str | None) -> Failed:
        return Failed(request_id=request_id or "", reason="model_load_failed", message=entry.error)

    async def builder(self, entry: Entry) -> PromptBuilder:
        """The entry's prompt builder for its current info (the grammar compiler reads
        the vocabulary: a worker thread, once per load)."""
        info = entry.info
        assert info is not None, "a builder before the model loaded"
        if entry.builder is None or entry.builder_of is not info:
            grammars = entry.grammars
            if (
                grammars is None
                or entry.builder_of is None
                or (entry.builder_of.model_dir != info.model_dir)
            ):  # the same files reloaded: the same vocabulary (its compiler takes ~1 s)
                options = self.prompts[entry.id]
                grammars = await trio.to_thread.run_sync(options.grammar_compiler, info.tokenizer)
            if entry.builder_of is not info:  # another request may have built it meanwhile
                entry.builder = PromptBuilder.for_model(info, self.prompts[entry.id], grammars)
                entry.builder_of, entry.grammars = info, grammars
        assert entry.builder is not None
        return entry.builder

    # ---- the streamer ------------------------------------------------------------------

    def stream_state(self, model: str) -> StreamState:
        entry = self.entries[model]
        if entry.stream is None:
            assert entry.info is not None, "a step from a model that never loaded"
            entry.stream = StreamState(entry.info.tokenizer, self.mailboxes)
        return entry.stream


class StreamStates:
    """The streamer's state per model: each step goes to its model's detokenizers."""

    def __init__(self, registry: ModelRegistry):
        self.registry = registry

    def on_step(self, step: EngineStep) -> list[str]:
        model = step.model or self.registry.default
        info = self.registry.info(model)
        # Failures of a load that never succeeded; an embedding model's whole news (no
        # text to detokenize): straight to the requests' mailboxes.
        if info is None or info.kind == "embedding":
            for event in (*step.started, *step.embedded, *step.failed):
                self.registry.mailboxes.deliver(event)
            return []
        return self.registry.stream_state(model).on_step(step)

    def __len__(self) -> int:
        return sum(len(e.stream) for e in self.registry.entries.values() if e.stream)
