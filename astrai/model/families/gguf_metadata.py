"""A GGUF file's metadata values, as the family records read them."""

from __future__ import annotations

import functools
from typing import Any

from gguf import GGUFReader, GGUFValueType

from astrai.model.checkpoint import CheckpointError


def metadata_value(reader: GGUFReader, name: str, default: Any = ...) -> Any:
    """A scalar metadata value; floats as the decimal the converter wrote (1e-05, not float32's
    9.99999974e-06). Without a default, a missing key is a CheckpointError."""
    field = reader.fields.get(name)
    if field is None:
        if default is ...:
            raise CheckpointError(f"GGUF metadata lacks required key {name!r}")
        return default
    value = field.parts[field.data[0]]
    if field.types[0] == GGUFValueType.STRING:
        return bytes(value).decode("utf-8")
    if field.types[0] in (GGUFValueType.FLOAT32, GGUFValueType.FLOAT64):
        return float(str(value[0]))
    if field.types[0] == GGUFValueType.BOOL:
        return bool(value[0])
    return int(value[0])


class GGUFMetadata:
    """The keys of one architecture in a GGUF file, by the name below it: metadata("block_count")
    reads llama.block_count in a llama file. Its tensors' names tell what the keys leave out
    (which layers have experts, whether the head is tied)."""

    def __init__(self, reader: GGUFReader, architecture: str) -> None:
        self.reader = reader
        self.architecture = architecture

    def __call__(self, name: str, default: Any = ...) -> Any:
        return metadata_value(self.reader, f"{self.architecture}.{name}", default)

    @functools.cached_property
    def tensor_names(self) -> frozenset[str]:
        return frozenset(tensor.name for tensor in self.reader.tensors)
