"""vLLM's tokenizer endpoints: /tokenize (a prompt or chat messages) and /detokenize."""

from __future__ import annotations

from fastapi import APIRouter, Request

from astrai.server.fields import refuse_unsupported
from astrai.server.protocol import DetokenizeRequest, TokenizeRequest
from astrai.server.registry import model_service

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict:
    """The ids the engine would run for a completion prompt or a chat, as vLLM answers them."""
    service = await model_service(request, body.model)
    refuse_unsupported(body)
    if body.prompt is not None:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        tokens = await service.text_prompt(body.prompt, add_special)
    else:
        service.check_message_extras(body.messages)
        messages = [m.template_message() for m in body.messages]
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or ()] or None
        tokens = await service.chat_prompt(
            messages, body.add_generation_prompt, bool(body.add_special_tokens), tools
        )
        tokens = list(tokens)  # an image prompt's ids, each image's placeholders expanded
    reply = {"count": len(tokens), "max_model_len": service.engine.max_seq_len, "tokens": tokens}
    if body.return_token_strs:
        reply["token_strs"] = [service.tokenizer.id_to_token(t) for t in tokens]
    return reply


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict:
    service = await model_service(request, body.model)
    service.check_token_ids(body.tokens, "tokens")
    return {"prompt": service.tokenizer.decode(body.tokens)}
