"""Model pool: the generation actor's loaded models, and when to load or unload one.

A plain class (no trio, no mlx): the actor hands it the inbox's messages and calls
``load`` / ``step`` on the generation thread. Each loaded model has its own
``EngineCore``; ``step`` runs one step of the next model with work, round-robin, so
models share the thread fairly, step for step.

A model loads on first use: a ``Load`` (sent by the tokenizer stage, which needs the
model's tokenizer before it can build the prompt) or a ``Submit`` for a model not
loaded marks it wanted. It loads once there is room: fewer than ``max_loaded``
models, and their weights within ``max_loaded_bytes`` (weights are measured at
each load). Room is made by unloading the least recently used model that is idle
(nothing waiting, prefilling or decoding) and not pinned (a ``Load`` names a
request whose ``Submit`` has not come yet). While no model can make room, the
wanted one waits; its requests wait with it, bounded by their queue timeout. A
model idle for ``idle_unload_s`` is unloaded. A load that raises fails the
requests submitted to that model (``model_load_failed``) and nothing else. A model's
``keep_alive`` (Ollama's, set per model by a ``KeepAlive``) replaces ``idle_unload_s``
for it. A model whose last load failed unloads nothing for its next try: room is made once that
load has succeeded (meanwhile one model more than ``max_loaded`` may be loaded), so
a broken model cannot evict a healthy one again and again. A first load that fails
after it made room reloads the models it unloaded (``restore``: right after the failure
is published, each that fits without unloading any other, with its idle time kept), so
a failed load leaves the pool as it found it.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
from mlxd.actors.engine.scheduler.core import EngineCore
from mlxd.actors.engine.scheduler.types import ModelInfo, Runner
from mlxd.protocol.messages import EmbedRequest, EngineStats, EngineStep, Failed, TokenizedRequest

log = logging.getLogger("mlxd.engine")

RunnerFactory = Callable[[], tuple[Runner, ModelInfo]]
CoreFactory = Callable[[Runner, ModelInfo, int], EngineCore]


@dataclass(frozen=True)
class ModelSpec:
    """One served model: its id, how to load it, its batch cap, whether it loads at start.

    Only a preloaded model may have the id "": it takes the loaded model's own name.
    """

    id: str
    factory: RunnerFactory
    max_batch: int
    preload: bool = False


@dataclass(frozen=True)
class PoolLimits:
    """How many models may be loaded, how much their weights may take, how long idle."""

    max_loaded: int = 2
    max_loaded_bytes: int = 0  # 0: no cap
    idle_unload_s: float = 0.0  # 0: never unload an idle model


@dataclass(frozen=True)
class ModelEvent:
    """A model's lifecycle news, for the registry and the status page.

    ``state``: loading, loaded, unloaded or failed; ``seconds``: how long the load or
    unload took; ``reason``: why it unloaded (idle, lru, memory).
    """

    model: str
    state: str
    info: ModelInfo | None = None
    message: str = ""
    seconds: float = 0.0
    weights_bytes: int = 0
    reason: str = ""


@dataclass
class _Loaded:
    core: EngineCore
    info: ModelInfo
    weights: int
    last_used: float


@dataclass
class ModelPool:
    """Every loaded model's engine core, the wanted ones, and the requests' owners."""

    specs: dict[str, ModelSpec]
    limits: PoolLimits
    make_core: CoreFactory
    free_memory: Callable[[], None] = lambda: None  # after an unload: return its buffers
    clock: Callable[[], float] = time.monotonic
    loaded: OrderedDict[str, _Loaded] = field(default_factory=OrderedDict)  # LRU first
    wanted: OrderedDict[str, None] = field(default_factory=OrderedDict)  # in request order
    queued: dict[str, list[TokenizedRequest | EmbedRequest]] = field(default_factory=dict)
    pins: dict[str, set[str]] = field(default_factory=dict)
    owner: dict[str, str] = field(default_factory=dict)  # request id → model
    events: list[ModelEvent] = field(default_factory=list)  # news not yet published
    weights_seen: dict[str, int] = field(default_factory=dict)  # model → weights at last load
    failed: set[str] = field(default_factory=set)  # models whose last load raised
    # model being loaded → the models unloaded to make room for it, with their last use
    evicted: dict[str, list[tuple[str, float]]] = field(default_factory=dict)
    # unloaded for a load that then failed: reloaded if they fit as things are (last use)
    restore: OrderedDict[str, float] = field(default_factory=OrderedDict)
    keep_alive: dict[str, float] = field(default_factory=dict)  # model → idle s (inf: never)
    _last: str = ""  # the model stepped last (round-robin goes on after it)

    @classmethod
    def of(cls, specs: list[ModelSpec], limits: PoolLimits, make_core: CoreFactory, **kw):
        return cls({s.id: s for s in specs}, limits, make_core, **kw)

    # ---- messages ------------------------------------------------------------------

    def submit(self, request: TokenizedRequest | EmbedRequest) -> None:
        model = request.model
        self._unpin(request.request_id)
        self.owner[request.request_id] = model
        slot = self.loaded.get(model)
        if slot is not None:
            self._touch(model)
            slot.core.submit(request)
        else:
            self.queued.setdefault(model, []).append(request)
            self.wanted.setdefault(model)

    def want(self, model: str, request_id: str | None) -> None:
        """A ``Load``: the model is about to be used (``request_id`` pins it until then;
        a model is wanted only while a request pins it or waits for it)."""
        if model not in self.specs:
            return  # the HTTP layer answered 404 for unknown ids: nothing to load
        if request_id is not None:
            self.pins.setdefault(model, set()).add(request_id)
            self.owner[request_id] = model
        if model in self.loaded:
            self._touch(model)
        else:
            self.wanted.setdefault(model)

    def abort(self, request_id: str) -> None:
        model = self.owner.pop(request_id, None)
        if model is None:
            return
        self._unpin(request_id, model)
        slot = self.loaded.get(model)
        if slot is not None:
            slot.core.abort(request_id)
        waiting = self.queued.get(model, [])
        self.queued[model] = [r for r in waiting if r.request_id != request_id]

    def set_keep_alive(self, model: str, seconds: float | None) -> None:
        """How long ``model`` stays loaded once idle, counted from now or its last step
        (None: ``idle_unload_s`` again; 0: unload as soon as it is idle; inf: never)."""
        if model not in self.specs:
            return
        if seconds is None:
            self.keep_alive.pop(model, None)
        else:
            self.keep_alive[model] = seconds
        if model in self.loaded:
            self._touch(model)

    def ttl(self, model: str) -> float:
        """Seconds ``model`` may stay idle before it is unloaded (inf: never)."""
        if model in self.keep_alive:
            return self.keep_alive[model]
        return self.limits.idle_unload_s or math.inf

    def clear_cache(self, model: str = "", tier: str = "") -> None:
        """Drop prefix-cache snapshots of ``model`` (every model: ""), in ``tier`` ("ram",
        "disk"; "": both). Unnamed, the disk tier loses every model's files."""
        for name, slot in self.loaded.items():
            runner = slot.core.runner
            if model not in ("", name):
                continue
            if hasattr(runner, "spill_cache"):  # a runner with a disk tier takes the tier
                runner.clear_cache(tier, not model)
            elif tier != "disk":
                runner.clear_cache()

    def unload_adapter(self, model: str, name: str) -> None:
        """``model``'s adapter ``name`` is no longer served: its runner drops its weights
        once no running row uses them (nothing where the model is not loaded)."""
        slot = self.loaded.get(model)
        drop = getattr(slot.core.runner, "unload_adapter", None) if slot is not None else None
        if drop is not None:
            drop(name)

    def spill(self, model: str, *, wait: bool) -> None:
        """Write ``model``'s prefix-cache snapshots to the disk tier, where it has one
        (before an unload, and at shutdown with ``wait``), so a reload starts warm."""
        runner = getattr(self.loaded[model].core, "runner", None)
        spill = getattr(runner, "spill_cache", None)
        if spill is not None:
            spill(wait=wait)

    def close(self) -> None:
        """Shutdown: every loaded model's snapshots to disk, waiting until written."""
        for model in list(self.loaded):
            self.spill(model, wait=True)

    # ---- scheduling ------------------------------------------------------------------

    @property
    def idle(self) -> bool:
        """Nothing to step and nothing that can load now: the actor may block on its inbox."""
        working = any(not s.core.idle for s in self.loaded.values())
        return not working and self.next_load() is None

    def next_load(self) -> str | None:
        """The first wanted model there is (or can be made) room for, if any. A model no
        request waits for any more (they were aborted) is no longer wanted."""
        for model in [m for m in self.wanted if not self.pins.get(m) and not self.queued.get(m)]:
            del self.wanted[model]
        for model in self.wanted:
            if self._room_for(model):
                return model
        for model in list(self.restore):
            if model not in self.loaded and self._fits_now(model):
                return model
            del self.restore[model]  # back already, or no room: it loads on its next request
        return None

    def step(self) -> EngineStep | None:
        """One step of the next model with work (round-robin); None if none has any."""
        busy = [m for m, s in self.loaded.items() if not s.core.idle]
        if not busy:
            return None
        order = sorted(busy)
        model = next((m for m in order if m > self._last), order[0])  # the next in turn
        self._last = model
        self._touch(model)
        result = self.loaded[model].core.step()
        for ended in _ended(result):
            self.owner.pop(ended, None)
        return msgspec.structs.replace(result, model=model)

    def expire(self) -> None:
        """Unload every model idle for its ``ttl``."""
        now = self.clock()
        for model in [m for m in self.loaded if self._evictable(m)]:
            if now - self.loaded[model].last_used >= self.ttl(model):
                self.unload(model, "idle")

    def next_expiry(self) -> float:
        """When the next idle model's ``ttl`` runs out (``inf``: none)."""
        times = [s.last_used + self.ttl(m) for m, s in self.loaded.items() if self._evictable(m)]
        return min(times, default=math.inf)

    def expires_at(self, model: str) -> float:
        """When a loaded ``model`` unloads if it gets no more work (Unix time; 0: never);
        a busy one: its ``ttl`` from now."""
        ttl, slot = self.ttl(model), self.loaded[model]
        if math.isinf(ttl):
            return 0.0
        since = slot.last_used if self._evictable(model) else self.clock()
        return time.time() + since + ttl - self.clock()

    # ---- load and unload -------------------------------------------------------------

    def preload(self) -> dict[str, ModelInfo]:
        """Load the preloaded models at start-up; a failure raises (a start-up error)."""
        for spec in [s for s in self.specs.values() if s.preload]:
            self._load(spec.id, strict=True)
        return {m: s.info for m, s in self.loaded.items()}

    def load(self, model: str) -> EngineStep | None:
        """Make room and load ``model`` (on the generation thread): None when it loaded,
        else the failures of the requests that were submitted to it."""
        restoring = self._restoring(model)
        self.wanted.pop(model, None)
        last_used = self.restore.pop(model, None)
        failed = self._load(model, strict=False)
        if failed is None and restoring and last_used is not None:
            self.loaded[model].last_used = last_used  # idle as long as before its unload
        return failed

    def loading(self, model: str) -> None:
        """Record that ``model`` is about to load (published before the slow part); room
        is made now, unless its last load failed (then once this one has succeeded) or
        it comes back after a failed load (it fits as things are)."""
        if model not in self.failed and not self._restoring(model):
            self.evicted[model] = self._make_room(model)
        self.events.append(ModelEvent(model=model, state="loading"))

    def _restoring(self, model: str) -> bool:
        """``model`` loads to undo a failed load's unloading, not for a request."""
        return model in self.restore and model not in self.wanted

    def _load(self, model: str, *, strict: bool) -> EngineStep | None:
        spec, before = self.specs[model], self._active_bytes()
        started = self.clock()
        try:
            runner, info = spec.factory()
        except Exception as exc:
            if strict:
                raise
            return self._failed(model, exc)
        model = self._rename(spec, info)
        weights = max(runner.memory_stats()[0] - before, 0)
        info = self._share_budget(info)
        slot = _Loaded(self.make_core(runner, info, spec.max_batch), info, weights, self.clock())
        self.loaded[model], self.weights_seen[model] = slot, weights
        seconds = self.clock() - started
        log.info("model %s loaded in %.2fs (%.0f MiB of weights)", model, seconds, weights / 2**20)
        self.events.append(
            ModelEvent(model, "loaded", info, seconds=seconds, weights_bytes=weights)
        )
        for request in self.queued.pop(model, []):
            slot.core.submit(request)
        self.failed.discard(model)
        self.evicted.pop(model, None)
        self._fit_count(keep=model)
        self._fit_memory(keep=model)
        return None

    def _failed(self, model: str, exc: Exception) -> EngineStep:
        log.error("model %s failed to load", model, exc_info=exc)
        self.failed.add(model)
        self.free_memory()  # whatever the failed load had allocated
        for victim, last_used in self.evicted.pop(model, []):
            log.info("model %s failed to load: reloading %s, unloaded for it", model, victim)
            self.restore.setdefault(victim, last_used)
        message = f"model {model!r} could not be loaded: {type(exc).__name__}: {exc}"
        self.events.append(ModelEvent(model=model, state="failed", message=message))
        for rid in self.pins.pop(model, set()):
            self.owner.pop(rid, None)
        failed = []
        for request in self.queued.pop(model, []):
            self.owner.pop(request.request_id, None)
            failed.append(
                Failed(request_id=request.request_id, reason="model_load_failed", message=message)
            )
        return EngineStep(model=model, failed=tuple(failed))

    def unload(self, model: str, reason: str) -> None:
        started = self.clock()
        self.spill(model, wait=False)
        slot = self.loaded.pop(model)
        weights = slot.weights
        del slot  # the core and its runner hold the weights: drop them before freeing
        self.free_memory()
        seconds = self.clock() - started
        log.info("model %s unloaded (%s) in %.2fs", model, reason, seconds)
        self.events.append(
            ModelEvent(model, "unloaded", seconds=seconds, weights_bytes=weights, reason=reason)
        )

    def unload_idle(self, model: str) -> bool:
        """An operator's unload (``Unload``): ``model`` goes now if it is loaded and idle
        and no request pins it; False (nothing done) otherwise."""
        if model not in self.loaded or not self._evictable(model):
            return False
        self.unload(model, "operator")
        return True

    def release_buffers(self) -> None:
        for slot in self.loaded.values():
            slot.core.runner.release_buffers()

    def stats(self, models: list[str] | None = None) -> dict[str, EngineStats]:
        """The snapshots of ``models`` (of every loaded model when None) that are loaded."""
        names = self.loaded if models is None else [m for m in models if m in self.loaded]
        return {
            m: msgspec.structs.replace(self.loaded[m].core.stats(), expires_at=self.expires_at(m))
            for m in names
        }

    # ---- policy --------------------------------------------------------------------

    def _evictable(self, model: str) -> bool:
        return self.loaded[model].core.idle and not self.pins.get(model)

    def _room_for(self, model: str) -> bool:
        """Whether ``model`` fits now, or would once idle models are unloaded."""
        free = [m for m in self.loaded if self._evictable(m)]
        count = len(self.loaded) - len(free)
        cap = self.limits.max_loaded_bytes
        held = sum(s.weights for m, s in self.loaded.items() if m not in free)
        fits_bytes = not cap or not held or held + self.weights_seen.get(model, 0) <= cap
        return count < self.limits.max_loaded and fits_bytes

    def _fits_now(self, model: str) -> bool:
        """Whether ``model`` fits with no model unloaded."""
        cap = self.limits.max_loaded_bytes
        held = sum(s.weights for s in self.loaded.values())
        fits_bytes = not cap or not held or held + self.weights_seen.get(model, 0) <= cap
        return len(self.loaded) < self.limits.max_loaded and fits_bytes

    def _make_room(self, model: str) -> list[tuple[str, float]]:
        """Unload the least recently used idle models until ``model`` fits; those unloaded,
        with their last use."""
        cap = self.limits.max_loaded_bytes
        need = self.weights_seen.get(model, 0)
        unloaded: list[tuple[str, float]] = []
        for victim in [m for m in self.loaded if self._evictable(m)]:  # LRU first
            held = sum(s.weights for s in self.loaded.values())
            if len(self.loaded) < self.limits.max_loaded and (not cap or held + need <= cap):
                break
            unloaded.append((victim, self.loaded[victim].last_used))
            self.unload(victim, "lru" if len(self.loaded) >= self.limits.max_loaded else "memory")
        return unloaded

    def _fit_count(self, keep: str) -> None:
        """After a load that made no room first (a retry): unload idle others past the count."""
        for victim in [m for m in self.loaded if m != keep and self._evictable(m)]:
            if len(self.loaded) <= self.limits.max_loaded:
                return
            self.unload(victim, "lru")

    def _fit_memory(self, keep: str) -> None:
        """After a load measured its weights: unload idle others while over the cap."""
        cap = self.limits.max_loaded_bytes
        for victim in [m for m in self.loaded if m != keep and self._evictable(m)]:
            if not cap or sum(s.weights for s in self.loaded.values()) <= cap:
                return
            self.unload(victim, "memory")

    def _share_budget(self, info: ModelInfo) -> ModelInfo:
        """The KV budget is split evenly among the models that may be loaded at once."""
        share = min(self.limits.max_loaded, len(self.specs))
        if info.memory is None or share <= 1:
            return info
        memory = dataclasses.replace(info.memory, budget_bytes=info.memory.budget_bytes // share)
        return dataclasses.replace(info, memory=memory)

    def _rename(self, spec: ModelSpec, info: ModelInfo) -> str:
        """A preloaded model with no id takes the loaded model's own name."""
        if spec.id:
            return spec.id
        renamed = dataclasses.replace(spec, id=info.model_id)
        del self.specs[spec.id]
        self.specs[renamed.id] = renamed
        return renamed.id

    def _active_bytes(self) -> int:
        """Device memory in use now (any loaded runner reports the process's)."""
        for slot in self.loaded.values():
            return slot.core.runner.memory_stats()[0]
        return 0

    def _touch(self, model: str) -> None:
        self.loaded[model].last_used = self.clock()
        self.loaded.move_to_end(model)

    def _unpin(self, request_id: str, model: str | None = None) -> None:
        model = model or self.owner.get(request_id)
        if model is not None and model in self.pins:
            self.pins[model].discard(request_id)


def _ended(step: EngineStep) -> list[str]:
    done = [t.request_id for t in step.tokens if t.finish_reason is not None]
    return done + [f.request_id for f in step.failed] + [e.request_id for e in step.embedded]
