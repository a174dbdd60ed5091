"""Session fixtures shared by every test directory; the builders live in tiny_models.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch


def interpret_triton_kernels() -> None:
    """Run the CUDA path's Triton kernels on CPU tensors under Triton's interpreter.

    It reads TRITON_INTERPRET when a kernel is defined, so this runs before astrai is
    imported. Its scalars are 1-element arrays that Triton 3.6 turns into loop bounds with
    int(), which NumPy 2.4 refuses for arrays of one dimension: the bound is read with .item().
    """
    os.environ.setdefault("TRITON_INTERPRET", "1")
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    patch_tensor = getattr(interpreter, "_patch_lang_tensor", None)
    if patch_tensor is None:  # another Triton: leave its interpreter as it is
        return

    def patch_with_scalar_index(tensor, scope) -> None:
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    interpreter._patch_lang_tensor = patch_with_scalar_index


if not torch.cuda.is_available():
    interpret_triton_kernels()

from tiny_models import (  # noqa: E402
    write_gemma3_vlm_model,
    write_hf_model,
    write_idefics3_model,
    write_llava_model,
    write_llava_next_model,
    write_qwen2_vl_model,
    write_tokenizer,
)


@pytest.fixture(autouse=True)
def private_tuning_cache(monkeypatch, tmp_path):
    """Kernel timings are kept in a cache of the test's own, never the user's, so that a faked
    timing stays in its test. (Each engine owns its KernelPlan: there is nothing to reset.)"""
    monkeypatch.setenv("ASTRAI_CACHE_DIR", str(tmp_path / "astrai-cache"))


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    return write_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def llava_dir(tmp_path_factory) -> Path:
    return write_llava_model(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="session")
def llava_next_dir(tmp_path_factory) -> Path:
    """A tiny LLaVA-NeXT whose language model is Mistral."""
    return write_llava_next_model(tmp_path_factory.mktemp("llava_next"), "mistral")


@pytest.fixture(scope="session")
def llava_next_qwen2_dir(tmp_path_factory) -> Path:
    """A tiny LLaVA-NeXT whose language model is Qwen2."""
    return write_llava_next_model(tmp_path_factory.mktemp("llava_next_qwen2"), "qwen2", seed=1)


@pytest.fixture(scope="session")
def smolvlm_dir(tmp_path_factory) -> Path:
    """A tiny SmolVLM whose images are split into tiles."""
    return write_idefics3_model(tmp_path_factory.mktemp("smolvlm"), "smolvlm")


@pytest.fixture(scope="session")
def idefics3_dir(tmp_path_factory) -> Path:
    """A tiny Idefics3 whose images are each one tile (do_image_splitting off)."""
    return write_idefics3_model(tmp_path_factory.mktemp("idefics3"), "idefics3", split=False)


@pytest.fixture(scope="session")
def qwen2_vl_dir(tmp_path_factory) -> Path:
    return write_qwen2_vl_model(tmp_path_factory.mktemp("qwen2_vl"), "qwen2_vl")


@pytest.fixture(scope="session")
def qwen2_5_vl_dir(tmp_path_factory) -> Path:
    """A tiny Qwen2.5-VL whose window blocks attend within 2x2-token windows."""
    return write_qwen2_vl_model(tmp_path_factory.mktemp("qwen2_5_vl"), "qwen2_5_vl")


@pytest.fixture(scope="session")
def gemma3_vlm_dir(tmp_path_factory) -> Path:
    return write_gemma3_vlm_model(tmp_path_factory.mktemp("gemma3_vlm"))
