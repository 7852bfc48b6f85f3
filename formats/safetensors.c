/* safetensors.c - the safetensors reader (safetensors.h): one file or an
 * index's shards, mmap'ed, every offset and shape bounds-checked. The writer
 * is safetensors_writer.c. */
#include "safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fsutil.h"
#include "le.h"
#include "log.h"
#include "mapguard.h"
#include "safetensors_internal.h"


#define INDEX_MAX_BYTES (64u << 20)

typedef struct st_file {
    char *path;          /* heap string: tensor views point at it */
    const uint8_t *base; /* whole file */
    size_t size;
    int mapped;          /* munmap on close (not for df_st_open_mem) */
} st_file;

struct df_st {
    char *path;
    st_file *files;
    size_t nfiles, capfiles;
    df_st_tensor *t;
    size_t n, cap;
    char **mkey, **mval;
    size_t nmeta, capmeta;
};

/* ------------------------------------------------------------------ */
/* small helpers                                                        */

char *df_st_shape_str(char *out, size_t n, int ndim, const int64_t *shape)
{
    size_t w = 0;
    if (n == 0)
        return out;
    out[0] = 0;
    w += (size_t)snprintf(out + w, n - w, "[");
    for (int i = 0; i < ndim && w < n; i++)
        w += (size_t)snprintf(out + w, n - w, "%s%lld", i ? "," : "", (long long)shape[i]);
    if (w < n)
        snprintf(out + w, n - w, "]");
    return out;
}

/* A non-negative integral JSON number <= 2^53. */
static int json_uint(const cJSON *j, uint64_t *out)
{
    if (!cJSON_IsNumber(j))
        return -1;
    double d = j->valuedouble;
    if (!(d >= 0 && d <= JSON_INT_MAX) || d != (double)(uint64_t)d)
        return -1;
    *out = (uint64_t)d;
    return 0;
}

static int add_meta(df_st *st, const char *k, const char *v)
{
    for (size_t i = 0; i < st->nmeta; i++)
        if (!strcmp(st->mkey[i], k))
            return 0; /* first shard wins */
    if (grow((void **)&st->mkey, &st->capmeta, st->nmeta + 1, sizeof(char *)))
        return -ENOMEM;
    size_t cap = st->capmeta;
    /* mval grows in step with mkey: keep its own capacity equal. */
    char **nv = realloc(st->mval, cap * sizeof(char *));
    if (!nv)
        return -ENOMEM;
    st->mval = nv;
    char *kk = strdup(k), *vv = strdup(v);
    if (!kk || !vv) {
        free(kk);
        free(vv);
        return -ENOMEM;
    }
    st->mkey[st->nmeta] = kk;
    st->mval[st->nmeta] = vv;
    st->nmeta++;
    return 0;
}

static int cmp_name(const void *a, const void *b)
{
    return strcmp(((const df_st_tensor *)a)->name, ((const df_st_tensor *)b)->name);
}

static int cmp_offset(const void *a, const void *b)
{
    const df_st_tensor *x = *(const df_st_tensor *const *)a, *y = *(const df_st_tensor *const *)b;
    if (x->file_offset != y->file_offset)
        return x->file_offset < y->file_offset ? -1 : 1;
    return x->nbytes < y->nbytes ? -1 : x->nbytes > y->nbytes;
}

/* ------------------------------------------------------------------ */
/* parsing one file                                                     */

static int parse_tensor(df_st *st, st_file *f, const cJSON *j, uint64_t data_start,
                        uint64_t data_size, df_err *e)
{
    const char *fn = f->path, *name = j->string;
    if (!cJSON_IsObject(j))
        return df_errf(e, -DF_ECORRUPT, "%s: header entry '%s' is not an object", fn, name);
    const cJSON *jd = cJSON_GetObjectItemCaseSensitive(j, "dtype");
    const cJSON *js = cJSON_GetObjectItemCaseSensitive(j, "shape");
    const cJSON *jo = cJSON_GetObjectItemCaseSensitive(j, "data_offsets");
    if (!cJSON_IsString(jd) || !cJSON_IsArray(js) || !cJSON_IsArray(jo))
        return df_errf(e, -DF_ECORRUPT,
                       "%s: tensor '%s': header entry needs string \"dtype\", array \"shape\" "
                       "and array \"data_offsets\"",
                       fn, name);
    df_st_tensor t;
    memset(&t, 0, sizeof t);
    t.dtype = df_dtype_from_name(jd->valuestring);
    if (t.dtype == DF_DTYPE_INVALID)
        return df_errf(e, -ENOTSUP,
                       "%s: tensor '%s': dtype '%.32s' is not supported (supported: BF16, F16, "
                       "F32, I32, I64, U8, F8_E4M3)",
                       fn, name, jd->valuestring);
    int nd = cJSON_GetArraySize(js);
    if (nd > DF_ST_MAX_DIMS)
        return df_errf(e, -DF_ECORRUPT, "%s: tensor '%s': %d dimensions, more than the %d supported",
                       fn, name, nd, DF_ST_MAX_DIMS);
    t.ndim = nd;
    uint64_t numel = 1;
    int i = 0;
    const cJSON *d;
    cJSON_ArrayForEach(d, js)
    {
        uint64_t v;
        if (json_uint(d, &v))
            return df_errf(e, -DF_ECORRUPT,
                           "%s: tensor '%s': shape[%d] is not a non-negative integer <= 2^53", fn,
                           name, i);
        t.shape[i++] = (int64_t)v;
        if (__builtin_mul_overflow(numel, v, &numel))
            return df_errf(e, -DF_ECORRUPT, "%s: tensor '%s': element count overflows", fn, name);
    }
    t.numel = numel;
    uint64_t nbytes;
    if (__builtin_mul_overflow(numel, (uint64_t)df_dtype_size(t.dtype), &nbytes))
        return df_errf(e, -DF_ECORRUPT, "%s: tensor '%s': byte size overflows", fn, name);
    uint64_t off[2];
    if (cJSON_GetArraySize(jo) != 2 || json_uint(cJSON_GetArrayItem(jo, 0), &off[0]) ||
        json_uint(cJSON_GetArrayItem(jo, 1), &off[1]))
        return df_errf(e, -DF_ECORRUPT,
                       "%s: tensor '%s': data_offsets must be two non-negative integers", fn, name);
    if (off[0] > off[1] || off[1] > data_size)
        return df_errf(e, -DF_ECORRUPT,
                       "%s: tensor '%s': data_offsets [%llu,%llu] outside the data section "
                       "(%llu bytes from file offset %llu)",
                       fn, name, (unsigned long long)off[0], (unsigned long long)off[1],
                       (unsigned long long)data_size, (unsigned long long)data_start);
    if (off[1] - off[0] != nbytes) {
        char sh[160];
        return df_errf(e, -DF_ECORRUPT,
                       "%s: tensor '%s': data_offsets [%llu,%llu] hold %llu bytes, but %s %s "
                       "needs %llu (file offset %llu)",
                       fn, name, (unsigned long long)off[0], (unsigned long long)off[1],
                       (unsigned long long)(off[1] - off[0]), df_dtype_name(t.dtype),
                       df_st_shape_str(sh, sizeof sh, t.ndim, t.shape),
                       (unsigned long long)nbytes,
                       (unsigned long long)(data_start + off[0]));
    }
    t.nbytes = nbytes;
    t.file_offset = data_start + off[0];
    t.data = f->base + t.file_offset;
    t.file = f->path;
    if (grow((void **)&st->t, &st->cap, st->n + 1, sizeof *st->t))
        return df_errf(e, -ENOMEM, "%s: out of memory", fn);
    t.name = strdup(name);
    if (!t.name)
        return df_errf(e, -ENOMEM, "%s: out of memory", fn);
    st->t[st->n++] = t;
    return 0;
}

/* Tensors [first, st->n) all come from one file: no two may share bytes. */
static int check_overlap(df_st *st, size_t first, const char *fn, df_err *e)
{
    size_t m = st->n - first;
    if (m < 2)
        return 0;
    df_st_tensor **v = malloc(m * sizeof *v);
    if (!v)
        return df_errf(e, -ENOMEM, "%s: out of memory", fn);
    size_t k = 0;
    for (size_t i = first; i < st->n; i++)
        if (st->t[i].nbytes) /* empty tensors occupy no bytes */
            v[k++] = &st->t[i];
    qsort(v, k, sizeof *v, cmp_offset);
    int rc = 0;
    for (size_t i = 1; i < k; i++) {
        const df_st_tensor *a = v[i - 1], *b = v[i];
        if (b->file_offset < a->file_offset + a->nbytes) {
            rc = df_errf(e, -DF_ECORRUPT,
                         "%s: tensors '%s' (bytes %llu..%llu) and '%s' (from byte %llu) overlap",
                         fn, a->name, (unsigned long long)a->file_offset,
                         (unsigned long long)(a->file_offset + a->nbytes), b->name,
                         (unsigned long long)b->file_offset);
            break;
        }
    }
    free(v);
    return rc;
}

static int parse_file(df_st *st, st_file *f, df_err *e)
{
    const char *fn = f->path;
    if (f->size < 8)
        return df_errf(e, -DF_ECORRUPT,
                       "%s: file is %zu bytes, too short for the 8-byte header length", fn, f->size);
    uint64_t hlen = df_le64(f->base);
    if (hlen > f->size - 8)
        return df_errf(e, -DF_ECORRUPT,
                       "%s: header length %llu (u64 at offset 0) runs past the end of the file "
                       "(%zu bytes): truncated or not a safetensors file",
                       fn, (unsigned long long)hlen, f->size);
    if (hlen > DF_ST_MAX_HEADER)
        return df_errf(e, -DF_ECORRUPT, "%s: header length %llu (u64 at offset 0) is over the %u limit",
                       fn, (unsigned long long)hlen, DF_ST_MAX_HEADER);
    const char *json = (const char *)f->base + 8, *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(json, (size_t)hlen, &end, 0);
    if (!root) {
        size_t at = end && end >= json && end <= json + hlen ? (size_t)(end - json) : 0;
        return df_errf(e, -DF_ECORRUPT, "%s: header (bytes 8..%llu) is not valid JSON (near byte %zu)",
                       fn, (unsigned long long)(8 + hlen), 8 + at);
    }
    int rc = 0;
    /* Only whitespace (the format pads with spaces) may follow the JSON. */
    for (const char *p = end; p < json + hlen; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r') {
            rc = df_errf(e, -DF_ECORRUPT, "%s: header has trailing garbage at byte %zu", fn,
                         (size_t)(8 + (p - json)));
            goto out;
        }
    if (!cJSON_IsObject(root)) {
        rc = df_errf(e, -DF_ECORRUPT, "%s: header (bytes 8..%llu) is JSON but not an object", fn,
                     (unsigned long long)(8 + hlen));
        goto out;
    }
    uint64_t data_start = 8 + hlen, data_size = f->size - data_start;
    size_t first = st->n;
    const cJSON *j;
    cJSON_ArrayForEach(j, root)
    {
        if (!strcmp(j->string, "__metadata__")) {
            if (cJSON_IsNull(j))
                continue;
            if (!cJSON_IsObject(j)) {
                rc = df_errf(e, -DF_ECORRUPT, "%s: __metadata__ is not an object", fn);
                goto out;
            }
            const cJSON *m;
            cJSON_ArrayForEach(m, j)
            {
                if (!cJSON_IsString(m)) {
                    rc = df_errf(e, -DF_ECORRUPT, "%s: __metadata__ key '%s' is not a string", fn,
                                 m->string);
                    goto out;
                }
                if (add_meta(st, m->string, m->valuestring)) {
                    rc = df_errf(e, -ENOMEM, "%s: out of memory", fn);
                    goto out;
                }
            }
            continue;
        }
        if ((rc = parse_tensor(st, f, j, data_start, data_size, e)) < 0)
            goto out;
    }
    rc = check_overlap(st, first, fn, e);
out:
    cJSON_Delete(root);
    return rc;
}

/* Sorts by name and refuses duplicates (within a file or across shards). */
static int finish_index(df_st *st, df_err *e)
{
    if (st->n > 1)
        qsort(st->t, st->n, sizeof *st->t, cmp_name);
    for (size_t i = 1; i < st->n; i++)
        if (!strcmp(st->t[i - 1].name, st->t[i].name)) {
            const df_st_tensor *a = &st->t[i - 1], *b = &st->t[i];
            if (a->file == b->file)
                return df_errf(e, -DF_ECORRUPT, "%s: tensor '%s' appears twice", a->file, a->name);
            return df_errf(e, -DF_ECORRUPT, "%s: tensor '%s' is in two shards: %s and %s",
                           st->path, a->name, a->file, b->file);
        }
    return 0;
}

/* ------------------------------------------------------------------ */
/* open / close                                                         */

static st_file *new_file(df_st *st, const char *path)
{
    if (grow((void **)&st->files, &st->capfiles, st->nfiles + 1, sizeof *st->files))
        return NULL;
    st_file *f = &st->files[st->nfiles];
    memset(f, 0, sizeof *f);
    f->path = strdup(path);
    if (!f->path)
        return NULL;
    st->nfiles++;
    return f;
}

static int map_file(st_file *f, df_err *e)
{
    int fd = df_open_regular(f->path, O_RDONLY, 0, e); /* a FIFO would block open(2) */
    if (fd < 0)
        return fd;
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int err = errno;
        close(fd);
        return df_errf(e, -err, "%s: cannot stat: %s", f->path, strerror(err));
    }
    f->size = (size_t)sb.st_size;
    if (f->size == 0) { /* mmap refuses 0 bytes; parse_file reports "too short" */
        close(fd);
        static const uint8_t empty[1];
        f->base = empty;
        return 0;
    }
    void *p = mmap(NULL, f->size, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    close(fd);
    if (p == MAP_FAILED)
        return df_errf(e, -err, "%s: mmap of %zu bytes failed: %s", f->path, f->size, strerror(err));
    f->base = p;
    f->mapped = 1;
    (void)df_mapguard_add(p, f->size, f->path); /* a clear error if the file shrinks under us */
    return 0;
}

static df_st *st_new(const char *path)
{
    df_st *st = calloc(1, sizeof *st);
    if (!st)
        return NULL;
    st->path = strdup(path);
    if (!st->path) {
        free(st);
        return NULL;
    }
    return st;
}

void df_st_close(df_st *st)
{
    if (!st)
        return;
    for (size_t i = 0; i < st->n; i++)
        free((char *)st->t[i].name);
    free(st->t);
    for (size_t i = 0; i < st->nfiles; i++) {
        if (st->files[i].mapped) {
            df_mapguard_remove(st->files[i].base);
            munmap((void *)st->files[i].base, st->files[i].size);
        }
        free(st->files[i].path);
    }
    free(st->files);
    for (size_t i = 0; i < st->nmeta; i++) {
        free(st->mkey[i]);
        free(st->mval[i]);
    }
    free(st->mkey);
    free(st->mval);
    free(st->path);
    free(st);
}

static int open_single(df_st *st, const char *path, df_err *e)
{
    st_file *f = new_file(st, path);
    if (!f)
        return df_errf(e, -ENOMEM, "%s: out of memory", path);
    int rc = map_file(f, e);
    if (rc < 0)
        return rc;
    if ((rc = parse_file(st, f, e)) < 0)
        return rc;
    return finish_index(st, e);
}

/* A shard name from an index must stay inside the model folder. */
static int shard_name_ok(const char *s)
{
    if (!*s || *s == '/')
        return 0;
    for (const char *p = s; *p;) {
        const char *q = strchr(p, '/');
        size_t n = q ? (size_t)(q - p) : strlen(p);
        if (n == 2 && p[0] == '.' && p[1] == '.')
            return 0;
        if (!q)
            break;
        p = q + 1;
    }
    return 1;
}

static int open_index(df_st *st, const char *index_path, df_err *e)
{
    char *txt = NULL;
    size_t len = 0;
    int rc = df_file_read_all(index_path, INDEX_MAX_BYTES, &txt, &len, e);
    if (rc < 0)
        return rc;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(txt, len, &end, 0);
    if (!root) {
        size_t at = end && end >= txt && end <= txt + len ? (size_t)(end - txt) : 0;
        free(txt);
        return df_errf(e, -DF_ECORRUPT, "%s: not valid JSON (near byte %zu)", index_path, at);
    }
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", index_path);
    char *d = dirname(dir);
    char dcopy[PATH_MAX];
    snprintf(dcopy, sizeof dcopy, "%s", d);

    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    const cJSON *j;
    if (!cJSON_IsObject(wm)) {
        rc = df_errf(e, -DF_ECORRUPT, "%s: no \"weight_map\" object", index_path);
        goto out;
    }
    /* First pass: open every distinct shard once, in order of appearance. */
    cJSON_ArrayForEach(j, wm)
    {
        if (!cJSON_IsString(j) || !shard_name_ok(j->valuestring)) {
            rc = df_errf(e, -DF_ECORRUPT,
                         "%s: weight_map entry '%s' must name a file inside the model folder",
                         index_path, j->string);
            goto out;
        }
        char p[PATH_MAX];
        if (df_path_join(p, sizeof p, dcopy, j->valuestring) < 0) {
            rc = df_errf(e, -ENAMETOOLONG, "%s: shard path too long: %s", index_path, j->valuestring);
            goto out;
        }
        int seen = 0;
        for (size_t i = 0; i < st->nfiles && !seen; i++)
            seen = !strcmp(st->files[i].path, p);
        if (seen)
            continue;
        if (access(p, F_OK) != 0) {
            rc = df_errf(e, -ENOENT, "%s: weight_map names shard '%s' (for tensor '%s'), but %s does not exist",
                         index_path, j->valuestring, j->string, p);
            goto out;
        }
        st_file *f = new_file(st, p);
        if (!f) {
            rc = df_errf(e, -ENOMEM, "%s: out of memory", index_path);
            goto out;
        }
        if ((rc = map_file(f, e)) < 0 || (rc = parse_file(st, f, e)) < 0)
            goto out;
    }
    if (st->nfiles == 0) {
        rc = df_errf(e, -DF_ECORRUPT, "%s: weight_map is empty", index_path);
        goto out;
    }
    if ((rc = finish_index(st, e)) < 0)
        goto out;
    /* Second pass: the index must tell the truth about where each tensor is. */
    size_t listed = 0;
    cJSON_ArrayForEach(j, wm)
    {
        const df_st_tensor *t = df_st_find(st, j->string);
        char p[PATH_MAX];
        df_path_join(p, sizeof p, dcopy, j->valuestring);
        if (!t) {
            rc = df_errf(e, -DF_ECORRUPT, "%s: weight_map puts tensor '%s' in %s, which does not hold it",
                         index_path, j->string, p);
            goto out;
        }
        if (strcmp(t->file, p)) {
            rc = df_errf(e, -DF_ECORRUPT, "%s: weight_map puts tensor '%s' in %s, but it is in %s",
                         index_path, j->string, p, t->file);
            goto out;
        }
        listed++;
    }
    if (listed != st->n)
        df_log(DF_LOG_WARN, "%s: %zu tensor(s) in the shards are not listed in weight_map",
               index_path, st->n - listed);
    rc = 0;
out:
    cJSON_Delete(root);
    free(txt);
    return rc;
}

static int ends_with(const char *s, const char *suf)
{
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

int df_st_open(const char *path, df_st **out, df_err *e)
{
    *out = NULL;
    struct stat sb;
    if (stat(path, &sb) != 0)
        return df_errf(e, -errno, "%s: %s", path, strerror(errno));
    df_st *st = st_new(path);
    if (!st)
        return df_errf(e, -ENOMEM, "%s: out of memory", path);
    int rc;
    if (S_ISDIR(sb.st_mode)) {
        char p[PATH_MAX];
        if (df_path_join(p, sizeof p, path, "model.safetensors.index.json") < 0) {
            rc = df_errf(e, -ENAMETOOLONG, "%s: path too long", path);
        } else if (access(p, F_OK) == 0) {
            rc = open_index(st, p, e);
        } else {
            df_path_join(p, sizeof p, path, "model.safetensors");
            if (access(p, F_OK) == 0)
                rc = open_single(st, p, e);
            else
                rc = df_errf(e, -ENOENT,
                             "%s: holds neither model.safetensors.index.json nor model.safetensors",
                             path);
        }
    } else if (ends_with(path, ".index.json")) {
        rc = open_index(st, path, e);
    } else {
        rc = open_single(st, path, e);
    }
    if (rc < 0) {
        df_st_close(st);
        return rc;
    }
    *out = st;
    return 0;
}

int df_st_open_mem(const void *buf, size_t len, const char *name, df_st **out, df_err *e)
{
    *out = NULL;
    static const uint8_t empty[1];
    df_st *st = st_new(name ? name : "(memory)");
    if (!st)
        return df_errf(e, -ENOMEM, "out of memory");
    st_file *f = new_file(st, st->path);
    if (!f) {
        df_st_close(st);
        return df_errf(e, -ENOMEM, "out of memory");
    }
    f->base = buf ? buf : empty;
    f->size = buf ? len : 0;
    int rc = parse_file(st, f, e);
    if (rc >= 0)
        rc = finish_index(st, e);
    if (rc < 0) {
        df_st_close(st);
        return rc;
    }
    *out = st;
    return 0;
}

/* ------------------------------------------------------------------ */
/* queries                                                              */

size_t df_st_count(const df_st *st) { return st->n; }

const df_st_tensor *df_st_at(const df_st *st, size_t i) { return i < st->n ? &st->t[i] : NULL; }

const df_st_tensor *df_st_find(const df_st *st, const char *name)
{
    size_t lo = 0, hi = st->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int c = strcmp(name, st->t[mid].name);
        if (!c)
            return &st->t[mid];
        if (c < 0)
            hi = mid;
        else
            lo = mid + 1;
    }
    return NULL;
}

int df_st_get(const df_st *st, const char *name, const df_st_tensor **out, df_err *e)
{
    const df_st_tensor *t = df_st_find(st, name);
    if (out)
        *out = t;
    if (!t)
        return df_errf(e, -ENOENT, "%s: no tensor named '%s'", st->path, name);
    return 0;
}

int df_st_check(const df_st_tensor *t, df_dtype dtype, int ndim, const int64_t *shape, df_err *e)
{
    int shape_ok = t->ndim == ndim;
    for (int i = 0; shape_ok && i < ndim; i++)
        shape_ok = t->shape[i] == shape[i];
    int dtype_ok = dtype == DF_DTYPE_INVALID || t->dtype == dtype;
    if (shape_ok && dtype_ok)
        return 0;
    char have[160], want[160];
    df_st_shape_str(have, sizeof have, t->ndim, t->shape);
    df_st_shape_str(want, sizeof want, ndim, shape);
    if (!shape_ok && !dtype_ok)
        return df_errf(e, -DF_EMISMATCH, "%s: %s shape %s, expected %s %s (in %s)", t->name,
                       df_dtype_name(t->dtype), have, df_dtype_name(dtype), want, t->file);
    if (!shape_ok)
        return df_errf(e, -DF_EMISMATCH, "%s: shape %s, expected %s (in %s)", t->name, have, want,
                       t->file);
    return df_errf(e, -DF_EMISMATCH, "%s: dtype %s, expected %s (in %s)", t->name,
                   df_dtype_name(t->dtype), df_dtype_name(dtype), t->file);
}

int df_st_expect(const df_st *st, const char *name, df_dtype dtype, int ndim,
                 const int64_t *shape, const df_st_tensor **out, df_err *e)
{
    const df_st_tensor *t;
    int rc = df_st_get(st, name, &t, e);
    if (rc < 0)
        return rc;
    if ((rc = df_st_check(t, dtype, ndim, shape, e)) < 0)
        return rc;
    if (out)
        *out = t;
    return 0;
}

const char *df_st_metadata(const df_st *st, const char *key)
{
    for (size_t i = 0; i < st->nmeta; i++)
        if (!strcmp(st->mkey[i], key))
            return st->mval[i];
    return NULL;
}

size_t df_st_metadata_count(const df_st *st) { return st->nmeta; }

int df_st_metadata_at(const df_st *st, size_t i, const char **key, const char **value)
{
    if (i >= st->nmeta)
        return -ERANGE;
    *key = st->mkey[i];
    *value = st->mval[i];
    return 0;
}

const char *df_st_path(const df_st *st) { return st->path; }

size_t df_st_file_count(const df_st *st) { return st->nfiles; }
