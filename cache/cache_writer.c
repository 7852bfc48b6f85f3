/* cache_writer.c - the background cache writer (see cache_writer.h).
 *
 * Threads: the caller (put), `threads` encoders, one I/O thread that owns
 * the io engine and every shard file. Jobs carry a sequence number; the I/O
 * thread writes them strictly in sequence, so the bytes on disk do not
 * depend on which encoder finished first.
 *
 * The writer's state and job types are in cache_writer_internal.h; resume
 * (taking up an earlier run's shards in open()) is cache_writer_resume.c. */
#include "cache_writer.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache_internal.h"
#include "cache_writer_internal.h"
#include "fsutil.h"
#include "io.h"
#include "le.h"
#include "log.h"

#define CHUNK (8u << 20) /* bytes per write request: big records go out in parallel */

/* ------------------------------------------------------------ helpers */

static void set_err(df_cache_writer *w, int rc, const df_err *e)
{
    pthread_mutex_lock(&w->mu);
    if (!w->err) {
        w->err = rc;
        if (e)
            w->errmsg = *e;
        else
            df_errf(&w->errmsg, rc, "%s: %s", w->dir, df_strerror(rc));
    }
    pthread_cond_broadcast(&w->cv_space);
    pthread_cond_broadcast(&w->cv_ready);
    pthread_mutex_unlock(&w->mu);
}

void df_cw_shard_path(const df_cache_writer *w, uint32_t seq, const char *suffix, char *out,
                      size_t n)
{
    char name[64];
    df_cache_shard_name(name, sizeof name, w->o.rank, seq, suffix);
    snprintf(out, n, "%s/%s", w->dir, name);
}

static void job_free(job *j)
{
    if (!j)
        return;
    free(j->raw);
    free(j->rec);
    free(j);
}

/* ------------------------------------------------------------ encoders */

static void *encoder_main(void *vp)
{
    df_cache_writer *w = vp;
    df_codec_ctx *ctx = df_codec_ctx_new();
    pthread_mutex_lock(&w->mu);
    for (;;) {
        while (!w->q_head && !w->closing)
            pthread_cond_wait(&w->cv_work, &w->mu);
        if (w->abandon || (!w->q_head && w->closing))
            break; /* jobs left in the queue are freed from the ring */
        job *j = w->q_head;
        w->q_head = j->next;
        if (!w->q_head)
            w->q_tail = NULL;
        int skip = w->err != 0;
        pthread_mutex_unlock(&w->mu);

        df_err e = {0};
        int rc = 0;
        if (!skip) {
            j->rec_cap = df_cache_record_bound(&w->p, j->s.n_tokens);
            j->rec = df_io_alloc(j->rec_cap);
            if (!ctx || !j->rec)
                rc = df_errf(&e, -ENOMEM, "sample %" PRIu64 ": out of memory encoding", j->s.id);
            else
                rc = df_cache_record_encode(&w->p, &j->s, ctx, j->rec, j->rec_cap, &j->rec_len,
                                            j->layer_raw, j->layer_stored, &e);
        }
        free(j->raw);
        j->raw = NULL;
        if (rc)
            set_err(w, rc, &e);

        pthread_mutex_lock(&w->mu);
        w->inflight -= j->raw_bytes;
        j->reserved -= j->raw_bytes;
        j->failed = skip || rc;
        j->state = JOB_ENCODED;
        pthread_cond_broadcast(&w->cv_ready);
        pthread_cond_broadcast(&w->cv_space);
    }
    pthread_mutex_unlock(&w->mu);
    df_codec_ctx_free(ctx);
    return NULL;
}

/* ------------------------------------------------------------ I/O thread */

static void release(df_cache_writer *w, job *j)
{
    pthread_mutex_lock(&w->mu);
    w->inflight -= j->reserved;
    w->unfinished--;
    pthread_cond_broadcast(&w->cv_space);
    pthread_mutex_unlock(&w->mu);
    job_free(j);
}

/* Records the failure of a write of the current shard (j: its job, NULL for
 * the header) as the writer's error. */
static void write_failed(df_cache_writer *w, const job *j, int res)
{
    df_err e;
    char path[4200];
    df_cw_shard_path(w, w->cur_seq, ".dfc.partial", path, sizeof path);
    df_errf(&e, res, "%s: write of sample %" PRIu64 " failed: %s", path, j ? j->s.id : 0,
            df_strerror(res));
    set_err(w, res, &e);
}

/* Reaps at least min completions (0: whatever is done). */
static int reap(df_cache_writer *w, unsigned min)
{
    df_io_cqe cq[64];
    double t0 = min ? df_now() : 0;
    int n = df_io_wait(w->io, cq, 64, min);
    if (min)
        w->st.io_wait_s += df_now() - t0;
    if (n < 0) {
        df_err e;
        df_errf(&e, n, "%s: I/O engine failed: %s", w->dir, df_strerror(n));
        set_err(w, n, &e);
        return n;
    }
    for (int i = 0; i < n; i++) {
        job *j = (job *)(uintptr_t)cq[i].tag;
        if (cq[i].res < 0)
            write_failed(w, j, (int)cq[i].res);
        if (j && --j->chunks_pending == 0)
            release(w, j);
    }
    return n;
}

/* Waits for every write in flight. Returns the writer's first error: a failed
 * completion is recorded by reap() (set_err) rather than returned, so without
 * this check finish_shard() would publish a shard whose write had failed
 * whenever that completion happened to be reaped here rather than in io_main's
 * loop (which skips later jobs once the error is set). */
static int drain(df_cache_writer *w)
{
    while (df_io_inflight(w->io) > 0)
        if (reap(w, 1) < 0)
            return -EIO;
    if (w->fault_drain) { /* test hook (finish_shard): a failure reaped here */
        write_failed(w, NULL, w->fault_drain);
        w->fault_drain = 0;
    }
    pthread_mutex_lock(&w->mu);
    int rc = w->err;
    pthread_mutex_unlock(&w->mu);
    return rc;
}

static int submit_write(df_cache_writer *w, const void *buf, size_t len, uint64_t off, job *j)
{
    for (;;) {
        int rc = df_io_write(w->io, w->fd, buf, len, off, (uint64_t)(uintptr_t)j, -1);
        if (rc != -EBUSY)
            return rc;
        if ((rc = reap(w, 1)) < 0)
            return rc;
    }
}

static int open_shard(df_cache_writer *w, uint32_t seq, df_err *e)
{
    char path[4200];
    df_cw_shard_path(w, seq, ".dfc.partial", path, sizeof path);
    int direct = 0;
    int fd = df_io_open_file(path, O_WRONLY | O_CREAT | O_TRUNC, 0644, !w->o.buffered, &direct, e);
    if (fd < 0)
        return fd;
    uint8_t *hdr = df_io_alloc(DF_CACHE_SHARD_HEADER);
    if (!hdr) {
        close(fd);
        return df_errf(e, -ENOMEM, "out of memory");
    }
    df_cache_shard_header_encode(&w->p, w->o.rank, seq, hdr);
    w->fd = fd;
    w->cur_open = 1;
    w->cur_seq = seq;
    w->cur_size = DF_CACHE_SHARD_HEADER;
    int rc = submit_write(w, hdr, DF_CACHE_SHARD_HEADER, 0, NULL);
    if (!rc)
        rc = drain(w);
    free(hdr);
    if (rc)
        return df_errf(e, rc, "%s: writing the shard header failed: %s", path, df_strerror(rc));
    return 0;
}

int df_cw_part_add_shard(df_cache_writer *w, const df_cache_shard_info *si, const uint64_t *raw,
                         const uint64_t *stored, uint64_t loss)
{
    df_cache_part *pt = &w->part;
    if (pt->n_shards == w->cap_shards) {
        size_t nc = w->cap_shards ? 2 * w->cap_shards : 8;
        df_cache_shard_info *ns = realloc(pt->shards, nc * sizeof *ns);
        if (!ns)
            return -ENOMEM;
        pt->shards = ns;
        w->cap_shards = nc;
    }
    pt->shards[pt->n_shards++] = *si;
    pt->samples += si->samples;
    pt->tokens += si->tokens;
    pt->loss_tokens += loss;
    for (uint32_t l = 0; l < w->p.n_layers; l++) {
        pt->layer_raw[l] += raw[l];
        pt->layer_stored[l] += stored[l];
        pt->raw_bytes += raw[l];
        pt->stored_bytes += stored[l];
    }
    return 0;
}

/* fsync the data, write the index, rename .partial into place, fsync the dir. */
static int finish_shard(df_cache_writer *w, df_err *e)
{
    /* Test hook: shard 1's last write fails, its completion reaped by this
     * drain (the window in which a failed shard used to be published). */
    int f = w->cur_seq == 1 ? df_fault("cache-shard-write") : 0;
    w->fault_drain = f ? -f : 0;
    int rc = drain(w);
    if (rc)
        return df_errf(e, rc, "%s: writes failed before finishing a shard", w->dir);
    char part_path[4200], data_path[4200], idx_path[4200];
    df_cw_shard_path(w, w->cur_seq, ".dfc.partial", part_path, sizeof part_path);
    df_cw_shard_path(w, w->cur_seq, ".dfc", data_path, sizeof data_path);
    df_cw_shard_path(w, w->cur_seq, ".dfi", idx_path, sizeof idx_path);
    if (fsync(w->fd) != 0)
        return df_errf(e, -errno, "%s: fsync failed: %s", part_path, strerror(errno));
    close(w->fd);
    w->fd = -1;
    w->cur_open = 0;
    uint8_t *img;
    size_t len;
    rc = df_cache_index_encode(&w->p, w->o.rank, w->cur_seq, w->ents, w->n_ents, w->cur_raw,
                               w->cur_stored, &img, &len, e);
    if (rc)
        return rc;
    rc = df_file_write_atomic(idx_path, img, len, e);
    free(img);
    if (rc)
        return rc;
    if (rename(part_path, data_path) != 0)
        return df_errf(e, -errno, "%s: rename to %s failed: %s", part_path, data_path,
                       strerror(errno));
    if ((rc = df_fsync_dir(w->dir, e)))
        return rc;
    df_cache_shard_info si = {.rank = w->o.rank, .seq = w->cur_seq, .samples = w->n_ents,
                              .tokens = w->cur_tokens, .bytes = w->cur_size};
    df_cache_shard_name(si.data, sizeof si.data, w->o.rank, w->cur_seq, ".dfc");
    df_cache_shard_name(si.index, sizeof si.index, w->o.rank, w->cur_seq, ".dfi");
    if (df_cw_part_add_shard(w, &si, w->cur_raw, w->cur_stored, w->cur_loss))
        return df_errf(e, -ENOMEM, "out of memory");
    w->n_ents = 0;
    w->cur_tokens = w->cur_loss = 0;
    memset(w->cur_raw, 0, sizeof w->cur_raw);
    memset(w->cur_stored, 0, sizeof w->cur_stored);
    w->cur_seq++;
    return 0;
}

int df_cw_add_entry(df_cache_writer *w, const df_cache_entry *t)
{
    if (w->n_ents == w->cap_ents) {
        size_t nc = w->cap_ents ? 2 * w->cap_ents : 1024;
        df_cache_entry *ne = realloc(w->ents, nc * sizeof *ne);
        if (!ne)
            return -ENOMEM;
        w->ents = ne;
        w->cap_ents = nc;
    }
    w->ents[w->n_ents++] = *t;
    return 0;
}

static int write_record(df_cache_writer *w, job *j, df_err *e)
{
    int rc;
    if (w->cur_open && w->cur_size > DF_CACHE_SHARD_HEADER &&
        w->cur_size + j->rec_len > w->p.shard_bytes)
        if ((rc = finish_shard(w, e)))
            return rc;
    if (!w->cur_open && (rc = open_shard(w, w->cur_seq, e)))
        return rc;
    df_cache_entry t = {.id = j->s.id, .offset = w->cur_size, .record_bytes = j->rec_len,
                        .n_tokens = j->s.n_tokens, .n_loss = j->n_loss,
                        .header_crc = df_le32(j->rec + 60)};
    for (uint32_t l = 0; l < w->p.n_layers; l++) {
        t.stored_bytes += j->layer_stored[l];
        w->cur_raw[l] += j->layer_raw[l];
        w->cur_stored[l] += j->layer_stored[l];
        w->st.raw_bytes += j->layer_raw[l];
        w->st.stored_bytes += j->layer_stored[l];
    }
    if (df_cw_add_entry(w, &t))
        return df_errf(e, -ENOMEM, "out of memory");
    w->cur_tokens += j->s.n_tokens;
    w->cur_loss += j->n_loss;
    w->st.samples++;
    w->st.tokens += j->s.n_tokens;
    w->st.file_bytes += j->rec_len;
    j->chunks_pending = (int)((j->rec_len + CHUNK - 1) / CHUNK);
    uint64_t base = w->cur_size;
    w->cur_size += j->rec_len;
    for (size_t o = 0; o < j->rec_len; o += CHUNK) {
        size_t n = j->rec_len - o < CHUNK ? j->rec_len - o : CHUNK;
        rc = submit_write(w, j->rec + o, n, base + o, j);
        if (rc) {
            /* Requests already queued complete normally and release the job. */
            j->chunks_pending -= (int)((j->rec_len - o + CHUNK - 1) / CHUNK);
            if (j->chunks_pending == 0)
                release(w, j);
            return df_errf(e, rc, "%s: cannot queue a write: %s", w->dir, df_strerror(rc));
        }
    }
    /* Into the kernel now, so the disk works while we wait for the next record. */
    rc = df_io_submit(w->io);
    return rc < 0 ? df_errf(e, rc, "%s: submitting writes failed: %s", w->dir, df_strerror(rc)) : 0;
}

static void *io_main(void *vp)
{
    df_cache_writer *w = vp;
    df_err e = {0};
    for (;;) {
        pthread_mutex_lock(&w->mu);
        job *j = NULL;
        for (;;) {
            if (w->abandon)
                break;
            job *c = w->ring[w->write_seq % w->ring_cap];
            if (c && c->state == JOB_ENCODED) {
                j = c;
                w->ring[w->write_seq % w->ring_cap] = NULL;
                w->write_seq++;
                pthread_cond_broadcast(&w->cv_space);
                break;
            }
            if (df_io_inflight(w->io) > 0) {
                pthread_mutex_unlock(&w->mu);
                reap(w, 1);
                pthread_mutex_lock(&w->mu);
                continue;
            }
            if (w->closing && w->write_seq == w->put_seq)
                break;
            pthread_cond_wait(&w->cv_ready, &w->mu);
        }
        int failed = w->err != 0;
        pthread_mutex_unlock(&w->mu);
        if (!j)
            break;
        if (failed || j->failed) {
            release(w, j);
            continue;
        }
        int rc = write_record(w, j, &e);
        if (rc)
            set_err(w, rc, &e);
    }
    drain(w);
    return NULL;
}

/* ------------------------------------------------------------ public */

static void writer_free(df_cache_writer *w)
{
    if (!w)
        return;
    if (w->fd >= 0)
        close(w->fd);
    if (w->lock_fd >= 0)
        close(w->lock_fd); /* releases the flock */
    df_io_close(w->io);
    if (w->ring)
        for (size_t i = 0; i < w->ring_cap; i++)
            job_free(w->ring[i]);
    free(w->ring);
    free(w->workers);
    free(w->ents);
    free(w->done_ids);
    df_cache_part_free(&w->part);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv_work);
    pthread_cond_destroy(&w->cv_ready);
    pthread_cond_destroy(&w->cv_space);
    free(w);
}

/* A new cache (no meta.json) goes only into an empty directory: one holding
 * anything but the writers' lock files and a meta.json.tmp left by a crash
 * (a model folder, another tool's output, shards of a cache whose meta.json
 * was lost) is refused, naming the first such entry. A projected cache's
 * basis.dfb is put there before the writer opens (cache project, extract
 * --basis), so it is allowed for one. Resuming a cache with
 * meta.json does not come here (its parameters are checked instead). */
static int only_cache_scratch(const char *dir, int projected, df_err *e)
{
    DIR *d = opendir(dir);
    if (!d)
        return df_errf(e, -errno, "%s: cannot list: %s", dir, strerror(errno));
    struct dirent *de;
    int rc = 0;
    while (!rc && (de = readdir(d))) {
        const char *n = de->d_name;
        unsigned r;
        char tail;
        if (!strcmp(n, ".") || !strcmp(n, "..") || !strcmp(n, "meta.json.tmp") ||
            (projected && (!strcmp(n, DF_CACHE_BASIS_FILE) || !strcmp(n, DF_CACHE_BASIS_FILE ".tmp"))) ||
            (sscanf(n, ".lock-r%4u%c", &r, &tail) == 1 && strlen(n) == 11))
            continue;
        rc = df_errf(e, -EEXIST, "%s: not empty (holds %s) and not a dflash cache (no meta.json): "
                     "refusing to write a new cache into it; choose an empty or new directory%s",
                     dir, n, !strncmp(n, "shard-", 6) || !strncmp(n, "rank-", 5)
                                 ? " (its cache files lost meta.json: remove them and rerun "
                                   "every rank)" : "");
    }
    closedir(d);
    return rc;
}

int df_cache_writer_check_dir(const char *dir, int projected, df_err *e)
{
    char path[4200];
    struct stat st;
    if (stat(dir, &st) != 0 && errno == ENOENT)
        return 0;
    snprintf(path, sizeof path, "%s/meta.json", dir);
    if (access(path, F_OK) == 0)
        return 0;
    return only_cache_scratch(dir, projected, e);
}

df_cache_writer *df_cache_writer_open(const char *dir, df_cache_params *p,
                                      const df_cache_writer_opts *opts, df_err *e)
{
    df_cache_writer *w = calloc(1, sizeof *w);
    if (!w) {
        df_errf(e, -ENOMEM, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv_work, NULL);
    pthread_cond_init(&w->cv_ready, NULL);
    pthread_cond_init(&w->cv_space, NULL);
    w->fd = -1;
    w->lock_fd = -1;
    if (opts)
        w->o = *opts;
    snprintf(w->dir, sizeof w->dir, "%s", dir);
    char path[4200];
    int dir_fd = -1;
    int rc = df_cache_params_finish(p, e);
    if (!rc && w->o.rank >= p->world_size)
        rc = df_errf(e, -EINVAL, "rank %u out of range for world size %u", w->o.rank,
                     p->world_size);
    if (!rc)
        rc = df_mkdirs(dir, e);
    if (rc)
        goto fail;
    /* Two processes appending to one rank's shards would corrupt each
     * other (a second run started while the first still runs): the kernel
     * drops the lock when its holder dies, so a crash never leaves it set. */
    snprintf(path, sizeof path, "%s/.lock-r%04u", dir, w->o.rank);
    char lock_path[4200];
    snprintf(lock_path, sizeof lock_path, "%s", path);
    int lock_was_there = access(lock_path, F_OK) == 0;
    w->lock_fd = df_open_regular(path, O_RDWR | O_CREAT, 0644, e);
    if (w->lock_fd < 0)
        goto fail;
    if (flock(w->lock_fd, LOCK_EX | LOCK_NB) != 0) {
        df_errf(e, -EBUSY, "%s: another process is writing rank %u of this cache (%s is "
                "locked); wait for it or stop it first", dir, w->o.rank, path);
        goto fail;
    }
    /* meta.json is read, or checked absent and created, under the
     * directory's lock: ranks started together agree on one uuid. */
    dir_fd = df_cache_dir_lock(dir, e);
    if (dir_fd < 0)
        goto fail;
    snprintf(path, sizeof path, "%s/manifest.json", dir);
    if (access(path, F_OK) == 0) {
        df_errf(e, -EEXIST, "%s: the cache is already complete (manifest.json exists); "
                "choose another directory or remove it", dir);
        goto fail;
    }
    df_cache_params old;
    df_err tmp;
    rc = df_cache_meta_read(dir, &old, &tmp);
    if (rc == -ENOENT && only_cache_scratch(dir, p->proj_rank > 0, e)) {
        if (!lock_was_there) /* a refused directory is left as it was found */
            unlink(lock_path);
        goto fail;
    }
    if (rc == 0) {
        if ((rc = df_cache_params_compatible(&old, p, e))) {
            df_err_wrap(e, "%s: cannot resume", dir);
            goto fail;
        }
        /* The cache's parameters are meta.json's (those the check does not
         * compare, e.g. the target's folder name, too): the shards' headers
         * carry their checksum, so a resumed run writes the same. */
        *p = old;
    } else if (rc == -ENOENT) {
        if (getrandom(p->uuid, sizeof p->uuid, 0) != (ssize_t)sizeof p->uuid) {
            df_errf(e, -EIO, "getrandom failed");
            goto fail;
        }
        char *js = df_cache_params_to_json(p);
        snprintf(path, sizeof path, "%s/meta.json", dir);
        rc = js ? df_file_write_atomic(path, js, strlen(js), e) : df_errf(e, -ENOMEM, "oom");
        free(js);
        if (rc)
            goto fail;
    } else {
        if (e)
            *e = tmp;
        goto fail;
    }
    close(dir_fd);
    dir_fd = -1;
    w->p = *p;
    w->part.rank = w->o.rank;
    w->part.has_uuid = 1;
    memcpy(w->part.uuid, p->uuid, sizeof w->part.uuid);
    w->part.n_layers = p->n_layers;
    if ((rc = df_cw_resume(w, e)))
        goto fail;

    df_io_opts io = {.queue_depth = w->o.queue_depth ? w->o.queue_depth : 16,
                     .force_fallback = w->o.force_fallback_io};
    w->io = df_io_open(&io, e);
    if (!w->io)
        goto fail;
    w->st.io_backend = df_io_backend(w->io);
    w->max_inflight = w->o.max_inflight_bytes ? w->o.max_inflight_bytes : (size_t)1 << 30;
    w->ring_cap = 4096;
    w->ring = calloc(w->ring_cap, sizeof *w->ring);
    w->nworkers = w->o.threads > 0 ? w->o.threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (w->nworkers < 1)
        w->nworkers = 1;
    w->workers = calloc((size_t)w->nworkers, sizeof *w->workers);
    if (!w->ring || !w->workers) {
        df_errf(e, -ENOMEM, "out of memory");
        goto fail;
    }
    for (int i = 0; i < w->nworkers; i++)
        if (pthread_create(&w->workers[i], NULL, encoder_main, w)) {
            w->nworkers = i;
            df_errf(e, -EAGAIN, "cannot start encoder threads");
            goto fail_threads;
        }
    if (pthread_create(&w->io_thread, NULL, io_main, w)) {
        df_errf(e, -EAGAIN, "cannot start the I/O thread");
        goto fail_threads;
    }
    w->io_started = 1;
    return w;
fail_threads:
    pthread_mutex_lock(&w->mu);
    w->closing = w->abandon = 1;
    pthread_cond_broadcast(&w->cv_work);
    pthread_mutex_unlock(&w->mu);
    for (int i = 0; i < w->nworkers; i++)
        pthread_join(w->workers[i], NULL);
fail:
    if (dir_fd >= 0)
        close(dir_fd);
    writer_free(w);
    return NULL;
}

int df_cache_writer_put(df_cache_writer *w, const df_cache_sample *s, df_err *e)
{
    const df_cache_params *p = &w->p;
    if (s->n_tokens > DF_CACHE_MAX_TOKENS)
        return df_errf(e, -EINVAL, "sample %" PRIu64 ": %u tokens, more than %u", s->id,
                       s->n_tokens, DF_CACHE_MAX_TOKENS);
    if (w->have_last && s->id <= w->last_id)
        return df_errf(e, -EINVAL,
                       "sample %" PRIu64 ": ids must increase (last was %" PRIu64 ")%s", s->id,
                       w->last_id, df_cache_writer_has(w, s->id) ? "; it is already in the cache" : "");
    size_t rb = (size_t)p->hidden_size * df_dtype_size(p->dtype);
    size_t n = s->n_tokens, layer_bytes = n * rb;
    size_t raw = n * 4 + n + (size_t)p->n_layers * layer_bytes + 64;
    job *j = calloc(1, sizeof *j);
    uint8_t *buf = j ? malloc(raw) : NULL;
    if (!buf) {
        free(j);
        return df_errf(e, -ENOMEM, "sample %" PRIu64 ": out of memory for %zu bytes", s->id, raw);
    }
    /* Layers first (they are the big, aligned part), then ids, then mask. */
    for (uint32_t l = 0; l < p->n_layers; l++) {
        memcpy(buf + l * layer_bytes, s->layers[l], layer_bytes);
        j->layer_ptrs[l] = buf + l * layer_bytes;
    }
    uint32_t *ids = (uint32_t *)(void *)(buf + p->n_layers * layer_bytes);
    memcpy(ids, s->ids, n * 4);
    uint8_t *mask = NULL;
    j->n_loss = (uint32_t)n;
    if (s->loss_mask) {
        mask = (uint8_t *)(ids + n);
        memcpy(mask, s->loss_mask, n);
        j->n_loss = 0;
        for (size_t i = 0; i < n; i++)
            j->n_loss += mask[i] ? 1 : 0;
    }
    j->raw = buf;
    j->raw_bytes = raw;
    j->reserved = raw + df_cache_record_bound(p, s->n_tokens);
    j->s = (df_cache_sample){.id = s->id, .n_tokens = s->n_tokens, .ids = ids, .loss_mask = mask,
                             .layers = j->layer_ptrs};

    double t0 = df_now();
    pthread_mutex_lock(&w->mu);
    while (!w->err && ((w->inflight > 0 && w->inflight + j->reserved > w->max_inflight) ||
                       w->put_seq - w->write_seq >= w->ring_cap))
        pthread_cond_wait(&w->cv_space, &w->mu);
    w->st.put_wait_s += df_now() - t0;
    if (w->err) {
        int rc = w->err;
        if (e)
            *e = w->errmsg;
        pthread_mutex_unlock(&w->mu);
        job_free(j);
        return rc;
    }
    j->seq = w->put_seq++;
    w->ring[j->seq % w->ring_cap] = j;
    w->inflight += j->reserved;
    w->unfinished++;
    if (w->q_tail)
        w->q_tail->next = j;
    else
        w->q_head = j;
    w->q_tail = j;
    w->last_id = s->id;
    w->have_last = 1;
    pthread_cond_signal(&w->cv_work);
    pthread_mutex_unlock(&w->mu);
    return 0;
}

int df_cache_writer_flush(df_cache_writer *w, df_err *e)
{
    pthread_mutex_lock(&w->mu);
    while (!w->err && w->unfinished > 0)
        pthread_cond_wait(&w->cv_space, &w->mu);
    int rc = w->err;
    if (rc && e)
        *e = w->errmsg;
    pthread_mutex_unlock(&w->mu);
    return rc;
}

void df_cache_writer_get_stats(df_cache_writer *w, df_cache_writer_stats *st)
{
    pthread_mutex_lock(&w->mu);
    *st = w->st;
    st->inflight_bytes = w->inflight;
    pthread_mutex_unlock(&w->mu);
}

static void stop_threads(df_cache_writer *w, int abandon)
{
    pthread_mutex_lock(&w->mu);
    w->closing = 1;
    w->abandon = abandon;
    pthread_cond_broadcast(&w->cv_work);
    pthread_cond_broadcast(&w->cv_ready);
    pthread_mutex_unlock(&w->mu);
    for (int i = 0; i < w->nworkers; i++)
        pthread_join(w->workers[i], NULL);
    /* Encoders are gone: wake the I/O thread for what they left. */
    pthread_mutex_lock(&w->mu);
    pthread_cond_broadcast(&w->cv_ready);
    pthread_mutex_unlock(&w->mu);
    if (w->io_started)
        pthread_join(w->io_thread, NULL);
    w->q_head = w->q_tail = NULL; /* any left are still in the ring */
}

int df_cache_writer_close(df_cache_writer *w, df_err *e)
{
    if (!w)
        return 0;
    stop_threads(w, 0);
    int rc = w->err;
    if (rc) {
        if (e)
            *e = w->errmsg;
    } else {
        if (w->cur_open && w->n_ents > 0)
            rc = finish_shard(w, e);
        else if (w->cur_open) { /* a header and nothing else: not a shard */
            char path[4200];
            df_cw_shard_path(w, w->cur_seq, ".dfc.partial", path, sizeof path);
            close(w->fd);
            w->fd = -1;
            unlink(path);
        }
        if (!rc)
            rc = df_cache_part_write(w->dir, &w->part, e);
        /* The last rank to finish writes the manifest (ranks that finish at
         * once take turns in df_cache_finalize; the later finds it written). */
        if (!rc) {
            df_err tmp;
            rc = df_cache_finalize(w->dir, &tmp);
            if (rc == -EAGAIN) { /* another rank is still to finish: it writes the manifest */
                df_log(DF_LOG_INFO, "%s; the manifest comes when it does", tmp.msg);
                rc = 0;
            }
            else if (rc && e)
                *e = tmp;
        }
    }
    writer_free(w);
    return rc;
}

void df_cache_writer_abandon(df_cache_writer *w)
{
    if (!w)
        return;
    stop_threads(w, 1);
    writer_free(w);
}
