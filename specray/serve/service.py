"""Text in, events out, around one coordinator: the generation service every front end uses.

:class:`CoordinatorService` does what sits between an API and the token-level coordinator:
tokenization and chat templates, sampling-parameter validation, stop strings, incremental
detokenization, per-request speculation control, and aborting requests whose caller left. The
Ray Serve ``Coordinator`` deployment hosts one; :class:`LocalBackend` hosts one with the
workers in this process (no Ray) for single-machine use and the front ends' tests.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace

from specray.cluster.coordinator import Coordinator, CoordinatorConfig
from specray.cluster.streams import StreamDelta
from specray.errors import InvalidRequestError, RequestCancelledError
from specray.outputs import RequestOutput
from specray.sampling import SamplingParams, SamplingParamsError
from specray.serve.protocol import GenerateRequest
from specray.serve.text import TextStream, encode_prompt

log = logging.getLogger(__name__)


def speculative_block(output: RequestOutput) -> dict:
    """Per-request speculative-decoding metrics under vLLM's names."""
    metrics = output.metrics
    return {
        "num_drafts": metrics.num_drafts,
        "num_draft_tokens": metrics.num_draft_tokens,
        "num_accepted_tokens": metrics.num_accepted_tokens,
        "num_accepted_tokens_per_pos": list(metrics.accepted_per_position),
        "acceptance_rate": metrics.acceptance_rate,
        "mean_acceptance_length": metrics.mean_acceptance_length,
    }


def final_event(output: RequestOutput, text: str, finish_reason: str) -> dict:
    return {
        "kind": "final",
        "request_id": output.request_id,
        "text": text,
        "token_ids": list(output.token_ids),
        "finish_reason": finish_reason,
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": len(output.token_ids),
        "seed": output.seed,
        "speculative_decoding": speculative_block(output),
        "time_to_first_token_s": output.time_to_first_token_s,
        "latency_s": output.latency_s,
    }


class CoordinatorService:
    """A :class:`specray.serve.protocol.GenerationBackend` over a running coordinator, used
    on the coordinator's event loop."""

    def __init__(
        self,
        coordinator: Coordinator,
        *,
        tokenizer,
        model_name: str,
        draft_name: str | None,
        max_model_len: int | None,
    ):
        self.coordinator = coordinator
        self.tokenizer = tokenizer
        self.model_name, self.draft_name = model_name, draft_name
        self.max_model_len = max_model_len

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.prompt is not None and not request.prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        return encode_prompt(self.tokenizer, request.prompt, request.messages)

    @staticmethod
    def _params(request: GenerateRequest) -> SamplingParams:
        try:
            return SamplingParams.from_dict(request.params)
        except SamplingParamsError as error:
            raise InvalidRequestError(str(error), param=error.param) from None
        except TypeError as error:  # a value of the wrong kind for a field
            raise InvalidRequestError(str(error)) from None

    async def generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        prompt_ids = self._prompt_ids(request)
        if request.messages is not None and "max_tokens" not in request.params:
            # Chat without a limit runs to the end of the context (OpenAI's and vLLM's rule).
            room = (self.max_model_len or 0) - len(prompt_ids)
            if room > 0:
                request = replace(request, params={**request.params, "max_tokens": room})
        params = self._params(request)
        stream = await self.coordinator.submit(
            prompt_ids,
            params,
            request_id=request.request_id,
            timeout_s=request.timeout_s,
            num_speculative_tokens=request.num_speculative_tokens,
            committed_token_ids=request.resume_token_ids,
        )
        request_id = stream.request_id
        text = TextStream(self.tokenizer, request.stop)
        if request.resume_token_ids:
            # A resumed request: the caller has (most of) these tokens' text already; it is
            # told where this stream's text starts, so it sends on exactly what is new.
            primed = text.push(list(request.resume_token_ids))
            yield {"kind": "resumed", "text_offset": len(primed)}
        finished = False
        try:
            async for first in stream:
                # Deltas that piled up while the caller was slow travel as one event.
                token_ids, output = list(first.token_ids), first.output
                while output is None and (more := stream.next_ready()) is not None:
                    token_ids += more.token_ids
                    output = more.output
                delta = StreamDelta(token_ids, output)
                piece = text.push(delta.token_ids)
                if text.stopped:  # a stop string: end here, whatever the target would add
                    output = self.coordinator.output_so_far(request_id) or delta.output
                    self.coordinator.abort(request_id)
                    finished = True
                    if piece or delta.token_ids:
                        yield {"kind": "delta", "text": piece, "token_ids": delta.token_ids}
                    yield final_event(output, text.text, "stop")
                    return
                if delta.output is not None:
                    finished = True
                    piece += text.flush()
                    if piece or delta.token_ids:
                        yield {"kind": "delta", "text": piece, "token_ids": delta.token_ids}
                    yield final_event(delta.output, text.text, delta.output.finish_reason)
                    return
                if piece or delta.token_ids:
                    yield {"kind": "delta", "text": piece, "token_ids": delta.token_ids}
        except RequestCancelledError:
            finished = True
            raise
        finally:
            if not finished:  # the caller went away (or failed): free the workers' state
                self.coordinator.abort(request_id)

    async def abort(self, request_id: str) -> bool:
        return self.coordinator.abort(request_id)

    async def model_info(self) -> dict:
        config = self.coordinator.config
        return {
            "model": self.model_name,
            "max_model_len": self.max_model_len or 0,
            "vocab_size": self.coordinator.vocab_size,
            "draft": self.draft_name or "",
            "num_speculative_tokens": config.num_speculative_tokens if self.draft_name else 0,
            "eos_token_ids": sorted(self.coordinator.eos_token_ids),
        }

    async def health(self) -> bool:
        return self.coordinator.healthy

    async def metrics_text(self) -> bytes:
        return self.coordinator.metrics.render()


class LocalBackend(CoordinatorService):
    """A coordinator with its target and draft workers in this process, on the running loop.

    ``backend = await LocalBackend.start(target, draft)`` ... ``await backend.stop()``.
    """

    @classmethod
    async def start(
        cls,
        target: str,
        draft: str | None = None,
        *,
        model_name: str | None = None,
        config: CoordinatorConfig | None = None,
        num_draft_workers: int = 1,
        draft_probs_encoding: str = "fp32",
    ) -> LocalBackend:
        import asyncio

        from specray.cluster.inprocess import InProcessDrafts, InProcessTarget
        from specray.models.loading import load_model_info

        config = config or CoordinatorConfig()
        loop = asyncio.get_running_loop()
        info = await loop.run_in_executor(None, load_model_info, target)
        workers = await loop.run_in_executor(None, InProcessTarget, target)
        drafts = None
        if draft is not None:
            drafts = await loop.run_in_executor(
                None,
                lambda: InProcessDrafts(
                    target,
                    draft,
                    workers.address,
                    num_workers=num_draft_workers,
                    draft_probs_encoding=draft_probs_encoding,
                ),
            )
        name = model_name or target
        coordinator = Coordinator(
            workers,
            drafts,
            config,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            max_positions=info.max_positions,
            tokenizer=info.tokenizer,
            model_name=name,
        )
        await coordinator.start()
        backend = cls(
            coordinator,
            tokenizer=info.tokenizer,
            model_name=name,
            draft_name=draft,
            max_model_len=info.max_positions,
        )
        backend._workers = (workers, drafts)
        return backend

    async def stop(self, *, drain: bool = True) -> None:
        import asyncio

        await self.coordinator.stop(drain=drain)
        target, drafts = self._workers
        loop = asyncio.get_running_loop()
        if drafts is not None:
            await loop.run_in_executor(None, drafts.close)
        await loop.run_in_executor(None, target.close)


__all__ = ["CoordinatorService", "LocalBackend", "final_event"]
