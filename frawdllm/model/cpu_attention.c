/* Causal self-attention for training on CPU, in bf16 (AVX512-BF16) and in fp32 (any CPU; at
   the end of the file): forward and backward, fused per head.

Why C: for the short sequences small models train on (T of a few hundred), PyTorch's causal
attention is a handful of small batched matmuls (head_dim 32-64: too little work per
call to run near peak) with the T x T scores written to memory and read back by each
softmax pass, forward and backward. Here one thread takes one (batch, head) at a time
and keeps everything of that head in its cache: scores, probabilities and their
gradients never leave L2, and every product uses the CPU's bf16 dot-product instruction
(AVX512-BF16: 32 bf16 products summed pairwise into 16 fp32 lanes per instruction).

Forward, per head, 8 query rows at a time (fp32 until the bf16 stores):
    S = Q K^T                               only key columns up to the block's last row
    E = exp(S / sqrt(hd) - max), causal     lse = logsumexp per row, kept for backward
    O = (E V) / sum(E)                      E rounded to bf16 for the product

Backward (flash-attention style: P is recomputed from lse, not stored), 8 key rows at a time:
    S^T = K Q^T, P^T = exp(S^T / sqrt(hd) - lse)    query columns i >= j only
    dP^T = V dO^T,  dS^T = P^T * (dP^T - D),  D_i = dO_i . O_i
    dV = P^T dO,  dK = dS^T Q / sqrt(hd)           rows of this key block
then dQ = dS K / sqrt(hd), 8 query rows at a time, reading the dS^T kept for the head.

Products: C (8 rows x 32 columns, 16 zmm accumulators) += A B, where A's rows give pairs
of consecutive k (a 32-bit broadcast) and B is packed "VNNI" style, [k/2][n][2], so one
load gives 16 columns x 2 k. Each head's operands are packed into that layout once.
The bf16 version requires a CPU with AVX512-BF16 (`frawd_attention_available`); the fp32
one (the end of the file) runs on any CPU; elsewhere PyTorch's attention runs instead.
*/
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../simd.h"

typedef uint16_t bf16;

/* A (B, H, T, hd) tensor: strides in elements, the last dimension contiguous. */
typedef struct {
    bf16 *p;
    int64_t sb, sh, st;
} View;

/* The next `bytes` of a thread's workspace, 64-byte aligned. */
static void *carve(char **cursor, int64_t bytes) {
    void *p = *cursor;
    *cursor += (bytes + 63) / 64 * 64;
    return p;
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

#define R 8  /* rows per tile */
#define C 32 /* columns per tile */

int frawd_attention_available(void) { return 1; }

static inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

static inline bf16 *at(View v, int64_t b, int64_t h, int64_t t) { return v.p + b * v.sb + h * v.sh + t * v.st; }

/* out[r][c] = sum over pairs p in [p0, p1) of a[r][p*as] * B[p][n0+c][0] + a[r][p*as+1] * B[p][n0+c][1].
   a[r] points at row r's first pair; as = elements from one pair to the next (2: a plain row). */
static inline void tile(const bf16 *const a[R], int64_t as, const bf16 *B, int64_t ldb, int64_t n0,
                        int64_t p0, int64_t p1, float out[R][C]) {
    __m512 c0[R], c1[R];
    for (int r = 0; r < R; r++) c0[r] = c1[r] = _mm512_setzero_ps();
    const bf16 *bp = B + p0 * ldb + 2 * n0;
    for (int64_t p = p0; p < p1; p++, bp += ldb) {
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(bp), b1 = (__m512bh)_mm512_loadu_si512(bp + 32);
#pragma GCC unroll 8
        for (int r = 0; r < R; r++) {
            int32_t pair;
            memcpy(&pair, a[r] + p * as, 4);
            __m512bh x = (__m512bh)_mm512_set1_epi32(pair);
            c0[r] = _mm512_dpbf16_ps(c0[r], x, b0);
            c1[r] = _mm512_dpbf16_ps(c1[r], x, b1);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm512_storeu_ps(out[r], c0[r]);
        _mm512_storeu_ps(out[r] + 16, c1[r]);
    }
}

static inline __m256i to_bf16(vf x) { return (__m256i)_mm512_cvtneps_pbh((__m512)x); }

/* 16 + 16 floats -> 32 bf16 interleaved: a0 b0 a1 b1 ... (two rows of a VNNI pair). */
static inline __m512i interleave_bf16(vf a, vf b) {
    const __m512i idx = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                         22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(idx, (__m512i)_mm512_cvtne2ps_pbh((__m512)b, (__m512)a));
}

/* dst[p][j][0..1] = src row j, pair p ([hd/2][Tp][2]: the layout of X^T as B); zero rows j >= T. */
static void pack_transposed(View src, int64_t b, int64_t h, int64_t T, int64_t Tp, int64_t hd, bf16 *dst) {
    int32_t *d32 = (int32_t *)dst;
    for (int64_t j = 0; j < Tp; j++) {
        const bf16 *row = j < T ? at(src, b, h, j) : NULL;
        for (int64_t p = 0; p < hd / 2; p++) {
            int32_t pair = 0;
            if (row) memcpy(&pair, row + 2 * p, 4);
            d32[p * Tp + j] = pair;
        }
    }
}

/* dst[q][d][0..1] = (src[2q][d], src[2q+1][d]) ([Tp/2][hd][2]: the layout of X as B); zero rows >= T. */
static void pack_pairs(View src, int64_t b, int64_t h, int64_t T, int64_t Tp, int64_t hd, bf16 *dst) {
    const __m512i lo = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                        6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
    const __m512i hi = _mm512_add_epi16(lo, _mm512_set1_epi16(16));
    for (int64_t q = 0; q < Tp / 2; q++) {
        for (int64_t d = 0; d < hd; d += 32) {
            __m512i x = 2 * q < T ? _mm512_loadu_si512(at(src, b, h, 2 * q) + d) : _mm512_setzero_si512();
            __m512i y = 2 * q + 1 < T ? _mm512_loadu_si512(at(src, b, h, 2 * q + 1) + d) : _mm512_setzero_si512();
            _mm512_storeu_si512(dst + (q * hd + d) * 2, _mm512_permutex2var_epi16(x, lo, y));
            _mm512_storeu_si512(dst + (q * hd + d) * 2 + 32, _mm512_permutex2var_epi16(x, hi, y));
        }
    }
}

static inline vf iota(void) { return (vf){0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }

/* Lanes j0 + l <= last of a 16-lane vector starting at column j0. */
static inline __mmask16 upto(int64_t j0, int64_t last) {
    const int64_t n = last - j0 + 1;
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

/* e^x for finite x (no clamping needed: vscalefps takes 2^n to 0 or inf by itself). */
static inline vf exp_fast(vf x) {
    const __m512 n = _mm512_roundscale_ps((__m512)(x * splat(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return (vf)_mm512_scalef_ps((__m512)exp_reduced(reduce_ln2(x, (vf)n)), n);
}

/* Bytes per thread, enough for either pass (see the carving at the top of each). */
static int64_t workspace_bytes(int64_t Tp, int64_t hd) {
    return round_up(2 * (5 * Tp * hd + Tp * Tp + 2 * R * Tp + hd) + 4 * (3 * R * C + 2 * Tp + R * Tp) + 16 * 64, 64);
}

/* This thread's workspace, or NULL with *failed set. Callers pass a barrier before using
   *failed: every thread must skip (or enter) the work-sharing loop alike. */
static char *thread_workspace(int64_t Tp, int64_t hd, int *failed) {
    char *ws = aligned_alloc(64, (size_t)workspace_bytes(Tp, hd));
    if (!ws) {
#pragma omp atomic write
        *failed = 1;
    }
    return ws;
}

/* Rows t0 + r < T of a tile, times scale (and row_scale[r] unless NULL), into dst[b, h, t0 + r, d0:d0+32] as bf16. */
static inline void store_tile(View dst, int64_t b, int64_t h, int64_t t0, int64_t T, int64_t d0, float x[R][C],
                              float scale, const float *row_scale) {
    for (int r = 0; r < R && t0 + r < T; r++) {
        const float m = row_scale ? scale * row_scale[r] : scale;
        bf16 *o = at(dst, b, h, t0 + r) + d0;
        _mm256_storeu_si256((__m256i *)o, to_bf16(*(vf *)x[r] * m));
        _mm256_storeu_si256((__m256i *)(o + 16), to_bf16(*(vf *)(x[r] + 16) * m));
    }
}

/* out = softmax(q k^T / sqrt(hd), causal) v, lse (B, H, T) fp32. Returns 0, or 1 when out of memory. */
int frawd_attention_forward(View q, View k, View v, View out, float *lse, int64_t B, int64_t H, int64_t T,
                            int64_t hd, int64_t threads) {
    const int64_t Tp = round_up(T, C);
    const float scale = 1.0f / sqrtf((float)hd);
    int failed = 0;
#pragma omp parallel num_threads((int)threads)
    {
        char *ws = thread_workspace(Tp, hd, &failed), *cur = ws;
#pragma omp barrier
        if (!failed) {
            bf16 *kp = carve(&cur, 2 * Tp * hd), *vp = carve(&cur, 2 * Tp * hd), *prow = carve(&cur, 2 * R * Tp);
            bf16 *zero = carve(&cur, 2 * hd); /* the row read for rows past T */
            float(*s)[C] = carve(&cur, 4 * R * C);
            float *srow = carve(&cur, 4 * R * Tp);
            memset(zero, 0, 2 * hd);
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * H; bh++) {
                const int64_t b = bh / H, h = bh % H;
                pack_transposed(k, b, h, T, Tp, hd, kp);
                pack_pairs(v, b, h, T, Tp, hd, vp);
                for (int64_t i0 = 0; i0 < T; i0 += R) {
                    const int64_t ncols = round_up(i0 + R, C) < Tp ? round_up(i0 + R, C) : Tp;
                    const bf16 *a[R];
                    for (int r = 0; r < R; r++) a[r] = i0 + r < T ? at(q, b, h, i0 + r) : zero;
                    __m512 top[R]; /* each row's largest score so far */
                    for (int r = 0; r < R; r++) top[r] = _mm512_set1_ps(-INFINITY);
                    for (int64_t n0 = 0; n0 < ncols; n0 += C) {  /* scores */
                        tile(a, 2, kp, 2 * Tp, n0, 0, hd / 2, s);
                        for (int r = 0; r < R; r++) {
                            const int64_t last = i0 + r < T ? i0 + r : T - 1; /* the last key this row sees */
                            for (int half = 0; half < 2; half++)
                                top[r] = _mm512_mask_max_ps(top[r], upto(n0 + 16 * half, last), top[r],
                                                            _mm512_loadu_ps(s[r] + 16 * half));
                            memcpy(srow + r * Tp + n0, s[r], sizeof s[r]);
                        }
                    }
                    float inv[R];
                    for (int r = 0; r < R; r++) {  /* causal softmax of each row, normalised after P V */
                        const int64_t i = i0 + r, last = i < T ? i : T - 1;
                        const float best = _mm512_reduce_max_ps(top[r]) * scale;
                        float *x = srow + r * Tp;
                        bf16 *p = prow + r * Tp;
                        vf acc = {};
                        for (int64_t j = 0; j < ncols; j += 16) {
                            vf e = (vf)_mm512_maskz_mov_ps(upto(j, last), (__m512)exp_fast(*(vf *)(x + j) * scale - best));
                            acc += e;
                            _mm256_storeu_si256((__m256i *)(p + j), to_bf16(e));
                        }
                        const float sum = hsum(acc);
                        inv[r] = 1.0f / sum;
                        if (i < T) lse[(b * H + h) * T + i] = best + logf(sum);
                    }
                    const bf16 *pa[R];
                    for (int r = 0; r < R; r++) pa[r] = prow + r * Tp;
                    for (int64_t d0 = 0; d0 < hd; d0 += C) {  /* O = P V */
                        tile(pa, 2, vp, 2 * hd, d0, 0, ncols / 2, s);
                        store_tile(out, b, h, i0, T, d0, s, 1.0f, inv);
                    }
                }
            }
        }
        free(ws);
    }
    return failed;
}

/* Gradients dq, dk, dv of the forward above, given dout, its inputs, out and lse. */
int frawd_attention_backward(View dout, View q, View k, View v, View out, const float *lse, View dq, View dk,
                             View dv, int64_t B, int64_t H, int64_t T, int64_t hd, int64_t threads) {
    const int64_t Tp = round_up(T, C);
    const float scale = 1.0f / sqrtf((float)hd);
    int failed = 0;
#pragma omp parallel num_threads((int)threads)
    {
        char *ws = thread_workspace(Tp, hd, &failed), *cur = ws;
#pragma omp barrier
        if (!failed) {
            bf16 *qt = carve(&cur, 2 * Tp * hd), *dot = carve(&cur, 2 * Tp * hd);  /* Q^T, dO^T as B */
            bf16 *dop = carve(&cur, 2 * Tp * hd), *qp = carve(&cur, 2 * Tp * hd), *kp = carve(&cur, 2 * Tp * hd);
            bf16 *dsv = carve(&cur, 2 * Tp * Tp);  /* dS^T in pairs of key rows: [Tp/2][Tp][2] */
            bf16 *pt = carve(&cur, 2 * R * Tp), *dst = carve(&cur, 2 * R * Tp);
            float(*s)[C] = carve(&cur, 4 * R * C), (*dp)[C] = carve(&cur, 4 * R * C), (*g)[C] = carve(&cur, 4 * R * C);
            float *lse_p = carve(&cur, 4 * Tp), *dvec = carve(&cur, 4 * Tp);
            bf16 *zero = carve(&cur, 2 * hd); /* the row read for rows past T */
            memset(zero, 0, 2 * hd);
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * H; bh++) {
                const int64_t b = bh / H, h = bh % H;
                pack_transposed(q, b, h, T, Tp, hd, qt);
                pack_transposed(dout, b, h, T, Tp, hd, dot);
                pack_pairs(dout, b, h, T, Tp, hd, dop);
                pack_pairs(q, b, h, T, Tp, hd, qp);
                pack_pairs(k, b, h, T, Tp, hd, kp);
                for (int64_t i = 0; i < Tp; i++) {
                    lse_p[i] = i < T ? lse[(b * H + h) * T + i] : 0.0f;
                    float d = 0.0f;
                    if (i < T) {
                        const bf16 *x = at(dout, b, h, i), *y = at(out, b, h, i);
                        for (int64_t c = 0; c < hd; c++) {
                            uint32_t xb = (uint32_t)x[c] << 16, yb = (uint32_t)y[c] << 16;
                            float xf, yf;
                            memcpy(&xf, &xb, 4);
                            memcpy(&yf, &yb, 4);
                            d += xf * yf;
                        }
                    }
                    dvec[i] = d;
                }
                for (int64_t j0 = 0; j0 < Tp; j0 += R) {
                    if (j0 >= T) break;
                    const int64_t c0 = j0 / C * C;  /* first query column of the block's tiles */
                    const bf16 *ka[R], *va[R], *pa[R], *da[R];
                    for (int r = 0; r < R; r++) {
                        ka[r] = j0 + r < T ? at(k, b, h, j0 + r) : zero;
                        va[r] = j0 + r < T ? at(v, b, h, j0 + r) : zero;
                        pa[r] = pt + r * Tp;
                        da[r] = dst + r * Tp;
                    }
                    for (int64_t n0 = c0; n0 < Tp; n0 += C) {
                        tile(ka, 2, qt, 2 * Tp, n0, 0, hd / 2, s);   /* S^T = K Q^T */
                        tile(va, 2, dot, 2 * Tp, n0, 0, hd / 2, dp); /* dP^T = V dO^T */
                        for (int r = 0; r < R; r += 2) {
                            vf ds[2][2];
                            for (int rr = 0; rr < 2; rr++) {
                                const int64_t j = j0 + r + rr;
                                for (int half = 0; half < 2; half++) {
                                    const int64_t i0 = n0 + 16 * half;
                                    vf iv = iota() + splat((float)i0);
                                    vfi ok = (iv >= splat((float)j)) & (iv < splat((float)T)) & ((vfi){} - (j < T));
                                    vf x = *(vf *)(s[r + rr] + 16 * half) * scale - *(vf *)(lse_p + i0);
                                    vf p = (vf)(ok & (vfi)exp_fast(x));
                                    vf d = p * (*(vf *)(dp[r + rr] + 16 * half) - *(vf *)(dvec + i0));
                                    _mm256_storeu_si256((__m256i *)(pt + (r + rr) * Tp + i0), to_bf16(p));
                                    _mm256_storeu_si256((__m256i *)(dst + (r + rr) * Tp + i0), to_bf16(d));
                                    ds[rr][half] = d;
                                }
                            }
                            bf16 *pair_row = dsv + ((j0 + r) / 2) * 2 * Tp + 2 * n0;
                            _mm512_storeu_si512(pair_row, interleave_bf16(ds[0][0], ds[1][0]));
                            _mm512_storeu_si512(pair_row + 32, interleave_bf16(ds[0][1], ds[1][1]));
                        }
                    }
                    for (int64_t d0 = 0; d0 < hd; d0 += C) {
                        tile(pa, 2, dop, 2 * hd, d0, c0 / 2, Tp / 2, g); /* dV = P^T dO */
                        store_tile(dv, b, h, j0, T, d0, g, 1.0f, NULL);
                        tile(da, 2, qp, 2 * hd, d0, c0 / 2, Tp / 2, g); /* dK = dS^T Q */
                        store_tile(dk, b, h, j0, T, d0, g, scale, NULL);
                    }
                }
                for (int64_t i0 = 0; i0 < T; i0 += R) { /* dQ = dS K: dS rows read across the pairs of dS^T */
                    const bf16 *sa[R];
                    for (int r = 0; r < R; r++) sa[r] = dsv + 2 * (i0 + r < Tp ? i0 + r : 0);
                    for (int64_t d0 = 0; d0 < hd; d0 += C) {
                        tile(sa, 2 * Tp, kp, 2 * hd, d0, 0, (i0 + R) / 2, g);
                        store_tile(dq, b, h, i0, T, d0, g, scale, NULL);
                    }
                }
            }
        }
        free(ws);
    }
    return failed;
}

#else /* no AVX512-BF16: the bf16 functions exist but refuse */

int frawd_attention_available(void) { return 0; }

int frawd_attention_forward(View q, View k, View v, View out, float *lse, int64_t B, int64_t H, int64_t T,
                            int64_t hd, int64_t threads) {
    return 2;
}

int frawd_attention_backward(View dout, View q, View k, View v, View out, const float *lse, View dq, View dk,
                             View dv, int64_t B, int64_t H, int64_t T, int64_t hd, int64_t threads) {
    return 2;
}
#endif

/* ---- fp32, any CPU: the same computation in the machine's own vectors (simd.h's vf) ----

On a CPU without AVX512-BF16, training runs in fp32 and PyTorch's causal attention again
spends most of its time around small products. Here one thread takes one (batch, head) at a
time, as above, with plain fp32 FMAs: tiles of FR rows x FC columns (two vectors, 12
accumulators: AVX2 has 16 registers), the query/key side skipping the masked half.
The forward keeps no probabilities; the backward recomputes P from lse and keeps the head's
P and dS (T x Tp each) in its workspace, then reads them row-wise (dQ) and column-wise
(dK, dV: the A operand of a tile may be strided). Requires hd % FC == 0
(`frawd_attention_f32_columns`). */

#define FR 6        /* rows per fp32 tile */
#define FC (2 * VF) /* columns per fp32 tile */

typedef struct {
    float *p;
    int64_t sb, sh, st;
} ViewF;

int frawd_attention_f32_columns(void) { return FC; }

static inline float *atf(ViewF v, int64_t b, int64_t h, int64_t t) { return v.p + b * v.sb + h * v.sh + t * v.st; }

static inline int64_t up_to(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

/* acc[r][0..1] = sum over p in [p0, p1) of a[r][p * as] * b[p * ldb + (0 .. FC-1)]. */
static inline void ftile(const float *const a[FR], int64_t as, const float *b, int64_t ldb, int64_t p0,
                         int64_t p1, vf acc[FR][2]) {
    vf c0[FR], c1[FR];
    for (int r = 0; r < FR; r++) c0[r] = c1[r] = splat(0.0f);
    for (int64_t p = p0; p < p1; p++) {
        const vf b0 = *(const vf *)(b + p * ldb), b1 = *(const vf *)(b + p * ldb + VF);
#pragma GCC unroll 6
        for (int r = 0; r < FR; r++) {
            const vf x = splat(a[r][p * as]);
            c0[r] += x * b0;
            c1[r] += x * b1;
        }
    }
    for (int r = 0; r < FR; r++) acc[r][0] = c0[r], acc[r][1] = c1[r];
}

static inline vf lanes(void) {
    vf l;
    for (int i = 0; i < VF; i++) l[i] = (float)i;
    return l;
}

static inline vf select_vf(vfi keep, vf a, vf b) { return (vf)((keep & (vfi)a) | (~keep & (vfi)b)); }

static inline float hmax(vf a) {
    float m = a[0];
    for (int i = 1; i < VF; i++) m = a[i] > m ? a[i] : m;
    return m;
}

/* dst[d][j] = src row j, element d ([hd][Tp]: X^T as a tile's b), zero for j >= T. */
static void transpose_f32(ViewF src, int64_t b, int64_t h, int64_t T, int64_t Tp, int64_t hd, float *dst) {
    for (int64_t j = 0; j < Tp; j++) {
        const float *row = j < T ? atf(src, b, h, j) : NULL;
        for (int64_t d = 0; d < hd; d++) dst[d * Tp + j] = row ? row[d] : 0.0f;
    }
}

/* Rows i0 .. i0+FR-1 of Q (or dO) as a tile's a, the ones past T repeating row T-1. */
static inline void rows_f32(ViewF x, int64_t b, int64_t h, int64_t i0, int64_t T, const float *a[FR]) {
    for (int r = 0; r < FR; r++) a[r] = atf(x, b, h, i0 + r < T ? i0 + r : T - 1);
}

static void *carve_f32(char **cursor, int64_t floats) { return carve(cursor, 4 * floats); }

static char *workspace_f32(int64_t T, int64_t Tp, int64_t hd, int *failed) {
    char *ws = aligned_alloc(64, (size_t)up_to(4 * (2 * hd * Tp + 2 * T * Tp + 2 * FR * Tp + 2 * Tp) + 8 * 64, 64));
    if (!ws) {
#pragma omp atomic write
        *failed = 1;
    }
    return ws;
}

/* out = softmax(q k^T / sqrt(hd), causal) v and lse (B, H, T), all fp32. 0, or 1 when out of memory. */
int frawd_attention_forward_f32(ViewF q, ViewF k, ViewF v, ViewF out, float *lse, int64_t B, int64_t H,
                                int64_t T, int64_t hd, int64_t threads) {
    const int64_t Tp = up_to(T, FC);
    const float scale = 1.0f / sqrtf((float)hd);
    int failed = 0;
#pragma omp parallel num_threads((int)threads)
    {
        char *ws = workspace_f32(T, Tp, hd, &failed), *cur = ws;
#pragma omp barrier
        if (!failed) {
            float *kt = carve_f32(&cur, hd * Tp), *prow = carve_f32(&cur, FR * Tp);
            const vf lane = lanes();
            vf acc[FR][2];
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * H; bh++) {
                const int64_t b = bh / H, h = bh % H;
                transpose_f32(k, b, h, T, Tp, hd, kt);
                for (int64_t i0 = 0; i0 < T; i0 += FR) {
                    const int64_t rows = T - i0 < FR ? T - i0 : FR, ncols = up_to(i0 + rows, FC);
                    const float *a[FR], *pa[FR];
                    rows_f32(q, b, h, i0, T, a);
                    for (int64_t n0 = 0; n0 < ncols; n0 += FC) { /* S = Q K^T, the block's columns */
                        ftile(a, 1, kt + n0, Tp, 0, hd, acc);
                        for (int r = 0; r < FR; r++) {
                            *(vf *)(prow + r * Tp + n0) = acc[r][0];
                            *(vf *)(prow + r * Tp + n0 + VF) = acc[r][1];
                        }
                    }
                    float inv[FR];
                    for (int r = 0; r < FR; r++) {
                        const int64_t i = i0 + (r < rows ? r : rows - 1);
                        float *x = prow + r * Tp;
                        vf top = splat(-INFINITY);
                        for (int64_t j = 0; j < ncols; j += VF) {
                            const vf seen = select_vf(lane + splat((float)j) <= splat((float)i), *(vf *)(x + j), top);
                            top = select_vf(seen > top, seen, top);
                        }
                        const float best = hmax(top) * scale;
                        vf sum = splat(0.0f);
                        for (int64_t j = 0; j < ncols; j += VF) {
                            const vf e = select_vf(lane + splat((float)j) <= splat((float)i),
                                                   v_exp(*(vf *)(x + j) * scale - best), splat(0.0f));
                            *(vf *)(x + j) = e;
                            sum += e;
                        }
                        const float total = hsum(sum);
                        inv[r] = 1.0f / total;
                        if (r < rows) lse[(b * H + h) * T + i] = best + logf(total);
                        pa[r] = x;
                    }
                    for (int64_t d0 = 0; d0 < hd; d0 += FC) { /* O = P V / sum */
                        ftile(pa, 1, atf(v, b, h, 0) + d0, v.st, 0, i0 + rows, acc);
                        for (int r = 0; r < rows; r++) {
                            float *o = atf(out, b, h, i0 + r) + d0;
                            *(vf *)o = acc[r][0] * inv[r];
                            *(vf *)(o + VF) = acc[r][1] * inv[r];
                        }
                    }
                }
            }
        }
        free(ws);
    }
    return failed;
}

/* Gradients dq, dk, dv (fp32) of the forward above, given dout, its inputs, out and lse. */
int frawd_attention_backward_f32(ViewF dout, ViewF q, ViewF k, ViewF v, ViewF out, const float *lse, ViewF dq,
                                 ViewF dk, ViewF dv, int64_t B, int64_t H, int64_t T, int64_t hd, int64_t threads) {
    const int64_t Tp = up_to(T, FC);
    const float scale = 1.0f / sqrtf((float)hd);
    int failed = 0;
#pragma omp parallel num_threads((int)threads)
    {
        char *ws = workspace_f32(T, Tp, hd, &failed), *cur = ws;
#pragma omp barrier
        if (!failed) {
            float *kt = carve_f32(&cur, hd * Tp), *vt = carve_f32(&cur, hd * Tp);
            float *P = carve_f32(&cur, T * Tp), *dS = carve_f32(&cur, T * Tp);
            float *lse_h = carve_f32(&cur, Tp), *D = carve_f32(&cur, Tp);
            const vf lane = lanes();
            vf s[FR][2], dp[FR][2];
#pragma omp for schedule(static)
            for (int64_t bh = 0; bh < B * H; bh++) {
                const int64_t b = bh / H, h = bh % H;
                transpose_f32(k, b, h, T, Tp, hd, kt);
                transpose_f32(v, b, h, T, Tp, hd, vt);
                for (int64_t i = 0; i < T; i++) { /* D_i = dO_i . O_i */
                    const float *x = atf(dout, b, h, i), *y = atf(out, b, h, i);
                    vf d = splat(0.0f);
                    for (int64_t c = 0; c < hd; c += VF) d += *(const vf *)(x + c) * *(const vf *)(y + c);
                    D[i] = hsum(d);
                    lse_h[i] = lse[(b * H + h) * T + i];
                }
                for (int64_t i0 = 0; i0 < T; i0 += FR) { /* P and dS, row blocks, causal columns only */
                    const int64_t rows = T - i0 < FR ? T - i0 : FR, ncols = up_to(i0 + rows, FC);
                    const float *qa[FR], *da[FR];
                    rows_f32(q, b, h, i0, T, qa);
                    rows_f32(dout, b, h, i0, T, da);
                    for (int64_t n0 = 0; n0 < ncols; n0 += FC) {
                        ftile(qa, 1, kt + n0, Tp, 0, hd, s);  /* S = Q K^T */
                        ftile(da, 1, vt + n0, Tp, 0, hd, dp); /* dP = dO V^T */
                        for (int r = 0; r < rows; r++) {
                            const int64_t i = i0 + r;
                            for (int half = 0; half < 2; half++) {
                                const int64_t j = n0 + half * VF;
                                const vf p = select_vf(lane + splat((float)j) <= splat((float)i),
                                                       v_exp(s[r][half] * scale - lse_h[i]), splat(0.0f));
                                *(vf *)(P + i * Tp + j) = p;
                                *(vf *)(dS + i * Tp + j) = p * (dp[r][half] - D[i]);
                            }
                        }
                    }
                    for (int r = 0; r < rows; r++) {
                        memset(P + (i0 + r) * Tp + ncols, 0, 4 * (Tp - ncols));
                        memset(dS + (i0 + r) * Tp + ncols, 0, 4 * (Tp - ncols));
                    }
                }
                for (int64_t i0 = 0; i0 < T; i0 += FR) { /* dQ = dS K / sqrt(hd) */
                    const int64_t rows = T - i0 < FR ? T - i0 : FR;
                    const float *a[FR];
                    for (int r = 0; r < FR; r++) a[r] = dS + (i0 + (r < rows ? r : rows - 1)) * Tp;
                    for (int64_t d0 = 0; d0 < hd; d0 += FC) {
                        ftile(a, 1, atf(k, b, h, 0) + d0, k.st, 0, i0 + rows, s);
                        for (int r = 0; r < rows; r++) {
                            float *o = atf(dq, b, h, i0 + r) + d0;
                            *(vf *)o = s[r][0] * scale;
                            *(vf *)(o + VF) = s[r][1] * scale;
                        }
                    }
                }
                for (int64_t j0 = 0; j0 < T; j0 += FR) { /* dV = P^T dO, dK = dS^T Q / sqrt(hd): rows i >= j */
                    const int64_t rows = T - j0 < FR ? T - j0 : FR;
                    const float *pa[FR], *sa[FR];
                    for (int r = 0; r < FR; r++) {
                        const int64_t j = j0 + (r < rows ? r : rows - 1);
                        pa[r] = P + j, sa[r] = dS + j;
                    }
                    for (int64_t d0 = 0; d0 < hd; d0 += FC) {
                        ftile(pa, Tp, atf(dout, b, h, 0) + d0, dout.st, j0, T, s);
                        ftile(sa, Tp, atf(q, b, h, 0) + d0, q.st, j0, T, dp);
                        for (int r = 0; r < rows; r++) {
                            float *ov = atf(dv, b, h, j0 + r) + d0, *ok = atf(dk, b, h, j0 + r) + d0;
                            *(vf *)ov = s[r][0];
                            *(vf *)(ov + VF) = s[r][1];
                            *(vf *)ok = dp[r][0] * scale;
                            *(vf *)(ok + VF) = dp[r][1] * scale;
                        }
                    }
                }
            }
        }
        free(ws);
    }
    return failed;
}
