/* cache_read.c - a finished cache: open (manifest + every index), read one
 * sample (or some of its layers) with pread, verify everything. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "basis.h"
#include "cache.h"
#include "cache_internal.h"
#include "fsutil.h"
#include "le.h"

struct df_cache {
    char dir[4096];
    df_cache_info info;
    df_cache_part part;
    int *fds;
    char (*paths)[4096 + 80];
    df_cache_entry *ents; /* sorted by id */
    size_t n;
};

static int cmp_entry_id(const void *a, const void *b)
{
    const df_cache_entry *x = a, *y = b;
    return x->id < y->id ? -1 : x->id > y->id;
}

void df_cache_close(df_cache *c)
{
    if (!c)
        return;
    for (uint32_t s = 0; s < c->part.n_shards; s++)
        if (c->fds && c->fds[s] >= 0)
            close(c->fds[s]);
    free(c->fds);
    free(c->paths);
    free(c->ents);
    df_cache_part_free(&c->part);
    free(c);
}

static int pread_full(int fd, void *buf, size_t len, uint64_t off, const char *path, df_err *e)
{
    size_t done = 0;
    while (done < len) {
        ssize_t r = pread(fd, (char *)buf + done, len - done, (off_t)(off + done));
        if (r < 0 && errno == EINTR)
            continue;
        if (r < 0)
            return df_errf(e, -errno, "%s: read at offset %" PRIu64 " failed: %s", path,
                           off + done, strerror(errno));
        if (r == 0)
            return df_errf(e, -DF_ECORRUPT, "%s: offset %" PRIu64 ": file ends early", path,
                           off + done);
        done += (size_t)r;
    }
    return 0;
}

df_cache *df_cache_open(const char *dir, df_err *e)
{
    df_cache *c = calloc(1, sizeof *c);
    if (!c) {
        df_errf(e, -ENOMEM, "out of memory");
        return NULL;
    }
    snprintf(c->dir, sizeof c->dir, "%s", dir);
    df_cache_info *in = &c->info;
    int rc = df_cache_manifest_read(dir, &in->params, &c->part, in->created_by,
                                    sizeof in->created_by, e);
    if (rc)
        goto fail;
    uint32_t ns = c->part.n_shards;
    c->fds = malloc((ns ? ns : 1) * sizeof *c->fds);
    c->paths = calloc(ns ? ns : 1, sizeof *c->paths);
    if (!c->fds || !c->paths) {
        df_errf(e, -ENOMEM, "out of memory");
        goto fail;
    }
    for (uint32_t s = 0; s < ns; s++)
        c->fds[s] = -1;
    size_t cap = 0;
    for (uint32_t s = 0; s < ns; s++) {
        const df_cache_shard_info *si = &c->part.shards[s];
        snprintf(c->paths[s], sizeof c->paths[s], "%s/%s", dir, si->data);
        c->fds[s] = df_open_regular(c->paths[s], O_RDONLY, 0, e);
        if (c->fds[s] < 0) {
            df_err_wrap(e, "shard listed in the manifest");
            goto fail;
        }
        struct stat st;
        if (fstat(c->fds[s], &st) || (uint64_t)st.st_size != si->bytes) {
            df_errf(e, -DF_ECORRUPT, "%s: %lld bytes, the manifest says %" PRIu64
                    " (truncated or replaced)", c->paths[s], (long long)st.st_size, si->bytes);
            goto fail;
        }
        uint8_t hdr[DF_CACHE_SHARD_HEADER];
        if (pread_full(c->fds[s], hdr, sizeof hdr, 0, c->paths[s], e) ||
            df_cache_shard_header_check(&in->params, hdr, sizeof hdr, si->rank, si->seq,
                                        c->paths[s], e))
            goto fail;
        char ipath[4096 + 80];
        snprintf(ipath, sizeof ipath, "%s/%s", dir, si->index);
        char *buf;
        size_t len;
        if (df_file_read_all(ipath, (size_t)1 << 40, &buf, &len, e))
            goto fail;
        df_cache_entry *ents;
        size_t n;
        rc = df_cache_index_parse(&in->params, (uint8_t *)buf, len, s, ipath, &ents, &n, NULL,
                                  NULL, e);
        free(buf);
        if (rc)
            goto fail;
        uint64_t end = n ? ents[n - 1].offset + ents[n - 1].record_bytes : DF_CACHE_SHARD_HEADER;
        uint64_t toks = 0;
        for (size_t i = 0; i < n; i++)
            toks += ents[i].n_tokens;
        if (n != si->samples || end != si->bytes || toks != si->tokens) {
            free(ents);
            df_errf(e, -DF_ECORRUPT, "%s: index (%zu samples, %" PRIu64 " tokens, ends at %" PRIu64
                    ") disagrees with the manifest (%" PRIu64 ", %" PRIu64 ", %" PRIu64 ")",
                    ipath, n, toks, end, si->samples, si->tokens, si->bytes);
            goto fail;
        }
        if (c->n + n > cap) {
            cap = (c->n + n) * 2;
            df_cache_entry *ne = realloc(c->ents, cap * sizeof *ne);
            if (!ne) {
                free(ents);
                df_errf(e, -ENOMEM, "out of memory");
                goto fail;
            }
            c->ents = ne;
        }
        if (n) /* (an empty shard's list may be NULL) */
            memcpy(c->ents + c->n, ents, n * sizeof *ents);
        c->n += n;
        free(ents);
        in->file_bytes += si->bytes;
    }
    if (c->n > 1) /* (an empty cache has no list: qsort wants one) */
        qsort(c->ents, c->n, sizeof *c->ents, cmp_entry_id);
    uint64_t toks = 0, loss = 0, stored = 0;
    for (size_t i = 0; i < c->n; i++) {
        if (i && c->ents[i].id == c->ents[i - 1].id) {
            df_errf(e, -DF_ECORRUPT, "%s: sample %" PRIu64 " appears twice (%s and %s)", dir,
                    c->ents[i].id, c->part.shards[c->ents[i - 1].shard].data,
                    c->part.shards[c->ents[i].shard].data);
            goto fail;
        }
        toks += c->ents[i].n_tokens;
        loss += c->ents[i].n_loss;
        stored += c->ents[i].stored_bytes;
    }
    if (c->n != c->part.samples || toks != c->part.tokens || loss != c->part.loss_tokens ||
        stored != c->part.stored_bytes) {
        df_errf(e, -DF_ECORRUPT, "%s/manifest.json: totals disagree with the indexes", dir);
        goto fail;
    }
    in->samples = c->part.samples;
    in->tokens = c->part.tokens;
    in->loss_tokens = c->part.loss_tokens;
    in->raw_bytes = c->part.raw_bytes;
    in->stored_bytes = c->part.stored_bytes;
    memcpy(in->layer_raw, c->part.layer_raw, sizeof in->layer_raw);
    memcpy(in->layer_stored, c->part.layer_stored, sizeof in->layer_stored);
    in->n_shards = ns;
    in->shards = c->part.shards;
    return c;
fail:
    df_cache_close(c);
    return NULL;
}

const df_cache_info *df_cache_get_info(const df_cache *c) { return &c->info; }
const char *df_cache_dir(const df_cache *c) { return c->dir; }
size_t df_cache_count(const df_cache *c) { return c->n; }
const df_cache_entry *df_cache_entry_at(const df_cache *c, size_t k)
{
    return k < c->n ? &c->ents[k] : NULL;
}
int df_cache_shard_fd(const df_cache *c, uint32_t s) { return s < c->part.n_shards ? c->fds[s] : -1; }
const char *df_cache_shard_path(const df_cache *c, uint32_t s)
{
    return s < c->part.n_shards ? c->paths[s] : "?";
}

int64_t df_cache_find(const df_cache *c, uint64_t id)
{
    size_t lo = 0, hi = c->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (c->ents[mid].id < id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo < c->n && c->ents[lo].id == id ? (int64_t)lo : -ENOENT;
}

/* Checks a parsed record against the index entry that led to it. */
static int match_entry(const df_cache_record *r, const df_cache_entry *t, const char *path,
                       df_err *e)
{
    if (r->id != t->id || r->record_bytes != t->record_bytes || r->n_tokens != t->n_tokens ||
        r->header_crc != t->header_crc)
        return df_errf(e, -DF_ECORRUPT,
                       "%s: offset %" PRIu64 ": record (sample %" PRIu64 ", %u tokens) does not "
                       "match its index entry (sample %" PRIu64 ", %u tokens)",
                       path, t->offset, r->id, r->n_tokens, t->id, t->n_tokens);
    return 0;
}

/* Reads a record's prefix (header, table, tokens) into buf (record_bytes
 * big), then parses it. */
static int read_prefix(df_cache *c, const df_cache_entry *t, uint8_t *buf, df_cache_record *r,
                       df_err *e)
{
    const char *path = c->paths[t->shard];
    int fd = c->fds[t->shard];
    uint64_t have = t->record_bytes < 65536 ? t->record_bytes : 65536;
    int rc = pread_full(fd, buf, have, t->offset, path, e);
    if (rc)
        return rc;
    if (have >= DF_CACHE_RECORD_HEADER) {
        /* The unverified header says how long the prefix is; bounded by the
         * entry's record size, so a lie costs at most one extra read. */
        uint64_t nb = df_le32(buf + 28), nt = df_le32(buf + 24);
        uint64_t need = DF_CACHE_RECORD_HEADER + nb * DF_CACHE_BLOCK_ENTRY + 64 + nt * 5;
        if (need > have) {
            need = need < t->record_bytes ? need : t->record_bytes;
            rc = pread_full(fd, buf + have, need - have, t->offset + have, path, e);
            if (rc)
                return rc;
        }
    }
    rc = df_cache_record_parse(&c->info.params, buf, t->record_bytes, r, e);
    if (rc)
        return df_err_wrap(e, "%s: offset %" PRIu64 " (sample %" PRIu64 ")", path, t->offset,
                           t->id);
    return match_entry(r, t, path, e);
}

int df_cache_read(df_cache *c, size_t k, uint64_t layer_mask, df_cache_out *out, df_pool *pool,
                  df_err *e)
{
    if (k >= c->n)
        return df_errf(e, -ENOENT, "sample position %zu out of range (%zu samples)", k, c->n);
    const df_cache_entry *t = &c->ents[k];
    const df_cache_params *p = &c->info.params;
    layer_mask &= p->n_layers >= 64 ? ~0ull : ((1ull << p->n_layers) - 1);
    uint8_t *buf = malloc(t->record_bytes);
    if (!buf)
        return df_errf(e, -ENOMEM, "sample %" PRIu64 ": out of memory for %" PRIu64 " bytes",
                       t->id, t->record_bytes);
    df_cache_record r = {0};
    int rc = read_prefix(c, t, buf, &r, e);
    const char *path = c->paths[t->shard];
    /* Each selected layer's blocks are contiguous: one read per layer. */
    uint32_t bpl = r.n_layers ? r.n_blocks / r.n_layers : 0;
    for (uint32_t l = 0; !rc && bpl && l < p->n_layers; l++) {
        if (!(layer_mask >> l & 1))
            continue;
        df_cache_block first, last;
        df_cache_record_block(&r, l * bpl, &first);
        df_cache_record_block(&r, l * bpl + bpl - 1, &last);
        rc = pread_full(c->fds[t->shard], buf + first.offset,
                        last.offset + last.stored_size - first.offset, t->offset + first.offset,
                        path, e);
    }
    if (!rc && (rc = df_cache_record_check_ids(p, &r, e)))
        df_err_wrap(e, "%s: offset %" PRIu64, path, t->offset);
    if (!rc) {
        const uint32_t *ids;
        const uint8_t *mask;
        df_cache_record_tokens(&r, &ids, &mask);
        if (out->ids)
            memcpy(out->ids, ids, (size_t)r.n_tokens * 4);
        if (out->loss_mask) {
            if (mask)
                memcpy(out->loss_mask, mask, r.n_tokens);
            else
                memset(out->loss_mask, 1, r.n_tokens);
        }
        rc = df_cache_record_decode(p, &r, layer_mask, out->layers, pool, e);
        if (rc)
            df_err_wrap(e, "%s: offset %" PRIu64, path, t->offset);
    }
    free(buf);
    return rc;
}

typedef struct verify_job {
    df_cache *c;
    pthread_mutex_t mu;
    uint64_t done, bad;
    df_err first;
    size_t first_k;
    int have;
    void (*progress)(void *, uint64_t, uint64_t);
    void *arg;
} verify_job;

static int verify_one(void *vp, size_t k)
{
    verify_job *j = vp;
    df_cache *c = j->c;
    const df_cache_entry *t = &c->ents[k];
    df_err e = {0};
    int rc;
    uint8_t *buf = malloc(t->record_bytes);
    if (!buf)
        rc = df_errf(&e, -ENOMEM, "out of memory");
    else
        rc = pread_full(c->fds[t->shard], buf, t->record_bytes, t->offset, c->paths[t->shard], &e);
    df_cache_record r;
    if (!rc) {
        rc = df_cache_record_parse(&c->info.params, buf, t->record_bytes, &r, &e);
        if (!rc)
            rc = match_entry(&r, t, c->paths[t->shard], &e);
        if (!rc)
            rc = df_cache_record_check_ids(&c->info.params, &r, &e);
        if (!rc)
            rc = df_cache_record_verify(&c->info.params, &r, &e);
        uint64_t stored = 0, loss = 0;
        for (uint32_t i = 0; !rc && i < r.n_blocks; i++) {
            df_cache_block b;
            df_cache_record_block(&r, i, &b);
            stored += b.stored_size;
        }
        if (!rc) {
            const uint32_t *ids;
            const uint8_t *mask;
            df_cache_record_tokens(&r, &ids, &mask);
            for (uint32_t i = 0; i < r.n_tokens; i++)
                loss += mask ? mask[i] : 1;
            if (stored != t->stored_bytes || loss != t->n_loss)
                rc = df_errf(&e, -DF_ECORRUPT, "index entry sizes disagree with the record");
        }
        if (rc && !strstr(e.msg, c->paths[t->shard]))
            df_err_wrap(&e, "%s: offset %" PRIu64 " (sample %" PRIu64 ")", c->paths[t->shard],
                        t->offset, t->id);
    }
    free(buf);
    pthread_mutex_lock(&j->mu);
    j->done++;
    if (rc) {
        j->bad++;
        if (!j->have || k < j->first_k) {
            j->first = e;
            j->first_k = k;
            j->have = 1;
        }
    }
    if (j->progress && (j->done % 64 == 0 || j->done == c->n))
        j->progress(j->arg, j->done, c->n);
    pthread_mutex_unlock(&j->mu);
    return rc;
}

int df_cache_load_basis(const char *dir, const df_cache_params *p, df_basis *out, df_err *e)
{
    if (!p->proj_rank)
        return 0;
    char path[4200], hex[DF_SHA256_HEX];
    if (snprintf(path, sizeof path, "%s/%s", dir, DF_CACHE_BASIS_FILE) >= (int)sizeof path)
        return df_errf(e, -ENAMETOOLONG, "%s: path too long", dir);
    int rc = df_basis_sha256(path, hex, e);
    if (rc)
        return rc;
    if (strcmp(hex, p->basis_sha256))
        return df_errf(e, -DF_ECORRUPT, "%s: sha256 %.12s... is not the basis the cache was "
                       "projected with (%.12s...)", path, hex, p->basis_sha256);
    df_basis b = {0};
    if ((rc = df_basis_read(path, &b, e)))
        return rc;
    if ((uint32_t)b.R != p->proj_rank || (uint32_t)b.K != p->src_n_layers ||
        (uint32_t)b.H != p->src_hidden ||
        memcmp(b.layer_ids, p->src_layer_ids, (size_t)b.K * sizeof *b.layer_ids))
        rc = df_errf(e, -DF_ECORRUPT, "%s: a rank-%d basis of %d layers x %d; the cache holds "
                     "rank %u of %u layers x %u", path, b.R, b.K, b.H, p->proj_rank,
                     p->src_n_layers, p->src_hidden);
    if (!rc && out)
        *out = b; /* the caller's now */
    else
        df_basis_free(&b);
    return rc;
}

int df_cache_verify(df_cache *c, df_pool *pool, void (*progress)(void *, uint64_t, uint64_t),
                    void *arg, uint64_t *n_bad, df_err *e)
{
    int brc = df_cache_load_basis(c->dir, &c->info.params, NULL, e);
    if (brc) {
        if (n_bad)
            *n_bad = 0;
        return brc;
    }
    verify_job j = {.c = c, .progress = progress, .arg = arg};
    pthread_mutex_init(&j.mu, NULL);
    int rc = df_pool_for(pool, c->n, verify_one, &j);
    pthread_mutex_destroy(&j.mu);
    if (n_bad)
        *n_bad = j.bad;
    if (rc && e)
        *e = j.first;
    return rc;
}
