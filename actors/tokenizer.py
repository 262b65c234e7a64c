"""Tokenizer / normalizer actor: admitted requests in, token ids out to the engine.

``PromptBuilder`` is the sync core: normalize messages, render the chat template
(with the request's tools and template variables), tokenize, check the prompt
against the context window and, with the model's memory estimate, against the
memory budget (the first stage that knows the token count: a request that could
never fit is refused here with the numbers, and a ``max_tokens`` shrinks to
what fits: a default always, a named one unless ``engine.max_tokens_overflow``
is ``refuse``), mark prefix-cache checkpoints, compile the request's
output constraint (JSON schema, forced tool call) and decide how the streamer
parses the output. There is one per served model (``Builders``, the model
registry in ``actors/models.py``): each request is built with its model's
tokenizer and chat template, once that model has loaded (the wait is bounded
there). For a vision model it also decodes and preprocesses the
request's images with the model's processor (``actors/vision.py``). It runs in
worker threads (templates, BPE, grammars and images are CPU work) and hands only
numpy arrays to the engine. Any failure here is that request's alone, delivered
to its mailbox: a 400 for input it cannot build (a ``RecursionError`` from
deeply nested arguments, a template error), a logged 500 for a bug. Chat
templates are the model's own or the server's (``model.chat_template``; clients
cannot send one) and transformers
renders them in Jinja's ``ImmutableSandboxedEnvironment`` (``range`` capped at
100,000 items); their input is bounded by ``server.max_body_bytes``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

import jinja2
import msgspec
import trio
from mlxd.actors import chat_template
from mlxd.actors.engine.scheduler.memory import MemoryModel
from mlxd.actors.engine.scheduler.types import ModelInfo
from mlxd.actors.families.fim import FimBuilder, FimError
from mlxd.actors.families.forced import Bounds
from mlxd.actors.families.reasoning import EffortError
from mlxd.actors.grammar import CompiledGrammar, GrammarCompiler, GrammarError
from mlxd.actors.lazy_calls import LazyGrammar
from mlxd.actors.mailbox import Mailboxes
from mlxd.actors.normalize import NormalizeError, normalize_messages
from mlxd.actors.tools import (
    TemplateTraits,
    template_source,
    template_traits,
    tool_dicts,
    with_call_ids,
)
from mlxd.actors.vision import ImageLimits, VisionError, VisionProcessor, load_images, split_images
from mlxd.protocol.messages import (
    Abort,
    AdapterRef,
    AdmittedRequest,
    ChatRequest,
    Failed,
    FimInput,
    OutputSpec,
    Reason,
    Submit,
    TokenizedRequest,
    VisionInputs,
)

log = logging.getLogger("mlxd")

# A user turn unlike any real one, to find where the system prompt's rendering ends.
_PROBE = "\u2063probe\u2063"
# What a template may raise on a partial conversation (checkpoints then skip that mark).
_TEMPLATE_ERRORS = (jinja2.TemplateError, ValueError, TypeError, KeyError)


def _shared_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# Template arguments mlxd sets itself, and the other parameters of the tokenizer's and the
# processor's apply_chat_template (not template variables): chat_template_kwargs may not set them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "add_generation_prompt", "tokenize", "documents"}
    | {"chat_template", "continue_final_message", "return_dict", "return_tensors"}
    | {"return_assistant_tokens_mask", "sanitize_control_tokens", "padding", "truncation"}
    | {"max_length", "tokenizer_kwargs", "processor_kwargs", "load_audio_from_video"}
)


class _Prompt(NamedTuple):
    text: str
    tokens: list[int]
    checkpoints: tuple[int, ...] = ()
    vision: VisionInputs | None = None


class PromptError(ValueError):
    """A request whose prompt cannot be built; becomes an HTTP 400."""

    def __init__(self, message: str, param: str | None = None, reason: Reason = "invalid_request"):
        super().__init__(message)
        self.param = param
        self.reason: Reason = reason


@dataclass(frozen=True)
class TokenizerOptions:
    """The tokenizer actor's options (the supervisor maps ``[tokenizer]``, ``[engine]``,
    ``[prefix_cache]`` and ``[vision]`` onto them)."""

    workers: int = 2  # threads that build prompts
    default_max_tokens: int = 512  # when a request names none (shrunk to fit)
    clamp_max_tokens: bool = True  # a named max_tokens that does not fit: shrunk (else a 400)
    max_prompt_tokens: int = 0  # 0: the model's context
    checkpoints: bool = True  # mark where the system prompt and the previous turn end
    max_breakpoints: int = 4  # and the ends of the last this many client cache breakpoints
    tool_format: str = "auto"  # tool-call markup, or "auto": from the chat template
    reasoning_tags: str = "auto"  # "auto", "none" or "<open>,<close>"
    image_limits: ImageLimits | None = None  # None: a text model's (no images)
    chat_template: str = ""  # the server's template, used instead of the model's; "": the model's
    # tool_choice auto: a call is held to its grammar from the family's opener on
    constrain_auto_calls: bool = True
    # the runner can hold one (not a drafting runner, not a group of ranks): else calls in
    # auto mode stay free, and a strict tool is refused
    auto_call_grammars: bool = True
    max_integer_digits: int = 18  # numbers in calls and JSON answers (``forced.Bounds``)
    max_fraction_digits: int = 10
    grammar_cache_size: int = 64  # compiled grammars kept (``GrammarCompiler``)

    def grammar_compiler(self, tokenizer: Any) -> GrammarCompiler:
        """The model's grammar compiler, with these options' bounds and cache."""
        bounds = Bounds(self.max_integer_digits, self.max_fraction_digits)
        return GrammarCompiler(tokenizer, bounds, self.grammar_cache_size)


def use_chat_template(info: ModelInfo, template: str) -> None:
    """The server's chat template in place of the model's, wherever one is read: the
    tokenizer's (text models, template traits) and the processor's (vision models)."""
    info.tokenizer.chat_template = template
    if info.processor is not None:
        info.processor.chat_template = template


class PromptBuilder:
    """Chat template + tokenizer + context, memory and output checks for one model."""

    @classmethod
    def for_model(
        cls, info: ModelInfo, options: TokenizerOptions, grammars: GrammarCompiler
    ) -> PromptBuilder:
        """The builder for the loaded model, configured by ``options``."""
        o = options
        if o.chat_template:
            use_chat_template(info, o.chat_template)
        return cls(
            info.tokenizer,
            info.context_length,
            default_max_tokens=o.default_max_tokens,
            clamp_max_tokens=o.clamp_max_tokens,
            max_prompt_tokens=o.max_prompt_tokens,
            vocab_size=info.vocab_size,
            checkpoints=o.checkpoints,
            max_breakpoints=o.max_breakpoints,
            processor=info.processor,
            image_limits=o.image_limits,
            memory=info.memory,
            traits=template_traits(info.tokenizer, o.tool_format, o.reasoning_tags),
            grammars=grammars,
            constrain_auto_calls=o.constrain_auto_calls and o.auto_call_grammars,
            auto_call_grammars=o.auto_call_grammars,
        )

    def __init__(
        self,
        tokenizer: Any,
        context_length: int,
        *,
        default_max_tokens: int,
        vocab_size: int,
        clamp_max_tokens: bool = True,
        max_prompt_tokens: int = 0,
        checkpoints: bool = True,
        max_breakpoints: int = 4,
        processor: Any = None,
        image_limits: ImageLimits | None = None,
        memory: MemoryModel | None = None,
        traits: TemplateTraits | None = None,
        grammars: GrammarCompiler | None = None,
        constrain_auto_calls: bool = True,
        auto_call_grammars: bool = True,
    ):
        self.tokenizer = tokenizer
        self.constrain_auto_calls = constrain_auto_calls
        self.auto_call_grammars = auto_call_grammars
        self.want_checkpoints = checkpoints
        self.max_breakpoints = max_breakpoints
        self.vision = VisionProcessor(processor) if processor is not None else None
        self.image_limits = image_limits
        self.default_max_tokens = default_max_tokens
        self.clamp_max_tokens = clamp_max_tokens
        self.context_length = context_length
        self.max_prompt_tokens = max_prompt_tokens or context_length
        self.vocab_size = vocab_size
        self.memory = memory
        self.traits = traits or template_traits(tokenizer, "auto", "auto")
        self.grammars = grammars or GrammarCompiler(None)
        self.fim = FimBuilder(tokenizer, template_source(tokenizer))  # its FIM tokens, if any

    def _offers_tools(self, request: ChatRequest) -> bool:
        return bool(request.tools) and request.tool_choice != "none"

    def _template_input(
        self, request: ChatRequest, text_only: bool = True
    ) -> tuple[list[dict], dict]:
        """Normalized messages and extra template variables (tools, chat_template_kwargs)."""
        messages, extra = request.messages, dict(request.template_kwargs)
        if self._offers_tools(request):
            if self.traits.tools_in_template:
                extra["tools"] = tool_dicts(request.tools)
            else:
                messages = self.traits.tool_prompt.offer(messages, request.tools)
        if not self.traits.tools_in_template:  # in the markup the tool prompt asks for
            messages = self.traits.tool_prompt.history(messages)
        elif self.traits.history_id is not None:
            messages = with_call_ids(messages, self.traits.history_id)
        if isinstance(request, ChatRequest) and request.reasoning_effort is not None:
            extra = {**self._effort_kwargs(request.reasoning_effort), **extra}
        try:
            return normalize_messages(messages, text_only=text_only), extra
        except NormalizeError as exc:
            raise PromptError(str(exc), "messages") from exc

    def _effort_kwargs(self, effort: str) -> dict:
        """The template variables of this model's family for a reasoning effort; a 400 for an
        effort its template cannot take (gpt-oss cannot turn reasoning off)."""
        try:
            return self.traits.controls.kwargs(effort)
        except EffortError as exc:
            raise PromptError(str(exc), "reasoning_effort") from exc

    def _render(self, messages: list[dict], generation_prompt: bool, extra: dict) -> str:
        return chat_template.render(self.tokenizer, messages, generation_prompt, **extra)

    def _encode(self, text: str, param: str = "messages") -> list[int]:
        return self.tokenizer.encode(utf8_text(text, param), add_special_tokens=False)

    def render_chat(
        self, request: ChatRequest, marks: bool = True
    ) -> tuple[str, list[int], tuple[int, ...]]:
        """The rendered conversation, its tokens and (``marks``) its prefix-cache checkpoints."""
        messages, extra = self._template_input(request)
        try:
            text = self._render(messages, True, extra)
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise PromptError(f"chat template error: {exc}", "messages") from exc
        tokens = self._encode(text)
        prefixes = self.breakpoint_prefixes(request) if marks else []
        if not marks or not (self.want_checkpoints or prefixes):
            return text, tokens, ()
        return text, tokens, self.checkpoints(messages, tokens, extra, text, prefixes)

    def breakpoint_prefixes(self, request: ChatRequest) -> list[list[dict]]:
        """The template input of the conversation up to each of the request's last
        ``max_breakpoints`` cache breakpoints (a breakpoint is an index into ``messages``)."""
        n = len(request.messages)
        ends = sorted({i for i in request.cache_breakpoints if 0 <= i < n})
        prefixes = []
        for i in ends[-self.max_breakpoints :] if self.max_breakpoints else ():
            upto = msgspec.structs.replace(request, messages=request.messages[: i + 1])
            try:
                prefixes.append(self._template_input(upto)[0])
            except PromptError:
                continue  # a prefix that does not normalize on its own: no snapshot there
        return prefixes

    def checkpoints(
        self,
        messages: list[dict],
        tokens: list[int],
        extra: dict,
        text: str = "",
        prefixes: list[list[dict]] | None = None,
    ) -> tuple[int, ...]:
        """Where the system prompt ends and where the previous turn ends (unless
        ``checkpoints`` is off), and where each of ``prefixes`` (the conversation up to a
        client's cache breakpoint) ends, in ``tokens``.

        The system boundary is where this conversation's rendering stops agreeing
        with the rendering of the same system prompt and a different user turn, so
        it holds for any template (ChatML, Llama 3, Gemma, ...) without knowing its markers.
        A prefix's end counts only where the full prompt's tokens start with that prefix's
        own tokens (rendered without a generation prompt), so a snapshot there is exact.
        """
        marks, ends = set(), []
        if self.want_checkpoints:
            marks.add(self._system_end(messages, tokens, extra))
            ends = [messages[:-1]] if len(messages) > 1 else []
        ends += [p for p in prefixes or () if p not in ends]
        marks |= {self._prefix_end(end, tokens, extra, text) for end in ends}
        return tuple(sorted(m for m in marks if 0 < m < len(tokens) - 1))

    def _system_end(self, messages: list[dict], tokens: list[int], extra: dict) -> int:
        system = [m for m in messages if m["role"] == "system"]
        try:
            probe = self._render([*system, {"role": "user", "content": _PROBE}], True, extra)
        except _TEMPLATE_ERRORS:
            return 0  # a template that needs a full conversation: no snapshot there
        return _shared_prefix(tokens, self._encode(probe))

    def _prefix_end(self, messages: list[dict], tokens: list[int], extra: dict, text: str) -> int:
        """How many of ``tokens`` the rendering of ``messages`` is, if they start with it
        (else 0). A rendering that is not a prefix of the prompt's ``text`` is not encoded
        (its tokens would not match, unless the tokenizer normalizes text: then a mark is
        missed, never misplaced)."""
        try:
            rendered = self._render(messages, False, extra)
            if text and not text.startswith(rendered):
                return 0
            prefix = self._encode(rendered)
        except _TEMPLATE_ERRORS:
            return 0  # a template that needs a full conversation: no snapshot there
        return len(prefix) if tokens[: len(prefix)] == prefix else 0

    def vision_chat(self, request: ChatRequest) -> _Prompt:
        """A vision model's prompt: the whole conversation through its processor.

        Tools and template variables reach the processor's template as they reach a
        text model's (``_template_input``); the rendered text is kept for the output spec.
        """
        assert self.vision is not None
        assert self.image_limits is not None
        messages, extra = self._template_input(request, text_only=False)
        try:
            messages, sources = split_images(messages)
            prompt = self.vision.render(messages, extra)
            if not sources:
                return _Prompt(prompt, self._encode(prompt))
            images = load_images(sources, self.image_limits)
            tokens, arrays = self.vision.encode(utf8_text(prompt, "messages"), images)
        except VisionError as exc:
            raise PromptError(str(exc), "messages") from exc
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise PromptError(
                f"chat template or image processing error: {exc}", "messages"
            ) from exc
        return _Prompt(prompt, tokens, (), VisionInputs(images=len(images), arrays=arrays))

    def prompt(self, request: AdmittedRequest) -> _Prompt:
        """Prompt text (chat only), tokens, checkpoints and image inputs of a request."""
        if isinstance(request, ChatRequest) and self.vision is not None:
            return self.vision_chat(request)
        if isinstance(request, ChatRequest):
            return _Prompt(*self.render_chat(request))
        if request.fim is not None:
            return _Prompt("", *self.fim_tokens(request.fim))
        if isinstance(request.prompt, str):
            return _Prompt("", self.tokenizer.encode(utf8_text(request.prompt, "prompt")))
        bad = [t for t in request.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}", "prompt")
        return _Prompt("", list(request.prompt))

    def fim_tokens(self, fim: FimInput) -> tuple[list[int], tuple[int, ...]]:
        """A fill-in-the-middle prompt in this model's FIM tokens, and its prefix-cache
        checkpoints (a 400 naming ``fim.param`` for a model without FIM tokens)."""
        for name in ("prefix", "suffix", "middle"):
            utf8_text(getattr(fim, name), fim.param)
        for f in fim.files:
            utf8_text(f.filename + f.text, fim.param)
        try:
            return self.fim.tokens(fim)
        except FimError as exc:
            raise PromptError(f"{fim.param}: {exc}", fim.param) from exc

    def tokens(self, request: AdmittedRequest) -> list[int]:
        """The prompt's tokens alone (count_tokens): no checkpoint probes."""
        if isinstance(request, ChatRequest) and self.vision is None:
            return self.render_chat(request, marks=False)[1]
        return self.prompt(request).tokens

    def output_spec(self, request: AdmittedRequest, prompt: str) -> OutputSpec:
        """How the streamer reads this request's output (stop strings, tool calls, reasoning)."""
        stop = request.sampling.stop
        if not isinstance(request, ChatRequest):
            return OutputSpec(stop=stop, end_ids=self.fim.ends if request.fim else ())
        traits, offers = self.traits, self._offers_tools(request)
        tags = traits.reasoning if request.parse_reasoning else None
        # a format whose parser reads the reasoning channel runs even without tools
        channels = traits.reasoning_in_parser and request.parse_reasoning
        return OutputSpec(
            stop=stop,
            tool_format=traits.tool_format if offers or channels else None,
            reasoning=tags,
            in_reasoning=bool(tags) and prompt.rstrip().endswith(tags[0]),  # type: ignore[index]
            single_tool_call=not request.parallel_tool_calls,
            tools=request.tools if offers else (),
        )

    def grammar(
        self, request: AdmittedRequest, spec: OutputSpec | None = None, prompt: str = ""
    ) -> CompiledGrammar | LazyGrammar | None:
        """The request's constraint compiled; where the prompt opened a reasoning block
        (``spec.in_reasoning``), the constrained answer first closes it."""
        if request.constraint is None:
            return self.lazy_grammar(request, prompt) if isinstance(request, ChatRequest) else None
        tools = request.tools if isinstance(request, ChatRequest) else ()
        prefix = spec.reasoning[1] + "\n" if spec and spec.in_reasoning and spec.reasoning else ""
        try:
            return self.grammars.compile(request.constraint, tools, self.traits.tool_format, prefix)
        except GrammarError as exc:
            raise PromptError(str(exc), request.constraint.param) from exc

    def lazy_grammar(self, request: ChatRequest, prompt: str) -> LazyGrammar | None:
        """``tool_choice: auto``: the grammar a call is held to once the model opens one
        (``actors/lazy_calls.py``). On where the request's ``constrain_calls`` or, unset,
        the server's ``constrain_auto_calls`` says so, and wherever a tool says ``strict:
        true``; where only that, the other tools take any arguments. ``strict: false``
        promises nothing and changes nothing. A schema the grammar cannot take (a keyword
        llguidance lacks) leaves the calls free, unless a tool is strict (a 400, as for a
        forced call)."""
        if request.tool_choice != "auto" or not request.tools:
            return None
        strict = any(t.strict for t in request.tools)
        if not self.auto_call_grammars:
            if strict:  # a promise this runner cannot keep is refused, not broken
                raise PromptError(
                    "a tool with strict: true needs its calls held to its schema, which this "
                    "model's runner cannot do under speculative decoding (speculative.enabled) "
                    "or over several ranks (distributed.parallel)",
                    "tools",
                )
            return None
        wanted = request.constrain_calls
        if wanted is None:
            wanted = self.constrain_auto_calls
        if not strict and not wanted:
            return None
        free = frozenset() if wanted else frozenset(t.name for t in request.tools if not t.strict)
        tags = self.traits.reasoning
        opened = bool(tags) and prompt.rstrip().endswith(tags[0])  # type: ignore[index]
        try:
            return self.grammars.compile_lazy(
                request.tools,
                self.traits.tool_format,
                tags,
                opened,
                free,
                parallel=request.parallel_tool_calls,
            )
        except GrammarError as exc:
            if strict:  # the arguments were promised to match: refused, as a forced call
                raise PromptError(str(exc), "tools") from exc
            log.info("tool calls of this request left free (%s)", str(exc).partition("\n")[0])
            return None

    def build(self, request: AdmittedRequest) -> TokenizedRequest:
        p = self.prompt(request)
        if not p.tokens:
            raise PromptError("the prompt is empty", "prompt")
        sampling = request.sampling
        max_tokens = self._max_tokens(len(p.tokens), sampling.max_tokens)
        self._check_memory(len(p.tokens), max_tokens)
        output = self.output_spec(request, p.text)
        return TokenizedRequest(
            request_id=request.request_id,
            prompt_tokens=tuple(p.tokens),
            sampling=msgspec.structs.replace(sampling, max_tokens=max_tokens),
            checkpoints=p.checkpoints,
            cache_key=request.cache_key if isinstance(request, ChatRequest) else "",
            vision=p.vision,
            priority=request.priority,
            output=output,
            grammar=self.grammar(request, output, p.text),
        )

    def _max_tokens(self, prompt: int, asked: int | None) -> int:
        """The client's max_tokens, shrunk to the context and memory left after the prompt
        (``clamp_max_tokens``; else refused when it does not fit the context); a default
        always shrinks to fit."""
        if prompt > self.max_prompt_tokens or prompt >= self.context_length:
            limit = min(self.max_prompt_tokens, self.context_length - 1)
            raise PromptError(
                f"the prompt has {prompt} tokens; the limit is {limit} "
                "(engine.max_prompt_tokens, or the model's context)",
                "messages",
            )
        if asked is None or self.clamp_max_tokens:
            wanted = self.default_max_tokens if asked is None else asked
            limit = min(wanted, self.context_length - prompt)
            fits = self.memory.max_tokens_fitting(prompt, limit) if self.memory else limit
            return max(fits, 1)  # 1 that does not fit is refused by _check_memory
        max_tokens = asked
        if prompt + max_tokens > self.context_length:
            raise PromptError(
                f"this model's context is {self.context_length} tokens; the request needs "
                f"{prompt + max_tokens} ({prompt} in the prompt, {max_tokens} for the completion); "
                'engine.max_tokens_overflow = "clamp" would lower max_tokens to fit',
                "max_tokens",
            )
        return max_tokens

    def _check_memory(self, prompt: int, max_tokens: int) -> None:
        """A request whose estimate exceeds the whole budget could never run: refuse it now."""
        m = self.memory
        if m is not None and m.request_bytes(prompt, max_tokens) > m.budget_bytes:
            raise PromptError(
                m.too_large_message(prompt, max_tokens), "max_tokens", reason="request_too_large"
            )


def utf8_text(text: str, param: str) -> str:
    """``text``, if it can be UTF-8 (what tokenizers take). A JSON ``\\ud800``-``\\udfff``
    escape without its pair decodes to a lone surrogate, which cannot: a 400, not a
    tokenizer error."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PromptError(
            f"the text holds an unpaired UTF-16 surrogate (U+{ord(exc.object[exc.start]):04X}): "
            "JSON \\ud800-\\udfff escapes must come in high-low pairs",
            param,
        ) from exc
    return text


def bad_input(exc: Exception) -> PromptError | None:
    """The 400 for an exception that a request's content causes while its prompt is
    built (too deep to render, a template that rejects it); None for anything else."""
    if isinstance(exc, PromptError):
        return exc
    if isinstance(exc, RecursionError):
        return PromptError(
            "the request is nested too deeply to render its prompt (tool-call arguments, "
            "chat_template_kwargs or content)",
            "messages",
            reason="too_deeply_nested",
        )
    if isinstance(exc, jinja2.TemplateError):  # the sandbox's SecurityError included
        return PromptError(f"chat template error: {exc}", "messages")
    return None


def request_failure(request_id: str, exc: Exception) -> Failed:
    """The request's ``Failed`` for an exception while it was built: 400 for bad input,
    500 (and the traceback in the log) for a bug. Either way only this request fails."""
    error = bad_input(exc)
    if error is None:
        log.error("request %s: building the prompt failed", request_id, exc_info=exc)
        return Failed(
            request_id=request_id,
            reason="internal_error",
            message=f"internal error while building the prompt ({type(exc).__name__}: {exc}); "
            "the server log has the traceback",
        )
    return Failed(
        request_id=request_id,
        reason=error.reason,
        message=str(error),
        param=error.param,
    )


class ModelUnavailable(Exception):
    """The request's model cannot serve it now (it failed to load, or the request may not
    wait longer for the load): carries the request's ``Failed``."""

    def __init__(self, failed: Failed):
        super().__init__(failed.message)
        self.failed = failed


class Builders(Protocol):
    """Each served model's ``PromptBuilder`` (``actors/models.py``, the model registry)."""

    default: str  # the model of requests that name none

    async def prepare(self, model: str, request_id: str | None) -> PromptBuilder:
        """The model's builder once it is loaded; raises ``ModelUnavailable``."""
        ...

    def target(self, model: str, request_id: str) -> tuple[str, AdapterRef | None]:
        """The engine's model for a request on ``model`` and the LoRA adapter it decodes
        with (an adapter's id: its base's and its own); raises ``ModelUnavailable``."""
        ...


class OneModel:
    """``Builders`` for a single, loaded model (tests and tools that build one graph)."""

    def __init__(self, builder: PromptBuilder, model: str = ""):
        self.builder, self.default = builder, model

    async def prepare(self, model: str, request_id: str | None) -> PromptBuilder:
        return self.builder

    def target(self, model: str, request_id: str) -> tuple[str, AdapterRef | None]:
        return model, None


async def _tokenize_one(
    request: AdmittedRequest,
    builders: Builders,
    limiter: trio.CapacityLimiter,
    outbox: trio.MemorySendChannel[Submit | Abort],
    mailboxes: Mailboxes,
) -> None:
    rid, model = request.request_id, request.model or builders.default
    if _gone(mailboxes, rid):
        return
    try:
        builder = await builders.prepare(model, rid)  # waits while the model loads
    except ModelUnavailable as exc:
        mailboxes.deliver(msgspec.structs.replace(exc.failed, request_id=rid))
        return
    async with limiter:
        if _gone(mailboxes, rid):  # the client left while this waited: skip its work
            await outbox.send(Abort(request_id=rid))  # and unpin its model
            return
        try:
            tokenized = await trio.to_thread.run_sync(builder.build, request)
        except Exception as exc:  # the request's failure, never the actor's
            mailboxes.deliver(request_failure(rid, exc))
            return
    if _gone(mailboxes, rid):  # the client left (or the drain ended it): no orphan work
        await outbox.send(Abort(request_id=rid))
        return
    try:  # an adapter's request: its base's model, with the adapter
        base, adapter = builders.target(model, rid)
    except ModelUnavailable as exc:
        mailboxes.deliver(msgspec.structs.replace(exc.failed, request_id=rid))
        return
    tokenized = msgspec.structs.replace(tokenized, model=base, adapter=adapter)
    await outbox.send(Submit(request=tokenized))


def _gone(mailboxes: Mailboxes, request_id: str) -> bool:
    box = mailboxes.get(request_id)
    return box is None or box.ended


async def run(
    inbox: trio.MemoryReceiveChannel[AdmittedRequest],
    outbox: trio.MemorySendChannel[Submit | Abort],
    mailboxes: Mailboxes,
    builders: Builders,
    options: TokenizerOptions,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Tokenize each admitted request with its model's builder, in a worker thread
    (``options.workers`` at once), and submit it to the engine."""
    limiter = trio.CapacityLimiter(options.workers)
    task_status.started()
    async with inbox, outbox, trio.open_nursery() as nursery:
        async for request in inbox:
            nursery.start_soon(_tokenize_one, request, builders, limiter, outbox, mailboxes)
