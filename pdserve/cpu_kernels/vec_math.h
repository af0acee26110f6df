/* Vector helpers shared by pdserve's C kernels (included by source; pdserve/attention/cpu_build.py
 * hashes included files into the build cache key). GCC/Clang vector extensions: VW floats per
 * vector, following the target ISA (16 with AVX-512, 8 with AVX, else 4). */
#ifndef PDSERVE_VEC_MATH_H
#define PDSERVE_VEC_MATH_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint32_t vu32 __attribute__((vector_size(VW * 4)));

/* mask ? a : b, lane by lane (mask lanes all ones or all zeros) */
ALWAYS_INLINE vf vselect(vu32 mask, vf a, vf b) {
    vu32 ab, bb;
    memcpy(&ab, &a, sizeof ab);
    memcpy(&bb, &b, sizeof bb);
    ab = (mask & ab) | (~mask & bb);
    memcpy(&a, &ab, sizeof a);
    return a;
}

/* exp(x) lane by lane for x in [-87, 88], relative error ~2e-7: x = n ln2 + r with
 * n = round(x / ln2), |r| <= ln2 / 2; exp(r) by its Taylor series to degree 7 (truncation error
 * below 6e-9); 2^n put into the exponent bits (n in [-126, 127]: a normal float, exp(88) ~ 1.7e38
 * still finite). n is rounded by adding 1.5 * 2^23, which leaves n in the low mantissa bits. */
ALWAYS_INLINE vf exp_range_v(vf x) {
    const vf shifter = (vf){0} + 12582912.0f;
    const vf t = x * 1.44269504088896341f + shifter;
    const vf n = t - shifter;
    vf r = x - n * 0.693145751953125f; /* ln2 split in a short high part (n * it is exact) */
    r = r - n * 1.42860682030941723e-6f; /* ... and the rest */
    vf p = (vf){0} + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    vu32 bits, sb;
    memcpy(&sb, &shifter, sizeof sb);
    memcpy(&bits, &t, sizeof bits);
    bits = (bits - sb + 127u) << 23; /* 2^n */
    vf two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* exp(x) lane by lane for x <= 0 (softmax arguments minus their max): exp_range_v with x below
 * -87 clamped there (exp ~ 1.6e-38: no denormals, and exp(-inf) * 0 stays 0). */
ALWAYS_INLINE vf exp_nonpos_v(vf x) {
    const vf lo = (vf){0} - 87.0f;
    return exp_range_v(vselect((vu32)(x < lo), lo, x));
}

/* exp(x) lane by lane for any x: exp_range_v with x clamped to [-87, 88] (so exp of a large x is
 * ~1.7e38 rather than inf) */
ALWAYS_INLINE vf exp_clamped_v(vf x) {
    const vf lo = (vf){0} - 87.0f, hi = (vf){0} + 88.0f;
    x = vselect((vu32)(x < lo), lo, x);
    return exp_range_v(vselect((vu32)(x > hi), hi, x));
}

#endif
