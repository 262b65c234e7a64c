"""Shared harness: the whole actor graph over a scripted fake runner."""

from __future__ import annotations

from contextlib import asynccontextmanager

import trio

from daemon.settings import load_settings
from daemon.supervisor import open_graph, run_actors
from protocol.messages import ChatRequest, Message, SamplingParams
from tests.fakes import FakeRunner, fake_factory


@asynccontextmanager
async def running_graph(settings=None, runner=None, context_length=4096):
    """Run the actors over a fake runner; on exit, assert nothing is left behind."""
    settings = settings or load_settings()
    runner = runner or FakeRunner()
    graph = open_graph(settings)
    async with trio.open_nursery() as nursery:
        await nursery.start(run_actors, graph, settings, fake_factory(runner, context_length))
        try:
            yield graph.pipeline, runner
            await assert_idle(graph.pipeline, runner)
        finally:
            nursery.cancel_scope.cancel()


async def assert_idle(pipeline, runner, timeout=5.0):
    """After requests finish: no mailbox open, nothing prefilling or decoding."""
    with trio.fail_after(timeout):
        while len(pipeline.mailboxes) or runner.running or runner.prefilling:
            await trio.sleep(0.01)


def chat(rid, text, max_tokens=None, stop=(), temperature=0.0):
    sampling = SamplingParams(max_tokens=max_tokens, temperature=temperature, stop=tuple(stop))
    return ChatRequest(
        request_id=rid, messages=(Message(role="user", content=text),), sampling=sampling
    )
