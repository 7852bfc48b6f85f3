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

#endif
