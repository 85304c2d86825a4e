/* RMSNorm, RoPE and SwiGLU for fp32 training on CPU: forward and backward, one pass each.

Why C: in eager PyTorch each of these is a chain of elementwise kernels (RMSNorm: pow,
mean, add, rsqrt, two multiplies; RoPE: four multiplies, a subtract, an add and a
concatenation, per q and k; SwiGLU: silu and a multiply), each reading and writing the
whole activation, and autograd's backward doubles the chain. For a small model on a CPU
they cost about as much as the attention (a third of the matmuls' time). Here each is one
pass over memory, forward and backward, in the machine's vectors (simd.h). torch.compile
fuses the same chains by itself; these serve eager fp32 training (cpu_fused.py says when).

Shapes (all fp32, rows contiguous):
    rmsnorm   x (N, D), w (D,)         y = x * rstd * w,  rstd = 1 / sqrt(mean(x^2) + eps)
    rope      x (B, H, T, hd) strided, cos/sin (T, hd/2): the "rotate half" pairs (i, i + hd/2)
    swiglu    h (N, 2F) = [gate | up]  y = silu(gate) * up
Every result is independent of the thread count (w's gradient sums fixed chunks of rows,
then the chunks in order).
*/
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>

#include "../simd.h"

#define CHUNK 64 /* rows per partial sum of RMSNorm's weight gradient */

static inline vf load(const float *p) { return *(const vf *)p; }
static inline void store(float *p, vf x) { *(vf *)p = x; }

/* y = x * rstd * w per row; rstd (N,) kept for backward. */
int frawd_rmsnorm_forward(const float *x, const float *w, float *y, float *rstd, int64_t N, int64_t D, float eps,
                          int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *xr = x + n * D;
        float *yr = y + n * D;
        vf acc = splat(0.0f);
        int64_t d = 0;
        for (; d + VF <= D; d += VF) acc += load(xr + d) * load(xr + d);
        float ss = hsum(acc);
        for (; d < D; d++) ss += xr[d] * xr[d];
        const float r = 1.0f / sqrtf(ss / (float)D + eps);
        rstd[n] = r;
        for (d = 0; d + VF <= D; d += VF) store(yr + d, load(xr + d) * r * load(w + d));
        for (; d < D; d++) yr[d] = xr[d] * r * w[d];
    }
    return 0;
}

/* gx = rstd * (w gy - x rstd^2 mean(w gy x)) per row; gw = sum over rows of gy x rstd.
   partial: ceil(N / CHUNK) x D floats of scratch. */
int frawd_rmsnorm_backward(const float *gy, const float *x, const float *w, const float *rstd, float *gx, float *gw,
                           float *partial, int64_t N, int64_t D, int threads) {
    const int64_t chunks = (N + CHUNK - 1) / CHUNK;
#pragma omp parallel num_threads(threads)
    {
#pragma omp for schedule(static)
        for (int64_t c = 0; c < chunks; c++) {
            float *part = partial + c * D;
            for (int64_t d = 0; d < D; d++) part[d] = 0.0f;
            const int64_t end = (c + 1) * CHUNK < N ? (c + 1) * CHUNK : N;
            for (int64_t n = c * CHUNK; n < end; n++) {
                const float *xr = x + n * D, *gr = gy + n * D;
                float *gxr = gx + n * D;
                const float r = rstd[n];
                vf acc = splat(0.0f);
                int64_t d = 0;
                for (; d + VF <= D; d += VF) acc += load(gr + d) * load(w + d) * load(xr + d);
                float dot = hsum(acc);
                for (; d < D; d++) dot += gr[d] * w[d] * xr[d];
                const float k = dot * r * r * r / (float)D;
                for (d = 0; d + VF <= D; d += VF) {
                    const vf xv = load(xr + d), gv = load(gr + d);
                    store(gxr + d, gv * load(w + d) * r - xv * k);
                    store(part + d, load(part + d) + gv * xv * r);
                }
                for (; d < D; d++) {
                    gxr[d] = gr[d] * w[d] * r - xr[d] * k;
                    part[d] += gr[d] * xr[d] * r;
                }
            }
        }
#pragma omp for schedule(static)
        for (int64_t d = 0; d < D; d++) {
            float s = 0.0f;
            for (int64_t c = 0; c < chunks; c++) s += partial[c * D + d];
            gw[d] = s;
        }
    }
    return 0;
}

/* out = x rotated by each position's angles (sign = 1), or back (sign = -1: the backward pass,
   a rotation's transpose). x: (B, H, T, hd) with strides sb, sh, st (elements); out: (B, T, H, hd)
   contiguous. */
int frawd_rope(const float *x, int64_t sb, int64_t sh, int64_t st, const float *cos_t, const float *sin_t,
               float *out, int64_t B, int64_t H, int64_t T, int64_t hd, float sign, int threads) {
    const int64_t half = hd / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t bt = 0; bt < B * T; bt++) {
        const int64_t b = bt / T, t = bt % T;
        const float *c = cos_t + t * half, *s = sin_t + t * half;
        for (int64_t h = 0; h < H; h++) {
            const float *xr = x + b * sb + h * sh + t * st;
            float *o = out + (bt * H + h) * hd;
            int64_t i = 0;
            for (; i + VF <= half; i += VF) {
                const vf x1 = load(xr + i), x2 = load(xr + half + i), cv = load(c + i), sv = load(s + i) * sign;
                store(o + i, x1 * cv - x2 * sv);
                store(o + half + i, x2 * cv + x1 * sv);
            }
            for (; i < half; i++) {
                const float x1 = xr[i], x2 = xr[half + i], sv = s[i] * sign;
                o[i] = x1 * c[i] - x2 * sv;
                o[half + i] = x2 * c[i] + x1 * sv;
            }
        }
    }
    return 0;
}

static inline vf v_sigmoid(vf g) { return splat(1.0f) / (splat(1.0f) + v_exp(-g)); }

/* y (N, F) = silu(h[:, :F]) * h[:, F:]. */
int frawd_swiglu_forward(const float *h, float *y, int64_t N, int64_t F, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *g = h + n * 2 * F, *u = g + F;
        float *yr = y + n * F;
        int64_t i = 0;
        for (; i + VF <= F; i += VF) {
            const vf gv = load(g + i);
            store(yr + i, gv * v_sigmoid(gv) * load(u + i));
        }
        for (; i < F; i++) yr[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
    return 0;
}

/* gh (N, 2F) = [gy * up * silu'(gate) | gy * silu(gate)], silu'(g) = sig(g) (1 + g (1 - sig(g))). */
int frawd_swiglu_backward(const float *gy, const float *h, float *gh, int64_t N, int64_t F, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const float *g = h + n * 2 * F, *u = g + F, *gr = gy + n * F;
        float *gg = gh + n * 2 * F, *gu = gg + F;
        int64_t i = 0;
        for (; i + VF <= F; i += VF) {
            const vf gv = load(g + i), sig = v_sigmoid(gv), dy = load(gr + i);
            store(gg + i, dy * load(u + i) * sig * (splat(1.0f) + gv * (splat(1.0f) - sig)));
            store(gu + i, dy * gv * sig);
        }
        for (; i < F; i++) {
            const float sig = 1.0f / (1.0f + expf(-g[i]));
            gg[i] = gr[i] * u[i] * sig * (1.0f + g[i] * (1.0f - sig));
            gu[i] = gr[i] * g[i] * sig;
        }
    }
    return 0;
}
