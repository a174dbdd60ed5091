/* The small ops between a layer's linears, one call each, for fp32 on the CPU.
 *
 * At batch 1 a decode step's linears stream the weights at the machine's read rate, and what
 * is left of the step is some 35 PyTorch ops per layer on a few hundred floats each, every one
 * paying the dispatcher and an allocation: a third of the step (benchmarks/README.md). These
 * three kernels do the work of about 20 of those ops:
 *   rms_norm   (x + residual, then RMSNorm of the sum): add, pow, mean, add, rsqrt, mul, mul
 *   silu_mul   silu(gate) * up of the fused gate/up projection: chunk, silu, mul
 *   rope       x * cos + swap_halves(x) * signed_sin: roll, mul, mul, add
 * Every row is computed alone in a fixed order, so a row's result does not depend on the batch.
 * Built with -ffp-contract=off: rope is then bit-identical to the PyTorch ops it replaces.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#include "vec8.h"

/* Below this many floats an op runs on the calling thread: waking the pool costs more. */
#define PARALLEL_MIN_FLOATS 32768

/* out = RMSNorm(x + residual) * weight, and residual_out = x + residual; without a residual
 * (residual == NULL) out = RMSNorm(x) * weight. Rows of dim floats, dim a multiple of LANES. */
VECTOR_CLONES
static void rms_norm_row(float *out, float *residual_out, const float *x, const float *residual,
                         const float *weight, float eps, int64_t dim) {
    const float *h = x;
    if (residual != NULL) {
        for (int64_t d = 0; d < dim; d += LANES)
            store8(residual_out + d, load8(x + d) + load8(residual + d));
        h = residual_out;
    }
    vec8 squares = {0.0f};
    for (int64_t d = 0; d < dim; d += LANES) {
        const vec8 v = load8(h + d);
        squares += v * v;
    }
    const float inv_rms = 1.0f / sqrtf(sum8(squares) / (float)dim + eps);
    for (int64_t d = 0; d < dim; d += LANES)
        store8(out + d, load8(h + d) * inv_rms * load8(weight + d));
}

static PyObject *rms_norm(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, residual_out, x, residual, weight, rows, dim;
    float eps;
    if (!PyArg_ParseTuple(args, "nnnnnfnn", &out, &residual_out, &x, &residual, &weight, &eps,
                          &rows, &dim))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++)
        rms_norm_row((float *)out + r * dim, residual ? (float *)residual_out + r * dim : NULL,
                     (const float *)x + r * dim,
                     residual ? (const float *)residual + r * dim : NULL, (const float *)weight,
                     eps, dim);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* out[:dim] = silu(gate_up[:dim]) * gate_up[dim:], silu(g) = g / (1 + exp(-g)). For g < 0 it
 * is taken as g * e / (1 + e) with e = exp(g): the exponent is never positive, so nothing
 * overflows. */
VECTOR_CLONES
static void silu_mul_row(float *out, const float *gate_up, int64_t dim) {
    for (int64_t d = 0; d < dim; d += LANES) {
        const vec8 g = load8(gate_up + d), up = load8(gate_up + dim + d);
        const int8v negative = g < 0.0f;
        const vec8 e = exp_nonpositive(select8(negative, g, -g));
        store8(out + d, select8(negative, g * e, g) / (1.0f + e) * up);
    }
}

static PyObject *silu_mul(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, gate_up, rows, dim;
    if (!PyArg_ParseTuple(args, "nnnn", &out, &gate_up, &rows, &dim)) return NULL;
    Py_BEGIN_ALLOW_THREADS;
#pragma omp parallel for schedule(static) if (rows * dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++)
        silu_mul_row((float *)out + r * dim, (const float *)gate_up + 2 * r * dim, dim);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

/* One row of heads: out = x * cos + swap_halves(x) * signed_sin, head by head, where cos and
 * signed_sin hold head_dim floats for this row's position. */
VECTOR_CLONES
static void rope_row(float *out, const float *x, const float *cos, const float *signed_sin,
                     int64_t heads, int64_t head_dim) {
    const int64_t half = head_dim / 2;
    for (int64_t h = 0; h < heads; h++) {
        const float *xh = x + h * head_dim;
        float *oh = out + h * head_dim;
        for (int64_t d = 0; d < half; d++) oh[d] = xh[d] * cos[d] + xh[d + half] * signed_sin[d];
        for (int64_t d = half; d < head_dim; d++)
            oh[d] = xh[d] * cos[d] + xh[d - half] * signed_sin[d];
    }
}

static PyObject *rope(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, x, cos, signed_sin, rows, heads, head_dim, x_row_stride;
    if (!PyArg_ParseTuple(args, "nnnnnnnn", &out, &x, &cos, &signed_sin, &rows, &heads,
                          &head_dim, &x_row_stride))
        return NULL;
    Py_BEGIN_ALLOW_THREADS;
#pragma omp parallel for schedule(static) if (rows * heads * head_dim >= PARALLEL_MIN_FLOATS)
    for (int64_t r = 0; r < rows; r++)
        rope_row((float *)out + r * heads * head_dim, (const float *)x + r * x_row_stride,
                 (const float *)cos + r * head_dim, (const float *)signed_sin + r * head_dim,
                 heads, head_dim);
    Py_END_ALLOW_THREADS;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"rms_norm", rms_norm, METH_VARARGS,
     "rms_norm(out, residual_out, x, residual, weight, eps, rows, dim): data pointers of "
     "contiguous fp32 [rows, dim] tensors (residual and residual_out 0 for none), then sizes."},
    {"silu_mul", silu_mul, METH_VARARGS,
     "silu_mul(out, gate_up, rows, dim): out [rows, dim] = silu(gate) * up of gate_up "
     "[rows, 2 * dim]."},
    {"rope", rope, METH_VARARGS,
     "rope(out, x, cos, signed_sin, rows, heads, head_dim, x_row_stride): out [rows, heads, "
     "head_dim] from x rows x_row_stride floats apart; cos and signed_sin [rows, head_dim]."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef definition = {
    PyModuleDef_HEAD_INIT,
    .m_name = "_fused_ops",
    .m_size = -1,
    .m_methods = methods,
};

PyMODINIT_FUNC PyInit__fused_ops(void) { return PyModule_Create(&definition); }
