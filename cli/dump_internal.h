/* dump_internal.h - what the files of `dflash dump` share: its options, exit
 * codes and the few output helpers every mode uses.
 *
 * cmd_dump.c parses the command line into an opts, opens the cache and calls
 * one mode; each mode lives in its own file:
 *   cmd_dump_summary.c  summary and --samples (the index only, no record read)
 *   cmd_dump_sample.c   --sample ID (reads one record: tokens, slices, stats)
 *   cmd_dump_verify.c   --verify (every checksum, on a worker pool)
 * Contract of a mode: it writes its report to stdout (with --json exactly one
 * JSON object, through dump_json_emit, and nothing else there), its messages
 * to stderr prefixed with PROG, and returns an EXIT_* code; it neither closes
 * the cache nor the pool, and it does not flush stdout (cmd_dump does both).
 * This header is private to cli/; nothing outside `dflash dump` includes it.
 */
#ifndef DF_DUMP_INTERNAL_H
#define DF_DUMP_INTERNAL_H

#include <cjson/cJSON.h>
#include <stddef.h>
#include <stdint.h>

#include "cache.h"
#include "err.h"
#include "pool.h"

#define PROG "dflash dump"
#define DEFAULT_SLICE_ROWS 4u
#define DEFAULT_SLICE_COLS 8u

enum { EXIT_OK = 0, EXIT_DATA = 1, EXIT_USAGE = 2 };
enum { MODE_SUMMARY, MODE_SAMPLES, MODE_SAMPLE, MODE_VERIFY };

/* A half-open range [lo, hi); has_lo/has_hi say which ends were written. */
typedef struct range {
    int given;
    int has_lo, has_hi;
    uint64_t lo, hi;
} range;

typedef struct opts {
    const char *dir;
    int mode;
    int json;
    uint64_t limit, offset;
    int has_limit, has_offset;
    uint64_t sample_id;
    int64_t layer;            /* target layer id, or -1 = every layer */
    range rows, cols;
    uint64_t threads;
    int has_threads;
} opts;

/* cmd_dump.c: the helpers the modes share. */
/* Prints e's message (or code's) to stderr; returns EXIT_DATA. */
int dump_data_err(const df_err *e, int code);
/* b bytes as "1.50 MiB" into buf; returns buf. */
const char *dump_human_bytes(char *buf, size_t n, double b);
/* Prints root to stdout and frees it; 0, or EXIT_DATA when out of memory. */
int dump_json_emit(cJSON *root);
/* Shard s's data file name, or "?". */
const char *dump_shard_name(const df_cache_info *inf, uint32_t s);

/* The modes. pool: NULL for summary and --samples, a started pool for the others. */
int dump_summary(df_cache *c, const opts *o);             /* cmd_dump_summary.c */
int dump_samples(df_cache *c, const opts *o);             /* cmd_dump_summary.c */
int dump_sample(df_cache *c, const opts *o, df_pool *pool); /* cmd_dump_sample.c */
int dump_verify(df_cache *c, const opts *o, df_pool *pool); /* cmd_dump_verify.c */

#endif
