/* train.c - the training loop (train.h). */
#include "train.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "batch.h"
#include "best.h"
#include "cache.h"
#include "cache_stream.h"
#include "ckpt.h"
#include "drafter.h"
#include "eval.h"
#include "feed.h"
#include "fsutil.h"
#include "init_from.h"
#include "runlog.h"
#include "log.h"
#include "params.h"
#include "projected.h"
#include "safetensors.h"
#include "schedule.h"
#include "settings.h"
#include "setup.h"
#include "comm.h"
#include "train_ops.h"
#include "zero.h"

void df_train_opts_defaults(df_train_opts *o)
{
    memset(o, 0, sizeof *o);
    /* layers, sliding_window, block_size 0: 1, 2048, 16 or init_from's (df_train_run) */
    o->mask_token_id = -1;
    o->max_tokens = 4096;
    o->max_anchors = 512;
    o->rows_per_step = 1;
    o->gamma = 7;
    o->lr = 6e-4;
    o->warmup_frac = 0.04;
    o->clip = 1.0;
    o->init_std = 0.02;
    o->seed = 1;
    o->log_every = 10;
    o->ckpt_every = 0;
    o->keep_last = 2;
    /* the cheap activations recomputed: ~2 GiB less at the 27B drafter shape
     * for ~0.2% of the step time (H200), the same bits */
    o->recompute = 1;
    /* AdamW bucket by bucket on a side stream, overlapping the next forward:
     * the same bits, ~1.4% less time per step at the 27B drafter shape
     * (docs/log/) */
    o->overlap_opt = -1;
}

/* Every rank's n bytes at mine into all (world x n); one rank: a copy. */
static int gather(df_comm *comm, const void *mine, size_t n, void *all, df_err *e)
{
    if (!comm) {
        memcpy(all, mine, n);
        return 0;
    }
    return df_comm_allgather_host(comm, mine, n, all, e);
}


/* The step's rows: forward and backward of each (on several ranks the last
 * one's gradient buckets are reduce-scattered as its backward finishes
 * them), their metrics into m; then the next step's first row's features
 * start up. */
static int step_rows(df_drafter *d, dev_state *ds, feeder *fd, feed_slot *sl, int64_t step, int nrows,
                     double denom, int world, df_drafter_metrics *m, df_err *e)
{
    int rc = 0;
    /* Forward + backward of every row; on the last, each gradient bucket
     * is reduce-scattered as soon as the backward has finished it. */
    ds->next_bucket = ds->nb - 1;
    ds->hook_err = e;
    for (int r = 0; r < nrows; r++) {
        const df_batch_row *br = df_batch_get_row(sl->rows[r]);
        if (denom <= 0 || br->weight_sum <= 0)
            continue; /* nothing to learn from (its gradients would be 0) */
        df_drafter_row dr = {.S = br->n_tokens,
                             .feat = br->features_bf16 ? (const void *)br->features_bf16
                                                       : (const void *)br->features,
                             .feat_dtype = br->features_bf16 ? DF_DTYPE_BF16 : DF_DTYPE_F32,
                             .ctx_pos = br->pos,
                             .blocks = br->blocks, .block_ids = (const uint32_t *)br->block_ids,
                             .block_pos = br->block_pos, .labels = br->labels,
                             .weights = br->weights,
                             .pinned = br->features_bf16 != NULL,
                             .argmax_out = sl->argmax[r]};
        int last = 1;
        for (int r2 = r + 1; r2 < nrows; r2++)
            last &= !(df_batch_get_row(sl->rows[r2])->weight_sum > 0);
        df_drafter_set_grad_hook(d, world > 1 && last ? ds_grad_hook : NULL, ds);
        df_drafter_set_fwd_hook(d, ds->overlap ? ds_fwd_hook : NULL, ds);
        rc = df_drafter_row_step(d, ds->w, &dr, (float)denom, ds->grad, m, e);
        df_drafter_set_grad_hook(d, NULL, NULL);
        df_drafter_set_fwd_hook(d, NULL, NULL);
        if (rc) {
            df_err_wrap(e, "step %" PRId64 " row %d", step, r);
            return rc;
        }
    }
    /* The next step's first row's features go up on the copy stream now,
     * once this backward (their buffer's last reader) has run: the upload
     * overlaps the gradient norm and the optimizer instead of delaying
     * the next forward. */
    feed_slot *nx = feeder_peek(fd, step + 1);
    for (int r = 0; nx && r < nrows; r++) {
        const df_batch_row *br = df_batch_get_row(nx->rows[r]);
        if (!(br->weight_sum > 0))
            continue;
        df_drafter_row nr = {.S = br->n_tokens, .feat = br->features_bf16,
                             .feat_dtype = DF_DTYPE_BF16, .pinned = 1};
        if (br->features_bf16 && (rc = df_drafter_prefetch_row(d, &nr)) < 0) {
            df_errf(e, rc, "step %" PRId64 ": prefetching the next row failed", step);
            return rc;
        }
        rc = 0;
        break;
    }
    return 0;
}

/* The step's figures over all ranks (logged by rank 0), in one host
 * collective: the sums of the gradients' squares, the metrics, tokens and
 * FLOPs, and each rank's data wait in its own slot (the longest is logged).
 * v: scratch of 6 + 2 DF_DRAFTER_MAX_BLOCK + world doubles. */
static int step_figures_reduce(df_comm *comm, int world, int rank, int bs, double wait_s, double *v,
                               double *sq, df_drafter_metrics *m, uint64_t *tokens, double *flops,
                               double *wait_max_s, df_err *e)
{
    /* v: 6 scalars, correct[bs], counted[bs], each rank's wait */
    int oc = 6, on = oc + bs, ow = on + bs, nv = ow + world, rc;
    v[0] = *sq, v[1] = m->loss_sum, v[2] = (double)m->blocks, v[3] = (double)m->accepted;
    v[4] = (double)*tokens, v[5] = *flops;
    for (int k = 0; k < bs; k++) {
        v[oc + k] = (double)m->correct[k];
        v[on + k] = (double)m->counted[k];
    }
    for (int q = 0; q < world; q++)
        v[ow + q] = q == rank ? wait_s : 0.0;
    if ((rc = df_comm_allreduce_host_f64(comm, v, nv, e)))
        return rc;
    for (int q = 0; q < world; q++)
        *wait_max_s = v[ow + q] > *wait_max_s ? v[ow + q] : *wait_max_s;
    *sq = v[0], m->loss_sum = v[1], m->blocks = (uint64_t)v[2], m->accepted = (uint64_t)v[3];
    *tokens = (uint64_t)v[4], *flops = v[5];
    for (int k = 0; k < bs; k++) {
        m->correct[k] = (uint64_t)v[oc + k];
        m->counted[k] = (uint64_t)v[on + k];
    }
    return 0;
}

/* The checkpoint of step done: every rank's RNG state and data position
 * gathered into rs, dps (world of each), which ck holds only while the lead
 * rank saves it. */
static int save_ckpt(const df_train_opts *o, df_comm *comm, int world, int lead, int64_t done,
                     const df_drafter_config *c, int64_t total, const uint8_t *rng_after,
                     const data_pos *dp, uint8_t *rs, data_pos *dps, df_ckpt_state *ck, df_err *e)
{
    int rc;
    if ((rc = gather(comm, rng_after, 32, rs, e)) || (rc = gather(comm, dp, sizeof *dp, dps, e)))
        return rc;
    ck->step = done;
    ck->config = *c;
    ck->n_floats = total;
    ck->rng_state = rs;
    ck->rng_len = 32 * (size_t)world;
    ck->data_position = dps;
    ck->data_position_len = sizeof *dps * (size_t)world;
    if (lead)
        rc = df_ckpt_save(o->run_dir, ck, o->keep_last, e);
    ck->rng_state = NULL;
    ck->data_position = NULL;
    ck->rng_len = ck->data_position_len = 0;
    return rc;
}

int df_train_run(const df_train_opts *o, df_err *e)
{
    int rc = 0;
    df_cache *cache = NULL;
    df_st *tst = NULL;
    df_backend *be = NULL;
    df_drafter *d = NULL;
    feeder fd = {0};
    float *grad = NULL;
    dev_state ds = {0};
    eval_ctx ev = {0};
    void *dev_embed = NULL, *dev_head = NULL;
    FILE *logf = NULL;
    df_ckpt_state ck = {0};
    source src = {0};
    df_comm *comm = NULL;
    df_basis basis = {0};
    best_state bst = {0};
    int lock_fd = -1; /* RUN/.lock, held by the lead rank (run_lock) */
    int nrows = o->rows_per_step > 0 ? o->rows_per_step : 1;
    int world = o->world > 1 ? o->world : 1, rank = world > 1 ? o->rank : 0;
    int lead = rank == 0; /* rank 0 writes the log, checkpoints and the export */
    /* the step figures' scratch (step_figures_reduce); the checkpoints' RNG states and
     * data positions */
    double *figs = NULL;
    uint8_t *ckpt_rs = NULL;
    data_pos *ckpt_dps = NULL;

    if (o->steps < 0 || (o->steps == 0 && !o->init_from))
        return df_errf(e, -EINVAL, "--steps must be > 0 (0 only with --init-from)");
    if (rank < 0 || rank >= world)
        return df_errf(e, -EINVAL, "rank %d out of range for %d ranks", rank, world);
    if (o->mask_token_id < 0 && !o->init_from)
        return df_errf(e, -EINVAL, "--mask-token is required (the id of the target's mask token)");
    /* the drafter config's fixed arrays (layer_types, target_layer_ids) bound these: checked
     * before anything is written into them */
    if (o->layers < 0 || o->layers > DF_MAX_LAYERS)
        return df_errf(e, -EINVAL, "--layers %d: want 1..%d", o->layers, DF_MAX_LAYERS);
    if (o->target_layers && (o->n_target_layers < 1 || o->n_target_layers > DF_MAX_TARGET_FEATURES))
        return df_errf(e, -EINVAL, "--target-layers: %d layers given, want 1..%d",
                       o->n_target_layers, DF_MAX_TARGET_FEATURES);
    /* --init-from: the config of the drafter export the run starts from; it gives the
     * shape options left unset (its weights are read at a fresh start, below) */
    df_drafter_config ic;
    const df_drafter_config *icp = NULL;
    if (o->init_from) {
        if ((rc = df_drafter_config_load(o->init_from, &ic, e))) {
            df_err_wrap(e, "--init-from %s", o->init_from);
            return rc;
        }
        icp = &ic;
    }
    df_model_config tc;
    if ((rc = df_model_config_load(o->random_target ? o->random_target : o->target_dir, &tc, e)))
        return rc;
    if (!(cache = df_cache_open(o->cache_dir, e)))
        return e ? e->code : -EIO;
    const df_cache_params *cp = &df_cache_get_info(cache)->params;
    if ((!o->random_target && strcmp(cp->config_sha256, tc.config_sha256)) ||
        (int)df_cache_target_hidden(cp) != tc.hidden_size) {
        rc = df_errf(e, -DF_EMISMATCH, "%s was extracted from another target (config sha256 "
                     "%.12s..., hidden %u) than %s (%.12s..., hidden %d)", o->cache_dir,
                     cp->config_sha256, df_cache_target_hidden(cp), o->target_dir,
                     tc.config_sha256, tc.hidden_size);
        goto out;
    }
    /* A projected cache: the drafter reads z (proj_rank values per token) through fc_r
     * (H x R); the export merges fc = fc_r P with the cache's basis. */
    if (cp->proj_rank && o->target_layers) {
        rc = df_errf(e, -EINVAL, "--target-layers: %s is projected (rank %u) from layers it "
                     "holds jointly; a subset of them cannot be taken", o->cache_dir, cp->proj_rank);
        goto out;
    }
    if (cp->proj_rank && (rc = df_cache_load_basis(o->cache_dir, cp, &basis, e)))
        goto out;
    const int32_t *src_ids;
    uint32_t n_src = df_cache_target_layers(cp, &src_ids);
    const int n_feat = cp->proj_rank ? 1 : (o->target_layers ? o->n_target_layers : (int)n_src);

    df_drafter_config c;
    int ids_from_init = 0;
    if ((rc = train_resolve_config(o, icp, &tc, cp, n_src, src_ids, &c, &ids_from_init, e)))
        goto out;
    if ((rc = df_drafter_config_validate(&c, "drafter", e)))
        goto out;
    /* values that parse but cannot work, refused before anything is written: a row must
     * hold an anchor and its block, and the feeder's rows (FEED_SLOTS steps of nrows rows,
     * allocated lazily, so too many would only fail mid-run) must fit in memory */
    if (o->max_tokens <= c.block_size) {
        rc = df_errf(e, -EINVAL, "--max-tokens %d: a row must hold at least one block of %d "
                     "and its anchor; give --max-tokens %d or more (default 4096)", o->max_tokens,
                     c.block_size, c.block_size + 1);
        goto out;
    }
    if (o->max_anchors < 1 || o->max_tokens < 1) {
        rc = df_errf(e, -EINVAL, "--max-anchors %d / --max-tokens %d: want >= 1", o->max_anchors,
                     o->max_tokens);
        goto out;
    }
    if ((rc = train_check_row_memory(o, &c, n_feat, cp, nrows, e)))
        goto out;
    if (icp && (rc = df_init_config_check(o->init_from, &c, icp, cp->proj_rank != 0,
                                          lead && !o->quiet, e)))
        goto out;

    int cache_index[DF_BATCH_MAX_FEATURES];
    uint64_t layer_mask = 0;
    if ((rc = df_batch_map_layers(cp, c.target_layer_ids, c.num_target_features, cache_index,
                                  &layer_mask, e))) {
        if (ids_from_init)
            df_err_wrap(e, "--init-from %s: its dflash_config.target_layer_ids", o->init_from);
        goto out;
    }

    df_tensor embed, head;
    if (!o->random_target &&
        (rc = train_load_target_head(&tst, o->target_dir, tc.vocab_size, tc.hidden_size,
                                     tc.tie_word_embeddings, &embed, &head, e)))
        goto out;
    int on_gpu = o->device && strcmp(o->device, "cpu") &&
                 (!strcmp(o->device, "cuda") || df_backend_cuda_device_count() > 0);
    be = on_gpu ? df_backend_cuda_open(o->gpu, e) : df_backend_cpu_open(o->threads, e);
    if (!be) {
        rc = e ? e->code : -ENOMEM;
        goto out;
    }
    int64_t mem_base = df_backend_mem_used(be); /* the context and handles, before our memory */
    if (world > 1) { /* the ranks meet in the run directory */
        if ((rc = df_mkdirs(o->run_dir, e)))
            goto out;
        df_comm_opts co = {.rank = rank, .world = world, .rdv_dir = o->run_dir,
                           .run_id = o->run_id ? o->run_id : "default",
                           .master_addr = o->master_addr, .master_port = o->master_port};
        if ((rc = df_comm_open(be, &co, &comm, e))) {
            df_err_wrap(e, "rank %d of %d", rank, world);
            goto out;
        }
    }
    if ((rc = train_frozen_on_backend(o, be, &tc, &embed, &head, &dev_embed, &dev_head, e)))
        goto out;
    if (!df_backend_host_addressable(be) && c.head_dim != 64 && c.head_dim != 128) {
        rc = df_errf(e, -ENOTSUP, "drafter head_dim %d: the GPU drafter attention takes 64 or "
                     "128 (set --head-dim, and --heads/--kv-heads to keep the width)", c.head_dim);
        goto out;
    }
    if ((rc = df_drafter_open(&c, be, &embed, &head, &d, e)))
        goto out;
    df_drafter_set_recompute(d, o->recompute);
    const df_params *ps = df_drafter_params(d);
    int64_t total = ps->total;

    df_lr_schedule sched; /* no steps (--init-from ... --steps 0): none to schedule */
    if (o->steps > 0 &&
        (rc = df_lr_schedule_init(&sched, o->lr, o->min_lr, o->steps, o->warmup_frac, e)))
        goto out;

    /* Fresh start or exact resume. */
    df_rng rng;
    data_pos dp = {0};
    int64_t step0 = 0;
    if (lead) { /* one run per RUN at a time, from here (before any of RUN is read) to the end */
        if ((rc = df_mkdirs(o->run_dir, e)) || (rc = train_run_lock(o->run_dir, e)) < 0)
            goto out;
        lock_fd = rc;
        rc = 0;
    }
    if ((rc = train_start_state(o, &c, icp, cp, ps, total, &basis, world, rank, lead, &ck, &rng, &dp,
                          &step0, e)))
        goto out;
    if (world > 1) { /* the ranks start from one checkpoint: without a shared disk, RUN
                      * may hold it on some nodes only */
        double *s0 = calloc((size_t)world, sizeof *s0);
        if (!s0) {
            rc = df_errf(e, -ENOMEM, "out of memory");
            goto out;
        }
        s0[rank] = (double)step0;
        rc = df_comm_allreduce_host_f64(comm, s0, world, e);
        for (int r = 1; !rc && r < world; r++)
            if (s0[r] != s0[0])
                rc = df_errf(e, -DF_EMISMATCH, "rank %d starts at step %.0f and rank 0 at step "
                             "%.0f: every rank must see the same checkpoints in %s (a shared "
                             "disk, or a copy of RUN on every node)", r, s0[r], s0[0],
                             o->run_dir);
        free(s0);
        if (rc)
            goto out;
    }
    if (step0 > 0 && step0 >= o->steps) { /* (a fresh --steps 0 run goes on: eval, export) */
        if (!o->quiet && lead)
            printf("%s: already trained for %" PRId64 " steps\n", o->run_dir, step0);
        goto export;
    }
    char logpath[4200];
    snprintf(logpath, sizeof logpath, "%s/log.jsonl", o->run_dir);
    if (lead && (rc = train_open_log(o, logpath, step0, df_backend_name(be), world, ck.hparams_json, &logf, e)))
        goto out;

    grad = malloc((size_t)total * sizeof(float));
    figs = calloc(6 + 2 * DF_DRAFTER_MAX_BLOCK + (size_t)world, sizeof *figs);
    ckpt_rs = calloc((size_t)world, 32);
    ckpt_dps = calloc((size_t)world, sizeof *ckpt_dps);
    if (!grad || !figs || !ckpt_rs || !ckpt_dps) {
        rc = df_errf(e, -ENOMEM, "out of memory");
        goto out;
    }
    if ((rc = dev_state_open(be, comm, &ck, grad, total, ps, c.num_hidden_layers, o->grad_f32,
                             &ds, e)))
        goto out;
    if ((rc = train_wire_grads(o, d, ps, c.num_hidden_layers, nrows, &ds, e)))
        goto out;
    double persistent_gib;
    {
        double gib = 1.0 / (1 << 30), P = (double)total;
        double eh = 2.0 * (double)tc.vocab_size * tc.hidden_size *
                    (double)df_dtype_size(embed.dtype) * gib;
        double wb = ds.sharded ? P * gib * (double)df_dtype_size(ds.wdt) : 0;
        persistent_gib = wb + 12 * P * gib / world + eh;
        if (!o->quiet && lead)
            printf("drafter: %" PRId64 " parameters on %s x %d rank(s); persistent state per "
                   "rank %.2f GiB (weights %.2f, fp32 master + moments %.2f, frozen embedding + "
                   "head %.2f); gradients (%s) %.2f GiB\n",
                   total, df_backend_name(be), world, persistent_gib, wb, 12 * P * gib / world,
                   eh, df_dtype_name(ds.gdt), (double)ds.ges * P * gib);
    }
    df_batch_config bc = {.max_tokens = o->max_tokens, .max_anchors = o->max_anchors,
                          .block_size = c.block_size, .mask_token_id = c.mask_token_id,
                          .vocab_size = c.vocab_size, .hidden_size = (int)cp->hidden_size,
                          .n_features = n_feat, .dtype = cp->dtype,
                          .gamma = o->gamma, .noise = o->noise,
                          /* a device backend takes the rows as bf16: half the upload, no cast */
                          .out_dtype = df_backend_host_addressable(be) ? DF_DTYPE_F32
                                                                       : DF_DTYPE_BF16};
    if (o->eval_cache) {
        if ((rc = eval_open(&ev, o->eval_cache, &bc, &c, cp, o->random_target ? NULL : tc.config_sha256,
                            tc.hidden_size, o->eval_rows, !o->no_eval_walk, o->cache_dir, e)))
            goto out;
        bst.on = lead && !o->no_best;
        if (bst.on && (rc = best_open(&bst, o->run_dir, e)))
            goto out;
    }
    if ((rc = train_open_data(o, be, cache, layer_mask, rank, world, &dp, &rng, &c, n_feat, cache_index, nrows,
                        &bc, step0, &src, &fd, e)))
        goto out;

    /* a run from --init-from is evaluated before its first step too: the score of the
     * drafter it starts from (with --steps 0, the only evaluation) */
    if (ev.cache && lead && o->init_from && step0 == 0) {
        df_best r;
        if ((rc = run_eval(&ev, d, ds.w, n_feat, 0, logf, logpath, o->quiet, c.block_size, &r, e)) ||
            (bst.on &&
             (rc = best_update(&bst, &r, o, be, &ds, &c, ps, ck.master, &basis, e))))
            goto out;
    }
    double t_prev = df_now(), acc_data_s = 0, acc_flops = 0, acc_build_s = 0, acc_read_s = 0;
    const double t_run0 = t_prev;
    double acc_data_max_s = 0;
    /* the peak MFU is taken against: the bf16 GEMM ceiling measured on the H200s (KERNELS.md) */
    double peak = df_backend_host_addressable(be) ? 0 : 790e12;
    df_drafter_metrics acc = {0};
    double acc_loss = 0, acc_gnorm = 0;
    int acc_n = 0;
    uint64_t acc_tokens = 0;
    for (int64_t step = step0; step < o->steps; step++) {
        /* The step's rows, built ahead by the feeder: waiting here is data wait. */
        double t_data = df_now();
        feed_slot *sl = feeder_take(&fd, step, e, &rc);
        if (rc)
            goto out;
        double denom = sl->denom;
        uint64_t tokens = sl->tokens;
        const double wait_s = df_now() - t_data;
        double wait_max_s = wait_s;
        acc_data_s += wait_s;
        acc_build_s += sl->build_s;
        acc_read_s += sl->read_s;
        /* The loss is normalised by the whole step's weight over all ranks
         * (docs/DRAFTER.md "Labels and loss": the global denominator). */
        if (world > 1 && (rc = df_comm_allreduce_host_f64(comm, &denom, 1, e)))
            goto out;
        /* with overlap the optimizer zeroed each bucket after its update; the
         * ranges hosting activations the backward clears itself */
        if ((!ds.overlap || step == step0) && (rc = ds_zero(be, &ds, 0, ds.np))) {
            df_errf(e, rc, "step %" PRId64 ": clearing gradients failed", step);
            goto out;
        }
        df_drafter_metrics m = {0};
        if ((rc = step_rows(d, &ds, &fd, sl, step, nrows, denom, world, &m, e)))
            goto out;
        if (world > 1 && (rc = ds_grad_hook(&ds, -1))) /* buckets no row reduced (no rows) */
            goto out;
        if (world > 1 && (rc = df_comm_wait(comm, e)))
            goto out;
        double sq = 0; /* this rank's reduced gradients: its slices of the buckets */
        if (ds.world > 1) {
            for (int k = 0; k < ds.nb; k++)
                sq += ds.cnt[k] ? df_op_sumsq(be, ds_gslice(&ds, k), ds.gdt, ds.cnt[k]) : 0.0;
        } else {
            sq = df_op_sumsq(be, ds.grad, ds.gdt, total);
        }
        /* sumsq waited for the stream: the rows' uploads and argmax are done */
        for (int r = 0; r < nrows && denom > 0; r++) {
            const df_batch_row *br = df_batch_get_row(sl->rows[r]);
            if (!(br->weight_sum > 0))
                continue;
            df_drafter_row dr = {.blocks = br->blocks, .labels = br->labels,
                                 .weights = br->weights};
            df_drafter_row_metrics(d, &dr, sl->argmax[r], &m);
        }
        double flops = sl->flops;
        data_pos after = sl->after;
        uint8_t rng_after[32];
        memcpy(rng_after, sl->rng_after, sizeof rng_after);
        feeder_release(&fd, sl);
        if (world > 1 && (rc = step_figures_reduce(comm, world, rank, c.block_size, wait_s, figs, &sq, &m,
                                                   &tokens, &flops, &wait_max_s, e)))
            goto out;
        acc_flops += flops;
        acc_data_max_s += wait_max_s;
        double loss = denom > 0 ? m.loss_sum / denom : 0.0;
        double gnorm = sqrt(sq);
        if (!isfinite(loss) || !isfinite(gnorm)) {
            rc = df_errf(e, -ERANGE, "step %" PRId64 ": loss %g, gradient norm %g: not finite "
                         "(rows of epoch %" PRIu64 " before position %" PRIu64 ")", step, loss,
                         gnorm, after.epoch, after.pos);
            goto out;
        }
        double lr = df_lr_at(&sched, step);
        float gscale = gnorm > o->clip && o->clip > 0 ? (float)(o->clip / gnorm) : 1.0f;
        if (denom > 0 && (rc = dev_state_adamw(be, &ds, (float)lr, step + 1, gscale, e))) {
            df_err_wrap(e, "step %" PRId64, step);
            goto out;
        }
        /* metrics over the logging interval */
        acc_loss += loss;
        acc_gnorm += gnorm;
        acc_n++;
        acc_tokens += tokens;
        acc.blocks += m.blocks;
        acc.accepted += m.accepted;
        for (int k = 0; k < DF_DRAFTER_MAX_BLOCK; k++) {
            acc.correct[k] += m.correct[k];
            acc.counted[k] += m.counted[k];
        }
        dp.tokens += tokens;
        int64_t done = step + 1;
        if (step == step0)
            df_backend_profile_reset(be); /* the op profile leaves out the warm-up step */
        if (done % (o->log_every > 0 ? o->log_every : 1) == 0 || done == o->steps) {
            double now = df_now(), dt = now - t_prev;
            int64_t used = df_backend_mem_used(be);
            df_step_perf pf = {.tok_s = acc_tokens / dt, .step_s = dt / acc_n,
                            .data_wait = acc_data_s / dt, .data_wait_max = acc_data_max_s / dt,
                            .tflops = acc_flops / dt / 1e12,
                            .mfu = peak > 0 ? acc_flops / dt / (peak * world) : 0,
                            .mem_gib = used >= 0 ? (double)used / (1 << 30) : -1,
                            .mem_base_gib = mem_base >= 0 ? (double)mem_base / (1 << 30) : -1,
                            .persistent_gib = persistent_gib,
                            .feed_build_s = acc_build_s / acc_n, .feed_read_s = acc_read_s / acc_n,
                            .eta_s = (now - t_run0) / (double)(done - step0) *
                                     (double)(o->steps - done)};
            if ((rc = df_runlog_step(logf, logpath, o->quiet || !lead, done, o->steps, acc_loss / acc_n,
                               lr, acc_gnorm / acc_n, &acc, c.block_size, &pf, dp.tokens,
                               after.epoch, e)))
                goto out;
            t_prev = now;
            acc_data_s = acc_data_max_s = acc_flops = acc_build_s = acc_read_s = 0;
            memset(&acc, 0, sizeof acc);
            acc_loss = acc_gnorm = 0;
            acc_n = 0;
            acc_tokens = 0;
        }
        if (ev.cache && lead &&
            ((o->eval_every > 0 && done % o->eval_every == 0) || done == o->steps)) {
            double t_ev = df_now();
            if (ds.overlap && (rc = df_backend_sync(be))) /* the optimizer's side stream */
                goto out;
            df_best r;
            if ((rc = run_eval(&ev, d, ds.w, n_feat, done, logf, logpath, o->quiet, c.block_size, &r,
                               e)) ||
                (bst.on &&
                 (rc = best_update(&bst, &r, o, be, &ds, &c, ps, ck.master, &basis, e))))
                goto out;
            t_prev += df_now() - t_ev; /* the next interval's throughput leaves it out */
        }
        int save = !o->no_ckpt &&
                   ((o->ckpt_every > 0 && done % o->ckpt_every == 0) || done == o->steps);
        /* the state comes back for a checkpoint, and at the end for the export */
        if ((save || done == o->steps) &&
            ((ds.overlap && (rc = df_backend_sync(be))) || (rc = dev_state_fetch(be, &ds, &ck, e))))
            goto out;
        if (save) {
            dp.epoch = after.epoch;
            dp.pos = after.pos;
            if ((rc = save_ckpt(o, comm, world, lead, done, &c, total, rng_after, &dp, ckpt_rs, ckpt_dps,
                                &ck, e)))
                goto out;
        }
        if (o->stop_after > 0 && done - step0 >= o->stop_after)
            goto out; /* as if killed (tests of resume) */
    }
    /* no step ran (--init-from ... --steps 0): the host master is the start's,
     * unless RUN/best's write used it as scratch; all ranks fetch it again */
    if (step0 == o->steps && (rc = dev_state_fetch(be, &ds, &ck, e)))
        goto out;
export:;
    if (!lead)
        goto out;
    char exp[4200];
    snprintf(exp, sizeof exp, "%s/export", o->run_dir);
    if ((rc = c.feature_dim ? df_export_drafter_projected(exp, &c, ps, ck.master, &basis, e)
                            : df_export_drafter(exp, &c, ps, ck.master, e)))
        goto out;
    if (!o->quiet)
        printf("exported the drafter to %s (config.json + model.safetensors)\n", exp);
out:
    if (rc && comm)
        df_comm_abort(comm); /* the other ranks fail fast instead of waiting */
    feeder_close(&fd); /* before the source it reads */
    source_close(&src);
    if (logf)
        fclose(logf);
    eval_close(&ev);
    dev_state_free(be, &ds);
    df_comm_close(comm);
    df_backend_free(be, dev_embed);
    df_backend_free(be, dev_head);
    free(grad);
    free(figs);
    free(ckpt_rs);
    free(ckpt_dps);
    /* ck's blobs: NULL, or a resumed checkpoint's (an error before they were taken): freed */
    df_ckpt_state_free(&ck);
    df_drafter_close(d);
    df_backend_close(be);
    df_st_close(tst);
    df_basis_free(&basis);
    df_cache_close(cache);
    if (lock_fd >= 0)
        close(lock_fd); /* last: the run's files are all closed */
    return rc;
}
