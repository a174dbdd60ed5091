"""GGUF's quantized block types as the quant_linear kernel reads them: decoded with the gguf
package's own arithmetic, and packed into 16-row records (csrc/quant_linear.c draws the layout).

Every type is one row of BLOCK_TYPES (ggml's type traits): its sizes, its scale fields, and the
functions that decode its GGUF bytes, dequantize its fields and pack and unpack its codes.
gguf_fields, dense_weight, pack_blocks and packed_fields look the row up, so no caller
switches on the type and adding a type is adding a row.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K

# Rows of W in one packed record (csrc/quant_linear.c describes the layout).
GROUP = 16
BLOCK = 32
Q = GGMLQuantizationType

Fields = dict[str, np.ndarray]


class _Records:
    """Packed records uint8 [groups, units, record bytes] read back one part at a time, in
    record order."""

    def __init__(self, packed: np.ndarray):
        self.packed, self.at = packed, 0
        self.groups, self.units, _ = packed.shape

    def take(self, nbytes: int, inner: tuple, group_axis: int, dtype=np.uint8) -> np.ndarray:
        """The next nbytes of each record as [groups, units, *inner], its GROUP axis (at
        group_axis) made rows: [groups * GROUP, units, *inner without it]."""
        part = self.packed[..., self.at : self.at + nbytes].copy().view(dtype)
        self.at += nbytes
        part = np.moveaxis(part.reshape(self.groups, self.units, *inner), group_axis, 1)
        return part.reshape(self.groups * GROUP, *part.shape[2:])


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type: 32-blocks per unit (a K type's super-block), the scale fields a
    unit keeps per row ((name, dtype, count), in record order), and its functions:

    codes: GGUF blocks uint8 [rows * units, block bytes] -> codes u (uint8, 32 per 32-block;
        Q8_0: its int8 bytes), as the gguf package reads them
    scales: GGUF blocks uint8 [rows * units, block bytes] -> each scale field
    dequantize: fields [rows, ...] -> W [rows, in] fp32, in the gguf package's fp32 operations
    pack_codes: GGUF blocks uint8 [rows, units, unit bytes] (rows whole groups) -> the records'
        code parts, each [groups, units, ...]
    unpack_codes: the records and unit_blocks -> u [groups * GROUP, units, blocks, 32]
    """

    qtype: GGMLQuantizationType
    unit_blocks: int
    fields: tuple[tuple[str, type, int], ...]
    codes: Callable[[np.ndarray], np.ndarray]
    scales: Callable[[np.ndarray], Fields]
    dequantize: Callable[[Fields], np.ndarray]
    pack_codes: Callable[[np.ndarray], list[np.ndarray]]
    unpack_codes: Callable[[_Records, int], np.ndarray]

    @property
    def unit_weights(self) -> int:
        return BLOCK * self.unit_blocks


def _halves(b: np.ndarray, at: int) -> np.ndarray:
    """The fp16 value at byte `at` of each block."""
    return b[:, at : at + 2].copy().view(np.float16)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """GGUF's 16 bytes per 32 weights as codes: element k in byte k's low nibble, k + 16 in
    its high one."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _per_weight(scale: np.ndarray, weights: int) -> np.ndarray:
    """A scale per `weights` weights as a scale for every weight, fp32 [rows, in]."""
    return np.repeat(scale.astype(np.float32).reshape(scale.shape[0], -1), weights, axis=1)


def _codes(fields: Fields) -> np.ndarray:
    """Codes u as fp32 [rows, in]."""
    return fields["u"].reshape(fields["u"].shape[0], -1).astype(np.float32)


def _to_records(x: np.ndarray) -> np.ndarray:
    """[rows, units, ...] -> [groups, units, GROUP, ...], a view (rows are whole groups)."""
    return np.moveaxis(x.reshape(-1, GROUP, *x.shape[1:]), 1, 2)


def _pack_bytes(u: np.ndarray) -> list[np.ndarray]:
    """Byte codes u [rows, units, 32] (Q8_0) as [groups, units, chunk t, GROUP, 4]: bytes 4 t..
    of each row."""
    rows, units = u.shape[:2]
    return [np.moveaxis(_to_records(u.reshape(rows, units, 8, 4)), 2, 3)]


def _unpack_bytes(records: _Records, unit_blocks: int) -> np.ndarray:
    return records.take(512, (8, GROUP, 4), 3).reshape(-1, records.units, 1, 32)


def _pack_nibbles(u: np.ndarray) -> list[np.ndarray]:
    """4-bit codes u [rows, units, blocks, 32] (the low 4 bits of wider ones) as
    _pack_nibble_bytes packs them."""
    rows, units = u.shape[:2]
    return _pack_nibble_bytes(
        ((u[..., :16] & 15) | (u[..., 16:] & 15) << 4).reshape(rows, units, -1)
    )


def _pack_nibble_bytes(qs: np.ndarray) -> list[np.ndarray]:
    """4-bit codes stored as GGUF's Q4_0 stores a block's, 16 bytes per 32 elements [rows, units,
    blocks * 16] (element k in byte k's low nibble, k + 16 in its high one), as [groups, units,
    blocks, chunk t, GROUP, 4]: bytes 4 t.. of each row's block, as they are."""
    rows, units = qs.shape[:2]
    return [np.moveaxis(_to_records(qs.reshape(rows, units, -1, 4, 4)), 2, 4)]


def _packed_from_codes(codes: Callable, pack: Callable) -> Callable:
    """pack_codes for a type whose records cut its codes u otherwise than its GGUF bytes do:
    the blocks decoded to u, which pack packs."""

    def pack_codes(b: np.ndarray) -> list[np.ndarray]:
        rows, units = b.shape[:2]
        return pack(codes(b.reshape(rows * units, -1)).reshape(rows, units, -1, 32))

    return pack_codes


def _unpack_nibbles(records: _Records, unit_blocks: int) -> np.ndarray:
    codes = records.take(256 * unit_blocks, (unit_blocks, 4, GROUP, 4), 4)
    codes = codes.reshape(-1, records.units, unit_blocks, 16)
    return np.concatenate([codes & 15, codes >> 4], axis=-1)


def _or_over(bits: np.ndarray, axes: tuple[int, ...]) -> np.ndarray:
    """bits ORed together along axes (numpy's bitwise_or.reduce over several axes is slow)."""
    for axis in sorted(axes, reverse=True):
        bits = functools.reduce(np.bitwise_or, np.moveaxis(bits, axis, 0))
    return bits


def _q5_high_bit_shifts() -> np.ndarray:
    """Q5_0: where element 16 h + 4 t + i's high bit lies in byte i of its chunk, as a shift
    [h, t, 1]."""
    return (np.arange(4).reshape(1, 4, 1) + 4 * np.arange(2).reshape(2, 1, 1)).astype(np.uint8)


def _q6_high_bit_shifts() -> np.ndarray:
    """Q6_K: where element 16 h + 4 (2 p + w) + i's 2 high bits lie in byte i of chunk p,
    as a shift [h, 1, w, 1] (csrc/quant_linear.c draws the layout)."""
    h, w = np.arange(2).reshape(2, 1, 1, 1), np.arange(2).reshape(1, 1, 2, 1)
    return (2 * (2 * w + h)).astype(np.uint8)


def _scales_d(b: np.ndarray) -> Fields:
    """One fp16 scale d per block, at its start (Q8_0, Q4_0, Q5_0)."""
    return {"d": _halves(b, 0)}


def _pack_q8_0(b: np.ndarray) -> list[np.ndarray]:
    return _pack_bytes(b[..., 2:])


def _dequantize_q8_0(fields: Fields) -> np.ndarray:
    u = fields["u"]
    return _per_weight(fields["d"], 32) * u.view(np.int8).reshape(u.shape[0], -1).astype(np.float32)


def _pack_q4_0(b: np.ndarray) -> list[np.ndarray]:
    return _pack_nibble_bytes(b[..., 2:])


def _dequantize_q4_0(fields: Fields) -> np.ndarray:
    return _per_weight(fields["d"], 32) * (_codes(fields) - 8)


def _scales_q4_1(b: np.ndarray) -> Fields:
    return {"d": _halves(b, 0), "m": _halves(b, 2)}


def _pack_q4_1(b: np.ndarray) -> list[np.ndarray]:
    return _pack_nibble_bytes(b[..., 4:])


def _dequantize_q4_1(fields: Fields) -> np.ndarray:
    return _per_weight(fields["d"], 32) * _codes(fields) + _per_weight(fields["m"], 32)


def _codes_q5_0(b: np.ndarray) -> np.ndarray:
    high = b[:, 2:6].copy().view("<u4") >> np.arange(32, dtype=np.uint32) & 1  # bit k: element k
    return _nibbles(b[:, 6:]) | high.astype(np.uint8) << 4


def _dequantize_q5_0(fields: Fields) -> np.ndarray:
    return _per_weight(fields["d"], 32) * (_codes(fields) - 16)


def _pack_q5_0(u: np.ndarray) -> list[np.ndarray]:
    """The low 4 bits as nibbles, then the high bits as [groups, units, GROUP, 4]."""
    rows, units = u.shape[:2]
    high = (u >> 4).reshape(rows, units, 2, 4, 4)  # [.., h, t, i]
    bits = _or_over(high << _q5_high_bit_shifts(), (2, 3))
    return [*_pack_nibbles(u), _to_records(bits)]


def _unpack_q5_0(records: _Records, unit_blocks: int) -> np.ndarray:
    u = _unpack_nibbles(records, unit_blocks)
    bits = records.take(64, (GROUP, 4), 2).reshape(-1, records.units, 1, 1, 1, 4)
    return u | ((bits >> _q5_high_bit_shifts()) & 1).reshape(-1, records.units, 1, 32) << 4


def _codes_q4_k(b: np.ndarray) -> np.ndarray:
    """64 weights per 32 bytes of qs: low nibbles first, then high."""
    return _nibbles(b[:, 16:].reshape(-1, 4, 32))


def _scales_q4_k(b: np.ndarray) -> Fields:
    sc, mn = Q4_K.get_scale_min(b[:, 4:16])
    return {"sc": sc, "mn": mn, "d": _halves(b, 0), "dmin": _halves(b, 2)}


def _dequantize_q4_k(fields: Fields) -> np.ndarray:
    d = fields["d"].astype(np.float32) * fields["sc"]
    dmin = fields["dmin"].astype(np.float32) * fields["mn"]
    return _per_weight(d, 32) * _codes(fields) - _per_weight(dmin, 32)


def _codes_q6_k(b: np.ndarray) -> np.ndarray:
    """128 weights per 64 bytes of ql (4 low bits) and 32 of qh (2 high bits)."""
    ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    return (ql & 15).reshape(-1, 8, 32) | (qh & 3).reshape(-1, 8, 32) << 4


def _scales_q6_k(b: np.ndarray) -> Fields:
    return {"sc": b[:, 192:208].view(np.int8), "d": _halves(b, 208)}


def _dequantize_q6_k(fields: Fields) -> np.ndarray:
    return _per_weight(fields["d"].astype(np.float32) * fields["sc"], 16) * (_codes(fields) - 32)


def _pack_q6_k(u: np.ndarray) -> list[np.ndarray]:
    """The low 4 bits as nibbles, then the high 2 bits as [groups, units, blocks, chunk p,
    GROUP, 4]."""
    rows, units = u.shape[:2]
    high = (u >> 4).reshape(rows, units, 8, 2, 2, 2, 4)  # [.., h, p, w, i]
    bits = _or_over(high << _q6_high_bit_shifts(), (3, 5))
    return [*_pack_nibbles(u), np.moveaxis(_to_records(bits), 2, 4)]


def _unpack_q6_k(records: _Records, unit_blocks: int) -> np.ndarray:
    u = _unpack_nibbles(records, unit_blocks)
    bits = records.take(1024, (8, 2, GROUP, 4), 4)  # [.., blocks, p, i]
    bits = bits.reshape(-1, records.units, 8, 1, 2, 1, 4)
    return u | ((bits >> _q6_high_bit_shifts()) & 3).reshape(-1, records.units, 8, 32) << 4


BLOCK_TYPES = {
    t.qtype: t
    for t in (
        BlockType(
            Q.Q8_0,
            unit_blocks=1,
            fields=(("d", np.float16, 1),),
            codes=lambda b: b[:, 2:],
            scales=_scales_d,
            dequantize=_dequantize_q8_0,
            pack_codes=_pack_q8_0,
            unpack_codes=_unpack_bytes,
        ),
        BlockType(
            Q.Q4_0,
            unit_blocks=1,
            fields=(("d", np.float16, 1),),
            codes=lambda b: _nibbles(b[:, 2:]),
            scales=_scales_d,
            dequantize=_dequantize_q4_0,
            pack_codes=_pack_q4_0,
            unpack_codes=_unpack_nibbles,
        ),
        BlockType(
            Q.Q4_1,
            unit_blocks=1,
            fields=(("d", np.float16, 1), ("m", np.float16, 1)),
            codes=lambda b: _nibbles(b[:, 4:]),
            scales=_scales_q4_1,
            dequantize=_dequantize_q4_1,
            pack_codes=_pack_q4_1,
            unpack_codes=_unpack_nibbles,
        ),
        BlockType(
            Q.Q5_0,
            unit_blocks=1,
            fields=(("d", np.float16, 1),),
            codes=_codes_q5_0,
            scales=_scales_d,
            dequantize=_dequantize_q5_0,
            pack_codes=_packed_from_codes(_codes_q5_0, _pack_q5_0),
            unpack_codes=_unpack_q5_0,
        ),
        BlockType(
            Q.Q4_K,
            unit_blocks=8,
            fields=(
                ("sc", np.uint8, 8),
                ("mn", np.uint8, 8),
                ("d", np.float16, 1),
                ("dmin", np.float16, 1),
            ),
            codes=_codes_q4_k,
            scales=_scales_q4_k,
            dequantize=_dequantize_q4_k,
            pack_codes=_packed_from_codes(_codes_q4_k, _pack_nibbles),
            unpack_codes=_unpack_nibbles,
        ),
        BlockType(
            Q.Q6_K,
            unit_blocks=8,
            fields=(("sc", np.int8, 16), ("d", np.float16, 1)),
            codes=_codes_q6_k,
            scales=_scales_q6_k,
            dequantize=_dequantize_q6_k,
            pack_codes=_packed_from_codes(_codes_q6_k, _pack_q6_k),
            unpack_codes=_unpack_q6_k,
        ),
    )
}


def gguf_fields(blocks: np.ndarray, qtype, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """W's GGUF blocks decoded: codes "u" uint8 [rows, in / 32, 32] (Q8_0: its int8 bytes),
    and each scale field [rows, units, count], as the gguf package reads them."""
    kind = BLOCK_TYPES[qtype]
    rows, units = shape[0], shape[1] // kind.unit_weights
    blocks = np.asarray(blocks, np.uint8).reshape(rows * units, -1)
    fields = {"u": kind.codes(blocks), **kind.scales(blocks)}
    return {
        name: field.reshape(rows, -1, 32) if name == "u" else field.reshape(rows, units, -1)
        for name, field in fields.items()
    }


def dense_weight(fields: dict[str, np.ndarray], qtype) -> np.ndarray:
    """W [rows, in] in fp32 from its fields, in the gguf package's fp32 operations."""
    return BLOCK_TYPES[qtype].dequantize(fields)


def pack_blocks(blocks: np.ndarray, qtype, shape: tuple[int, int]) -> np.ndarray:
    """GGUF blocks of W [out_features, in_features] (any uint8 array holding them in order) as
    the kernel's records: uint8 [groups, units, record bytes]: the type's code parts, then its
    scale fields, each [groups, units, count, GROUP]. The last group's missing rows are zero."""
    kind = BLOCK_TYPES[qtype]
    rows, units = shape[0], shape[1] // kind.unit_weights
    groups = -(-rows // GROUP)
    blocks = np.asarray(blocks, np.uint8).reshape(rows, -1)
    if rows % GROUP:  # zero blocks decode to zero codes and scales
        blocks = np.concatenate(
            [blocks, np.zeros((groups * GROUP - rows, blocks.shape[1]), np.uint8)]
        )
    parts = kind.pack_codes(blocks.reshape(groups * GROUP, units, -1))
    scales = kind.scales(blocks.reshape(groups * GROUP * units, -1))
    for name, dtype, _ in kind.fields:
        field = scales[name].astype(dtype, copy=False).reshape(groups * GROUP, units, -1)
        parts.append(np.moveaxis(_to_records(field), 2, 3))
    packed = np.empty((groups, units, sum(p[0, 0].nbytes for p in parts)), np.uint8)
    at = 0
    for part in parts:
        size = part[0, 0].nbytes
        _put(packed[..., at : at + size], part)
        at += size
    return packed


def _put(target: np.ndarray, part: np.ndarray) -> None:
    """Write part [groups, units, ...] into target, uint8 [groups, units, its bytes per unit],
    in part's order. Runs of 4 bytes move as one uint32: numpy copies single bytes slowly."""
    if part.dtype == np.uint8 and part.shape[-1] == 4 and part.strides[-1] == 1:
        part = part.view(np.uint32)[..., 0]
    target.view(part.dtype).reshape(part.shape)[...] = part


def packed_fields(packed: np.ndarray, qtype, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """pack_blocks undone: the fields gguf_fields gives."""
    kind = BLOCK_TYPES[qtype]
    records, rows = _Records(packed), shape[0]
    u = kind.unpack_codes(records, kind.unit_blocks)
    fields = {"u": u.reshape(records.groups * GROUP, -1, 32)[:rows]}
    for name, dtype, count in kind.fields:
        nbytes = count * GROUP * np.dtype(dtype).itemsize
        fields[name] = records.take(nbytes, (count, GROUP), 3, dtype)[:rows]
    return fields
