"""GGUF conversion on tiny synthetic files: every common tensor type, every architecture.

Each test writes a random-weight GGUF with ``gguf.GGUFWriter`` the way llama.cpp lays one out
(llama's Q/K rows in its interleaved-RoPE order, Gemma's norms stored as 1 + w, Phi-3's fused
projections), converts it, and checks the mlx-lm model's logits against a numpy forward pass
that follows llama.cpp's semantics on the GGUF tensors themselves (interleaved "normal" RoPE
for llama, NEOX for the others, ``rope_freqs`` dividing the angles). A converter that skipped
the un-permutation, the norm offset or the RoPE scaling would fail these.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter, quants
from mlxd.actors.engine.loading.gguf.arch import UnsupportedModel, llama3_rope_scaling
from mlxd.actors.engine.loading.gguf.convert import convert_gguf
from mlxd.actors.engine.loading.gguf.tensors import Storage

pytestmark = pytest.mark.mlx

T = GGMLQuantizationType
ALL_TYPES = [
    T.F32, T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0,
    T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K,
]  # fmt: skip
# K-quant blocks: byte offsets of the f16 super-block scales (d, then dmin where there is one).
_K_SCALES = {T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM = 256, 512, 4, 2, 64
EPS = 1e-6
TOKENS = [5, 17, 3, 30, 8, 12, 25, 1, 9, 14]


# ---- writing a file ----------------------------------------------------------------------


def encode(x: np.ndarray, qtype: T, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(bytes or floats to write, the float64 values the file then holds)."""
    if qtype == T.F32:
        return x.astype(np.float32), x.astype(np.float32).astype(np.float64)
    if qtype == T.F16:
        return x.astype(np.float16), x.astype(np.float16).astype(np.float64)
    if qtype in _K_SCALES:  # gguf cannot quantize K types: random blocks, scaled to std 0.05
        size, block = quants.GGML_QUANT_SIZES[qtype]
        raw = rng.integers(0, 256, (x.shape[0], x.shape[1] // size * block), dtype=np.uint8)
        blocks = raw.reshape(x.shape[0], -1, block)
        for offset in _K_SCALES[qtype]:
            blocks[..., offset : offset + 2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
        std = quants.dequantize(raw, qtype).std()
        for offset in _K_SCALES[qtype]:
            scale = np.frombuffer(np.float16(0.05 / std).tobytes(), np.uint8)
            blocks[..., offset : offset + 2] = scale
    else:
        raw = quants.quantize(x.astype(np.float32), qtype)
    return raw, quants.dequantize(raw, qtype).astype(np.float64)


class Writer:
    """Collects metadata and tensors; ``truth`` holds what each tensor dequantizes to."""

    def __init__(self, arch: str, seed: int):
        self.arch, self.rng = arch, np.random.default_rng(seed)
        self.meta: dict[str, object] = {}
        self.tensors: dict[str, tuple[np.ndarray, T]] = {}
        self.truth: dict[str, np.ndarray] = {}
        self.types: dict[str, T] = {}
        self._next_type = seed

    def key(self, name: str, value: object) -> None:
        self.meta[
            name if name.startswith(("general.", "tokenizer.")) else f"{self.arch}.{name}"
        ] = value

    def matrix(self, name: str, rows: int, cols: int, std: float = 0.05) -> None:
        """A 2-D weight, in the next of ALL_TYPES (so each file cycles through every type)."""
        qtype = ALL_TYPES[self._next_type % len(ALL_TYPES)]
        self._next_type += 1
        self.add(name, self.rng.normal(0, std, (rows, cols)), qtype)

    def vector(self, name: str, n: int, mean: float = 1.0, std: float = 0.1) -> None:
        self.add(name, self.rng.normal(mean, std, (n,)), T.F32)

    def add(self, name: str, x: np.ndarray, qtype: T) -> None:
        raw, self.truth[name] = encode(x, qtype, self.rng)
        self.tensors[name], self.types[name] = (raw, qtype), qtype

    def write(self, path: Path) -> Path:
        w = GGUFWriter(str(path), self.arch)
        for name, value in self.meta.items():
            _add_key(w, name, value)
        for name, (raw, qtype) in self.tensors.items():
            float_raw = qtype in (T.F32, T.F16)
            w.add_tensor(name, raw, raw_dtype=None if float_raw else qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path


def _add_key(w: GGUFWriter, name: str, value: object) -> None:
    if isinstance(value, bool):
        w.add_bool(name, value)
    elif isinstance(value, int):
        w.add_uint32(name, value)
    elif isinstance(value, float):
        w.add_float32(name, value)
    elif isinstance(value, str):
        w.add_string(name, value)
    else:
        w.add_array(name, value)


def sentencepiece_vocab(w: Writer) -> int:
    """A llama.cpp SentencePiece vocabulary: <unk> <s> </s>, bytes, letters, ▁letters."""
    tokens = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(97, 123)]
    tokens += ["\u2581" + chr(c) for c in range(97, 123)] + ["\u2581"]
    w.key("tokenizer.ggml.model", "llama")
    w.key("tokenizer.ggml.tokens", tokens)
    w.key("tokenizer.ggml.scores", [0.0, 0.0, 0.0] + [-float(i) for i in range(len(tokens) - 3)])
    w.key("tokenizer.ggml.token_type", [2, 3, 3] + [1] * (len(tokens) - 3))
    w.key("tokenizer.ggml.bos_token_id", 1)
    w.key("tokenizer.ggml.eos_token_id", 2)
    w.key("tokenizer.ggml.add_bos_token", True)
    return len(tokens)


def bpe_vocab(w: Writer) -> int:
    """A byte-level BPE vocabulary with merges and a chat template, as Qwen files have."""
    tokens = [chr(c) for c in range(97, 123)] + ["Ġ", "Ġa", "Ġb", "ab"]
    tokens += ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    w.key("tokenizer.ggml.model", "gpt2")
    w.key("tokenizer.ggml.pre", "qwen2")
    w.key("tokenizer.ggml.tokens", tokens)
    w.key("tokenizer.ggml.merges", ["Ġ a", "Ġ b", "a b"])
    w.key("tokenizer.ggml.token_type", [1] * (len(tokens) - 3) + [3, 3, 3])
    w.key("tokenizer.ggml.eos_token_id", len(tokens) - 3)
    w.key("tokenizer.ggml.bos_token_id", len(tokens) - 3)
    w.key("tokenizer.chat_template", CHATML)
    return len(tokens)


CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def base_keys(w: Writer, layers: int, head_dim: int = HEAD_DIM, theta: float = 10000.0) -> None:
    for name, value in {
        "block_count": layers,
        "context_length": 2048,
        "embedding_length": HIDDEN,
        "feed_forward_length": FFN,
        "attention.head_count": HEADS,
        "attention.head_count_kv": KV_HEADS,
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "attention.layer_norm_rms_epsilon": EPS,
        "rope.freq_base": theta,
    }.items():
        w.key(name, value)


def attention_tensors(w: Writer, i: int, head_dim: int = HEAD_DIM) -> None:
    w.matrix(f"blk.{i}.attn_q.weight", HEADS * head_dim, HIDDEN)
    w.matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
    w.matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
    w.matrix(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * head_dim)


def mlp_tensors(w: Writer, i: int) -> None:
    w.matrix(f"blk.{i}.ffn_gate.weight", FFN, HIDDEN)
    w.matrix(f"blk.{i}.ffn_up.weight", FFN, HIDDEN)
    w.matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)


def llama_file(path: Path, *, rope_freqs: bool = True, linear: float = 0.0) -> Writer:
    w = Writer("llama", seed=0)
    base_keys(w, 2, theta=500000.0)
    if linear:  # older long-context llamas: positions divided by the factor
        w.key("rope.scaling.type", "linear")
        w.key("rope.scaling.factor", linear)
    vocab = sentencepiece_vocab(w)
    w.matrix("token_embd.weight", vocab, HIDDEN, std=1.0)
    for i in range(2):
        w.vector(f"blk.{i}.attn_norm.weight", HIDDEN)
        attention_tensors(w, i)
        w.vector(f"blk.{i}.ffn_norm.weight", HIDDEN)
        mlp_tensors(w, i)
    w.vector("output_norm.weight", HIDDEN)
    w.matrix("output.weight", vocab, HIDDEN)
    if rope_freqs:  # Llama 3.1's factors, as llama.cpp's convert computes them
        w.add("rope_freqs.weight", llama3_factors(8.0, 1.0, 4.0, 8192, 500000.0), T.F32)
    w.write(path)
    return w


def llama3_factors(factor, low, high, original, base, dims=HEAD_DIM) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.generate_extra_tensors."""
    out = []
    for freq in 1.0 / base ** (np.arange(0, dims, 2) / dims):
        wavelen = 2 * np.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out)


def qwen_file(path: Path, arch: str, w: Writer | None = None) -> Writer:
    w = w or Writer(arch, seed=3 if arch == "qwen2" else 7)
    base_keys(w, 2, theta=1000000.0)
    vocab = bpe_vocab(w)
    w.matrix("token_embd.weight", vocab, HIDDEN, std=1.0)  # tied: no output.weight
    for i in range(2):
        w.vector(f"blk.{i}.attn_norm.weight", HIDDEN)
        attention_tensors(w, i)
        if arch == "qwen2":
            for part, rows in (("q", HEADS), ("k", KV_HEADS), ("v", KV_HEADS)):
                w.vector(f"blk.{i}.attn_{part}.bias", rows * HEAD_DIM, mean=0.0, std=0.5)
        else:
            w.vector(f"blk.{i}.attn_q_norm.weight", HEAD_DIM)
            w.vector(f"blk.{i}.attn_k_norm.weight", HEAD_DIM)
        w.vector(f"blk.{i}.ffn_norm.weight", HIDDEN)
        mlp_tensors(w, i)
    w.vector("output_norm.weight", HIDDEN)
    w.write(path)
    return w


def phi3_file(path: Path) -> Writer:
    w = Writer("phi3", seed=5)
    base_keys(w, 2)
    w.key("rope.dimension_count", HEAD_DIM // 2)  # partial rotary
    vocab = sentencepiece_vocab(w)
    w.matrix("token_embd.weight", vocab, HIDDEN, std=1.0)
    for i in range(2):
        w.vector(f"blk.{i}.attn_norm.weight", HIDDEN)
        w.matrix(f"blk.{i}.attn_qkv.weight", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)
        w.matrix(f"blk.{i}.attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
        w.vector(f"blk.{i}.ffn_norm.weight", HIDDEN)
        w.matrix(f"blk.{i}.ffn_up.weight", 2 * FFN, HIDDEN)  # gate rows, then up rows
        w.matrix(f"blk.{i}.ffn_down.weight", HIDDEN, FFN)
    w.vector("output_norm.weight", HIDDEN)
    w.matrix("output.weight", vocab, HIDDEN)
    w.write(path)
    return w


GEMMA_LAYERS, GEMMA_WINDOW = 6, 4  # layer 5 global, the rest sliding over 4 tokens


def gemma3_file(path: Path) -> Writer:
    w = Writer("gemma3", seed=11)
    base_keys(w, GEMMA_LAYERS, head_dim=128, theta=1000000.0)
    w.key("attention.sliding_window", GEMMA_WINDOW)
    vocab = sentencepiece_vocab(w)
    w.matrix("token_embd.weight", vocab, HIDDEN, std=0.1)
    for i in range(GEMMA_LAYERS):
        # llama.cpp stores Gemma's norms as 1 + w: around 1, like HF's w around 0.
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            w.vector(f"blk.{i}.{norm}.weight", HIDDEN)
        w.vector(f"blk.{i}.attn_q_norm.weight", 128)
        w.vector(f"blk.{i}.attn_k_norm.weight", 128)
        attention_tensors(w, i, head_dim=128)
        mlp_tensors(w, i)
    w.vector("output_norm.weight", HIDDEN)
    w.write(path)
    return w


# ---- the reference forward pass (llama.cpp semantics, float64) ---------------------------


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float = EPS) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight


def rope(
    x: np.ndarray, n_rot: int, base: float, neox: bool, factors=None, linear: float = 1.0
) -> np.ndarray:
    """x: (tokens, heads, dim). llama.cpp's RoPE: NEOX rotates (j, j + n_rot/2), normal (2j, 2j+1)."""
    inv = base ** (-np.arange(0, n_rot, 2) / n_rot)
    if factors is not None:
        inv = inv / factors
    angle = np.arange(x.shape[0])[:, None, None] / linear * inv
    cos, sin = np.cos(angle), np.sin(angle)
    out = x.copy()
    lo, hi = (
        (slice(0, n_rot // 2), slice(n_rot // 2, n_rot))
        if neox
        else (slice(0, n_rot, 2), slice(1, n_rot, 2))
    )
    a, b = x[..., lo], x[..., hi]
    out[..., lo], out[..., hi] = a * cos - b * sin, a * sin + b * cos
    return out


def attention(q, k, v, scale: float, window: int | None = None) -> np.ndarray:
    n = q.shape[0]
    k, v = (np.repeat(t, q.shape[1] // k.shape[1], axis=1) for t in (k, v))
    scores = np.einsum("qhd,khd->hqk", q, k) * scale
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    hidden = (j > i) | ((i - j >= window) if window else False)
    scores = np.where(hidden, -np.inf, scores)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v).reshape(n, -1)


def silu(x):
    return x / (1 + np.exp(-x))


def gelu_tanh(x):
    return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x**3)))


def reference_logits(w: Writer, tokens: list[int], head: bool = True) -> np.ndarray:
    """Logits for ``tokens`` from ``w.truth`` (GGUF names and values) and ``w.meta``; with
    ``head`` False, the final norm's output instead."""
    t, arch = w.truth, w.arch
    key = lambda name, *default: w.meta.get(f"{arch}.{name}", *default)  # noqa: E731
    head_dim, heads = key("attention.key_length"), key("attention.head_count")
    eps = key("attention.layer_norm_rms_epsilon")
    x = t["token_embd.weight"][tokens]
    if arch == "gemma3":
        x = x * np.sqrt(key("embedding_length"))
    for i in range(key("block_count")):
        g = lambda name, i=i: t[f"blk.{i}.{name}"]  # noqa: E731
        h = rms_norm(x, g("attn_norm.weight"), eps)
        if arch == "phi3":
            kv_rows = w.meta["phi3.attention.head_count_kv"] * head_dim
            q, k, v = np.split(
                h @ g("attn_qkv.weight").T, [heads * head_dim, heads * head_dim + kv_rows], -1
            )
        else:
            q, k, v = (h @ g(f"attn_{p}.weight").T for p in "qkv")
        if arch == "qwen2":
            q, k, v = q + g("attn_q.bias"), k + g("attn_k.bias"), v + g("attn_v.bias")
        q, k, v = (a.reshape(len(tokens), -1, head_dim) for a in (q, k, v))
        if arch in ("qwen3", "gemma3"):
            q = rms_norm(q, g("attn_q_norm.weight"), eps)
            k = rms_norm(k, g("attn_k_norm.weight"), eps)
        n_rot, base, window = head_dim, key("rope.freq_base"), None
        if arch == "phi3":
            n_rot = w.meta["phi3.rope.dimension_count"]
        if arch == "gemma3" and (i + 1) % 6:
            base, window = 10000.0, key("attention.sliding_window")
        factors, linear = t.get("rope_freqs.weight"), key("rope.scaling.factor", 1.0)
        q, k = (rope(a, n_rot, base, arch != "llama", factors, linear) for a in (q, k))
        o = attention(q, k, v, head_dim**-0.5, window) @ g("attn_output.weight").T
        if arch == "gemma3":
            x = x + rms_norm(o, g("post_attention_norm.weight"), eps)
            h = rms_norm(x, g("ffn_norm.weight"), eps)
            m = gelu_tanh(h @ g("ffn_gate.weight").T) * (h @ g("ffn_up.weight").T)
            x = x + rms_norm(m @ g("ffn_down.weight").T, g("post_ffw_norm.weight"), eps)
            continue
        x = x + o
        h = rms_norm(x, g("ffn_norm.weight"), eps)
        if arch == "phi3":
            gate, up = np.split(h @ g("ffn_up.weight").T, 2, -1)
        else:
            gate, up = h @ g("ffn_gate.weight").T, h @ g("ffn_up.weight").T
        x = x + (silu(gate) * up) @ g("ffn_down.weight").T
    x = rms_norm(x, t["output_norm.weight"], eps)
    return x @ t.get("output.weight", t["token_embd.weight"]).T if head else x


# ---- the tests ---------------------------------------------------------------------------


def convert_and_load(path: Path, storage: Storage | None = None):
    from mlx_lm.utils import load

    model_dir = convert_gguf(path, path.parent / "cache", lambda _: None, storage=storage)
    model, tokenizer = load(str(model_dir))
    return model_dir, model, tokenizer


def logits_of(model, tokens: list[int]) -> np.ndarray:
    return np.array(model(mx.array([tokens]))[0].astype(mx.float32))


def assert_close(got: np.ndarray, want: np.ndarray, rel: float = 2e-4) -> None:
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= rel * scale, np.abs(got - want).max() / scale


BUILDERS = {
    "llama": llama_file,
    "llama_linear": lambda p: llama_file(p, rope_freqs=False, linear=4.0),
    "qwen2": lambda p: qwen_file(p, "qwen2"),
    "qwen3": lambda p: qwen_file(p, "qwen3"),
    "phi3": phi3_file,
    "gemma3": gemma3_file,
}


@pytest.mark.parametrize("arch", list(BUILDERS))
def test_converted_model_matches_the_reference_forward(arch: str, tmp_path: Path) -> None:
    w = BUILDERS[arch](tmp_path / f"{arch}.gguf")
    model_dir, model, _ = convert_and_load(tmp_path / f"{arch}.gguf", Storage("float32"))
    assert json.loads((model_dir / "config.json").read_text())["model_type"] == (
        "gemma3_text" if w.arch == "gemma3" else w.arch
    )
    assert_close(logits_of(model, TOKENS), reference_logits(w, TOKENS))


def test_every_common_type_is_read(tmp_path: Path) -> None:
    """The synthetic files between them hold each of the 13 common types."""
    types = set()
    for arch, build in BUILDERS.items():
        types |= set(build(tmp_path / f"{arch}.gguf").types.values())
    assert types == set(ALL_TYPES)


def test_converted_weights_equal_the_dequantized_tensors(tmp_path: Path, monkeypatch) -> None:
    """Tensor by tensor, before any forward pass: names, values, and llama's Q/K rows; in
    several safetensors files (shards of 1 MiB here) with Hugging Face's index."""
    import mlxd.actors.engine.loading.gguf.convert as converter
    from mlxd.actors.engine.loading.gguf.arch import unpermute_rows

    monkeypatch.setattr(converter, "_SHARD_BYTES", 1 << 20)
    w = llama_file(tmp_path / "llama.gguf")
    model_dir = convert_gguf(tmp_path / "llama.gguf", tmp_path / "c", lambda _: None)
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    files = sorted(model_dir.glob("model-*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == [f.name for f in files]
    weights = {k: v for f in files for k, v in mx.load(str(f)).items()}
    assert sorted(weights) == sorted(index["weight_map"])
    assert "rope_freqs.weight" not in weights and len(weights) == len(w.truth) - 1
    for i, heads in ((0, HEADS), (1, KV_HEADS)):
        kind = "qk"[i]
        stored = np.array(weights[f"model.layers.1.self_attn.{kind}_proj.weight"])
        truth = w.truth[f"blk.1.attn_{kind}.weight"]
        np.testing.assert_array_equal(stored, unpermute_rows(truth, heads).astype(np.float32))
    down = np.array(weights["model.layers.0.mlp.down_proj.weight"])
    np.testing.assert_array_equal(down, w.truth["blk.0.ffn_down.weight"].astype(np.float32))


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    llama_file(tmp_path / "llama.gguf")
    model_dir = convert_gguf(tmp_path / "llama.gguf", tmp_path / "c", lambda _: None)
    scaling = json.loads((model_dir / "config.json").read_text())["rope_scaling"]
    assert scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


@pytest.mark.parametrize(("low", "high"), [(1.0, 4.0), (2.0, 6.0), (0.5, 3.0)])
def test_llama3_scaling_is_recovered_from_any_ramp(low: float, high: float) -> None:
    factors = llama3_factors(32.0, low, high, 8192, 500000.0, dims=128)
    scaling = llama3_rope_scaling(factors, 500000.0, 128)
    assert scaling["factor"] == pytest.approx(32.0)
    assert scaling["low_freq_factor"] == pytest.approx(low, rel=1e-2)
    assert scaling["high_freq_factor"] == pytest.approx(high, rel=1e-2)


def test_rope_freqs_that_no_llama3_scaling_explains_are_refused() -> None:
    factors = np.linspace(1.0, 8.0, 64)[::-1].copy()  # falling: no llama3 ramp does that
    with pytest.raises(UnsupportedModel, match="rope_freqs"):
        llama3_rope_scaling(factors, 500000.0, 128)


def test_gemma3_sliding_window_with_a_rotating_cache(tmp_path: Path) -> None:
    """Decoding token by token through mlx-lm's caches (RotatingKVCache of 4 on the sliding
    layers, so it wraps) gives the reference's logits at every position."""
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    w = gemma3_file(tmp_path / "gemma3.gguf")
    model_dir, model, _ = convert_and_load(tmp_path / "gemma3.gguf", Storage("float32"))
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (GEMMA_WINDOW, 6)
    cache = make_prompt_cache(model)
    assert sum(isinstance(c, RotatingKVCache) for c in cache) == 5
    steps = [np.array(model(mx.array([[t]]), cache=cache)[0, -1]) for t in TOKENS]
    assert_close(np.stack(steps), reference_logits(w, TOKENS))


def test_affine_storage_requantizes_by_source_type(tmp_path: Path) -> None:
    """Metal/CUDA storage: 4-bit group 32 for <= 4-bit sources, 8-bit group 64 for 5-8 bit
    ones, floats kept; mlx-lm loads it from the config's quantization block (tested on CPU)."""
    w = qwen_file(tmp_path / "qwen3.gguf", "qwen3")
    model_dir, model, _ = convert_and_load(tmp_path / "qwen3.gguf", Storage("affine", mx.float32))
    quant = json.loads((model_dir / "config.json").read_text())["quantization"]
    names = {"attn_q": "self_attn.q_proj", "ffn_down": "mlp.down_proj", "token_embd": ""}
    for gguf_name, qtype in w.types.items():
        kind = gguf_name.split(".")[-2]
        if kind not in names or not gguf_name.endswith(".weight"):
            continue
        layer = (
            "model.embed_tokens"
            if kind == "token_embd"
            else (f"model.layers.{gguf_name.split('.')[1]}.{names[kind]}")
        )
        module = model.model.embed_tokens if kind == "token_embd" else _module(model, layer)
        if qtype in (T.F32, T.F16, T.BF16):
            assert not hasattr(module, "scales"), layer
            continue
        bits = 4 if qtype in (T.Q4_0, T.Q4_1, T.Q2_K, T.Q3_K, T.Q4_K) else 8
        assert (module.bits, module.group_size) == (bits, 32 if bits == 4 else 64), layer
        assert quant.get(layer, quant)["bits"] == bits
    got, want = logits_of(model, TOKENS).ravel(), reference_logits(w, TOKENS).ravel()
    assert np.dot(got, want) / np.linalg.norm(got) / np.linalg.norm(want) > 0.99


def _module(model, dotted: str):
    node = model
    for part in dotted.split("."):
        node = node[int(part)] if part.isdigit() else getattr(node, part)
    return node


def test_tokenizers_are_built_from_the_metadata(tmp_path: Path) -> None:
    llama_file(tmp_path / "llama.gguf")
    qwen_file(tmp_path / "qwen2.gguf", "qwen2")
    _, _, sp = convert_and_load(tmp_path / "llama.gguf")
    _, _, bpe = convert_and_load(tmp_path / "qwen2.gguf")
    assert sp.decode(sp.encode("ab cd")).endswith("ab cd")
    assert sp.encode("ab")[0] == 1  # BOS, as tokenizer.ggml.add_bos_token says
    # The Qwen file's chat template; the base llama file gets the plain fallback.
    chat = [{"role": "user", "content": "ab"}, {"role": "assistant", "content": "b"}]
    assert bpe.apply_chat_template(chat, tokenize=False) == (
        "<|im_start|>user\nab<|im_end|>\n<|im_start|>assistant\nb<|im_end|>\n"
    )
    assert sp.apply_chat_template(chat, tokenize=False) == "<s>ab\n\nb"
    im_end = bpe.convert_tokens_to_ids("<|im_end|>")
    assert im_end in bpe.eos_token_ids  # an end-of-turn control token stops generation


def odd_type_file(path: Path, type_id: int | None = None) -> Path:
    """A file whose embedding is Q8_1 (which `gguf` cannot dequantize), or ``type_id``."""
    w = Writer("qwen3", seed=1)
    base_keys(w, 1)
    vocab = bpe_vocab(w)
    w.tensors["token_embd.weight"] = (np.zeros((vocab, 256 // 32 * 40), np.uint8), T.Q8_1)
    w.write(path)
    if type_id is not None:  # the u32 type follows the name, n_dims and two u64 dims
        data = bytearray(path.read_bytes())
        at = data.index(b"token_embd.weight") + len("token_embd.weight") + 4 + 16
        data[at : at + 4] = type_id.to_bytes(4, "little")
        path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize(
    ("type_id", "message"),
    [
        (None, "'token_embd.weight' has type Q8_1"),
        (99, "'token_embd.weight' has unknown ggml type 99"),
    ],
)
def test_a_tensor_type_that_cannot_be_read_is_a_one_line_error(
    tmp_path: Path, type_id: int | None, message: str
) -> None:
    path = odd_type_file(tmp_path / "odd.gguf", type_id)
    with pytest.raises(UnsupportedModel, match=message) as exc:
        convert_gguf(path, tmp_path / "c", lambda _: None)
    assert "\n" not in str(exc.value)
    assert not any((tmp_path / "c").iterdir())  # nothing half-written is left


def test_gemma3_batch_with_wrapping_windows_equals_alone(tmp_path: Path) -> None:
    """Through the engine: prompts longer than the 4-token window, joining at different steps,
    so rotating caches that have wrapped sit in one batch with full ones."""
    from tests.engine_driver import alone, drive, load, request

    gemma3_file(tmp_path / "gemma3.gguf")
    model_dir = convert_gguf(tmp_path / "gemma3.gguf", tmp_path / "c", lambda _: None)
    runner, _ = load(model_dir, max_batch=4)
    prompts = [TOKENS, TOKENS[:3], TOKENS[::-1] * 2, [7, 7, 9, 11, 13, 4]]
    requests = [request(f"r{i}", p, 6 + i) for i, p in enumerate(prompts)]
    expected = alone(runner, requests, prefill_chunk_tokens=4)
    batched, failed = drive(runner, {0: requests[:2], 2: requests[2:]}, prefill_chunk_tokens=4)
    assert not failed
    assert batched == expected
    assert [len(t) for t in expected.values()] == [6, 7, 8, 9]  # no early EOS
    assert (runner.decoding, runner.prefilling_count, runner.cache_bytes) == (0, 0, 0)


def test_phi3_long_rope_factors_become_longrope_scaling(tmp_path: Path) -> None:
    w = Writer("phi3", seed=5)
    base_keys(w, 1)
    w.key("rope.dimension_count", HEAD_DIM)
    w.key("rope.scaling.original_context_length", 512)
    vocab = sentencepiece_vocab(w)
    w.matrix("token_embd.weight", vocab, HIDDEN, std=1.0)
    w.vector("blk.0.attn_norm.weight", HIDDEN)
    w.matrix("blk.0.attn_qkv.weight", (HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN)
    w.matrix("blk.0.attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
    w.vector("blk.0.ffn_norm.weight", HIDDEN)
    w.matrix("blk.0.ffn_up.weight", 2 * FFN, HIDDEN)
    w.matrix("blk.0.ffn_down.weight", HIDDEN, FFN)
    w.vector("output_norm.weight", HIDDEN)
    w.add("rope_factors_long.weight", np.linspace(1.0, 4.0, HEAD_DIM // 2), T.F32)
    w.add("rope_factors_short.weight", np.linspace(1.0, 1.5, HEAD_DIM // 2), T.F32)
    model_dir, model, _ = convert_and_load(w.write(tmp_path / "long.gguf"), Storage("float32"))
    config = json.loads((model_dir / "config.json").read_text())
    assert config["original_max_position_embeddings"] == 512
    scaling = config["rope_scaling"]
    assert scaling["type"] == "longrope"
    np.testing.assert_allclose(scaling["long_factor"], np.linspace(1.0, 4.0, HEAD_DIM // 2))
    np.testing.assert_allclose(scaling["short_factor"], np.linspace(1.0, 1.5, HEAD_DIM // 2))
    assert np.isfinite(logits_of(model, TOKENS)).all()


def test_storage_quantizes_by_source_bits_and_keeps_the_rest_float() -> None:
    """The Metal/CUDA storage on small arrays: dtypes, shapes, and the config block."""
    from mlxd.actors.engine.loading.gguf.tensors import quantization_config

    rng = np.random.default_rng(0)
    x = rng.normal(0, 1, (8, 128)).astype(np.float32)
    storage = Storage("affine", mx.bfloat16)
    four = storage.store("a.weight", x, T.Q4_K)
    eight = storage.store("b.weight", x, T.Q6_K)
    odd = storage.store("c.weight", x[:, :96], T.Q8_0)
    norm = storage.store("d.weight", x[0], T.F32)
    dense = storage.store("e.weight", x, T.F16)
    assert (four["a.weight"].shape, four["a.scales"].shape) == ((8, 16), (8, 4))  # 4 bit, g32
    assert (eight["b.weight"].shape, eight["b.scales"].shape) == ((8, 32), (8, 2))  # 8 bit, g64
    assert four["a.scales"].dtype == mx.bfloat16
    assert list(odd) == ["c.weight"] and odd["c.weight"].dtype == mx.bfloat16  # 96 % 64 != 0
    assert norm["d.weight"].dtype == dense["e.weight"].dtype == mx.bfloat16
    shapes = {
        k: tuple(v.shape) for part in (four, eight, odd, norm, dense) for k, v in part.items()
    }
    assert quantization_config(shapes) in (
        {"quantization": {"group_size": 32, "bits": 4, "b": {"group_size": 64, "bits": 8}}},
        {"quantization": {"group_size": 64, "bits": 8, "a": {"group_size": 32, "bits": 4}}},
    )
    assert quantization_config({"x.weight": (4, 4)}) == {}
    for part, prefix, bits, tol in ((four, "a", 4, 0.25), (eight, "b", 8, 0.02)):
        triple = (part[f"{prefix}.{k}"] for k in ("weight", "scales", "biases"))
        restored = mx.dequantize(*triple, group_size=32 if bits == 4 else 64, bits=bits)
        assert np.abs(np.array(restored.astype(mx.float32)) - x).max() < tol * np.abs(x).max()


def test_a_file_without_chat_template_warns_at_every_start(tmp_path: Path, caplog) -> None:
    """The warning comes with the loader's template choice, at every load (converting, then
    from the cache): this file's vocabulary has no family's turn tokens either."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer
    from mlxd.actors.families.fallback_templates import settle

    llama_file(tmp_path / "llama.gguf", rope_freqs=False)
    qwen_file(tmp_path / "qwen2.gguf", "qwen2")
    for _ in range(2):
        caplog.clear()
        target = convert_gguf(tmp_path / "llama.gguf", tmp_path / "c", lambda _: None)
        with caplog.at_level("WARNING", logger="mlxd"):
            assert settle(load_tokenizer(target)).source == "concatenation"
        assert "has no chat template" in caplog.text
    caplog.clear()
    target = convert_gguf(tmp_path / "qwen2.gguf", tmp_path / "c", lambda _: None)
    with caplog.at_level("WARNING", logger="mlxd"):
        assert settle(load_tokenizer(target)).source == "model"
    assert "chat template" not in caplog.text


def test_yarn_rope_scaling_comes_from_the_metadata(tmp_path: Path) -> None:
    """Qwen 2.5's long-context files state yarn in metadata; mlx-lm's YarnRoPE takes it."""
    w = Writer("qwen2", seed=3)
    w.key("rope.scaling.type", "yarn")
    w.key("rope.scaling.factor", 4.0)
    w.key("rope.scaling.original_context_length", 512)
    qwen_path = tmp_path / "qwen2.gguf"
    qwen_file(qwen_path, "qwen2", w)
    model_dir, model, _ = convert_and_load(qwen_path, Storage("float32"))
    config = json.loads((model_dir / "config.json").read_text())
    assert config["rope_scaling"] == {
        "type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    assert type(model.model.layers[0].self_attn.rope).__name__ == "YarnRoPE"
    assert np.isfinite(logits_of(model, TOKENS)).all()


def test_a_tensor_without_mlx_lm_equivalent_fails_before_converting(tmp_path: Path) -> None:
    w = Writer("qwen3", seed=1)
    base_keys(w, 1)
    vocab = bpe_vocab(w)
    w.add("token_embd.weight", np.zeros((vocab, HIDDEN)), T.F32)
    w.add("blk.0.ssm_conv1d.weight", np.zeros((4, 32)), T.F32)
    with pytest.raises(UnsupportedModel, match="'blk.0.ssm_conv1d.weight' has no mlx-lm"):
        convert_gguf(w.write(tmp_path / "odd.gguf"), tmp_path / "c", lambda _: None)


def test_one_part_of_a_split_file_is_refused(tmp_path: Path) -> None:
    w = Writer("qwen3", seed=1)
    base_keys(w, 1)
    bpe_vocab(w)
    w.meta["split.count"] = 3
    w.add("token_embd.weight", np.zeros((33, HIDDEN)), T.F32)
    with pytest.raises(UnsupportedModel, match="3-file split GGUF; merge"):
        convert_gguf(w.write(tmp_path / "m-00001-of-00003.gguf"), tmp_path / "c", lambda _: None)


def test_per_layer_head_counts_are_taken_when_uniform_and_refused_otherwise(tmp_path: Path) -> None:
    for counts, ok in (([KV_HEADS, KV_HEADS], True), ([KV_HEADS, 1], False)):
        w = Writer("qwen3", seed=1)
        qwen_file(tmp_path / "q.gguf", "qwen3", w)
        w.meta["qwen3.attention.head_count_kv"] = counts
        path = w.write(tmp_path / f"per-layer-{ok}.gguf")
        if ok:
            config = json.loads(
                (convert_gguf(path, tmp_path / "c", lambda _: None) / "config.json").read_text()
            )
            assert config["num_key_value_heads"] == KV_HEADS
        else:
            with pytest.raises(UnsupportedModel, match="head_count_kv differs between layers"):
                convert_gguf(path, tmp_path / "c", lambda _: None)


def test_dequantize_on_cpu_off_keeps_a_gguf_quantized_on_the_cpu_backend(tmp_path: Path) -> None:
    """``model.dequantize_on_cpu = false`` reaches the conversion: affine storage with
    float32 scales on the CPU backend; on (the default) the backend's own storage."""
    from mlxd.actors.engine.loading.load import backend, resolve_model_dir

    if backend() != "cpu":
        pytest.skip("the CPU backend's choice")
    qwen_file(tmp_path / "q.gguf", "qwen3")
    _, kept = resolve_model_dir(str(tmp_path / "q.gguf"), tmp_path, print, dequantize_on_cpu=False)
    _, floats = resolve_model_dir(str(tmp_path / "q.gguf"), tmp_path, print)
    assert kept.name.endswith("-affine") and floats.name.endswith("-float32")
    assert "quantization" in json.loads((kept / "config.json").read_text())
    assert "quantization" not in json.loads((floats / "config.json").read_text())
