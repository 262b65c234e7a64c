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

LoRA adapters are served ids of their own over a base entry (``Adapter``): a request
naming one is built with its base's prompt builder and submitted to the base with an
``AdapterRef``. Before the first request on an adapter, and whenever its files change
or its base reloads, its files are checked against the base's linear layers
(``ModelInfo.lora_targets``) on a worker thread: a mismatch fails that request (a 400
naming the module and shapes) and marks the adapter failed, while the base and the
other adapters serve on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import trio
from mlxd.actors.engine.adapters import files
from mlxd.actors.engine.scheduler.pool import ModelEvent
from mlxd.actors.engine.scheduler.types import ModelInfo
from mlxd.actors.grammar import GrammarCompiler
from mlxd.actors.mailbox import Mailboxes
from mlxd.actors.streamer import StreamState
from mlxd.actors.tokenizer import ModelUnavailable, PromptBuilder, TokenizerOptions
from mlxd.protocol.messages import AdapterRef, EngineInbox, EngineStep, Failed, Load

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


@dataclass
class Adapter:
    """One served LoRA adapter over the entry ``base``. ``state``: ``unchecked`` (no
    request has used it yet), ``ready`` (its files fit the base) or ``failed`` (``error``
    says why); the check holds for the files' ``fingerprint`` and the base's info."""

    name: str
    base: str
    path: str  # its directory, ``~`` expanded
    source: str = "settings"  # or "api" (POST /v1/load_lora_adapter)
    state: str = "unchecked"
    error: str = ""
    fingerprint: str = ""  # of the files last checked
    checked_of: ModelInfo | None = None  # the base's info they were checked against
    nbytes: int = 0  # what its tensors take once loaded (known once checked)

    def ref(self) -> AdapterRef:
        return AdapterRef(name=self.name, path=self.path, fingerprint=self.fingerprint)


def expand(path: str) -> str:
    """An adapter's directory as served: ``~`` expanded."""
    return str(Path(path).expanduser())


def _adapter_refusal(info: ModelInfo) -> str:
    """Why the model takes no adapters ("" when it takes them)."""
    if info.adapters_refused:
        return info.adapters_refused
    return "" if info.lora_targets else "its runner takes no LoRA adapters"


def check_files(path: str, targets: Mapping[str, tuple[int, int]], base: str) -> int:
    """The adapter's bytes once loaded; ``files.AdapterError`` unless its files fit the base
    (a worker thread: it reads the config and the safetensors header)."""
    found = files.inspect(Path(path))
    found.check(targets, base)
    return found.nbytes


class ModelRegistry:
    """Every served model's entry, in configuration order (the first is the default), and
    the LoRA adapters served over them."""

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
        adapters: Mapping[str, Mapping[str, str]] | None = None,
    ):
        self.entries = {i: Entry(i, kind=(kinds or {}).get(i, "auto")) for i in ids}
        self.adapters: dict[str, Adapter] = {}
        self.unloaded: set[str] = set()  # adapters' ids no longer served: a 404, never an alias
        for base, table in (adapters or {}).items():
            for name, path in table.items():
                if name in self.entries:  # [model]'s id is known only once it has loaded
                    raise ValueError(f"adapters: {name!r} ({base}) is a model's id")
                self.adapters[name] = Adapter(name, base, expand(path))
        self.default = ids[0]
        self.engine, self.mailboxes = engine, mailboxes
        self.prompts, self.options = prompts, options
        # "auto": a one-model daemon serves any id (clients hard-code theirs); with several
        # models, or LoRA adapters (ever), an unknown id is more likely a typo than an alias.
        self.auto_ids = accept_other_ids == "auto"
        self.accept_other_ids = len(ids) == 1 if self.auto_ids else bool(accept_other_ids)
        self._no_aliases()

    def _no_aliases(self) -> None:
        """With adapters an unknown id is not an alias ("auto"): a typo of an adapter's id,
        or one unloaded, must not be answered by the base."""
        if self.auto_ids and self.adapters:
            self.accept_other_ids = False

    # ---- lookups ---------------------------------------------------------------------

    def find(self, requested: str | None) -> str | None:
        """The entry a request's ``model`` selects: none named → the default; an unknown
        id → None (a 404), or the default when ``accept_other_ids``."""
        if not requested:
            return self.default
        if requested in self.entries or requested in self.adapters:
            return requested
        if requested in self.unloaded:
            return None
        return self.default if self.accept_other_ids else None

    def base_of(self, model: str) -> str:
        """The entry that serves ``model``: an adapter's base, else the model itself."""
        adapter = self.adapters.get(model)
        return adapter.base if adapter is not None else model

    def info(self, model: str) -> ModelInfo | None:
        """The model's (an adapter's: its base's) last loaded info (None: never loaded yet)."""
        entry = self.entries.get(self.base_of(model))
        return entry.info if entry else None

    def target(self, model: str, request_id: str) -> tuple[str, AdapterRef | None]:
        """Where a request on ``model`` goes: the entry's id, and the adapter its rows decode
        with (None: the base's own weights). ``ModelUnavailable`` for an adapter unloaded
        since the request chose it."""
        adapter = self.adapters.get(model)
        if adapter is not None:
            return adapter.base, adapter.ref()
        if model not in self.entries:
            raise ModelUnavailable(self._gone(model, request_id))
        return model, None

    def _gone(self, model: str, request_id: str | None) -> Failed:
        return Failed(
            request_id=request_id or "",
            reason="invalid_request",
            param="model",
            message=f"adapter {model!r} was unloaded (POST /v1/unload_lora_adapter)",
        )

    def _entry(self, model: str, request_id: str | None) -> Entry:
        """The entry serving ``model`` (an adapter's base); ``ModelUnavailable`` for an
        adapter unloaded since the request chose it."""
        entry = self.entries.get(self.base_of(model))
        if entry is None:
            raise ModelUnavailable(self._gone(model, request_id))
        return entry

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
        load takes too long, or the model failed to load), for an embedding model, and for
        an adapter whose files do not fit its base (a 400)."""
        entry = self._entry(model, request_id)
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
        info = await self.loaded(model, request_id)
        adapter = self.adapters.get(model)
        if adapter is not None:
            await self.check_adapter(adapter, info, request_id)
        return await self.builder(entry)

    async def loaded(self, model: str, request_id: str | None) -> ModelInfo:
        """The model's (an adapter's: its base's) info once it is loaded (asking the engine
        to load it; ``request_id`` keeps it loaded until that request is submitted or
        aborted). Raises ``ModelUnavailable`` as ``prepare`` does."""
        entry = self._entry(model, request_id)
        self._check_failed(entry, request_id)
        await self.engine.send(Load(model=entry.id, request_id=request_id))
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

    # ---- adapters ----------------------------------------------------------------------

    async def check_adapter(
        self, adapter: Adapter, info: ModelInfo, request_id: str | None
    ) -> None:
        """``ModelUnavailable`` (a 400 naming the adapter) unless the adapter's files fit its
        loaded base ``info``; checked again once its files or the base's info change."""
        fingerprint = await trio.to_thread.run_sync(files.fingerprint, Path(adapter.path))
        if fingerprint != adapter.fingerprint or adapter.checked_of is not info:
            error, nbytes = "", 0
            refusal = _adapter_refusal(info)
            if refusal:
                error = f"model {adapter.base!r} takes no LoRA adapters: {refusal}"
            else:
                try:
                    nbytes = await trio.to_thread.run_sync(
                        check_files, adapter.path, info.lora_targets, adapter.base
                    )
                except files.AdapterError as exc:
                    error = str(exc)
            adapter.fingerprint, adapter.checked_of, adapter.nbytes = fingerprint, info, nbytes
            adapter.state, adapter.error = ("failed", error) if error else ("ready", "")
            if error:
                log.warning("adapter %r cannot serve: %s", adapter.name, error)
        if adapter.state == "failed":
            raise ModelUnavailable(
                Failed(
                    request_id=request_id or "",
                    reason="invalid_request",
                    param="model",
                    message=f"adapter {adapter.name!r} cannot be served: {adapter.error}",
                )
            )

    def adapter_id_taken(self, name: str) -> bool:
        return name in self.entries or name in self.adapters

    async def add_adapter(self, name: str, path: str, base: str, request_id: str) -> Adapter:
        """Check the adapter's files against ``base`` (loading it; ``request_id`` pins it
        until the caller aborts that id) and serve it as ``name``. Raises
        ``ModelUnavailable``: the base cannot load, or the files do not fit (a 400);
        ``ValueError``: ``name`` is taken."""
        adapter = Adapter(name, base, expand(path), source="api")
        info = await self.loaded(base, request_id)
        await self.check_adapter(adapter, info, request_id)
        if self.adapter_id_taken(name):  # another load took it meanwhile
            raise ValueError(f"{name!r} is already a served model or adapter id")
        self.adapters[name] = adapter
        self.unloaded.discard(name)
        self._no_aliases()
        log.info("adapter %r (%s) serves over %r", name, adapter.path, base)
        return adapter

    def remove_adapter(self, name: str) -> Adapter | None:
        """Stop serving the adapter ``name`` (None: there is none); new requests on it 404."""
        adapter = self.adapters.pop(name, None)
        if adapter is not None:
            self.unloaded.add(name)
            log.info("adapter %r no longer served", name)
        return adapter

    def adapter_state(self, adapter: Adapter) -> str:
        """The adapter as a listing shows it: ``failed`` when its check failed, else its
        base's state."""
        if adapter.state == "failed":
            return "failed"
        return self.entries[adapter.base].state

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
