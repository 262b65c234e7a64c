"""Speculative decoding inside the continuous batch (mlx-lm's ``BatchGenerator`` has none).

``SpeculativeBatch`` owns a decode batch built only from the cache classes'
public batching API (``merge`` / ``extend`` / ``filter`` / ``extract`` /
``prepare`` / ``finalize`` / ``trim``). Each step:

1. the drafter (``ModelDrafter`` here, ``mtp.MTPDrafter``, ``lookup.LookupDrafter``)
   proposes up to ``k`` tokens for every row;
2. one target forward pass verifies all rows: row ``i`` is fed ``[last, d1..dk]``;
3. each row accepts its own prefix: greedy rows while the draft equals the
   target's argmax, sampled rows by standard rejection sampling (accept ``d``
   with probability ``min(1, p/q)``, else draw from ``norm(max(p - q, 0))``),
   then one bonus token from the target;
4. caches are rewound per row. Attention caches (``BatchKVCache``) keep rows
   right-aligned, so a row's rejected tail is turned into left padding the way
   mlx-lm finalizes right-padded prompts (``prepare(right_padding=...)`` +
   ``finalize()``): the common part is trimmed, the rest rolled out and masked.
   Layers that cannot be trimmed (SSM / GatedDeltaNet ``ArraysCache`` state)
   are snapshotted before the verify pass; when any row rejected a draft, every
   row's SSM state is restored, the attention layers drop the verify tokens,
   and the accepted tokens are fed again (right-padded, per-row lengths).

Greedy output equals plain decoding token for token; sampled output follows the
target distribution. Above ``max_batch`` rows speculation is off for the step
(plain one-token decode in the same batch); the draft cache catches up on the
tokens it missed the next time speculation is on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from mlxd.actors.engine.runner.sampling import scaled_logits
from mlxd.protocol.messages import SamplingParams, SpeculativeCounters


class UnsupportedForSpeculation(ValueError):
    """A cache layout that speculative decoding cannot rewind (e.g. a rotating window)."""


@dataclass
class SpecRow:
    """One sequence in the speculative batch."""

    request_id: str
    tokens: list[int]  # prompt + emitted; tokens[-1] is not in the target cache yet
    max_tokens: int
    params: SamplingParams
    processors: list = field(default_factory=list)
    key: mx.array | None = None  # a seeded request's own PRNG key
    generated: int = 0

    def next_key(self) -> mx.array | None:
        if self.key is None:
            return None
        self.key, sub = mx.random.split(self.key)
        return sub


@dataclass(frozen=True)
class Emitted:
    """A row's tokens from one step; ``cache``/``tokens`` set when it finished."""

    request_id: str
    tokens: tuple[int, ...]
    finish_reason: str | None
    cache: list[Any] | None = None
    cache_tokens: list[int] | None = None


# ---- sampling -------------------------------------------------------------------------


def sample(logits: mx.array, key: mx.array | None) -> int:
    return int(mx.random.categorical(logits, key=key).item())


def accept_sampled(
    p: mx.array,
    q: mx.array | None,
    drafts: Sequence[int],
    next_key: Callable[[], mx.array | None],
) -> tuple[int, int]:
    """Standard speculative sampling for one row: (drafts accepted, next token).

    ``p`` is the target's ``[k+1, V]`` probabilities, ``q`` the draft's ``[k, V]``
    from which ``drafts`` were drawn; None for a deterministic drafter (prompt
    lookup), whose ``q`` is all on the drafted token.
    """
    for j, d in enumerate(drafts):
        u = mx.random.uniform(key=next_key()).item()
        qd = 1.0 if q is None else q[j, d].item()
        if u * qd < p[j, d].item():  # u < p/q without dividing by q
            continue
        if q is None:  # max(p - onehot(d), 0): p without d
            residual = p[j] * (mx.arange(p.shape[-1]) != d)
        else:
            residual = mx.maximum(p[j] - q[j], 0.0)
        if residual.sum().item() <= 0.0:  # p == q up to rounding: nothing to correct
            residual = p[j]
        return j, sample(mx.log(residual), next_key())
    return len(drafts), sample(mx.log(p[len(drafts)]), next_key())


# ---- caches ---------------------------------------------------------------------------


def _leaves(cache: Sequence[Any]) -> list[Any]:
    out = []
    for c in cache:
        out.extend(_leaves(c.caches) if hasattr(c, "caches") else [c])  # CacheList
    return out


def check_rewindable(cache: Sequence[Any]) -> None:
    """Every layer must be trimmable attention state or an SSM ``ArraysCache``.

    By class name: mlx-vlm ships its own copies of mlx-lm's cache classes
    (``QuantizedRowCache``: ``runner/kv_quant.py``, trimmed and rolled alike)."""
    for c in _leaves(cache):
        if _is_ssm(c):
            continue
        if type(c).__name__ not in ("KVCache", "QuantizedRowCache"):
            raise UnsupportedForSpeculation(f"cannot rewind a {type(c).__name__} layer")


def feed(model: Any, cache: list[Any], rows: Sequence[Sequence[int]]) -> Any:
    """One forward pass over rows of different lengths (right-padded); ``[B, L, ...]``."""
    width = max(len(r) for r in rows)
    ids = mx.array([list(r) + [0] * (width - len(r)) for r in rows])
    return padded(cache, [len(r) for r in rows], lambda: model(ids, cache=cache))


def padded(cache: list[Any], lengths: Sequence[int], call: Callable[[], Any]) -> Any:
    """``call()`` over right-padded rows of ``lengths``; the caches keep only real tokens."""
    width = max(lengths)
    padding = [width - n for n in lengths]
    if max(padding) == 0:
        return call()
    for c in cache:
        c.prepare(lengths=list(lengths), right_padding=padding)
    out = call()
    for c in cache:
        c.finalize()
    return out


def drop_last(cache: Sequence[Any], drop: Sequence[int]) -> None:
    """Remove the last ``drop[i]`` tokens of row ``i`` from trimmable batch caches."""
    common = min(drop)
    rest = [d - common for d in drop]
    for c in cache:
        if common:
            c.trim(common)
        if max(rest) > 0:
            c.prepare(right_padding=rest)
            c.finalize()


def snapshot(cache: Sequence[Any]) -> list[tuple]:
    """The SSM layers' state (arrays are immutable: copying the lists is enough)."""
    return [(list(c.cache), c.left_padding, c.lengths) for c in _leaves(cache) if _is_ssm(c)]


def _is_ssm(c: Any) -> bool:
    return type(c).__name__ in ("ArraysCache", "BatchArraysCache")


def restore(cache: Sequence[Any], saved: list[tuple]) -> None:
    for c, (arrays, left, lengths) in zip(
        [c for c in _leaves(cache) if _is_ssm(c)], saved, strict=True
    ):
        c.cache, c.left_padding, c.lengths = list(arrays), left, lengths


def rewind(
    model: Any,
    cache: list[Any],
    fed: Sequence[Sequence[int]],
    keep: Sequence[int],
    saved: list[tuple] | None,
) -> None:
    """Row ``i`` was fed the tokens ``fed[i]`` since ``saved``: keep its first ``keep[i]``.

    Attention-only caches roll the rejected tails out. With SSM layers (``saved``
    holds their state from before the feed), every row's attention drops all it was
    fed, SSM state is restored, and the kept tokens (at least one per row) are fed again.
    """
    drop = [len(f) - k for f, k in zip(fed, keep, strict=True)]
    if max(drop) == 0:
        return
    if saved is None:
        drop_last(cache, drop)
        return
    drop_last([c for c in _leaves(cache) if not _is_ssm(c)], [len(f) for f in fed])
    restore(cache, saved)
    feed(model, cache, [list(f[:k]) for f, k in zip(fed, keep, strict=True)])


def merge_caches(caches: Sequence[Sequence[Any]]) -> list[Any]:
    return [caches[0][i].merge([c[i] for c in caches]) for i in range(len(caches[0]))]


# ---- drafters ------------------------------------------------------------------------


class Drafter:
    """What proposes tokens: a draft model (``ModelDrafter``), the target's MTP head
    (``mtp.MTPDrafter``) or n-gram lookup in the request's own tokens (``lookup``).

    A drafter follows each request's prefill (``start`` / ``prefilled`` / ``joined``),
    then keeps per-row state aligned with the batch's rows (``add`` / ``filter``):
    ``propose`` drafts up to ``k`` tokens per row (rows may get fewer, or none: the
    verify pass is right-padded), ``update`` tells it what the target accepted. A
    drafter that does not ``draw`` from logits is deterministic: sampled rows then
    accept by rejection sampling against a point mass. ``wants_hidden``: it needs the target's last hidden states (prefill
    chunks and the verify pass), so the target runs split at its head.
    """

    name = ""
    wants_hidden = False

    def fresh(self) -> Drafter:
        """The same drafter with no requests (after a failed step)."""
        raise NotImplementedError

    def start(self, request_id: str) -> None: ...

    def prefilled(self, request_id: str, prompt: Sequence[int], upto: int, hidden: Any) -> None:
        """The target prefilled ``prompt[:upto]``; ``hidden`` its last chunk's hidden states."""

    def joined(self, request_id: str, prompt: Sequence[int]) -> Any:
        """The request's drafter state as it joins the batch (its target cache holds
        ``prompt[:-1]``)."""

    def forget(self, request_id: str) -> None: ...

    def add(self, state: Any) -> None:
        raise NotImplementedError

    def propose(self, rows: list[SpecRow], k: int, draw: Callable) -> list[list[int]]:
        raise NotImplementedError

    def update(
        self,
        fed: list[list[int]],
        proposed: list[list[int]],
        accepted: list[int],
        new: list[list[int]],
        k: int,
        hidden: Any,
    ) -> None:
        """After a step: row ``i`` was fed ``fed[i]`` (verify), emitted ``new[i]``."""
        raise NotImplementedError

    def filter(self, keep: list[int]) -> None:
        raise NotImplementedError

    def state(self) -> list[Any]:
        """Arrays to evaluate at the end of a step."""
        return []

    @property
    def nbytes(self) -> int:
        return 0


class ModelDrafter(Drafter):
    """A separate small model sharing the tokenizer (or the target itself): its own caches."""

    def __init__(self, model: Any, name: str = "draft model"):
        self.model, self.name = model, name
        self._make_cache = lambda: make_prompt_cache(model)
        check_rewindable(self._make_cache())
        self._prefill: dict[str, tuple[list[Any], int]] = {}  # cache, prompt tokens in it
        self.cache: list[Any] = []
        self.pending: list[list[int]] = []  # per row: tokens the draft cache lacks
        self._ssm = False

    def start(self, request_id: str) -> None:
        self._prefill[request_id] = (self._make_cache(), 0)

    def prefilled(self, request_id: str, prompt: Sequence[int], upto: int, hidden: Any) -> None:
        cache, done = self._prefill[request_id]
        if upto > done:
            self.model(mx.array(prompt[done:upto])[None], cache=cache)
            mx.eval([c.state for c in cache])
            self._prefill[request_id] = (cache, upto)

    def joined(self, request_id: str, prompt: Sequence[int]) -> Any:
        self.prefilled(request_id, prompt, len(prompt) - 1, None)
        cache, _ = self._prefill.pop(request_id)
        return cache, [prompt[-1]]

    def forget(self, request_id: str) -> None:
        self._prefill.pop(request_id, None)

    def add(self, state: Any) -> None:
        cache, pending = state
        new = merge_caches([cache])
        if not self.pending:
            self.cache, self._ssm = new, bool(snapshot(new))
        else:
            for mine, other in zip(self.cache, new, strict=True):
                mine.extend(other)
        self.pending.append(pending)

    def propose(self, rows: list[SpecRow], k: int, draw: Callable) -> list[list[int]]:
        self._saved = snapshot(self.cache) if self._ssm else None
        logits = feed(self.model, self.cache, self.pending)
        logits = logits[mx.arange(len(rows)), mx.array([len(p) - 1 for p in self.pending])]
        steps = []
        for j in range(k):
            if j:
                logits = self.model(steps[-1][:, None], cache=self.cache)[:, -1]
            steps.append(draw(logits))
        return mx.stack(steps, axis=1).tolist()

    def update(self, fed, proposed, accepted, new, k, hidden) -> None:
        if k == 0:
            for pending, tokens in zip(self.pending, new, strict=True):
                pending.extend(tokens)
            return
        # The draft was fed its pending tokens and d1..d(k-1).
        fed_draft = [p + d[:-1] for p, d in zip(self.pending, proposed, strict=True)]
        keep = [len(p) + min(a, k - 1) for p, a in zip(self.pending, accepted, strict=True)]
        rewind(self.model, self.cache, fed_draft, keep, self._saved)
        # It keeps d1..d(min(a, k-1)) of the emitted d1..da + bonus: the rest is pending.
        self.pending = [n[min(a, k - 1) :] for a, n in zip(accepted, new, strict=True)]

    def filter(self, keep: list[int]) -> None:
        self.pending = [self.pending[i] for i in keep]
        if not keep:
            self.cache = []
            return
        for c in self.cache:
            c.filter(keep)

    def state(self) -> list[Any]:
        return [c.state for c in self.cache]

    @property
    def nbytes(self) -> int:
        held = sum(c.nbytes for cache, _ in self._prefill.values() for c in cache)
        return held + sum(c.nbytes for c in self.cache)


def split_at_head(model: Any) -> tuple[Any, Any]:
    """A model's body (tokens → last hidden states) and head (hidden → logits; the tied
    embedding when it has no ``lm_head``)."""
    lm = getattr(model, "language_model", model)
    head = getattr(lm, "lm_head", None)
    return lm.model, head if head is not None else lm.model.embed_tokens.as_linear


class Target:
    """The target model as the verify pass calls it: logits, and (for MTP) hidden states."""

    def __init__(self, model: Any, split: bool):
        self.model = model
        self.split = split
        if split:
            self.inner, self.head = split_at_head(model)

    def __call__(self, ids: mx.array, cache: list[Any]) -> tuple[mx.array, mx.array | None]:
        if not self.split:
            return self.model(ids, cache=cache), None
        hidden = self.inner(ids, cache=cache)
        return self.head(hidden), hidden

    def hidden(self, ids: mx.array, cache: list[Any]) -> mx.array:
        """The last hidden states alone (no vocabulary projection): for prefill and replays."""
        return self.inner(ids, cache=cache) if self.split else self.model(ids, cache=cache)


# ---- the batch ------------------------------------------------------------------------


class SpeculativeBatch:
    """Rows decoding together; each ``step()`` drafts, verifies once, accepts, rewinds."""

    def __init__(
        self,
        model: Any,
        drafter: Drafter,
        *,
        num_draft: int,
        max_batch: int,
        stop_tokens: Sequence[int],
        stats: SpeculativeCounters,
        target: Any = None,
    ):
        # ``target``: how the verify pass calls the model (default ``Target``; a vision
        # model's language model needs its own positions, see ``vlm_mtp.py``).
        self.target = target or Target(model, drafter.wants_hidden)
        self.drafter = drafter
        self.k, self.max_batch = num_draft, max_batch
        self.stop = set(stop_tokens)
        self.stats = stats
        self.rows: list[SpecRow] = []
        self.cache: list[Any] = []
        self._ssm = False

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.cache) + self.drafter.nbytes

    def add(self, row: SpecRow, cache: list[Any], draft_state: Any) -> None:
        """Join a prefilled row: ``cache`` holds ``row.tokens[:-1]``; ``draft_state``
        is what ``drafter.joined`` returned for it."""
        new = merge_caches([cache])
        if not self.rows:
            self.cache, self._ssm = new, bool(snapshot(new))
        else:
            for mine, other in zip(self.cache, new, strict=True):
                mine.extend(other)
        self.drafter.add(draft_state)
        self.rows.append(row)

    def remove(self, request_id: str) -> Emitted | None:
        """Take a row out; its cache (and the tokens in it) come back."""
        for i, row in enumerate(self.rows):
            if row.request_id == request_id:
                done = self._finished(i, (), "abort")
                self._filter([j for j in range(len(self.rows)) if j != i])
                return done
        return None

    def step(self) -> list[Emitted]:
        if not self.rows:
            return []
        wanted = any(r.params.speculative for r in self.rows)
        k = self.k if wanted and len(self.rows) <= self.max_batch else 0
        q: list[list[mx.array]] = [[] for _ in self.rows]
        proposed = (
            self.drafter.propose(self.rows, k, lambda logits: self._draft_tokens(logits, q))
            if k
            else [[] for _ in self.rows]
        )
        # A request that opted out ("speculative": false) verifies no drafts.
        drafts = [
            d if r.params.speculative else [] for r, d in zip(self.rows, proposed, strict=True)
        ]
        fed = [[r.tokens[-1], *d] for r, d in zip(self.rows, drafts, strict=True)]
        saved = snapshot(self.cache) if k and self._ssm else None
        logits, hidden = feed(self.target, self.cache, fed)
        accepted, bonus = self._accept(self._process(logits, fed), drafts, q)
        rewind(self.target.hidden, self.cache, fed, [a + 1 for a in accepted], saved)
        new = [d[:a] + [b] for d, a, b in zip(drafts, accepted, bonus, strict=True)]
        self.drafter.update(fed, proposed, accepted, new, k, hidden)
        mx.eval([c.state for c in self.cache], self.drafter.state())
        self._count(k, drafts, accepted)
        return self._emit(new)

    # -- drafting and acceptance

    def _draft_tokens(self, logits: mx.array, q: list[list[mx.array]]) -> mx.array:
        """One draft token per row from the drafter's ``[B, V]`` logits; records the
        distributions of sampled rows in ``q`` (rejection sampling needs them)."""
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if all(r.params.greedy for r in self.rows):
            return mx.argmax(logprobs, axis=-1)
        out = []
        for i, r in enumerate(self.rows):
            if r.params.greedy:
                out.append(mx.argmax(logprobs[i : i + 1], axis=-1))
                continue
            scaled = scaled_logits(logprobs[i : i + 1], r.params)
            q[i].append(mx.softmax(scaled, axis=-1)[0])
            out.append(mx.random.categorical(scaled, key=r.next_key()))
        return mx.concatenate(out)

    def _process(self, logits: mx.array, fed: list[list[int]]) -> mx.array:
        """Logits processors (penalties, bias) per position, each with its own context."""
        if not any(r.processors for r in self.rows):
            return logits
        rows = []
        for i, r in enumerate(self.rows):
            if not r.processors:
                rows.append(logits[i])
                continue
            positions = []
            for j in range(logits.shape[1]):
                context = mx.array(r.tokens + fed[i][1 : j + 1])
                x = logits[i, j : j + 1]
                for processor in r.processors:
                    x = processor(context, x)
                positions.append(x)
            rows.append(mx.concatenate(positions, axis=0))
        return mx.stack(rows)

    def _accept(self, logits, drafts, q) -> tuple[list[int], list[int]]:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        argmax = mx.argmax(logprobs, axis=-1).tolist()
        accepted, bonus = [], []
        for i, r in enumerate(self.rows):
            if r.params.greedy:
                a = 0
                while a < len(drafts[i]) and drafts[i][a] == argmax[i][a]:
                    a += 1
                accepted.append(a)
                bonus.append(argmax[i][a])
                continue
            p = mx.softmax(scaled_logits(logprobs[i], r.params), axis=-1)
            qi = mx.stack(q[i]) if q[i] else None  # none drawn: a deterministic drafter
            a, t = accept_sampled(p, qi, drafts[i], r.next_key)
            accepted.append(a)
            bonus.append(t)
        return accepted, bonus

    # -- bookkeeping

    def _count(self, k: int, drafts: list[list[int]], accepted: list[int]) -> None:
        if k == 0:
            self.stats.plain_steps += 1
            return
        emitted = sum(accepted) + sum(1 for d in drafts if d)
        self.stats.count(sum(len(d) for d in drafts), sum(accepted), emitted)

    def _emit(self, new: list[list[int]]) -> list[Emitted]:
        out, keep = [], []
        for i, r in enumerate(self.rows):
            r.tokens.extend(new[i])
            shown, reason = self._shown(r, new[i])
            if reason is None:
                keep.append(i)
                out.append(Emitted(r.request_id, shown, None))
            else:
                out.append(self._finished(i, shown, reason))
        if len(keep) < len(self.rows):
            self._filter(keep)
        return out

    def _shown(self, row: SpecRow, new: list[int]) -> tuple[tuple[int, ...], str | None]:
        """The new tokens up to a stop token or the length limit."""
        for n, t in enumerate(new, 1):
            row.generated += 1
            if t in self.stop:
                return tuple(new[:n]), "stop"
            if row.generated >= row.max_tokens:
                return tuple(new[:n]), "length"
        return tuple(new), None

    def _finished(self, i: int, shown: tuple[int, ...], reason: str) -> Emitted:
        row = self.rows[i]
        cache = [c.extract(i) for c in self.cache]
        return Emitted(row.request_id, shown, reason, cache, row.tokens[:-1])

    def _filter(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]
        self.drafter.filter(keep)
        if not keep:
            self.cache = []
            return
        for c in self.cache:
            c.filter(keep)
