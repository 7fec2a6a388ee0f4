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
 * re-apply in 28 bytes instead of 24 + 28). */
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

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
    float *sp, *sm, *sv; /* the backup: written ("save") or read ("from"); unused in place */
} adamw_args;

/* IN(a): where the old master / moment element is read: in place, or from the backup. SAVE:
 * what is done with the old values (nothing, or written to the backup). Separate loops, so
 * every pointer stays restrict (the in-place loop reads and writes the same arrays). */
#define IN_PLACE(arr, bak) arr
#define IN_BACKUP(arr, bak) bak
#define NO_SAVE
#define SAVE_OLD sp[i] = p0; sm[i] = m0; sv[i] = v0;

#define ADAMW_LOOP(NAME, GT, LD, BODY_STORE, IN, SAVE)                                        \
    static void NAME(void *ctx, int64_t a, int64_t b) {                                       \
        const adamw_args *x = (const adamw_args *)ctx;                                        \
        float *restrict p = x->p, *restrict m = x->m, *restrict v = x->v;                     \
        float *restrict sp = x->sp, *restrict sm = x->sm, *restrict sv = x->sv;               \
        const GT *restrict g = (const GT *)x->g;                                              \
        const float gs = x->gscale, dc = x->decay, b2 = x->b2, o = x->omb2;                   \
        const float s2 = x->bc2s, eps = x->eps, ns = x->neg_step, w1 = x->lerp_w;             \
        const int small = fabsf(w1) < 0.5f;                                                   \
        const float lc = small ? w1 : w1 - 1.0f;                                              \
        (void)sp; (void)sm; (void)sv;                                                         \
        for (int64_t i = a; i < b; i++) {                                                     \
            const float gi = LD(g[i]) * gs;                                                   \
            const float p0 = IN(p, sp)[i], m0 = IN(m, sm)[i], v0 = IN(v, sv)[i];               \
            SAVE                                                                              \
            const float pi0 = p0 * dc;                                                        \
            const float mi = fmaf(lc, gi - m0, small ? m0 : gi);                              \
            float vi = v0 * b2;                                                               \
            vi = fmaf(o * gi, gi, vi);                                                        \
            const float d = sqrtf(vi) / s2 + eps;                                             \
            const float pi = pi0 + (ns * mi) / d;                                             \
            p[i] = pi;                                                                        \
            m[i] = mi;                                                                        \
            v[i] = vi;                                                                        \
            BODY_STORE                                                                        \
        }                                                                                     \
    }

#define NO_STORE
#define STORE(WT, ST) ((WT *restrict)x->w)[i] = ST(pi);

/* Per gradient dtype: every working-copy dtype, in each of the three forms (0 in place, 1 save, 2 from). */
#define ADAMW_FORMS(NAME, GT, LD, BODY_STORE)                                                 \
    ADAMW_LOOP(NAME##_0, GT, LD, BODY_STORE, IN_PLACE, NO_SAVE)                               \
    ADAMW_LOOP(NAME##_1, GT, LD, BODY_STORE, IN_PLACE, SAVE_OLD)                              \
    ADAMW_LOOP(NAME##_2, GT, LD, BODY_STORE, IN_BACKUP, NO_SAVE)

#define ADAMW_FOR_GRAD(SUFFIX, GT, LD)                                                        \
    ADAMW_FORMS(adamw_##SUFFIX##_none, GT, LD, NO_STORE)                                      \
    ADAMW_FORMS(adamw_##SUFFIX##_f32, GT, LD, STORE(float, st_f32))                           \
    ADAMW_FORMS(adamw_##SUFFIX##_bf16, GT, LD, STORE(uint16_t, st_bf16))                      \
    ADAMW_F16_WORK(SUFFIX, GT, LD)

#ifndef XPU_NO_F16
#define ADAMW_F16_WORK(SUFFIX, GT, LD) ADAMW_FORMS(adamw_##SUFFIX##_f16, GT, LD, STORE(_Float16, st_f16))
ADAMW_FOR_GRAD(f32, float, ld_f32)
ADAMW_FOR_GRAD(bf16, uint16_t, ld_bf16)
ADAMW_FOR_GRAD(f16, _Float16, ld_f16)
#else
#define ADAMW_F16_WORK(SUFFIX, GT, LD)
ADAMW_FOR_GRAD(f32, float, ld_f32)
ADAMW_FOR_GRAD(bf16, uint16_t, ld_bf16)
#endif

typedef void (*range_fn)(void *, int64_t, int64_t);

typedef struct {
    range_fn fn;
    void *ctx;
    int64_t a, b;
} job;

static void *run_job(void *j) {
    job *x = (job *)j;
    x->fn(x->ctx, x->a, x->b);
    return NULL;
}

#define MAX_THREADS 256
#define MIN_PER_THREAD 32768 /* below this a thread costs more than it saves */

/* Runs fn over [0, n) in up to `threads` contiguous parts of at least `least` items (rounded
 * to multiples of `align`), one per thread (this one included). */
static void parallel_over(range_fn fn, void *ctx, int64_t n, int threads, int64_t least, int64_t align) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if ((int64_t)threads * least > n) threads = (int)(n / least);
    if (threads < 2) {
        fn(ctx, 0, n);
        return;
    }
    pthread_t tid[MAX_THREADS];
    int started[MAX_THREADS];
    job jobs[MAX_THREADS];
    int64_t per = ((n + threads - 1) / threads + align - 1) / align * align;
    for (int k = 0; k < threads; k++) {
        int64_t a = k * per, b = a + per < n ? a + per : n;
        jobs[k] = (job){fn, ctx, a < n ? a : n, b};
        started[k] = k > 0 && pthread_create(&tid[k], NULL, run_job, &jobs[k]) == 0;
    }
    run_job(&jobs[0]);
    for (int k = 1; k < threads; k++) {
        if (started[k])
            pthread_join(tid[k], NULL);
        else
            run_job(&jobs[k]); /* no thread to spare: do its part here */
    }
}

/* Elementwise loops: parts of whole cache lines (64 elements). */
static void parallel(range_fn fn, void *ctx, int64_t n, int threads) {
    parallel_over(fn, ctx, n, threads, MIN_PER_THREAD, 64);
}

#define FORM(NAME) (form == 0 ? NAME##_0 : form == 1 ? NAME##_1 : NAME##_2)

static range_fn adamw_fn(int gkind, int wkind, int form) {
    if (form < 0 || form > 2) return NULL;
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
 * master and moments to bp/bm/bv, 2 read them from bp/bm/bv (the backup; unused in form 0).
 * Returns 0, or -1 for an unbuilt dtype pair or form. */
int xpu_adamw(int gkind, int wkind, float *p, const void *g, float *m, float *v, void *w, int64_t n,
              const float *hp, int threads, int form, float *bp, float *bm, float *bv) {
    range_fn fn = adamw_fn(gkind, wkind, form);
    if (!fn) return -1;
    adamw_args x = {p, m, v, g, w, hp[0], hp[1], hp[2], hp[3], hp[4], hp[5], hp[6], hp[7], bp, bm, bv};
    parallel(fn, &x, n, threads);
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
int xpu_accumulate(int gkind, float *acc, const void *g, int64_t n, int threads) {
    acc_args x = {acc, g};
    range_fn fn = gkind == 1 ? acc_bf16 : NULL;
#ifndef XPU_NO_F16
    if (gkind == 2) fn = acc_f16;
#endif
    if (!fn) return -1;
    parallel(fn, &x, n, threads);
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
