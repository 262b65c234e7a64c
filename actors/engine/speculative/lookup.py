"""Prompt-lookup drafting: n-gram matches in the request's own prompt and output.

Agents and editors copy: code, tool output and quoted text come back in the reply.
``LookupDrafter`` needs no model. For each row it finds the latest earlier
occurrence of the row's last ``n`` tokens (``n`` from ``max_ngram`` down to
``min_ngram``, the longest match wins) and proposes the ``k`` tokens that followed
it; a row with no match drafts nothing that step (the verify pass is right-padded,
so that row decodes one token). Verification is the batch's: greedy output equals
plain decoding, sampled rows accept against a point mass on the drafted token.

``NgramIndex`` keeps one sequence's tokens and a dict from each n-gram to the
position of the token after its latest occurrence, updated as tokens arrive: O(n)
per token and O(n + k) per proposal, never a rescan. Plain Python, no MLX.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from mlxd.actors.engine.speculative.batch import Drafter, SpecRow


class NgramIndex:
    """One sequence's tokens, and where each of its n-grams (``min_n``..``max_n``)
    last occurred with a token after it."""

    def __init__(self, max_n: int, min_n: int, tokens: Iterable[int] = ()):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram bounds must satisfy 1 <= min <= max, got {min_n}..{max_n}")
        self.max_n, self.min_n = max_n, min_n
        self.tokens: list[int] = []
        # n-gram -> position of the token that followed its latest occurrence
        self._next: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Iterable[int]) -> None:
        seq, index = self.tokens, self._next
        for t in tokens:
            at = len(seq)  # every n-gram ending just before ``at`` is followed by ``t``
            for n in range(self.min_n, min(self.max_n, at) + 1):
                index[tuple(seq[at - n : at])] = at
            seq.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens that followed the latest earlier occurrence of the longest
        matching suffix; [] when no suffix of ``min_n`` tokens or more occurred before."""
        seq, end = self.tokens, len(self.tokens)
        for n in range(min(self.max_n, end), self.min_n - 1, -1):
            start = self._next.get(tuple(seq[end - n :]))
            if start is None:
                continue
            out: list[int] = []
            for j in range(k):
                # Past the end the copy continues with itself (a period of end - start).
                i = start + j
                out.append(seq[i] if i < end else out[i - end])
            return out
        return []


class LookupDrafter(Drafter):
    """Drafts by n-gram lookup in each row's prompt and output (``NgramIndex``)."""

    name = "lookup"

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1):
        NgramIndex(max_ngram, min_ngram)  # check the bounds now, not at the first join
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self._prefill: dict[str, NgramIndex] = {}  # requests prefilling: the prompt so far
        self.rows: list[NgramIndex] = []  # aligned with the batch's rows

    def fresh(self) -> LookupDrafter:
        return LookupDrafter(self.max_ngram, self.min_ngram)

    def _new(self) -> NgramIndex:
        return NgramIndex(self.max_ngram, self.min_ngram)

    # -- following prefill: the prompt is indexed chunk by chunk, spreading the cost

    def start(self, request_id: str) -> None:
        self._prefill[request_id] = self._new()

    def prefilled(self, request_id: str, prompt: Sequence[int], upto: int, hidden: Any) -> None:
        index = self._prefill.setdefault(request_id, self._new())
        index.extend(prompt[len(index) : upto])

    def joined(self, request_id: str, prompt: Sequence[int]) -> NgramIndex:
        # Whatever prefill did not show it (prefix-cache hits, SpecPrefill) is indexed now.
        index = self._prefill.pop(request_id, None) or self._new()
        index.extend(prompt[len(index) :])
        return index

    def forget(self, request_id: str) -> None:
        self._prefill.pop(request_id, None)

    # -- in the batch

    def add(self, state: NgramIndex) -> None:
        self.rows.append(state)

    def propose(self, rows: list[SpecRow], k: int, draw: Callable) -> list[list[int]]:
        return [
            index.propose(k) if r.params.speculative else []
            for r, index in zip(rows, self.rows, strict=True)
        ]

    def update(self, fed, proposed, accepted, new, k, hidden) -> None:
        for index, tokens in zip(self.rows, new, strict=True):
            index.extend(tokens)

    def filter(self, keep: list[int]) -> None:
        self.rows = [self.rows[i] for i in keep]

    # ``nbytes`` stays 0: the indexes live in host memory, not in the device budget.
