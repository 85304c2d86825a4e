/* Vector helpers shared by the C files (compiled with -march=native): GCC vector
   extensions of the machine's width, VF floats: 16 (one AVX-512 register) or 8 (one AVX2
   register, or a pair of SSE/NEON registers). A wider vector than the registers compiles
   into halves that go through the stack: on AVX2, GELU over 16-float vectors ran ~4x
   slower than over 8. */
#ifndef FRAWD_SIMD_H
#define FRAWD_SIMD_H
#include <stdint.h>

#if defined(__AVX512F__)
#define VF 16
#else
#define VF 8
#endif
typedef float vf __attribute__((vector_size(VF * 4), aligned(4))); /* VF floats, any alignment */
typedef int32_t vfi __attribute__((vector_size(VF * 4), aligned(4)));

/* a in every lane: a broadcast (no add, so -0.0 stays -0.0) */
static inline vf splat(float a) { return __builtin_shuffle((vf){a}, (vfi){}); }

/* a[0] + ... + a[VF - 1] as a tree of vector adds. */
static inline float hsum(vf a) {
#if VF == 16
    a += __builtin_shuffle(a, (vfi){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    a += __builtin_shuffle(a, (vfi){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    a += __builtin_shuffle(a, (vfi){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    a += __builtin_shuffle(a, (vfi){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
#else
    a += __builtin_shuffle(a, (vfi){4, 5, 6, 7, 0, 1, 2, 3});
    a += __builtin_shuffle(a, (vfi){2, 3, 0, 1, 2, 3, 0, 1});
    a += __builtin_shuffle(a, (vfi){1, 0, 1, 0, 1, 0, 1, 0});
#endif
    return a[0];
}

/* e^r for |r| <= ln2 / 2 to about 1 ulp: the Cephes expf polynomial. */
static inline vf exp_reduced(vf r) {
    vf p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    return p * r * r + r + splat(1.0f);
}

/* x = n ln2 + r with n an integer (as a float) and |r| <= ln2 / 2; ln2 in two parts, so r is exact. */
static inline vf reduce_ln2(vf x, vf n) { return x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f); }

/* e^x to about 1 ulp (Cephes expf): x = n ln2 + r, e^x = 2^n e^r, e^r by a polynomial. */
static inline vf v_exp(vf x) {
    const vf hi = splat(88.3762626647949f), lo = splat(-87.3365447505531f);
    x = (vf)((vfi)(x > hi) & (vfi)hi) + (vf)(~(vfi)(x > hi) & (vfi)x);
    x = (vf)((vfi)(x < lo) & (vfi)lo) + (vf)(~(vfi)(x < lo) & (vfi)x);
    const vf magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    vf n = (x * splat(1.44269504088896341f) + magic) - magic;
    vf p = exp_reduced(reduce_ln2(x, n));
    vfi bits = (__builtin_convertvector(n, vfi) + 127) << 23;
    return p * (vf)bits;
}

#endif
