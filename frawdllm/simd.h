/* Vector helpers shared by the C files (compiled with -march=native): GCC vector
   extensions of 16 floats, which the compiler emits as AVX-512, AVX2 or SSE. */
#ifndef FRAWD_SIMD_H
#define FRAWD_SIMD_H
#include <stdint.h>

typedef float v16 __attribute__((vector_size(64), aligned(4))); /* 16 floats, any alignment */
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));

static inline v16 splat(float a) { return (v16){} + a; }

/* a[0] + ... + a[15] as a tree of 4 vector adds. */
static inline float hsum(v16 a) {
    a += __builtin_shuffle(a, (vi16){8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
    a += __builtin_shuffle(a, (vi16){4, 5, 6, 7, 0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3});
    a += __builtin_shuffle(a, (vi16){2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1});
    a += __builtin_shuffle(a, (vi16){1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0});
    return a[0];
}

/* e^r for |r| <= ln2 / 2 to about 1 ulp: the Cephes expf polynomial. */
static inline v16 exp_reduced(v16 r) {
    v16 p = splat(1.9875691500e-4f);
    p = p * r + splat(1.3981999507e-3f);
    p = p * r + splat(8.3334519073e-3f);
    p = p * r + splat(4.1665795894e-2f);
    p = p * r + splat(1.6666665459e-1f);
    p = p * r + splat(5.0000001201e-1f);
    return p * r * r + r + splat(1.0f);
}

/* x = n ln2 + r with n an integer (as a float) and |r| <= ln2 / 2; ln2 in two parts, so r is exact. */
static inline v16 reduce_ln2(v16 x, v16 n) { return x - n * splat(0.693359375f) - n * splat(-2.12194440e-4f); }

/* e^x to about 1 ulp (Cephes expf): x = n ln2 + r, e^x = 2^n e^r, e^r by a polynomial. */
static inline v16 v_exp(v16 x) {
    const v16 hi = splat(88.3762626647949f), lo = splat(-87.3365447505531f);
    x = (v16)((vi16)(x > hi) & (vi16)hi) + (v16)(~(vi16)(x > hi) & (vi16)x);
    x = (v16)((vi16)(x < lo) & (vi16)lo) + (v16)(~(vi16)(x < lo) & (vi16)x);
    const v16 magic = splat(12582912.0f); /* 1.5 * 2^23: adding it rounds to an integer */
    v16 n = (x * splat(1.44269504088896341f) + magic) - magic;
    v16 p = exp_reduced(reduce_ln2(x, n));
    vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;
    return p * (v16)bits;
}

#endif
