"""AutoTokenizer: the one entry point that picks a tokenizer's reader by what the path holds.

It sits above both readers (a Hugging Face directory's files in tokenizer.py, a GGUF file's
metadata in gguf_tokenizer.py), which share the Tokenizer they build.
"""

from __future__ import annotations

import os
from pathlib import Path

from astrai.tokenize.gguf_tokenizer import load_gguf_tokenizer
from astrai.tokenize.tokenizer import Tokenizer, chat_template_text, load_hf_tokenizer


class AutoTokenizer:
    """Loads the tokenizer of a Hugging Face model directory or a GGUF file."""

    @staticmethod
    def from_pretrained(
        path: str | os.PathLike, chat_template: str | os.PathLike | None = None
    ) -> Tokenizer:
        """Read tokenizer.json, tokenizer_config.json, generation_config.json and chat templates,
        or the metadata of a .gguf file.

        chat_template, a Jinja file or the template's text, replaces the model's default one.
        """
        if Path(path).suffix == ".gguf":
            template = None if chat_template is None else chat_template_text(chat_template)
            return load_gguf_tokenizer(path, chat_template=template)
        return load_hf_tokenizer(path, chat_template)
