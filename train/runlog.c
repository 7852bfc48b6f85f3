/* runlog.c - log.jsonl lines through cJSON (runlog.h). */
#include "runlog.h"

#include <errno.h>
#include <fcntl.h>
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

int df_runlog_step(FILE *f, const char *path, int quiet, int64_t step, int64_t steps, double loss,
                   double lr, double gnorm, const df_drafter_metrics *m, int bs,
                   const df_step_perf *pf, uint64_t tokens, uint64_t epoch, df_err *e)
{
    double tok_s = pf->tok_s, step_s = pf->step_s;
    double tau = m->blocks ? 1.0 + (double)m->accepted / (double)m->blocks : 1.0;
    if (f) {
        double acc[DF_DRAFTER_MAX_BLOCK];
        for (int k = 1; k < bs; k++)
            acc[k - 1] = m->counted[k] ? (double)m->correct[k] / (double)m->counted[k] : 0.0;
        cJSON *l = df_runlog_line(step);
        int bad = !l || df_runlog_int(l, "epoch", (int64_t)epoch) ||
                  df_runlog_num(l, "loss", "%.6f", loss) || df_runlog_num(l, "lr", "%.6g", lr) ||
                  df_runlog_num(l, "grad_norm", "%.6g", gnorm) ||
                  df_runlog_num(l, "tau_hat", "%.4f", tau) ||
                  df_runlog_int(l, "tokens", (int64_t)tokens) ||
                  df_runlog_num(l, "tokens_per_s", "%.1f", tok_s) ||
                  df_runlog_num(l, "step_s", "%.4f", step_s) ||
                  df_runlog_num(l, "data_wait", "%.4f", pf->data_wait) ||
                  df_runlog_num(l, "data_wait_max", "%.4f", pf->data_wait_max) ||
                  df_runlog_num(l, "feed_build_s", "%.4f", pf->feed_build_s) ||
                  df_runlog_num(l, "feed_read_s", "%.4f", pf->feed_read_s) ||
                  df_runlog_num(l, "tflops", "%.2f", pf->tflops) ||
                  df_runlog_num(l, "mfu", "%.4f", pf->mfu) ||
                  df_runlog_num(l, "mem_gib", "%.3f", pf->mem_gib) ||
                  df_runlog_num(l, "mem_base_gib", "%.3f", pf->mem_base_gib) ||
                  df_runlog_num(l, "persistent_gib", "%.3f", pf->persistent_gib) ||
                  df_runlog_num(l, "eta_s", "%.0f", pf->eta_s) ||
                  df_runlog_nums(l, "acc", "%.4f", acc, bs - 1);
        if (bad) {
            cJSON_Delete(l);
            l = NULL; /* df_runlog_write reports it */
        }
        int rc = df_runlog_write(f, path, step, l, e);
        if (rc)
            return rc;
    }
    if (!quiet) {
        printf("step %6" PRId64 "/%" PRId64 "  loss %.4f  tau_hat %.3f  acc1 %.3f  acc%d %.3f  "
               "lr %.2e  |g| %.3f  %.0f tok/s  %.3f s/step  data %.0f%%",
               step, steps, loss, tau,
               m->counted[1] ? (double)m->correct[1] / (double)m->counted[1] : 0.0, bs - 1,
               m->counted[bs - 1] ? (double)m->correct[bs - 1] / (double)m->counted[bs - 1] : 0.0,
               lr, gnorm, tok_s, step_s, 100 * pf->data_wait);
        if (pf->mfu > 0)
            printf("  %.0f TFLOP/s (MFU %.1f%%)", pf->tflops, 100 * pf->mfu);
        if (pf->mem_gib >= 0)
            printf("  %.1f GiB", pf->mem_gib);
        if (step < steps) {
            long long t = (long long)(pf->eta_s + 0.5);
            printf("  ETA %lld:%02lld:%02lld", t / 3600, t / 60 % 60, t % 60);
        }
        printf("\n");
        fflush(stdout);
    }
    return 0;
}

/* Keeps only the whole log lines of steps <= step (a resumed run rewrites
 * the rest; a line cut short by a failed write has no newline and goes too).
 * A failure to rewrite the log is an error: the resumed run would otherwise
 * append after stale lines. */
int df_runlog_trim(const char *path, int64_t step, df_err *e)
{
    if (access(path, F_OK) != 0)
        return errno == ENOENT ? 0 : df_errf(e, -errno, "%s: cannot open: %s", path, strerror(errno));
    int fd = df_open_regular(path, O_RDONLY, 0, e); /* a FIFO would block fopen */
    if (fd < 0)
        return fd;
    FILE *f = fdopen(fd, "r");
    if (!f) {
        int err = errno;
        close(fd);
        return df_errf(e, -err, "%s: cannot open: %s", path, strerror(err));
    }
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *o = fopen(tmp, "w");
    if (!o) {
        int err = errno;
        fclose(f);
        return df_errf(e, -err, "%s: cannot create: %s", tmp, strerror(err));
    }
    enum { LINE_MAX_ = 1 << 16 }; /* the run lines hold the settings: a few KB */
    char *line = malloc(LINE_MAX_);
    if (!line) {
        fclose(f);
        fclose(o);
        unlink(tmp);
        return df_errf(e, -ENOMEM, "out of memory");
    }
    while (fgets(line, LINE_MAX_, f)) {
        long long st;
        size_t n = strlen(line);
        if (n && line[n - 1] == '\n' && sscanf(line, "{\"step\":%lld", &st) == 1 && st <= step)
            fputs(line, o);
    }
    free(line);
    int bad_in = ferror(f);
    fclose(f);
    errno = 0;
    int bad_out = fflush(o) != 0 || ferror(o) || fsync(fileno(o)) != 0;
    int err = errno ? errno : EIO;
    if (fclose(o) != 0 && !bad_out) {
        bad_out = 1;
        err = errno ? errno : EIO;
    }
    if (bad_in || bad_out) {
        unlink(tmp);
        return df_errf(e, -(bad_out ? err : EIO), "%s: %s failed while trimming the log to step "
                       "%" PRId64, bad_out ? tmp : path, bad_out ? "write" : "read", step);
    }
    if (rename(tmp, path) != 0) {
        int rerr = errno;
        unlink(tmp);
        return df_errf(e, -rerr, "%s: rename to %s failed: %s", tmp, path, strerror(rerr));
    }
    return 0;
}
