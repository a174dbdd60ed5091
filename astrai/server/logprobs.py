"""Token logprobs in OpenAI's two shapes, chat (`content` entries) and legacy completions (an
echo's prompt tokens too), and vLLM's prompt_logprobs."""

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


def prompt_logprobs(
    tokenizer, entries: Sequence[TokenLogprob | None], k: int
) -> list[dict[str, dict] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None for the first (nothing predicts it),
    else {token id: {logprob, rank, decoded_token}} of the token itself and the top k."""
    out: list[dict[str, dict] | None] = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {
            str(entry.token_id): _ranked(tokenizer, entry.token_id, entry.logprob, entry.rank)
        }
        for rank, (token_id, logprob) in enumerate(entry.top[:k], 1):
            ranked.setdefault(str(token_id), _ranked(tokenizer, token_id, logprob, rank))
        out.append(ranked)
    return out


def _ranked(tokenizer, token_id: int, logprob: float, rank: int | None) -> dict:
    return {"logprob": logprob, "rank": rank, "decoded_token": _token(tokenizer, token_id)[0]}


def echo_logprobs(
    tokenizer, prompt_ids: Sequence[int], entries: Sequence[TokenLogprob | None], k: int
) -> tuple[dict, int]:
    """The prompt's part of an echoed completion's `logprobs`, and the text offset past it:
    the first token's logprob and alternatives are null, as OpenAI's are; each other token has
    its own logprob and, among its top k alternatives, itself."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    text_offset = 0
    for token_id, entry in zip(prompt_ids, entries, strict=True):
        text, _ = _token(tokenizer, token_id)
        tokens.append(text)
        offsets.append(text_offset)
        text_offset += len(text)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top = {_token(tokenizer, t)[0]: lp for t, lp in entry.top[:k]}
        top.setdefault(text, entry.logprob)
        top_logprobs.append(top)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }
    return body, text_offset


def joined_logprobs(first: dict, second: dict) -> dict:
    """Two parts of a completion's `logprobs` (the echoed prompt's, the text's), one after the
    other."""
    return {key: first[key] + second[key] for key in first}
