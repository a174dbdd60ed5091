"""Embeddings: OpenAI's POST /v1/embeddings, Ollama's POST /api/embed and its older
POST /api/embeddings.

An embedding is the model's final hidden states (after the final norm) of an input's tokens,
pooled as the engine pools them (EngineConfig.pooling: the last token's, or the mean) and
L2-normalized; `dimensions` keeps the first k of them and normalizes again, as a
Matryoshka-trained model is meant to be cut. The engine computes them in the prefill, batched
with every other request, without decoding.
"""

from __future__ import annotations

import base64
import time
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from fastapi import APIRouter, Request

from astrai.server.errors import APIError
from astrai.server.fields import refuse_unsupported
from astrai.server.generation import GenerationService
from astrai.server.ollama_api import JSONBodyRoute, keep_alive_seconds, ollama_name
from astrai.server.protocol import EmbeddingRequest, OllamaEmbeddingsRequest, OllamaEmbedRequest
from astrai.server.registry import model_service

router = APIRouter()
# Ollama's routes read their body as JSON whatever its Content-Type, as Ollama's own do.
ollama_router = APIRouter(route_class=JSONBodyRoute)


async def _embeddings(
    service: GenerationService,
    prompts: Sequence[list[int]],
    model: str | None,
    dimensions: int | None,
    request: Request,
) -> torch.Tensor:
    """The prompts' embeddings [len(prompts), dimensions or the model's width], normalized,
    under the LoRA adapter model names, if any."""
    width = service.engine.model.config.dim
    if dimensions is not None and dimensions > width:
        raise APIError(
            400,
            f"dimensions is {dimensions}, but this model's embeddings have {width}; ask for "
            f"at most {width}",
            param="dimensions",
        )
    outputs = await service.embed(prompts, model).collect(request)
    pooled = torch.stack([out.result.embedding for out in outputs])
    return F.normalize(pooled[:, :dimensions], dim=-1)


def _check_lengths(prompts: Sequence[list[int]], limit: int, what: str, fix: str) -> None:
    """A 400 naming the first input longer than limit tokens."""
    for i, prompt in enumerate(prompts):
        if len(prompt) > limit:
            raise APIError(
                400,
                f"input {i} has {len(prompt)} tokens, but {what} is {limit} tokens; {fix}",
                param="input",
                code="context_length_exceeded",
            )


# OpenAI


@router.post("/v1/embeddings")
async def embeddings(body: EmbeddingRequest, request: Request) -> dict:
    service = await model_service(request, body.model)
    refuse_unsupported(body)
    inputs = body.input
    if isinstance(inputs, str) or all(isinstance(item, int) for item in inputs):
        inputs = [inputs]
    prompts = []
    for item in inputs:
        if isinstance(item, str):
            prompts.append(await service.text_prompt(item, body.add_special_tokens))
        else:
            service.check_token_ids(item, "input")
            prompts.append(list(item))
    prompts = service.truncate(prompts, body.truncate_prompt_tokens)
    _check_lengths(
        prompts,
        service.engine.max_request_tokens,
        "the most this server embeds at once (its context length)",
        "shorten it, or send truncate_prompt_tokens",
    )
    vectors = await _embeddings(service, prompts, body.model, body.dimensions, request)
    data = [
        {"object": "embedding", "index": i, "embedding": _encoded(vector, body.encoding_format)}
        for i, vector in enumerate(vectors)
    ]
    tokens = sum(len(prompt) for prompt in prompts)
    return {
        "object": "list",
        "data": data,
        "model": body.model or service.model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _encoded(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """A vector as a list of floats, or as base64 of its little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


# Ollama


def _context_length(service: GenerationService, options: dict[str, Any] | None) -> int:
    """The most tokens of one input: the server's context length, or less under num_ctx, the
    one option that bears on an embedding; any other option is refused."""
    limit = service.engine.max_request_tokens
    for key, value in (options or {}).items():
        if key != "num_ctx":
            raise APIError(
                400,
                f"options.{key} does not apply to embeddings (num_ctx is the one option they "
                "take); leave it out",
                param=f"options.{key}",
            )
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise APIError(
                400, f"options.num_ctx must be a positive integer, got {value!r}", param="options"
            )
        limit = min(limit, value)
    return limit


async def _ollama_prompts(
    service: GenerationService, texts: Sequence[str], limit: int, truncate: bool
) -> list[list[int]]:
    """The texts' token ids: cut to limit tokens under truncate (Ollama keeps the start),
    else a 400 for a text longer than that."""
    prompts = [await service.text_prompt(text) for text in texts]
    if truncate:
        return [prompt[:limit] for prompt in prompts]
    _check_lengths(prompts, limit, "the context length", "shorten it, or send truncate true")
    return prompts


@ollama_router.post("/api/embed")
async def ollama_embed(body: OllamaEmbedRequest, request: Request) -> dict:
    started = time.perf_counter()
    model = ollama_name(body.model)
    service = await model_service(request, model, keep_alive_seconds(body.keep_alive))
    ready = max(started, service.ready)
    limit = _context_length(service, body.options)
    texts = [body.input] if isinstance(body.input, str) else body.input
    texts = [text for text in texts if text]  # Ollama embeds no empty text
    prompts = await _ollama_prompts(service, texts, limit, body.truncate)
    vectors = (
        await _embeddings(service, prompts, model, body.dimensions, request) if prompts else []
    )
    return {
        "model": body.model,
        "embeddings": [vector.tolist() for vector in vectors],
        "total_duration": int((time.perf_counter() - started) * 1e9),
        "load_duration": int((ready - started) * 1e9),  # the model's load, if it was not
        "prompt_eval_count": sum(len(prompt) for prompt in prompts),
    }


@ollama_router.post("/api/embeddings")
async def ollama_embeddings(body: OllamaEmbeddingsRequest, request: Request) -> dict:
    model = ollama_name(body.model)
    service = await model_service(request, model, keep_alive_seconds(body.keep_alive))
    limit = _context_length(service, body.options)
    if not body.prompt:
        return {"embedding": []}
    prompts = await _ollama_prompts(service, [body.prompt], limit, truncate=True)
    [vector] = await _embeddings(service, prompts, model, None, request)
    return {"embedding": vector.tolist()}
