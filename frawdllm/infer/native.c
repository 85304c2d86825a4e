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

Matrices are read from copies the decoder owns (`native.py` writes them; the model is
never touched), packed by tiles of 64 outputs: tile t holds W^T[:, 64t:64t+64] as `in`
consecutive rows of 64, so a thread's share of a product is one contiguous stream,
which the hardware prefetcher follows and which is also prefetched 8 KB ahead (with the
hint measured fastest for the model, see frawd_set_forms). A product walks the inputs i
and adds x[i] * W^T[i, tile] into register accumulators: one row 64 outputs at a time,
many rows by blocks of up to 6 rows x 32 outputs (AVX2: 6 x 16), as many as the registers
hold: plain multiply-adds, no horizontal sums, no scalar loops; or, on CPUs with AMX and
from as many rows as timing says it pays, on the tile unit (see "AMX"). Weights are fp32,
fp16 (half the bytes) or int8 with a scale per output (`--quantize int8`: a quarter), each
converted exactly to fp32 in registers.

Threads (OpenMP's team on the main thread, one of our own elsewhere: see "the team")
each take an even share of a phase's items (a product's output tiles, attention's tasks),
then what is left of the others', and a phase ends when its items are done, by whoever
took them (see "sharing a forward's work": a thread the OS preempts holds up only the item
it has; a waiting thread sleeps after a short spin). Arithmetic is fp32 throughout, as in the
model: with fp32 weights results equal PyTorch's up to rounding order
(tests/test_native.py checks 1e-5 against the full forward). The KV cache holds fp32, or
fp16 (kv_half: rounded once when stored, converted exactly when read; the engine's
choice with fp16 weights), which halves what attention reads from memory.

Vectors use GCC's vector extensions (16 or 8 floats), so the compiler emits AVX-512,
AVX2, SSE or NEON for the machine it runs on (the file is compiled on first use with
-march=native); fp16 loads convert with F16C on x86 (AVX-512 or AVX) and natively on
aarch64; int8 loads widen with AVX-512, AVX2 or NEON instructions, and with the compiler's
portable conversion elsewhere.
*/
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#elif defined(__aarch64__)
#include <arm_neon.h>
#endif
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/syscall.h>
#else
#include <sched.h>
#endif

#include "../simd.h"

/* Vectors are simd.h's: VF floats (16 with AVX-512, else 8); ACC_MAX accumulators fit
   beside the weights and broadcast in the register file (32 or 16 registers). */
#if VF == 16
#define ACC_MAX 16
#else
#define ACC_MAX 8
#endif
#define TILE 64            /* outputs per packed tile (the layout native.py writes) */
#define NV (TILE / VF)     /* vectors per tile */
#define PREFETCH_BYTES 8192 /* how far ahead the weight stream is prefetched */

/* How the weight stream is prefetched: the hint matters more than one would think. On AMD
   Zen 4 the non-temporal hint (NTA) paid; on an Intel Xeon with AMX, NTA-prefetched weights
   came at a quarter of the speed of no software prefetch: batch-1 decode of `tiny` ran 3.6x
   slower. native.py times the three on the model's own decode steps (frawd_set_forms). */
enum { PF_NTA = 0, PF_T0 = 1, PF_NONE = 2 };

static inline __attribute__((always_inline)) void prefetch_w(int hint, const char *p) {
    if (hint == PF_NTA) __builtin_prefetch(p, 0, 0);
    else if (hint == PF_T0) __builtin_prefetch(p, 0, 3);
}

enum { POS_NONE = 0, POS_LEARNED = 1, POS_SINUSOIDAL = 2, POS_ROPE = 3 };
enum { EPI_STORE = 0, EPI_ADD = 1, EPI_GELU = 2 };
enum { OK = 0, BAD_TOKEN = 1, BAD_POSITION = 2, BAD_SLOT = 3, BAD_CACHE = 4, KV_OVERFLOW = 5 };

/* The structs below are mirrored by ctypes in native.py: keep the two in step.
   A Linear's weights are packed by tiles of TILE outputs: W[t, i, k] = W^T[i, t TILE + k],
   (out padded with zero columns to a whole tile), so a thread's share is one contiguous
   stream. Bias and scale are padded to whole tiles too. */
typedef struct {
    const float *w;     /* packed fp32, read when wh and wq are NULL */
    const uint16_t *wh; /* or packed fp16 */
    const int8_t *wq;   /* or packed int8 with one scale per output: W^T[i, o] = wq * scale[o] */
    const float *scale;
    const float *b;     /* (tiles * TILE) or NULL */
    int64_t in, out;
    int64_t hint, narrow, hint_rows; /* how its stream is read: one row, many (frawd_set_forms) */
    const uint16_t *wb; /* or NULL: the fp16 weights again as two bf16 planes for AMX (see "AMX") */
    int64_t amx_rows;   /* products of at least this many rows run on AMX (0: never; frawd_set_forms) */
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
    int64_t kv_prefetch; /* decode steps ask for the next task's keys and values ahead (frawd_set_forms) */
} Model;

static inline vf v_sigmoid(vf x) { return splat(1.0f) / (splat(1.0f) + v_exp(-x)); }

/* GPT-2's tanh GELU written with a sigmoid: 0.5 (1 + tanh z) = sigmoid(2z). */
static inline vf v_gelu(vf x) {
    return x * v_sigmoid(splat(1.5957691216057308f) * (x + splat(0.044715f) * x * x * x));
}

enum { W_FP32 = 0, W_FP16 = 1, W_INT8 = 2 }; /* how a Linear stores its weights */
enum { W_FP16_NARROW = 3 }; /* fp16 read 8 at a time (see chunk_product_narrow) */
static const int BYTES[4] = {4, 2, 1, 2};

static inline int storage(const Linear *L) { return L->wq ? W_INT8 : L->wh ? W_FP16 : W_FP32; }

static inline const char *packed(const Linear *L) {
    return L->wq ? (const char *)L->wq : L->wh ? (const char *)L->wh : (const char *)L->w;
}

#if defined(__F16C__) || defined(__aarch64__)
#define HAS_FP16 1
#else
#define HAS_FP16 0
#endif

/* 1 when fp16 weights can be read on this machine (x86 with F16C, every aarch64): load_w,
   load_kv and to_half convert them. */
int frawd_has_fp16(void) { return HAS_FP16; }

/* Outputs per packed tile: the layout native.py writes. */
int64_t frawd_tile(void) { return TILE; }

/* ---- matrix-vector products ---------------------------------------------------------- */

/* VF weights from fp32, fp16 or int8 storage (fewer bytes to read; converted exactly). */
static inline __attribute__((always_inline)) vf load_w(int kind, const char *p) {
    if (kind == W_FP32) return *(const vf *)p;
#if defined(__AVX512F__)
    if (kind == W_FP16) return (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
    return (vf)_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
#if defined(__F16C__) /* (AVX2, or AVX alone: Ivy Bridge, AMD Piledriver) */
    if (kind == W_FP16) return (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#elif HAS_FP16 /* aarch64 */
    typedef __fp16 vh __attribute__((vector_size(VF * 2), aligned(2)));
    if (kind == W_FP16) return __builtin_convertvector(*(const vh *)p, vf);
#endif
#if defined(__AVX2__)
    return (vf)_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#elif defined(__aarch64__) && VF == 8 /* widened twice in registers (the generic form converted one by one) */
    int16x8_t wide = vmovl_s8(vld1_s8((const int8_t *)p));
    float32x4_t halves[2] = {vcvtq_f32_s32(vmovl_s16(vget_low_s16(wide))), vcvtq_f32_s32(vmovl_high_s16(wide))};
    vf out;
    memcpy(&out, halves, sizeof out);
    return out;
#else /* portable: the compiler's own conversion */
    typedef int8_t vq __attribute__((vector_size(VF), aligned(1)));
    return __builtin_convertvector(*(const vq *)p, vf);
#endif
#endif
}

/* Whether products keep a second set of sums for odd inputs (hides the add latency): where
   the register file holds twice a tile's sums. Every row count sums the same way, so a
   row's result does not depend on how many rows share the product (a continuous batch
   gives each request exactly what it would get alone; with AMX, below its row count). */
#define SPLIT (2 * NV <= ACC_MAX)

/* acc[r][k] = x[r] . W^T[:, chunk k] for R rows, C vectors of one tile; p = the tile's
   first row at this chunk, rows TILE weights apart. Every row of the stream is used R
   times from registers; the stream PREFETCH_BYTES ahead is requested meanwhile. */
static inline __attribute__((always_inline)) void chunk_product_narrow(
    int C, const float *x, const char *p, int64_t in, vf acc[][ACC_MAX]);

static inline __attribute__((always_inline)) void chunk_product(
    int R, int C, int kind, int hint, const float *x, int64_t ldx, const char *p, int64_t in, vf acc[][ACC_MAX]) {
    if (kind == W_FP16_NARROW) { /* (one row only) */
        chunk_product_narrow(C, x, p, in, acc);
        return;
    }
    const int64_t row = (int64_t)TILE * BYTES[kind], bytes = (int64_t)C * VF * BYTES[kind];
    const int64_t ahead = PREFETCH_BYTES / row; /* rows */
    for (int r = 0; r < R; r++)
        for (int k = 0; k < C; k++) acc[r][k] = splat(0.0f);
    int64_t i = 0;
    if (SPLIT) { /* even inputs into acc, odd ones into odd, added at the end */
        vf odd[8][ACC_MAX];
        for (int r = 0; r < R; r++)
            for (int k = 0; k < C; k++) odd[r][k] = splat(0.0f);
        for (; i + 2 <= in; i += 2, p += 2 * row) {
            if (hint != PF_NONE)
                for (int64_t b = 0; b < bytes; b += 64) {
                    prefetch_w(hint, p + ahead * row + b);
                    prefetch_w(hint, p + (ahead + 1) * row + b);
                }
            vf w0[ACC_MAX], w1[ACC_MAX];
            for (int k = 0; k < C; k++) w0[k] = load_w(kind, p + (int64_t)k * VF * BYTES[kind]);
            for (int k = 0; k < C; k++) w1[k] = load_w(kind, p + row + (int64_t)k * VF * BYTES[kind]);
            for (int r = 0; r < R; r++) {
                vf x0 = splat(x[r * ldx + i]), x1 = splat(x[r * ldx + i + 1]);
                for (int k = 0; k < C; k++) acc[r][k] += x0 * w0[k];
                for (int k = 0; k < C; k++) odd[r][k] += x1 * w1[k];
            }
        }
        for (int r = 0; r < R; r++)
            for (int k = 0; k < C; k++) acc[r][k] += odd[r][k];
    }
    for (; i < in; i++, p += row) {
        if (hint != PF_NONE)
            for (int64_t b = 0; b < bytes; b += 64) prefetch_w(hint, p + ahead * row + b);
        vf w[ACC_MAX];
        for (int k = 0; k < C; k++) w[k] = load_w(kind, p + (int64_t)k * VF * BYTES[kind]);
        for (int r = 0; r < R; r++) {
            vf xi = splat(x[r * ldx + i]);
            for (int k = 0; k < C; k++) acc[r][k] += xi * w[k];
        }
    }
}

/* fp16 at batch 1 with 16-float vectors, converted 8 at a time. One row uses each
   weight once, so the product runs at the rate weights are converted, and some cores
   convert 16 fp16 at half the rate of 8 (AMD Zen 4: a one-row fp16 product then streams
   ~55 GB/s from L3 against ~85 with 8-wide conversions); others convert both at one per
   cycle. native.py times both forms and keeps the faster. The sums
   are the same, in the same order, as chunk_product's (lanes are independent), so the
   two forms give identical bits. No software prefetch here: with the loads at their
   limit the prefetch instructions cost more than the hardware prefetcher leaves to gain. */
#if VF == 16 && defined(__F16C__)
#define HAS_NARROW 1
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t v8i __attribute__((vector_size(32)));

static inline __attribute__((always_inline)) void chunk_product_narrow(
    int C, const float *x, const char *p, int64_t in, vf acc[][ACC_MAX]) {
    const int64_t row = (int64_t)TILE * 2;
    v8 even[2 * NV], odd[2 * NV]; /* halves of acc and of chunk_product's odd sums */
    for (int k = 0; k < 2 * C; k++) even[k] = odd[k] = (v8){};
    int64_t i = 0;
    for (; i + 2 <= in; i += 2, p += 2 * row) {
        v8 x0 = __builtin_shuffle((v8){x[i]}, (v8i){}), x1 = __builtin_shuffle((v8){x[i + 1]}, (v8i){});
        for (int k = 0; k < 2 * C; k++) even[k] += x0 * (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * k)));
        for (int k = 0; k < 2 * C; k++)
            odd[k] += x1 * (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + row + 16 * k)));
    }
    for (int k = 0; k < 2 * C; k++) even[k] += odd[k];
    for (; i < in; i++, p += row) {
        v8 xi = __builtin_shuffle((v8){x[i]}, (v8i){});
        for (int k = 0; k < 2 * C; k++) even[k] += xi * (v8)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16 * k)));
    }
    for (int k = 0; k < C; k++) {
        memcpy(&acc[0][k], &even[2 * k], sizeof(v8));
        memcpy((char *)&acc[0][k] + sizeof(v8), &even[2 * k + 1], sizeof(v8));
    }
}
#else
#define HAS_NARROW 0
static inline __attribute__((always_inline)) void chunk_product_narrow(
    int C, const float *x, const char *p, int64_t in, vf acc[][ACC_MAX]) {
    (void)x, (void)p, (void)in; /* never called: 8-wide vectors are already the only form */
    for (int k = 0; k < C; k++) acc[0][k] = splat(0.0f);
}
#endif

/* y (=, +=) value for the first n of VF outputs (n < VF only in the last tile). */
static inline void epilogue(int mode, float *y, vf value, int64_t n) {
    if (n >= VF) {
        if (mode == EPI_ADD) value += *(vf *)y;
        *(vf *)y = value;
        return;
    }
    vf old = {};
    for (int64_t k = 0; k < n; k++) old[k] = y[k];
    value = mode == EPI_ADD ? value + old : value;
    for (int64_t k = 0; k < n; k++) y[k] = value[k];
}

/* Rows [r0, r0 + R) of y[:, chunk] for the chunk of C vectors at vector c0 of tile t, whose
   weights start at `tile` (tile t of the packed matrix). */
static inline __attribute__((always_inline)) void rows_chunk(
    int R, int C, int kind, int hint, const Linear *L, const char *tile, const float *x, int64_t ldx, float *y,
    int64_t ldy, int64_t r0, int64_t t, int c0, int mode) {
    vf acc[8][ACC_MAX];
    chunk_product(R, C, kind, hint, x + r0 * ldx, ldx, tile + (int64_t)c0 * VF * BYTES[kind], L->in, acc);
    for (int k = 0; k < C; k++) {
        int64_t o = t * TILE + (int64_t)(c0 + k) * VF; /* first output of this vector */
        if (o >= L->out) break;
        vf scale = L->scale ? *(const vf *)(L->scale + o) : splat(1.0f);
        vf bias = L->b ? *(const vf *)(L->b + o) : splat(0.0f);
        for (int r = 0; r < R; r++)
            epilogue(mode, y + (r0 + r) * ldy + o, acc[r][k] * scale + bias, L->out - o);
    }
}

/* Accumulators a block of R rows keeps per output vector (two chains each with SPLIT). */
#define ACC_ROWS(R) (SPLIT ? 2 * (R) : (R))

/* One row (batch-1 decode): the product runs at the rate weights stream in, so each tile
   is read once, 4 vectors wide (twice that many sums with SPLIT), in the form timed fastest
   (the prefetch hint; fp16 converted 8 at a time or 16). */
#define ROW_TILE(KIND)                                                                          \
    for (int c0 = 0; c0 < NV; c0 += ROW_CHUNK) rows_chunk(1, ROW_CHUNK, KIND, L->hint, L, tile, x, 0, y, 0, 0, t, c0, mode)
#define ROW_CHUNK (NV < ACC_MAX / ACC_ROWS(1) ? NV : ACC_MAX / ACC_ROWS(1))

static void one_row_tiles(const Linear *L, const float *x, float *y, int64_t t0, int64_t t1, int mode) {
    for (int64_t t = t0; t < t1; t++) {
        const char *tile = packed(L) + t * L->in * TILE * BYTES[storage(L)];
        switch (storage(L)) {
            case W_FP32: ROW_TILE(W_FP32); break;
            case W_FP16:
                if (L->narrow) ROW_TILE(W_FP16_NARROW);
                else ROW_TILE(W_FP16);
                break;
            default: ROW_TILE(W_INT8); break;
        }
    }
}

/* Many rows (a prefill, a batch): the products are bound by arithmetic, not by reading
   weights; each tile is read from memory once and then from cache by blocks of rows. A
   block of R rows x C vectors reads C weight vectors (converting fp16 or int8, which costs
   about what a multiply-add does) and broadcasts R inputs per input for R C multiply-adds,
   so blocks are as large as the registers allow: WIDE_ACC accumulators (R C, twice that
   with SPLIT): 6 rows x 2 vectors (AVX-512: ~10% faster than 8 x 1 for 32 rows, 20% for 8;
   AVX2 on a Zen 3: 10-12% faster than 4 x 2 for 8-32 rows, while 12 x 1 was 18% slower). The
   sums are the same, in the same order, as one row's: the row count changes no bit (AMX
   products, where they run, sum in another order: see "AMX"). */
#if VF == 16
#define WIDE_ACC 24 /* of 32 registers: the rest hold weights and broadcasts */
#else
#define WIDE_ACC 12 /* of 16 */
#endif
#define WIDE_ROWS 6
/* the widest chunk (a power of 2 vectors, so that chunks tile NV) whose sums fit WIDE_ACC */
#define WIDE_CHUNK(R) (ACC_ROWS(R) * NV <= WIDE_ACC ? NV : ACC_ROWS(R) * NV / 2 <= WIDE_ACC ? NV / 2 \
                       : ACC_ROWS(R) * NV / 4 <= WIDE_ACC ? NV / 4 : 1)
#define WIDE_TILE(R, KIND)                                                                       \
    for (int c0 = 0; c0 < NV; c0 += WIDE_CHUNK(R))                                               \
        rows_chunk(R, WIDE_CHUNK(R), KIND, L->hint_rows, L, tile, x, ldx, y, ldy, r0, t, c0, mode)
#define WIDE_ROW_BLOCKS(KIND)                                                                    \
    do {                                                                                         \
        int64_t r0 = 0;                                                                          \
        for (; r0 + WIDE_ROWS <= B; r0 += WIDE_ROWS) WIDE_TILE(WIDE_ROWS, KIND);                 \
        for (; r0 + 4 <= B; r0 += 4) WIDE_TILE(4, KIND);                                         \
        for (; r0 + 2 <= B; r0 += 2) WIDE_TILE(2, KIND);                                         \
        for (; r0 < B; r0++) WIDE_TILE(1, KIND);                                                 \
    } while (0)

static void wide_tiles(const Linear *L, const float *x, int64_t ldx, float *y, int64_t ldy, int64_t B,
                       int64_t t0, int64_t t1, int mode) {
    for (int64_t t = t0; t < t1; t++) {
        const char *tile = packed(L) + t * L->in * TILE * BYTES[storage(L)];
        switch (storage(L)) {
            case W_FP32: WIDE_ROW_BLOCKS(W_FP32); break;
            case W_FP16: WIDE_ROW_BLOCKS(W_FP16); break;
            default: WIDE_ROW_BLOCKS(W_INT8); break;
        }
    }
}

/* y[r, c0:c1] = gelu(y[r, c0:c1]) for rows [0, B), VF at a time. */
static void gelu_columns(float *y, int64_t ldy, int64_t B, int64_t c0, int64_t c1) {
    for (int64_t r = 0; r < B; r++) {
        float *row = y + r * ldy;
        int64_t c = c0;
        for (; c + VF <= c1; c += VF) *(vf *)(row + c) = v_gelu(*(vf *)(row + c));
        if (c < c1) {
            vf tail = {};
            memcpy(&tail, row + c, (c1 - c) * sizeof(float));
            tail = v_gelu(tail);
            memcpy(row + c, &tail, (c1 - c) * sizeof(float));
        }
    }
}

/* ---- waiting for each other ------------------------------------------------------------ */

/* Waiting for the others: a thread spins briefly (a decode step's phases are microseconds
   apart) and then sleeps in the kernel: when another process keeps a core busy, a waiting
   thread gives its core to the one it waits for instead of spinning through its time
   slice. (OpenMP's own barrier spins for as long as the runtime was told when it started,
   which is torch's.) The barrier ends an OpenMP forward (everyone out of forward_part);
   inside a forward, phases end by `Share`. */
#define SPINS 4000

typedef struct {
    atomic_int arrived, generation, P, sleepers; /* sleepers: threads in (or entering) futex_wait */
} Barrier;

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

/* Until *word != arg (changed) or *word >= arg (!changed): spin SPINS times, then sleep on
   the word in the kernel, counted in *sleepers (whoever moves the word wakes sleepers after
   it moves it: a sleeper counts itself before it checks, so the two cannot miss each other). */
static inline __attribute__((always_inline)) void spin_then_sleep(atomic_int *word, atomic_int *sleepers, int arg,
                                                                  int changed) {
#define READY(v) (changed ? (v) != arg : (v) >= arg)
    for (int i = 0; i < SPINS; i++) {
        if (READY(atomic_load_explicit(word, memory_order_acquire))) return;
        cpu_relax();
    }
    atomic_fetch_add(sleepers, 1);
    for (int v; !READY(v = atomic_load(word));) {
#if defined(__linux__)
        syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, v, NULL, NULL, 0);
#else
        sched_yield();
#endif
    }
    atomic_fetch_sub(sleepers, 1);
#undef READY
}

static void barrier_wait(Barrier *b) {
    int gen = atomic_load_explicit(&b->generation, memory_order_acquire);
    if (atomic_fetch_add_explicit(&b->arrived, 1, memory_order_acq_rel) == atomic_load_explicit(&b->P, memory_order_relaxed) - 1) {
        atomic_store_explicit(&b->arrived, 0, memory_order_relaxed);
        atomic_store(&b->generation, gen + 1);
#if defined(__linux__)
        /* A wake is a system call (~1 us in a VM), paid only when someone sleeps: a sleeper
           counts itself before its futex_wait re-checks the generation, and the two
           sequentially consistent pairs (store generation, load sleepers; add sleepers,
           load generation) cannot both miss each other. */
        if (atomic_load(&b->sleepers) > 0)
            syscall(SYS_futex, &b->generation, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
#endif
        return;
    }
    spin_then_sleep(&b->generation, &b->sleepers, gen, 1);
}

/* ---- sharing a forward's work ----------------------------------------------------------

   A forward is a chain of phases (a product, attention, norms), each of n items (a
   product's tiles, attention's tasks) that depend only on earlier phases. Each thread owns
   an even share of a phase's items (a product's tiles: a contiguous run of the weights) and
   takes them in order from its own counter; a thread that has finished its own takes what
   is left of the others', and a phase ends when its items are done, by whoever took them.
   With threads running alike this is a fixed even split; a thread the OS preempts (a
   server's HTTP work shares the cores, or another process) costs the others only the item
   it holds, where a fixed split made them wait at the next barrier for its whole share, and
   a thread late to a phase finds its items taken and goes on to the next. Each owner's
   counter serves the whole forward: every thread goes through the same phases with the same
   shares, so each knows where every owner's tickets for the current phase begin. An item's
   arithmetic does not depend on who computes it. */
#define MAX_TEAM 256

typedef struct {
    _Alignas(64) atomic_int next; /* an owner's tickets handed out (a cache line of its own) */
} Slot;

typedef struct {
    atomic_int done, sleepers; /* items finished (counted at each thread's phase end); threads asleep */
    Slot slot[MAX_TEAM];
} Shared;

typedef struct {
    Shared *s;
    int t, P;
    int64_t per, chunks; /* the current phase: chunks x per items; owner u has its share of per in each */
    int64_t tasks, k;    /* a phase of small tasks (begin_tasks): n of them, k an item */
    int end, mine;       /* `done` at which the current phase is over; items this thread did in it */
    int phases;          /* phases begun (for frawd_test_late_threads) */
    int base[MAX_TEAM];  /* owner u's tickets before the current phase */
} Share;

/* For tests: threads other than the first sleep `late_us` as they begin phase `late_phase` of
   each forward, as a preempted thread would: they find the phases that ended meanwhile done,
   take nothing from them, and join the phase under way. */
static int64_t late_us = 0, late_phase = 0;
void frawd_test_late_threads(int64_t us, int64_t phase) { late_us = us, late_phase = phase; }


/* Owner u's first of `per` items (its share: [first(u), first(u + 1))). */
static inline int64_t first(int64_t per, int u, int P) { return per * u / P; }

/* How many of the current phase's items owner u has. */
static inline int owned(const Share *sh, int u) {
    return (int)(sh->chunks * (first(sh->per, u + 1, sh->P) - first(sh->per, u, sh->P)));
}

/* A phase of chunks x per items (a product: row chunks x output tiles; else 1 x n). */
static inline void begin_chunks(Share *sh, int64_t per, int64_t chunks) {
    sh->per = per, sh->chunks = chunks, sh->mine = 0;
    if (late_us > 0 && sh->t > 0 && sh->phases++ == late_phase) usleep((useconds_t)late_us);
}

static inline void begin(Share *sh, int64_t n) { begin_chunks(sh, n, 1); }

/* A phase of n small tasks (rows to norm, attention's (row, head) pairs), k to an item: about
   4 items a thread (a ticket for every task would cost more than some tasks do). */
static inline void begin_tasks(Share *sh, int64_t n) {
    int64_t k = n / (4 * (int64_t)sh->P);
    sh->tasks = n, sh->k = k > 1 ? k : 1;
    begin(sh, (n + sh->k - 1) / sh->k);
}

/* The next item of the current phase, as (owner, index in the owner's share), own items
   first; -1 when all are taken. */
static inline int64_t take_owned(Share *sh, int *owner) {
    for (int k = 0, u = sh->t; k < sh->P; k++, u = u + 1 == sh->P ? 0 : u + 1) {
        atomic_int *c = &sh->s->slot[u].next;
        int i = atomic_load_explicit(c, memory_order_relaxed), end = sh->base[u] + owned(sh, u);
        while (i < end && !atomic_compare_exchange_weak_explicit(c, &i, i + 1, memory_order_relaxed,
                                                                 memory_order_relaxed)) {
        }
        if (i < end) {
            *owner = u;
            return i - sh->base[u];
        }
    }
    return -1;
}

/* The next item of a 1 x n phase: its index in [0, n), or -1. */
static inline int64_t take(Share *sh) {
    int u;
    int64_t j = take_owned(sh, &u);
    return j < 0 ? -1 : first(sh->per, u, sh->P) + j;
}

/* The next item of a product: a row chunk and a tile (each owner's tiles chunk by chunk); 0
   when all are taken. */
static inline int take_tile(Share *sh, int64_t *chunk, int64_t *tile) {
    int u;
    int64_t j = take_owned(sh, &u);
    if (j < 0) return 0;
    int64_t t0 = first(sh->per, u, sh->P), tiles = first(sh->per, u + 1, sh->P) - t0;
    *chunk = j / tiles, *tile = t0 + j % tiles;
    return 1;
}

/* The next item of a begin_tasks phase: tasks [*lo, *hi); 0 when all are taken. */
static inline int take_tasks(Share *sh, int64_t *lo, int64_t *hi) {
    int64_t item = take(sh);
    if (item < 0) return 0;
    *lo = item * sh->k, *hi = *lo + sh->k < sh->tasks ? *lo + sh->k : sh->tasks;
    return 1;
}

static inline void done_one(Share *sh) { sh->mine++; }

/* The end of the current phase: this thread's items counted, returns once all are done
   (the thread whose count ends the phase wakes sleepers). */
static void end(Share *sh) {
    Shared *s = sh->s;
    for (int u = 0; u < sh->P; u++) sh->base[u] += owned(sh, u);
    sh->end += (int)(sh->chunks * sh->per);
    if (sh->mine && atomic_fetch_add(&s->done, sh->mine) + sh->mine == sh->end && atomic_load(&s->sleepers) > 0) {
#if defined(__linux__)
        syscall(SYS_futex, &s->done, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
#endif
    }
    spin_then_sleep(&s->done, &s->sleepers, sh->end, 0);
}

/* ---- AMX: many rows on Intel's matrix units ---------------------------------------------

   Many-row products are bound by arithmetic (see wide_tiles). Where the CPU has AMX
   (Intel Xeon since Sapphire Rapids), its tile unit multiplies bf16 matrices with fp32 sums
   ~14x faster than AVX-512 fp32 multiply-adds. bf16 keeps 8 significant bits, so the
   operands are split: an fp16 weight w (11 bits) = wh + wl, two bf16, exactly; an fp32 input
   x (24 bits) = xh + xm + xl, three bf16 (each the rounded rest of the one before; exact
   unless a part falls below fp32's normal range, |x| < ~2^-110, which the conversion
   flushes to 0; an infinite x gives NaN). bf16 products are exact in fp32, so x w = xh wh
   + xm wh + xl wh + xh wl + xm wl (+ xl wl, at most 2^-24 of x w, left out) is five tile
   products with fp32 sums: the error is that of an fp32 dot product (a different summation order from wide_tiles', so a row's last bits
   depend on whether its batch was large enough for AMX). native.py writes the planes
   (Linear.wb: per 16 outputs, per 32 inputs, wh then wl, each 16 input pairs x 16 outputs
   x 2, the tile unit's layout); frawd_amx_init asks Linux for the tile registers once. */
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define HAS_AMX 1
#define AMX_CHUNK 128    /* rows split into bf16 at a time (per-thread scratch: 768 KB for 1024 inputs) */
static int amx_ready = 0;
static __thread uint16_t *amx_scratch = NULL; /* this thread's split inputs, freed when it exits */
static __thread size_t amx_scratch_n = 0;
static pthread_key_t amx_key; /* (its destructor frees a thread's scratch: schedulers come and go) */
static pthread_once_t amx_key_once = PTHREAD_ONCE_INIT;
static void amx_key_make(void) { pthread_key_create(&amx_key, free); }

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed)) TileConfig;

int frawd_amx_init(void) {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return 0;
    amx_ready = 1;
    return 1;
}

static inline __m512 bf16_to_fp32(__m256bh v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)v), 16));
}

/* Rows [0, N) of x (K inputs, K % 32 == 0) as three bf16 matrices h, m, l of Np rows (zero
   rows past N), K apart. */
static void split_bf16(const float *x, int64_t ldx, int64_t N, int64_t Np, int64_t K, uint16_t *h, uint16_t *m,
                       uint16_t *l) {
    for (int64_t r = 0; r < Np; r++)
        for (int64_t k = 0; k < K; k += 16) {
            __m512 v = r < N ? _mm512_loadu_ps(x + r * ldx + k) : _mm512_setzero_ps();
            __m256bh vh = _mm512_cvtneps_pbh(v);
            __m512 rest = _mm512_sub_ps(v, bf16_to_fp32(vh)); /* exact */
            __m256bh vm = _mm512_cvtneps_pbh(rest);
            __m256bh vl = _mm512_cvtneps_pbh(_mm512_sub_ps(rest, bf16_to_fp32(vm)));
            _mm256_storeu_si256((__m256i *)(h + r * K + k), (__m256i)vh);
            _mm256_storeu_si256((__m256i *)(m + r * K + k), (__m256i)vm);
            _mm256_storeu_si256((__m256i *)(l + r * K + k), (__m256i)vl);
        }
}

/* One 16 x 16 block of sums (tile register `tile`) into y, through the epilogue. */
#define AMX_STORE(tile, rows_at, col)                                                               \
    do {                                                                                            \
        __asm__ __volatile__("" ::: "memory"); /* (older GCCs' tile asm declares no memory access) */ \
        _tile_stored(tile, sums, 64);                                                               \
        __asm__ __volatile__("" ::: "memory");                                                      \
        for (int r = 0; r < 16 && (rows_at) + r < B; r++) {                                        \
            int64_t o_ = (col);                                                                     \
            if (o_ >= L->out) break;                                                                \
            vf value = *(const vf *)(sums + r * 16) + (L->b ? *(const vf *)(L->b + o_) : splat(0.0f)); \
            epilogue(mode, y + ((rows_at) + r) * ldy + o_, value, L->out - o_);                     \
        }                                                                                           \
    } while (0)

/* Sums of 32 rows x 32 outputs (at r0 of the split rows, outputs 32 pair): four 16 x 16
   sums (tiles 0-3), two input tiles (4, 5), two weight tiles (6, 7). */
static inline __attribute__((always_inline)) void amx_block_32x32(const uint16_t *w0, const uint16_t *w1, const uint16_t *h, const uint16_t *m,
                                   const uint16_t *l, int64_t r0, int64_t K) {
    const int64_t plane = 512;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t c = 0; c < K / 32; c++) {
        const uint16_t *a[3] = {h + r0 * K + 32 * c, m + r0 * K + 32 * c, l + r0 * K + 32 * c};
        const uint16_t *p0 = w0 + 2 * plane * c, *p1 = w1 + 2 * plane * c;
        for (int s = 0; s < 3; s++) { /* x part s times wh, and (s < 2) times wl */
            _tile_loadd(4, a[s], K * 2);
            _tile_loadd(5, a[s] + 16 * K, K * 2);
            _tile_loadd(6, p0, 64);
            _tile_loadd(7, p1, 64);
            _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            if (s < 2) {
                _tile_loadd(6, p0 + plane, 64);
                _tile_loadd(7, p1 + plane, 64);
                _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
                _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
            }
        }
    }
}

/* Sums of 16 rows x 64 outputs (the last 16 rows): four 16 x 16 sums (tiles 0-3), one
   input tile (4), weight tiles 5-7 in turn. w: the first of four 16-output blocks. */
static inline __attribute__((always_inline)) void amx_block_16x64(const uint16_t *w, int64_t block, const uint16_t *h, const uint16_t *m,
                                   const uint16_t *l, int64_t r0, int64_t K) {
    const int64_t plane = 512;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t c = 0; c < K / 32; c++) {
        const uint16_t *a[3] = {h + r0 * K + 32 * c, m + r0 * K + 32 * c, l + r0 * K + 32 * c};
        const uint16_t *p = w + 2 * plane * c;
        for (int s = 0; s < 3; s++)
            for (int lo = 0; lo < (s < 2 ? 2 : 1); lo++) {
                const uint16_t *q = p + lo * plane;
                _tile_loadd(4, a[s], K * 2);
                _tile_loadd(5, q, 64);
                _tile_loadd(6, q + block, 64);
                _tile_loadd(7, q + 2 * block, 64);
                _tile_dpbf16ps(0, 4, 5); _tile_dpbf16ps(1, 4, 6); _tile_dpbf16ps(2, 4, 7);
                _tile_loadd(5, q + 3 * block, 64);
                _tile_dpbf16ps(3, 4, 5);
            }
    }
}

/* wide_tiles on the tile unit, for (chunk of AMX_CHUNK rows, tile) and the next ones this
   thread takes: each owner's tiles chunk by chunk, so a thread splits a chunk's rows into
   bf16 once (again only for what it takes from another's share); by blocks of 32 rows (and
   16 for the rest); then GELU, for EPI_GELU. (noinline: inlined into forward_part, a
   64-token prefill ran 2-6% slower on one thread.) */
static __attribute__((noinline)) void amx_tiles(const Linear *L, const float *x, int64_t ldx, float *y, int64_t ldy,
                                                 int64_t B, Share *share, int64_t chunk, int64_t t, int mode) {
    const int64_t K = L->in, block = 2 * 512 * (K / 32);
    size_t need = (size_t)3 * AMX_CHUNK * K;
    if (amx_scratch_n < need) {
        pthread_once(&amx_key_once, amx_key_make);
        free(amx_scratch);
        amx_scratch = aligned_alloc(64, need * sizeof(uint16_t));
        amx_scratch_n = amx_scratch ? need : 0;
        pthread_setspecific(amx_key, amx_scratch);
        if (!amx_scratch) {
            do {
                int64_t rc = chunk * AMX_CHUNK, n = B - rc < AMX_CHUNK ? B - rc : AMX_CHUNK;
                wide_tiles(L, x + rc * ldx, ldx, y + rc * ldy, ldy, n, t, t + 1, mode == EPI_GELU ? EPI_STORE : mode);
                if (mode == EPI_GELU)
                    gelu_columns(y + rc * ldy, ldy, n, TILE * t, TILE * (t + 1) < L->out ? TILE * (t + 1) : L->out);
                done_one(share);
            } while (take_tile(share, &chunk, &t));
            return;
        }
    }
    /* eight tiles of 16 rows x 64 bytes (static: GCC's ldtilecfg operand names only its first bytes) */
    static const TileConfig cfg = {.palette = 1, .colsb = {64, 64, 64, 64, 64, 64, 64, 64},
                                   .rows = {16, 16, 16, 16, 16, 16, 16, 16}};
    _tile_loadconfig(&cfg);
    float sums[16 * 16] __attribute__((aligned(64)));
    uint16_t *h = amx_scratch, *m = NULL, *l = NULL;
    int64_t split = -1, n = 0, np = 0;
    do {
        int64_t rc = chunk * AMX_CHUNK;
        if (rc != split) {
            n = B - rc < AMX_CHUNK ? B - rc : AMX_CHUNK, np = (n + 15) / 16 * 16;
            m = h + np * K, l = m + np * K;
            split_bf16(x + rc * ldx, ldx, n, np, K, h, m, l);
            __asm__ __volatile__("" ::: "memory"); /* the split rows are in memory before tile loads read them */
            split = rc;
        }
        const uint16_t *w = L->wb + 4 * t * block; /* tile t: 16-output blocks 4t .. 4t + 3 */
        int64_t r0 = 0;
        for (; r0 + 32 <= np; r0 += 32)
            for (int pair = 0; pair < 2; pair++) {
                int64_t out0 = TILE * t + 32 * pair;
                amx_block_32x32(w + 2 * pair * block, w + (2 * pair + 1) * block, h, m, l, r0, K);
                AMX_STORE(0, rc + r0, out0);
                AMX_STORE(1, rc + r0, out0 + 16);
                AMX_STORE(2, rc + r0 + 16, out0);
                AMX_STORE(3, rc + r0 + 16, out0 + 16);
            }
        if (r0 < np) {
            amx_block_16x64(w, block, h, m, l, r0, K);
            AMX_STORE(0, rc + r0, TILE * t);
            AMX_STORE(1, rc + r0, TILE * t + 16);
            AMX_STORE(2, rc + r0, TILE * t + 32);
            AMX_STORE(3, rc + r0, TILE * t + 48);
        }
        if (mode == EPI_GELU)
            gelu_columns(y + rc * ldy, ldy, n, TILE * t, TILE * (t + 1) < L->out ? TILE * (t + 1) : L->out);
        done_one(share);
    } while (take_tile(share, &chunk, &t));
    _tile_release();
}
#else
#define HAS_AMX 0
int frawd_amx_init(void) { return 0; }
#endif

int frawd_has_amx(void) { return HAS_AMX; }

/* What a product reads, made by the thread that takes one of its items, once: a phase
   cannot end while a thread holds an item, so nobody writes what it reads meanwhile (and a
   thread late to the phase takes nothing and reads nothing). */
enum { IN_AS_IS, IN_NORM, IN_LAST, IN_SWIGLU };
typedef struct {
    int kind;      /* IN_NORM: norm(x) of every row (pre-LN; post-LN reads x as is); IN_LAST: each
                      row's last token, after the final norm; IN_SWIGLU: silu(gate) * up */
    const Norm *norm;
    const float *src;
    int64_t ld;    /* src's row stride (IN_SWIGLU: 2H) */
} Input;

static void norm_row(const Model *m, const Norm *n, const float *x, float *y);
static void swiglu_row(const float *g, float *y, int64_t H);

static const float *make_input(const Model *m, const Input *in, float *own, int64_t B, int64_t T) {
    int64_t D = m->d, N = B * T;
    switch (in->kind) {
        case IN_NORM:
            if (!m->pre_norm) return in->src;
            for (int64_t r = 0; r < N; r++) norm_row(m, in->norm, in->src + r * D, own + r * D);
            return own;
        case IN_LAST:
            for (int64_t b = 0; b < B; b++) {
                const float *last = in->src + ((b + 1) * T - 1) * D;
                if (m->final_norm) norm_row(m, &m->final_norm_w, last, own + b * D);
                else memcpy(own + b * D, last, D * sizeof(float));
            }
            return own;
        case IN_SWIGLU:
            for (int64_t n = 0; n < N; n++) swiglu_row(in->src + n * in->ld, own + n * m->ffn, m->ffn);
            return own;
        default: return in->src;
    }
}

/* One phase: y = input @ W^T (+ b) (then GELU, for EPI_GELU) for B rows, whose input has rows
   ldx apart. One row: contiguous runs of tiles, a few per thread (the product runs at the rate
   weights stream in); many rows: a tile each (on AMX, a tile of 128 rows). */
static void linear(Share *share, const Model *m, const Linear *L, const Input *in, float *own, int64_t ldx,
                   float *y, int64_t ldy, int64_t B, int64_t T, int mode) {
    int64_t tiles = (L->out + TILE - 1) / TILE, rows = in->kind == IN_LAST ? B : B * T;
    int store = mode == EPI_GELU ? EPI_STORE : mode;
    int64_t chunks = 1;
#if HAS_AMX
    int amx = rows > 1 && L->amx_rows && rows >= L->amx_rows && L->wb && amx_ready;
    if (amx) chunks = (rows + AMX_CHUNK - 1) / AMX_CHUNK;
#endif
    begin_chunks(share, tiles, chunks);
    int64_t chunk, t;
    if (take_tile(share, &chunk, &t)) {
        const float *x = make_input(m, in, own, B, T);
#if HAS_AMX
        if (amx) {
            amx_tiles(L, x, ldx, y, ldy, rows, share, chunk, t, mode);
            end(share);
            return;
        }
#endif
        do {
            if (rows == 1) one_row_tiles(L, x, y, t, t + 1, store);
            else wide_tiles(L, x, ldx, y, ldy, rows, t, t + 1, store);
            if (mode == EPI_GELU) gelu_columns(y, ldy, rows, t * TILE, (t + 1) * TILE < L->out ? (t + 1) * TILE : L->out);
            done_one(share);
        } while (take_tile(share, &chunk, &t));
    }
    end(share);
}

/* 1 where one-row fp16 products can convert 8 at a time instead of 16 (AVX-512 builds). */
int frawd_has_narrow(void) { return HAS_NARROW; }

/* Every Linear of the model (the LM head last). */
static Linear *model_linear(const Model *m, int64_t i) {
    if (i == 4 * m->n_layer) return (Linear *)&m->head;
    Layer *L = (Layer *)&m->layers[i / 4];
    Linear *kinds[4] = {&L->qkv, &L->proj, &L->up, &L->down};
    return kinds[i % 4];
}

/* Read every Linear of the model in these forms from now on (native.py times them on real
   decode steps and keeps the fastest): the prefetch hint of one-row products and whether
   they convert fp16 8 at a time (fp16 weights in AVX-512 builds), the hint of many-row ones,
   from how many rows products run on AMX (0: never), and whether decode steps prefetch the
   keys and values of their next attention task (prefetch_group). */
void frawd_set_forms(Model *m, int64_t hint, int64_t narrow, int64_t hint_rows, int64_t amx_rows,
                     int64_t kv_prefetch) {
    m->kv_prefetch = kv_prefetch != 0;
    for (int64_t i = 0; i <= 4 * m->n_layer; i++) {
        Linear *L = model_linear(m, i);
        L->amx_rows = L->wb && amx_rows > 0 ? amx_rows : 0;
        L->hint = hint >= PF_NTA && hint <= PF_NONE ? hint : PF_NTA;
        L->narrow = HAS_NARROW && narrow && storage(L) == W_FP16;
        L->hint_rows = hint_rows >= PF_NTA && hint_rows <= PF_NONE ? hint_rows : PF_NTA;
    }
}

/* ---- the team ------------------------------------------------------------------------- */

/* Who runs a forward's parts. On the main thread: OpenMP's team, which is torch's: it spins
   for a while after each parallel region (torch's or ours), and a second team of spinning
   threads on the same cores would collide with it (a 16-row decode ran 10% slower, a decode
   step after a PyTorch prefill waited for a core). On any other thread (a server's scheduler):
   threads of our own, because libgomp keeps a team per calling thread, and once it manages
   more threads than there are cores its idle threads stop spinning after ~100 iterations and
   sleep: every forward then began by waking each helper in the kernel, ~70 us in a VM, a
   fifth of a batch-1 decode step (0.38 ms against 0.31 on the main thread), and the main
   thread's team slowed down the same way (a 1-row step ~13% slower beside an idle server
   scheduler). Our team serves every other thread, one forward at a time (two models served
   by one process take turns instead of splitting the cores), and a helper that finished its
   part keeps looking for the next for IDLE_SPIN_NS before it sleeps, so steps in a loop find
   it awake. A call with one thread runs on the caller alone. */
#define IDLE_SPIN_NS 500000

typedef void (*Part)(void *job, int t, int P);

static struct {
    pthread_mutex_t calls;             /* held for a whole job: one at a time */
    int helpers;                       /* started: threads 1..helpers */
    atomic_int job_no, job_sleepers;   /* bumped to publish a job; helpers asleep waiting for one */
    atomic_int done, done_sleepers;    /* helpers through with the current job; a caller asleep */
    Part part;
    void *job;
    int P;
} crew = {.calls = PTHREAD_MUTEX_INITIALIZER};

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void futex_wake_all(atomic_int *word) {
#if defined(__linux__)
    syscall(SYS_futex, word, FUTEX_WAKE_PRIVATE, 0x7fffffff, NULL, NULL, 0);
#else
    (void)word;
#endif
}

/* Until *word != old: spin for spin_ns, offering the core to other threads now and then,
   then sleep (the waker wakes sleepers; see barrier_wait for why a sleeper counted before
   its check is never missed). */
static void wait_while(atomic_int *word, int old, atomic_int *sleepers, uint64_t spin_ns) {
    uint64_t until = 0;
    for (unsigned i = 1;; i++) {
        if (atomic_load_explicit(word, memory_order_acquire) != old) return;
        cpu_relax();
        if (i % 256 == 0) {
            uint64_t now = now_ns();
            if (!until) until = now + spin_ns;
            else if (now > until) break;
            sched_yield(); /* the core to a thread that wants it (the server's event loop does not preempt) */
        }
    }
    atomic_fetch_add(sleepers, 1);
    while (atomic_load(word) == old) {
#if defined(__linux__)
        syscall(SYS_futex, word, FUTEX_WAIT_PRIVATE, old, NULL, NULL, 0);
#else
        sched_yield();
#endif
    }
    atomic_fetch_sub(sleepers, 1);
}

static int start_no[MAX_TEAM]; /* the job number when helper t was started (written under crew.calls) */

static void *helper_main(void *arg) {
    int t = (int)(intptr_t)arg, seen = start_no[t];
    uint64_t spin = IDLE_SPIN_NS;
    for (;;) {
        wait_while(&crew.job_no, seen, &crew.job_sleepers, spin);
        seen = atomic_load_explicit(&crew.job_no, memory_order_acquire); /* (the caller waits for every
            helper before the next job, so this is the job after the last one seen) */
        int P = crew.P;
        if (t < P) crew.part(crew.job, t, P);
        /* A helper beyond this job's P (an earlier call wanted more threads) only says so, and
           sleeps at once rather than spin beside the ones working. */
        spin = t < P ? IDLE_SPIN_NS : 0;
        atomic_fetch_add(&crew.done, 1);
        if (atomic_load(&crew.done_sleepers) > 0) futex_wake_all(&crew.done);
    }
    return NULL;
}

/* After fork() the child has only the forking thread: no helpers, and libgomp's team of a
   thread that had one lists threads that do not exist (an OpenMP forward would wait for them
   for ever), so a child's forwards all run on a team of its own. */
static int forked_child = 0;

static void crew_after_fork(void) {
    forked_child = 1;
    pthread_mutex_init(&crew.calls, NULL);
    crew.helpers = 0;
    atomic_store(&crew.job_sleepers, 0);
    atomic_store(&crew.done_sleepers, 0);
}

__attribute__((constructor)) static void crew_at_load(void) { pthread_atfork(NULL, NULL, crew_after_fork); }

static int on_main_thread(void) {
    if (forked_child) return 0;
#if defined(__linux__)
    static _Thread_local int main_thread = -1;
    if (main_thread < 0) main_thread = syscall(SYS_gettid) == getpid();
    return main_thread;
#else
    return 1;
#endif
}

/* A helper: detached, no signals (they go to the process's other threads), the default
   scheduling whatever the creating thread runs under (the server's event loop yields to the
   engine: see serve/app.py). */
static int start_helper(int t) {
    pthread_t id;
    pthread_attr_t attr;
    struct sched_param normal = {0};
    sigset_t all, old;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setinheritsched(&attr, PTHREAD_EXPLICIT_SCHED);
    pthread_attr_setschedpolicy(&attr, SCHED_OTHER);
    pthread_attr_setschedparam(&attr, &normal);
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    start_no[t] = atomic_load(&crew.job_no);
    int failed = pthread_create(&id, &attr, helper_main, (void *)(intptr_t)t);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    return failed;
}

/* part(job, t, P) for t = 0..P-1 at once, t = 0 on the calling thread; returns when all are
   done. P is cut to the threads that could be started. */
static void crew_run(Part part, void *job, int P) {
    static int cpus = 0; /* more threads than cores would only wait for each other */
    if (!cpus) cpus = (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (cpus > 0 && P > cpus) P = cpus;
    if (P > MAX_TEAM) P = MAX_TEAM;
    if (P <= 1) {
        part(job, 0, 1);
        return;
    }
    pthread_mutex_lock(&crew.calls);
    while (crew.helpers < P - 1 && start_helper(crew.helpers + 1) == 0) crew.helpers++;
    if (P > crew.helpers + 1) P = crew.helpers + 1;
    crew.part = part, crew.job = job, crew.P = P;
    atomic_store(&crew.done, 0);
    atomic_fetch_add(&crew.job_no, 1); /* publishes the fields above */
    if (atomic_load(&crew.job_sleepers) > 0) futex_wake_all(&crew.job_no);
    part(job, 0, P);
    for (int d; (d = atomic_load(&crew.done)) != crew.helpers;) wait_while(&crew.done, d, &crew.done_sleepers, 100000);
    pthread_mutex_unlock(&crew.calls);
}

/* ---- the other pieces ------------------------------------------------------------------ */

/* sum of (x[i] - c)^p for p = 1 or 2, in VF lanes (a scalar sum is one long chain of adds) */
static inline float moment(const float *x, int64_t D, float c, int p) {
    vf acc = splat(0.0f);
    int64_t i = 0;
    for (; i + VF <= D; i += VF) {
        vf d = *(const vf *)(x + i) - splat(c);
        acc += p == 2 ? d * d : d;
    }
    float s = hsum(acc);
    for (; i < D; i++) s += p == 2 ? (x[i] - c) * (x[i] - c) : x[i] - c;
    return s;
}

static void norm_row(const Model *m, const Norm *n, const float *x, float *y) {
    int64_t D = m->d;
    float mean = m->rmsnorm ? 0.0f : moment(x, D, 0.0f, 1) / (float)D;
    float var = moment(x, D, mean, 2);
    float inv = 1.0f / sqrtf(var / (float)D + m->eps);
    for (int64_t i = 0; i < D; i++) y[i] = (x[i] - mean) * inv * n->w[i] + (n->b ? n->b[i] : 0.0f);
}

/* After a residual add: post-LN normalises the stream in place (rows shared out); pre-LN
   leaves it. */
static void after_residual(Share *share, const Model *m, const Norm *n, float *x, int64_t N) {
    if (m->pre_norm) return;
    begin_tasks(share, N);
    for (int64_t lo, hi; take_tasks(share, &lo, &hi); done_one(share))
        for (int64_t r = lo; r < hi; r++) norm_row(m, n, x + r * m->d, x + r * m->d);
    end(share);
}

/* y[i] = silu(g[i]) * g[H + i] for i < H: SwiGLU's gate times its up projection. */
static void swiglu_row(const float *g, float *y, int64_t H) {
    int64_t i = 0;
    for (; i + VF <= H; i += VF) {
        vf a = *(const vf *)(g + i);
        *(vf *)(y + i) = a * v_sigmoid(a) * *(const vf *)(g + H + i);
    }
    for (; i < H; i++) {
        vf a = splat(g[i]);
        y[i] = g[i] * v_sigmoid(a)[0] * g[H + i];
    }
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

/* ---- an fp16 KV cache ----------------------------------------------------------------

   With kv_half the cache holds keys and values as fp16 (half the memory, and half the
   bytes attention reads: at 32 rows of ~130 slots a decode step of `tiny` reads ~50 MB of
   fp32 keys and values from DRAM). They are rounded to nearest when stored and converted
   exactly to fp32 when read; scores and sums stay fp32. */
#if HAS_FP16
static inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
    return _cvtsh_ss(h);
#else
    __fp16 x;
    memcpy(&x, &h, 2);
    return (float)x;
#endif
}

/* Stores x rounded to fp16; returns 1 when a finite value was too large for fp16 (it would
   be cached as inf, and every later score that reads it NaN): the caller reports it. */
static int to_half(uint16_t *y, const float *x, int64_t n) {
    int64_t i = 0;
    float largest = 0.0f; /* |x| at most; a NaN input is not counted (it is NaN in fp32 too) */
#if defined(__F16C__)
    __m256 top = _mm256_setzero_ps(), magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(x + i);
        top = _mm256_max_ps(_mm256_and_ps(v, magnitude), top); /* (max_ps keeps `top` where v is NaN) */
        _mm_storeu_si128((__m128i *)(y + i), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int k = 0; k < 8; k++) largest = lanes[k] > largest ? lanes[k] : largest;
    for (; i < n; i++) {
        largest = fabsf(x[i]) > largest ? fabsf(x[i]) : largest;
        y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
    }
#else
    for (; i < n; i++) {
        largest = fabsf(x[i]) > largest ? fabsf(x[i]) : largest;
        __fp16 h = (__fp16)x[i];
        memcpy(y + i, &h, 2);
    }
#endif
    return largest >= 65520.0f; /* rounds to inf (65504 is fp16's largest; inf from fp32 too) */
}
#else
static inline float half_to_float(uint16_t h) { (void)h; return 0.0f; } /* never called: python refuses kv_half */
static int to_half(uint16_t *y, const float *x, int64_t n) { (void)y, (void)x, (void)n; return 0; }
#endif

/* VF keys or values of a cache row (fp32 or fp16), as fp32. */
static inline __attribute__((always_inline)) vf load_kv(int half, const void *base, int64_t at) {
    return half ? load_w(W_FP16, (const char *)((const uint16_t *)base + at)) : *(const vf *)((const float *)base + at);
}

static inline __attribute__((always_inline)) float kv_at(int half, const void *base, int64_t at) {
    return half ? half_to_float(((const uint16_t *)base)[at]) : ((const float *)base)[at];
}

/* Token n = (b, t) of the batch, kv head g: RoPE on k and on the query heads sharing g,
   then k and v into cache slot `start[b] + t` of row b. Returns 1 when an fp16 cache could
   not hold them (to_half). */
static int store_group(const Model *m, int64_t n, int64_t T, int64_t g, float *qkv, void *k_cache,
                        void *v_cache, int64_t max_len, const int64_t *start, int64_t position, int half) {
    int64_t hd = m->head_dim, nh = m->n_head, nkv = m->n_kv_head, rep = nh / nkv;
    int64_t b = n / T, slot = start[b] + n % T;
    float *row = qkv + n * (nh + 2 * nkv) * hd;
    float *k = row + (nh + g) * hd, *v = row + (nh + nkv + g) * hd;
    if (m->pos_encoding == POS_ROPE) {
        rope(m, k, position);
        for (int64_t h = g * rep; h < (g + 1) * rep; h++) rope(m, row + h * hd, position);
    }
    int64_t at = ((b * nkv + g) * max_len + slot) * hd;
    if (half) /* fp16 cache: rounded to nearest, as PyTorch's .half() */
        return to_half((uint16_t *)k_cache + at, k, hd) | to_half((uint16_t *)v_cache + at, v, hd);
    memcpy((float *)k_cache + at, k, hd * sizeof(float));
    memcpy((float *)v_cache + at, v, hd * sizeof(float));
    return 0;
}

/* Lanes [0, h) of each block of 2h lanes from x's block, [h, 2h) from y's, each the sum of
   a lane and the one h further on in its source block: one level of transpose_sum. */
#if VF == 16
#define HALVES(h)                                                                                           \
    (h == 8   ? (vfi){0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23}                               \
     : h == 4 ? (vfi){0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27}                            \
     : h == 2 ? (vfi){0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29}                            \
              : (vfi){0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30})
#else
#define HALVES(h)                                                                                           \
    (h == 4 ? (vfi){0, 1, 2, 3, 8, 9, 10, 11} : h == 2 ? (vfi){0, 1, 8, 9, 4, 5, 12, 13}                   \
            : (vfi){0, 8, 2, 10, 4, 12, 6, 14})
#endif
#define FOLD(x, y, h) (__builtin_shuffle(x, y, HALVES(h)) + __builtin_shuffle(x, y, HALVES(h) + (h)))

/* The VF sums of the lanes of p[0], ..., p[VF - 1] as one vector, lane j = sum of p[j]:
   log2(VF) levels of FOLD, each halving the number of vectors and the lanes left to add
   (VF - 1 folds in all, instead of a horizontal sum per vector). Each level interleaves
   its pairs, so the leaves are taken in bit-reversed order to come out in order. */
static inline vf transpose_sum(const vf p[VF]) {
#if VF == 16
    static const int leaf[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};
#else
    static const int leaf[8] = {0, 4, 2, 6, 1, 5, 3, 7};
#endif
    vf a[VF / 2], b[VF / 4];
    for (int i = 0; i < VF / 2; i++) a[i] = FOLD(p[leaf[2 * i]], p[leaf[2 * i + 1]], VF / 2);
    for (int i = 0; i < VF / 4; i++) b[i] = FOLD(a[2 * i], a[2 * i + 1], VF / 4);
#if VF == 16
    for (int i = 0; i < 2; i++) a[i] = FOLD(b[2 * i], b[2 * i + 1], 2);
    return FOLD(a[0], a[1], 1);
#else
    return FOLD(b[0], b[1], 1);
#endif
}

/* q . k[s] for the VF slots [s0, s0 + VF) of a head's cache (K vectors a row), one score
   per lane. Slots past S - 1 repeat slot S - 1 (never read past the cache). */
static inline __attribute__((always_inline)) vf block_scores(int K, int half, const float *q, const void *kc,
                                                             int64_t s0, int64_t S) {
    vf p[VF];
    for (int j = 0; j < VF; j++) {
        int64_t k = (s0 + j < S ? s0 + j : S - 1) * K * VF; /* the slot's first element */
        vf acc = *(const vf *)q * load_kv(half, kc, k);
        for (int i = 1; i < K; i++) acc += *(const vf *)(q + i * VF) * load_kv(half, kc, k + i * VF);
        p[j] = acc;
    }
    return transpose_sum(p);
}

/* block_scores with the row length a constant for the usual head sizes (the sums then stay
   in registers). */
static vf head_scores(int half, const float *q, const void *kc, int64_t hd, int64_t s0, int64_t S) {
#define HEAD_SCORES(H)                                                         \
    switch (hd / VF) {                                                         \
        case 1: return block_scores(1, H, q, kc, s0, S);                       \
        case 2: return block_scores(2, H, q, kc, s0, S);                       \
        case 4: return block_scores(4, H, q, kc, s0, S);                       \
        case 8: return block_scores(8, H, q, kc, s0, S);                       \
        case 16: return block_scores(16, H, q, kc, s0, S);                     \
        default: return block_scores((int)(hd / VF), H, q, kc, s0, S);         \
    }
    if (half) HEAD_SCORES(1)
    HEAD_SCORES(0)
#undef HEAD_SCORES
}

/* y[0 : C VF] = sum over slots s < S of w[s] inv v[s][c0 : c0 + C VF] (rows hd elements
   apart, fp32 or fp16), in C accumulators; slots of weight 0 (masked) are skipped. */
static inline __attribute__((always_inline)) void weighted_values(int C, int half, const float *w, float inv,
                                                                  const void *v, int64_t hd, int64_t S, float *y) {
    vf acc[ACC_MAX];
    for (int j = 0; j < C; j++) acc[j] = splat(0.0f);
    for (int64_t s = 0; s < S; s++) {
        if (w[s] == 0.0f) continue;
        vf ws = splat(w[s] * inv);
        for (int j = 0; j < C; j++) acc[j] += ws * load_kv(half, v, s * hd + j * VF);
    }
    for (int j = 0; j < C; j++) *(vf *)(y + j * VF) = acc[j];
}

/* weighted_values for a chunk of C vectors, C one of the constants below, in either storage. */
static void weighted_chunk(int C, int half, const float *w, float inv, const void *v, int64_t hd, int64_t S,
                           float *y) {
#define WEIGHTED(H)                                                                     \
    switch (C) {                                                                        \
        case 16: weighted_values(ACC_MAX >= 16 ? 16 : 8, H, w, inv, v, hd, S, y); break; \
        case 8: weighted_values(8, H, w, inv, v, hd, S, y); break;                      \
        case 4: weighted_values(4, H, w, inv, v, hd, S, y); break;                      \
        case 2: weighted_values(2, H, w, inv, v, hd, S, y); break;                      \
        default: weighted_values(1, H, w, inv, v, hd, S, y); break;                     \
    }
    if (half) WEIGHTED(1) else WEIGHTED(0)
#undef WEIGHTED
}

/* Token n = (b, t), query head h: softmax(q k^T / sqrt(hd)) v over slots [0, start[b] + t] of
   row b. With padding, a real query skips padding slots; a padding query (whose output
   nobody uses) sees them, so that no softmax is empty (PyTorch's mask does the same).
   scores: max_len + 16 floats of scratch. The scores come VF slots at a time
   (`block_scores`); the last block's lanes past the query's slot are -inf, so every
   block is whole and weighs nothing there. */
static void attend_head(const Model *m, int64_t n, int64_t T, int64_t h, const float *qkv, float *out,
                        const void *k_cache, const void *v_cache, int64_t max_len, const int64_t *start,
                        const uint8_t *valid, int64_t padded, float *scores, int half) {
    int64_t hd = m->head_dim, nh = m->n_head, nkv = m->n_kv_head, g = h / (nh / nkv);
    int64_t b = n / T, slot = start[b] + n % T, S = slot + 1, blocks = (S + VF - 1) / VF;
    const float *q = qkv + n * (nh + 2 * nkv) * hd + h * hd;
    int64_t size = half ? 2 : 4, head = (b * nkv + g) * max_len * hd; /* the head's first element */
    const char *kc = (const char *)k_cache + head * size, *vc = (const char *)v_cache + head * size;
    const uint8_t *ok = valid + b * max_len;
    int mask = padded && ok[slot];
    float scale = 1.0f / sqrtf((float)hd);
    const vf minus_inf = splat(-INFINITY);
    vf best = minus_inf;
    for (int64_t s0 = 0; s0 < S; s0 += VF) {
        vf sc;
        if (hd % VF == 0) {
            sc = head_scores(half, q, kc, hd, s0, S) * splat(scale);
        } else { /* odd head sizes: one slot at a time */
            for (int j = 0; j < VF; j++) {
                int64_t k = (s0 + j < S ? s0 + j : S - 1) * hd;
                float d = 0.0f;
                for (int64_t i = 0; i < hd; i++) d += q[i] * kv_at(half, kc, k + i);
                sc[j] = d * scale;
            }
        }
        if (mask || s0 + VF > S) /* lane by lane only where a lane may be masked (the whole */
            for (int j = 0; j < VF; j++) /* attention over 200 slots: 11% faster than always) */
                if (s0 + j >= S || (mask && !ok[s0 + j])) sc[j] = -INFINITY;
        *(vf *)(scores + s0) = sc;
        best = (vf)((vfi)(sc > best) & (vfi)sc) + (vf)(~(vfi)(sc > best) & (vfi)best); /* lane-wise max */
    }
    float top = best[0];
    for (int j = 1; j < VF; j++) top = best[j] > top ? best[j] : top;
    int64_t wide_end = (S + VF - 1) / VF * VF; /* exp runs VF lanes at a time */
    for (int64_t s = blocks * VF; s < wide_end; s++) scores[s] = -INFINITY;
    vf total = {};
    for (int64_t s = 0; s < wide_end; s += VF) {
        vf x = *(vf *)(scores + s);
        vf e = (vf)((vfi)v_exp(x - splat(top)) & ~(vfi)(x == splat(-INFINITY))); /* masked: exactly 0 */
        *(vf *)(scores + s) = e;
        total += e;
    }
    float sum = hsum(total);
    float *y = out + n * m->d + h * hd;
    float inv_total = 1.0f / sum;
    int64_t c0 = 0;
    if (hd % VF == 0) /* chunks of up to ACC_MAX vectors, each summed in registers over all slots */
        while (c0 < hd) {
            int64_t left = (hd - c0) / VF;
            int C = left >= 16 && ACC_MAX >= 16 ? 16 : left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
            weighted_chunk(C, half, scores, inv_total, vc + c0 * size, hd, S, y + c0);
            c0 += C * VF;
        }
    else {
        memset(y, 0, hd * sizeof(float));
        for (int64_t s2 = 0; s2 < S; s2++) {
            if (scores[s2] == 0.0f) continue;
            float p = scores[s2] * inv_total;
            for (int64_t i = 0; i < hd; i++) y[i] += p * kv_at(half, vc, s2 * hd + i);
        }
    }
}

/* Ask for row b's cached keys and values of kv head g (slots [0, start[b]]) ahead of use
   (into L2). A wide decode step reads them from DRAM (32 rows of ~130 slots: 51 MB of fp32
   in `tiny`, 25 MB of fp16), one head's ~33 KB at a time: asked one task ahead, a 32-row step of `tiny`
   took 8-10% less time on an AMD EPYC. On an Intel Xeon whose L3 holds them (480 MB), the
   prefetches waited for fill buffers and the attention of a 32-row step took 5-27% longer
   with them (two measurements), so whether to prefetch is timed (Model.kv_prefetch). */
static void prefetch_group(const Model *m, int64_t b, int64_t g, const void *k_cache, const void *v_cache,
                           int64_t max_len, const int64_t *start, int half) {
    int64_t hd = m->head_dim, nkv = m->n_kv_head, size = half ? 2 : 4, bytes = (start[b] + 1) * hd * size;
    const char *k = (const char *)k_cache + (b * nkv + g) * max_len * hd * size;
    const char *v = (const char *)v_cache + (b * nkv + g) * max_len * hd * size;
    for (int64_t i = 0; i < bytes; i += 64) {
        __builtin_prefetch(k + i, 0, 2);
        __builtin_prefetch(v + i, 0, 2);
    }
}

/* ---- the forward ----------------------------------------------------------------------- */

/* Floats of scratch `frawd_forward` needs for N = B T tokens, max_len slots, P threads:
   shared activations, then per thread attention scores and a buffer of its own (the
   normalised rows, later the SwiGLU product, that its share of a product reads). */
int64_t frawd_workspace_floats(const Model *m, int64_t N, int64_t max_len, int64_t P) {
    int64_t qkv = (m->n_head + 2 * m->n_kv_head) * m->head_dim;
    int64_t ff = m->swiglu ? 2 * m->ffn : m->ffn, own = N * (m->d > m->ffn ? m->d : m->ffn);
    return N * (2 * m->d + qkv + ff) + P * (max_len + 16 + own + 16) + 64;
}

/* B rows of T new tokens each: token[b, t] at position[b, t] goes to cache slot start[b] + t
   of every layer and attends slots [0, start[b] + t] (masked by valid[b, s] when `padded`).
   Rows may start at different slots (a continuous batch: each row has its own length).
   T = 1 is a decode step; T > 1 a prefill. k_cache[l], v_cache[l]: (B, n_kv_head,
   max_len, head_dim), fp32, or fp16 with kv_half (see "an fp16 KV cache").
   logits: (B, vocab), of each row's last token.
   Returns OK, BAD_TOKEN, BAD_POSITION, BAD_SLOT or BAD_CACHE (nothing computed then), or
   KV_OVERFLOW: a key or value was too large for the fp16 cache (computed, not usable).

   Barriers only where a phase reads what other threads wrote: after each product, and
   between the cache writes and the attention of a prefill. A pre-LN norm and the SwiGLU
   product are computed by every thread for itself; in a decode step (T = 1) a token
   attends only its own row's cache, so one task writes a kv head's slot and then runs
   the query heads that read it. */
/* One forward's arguments and shared state, for its parts (forward_part). */
typedef struct {
    const Model *m;
    int64_t B, T, max_len, padded;
    const int64_t *token, *position, *start;
    void *const *k_cache, *const *v_cache;
    const uint8_t *valid;
    float *logits, *work;
    int half;
    Barrier team;
    int overflow; /* some thread's to_half saw a value fp16 cannot hold */
    Shared *shared;
} Forward;

/* Thread t of P's part of a forward. */
static void forward_part(void *job, int t, int P) {
    Forward *f = job;
    const Model *m = f->m;
    const int64_t B = f->B, T = f->T, N = B * T, max_len = f->max_len, padded = f->padded;
    const int64_t *token = f->token, *position = f->position, *start = f->start;
    void *const *k_cache = f->k_cache, *const *v_cache = f->v_cache;
    const uint8_t *valid = f->valid;
    float *logits = f->logits;
    const int half = f->half;
    int64_t D = m->d, nh = m->n_head, nkv = m->n_kv_head, rep = nh / nkv;
    int64_t qkv_w = (nh + 2 * nkv) * m->head_dim, ff_w = m->swiglu ? 2 * m->ffn : m->ffn;
    int64_t own_floats = N * (D > m->ffn ? D : m->ffn);
    float *x = f->work, *att = x + N * D, *qkv = att + N * D, *ff = qkv + N * qkv_w;
    float *scratch = ff + N * ff_w;
    int too_large = 0;
    Share share = {.s = f->shared, .t = t, .P = P};
    float *scores = scratch + t * (max_len + 16 + own_floats + 16);
    float *own = scores + max_len + 16;
    begin_tasks(&share, N);
    for (int64_t lo, hi; take_tasks(&share, &lo, &hi); done_one(&share)) /* embeddings */
        for (int64_t n = lo; n < hi; n++) {
            const float *e = m->tok + token[n] * m->tok_s0;
            const float *p = m->pos ? m->pos + position[n] * D : NULL;
            for (int64_t i = 0; i < D; i++)
                x[n * D + i] = e[i * m->tok_s1] * m->embed_scale + (p ? p[i] : 0.0f);
        }
    end(&share);
    for (int64_t l = 0; l < m->n_layer; l++) {
        const Layer *L = &m->layers[l];
        /* attention */
        linear(&share, m, &L->qkv, &(Input){IN_NORM, &L->norm1, x, D}, own, D, qkv, qkv_w, B, T, EPI_STORE);
        if (T == 1) { /* store and attend a kv head's group of one row: a task */
            const int64_t tasks = N * nkv;
            begin_tasks(&share, tasks);
            for (int64_t lo, hi; take_tasks(&share, &lo, &hi); done_one(&share))
                for (int64_t task = lo; task < hi; task++) {
                    int64_t n = task / nkv, g = task % nkv;
                    too_large |= store_group(m, n, T, g, qkv, k_cache[l], v_cache[l], max_len, start, position[n],
                                             half);
                    if (m->kv_prefetch && task + 1 < tasks) /* the next task's keys and values, on their way meanwhile */
                        prefetch_group(m, (task + 1) / nkv, (task + 1) % nkv, k_cache[l], v_cache[l], max_len,
                                       start, half);
                    for (int64_t h = g * rep; h < (g + 1) * rep; h++)
                        attend_head(m, n, T, h, qkv, att, k_cache[l], v_cache[l], max_len, start, valid, padded,
                                    scores, half);
                }
            end(&share);
        } else { /* every token's keys and values stored first: later tokens attend earlier ones */
            begin_tasks(&share, N * nkv);
            for (int64_t lo, hi; take_tasks(&share, &lo, &hi); done_one(&share))
                for (int64_t task = lo; task < hi; task++)
                    too_large |= store_group(m, task / nkv, T, task % nkv, qkv, k_cache[l], v_cache[l], max_len,
                                             start, position[task / nkv], half);
            end(&share);
            begin_tasks(&share, N * nh); /* a later token attends more slots: an item takes every n-th task */
            for (int64_t item; (item = take(&share)) >= 0; done_one(&share))
                for (int64_t task = item; task < N * nh; task += share.per) /* (per: the phase's item count) */
                    attend_head(m, task / nh, T, task % nh, qkv, att, k_cache[l], v_cache[l], max_len, start,
                                valid, padded, scores, half);
            end(&share);
        }
        linear(&share, m, &L->proj, &(Input){IN_AS_IS, NULL, att, D}, own, D, x, D, B, T, EPI_ADD); /* x += attention output */
        after_residual(&share, m, &L->norm1, x, N);
        /* MLP */
        linear(&share, m, &L->up, &(Input){IN_NORM, &L->norm2, x, D}, own, D, ff, ff_w, B, T,
               m->swiglu ? EPI_STORE : EPI_GELU);
        Input hidden = m->swiglu ? (Input){IN_SWIGLU, NULL, ff, ff_w} : (Input){IN_AS_IS, NULL, ff, ff_w};
        linear(&share, m, &L->down, &hidden, own, m->swiglu ? m->ffn : ff_w, x, D, B, T, EPI_ADD); /* x += MLP output */
        after_residual(&share, m, &L->norm2, x, N);
    }
    /* each row's last token: final norm (or a copy) into own, then the LM head */
    linear(&share, m, &m->head, &(Input){IN_LAST, NULL, x, D}, own, D, logits, m->vocab, B, T, EPI_STORE);
    if (too_large) __atomic_store_n(&f->overflow, 1, __ATOMIC_RELAXED);
}

int frawd_forward(const Model *m, int64_t B, int64_t T, const int64_t *token, const int64_t *position,
                  void *const *k_cache, void *const *v_cache, int64_t max_len, const int64_t *start,
                  const uint8_t *valid, int64_t padded, float *logits, float *work, int64_t threads,
                  int64_t kv_half) {
    int64_t N = B * T;
    const int half = kv_half != 0;
    if (half && !HAS_FP16) return BAD_CACHE;
    for (int64_t n = 0; n < N; n++) {
        if (token[n] < 0 || token[n] >= m->vocab) return BAD_TOKEN;
        if (position[n] < 0 || position[n] >= m->context) return BAD_POSITION;
    }
    for (int64_t b = 0; b < B; b++)
        if (start[b] < 0 || start[b] + T > max_len) return BAD_SLOT;
    int P = threads < 1 ? 1 : threads > MAX_TEAM ? MAX_TEAM : (int)threads;
    Shared shared; /* (not zeroed whole: P slots are used) */
    atomic_init(&shared.done, 0);
    atomic_init(&shared.sleepers, 0);
    for (int u = 0; u < P; u++) atomic_init(&shared.slot[u].next, 0);
    Forward f = {m, B, T, max_len, padded, token, position, start, k_cache, v_cache, valid, logits, work, half,
                 {0, 0, 0, 0}, 0, &shared};
    if (P > 1 && on_main_thread()) { /* torch's OpenMP team: see "the team" */
#pragma omp parallel num_threads(P)
        {
            atomic_store_explicit(&f.team.P, omp_get_num_threads(), memory_order_relaxed); /* (the same from everyone) */
            forward_part(&f, omp_get_thread_num(), omp_get_num_threads());
            barrier_wait(&f.team); /* everyone done: OpenMP's closing barrier then waits for no one */
        }
    } else {
        crew_run(forward_part, &f, P);
    }
    return f.overflow ? KV_OVERFLOW : OK;
}

/* frawd_forward's arguments in one struct: a caller that makes the same call every step
   (native.py's RowStep, batch-1 decoding) keeps one and changes only what the step changes,
   so crossing from Python costs one pointer instead of fourteen converted arguments. */
typedef struct {
    int64_t B, T;
    const int64_t *token, *position;
    void *const *k_cache, *const *v_cache;
    int64_t max_len;
    const int64_t *start;
    const uint8_t *valid;
    int64_t padded;
    float *logits, *work;
    int64_t threads, kv_half;
} ForwardArgs;

int frawd_forward_args(const Model *m, const ForwardArgs *a) {
    return frawd_forward(m, a->B, a->T, a->token, a->position, a->k_cache, a->v_cache, a->max_len, a->start,
                         a->valid, a->padded, a->logits, a->work, a->threads, a->kv_half);
}
