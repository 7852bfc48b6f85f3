/* extract.c - corpus -> target forward -> cache writer (see extract.h). */
#include "extract.h"

#include <errno.h>
#include <inttypes.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache_writer.h"
#include "corpus.h"
#include "fsutil.h"
#include "model.h"

typedef struct progress {
    int on, tty;
    double t0, last;
} progress;

static void progress_line(progress *p, const df_extract_stats *st, uint64_t done_docs,
                          uint64_t total_docs, int final)
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
    fprintf(stderr, "%sextract: %" PRIu64 "/%" PRIu64 " docs, %" PRIu64 " tokens, %.0f tok/s, "
            "ETA %.0f s, %.1f MB stored (ratio %.3f)%s",
            p->tty ? "\r" : "", done_docs, total_docs, st->tokens, tps, eta,
            st->stored_bytes / 1e6,
            st->raw_bytes ? (double)st->stored_bytes / (double)st->raw_bytes : 0.0,
            p->tty && !final ? "   " : "\n");
}

int df_extract_run(const df_extract_opts *o, df_backend *be, df_extract_stats *st, df_err *e)
{
    memset(st, 0, sizeof *st);
    double t_start = df_now();
    df_model *m = NULL;
    df_corpus *corpus = NULL;
    df_cache_writer *w = NULL;
    uint16_t *feat[64] = {0};
    uint32_t *ids = NULL;
    int32_t *cu = NULL;
    int64_t *docs = NULL;
    int rc = df_model_open(o->model_dir, be, &m, e);
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
    snprintf(p.model_type, sizeof p.model_type, "%s", c->model_type);
    char dcopy[4096];
    snprintf(dcopy, sizeof dcopy, "%s", o->model_dir);
    snprintf(p.target_name, sizeof p.target_name, "%s", basename(dcopy));
    snprintf(p.config_sha256, sizeof p.config_sha256, "%s", c->config_sha256);
    p.hidden_size = (uint32_t)c->hidden_size;
    p.num_target_layers = (uint32_t)L;
    p.vocab_size = c->vocab_size;
    p.n_layers = (uint32_t)K;
    for (int i = 0; i < K; i++)
        p.layer_ids[i] = layers[i];
    p.dtype = DF_DTYPE_BF16;
    p.codec = o->codec;
    p.codec_level = o->codec_level;
    df_corpus_fingerprint(corpus, p.corpus_fingerprint);
    p.corpus_docs = df_corpus_n_docs(corpus);
    p.world_size = o->world_size ? o->world_size : 1;
    df_cache_writer_opts wo = {.rank = o->rank, .threads = o->threads,
                               .force_fallback_io = o->force_fallback_io, .buffered = o->buffered};
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
    ids = malloc((size_t)cap * sizeof *ids);
    cu = malloc(((size_t)cap + 2) * sizeof *cu);
    docs = malloc(((size_t)cap + 2) * sizeof *docs);
    for (int i = 0; i < K; i++)
        feat[i] = malloc((size_t)cap * H * 2);
    if (!ids || !cu || !docs || (K && !feat[K - 1])) {
        rc = df_errf(e, -ENOMEM, "out of memory for a batch of %lld tokens", (long long)cap);
        goto out;
    }
    int hs[64];
    void *outs[64];
    for (int i = 0; i < K; i++) {
        hs[i] = layers[i] + 1;
        outs[i] = feat[i];
    }
    uint64_t mine = 0;
    for (uint64_t d = o->rank; d < n_docs; d += p.world_size)
        mine++;
    progress pr = {.on = o->progress, .tty = isatty(2), .t0 = df_now()};
    pr.last = pr.t0;
    uint64_t done = 0;
    uint64_t d = o->rank;
    while (d < n_docs) {
        /* Pack documents into one forward of about `budget` tokens. */
        int n = 0;
        int64_t T = 0;
        cu[0] = 0;
        for (; d < n_docs; d += p.world_size) {
            const uint32_t *di;
            const uint8_t *dm;
            uint64_t len;
            df_corpus_doc(corpus, d, &di, &dm, &len);
            if (df_cache_writer_has(w, d)) {
                st->docs_skipped_resume++;
                done++;
                continue;
            }
            if (len == 0) {
                st->docs_empty++;
                done++;
                continue;
            }
            if (n > 0 && T + (int64_t)len > budget)
                break;
            memcpy(ids + T, di, len * sizeof *ids);
            docs[n] = (int64_t)d;
            T += (int64_t)len;
            cu[++n] = (int32_t)T;
        }
        if (n == 0)
            break;
        double t0 = df_now();
        if ((rc = df_model_forward(m, ids, cu, n, T, hs, K, DF_DTYPE_BF16, outs, e))) {
            df_err_wrap(e, "documents %" PRId64 "..%" PRId64, docs[0], docs[n - 1]);
            goto out;
        }
        st->forward_seconds += df_now() - t0;
        for (int j = 0; j < n; j++) {
            const uint32_t *di;
            const uint8_t *dm;
            uint64_t len;
            df_corpus_doc(corpus, (uint64_t)docs[j], &di, &dm, &len);
            const void *lp[64];
            for (int i = 0; i < K; i++)
                lp[i] = feat[i] + (size_t)cu[j] * H;
            df_cache_sample s = {.id = (uint64_t)docs[j], .n_tokens = (uint32_t)len, .ids = di,
                                 .loss_mask = dm, .layers = lp};
            if ((rc = df_cache_writer_put(w, &s, e)))
                goto out;
            st->docs++;
            st->tokens += len;
            done++;
        }
        df_cache_writer_stats ws;
        df_cache_writer_get_stats(w, &ws);
        st->raw_bytes = ws.raw_bytes;
        st->stored_bytes = ws.stored_bytes;
        progress_line(&pr, st, done, mine, 0);
    }
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
    progress_line(&pr, st, done, mine, 1);
out:
    if (w)
        df_cache_writer_abandon(w); /* what was written stays resumable */
    for (int i = 0; i < 64; i++)
        free(feat[i]);
    free(ids);
    free(cu);
    free(docs);
    df_corpus_close(corpus);
    df_model_close(m);
    return rc;
}
