"""SpecPrefill: a scorer model picks the prompt chunks the target prefills.

For a prompt whose uncached suffix is at least ``spec_prefill.threshold_tokens``:

1. The suffix (everything after a prefix-cache hit, up to the last prompt token)
   is cut into ``chunk_tokens`` chunks. The first and the last chunk are always
   kept; of the middle chunks the top ones by score are kept so that about
   ``keep_fraction`` of all chunks are (the kept-token count is therefore known
   when the request starts, and ``Started`` reports it).
2. Scoring: the scorer model (the speculative draft, or the served model) reads
   the suffix on a cache of its own, chunk by chunk within the prefill budget.
   A token's importance is its **surprisal** under the scorer
   (``-log p(token | preceding suffix)``), a chunk's score the mean over its
   tokens: predictable text is what a reader can skip. This needs only the
   model's logits (``model(tokens, cache)``), so any mlx-lm model can score;
   the published SpecPrefill reads the draft's attention of the last tokens
   instead, which mlx-lm does not expose without patching its attention layers.
3. The target prefills only the kept chunks, **at their original positions**:
   its attention layers get a ``PositionedKVCache``, whose RoPE offset runs ahead
   of its stored entries by the positions skipped so far. Attention then sees
   fewer keys than the position count (the skipped tokens simply are not
   there); decoding continues at position ``len(prompt)``. SSM layers of a
   hybrid model (allowed only with ``spec_prefill.hybrid``) see just the kept
   tokens, one after the other: their state is not what a full prefill gives.

A sparse-prefilled cache never enters the prefix cache (it is not equivalent to
a full prefill). Must run on the generation thread, like the runner.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, BatchKVCache, KVCache, make_prompt_cache
from mlxd.actors.engine.scheduler.options import SpecPrefillOptions
from mlxd.protocol.messages import SpecPrefillCounters


class PositionedKVCache(KVCache):
    """A ``KVCache`` whose RoPE positions run ``skipped`` ahead of its stored entries.

    mlx-lm attention layers rotate queries and keys by ``cache.offset`` and then
    store at the same offset; here ``offset`` is the position and ``stored`` the
    storage index. ``merge`` (what mlx-lm's batching calls) carries the skipped
    positions into the batch cache's per-row offsets.
    """

    def __init__(self, skipped: int = 0):
        self.skipped = 0
        super().__init__()
        self.skipped = skipped

    @classmethod
    def of(cls, cache: KVCache) -> PositionedKVCache:
        out = cls()
        out.keys, out.values, out.offset = cache.keys, cache.values, cache.offset
        return out

    @property
    def offset(self) -> int:  # type: ignore[override]
        return self.stored + self.skipped

    @offset.setter
    def offset(self, value: int) -> None:
        self.stored = value - self.skipped

    def update_and_fetch(self, keys, values):
        skipped, self.skipped = self.skipped, 0  # KVCache stores at ``offset``
        try:
            return super().update_and_fetch(keys, values)
        finally:
            self.skipped = skipped

    def keys_and_values(self):
        return self.keys[..., : self.stored, :], self.values[..., : self.stored, :]

    def size(self) -> int:
        return self.stored

    def trim(self, n: int) -> int:
        n = min(self.stored, n)
        self.stored -= n
        return n

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        skipped, self.skipped = self.skipped, 0  # masks index stored entries
        try:
            return super().make_mask(N, return_array=return_array, window_size=window_size)
        finally:
            self.skipped = skipped

    @classmethod
    def merge(cls, caches):
        plain = [_stored_view(c) for c in caches]
        batch = BatchKVCache.merge(plain)
        batch.offset = batch.offset + mx.array([getattr(c, "skipped", 0) for c in caches])
        return batch


def _stored_view(cache: Any) -> Any:
    if not isinstance(cache, PositionedKVCache):
        return cache
    view = KVCache()
    view.keys, view.values, view.offset = cache.keys, cache.values, cache.stored
    return view


def positioned(cache: list[Any]) -> list[Any]:
    """The same cache list with every plain ``KVCache`` layer as a ``PositionedKVCache``."""
    return [PositionedKVCache.of(c) if type(c) is KVCache else c for c in cache]


def set_position(cache: list[Any], position: int) -> None:
    """The next token fed is at ``position``: skip the positions between."""
    for c in cache:
        if isinstance(c, PositionedKVCache):
            c.skipped = position - c.stored


def unsupported_layers(cache: list[Any], hybrid: bool) -> str | None:
    """Why SpecPrefill cannot run on this cache layout (None: it can)."""
    for c in cache:
        if isinstance(c, ArraysCache):
            if not hybrid:
                return (
                    "hybrid model (SSM layers would see only the kept tokens; spec_prefill.hybrid)"
                )
            continue
        if type(c) is not KVCache:
            return f"cannot prefill a {type(c).__name__} layer sparsely"
    return None


# ---- the plan -------------------------------------------------------------------------


def chunk_bounds(start: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(s, min(s + size, end)) for s in range(start, end, size)]


def kept_middle(chunks: int, keep_fraction: float) -> int:
    """How many of the ``chunks - 2`` middle chunks to keep (first and last always are)."""
    middle = max(chunks - 2, 0)
    return min(middle, max(math.ceil(keep_fraction * chunks) - 2, 0))


@dataclass
class SparsePlan:
    """One request's SpecPrefill: score the suffix, then prefill the kept chunks."""

    tokens: tuple[int, ...]  # the prompt
    chunks: list[tuple[int, int]]  # [start, end) positions of the suffix's chunks
    keep_middle: int
    scorer_cache: list[Any] | None = None
    scored: int = 0  # suffix tokens the scorer has read
    surprise: list[float] = field(default_factory=list)  # per scored token after the first
    kept: list[tuple[int, int]] = field(default_factory=list)  # decided once scored
    fed: int = 0  # kept tokens the target has read

    @property
    def start(self) -> int:
        return self.chunks[0][0]

    @property
    def end(self) -> int:
        return self.chunks[-1][1]

    @property
    def skipped(self) -> int:
        middle = self.chunks[1:-1]
        return sum(e - s for s, e in middle[: len(middle) - self.keep_middle])

    @property
    def needs_scores(self) -> bool:
        return self.keep_middle < len(self.chunks) - 2

    @property
    def remaining(self) -> int:
        unscored = (self.end - self.start - self.scored) if not self.kept else 0
        total = self.end - self.start - self.skipped
        return unscored + total - self.fed


def make_plan(
    tokens: tuple[int, ...], cached: int, *, chunk_tokens: int, keep_fraction: float
) -> SparsePlan:
    chunks = chunk_bounds(cached, len(tokens) - 1, chunk_tokens)
    plan = SparsePlan(tokens, chunks, kept_middle(len(chunks), keep_fraction))
    if not plan.needs_scores:
        plan.kept = coalesce(chunks)
    return plan


def score_step(scorer: Any, plan: SparsePlan, budget: int) -> int:
    """Let the scorer read up to ``budget`` more suffix tokens; return how many it read."""
    if plan.scorer_cache is None:
        plan.scorer_cache = make_prompt_cache(scorer)
    lo = plan.start + plan.scored
    hi = min(lo + budget, plan.end)
    logits = scorer(mx.array(plan.tokens[lo:hi])[None], cache=plan.scorer_cache)[0]
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    following = mx.array(plan.tokens[lo + 1 : hi + 1])[:, None]
    # Position p predicts token p + 1: the surprisal of tokens lo+1 .. hi.
    surprise = -mx.take_along_axis(logprobs, following, axis=-1)[:, 0]
    plan.surprise.extend(surprise.tolist())
    plan.scored += hi - lo
    if plan.scored == plan.end - plan.start:
        plan.kept = select(plan)
        plan.scorer_cache = None
    return hi - lo


def select(plan: SparsePlan) -> list[tuple[int, int]]:
    """First and last chunk, and the ``keep_middle`` middle chunks most surprising on average."""
    middle = plan.chunks[1:-1]

    def score(chunk: tuple[int, int]) -> float:
        # surprise[i] is token start + 1 + i
        values = plan.surprise[chunk[0] - plan.start - 1 : chunk[1] - plan.start - 1]
        return sum(values) / len(values)

    best = sorted(middle, key=score, reverse=True)[: plan.keep_middle]
    return coalesce([plan.chunks[0], *sorted(best), plan.chunks[-1]])


def coalesce(chunks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent kept chunks as one range (fewer, longer forward passes)."""
    out: list[tuple[int, int]] = []
    for s, e in chunks:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def prefill_step(model: Any, cache: list[Any], plan: SparsePlan, budget: int) -> int:
    """Feed the target up to ``budget`` kept tokens, each chunk at its own positions."""
    done = 0
    while done < budget and plan.fed < sum(e - s for s, e in plan.kept):
        s, e = _next_piece(plan, budget - done)
        set_position(cache, s)
        model(mx.array(plan.tokens[s:e])[None], cache=cache)
        plan.fed += e - s
        done += e - s
    return done


def _next_piece(plan: SparsePlan, budget: int) -> tuple[int, int]:
    fed = plan.fed
    for s, e in plan.kept:
        if fed < e - s:
            return s + fed, min(e, s + fed + budget)
        fed -= e - s
    raise AssertionError("nothing left to prefill")


# ---- what the runner holds ------------------------------------------------------------


@dataclass
class SpecPrefill:
    """The scorer model and its options; decides each request's plan."""

    scorer: Any
    options: SpecPrefillOptions
    stats: SpecPrefillCounters  # read by ``/v1/status`` (copies the engine publishes)

    def plan(self, tokens: tuple[int, ...], cached: int, wanted: bool | None) -> SparsePlan | None:
        s = self.options
        use = s.by_default if wanted is None else wanted
        suffix = len(tokens) - 1 - cached
        if not use or suffix < s.threshold_tokens:
            return None
        plan = make_plan(tokens, cached, chunk_tokens=s.chunk_tokens, keep_fraction=s.keep_fraction)
        self.stats.requests += 1
        self.stats.suffix_tokens += suffix
        self.stats.skipped_tokens += plan.skipped
        return plan

    def step(self, model: Any, cache: list[Any], plan: SparsePlan, budget: int) -> None:
        """One engine step's share: scoring first, then the kept chunks."""
        if not plan.kept:
            budget -= score_step(self.scorer, plan, budget)
        if plan.kept and budget > 0:
            prefill_step(model, cache, plan, budget)
