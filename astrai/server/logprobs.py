"""Token logprobs in OpenAI's two shapes: chat (`content` entries) and legacy completions."""

from __future__ import annotations

from collections.abc import Sequence

from astrai.inference.task import TokenLogprob
from astrai.tokenize import TokenizerError


def _token(tokenizer, token_id: int) -> tuple[str, list[int]]:
    try:
        raw = tokenizer.token_bytes(token_id)
    except TokenizerError:  # a model's embedding may be padded past the tokenizer's vocabulary
        raw = b""
    # A token may hold part of a UTF-8 character; its text then shows the bytes escaped.
    return raw.decode("utf-8", errors="backslashreplace"), list(raw)


def chat_logprobs(tokenizer, entries: Sequence[TokenLogprob]) -> dict:
    """`choices[].logprobs` of a chat completion: {content: [{token, logprob, bytes, top_...}]}."""
    content = []
    for entry in entries:
        text, raw = _token(tokenizer, entry.token_id)
        top = []
        for token_id, logprob in entry.top:
            top_text, top_raw = _token(tokenizer, token_id)
            top.append({"token": top_text, "logprob": logprob, "bytes": top_raw})
        content.append({"token": text, "logprob": entry.logprob, "bytes": raw, "top_logprobs": top})
    return {"content": content, "refusal": None}


def completion_logprobs(
    tokenizer, entries: Sequence[TokenLogprob], text_offset: int = 0
) -> tuple[dict, int]:
    """`choices[].logprobs` of a completion, and the text offset just past its last token.

    text_offset counts characters from the start of this choice's generated text.
    """
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for entry in entries:
        text, _ = _token(tokenizer, entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        # Like OpenAI, the sampled token is always among the alternatives.
        top = {_token(tokenizer, t)[0]: lp for t, lp in entry.top}
        top.setdefault(text, entry.logprob)
        top_logprobs.append(top)
        offsets.append(text_offset)
        text_offset += len(text)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
    return body, text_offset
