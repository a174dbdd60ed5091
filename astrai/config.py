"""Configuration: the model's shape (ModelConfig) and the engine's limits (EngineConfig)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A configuration value is missing, unsupported or out of range."""


# The model_type of astrai's own config.json (a ModelConfig's fields as they are).
NATIVE_MODEL_TYPE = "astrai"
LAYER_TYPES = ("full_attention", "sliding_attention")
HIDDEN_ACTS = ("silu", "gelu_tanh")
ROPE_SCALING_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    # One divisor per rotary frequency, as a GGUF file's rope_freqs tensor gives them (llama.cpp
    # writes Llama 3.1's scaling that way, without the llama3 parameters it came from).
    "frequency_factors": ("factors",),
    # YaRN: low frequencies divided by factor, high ones kept, a ramp between them (beta_fast and
    # beta_slow rotations over the original context); cos and sin scaled by attention_factor.
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "truncate",
    ),
    # Dynamic NTK: past the original context the base grows with the position (see
    # astrai.model.rope for which position a token's rotation follows).
    "dynamic": ("factor", "original_max_position_embeddings"),
    # LongRoPE (Phi-3): a divisor per frequency, short_factor's within the original context and
    # long_factor's past it; cos and sin scaled by attention_factor.
    "longrope": (
        "short_factor",
        "long_factor",
        "original_max_position_embeddings",
        "attention_factor",
    ),
}


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward layers (Mixtral, Qwen2-MoE, Qwen3-MoE).

    Each token goes to the n_experts_per_token experts (SwiGLU MLPs of dim_expert) with the
    highest router probability, their outputs weighted by those probabilities, renormalised to
    sum to 1 if norm_topk_prob. dim_shared_expert is Qwen2-MoE's expert that every token also
    runs, its output scaled by a sigmoid gate. As transformers places them, layer i is sparse
    if (i + 1) % sparse_step == 0 and i is not in dense_layers; a dense layer runs the plain MLP
    of ModelConfig.dim_ffn.
    """

    n_experts: int
    n_experts_per_token: int
    dim_expert: int
    norm_topk_prob: bool = True
    dim_shared_expert: int | None = None
    sparse_step: int = 1
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        sizes = ("n_experts", "n_experts_per_token", "dim_expert", "sparse_step")
        for name in (*sizes, "dim_shared_expert"):
            value = getattr(self, name)
            if (value is not None or name in sizes) and not _positive_int(value):
                raise ConfigError(f"moe.{name} must be a positive integer, got {value!r}")
        if self.n_experts_per_token > self.n_experts:
            raise ConfigError(
                f"moe.n_experts_per_token ({self.n_experts_per_token}) cannot exceed "
                f"moe.n_experts ({self.n_experts})"
            )
        # A tuple, so the frozen config stays hashable and the caller's list cannot change it.
        object.__setattr__(self, "dense_layers", tuple(self.dense_layers))

    def is_sparse(self, layer_idx: int) -> bool:
        """Whether layer layer_idx runs the experts rather than the dense MLP."""
        return layer_idx not in self.dense_layers and (layer_idx + 1) % self.sparse_step == 0


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder: everything the model needs to build itself.

    head_dim is explicit because Qwen3 and others do not use dim // n_heads. rope_scaling is
    None or a dict with "rope_type" (a key of ROPE_SCALING_KEYS) and that type's parameters,
    spelled as Hugging Face spells them; rope turns the first rotary_dim of each head's dims
    (None: all of them). attention_bias means a bias on the q/k/v projections only (Qwen2);
    use_qk_norm is Qwen3's per-head RMSNorm on q and k.

    The fields after attention_bias are what Gemma 2/3 and sliding-window models change, each
    off by default: hidden_act is the MLP gate's activation ("silu": SwiGLU; "gelu_tanh":
    GeGLU); scale_embeddings multiplies the embeddings by sqrt(dim) in the model dtype;
    post_norms adds a norm on each sublayer's output before its residual add; attention_scale
    replaces 1/sqrt(head_dim); the soft-caps c turn x into c * tanh(x / c) on the attention
    logits and on the final logits. A layer with a sliding window attends to the
    sliding_window keys up to its own position: every layer when layer_types is None, else
    those whose layer_types entry is "sliding_attention". rope_local_theta is the rope base of
    the sliding layers where it differs from the others' (Gemma 3).

    mrope_section (Qwen2-VL's M-RoPE) splits the rotary frequencies into three runs that turn
    by a token's temporal, height and width positions; a token of text has all three equal,
    so it rotates as with plain rope.

    moe describes the experts of a mixture-of-experts model (MoEConfig); None for a dense one.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    dim_ffn: int
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    rotary_dim: int | None = None
    max_len: int = 2048
    tie_weight: bool = False
    # OLMo 2: no norm before each sublayer (post_norms after it instead), and one q norm and
    # one k norm over the whole projection (use_qk_norm's are per head).
    pre_norms: bool = True
    qk_norm_across_heads: bool = False
    # Granite: embeddings times embedding_multiplier, each sublayer's output times
    # residual_multiplier before its residual add, logits divided by logits_scaling.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    use_qk_norm: bool = False
    attention_bias: bool = False
    hidden_act: str = "silu"
    scale_embeddings: bool = False
    post_norms: bool = False
    attention_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    sliding_window: int | None = None
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None
    mrope_section: tuple[int, ...] | None = None
    moe: MoEConfig | None = None

    def __post_init__(self) -> None:
        sizes = ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "dim_ffn")
        for name in (*sizes, "max_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads != 0:
            raise ConfigError(
                f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads}) "
                "for grouped-query attention"
            )
        if self.head_dim % 2 != 0:
            raise ConfigError(f"head_dim must be even for rotary embedding, got {self.head_dim}")
        if not (self.norm_eps > 0 and self.rope_theta > 0):
            raise ConfigError(
                f"norm_eps and rope_theta must be positive, got {self.norm_eps!r} "
                f"and {self.rope_theta!r}"
            )
        rotary_dim = self.rotary_dim or self.head_dim
        if not (_positive_int(rotary_dim) and rotary_dim % 2 == 0 and rotary_dim <= self.head_dim):
            raise ConfigError(
                f"rotary_dim must be an even number of dims up to head_dim ({self.head_dim}), "
                f"got {self.rotary_dim!r}"
            )
        if self.use_qk_norm and self.qk_norm_across_heads:
            raise ConfigError("use_qk_norm (per head) and qk_norm_across_heads exclude each other")
        for name in ("embedding_multiplier", "residual_multiplier", "logits_scaling"):
            if not (isinstance(getattr(self, name), (int, float)) and getattr(self, name) > 0):
                raise ConfigError(f"{name} must be a positive number, got {getattr(self, name)!r}")
        if self.rope_scaling is not None:
            _check_rope_scaling(self.rope_scaling, rotary_dim)
            rope_type = self.rope_scaling["rope_type"]
            if self.rope_local_theta is not None and rope_type in ("yarn", "dynamic", "longrope"):
                raise ConfigError(
                    f"{rope_type} rope scaling beside rope_local_theta (a second rope for the "
                    "sliding layers) is not supported; use linear, llama3 or frequency_factors"
                )
            # A private copy: the caller's dict must not be able to change a frozen config.
            object.__setattr__(self, "rope_scaling", dict(self.rope_scaling))
        self._check_gemma_and_window_fields()
        if isinstance(self.moe, dict):  # as a native config.json holds it
            try:
                object.__setattr__(self, "moe", MoEConfig(**self.moe))
            except TypeError as error:
                raise ConfigError(f"invalid moe settings {self.moe}: {error}") from None

    def _check_gemma_and_window_fields(self) -> None:
        if self.hidden_act not in HIDDEN_ACTS:
            raise ConfigError(f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        for name in ("attention_scale", "attn_logit_softcap", "final_logit_softcap"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ConfigError(f"{name} must be a positive number or null, got {value!r}")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or window <= 0):
            raise ConfigError(f"sliding_window must be a positive integer or null, got {window!r}")
        if self.layer_types is not None:
            # A tuple, so the frozen config stays hashable and the caller's list cannot change it.
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
            unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if unknown or len(self.layer_types) != self.n_layers:
                raise ConfigError(
                    f"layer_types must name one of {LAYER_TYPES} for each of the {self.n_layers} "
                    f"layers, got {list(self.layer_types)}"
                )
        if self.rope_local_theta is not None and not self.rope_local_theta > 0:
            raise ConfigError(f"rope_local_theta must be positive, got {self.rope_local_theta!r}")
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", tuple(self.mrope_section))
            n_frequencies = (self.rotary_dim or self.head_dim) // 2
            if len(self.mrope_section) != 3 or sum(self.mrope_section) != n_frequencies:
                raise ConfigError(
                    f"mrope_section must be three runs of rotary frequencies that add up to "
                    f"{n_frequencies} (half the rotary dims), got {list(self.mrope_section)}"
                )
            if self.rope_scaling is not None or self.rope_local_theta is not None:
                raise ConfigError("M-RoPE (mrope_section) beside rope scaling is not supported")

    def layer_window(self, layer_idx: int) -> int | None:
        """How many keys, up to its own position, a query of this layer sees (None: all)."""
        if self.layer_types is not None and self.layer_types[layer_idx] != "sliding_attention":
            return None
        return self.sliding_window

    def uses_local_rope(self, layer_idx: int) -> bool:
        """Whether the layer rotates by rope_local_theta's frequencies, not rope_theta's: a
        sliding layer's, even where its window covers the whole context."""
        sliding = self.layer_types is None or self.layer_types[layer_idx] == "sliding_attention"
        return self.rope_local_theta is not None and sliding

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """The config of astrai's native config.json content (to_dict's), its model_type
        optional."""
        known = {field.name for field in fields(cls)}
        settings = {key: value for key, value in raw.items() if key != "model_type"}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(
                f"unknown fields in native astrai config: {unknown}; known fields are "
                f"{sorted(known)}"
            )
        missing = sorted(
            field.name
            for field in fields(cls)
            if field.name not in settings and field.default is MISSING
        )
        if missing:
            raise ConfigError(f"native astrai config lacks required fields: {missing}")
        return cls(**settings)

    def to_dict(self) -> dict[str, Any]:
        """The native config.json content (model_type "astrai" plus every field)."""
        return {"model_type": NATIVE_MODEL_TYPE, **asdict(self)}

    def save(self, directory: str | Path) -> None:
        """Write the native config.json into directory (created if needed)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _check_rope_scaling(rope_scaling: dict, rotary_dim: int) -> None:
    rope_type = rope_scaling.get("rope_type")
    if rope_type not in ROPE_SCALING_KEYS:
        raise ConfigError(
            f"unsupported rope_scaling type {rope_type!r}; astrai supports "
            f"{sorted(ROPE_SCALING_KEYS)} (or no scaling)"
        )
    missing = [key for key in ROPE_SCALING_KEYS[rope_type] if key not in rope_scaling]
    if missing:
        raise ConfigError(f"rope_scaling of type {rope_type!r} lacks {missing}")
    unknown = sorted(set(rope_scaling) - {"rope_type", *ROPE_SCALING_KEYS[rope_type]})
    if unknown:
        raise ConfigError(
            f"rope_scaling of type {rope_type!r} has unknown keys {unknown}; it takes "
            f"{list(ROPE_SCALING_KEYS[rope_type])} (rope_theta is a field of its own)"
        )
    # One divisor per rotary frequency, or one for them all.
    per_frequency = [k for k in ("factors", "short_factor", "long_factor") if k in rope_scaling]
    for key in per_frequency or ["factor"]:
        factors = rope_scaling[key] if per_frequency else [rope_scaling[key]]
        if not all(isinstance(f, (int, float)) and f > 0 for f in factors):
            raise ConfigError(f"rope_scaling {key} must be positive numbers, got {factors!r}")
        if per_frequency and len(factors) != rotary_dim // 2:
            raise ConfigError(
                f"rope_scaling has {len(factors)} {key}; a rotary dimension of {rotary_dim} has "
                f"{rotary_dim // 2} frequencies"
            )


def setting(default: Any, help: str, **cli: Any) -> Any:
    """A dataclass field with its command-line help (and metavar, choices, "flag" where the flag
    is spelled otherwise than the field, "parse" where its text needs a parser) in metadata."""
    return field(default=default, metadata={"help": help, **cli})


def parse_kv_cache_memory(text: str) -> float:
    """Read kv_cache_memory from text such as "8000000" or "0.25"; the range is checked later."""
    try:
        return float(text)
    except ValueError:
        raise ConfigError(
            f"expected a byte count (> 1) or a fraction of free memory in (0, 1], got {text!r}"
        ) from None


SPECULATIVE_METHODS = ("ngram", "draft")
KV_CACHE_DTYPES = ("auto", "fp32", "bf16", "fp16")
# how quantized linears' kernel rounds x on the CPU (astrai.kernels.quant_ops); the first is
# the default
ACTIVATION_PRECISIONS = ("int8x2", "int8")
MAX_SPECULATIVE_TOKENS = 16
# What an engine serves: text (and embeddings besides), or embeddings only.
ENGINE_TASKS = ("generate", "embed")
POOLINGS = ("last", "mean")


@dataclass(frozen=True)
class EngineConfig:
    """Limits and switches of one InferenceEngine.

    The KV page pool holds max_total_tokens (default: max_batch_size x max_seq_len, what a
    full batch can use), capped by kv_cache_memory: a byte count (> 1) or a fraction of the
    device's free memory (0 < x <= 1).
    Each field's metadata holds its command-line help (and "flag" where the flag is spelled
    otherwise than the field, "parse" where its text needs a parser), so the CLI derives its
    flags from these fields.
    """

    max_batch_size: int = setting(32, "most requests generated at once")
    kv_cache_memory: float = setting(
        0.25,
        "KV cache budget: bytes if above 1, else a fraction of free device memory",
        metavar="BYTES_OR_FRACTION",
        parse=parse_kv_cache_memory,
    )
    kv_cache_dtype: str = setting(
        "auto",
        "dtype the KV cache stores (auto: the model's); bf16 or fp16 under an fp32 model holds "
        "twice the tokens in the same memory and halves the bytes decode attention reads",
        choices=KV_CACHE_DTYPES,
    )
    page_size: int = setting(16, "tokens per KV cache page")
    max_num_batched_tokens: int = setting(
        2048, "token budget of one forward pass; longer prompts are prefilled in chunks"
    )
    max_seq_len: int | None = setting(
        None,
        "longest prompt plus output in tokens (default: the model's context length); "
        "--max-model-len (vLLM's spelling), -c and --ctx-size (llama.cpp's) are aliases",
        aliases=("--max-model-len", "-c", "--ctx-size"),
    )
    max_total_tokens: int | None = setting(
        None,
        "most tokens the KV pool holds, all requests together, capped by --kv-cache-memory "
        "(default: --max-batch-size x --max-seq-len, a full batch at full length; astrai "
        "generate: its prompt and --max-tokens; astrai chat: one conversation)",
    )
    enable_prefix_cache: bool = setting(
        True, "reuse the KV cache of shared prompt prefixes", flag="--prefix-cache"
    )
    max_waiting: int = setting(1024, "most requests queued before new ones are refused")
    max_images_per_request: int = setting(
        8, "most images one request's prompt may hold (vision-language models)"
    )
    max_image_pixels: int = setting(
        4096 * 4096, "most pixels (width x height) an image of a request may declare"
    )
    max_image_bytes: int = setting(20 << 20, "most bytes an image of a request may take")
    check_invariants: bool = setting(
        False, "raise, not only log, when the KV page accounting check at idle finds an error"
    )
    speculative: str | None = setting(
        None,
        "speculative decoding: guess tokens and check them in one forward pass; ngram guesses "
        "from the prompt and output so far, draft with --draft-model",
        choices=SPECULATIVE_METHODS,
    )
    num_speculative_tokens: int = setting(4, "most tokens guessed per step when speculating")
    draft_model: str | None = setting(
        None,
        "the model that guesses for --speculative draft (implied): a smaller model with the "
        "same tokenizer (directory, .gguf file or Hugging Face id)",
        metavar="DIR|FILE|ID",
    )
    batch_invariant: bool = setting(
        True,
        "on the CPU, quantized linears run their int8 kernel at every batch size, whose result "
        "for a row does not depend on the other rows, so a request's greedy output does not "
        "depend on what shares its batch; --no-batch-invariant lets a product of more rows take "
        "a GEMM path where the start's timing finds one faster (a bf16 GEMM on an AMX CPU), "
        "whose roundings differ from the kernel's. Each engine keeps its own setting (its "
        "KernelPlan), a draft model its target's",
    )
    activation_precision: str = setting(
        ACTIVATION_PRECISIONS[0],
        "on the CPU, how the kernel of quantized linears rounds their input: int8x2 quantizes "
        "it in two int8 terms (the int8 blocks and what they leave at 1/256 of their scale), "
        "together 16-bit activations, so greedy output follows the dequantized weights' as "
        "fp32 does; int8 is llama.cpp's one term, faster where the products are bound by "
        "arithmetic, and its roundings tip a small model's near-ties",
        choices=ACTIVATION_PRECISIONS,
    )
    cuda_graphs: bool | None = setting(
        None,
        "on CUDA, replay each decode step from a CUDA graph captured per batch size (one "
        "launch a step); --no-cuda-graphs launches its kernels one by one (default: graphs "
        "on CUDA, but for tensor parallelism, whose ranks run their steps eagerly)",
    )
    tensor_parallel_size: int = setting(
        1,
        "processes that each hold 1/N of every layer's weights and KV heads (tensor "
        "parallelism on torch.distributed: gloo on CPU, NCCL on CUDA)",
    )
    loras: tuple[str, ...] = setting(
        (),
        "a LoRA adapter to load: NAME=PATH, or PATH (named after its file or directory); PATH "
        "is a PEFT adapter directory or a llama.cpp GGUF LoRA file; repeatable; a request "
        "picks one by name (the API's model field); the Python API also takes a dict",
        flag="--lora",
        metavar="NAME=PATH",
    )
    max_loras: int | None = setting(
        None,
        "most LoRA adapters loaded at once, each in a slot of its own (default: the --lora "
        "count; give it to load adapters later through the API)",
    )
    max_lora_rank: int | None = setting(
        None, "largest LoRA rank a slot holds (default: the largest --lora rank, else 16)"
    )
    task: str = setting(
        "generate",
        "generate: text, and embeddings besides; embed: embeddings only (an embedding model "
        "such as Qwen3-Embedding): the LM head never runs and generation requests are refused",
        choices=ENGINE_TASKS,
    )
    pooling: str | None = setting(
        None,
        "how an embedding pools the final hidden states of its tokens: the last token's or "
        "their mean (default: the checkpoint's: a sentence-transformers pooling config or a GGUF "
        "file's pooling_type; else last)",
        choices=POOLINGS,
    )

    def __post_init__(self) -> None:
        if isinstance(self.loras, Mapping):
            object.__setattr__(
                self, "loras", tuple(f"{name}={path}" for name, path in self.loras.items())
            )
        names = [name for name, _ in self.adapters]
        if any(not name for name in names) or len(set(names)) != len(names):
            raise ConfigError(f"loras need distinct, non-empty names, got {list(self.loras)}")
        if self.max_loras is not None and self.max_loras < len(self.loras):
            raise ConfigError(
                f"max_loras is {self.max_loras}, fewer than the {len(self.loras)} loras given"
            )
        positive = {
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_batch_size": self.max_batch_size,
            "page_size": self.page_size,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_waiting": self.max_waiting,
            "max_images_per_request": self.max_images_per_request,
            "max_image_pixels": self.max_image_pixels,
            "max_image_bytes": self.max_image_bytes,
        }
        for name, value in positive.items():
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        for name in ("max_seq_len", "max_total_tokens", "max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(
                f"kv_cache_dtype must be one of {list(KV_CACHE_DTYPES)}, got "
                f"{self.kv_cache_dtype!r}"
            )
        if self.activation_precision not in ACTIVATION_PRECISIONS:
            raise ConfigError(
                f"activation_precision must be one of {list(ACTIVATION_PRECISIONS)}, got "
                f"{self.activation_precision!r}"
            )
        if self.task not in ENGINE_TASKS:
            raise ConfigError(f"task must be one of {list(ENGINE_TASKS)}, got {self.task!r}")
        if self.pooling not in (None, *POOLINGS):
            raise ConfigError(
                f"pooling must be one of {list(POOLINGS)} or None, got {self.pooling!r}"
            )
        if self.speculative not in (None, *SPECULATIVE_METHODS):
            raise ConfigError(
                f"speculative must be one of {list(SPECULATIVE_METHODS)} or None, got "
                f"{self.speculative!r}"
            )
        if self.draft_model is not None and self.speculative is None:
            object.__setattr__(self, "speculative", "draft")  # a draft model means guessing
        if (self.speculative == "draft") != (self.draft_model is not None):
            raise ConfigError(
                "speculative='draft' needs a draft_model (--draft-model PATH), and a draft "
                "model guesses only with speculative='draft'"
            )
        if not isinstance(self.num_speculative_tokens, int) or not (
            1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS
        ):
            raise ConfigError(
                f"num_speculative_tokens must be an integer in [1, {MAX_SPECULATIVE_TOKENS}], "
                f"got {self.num_speculative_tokens!r}"
            )
        if self.cuda_graphs and self.tensor_parallel_size > 1:
            raise ConfigError(
                f"cuda_graphs=True (--cuda-graphs) with tensor_parallel_size "
                f"{self.tensor_parallel_size}: the ranks would have to capture and replay each "
                "step's graph together, its all-reduces inside, which astrai does not do; leave "
                "the option out (the ranks then run their decode steps eagerly), or serve the "
                "model on one GPU to replay them"
            )
        if self.cuda_graphs and self.lora_slots:
            raise ConfigError(
                "cuda_graphs=True (--cuda-graphs) with LoRA adapters: a step's adapters change "
                "from step to step, which a captured graph cannot follow, so the decode steps "
                "run eagerly; leave the option out, or serve without --lora to replay them"
            )
        if self.lora_slots and self.tensor_parallel_size > 1:
            raise ConfigError("LoRA adapters under tensor parallelism are not supported yet")
        if not (self.kv_cache_memory > 0):
            raise ConfigError(
                "kv_cache_memory must be a byte count (> 1) or a fraction of free memory "
                f"in (0, 1], got {self.kv_cache_memory!r}"
            )

    @property
    def adapters(self) -> list[tuple[str, str]]:
        """(name, path) of each LoRA adapter in loras."""
        pairs = []
        for item in self.loras:
            name, _, path = item.rpartition("=")
            pairs.append((name or Path(path).stem, path))
        return pairs

    @property
    def lora_slots(self) -> int:
        """Adapters loaded at once; 0 runs the model without LoRA's per-step products."""
        return len(self.loras) if self.max_loras is None else self.max_loras


LOAD_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoadConfig:
    """What to load and how: the model's source, its dtype and device, and what becomes of its
    linears (a GGUF file's blocks, a dense checkpoint's weights), and the chat template.

    As EngineConfig's, each field's metadata holds its command-line help, so the CLI derives
    its model flags from these fields. Whether the settings fit the model and the machine is
    checked where they are applied (AutoModel.from_pretrained: the device, the quantization).
    """

    model: str | None = setting(
        None,
        "a model directory (Hugging Face Llama-family or native astrai), a .gguf file, or a "
        "Hugging Face id such as HuggingFaceTB/SmolLM2-135M-Instruct (from the local cache, "
        "downloaded unless HF_HUB_OFFLINE=1); default: the small demo model shipped with astrai",
        metavar="DIR|FILE|ID",
        aliases=("-m",),
    )
    revision: str | None = setting(
        None, "branch, tag or commit of a Hugging Face id (default: main)", metavar="REV"
    )
    gguf_file: str | None = setting(
        None,
        "the .gguf file to load from the --model directory or Hugging Face repo",
        metavar="NAME",
    )
    dtype: str = setting(
        "auto",
        "weight dtype, and the KV cache's unless --kv-cache-dtype; auto is bfloat16 on CUDA, "
        "float32 on CPU; a GGUF file's quantized linears keep their blocks",
        choices=LOAD_DTYPES,
    )
    dequantize: bool = setting(
        False,
        "dequantize a GGUF file's quantized linears to --dtype at load, instead of running "
        "them on astrai's quantized kernels (slower; products without int8 activations)",
    )
    quantization: str | None = setting(
        None,
        "quantize a dense checkpoint's linears at load to GGUF blocks for astrai's quantized "
        "CPU kernels: q8_0, q4_0, q4_1 or q5_0 (by the gguf package's quantizer, which has no K "
        "types: for q4_k load a Q4_K_M GGUF file)",
        metavar="TYPE",
    )
    device: str = setting(
        "auto", "cpu, cuda or cuda:N; auto picks CUDA when present", metavar="DEVICE"
    )
    mmproj: str | None = setting(
        None,
        "llama.cpp's vision projector file (mmproj .gguf) for a GGUF --model, as llama-server "
        "takes it: the model then reads images (projector types: idefics3, i.e. SmolVLM)",
        metavar="FILE",
    )
    chat_template: str | None = setting(
        None,
        "a Jinja chat template (a file or its text) to use instead of the model's",
        metavar="FILE_OR_TEXT",
    )

    def __post_init__(self) -> None:
        if self.dtype not in LOAD_DTYPES:
            raise ConfigError(f"dtype must be one of {list(LOAD_DTYPES)}, got {self.dtype!r}")
