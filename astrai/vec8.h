/* Eight-float vectors for astrai's C kernels, in GCC/Clang vector extensions.
 *
 * The kernels are written once on vec8; VECTOR_CLONES compiles a function twice, for x86-64-v3
 * (AVX2 + FMA: one register per vec8) and for the baseline (two SSE registers), and the loader
 * picks the clone the CPU can run. Other compilers and targets get the portable code only.
 */
#ifndef ASTRAI_VEC8_H
#define ASTRAI_VEC8_H

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

#endif
