"""``mlxd serve --parallel`` under ``mlx.launch``: one model over the ranks of a group.

Rank 0 is the daemon (HTTP and every actor); its runner is a ``replica.Leader`` and
a monitor task watches the other ranks (``actors/engine/distributed/watch.py``). Every
other rank only follows: it loads the same model the same way, sharded the same
way, and replays rank 0's runner calls on its one thread (``replica.follow``).

Start-up, on every rank alike: join the group, compare the model's and the
settings' fingerprints (a mismatch is a start-up error on every rank), load and
shard (``tensor``, ``pipeline``, or ``auto``: tensor when the model can and its
heads divide, else pipeline; a model that can do neither is refused), seed MLX's
random state with one shared draw. Speculative decoding and SpecPrefill stay off
(every rank would have to draft and score in step); /v1/status says so.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from typing import Any

import msgspec
import trio
from mlxd.actors.engine.distributed.watch import EXIT_PEER_LOST, Watch, monitor
from mlxd.actors.engine.scheduler.options import LoadOptions
from mlxd.daemon.pipeline import Pipeline, ServerState
from mlxd.daemon.settings import DistributedSettings, Settings
from mlxd.daemon.supervisor import load_options
from mlxd.daemon.supervisor import serve as serve_forever
from mlxd.protocol.messages import Failed, SpecPrefillCounters, SpeculativeCounters

log = logging.getLogger("mlxd.distributed")

_SPEC_OFF = "off: not served over several ranks (every rank would have to draft in step)"
_SPEC_PREFILL_OFF = "off: not served over several ranks (every rank would have to score)"


def serve(settings: Settings) -> int:
    """Serve (rank 0) or follow (the other ranks); the process's exit status."""
    import mlx.core as mx

    group = mx.distributed.init()
    if group.size() == 1:
        log.warning(
            "distributed.parallel = %s, but this process is no rank of a group "
            "(start it with mlx.launch): serving alone",
            settings.distributed.parallel,
        )
        trio.run(serve_forever, settings)
        return 0
    if settings.models:
        raise ValueError("serving over several ranks takes one model: [model], not [[models]]")
    if settings.model_pool.idle_unload_s > 0:
        raise ValueError(
            "serving over several ranks keeps its model loaded: set model_pool.idle_unload_s = 0"
        )
    if group.rank() == 0:
        return _lead(settings, group)
    return _follow(settings, group)


def _lead(settings: Settings, group: Any) -> int:
    watch, loads = Watch(), []

    def factory():
        from mlxd.actors.engine.distributed.replica import Channel, Leader, Timeouts, runner_stream

        if loads:  # the other ranks follow the first load's runner: a second would desync
            raise ValueError("a model served over several ranks is loaded once, not again")
        loads.append(1)
        runner, info = _load(settings, group, leader=True)
        d = settings.distributed
        timeouts = Timeouts(step_s=d.step_timeout_s, prefill_s=d.prefill_timeout_s)
        channel = Channel(group, runner_stream(runner))
        return Leader(runner, channel, watch, timeouts), info

    watching = functools.partial(_watch, watch, settings.distributed)
    trio.run(serve_forever, settings, factory, watching)
    return 0


def _follow(settings: Settings, group: Any) -> int:
    from mlxd.actors.engine.distributed.replica import Channel, follow, runner_stream

    runner, _ = _load(settings, group, leader=False)
    log.info("rank %d of %d: following rank 0", group.rank(), group.size())
    try:
        follow(runner, Channel(group, runner_stream(runner)))
    except RuntimeError as exc:  # a collective failed: rank 0 (or a peer) is gone
        log.error("rank %d: the group is gone (%s); exiting", group.rank(), exc)
        return EXIT_PEER_LOST
    return 0


def _load(settings: Settings, group: Any, *, leader: bool):
    """This rank's runner: fingerprints compared, the model loaded and sharded, seeded."""
    from mlxd.actors.engine.distributed import replica
    from mlxd.actors.engine.loading.load import load_served, resolve_model_dir

    s, options = settings, rank_options(settings)
    _, model_dir = resolve_model_dir(
        options.path, options.cache_dir, log.info, dequantize_on_cpu=options.dequantize_on_cpu
    )
    fingerprints = {"model": replica.model_fingerprint(model_dir), "settings": _settings_of(s)}
    replica.check_same(group, fingerprints)
    runner, info = load_served(options, replica.sharder(s.distributed.parallel, group))
    replica.lockstep_cache(runner, group, leader=leader)
    seed = replica.shared_seed(group)
    runner.share_seed(seed)  # a row guard's re-seed must be the same on every rank too
    log.info("rank %d: model loaded and sharded; random seed %d", group.rank(), seed)
    if s.speculative.enabled:
        runner.spec_stats = SpeculativeCounters(notes=(_SPEC_OFF,))
    if s.spec_prefill.enabled:
        runner.spec_prefill_stats = SpecPrefillCounters(notes=(_SPEC_PREFILL_OFF,))
    return runner, info


def rank_options(settings: Settings) -> LoadOptions:
    """The served model's load options (``supervisor.load_options``), less what every rank
    would have to do in step (drafting, scoring) and one prefill stream: collectives on
    two streams could run in different orders per rank."""
    options = load_options(settings)
    return dataclasses.replace(options, speculative=None, spec_prefill=None, prefill_streams=1)


def _settings_of(s: Settings) -> bytes:
    """The settings every rank must share: those that shape the replayed runner calls."""
    shared = {
        "parallel": s.distributed.parallel,
        "model": {"kind": s.model.kind, "dequantize_on_cpu": s.model.dequantize_on_cpu},
        "max_batch": s.engine.max_batch,
        "prefix_cache": msgspec.to_builtins(s.prefix_cache),
    }
    return json.dumps(shared, sort_keys=True).encode()


async def _watch(watch: Watch, options: DistributedSettings, pipeline: Pipeline) -> None:
    """The supervisor's monitor task: on a lost rank, 503 to every open request, then exit."""

    def fail_all(reason: str) -> int:
        pipeline.state = ServerState.DRAINING  # new requests get a 503 too
        return pipeline.mailboxes.fail_all(functools.partial(_lost, reason))

    await monitor(watch, fail_all, exit_grace_s=options.exit_grace_s)


def _lost(reason: str, request_id: str) -> Failed:
    return Failed(
        request_id=request_id,
        reason="shutting_down",
        message=f"the group of machines serving this model broke ({reason}); the server is exiting",
    )
