"""Lying GGUF files against the loader: mutated headers, metadata and tensor tables of the real
SmolLM2 file and of a tiny quantized model, and files cut short at every section boundary.

Each case must be refused with an error that names the file, or load; a file that loads must
hold its tensors inside it, aligned and apart (as this test reads it), and a model that loads
after a mutation that changes nothing it is made of must equal the original. None may crash,
raise anything else, take 10 s or grow the process by a gigabyte. The cases are seeded: every
numeric field of the tiny file's header, metadata and tensor table twice, every boundary once,
and a sample of the real file's; ASTRAI_GGUF_FUZZ_CASES=N adds N random cases on each file.
"""

from __future__ import annotations

import itertools
import math
import os
import random
import re
import resource
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import pytest
import torch
from tiny_models import real_gguf, write_gguf, write_hf_model

from astrai.config import ConfigError
from astrai.model import AutoModel, CheckpointError

SEED = 45
EXTRA_CASES = int(os.environ.get("ASTRAI_GGUF_FUZZ_CASES", "0"))
CASE_SECONDS = 10
GROWTH_BYTES = 1 << 30
IDS = torch.tensor([[3, 17, 42, 99, 7, 250, 11, 64]])
Q = gguf.GGMLQuantizationType
# Types with a kernel and without (dequantized at load), so both paths read mutated tables.
TINY_TYPES = {
    "attn_q.weight": Q.Q4_0,
    "attn_k.weight": Q.Q8_0,
    "attn_output.weight": Q.Q4_1,
    "ffn_up.weight": Q.Q5_0,
    "ffn_down.weight": Q.Q5_1,
    "token_embd.weight": Q.Q8_0,
}
# Metadata the model is not made of: a file that loads with another value is the same model.
HARMLESS_KEYS = ("context_length", "general.", "tokenizer.")
NUMERIC_TYPES = {
    gguf.GGUFValueType[name]: width
    for name, width in (
        ("UINT8", 1), ("INT8", 1), ("UINT16", 2), ("INT16", 2), ("UINT32", 4), ("INT32", 4),
        ("FLOAT32", 4), ("BOOL", 1), ("UINT64", 8), ("INT64", 8), ("FLOAT64", 8),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Field:
    """A little-endian unsigned integer of width bytes at offset: a count, length, type id,
    dim, offset or numeric value of the file."""

    name: str
    offset: int
    width: int
    harmless: bool = False


def numeric_fields(reader: gguf.GGUFReader) -> list[Field]:
    """Every number of the file's header, metadata and tensor table, as the gguf package finds
    them in the original."""
    fields = [Field("version", 4, 4), Field("tensor count", 8, 8), Field("key count", 16, 8)]
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        at = [field.offset]  # where its first parts start: key length, key, type, value...
        for part in field.parts[:4]:
            at.append(at[-1] + part.nbytes)
        harmless = any(part in key for part in HARMLESS_KEYS)
        fields += [Field(f"{key}: key length", at[0], 8), Field(f"{key}: type", at[2], 4)]
        kind = field.types[0]
        if kind == gguf.GGUFValueType.STRING:
            fields.append(Field(f"{key}: string length", at[3], 8))
        elif kind == gguf.GGUFValueType.ARRAY:
            fields += [Field(f"{key}: item type", at[3], 4), Field(f"{key}: length", at[4], 8)]
        else:
            fields.append(Field(f"{key}: value", at[3], NUMERIC_TYPES[kind], harmless))
    for tensor in reader.tensors:
        at = [tensor.field.offset]
        for part in tensor.field.parts:
            at.append(at[-1] + part.nbytes)
        n_dims = len(tensor.shape)
        fields += [
            Field(f"{tensor.name}: name length", at[0], 8),
            Field(f"{tensor.name}: n_dims", at[2], 4),
            *(Field(f"{tensor.name}: dim {i}", at[3] + 8 * i, 8) for i in range(n_dims)),
            Field(f"{tensor.name}: type", at[4], 4),
            Field(f"{tensor.name}: offset", at[5], 8),
        ]
    return fields


def section_boundaries(reader: gguf.GGUFReader) -> list[int]:
    """Where the file's sections and items start and end: the cuts a truncation tries."""
    size = len(reader.data)
    cuts = {4, 8, 24, reader.data_offset, size - 1}
    for field in reader.fields.values():
        cuts |= {field.offset, field.offset + sum(p.nbytes for p in field.parts)}
    for tensor in reader.tensors:
        cuts |= {tensor.field.offset, tensor.data_offset, tensor.data_offset + tensor.n_bytes}
    return sorted(c for c in cuts if 0 < c < size)


def values_for(field: Field, original: int, rng: random.Random) -> int:
    """A value a liar would write: an edge of the field's range, the original moved a little
    or doubled, or noise."""
    top = (1 << (8 * field.width)) - 1
    candidates = [0, 1, original - 1, original + 1, original * 2, original // 2, top, top >> 1]
    candidates += [original + 3, original + 32, top - 63, rng.randrange(top + 1)]
    return min(max(rng.choice(candidates), 0), top)


@dataclass
class Outcome:
    refused: str | None
    equal: bool | None


class Fuzzer:
    """Loads mutated copies of one file; each outcome is checked as the module says."""

    def __init__(self, source: Path, work: Path, load) -> None:
        self.data = source.read_bytes()
        self.work = work
        self.load = load
        self.original = load(source)
        self.cases = 0

    def mutate(self, field: Field, value: int) -> Outcome:
        data = bytearray(self.data)
        original = int.from_bytes(data[field.offset : field.offset + field.width], "little")
        data[field.offset : field.offset + field.width] = value.to_bytes(field.width, "little")
        outcome = self.run(bytes(data), f"{field.name} {original} -> {value}")
        if outcome.equal is not None and (field.harmless or value == original):
            assert outcome.equal, f"{field.name}: {original} -> {value} changed the model"
        return outcome

    def truncate(self, size: int) -> Outcome:
        return self.run(self.data[:size], f"cut at byte {size}")

    def run(self, data: bytes, case: str) -> Outcome:
        self.cases += 1
        path = self.work / f"case{self.cases}.gguf"  # a new name: no reader cached for it
        path.write_bytes(data)
        started = time.monotonic()
        try:
            logits = self.load(path)
            assert_tensors_lie_apart_in_the_file(path, case)
        except (CheckpointError, ConfigError) as error:
            assert str(path) in str(error), f"{case}: the error does not name the file: {error}"
            return Outcome(str(error), None)
        finally:
            path.unlink()
            assert time.monotonic() - started < CASE_SECONDS, f"{case} took too long"
        return Outcome(None, torch.equal(logits, self.original))


def assert_tensors_lie_apart_in_the_file(path: Path, case: str) -> None:
    """What a loaded file must be, read here by the gguf package on its own: each tensor's
    bytes (from its dims, in Python's integers) inside the file, aligned, and apart."""
    reader = gguf.GGUFReader(path)
    regions = []
    for tensor in reader.tensors:
        block, block_bytes = gguf.GGML_QUANT_SIZES[tensor.tensor_type]
        size = math.prod(int(n) for n in tensor.shape) // block * block_bytes
        start = tensor.data_offset
        assert (start - reader.data_offset) % reader.alignment == 0, f"{case}: {tensor.name}"
        assert start + size <= len(reader.data), f"{case}: {tensor.name} runs past the end"
        regions.append((start, start + size, tensor.name))
    regions.sort()
    for (_, end, name), (start, _, following) in itertools.pairwise(regions):
        assert end <= start, f"{case}: {name} overlaps {following}"


def tiny_logits(path: Path) -> torch.Tensor:
    with torch.no_grad():
        return AutoModel.from_pretrained(path).forward_dense(IDS)


def real_logits(path: Path) -> torch.Tensor:
    with torch.no_grad():
        return AutoModel.from_pretrained(path).forward_dense(IDS[:, :4])


@pytest.fixture(scope="module")
def tiny_quantized(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("fuzz")
    hf_dir = write_hf_model(directory / "hf", "llama", seed=7, intermediate_size=256)
    return write_gguf(directory / "tiny.gguf", hf_dir, "llama", types=TINY_TYPES)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _fuzz(fuzzer: Fuzzer, fields: list[Field], cuts: list[int], rng: random.Random) -> list:
    peak = _peak_rss_bytes()
    outcomes = []
    for field in fields:
        original = int.from_bytes(fuzzer.data[field.offset : field.offset + field.width], "little")
        outcomes.append(fuzzer.mutate(field, values_for(field, original, rng)))
    outcomes += [fuzzer.truncate(cut) for cut in cuts]
    assert _peak_rss_bytes() - peak < GROWTH_BYTES
    return outcomes


# A tensor whose type was changed decodes its bytes as another type's: scales may be NaN.
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_every_field_and_cut_of_a_tiny_quantized_file_is_refused_or_harmless(
    tmp_path, tiny_quantized
):
    rng = random.Random(SEED)
    fuzzer = Fuzzer(tiny_quantized, tmp_path, tiny_logits)
    reader = gguf.GGUFReader(tiny_quantized)
    fields = numeric_fields(reader)
    fields = fields * 2 + rng.choices(fields, k=EXTRA_CASES)  # each field, two values
    outcomes = _fuzz(fuzzer, fields, section_boundaries(reader), rng)
    refused = [o.refused for o in outcomes if o.refused]
    # The checks before the gguf package parses the file and those of the loaded config both
    # turned lies away, and some mutations loaded (changed numbers the model is not made of).
    assert len(outcomes) > 300
    assert any("malformed GGUF file" in message for message in refused)
    assert any("llama.block_count" in message for message in refused)
    assert any(o.equal for o in outcomes)


@pytest.mark.slow
def test_a_sample_of_the_real_files_fields_and_cuts_is_refused_or_harmless(tmp_path):
    rng = random.Random(SEED)
    source = tmp_path / "smollm2.gguf"
    shutil.copyfile(real_gguf(), source)
    fuzzer = Fuzzer(source, tmp_path, real_logits)
    reader = gguf.GGUFReader(source)
    fields, cuts = numeric_fields(reader), section_boundaries(reader)
    outcomes = _fuzz(fuzzer, rng.sample(fields, 12 + EXTRA_CASES), rng.sample(cuts, 6), rng)
    assert any(o.refused for o in outcomes)


# -- the crafted copies of the real file that astrai once ran on garbage ----------------------


def _tensor_field(reader, name: str, part: int) -> int:
    tensor = next(t for t in reader.tensors if t.name == name)
    return tensor.field.offset + sum(p.nbytes for p in tensor.field.parts[:part])


def _patched(tmp_path: Path, name: str, patches: list[tuple[int, bytes]]) -> Path:
    data = bytearray(real_gguf().read_bytes())
    for offset, value in patches:
        data[offset : offset + len(value)] = value
    path = tmp_path / f"{name}.gguf"
    path.write_bytes(bytes(data))
    return path


@pytest.fixture(scope="module")
def real_reader():
    return gguf.GGUFReader(real_gguf())


TYPE_PART, OFFSET_PART = 4, 5
Q8_0 = struct.pack("<I", int(Q.Q8_0))


def _last_q4_1(reader) -> str:
    q4_1 = [t for t in reader.tensors if t.tensor_type == Q.Q4_1]
    return max(q4_1, key=lambda t: t.data_offset).name


@pytest.mark.slow
@pytest.mark.parametrize(
    "case, expected",
    [
        ("overlap", r"tensor 'blk\.0\.attn_q\.weight' ends at offset \d+ .* their bytes overlap"),
        ("past-the-end", r"tensor 'blk\.9\.attn_v\.weight' \(Q8_0.* ends past the data section"),
        ("wrapping-offset", r"at offset 18446744073709551552\) ends past the data section"),
        ("misaligned", r"starts at offset \d+ of the data section, expected a multiple of .* 32"),
    ],
)
def test_crafted_tensor_tables_are_refused_naming_file_and_tensor(
    tmp_path, real_reader, case, expected
):
    first = "blk.0.attn_q.weight"
    offset_at = _tensor_field(real_reader, first, OFFSET_PART)
    data_offset = struct.unpack_from("<Q", real_gguf().read_bytes(), offset_at)[0]
    patches = {
        "overlap": [(_tensor_field(real_reader, first, TYPE_PART), Q8_0)],
        "past-the-end": [(_tensor_field(real_reader, _last_q4_1(real_reader), TYPE_PART), Q8_0)],
        "wrapping-offset": [(offset_at, struct.pack("<Q", 2**64 - 64))],
        "misaligned": [(offset_at, struct.pack("<Q", data_offset + 3))],
    }[case]
    path = _patched(tmp_path, case, patches)
    with pytest.raises(
        CheckpointError, match=f"malformed GGUF file {re.escape(str(path))}: .*{expected}"
    ):
        AutoModel.from_pretrained(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "key, value, expected",
    [
        ("block_count", 1_000_000, "block_count = 1000000, but the file holds .* blocks 0 to 29"),
        ("attention.head_count", 0, "attention.head_count = 0, expected 1 to 49152"),
        ("attention.head_count_kv", 4, "attention.head_count = 9 is not a multiple of .*_kv = 4"),
        ("context_length", 0, "context_length = 0, expected 1"),
    ],
)
def test_crafted_architecture_numbers_are_refused_at_once_naming_file_and_key(
    tmp_path, real_reader, key, value, expected
):
    field = real_reader.fields[f"llama.{key}"]
    at = field.offset + sum(p.nbytes for p in field.parts[:3])
    path = _patched(tmp_path, "lying", [(at, struct.pack("<I", value))])
    started = time.monotonic()
    with pytest.raises(ConfigError, match=f"GGUF file {re.escape(str(path))}: llama.{expected}"):
        AutoModel.from_pretrained(path)
    assert time.monotonic() - started < 5  # refused before a layer is built
