"""The disk tier's MLX side: snapshots to buffers and back, and reads a request waits for.

Any cache layer is stored generically, the way mlx-lm's ``save_prompt_cache`` describes
one: its class, its ``state`` (a tree of arrays, numbers, strings and None) and its
``meta_state`` where the class has one; a layer comes back through the class's
``from_state``. So KVCache, RotatingKVCache, ArraysCache (SSM / GatedDeltaNet state),
CacheList, QuantizedKVCache and mlxd's own cache classes all round-trip at exactly the
length the RAM tier held them. Only array conversion happens here, on the engine
thread; the files are ``disk_tier``'s, on its I/O thread.

Append-only attention KV (``_APPEND_ONLY`` layers holding a row per token) is marked so
the store keeps it in shared token blocks (``disk_blocks``). Everything else is stored
whole with its snapshot: SSM state, rotating (sliding-window) buffers, whose rows are not
in token order once they wrap, and ``CacheList`` layers (a sliding-window model's mixed
layers), whose children are not told apart here.

``DiskReads`` is the engine's side of a read: a request whose prompt the disk covers
further than RAM waits (not prefilling) while the file is read off the thread; the
snapshot is then made into arrays and put in the RAM tier, where the request's own
lookup finds it. A read that fails is a miss.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache
from mlxd.actors.engine.runner import caches
from mlxd.actors.engine.runner.disk_tier import DiskView, Encoded, Loaded, files_fingerprint
from mlxd.actors.engine.runner.prefix_cache import Entry, PrefixCache

log = logging.getLogger("mlxd.disk_cache")

# Cache classes are looked up only in these packages.
_MODULES = ("mlx_lm.", "mlx_vlm.", "mlxd.")
_IDLE_WAIT_S = 0.01  # nothing else to run: block this long on a read, not spin
# Layers whose arrays have one row per token along axis 2, from the first token, and only
# ever grow (exact types: a subclass such as ChunkedKVCache may drop its first rows).
# mlxd's QuantizedRowCache (``kv_quant``) by name: importing kv_quant brings in mlx-vlm,
# which only models with ``engine.kv_bits`` set load (test_the_loader_imports_no_...).
_APPEND_ONLY = (KVCache, QuantizedKVCache)
_APPEND_ONLY_NAMES = frozenset({"mlxd.actors.engine.runner.kv_quant:QuantizedRowCache"})
_TOKEN_AXIS = 2


class Unserializable(ValueError):
    """A cache layer holding something the format cannot store."""


def encode(snapshot: list[Any], n_tokens: int = 0) -> Encoded:
    """A snapshot's layer tree and zero-copy views of its arrays (evaluated already).
    ``n_tokens``: the tokens it holds (0: unknown, nothing is marked as blockable KV)."""
    buffers: list[Any] = []
    offset = [0]

    def tree(x: Any, kv: bool = False) -> Any:
        if isinstance(x, mx.array):
            node = {"a": str(x.dtype).rsplit(".", 1)[-1], "s": list(x.shape), "o": offset[0]}
            node["n"] = 0
            if kv and x.ndim == 4 and x.shape[_TOKEN_AXIS] >= n_tokens:
                node["b"] = _TOKEN_AXIS
            if x.size:
                view = memoryview(mx.contiguous(x.reshape(-1))).cast("B")
                node["n"] = view.nbytes
                buffers.append(view)
                offset[0] += view.nbytes
            return node
        if isinstance(x, (list, tuple)):
            return {"l" if isinstance(x, list) else "t": [tree(v, kv) for v in x]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"v": x}
        raise Unserializable(f"cannot store a {type(x).__name__} in a cache state")

    layers = []
    for layer in snapshot:
        cls = type(layer)
        name = f"{cls.__module__}:{cls.__qualname__}"
        append_only = cls in _APPEND_ONLY or name in _APPEND_ONLY_NAMES
        kv = n_tokens > 0 and append_only and getattr(layer, "offset", -1) == n_tokens
        node = {"c": name, "state": tree(layer.state, kv)}
        if isinstance(getattr(cls, "meta_state", None), property):
            node["meta"] = tree(layer.meta_state)
        layers.append(node)
    return Encoded(layers, buffers, offset[0])


def decode(layers: list[Any], payload: memoryview) -> list[Any]:
    """The snapshot ``encode`` described, in arrays of its own (copied out of ``payload``)."""

    def tree(node: dict[str, Any]) -> Any:
        if "a" in node:
            start, n = int(node["o"]), int(node["n"])
            if start < 0 or start + n > len(payload):
                raise ValueError("an array lies outside the payload")
            raw = np.frombuffer(payload, dtype=np.uint8, count=n, offset=start)
            dtype = getattr(mx, node["a"])
            if not isinstance(dtype, mx.Dtype):
                raise ValueError(f"not a dtype: {node['a']}")
            return mx.array(raw).view(dtype).reshape(node["s"])
        if "l" in node:
            return [tree(v) for v in node["l"]]
        if "t" in node:
            return tuple(tree(v) for v in node["t"])
        return node["v"]

    out = []
    for layer in layers:
        cls = _cache_class(layer["c"])
        state = tree(layer["state"])
        obj = cls.from_state(state) if hasattr(cls, "from_state") else _bare(cls, state)
        if "meta" in layer:
            obj.meta_state = tree(layer["meta"])
        out.append(obj)
    mx.eval([c.state for c in out])
    return out


def _bare(cls: type, state: Any) -> Any:
    obj = cls.__new__(cls)
    obj.state = state
    return obj


def _cache_class(name: str) -> type:
    module, _, qualname = name.partition(":")
    if not module.startswith(_MODULES):
        raise ValueError(f"cache class from an unknown package: {name}")
    found: Any = importlib.import_module(module)
    for part in qualname.split("."):
        found = getattr(found, part)
    if not isinstance(found, type):
        raise ValueError(f"not a class: {name}")
    return found


def namespace_key(
    model_dir: Path, adapter: Path | None, cache: list[Any], extra: dict[str, Any]
) -> dict[str, Any]:
    """Everything that changes a snapshot's bytes: the model's files (tokenizer and
    template among them), the adapter's, the cache layout, and ``extra`` (the chat
    template override, ``kv_bits`` and ``kv_group_size``)."""
    return {
        "model": files_fingerprint(model_dir),
        "adapter": files_fingerprint(adapter),
        "layout": caches.layer_kinds(cache),
        **extra,
    }


class Spaces:
    """Which disk space a RAM snapshot belongs to. The RAM tier keys an adapter's
    snapshots by its namespace (one negative number before the tokens, ``MlxRunner``'s
    ``namespace``); on disk each adapter has a space of its own (its files' fingerprint
    in the space's key), where the snapshots are stored under their plain tokens."""

    def __init__(self, base: DiskView, for_adapter: Callable[[str, str], DiskView] | None):
        self.base, self._for_adapter = base, for_adapter
        self._views: dict[tuple[int, ...], DiskView] = {}

    def register(self, ns: tuple[int, ...], name: str, fingerprint: str) -> None:
        """An adapter's namespace gets its space (once; nothing without a factory)."""
        if ns and ns not in self._views and self._for_adapter is not None:
            self._views[ns] = self._for_adapter(name, fingerprint)

    @staticmethod
    def split(tokens: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(namespace, plain tokens) of a RAM key."""
        if tokens and tokens[0] < 0:
            return tokens[:1], tokens[1:]
        return (), tokens

    def view(self, ns: tuple[int, ...]) -> DiskView | None:
        return self.base if not ns else self._views.get(ns)


class DiskSpill:
    """The RAM tier's hooks: encode the snapshot (here), write it (I/O thread) now when
    RAM evicts it, within ``write_behind_s`` when RAM has just made it."""

    def __init__(self, spaces: Spaces):
        self.spaces = spaces
        self._refused: set[str] = set()

    def __call__(self, entry: Entry, behind: bool = False) -> None:
        ns, tokens = Spaces.split(entry.tokens)
        view = self.spaces.view(ns)
        if view is None or not tokens:
            return  # an adapter without a space of its own: RAM only
        try:
            enc = encode(entry.snapshot, len(tokens))
        except Unserializable as exc:
            if str(exc) not in self._refused:  # once per kind of layer
                self._refused.add(str(exc))
                log.warning("prefix cache on disk: a snapshot is not stored: %s", exc)
            return
        view.spill(tokens, entry.trimmable, enc, behind=behind)

    def behind(self, entry: Entry) -> None:
        self(entry, behind=True)


class DiskReads:
    """Reads in flight for requests waiting to start, and their landing in RAM."""

    def __init__(self, cache: PrefixCache, view: DiskView):
        self.cache, self.view = cache, view
        self.spaces: Spaces = cache.disk_spaces or Spaces(view, None)
        self._reads: dict[str, tuple[Future[Loaded | None], tuple[int, ...]]] = {}

    def waiting(self, request_id: str, prompt: tuple[int, ...], idle: bool) -> bool:
        """Whether the request must wait for the disk (a read is on). ``idle``: nothing
        else runs, so the engine thread may block on the read briefly instead of spinning."""
        ns, plain = Spaces.split(prompt)
        found = self._reads.get(request_id)
        if found is None:
            if not self.view.ready:  # the index is being rebuilt at start-up
                if idle:
                    self.view.when_ready(_IDLE_WAIT_S)
                return not self.view.ready
            read = self._start(ns, plain)
            if read is None:
                return False
            self._reads[request_id] = (read, ns)
        else:
            read = found[0]
        if not read.done() and idle:
            try:
                read.result(_IDLE_WAIT_S)
            except TimeoutError:
                pass
        if not read.done():
            return True
        del self._reads[request_id]
        self._land(read, ns)
        return False

    def _start(self, ns: tuple[int, ...], prompt: tuple[int, ...]) -> Future[Loaded | None] | None:
        view = self.spaces.view(ns)
        if view is None:
            return None
        limit = len(prompt) - 1
        found = view.best(prompt, limit)
        if found is None or found[1] + len(ns) <= self.cache.peek(ns + prompt, len(ns) + limit):
            return None
        entry, _ = found
        if ns + entry.tokens in self.cache:
            return None
        return view.read(entry)

    def _land(self, read: Future[Loaded | None], ns: tuple[int, ...] = ()) -> None:
        try:
            loaded = read.result()
        except OSError as exc:
            log.warning("prefix cache on disk: a read failed: %s", exc)
            return
        if loaded is None:
            return  # corrupt: the store removed and counted it
        try:
            snapshot = decode(loaded.layers, loaded.payload)
        except (ValueError, KeyError, TypeError, AttributeError, ImportError) as exc:
            log.warning("prefix cache on disk: %s cannot be loaded: %r", loaded.entry.path, exc)
            self.view.store.discard(loaded.entry)
            return
        tokens, trimmable = ns + loaded.entry.tokens, caches.can_trim(snapshot)
        self.cache.insert(tokens, snapshot, caches.nbytes(snapshot), trimmable, from_disk=True)

    def forget(self, request_id: str) -> None:
        self._reads.pop(request_id, None)


def attach(
    cache: PrefixCache, view: DiskView, for_adapter: Callable[[str, str], DiskView] | None = None
) -> None:
    """Give a RAM tier its disk tier: evictions spill there, new snapshots are written
    behind (``write_behind_s`` > 0), counters show it. ``for_adapter(name, fingerprint)``:
    the space of an adapter's snapshots (None: adapters' snapshots stay in RAM)."""
    cache.disk = view
    cache.disk_spaces = Spaces(view, for_adapter)
    spill = DiskSpill(cache.disk_spaces)
    cache.on_evict = spill
    if view.store.write_behind_s > 0:
        cache.on_insert = spill.behind
