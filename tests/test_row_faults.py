"""A bad row never harms its batch, on real MLX models.

Requests join and leave a running batch at set steps; one of them is bad. The
engine must fail only it, and every other request's tokens must equal those it
gets running alone. Two kinds of bad row: one whose own sampling fails while
the step is built (caught by the row guards: the step completes for the others),
and one that makes the whole step raise (the engine bisects the batch and
replays the innocent rows). Afterwards the engine is not poisoned: an unseeded
sampled request still runs.
"""

from __future__ import annotations

import pytest
from mlxd.protocol.messages import SamplingParams, TokenizedRequest

from tests.engine_driver import alone, drive, load

pytestmark = pytest.mark.mlx

PROMPTS = {
    "g1": list(range(200, 230)),
    "g2": list(range(400, 410)),
    "g3": list(range(900, 950)),
}


def greedy(rid: str, max_tokens: int = 12) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=rid,
        prompt_tokens=tuple(PROMPTS[rid]),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def seeded(rid: str, seed: int = 7) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=rid,
        prompt_tokens=tuple(range(1000, 1020)),
        sampling=SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=seed),
    )


def bad(rid: str, **sampling) -> TokenizedRequest:
    return TokenizedRequest(
        request_id=rid,
        prompt_tokens=tuple(range(300, 320)),
        sampling=SamplingParams(max_tokens=20, **sampling),
    )


@pytest.fixture(scope="module")
def smollm(smollm_tokenizer):
    runner, info = load(smollm_tokenizer)
    return runner, info


def test_rows_whose_sampling_fails_fail_alone_and_the_batch_is_unchanged(smollm):
    runner, info = smollm
    innocent = [greedy("g1"), greedy("g2"), seeded("s1"), greedy("g3")]
    expected = alone(runner, innocent)
    schedule = {
        0: [innocent[0], innocent[2]],
        # unchecked by the engine (vocab_size unknown to ``drive``'s core), so they reach
        # MLX: a top_k past the vocabulary raises inside mlx-lm's compiled sampler, and an
        # out-of-range logit_bias id reaches the bias processor's bounds check
        2: [bad("topk", temperature=1.0, top_k=info.vocab_size + 5), innocent[1]],
        4: [bad("bias", temperature=0.0, logit_bias={10_000_000: 5.0}), innocent[3]],
    }
    tokens, failed = drive(runner, schedule)
    assert set(failed) == {"topk", "bias"}
    assert failed["bias"].reason == "invalid_request" and failed["bias"].param == "logit_bias"
    assert {rid: tokens[rid] for rid in expected} == expected
    # nothing poisoned: an unseeded sampled request runs and yields tokens
    fresh, none_failed = drive(runner, {0: [seeded("u1", seed=None)]})  # type: ignore[arg-type]
    assert not none_failed and len(fresh["u1"]) == 12


class CrashingRunner:
    """The real runner, but a decode step with ``culprit`` in the batch raises after the
    real step ran (so the runner's batch is left half-advanced, as a real failure would)."""

    def __init__(self, runner, culprit: str):
        self._runner, self._culprit = runner, culprit

    def __getattr__(self, name):
        return getattr(self._runner, name)

    def decode(self):
        decoded = self._runner.decode()
        if self._culprit in self._runner._rid_to_uid:
            raise RuntimeError("injected failure of a whole step")
        return decoded


@pytest.mark.parametrize("model", ["smollm", "qwen3_5"])
def test_a_step_that_raises_is_bisected_and_innocent_rows_go_on_unchanged(
    model, smollm, tiny_models
):
    runner = smollm[0] if model == "smollm" else load(tiny_models("qwen3_5"))[0]
    innocent = [greedy("g1"), greedy("g2"), greedy("g3")]
    expected = alone(runner, innocent)
    crashing = CrashingRunner(runner, "boom")
    schedule = {0: [innocent[0], innocent[1]], 3: [bad("boom", temperature=0.0), innocent[2]]}
    tokens, failed = drive(crashing, schedule)
    assert set(failed) == {"boom"} and failed["boom"].reason == "internal_error"
    assert {rid: tokens[rid] for rid in expected} == expected
    assert runner.decoding == 0 and runner.prefilling_count == 0


def _draws_after_a_fault(base: int, before: int) -> list[int]:
    """The global key's next draws after a row's sampler raised under a guard with ``base``."""
    import mlx.core as mx
    from mlxd.actors.engine.runner.guards import RowGuard

    def broken(logprobs):
        raise ValueError("this row's sampler fails")

    mx.random.seed(before)  # the process's key before the fault: each rank its own
    RowGuard(base).sampler("req-1", broken)(mx.zeros((1, 8)))
    return mx.random.randint(0, 1 << 30, (4,)).tolist()


def test_a_row_fault_reseeds_the_global_key_alike_on_every_rank(smollm):
    """The ranks of a group share the guard's base (``ranks.py``): after the same fault,
    their unseeded draws stay the same (a random re-seed would desync the followers)."""
    runner, _ = smollm
    first = _draws_after_a_fault(base=42, before=1234)
    assert _draws_after_a_fault(base=42, before=999) == first
    assert _draws_after_a_fault(base=43, before=1234) != first
    runner.share_seed(42)
    assert runner._guard.base == 42


def test_a_replayed_seeded_row_goes_on_as_if_never_interrupted(smollm):
    """A seeded row replayed after a failed step continues its own random key: its
    tokens equal those it gets running alone, not a restart of its key from the seed."""
    runner, _ = smollm
    innocent = [seeded("s1", seed=7), seeded("s2", seed=11), greedy("g1")]
    expected = alone(runner, innocent)
    crashing = CrashingRunner(runner, "boom")
    schedule = {0: innocent[:2], 2: [innocent[2]], 4: [bad("boom", temperature=0.0)]}
    tokens, failed = drive(crashing, schedule)
    assert set(failed) == {"boom"}
    assert {rid: tokens[rid] for rid in expected} == expected
    assert runner.decoding == 0 and runner.prefilling_count == 0
