"""LoRA adapters (astrai/model/lora.py): greedy output per adapter equals transformers + PEFT's,
alone and mixed in one batch, from PEFT directories and GGUF files, on dense and quantized
bases; the prefix cache keeps adapters apart; bad adapters are refused by name."""

from __future__ import annotations

import json
import queue
import random

import numpy as np
import pytest
import torch
from kernel_switch import CountingKernels, kernel_or_fallback
from safetensors.torch import load_file, save_file
from tiny_models import (
    hf_greedy,
    llama_cpp_permute,
    make_engine,
    run_ids,
    write_gguf,
    write_hf_model,
    write_lora_adapter,
)

from astrai.inference import STOP, GenerationParams
from astrai.kernels import lora_ops, native
from astrai.kernels.quant_ops import QuantizedWeight
from astrai.model import AutoModel
from astrai.model.lora import LoraError, UnknownAdapterError, read_adapter
from astrai.tokenize import AutoTokenizer

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def peft_model(base_dir, adapter_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    return peft.PeftModel.from_pretrained(hf, adapter_dir).eval()


def prompts(n=4, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(4, 512) for _ in range(rng.randint(3, 40))] for _ in range(n)]


def greedy(engine, ids, lora=None, max_tokens=12):
    params = GenerationParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, lora=lora)
    return [r[0].token_ids for r in run_ids(engine, ids, [params] * len(ids))]


def reference(hf, ids, max_tokens=12):
    return [hf_greedy(hf, p, max_tokens, set()) for p in ids]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return write_hf_model(tmp_path_factory.mktemp("base"), "llama")


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory):
    """Three adapters of the base: all linears rank 4, attention rank 16 (rsLoRA), MLP rank 8."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "all": write_lora_adapter(base, root / "all", ATTENTION + MLP, 4, seed=1),
        "attention": write_lora_adapter(
            base, root / "attention", ATTENTION, 16, 2, use_rslora=True
        ),
        "mlp": write_lora_adapter(base, root / "mlp", MLP, 8, seed=3),
    }


@pytest.fixture(scope="module")
def model(base):
    return AutoModel.from_pretrained(base)


@pytest.fixture(scope="module")
def tokenizer(base):
    return AutoTokenizer.from_pretrained(base)


@pytest.mark.parametrize("name", ["all", "attention", "mlp"])
def test_each_adapter_equals_peft_and_the_merged_model(base, adapters, model, tokenizer, name):
    ids = prompts()
    peft_out = reference(peft_model(base, adapters[name]), ids)
    merged = peft_model(base, adapters[name]).merge_and_unload()
    assert reference(merged, ids) == peft_out
    with make_engine(model, tokenizer, loras={name: str(adapters[name])}) as engine:
        assert greedy(engine, ids, name) == peft_out
        base_out = greedy(engine, ids)
    assert base_out == reference(transformers.AutoModelForCausalLM.from_pretrained(base), ids)
    assert base_out != peft_out


@pytest.mark.parametrize(
    ("arch", "targets"),
    [("qwen2", ATTENTION + MLP), ("phi3", ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))],
)
def test_other_families_equal_peft(arch, targets, tmp_path):
    """Qwen2's q/k/v carry biases; Phi-3's checkpoints fuse q/k/v and gate/up, so its adapters
    do too."""
    # Phi-3's config pads with token 32000 unless told otherwise: past the tiny vocabulary
    family_base = write_hf_model(tmp_path / arch, arch, pad_token_id=0)
    adapter = write_lora_adapter(family_base, tmp_path / "adapter", targets, 8, seed=7)
    ids = prompts()
    expected = reference(peft_model(family_base, adapter), ids)
    model = AutoModel.from_pretrained(family_base)
    tokenizer = AutoTokenizer.from_pretrained(family_base)
    with make_engine(model, tokenizer, loras={"a": str(adapter)}) as engine:
        assert greedy(engine, ids, "a") == expected
        assert greedy(engine, ids) != expected


@pytest.fixture(params=["c-kernel", "pytorch"])
def products(request, monkeypatch):
    """Run a test on the LoRA kernel, then on the grouped PyTorch products (CUDA's); in the
    first case the test fails unless the kernel ran."""
    name = kernel_or_fallback(request, monkeypatch, "lora")
    calls: list[str] = []
    if name == "c-kernel":
        monkeypatch.setattr(native, "lora", CountingKernels(native.lora, calls))
    yield name
    assert ("add_products" in calls) == (name == "c-kernel")


def test_a_batch_mixing_adapters_and_the_base_equals_each_alone(
    adapters, model, tokenizer, products
):
    """Each row gets its own adapter's products, or none. Small pages and a small token budget
    put prompt chunks and decodes of every adapter in one step, and decode steps replay
    recorded calls, with each step's rows."""
    loras = {name: str(path) for name, path in adapters.items()}
    ids = prompts(8, seed=1)
    names = [None, "all", "attention", "mlp"] * 2
    config = dict(loras=loras, page_size=4, max_num_batched_tokens=24)
    with make_engine(model, tokenizer, **config) as engine:
        alone = [greedy(engine, [p], name)[0] for p, name in zip(ids, names, strict=True)]
    with make_engine(model, tokenizer, **config) as engine:
        params = [
            GenerationParams(max_tokens=12, temperature=0.0, ignore_eos=True, lora=name)
            for name in names
        ]
        mixed = [r[0].token_ids for r in run_ids(engine, ids, params)]
        recorded = engine.scheduler.executor.recorded.steps
    assert mixed == alone
    assert len(set(map(tuple, alone))) == len(alone)
    assert any(step is not None for step in recorded.values())  # replayed, not run eagerly


def test_the_adapters_run_on_the_kernel_path_timing_chose(adapters, model, tokenizer, monkeypatch):
    if native.lora is None or len(native.lora.paths()) < 2:
        pytest.skip("needs the LoRA kernel with more than one CPU path")
    slowest_named = native.lora.paths()[0]
    timing = lambda step, path, limit: 0.1 + (path != slowest_named)  # noqa: E731
    monkeypatch.setattr(lora_ops, "_seconds", timing)
    paths = []
    add_lora = lora_ops.add_lora
    monkeypatch.setattr(
        lora_ops, "add_lora", lambda *args: paths.append(args[-1]) or add_lora(*args)
    )
    loras = {name: str(path) for name, path in adapters.items()}
    with make_engine(model, tokenizer, loras=loras) as engine:
        greedy(engine, prompts(1, seed=2), "all")
    assert paths and set(paths) == {slowest_named}


def test_prefix_cache_keys_kv_by_adapter(adapters, model, tokenizer):
    """A prompt's pages cached under one adapter are never handed to another, nor to the base
    model; under the same adapter they are."""
    prompt = prompts(1, seed=2)[0] * 3  # 3 full pages at least
    with make_engine(model, tokenizer, loras={n: str(p) for n, p in adapters.items()}) as engine:
        first = run_ids(engine, [prompt], [GenerationParams(max_tokens=4, lora="all")])[0][0]
        cold = {}
        for name in (None, "attention", "all"):
            params = GenerationParams(max_tokens=8, temperature=0.0, lora=name)
            cold[name] = run_ids(engine, [prompt], [params])[0][0]
    assert first.cached_tokens == 0
    assert cold[None].cached_tokens == 0
    assert cold["attention"].cached_tokens == 0
    assert cold["all"].cached_tokens >= 16
    with make_engine(model, tokenizer, loras={n: str(p) for n, p in adapters.items()}) as engine:
        for name in (None, "attention", "all"):
            params = GenerationParams(max_tokens=8, temperature=0.0, lora=name)
            assert run_ids(engine, [prompt], [params])[0][0].token_ids == cold[name].token_ids


def write_gguf_adapter(adapter_dir, path, arch="llama", n_heads=4, n_kv_heads=2):
    """The PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it: lora_a and lora_b
    per linear, B's rows of q and k permuted as the base's are, alpha in the metadata."""
    import gguf

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    tensors = load_file(adapter_dir / "adapter_model.safetensors")
    writer = gguf.GGUFWriter(path, arch)
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    names = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output"}
    names |= {"gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
    for key, tensor in tensors.items():
        layer = key.split("layers.")[1].split(".")[0]
        module = key.split(".lora_")[0].rsplit(".", 1)[1]
        which = "a" if ".lora_A." in key else "b"
        array = tensor.float().numpy()
        if which == "b" and module in ("q_proj", "k_proj"):
            array = llama_cpp_permute(array, n_heads if module == "q_proj" else n_kv_heads)
        writer.add_tensor(f"blk.{layer}.{names[module]}.weight.lora_{which}", array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_adapter_equals_its_peft_twin(base, adapters, model, tokenizer, tmp_path):
    path = write_gguf_adapter(adapters["all"], tmp_path / "all.gguf")
    ids = prompts()
    with make_engine(
        model, tokenizer, loras={"peft": str(adapters["all"]), "gguf": str(path)}
    ) as e:
        assert greedy(e, ids, "gguf") == greedy(e, ids, "peft")


def test_a_gguf_adapter_whose_tensor_lies_outside_the_file_is_refused(adapters, model, tmp_path):
    import gguf

    path = write_gguf_adapter(adapters["all"], tmp_path / "all.gguf")
    reader = gguf.GGUFReader(path)
    last = max(reader.tensors, key=lambda t: t.data_offset)
    offset_at = last.field.offset + sum(part.nbytes for part in last.field.parts[:5])
    data = bytearray(path.read_bytes())
    data[offset_at : offset_at + 8] = (2**64 - 64).to_bytes(8, "little")  # wraps past the end
    path.write_bytes(bytes(data))
    with pytest.raises(LoraError, match=f"malformed GGUF file {path}: tensor '{last.name}'"):
        read_adapter("lying", path, model)


QUANTIZED_LINEARS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1"])
def test_quantized_base_with_an_adapter_follows_the_dequantized_base(
    base, adapters, tokenizer, tmp_path, qtype
):
    """QLoRA's deployment: a Q8_0 or 4-bit (Q4_1, as the real SmolLM2 file) GGUF base plus a
    PEFT adapter. Measure: the adapter's greedy tokens on the quantized kernel (int8x2
    activations) equal those on the same file dequantized to fp32, 12 tokens of each prompt.
    (The gguf package cannot write Q4_K blocks, which the K-quant kernel tests cover.)"""
    import gguf

    block_type = gguf.GGMLQuantizationType[qtype]
    path = write_gguf(
        tmp_path / f"{qtype}.gguf",
        base,
        "llama",
        types={f"{name}.weight": block_type for name in (*QUANTIZED_LINEARS, "ffn_down")},
    )
    quantized = AutoModel.from_pretrained(path)
    dequantized = AutoModel.from_pretrained(path, dequantize=True)
    wo, dense_wo = quantized.layers[0].attention.wo, dequantized.layers[0].attention.wo
    assert isinstance(wo.weight, QuantizedWeight) and isinstance(dense_wo.weight, torch.Tensor)
    ids = prompts()
    loras = {"all": str(adapters["all"])}
    with make_engine(dequantized, tokenizer, loras=loras) as engine:
        expected = greedy(engine, ids, "all")
    with make_engine(quantized, tokenizer, loras=loras) as engine:
        assert greedy(engine, ids, "all") == expected
        assert greedy(engine, ids) != expected


def test_adapters_load_and_unload_while_requests_run(adapters, model, tokenizer):
    """Unloading an adapter lets its running requests finish under it; its slot is reused
    once they have ended, and the new adapter's requests get the new weights."""
    ids = prompts(4, seed=4)
    loras = {"all": str(adapters["all"])}
    with make_engine(model, tokenizer, loras=loras, max_lora_rank=8) as engine:
        expected = greedy(engine, ids, "all", max_tokens=200)
        params = GenerationParams(max_tokens=200, temperature=0.0, ignore_eos=True, lora="all")
        events = queue.SimpleQueue()
        groups = [engine.submit(p, params, lambda task, event: events.put(event)) for p in ids]
        engine.unload_adapter("all")
        with pytest.raises(UnknownAdapterError, match="no adapter named 'all'"):
            greedy(engine, ids[:1], "all")
        with pytest.raises(LoraError, match="all 1 adapter slots are taken"):
            engine.load_adapter("mlp", str(adapters["mlp"]))  # "all" still runs in the slot
        remaining = len(groups)
        while remaining:
            remaining -= events.get(timeout=120) is STOP
        assert [group[0].output_ids for group in groups] == expected
        engine.load_adapter("mlp", str(adapters["mlp"]))
        assert engine.adapter_names() == ["mlp"]
        mlp = greedy(engine, ids, "mlp")
    with make_engine(model, tokenizer, loras={"mlp": str(adapters["mlp"])}) as engine:
        assert greedy(engine, ids, "mlp") == mlp


def test_bad_adapters_are_refused_by_name(base, adapters, model, tokenizer, tmp_path):
    loras = {"attention": str(adapters["attention"])}
    with pytest.raises(LoraError, match="rank 16, above the largest this server holds, 8"):
        make_engine(model, tokenizer, loras=loras, max_lora_rank=8)
    other = write_hf_model(tmp_path / "wide", "llama", hidden_size=96, intermediate_size=128)
    wide = write_lora_adapter(other, tmp_path / "wide-adapter", ("q_proj",), 4, seed=5)
    with pytest.raises(LoraError, match=r"layers.0.self_attn.q_proj: lora_A has shape \[4, 96\]"):
        make_engine(model, tokenizer, loras={"wide": str(wide)})
    saved = tmp_path / "saved"
    saved.mkdir()
    config = json.loads((adapters["all"] / "adapter_config.json").read_text())
    (saved / "adapter_config.json").write_text(
        json.dumps(config | {"modules_to_save": ["lm_head"]})
    )
    tensors = load_file(adapters["all"] / "adapter_model.safetensors")
    save_file(tensors, saved / "adapter_model.safetensors")
    with pytest.raises(LoraError, match="modules_to_save is"):
        make_engine(model, tokenizer, loras={"saved": str(saved)})
    poisoned = tmp_path / "nan"
    poisoned.mkdir()
    (poisoned / "adapter_config.json").write_text(json.dumps(config))
    key = next(iter(tensors))
    save_file(
        tensors | {key: torch.full_like(tensors[key], np.nan)},
        poisoned / "adapter_model.safetensors",
    )
    with pytest.raises(LoraError, match="NaN or infinite"):
        make_engine(model, tokenizer, loras={"nan": str(poisoned)})
    with make_engine(model, tokenizer, loras={"all": str(adapters["all"])}) as engine:
        with pytest.raises(
            UnknownAdapterError, match=r"no adapter named 'x' is loaded; loaded: \['all'\]"
        ):
            greedy(engine, [[5, 6]], "x")
        assert greedy(engine, [[5, 6]], "all")  # the engine goes on
