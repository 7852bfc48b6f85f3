/* ckpt.c - training checkpoints (see ckpt.h; the serving export: export.c).
 *
 * Test hook: when the knob DFLASH_CKPT_TEST_KILL_AT (knobs.h) names a stage
 * of df_ckpt_save ("config", "state", "manifest", "complete", "rename",
 * "latest"), the process SIGKILLs itself right after that stage, so tests can
 * check what a crash at that point leaves behind.
 */
#include "ckpt.h"
#include "ckpt_internal.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32c.h"
#include "dtype.h"
#include "fsutil.h"
#include "knobs.h"
#include "safetensors.h"
#include "sha256.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "checkpoints store the host's floats as little-endian safetensors"
#endif

#define PATHN 4096
#define SMALL_MAX (1u << 20) /* manifest.json, COMPLETE, latest */
#define CONFIG_MAX (16u << 20)

static const char *const ARRAYS[3] = {"master", "adam_m", "adam_v"};

static void test_hook(const char *stage)
{
    const char *v = df_knob_str(DF_KNOB_CKPT_TEST_KILL_AT);
    if (v && !strcmp(v, stage))
        raise(SIGKILL);
}

int df_ckpt_join(char *out, const char *dir, const char *name, df_err *e)
{
    if (df_path_join(out, PATHN, dir, name) < 0)
        return df_errf(e, -ENAMETOOLONG, "%s/%s: path too long", dir, name);
    return 0;
}

/* "ckpt-<digits>" with an optional suffix; returns the kind: 0 = final,
 * 1 = ".tmp", 2 = ".deleting", -1 = not ours. */
static int parse_name(const char *name, int64_t *step)
{
    if (strncmp(name, "ckpt-", 5))
        return -1;
    const char *p = name + 5;
    int64_t s = 0;
    int nd = 0;
    for (; *p >= '0' && *p <= '9'; p++, nd++) {
        if (nd >= 18)
            return -1;
        s = s * 10 + (*p - '0');
    }
    if (nd == 0)
        return -1;
    *step = s;
    if (!*p)
        return 0;
    if (!strcmp(p, ".tmp"))
        return 1;
    if (!strcmp(p, ".deleting"))
        return 2;
    return -1;
}

static void ckpt_name(char *out, size_t n, int64_t step)
{
    snprintf(out, n, "ckpt-%010" PRId64, step);
}

int df_ckpt_rm_flat_dir(const char *dir, df_err *e)
{
    DIR *d = opendir(dir);
    if (!d) {
        if (errno == ENOENT)
            return 0;
        return df_errf(e, -errno, "%s: cannot open directory: %s", dir, strerror(errno));
    }
    int rc = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        if (unlinkat(dirfd(d), de->d_name, 0) != 0) {
            rc = df_errf(e, -errno, "%s/%s: cannot remove: %s", dir, de->d_name, strerror(errno));
            break;
        }
    }
    closedir(d);
    if (!rc && rmdir(dir) != 0)
        rc = df_errf(e, -errno, "%s: cannot remove directory: %s", dir, strerror(errno));
    return rc;
}

void df_ckpt_state_free(df_ckpt_state *st)
{
    if (!st)
        return;
    free(st->master);
    free(st->adam_m);
    free(st->adam_v);
    free(st->rng_state);
    free(st->data_position);
    free(st->hparams_json);
    memset(st, 0, sizeof *st);
}

static int cmp_info(const void *a, const void *b)
{
    int64_t x = ((const df_ckpt_info *)a)->step, y = ((const df_ckpt_info *)b)->step;
    return (x > y) - (x < y);
}

int df_ckpt_list(const char *run_dir, df_ckpt_info **out, int *n, df_err *e)
{
    *out = NULL;
    *n = 0;
    DIR *d = opendir(run_dir);
    if (!d)
        return df_errf(e, -errno, "%s: cannot open run directory: %s", run_dir, strerror(errno));
    df_ckpt_info *v = NULL;
    int cnt = 0, cap = 0, rc = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        int64_t step;
        if (parse_name(de->d_name, &step) != 0)
            continue;
        struct stat sb;
        if (fstatat(dirfd(d), de->d_name, &sb, 0) != 0 || !S_ISDIR(sb.st_mode))
            continue;
        if (cnt == cap) {
            cap = cap ? 2 * cap : 16;
            df_ckpt_info *nv = realloc(v, (size_t)cap * sizeof *v);
            if (!nv) {
                rc = df_errf(e, -ENOMEM, "%s: out of memory listing checkpoints", run_dir);
                break;
            }
            v = nv;
        }
        df_ckpt_info *it = &v[cnt++];
        memset(it, 0, sizeof *it);
        it->step = step;
        snprintf(it->name, sizeof it->name, "%s", de->d_name);
        char marker[PATHN];
        snprintf(marker, sizeof marker, "%s/COMPLETE", de->d_name);
        it->complete = fstatat(dirfd(d), marker, &sb, 0) == 0 && S_ISREG(sb.st_mode);
    }
    closedir(d);
    if (rc) {
        free(v);
        return rc;
    }
    if (cnt > 1)
        qsort(v, (size_t)cnt, sizeof *v, cmp_info);
    *out = v;
    *n = cnt;
    return 0;
}

/* Renames run/name to run/name.deleting, makes that durable, removes it. */
static int remove_ckpt(const char *run_dir, const char *name, df_err *e)
{
    char from[PATHN], to[PATHN];
    int rc = df_ckpt_join(from, run_dir, name, e);
    if (rc < 0)
        return rc;
    if (snprintf(to, sizeof to, "%s.deleting", from) >= (int)sizeof to)
        return df_errf(e, -ENAMETOOLONG, "%s: path too long", from);
    if (rename(from, to) != 0)
        return df_errf(e, -errno, "%s: cannot rename to %s: %s", from, to, strerror(errno));
    if ((rc = df_fsync_dir(run_dir, e)) < 0)
        return rc;
    return df_ckpt_rm_flat_dir(to, e);
}

int df_ckpt_prune(const char *run_dir, int keep_last, df_err *e)
{
    if (keep_last <= 0)
        return 0;
    df_ckpt_info *v;
    int n, rc = df_ckpt_list(run_dir, &v, &n, e);
    if (rc < 0)
        return rc;
    /* keep the keep_last newest complete ones; remove everything older */
    int kept = 0, i;
    int64_t oldest_kept = INT64_MAX;
    for (i = n - 1; i >= 0 && kept < keep_last; i--)
        if (v[i].complete) {
            kept++;
            oldest_kept = v[i].step;
        }
    if (kept < keep_last) {
        free(v);
        return 0;
    }
    for (i = 0; i < n && !rc; i++)
        if (v[i].step < oldest_kept)
            rc = remove_ckpt(run_dir, v[i].name, e);
    free(v);
    return rc;
}

/* Removes leftovers of killed saves and prunes: ckpt-*.tmp, ckpt-*.deleting. */
static int clean_leftovers(const char *run_dir, df_err *e)
{
    DIR *d = opendir(run_dir);
    if (!d)
        return df_errf(e, -errno, "%s: cannot open run directory: %s", run_dir, strerror(errno));
    char names[64][48];
    int n = 0, rc = 0;
    struct dirent *de;
    while ((de = readdir(d)) && n < 64) {
        int64_t step;
        int kind = parse_name(de->d_name, &step);
        if (kind == 1 || kind == 2)
            snprintf(names[n++], sizeof names[0], "%s", de->d_name);
    }
    closedir(d);
    for (int i = 0; i < n && !rc; i++) {
        char p[PATHN];
        if (!(rc = df_ckpt_join(p, run_dir, names[i], e)))
            rc = df_ckpt_rm_flat_dir(p, e);
    }
    return rc;
}

int df_ckpt_write_text(const char *dir, const char *name, const void *data, size_t len,
                       df_err *e)
{
    char p[PATHN];
    int rc = df_ckpt_join(p, dir, name, e);
    return rc < 0 ? rc : df_file_write_atomic(p, data, len, e);
}

static int build_manifest(const df_ckpt_state *st, const df_params *ps, const char *cfg_hex,
                          const char *hp_hex, size_t hp_len, char **out, df_err *e)
{
    uint32_t crc[5];
    const float *arr[3] = {st->master, st->adam_m, st->adam_v};
    for (int a = 0; a < 3; a++)
        crc[a] = df_crc32c(0, arr[a], (size_t)ps->total * sizeof(float));
    crc[3] = df_crc32c(0, st->rng_state, st->rng_len);
    crc[4] = df_crc32c(0, st->data_position, st->data_position_len);
    cJSON *r = cJSON_CreateObject(), *c = NULL;
    int ok = r != NULL;
#define ADD(x) ok = ok && (x) != NULL
    ADD(cJSON_AddStringToObject(r, "format", "dflash-ckpt"));
    ADD(cJSON_AddNumberToObject(r, "version", DF_CKPT_VERSION));
    ADD(cJSON_AddNumberToObject(r, "step", (double)st->step));
    ADD(cJSON_AddNumberToObject(r, "params_total", (double)ps->total));
    ADD(cJSON_AddNumberToObject(r, "params_count", ps->n));
    if (st->config.feature_dim) /* a projected cache's rank: fc is hidden x it (not in config.json) */
        ADD(cJSON_AddNumberToObject(r, "feature_dim", st->config.feature_dim));
    ADD(cJSON_AddStringToObject(r, "config_sha256", cfg_hex));
    ADD(cJSON_AddStringToObject(r, "hparams_sha256", hp_hex));
    ADD(cJSON_AddNumberToObject(r, "hparams_bytes", (double)hp_len));
    ADD(cJSON_AddNumberToObject(r, "rng_state_bytes", (double)st->rng_len));
    ADD(cJSON_AddNumberToObject(r, "data_position_bytes", (double)st->data_position_len));
    ADD(c = cJSON_AddObjectToObject(r, "crc32c"));
    if (ok) {
        ADD(cJSON_AddNumberToObject(c, "master", crc[0]));
        ADD(cJSON_AddNumberToObject(c, "adam_m", crc[1]));
        ADD(cJSON_AddNumberToObject(c, "adam_v", crc[2]));
        ADD(cJSON_AddNumberToObject(c, "rng_state", crc[3]));
        ADD(cJSON_AddNumberToObject(c, "data_position", crc[4]));
    }
#undef ADD
    *out = ok ? cJSON_Print(r) : NULL;
    cJSON_Delete(r);
    if (!*out)
        return df_errf(e, -ENOMEM, "checkpoint manifest: out of memory");
    return 0;
}

static int write_state(const char *dir, const df_ckpt_state *st, const df_params *ps, df_err *e)
{
    char p[PATHN], nm[160], stepbuf[32];
    int rc = df_ckpt_join(p, dir, "state.safetensors", e);
    if (rc < 0)
        return rc;
    df_st_writer *w;
    if ((rc = df_st_writer_open(p, &w, e)) < 0)
        return rc;
    const float *arr[3] = {st->master, st->adam_m, st->adam_v};
    for (int a = 0; a < 3 && !rc; a++)
        for (int i = 0; i < ps->n && !rc; i++) {
            const df_param *q = &ps->p[i];
            snprintf(nm, sizeof nm, "%s.%s", ARRAYS[a], q->name);
            rc = df_st_writer_add(w, nm, DF_DTYPE_F32, q->ndim, q->shape, arr[a] + q->offset, e);
        }
    int64_t rl = (int64_t)st->rng_len, dl = (int64_t)st->data_position_len;
    snprintf(stepbuf, sizeof stepbuf, "%" PRId64, st->step);
    if (!rc)
        rc = df_st_writer_add(w, "rng_state", DF_DTYPE_U8, 1, &rl, st->rng_state, e);
    if (!rc)
        rc = df_st_writer_add(w, "data_position", DF_DTYPE_U8, 1, &dl, st->data_position, e);
    if (!rc)
        rc = df_st_writer_set_metadata(w, "format", "dflash-ckpt", e);
    if (!rc)
        rc = df_st_writer_set_metadata(w, "step", stepbuf, e);
    if (!rc)
        rc = df_st_writer_finish(w, e);
    df_st_writer_free(w);
    return rc;
}

static int take_lock(const char *run_dir, int *fd_out, df_err *e)
{
    char p[PATHN];
    int rc = df_ckpt_join(p, run_dir, ".ckpt.lock", e);
    if (rc < 0)
        return rc;
    int fd = open(p, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return df_errf(e, -errno, "%s: cannot open: %s", p, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int err = errno;
        close(fd);
        if (err == EWOULDBLOCK)
            return df_errf(e, -EBUSY, "%s: another process is saving a checkpoint of this run", p);
        return df_errf(e, -err, "%s: flock failed: %s", p, strerror(err));
    }
    *fd_out = fd;
    return 0;
}

static int check_state_for_save(const df_ckpt_state *st, df_err *e)
{
    if (st->step < 0)
        return df_errf(e, -EINVAL, "checkpoint: step %" PRId64 " is negative", st->step);
    if (!st->master || !st->adam_m || !st->adam_v)
        return df_errf(e, -EINVAL, "checkpoint: master weights and both AdamW moments are required");
    if (st->rng_len > DF_CKPT_MAX_BLOB || st->data_position_len > DF_CKPT_MAX_BLOB)
        return df_errf(e, -EINVAL, "checkpoint: rng state (%zu bytes) or data position (%zu bytes) "
                       "larger than %u bytes", st->rng_len, st->data_position_len, DF_CKPT_MAX_BLOB);
    if ((st->rng_len && !st->rng_state) || (st->data_position_len && !st->data_position))
        return df_errf(e, -EINVAL, "checkpoint: blob length given without data");
    if (st->hparams_json) {
        size_t n = strlen(st->hparams_json);
        if (n > DF_CKPT_MAX_HPARAMS)
            return df_errf(e, -EINVAL, "checkpoint: hyperparameters: %zu bytes, more than %u", n,
                           DF_CKPT_MAX_HPARAMS);
        cJSON *j = n ? cJSON_ParseWithLength(st->hparams_json, n) : NULL;
        if (n && !j)
            return df_errf(e, -EINVAL, "checkpoint: hyperparameters are not JSON");
        cJSON_Delete(j);
    }
    return 0;
}

int df_ckpt_save(const char *run_dir, const df_ckpt_state *st, int keep_last, df_err *e)
{
    int rc = check_state_for_save(st, e);
    if (rc < 0)
        return rc;
    char *cfg = df_drafter_config_to_json(&st->config, e);
    if (!cfg)
        return e ? e->code : -EINVAL;
    df_params ps;
    if ((rc = df_params_build(&st->config, &ps, e)) < 0) {
        free(cfg);
        return rc;
    }
    char *manifest = NULL;
    int lockfd = -1, made_tmp = 0;
    char name[48], fin[PATHN], tmp[PATHN], complete[512], cfg_hex[DF_SHA256_HEX],
        hp_hex[DF_SHA256_HEX], man_hex[DF_SHA256_HEX];
    if (st->n_floats != ps.total) {
        rc = df_errf(e, -DF_EMISMATCH, "checkpoint: %" PRId64 " floats given, the drafter config "
                     "has %" PRId64 " parameters", st->n_floats, ps.total);
        goto out;
    }
    ckpt_name(name, sizeof name, st->step);
    if ((rc = df_mkdirs(run_dir, e)) < 0 || (rc = take_lock(run_dir, &lockfd, e)) < 0 ||
        (rc = clean_leftovers(run_dir, e)) < 0 || (rc = df_ckpt_join(fin, run_dir, name, e)) < 0)
        goto out;
    snprintf(tmp, sizeof tmp, "%s.tmp", fin);
    struct stat sb;
    if (lstat(fin, &sb) == 0) {
        rc = df_errf(e, -EEXIST, "%s: a checkpoint of step %" PRId64 " already exists", fin,
                     st->step);
        goto out;
    }
    if (mkdir(tmp, 0755) != 0) {
        rc = df_errf(e, -errno, "%s: mkdir failed: %s", tmp, strerror(errno));
        goto out;
    }
    made_tmp = 1;
    size_t cfg_len = strlen(cfg);
    const char *hp = st->hparams_json ? st->hparams_json : "";
    size_t hp_len = strlen(hp);
    df_sha256_hex_of(cfg, cfg_len, cfg_hex);
    df_sha256_hex_of(hp, hp_len, hp_hex);
    if ((rc = df_ckpt_write_text(tmp, "config.json", cfg, cfg_len, e)) < 0 ||
        (rc = df_ckpt_write_text(tmp, "hparams.json", hp, hp_len, e)) < 0)
        goto out;
    test_hook("config");
    if ((rc = write_state(tmp, st, &ps, e)) < 0)
        goto out;
    test_hook("state");
    if ((rc = build_manifest(st, &ps, cfg_hex, hp_hex, hp_len, &manifest, e)) < 0)
        goto out;
    df_sha256_hex_of(manifest, strlen(manifest), man_hex);
    if ((rc = df_ckpt_write_text(tmp, "manifest.json", manifest, strlen(manifest), e)) < 0)
        goto out;
    test_hook("manifest");
    int cn = snprintf(complete, sizeof complete, "dflash-ckpt %d\nstep %" PRId64
                      "\nmanifest.json sha256 %s\n", DF_CKPT_VERSION, st->step, man_hex);
    if ((rc = df_ckpt_write_text(tmp, "COMPLETE", complete, (size_t)cn, e)) < 0)
        goto out;
    test_hook("complete");
    if (rename(tmp, fin) != 0) {
        rc = df_errf(e, -errno, "%s: rename to %s failed: %s", tmp, fin, strerror(errno));
        goto out;
    }
    made_tmp = 0;
    if ((rc = df_fsync_dir(run_dir, e)) < 0)
        goto out;
    test_hook("rename");
    char latest[PATHN], line[64];
    int ln = snprintf(line, sizeof line, "%s\n", name);
    if ((rc = df_ckpt_join(latest, run_dir, "latest", e)) < 0 ||
        (rc = df_file_write_atomic(latest, line, (size_t)ln, e)) < 0)
        goto out;
    test_hook("latest");
    rc = df_ckpt_prune(run_dir, keep_last, e);
out:
    if (made_tmp) {
        df_err e2;
        df_ckpt_rm_flat_dir(tmp, &e2); /* best effort: the next save removes it too */
    }
    if (lockfd >= 0)
        close(lockfd);
    if (manifest)
        cJSON_free(manifest);
    df_params_free(&ps);
    free(cfg);
    return rc;
}

/* ---- loading ---- */

static int read_file(const char *dir, const char *name, size_t max, char **buf, size_t *len,
                     char *path, df_err *e)
{
    int rc = df_ckpt_join(path, dir, name, e);
    if (rc < 0)
        return rc;
    rc = df_file_read_all(path, max, buf, len, e);
    if (rc == -ENOENT)
        return df_errf(e, -DF_ECORRUPT, "%s: missing", path);
    return rc;
}

static int get_int(const cJSON *o, const char *key, int64_t lo, int64_t hi, int64_t *out,
                   const char *path, df_err *e)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(j))
        return df_errf(e, -DF_ECORRUPT, "%s: \"%s\" missing or not a number", path, key);
    double d = j->valuedouble;
    if (!(d >= (double)lo && d <= (double)hi) || d != floor(d))
        return df_errf(e, -DF_ECORRUPT, "%s: \"%s\" = %g is not an integer in [%" PRId64
                       ", %" PRId64 "]", path, key, d, lo, hi);
    *out = (int64_t)d;
    return 0;
}

static int get_hex(const cJSON *o, const char *key, const char **out, const char *path, df_err *e)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsString(j) || strlen(j->valuestring) != DF_SHA256_HEX - 1)
        return df_errf(e, -DF_ECORRUPT, "%s: \"%s\" missing or not a sha256", path, key);
    *out = j->valuestring;
    return 0;
}

typedef struct manifest {
    int64_t step, total, count, hp_bytes, rng_bytes, dp_bytes, crc[5], feature_dim;
    char cfg_hex[DF_SHA256_HEX], hp_hex[DF_SHA256_HEX];
} manifest;

static int parse_manifest(const char *txt, size_t len, const char *path, manifest *m, df_err *e)
{
    cJSON *r = cJSON_ParseWithLength(txt, len);
    if (!cJSON_IsObject(r)) {
        cJSON_Delete(r);
        return df_errf(e, -DF_ECORRUPT, "%s: not a JSON object", path);
    }
    int rc = 0;
    int64_t ver = 0;
    m->feature_dim = 0;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(r, "format");
    const cJSON *crc = cJSON_GetObjectItemCaseSensitive(r, "crc32c");
    const char *h1 = NULL, *h2 = NULL;
    if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, "dflash-ckpt"))
        rc = df_errf(e, -DF_ECORRUPT, "%s: \"format\" is not \"dflash-ckpt\"", path);
    else if ((rc = get_int(r, "version", 0, INT32_MAX, &ver, path, e)) < 0)
        ;
    else if (ver != DF_CKPT_VERSION)
        rc = df_errf(e, -DF_EVERSION, "%s: checkpoint format version %" PRId64 ", this build "
                     "reads version %d", path, ver, DF_CKPT_VERSION);
    else if ((rc = get_int(r, "step", 0, INT64_C(1) << 53, &m->step, path, e)) < 0 ||
             (rc = get_int(r, "params_total", 1, INT64_C(1) << 53, &m->total, path, e)) < 0 ||
             (rc = get_int(r, "params_count", 1, INT32_MAX, &m->count, path, e)) < 0 ||
             (rc = get_int(r, "hparams_bytes", 0, DF_CKPT_MAX_HPARAMS, &m->hp_bytes, path, e)) < 0 ||
             (rc = get_int(r, "rng_state_bytes", 0, DF_CKPT_MAX_BLOB, &m->rng_bytes, path, e)) < 0 ||
             (rc = get_int(r, "data_position_bytes", 0, DF_CKPT_MAX_BLOB, &m->dp_bytes, path, e)) < 0 ||
             (rc = get_hex(r, "config_sha256", &h1, path, e)) < 0 ||
             (rc = get_hex(r, "hparams_sha256", &h2, path, e)) < 0)
        ;
    else if (cJSON_GetObjectItemCaseSensitive(r, "feature_dim") &&
             (rc = get_int(r, "feature_dim", 1, INT32_MAX, &m->feature_dim, path, e)) < 0)
        ;
    else if (!cJSON_IsObject(crc))
        rc = df_errf(e, -DF_ECORRUPT, "%s: \"crc32c\" missing or not an object", path);
    else {
        static const char *const keys[5] = {"master", "adam_m", "adam_v", "rng_state",
                                            "data_position"};
        for (int i = 0; i < 5 && !rc; i++)
            rc = get_int(crc, keys[i], 0, UINT32_MAX, &m->crc[i], path, e);
        snprintf(m->cfg_hex, sizeof m->cfg_hex, "%s", h1);
        snprintf(m->hp_hex, sizeof m->hp_hex, "%s", h2);
    }
    cJSON_Delete(r);
    return rc;
}

/* COMPLETE must be exactly what the save wrote for manifest.json's bytes. */
static int check_complete(const char *dir, const char *man, size_t man_len, int64_t *step,
                          df_err *e)
{
    char path[PATHN], *txt;
    size_t len;
    int rc = df_ckpt_join(path, dir, "COMPLETE", e);
    if (rc < 0)
        return rc;
    rc = df_file_read_all(path, SMALL_MAX, &txt, &len, e);
    if (rc == -ENOENT)
        return df_errf(e, -DF_ECORRUPT, "%s: missing: incomplete or damaged checkpoint", path);
    if (rc < 0)
        return rc;
    int ver = 0;
    long long s = -1;
    char hex[DF_SHA256_HEX], want[512], man_hex[DF_SHA256_HEX];
    if (sscanf(txt, "dflash-ckpt %d", &ver) != 1)
        rc = df_errf(e, -DF_ECORRUPT, "%s: not a dflash checkpoint marker", path);
    else if (ver != DF_CKPT_VERSION)
        rc = df_errf(e, -DF_EVERSION, "%s: checkpoint format version %d, this build reads "
                     "version %d", path, ver, DF_CKPT_VERSION);
    else if (sscanf(txt, "dflash-ckpt %d\nstep %lld\nmanifest.json sha256 %64s", &ver, &s, hex) != 3 ||
             s < 0)
        rc = df_errf(e, -DF_ECORRUPT, "%s: malformed marker", path);
    else {
        int wn = snprintf(want, sizeof want, "dflash-ckpt %d\nstep %lld\nmanifest.json sha256 %s\n",
                          ver, s, hex);
        df_sha256_hex_of(man, man_len, man_hex);
        if ((size_t)wn != len || memcmp(want, txt, len))
            rc = df_errf(e, -DF_ECORRUPT, "%s: malformed marker", path);
        else if (strcmp(hex, man_hex))
            rc = df_errf(e, -DF_ECORRUPT, "%s/manifest.json: sha256 %s, COMPLETE says %s "
                         "(damaged file)", dir, man_hex, hex);
        else
            *step = s;
    }
    free(txt);
    return rc;
}

/* A tensor missing or of another shape in our own file means a damaged file. */
static int as_corrupt(int rc, df_err *e, const char *path)
{
    if (rc == -ENOENT || rc == -DF_EMISMATCH) {
        rc = -DF_ECORRUPT;
        if (e)
            e->code = rc;
    }
    df_err_wrap(e, "%s", path);
    return rc;
}

static int load_state(const char *dir, const df_params *ps, const manifest *m, df_ckpt_state *out,
                      df_err *e)
{
    char path[PATHN], nm[160];
    int rc = df_ckpt_join(path, dir, "state.safetensors", e);
    if (rc < 0)
        return rc;
    df_st *st;
    if ((rc = df_st_open(path, &st, e)) < 0)
        return rc;
    size_t want = 3 * (size_t)ps->n + 2;
    if (df_st_count(st) != want) {
        rc = df_errf(e, -DF_ECORRUPT, "%s: %zu tensors, expected %zu", path, df_st_count(st), want);
        goto out;
    }
    float **arr[3] = {&out->master, &out->adam_m, &out->adam_v};
    for (int a = 0; a < 3; a++) {
        float *dst = malloc((size_t)ps->total * sizeof(float));
        *arr[a] = dst;
        if (!dst) {
            rc = df_errf(e, -ENOMEM, "%s: out of memory for %" PRId64 " floats", path, ps->total);
            goto out;
        }
        for (int i = 0; i < ps->n; i++) {
            const df_param *q = &ps->p[i];
            const df_st_tensor *t;
            snprintf(nm, sizeof nm, "%s.%s", ARRAYS[a], q->name);
            if ((rc = df_st_expect(st, nm, DF_DTYPE_F32, q->ndim, q->shape, &t, e)) < 0) {
                rc = as_corrupt(rc, e, path);
                goto out;
            }
            memcpy(dst + q->offset, t->data, (size_t)t->nbytes);
        }
        uint32_t c = df_crc32c(0, dst, (size_t)ps->total * sizeof(float));
        if (c != (uint32_t)m->crc[a]) {
            rc = df_errf(e, -DF_ECORRUPT, "%s: %s: crc32c %08x, manifest.json says %08x (damaged "
                         "file)", path, ARRAYS[a], c, (unsigned)m->crc[a]);
            goto out;
        }
    }
    static const char *const blobs[2] = {"rng_state", "data_position"};
    void **bp[2] = {&out->rng_state, &out->data_position};
    size_t *bl[2] = {&out->rng_len, &out->data_position_len};
    int64_t bn[2] = {m->rng_bytes, m->dp_bytes};
    for (int b = 0; b < 2; b++) {
        const df_st_tensor *t;
        if ((rc = df_st_expect(st, blobs[b], DF_DTYPE_U8, 1, &bn[b], &t, e)) < 0) {
            rc = as_corrupt(rc, e, path);
            goto out;
        }
        if (!(*bp[b] = malloc((size_t)bn[b] + 1))) {
            rc = df_errf(e, -ENOMEM, "%s: out of memory", path);
            goto out;
        }
        memcpy(*bp[b], t->data, (size_t)bn[b]);
        *bl[b] = (size_t)bn[b];
        uint32_t c = df_crc32c(0, *bp[b], *bl[b]);
        if (c != (uint32_t)m->crc[3 + b]) {
            rc = df_errf(e, -DF_ECORRUPT, "%s: %s: crc32c %08x, manifest.json says %08x (damaged "
                         "file)", path, blobs[b], c, (unsigned)m->crc[3 + b]);
            goto out;
        }
    }
    const char *ms = df_st_metadata(st, "step"), *mf = df_st_metadata(st, "format");
    char sbuf[32];
    snprintf(sbuf, sizeof sbuf, "%" PRId64, m->step);
    if (!mf || strcmp(mf, "dflash-ckpt"))
        rc = df_errf(e, -DF_ECORRUPT, "%s: metadata format is not \"dflash-ckpt\"", path);
    else if (!ms || strcmp(ms, sbuf))
        rc = df_errf(e, -DF_ECORRUPT, "%s: metadata step %s, manifest.json says %s", path,
                     ms ? ms : "(none)", sbuf);
out:
    df_st_close(st);
    return rc;
}

int df_ckpt_load(const char *dir, df_ckpt_state *out, df_err *e)
{
    memset(out, 0, sizeof *out);
    char mpath[PATHN], path[PATHN], hex[DF_SHA256_HEX];
    char *man = NULL, *cfg = NULL, *hp = NULL;
    size_t man_len, cfg_len, hp_len;
    manifest m;
    df_params ps = {0};
    int64_t cstep = -1, dstep;
    const char *base = strrchr(dir, '/');
    base = base ? base + 1 : dir;
    int rc = read_file(dir, "manifest.json", SMALL_MAX, &man, &man_len, mpath, e);
    if (rc == -DF_ECORRUPT) { /* a missing manifest: say whether the marker is there */
        char cp[PATHN];
        struct stat sb;
        if (df_ckpt_join(cp, dir, "COMPLETE", NULL) == 0 && stat(cp, &sb) != 0)
            rc = df_errf(e, -DF_ECORRUPT, "%s: missing: incomplete or damaged checkpoint", cp);
    }
    if (rc < 0)
        goto out;
    if ((rc = check_complete(dir, man, man_len, &cstep, e)) < 0 ||
        (rc = parse_manifest(man, man_len, mpath, &m, e)) < 0)
        goto out;
    if (m.step != cstep || (parse_name(base, &dstep) == 0 && dstep != m.step)) {
        rc = df_errf(e, -DF_ECORRUPT, "%s: step %" PRId64 " does not match the marker (%" PRId64
                     ") or the directory name", mpath, m.step, cstep);
        goto out;
    }
    if ((rc = read_file(dir, "config.json", CONFIG_MAX, &cfg, &cfg_len, path, e)) < 0)
        goto out;
    df_sha256_hex_of(cfg, cfg_len, hex);
    if (strcmp(hex, m.cfg_hex)) {
        rc = df_errf(e, -DF_ECORRUPT, "%s: sha256 %s, manifest.json says %s (damaged file)", path,
                     hex, m.cfg_hex);
        goto out;
    }
    if ((rc = df_drafter_config_parse(cfg, cfg_len, path, &out->config, e)) < 0)
        goto out;
    out->config.feature_dim = (int)m.feature_dim;
    if ((rc = df_params_build(&out->config, &ps, e)) < 0)
        goto out;
    if (ps.total != m.total || ps.n != m.count) {
        rc = df_errf(e, -DF_ECORRUPT, "%s: %" PRId64 " parameters in %" PRId64 " tensors, the "
                     "config.json gives %" PRId64 " in %d", mpath, m.total, m.count, ps.total, ps.n);
        goto out;
    }
    if ((rc = read_file(dir, "hparams.json", DF_CKPT_MAX_HPARAMS, &hp, &hp_len, path, e)) < 0)
        goto out;
    df_sha256_hex_of(hp, hp_len, hex);
    if ((int64_t)hp_len != m.hp_bytes || strcmp(hex, m.hp_hex)) {
        rc = df_errf(e, -DF_ECORRUPT, "%s: %zu bytes, sha256 %s; manifest.json says %" PRId64
                     " bytes, %s (damaged file)", path, hp_len, hex, m.hp_bytes, m.hp_hex);
        goto out;
    }
    if ((rc = load_state(dir, &ps, &m, out, e)) < 0)
        goto out;
    out->step = m.step;
    out->n_floats = ps.total;
    if (hp_len) {
        out->hparams_json = hp;
        hp = NULL;
    }
    snprintf(out->loaded_from, sizeof out->loaded_from, "%s", dir);
out:
    free(man);
    free(cfg);
    free(hp);
    df_params_free(&ps);
    if (rc < 0)
        df_ckpt_state_free(out);
    return rc;
}

int df_ckpt_load_latest(const char *run_dir, df_ckpt_state *out, df_err *e)
{
    memset(out, 0, sizeof *out);
    df_ckpt_info *v;
    int n, rc;
    struct stat sb;
    if (stat(run_dir, &sb) != 0)
        return df_errf(e, -ENOENT, "%s: no such run directory, no checkpoint to resume", run_dir);
    if ((rc = df_ckpt_list(run_dir, &v, &n, e)) < 0)
        return rc;
    if (n == 0) {
        free(v);
        return df_errf(e, -ENOENT, "%s: no checkpoint to resume", run_dir);
    }
    df_ckpt_info newest = v[n - 1];
    free(v);
    /* `latest` is written after the rename, so it may lag by one save, never lead */
    char lp[PATHN], cp[PATHN], *txt = NULL;
    size_t len;
    if ((rc = df_ckpt_join(lp, run_dir, "latest", e)) < 0)
        return rc;
    rc = df_file_read_all(lp, SMALL_MAX, &txt, &len, e);
    if (rc == 0) {
        int64_t ls;
        char nm[64] = "";
        if (len >= sizeof nm || len < 2 || txt[len - 1] != '\n')
            rc = df_errf(e, -DF_ECORRUPT, "%s: malformed", lp);
        else {
            memcpy(nm, txt, len - 1);
            if (parse_name(nm, &ls) != 0)
                rc = df_errf(e, -DF_ECORRUPT, "%s: malformed", lp);
            else if (ls > newest.step)
                rc = df_errf(e, -DF_ECORRUPT, "%s: names %s, but the newest checkpoint present is "
                             "%s (deleted?)", lp, nm, newest.name);
        }
        free(txt);
        if (rc < 0)
            return rc;
    } else if (rc != -ENOENT) {
        return rc;
    }
    if ((rc = df_ckpt_join(cp, run_dir, newest.name, e)) < 0)
        return rc;
    rc = df_ckpt_load(cp, out, e);
    if (rc < 0)
        df_err_wrap(e, "newest checkpoint %s unusable (no fall-back to older ones; see "
                    "df_ckpt_list)", newest.name);
    return rc;
}
