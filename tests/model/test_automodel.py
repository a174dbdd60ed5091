"""Loading checkpoints: HF and native, sharded, dtypes, and every way a checkpoint can be wrong."""

from __future__ import annotations

import io
import json
import logging
import shutil
import sys
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType
from safetensors.torch import load_file, save_file
from tiny_models import write_gguf, write_hf_model

from astrai.config import ConfigError
from astrai.distributed import TensorShard
from astrai.kernels import TiedTable
from astrai.model import AutoModel, CheckpointError, Transformer


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("qwen2"), "qwen2", seed=2)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory) -> Path:
    return write_hf_model(tmp_path_factory.mktemp("tied"), "llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def model(hf_dir) -> Transformer:
    return AutoModel.from_pretrained(hf_dir)


def copy_with_weights(source: Path, target: Path, edit) -> Path:
    """Copy a single-file HF checkpoint, passing its tensors dict through edit() first."""
    shutil.copytree(source, target)
    tensors = load_file(target / "model.safetensors")
    edit(tensors)
    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    return target


def assert_same_weights(a: Transformer, b: Transformer) -> None:
    state_a, state_b = a.state_dict(), b.state_dict()
    assert state_a.keys() == state_b.keys()
    for name in state_a:
        assert state_a[name].dtype == state_b[name].dtype, name
        assert torch.equal(state_a[name], state_b[name]), name


def test_sharded_checkpoint_loads_like_a_single_file(hf_dir, model, tmp_path):
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    reference.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 2
    assert_same_weights(AutoModel.from_pretrained(tmp_path), model)


def test_missing_tensor_is_named(hf_dir, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    broken = copy_with_weights(hf_dir, tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"missing tensors: \['{name}'\]"):
        AutoModel.from_pretrained(broken)


def test_misshaped_tensor_is_named_with_both_shapes(hf_dir, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"

    def shrink(tensors):
        tensors[name] = tensors[name][:-1].clone()

    broken = copy_with_weights(hf_dir, tmp_path / "m", shrink)
    with pytest.raises(
        CheckpointError, match=rf"{name} has shape \[127, 64\], expected \[128, 64\]"
    ):
        AutoModel.from_pretrained(broken)


def test_unexpected_tensor_is_named(hf_dir, tmp_path):
    name = "model.layers.0.self_attn.extra.weight"

    def add(tensors):
        tensors[name] = torch.zeros(2)

    broken = copy_with_weights(hf_dir, tmp_path / "m", add)
    with pytest.raises(CheckpointError, match=rf"unexpected tensors: \['{name}'\]"):
        AutoModel.from_pretrained(broken)


def test_stored_rope_frequencies_of_old_checkpoints_are_ignored(hf_dir, model, tmp_path):
    def add(tensors):
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    old = copy_with_weights(hf_dir, tmp_path / "m", add)
    assert_same_weights(AutoModel.from_pretrained(old), model)


def test_tied_checkpoint_loads_with_or_without_lm_head(tied_dir, tmp_path):
    with_head = copy_with_weights(
        tied_dir,
        tmp_path / "m",
        lambda t: t.setdefault("lm_head.weight", t["model.embed_tokens.weight"].clone()),
    )
    without_head = AutoModel.from_pretrained(tied_dir)
    assert "lm_head.weight" not in load_file(tied_dir / "model.safetensors")
    assert isinstance(without_head.output.weight, TiedTable)
    assert_same_weights(AutoModel.from_pretrained(with_head), without_head)


@pytest.mark.parametrize("fixture", ["hf_dir", "tied_dir"])
def test_native_save_and_load_round_trip_bit_identically(fixture, request, tmp_path):
    original = AutoModel.from_pretrained(request.getfixturevalue(fixture))
    original.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "astrai"
    names = set(load_file(tmp_path / "model.safetensors"))
    assert "layers.0.attention.wqkv.weight" in names
    assert ("output.weight" in names) == (not original.config.tie_weight)
    loaded = AutoModel.from_pretrained(tmp_path)
    assert loaded.config == original.config
    assert_same_weights(loaded, original)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert torch.equal(loaded.forward_dense(ids), original.forward_dense(ids))


def test_native_checkpoint_errors_name_native_tensors(model, tmp_path):
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["layers.1.ffn_norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing tensors: \['layers.1.ffn_norm.weight'\]"):
        AutoModel.from_pretrained(tmp_path)


@pytest.mark.parametrize("dtype", ["bf16", "bfloat16", torch.bfloat16])
def test_bf16_load(hf_dir, model, dtype):
    low = AutoModel.from_pretrained(hf_dir, dtype=dtype)
    assert {p.dtype for p in low.parameters()} == {torch.bfloat16}
    assert low.rope.inv_freq.dtype == torch.float32
    assert torch.equal(low.rope.inv_freq, model.rope.inv_freq)
    ids = torch.tensor([[1, 20, 300, 40, 5]])
    with torch.no_grad():
        logits, exact = low.forward_dense(ids), model.forward_dense(ids)
    assert logits.dtype == torch.float32
    assert (logits - exact).abs().max().item() < 0.1 * exact.abs().max().item()


def test_bf16_logits_match_transformers_in_bf16(hf_dir):
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16)
    ids = torch.tensor([[1, 20, 300, 40, 5, 77, 8]])
    with torch.no_grad():
        logits = AutoModel.from_pretrained(hf_dir, dtype="bf16").forward_dense(ids)
        expected = reference.eval()(input_ids=ids).logits.float()
    assert (logits - expected).abs().max().item() < 5e-2


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("fp16", torch.float16), ("float16", torch.float16), ("fp32", torch.float32)],
)
def test_dtype_names(hf_dir, name, dtype):
    assert AutoModel.from_pretrained(hf_dir, dtype=name).norm.weight.dtype == dtype


@pytest.mark.parametrize("dtype", ["int8", torch.int64])
def test_unsupported_dtype_is_refused(hf_dir, dtype):
    with pytest.raises(ConfigError, match="bf16"):
        AutoModel.from_pretrained(hf_dir, dtype=dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize(
    ("device", "message"),
    [("cuda", "CPU-only build.*use --device cpu"), ("cuda:1", "CPU-only"), ("mps", "cpu and cuda")],
)
def test_a_device_the_machine_lacks_is_refused_before_loading(hf_dir, device, message):
    with pytest.raises(ConfigError, match=message):
        AutoModel.from_pretrained(hf_dir, device=device)


def test_load_builds_on_meta_without_a_random_init(hf_dir, monkeypatch):
    initialized_on = set()
    for init_name in ("normal_", "uniform_", "kaiming_uniform_"):
        real = getattr(torch.nn.init, init_name)

        def record(tensor, *args, real=real, **kwargs):
            initialized_on.add(tensor.device.type)
            return real(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.nn.init, init_name, record)
    loaded = AutoModel.from_pretrained(hf_dir)
    assert initialized_on <= {"meta"}
    assert all(p.device.type == "cpu" for p in loaded.parameters())


@pytest.fixture(scope="module")
def tied_gguf(tied_dir, tmp_path_factory) -> Path:
    """The tied Llama as GGUF: a Q8_0 table (looked up and streamed by the head), Q8_0 q and
    k beside a Q4_1 v (a wqkv of two block types), an F32 MLP."""
    Q = GGMLQuantizationType
    types = {"token_embd.weight": Q.Q8_0, "attn_v.weight": Q.Q4_1}
    types |= {f"{name}.weight": Q.Q8_0 for name in ("attn_q", "attn_k", "attn_output")}
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tied.gguf", tied_dir, "llama", types=types)


@pytest.fixture(scope="module")
def olmo2_dir(tmp_path_factory) -> Path:
    """OLMo 2: q and k normed across all heads (across the ranks, when sharded)."""
    return write_hf_model(tmp_path_factory.mktemp("olmo2"), "olmo2")


@pytest.mark.parametrize(
    "checkpoint, options",
    [
        ("tied_gguf", {}),
        ("tied_gguf", {"shard": TensorShard(1, 2)}),
        ("tied_dir", {"quantization": "q8_0"}),
        ("tied_dir", {"quantization": "q8_0", "shard": TensorShard(0, 2)}),
        ("olmo2_dir", {"shard": TensorShard(1, 2)}),
    ],
)
def test_loading_fills_the_modules_the_model_was_built_with(
    checkpoint, options, request, monkeypatch
):
    """The loaders put blocks and tensors into the layers the Transformer built (on the meta
    device): every module after loading is the one built there, under the same name. A
    tensor-parallel rank's model is built with its vocabulary-parallel embedding and head and
    its norms across the ranks; it loads with no process group."""
    built: dict[int, list[tuple[str, torch.nn.Module]]] = {}
    init = Transformer.__init__

    def recording_init(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        built[id(self)] = list(self.named_modules())

    monkeypatch.setattr(Transformer, "__init__", recording_init)
    model = AutoModel.from_pretrained(request.getfixturevalue(checkpoint), **options)
    after = [(name, id(module)) for name, module in model.named_modules()]
    before = [(name, id(module)) for name, module in built[id(model)]]
    changed = sorted({name for name, _ in set(after) ^ set(before)})
    assert not changed, f"modules put in or taken out after construction: {changed}"


def test_pickled_weights_are_refused_not_unpickled(hf_dir, tmp_path):
    shutil.copy(hf_dir / "config.json", tmp_path / "config.json")
    (tmp_path / "pytorch_model.bin").write_bytes(b"not a pickle; must never be opened")
    with pytest.raises(CheckpointError, match="safetensors"):
        AutoModel.from_pretrained(tmp_path)


def test_directory_without_weights(hf_dir, tmp_path):
    shutil.copy(hf_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="no weights"):
        AutoModel.from_pretrained(tmp_path)


def test_index_naming_an_absent_shard(hf_dir, tmp_path):
    shutil.copy(hf_dir / "config.json", tmp_path / "config.json")
    index = {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00001-of-00002.safetensors"):
        AutoModel.from_pretrained(tmp_path)


def test_missing_directory_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        AutoModel.from_pretrained(tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="no config.json"):
        AutoModel.from_pretrained(tmp_path)


def test_loading_shows_a_progress_bar_on_a_terminal_and_a_log_line(hf_dir, monkeypatch, caplog):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    with caplog.at_level(logging.INFO, logger="astrai.model"):
        AutoModel.from_pretrained(hf_dir)
    assert f"loading 17 tensors from {hf_dir}" in caplog.text
    assert f"loading {hf_dir.name}:   0%|          | 0/17" in terminal.getvalue()
    monkeypatch.setattr(sys, "stderr", io.StringIO())  # not a terminal: the log line only
    AutoModel.from_pretrained(hf_dir)
    assert sys.stderr.getvalue() == ""
