// A small thread pool for the element-wise work of the CPU backend: lm_pool_run hands out task
// indices [0, n) to the pool's threads and the caller's own thread and returns when every task
// is done. Tasks are numbered and each writes only its own part of the output, so results do
// not depend on how many threads there are or which thread ran which task.
#ifndef LM_PARALLEL_H
#define LM_PARALLEL_H

#include <stdint.h>

#include "status.h"

typedef struct lm_pool lm_pool;

// Starts a pool running `threads` tasks at once (the caller's thread counts as one, so
// threads - 1 workers are started); threads <= 0 means one per online core. Free with
// lm_pool_free.
lm_status lm_pool_create(lm_pool **out, int threads, lm_err *err);

// Stops and joins the workers; safe on NULL.
void lm_pool_free(lm_pool *p);

// The number of tasks the pool runs at once.
int lm_pool_threads(const lm_pool *p);

// Runs fn(ctx, i) for every i in [0, n) and returns when all have finished. Not reentrant:
// fn must not call lm_pool_run on the same pool.
void lm_pool_run(lm_pool *p, int64_t n, void (*fn)(void *ctx, int64_t i), void *ctx);

// lm_pool_run, with side(side_ctx) run first on the calling thread while the pool's other
// threads start on the tasks (the calling thread then joins them): the caller's own work
// overlaps the job's. side may be NULL.
void lm_pool_run_side(lm_pool *p, int64_t n, void (*fn)(void *ctx, int64_t i), void *ctx, void (*side)(void *ctx),
                      void *side_ctx);

// The number of cores this process may use: the online cores, or fewer where its CPU affinity
// says (taskset, a cgroup's cpuset, Slurm's task/affinity), or fewer where it runs in a Slurm job
// with SLURM_CPUS_PER_TASK (srun -c, sbatch -c), so that a job never runs more threads than the
// CPUs it was given. What --threads defaults to.
int lm_cpu_count(void);

#endif
