"""Tiny random-weight models (and test images) for the ``mlx`` test tier and the benchmarks.

Built offline from config dicts, outside ``tests/`` so benchmarks can use them too.

Each builder writes a model directory (``config.json``, ``model.safetensors`` and the
tokenizer files) that mlxd loads exactly as it loads a real checkpoint. The tokenizer
is SmolLM2's (converted from the default GGUF), so prompts tokenize like real text; the
configs use its vocabulary size and tiny hidden sizes so every test stays fast.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np

VOCAB = 49152  # SmolLM2's vocabulary
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "generation_config.json",
)

# mlx-lm hybrids: GatedDeltaNet (ArraysCache) layers interleaved with full attention.
QWEN3_5 = {
    "model_type": "qwen3_5",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_value_heads": 4,
    "linear_num_key_heads": 2,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_conv_kernel_dim": 4,
    "full_attention_interval": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "rope_parameters": {"type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
}

# Baichuan-M1: every layer is a CacheList(ArraysCache conv state, KV cache); the
# sliding-window layers use a RotatingKVCache (window 8, shorter than the prompts).
BAICHUAN_M1 = {
    "model_type": "baichuan_m1",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rope_theta": 10000.0,
    "sliding_window": 8,
    "sliding_window_layers": [1, 3],
    "conv_window": 2,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


# Attention-only targets and drafts for speculative decoding (same vocabulary).
LLAMA = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}
LLAMA_DRAFT = {**LLAMA, "num_hidden_layers": 1}

# Agent clients (tests/test_clients.py): Claude Code's first prompt is ~21k tokens, so a
# long context, and one small layer so that prefilling it stays cheap on a CPU.
LLAMA_LONG = {
    **LLAMA,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 65536,
}

# Plain attention whose head counts divide by 2: tensor parallel over two ranks.
QWEN3 = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "vocab_size": VOCAB,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
}


def copy_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, out / name)


def build_text_model(
    config: dict[str, Any], tokenizer_dir: Path, out: Path, seed: int = 0, noise: float = 0.0
) -> Path:
    """An mlx-lm model directory with random weights for ``config``.

    ``noise`` > 0 adds that much relative Gaussian noise to every weight: with the
    same config and seed, a draft that agrees with its target only some of the time.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_map

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    mx.random.seed(seed)
    model = module.Model(module.ModelArgs.from_dict(dict(config)))
    if noise:
        mx.random.seed(seed + 1)
        model.update(
            tree_map(lambda w: w * (1 + noise * mx.random.normal(w.shape)), model.parameters())
        )
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(tokenizer_dir, out)
    return out


# A scripted model (``build_script_model``): one llama layer; its sizes follow the script.
SCRIPTED = {
    "model_type": "llama",
    "intermediate_size": 16,
    "num_hidden_layers": 1,
    "head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_theta": 100.0,
    "max_position_embeddings": 8192,
    "tie_word_embeddings": False,
}

# (the prompt's last tokens, the answer): what a scripted model writes after that prompt
Script = tuple[list[int], list[int]]


def script_steps(scripts: list[Script], context: int) -> list[tuple[tuple[int, ...], int]]:
    """Each step of the answers: (its last ``context`` tokens, oldest first, the next
    token). Raises where one context is followed by two different tokens."""
    steps: dict[tuple[int, ...], int] = {}
    for tail, answer in scripts:
        written = list(tail)
        for token in answer:
            seen = tuple(written[-context:])
            if steps.setdefault(seen, token) != token:
                raise ValueError(f"{seen} is followed by {steps[seen]} and by {token}")
            written.append(token)
    return list(steps.items())


def _script_head(steps, slot: dict[int, int], context: int) -> dict[int, np.ndarray]:
    """Each next token's weights on its context's features (token at distance d: block d),
    by a perceptron, until each step's next token scores 1 above every other and above 0
    (every unscripted token's score)."""
    n = len(slot)
    examples = []
    for seen, successor in steps:
        f = np.zeros(context * n)
        for d, token in enumerate(reversed(seen)):
            if token in slot:
                f[d * n + slot[token]] = 1.0
        examples.append((f, successor))
    weights = {s: np.zeros(context * n) for _, s in steps}
    for _ in range(1000):
        wrong = 0
        for f, want in examples:
            score = {t: float(w @ f) for t, w in weights.items()}
            rival = max((t for t in score if t != want), key=score.__getitem__, default=None)
            if score[want] < 1.0 or (rival is not None and score[rival] > score[want] - 1.0):
                weights[want] += f
                if rival is not None and score[rival] > score[want] - 1.0:
                    weights[rival] -= f
                wrong += 1
        if not wrong:
            return weights
    raise ValueError("no weights write these scripts: spell them with other tokens")


def build_script_model(
    tokenizer_dir: Path,
    scripts: list[Script],
    out: Path,
    vocab_size: int,
    context: int = 4,
    logit: float = 10.0,
) -> Path:
    """A model that writes each script's answer greedily after its prompt's last tokens: the
    next token is a function of the last ``context`` tokens. (A bigram cannot write
    Qwen3.5's call markup: each of its tags ends in the token ``>`` and a newline, itself
    one token, and what follows differs.)

    The residual stream: dimension 0 is 1 for every token; then one block per distance
    ``d`` in 0 … context - 1, one dimension per scripted token in each: the token ``d``
    back, one-hot (zero for the rest of the vocabulary). Block 0 is the embedding; head
    ``d`` of the attention fills block ``d`` (``_lookback``). The MLP writes nothing
    (``down_proj`` zero). ``lm_head`` scores each next token on these features, fitted so
    that each step's next token wins by a margin; a context of unscripted tokens scores
    every token 0 (a grammar's mask then leaves its lowest allowed id)."""
    steps = script_steps(scripts, context)
    tokens = sorted({t for seen, s in steps for t in (*seen, s)})
    n = len(tokens)
    if n > SCRIPTED["head_dim"]:
        raise ValueError(f"{n} scripted tokens: at most {SCRIPTED['head_dim']}")
    heads = context  # head 0 idles: ``context`` heads divide the hidden size
    hidden = -(-(1 + context * n) // (8 * heads)) * 8 * heads
    config = {**SCRIPTED, "vocab_size": vocab_size, "hidden_size": hidden}
    config |= {"num_attention_heads": heads, "num_key_value_heads": heads}
    embed = np.zeros((vocab_size, hidden), dtype=np.float32)
    embed[:, 0] = 1.0
    embed[tokens, 1 + np.arange(n)] = 1.0
    head = np.zeros((vocab_size, hidden), dtype=np.float32)
    slot = {t: i for i, t in enumerate(tokens)}  # offset in each block
    for successor, w in _script_head(steps, slot, context).items():
        head[successor, 1 : 1 + context * n] = logit * w
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": head}
    for name, value in _lookback(config, n, context).items():
        weights[f"model.layers.0.self_attn.{name}.weight"] = value
    return _save_llama(config, weights, tokenizer_dir, out)


def _lookback(config: dict[str, Any], n: int, context: int) -> dict[str, np.ndarray]:
    """Attention whose head ``d`` reads the token ``d`` back: constant queries and keys whose
    RoPE phases agree only at distance ``d`` (there the score exceeds the next best, at
    ``d`` ± 1, by 240 or more), and a value that copies the token's one-hot into block ``d``."""
    hidden, head_dim, heads = config["hidden_size"], config["head_dim"], context
    # RoPE pairs dimension j with j + head_dim / 2, at frequency rope_theta ** (-2j / head_dim)
    half = head_dim // 2
    theta = config["rope_theta"] ** (-np.arange(half) * 2.0 / head_dim)
    one_hot = np.sqrt(hidden / 2)  # dimension 0, or a scripted token's, after the RMSNorm
    amplitude = np.sqrt(2048 / hidden)  # the scores' scale whatever the hidden size
    q = np.zeros((heads * head_dim, hidden), dtype=np.float32)
    k, v = np.zeros_like(q), np.zeros_like(q)
    o = np.zeros((hidden, heads * head_dim), dtype=np.float32)
    for d in range(1, context):
        at = d * head_dim
        q[at : at + half, 0] = amplitude
        k[at : at + half, 0] = amplitude * np.cos(d * theta)
        k[at + half : at + head_dim, 0] = amplitude * np.sin(d * theta)
        for i in range(n):
            v[at + i, 1 + i] = 1.0
            o[1 + d * n + i, at + i] = 1.0 / one_hot
    return {"q_proj": q, "k_proj": k, "v_proj": v, "o_proj": o}


def _save_llama(
    config: dict[str, Any], arrays: dict[str, np.ndarray], tokenizer_dir: Path, out: Path
) -> Path:
    """An mlx-lm llama directory: ``arrays`` by name, every norm 1, every other weight 0."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    module = importlib.import_module("mlx_lm.models.llama")
    model = module.Model(module.ModelArgs.from_dict(dict(config)))
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name in arrays:
            weights[name] = mx.array(arrays[name])
        elif name.endswith("norm.weight"):
            weights[name] = mx.ones(value.shape, dtype=mx.float32)
        else:
            weights[name] = mx.zeros(value.shape, dtype=mx.float32)
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(tokenizer_dir, out)
    return out


def write_weight_index(out: Path) -> Path:
    """``model.safetensors.index.json`` for a one-file checkpoint: mlx-lm's ``sharded_load``
    reads it to find each pipeline stage's files."""
    import mlx.core as mx

    names = sorted(mx.load(str(out / "model.safetensors")))
    index = {"metadata": {}, "weight_map": dict.fromkeys(names, "model.safetensors")}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return out


# A Qwen3.5 hybrid whose checkpoint carries an MTP head (``mtp.*`` weights).
QWEN3_5_MTP = {**QWEN3_5, "mtp_num_hidden_layers": 1}


def build_mtp_model(
    config: dict[str, Any], tokenizer_dir: Path, out: Path, residual: float = 1.0, seed: int = 0
) -> Path:
    """A target with an ``mtp.*`` head in its safetensors, next to the model's weights.

    ``residual`` scales every layer's contribution to the residual stream (attention,
    GatedDeltaNet and MLP output projections) in target and head alike. At 0 the
    target is a bigram model (``lm_head(norm(embed(x)))``) and the head, built to
    read only the token embedding, predicts exactly what the target will: every
    draft is accepted. Between 0 and 1 the target depends on context a little and
    the head agrees with it only sometimes; at 1 the head is simply random.
    """
    import mlx.core as mx

    build_text_model(config, tokenizer_dir, out, seed)
    weights = mx.load(str(out / "model.safetensors"))
    outputs = ("o_proj.weight", "out_proj.weight", "down_proj.weight")
    weights = {k: v * residual if k.endswith(outputs) else v for k, v in weights.items()}
    mtp = random_mtp_head(config, seed + 7)
    mtp = {k: v * residual if k.endswith(outputs) else v for k, v in mtp.items()}
    if residual < 1.0:  # read the token embedding only, normalised like the target's output
        hidden = config["hidden_size"]
        mtp["fc.weight"] = mx.concatenate([mx.eye(hidden), mx.zeros((hidden, hidden))], axis=1)
        mtp["norm.weight"] = weights["language_model.model.norm.weight"]
    weights.update({f"mtp.{k}": v for k, v in mtp.items()})
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    return out


def random_mtp_head(text_config: dict[str, Any], seed: int) -> dict[str, Any]:
    """Random weights of an MTP head for ``text_config`` (names without ``mtp.``)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlxd.actors.engine.speculative.mtp import FAMILIES, MTPHead

    module_name, layer_name, args_name = FAMILIES[text_config["model_type"]]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    args = getattr(module, args_name).from_dict(dict(text_config))
    mx.random.seed(seed)
    head = MTPHead(args, getattr(module, layer_name), text_config["mtp_num_hidden_layers"])
    mx.eval(head.parameters())
    return dict(tree_flatten(head.parameters()))


# ---- vision-language models (mlx-vlm) --------------------------------------------------

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")

# Qwen2-VL's chat template, cut down: images become <|vision_start|><|image_pad|><|vision_end|>.
QWEN_VL_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Qwen2-VL's image processor, sized so a small image becomes a handful of tokens.
QWEN_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "processor_class": "Qwen2VLProcessor",
    "patch_size": 14,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "min_pixels": 56 * 56,
    "max_pixels": 112 * 112,
    "image_mean": [0.48145466, 0.4578275, 0.40821073],
    "image_std": [0.26862954, 0.26130258, 0.27577711],
    "do_rescale": True,
    "rescale_factor": 1 / 255,
    "do_normalize": True,
    "do_convert_rgb": True,
}

_QWEN_VISION = {
    "depth": 2,
    "embed_dim": 32,
    "num_heads": 2,
    "mlp_ratio": 2,
    "in_channels": 3,
    "patch_size": 14,
    "spatial_patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


_SMOLLM_SPECIALS = {"bos_token_id": 1, "eos_token_id": 2}


def _qwen_vl_ids(vocab: int) -> dict[str, int]:
    start, end, image, video = range(vocab, vocab + 4)
    return {
        "vision_start_token_id": start,
        "vision_end_token_id": end,
        "image_token_id": image,
        "video_token_id": video,
    }


def qwen2_vl_config() -> dict[str, Any]:
    """Qwen2-VL: plain attention with M-RoPE (positions after an image depend on its grid)."""
    return {
        "model_type": "qwen2_vl",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rms_norm_eps": 1e-6,
        "vocab_size": VOCAB + len(VISION_TOKENS),
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "mrope", "mrope_section": [2, 3, 3]},
        # Untied: with a tied head, random weights just repeat the input token.
        "tie_word_embeddings": False,
        **_SMOLLM_SPECIALS,
        **_qwen_vl_ids(VOCAB),
        "vision_config": {**_QWEN_VISION, "model_type": "qwen2_vl", "hidden_size": 64},
    }


def qwen3_5_vl_config() -> dict[str, Any]:
    """Qwen3.5 VLM: a hybrid (GatedDeltaNet + attention) language model behind a vision tower."""
    ids = _qwen_vl_ids(VOCAB)
    text = {
        **{k: v for k, v in QWEN3_5.items() if k != "rope_parameters"},
        "vocab_size": VOCAB + len(VISION_TOKENS),
        "rope_parameters": {
            "type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [2, 1, 1],
            "mrope_interleaved": True,
        },
    }
    return {
        "model_type": "qwen3_5",
        "text_config": text,
        **_SMOLLM_SPECIALS,
        **ids,
        "vision_config": {
            "model_type": "qwen3_5",
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": [],
        },
    }


def qwen3_5_vl_mtp_config() -> dict[str, Any]:
    """The Qwen3.5 VLM with an MTP head on its text backbone."""
    config = qwen3_5_vl_config()
    config["text_config"]["mtp_num_hidden_layers"] = 1
    return config


def _vlm_tokenizer(tokenizer_dir: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.chat_template = QWEN_VL_TEMPLATE
    tokenizer.save_pretrained(str(out))
    (out / "chat_template.jinja").write_text(QWEN_VL_TEMPLATE)
    shutil.copy(tokenizer_dir / "generation_config.json", out / "generation_config.json")


def build_vlm(config: dict[str, Any], tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    """An mlx-vlm model directory with random weights, tokenizer and image processor."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_vlm.utils import get_model_and_args, update_module_configs

    out.mkdir(parents=True, exist_ok=True)
    raw = json.loads(json.dumps(config))
    module, _ = get_model_and_args(raw)
    raw.setdefault("text_config", {})
    model_config = module.ModelConfig.from_dict(raw)
    model_config = update_module_configs(model_config, module, raw, ["text", "vision"])
    mx.random.seed(seed)
    model = module.Model(model_config)
    mx.eval(model.parameters())
    weights = dict(tree_flatten(model.parameters()))
    if config.get("text_config", {}).get("mtp_num_hidden_layers"):
        head = random_mtp_head(config["text_config"], seed + 7)
        weights.update({f"mtp.{k}": v for k, v in head.items()})
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    _vlm_tokenizer(tokenizer_dir, out)
    pre = json.dumps(QWEN_VL_PREPROCESSOR, indent=2)
    (out / "preprocessor_config.json").write_text(pre)
    (out / "video_preprocessor_config.json").write_text(pre)
    (out / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    return out


def png(width=40, height=30, seed=0) -> bytes:
    """A PNG of random pixels (``seed`` picks them)."""
    from PIL import Image

    pixels = (np.random.RandomState(seed).rand(height, width, 3) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes, mime="image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


# An embedding model: a Qwen3 body (its LM head is never run) under a sentence-transformers
# mean-pooling + normalise head; its vectors (64 dimensions) may be cut to 16 or 32.
QWEN3_EMBEDDING = {**QWEN3, "matryoshka_dimensions": [16, 32]}


def build_embedding_model(
    tokenizer_dir: Path, out: Path, pooling: str = "mean", seed: int = 0
) -> Path:
    """A ``kind = "embedding"`` model directory: random Qwen3 weights, SmolLM2's tokenizer
    and sentence-transformers' ``modules.json`` + ``1_Pooling/config.json`` naming
    ``pooling`` (mean, cls or last) and a Normalize module."""
    build_text_model(QWEN3_EMBEDDING, tokenizer_dir, out, seed)
    _sentence_transformers_files(out, pooling, QWEN3_EMBEDDING["hidden_size"])
    return out


def _sentence_transformers_files(out: Path, pooling: str, size: int) -> None:
    """``modules.json`` (transformer, pooling, normalise) and the pooling module's config."""
    modes = {"mean": "mean_tokens", "cls": "cls_token", "last": "lasttoken"}
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
        {
            "idx": 2,
            "name": "2",
            "path": "2_Normalize",
            "type": "sentence_transformers.models.Normalize",
        },
    ]
    (out / "modules.json").write_text(json.dumps(modules, indent=2))
    (out / "1_Pooling").mkdir(exist_ok=True)
    pooling_config = {"word_embedding_dimension": size}
    pooling_config |= {f"pooling_mode_{m}": m == modes[pooling] for m in modes.values()}
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config, indent=2))


# An encoder embedding model (run by mlx-embeddings): a tiny random BERT under a
# sentence-transformers cls-pooling + normalise head, with a WordPiece tokenizer trained
# here on a small corpus (BERT's [CLS] / [SEP] / [PAD] conventions; mlxd pads with id 0).
BERT = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 64,
    "max_position_embeddings": 128,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "pad_token_id": 0,
}
_CORPUS = (
    "the quick brown fox jumps over the lazy dog . embeddings turn text into vectors , "
    "and similar texts get similar vectors . mlx runs models on the cpu backend here ; "
    "an encoder reads every token at once , a decoder reads them in order . hello world !"
)


def build_bert_embedding_model(out: Path, pooling: str = "cls", seed: int = 0) -> Path:
    """A ``kind = "embedding"`` encoder directory: random BERT weights (mlx-embeddings'
    model), a WordPiece tokenizer and sentence-transformers files naming ``pooling``."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_embeddings.models import bert
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    wordpiece = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    wordpiece.train_from_iterator([_CORPUS], trainers.WordPieceTrainer(special_tokens=specials))
    cls, sep = wordpiece.token_to_id("[CLS]"), wordpiece.token_to_id("[SEP]")
    wordpiece.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=wordpiece,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    config = {**BERT, "vocab_size": wordpiece.get_vocab_size()}
    mx.random.seed(seed)
    model = bert.Model(bert.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(str(out))
    _sentence_transformers_files(out, pooling, config["hidden_size"])
    return out


# ---- LoRA adapters (per-request adapters: tests and ``bench_lora``) -----------------

LORA_KEYS = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")


def build_lora_adapter(
    model_dir: Path,
    out: Path,
    *,
    kind: str = "lora",
    rank: int = 4,
    scale: float = 2.0,
    num_layers: int = 2,
    keys: tuple[str, ...] = LORA_KEYS,
    seed: int = 0,
    spread: float = 0.2,
) -> Path:
    """An mlx-lm adapter directory as ``mlx_lm.lora`` writes one (``adapter_config.json``
    + ``adapters.safetensors``), with random ``lora_a`` / ``lora_b`` (and, for DoRA, a
    magnitude 20% off the base's row norms), on the last ``num_layers`` layers. Keys an
    architecture lacks (a hybrid's linear-attention layers) are skipped by mlx-lm."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load

    model, _ = load(str(model_dir))
    params = {"rank": rank, "scale": scale, "dropout": 0.0, "keys": list(keys)}
    linear_to_lora_layers(model, num_layers, params, use_dora=kind == "dora")
    mx.random.seed(seed)
    weights = {}
    for name, w in tree_flatten(model.trainable_parameters()):
        if name.endswith(("lora_a", "lora_b")):
            weights[name] = mx.random.normal(w.shape) * spread
        elif name.endswith(".m"):
            weights[name] = w * (1 + 0.2 * mx.random.uniform(-1, 1, w.shape))
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapters.safetensors"), weights)
    config = {"fine_tune_type": kind, "num_layers": num_layers, "lora_parameters": params}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return out


def peft_from_mlx(adapter: Path, out: Path, alpha_over_rank: float | None = None) -> Path:
    """The same adapter in PEFT's layout (``adapter_model.safetensors``: A [r, in], B
    [out, r] under ``base_model.model.``; ``lora_alpha / r`` is the scale)."""
    import mlx.core as mx

    config = json.loads((adapter / "adapter_config.json").read_text())
    lora = config["lora_parameters"]
    tensors = mx.load(str(adapter / "adapters.safetensors"))
    weights, modules = {}, set()
    for name, w in tensors.items():
        module, leaf = name.rsplit(".", 1)
        stem = f"base_model.model.{module}"
        modules.add(module.rsplit(".", 1)[1])
        if leaf == "lora_a":
            weights[f"{stem}.lora_A.weight"] = w.T
        elif leaf == "lora_b":
            weights[f"{stem}.lora_B.weight"] = w.T
        else:
            weights[f"{stem}.lora_magnitude_vector"] = w
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "adapter_model.safetensors"), weights)
    rank = lora["rank"]
    peft = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": (alpha_over_rank or lora["scale"]) * rank,
        "target_modules": sorted(modules),
        "use_dora": config["fine_tune_type"] == "dora",
        "use_rslora": False,
        "fan_in_fan_out": False,
        "bias": "none",
        "modules_to_save": None,
    }
    (out / "adapter_config.json").write_text(json.dumps(peft, indent=2))
    return out


def fuse_adapter(model: Any, adapter: Path) -> Any:
    """``model`` with an mlx-lm adapter fused in, as ``mlx_lm.fuse`` does it."""
    from mlx.utils import tree_unflatten
    from mlx_lm.tuner.utils import load_adapters

    model = load_adapters(model, str(adapter))
    fused = [(n, m.fuse()) for n, m in model.named_modules() if hasattr(m, "fuse")]
    model.update_modules(tree_unflatten(fused))
    return model
