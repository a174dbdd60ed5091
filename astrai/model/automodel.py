"""AutoModel: a checkpoint's path -> its family record -> the Transformer, weights loaded.

A .gguf file goes to the GGUF reader, a directory (native astrai or Hugging Face) to the
safetensors reader; both find the checkpoint's family in astrai.model.families.
"""

from __future__ import annotations

from pathlib import Path

import torch

from astrai.config import ConfigError
from astrai.model.checkpoint import WeightShard
from astrai.model.transformer import Transformer
from astrai.model.weights.gguf import load_gguf
from astrai.model.weights.mmproj import load_mmproj
from astrai.model.weights.quantize import quantization_type
from astrai.model.weights.safetensors import load_safetensors

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


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
        mmproj: str | Path | None = None,
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
        mmproj: llama.cpp's vision projector file for a GGUF language model, whose images
        the model then reads (astrai.model.weights.mmproj).
        """
        directory = Path(path)
        dtype = resolve_dtype(dtype)
        device = torch.device(device)
        qtype = None if quantization is None else quantization_type(quantization)
        gguf_file = directory.suffix == ".gguf" and directory.is_file()
        _check_quantization(quantization, dequantize, device, gguf_file)
        _check_mmproj(mmproj, gguf_file, shard)
        check_device(device, dtype)
        if not gguf_file:
            return load_safetensors(directory, dtype, device, qtype, shard)
        model = load_gguf(directory, dtype, device, dequantize, shard)
        if mmproj is not None:
            model.vision = load_mmproj(Path(mmproj), directory, model.config.dim, dtype, device)
        return model


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


def _check_mmproj(mmproj: str | Path | None, gguf_file: bool, shard: WeightShard | None) -> None:
    """Refuse a vision projector file where it cannot apply."""
    if mmproj is None:
        return
    if not gguf_file:
        raise ConfigError(
            f"mmproj={str(mmproj)!r} goes with a GGUF language model; a Hugging Face "
            "vision-language checkpoint directory holds its own vision tower"
        )
    if shard is not None:
        raise ConfigError(
            f"mmproj={str(mmproj)!r} with tensor parallelism: images run on one process only; "
            "leave out --tensor-parallel-size"
        )
    if not Path(mmproj).is_file():
        raise ConfigError(f"mmproj file {str(mmproj)!r} does not exist")


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
