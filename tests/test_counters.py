"""One type per counter set, from the engine to the wire.

The prefix cache, the speculative batch and SpecPrefill count into the msgspec structs
of ``protocol/messages.py``; the engine publishes copies of those same structs and
``/v1/status`` encodes them as they are (``/v1/cache``, ``/v1/speculative`` and
``/metrics`` read them too: ``tests/test_http.py``, ``tests/test_speculative.py``).
"""

from __future__ import annotations

import typing

from mlxd.protocol import status as wire
from mlxd.protocol.messages import (
    PrefixCacheCounters,
    RunnerCounters,
    SpecPrefillCounters,
    SpeculativeCounters,
)


def test_the_engine_counts_into_the_types_the_wire_encodes():
    from mlxd.actors.engine.runner.base import MlxRunner
    from mlxd.actors.engine.runner.prefix_cache import PrefixCache
    from mlxd.actors.engine.speculative.batch import SpeculativeBatch
    from mlxd.actors.engine.speculative.spec_prefill import SpecPrefill

    assert typing.get_type_hints(PrefixCache)["stats"] is PrefixCacheCounters
    assert typing.get_type_hints(SpecPrefill)["stats"] is SpecPrefillCounters
    init = typing.get_type_hints(SpeculativeBatch.__init__)
    assert init["stats"] is SpeculativeCounters
    runner = typing.get_type_hints(MlxRunner)
    assert runner["spec_stats"] == SpeculativeCounters | None
    assert runner["spec_prefill_stats"] == SpecPrefillCounters | None
    published = typing.get_type_hints(RunnerCounters)
    assert published["prefix_cache"] == PrefixCacheCounters | None
    assert published["speculative"] == SpeculativeCounters | None
    status = typing.get_type_hints(wire.Status)
    assert status["speculative"] == list[SpeculativeCounters]
    assert status["spec_prefill"] == SpecPrefillCounters | None
    assert PrefixCache(block_size=4, max_bytes=100).stats.max_bytes == 100


def test_counting_keeps_the_acceptance_rate():
    stats = SpeculativeCounters(drafter="d", enabled=True)
    stats.count(drafted=4, accepted=3, emitted=5)
    stats.count(drafted=4, accepted=1, emitted=2)
    stats.plain_steps += 1
    assert (stats.steps, stats.drafted, stats.accepted, stats.emitted) == (2, 8, 4, 7)
    assert stats.acceptance_rate == 0.5
    stats.reset()
    assert (stats.steps, stats.plain_steps, stats.drafted, stats.acceptance_rate) == (0, 0, 0, 0.0)
    assert stats.drafter == "d" and stats.enabled


def test_published_copies_do_not_follow_the_live_counters():
    from mlxd.actors.engine.runner.base import _copy

    live = SpeculativeCounters(drafter="d", enabled=True, notes=("a",))
    published = _copy(live)
    live.count(drafted=2, accepted=2, emitted=3)
    assert published == SpeculativeCounters(drafter="d", enabled=True, notes=("a",))
    assert _copy(None) is None
