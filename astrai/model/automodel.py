"""Load a Transformer from a native astrai or Hugging Face Llama-family model directory.

Weights come from safetensors only (one file, or shards listed in
model.safetensors.index.json); pickled checkpoints are refused, since unpickling runs
arbitrary code. The module is built on the meta device and the checkpoint's tensors are
assigned in, so no memory is spent on a random init that would be overwritten at once.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from collections.abc import Collection, Iterable
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple, Protocol, TypeVar

import torch
from safetensors import safe_open
from tqdm import tqdm

from astrai.config import GEMMA_MODEL_TYPES, NATIVE_MODEL_TYPE, ConfigError, ModelConfig
from astrai.model.transformer import WEIGHTS_FILE, Transformer
from astrai.model.weights.quantize import quantization_type, quantize_into

log = logging.getLogger(__name__)
T = TypeVar("T")

INDEX_FILE = "model.safetensors.index.json"
DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

# Native name (below layers.N.) -> the HF tensors it is made of, concatenated along dim 0.
HF_LAYER_NAMES = {
    "attention_norm.weight": ("input_layernorm.weight",),
    "ffn_norm.weight": ("post_attention_layernorm.weight",),
    "attention.wqkv.weight": tuple(f"self_attn.{p}_proj.weight" for p in "qkv"),
    "attention.wqkv.bias": tuple(f"self_attn.{p}_proj.bias" for p in "qkv"),
    "attention.wo.weight": ("self_attn.o_proj.weight",),
    "attention.q_norm.weight": ("self_attn.q_norm.weight",),
    "attention.k_norm.weight": ("self_attn.k_norm.weight",),
    "feed_forward.w13.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight"),
    "feed_forward.w2.weight": ("mlp.down_proj.weight",),
    # Mixture of experts: one entry serves every expert, its index written {e}.
    "feed_forward.router.weight": ("mlp.gate.weight",),
    "feed_forward.experts.{e}.w13.weight": (
        "mlp.experts.{e}.gate_proj.weight",
        "mlp.experts.{e}.up_proj.weight",
    ),
    "feed_forward.experts.{e}.w2.weight": ("mlp.experts.{e}.down_proj.weight",),
    "feed_forward.shared_expert.w13.weight": (
        "mlp.shared_expert.gate_proj.weight",
        "mlp.shared_expert.up_proj.weight",
    ),
    "feed_forward.shared_expert.w2.weight": ("mlp.shared_expert.down_proj.weight",),
    "feed_forward.shared_expert_gate.weight": ("mlp.shared_expert_gate.weight",),
}
# Mixtral's checkpoints name the experts' projections as the paper does.
MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# transformers 5's own layout (save_pretrained(save_original_format=False)): each layer's
# experts in one [n_experts, rows, in_features] tensor, rows split evenly among these parts.
FUSED_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# With post-norms (Gemma) HF's post_attention_layernorm norms the attention's output, and the
# feed-forward has a pre_ and a post_feedforward_layernorm of its own.
HF_POST_NORM_LAYER_NAMES = {
    **HF_LAYER_NAMES,
    "ffn_norm.weight": ("pre_feedforward_layernorm.weight",),
    "post_attention_norm.weight": ("post_attention_layernorm.weight",),
    "post_ffn_norm.weight": ("post_feedforward_layernorm.weight",),
}
HF_TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Phi-3 checkpoints hold q/k/v and gate/up fused, in astrai's order.
FUSED_PROJECTION_MODEL_TYPES = ("phi3",)
HF_FUSED_LAYER_NAMES = {
    **HF_LAYER_NAMES,
    "attention.wqkv.weight": ("self_attn.qkv_proj.weight",),
    "feed_forward.w13.weight": ("mlp.gate_up_proj.weight",),
}
# Old HF checkpoints carry rope frequencies as tensors; transformers ignores them and so do we.
IGNORED_HF_TENSOR = re.compile(r".*rotary_emb\.inv_freq$")


class CheckpointError(ValueError):
    """A model directory's weights are missing, unreadable, or do not fit its config."""


class StoredTensor(NamedTuple):
    """Where a checkpoint tensor lies: tensor `name` of file, or the part of it that index
    picks (one expert's share of a fused experts tensor); shape is that of the part."""

    file: Path
    name: str
    shape: tuple[int, ...]
    index: tuple = ()

    def read(self, handle, index: tuple = ()) -> torch.Tensor:
        """The tensor, from handle (the safe_open of file); only its part at index if given,
        which is sliced before it is read (a tensor-parallel rank reads its share alone)."""
        assert not (index and self.index), "a part of a part is never read"
        index = index or self.index
        return handle.get_slice(self.name)[index] if index else handle.get_tensor(self.name)


class WeightShard(Protocol):
    """The share of the weights one tensor-parallel rank loads (astrai.distributed's
    TensorShard): its model's config, and which rows or columns of each tensor it holds."""

    def model(self, config: ModelConfig) -> Transformer:
        """The rank's model, for the whole model's config (built where the caller says)."""
        ...

    def spans(self, name: str, config: ModelConfig) -> tuple[int, list[tuple[int, int]]] | None:
        """(dim, [(start, stop), ...]): the ranges along dim of native tensor `name` (of the
        whole model, config) the rank holds, concatenated in order; None for a tensor every
        rank holds whole."""
        ...


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A floating torch.dtype from a torch.dtype or a name such as "bf16"."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    raise ConfigError(
        f"unsupported dtype {dtype!r}; pass a floating torch.dtype or one of {sorted(DTYPES)}"
    )


class AutoModel:
    """Entry point: AutoModel.from_pretrained(directory) -> Transformer."""

    @staticmethod
    def from_pretrained(
        path: str | Path,
        dtype: torch.dtype | str = torch.float32,
        device: str | torch.device = "cpu",
        dequantize: bool = False,
        quantization: str | None = None,
        shard: WeightShard | None = None,
    ) -> Transformer:
        """Build the Transformer of a native or Hugging Face directory, or of a .gguf file,
        and load its weights.

        Every tensor's shape is checked against the config; missing, unexpected and
        mis-shaped tensors are all reported by name in one CheckpointError. A GGUF file's
        quantized linears keep their blocks on the CPU (dtype is then that of the activations)
        unless dequantize. A directory's linears are quantized at load to quantization's
        blocks ("q8_0", "q4_0", "q4_1" or "q5_0"), for the CPU's quantized kernels, if it is
        given.
        With shard, only that tensor-parallel rank's share of each tensor is read.
        """
        directory = Path(path)
        dtype = resolve_dtype(dtype)
        device = torch.device(device)
        qtype = None if quantization is None else quantization_type(quantization)
        gguf_file = directory.suffix == ".gguf" and directory.is_file()
        _check_quantization(quantization, dequantize, device, gguf_file)
        check_device(device, dtype)
        if gguf_file:
            # Imported here: the GGUF reader builds on this module's checkpoint layout.
            from astrai.model.weights.gguf import load_gguf

            return load_gguf(directory, dtype, device, dequantize, shard)
        config = ModelConfig.from_pretrained(directory)
        raw_config = json.loads((directory / "config.json").read_text())
        native = raw_config.get("model_type", NATIVE_MODEL_TYPE) == NATIVE_MODEL_TYPE
        # Gemma's RMSNorms scale by (1 + weight): the 1 is added once here, in fp32 as
        # transformers adds it, so the model's norms are the plain ones.
        unit_offset_norms = raw_config.get("model_type") in GEMMA_MODEL_TYPES
        with torch.device("meta"):
            model = Transformer(config)
        shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
        if shard is not None:
            with torch.device("meta"):
                model = shard.model(config)
        fused = raw_config.get("model_type") in FUSED_PROJECTION_MODEL_TYPES
        layout = {
            name: _sources(config, name, shape, native, fused) for name, shape in shapes.items()
        }
        files = _tensor_files(directory)
        with ExitStack() as stack:
            handles = {
                file: stack.enter_context(safe_open(file, framework="pt", device="cpu"))
                for file in {stored.file for stored in files.values()}
            }
            _check(layout, files, config, native)
            state = {}
            for name, parts in loading(layout.items(), directory):
                spans = None if shard is None else shard.spans(name, config)
                tensor = _read(parts, files, handles, spans)
                if unit_offset_norms and name.endswith("norm.weight"):
                    tensor = 1.0 + tensor.float()
                if qtype is None or not quantize_into(model, name, tensor, qtype):
                    state[name] = tensor.to(dtype).to(device)
        if qtype is not None:
            quantized = len(layout) - len(state)
            log.info("quantized %d linears to %s at load", quantized, qtype.name)
        model.load_state_dict(state, strict=True, assign=True)
        # Moves the rope buffer (built on CPU in fp32) to the device, keeping it fp32.
        model.to(device)
        return model.requires_grad_(False).eval()


def _read(
    parts: list[tuple[str, tuple[int, ...]]],
    files: dict[str, StoredTensor],
    handles: dict,
    spans: tuple[int, list[tuple[int, int]]] | None,
) -> torch.Tensor:
    """A native tensor from its checkpoint parts, which lie one after another along dim 0; with
    spans (dim, ranges), only those ranges of it, each part sliced as it is read."""
    if spans is None:
        tensors = [files[src].read(handles[files[src].file]) for src, _ in parts]
        return tensors[0] if len(tensors) == 1 else torch.cat(tensors)
    dim, ranges = spans
    if dim == 1:
        assert len(parts) == 1, "columns are taken of one-part tensors only"
        stored = files[parts[0][0]]
        index = [(slice(None), slice(start, stop)) for start, stop in ranges]
        return torch.cat([stored.read(handles[stored.file], i) for i in index], dim)
    pieces = []
    for (src, _), rows in zip(parts, part_rows([s[0] for _, s in parts], ranges), strict=True):
        stored = files[src]
        pieces += [stored.read(handles[stored.file], (share,)) for share in rows]
    return torch.cat(pieces)


def part_rows(lengths: list[int], ranges: list[tuple[int, int]]) -> list[list[slice]]:
    """For parts of these row counts lying one after another, the slices of each part's rows
    that the ranges of the whole cover, in order (a WeightShard's spans along dim 0)."""
    shares, offset = [], 0
    for length in lengths:
        shares.append(
            [
                slice(max(start - offset, 0), min(stop - offset, length))
                for start, stop in ranges
                if start < offset + length and stop > offset
            ]
        )
        offset += length
    return shares


def check_device(device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, before anything loads, a device this machine lacks or a dtype it cannot
    compute in, saying what there is instead (torch's own errors name neither)."""
    if device.type == "cpu":
        return
    if device.type != "cuda":
        raise ConfigError(f"device {str(device)!r} is not supported; astrai runs on cpu and cuda")
    if not torch.cuda.is_available():
        build = (
            "a CPU-only build"
            if torch.version.cuda is None
            else f"built for CUDA {torch.version.cuda}, but it sees no GPU"
        )
        raise ConfigError(
            f"device {str(device)!r} was asked for, but torch {torch.__version__} is {build}; "
            "use --device cpu (or auto), or a CUDA build of torch on a machine with a GPU"
        )
    count = torch.cuda.device_count()
    if (device.index or 0) >= count:
        raise ConfigError(
            f"device {str(device)!r} does not exist: this machine has {count} CUDA device(s), "
            f"cuda:0 to cuda:{count - 1}"
        )
    if dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        name = torch.cuda.get_device_name(device)
        raise ConfigError(
            f"{name} cannot compute in bfloat16 (it needs compute capability 8.0); "
            "use --dtype float16 or float32"
        )


def _check_quantization(
    quantization: str | None, dequantize: bool, device: torch.device, gguf_file: bool
) -> None:
    """Refuse a quantization that cannot apply: to a GGUF file, with dequantize, off the CPU."""
    if quantization is None:
        return
    if dequantize:
        raise ConfigError(
            f"quantization={quantization!r} and dequantize=True ask for opposite things; "
            "pass one or the other"
        )
    if gguf_file:
        raise ConfigError(
            f"quantization={quantization!r} applies to dense checkpoints only; a GGUF file's "
            "linears keep the blocks they were written in (or pass dequantize=True for dense)"
        )
    if device.type != "cpu":
        raise ConfigError(
            f"quantization={quantization!r} needs device cpu, where the quantized kernels run, "
            f"not {device}"
        )


def loading(items: Collection[T], source: Path) -> Iterable[T]:
    """items, counted on a progress bar when stderr is a terminal, announced in the log."""
    log.info("loading %d tensors from %s", len(items), source)
    return tqdm(
        items,
        desc=f"loading {source.name}",
        unit="tensor",
        leave=False,
        disable=not sys.stderr.isatty(),
    )


def _sources(
    config: ModelConfig,
    name: str,
    shape: tuple[int, ...],
    native: bool,
    fused_projections: bool = False,
) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint tensors (name, shape) that make up native tensor `name`, in order;
    fused_projections: the checkpoint's q/k/v and gate/up are one tensor each, as astrai's."""
    if native:
        return [(name, shape)]
    if name in HF_TOP_NAMES:
        return [(HF_TOP_NAMES[name], shape)]
    match = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
    assert match is not None, f"no HF name for native tensor {name}"
    layer, suffix = match.groups()
    suffix, index = expert_template(suffix)
    layer_names = HF_POST_NORM_LAYER_NAMES if config.post_norms else HF_LAYER_NAMES
    if fused_projections:
        layer_names = HF_FUSED_LAYER_NAMES
    hf_names = [f"model.layers.{layer}.{hf.format(e=index)}" for hf in layer_names[suffix]]
    if len(hf_names) == 1:
        rows = [shape[0]]
    elif suffix.startswith("attention.wqkv"):
        q_size = config.n_heads * config.head_dim
        kv_size = config.n_kv_heads * config.head_dim
        rows = [q_size, kv_size, kv_size]
    else:  # an MLP's gate and up projections, fused
        rows = [shape[0] // 2, shape[0] // 2]
    return [(hf, (n, *shape[1:])) for hf, n in zip(hf_names, rows, strict=True)]


def expert_template(name: str) -> tuple[str, str | None]:
    """(name with its expert index written {e}, as the name tables spell every expert's
    tensors once, and that index), or (name, None) for a tensor of no expert."""
    expert = re.search(r"(?<=experts\.)\d+(?=\.)", name)
    if expert is None:
        return name, None
    return name.replace(f"experts.{expert[0]}.", "experts.{e}."), expert[0]


def _tensor_files(directory: Path) -> dict[str, StoredTensor]:
    """Where each tensor of the directory's safetensors weights lies, by its name; experts
    under Mixtral's names or fused as transformers 5 writes them are listed per expert, as
    HF_LAYER_NAMES names them."""
    single = directory / WEIGHTS_FILE
    index = directory / INDEX_FILE
    if single.is_file():
        shards = [single]
    elif index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise CheckpointError(
                f"{index} is not a valid safetensors index (needs a 'weight_map'): {error}"
            ) from error
        shards = [directory / shard for shard in sorted(set(weight_map.values()))]
        absent = [shard.name for shard in shards if not shard.is_file()]
        if absent:
            raise CheckpointError(f"{index} lists shards that are not in {directory}: {absent}")
    elif any(directory.glob("*.bin")) or any(directory.glob("*.pt")):
        raise CheckpointError(
            f"{directory} has only pickled weights (.bin/.pt); astrai never unpickles, since that "
            "can run arbitrary code. Convert them to safetensors, e.g. with transformers: "
            "AutoModelForCausalLM.from_pretrained(d).save_pretrained(d, safe_serialization=True)"
        )
    else:
        raise CheckpointError(
            f"no weights in {directory}: expected {WEIGHTS_FILE} or {INDEX_FILE} with its shards"
        )
    stored: list[StoredTensor] = []
    for shard in shards:
        try:
            with safe_open(shard, framework="pt", device="cpu") as handle:
                stored += [
                    StoredTensor(shard, name, tuple(handle.get_slice(name).get_shape()))
                    for name in handle.keys()  # noqa: SIM118
                ]
        except Exception as error:
            raise CheckpointError(f"cannot read safetensors file {shard}: {error}") from error
    return {name: part for tensor in stored for name, part in _per_expert(tensor).items()}


def _per_expert(stored: StoredTensor) -> dict[str, StoredTensor]:
    """A checkpoint tensor by the name(s) HF_LAYER_NAMES reads: a Mixtral expert's or router's
    renamed, a fused experts tensor split into each expert's parts, any other as it is."""
    mixtral = re.fullmatch(r"(.+)\.block_sparse_moe\.(.+)", stored.name)
    if mixtral is not None:
        prefix, rest = mixtral.groups()
        rest = re.sub(r"(?<=\.)w[123](?=\.)", lambda w: MIXTRAL_EXPERT_NAMES[w[0]], rest)
        return {f"{prefix}.mlp.{rest}": stored}
    fused = re.fullmatch(r"(.+\.experts)\.(gate_up_proj|down_proj)", stored.name)
    if fused is None:
        return {stored.name: stored}
    prefix, kind = fused.groups()
    parts = FUSED_EXPERT_PARTS[kind]
    if len(stored.shape) != 3 or stored.shape[1] % len(parts):
        raise CheckpointError(
            f"{stored.name} has shape {list(stored.shape)}; fused experts are [n_experts, "
            f"rows, in_features] with rows holding {' and '.join(parts)}"
        )
    n_experts, rows, in_features = stored.shape
    share = rows // len(parts)
    return {
        f"{prefix}.{expert}.{part}.weight": stored._replace(
            shape=(share, in_features), index=(expert, slice(i * share, (i + 1) * share))
        )
        for expert in range(n_experts)
        for i, part in enumerate(parts)
    }


def _check(layout, files: dict[str, StoredTensor], config: ModelConfig, native: bool) -> None:
    """Raise one CheckpointError naming every missing, unexpected or mis-shaped tensor."""
    wanted = {source: shape for parts in layout.values() for source, shape in parts}
    missing = sorted(set(wanted) - set(files))
    allowed_extra = set()
    if config.tie_weight:
        # A tied checkpoint may still carry the head; the embedding is used for it regardless.
        allowed_extra.add("output.weight" if native else "lm_head.weight")
    unexpected = sorted(
        name
        for name in set(files) - set(wanted) - allowed_extra
        if native or not IGNORED_HF_TENSOR.fullmatch(name)
    )
    misshaped = []
    for source, shape in wanted.items():
        if source in files:
            found = files[source].shape
            if found != shape:
                misshaped.append(f"{source} has shape {list(found)}, expected {list(shape)}")
    problems = []
    if missing:
        problems.append(f"missing tensors: {missing}")
    if unexpected:
        problems.append(f"unexpected tensors: {unexpected}")
    if misshaped:
        problems.append("mis-shaped tensors: " + "; ".join(misshaped))
    if problems:
        raise CheckpointError(
            "checkpoint does not match its config.json: "
            + ". ".join(problems)
            + ". Check that config.json belongs to these weights."
        )
