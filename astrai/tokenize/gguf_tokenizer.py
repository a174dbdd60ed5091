"""The tokenizer a GGUF file describes, built as a `tokenizers` tokenizer from its metadata.

A GGUF file has no tokenizer.json: it stores the vocabulary, merges, token types, special token
ids and chat template under llama.cpp's `tokenizer.*` keys. This module reads them with the `gguf`
package and assembles the tokenizer they describe: byte-level BPE ("gpt2") or SentencePiece BPE
("llama"). Which regexes split the text before byte-level BPE is not in the file, only its name
(`tokenizer.ggml.pre`); the regexes are llama.cpp's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors

from astrai.tokenize.tokenizer import BYTE_DECODER, Tokenizer, TokenizerError

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# tokenizer.ggml.pre -> the regexes that split the text, applied one after another (llama.cpp's
# llama-vocab.cpp). "smollm" isolates every digit first: its vocabulary has no multi-digit tokens.
PRE_TOKENIZER_SPLITS: dict[str, tuple[str, ...]] = {
    "gpt2": (_GPT2_SPLIT,),
    "smollm": (r"\p{N}", _GPT2_SPLIT),
    "starcoder": (r"\p{N}", _GPT2_SPLIT),
    "llama-bpe": (_LLAMA3_SPLIT,),
    "qwen2": (_QWEN2_SPLIT,),
}

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
_CONTROL = 3
_USER_DEFINED = 4
_UNUSED = 5

# The special tokens a chat template sees, by the metadata key of their id.
_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}
# Ids that end a turn besides EOS: end of turn and of message (Llama 3's <|eot_id|>, <|eom_id|>).
_STOP_TOKEN_KEYS = ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")


def load_gguf_tokenizer(path: str | os.PathLike, chat_template: str | None = None) -> Tokenizer:
    """The tokenizer of a GGUF file; chat_template (the template's text) replaces the file's."""
    metadata = _read_metadata(Path(path))
    model_type = metadata.get("tokenizer.ggml.model")
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if model_type == "gpt2":
        backend = _byte_level_backend(metadata, tokens, token_types, path)
    elif model_type == "llama":
        backend = _sentencepiece_backend(metadata, tokens)
    else:
        raise TokenizerError(
            f"{path} has a {model_type!r} tokenizer (tokenizer.ggml.model); astrai reads "
            "GPT-2-style byte-level BPE ('gpt2') and SentencePiece BPE ('llama') from GGUF files. "
            "Use the model's Hugging Face directory (with tokenizer.json) instead"
        )
    # llama.cpp matches control and user-defined tokens whole in the text, before BPE.
    kinds = list(enumerate(token_types))
    backend.add_special_tokens([_added(tokens[i], True) for i, kind in kinds if kind == _CONTROL])
    backend.add_tokens([_added(tokens[i], False) for i, kind in kinds if kind == _USER_DEFINED])
    special_tokens = {
        name: _token_at(tokens, metadata[key], key)
        for name, key in _SPECIAL_TOKEN_KEYS.items()
        if key in metadata
    }
    backend.post_processor = _post_processor(metadata, tokens)
    templates = {}
    if chat_template is not None:
        templates["default"] = chat_template
    elif "tokenizer.chat_template" in metadata:
        templates["default"] = metadata["tokenizer.chat_template"]
    stop_ids = [metadata[key] for key in _STOP_TOKEN_KEYS if key in metadata]
    return Tokenizer(
        backend, special_tokens=special_tokens, chat_templates=templates, eos_token_ids=stop_ids
    )


def _byte_level_backend(
    metadata: dict[str, Any], tokens: list[str], token_types: list[int], path: str | os.PathLike
) -> tokenizers.Tokenizer:
    """GPT-2-style BPE over bytes: the file's merges, split first by the named regexes."""
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=_byte_level_vocab(tokens, token_types),
            merges=_file_merges(metadata["tokenizer.ggml.merges"]),
            fuse_unk=False,
        )
    )
    backend.pre_tokenizer = _pre_tokenizer(metadata.get("tokenizer.ggml.pre", "gpt2"), path)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_backend(metadata: dict[str, Any], tokens: list[str]) -> tokenizers.Tokenizer:
    """SentencePiece BPE (Llama 2, Mistral): spaces spelled as U+2581 and one prefixed, unknown
    characters as <0xNN> byte tokens, merges in order of the merged piece's score. Built as
    transformers builds LlamaTokenizer from a GGUF file, so both give the same ids."""
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    merges = metadata.get("tokenizer.ggml.merges")
    merges = (
        _file_merges(merges)
        if merges
        else _merges_by_score(vocab, metadata.get("tokenizer.ggml.scores") or [0.0] * len(tokens))
    )
    unknown_key = "tokenizer.ggml.unknown_token_id"
    backend = tokenizers.Tokenizer(
        models.BPE(
            vocab=vocab,
            merges=merges,
            unk_token=_token_at(tokens, metadata[unknown_key], unknown_key)
            if unknown_key in metadata
            else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_SPACE, prepend_scheme="first", split=False
    )
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace(_SPACE, " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(content=" ", left=1),
        ]
    )
    return backend


_SPACE = "\u2581"


def _file_merges(merges: list[str]) -> list[tuple[str, str]]:
    """The file's merges, each written "left right"."""
    return [tuple(merge.split(" ", 1)) for merge in merges]


def _merges_by_score(vocab: dict[str, int], scores: list[float]) -> list[tuple[str, str]]:
    """The merges a SentencePiece vocabulary implies: every split of a piece into two pieces of
    the vocabulary, the highest-scoring piece's first (ties: longer left part, then lower ids)."""
    merges = []
    for piece, score in zip(vocab, scores, strict=True):
        splits = [
            (piece[:cut], piece[cut:])
            for cut in range(1, len(piece))
            if piece[:cut] in vocab and piece[cut:] in vocab
        ]
        splits.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, score) for left, right in splits)
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _read_metadata(path: Path) -> dict[str, Any]:
    """The file's tokenizer.* metadata as Python values."""
    if not path.is_file():
        raise TokenizerError(f"{path} does not exist; pass the path of a .gguf file")
    # Imported here: the weights loader's reader is shared, so the file is parsed once.
    from astrai.model.weights.gguf import CheckpointError, open_gguf

    try:
        reader = open_gguf(path)
    except CheckpointError as exc:
        raise TokenizerError(str(exc)) from exc
    fields = reader.fields.items()
    metadata = {key: field.contents() for key, field in fields if key.startswith("tokenizer.")}
    for key in ("tokenizer.ggml.model", "tokenizer.ggml.tokens"):
        if key not in metadata:
            raise TokenizerError(f"{path} has no {key} in its metadata, so no tokenizer to build")
    return metadata


def _byte_level_vocab(tokens: list[str], token_types: list[int]) -> dict[str, int]:
    """Token -> id. Normal tokens are spelled in GPT-2's byte alphabet; one that is not (a file
    written with raw text) is respelled, as transformers does. Control tokens keep their text.

    Unused tokens are left out: llama.cpp's converter pads a vocabulary to the embedding's rows
    with [PAD<id>] tokens of that type, which llama.cpp decodes to nothing, as transformers
    decodes an id its tokenizer lacks."""
    vocab = {}
    for token_id, (token, kind) in enumerate(zip(tokens, token_types, strict=True)):
        if kind == _UNUSED:
            continue
        if kind not in (_CONTROL, _USER_DEFINED) and not _BYTE_CHARS.issuperset(token):
            token = "".join(_BYTE_ENCODER[byte] for byte in token.encode("utf-8"))
        vocab[token] = token_id
    return vocab


_BYTE_ENCODER = {byte: char for char, byte in BYTE_DECODER.items()}
_BYTE_CHARS = frozenset(BYTE_DECODER)


def _pre_tokenizer(name: str, path: str | os.PathLike) -> pre_tokenizers.PreTokenizer:
    splits = PRE_TOKENIZER_SPLITS.get(name)
    if splits is None:
        raise TokenizerError(
            f"{path} names the pre-tokenizer {name!r} (tokenizer.ggml.pre), which astrai does not "
            f"know; known: {', '.join(sorted(PRE_TOKENIZER_SPLITS))}. Use the model's Hugging Face "
            "directory (with tokenizer.json) instead"
        )
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated") for split in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )


def _added(token: str, special: bool) -> AddedToken:
    return AddedToken(token, special=special, normalized=False)


def _token_at(tokens: list[str], token_id: int, key: str) -> str:
    if not 0 <= token_id < len(tokens):
        raise TokenizerError(f"{key} is {token_id}, outside the vocabulary of {len(tokens)} tokens")
    return tokens[token_id]


def _post_processor(metadata: dict[str, Any], tokens: list[str]) -> processors.PostProcessor | None:
    """BOS/EOS added by encode(add_special_tokens=True), as the file's add_*_token flags say.
    Without a flag, BOS only for a SentencePiece vocabulary, as transformers and llama.cpp do."""
    bos_id = metadata.get("tokenizer.ggml.bos_token_id")
    eos_id = metadata.get("tokenizer.ggml.eos_token_id")
    sentencepiece = metadata["tokenizer.ggml.model"] == "llama"
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", sentencepiece)
    prefix = [bos_id] if add_bos and bos_id is not None else []
    suffix = [eos_id] if metadata.get("tokenizer.ggml.add_eos_token") and eos_id is not None else []
    if not prefix and not suffix:
        return None
    prefix_tokens = [tokens[i] for i in prefix]
    suffix_tokens = [tokens[i] for i in suffix]
    return processors.TemplateProcessing(
        single=[*prefix_tokens, "$A", *suffix_tokens],
        pair=[*prefix_tokens, "$A", *suffix_tokens, *prefix_tokens, "$B", *suffix_tokens],
        special_tokens=[(tokens[i], i) for i in {*prefix, *suffix}],
    )
