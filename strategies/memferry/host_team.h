/* The thread team host_loops.c runs its loops on (included by it alone: its functions are
 * static). parallel_over(fn, ctx, n, threads, least, align) runs fn over [0, n) on up to `threads`
 * threads, the caller's included, in chunks each thread takes in turn. No OpenMP: a second OpenMP
 * runtime beside torch's would fight it for the cores. */
#ifndef XPU_HOST_TEAM_H
#define XPU_HOST_TEAM_H

#include <pthread.h>
#include <stdint.h>

typedef void (*range_fn)(void *, int64_t, int64_t);

/* The items of one call, handed out in chunks: each thread takes the next chunk until none is
 * left. Fixed contiguous parts, one per thread, left the fast threads idle behind the slowest
 * one at the end of every call; that tail cost an update in three pieces 20 % more per parameter
 * than the same update in one call on the H200's host (15 threads), and 4 % on two cores. With
 * chunks of about 1/16 of a thread's share the tail is at most one chunk. Which thread runs an
 * item changes no result: every loop here writes each item (element, or norm block) alone. */
typedef struct {
    range_fn fn;
    void *ctx;
    int64_t n, chunk;
    int64_t next; /* the first item not yet taken (atomic) */
} chunks;

static void take_chunks(chunks *c) {
    for (;;) {
        const int64_t a = __atomic_fetch_add(&c->next, c->chunk, __ATOMIC_RELAXED);
        if (a >= c->n) return;
        c->fn(c->ctx, a, a + c->chunk < c->n ? a + c->chunk : c->n);
    }
}

#define MAX_THREADS 256
#define MIN_PER_THREAD 32768 /* below this a thread costs more than it saves */

/* A team of worker threads kept between calls: the host optimizer calls these loops once per
 * piece of an update (about 2 ms each when updates yield to one another), and creating and
 * joining a dozen threads per call cost a fifth of that on the H200's host. Workers sleep on a
 * condition variable between calls; one call dispatches at a time (callers queue on
 * `dispatch_mu`). The workers a call wants take chunks of it beside the caller. Completion is
 * counted under `mu`, whose release and
 * acquire order the workers' writes (their non-temporal stores are fenced inside each loop)
 * before the caller's return. A forked child starts with no workers (pthread_atfork). */
static struct {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    int size;           /* workers started: ids 1..size */
    unsigned long gen;  /* calls dispatched so far */
    int want, left;     /* this call's workers (ids 1..want), and how many of them are still running */
    chunks *call;       /* this call's items */
    unsigned long born[MAX_THREADS]; /* the call count when worker k started */
} team = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER};
static pthread_mutex_t dispatch_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void *team_worker(void *arg) {
    int id = (int)(intptr_t)arg;
    pthread_mutex_lock(&team.mu);
    unsigned long seen = team.born[id];
    for (;;) {
        while (team.gen == seen) pthread_cond_wait(&team.work, &team.mu);
        seen = team.gen;
        if (id > team.want) continue; /* not part of this call */
        chunks *c = team.call;
        pthread_mutex_unlock(&team.mu);
        take_chunks(c);
        pthread_mutex_lock(&team.mu);
        if (--team.left == 0) pthread_cond_signal(&team.done);
    }
    return NULL;
}

static void team_after_fork(void) { /* the child has none of the parent's threads */
    pthread_mutex_init(&team.mu, NULL);
    pthread_cond_init(&team.work, NULL);
    pthread_cond_init(&team.done, NULL);
    pthread_mutex_init(&dispatch_mu, NULL);
    team.size = 0;
}

static void team_register(void) { pthread_atfork(NULL, NULL, team_after_fork); }

/* Start workers up to `n` (fewer if the system refuses); returns how many there are. Called with
 * dispatch_mu held, so no call is under way. */
static int team_grow(int n) {
    pthread_once(&atfork_once, team_register);
    while (team.size < n) {
        int id = team.size + 1;
        pthread_t tid;
        pthread_attr_t attr;
        team.born[id] = team.gen;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int failed = pthread_create(&tid, &attr, team_worker, (void *)(intptr_t)id);
        pthread_attr_destroy(&attr);
        if (failed) break;
        team.size = id;
    }
    return team.size;
}

/* Runs fn over [0, n) on up to `threads` threads (this one included), each given at least
 * `least` items' worth, in chunks of a multiple of `align` items (see `chunks`). */
static void parallel_over(range_fn fn, void *ctx, int64_t n, int threads, int64_t least, int64_t align) {
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if ((int64_t)threads * least > n) threads = (int)(n / least);
    if (threads < 2) {
        fn(ctx, 0, n);
        return;
    }
    int64_t chunk = (n + threads * 16 - 1) / (threads * 16);
    if (chunk < least / 4) chunk = least / 4;
    chunk = (chunk + align - 1) / align * align;
    chunks c = {fn, ctx, n, chunk, 0};
    pthread_mutex_lock(&dispatch_mu);
    int helpers = team_grow(threads - 1);
    if (helpers > threads - 1) helpers = threads - 1;
    pthread_mutex_lock(&team.mu);
    team.call = &c;
    team.want = team.left = helpers;
    team.gen++;
    pthread_cond_broadcast(&team.work);
    pthread_mutex_unlock(&team.mu);
    take_chunks(&c); /* with fewer workers than asked, this thread takes their chunks too */
    pthread_mutex_lock(&team.mu);
    while (team.left > 0) pthread_cond_wait(&team.done, &team.mu);
    pthread_mutex_unlock(&team.mu);
    pthread_mutex_unlock(&dispatch_mu);
}

#endif
