/* y = x W^T + b for a few rows of x, fp32 or bf16 on the CPU: the linears of a decode step.
 *
 * With a handful of rows a linear is bound by reading W from memory, and BLAS GEMMs often do
 * that below the machine's read rate at small M (benchmarks/README.md has the figures; which
 * path wins is timed at start, astrai/kernels/linear_ops.py). Here the threads split W's rows, and
 * each block of ROW_BLOCK rows is read from memory once and then serves every row of x from
 * the L1 cache. Every output is one dot product summed in the same order whatever the number of
 * rows, so a sequence's logits do not depend on what else is in the batch.
 *
 * bf16 tensors are read as bf16 (half the bytes of fp32) and multiplied and summed in fp32,
 * as PyTorch's bf16 GEMMs do, and the result is rounded to bf16 once. A bf16 product has three
 * paths, named with each call (linear_ops times them when an engine is built, as the machine
 * decides which wins, and keeps the answer in the engine's KernelPlan):
 *   vec8        the portable code below, on eight-float vectors (AVX2 + FMA on x86-64-v3);
 *   avx512      16 bf16 of W widened to fp32 per vector, and 512-bit FMAs;
 *   avx512bf16  vdpbf16ps: 32 bf16 of W against 32 of x in one instruction, each pair's exact
 *               products added to an fp32 lane (subnormal inputs and sums read as zero).
 * Each keeps one fixed summation order per output whatever the rows, so each is batch
 * invariant; they round their fp32 sums differently from one another.
 *
 * Like the other kernels, it links libgomp by soname and so shares torch's OpenMP runtime.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

#include "module.h"
#include "vec8.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define X86 1
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define TARGET_AVX512BF16                                                                          \
    __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,fma")))
#define INLINE static inline __attribute__((always_inline))
#else
#define X86 0
#endif

enum bf16_path { VEC8, AVX512, AVX512BF16 };
static const char *const bf16_path_names[] = {"vec8", "avx512", "avx512bf16"};

static int bf16_path_runs(enum bf16_path path) {
#if X86
    __builtin_cpu_init();
    const int avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq");
    if (path == AVX512) return avx512;
    if (path == AVX512BF16) return avx512 && __builtin_cpu_supports("avx512bf16");
#endif
    return path == VEC8;
}

/* The bf16 path named name, if this CPU runs it; else -1 with a ValueError set. */
static int bf16_path_named(const char *name) {
    for (int path = VEC8; path <= AVX512BF16; path++)
        if (strcmp(name, bf16_path_names[path]) == 0) {
            if (bf16_path_runs(path)) return path;
            PyErr_Format(PyExc_ValueError, "skinny_linear: this CPU cannot run %s", name);
            return -1;
        }
    PyErr_Format(PyExc_ValueError, "skinny_linear: no bf16 path %s (vec8, avx512, avx512bf16)",
                 name);
    return -1;
}

/* W rows and x rows whose dot products run together: ROW_BLOCK * X_BLOCK independent FMA
 * chains that fit in the vector registers, few enough streams from memory for the hardware
 * prefetcher to follow, and each loaded vector of W used for X_BLOCK rows of x. */
#define ROW_BLOCK 4
#define X_BLOCK 2

/* out[m0 : m0 + n_x, n0 : n0 + ROW_BLOCK] for n_x <= X_BLOCK, from the W rows w. Inlined
 * with n_x and is_bf16 constants, so the accumulators live in vector registers.
 *
 * fp32: x and out are fp32 rows. bf16: W, bias and out are bf16 and x is fp32 with each run
 * of 16 values stored evens first, then odds (bf16_x_layout). 16 bf16 of a W row are then
 * one 32-byte load, whose evens become fp32 by a shift and whose odds by a mask, two integer
 * ops for 16 values where widening them in order takes shuffles. */
static inline __attribute__((always_inline)) void tile(void *out, const float *x,
                                                        const void *const *w, const void *bias,
                                                        int64_t in_features, int64_t n_out,
                                                        const int64_t *n, int64_t m0, int n_x,
                                                        const int is_bf16) {
    vec8 acc[X_BLOCK][ROW_BLOCK] = {{{0.0f}}};
    if (is_bf16) {
        for (int64_t k0 = 0; k0 < in_features; k0 += 2 * LANES) {
            vec8 evens[X_BLOCK], odds[X_BLOCK];
            for (int i = 0; i < n_x; i++) {
                evens[i] = load8(x + (m0 + i) * in_features + k0);
                odds[i] = load8(x + (m0 + i) * in_features + k0 + LANES);
            }
            for (int r = 0; r < ROW_BLOCK; r++) {
                int8v pairs;
                __builtin_memcpy(&pairs, (const bf16 *)w[r] + k0, sizeof pairs);
                const vec8 w_evens = (vec8)(pairs << 16), w_odds = (vec8)(pairs & -65536);
                for (int i = 0; i < n_x; i++) acc[i][r] += evens[i] * w_evens + odds[i] * w_odds;
            }
        }
    } else {
        for (int64_t k0 = 0; k0 < in_features; k0 += LANES) {
            vec8 wk[ROW_BLOCK];
            for (int r = 0; r < ROW_BLOCK; r++) wk[r] = load8((const float *)w[r] + k0);
            for (int i = 0; i < n_x; i++) {
                const vec8 xk = load8(x + (m0 + i) * in_features + k0);
                for (int r = 0; r < ROW_BLOCK; r++) acc[i][r] += xk * wk[r];
            }
        }
    }
    for (int i = 0; i < n_x; i++)
        for (int r = 0; r < ROW_BLOCK; r++) {
            if (n[r] < 0) continue;
            float dot = sum8(acc[i][r]);
            const int64_t at = (m0 + i) * n_out + n[r];
            if (is_bf16) {
                if (bias != NULL) dot += bf16_to_float(((const bf16 *)bias)[n[r]]);
                ((bf16 *)out)[at] = float_to_bf16(dot);
            } else {
                ((float *)out)[at] = bias == NULL ? dot : dot + ((const float *)bias)[n[r]];
            }
        }
}

/* bf16 rows of x as fp32, each run of 16 values reordered evens first, then odds, as tile()
 * pairs them with W's. */
static void bf16_x_layout(float *dst, const bf16 *x, int64_t n) {
    for (int64_t k0 = 0; k0 < n; k0 += 2 * LANES)
        for (int j = 0; j < LANES; j++) {
            dst[k0 + j] = bf16_to_float(x[k0 + 2 * j]);
            dst[k0 + LANES + j] = bf16_to_float(x[k0 + 2 * j + 1]);
        }
}

/* out[:, n[r]] for every row of x and the ROW_BLOCK W rows n[r]; a row n[r] < 0 is computed
 * on row 0 and not stored. in_features is a multiple of LANES. */
static inline __attribute__((always_inline)) void row_block(void *out, const float *x,
                                                             const void *weight, const void *bias,
                                                             int64_t rows, int64_t in_features,
                                                             int64_t n_out, const int64_t *n,
                                                             const int is_bf16) {
    const int64_t row_bytes = in_features * (is_bf16 ? sizeof(bf16) : sizeof(float));
    const void *w[ROW_BLOCK];
    for (int64_t r = 0; r < ROW_BLOCK; r++)
        w[r] = (const char *)weight + (n[r] < 0 ? 0 : n[r]) * row_bytes;
    int64_t m = 0;
    for (; m + X_BLOCK <= rows; m += X_BLOCK)
        tile(out, x, w, bias, in_features, n_out, n, m, X_BLOCK, is_bf16);
    for (; m < rows; m++) tile(out, x, w, bias, in_features, n_out, n, m, 1, is_bf16);
}

/* (vec8 leaves W's stream to the hardware prefetcher: prefetch_bytes is not read) */
FP32_AND_BF16(row_block,
              (void *out, const float *x, const void *weight, const void *bias, int64_t rows,
               int64_t in_features, int64_t n_out, const int64_t *n, int prefetch_bytes),
              out, x, weight, bias, rows, in_features, n_out, n)

/* How far ahead in each of its W rows an AVX-512 path prefetches, in bytes: at a few rows of x
 * the hardware prefetcher alone left the FMAs waiting on memory (twice the time at 4 rows on
 * the AVX-512 EPYC, benchmarks/README.md); linear_ops times a few distances at start. */
#define KERNEL_NAME "skinny_linear"
#include "prefetch.h"

#if X86
/* The AVX-512 paths: W rows and x rows whose dot products run together, as in tile(): with 32
 * vector registers, 4 x rows against ROW_BLOCK W rows keep 16 accumulators. */
#define X512_BLOCK 4

/* out[m0 : m0 + n_x, n[r]] from a tile's accumulators acc[i][r], lanes summed in a fixed order
 * (_mm512_reduce_add_ps's), plus the bias, rounded to bf16. */
TARGET_AVX512 INLINE void store_bf16_tile(bf16 *out, const __m512 acc[X512_BLOCK][ROW_BLOCK],
                                          const bf16 *bias, int64_t n_out, const int64_t *n,
                                          int64_t m0, const int n_x) {
    for (int i = 0; i < n_x; i++)
        for (int r = 0; r < ROW_BLOCK; r++) {
            if (n[r] < 0) continue;
            float dot = _mm512_reduce_add_ps(acc[i][r]);
            if (bias != NULL) dot += bf16_to_float(bias[n[r]]);
            out[(m0 + i) * n_out + n[r]] = float_to_bf16(dot);
        }
}

/* avx512: x widened to fp32 in order, W's bf16 widened 16 at a time by a shift. */
TARGET_AVX512 INLINE void tile_avx512(bf16 *out, const float *x, const bf16 *const *w,
                                      const bf16 *bias, int64_t in_features, int64_t n_out,
                                      const int64_t *n, int64_t m0, const int n_x,
                                      const int prefetch_bytes) {
    __m512 acc[X512_BLOCK][ROW_BLOCK];
    for (int i = 0; i < n_x; i++)
        for (int r = 0; r < ROW_BLOCK; r++) acc[i][r] = _mm512_setzero_ps();
    for (int64_t k0 = 0; k0 < in_features; k0 += 16) {
        __m512 xk[X512_BLOCK];
        for (int i = 0; i < n_x; i++) xk[i] = _mm512_loadu_ps(x + (m0 + i) * in_features + k0);
        for (int r = 0; r < ROW_BLOCK; r++) {
            if (k0 % 32 == 0) /* a cache line per two runs */
                _mm_prefetch((const char *)(w[r] + k0) + prefetch_bytes, _MM_HINT_T0);
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(w[r] + k0));
            const __m512i widened = _mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16);
            const __m512 wk = _mm512_castsi512_ps(widened);
            for (int i = 0; i < n_x; i++) acc[i][r] = _mm512_fmadd_ps(xk[i], wk, acc[i][r]);
        }
    }
    store_bf16_tile(out, acc, bias, n_out, n, m0, n_x);
}

/* avx512bf16: x stays bf16; a run of 16 at the end of a row is loaded masked, the rest zero. */
TARGET_AVX512BF16 INLINE void tile_avx512bf16(bf16 *out, const bf16 *x, const bf16 *const *w,
                                              const bf16 *bias, int64_t in_features,
                                              int64_t n_out, const int64_t *n, int64_t m0,
                                              const int n_x, const int prefetch_bytes) {
    __m512 acc[X512_BLOCK][ROW_BLOCK];
    for (int i = 0; i < n_x; i++)
        for (int r = 0; r < ROW_BLOCK; r++) acc[i][r] = _mm512_setzero_ps();
    int64_t k0 = 0;
    for (; k0 + 32 <= in_features; k0 += 32) {
        __m512bh xk[X512_BLOCK];
        for (int i = 0; i < n_x; i++)
            xk[i] = (__m512bh)_mm512_loadu_si512(x + (m0 + i) * in_features + k0);
        for (int r = 0; r < ROW_BLOCK; r++) {
            _mm_prefetch((const char *)(w[r] + k0) + prefetch_bytes, _MM_HINT_T0);
            const __m512bh wk = (__m512bh)_mm512_loadu_si512(w[r] + k0);
            for (int i = 0; i < n_x; i++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], wk, xk[i]);
        }
    }
    if (k0 < in_features) { /* a last run of 16 */
        __m512bh xk[X512_BLOCK];
        for (int i = 0; i < n_x; i++)
            xk[i] = (__m512bh)_mm512_maskz_loadu_epi16(0xffff, x + (m0 + i) * in_features + k0);
        for (int r = 0; r < ROW_BLOCK; r++) {
            const __m512bh wk = (__m512bh)_mm512_maskz_loadu_epi16(0xffff, w[r] + k0);
            for (int i = 0; i < n_x; i++) acc[i][r] = _mm512_dpbf16_ps(acc[i][r], wk, xk[i]);
        }
    }
    store_bf16_tile(out, acc, bias, n_out, n, m0, n_x);
}

/* row_block() for the AVX-512 paths: x rows X512_BLOCK at a time, the rest in one tile; x is
 * fp32 for avx512 and the caller's bf16 rows for avx512bf16 (x_type). */
#define AVX512_ROW_BLOCK(name, target, tile_fn, x_type)                                            \
    target static void name(void *out, const float *x, const void *weight, const void *bias,     \
                            int64_t rows, int64_t in_features, int64_t n_out, const int64_t *n,  \
                            int prefetch_bytes) {                                                \
        const bf16 *w[ROW_BLOCK];                                                                \
        for (int r = 0; r < ROW_BLOCK; r++)                                                      \
            w[r] = (const bf16 *)weight + (n[r] < 0 ? 0 : n[r]) * in_features;                   \
        const x_type *xs = (const x_type *)x;                                                    \
        int64_t m = 0;                                                                           \
        for (; m + X512_BLOCK <= rows; m += X512_BLOCK)                                          \
            tile_fn(out, xs, w, bias, in_features, n_out, n, m, X512_BLOCK, prefetch_bytes);     \
        switch (rows - m) {                                                                      \
        case 1: tile_fn(out, xs, w, bias, in_features, n_out, n, m, 1, prefetch_bytes); break;   \
        case 2: tile_fn(out, xs, w, bias, in_features, n_out, n, m, 2, prefetch_bytes); break;   \
        case 3: tile_fn(out, xs, w, bias, in_features, n_out, n, m, 3, prefetch_bytes); break;   \
        default: break;                                                                          \
        }                                                                                        \
    }

AVX512_ROW_BLOCK(row_block_avx512, TARGET_AVX512, tile_avx512, float)
AVX512_ROW_BLOCK(row_block_avx512bf16, TARGET_AVX512BF16, tile_avx512bf16, bf16)
#endif

static PyObject *linear(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, x, weight, bias, rows, in_features, n_out;
    int is_bf16, prefetch_bytes;
    const char *bf16_path_name;
    if (!PyArg_ParseTuple(args, "nnnnnnnpsi", &out, &x, &weight, &bias, &rows, &in_features,
                          &n_out, &is_bf16, &bf16_path_name, &prefetch_bytes))
        return NULL;
    const int named = bf16_path_named(bf16_path_name);
    if (named < 0 || !check_prefetch(prefetch_bytes)) return NULL;
    typedef void (*row_block_fn)(void *, const float *, const void *, const void *, int64_t,
                                 int64_t, int64_t, const int64_t *, int);
    row_block_fn run = is_bf16 ? row_block_bf16 : row_block_fp32;
    const enum bf16_path path = is_bf16 ? (enum bf16_path)named : VEC8;
#if X86
    if (path == AVX512) run = row_block_avx512;
    if (path == AVX512BF16) run = row_block_avx512bf16;
#endif
    /* x as each bf16 path reads it: vec8 fp32 in runs of evens and odds, avx512 fp32 in order,
     * avx512bf16 the bf16 rows as they are */
    float *x_fp32 = NULL;
    const int widens_x = is_bf16 && path != AVX512BF16;
    if (widens_x && (x_fp32 = malloc(sizeof(float) * rows * in_features)) == NULL)
        return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS;
    if (path == VEC8 && is_bf16) bf16_x_layout(x_fp32, (const bf16 *)x, rows * in_features);
    if (path == AVX512)
        for (int64_t k = 0; k < rows * in_features; k++)
            x_fp32[k] = bf16_to_float(((const bf16 *)x)[k]);
    const float *x_rows = x_fp32 != NULL ? x_fp32 : (const float *)x;
#pragma omp parallel
    {
        /* Each thread takes a contiguous range of W's rows, cut into ROW_BLOCK parts; a block
         * reads one row from each part, so the thread reads ROW_BLOCK long sequential streams
         * that the hardware prefetcher follows across blocks. */
        const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
        const int64_t begin = n_out * t / threads, end = n_out * (t + 1) / threads;
        const int64_t part = (end - begin + ROW_BLOCK - 1) / ROW_BLOCK;
        for (int64_t j = 0; j < part; j++) {
            int64_t n[ROW_BLOCK];
            for (int r = 0; r < ROW_BLOCK; r++) {
                const int64_t row = begin + r * part + j;
                n[r] = row < end ? row : -1;
            }
            run((void *)out, x_rows, (const void *)weight, (const void *)bias, rows, in_features,
                n_out, n, prefetch_bytes);
        }
    }
    Py_END_ALLOW_THREADS;
    free(x_fp32);
    Py_RETURN_NONE;
}

static PyObject *bf16_paths(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    PyObject *names = PyList_New(0);
    for (int path = VEC8; names != NULL && path <= AVX512BF16; path++) {
        if (!bf16_path_runs(path)) continue;
        PyObject *name = PyUnicode_FromString(bf16_path_names[path]);
        if (name == NULL || PyList_Append(names, name) < 0) Py_CLEAR(names);
        Py_XDECREF(name);
    }
    return names;
}

static PyMethodDef methods[] = {
    {"linear", linear, METH_VARARGS,
     "linear(out, x, weight, bias, rows, in_features, out_features, is_bf16, bf16_path, "
     "prefetch): data pointers (bias 0 for none) of contiguous tensors, all fp32 or all bf16, "
     "then sizes, the path a bf16 product takes (one of bf16_paths()) and how far ahead in W's "
     "rows the AVX-512 paths prefetch (a multiple of 64 bytes, at most 16384); writes out "
     "[rows, out_features]."},
    {"bf16_paths", bf16_paths, METH_NOARGS, "bf16_paths(): the bf16 paths this CPU runs."},
    {NULL, NULL, 0, NULL},
};

ASTRAI_MODULE(_skinny_linear, methods)
