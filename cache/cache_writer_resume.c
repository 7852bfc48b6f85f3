/* cache_writer_resume.c - the cache writer's resume: what open() finds of
 * this rank's earlier run in the directory. Finished shards are taken as they
 * are (their index parsed, their size checked); the one partial shard is
 * scanned record by record, every CRC checked, cut after the last verified
 * sample and left open for appending. The sample ids found are kept sorted
 * for df_cache_writer_has(). Apart from cache_writer.c because it reads and
 * repairs old files, while that file only ever appends new ones.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache_writer_internal.h"
#include "fsutil.h"
#include "io.h"
#include "le.h"
#include "log.h"

static int cmp_u64(const void *a, const void *b)
{
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}

static int push_done(df_cache_writer *w, uint64_t id, size_t *cap)
{
    if (w->n_done == *cap) {
        *cap = *cap ? 2 * *cap : 1024;
        uint64_t *n = realloc(w->done_ids, *cap * sizeof *n);
        if (!n)
            return -ENOMEM;
        w->done_ids = n;
    }
    w->done_ids[w->n_done++] = id;
    if (!w->have_last || id > w->last_id)
        w->last_id = id;
    w->have_last = 1;
    return 0;
}

/* Scans a partial shard, keeps its verified prefix (truncating the rest) and
 * leaves it open for appending. Returns 0, or a negative code. */
static int recover_partial(df_cache_writer *w, uint32_t seq, size_t *done_cap, df_err *e)
{
    char path[4200];
    df_cw_shard_path(w, seq, ".dfc.partial", path, sizeof path);
    int fd = df_open_regular(path, O_RDWR, 0, e);
    if (fd < 0)
        return fd;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int err = -errno;
        close(fd);
        return df_errf(e, err, "%s: cannot stat: %s", path, strerror(-err));
    }
    uint64_t size = (uint64_t)st.st_size, off = DF_CACHE_SHARD_HEADER;
    uint8_t hdr[DF_CACHE_SHARD_HEADER];
    df_err tmp;
    if (size < DF_CACHE_SHARD_HEADER || pread(fd, hdr, sizeof hdr, 0) != (ssize_t)sizeof hdr ||
        df_cache_shard_header_check(&w->p, hdr, sizeof hdr, w->o.rank, seq, path, &tmp)) {
        /* Not even a header made it to disk: start this shard afresh. */
        close(fd);
        unlink(path);
        df_log(DF_LOG_INFO, "resume: %s had no valid header; rewriting it", path);
        return 1;
    }
    uint8_t *buf = NULL;
    size_t cap = 0;
    uint64_t kept = 0;
    while (off + DF_CACHE_RECORD_HEADER <= size) {
        uint8_t h[DF_CACHE_RECORD_HEADER];
        if (pread(fd, h, sizeof h, (off_t)off) != (ssize_t)sizeof h)
            break;
        uint64_t rb = df_le64(h + 16);
        if (rb == 0 || rb % DF_CACHE_ALIGN || rb > size - off)
            break;
        if (rb > cap) {
            free(buf);
            cap = rb;
            buf = malloc(cap);
            if (!buf) {
                close(fd);
                return df_errf(e, -ENOMEM, "%s: out of memory scanning", path);
            }
        }
        if (pread(fd, buf, rb, (off_t)off) != (ssize_t)rb)
            break;
        df_cache_record r;
        if (df_cache_record_parse(&w->p, buf, rb, &r, &tmp) || r.record_bytes != rb ||
            df_cache_record_verify(&w->p, &r, &tmp) || (w->have_last && r.id <= w->last_id))
            break;
        const uint32_t *ids;
        const uint8_t *mask;
        df_cache_record_tokens(&r, &ids, &mask);
        df_cache_entry t = {.id = r.id, .offset = off, .record_bytes = rb,
                            .n_tokens = r.n_tokens, .header_crc = r.header_crc};
        for (uint32_t i = 0; i < r.n_tokens; i++)
            t.n_loss += mask ? mask[i] : 1;
        for (uint32_t i = 0; i < r.n_blocks; i++) {
            df_cache_block b;
            df_cache_record_block(&r, i, &b);
            t.stored_bytes += b.stored_size;
            w->cur_raw[b.layer] += b.raw_size;
            w->cur_stored[b.layer] += b.stored_size;
        }
        if (df_cw_add_entry(w, &t) || push_done(w, r.id, done_cap)) {
            free(buf);
            close(fd);
            return df_errf(e, -ENOMEM, "out of memory");
        }
        w->cur_tokens += r.n_tokens;
        w->cur_loss += t.n_loss;
        w->st.resumed_samples++;
        w->st.resumed_tokens += r.n_tokens;
        off += rb;
        kept++;
    }
    free(buf);
    if (off < size) {
        df_log(DF_LOG_INFO, "resume: %s: kept %" PRIu64 " verified samples, cut %" PRIu64
               " bytes of incomplete data at offset %" PRIu64, path, kept, size - off, off);
        if (ftruncate(fd, (off_t)off) != 0) {
            int err = -errno;
            close(fd);
            return df_errf(e, err, "%s: truncate to %" PRIu64 " failed", path, off);
        }
        fsync(fd);
    }
    close(fd);
    int direct = 0;
    fd = df_io_open_file(path, O_WRONLY, 0644, !w->o.buffered, &direct, e);
    if (fd < 0)
        return fd;
    w->fd = fd;
    w->cur_open = 1;
    w->cur_seq = seq;
    w->cur_size = off;
    return 0;
}

static int load_finished(df_cache_writer *w, uint32_t seq, size_t *done_cap, df_err *e)
{
    char dpath[4200], ipath[4200];
    df_cw_shard_path(w, seq, ".dfc", dpath, sizeof dpath);
    df_cw_shard_path(w, seq, ".dfi", ipath, sizeof ipath);
    char *buf;
    size_t len;
    int rc = df_file_read_all(ipath, (size_t)1 << 40, &buf, &len, e);
    if (rc)
        return df_err_wrap(e, "resume: finished shard %s", dpath);
    df_cache_entry *ents;
    size_t n;
    uint64_t raw[DF_CACHE_MAX_LAYERS] = {0}, stored[DF_CACHE_MAX_LAYERS] = {0};
    rc = df_cache_index_parse(&w->p, (uint8_t *)buf, len, seq, ipath, &ents, &n, raw, stored, e);
    free(buf);
    if (rc)
        return rc;
    struct stat st;
    uint64_t end = n ? ents[n - 1].offset + ents[n - 1].record_bytes : DF_CACHE_SHARD_HEADER;
    if (stat(dpath, &st) != 0 || !S_ISREG(st.st_mode) || (uint64_t)st.st_size != end) {
        free(ents);
        return df_errf(e, -DF_ECORRUPT, "%s: size does not match its index (%" PRIu64 " bytes)",
                       dpath, end);
    }
    df_cache_shard_info si = {.rank = w->o.rank, .seq = seq, .samples = n, .bytes = end};
    df_cache_shard_name(si.data, sizeof si.data, w->o.rank, seq, ".dfc");
    df_cache_shard_name(si.index, sizeof si.index, w->o.rank, seq, ".dfi");
    uint64_t loss = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        si.tokens += ents[i].n_tokens;
        loss += ents[i].n_loss;
        if (w->have_last && ents[i].id <= w->last_id)
            rc = df_errf(e, -DF_ECORRUPT, "%s: sample ids not increasing", ipath);
        else if (push_done(w, ents[i].id, done_cap))
            rc = df_errf(e, -ENOMEM, "out of memory");
    }
    free(ents);
    if (!rc && df_cw_part_add_shard(w, &si, raw, stored, loss))
        rc = df_errf(e, -ENOMEM, "out of memory");
    w->st.resumed_samples += n;
    w->st.resumed_tokens += si.tokens;
    return rc;
}

/* Finds this rank's shards: finished ones 0..k-1, then at most one partial k. */
int df_cw_resume(df_cache_writer *w, df_err *e)
{
    DIR *d = opendir(w->dir);
    if (!d)
        return df_errf(e, -errno, "%s: cannot list: %s", w->dir, strerror(errno));
    uint32_t n_fin = 0, max_fin = 0;
    int have_partial = 0;
    uint32_t partial_seq = 0;
    struct dirent *de;
    char want[32];
    snprintf(want, sizeof want, "shard-r%04u-", w->o.rank);
    while ((de = readdir(d))) {
        unsigned seq;
        char rest[32] = {0};
        if (strncmp(de->d_name, want, strlen(want)) ||
            sscanf(de->d_name + strlen(want), "%5u%31s", &seq, rest) != 2)
            continue;
        if (!strcmp(rest, ".dfc")) {
            n_fin++;
            if (seq + 1 > max_fin)
                max_fin = seq + 1;
        } else if (!strcmp(rest, ".dfc.partial")) {
            if (have_partial) {
                closedir(d);
                return df_errf(e, -DF_ECORRUPT, "%s: rank %u has two partial shards", w->dir,
                               w->o.rank);
            }
            have_partial = 1;
            partial_seq = seq;
        }
    }
    closedir(d);
    if (n_fin != max_fin)
        return df_errf(e, -DF_ECORRUPT, "%s: rank %u: finished shards are not numbered 0..%u",
                       w->dir, w->o.rank, n_fin);
    if (have_partial && partial_seq != n_fin)
        return df_errf(e, -DF_ECORRUPT, "%s: rank %u: partial shard %u after %u finished ones",
                       w->dir, w->o.rank, partial_seq, n_fin);
    size_t cap = 0;
    int rc;
    for (uint32_t s = 0; s < n_fin; s++)
        if ((rc = load_finished(w, s, &cap, e)))
            return rc;
    w->cur_seq = n_fin;
    if (have_partial) {
        char ipath[4200];
        df_cw_shard_path(w, partial_seq, ".dfi", ipath, sizeof ipath);
        unlink(ipath); /* an index written just before a crash: the scan rebuilds it */
        rc = recover_partial(w, partial_seq, &cap, e);
        if (rc < 0)
            return rc;
    }
    if (w->n_done)
        qsort(w->done_ids, w->n_done, sizeof *w->done_ids, cmp_u64);
    if (w->n_done)
        df_log(DF_LOG_INFO, "resume: %s rank %u: %zu samples already complete", w->dir, w->o.rank,
               w->n_done);
    return 0;
}

int df_cache_writer_has(const df_cache_writer *w, uint64_t id)
{
    return w->n_done && bsearch(&id, w->done_ids, w->n_done, sizeof id, cmp_u64) != NULL;
}
