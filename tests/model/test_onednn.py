"""oneDNN packing: the same logits as the dense model, and a packed model cannot be saved."""

from __future__ import annotations

import pytest
import torch
from tiny_models import write_hf_model

from astrai.inference import InferenceEngine
from astrai.model import AutoModel
from astrai.model.onednn import OneDnnLinear, can_pack, pack_linears
from astrai.tokenize import AutoTokenizer

pytestmark = pytest.mark.skipif(
    not torch.backends.mkldnn.is_available(), reason="PyTorch was built without oneDNN"
)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # tied head; untied head with qkv bias
def test_packed_model_gives_the_dense_logits(tmp_path, arch):
    overrides = {"tie_word_embeddings": arch == "llama"}
    model = AutoModel.from_pretrained(write_hf_model(tmp_path, arch, **overrides))
    ids = torch.randint(0, model.config.vocab_size, (3, 17))
    with torch.inference_mode():
        dense = model.forward_dense(ids)
        assert can_pack(model)
        pack_linears(model)
        packed = model.forward_dense(ids)
    assert isinstance(model.output, OneDnnLinear)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.modules())
    modules = list(model.modules())
    pack_linears(model)  # packing again changes nothing
    assert all(a is b for a, b in zip(modules, model.modules(), strict=True))
    torch.testing.assert_close(packed, dense, atol=1e-4, rtol=1e-4)
    assert torch.equal(packed.argmax(-1), dense.argmax(-1))


def test_engine_packs_a_float32_cpu_model(llama_dir):
    model = AutoModel.from_pretrained(llama_dir)
    with InferenceEngine(model, AutoTokenizer.from_pretrained(llama_dir)) as engine:
        assert isinstance(model.output, OneDnnLinear)
        assert engine.generate("hello", max_tokens=4, temperature=0.0)


def test_packed_model_refuses_to_save(llama_dir, tmp_path):
    model = AutoModel.from_pretrained(llama_dir)
    pack_linears(model)
    with pytest.raises(RuntimeError, match="save the model before"):
        model.save_pretrained(tmp_path)


def test_only_float32_models_are_packed(llama_dir):
    assert not can_pack(AutoModel.from_pretrained(llama_dir, dtype=torch.bfloat16))
