/* knobs.h - every DFLASH_* environment variable dflash reads, in one table.
 *
 * The environment is read once per process, on the first call of any
 * function here (thread-safe), and each value is checked against its knob's
 * kind:
 *   flag    0 or 1
 *   int     a decimal integer in the knob's range
 *   choice  one of the knob's words ("uring|io_uring": two spellings of one)
 *   string  any text (the code that uses it checks its form)
 * Unset or empty is the default. A bad value prints one warning naming the
 * variable and what it allows (on stderr, unless DFLASH_LOG=error) and the
 * knob takes its default; for a knob marked bad_is_error (DFLASH_IO) it is
 * instead an error where the knob is used (df_knob_check).
 *
 * Library code asks these accessors and never calls getenv itself. The
 * table (knobs.c) is what `dflash env` prints and what docs/KNOBS.md is.
 */
#ifndef DF_KNOBS_H
#define DF_KNOBS_H

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef enum df_knob_id {
    DF_KNOB_LOG,                 /* choice error,warn,info,debug: log.h's DF_LOG_* levels */
    DF_KNOB_IO,                  /* choice auto,uring|io_uring,threads (0, 1, 2) */
    DF_KNOB_CPU_SIMD,            /* flag, default 1 */
    DF_KNOB_PORTABLE,            /* flag */
    DF_KNOB_CUDA_FALLBACK,       /* flag */
    DF_KNOB_PROFILE,             /* flag */
    DF_KNOB_GEMM_TUNE,           /* flag */
    DF_KNOB_CE_CHUNK_MIB,        /* int 64..65536, default 1024 */
    DF_KNOB_CE_CHUNK_ROWS,       /* int 0..65536, default 0 (by memory) */
    DF_KNOB_CE_PRECISE,          /* flag */
    DF_KNOB_CE_ONEPASS_BSUM,     /* flag, default 0 */
    DF_KNOB_CE_ROWS_OCC4,        /* flag, default 0 */
    DF_KNOB_FP8_GEMM,            /* flag, default 1 */
    DF_KNOB_FP8_SWIGLU,          /* flag, default 1 */
    DF_KNOB_FP8_RMSNORM,         /* flag, default 1 */
    DF_KNOB_FP8_DY_CODES,        /* flag, default 0 */
    DF_KNOB_FP8_ONLY_CODES,      /* flag, default 1 */
    DF_KNOB_FP8_WEIGHT_CODES,    /* flag, default 1 */
    DF_KNOB_FP8_LAZY_BF16,       /* flag, default 0 */
    DF_KNOB_RMSNORM_BWD,         /* choice onepass,twopass (0, 1) */
    DF_KNOB_ATTN_BWD,            /* choice simt,mma4,wg2,wg2f,wg3 (0..4); -1: unset */
    DF_KNOB_ATTN_PDL,            /* flag, default 1 */
    DF_KNOB_ATTN_DQ_PERSIST,     /* flag, default 1 */
    DF_KNOB_FAULT,               /* string: POINT=ERRNO,... (fsutil.h's df_fault) */
    DF_KNOB_CKPT_TEST_KILL_AT,   /* choice config,state,manifest,complete,rename,latest; -1: unset */
    DF_KNOB_TEST_REPLICATE_DATA, /* flag (read by cli/) */
    DF_KNOB_RUN_ID,              /* string (read by cli/) */
    DF_KNOB_COUNT
} df_knob_id;

typedef enum df_knob_kind { DF_KNOB_FLAG, DF_KNOB_INT, DF_KNOB_CHOICE, DF_KNOB_STRING } df_knob_kind;

/* Who a knob is for: users, timing and comparing paths, or tests (fault
 * injection, oracles). */
typedef enum df_knob_use { DF_KNOB_USER, DF_KNOB_BENCH, DF_KNOB_TEST } df_knob_use;

typedef struct df_knob_info {
    const char *name;    /* "DFLASH_LOG" */
    df_knob_kind kind;
    df_knob_use use;
    const char *def;     /* the default as the variable would spell it; NULL: none (see what) */
    const char *allowed; /* flag "0,1"; int "lo..hi"; choice "a,b|b2,c"; string: its form */
    int lo, hi;          /* int: the range */
    int bad_is_error;    /* a bad value fails df_knob_check instead of warning */
    const char *what;    /* one line */
} df_knob_info;

/* The table's entry for id (NULL for an id out of range). */
const df_knob_info *df_knob_info_of(df_knob_id id);
const char *df_knob_kind_name(df_knob_kind kind); /* "flag", "int", "choice", "string" */
const char *df_knob_use_name(df_knob_use use);    /* "user", "bench", "test" */
/* What the knob allows as a reader would write it into out (cap bytes):
 * "0 or 1", "64..65536", "auto, uring (or io_uring), threads", a string's form. */
void df_knob_allowed(df_knob_id id, char *out, size_t cap);

/* The value in use: flag 0 / 1; int the number; choice the index of its
 * word in the knob's list (above), -1 when unset with no default; string 1
 * when set, 0 when not. A bad value gives the default's. */
int df_knob_int(df_knob_id id);

/* The value in use as text: string knobs their text (NULL when unset),
 * choices their word's first spelling (NULL when unset with no default),
 * flags and ints the number. Valid until the next df_knob_set of id. */
const char *df_knob_str(df_knob_id id);

/* The text the knob was given (environment or df_knob_set), NULL when unset
 * or empty, and whether that text was refused (then the default is in use). */
const char *df_knob_raw(df_knob_id id);
int df_knob_bad(df_knob_id id);

/* 0, or -EINVAL with a message naming the variable, its value and what is
 * allowed when the knob was given a bad value. For bad_is_error knobs, at
 * the point of use. */
int df_knob_check(df_knob_id id, df_err *e);

/* Parses text as id's value would be (NULL or "": the default) into *val
 * (as df_knob_int reports it) without touching the knob; 0, or -EINVAL with
 * the message df_knob_check would give. For tests. */
int df_knob_parse(df_knob_id id, const char *text, int *val, df_err *e);

/* Gives the knob text (NULL: unset) as if the process had started with it,
 * without a warning: for tests and tools that switch a knob between calls
 * (the environment is read only once). Returns 0, or -EINVAL when text is
 * bad (the knob then behaves as for a bad environment value). Not safe
 * while other threads read knobs. */
int df_knob_set(df_knob_id id, const char *text);

#ifdef __cplusplus
}
#endif
#endif
