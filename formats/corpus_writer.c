/* corpus_writer.c - the .dtok writer: streams documents into the token
 * section of <path>.tmp and the mask and offsets into unlinked scratch files
 * next to it, then at finish appends them, writes the real header (counts,
 * CRCs, fingerprint) and renames into place. Apart from corpus.c because it
 * is the only code that makes .dtok bytes; both share the header layout and
 * the accounting through corpus_internal.h. See corpus.h for the contract. */
#include "corpus.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "corpus_internal.h"
#include "crc32c.h"
#include "fsutil.h"
#include "le.h"
#include "sha256.h"

/* ----------------------------------------------------------------- writer */

typedef struct {
    int fd;
    uint8_t *buf;
    size_t fill, cap;
    uint64_t bytes; /* bytes put (flushed or not) */
    uint32_t crc;   /* CRC32C of the bytes put with crc on */
} wstream;

struct df_corpus_writer {
    char path[4096], tmp[4200];
    wstream main, mask, offs;
    df_sha256_ctx fp;
    df_corpus_stats st;
    uint64_t n_zero;       /* mask zeros seen: none -> no mask section */
    uint64_t ones_pending; /* leading all-ones mask bytes not yet written to scratch */
    int failed;
};

static int ws_flush(wstream *s, const char *name, df_err *e)
{
    size_t done = 0;
    while (done < s->fill) {
        ssize_t w = write(s->fd, s->buf + done, s->fill - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            int err = w < 0 ? -errno : -EIO;
            return df_errf(e, err, "%s: write failed near byte %llu: %s", name,
                           (unsigned long long)(s->bytes - s->fill + done), strerror(-err));
        }
        done += (size_t)w;
    }
    s->fill = 0;
    return 0;
}

static int ws_put(wstream *s, const void *data, size_t n, int crc, const char *name, df_err *e)
{
    const uint8_t *p = data;
    if (crc)
        s->crc = df_crc32c(s->crc, p, n);
    s->bytes += n;
    while (n) {
        size_t k = s->cap - s->fill < n ? s->cap - s->fill : n;
        memcpy(s->buf + s->fill, p, k);
        s->fill += k;
        p += k;
        n -= k;
        if (s->fill == s->cap) {
            int rc = ws_flush(s, name, e);
            if (rc < 0)
                return rc;
        }
    }
    return 0;
}

static int ws_pad8(wstream *s, const char *name, df_err *e)
{
    static const uint8_t zero[8];
    size_t pad = (size_t)(align8(s->bytes) - s->bytes);
    return pad ? ws_put(s, zero, pad, 0, name, e) : 0;
}

static int ws_init(wstream *s, int fd, size_t cap)
{
    s->fd = fd;
    s->buf = malloc(cap);
    s->cap = cap;
    return s->buf ? 0 : -ENOMEM;
}

static void ws_free(wstream *s)
{
    if (s->fd >= 0)
        close(s->fd);
    free(s->buf);
    s->fd = -1;
    s->buf = NULL;
}

/* An anonymous scratch file next to the output (same file system, so a big
 * mask section never lands in a small /tmp): created and unlinked at once. */
static int scratch_fd(const char *path, const char *suffix, df_err *e)
{
    char name[4300];
    snprintf(name, sizeof name, "%s.%s.%ld", path, suffix, (long)getpid());
    int fd = open(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0)
        return df_errf(e, -errno, "%s: cannot create scratch file: %s", name, strerror(errno));
    unlink(name);
    return fd;
}

int df_corpus_writer_open(const char *path, df_corpus_writer **out, df_err *e)
{
    *out = NULL;
    df_corpus_writer *w = calloc(1, sizeof *w);
    if (!w)
        return df_errf(e, -ENOMEM, "%s: out of memory", path);
    w->main.fd = w->mask.fd = w->offs.fd = -1;
    if (snprintf(w->path, sizeof w->path, "%s", path) >= (int)sizeof w->path) {
        free(w);
        return df_errf(e, -ENAMETOOLONG, "%s: path too long", path);
    }
    snprintf(w->tmp, sizeof w->tmp, "%s.tmp", path);
    int rc;
    /* df_open_regular: a FIFO left at the .tmp name would block a plain open */
    int fd = df_open_regular(w->tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644, e);
    if (fd < 0) {
        free(w);
        return fd;
    }
    if (ws_init(&w->main, fd, 4u << 20) < 0) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory", path);
        goto fail;
    }
    if ((fd = scratch_fd(path, "mask", e)) < 0) {
        rc = fd;
        goto fail;
    }
    if (ws_init(&w->mask, fd, 1u << 20) < 0) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory", path);
        goto fail;
    }
    if ((fd = scratch_fd(path, "offs", e)) < 0) {
        rc = fd;
        goto fail;
    }
    if (ws_init(&w->offs, fd, 1u << 20) < 0) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory", path);
        goto fail;
    }
    /* Placeholder header: the real one is written at finish, when the counts are known. */
    uint8_t zero[DF_DTOK_HEADER_BYTES] = {0};
    uint8_t off0[8] = {0};
    if ((rc = ws_put(&w->main, zero, sizeof zero, 0, w->tmp, e)) < 0 ||
        (rc = ws_put(&w->offs, off0, 8, 1, w->tmp, e)) < 0)
        goto fail;
    df_corpus_fp_init(&w->fp);
    w->st.format = DF_CORPUS_DTOK;
    w->st.version = DF_DTOK_VERSION;
    *out = w;
    return 0;
fail:
    df_corpus_writer_abort(w);
    return rc;
}

static int mask_put_ones(df_corpus_writer *w, uint64_t n, df_err *e)
{
    int rc = 0;
    for (uint64_t done = 0; done < n && rc >= 0;) {
        size_t k = n - done < sizeof df_corpus_ones ? (size_t)(n - done) : sizeof df_corpus_ones;
        rc = ws_put(&w->mask, df_corpus_ones, k, 1, w->tmp, e);
        done += k;
    }
    return rc;
}

int df_corpus_writer_add(df_corpus_writer *w, const uint32_t *ids, const uint8_t *mask,
                         uint64_t len, df_err *e)
{
    if (w->failed)
        return df_errf(e, -EINVAL, "%s: writer failed earlier", w->path);
    uint64_t bad;
    if (mask && !df_corpus_mask_valid(mask, len, &bad))
        return df_errf(e, -EINVAL, "%s: doc %llu: loss mask value %u at token %llu (0/1 only)",
                       w->path, (unsigned long long)w->st.n_docs, mask[bad],
                       (unsigned long long)bad);
    if (len > ((uint64_t)1 << 40) || w->st.n_tokens + len > ((uint64_t)1 << 44))
        return df_errf(e, -EFBIG, "%s: doc %llu: too many tokens", w->path,
                       (unsigned long long)w->st.n_docs);
    int rc;
    uint8_t end[8];
    df_put64(end, w->st.n_tokens + len);
    if ((rc = ws_put(&w->main, ids, (size_t)len * 4, 1, w->tmp, e)) < 0)
        goto fail;
    uint64_t zeros = df_corpus_account(&w->st, ids, mask, len);
    if (!w->n_zero && !zeros) {
        /* No zero so far: the mask section may never be needed (then it is not
         * stored), so the ones are only counted, not written to scratch. */
        w->ones_pending += len;
    } else {
        rc = mask_put_ones(w, w->ones_pending, e);
        w->ones_pending = 0;
        if (rc >= 0)
            rc = mask ? ws_put(&w->mask, mask, (size_t)len, 1, w->tmp, e)
                      : mask_put_ones(w, len, e);
        if (rc < 0)
            goto fail;
    }
    w->n_zero += zeros;
    if ((rc = ws_put(&w->offs, end, 8, 1, w->tmp, e)) < 0)
        goto fail;
    df_corpus_fp_doc(&w->fp, ids, mask, len);
    return 0;
fail:
    w->failed = 1;
    return rc;
}

void df_corpus_writer_set_source(df_corpus_writer *w, const uint8_t source_sha256[32],
                                 uint64_t n_empty_skipped)
{
    w->st.has_source_sha = source_sha256 != NULL;
    if (source_sha256)
        memcpy(w->st.source_sha256, source_sha256, 32);
    w->st.n_empty_skipped = n_empty_skipped;
}

/* Appends the whole scratch file src (already flushed) to dst. */
static int ws_append_file(wstream *dst, wstream *src, const char *name, df_err *e)
{
    uint64_t total = src->bytes, done = 0;
    while (done < total) {
        if (dst->fill == dst->cap) {
            int rc = ws_flush(dst, name, e);
            if (rc < 0)
                return rc;
        }
        size_t want = dst->cap - dst->fill;
        if (want > total - done)
            want = (size_t)(total - done);
        ssize_t r = pread(src->fd, dst->buf + dst->fill, want, (off_t)done);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return df_errf(e, r < 0 ? -errno : -EIO, "%s: reading back scratch data failed",
                           name);
        dst->fill += (size_t)r;
        dst->bytes += (size_t)r;
        done += (size_t)r;
    }
    return 0;
}

int df_corpus_writer_finish(df_corpus_writer *w, df_corpus_stats *stats, df_err *e)
{
    int rc;
    if (w->failed) {
        rc = df_errf(e, -EINVAL, "%s: writer failed earlier", w->path);
        goto fail;
    }
    int has_mask = w->n_zero > 0;
    uint64_t n_tok = w->st.n_tokens, n_docs = w->st.n_docs;
    uint64_t mask_off = DF_DTOK_HEADER_BYTES + align8(n_tok * 4);
    uint64_t offs_off = mask_off + (has_mask ? align8(n_tok) : 0);
    uint64_t file_bytes = offs_off + 8 * (n_docs + 1);
    if ((rc = ws_pad8(&w->main, w->tmp, e)) < 0)
        goto fail;
    if (has_mask) {
        if ((rc = ws_flush(&w->mask, w->tmp, e)) < 0 ||
            (rc = ws_append_file(&w->main, &w->mask, w->tmp, e)) < 0 ||
            (rc = ws_pad8(&w->main, w->tmp, e)) < 0)
            goto fail;
    }
    if ((rc = ws_flush(&w->offs, w->tmp, e)) < 0 ||
        (rc = ws_append_file(&w->main, &w->offs, w->tmp, e)) < 0 ||
        (rc = ws_flush(&w->main, w->tmp, e)) < 0)
        goto fail;
    if (w->main.bytes != file_bytes) { /* an internal invariant; cheap to check */
        rc = df_errf(e, -EIO, "%s: wrote %llu bytes, layout says %llu", w->tmp,
                     (unsigned long long)w->main.bytes, (unsigned long long)file_bytes);
        goto fail;
    }
    df_corpus_fp_final(&w->fp, n_docs, w->st.content_sha256);

    uint8_t h[DF_DTOK_HEADER_BYTES] = {0};
    memcpy(h + H_MAGIC, DF_DTOK_MAGIC, 8);
    df_put32(h + H_VERSION, DF_DTOK_VERSION);
    df_put32(h + H_HDRBYTES, DF_DTOK_HEADER_BYTES);
    df_put32(h + H_FLAGS, (has_mask ? F_MASK : 0) | (w->st.has_source_sha ? F_SOURCE_SHA : 0));
    df_put32(h + H_MAX_ID, w->st.max_id);
    df_put64(h + H_N_DOCS, n_docs);
    df_put64(h + H_N_TOKENS, n_tok);
    df_put64(h + H_N_LOSS, w->st.n_loss_tokens);
    df_put64(h + H_MAX_DOC_LEN, w->st.max_doc_len);
    df_put64(h + H_N_EMPTY, w->st.n_empty_docs);
    df_put64(h + H_N_SKIPPED, w->st.n_empty_skipped);
    df_put64(h + H_TOKENS_OFF, DF_DTOK_HEADER_BYTES);
    df_put64(h + H_MASK_OFF, mask_off);
    df_put64(h + H_OFFSETS_OFF, offs_off);
    df_put64(h + H_FILE_BYTES, file_bytes);
    df_put32(h + H_CRC_TOKENS, w->main.crc);
    df_put32(h + H_CRC_MASK, has_mask ? w->mask.crc : 0);
    df_put32(h + H_CRC_OFFSETS, w->offs.crc);
    memcpy(h + H_CONTENT_SHA, w->st.content_sha256, 32);
    if (w->st.has_source_sha)
        memcpy(h + H_SOURCE_SHA, w->st.source_sha256, 32);
    df_put32(h + H_CRC, df_crc32c(0, h, H_CRC));
    if (pwrite(w->main.fd, h, sizeof h, 0) != (ssize_t)sizeof h) {
        rc = df_errf(e, errno ? -errno : -EIO, "%s: writing the header failed: %s", w->tmp,
                     strerror(errno));
        goto fail;
    }
    if (fsync(w->main.fd) != 0) {
        rc = df_errf(e, -errno, "%s: fsync failed: %s", w->tmp, strerror(errno));
        goto fail;
    }
    if (rename(w->tmp, w->path) != 0) {
        rc = df_errf(e, -errno, "%s: rename to %s failed: %s", w->tmp, w->path, strerror(errno));
        goto fail;
    }
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", w->path);
    rc = df_fsync_dir(dirname(dir), e);
    w->st.has_mask = has_mask;
    w->st.bytes_in = 0;
    if (stats)
        *stats = w->st;
    ws_free(&w->main);
    ws_free(&w->mask);
    ws_free(&w->offs);
    free(w);
    return rc;
fail:
    df_corpus_writer_abort(w);
    return rc;
}

void df_corpus_writer_abort(df_corpus_writer *w)
{
    if (!w)
        return;
    ws_free(&w->main);
    ws_free(&w->mask);
    ws_free(&w->offs);
    unlink(w->tmp);
    free(w);
}
