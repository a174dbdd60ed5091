"""GGUF's quantized block types as the quant_linear kernel reads them: decoded with the gguf
package's own arithmetic, and packed into 16-row records (csrc/quant_linear.c draws the layout).

Every type is one row of BLOCK_TYPES (units, scale fields); packing and unpacking are written
once over those fields, so a caller never switches on the type.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import Q4_K

# Rows of W in one packed record (csrc/quant_linear.c describes the layout).
GROUP = 16
BLOCK = 32
Q = GGMLQuantizationType


@dataclass(frozen=True)
class BlockType:
    """One GGUF block type as the kernel packs it: 32-blocks per unit (a K type's super-block),
    and the scale fields a unit keeps per row: (name, dtype, count), in record order."""

    qtype: GGMLQuantizationType
    unit_blocks: int
    fields: tuple[tuple[str, type, int], ...]

    @property
    def unit_weights(self) -> int:
        return BLOCK * self.unit_blocks


BLOCK_TYPES = {
    t.qtype: t
    for t in (
        BlockType(Q.Q8_0, 1, (("d", np.float16, 1),)),
        BlockType(Q.Q4_0, 1, (("d", np.float16, 1),)),
        BlockType(Q.Q4_1, 1, (("d", np.float16, 1), ("m", np.float16, 1))),
        BlockType(Q.Q5_0, 1, (("d", np.float16, 1),)),
        BlockType(
            Q.Q4_K,
            8,
            (
                ("sc", np.uint8, 8),
                ("mn", np.uint8, 8),
                ("d", np.float16, 1),
                ("dmin", np.float16, 1),
            ),
        ),
        BlockType(Q.Q6_K, 8, (("sc", np.int8, 16), ("d", np.float16, 1))),
    )
}


def gguf_fields(blocks: np.ndarray, qtype, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """W's GGUF blocks decoded: codes "u" uint8 [rows, in / 32, 32] (Q8_0: its int8 bytes),
    and each scale field [rows, units, count], as the gguf package reads them."""
    kind = BLOCK_TYPES[qtype]
    rows, units = shape[0], shape[1] // kind.unit_weights
    b = np.asarray(blocks, np.uint8).reshape(rows * units, -1)

    def halves(at: int) -> np.ndarray:
        return b[:, at : at + 2].copy().view(np.float16).reshape(rows, units, 1)

    def nibbles(qs: np.ndarray) -> np.ndarray:  # GGUF's 16 bytes per 32 weights: k, k + 16
        return np.concatenate([qs & 15, qs >> 4], axis=-1)

    if qtype == Q.Q8_0:
        fields = {"u": b[:, 2:], "d": halves(0)}
    elif qtype in (Q.Q4_0, Q.Q4_1):
        fields = {"u": nibbles(b[:, -16:]), "d": halves(0)}
        if qtype == Q.Q4_1:
            fields["m"] = halves(2)
    elif qtype == Q.Q5_0:  # element k's high bit is bit k of a little-endian uint32
        high = b[:, 2:6].copy().view("<u4") >> np.arange(32, dtype=np.uint32) & 1
        fields = {"u": nibbles(b[:, 6:]) | high.astype(np.uint8) << 4, "d": halves(0)}
    elif qtype == Q.Q4_K:  # 64 weights per 32 bytes of qs: low nibbles first, then high
        sc, mn = Q4_K.get_scale_min(b[:, 4:16])
        u = nibbles(b[:, 16:].reshape(-1, 4, 32))
        fields = {"u": u, "sc": sc, "mn": mn, "d": halves(0), "dmin": halves(2)}
    else:  # Q6_K: 128 weights per 64 bytes of ql (4 low bits) and 32 of qh (2 high bits)
        ql = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        qh = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(
            1, 1, 4, 1
        )
        u = (ql & 15).reshape(-1, 8, 32) | (qh & 3).reshape(-1, 8, 32) << 4
        fields = {"u": u, "sc": b[:, 192:208].view(np.int8), "d": halves(208)}
    return {
        name: field.reshape(rows, -1, 32) if name == "u" else field.reshape(rows, units, -1)
        for name, field in fields.items()
    }


def dense_weight(fields: dict[str, np.ndarray], qtype) -> np.ndarray:
    """W [rows, in] in fp32 from its fields, in the gguf package's fp32 operations."""
    u, rows = fields["u"], fields["u"].shape[0]

    def per(scale: np.ndarray, weights: int) -> np.ndarray:  # a scale for every weight
        return np.repeat(scale.astype(np.float32).reshape(rows, -1), weights, axis=1)

    if qtype == Q.Q8_0:
        return per(fields["d"], 32) * u.view(np.int8).reshape(rows, -1).astype(np.float32)
    codes = u.reshape(rows, -1).astype(np.float32)
    if qtype in (Q.Q4_0, Q.Q5_0):
        return per(fields["d"], 32) * (codes - (8 if qtype == Q.Q4_0 else 16))
    if qtype == Q.Q4_1:
        return per(fields["d"], 32) * codes + per(fields["m"], 32)
    if qtype == Q.Q4_K:
        d = fields["d"].astype(np.float32) * fields["sc"]
        dmin = fields["dmin"].astype(np.float32) * fields["mn"]
        return per(d, 32) * codes - per(dmin, 32)
    return per(fields["d"].astype(np.float32) * fields["sc"], 16) * (codes - 32)


def _to_records(x: np.ndarray) -> np.ndarray:
    """[rows, units, ...] -> [groups, units, GROUP, ...], rows padded to whole groups."""
    rows = x.shape[0]
    padded = np.zeros((-(-rows // GROUP) * GROUP, *x.shape[1:]), x.dtype)
    padded[:rows] = x
    padded = padded.reshape(-1, GROUP, *x.shape[1:])
    return np.moveaxis(padded, 1, 2)


def _q5_high_bit_shifts() -> np.ndarray:
    """Q5_0: where element 16 h + 4 t + i's high bit lies in byte i of its chunk, as a shift
    [h, t, 1]."""
    return (np.arange(4).reshape(1, 4, 1) + 4 * np.arange(2).reshape(2, 1, 1)).astype(np.uint8)


def _high_bit_shifts() -> np.ndarray:
    """Q6_K: where element 16 h + 4 (2 p + w) + i's 2 high bits lie in byte i of chunk p,
    as a shift [h, 1, w, 1] (csrc/quant_linear.c draws the layout)."""
    h, w = np.arange(2).reshape(2, 1, 1, 1), np.arange(2).reshape(1, 1, 2, 1)
    return (2 * (2 * w + h)).astype(np.uint8)


def pack_blocks(blocks: np.ndarray, qtype, shape: tuple[int, int]) -> np.ndarray:
    """GGUF blocks of W [out_features, in_features] (any uint8 array holding them in order) as
    the kernel's records: uint8 [groups, units, record bytes]."""
    kind = BLOCK_TYPES[qtype]
    fields = gguf_fields(blocks, qtype, shape)
    rows, units = shape[0], shape[1] // kind.unit_weights
    u = fields["u"].reshape(rows, units, kind.unit_blocks, 32)
    if qtype == Q.Q8_0:  # [groups, units, chunk t, GROUP, 4]: bytes 4 t..
        parts = [np.moveaxis(_to_records(u.reshape(rows, units, 8, 4)), 2, 3)]
    else:  # [groups, units, blocks, chunk t, GROUP, 4]: element 4 t + i low, 16 + 4 t + i high
        codes = (u[..., :16] & 15) | (u[..., 16:] & 15) << 4
        parts = [np.moveaxis(_to_records(codes.reshape(rows, units, -1, 4, 4)), 2, 4)]
    if qtype == Q.Q5_0:  # [groups, units, GROUP, 4]
        high = (u >> 4).reshape(rows, units, 2, 4, 4)  # [.., h, t, i]
        bits = np.bitwise_or.reduce(high << _q5_high_bit_shifts(), axis=(2, 3))
        parts.append(_to_records(bits))
    if qtype == Q.Q6_K:  # [groups, units, blocks, chunk p, GROUP, 4]
        high = (u >> 4).reshape(rows, units, 8, 2, 2, 2, 4)  # [.., h, p, w, i]
        bits = np.bitwise_or.reduce(high << _high_bit_shifts(), axis=(3, 5))
        parts.append(np.moveaxis(_to_records(bits), 2, 4))
    for name, dtype, _ in kind.fields:  # [groups, units, count, GROUP]
        field = np.moveaxis(_to_records(fields[name].astype(dtype)), 2, 3)
        parts.append(np.ascontiguousarray(field).view(np.uint8))
    groups = parts[0].shape[0]
    return np.concatenate([p.reshape(groups, units, -1) for p in parts], axis=-1)


def packed_fields(packed: np.ndarray, qtype, shape: tuple[int, int]) -> dict[str, np.ndarray]:
    """pack_blocks undone: the fields gguf_fields gives."""
    kind = BLOCK_TYPES[qtype]
    groups, units, _ = packed.shape
    rows, at = shape[0], 0

    def take(nbytes: int, dtype=np.uint8, inner: tuple = ()) -> np.ndarray:
        """The next nbytes of each record as [groups, units, *inner]."""
        nonlocal at
        part = packed[..., at : at + nbytes].copy().view(dtype)
        at += nbytes
        return part.reshape(groups, units, *inner)

    def per_row(part: np.ndarray, axis: int) -> np.ndarray:  # the GROUP axis to rows
        part = np.moveaxis(part, axis, 1)
        return part.reshape(groups * GROUP, *part.shape[2:])

    blocks = kind.unit_blocks
    if qtype == Q.Q8_0:
        u = per_row(take(512, inner=(8, GROUP, 4)), 3).reshape(-1, units, 1, 32)
    else:
        codes = per_row(take(256 * blocks, inner=(blocks, 4, GROUP, 4)), 4)
        codes = codes.reshape(-1, units, blocks, 16)
        u = np.concatenate([codes & 15, codes >> 4], axis=-1)
        if qtype == Q.Q5_0:
            bits = per_row(take(64, inner=(GROUP, 4)), 2).reshape(-1, units, 1, 1, 1, 4)
            u = u | ((bits >> _q5_high_bit_shifts()) & 1).reshape(-1, units, 1, 32) << 4
        if qtype == Q.Q6_K:
            bits = per_row(take(1024, inner=(8, 2, GROUP, 4)), 4)  # [.., blocks, p, i]
            bits = bits.reshape(-1, units, 8, 1, 2, 1, 4)
            u = u | ((bits >> _high_bit_shifts()) & 3).reshape(-1, units, 8, 32) << 4
    fields = {"u": u.reshape(groups * GROUP, -1, 32)[:rows]}
    for name, dtype, count in kind.fields:
        nbytes = count * GROUP * np.dtype(dtype).itemsize
        fields[name] = per_row(take(nbytes, dtype, (count, GROUP)), 3)[:rows]
    return fields
