"""Load a Transformer from a native astrai or Hugging Face model directory's safetensors.

Weights come from safetensors only (one file, or shards listed in
model.safetensors.index.json); pickled checkpoints are refused, since unpickling runs
arbitrary code. The module is built on the meta device and the checkpoint's tensors are
assigned in, so no memory is spent on a random init that would be overwritten at once.
"""

from __future__ import annotations

import json
import logging
import re
from contextlib import ExitStack
from pathlib import Path
from typing import NamedTuple

import torch
from gguf import GGMLQuantizationType
from safetensors import safe_open

from astrai.config import ConfigError, ModelConfig
from astrai.model.checkpoint import CheckpointError, WeightShard, loading, part_rows
from astrai.model.families import Family, VisionFamily, checkpoint_vision, read_checkpoint_config
from astrai.model.transformer import WEIGHTS_FILE, Transformer
from astrai.model.weights.quantize import quantize_into

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
# Mixtral's checkpoints name the experts' projections as the paper does.
MIXTRAL_EXPERT_NAMES = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
# transformers 5's own layout (save_pretrained(save_original_format=False)): each layer's
# experts in one [n_experts, rows, in_features] tensor, rows split evenly among these parts.
FUSED_EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
# Old HF checkpoints carry rope frequencies as tensors; transformers ignores them and so do we.
IGNORED_HF_TENSOR = re.compile(r".*rotary_emb\.inv_freq$")


def load_safetensors(
    directory: Path,
    dtype: torch.dtype,
    device: torch.device,
    qtype: GGMLQuantizationType | None = None,
    shard: WeightShard | None = None,
) -> Transformer:
    """The Transformer of a native or Hugging Face directory, its linears quantized at load to
    qtype's blocks if given; with shard, only that tensor-parallel rank's share of each
    tensor is read."""
    config, family = read_checkpoint_config(directory)
    with torch.device("meta"):
        model = Transformer(config)
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if shard is not None:
        with torch.device("meta"):
            model = shard.model(config)
    layout = {name: _sources(family, config, name, shape) for name, shape in shapes.items()}
    vision = checkpoint_vision(directory)
    if vision is not None and shard is not None:
        raise ConfigError(
            f"{directory} is a vision-language ({vision[0].name}) checkpoint; tensor "
            "parallelism runs language models only, so serve it with one process"
        )
    files = _tensor_files(directory)
    if vision is not None:
        files = {vision[0].tensor_name(name): stored for name, stored in files.items()}
    # Gemma's RMSNorms scale by (1 + weight): the 1 is added once here, in fp32 as
    # transformers adds it, so the model's norms are the plain ones.
    unit_offset_norms = family is not None and family.unit_offset_norms
    with ExitStack() as stack:
        handles = {
            file: stack.enter_context(safe_open(file, framework="pt", device="cpu"))
            for file in {stored.file for stored in files.values()}
        }
        vision_names = () if vision is None else vision[0].vision_prefixes
        _check(layout, files, config, native=family is None, ignored_prefixes=vision_names)
        state = {}
        for name, parts in loading(layout.items(), directory):
            spans = None if shard is None else shard.spans(name, config)
            tensor = _read(parts, files, handles, spans)
            if unit_offset_norms and name.endswith("norm.weight"):
                tensor = 1.0 + tensor.float()
            if qtype is None or not quantize_into(model, name, tensor, qtype):
                state[name] = tensor.to(dtype).to(device)
        vision_module = None
        if vision is not None:
            vision_module = _load_vision(*vision, directory, files, handles, dtype, device)
    if qtype is not None:
        quantized = len(layout) - len(state)
        log.info("quantized %d linears to %s at load", quantized, qtype.name)
    model.load_state_dict(state, strict=True, assign=True)
    # Moves the rope buffer (built on CPU in fp32) to the device, keeping it fp32.
    model.to(device)
    model.vision = vision_module
    return model.requires_grad_(False).eval()


def _load_vision(
    family: VisionFamily,
    hf: dict,
    directory: Path,
    files: dict[str, StoredTensor],
    handles: dict,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.nn.Module:
    """The vision module of a vision-language checkpoint, its tensors read by their names
    (those of layers it never runs are left unread)."""
    with torch.device("meta"):
        module = family.build(hf, directory)
    wanted = {name: tuple(t.shape) for name, t in module.state_dict().items()}
    missing = sorted(set(wanted) - set(files))
    misshaped = [
        f"{name} has shape {list(files[name].shape)}, expected {list(shape)}"
        for name, shape in wanted.items()
        if name in files and files[name].shape != shape
    ]
    if missing or misshaped:
        raise CheckpointError(
            f"the {family.name} vision tensors do not match config.json: "
            + ". ".join(
                [f"missing tensors: {missing}"] * bool(missing)
                + ["mis-shaped tensors: " + "; ".join(misshaped)] * bool(misshaped)
            )
        )
    state = {
        name: files[name].read(handles[files[name].file]).to(dtype).to(device) for name in wanted
    }
    module.load_state_dict(state, strict=True, assign=True)
    return module.requires_grad_(False).eval()


def _sources(
    family: Family | None, config: ModelConfig, name: str, shape: tuple[int, ...]
) -> list[tuple[str, tuple[int, ...]]]:
    """The checkpoint tensors (name, shape) that make up native tensor `name`, in order: the
    tensor itself in a native checkpoint, else the family's Hugging Face tensors."""
    return [(name, shape)] if family is None else family.hf_tensors(config, name, shape)


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


def _tensor_files(directory: Path) -> dict[str, StoredTensor]:
    """Where each tensor of the directory's safetensors weights lies, by its name; experts
    under Mixtral's names or fused as transformers 5 writes them are listed per expert, as
    the family records name them."""
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
    """A checkpoint tensor by the name(s) the family records read: a Mixtral expert's or router's
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


def _check(
    layout,
    files: dict[str, StoredTensor],
    config: ModelConfig,
    native: bool,
    ignored_prefixes: tuple[str, ...] = (),
) -> None:
    """Raise one CheckpointError naming every missing, unexpected or mis-shaped tensor; those
    under ignored_prefixes (a vision module's, which loads them itself) are not unexpected."""
    wanted = {source: shape for parts in layout.values() for source, shape in parts}
    missing = sorted(set(wanted) - set(files))
    allowed_extra = set()
    if config.tie_weight:
        # A tied checkpoint may still carry the head; the embedding is used for it regardless.
        allowed_extra.add("output.weight" if native else "lm_head.weight")
    unexpected = sorted(
        name
        for name in set(files) - set(wanted) - allowed_extra
        if (native or not IGNORED_HF_TENSOR.fullmatch(name))
        and not name.startswith(ignored_prefixes)
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
