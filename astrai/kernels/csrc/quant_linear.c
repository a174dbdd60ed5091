/* y = x W^T + b for a few rows of x, W in GGUF's 32-weight blocks: Q8_0, Q4_0, Q4_1.
 *
 * A decode step's linears are bound by reading W, and a 4-bit W is a quarter of the bytes of
 * bf16. Nothing here widens W to floats: each 32-block of a row of x is quantized to int8 with
 * one fp32 scale dx (dx = max|x| / 127), and a block's product is an integer dot product of the
 * weight codes with those int8 values, scaled once:
 *
 *     sum_j w_j x_j ~= sum_j (d u_j + m) dx q_j = d dx (u . q) + m sx,   sx = dx sum_j q_j
 *
 * with every type written as unsigned codes u, a scale d and an offset m per block:
 * Q4_1 (w = d u + m, u in 0..15), Q4_0 (w = d (u - 8): m = -8 d) and Q8_0 (w = d s, s signed:
 * u = s + 128, m = -128 d). Unsigned codes against signed x are what the CPUs' int8
 * multiply-adds take (AVX512-VNNI vpdpbusd, AVX2 vpmaddubsw).
 *
 * Packed layout (quant_ops.pack_blocks makes it from GGUF blocks at load). W's rows are taken
 * GROUP = 4 at a time (the last group padded with zero rows); a group is one record per
 * 32-block, records in block order, groups one after the other, so a thread streams one
 * contiguous range:
 *   Q4_0, Q4_1: 64 bytes of codes, row r's 16 GGUF bytes at 16 r (byte k: element k in the
 *               low nibble, element k + 16 in the high one), then fp16 d[4], (Q4_1) fp16 m[4].
 *   Q8_0:       row r's elements 0..15 at 16 r, its elements 16..31 at 64 + 16 r, then d[4].
 * Records are as many bytes as the GGUF blocks they hold (72, 80, 136 for 4 rows), and one
 * 512-bit load gives the 4 rows' codes for 16 elements each, which vpdpbusd multiplies with
 * those 16 x values broadcast to each 128-bit lane: the 4 rows of a group in one instruction.
 *
 * Threads split the groups into contiguous ranges; each group is read from memory once and
 * serves every row of x from the L1 cache. Each output is summed in the same order whatever
 * the number of rows or threads, and each row of x is quantized on its own, so a row's result
 * never depends on the batch. The paths (scalar, avx2, avx512vnni) may round differently from
 * one another; set_isa() picks one for tests and timing.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "module.h"
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
enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };
#define QK 32
#define GROUP 4

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

static int64_t record_bytes(int qtype) {
    return qtype == Q8_0 ? 128 + 2 * GROUP : qtype == Q4_1 ? 64 + 4 * GROUP : 64 + 2 * GROUP;
}

static float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = h >> 10 & 0x1f,
                   mantissa = h & 0x3ff;
    if (exponent == 0) { /* zero or subnormal: mantissa * 2^-24, exact in fp32 */
        const float f = ldexpf((float)mantissa, -24);
        return sign ? -f : f;
    }
    const uint32_t bits =
        sign | (exponent == 31 ? 0x7f800000 | mantissa << 13 : (exponent + 112) << 23 | mantissa << 13);
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Row r's code u (see the top) for element j of a record, and its block's d and m. */
static int code(const uint8_t *rec, int qtype, int r, int j) {
    if (qtype == Q8_0) return (int8_t)rec[(j < 16 ? 16 * r + j : 64 + 16 * r + j - 16)] + 128;
    const uint8_t byte = rec[16 * r + (j & 15)];
    return j < 16 ? byte & 15 : byte >> 4;
}

static void block_scales(const uint8_t *rec, int qtype, int r, float *d, float *m) {
    const uint8_t *halves = rec + (qtype == Q8_0 ? 128 : 64);
    uint16_t h;
    memcpy(&h, halves + 2 * r, 2);
    *d = half_to_float(h);
    if (qtype == Q4_1) {
        memcpy(&h, halves + 2 * (GROUP + r), 2);
        *m = half_to_float(h);
    } else {
        *m = (qtype == Q8_0 ? -128.0f : -8.0f) * *d;
    }
}

/* One row of x (fp32 or bf16) as int8 per 32-block: q[in], and scales[2 * block] = dx, sx.
 * Every operation is one IEEE rounding, so NumPy reproduces it exactly (the tests do): x / dx
 * is rounded to the nearest integer, ties to even, by adding and subtracting 1.5 * 2^23 (exact
 * below 2^22 in magnitude, and |x / dx| <= 127). */
static inline __attribute__((always_inline)) void quantize(int8_t *q, float *scales,
                                                            const void *x, int64_t in,
                                                            const int is_bf16) {
    const vec8 round = (vec8){0.0f} + 12582912.0f;
    for (int64_t b = 0; b < in / QK; b++) {
        vec8 v[QK / LANES], amax = {0.0f};
        for (int k = 0; k < QK / LANES; k++) {
            v[k] = load_any(x, b * QK + k * LANES, is_bf16);
            const vec8 a = (vec8)((int8v)v[k] & 0x7fffffff);
            amax = select8(a > amax, a, amax);
        }
        float max = 0.0f;
        for (int l = 0; l < LANES; l++) max = amax[l] > max ? amax[l] : max;
        const float dx = max / 127.0f, inverse = dx != 0.0f ? 1.0f / dx : 0.0f;
        int8v sum = {0};
        for (int k = 0; k < QK / LANES; k++) {
            const int8v qk = __builtin_convertvector((v[k] * inverse + round) - round, int8v);
            sum += qk;
            for (int l = 0; l < LANES; l++) q[b * QK + k * LANES + l] = (int8_t)qk[l];
        }
        int total = 0;
        for (int l = 0; l < LANES; l++) total += sum[l];
        scales[2 * b] = dx;
        scales[2 * b + 1] = dx * (float)total;
    }
}

FP32_AND_BF16(quantize, (int8_t *q, float *scales, const void *x, int64_t in), q, scales, x, in)

/* What every path reads: the packed W, the quantized x and where results go. */
struct call {
    void *out;
    const uint8_t *w;
    const int8_t *xq;   /* [rows, in] */
    const float *xs;    /* [rows, in / 32, 2]: dx, sx */
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
    const uint8_t *recs = c->w + g * c->blocks * c->rec_bytes;
    for (int64_t m = 0; m < c->rows; m++)
        for (int r = 0; r < GROUP; r++) {
            float dot = 0.0f;
            for (int64_t b = 0; b < c->blocks; b++) {
                const uint8_t *rec = recs + b * c->rec_bytes;
                const int8_t *q = c->xq + (m * c->blocks + b) * QK;
                const float *xs = c->xs + 2 * (m * c->blocks + b);
                int32_t idot = 0;
                for (int j = 0; j < QK; j++) idot += code(rec, c->qtype, r, j) * q[j];
                float d, offset;
                block_scales(rec, c->qtype, r, &d, &offset);
                dot += d * xs[0] * (float)idot + offset * xs[1];
            }
            store(c, m, GROUP * g + r, dot);
        }
}

#if X86
/* AVX-512 VNNI: a group's codes for 16 elements are one 512-bit vector (row r in 128-bit lane
 * r), and one vpdpbusd against the 16 x values broadcast to every lane leaves lane 4 r + i with
 * 4 products of row r. Per x row an accumulator of 16 floats: lanes 4 r .. 4 r + 3 sum to row
 * r's result, the scale d dx applied to each lane and the offset term m sx added to lane 4 r.
 * n_x rows of x run together (n_x a constant after inlining), each using W's vectors loaded
 * once. */
#define VNNI_X 4

TARGET_VNNI INLINE void vnni_tile(const struct call *c, const uint8_t *recs, int64_t g,
                                  int64_t m0, const int n_x, const int qtype) {
    const __m512i low4 = _mm512_set1_epi8(0x0f), flip = _mm512_set1_epi8((char)0x80);
    /* lanes 4 r .. 4 r + 3 take d_r (element r of [d0..d3, m0..m3]); lane 4 r takes m_r */
    const __m512i d_lanes = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i m_lanes = _mm512_set_epi32(7, 7, 7, 7, 6, 6, 6, 6, 5, 5, 5, 5, 4, 4, 4, 4);
    __m512 acc[VNNI_X];
    for (int i = 0; i < n_x; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < c->blocks; b++) {
        const uint8_t *rec = recs + b * c->rec_bytes;
        __m512i low, high;
        __m256 dm; /* [d0..d3, m0..m3] */
        if (qtype == Q8_0) {
            low = _mm512_xor_si512(_mm512_loadu_si512(rec), flip);
            high = _mm512_xor_si512(_mm512_loadu_si512(rec + 64), flip);
        } else {
            const __m512i codes = _mm512_loadu_si512(rec);
            low = _mm512_and_si512(codes, low4);
            high = _mm512_and_si512(_mm512_srli_epi16(codes, 4), low4);
        }
        if (qtype == Q4_1) {
            dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 64)));
        } else {
            const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(rec + (qtype == Q8_0 ? 128 : 64))));
            const __m128 m = _mm_mul_ps(d, _mm_set1_ps(qtype == Q8_0 ? -128.0f : -8.0f));
            dm = _mm256_insertf128_ps(_mm256_castps128_ps256(d), m, 1);
        }
        const __m512 dm512 = _mm512_castps256_ps512(dm);
        const __m512 d = _mm512_permutexvar_ps(d_lanes, dm512);
        const __m512 offset = _mm512_maskz_permutexvar_ps(0x1111, m_lanes, dm512);
        for (int i = 0; i < n_x; i++) {
            const int8_t *q = c->xq + ((m0 + i) * c->blocks + b) * QK;
            const float *xs = c->xs + 2 * ((m0 + i) * c->blocks + b);
            const __m512i q_low = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)q));
            const __m512i q_high = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(q + 16)));
            const __m512i dot = _mm512_dpbusd_epi32(
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), low, q_low), high, q_high);
            acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot),
                                     _mm512_mul_ps(d, _mm512_set1_ps(xs[0])), acc[i]);
            acc[i] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xs[1]), acc[i]);
        }
    }
    for (int i = 0; i < n_x; i++) {
        float lanes[16];
        _mm512_storeu_ps(lanes, acc[i]);
        for (int r = 0; r < GROUP; r++)
            store(c, m0 + i, GROUP * g + r,
                  (lanes[4 * r] + lanes[4 * r + 1]) + (lanes[4 * r + 2] + lanes[4 * r + 3]));
    }
}

TARGET_VNNI INLINE void vnni_group(const struct call *c, int64_t g, const int qtype) {
    const uint8_t *recs = c->w + g * c->blocks * c->rec_bytes;
    int64_t m = 0;
    for (; m + VNNI_X <= c->rows; m += VNNI_X) vnni_tile(c, recs, g, m, VNNI_X, qtype);
    for (; m < c->rows; m++) vnni_tile(c, recs, g, m, 1, qtype);
}

TARGET_VNNI static void group_vnni(const struct call *c, int64_t g) {
    if (c->qtype == Q8_0)
        vnni_group(c, g, Q8_0);
    else if (c->qtype == Q4_1)
        vnni_group(c, g, Q4_1);
    else
        vnni_group(c, g, Q4_0);
}

/* AVX2: a 256-bit vector holds rows 2 h and 2 h + 1 (h = 0, 1) of a group, 16 elements each.
 * vpmaddubsw multiplies unsigned codes by the signed x in pairs into int16 and vpmaddwd sums
 * those pairs into int32 lanes, 4 per row, scaled and summed as in the VNNI path. Q8_0 codes
 * as unsigned would overflow vpmaddubsw's int16 pairs (255 * 127 * 2), so they stay signed:
 * |w| times x with w's sign, and no offset term. */
#define AVX2_X 2

TARGET_AVX2 INLINE __m256i avx2_dot(__m256i w, __m256i q, const int is_signed) {
    const __m256i pairs = is_signed
                              ? _mm256_maddubs_epi16(_mm256_abs_epi8(w), _mm256_sign_epi8(q, w))
                              : _mm256_maddubs_epi16(w, q);
    return _mm256_madd_epi16(pairs, _mm256_set1_epi16(1));
}

TARGET_AVX2 INLINE void avx2_tile(const struct call *c, const uint8_t *recs, int64_t g,
                                  int64_t m0, const int n_x, const int qtype) {
    const __m256i low4 = _mm256_set1_epi8(0x0f);
    const __m256i lanes_01 = _mm256_set_epi32(5, 5, 5, 5, 4, 4, 4, 4);
    const __m256i d_01 = _mm256_set_epi32(1, 1, 1, 1, 0, 0, 0, 0);
    const __m256i d_23 = _mm256_set_epi32(3, 3, 3, 3, 2, 2, 2, 2);
    const __m256i m_23 = _mm256_set_epi32(7, 7, 7, 7, 6, 6, 6, 6);
    __m256 acc[AVX2_X][2];
    for (int i = 0; i < n_x; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int64_t b = 0; b < c->blocks; b++) {
        const uint8_t *rec = recs + b * c->rec_bytes;
        __m256i low[2], high[2];
        __m256 dm; /* [d0..d3, m0..m3] */
        for (int h = 0; h < 2; h++) {
            const __m256i codes = _mm256_loadu_si256((const __m256i *)(rec + 32 * h));
            if (qtype == Q8_0) {
                low[h] = codes;
                high[h] = _mm256_loadu_si256((const __m256i *)(rec + 64 + 32 * h));
            } else {
                low[h] = _mm256_and_si256(codes, low4);
                high[h] = _mm256_and_si256(_mm256_srli_epi16(codes, 4), low4);
            }
        }
        if (qtype == Q4_1) {
            dm = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(rec + 64)));
        } else {
            const __m128 d = _mm_cvtph_ps(_mm_loadl_epi64((const __m128i *)(rec + (qtype == Q8_0 ? 128 : 64))));
            dm = _mm256_insertf128_ps(_mm256_castps128_ps256(d), _mm_mul_ps(d, _mm_set1_ps(-8.0f)), 1);
        }
        /* per h: d of rows 2 h, 2 h + 1 on their 4 lanes each; the offset m on the first lane
         * of each row (Q4 only) */
        const __m256 d[2] = {_mm256_permutevar8x32_ps(dm, d_01), _mm256_permutevar8x32_ps(dm, d_23)};
        const __m256 first = _mm256_castsi256_ps(_mm256_set_epi32(0, 0, 0, -1, 0, 0, 0, -1));
        const __m256 offset[2] = {
            _mm256_and_ps(_mm256_permutevar8x32_ps(dm, lanes_01), first),
            _mm256_and_ps(_mm256_permutevar8x32_ps(dm, m_23), first)};
        for (int i = 0; i < n_x; i++) {
            const int8_t *q = c->xq + ((m0 + i) * c->blocks + b) * QK;
            const float *xs = c->xs + 2 * ((m0 + i) * c->blocks + b);
            const __m256i q_low = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)q));
            const __m256i q_high = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(q + 16)));
            const __m256 dx = _mm256_set1_ps(xs[0]), sx = _mm256_set1_ps(xs[1]);
            for (int h = 0; h < 2; h++) {
                const __m256i dot = _mm256_add_epi32(avx2_dot(low[h], q_low, qtype == Q8_0),
                                                     avx2_dot(high[h], q_high, qtype == Q8_0));
                acc[i][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(d[h], dx), acc[i][h]);
                if (qtype != Q8_0) acc[i][h] = _mm256_fmadd_ps(offset[h], sx, acc[i][h]);
            }
        }
    }
    for (int i = 0; i < n_x; i++)
        for (int h = 0; h < 2; h++) {
            float lanes[8];
            _mm256_storeu_ps(lanes, acc[i][h]);
            for (int r = 0; r < 2; r++)
                store(c, m0 + i, GROUP * g + 2 * h + r,
                      (lanes[4 * r] + lanes[4 * r + 1]) + (lanes[4 * r + 2] + lanes[4 * r + 3]));
        }
}

TARGET_AVX2 INLINE void avx2_group(const struct call *c, int64_t g, const int qtype) {
    const uint8_t *recs = c->w + g * c->blocks * c->rec_bytes;
    int64_t m = 0;
    for (; m + AVX2_X <= c->rows; m += AVX2_X) avx2_tile(c, recs, g, m, AVX2_X, qtype);
    for (; m < c->rows; m++) avx2_tile(c, recs, g, m, 1, qtype);
}

TARGET_AVX2 static void group_avx2(const struct call *c, int64_t g) {
    if (c->qtype == Q8_0)
        avx2_group(c, g, Q8_0);
    else if (c->qtype == Q4_1)
        avx2_group(c, g, Q4_1);
    else
        avx2_group(c, g, Q4_0);
}
#endif

static int check_qtype(int qtype) {
    if (qtype == Q4_0 || qtype == Q4_1 || qtype == Q8_0) return 1;
    PyErr_Format(PyExc_ValueError, "quant_linear: GGML type %d has no kernel (Q4_0, Q4_1, Q8_0)",
                 qtype);
    return 0;
}

static PyObject *linear(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, x, w, bias, rows, in_features, n_out;
    int qtype, is_bf16;
    if (!PyArg_ParseTuple(args, "nnnnnnnip", &out, &x, &w, &bias, &rows, &in_features, &n_out,
                          &qtype, &is_bf16) ||
        !check_qtype(qtype))
        return NULL;
    const int64_t blocks = in_features / QK;
    int8_t *xq = malloc(rows * in_features + 1);
    float *xs = malloc(sizeof(float) * 2 * rows * blocks + 1);
    if (xq == NULL || xs == NULL) {
        free(xq);
        free(xs);
        return PyErr_NoMemory();
    }
    const struct call c = {(void *)out, (const uint8_t *)w, xq, xs, (const void *)bias, rows,
                           blocks, n_out, record_bytes(qtype), qtype, is_bf16};
    void (*group)(const struct call *, int64_t) = group_scalar;
#if X86
    if (current_isa == AVX512VNNI) group = group_vnni;
    if (current_isa == AVX2) group = group_avx2;
#endif
    const size_t x_row_bytes = in_features * (is_bf16 ? sizeof(bf16) : sizeof(float));
    Py_BEGIN_ALLOW_THREADS;
    /* A few rows are quantized on this thread: cheaper than the threads meeting at a barrier. */
#pragma omp parallel for schedule(static) if (rows > 8)
    for (int64_t m = 0; m < rows; m++)
        (is_bf16 ? quantize_bf16 : quantize_fp32)(xq + m * in_features, xs + 2 * m * blocks,
                                                  (const char *)x + m * x_row_bytes, in_features);
#pragma omp parallel
    {
        const int64_t groups = (n_out + GROUP - 1) / GROUP;
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        for (int64_t g = groups * t / threads; g < groups * (t + 1) / threads; g++) group(&c, g);
    }
    Py_END_ALLOW_THREADS;
    free(xq);
    free(xs);
    Py_RETURN_NONE;
}

/* W as fp32 or bf16 [n_out, in] from its packed records: the many-row products take a GEMM. */
static PyObject *dequantize(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, w, n_out, in_features;
    int qtype, is_bf16;
    if (!PyArg_ParseTuple(args, "nnnnip", &out, &w, &n_out, &in_features, &qtype, &is_bf16) ||
        !check_qtype(qtype))
        return NULL;
    const int64_t blocks = in_features / QK, rec_bytes = record_bytes(qtype);
    Py_BEGIN_ALLOW_THREADS;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < n_out; n++) {
        const uint8_t *recs = (const uint8_t *)w + n / GROUP * blocks * rec_bytes;
        for (int64_t b = 0; b < blocks; b++) {
            const uint8_t *rec = recs + b * rec_bytes;
            float d, m;
            block_scales(rec, qtype, n % GROUP, &d, &m);
            for (int j = 0; j < QK; j++) {
                /* exact: d u + m is w with at most 19 significant bits (Q8_0: d (s + 128) - 128 d) */
                const float value = d * (float)code(rec, qtype, n % GROUP, j) + m;
                const int64_t at = n * in_features + b * QK + j;
                if (is_bf16)
                    ((bf16 *)out)[at] = float_to_bf16(value);
                else
                    ((float *)out)[at] = value;
            }
        }
    }
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
    for (int isa = SCALAR; names != NULL && isa <= AVX512VNNI; isa++)
        if (isa_runs(isa) && PyList_Append(names, PyUnicode_FromString(isa_names[isa])) < 0)
            Py_CLEAR(names);
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
    {"set_isa", set_isa, METH_O, "set_isa(name): the path linear() takes from now on."},
    {"isa", get_isa, METH_NOARGS, "isa(): the path linear() takes."},
    {"isas", isas, METH_NOARGS, "isas(): the paths this CPU runs, slowest first."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_definition = {PyModuleDef_HEAD_INIT, .m_name = "_quant_linear",
                                               .m_size = -1, .m_methods = methods};

PyMODINIT_FUNC PyInit__quant_linear(void) {
    /* the fastest path this CPU runs until set_isa() (quant_ops times them and may pick another) */
    for (int isa = SCALAR; isa <= AVX512VNNI; isa++)
        if (isa_runs(isa)) current_isa = isa;
    return PyModule_Create(&module_definition);
}
