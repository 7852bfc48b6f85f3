/* pool.h - a fixed pthread pool for parallel-for style work.
 *
 * df_pool_for() splits [0, n) across the workers and the calling thread and
 * returns when every index has run. Calls from several threads at once are
 * serialized. nthreads == 0 means "use the number of online CPUs". */
#ifndef DF_POOL_H
#define DF_POOL_H

#include <stddef.h>

typedef struct df_pool df_pool;

/* fn(arg, i) for one index; returns 0 or a negative code. */
typedef int (*df_pool_fn)(void *arg, size_t i);

df_pool *df_pool_open(int nthreads);
void df_pool_close(df_pool *p);
int df_pool_size(const df_pool *p);

/* Runs fn(arg, i) for i in [0, n). Returns 0, or the first (lowest i)
 * negative code any call returned; all indices run regardless. p may be
 * NULL: then everything runs on the calling thread. */
int df_pool_for(df_pool *p, size_t n, df_pool_fn fn, void *arg);

#endif
