/* y = x W^T + b for a few rows of x, W in GGUF's quantized blocks: Q8_0, Q4_0, Q4_1, Q5_0, Q4_K,
 * Q6_K.
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
 *   Q5_0  u = 5-bit, c = 16
 *   Q4_K  u = 4-bit, d = d_super * sc, m = -dmin_super * mn (6-bit sc, mn per 32-block)
 *
 * With two terms (linear()'s terms = 2, the default activation precision) a row of x is
 * quantized twice: its int8 blocks q with scale dx, then what they leave, x - dx q, in int8 at
 * the fixed scale dx / 256. 256 q + q' is x in 16 bits with scale dx / 256, and a block's
 * integer products of the two terms are summed as 256 D + D' (exact in int32) before the one
 * conversion to float that a single term has: twice the vpdpbusd work of one term, and no
 * more of the rest. The two terms are rows of x of their own, next to each other, in a tile.
 *
 * Unsigned codes against signed x are what the CPUs' int8 multiply-adds take (AVX512-VNNI
 * vpdpbusd, AVX2 vpmaddubsw); c sum q depends on x alone and is computed with x's quantization,
 * where it seeds the integer accumulator.
 *
 * Packed layout (quant_blocks.pack_blocks makes it from GGUF blocks at load). W's rows are
 * taken GROUP = 16 at a time (the last group padded with zero rows), so that a 32-bit lane of a
 * 512-bit vector is one row of W: a 4-byte run of x broadcast to every lane, one vpdpbusd adds 4
 * products to each of the 16 rows, the rows' sums never need reducing across lanes, and a scale
 * is one vector over the 16 rows. A group is one record per unit (a 32-block, or a K type's
 * 256-weight super-block), records in order, groups one after the other, so a thread streams
 * one contiguous range. In a record, a 32-block's codes are 4 chunks of 64 bytes: chunk t holds
 * row r's bytes 4 t..4 t + 3 at 4 r, byte k with element k in the low nibble and element k + 16
 * in the high one (GGUF's own order of a 4-bit block). Then per type, scale arrays [...][16 rows]:
 *   Q4_0  codes, fp16 d[16]                                                            288 bytes
 *   Q4_1  codes, fp16 d[16], fp16 m[16]                                                320
 *   Q5_0  codes (low 4 bits), 1 chunk of high bits (byte 4 r + i: bit t + 4 h the high bit
 *         of element 16 h + 4 t + i), fp16 d[16]                                        352
 *   Q8_0  8 chunks (row r's int8 bytes 4 t..4 t + 3 of chunk t at 4 r), fp16 d[16]     544
 *   Q4_K  8 x codes, u8 sc[8][16], u8 mn[8][16], fp16 d[16], fp16 dmin[16]            2368
 *   Q6_K  8 x low 4 bits as codes, 8 x 2 chunks of high 2 bits (chunk p's byte 4 r + i: bits
 *         2 (2 w + h).. the high bits of element 16 h + 4 (2 p + w) + i), i8 sc[16][16] (per 16
 *         weights), fp16 d[16]                                                          3360
 * Records are as many bytes as the GGUF blocks they hold, but Q4_K's (+3 %: 6-bit scales
 * widened to bytes).
 *
 * Threads split the groups into contiguous ranges; each group is read from memory once and
 * serves every row of x from the L1 cache. Each output is summed in the same order whatever
 * the number of rows or threads, and each row of x is quantized on its own, so a row's result
 * never depends on the batch. The paths (scalar, avx2, avx512vnni) quantize x alike, bit for
 * bit, and may round their float sums differently from one another; each call names the one
 * it takes (quant_ops times them when an engine is built and keeps the fastest in the engine's
 * KernelPlan).
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
#define TARGET_VNNI                                                                                \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx2,fma,f16c")))
#define INLINE static inline __attribute__((always_inline))
/* Loops over a tile's rows of x and a block's chunks run unrolled, so that their vectors stay
 * in registers: GCC unrolls a loop of a constant count only while its body is small, and a
 * rolled loop keeps acc[i] in memory (a 4-row tile ran at half the speed of a 3-row one). */
#define UNROLL _Pragma("GCC unroll 8")
#else
#define X86 0
#endif

/* GGML's type ids; TYPES bounds them */
enum { Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q6_K = 14, TYPES };
#define QK 32
#define GROUP 16
#define CHUNK (4 * GROUP) /* bytes of 4 codes (or code bytes) of each row */

enum isa { SCALAR, AVX2, AVX512VNNI, ISAS };
static const char *const isa_names[] = {"scalar", "avx2", "avx512vnni"};

/* Where a record's parts start: its scales d (and m: Q4_1's m, Q4_K's dmin; sc: the K types'
 * 8-bit scales, mn: Q4_K's mins; high: Q5_0's and Q6_K's high bits), and its size. */
struct layout {
    int d, m, sc, mn, high, bytes;
};

struct call;

/* One GGML block type, a row of block_types (ggml's type traits): its record and arithmetic,
 * and its kernels. Each kernel is a template below compiled with the type a constant, so no
 * inner loop tests the type: a call looks its row up once and takes the kernel of its path. */
struct block_type {
    const char *name;
    int unit_blocks;    /* 32-blocks per unit */
    int code_offset;    /* the integer offset c (see the top) */
    int seeds_per_half; /* whether x's blocks carry a seed per 16-weight half: Q6_K has a scale
                           per half, and Q5_0's 5-bit products overflow AVX2's int16 sums of a
                           whole block, so it sums each half apart */
    struct layout at;
    /* x rows' products with group g of W, stored: per path (NULL where not compiled) */
    void (*group[ISAS])(const struct call *c, int64_t g);
    /* row r of a group as fp32 [0] or bf16 [1], from the group's records */
    void (*row[2])(void *out, const uint8_t *recs, int64_t blocks, int r);
    /* group g's rows as columns of W^T [in, n_out], fp32 [0] or bf16 [1]: avx512vnni only */
    void (*columns[2])(void *out, const uint8_t *recs, int64_t blocks, int64_t n_out, int64_t g);
};

/* The rows, indexed by the type; filled in at the end, once the kernels are compiled (the
 * templates read a row's record and arithmetic as constants). */
static const struct block_type block_types[TYPES];

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

/* The path named name, if this CPU runs it; else -1 with a ValueError set. */
static int isa_named(const char *name) {
    for (int isa = SCALAR; isa <= AVX512VNNI; isa++)
        if (strcmp(name, isa_names[isa]) == 0) {
            if (isa_runs(isa)) return isa;
            PyErr_Format(PyExc_ValueError, "quant_linear: this CPU cannot run %s", name);
            return -1;
        }
    PyErr_Format(PyExc_ValueError, "quant_linear: no path %s (scalar, avx2, avx512vnni)", name);
    return -1;
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
static inline __attribute__((always_inline)) int code(const uint8_t *rec, int qtype, int r, int j,
                                                      int k) {
    const int in_chunk = 4 * r + k % 4;
    if (qtype == Q8_0) return (uint8_t)(rec[CHUNK * (k / 4) + in_chunk] ^ 0x80);
    const uint8_t byte = rec[4 * CHUNK * j + CHUNK * (k % 16 / 4) + in_chunk];
    const int low = k < 16 ? byte & 15 : byte >> 4;
    if (qtype == Q5_0)
        return low | (rec[block_types[Q5_0].at.high + in_chunk] >> (k % 16 / 4 + 4 * (k / 16)) & 1)
                         << 4;
    if (qtype != Q6_K) return low;
    const int t = k % 16 / 4, shift = 2 * (2 * (t % 2) + k / 16);
    const uint8_t bits =
        rec[block_types[Q6_K].at.high + 2 * CHUNK * j + CHUNK * (t / 2) + in_chunk];
    return low | (bits >> shift & 3) << 4;
}

/* Row r's scales of 32-block j of a record: d of its two halves, and m. */
static inline __attribute__((always_inline)) void block_scales(const uint8_t *rec, int qtype, int r,
                                                               int j, float d[2], float *m) {
    const struct layout at = block_types[qtype].at;
    *m = 0.0f;
    switch (qtype) {
    case Q4_K:
        d[0] = d[1] = half_to_float(rec + at.d + 2 * r) * rec[at.sc + GROUP * j + r];
        *m = -(half_to_float(rec + at.m + 2 * r) * rec[at.mn + GROUP * j + r]);
        return;
    case Q6_K:
        for (int h = 0; h < 2; h++)
            d[h] = half_to_float(rec + at.d + 2 * r) * (int8_t)rec[at.sc + GROUP * (2 * j + h) + r];
        return;
    default:
        d[0] = d[1] = half_to_float(rec + at.d + 2 * r);
        if (qtype == Q4_1) *m = half_to_float(rec + at.m + 2 * r);
    }
}

/* A 32-block of a row of x as the kernels read it. */
struct xblock {
    union {
        int8_t q[QK];
        int32_t q4[QK / 4]; /* runs of 4, which the kernels broadcast from memory */
    };
    float dx, sx;    /* x ~= dx q; sx = dx sum q */
    int32_t seed[2]; /* -c sum q, or (seeds_per_half) -c times each half's sum */
};

/* A 32-block's seeds and sx from the sums of its halves' q. */
static inline __attribute__((always_inline)) void
finish_block(struct xblock *b, float dx, int32_t first, int32_t second, int c, int halves) {
    b->dx = dx;
    b->sx = dx * (float)(first + second);
    b->seed[0] = -c * (halves ? first : first + second);
    b->seed[1] = halves ? -c * second : 0;
}

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUFFLE __builtin_shufflevector
#endif

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
static inline __attribute__((always_inline)) void
quantize(struct xblock *out, const void *x, int64_t in, int c, int halves, const int is_bf16) {
    const vec8 round = (vec8){0.0f} + 12582912.0f;
    for (int64_t b = 0; b < in / QK; b++) {
        vec8 v[QK / LANES], amax = {0.0f};
        for (int k = 0; k < QK / LANES; k++) {
            v[k] = load_any(x, b * QK + k * LANES, is_bf16);
            const vec8 a = (vec8)((int8v)v[k] & 0x7fffffff);
            amax = select8(a > amax, a, amax);
        }
        const float max = max8(amax), dx = max / 127.0f, scale = max != 0.0f ? 127.0f / max : 0.0f;
        int8v sums[2] = {{0}, {0}};
        for (int k = 0; k < QK / LANES; k++) {
            const int8v qk = __builtin_convertvector((v[k] * scale + round) - round, int8v);
            sums[k / 2] += qk;
            for (int l = 0; l < LANES; l++) out[b].q[k * LANES + l] = (int8_t)qk[l];
        }
        int32_t half[2] = {0, 0};
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < LANES; l++) half[h] += sums[h][l];
        finish_block(out + b, dx, half[0], half[1], c, halves);
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
    int64_t rows, blocks, n_out, rec_bytes; /* rows of x: output rows times terms */
    int is_bf16, terms;
    int prefetch_bytes; /* how far the x86 paths prefetch W (prefetch.h) */
};

/* Output row m's sums over group g's rows (GROUP floats, row r's at r), plus the bias, stored;
 * a padding row of the last group is not. Inlined into each path and compiled with its
 * vectors: as a call per group into baseline (SSE) code it cost the AVX-512 tiles up to half
 * their time at a few rows. */
static inline __attribute__((always_inline)) void store_group(const struct call *c, int64_t m,
                                                              int64_t g, const float *sums) {
    const int64_t first = GROUP * g, at = m * c->n_out + first;
    if (c->n_out - first >= GROUP) {
        for (int h = 0; h < GROUP / LANES; h++) {
            vec8 v = load8(sums + LANES * h);
            if (c->bias != NULL) v += load_any(c->bias, first + LANES * h, c->is_bf16);
            store_any(c->out, at + LANES * h, v, c->is_bf16);
        }
        return;
    }
    for (int r = 0; r < c->n_out - first; r++) {
        float sum = sums[r];
        if (c->bias != NULL)
            sum += c->is_bf16 ? bf16_to_float(((const bf16 *)c->bias)[first + r])
                              : ((const float *)c->bias)[first + r];
        if (c->is_bf16)
            ((bf16 *)c->out)[at + r] = float_to_bf16(sum);
        else
            ((float *)c->out)[at + r] = sum;
    }
}

/* Two terms' integer sums of a block (or half) as one: 256 D + D', the product with x in 16
 * bits (see the top); one term's as they are. */
#define JOIN_TERMS(terms, first, second) ((terms) == 2 ? 256 * (first) + (second) : (first))

/* The portable path: correct everywhere, and the plainest statement of the arithmetic. */
static inline __attribute__((always_inline)) void scalar_group(const struct call *c, int64_t g,
                                                               const int qtype) {
    const int per_unit = block_types[qtype].unit_blocks, offset = block_types[qtype].code_offset;
    const uint8_t *recs = c->w + g * c->blocks / per_unit * c->rec_bytes;
    for (int64_t m = 0; m < c->rows / c->terms; m++) {
        float sums[GROUP];
        for (int r = 0; r < GROUP; r++) {
            float dot = 0.0f;
            for (int64_t b = 0; b < c->blocks; b++) {
                const uint8_t *rec = recs + b / per_unit * c->rec_bytes;
                const int j = b % per_unit;
                int32_t half[2][2] = {{0, 0}, {0, 0}}; /* [term][half] */
                float sx = 0.0f;
                for (int t = 0; t < c->terms; t++) {
                    const struct xblock *xb = c->x + (m * c->terms + t) * c->blocks + b;
                    for (int k = 0; k < QK; k++)
                        half[t][k / 16] += (code(rec, qtype, r, j, k) - offset) * xb->q[k];
                    sx += xb->sx;
                }
                const float dx = c->x[(m * c->terms + c->terms - 1) * c->blocks + b].dx;
                float d[2], mb;
                block_scales(rec, qtype, r, j, d, &mb);
                dot += dx * (d[0] * (float)JOIN_TERMS(c->terms, half[0][0], half[1][0]) +
                             d[1] * (float)JOIN_TERMS(c->terms, half[0][1], half[1][1])) +
                       mb * sx;
            }
            sums[r] = dot;
        }
        store_group(c, m, g, sums);
    }
}

/* The x86 paths prefetch W's stream prefetch_bytes beyond the end of the record being decoded:
 * the hardware prefetcher alone left a one-row pass waiting on memory for a third of its time
 * (it starts over at each 4 KB page), and the kernel's arithmetic did not overlap the misses.
 * Counted from the record's end, not its start, because a record is not read in address order: a
 * K type reads its high bits and scales, at the record's tail, from its first block on, and a
 * distance shorter than the record (Q6_K's is 3.3 KB) reached them too late. The distance that
 * does best depends on the machine: quant_ops times a few when an engine is built, with the path,
 * and passes the fastest with each call (benchmarks/README.md, "Prefetching W"). */
#define KERNEL_NAME "quant_linear"
#include "prefetch.h"

#if X86

/* The share of a record's prefetch that goes with its 32-block j of per_unit: a K type's
 * 2-3 KB record asked for at once stalls on the few misses a core can have in flight, where
 * a block's share at a time keeps pace with the arithmetic. */
INLINE void prefetch_block(const uint8_t *rec, const int bytes, const int j, const int per_unit,
                           const int prefetch_bytes) {
    const int share = (bytes + per_unit - 1) / per_unit;
    const uint8_t *ahead = rec + bytes + prefetch_bytes + j * share;
    for (int line = 0; line < share; line += 64)
        _mm_prefetch((const char *)ahead + line, _MM_HINT_T0);
}

/* AVX-512 VNNI. Per x row an accumulator of 16 floats, lane r row r's sum of d dx (u . q - c
 * sum q), and a second of its m sx. n_x rows of x run together (n_x a constant after
 * inlining), each using W's vectors decoded once. */
#define VNNI_X 6

/* 16 fp16 values as floats */
TARGET_VNNI INLINE __m512 halves16(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}

/* 16 bytes as 16 floats */
TARGET_VNNI INLINE __m512 bytes16(const uint8_t *p, const int is_signed) {
    const __m128i bytes = _mm_loadu_si128((const __m128i *)p);
    return _mm512_cvtepi32_ps(is_signed ? _mm512_cvtepi8_epi32(bytes)
                                        : _mm512_cvtepu8_epi32(bytes));
}

/* Block j of a record as its 16 rows' codes u: low[t] holds elements 4 t..4 t + 3 of each
 * row (row r in bytes 4 r..4 r + 3), high[t] elements 16 + 4 t..16 + 4 t + 3. */
TARGET_VNNI INLINE void vnni_codes(const uint8_t *rec, const struct layout at, const int j,
                                   const int qtype, __m512i low[4], __m512i high[4]) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), high2 = _mm512_set1_epi8(0x30);
    if (qtype == Q8_0) {
        const __m512i flip = _mm512_set1_epi8((char)0x80);
        UNROLL
        for (int t = 0; t < 4; t++) {
            low[t] = _mm512_xor_si512(_mm512_loadu_si512(rec + CHUNK * t), flip);
            high[t] = _mm512_xor_si512(_mm512_loadu_si512(rec + CHUNK * (4 + t)), flip);
        }
    } else {
        UNROLL
        for (int t = 0; t < 4; t++) {
            const __m512i codes = _mm512_loadu_si512(rec + 4 * CHUNK * j + CHUNK * t);
            low[t] = _mm512_and_si512(codes, low4);
            high[t] = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low4);
        }
    }
    if (qtype == Q5_0) { /* bit t + 4 h of the chunk's bytes moved to bit 4 */
        const __m512i bits = _mm512_loadu_si512(rec + at.high), bit4 = _mm512_set1_epi8(0x10);
        UNROLL
        for (int t = 0; t < 4; t++) {
            low[t] =
                _mm512_or_si512(low[t], _mm512_and_si512(_mm512_slli_epi16(bits, 4 - t), bit4));
            high[t] = _mm512_or_si512(high[t], _mm512_and_si512(_mm512_srli_epi16(bits, t), bit4));
        }
    }
    if (qtype == Q6_K) { /* bits 2 (2 w + h) of chunk p's bytes moved to bits 4, 5 */
        UNROLL
        for (int p = 0; p < 2; p++) {
            const __m512i bits = _mm512_loadu_si512(rec + at.high + 2 * CHUNK * j + CHUNK * p);
            low[2 * p] =
                _mm512_or_si512(low[2 * p], _mm512_and_si512(_mm512_slli_epi16(bits, 4), high2));
            high[2 * p] =
                _mm512_or_si512(high[2 * p], _mm512_and_si512(_mm512_slli_epi16(bits, 2), high2));
            low[2 * p + 1] = _mm512_or_si512(low[2 * p + 1], _mm512_and_si512(bits, high2));
            high[2 * p + 1] = _mm512_or_si512(high[2 * p + 1],
                                              _mm512_and_si512(_mm512_srli_epi16(bits, 2), high2));
        }
    }
}

/* Block j's scales per row (lane r): d of its two halves and m, from the unit's d and -dmin
 * (the K types'; exact products, as block_scales computes them). */
TARGET_VNNI INLINE void vnni_scales(const uint8_t *rec, const struct layout at, const int j,
                                    const int qtype, const __m512 unit_d, const __m512 unit_m,
                                    __m512 *d_low, __m512 *d_high, __m512 *m) {
    *m = _mm512_setzero_ps();
    if (qtype == Q6_K) {
        *d_low = _mm512_mul_ps(unit_d, bytes16(rec + at.sc + GROUP * 2 * j, 1));
        *d_high = _mm512_mul_ps(unit_d, bytes16(rec + at.sc + GROUP * (2 * j + 1), 1));
    } else if (qtype == Q4_K) {
        *d_low = *d_high = _mm512_mul_ps(unit_d, bytes16(rec + at.sc + GROUP * j, 0));
        *m = _mm512_mul_ps(unit_m, bytes16(rec + at.mn + GROUP * j, 0));
    } else {
        *d_low = *d_high = halves16(rec + at.d);
        if (qtype == Q4_1) *m = halves16(rec + at.m);
    }
}

/* A unit's d and -dmin per row (the K types'; zero for the others). */
TARGET_VNNI INLINE void vnni_unit_scales(const uint8_t *rec, const struct layout at,
                                         const int qtype, __m512 *unit_d, __m512 *unit_m) {
    *unit_d = *unit_m = _mm512_setzero_ps();
    if (qtype == Q4_K || qtype == Q6_K) *unit_d = halves16(rec + at.d);
    if (qtype == Q4_K) *unit_m = _mm512_sub_ps(_mm512_setzero_ps(), halves16(rec + at.m));
}

/* Integer vectors a and b of two terms as one, 256 a + b (JOIN_TERMS); a as it is for one. */
TARGET_VNNI INLINE __m512i vnni_join(const __m512i a, const __m512i b, const int terms) {
    return terms == 2 ? _mm512_add_epi32(_mm512_slli_epi32(a, 8), b) : a;
}

/* n_x rows of x (x rows m0.., each output row's terms next to each other) against group g. */
TARGET_VNNI INLINE void vnni_tile(const struct call *c, const uint8_t *recs, int64_t g, int64_t m0,
                                  const int n_x, const int terms, const int qtype) {
    const int per_unit = block_types[qtype].unit_blocks, n_rows = n_x / terms;
    const struct layout at = block_types[qtype].at;
    __m512 acc[VNNI_X], offsets[VNNI_X];
    UNROLL
    for (int i = 0; i < n_rows; i++) acc[i] = offsets[i] = _mm512_setzero_ps();
    for (int64_t unit = 0; unit < c->blocks / per_unit; unit++) {
        const uint8_t *rec = recs + unit * c->rec_bytes;
        __m512 unit_d, unit_m;
        vnni_unit_scales(rec, at, qtype, &unit_d, &unit_m);
        for (int j = 0; j < per_unit; j++) {
            const int64_t b = unit * per_unit + j;
            prefetch_block(rec, at.bytes, j, per_unit, c->prefetch_bytes);
            __m512i low[4], high[4]; /* elements 4 t.. and 16 + 4 t.. of each row */
            vnni_codes(rec, at, j, qtype, low, high);
            __m512 d_low, d_high, m;
            vnni_scales(rec, at, j, qtype, unit_d, unit_m, &d_low, &d_high, &m);
            __m512i dot_low[VNNI_X], dot_high[VNNI_X];
            UNROLL
            for (int i = 0; i < n_x; i++) {
                const struct xblock *xb = c->x + (m0 + i) * c->blocks + b;
                const int32_t *q4 = xb->q4;
                /* two chains per half, 2 deep, so that one row's blocks do not wait on
                 * vpdpbusd's latency */
                __m512i chain[4] = {_mm512_set1_epi32(xb->seed[0]), _mm512_setzero_si512(),
                                    _mm512_set1_epi32(xb->seed[1]), _mm512_setzero_si512()};
                UNROLL
                for (int t = 0; t < 4; t++) {
                    chain[t % 2] =
                        _mm512_dpbusd_epi32(chain[t % 2], low[t], _mm512_set1_epi32(q4[t]));
                    chain[2 + t % 2] = _mm512_dpbusd_epi32(chain[2 + t % 2], high[t],
                                                           _mm512_set1_epi32(q4[4 + t]));
                }
                dot_low[i] = _mm512_add_epi32(chain[0], chain[1]);
                dot_high[i] = _mm512_add_epi32(chain[2], chain[3]);
                if (qtype != Q6_K) dot_low[i] = _mm512_add_epi32(dot_low[i], dot_high[i]);
            }
            UNROLL
            for (int i = 0; i < n_rows; i++) {
                const struct xblock *first = c->x + (m0 + terms * i) * c->blocks + b;
                const struct xblock *last = first + (terms - 1) * c->blocks;
                const int t = terms * i;
                const __m512 dx = _mm512_set1_ps(last->dx);
                const __m512i dot = vnni_join(dot_low[t], dot_low[t + terms - 1], terms);
                acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d_low, dx), acc[i]);
                if (qtype == Q6_K) {
                    const __m512i second = vnni_join(dot_high[t], dot_high[t + terms - 1], terms);
                    acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(second), _mm512_mul_ps(d_high, dx),
                                             acc[i]);
                }
                if (qtype == Q4_1 || qtype == Q4_K)
                    offsets[i] = _mm512_fmadd_ps(
                        m, _mm512_set1_ps(terms == 2 ? first->sx + last->sx : first->sx),
                        offsets[i]);
            }
        }
    }
    UNROLL
    for (int i = 0; i < n_rows; i++) {
        float sums[GROUP];
        _mm512_storeu_ps(sums, _mm512_add_ps(acc[i], offsets[i]));
        store_group(c, m0 / terms + i, g, sums);
    }
}

/* The rows of x against group g, VNNI_X at a time, each output row's terms in one tile. */
TARGET_VNNI INLINE void vnni_rows(const struct call *c, const uint8_t *recs, int64_t g,
                                  const int terms, const int qtype) {
    int64_t m = 0;
    for (; m + VNNI_X <= c->rows; m += VNNI_X) vnni_tile(c, recs, g, m, VNNI_X, terms, qtype);
    switch (c->rows - m) { /* the rest in one pass over W */
    case 1: vnni_tile(c, recs, g, m, 1, terms, qtype); break;
    case 2: vnni_tile(c, recs, g, m, 2, terms, qtype); break;
    case 3: vnni_tile(c, recs, g, m, 3, terms, qtype); break;
    case 4: vnni_tile(c, recs, g, m, 4, terms, qtype); break;
    case 5: vnni_tile(c, recs, g, m, 5, terms, qtype); break;
    default: break;
    }
}

TARGET_VNNI INLINE void vnni_group(const struct call *c, int64_t g, const int qtype) {
    const uint8_t *recs = c->w + g * (c->blocks / block_types[qtype].unit_blocks) * c->rec_bytes;
    if (c->terms == 2)
        vnni_rows(c, recs, g, 2, qtype);
    else
        vnni_rows(c, recs, g, 1, qtype);
}

/* quantize() in AVX-512: the same arithmetic (vcvtps2dq rounds to nearest even, as the
 * generic code's add and subtract of 1.5 * 2^23 does) in a quarter of the instructions: a
 * one-row step quantizes x once per linear. */
TARGET_VNNI static void quantize_vnni(struct xblock *out, const void *x, int64_t in, int c,
                                      int halves, int is_bf16) {
    const __m128i ones = _mm_set1_epi8(1);
    for (int64_t b = 0; b < in / QK; b++) {
        __m512 v[2];
        UNROLL
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
        int32_t half[2];
        UNROLL
        for (int h = 0; h < 2; h++) {
            const __m512i rounded = _mm512_cvtps_epi32(_mm512_mul_ps(v[h], _mm512_set1_ps(scale)));
            const __m128i q = _mm512_cvtepi32_epi8(rounded);
            _mm_storeu_si128((__m128i *)(out[b].q + 16 * h), q);
            const __m128i fours = _mm_dpbusd_epi32(_mm_setzero_si128(), ones, q); /* sums of 4 */
            half[h] = (_mm_extract_epi32(fours, 0) + _mm_extract_epi32(fours, 1)) +
                      (_mm_extract_epi32(fours, 2) + _mm_extract_epi32(fours, 3));
        }
        finish_block(out + b, dx, half[0], half[1], c, halves);
    }
}

/* 16 values, lane r at column r of a row of W^T from at on, fp32 or bf16 (rounded as
 * float_to_bf16 rounds a finite value); mask: the group's rows that exist. */
TARGET_VNNI INLINE void store_column(void *out, const int64_t at, const __m512 v,
                                     const __mmask16 mask, const int is_bf16) {
    if (is_bf16) {
        const __m512i bits = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
        const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd));
        _mm512_mask_cvtepi32_storeu_epi16((bf16 *)out + at, mask, _mm512_srli_epi32(up, 16));
    } else {
        _mm512_mask_storeu_ps((float *)out + at, mask, v);
    }
}

/* Group g's 16 rows of W as columns 16 g.. of W^T [in, n_out]: each element of a block is one
 * vector of the rows' values, d u + (m - c d), which is d (u - c) + m exactly as
 * dequantize_row computes it (d (u - c) and c d are exact, so one rounding either way). */
TARGET_VNNI INLINE void vnni_dequantize_group(void *out, const uint8_t *recs, int64_t blocks,
                                              int64_t n_out, int64_t g, const int qtype,
                                              const int is_bf16) {
    const int per_unit = block_types[qtype].unit_blocks;
    const struct layout at = block_types[qtype].at;
    const int64_t rows = n_out - GROUP * g < GROUP ? n_out - GROUP * g : GROUP;
    const __mmask16 mask = (__mmask16)((1u << rows) - 1);
    const __m512 c = _mm512_set1_ps((float)block_types[qtype].code_offset);
    const __m512i byte = _mm512_set1_epi32(0xff);
    for (int64_t unit = 0; unit < blocks / per_unit; unit++) {
        const uint8_t *rec = recs + unit * at.bytes;
        __m512 unit_d, unit_m;
        vnni_unit_scales(rec, at, qtype, &unit_d, &unit_m);
        for (int j = 0; j < per_unit; j++) {
            __m512i low[4], high[4];
            vnni_codes(rec, at, j, qtype, low, high);
            __m512 d_low, d_high, m;
            vnni_scales(rec, at, j, qtype, unit_d, unit_m, &d_low, &d_high, &m);
            const __m512 base_low = _mm512_fnmadd_ps(c, d_low, m);
            const __m512 base_high = _mm512_fnmadd_ps(c, d_high, m);
            const int64_t k0 = (unit * per_unit + j) * QK;
            UNROLL
            for (int t = 0; t < 4; t++) {
                UNROLL
                for (int i = 0; i < 4; i++) {
                    const __m512 u_low = _mm512_cvtepi32_ps(
                        _mm512_and_si512(_mm512_srli_epi32(low[t], 8 * i), byte));
                    const __m512 u_high = _mm512_cvtepi32_ps(
                        _mm512_and_si512(_mm512_srli_epi32(high[t], 8 * i), byte));
                    const int64_t k = k0 + 4 * t + i;
                    store_column(out, k * n_out + GROUP * g,
                                 _mm512_fmadd_ps(d_low, u_low, base_low), mask, is_bf16);
                    store_column(out, (k + 16) * n_out + GROUP * g,
                                 _mm512_fmadd_ps(d_high, u_high, base_high), mask, is_bf16);
                }
            }
        }
    }
}

/* AVX2: as the VNNI path with 256-bit vectors, half h (h = 0, 1) of a group's rows, 8 h..8 h +
 * 7, in the 32 bytes at 32 h of each chunk. vpmaddubsw multiplies unsigned codes by the signed x
 * in pairs into int16 lanes and vpmaddwd sums those pairs into the int32 lanes vpdpbusd fills.
 * Pairs are summed as int16 as long as they cannot overflow: a 4-bit code's (at most 2 * 15 *
 * 127) over the whole 32-block, a 5-bit one's over each 16-weight half, a 6-bit one's (2 * 63 *
 * 127) two at a time. Q8_0's codes as unsigned would overflow a pair (255 * 127 * 2), so they
 * stay signed: |s| times x with s's sign, and c = 0.
 *
 * Counted in instructions, as the path is bound by them where a core splits each 256-bit
 * operation in two (AMD Zen 1): x's 4-byte runs are broadcast once for both halves of the rows,
 * two chunks at a time; Q4_1's and Q4_K's c = 0 adds no seed; a K type sums its 32-blocks over
 * the super-block with their 6- or 8-bit scales and applies its fp16 d (and Q4_K's dmin) once. */
#define AVX2_X 2

/* 8 fp16 values as floats */
TARGET_AVX2 INLINE __m256 halves8(const uint8_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

/* 8 bytes as 8 floats */
TARGET_AVX2 INLINE __m256 bytes8(const uint8_t *p, const int is_signed) {
    const __m128i bytes = _mm_loadl_epi64((const __m128i *)p);
    return _mm256_cvtepi32_ps(is_signed ? _mm256_cvtepi8_epi32(bytes)
                                        : _mm256_cvtepu8_epi32(bytes));
}

TARGET_AVX2 INLINE __m256i pairs(__m256i w, __m256i q, const int is_signed) {
    return is_signed ? _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(q, w))
                     : _mm256_maddubs_epi16(w, q);
}

/* s + v, each kept in a register: left to itself GCC reassociates a block's sums into a tree
 * wider than the 16 vector registers and spills its parts to the stack */
TARGET_AVX2 INLINE __m256i add16(__m256i s, const __m256i v) {
    s = _mm256_add_epi16(s, v);
    __asm__("" : "+x"(s));
    return s;
}

TARGET_AVX2 INLINE __m256i add32(__m256i s, const __m256i v) {
    s = _mm256_add_epi32(s, v);
    __asm__("" : "+x"(s));
    return s;
}

TARGET_AVX2 INLINE __m256i load32(const uint8_t *p) {
    return _mm256_loadu_si256((const __m256i *)p);
}

/* Rows 8 h.. of chunk t of 32-block j: codes of elements 4 t.. (low) and 16 + 4 t.. (high). */
TARGET_AVX2 INLINE void avx2_codes(const uint8_t *rec, const int j, const int t, const int h,
                                   __m256i *low, __m256i *high, const int qtype) {
    const struct layout at = block_types[qtype].at;
    const __m256i low4 = _mm256_set1_epi8(0x0f), high2 = _mm256_set1_epi8(0x30);
    if (qtype == Q8_0) {
        *low = load32(rec + CHUNK * t + 32 * h);
        *high = load32(rec + CHUNK * (4 + t) + 32 * h);
        return;
    }
    const __m256i codes = load32(rec + 4 * CHUNK * j + CHUNK * t + 32 * h);
    *low = _mm256_and_si256(codes, low4);
    *high = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low4);
    if (qtype == Q5_0) { /* as in the AVX-512 tile */
        const __m256i bits = load32(rec + at.high + 32 * h), bit4 = _mm256_set1_epi8(0x10);
        *low = _mm256_or_si256(*low, _mm256_and_si256(_mm256_slli_epi16(bits, 4 - t), bit4));
        *high = _mm256_or_si256(*high, _mm256_and_si256(_mm256_srli_epi16(bits, t), bit4));
    }
    /* Q6_K: low's and high's top 2 bits, bits 4 w and 4 w + 2 (w = t % 2) of chunk t / 2's
     * bytes, moved to bits 4, 5 */
    if (qtype == Q6_K) {
        const __m256i bits = load32(rec + at.high + 2 * CHUNK * j + CHUNK * (t / 2) + 32 * h);
        const __m256i to_low = t % 2 ? bits : _mm256_slli_epi16(bits, 4);
        const __m256i to_high = t % 2 ? _mm256_srli_epi16(bits, 2) : _mm256_slli_epi16(bits, 2);
        *low = _mm256_or_si256(*low, _mm256_and_si256(to_low, high2));
        *high = _mm256_or_si256(*high, _mm256_and_si256(to_high, high2));
    }
}

/* n_x rows of x (x rows m0.., each output row's terms next to each other) against group g. */
TARGET_AVX2 INLINE void avx2_tile(const struct call *c, const uint8_t *recs, int64_t g, int64_t m0,
                                  const int n_x, const int terms, const int qtype) {
    const __m256i ones = _mm256_set1_epi16(1);
    const int per_unit = block_types[qtype].unit_blocks, k_type = per_unit > 1;
    const int is_signed = qtype == Q8_0;
    const struct layout at = block_types[qtype].at;
    /* Q4_1's m sx apart from the rest until the end, as the VNNI tile sums them */
    __m256 acc[AVX2_X][2], offsets[AVX2_X][2];
    UNROLL
    for (int i = 0; i < n_x; i++) UNROLL
    for (int h = 0; h < 2; h++) acc[i][h] = offsets[i][h] = _mm256_setzero_ps();
    for (int64_t unit = 0; unit < c->blocks / per_unit; unit++) {
        const uint8_t *rec = recs + unit * c->rec_bytes;
        /* a K type's sums over its super-block before its d scales them, and Q4_K's of its
         * mins before its dmin does */
        __m256 unit_sum[AVX2_X][2], unit_min[AVX2_X][2];
        UNROLL
        for (int i = 0; i < n_x; i++) UNROLL
        for (int h = 0; h < 2; h++) unit_sum[i][h] = unit_min[i][h] = _mm256_setzero_ps();
        for (int j = 0; j < per_unit; j++) {
            const int64_t b = unit * per_unit + j;
            const struct xblock *xb[AVX2_X];
            UNROLL
            for (int i = 0; i < n_x; i++) xb[i] = c->x + (m0 + i) * c->blocks + b;
            prefetch_block(rec, at.bytes, j, per_unit, c->prefetch_bytes);
            /* int16 sums of pairs: a 4-bit type's over the block, Q5_0's per half (index 1
             * the high half); int32 dots per half (Q6_K, Q8_0) */
            __m256i sums16[AVX2_X][2][2], dots[AVX2_X][2][2];
            UNROLL
            for (int i = 0; i < n_x; i++) UNROLL
            for (int h = 0; h < 2; h++) UNROLL
            for (int half = 0; half < 2; half++)
                sums16[i][h][half] = dots[i][h][half] = _mm256_setzero_si256();
            UNROLL
            for (int t = 0; t < 4; t += 2) {
                __m256i q[AVX2_X][4]; /* x's runs for elements 4 t.., 4 t + 4.., 16 + ... */
                UNROLL
                for (int i = 0; i < n_x; i++) UNROLL
                for (int k = 0; k < 4; k++)
                    q[i][k] = _mm256_set1_epi32(xb[i]->q4[t + k % 2 + 4 * (k / 2)]);
                UNROLL
                for (int h = 0; h < 2; h++) {
                    __m256i w[4]; /* low of t, t + 1, high of t, t + 1 */
                    avx2_codes(rec, j, t, h, &w[0], &w[2], qtype);
                    avx2_codes(rec, j, t + 1, h, &w[1], &w[3], qtype);
                    UNROLL
                    for (int i = 0; i < n_x; i++) {
                        __m256i p[4];
                        UNROLL
                        for (int k = 0; k < 4; k++) p[k] = pairs(w[k], q[i][k], is_signed);
                        if (qtype == Q8_0) {
                            UNROLL
                            for (int k = 0; k < 4; k++)
                                dots[i][h][0] = add32(dots[i][h][0], _mm256_madd_epi16(p[k], ones));
                        } else if (qtype == Q6_K) {
                            UNROLL
                            for (int half = 0; half < 2; half++)
                                dots[i][h][half] = add32(
                                    dots[i][h][half],
                                    _mm256_madd_epi16(
                                        _mm256_add_epi16(p[2 * half], p[2 * half + 1]), ones));
                        } else {
                            UNROLL
                            for (int k = 0; k < 4; k++) /* Q5_0 sums each half apart */
                                sums16[i][h][qtype == Q5_0 ? k / 2 : 0] =
                                    add16(sums16[i][h][qtype == Q5_0 ? k / 2 : 0], p[k]);
                        }
                    }
                }
            }
            UNROLL
            for (int h = 0; h < 2; h++) {
                __m256 scale[2], min = _mm256_setzero_ps(); /* per half: d, or a K type's sc */
                if (qtype == Q6_K) {
                    UNROLL
                    for (int half = 0; half < 2; half++)
                        scale[half] = bytes8(rec + at.sc + GROUP * (2 * j + half) + 8 * h, 1);
                } else if (qtype == Q4_K) {
                    scale[0] = bytes8(rec + at.sc + GROUP * j + 8 * h, 0);
                    min = bytes8(rec + at.mn + GROUP * j + 8 * h, 0);
                } else {
                    scale[0] = halves8(rec + at.d + 16 * h);
                    if (qtype == Q4_1) min = halves8(rec + at.m + 16 * h);
                }
                /* each x row's int32 dot per half (Q6_K) or over the block (index 0), seeded */
                __m256i dot[AVX2_X][2];
                UNROLL
                for (int i = 0; i < n_x; i++) {
                    if (qtype == Q6_K) {
                        UNROLL
                        for (int half = 0; half < 2; half++)
                            dot[i][half] = _mm256_add_epi32(
                                dots[i][h][half], _mm256_set1_epi32(xb[i]->seed[half]));
                        continue;
                    }
                    dot[i][0] = dots[i][h][0];
                    if (qtype != Q8_0) dot[i][0] = _mm256_madd_epi16(sums16[i][h][0], ones);
                    if (qtype == Q5_0)
                        dot[i][0] = _mm256_add_epi32(
                            dot[i][0], _mm256_add_epi32(_mm256_madd_epi16(sums16[i][h][1], ones),
                                                        _mm256_set1_epi32(xb[i]->seed[1])));
                    if (qtype == Q4_0 || qtype == Q5_0) /* c = 0 for Q4_1, signed Q8_0 */
                        dot[i][0] = _mm256_add_epi32(dot[i][0], _mm256_set1_epi32(xb[i]->seed[0]));
                }
                UNROLL
                for (int i = 0; i < n_x / terms; i++) {
                    const int first = terms * i, last = first + terms - 1;
                    const __m256 dx = _mm256_set1_ps(xb[last]->dx);
                    const __m256 sx = _mm256_set1_ps(terms == 2 ? xb[first]->sx + xb[last]->sx
                                                                : xb[first]->sx);
                    __m256 *const sum = k_type ? &unit_sum[i][h] : &acc[i][h];
                    for (int half = 0; half < (qtype == Q6_K ? 2 : 1); half++) {
                        const __m256i joined =
                            terms == 2 ? _mm256_add_epi32(_mm256_slli_epi32(dot[first][half], 8),
                                                          dot[last][half])
                                       : dot[first][half];
                        *sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(joined),
                                               _mm256_mul_ps(scale[half], dx), *sum);
                    }
                    if (qtype == Q4_1) offsets[i][h] = _mm256_fmadd_ps(min, sx, offsets[i][h]);
                    if (qtype == Q4_K) unit_min[i][h] = _mm256_fmadd_ps(min, sx, unit_min[i][h]);
                }
            }
        }
        if (k_type) {
            UNROLL
            for (int h = 0; h < 2; h++) {
                const __m256 d = halves8(rec + at.d + 16 * h);
                const __m256 dmin = qtype == Q4_K ? halves8(rec + at.m + 16 * h) : d;
                UNROLL
                for (int i = 0; i < n_x / terms; i++) {
                    acc[i][h] = _mm256_fmadd_ps(unit_sum[i][h], d, acc[i][h]);
                    if (qtype == Q4_K)
                        acc[i][h] = _mm256_fnmadd_ps(unit_min[i][h], dmin, acc[i][h]);
                }
            }
        }
    }
    UNROLL
    for (int i = 0; i < n_x / terms; i++) {
        float sums[GROUP];
        UNROLL
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(sums + 8 * h, qtype == Q4_1 ? _mm256_add_ps(acc[i][h], offsets[i][h])
                                                         : acc[i][h]);
        store_group(c, m0 / terms + i, g, sums);
    }
}

TARGET_AVX2 INLINE void avx2_group(const struct call *c, int64_t g, const int qtype) {
    const uint8_t *recs = c->w + g * (c->blocks / block_types[qtype].unit_blocks) * c->rec_bytes;
    int64_t m = 0;
    if (c->terms == 2) { /* a tile is one output row's two terms */
        for (; m < c->rows; m += AVX2_X) avx2_tile(c, recs, g, m, AVX2_X, 2, qtype);
        return;
    }
    for (; m + AVX2_X <= c->rows; m += AVX2_X) avx2_tile(c, recs, g, m, AVX2_X, 1, qtype);
    for (; m < c->rows; m++) avx2_tile(c, recs, g, m, 1, 1, qtype);
}

/* quantize() in AVX2, as quantize_vnni() is in AVX-512 */
TARGET_AVX2 static void quantize_avx2(struct xblock *out, const void *x, int64_t in, int c,
                                      int halves, int is_bf16) {
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
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
        const __m256i packed =
            _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        const __m256i bytes =
            _mm256_permutevar8x32_epi32(packed, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)out[b].q, bytes);
        const __m256i fours = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(1), bytes),
                                                _mm256_set1_epi16(1)); /* sums of 4 */
        int32_t sums[8];
        _mm256_storeu_si256((__m256i *)sums, fours);
        finish_block(out + b, dx, (sums[0] + sums[1]) + (sums[2] + sums[3]),
                     (sums[4] + sums[5]) + (sums[6] + sums[7]), c, halves);
    }
}

#endif

/* Row r of a group as fp32 or bf16, from the group's records. Exact, as the gguf package
 * computes it: d (u - c) + m has at most 24 significant bits. */
static inline __attribute__((always_inline)) void dequantize_row(void *out, const uint8_t *recs,
                                                                 int64_t blocks, int qtype, int r,
                                                                 const int is_bf16) {
    const int per_unit = block_types[qtype].unit_blocks, offset = block_types[qtype].code_offset;
    const int64_t rec_bytes = block_types[qtype].at.bytes;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *rec = recs + b / per_unit * rec_bytes;
        const int j = b % per_unit;
        /* row r's bytes of the block's chunks, then codes in loops the compiler vectorizes */
        uint8_t bytes[QK], high[8];
        int u[QK];
        const uint8_t *codes = rec + (qtype == Q8_0 ? 0 : 4 * CHUNK * j) + 4 * r;
        for (int t = 0; t < (qtype == Q8_0 ? 8 : 4); t++)
            memcpy(bytes + 4 * t, codes + CHUNK * t, 4);
        if (qtype == Q8_0)
            for (int k = 0; k < QK; k++) u[k] = bytes[k] ^ 0x80;
        else
            for (int k = 0; k < 16; k++) {
                u[k] = bytes[k] & 15;
                u[16 + k] = bytes[k] >> 4;
            }
        if (qtype == Q5_0) {
            memcpy(high, rec + block_types[Q5_0].at.high + 4 * r, 4);
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 16; k++) /* k = 4 t + i */
                    u[16 * h + k] |= (high[k % 4] >> (k / 4 + 4 * h) & 1) << 4;
        }
        if (qtype == Q6_K) {
            for (int p = 0; p < 2; p++)
                memcpy(high + 4 * p,
                       rec + block_types[Q6_K].at.high + 2 * CHUNK * j + CHUNK * p + 4 * r, 4);
            for (int h = 0; h < 2; h++)
                for (int k = 0; k < 16; k++) /* k = 4 (2 p + w) + i */
                    u[16 * h + k] |= (high[4 * (k / 8) + k % 4] >> 2 * (2 * (k / 4 % 2) + h) & 3)
                                     << 4;
        }
        float d[2], m, value[QK];
        block_scales(rec, qtype, r, j, d, &m);
        for (int k = 0; k < QK; k++) value[k] = d[k / 16] * (float)(u[k] - offset) + m;
        for (int k = 0; k < QK; k += LANES) store_any(out, b * QK + k, load8(value + k), is_bf16);
    }
}

/* Each type's kernels: the templates above compiled with the type a constant. */
#define PORTABLE_KERNELS(T)                                                                        \
    static void group_scalar_##T(const struct call *c, int64_t g) { scalar_group(c, g, T); }       \
    VECTOR_CLONES static void row_fp32_##T(void *out, const uint8_t *recs, int64_t blocks,         \
                                           int r) {                                                \
        dequantize_row(out, recs, blocks, T, r, 0);                                                \
    }                                                                                              \
    VECTOR_CLONES static void row_bf16_##T(void *out, const uint8_t *recs, int64_t blocks,         \
                                           int r) {                                                \
        dequantize_row(out, recs, blocks, T, r, 1);                                                \
    }
#if X86
#define X86_KERNELS(T)                                                                             \
    TARGET_AVX2 static void group_avx2_##T(const struct call *c, int64_t g) {                      \
        avx2_group(c, g, T);                                                                       \
    }                                                                                              \
    TARGET_VNNI static void group_vnni_##T(const struct call *c, int64_t g) {                      \
        vnni_group(c, g, T);                                                                       \
    }                                                                                              \
    TARGET_VNNI static void columns_fp32_##T(void *out, const uint8_t *recs, int64_t blocks,       \
                                             int64_t n_out, int64_t g) {                           \
        vnni_dequantize_group(out, recs, blocks, n_out, g, T, 0);                                  \
    }                                                                                              \
    TARGET_VNNI static void columns_bf16_##T(void *out, const uint8_t *recs, int64_t blocks,       \
                                             int64_t n_out, int64_t g) {                           \
        vnni_dequantize_group(out, recs, blocks, n_out, g, T, 1);                                  \
    }
#define KERNELS_OF(T)                                                                              \
    .group = {group_scalar_##T, group_avx2_##T, group_vnni_##T},                                   \
    .row = {row_fp32_##T, row_bf16_##T}, .columns = {columns_fp32_##T, columns_bf16_##T}
#else
#define X86_KERNELS(T)
#define KERNELS_OF(T) .group = {group_scalar_##T}, .row = {row_fp32_##T, row_bf16_##T}
#endif
#define KERNELS(T) PORTABLE_KERNELS(T) X86_KERNELS(T)

KERNELS(Q4_0)
KERNELS(Q4_1)
KERNELS(Q5_0)
KERNELS(Q8_0)
KERNELS(Q4_K)
KERNELS(Q6_K)

/* The rows. A record's layout is what quant_blocks.py's row of the type packs (the top draws
 * it). Adding a type is its arithmetic in the templates, a KERNELS line and a row here. */
static const struct block_type block_types[TYPES] = {
    [Q4_0] = {.name = "Q4_0", .unit_blocks = 1, .code_offset = 8,
              .at = {.d = 256, .bytes = 288}, KERNELS_OF(Q4_0)},
    [Q4_1] = {.name = "Q4_1", .unit_blocks = 1, .code_offset = 0,
              .at = {.d = 256, .m = 288, .bytes = 320}, KERNELS_OF(Q4_1)},
    [Q5_0] = {.name = "Q5_0", .unit_blocks = 1, .code_offset = 16, .seeds_per_half = 1,
              .at = {.high = 256, .d = 320, .bytes = 352}, KERNELS_OF(Q5_0)},
    [Q8_0] = {.name = "Q8_0", .unit_blocks = 1, .code_offset = 128,
              .at = {.d = 512, .bytes = 544}, KERNELS_OF(Q8_0)},
    [Q4_K] = {.name = "Q4_K", .unit_blocks = 8, .code_offset = 0,
              .at = {.sc = 2048, .mn = 2176, .d = 2304, .m = 2336, .bytes = 2368},
              KERNELS_OF(Q4_K)},
    [Q6_K] = {.name = "Q6_K", .unit_blocks = 8, .code_offset = 32, .seeds_per_half = 1,
              .at = {.high = 2048, .sc = 3072, .d = 3328, .bytes = 3360}, KERNELS_OF(Q6_K)},
};

/* qtype's row of block_types where it has one and the kernels take in_features; else NULL,
 * with a ValueError set. */
static const struct block_type *block_type_of(int qtype, int64_t in_features) {
    if (qtype < 0 || qtype >= TYPES || block_types[qtype].name == NULL) {
        char names[64] = "";
        for (int t = 0; t < TYPES; t++)
            if (block_types[t].name != NULL)
                snprintf(names + strlen(names), sizeof names - strlen(names), "%s%s",
                         names[0] ? ", " : "", block_types[t].name);
        PyErr_Format(PyExc_ValueError, "quant_linear: GGML type %d has no kernel (%s)", qtype,
                     names);
        return NULL;
    }
    const struct block_type *type = block_types + qtype;
    if (in_features % (QK * type->unit_blocks) != 0) {
        PyErr_Format(PyExc_ValueError, "quant_linear: in_features %lld is not a multiple of %d",
                     (long long)in_features, QK * type->unit_blocks);
        return NULL;
    }
    return type;
}

/* Whether w_bytes of packed records hold W [n_out, in_features] (n_out rows in groups of GROUP,
 * the last one padded); sets a ValueError if not. The caller's sizes are checked against the
 * buffer it hands over, so that no size can send a kernel reading past its end. */
static int check_weight_bytes(Py_ssize_t w_bytes, int64_t n_out, int64_t in_features,
                              const struct block_type *type) {
    const int64_t group_bytes = in_features / QK / type->unit_blocks * type->at.bytes;
    const int64_t groups = (n_out + GROUP - 1) / GROUP;
    if (n_out < 0 || w_bytes < 0 || (group_bytes > 0 && groups > w_bytes / group_bytes)) {
        PyErr_Format(PyExc_ValueError,
                     "quant_linear: W [%lld, %lld] needs %lld groups of %lld bytes, but its packed "
                     "buffer holds %lld bytes",
                     (long long)n_out, (long long)in_features, (long long)groups,
                     (long long)group_bytes, (long long)w_bytes);
        return 0;
    }
    return 1;
}

typedef void (*quantize_fn)(struct xblock *, const void *, int64_t, int, int, int);

/* The second term of a row of x (fp32 or bf16) from its first, first[b] the int8 block b with
 * scale dx: what it leaves, x - dx q (rounded to fp32), times 256 / dx, rounded to the nearest
 * integer (ties to even, as quantize() rounds) and clamped to +-127, with the fixed scale
 * dx / 256 (the clamp moves an element only where x - dx q is within dx / 512 of dx / 2).
 * Every operation is one IEEE rounding, so NumPy reproduces it exactly. */
static inline __attribute__((always_inline)) void
second_term(struct xblock *out, const struct xblock *first, const void *x, int64_t in, int c,
            int halves, const int is_bf16) {
    const vec8 round = (vec8){0.0f} + 12582912.0f, limit = (vec8){0.0f} + 127.0f;
    for (int64_t b = 0; b < in / QK; b++) {
        const float dx = first[b].dx, scale = dx != 0.0f ? 256.0f / dx : 0.0f;
        int8v sums[2] = {{0}, {0}};
        for (int k = 0; k < QK / LANES; k++) {
            int8v q;
            for (int l = 0; l < LANES; l++) q[l] = first[b].q[k * LANES + l];
            const vec8 left = load_any(x, b * QK + k * LANES, is_bf16) -
                              dx * __builtin_convertvector(q, vec8);
            vec8 r = (left * scale + round) - round;
            r = select8(r > limit, limit, select8(r < -limit, -limit, r));
            const int8v rk = __builtin_convertvector(r, int8v);
            sums[k / 2] += rk;
            for (int l = 0; l < LANES; l++) out[b].q[k * LANES + l] = (int8_t)rk[l];
        }
        int32_t half[2] = {0, 0};
        for (int h = 0; h < 2; h++)
            for (int l = 0; l < LANES; l++) half[h] += sums[h][l];
        finish_block(out + b, dx / 256.0f, half[0], half[1], c, halves);
    }
}

FP32_AND_BF16(second_term,
              (struct xblock * out, const struct xblock *first, const void *x, int64_t in, int c,
               int halves),
              out, first, x, in, c, halves)

/* Row m of x as `terms` rows of xblocks from xq + m * terms * blocks on: its int8 blocks q with
 * scale dx and, for two terms, the second term (second_term) after them. */
static void quantize_terms(quantize_fn quantize_row, struct xblock *xq, const void *x, int64_t in,
                           const struct block_type *type, int is_bf16, int terms) {
    const int c = type->code_offset, halves = type->seeds_per_half;
    quantize_row(xq, x, in, c, halves, is_bf16);
    if (terms == 2)
        (is_bf16 ? second_term_bf16 : second_term_fp32)(xq + in / QK, xq, x, in, c, halves);
}

static PyObject *linear(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, x, w, w_bytes, bias, rows, in_features, n_out;
    int qtype, is_bf16, terms, prefetch_bytes;
    const char *isa_name;
    if (!PyArg_ParseTuple(args, "nnnnnnnnipisi", &out, &x, &w, &w_bytes, &bias, &rows,
                          &in_features, &n_out, &qtype, &is_bf16, &terms, &isa_name,
                          &prefetch_bytes) ||
        !check_prefetch(prefetch_bytes))
        return NULL;
    const int isa = isa_named(isa_name);
    if (isa < 0) return NULL;
    const struct block_type *type = block_type_of(qtype, in_features);
    if (type == NULL || !check_weight_bytes(w_bytes, n_out, in_features, type)) return NULL;
    if (terms != 1 && terms != 2) {
        PyErr_Format(PyExc_ValueError, "quant_linear: x in %d terms (1: int8, 2: int8x2)", terms);
        return NULL;
    }
    const int64_t blocks = in_features / QK;
    struct xblock *xq = malloc(sizeof(struct xblock) * (rows * terms * blocks + 1));
    if (xq == NULL) return PyErr_NoMemory();
    const struct call c = {(void *)out,  (const uint8_t *)w, xq,    (const void *)bias,
                           rows * terms, blocks,             n_out, type->at.bytes,
                           is_bf16,      terms,              prefetch_bytes};
    void (*const group)(const struct call *, int64_t) = type->group[isa];
    const size_t x_row_bytes = in_features * (is_bf16 ? sizeof(bf16) : sizeof(float));
    Py_BEGIN_ALLOW_THREADS;
    quantize_fn quantize_row = quantize_generic;
#if X86
    if (isa == AVX512VNNI) quantize_row = quantize_vnni;
    if (isa == AVX2) quantize_row = quantize_avx2;
#endif
    /* A few rows are quantized on this thread: cheaper than the threads meeting at a barrier. */
    if (rows > 8) {
#pragma omp parallel for schedule(static)
        for (int64_t m = 0; m < rows; m++)
            quantize_terms(quantize_row, xq + m * terms * blocks, (const char *)x + m * x_row_bytes,
                           in_features, type, is_bf16, terms);
    } else {
        for (int64_t m = 0; m < rows; m++)
            quantize_terms(quantize_row, xq + m * terms * blocks, (const char *)x + m * x_row_bytes,
                           in_features, type, is_bf16, terms);
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

/* W as fp32 or bf16 [n_out, in] from its packed records, or (transposed, on the AVX-512 path
 * only, which writes a column's 16 rows at once) W^T [in, n_out]: the many-row products take a
 * GEMM. */
static PyObject *dequantize(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, w, w_bytes, n_out, in_features;
    int qtype, is_bf16, transposed;
    if (!PyArg_ParseTuple(args, "nnnnnipp", &out, &w, &w_bytes, &n_out, &in_features, &qtype,
                          &is_bf16, &transposed))
        return NULL;
    const struct block_type *type = block_type_of(qtype, in_features);
    if (type == NULL || !check_weight_bytes(w_bytes, n_out, in_features, type)) return NULL;
    if (transposed && !isa_runs(AVX512VNNI)) {
        PyErr_SetString(PyExc_ValueError, "quant_linear: W^T is written on the avx512vnni path "
                                          "only, which this CPU does not run");
        return NULL;
    }
    const int64_t blocks = in_features / QK;
    const int64_t group_bytes = blocks / type->unit_blocks * type->at.bytes;
    const size_t row_bytes = in_features * (is_bf16 ? sizeof(bf16) : sizeof(float));
    Py_BEGIN_ALLOW_THREADS;
    if (transposed) {
        void (*const columns)(void *, const uint8_t *, int64_t, int64_t, int64_t) =
            type->columns[is_bf16];
#pragma omp parallel for schedule(static)
        for (int64_t g = 0; g < (n_out + GROUP - 1) / GROUP; g++)
            columns((void *)out, (const uint8_t *)w + g * group_bytes, blocks, n_out, g);
    } else {
        void (*const row)(void *, const uint8_t *, int64_t, int) = type->row[is_bf16];
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < n_out; n++)
            row((char *)out + n * row_bytes, (const uint8_t *)w + n / GROUP * group_bytes, blocks,
                n % GROUP);
    }
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* Rows ids of W as fp32 or bf16 [n_ids, in_features], from its packed records: an embedding
 * table kept in its blocks, looked up a step's tokens at a time, each row decoded as dequantize
 * decodes it. */
static PyObject *gather_rows(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, w, w_bytes, ids_address, n_ids, n_out, in_features;
    int qtype, is_bf16;
    if (!PyArg_ParseTuple(args, "nnnnnnnip", &out, &w, &w_bytes, &ids_address, &n_ids, &n_out,
                          &in_features, &qtype, &is_bf16))
        return NULL;
    const struct block_type *type = block_type_of(qtype, in_features);
    if (type == NULL || !check_weight_bytes(w_bytes, n_out, in_features, type)) return NULL;
    const int64_t *ids = (const int64_t *)ids_address;
    for (Py_ssize_t i = 0; i < n_ids; i++)
        if (ids[i] < 0 || ids[i] >= n_out)
            return PyErr_Format(PyExc_IndexError,
                                "quant_linear: row %lld is out of range for a table of %lld rows",
                                (long long)ids[i], (long long)n_out);
    const int64_t blocks = in_features / QK;
    const int64_t group_bytes = blocks / type->unit_blocks * type->at.bytes;
    const size_t row_bytes = in_features * (is_bf16 ? sizeof(bf16) : sizeof(float));
    void (*const row)(void *, const uint8_t *, int64_t, int) = type->row[is_bf16];
    Py_BEGIN_ALLOW_THREADS;
    /* a step's few rows decode in microseconds, less than waking the other threads takes */
#pragma omp parallel for schedule(static) if (n_ids * in_features >= (1 << 20))
    for (Py_ssize_t i = 0; i < n_ids; i++)
        row((char *)out + i * row_bytes, (const uint8_t *)w + ids[i] / GROUP * group_bytes, blocks,
            ids[i] % GROUP);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
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
     "linear(out, x, w, w_bytes, bias, rows, in_features, out_features, qtype, is_bf16, terms, "
     "isa, prefetch): data pointers (bias 0 for none; x, bias, out fp32 or bf16, w packed, of "
     "w_bytes) then sizes, the GGML type, the int8 terms each row of x is quantized in (1 or 2), "
     "the CPU path (one of isas()) and how far beyond a record the x86 paths prefetch W (a "
     "multiple of 64 bytes, at most 16384); writes out [rows, out_features]."},
    {"dequantize", dequantize, METH_VARARGS,
     "dequantize(out, w, w_bytes, out_features, in_features, qtype, is_bf16, transposed): writes "
     "out [out_features, in_features] (or, transposed, [in_features, out_features]) from the "
     "packed w of w_bytes."},
    {"gather_rows", gather_rows, METH_VARARGS,
     "gather_rows(out, w, w_bytes, ids, n_ids, out_features, in_features, qtype, is_bf16): writes "
     "out [n_ids, in_features] from rows ids (int64, each below out_features) of the packed w of "
     "w_bytes."},
    {"isas", isas, METH_NOARGS, "isas(): the CPU paths this machine runs, slowest first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_definition = {PyModuleDef_HEAD_INIT, .m_name = "_quant_linear",
                                               .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__quant_linear(void) { return PyModule_Create(&module_definition); }
