/* LoRA's low-rank products for one linear and a whole step, every row under its own adapter:
 * Punica's SGMV on the CPU, one call where grouping the rows by adapter in PyTorch took four
 * ops an adapter.
 *
 *   out[r] += scaling[r] * (x[r] A_s^T) B_s^T    for s = row_slots[r] >= 0; rows of -1 untouched
 *
 * A and B^T are the adapted linear's stacks, [slots * width, in] and [slots * width, out]:
 * slot s's block of width = parts * max_rank columns holds each part's (q/k/v, gate/up) A and
 * B^T in its first rank columns, the rest zeros, which are skipped (slot_ranks[s]). The rows
 * are sorted by slot and cut into tiles of up to TILE_ROWS rows of one adapter, which share
 * each vector of A and B^T read. Two phases, threads splitting each: the shrink computes low
 * [rows, width] (dot products of x's rows with their adapter's A rows), the expand adds low's
 * rows times B^T to out's, the threads splitting out's columns. x, A, B^T and out are all fp32
 * or all bf16; bf16 is widened to fp32, and rounded back to bf16 after the shrink and in out,
 * as the PyTorch products round.
 *
 * Paths: avx512 (16-float vectors), avx2 (8-float vectors with FMA) and scalar, written once
 * in lora_path.h; the caller names one (the widest the CPU runs unless a test forces another).
 * Like the other kernels, it links libgomp by soname and so shares torch's OpenMP runtime.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "module.h"
#include "vec8.h"

/* rows of one adapter that share each vector of A and B^T read */
#define TILE_ROWS 4
/* Below this many multiply-adds a call runs on the calling thread: waking the pool costs more
 * than a decode row's products (a few microseconds). */
#define PARALLEL_MIN_WORK (1 << 18)

/* up to TILE_ROWS rows of one adapter: order[first : first + rows] */
struct tile {
    int64_t slot, first, rows;
};

struct lora_call {
    void *out;
    const void *x, *a, *bt;
    const int64_t *slot_ranks;
    const float *row_scaling;
    int64_t in_features, out_features, width, max_rank, parts;
    const int64_t *order; /* the rows with an adapter, by slot */
    const struct tile *tiles;
    int64_t n_tiles;
    float *low; /* [rows, width] */
};

#define PATH scalar
#define N 1
#define DOTS 2
#define COLUMN_VECTORS 2
#define TARGET
#include "lora_path.h"
#undef PATH
#undef N
#undef DOTS
#undef COLUMN_VECTORS
#undef TARGET

#if defined(__x86_64__) && defined(__GNUC__)
#define X86 1
#define PATH avx2
#define N 8
#define DOTS 2
#define COLUMN_VECTORS 2
#define TARGET __attribute__((target("avx2,fma")))
#include "lora_path.h"
#undef PATH
#undef N
#undef DOTS
#undef COLUMN_VECTORS
#undef TARGET

#define PATH avx512
#define N 16
#define DOTS 4
#define COLUMN_VECTORS 4
#define TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")))
#include "lora_path.h"
#undef PATH
#undef N
#undef DOTS
#undef COLUMN_VECTORS
#undef TARGET
#else
#define X86 0
#endif

typedef void (*item_fn)(const struct lora_call *, int64_t);

enum path { SCALAR, AVX2, AVX512, N_PATHS };
static const char *const path_names[] = {"scalar", "avx2", "avx512"};

static int path_runs(enum path path) {
#if X86
    __builtin_cpu_init();
    if (path == AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (path == AVX512)
        return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
               __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
               __builtin_cpu_supports("fma");
#endif
    return path == SCALAR;
}

/* (shrink, expand, A columns a shrink item takes, out columns an expand item takes) of a path
 * and dtype */
static void path_fns(enum path path, int is_bf16, item_fn *shrink, item_fn *expand, int *dots,
                     int *columns) {
    *shrink = is_bf16 ? shrink_bf16_scalar : shrink_fp32_scalar;
    *expand = is_bf16 ? expand_bf16_scalar : expand_fp32_scalar;
    *dots = dots_per_item_scalar, *columns = columns_per_item_scalar;
#if X86
    if (path == AVX2) {
        *shrink = is_bf16 ? shrink_bf16_avx2 : shrink_fp32_avx2;
        *expand = is_bf16 ? expand_bf16_avx2 : expand_fp32_avx2;
        *dots = dots_per_item_avx2, *columns = columns_per_item_avx2;
    }
    if (path == AVX512) {
        *shrink = is_bf16 ? shrink_bf16_avx512 : shrink_fp32_avx512;
        *expand = is_bf16 ? expand_bf16_avx512 : expand_fp32_avx512;
        *dots = dots_per_item_avx512, *columns = columns_per_item_avx512;
    }
#endif
}

/* The rows with an adapter in order of their slots (order), cut into tiles; returns the
 * number of tiles, or -1 (Python error set) for a slot outside 0..slots - 1. */
static int64_t tile_rows(const int64_t *row_slots, int64_t rows, int64_t slots, int64_t *order,
                         struct tile *tiles) {
    int64_t *starts = calloc(slots + 1, sizeof(int64_t));
    if (starts == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (int64_t r = 0; r < rows; r++) {
        if (row_slots[r] >= slots || row_slots[r] < -1) {
            PyErr_Format(PyExc_ValueError, "lora: row %ld takes slot %ld, not one of the %ld",
                         (long)r, (long)row_slots[r], (long)slots);
            free(starts);
            return -1;
        }
        if (row_slots[r] >= 0) starts[row_slots[r] + 1]++;
    }
    for (int64_t s = 0; s < slots; s++) starts[s + 1] += starts[s];
    int64_t n_tiles = 0;
    for (int64_t s = 0; s < slots; s++)
        for (int64_t first = starts[s]; first < starts[s + 1]; first += TILE_ROWS) {
            const int64_t left = starts[s + 1] - first;
            tiles[n_tiles++] = (struct tile){s, first, left < TILE_ROWS ? left : TILE_ROWS};
        }
    for (int64_t r = 0; r < rows; r++)
        if (row_slots[r] >= 0) order[starts[row_slots[r]]++] = r;
    free(starts);
    return n_tiles;
}

static PyObject *add_products(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, x, a, bt, step_rows, slot_ranks;
    Py_ssize_t rows, in_features, out_features, slots, width, max_rank;
    int is_bf16;
    const char *name;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnnnps", &out, &x, &a, &bt, &step_rows, &slot_ranks,
                          &rows, &in_features, &out_features, &slots, &width, &max_rank,
                          &is_bf16, &name))
        return NULL;
    enum path path = N_PATHS;
    for (int p = SCALAR; p < N_PATHS; p++)
        if (strcmp(name, path_names[p]) == 0) path = p;
    if (path == N_PATHS || !path_runs(path))
        return PyErr_Format(PyExc_ValueError,
                            "lora: no path %s on this CPU (scalar, avx2, avx512 where it runs)",
                            name);
    if (max_rank <= 0 || width % max_rank != 0)
        return PyErr_Format(PyExc_ValueError, "lora: width %zd is not a multiple of rank %zd",
                            width, max_rank);
    const int64_t *row_slots = (const int64_t *)((const int64_t *)step_rows)[0];
    float *low = malloc(sizeof(float) * (rows * width + 1));
    int64_t *order = malloc(sizeof(int64_t) * (rows + 1));
    struct tile *tiles = malloc(sizeof(struct tile) * (rows + slots + 1));
    int64_t n_tiles = -1;
    if (low == NULL || order == NULL || tiles == NULL)
        PyErr_NoMemory();
    else
        n_tiles = tile_rows(row_slots, rows, slots, order, tiles);
    if (n_tiles < 0) {
        free(low);
        free(order);
        free(tiles);
        return NULL;
    }
    const struct lora_call c = {
        .out = (void *)out, .x = (const void *)x, .a = (const void *)a, .bt = (const void *)bt,
        .slot_ranks = (const int64_t *)slot_ranks,
        .row_scaling = (const float *)((const int64_t *)step_rows)[1],
        .in_features = in_features, .out_features = out_features, .width = width,
        .max_rank = max_rank, .parts = width / max_rank, .order = order, .tiles = tiles,
        .n_tiles = n_tiles, .low = low};
    item_fn shrink, expand;
    int dots, columns;
    path_fns(path, is_bf16, &shrink, &expand, &dots, &columns);
    const int64_t shrink_items = n_tiles * c.parts * ((max_rank + dots - 1) / dots);
    const int64_t expand_items = out_features / columns + 1;
    const int64_t work = rows * width * (in_features + out_features);
    Py_BEGIN_ALLOW_THREADS;
#pragma omp parallel if (work >= PARALLEL_MIN_WORK)
    {
#pragma omp for schedule(static)
        for (int64_t i = 0; i < shrink_items; i++) shrink(&c, i);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < expand_items; i++) expand(&c, i);
    }
    Py_END_ALLOW_THREADS;
    free(low);
    free(order);
    free(tiles);
    Py_RETURN_NONE;
}

static PyObject *paths(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    PyObject *names = PyList_New(0);
    for (int path = SCALAR; names != NULL && path < N_PATHS; path++) {
        if (!path_runs(path)) continue;
        PyObject *name = PyUnicode_FromString(path_names[path]);
        if (name == NULL || PyList_Append(names, name) < 0) Py_CLEAR(names);
        Py_XDECREF(name);
    }
    return names;
}

static PyMethodDef methods[] = {
    {"add_products", add_products, METH_VARARGS,
     "add_products(out, x, a, bt, step_rows, slot_ranks, rows, in_features, out_features, "
     "slots, width, max_rank, is_bf16, path): data pointers of contiguous tensors (out, x, a, "
     "bt all fp32 or all bf16; slot_ranks int64 [slots]; step_rows int64 [2], the addresses of "
     "the rows' slots, int64 [rows], and scalings, fp32 [rows]), then sizes; adds each row's "
     "adapter's products to out [rows, out_features]."},
    {"paths", paths, METH_NOARGS, "paths(): the CPU paths this machine runs, slowest first."},
    {NULL, NULL, 0, NULL},
};

ASTRAI_MODULE(_lora, methods)
