/* Decode attention that reads the paged KV cache in place, on the CPU.
 *
 * Gathering each decode's pages into a contiguous buffer and calling SDPA copies every K/V
 * byte once more and runs a flash kernel tuned for long queries on one-token ones: at 64
 * decodes of 100-380 tokens the gather and SDPA took as long as all the model's linears
 * (benchmarks/README.md). Here each OpenMP work item -- a part of up to KEY_CHUNK keys of a
 * decode, or a (part, kv head) pair when there are too few parts to share out -- walks its pages
 * once for K and once for V, serving every query head that reads a key from the one load; a
 * decode of several parts is then joined from their softmax sums. Each sequence is computed
 * alone in a fixed order, so its result does not depend on what else is in the batch. In a step of
 * decodes alone the kernel also stores each decode's new K/V in its page first, which saves
 * the caller two scatter ops a layer. A layer with a sliding window reads only the keys within
 * it, and a soft-capped one (Gemma 2) caps each scaled logit x at softcap * tanh(x / softcap).
 * A row may see keys past its own position (key_ends: the tokens of a Gemma 3 image see each
 * other); its window still starts from its own position.
 * q, out and the new K/V are fp32, bf16 or fp16, and the cache any of the three (a bf16 or fp16
 * cache halves the bytes a long context reads): keys and values are widened to fp32 as they are
 * read and rounded to the cache's type as they are stored, as PyTorch's conversions round.
 *
 * The extension links libgomp by soname, so in a process that imported torch first it shares
 * torch's OpenMP runtime and thread pool instead of starting a second one.
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

/* Sizes and strides count values, not bytes. */
typedef struct {
    void *out;     /* [num_tokens, n_heads, head_dim], contiguous */
    const void *q; /* rows of q_row_stride values; heads contiguous within a row */
    /* The decodes' own new K and V, rows of new_k/v_row_stride values, which attend_all()
     * stores in the cache before any decode reads it; NULL when the caller has stored them. */
    const void *new_k, *new_v;
    void *k_cache; /* [n_pages, page_size, kv_heads, head_dim], one layer */
    void *v_cache;
    const int64_t *rows;         /* [n] the batch row of each decode */
    const int64_t *block_tables; /* [n, max_pages] */
    const int64_t *context_lens; /* [n] each decode's position + 1: its own key is the last */
    const int64_t *key_ends;     /* [n] the keys each sees end before; NULL: context_lens */
    int64_t n, max_pages, page_size, n_heads, kv_heads, head_dim;
    int64_t q_row_stride, new_k_row_stride, new_v_row_stride;
    int64_t window; /* a decode sees its last window keys only; 0: all */
    float scale;
    float softcap;   /* 0: none */
    int io_dtype;    /* of q, out, new_k and new_v: a DTYPE_ code */
    int cache_dtype; /* of k_cache and v_cache */
} DecodeBatch;

/* The address of value i of an array of dtype. */
static inline __attribute__((always_inline)) const void *at(const void *p, int64_t i,
                                                            const int dtype) {
    return (const char *)p + i * dtype_size(dtype);
}

/* n values (a multiple of LANES) copied from src to dst, converted between their dtypes. */
static inline __attribute__((always_inline)) void
convert(void *dst, const int dst_dtype, const void *src, const int src_dtype, int64_t n) {
    if (dst_dtype == src_dtype) {
        memcpy(dst, src, n * dtype_size(dst_dtype));
        return;
    }
    for (int64_t d = 0; d < n; d += LANES) store_as(dst, d, load_as(src, d, src_dtype), dst_dtype);
}

/* Where token t of a sequence with these pages lies in one layer's K or V cache, in values.
 * The page size is a power of two in practice, and a shift and a mask cost far less than a
 * division. */
static inline int64_t page_token(const DecodeBatch *b, const int64_t *pages, int64_t t) {
    const int64_t token_stride = b->kv_heads * b->head_dim;
    if ((b->page_size & (b->page_size - 1)) == 0) {
        const int shift = __builtin_ctzll((unsigned long long)b->page_size);
        return (pages[t >> shift] << shift | (t & (b->page_size - 1))) * token_stride;
    }
    return (pages[t / b->page_size] * b->page_size + t % b->page_size) * token_stride;
}

/* The keys decode i sees: first .. end - 1, where end is its key end (its own position + 1
 * unless key_ends says more) and first the start of its window, counted from its position. */
static inline int64_t key_range(const DecodeBatch *b, int64_t i, int64_t *first) {
    const int64_t own_end = b->context_lens[i];
    *first = b->window > 0 && own_end > b->window ? own_end - b->window : 0;
    return b->key_ends != NULL ? b->key_ends[i] : own_end;
}

/* Keys scored together: their dot products are independent chains of FMAs, where one dot
 * product alone would wait on its own accumulator at every step; sum8x8 then adds up each
 * one's lanes at once. */
#define KEY_BLOCK LANES

/* Keys a work item attends to at most: a decode's keys are cut into parts of KEY_CHUNK from
 * the first it sees, each part's softmax and weighted values computed on its own and the parts
 * then joined, so that a lone decode's few kv heads still share out over the threads in even
 * parts. The cut depends on the decode's keys alone, never on the batch or the threads, so a
 * decode's result is the same whatever else runs beside it. */
#define KEY_CHUNK 128

/* Keys ahead of the block being scored whose K and V rows are fetched now. An item reads a
 * few hundred bytes a key, in rows a token apart; the step's linears have streamed the cache
 * out of the caches, and a core left to miss on each row in turn reads far below the memory's
 * rate. V, needed after the softmax, is then found in the caches too. */
#define PREFETCH_KEYS (2 * KEY_BLOCK)

static inline __attribute__((always_inline)) void prefetch_row(const void *row, int64_t bytes) {
    for (int64_t line = 0; line < bytes; line += 64)
        __builtin_prefetch((const char *)row + line, 0, 3);
}

/* Query heads of one kv head whose value sums run together, in registers. */
#define HEAD_BLOCK 4

/* out[g, d0 : d0 + n_vec * LANES] = sum over t of s[g * stride + t] * values[t][d0 : ...] for
 * the n_heads <= HEAD_BLOCK heads whose scores rows start at s; out's heads are hd values
 * apart. Inlined with the counts and dtypes constant, so the n_vec * n_heads sums live in
 * vector registers and each token's value vectors are loaded once for all the heads. */
static inline __attribute__((always_inline)) void
weigh_values(void *out, const float *s, int64_t stride, const void *const *values, int64_t ctx,
             int64_t hd, int64_t d0, const int n_heads, const int n_vec, const int io,
             const int cache) {
    vec8 acc[HEAD_BLOCK][2] = {{{0.0f}}};
    for (int64_t t = 0; t < ctx; t++)
        for (int v = 0; v < n_vec; v++) {
            const vec8 value = load_as(values[t], d0 + v * LANES, cache);
            for (int g = 0; g < n_heads; g++) acc[g][v] += s[g * stride + t] * value;
        }
    for (int g = 0; g < n_heads; g++)
        for (int v = 0; v < n_vec; v++) store_as(out, g * hd + d0 + v * LANES, acc[g][v], io);
}

/* weigh_values for a run-time head count, over a slice of n_vec * LANES values. */
static inline __attribute__((always_inline)) void
weigh_values_of(void *out, const float *s, int64_t stride, const void *const *values, int64_t ctx,
                int64_t hd, int64_t d0, int64_t n_heads, const int n_vec, const int io,
                const int cache) {
    switch (n_heads) {
    case 1: weigh_values(out, s, stride, values, ctx, hd, d0, 1, n_vec, io, cache); break;
    case 2: weigh_values(out, s, stride, values, ctx, hd, d0, 2, n_vec, io, cache); break;
    case 3: weigh_values(out, s, stride, values, ctx, hd, d0, 3, n_vec, io, cache); break;
    default: weigh_values(out, s, stride, values, ctx, hd, d0, HEAD_BLOCK, n_vec, io, cache); break;
    }
}

/* out = scores @ V for query heads [kv_begin * group, kv_end * group), written as out_dtype:
 * per kv head, HEAD_BLOCK of its query heads at a time, over 16 values of head_dim at a time (8
 * for the rest). key_rows holds each key's row in the layer's caches and is overwritten. */
static inline __attribute__((always_inline)) void
weigh_heads(void *out, const float *scores, int64_t stride, int64_t *key_rows, int64_t ctx,
            const DecodeBatch *b, int64_t kv_begin, int64_t kv_end, const int out_dtype,
            const int cache) {
    const int64_t hd = b->head_dim, group = b->n_heads / b->kv_heads;
    const void **values = (const void **)key_rows; /* [ctx] V rows, each in its offset's place */
    for (int64_t t = 0; t < ctx; t++) values[t] = at(b->v_cache, key_rows[t], cache);
    for (int64_t kv = kv_begin; kv < kv_end; kv++) {
        if (kv > kv_begin)
            for (int64_t t = 0; t < ctx; t++) values[t] = at(values[t], hd, cache);
        for (int64_t g0 = 0; g0 < group; g0 += HEAD_BLOCK) {
            const int64_t h = (kv - kv_begin) * group + g0; /* first head, of this item's */
            const int64_t n = group - g0 < HEAD_BLOCK ? group - g0 : HEAD_BLOCK;
            void *out_h = (void *)at(out, h * hd, out_dtype);
            int64_t d0 = 0;
            for (; d0 + 2 * LANES <= hd; d0 += 2 * LANES)
                weigh_values_of(out_h, scores + h * stride, stride, values, ctx, hd, d0, n, 2,
                                out_dtype, cache);
            if (d0 < hd)
                weigh_values_of(out_h, scores + h * stride, stride, values, ctx, hd, d0, n, 1,
                                out_dtype, cache);
        }
    }
}

/* The parts of KEY_CHUNK keys decode i's keys are cut into. */
static inline int64_t key_chunks(const DecodeBatch *b, int64_t i) {
    int64_t first;
    const int64_t end = key_range(b, i, &first);
    return (end - first + KEY_CHUNK - 1) / KEY_CHUNK;
}

/* Where a decode cut into several parts keeps each part's results until they are joined, in
 * floats from the part's start: [n_heads, hd] values weighted by exp(score - max), then [n_heads]
 * maxes, then [n_heads] sums of exp(score - max). */
static inline int64_t part_floats(const DecodeBatch *b) { return b->n_heads * (b->head_dim + 2); }

/* Attention of query heads [kv_begin * group, kv_end * group) of decode i, which read kv heads
 * [kv_begin, kv_end), over part chunk of its keys. A decode of one part is written to out;
 * a part of several is written to part (part_floats() floats) and joined by join_parts().
 * scratch holds scratch_len(...) floats. head_dim is a multiple of LANES. Every value is read
 * as fp32, computed in fp32 and rounded once, at the output; io and cache are the dtypes of
 * q/out and of the cache, constants after inlining. */
static inline __attribute__((always_inline)) void attend(const DecodeBatch *b, int64_t i,
                                                         int64_t kv_begin, int64_t kv_end,
                                                         int64_t chunk, float *part,
                                                         float *scratch, const int io,
                                                         const int cache) {
    const int64_t hd = b->head_dim, group = b->n_heads / b->kv_heads;
    const int64_t n_heads = (kv_end - kv_begin) * group;
    int64_t first;
    const int64_t end = key_range(b, i, &first);
    first += chunk * KEY_CHUNK; /* the keys seen: first .. + ctx - 1 */
    const int64_t ctx = end - first < KEY_CHUNK ? end - first : KEY_CHUNK;
    const int64_t stride = (ctx + LANES - 1) / LANES * LANES; /* a head's row of scores */
    const int64_t *pages = b->block_tables + i * b->max_pages;
    const int64_t first_head = kv_begin * group;
    /* [n_heads, hd] each */
    const void *q = at(b->q, b->rows[i] * b->q_row_stride + first_head * hd, io);
    void *out = (void *)at(b->out, (b->rows[i] * b->n_heads + first_head) * hd, io);
    float *scores = scratch; /* [n_heads, stride] */
    /* [KEY_BLOCK, kv_end - kv_begin, hd]: an fp16 key block widened once, not once for each
     * query head that reads it (widening fp16 takes a dozen vector ops, bf16 one) */
    float *widened = scores + n_heads * stride;
    const int64_t widened_row = (kv_end - kv_begin) * hd;
    const int key_dtype = cache == DTYPE_FP16 ? DTYPE_FP32 : cache; /* as the loop reads keys */
    /* [ctx] where each key's row of this item lies in the layer's K and V caches (in values),
     * looked up once for the prefetch, the scores and the weighted sum; the weighted sum then
     * turns each into the address of its V row */
    int64_t *key_rows = (int64_t *)(widened + KEY_BLOCK * widened_row);
    for (int64_t t = 0; t < ctx; t++) key_rows[t] = page_token(b, pages, first + t) + kv_begin * hd;

    const int64_t row_bytes = widened_row * dtype_size(cache); /* of this item's K or V */
    for (int64_t t = 0; t < PREFETCH_KEYS && t < ctx; t++) { /* the keys the loop does not */
        prefetch_row(at(b->k_cache, key_rows[t], cache), row_bytes);
        prefetch_row(at(b->v_cache, key_rows[t], cache), row_bytes);
    }
    for (int64_t t0 = 0; t0 < ctx; t0 += KEY_BLOCK) {
        const int64_t n_keys = ctx - t0 < KEY_BLOCK ? ctx - t0 : KEY_BLOCK;
        for (int64_t t = t0 + PREFETCH_KEYS; t < t0 + PREFETCH_KEYS + KEY_BLOCK && t < ctx; t++) {
            prefetch_row(at(b->k_cache, key_rows[t], cache), row_bytes);
            prefetch_row(at(b->v_cache, key_rows[t], cache), row_bytes);
        }
        const void *keys[KEY_BLOCK];
        for (int64_t j = 0; j < KEY_BLOCK; j++)
            keys[j] = at(b->k_cache, key_rows[t0 + (j < n_keys ? j : 0)], cache);
        if (cache == DTYPE_FP16)
            for (int j = 0; j < KEY_BLOCK; j++) {
                float *row = widened + j * widened_row;
                for (int64_t d = 0; d < widened_row; d += LANES)
                    store8(row + d, load_as(keys[j], d, cache));
                keys[j] = row;
            }
        for (int64_t h = 0; h < n_heads; h++) {
            const int64_t k_offset = (h / group) * hd;
            vec8 acc[KEY_BLOCK] = {{0.0f}};
            for (int64_t d0 = 0; d0 < hd; d0 += LANES) {
                const vec8 qv = load_as(q, h * hd + d0, io);
                for (int j = 0; j < KEY_BLOCK; j++)
                    acc[j] += qv * load_as(keys[j], k_offset + d0, key_dtype);
            }
            /* a whole block: the row is padded to a multiple of LANES, and softmax overwrites
             * the scores past ctx */
            store8(scores + h * stride + t0, sum8x8(acc) * b->scale);
        }
    }

    /* softmax over each head's scores; the padding past ctx is set to the max, so its exp is
     * exactly 1 and is taken back out of the sum */
    for (int64_t h = 0; h < n_heads; h++) {
        float *s = scores + h * stride, max = -INFINITY;
        if (b->softcap > 0.0f)
            for (int64_t t = 0; t < ctx; t++) s[t] = tanhf(s[t] / b->softcap) * b->softcap;
        /* the max a vector at a time (the scalar loop waited on each compare), exact in any
         * order */
        for (int64_t t = ctx; t < stride; t++) s[t] = -INFINITY;
        vec8 maxes = load8(s);
        for (int64_t t0 = LANES; t0 < stride; t0 += LANES) {
            const vec8 v = load8(s + t0);
            maxes = select8(v > maxes, v, maxes);
        }
        for (int l = 0; l < LANES; l++) max = maxes[l] > max ? maxes[l] : max;
        for (int64_t t = ctx; t < stride; t++) s[t] = max;
        vec8 sums = {0.0f};
        for (int64_t t0 = 0; t0 < stride; t0 += LANES) {
            const vec8 e = exp_nonpositive(load8(s + t0) - max);
            store8(s + t0, e);
            sums += e;
        }
        const float sum = sum8(sums) - (float)(stride - ctx); /* padding gave exp(0) */
        if (part != NULL) { /* kept apart, and joined with the decode's other parts */
            part[b->n_heads * hd + first_head + h] = max;
            part[b->n_heads * (hd + 1) + first_head + h] = sum;
            continue;
        }
        const float inv = 1.0f / sum;
        for (int64_t t = 0; t < ctx; t++) s[t] *= inv;
    }
    if (part != NULL)
        weigh_heads(part + first_head * hd, scores, stride, key_rows, ctx, b, kv_begin, kv_end,
                    DTYPE_FP32, cache);
    else
        weigh_heads(out, scores, stride, key_rows, ctx, b, kv_begin, kv_end, io, cache);
}

/* attend_<io>_<kv>: attend compiled for one pair of dtypes (and each as VECTOR_CLONES). */
#define ATTEND_FOR(io, kv)                                                                         \
    VECTOR_CLONES static void attend_##io##_##kv(const DecodeBatch *b, int64_t i,                \
                                                 int64_t kv_begin, int64_t kv_end, int64_t chunk, \
                                                 float *part, float *scratch) {                   \
        attend(b, i, kv_begin, kv_end, chunk, part, scratch, DTYPE_##io, DTYPE_##kv);              \
    }
#define ATTEND_FOR_CACHES(io) ATTEND_FOR(io, FP32) ATTEND_FOR(io, BF16) ATTEND_FOR(io, FP16)
ATTEND_FOR_CACHES(FP32)
ATTEND_FOR_CACHES(BF16)
ATTEND_FOR_CACHES(FP16)

typedef void (*AttendFn)(const DecodeBatch *, int64_t, int64_t, int64_t, int64_t, float *,
                         float *);

/* [io_dtype][cache_dtype] */
static const AttendFn attend_fns[N_DTYPES][N_DTYPES] = {
    {attend_FP32_FP32, attend_FP32_BF16, attend_FP32_FP16},
    {attend_BF16_FP32, attend_BF16_BF16, attend_BF16_FP16},
    {attend_FP16_FP32, attend_FP16_BF16, attend_FP16_FP16},
};

/* Floats of scratch attend() needs for kv_per_item kv heads of a decode of ctx keys. */
static int64_t scratch_len(const DecodeBatch *b, int64_t kv_per_item, int64_t ctx) {
    const int64_t stride = (ctx + LANES - 1) / LANES * LANES;
    /* ctx int64s, which then hold as many pointers (no wider on any target) */
    const int64_t row_floats = ctx * (int64_t)(sizeof(int64_t) / sizeof(float));
    return kv_per_item * (b->n_heads / b->kv_heads) * stride +
           KEY_BLOCK * kv_per_item * b->head_dim + row_floats;
}

/* Decode i's new K and V (of io dtype) stored in its slot, rounded to the cache's dtype; the
 * dtypes are read at run time (a row of kv_heads * head_dim values a decode). */
static void store_new_kv(const DecodeBatch *b, int64_t i) {
    const int64_t slot = page_token(b, b->block_tables + i * b->max_pages, b->context_lens[i] - 1);
    const int64_t n_values = b->kv_heads * b->head_dim;
    convert((void *)at(b->k_cache, slot, b->cache_dtype), b->cache_dtype,
            at(b->new_k, b->rows[i] * b->new_k_row_stride, b->io_dtype), b->io_dtype, n_values);
    convert((void *)at(b->v_cache, slot, b->cache_dtype), b->cache_dtype,
            at(b->new_v, b->rows[i] * b->new_v_row_stride, b->io_dtype), b->io_dtype, n_values);
}

/* Decode i's query head h joined from its chunks parts (part_floats() apart) into out: each
 * part's weighted values scaled by exp(its max - the largest max) and summed in order over the
 * parts, then divided by the parts' sums scaled alike, and rounded to out's dtype once. Each
 * part's max is overwritten by its scale. */
static void join_parts(const DecodeBatch *b, int64_t i, int64_t h, float *parts, int64_t chunks) {
    const int64_t hd = b->head_dim, apart = part_floats(b);
    float *const maxes = parts + b->n_heads * hd + h, *const sums = maxes + b->n_heads;
    float max = -INFINITY, sum = 0.0f;
    for (int64_t c = 0; c < chunks; c++) max = maxes[c * apart] > max ? maxes[c * apart] : max;
    for (int64_t c = 0; c < chunks; c++) {
        maxes[c * apart] = expf(maxes[c * apart] - max);
        sum += maxes[c * apart] * sums[c * apart];
    }
    const float inv = 1.0f / sum;
    void *out = (void *)at(b->out, (b->rows[i] * b->n_heads + h) * hd, b->io_dtype);
    for (int64_t d0 = 0; d0 < hd; d0 += LANES) {
        vec8 acc = {0.0f};
        for (int64_t c = 0; c < chunks; c++)
            acc += load8(parts + c * apart + h * hd + d0) * (maxes[c * apart] * inv);
        store_as(out, d0, acc, b->io_dtype);
    }
}

/* The decode whose work items start at or before item: the last i with first_item[i] <= item. */
static int64_t decode_of(const int64_t *first_item, int64_t n, int64_t item) {
    int64_t low = 0, high = n - 1;
    while (low < high) {
        const int64_t mid = (low + high + 1) / 2;
        if (first_item[mid] <= item)
            low = mid;
        else
            high = mid - 1;
    }
    return low;
}

/* Room for floats of a call's parts, kept by the calling thread and grown as needed: at a
 * large batch of long decodes the parts take tens of MB, which fresh memory would fault in anew
 * at every layer's call. Never freed: a thread holds its largest call's parts while it lives
 * (the engine's scheduler thread, one buffer). NULL when it cannot be had. */
static float *parts_buffer(int64_t floats) {
    static __thread float *buffer = NULL;
    static __thread int64_t capacity = 0;
    if (floats > capacity) {
        free(buffer);
        buffer = malloc(sizeof(float) * floats);
        capacity = buffer != NULL ? floats : 0;
    }
    return buffer;
}

/* The decodes' new K/V stored first, all of them (rows of one sequence -- a speculative check
 * -- see each other's), then one work item per part of KEY_CHUNK keys of a decode when there
 * are enough to keep every thread busy, else one per (part, kv head); then the decodes cut
 * into several parts are joined. Returns 0, or -1 when scratch memory could not be had. */
static int attend_all(const DecodeBatch *b) {
    /* first_item[i]: decode i's first work item (first_item[n]: the count); part_at[i]: where
     * its parts start in parts, -1 for a decode of one part */
    int64_t *first_item = malloc(sizeof(int64_t) * (2 * b->n + 1));
    if (first_item == NULL) return -1;
    int64_t *part_at = first_item + b->n + 1;
    int64_t chunks_in_all = 0;
    for (int64_t i = 0; i < b->n; i++) chunks_in_all += key_chunks(b, i);
    const int64_t kv_per_item = chunks_in_all >= 4 * omp_get_max_threads() ? b->kv_heads : 1;
    const int64_t items_per_chunk = b->kv_heads / kv_per_item;
    int64_t items = 0, part_values = 0, longest = 0;
    for (int64_t i = 0; i < b->n; i++) {
        const int64_t chunks = key_chunks(b, i);
        int64_t first;
        const int64_t ctx = key_range(b, i, &first) - first;
        longest = ctx > longest ? ctx : longest;
        first_item[i] = items;
        items += chunks * items_per_chunk;
        part_at[i] = chunks > 1 ? part_values : -1;
        part_values += chunks > 1 ? chunks * part_floats(b) : 0;
    }
    first_item[b->n] = items;
    float *parts = part_values > 0 ? parts_buffer(part_values) : NULL;
    if (part_values > 0 && parts == NULL) {
        free(first_item);
        return -1;
    }
    const AttendFn attend_item = attend_fns[b->io_dtype][b->cache_dtype];
    int failed = 0;
#pragma omp parallel
    {
        if (b->new_k != NULL) {
#pragma omp for schedule(static)
            for (int64_t i = 0; i < b->n; i++) store_new_kv(b, i);
        }
        /* one scratch buffer per thread, for the longest part */
        float *scratch = malloc(
            sizeof(float) * scratch_len(b, kv_per_item, longest < KEY_CHUNK ? longest : KEY_CHUNK));
        if (scratch == NULL) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(dynamic)
        for (int64_t item = 0; item < items; item++) {
            if (scratch == NULL) continue;
            const int64_t i = decode_of(first_item, b->n, item), own = item - first_item[i];
            const int64_t chunk = own / items_per_chunk;
            const int64_t kv_begin = own % items_per_chunk * kv_per_item;
            float *part = part_at[i] < 0 ? NULL : parts + part_at[i] + chunk * part_floats(b);
            attend_item(b, i, kv_begin, kv_begin + kv_per_item, chunk, part, scratch);
        }
        if (parts != NULL && !failed) { /* failed is read after the loop's barrier: alike */
#pragma omp for schedule(static)
            for (int64_t ih = 0; ih < b->n * b->n_heads; ih++) {
                const int64_t i = ih / b->n_heads;
                if (part_at[i] >= 0)
                    join_parts(b, i, ih % b->n_heads, parts + part_at[i], key_chunks(b, i));
            }
        }
        free(scratch);
    }
    free(first_item);
    return failed ? -1 : 0;
}

/* The step's decodes and cache, read by decode() from memory at each call rather than passed
 * as its arguments, so that a call recorded once (astrai.kernels.graph) serves every later
 * step. The int64s at the step argument's address: */
enum {
    STEP_ROWS,         /* the addresses of rows, */
    STEP_BLOCK_TABLES, /* block_tables */
    STEP_CONTEXT_LENS, /* and context_lens, */
    STEP_N,
    STEP_MAX_PAGES,
    STEP_PAGE_SIZE,
    STEP_K_CACHE, /* the addresses of all layers' K and V caches, */
    STEP_V_CACHE,
    STEP_LAYER_STRIDE, /* values from one layer's cache to the next's, */
    STEP_CACHE_DTYPE,
    STEP_KEY_ENDS, /* the address of key_ends, 0 when every decode sees up to its own key */
};

static PyObject *decode(PyObject *module, PyObject *args) {
    (void)module;
    Py_ssize_t out, q, q_row_stride, new_k, new_k_row_stride, new_v, new_v_row_stride;
    Py_ssize_t layer, step_address, n_heads, kv_heads, head_dim, window;
    float scale, softcap;
    int io_dtype;
    if (!PyArg_ParseTuple(args, "nnnnnnnnnnnnfnfi", &out, &q, &q_row_stride, &new_k,
                          &new_k_row_stride, &new_v, &new_v_row_stride, &layer, &step_address,
                          &n_heads, &kv_heads, &head_dim, &scale, &window, &softcap, &io_dtype))
        return NULL;
    const int64_t *step = (const int64_t *)step_address;
    const int64_t cache_dtype = step[STEP_CACHE_DTYPE];
    if (io_dtype < 0 || io_dtype >= N_DTYPES || cache_dtype < 0 || cache_dtype >= N_DTYPES) {
        PyErr_SetString(PyExc_ValueError, "io_dtype and cache_dtype must be 0 (fp32), 1 (bf16) "
                                          "or 2 (fp16)");
        return NULL;
    }
    const DecodeBatch b = {
        .out = (void *)out,
        .q = (const void *)q,
        .new_k = (const void *)new_k,
        .new_v = (const void *)new_v,
        .k_cache = (void *)at((void *)step[STEP_K_CACHE], layer * step[STEP_LAYER_STRIDE],
                              (int)cache_dtype),
        .v_cache = (void *)at((void *)step[STEP_V_CACHE], layer * step[STEP_LAYER_STRIDE],
                              (int)cache_dtype),
        .rows = (const int64_t *)step[STEP_ROWS],
        .block_tables = (const int64_t *)step[STEP_BLOCK_TABLES],
        .context_lens = (const int64_t *)step[STEP_CONTEXT_LENS],
        .key_ends = (const int64_t *)step[STEP_KEY_ENDS],
        .n = step[STEP_N],
        .max_pages = step[STEP_MAX_PAGES],
        .page_size = step[STEP_PAGE_SIZE],
        .n_heads = n_heads,
        .kv_heads = kv_heads,
        .head_dim = head_dim,
        .q_row_stride = q_row_stride,
        .new_k_row_stride = new_k_row_stride,
        .new_v_row_stride = new_v_row_stride,
        .window = window,
        .scale = scale,
        .softcap = softcap,
        .io_dtype = io_dtype,
        .cache_dtype = (int)cache_dtype,
    };
    int status;
    Py_BEGIN_ALLOW_THREADS;
    status = attend_all(&b);
    Py_END_ALLOW_THREADS;
    if (status != 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS,
     "decode(out, q, q_row_stride, new_k, new_k_row_stride, new_v, new_v_row_stride, layer, "
     "step, n_heads, kv_heads, head_dim, scale, window, softcap, io_dtype): data pointers and "
     "sizes; step the address of eleven int64s, read at the call: the addresses of rows, "
     "block_tables and context_lens, n, max_pages, page_size, the addresses of the K and V "
     "caches, the values between layers in them, their dtype, and the address of key_ends (0: "
     "none); new_k and new_v 0 when already stored; window and softcap 0 when none; io_dtype "
     "(of q, out, new_k, new_v) and the cache's 0 for fp32, 1 for bf16, 2 for fp16."},
    {NULL, NULL, 0, NULL},
};

ASTRAI_MODULE(_paged_attention, methods)
