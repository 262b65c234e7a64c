"""Internal messages passed between mlxd's actors.

Types are named by pipeline stage: an HTTP handler builds a ``ChatRequest``
(or ``CompletionRequest``), the tokenizer turns it into a ``TokenizedRequest``,
the generation actor emits one ``EngineStep`` per decode step, and the
detokenizer turns that into ``TextDelta`` / ``Finished`` / ``Failed`` events in
each request's mailbox. Nothing here imports trio or mlx.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

FinishReason = Literal["stop", "length", "error", "abort", "tool_calls"]


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """Per-request sampling and stopping options, already validated.

    ``max_tokens`` is None when the client named none; the tokenizer resolves it
    against the context window, so the engine always sees a number.
    """

    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = {}
    seed: int | None = None
    stop: tuple[str, ...] = ()
    # Decoding options (mlxd extensions): False opts this request out of drafting;
    # ``spec_prefill`` None follows the server's ``[spec_prefill]`` settings.
    speculative: bool = True
    spec_prefill: bool | None = None
    logprobs: bool = False  # return the sampled token's log-probability
    top_logprobs: int = 0  # and this many most likely alternatives

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class ToolCall(msgspec.Struct, frozen=True, kw_only=True):
    """A function call the assistant made (in a request's history, or parsed from output)."""

    id: str
    name: str
    arguments: str  # JSON text, as the OpenAI API carries it


class TextPart(msgspec.Struct, frozen=True, kw_only=True):
    """Text in a message's content (OpenAI ``text`` / ``input_text``, Anthropic ``text``)."""

    text: str


class ImagePart(msgspec.Struct, frozen=True, kw_only=True):
    """An image in a message's content, for a vision model (a text model refuses it).

    ``url`` is a ``data:`` URL (base64) or an http(s) URL; OpenAI ``image_url``,
    Responses ``input_image`` and Anthropic ``image`` blocks all become one.
    """

    url: str
    detail: str | None = None


ContentPart = TextPart | ImagePart


class Message(msgspec.Struct, frozen=True, kw_only=True):
    """One chat message after wire decoding; ``content`` is text or a tuple of parts.

    Assistant turns may carry ``tool_calls``; ``tool`` turns answer the call
    named by ``tool_call_id`` (their content may hold images too).
    """

    role: str
    content: str | tuple[ContentPart, ...] | None = None
    name: str | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    # An assistant turn's earlier reasoning, for templates that render it back (gpt-oss
    # between calls, Qwen3 / GLM after the last user turn); others ignore it.
    reasoning: str | None = None


class Tool(msgspec.Struct, frozen=True, kw_only=True):
    """A function the model may call: its name, description and JSON-schema parameters."""

    name: str
    description: str = ""
    parameters: dict = {}
    # The API's ``strict``: True, the arguments match the schema exactly, also in auto mode
    # (the schema passed OpenAI's strict rules). False or None: no such promise; calls in
    # auto mode are held as ``ChatRequest.constrain_calls`` or the server's setting says
    # (Codex sends ``strict: false`` on every tool: it is not an opt-out).
    strict: bool | None = None


class Constraint(msgspec.Struct, frozen=True, kw_only=True):
    """Token-level constraint on the output: ``json_schema`` / ``json_object`` or a tool call.

    ``tool_names`` set: the output must be one call (in the model's tool-call
    format) to one of these tools, with arguments matching its schema.
    """

    kind: Literal["json_schema", "json_object", "tool_call"]
    schema: dict | None = None
    tool_names: tuple[str, ...] = ()
    param: str = "response_format"  # the request field it came from, for a 400


class ChatRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A chat conversation to render with the model's chat template.

    ``priority``: lower runs first (only when ``admission.priority`` is on;
    otherwise every request has 0 and the order is first come, first served).

    ``tools`` are offered to the model (through its template, or a system-prompt
    description when the template has no tool support); ``tool_choice`` is
    ``auto`` / ``none`` / ``required`` or a tool name. ``template_kwargs`` go to
    the chat template as extra variables (e.g. ``enable_thinking``). ``model``: the
    served model's id ("" = the default, first, model).
    """

    request_id: str
    model: str = ""
    messages: tuple[Message, ...]
    sampling: SamplingParams
    arrival: float = 0.0
    priority: int = 0
    tools: tuple[Tool, ...] = ()
    tool_choice: str = "auto"
    parallel_tool_calls: bool = True
    # ``tool_choice: auto``: hold a call the model opens to its tool's schema (True), leave it
    # free (False), or do as ``tokenizer.constrain_auto_calls`` says (None); the request's
    # ``constrain_tool_calls`` (an mlxd extension, in every API)
    constrain_calls: bool | None = None
    template_kwargs: dict = {}
    # The API's reasoning effort (``none`` … ``max``); the model's family maps it onto its
    # template's variables (``actors/families/reasoning.py``). None: the template's default.
    reasoning_effort: str | None = None
    constraint: Constraint | None = None
    parse_reasoning: bool = True
    # Prefix-cache hints from the client: ``cache_breakpoints`` are indices into
    # ``messages`` after whose end the prompt is worth a snapshot (Anthropic
    # ``cache_control``); ``cache_key`` groups requests that share a prefix (Responses
    # ``prompt_cache_key``), "" = none.
    cache_breakpoints: tuple[int, ...] = ()
    cache_key: str = ""


class FimFile(msgspec.Struct, frozen=True, kw_only=True):
    """Another file of the repository, context for a fill-in-the-middle prompt."""

    filename: str
    text: str


class FimInput(msgspec.Struct, frozen=True, kw_only=True):
    """A fill-in-the-middle prompt: the code before and after the cursor, text already
    typed after the prefix (llama.cpp's ``prompt``, which follows the middle token) and
    other files, laid out in the model family's own tokens (``actors/families/fim.py``).
    ``param`` names the request field a refusal points at."""

    prefix: str
    suffix: str
    middle: str = ""
    files: tuple[FimFile, ...] = ()
    repo: str = "project"  # the repository's name, where the family's layout writes one
    filename: str = "filename"  # the edited file's name, where the layout writes one
    param: str = "suffix"


class CompletionRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A raw prompt (text, or token ids) for the completions endpoint; ``fim`` set: a
    fill-in-the-middle prompt instead (``prompt`` is unused)."""

    request_id: str
    model: str = ""
    prompt: str | tuple[int, ...]
    sampling: SamplingParams
    arrival: float = 0.0
    priority: int = 0
    constraint: Constraint | None = None
    fim: FimInput | None = None


AdmittedRequest = ChatRequest | CompletionRequest


class VisionInputs(msgspec.Struct, frozen=True, kw_only=True):
    """A request's images, decoded and preprocessed by the model's processor.

    ``arrays`` maps the processor's output names (``pixel_values``,
    ``image_grid_thw``, ...) to numpy arrays. They are typed ``Any`` because
    they only ever travel in-process between actors, never over the wire; the
    generation thread turns them into MLX arrays, so no other thread touches MLX.
    """

    images: int
    arrays: dict[str, Any]


class OutputSpec(msgspec.Struct, frozen=True, kw_only=True):
    """How the streamer reads a request's output text.

    ``stop`` holds the request's stop strings; ``tool_format`` names the
    tool-call parser (None: no tool parsing); ``reasoning`` is the (open, close)
    tag pair of the reasoning block (None: no reasoning parsing); ``in_reasoning``
    says the prompt already opened it. The tokenizer builds it and it reaches the
    streamer in ``Started``: the one route for what the streamer knows of a request.
    """

    stop: tuple[str, ...] = ()
    tool_format: str | None = None
    reasoning: tuple[str, str] | None = None
    in_reasoning: bool = False
    single_tool_call: bool = False
    # The offered tools: parsers of XML-style markup read parameter types from them.
    tools: tuple[Tool, ...] = ()
    # Tokens that end the output where they appear, not shown (a FIM family's end of
    # the middle: ``<|file_sep|>``, ``<fim_pad>`` …); the finish reason is ``stop``.
    end_ids: tuple[int, ...] = ()


class AdapterRef(msgspec.Struct, frozen=True, kw_only=True):
    """A LoRA adapter over a served base model, as a request names it to the engine.

    ``name``: its served id; ``path``: its directory (mlx-lm's or PEFT's files);
    ``fingerprint``: what its files hold (sizes and modification times), so a snapshot
    made with an adapter is never reused once its files change.
    """

    name: str
    path: str
    fingerprint: str = ""


class TokenizedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """A request ready for the generation actor (``max_tokens`` always set).

    ``vision`` is set when it has images; ``grammar`` is the compiled token-level
    constraint (an llguidance matcher, built off the engine thread), or None.
    ``model`` names the served model that runs it (the tokenizer resolved "").
    """

    request_id: str
    model: str = ""
    prompt_tokens: tuple[int, ...]
    sampling: SamplingParams
    # Prompt positions worth a prefix-cache snapshot (end of the system prompt,
    # end of the previous turn): hybrid models can only reuse state captured exactly there.
    checkpoints: tuple[int, ...] = ()
    vision: VisionInputs | None = None
    priority: int = 0
    output: OutputSpec = OutputSpec()
    grammar: object | None = None
    cache_key: str = ""  # the client's prefix-sharing group (ChatRequest.cache_key)
    # A resumed request (after a preemption or a failed step): its prompt ends with this
    # many tokens it generated itself. Its seeded sampler skips that many draws and its
    # grammar consumes them, so it goes on exactly where it stopped.
    resumed: int = 0
    # The LoRA adapter its rows decode with (None: the base model's own weights). The
    # model registry resolves a served adapter id to it; ``model`` is then the base's id.
    adapter: AdapterRef | None = None


# ---- admission inbox ----------------------------------------------------------------


class Admit(msgspec.Struct, frozen=True, kw_only=True):
    """Ask the admission controller to run a request (or queue or reject it)."""

    request: AdmittedRequest


class Release(msgspec.Struct, frozen=True, kw_only=True):
    """The request's handler is done with it: free its slot (or its queue place)."""

    request_id: str


AdmissionInbox = Admit | Release


# ---- generation actor inbox ---------------------------------------------------------


class Submit(msgspec.Struct, frozen=True, kw_only=True):
    """Start generating for a tokenized request."""

    request: TokenizedRequest


class Abort(msgspec.Struct, frozen=True, kw_only=True):
    """Stop generating for a request (client gone, stop string matched, timed out)."""

    request_id: str


class ClearCache(msgspec.Struct, frozen=True, kw_only=True):
    """Drop every prefix-cache snapshot (runs on the engine thread, between steps) of
    ``model``, or of every loaded model when it is ""."""

    model: str = ""
    tier: str = ""  # "ram" or "disk": that tier only; "": both


class Load(msgspec.Struct, frozen=True, kw_only=True):
    """A request for ``model`` is on its way (the tokenizer needs the model's tokenizer
    first): load the model unless it is loaded, and keep it loaded until ``request_id``
    is submitted or aborted (None: keep nothing)."""

    model: str
    request_id: str | None = None


class KeepAlive(msgspec.Struct, frozen=True, kw_only=True):
    """How long ``model`` stays loaded once idle (Ollama's ``keep_alive``), from now on:
    ``seconds`` 0 unloads it as soon as it is idle, inf never; None: back to
    ``model_pool.idle_unload_s``."""

    model: str
    seconds: float | None = None


class EmbedRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Texts to embed, already tokenized and checked (ids within the vocabulary, lengths
    within the model's limit), for an embedding model (``model``)."""

    request_id: str
    model: str
    inputs: tuple[tuple[int, ...], ...]


class Embed(msgspec.Struct, frozen=True, kw_only=True):
    """Embed a request's inputs (an embedding model's ``EmbeddingCore`` batches them)."""

    request: EmbedRequest


class Unload(msgspec.Struct, frozen=True, kw_only=True):
    """An operator unloads ``model`` (the dashboard's button): done at once if it is loaded
    and idle (nothing running, waiting or about to be submitted), else nothing is done."""

    model: str


class UnloadAdapter(msgspec.Struct, frozen=True, kw_only=True):
    """The adapter ``name`` of base ``model`` is no longer served: its weights are dropped
    once no running request uses it (``POST /v1/unload_lora_adapter``)."""

    model: str
    name: str


EngineInbox = Submit | Abort | ClearCache | Load | KeepAlive | Embed | Unload | UnloadAdapter


# ---- generation actor outbox --------------------------------------------------------


class Started(msgspec.Struct, frozen=True, kw_only=True):
    """The engine accepted a request and is prefilling it.

    ``cached_tokens``: prompt tokens served from a prompt cache (0 without one).
    ``prefilled_tokens``: prompt tokens the model will process (fewer than
    ``prompt_tokens - cached_tokens`` when SpecPrefill skips chunks; -1: unknown).
    """

    request_id: str
    prompt_tokens: int
    cached_tokens: int = 0  # prompt tokens reused from the prefix cache
    prefilled_tokens: int = -1
    output: OutputSpec = OutputSpec()


class TokenLogprob(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A sampled token's log-probability and the ``top`` most likely (token, logprob) pairs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class TokenStep(msgspec.Struct, frozen=True, kw_only=True):
    """New tokens of one request in one step; ``finish_reason`` set on its last.

    ``logprobs`` (one per token) only for requests that asked for them.
    """

    request_id: str
    tokens: tuple[int, ...]
    finish_reason: FinishReason | None = None
    logprobs: tuple[TokenLogprob, ...] = ()


# Why a request failed, stable and machine-readable. Each HTTP API maps a reason to its
# own status code and error format (``daemon/api/errors.py``); the reason is also the
# label of the rejection and failure metrics.
Reason = Literal[
    "invalid_request",  # the request cannot be served as sent (a 400)
    "too_deeply_nested",  # its nesting is too deep to render the prompt
    "request_too_large",  # it could never fit the memory budget
    "queue_full",  # admission is at capacity
    "queue_timeout",  # it waited too long for a slot, memory or a batch place
    "request_timeout",  # it passed its deadline
    "out_of_memory",  # an allocation failed in its step
    "client_not_reading",  # its client left too much output unread
    "shutting_down",  # the server is draining and it did not finish in time
    "model_loading",  # its model is still loading (too long, or too many wait for it)
    "model_load_failed",  # its model could not be loaded
    "internal_error",  # a bug while building, running or streaming it
]


class Failed(msgspec.Struct, frozen=True, kw_only=True):
    """A per-request failure: reaches only that request's client.

    ``reason`` says why (never an HTTP status: each API picks its own);
    ``param`` names the request field at fault; ``retry_after`` (seconds) says
    when a retry may succeed.
    """

    request_id: str
    reason: Reason
    message: str
    param: str | None = None
    retry_after: float | None = None


class EngineStep(msgspec.Struct, frozen=True, kw_only=True):
    """Everything one engine step of one model produced, for every running request
    (``embedded``: the embedding requests it completed)."""

    model: str = ""
    started: tuple[Started, ...] = ()
    tokens: tuple[TokenStep, ...] = ()
    failed: tuple[Failed, ...] = ()
    embedded: tuple[Embedded, ...] = ()


class PrefixCacheCounters(msgspec.Struct, kw_only=True):
    """The prefix cache's counters: lookups, tokens served, snapshots held and evicted.

    One type from the engine to the wire: the cache counts into its own (``PrefixCache.stats``),
    the engine publishes copies, ``/v1/cache`` and ``/v1/status`` encode them."""

    hits: int = 0
    misses: int = 0
    cached_tokens: int = 0  # prompt tokens served from the cache, summed over hits
    evictions: int = 0
    entries: int = 0
    bytes: int = 0
    max_bytes: int = 0
    disk_hits: int = 0  # of the hits, snapshots read back from the disk tier
    disk_cached_tokens: int = 0  # of cached_tokens, served by those
    disk: DiskCounters | None = None  # the disk tier (shared by every model); None: off


class DiskCounters(msgspec.Struct, kw_only=True):
    """The prefix cache's disk tier, shared by the models (``prefix_cache.disk_dir``):
    files held, written and read back, evicted over the budget, and removed because they
    were corrupt (a checksum, length or header was wrong), torn (a write cut off by a
    crash) or incompatible (another model's files, template, ``kv_bits``, format)."""

    enabled: bool = False
    writable: bool = False  # false: a write failed (disk full, read-only): RAM only
    owner_pid: int = 0  # not 0: another process (-1: unknown pid) holds disk_dir: RAM only
    max_bytes: int = 0
    bytes: int = 0
    entries: int = 0
    writes: int = 0
    reads: int = 0
    evictions: int = 0
    pending_writes: int = 0  # spilled snapshots the I/O thread has not written yet
    spills_dropped: int = 0  # spills refused: writes off or the write queue full
    # snapshots not written because a longer one of the same conversation, queued after
    # them, serves them (prefix_cache.disk_write_behind_s)
    coalesced: int = 0
    blocks: int = 0  # attention-KV block files held (``bytes`` counts each once)
    block_writes: int = 0
    bytes_written: int = 0  # snapshot and block files written, in bytes (all so far)
    corrupt_removed: int = 0
    torn_removed: int = 0
    incompatible_removed: int = 0


class SpeculativeCounters(msgspec.Struct, kw_only=True):
    """One drafter's counters: ``acceptance_rate`` = accepted ÷ drafted tokens.

    ``enabled`` is false when speculation is configured but off for this model (``notes``
    say why: ``off: ...``); ``plain_steps`` are steps decoded without drafts. One type from
    the engine to the wire: the speculative batch counts into the runner's
    (``spec_stats``), the engine publishes copies, ``/v1/speculative``, ``/v1/status`` and
    ``/metrics`` encode them."""

    drafter: str = ""
    enabled: bool = False
    num_draft_tokens: int = 0
    max_batch: int = 0
    steps: int = 0  # speculative steps (one verify pass each)
    plain_steps: int = 0  # steps decoded without drafts (batch above max_batch)
    drafted: int = 0  # draft tokens proposed, summed over rows
    accepted: int = 0  # of them, accepted
    emitted: int = 0  # tokens emitted by speculative steps (accepted + bonus)
    acceptance_rate: float = 0.0
    notes: tuple[str, ...] = ()  # what speculation does not cover

    def count(self, drafted: int, accepted: int, emitted: int) -> None:
        """One verify step."""
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        self.emitted += emitted
        self.acceptance_rate = self.accepted / self.drafted if self.drafted else 0.0

    def reset(self) -> None:
        """Zero the step counts (a benchmark counts its timed runs only)."""
        self.steps = self.plain_steps = self.drafted = self.accepted = self.emitted = 0
        self.acceptance_rate = 0.0


class SpecPrefillCounters(msgspec.Struct, kw_only=True):
    """SpecPrefill: requests sparse-prefilled, their uncached prompt tokens and how many of
    those the target skipped. ``notes`` say why it is off, or what it does to a hybrid
    model's SSM layers (they see only the kept tokens). One type from the engine to the
    wire: SpecPrefill counts into its own (``SpecPrefill.stats``), the engine publishes
    copies, ``/v1/status`` encodes them."""

    scorer: str = ""
    enabled: bool = False
    requests: int = 0
    suffix_tokens: int = 0  # uncached prompt tokens of those requests
    skipped_tokens: int = 0  # of them, never prefilled by the target
    notes: tuple[str, ...] = ()


class RunnerCounters(msgspec.Struct, frozen=True, kw_only=True):
    """Copies of the runner's feature counters, taken on the engine thread after a step
    (None: the feature is not configured); nothing reads them but to encode them."""

    prefix_cache: PrefixCacheCounters | None = None
    speculative: SpeculativeCounters | None = None
    spec_prefill: SpecPrefillCounters | None = None


class EngineStats(msgspec.Struct, frozen=True, kw_only=True):
    """The engine's state after a step, published for /metrics and /v1/status.

    ``batch_size`` is the last decode step's; ``batch_tokens_total`` over
    ``decode_steps`` is the mean. Memory figures are bytes: ``memory_active`` /
    ``memory_peak`` as MLX reports them, ``kv_reserved`` the estimates of the
    sequences the engine holds, ``kv_budget`` what they may add up to (0: no memory
    gate). ``counters`` are copies taken on the engine thread: nothing outside it
    reads the runner's live objects.
    """

    steps: int = 0
    decode_steps: int = 0
    waiting: int = 0
    prefilling: int = 0
    decoding: int = 0
    batch_size: int = 0
    batch_tokens_total: int = 0
    memory_active: int = 0
    memory_peak: int = 0
    kv_reserved: int = 0
    kv_budget: int = 0
    failed_steps: int = 0
    # memory.admission "use": rows taken out of the batch to make room, rows brought back,
    # the bytes of the snapshots they left, and the seconds they spent out (all so far);
    # ``preempted`` is how many are out now
    preemptions: int = 0
    resumes: int = 0
    preempted: int = 0
    preempted_bytes: int = 0
    preempted_seconds: float = 0.0
    expires_at: float = 0.0  # when the model unloads if it gets no more work (Unix s; 0: never)
    counters: RunnerCounters = RunnerCounters()


# ---- mailbox events (detokenizer → HTTP handler) ------------------------------------


class ToolCallDelta(msgspec.Struct, frozen=True, kw_only=True):
    """A tool call parsed from the output, or more of its arguments.

    Calls are numbered from 0 within the request; a call's first delta carries
    its ``id`` and ``name``, later ones (same ``index``) continue ``arguments``.
    """

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None


class LogprobPiece(msgspec.Struct, frozen=True, kw_only=True):
    """One generated token as text, with its log-probability and the top alternatives."""

    token: str
    bytes: tuple[int, ...]
    logprob: float
    top: tuple[tuple[str, tuple[int, ...], float], ...] = ()


class TextDelta(msgspec.Struct, frozen=True, kw_only=True):
    """Output since the last delta: content text (always whole UTF-8 characters),
    reasoning text, completed tool calls and per-token logprobs."""

    text: str
    tokens: int
    reasoning: str = ""
    tool_calls: tuple[ToolCallDelta, ...] = ()
    logprobs: tuple[LogprobPiece, ...] = ()


class Finished(msgspec.Struct, frozen=True, kw_only=True):
    """The request ended normally; ``stop_string`` names the stop string that ended it."""

    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    prefilled_tokens: int = -1  # as in ``Started``
    stop_string: str | None = None
    # The index of the tool call the token limit cut (its arguments as far as written).
    cut_call: int | None = None


class Embedded(Finished, frozen=True, kw_only=True):
    """An embedding request's result, its final event: a ``Finished`` (``prompt_tokens``:
    the tokens embedded, no completion) carrying ``vectors``, a float32 numpy array of
    shape (inputs, dimensions), L2-normalised where the model normalises. Typed ``Any``:
    it travels in-process only, and is numpy, never MLX, so no other thread touches MLX."""

    request_id: str
    vectors: Any
    finish_reason: FinishReason = "stop"
    completion_tokens: int = 0


MailboxEvent = Started | TextDelta | Finished | Failed
