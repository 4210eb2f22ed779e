"""Text in, events out, around one engine core: the generation service every front end uses.

:class:`CoordinatorService` does what sits between an API and the token-level engine core:
tokenization and chat templates, sampling-parameter validation, stop strings, incremental
detokenization, per-request speculation control, and aborting requests whose caller left. It
runs in the front end's process over a session with the engine core
(:class:`specray.engine_core.aio_client.AsyncEngineCoreClient`), which only commits tokens. The
Ray Serve ``Coordinator`` deployment hosts one; :class:`LocalBackend` hosts one with the
workers in this process (no Ray) for single-machine use and the front ends' tests.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from dataclasses import replace

from specray.engine_core.aio_client import AsyncEngineCoreClient
from specray.engine_core.coordinator import CoordinatorConfig
from specray.engine_core.streams import StreamDelta
from specray.errors import InvalidRequestError, RequestCancelledError
from specray.outputs import RequestOutput
from specray.prompts import prompt_token_ids, template_renders_tool_calls, template_renders_tools
from specray.sampling import SamplingParams, SamplingParamsError
from specray.sampling.logprobs import TokenLogprob
from specray.serve.openai_tools import tool_calls_as_text
from specray.serve.protocol import GenerateRequest
from specray.serve.text import TextStream

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


def final_event(
    output: RequestOutput,
    text: str,
    finish_reason: str,
    *,
    num_tokens: int | None = None,
    logprobs: list[dict] | None = None,
    prompt_logprobs: list[dict] | None = None,
) -> dict:
    """The final event of ``output``; with ``num_tokens``, only its first that many tokens
    (a stop string ended it: the rest was not delivered)."""
    token_ids = list(output.token_ids[:num_tokens])
    return {
        "kind": "final",
        "request_id": output.request_id,
        "text": text,
        "token_ids": token_ids,
        "finish_reason": finish_reason,
        "prompt_tokens": len(output.prompt_token_ids),
        "completion_tokens": len(token_ids),
        "seed": output.seed,
        "speculative_decoding": speculative_block(output),
        "time_to_first_token_s": output.time_to_first_token_s,
        "latency_s": output.latency_s,
        "logprobs": logprobs,
        "prompt_logprobs": prompt_logprobs,
    }


def _first_tokens(delta: StreamDelta, count: int) -> StreamDelta:
    """``delta`` cut to its first ``count`` tokens (and their log-probabilities)."""
    logprobs = None if delta.logprobs is None else delta.logprobs[:count]
    return StreamDelta(delta.token_ids[:count], delta.output, logprobs, delta.prompt_logprobs)


class CoordinatorService:
    """A :class:`specray.serve.protocol.GenerationBackend` over a session with a running
    engine core."""

    def __init__(
        self,
        coordinator: AsyncEngineCoreClient,
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
        self._token_texts: dict[int, str] = {}  # token id -> its text alone (<= vocabulary)
        self._renders_tools: bool | None = None  # the chat template's (probed on first use)
        self._renders_tool_calls: bool | None = None  # the same, for assistant tool calls

    def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        if request.prompt_token_ids is not None:
            return list(request.prompt_token_ids)
        if request.prompt is not None and not request.prompt:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if self.tokenizer is None:
            raise InvalidRequestError(
                "this model has no tokenizer: send prompt token ids instead of text", param="prompt"
            )
        if request.messages is not None:
            tools = self._template_tools(request)
            turns = self._template_turns(request.messages)
            return prompt_token_ids(self.tokenizer, turns, use_chat_template=True, tools=tools)
        return prompt_token_ids(self.tokenizer, request.prompt, use_chat_template=False)

    def _template_turns(self, messages) -> list:
        """The turns as the chat template is given them: assistant turns' tool calls as they
        are where the template renders them, else folded into their text (the model must see
        what it called before the tool turns that answer)."""
        if not any("tool_calls" in message for message in messages):
            return list(messages)
        if self._renders_tool_calls is None:
            self._renders_tool_calls = template_renders_tool_calls(self.tokenizer)
        return list(messages) if self._renders_tool_calls else tool_calls_as_text(messages)

    def _template_tools(self, request: GenerateRequest) -> list | None:
        """The tools to render with the turns: all of them where the chat template renders
        tools, else none; then tool_choice "auto" (the model decides whether to call one,
        having been shown none) is refused."""
        if not request.tools:
            return None
        if self._renders_tools is None:
            self._renders_tools = template_renders_tools(self.tokenizer)
        if self._renders_tools:
            return list(request.tools)
        if request.tool_choice == "auto":
            raise InvalidRequestError(
                'tool_choice "auto" (the default with tools) lets the model decide whether to '
                "call a tool, and this model's chat template does not show it the tools: name "
                'a function ({"type": "function", "function": {"name": ...}}) or send '
                '"required" (the output is then constrained to tool calls)',
                param="tool_choice",
            )
        return None

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
            fixed_k=request.speculation == "on",
            committed_token_ids=request.resume_token_ids,
            stream=request.stream or bool(request.stop),
        )
        request_id = stream.request_id
        text = TextStream(
            self.tokenizer,
            request.stop,
            include_stop=request.include_stop_str_in_output,
            min_tokens=params.min_tokens,
            deferred=not (request.stream or request.stop),  # the text is read at the end only
        )
        if request.resume_token_ids:
            # A resumed request: the caller has (most of) these tokens' text already; it is
            # told where this stream's text starts, so it sends on exactly what is new.
            primed = text.push(list(request.resume_token_ids))
            yield {"kind": "resumed", "text_offset": len(primed)}
        # What the deltas carried, for the final event: this stream's tokens' log-probabilities
        # (a resumed stream's start after its resume tokens) and the prompt's.
        logprobs = [] if params.logprobs is not None else None
        prompt_logprobs = None
        finished = False
        try:
            async for delta in stream:
                # Deltas that piled up while the caller was slow travel as one event.
                while delta.output is None and (more := stream.next_ready()) is not None:
                    delta = delta.merge(more)
                piece = text.push(delta.token_ids)
                output = delta.output
                if text.stopped:  # a stop string: end here, whatever the target would add
                    output = output or await self.coordinator.finish(request_id)
                    finished = True
                    if output is None:  # it ended otherwise meanwhile (cancelled)
                        raise RequestCancelledError(f"request {request_id} was cancelled")
                    # Tokens past the one that completed the stop string are not delivered.
                    before = len(text.token_ids) - len(delta.token_ids)
                    delta = _first_tokens(delta, max(text.kept_tokens - before, 0))
                elif output is not None:
                    finished = True
                    piece += text.flush()
                new_logprobs = new_prompt_logprobs = None
                if logprobs is not None:  # asked: a list, empty for a delta without tokens
                    new_logprobs = self._entries(delta.logprobs or [])
                    logprobs += new_logprobs
                if delta.prompt_logprobs is not None:  # with the request's first tokens
                    new_prompt_logprobs = self._prompt_entries(delta.prompt_logprobs, prompt_ids)
                    prompt_logprobs = new_prompt_logprobs
                if piece or delta.token_ids:
                    yield {
                        "kind": "delta",
                        "text": piece,
                        "token_ids": list(delta.token_ids),
                        "logprobs": new_logprobs,
                        "prompt_logprobs": new_prompt_logprobs,
                    }
                if output is not None:
                    if prompt_logprobs is None and output.prompt_logprobs is not None:
                        prompt_logprobs = self._prompt_entries(output.prompt_logprobs, prompt_ids)
                    yield final_event(
                        output,
                        text.text,
                        "stop" if text.stopped else output.finish_reason,
                        num_tokens=text.kept_tokens if text.stopped else None,
                        logprobs=logprobs,
                        prompt_logprobs=prompt_logprobs,
                    )
                    return
        except RequestCancelledError:
            finished = True
            raise
        finally:
            if not finished:  # the caller went away (or failed): free the workers' state
                self.coordinator.abort(request_id)

    # ---- log-probabilities, as events carry them (specray.serve.protocol) ---------------
    def _token_text(self, token_id: int) -> str:
        """A token's text decoded on its own, special tokens spelled out (as OpenAI and vLLM
        report tokens); ``token_id:<id>`` for a model without a tokenizer (vLLM's spelling)."""
        text = self._token_texts.get(token_id)
        if text is None:
            if self.tokenizer is None:
                text = f"token_id:{token_id}"
            else:
                text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_texts[token_id] = text
        return text

    def _entries(self, logprobs: list[TokenLogprob]) -> list[dict]:
        token = self._token_text
        return [
            {
                "token_id": item.token_id,
                "token": token(item.token_id),
                "logprob": item.logprob,
                "rank": item.rank,
                "top": [
                    {"token_id": top_id, "token": token(top_id), "logprob": top_logprob}
                    for top_id, top_logprob in zip(item.top_ids, item.top_logprobs, strict=True)
                ],
            }
            for item in logprobs
        ]

    def _prompt_entries(
        self, logprobs: list[TokenLogprob | None], prompt_ids: list[int]
    ) -> list[dict]:
        """One per prompt token; the first has no log-probability (nothing precedes it)."""
        first = prompt_ids[0]
        entry = {"token_id": first, "token": self._token_text(first), "logprob": None}
        return [entry | {"rank": None, "top": []}, *self._entries(logprobs[1:])]

    async def abort(self, request_id: str) -> bool:
        return self.coordinator.abort(request_id)

    async def model_info(self) -> dict:
        session = self.coordinator
        return {
            "model": self.model_name,
            "max_model_len": self.max_model_len or 0,
            "vocab_size": session.vocab_size,
            "draft": self.draft_name or "",
            "num_speculative_tokens": session.num_speculative_tokens if self.draft_name else 0,
            "eos_token_ids": sorted(session.eos_token_ids),
        }

    async def tokenize(self, request: GenerateRequest) -> list[int]:
        """The prompt token ids ``generate`` would run ``request`` with (chat template
        applied to messages)."""
        return self._prompt_ids(request)

    async def detokenize(self, token_ids: list[int]) -> str:
        vocab_size = self.coordinator.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise InvalidRequestError(
                f"tokens holds {bad[0]}, outside the vocabulary [0, {vocab_size})", param="tokens"
            )
        if self.tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer", param="tokens")
        return self.tokenizer.decode(token_ids, skip_special_tokens=False)

    async def health(self) -> bool:
        return self.coordinator.healthy

    async def metrics_text(self) -> bytes:
        return await self.coordinator.metrics_text()


class LocalBackend(CoordinatorService):
    """The engine core with its target and draft workers in this process, and a session on it
    from this loop: the same path as a served group, without Ray. Blocks travel draft ->
    target over gRPC on loopback, or in memory with ``draft_placement="colocated"``.

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
        batch_invariant: bool = False,
        draft_placement: str = "workers",
    ) -> LocalBackend:
        import asyncio

        from specray.actors.draft_worker import DraftWorker
        from specray.actors.target_worker import TargetWorker
        from specray.cluster.distributed import reads_target_features
        from specray.cluster.placement import resolve_draft_placement
        from specray.drafters import resolve_draft_name
        from specray.engine_core.aio_client import AsyncEngineCoreClient
        from specray.models.loading import load_model_info

        config = config or CoordinatorConfig()
        name = model_name or target
        loop = asyncio.get_running_loop()
        info = await loop.run_in_executor(None, load_model_info, target)
        worker = await loop.run_in_executor(
            None,
            lambda: TargetWorker(
                target,
                0,
                1,
                "",
                verifier_host="127.0.0.1",
                keep_features=reads_target_features(draft),
                batch_invariant=batch_invariant,
            ),
        )
        drafts = []
        draft_placement = resolve_draft_placement(
            draft_placement, draft, target, pool_sized=num_draft_workers != 1
        )
        if draft is not None and draft_placement == "colocated":
            await loop.run_in_executor(None, worker.colocate_draft, draft, draft_probs_encoding)
        elif draft is not None:
            for _ in range(num_draft_workers):
                drafts.append(
                    await loop.run_in_executor(
                        None, DraftWorker, target, draft, draft_probs_encoding
                    )
                )
                drafts[-1].connect(worker.address)
            await loop.run_in_executor(None, worker.wait_for_drafts, len(drafts))
        session_address = await loop.run_in_executor(
            None,
            lambda: worker.start_engine_core(
                config,
                with_drafts=draft is not None,
                max_positions=info.max_positions,
                model_name=name,
            ),
        )

        async def metrics_text() -> bytes:
            return worker.engine_core.coordinator.metrics.render()

        session = AsyncEngineCoreClient(
            session_address,
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            num_speculative_tokens=config.num_speculative_tokens if draft else 0,
            metrics_text=metrics_text,
        )
        await session.start()
        backend = cls(
            session,
            tokenizer=info.tokenizer,
            model_name=name,
            draft_name=resolve_draft_name(draft, info) if draft else None,
            max_model_len=info.max_positions,
        )
        backend.workers = (worker, drafts)
        return backend

    @property
    def engine(self):
        """The engine core's coordinator (in this process: for introspection and tests)."""
        return self.workers[0].engine_core.coordinator

    async def stop(self, *, drain: bool = True) -> None:
        import asyncio

        await self.coordinator.close()
        target, drafts = self.workers
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, lambda: target.stop_engine_core(drain=drain))
        for draft in drafts:
            draft.stop()
        await loop.run_in_executor(None, target.stop)


__all__ = ["CoordinatorService", "LocalBackend", "final_event"]
