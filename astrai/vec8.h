/* Eight-float vectors for astrai's C kernels, in GCC/Clang vector extensions.
 *
 * The kernels are written once on vec8; VECTOR_CLONES compiles a function twice, for x86-64-v3
 * (AVX2 + FMA: one register per vec8) and for the baseline (two SSE registers), and the loader
 * picks the clone the CPU can run. Other compilers and targets get the portable code only.
 */
#ifndef ASTRAI_VEC8_H
#define ASTRAI_VEC8_H

#include <stdint.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define VECTOR_CLONES
#endif

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

typedef int32_t int8v __attribute__((vector_size(LANES * sizeof(int32_t))));

/* exp(x) for x <= 0, to about 1 ulp: 2^n * exp(r) with n = round(x / ln 2), |r| <= ln(2) / 2,
 * exp(r) by its Taylor series to r^7. Below -87.3 it returns exp(-87.3) ~ 1e-38, not 0: its
 * users (softmax, silu) add it to a term of 1 or more, so the difference is far below rounding. */
static inline __attribute__((always_inline)) vec8 exp_nonpositive(vec8 x) {
    const vec8 lowest = (vec8){0.0f} - 87.3f;
    const int8v clamp = x < lowest;
    x = (vec8)(((int8v)x & ~clamp) | ((int8v)lowest & clamp));
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
