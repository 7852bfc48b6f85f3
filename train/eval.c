/* eval.c - loss, acc[k], tau_hat and the tau walk on a held-out cache (eval.h). */
#include "eval.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "feed.h"
#include "fsutil.h"
#include "runlog.h"


int eval_open(eval_ctx *ev, const char *path, const df_batch_config *bc, const df_drafter_config *c,
              const df_cache_params *cp, const char *config_sha256, int hidden, int rows, int walk,
              const char *train_cache, df_err *e)
{
    if (!(ev->cache = df_cache_open(path, e)))
        return e ? e->code : -EIO;
    const df_cache_params *ep = &df_cache_get_info(ev->cache)->params;
    if ((config_sha256 && strcmp(ep->config_sha256, config_sha256)) ||
        (int)df_cache_target_hidden(ep) != hidden)
        return df_errf(e, -DF_EMISMATCH, "evaluation cache %s was extracted from another target "
                       "than the training cache", path);
    if (ep->proj_rank != cp->proj_rank || (cp->proj_rank && strcmp(ep->basis_sha256, cp->basis_sha256)))
        return df_errf(e, -DF_EMISMATCH, "evaluation cache %s is %s; the training cache %s is "
                       "%s: project both with the same basis (dflash cache project --basis)",
                       path, ep->proj_rank ? "projected" : "not projected", train_cache,
                       cp->proj_rank ? "projected" : "not projected");
    int rc = df_batch_map_layers(ep, c->target_layer_ids, c->num_target_features, ev->cache_index,
                                 &ev->layer_mask, e);
    if (rc) {
        df_err_wrap(e, "evaluation cache %s", path);
        return rc;
    }
    df_batch_config ebc = *bc;
    ebc.dtype = ep->dtype;
    ebc.noise = 0; /* evaluation sees the features as they are */
    if (!(ev->row = df_batch_create(&ebc, e)))
        return e ? e->code : -ENOMEM;
    ev->rows = rows > 0 ? rows : 64;
    ev->walk = walk;
    if (ev->walk) {
        ev->cand = malloc((size_t)bc->max_tokens * sizeof *ev->cand);
        ev->acc_at = malloc((size_t)bc->max_tokens * sizeof *ev->acc_at);
        ev->anch = malloc((size_t)bc->max_anchors * sizeof *ev->anch);
        ev->blk_acc = malloc((size_t)bc->max_anchors * sizeof *ev->blk_acc);
        if (!ev->cand || !ev->acc_at || !ev->anch || !ev->blk_acc)
            return df_errf(e, -ENOMEM, "out of memory");
    }
    /* not the training seed: runs of other seeds score the same rows and anchors */
    ev->seed = 0x5eedull;
    return 0;
}

void eval_close(eval_ctx *ev)
{
    df_batch_free(ev->row);
    df_cache_close(ev->cache);
    free(ev->cand);
    free(ev->acc_at);
    free(ev->anch);
    free(ev->blk_acc);
    memset(ev, 0, sizeof *ev);
}

/* Every candidate of the finished row scored, then the walk over its
 * documents (eval_ctx); adds to *tokens and *verifs. */
static int eval_walk_row(eval_ctx *ev, df_drafter *d, const void *w, df_drafter_row *dr,
                         uint64_t *tokens, uint64_t *verifs, df_err *e)
{
    const df_batch_config *bc = df_batch_get_config(ev->row);
    const df_batch_row *br = df_batch_get_row(ev->row);
    int nc = df_batch_candidates(ev->row, ev->cand, bc->max_tokens);
    if (nc < 0)
        return df_errf(e, nc, "evaluation walk: row not finished");
    for (int t = 0; t < br->n_tokens; t++)
        ev->acc_at[t] = -1;
    int A = bc->max_anchors, P = (nc + A - 1) / A;
    for (int k = 0; k < P; k++) {
        int na = 0;
        for (int i = k; i < nc; i += P)
            ev->anch[na++] = ev->cand[i];
        int rc = df_batch_set_anchors(ev->row, ev->anch, na, e);
        if (rc)
            return rc;
        df_drafter_metrics wm = {0};
        wm.block_accepted = ev->blk_acc;
        if ((rc = df_drafter_row_step(d, w, dr, 1.0f, NULL, &wm, e))) {
            df_err_wrap(e, "evaluation walk pass %d of %d", k + 1, P);
            return rc;
        }
        for (int b = 0; b < na; b++)
            ev->acc_at[ev->anch[b]] = ev->blk_acc[b];
    }
    for (int p = 0; p < br->n_tokens;) {
        if (ev->acc_at[p] < 0) {
            p++;
            continue;
        }
        int len = ev->acc_at[p] + 1;
        *tokens += (uint64_t)len;
        (*verifs)++;
        p += len;
    }
    return 0;
}

/* One evaluation, logged; *res gets its figures (res->eval_cache is left to
 * the caller). */
int run_eval(eval_ctx *ev, df_drafter *d, const void *w, int K, int64_t step, FILE *logf,
             const char *logpath, int quiet, int bs, df_best *res, df_err *e)
{
    source src = {.cache = ev->cache, .layer_mask = ev->layer_mask, .threads = 2,
                  .seed = ev->seed, .n_all = df_cache_count(ev->cache), .world = 1};
    src.order = malloc((src.n_all ? src.n_all : 1) * sizeof *src.order);
    if (!src.order)
        return df_errf(e, -ENOMEM, "out of memory");
    df_rng rng;
    df_rng_seed(&rng, ev->seed, 7);
    df_drafter_metrics m = {0};
    uint64_t walk_tokens = 0, walk_verifs = 0;
    int rc = source_open_at(&src, 0, 0, e), n_rows = 0;
    while (!rc && n_rows < ev->rows && (src.pos < src.n || src.have_pending)) {
        df_batch_reset(ev->row);
        int added_docs = 0;
        for (;;) {
            df_cache_item it;
            int got = source_next(&src, &it, e);
            if (got < 0) {
                rc = got;
                break;
            }
            if (got == 0)
                break;
            df_batch_doc doc;
            df_batch_doc_from_item(&it, ev->cache_index, K, &doc);
            int added = df_batch_add(ev->row, &doc, &rng, e);
            if (added < 0) {
                rc = added;
                break;
            }
            if (added == 0) {
                source_push_back(&src, &it);
                break;
            }
            added_docs++;
            df_cache_stream_release(src.s, &it);
        }
        if (rc || !added_docs)
            break;
        if ((rc = df_batch_finish(ev->row, &rng, e)))
            break;
        const df_batch_row *br = df_batch_get_row(ev->row);
        df_drafter_row dr = {.S = br->n_tokens,
                             .feat = br->features_bf16 ? (const void *)br->features_bf16
                                                       : (const void *)br->features,
                             .feat_dtype = br->features_bf16 ? DF_DTYPE_BF16 : DF_DTYPE_F32,
                             .ctx_pos = br->pos, .blocks = br->blocks,
                             .block_ids = (const uint32_t *)br->block_ids,
                             .block_pos = br->block_pos, .labels = br->labels,
                             .weights = br->weights};
        if (br->weight_sum > 0 && (rc = df_drafter_row_step(d, w, &dr, 1.0f, NULL, &m, e)))
            df_err_wrap(e, "evaluation row %d", n_rows);
        if (!rc && ev->walk && br->weight_sum > 0 &&
            (rc = eval_walk_row(ev, d, w, &dr, &walk_tokens, &walk_verifs, e)))
            df_err_wrap(e, "evaluation row %d", n_rows);
        n_rows++;
    }
    source_close(&src);
    if (rc)
        return rc;
    double loss = m.weight_sum > 0 ? m.loss_sum / m.weight_sum : 0.0;
    double tau = m.blocks ? 1.0 + (double)m.accepted / (double)m.blocks : 1.0;
    double tau_walk = walk_verifs ? (double)walk_tokens / (double)walk_verifs : 1.0;
    res->step = step;
    res->walked = ev->walk;
    snprintf(res->metric, sizeof res->metric, "%s", ev->walk ? "eval_tau_walk" : "eval_tau_hat");
    res->value = ev->walk ? tau_walk : tau;
    res->tau_walk = ev->walk ? tau_walk : 0;
    res->tau_hat = tau;
    res->loss = loss;
    res->rows = n_rows;
    res->blocks = m.blocks;
    if (logf) {
        double acc[DF_DRAFTER_MAX_BLOCK];
        for (int k = 1; k < bs; k++)
            acc[k - 1] = m.counted[k] ? (double)m.correct[k] / (double)m.counted[k] : 0.0;
        cJSON *l = df_runlog_line(step);
        int bad = !l || df_runlog_int(l, "eval_rows", n_rows) ||
                  df_runlog_int(l, "eval_blocks", (int64_t)m.blocks) ||
                  df_runlog_num(l, "eval_loss", "%.6f", loss) ||
                  df_runlog_num(l, "eval_tau_hat", "%.4f", tau);
        if (!bad && ev->walk)
            bad = df_runlog_num(l, "eval_tau_walk", "%.4f", tau_walk) ||
                  df_runlog_int(l, "eval_walk_verifications", (int64_t)walk_verifs);
        bad = bad || df_runlog_nums(l, "eval_acc", "%.4f", acc, bs - 1);
        if (bad) {
            cJSON_Delete(l);
            l = NULL; /* df_runlog_write reports it */
        }
        if ((rc = df_runlog_write(logf, logpath, step, l, e)))
            return rc;
    }
    if (!quiet) {
        printf("eval @ step %" PRId64 ": %d rows, %" PRIu64 " blocks, loss %.4f  tau_hat %.3f  ",
               step, n_rows, m.blocks, loss, tau);
        if (ev->walk)
            printf("tau_walk %.3f  ", tau_walk);
        printf("acc1 %.3f  acc%d %.3f\n",
               m.counted[1] ? (double)m.correct[1] / (double)m.counted[1] : 0.0, bs - 1,
               m.counted[bs - 1] ? (double)m.correct[bs - 1] / (double)m.counted[bs - 1] : 0.0);
        fflush(stdout);
    }
    return 0;
}
