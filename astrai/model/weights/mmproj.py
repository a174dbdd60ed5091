"""llama.cpp's vision projector files: the image encoder and projector of a vision-language model
in a GGUF of their own (general.type "mmproj"), beside its language model's GGUF file, as
llama-server's --mmproj takes them.

A projector type maps onto the vision module astrai builds from the Hugging Face checkpoint
it was converted from: the settings come from the file's clip.* metadata (and the image
tokens from the language model's vocabulary), and each tensor is found under the name the gguf
package's own table gives its Hugging Face name, the table llama.cpp's converter writes with.
Types without a module here are refused by name.
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
from astrai.model.weights.gguf import open_gguf

MMPROJ_TYPE = "mmproj"


def load_mmproj(
    path: Path, language_model: Path, text_dim: int, dtype: torch.dtype, device: torch.device
) -> torch.nn.Module:
    """The vision module of the mmproj file at path, for the GGUF language model at
    language_model (whose embeddings are text_dim wide): built, its tensors loaded."""
    reader = open_gguf(path)
    kind = metadata_value(reader, "general.type", None)
    if kind != MMPROJ_TYPE:
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
    projection_dim = metadata_value(reader, "clip.vision.projection_dim")
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
        source = names.get_name(projector.hf_name(name), try_suffixes=(".weight", ".bias"))
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


def _floats(reader: GGUFReader, name: str) -> list[float]:
    field = reader.fields.get(name)
    if field is None:
        raise CheckpointError(f"GGUF metadata lacks required key {name!r}")
    return [float(str(field.parts[part][0])) for part in field.data]


class Projector(NamedTuple):
    """How mmproj files of one projector type load: build makes the vision module from the
    file's metadata and the language model's file; hf_name spells a module tensor's name as the
    Hugging Face checkpoint the converter read names it; unit_offset_norms are the module's
    (1 + w) norm weights, which the converter stores with the 1 added."""

    build: Callable[[GGUFReader, Path], torch.nn.Module]
    hf_name: Callable[[str], str]
    unit_offset_norms: tuple[str, ...] = ()


PROJECTORS = {
    "idefics3": Projector(_idefics3, lambda name: "model." + name),
    "gemma3": Projector(
        _gemma3, _gemma3_hf_name, ("multi_modal_projector.mm_soft_emb_norm.weight",)
    ),
}
