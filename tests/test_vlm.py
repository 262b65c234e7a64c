"""Vision-language models: image and text requests in one continuous batch.

Tiny random-weight mlx-vlm models (``scripts/tiny_models.py``) with SmolLM2's
tokenizer plus Qwen-VL's vision tokens and an offline image-processor config:
``qwen2_vl`` (plain attention, M-RoPE) and ``qwen3_5_vl`` (a Qwen3.5 VLM, whose
language model is a GatedDeltaNet/attention hybrid).
"""

from __future__ import annotations

import json

import httpx
import pytest
import trio
from mlxd.actors.tokenizer import PromptBuilder
from mlxd.actors.vision import ImageLimits
from mlxd.daemon.supervisor import mlx_runner_factory
from mlxd.protocol.messages import ChatRequest, ImagePart, Message, SamplingParams, TextPart
from mlxd.scripts.tiny_models import data_url, png

from tests.conftest import real_server, settings_with
from tests.engine_driver import alone, drive, load

pytestmark = pytest.mark.mlx

LIMITS = ImageLimits(4, 1 << 20, 1 << 20, False, 1.0)
QUESTIONS = ["What is this?", "Describe the picture", "Hello there", "Count to ten please"]


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen3_5_vl"])
def vlm(request, tiny_models):
    runner, info = load(tiny_models(request.param))
    builder = PromptBuilder(
        info.tokenizer,
        info.context_length,
        default_max_tokens=8,
        vocab_size=info.vocab_size,
        processor=info.processor,
        image_limits=LIMITS,
    )
    return request.param, runner, info, builder


def chat(rid, text, image=None, max_tokens=8, system="Be brief."):
    content = text if image is None else (ImagePart(url=image), TextPart(text=text))
    messages = (Message(role="system", content=system), Message(role="user", content=content))
    return ChatRequest(
        request_id=rid,
        messages=messages,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
    )


def image(seed, height=40, width=70):
    return data_url(png(width, height, seed))


def mixed_requests(builder, n=8):
    """Even ones carry an image (three different images, sizes vary), odd ones are text."""
    return [
        builder.build(
            chat(
                f"r{i}",
                QUESTIONS[i % 4],
                image(i % 3, 40 + 10 * i) if i % 2 == 0 else None,
                max_tokens=5 + i % 4,
            )
        )
        for i in range(n)
    ]


def test_loaded_as_vision_model_with_mlx_vlm_processor(vlm):
    """Kind from the config; mlx-vlm's own (numpy) processor, not a transformers fallback."""
    name, runner, info, _ = vlm
    assert info.kind == "vision"
    assert type(runner).__name__ == "VlmRunner"
    expected = {"qwen2_vl": "Qwen2VLProcessor", "qwen3_5_vl": "Qwen3VLProcessor"}[name]
    assert type(info.processor).__name__ == expected
    assert type(info.processor).__module__.startswith("mlx_vlm.")
    assert type(info.processor.image_processor).__module__.startswith("mlx_vlm.")
    assert runner.carries_deltas  # both use M-RoPE


def test_processor_template_gets_the_whole_conversation(vlm):
    _, _, info, builder = vlm
    request = ChatRequest(
        request_id="conv",
        messages=(
            Message(role="system", content="SYSTEM-RULES"),
            Message(role="user", content="FIRST-TURN"),
            Message(role="assistant", content="FIRST-ANSWER"),
            Message(role="user", content=(TextPart(text="SECOND-TURN"),)),
        ),
        sampling=SamplingParams(max_tokens=4),
    )
    text = info.tokenizer.decode(list(builder.build(request).prompt_tokens))
    positions = [
        text.index(s) for s in ("SYSTEM-RULES", "FIRST-TURN", "FIRST-ANSWER", "SECOND-TURN")
    ]
    assert positions == sorted(positions)


@pytest.mark.parametrize("with_image", [True, False])
def test_alone_equals_mlx_vlm_generation(vlm, with_image):
    """Our per-request prefill + batch join gives mlx-vlm's own greedy tokens."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    _, runner, _, builder = vlm
    picture = image(5) if with_image else None
    request = builder.build(chat("one", "What is this?", picture, max_tokens=8))
    ours = alone(runner, [request])["one"]
    vision = request.vision.arrays if request.vision else {}
    arrays = {k: mx.array(v) for k, v in vision.items()}
    pixels = arrays.pop("pixel_values", None)
    ids = mx.array(request.prompt_tokens)[None]
    steps = generate_step(ids, runner.model, pixels, None, max_tokens=8, temperature=0.0, **arrays)
    reference = [int(token) for token, _ in steps]
    assert ours == reference[: len(ours)]
    assert len(ours) >= 4


def test_mixed_image_and_text_batch_equals_each_alone(vlm):
    _, runner, _, builder = vlm
    requests = mixed_requests(builder)
    expected = alone(runner, requests)
    schedule = {0: requests[:2], 1: requests[2:4], 3: requests[4:6], 6: requests[6:]}
    batched, failed = drive(runner, schedule, prefill_chunk_tokens=8)
    assert not failed
    assert batched == expected
    assert (runner.decoding, runner.prefilling_count, runner.cache_bytes) == (0, 0, 0)
    # The images matter: same question, different image, different tokens.
    assert expected["r0"] != expected["r4"]


def test_same_image_twice_gives_the_same_tokens(vlm):
    _, runner, _, builder = vlm
    a = builder.build(chat("a", "What is this?", image(7)))
    b = builder.build(chat("b", "What is this?", image(7)))
    other = builder.build(chat("c", "What is this?", image(8)))
    text = builder.build(chat("t", "What is this?"))
    tokens, failed = drive(runner, {0: [a, text], 2: [b, other]})
    assert not failed
    assert tokens["a"] == tokens["b"]
    assert tokens["a"] != tokens["c"]


def test_m_rope_deltas_are_what_keeps_image_requests_right(vlm):
    """Test of the test: decoding an image request at plain positions changes its tokens."""
    _, runner, _, builder = vlm
    request = builder.build(chat("img", "Describe the picture", image(2, 80, 90), max_tokens=8))
    right = alone(runner, [request])["img"]
    original = runner._batch_cache

    def without_deltas(pending):
        cache = original(pending)
        cache[-1].values = cache[-1].values * 0
        return cache

    runner._batch_cache = without_deltas
    try:
        wrong = alone(runner, [request])["img"]
    finally:
        runner._batch_cache = original
    assert wrong != right


def test_kind_override_serves_a_vlm_checkpoint_as_text(tiny_models):
    """``model.kind = "text"``: mlx-lm loads the language model alone; images are a 400."""
    from mlxd.actors.tokenizer import PromptError

    runner, info = load(tiny_models("qwen3_5_vl"), kind="text")
    assert (type(runner).__name__, info.kind, info.processor) == ("MlxRunner", "text", None)
    builder = PromptBuilder(
        info.tokenizer, info.context_length, default_max_tokens=4, vocab_size=info.vocab_size
    )
    with pytest.raises(PromptError, match="image_url"):
        builder.build(chat("x", "hi", image(1)))
    tokens = alone(runner, [builder.build(chat("t", "Hello there", max_tokens=4))])
    assert len(tokens["t"]) == 4


# ---- the whole daemon over HTTP ------------------------------------------------------------


def _body(content, max_tokens=6):
    return {
        "messages": [{"role": "user", "content": content}],
        "temperature": 0,
        "max_tokens": max_tokens,
    }


def _with_image(url, text="What is this?"):
    return [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]


async def test_http_bad_image_fails_only_its_request(tiny_models):
    good, text = _body(_with_image(image(3))), _body("Hello there")
    bad = _body(_with_image(data_url(b"\x89PNG\r\n\x1a\n truncated")))
    huge = _body(_with_image(data_url(png(700, 700, seed=1))))  # ~1.5 MB: over max_image_bytes
    settings = settings_with(
        model={"path": str(tiny_models("qwen2_vl"))},
        engine={"max_batch": 8},
        vision={"max_image_bytes": 1_000_000},
        server={"max_body_bytes": 16_000_000},
    )
    async with real_server(settings, mlx_runner_factory(settings)) as (url, _, runner):
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:

            async def post(body):
                return await http.post("/v1/chat/completions", json=body)

            alone_good = (await post(good)).json()
            alone_text = (await post(text)).json()
            results = {}

            async def one(name, body):
                results[name] = await post(body)

            async with trio.open_nursery() as nursery:
                for name, body in (("good", good), ("bad", bad), ("text", text), ("huge", huge)):
                    nursery.start_soon(one, name, body)
    assert results["bad"].status_code == 400
    error = results["bad"].json()["error"]
    assert error["type"] == "invalid_request_error"
    assert "image 1: cannot decode" in error["message"]
    assert results["huge"].status_code == 400
    assert "larger than" in results["huge"].json()["error"]["message"]
    for name, expected in (("good", alone_good), ("text", alone_text)):
        got = results[name].json()
        assert got["choices"][0]["message"] == expected["choices"][0]["message"], name
        assert got["usage"] == expected["usage"]
    assert alone_good["usage"]["prompt_tokens"] > alone_text["usage"]["prompt_tokens"]
    assert json.dumps(alone_good)  # plain JSON through and through
    assert runner.cache_bytes == 0
