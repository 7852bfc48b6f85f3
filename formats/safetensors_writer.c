/* safetensors_writer.c - the safetensors writer (safetensors.h): tensors
 * added by reference, the header sorted by name, written through a temporary
 * file, fsynced and renamed into place. The reader is safetensors.c. */
#include "safetensors.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fsutil.h"
#include "le.h"
#include "safetensors_internal.h"

typedef struct wentry {
    char *name;
    df_dtype dtype;
    int ndim;
    int64_t shape[DF_ST_MAX_DIMS];
    const void *data;
    uint64_t nbytes;
} wentry;

struct df_st_writer {
    char *path;
    wentry *ent;
    size_t n, cap;
    char **mkey, **mval;
    size_t nmeta, capmeta;
};

int df_st_writer_open(const char *path, df_st_writer **out, df_err *e)
{
    *out = NULL;
    df_st_writer *w = calloc(1, sizeof *w);
    if (!w || !(w->path = strdup(path))) {
        free(w);
        return df_errf(e, -ENOMEM, "%s: out of memory", path);
    }
    *out = w;
    return 0;
}

void df_st_writer_free(df_st_writer *w)
{
    if (!w)
        return;
    for (size_t i = 0; i < w->n; i++)
        free(w->ent[i].name);
    for (size_t i = 0; i < w->nmeta; i++) {
        free(w->mkey[i]);
        free(w->mval[i]);
    }
    free(w->ent);
    free(w->mkey);
    free(w->mval);
    free(w->path);
    free(w);
}

int df_st_writer_add(df_st_writer *w, const char *name, df_dtype dtype, int ndim,
                     const int64_t *shape, const void *data, df_err *e)
{
    if (!name || !*name || !strcmp(name, "__metadata__"))
        return df_errf(e, -EINVAL, "%s: invalid tensor name '%s'", w->path, name ? name : "(null)");
    if (df_dtype_size(dtype) == 0)
        return df_errf(e, -EINVAL, "%s: tensor '%s': invalid dtype %d", w->path, name, (int)dtype);
    if (ndim < 0 || ndim > DF_ST_MAX_DIMS)
        return df_errf(e, -EINVAL, "%s: tensor '%s': ndim %d outside 0..%d", w->path, name, ndim,
                       DF_ST_MAX_DIMS);
    uint64_t nb = df_dtype_size(dtype);
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0 || (double)shape[i] > JSON_INT_MAX ||
            __builtin_mul_overflow(nb, (uint64_t)shape[i], &nb))
            return df_errf(e, -EINVAL, "%s: tensor '%s': bad dimension %d (%lld)", w->path, name, i,
                           (long long)shape[i]);
    }
    if (nb && !data)
        return df_errf(e, -EINVAL, "%s: tensor '%s': no data", w->path, name);
    for (size_t i = 0; i < w->n; i++)
        if (!strcmp(w->ent[i].name, name))
            return df_errf(e, -EEXIST, "%s: tensor '%s' added twice", w->path, name);
    if (grow((void **)&w->ent, &w->cap, w->n + 1, sizeof *w->ent))
        return df_errf(e, -ENOMEM, "%s: out of memory", w->path);
    wentry *t = &w->ent[w->n];
    memset(t, 0, sizeof *t);
    if (!(t->name = strdup(name)))
        return df_errf(e, -ENOMEM, "%s: out of memory", w->path);
    t->dtype = dtype;
    t->ndim = ndim;
    for (int i = 0; i < ndim; i++)
        t->shape[i] = shape[i];
    t->data = data;
    t->nbytes = nb;
    w->n++;
    return 0;
}

int df_st_writer_set_metadata(df_st_writer *w, const char *key, const char *value, df_err *e)
{
    if (!key || !value)
        return df_errf(e, -EINVAL, "%s: metadata key and value must be strings", w->path);
    for (size_t i = 0; i < w->nmeta; i++)
        if (!strcmp(w->mkey[i], key)) {
            char *v = strdup(value);
            if (!v)
                return df_errf(e, -ENOMEM, "%s: out of memory", w->path);
            free(w->mval[i]);
            w->mval[i] = v;
            return 0;
        }
    if (grow((void **)&w->mkey, &w->capmeta, w->nmeta + 1, sizeof(char *)))
        return df_errf(e, -ENOMEM, "%s: out of memory", w->path);
    char **nv = realloc(w->mval, w->capmeta * sizeof(char *));
    if (!nv)
        return df_errf(e, -ENOMEM, "%s: out of memory", w->path);
    w->mval = nv;
    char *k = strdup(key), *v = strdup(value);
    if (!k || !v) {
        free(k);
        free(v);
        return df_errf(e, -ENOMEM, "%s: out of memory", w->path);
    }
    w->mkey[w->nmeta] = k;
    w->mval[w->nmeta] = v;
    w->nmeta++;
    return 0;
}

/* Growable string for the header. */
typedef struct sbuf {
    char *p;
    size_t n, cap;
    int oom;
} sbuf;

static void sb_put(sbuf *b, const char *s, size_t n)
{
    if (b->oom)
        return;
    if (b->n + n + 1 > b->cap) {
        size_t nc = b->cap ? b->cap : 4096;
        while (nc < b->n + n + 1)
            nc *= 2;
        char *q = realloc(b->p, nc);
        if (!q) {
            b->oom = 1;
            return;
        }
        b->p = q;
        b->cap = nc;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = 0;
}

static void sb_str(sbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_fmt(sbuf *b, const char *fmt, unsigned long long v)
{
    char tmp[32];
    int n = snprintf(tmp, sizeof tmp, fmt, v);
    sb_put(b, tmp, (size_t)n);
}

/* A JSON string literal; bytes >= 0x80 pass through (names are UTF-8). */
static void sb_json_str(sbuf *b, const char *s)
{
    sb_put(b, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') {
            char esc[2] = {'\\', (char)*p};
            sb_put(b, esc, 2);
        } else if (*p < 0x20) {
            sb_fmt(b, "\\u%04llx", *p);
        } else {
            sb_put(b, (const char *)p, 1);
        }
    }
    sb_put(b, "\"", 1);
}

static int cmp_wentry(const void *a, const void *b)
{
    const wentry *x = a, *y = b;
    size_t sx = df_dtype_size(x->dtype), sy = df_dtype_size(y->dtype);
    if (sx != sy)
        return sx > sy ? -1 : 1;
    return strcmp(x->name, y->name);
}

static int write_all(int fd, const void *data, uint64_t len, const char *tmp, uint64_t *pos,
                     df_err *e)
{
    const char *p = data;
    while (len) {
        size_t chunk = len > (1u << 30) ? (1u << 30) : (size_t)len;
        ssize_t r = write(fd, p, chunk);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            int err = r < 0 ? -errno : -EIO;
            return df_errf(e, err, "%s: write failed at offset %llu: %s", tmp,
                           (unsigned long long)*pos, strerror(-err));
        }
        p += r;
        len -= (uint64_t)r;
        *pos += (uint64_t)r;
    }
    return 0;
}

int df_st_writer_finish(df_st_writer *w, df_err *e)
{
    if (w->n > 1)
        qsort(w->ent, w->n, sizeof *w->ent, cmp_wentry);
    sbuf h = {0};
    sb_str(&h, "{");
    if (w->nmeta) {
        sb_str(&h, "\"__metadata__\":{");
        for (size_t i = 0; i < w->nmeta; i++) {
            if (i)
                sb_str(&h, ",");
            sb_json_str(&h, w->mkey[i]);
            sb_str(&h, ":");
            sb_json_str(&h, w->mval[i]);
        }
        sb_str(&h, "}");
    }
    uint64_t off = 0;
    for (size_t i = 0; i < w->n; i++) {
        const wentry *t = &w->ent[i];
        if (i || w->nmeta)
            sb_str(&h, ",");
        sb_json_str(&h, t->name);
        sb_str(&h, ":{\"dtype\":\"");
        sb_str(&h, df_dtype_name(t->dtype));
        sb_str(&h, "\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++)
            sb_fmt(&h, d ? ",%llu" : "%llu", (unsigned long long)t->shape[d]);
        sb_fmt(&h, "],\"data_offsets\":[%llu,", off);
        off += t->nbytes;
        sb_fmt(&h, "%llu]}", off);
    }
    sb_str(&h, "}");
    while (!h.oom && h.n % 8)
        sb_str(&h, " ");
    if (h.oom) {
        free(h.p);
        return df_errf(e, -ENOMEM, "%s: out of memory for the header", w->path);
    }
    if (h.n > DF_ST_MAX_HEADER) {
        free(h.p);
        return df_errf(e, -EFBIG, "%s: header of %zu bytes is over the %u limit", w->path, h.n,
                       DF_ST_MAX_HEADER);
    }

    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", w->path) >= (int)sizeof tmp) {
        free(h.p);
        return df_errf(e, -ENAMETOOLONG, "%s: path too long", w->path);
    }
    /* df_open_regular: a FIFO left at the .tmp name would block a plain open */
    int fd = df_open_regular(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644, e);
    if (fd < 0) {
        free(h.p);
        return fd;
    }
    uint8_t lenbuf[8];
    df_put64(lenbuf, (uint64_t)h.n);
    uint64_t pos = 0;
    int rc = write_all(fd, lenbuf, 8, tmp, &pos, e);
    if (rc >= 0)
        rc = write_all(fd, h.p, h.n, tmp, &pos, e);
    free(h.p);
    for (size_t i = 0; rc >= 0 && i < w->n; i++)
        rc = write_all(fd, w->ent[i].data, w->ent[i].nbytes, tmp, &pos, e);
    if (rc >= 0 && fsync(fd) != 0)
        rc = df_errf(e, -errno, "%s: fsync failed: %s", tmp, strerror(errno));
    if (close(fd) != 0 && rc >= 0)
        rc = df_errf(e, -errno, "%s: close failed: %s", tmp, strerror(errno));
    if (rc >= 0 && rename(tmp, w->path) != 0)
        rc = df_errf(e, -errno, "%s: rename to %s failed: %s", tmp, w->path, strerror(errno));
    if (rc < 0) {
        unlink(tmp);
        return rc;
    }
    char dcopy[PATH_MAX];
    snprintf(dcopy, sizeof dcopy, "%s", w->path);
    return df_fsync_dir(dirname(dcopy), e);
}
