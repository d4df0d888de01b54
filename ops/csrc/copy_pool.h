/*
 * Persistent helper threads for the block-copy kernel.
 *
 * A layer-wise load makes one kernel call per layer; creating and joining
 * threads on each call cost more than the copy gained from them.  The pool's
 * workers are created on first use and then sleep between calls.
 */
#ifndef CTM_COPY_POOL_H
#define CTM_COPY_POOL_H

#include <stddef.h>

/* One item of a job; it must leave its stores visible to other threads before it returns
 * (non-temporal stores need an sfence). */
typedef void (*copy_pool_item_fn)(void *ctx, size_t item);

/*
 * Runs fn(ctx, i) once for every i in [0, items), on the calling thread and on
 * up to `helpers` pool workers, which take items as they come free.  Returns
 * when every item has returned; returns how many workers helped.
 *
 * Safe to call from several threads at once: each call is its own job and the
 * caller works through its own items, so it never waits for another job, only
 * for items of its own that a worker is finishing.  If the pool cannot start a
 * thread, the caller does that share itself.
 */
int copy_pool_run(copy_pool_item_fn fn, void *ctx, size_t items, int helpers);

/* Workers alive in this process (a forked child starts with none). */
int copy_pool_workers(void);

#endif
