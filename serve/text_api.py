"""POST /v1/completions: raw text (or token ids) in, text out; no chat template, no tool parsing.

Bodies and chunks carry `policy_version`, known at the first generated token: a stream holds the
chunks before it (the echoed prompt) until then. A stream that fails ends with the error event, without
`[DONE]`."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse

from serve.chat_api import per_choice_params, usage
from serve.engine.base import SamplingParams
from serve.generation import Finish, Piece, run_choice
from serve.schemas import APIError, CompletionRequest
from serve.state import ServerState, engine_error, request_id, unless_disconnected


def prepare(state: ServerState, req: CompletionRequest) -> list[tuple[int, list[int], str, SamplingParams]]:
    """(choice index, prompt ids, prompt text, params) per choice; on a worker thread (it tokenises)."""
    state.check_model(req.model)
    jobs = []
    vocab = state.chat.tokenizer.get_vocab_size()
    for prompt in req.prompts():
        if isinstance(prompt, str):
            ids = state.encode(prompt, "prompt")
        else:
            if any(not 0 <= t < vocab for t in prompt):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt",
                               code="invalid_token_id")
            ids = list(prompt)
        params = state.sampling(req, len(ids), req.max_tokens, req.logprobs is not None, req.logprobs or 0)
        text = prompt if isinstance(prompt, str) else state.chat.decode(ids) if req.echo else ""
        for j in range(req.n):
            jobs.append((len(jobs), ids, text, per_choice_params(params, j)))
    return jobs


async def text_completion(state: ServerState, req: CompletionRequest, request: Request):
    jobs = await state.offload(prepare, state, req)
    rid, created = request_id("cmpl"), int(time.time())
    base = {"id": rid, "object": "text_completion", "created": created, "model": state.served_name,
            **state.numerics()}
    prompt_tokens = sum(len(ids) for _, ids, _, _ in jobs) // req.n
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return StreamingResponse(_stream(state, req, jobs, base, prompt_tokens, include_usage),
                                 media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
    results = await unless_disconnected(request, asyncio.gather(*(_collect(state, req, job) for job in jobs)))
    choices = [c for c, _, _, _ in results]
    body: dict[str, Any] = base | {"policy_version": state.response_version([v for _, _, v, _ in results]),
                                   "choices": choices,
                                   "usage": usage(prompt_tokens, sum(n for _, n, _, _ in results),
                                                  [c for _, _, _, c in results], req.n)}
    if req.return_token_ids:
        body["prompt_token_ids"] = [ids for _, ids, _, _ in jobs[:: req.n]]
    state.metrics.requests.labels("/v1/completions", "200").inc()
    return body


def _legacy_logprobs(state: ServerState, pieces: list[Piece], offset: int) -> dict[str, Any]:
    """The completions API's logprobs: tokens, their logprobs, the top alternatives, text offsets."""
    decode = state.chat.tokenizer.decode
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for piece in pieces:
        for tid, lp, top in zip(piece.token_ids, piece.logprobs, piece.tops, strict=False):
            token = decode([tid], skip_special_tokens=False)
            out["tokens"].append(token)
            out["token_logprobs"].append(lp)
            out["top_logprobs"].append({decode([t], skip_special_tokens=False): v for t, v in top} if top else None)
            out["text_offset"].append(offset)
            offset += len(token)
    return out


async def _collect(state: ServerState, req: CompletionRequest,
                   job) -> tuple[dict[str, Any], int, int | None, int | None]:
    """(choice, completion tokens, policy version, cached prompt tokens)."""
    index, ids, text, params = job
    pieces: list[Piece] = []
    finish, n, version, cached = "length", 0, None, None
    async for piece in run_choice(state.engine, state.chat.tokenizer, ids, params, req.stop_list(), state.metrics):
        if isinstance(piece, Finish):
            finish, n, version = piece.reason, piece.completion_tokens, piece.policy_version
            cached = piece.cached_tokens
        else:
            pieces.append(piece)
    token_ids = [t for p in pieces for t in p.token_ids]
    prefix = text if req.echo else ""
    choice: dict[str, Any] = {"index": index, "text": prefix + "".join(p.text for p in pieces),
                              "finish_reason": finish,
                              "logprobs": None if req.logprobs is None else _legacy_logprobs(state, pieces, len(prefix))}
    if req.return_token_ids:
        choice["token_ids"] = token_ids
    return choice, n, version, cached


async def _stream(state: ServerState, req: CompletionRequest, jobs, base: dict[str, Any], prompt_tokens: int,
                  include_usage: bool) -> AsyncIterator[bytes]:
    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return f"data: {json.dumps(base | {'choices': choices} | extra, ensure_ascii=False)}\n\n".encode()

    queue: asyncio.Queue = asyncio.Queue()  # (choice or error body, completion tokens, finished, policy version)
    cached: list[int | None] = [None] * len(jobs)  # per job, once finished (usage)

    async def produce(job) -> None:
        try:
            await _produce(job)
        except Exception as e:  # noqa: BLE001 - reported in-stream: headers are already sent
            await queue.put((engine_error(e), 0, True, getattr(e, "policy_version", None)))

    async def _produce(job) -> None:
        index, ids, text, params = job
        offset = 0
        if req.echo:
            await queue.put(({"index": index, "text": text, "finish_reason": None, "logprobs": None}, 0, False, None))
            offset = len(text)
        async for piece in run_choice(state.engine, state.chat.tokenizer, ids, params, req.stop_list(),
                                      state.metrics, state.stream_interval):
            if isinstance(piece, Finish):
                cached[index] = piece.cached_tokens
                await queue.put(({"index": index, "text": "", "finish_reason": piece.reason, "logprobs": None},
                                 piece.completion_tokens, True, piece.policy_version))
            elif piece.text or req.return_token_ids or (req.logprobs is not None and piece.token_ids):
                lp = None
                if req.logprobs is not None:
                    lp = _legacy_logprobs(state, [piece], offset)
                    offset += sum(len(t) for t in lp["tokens"])
                c = {"index": index, "text": piece.text, "finish_reason": None, "logprobs": lp}
                if req.return_token_ids:
                    c["token_ids"] = piece.token_ids
                await queue.put((c, 0, False, piece.policy_version))

    tasks = [asyncio.create_task(produce(job)) for job in jobs]
    try:
        done, completion = 0, 0
        held: list[dict[str, Any]] = []  # chunks that came before the policy version was known
        while done < len(jobs):
            c, n, finished, version = await queue.get()
            done += finished
            completion += n
            if "policy_version" not in base and (version is not None or isinstance(c, APIError)):
                base["policy_version"] = state.response_version([version])
                for h in held:
                    yield chunk([h])
                held = []
            if isinstance(c, APIError):  # the last event: no usage, no [DONE] (the answer is not complete)
                yield f"data: {json.dumps(c.body())}\n\n".encode()
                state.metrics.requests.labels("/v1/completions", str(c.status)).inc()
                return
            if "policy_version" not in base:
                held.append(c)
            else:
                yield chunk([c])
        base.setdefault("policy_version", state.response_version([]))
        for h in held:
            yield chunk([h])
        if include_usage:
            yield chunk([], usage=usage(prompt_tokens, completion, cached, req.n))
        yield b"data: [DONE]\n\n"
        state.metrics.requests.labels("/v1/completions", "200").inc()
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
