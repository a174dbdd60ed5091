"""Tokenization: Hugging Face tokenizers, chat templates and streaming detokenization."""

from astrai.tokenize.chat_template import ChatTemplateError
from astrai.tokenize.tokenizer import (
    AutoTokenizer,
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
