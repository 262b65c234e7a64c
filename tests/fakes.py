"""Scripted fakes for everything above the MLX runner: a char tokenizer and a runner."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from mlxd.actors.engine.scheduler.memory import AttentionLayer, MemoryModel
from mlxd.actors.engine.scheduler.types import Decoded, ModelInfo
from mlxd.protocol.messages import (
    RunnerCounters,
    SpeculativeCounters,
    TokenizedRequest,
    TokenLogprob,
)

EOS = 0


class CharTokenizer:
    """One token per character (id = code point); id 0 is EOS."""

    eos_token_ids = {EOS}
    grammar_check_only = True  # constraints are validated, not enforced (see actors/grammar.py)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i != EOS)

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **extra):
        for m in messages:
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"role {m['role']} not supported by this template")
        text = "".join(f"<{k}={v}>" for k, v in sorted(extra.items()))
        text += "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


def reply_for(prompt: tuple[int, ...]) -> str:
    """The fake model's answer: the last user turn upper-cased (verbatim after a leading ``!``)."""
    text = "".join(chr(t) for t in prompt)
    last = text.rsplit("<user>", 1)[-1].removesuffix("<assistant>")
    return last[1:] if last.startswith("!") else last.upper()


def fake_logprob(token: int, top: int) -> TokenLogprob:
    """Scripted logprobs: the sampled token is the likeliest, alternatives follow it."""
    alternatives = tuple((token + i, -0.25 - i) for i in range(top))
    return TokenLogprob(token=token, logprob=-0.25, top=alternatives)


@dataclass
class _Seq:
    request: TokenizedRequest
    reply: list[int]
    emitted: int = 0
    prefilled: int = 0


def _text(seq: _Seq) -> str:
    return "".join(chr(t) for t in seq.request.prompt_tokens)


@dataclass
class FakeRunner:
    """Implements the runner protocol. Scripted failures: ``FAIL`` in a prompt makes its
    prefill raise; ``OOM`` makes the first decode step it is in raise an MLX-like
    allocation error (the whole step fails, as a real batched step would); ``CRASH``
    makes every decode step it is in raise some other error; ``BADROW``: see ``faults``.

    Like a real model it is deterministic: a request started again with its emitted
    tokens appended to its prompt (a replay) goes on with the same reply."""

    step_delay: float = 0.002
    prefilling: dict[str, _Seq] = field(default_factory=dict)
    running: dict[str, _Seq] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # rows taken out for memory, in order
    decode_steps: int = 0
    batch_sizes: list[int] = field(default_factory=list)
    cleared: int = 0
    prefill_log: list[tuple[str, int]] = field(default_factory=list)  # (request, decode step)
    resets: int = 0
    released: int = 0  # times the engine went idle and released buffers
    cache_held: int = 0  # scripted prefix-cache bytes (they share the memory budget)
    replies: dict[str, tuple[tuple[int, ...], list[int]]] = field(default_factory=dict)
    bytes_per_token: int = 1024  # the fake's "device memory" per token held
    peak: int = 0
    speculative: SpeculativeCounters | None = None  # what counters() reports for a drafter
    batches_prefill: bool = False  # True: the engine hands it several requests' chunks at once
    batch_prefill_pays: bool = True  # the engine's default when batch_prefill is "auto"
    prefill_batches: list[dict[str, int]] = field(default_factory=list)  # the budgets of each

    @property
    def decoding(self) -> int:
        return len(self.running)

    def start(self, request: TokenizedRequest) -> int:
        prompt = request.prompt_tokens
        first, reply = self.replies.get(request.request_id, (prompt, []))
        if not reply or prompt[: len(first)] != first:
            first, reply = prompt, [ord(c) for c in reply_for(prompt)] + [EOS]
        self.replies[request.request_id] = (first, reply)
        seq = _Seq(request, reply, emitted=len(prompt) - len(first))
        self.prefilling[request.request_id] = seq
        return 0

    def skipped_tokens(self, request_id: str) -> int:
        return 0

    def wait_for(self, request: TokenizedRequest) -> str | None:
        return None

    def prefill(self, request_id: str, budget: int) -> int:
        seq = self.prefilling[request_id]
        self.prefill_log.append((request_id, self.decode_steps))
        if "FAIL" in _text(seq):
            raise RuntimeError("scripted prefill failure")
        todo = len(seq.request.prompt_tokens) - 1
        seq.prefilled = min(todo, seq.prefilled + budget)
        if seq.prefilled == todo:
            self.running[request_id] = self.prefilling.pop(request_id)
            return 0
        return todo - seq.prefilled

    def prefill_batch(self, budgets: dict[str, int]) -> dict[str, int | Exception]:
        """Like the real runner: a request whose own prefill fails gets its exception."""
        self.prefill_batches.append(dict(budgets))
        out: dict[str, int | Exception] = {}
        for rid, budget in budgets.items():
            try:
                out[rid] = self.prefill(rid, budget)
            except RuntimeError as exc:
                out[rid] = exc
        return out

    def decode(self) -> list[Decoded]:
        time.sleep(self.step_delay)
        self.decode_steps += 1
        self.batch_sizes.append(len(self.running))
        self.peak = max(self.peak, self.memory_stats()[0])
        if any("OOM" in _text(seq) for seq in self.running.values()):
            raise RuntimeError(
                "[metal::malloc] Attempting to allocate 8589934592 bytes: out of memory"
            )
        if any("CRASH" in _text(seq) for seq in self.running.values()):
            raise RuntimeError("scripted batch failure")
        out = []
        for rid, seq in list(self.running.items()):
            token = seq.reply[min(seq.emitted, len(seq.reply) - 1)]
            seq.emitted += 1
            reason = "stop" if token == EOS else None
            first = len(self.replies[rid][0])
            done = seq.emitted - (len(seq.request.prompt_tokens) - first)  # of this request
            if reason is None and done >= seq.request.sampling.max_tokens:
                reason = "length"
            params = seq.request.sampling
            lp = fake_logprob(token, params.top_logprobs) if params.logprobs else None
            out.append(Decoded(rid, token, reason, lp))
            if reason:
                del self.running[rid]
        return out

    def faults(self) -> dict[str, Exception]:
        """``BADROW`` in a prompt: that row's own sampling fails in every step it is in (the
        step completes for the other rows, as the real runner's row guards make it)."""
        return {
            rid: ValueError("scripted sampler failure")
            for rid, seq in self.running.items()
            if "BADROW" in _text(seq)
        }

    def clear_cache(self) -> None:
        self.cleared += 1

    def release_buffers(self) -> None:
        self.released += 1

    def shrink_cache(self, nbytes: int) -> int:
        freed = min(nbytes, self.cache_held)
        self.cache_held -= freed
        return freed

    def remove(self, request_id: str) -> None:
        self.removed.append(request_id)
        self.prefilling.pop(request_id, None)
        self.running.pop(request_id, None)

    def preempt(self, request_id: str) -> int:
        """Like the real runner: the row goes; its "snapshot" is the bytes it held (the
        fake keeps no cache: the resume recomputes, and ``replies`` makes it go on)."""
        self.preempted.append(request_id)
        seq = self.running.get(request_id) or self.prefilling.get(request_id)
        held = self._held(request_id, seq) if seq is not None else 0
        self.remove(request_id)
        return held * self.bytes_per_token

    def _held(self, request_id: str, seq: _Seq) -> int:
        """Tokens the sequence holds: its first prompt and every token it emitted."""
        return len(self.replies[request_id][0]) + seq.emitted

    def reset(self) -> None:
        self.resets += 1
        self.running.clear()

    def memory_stats(self) -> tuple[int, int]:
        held = [*self.prefilling.items(), *self.running.items()]
        active = sum(self._held(rid, s) for rid, s in held) * self.bytes_per_token
        return active, max(self.peak, active)

    def counters(self) -> RunnerCounters:
        return RunnerCounters(speculative=self.speculative)


def fake_memory(budget_bytes: int, bytes_per_token: int = 1024, step: int = 1) -> MemoryModel:
    """A one-layer estimate for the fake model: ``bytes_per_token`` × (prompt + max_tokens)."""
    return MemoryModel(
        layers=(AttentionLayer(bytes_per_token=bytes_per_token),),
        budget_bytes=budget_bytes,
        step=step,
    )


def fake_factory(runner: FakeRunner, context_length: int = 4096, memory: MemoryModel | None = None):
    def factory():
        info = ModelInfo(
            model_id="fake-model",
            model_dir=Path("."),
            context_length=context_length,
            vocab_size=0x110000,
            tokenizer=CharTokenizer(),
            backend="fake",
            memory=memory,
        )
        return runner, info

    return factory


# ---- a scripted model under a grammar (tool calls constrained in auto mode) ----------------

# Where the script has nothing the grammar allows, a scripted model closes what is open.
_CLOSERS = '"}]\n'


class ScriptedModel:
    """A model that means to write ``script`` (token ids), masked as a real one would be.

    It writes its next script token where the grammar allows it (free text: always),
    skips blanks the grammar's layout has no room for, takes a token the grammar forces,
    else jumps to the next script token the grammar allows, else closes what is open
    (``"``, ``}``, ``]``, a newline), else takes the lowest allowed id. So a wrong key, a
    string for an integer or a call that never closes comes out repaired under a mask,
    and as scripted without one. Deterministic: no randomness.
    """

    def __init__(self, script: list[int], constraint, tokenizer, vocab: int):
        self._script, self._p = script, 0
        self._constraint = constraint  # lazy_calls.LazyCalls, a _Forced matcher, or None
        self._tok = tokenizer
        self._vocab = vocab

    def next(self) -> int:
        allowed = self._constraint.allowed(self._vocab) if self._constraint else None
        token = self._choose(allowed)
        if self._constraint is not None:
            self._constraint.consume([token])
        return token

    def _want(self, k: int) -> int:
        return self._script[min(k, len(self._script) - 1)]

    def _choose(self, allowed) -> int:
        import numpy as np

        if allowed is None:
            self._p += 1
            return self._want(self._p - 1)
        s = self._script
        while self._p < len(s) and not allowed[s[self._p]] and self._blank(s[self._p]):
            self._p += 1
        if self._p < len(s) and allowed[s[self._p]]:
            self._p += 1
            return s[self._p - 1]
        ids = np.flatnonzero(allowed)
        if len(ids) == 1:
            return int(ids[0])
        later = [k for k in range(self._p, len(s)) if allowed[s[k]]]
        if later:
            self._p = later[0] + 1
            return s[later[0]]
        for ch in _CLOSERS:
            ids_of = self._tok.encode(ch, add_special_tokens=False)
            if len(ids_of) == 1 and allowed[ids_of[0]]:
                return ids_of[0]
        return int(ids[0])

    def _blank(self, token: int) -> bool:
        text = self._tok.decode([token])
        return bool(text) and text.isspace()


class _Forced:
    """A forced grammar's matcher in the shape of ``LazyCalls``: on from the first token,
    only an end of sequence once the call is complete."""

    def __init__(self, grammar):
        from llguidance.numpy import allocate_token_bitmask

        self._g = grammar
        self._bitmask = allocate_token_bitmask(1, grammar.vocab_size)

    def allowed(self, width: int):
        import numpy as np
        from llguidance.numpy import fill_next_token_bitmask

        allowed = np.zeros(width, dtype=bool)
        matcher = self._g.matcher
        if matcher.is_stopped():
            allowed[list(self._g.eos_ids)] = True
            return allowed
        fill_next_token_bitmask(matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        allowed[: self._g.vocab_size] = bits[: self._g.vocab_size]
        return allowed

    def consume(self, tokens: list[int]) -> None:
        for t in tokens:
            if not self._g.matcher.is_stopped():
                self._g.matcher.consume_token(t)


@dataclass
class GrammarRunner(FakeRunner):
    """A fake runner whose model writes the text between the last two ``@@`` of its prompt
    (else ``OK``) in an HF tokenizer's ids, under the request's grammar (forced or lazy),
    through ``ScriptedModel``. Each row is masked on its own, as the real runner's
    logits processors are."""

    tokenizer: object = None
    models: dict = field(default_factory=dict)

    def start(self, request: TokenizedRequest) -> int:
        from mlxd.actors.lazy_calls import LazyCalls, LazyGrammar

        tok = self.tokenizer
        text = tok.decode(list(request.prompt_tokens), skip_special_tokens=False)  # type: ignore[attr-defined]
        script = text.split("@@")[-2] if text.count("@@") >= 2 else "OK"
        reply = tok.encode(script, add_special_tokens=False) + [tok.eos_token_id]  # type: ignore[attr-defined]
        g = request.grammar
        constraint = LazyCalls(g) if isinstance(g, LazyGrammar) else (_Forced(g) if g else None)
        self.models[request.request_id] = ScriptedModel(reply, constraint, tok, len(tok))  # type: ignore[arg-type]
        self.replies[request.request_id] = (request.prompt_tokens, reply)
        self.prefilling[request.request_id] = _Seq(request, reply)
        return 0

    def decode(self) -> list[Decoded]:
        self.decode_steps += 1
        self.batch_sizes.append(len(self.running))
        out = []
        for rid, seq in list(self.running.items()):
            token = self.models[rid].next()
            seq.emitted += 1
            reason = "stop" if token == self.tokenizer.eos_token_id else None  # type: ignore[attr-defined]
            if reason is None and seq.emitted >= seq.request.sampling.max_tokens:
                reason = "length"
            out.append(Decoded(rid, token, reason, None))
            if reason:
                del self.running[rid]
        return out


def grammar_factory(runner: GrammarRunner, context_length: int = 8192):
    def factory():
        info = ModelInfo(
            model_id="fake-model",
            model_dir=Path("."),
            context_length=context_length,
            vocab_size=len(runner.tokenizer),  # type: ignore[arg-type]
            tokenizer=runner.tokenizer,
            backend="fake",
        )
        return runner, info

    return factory
