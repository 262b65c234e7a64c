"""The engine core's memory gate, priority order, aborts and failed-step recovery,
driven by hand with the fake runner. Timeouts are the pipeline's (tests/test_graph.py):
the core only has to honour the ``Abort`` that follows one, wherever the request is."""

from __future__ import annotations

import msgspec
from mlxd.actors.engine.scheduler.core import EngineCore
from mlxd.protocol.messages import SamplingParams, TokenizedRequest

from tests.fakes import FakeRunner, fake_memory


def req(rid, prompt="abcdefghi", max_tokens=10, priority=0):
    return TokenizedRequest(
        request_id=rid,
        prompt_tokens=tuple(ord(c) for c in prompt),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0),
        priority=priority,
    )


def core_with(budget=None, **kw):
    runner = FakeRunner(step_delay=0)
    memory = fake_memory(budget) if budget is not None else None
    return runner, EngineCore(runner, max_batch=8, prefill_chunk_tokens=512, memory=memory, **kw)


def run_until_idle(core, limit=1000):
    steps = []
    while not core.idle and len(steps) < limit:
        steps.append(core.step())
    return steps


def started_ids(steps):
    return [s.request_id for step in steps for s in step.started]


def test_memory_gate_holds_requests_until_running_ones_free_their_share():
    # each request: (9 prompt + 10 completion) × 1024 bytes; the budget fits two
    runner, core = core_with(budget=2 * 19 * 1024)
    for i in range(5):
        core.submit(req(f"r{i}"))
    first = core.step()
    assert [s.request_id for s in first.started] == ["r0", "r1"]
    assert core.reserved_bytes == 2 * 19 * 1024
    steps = [first, *run_until_idle(core)]
    assert started_ids(steps) == ["r0", "r1", "r2", "r3", "r4"]  # all ran, in order
    assert max(runner.batch_sizes) == 2
    assert core.reserved_bytes == 0 and not core.reserved


def test_without_a_budget_the_batch_cap_alone_applies():
    runner, core = core_with()
    for i in range(5):
        core.submit(req(f"r{i}"))
    assert len(core.step().started) == 5


def test_a_request_that_can_never_fit_is_a_400_with_numbers():
    runner, core = core_with(budget=10 * 1024)
    core.submit(req("big"))
    (failed,) = core.step().failed
    assert failed.reason == "request_too_large"
    assert "MiB" in failed.message and "9 prompt + 10 completion" in failed.message
    assert core.idle


def test_priority_orders_the_engine_queue():
    runner, core = core_with(budget=19 * 1024)  # one at a time
    core.submit(req("low", priority=5))
    core.submit(req("mid-a", priority=1))
    core.submit(req("high", priority=0))
    core.submit(req("mid-b", priority=1))
    assert started_ids(run_until_idle(core)) == ["high", "mid-a", "mid-b", "low"]


def test_an_abort_while_waiting_for_memory_leaves_the_queue():
    runner, core = core_with(budget=19 * 1024)
    core.submit(req("running", max_tokens=10))
    core.step()
    core.submit(req("patient"))
    assert not core.step().failed and len(core.waiting) == 1
    core.abort("patient")  # its queue timeout passed (the pipeline's timer)
    steps = run_until_idle(core)
    assert started_ids(steps) == [] and not any(step.failed for step in steps)
    assert core.reserved_bytes == 0 and "patient" not in [rid for rid, _ in runner.prefill_log]


def test_abort_releases_the_reservation():
    runner, core = core_with(budget=2 * 19 * 1024)
    core.submit(req("a"))
    core.submit(req("b"))
    core.submit(req("c"))
    core.step()
    core.abort("a")
    assert core.reserved_bytes == 19 * 1024
    assert started_ids([core.step()]) == ["c"]
    run_until_idle(core)
    assert core.reserved_bytes == 0


def test_an_allocation_failure_in_decode_fails_that_step_and_the_engine_goes_on():
    runner, core = core_with(budget=10**9)
    core.submit(req("ok1", "fine"))
    core.submit(req("boom", "OOM here"))
    steps = run_until_idle(core)
    failed = {f.request_id: f for step in steps for f in step.failed}
    assert set(failed) == {"ok1", "boom"}  # both were in the failing step
    assert all(f.reason == "out_of_memory" for f in failed.values())
    assert "out of memory" in failed["boom"].message
    assert runner.resets == 1 and core.reserved_bytes == 0
    # the engine keeps serving
    core.submit(req("after", "next"))
    steps = run_until_idle(core)
    tokens = [t for step in steps for t in step.tokens if t.request_id == "after"]
    assert tokens[-1].finish_reason == "stop"
    assert core.stats().failed_steps == 1


def test_stats_report_the_batch_and_memory():
    runner, core = core_with(budget=10**6)
    core.submit(req("a"))
    core.submit(req("b"))
    core.step()
    stats = core.stats()
    assert stats.decoding == 2 and stats.batch_size == 2
    assert stats.kv_reserved == 2 * 19 * 1024 and stats.kv_budget == 10**6
    assert stats.memory_active > 0
    run_until_idle(core)
    idle = core.stats()
    assert (idle.decoding, idle.kv_reserved, idle.memory_active) == (0, 0, 0)
    assert idle.batch_tokens_total >= idle.decode_steps


def test_an_abort_mid_decode_leaves_the_batch_and_frees_its_share():
    runner, core = core_with(budget=10**6)
    core.submit(req("late", "x" * 50, max_tokens=100))
    core.submit(req("other", "y" * 50, max_tokens=100))
    core.step()
    core.step()
    core.abort("late")  # past its deadline (the pipeline's timer)
    core.abort("late")  # and again, from its session: harmless
    assert "late" in runner.removed and "late" not in runner.running
    assert list(core.reserved) == ["other"]
    steps = run_until_idle(core)
    assert all(t.request_id == "other" for step in steps for t in step.tokens)
    assert core.reserved_bytes == 0


def tokens_by_request(steps):
    out: dict[str, list[int]] = {}
    for step in steps:
        for t in step.tokens:
            out.setdefault(t.request_id, []).extend(t.tokens)
    return out


def alone(prompts: dict[str, str], max_tokens=10):
    out = {}
    for rid, prompt in prompts.items():
        _, core = core_with()
        core.submit(req(rid, prompt, max_tokens))
        out |= tokens_by_request(run_until_idle(core))
    return out


INNOCENT = {"a": "first one", "b": "second", "c": "third request", "d": "fourth", "e": "fifth"}


def test_a_row_whose_own_sampling_fails_fails_alone_and_the_step_goes_on():
    runner, core = core_with()
    for rid, prompt in INNOCENT.items():
        core.submit(req(rid, prompt))
    core.submit(req("bad", "BADROW here"))
    steps = run_until_idle(core)
    failed = {f.request_id: f for step in steps for f in step.failed}
    assert set(failed) == {"bad"} and failed["bad"].reason == "internal_error"
    assert "scripted sampler failure" in failed["bad"].message
    assert tokens_by_request(steps) == alone(INNOCENT)  # "bad" emitted nothing
    assert runner.resets == 0 and core.stats().failed_steps == 0


def test_a_failed_step_is_bisected_to_its_culprit_and_the_rest_go_on_unchanged():
    runner, core = core_with()
    for rid, prompt in INNOCENT.items():
        core.submit(req(rid, prompt))
    steps = [core.step(), core.step()]  # the batch is running: a, b, c, d, e
    core.submit(req("bad", "CRASH soon"))  # joins mid-stream
    core.submit(req("late", "arrives later"))
    steps += run_until_idle(core)
    failed = {f.request_id: f for step in steps for f in step.failed}
    assert set(failed) == {"bad"} and failed["bad"].reason == "internal_error"
    assert tokens_by_request(steps) == alone({**INNOCENT, "late": "arrives later"})
    assert sorted(started_ids(steps)) == sorted([*INNOCENT, "bad", "late"])  # each once
    # six rows in the failed step: found in at most ceil(log2(6)) + 1 failed steps
    assert 1 < core.stats().failed_steps <= 4
    assert core.reserved_bytes == 0 and core.recovery.idle and not core.recovery.origins


def test_rows_that_cannot_be_rebuilt_fail_with_a_reason_others_go_on():
    runner, core = core_with()
    core.submit(req("a", "first one"))
    core.submit(msgspec.structs.replace(req("g", "grammar row"), grammar=object()))
    steps = [core.step()]
    core.submit(req("bad", "CRASH"))
    steps += run_until_idle(core)
    failed = {f.request_id: f for step in steps for f in step.failed}
    assert set(failed) == {"bad", "g"}
    assert "cannot be rebuilt" in failed["g"].message
    assert tokens_by_request(steps)["a"] == alone({"a": "first one"})["a"]


def test_an_abort_while_parked_for_a_replay_forgets_the_request():
    runner, core = core_with()
    for rid in ("a", "b", "c"):
        core.submit(req(rid, rid * 5, 50))
    core.submit(req("bad", "CRASH"))
    steps = [core.step()]  # the step fails: a, b, c are parked or on trial
    assert core.recovery.parked
    for rid in ("a", "b", "c"):
        core.abort(rid)  # past their deadline (the pipeline's timer)
    steps += run_until_idle(core)
    failed = {f.request_id: f.reason for step in steps for f in step.failed}
    assert failed == {"bad": "internal_error"}
    assert core.idle and core.recovery.idle


def test_options_the_model_cannot_run_are_a_400_before_any_runner_call():
    runner, core = core_with(vocab_size=1000)
    bad = {
        "top_k": SamplingParams(max_tokens=5, temperature=1.0, top_k=1000),
        "logit_bias": SamplingParams(max_tokens=5, temperature=0, logit_bias={1000: 1.0}),
        "seed": SamplingParams(max_tokens=5, temperature=1.0, seed=-1),
    }
    for param, sampling in bad.items():
        core.submit(msgspec.structs.replace(req(param), sampling=sampling))
    core.submit(req("ok", "fine"))
    steps = run_until_idle(core)
    failed = {f.request_id: f for step in steps for f in step.failed}
    assert {rid: (f.reason, f.param) for rid, f in failed.items()} == {
        p: ("invalid_request", p) for p in bad
    }
    assert not runner.removed or set(runner.removed) <= {"ok"}
    assert tokens_by_request(steps)["ok"] == alone({"ok": "fine"})["ok"]


def test_the_prefill_budget_is_charged_for_the_tokens_run_in_that_step():
    runner = FakeRunner(step_delay=0)
    core = EngineCore(runner, max_batch=8, prefill_chunk_tokens=100)
    core.submit(req("long", "x" * 251))  # 250 tokens to prefill: 100, 100, 50
    core.submit(req("short", "y" * 31))
    for _ in range(3):
        core.step()
    # the third step ran 50 of "long"'s tokens, so "short" got the other 50 of the budget
    # (charging "long" all 250 it has prefilled so far left it nothing)
    assert [rid for rid, _ in runner.prefill_log] == ["long", "long", "long", "short"]
    assert "short" in core.decoding


def test_a_request_held_for_a_shared_prefill_keeps_its_place_and_lets_others_start():
    class Sharing(FakeRunner):
        def wait_for(self, request):
            if request.request_id == "follower" and "leader" in self.prefilling:
                return "leader"
            return None

    runner = Sharing(step_delay=0)
    core = EngineCore(runner, max_batch=8, prefill_chunk_tokens=10)
    core.submit(req("leader", "s" * 40))
    core.submit(req("follower", "s" * 40))
    core.submit(req("other", "o" * 5))
    first = core.step()
    assert [s.request_id for s in first.started] == ["leader", "other"]
    assert core.waiting[0].request.request_id == "follower"
    steps = [first, *run_until_idle(core)]
    starts = {s.request_id: i for i, step in enumerate(steps) for s in step.started}
    assert starts["follower"] >= 4  # the leader's 39 tokens take 4 chunks of 10 first
    assert tokens_by_request(steps)["follower"] == tokens_by_request(steps)["leader"]


def test_prefix_cache_snapshots_share_the_memory_budget_and_yield_to_requests():
    runner, core = core_with(budget=2 * 19 * 1024)  # room for two requests
    runner.cache_held = 30 * 1024  # snapshots hold most of it
    core.submit(req("a"))
    core.submit(req("b"))
    first = core.step()
    assert [s.request_id for s in first.started] == ["a", "b"]
    # the snapshots were evicted, just enough for both requests
    assert core.reserved_bytes + runner.cache_held <= 2 * 19 * 1024
    assert runner.cache_held == 0


def test_requests_given_budget_in_a_step_are_prefilled_in_one_batched_call():
    runner = FakeRunner(step_delay=0, batches_prefill=True)
    core = EngineCore(runner, max_batch=8, prefill_chunk_tokens=100)
    core.submit(req("a", "a" * 41))  # 40 to prefill
    core.submit(req("b", "b" * 51))  # 50
    core.submit(req("c", "c" * 31))  # 30: only 10 of the budget is left for it
    core.step()
    # one call, oldest first, each charged for what it runs: 40 + 50 + the last 10
    assert runner.prefill_batches == [{"a": 100, "b": 60, "c": 10}]
    assert set(core.decoding) == {"a", "b"}
    assert core._left["c"] == 20
    core.step()
    assert runner.prefill_batches[1:] == []  # one request left: no batch to make
    assert "c" in core.decoding


def test_a_short_prompt_the_budget_cannot_take_whole_waits_for_the_next_step():
    runner = FakeRunner(step_delay=0, batches_prefill=True)
    core = EngineCore(runner, max_batch=8, prefill_chunk_tokens=100, prefill_unsplit_tokens=30)
    core.submit(req("a", "a" * 61))  # 60 to prefill
    core.submit(req("b", "b" * 31))  # 30: only 40 left... taken whole
    core.submit(req("c", "c" * 21))  # 20: 10 left, short: not split, the next step's
    core.submit(req("d", "d" * 6))  # 5, younger: does not go ahead of c
    core.step()
    assert runner.prefill_batches == [{"a": 100, "b": 40}]
    assert (core._left["c"], core._left["d"]) == (20, 5)
    core.submit(req("e", "e" * 201))  # 200: longer than unsplit, split as before
    core.step()
    assert runner.prefill_batches[1] == {"c": 100, "d": 80, "e": 75}
    assert core._left["e"] == 200 - 75
    core.step()  # the first request of a step always gets the budget
    assert core._left["e"] == 25
    steps = run_until_idle(core)
    assert not [f for step in steps for f in step.failed]


def test_a_failing_batched_prefill_is_retried_one_by_one_and_fails_only_its_culprit():
    runner = FakeRunner(step_delay=0, batches_prefill=True)
    core = EngineCore(runner, max_batch=8, prefill_chunk_tokens=512)
    prompts = {"a": "first one", "bad": "FAIL here", "c": "third request"}
    for rid, prompt in prompts.items():
        core.submit(req(rid, prompt))
    steps = run_until_idle(core)
    assert len(runner.prefill_batches) == 1
    assert [f.request_id for step in steps for f in step.failed] == ["bad"]
    assert tokens_by_request(steps) == alone({"a": "first one", "c": "third request"})
