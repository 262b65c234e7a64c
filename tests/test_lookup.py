"""Prompt-lookup drafting (``actors/engine/speculative/lookup.py``).

The index and the drafter's row bookkeeping are checked by hand; on tiny targets
(llama, and the hybrid Qwen3.5) greedy output with lookup drafts equals plain
greedy output for 8 requests joining and leaving at different steps; on a bigram
target a prompt that repeats itself is copied, and the copy is drafted.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from mlxd.actors.engine.speculative.lookup import LookupDrafter, NgramIndex

from tests.engine_driver import alone, drive, request, speculative_runner
from tests.test_speculative import _requests, _schedule, assert_sampled_runs_repeat

# ---- the index and the drafter, no model -----------------------------------------------


def test_the_longest_suffix_that_occurred_before_proposes_what_followed_it():
    index = NgramIndex(3, 1, [1, 2, 3, 9, 2, 3, 4, 5, 7, 2, 3])
    # "2 3" occurred twice before; no earlier "7 2 3": the latest "2 3" is followed by 4, 5
    assert index.propose(2) == [4, 5]
    index.extend([4])  # "2 3 4" now matches as a trigram: 5, 7, 2
    assert index.propose(3) == [5, 7, 2]
    assert NgramIndex(3, 1, [5, 6, 7]).propose(3) == []  # no token occurred twice
    assert NgramIndex(3, 2, [1, 2, 9, 2]).propose(3) == []  # "2" alone is under min_n


def test_the_copy_runs_past_the_end_with_its_own_period():
    assert NgramIndex(3, 1, [1, 2, 1, 2]).propose(5) == [1, 2, 1, 2, 1]
    assert NgramIndex(2, 1, [8, 8]).propose(3) == [8, 8, 8]
    assert NgramIndex(3, 1, [7, 1, 2, 3, 1, 2, 3]).propose(4) == [1, 2, 3, 1]


def test_the_index_grows_incrementally_like_a_fresh_one():
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3]
    grown = NgramIndex(4, 2)
    for i, t in enumerate(tokens):
        grown.extend([t])
        fresh = NgramIndex(4, 2, tokens[: i + 1])
        assert grown._next == fresh._next
        assert grown.propose(3) == fresh.propose(3)
    with pytest.raises(ValueError, match="min <= max"):
        NgramIndex(2, 3)
    with pytest.raises(ValueError, match="min <= max"):
        LookupDrafter(3, 0)


def _row(speculative=True):
    return SimpleNamespace(params=SimpleNamespace(speculative=speculative))


def test_drafter_follows_prefill_joins_updates_and_filters_rows():
    drafter = LookupDrafter(2, 1)
    a, b, c = [1, 2, 3, 1, 2], [5, 6, 5], [9, 9, 4]
    drafter.start("a")
    drafter.prefilled("a", a, 3, None)  # chunks: the prompt is indexed as prefill goes
    assert drafter._prefill["a"].tokens == [1, 2, 3]
    drafter.prefilled("a", a, 4, None)
    drafter.add(drafter.joined("a", a))
    drafter.add(drafter.joined("b", b))  # never prefilled (a prefix-cache hit): indexed whole
    drafter.start("c")
    drafter.add(drafter.joined("c", c))
    drafter.start("gone")
    drafter.forget("gone")
    assert drafter._prefill == {}
    rows = [_row(), _row(), _row(speculative=False)]
    assert drafter.propose(rows, 2, None) == [[3, 1], [6, 5], []]
    # a accepted 3 and got 7; b rejected its draft and got 8; c got 1
    drafter.update(None, None, [1, 0, 0], [[3, 7], [8], [1]], 2, None)
    assert [r.tokens for r in drafter.rows] == [a + [3, 7], b + [8], c + [1]]
    drafter.filter([2, 0])  # b finished; order follows the batch
    assert [r.tokens[:3] for r in drafter.rows] == [c, a[:3]]
    assert drafter.propose([_row(), _row()], 3, None) == [[], []]
    drafter.update(None, None, [0, 0], [[9], [1]], 0, None)  # a plain step: still indexed
    assert drafter.propose([_row(), _row()], 2, None) == [[4, 1], [2, 3]]
    assert drafter.fresh().rows == [] and drafter.nbytes == 0


def test_a_deterministic_draft_is_accepted_with_the_targets_probability():
    """``q`` None (a point mass on the draft): the first token is still distributed as
    ``p``, whether or not the draft is likely."""
    import mlx.core as mx
    from mlxd.actors.engine.speculative.batch import accept_sampled

    p = mx.array([[0.5, 0.3, 0.15, 0.05], [0.25, 0.25, 0.25, 0.25]])
    key = [mx.random.key(11)]

    def next_key():
        key[0], sub = mx.random.split(key[0])
        return sub

    n = 2000
    for draft in (0, 3):
        counts = [0] * 4
        for _ in range(n):
            accepted, token = accept_sampled(p, None, [draft], next_key)
            counts[draft if accepted else token] += 1
        freq = [c / n for c in counts]
        assert all(abs(f - t) < 0.035 for f, t in zip(freq, p[0].tolist(), strict=True)), freq


# ---- on tiny models -------------------------------------------------------------------


def lookup_runner(model_dir, *, k=3, spec_max_batch=8, max_batch=8, ngrams=(3, 1)):
    return speculative_runner(
        model_dir,
        lambda _: LookupDrafter(*ngrams),
        k=k,
        spec_max_batch=spec_max_batch,
        max_batch=max_batch,
    )


@pytest.mark.mlx
@pytest.mark.parametrize(
    ("target", "spec_max_batch", "ngrams"),
    [
        ("llama", 8, (3, 1)),
        ("llama", 3, (4, 2)),  # off above 3 rows: the index still follows every token
        ("qwen3_5", 8, (3, 1)),  # hybrid: a rejected draft restores SSM state
    ],
)
def test_greedy_lookup_speculation_equals_plain_decoding(
    tiny_models, target, spec_max_batch, ngrams
):
    plain, runner, info = lookup_runner(
        tiny_models(target), spec_max_batch=spec_max_batch, ngrams=ngrams
    )
    requests = _requests(info)
    expected = alone(plain, requests)
    got, failed = drive(runner, _schedule(requests), prefill_chunk_tokens=8)
    assert not failed
    assert got == expected
    stats = runner.spec_stats
    print(target, stats)
    assert stats.drafter == "lookup" and stats.steps > 0 and stats.drafted > 0
    if spec_max_batch < 8:
        assert stats.plain_steps > 0
    assert (runner.decoding, runner.prefilling_count, runner.cache_bytes) == (0, 0, 0)


@pytest.mark.mlx
def test_a_copy_of_the_prompt_is_drafted_from_the_prompt(tiny_models):
    """A bigram target (its next token depends on the last one only) continues ``P + O
    + P`` with ``O``, what it continued ``P`` with: the lookup finds the suffix in the
    first copy and drafts ``O`` from it. Alone, and in a batch (a hybrid target) with
    rows that accept less."""
    plain, runner, info = lookup_runner(tiny_models("qwen3_5_mtp_exact"))
    prompt = info.tokenizer.encode("def fibonacci(n): return n if n < 2 else")
    (out,) = alone(plain, [request("p", prompt, 12)]).values()
    copy = request("c", [*prompt, *out, *prompt], 12)
    expected = alone(plain, [copy])
    assert expected["c"] == out
    got, failed = drive(runner, {0: [copy]})
    assert not failed and got == expected
    stats = runner.spec_stats
    print(stats)
    assert stats.acceptance_rate > 0.5
    assert stats.emitted / stats.steps > 2  # more than two tokens per verify pass
    others = _requests(info)[:4]
    expected = alone(plain, [copy, *others])
    got, failed = drive(runner, {0: [copy, others[0]], 1: others[1:]})
    assert not failed and got == expected


@pytest.mark.mlx
def test_sampled_requests_with_lookup_drafts(tiny_models):
    """Temperature > 0: drafts are accepted with the target's probability of them
    (rejection sampling against a point mass); a seed makes a request repeatable."""
    _, runner, info = lookup_runner(tiny_models("llama"))
    assert_sampled_runs_repeat(runner, info)
    assert runner.spec_stats.drafted > 0


@pytest.mark.mlx
def test_load_runner_picks_the_lookup_drafter(tiny_models):
    """``drafter = "lookup"`` with its n-gram bounds; the stats say "lookup"."""
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.options import SpeculativeOptions

    options = SpeculativeOptions(drafter="lookup", lookup_max_ngram=4, lookup_min_ngram=2)
    model = tiny_models("llama")
    runner, _ = load_runner(
        str(model), model, dequantize_on_cpu=True, max_batch=4, speculative=options
    )
    assert runner.spec_stats.drafter == "lookup" and runner.spec_stats.enabled
    assert (runner.drafter.max_ngram, runner.drafter.min_ngram) == (4, 2)
    counters = runner.counters().speculative
    assert counters.drafter == "lookup" and counters.enabled


def test_lookup_settings_reach_the_options():
    import msgspec
    from mlxd.actors.engine.scheduler.options import SpeculativeOptions
    from mlxd.daemon.settings import SpeculativeSettings
    from mlxd.daemon.supervisor import options_from

    section = SpeculativeSettings(
        enabled=True, drafter="lookup", lookup_max_ngram=5, lookup_min_ngram=2
    )
    options = options_from(section, SpeculativeOptions)
    assert (options.drafter, options.lookup_max_ngram, options.lookup_min_ngram) == (
        "lookup",
        5,
        2,
    )
    with pytest.raises(msgspec.ValidationError, match="lookup_min_ngram"):
        msgspec.convert({"lookup_max_ngram": 2, "lookup_min_ngram": 3}, SpeculativeSettings)


@pytest.mark.mlx
async def test_default_model_with_lookup_drafts_over_http(tmp_path_factory):
    """SmolLM2 asked to give code back: same replies as without speculation, and
    ``/v1/speculative`` counts the lookup drafter's accepted drafts."""
    from tests.conftest import settings_with
    from tests.test_speculative import _chat_all

    code = "def area(width, height):\n    return width * height\n"
    prompts = [f"Repeat this code exactly:\n\n{code}", f"Add a docstring to:\n\n{code}"]
    cache_dir = str(tmp_path_factory.getbasetemp() / "mlxd-cache")
    off = settings_with(model={"cache_dir": cache_dir})
    on = settings_with(
        model={"cache_dir": cache_dir}, speculative={"enabled": True, "drafter": "lookup"}
    )
    plain, _ = await _chat_all(off, prompts)
    spec, stats = await _chat_all(on, prompts)
    print(stats)
    assert spec == plain
    assert stats["enabled"] and stats["drafter"] == "lookup"
    assert stats["accepted"] > 0 and 0 < stats["acceptance_rate"] <= 1


@pytest.mark.mlx
def test_vision_models_do_not_speculate_with_lookup(tiny_models):
    """Off, and the status says why: the VLM lane's verify pass cannot take rows with
    different draft counts (right-padded) on mlx-vlm's Qwen3.5 yet."""
    from mlxd.actors.engine.loading.load import load_runner
    from mlxd.actors.engine.scheduler.options import SpeculativeOptions

    model_dir = tiny_models("qwen3_5_vl")
    runner, _ = load_runner(
        str(model_dir),
        model_dir,
        dequantize_on_cpu=True,
        max_batch=8,
        speculative=SpeculativeOptions(drafter="lookup"),
    )
    assert not runner.spec_stats.enabled and "MTP head" in runner.spec_stats.notes[0]
