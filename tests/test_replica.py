"""The distributed leader and follower without a group: a fake channel between them.

What crosses the channel (every state-changing runner call, typed again on the far
side; nothing read-only), what never does (requests the ranks cannot replay), the
prefix caches' lockstep, the choice of sharding, and rank 0's monitor. The real
two-rank runs are in ``tests/test_distributed.py``.
"""

from __future__ import annotations

import random
import time
from types import SimpleNamespace

import numpy as np
import pytest
import trio
from mlxd.actors.engine.distributed.replica import (
    Channel,
    Desync,
    FollowerPrefixCache,
    Leader,
    LeaderPrefixCache,
    Timeouts,
    choose_mode,
    follow,
)
from mlxd.actors.engine.distributed.watch import EXIT_PEER_LOST, Watch, monitor
from mlxd.actors.engine.scheduler.types import Decoded, InvalidRequest
from mlxd.protocol.messages import SamplingParams, TokenizedRequest


class Recorder:
    """A runner that records the calls it gets, with their arguments' types."""

    prefix_cache = None
    decoding = 0

    def __init__(self):
        self.calls: list[tuple] = []

    def start(self, request: TokenizedRequest) -> int:
        self.calls.append(("start", request))
        return 0

    def prefill(self, request_id: str, budget: int) -> int:
        self.calls.append(("prefill", request_id, budget))
        return 0

    def decode(self) -> list:
        self.calls.append(("decode",))
        return []

    def remove(self, request_id: str) -> None:
        self.calls.append(("remove", request_id))

    def prefill_batch(self, request_ids: tuple[str, ...], budget: int) -> int:
        self.calls.append(("prefill_batch", request_ids, budget))  # a method added later
        return 0

    def memory_stats(self) -> tuple[int, int]:
        self.calls.append(("memory_stats",))
        return 1, 2

    def counters(self) -> None:
        self.calls.append(("counters",))

    def skipped_tokens(self, request_id: str) -> int:
        self.calls.append(("skipped_tokens", request_id))
        return 0


class Pipe:
    """A channel in memory; receiving past the end fails like a lost peer."""

    def __init__(self):
        self.sent: list[bytes] = []

    def send(self, payload: bytes) -> None:
        self.sent.append(payload)

    def receive(self) -> bytes:
        if not self.sent:
            raise RuntimeError("[ring] connection to a peer was lost")
        return self.sent.pop(0)


def _request(rid="r1", **extra) -> TokenizedRequest:
    sampling = SamplingParams(max_tokens=4, temperature=0.0)
    return TokenizedRequest(request_id=rid, prompt_tokens=(1, 2, 3), sampling=sampling, **extra)


def test_every_state_changing_call_is_replayed_typed_and_in_order():
    leader_runner, pipe = Recorder(), Pipe()
    leader = Leader(leader_runner, pipe, Watch())
    request = _request()
    assert leader.start(request) == 0
    leader.prefill("r1", 16)
    leader.prefill_batch(("r1", "r2"), 8)
    leader.decode()
    leader.remove("r1")
    assert leader.memory_stats() == (1, 2)  # read-only: rank 0 alone
    leader.counters()
    leader.skipped_tokens("r1")
    assert leader.decoding == 0
    assert len(pipe.sent) == 5

    follower = Recorder()
    with pytest.raises(RuntimeError, match="peer was lost"):
        follow(follower, pipe)
    replayed = [
        ("start", request),
        ("prefill", "r1", 16),
        ("prefill_batch", ("r1", "r2"), 8),
        ("decode",),
        ("remove", "r1"),
    ]
    assert follower.calls == replayed
    assert isinstance(follower.calls[0][1], TokenizedRequest)
    assert leader_runner.calls[:5] == replayed


class Decoding(Recorder):
    def __init__(self, token: int):
        super().__init__()
        self.token = token

    def decode(self) -> list:
        super().decode()
        return [Decoded("r1", self.token, None)]


def test_a_follower_that_decodes_other_tokens_than_rank_0_stops():
    pipe = Pipe()
    leader = Leader(Decoding(7), pipe, Watch())
    leader.decode()
    leader.decode()
    with pytest.raises(Desync, match="before its decode"):
        follow(Decoding(8), pipe)
    pipe = Pipe()
    leader = Leader(Decoding(7), pipe, Watch())
    leader.decode()
    leader.decode()
    with pytest.raises(RuntimeError, match="peer was lost"):  # in step: to the end
        follow(Decoding(7), pipe)


def test_requests_the_ranks_cannot_replay_are_refused_before_any_rank_sees_them():
    pipe = Pipe()
    leader = Leader(Recorder(), pipe, Watch())
    constrained = _request(grammar=object())
    assert leader.wait_for(constrained) is None
    with pytest.raises(InvalidRequest, match="constrained output"):
        leader.start(constrained)
    assert pipe.sent == []


class Lost(Exception):
    pass


def _parked() -> None:
    raise Lost  # the real leader parks its thread here


def test_a_failed_broadcast_marks_the_group_lost():
    class Broken(Pipe):
        def send(self, payload: bytes) -> None:
            raise RuntimeError("[ring] connection to a peer was lost")

    watch = Watch()
    leader = Leader(Recorder(), Broken(), watch, on_lost=_parked)
    with pytest.raises(Lost):
        leader.decode()
    assert "a rank of the group is gone" in (watch.lost or "")
    assert watch.deadline is None


@pytest.mark.parametrize("trimmable_ok", [True, False])
def test_prefix_caches_stay_in_lockstep_through_evictions_refusals_and_clears(trimmable_ok):
    lead = LeaderPrefixCache(block_size=4, max_bytes=100, trimmable_ok=trimmable_ok)
    follower = FollowerPrefixCache(block_size=4, max_bytes=1 << 60, trimmable_ok=trimmable_ok)
    rng = random.Random(0)

    def both(op: str, *args) -> None:
        getattr(lead, op)(*args)
        getattr(follower, op)(*args)
        follower.drop(lead.take_dropped())  # what travels with the next call
        assert set(follower._entries) == set(lead._entries)

    for step in range(200):
        tokens = tuple(rng.randrange(3) for _ in range(rng.randrange(1, 12)))
        match rng.randrange(5):
            case 0 | 1:
                # sizes and trimmability differ by rank (a pipeline stage holds other
                # layers): only rank 0's sizes decide, including one too large for its
                # budget, and nothing is trimmable unless every rank's layers are
                if tokens not in lead:
                    size = rng.choice([10, 30, 120])
                    lead.insert(tokens, None, size, trimmable_ok)
                    follower.insert(tokens, None, size * 3, trimmable_ok or rng.random() < 0.5)
                    follower.drop(lead.take_dropped())
            case 2:
                both("lookup", tokens, len(tokens))
            case 3:
                both("evict", rng.randrange(60))
            case 4 if step % 50 == 0:
                both("clear")
        assert set(follower._entries) == set(lead._entries)
    assert lead.stats.evictions > 0


def _model(*, shard: bool, pipeline: bool):
    model = SimpleNamespace(model=SimpleNamespace())
    if shard:
        model.shard = lambda group: None
    if pipeline:
        model.model.pipeline = lambda group: None
    return model


def test_auto_picks_tensor_when_heads_divide_else_pipeline_else_refuses():
    even = {"model_type": "x", "num_attention_heads": 4, "num_key_value_heads": 2}
    odd = {"model_type": "x", "text_config": {"num_attention_heads": 3}}
    both = _model(shard=True, pipeline=True)
    assert choose_mode("auto", both, even, 2) == "tensor"
    assert choose_mode("auto", both, odd, 2) == "pipeline"
    assert choose_mode("pipeline", both, even, 2) == "pipeline"
    with pytest.raises(ValueError, match="do not divide by 2 ranks"):
        choose_mode("tensor", both, odd, 2)
    with pytest.raises(ValueError, match="no pipeline"):
        choose_mode("pipeline", _model(shard=True, pipeline=False), even, 2)
    with pytest.raises(ValueError, match="supports neither tensor parallel"):
        choose_mode("auto", _model(shard=False, pipeline=False), even, 2)


async def test_the_monitor_fails_open_requests_then_exits_when_a_rank_is_lost(autojump_clock):
    watch, failed, exits = Watch(), [], []

    async def lose_later():
        await trio.sleep(5)
        watch.lose("rank 1 is gone")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(lose_later)
        options = {"exit_grace_s": 1.0, "exit": exits.append}
        await monitor(watch, lambda why: failed.append(why) or 2, **options)
    assert failed == ["rank 1 is gone"]
    assert exits == [EXIT_PEER_LOST]
    assert 6.0 <= trio.current_time() < 6.5  # loss seen within a poll, then the grace


async def test_a_shutdown_during_the_grace_still_exits(autojump_clock):
    """``mlx.launch`` sends SIGTERM about a second after a rank died: the shutdown that
    cancels the monitor must not leave the process waiting for its parked thread."""
    watch, exits = Watch(), []
    watch.lose("rank 1 is gone")
    with trio.move_on_after(0.5):
        await monitor(watch, lambda why: 0, exit_grace_s=10.0, exit=exits.append)
    assert exits == [EXIT_PEER_LOST]
    assert trio.current_time() < 1.0


def test_a_broadcast_or_call_past_its_deadline_counts_as_lost():
    class Stuck(Pipe):
        def send(self, payload: bytes) -> None:
            time.sleep(0.05)  # a broadcast that blocks (a peer died mid-step)
            assert "broadcast of decode()" in (watch.trouble() or "")

    watch = Watch()
    leader = Leader(Recorder(), Stuck(), watch, Timeouts(step_s=0.01, prefill_s=5.0))
    leader.decode()
    assert watch.trouble() is None  # over: no deadline left
    assert Timeouts(step_s=1, prefill_s=9).of("prefill_batch") == 9
    watch.expect(-1.0, "the engine call prefill()")
    assert "prefill() did not finish in time: a rank is gone or hangs" in (watch.trouble() or "")


class Loopback(Channel):
    """The channel's framing with the all_sum replaced: what rank 0 sums, rank 1 gets."""

    def __init__(self):
        super().__init__(None, None)
        self.wire: list[np.ndarray] = []
        self.receiving = False

    def _sum(self, x):
        if not self.receiving:
            self.wire.append(np.asarray(x))
            return self.wire[-1]
        sent = self.wire.pop(0)
        assert sent.shape == tuple(x.shape)  # both ranks sum arrays of one shape
        return sent


@pytest.mark.parametrize("size", [0, 1, 4091, 4092, 4093, 50_000])
def test_the_broadcast_frames_short_and_long_calls(size):
    payload = bytes(np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8))
    channel = Loopback()
    channel.send(payload)
    assert len(channel.wire) == (1 if size <= 4092 else 2)
    channel.receiving = True
    assert channel.receive() == payload
