"""A GGUF file's layout checked before the gguf package parses it or a kernel reads its tensors.

A model file is untrusted input. The gguf package's GGUFReader believes what a file says: it
loops over an array's stated length past the end of the file, multiplies a tensor's dims
in 64 bits that wrap, and maps a tensor's bytes wherever its offset points, over the metadata,
over the next tensor or past the end of the mapping. Here every count and length is checked
against the bytes left before anything is read for it, and every tensor's region, computed in
Python's unbounded integers, against the data section, the alignment and the other tensors.
A refusal is a CheckpointError that names the file, the field and what was expected.
"""

from __future__ import annotations

import itertools
import mmap
import struct
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType, GGUFValueType

from astrai.model.checkpoint import CheckpointError

VERSIONS = (2, 3)  # the versions GGUFReader reads
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
SCALAR_FORMATS = {
    GGUFValueType.UINT8: "B",
    GGUFValueType.INT8: "b",
    GGUFValueType.UINT16: "H",
    GGUFValueType.INT16: "h",
    GGUFValueType.UINT32: "I",
    GGUFValueType.INT32: "i",
    GGUFValueType.FLOAT32: "f",
    GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "Q",
    GGUFValueType.INT64: "q",
    GGUFValueType.FLOAT64: "d",
}
# The fewest bytes a key-value pair (empty key, a uint8) and a tensor's info (empty name, no
# dims) can take: a count larger than the bytes left allow is a lie, refused before the loop.
MIN_KV_BYTES = 8 + 4 + 1
MIN_TENSOR_INFO_BYTES = 8 + 4 + 4 + 8


def check_gguf_layout(path: str) -> None:
    """Raise a CheckpointError unless path is a GGUF file whose header can be parsed within the
    file and whose tensors lie, aligned and apart, inside its data section."""
    with open(path, "rb") as file:
        size = Path(path).stat().st_size
        if size == 0:
            raise CheckpointError(f"GGUF file {path} is empty; download it again")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            _Layout(path, data).check()


class _Layout:
    """A walk through one file's header: a cursor that refuses to step past the end."""

    def __init__(self, path: str, data: mmap.mmap) -> None:
        self.path = path
        self.data = data
        self.offset = 0
        self.order = "<"
        self.alignment = GGUF_DEFAULT_ALIGNMENT

    def refuse(self, problem: str) -> CheckpointError:
        return CheckpointError(
            f"malformed GGUF file {self.path}: {problem}; the file is corrupt, truncated or "
            "crafted: download it again"
        )

    def read(self, fmt: str, what: str) -> tuple:
        size = struct.calcsize(self.order + fmt)
        if self.offset + size > len(self.data):
            raise self.refuse(
                f"{what} at byte {self.offset} runs past the end of the file "
                f"({len(self.data)} bytes)"
            )
        values = struct.unpack_from(self.order + fmt, self.data, self.offset)
        self.offset += size
        return values

    def skip(self, count: int, what: str) -> None:
        if count > len(self.data) - self.offset:
            raise self.refuse(
                f"{what} states {count} bytes at byte {self.offset}, but only "
                f"{len(self.data) - self.offset} are left in the file"
            )
        self.offset += count

    def string(self, what: str) -> str:
        (length,) = self.read("Q", f"the length of {what}")
        start = self.offset
        self.skip(length, what)
        try:
            return self.data[start : self.offset].decode("utf-8")
        except UnicodeDecodeError:
            raise self.refuse(f"{what} at byte {start} is not UTF-8") from None

    def skip_strings(self, count: int, key: str) -> None:
        """Step over an array's count strings (a vocabulary's hundred thousand: kept tight)."""
        data, offset, end = self.data, self.offset, len(self.data)
        length_at = struct.Struct(self.order + "Q").unpack_from
        for index in range(count):
            length = length_at(data, offset)[0] if offset + 8 <= end else end
            offset += 8 + length
            if offset > end:
                raise self.refuse(f"item {index} of array {key!r} runs past the end of the file")
        self.offset = offset

    def count(self, what: str, least_bytes: int) -> int:
        """A stated number of items, each at least least_bytes long, that fit in the file."""
        (count,) = self.read("Q", what)
        left = len(self.data) - self.offset
        if count * least_bytes > left:
            raise self.refuse(
                f"{what} is {count}, but the {left} bytes left in the file hold at most "
                f"{left // least_bytes}"
            )
        return count

    def value_type(self, what: str) -> GGUFValueType:
        (raw,) = self.read("I", what)
        try:
            return GGUFValueType(raw)
        except ValueError:
            names = ", ".join(t.name for t in GGUFValueType)
            raise self.refuse(f"{what} is {raw}, not a GGUF value type ({names})") from None

    def check(self) -> None:
        if bytes(self.data[:4]) != b"GGUF":
            raise self.refuse(f"it starts with {bytes(self.data[:4])!r}, not the magic b'GGUF'")
        self.offset = 4
        (version,) = self.read("I", "the version")
        if version & 0xFFFF == 0:  # written for the other byte order, as GGUFReader reads it
            self.order = ">"
            version = int.from_bytes(version.to_bytes(4, "little"), "big")
        if version not in VERSIONS:
            raise self.refuse(f"version {version}: astrai reads GGUF versions {VERSIONS}")
        n_tensors = self.count("the tensor count", MIN_TENSOR_INFO_BYTES)
        n_keys = self.count("the metadata key count", MIN_KV_BYTES)
        keys = set()
        for _ in range(n_keys):
            key = self.string("a metadata key")
            if key in keys:
                raise self.refuse(f"metadata key {key!r} appears twice")
            keys.add(key)
            self.metadata_value(key)
        tensors = [self.tensor_info() for _ in range(n_tensors)]
        data_start = -(-self.offset // self.alignment) * self.alignment
        self.check_regions(tensors, data_start)

    def metadata_value(self, key: str) -> None:
        kind = self.value_type(f"the type of metadata key {key!r}")
        if kind == GGUFValueType.STRING:
            self.string(f"the value of {key!r}")
        elif kind == GGUFValueType.ARRAY:
            item = self.value_type(f"the item type of array {key!r}")
            if item == GGUFValueType.ARRAY:
                raise self.refuse(
                    f"metadata key {key!r} holds nested arrays, which astrai does not read"
                )
            if item == GGUFValueType.STRING:
                self.skip_strings(self.count(f"the length of array {key!r}", 8), key)
            else:
                item_bytes = struct.calcsize(SCALAR_FORMATS[item])
                length = self.count(f"the length of array {key!r}", item_bytes)
                self.offset += length * item_bytes
        elif key == "general.alignment":
            if kind != GGUFValueType.UINT32:
                raise self.refuse(f"general.alignment is a {kind.name}, expected a UINT32")
            (alignment,) = self.read("I", "general.alignment")
            if alignment == 0 or alignment & (alignment - 1):
                raise self.refuse(f"general.alignment is {alignment}, expected a power of two")
            self.alignment = alignment
        else:
            self.read(SCALAR_FORMATS[kind], f"the value of {key!r}")

    def tensor_info(self) -> tuple[str, GGMLQuantizationType, list[int], int]:
        """One entry of the tensor table: (name, type, dims innermost first, offset in the data
        section)."""
        name = self.string("a tensor name")
        (n_dims,) = self.read("I", f"the number of dims of tensor {name!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            raise self.refuse(f"tensor {name!r} has {n_dims} dims, expected 1 to {MAX_DIMS}")
        dims = list(self.read(f"{n_dims}Q", f"the dims of tensor {name!r}"))
        (raw_type, offset) = self.read("IQ", f"the type and offset of tensor {name!r}")
        if any(dim == 0 for dim in dims):
            raise self.refuse(f"tensor {name!r} has dims {dims}, expected every dim positive")
        try:
            tensor_type = GGMLQuantizationType(raw_type)
        except ValueError:
            raise self.refuse(f"tensor {name!r} has type {raw_type}, not a GGML type") from None
        block = GGML_QUANT_SIZES[tensor_type][0]
        if dims[0] % block:
            raise self.refuse(
                f"tensor {name!r} of type {tensor_type.name} has rows of {dims[0]} weights, "
                f"expected a multiple of its blocks of {block}"
            )
        return name, tensor_type, dims, offset

    def check_regions(self, tensors: list, data_start: int) -> None:
        """Each tensor's bytes inside the data section, aligned, and no two overlapping."""
        names, regions = set(), []
        data_bytes = len(self.data) - data_start
        for name, tensor_type, dims, offset in tensors:
            if name in names:
                raise self.refuse(f"tensor {name!r} appears twice in the tensor table")
            names.add(name)
            block, block_bytes = GGML_QUANT_SIZES[tensor_type]
            elements = 1
            for dim in dims:
                elements *= dim
            size = elements // block * block_bytes
            if offset % self.alignment:
                raise self.refuse(
                    f"tensor {name!r} starts at offset {offset} of the data section, expected "
                    f"a multiple of the alignment {self.alignment}"
                )
            if offset + size > data_bytes:
                raise self.refuse(
                    f"tensor {name!r} ({tensor_type.name}, dims {dims}: {size} bytes at offset "
                    f"{offset}) ends past the data section's {data_bytes} bytes"
                )
            regions.append((offset, offset + size, name))
        regions.sort()
        for (_, end, name), (start, _, following) in itertools.pairwise(regions):
            if start < end:
                raise self.refuse(
                    f"tensor {name!r} ends at offset {end} of the data section, past the start "
                    f"{start} of tensor {following!r}: their bytes overlap"
                )
