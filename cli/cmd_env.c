/* `dflash env [--markdown]`: the environment knobs (common/knobs.h) with the
 * values in use, or as docs/KNOBS.md (--markdown, no values: the file is
 * this output, and test_cli.sh checks that they agree). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmds.h"
#include "knobs.h"

/* What the dflash command itself reads from its launcher (cli/ranks.c,
 * cmd_eval.c): the program's edge, not knobs of the library. */
static const char *const LAUNCHER[] = {
    "RANK",          "WORLD_SIZE",         "LOCAL_RANK",    "SLURM_PROCID",
    "SLURM_NTASKS",  "SLURM_LOCALID",      "NODE_RANK",     "NNODES",
    "SLURM_NODEID",  "SLURM_NNODES",       "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID",
    "SLURM_STEP_ID", "MASTER_ADDR",        "MASTER_PORT",   "TORCHELASTIC_USE_AGENT_STORE",
    "TMPDIR"};
#define N_LAUNCHER (sizeof LAUNCHER / sizeof LAUNCHER[0])

static void usage(FILE *f)
{
    fprintf(f, "usage: dflash env [--markdown]\n"
               "  every DFLASH_* environment variable dflash reads: kind, default, what it allows,\n"
               "  whom it is for (user, bench, test), what it does, and the value in use now\n"
               "  --markdown  the table without values, as docs/KNOBS.md\n");
}

/* A markdown table cell: '|' escaped. */
static void cell(const char *s)
{
    for (; *s; s++) {
        if (*s == '|')
            fputc('\\', stdout);
        fputc(*s, stdout);
    }
}

static void markdown(void)
{
    printf("# Environment knobs\n\n"
           "Every `DFLASH_*` variable dflash reads, from the one table in `common/knobs.c`: this file "
           "is `dflash env --markdown` (test_cli checks that they agree), and `dflash env` shows the "
           "values in use. Each is read once per process; unset or empty is the default; a bad value "
           "warns once and takes the default, except where it says it is an error.\n\n"
           "| variable | kind | default | allowed | for | what |\n"
           "|---|---|---|---|---|---|\n");
    char allowed[256];
    for (int i = 0; i < DF_KNOB_COUNT; i++) {
        const df_knob_info *k = df_knob_info_of((df_knob_id)i);
        df_knob_allowed((df_knob_id)i, allowed, sizeof allowed);
        printf("| `%s` | %s | ", k->name, df_knob_kind_name(k->kind));
        if (k->def)
            printf("`%s`", k->def);
        else
            printf("(none)");
        printf(" | ");
        cell(allowed);
        printf(" | %s | ", df_knob_use_name(k->use));
        cell(k->what);
        printf(" |\n");
    }
    printf("\nThe `dflash` command also reads its launcher's variables (not knobs): ");
    for (size_t i = 0; i < N_LAUNCHER; i++)
        printf("%s`%s`", i ? ", " : "", LAUNCHER[i]);
    printf(".\n");
}

static void current(void)
{
    printf("dflash's environment knobs (docs/KNOBS.md), read once at start; unset or empty is the "
           "default.\n\n");
    char allowed[256], head[320];
    for (int i = 0; i < DF_KNOB_COUNT; i++) {
        const df_knob_id id = (df_knob_id)i;
        const df_knob_info *k = df_knob_info_of(id);
        const char *raw = df_knob_raw(id), *use = df_knob_str(id);
        if (df_knob_bad(id))
            snprintf(head, sizeof head, "%s=%.200s (bad: %s)", k->name, raw,
                     k->bad_is_error ? "an error at use" : "the default in use");
        else if (raw)
            snprintf(head, sizeof head, "%s=%.200s (set)", k->name, raw);
        else if (use)
            snprintf(head, sizeof head, "%s=%s (default)", k->name, use);
        else
            snprintf(head, sizeof head, "%s unset (default)", k->name);
        df_knob_allowed(id, allowed, sizeof allowed);
        printf("%-44s %-5s  %s: %s\n    %s\n", head, df_knob_use_name(k->use),
               df_knob_kind_name(k->kind), allowed, k->what);
    }
    printf("\nlauncher variables the dflash command reads:");
    int any = 0;
    for (size_t i = 0; i < N_LAUNCHER; i++) {
        const char *v = getenv(LAUNCHER[i]);
        if (v && *v) {
            printf("\n  %s=%s", LAUNCHER[i], v);
            any = 1;
        }
    }
    printf("%s\n", any ? "" : " none set");
}

int cmd_env(int argc, char **argv)
{
    int md = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--markdown")) {
            md = 1;
        } else if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            usage(stdout);
            return 0;
        } else {
            fprintf(stderr, "dflash env: unknown argument '%s'\n", argv[i]);
            usage(stderr);
            return 2;
        }
    }
    if (md)
        markdown();
    else
        current();
    return 0;
}
