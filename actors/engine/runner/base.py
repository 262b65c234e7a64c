"""The base runner: mlx-lm behind a small runner protocol, with the sampling it batches.

``MlxRunner`` prefills each request on its own prompt cache (so a failure is
that request's alone, and long prompts go a chunk per engine step), then hands
the cache to mlx-lm's ``BatchGenerator`` with ``insert(..., caches=...)``; every
``decode()`` is one ``BatchGenerator.next()``. Any per-layer mix of cache kinds
(attention, sliding window, SSM state, cache lists) works: ``caches`` checks at
start-up that every layer can be batched. All methods must be called on the
generation actor's thread: MLX streams are thread-local.

The variants (``spec_runner``, ``vlm_runner``, ``vlm_mtp``) subclass it; only
``loading``, the engine's composition root, picks one and loads the model.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import ctypes
import ctypes.util
import functools
import hashlib
import logging
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import ArraysCache, make_prompt_cache
from mlx_lm.sample_utils import greedy_sampler, make_logits_processors
from mlxd.actors.engine import backend_policy
from mlxd.actors.engine.adapters.bank import AdapterBank
from mlxd.actors.engine.adapters.files import AdapterError
from mlxd.actors.engine.adapters.multi_lora import RowAdapters
from mlxd.actors.engine.kernels.openblas import OpenBlas
from mlxd.actors.engine.runner import caches
from mlxd.actors.engine.runner.caches import RowSlots, check_batchable, layer_kinds
from mlxd.actors.engine.runner.disk_codec import DiskReads
from mlxd.actors.engine.runner.guards import RowGuard, bias_processor
from mlxd.actors.engine.runner.logits import GrammarProcessor, LazyCallProcessor, token_logprobs
from mlxd.actors.engine.runner.prefix_cache import PrefixCache
from mlxd.actors.engine.runner.sampling import scaled_logits
from mlxd.actors.engine.scheduler.memory import AttentionLayer, Layer, StateLayer
from mlxd.actors.engine.scheduler.types import Decoded, InvalidRequest
from mlxd.actors.engine.speculative.spec_prefill import SpecPrefill, positioned, set_position
from mlxd.actors.grammar import CompiledGrammar
from mlxd.actors.lazy_calls import LazyGrammar
from mlxd.protocol.messages import (
    RunnerCounters,
    SamplingParams,
    SpecPrefillCounters,
    SpeculativeCounters,
    TokenizedRequest,
)

log = logging.getLogger("mlxd.runner")
_T = TypeVar("_T")

# Penalties look back over the whole sequence, as the OpenAI API defines them.
_PENALTY_CONTEXT = 1 << 20


def make_sampler(params: SamplingParams, drawn: int = 0):
    """A per-request sampler; a seeded one draws from its own key, not the global RNG,
    split once per draw: ``drawn`` draws are skipped (a replay goes on where it stopped)."""
    if params.greedy:
        return greedy_sampler  # shared object: an all-greedy batch samples in one call
    key = [mx.random.key(params.seed)] if params.seed is not None else None
    if key is not None and drawn:
        for _ in range(drawn):
            key[0], _sub = mx.random.split(key[0])
        mx.eval(key[0])  # sync (a replay's join only): the skipped splits collapse to one key

    def sample(logprobs: mx.array) -> mx.array:
        scaled = scaled_logits(logprobs, params)  # the verifiers' chain too
        if key is None:
            return mx.random.categorical(scaled)
        key[0], sub = mx.random.split(key[0])
        return mx.random.categorical(scaled, key=sub)

    return sample


def make_processors(
    params: SamplingParams,
    grammar: object | None = None,
    resumed: int = 0,
    opener_on_device: bool = True,
) -> list:
    """A bounds-checked bias, penalties from mlx-lm; a grammar mask last, so nothing can undo it
    (``resumed``: a lazy call grammar replays the row's last tokens, its own;
    ``opener_on_device``: the backend table's ``opener_mask_on_device``)."""
    processors = [bias_processor(params.logit_bias)] if params.logit_bias else []
    processors += make_logits_processors(
        repetition_penalty=params.repetition_penalty if params.repetition_penalty != 1.0 else None,
        repetition_context_size=_PENALTY_CONTEXT,
        presence_penalty=params.presence_penalty or None,
        presence_context_size=_PENALTY_CONTEXT,
        frequency_penalty=params.frequency_penalty or None,
        frequency_context_size=_PENALTY_CONTEXT,
    )
    if isinstance(grammar, CompiledGrammar):
        processors.append(GrammarProcessor(grammar))
    elif isinstance(grammar, LazyGrammar):
        processors.append(LazyCallProcessor(grammar, resumed, opener_on_device))
    return processors


@dataclass
class Pending:
    """A request being prefilled on its own cache."""

    request: TokenizedRequest
    cache: list[Any] = field(default_factory=list)
    done: int = 0  # prompt tokens already in the cache
    inputs: Any = None  # runner-specific prepared inputs (a VLM's prompt embeddings)
    checkpoints: list[int] = field(default_factory=list)  # where to snapshot, ascending
    sparse: Any = None  # a SpecPrefill ``SparsePlan``: only its kept chunks are prefilled

    @property
    def remaining(self) -> int:
        if self.sparse is not None:
            return self.sparse.remaining
        return len(self.request.prompt_tokens) - 1 - self.done

    def next_stop(self, budget: int) -> int:
        """Tokens to prefill now: the budget, cut at the next checkpoint."""
        n = min(budget, self.remaining)
        ahead = [c - self.done for c in self.checkpoints if c > self.done]
        return min([n, *ahead])


# Requests prefilled in one pass attend over the longest cache among them (the shorter
# ones are left-padded in the batch cache): batch only caches within this many tokens,
# or this fraction of the longest, of each other.
_OFFSET_SLACK_TOKENS = 128
_OFFSET_SLACK_FRACTION = 0.25

# A prefill chunk is split across the prefill streams only into pieces of at least this
# many tokens: smaller pieces leave too little work per layer to run side by side.
_MIN_PIECE_TOKENS = 64


def pieces(n: int, streams: int) -> list[tuple[int, int]]:
    """``n`` tokens as up to ``streams`` consecutive (start, end) pieces of nearly equal
    length, none shorter than ``_MIN_PIECE_TOKENS`` (one piece when ``n`` is short)."""
    k = max(1, min(streams, n // _MIN_PIECE_TOKENS))
    bounds = [n * i // k for i in range(k + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


def _similar_offsets(rows: list[tuple[Pending, int]]) -> list[list[tuple[Pending, int]]]:
    """``rows`` grouped so that the caches in a group hold about as many tokens."""
    groups: list[list[tuple[Pending, int]]] = []
    for row in sorted(rows, key=lambda r: r[0].done):
        if groups:
            low, high = groups[-1][0][0].done, row[0].done
            if high - low <= max(_OFFSET_SLACK_TOKENS, _OFFSET_SLACK_FRACTION * high):
                groups[-1].append(row)
                continue
        groups.append([row])
    return groups


def common_prefix_length(a: tuple[int, ...], b: tuple[int, ...], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, up to ``limit`` (a binary search over
    slice comparisons, which run in C)."""
    lo, hi = 0, max(min(limit, len(a), len(b)), 0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


class MlxRunner:
    """Per-request chunked prefill, then continuous batched decode in mlx-lm."""

    # Live counters, updated on this thread: the speculative variants set ``spec_stats``,
    # and ``loading`` sets them where a configured feature is off (their notes say why).
    spec_stats: SpeculativeCounters | None = None
    spec_prefill_stats: SpecPrefillCounters | None = None
    # Set by ``loading`` where the backend table batches only short rows (the CPU;
    # ``engine.batch_prefill_max_context``): rows whose cache holds at most this many
    # tokens after the pass are still prefilled together. None: no such limit.
    batch_prefill_max_context: int | None = None

    def __init__(
        self,
        model: nn.Module,
        stop_tokens: list[int],
        max_batch: int,
        *,
        make_cache: Callable[[], list[Any]] | None = None,
        decode_model: Callable[..., mx.array] | None = None,
        prefix_cache: PrefixCache | None = None,
        spec_prefill: SpecPrefill | None = None,
        adapters: AdapterBank | None = None,
    ):
        self.model = model
        # LoRA adapters chosen per request (None: this runner serves the base only)
        self.adapters = adapters
        self._slots: dict[str, int] = {}  # request → its adapter slot (held until removed)
        self._ns: dict[str, tuple[int, ...]] = {}  # request → its prefix-cache namespace
        self._adapter_errors: dict[str, Exception] = {}  # an adapter that failed to load
        self.prefix_cache = prefix_cache
        # the disk tier's reads (None: no disk tier); see ``disk_codec``
        disk = prefix_cache.disk if prefix_cache is not None else None
        self._disk = DiskReads(prefix_cache, disk) if prefix_cache and disk else None
        self.spec_prefill = spec_prefill  # None: off
        if spec_prefill is not None:
            self.spec_prefill_stats = spec_prefill.stats
        self._sparse: set[str] = set()  # requests sparse-prefilled: never remembered
        self._keys: dict[str, str] = {}  # request → its cache key, for its snapshots
        self._remembered = 0  # bytes of the last snapshot ``_remember`` kept (``preempt``)
        self._make_cache = make_cache or (lambda: make_prompt_cache(model))
        cache = self._make_cache()
        check_batchable(cache, self._make_cache())
        log.info("per-layer caches: %s", layer_kinds(cache))
        self._decode_model = decode_model or model
        if adapters is not None:
            self._decode_model = AdapterStep(self._decode_model, adapters.rows)
        self._stop_tokens = [[t] for t in stop_tokens]
        self._max_batch = max_batch
        self._policy = backend_policy.for_backend(backend_policy.detect())
        self._stream = mx.new_stream(mx.default_device())
        self._prefill_streams = [self._stream]  # see ``use_prefill_streams``
        self._openblas = OpenBlas.loaded() if mx.default_device() == mx.cpu else None
        if self._openblas is not None:  # shared by every model: waits for this one's steps
            self._openblas.watch(self, self._stream)
        self.generator = self._new_generator()
        self._pending: dict[str, Pending] = {}
        self._uid_to_rid: dict[int, str] = {}
        self._rid_to_uid: dict[str, int] = {}
        self._joined: set[int] = set()  # rows inserted since the last decode (no token yet)
        self._top: dict[str, int] = {}  # requests that want logprobs → how many alternatives
        self._guard = RowGuard()
        # rows whose lazy call grammar reads the tokens each step reads back (no wait)
        self._readers: dict[str, LazyCallProcessor] = {}
        self._padding_ok: bool | None = None  # see ``padding_keeps_rows``

    def _new_generator(self) -> BatchGenerator:
        return BatchGenerator(
            self._decode_model,
            stop_tokens=self._stop_tokens,
            completion_batch_size=self._max_batch,
            prefill_batch_size=self._max_batch,
            stream=self._stream,
        )

    @property
    def decoding(self) -> int:
        return len(self._rid_to_uid)

    def counters(self) -> RunnerCounters:
        """Copies of the live counters, for the engine's published ``EngineStats``."""
        cache = self.prefix_cache.counters() if self.prefix_cache is not None else None
        return RunnerCounters(
            prefix_cache=cache,
            speculative=_copy(self.spec_stats),
            spec_prefill=_copy(self.spec_prefill_stats),
        )

    @property
    def prefilling_count(self) -> int:
        return len(self._pending)

    @property
    def cache_bytes(self) -> int:
        """Bytes of KV state held for requests: 0 when nothing runs."""
        pending = sum(c.nbytes for p in self._pending.values() for c in p.cache)
        return pending + self.generator.prompt_cache_nbytes

    def start(self, request: TokenizedRequest) -> int:
        """Set up the request's cache (from the prefix cache if it can); return tokens reused."""
        prompt = request.prompt_tokens
        rid = request.request_id
        error = self._adapter_errors.pop(rid, None)
        if error is not None:
            raise error
        if request.adapter is not None and rid not in self._slots:
            self._hold_adapter(request, waiting=False)
        if request.cache_key:
            self._keys[rid] = request.cache_key
        cache, done = self._cached(prompt, request.cache_key, self._ns.get(rid, ()))
        marks = sorted(c for c in request.checkpoints if done < c < len(prompt) - 1)
        pending = Pending(request, cache, done, checkpoints=marks)
        if self.spec_prefill is not None:
            pending.sparse = self.spec_prefill.plan(prompt, done, request.sampling.spec_prefill)
        if pending.sparse is not None:
            pending.cache, pending.checkpoints = positioned(cache), []
            self._sparse.add(request.request_id)
        self._pending[request.request_id] = pending
        return done

    def wait_for(self, request: TokenizedRequest) -> str | None:
        """A request being prefilled that shares at least one more prefix-cache block with
        this one than the cache holds: it gets a checkpoint at the shared block boundary
        (so it snapshots there), and its id is returned so this one waits and then starts
        from that snapshot. K agents sending the same system prompt at once compute it once.
        Exact boundaries, so hybrid (SSM) models share too. A request whose prompt the
        disk tier covers further than RAM waits ("disk") while its file is read."""
        if request.adapter is not None and request.request_id not in self._slots:
            try:
                if not self._hold_adapter(request, waiting=True):
                    return "adapter"  # every resident adapter is in use: wait for a row
            except Exception as exc:  # noqa: BLE001 - its own start fails with it
                self._adapter_errors[request.request_id] = exc
                return None
        ns = self._ns.get(request.request_id, ())
        idle = not self._pending and not self._rid_to_uid
        if self._disk and self._disk.waiting(request.request_id, ns + request.prompt_tokens, idle):
            return "disk"
        if self.prefix_cache is None or not self._pending:
            return None
        prompt = request.prompt_tokens
        block = self.prefix_cache.block_size
        have = max(self.prefix_cache.peek(ns + prompt, len(ns) + len(prompt) - 1) - len(ns), 0)
        for rid, pending in self._pending.items():
            if self._ns.get(rid, ()) != ns:
                continue  # another adapter's (or the base's) prefix is not this one's
            other = pending.request.prompt_tokens
            limit = min(len(prompt), len(other)) - 1
            boundary = common_prefix_length(prompt, other, limit) // block * block
            if pending.sparse is not None or boundary < have + block or pending.done >= boundary:
                continue
            if boundary not in pending.checkpoints:
                bisect.insort(pending.checkpoints, boundary)
            return rid
        return None

    def skipped_tokens(self, request_id: str) -> int:
        """Prompt tokens SpecPrefill will not prefill for this request (0: a full prefill)."""
        pending = self._pending.get(request_id)
        return pending.sparse.skipped if pending is not None and pending.sparse else 0

    def _cached(
        self, prompt: tuple[int, ...], key: str = "", ns: tuple[int, ...] = ()
    ) -> tuple[list[Any], int]:
        """The best snapshot for ``prompt`` in namespace ``ns`` (an adapter's; () the
        base's), copied and trimmed, and how many prompt tokens it covers."""
        pc = self.prefix_cache
        keyed = ns + prompt
        hit = pc.lookup(keyed, len(keyed) - 1, key) if pc is not None else None
        if hit is None or hit.length <= len(ns):
            return self._make_cache(), 0
        # New cache objects over the same (immutable) buffers: never share a snapshot.
        cache = copy.deepcopy(hit.entry.snapshot)
        caches.trim(cache, len(hit.entry.tokens) - hit.length)
        return cache, hit.length - len(ns)

    # ---- adapters ------------------------------------------------------------------

    def _hold_adapter(self, request: TokenizedRequest, *, waiting: bool) -> bool:
        """Take a slot of the request's adapter (loading it); False: no room now (only
        when ``waiting``; a start that cannot wait raises). Raises the adapter's error."""
        ref = request.adapter
        assert ref is not None
        if self.adapters is None:
            raise InvalidAdapter(
                f"model {request.model!r} serves no LoRA adapter per request on this runner"
            )
        try:
            slot = self.adapters.acquire(ref)
        except AdapterError as exc:
            raise InvalidAdapter(str(exc)) from None
        if slot is None:
            if waiting:
                return False
            raise InvalidAdapter(f"adapter {ref.name!r}: no room (every resident adapter in use)")
        self._slots[request.request_id] = slot
        identity = ref.fingerprint or ref.path
        ns = self._ns[request.request_id] = namespace(identity)
        spaces = self.prefix_cache.disk_spaces if self.prefix_cache is not None else None
        if spaces is not None:  # its snapshots' own space in the disk tier
            spaces.register(ns, ref.name, identity)
        return True

    def _drop_adapter(self, request_id: str) -> None:
        slot = self._slots.pop(request_id, None)
        self._ns.pop(request_id, None)
        self._adapter_errors.pop(request_id, None)
        if slot is not None and self.adapters is not None:
            self.adapters.release(slot)

    def unload_adapter(self, name: str) -> None:
        if self.adapters is not None:
            self.adapters.unload(name)

    def _rows(self, request_ids: list[str]) -> AbstractContextManager[None]:
        """The forward passes run inside serve these requests' rows, in this order."""
        if self.adapters is None:
            return contextlib.nullcontext()
        return self.adapters.rows.using([self._slots.get(r, 0) for r in request_ids])

    def _remember(
        self,
        tokens: list[int] | tuple[int, ...],
        cache: list[Any],
        *,
        live: bool = False,
        key: str = "",
    ) -> None:
        """Offer a snapshot to the prefix cache, in buffers of its own; it becomes the newest
        of the request's cache ``key``.

        ``live``: the cache is still in use, so the snapshot is taken from a copy.
        """
        if self.prefix_cache is None or not tokens:
            return
        if tokens not in self.prefix_cache:
            snapshot = caches.compact(copy.deepcopy(cache) if live else cache)
            # sync (a snapshot, not every step): its own buffers now, its size exact, and no
            # graph kept alive over the live cache it was copied from
            mx.eval([c.state for c in snapshot])
            self._remembered = caches.nbytes(snapshot)
            self.prefix_cache.insert(tokens, snapshot, self._remembered, caches.can_trim(snapshot))
        self.prefix_cache.claim(tokens, key)

    def prefill(self, request_id: str, budget: int) -> int:
        """Prefill up to ``budget`` prompt tokens; return how many are left (0: decoding)."""
        pending = self._pending[request_id]
        if pending.sparse is not None:
            with mx.stream(self._stream), self._rows([request_id]):
                self.spec_prefill.step(self.model, pending.cache, pending.sparse, budget)
                mx.eval([c.state for c in pending.cache])  # sync: as in the plain chunk below
            if pending.remaining == 0:
                self._join_batch(self._pending.pop(request_id))
            return pending.remaining
        n = pending.next_stop(budget)
        if n > 0:
            with self._blas_for(n), mx.stream(self._stream), self._rows([request_id]):
                self._prefill_chunk(pending, n)
                # sync: the chunk runs (and fails) here, as this request's own, not inside
                # the batched decode step that would otherwise evaluate it
                mx.eval([c.state for c in pending.cache])
        return self._prefilled(pending, n)

    def _blas_for(self, n: int) -> AbstractContextManager[None]:
        """While a chunk of ``n`` tokens runs split over k streams, OpenBLAS gets at most
        1/k of its threads (``openblas.py`` says why). The decode steps still in flight on
        every model's runner are waited for first: no matmul runs while the count changes."""
        k = len(pieces(n, len(self._prefill_streams)))
        if k < 2 or self._openblas is None:
            return contextlib.nullcontext()
        return self._openblas.at_most(max(1, self._openblas.threads // k))

    def _prefilled(self, pending: Pending, n: int) -> int:
        """Account ``n`` tokens just run: snapshot at a checkpoint, join the batch when done."""
        pending.done += n
        if n > 0 and pending.done in pending.checkpoints:
            prefix = pending.request.prompt_tokens[: pending.done]
            ns = self._ns.get(pending.request.request_id, ())
            self._remember(ns + prefix, pending.cache, live=True, key=pending.request.cache_key)
        if pending.remaining == 0:
            self._join_batch(self._pending.pop(pending.request.request_id))
        return pending.remaining

    @property
    def batch_prefill_pays(self) -> bool:
        """Whether the engine hands this runner several requests' chunks by default: where
        the backend table batches every row (a GPU), or only short rows and there is a
        limit (the CPU; ``backend_policy`` names the measurements)."""
        return self._policy.batch_prefill or bool(self.batch_prefill_max_context)

    @property
    def batches_prefill(self) -> bool:
        """Whether ``prefill_batch`` runs several requests' chunks in one forward pass. Off
        for variants that prefill their own way (a drafter's hidden states, a VLM's
        embeddings) and with SpecPrefill (its sparse chunks keep their own positions)."""
        return type(self)._prefill_chunk is MlxRunner._prefill_chunk and self.spec_prefill is None

    def prefill_batch(self, budgets: dict[str, int]) -> dict[str, int | Exception]:
        """Prefill several requests, up to each one's budget; requests whose caches hold
        about as many tokens are prefilled together, in forward passes over all their
        chunks at once (``_prefill_rows``). Returns each request's prompt tokens left (0:
        it joined the decode batch), or the exception its own prefill raised: a failed
        batched pass changes no request, and each of its requests is then prefilled
        alone, so only the one whose own prefill fails gets an exception."""
        rows = [(self._pending[rid], budget) for rid, budget in budgets.items()]
        out: dict[str, int | Exception] = {}
        running = [(p, p.next_stop(b)) for p, b in rows] if self.batches_prefill else []
        limit = self.batch_prefill_max_context
        short = [(p, n) for p, n in running if n > 0 and (limit is None or p.done + n <= limit)]
        for group in _similar_offsets(short):
            if len(group) < 2:
                continue
            try:
                with mx.stream(self._stream):
                    caches = self._prefill_rows(group)
            except Exception as exc:  # noqa: BLE001 - each request is retried alone below
                log.warning("batched prefill of %d requests failed: %r", len(group), exc)
                continue
            for (pending, n), cache in zip(group, caches, strict=True):
                pending.cache = cache
                out[pending.request.request_id] = self._prefilled(pending, n)
        for pending, budget in rows:
            rid = pending.request.request_id
            if rid not in out:
                try:
                    out[rid] = self.prefill(rid, budget)
                except Exception as exc:  # noqa: BLE001 - fails this request only
                    out[rid] = exc
        return out

    def _prefill_rows(self, rows: list[tuple[Pending, int]]) -> list[list[Any]]:
        """Run ``n`` more prompt tokens of each row, several rows per forward pass, and
        return each row's new cache (the requests' own caches are not touched).

        No padding: every row runs the shortest chunk together, then the rows with more
        run the next shortest, and so on. (Right padding would make mlx-lm roll every
        row's whole cache once per pass, which on the CPU backend costs more than the pass
        saves.) The caches are merged into a batch cache with the cache classes' ``merge``
        and taken apart again with ``extract``. Short rows (``batch_prefill_max_context``)
        go in one padded pass instead (``_prefill_padded``)."""
        if self.batch_prefill_max_context is not None and self.padding_keeps_rows():
            return self._prefill_padded(rows)
        caches = [p.cache for p, _ in rows]
        done = [p.done for p, _ in rows]
        left = [n for _, n in rows]
        while live := [i for i, n in enumerate(left) if n > 0]:
            m = min(left[i] for i in live)
            chunks = [rows[i][0].request.prompt_tokens[done[i] : done[i] + m] for i in live]
            if len(live) == 1 and caches[live[0]] is not rows[live[0]][0].cache:
                batch = caches[live[0]]  # a copy already: run it as it is
            else:
                batch = [
                    layer.merge([caches[i][j] for i in live])
                    for j, layer in enumerate(caches[live[0]])
                ]
            with self._rows([rows[i][0].request.request_id for i in live]):
                self.model(mx.array(chunks), cache=batch)
            mx.eval(
                [c.state for c in batch]
            )  # sync: a failed pass raises here (rows retried alone)
            if batch is not caches[live[0]]:
                for k, i in enumerate(live):
                    caches[i] = [c.extract(k) for c in batch]
            for i in live:
                done[i] += m
                left[i] -= m
        return caches

    def padding_keeps_rows(self) -> bool:
        """Whether a right-padded pass leaves each row's recurrent state (``ArraysCache``
        layers) as the row alone would: mlx-lm's ``prepare`` masks the padding only where
        the model's layer code reads the mask, and a layer that stores its last inputs
        regardless (Baichuan-M1's key/value convolution) keeps the padding's instead.
        Checked once, on the model itself (two short rows, padded against alone); where it
        fails, short rows share passes without padding (``_prefill_rows``'s equal
        chunks). Attention-only models need no check: ``finalize`` rolls the padding off."""
        if self._padding_ok is None:
            self._padding_ok = self._check_padding()
            if not self._padding_ok:
                log.info("batched prefill without padding: this model's state keeps the padding")
        return self._padding_ok

    def _check_padding(self) -> bool:
        def states(cache: list[Any]) -> list[mx.array]:
            leaves = [c for c in _leaf_caches(cache) if isinstance(c, ArraysCache)]
            return [a for c in leaves for a in c.cache if a is not None]

        if not any(isinstance(c, ArraysCache) for c in _leaf_caches(self._make_cache())):
            return True
        prompts = [tuple(range(1, 6)), tuple(range(6, 9))]
        rows = [(Pending(_probe_request(p), self._make_cache()), len(p)) for p in prompts]
        with mx.stream(self._stream):
            together = self._prefill_padded(rows)
            alone = [self._prefill_padded([row]) for row in rows]
            for a, b in zip(alone, together, strict=True):
                for x, y in zip(states(a[0]), states(b), strict=True):
                    if not mx.allclose(x, y, rtol=1e-3, atol=1e-3).item():  # sync (once, at load)
                        return False
        return True

    def _prefill_padded(self, rows: list[tuple[Pending, int]]) -> list[list[Any]]:
        """Short rows in one forward pass, each chunk right-padded to the longest, as
        mlx-lm's own batched prompt processing runs them: ``prepare`` masks the padding
        (recurrent layers) and ``finalize`` rolls it to the left of each row, where
        ``extract`` drops it. The roll copies every row's cache, which costs little at a
        short context, and saves a pass per distinct chunk length (eight chat prompts of
        57-62 tokens took up to six passes)."""
        lengths = [n for _, n in rows]
        padding = [max(lengths) - n for n in lengths]
        tokens = [
            [*p.request.prompt_tokens[p.done : p.done + n], *[0] * pad]
            for (p, n), pad in zip(rows, padding, strict=True)
        ]
        first = rows[0][0].cache
        batch = [layer.merge([p.cache[j] for p, _ in rows]) for j, layer in enumerate(first)]
        if any(padding):
            for c in batch:
                c.prepare(lengths=lengths, right_padding=padding)
        with self._rows([p.request.request_id for p, _ in rows]):
            self.model(mx.array(tokens), cache=batch)
        if any(padding):
            for c in batch:
                c.finalize()
        mx.eval([c.state for c in batch])  # sync: as in ``_prefill_rows``
        return [[c.extract(k) for c in batch] for k in range(len(rows))]

    def use_prefill_streams(self, n: int) -> None:
        """Run each prefill chunk as ``n`` consecutive pieces, each on its own MLX stream.

        The pieces share one cache and are evaluated together, so MLX runs them side by
        side: piece 2's layer L needs only piece 1's keys and values of layer L (written
        before piece 1's attention), and a recurrent layer's state passes piece to piece
        as the layers go, like a pipeline. On the CPU backend every op but the BLAS runs
        on its stream's one thread, and attention's softmax dominates prefill at agent
        context lengths, so two pieces keep two cores busy (``scripts/bench_step.py``).
        The result is the same as prefilling the pieces one after the other."""
        self._prefill_streams = [
            self._stream,
            *(mx.new_stream(mx.default_device()) for _ in range(n - 1)),
        ]

    @property
    def prefill_streams(self) -> int:
        return len(self._prefill_streams)

    def _prefill_chunk(self, pending: Pending, n: int) -> None:
        chunk = mx.array(pending.request.prompt_tokens[pending.done : pending.done + n])[None]
        parts = pieces(n, len(self._prefill_streams))
        for stream, (a, b) in zip(self._prefill_streams, parts, strict=False):
            with mx.stream(stream):
                self.model(chunk[:, a:b], cache=pending.cache)

    def _batch_cache(self, pending: Pending) -> list[Any]:
        """The cache list that joins the batch (a VLM appends per-sequence state; with
        adapters, the row's slot rides at the end: ``AdapterStep`` reads it)."""
        if self.adapters is not None:
            return [*pending.cache, RowSlots([self._slots.get(pending.request.request_id, 0)])]
        return pending.cache

    def _joining(self, pending: Pending) -> list[Any]:
        """The prefilled cache, remembered if it is a full prefill; with SpecPrefill on, its
        attention layers positioned (so every cache merged into a batch carries positions)."""
        prompt = pending.request.prompt_tokens
        if pending.sparse is None:
            ns = self._ns.get(pending.request.request_id, ())
            self._remember(
                ns + prompt[:-1], pending.cache, live=True, key=pending.request.cache_key
            )
        if self.spec_prefill is None:
            return pending.cache
        cache = positioned(pending.cache)
        set_position(cache, len(prompt) - 1)
        return cache

    def _join_batch(self, pending: Pending) -> None:
        request = pending.request
        params = request.sampling
        pending.cache = self._joining(pending)
        (uid,) = self.generator.insert(
            [[request.prompt_tokens[-1]]],
            max_tokens=[params.max_tokens],
            caches=[self._batch_cache(pending)],
            all_tokens=[list(request.prompt_tokens[:-1])],
            samplers=[self._guarded_sampler(request)],
            logits_processors=[self._guarded_processors(request)],
        )
        self._uid_to_rid[uid] = request.request_id
        self._rid_to_uid[request.request_id] = uid
        self._joined.add(uid)
        if params.logprobs:
            self._top[request.request_id] = params.top_logprobs

    def _guarded_sampler(self, request: TokenizedRequest):
        """The request's sampler; one that can fail is guarded (greedy stays the shared object,
        so an all-greedy batch still samples in one call)."""
        # a resumed row's key skips one draw per token it emitted before
        sample = make_sampler(request.sampling, request.resumed)
        if sample is greedy_sampler:
            return sample
        return self._guard.sampler(request.request_id, sample)

    def _guarded_processors(self, request: TokenizedRequest) -> list:
        if isinstance(request.grammar, CompiledGrammar) and request.resumed:
            # rebuilt from the start over the tokens it emitted: the resume does not
            # depend on where the row's last step left the shared matcher
            request.grammar.matcher.reset()
            request.grammar.matcher.consume_tokens(list(request.prompt_tokens[-request.resumed :]))
        processors = make_processors(
            request.sampling,
            request.grammar,
            request.resumed,
            self._policy.opener_mask_on_device,
        )
        for p in processors:
            if isinstance(p, LazyCallProcessor):  # fed the tokens each step reads back
                self._readers[request.request_id] = p
        return [self._guard.processor(request.request_id, p) for p in processors]

    def faults(self) -> dict[str, Exception]:
        return self._guard.take()

    def share_seed(self, seed: int) -> None:
        """Ranks of a group: the row guard re-seeds from ``seed``, the same on every rank."""
        self._guard.base = seed

    def decode(self) -> list[Decoded]:
        """One decode step, and a second where rows joined since the last: mlx-lm's
        generator runs a step ahead, so a joined row's first token comes out of the call
        after the one that takes it in. Made at once, that call moves the row's first
        token before the next engine step's prefill (a burst of 32 chat prompts: a
        second 512-token pass, ~1.2 s on 2 cores, sooner); it is the decode the next
        step would have made, so the work is the same."""
        joined, self._joined = self._joined, set()
        out = self._decode_once()
        if joined & self._uid_to_rid.keys():
            out += self._decode_once()
        return out

    def _decode_once(self) -> list[Decoded]:
        if not self._rid_to_uid:
            return []
        # the step's one wait: mlx-lm's ``next`` launches the following step, then reads
        # this one's tokens back as Python ints (nothing else in the step waits)
        _, responses = self.generator.next()
        logprobs = self._logprobs(responses)
        out = []
        for r in responses:
            rid = self._uid_to_rid[r.uid]
            out.append(Decoded(rid, r.token, r.finish_reason, logprobs.get(r.uid)))
            reader = self._readers.get(rid)
            if reader is not None:
                reader.readback(r.token)
            if r.finish_reason is not None:
                self._readers.pop(rid, None)
                del self._uid_to_rid[r.uid], self._rid_to_uid[rid]
                self._remember_finished(rid, r.all_tokens, r.prompt_cache)  # a fresh copy
                self._top.pop(rid, None)
                self._drop_adapter(rid)
        return out

    def _remember_finished(
        self, request_id: str, tokens: Any, cache: Any, *, live: bool = False
    ) -> None:
        """A finished request's cache, unless SpecPrefill skipped part of its prompt."""
        key = self._keys.pop(request_id, "")
        ns = self._ns.get(request_id, ())
        cache = [c for c in cache if not isinstance(c, RowSlots)]  # the batch's, not the row's
        if request_id in self._sparse:
            self._sparse.discard(request_id)
        else:
            self._remember(ns + tuple(tokens), cache, live=live, key=key)

    def _logprobs(self, responses: list) -> dict:
        """Logprobs for the responses whose requests asked, in one batched computation."""
        want = [r for r in responses if self._uid_to_rid[r.uid] in self._top]
        if not want:
            return {}
        tops = [self._top[self._uid_to_rid[r.uid]] for r in want]
        found = token_logprobs([r.logprobs for r in want], [r.token for r in want], tops)
        return {r.uid: lp for r, lp in zip(want, found, strict=True)}

    def remove(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._readers.pop(request_id, None)
        self._top.pop(request_id, None)
        uid = self._rid_to_uid.pop(request_id, None)
        if uid is not None:
            del self._uid_to_rid[uid]
            for cache, tokens in self.generator.remove([uid], return_prompt_caches=True).values():
                self._remember_finished(request_id, tokens, cache, live=True)
        self._sparse.discard(request_id)
        self._keys.pop(request_id, None)
        self._drop_adapter(request_id)
        if self._disk is not None:
            self._disk.forget(request_id)

    def preempt(self, request_id: str) -> int:
        """Take a row out of the batch to free its memory (``memory.admission = "use"``),
        leaving its cache in the prefix cache as a snapshot at its tokens so far (evicted
        to the disk tier, or dropped, like any other under pressure): its resume, a request
        whose prompt is those tokens, starts from it or recomputes them. Returns the
        snapshot's bytes (0: none kept: no prefix cache, or the row was still prefilling)."""
        self._remembered = 0
        self.remove(request_id)  # a variant's own removal (the speculative batch's) too
        return self._remembered

    def clear_cache(self, tier: str = "", every_model: bool = False) -> None:
        """Drop the prefix cache's snapshots: in RAM, on disk (this model's, or every
        model's), or both ("")."""
        if self.prefix_cache is not None and tier in ("", "ram"):
            self.prefix_cache.clear()
        if self._disk is not None and tier in ("", "disk"):
            self._disk.view.clear(every_space=every_model)

    def spill_cache(self, wait: bool = False) -> None:
        """Write every RAM snapshot to the disk tier (shutdown, unload); ``wait``: until
        they are on disk. Nothing without a disk tier."""
        if self._disk is None or self.prefix_cache is None:
            return
        n = self.prefix_cache.spill_all()
        log.info("prefix cache: %d snapshots spilled to disk", n)
        if wait:
            self._disk.view.store.flush()

    @property
    def cache_held(self) -> int:
        """Bytes of prefix-cache snapshots and resident adapters (they count against the
        request memory budget; only snapshots can be evicted for running requests)."""
        held = self.prefix_cache.stats.bytes if self.prefix_cache is not None else 0
        return held + (self.adapters.nbytes if self.adapters is not None else 0)

    def shrink_cache(self, nbytes: int) -> int:
        """Evict least-recently-used snapshots to free ``nbytes`` for running requests."""
        return self.prefix_cache.evict(nbytes) if self.prefix_cache is not None else 0

    def reset(self) -> None:
        """After a failed decode step: a fresh batch (the old one may be half-updated)."""
        self.generator.close()
        self.generator = self._new_generator()
        self._uid_to_rid.clear()
        self._rid_to_uid.clear()
        self._joined.clear()
        self._readers.clear()
        self._sparse.intersection_update(self._pending)
        self._keys = {rid: k for rid, k in self._keys.items() if rid in self._pending}
        for rid in [r for r in self._slots if r not in self._pending]:
            self._drop_adapter(rid)
        self._guard.take()
        mx.clear_cache()

    @contextlib.contextmanager
    def warming_up(self) -> Iterator[None]:
        """Requests no client sent (``scheduler/warmup.py``): the prefix cache and its disk
        tier neither serve nor keep them. Afterwards MLX's freed buffers go back and its
        memory peak starts again from idle, so the accounting is as the load left it."""
        kept = self.prefix_cache, self._disk
        self.prefix_cache, self._disk = None, None
        try:
            yield
        finally:
            self.prefix_cache, self._disk = kept
            mx.clear_cache()
            mx.reset_peak_memory()

    def memory_stats(self) -> tuple[int, int]:
        return mx.get_active_memory(), mx.get_peak_memory()

    def release_buffers(self) -> None:
        """The engine is idle: hand MLX's cached free buffers back to the system."""
        mx.clear_cache()
        _trim_heap()

    def _probe(self, cache: list[Any]) -> None:
        self.model(mx.array([[0]]), cache=cache)

    def probe_layers(self) -> tuple[Layer, ...]:
        """Measure each layer's cache on a one-token forward pass: per-token KV or fixed state."""
        cache = self._make_cache()
        with mx.stream(self._stream):
            self._probe(cache)
            mx.eval([c.state for c in cache])  # sync (at load): the cache's sizes are read next
        layers = tuple(_layer_of(c) for c in _leaf_caches(cache))
        del cache
        mx.clear_cache()
        return layers


def _libc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, where the C library has it (Linux; not macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return functools.partial(libc.malloc_trim, 0)
    except (OSError, AttributeError):
        return None


_TRIM = _libc_trim()


def _trim_heap() -> None:
    """Give freed heap pages back to the system. On the CPU backend MLX's buffers come
    from malloc, and glibc keeps large freed chunks in its arenas (its mmap threshold
    rises as they are freed): without this, resident memory stays near the burst's peak."""
    if _TRIM is not None:
        _TRIM()


def _probe_request(prompt: tuple[int, ...]) -> TokenizedRequest:
    """A request no client sent, for the runner's own checks on the model."""
    return TokenizedRequest(request_id="probe", prompt_tokens=prompt, sampling=SamplingParams())


def _leaf_caches(caches) -> list[Any]:
    out = []
    for c in caches:
        out.extend(_leaf_caches(c.caches) if hasattr(c, "caches") else [c])
    return out


def _copy(live: _T | None) -> _T | None:
    """A copy of live counters to publish (their fields are numbers, strings, tuples)."""
    return None if live is None else copy.copy(live)


def _layer_of(cache: Any) -> Layer:
    """A cache with keys grows per token (its third axis is the allocated length)."""
    keys = getattr(cache, "keys", None)
    if keys is None:
        return StateLayer(state_bytes=int(cache.nbytes))
    arrays = [a for _, a in tree_flatten((cache.keys, cache.values))]
    per_token = sum(a.nbytes // a.shape[2] for a in arrays)
    return AttentionLayer(bytes_per_token=int(per_token), window=getattr(cache, "max_size", None))


class InvalidAdapter(InvalidRequest):
    """A request's adapter cannot be served by this runner now (its own failure, a 400)."""

    def __init__(self, message: str):
        super().__init__(message, param="model")


class AdapterStep:
    """What BatchGenerator calls each decode step when adapters are on: the rows'
    adapter slots ride at the end of the batch's cache list (``RowSlots``), in the
    batch's own row order; the model runs on the other entries with them set."""

    def __init__(self, model: Callable[..., mx.array], rows: RowAdapters):
        self.model, self.rows = model, rows

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array:
        layers = cache[:-1]
        with self.rows.using(cache[-1].slots):
            out = self.model(inputs, cache=layers)
        cache[:-1] = layers  # some models swap a layer's cache object inside the list
        return out


def namespace(identity: str) -> tuple[int, ...]:
    """The prefix-cache namespace of an adapter: one negative number (no token is
    negative) from its identity, put before its rows' tokens in every snapshot key, so
    an adapter row never reuses the base's or another adapter's prefix."""
    digest = hashlib.sha256(identity.encode()).digest()
    return (-(int.from_bytes(digest[:7], "little") + 1),)
