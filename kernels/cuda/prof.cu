/* prof.cu - the CUDA backend's op profiling (DFLASH_PROFILE=1; cuda_internal.h):
 * GPU time per op and per op part, and the gaps between ops on each stream.
 * Each op is bracketed by two events on the stream; at every sync (and when
 * the bracket array fills) elapsed times are summed per op name, and the
 * gaps between a stream's brackets per name of the op after the gap; close
 * logs both tables. Costs a few microseconds per op: a measuring mode. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_internal.h"
#include "cuda_state.h"

extern "C" {
#include "log.h"
}

static df_cuda_state *st_of(df_backend *be)
{
    return (df_cuda_state *)be->impl;
}

extern "C" void df_cuda_prof_open(df_backend *be)
{
    df_cuda_state *s = st_of(be);
    if (!(s->prof = (df_cuda_prof *)calloc(1, sizeof *s->prof)))
        return; /* (no profile: the ops run as without it) */
    for (int i = 0; i < 2 * DF_CUDA_PROF_EVENTS; i++)
        (void)cudaEventCreate(&s->prof->ev[i]);
    for (int j = 0; j < 2; j++)
        if (cudaEventCreate(&s->prof->last_end[j]) != cudaSuccess)
            s->prof->last_end[j] = NULL, (void)cudaGetLastError();
    be->prof = 1;
}

/* the stream's slot among the two whose gaps are kept, or -1 */
static int prof_slot(df_cuda_prof *p, cudaStream_t st)
{
    for (int j = 0; j < 2; j++)
        if (p->last_end[j] && (!p->slot_used[j] || p->last_strm[j] == st)) {
            p->last_strm[j] = st;
            p->slot_used[j] = 1;
            return j;
        }
    return -1;
}

extern "C" void df_cuda_prof_flush(df_backend *be)
{
    df_cuda_prof *p = st_of(be)->prof;
    if (!p || !p->n)
        return;
    (void)cudaEventSynchronize(p->ev[2 * p->n - 1]);
    int last[2] = {-1, -1}; /* each slot's last bracket in this flush */
    for (int i = 0; i < p->n; i++) {
        float ms = 0;
        (void)cudaEventElapsedTime(&ms, p->ev[2 * i], p->ev[2 * i + 1]);
        int k = 0;
        while (k < p->n_names && strcmp(p->names[k], p->name[i]))
            k++;
        if (k == p->n_names && k < DF_CUDA_PROF_NAMES)
            p->names[p->n_names++] = p->name[i];
        if (k < DF_CUDA_PROF_NAMES) {
            p->ms[k] += ms;
            p->calls[k]++;
        }
        int j = prof_slot(p, p->strm[i]);
        if (j < 0)
            continue;
        float gap = 0;
        int have = last[j] >= 0 ? cudaEventElapsedTime(&gap, p->ev[2 * last[j] + 1], p->ev[2 * i]) == cudaSuccess
                   : p->has_last[j] ? cudaEventElapsedTime(&gap, p->last_end[j], p->ev[2 * i]) == cudaSuccess
                                    : 0;
        if (!have)
            (void)cudaGetLastError();
        if (have && k < DF_CUDA_PROF_NAMES && gap > 0) {
            p->gap_ms[k] += gap;
            p->gap_n[k]++;
            if (gap > p->gap_max)
                p->gap_max = gap, p->gap_max_name = p->names[k];
        }
        last[j] = i;
    }
    /* each slot's last end stays valid in its own event (the arrays are recorded anew) */
    for (int j = 0; j < 2; j++)
        if (last[j] >= 0) {
            cudaEvent_t t = p->last_end[j];
            p->last_end[j] = p->ev[2 * last[j] + 1];
            p->ev[2 * last[j] + 1] = t;
            p->has_last[j] = 1;
        }
    p->n = 0;
}

extern "C" void df_cuda_prof_begin(df_backend *be, const char *name)
{
    df_cuda_state *s = st_of(be);
    df_cuda_prof *p = s->prof;
    if (p->n == DF_CUDA_PROF_EVENTS)
        df_cuda_prof_flush(be);
    p->name[p->n] = name;
    p->strm[p->n] = s->stream;
    p->op = name;
    (void)cudaEventRecord(p->ev[2 * p->n], s->stream);
}

extern "C" void df_cuda_prof_end(df_backend *be)
{
    df_cuda_state *s = st_of(be);
    df_cuda_prof *p = s->prof;
    (void)cudaEventRecord(p->ev[2 * p->n + 1], s->stream);
    p->n++;
}

extern "C" void df_cuda_prof_split(df_backend *be, const char *part)
{
    df_cuda_state *s = st_of(be);
    df_cuda_prof *p = s->prof;
    if (!be->prof || !p || !p->op)
        return;
    const char *op = p->op, *name = op;
    char buf[96];
    if (part) {
        snprintf(buf, sizeof buf, "%s: %s", op, part);
        int k = 0;
        while (k < p->n_parts && strcmp(p->parts[k], buf))
            k++;
        if (k == p->n_parts && k < DF_CUDA_PROF_NAMES && (p->parts[k] = strdup(buf)))
            p->n_parts++;
        if (k < p->n_parts)
            name = p->parts[k];
    }
    df_cuda_prof_end(be);
    df_cuda_prof_begin(be, name);
    p->op = op;
}

extern "C" void df_cuda_prof_reset(df_backend *be)
{
    df_cuda_state *s = st_of(be);
    if (!s->prof)
        return;
    df_cuda_prof_flush(be);
    memset(s->prof->ms, 0, sizeof s->prof->ms);
    memset(s->prof->calls, 0, sizeof s->prof->calls);
    memset(s->prof->gap_ms, 0, sizeof s->prof->gap_ms);
    memset(s->prof->gap_n, 0, sizeof s->prof->gap_n);
    s->prof->gap_max = 0, s->prof->gap_max_name = NULL;
    s->prof->has_last[0] = s->prof->has_last[1] = 0; /* no gap across the reset */
}

extern "C" void df_cuda_prof_close(df_backend *be)
{
    df_cuda_state *s = st_of(be);
    df_cuda_prof *p = s->prof;
    if (!p)
        return;
    df_cuda_prof_flush(be);
    double tot = 0;
    for (int k = 0; k < p->n_names; k++)
        tot += p->ms[k];
    df_log(DF_LOG_INFO, "cuda profile (device %d): %.1f ms in ops", s->device, tot);
    for (int done = 0; done < p->n_names; done++) { /* largest first */
        int best = -1;
        for (int k = 0; k < p->n_names; k++)
            if (p->calls[k] && (best < 0 || p->ms[k] > p->ms[best]))
                best = k;
        if (best < 0)
            break;
        df_log(DF_LOG_INFO, "  %-24s %9.1f ms %5.1f%% %8llu calls %8.3f ms/call", p->names[best],
               p->ms[best], tot > 0 ? 100 * p->ms[best] / tot : 0.0,
               (unsigned long long)p->calls[best], p->ms[best] / (double)p->calls[best]);
        p->calls[best] = 0;
    }
    double gtot = 0;
    for (int k = 0; k < p->n_names; k++)
        gtot += p->gap_ms[k];
    df_log(DF_LOG_INFO, "cuda profile gaps (device %d): %.1f ms between ops on their streams, "
           "the largest %.3f ms before %s; by the op after:", s->device, gtot, p->gap_max,
           p->gap_max_name ? p->gap_max_name : "-");
    for (int done = 0; done < 12; done++) { /* the largest sums */
        int best = -1;
        for (int k = 0; k < p->n_names; k++)
            if (p->gap_n[k] && (best < 0 || p->gap_ms[k] > p->gap_ms[best]))
                best = k;
        if (best < 0)
            break;
        df_log(DF_LOG_INFO, "  %-24s %9.1f ms %8llu gaps %8.3f ms/gap", p->names[best],
               p->gap_ms[best], (unsigned long long)p->gap_n[best],
               p->gap_ms[best] / (double)p->gap_n[best]);
        p->gap_n[best] = 0;
    }
    for (int i = 0; i < 2 * DF_CUDA_PROF_EVENTS; i++)
        (void)cudaEventDestroy(p->ev[i]);
    for (int j = 0; j < 2; j++)
        if (p->last_end[j])
            (void)cudaEventDestroy(p->last_end[j]);
    for (int i = 0; i < p->n_parts; i++)
        free(p->parts[i]);
    free(p);
    s->prof = NULL;
}
