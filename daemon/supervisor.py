"""The supervisor: every actor, every channel and its buffer, started in order.

    HTTP ──Admit/Release──▶ admission ──▶ tokenizer ──Submit──▶ engine ──EngineStep──▶ streamer
      ▲         (max_waiting)         (1)           (max_running)    (engine_outbox)      │
      └──────────────────────────── mailboxes (merge, never block) ◀─────────────────────┘
    HTTP ──Abort (session close)──▶ engine ◀──Abort (stop string)── streamer
    tokenizer ──Load (model not loaded)──▶ engine ──EngineNews (model events)──▶ registry
    HTTP ──UnloadAdapter (POST /v1/unload_lora_adapter)──▶ engine
    pipeline.expire (queue timeout, deadline) ──Failed──▶ mailboxes
    mailbox final event ──▶ pipeline.release_ended ──Abort/Release──▶ engine, admission
    engine ──EngineNews (stats per model, each step)──▶ pipeline ◀── /metrics, /v1/status

The HTTP server starts first (``/health`` answers 503 while the model loads);
the engine starts next, and ``nursery.start`` returns once the preloaded models
(``[model]``, or ``[[models]]`` entries with ``preload``) are loaded and warmed up
(``engine.warmup``); the others load, and warm up, on first use. Then the model registry, the streamer, tokenizer and
admission controller. SIGHUP (``launchctl kill HUP``, a closed terminal, a log
rotator) re-reads the API key file, and serving goes on. SIGTERM/SIGINT switch
to draining: ``/health`` answers 503 "draining" at once, requests are still admitted
for ``drain_notice_s`` (a router moves them away meanwhile), then new requests get
503, in-flight ones get ``drain_timeout_s`` to end,
and those still open then end with a 503 error (an error event in a stream).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, TypeVar

import msgspec
import trio
from hypercorn.config import Config as HypercornConfig
from hypercorn.config import Sockets
from mlxd.actors import admission, streamer, tokenizer
from mlxd.actors.admission import AdmissionOptions, AdmissionPolicy
from mlxd.actors.engine import actor as engine
from mlxd.actors.engine.actor import (
    EngineOptions,
    ModelSpec,
    PoolLimits,
    Publish,
    RunnerFactory,
)
from mlxd.actors.engine.runner.disk_tier import DiskStore, adapter_slug, slug
from mlxd.actors.engine.scheduler.options import (
    DiskTierOptions,
    EmbeddingOptions,
    LoadOptions,
    MemoryOptions,
    PrefixCacheOptions,
    SpecPrefillOptions,
    SpeculativeOptions,
)
from mlxd.actors.mailbox import Mailboxes
from mlxd.actors.models import ModelRegistry, RegistryOptions, StreamStates
from mlxd.actors.tokenizer import TokenizerOptions
from mlxd.actors.vision import ImageLimits
from mlxd.daemon.app import DRAIN_NOTICE, create_app, reload_api_keys
from mlxd.daemon.history import History
from mlxd.daemon.hypercorn_serve import Connections
from mlxd.daemon.hypercorn_serve import serve as http_serve
from mlxd.daemon.pipeline import Pipeline, ServerState, Timeouts
from mlxd.daemon.settings import (
    ModelEntry,
    PrefixCacheSettings,
    Settings,
    SpecPrefillSettings,
    SpeculativeSettings,
)
from mlxd.protocol.messages import AdmissionInbox, AdmittedRequest, EngineInbox, EngineStep, Failed

log = logging.getLogger("mlxd")
_Options = TypeVar("_Options")
Feature = PrefixCacheSettings | SpeculativeSettings | SpecPrefillSettings
Monitor = Callable[[Pipeline], Awaitable[None]]


def options_from(section: msgspec.Struct, kind: type[_Options]) -> _Options:
    """Options (a dataclass) from the settings section they mirror, field by field."""
    fields = dataclasses.fields(kind)  # type: ignore[arg-type]
    return kind(**{f.name: getattr(section, f.name) for f in fields})


def feature_options(section: Feature, kind: type[_Options]) -> _Options | None:
    """A feature's options; None where its section says ``enabled = false``."""
    return options_from(section, kind) if section.enabled else None


def load_options(
    settings: Settings, entry: ModelEntry | None = None, disk: DiskStore | None = None
) -> LoadOptions:
    """How one served model (the first entry unless named) loads: the one mapping of the
    settings onto the loader, for ``serve``, the ranks of ``serve --parallel``
    (``ranks.py``) and ``bench --engine`` (``bench.py``)."""
    s, m = settings, settings.model
    e = entry or settings.model_entries()[0]
    return LoadOptions(
        path=e.path,
        cache_dir=Path(m.cache_dir).expanduser(),
        dequantize_on_cpu=m.dequantize_on_cpu,
        max_batch=e.max_batch or s.engine.max_batch,
        kind=e.kind,
        adapter_path=Path(e.adapter_path).expanduser() if e.adapter_path else None,
        max_adapters=e.max_adapters or m.max_adapters,
        adapter_memory_bytes=(e.adapter_memory_mb or m.adapter_memory_mb) << 20,
        prefill_streams=prefill_streams(s),
        chunked_linear_attention=auto_or(s.engine.chunked_linear_attention),
        # the limit is part of the "auto" choice: true batches every row, false none
        batch_prefill=auto_or(s.engine.batch_prefill),
        batch_prefill_max_context=auto_value(s.engine.batch_prefill_max_context)
        if s.engine.batch_prefill == "auto"
        else None,
        kv_bits=s.engine.kv_bits,
        kv_group_size=s.engine.kv_group_size,
        prefix_cache=feature_options(s.prefix_cache, PrefixCacheOptions),
        disk_tier=None if disk is None else disk_tier_options(s, e, disk),
        memory=options_from(s.memory, MemoryOptions),
        speculative=feature_options(e.speculative or s.speculative, SpeculativeOptions),
        spec_prefill=feature_options(e.spec_prefill or s.spec_prefill, SpecPrefillOptions),
        embedding=embedding_options(s, e),
    )


def embedding_options(s: Settings, entry: ModelEntry) -> EmbeddingOptions:
    """An embedding entry's pooling and the engine's batching of its inputs."""
    b = s.embeddings
    return EmbeddingOptions(
        pooling=entry.pooling,
        normalize=b.normalize,
        matryoshka=tuple(entry.matryoshka_dimensions),
        max_input_tokens=b.max_input_tokens,
        max_batch_inputs=b.max_batch_inputs,
        max_batch_tokens=b.max_batch_tokens,
        max_queued_inputs=b.max_queued_inputs,
    )


def disk_store(s: Settings) -> DiskStore | None:
    """The prefix cache's disk tier, shared by every model (None: ``disk_dir`` is empty).
    Its I/O thread starts by rebuilding the index and deleting what is not ours."""
    p = s.prefix_cache
    if not p.enabled or not p.disk_dir:
        return None
    entries = s.model_entries()
    slugs = [disk_slug(e) for e in entries]
    # configured adapters' spaces are kept across restarts too (an adapter loaded through
    # the API is not configured: its files go at the next start)
    slugs += [adapter_slug(disk_slug(e), name) for e in entries for name in e.adapters]
    return DiskStore(
        Path(p.disk_dir),
        p.disk_max_bytes,
        slugs,
        max_pending_bytes=p.disk_write_queue_bytes,
        write_behind_s=p.disk_write_behind_s,
        block_tokens=p.disk_block_tokens,
    )


def disk_slug(entry: ModelEntry) -> str:
    return slug(entry.id or entry.path)


def disk_tier_options(s: Settings, entry: ModelEntry, disk: DiskStore) -> DiskTierOptions:
    template = entry.chat_template_text(s.model.chat_template_text())
    return DiskTierOptions(store=disk, slug=disk_slug(entry), chat_template=template)


def mlx_runner_factory(
    settings: Settings, entry: ModelEntry | None = None, disk: DiskStore | None = None
) -> RunnerFactory:
    """Loads one served model (the first entry unless named); runs on the generation
    thread (imports MLX there)."""
    options = load_options(settings, entry, disk)

    def factory():
        from mlxd.actors.engine.loading.load import load_served

        return load_served(options)

    return factory


def prefill_streams(settings: Settings) -> int | None:
    """``engine.prefill_streams`` for ``load_runner`` (None: its automatic choice)."""
    return auto_value(settings.engine.prefill_streams)


def auto_value(value: int | str) -> int | None:
    """A number-or-``"auto"`` setting for the engine (None: the backend table's value,
    ``actors/engine/backend_policy.py``)."""
    return None if value == "auto" else int(value)


def auto_or(value: bool | str) -> bool | None:
    """A ``true / false / "auto"`` setting for the loader (None: its automatic choice)."""
    return None if value == "auto" else bool(value)


def free_mlx_memory() -> None:
    """After a model is unloaded (engine thread): collect its arrays and give MLX's cached
    buffers back."""
    import gc

    import mlx.core as mx

    gc.collect()
    mx.clear_cache()


Factories = RunnerFactory | dict[str, RunnerFactory]


def model_specs(settings: Settings, factories: Factories | None) -> list[ModelSpec]:
    """The engine's models: each entry with its factory (``factories`` by id, or one
    factory for the one entry; None: the real ones)."""
    specs = []
    disk = disk_store(settings) if factories is None else None
    for i, entry in enumerate(settings.model_entries()):
        if factories is None:
            factory = mlx_runner_factory(settings, entry, disk)
        elif isinstance(factories, dict):
            factory = factories[entry.id]
        else:
            assert i == 0, "one factory for several [[models]]: pass them by id"
            factory = factories
        specs.append(ModelSpec(entry.id, factory, entry.max_batch, entry.preload))
    return specs


@dataclass
class Graph:
    """The channels between the actors, opened before any actor runs."""

    pipeline: Pipeline
    admission_rx: trio.MemoryReceiveChannel[AdmissionInbox]
    tokenize: tuple[
        trio.MemorySendChannel[AdmittedRequest], trio.MemoryReceiveChannel[AdmittedRequest]
    ]
    engine: tuple[trio.MemorySendChannel[EngineInbox], trio.MemoryReceiveChannel[EngineInbox]]
    steps: tuple[trio.MemorySendChannel[EngineStep], trio.MemoryReceiveChannel[EngineStep]]


def open_graph(s: Settings) -> Graph:
    # Handlers block briefly here when a burst arrives; admission answers at once.
    admission_tx, admission_rx = trio.open_memory_channel[AdmissionInbox](s.admission.max_waiting)
    engine = trio.open_memory_channel[EngineInbox](s.admission.max_running)
    a = s.admission
    pipeline = Pipeline(
        admission=admission_tx,
        engine=engine[0].clone(),
        mailboxes=Mailboxes(s.streaming.max_unread_bytes),
        timeouts=Timeouts(a.queue_timeout_s, a.request_timeout_s),
        retry_after_s=a.retry_after_s,
        keepalive_s=s.streaming.keepalive_s,
        history=History.from_settings(s.dashboard) if s.dashboard.enabled else None,
    )
    return Graph(
        pipeline=pipeline,
        admission_rx=admission_rx,
        # Admission waits for the tokenizer, which starts a task per request at once.
        tokenize=trio.open_memory_channel[AdmittedRequest](1),
        # Submits and aborts (handlers, streamer, timer); the engine drains it every step.
        engine=engine,
        # A few steps of slack between the engine thread and the streamer.
        steps=trio.open_memory_channel[EngineStep](s.streaming.engine_outbox),
    )


def tokenizer_options(s: Settings, entry: ModelEntry | None = None) -> TokenizerOptions:
    """The prompt builder's options for one served model (the first unless named)."""
    entry = entry or s.model_entries()[0]
    return TokenizerOptions(
        workers=s.tokenizer.workers,
        default_max_tokens=s.engine.default_max_tokens,
        clamp_max_tokens=s.engine.max_tokens_overflow == "clamp",
        max_prompt_tokens=s.engine.max_prompt_tokens,
        checkpoints=s.prefix_cache.enabled and s.prefix_cache.system_prompt,
        max_breakpoints=s.prefix_cache.max_breakpoints if s.prefix_cache.enabled else 0,
        tool_format=entry.tool_format or s.tokenizer.tool_format,
        reasoning_tags=entry.reasoning_tags or s.tokenizer.reasoning_tags,
        image_limits=options_from(s.vision, ImageLimits),
        chat_template=entry.chat_template_text(s.model.chat_template_text()),
        constrain_auto_calls=s.tokenizer.constrain_auto_calls,
        # a lazy call grammar rides on the runner's logits processors, which neither the
        # drafting runner nor the other ranks of a group run
        auto_call_grammars=not _speculates(s, entry) and s.distributed.parallel == "off",
        max_integer_digits=s.tokenizer.max_integer_digits,
        max_fraction_digits=s.tokenizer.max_fraction_digits,
        grammar_cache_size=s.tokenizer.grammar_cache_size,
    )


def engine_options(s: Settings, publish: Publish) -> EngineOptions:
    p = s.model_pool
    return EngineOptions(
        max_batch=s.engine.max_batch,
        prefill_chunk_tokens=auto_value(s.engine.prefill_chunk_tokens),
        prefill_unsplit_tokens=auto_value(s.engine.prefill_unsplit_tokens),
        batch_prefill=auto_or(s.engine.batch_prefill),
        warmup=auto_or(s.engine.warmup),
        warmup_max_batch=auto_value(s.engine.warmup_max_batch),
        retry_after_s=s.admission.retry_after_s,
        release_after_idle_s=s.memory.release_after_idle_s,
        publish=publish,
        limits=PoolLimits(p.max_loaded, p.max_loaded_mb << 20, p.idle_unload_s),
        free_memory=free_mlx_memory,
    )


def registry_options(s: Settings) -> RegistryOptions:
    p = s.model_pool
    return RegistryOptions(
        max_waiting=p.max_waiting,
        load_timeout_s=p.load_timeout_s,
        failed_retry_s=p.failed_retry_s,
        retry_after_s=s.admission.retry_after_s,
    )


async def run_actors(
    graph: Graph,
    settings: Settings,
    factory: Factories | None = None,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start the actors in dependency order; ``started`` once the preloaded models are
    loaded. ``factory``: one per model id, or one for the one model; None: the real ones."""
    s, pipeline, mailboxes = settings, graph.pipeline, graph.pipeline.mailboxes
    options, specs = engine_options(s, pipeline.publish), model_specs(s, factory)
    prompts = [tokenizer_options(s, entry) for entry in s.model_entries()]  # files read now
    async with trio.open_nursery() as nursery:
        infos = await nursery.start(engine.run, graph.engine[1], graph.steps[0], specs, options)
        # A preloaded model with no id took its own name: the engine's ids are final.
        ids = [spec.id or next(iter(infos)) for spec in specs]
        models = pipeline.models = ModelRegistry(
            ids,
            graph.engine[0].clone(),
            mailboxes,
            dict(zip(ids, prompts, strict=True)),
            registry_options(s),
            accept_other_ids=s.model.accept_other_ids,
            kinds={i: e.kind for i, e in zip(ids, s.model_entries(), strict=True)},
            adapters={i: e.adapters for i, e in zip(ids, s.model_entries(), strict=True)},
        )
        pipeline.speculative = {
            i: _speculates(s, e) for i, e in zip(ids, s.model_entries(), strict=True)
        }
        for event in pipeline.early_events:  # the preloaded models' loads
            models.on_event(event)
        for model in infos:  # their grammar compilers read the vocabulary (a worker thread)
            if models.entries[model].kind != "embedding":  # which builds no prompts
                await models.builder(models.entries[model])
        steps = StreamStates(models)
        await nursery.start(streamer.run, graph.steps[1], graph.engine[0].clone(), steps)
        pipeline.count_limiter = trio.CapacityLimiter(prompts[0].workers)
        tokenizer_channels = (graph.tokenize[1], graph.engine[0], mailboxes)
        await nursery.start(tokenizer.run, *tokenizer_channels, models, prompts[0])
        queue = options_from(s.admission, AdmissionOptions)
        policy = pipeline.policy = AdmissionPolicy.from_options(queue)
        admission_channels = (graph.admission_rx, graph.tokenize[0], mailboxes)
        await nursery.start(admission.run, *admission_channels, policy, queue)
        # Frees a request's slot when its final event arrives, read or not.
        await nursery.start(pipeline.release_ended)
        # Queue timeouts and deadlines, for every request wherever it is.
        await nursery.start(pipeline.expire)
        if pipeline.history is not None:  # the dashboard's samples (dashboard.sample_period_s)
            await nursery.start(pipeline.sample_history)
        pipeline.state = ServerState.READY
        for model, info in infos.items():
            log.info(
                "ready: serving %s (%s model, backend %s, context %d)",
                model,
                info.kind,
                info.backend,
                info.context_length,
            )
        lazy = [i for i in ids if i not in infos]
        if lazy:
            log.info("ready: %s load on first use", ", ".join(lazy))
        task_status.started()


def _speculates(s: Settings, entry: ModelEntry) -> bool:
    """Whether speculation is configured for the entry (its own section, or the global)."""
    return (entry.speculative or s.speculative).enabled


async def drain_notice(app, notice_s: float) -> None:
    """Say "draining" on /health (503) while still admitting for ``notice_s``: a router
    polling it (``mlxd cluster``) sends new requests elsewhere before any is refused."""
    if notice_s > 0:
        app.config[DRAIN_NOTICE] = True
        log.info(
            "draining in %.1fs: /health answers 503 draining, requests still admitted", notice_s
        )
        await trio.sleep(notice_s)


async def drain(pipeline: Pipeline, deadline_s: float) -> None:
    """Stop admitting; give in-flight requests up to ``deadline_s`` to finish.

    Requests still open then end with a 503 ``shutting_down`` failure: an error
    status before the first token, an error event (and ``[DONE]``) in a stream.
    """
    pipeline.state = ServerState.DRAINING
    log.info("draining %d in-flight requests (up to %.0fs)", len(pipeline.mailboxes), deadline_s)
    with trio.move_on_after(deadline_s):
        await pipeline.mailboxes.wait_empty()
    cut = pipeline.mailboxes.fail_all(lambda rid: _cut_off(rid, deadline_s))
    log.info("drained; %d requests cut off", cut)


def _cut_off(request_id: str, deadline_s: float) -> Failed:
    return Failed(
        request_id=request_id,
        reason="shutting_down",
        message=f"the server is shutting down and the request did not finish within "
        f"{deadline_s:g}s (server.drain_timeout_s)",
    )


async def _serve_http(
    app,
    config: HttpConfig,
    stop: trio.Event,
    done: trio.Event,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    connections = Connections(config.max_connections)
    try:
        await http_serve(
            app, config, connections, shutdown_trigger=stop.wait, task_status=task_status
        )
    finally:
        done.set()


class HttpConfig(HypercornConfig):
    """hypercorn's config, whose listening TCP sockets carry ``send_timeout_s``.

    hypercorn shields its socket writes from cancellation, so a response being
    written to a client that reads nothing blocks until the kernel gives up on
    the connection. ``TCP_USER_TIMEOUT`` (Linux; accepted connections inherit
    it) makes the kernel give up once the client has taken no bytes for
    ``send_timeout_s``: the write fails, the handler ends, its sessions close.
    """

    send_timeout_s: float = 0.0
    max_connections: int = 0  # server.max_connections (daemon/hypercorn_serve.py)

    def create_sockets(self) -> Sockets:
        sockets = super().create_sockets()
        option = getattr(socket, "TCP_USER_TIMEOUT", None)
        if option is not None and self.send_timeout_s > 0:
            for sock in sockets.insecure_sockets + sockets.secure_sockets:
                if sock.family in (socket.AF_INET, socket.AF_INET6):
                    sock.setsockopt(socket.IPPROTO_TCP, option, int(self.send_timeout_s * 1000))
        return sockets


def http_config(s: Settings) -> HttpConfig:
    config = HttpConfig()
    config.bind = [f"{s.server.host}:{s.server.port}"]
    config.accesslog = None
    config.graceful_timeout = s.server.flush_timeout_s
    config.backlog = s.server.backlog
    config.send_timeout_s = s.server.send_timeout_s
    config.keep_alive_timeout = s.server.idle_timeout_s  # HTTP/2 ones too: hypercorn_serve.py
    config.max_connections = s.server.max_connections
    # No HTTP/2 stream is accepted (cleartext h2 is only ever a probe here, e.g. a router's
    # gRPC health check): a response streamed to an h2 client that hangs up at once can
    # race hypercorn's close of the socket and end the server (BusyResourceError).
    config.h2_max_concurrent_streams = 0
    return config


async def serve(
    settings: Settings, factory: Factories | None = None, monitor: Monitor | None = None
) -> None:
    """Serve HTTP until SIGTERM/SIGINT, then drain and return.

    Shutdown order: stop admitting (503), wait for in-flight generations (up to
    ``drain_timeout_s``; then they end with a 503 error), let hypercorn finish
    writing open responses (up to ``flush_timeout_s``), and only then cancel
    the actors. A response then still stuck writing to a client that reads
    nothing cannot be cancelled (hypercorn shields the write): the process exits
    without it, well within the service managers' stop timeouts.
    """
    config = http_config(settings)
    graph = open_graph(settings)
    stop_http, http_done = trio.Event(), trio.Event()
    async with trio.open_nursery() as nursery:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            app = create_app(graph.pipeline, settings)
            await nursery.start(_serve_http, app, config, stop_http, http_done)
            log.info("listening on http://%s (loading the model)", config.bind[0])
            actors = trio.CancelScope()
            nursery.start_soon(_run_in_scope, actors, graph, settings, factory, monitor)
            async for signum in signals:
                log.info("received %s", signal.Signals(signum).name)
                if signum != signal.SIGHUP:
                    break
                log.info("SIGHUP: %s; serving on", reload_api_keys(app, settings))
            await drain_notice(app, settings.server.drain_notice_s)
            await drain(graph.pipeline, settings.server.drain_timeout_s)
            stop_http.set()
            # hypercorn returns once open responses are written (flush_timeout_s)
            with trio.move_on_after(settings.server.flush_timeout_s + 1):
                await http_done.wait()
            if not http_done.is_set():
                _exit_past_stuck_writes()
        actors.cancel()


def _exit_past_stuck_writes() -> NoReturn:
    """hypercorn cannot return while a shielded write blocks on a client that reads
    nothing, and nothing can cancel that write: the drain is over, so exit now."""
    log.warning("exiting with responses still blocked on clients that read nothing")
    logging.shutdown()
    os._exit(0)


async def _run_in_scope(
    scope: trio.CancelScope, graph: Graph, settings: Settings, factory, monitor
) -> None:
    """The actors under ``scope``. ``monitor``: a task watching something outside the
    graph (the other ranks of a distributed group, ``daemon/ranks.py``) that may fail
    every open request; it runs outside ``scope`` and keeps watching while the actors
    shut down (a generation thread stuck on a lost rank never returns), until they have."""
    async with trio.open_nursery() as nursery:
        if monitor is not None:
            nursery.start_soon(monitor, graph.pipeline)
        with scope:
            await run_actors(graph, settings, factory)
        nursery.cancel_scope.cancel()
