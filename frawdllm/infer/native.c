/* The FrawdLLM forward on CPU, in C: prefill and decode steps of the inference engine.

Why C: at batch 1 a decode step multiplies one vector by every weight matrix. The work
is reading the weights (27 MB for the `tiny` preset in fp32), which two cores do in
about 0.4 ms; PyTorch spends several times that dispatching its ~150 small operations.
Here a whole forward is one call doing the model's own arithmetic, in the order of
`FrawdLLM.hidden_states` + `lm_head`, with nothing around it:

    x = tok[token] (* sqrt(D)) (+ pos[p])                      embeddings
    per layer (pre-LN shown; post-LN normalises after each residual add instead):
        q, k, v = split(norm1(x) @ Wqkv)       RoPE on q, k     k, v -> cache slots
        x += softmax(q k^T / sqrt(hd)) v @ Wproj                 over the cached slots
        x += act(norm2(x) @ Wup) @ Wdown                         GELU or SwiGLU
    logits = norm(x) @ Whead                                     last token of each row

One call takes B rows of T new tokens: T = 1 is a decode step, T > 1 a prefill.

Matrices are read as W^T, (in, out) row-major: that is how the engine stores every
nn.Linear weight (`column_major_weights`), so nothing is copied. A product walks the
inputs i and adds x[i] * W^T[i, tile] into accumulators for a tile of 128 outputs and
1-2 rows (or 64 outputs and 4 rows): plain multiply-adds over contiguous memory, no
horizontal sums. Weights
can also be read from fp16 copies (half the bytes) or from int8 with a scale per output
(`--quantize int8`: a quarter), each converted exactly to fp32 in registers.

Threads (OpenMP) split every product by output tiles and the attention by token and
head; a barrier separates dependent phases. Arithmetic is fp32 throughout, as in the
model: with fp32 weights results equal PyTorch's up to rounding order
(tests/test_native.py checks 1e-5 against the full forward).

Vectors use GCC's vector extensions (16 floats), so the compiler emits AVX-512, AVX2 or
SSE for the machine it runs on (the file is compiled on first use with -march=native).
*/
#include <math.h>
#include <omp.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdint.h>
#include <string.h>

#include "../simd.h"

#define NV_MAX 8  /* vectors per tile */
#define TILE (16 * NV_MAX)  /* outputs per tile */
#define ROWS_MAX 4  /* rows per pass over (half) a tile */

enum { POS_NONE = 0, POS_LEARNED = 1, POS_SINUSOIDAL = 2, POS_ROPE = 3 };
enum { EPI_STORE = 0, EPI_ADD = 1, EPI_GELU = 2 };
enum { OK = 0, BAD_TOKEN = 1, BAD_POSITION = 2 };

/* The structs below are mirrored by ctypes in native.py: keep the two in step. */
typedef struct {
    const float *w;     /* W^T: (in, out) row-major */
    const uint16_t *wh; /* the same as fp16, or NULL: read instead of w when set */
    const int8_t *wq;   /* or int8 (in, out) with one scale per output: W^T[i, o] = wq[i, o] * scale[o] */
    const float *scale;
    const float *b;     /* (out) or NULL */
    int64_t in, out;
} Linear;

typedef struct {
    const float *w, *b; /* gain (D), bias (D) or NULL; RMSNorm has no bias */
} Norm;

typedef struct {
    Norm norm1, norm2;
    Linear qkv, proj, up, down;
} Layer;

typedef struct {
    int64_t n_layer, d, n_head, n_kv_head, head_dim, vocab, context, ffn;
    int64_t pos_encoding, rmsnorm, swiglu, pre_norm, final_norm;
    float embed_scale, eps;
    const float *tok;
    int64_t tok_s0, tok_s1; /* token embedding (vocab, D) and its strides, in floats */
    const float *pos;       /* (context, D): learned or sinusoidal; NULL otherwise */
    const float *rope_cos, *rope_sin; /* (context, hd/2) for RoPE */
    Norm final_norm_w;
    Linear head;
    const Layer *layers;
} Model;

static inline v16 v_sigmoid(v16 x) { return splat(1.0f) / (splat(1.0f) + v_exp(-x)); }

/* GPT-2's tanh GELU written with a sigmoid: 0.5 (1 + tanh z) = sigmoid(2z). */
static inline v16 v_gelu(v16 x) {
    return x * v_sigmoid(splat(1.5957691216057308f) * (x + splat(0.044715f) * x * x * x));
}

static float gelu1(float x) { v16 v = v_gelu(splat(x)); return v[0]; }
static float silu1(float x) { v16 v = v_sigmoid(splat(x)); return x * v[0]; }

enum { W_FP32 = 0, W_FP16 = 1, W_INT8 = 2 }; /* how a Linear stores its weights */

static inline int storage(const Linear *L) { return L->wq ? W_INT8 : L->wh ? W_FP16 : W_FP32; }

/* W^T[i, o] for flat index j = i * out + o, without the int8 scale. */
static inline float weight(const Linear *L, int64_t j) {
    if (L->wq) return (float)L->wq[j];
#if defined(__F16C__)
    if (L->wh) return _cvtsh_ss(L->wh[j]);
#endif
    return L->w[j];
}

/* 1 when fp16 weights can be read on this machine. */
int frawd_has_fp16(void) {
#if defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

/* ---- matrix-vector products ---------------------------------------------------------- */

/* 16 weights from fp32, fp16 or int8 storage (fewer bytes to read; converted exactly). */
static inline __attribute__((always_inline)) v16 load_w(int kind, const Linear *L, int64_t j) {
#if defined(__AVX512F__)
    if (kind == W_FP16) return (v16)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(L->wh + j)));
    if (kind == W_INT8) return (v16)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(L->wq + j))));
#elif defined(__F16C__) /* AVX2 machines: two halves of 8 */
    if (kind == W_FP16) {
        __m256 lo = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(L->wh + j)));
        __m256 hi = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(L->wh + j + 8)));
        v16 out;
        memcpy(&out, &lo, 32);
        memcpy((char *)&out + 32, &hi, 32);
        return out;
    }
#if defined(__AVX2__)
    if (kind == W_INT8) {
        __m256 lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(L->wq + j))));
        __m256 hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(L->wq + j + 8))));
        v16 out;
        memcpy(&out, &lo, 32);
        memcpy((char *)&out + 32, &hi, 32);
        return out;
    }
#endif
#endif
    if (kind != W_FP32) {
        v16 out;
        for (int k = 0; k < 16; k++) out[k] = weight(L, j + k);
        return out;
    }
    return *(const v16 *)(L->w + j);
}

/* acc[r][k] = x[r] . W^T[:, c + 16k]  for R rows and one tile of 16 NV outputs starting at c. */
static inline __attribute__((always_inline)) void tile_product(
    int R, int NV, int kind, const float *x, int64_t ldx, const Linear *L, int64_t c, v16 acc[][NV_MAX]) {
    for (int r = 0; r < R; r++)
        for (int k = 0; k < NV; k++) acc[r][k] = splat(0.0f);
    for (int64_t i = 0, j = c; i < L->in; i++, j += L->out) {
        v16 w[NV_MAX];
        for (int k = 0; k < NV; k++) w[k] = load_w(kind, L, j + 16 * k);
        for (int r = 0; r < R; r++) {
            v16 xi = splat(x[r * ldx + i]);
            for (int k = 0; k < NV; k++) acc[r][k] += xi * w[k];
        }
    }
}

static inline void epilogue(int mode, float *y, v16 value) {
    if (mode == EPI_ADD) value += *(v16 *)y;
    else if (mode == EPI_GELU) value = v_gelu(value);
    *(v16 *)y = value;
}

/* Rows [r0, r0 + R) of y[:, c:c + 16 NV] (=, +=, = gelu of) x @ W^T[:, c:c + 16 NV] + b. */
static inline __attribute__((always_inline)) void rows_tile(const Linear *L, const float *x, int64_t ldx, float *y,
                                                            int64_t ldy, int64_t r0, int R, int64_t c, int NV,
                                                            int mode) {
    v16 acc[ROWS_MAX][NV_MAX];
    const float *xr = x + r0 * ldx;
    /* constant arguments: one specialised loop each, acc kept in registers */
    switch (storage(L) * 4 + (R == 4 ? 2 : R - 1)) {
        case W_FP32 * 4: tile_product(1, NV, W_FP32, xr, ldx, L, c, acc); break;
        case W_FP32 * 4 + 1: tile_product(2, NV, W_FP32, xr, ldx, L, c, acc); break;
        case W_FP32 * 4 + 2: tile_product(4, NV, W_FP32, xr, ldx, L, c, acc); break;
        case W_FP16 * 4: tile_product(1, NV, W_FP16, xr, ldx, L, c, acc); break;
        case W_FP16 * 4 + 1: tile_product(2, NV, W_FP16, xr, ldx, L, c, acc); break;
        case W_FP16 * 4 + 2: tile_product(4, NV, W_FP16, xr, ldx, L, c, acc); break;
        case W_INT8 * 4: tile_product(1, NV, W_INT8, xr, ldx, L, c, acc); break;
        case W_INT8 * 4 + 1: tile_product(2, NV, W_INT8, xr, ldx, L, c, acc); break;
        default: tile_product(4, NV, W_INT8, xr, ldx, L, c, acc); break;
    }
    for (int r = 0; r < R; r++)
        for (int k = 0; k < NV; k++) {
            v16 v = acc[r][k];
            if (L->scale) v *= *(const v16 *)(L->scale + c + 16 * k);
            if (L->b) v += *(const v16 *)(L->b + c + 16 * k);
            epilogue(mode, y + (r0 + r) * ldy + c + 16 * k, v);
        }
}

/* Rows [0, B) of y[:, c:c + 16 NV]. Rows go 4 at a time over half a tile (16 accumulators,
   each weight vector used 4 times: prefill and batches), the last ones 1 or 2 at a time
   over the whole tile. */
static inline __attribute__((always_inline)) void tile(const Linear *L, const float *x, int64_t ldx, float *y,
                                                       int64_t ldy, int64_t B, int64_t c, int NV, int mode) {
    int64_t r0 = 0;
    for (; r0 + 4 <= B; r0 += 4) {
        if (NV == NV_MAX) {
            rows_tile(L, x, ldx, y, ldy, r0, 4, c, NV_MAX / 2, mode);
            rows_tile(L, x, ldx, y, ldy, r0, 4, c + 8 * NV_MAX, NV_MAX / 2, mode);
        } else {
            rows_tile(L, x, ldx, y, ldy, r0, 4, c, NV, mode);
        }
    }
    for (; r0 < B; r0 += 2) rows_tile(L, x, ldx, y, ldy, r0, B - r0 == 1 ? 1 : 2, c, NV, mode);
}

/* y[r] (=, +=, = gelu of) x[r] @ W^T + b for rows [0, B), output tiles [t0, t1).
   Tile `out / TILE` is the partial one at the end: 16 outputs at a time, then single ones. */
static void linear_tiles(const Linear *L, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t B,
                         int64_t t0, int64_t t1, int mode) {
    int64_t full = L->out / TILE;
    for (int64_t t = t0; t < t1 && t < full; t++) tile(L, x, ldx, y, ldy, B, t * TILE, NV_MAX, mode);
    if (t1 <= full) return;
    int64_t c = full * TILE;
    for (; c + 16 <= L->out; c += 16) tile(L, x, ldx, y, ldy, B, c, 1, mode);
    for (int64_t r = 0; r < B; r++)
        for (int64_t j = c; j < L->out; j++) {
            float s = 0.0f;
            for (int64_t i = 0; i < L->in; i++) s += x[r * ldx + i] * weight(L, i * L->out + j);
            if (L->scale) s *= L->scale[j];
            if (L->b) s += L->b[j];
            float *out = y + r * ldy + j;
            *out = mode == EPI_ADD ? *out + s : mode == EPI_GELU ? gelu1(s) : s;
        }
}

/* This thread's share of y = x @ W^T (+ b): output tiles split evenly between threads. */
static void linear(const Linear *L, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t B, int mode) {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    int64_t tiles = (L->out + TILE - 1) / TILE;
    linear_tiles(L, x, ldx, y, ldy, B, tiles * t / T, tiles * (t + 1) / T, mode);
}

/* ---- the other pieces ------------------------------------------------------------------ */

static void norm_row(const Model *m, const Norm *n, const float *x, float *y) {
    int64_t D = m->d;
    float mean = 0.0f, var = 0.0f;
    if (!m->rmsnorm) {
        for (int64_t i = 0; i < D; i++) mean += x[i];
        mean /= (float)D;
    }
    for (int64_t i = 0; i < D; i++) var += (x[i] - mean) * (x[i] - mean);
    float inv = 1.0f / sqrtf(var / (float)D + m->eps);
    for (int64_t i = 0; i < D; i++) y[i] = (x[i] - mean) * inv * n->w[i] + (n->b ? n->b[i] : 0.0f);
}

/* This thread's rows of y = norm(x). */
static void norm_rows(const Model *m, const Norm *n, const float *x, float *y, int64_t B) {
    int t = omp_get_thread_num(), T = omp_get_num_threads();
    for (int64_t r = t; r < B; r += T) norm_row(m, n, x + r * m->d, y + r * m->d);
}

/* What a sublayer (attention, MLP) reads: pre-LN, norm(x) written to h; post-LN, x itself.
   Called by every thread of the parallel region (the barrier is theirs). */
static const float *sublayer_input(const Model *m, const Norm *n, const float *x, float *h, int64_t N) {
    if (!m->pre_norm) return x;
    norm_rows(m, n, x, h, N);
#pragma omp barrier
    return h;
}

/* After a residual add: post-LN normalises the stream in place; pre-LN leaves it. */
static void after_residual(const Model *m, const Norm *n, float *x, int64_t N) {
    if (m->pre_norm) return;
    norm_rows(m, n, x, x, N);
#pragma omp barrier
}

/* Rotate pairs (v[i], v[i + hd/2]) by the angles of position p (the "rotate half" layout). */
static void rope(const Model *m, float *v, int64_t p) {
    int64_t half = m->head_dim / 2;
    const float *c = m->rope_cos + p * half, *s = m->rope_sin + p * half;
    for (int64_t i = 0; i < half; i++) {
        float a = v[i], b = v[i + half];
        v[i] = a * c[i] - b * s[i];
        v[i + half] = b * c[i] + a * s[i];
    }
}

static inline float dot(const float *a, const float *b, int64_t n) {
    float s = 0.0f;
    int64_t i = 0;
    if (n >= 16) {
        v16 acc = *(const v16 *)a * *(const v16 *)b;
        for (i = 16; i + 16 <= n; i += 16) acc += *(const v16 *)(a + i) * *(const v16 *)(b + i);
        s = hsum(acc);
    }
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* y += p * v over n floats */
static inline void axpy(float *y, float p, const float *v, int64_t n) {
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) *(v16 *)(y + i) += splat(p) * *(const v16 *)(v + i);
    for (; i < n; i++) y[i] += p * v[i];
}

/* Token n = (b, t) of the batch, kv head g: RoPE on k and on the query heads sharing g,
   then k and v into cache slot `start + t` of row b. */
static void store_group(const Model *m, int64_t n, int64_t T, int64_t g, float *qkv, float *k_cache,
                        float *v_cache, int64_t max_len, int64_t start, int64_t position) {
    int64_t hd = m->head_dim, nh = m->n_head, nkv = m->n_kv_head, rep = nh / nkv;
    int64_t b = n / T, slot = start + n % T;
    float *row = qkv + n * (nh + 2 * nkv) * hd;
    float *k = row + (nh + g) * hd, *v = row + (nh + nkv + g) * hd;
    if (m->pos_encoding == POS_ROPE) {
        rope(m, k, position);
        for (int64_t h = g * rep; h < (g + 1) * rep; h++) rope(m, row + h * hd, position);
    }
    memcpy(k_cache + ((b * nkv + g) * max_len + slot) * hd, k, hd * sizeof(float));
    memcpy(v_cache + ((b * nkv + g) * max_len + slot) * hd, v, hd * sizeof(float));
}

/* Token n = (b, t), query head h: softmax(q k^T / sqrt(hd)) v over slots [0, start + t] of
   row b. With padding, a real query skips padding slots; a padding query (whose output
   nobody uses) sees them, so that no softmax is empty (PyTorch's mask does the same).
   scores: max_len floats of scratch. */
static void attend_head(const Model *m, int64_t n, int64_t T, int64_t h, const float *qkv, float *out,
                        const float *k_cache, const float *v_cache, int64_t max_len, int64_t start,
                        const uint8_t *valid, int64_t padded, float *scores) {
    int64_t hd = m->head_dim, nh = m->n_head, nkv = m->n_kv_head, g = h / (nh / nkv);
    int64_t b = n / T, slot = start + n % T, S = slot + 1;
    const float *q = qkv + n * (nh + 2 * nkv) * hd + h * hd;
    const float *kc = k_cache + (b * nkv + g) * max_len * hd, *vc = v_cache + (b * nkv + g) * max_len * hd;
    const uint8_t *ok = valid + b * max_len;
    int mask = padded && ok[slot];
    float scale = 1.0f / sqrtf((float)hd), best = -INFINITY;
    for (int64_t s = 0; s < S; s++) {
        scores[s] = (!mask || ok[s]) ? dot(q, kc + s * hd, hd) * scale : -INFINITY;
        if (scores[s] > best) best = scores[s];
    }
    float total = 0.0f;
    int64_t s = 0;
    for (; s + 16 <= S; s += 16) {
        v16 e = v_exp(*(v16 *)(scores + s) - splat(best));
        e = (v16)((vi16)e & ~(vi16)(*(v16 *)(scores + s) == splat(-INFINITY))); /* masked: exactly 0 */
        *(v16 *)(scores + s) = e;
        total += hsum(e);
    }
    for (; s < S; s++) {
        scores[s] = scores[s] == -INFINITY ? 0.0f : expf(scores[s] - best);
        total += scores[s];
    }
    float *y = out + n * m->d + h * hd;
    memset(y, 0, hd * sizeof(float));
    float inv_total = 1.0f / total;
    for (int64_t s2 = 0; s2 < S; s2++)
        if (scores[s2] != 0.0f) axpy(y, scores[s2] * inv_total, vc + s2 * hd, hd);
}

/* ---- the forward ----------------------------------------------------------------------- */

/* Floats of scratch `frawd_forward` needs for N = B T tokens, max_len slots, P threads. */
int64_t frawd_workspace_floats(const Model *m, int64_t N, int64_t max_len, int64_t P) {
    int64_t qkv = (m->n_head + 2 * m->n_kv_head) * m->head_dim;
    int64_t ff = m->swiglu ? 2 * m->ffn : m->ffn;
    return N * (3 * m->d + qkv + ff) + P * (max_len + 16) + 64;
}

/* B rows of T new tokens each: token[b, t] at position[b, t] goes to cache slot start + t
   of every layer and attends slots [0, start + t] (masked by valid[b, s] when `padded`).
   T = 1 is a decode step; T > 1 a prefill. k_cache[l], v_cache[l]: (B, n_kv_head,
   max_len, head_dim). logits: (B, vocab), of each row's last token.
   Returns OK, BAD_TOKEN or BAD_POSITION (nothing computed then). */
int frawd_forward(const Model *m, int64_t B, int64_t T, const int64_t *token, const int64_t *position,
                  float *const *k_cache, float *const *v_cache, int64_t max_len, int64_t start,
                  const uint8_t *valid, int64_t padded, float *logits, float *work, int64_t threads) {
    int64_t N = B * T;
    for (int64_t n = 0; n < N; n++) {
        if (token[n] < 0 || token[n] >= m->vocab) return BAD_TOKEN;
        if (position[n] < 0 || position[n] >= m->context) return BAD_POSITION;
    }
    int64_t D = m->d, nh = m->n_head, nkv = m->n_kv_head;
    int64_t qkv_w = (nh + 2 * nkv) * m->head_dim, ff_w = m->swiglu ? 2 * m->ffn : m->ffn;
    float *x = work, *h = x + N * D, *att = h + N * D, *qkv = att + N * D, *ff = qkv + N * qkv_w;
    float *scratch = ff + N * ff_w;

#pragma omp parallel num_threads((int)threads)
    {
        int t = omp_get_thread_num(), P = omp_get_num_threads();
        float *scores = scratch + t * (max_len + 16);
        for (int64_t n = t; n < N; n += P) { /* embeddings */
            const float *e = m->tok + token[n] * m->tok_s0;
            const float *p = m->pos ? m->pos + position[n] * D : NULL;
            for (int64_t i = 0; i < D; i++)
                x[n * D + i] = e[i * m->tok_s1] * m->embed_scale + (p ? p[i] : 0.0f);
        }
#pragma omp barrier
        for (int64_t l = 0; l < m->n_layer; l++) {
            const Layer *L = &m->layers[l];
            /* attention */
            linear(&L->qkv, sublayer_input(m, &L->norm1, x, h, N), D, qkv, qkv_w, N, EPI_STORE);
#pragma omp barrier
            for (int64_t task = t; task < N * nkv; task += P)
                store_group(m, task / nkv, T, task % nkv, qkv, k_cache[l], v_cache[l], max_len, start,
                            position[task / nkv]);
#pragma omp barrier
            for (int64_t task = t; task < N * nh; task += P)
                attend_head(m, task / nh, T, task % nh, qkv, att, k_cache[l], v_cache[l], max_len, start,
                            valid, padded, scores);
#pragma omp barrier
            linear(&L->proj, att, D, x, D, N, EPI_ADD); /* x += attention output */
#pragma omp barrier
            after_residual(m, &L->norm1, x, N);
            /* MLP */
            linear(&L->up, sublayer_input(m, &L->norm2, x, h, N), D, ff, ff_w, N, m->swiglu ? EPI_STORE : EPI_GELU);
#pragma omp barrier
            if (m->swiglu) { /* ff[:, :H] <- silu(gate) * up, gate = ff[:, :H], up = ff[:, H:] */
                for (int64_t n = t; n < N; n += P)
                    for (int64_t i = 0; i < m->ffn; i++)
                        ff[n * ff_w + i] = silu1(ff[n * ff_w + i]) * ff[n * ff_w + m->ffn + i];
#pragma omp barrier
            }
            linear(&L->down, ff, ff_w, x, D, N, EPI_ADD); /* x += MLP output */
#pragma omp barrier
            after_residual(m, &L->norm2, x, N);
        }
        /* each row's last token: final norm (or a copy) into h, then the LM head */
        for (int64_t b = t; b < B; b += P) {
            const float *last = x + ((b + 1) * T - 1) * D;
            if (m->final_norm) norm_row(m, &m->final_norm_w, last, h + b * D);
            else memcpy(h + b * D, last, D * sizeof(float));
        }
#pragma omp barrier
        linear(&m->head, h, D, logits, m->vocab, B, EPI_STORE);
    }
    return OK;
}
