"""Tokenization: Hugging Face tokenizers, chat templates and streaming detokenization."""

from astrai.tokenize.auto_tokenizer import AutoTokenizer
from astrai.tokenize.chat_template import ChatTemplateError
from astrai.tokenize.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

__all__ = [
    "AutoTokenizer",
    "ChatTemplateError",
    "IncrementalDetokenizer",
    "Tokenizer",
    "TokenizerError",
]
