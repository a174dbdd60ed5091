/* One CPU path of lora.c's products, written once on vectors of N floats and included once
 * per path: lora.c defines PATH (the suffix of this path's functions), N (floats a vector) and
 * TARGET (the path's target attribute, or nothing) before each include.
 *
 * A row's products are summed in a fixed order (a dot product's lanes, then its tail; the
 * expand's columns of A in order), whatever the other rows or the threads, so a row's result
 * does not depend on the batch. The paths round their fp32 sums differently from one another.
 */
#define GLUE_(a, b) a##_##b
#define GLUE(a, b) GLUE_(a, b)
#define FN(name) GLUE(name, PATH)
#define VEC FN(vec)
#define HALVES FN(halves)
#define WORDS FN(words)
#define PATH_INLINE TARGET static inline __attribute__((always_inline))

typedef float VEC __attribute__((vector_size(N * sizeof(float))));
typedef uint16_t HALVES __attribute__((vector_size(N * sizeof(uint16_t))));
typedef uint32_t WORDS __attribute__((vector_size(N * sizeof(uint32_t))));

/* N values of an fp32 or bf16 array from element i, as fp32 (is_bf16 a constant once inlined) */
PATH_INLINE VEC FN(load)(const void *p, int64_t i, const int is_bf16) {
    if (is_bf16) {
        HALVES h;
        __builtin_memcpy(&h, (const bf16 *)p + i, sizeof h);
        return (VEC)(__builtin_convertvector(h, WORDS) << 16);
    }
    VEC v;
    __builtin_memcpy(&v, (const float *)p + i, sizeof v);
    return v;
}

/* v at element i, each lane rounded to bf16 as float_to_bf16 does (ties to even, NaN kept) */
PATH_INLINE void FN(store)(void *p, int64_t i, VEC v, const int is_bf16) {
    if (!is_bf16) {
        __builtin_memcpy((float *)p + i, &v, sizeof v);
        return;
    }
    const WORDS bits = (WORDS)v;
    const WORDS rounded = (bits + 0x7fff + (bits >> 16 & 1)) >> 16;
    const WORDS nan = (WORDS)(v != v);
    const HALVES h = __builtin_convertvector((rounded & ~nan) | (0x7fc0 & nan), HALVES);
    __builtin_memcpy((bf16 *)p + i, &h, sizeof h);
}

PATH_INLINE float FN(at)(const void *p, int64_t i, const int is_bf16) {
    return is_bf16 ? bf16_to_float(((const bf16 *)p)[i]) : ((const float *)p)[i];
}

/* low[r, j0 : j0 + nj] = x[r] . A[slot * width + j0 + q] for q < nj: nj dot products that
 * share each load of x (nj a constant once inlined). bf16 rounds them to bf16, as the
 * products x A^T in bf16 do. */
PATH_INLINE void FN(dots)(const struct lora_call *c, int64_t r, int64_t j0, const int nj,
                          const int is_bf16) {
    const int64_t in = c->in_features;
    const int64_t a_row = c->row_slots[r] * c->width + j0;
    VEC acc[DOT_BLOCK];
    for (int q = 0; q < nj; q++) acc[q] = (VEC){0.0f};
    int64_t k = 0;
    for (; k + N <= in; k += N) {
        const VEC xk = FN(load)(c->x, r * in + k, is_bf16);
        for (int q = 0; q < nj; q++) acc[q] += xk * FN(load)(c->a, (a_row + q) * in + k, is_bf16);
    }
    for (int q = 0; q < nj; q++) {
        float dot = 0.0f;
        for (int l = 0; l < N; l++) dot += acc[q][l];
        for (int64_t t = k; t < in; t++)
            dot += FN(at)(c->x, r * in + t, is_bf16) * FN(at)(c->a, (a_row + q) * in + t, is_bf16);
        c->low[r * c->width + j0 + q] = is_bf16 ? bf16_to_float(float_to_bf16(dot)) : dot;
    }
}

/* Shrink item i: row i / blocks' dot products for block i % blocks of its A columns (each
 * part's first rank columns, DOT_BLOCK at a time). */
PATH_INLINE void FN(shrink)(const struct lora_call *c, int64_t item, const int is_bf16) {
    const int64_t per_part = (c->max_rank + DOT_BLOCK - 1) / DOT_BLOCK;
    const int64_t r = item / (c->parts * per_part), block = item % (c->parts * per_part);
    const int64_t slot = c->row_slots[r];
    if (slot < 0) return;
    const int64_t i0 = block % per_part * DOT_BLOCK, rank = c->slot_ranks[slot];
    const int64_t j0 = block / per_part * c->max_rank + i0;
    if (i0 + DOT_BLOCK <= rank)
        FN(dots)(c, r, j0, DOT_BLOCK, is_bf16);
    else
        for (int64_t q = 0; i0 + q < rank; q++) FN(dots)(c, r, j0 + q, 1, is_bf16);
}

/* out[r, c0 : c0 + nv * N] += scaling[r] * low[r] B^T[its slot's columns] for every row r
 * with an adapter: nv vectors of columns summed side by side (nv a constant once inlined). */
PATH_INLINE void FN(expand)(const struct lora_call *c, int64_t c0, const int nv,
                            const int is_bf16) {
    const int64_t n_out = c->out_features;
    for (int64_t r = 0; r < c->rows; r++) {
        const int64_t slot = c->row_slots[r];
        if (slot < 0) continue;
        const int64_t rank = c->slot_ranks[slot];
        VEC acc[EXPAND_BLOCK];
        for (int v = 0; v < nv; v++) acc[v] = (VEC){0.0f};
        for (int64_t p = 0; p < c->parts; p++)
            for (int64_t i = 0; i < rank; i++) {
                const int64_t j = p * c->max_rank + i;
                const float low = c->low[r * c->width + j];
                const int64_t bt_row = (slot * c->width + j) * n_out + c0;
                for (int v = 0; v < nv; v++)
                    acc[v] += low * FN(load)(c->bt, bt_row + v * N, is_bf16);
            }
        const float scaling = c->row_scaling[r];
        for (int v = 0; v < nv; v++) {
            const int64_t at = r * n_out + c0 + v * N;
            FN(store)(c->out, at, FN(load)(c->out, at, is_bf16) + scaling * acc[v], is_bf16);
        }
    }
}

/* Expand item i: columns [i * EXPAND_BLOCK * N, +EXPAND_BLOCK * N), the last item also the
 * columns past the whole blocks, a vector and then a column at a time. */
PATH_INLINE void FN(expand_item)(const struct lora_call *c, int64_t item, const int is_bf16) {
    const int64_t block_columns = EXPAND_BLOCK * N, n_out = c->out_features;
    const int64_t whole = n_out / block_columns;
    if (item < whole) {
        FN(expand)(c, item * block_columns, EXPAND_BLOCK, is_bf16);
        return;
    }
    int64_t c0 = whole * block_columns;
    for (; c0 + N <= n_out; c0 += N) FN(expand)(c, c0, 1, is_bf16);
    for (; c0 < n_out; c0++)
        for (int64_t r = 0; r < c->rows; r++) {
            const int64_t slot = c->row_slots[r];
            if (slot < 0) continue;
            float acc = 0.0f;
            for (int64_t p = 0; p < c->parts; p++)
                for (int64_t i = 0; i < c->slot_ranks[slot]; i++) {
                    const int64_t j = p * c->max_rank + i;
                    acc += c->low[r * c->width + j] *
                           FN(at)(c->bt, (slot * c->width + j) * n_out + c0, is_bf16);
                }
            const float sum = FN(at)(c->out, r * n_out + c0, is_bf16) + c->row_scaling[r] * acc;
            if (is_bf16)
                ((bf16 *)c->out)[r * n_out + c0] = float_to_bf16(sum);
            else
                ((float *)c->out)[r * n_out + c0] = sum;
        }
}

/* the path's entry points, for fp32 and bf16 */
TARGET static void FN(shrink_fp32)(const struct lora_call *c, int64_t item) {
    FN(shrink)(c, item, 0);
}
TARGET static void FN(shrink_bf16)(const struct lora_call *c, int64_t item) {
    FN(shrink)(c, item, 1);
}
TARGET static void FN(expand_fp32)(const struct lora_call *c, int64_t item) {
    FN(expand_item)(c, item, 0);
}
TARGET static void FN(expand_bf16)(const struct lora_call *c, int64_t item) {
    FN(expand_item)(c, item, 1);
}

#undef GLUE_
#undef GLUE
#undef FN
#undef VEC
#undef HALVES
#undef WORDS
#undef PATH_INLINE
