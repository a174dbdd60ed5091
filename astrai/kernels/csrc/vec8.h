/* Eight-float vectors for astrai's C kernels, in GCC/Clang vector extensions.
 *
 * The kernels are written once on vec8; VECTOR_CLONES compiles a function twice, for x86-64-v3
 * (AVX2 + FMA: one register per vec8) and for the baseline (two SSE registers), and the loader
 * picks the clone the CPU can run. Other compilers and targets get the portable code only.
 * bf16 values are widened to fp32 on load and rounded back on store, as PyTorch's bf16 ops do.
 */
#ifndef ASTRAI_VEC8_H
#define ASTRAI_VEC8_H

#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

/* name_fp32 and name_bf16: the always-inlined name, whose last parameter is is_bf16, compiled
 * once for each dtype (and each as VECTOR_CLONES). params is their parameter list in
 * parentheses, the rest the arguments they pass on before is_bf16. */
#define FP32_AND_BF16(name, params, ...)                                                      \
    VECTOR_CLONES static void name##_fp32 params { name(__VA_ARGS__, 0); }                    \
    VECTOR_CLONES static void name##_bf16 params { name(__VA_ARGS__, 1); }

#define LANES 8

typedef float vec8 __attribute__((vector_size(LANES * sizeof(float))));

static inline __attribute__((always_inline)) vec8 load8(const float *p) {
    vec8 v;
    __builtin_memcpy(&v, p, sizeof v); /* unaligned load */
    return v;
}

static inline __attribute__((always_inline)) void store8(float *p, vec8 v) {
    __builtin_memcpy(p, &v, sizeof v); /* unaligned store */
}

/* The lanes summed in a fixed order, so a result never depends on the caller's batch. */
static inline __attribute__((always_inline)) float sum8(vec8 v) {
    float sum = 0.0f;
    for (int l = 0; l < LANES; l++) sum += v[l];
    return sum;
}

/* The lane sums of eight vectors as one vector: out[j] = v[j]'s lanes summed pairwise,
 * ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)), by shuffles rather than one lane at a time.
 * Compilers without __builtin_shufflevector add the lanes in the same order one by one. */
static inline __attribute__((always_inline)) vec8 sum8x8(const vec8 v[LANES]) {
#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define SHUFFLE __builtin_shufflevector
    vec8 pairs[4], quads[2];
    for (int k = 0; k < 4; k++)
        pairs[k] = SHUFFLE(v[2 * k], v[2 * k + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
                   SHUFFLE(v[2 * k], v[2 * k + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int k = 0; k < 2; k++)
        quads[k] = SHUFFLE(pairs[2 * k], pairs[2 * k + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
                   SHUFFLE(pairs[2 * k], pairs[2 * k + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE(quads[0], quads[1], 0, 1, 2, 3, 8, 9, 10, 11) +
           SHUFFLE(quads[0], quads[1], 4, 5, 6, 7, 12, 13, 14, 15);
#undef SHUFFLE
#else
    vec8 out;
    for (int j = 0; j < LANES; j++)
        out[j] = ((v[j][0] + v[j][1]) + (v[j][2] + v[j][3])) +
                 ((v[j][4] + v[j][5]) + (v[j][6] + v[j][7]));
    return out;
#endif
}

typedef int32_t int8v __attribute__((vector_size(LANES * sizeof(int32_t))));

/* a where mask is set, else b, lane by lane; mask is a comparison's result */
static inline __attribute__((always_inline)) vec8 select8(int8v mask, vec8 a, vec8 b) {
    return (vec8)(((int8v)a & mask) | ((int8v)b & ~mask));
}

/* bf16: the high half of an fp32, stored as 16 bits. */
typedef uint16_t bf16;
typedef uint16_t bf16x8 __attribute__((vector_size(LANES * sizeof(bf16))));
typedef uint32_t uint8v __attribute__((vector_size(LANES * sizeof(uint32_t))));

static inline __attribute__((always_inline)) float bf16_to_float(bf16 h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

/* f rounded to the nearest bf16, ties to even, NaN kept NaN: as PyTorch rounds. */
static inline __attribute__((always_inline)) bf16 float_to_bf16(float f) {
    uint32_t bits;
    __builtin_memcpy(&bits, &f, sizeof bits);
    return f != f ? 0x7fc0 : (bf16)((bits + 0x7fff + (bits >> 16 & 1)) >> 16);
}

static inline __attribute__((always_inline)) vec8 load8_bf16(const bf16 *p) {
    bf16x8 h;
    __builtin_memcpy(&h, p, sizeof h);
    return (vec8)(__builtin_convertvector(h, uint8v) << 16);
}

/* Each lane rounded to bf16 as float_to_bf16 does, and kept as an fp32. */
static inline __attribute__((always_inline)) vec8 round8_bf16(vec8 v) {
    const uint8v bits = (uint8v)v;
    const vec8 rounded = (vec8)((bits + 0x7fff + (bits >> 16 & 1)) & 0xffff0000u);
    return select8(v != v, v, rounded);
}

static inline __attribute__((always_inline)) void store8_bf16(bf16 *p, vec8 v) {
    const bf16x8 h = __builtin_convertvector((uint8v)round8_bf16(v) >> 16, bf16x8);
    __builtin_memcpy(p, &h, sizeof h);
}

/* Eight values of an fp32 or bf16 array (is_bf16 a constant after inlining) as fp32, and back:
 * for kernels written once for both. */
static inline __attribute__((always_inline)) vec8 load_any(const void *p, int64_t i,
                                                            const int is_bf16) {
    return is_bf16 ? load8_bf16((const bf16 *)p + i) : load8((const float *)p + i);
}

static inline __attribute__((always_inline)) void store_any(void *p, int64_t i, vec8 v,
                                                             const int is_bf16) {
    if (is_bf16)
        store8_bf16((bf16 *)p + i, v);
    else
        store8((float *)p + i, v);
}

/* fp16 as _Float16 (GCC >= 12, Clang >= 15). Widening is done on the bits, in vector integer
 * ops, exactly: GCC 12 widens a _Float16 vector lane by lane (or by libgcc calls without F16C),
 * which made a decode over an fp16 cache slower than over fp32. Narrowing, which a kernel does
 * only to store, is the compiler's: to nearest even, as PyTorch rounds. */
typedef _Float16 f16x8 __attribute__((vector_size(LANES * sizeof(_Float16))));
typedef uint16_t u16x8 __attribute__((vector_size(LANES * sizeof(uint16_t))));

static inline __attribute__((always_inline)) vec8 load8_f16(const _Float16 *p) {
    u16x8 h;
    __builtin_memcpy(&h, p, sizeof h);
    const uint8v bits = __builtin_convertvector(h, uint8v);
    const uint8v sign = (bits & 0x8000u) << 16;
    /* exponent and mantissa moved into an fp32's places, then the exponent rebased 15 -> 127 */
    const uint8v shifted = (bits & 0x7fffu) << 13;
    const vec8 normal = (vec8)(shifted + ((127u - 15u) << 23));
    const vec8 infinite_or_nan = (vec8)(shifted | 0x7f800000u);
    const vec8 subnormal = __builtin_convertvector((int8v)(bits & 0x3ffu), vec8) * 0x1p-24f;
    const int8v exponent = (int8v)(bits & 0x7c00u);
    const vec8 magnitude =
        select8(exponent == 0, subnormal, select8(exponent == 0x7c00, infinite_or_nan, normal));
    return (vec8)((uint8v)magnitude | sign);
}

static inline __attribute__((always_inline)) void store8_f16(_Float16 *p, vec8 v) {
    const f16x8 h = __builtin_convertvector(v, f16x8);
    __builtin_memcpy(p, &h, sizeof h);
}

/* The element types a kernel may read as a run-time code (a constant after inlining), for
 * kernels whose tensors need not share one type. */
enum { DTYPE_FP32, DTYPE_BF16, DTYPE_FP16, N_DTYPES };

static inline __attribute__((always_inline)) int64_t dtype_size(const int dtype) {
    return dtype == DTYPE_FP32 ? (int64_t)sizeof(float) : (int64_t)sizeof(bf16);
}

static inline __attribute__((always_inline)) vec8 load_as(const void *p, int64_t i,
                                                           const int dtype) {
    if (dtype == DTYPE_FP16) return load8_f16((const _Float16 *)p + i);
    return load_any(p, i, dtype == DTYPE_BF16);
}

static inline __attribute__((always_inline)) void store_as(void *p, int64_t i, vec8 v,
                                                            const int dtype) {
    if (dtype == DTYPE_FP16)
        store8_f16((_Float16 *)p + i, v);
    else
        store_any(p, i, v, dtype == DTYPE_BF16);
}

/* exp(x) for x <= 0, to about 1 ulp: 2^n * exp(r) with n = round(x / ln 2), |r| <= ln(2) / 2,
 * exp(r) by its Taylor series to r^7. Below -87.3 it returns exp(-87.3) ~ 1e-38, not 0: its
 * users (softmax, silu) add it to a term of 1 or more, so the difference is far below rounding. */
static inline __attribute__((always_inline)) vec8 exp_nonpositive(vec8 x) {
    const vec8 lowest = (vec8){0.0f} - 87.3f;
    x = select8(x < lowest, lowest, x);
    const int8v n = __builtin_convertvector(x * 1.44269504f - 0.5f, int8v); /* trunc: x <= 0 */
    const vec8 nf = __builtin_convertvector(n, vec8);
    const vec8 r = x - nf * 0.693359375f - nf * -2.12194440e-4f; /* ln 2 in two parts */
    vec8 p = r * (1.0f / 5040) + 1.0f / 720;
    p = p * r + 1.0f / 120;
    p = p * r + 1.0f / 24;
    p = p * r + 1.0f / 6;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    return p * (vec8)((n + 127) << 23);
}

#endif
