"""A GGUF file's metadata and tensor table as the gguf package's GGUFReader gives them, its
metadata arrays read in bulk.

GGUFReader makes numpy arrays of every item of a metadata array, in a Python loop: a vocabulary
of 49k tokens and as many merges is a quarter of a million small arrays and half a second of a
start. GGUFFileReader gives the same fields (gguf's ReaderField: parts, data, types,
contents()) and tensors (ReaderTensor), but keeps an array as one view of its numbers, or the
offsets of its strings, found in one tight walk; an item's parts are made only when one is
asked for, and contents() decodes all the strings from one copy of their bytes.

The file's layout is checked first (gguf_layout), so the walk trusts the counts and lengths it
reads.
"""

from __future__ import annotations

import struct
from abc import abstractmethod
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor
from gguf.quants import quant_shape_to_byte_shape

from astrai.model.weights.gguf_layout import SCALAR_FORMATS

# The tensor types whose data GGUFReader gives as numbers; every other type's as bytes.
NUMBER_TENSOR_TYPES = {
    GGMLQuantizationType.F16: np.float16,
    GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64,
    GGMLQuantizationType.I8: np.int8,
    GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32,
    GGMLQuantizationType.I64: np.int64,
}


class GGUFFileReader:
    """The fields (key -> ReaderField, in file order) and tensors (ReaderTensor, their data
    views of the memory-mapped file) of a GGUF file whose layout gguf_layout has checked."""

    def __init__(self, path: str | Path) -> None:
        # A plain ndarray view of the mapping: slicing numpy's memmap subclass costs microseconds.
        self.data = np.memmap(path, mode="r").view(np.ndarray)
        self.order = "<"
        if self._get(4, np.uint32)[0] & 0xFFFF == 0:  # written for the other byte order
            self.order = ">"
        version = self._get(4, np.uint32)
        counts = self._get(8, np.uint64, 2)
        self.fields: dict[str, ReaderField] = {}
        for field in (
            ReaderField(4, "GGUF.version", [version], [0], [GGUFValueType.UINT32]),
            ReaderField(8, "GGUF.tensor_count", [counts[:1]], [0], [GGUFValueType.UINT64]),
            ReaderField(16, "GGUF.kv_count", [counts[1:]], [0], [GGUFValueType.UINT64]),
        ):
            self.fields[field.name] = field
        offset = 24
        for _ in range(int(counts[1])):
            field, offset = self._field(offset)
            self.fields[field.name] = field
        infos = []
        for _ in range(int(counts[0])):
            info, offset = self._tensor_info(offset)
            infos.append(info)
        alignment = self.fields.get("general.alignment")
        alignment = int(alignment.parts[-1][0]) if alignment else GGUF_DEFAULT_ALIGNMENT
        data_start = -(-offset // alignment) * alignment
        self.tensors = [self._tensor(info, data_start) for info in infos]

    def _get(self, offset: int, dtype, count: int = 1) -> np.ndarray:
        """count numbers of dtype at offset, in the file's byte order (a view)."""
        dtype = np.dtype(dtype).newbyteorder(self.order)
        return self.data[offset : offset + dtype.itemsize * count].view(dtype)

    def _string(self, offset: int) -> tuple[np.ndarray, np.ndarray]:
        """A string's parts at offset: its length (uint64 [1]) and its bytes."""
        length = self._get(offset, np.uint64)
        return length, self.data[offset + 8 : offset + 8 + int(length[0])]

    def _field(self, start: int) -> tuple[ReaderField, int]:
        """The key-value pair at start and the offset past it."""
        key_length, key = self._string(start)
        offset = start + 8 + key.size
        raw_type = self._get(offset, np.uint32)
        offset += 4
        kind = GGUFValueType(int(raw_type[0]))
        name = key.tobytes().decode("utf-8")
        head = [key_length, key, raw_type]
        if kind == GGUFValueType.STRING:
            length, text = self._string(offset)
            field = ReaderField(start, name, [*head, length, text], [4], [kind])
            return field, offset + 8 + text.size
        if kind != GGUFValueType.ARRAY:
            value = self._get(offset, SCALAR_FORMATS[kind])
            return ReaderField(start, name, [*head, value], [3], [kind]), offset + value.nbytes
        raw_item_type = self._get(offset, np.uint32)
        length = self._get(offset + 4, np.uint64)
        item_type = GGUFValueType(int(raw_item_type[0]))
        head += [raw_item_type, length]
        offset += 12
        if item_type == GGUFValueType.STRING:
            parts = _StringArrayParts(self, head, offset, int(length[0]))
            end = parts.starts[-1] - 8
        else:
            values = self._get(offset, SCALAR_FORMATS[item_type], int(length[0]))
            parts, end = _NumberArrayParts(head, values), offset + values.nbytes
        # GGUFReader names the item type only when the array has an item
        types = [kind, item_type] if length[0] else [kind]
        return _ArrayField(start, name, parts, parts.data_indices(), types), end

    def _tensor_info(self, start: int) -> tuple[ReaderField, int]:
        """The tensor table's entry at start, as GGUFReader keeps it, and the offset past it."""
        name_length, name = self._string(start)
        offset = start + 8 + name.size
        n_dims = self._get(offset, np.uint32)
        dims = self._get(offset + 4, np.uint64, int(n_dims[0]))
        offset += 4 + dims.nbytes
        raw_type = self._get(offset, np.uint32)
        data_offset = self._get(offset + 4, np.uint64)
        parts = [name_length, name, n_dims, dims, raw_type, data_offset]
        return ReaderField(start, name.tobytes().decode("utf-8"), parts, [1, 3, 4, 5]), offset + 12

    def _tensor(self, info: ReaderField, data_start: int) -> ReaderTensor:
        _, _, _, dims, raw_type, data_offset = info.parts
        tensor_type = GGMLQuantizationType(int(raw_type[0]))
        n_elements = int(np.prod(dims))
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        n_bytes = n_elements * block_bytes // block
        start = data_start + int(data_offset[0])
        shape = tuple(reversed(dims.tolist()))
        if tensor_type in NUMBER_TENSOR_TYPES:
            data = self._get(start, NUMBER_TENSOR_TYPES[tensor_type], n_elements)
        else:
            data = self._get(start, np.uint8, n_bytes)
            shape = quant_shape_to_byte_shape(shape, tensor_type)
        return ReaderTensor(
            name=info.name,
            tensor_type=tensor_type,
            shape=dims,
            n_elements=n_elements,
            n_bytes=n_bytes,
            data_offset=start,
            data=data.reshape(shape),
            field=info,
        )


class _ArrayField(ReaderField):
    """A metadata array's ReaderField, whose contents() its parts give in bulk."""

    __slots__ = ()

    def contents(self, index_or_slice: int | slice = slice(None)):
        return self.parts.contents(index_or_slice)


class _ArrayParts(Sequence):
    """GGUFReader's parts of a metadata array: the field's head parts, then the parts of its
    items, each made when asked for (item_part)."""

    head: list[np.ndarray]

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        index = range(len(self))[index]
        if index < len(self.head):
            return self.head[index]
        return self.item_part(index - len(self.head))

    @abstractmethod
    def item_part(self, index: int):
        """Part index of those after the head."""


class _NumberArrayParts(_ArrayParts):
    """An array of numbers: each item a part, an array of one from the view of them all
    (values)."""

    def __init__(self, head: list[np.ndarray], values: np.ndarray) -> None:
        self.head, self.values = head, values

    def __len__(self) -> int:
        return len(self.head) + len(self.values)

    def item_part(self, index: int):
        return self.values[index : index + 1]

    def data_indices(self) -> range:
        return range(len(self.head), len(self))

    def contents(self, index_or_slice: int | slice):
        return self.values[index_or_slice].tolist()


class _StringArrayParts(_ArrayParts):
    """An array of strings: each string's length and bytes two parts, from where the strings
    start."""

    def __init__(self, reader: GGUFFileReader, head: list[np.ndarray], offset: int, count: int):
        self.reader, self.head = reader, head
        # where each string's bytes start, and (last) where a string after them would
        data = reader.data
        length_at = struct.Struct(reader.order + "Q").unpack_from
        starts = []
        for _ in range(count):
            starts.append(offset + 8)
            offset += 8 + length_at(data, offset)[0]
        starts.append(offset + 8)
        self.starts = starts

    def __len__(self) -> int:
        return len(self.head) + 2 * (len(self.starts) - 1)

    def item_part(self, index: int):
        item, is_text = divmod(index, 2)
        start = self.starts[item]
        if is_text:
            return self.reader.data[start : self.starts[item + 1] - 8]
        return self.reader._get(start - 8, np.uint64)

    def data_indices(self) -> range:
        return range(len(self.head) + 1, len(self), 2)

    def contents(self, index_or_slice: int | slice):
        starts = self.starts
        if not isinstance(index_or_slice, slice):
            item = range(len(starts) - 1)[index_or_slice]
            return self.reader.data[starts[item] : starts[item + 1] - 8].tobytes().decode("utf-8")
        first = starts[0]
        text = self.reader.data[first : starts[-1]].tobytes()  # one copy of all the strings
        return [
            text[starts[i] - first : starts[i + 1] - 8 - first].decode("utf-8")
            for i in range(len(starts) - 1)[index_or_slice]
        ]
