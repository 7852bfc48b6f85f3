/* extract.c - corpus -> target forward -> cache writer (see extract.h). */
#include "extract.h"

#include <errno.h>
#include <inttypes.h>
#include <libgen.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "basis.h"
#include "cache_writer.h"
#include "corpus.h"
#include "fsutil.h"
#include "model.h"
#include "pool.h"

/* Two batches in flight: the forward fills one slot's pinned feature
 * buffers while the put thread hands the other's samples to the cache
 * writer (which copies them and compresses/writes in the background). The
 * forward waits only when the writer side is behind: that wait is the
 * "writer-bound" share the progress line reports. */
enum { SLOT_FREE = 0, SLOT_FULL = 1 };

typedef struct slot {
    int state;
    int n;               /* documents */
    uint32_t *ids;       /* [cap] */
    int32_t *cu;         /* [cap + 2] */
    int64_t *docs;       /* [cap + 2] */
    uint16_t *feat[64];  /* [cap * H] each, pinned */
} slot;

typedef struct pipe {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    slot slots[2];
    int done;            /* no more batches */
    int rc;              /* first put error */
    df_err err;
    /* put thread's view */
    df_cache_writer *w;
    df_corpus *corpus;
    int K;
    size_t H;
    const df_basis *basis; /* a projected cache: each document's z = P x is put */
    int device_z;          /* the forward hands z (feat[0], R wide): nothing to project here */
    df_pool *pool;
    uint16_t *z;
    size_t zcap;           /* tokens */
    uint64_t docs_put, tokens_put;
} pipe_t;

static void *put_main(void *arg)
{
    pipe_t *p = arg;
    for (int s = 0;; s ^= 1) {
        slot *sl = &p->slots[s];
        pthread_mutex_lock(&p->mu);
        while (sl->state != SLOT_FULL && !p->done)
            pthread_cond_wait(&p->cv, &p->mu);
        int have = sl->state == SLOT_FULL;
        pthread_mutex_unlock(&p->mu);
        if (!have)
            return NULL; /* done and drained (slots are filled in turn) */
        int rc = 0;
        df_err e = {0};
        for (int j = 0; j < sl->n && !rc; j++) {
            const uint32_t *di;
            const uint8_t *dm;
            uint64_t len;
            if (df_cache_writer_has(p->w, (uint64_t)sl->docs[j]))
                continue; /* resumed: already in the cache (has() only reads) */
            df_corpus_doc(p->corpus, (uint64_t)sl->docs[j], &di, &dm, &len);
            const void *lp[64];
            for (int i = 0; i < (p->device_z ? 0 : p->K); i++)
                lp[i] = sl->feat[i] + (size_t)sl->cu[j] * p->H;
            if (p->device_z)
                lp[0] = sl->feat[0] + (size_t)sl->cu[j] * (size_t)p->basis->R;
            else if (p->basis && len > p->zcap) {
                free(p->z);
                p->zcap = (size_t)len;
                if (!(p->z = malloc(p->zcap * (size_t)p->basis->R * 2)))
                    rc = df_errf(&e, -ENOMEM, "out of memory projecting %" PRIu64 " tokens", len);
            }
            if (!rc && p->basis && !p->device_z && len &&
                !(rc = df_basis_project_bf16(p->basis, (const uint16_t *const *)lp, p->K,
                                             (int)p->H, (int64_t)len, p->z, p->pool, &e)))
                lp[0] = p->z;
            df_cache_sample smp = {.id = (uint64_t)sl->docs[j], .n_tokens = (uint32_t)len,
                                   .ids = di, .loss_mask = dm, .layers = lp};
            if (!rc)
                rc = df_cache_writer_put(p->w, &smp, &e);
            if (!rc) {
                pthread_mutex_lock(&p->mu);
                p->docs_put++;
                p->tokens_put += len;
                pthread_mutex_unlock(&p->mu);
            }
        }
        pthread_mutex_lock(&p->mu);
        sl->state = SLOT_FREE;
        if (rc && !p->rc) {
            p->rc = rc;
            p->err = e;
        }
        pthread_cond_broadcast(&p->cv);
        pthread_mutex_unlock(&p->mu);
        if (rc)
            return NULL;
    }
}

typedef struct progress {
    int on, tty;
    double raw_scale; /* stored values per raw feature value: R / (K H) projected, else 1 */
    double t0, last;
    char who[48]; /* "extract" or "extract[rank r/w]" */
} progress;

static void progress_line(progress *p, const df_extract_stats *st, uint64_t done_docs,
                          uint64_t total_docs, double wait_s, int final)
{
    if (!p->on)
        return;
    double now = df_now();
    if (!final && now - p->last < (p->tty ? 0.5 : 10.0))
        return;
    p->last = now;
    double dt = now - p->t0;
    double tps = dt > 0 ? (double)st->tokens / dt : 0;
    double frac = total_docs ? (double)done_docs / (double)total_docs : 1;
    double eta = frac > 0 && frac < 1 ? dt / frac - dt : 0;
    double waitf = dt > 0 ? wait_s / dt : 0;
    char wb[64] = "";
    if (waitf > 0.05) /* the target waits on compression / the disk */
        snprintf(wb, sizeof wb, ", writer-bound %.0f%%", 100 * waitf);
    fprintf(stderr, "%s%s: %" PRIu64 "/%" PRIu64 " docs, %" PRIu64 " tokens, %.0f tok/s, "
            "ETA %.0f s, %.2f GB written (ratio %.3f)%s%s",
            p->tty ? "\r" : "", p->who, done_docs, total_docs, st->tokens, tps, eta,
            st->stored_bytes / 1e9,
            st->raw_bytes ? (double)st->stored_bytes / (double)st->raw_bytes * p->raw_scale : 0.0,
            wb,
            p->tty && !final ? "   " : "\n");
}

/* Waits until slot s is free; returns the seconds waited, or -1 when the
 * put thread failed. */
static double slot_wait_free(pipe_t *p, int s)
{
    double t0 = df_now();
    pthread_mutex_lock(&p->mu);
    while (p->slots[s].state != SLOT_FREE && !p->rc)
        pthread_cond_wait(&p->cv, &p->mu);
    int rc = p->rc;
    pthread_mutex_unlock(&p->mu);
    return rc ? -1 : df_now() - t0;
}

/* --basis: read it, check it is a basis of these layers, and put it into the
 * cache folder (kept there when an earlier run of the same cache put the same
 * one; another one there is refused; only rank 0 writes it, so ranks never
 * race on the file). Fills p's projection fields. */
static int open_basis(const df_extract_opts *o, const df_model_config *c, const int *layers,
                      int K, df_basis *b, df_cache_params *p, df_err *e)
{
    int rc = df_basis_read(o->basis_path, b, e);
    if (rc)
        return rc;
    if (b->K != K || b->H != c->hidden_size ||
        memcmp(b->layer_ids, layers, (size_t)K * sizeof *layers))
        return df_errf(e, -DF_EMISMATCH, "%s: a basis of %d layers x %d (first layer %d); this "
                       "extraction takes %d x %d (first %d)", o->basis_path, b->K, b->H,
                       b->layer_ids[0], K, c->hidden_size, layers[0]);
    char dst[4200], have[DF_SHA256_HEX], want[DF_SHA256_HEX];
    if (snprintf(dst, sizeof dst, "%s/%s", o->out_dir, DF_CACHE_BASIS_FILE) >= (int)sizeof dst)
        return df_errf(e, -ENAMETOOLONG, "%s: path too long", o->out_dir);
    if ((rc = df_basis_sha256(o->basis_path, want, e)) || (rc = df_mkdirs(o->out_dir, e)))
        return rc;
    if (access(dst, F_OK) == 0) {
        if ((rc = df_basis_sha256(dst, have, e)))
            return rc;
        if (strcmp(have, want))
            return df_errf(e, -DF_EMISMATCH, "%s holds another basis (sha256 %.12s...) than %s "
                           "(%.12s...): a cache has one basis", dst, have, o->basis_path, want);
    } else if (o->rank == 0 && (rc = df_basis_write(b, dst, e))) {
        return rc; /* rank 0 writes it (the manifest needs every rank, rank 0 too) */
    }
    p->proj_rank = (uint32_t)b->R;
    memcpy(p->basis_sha256, want, sizeof p->basis_sha256);
    return 0;
}

int df_extract_run(const df_extract_opts *o, df_backend *be, df_extract_stats *st, df_err *e)
{
    memset(st, 0, sizeof *st);
    st->mem_setup_bytes = st->mem_peak_bytes = -1;
    double t_start = df_now();
    df_model *m = NULL;
    df_corpus *corpus = NULL;
    df_cache_writer *w = NULL;
    df_basis basis = {0};
    pipe_t pp;
    memset(&pp, 0, sizeof pp);
    pthread_mutex_init(&pp.mu, NULL);
    pthread_cond_init(&pp.cv, NULL);
    int put_started = 0;
    pthread_t put_thread;
    int rc = o->random_config
                 ? df_model_open_random(o->random_config, be, o->random_seed, &m, e)
                 : df_model_open(o->model_dir, be, &m, e);
    if (rc)
        goto out;
    const df_model_config *c = df_model_get_config(m);
    int L = c->num_hidden_layers;

    /* Feature layers: explicit, else the DFlash rule. The last layer's
     * output is normed in HF's hidden_states, so it is never a feature. */
    int layers[64];
    int K = o->layer_ids ? o->n_layer_ids : o->n_layers;
    if (!o->layer_ids && K == 0)
        K = L - 3 < 1 ? 1 : (L - 3 > 5 ? 5 : L - 3);
    if (K < 1 || K > 64) {
        rc = df_errf(e, -EINVAL, "%d feature layers asked; 1..64 supported", K);
        goto out;
    }
    if (o->layer_ids) {
        memcpy(layers, o->layer_ids, (size_t)K * sizeof *layers);
    } else if (df_default_target_layers(L, K, layers)) {
        rc = df_errf(e, -EINVAL, "%d feature layers cannot be picked from a %d-layer target; "
                     "give --layers explicitly", K, L);
        goto out;
    }
    for (int i = 0; i < K; i++)
        if (layers[i] < 0 || layers[i] >= L - 1) {
            rc = df_errf(e, -EINVAL, "feature layer %d out of range: 0..%d for a %d-layer target "
                         "(the last layer's output is normed, not a feature)", layers[i], L - 2, L);
            goto out;
        }
    memcpy(st->layer_ids, layers, (size_t)K * sizeof *layers);
    st->n_layers = K;

    int64_t max_len = o->max_len ? o->max_len : c->max_position_embeddings;
    df_corpus_opts co = {.vocab = (uint64_t)c->vocab_size, .max_len = (uint64_t)max_len};
    if ((rc = df_corpus_open(o->data_path, &co, &corpus, e)))
        goto out;

    df_cache_params p = {0};
    /* open_basis puts basis.dfb into the folder: check first that it may hold a cache */
    if (o->basis_path && ((rc = df_cache_writer_check_dir(o->out_dir, 1, e)) ||
                          (rc = open_basis(o, c, layers, K, &basis, &p, e))))
        goto out;
    snprintf(p.model_type, sizeof p.model_type, "%s", c->model_type);
    char dcopy[4096];
    snprintf(dcopy, sizeof dcopy, "%s", o->random_config ? o->random_config : o->model_dir);
    snprintf(p.target_name, sizeof p.target_name, "%s%s", o->random_config ? "random:" : "",
             basename(dcopy));
    snprintf(p.config_sha256, sizeof p.config_sha256, "%s", c->config_sha256);
    p.hidden_size = (uint32_t)c->hidden_size;
    p.num_target_layers = (uint32_t)L;
    p.vocab_size = c->vocab_size;
    p.n_layers = (uint32_t)K;
    for (int i = 0; i < K; i++)
        p.layer_ids[i] = layers[i];
    if (o->basis_path) { /* one stored "layer": z (cache.h) */
        p.src_hidden = p.hidden_size;
        p.src_n_layers = p.n_layers;
        memcpy(p.src_layer_ids, p.layer_ids, sizeof p.src_layer_ids);
        p.hidden_size = p.proj_rank;
        p.n_layers = 1;
        memset(p.layer_ids, 0, sizeof p.layer_ids);
        p.layer_ids[0] = DF_CACHE_PROJECTED_LAYER;
        pp.basis = &basis;
        /* on a GPU, z = P x is one more GEMM after the forward (and a smaller
         * copy to the host); the CPU backend projects on the writer's threads,
         * beside its forward */
        if (!df_backend_host_addressable(be)) {
            if ((rc = df_model_set_projection(m, basis.P, basis.R, basis.D, e)))
                goto out;
            pp.device_z = 1;
        } else if (!(pp.pool = df_pool_open(o->threads))) {
            rc = df_errf(e, -EAGAIN, "cannot start the projection threads");
            goto out;
        }
    }
    p.dtype = DF_DTYPE_BF16;
    p.codec = o->codec;
    p.codec_level = o->codec_level;
    df_corpus_fingerprint(corpus, p.corpus_fingerprint);
    p.corpus_docs = df_corpus_n_docs(corpus);
    p.world_size = o->world_size ? o->world_size : 1;
    df_cache_writer_opts wo = {.rank = o->rank, .threads = o->threads,
                               .force_fallback_io = o->force_fallback_io, .buffered = o->buffered};
    /* Room for about three batches in flight behind the forward (one being
     * put, one compressing, one writing), or the forward waits on the
     * writer while the disk still has headroom. */
    {
        int64_t bt = o->batch_tokens > 0 ? o->batch_tokens : 8192;
        size_t batch = (size_t)bt * (size_t)c->hidden_size * 2 * (size_t)K;
        wo.max_inflight_bytes = batch * 3 > ((size_t)1 << 30) ? batch * 3 : (size_t)1 << 30;
    }
    if (!(w = df_cache_writer_open(o->out_dir, &p, &wo, e))) {
        rc = e ? e->code : -EIO;
        goto out;
    }

    int64_t budget = o->batch_tokens > 0 ? o->batch_tokens : 8192;
    uint64_t n_docs = df_corpus_n_docs(corpus);
    int64_t longest = 0;
    for (uint64_t d = 0; d < n_docs; d++) {
        const uint32_t *di;
        const uint8_t *dm;
        uint64_t len;
        df_corpus_doc(corpus, d, &di, &dm, &len);
        if ((int64_t)len > longest)
            longest = (int64_t)len;
    }
    int64_t cap = longest > budget ? longest : budget;
    size_t H = (size_t)c->hidden_size;
    for (int b = 0; b < 2; b++) {
        slot *sl = &pp.slots[b];
        sl->ids = malloc((size_t)cap * sizeof *sl->ids);
        sl->cu = malloc(((size_t)cap + 2) * sizeof *sl->cu);
        sl->docs = malloc(((size_t)cap + 2) * sizeof *sl->docs);
        int ok = sl->ids && sl->cu && sl->docs;
        for (int i = 0; i < (pp.device_z ? 1 : K) && ok; i++)
            ok = (sl->feat[i] = df_backend_host_alloc(
                      be, (size_t)cap * (pp.device_z ? (size_t)basis.R : H) * 2)) != NULL;
        if (!ok) {
            rc = df_errf(e, -ENOMEM, "out of memory for a batch of %lld tokens", (long long)cap);
            goto out;
        }
    }
    int hs[64];
    for (int i = 0; i < K; i++)
        hs[i] = layers[i] + 1;
    if ((rc = df_backend_sync(be))) { /* weight uploads / random fills are done */
        df_errf(e, rc, "%s backend failed while loading the model", df_backend_name(be));
        goto out;
    }
    st->setup_seconds = df_now() - t_start;
    st->mem_setup_bytes = st->mem_peak_bytes = df_backend_mem_used(be);
    uint64_t mine = 0;
    for (uint64_t d = o->rank; d < n_docs; d += p.world_size)
        mine++;
    pp.w = w;
    pp.corpus = corpus;
    pp.K = K;
    pp.H = H;
    if (pthread_create(&put_thread, NULL, put_main, &pp)) {
        rc = df_errf(e, -EAGAIN, "cannot start the writer thread");
        goto out;
    }
    put_started = 1;
    /* Several ranks share a terminal: plain lines, each naming its rank. */
    progress pr = {.on = o->progress, .tty = isatty(2) && p.world_size == 1, .t0 = df_now(),
                   .raw_scale = o->basis_path ? (double)p.proj_rank / ((double)K * (double)H) : 1};
    pr.last = pr.t0;
    if (p.world_size > 1)
        snprintf(pr.who, sizeof pr.who, "extract[rank %u/%u]", o->rank, p.world_size);
    else
        snprintf(pr.who, sizeof pr.who, "extract");
    uint64_t skipped = 0;
    double wait_s = 0;
    uint64_t d = o->rank;
    for (int s = 0; d < n_docs; s ^= 1) {
        slot *sl = &pp.slots[s];
        double waited = slot_wait_free(&pp, s);
        if (waited < 0)
            break; /* the put thread failed: reported below */
        wait_s += waited;
        /* Pack documents into one forward of about `budget` tokens. Batch
         * bounds depend on the corpus alone, never on what a resumed cache
         * already holds, so every document is computed in the same batch as
         * in an uninterrupted run (bit-identical hidden states); a batch
         * whose documents are all in the cache is skipped, a partly written
         * one runs whole and only its missing documents are put. */
        int n = 0, todo = 0;
        int64_t T = 0;
        while (d < n_docs && todo == 0) {
            n = 0;
            T = 0;
            sl->cu[0] = 0;
            for (; d < n_docs; d += p.world_size) {
                const uint32_t *di;
                const uint8_t *dm;
                uint64_t len;
                df_corpus_doc(corpus, d, &di, &dm, &len);
                if (len == 0) {
                    st->docs_empty++;
                    skipped++;
                    continue;
                }
                if (n > 0 && T + (int64_t)len > budget)
                    break;
                if (df_cache_writer_has(w, d)) {
                    st->docs_skipped_resume++;
                    skipped++;
                } else {
                    todo++;
                }
                memcpy(sl->ids + T, di, len * sizeof *sl->ids);
                sl->docs[n] = (int64_t)d;
                T += (int64_t)len;
                sl->cu[++n] = (int32_t)T;
            }
        }
        if (todo == 0)
            break;
        double t0 = df_now();
        rc = pp.device_z ? df_model_forward_projected(m, sl->ids, sl->cu, n, T, hs, K,
                                                      sl->feat[0], e)
                         : df_model_forward(m, sl->ids, sl->cu, n, T, hs, K, DF_DTYPE_BF16,
                                            (void *const *)sl->feat, e);
        if (rc) {
            df_err_wrap(e, "documents %" PRId64 "..%" PRId64, sl->docs[0], sl->docs[n - 1]);
            goto out;
        }
        st->forward_seconds += df_now() - t0;
        int64_t used = df_backend_mem_used(be); /* activations and workspaces at their largest */
        if (used > st->mem_peak_bytes)
            st->mem_peak_bytes = used;
        sl->n = n;
        pthread_mutex_lock(&pp.mu);
        sl->state = SLOT_FULL;
        pthread_cond_broadcast(&pp.cv);
        st->docs = pp.docs_put;
        st->tokens = pp.tokens_put;
        pthread_mutex_unlock(&pp.mu);
        df_cache_writer_stats ws;
        df_cache_writer_get_stats(w, &ws);
        st->raw_bytes = ws.raw_bytes;
        st->stored_bytes = ws.stored_bytes;
        progress_line(&pr, st, st->docs + skipped, mine, wait_s, 0);
    }
    pthread_mutex_lock(&pp.mu);
    pp.done = 1;
    pthread_cond_broadcast(&pp.cv);
    pthread_mutex_unlock(&pp.mu);
    pthread_join(put_thread, NULL);
    put_started = 0;
    if (pp.rc) {
        rc = pp.rc;
        if (e)
            *e = pp.err;
        goto out;
    }
    st->docs = pp.docs_put;
    st->tokens = pp.tokens_put;
    st->writer_wait_seconds = wait_s;
    if ((rc = df_cache_writer_flush(w, e)))
        goto out;
    df_cache_writer_stats ws;
    df_cache_writer_get_stats(w, &ws);
    st->raw_bytes = ws.raw_bytes;
    st->stored_bytes = ws.stored_bytes;
    st->io_backend = ws.io_backend;
    rc = df_cache_writer_close(w, e);
    w = NULL;
    st->seconds = df_now() - t_start;
    progress_line(&pr, st, st->docs + skipped, mine, wait_s, 1);
out:
    if (put_started) { /* an error on this side: stop the put thread first */
        pthread_mutex_lock(&pp.mu);
        pp.done = 1;
        pthread_cond_broadcast(&pp.cv);
        pthread_mutex_unlock(&pp.mu);
        pthread_join(put_thread, NULL);
    }
    if (w)
        df_cache_writer_abandon(w); /* what was written stays resumable */
    for (int b = 0; b < 2; b++) {
        for (int i = 0; i < 64; i++)
            df_backend_host_free(be, pp.slots[b].feat[i]);
        free(pp.slots[b].ids);
        free(pp.slots[b].cu);
        free(pp.slots[b].docs);
    }
    pthread_mutex_destroy(&pp.mu);
    pthread_cond_destroy(&pp.cv);
    df_corpus_close(corpus);
    df_model_close(m);
    df_pool_close(pp.pool);
    free(pp.z);
    df_basis_free(&basis);
    return rc;
}
