#include "pool.h"

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <unistd.h>

struct df_pool {
    int n;
    pthread_t *th;
    pthread_mutex_t mu;   /* guards the fields below */
    pthread_cond_t work;  /* a job was posted or shutdown */
    pthread_cond_t done;  /* a worker finished its part */
    pthread_mutex_t call; /* serializes df_pool_for callers */
    unsigned long gen;    /* job generation */
    int quit;
    int busy;             /* workers still on the current job */
    /* current job */
    df_pool_fn fn;
    void *arg;
    size_t total, next;   /* next index to hand out (guarded by mu) */
    size_t err_i;
    int err;
};

static void run_job(df_pool *p)
{
    for (;;) {
        pthread_mutex_lock(&p->mu);
        size_t i = p->next;
        if (i >= p->total) {
            pthread_mutex_unlock(&p->mu);
            return;
        }
        p->next++;
        pthread_mutex_unlock(&p->mu);
        int rc = p->fn(p->arg, i);
        if (rc < 0) {
            pthread_mutex_lock(&p->mu);
            if (!p->err || i < p->err_i) {
                p->err = rc;
                p->err_i = i;
            }
            pthread_mutex_unlock(&p->mu);
        }
    }
}

static void *worker(void *vp)
{
    df_pool *p = vp;
    unsigned long seen = 0;
    pthread_mutex_lock(&p->mu);
    for (;;) {
        while (!p->quit && p->gen == seen)
            pthread_cond_wait(&p->work, &p->mu);
        if (p->quit)
            break;
        seen = p->gen;
        pthread_mutex_unlock(&p->mu);
        run_job(p);
        pthread_mutex_lock(&p->mu);
        if (--p->busy == 0)
            pthread_cond_signal(&p->done);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

df_pool *df_pool_open(int nthreads)
{
    if (nthreads <= 0) {
        long c = sysconf(_SC_NPROCESSORS_ONLN);
        nthreads = c > 0 ? (int)c : 1;
    }
    df_pool *p = calloc(1, sizeof *p);
    if (!p)
        return NULL;
    /* The caller also works, so n-1 helper threads give n-way parallelism. */
    p->n = nthreads - 1;
    p->th = calloc((size_t)(p->n > 0 ? p->n : 1), sizeof *p->th);
    if (!p->th) {
        free(p);
        return NULL;
    }
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_init(&p->call, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, NULL);
    for (int i = 0; i < p->n; i++) {
        if (pthread_create(&p->th[i], NULL, worker, p) != 0) {
            p->n = i;
            break;
        }
    }
    return p;
}

void df_pool_close(df_pool *p)
{
    if (!p)
        return;
    pthread_mutex_lock(&p->mu);
    p->quit = 1;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->n; i++)
        pthread_join(p->th[i], NULL);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->call);
    pthread_cond_destroy(&p->work);
    pthread_cond_destroy(&p->done);
    free(p->th);
    free(p);
}

int df_pool_size(const df_pool *p)
{
    return p ? p->n + 1 : 1;
}

int df_pool_for(df_pool *p, size_t n, df_pool_fn fn, void *arg)
{
    if (!p || p->n == 0 || n <= 1) {
        int err = 0;
        for (size_t i = 0; i < n; i++) {
            int rc = fn(arg, i);
            if (rc < 0 && !err)
                err = rc;
        }
        return err;
    }
    pthread_mutex_lock(&p->call);
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->total = n;
    p->next = 0;
    p->err = 0;
    p->err_i = SIZE_MAX;
    p->busy = p->n;
    p->gen++;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    run_job(p);
    pthread_mutex_lock(&p->mu);
    while (p->busy > 0)
        pthread_cond_wait(&p->done, &p->mu);
    int err = p->err;
    pthread_mutex_unlock(&p->mu);
    pthread_mutex_unlock(&p->call);
    return err;
}
