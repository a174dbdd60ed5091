/* One CPU path of lora.c's products, written once on vectors of N floats and included once
 * per path: lora.c defines PATH (the suffix of this path's functions), N (floats a vector),
 * DOTS (A rows a shrink tile takes at once), COLUMN_VECTORS (vectors of out's columns an expand
 * tile sums at once; DOTS and COLUMN_VECTORS keep a tile's sums in the path's registers) and
 * TARGET (the path's target attribute, or nothing) before each include.
 *
 * A tile is up to TILE_ROWS rows of one adapter, so each vector of A or B^T read serves all of
 * them. Every sum runs in a fixed order whatever the tile (a dot product's vectors, its lanes
 * pairwise, then its tail; the expand's columns of A in order), so a row's result does not
 * depend on the batch. The paths round their fp32 sums differently from one another.
 */
#define GLUE_(a, b) a##_##b
#define GLUE(a, b) GLUE_(a, b)
#define FN(name) GLUE(name, PATH)
#define VEC FN(vec)
#define HALVES FN(halves)
#define WORDS FN(words)
#define PATH_INLINE TARGET static inline __attribute__((always_inline))

/* what lora.c's items count in: A columns a shrink item takes, out columns an expand item */
enum { FN(dots_per_item) = DOTS, FN(columns_per_item) = COLUMN_VECTORS * N };

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

/* v's lanes summed pairwise: halves added until one is left */
PATH_INLINE float FN(lanes_sum)(VEC v) {
    float lanes[N];
    __builtin_memcpy(lanes, &v, sizeof lanes);
    for (int width = N / 2; width >= 1; width /= 2)
        for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
    return lanes[0];
}

/* low[row, j0 + q] = x[row] . A[slot * width + j0 + q] for the tile's nr rows and q < nj, each
 * A vector read once for the nr rows (nr, nj constants once inlined). bf16 rounds them to
 * bf16, as the product x A^T in bf16 does. */
PATH_INLINE void FN(dots)(const struct lora_call *c, const struct tile *t, int64_t j0,
                          const int nr, const int nj, const int is_bf16) {
    const int64_t in = c->in_features;
    const int64_t a_row = t->slot * c->width + j0;
    const int64_t *rows = c->order + t->first;
    int64_t x_row[TILE_ROWS];
    for (int i = 0; i < nr; i++) x_row[i] = rows[i] * in;
    VEC acc[TILE_ROWS][DOTS];
    for (int i = 0; i < nr; i++)
        for (int q = 0; q < nj; q++) acc[i][q] = (VEC){0.0f};
    int64_t k = 0;
    for (; k + N <= in; k += N) {
        VEC xk[TILE_ROWS];
        for (int i = 0; i < nr; i++) xk[i] = FN(load)(c->x, x_row[i] + k, is_bf16);
        for (int q = 0; q < nj; q++) {
            const VEC ak = FN(load)(c->a, (a_row + q) * in + k, is_bf16);
            for (int i = 0; i < nr; i++) acc[i][q] += xk[i] * ak;
        }
    }
    for (int i = 0; i < nr; i++)
        for (int q = 0; q < nj; q++) {
            float dot = FN(lanes_sum)(acc[i][q]);
            for (int64_t u = k; u < in; u++)
                dot += FN(at)(c->x, x_row[i] + u, is_bf16) *
                       FN(at)(c->a, (a_row + q) * in + u, is_bf16);
            c->low[rows[i] * c->width + j0 + q] =
                is_bf16 ? bf16_to_float(float_to_bf16(dot)) : dot;
        }
}

/* dots() for a tile of nr rows, nr a constant */
PATH_INLINE void FN(tile_dots)(const struct lora_call *c, const struct tile *t, int64_t j0,
                               int64_t nj, const int nr, const int is_bf16) {
    if (nj == DOTS)
        FN(dots)(c, t, j0, nr, DOTS, is_bf16);
    else
        for (int64_t q = 0; q < nj; q++) FN(dots)(c, t, j0 + q, nr, 1, is_bf16);
}

/* Shrink item i: tile i / blocks's dot products for block i % blocks of its adapter's A
 * columns (each part's first rank columns, DOTS at a time). */
PATH_INLINE void FN(shrink)(const struct lora_call *c, int64_t item, const int is_bf16) {
    const int64_t per_part = (c->max_rank + DOTS - 1) / DOTS;
    const struct tile *t = &c->tiles[item / (c->parts * per_part)];
    const int64_t block = item % (c->parts * per_part);
    const int64_t i0 = block % per_part * DOTS, rank = c->slot_ranks[t->slot];
    if (i0 >= rank) return;
    const int64_t j0 = block / per_part * c->max_rank + i0;
    const int64_t nj = rank - i0 < DOTS ? rank - i0 : DOTS;
    switch (t->rows) {
    case 1: FN(tile_dots)(c, t, j0, nj, 1, is_bf16); break;
    case 2: FN(tile_dots)(c, t, j0, nj, 2, is_bf16); break;
    case 3: FN(tile_dots)(c, t, j0, nj, 3, is_bf16); break;
    default: FN(tile_dots)(c, t, j0, nj, TILE_ROWS, is_bf16); break;
    }
}

/* out[row, c0 : c0 + nv * N] += scaling[row] * low[row] B^T[the slot's columns] for the tile's
 * nr rows, each B^T vector read once for them (nr, nv constants once inlined). */
PATH_INLINE void FN(expand)(const struct lora_call *c, const struct tile *t, int64_t c0,
                            const int nr, const int nv, const int is_bf16) {
    const int64_t n_out = c->out_features, rank = c->slot_ranks[t->slot];
    const int64_t *rows = c->order + t->first;
    VEC acc[TILE_ROWS][COLUMN_VECTORS];
    for (int i = 0; i < nr; i++)
        for (int v = 0; v < nv; v++) acc[i][v] = (VEC){0.0f};
    for (int64_t p = 0; p < c->parts; p++)
        for (int64_t k = 0; k < rank; k++) {
            const int64_t j = p * c->max_rank + k;
            const int64_t bt_row = (t->slot * c->width + j) * n_out + c0;
            float low[TILE_ROWS];
            for (int i = 0; i < nr; i++) low[i] = c->low[rows[i] * c->width + j];
            for (int v = 0; v < nv; v++) {
                const VEC btv = FN(load)(c->bt, bt_row + v * N, is_bf16);
                for (int i = 0; i < nr; i++) acc[i][v] += low[i] * btv;
            }
        }
    for (int i = 0; i < nr; i++) {
        const float scaling = c->row_scaling[rows[i]];
        for (int v = 0; v < nv; v++) {
            const int64_t at = rows[i] * n_out + c0 + v * N;
            FN(store)(c->out, at, FN(load)(c->out, at, is_bf16) + scaling * acc[i][v], is_bf16);
        }
    }
}

/* expand() for every tile, nv a constant */
PATH_INLINE void FN(expand_tiles)(const struct lora_call *c, int64_t c0, const int nv,
                                  const int is_bf16) {
    for (int64_t t = 0; t < c->n_tiles; t++) {
        const struct tile *tile = &c->tiles[t];
        switch (tile->rows) {
        case 1: FN(expand)(c, tile, c0, 1, nv, is_bf16); break;
        case 2: FN(expand)(c, tile, c0, 2, nv, is_bf16); break;
        case 3: FN(expand)(c, tile, c0, 3, nv, is_bf16); break;
        default: FN(expand)(c, tile, c0, TILE_ROWS, nv, is_bf16); break;
        }
    }
}

/* Expand item i: columns [i * COLUMN_VECTORS * N, +COLUMN_VECTORS * N); the last item the
 * columns past the whole blocks, a vector and then a column at a time. */
PATH_INLINE void FN(expand_item)(const struct lora_call *c, int64_t item, const int is_bf16) {
    const int64_t block_columns = COLUMN_VECTORS * N, n_out = c->out_features;
    const int64_t whole = n_out / block_columns;
    if (item < whole) {
        FN(expand_tiles)(c, item * block_columns, COLUMN_VECTORS, is_bf16);
        return;
    }
    int64_t c0 = whole * block_columns;
    for (; c0 + N <= n_out; c0 += N) FN(expand_tiles)(c, c0, 1, is_bf16);
    for (; c0 < n_out; c0++)
        for (int64_t t = 0; t < c->n_tiles; t++) {
            const int64_t slot = c->tiles[t].slot;
            for (int64_t i = 0; i < c->tiles[t].rows; i++) {
                const int64_t row = c->order[c->tiles[t].first + i];
                float acc = 0.0f;
                for (int64_t p = 0; p < c->parts; p++)
                    for (int64_t k = 0; k < c->slot_ranks[slot]; k++) {
                        const int64_t j = p * c->max_rank + k;
                        acc += c->low[row * c->width + j] *
                               FN(at)(c->bt, (slot * c->width + j) * n_out + c0, is_bf16);
                    }
                const int64_t at = row * n_out + c0;
                const float sum = FN(at)(c->out, at, is_bf16) + c->row_scaling[row] * acc;
                if (is_bf16)
                    ((bf16 *)c->out)[at] = float_to_bf16(sum);
                else
                    ((float *)c->out)[at] = sum;
            }
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
