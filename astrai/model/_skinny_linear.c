/* y = x W^T + b for a few rows of x, fp32 on the CPU: the linears of a decode step.
 *
 * With a handful of rows a linear is bound by reading W from memory, and BLAS GEMMs do that
 * badly at small M: measured on a 2-core AMD EPYC, MKL's GEMV streamed a SmolLM2-135M layer's
 * weights at 14 GB/s from one thread and an 8-row GEMM at 9 GB/s, against 20+ GB/s that two
 * threads can read (benchmarks/README.md). Here the threads split W's rows between them, and
 * each block of ROW_BLOCK rows is read from memory once and then serves every row of x from
 * the L1 cache. Every output is one dot product summed in the same order whatever the number of
 * rows, so a sequence's logits do not depend on what else is in the batch.
 *
 * Like _paged_attention, it links libgomp by soname and so shares torch's OpenMP runtime.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "vec8.h"

/* W rows and x rows whose dot products run together: ROW_BLOCK * X_BLOCK independent FMA
 * chains that fit in the vector registers, few enough streams from memory for the hardware
 * prefetcher to follow, and each loaded vector of W used for X_BLOCK rows of x. */
#define ROW_BLOCK 4
#define X_BLOCK 2

/* out[m0 : m0 + n_x, n0 : n0 + ROW_BLOCK] for n_x <= X_BLOCK, from the W rows w. Inlined
 * with n_x a constant, so the accumulators live in vector registers. */
static inline __attribute__((always_inline)) void tile(float *out, const float *x,
                                                        const float *const *w, const float *bias,
                                                        int64_t in_features, int64_t n_out,
                                                        int64_t n0, int64_t m0, int n_x) {
    vec8 acc[X_BLOCK][ROW_BLOCK] = {{{0.0f}}};
    for (int64_t k0 = 0; k0 < in_features; k0 += LANES) {
        vec8 wk[ROW_BLOCK];
        for (int r = 0; r < ROW_BLOCK; r++) wk[r] = load8(w[r] + k0);
        for (int i = 0; i < n_x; i++) {
            const vec8 xk = load8(x + (m0 + i) * in_features + k0);
            for (int r = 0; r < ROW_BLOCK; r++) acc[i][r] += xk * wk[r];
        }
    }
    for (int i = 0; i < n_x; i++)
        for (int r = 0; r < ROW_BLOCK && n0 + r < n_out; r++) {
            const float dot = sum8(acc[i][r]);
            out[(m0 + i) * n_out + n0 + r] = bias == NULL ? dot : dot + bias[n0 + r];
        }
}

/* out[:, n0 : n0 + ROW_BLOCK] for every row of x; W rows past n_out are computed on row
 * n_out - 1 and not stored. in_features is a multiple of LANES. */
VECTOR_CLONES
static void row_block(float *out, const float *x, const float *weight, const float *bias,
                      int64_t rows, int64_t in_features, int64_t n_out, int64_t n0) {
    const float *w[ROW_BLOCK];
    for (int64_t r = 0; r < ROW_BLOCK; r++)
        w[r] = weight + (n0 + r < n_out ? n0 + r : n_out - 1) * in_features;
    int64_t m = 0;
    for (; m + X_BLOCK <= rows; m += X_BLOCK)
        tile(out, x, w, bias, in_features, n_out, n0, m, X_BLOCK);
    for (; m < rows; m++) tile(out, x, w, bias, in_features, n_out, n0, m, 1);
}

static PyObject *linear(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, x, weight, bias, rows, in_features, n_out;
    if (!PyArg_ParseTuple(args, "nnnnnnn", &out, &x, &weight, &bias, &rows, &in_features,
                          &n_out))
        return NULL;
    const int64_t blocks = (n_out + ROW_BLOCK - 1) / ROW_BLOCK;
    Py_BEGIN_ALLOW_THREADS;
#pragma omp parallel for schedule(static)
    for (int64_t block = 0; block < blocks; block++)
        row_block((float *)out, (const float *)x, (const float *)weight, (const float *)bias,
                  rows, in_features, n_out, block * ROW_BLOCK);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"linear", linear, METH_VARARGS,
     "linear(out, x, weight, bias, rows, in_features, out_features): data pointers (bias 0 for "
     "none) of contiguous fp32 tensors, then sizes; writes out [rows, out_features]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_skinny_linear",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__skinny_linear(void) { return PyModule_Create(&definition); }
