"""llama.cpp's vision projector files: the image encoder and projector of a vision-language model
in a GGUF of their own (general.type "mmproj"), beside its language model's GGUF file, as
llama-server's --mmproj takes them.

A projector type maps onto the vision module astrai builds from the Hugging Face checkpoint
it was converted from: the settings come from the file's clip.* metadata (and the image
tokens from the language model's vocabulary), and each tensor is found under the name the gguf
package's own table gives its Hugging Face name, the table llama.cpp's converter writes with
(LLaVA-1.5's "mlp" projector, which llama.cpp's older converter wrote, keeps the original
LLaVA's names for its two linears). Types without a module here are refused by name.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize as decode_blocks

from astrai.model.checkpoint import CheckpointError
from astrai.model.families.gguf_metadata import metadata_value
from astrai.model.vision.gemma3 import Gemma3Vision
from astrai.model.vision.gemma3_processor import Gemma3ImageProcessor
from astrai.model.vision.idefics3 import Idefics3Vision
from astrai.model.vision.idefics3_processor import Idefics3ImageProcessor
from astrai.model.vision.image_processor import ClipImageProcessor
from astrai.model.vision.llava import LlavaVision
from astrai.model.weights.gguf import open_gguf

MMPROJ_TYPE = "mmproj"


def load_mmproj(
    path: Path, language_model: Path, text_dim: int, dtype: torch.dtype, device: torch.device
) -> torch.nn.Module:
    """The vision module of the mmproj file at path, for the GGUF language model at
    language_model (whose embeddings are text_dim wide): built, its tensors loaded."""
    reader = open_gguf(path)
    kind = metadata_value(reader, "general.type", None)
    # llama.cpp's older converter (LLaVA-1.5's files) wrote no type, only the clip architecture.
    untyped_clip = kind is None and metadata_value(reader, "general.architecture", None) == "clip"
    if kind != MMPROJ_TYPE and not untyped_clip:
        raise CheckpointError(
            f"{path} is not a vision projector (its general.type is {kind!r}, not "
            f"{MMPROJ_TYPE!r}); pass --mmproj the mmproj GGUF file that comes with the model"
        )
    projector_type = metadata_value(reader, "clip.projector_type", None)
    projector = PROJECTORS.get(projector_type)
    if projector is None:
        raise CheckpointError(
            f"{path} holds a {projector_type!r} vision projector; astrai runs mmproj files of "
            f"{sorted(PROJECTORS)} (other vision-language models load from their Hugging Face "
            "checkpoint directory)"
        )
    projection_dim = projector.projection_dim(reader)
    if projection_dim != text_dim:
        raise CheckpointError(
            f"{path} projects images to {projection_dim}-wide embeddings, but the language "
            f"model {language_model} embeds tokens in {text_dim}: the two files are not one model"
        )
    with torch.device("meta"):
        module = projector.build(reader, language_model)
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(
        gguf.MODEL_ARCH.MMPROJ, metadata_value(reader, "clip.vision.block_count")
    )
    state, missing, misshaped = {}, [], []
    for name, wanted in module.state_dict().items():
        source = projector.tensor_name(names, name)
        if source is not None:
            source = _ffn_as_shaped(source, tensors, tuple(wanted.shape))
        tensor = tensors.pop(source, None)
        if tensor is None:
            missing.append(source or name)
            continue
        values = decode_blocks(tensor.data, tensor.tensor_type).reshape(
            [int(n) for n in reversed(tensor.shape)]
        )
        if tuple(values.shape) != tuple(wanted.shape):
            misshaped.append(
                f"{source} has shape {list(values.shape)}, expected {list(wanted.shape)}"
            )
            continue
        values = np.array(values, dtype=np.float32)
        if name in projector.unit_offset_norms:
            values -= 1.0  # the module adds Gemma's 1 itself
        state[name] = torch.from_numpy(values).to(dtype).to(device)
    if missing or misshaped or tensors:
        problems = [f"missing tensors: {missing}"] * bool(missing)
        problems += ["mis-shaped tensors: " + "; ".join(misshaped)] * bool(misshaped)
        problems += [f"unexpected tensors (not supported): {sorted(tensors)}"] * bool(tensors)
        raise CheckpointError(f"cannot load vision projector {path}: " + ". ".join(problems))
    module.load_state_dict(state, strict=True, assign=True)
    return module.requires_grad_(False).eval()


def _ffn_as_shaped(source: str, tensors: dict[str, Any], shape: tuple[int, ...]) -> str:
    """source, or its ffn_up / ffn_down counterpart where only that one has the shape wanted:
    llama.cpp's older converters wrote a layer's fc1 as ffn_down and its fc2 as ffn_up, and its
    clip.cpp tells the two apart by shape too."""
    if source in tensors and _torch_shape(tensors[source]) == shape:
        return source
    for name, other in (("ffn_up", "ffn_down"), ("ffn_down", "ffn_up")):
        swapped = source.replace(f".{name}.", f".{other}.")
        if swapped in tensors and swapped != source and _torch_shape(tensors[swapped]) == shape:
            return swapped
    return source


def _torch_shape(tensor: Any) -> tuple[int, ...]:
    return tuple(int(n) for n in reversed(tensor.shape))


def _token_id(language_model: Path, token: str) -> int:
    """The id of token in the GGUF language model's vocabulary."""
    field = open_gguf(language_model).fields.get("tokenizer.ggml.tokens")
    if field is not None:
        for token_id, part in enumerate(field.data):
            if bytes(field.parts[part]).decode("utf-8") == token:
                return token_id
    raise CheckpointError(
        f"the language model {language_model} has no {token!r} token in its vocabulary; its "
        "images are written as that token: use the GGUF file converted with its mmproj file"
    )


def _idefics3(reader: GGUFReader, language_model: Path) -> Idefics3Vision:
    """Idefics3's and SmolVLM's SigLIP tower and pixel-shuffle connector."""

    def clip(name: str, default: Any = ...) -> Any:
        return metadata_value(reader, f"clip.vision.{name}", default)

    image_size = clip("image_size")
    hf = {
        "vision_config": {
            "model_type": "idefics3_vision",
            "hidden_size": clip("embedding_length"),
            "intermediate_size": clip("feed_forward_length"),
            "num_hidden_layers": clip("block_count"),
            "num_attention_heads": clip("attention.head_count"),
            "image_size": image_size,
            "patch_size": clip("patch_size"),
            "layer_norm_eps": clip("attention.layer_norm_epsilon"),
        },
        "scale_factor": clip("projector.scale_factor"),
        "text_config": {"hidden_size": clip("projection_dim")},
        "image_token_id": _token_id(language_model, "<image>"),
    }
    # The converter keeps the processor's longest edge; tiles are the tower's image size, and
    # the image is split into them as transformers' processor does by default.
    processor = Idefics3ImageProcessor.from_hf(
        {
            "size": {"longest_edge": clip("preproc_image_size", image_size)},
            "max_image_size": {"longest_edge": image_size},
            "image_mean": _floats(reader, "clip.vision.image_mean"),
            "image_std": _floats(reader, "clip.vision.image_std"),
        }
    )
    return Idefics3Vision(hf, processor)


def _gemma3(reader: GGUFReader, language_model: Path) -> Gemma3Vision:
    """Gemma 3's SigLIP tower and pooling projector; its patch grid is pooled by
    projector.scale_factor a side (llama.cpp's default for Gemma 3: 4, 256 tokens an image)."""

    def clip(name: str, default: Any = ...) -> Any:
        return metadata_value(reader, f"clip.vision.{name}", default)

    image_size, patch_size = clip("image_size"), clip("patch_size")
    tokens_per_side = image_size // patch_size // clip("projector.scale_factor", 4)
    hf = {
        "vision_config": {
            "model_type": "siglip_vision_model",
            "hidden_size": clip("embedding_length"),
            "intermediate_size": clip("feed_forward_length"),
            "num_hidden_layers": clip("block_count"),
            "num_attention_heads": clip("attention.head_count"),
            "image_size": image_size,
            "patch_size": patch_size,
            "layer_norm_eps": clip("attention.layer_norm_epsilon"),
        },
        "mm_tokens_per_image": tokens_per_side**2,
        "text_config": {"hidden_size": clip("projection_dim")},
        "boi_token_index": _token_id(language_model, "<start_of_image>"),
        "eoi_token_index": _token_id(language_model, "<end_of_image>"),
        "image_token_index": _token_id(language_model, "<image_soft_token>"),
    }
    processor = Gemma3ImageProcessor.from_hf(
        {
            "size": {"height": image_size, "width": image_size},
            "image_mean": _floats(reader, "clip.vision.image_mean"),
            "image_std": _floats(reader, "clip.vision.image_std"),
        }
    )
    return Gemma3Vision(hf, processor)


def _gemma3_hf_name(name: str) -> str:
    """A Gemma3Vision tensor's name as the hub's checkpoint (transformers 4) has it."""
    if name.startswith("vision_tower."):
        return "vision_tower.vision_model." + name.removeprefix("vision_tower.")
    return name.replace("_projection_weight", "_projection.weight")


def _llava(reader: GGUFReader, language_model: Path) -> LlavaVision:
    """LLaVA-1.5's CLIP tower and two-layer MLP projector. llama.cpp's converter keeps the
    tower's layers up to the one LLaVA reads (clip.vision.feature_layer, when it writes it,
    names that last one) and drops its post-norm, so the image features are the last layer's."""

    def clip(name: str, default: Any = ...) -> Any:
        return metadata_value(reader, f"clip.vision.{name}", default)

    if "clip.vision.image_grid_pinpoints" in reader.fields:
        raise CheckpointError(
            "this mmproj file is LLaVA-NeXT's (it has image_grid_pinpoints); astrai loads "
            "LLaVA-NeXT from its Hugging Face checkpoint directory only"
        )
    layers = clip("block_count")
    if "clip.vision.feature_layer" in reader.fields:
        feature_layers = [int(n) for n in _floats(reader, "clip.vision.feature_layer")]
        if feature_layers != [layers]:
            raise CheckpointError(
                f"this mmproj file reads the tower's hidden states {feature_layers}; astrai's "
                f"LLaVA reads one, the last of the {layers} layers the file holds"
            )
    image_size = clip("image_size")
    hf = {
        "vision_config": {
            "hidden_size": clip("embedding_length"),
            "intermediate_size": clip("feed_forward_length"),
            "num_hidden_layers": layers,
            "num_attention_heads": clip("attention.head_count"),
            "image_size": image_size,
            "patch_size": clip("patch_size"),
            "layer_norm_eps": clip("attention.layer_norm_epsilon"),
            "hidden_act": "gelu"
            if metadata_value(reader, "clip.use_gelu", False)
            else "quick_gelu",
        },
        "vision_feature_layer": -1,
        "text_config": {"hidden_size": _llava_projection_dim(reader)},
        "image_token_index": _token_id(language_model, "<image>"),
    }
    processor = ClipImageProcessor(
        shortest_edge=image_size,
        crop_size=(image_size, image_size),
        image_mean=tuple(_floats(reader, "clip.vision.image_mean")),
        image_std=tuple(_floats(reader, "clip.vision.image_std")),
    )
    return LlavaVision(hf, processor)


def _floats(reader: GGUFReader, name: str) -> list[float]:
    field = reader.fields.get(name)
    if field is None:
        raise CheckpointError(f"GGUF metadata lacks required key {name!r}")
    return [float(str(field.parts[part][0])) for part in field.data]


def _metadata_projection_dim(reader: GGUFReader) -> int:
    """The width of the embeddings the projector makes (clip.vision.projection_dim)."""
    return metadata_value(reader, "clip.vision.projection_dim")


def _llava_projection_dim(reader: GGUFReader) -> int:
    """The width of LLaVA's projected features: its last linear's (mm.2's) rows, as clip.cpp
    reads it; the file's clip.vision.projection_dim is the CLIP model's own."""
    tensor = next((t for t in reader.tensors if t.name == "mm.2.weight"), None)
    if tensor is None:
        raise CheckpointError("this LLaVA mmproj file lacks mm.2.weight, its projector's output")
    return int(tensor.shape[1])  # GGUF shapes are [in, out]


def _table_name(names: gguf.TensorNameMap, name: str) -> str | None:
    """The file's name of a module tensor, by the gguf package's table of Hugging Face names."""
    return names.get_name("model." + name, try_suffixes=(".weight", ".bias"))


# llama.cpp's LLaVA projector keeps the original LLaVA's names for its two linears (the
# indices of model.mm_projector's Sequential), which the gguf package's table lacks.
LLAVA_PROJECTOR_NAMES = {
    "multi_modal_projector.linear_1": "mm.0",
    "multi_modal_projector.linear_2": "mm.2",
}


def _llava_name(names: gguf.TensorNameMap, name: str) -> str | None:
    """The file's name of a LlavaVision tensor: the projector's as llama.cpp names it, the
    tower's by the table (which knows it as transformers' vision_tower.vision_model.*)."""
    module, kind = name.rsplit(".", 1)
    if module in LLAVA_PROJECTOR_NAMES:
        return f"{LLAVA_PROJECTOR_NAMES[module]}.{kind}"
    tower = name.removeprefix("vision_tower.")
    return names.get_name(f"vision_tower.vision_model.{tower}", try_suffixes=(".weight", ".bias"))


def _gemma3_name(names: gguf.TensorNameMap, name: str) -> str | None:
    """The file's name of a Gemma3Vision tensor, by the table, which knows the hub's
    checkpoint's names (transformers 4's)."""
    return names.get_name(_gemma3_hf_name(name), try_suffixes=(".weight", ".bias"))


class Projector(NamedTuple):
    """A projector type: its vision module, built from the file's metadata (and the language
    model's vocabulary); the file's name of each of the module's tensors; the width of the
    embeddings it makes; and the module's (1 + w) norm weights, which the converter stores with
    the 1 added."""

    build: Callable[[GGUFReader, Path], torch.nn.Module]
    tensor_name: Callable[[gguf.TensorNameMap, str], str | None]
    projection_dim: Callable[[GGUFReader], int]
    unit_offset_norms: tuple[str, ...] = ()


PROJECTORS = {
    "idefics3": Projector(_idefics3, _table_name, _metadata_projection_dim),
    "mlp": Projector(_llava, _llava_name, _llava_projection_dim),
    "gemma3": Projector(
        _gemma3,
        _gemma3_name,
        _metadata_projection_dim,
        ("multi_modal_projector.mm_soft_emb_norm.weight",),
    ),
}
