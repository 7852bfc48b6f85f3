/* dflash export: the serving export of any checkpoint of a run. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "basis.h"
#include "best.h"
#include "cache.h"
#include "ckpt.h"
#include "cmds.h"
#include "opt.h"
#include "params.h"
#include "projected.h"

static void export_usage(FILE *f)
{
    fprintf(f,
            "usage: dflash export --run RUN --out DIR [--step N | --best] [--cache CACHE | --basis FILE]\n"
            "Writes DIR/config.json + DIR/model.safetensors, the drafter as serving engines load\n"
            "it (what `dflash train` writes to RUN/export at its end), from a checkpoint of RUN.\n"
            "  --run RUN      a training run directory (its ckpt-* checkpoints)\n"
            "  --step N       the checkpoint at step N (default: the newest)\n"
            "  --best         the export of the step with the best evaluation (RUN/best/, kept\n"
            "                 by training with --eval-cache; projected runs: already merged)\n"
            "  --out DIR      the export directory (replaced atomically if it holds an export)\n"
            "  --cache CACHE  for a run on a projected cache: that cache (its basis.dfb, checked\n"
            "                 against its manifest) or --basis FILE: the export merges fc = fc_r P\n"
            "Exit status: 0 done, 1 bad data or I/O, 2 bad usage.\n");
}

/* The checkpoint directory of RUN at step (-1: the newest complete one). */
static int pick_ckpt(const char *run, long long step, char *dir, size_t cap, df_err *e)
{
    df_ckpt_info *ls = NULL;
    int n = 0, rc = df_ckpt_list(run, &ls, &n, e), at = -1;
    if (rc)
        return rc;
    for (int i = 0; i < n; i++)
        if (ls[i].complete && (step < 0 || ls[i].step == step))
            at = i;
    if (at < 0) {
        char have[512] = "";
        size_t len = 0;
        for (int i = 0; i < n && len + 24 < sizeof have; i++)
            if (ls[i].complete)
                len += (size_t)snprintf(have + len, sizeof have - len, "%s%" PRId64,
                                        len ? ", " : "", ls[i].step);
        rc = step < 0 ? df_errf(e, -ENOENT, "%s: no complete checkpoint", run)
                      : df_errf(e, -ENOENT, "%s: no complete checkpoint at step %lld (steps: %s)",
                                run, step, len ? have : "none");
    } else if (snprintf(dir, cap, "%s/%s", run, ls[at].name) >= (int)cap) {
        rc = df_errf(e, -ENAMETOOLONG, "%s: path too long", run);
    }
    free(ls);
    return rc;
}

/* The basis of a projected run: from --basis, or the --cache it was trained on. */
static int load_basis(const char *cache_dir, const char *basis_path, df_basis *b, df_err *e)
{
    if (basis_path)
        return df_basis_read(basis_path, b, e);
    df_cache *c = df_cache_open(cache_dir, e);
    if (!c)
        return e->code ? e->code : -EIO;
    const df_cache_params *p = &df_cache_get_info(c)->params;
    int rc = p->proj_rank ? df_cache_load_basis(cache_dir, p, b, e)
                          : df_errf(e, -DF_EMISMATCH, "%s is not a projected cache", cache_dir);
    df_cache_close(c);
    return rc;
}

/* --best: RUN/best read back whole (every tensor checked against its config,
 * df_export_load) and written to outd as any export. */
static int export_best(const char *run, const char *outd)
{
    df_err e = {0};
    df_best b;
    df_drafter_config c;
    df_params ps = {0};
    float *w = NULL;
    char dir[4200];
    snprintf(dir, sizeof dir, "%s/%s", run, DF_BEST_DIR);
    int rc = df_best_load(run, &b, &e);
    if (!rc && (rc = df_export_load(dir, &c, &ps, &w, &e)) < 0)
        df_err_wrap(&e, "%s", dir);
    if (!rc)
        rc = df_export_drafter(outd, &c, &ps, w, &e);
    if (!rc)
        printf("exported the best step %" PRId64 " of %s (%s %.4f) to %s (config.json + "
               "model.safetensors)\n", b.step, run, b.metric, b.value, outd);
    else
        fprintf(stderr, "dflash export: %s\n", e.msg);
    free(w);
    df_params_free(&ps);
    return rc ? 1 : 0;
}

int cmd_export(int argc, char **argv)
{
    const char *run = NULL, *outd = NULL, *cache_dir = NULL, *basis_path = NULL;
    int64_t step = -1;
    int best = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            export_usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--best")) {
            best = 1;
            continue;
        }
        const char *v = i + 1 < argc ? argv[++i] : NULL;
        df_err pe = {0};
        int bad = !v;
        if (bad)
            ;
        else if (!strcmp(a, "--run"))
            run = v;
        else if (!strcmp(a, "--out"))
            outd = v;
        else if (!strcmp(a, "--cache"))
            cache_dir = v;
        else if (!strcmp(a, "--basis"))
            basis_path = v;
        else if (!strcmp(a, "--step"))
            bad = df_opt_i64(a, v, 0, INT64_MAX, &step, &pe) != 0;
        else {
            fprintf(stderr, "dflash export: unknown option '%s'\n", a);
            export_usage(stderr);
            return 2;
        }
        if (bad && pe.code) {
            fprintf(stderr, "dflash export: bad or missing value: %s\n", pe.msg);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "dflash export: %s: bad or missing value%s%s\n", a, v ? " " : "",
                    v ? v : "");
            return 2;
        }
    }
    if (!run || !outd || (cache_dir && basis_path)) {
        fprintf(stderr, "dflash export: want --run and --out, and at most one of --cache, "
                        "--basis\n");
        export_usage(stderr);
        return 2;
    }
    if (best && (step >= 0 || cache_dir || basis_path)) {
        fprintf(stderr, "dflash export: --best is the export kept by training (projected runs "
                        "merged already): no --step, --cache or --basis with it\n");
        return 2;
    }
    df_err e = {0};
    if (best)
        return export_best(run, outd);
    df_ckpt_state st = {0};
    df_params ps = {0};
    df_basis b = {0};
    char dir[4200];
    int rc = pick_ckpt(run, step, dir, sizeof dir, &e);
    if (!rc)
        rc = df_ckpt_load(dir, &st, &e);
    if (!rc)
        rc = df_params_build(&st.config, &ps, &e);
    if (!rc && st.config.feature_dim) {
        if (!cache_dir && !basis_path)
            rc = df_errf(&e, -EINVAL, "%s: a run on a projected cache (fc reads %d features): "
                         "give its cache (--cache) or basis (--basis) to merge fc = fc_r P", dir,
                         st.config.feature_dim);
        else if (!(rc = load_basis(cache_dir, basis_path, &b, &e)) &&
                 memcmp(b.layer_ids, st.config.target_layer_ids,
                        sizeof(int32_t) * (size_t)b.K))
            rc = df_errf(&e, -DF_EMISMATCH, "%s: a basis of target layers %d.. ; the drafter "
                         "reads layers %d..", cache_dir ? cache_dir : basis_path, b.layer_ids[0],
                         st.config.target_layer_ids[0]);
        if (!rc)
            rc = df_export_drafter_projected(outd, &st.config, &ps, st.master, &b, &e);
    } else if (!rc && (cache_dir || basis_path)) {
        fprintf(stderr, "dflash export: %s: not a run on a projected cache; --cache and --basis "
                        "are for those\n", dir);
        rc = 2;
    } else if (!rc) {
        rc = df_export_drafter(outd, &st.config, &ps, st.master, &e);
    }
    if (rc == 0)
        printf("exported step %" PRId64 " of %s to %s (config.json + model.safetensors)\n",
               st.step, run, outd);
    else if (rc < 0)
        fprintf(stderr, "dflash export: %s\n", e.msg);
    df_basis_free(&b);
    df_params_free(&ps);
    df_ckpt_state_free(&st);
    return rc == 0 ? 0 : rc == 2 ? 2 : 1;
}
