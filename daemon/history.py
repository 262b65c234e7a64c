"""The dashboard's memory: bounded rings of periodic samples and of finished requests.

A plain class (no trio, no mlx), fed on the trio thread by what is already collected:

- ``add_tokens``: the tokens of the steps the engine delivers with each ``EngineNews``
  (one integer addition per step);
- ``request_done``: a closing session's ``RequestTrace`` (a row in the recent-requests
  ring: counts, timings, status; never the request's content);
- ``sample``: every ``dashboard.sample_period_s`` the sampler task hands over the open
  requests' traces, the admission counts and the speculation counters of the loaded
  models; one ``Sample`` per period goes into a ring of ``history_s`` worth.

A sample's TTFT percentiles are over the requests whose first token came in its period,
its cache hit rate over the prompts that started in it (cached ÷ prompt tokens), its
acceptance rate over the drafts verified in it: each request is counted in the period
where the event happened, whether it is still open or already closed at sampling time.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    from mlxd.daemon.telemetry import RequestTrace


class Sample(msgspec.Struct, kw_only=True):
    """One period: ``t`` its end (Unix seconds); rates per second; TTFT in seconds; a
    rate or percentile is None when nothing it is over happened in the period."""

    seq: int
    t: float
    seconds: float  # the period's length (longer than ``sample_period_s`` when late)
    tokens: int  # generated in the period
    tokens_per_s: float
    # the most requests at once in the period (seen after every engine step and at the
    # sample): a burst that starts and ends between two samples still shows
    running: int  # requests past admission (tokenizing, generating, streaming)
    queued: int  # requests in the admission queue
    finished: int = 0  # requests that ended in the period
    ttft_p50: float | None = None
    ttft_p95: float | None = None
    cache_hit_rate: float | None = None
    spec_acceptance: float | None = None
    memory_bytes: int = 0


class RequestRow(msgspec.Struct, kw_only=True):
    """A finished request as the dashboard lists it; ``api`` is the route it came in by."""

    seq: int
    id: str
    model: str
    api: str
    t: float  # when it ended (Unix seconds)
    prompt_tokens: int
    cached_tokens: int
    generated_tokens: int
    ttft_s: float | None
    duration_s: float | None
    status: int | None
    finish_reason: str | None
    code: str | None = None


class Window(msgspec.Struct, kw_only=True):
    """The samples of the last ``seconds`` summed up (``mlxd status``'s last minute)."""

    seconds: float
    tokens_per_s: float
    requests: int  # requests that finished in it
    ttft_p50: float | None
    ttft_p95: float | None


def percentile(values: list[float], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank; None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q * len(ordered)) - 1)]


class History:
    """The rings and the running tallies between two samples."""

    def __init__(
        self,
        period_s: float = 1.0,
        max_samples: int = 900,
        max_requests: int = 100,
        window_s: float = 60.0,
    ):
        self.period_s, self.window_s = period_s, window_s
        self.samples: deque[Sample] = deque(maxlen=max_samples)
        self.requests: deque[RequestRow] = deque(maxlen=max_requests)
        self.done_by_model: dict[str, int] = {}
        self._tokens = 0  # generated since the last sample
        self._peak = (0, 0)  # the most (running, queued) seen since the last sample
        self._closed: list[RequestTrace] = []  # closed since the last sample
        self._last_at: float | None = None  # the last sample's time on the traces' clock
        self._spec: dict[str, tuple[int, int]] = {}  # model → (drafted, accepted) last seen
        self._next_sample = self._next_request = 0
        # each recent sample's TTFTs, for the window's percentiles (which do not add up)
        self._ttfts: deque[tuple[float, list[float]]] = deque(
            maxlen=math.ceil(window_s / period_s) + 1
        )

    @classmethod
    def from_settings(cls, dashboard) -> History:
        return cls(dashboard.sample_period_s, dashboard.max_samples, dashboard.recent_requests)

    # ---- fed on the trio thread --------------------------------------------------------

    def add_tokens(self, n: int) -> None:
        self._tokens += n

    def note_load(self, running: int, queued: int) -> None:
        """The admission counts now (after an engine step): the period keeps the most."""
        self._peak = (max(self._peak[0], running), max(self._peak[1], queued))

    def request_done(self, trace: RequestTrace, wall: float) -> None:
        self._closed.append(trace)
        self.done_by_model[trace.model] = self.done_by_model.get(trace.model, 0) + 1
        duration = None if trace.end is None else trace.end - trace.start
        if self.requests.maxlen == 0:
            return
        self.requests.append(
            RequestRow(
                seq=self._next_request,
                id=trace.request_id,
                model=trace.model,
                api=trace.api,
                t=wall,
                prompt_tokens=trace.prompt_tokens,
                cached_tokens=trace.cached_tokens,
                generated_tokens=trace.completion_tokens,
                ttft_s=trace.ttft,
                duration_s=duration,
                status=trace.status,
                finish_reason=trace.finish_reason,
                code=trace.code,
            )
        )
        self._next_request += 1

    def sample(
        self,
        now: float,
        wall: float,
        open_traces: Iterable[RequestTrace],
        running: int,
        queued: int,
        speculation: dict[str, tuple[int, int]] | None = None,
        memory_bytes: int = 0,
    ) -> Sample:
        """Close the period ending at ``now`` (the traces' clock; ``wall``: Unix time)."""
        since, self._last_at = self._last_at, now
        elapsed = self.period_s if since is None else max(now - since, 1e-9)
        finished = len(self._closed)
        traces, self._closed = [*open_traces, *self._closed], []
        ttfts, prompt, cached = [], 0, 0
        for trace in traces:
            if _within(trace.first_token_at, since, now) and trace.ttft is not None:
                ttfts.append(trace.ttft)
            if _within(trace.started_at, since, now):
                prompt, cached = prompt + trace.prompt_tokens, cached + trace.cached_tokens
        tokens, self._tokens = self._tokens, 0
        (peak_running, peak_queued), self._peak = self._peak, (0, 0)
        sample = Sample(  # rounded: a poll after a page opens carries every sample
            seq=self._next_sample,
            t=round(wall, 3),
            seconds=round(elapsed, 4),
            tokens=tokens,
            tokens_per_s=round(tokens / elapsed, 2),
            running=max(running, peak_running),
            queued=max(queued, peak_queued),
            finished=finished,
            ttft_p50=_round(percentile(ttfts, 0.5)),
            ttft_p95=_round(percentile(ttfts, 0.95)),
            cache_hit_rate=_round(cached / prompt if prompt else None),
            spec_acceptance=_round(self._acceptance(speculation or {})),
            memory_bytes=memory_bytes,
        )
        self._next_sample += 1
        self.samples.append(sample)
        self._ttfts.append((wall, ttfts))
        return sample

    def _acceptance(self, counters: dict[str, tuple[int, int]]) -> float | None:
        """Accepted ÷ drafted tokens since the last sample, over every model (a model's
        counters start again at zero when it reloads)."""
        drafted = accepted = 0
        for model, (d, a) in counters.items():
            last_d, last_a = self._spec.get(model, (0, 0))
            if d < last_d or a < last_a:  # reloaded since
                last_d = last_a = 0
            drafted, accepted = drafted + d - last_d, accepted + a - last_a
        self._spec = dict(counters)
        return accepted / drafted if drafted > 0 else None

    # ---- read by the routes --------------------------------------------------------------

    def samples_since(self, seq: int) -> list[Sample]:
        """The samples numbered ``seq`` and after that the ring still holds."""
        first = self.samples[0].seq if self.samples else 0
        return list(self.samples)[max(seq - first, 0) :]

    def requests_since(self, seq: int) -> list[RequestRow]:
        first = self.requests[0].seq if self.requests else 0
        return list(self.requests)[max(seq - first, 0) :]

    @property
    def next_sample(self) -> int:
        return self._next_sample

    @property
    def next_request(self) -> int:
        return self._next_request

    def window(self, wall: float) -> Window:
        """The samples of the last ``window_s`` (tokens per second over the time they
        cover)."""
        start = wall - self.window_s
        recent = [s for s in self.samples if s.t > start]
        covered = sum(s.seconds for s in recent)
        ttfts = [v for t, values in self._ttfts if t > start for v in values]
        return Window(
            seconds=self.window_s,
            tokens_per_s=sum(s.tokens for s in recent) / covered if covered else 0.0,
            requests=sum(s.finished for s in recent),
            ttft_p50=percentile(ttfts, 0.5),
            ttft_p95=percentile(ttfts, 0.95),
        )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _within(at: float | None, since: float | None, now: float) -> bool:
    return at is not None and (since is None or at > since) and at <= now
