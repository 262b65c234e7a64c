"""Tokenizer / normalizer actor: admitted requests in, token ids out to the engine.

``PromptBuilder`` is the sync core: normalize messages, render the chat template
(with the request's tools and template variables), tokenize, check the prompt
against the context window, compile the request's output constraint (JSON
schema, forced tool call) and decide how the streamer parses the output. It
runs in worker threads (templates, BPE and grammar compilation are CPU work)
and never touches MLX. Any failure here is a 400 for that request alone,
delivered to its mailbox.
"""

from __future__ import annotations

from typing import Any

import jinja2
import msgspec
import trio

from actors.grammar import CompiledGrammar, GrammarCompiler, GrammarError
from actors.mailbox import Mailboxes
from actors.normalize import NormalizeError, normalize_messages
from actors.tools import (
    TemplateTraits,
    history_as_text,
    template_traits,
    tool_dicts,
    tool_system_prompt,
)
from protocol.messages import (
    AdmittedRequest,
    ChatRequest,
    Failed,
    Message,
    OutputSpec,
    Submit,
    TokenizedRequest,
)

# Template arguments mlxd sets itself; a request's chat_template_kwargs may not override them.
RESERVED_TEMPLATE_KWARGS = frozenset(
    {"conversation", "messages", "tools", "add_generation_prompt", "tokenize", "documents"}
)


class PromptError(ValueError):
    """A request whose prompt cannot be built; becomes an HTTP 400."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class PromptBuilder:
    """Chat template + tokenizer + context checks for one model."""

    def __init__(
        self,
        tokenizer: Any,
        context_length: int,
        *,
        default_max_tokens: int,
        vocab_size: int,
        max_prompt_tokens: int = 0,
        traits: TemplateTraits | None = None,
        grammars: GrammarCompiler | None = None,
    ):
        self.tokenizer = tokenizer
        self.default_max_tokens = default_max_tokens
        self.context_length = context_length
        self.max_prompt_tokens = max_prompt_tokens or context_length
        self.vocab_size = vocab_size
        self.traits = traits or template_traits(tokenizer, "auto", "auto")
        self.grammars = grammars or GrammarCompiler(None)

    def _offers_tools(self, request: ChatRequest) -> bool:
        return bool(request.tools) and request.tool_choice != "none"

    def render_chat(self, request: ChatRequest) -> str:
        messages, extra = request.messages, dict(request.template_kwargs)
        if self._offers_tools(request):
            if self.traits.tools_in_template:
                extra["tools"] = tool_dicts(request.tools)
            else:
                system = Message(role="system", content=tool_system_prompt(request.tools))
                messages = (*messages, system)
        if not self.traits.tools_in_template:
            messages = history_as_text(messages)
        try:
            normalized = normalize_messages(messages)
            return self.tokenizer.apply_chat_template(
                normalized, add_generation_prompt=True, tokenize=False, **extra
            )
        except NormalizeError as exc:
            raise PromptError(str(exc), "messages") from exc
        except (jinja2.TemplateError, ValueError, TypeError, KeyError) as exc:
            raise PromptError(f"chat template error: {exc}", "messages") from exc

    def output_spec(self, request: AdmittedRequest, prompt: str) -> OutputSpec:
        """How the streamer reads this request's output (tool calls, reasoning)."""
        if not isinstance(request, ChatRequest):
            return OutputSpec()
        tags = self.traits.reasoning if request.parse_reasoning else None
        return OutputSpec(
            tool_format=self.traits.tool_format if self._offers_tools(request) else None,
            reasoning=tags,
            in_reasoning=bool(tags) and prompt.rstrip().endswith(tags[0]),  # type: ignore[index]
            single_tool_call=not request.parallel_tool_calls,
        )

    def grammar(self, request: AdmittedRequest) -> CompiledGrammar | None:
        if request.constraint is None:
            return None
        tools = request.tools if isinstance(request, ChatRequest) else ()
        try:
            return self.grammars.compile(request.constraint, tools, self.traits.tool_format)
        except GrammarError as exc:
            raise PromptError(str(exc), request.constraint.param) from exc

    def prompt(self, request: AdmittedRequest) -> tuple[str, list[int]]:
        """The prompt text (chat: the rendered template) and its tokens."""
        if isinstance(request, ChatRequest):
            text = self.render_chat(request)
            return text, self.tokenizer.encode(text, add_special_tokens=False)
        return "", self.tokens(request)

    def tokens(self, request: AdmittedRequest) -> list[int]:
        if isinstance(request, ChatRequest):
            return self.prompt(request)[1]
        if isinstance(request.prompt, str):
            return self.tokenizer.encode(request.prompt)
        bad = [t for t in request.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}", "prompt")
        return list(request.prompt)

    def build(self, request: AdmittedRequest) -> TokenizedRequest:
        text, tokens = self.prompt(request)
        if not tokens:
            raise PromptError("the prompt is empty", "prompt")
        sampling = request.sampling
        max_tokens = self._max_tokens(len(tokens), sampling.max_tokens)
        return TokenizedRequest(
            request_id=request.request_id,
            prompt_tokens=tuple(tokens),
            sampling=msgspec.structs.replace(sampling, max_tokens=max_tokens),
            output=self.output_spec(request, text),
            grammar=self.grammar(request),
        )

    def _max_tokens(self, prompt: int, asked: int | None) -> int:
        """The client's max_tokens if it fits the context; a default shrinks to fit."""
        if prompt > self.max_prompt_tokens or prompt >= self.context_length:
            limit = min(self.max_prompt_tokens, self.context_length - 1)
            raise PromptError(f"the prompt has {prompt} tokens; the limit is {limit}", "messages")
        if asked is None:
            return min(self.default_max_tokens, self.context_length - prompt)
        max_tokens = asked
        if prompt + max_tokens > self.context_length:
            raise PromptError(
                f"this model's context is {self.context_length} tokens; the request needs "
                f"{prompt + max_tokens} ({prompt} in the prompt, {max_tokens} for the completion)",
                "max_tokens",
            )
        return max_tokens


async def _tokenize_one(
    request: AdmittedRequest,
    builder: PromptBuilder,
    limiter: trio.CapacityLimiter,
    outbox: trio.MemorySendChannel[Submit],
    mailboxes: Mailboxes,
) -> None:
    try:
        tokenized = await trio.to_thread.run_sync(builder.build, request, limiter=limiter)
    except PromptError as exc:
        mailboxes.deliver(
            Failed(
                request_id=request.request_id,
                status=400,
                kind="invalid_request_error",
                message=str(exc),
                param=exc.param,
            )
        )
        return
    if mailboxes.get(request.request_id) is None:
        return  # the client left while we tokenized; never start orphan work
    await outbox.send(Submit(request=tokenized))


async def run(
    inbox: trio.MemoryReceiveChannel[AdmittedRequest],
    outbox: trio.MemorySendChannel[Submit],
    mailboxes: Mailboxes,
    builder: PromptBuilder,
    workers: int,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Tokenize each admitted request in a worker thread and submit it to the engine."""
    limiter = trio.CapacityLimiter(workers)
    task_status.started()
    async with inbox, outbox, trio.open_nursery() as nursery:
        async for request in inbox:
            nursery.start_soon(_tokenize_one, request, builder, limiter, outbox, mailboxes)
