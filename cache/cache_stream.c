/* cache_stream.c - the streaming cache reader (see cache_stream.h).
 *
 * Item seq goes through: WAIT_SLOT -> READING (I/O thread) -> READ (queued
 * for a decoder) -> READY (next() may hand it out) -> held by the caller ->
 * released (slot free again). The I/O thread starts item seq only when a
 * slot is free and the prefetch budget allows, so memory stays bounded. */
#include "cache_stream.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fsutil.h"
#include "io.h"

#define CHUNK (8u << 20)

enum { IT_EMPTY, IT_READING, IT_READ, IT_READY };

typedef struct item {
    int state;
    size_t seq, pos;
    unsigned slot;
    uint8_t *buf;       /* the record as read */
    size_t buf_bytes;
    int chunks_pending;
    int rc;
    df_err err;
    df_cache_item out;
    struct item *next;  /* decode queue */
} item;

struct df_cache_stream {
    df_cache *c;
    df_cache_params p;
    uint64_t *order;    /* owned copy */
    size_t n;
    uint64_t layer_mask;
    size_t max_prefetch;

    pthread_mutex_t mu;
    pthread_cond_t cv_io, cv_dec, cv_out;
    item *items;        /* one per slot: items[k] uses slots[k] */
    unsigned *seq_slot; /* seq % n_slots -> slot of that seq, for seqs in [next_out, next_read) */
    unsigned n_slots;
    void **slots;
    int own_slots;
    size_t slot_bytes;
    unsigned *free_slots;
    unsigned n_free;
    size_t prefetch;    /* bytes of records in memory */
    size_t next_read, next_out;
    item *dq_head, *dq_tail;
    int stop;

    pthread_t io_thread, *dec;
    int n_dec, io_started;
    df_io *io;
    int *fds;
    uint32_t n_fds;
    int io_err;
    df_err io_errmsg;

    df_cache_stream_stats st;
    double t0;
};

size_t df_cache_stream_slot_bytes(const df_cache *c, uint64_t layer_mask)
{
    const df_cache_params *p = &df_cache_get_info(c)->params;
    uint32_t maxn = 0;
    for (size_t k = 0; k < df_cache_count(c); k++)
        if (df_cache_entry_at(c, k)->n_tokens > maxn)
            maxn = df_cache_entry_at(c, k)->n_tokens;
    unsigned sel = 0;
    for (uint32_t l = 0; l < p->n_layers; l++)
        sel += (unsigned)(layer_mask >> l & 1);
    size_t row = (size_t)p->hidden_size * df_dtype_size(p->dtype);
    /* ids, mask, then each layer 64-byte aligned */
    return ((size_t)maxn * 5 + 63) / 64 * 64 + sel * (((size_t)maxn * row + 63) / 64 * 64) + 64;
}

void df_cache_shuffle(uint64_t seed, uint64_t epoch, uint64_t *order, size_t n)
{
    uint64_t s = seed ^ (0x9E3779B97F4A7C15ull * (epoch + 1));
    for (size_t i = 0; i < n; i++)
        order[i] = i;
    for (size_t i = n; i > 1; i--) {
        uint64_t z = (s += 0x9E3779B97F4A7C15ull);
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        size_t j = (size_t)(z % i);
        uint64_t t = order[i - 1];
        order[i - 1] = order[j];
        order[j] = t;
    }
}


size_t df_cache_stream_default_prefetch(size_t largest_record, int threads)
{
    const size_t floor = (size_t)256 << 20, k = (size_t)(threads > 0 ? threads : 1) + 1;
    if (largest_record > SIZE_MAX / k)
        return SIZE_MAX;
    return largest_record * k > floor ? largest_record * k : floor;
}

/* ------------------------------------------------------------ I/O thread */

static void io_fail(df_cache_stream *s, int rc, const char *fmt, uint64_t a, uint64_t b)
{
    pthread_mutex_lock(&s->mu);
    if (!s->io_err) {
        s->io_err = rc;
        df_errf(&s->io_errmsg, rc, fmt, a, b, df_strerror(rc));
    }
    pthread_cond_broadcast(&s->cv_out);
    pthread_mutex_unlock(&s->mu);
}

static int reap(df_cache_stream *s, unsigned min)
{
    df_io_cqe cq[64];
    int n = df_io_wait(s->io, cq, 64, min);
    if (n < 0)
        return n;
    for (int i = 0; i < n; i++) {
        item *it = (item *)(uintptr_t)cq[i].tag;
        if (cq[i].res < 0 && !it->rc) {
            const df_cache_entry *t = df_cache_entry_at(s->c, it->pos);
            it->rc = (int)cq[i].res;
            df_errf(&it->err, it->rc, "%s: read of sample %" PRIu64 " at offset %" PRIu64
                    " failed: %s", df_cache_shard_path(s->c, t->shard), t->id, t->offset,
                    df_strerror(it->rc));
        }
        if (--it->chunks_pending == 0) {
            pthread_mutex_lock(&s->mu);
            it->state = IT_READ;
            it->next = NULL;
            if (s->dq_tail)
                s->dq_tail->next = it;
            else
                s->dq_head = it;
            s->dq_tail = it;
            pthread_cond_signal(&s->cv_dec);
            pthread_mutex_unlock(&s->mu);
        }
    }
    return n;
}

static void *io_main(void *vp)
{
    df_cache_stream *s = vp;
    while (s->next_read < s->n) {
        const df_cache_entry *t = df_cache_entry_at(s->c, s->order[s->next_read]);
        pthread_mutex_lock(&s->mu);
        /* Room for one more: a free slot and prefetch budget (always allow one). */
        while (!s->stop && (s->n_free == 0 ||
                            (s->prefetch > 0 && s->prefetch + t->record_bytes > s->max_prefetch))) {
            if (df_io_inflight(s->io) > 0) {
                pthread_mutex_unlock(&s->mu);
                int rc = reap(s, 1);
                pthread_mutex_lock(&s->mu);
                if (rc < 0) {
                    s->stop = 1;
                    pthread_mutex_unlock(&s->mu);
                    io_fail(s, rc, "I/O engine failed (%" PRIu64 ", %" PRIu64 "): %s", 0, 0);
                    pthread_mutex_lock(&s->mu);
                }
                continue;
            }
            pthread_cond_wait(&s->cv_io, &s->mu);
        }
        if (s->stop) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        unsigned slot = s->free_slots[--s->n_free];
        item *it = &s->items[slot];
        it->seq = s->next_read;
        it->pos = s->order[s->next_read];
        it->slot = slot;
        s->seq_slot[s->next_read % s->n_slots] = slot;
        it->state = IT_READING;
        it->rc = 0;
        s->prefetch += t->record_bytes;
        s->next_read++;
        pthread_mutex_unlock(&s->mu);

        it->buf_bytes = t->record_bytes;
        it->buf = df_io_alloc(t->record_bytes);
        if (!it->buf) {
            it->rc = df_errf(&it->err, -ENOMEM, "sample %" PRIu64 ": out of memory", t->id);
            pthread_mutex_lock(&s->mu);
            it->state = IT_READ;
            it->next = NULL;
            if (s->dq_tail) s->dq_tail->next = it; else s->dq_head = it;
            s->dq_tail = it;
            pthread_cond_signal(&s->cv_dec);
            pthread_mutex_unlock(&s->mu);
            continue;
        }
        it->chunks_pending = (int)((t->record_bytes + CHUNK - 1) / CHUNK);
        for (uint64_t o = 0; o < t->record_bytes; o += CHUNK) {
            size_t len = t->record_bytes - o < CHUNK ? (size_t)(t->record_bytes - o) : CHUNK;
            int rc;
            while ((rc = df_io_read(s->io, s->fds[t->shard], it->buf + o, len, t->offset + o,
                                    (uint64_t)(uintptr_t)it, -1)) == -EBUSY)
                if ((rc = reap(s, 1)) < 0)
                    break;
            if (rc < 0) {
                io_fail(s, rc, "cannot queue a read of sample %" PRIu64 " (offset %" PRIu64 "): %s",
                        t->id, t->offset);
                goto out;
            }
        }
        s->st.bytes_read += t->record_bytes;
        reap(s, 0);
    }
out:
    while (df_io_inflight(s->io) > 0)
        if (reap(s, 1) < 0)
            break;
    return NULL;
}

/* ------------------------------------------------------------ decoders */

static void decode_item(df_cache_stream *s, item *it)
{
    const df_cache_entry *t = df_cache_entry_at(s->c, it->pos);
    const char *path = df_cache_shard_path(s->c, t->shard);
    df_cache_record r;
    if (it->rc)
        return;
    int rc = df_cache_record_parse(&s->p, it->buf, it->buf_bytes, &r, &it->err);
    if (!rc && (r.id != t->id || r.header_crc != t->header_crc || r.n_tokens != t->n_tokens))
        rc = df_errf(&it->err, -DF_ECORRUPT, "record is sample %" PRIu64 ", index says %" PRIu64,
                     r.id, t->id);
    uint8_t *slot = s->slots[it->slot];
    size_t need = ((size_t)r.n_tokens * 5 + 63) / 64 * 64;
    size_t row = (size_t)s->p.hidden_size * df_dtype_size(s->p.dtype);
    void *dst[DF_CACHE_MAX_LAYERS] = {0};
    for (uint32_t l = 0; !rc && l < s->p.n_layers; l++) {
        if (!(s->layer_mask >> l & 1))
            continue;
        dst[l] = slot + need;
        need += ((size_t)r.n_tokens * row + 63) / 64 * 64;
    }
    if (!rc) /* ids past the vocabulary: named here, not as a bad index in training */
        rc = df_cache_record_check_ids(&s->p, &r, &it->err);
    if (!rc && need > s->slot_bytes)
        rc = df_errf(&it->err, -ENOSPC, "sample %" PRIu64 " needs %zu bytes, slots have %zu",
                     t->id, need, s->slot_bytes);
    if (!rc) {
        const uint32_t *ids;
        const uint8_t *mask;
        df_cache_record_tokens(&r, &ids, &mask);
        memcpy(slot, ids, (size_t)r.n_tokens * 4);
        uint8_t *m = slot + (size_t)r.n_tokens * 4;
        if (mask)
            memcpy(m, mask, r.n_tokens);
        else
            memset(m, 1, r.n_tokens);
        rc = df_cache_record_decode(&s->p, &r, s->layer_mask, dst, NULL, &it->err);
        df_cache_item *o = &it->out;
        memset(o, 0, sizeof *o);
        o->id = t->id;
        o->pos = it->pos;
        o->seq = it->seq;
        o->n_tokens = r.n_tokens;
        o->ids = (const uint32_t *)(void *)slot;
        o->loss_mask = m;
        for (uint32_t l = 0; l < s->p.n_layers; l++)
            o->layers[l] = dst[l];
        o->slot = it->slot;
    }
    if (rc) {
        it->rc = rc;
        if (!strstr(it->err.msg, path))
            df_err_wrap(&it->err, "%s: offset %" PRIu64 " (sample %" PRIu64 ")", path, t->offset,
                        t->id);
    }
}

static void *dec_main(void *vp)
{
    df_cache_stream *s = vp;
    pthread_mutex_lock(&s->mu);
    for (;;) {
        while (!s->dq_head && !s->stop)
            pthread_cond_wait(&s->cv_dec, &s->mu);
        if (s->stop)
            break;
        item *it = s->dq_head;
        s->dq_head = it->next;
        if (!s->dq_head)
            s->dq_tail = NULL;
        pthread_mutex_unlock(&s->mu);
        decode_item(s, it);
        free(it->buf);
        it->buf = NULL;
        pthread_mutex_lock(&s->mu);
        s->prefetch -= it->buf_bytes;
        it->state = IT_READY;
        pthread_cond_broadcast(&s->cv_out);
        pthread_cond_signal(&s->cv_io);
    }
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ------------------------------------------------------------ public */

void df_cache_stream_close(df_cache_stream *s)
{
    if (!s)
        return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_broadcast(&s->cv_io);
    pthread_cond_broadcast(&s->cv_dec);
    pthread_mutex_unlock(&s->mu);
    if (s->io_started)
        pthread_join(s->io_thread, NULL);
    for (int i = 0; i < s->n_dec; i++)
        pthread_join(s->dec[i], NULL);
    if (s->items)
        for (unsigned i = 0; i < s->n_slots; i++)
            free(s->items[i].buf);
    if (s->own_slots && s->slots)
        for (unsigned i = 0; i < s->n_slots; i++)
            free(s->slots[i]);
    if (s->own_slots)
        free(s->slots);
    for (uint32_t i = 0; s->fds && i < s->n_fds; i++)
        if (s->fds[i] >= 0)
            close(s->fds[i]);
    df_io_close(s->io);
    free(s->fds);
    free(s->items);
    free(s->free_slots);
    free(s->seq_slot);
    free(s->dec);
    free(s->order);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv_io);
    pthread_cond_destroy(&s->cv_dec);
    pthread_cond_destroy(&s->cv_out);
    free(s);
}

df_cache_stream *df_cache_stream_open(df_cache *c, const df_cache_stream_opts *o, df_err *e)
{
    df_cache_stream_opts dflt = {0};
    if (!o)
        o = &dflt;
    df_cache_stream *s = calloc(1, sizeof *s);
    if (!s) {
        df_errf(e, -ENOMEM, "out of memory");
        return NULL;
    }
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv_io, NULL);
    pthread_cond_init(&s->cv_dec, NULL);
    pthread_cond_init(&s->cv_out, NULL);
    s->c = c;
    s->p = df_cache_get_info(c)->params;
    size_t count = df_cache_count(c);
    uint64_t all = s->p.n_layers >= 64 ? ~0ull : (1ull << s->p.n_layers) - 1;
    s->layer_mask = o->layer_mask ? (o->layer_mask & all) : all;
    s->n = o->order ? o->n : count;
    s->order = malloc((s->n ? s->n : 1) * sizeof *s->order);
    if (!s->order)
        goto oom;
    for (size_t i = 0; i < s->n; i++) {
        s->order[i] = o->order ? o->order[i] : i;
        if (s->order[i] >= count) {
            df_errf(e, -EINVAL, "order[%zu] = %" PRIu64 " out of range (%zu samples)", i,
                    s->order[i], count);
            goto fail;
        }
    }
    s->n_dec = o->threads > 0 ? o->threads : (int)sysconf(_SC_NPROCESSORS_ONLN);
    if (s->n_dec < 1)
        s->n_dec = 1;
    /* The default budget admits a record for every decoder plus the one being
     * read: a sample is decoded by one thread, and its record stays counted
     * until that decode ends, so a budget of one large record (a 4096-token
     * row of 5 x 5120 bf16 features is ~140 MB stored) would leave every
     * decoder but one idle and serialize read and decode. */
    if (o->max_prefetch_bytes) {
        s->max_prefetch = o->max_prefetch_bytes;
    } else {
        size_t big = 0;
        for (size_t i = 0; i < s->n; i++) {
            size_t b = (size_t)df_cache_entry_at(c, s->order[i])->record_bytes;
            big = b > big ? b : big;
        }
        s->max_prefetch = df_cache_stream_default_prefetch(big, s->n_dec);
    }
    s->st.prefetch_budget = s->max_prefetch;
    s->n_slots = o->n_slots ? o->n_slots : (unsigned)(2 * s->n_dec + 2);
    s->items = calloc(s->n_slots, sizeof *s->items);
    s->free_slots = malloc(s->n_slots * sizeof *s->free_slots);
    s->seq_slot = malloc(s->n_slots * sizeof *s->seq_slot);
    s->dec = calloc((size_t)s->n_dec, sizeof *s->dec);
    if (!s->items || !s->free_slots || !s->seq_slot || !s->dec)
        goto oom;
    if (o->slots) {
        s->slots = o->slots;
        s->slot_bytes = o->slot_bytes;
    } else {
        s->own_slots = 1;
        s->slot_bytes = o->slot_bytes ? o->slot_bytes : df_cache_stream_slot_bytes(c, s->layer_mask);
        s->slots = calloc(s->n_slots, sizeof *s->slots);
        if (!s->slots)
            goto oom;
        for (unsigned i = 0; i < s->n_slots; i++)
            if (!(s->slots[i] = df_io_alloc(s->slot_bytes)))
                goto oom;
    }
    for (unsigned i = 0; i < s->n_slots; i++)
        s->free_slots[i] = s->n_slots - 1 - i;
    s->n_free = s->n_slots;

    const df_cache_info *in = df_cache_get_info(c);
    s->n_fds = in->n_shards;
    s->fds = malloc((s->n_fds ? s->n_fds : 1) * sizeof *s->fds);
    if (!s->fds)
        goto oom;
    for (uint32_t i = 0; i < s->n_fds; i++)
        s->fds[i] = -1;
    for (uint32_t i = 0; i < s->n_fds; i++) {
        int direct = 0;
        s->fds[i] = df_io_open_file(df_cache_shard_path(c, i), O_RDONLY, 0, !o->buffered, &direct, e);
        if (s->fds[i] < 0)
            goto fail;
    }
    df_io_opts io = {.queue_depth = o->queue_depth ? o->queue_depth : 16,
                     .force_fallback = o->force_fallback_io};
    if (!(s->io = df_io_open(&io, e)))
        goto fail;
    s->st.io_backend = df_io_backend(s->io);
    s->t0 = df_now();
    for (int i = 0; i < s->n_dec; i++)
        if (pthread_create(&s->dec[i], NULL, dec_main, s)) {
            s->n_dec = i;
            df_errf(e, -EAGAIN, "cannot start decoder threads");
            goto fail;
        }
    if (pthread_create(&s->io_thread, NULL, io_main, s)) {
        df_errf(e, -EAGAIN, "cannot start the I/O thread");
        goto fail;
    }
    s->io_started = 1;
    return s;
oom:
    df_errf(e, -ENOMEM, "out of memory for the stream's buffers");
fail:
    df_cache_stream_close(s);
    return NULL;
}

int df_cache_stream_next(df_cache_stream *s, df_cache_item *it, df_err *e)
{
    if (s->next_out >= s->n)
        return 0;
    double t0 = df_now();
    pthread_mutex_lock(&s->mu);
    item *x = NULL;
    for (;;) {
        if (s->next_out < s->next_read) {
            x = &s->items[s->seq_slot[s->next_out % s->n_slots]];
            if (x->state == IT_READY && x->seq == s->next_out)
                break;
        }
        x = NULL;
        if (s->io_err)
            break;
        pthread_cond_wait(&s->cv_out, &s->mu);
    }
    s->st.consumer_wait_s += df_now() - t0;
    if (!x) {
        int rc = s->io_err;
        if (e)
            *e = s->io_errmsg;
        pthread_mutex_unlock(&s->mu);
        return rc;
    }
    pthread_mutex_unlock(&s->mu);
    if (x->rc) {
        if (e)
            *e = x->err;
        return x->rc;
    }
    *it = x->out;
    s->next_out++;
    s->st.samples++;
    s->st.tokens += it->n_tokens;
    return 1;
}

void df_cache_stream_release(df_cache_stream *s, const df_cache_item *it)
{
    pthread_mutex_lock(&s->mu);
    s->items[it->slot].state = IT_EMPTY;
    s->free_slots[s->n_free++] = it->slot;
    pthread_cond_signal(&s->cv_io);
    pthread_mutex_unlock(&s->mu);
}

void df_cache_stream_get_stats(df_cache_stream *s, df_cache_stream_stats *st)
{
    pthread_mutex_lock(&s->mu);
    *st = s->st;
    st->elapsed_s = df_now() - s->t0;
    pthread_mutex_unlock(&s->mu);
}
