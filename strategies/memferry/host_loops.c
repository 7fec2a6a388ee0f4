/* MemFerry's host optimizer loops: AdamW in one pass over a unit, and fp32 accumulation of
 * 16-bit gradients. Built by host_loops.py with the machine's C compiler and called through
 * ctypes, which releases the GIL for the whole call (the training thread keeps issuing device
 * work meanwhile); Inductor's compiled CPU kernels hold it.
 *
 * The AdamW arithmetic is torch.optim.AdamW's single-tensor path, op for op, in fp32:
 *   p *= 1 - lr * wd;  m = lerp(m, g, 1 - b1);  v = v * b2;  v = addcmul(v, g, g, 1 - b2);
 *   d = sqrt(v) / sqrt(bc2) + eps;  p = addcdiv(p, m, d, -lr / bc1)
 * rounded as ATen's vectorised CPU kernels round them: lerp as fma(w, g - m, m), addcmul as
 * fma((1 - b2) * g, g, v), addcdiv as p + (s * m) / d. Built with -ffp-contract=off so the
 * compiler fuses nothing else. Dtype kinds: 0 fp32, 1 bf16, 2 fp16;
 * a work kind of -1 means the fp32 master is the working copy.
 *
 * Speculative clipping (speculative_clip.py) needs two more forms of the same update, each one
 * sweep: "save" writes the old master and moments to a backup as it reads them (40 bytes per
 * bf16 parameter instead of a 24-byte copy then the 28-byte update), and "from" reads the old
 * values from that backup instead of from the master and moments (a rollback: restore and
 * re-apply in 28 bytes instead of 24 + 28; or an update into a spare, which leaves the old state
 * as it was). fp16 gradients or working copies run scalar where GCC has no vector type for
 * _Float16 (GCC 12 on x86-64); bf16 and fp32 vectorise in every form.
 *
 * A split update (split_update.py) needs a third kind: "copy first" computes the update as the
 * others do but writes only the working copy and the step's whole gradient in fp32 (the sum it
 * read, to a buffer of its own); a later in-place update from it writes the master and moments. */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

static inline float ld_f32(float x) { return x; }
static inline float st_f32(float x) { return x; }
static inline float ld_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static inline uint16_t st_bf16(float f) { /* round to nearest even, NaN -> 0x7fc0: as c10::BFloat16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
#ifndef XPU_NO_F16
static inline float ld_f16(_Float16 h) { return (float)h; }
static inline _Float16 st_f16(float f) { return (_Float16)f; }
#endif

typedef struct {
    float *p, *m, *v;
    const void *g;
    void *w;
    float gscale, decay, lerp_w, b2, omb2, bc2s, eps, neg_step;
    float *sp, *sm, *sv; /* the backup: written ("save") or read ("from"); unused in place; sp: the
                          * fp32 gradient written by forms 5-7 (NULL: not written) */
    const float *acc;    /* forms 3 and 4: the fp32 sum of earlier micro-batches (form 3) */
    const void *g1;      /* forms 3 and 4: the step's last micro-batch (g is the one before) */
} adamw_args;

/* Stores no loop reads back (the backup a "save" writes, the new state a "from" writes, the
 * working copy the device loads next) go out with non-temporal stores where the target has
 * them: a plain store to a line not in cache first reads it (read-for-ownership), 12 bytes more
 * per parameter for an out-of-place master and moments. The fence makes them visible before the
 * thread that wrote them reports its part done (the team's mutex then orders them for the caller). */
#if defined(__SSE2__)
#include <emmintrin.h>
static inline void stream_out(void *dst, const void *src, int64_t nbytes) {
    char *d = (char *)dst;
    const char *s = (const char *)src;
    int64_t head = (int64_t)((16 - ((uintptr_t)d & 15)) & 15);
    if (head > nbytes) head = nbytes;
    memcpy(d, s, (size_t)head);
    d += head, s += head, nbytes -= head;
    for (; nbytes >= 16; nbytes -= 16, d += 16, s += 16)
        _mm_stream_si128((__m128i *)d, _mm_loadu_si128((const __m128i *)s));
    memcpy(d, s, (size_t)nbytes);
}
static inline void stream_fence(void) { _mm_sfence(); }
#else
static inline void stream_out(void *dst, const void *src, int64_t nbytes) { memcpy(dst, src, (size_t)nbytes); }
static inline void stream_fence(void) {}
#endif

/* Elements per tile: a tile's new values (or old ones, for a save) are computed into buffers
 * that stay in the first-level cache, then streamed out. */
#define TILE 512

/* FORM 0 updates in place; 1 also saves the old master and moments to the backup; 2 reads the
 * old values from the backup and writes the new ones to the master and moments (a rollback's
 * re-application, or an update into a spare); 3 and 4 update in place from the step's last two
 * micro-batches summed as they are read, 3: (acc + g) + g1, 4: g + g1, added in the order
 * xpu_accumulate2 adds them (bit-equal to summing first, in 8 bytes per parameter fewer than
 * that pass's write and re-read of the fp32 sum); 8 from the fp32 sum and the last micro-batch,
 * acc + g, as xpu_accumulate adds them; 5, 6, 7 and 9 are 0, 3, 4 and 8 copying first: they write
 * the working copy and the fp32 gradient (to sp), not the master and moments (see the top of the
 * file). HAS_W: the working copy (type WT) is written.
 * GCC ivdep: no element depends on another, so the loop vectorises without the run-time alias
 * checks GCC would otherwise give up on for this many arrays (it had, in forms 1 and 2). */
#define TRIPLE(F) ((F) == 3 || (F) == 6)   /* the gradient is (acc + g) + g1 */
#define PAIR(F) ((F) == 4 || (F) == 7)     /* the gradient is g + g1 */
#define SUM1(F) ((F) == 8 || (F) == 9)     /* the gradient is acc + g */
#define FIRST(F) ((F) >= 5 && (F) != 8)    /* copying first: no master or moments written */
#define ADAMW_LOOP(NAME, GT, LD, WT, ST, HAS_W, FORM)                                         \
    static void NAME(void *ctx, int64_t a, int64_t b) {                                       \
        const adamw_args *x = (const adamw_args *)ctx;                                        \
        float *restrict p = x->p, *restrict m = x->m, *restrict v = x->v;                     \
        const GT *restrict g = (const GT *)x->g, *restrict g1 = (const GT *)x->g1;            \
        const float *restrict acc = x->acc;                                                   \
        const float gs = x->gscale, dc = x->decay, b2 = x->b2, o = x->omb2;                   \
        const float s2 = x->bc2s, eps = x->eps, ns = x->neg_step, w1 = x->lerp_w;             \
        const int small = fabsf(w1) < 0.5f;                                                   \
        const float lc = small ? w1 : w1 - 1.0f;                                              \
        float tp[TILE], tm[TILE], tv[TILE], ts[TILE];                                         \
        WT tw[TILE];                                                                          \
        for (int64_t t = a; t < b; t += TILE) {                                               \
            const int64_t n = b - t < TILE ? b - t : TILE;                                    \
            const float *rp = (FORM == 2 ? x->sp : p) + t, *rm = (FORM == 2 ? x->sm : m) + t; \
            const float *rv = (FORM == 2 ? x->sv : v) + t;                                    \
            const int tiles = FORM == 2 || FIRST(FORM); /* new state kept in the tiles */      \
            float *wp = tiles ? tp : p + t, *wm = tiles ? tm : m + t;                         \
            float *wv = tiles ? tv : v + t;                                                   \
            const GT *gt = g + t, *gt1 = TRIPLE(FORM) || PAIR(FORM) ? g1 + t : g;             \
            const float *at = TRIPLE(FORM) || SUM1(FORM) ? acc + t : p;                       \
            _Pragma("GCC ivdep") for (int64_t j = 0; j < n; j++) {                            \
                float gsum = TRIPLE(FORM) || SUM1(FORM) ? at[j] : LD(gt[j]);                  \
                if (TRIPLE(FORM) || SUM1(FORM)) gsum += LD(gt[j]);                            \
                if (TRIPLE(FORM) || PAIR(FORM)) gsum += LD(gt1[j]);                           \
                if (FIRST(FORM)) ts[j] = gsum;                                                \
                const float gi = gsum * gs;                                                   \
                const float p0 = rp[j], m0 = rm[j], v0 = rv[j];                               \
                if (FORM == 1) {                                                              \
                    tp[j] = p0;                                                               \
                    tm[j] = m0;                                                               \
                    tv[j] = v0;                                                               \
                }                                                                             \
                const float pi0 = p0 * dc;                                                    \
                const float mi = fmaf(lc, gi - m0, small ? m0 : gi);                          \
                float vi = v0 * b2;                                                           \
                vi = fmaf(o * gi, gi, vi);                                                    \
                const float d = sqrtf(vi) / s2 + eps;                                         \
                const float pi = pi0 + (ns * mi) / d;                                         \
                wp[j] = pi;                                                                   \
                wm[j] = mi;                                                                   \
                wv[j] = vi;                                                                   \
                if (HAS_W) tw[j] = ST(pi);                                                    \
            }                                                                                 \
            if (FORM == 1 || FORM == 2) {                                                     \
                float *dp = FORM == 1 ? x->sp : p, *dm = FORM == 1 ? x->sm : m;               \
                float *dv = FORM == 1 ? x->sv : v;                                            \
                stream_out(dp + t, tp, n * 4);                                                \
                stream_out(dm + t, tm, n * 4);                                                \
                stream_out(dv + t, tv, n * 4);                                                \
            }                                                                                 \
            if (FIRST(FORM) && x->sp) stream_out(x->sp + t, ts, n * 4);                      \
            if (HAS_W) stream_out((WT *)x->w + t, tw, n * (int64_t)sizeof(WT));               \
        }                                                                                     \
        stream_fence();                                                                       \
    }

/* Per gradient dtype: every working-copy dtype, in each of the ten forms (0 in place, 1 save,
 * 2 from, 3 and 4 from a pair, 8 from the sum and one more, 5-7 and 9 copying first). */
#define ADAMW_FORMS(NAME, GT, LD, WT, ST, HAS_W)                                              \
    ADAMW_LOOP(NAME##_0, GT, LD, WT, ST, HAS_W, 0)                                            \
    ADAMW_LOOP(NAME##_1, GT, LD, WT, ST, HAS_W, 1)                                            \
    ADAMW_LOOP(NAME##_2, GT, LD, WT, ST, HAS_W, 2)                                            \
    ADAMW_LOOP(NAME##_3, GT, LD, WT, ST, HAS_W, 3)                                            \
    ADAMW_LOOP(NAME##_4, GT, LD, WT, ST, HAS_W, 4)                                            \
    ADAMW_LOOP(NAME##_5, GT, LD, WT, ST, HAS_W, 5)                                            \
    ADAMW_LOOP(NAME##_6, GT, LD, WT, ST, HAS_W, 6)                                            \
    ADAMW_LOOP(NAME##_7, GT, LD, WT, ST, HAS_W, 7)                                            \
    ADAMW_LOOP(NAME##_8, GT, LD, WT, ST, HAS_W, 8)                                            \
    ADAMW_LOOP(NAME##_9, GT, LD, WT, ST, HAS_W, 9)

#define ADAMW_FOR_GRAD(SUFFIX, GT, LD)                                                        \
    ADAMW_FORMS(adamw_##SUFFIX##_none, GT, LD, float, st_f32, 0)                              \
    ADAMW_FORMS(adamw_##SUFFIX##_f32, GT, LD, float, st_f32, 1)                               \
    ADAMW_FORMS(adamw_##SUFFIX##_bf16, GT, LD, uint16_t, st_bf16, 1)                          \
    ADAMW_F16_WORK(SUFFIX, GT, LD)

#ifndef XPU_NO_F16
#define ADAMW_F16_WORK(SUFFIX, GT, LD) ADAMW_FORMS(adamw_##SUFFIX##_f16, GT, LD, _Float16, st_f16, 1)
ADAMW_FOR_GRAD(f32, float, ld_f32)
ADAMW_FOR_GRAD(bf16, uint16_t, ld_bf16)
ADAMW_FOR_GRAD(f16, _Float16, ld_f16)
#else
#define ADAMW_F16_WORK(SUFFIX, GT, LD)
ADAMW_FOR_GRAD(f32, float, ld_f32)
ADAMW_FOR_GRAD(bf16, uint16_t, ld_bf16)
#endif

#include "host_team.h" /* parallel_over: the thread team every loop below runs on */

/* Elementwise loops: parts of whole cache lines (64 elements). */
static void parallel(range_fn fn, void *ctx, int64_t n, int threads) {
    parallel_over(fn, ctx, n, threads, MIN_PER_THREAD, 64);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* parallel(), and (unless seconds is NULL) how long it ran, clocked inside the call, so that the
 * caller can tell the loop from what the call took around it (taking the GIL back on return). */
static void timed_parallel(range_fn fn, void *ctx, int64_t n, int threads, double *seconds) {
    const double t0 = now_s();
    parallel(fn, ctx, n, threads);
    if (seconds) *seconds = now_s() - t0;
}

#define FORM(NAME)                                                                            \
    (form == 0 ? NAME##_0 : form == 1 ? NAME##_1 : form == 2 ? NAME##_2 : form == 3 ? NAME##_3   \
     : form == 4 ? NAME##_4 : form == 5 ? NAME##_5 : form == 6 ? NAME##_6 : form == 7 ? NAME##_7   \
     : form == 8 ? NAME##_8 : NAME##_9)

static range_fn adamw_fn(int gkind, int wkind, int form) {
    if (form < 0 || form > 9) return NULL;
#define PICK(SUFFIX)                                                                          \
    switch (wkind) {                                                                          \
    case -1: return FORM(adamw_##SUFFIX##_none);                                              \
    case 0: return FORM(adamw_##SUFFIX##_f32);                                                \
    case 1: return FORM(adamw_##SUFFIX##_bf16);                                               \
    PICK_F16_WORK(SUFFIX)                                                                     \
    default: return NULL;                                                                     \
    }
#ifndef XPU_NO_F16
#define PICK_F16_WORK(SUFFIX) case 2: return FORM(adamw_##SUFFIX##_f16);
#else
#define PICK_F16_WORK(SUFFIX)
#endif
    switch (gkind) {
    case 0: PICK(f32)
    case 1: PICK(bf16)
#ifndef XPU_NO_F16
    case 2: PICK(f16)
#endif
    default: return NULL;
    }
}

/* One AdamW step over n elements. hp: gradient scale, 1 - lr*wd, 1 - beta1, beta2, 1 - beta2,
 * sqrt(bias_correction2), eps, -lr/bias_correction1. form: 0 in place, 1 also save the old
 * master and moments to bp/bm/bv, 2 read them from bp/bm/bv (the backup; unused otherwise),
 * 3 the gradient is (acc + g) + g1, 4 it is g + g1 (acc and g1 unused in forms 0-2), 5-7 are
 * 0, 3 and 4 writing the working copy and the fp32 gradient to bp (if not NULL), not p, m, v.
 * seconds: as timed_parallel's. Returns 0, or -1 for an unbuilt dtype pair or form. */
int xpu_adamw(int gkind, int wkind, float *p, const void *g, float *m, float *v, void *w, int64_t n,
              const float *hp, int threads, int form, float *bp, float *bm, float *bv, const float *acc,
              const void *g1, double *seconds) {
    range_fn fn = adamw_fn(gkind, wkind, form);
    if (!fn) return -1;
    adamw_args x = {p, m, v, g, w, hp[0], hp[1], hp[2], hp[3], hp[4], hp[5], hp[6], hp[7], bp, bm, bv, acc, g1};
    timed_parallel(fn, &x, n, threads, seconds);
    return 0;
}

/* Sum of squares in fp64, in fixed blocks whose partial sums are added in order: the same
 * result for any thread count. Eight accumulators per block, so the loop is not one chain. */
#define NORM_BLOCK 65536

typedef struct {
    const void *g;
    int gkind;
    int64_t n;
    double *part;
} norm_args;

#define SQ_BLOCK(GT, LD)                                                                      \
    {                                                                                         \
        const GT *restrict g = (const GT *)x->g;                                              \
        double acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};                                             \
        int64_t i = lo;                                                                       \
        for (; i + 8 <= hi; i += 8)                                                           \
            for (int k = 0; k < 8; k++) {                                                     \
                const double e = (double)LD(g[i + k]);                                        \
                acc[k] += e * e;                                                              \
            }                                                                                 \
        for (; i < hi; i++) {                                                                 \
            const double e = (double)LD(g[i]);                                                \
            acc[0] += e * e;                                                                  \
        }                                                                                     \
        x->part[blk] = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])); \
    }

static void sq_blocks(void *ctx, int64_t a, int64_t b) { /* a, b: block numbers */
    const norm_args *x = (const norm_args *)ctx;
    for (int64_t blk = a; blk < b; blk++) {
        const int64_t lo = blk * NORM_BLOCK, hi = lo + NORM_BLOCK < x->n ? lo + NORM_BLOCK : x->n;
        switch (x->gkind) {
        case 0: SQ_BLOCK(float, ld_f32) break;
        case 1: SQ_BLOCK(uint16_t, ld_bf16) break;
#ifndef XPU_NO_F16
        case 2: SQ_BLOCK(_Float16, ld_f16) break;
#endif
        default: break;
        }
    }
}

/* The sum of g's squares over n elements into *out (fp64). part: scratch of ceil(n / 65536)
 * doubles. Returns 0, or -1 for an unbuilt kind. */
int xpu_sqnorm(int gkind, const void *g, int64_t n, int threads, double *part, double *out) {
#ifdef XPU_NO_F16
    if (gkind == 2) return -1;
#endif
    if (gkind < 0 || gkind > 2) return -1;
    const int64_t blocks = (n + NORM_BLOCK - 1) / NORM_BLOCK;
    norm_args x = {g, gkind, n, part};
    parallel_over(sq_blocks, &x, blocks, threads, 1, 1); /* a part: whole blocks */
    double total = 0.0;
    for (int64_t k = 0; k < blocks; k++) total += part[k];
    *out = total;
    return 0;
}

typedef struct {
    float *acc;
    const void *g;
} acc_args;

static void acc_bf16(void *ctx, int64_t a, int64_t b) {
    const acc_args *x = (const acc_args *)ctx;
    float *restrict acc = x->acc;
    const uint16_t *restrict g = (const uint16_t *)x->g;
    for (int64_t i = a; i < b; i++) acc[i] += ld_bf16(g[i]);
}

#ifndef XPU_NO_F16
static void acc_f16(void *ctx, int64_t a, int64_t b) {
    const acc_args *x = (const acc_args *)ctx;
    float *restrict acc = x->acc;
    const _Float16 *restrict g = (const _Float16 *)x->g;
    for (int64_t i = a; i < b; i++) acc[i] += ld_f16(g[i]);
}
#endif

/* acc += g over n elements, g 16-bit (kind 1 bf16, 2 fp16). Returns 0, or -1 for an unbuilt kind. */
int xpu_accumulate(int gkind, float *acc, const void *g, int64_t n, int threads, double *seconds) {
    acc_args x = {acc, g};
    range_fn fn = gkind == 1 ? acc_bf16 : NULL;
#ifndef XPU_NO_F16
    if (gkind == 2) fn = acc_f16;
#endif
    if (!fn) return -1;
    timed_parallel(fn, &x, n, threads, seconds);
    return 0;
}

typedef struct {
    float *acc;
    const void *g0;
    const void *g1;
    int init;
} acc2_args;

/* Two micro-batches in one pass, in the order two passes of acc += g would add them (bit-equal):
   acc = g0 + g1 (init) or acc = (acc + g0) + g1. */
#define ACC2(name, T, LD)                                                                   \
    static void name(void *ctx, int64_t a, int64_t b) {                                     \
        const acc2_args *x = (const acc2_args *)ctx;                                        \
        float *restrict acc = x->acc;                                                       \
        const T *restrict g0 = (const T *)x->g0;                                            \
        const T *restrict g1 = (const T *)x->g1;                                            \
        if (x->init) {                                                                      \
            for (int64_t i = a; i < b; i++) { float s = LD(g0[i]); s += LD(g1[i]); acc[i] = s; } \
        } else {                                                                            \
            for (int64_t i = a; i < b; i++) { float s = acc[i]; s += LD(g0[i]); s += LD(g1[i]); acc[i] = s; } \
        }                                                                                   \
    }
ACC2(acc2_bf16, uint16_t, ld_bf16)
#ifndef XPU_NO_F16
ACC2(acc2_f16, _Float16, ld_f16)
#endif

/* acc (+)= g0 + g1 over n elements (see ACC2), g0 and g1 16-bit of one kind. Returns 0, or -1 for an unbuilt kind. */
int xpu_accumulate2(int gkind, float *acc, const void *g0, const void *g1, int64_t n, int threads, int init,
                    double *seconds) {
    acc2_args x = {acc, g0, g1, init};
    range_fn fn = gkind == 1 ? acc2_bf16 : NULL;
#ifndef XPU_NO_F16
    if (gkind == 2) fn = acc2_f16;
#endif
    if (!fn) return -1;
    timed_parallel(fn, &x, n, threads, seconds);
    return 0;
}

/* The fp16 kinds this build has (1) or lacks (0): a compiler without _Float16 builds without them. */
int xpu_has_f16(void) {
#ifndef XPU_NO_F16
    return 1;
#else
    return 0;
#endif
}
