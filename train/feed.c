/* feed.c - the document source and the feeder thread (feed.h). */
#include "feed.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "fsutil.h"
#include "log.h"

/* Model FLOPs of one row's forward + backward, as the usual model-FLOPs
 * convention counts them (matmuls 6 x params x tokens; the frozen-input fc
 * and LM head 4 x; attention 3.5 x 4 x visible pairs x heads x head_dim,
 * visible pairs counted from the row's blocks). */
static double row_flops(const df_drafter_config *c, const df_batch_row *br)
{
    double H = c->hidden_size, D = c->head_dim, QD = (double)c->num_attention_heads * D,
           KD = (double)c->num_key_value_heads * D, F = c->intermediate_size,
           KH = (double)df_drafter_fc_in(c), V = (double)c->vocab_size;
    double S = br->n_tokens, N = (double)br->n_blocks * br->block_size, bs = br->block_size;
    double per_layer = H * QD + 2 * H * KD + QD * H + 3 * H * F;
    double f = 4 * S * KH * H + 4 * (double)br->n_weighted * H * V;
    for (int l = 0; l < c->num_hidden_layers; l++) {
        int W = c->layer_types[l] == DF_LAYER_SLIDING ? c->sliding_window : 0;
        double pairs = 0;
        for (int b = 0; b < br->n_blocks; b++) {
            if (!br->valid[b])
                continue;
            for (int q = 0; q < br->block_size; q++) {
                int64_t lo = br->doc_start[b], hi = br->anchor[b];
                if (W > 0 && hi + q - (W - 1) > lo)
                    lo = hi + q - (W - 1);
                pairs += (double)(hi > lo ? hi - lo : 0) + (W > 0 ? q + 1 : bs);
            }
        }
        f += 6 * per_layer * N + 6 * S * 2 * KD * H + 3.5 * 4 * pairs * c->num_attention_heads * D;
    }
    return f;
}


/* This rank's documents in epoch `epoch`'s order, into src->order (src->n
 * of them). */
static void source_epoch_order(source *src, uint64_t epoch)
{
    df_cache_shuffle(src->seed, epoch, src->order, src->n_all);
    if (src->world > 1) { /* every world-th document of the epoch's order, from rank */
        src->n = (src->n_all - (size_t)src->rank + (size_t)src->world - 1) / (size_t)src->world;
        for (size_t i = 0; i < src->n; i++)
            src->order[i] = src->order[(size_t)src->rank + i * (size_t)src->world];
    } else {
        src->n = src->n_all;
    }
}

int source_open_at(source *src, uint64_t epoch, size_t pos, df_err *e)
{
    if (src->next_s && src->next_epoch == epoch && pos == 0) { /* opened ahead: reading on */
        df_cache_stream_close(src->s);
        src->s = src->next_s;
        src->next_s = NULL;
        src->epoch = epoch;
        src->pos = 0;
        return 0;
    }
    if (src->s)
        df_cache_stream_close(src->s);
    if (src->next_s)
        df_cache_stream_close(src->next_s);
    src->s = src->next_s = NULL;
    src->epoch = epoch;
    src->pos = pos;
    source_epoch_order(src, epoch);
    df_cache_stream_opts so = {.order = src->order + pos, .n = src->n - pos,
                               .layer_mask = src->layer_mask, .threads = src->threads,
                               .buffered = src->buffered};
    if (src->n - pos == 0)
        return 0;
    src->s = df_cache_stream_open(src->cache, &so, e);
    return src->s ? 0 : (e ? e->code : -EIO);
}

/* The next document: the held-back one, else the stream's next (0 at the
 * end of the epoch). Near the end of an epoch the next epoch's stream is
 * opened (src->ahead), so its reads and decoding overlap the last rows
 * instead of stalling the first step of the new epoch. */
int source_next(source *src, df_cache_item *it, df_err *e)
{
    if (src->have_pending) {
        *it = src->pending;
        src->have_pending = 0;
        return 1;
    }
    if (!src->s)
        return 0;
    int rc = df_cache_stream_next(src->s, it, e);
    if (rc == 1)
        src->pos++;
    if (rc == 1 && src->ahead && !src->next_s && src->pos + 2 >= src->n) {
        source_epoch_order(src, src->epoch + 1);
        df_cache_stream_opts so = {.order = src->order, .n = src->n,
                                   .layer_mask = src->layer_mask, .threads = src->threads,
                                   .buffered = src->buffered};
        if (src->n && !(src->next_s = df_cache_stream_open(src->cache, &so, e))) {
            df_cache_stream_release(src->s, it);
            return e ? e->code : -EIO;
        }
        src->next_epoch = src->epoch + 1;
    }
    return rc;
}

/* A document that did not fit: it starts the next row. */
void source_push_back(source *src, const df_cache_item *it)
{
    src->pending = *it;
    src->have_pending = 1;
}

/* Position in the epoch's order of the first document not yet in a
 * finished row: where a resumed run starts reading. */
size_t source_position(const source *src)
{
    return src->have_pending ? src->pos - 1 : src->pos;
}

void source_close(source *src)
{
    if (src->have_pending && src->s)
        df_cache_stream_release(src->s, &src->pending);
    df_cache_stream_close(src->s);
    df_cache_stream_close(src->next_s);
    free(src->order);
    memset(src, 0, sizeof *src);
}


/* Fills one slot with the next step's rows (the feeder thread; the source
 * and the RNG belong to it while it runs). */
static int feeder_build(feeder *f, feed_slot *sl, df_err *e)
{
    source *src = f->src;
    const double t0 = df_now();
    sl->denom = sl->flops = 0;
    sl->tokens = 0;
    sl->read_s = 0;
    for (int r = 0; r < f->nrows; r++) {
        df_batch_reset(sl->rows[r]);
        int added_docs = 0;
        for (;;) {
            const double tr = df_now();
            if (src->pos >= src->n && !src->have_pending) {
                if (added_docs) /* the epoch ends: this row takes what it has */
                    break;
                int rc = source_open_at(src, src->epoch + 1, 0, e);
                if (rc)
                    return rc;
            }
            df_cache_item it;
            int got = source_next(src, &it, e);
            sl->read_s += df_now() - tr;
            if (got <= 0)
                return got < 0 ? got : df_errf(e, -ENODATA, "%s: no samples", f->cache_dir);
            df_batch_doc doc;
            df_batch_doc_from_item(&it, f->cache_index, f->n_feat, &doc);
            int added = df_batch_add(sl->rows[r], &doc, f->rng, e);
            if (added < 0)
                return added;
            if (added == 0) { /* full: this document starts the next row */
                source_push_back(src, &it);
                break;
            }
            added_docs++;
            df_cache_stream_release(src->s, &it);
        }
        int rc = df_batch_finish(sl->rows[r], f->rng, e);
        if (rc)
            return rc;
        const df_batch_row *br = df_batch_get_row(sl->rows[r]);
        sl->denom += br->weight_sum;
        sl->tokens += (uint64_t)br->n_tokens;
        sl->flops += row_flops(f->c, br);
    }
    sl->after.epoch = src->epoch;
    sl->after.pos = source_position(src);
    df_rng_save(f->rng, sl->rng_after);
    sl->build_s = df_now() - t0;
    return 0;
}

static void *feeder_main(void *arg)
{
    feeder *f = arg;
    for (;;) {
        pthread_mutex_lock(&f->mu);
        feed_slot *sl = NULL;
        while (!f->stop && f->next_step < f->end_step &&
               (sl = &f->slot[f->next_step % FEED_SLOTS])->ready)
            pthread_cond_wait(&f->cv, &f->mu);
        if (f->stop || f->next_step >= f->end_step) {
            pthread_mutex_unlock(&f->mu);
            return NULL;
        }
        pthread_mutex_unlock(&f->mu);
        df_err err = {0};
        int rc = feeder_build(f, sl, &err);
        pthread_mutex_lock(&f->mu);
        sl->rc = rc;
        sl->err = err;
        sl->ready = 1;
        f->next_step++;
        pthread_cond_broadcast(&f->cv);
        pthread_mutex_unlock(&f->mu);
        if (rc)
            return NULL; /* the step that takes this slot reports the error */
    }
}

void feeder_close(feeder *f)
{
    if (f->started) {
        pthread_mutex_lock(&f->mu);
        f->stop = 1;
        pthread_cond_broadcast(&f->cv);
        pthread_mutex_unlock(&f->mu);
        pthread_join(f->th, NULL);
        pthread_mutex_destroy(&f->mu);
        pthread_cond_destroy(&f->cv);
        f->started = 0;
    }
    for (int k = 0; k < FEED_SLOTS; k++) {
        feed_slot *sl = &f->slot[k];
        for (int r = 0; sl->rows && r < f->nrows; r++) {
            df_batch_free(sl->rows[r]);
            df_backend_host_free(f->be, sl->feat_bf16[r]);
            df_backend_host_free(f->be, sl->argmax[r]);
        }
        free(sl->rows);
        free(sl->feat_bf16);
        free(sl->argmax);
    }
    memset(f->slot, 0, sizeof f->slot);
}

/* Slots for rows of config bc (their BF16 feature buffers and argmax arrays
 * from the backend's host memory), then the thread building steps
 * [step0, steps). */
int feeder_open(feeder *f, const df_batch_config *bc, int64_t step0, int64_t steps,
                df_err *e)
{
    int64_t S = bc->max_tokens, width = (int64_t)bc->n_features * bc->hidden_size;
    int64_t N = (int64_t)bc->max_anchors * bc->block_size;
    for (int k = 0; k < FEED_SLOTS; k++) {
        feed_slot *sl = &f->slot[k];
        sl->rows = calloc((size_t)f->nrows, sizeof *sl->rows);
        sl->feat_bf16 = calloc((size_t)f->nrows, sizeof *sl->feat_bf16);
        sl->argmax = calloc((size_t)f->nrows, sizeof *sl->argmax);
        if (!sl->rows || !sl->feat_bf16 || !sl->argmax)
            return df_errf(e, -ENOMEM, "out of memory");
        for (int r = 0; r < f->nrows; r++) {
            df_batch_config c = *bc;
            if (c.out_dtype == DF_DTYPE_BF16) {
                sl->feat_bf16[r] = df_backend_host_alloc(f->be, (size_t)(S * width) * 2);
                if (!sl->feat_bf16[r])
                    return df_errf(e, -ENOMEM, "out of host memory for a row's features "
                                   "(%lld x %lld bf16)", (long long)S, (long long)width);
                c.features_bf16 = sl->feat_bf16[r];
            }
            sl->argmax[r] = df_backend_host_alloc(f->be, (size_t)N * sizeof(int32_t));
            if (!sl->argmax[r])
                return df_errf(e, -ENOMEM, "out of host memory");
            if (!(sl->rows[r] = df_batch_create(&c, e)))
                return e ? e->code : -ENOMEM;
        }
    }
    f->next_step = step0;
    f->end_step = steps;
    pthread_mutex_init(&f->mu, NULL);
    pthread_cond_init(&f->cv, NULL);
    if (pthread_create(&f->th, NULL, feeder_main, f)) {
        pthread_mutex_destroy(&f->mu);
        pthread_cond_destroy(&f->cv);
        return df_errf(e, -EAGAIN, "cannot start the data feeder thread");
    }
    f->started = 1;
    return 0;
}

/* The slot of step `step`, waiting until it is built; its build error if any. */
feed_slot *feeder_take(feeder *f, int64_t step, df_err *e, int *rc)
{
    feed_slot *sl = &f->slot[step % FEED_SLOTS];
    pthread_mutex_lock(&f->mu);
    while (!sl->ready)
        pthread_cond_wait(&f->cv, &f->mu);
    pthread_mutex_unlock(&f->mu);
    *rc = sl->rc;
    if (sl->rc && e)
        *e = sl->err;
    return sl;
}

/* Step `step`'s slot if the thread has built it already (NULL if not yet,
 * or past the end): never waits. Once ready, a slot is not written until it
 * is released after its own step. */
feed_slot *feeder_peek(feeder *f, int64_t step)
{
    feed_slot *sl = &f->slot[step % FEED_SLOTS];
    pthread_mutex_lock(&f->mu);
    int ok = sl->ready && !sl->rc && step < f->end_step;
    pthread_mutex_unlock(&f->mu);
    return ok ? sl : NULL;
}

/* The step's rows are no longer read (after the step's sync): refill. */
void feeder_release(feeder *f, feed_slot *sl)
{
    pthread_mutex_lock(&f->mu);
    sl->ready = 0;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}
