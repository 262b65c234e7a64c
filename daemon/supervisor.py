"""The supervisor: every actor, every channel and its buffer, started in order.

    HTTP ──Admit/Release──▶ admission ──▶ tokenizer ──Submit──▶ engine ──EngineStep──▶ streamer
      ▲         (max_waiting)         (1)           (max_running)    (engine_outbox)      │
      └──────────────────────────── mailboxes (merge, never block) ◀─────────────────────┘
    HTTP ──Abort (session close)──▶ engine ◀──Abort (stop string)── streamer
    pipeline.expire (queue timeout, deadline) ──Failed──▶ mailboxes
    mailbox final event ──▶ pipeline.release_ended ──Abort/Release──▶ engine, admission
    engine ──EngineStats (each step)──▶ pipeline.engine_stats ◀── /metrics, /v1/status

The HTTP server starts first (``/health`` answers 503 while the model loads);
the engine starts next, and ``nursery.start`` returns once the model is loaded;
then the streamer, tokenizer and admission controller. SIGTERM/SIGINT switch to
draining: new requests get 503, in-flight ones get ``drain_timeout_s`` to end,
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
from hypercorn.trio import serve as hypercorn_serve
from mlxd.actors import admission, streamer, tokenizer
from mlxd.actors.admission import AdmissionOptions, AdmissionPolicy
from mlxd.actors.engine import actor as engine
from mlxd.actors.engine.actor import EngineOptions, Publish, RunnerFactory
from mlxd.actors.engine.options import (
    MemoryOptions,
    PrefixCacheOptions,
    SpecPrefillOptions,
    SpeculativeOptions,
)
from mlxd.actors.grammar import GrammarCompiler
from mlxd.actors.mailbox import Mailboxes
from mlxd.actors.streamer import StreamState
from mlxd.actors.tokenizer import PromptBuilder, TokenizerOptions
from mlxd.actors.vision import ImageLimits
from mlxd.daemon.app import create_app
from mlxd.daemon.pipeline import Pipeline, ServerState, Timeouts
from mlxd.daemon.settings import (
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


def mlx_runner_factory(settings: Settings) -> RunnerFactory:
    """Loads the real model; runs on the generation thread (imports MLX there)."""
    s, m = settings, settings.model
    features = {
        "prefix_cache": feature_options(s.prefix_cache, PrefixCacheOptions),
        "memory": options_from(s.memory, MemoryOptions),
        "speculative": feature_options(s.speculative, SpeculativeOptions),
        "spec_prefill": feature_options(s.spec_prefill, SpecPrefillOptions),
    }

    def factory():
        from mlxd.actors.engine.loading import load_runner

        return load_runner(
            m.path,
            Path(m.cache_dir).expanduser(),
            dequantize_on_cpu=m.dequantize_on_cpu,
            max_batch=s.engine.max_batch,
            kind=m.kind,
            **features,
        )

    return factory


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


def tokenizer_options(s: Settings) -> TokenizerOptions:
    return TokenizerOptions(
        workers=s.tokenizer.workers,
        default_max_tokens=s.engine.default_max_tokens,
        max_prompt_tokens=s.engine.max_prompt_tokens,
        checkpoints=s.prefix_cache.enabled and s.prefix_cache.system_prompt,
        tool_format=s.tokenizer.tool_format,
        reasoning_tags=s.tokenizer.reasoning_tags,
        image_limits=options_from(s.vision, ImageLimits),
        chat_template=s.model.chat_template_text(),
    )


def engine_options(s: Settings, publish: Publish) -> EngineOptions:
    return EngineOptions(
        max_batch=s.engine.max_batch,
        prefill_chunk_tokens=s.engine.prefill_chunk_tokens,
        retry_after_s=s.admission.retry_after_s,
        release_after_idle_s=s.memory.release_after_idle_s,
        publish=publish,
    )


async def run_actors(
    graph: Graph,
    settings: Settings,
    factory: RunnerFactory,
    *,
    monitor: Monitor | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Start the actors in dependency order; ``started`` once the model is loaded.

    ``monitor``: a task watching something outside the graph (the other ranks of a
    distributed group, ``daemon/ranks.py``) that may fail every open request."""
    s, pipeline, mailboxes = settings, graph.pipeline, graph.pipeline.mailboxes
    options = engine_options(s, pipeline.publish)
    async with trio.open_nursery() as nursery:
        if monitor is not None:
            nursery.start_soon(monitor, pipeline)
        info = await nursery.start(engine.run, graph.engine[1], graph.steps[0], factory, options)
        pipeline.info = info
        state = StreamState(info.tokenizer, mailboxes)
        await nursery.start(streamer.run, graph.steps[1], graph.engine[0].clone(), state)
        # Reading the vocabulary into llguidance takes a moment: not on the trio thread.
        grammars = await trio.to_thread.run_sync(GrammarCompiler, info.tokenizer)
        prompts = tokenizer_options(s)
        builder = pipeline.builder = PromptBuilder.for_model(info, prompts, grammars)
        pipeline.count_limiter = trio.CapacityLimiter(prompts.workers)
        tokenizer_channels = (graph.tokenize[1], graph.engine[0], mailboxes)
        await nursery.start(tokenizer.run, *tokenizer_channels, builder, prompts)
        queue = options_from(s.admission, AdmissionOptions)
        policy = pipeline.policy = AdmissionPolicy.from_options(queue)
        admission_channels = (graph.admission_rx, graph.tokenize[0], mailboxes)
        await nursery.start(admission.run, *admission_channels, policy, queue)
        # Frees a request's slot when its final event arrives, read or not.
        await nursery.start(pipeline.release_ended)
        # Queue timeouts and deadlines, for every request wherever it is.
        await nursery.start(pipeline.expire)
        pipeline.state = ServerState.READY
        log.info(
            "ready: serving %s (%s model, backend %s, context %d)",
            info.model_id,
            info.kind,
            info.backend,
            info.context_length,
        )
        task_status.started()


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
    config: HypercornConfig,
    stop: trio.Event,
    done: trio.Event,
    *,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    try:
        await hypercorn_serve(app, config, shutdown_trigger=stop.wait, task_status=task_status)
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
    return config


async def serve(
    settings: Settings, factory: RunnerFactory | None = None, monitor: Monitor | None = None
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
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            app = create_app(graph.pipeline, settings)
            await nursery.start(_serve_http, app, config, stop_http, http_done)
            log.info("listening on http://%s (loading the model)", config.bind[0])
            actors = trio.CancelScope()
            nursery.start_soon(_run_in_scope, actors, graph, settings, factory, monitor)
            async for signum in signals:
                log.info("received %s", signal.Signals(signum).name)
                break
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
    with scope:
        factory = factory or mlx_runner_factory(settings)
        await run_actors(graph, settings, factory, monitor=monitor)
