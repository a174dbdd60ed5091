"""oneDNN packing: the same logits as the dense model, and a packed model cannot be saved."""

from __future__ import annotations

import pytest
import torch
from tiny_models import write_hf_model

from astrai.model import AutoModel
from astrai.model.onednn import OneDnnLinear, can_pack, pack_linears

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
    torch.testing.assert_close(packed, dense, atol=1e-4, rtol=1e-4)
    assert torch.equal(packed.argmax(-1), dense.argmax(-1))


def test_packed_model_refuses_to_save(llama_dir, tmp_path):
    model = AutoModel.from_pretrained(llama_dir)
    pack_linears(model)
    with pytest.raises(RuntimeError, match="save the model before"):
        model.save_pretrained(tmp_path)


def test_only_float32_models_are_packed(llama_dir):
    assert not can_pack(AutoModel.from_pretrained(llama_dir, dtype=torch.bfloat16))
