"""LoRA adapters chosen per request, in one batch with the base (issue 44, items 2-4, 6).

Tiny random-weight models (dense llama, hybrid Qwen3.5) with random adapters made as
``mlx_lm.lora`` makes them (LoRA and DoRA) and the same tensors in PEFT's layout. The
reference for an adapter row is the same request served alone on a model with that
adapter fused (``mlx_lm.fuse``'s path); for a base row, the base alone. Greedy, token
for token.
"""

from __future__ import annotations

import json

import pytest
from mlxd.protocol.messages import AdapterRef, SamplingParams, TokenizedRequest

from tests.engine_driver import alone, drive, load

pytestmark = pytest.mark.mlx

PROMPTS = {
    "base": [1, 42, 7, 300, 99, 5],
    "a": [1, 15, 2000, 33, 8],
    "b": [1, 640, 12, 12, 7, 900, 4],
    "c": [1, 77, 3, 505],
}


def ask(rid: str, prompt, adapter: AdapterRef | None = None, max_tokens: int = 8):
    return TokenizedRequest(
        request_id=rid,
        prompt_tokens=tuple(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        adapter=adapter,
    )


def ref(name: str, path) -> AdapterRef:
    from mlxd.actors.engine.adapters.files import fingerprint

    return AdapterRef(name=name, path=str(path), fingerprint=fingerprint(path))


@pytest.fixture(scope="module", params=["llama", "qwen3_5"])
def setup(request, tiny_models, tmp_path_factory):
    """(model dir, {name: adapter dir}, {name: mlx-lm dir of the same tensors})."""
    from mlxd.scripts import tiny_models as tm

    model_dir = tiny_models(request.param)
    root = tmp_path_factory.mktemp(f"adapters-{request.param}")
    a = tm.build_lora_adapter(model_dir, root / "a", kind="lora", rank=4, seed=1)
    b = tm.build_lora_adapter(model_dir, root / "b", kind="dora", rank=8, seed=2)
    c_mlx = tm.build_lora_adapter(
        model_dir,
        root / "c-mlx",
        kind="lora",
        rank=2,
        seed=3,
        keys=("self_attn.k_proj", "mlp.up_proj"),
    )
    c = tm.peft_from_mlx(c_mlx, root / "c")
    return model_dir, {"a": a, "b": b, "c": c}, {"a": a, "b": b, "c": c_mlx}


def fused_alone(model_dir, adapter, requests):
    from mlxd.actors.engine.runner.base import MlxRunner
    from mlxd.scripts import tiny_models as tm

    runner, info = load(model_dir)
    fused = tm.fuse_adapter(runner.model, adapter)
    plain = MlxRunner(fused, sorted(info.tokenizer.eos_token_ids), 8)
    return alone(plain, requests)


def test_one_batch_of_base_and_three_adapters_equals_each_alone_fused(setup):
    """Rows on the base, on a LoRA, a DoRA and a PEFT adapter decode in the same steps
    (joining at different steps), and each row writes what it writes alone on its
    adapter's fused model; the base rows what the base writes alone."""
    model_dir, adapters, as_mlx = setup
    runner, _ = load(model_dir)
    refs = {n: ref(n, p) for n, p in adapters.items()}
    requests = [ask("base", PROMPTS["base"])] + [ask(n, PROMPTS[n], refs[n]) for n in "abc"]
    requests.append(ask("base2", PROMPTS["a"]))  # the base on another adapter's prompt
    tokens, failed = drive(runner, {0: requests[:2], 1: requests[2:4], 3: requests[4:]})
    assert not failed, failed
    assert runner.adapters is not None and sorted(runner.adapters.resident) == ["a", "b", "c"]
    base_alone = alone(runner, [requests[0], requests[4]])
    assert tokens["base"] == base_alone["base"]
    assert tokens["base2"] == base_alone["base2"]
    for n in "abc":
        want = fused_alone(model_dir, as_mlx[n], [ask(n, PROMPTS[n])])[n]
        assert tokens[n] == want, n
    assert tokens["a"] != tokens["base2"]  # the adapter changes the answer


def test_adapter_rows_are_prefilled_together_and_alone_alike(setup):
    """Several adapter rows prefilled in one forward pass (the engine's batched
    prefill), then decoded together: the same tokens as each alone on the runner."""
    model_dir, adapters, _ = setup
    runner, _ = load(model_dir)
    runner.batch_prefill_max_context = 64
    refs = {n: ref(n, p) for n, p in adapters.items()}
    same = [1, 42, 7, 300, 99, 5, 17, 18]
    requests = [ask(n, same, refs[n]) for n in "abc"] + [ask("base", same)]
    tokens, failed = drive(runner, {0: requests})
    assert not failed
    for r in requests:
        assert tokens[r.request_id] == alone(runner, [r])[r.request_id]
    assert len({tuple(t) for t in tokens.values()}) == 4


def test_a_mismatched_adapter_fails_its_own_request_only(setup, tmp_path):
    from mlxd.scripts import tiny_models as tm

    model_dir, adapters, _ = setup
    runner, _ = load(model_dir)
    bad = tm.build_lora_adapter(model_dir, tmp_path / "bad", rank=4, seed=9)
    tensors_file = bad / "adapters.safetensors"
    import mlx.core as mx

    tensors = mx.load(str(tensors_file))
    name = next(n for n in tensors if n.endswith("lora_a"))
    tensors[name] = mx.zeros((tensors[name].shape[0] + 3, tensors[name].shape[1]))
    mx.save_safetensors(str(tensors_file), tensors)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "lora"}))
    (broken / "adapters.safetensors").write_bytes(b"\x00" * 4)
    requests = [
        ask("base", PROMPTS["base"]),
        ask("good", PROMPTS["a"], ref("a", adapters["a"])),
        ask("bad", PROMPTS["b"], ref("bad", bad)),
        ask("broken", PROMPTS["c"], ref("broken", broken)),
    ]
    tokens, failed = drive(runner, {0: requests})
    assert set(failed) == {"bad", "broken"}
    assert "maps" in failed["bad"].message and name.rsplit(".", 1)[0] in failed["bad"].message
    assert failed["bad"].reason == "invalid_request"
    assert "lora_parameters" in failed["broken"].message
    assert tokens["good"] == alone(runner, [requests[1]])["good"]
    assert tokens["base"] == alone(runner, [requests[0]])["base"]


@pytest.mark.parametrize("kind", ["lora", "dora"])
def test_a_quantized_base_serves_adapters_as_mlx_lm_applies_them(tiny_models, tmp_path, kind):
    """A quantized base (``QuantizedLinear``; DoRA's norm over its dequantized weight):
    an adapter row in a batch with a base row writes what mlx-lm's own adapter layers
    (``load_adapters``, unfused: fusing would quantize again) write alone."""
    import mlx.nn as nn
    from mlx_lm.tuner.utils import load_adapters
    from mlxd.actors.engine.adapters.bank import AdapterBank
    from mlxd.actors.engine.runner.base import MlxRunner
    from mlxd.scripts import tiny_models as tm

    model_dir = tiny_models("llama")
    adapter = tm.build_lora_adapter(model_dir, tmp_path / kind, kind=kind, rank=4, seed=4)

    def quantized():
        runner, info = load(model_dir)
        nn.quantize(runner.model, group_size=32, bits=8)
        return runner.model, sorted(info.tokenizer.eos_token_ids)

    model, stops = quantized()
    bank = AdapterBank(model, "q", max_adapters=2, memory_bytes=1 << 30)
    served = MlxRunner(model, stops, 8, adapters=bank)
    requests = [ask("tuned", PROMPTS["a"], ref("t", adapter)), ask("base", PROMPTS["base"])]
    tokens, failed = drive(served, {0: requests})
    assert not failed
    reference, _ = quantized()
    reference = load_adapters(reference, str(adapter))
    want = alone(MlxRunner(reference, stops, 8), [ask("tuned", PROMPTS["a"])])["tuned"]
    assert tokens["tuned"] == want
    assert tokens["base"] == alone(served, [requests[1]])["base"]
