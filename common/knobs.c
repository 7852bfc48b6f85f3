/* knobs.c - the table of DFLASH_* environment variables and their one
 * reading (knobs.h). Warnings go straight to stderr in df_log's format: log.c
 * takes its level from here, so this file cannot log through it. */
#include "knobs.h"

#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "log.h"
#include "opt.h"

_Static_assert(DF_LOG_ERROR == 0 && DF_LOG_WARN == 1 && DF_LOG_INFO == 2 && DF_LOG_DEBUG == 3,
               "DFLASH_LOG's choices are listed in log.h's order");

/* In df_knob_id's order. Defaults and behaviour as the readers had them. */
static const df_knob_info TABLE[DF_KNOB_COUNT] = {
    [DF_KNOB_LOG] = {"DFLASH_LOG", DF_KNOB_CHOICE, DF_KNOB_USER, "info", "error,warn,info,debug", 0, 0,
                     0, "the diagnostics printed on stderr: errors; also warnings; also progress; everything"},
    [DF_KNOB_IO] = {"DFLASH_IO", DF_KNOB_CHOICE, DF_KNOB_USER, "auto", "auto,uring|io_uring,threads", 0,
                    0, 1,
                    "the I/O engine: io_uring where it works, else the thread pool; io_uring or an "
                    "error; the thread pool. A bad value fails the engine's open"},
    [DF_KNOB_CPU_SIMD] = {"DFLASH_CPU_SIMD", DF_KNOB_FLAG, DF_KNOB_TEST, "1", "0,1", 0, 0, 0,
                          "0: the CPU GEMMs use the portable C micro-kernel instead of the AVX2 + "
                          "FMA one"},
    [DF_KNOB_PORTABLE] = {"DFLASH_PORTABLE", DF_KNOB_FLAG, DF_KNOB_BENCH, "0", "0,1", 0, 0, 0,
                          "1: the portable mma.sync kernels within 99 KiB of shared memory on any "
                          "GPU, as sm_86 / sm_89 / sm_120 run them (to test and time that path on "
                          "Hopper)"},
    [DF_KNOB_CUDA_FALLBACK] = {"DFLASH_CUDA_FALLBACK", DF_KNOB_FLAG, DF_KNOB_TEST, "0", "0,1", 0, 0,
                               0,
                               "1: the CUDA-core fallbacks of the target's attention and GDN "
                               "everywhere, an oracle for the tuned kernels"},
    [DF_KNOB_PROFILE] = {"DFLASH_PROFILE", DF_KNOB_FLAG, DF_KNOB_BENCH, "0", "0,1", 0, 0, 0,
                         "1: GPU time per op, and the gaps between ops on a stream, logged when "
                         "the CUDA backend closes"},
    [DF_KNOB_GEMM_TUNE] = {"DFLASH_GEMM_TUNE", DF_KNOB_FLAG, DF_KNOB_BENCH, "0", "0,1", 0, 0, 0,
                           "1: time cuBLASLt's candidates on each new big GEMM shape and keep the "
                           "fastest bitwise-equal one; pays only when shapes repeat"},
    [DF_KNOB_CE_CHUNK_MIB] = {"DFLASH_CE_CHUNK_MIB", DF_KNOB_INT, DF_KNOB_BENCH, "1024", "64..65536", 64,
                              65536, 0,
                              "the CUDA LM head + cross-entropy's per-chunk buffers in MiB: larger "
                              "gives the dh GEMM more tiles per wave, at that much more memory; "
                              "when set, also past the memory the trainer lends it"},
    [DF_KNOB_CE_CHUNK_ROWS] = {"DFLASH_CE_CHUNK_ROWS", DF_KNOB_INT, DF_KNOB_BENCH, "0", "0..65536", 0,
                               65536, 0,
                               "the CUDA LM head + cross-entropy's rows per chunk on the E4M3 "
                               "tensor cores (rounded up to 4), past the memory the trainer "
                               "lends it; 0: by DFLASH_CE_CHUNK_MIB and that memory (multiples of "
                               "256); being measured"},
    [DF_KNOB_CE_ONEPASS_BSUM] = {"DFLASH_CE_ONEPASS_BSUM", DF_KNOB_FLAG, DF_KNOB_BENCH, "0", "0,1", 0,
                                 0, 0,
                                 "1: --fp8-ce-onepass's row sums from its codes' own exps, block "
                                 "by block (one expf a logit, no fp64 per logit); being measured"},
    [DF_KNOB_CE_ROWS_OCC4] = {"DFLASH_CE_ROWS_OCC4", DF_KNOB_FLAG, DF_KNOB_BENCH, "0", "0,1", 0, 0, 0,
                              "1: the LM head's row kernels held to 32 registers, 4 blocks of 512 "
                              "threads per SM (a 512-row chunk in one wave on 132 SMs, a few "
                              "registers spilled); 0: 40 registers, 3 blocks (the same bits)"},
    [DF_KNOB_CE_PRECISE] = {"DFLASH_CE_PRECISE", DF_KNOB_FLAG, DF_KNOB_TEST, "0", "0,1", 0, 0, 0,
                            "1: the CUDA LM head's gradient carried as hi + lo bf16 (~2^-17) at one "
                            "more GEMM; 0 rounds it to one bf16 as bf16 autograd does"},
    [DF_KNOB_FP8_GEMM] = {"DFLASH_FP8_GEMM", DF_KNOB_FLAG, DF_KNOB_BENCH, "1", "0,1", 0, 0, 0,
                          "1: FP8 training's GEMMs on E4M3 tensor cores where cuBLASLt has them "
                          "(sm_90; MXFP8 on 10+; each shape checked once against 0); 0: the BF16 GEMM on the "
                          "rounded operands"},
    [DF_KNOB_FP8_SWIGLU] = {"DFLASH_FP8_SWIGLU", DF_KNOB_FLAG, DF_KNOB_BENCH, "1", "0,1", 0, 0, 0,
                            "1: with E4M3 tensor cores, SwiGLU writes the codes of the GEMM "
                            "operands it computes (the down projection's x, the gate and up "
                            "projections' dy); 0: the GEMMs round them (the same bits)"},
    [DF_KNOB_FP8_RMSNORM] = {"DFLASH_FP8_RMSNORM", DF_KNOB_FLAG, DF_KNOB_BENCH, "1", "0,1", 0, 0, 0,
                             "1: with E4M3 tensor cores, the RMSNorms before the projections write "
                             "the codes of the GEMMs that read their output (the forward's and, "
                             "recomputed, the weight gradients'); 0: the GEMMs round it (the same bits)"},
    [DF_KNOB_FP8_DY_CODES] = {"DFLASH_FP8_DY_CODES", DF_KNOB_FLAG, DF_KNOB_BENCH, "0", "0,1", 0, 0, 0,
                              "1: with E4M3 tensor cores, a gradient that is dy of both backward GEMMs "
                              "of a projection is rounded once for both (df_op_fp8_dy_codes); 0: each "
                              "GEMM rounds it (the same bits)"},
    [DF_KNOB_FP8_ONLY_CODES] = {"DFLASH_FP8_ONLY_CODES", DF_KNOB_FLAG, DF_KNOB_BENCH, "1", "0,1", 0, 0,
                                0,
                                "1: where SwiGLU wrote the codes of every GEMM that reads its output "
                                "and the trainer reads it nowhere else, it leaves out the BF16 values "
                                "(DF_FP8_ONLY_CODES); 0: it writes them too (the same bits)"},
    [DF_KNOB_FP8_WEIGHT_CODES] = {"DFLASH_FP8_WEIGHT_CODES", DF_KNOB_FLAG, DF_KNOB_BENCH, "1", "0,1", 0,
                                  0, 0,
                                  "1: FP8 training with one GPU keeps the weights' E4M3 codes, both "
                                  "layouts, written by AdamW with the weights; 0: each GEMM rounds "
                                  "its weight (the same bits, 2 bytes per parameter less memory)"},
    [DF_KNOB_FP8_LAZY_BF16] = {"DFLASH_FP8_LAZY_BF16", DF_KNOB_FLAG, DF_KNOB_BENCH, "0", "0,1", 0, 0,
                               0,
                               "1: where AdamW writes a kept weight's E4M3 codes it leaves its BF16 "
                               "values out, written from the master (the same bits) before anything "
                               "else reads them; 0: AdamW writes both"},
    [DF_KNOB_RMSNORM_BWD] = {"DFLASH_RMSNORM_BWD", DF_KNOB_CHOICE, DF_KNOB_BENCH, "onepass",
                             "onepass,twopass", 0, 0, 0,
                             "RMSNorm's CUDA backward: the one-pass kernel where it fits, or three "
                             "kernels for any layout; the same bits"},
    [DF_KNOB_ATTN_BWD] = {"DFLASH_ATTN_BWD", DF_KNOB_CHOICE, DF_KNOB_BENCH, NULL,
                          "simt,mma4,wg2,wg2f,wg3", 0, 0, 0,
                          "the drafter attention's backward; unset: wg3 on compute capability 9.0, "
                          "mma4 elsewhere (the retired mma, mma2, mma3, mma5, wg are bad values)"},
    [DF_KNOB_ATTN_PDL] = {"DFLASH_ATTN_PDL", DF_KNOB_FLAG, DF_KNOB_BENCH, "1", "0,1", 0, 0, 0,
                          "0: wg3's attention kernels launched plainly, not as programmatic "
                          "dependents (the same bits; 1-2% slower at 3 documents)"},
    [DF_KNOB_ATTN_DQ_PERSIST] = {"DFLASH_ATTN_DQ_PERSIST", DF_KNOB_FLAG, DF_KNOB_BENCH, "1", "0,1", 0,
                                 0, 0,
                                 "0: the wgmma dQ pass with one CTA per item instead of its "
                                 "persistent grid (the same bits; ~4% slower)"},
    [DF_KNOB_FAULT] = {"DFLASH_FAULT", DF_KNOB_STRING, DF_KNOB_TEST, NULL, "POINT=ERRNO[,...]", 0, 0, 0,
                       "fault injection: fake ERRNO (EIO, ENOSPC) at POINT (cache-final-dirsync, "
                       "log-write, cache-shard-write); at most 8 items, others ignored with a "
                       "warning"},
    [DF_KNOB_CKPT_TEST_KILL_AT] = {"DFLASH_CKPT_TEST_KILL_AT", DF_KNOB_CHOICE, DF_KNOB_TEST, NULL,
                                   "config,state,manifest,complete,rename,latest", 0, 0, 0,
                                   "crash test: the process SIGKILLs itself right after that stage "
                                   "of a checkpoint save"},
    [DF_KNOB_TEST_REPLICATE_DATA] = {"DFLASH_TEST_REPLICATE_DATA", DF_KNOB_FLAG, DF_KNOB_TEST, "0",
                                     "0,1", 0, 0, 0,
                                     "1: every rank of `dflash train` trains on rank 0's rows (N "
                                     "ranks must then give one rank's result)"},
    [DF_KNOB_RUN_ID] = {"DFLASH_RUN_ID", DF_KNOB_STRING, DF_KNOB_USER, NULL, "any text", 0, 0, 0,
                        "the id the ranks of one `dflash train` run share; unset: "
                        "TORCHELASTIC_RUN_ID, else Slurm's job and step ids"},
};

typedef struct knob_state {
    char *raw;     /* the text given (owned), NULL when unset or empty */
    int bad;       /* raw was refused: val is the default's */
    int val;       /* as df_knob_int reports it */
    char word[48]; /* the value in use as text (not for string knobs); "" for none */
} knob_state;

static knob_state g_st[DF_KNOB_COUNT];
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static int valid_id(df_knob_id id)
{
    return (int)id >= 0 && id < DF_KNOB_COUNT;
}

const df_knob_info *df_knob_info_of(df_knob_id id)
{
    return valid_id(id) ? &TABLE[id] : NULL;
}

const char *df_knob_kind_name(df_knob_kind kind)
{
    static const char *const n[] = {"flag", "int", "choice", "string"};
    return (int)kind >= 0 && kind <= DF_KNOB_STRING ? n[kind] : "?";
}

const char *df_knob_use_name(df_knob_use use)
{
    static const char *const n[] = {"user", "bench", "test"};
    return (int)use >= 0 && use <= DF_KNOB_TEST ? n[use] : "?";
}

/* The index of the comma-separated group of list holding the spelling text
 * ('|' separates a group's spellings), or -1. */
static int choice_index(const char *list, const char *text)
{
    size_t n = strlen(text);
    int idx = 0;
    for (const char *p = list; *p;) {
        size_t len = strcspn(p, ",|");
        if (len == n && !strncmp(p, text, n))
            return idx;
        p += len;
        if (*p == ',')
            idx++;
        if (*p)
            p++;
    }
    return -1;
}

/* The first spelling of group idx of list into out ("" when there is none). */
static void choice_word(const char *list, int idx, char *out, size_t cap)
{
    out[0] = 0;
    const char *p = list;
    for (int i = 0; i < idx && p; i++) {
        p = strchr(p, ',');
        if (p)
            p++;
    }
    if (idx >= 0 && p)
        snprintf(out, cap, "%.*s", (int)strcspn(p, ",|"), p);
}

/* The list as a reader would write it: "a, b (or b2), c". */
static void choice_list(const char *list, char *out, size_t cap)
{
    size_t o = 0;
    out[0] = 0;
    for (const char *p = list; *p && o < cap;) {
        size_t group = strcspn(p, ","), first = strcspn(p, ",|");
        o += (size_t)snprintf(out + o, cap - o, "%s%.*s", p == list ? "" : ", ", (int)first, p);
        if (first < group && o < cap)
            o += (size_t)snprintf(out + o, cap - o, " (or %.*s)", (int)(group - first - 1),
                                  p + first + 1);
        p += group;
        if (*p)
            p++;
    }
}

static int default_val(const df_knob_info *k)
{
    if (!k->def)
        return k->kind == DF_KNOB_CHOICE ? -1 : 0;
    switch (k->kind) {
    case DF_KNOB_FLAG:
    case DF_KNOB_INT:
        return atoi(k->def);
    case DF_KNOB_CHOICE:
        return choice_index(k->allowed, k->def);
    case DF_KNOB_STRING:
        return 1;
    }
    return 0;
}

int df_knob_parse(df_knob_id id, const char *text, int *val, df_err *e)
{
    if (!valid_id(id))
        return df_errf(e, -EINVAL, "knob %d: no such knob", (int)id);
    const df_knob_info *k = &TABLE[id];
    *val = default_val(k);
    if (!text || !*text)
        return 0;
    switch (k->kind) {
    case DF_KNOB_FLAG:
        if (strcmp(text, "0") && strcmp(text, "1"))
            return df_errf(e, -EINVAL, "%s=%.200s: want 0 or 1", k->name, text);
        *val = text[0] == '1';
        return 0;
    case DF_KNOB_INT: {
        int v = 0;
        if (df_opt_int(k->name, text, k->lo, k->hi, &v, NULL))
            return df_errf(e, -EINVAL, "%s=%.200s: want an integer in %d..%d", k->name, text, k->lo,
                           k->hi);
        *val = v;
        return 0;
    }
    case DF_KNOB_CHOICE: {
        int v = choice_index(k->allowed, text);
        if (v < 0) {
            char list[256];
            choice_list(k->allowed, list, sizeof list);
            return df_errf(e, -EINVAL, "%s=%.200s: want one of %s", k->name, text, list);
        }
        *val = v;
        return 0;
    }
    case DF_KNOB_STRING:
        *val = 1;
        return 0;
    }
    return 0;
}

/* Gives knob id the text (NULL or "": unset); the parse's code. */
static int apply(df_knob_id id, const char *text)
{
    knob_state *s = &g_st[id];
    const df_knob_info *k = &TABLE[id];
    free(s->raw);
    s->raw = NULL;
    if (text && *text)
        s->raw = strdup(text); /* NULL (out of memory): as unset */
    int rc = df_knob_parse(id, s->raw, &s->val, NULL);
    s->bad = rc != 0;
    s->word[0] = 0;
    if (k->kind == DF_KNOB_CHOICE)
        choice_word(k->allowed, s->val, s->word, sizeof s->word);
    else if (k->kind != DF_KNOB_STRING)
        snprintf(s->word, sizeof s->word, "%d", s->val);
    return rc;
}

static void knobs_init(void)
{
    for (int i = 0; i < DF_KNOB_COUNT; i++)
        apply((df_knob_id)i, getenv(TABLE[i].name));
    if (g_st[DF_KNOB_LOG].val < DF_LOG_WARN)
        return;
    for (int i = 0; i < DF_KNOB_COUNT; i++) {
        if (!g_st[i].bad || TABLE[i].bad_is_error)
            continue;
        df_err e;
        int v;
        df_knob_parse((df_knob_id)i, g_st[i].raw, &v, &e);
        if (TABLE[i].def)
            fprintf(stderr, "dflash warn: %s; using the default (%s)\n", e.msg, TABLE[i].def);
        else
            fprintf(stderr, "dflash warn: %s; using the default\n", e.msg);
    }
}

void df_knob_allowed(df_knob_id id, char *out, size_t cap)
{
    if (!cap)
        return;
    out[0] = 0;
    if (!valid_id(id))
        return;
    const df_knob_info *k = &TABLE[id];
    if (k->kind == DF_KNOB_CHOICE)
        choice_list(k->allowed, out, cap);
    else if (k->kind == DF_KNOB_FLAG)
        snprintf(out, cap, "0 or 1");
    else
        snprintf(out, cap, "%s", k->allowed);
}

int df_knob_int(df_knob_id id)
{
    pthread_once(&g_once, knobs_init);
    return valid_id(id) ? g_st[id].val : 0;
}

const char *df_knob_str(df_knob_id id)
{
    pthread_once(&g_once, knobs_init);
    if (!valid_id(id))
        return NULL;
    if (TABLE[id].kind == DF_KNOB_STRING)
        return g_st[id].raw;
    return g_st[id].word[0] ? g_st[id].word : NULL;
}

const char *df_knob_raw(df_knob_id id)
{
    pthread_once(&g_once, knobs_init);
    return valid_id(id) ? g_st[id].raw : NULL;
}

int df_knob_bad(df_knob_id id)
{
    pthread_once(&g_once, knobs_init);
    return valid_id(id) ? g_st[id].bad : 0;
}

int df_knob_check(df_knob_id id, df_err *e)
{
    pthread_once(&g_once, knobs_init);
    if (!valid_id(id))
        return df_errf(e, -EINVAL, "knob %d: no such knob", (int)id);
    if (!g_st[id].bad)
        return 0;
    int v;
    return df_knob_parse(id, g_st[id].raw, &v, e);
}

int df_knob_set(df_knob_id id, const char *text)
{
    pthread_once(&g_once, knobs_init);
    if (!valid_id(id))
        return -EINVAL;
    return apply(id, text);
}
