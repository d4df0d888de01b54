/*
 * Persistent helper threads for the block-copy kernel; see copy_pool.h.
 *
 * Jobs live on their caller's stack and wait in one queue.  A worker joins the
 * first job that still wants helpers and claims items through the job's atomic
 * index, as does the caller, so whoever is running takes the next item: on a
 * busy machine a worker that is woken late costs nothing but its own share.
 * The caller returns only when every worker that joined its job has left it,
 * which is what makes the stack-allocated job safe.
 *
 * All queue and membership changes happen under one mutex; the only lock-free
 * reads are the polls of short spins, which are always re-checked under it.
 */
#define _GNU_SOURCE /* pthread_setname_np; pthread_sigmask and clock_gettime under -std=c11 */
#include "copy_pool.h"

#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define cpu_relax() _mm_pause()
#else
#define cpu_relax() ((void)0)
#endif

/* The caller is the 64th thread of MAX_THREADS in block_copy.c. */
#define POOL_MAX_WORKERS 63

/* After a job a worker spins briefly before it sleeps, to catch a job that follows at once
 * without a futex wake-up; an idle process sleeps.  Longer spins bought nothing measurable on
 * layer-wise loads (the next layer comes tens of microseconds later, after Python work) and
 * would take a core from the engine on a small machine. */
#define WORKER_SPIN_NS 10000
/* A caller whose items are all taken waits for the workers' last items, usually a fraction
 * of one item's copy: spin that long before sleeping. */
#define CALLER_SPIN_NS 50000

/* A copy's memcpy needs little stack; the default 8 MiB is only address space, but there
 * can be 63 of them. */
#define WORKER_STACK_BYTES (256 * 1024)

typedef struct job {
    copy_pool_item_fn fn;
    void *ctx;
    size_t items;
    atomic_size_t next;  /* next unclaimed item */
    atomic_int active;   /* workers inside the job; changed under the lock */
    int helpers_max;     /* the workers that may join */
    int joined;          /* under the lock */
    int queued;          /* under the lock */
    struct job *link;    /* under the lock */
} job_t;

static struct {
    pthread_mutex_t lock;
    pthread_cond_t work; /* idle workers sleep here */
    pthread_cond_t done; /* callers sleep here until their job's workers have left */
    job_t *head;         /* jobs that still want helpers, oldest first */
    atomic_int queued;   /* jobs in the queue, for spinning workers to poll */
    atomic_int workers;
    int sleeping;
} pool = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, 0, 0, 0};

static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static uint64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

/* Spins until *flag != 0 (want_nonzero) or == 0, or for at most ns; returns the last value. */
static int spin_on(atomic_int *flag, int want_nonzero, uint64_t ns)
{
    uint64_t deadline = 0;
    for (unsigned i = 0;; i++) {
        int v = atomic_load_explicit(flag, memory_order_acquire);
        if ((v != 0) == want_nonzero)
            return v;
        if ((i & 63) == 63) {
            uint64_t t = now_ns();
            if (!deadline)
                deadline = t + ns;
            else if (t >= deadline)
                return v;
        }
        cpu_relax();
    }
}

static void run_items(job_t *job)
{
    size_t i;
    while ((i = atomic_fetch_add_explicit(&job->next, 1, memory_order_relaxed)) < job->items)
        job->fn(job->ctx, i);
}

/* Lock held. */
static void enqueue(job_t *job)
{
    job_t **p = &pool.head;
    while (*p)
        p = &(*p)->link;
    job->link = NULL;
    *p = job;
    job->queued = 1;
    atomic_fetch_add(&pool.queued, 1);
}

/* Lock held. */
static void dequeue(job_t *job)
{
    if (!job->queued)
        return;
    for (job_t **p = &pool.head; *p; p = &(*p)->link) {
        if (*p == job) {
            *p = job->link;
            break;
        }
    }
    job->queued = 0;
    atomic_fetch_sub(&pool.queued, 1);
}

static void *worker_main(void *arg)
{
    (void)arg;
    pthread_setname_np(pthread_self(), "ctm-copy"); /* for top -H, and the tests count them */
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        job_t *job = pool.head;
        if (!job) {
            pthread_mutex_unlock(&pool.lock);
            spin_on(&pool.queued, 1, WORKER_SPIN_NS);
            pthread_mutex_lock(&pool.lock);
            if (!pool.head) {
                pool.sleeping++;
                pthread_cond_wait(&pool.work, &pool.lock);
                pool.sleeping--;
            }
            continue;
        }
        if (++job->joined >= job->helpers_max)
            dequeue(job);
        atomic_fetch_add(&job->active, 1);
        pthread_mutex_unlock(&pool.lock);

        run_items(job);

        pthread_mutex_lock(&pool.lock);
        /* The last touch of the job: once active reaches 0 its caller may return. */
        if (atomic_fetch_sub_explicit(&job->active, 1, memory_order_release) == 1)
            pthread_cond_broadcast(&pool.done);
    }
    return NULL;
}

/* Lock held.  Starts workers until there are `want`; returns how many there are. */
static int grow(int want)
{
    int have = atomic_load(&pool.workers);
    if (have >= want)
        return have;
    pthread_attr_t attr;
    if (pthread_attr_init(&attr) != 0)
        return have;
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, WORKER_STACK_BYTES);
    /* Signals belong to the interpreter's threads, not to these. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    for (; have < want; have++) {
        pthread_t tid;
        if (pthread_create(&tid, &attr, worker_main, NULL) != 0)
            break; /* the callers do that share themselves */
        atomic_store(&pool.workers, have + 1);
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    pthread_attr_destroy(&attr);
    return have;
}

/* Fork: hold the lock across it so the child's copy of the pool is consistent, then give
 * the child an empty pool with fresh primitives; its workers were not copied, and any job
 * in the queue belongs to a thread the child does not have. */
static void atfork_prepare(void) { pthread_mutex_lock(&pool.lock); }

static void atfork_parent(void) { pthread_mutex_unlock(&pool.lock); }

static void atfork_child(void)
{
    pool.head = NULL;
    pool.sleeping = 0;
    atomic_store(&pool.queued, 0);
    atomic_store(&pool.workers, 0);
    pthread_mutex_init(&pool.lock, NULL);
    pthread_cond_init(&pool.work, NULL);
    pthread_cond_init(&pool.done, NULL);
}

static void pool_init(void) { pthread_atfork(atfork_prepare, atfork_parent, atfork_child); }

int copy_pool_run(copy_pool_item_fn fn, void *ctx, size_t items, int helpers)
{
    job_t job = {.fn = fn, .ctx = ctx, .items = items};
    atomic_init(&job.next, 0);
    atomic_init(&job.active, 0);
    if (helpers > POOL_MAX_WORKERS)
        helpers = POOL_MAX_WORKERS;
    if (items < 2)
        helpers = 0;
    else if ((size_t)helpers > items - 1)
        helpers = (int)(items - 1);

    if (helpers > 0) {
        pthread_once(&pool_once, pool_init);
        pthread_mutex_lock(&pool.lock);
        int workers = grow(helpers);
        job.helpers_max = helpers < workers ? helpers : workers;
        if (job.helpers_max > 0) {
            enqueue(&job);
            int wake = job.helpers_max < pool.sleeping ? job.helpers_max : pool.sleeping;
            for (int i = 0; i < wake; i++)
                pthread_cond_signal(&pool.work);
        }
        pthread_mutex_unlock(&pool.lock);
    }

    run_items(&job);

    if (job.helpers_max == 0)
        return 0;
    pthread_mutex_lock(&pool.lock);
    dequeue(&job); /* no worker joins a job with nothing left to claim */
    int joined = job.joined;
    if (atomic_load(&job.active) > 0) {
        pthread_mutex_unlock(&pool.lock);
        if (spin_on(&job.active, 0, CALLER_SPIN_NS) == 0)
            return joined; /* acquire load: the workers' stores are visible */
        pthread_mutex_lock(&pool.lock);
        while (atomic_load(&job.active) > 0)
            pthread_cond_wait(&pool.done, &pool.lock);
    }
    pthread_mutex_unlock(&pool.lock);
    return joined;
}

int copy_pool_workers(void) { return atomic_load(&pool.workers); }
