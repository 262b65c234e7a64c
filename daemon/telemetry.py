"""Observability: Prometheus metrics, the one-line request log, and ``/v1/status``.

Nothing here runs on the hot path (the engine step and the SSE loop):

- the engine publishes an ``EngineStats`` snapshot after each step (one
  attribute write on the trio thread), with copies of the prefix-cache,
  speculation and SpecPrefill counters taken on the engine thread (each set is one
  type from the engine to the wire, encoded as it arrives); when
  ``/metrics`` or ``/v1/status`` is read, the pipeline hands over a ``Live``
  view (that snapshot, the admission counts, the open requests' traces) and
  nothing here reads an actor's or the runner's live objects;
- each session keeps a ``RequestTrace`` (a few timestamps and counts) and hands
  it here once, when it closes: histograms, counters and the log line are
  written then.

Every app gets its own ``CollectorRegistry`` (tests build many apps).
Inter-token latency is each request's mean gap after its first token
(``(last − first) / (tokens − 1)``): the mailboxes merge deltas, so single
gaps are not seen above the detokenizer.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
from mlxd.daemon.api.errors import STATUS, code_of
from mlxd.protocol import status as wire
from mlxd.protocol.messages import (
    EngineStats,
    Failed,
    Finished,
    MailboxEvent,
    PrefixCacheCounters,
    SpeculativeCounters,
    Started,
    TextDelta,
)
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from mlxd.daemon.settings import Settings

request_log = logging.getLogger("mlxd.requests")

# Failures that are admission decisions (the request never ran), by their reason's code.
REJECTIONS = frozenset({"queue_full", "queue_timeout", "request_too_large", "model_loading"})
CLIENT_GONE = 499  # nginx's "client closed request": the client left before the end
# The route a request came in by (its path), set by the app's guard for the handler's task;
# a session records it on its trace (the dashboard's "API" column).
API_ROUTE: ContextVar[str] = ContextVar("mlxd_api_route", default="")

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
_E2E = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320, 640)


@dataclass
class RequestTrace:
    """One request's timings (trio clock, seconds) and counts, filled in as events pass."""

    request_id: str
    start: float
    started_at: float | None = None
    first_token_at: float | None = None
    last_token_at: float | None = None
    end: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    status: int | None = None
    code: str | None = None
    model: str = ""  # the served model's id (the ``model`` label)
    api: str = ""  # the route it came in by (``API_ROUTE``)

    def observe(self, batch: list[MailboxEvent], now: float) -> None:
        for event in batch:
            match event:
                case Started(prompt_tokens=prompt, cached_tokens=cached):
                    self.started_at, self.prompt_tokens, self.cached_tokens = now, prompt, cached
                case TextDelta(tokens=tokens):
                    self.first_token_at = self.first_token_at or now
                    self.last_token_at = now
                    self.completion_tokens += tokens
                case Finished():
                    self.finish_reason, self.status = event.finish_reason, 200
                    self.completion_tokens = event.completion_tokens
                case Failed():
                    self.finish_reason, self.code = "error", code_of(event.reason)
                    self.status = STATUS[event.reason]

    def close(self, now: float) -> None:
        self.end = now
        if self.status is None:
            self.status, self.finish_reason = CLIENT_GONE, "abort"

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.start

    @property
    def inter_token(self) -> float | None:
        if self.first_token_at is None or self.last_token_at is None:
            return None
        if self.completion_tokens < 2:
            return None
        return (self.last_token_at - self.first_token_at) / (self.completion_tokens - 1)

    def log_line(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value * 1000:.1f}"

        duration = None if self.end is None else self.end - self.start
        return (
            f"request id={self.request_id} status={self.status} "
            f"prompt_tokens={self.prompt_tokens} cached_tokens={self.cached_tokens} "
            f"generated_tokens={self.completion_tokens} ttft_ms={ms(self.ttft)} "
            f"duration_ms={ms(duration)} finish_reason={self.finish_reason}"
            + (f" code={self.code}" if self.code else "")
        )


@dataclass(frozen=True)
class Live:
    """The server now, as the pipeline reports it when metrics or the status are read."""

    state: str  # loading, ready or draining
    engine: EngineStats  # the engine's last published snapshot
    admission: wire.AdmissionStatus
    requests: list[tuple[RequestTrace, bool]]  # open requests; True: in the admission queue
    model: wire.ModelStatus | None = None  # None while loading
    kv_bytes_per_token: int = 0  # the memory model's estimates (0: no memory gate)
    state_bytes: int = 0
    models: list[wire.ServedModel] = dataclasses.field(default_factory=list)
    adapters: list[wire.ServedAdapter] = dataclasses.field(default_factory=list)


class Telemetry:
    """The metrics of one app, and what a closing session reports to them."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        by_model = ["model"]
        self.requests = Counter(
            "mlxd_requests",
            "Finished requests",
            ["model", "status", "finish_reason"],
            registry=r,
        )
        self.rejected = Counter(
            "mlxd_requests_rejected",
            "Requests refused by admission",
            ["model", "reason"],
            registry=r,
        )
        self.failed = Counter(
            "mlxd_requests_failed",
            "Requests that failed after admission",
            ["model", "reason"],
            registry=r,
        )
        self.http_errors = Counter(
            "mlxd_http_errors",
            "Errors answered before a request entered the pipeline",
            ["status"],
            registry=r,
        )
        self.prompt_tokens = Counter("mlxd_prompt_tokens", "Prompt tokens", by_model, registry=r)
        self.cached_tokens = Counter(
            "mlxd_cached_prompt_tokens",
            "Prompt tokens served from a prompt cache",
            by_model,
            registry=r,
        )
        self.generation_tokens = Counter(
            "mlxd_generation_tokens", "Generated tokens", by_model, registry=r
        )
        self.ttft = Histogram(
            "mlxd_time_to_first_token_seconds",
            "Arrival to first text",
            by_model,
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "mlxd_inter_token_latency_seconds",
            "Mean gap between a request's tokens",
            by_model,
            buckets=_ITL,
            registry=r,
        )
        self.e2e = Histogram(
            "mlxd_e2e_request_latency_seconds",
            "Arrival to last event",
            by_model,
            buckets=_E2E,
            registry=r,
        )
        self.queue_time = Histogram(
            "mlxd_queue_time_seconds",
            "Arrival to the start of prefill",
            by_model,
            buckets=_LATENCY,
            registry=r,
        )
        self.prompt_total = self.cached_total = 0
        self.started = time.monotonic()

    def watch(self, live: Callable[[], Live]) -> None:
        """Read ``live()`` (gauges) whenever the registry is collected."""
        self.registry.register(_LiveCollector(live, self))

    def request_done(self, trace: RequestTrace) -> None:
        model = trace.model
        self.requests.labels(model, str(trace.status), trace.finish_reason or "").inc()
        if trace.code in REJECTIONS:
            self.rejected.labels(model, trace.code).inc()
        elif trace.code:
            self.failed.labels(model, trace.code).inc()
        self.prompt_tokens.labels(model).inc(trace.prompt_tokens)
        self.cached_tokens.labels(model).inc(trace.cached_tokens)
        self.generation_tokens.labels(model).inc(trace.completion_tokens)
        self.prompt_total += trace.prompt_tokens
        self.cached_total += trace.cached_tokens
        self._observe_latencies(trace)
        request_log.info(trace.log_line())

    def _observe_latencies(self, trace: RequestTrace) -> None:
        model = trace.model
        if trace.ttft is not None:
            self.ttft.labels(model).observe(trace.ttft)
        if trace.inter_token is not None:
            self.itl.labels(model).observe(trace.inter_token)
        if trace.started_at is not None:
            self.queue_time.labels(model).observe(trace.started_at - trace.start)
        if trace.end is not None and trace.status == 200:
            self.e2e.labels(model).observe(trace.end - trace.start)

    def http_error(self, status: int) -> None:
        self.http_errors.labels(str(status)).inc()

    @property
    def hit_rate(self) -> float:
        return self.cached_total / self.prompt_total if self.prompt_total else 0.0

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


class _LiveCollector(Collector):
    """Gauges (and engine counters) read from the live state at scrape time."""

    def __init__(self, live: Callable[[], Live], telemetry: Telemetry):
        self.live, self.telemetry = live, telemetry

    def collect(self) -> Iterator[Metric]:
        live = self.live()
        s = live.engine
        yield _gauge("mlxd_requests_running", "Requests past admission", live.admission.running)
        yield _gauge(
            "mlxd_requests_waiting", "Requests in the admission queue", live.admission.waiting
        )
        loaded = [(m.id, m.engine) for m in live.models if m.engine is not None]
        yield from _engine_metrics(loaded)
        yield from _model_metrics(live.models)
        yield _gauge("mlxd_memory_active_bytes", "Device memory in use (MLX)", s.memory_active)
        yield _gauge("mlxd_memory_peak_bytes", "Peak device memory (MLX)", s.memory_peak)
        yield _gauge(
            "mlxd_cache_hit_rate", "Cached ÷ prompt tokens, since start", self.telemetry.hit_rate
        )
        for model, stats in loaded:
            yield from _spec_metrics(model, stats.counters.speculative)
        yield from _prefix_metrics(loaded)
        yield _gauge(
            "mlxd_ready", "1 when serving, 0 when loading or draining", float(live.state == "ready")
        )


_ENGINE_GAUGES = (
    ("mlxd_batch_size", "Sequences in the last decode step", "batch_size"),
    ("mlxd_kv_reserved_bytes", "Estimated KV/state of running sequences", "kv_reserved"),
    ("mlxd_kv_budget_bytes", "Memory budget for KV/state (0: none)", "kv_budget"),
    ("mlxd_preempted_requests", "Requests out of the batch for memory now", "preempted"),
)
_ENGINE_COUNTERS = (
    ("mlxd_decode_steps", "Decode steps (from the model's last load)", "decode_steps"),
    (
        "mlxd_batch_tokens",
        "Sum of decode batch sizes (÷ decode steps = mean batch)",
        "batch_tokens_total",
    ),
    ("mlxd_failed_steps", "Decode steps that failed (their requests failed)", "failed_steps"),
    ("mlxd_preemptions", "Rows taken out of the batch to stay in the memory budget", "preemptions"),
    ("mlxd_resumes", "Preempted rows brought back into the batch", "resumes"),
    ("mlxd_preempted_bytes", "Bytes of the snapshots preempted rows left", "preempted_bytes"),
    ("mlxd_preempted_seconds", "Seconds rows spent preempted", "preempted_seconds"),
)


_DISK_COUNTERS = (
    ("writes", "Snapshots written to the disk tier"),
    ("reads", "Snapshots read back from the disk tier"),
    ("evictions", "Disk-tier files deleted to stay within prefix_cache.disk_max_bytes"),
    ("corrupt_removed", "Disk-tier files deleted because a checksum, length or header was wrong"),
    ("torn_removed", "Disk-tier files a crash left half-written, deleted at start-up"),
    ("incompatible_removed", "Disk-tier files of another model, template, kv_bits or format"),
    ("spills_dropped", "Snapshots not written: disk writes off or the write queue full"),
    ("coalesced", "Snapshots not written: a longer one of the conversation, queued after, serves"),
    ("block_writes", "Attention-KV block files written (each token block once)"),
    ("bytes_written", "Bytes of snapshot and block files written to the disk tier"),
)


def _prefix_metrics(loaded: list[tuple[str, EngineStats]]) -> Iterator[Metric]:
    """The prefix cache per model and tier (ram, disk), and the disk tier's files."""
    hits = CounterMetricFamily(
        "mlxd_prefix_cache_hits", "Prefix-cache hits by tier", labels=["model", "tier"]
    )
    held = GaugeMetricFamily(
        "mlxd_prefix_cache_bytes", "Bytes of snapshots held by tier", labels=["model", "tier"]
    )
    entries = GaugeMetricFamily(
        "mlxd_prefix_cache_entries", "Snapshots held by tier", labels=["model", "tier"]
    )
    evictions = CounterMetricFamily(
        "mlxd_prefix_cache_ram_evictions", "Snapshots evicted from RAM", labels=["model"]
    )
    disk = None
    for model, s in loaded:
        c = s.counters.prefix_cache
        if c is None:
            continue
        hits.add_metric([model, "ram"], c.hits - c.disk_hits)
        hits.add_metric([model, "disk"], c.disk_hits)
        held.add_metric([model, "ram"], c.bytes)
        entries.add_metric([model, "ram"], c.entries)
        evictions.add_metric([model], c.evictions)
        disk = disk or c.disk
    if disk is not None:  # one store for every model
        held.add_metric(["", "disk"], disk.bytes)
        entries.add_metric(["", "disk"], disk.entries)
    yield from (hits, held, entries, evictions)
    if disk is not None:
        yield _gauge("mlxd_prefix_cache_disk_max_bytes", "The disk tier's budget", disk.max_bytes)
        yield _gauge("mlxd_prefix_cache_disk_writable", "0: disk writes off", disk.writable)
        yield _gauge("mlxd_prefix_cache_disk_blocks", "Attention-KV block files held", disk.blocks)
        for name, doc in _DISK_COUNTERS:
            yield CounterMetricFamily(f"mlxd_prefix_cache_disk_{name}", doc, getattr(disk, name))


def _engine_metrics(loaded: list[tuple[str, EngineStats]]) -> Iterator[Metric]:
    """Each loaded model's engine snapshot, labelled ``model``."""
    engine = GaugeMetricFamily(
        "mlxd_engine_requests", "Requests in the engine", labels=["model", "state"]
    )
    for model, s in loaded:
        for state, n in (
            ("waiting", s.waiting),
            ("prefilling", s.prefilling),
            ("decoding", s.decoding),
        ):
            engine.add_metric([model, state], n)
    yield engine
    for name, doc, attr in _ENGINE_GAUGES:
        family = GaugeMetricFamily(name, doc, labels=["model"])
        for model, s in loaded:
            family.add_metric([model], getattr(s, attr))
        yield family
    for name, doc, attr in _ENGINE_COUNTERS:
        counter = CounterMetricFamily(name, doc, labels=["model"])
        for model, s in loaded:
            counter.add_metric([model], getattr(s, attr))
        yield counter


def _model_metrics(models: list[wire.ServedModel]) -> Iterator[Metric]:
    """Each served model's load state, loads, unloads, last load time and weights."""
    loaded = GaugeMetricFamily("mlxd_model_loaded", "1 while the model is loaded", labels=["model"])
    loads = CounterMetricFamily("mlxd_model_loads", "Times the model loaded", labels=["model"])
    unloads = CounterMetricFamily("mlxd_model_unloads", "Times it unloaded", labels=["model"])
    seconds = GaugeMetricFamily(
        "mlxd_model_load_seconds", "How long its last load took", labels=["model"]
    )
    weights = GaugeMetricFamily(
        "mlxd_model_weights_bytes", "Its weights, measured at its last load", labels=["model"]
    )
    for m in models:
        loaded.add_metric([m.id], float(m.state == "loaded"))
        loads.add_metric([m.id], m.loads)
        unloads.add_metric([m.id], m.unloads)
        seconds.add_metric([m.id], m.last_load_s)
        weights.add_metric([m.id], m.weights_bytes)
    yield from (loaded, loads, unloads, seconds, weights)


def _spec_metrics(model: str, stats: SpeculativeCounters | None) -> Iterator[Metric]:
    """A model's speculation counters (nothing when speculation is not configured)."""
    if stats is None:
        return
    label = [model, stats.drafter or "none"]
    for name, doc, value in (
        ("mlxd_spec_drafted_tokens", "Draft tokens proposed", stats.drafted),
        ("mlxd_spec_accepted_tokens", "Draft tokens the target accepted", stats.accepted),
        ("mlxd_spec_steps", "Speculative (verify) decode steps", stats.steps),
        (
            "mlxd_spec_plain_steps",
            "Decode steps without drafts (batch too large)",
            stats.plain_steps,
        ),
    ):
        family = CounterMetricFamily(name, doc, labels=["model", "drafter"])
        family.add_metric(label, value)
        yield family
    rate = GaugeMetricFamily(
        "mlxd_spec_acceptance_rate",
        "Accepted ÷ drafted tokens, since start",
        labels=["model", "drafter"],
    )
    rate.add_metric(label, stats.acceptance_rate)
    yield rate


# ---- /v1/status ---------------------------------------------------------------------------


def status_snapshot(live: Live, t: Telemetry, settings: Settings, now: float) -> wire.Status:
    """A snapshot of the server for ``/v1/status``; ``now`` on the sessions' (trio) clock."""
    s, c = live.engine, live.engine.counters
    running, waiting = [], []
    for trace, queued in live.requests:
        row = _request_row(trace, "queued" if queued else None, now)
        (running if row.state == "running" else waiting).append(row)
    return wire.Status(
        state=live.state,
        uptime_s=round(time.monotonic() - t.started, 3),
        model=live.model,
        models=live.models,
        adapters=live.adapters,
        requests=wire.RequestsStatus(running=running, waiting=waiting),
        admission=live.admission,
        engine=s,
        memory=wire.MemoryStatus(
            active_bytes=s.memory_active,
            peak_bytes=s.memory_peak,
            kv_reserved_bytes=s.kv_reserved,
            kv_budget_bytes=s.kv_budget,
            kv_bytes_per_token=live.kv_bytes_per_token,
            state_bytes_per_request=live.state_bytes,
        ),
        cache=_cache(t, c.prefix_cache),
        speculative=[] if c.speculative is None else [c.speculative],  # one per drafter
        spec_prefill=c.spec_prefill,
        settings=settings_summary(settings),
    )


def _cache(t: Telemetry, prefix: PrefixCacheCounters | None) -> wire.CacheStatus:
    counters = {}
    if prefix is not None:  # its own cached_tokens: the requests' total stands in its place
        counters = msgspec.structs.asdict(prefix) | {"enabled": True}
        del counters["cached_tokens"]
    return wire.CacheStatus(
        prompt_tokens=t.prompt_total, cached_tokens=t.cached_total, hit_rate=t.hit_rate, **counters
    )


def _request_row(trace: RequestTrace, state: str | None, now: float) -> wire.RequestStatus:
    return wire.RequestStatus(
        id=trace.request_id,
        model=trace.model,
        state=state or ("running" if trace.started_at is not None else "waiting"),
        age_s=round(now - trace.start, 3),
        prompt_tokens=trace.prompt_tokens,
        cached_tokens=trace.cached_tokens,
        generated_tokens=trace.completion_tokens,
    )


def settings_summary(settings: Settings) -> dict:
    """The settings that shape serving (never the API keys)."""
    a, e = settings.admission, settings.engine
    return {
        "admission": msgspec.to_builtins(a),
        "engine": msgspec.to_builtins(e),
        "memory": msgspec.to_builtins(settings.memory),
        "server": {
            "max_body_bytes": settings.server.max_body_bytes,
            "cors_origins": settings.server.cors_origins,
        },
        "tokenizer": msgspec.to_builtins(settings.tokenizer),
        "speculative": msgspec.to_builtins(settings.speculative),
        "spec_prefill": msgspec.to_builtins(settings.spec_prefill),
        "model_pool": msgspec.to_builtins(settings.model_pool),
        "auth": {"enabled": bool(settings.auth.api_keys or settings.auth.api_key_file)},
    }
