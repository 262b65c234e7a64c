"""A model's own multi-token-prediction (MTP) head as a speculative drafter.

Qwen3.5 and Qwen3-Next checkpoints carry ``mtp.*`` weights: one (or more) extra
decoder layer that, given the target's last hidden state ``h_t`` at position ``t``
and the embedding of the token ``x_{t+1}``, predicts ``x_{t+2}``:

    g = norm(layers(fc([norm_e(embed(x_{t+1})), norm_h(h_t)])))    logits = lm_head(g)

mlx-lm's loaders drop these weights, so ``load_mtp`` reads them from the checkpoint
itself and builds the head from mlx-lm's own decoder-layer class for the family
(one full-attention layer), sharing the target's embedding and ``lm_head``.

As a drafter (``MTPDrafter``) the head keeps one attention cache per row, with one
entry per (target hidden, next token) pair. Prefill feeds it the pairs of the
prompt; each step feeds the pairs not yet in it, drafts ``d1`` from the last, then
chains ``d2..dk`` on its own outputs. After the verify pass those chained entries
are dropped and the verified pairs (the target's hidden states at the accepted
positions, with the tokens emitted there) become the next step's input, so the
head always conditions on the target's real hidden states.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import struct
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlxd.actors.engine.speculative.batch import (
    Drafter,
    SpecRow,
    drop_last,
    merge_caches,
    padded,
    split_at_head,
)

log = logging.getLogger("mlxd.mtp")

# model_type -> (mlx-lm module, its decoder-layer class, its args class); the MTP layer
# is that class built as a full-attention layer. A vision model's text backbone (the
# Qwen3.5 VLMs) uses mlx-lm's layer too: for text tokens M-RoPE is plain RoPE.
FAMILIES = {
    "qwen3_5": ("qwen3_5", "DecoderLayer", "TextModelArgs"),
    "qwen3_5_moe": ("qwen3_5", "DecoderLayer", "TextModelArgs"),
    "qwen3_next": ("qwen3_next", "Qwen3NextDecoderLayer", "ModelArgs"),
}
# Zero-centred RMSNorm weights (stored as w - 1 in Hugging Face checkpoints).
_NORMS = (
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
    "q_norm.weight",
    "k_norm.weight",
    "norm.weight",
    "pre_fc_norm_embedding.weight",
    "pre_fc_norm_hidden.weight",
)


class MTPHead(nn.Module):
    """``fc`` over [normed token embedding, normed target hidden], decoder layer(s), norm."""

    def __init__(self, args: Any, layer_cls: type, num_layers: int):
        super().__init__()
        hidden = args.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(hidden, eps=args.rms_norm_eps)
        full = replace(args, full_attention_interval=1)
        self.layers = [layer_cls(full, 0) for _ in range(num_layers)]
        self.norm = nn.RMSNorm(hidden, eps=args.rms_norm_eps)

    def __call__(self, embeds: mx.array, hidden: mx.array, cache: list[Any]) -> mx.array:
        h = self.fc(
            mx.concatenate(
                [self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], axis=-1
            )
        )
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache, strict=True):
            h = layer(h, mask=mask, cache=c)
        return self.norm(h)

    def make_cache(self) -> list[Any]:
        return [KVCache() for _ in self.layers]


# ---- loading --------------------------------------------------------------------------


def _headers(model_dir: Path) -> dict[Path, dict[str, Any]]:
    """Each safetensors file's header (names, dtypes, shapes) without reading tensors."""
    out = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            out[path] = json.loads(f.read(size))
    return out


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    return config.get("text_config") or config


def _from_hugging_face(headers: dict[Path, dict[str, Any]]) -> bool:
    """A checkpoint not converted by mlx-lm: its conv weights still have the kernel last
    (mlx-lm's own test for whether norm weights need ``+ 1``)."""
    for header in headers.values():
        for name, info in header.items():
            if name.endswith("conv1d.weight") and info["shape"][-1] != 1:
                return True
    return False


def _experts(weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """MoE experts as mlx-lm stacks them (``switch_mlp``): per-expert or fused gate/up."""
    out = dict(weights)
    fused = [k for k in out if k.endswith("mlp.experts.gate_up_proj")]
    for key in fused:
        base = key[: -len("experts.gate_up_proj")]
        gate_up = out.pop(key)
        mid = gate_up.shape[-2] // 2
        out[f"{base}switch_mlp.gate_proj.weight"] = gate_up[..., :mid, :]
        out[f"{base}switch_mlp.up_proj.weight"] = gate_up[..., mid:, :]
        out[f"{base}switch_mlp.down_proj.weight"] = out.pop(f"{base}experts.down_proj")
    pattern = re.compile(r"(.*mlp\.)experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[tuple[str, str], dict[int, mx.array]] = {}
    for key in [k for k in out if pattern.match(k)]:
        base, expert, proj = pattern.match(key).groups()  # type: ignore[union-attr]
        groups.setdefault((base, proj), {})[int(expert)] = out.pop(key)
    for (base, proj), experts in groups.items():
        out[f"{base}switch_mlp.{proj}.weight"] = mx.stack([experts[e] for e in sorted(experts)])
    return out


def mtp_weights(model_dir: Path) -> tuple[dict[str, mx.array], bool]:
    """The checkpoint's ``mtp.*`` tensors (prefix removed) and whether it is a Hugging Face
    original; empty when it has none (e.g. converted by mlx-lm, which drops them)."""
    headers = _headers(model_dir)
    out: dict[str, mx.array] = {}
    for path, header in headers.items():
        names = [n for n in header if n != "__metadata__" and re.match(r"(.*\.)?mtp\.", n)]
        if names:
            tensors = mx.load(str(path))
            out.update({n[n.index("mtp.") + 4 :]: tensors[n] for n in names})
    return out, _from_hugging_face(headers)


def load_mtp(model_dir: Path, config: dict[str, Any]) -> MTPHead:
    """The target's MTP head; ``ValueError`` saying why when it has none we can run."""
    text = _text_config(config)
    model_type = text.get("model_type", config.get("model_type", ""))
    if model_type not in FAMILIES:
        raise ValueError(f"no MTP support for {model_type!r} models (have: {sorted(FAMILIES)})")
    num_layers = int(text.get("mtp_num_hidden_layers", 0) or 0)
    weights, original = mtp_weights(model_dir)
    if not weights or num_layers == 0:
        raise ValueError("the checkpoint has no mtp.* weights (mlx-lm conversions drop them)")
    module_name, layer_name, args_name = FAMILIES[model_type]
    module = importlib.import_module(f"mlx_lm.models.{module_name}")
    args = getattr(module, args_name).from_dict(dict(text))
    head = MTPHead(args, getattr(module, layer_name), num_layers)
    if original:
        weights = {
            k: v + 1.0 if v.ndim == 1 and any(k.endswith(n) for n in _NORMS) else v
            for k, v in weights.items()
        }
    weights = _experts(weights)
    quantization = config.get("quantization")
    if quantization and any(k.endswith(".scales") for k in weights):
        nn.quantize(
            head,
            group_size=quantization["group_size"],
            bits=quantization["bits"],
            class_predicate=lambda path, _: f"{path}.scales" in weights,
        )
    head.load_weights(list(weights.items()), strict=True)
    mx.eval(head.parameters())
    return head


# ---- the drafter ----------------------------------------------------------------------


class MTPDrafter(Drafter):
    """Drafts with the target's MTP head; the batch gives it the target's hidden states."""

    wants_hidden = True

    def __init__(self, head: MTPHead, target: nn.Module, name: str = "mtp"):
        self.head, self.target, self.name = head, target, name
        body, self.lm_head = split_at_head(target)
        self.embed = body.embed_tokens
        self._prefill: dict[str, tuple[list[Any], list[int], list[mx.array]]] = {}
        self.cache: list[Any] = []
        # Per row: the (token, target hidden) pairs the head's cache lacks, oldest first.
        self.tokens: list[list[int]] = []
        self.hidden: list[mx.array] = []  # [n, H] each

    def fresh(self) -> MTPDrafter:
        return MTPDrafter(self.head, self.target, self.name)

    # -- following prefill

    def start(self, request_id: str) -> None:
        self._prefill[request_id] = (self.head.make_cache(), [], [])

    def prefilled(self, request_id: str, prompt: Sequence[int], upto: int, hidden: Any) -> None:
        """Pairs (hidden at position j, prompt token j+1) of the chunk; all but the newest
        go into the head's cache now (the newest drafts ``d1`` at the join)."""
        cache, tokens, states = self._prefill[request_id]
        n = hidden.shape[1]
        tokens.extend(prompt[upto - n + 1 : upto + 1])
        states.append(hidden[0])
        h = mx.concatenate(states, axis=0)
        if len(tokens) > 1:
            ids = mx.array(tokens[:-1])[None]
            self.head(self.embed(ids), h[None, :-1], cache)
            mx.eval([c.state for c in cache])
        self._prefill[request_id] = (cache, tokens[-1:], [h[-1:]])

    def joined(self, request_id: str, prompt: Sequence[int]) -> Any:
        cache, tokens, states = self._prefill.pop(request_id)
        if not tokens:
            # Nothing was prefilled (the whole prompt came from the prefix cache, or
            # SpecPrefill filled it): no target hidden state for the last prompt token.
            # The head starts from zeros: its first drafts are guesses; output is unaffected.
            tokens = [prompt[-1]]
            states = [mx.zeros((1, self.embed.weight.shape[-1]), self.embed.weight.dtype)]
        return cache, tokens, states[0]

    def forget(self, request_id: str) -> None:
        self._prefill.pop(request_id, None)

    # -- in the batch

    def add(self, state: Any) -> None:
        cache, tokens, hidden = state
        new = merge_caches([cache]) if cache[0].keys is not None else self._empty_batch_cache()
        if not self.tokens:
            self.cache = new
        else:
            for mine, other in zip(self.cache, new, strict=True):
                mine.extend(other)
        self.tokens.append(list(tokens))
        self.hidden.append(hidden)

    def _empty_batch_cache(self) -> list[Any]:
        return [BatchKVCache([0]) for _ in self.head.layers]

    def propose(self, rows: list[SpecRow], k: int, draw: Callable) -> list[list[int]]:
        lengths = [len(t) for t in self.tokens]
        width = max(lengths)
        ids = mx.array([t + [0] * (width - len(t)) for t in self.tokens])
        hidden = mx.stack([mx.pad(h, [(0, width - h.shape[0]), (0, 0)]) for h in self.hidden])
        embeds = self.embed(ids)
        g = padded(self.cache, lengths, lambda: self.head(embeds, hidden, self.cache))
        g = g[mx.arange(len(rows)), mx.array(lengths) - 1][:, None]
        steps = [draw(self.lm_head(g)[:, -1])]
        for _ in range(k - 1):
            g = self.head(self.embed(steps[-1][:, None]), g, self.cache)
            steps.append(draw(self.lm_head(g)[:, -1]))
        return mx.stack(steps, axis=1).tolist()

    def update(self, fed, proposed, accepted, new, k, hidden) -> None:
        if k:
            # The pending pairs stay in the cache; the k-1 chained drafts do not.
            if k > 1:
                drop_last(self.cache, [k - 1] * len(new))
            self.tokens = [list(n) for n in new]
            self.hidden = [hidden[i, : len(n)] for i, n in enumerate(new)]
            return
        for i, n in enumerate(new):  # no drafting this step: the pairs wait
            self.tokens[i].extend(n)
            self.hidden[i] = mx.concatenate([self.hidden[i], hidden[i, : len(n)]], axis=0)

    def filter(self, keep: list[int]) -> None:
        self.tokens = [self.tokens[i] for i in keep]
        self.hidden = [self.hidden[i] for i in keep]
        if not keep:
            self.cache = []
            return
        for c in self.cache:
            c.filter(keep)

    def state(self) -> list[Any]:
        return [c.state for c in self.cache] + self.hidden

    @property
    def nbytes(self) -> int:
        held = sum(c.nbytes for cache, _, _ in self._prefill.values() for c in cache)
        return held + sum(c.nbytes for c in self.cache) + sum(h.nbytes for h in self.hidden)
