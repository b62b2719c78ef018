// The thread pool: see parallel.h. Workers sleep on a condition variable between jobs; a job
// is a function, a context and an atomic counter of the next task index.
#define _GNU_SOURCE  // sched_getaffinity
#include "parallel.h"

#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <unistd.h>

struct lm_pool {
    int threads;
    pthread_t *workers;  // (threads - 1)
    int n_workers;
    pthread_mutex_t mu;
    pthread_cond_t wake, done;
    uint64_t generation;     // bumped for every job
    bool stop;
    // the current job
    void (*fn)(void *ctx, int64_t i);
    void *ctx;
    int64_t n;
    atomic_int_fast64_t next;
    int busy;                // workers still inside the current job
};

int lm_cpu_count(void)
{
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0 && CPU_COUNT(&set) < n)
        n = CPU_COUNT(&set);
    // a Slurm job's CPUs per task: what it was given, whether or not the cores are confined
    const char *slurm = getenv("SLURM_CPUS_PER_TASK");
    char *end;
    long c = slurm && *slurm ? strtol(slurm, &end, 10) : 0;
    if (slurm && *slurm && *end == '\0' && c > 0 && c < n)
        n = c;
    return n > 0 ? (int)n : 1;
}

static void run_tasks(lm_pool *p)
{
    for (;;) {
        int64_t i = atomic_fetch_add(&p->next, 1);
        if (i >= p->n)
            break;
        p->fn(p->ctx, i);
    }
}

static void *worker(void *arg)
{
    lm_pool *p = arg;
    uint64_t seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->stop && p->generation == seen)
            pthread_cond_wait(&p->wake, &p->mu);
        if (p->stop)
            break;
        seen = p->generation;
        pthread_mutex_unlock(&p->mu);
        run_tasks(p);
        pthread_mutex_lock(&p->mu);
        if (--p->busy == 0)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

lm_status lm_pool_create(lm_pool **out, int threads, lm_err *err)
{
    *out = NULL;
    lm_pool *p = calloc(1, sizeof *p);
    if (!p)
        return lm_err_set(err, LM_ERR_NOMEM, "out of memory for the thread pool");
    p->threads = threads > 0 ? threads : lm_cpu_count();
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->wake, NULL);
    pthread_cond_init(&p->done, NULL);
    atomic_init(&p->next, 0);
    if (p->threads > 1) {
        p->workers = calloc((size_t)p->threads - 1, sizeof *p->workers);
        if (!p->workers) {
            lm_pool_free(p);
            return lm_err_set(err, LM_ERR_NOMEM, "out of memory for the thread pool");
        }
        for (int i = 0; i < p->threads - 1; i++) {
            if (pthread_create(&p->workers[i], NULL, worker, p) != 0) {
                int want = p->threads;
                lm_pool_free(p);
                return lm_err_set(err, LM_ERR_NOMEM, "cannot start thread %d of %d", i + 2, want);
            }
            p->n_workers++;
        }
    }
    *out = p;
    return LM_OK;
}

void lm_pool_free(lm_pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->stop = true;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n_workers; i++)
        pthread_join(p->workers[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_cond_destroy(&p->wake);
    pthread_cond_destroy(&p->done);
    free(p->workers);
    free(p);
}

int lm_pool_threads(const lm_pool *p)
{
    return p->threads;
}

void lm_pool_run(lm_pool *p, int64_t n, void (*fn)(void *ctx, int64_t i), void *ctx)
{
    lm_pool_run_side(p, n, fn, ctx, NULL, NULL);
}

void lm_pool_run_side(lm_pool *p, int64_t n, void (*fn)(void *ctx, int64_t i), void *ctx, void (*side)(void *ctx),
                      void *side_ctx)
{
    if (p->n_workers == 0 || n <= 1) {
        if (side)
            side(side_ctx);
        for (int64_t i = 0; i < n; i++)
            fn(ctx, i);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->ctx = ctx;
    p->n = n;
    atomic_store(&p->next, 0);
    p->busy = p->n_workers;
    p->generation++;
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mu);
    if (side)
        side(side_ctx);
    run_tasks(p);
    pthread_mutex_lock(&p->mu);
    while (p->busy > 0)
        pthread_cond_wait(&p->done, &p->mu);
    pthread_mutex_unlock(&p->mu);
}
