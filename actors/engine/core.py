"""Engine core: the scheduling policy of the generation actor, as a plain class.

Each ``step()`` spends a prompt-token budget on prefill (oldest request first,
chunked, so a long prompt never stalls running streams for more than one chunk),
then runs one batched decode step, and returns one ``EngineStep`` carrying the
news for every request. A runner error while starting or prefilling a request
fails that request alone. No trio, no mlx: tests drive it with a fake runner.
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque

from actors.engine.types import Runner
from protocol.messages import EngineStep, Failed, Started, TokenizedRequest, TokenStep

log = logging.getLogger("mlxd.engine")


class EngineCore:
    """Waiting → prefilling → decoding, with a cap on sequences in the batch."""

    def __init__(self, runner: Runner, *, max_batch: int, prefill_chunk_tokens: int):
        self.runner = runner
        self.max_batch = max_batch
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.waiting: deque[TokenizedRequest] = deque()
        self.prefilling: OrderedDict[str, TokenizedRequest] = OrderedDict()
        self.decoding: set[str] = set()

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.decoding)

    def submit(self, request: TokenizedRequest) -> None:
        self.waiting.append(request)

    def abort(self, request_id: str) -> None:
        self.waiting = deque(r for r in self.waiting if r.request_id != request_id)
        self.prefilling.pop(request_id, None)
        self.decoding.discard(request_id)
        self.runner.remove(request_id)

    def step(self) -> EngineStep:
        started: list[Started] = []
        failed: list[Failed] = []
        self._admit(started, failed)
        self._prefill(failed)
        tokens = self._decode()
        return EngineStep(started=tuple(started), tokens=tuple(tokens), failed=tuple(failed))

    def _admit(self, started: list[Started], failed: list[Failed]) -> None:
        """Move waiting requests into prefill while the batch has room."""
        while self.waiting and len(self.prefilling) + len(self.decoding) < self.max_batch:
            request = self.waiting.popleft()
            rid = request.request_id
            try:
                self.runner.start(request)
            except Exception as exc:  # noqa: BLE001 - any runner error fails this request only
                failed.append(self._failure(rid, "could not start", exc))
                continue
            self.prefilling[rid] = request
            started.append(
                Started(
                    request_id=rid, prompt_tokens=len(request.prompt_tokens), output=request.output
                )
            )

    def _prefill(self, failed: list[Failed]) -> None:
        budget = self.prefill_chunk_tokens
        for rid in list(self.prefilling):
            if budget <= 0:
                break
            before = self._remaining(rid)
            try:
                left = self.runner.prefill(rid, budget)
            except Exception as exc:  # noqa: BLE001 - a prefill error fails this request only
                self.prefilling.pop(rid)
                self.runner.remove(rid)
                failed.append(self._failure(rid, "prefill failed", exc))
                continue
            budget -= max(before - left, 1)
            if left == 0:
                self.decoding.add(self.prefilling.pop(rid).request_id)

    def _remaining(self, rid: str) -> int:
        return len(self.prefilling[rid].prompt_tokens) - 1

    def _decode(self) -> list[TokenStep]:
        if not self.decoding:
            return []
        out = []
        for d in self.runner.decode():
            if d.request_id not in self.decoding:
                continue
            # The stop token itself (EOS) is not part of the completion.
            eos = d.finish_reason == "stop"
            out.append(
                TokenStep(
                    request_id=d.request_id,
                    tokens=() if eos else (d.token,),
                    finish_reason=d.finish_reason,
                    logprobs=() if eos or d.logprob is None else (d.logprob,),
                )
            )
            if d.finish_reason is not None:
                self.decoding.discard(d.request_id)
        return out

    @staticmethod
    def _failure(request_id: str, what: str, exc: Exception) -> Failed:
        log.warning("request %s: %s: %r", request_id, what, exc)
        return Failed(request_id=request_id, status=500, message=f"{what}: {exc}")
