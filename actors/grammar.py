"""Structured output: JSON schemas and tool calls compiled to llguidance grammars.

Why llguidance: it installs from PyPI as one wheel with no dependencies (no
torch, unlike xgrammar), builds its token trie straight from the HF tokenizer,
computes a mask in tens of microseconds on the CPU (the mask is applied with
MLX, so it works on Metal, CUDA and CPU alike), compiles JSON schemas lazily
(no up-front regex/FSM index over the vocabulary as outlines-core builds), and
has Lark grammars, which tool calls in a model's own markup need.

``GrammarCompiler`` runs in the tokenizer actor's worker threads: compiling is
CPU work and, for big schemas, slow, so it never blocks the engine thread. The
``CompiledGrammar`` (a fresh matcher per sequence) travels in the request.
No trio, no mlx.
"""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask
from mlxd.actors.families import forced, formats
from mlxd.actors.lazy_calls import LazyGrammar, OpenerGuard, TokenIndex
from mlxd.protocol.messages import Constraint, Tool

# The layout of JSON answers: one space after ``,`` and ``:`` as ``json.dumps`` writes it (the
# spacing models saw most) and no other whitespace between tokens. llguidance's default allows
# any run of whitespace there, and a small model can spend its whole max_tokens on
# ``{\n \t\r\n ...`` without ever writing a key. A schema's own ``x-guidance`` options win.
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(ValueError):
    """A schema or grammar that does not compile; becomes an HTTP 400."""


@dataclass
class CompiledGrammar:
    """A matcher ready for one sequence, with what the logits processor needs to size masks."""

    matcher: Any  # llguidance.LLMatcher
    vocab_size: int
    eos_ids: tuple[int, ...]


def tool_call_schema(
    tools: tuple[Tool, ...],
    names: tuple[str, ...],
    loose: frozenset[str] = frozenset(),
    bounds: forced.Bounds | None = None,
) -> dict:
    """JSON schema of one call ``{"name": …, "arguments": {…}}`` to one of ``names``.

    Calls are strict and take at most one space between JSON tokens
    (``forced.CALL_LAYOUT``), so that even a small model cannot wander off into extra
    keys or blanks before closing the call. A tool
    with ``strict: true`` has a schema that passed OpenAI's strict rules
    (``strict_schema_error``): it is used as it is. Tools named in ``loose`` take any
    object (a ``strict: false`` tool offered beside a strict one, in auto mode).
    """
    options = []
    for tool in tools:
        if tool.name not in names:
            continue
        params = tool.parameters or {"type": "object"}
        if tool.name in loose:
            params = {"type": "object"}
        elif not tool.strict:
            params = forced.strict(params)
        params = forced.bound_numbers(params, bounds or forced.Bounds())
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": tool.name}, "arguments": params},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    return {**schema, "x-guidance": forced.CALL_LAYOUT}


def tool_call_lark(
    schema: dict,
    fmt: str,
    split: forced.Split = forced.as_text,
    prefix: str = "",
    between: str | None = None,
) -> str:
    """A Lark grammar for one call in the markup of the format ``fmt`` (its record's
    ``calls.grammar``; none: the bare JSON object), or several where ``between`` is set;
    ``split`` says which markers are special tokens."""
    build = formats.named(fmt).calls.grammar or forced.json_call
    return forced.lark(build, schema, split, prefix, between)


# Keywords that add no constraint: a node with only these besides ``$ref`` is just the ref.
_ANNOTATIONS = frozenset(
    {"$defs", "definitions", "$id", "$schema", "$comment", "title", "description", "examples"}
)


def check_refs(schema: dict) -> None:
    """Refuse a local ``$ref`` chain that leads back to itself with nothing else in between
    (``{"$ref": "#/$defs/a"}`` where ``a`` is ``{"$ref": "#/$defs/a"}``): no value matches it,
    and wherever the model reached it, it could only stop."""
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, list):
            stack += node
        elif isinstance(node, dict):
            stack += node.values()
            _follow(schema, node)


def _follow(root: dict, node: dict) -> None:
    seen: set[str] = set()
    while isinstance(node, dict) and isinstance(node.get("$ref"), str):
        if node.keys() - _ANNOTATIONS != {"$ref"}:
            return
        ref = node["$ref"]
        if ref in seen:
            raise GrammarError(f"the schema's $ref {ref!r} refers only to itself")
        seen.add(ref)
        node = _resolve(root, ref)


def _resolve(root: dict, ref: str) -> Any:
    """A local JSON pointer (``#/$defs/a``); None for anything else."""
    if not ref.startswith("#"):
        return None
    node: Any = root
    for part in ref[1:].split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict):
            node = node.get(part)
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def strict_schema_error(schema: dict, all_required: bool = True) -> str | None:
    """Why ``strict: true`` cannot take this parameters schema, in OpenAI's words, or None.

    OpenAI's rules: the root is an object; every object, at every nesting level
    (``properties``, ``items``, ``anyOf`` / ``allOf`` / ``oneOf``, ``$defs``), sets
    ``additionalProperties: false`` and lists every one of its properties in ``required``.
    Anthropic's strict tools take optional properties (``all_required=False``).
    ``context`` is the path to the object that breaks a rule, as OpenAI writes it.
    """
    if not _is_object(schema):
        return f"schema must be a JSON Schema of 'type: \"object\"', got 'type: \"{schema.get('type')}\"'."
    stack: list[tuple[Any, tuple[str, ...]]] = [(schema, ())]
    while stack:
        node, path = stack.pop()
        if not isinstance(node, dict):
            continue
        if _is_object(node):
            problem = _strict_object(node, all_required)
            if problem:
                return f"In context={path!r}, {problem}"
        stack += reversed(list(_children(node, path)))
    return None


def _is_object(node: dict) -> bool:
    kind = node.get("type")
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


def _strict_object(node: dict, all_required: bool) -> str | None:
    if node.get("additionalProperties") is not False:
        return "'additionalProperties' is required to be supplied and to be false."
    if not all_required:
        return None
    props = node.get("properties") or {}
    required = node.get("required")
    missing = [k for k in props if not isinstance(required, list) or k not in required]
    if missing:
        return (
            "'required' is required to be supplied and to be an array including every key in "
            f"properties. Missing '{missing[0]}'."
        )
    return None


def _children(node: dict, path: tuple[str, ...]):
    """The subschemas of ``node`` with their paths."""
    for key in ("properties", "$defs", "definitions"):
        if isinstance(node.get(key), dict):
            for name, sub in node[key].items():
                yield sub, (*path, key, name)
    for key in ("anyOf", "allOf", "oneOf", "prefixItems"):
        if isinstance(node.get(key), list):
            for i, sub in enumerate(node[key]):
                yield sub, (*path, key, str(i))
    for key in ("items", "additionalProperties", "not"):
        if isinstance(node.get(key), dict):
            yield node[key], (*path, key)


class GrammarCompiler:
    """Compiles constraints against one tokenizer, and keeps the last ``cache_size``
    compiled matchers (``tokenizer.grammar_cache_size``): an agent resends the same tools
    every turn, and a request with the same grammar takes a copy instead of compiling.

    A tokenizer llguidance cannot read (not an HF fast tokenizer) makes every
    constraint a 400, except for test doubles that set ``grammar_check_only``:
    their constraints are checked against a byte-level vocabulary, then left to
    the fake runner.
    """

    def __init__(
        self,
        tokenizer: Any | None,
        bounds: forced.Bounds | None = None,
        cache_size: int = 64,
    ):
        self._llt = _llg_tokenizer(tokenizer) if tokenizer is not None else None
        self._split = _splitter(self._llt)
        self._check_only = bool(getattr(tokenizer, "grammar_check_only", False))
        self.bounds = bounds or forced.Bounds()
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # the tokenizer actor's worker threads share it
        self.compiled = 0  # matchers built (not taken from the cache), for tests and benches
        self._index: TokenIndex | None = None

    def grammar_text(
        self, constraint: Constraint, tools: tuple[Tool, ...], fmt: str, prefix: str = ""
    ) -> str:
        """``prefix``: text the answer starts with (the end of a reasoning block the prompt
        opened: a constrained answer inside it would be read as reasoning)."""
        if constraint.kind in ("json_object", "json_schema"):
            schema = (constraint.schema or {}) if constraint.kind == "json_schema" else None
            check_refs(schema or {})
            schema = {"type": "object"} if schema is None else schema
            schema = forced.bound_numbers(schema, self.bounds)
            try:
                if prefix:
                    lark = forced.json_lark(schema, JSON_LAYOUT, self._split, prefix)
                    return llguidance.LLMatcher.grammar_from_lark(lark)
                return llguidance.LLMatcher.grammar_from_json_schema(schema, JSON_LAYOUT)
            except ValueError as exc:
                raise GrammarError(f"invalid JSON schema: {exc}") from exc
        for tool in tools:
            check_refs(tool.parameters)
        schema = tool_call_schema(tools, constraint.tool_names, bounds=self.bounds)
        lark = tool_call_lark(schema, fmt, self._split, prefix)
        return llguidance.LLMatcher.grammar_from_lark(lark)

    def validate(self, grammar: str) -> None:
        error = llguidance.LLMatcher.validate_grammar(grammar, self._llt)
        if error:
            raise GrammarError(f"invalid schema: {error}")

    def _matcher(self, grammar: str, llt: Any) -> Any:
        """A fresh matcher for ``grammar``: a copy of the cached one, else compiled."""
        with self._lock:
            template = self._cache.get(grammar)
            if template is not None:
                self._cache.move_to_end(grammar)
                return template.deep_copy()
        self.validate(grammar)
        template = llguidance.LLMatcher(llt, grammar, log_level=0)
        _check_first_step(template)
        with self._lock:
            self.compiled += 1
            if self._cache_size > 0:
                self._cache[grammar] = template
                while len(self._cache) > self._cache_size:
                    self._cache.popitem(last=False)
        return template.deep_copy()

    def compile(
        self,
        constraint: Constraint,
        tools: tuple[Tool, ...] = (),
        fmt: str = "hermes",
        prefix: str = "",
    ) -> CompiledGrammar | None:
        """A matcher for the constraint (None for a check-only test tokenizer)."""
        grammar = self.grammar_text(constraint, tools, fmt, prefix)
        llt = self._llt or (_byte_tokenizer() if self._check_only else None)
        if llt is None:
            self.validate(grammar)
            raise GrammarError("structured output is not available for this model's tokenizer")
        matcher = self._matcher(grammar, llt)
        if self._llt is None:
            return None
        return CompiledGrammar(matcher, llt.vocab_size, tuple(llt.eos_tokens))

    def compile_lazy(
        self,
        tools: tuple[Tool, ...],
        fmt: str,
        reasoning: tuple[str, str] | None = None,
        in_reasoning: bool = False,
        loose: frozenset[str] = frozenset(),
        parallel: bool = True,
    ) -> LazyGrammar | None:
        """The grammar of the rest of an answer from its first call on, waiting for the
        format's opener (``actors/lazy_calls.py``): the call, then another (``parallel``,
        where the markup takes several) or the end. None where the format's calls stay free
        (``CallMarkup.free``), or the tokenizer is not one llguidance reads (a test
        double's: check only)."""
        markup = formats.named(fmt).calls
        if not markup.held or not tools:
            return None
        for tool in tools:
            check_refs(tool.parameters)
        schema = tool_call_schema(tools, tuple(t.name for t in tools), loose, self.bounds)
        between = markup.between if parallel else None
        lark = tool_call_lark(schema, fmt, self._split, "", between)
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        if self._llt is None:
            self.validate(grammar)
            return None
        matcher = self._matcher(grammar, self._llt)
        special, texts = self._openers(markup.openers)
        guard = None
        if texts and not markup.leading:
            guard = OpenerGuard(self._token_index(), matcher.deep_copy(), self._llt, texts)
        return LazyGrammar(
            matcher=matcher,
            tokenizer=self._llt,
            vocab_size=self._llt.vocab_size,
            eos_ids=tuple(self._llt.eos_tokens),
            special=special,
            text_openers=texts,
            leading=markup.leading,
            reasoning=(reasoning[0].encode(), reasoning[1].encode()) if reasoning else None,
            in_reasoning=in_reasoning,
            guard=guard,
            first_words={
                i: _first_words(matcher, i, self._llt.vocab_size)
                for i, rest in special.items()
                if not rest
            },
        )

    def _token_index(self) -> TokenIndex:
        """The vocabulary's ordinary tokens by their bytes (built once, on first need)."""
        with self._lock:
            if self._index is None:
                self._index = TokenIndex(self._llt)
            return self._index

    def _openers(self, openers: tuple[str, ...]) -> tuple[dict[int, bytes], tuple[bytes, ...]]:
        """The openers that start with a special token (its id → the text after it) and
        those that are text."""
        special: dict[int, bytes] = {}
        texts: list[bytes] = []
        for opener in openers:
            pieces = self._split(opener)
            if isinstance(pieces[0], int):
                rest = opener[len(self._llt.decode_str([pieces[0]])) :] if self._llt else ""
                special[pieces[0]] = rest.encode()
            else:
                texts.append(opener.encode())
        return special, tuple(texts)


def _first_words(matcher: Any, opener: int, vocab_size: int) -> np.ndarray:
    """The grammar's mask right after the special token ``opener`` (packed words)."""
    probe = matcher.deep_copy()
    bitmask = allocate_token_bitmask(1, vocab_size)
    probe.consume_token(opener)
    fill_next_token_bitmask(probe, bitmask)
    return bitmask[0].copy()


def _check_first_step(matcher: Any) -> None:
    """A grammar that allows no first token (a ``$ref`` that only refers to itself) is a 400,
    not an empty answer: the first mask is computed on a copy, so the matcher is untouched."""
    if matcher.is_error():
        raise GrammarError(f"invalid schema: {matcher.get_error()}")
    probe = matcher.deep_copy()
    probe.compute_bitmask()
    if probe.is_error():
        reason = probe.get_error().partition("\n")[0]
        raise GrammarError(
            f"the schema allows no output at all (llguidance: {reason}); "
            "look for a $ref that refers only to itself"
        )


def _splitter(llt: Any | None) -> forced.Split:
    """A marker's text → its pieces, each special token of ``llt`` by id: no run of text
    tokens can produce a special token, so the grammar must name it. Special tokens are
    found by their text (the longest first where two start at one place), not by asking the
    tokenizer: llguidance's ``tokenize_str`` misses one whose text holds what looks like
    another (MiniMax-M3's ``]<]minimax[>[``)."""
    if llt is None:
        return forced.as_text
    specials: dict[str, int] = {}
    for token in range(llt.vocab_size):
        if llt.is_special_token(token):
            name = llt.decode_str([token])
            if name.strip():
                specials.setdefault(name, token)
    names = sorted(specials, key=len, reverse=True)

    def split(text: str) -> list[str | int]:
        pieces: list[str | int] = []
        rest = text
        while rest:
            found = [(at, -len(n), n) for n in names if (at := rest.find(n)) >= 0]
            if not found:
                pieces.append(rest)
                break
            at, _, name = min(found)
            pieces += [rest[:at], specials[name]]
            rest = rest[at + len(name) :]
        return [p for p in pieces if p != ""]

    return split


class _Bytes:
    """A 256-byte vocabulary plus EOS, in the shape ``llguidance.TokenizerWrapper`` reads."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([b]) for b in range(256)] + [b"</s>"]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text if isinstance(text, bytes) else text.encode())


@functools.cache
def _byte_tokenizer() -> Any:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def _llg_tokenizer(tokenizer: Any) -> Any | None:
    """llguidance's view of an HF fast tokenizer (mlx-lm's wrapper unwrapped); None if unsupported.

    mlx-lm's wrapper keeps the HF tokenizer in ``_tokenizer``; a plain HF fast tokenizer
    (a vision model's processor has one) keeps its Rust ``tokenizers.Tokenizer`` there.
    """
    wrapped = getattr(tokenizer, "_tokenizer", None)
    hf = wrapped if hasattr(wrapped, "backend_tokenizer") else tokenizer
    if not hasattr(hf, "backend_tokenizer"):
        return None
    # mlx-lm's wrapper: a set of ids; a plain HF tokenizer (transformers 5): one id.
    eos = getattr(tokenizer, "eos_token_ids", None) or hf.eos_token_id
    eos = sorted(eos) if isinstance(eos, list | tuple | set | frozenset) else [eos]
    return llguidance.hf.from_tokenizer(hf, eos_token=eos)
