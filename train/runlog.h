/* runlog.h - the lines of a run's log.jsonl (RUN/log.jsonl), built with cJSON.
 *
 * One JSON object per line, each beginning with "step" (a resume trims the log
 * to its checkpoint's step by that key):
 *   {"step":S,"run":{...}}   written by the lead rank each time the run starts
 *                            (S = 0) or resumes (S = the checkpoint's step): what
 *                            ran where (df_runlog_meta) and the run's defining
 *                            settings (settings.h), so a log read alone says which
 *                            run made it;
 *   {"step":S,"epoch":...,"loss":...,...}   a training interval (train.c);
 *   {"step":S,"eval_rows":...,"eval_loss":...,...}   an evaluation (eval.c).
 * Numbers keep fixed printf formats (the same text on every rerun; a non-finite
 * value is written as null, which JSON readers take as missing); strings are
 * escaped by cJSON. Each line is flushed as it is written, and a write error
 * (ENOSPC, EIO) stops the run naming the file and the step: a log never lacks
 * lines silently. DFLASH_FAULT=log-write=ENOSPC fakes one (tests).
 */
#ifndef DF_RUNLOG_H
#define DF_RUNLOG_H

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdio.h>

#include "drafter.h"
#include "err.h"

/* Where and how a run (re)started; NULL strings are left out. */
typedef struct df_runlog_meta {
    const char *event;      /* "start" or "resume" */
    const char *backend;    /* df_backend_name */
    int world;              /* ranks */
    const char *cache, *eval_cache, *target, *init_from, *run_dir;
    int64_t steps;          /* --steps of this invocation */
    const char *settings_json; /* df_run_settings_json's text; its "settings" object is copied */
} df_runlog_meta;

/* A new line object {"step":step}; NULL when out of memory. */
cJSON *df_runlog_line(int64_t step);

/* Adds key = the number printf(fmt, v) (null when v is not finite). 0 or -ENOMEM. */
int df_runlog_num(cJSON *line, const char *key, const char *fmt, double v);
/* Adds key = an integer. 0 or -ENOMEM. */
int df_runlog_int(cJSON *line, const char *key, int64_t v);
/* Adds key = [printf(fmt, v[0]), ...] (n values). 0 or -ENOMEM. */
int df_runlog_nums(cJSON *line, const char *key, const char *fmt, const double *v, int n);

/* Prints line as one row of f, frees it (always, also on error) and ends the row:
 * flushed, a write error or an allocation failure returned naming path and step. */
int df_runlog_write(FILE *f, const char *path, int64_t step, cJSON *line, df_err *e);

/* Writes the {"step":step,"run":{...}} line of m. */
int df_runlog_run(FILE *f, const char *path, int64_t step, const df_runlog_meta *m, df_err *e);

/* Per-interval timing figures of the log (they differ between runs; every
 * other field of a step is reproducible). */
typedef struct df_step_perf {
    double tok_s, step_s;
    double data_wait; /* share of the step time spent reading the cache and building rows */
    double data_wait_max; /* the same for the rank that waited longest in each step (with
                           * several ranks the others wait for it in the collectives);
                           * up to 64 ranks, else this rank's */
    /* the feeder's time per step (seconds, mean over the interval): building
     * the step's rows, and of that waiting for the cache stream's next items
     * (read and decoded ahead on the stream's own threads). Next to
     * data_wait they say whether a wait came from a slow build (the host) or
     * not (e.g. the build started late) */
    double feed_build_s, feed_read_s;
    double tflops;    /* model TFLOP/s (row_flops) */
    double mfu;       /* tflops per rank / one GPU's peak (0: no peak known) */
    double mem_gib;   /* device memory in use (-1: not known) */
    /* constant over a run: device memory in use before the trainer allocated
     * anything (the CUDA context, library handles) and the persistent state
     * (weights, fp32 master + moments, frozen embedding + head) per rank, so
     * mem_gib - mem_base_gib - persistent_gib is what the step itself needs */
    double mem_base_gib, persistent_gib;
    double eta_s;     /* to the last step, at this run's mean pace so far (evaluations included) */
} df_step_perf;

/* The training line of one logged interval ending at step (m: its metrics, bs: the block
 * size, tokens and epoch: the run's so far) to f when f is not NULL, and the readable
 * progress line to stdout unless quiet. */
int df_runlog_step(FILE *f, const char *path, int quiet, int64_t step, int64_t steps, double loss,
                   double lr, double gnorm, const df_drafter_metrics *m, int bs,
                   const df_step_perf *pf, uint64_t tokens, uint64_t epoch, df_err *e);

/* A resume's log: only the whole lines of steps <= step are kept (rewritten through a
 * temporary file, fsynced, renamed). 0 when there is no log yet. */
int df_runlog_trim(const char *path, int64_t step, df_err *e);

#endif
