/* y = x W^T + b for a few rows of x, W in GGUF's quantized blocks: Q8_0, Q4_0, Q4_1, Q4_K, Q6_K.
 *
 * A decode step's linears are bound by reading W, and a 4-bit W is a quarter of the bytes of
 * bf16. Nothing here widens W to floats: each 32-block of a row of x is quantized to int8 with
 * one fp32 scale dx (dx = max|x| / 127), and a block's product is an integer dot product of
 * W's codes with those int8 values, scaled once. Every type is written as unsigned codes u, a
 * scale d per 16 or 32 weights, an integer offset c and a float offset m per 32-block:
 *
 *     w = d (u - c) + m          sum_j w_j x_j ~= d dx (u . q - c sum q) + m sx,  sx = dx sum q
 *
 *   Q4_0  u = 4-bit, c = 8                       Q8_0  u = s + 128, c = 128 (s: GGUF's int8)
 *   Q4_1  u = 4-bit, m per block                 Q6_K  u = 6-bit, c = 32, d = d_super * sc16
 *   Q4_K  u = 4-bit, d = d_super * sc, m = -dmin_super * mn (6-bit sc, mn per 32-block)
 *
 * Unsigned codes against signed x are what the CPUs' int8 multiply-adds take (AVX512-VNNI
 * vpdpbusd, AVX2 vpmaddubsw); c sum q depends on x alone and is computed with x's quantization,
 * where it seeds the integer accumulator.
 *
 * Packed layout (quant_ops.pack_blocks makes it from GGUF blocks at load). W's rows are taken
 * GROUP = 4 at a time (the last group padded with zero rows); a group is one record per unit
 * (a 32-block, or a K type's 256-weight super-block), records in order, groups one after the
 * other, so a thread streams one contiguous range. In a record, 64 bytes hold the 4 rows' codes
 * of a 32-block: row r's 16 bytes at 16 r, byte k with element k in the low nibble and element
 * k + 16 in the high one. One 512-bit load thus gives 16 elements of each of 4 rows, and one
 * vpdpbusd against those 16 x values broadcast to each 128-bit lane does the 4 rows at once.
 * Then per type (scale arrays are [unit's sub-blocks][4 rows]):
 *   Q4_0  codes, fp16 d[4]                                                         72 bytes
 *   Q4_1  codes, fp16 d[4], fp16 m[4]                                              80
 *   Q8_0  row r's bytes 0..15 at 16 r, its bytes 16..31 at 64 + 16 r, fp16 d[4]   136
 *   Q4_K  8 x codes, u8 sc[8][4], u8 mn[8][4], fp16 d[4], fp16 dmin[4]            592
 *   Q6_K  8 x low 4 bits as codes, 4 x 64 bytes of high 2 bits (bits 2 f..2 f + 1 of byte
 *         16 r + k: block 2 p + f / 2 of the record's 64-byte part p, element k + 16 (f % 2)),
 *         i8 sc[16][4] (per 16 weights), fp16 d[4]                               840
 * Records are as many bytes as the GGUF blocks they hold, but Q4_K's (+3 %: 6-bit scales
 * widened to bytes).
 *
 * Threads split the groups into contiguous ranges; each group is read from memory once and
 * serves every row of x from the L1 cache. Each output is summed in the same order whatever
 * the number of rows or threads, and each row of x is quantized on its own, so a row's result
 * never depends on the batch. The paths (scalar, avx2, avx512vnni) quantize x alike, bit for
 * bit, and may round their float sums differently from one another; the widest the CPU runs
 * is the default, set_isa() picks one for tests and timing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec8.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define X86 1
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))
#define TARGET_VNNI                                                                            \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))
#else
#define X86 0
#endif

/* GGML's type ids */
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q6_K = 14 };
#define QK 32
#define GROUP 4

/* 32-blocks per unit and bytes per record, by type */
static int unit_blocks(int qtype) { return qtype == Q4_K || qtype == Q6_K ? 8 : 1; }

static int64_t record_bytes(int qtype) {
    switch (qtype) {
    case Q4_0: return 72;
    case Q4_1: return 80;
    case Q8_0: return 136;
    case Q4_K: return 592;
    default: return 840;
    }
}

/* the integer offset c (see the top) */
static int code_offset(int qtype) {
    return qtype == Q4_0 ? 8 : qtype == Q8_0 ? 128 : qtype == Q6_K ? 32 : 0;
}

enum isa { SCALAR, AVX2, AVX512VNNI };
static const char *const isa_names[] = {"scalar", "avx2", "avx512vnni"};
static enum isa current_isa = SCALAR;

static int isa_runs(enum isa isa) {
#if X86
    __builtin_cpu_init();
    if (isa == AVX2)
        return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
               __builtin_cpu_supports("f16c");
    if (isa == AVX512VNNI)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c");
#endif
    return isa == SCALAR;
}

static float half_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, sizeof h);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = h >> 10 & 0x1f,
                   mantissa = h & 0x3ff;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in fp32 */
        const float f = ldexpf((float)mantissa, -24);
        return sign ? -f : f;
    }
    const uint32_t bits = sign | (exponent == 31 ? 0x7f800000 | mantissa << 13
                                                 : (exponent + 112) << 23 | mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Row r's code u of element k of 32-block j of a record. */
static int code(const uint8_t *rec, int qtype, int r, int j, int k) {
    if (qtype == Q8_0) return (uint8_t)(rec[k < 16 ? 16 * r + k : 64 + 16 * r + k - 16] ^ 0x80);
    const uint8_t byte = rec[64 * j + 16 * r + k % 16];
    const int low = k < 16 ? byte & 15 : byte >> 4;
    if (qtype != Q6_K) return low;
    const int f = 2 * (j % 2) + k / 16;
    return low | (rec[512 + 64 * (j / 2) + 16 * r + k % 16] >> 2 * f & 3) << 4;
}

/* Row r's scales of 32-block j of a record: d of its two halves, and m. */
static void block_scales(const uint8_t *rec, int qtype, int r, int j, float d[2], float *m) {
    *m = 0.0f;
    switch (qtype) {
    case Q4_K:
        d[0] = d[1] = half_to_float(rec + 576 + 2 * r) * rec[512 + 4 * j + r];
        *m = -(half_to_float(rec + 584 + 2 * r) * rec[544 + 4 * j + r]);
        return;
    case Q6_K:
        for (int h = 0; h < 2; h++)
            d[h] = half_to_float(rec + 832 + 2 * r) * (int8_t)rec[768 + 4 * (2 * j + h) + r];
        return;
    default:
        d[0] = d[1] = half_to_float(rec + (qtype == Q8_0 ? 128 : 64) + 2 * r);
        if (qtype == Q4_1) *m = half_to_float(rec + 72 + 2 * r);
    }
}

/* A 32-block of a row of x as the kernels read it. */
struct xblock {
    int8_t q[QK];
    float dx, sx;  /* x ~= dx q; sx = dx sum q */
    int32_t lanes[8]; /* -c times the sums of q over elements 4 i..4 i + 3 and 16 + 4 i.. (i <
                         4): both in lane i (one accumulator takes both halves), or, for Q6_K
                         (a scale per half), the first half's in lane i, the second's in 4 + i */
};

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUFFLE __builtin_shufflevector
#endif

/* [sums of a's lanes 0..3 and 4..7, then of b's], in lanes 0..3 */
static inline __attribute__((always_inline)) int8v sums_of_four(int8v a, int8v b) {
#ifdef SHUFFLE
    const int8v pairs = SHUFFLE(a, b, 0, 2, 4, 6, 8, 10, 12, 14) +
                        SHUFFLE(a, b, 1, 3, 5, 7, 9, 11, 13, 15);
    return SHUFFLE(pairs, pairs, 0, 2, 4, 6, 0, 2, 4, 6) +
           SHUFFLE(pairs, pairs, 1, 3, 5, 7, 1, 3, 5, 7);
#else
    int8v sums = {0};
    for (int i = 0; i < 4; i++)
        for (int l = 0; l < 4; l++) sums[i] += (i < 2 ? a : b)[4 * (i % 2) + l];
    return sums;
#endif
}

/* the largest lane of v, v's lanes >= 0 */
static inline __attribute__((always_inline)) float max8(vec8 v) {
#ifdef SHUFFLE
    const vec8 halves = SHUFFLE(v, v, 4, 5, 6, 7, 0, 1, 2, 3);
    v = select8(v > halves, v, halves);
    const vec8 quarters = SHUFFLE(v, v, 2, 3, 0, 1, 2, 3, 0, 1);
    v = select8(v > quarters, v, quarters);
    return v[0] > v[1] ? v[0] : v[1];
#else
    float max = 0.0f;
    for (int l = 0; l < LANES; l++) max = v[l] > max ? v[l] : max;
    return max;
#endif
}

/* One row of x (fp32 or bf16) as xblocks for codes offset by c. Every operation is one IEEE
 * rounding, so NumPy reproduces it exactly (the tests do): x * (127 / max|x|) is rounded to the
 * nearest integer, ties to even, by adding and subtracting 1.5 * 2^23 (exact below 2^22 in
 * magnitude, and it is at most 127). */
static inline __attribute__((always_inline)) void quantize(struct xblock *out, const void *x,
                                                            int64_t in, int c, int halves,
                                                            const int is_bf16) {
    const vec8 round = (vec8){0.0f} + 12582912.0f;
    for (int64_t b = 0; b < in / QK; b++) {
        vec8 v[QK / LANES], amax = {0.0f};
        for (int k = 0; k < QK / LANES; k++) {
            v[k] = load_any(x, b * QK + k * LANES, is_bf16);
            const vec8 a = (vec8)((int8v)v[k] & 0x7fffffff);
            amax = select8(a > amax, a, amax);
        }
        const float max = max8(amax), dx = max / 127.0f, scale = max != 0.0f ? 127.0f / max : 0.0f;
        int8v qk[QK / LANES];
        for (int k = 0; k < QK / LANES; k++) {
            qk[k] = __builtin_convertvector((v[k] * scale + round) - round, int8v);
            for (int l = 0; l < LANES; l++) out[b].q[k * LANES + l] = (int8_t)qk[k][l];
        }
        /* sums of 4: elements 4 i.. of the first half (qk[0], qk[1]), then of the second */
        const int8v first = sums_of_four(qk[0], qk[1]), second = sums_of_four(qk[2], qk[3]);
        const int8v both = first + second, own = halves ? first : both;
        out[b].dx = dx;
        out[b].sx = dx * (float)((both[0] + both[1]) + (both[2] + both[3]));
#ifdef SHUFFLE
        const int8v lanes = SHUFFLE(own, second, 0, 1, 2, 3, 8, 9, 10, 11) * -c;
#else
        const int8v lanes = {own[0] * -c, own[1] * -c, own[2] * -c, own[3] * -c,
                             second[0] * -c, second[1] * -c, second[2] * -c, second[3] * -c};
#endif
        memcpy(out[b].lanes, &lanes, sizeof lanes);
    }
}

VECTOR_CLONES static void quantize_fp32(struct xblock *out, const void *x, int64_t in, int c,
                                        int halves) {
    quantize(out, x, in, c, halves, 0);
}

VECTOR_CLONES static void quantize_bf16(struct xblock *out, const void *x, int64_t in, int c,
                                        int halves) {
    quantize(out, x, in, c, halves, 1);
}

static void quantize_generic(struct xblock *out, const void *x, int64_t in, int c, int halves,
                             int is_bf16) {
    (is_bf16 ? quantize_bf16 : quantize_fp32)(out, x, in, c, halves);
}

/* What every path reads: the packed W, the quantized x and where results go. */
struct call {
    void *out;
    const uint8_t *w;
    const struct xblock *x; /* [rows, in / 32] */
    const void *bias;
    int64_t rows, blocks, n_out, rec_bytes;
    int qtype, is_bf16;
};

static void store(const struct call *c, int64_t m, int64_t n, float dot) {
    if (n >= c->n_out) return; /* a padding row of the last group */
    const int64_t at = m * c->n_out + n;
    if (c->is_bf16) {
        if (c->bias != NULL) dot += bf16_to_float(((const bf16 *)c->bias)[n]);
        ((bf16 *)c->out)[at] = float_to_bf16(dot);
    } else {
        ((float *)c->out)[at] = c->bias == NULL ? dot : dot + ((const float *)c->bias)[n];
    }
}

/* The portable path: correct everywhere, and the plainest statement of the arithmetic. */
static void group_scalar(const struct call *c, int64_t g) {
    const int per_unit = unit_blocks(c->qtype), offset = code_offset(c->qtype);
    const uint8_t *recs = c->w + g * c->blocks / per_unit * c->rec_bytes;
    for (int64_t m = 0; m < c->rows; m++)
        for (int r = 0; r < GROUP; r++) {
            float dot = 0.0f;
            for (int64_t b = 0; b < c->blocks; b++) {
                const uint8_t *rec = recs + b / per_unit * c->rec_bytes;
                const int j = b % per_unit;
                const struct xblock *xb = c->x + m * c->blocks + b;
                int32_t half[2] = {0, 0};
                for (int k = 0; k < QK; k++)
                    half[k / 16] += (code(rec, c->qtype, r, j, k) - offset) * xb->q[k];
                float d[2], mb;
                block_scales(rec, c->qtype, r, j, d, &mb);
                dot += xb->dx * (d[0] * (float)half[0] + d[1] * (float)half[1]) + mb * xb->sx;
            }
            store(c, m, GROUP * g + r, dot);
        }
}

#if X86
/* 4 fp16 values as fp32 */
TARGET_AVX2 INLINE __m128 halves4(const uint8_t *p) {
    return _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)p));
}

/* AVX-512 VNNI. Per x row an accumulator of 16 floats: lane 4 r + i sums row r's products of
 * elements 4 i..4 i + 3 and 16 + 4 i.. of each block, scaled by d dx, and the 4 lanes of a row
 * sum to its result, plus lane r of a second accumulator, of the offset terms m sx. n_x rows
 * of x run together (n_x a constant after inlining), each using W's vectors loaded once. */
#define VNNI_X 4

/* lanes 4 r .. 4 r + 3 of v's element 4 s + r: row r's value of sub-block s of a scale array */
TARGET_VNNI INLINE __m512 spread(__m512 v, int s) {
    const __m512i rows = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(_mm512_add_epi32(rows, _mm512_set1_epi32(4 * s)), v);
}

/* 16 bytes, in each 128-bit lane */
TARGET_VNNI INLINE __m512i broadcast4(const void *p) {
    return _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)p));
}

/* 16 bytes as 16 floats, times the 4 rows' fp16 values at halves (for [4][4] scale arrays) */
TARGET_VNNI INLINE __m512 scales16(__m128i bytes, const int is_signed, const uint8_t *halves) {
    const __m512i wide = is_signed ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
    const __m128 d = halves4(halves);
    return _mm512_mul_ps(_mm512_cvtepi32_ps(wide), _mm512_broadcast_f32x4(d));
}

TARGET_VNNI INLINE void vnni_tile(const struct call *c, const uint8_t *recs, int64_t g,
                                  int64_t m0, const int n_x, const int qtype) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), high2 = _mm512_set1_epi8(0x30);
    const int per_unit = unit_blocks(qtype);
    __m512 acc[VNNI_X];
    __m128 offsets[VNNI_X];
    for (int i = 0; i < n_x; i++) {
        acc[i] = _mm512_setzero_ps();
        offsets[i] = _mm_setzero_ps();
    }
    for (int64_t unit = 0; unit < c->blocks / per_unit; unit++) {
        const uint8_t *rec = recs + unit * c->rec_bytes;
        __m512 unit_d[4], unit_m[2]; /* K types: d and m of 4 sub-blocks each, [4][4] */
        if (qtype == Q4_K)
            for (int p = 0; p < 2; p++) {
                const __m128i *sc = (const __m128i *)(rec + 512 + 16 * p);
                const __m128i *mn = (const __m128i *)(rec + 544 + 16 * p);
                unit_d[p] = scales16(_mm_loadu_si128(sc), 0, rec + 576);
                unit_m[p] = _mm512_sub_ps(_mm512_setzero_ps(),
                                          scales16(_mm_loadu_si128(mn), 0, rec + 584));
            }
        if (qtype == Q6_K)
            for (int p = 0; p < 4; p++)
                unit_d[p] = scales16(_mm_loadu_si128((const __m128i *)(rec + 768 + 16 * p)), 1,
                                     rec + 832);
        for (int j = 0; j < per_unit; j++) {
            const int64_t b = unit * per_unit + j;
            __m512i low, high;
            __m512 d_low, d_high;
            __m128 m = _mm_setzero_ps(); /* [m0..m3] */
            if (qtype == Q8_0) {
                const __m512i flip = _mm512_set1_epi8((char)0x80);
                low = _mm512_xor_si512(_mm512_loadu_si512(rec), flip);
                high = _mm512_xor_si512(_mm512_loadu_si512(rec + 64), flip);
            } else {
                const __m512i codes = _mm512_loadu_si512(rec + 64 * j);
                low = _mm512_and_si512(codes, low4);
                high = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low4);
            }
            if (qtype == Q6_K) { /* bits 2 f, 2 f + 1 of the high-bit bytes, moved to bits 4, 5 */
                const __m512i bits = _mm512_loadu_si512(rec + 512 + 64 * (j / 2));
                const __m512i h_low = j % 2 ? bits : _mm512_slli_epi16(bits, 4);
                const __m512i h_high =
                    j % 2 ? _mm512_srli_epi16(bits, 2) : _mm512_slli_epi16(bits, 2);
                low = _mm512_or_si512(low, _mm512_and_si512(h_low, high2));
                high = _mm512_or_si512(high, _mm512_and_si512(h_high, high2));
                d_low = spread(unit_d[j / 2], 2 * j % 4);
                d_high = spread(unit_d[j / 2], 2 * j % 4 + 1);
            } else if (qtype == Q4_K) {
                d_low = d_high = spread(unit_d[j / 4], j % 4);
                const __m512i iota =
                    _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
                const __m512i quarter = _mm512_add_epi32(iota, _mm512_set1_epi32(4 * (j % 4)));
                m = _mm512_castps512_ps128(_mm512_permutexvar_ps(quarter, unit_m[j / 4]));
            } else {
                /* [d0..d3, m0..m3] spread: d_r to lanes 4 r .. 4 r + 3, m_r to lane 4 r */
                const __m128 d = halves4(rec + (qtype == Q8_0 ? 128 : 64));
                d_low = d_high = spread(_mm512_castps128_ps512(d), 0);
                if (qtype == Q4_1) m = halves4(rec + 72);
            }
            for (int i = 0; i < n_x; i++) {
                const struct xblock *xb = c->x + (m0 + i) * c->blocks + b;
                const __m512i q_low = broadcast4(xb->q), q_high = broadcast4(xb->q + 16);
                const __m512i seed_low = broadcast4(xb->lanes);
                const __m512 dx = _mm512_set1_ps(xb->dx);
                if (qtype == Q6_K) {
                    const __m512i seed_high = broadcast4(xb->lanes + 4);
                    const __m512i dot_low = _mm512_dpbusd_epi32(seed_low, low, q_low);
                    const __m512i dot_high = _mm512_dpbusd_epi32(seed_high, high, q_high);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_low),
                                             _mm512_mul_ps(d_low, dx), acc[i]);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot_high),
                                             _mm512_mul_ps(d_high, dx), acc[i]);
                } else {
                    const __m512i seed = qtype == Q4_0 || qtype == Q8_0 ? seed_low
                                                                         : _mm512_setzero_si512();
                    const __m512i dot = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(seed, low, q_low),
                                                            high, q_high);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d_low, dx),
                                             acc[i]);
                    if (qtype == Q4_1 || qtype == Q4_K)
                        offsets[i] = _mm_fmadd_ps(m, _mm_set1_ps(xb->sx), offsets[i]);
                }
            }
        }
    }
    for (int i = 0; i < n_x; i++) {
        float lanes[16], m[4];
        _mm512_storeu_ps(lanes, acc[i]);
        _mm_storeu_ps(m, offsets[i]);
        for (int r = 0; r < GROUP; r++)
            store(c, m0 + i, GROUP * g + r,
                  (lanes[4 * r] + lanes[4 * r + 1]) + (lanes[4 * r + 2] + lanes[4 * r + 3]) + m[r]);
    }
}

TARGET_VNNI INLINE void vnni_group(const struct call *c, int64_t g, const int qtype) {
    const uint8_t *recs = c->w + g * (c->blocks / unit_blocks(qtype)) * c->rec_bytes;
    int64_t m = 0;
    for (; m + VNNI_X <= c->rows; m += VNNI_X) vnni_tile(c, recs, g, m, VNNI_X, qtype);
    for (; m < c->rows; m++) vnni_tile(c, recs, g, m, 1, qtype);
}

/* quantize() in AVX-512: the same arithmetic (vcvtps2dq rounds to nearest even, as the
 * generic code's add and subtract of 1.5 * 2^23 does) in a quarter of the instructions: a
 * one-row step quantizes x once per linear. */
TARGET_VNNI static void quantize_vnni(struct xblock *out, const void *x, int64_t in, int c,
                                      int halves, int is_bf16) {
    const __m128i ones = _mm_set1_epi8(1), minus_c = _mm_set1_epi32(-c);
    for (int64_t b = 0; b < in / QK; b++) {
        __m512 v[2];
        for (int h = 0; h < 2; h++) {
            if (is_bf16) {
                const bf16 *halfs = (const bf16 *)x + b * QK + 16 * h;
                const __m256i raw = _mm256_loadu_si256((const __m256i *)halfs);
                v[h] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
            } else {
                v[h] = _mm512_loadu_ps((const float *)x + b * QK + 16 * h);
            }
        }
        const float max =
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])));
        const float dx = max / 127.0f, scale = max != 0.0f ? 127.0f / max : 0.0f;
        __m128i q[2], fours[2];
        for (int h = 0; h < 2; h++) {
            const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(scale)));
            q[h] = _mm512_cvtepi32_epi8(rounded);
            _mm_storeu_si128((__m128i *)(out[b].q + 16 * h), q[h]);
            fours[h] = _mm_dpbusd_epi32(_mm_setzero_si128(), ones, q[h]); /* sums of 4 */
        }
        const __m128i both = _mm_add_epi32(fours[0], fours[1]);
        out[b].dx = dx;
        out[b].sx = dx * (float)((_mm_extract_epi32(both, 0) + _mm_extract_epi32(both, 1)) +
                                 (_mm_extract_epi32(both, 2) + _mm_extract_epi32(both, 3)));
        const __m128i first = halves ? fours[0] : both;
        _mm_storeu_si128((__m128i *)out[b].lanes, _mm_mullo_epi32(first, minus_c));
        _mm_storeu_si128((__m128i *)(out[b].lanes + 4), _mm_mullo_epi32(fours[1], minus_c));
    }
}

TARGET_VNNI static void group_vnni(const struct call *c, int64_t g) {
    switch (c->qtype) {
    case Q4_0: vnni_group(c, g, Q4_0); break;
    case Q4_1: vnni_group(c, g, Q4_1); break;
    case Q8_0: vnni_group(c, g, Q8_0); break;
    case Q4_K: vnni_group(c, g, Q4_K); break;
    default: vnni_group(c, g, Q6_K);
    }
}

/* AVX2: as the VNNI path with 256-bit vectors, vector h (h = 0, 1) holding rows 2 h and 2 h +
 * 1 of a group. vpmaddubsw multiplies unsigned codes by the signed x in pairs into int16 and
 * vpmaddwd sums those pairs into the same int32 lanes vpdpbusd fills. Q8_0's codes as unsigned
 * would overflow vpmaddubsw's int16 pairs (255 * 127 * 2), so they stay signed: |s| times x
 * with s's sign, and c = 0. */
#define AVX2_X 2

/* lanes 0..3 of v's element 4 s + 2 h, lanes 4..7 of element 4 s + 2 h + 1: rows 2 h and 2 h
 * + 1 of sub-block s of a scale array [2][4] */
TARGET_AVX2 INLINE __m256 spread2(__m256 v, int s, int h) {
    const __m256i rows = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
    return _mm256_permutevar8x32_ps(v, _mm256_add_epi32(rows, _mm256_set1_epi32(4 * s + 2 * h)));
}

/* 8 bytes as 8 floats, times the 4 rows' fp16 values at halves (for [2][4] scale arrays) */
TARGET_AVX2 INLINE __m256 scales8(const uint8_t *bytes, const int is_signed,
                                  const uint8_t *halves) {
    const __m128i packed = _mm_loadl_epi64((const __m128i *)bytes);
    const __m256i wide = is_signed ? _mm256_cvtepi8_epi32(packed) : _mm256_cvtepu8_epi32(packed);
    const __m128 d = halves4(halves);
    return _mm256_mul_ps(_mm256_cvtepi32_ps(wide), _mm256_set_m128(d, d));
}

/* 16 bytes, in each 128-bit lane */
TARGET_AVX2 INLINE __m256i broadcast2(const void *p) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)p));
}

TARGET_AVX2 INLINE __m256i avx2_dot(__m256i w, __m256i q, const int is_signed) {
    const __m256i pairs = is_signed
                              ? _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(q, w))
                              : _mm256_maddubs_epi16(w, q);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

TARGET_AVX2 INLINE void avx2_tile(const struct call *c, const uint8_t *recs, int64_t g,
                                  int64_t m0, const int n_x, const int qtype) {
    const __m256i low4 = _mm256_set1_epi8(0x0f), high2 = _mm256_set1_epi8(0x30);
    const int per_unit = unit_blocks(qtype);
    __m256 acc[AVX2_X][2];
    __m128 offsets[AVX2_X];
    for (int i = 0; i < n_x; i++) {
        acc[i][0] = acc[i][1] = _mm256_setzero_ps();
        offsets[i] = _mm_setzero_ps();
    }
    for (int64_t unit = 0; unit < c->blocks / per_unit; unit++) {
        const uint8_t *rec = recs + unit * c->rec_bytes;
        __m256 unit_d[8], unit_m[4]; /* K types: d and m of 2 sub-blocks each, [2][4] */
        if (qtype == Q4_K)
            for (int p = 0; p < 4; p++) {
                unit_d[p] = scales8(rec + 512 + 8 * p, 0, rec + 576);
                unit_m[p] = _mm256_sub_ps(_mm256_setzero_ps(),
                                          scales8(rec + 544 + 8 * p, 0, rec + 584));
            }
        if (qtype == Q6_K)
            for (int p = 0; p < 8; p++) unit_d[p] = scales8(rec + 768 + 8 * p, 1, rec + 832);
        for (int j = 0; j < per_unit; j++) {
            const int64_t b = unit * per_unit + j;
            __m256i low[2], high[2];
            __m256 d_low[2], d_high[2];
            __m128 d, m = _mm_setzero_ps(); /* [d0..d3] (of Q4_0, Q4_1, Q8_0), [m0..m3] */
            if (per_unit == 1) d = halves4(rec + (qtype == Q8_0 ? 128 : 64));
            if (qtype == Q4_1) m = halves4(rec + 72);
            if (qtype == Q4_K) /* elements 4 s.. 4 s + 3 */
                m = _mm256_castps256_ps128(_mm256_permutevar8x32_ps(
                    unit_m[j / 2], _mm256_add_epi32(_mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0),
                                                    _mm256_set1_epi32(4 * (j % 2)))));
            for (int h = 0; h < 2; h++) {
                const __m256i codes = _mm256_loadu_si256((const __m256i *)(rec + 64 * j + 32 * h));
                if (qtype == Q8_0) {
                    low[h] = codes;
                    high[h] = _mm256_loadu_si256((const __m256i *)(rec + 64 + 32 * h));
                } else {
                    low[h] = _mm256_and_si256(codes, low4);
                    high[h] = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low4);
                }
                if (qtype == Q6_K) {
                    const uint8_t *high_bits = rec + 512 + 64 * (j / 2) + 32 * h;
                    const __m256i bits = _mm256_loadu_si256((const __m256i *)high_bits);
                    const __m256i h_low = j % 2 ? bits : _mm256_slli_epi16(bits, 4);
                    const __m256i h_high =
                        j % 2 ? _mm256_srli_epi16(bits, 2) : _mm256_slli_epi16(bits, 2);
                    low[h] = _mm256_or_si256(low[h], _mm256_and_si256(h_low, high2));
                    high[h] = _mm256_or_si256(high[h], _mm256_and_si256(h_high, high2));
                    d_low[h] = spread2(unit_d[j], 0, h);
                    d_high[h] = spread2(unit_d[j], 1, h);
                } else if (qtype == Q4_K) {
                    d_low[h] = d_high[h] = spread2(unit_d[j / 2], j % 2, h);
                } else {
                    d_low[h] = d_high[h] = spread2(_mm256_castps128_ps256(d), 0, h);
                }
            }
            for (int i = 0; i < n_x; i++) {
                const struct xblock *xb = c->x + (m0 + i) * c->blocks + b;
                const __m256i q_low = broadcast2(xb->q), q_high = broadcast2(xb->q + 16);
                const __m256i seed_low = broadcast2(xb->lanes);
                const __m256i seed_high = broadcast2(xb->lanes + 4);
                const __m256 dx = _mm256_set1_ps(xb->dx);
                if (qtype == Q4_1 || qtype == Q4_K)
                    offsets[i] = _mm_fmadd_ps(m, _mm_set1_ps(xb->sx), offsets[i]);
                for (int h = 0; h < 2; h++) {
                    const __m256i dot_low = avx2_dot(low[h], q_low, qtype == Q8_0);
                    const __m256i dot_high = avx2_dot(high[h], q_high, qtype == Q8_0);
                    __m256 *const sum = &acc[i][h];
                    if (qtype == Q6_K) {
                        const __m256i low = _mm256_add_epi32(dot_low, seed_low);
                        const __m256i high = _mm256_add_epi32(dot_high, seed_high);
                        *sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low), _mm256_mul_ps(d_low[h], dx),
                                               *sum);
                        *sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(high),
                                               _mm256_mul_ps(d_high[h], dx), *sum);
                        continue;
                    }
                    __m256i dot = _mm256_add_epi32(dot_low, dot_high);
                    if (qtype == Q4_0) dot = _mm256_add_epi32(dot, seed_low);
                    *sum =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d_low[h], dx), *sum);
                }
            }
        }
    }
    for (int i = 0; i < n_x; i++) {
        float m[4];
        _mm_storeu_ps(m, offsets[i]);
        for (int h = 0; h < 2; h++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[i][h]);
            for (int r = 0; r < 2; r++)
                store(c, m0 + i, GROUP * g + 2 * h + r,
                      (lanes[4 * r] + lanes[4 * r + 1]) + (lanes[4 * r + 2] + lanes[4 * r + 3]) +
                          m[2 * h + r]);
        }
    }
}

TARGET_AVX2 INLINE void avx2_group(const struct call *c, int64_t g, const int qtype) {
    const uint8_t *recs = c->w + g * (c->blocks / unit_blocks(qtype)) * c->rec_bytes;
    int64_t m = 0;
    for (; m + AVX2_X <= c->rows; m += AVX2_X) avx2_tile(c, recs, g, m, AVX2_X, qtype);
    for (; m < c->rows; m++) avx2_tile(c, recs, g, m, 1, qtype);
}

/* quantize() in AVX2, as quantize_vnni() is in AVX-512 */
TARGET_AVX2 static void quantize_avx2(struct xblock *out, const void *x, int64_t in, int c,
                                      int halves, int is_bf16) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    const __m128i minus_c = _mm_set1_epi32(-c);
    for (int64_t b = 0; b < in / QK; b++) {
        __m256 v[4], amax = _mm256_setzero_ps();
        for (int k = 0; k < 4; k++) {
            if (is_bf16) {
                const bf16 *halfs = (const bf16 *)x + b * QK + LANES * k;
                const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)halfs));
                v[k] = _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
            } else {
                v[k] = _mm256_loadu_ps((const float *)x + b * QK + LANES * k);
            }
            amax = _mm256_max_ps(amax, _mm256_and_ps(v[k], magnitude));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
        const float max = _mm_cvtss_f32(m);
        const float dx = max / 127.0f, scale = max != 0.0f ? 127.0f / max : 0.0f;
        __m256i q[4];
        for (int k = 0; k < 4; k++)
            q[k] = _mm256_cvtps_epi32(_mm256_mul_ps(v[k], _mm256_set1_ps(scale)));
        /* int32 -> int8 packs within 128-bit lanes; the permute puts the 4-byte runs in order */
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]),
                                                  _mm256_packs_epi32(q[2], q[3]));
        const __m256i bytes =
            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)out[b].q, bytes);
        const __m256i fours = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes),
                                                _mm256_set1_epi16(1)); /* sums of 4 */
        const __m128i low = _mm256_castsi256_si128(fours);
        const __m128i high = _mm256_extracti128_si256(fours, 1);
        const __m128i both = _mm_add_epi32(low, high);
        out[b].dx = dx;
        out[b].sx = dx * (float)((_mm_extract_epi32(both, 0) + _mm_extract_epi32(both, 1)) +
                                 (_mm_extract_epi32(both, 2) + _mm_extract_epi32(both, 3)));
        const __m128i first = halves ? low : both;
        _mm_storeu_si128((__m128i *)out[b].lanes, _mm_mullo_epi32(first, minus_c));
        _mm_storeu_si128((__m128i *)(out[b].lanes + 4), _mm_mullo_epi32(high, minus_c));
    }
}

TARGET_AVX2 static void group_avx2(const struct call *c, int64_t g) {
    switch (c->qtype) {
    case Q4_0: avx2_group(c, g, Q4_0); break;
    case Q4_1: avx2_group(c, g, Q4_1); break;
    case Q8_0: avx2_group(c, g, Q8_0); break;
    case Q4_K: avx2_group(c, g, Q4_K); break;
    default: avx2_group(c, g, Q6_K);
    }
}
#endif

/* Whether the kernels take qtype and in_features; sets a ValueError if not. */
static int check_shape(int qtype, int64_t in_features) {
    if (qtype != Q4_0 && qtype != Q4_1 && qtype != Q8_0 && qtype != Q4_K && qtype != Q6_K) {
        PyErr_Format(PyExc_ValueError,
                     "quant_linear: GGML type %d has no kernel (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K)",
                     qtype);
        return 0;
    }
    if (in_features % (QK * unit_blocks(qtype)) != 0) {
        PyErr_Format(PyExc_ValueError, "quant_linear: in_features %lld is not a multiple of %d",
                     (long long)in_features, QK * unit_blocks(qtype));
        return 0;
    }
    return 1;
}

static PyObject *linear(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, x, w, bias, rows, in_features, n_out;
    int qtype, is_bf16;
    if (!PyArg_ParseTuple(args, "nnnnnnnip", &out, &x, &w, &bias, &rows, &in_features, &n_out,
                          &qtype, &is_bf16) ||
        !check_shape(qtype, in_features))
        return NULL;
    const int64_t blocks = in_features / QK;
    struct xblock *xq = malloc(sizeof(struct xblock) * (rows * blocks + 1));
    if (xq == NULL) return PyErr_NoMemory();
    const struct call c = {(void *)out, (const uint8_t *)w, xq, (const void *)bias, rows,
                           blocks, n_out, record_bytes(qtype), qtype, is_bf16};
    void (*group)(const struct call *, int64_t) = group_scalar;
#if X86
    if (current_isa == AVX512VNNI) group = group_vnni;
    if (current_isa == AVX2) group = group_avx2;
#endif
    const size_t x_row_bytes = in_features * (is_bf16 ? sizeof(bf16) : sizeof(float));
    Py_BEGIN_ALLOW_THREADS;
    void (*quantize_row)(struct xblock *, const void *, int64_t, int, int, int) =
        quantize_generic;
#if X86
    if (current_isa == AVX512VNNI) quantize_row = quantize_vnni;
    if (current_isa == AVX2) quantize_row = quantize_avx2;
#endif
    /* A few rows are quantized on this thread: cheaper than the threads meeting at a barrier. */
    if (rows > 8) {
#pragma omp parallel for schedule(static)
        for (int64_t m = 0; m < rows; m++)
            quantize_row(xq + m * blocks, (const char *)x + m * x_row_bytes, in_features,
                         code_offset(qtype), qtype == Q6_K, is_bf16);
    } else {
        for (int64_t m = 0; m < rows; m++)
            quantize_row(xq + m * blocks, (const char *)x + m * x_row_bytes, in_features,
                         code_offset(qtype), qtype == Q6_K, is_bf16);
    }
#pragma omp parallel
    {
        const int64_t groups = (n_out + GROUP - 1) / GROUP;
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        for (int64_t g = groups * t / threads; g < groups * (t + 1) / threads; g++) group(&c, g);
    }
    Py_END_ALLOW_THREADS;
    free(xq);
    Py_RETURN_NONE;
}

/* Row r of a group as fp32 or bf16, from the group's records: each 32-block's codes taken in
 * plain loops over its 16 bytes, which the compiler vectorizes. Exact, as the gguf package
 * computes it: d (u - c) + m has at most 24 significant bits. */
static inline __attribute__((always_inline)) void dequantize_row(void *out, const uint8_t *recs,
                                                                  int64_t blocks, int qtype,
                                                                  int r, const int is_bf16) {
    const int per_unit = unit_blocks(qtype), offset = code_offset(qtype);
    const int64_t rec_bytes = record_bytes(qtype);
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *rec = recs + b / per_unit * rec_bytes;
        const int j = b % per_unit;
        int u[QK];
        if (qtype == Q8_0) {
            for (int k = 0; k < 16; k++) {
                u[k] = rec[16 * r + k] ^ 0x80;
                u[16 + k] = rec[64 + 16 * r + k] ^ 0x80;
            }
        } else {
            const uint8_t *codes = rec + 64 * j + 16 * r;
            for (int k = 0; k < 16; k++) {
                u[k] = codes[k] & 15;
                u[16 + k] = codes[k] >> 4;
            }
        }
        if (qtype == Q6_K) {
            const uint8_t *bits = rec + 512 + 64 * (j / 2) + 16 * r;
            const int f = 2 * (j % 2);
            for (int k = 0; k < 16; k++) {
                u[k] |= (bits[k] >> 2 * f & 3) << 4;
                u[16 + k] |= (bits[k] >> (2 * f + 2) & 3) << 4;
            }
        }
        float d[2], m;
        block_scales(rec, qtype, r, j, d, &m);
        float value[QK];
        for (int k = 0; k < QK; k++) value[k] = d[k / 16] * (float)(u[k] - offset) + m;
        for (int k = 0; k < QK; k += LANES) store_any(out, b * QK + k, load8(value + k), is_bf16);
    }
}

VECTOR_CLONES static void dequantize_row_fp32(void *out, const uint8_t *recs, int64_t blocks,
                                              int qtype, int r) {
    dequantize_row(out, recs, blocks, qtype, r, 0);
}

VECTOR_CLONES static void dequantize_row_bf16(void *out, const uint8_t *recs, int64_t blocks,
                                              int qtype, int r) {
    dequantize_row(out, recs, blocks, qtype, r, 1);
}

/* W as fp32 or bf16 [n_out, in] from its packed records: the many-row products take a GEMM. */
static PyObject *dequantize(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, w, n_out, in_features;
    int qtype, is_bf16;
    if (!PyArg_ParseTuple(args, "nnnnip", &out, &w, &n_out, &in_features, &qtype, &is_bf16) ||
        !check_shape(qtype, in_features))
        return NULL;
    const int64_t blocks = in_features / QK;
    const int64_t group_bytes = blocks / unit_blocks(qtype) * record_bytes(qtype);
    const size_t row_bytes = in_features * (is_bf16 ? sizeof(bf16) : sizeof(float));
    Py_BEGIN_ALLOW_THREADS;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_out; n++)
        (is_bf16 ? dequantize_row_bf16 : dequantize_row_fp32)(
            (char *)out + n * row_bytes, (const uint8_t *)w + n / GROUP * group_bytes, blocks,
            qtype, n % GROUP);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyObject *set_isa(PyObject *module, PyObject *arg) {
    (void)module;
    const char *name = PyUnicode_AsUTF8(arg);
    if (name == NULL) return NULL;
    for (int isa = SCALAR; isa <= AVX512VNNI; isa++)
        if (strcmp(name, isa_names[isa]) == 0) {
            if (!isa_runs(isa))
                return PyErr_Format(PyExc_ValueError, "quant_linear: this CPU cannot run %s",
                                    name);
            current_isa = isa;
            Py_RETURN_NONE;
        }
    return PyErr_Format(PyExc_ValueError, "quant_linear: no path %s (scalar, avx2, avx512vnni)",
                        name);
}

static PyObject *get_isa(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyUnicode_FromString(isa_names[current_isa]);
}

static PyObject *isas(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    PyObject *names = PyList_New(0);
    for (int isa = SCALAR; names != NULL && isa <= AVX512VNNI; isa++) {
        if (!isa_runs(isa)) continue;
        PyObject *name = PyUnicode_FromString(isa_names[isa]);
        if (name == NULL || PyList_Append(names, name) < 0) Py_CLEAR(names);
        Py_XDECREF(name);
    }
    return names;
}

static PyMethodDef methods[] = {
    {"linear", linear, METH_VARARGS,
     "linear(out, x, w, bias, rows, in_features, out_features, qtype, is_bf16): data pointers "
     "(bias 0 for none; x, bias, out fp32 or bf16, w packed) then sizes and the GGML type; "
     "writes out [rows, out_features]."},
    {"dequantize", dequantize, METH_VARARGS,
     "dequantize(out, w, out_features, in_features, qtype, is_bf16): writes out "
     "[out_features, in_features] from the packed w."},
    {"set_isa", set_isa, METH_O, "set_isa(name): the CPU path linear() takes from now on."},
    {"isa", get_isa, METH_NOARGS, "isa(): the CPU path linear() takes."},
    {"isas", isas, METH_NOARGS, "isas(): the CPU paths this machine runs, slowest first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_definition = {PyModuleDef_HEAD_INIT, .m_name = "_quant_linear",
                                               .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__quant_linear(void) {
    /* the widest path the CPU runs, until set_isa() (quant_ops times them and may pick another) */
    for (int isa = SCALAR; isa <= AVX512VNNI; isa++)
        if (isa_runs(isa)) current_isa = isa;
    return PyModule_Create(&module_definition);
}
