/* runlog.c - log.jsonl lines through cJSON (runlog.h). */
#include "runlog.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "fsutil.h"
#include "version.h"

cJSON *df_runlog_line(int64_t step)
{
    cJSON *o = cJSON_CreateObject();
    if (o && df_runlog_int(o, "step", step)) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

static cJSON *num_item(const char *fmt, double v)
{
    if (!isfinite(v))
        return cJSON_CreateNull();
    char b[64];
    snprintf(b, sizeof b, fmt, v);
    return cJSON_CreateRaw(b);
}

int df_runlog_num(cJSON *line, const char *key, const char *fmt, double v)
{
    cJSON *it = num_item(fmt, v);
    if (!it || !cJSON_AddItemToObject(line, key, it)) {
        cJSON_Delete(it);
        return -ENOMEM;
    }
    return 0;
}

int df_runlog_int(cJSON *line, const char *key, int64_t v)
{
    char b[32];
    snprintf(b, sizeof b, "%" PRId64, v);
    return cJSON_AddRawToObject(line, key, b) ? 0 : -ENOMEM;
}

int df_runlog_nums(cJSON *line, const char *key, const char *fmt, const double *v, int n)
{
    cJSON *a = cJSON_CreateArray();
    if (!a || !cJSON_AddItemToObject(line, key, a)) {
        cJSON_Delete(a);
        return -ENOMEM;
    }
    for (int i = 0; i < n; i++) {
        cJSON *it = num_item(fmt, v[i]);
        if (!it || !cJSON_AddItemToArray(a, it)) {
            cJSON_Delete(it);
            return -ENOMEM;
        }
    }
    return 0;
}

int df_runlog_write(FILE *f, const char *path, int64_t step, cJSON *line, df_err *e)
{
    char *txt = line ? cJSON_PrintUnformatted(line) : NULL;
    cJSON_Delete(line);
    if (!txt)
        return df_errf(e, -ENOMEM, "%s: out of memory building the line of step %" PRId64, path,
                       step);
    fputs(txt, f);
    fputc('\n', f);
    cJSON_free(txt);
    errno = 0;
    int bad = fflush(f) != 0 || ferror(f);
    int err = bad ? (errno ? errno : EIO) : df_fault("log-write");
    if (!err)
        return 0;
    return df_errf(e, -err, "%s: writing the line of step %" PRId64 " failed: %s; stopping (the "
                   "checkpoints so far stand: free space and rerun to resume)", path, step,
                   strerror(err));
}

static int add_str(cJSON *o, const char *k, const char *v)
{
    return !v || cJSON_AddStringToObject(o, k, v) ? 0 : -ENOMEM;
}

int df_runlog_run(FILE *f, const char *path, int64_t step, const df_runlog_meta *m, df_err *e)
{
    cJSON *line = df_runlog_line(step), *r = cJSON_CreateObject();
    if (!line || !r || !cJSON_AddItemToObject(line, "run", r)) {
        cJSON_Delete(r);
        cJSON_Delete(line);
        return df_errf(e, -ENOMEM, "%s: out of memory building the run line", path);
    }
    char when[32] = "", host[256] = "";
    time_t now = time(NULL);
    struct tm tm;
    if (gmtime_r(&now, &tm))
        strftime(when, sizeof when, "%Y-%m-%dT%H:%M:%SZ", &tm);
    if (gethostname(host, sizeof host - 1) != 0)
        host[0] = 0;
    int rc = add_str(r, "event", m->event) || add_str(r, "time", when) ||
             add_str(r, "host", host[0] ? host : NULL) || df_runlog_int(r, "pid", getpid()) ||
             add_str(r, "dflash", DFLASH_VERSION) || add_str(r, "backend", m->backend) ||
             df_runlog_int(r, "ranks", m->world) || df_runlog_int(r, "steps", m->steps) ||
             add_str(r, "run_dir", m->run_dir) || add_str(r, "cache", m->cache) ||
             add_str(r, "eval_cache", m->eval_cache) || add_str(r, "target", m->target) ||
             add_str(r, "init_from", m->init_from);
    if (!rc && m->settings_json) {
        cJSON *hp = cJSON_Parse(m->settings_json);
        cJSON *s = cJSON_DetachItemFromObjectCaseSensitive(hp, "settings");
        if (s && !cJSON_AddItemToObject(r, "settings", s)) {
            cJSON_Delete(s);
            rc = -ENOMEM;
        }
        cJSON_Delete(hp);
    }
    if (rc) {
        cJSON_Delete(line);
        return df_errf(e, -ENOMEM, "%s: out of memory building the run line", path);
    }
    return df_runlog_write(f, path, step, line, e);
}
