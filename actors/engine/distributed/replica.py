"""One model over the ranks of an ``mx.distributed`` group: rank 0 leads, the others replay.

Rank 0 runs the whole daemon. Its generation thread drives a ``Leader``: a proxy
around its runner that, before every runner call that touches MLX or runner state,
broadcasts the call (method name and msgpack-encoded arguments) to the other ranks,
then makes it on its own runner. Every other rank runs ``follow``: the same model
loaded and sharded the same way, receiving those calls on its one thread and making
them on its own runner, in the same order. So every rank runs the same MLX operations
(the tensor-parallel all_sums, the pipeline's sends and receives) and samples the same
tokens (one seed shared at start-up, the same draws in the same order); only rank 0's
results are used. The proxy forwards any method by name, so runner methods added
later replicate without a change here; the read-only ones stay local (``_LOCAL``).

Rank 0's engine core makes every scheduling decision (admission, the memory gate,
aborts, deadlines); they reach the followers as the calls they lead to. The prefix
cache is kept in lockstep: its lookups are deterministic given the same entries, and
rank 0's evictions (which depend on its own byte counts and budget) travel with the
next call as the keys it dropped; a follower's cache never evicts on its own.

The broadcast is an ``all_sum`` over the runner's own stream (so it is ordered with
the collectives of an in-flight decode step) of a fixed-size head carrying the length
and most calls whole; a long call (a long prompt) takes a second one for the rest.
Followers contribute zeros. Each call also carries a digest of rank 0's last decoded
tokens: a follower that decoded anything else stops (``Desync``) rather than go on
out of step.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import logging
import os
import sys
import typing
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import msgspec
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from mlxd.actors.engine.distributed.watch import Watch, park
from mlxd.actors.engine.runner.caches import can_trim
from mlxd.actors.engine.runner.prefix_cache import PrefixCache
from mlxd.actors.engine.scheduler.types import InvalidRequest
from mlxd.protocol.messages import TokenizedRequest

log = logging.getLogger("mlxd.distributed")

_HEAD = 4096  # bytes of the first all_sum of a call: its length, then most calls whole
_LEN = 4  # bytes of the length at the head's start (little-endian)
# Runner methods and properties that only read local state: never replicated.
_LOCAL = frozenset({"memory_stats", "counters", "skipped_tokens", "probe_layers"})
_COLLECTIVE_ERRORS = ("[ring]", "[jaccl]", "[mpi]", "[nccl]", "[distributed]")


class Call(msgspec.Struct, tag=True, array_like=True):
    """A runner call rank 0 is about to make; ``dropped``: prefix-cache keys it evicted
    during its previous call (a follower drops them before making this one); ``tokens``:
    a digest of the tokens its last decode produced (a follower's must be the same)."""

    method: str
    args: list[Any]
    kwargs: dict[str, Any]
    dropped: list[tuple[int, ...]] = []
    tokens: int = 0


class Desync(RuntimeError):
    """A follower decoded other tokens than rank 0: the ranks no longer run in step."""


def tokens_digest(result: Any) -> int | None:
    """A digest of a decode's (request, token) pairs; None for results that are not that."""
    if not isinstance(result, list) or not all(hasattr(d, "token") for d in result):
        return None
    pairs = ";".join(f"{getattr(d, 'request_id', '')}:{d.token}" for d in result)
    return zlib.crc32(pairs.encode())


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Call)


# ---- the broadcast ------------------------------------------------------------------


class Channel:
    """Rank 0 → every rank, over ``all_sum`` on one stream (rank 0 sends, others receive)."""

    def __init__(self, group: Any, stream: Any):
        self._group, self._stream = group, stream

    def _sum(self, x: mx.array) -> np.ndarray:
        out = mx.distributed.all_sum(x, group=self._group, stream=self._stream)
        mx.eval(out)
        return np.asarray(out)

    def send(self, payload: bytes) -> None:
        head = np.zeros(_HEAD, np.uint8)
        head[:_LEN] = np.frombuffer(len(payload).to_bytes(_LEN, "little"), np.uint8)
        inline = payload[: _HEAD - _LEN]
        head[_LEN : _LEN + len(inline)] = np.frombuffer(inline, np.uint8)
        self._sum(mx.array(head))
        if len(payload) > len(inline):
            self._sum(mx.array(np.frombuffer(payload[len(inline) :], np.uint8)))

    def receive(self) -> bytes:
        head = self._sum(mx.zeros(_HEAD, mx.uint8))
        size = int.from_bytes(head[:_LEN].tobytes(), "little")
        inline = head[_LEN : _LEN + min(size, _HEAD - _LEN)].tobytes()
        rest = size - len(inline)
        return inline + (self._sum(mx.zeros(rest, mx.uint8)).tobytes() if rest else b"")


def _collective_failed(exc: BaseException) -> bool:
    return isinstance(exc, RuntimeError) and str(exc).startswith(_COLLECTIVE_ERRORS)


def runner_stream(runner: Any) -> Any:
    """The stream the runner evaluates on: the broadcast shares it, so its collectives
    stay ordered with those of a decode step still in flight (BatchGenerator evaluates
    the next step asynchronously)."""
    return getattr(runner, "_stream", None) or mx.default_stream(mx.default_device())


# ---- rank 0 ----------------------------------------------------------------------------


@dataclass
class GroupPrefixCache(PrefixCache):
    """A prefix cache whose decisions are the same on every rank. ``trimmable_ok``: every
    rank's layers are plain KV caches (agreed at start-up): else no snapshot is taken as
    trimmable anywhere, since a pipeline stage's own layers (SSM state, a sliding window)
    would make it trimmable on one rank and not on another, and their lookups differ."""

    trimmable_ok: bool = False

    def insert(self, tokens: Sequence[int], snapshot: Any, nbytes: int, trimmable: bool) -> None:
        super().insert(tokens, snapshot, nbytes, trimmable and self.trimmable_ok)


@dataclass
class LeaderPrefixCache(GroupPrefixCache):
    """Rank 0's prefix cache: records every key it drops (evicted, replaced, cleared, or
    refused as too large) for the followers' caches to drop too."""

    dropped: list[tuple[int, ...]] = field(default_factory=list)

    def _drop(self, key: tuple[int, ...]) -> None:
        super()._drop(key)
        self.dropped.append(key)

    def insert(self, tokens: Sequence[int], snapshot: Any, nbytes: int, trimmable: bool) -> None:
        super().insert(tokens, snapshot, nbytes, trimmable)
        if tokens and tuple(tokens) not in self:
            self.dropped.append(tuple(tokens))  # refused: larger than the whole budget

    def take_dropped(self) -> list[tuple[int, ...]]:
        out, self.dropped = self.dropped, []
        return out


def _refusal(request: TokenizedRequest) -> InvalidRequest | None:
    """Why the other ranks cannot replay this request (its grammar matcher and its images
    do not travel), or None."""
    if request.grammar is not None:
        return InvalidRequest(
            "constrained output (response_format, forced tool calls) is not served "
            "over several ranks yet",
            param="response_format",
        )
    if request.vision is not None:
        return InvalidRequest("images are not served over several ranks", param="messages")
    return None


@dataclass(frozen=True)
class Timeouts:
    """How long a broadcast or a runner call may take before the group counts as broken:
    ``prefill_s`` for a prefill (a chunk of a prompt), ``step_s`` for anything else (a
    broadcast waits at most for one decode step in flight)."""

    step_s: float = 10.0
    prefill_s: float = 60.0

    def of(self, method: str) -> float:
        return self.prefill_s if "prefill" in method else self.step_s


class Leader:
    """Rank 0's runner: each call that is not read-only goes to the other ranks first.

    A failed collective (a rank died) or a call running past the watch's timeout
    ends serving: the proxy marks the watch lost and parks this thread, and the
    monitor (``distributed.monitor``) fails the open requests and exits."""

    def __init__(
        self,
        runner: Any,
        channel: Channel,
        watch: Watch,
        timeouts: Timeouts | None = None,
        on_lost: Callable[[], None] = park,
    ):
        self._runner, self._channel, self._watch = runner, channel, watch
        self._timeouts = timeouts or Timeouts()
        self._on_lost = on_lost
        self._tokens = 0  # ``tokens_digest`` of the last decode
        cache = getattr(runner, "prefix_cache", None)
        self._cache = cache if isinstance(cache, LeaderPrefixCache) else None

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._runner, name)
        if name.startswith("_") or name in _LOCAL or not callable(value):
            return value
        return functools.partial(self._call, name)

    def wait_for(self, request: TokenizedRequest) -> str | None:
        if _refusal(request) is not None:
            return None  # ``start`` refuses it: nothing to wait for
        return self._call("wait_for", request)

    def start(self, request: TokenizedRequest) -> int:
        refusal = _refusal(request)
        if refusal is not None:
            raise refusal
        return self._call("start", request)

    def _call(self, name: str, *args: Any, **kwargs: Any) -> Any:
        dropped = self._cache.take_dropped() if self._cache is not None else []
        payload = _encoder.encode(Call(name, list(args), kwargs, dropped, self._tokens))
        watch, timeouts = self._watch, self._timeouts
        try:
            watch.expect(timeouts.step_s, f"the broadcast of {name}() to the other ranks")
            try:
                self._channel.send(payload)
            except RuntimeError as exc:  # the broadcast is a collective and nothing else
                self._lost(exc)
            watch.expect(timeouts.of(name), f"the engine call {name}()")
            try:
                result = getattr(self._runner, name)(*args, **kwargs)
            except RuntimeError as exc:
                if _collective_failed(exc):
                    self._lost(exc)
                raise
        finally:
            watch.done()
        self._tokens = tokens_digest(result) or self._tokens
        return result

    def _lost(self, exc: BaseException) -> None:
        self._watch.lose(f"a rank of the group is gone ({exc})")
        self._on_lost()


# ---- the other ranks ----------------------------------------------------------------


@dataclass
class FollowerPrefixCache(GroupPrefixCache):
    """A follower's prefix cache: never evicts on its own; drops what rank 0 dropped."""

    def evict(self, nbytes: int) -> int:
        return 0  # rank 0's evictions arrive as ``Call.dropped``

    def _drop_trimmable_prefixes_of(self, key: tuple[int, ...]) -> None:
        pass  # rank 0 may have refused ``key`` and kept its prefixes: its drops decide

    def drop(self, keys: list[tuple[int, ...]]) -> None:
        for key in keys:
            if key in self:
                self._drop(key)


class _Arguments:
    """Turns a call's msgpack arguments back into the types the runner's method declares."""

    def __init__(self, runner: Any):
        self._kind = type(runner)
        self._known: dict[str, tuple[list[Any], dict[str, Any]]] = {}

    def _types(self, method: str) -> tuple[list[Any], dict[str, Any]]:
        if method not in self._known:
            function = getattr(self._kind, method)
            hints = typing.get_type_hints(function)
            names = [p for p in inspect.signature(function).parameters if p != "self"]
            types = [hints.get(n, Any) for n in names]
            self._known[method] = types, dict(zip(names, types, strict=True))
        return self._known[method]

    def convert(self, call: Call) -> tuple[list[Any], dict[str, Any]]:
        positional, named = self._types(call.method)
        args = [msgspec.convert(a, t) for a, t in zip(call.args, positional, strict=False)]
        kwargs = {k: msgspec.convert(v, named.get(k, Any)) for k, v in call.kwargs.items()}
        return args, kwargs


def follow(runner: Any, channel: Channel) -> None:
    """Make rank 0's runner calls on this rank's runner until the group breaks (raises;
    ``Desync`` when this rank decoded other tokens than rank 0)."""
    cache = getattr(runner, "prefix_cache", None)
    arguments = _Arguments(runner)
    tokens = 0
    while True:
        call = _decoder.decode(channel.receive())
        if call.tokens != tokens:
            raise Desync(f"decoded other tokens than rank 0 before its {call.method}()")
        if isinstance(cache, FollowerPrefixCache):
            cache.drop(call.dropped)
        args, kwargs = arguments.convert(call)
        try:
            result = getattr(runner, call.method)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - rank 0 met the same error and handled it
            if _collective_failed(exc):
                raise
            log.debug("%s failed here as on rank 0: %r", call.method, exc)
            continue
        tokens = tokens_digest(result) or tokens


# ---- start-up: the same model, the same settings, sharded the same way ---------------

MODES = ("tensor", "pipeline", "auto")


def _heads(config: dict[str, Any]) -> dict[str, int]:
    """Every head count of the config (top level and ``text_config``)."""
    found = {k: v for k, v in config.items() if "heads" in k and isinstance(v, int)}
    found.update(
        _heads(config["text_config"]) if isinstance(config.get("text_config"), dict) else {}
    )
    return found


def choose_mode(parallel: str, model: nn.Module, config: dict[str, Any], size: int) -> str:
    """``tensor`` or ``pipeline`` for this model and group size; ValueError if neither can.

    ``auto``: tensor parallel when the model has ``shard()`` and every head count divides
    by the group size, else pipeline parallel (``model.model.pipeline``)."""
    name = config.get("model_type", type(model).__module__)
    uneven = {k: v for k, v in _heads(config).items() if v % size}
    tensor = hasattr(model, "shard") and not uneven
    pipeline = hasattr(getattr(model, "model", None), "pipeline")
    if parallel == "tensor" and not tensor:
        why = f"heads {uneven} do not divide by {size} ranks" if uneven else "it has no shard()"
        raise ValueError(f"model type {name} cannot be served tensor parallel: {why}")
    if parallel == "pipeline" and not pipeline:
        raise ValueError(f"model type {name} cannot be served pipeline parallel (no pipeline())")
    if parallel == "auto" and not (tensor or pipeline):
        raise ValueError(
            f"model type {name} supports neither tensor parallel (shard(), heads dividing by "
            f"{size}) nor pipeline parallel (model.pipeline()) over {size} ranks"
        )
    return "tensor" if parallel == "tensor" or (parallel == "auto" and tensor) else "pipeline"


def sharder(parallel: str, group: Any) -> Callable[[nn.Module, dict], None]:
    """The ``shard`` hook of ``loading.load_runner``: this rank's part of the model."""

    def shard(model: nn.Module, config: dict[str, Any]) -> None:
        mode = choose_mode(parallel, model, config, group.size())
        if mode == "tensor":
            model.shard(group)
        else:
            model.model.pipeline(group)  # type: ignore[union-attr, operator]
        log.info("rank %d of %d: %s parallel", group.rank(), group.size(), mode)

    return shard


def model_fingerprint(model_dir: Path) -> bytes:
    """The model's config, generation and tokenizer settings, and its weight files' sizes."""
    parts = []
    for name in ("config.json", "generation_config.json", "tokenizer_config.json"):
        path = model_dir / name
        parts.append(path.read_bytes() if path.exists() else b"")
    weights = sorted((p.name, p.stat().st_size) for p in model_dir.glob("*.safetensors"))
    return b"\0".join(parts) + json.dumps(weights).encode()


def check_same(group: Any, parts: dict[str, bytes]) -> None:
    """Every rank must hold the same model and settings: compare digests, or ValueError."""
    size, rank = group.size(), group.rank()
    for what, blob in parts.items():
        mine = np.frombuffer(hashlib.sha256(blob).digest(), np.uint8)
        table = np.zeros((size, mine.size), np.uint8)
        table[rank] = mine
        total = mx.distributed.all_sum(mx.array(table), group=group, stream=mx.cpu)
        rows = np.array(total)
        differ = [r for r in range(size) if not np.array_equal(rows[r], rows[0])]
        if differ:
            ranks = ", ".join(map(str, differ))
            raise ValueError(f"rank(s) {ranks} do not hold the same {what} as rank 0")


def shared_seed(group: Any) -> int:
    """Seed MLX's global random state with rank 0's draw, on every rank alike."""
    draw = int.from_bytes(os.urandom(3), "little") if group.rank() == 0 else 0
    seed = int(mx.distributed.all_sum(mx.array(draw), group=group, stream=mx.cpu).item())
    mx.random.seed(seed)
    return seed


def lockstep_cache(runner: Any, group: Any, *, leader: bool) -> None:
    """Swap the runner's (still empty) prefix cache for the leader's or a follower's kind,
    with ``trimmable_ok`` agreed by every rank (a collective: every rank calls this)."""
    cache = getattr(runner, "prefix_cache", None)
    layers = make_prompt_cache(runner.model)
    plain = can_trim(layers) and not any(hasattr(c, "max_size") for c in layers)
    agreed = mx.distributed.all_sum(mx.array(int(plain)), group=group, stream=mx.cpu)
    trimmable_ok = int(agreed.item()) == group.size()
    if cache is None:
        return
    kind, budget = (
        (LeaderPrefixCache, cache.max_bytes) if leader else (FollowerPrefixCache, sys.maxsize)
    )
    runner.prefix_cache = kind(
        block_size=cache.block_size,
        max_bytes=budget,
        affinity_keys=cache.affinity_keys,
        trimmable_ok=trimmable_ok,
    )
