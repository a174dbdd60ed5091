"""Tokenization: Hugging Face tokenizers, chat templates and streaming detokenization."""

from astrai.tokenize.tokenizer import (
    AutoTokenizer,
    ChatTemplateError,
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
)

__all__ = [
    "AutoTokenizer",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerError",
]
