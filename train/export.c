/* export.c - the serving export: config.json + model.safetensors, written whole (ckpt.h). */
#include "ckpt.h"
#include "ckpt_internal.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "dtype.h"
#include "fsutil.h"
#include "safetensors.h"

#define PATHN 4096

static int same_table(const df_params *a, const df_params *b)
{
    if (a->n != b->n || a->total != b->total)
        return 0;
    for (int i = 0; i < a->n; i++)
        if (strcmp(a->p[i].name, b->p[i].name) || a->p[i].offset != b->p[i].offset ||
            a->p[i].ndim != b->p[i].ndim || a->p[i].shape[0] != b->p[i].shape[0] ||
            a->p[i].shape[1] != b->p[i].shape[1])
            return 0;
    return 1;
}

/* An existing export directory may hold only what an export writes (with
 * extra: that file too). */
static int only_export_files(const char *dir, const df_export_extra *extra, df_err *e)
{
    DIR *d = opendir(dir);
    if (!d)
        return df_errf(e, -errno, "%s: cannot open directory: %s", dir, strerror(errno));
    static const char *const ok[] = {".", "..", "config.json", "model.safetensors",
                                     "config.json.tmp", "model.safetensors.tmp"};
    int rc = 0;
    struct dirent *de;
    while (!rc && (de = readdir(d))) {
        size_t i;
        for (i = 0; i < sizeof ok / sizeof ok[0]; i++)
            if (!strcmp(de->d_name, ok[i]))
                break;
        size_t xl = extra ? strlen(extra->name) : 0;
        if (i == sizeof ok / sizeof ok[0] && extra && !strncmp(de->d_name, extra->name, xl) &&
            (!de->d_name[xl] || !strcmp(de->d_name + xl, ".tmp")))
            continue;
        if (i == sizeof ok / sizeof ok[0])
            rc = df_errf(e, -EEXIST, "%s: exists and holds %s: not replacing it (export into a "
                         "new or an earlier export directory)", dir, de->d_name);
    }
    closedir(d);
    return rc;
}

static int parent_of(const char *path, char *out)
{
    snprintf(out, PATHN, "%s", path);
    size_t n = strlen(out);
    while (n > 1 && out[n - 1] == '/')
        out[--n] = 0;
    char *s = strrchr(out, '/');
    if (!s)
        snprintf(out, PATHN, ".");
    else if (s == out)
        out[1] = 0;
    else
        *s = 0;
    return 0;
}

int df_export_drafter(const char *out_dir, const df_drafter_config *c, const df_params *ps,
                      const float *master, df_err *e)
{
    return df_export_drafter_with(out_dir, c, ps, master, NULL, e);
}

int df_export_drafter_with(const char *out_dir, const df_drafter_config *c, const df_params *ps,
                           const float *master, const df_export_extra *extra, df_err *e)
{
    if (extra && (!extra->name || !*extra->name || strchr(extra->name, '/') ||
                  !strcmp(extra->name, "config.json") ||
                  !strcmp(extra->name, "model.safetensors") || !extra->text))
        return df_errf(e, -EINVAL, "%s: bad extra file for the export", out_dir);
    char *cfg = df_drafter_config_to_json(c, e);
    if (!cfg)
        return e ? e->code : -EINVAL;
    df_params mine;
    int rc = df_params_build(c, &mine, e);
    if (rc < 0) {
        free(cfg);
        return rc;
    }
    uint16_t *bf = NULL;
    df_st_writer *w = NULL;
    int made_tmp = 0;
    char tmp[PATHN], old[PATHN], parent[PATHN], p[PATHN];
    if (!same_table(ps, &mine)) {
        rc = df_errf(e, -DF_EMISMATCH, "%s: the parameter table does not match the drafter config",
                     out_dir);
        goto out;
    }
    if (snprintf(tmp, sizeof tmp, "%s.dflash-export.tmp", out_dir) >= (int)sizeof tmp ||
        snprintf(old, sizeof old, "%s.dflash-export.old", out_dir) >= (int)sizeof old) {
        rc = df_errf(e, -ENAMETOOLONG, "%s: path too long", out_dir);
        goto out;
    }
    parent_of(out_dir, parent);
    if (!(bf = malloc((size_t)ps->total * sizeof *bf))) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory for %" PRId64 " bf16 weights", out_dir,
                     ps->total);
        goto out;
    }
    for (int i = 0; i < ps->n; i++) {
        const df_param *q = &ps->p[i];
        for (int64_t k = 0; k < q->numel; k++) {
            float x = master[q->offset + k];
            if (!isfinite(x)) {
                rc = df_errf(e, -EINVAL, "%s: %s[%" PRId64 "] is %g: not exporting non-finite "
                             "weights", out_dir, q->name, k, (double)x);
                goto out;
            }
            bf[q->offset + k] = df_f32_to_bf16(x);
        }
    }
    struct stat sb;
    int exists = lstat(out_dir, &sb) == 0;
    if (exists && !S_ISDIR(sb.st_mode)) {
        rc = df_errf(e, -ENOTDIR, "%s: exists and is not a directory", out_dir);
        goto out;
    }
    if (exists && (rc = only_export_files(out_dir, extra, e)) < 0)
        goto out;
    if ((rc = df_ckpt_rm_flat_dir(tmp, e)) < 0 || (rc = df_ckpt_rm_flat_dir(old, e)) < 0 ||
        (rc = df_mkdirs(tmp, e)) < 0)
        goto out;
    made_tmp = 1;
    if ((rc = df_ckpt_write_text(tmp, "config.json", cfg, strlen(cfg), e)) < 0 ||
        (extra && (rc = df_ckpt_write_text(tmp, extra->name, extra->text, strlen(extra->text), e)) < 0) ||
        (rc = df_ckpt_join(p, tmp, "model.safetensors", e)) < 0 || (rc = df_st_writer_open(p, &w, e)) < 0)
        goto out;
    for (int i = 0; i < ps->n && !rc; i++)
        rc = df_st_writer_add(w, ps->p[i].name, DF_DTYPE_BF16, ps->p[i].ndim, ps->p[i].shape,
                              bf + ps->p[i].offset, e);
    if (rc < 0 || (rc = df_st_writer_set_metadata(w, "format", "pt", e)) < 0 ||
        (rc = df_st_writer_finish(w, e)) < 0)
        goto out;
    if (!exists) {
        if (rename(tmp, out_dir) != 0) {
            rc = df_errf(e, -errno, "%s: rename to %s failed: %s", tmp, out_dir, strerror(errno));
            goto out;
        }
        made_tmp = 0;
        rc = df_fsync_dir(parent, e);
        goto out;
    }
    /* Replace: an atomic exchange where the file system has it, else move the
     * old directory aside first (a crash between leaves OUT.old, never a mix). */
    if (renameat2(AT_FDCWD, tmp, AT_FDCWD, out_dir, RENAME_EXCHANGE) == 0) {
        if ((rc = df_fsync_dir(parent, e)) < 0)
            goto out;
        rc = df_ckpt_rm_flat_dir(tmp, e); /* the previous export */
        made_tmp = 0;
        goto out;
    }
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
        rc = df_errf(e, -errno, "%s: exchange with %s failed: %s", tmp, out_dir, strerror(errno));
        goto out;
    }
    if (rename(out_dir, old) != 0 || rename(tmp, out_dir) != 0) {
        rc = df_errf(e, -errno, "%s: replacing failed: %s", out_dir, strerror(errno));
        goto out;
    }
    made_tmp = 0;
    if ((rc = df_fsync_dir(parent, e)) < 0)
        goto out;
    rc = df_ckpt_rm_flat_dir(old, e);
out:
    if (made_tmp) {
        df_err e2;
        df_ckpt_rm_flat_dir(tmp, &e2);
    }
    df_st_writer_free(w);
    free(bf);
    df_params_free(&mine);
    free(cfg);
    return rc;
}
