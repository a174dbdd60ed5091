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
 * as PyTorch's bf16 GEMMs do, and the result is rounded to bf16 once.
 *
 * Like the other kernels, it links libgomp by soname and so shares torch's OpenMP runtime.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <omp.h>
#include <stdlib.h>

#include "module.h"
#include "vec8.h"

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

FP32_AND_BF16(row_block,
              (void *out, const float *x, const void *weight, const void *bias, int64_t rows,
               int64_t in_features, int64_t n_out, const int64_t *n),
              out, x, weight, bias, rows, in_features, n_out, n)

static PyObject *linear(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, x, weight, bias, rows, in_features, n_out;
    int is_bf16;
    if (!PyArg_ParseTuple(args, "nnnnnnnp", &out, &x, &weight, &bias, &rows, &in_features,
                          &n_out, &is_bf16))
        return NULL;
    void (*const run)(void *, const float *, const void *, const void *, int64_t, int64_t,
                      int64_t, const int64_t *) = is_bf16 ? row_block_bf16 : row_block_fp32;
    float *bf16_x = NULL;
    if (is_bf16 && (bf16_x = malloc(sizeof(float) * rows * in_features)) == NULL)
        return PyErr_NoMemory();
    Py_BEGIN_ALLOW_THREADS;
    if (is_bf16) bf16_x_layout(bf16_x, (const bf16 *)x, rows * in_features);
    const float *x_rows = is_bf16 ? bf16_x : (const float *)x;
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
                n_out, n);
        }
    }
    Py_END_ALLOW_THREADS;
    free(bf16_x);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"linear", linear, METH_VARARGS,
     "linear(out, x, weight, bias, rows, in_features, out_features, is_bf16): data pointers "
     "(bias 0 for none) of contiguous tensors, all fp32 or all bf16, then sizes; writes out "
     "[rows, out_features]."},
    {NULL, NULL, 0, NULL},
};

ASTRAI_MODULE(_skinny_linear, methods)
