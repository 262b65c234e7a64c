"""Tokenizer / normalizer actor: admitted requests in, token ids out to the engine.

``PromptBuilder`` is the sync core: normalize messages, render the chat template,
tokenize, check the prompt against the context window and, with the model's
memory estimate, against the memory budget (the first stage that knows the
token count: a request that could never fit is refused here with the numbers,
and a defaulted ``max_tokens`` shrinks to what fits). It runs in worker threads
(templates and BPE are CPU work) and never touches MLX. Any failure here is a
400 for that request alone, delivered to its mailbox.
"""

from __future__ import annotations

from typing import Any

import jinja2
import msgspec
import trio

from actors.engine.memory import MemoryModel
from actors.mailbox import Mailboxes
from actors.normalize import NormalizeError, normalize_messages
from protocol.messages import (
    AdmittedRequest,
    ChatRequest,
    Failed,
    Submit,
    TokenizedRequest,
)


class PromptError(ValueError):
    """A request whose prompt cannot be built; becomes an HTTP 400."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.param = param
        self.code = code


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
        memory: MemoryModel | None = None,
    ):
        self.tokenizer = tokenizer
        self.default_max_tokens = default_max_tokens
        self.context_length = context_length
        self.max_prompt_tokens = max_prompt_tokens or context_length
        self.vocab_size = vocab_size
        self.memory = memory

    def render_chat(self, request: ChatRequest) -> str:
        try:
            messages = normalize_messages(request.messages)
            return self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=False
            )
        except NormalizeError as exc:
            raise PromptError(str(exc), "messages") from exc
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise PromptError(f"chat template error: {exc}", "messages") from exc

    def tokens(self, request: AdmittedRequest) -> list[int]:
        if isinstance(request, ChatRequest):
            return self.tokenizer.encode(self.render_chat(request), add_special_tokens=False)
        if isinstance(request.prompt, str):
            return self.tokenizer.encode(request.prompt)
        bad = [t for t in request.prompt if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"token ids out of range [0, {self.vocab_size}): {bad[:5]}", "prompt")
        return list(request.prompt)

    def build(self, request: AdmittedRequest) -> TokenizedRequest:
        tokens = self.tokens(request)
        if not tokens:
            raise PromptError("the prompt is empty", "prompt")
        sampling = request.sampling
        max_tokens = self._max_tokens(len(tokens), sampling.max_tokens)
        self._check_memory(len(tokens), max_tokens)
        return TokenizedRequest(
            request_id=request.request_id,
            prompt_tokens=tuple(tokens),
            sampling=msgspec.structs.replace(sampling, max_tokens=max_tokens),
            priority=request.priority,
            deadline=request.deadline,
        )

    def _max_tokens(self, prompt: int, asked: int | None) -> int:
        """The client's max_tokens if it fits the context; a default shrinks to fit (memory too)."""
        if prompt > self.max_prompt_tokens or prompt >= self.context_length:
            limit = min(self.max_prompt_tokens, self.context_length - 1)
            raise PromptError(
                f"the prompt has {prompt} tokens; the limit is {limit} "
                "(engine.max_prompt_tokens, or the model's context)",
                "messages",
            )
        if asked is None:
            default = min(self.default_max_tokens, self.context_length - prompt)
            fits = self.memory.max_tokens_fitting(prompt, default) if self.memory else default
            return max(fits, 1)  # 1 that does not fit is refused by _check_memory
        max_tokens = asked
        if prompt + max_tokens > self.context_length:
            raise PromptError(
                f"this model's context is {self.context_length} tokens; the request needs "
                f"{prompt + max_tokens} ({prompt} in the prompt, {max_tokens} for the completion)",
                "max_tokens",
            )
        return max_tokens

    def _check_memory(self, prompt: int, max_tokens: int) -> None:
        """A request whose estimate exceeds the whole budget could never run: refuse it now."""
        m = self.memory
        if m is not None and m.request_bytes(prompt, max_tokens) > m.budget_bytes:
            raise PromptError(
                m.too_large_message(prompt, max_tokens), "max_tokens", code="request_too_large"
            )


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
                code=exc.code,
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
