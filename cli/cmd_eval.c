/* dflash eval - score an exported drafter on a held-out cache: the trainer's
 * own evaluation (the same rows, anchors and walk as `train --eval-cache`),
 * run as a zero-step fine-tune of the export in a scratch run folder that is
 * removed afterwards. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <ftw.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cmds.h"
#include "fsutil.h"
#include "opt.h"
#include "train.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: dflash eval --cache EVAL --drafter DIR --target TARGET [options]\n"
            "Scores the drafter export in DIR (config.json + model.safetensors: a `dflash\n"
            "export`, or a released DFlash drafter with the same tensor names) on the held-out\n"
            "cache EVAL of the target TARGET (whose frozen embedding and lm_head the drafter\n"
            "uses): loss, acc[k] per block position, tau_hat and tau_walk, exactly as `dflash\n"
            "train --eval-cache EVAL --eval-rows R` scores it (same rows and anchors). A projected\n"
            "EVAL (dflash cache project) reads the features through fc P^T.\n"
            "  --rows R            rows scored (default 64, as train's --eval-rows)\n"
            "  --no-walk           skip tau_walk (greedy decoding over the eval text: the slow part)\n"
            "  --max-tokens N --max-anchors N   row shape (defaults 4096, 512, as train's)\n"
            "  --device cpu|cuda|auto  --gpu I  --threads N   where it runs (default cpu)\n"
            "  --work DIR          scratch run folder (default: a new one under $TMPDIR or /tmp,\n"
            "                      removed at the end; a given one is kept)\n"
            "  --json              print the figures as one JSON object\n");
}

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb, (void)flag, (void)ftw;
    return remove(path) ? -1 : 0;
}

int cmd_eval(int argc, char **argv)
{
    df_train_opts o;
    df_train_opts_defaults(&o);
    o.steps = 0;
    o.eval_rows = 64;
    o.quiet = 1;
    o.no_ckpt = 1;
    o.no_best = 1;
    const char *work = NULL;
    int json = 0, bad = 0;
    df_err oe = {0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--no-walk")) { o.no_eval_walk = 1; continue; }
        if (!strcmp(a, "--json")) { json = 1; continue; }
        if (i + 1 >= argc) {
            fprintf(stderr, "dflash eval: %s: missing value (or unknown option)\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--cache")) o.eval_cache = o.cache_dir = v;
        else if (!strcmp(a, "--drafter")) o.init_from = v;
        else if (!strcmp(a, "--target")) o.target_dir = v;
        else if (!strcmp(a, "--work")) work = v;
        else if (!strcmp(a, "--device")) o.device = v;
        else if (!strcmp(a, "--rows")) bad = df_opt_int(a, v, 1, 1 << 20, &o.eval_rows, &oe);
        else if (!strcmp(a, "--max-tokens")) bad = df_opt_int(a, v, 1, 1 << 24, &o.max_tokens, &oe);
        else if (!strcmp(a, "--max-anchors")) bad = df_opt_int(a, v, 1, 1 << 20, &o.max_anchors, &oe);
        else if (!strcmp(a, "--gpu")) bad = df_opt_int(a, v, 0, 1023, &o.gpu, &oe);
        else if (!strcmp(a, "--threads")) bad = df_opt_int(a, v, 0, 4096, &o.threads, &oe);
        else {
            fprintf(stderr, "dflash eval: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "dflash eval: %s\n", oe.msg);
            return 2;
        }
    }
    if (!o.eval_cache || !o.init_from || !o.target_dir) {
        fprintf(stderr, "dflash eval: --cache, --drafter and --target are required\n");
        usage(stderr);
        return 2;
    }
    if (o.device && strcmp(o.device, "cpu") && strcmp(o.device, "cuda") &&
        strcmp(o.device, "auto")) {
        fprintf(stderr, "dflash eval: --device '%s': want cpu, cuda or auto\n", o.device);
        return 2;
    }
    char tmpl[4200];
    if (work) {
        o.run_dir = work;
    } else {
        const char *t = getenv("TMPDIR");
        snprintf(tmpl, sizeof tmpl, "%s/dflash-eval-XXXXXX", t && *t ? t : "/tmp");
        if (!mkdtemp(tmpl)) {
            fprintf(stderr, "dflash eval: cannot make a scratch folder %s: %s\n", tmpl,
                    strerror(errno));
            return 1;
        }
        o.run_dir = tmpl;
    }
    df_err e = {0};
    int rc = df_train_run(&o, &e), ret = 0;
    char *log = NULL;
    size_t len = 0;
    char path[4300];
    cJSON *line = NULL;
    if (rc) { /* the trainer names the export by its option there */
        const char *m = e.msg;
        if (!strncmp(m, "--init-from ", 12))
            fprintf(stderr, "dflash eval: --drafter %s\n", m + 12);
        else
            fprintf(stderr, "dflash eval: %s\n", m);
        ret = rc == -EINVAL ? 2 : 1;
        goto out;
    }
    snprintf(path, sizeof path, "%s/log.jsonl", o.run_dir);
    if (df_file_read_all(path, (size_t)1 << 26, &log, &len, &e)) {
        fprintf(stderr, "dflash eval: %s\n", e.msg);
        ret = 1;
        goto out;
    }
    /* the evaluation's line: the last one holding eval_loss */
    for (char *p = log, *nl; p && *p; p = nl ? nl + 1 : NULL) {
        nl = strchr(p, '\n');
        if (nl)
            *nl = 0;
        if (strstr(p, "\"eval_loss\"")) {
            cJSON_Delete(line);
            line = cJSON_Parse(p);
        }
    }
    if (!line) {
        fprintf(stderr, "dflash eval: %s: no evaluation line\n", path);
        ret = 1;
        goto out;
    }
    cJSON_DeleteItemFromObject(line, "step");
    cJSON_AddStringToObject(line, "drafter", o.init_from);
    cJSON_AddStringToObject(line, "cache", o.eval_cache);
    if (json) {
        char *s = cJSON_PrintUnformatted(line);
        if (s)
            printf("%s\n", s);
        free(s);
    } else {
        const cJSON *it;
        printf("%s on %s:\n", o.init_from, o.eval_cache);
        cJSON_ArrayForEach(it, line) {
            if (cJSON_IsNumber(it))
                printf("  %-24s %.6g\n", it->string, it->valuedouble);
            else if (cJSON_IsArray(it)) {
                printf("  %-24s", it->string);
                const cJSON *x;
                cJSON_ArrayForEach(x, it) printf(" %.4f", x->valuedouble);
                printf("\n");
            }
        }
    }
out:
    cJSON_Delete(line);
    free(log);
    if (!work)
        nftw(tmpl, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
    return ret;
}
