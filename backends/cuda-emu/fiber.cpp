// The emulated device's block runner: a block's threads as cooperative fibers on one OS thread,
// so that __syncthreads is a real barrier and the warp operations exchange values among the 32
// lanes of a warp. A fiber runs until it reaches a barrier or a warp operation that is not
// complete yet, or exits; the scheduler then switches to the next runnable one, in thread order.
// When none can run and some have not exited, the block has deadlocked. With a seed
// (LLMERGE_EMU_SEED) the runnable threads are taken in a random order instead, so that races
// the fixed order hides (a thread reading what a later one overwrites) can show.
//
// The switch is hand-written for x86-64 (the callee-saved registers, MXCSR and the x87 control
// word: some 20 ns, against a microsecond for swapcontext's signal-mask system call), with
// ucontext elsewhere. Stacks are mapped once per OS thread with MAP_NORESERVE and reused. Under
// AddressSanitizer every switch is announced (__sanitizer_start_switch_fiber), so that it
// follows the stacks.
#include "emu_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>

#if defined(__SANITIZE_ADDRESS__)
#define LM_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LM_EMU_ASAN 1
#endif
#endif

#ifdef LM_EMU_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#define STACK_BYTES ((size_t)256 << 10)  // the sanitizer's frames are larger
#else
#define STACK_BYTES ((size_t)64 << 10)
#endif

#if defined(__x86_64__) && !defined(LM_EMU_UCONTEXT)  // LM_EMU_UCONTEXT: the portable switch, to test it
#define LM_EMU_ASM_SWITCH 1
#else
#include <ucontext.h>
#endif

#define MAX_THREADS 1024
#define WARP 32

namespace lm_emu {

thread_local uint3 threadIdx, blockIdx;
thread_local dim3 blockDim, gridDim;

#ifdef LM_EMU_ASM_SWITCH
// lm_emu_switch(save, to): saves the callee-saved registers, MXCSR and the x87 control word on
// the current stack, stores the stack pointer in *save, and resumes the context whose stack
// pointer is `to`. A new context's stack holds the same frame, returning into lm_emu_entry,
// which calls r13(r12).
extern "C" void lm_emu_switch(void **save, void *to);
extern "C" void lm_emu_entry(void);
__asm__(".text\n"
        ".globl lm_emu_switch\n"
        ".hidden lm_emu_switch\n"
        ".type lm_emu_switch,@function\n"
        "lm_emu_switch:\n"
        "  pushq %rbp\n"
        "  pushq %rbx\n"
        "  pushq %r12\n"
        "  pushq %r13\n"
        "  pushq %r14\n"
        "  pushq %r15\n"
        "  subq $8, %rsp\n"
        "  stmxcsr (%rsp)\n"
        "  fnstcw 4(%rsp)\n"
        "  movq %rsp, (%rdi)\n"
        "  movq %rsi, %rsp\n"
        "  ldmxcsr (%rsp)\n"
        "  fldcw 4(%rsp)\n"
        "  addq $8, %rsp\n"
        "  popq %r15\n"
        "  popq %r14\n"
        "  popq %r13\n"
        "  popq %r12\n"
        "  popq %rbx\n"
        "  popq %rbp\n"
        "  ret\n"
        ".size lm_emu_switch, .-lm_emu_switch\n"
        ".globl lm_emu_entry\n"
        ".hidden lm_emu_entry\n"
        ".type lm_emu_entry,@function\n"
        "lm_emu_entry:\n"
        "  movq %r12, %rdi\n"
        "  callq *%r13\n"
        "  ud2\n"
        ".size lm_emu_entry, .-lm_emu_entry\n"
        ".section .note.GNU-stack,\"\",@progbits\n"
        ".text\n");
#endif

enum fstate { RUNNABLE, AT_BARRIER, AT_WARP, EXITED };

struct fiber {
#ifdef LM_EMU_ASM_SWITCH
    void *sp;
#else
    ucontext_t uc;
#endif
    char *stack;
    fstate state;
    uint3 tid;
    int linear;
    // the warp operation it waits at, and its result
    warp_op op;
    unsigned mask;
    int arg, width;
    uint64_t in, out;
#ifdef LM_EMU_ASAN
    void *fake;
#endif
};

struct warp_s {
    unsigned present;  // lanes that exist (a partial last warp has fewer)
    unsigned exited;
    unsigned arrived;  // lanes waiting at the current operation
};

struct block_s {
    fiber *f;  // (nthreads)
    int nthreads, live, at_barrier;
    warp_s warps[MAX_THREADS / WARP];
    void (*body)(void *);
    void *arg;
    char *dyn_shared;
#ifdef LM_EMU_ASM_SWITCH
    void *sched_sp;
#else
    ucontext_t sched_uc;
#endif
#ifdef LM_EMU_ASAN
    void *sched_fake;
    const void *sched_bottom;
    size_t sched_size;
#endif
};

static thread_local char *stacks;     // MAX_THREADS stacks of STACK_BYTES, mapped on first use
static thread_local int guarded;      // how many of them have their guard page yet
static thread_local fiber *fibers;    // MAX_THREADS
static thread_local block_s *cur_block;
static thread_local fiber *cur;

static bool map_stacks(void)
{
    if (stacks)
        return true;
    void *m = mmap(NULL, (size_t)MAX_THREADS * STACK_BYTES, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED)
        return false;
    fibers = (fiber *)calloc(MAX_THREADS, sizeof *fibers);
    if (!fibers) {
        munmap(m, (size_t)MAX_THREADS * STACK_BYTES);
        return false;
    }
    stacks = (char *)m;
    return true;
}

// A guard page at the bottom of each of the first n stacks: an overflow faults instead of
// corrupting the next stack.
static void guard_stacks(int n)
{
    for (; guarded < n; guarded++)
        mprotect(stacks + (size_t)guarded * STACK_BYTES, 4096, PROT_NONE);
}

// ---- switching -------------------------------------------------------------------------------

// From the scheduler into fiber f.
static void switch_in(block_s *b, fiber *f)
{
    cur = f;
    threadIdx = f->tid;
#ifdef LM_EMU_ASAN
    __sanitizer_start_switch_fiber(&b->sched_fake, f->stack, STACK_BYTES);
#endif
#ifdef LM_EMU_ASM_SWITCH
    lm_emu_switch(&b->sched_sp, f->sp);
#else
    swapcontext(&b->sched_uc, &f->uc);
#endif
#ifdef LM_EMU_ASAN
    __sanitizer_finish_switch_fiber(b->sched_fake, NULL, NULL);
#endif
    cur = NULL;
}

// From the running fiber back to the scheduler; returns when the scheduler resumes it.
static void yield(void)
{
    block_s *b = cur_block;
    fiber *f = cur;
#ifdef LM_EMU_ASAN
    __sanitizer_start_switch_fiber(f->state == EXITED ? NULL : &f->fake, b->sched_bottom, b->sched_size);
#endif
#ifdef LM_EMU_ASM_SWITCH
    lm_emu_switch(&f->sp, b->sched_sp);
#else
    swapcontext(&f->uc, &b->sched_uc);
#endif
#ifdef LM_EMU_ASAN
    __sanitizer_finish_switch_fiber(f->fake, NULL, NULL);
#endif
}

static void release_barrier(block_s *b)
{
    for (int i = 0; i < b->nthreads; i++)
        if (b->f[i].state == AT_BARRIER)
            b->f[i].state = RUNNABLE;
    b->at_barrier = 0;
}

static bool try_complete(block_s *b, int w);

static void fiber_main(void *p)
{
    fiber *f = (fiber *)p;
    block_s *b = cur_block;
#ifdef LM_EMU_ASAN
    __sanitizer_finish_switch_fiber(NULL, &b->sched_bottom, &b->sched_size);
#endif
    b->body(b->arg);
    f->state = EXITED;
    b->live--;
    b->warps[f->linear / WARP].exited |= 1u << (f->linear % WARP);
    if (b->at_barrier && b->at_barrier == b->live)
        release_barrier(b);
    try_complete(b, f->linear / WARP);  // an __activemask the lanes left waiting for it
    yield();
    abort();  // an exited fiber is never resumed
}

#ifndef LM_EMU_ASM_SWITCH
static void fiber_trampoline(unsigned hi, unsigned lo)
{
    fiber_main((void *)((uintptr_t)hi << 32 | lo));
}
#endif

static void fiber_init(fiber *f, int i)
{
    f->stack = stacks + (size_t)i * STACK_BYTES;
#ifdef LM_EMU_ASAN
    f->fake = NULL;
#endif
#ifdef LM_EMU_ASM_SWITCH
    uint64_t *top = (uint64_t *)(f->stack + STACK_BYTES);  // 16-byte aligned
    uint64_t *sp = top - 8;
    uint32_t csr[2];
    __asm__ volatile("stmxcsr %0\n\tfnstcw %1" : "=m"(csr[0]), "=m"(csr[1]));
    memcpy(&sp[0], csr, 8);
    sp[1] = 0;                        // r15
    sp[2] = 0;                        // r14
    sp[3] = (uint64_t)(uintptr_t)&fiber_main;  // r13
    sp[4] = (uint64_t)(uintptr_t)f;   // r12
    sp[5] = 0;                        // rbx
    sp[6] = 0;                        // rbp
    sp[7] = (uint64_t)(uintptr_t)&lm_emu_entry;
    f->sp = sp;
#else
    getcontext(&f->uc);
    f->uc.uc_stack.ss_sp = f->stack + 4096;
    f->uc.uc_stack.ss_size = STACK_BYTES - 4096;
    f->uc.uc_link = NULL;
    uintptr_t p = (uintptr_t)f;
    makecontext(&f->uc, (void (*)(void))fiber_trampoline, 2, (unsigned)(p >> 32), (unsigned)p);
#endif
}

// ---- barriers and warp operations ------------------------------------------------------------

static void no_block(const char *what)
{
    fprintf(stderr, "cuda-emu: %s called outside a kernel\n", what);
    abort();
}

void __syncthreads(void)
{
    block_s *b = cur_block;
    if (!b || !cur)
        no_block("__syncthreads");
    if (++b->at_barrier == b->live) {
        release_barrier(b);
        return;
    }
    cur->state = AT_BARRIER;
    yield();
}

// Computes every waiting lane's result of the operation the lanes of `need` meet at.
static void complete(block_s *b, int w0, unsigned need)
{
    fiber *lanes = b->f + w0;
    for (int l = 0; l < WARP; l++) {
        if (!(need >> l & 1))
            continue;
        fiber *f = &lanes[l];
        int width = f->width < 1 || f->width > WARP ? WARP : f->width;
        int seg = l - l % width, src = l;
        switch (f->op) {
        case WARP_SHFL:
            src = seg + (f->arg % width + width) % width;
            break;
        case WARP_SHFL_DOWN:
            src = l + f->arg < seg + width ? l + f->arg : l;
            break;
        case WARP_SHFL_UP:
            src = l - f->arg >= seg ? l - f->arg : l;
            break;
        case WARP_SHFL_XOR:
            src = (l ^ f->arg) < seg + width && (l ^ f->arg) >= seg ? l ^ f->arg : l;
            break;
        default:
            break;
        }
        if (f->op == WARP_ACTIVE) {
            f->out = need;
        } else if (f->op == WARP_BALLOT || f->op == WARP_MATCH_ANY || f->op == WARP_SYNC) {
            uint64_t r = 0;
            for (int k = 0; k < WARP; k++) {
                if (!(need >> k & 1))
                    continue;
                if (f->op == WARP_BALLOT ? lanes[k].in != 0 : f->op == WARP_MATCH_ANY ? lanes[k].in == f->in : false)
                    r |= 1ull << k;
            }
            f->out = r;
        } else {
            // A source lane outside the mask gives an undefined value on a GPU: here, the lane's own.
            f->out = need >> src & 1 ? lanes[src].in : f->in;
        }
    }
    for (int l = 0; l < WARP; l++)
        if (need >> l & 1)
            lanes[l].state = RUNNABLE;
}

// Completes the operation the lanes of warp w wait at when every lane it needs is there: the
// lanes of the mask (for __activemask, every lane that has not exited). The lanes that meet must
// agree on the operation and the mask; when they do not, they stay waiting (the block's
// deadlock). True when it completed.
static bool try_complete(block_s *b, int w)
{
    warp_s *ws = &b->warps[w];
    if (!ws->arrived)
        return false;
    fiber *first = &b->f[w * WARP + __builtin_ctz(ws->arrived)];
    unsigned need = first->op == WARP_ACTIVE ? ws->present & ~ws->exited : first->mask & ws->present;
    if ((ws->arrived & need) != need)
        return false;
    for (int l = 0; l < WARP; l++) {
        fiber *o = &b->f[w * WARP + l];
        if (need >> l & 1 && (o->op != first->op || (first->op != WARP_ACTIVE && (o->mask & ws->present) != need)))
            return false;
    }
    ws->arrived &= ~need;
    complete(b, w * WARP, need);
    return true;
}

uint64_t warp_exchange(warp_op op, unsigned mask, uint64_t v, int arg, int width)
{
    block_s *b = cur_block;
    fiber *f = cur;
    if (!b || !f)
        no_block("a warp operation");
    int w = f->linear / WARP, lane = f->linear % WARP;
    warp_s *ws = &b->warps[w];
    f->op = op;
    f->mask = mask;
    f->in = v;
    f->arg = arg;
    f->width = width;
    f->out = 0;
    ws->arrived |= 1u << lane;
    f->state = AT_WARP;
    if (try_complete(b, w) && f->state == RUNNABLE)
        return f->out;
    yield();
    return f->out;
}

void *dynamic_shared(void)
{
    if (!cur_block)
        no_block("extern __shared__");
    return cur_block->dyn_shared;
}

// ---- running a grid --------------------------------------------------------------------------

// Why nothing can run: a line for the launch's error message.
static void describe_deadlock(block_s *b, char *why, size_t why_size)
{
    int bar = 0, warp = 0, exited = 0, first_warp = -1;
    for (int i = 0; i < b->nthreads; i++) {
        fstate s = b->f[i].state;
        bar += s == AT_BARRIER;
        exited += s == EXITED;
        if (s == AT_WARP) {
            warp++;
            if (first_warp < 0)
                first_warp = i;
        }
    }
    if (warp && first_warp >= 0) {
        warp_s *w = &b->warps[first_warp / WARP];
        snprintf(why, why_size,
                 "deadlock: %d thread%s wait at a warp operation whose lanes never all arrive (warp %d: lanes "
                 "exited 0x%08x, waiting 0x%08x), %d at __syncthreads, %d exited",
                 warp, warp == 1 ? "" : "s", first_warp / WARP, w->exited, w->arrived, bar, exited);
    } else {
        snprintf(why, why_size, "deadlock: %d thread%s wait at __syncthreads that %d other%s never reach%s", bar,
                 bar == 1 ? "" : "s", b->live - bar, b->live - bar == 1 ? "" : "s", b->live - bar == 1 ? "es" : "");
    }
}

// Runs one block to its end; false on a deadlock. Each pass switches to every runnable thread
// in thread order, or, with a seed, in an order drawn afresh for the pass.
static bool run_block(block_s *b, uint64_t *seed, char *why, size_t why_size)
{
    static thread_local int order[MAX_THREADS];
    for (int i = 0; i < b->nthreads; i++)
        order[i] = i;
    for (;;) {
        bool ran = false;
        if (*seed) {
            for (int i = b->nthreads - 1; i > 0; i--) {
                *seed ^= *seed << 13;
                *seed ^= *seed >> 7;
                *seed ^= *seed << 17;
                int j = (int)(*seed % (uint64_t)(i + 1)), t = order[i];
                order[i] = order[j];
                order[j] = t;
            }
        }
        for (int k = 0; k < b->nthreads; k++) {
            fiber *f = &b->f[order[k]];
            if (f->state != RUNNABLE)
                continue;
            switch_in(b, f);
            ran = true;
        }
        if (b->live == 0)
            return true;
        if (!ran) {
            describe_deadlock(b, why, why_size);
            return false;
        }
    }
}

bool run_grid(const char *name, dim3 grid, dim3 block, size_t shmem, unsigned max_blocks, uint64_t seed,
              void (*body)(void *), void *arg, char *why, size_t why_size)
{
    int nthreads = (int)(block.x * block.y * block.z);
    if (!map_stacks()) {
        snprintf(why, why_size, "cannot map the fibers' stacks");
        return false;
    }
    guard_stacks(nthreads);
    block_s *b = (block_s *)calloc(1, sizeof *b);
    char *dyn = (char *)calloc(1, shmem ? shmem : 1);
    if (!b || !dyn) {
        free(b);
        free(dyn);
        snprintf(why, why_size, "out of host memory");
        return false;
    }
    uint64_t total = (uint64_t)grid.x * grid.y * grid.z;
    dim3 run = grid;
    if (total > max_blocks) {  // a smaller grid in x: the kernels are grid-stride loops
        run.x = max_blocks / (grid.y * grid.z) ? max_blocks / (grid.y * grid.z) : 1;
        total = (uint64_t)run.x * run.y * run.z;
    }
    gridDim = run;
    blockDim = block;
    bool ok = true;
    block_s *saved = cur_block;
    cur_block = b;
    for (uint64_t bi = 0; bi < total && ok; bi++) {
        blockIdx.x = (unsigned)(bi % run.x);
        blockIdx.y = (unsigned)(bi / run.x % run.y);
        blockIdx.z = (unsigned)(bi / run.x / run.y);
        b->f = fibers;
        b->nthreads = b->live = nthreads;
        b->at_barrier = 0;
        b->body = body;
        b->arg = arg;
        b->dyn_shared = dyn;
        memset(b->warps, 0, sizeof b->warps);
        for (int i = 0; i < nthreads; i++) {
            fiber *f = &fibers[i];
            f->state = RUNNABLE;
            f->linear = i;
            f->tid.x = (unsigned)i % block.x;
            f->tid.y = (unsigned)i / block.x % block.y;
            f->tid.z = (unsigned)i / block.x / block.y;
            fiber_init(f, i);
            b->warps[i / WARP].present |= 1u << (i % WARP);
        }
        if (!run_block(b, &seed, why, why_size)) {
            ok = false;
#ifdef LM_EMU_ASAN
            // The abandoned fibers' frames leave their poison on the stacks.
            ASAN_UNPOISON_MEMORY_REGION(stacks + 4096, (size_t)nthreads * STACK_BYTES - 4096);
#endif
            size_t len = strlen(why);
            snprintf(why + len, why_size - len, " (kernel %s, block %u)", name, blockIdx.x);
        }
    }
    cur_block = saved;
    free(dyn);
    free(b);
    return ok;
}

}  // namespace lm_emu
