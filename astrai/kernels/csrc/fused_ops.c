/* The small ops between a layer's linears, one call each, for fp32 and bf16 on the CPU.
 *
 * At batch 1 a decode step's linears stream the weights at the machine's read rate, and what
 * is left of the step is some 35 PyTorch ops per layer on a few hundred floats each, every one
 * paying the dispatcher and an allocation: much of the step (benchmarks/README.md). These
 * three kernels do the work of about 20 of those ops:
 *   rms_norm   (x + residual, then RMSNorm of the sum): add, pow, mean, add, rsqrt, mul, mul
 *   gated_mul  silu(gate) * up (or GELU's, Gemma) of the fused gate/up projection: chunk, act, mul
 *   rope       x * cos + swap_halves(x) * signed_sin: roll, mul, mul, add
 * and gather_rows copies a table's rows (a dense embedding's, rope's cos and sin tables) as
 * index_select would, so a recorded step can look them up.
 * Every row is computed alone in a fixed order, so a row's result does not depend on the batch.
 * Built with -ffp-contract=off: rope is then bit-identical to the PyTorch ops it replaces.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "module.h"
#include "vec8.h"

/* Below this many values an op runs on the calling thread: waking the pool costs more. */
#define PARALLEL_MIN_VALUES 32768

/* Rows are fp32 or bf16. A bf16 op computes in fp32 and rounds to bf16 wherever the PyTorch
 * formula it replaces rounds (after each op), so the two agree but for the last ulp of a sum
 * or an exp; in fp32 rounding is the identity. Inlined with is_bf16 a constant. */
static inline __attribute__((always_inline)) vec8 rounded(vec8 v, const int is_bf16) {
    return is_bf16 ? round8_bf16(v) : v;
}

/* out = RMSNorm(x + residual) * weight, and residual_out = x + residual; without a residual
 * (residual == NULL) out = RMSNorm(x) * weight. Rows of dim values, dim a multiple of LANES.
 * bf16 rounds the sum, the normalised row and the product with the weight, as transformers. */
static inline __attribute__((always_inline)) void rms_norm_row(
    void *out, void *residual_out, const void *x, const void *residual, const void *weight,
    float eps, int64_t dim, const int is_bf16) {
    const void *h = x;
    if (residual != NULL) {
        for (int64_t d = 0; d < dim; d += LANES)
            store_any(residual_out, d,
                      load_any(x, d, is_bf16) + load_any(residual, d, is_bf16), is_bf16);
        h = residual_out;
    }
    vec8 squares = {0.0f};
    for (int64_t d = 0; d < dim; d += LANES) {
        const vec8 v = load_any(h, d, is_bf16);
        squares += v * v;
    }
    const float inv_rms = 1.0f / sqrtf(sum8(squares) / (float)dim + eps);
    for (int64_t d = 0; d < dim; d += LANES)
        store_any(out, d,
                  rounded(load_any(h, d, is_bf16) * inv_rms, is_bf16) *
                      load_any(weight, d, is_bf16),
                  is_bf16);
}

/* x * sigmoid(s) = x / (1 + exp(-s)). For s < 0 it is taken as x * e / (1 + e) with e = exp(s):
 * the exponent is never positive, so nothing overflows. */
static inline __attribute__((always_inline)) vec8 times_sigmoid(vec8 x, vec8 s) {
    const int8v negative = s < 0.0f;
    const vec8 e = exp_nonpositive(select8(negative, s, -s));
    return select8(negative, x * e, x) / (1.0f + e);
}

/* GELU's tanh approximation 0.5 g (1 + tanh(u)), u = sqrt(2 / pi) (g + 0.044715 g^3), is
 * g * sigmoid(2u): the same function without the cancellation of 1 + tanh(u) at negative u,
 * where PyTorch's formula keeps only a few bits (the two agree to 1e-7 of the gate there). */
static inline __attribute__((always_inline)) vec8 gelu_tanh8(vec8 g) {
    return times_sigmoid(g, 1.5957691216057308f * (g + 0.044715f * (g * g * g)));
}

/* out[:dim] = act(gate_up[:dim]) * gate_up[dim:], act silu or (gelu) GELU's tanh form. bf16
 * rounds act's result before the product, as F.silu(gate) * up does. */
static inline __attribute__((always_inline)) void gated_mul_row(void *out, const void *gate_up,
                                                                 int64_t dim, int gelu,
                                                                 const int is_bf16) {
    for (int64_t d = 0; d < dim; d += LANES) {
        const vec8 g = load_any(gate_up, d, is_bf16), up = load_any(gate_up, dim + d, is_bf16);
        const vec8 act = gelu ? gelu_tanh8(g) : times_sigmoid(g, g); /* GELU or SiLU */
        store_any(out, d, rounded(act, is_bf16) * up, is_bf16);
    }
}

static inline __attribute__((always_inline)) float load1(const void *p, int64_t i,
                                                           const int is_bf16) {
    return is_bf16 ? bf16_to_float(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

static inline __attribute__((always_inline)) float rounded1(float v, const int is_bf16) {
    return is_bf16 ? bf16_to_float(float_to_bf16(v)) : v;
}

/* x * cos + partner * signed_sin for one value; bf16 rounds both products and the sum, as the
 * PyTorch ops do, and the caller's store rounds the sum. */
static inline __attribute__((always_inline)) float rotated(const void *x, int64_t i,
                                                            int64_t partner, const void *cos,
                                                            const void *signed_sin, int64_t d,
                                                            const int is_bf16) {
    return rounded1(load1(x, i, is_bf16) * load1(cos, d, is_bf16), is_bf16) +
           rounded1(load1(x, partner, is_bf16) * load1(signed_sin, d, is_bf16), is_bf16);
}

/* One row of heads: out = x * cos + swap_halves(x) * signed_sin, head by head, where cos and
 * signed_sin hold head_dim values for this row's position. */
static inline __attribute__((always_inline)) void rope_row(void *out, const void *x,
                                                            const void *cos,
                                                            const void *signed_sin,
                                                            int64_t heads, int64_t head_dim,
                                                            const int is_bf16) {
    const int64_t half = head_dim / 2;
    for (int64_t i = 0; i < heads * head_dim; i += head_dim)
        for (int64_t d = 0; d < head_dim; d++) {
            const float v = rotated(x, i + d, d < half ? i + d + half : i + d - half, cos,
                                    signed_sin, d, is_bf16);
            if (is_bf16)
                ((bf16 *)out)[i + d] = float_to_bf16(v);
            else
                ((float *)out)[i + d] = v;
        }
}

FP32_AND_BF16(rms_norm_row,
              (void *out, void *residual_out, const void *x, const void *residual,
               const void *weight, float eps, int64_t dim),
              out, residual_out, x, residual, weight, eps, dim)

static PyObject *rms_norm(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, residual_out, x, residual, weight, rows, dim;
    float eps;
    int is_bf16;
    if (!PyArg_ParseTuple(args, "nnnnnfnnp", &out, &residual_out, &x, &residual, &weight, &eps,
                          &rows, &dim, &is_bf16))
        return NULL;
    void (*const row)(void *, void *, const void *, const void *, const void *, float, int64_t) =
        is_bf16 ? rms_norm_row_bf16 : rms_norm_row_fp32;
    const int64_t row_bytes = dim * (is_bf16 ? sizeof(bf16) : sizeof(float));
    Py_BEGIN_ALLOW_THREADS;
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_VALUES)
    for (int64_t r = 0; r < rows; r++)
        row((char *)out + r * row_bytes, residual ? (char *)residual_out + r * row_bytes : NULL,
            (const char *)x + r * row_bytes, residual ? (const char *)residual + r * row_bytes : NULL,
            (const void *)weight, eps, dim);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

FP32_AND_BF16(gated_mul_row, (void *out, const void *gate_up, int64_t dim, int gelu), out,
              gate_up, dim, gelu)

static PyObject *gated_mul(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, gate_up, rows, dim;
    int gelu, is_bf16;
    if (!PyArg_ParseTuple(args, "nnnnpp", &out, &gate_up, &rows, &dim, &gelu, &is_bf16))
        return NULL;
    void (*const row)(void *, const void *, int64_t, int) =
        is_bf16 ? gated_mul_row_bf16 : gated_mul_row_fp32;
    const int64_t row_bytes = dim * (is_bf16 ? sizeof(bf16) : sizeof(float));
    Py_BEGIN_ALLOW_THREADS;
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_VALUES)
    for (int64_t r = 0; r < rows; r++)
        row((char *)out + r * row_bytes, (const char *)gate_up + 2 * r * row_bytes, dim, gelu);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

FP32_AND_BF16(rope_row,
              (void *out, const void *x, const void *cos, const void *signed_sin, int64_t heads,
               int64_t head_dim),
              out, x, cos, signed_sin, heads, head_dim)

static PyObject *rope(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, x, cos, signed_sin, rows, heads, head_dim, x_row_stride;
    int is_bf16;
    if (!PyArg_ParseTuple(args, "nnnnnnnnp", &out, &x, &cos, &signed_sin, &rows, &heads,
                          &head_dim, &x_row_stride, &is_bf16))
        return NULL;
    void (*const row)(void *, const void *, const void *, const void *, int64_t, int64_t) =
        is_bf16 ? rope_row_bf16 : rope_row_fp32;
    const int64_t size = is_bf16 ? sizeof(bf16) : sizeof(float);
    Py_BEGIN_ALLOW_THREADS;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim >= PARALLEL_MIN_VALUES)
    for (int64_t r = 0; r < rows; r++)
        row((char *)out + r * heads * head_dim * size, (const char *)x + r * x_row_stride * size,
            (const char *)cos + r * head_dim * size, (const char *)signed_sin + r * head_dim * size,
            heads, head_dim);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyObject *gather_rows(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, table, index, rows, row_bytes, table_rows;
    if (!PyArg_ParseTuple(args, "nnnnnn", &out, &table, &index, &rows, &row_bytes, &table_rows))
        return NULL;
    const int64_t *const at = (const int64_t *)index;
    for (Py_ssize_t r = 0; r < rows; r++)
        if (at[r] < 0 || at[r] >= table_rows)
            return PyErr_Format(PyExc_IndexError, "row %lld of a table of %zd rows",
                                (long long)at[r], table_rows);
    for (Py_ssize_t r = 0; r < rows; r++)
        memcpy((char *)out + r * row_bytes, (const char *)table + at[r] * row_bytes, row_bytes);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS,
     "rms_norm(out, residual_out, x, residual, weight, eps, rows, dim, is_bf16): data pointers "
     "of contiguous [rows, dim] tensors, all fp32 or all bf16 (residual and residual_out 0 for "
     "none), then sizes."},
    {"gated_mul", gated_mul, METH_VARARGS,
     "gated_mul(out, gate_up, rows, dim, gelu, is_bf16): out [rows, dim] = act(gate) * up of "
     "gate_up [rows, 2 * dim], act silu or (gelu) GELU's tanh approximation."},
    {"rope", rope, METH_VARARGS,
     "rope(out, x, cos, signed_sin, rows, heads, head_dim, x_row_stride, is_bf16): out [rows, "
     "heads, head_dim] from x rows x_row_stride values apart; cos and signed_sin [rows, "
     "head_dim]."},
    {"gather_rows", gather_rows, METH_VARARGS,
     "gather_rows(out, table, index, rows, row_bytes, table_rows): out's rows are the table's "
     "rows index[0 .. rows) (int64), row_bytes each; IndexError for an index outside "
     "[0, table_rows)."},
    {NULL, NULL, 0, NULL},
};

ASTRAI_MODULE(_fused_ops, methods)
