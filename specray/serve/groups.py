"""The ingress's view of the target groups: one session with each group's engine core, the
generation service over it, and resumption when a group fails.

Each Ingress replica holds one session per target group's engine core (found through the
registry) and runs :class:`specray.serve.service.CoordinatorService` over it, so a request's
tokens cross one connection per round from the engine core to this process, batched with every
other request of the group, and text, stop strings and events are made here. A request goes to
the group with the fewest requests of this replica in flight. If its group fails midway (the
session closes: the engine core or a TP rank died and the group restarts), the request is
resubmitted, to a (restarted) group, with the tokens already delivered: the continuation is
drawn from the target conditioned on them, so the output stays exact and the caller sees one
uninterrupted stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, replace

from specray.drafters import resolve_draft_name
from specray.engine_core.aio_client import AsyncEngineCoreClient
from specray.errors import DeadlineExceededError, UnavailableError
from specray.serve.config import AppArgs
from specray.serve.protocol import GenerateRequest
from specray.serve.service import CoordinatorService

log = logging.getLogger(__name__)
RESUME_WINDOW_S = 120.0  # how long a failed request keeps trying to resume (no progress)
RESUME_BACKOFF_S = 0.25  # first wait before resuming; doubles, capped at 5 s
REFRESH_S = 1.0  # how often the replica re-reads the target groups from the registry


@dataclass
class Group:
    group_id: str
    address: str
    leader: object  # rank 0's actor handle (metrics)
    session: AsyncEngineCoreClient
    service: CoordinatorService

    @property
    def in_flight(self) -> int:
        return self.session.in_flight


def _whole_logprobs(final: dict, emitted_logprobs: list, prompt_logprobs) -> dict:
    """A resumed attempt's final event with the whole request's log-probabilities: the attempt
    knows only its own tokens' (the deltas of every attempt carried them all), and the engine
    core scores no prompt for a resumed request (the first attempt's first delta had it)."""
    if final.get("logprobs") is not None:
        final = {**final, "logprobs": list(emitted_logprobs)}
    if final.get("prompt_logprobs") is None and prompt_logprobs is not None:
        final = {**final, "prompt_logprobs": prompt_logprobs}
    return final


class GroupsBackend:
    """A :class:`specray.serve.protocol.GenerationBackend` over every target group."""

    def __init__(self, args: AppArgs, registry):
        self.args, self.registry = args, registry
        self.groups: dict[str, Group] = {}
        self.resumes = 0  # requests resumed after their target group failed
        self._where: dict[str, Group] = {}  # request id -> its group (for Abort)
        self._follow: asyncio.Task | None = None

    async def start(self) -> None:
        """Load the model's description and wait for a first group (startup_timeout_s)."""
        from specray.models.loading import load_model_info

        loop = asyncio.get_running_loop()
        self.info = await loop.run_in_executor(None, load_model_info, self.args.target)
        deadline = loop.time() + self.args.startup_timeout_s
        while not self.groups:
            await self._refresh()
            if not self.groups:
                if loop.time() > deadline:
                    raise RuntimeError("no target group registered before startup_timeout_s")
                await asyncio.sleep(0.5)
        self._follow = asyncio.create_task(self._follow_groups())

    async def _follow_groups(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            try:
                await self._refresh()
            except Exception as error:
                log.warning("target group refresh failed: %s", error)

    async def _refresh(self) -> None:
        """Open sessions with new (or restarted) groups; close those of groups gone."""
        targets = await self.registry.endpoints.remote()
        for group_id in set(self.groups) - set(targets):
            await self.groups.pop(group_id).session.close()
        for group_id, target in targets.items():
            known = self.groups.get(group_id)
            if known is not None and known.address == target["address"]:
                if known.session.healthy:
                    continue
                await known.session.close()
            try:
                self.groups[group_id] = await self._connect(group_id, target)
            except Exception as error:  # not serving yet (restarting): next refresh
                log.warning("no session with target group %s yet: %s", group_id, error)
                self.groups.pop(group_id, None)

    async def _connect(self, group_id: str, target: dict) -> Group:
        info, leader = self.info, target["leader"]

        async def metrics_text() -> bytes:
            return await leader.engine_core_metrics.remote()

        session = AsyncEngineCoreClient(
            target["address"],
            vocab_size=info.vocab_size,
            eos_token_ids=info.eos_token_ids,
            num_speculative_tokens=self.args.num_speculative_tokens if self.args.draft else 0,
            metrics_text=metrics_text,
        )
        await session.start(connect_timeout_s=5.0)
        service = CoordinatorService(
            session,
            tokenizer=info.tokenizer,
            model_name=self.args.served_name,
            draft_name=resolve_draft_name(self.args.draft, info) if self.args.draft else None,
            max_model_len=info.max_positions,
        )
        return Group(group_id, target["address"], leader, session, service)

    def _pick(self) -> Group:
        healthy = [group for group in self.groups.values() if group.session.healthy]
        if not healthy:
            raise UnavailableError("no target group is serving; retry")
        return min(healthy, key=lambda group: group.in_flight)

    async def generate(self, request: GenerateRequest):
        """The request's events; if its group fails midway, it resumes from the tokens already
        delivered, for up to ``RESUME_WINDOW_S`` of no progress."""
        loop = asyncio.get_running_loop()
        deadline = None if request.timeout_s is None else loop.time() + request.timeout_s
        emitted: list[int] = []  # token ids the caller has
        emitted_logprobs: list[dict] = []  # their log-probability entries (when asked)
        prompt_logprobs = None  # the prompt's entries, once a delta carried them
        delivered = 0  # characters of text the caller has
        failed_since = None
        attempt = request
        while True:
            try:
                group = self._pick()
                if request.request_id is not None:
                    self._where[request.request_id] = group
                offset = 0  # where this attempt's text starts
                async for event in group.service.generate(attempt):
                    kind = event["kind"]
                    if kind == "resumed":
                        offset = event["text_offset"]
                        continue
                    if kind == "delta":
                        emitted += event["token_ids"]
                        emitted_logprobs += event.get("logprobs") or ()
                        prompt_logprobs = event.get("prompt_logprobs") or prompt_logprobs
                        start = offset
                        offset += len(event["text"])
                        if start < delivered:  # after a resume: part of it was delivered
                            event = {**event, "text": event["text"][delivered - start :]}
                        delivered = max(delivered, offset)
                    elif kind == "final" and attempt.resume_token_ids:
                        event = _whole_logprobs(event, emitted_logprobs, prompt_logprobs)
                    yield event
                    failed_since = None  # progress: a later failure gets a full window
                    if kind == "final":
                        return
                raise UnavailableError("the engine core's stream ended early")
            except UnavailableError as cause:  # the group failed, is draining or restarting
                now = loop.time()
                failed_since = failed_since or now
                if now - failed_since > RESUME_WINDOW_S:
                    raise UnavailableError(
                        f"the request failed and could not resume within {RESUME_WINDOW_S:.0f} s: "
                        f"{cause}"
                    ) from None
                if deadline is not None and now >= deadline:
                    raise DeadlineExceededError("the deadline passed while resuming") from None
                self.resumes += 1
                log.warning("resuming a request after %d tokens: %s", len(emitted), cause)
                await asyncio.sleep(min(RESUME_BACKOFF_S * 2 ** min(self.resumes, 4), 5.0))
                with contextlib.suppress(Exception):
                    await self._refresh()
                timeout = None if deadline is None else max(deadline - loop.time(), 0.001)
                attempt = replace(request, resume_token_ids=tuple(emitted), timeout_s=timeout)
            finally:
                if request.request_id is not None:
                    self._where.pop(request.request_id, None)

    async def abort(self, request_id: str) -> bool:
        group = self._where.get(request_id)
        return await group.service.abort(request_id) if group is not None else False

    async def model_info(self) -> dict:
        return await self._pick().service.model_info()

    async def tokenize(self, request: GenerateRequest) -> list[int]:
        return await self._pick().service.tokenize(request)

    async def detokenize(self, token_ids: list[int]) -> str:
        return await self._pick().service.detokenize(token_ids)

    async def health(self) -> bool:
        return any(group.session.healthy for group in self.groups.values())

    async def metrics_text(self) -> bytes:
        """Each group's engine core, live (one: as is; several: merged with a ``replica``
        label), then this replica's own."""
        from specray.engine_core.metrics import merge_expositions

        groups = list(self.groups.values())
        texts = await asyncio.gather(*(group.session.metrics_text() for group in groups))
        if len(texts) == 1:
            text = texts[0]
        else:
            text = merge_expositions(
                {group.group_id: text for group, text in zip(groups, texts, strict=True)}
            )
        return text + self._own_metrics()

    def _own_metrics(self) -> bytes:
        name = "specray:ingress_request_resumes_total"
        return (
            f"# HELP {name} Requests resumed after their target group failed.\n"
            f"# TYPE {name} counter\n{name} {self.resumes}\n"
        ).encode()

    async def close(self) -> None:
        if self._follow is not None:
            self._follow.cancel()
        for group in self.groups.values():
            await group.session.close()
