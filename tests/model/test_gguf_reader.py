"""astrai's GGUF header reader (astrai/model/weights/gguf_reader.py) against the gguf package's
GGUFReader, the reference: every field's offset, name, types, parts, data indices and contents,
and every tensor, on the real SmolLM2 file and on small written files of every value type in
either byte order."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from tiny_models import real_gguf

from astrai.model.weights.gguf_reader import GGUFFileReader

V = gguf.GGUFValueType
Q8_0 = gguf.GGMLQuantizationType.Q8_0
NUMBER_ARRAYS = {
    V.UINT8: np.uint8,
    V.INT8: np.int8,
    V.UINT16: np.uint16,
    V.INT16: np.int16,
    V.UINT32: np.uint32,
    V.INT32: np.int32,
    V.FLOAT32: np.float32,
    V.UINT64: np.uint64,
    V.INT64: np.int64,
    V.FLOAT64: np.float64,
    V.BOOL: np.bool_,
}


def same_array(ours: np.ndarray, reference: np.ndarray) -> bool:
    return (
        ours.dtype == reference.dtype
        and ours.shape == reference.shape
        and np.array_equal(ours, reference)
    )


def same_field(ours, reference) -> None:
    name = reference.name
    assert (ours.offset, ours.name, ours.types) == (reference.offset, name, reference.types)
    assert list(ours.data) == list(reference.data), name
    assert len(ours.parts) == len(reference.parts), name
    for at, part in enumerate(reference.parts):
        assert same_array(ours.parts[at], part), (name, at)
    assert ours.contents() == reference.contents(), name
    if len(reference.data) > 2 and reference.types[:1] == [V.ARRAY]:
        for which in (0, -1, slice(1, None, 2)):
            assert ours.contents(which) == reference.contents(which), (name, which)


def assert_reads_as_gguf(path) -> None:
    """GGUFFileReader gives path's fields and tensors exactly as GGUFReader does."""
    ours, reference = GGUFFileReader(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(reference.fields)
    for key, field in reference.fields.items():
        same_field(ours.fields[key], field)
    assert [t.name for t in ours.tensors] == [t.name for t in reference.tensors]
    for tensor, expected in zip(ours.tensors, reference.tensors, strict=True):
        numbers = ("tensor_type", "n_elements", "n_bytes", "data_offset")
        assert [getattr(tensor, n) for n in numbers] == [getattr(expected, n) for n in numbers]
        assert same_array(tensor.shape, expected.shape), expected.name
        assert same_array(tensor.data, expected.data), expected.name
        same_field(tensor.field, expected.field)


@pytest.mark.slow
def test_the_real_file_reads_as_gguf_reads_it():
    assert_reads_as_gguf(real_gguf())


@pytest.mark.parametrize("endianess", list(gguf.GGUFEndian), ids=lambda e: e.name)
def test_every_value_type_reads_as_gguf_reads_it(tmp_path, endianess):
    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(path, "llama", endianess=endianess)
    writer.add_uint32("general.alignment", 64)
    for kind, dtype in NUMBER_ARRAYS.items():
        values = np.arange(-3, 4).astype(dtype)
        writer.add_key_value(f"scalar.{kind.name}", values[-1].item(), kind)
        writer.add_key_value(f"array.{kind.name}", values.tolist(), V.ARRAY, sub_type=kind)
    writer.add_string("text", "héllo ✓")
    writer.add_array("strings", ["", "a b", "日本語", "<|im_end|>", "x" * 300])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal(7).astype(np.float16))
    writer.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    q8 = gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32), Q8_0)
    writer.add_tensor("q8_0", q8, raw_dtype=Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_reads_as_gguf(path)
    # the reader read what was written, not merely what GGUFReader makes of it
    reader = GGUFFileReader(path)
    assert reader.fields["strings"].contents() == ["", "a b", "日本語", "<|im_end|>", "x" * 300]
    assert reader.fields["array.INT16"].contents() == [-3, -2, -1, 0, 1, 2, 3]
    assert reader.tensors[2].data.tolist() == [[0, 1, 2], [3, 4, 5]]
