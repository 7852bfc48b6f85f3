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
    o->fp8 = -1; /* auto: where FP8 tensor cores are verified and the drafter wide enough */
    /* with FP8, bwd_w's dy per 128 x 128: cuBLASLt's faster kernel on sm_90, the drafter's
     * quality within the seed-to-seed spread (docs/FP8.md) */
    o->fp8_dy_blocks = 1;
    /* AdamW's m in BF16 (stochastically rounded), v in F32: 2 bytes less per parameter and
     * ~1.4% less step time at the 27B shape, the drafter within the seed-to-seed spread
     * (docs/DESIGN.md) */
    o->adam_m_bf16 = 1;
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
/* *wrote: whether a row ran its backward (the first one wrote every gradient: grad_write) */
static int step_rows(df_drafter *d, dev_state *ds, feeder *fd, feed_slot *sl, int64_t step, int nrows,
                     double denom, int world, df_drafter_metrics *m, int *wrote, df_err *e)
{
    int rc = 0;
    *wrote = 0;
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
                             .argmax_out = sl->argmax[r], .grad_write = !*wrote};
        int last = 1;
        for (int r2 = r + 1; r2 < nrows; r2++)
            last &= !(df_batch_get_row(sl->rows[r2])->weight_sum > 0);
        df_drafter_set_grad_hook(d, world > 1 && last ? ds_grad_hook : NULL, ds);
        df_drafter_set_fwd_hook(d, ds->overlap ? ds_fwd_hook : NULL, ds);
        rc = df_drafter_row_step(d, ds->w, &dr, (float)denom, ds->grad, m, e);
        *wrote = 1;
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
/* One run's state, from its opening to its close (run_close frees what is there). */
typedef struct run {
    const df_train_opts *o; /* &opts: the caller's, with --fp8 auto resolved (run_open_model) */
    df_train_opts opts;
    int nrows, world, rank, lead; /* lead: rank 0 writes the log, checkpoints and the export */
    df_cache *cache;
    const df_cache_params *cp;
    df_st *tst;
    df_backend *be;
    df_comm *comm;
    df_drafter *d;
    feeder fd;
    source src;
    float *grad;
    dev_state ds;
    eval_ctx ev;
    best_state bst;
    void *dev_embed, *dev_head;
    FILE *logf;
    char logpath[4200];
    df_ckpt_state ck;
    df_basis basis;
    int lock_fd; /* RUN/.lock, held by the lead rank (train_run_lock) */
    /* the step figures' scratch (step_figures_reduce); the checkpoints' RNG states and
     * data positions */
    double *figs;
    uint8_t *ckpt_rs;
    data_pos *ckpt_dps;
    df_drafter_config ic; /* --init-from's config (icp: &ic, or NULL) */
    const df_drafter_config *icp;
    df_model_config tc; /* the target's */
    df_drafter_config c;
    int ids_from_init, n_feat;
    int cache_index[DF_BATCH_MAX_FEATURES];
    uint64_t layer_mask;
    df_tensor embed, head;
    int64_t mem_base; /* device memory in use before ours: the context and handles */
    const df_params *ps;
    int64_t total;
    df_lr_schedule sched;
    df_rng rng;
    data_pos dp;
    int64_t step0;
    double persistent_gib;
    df_batch_config bc;
    /* the step just run: where its rows ended, the RNG after them */
    data_pos after;
    uint8_t rng_after[32];
    /* the logging interval's sums */
    double t_prev, t_run0, peak, acc_data_s, acc_data_max_s, acc_flops, acc_build_s, acc_read_s;
    double acc_loss, acc_gnorm;
    int acc_n;
    uint64_t acc_tokens;
    df_drafter_metrics acc;
} run;

/* The options alone: what cannot work is refused before anything is opened. */
static int run_check_opts(const df_train_opts *o, int rank, int world, df_err *e)
{
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
    /* UF16 holds v below 64: a gradient clipped at C <= 4 keeps it below C^2 */
    if (o->adam_v16 && !(o->clip > 0 && o->clip <= 4))
        return df_errf(e, -EINVAL, "--adam-v16 needs --clip in (0, 4] (now %g): UF16 holds AdamW's "
                       "v below 64 only", o->clip);
    if (o->adam_v16 && (o->adam_bf16 || !o->adam_m_bf16))
        return df_errf(e, -EINVAL, "--adam-v16 keeps m in BF16 and v in UF16: not with %s",
                       o->adam_bf16 ? "--adam-bf16" : "--no-adam-m-bf16");
    return 0;
}

/* The inputs: --init-from's config, the target's, the cache (from that target), the
 * drafter's config resolved and checked, the cache layers it reads, the frozen head. */
static int run_open_inputs(run *r, df_err *e)
{
    const df_train_opts *o = r->o;
    int rc;
    /* --init-from: the config of the drafter export the run starts from; it gives the
     * shape options left unset (its weights are read at a fresh start, below) */
    if (o->init_from) {
        if ((rc = df_drafter_config_load(o->init_from, &r->ic, e))) {
            df_err_wrap(e, "--init-from %s", o->init_from);
            return rc;
        }
        r->icp = &r->ic;
    }
    if ((rc = df_model_config_load(o->random_target ? o->random_target : o->target_dir, &r->tc, e)))
        return rc;
    if (!(r->cache = df_cache_open(o->cache_dir, e)))
        return e ? e->code : -EIO;
    const df_cache_params *cp = r->cp = &df_cache_get_info(r->cache)->params;
    const df_model_config *tc = &r->tc;
    if ((!o->random_target && strcmp(cp->config_sha256, tc->config_sha256)) ||
        (int)df_cache_target_hidden(cp) != tc->hidden_size)
        return df_errf(e, -DF_EMISMATCH, "%s was extracted from another target (config sha256 "
                       "%.12s..., hidden %u) than %s (%.12s..., hidden %d)", o->cache_dir,
                       cp->config_sha256, df_cache_target_hidden(cp), o->target_dir,
                       tc->config_sha256, tc->hidden_size);
    /* A projected cache: the drafter reads z (proj_rank values per token) through fc_r
     * (H x R); the export merges fc = fc_r P with the cache's basis. */
    if (cp->proj_rank && o->target_layers)
        return df_errf(e, -EINVAL, "--target-layers: %s is projected (rank %u) from layers it "
                       "holds jointly; a subset of them cannot be taken", o->cache_dir, cp->proj_rank);
    if (cp->proj_rank && (rc = df_cache_load_basis(o->cache_dir, cp, &r->basis, e)))
        return rc;
    const int32_t *src_ids;
    uint32_t n_src = df_cache_target_layers(cp, &src_ids);
    r->n_feat = cp->proj_rank ? 1 : (o->target_layers ? o->n_target_layers : (int)n_src);

    df_drafter_config *c = &r->c;
    if ((rc = train_resolve_config(o, r->icp, tc, cp, n_src, src_ids, c, &r->ids_from_init, e)) ||
        (rc = df_drafter_config_validate(c, "drafter", e)))
        return rc;
    /* values that parse but cannot work, refused before anything is written: a row must
     * hold an anchor and its block, and the feeder's rows (FEED_SLOTS steps of nrows rows,
     * allocated lazily, so too many would only fail mid-run) must fit in memory */
    if (o->max_tokens <= c->block_size)
        return df_errf(e, -EINVAL, "--max-tokens %d: a row must hold at least one block of %d "
                       "and its anchor; give --max-tokens %d or more (default 4096)", o->max_tokens,
                       c->block_size, c->block_size + 1);
    if (o->max_anchors < 1 || o->max_tokens < 1)
        return df_errf(e, -EINVAL, "--max-anchors %d / --max-tokens %d: want >= 1", o->max_anchors,
                       o->max_tokens);
    if ((rc = train_check_row_memory(o, c, r->n_feat, cp, r->nrows, e)))
        return rc;
    if (r->icp && (rc = df_init_config_check(o->init_from, c, r->icp, cp->proj_rank != 0,
                                             r->lead && !o->quiet, e)))
        return rc;
    if ((rc = df_batch_map_layers(cp, c->target_layer_ids, c->num_target_features, r->cache_index,
                                  &r->layer_mask, e))) {
        if (r->ids_from_init)
            df_err_wrap(e, "--init-from %s: its dflash_config.target_layer_ids", o->init_from);
        return rc;
    }
    if (!o->random_target &&
        (rc = train_load_target_head(&r->tst, o->target_dir, tc->vocab_size, tc->hidden_size,
                                     tc->tie_word_embeddings, &r->embed, &r->head, e)))
        return rc;
    return 0;
}

/* --fp8 auto: on where every rank's backend has verified FP8 tensor cores and the drafter is
 * at least DF_FP8_AUTO_MIN_HIDDEN wide (the ranks agree: one numerics for the whole run). The
 * choice goes into r->opts, hence the run's settings: a resume must make the same one. */
static int fp8_resolve(run *r, df_err *e)
{
    if (r->opts.fp8 >= 0)
        return 0;
    int hw = df_backend_fp8_tensor_cores(r->be), wide = r->c.hidden_size >= DF_FP8_AUTO_MIN_HIDDEN;
    double n = hw && wide;
    int rc;
    if (r->world > 1 && (rc = df_comm_allreduce_host_f64(r->comm, &n, 1, e)))
        return rc;
    r->opts.fp8 = n == r->world;
    if (r->lead && !r->opts.quiet)
        printf("--fp8 auto: %s (%s; hidden %d %s %d)\n", r->opts.fp8 ? "on" : "off",
               hw ? "FP8 tensor cores verified here" : "no verified FP8 tensor cores here",
               r->c.hidden_size, wide ? ">=" : "<", DF_FP8_AUTO_MIN_HIDDEN);
    return 0;
}

/* The backend, the ranks' communicator, the frozen head on the backend, the
 * drafter, the schedule, RUN's lock and the start (fresh, resumed or
 * --init-from), the same step on every rank. */
static int run_open_model(run *r, df_err *e)
{
    const df_train_opts *o = r->o;
    const df_drafter_config *c = &r->c;
    int rc;
    int on_gpu = o->device && strcmp(o->device, "cpu") &&
                 (!strcmp(o->device, "cuda") || df_backend_cuda_device_count() > 0);
    r->be = on_gpu ? df_backend_cuda_open(o->gpu, e) : df_backend_cpu_open(o->threads, e);
    if (!r->be)
        return e ? e->code : -ENOMEM;
    r->mem_base = df_backend_mem_used(r->be);
    if (r->world > 1) { /* the ranks meet in the run directory */
        if ((rc = df_mkdirs(o->run_dir, e)))
            return rc;
        df_comm_opts co = {.rank = r->rank, .world = r->world, .rdv_dir = o->run_dir,
                           .run_id = o->run_id ? o->run_id : "default",
                           .master_addr = o->master_addr, .master_port = o->master_port};
        if ((rc = df_comm_open(r->be, &co, &r->comm, e))) {
            df_err_wrap(e, "rank %d of %d", r->rank, r->world);
            return rc;
        }
    }
    if ((rc = train_frozen_on_backend(o, r->be, &r->tc, &r->embed, &r->head, &r->dev_embed,
                                      &r->dev_head, e)))
        return rc;
    if (!df_backend_host_addressable(r->be) && c->head_dim != 64 && c->head_dim != 128)
        return df_errf(e, -ENOTSUP, "drafter head_dim %d: the GPU drafter attention takes 64 or "
                       "128 (set --head-dim, and --heads/--kv-heads to keep the width)", c->head_dim);
    if ((rc = df_drafter_open(c, r->be, &r->embed, &r->head, &r->d, e)))
        return rc;
    df_drafter_set_recompute(r->d, o->recompute);
    if ((rc = fp8_resolve(r, e)))
        return rc;
    if (o->fp8 && (rc = df_drafter_set_fp8(r->d, 1, e)))
        return rc;
    df_drafter_set_fp8_dy_blocks(r->d, o->fp8 && o->fp8_dy_blocks);
    df_drafter_set_fp8_ce_onepass(r->d, o->fp8 && o->fp8_ce_onepass);
    df_drafter_set_bf16_logits(r->d, o->bf16_logits);
    df_drafter_set_f16_logits(r->d, o->f16_logits);
    r->ps = df_drafter_params(r->d);
    r->total = r->ps->total;
    /* no steps (--init-from ... --steps 0): none to schedule */
    if (o->steps > 0 &&
        (rc = df_lr_schedule_init(&r->sched, o->lr, o->min_lr, o->steps, o->warmup_frac, e)))
        return rc;
    /* Fresh start or exact resume. */
    if (r->lead) { /* one run per RUN at a time, from here (before any of RUN is read) to the end */
        if ((rc = df_mkdirs(o->run_dir, e)) || (rc = train_run_lock(o->run_dir, e)) < 0)
            return rc;
        r->lock_fd = rc;
    }
    if ((rc = train_start_state(o, c, r->icp, r->cp, r->ps, r->total, &r->basis, r->world, r->rank,
                                r->lead, &r->ck, &r->rng, &r->dp, &r->step0, e)))
        return rc;
    if (r->world > 1) { /* the ranks start from one checkpoint: without a shared disk, RUN
                         * may hold it on some nodes only */
        double *s0 = calloc((size_t)r->world, sizeof *s0);
        if (!s0)
            return df_errf(e, -ENOMEM, "out of memory");
        s0[r->rank] = (double)r->step0;
        rc = df_comm_allreduce_host_f64(r->comm, s0, r->world, e);
        for (int q = 1; !rc && q < r->world; q++)
            if (s0[q] != s0[0])
                rc = df_errf(e, -DF_EMISMATCH, "rank %d starts at step %.0f and rank 0 at step "
                             "%.0f: every rank must see the same checkpoints in %s (a shared "
                             "disk, or a copy of RUN on every node)", q, s0[q], s0[0], o->run_dir);
        free(s0);
        if (rc)
            return rc;
    }
    return 0;
}

/* What the steps need: the log, the gradients and the device state (ZeRO-1
 * shards, buckets), the evaluation, the data; --init-from's first evaluation. */
static int run_open_steps(run *r, df_err *e)
{
    const df_train_opts *o = r->o;
    const df_drafter_config *c = &r->c;
    int rc;
    snprintf(r->logpath, sizeof r->logpath, "%s/log.jsonl", o->run_dir);
    if (r->lead && (rc = train_open_log(o, r->logpath, r->step0, df_backend_name(r->be), r->world,
                                        r->ck.hparams_json, &r->logf, e)))
        return rc;
    r->grad = malloc((size_t)r->total * sizeof(float));
    r->figs = calloc(6 + 2 * DF_DRAFTER_MAX_BLOCK + (size_t)r->world, sizeof *r->figs);
    r->ckpt_rs = calloc((size_t)r->world, 32);
    r->ckpt_dps = calloc((size_t)r->world, sizeof *r->ckpt_dps);
    if (!r->grad || !r->figs || !r->ckpt_rs || !r->ckpt_dps)
        return df_errf(e, -ENOMEM, "out of memory");
    if ((rc = dev_state_open(r->be, r->comm, &r->ck, r->grad, r->total, r->ps, c->num_hidden_layers,
                             o->grad_f32, df_train_moments16(o), o->seed, &r->ds, e)) ||
        (rc = train_wire_grads(o, r->d, r->ps, c->num_hidden_layers, r->nrows, &r->ds, e)))
        return rc;
    if (o->fp8 > 0) {
        int kept;
        double kgib;
        if ((rc = ds_keep_weight_codes(r->be, &r->ds, r->ps, &kept, &kgib, e)))
            return rc;
        if (kept && !o->quiet && r->lead)
            printf("fp8: the E4M3 codes of %d weight matrices kept, written by AdamW (%.2f GiB)\n",
                   kept, kgib);
    }
    {
        double gib = 1.0 / (1 << 30), P = (double)r->total;
        double eh = 2.0 * (double)r->tc.vocab_size * r->tc.hidden_size *
                    (double)df_dtype_size(r->embed.dtype) * gib;
        double wb = r->ds.sharded ? P * gib * (double)df_dtype_size(r->ds.wdt) : 0;
        const int m16 = r->ds.m16 != NULL, v16 = r->ds.v16 != NULL;
        /* master + moments, bytes per parameter */
        double opt = (4 + (m16 ? 2 : 4) + (v16 ? 2 : 4)) * P * gib / r->world;
        r->persistent_gib = wb + opt + eh;
        if (!o->quiet && r->lead)
            printf("drafter: %" PRId64 " parameters on %s x %d rank(s); persistent state per "
                   "rank %.2f GiB (weights %.2f, fp32 master + %s moments %.2f, frozen "
                   "embedding + head %.2f); gradients (%s) %.2f GiB\n",
                   r->total, df_backend_name(r->be), r->world, r->persistent_gib, wb,
                   !v16 ? (m16 ? "bf16 m / fp32 v" : "fp32")
                   : r->ds.vdt == DF_DTYPE_UF16 ? "bf16 m / uf16 v" : "bf16", opt, eh,
                   df_dtype_name(r->ds.gdt), (double)r->ds.ges * P * gib);
    }
    const df_cache_params *cp = r->cp;
    r->bc = (df_batch_config){.max_tokens = o->max_tokens, .max_anchors = o->max_anchors,
                              .block_size = c->block_size, .mask_token_id = c->mask_token_id,
                              .vocab_size = c->vocab_size, .hidden_size = (int)cp->hidden_size,
                              .n_features = r->n_feat, .dtype = cp->dtype,
                              .gamma = o->gamma, .noise = o->noise,
                              /* a device backend takes the rows as bf16: half the upload, no cast */
                              .out_dtype = df_backend_host_addressable(r->be) ? DF_DTYPE_F32
                                                                             : DF_DTYPE_BF16};
    if (o->eval_cache) {
        if ((rc = eval_open(&r->ev, o->eval_cache, &r->bc, c, cp,
                            o->random_target ? NULL : r->tc.config_sha256, r->tc.hidden_size,
                            o->eval_rows, !o->no_eval_walk, o->cache_dir, e)))
            return rc;
        r->bst.on = r->lead && !o->no_best;
        if (r->bst.on && (rc = best_open(&r->bst, o->run_dir, e)))
            return rc;
    }
    if ((rc = train_open_data(o, r->be, r->cache, r->layer_mask, r->rank, r->world, &r->dp, &r->rng, c,
                              r->n_feat, r->cache_index, r->nrows, &r->bc, r->step0, &r->src, &r->fd, e)))
        return rc;
    /* a run from --init-from is evaluated before its first step too: the score of the
     * drafter it starts from (with --steps 0, the only evaluation) */
    if (r->ev.cache && r->lead && o->init_from && r->step0 == 0) {
        df_best b;
        if ((rc = run_eval(&r->ev, r->d, r->ds.w, r->n_feat, 0, r->logf, r->logpath, o->quiet,
                           c->block_size, &b, e)) ||
            (r->bst.on &&
             (rc = best_update(&r->bst, &b, o, r->be, &r->ds, c, r->ps, r->ck.master, &r->basis, e))))
            return rc;
    }
    r->t_prev = r->t_run0 = df_now();
    /* the peak MFU is taken against: the bf16 GEMM ceiling measured on the H200s (KERNELS.md),
     * twice that where the GEMMs run on E4M3 tensor cores (their dense rate is twice BF16's),
     * so that an FP8 run is not shown above 100% */
    const int e4m3 = o->fp8 > 0 && df_backend_fp8_tensor_cores(r->be);
    r->peak = df_backend_host_addressable(r->be) ? 0 : e4m3 ? 2 * 790e12 : 790e12;
    return 0;
}

/* One optimizer step: the rows' forward and backward, the gradients reduced
 * over the ranks, their norm, clipping and AdamW; the figures into the
 * logging interval's sums; the rows' end and RNG into r->after, r->rng_after. */
static int run_step(run *r, int64_t step, df_err *e)
{
    const df_train_opts *o = r->o;
    dev_state *ds = &r->ds;
    int rc = 0;
    /* The step's rows, built ahead by the feeder: waiting here is data wait. */
    double t_data = df_now();
    feed_slot *sl = feeder_take(&r->fd, step, e, &rc);
    if (rc)
        return rc;
    double denom = sl->denom;
    uint64_t tokens = sl->tokens;
    const double wait_s = df_now() - t_data;
    double wait_max_s = wait_s;
    r->acc_data_s += wait_s;
    r->acc_build_s += sl->build_s;
    r->acc_read_s += sl->read_s;
    /* The loss is normalised by the whole step's weight over all ranks
     * (docs/DRAFTER.md "Labels and loss": the global denominator). */
    if (r->world > 1 && (rc = df_comm_allreduce_host_f64(r->comm, &denom, 1, e)))
        return rc;
    /* The step's first row writes the gradients (df_drafter_row.grad_write), so they are not
     * cleared between steps. Cleared here: at the first step (the buckets' padding past the
     * parameters, which no row writes and the reduce-scatter keeps zero) and in a step where
     * no row ran its backward. */
    size_t gbytes = (size_t)ds->np * ds->ges;
    if (step == r->step0 && (rc = df_backend_zero(r->be, ds->grad, gbytes)))
        return df_errf(e, rc, "step %" PRId64 ": clearing gradients failed", step);
    df_drafter_metrics m = {0};
    int wrote = 0;
    if ((rc = step_rows(r->d, ds, &r->fd, sl, step, r->nrows, denom, r->world, &m, &wrote, e)))
        return rc;
    if (!wrote && (rc = df_backend_zero(r->be, ds->grad, gbytes)))
        return df_errf(e, rc, "step %" PRId64 ": clearing gradients failed", step);
    if (r->world > 1 && (rc = ds_grad_hook(ds, -1))) /* buckets no row reduced (no rows) */
        return rc;
    if (r->world > 1 && (rc = df_comm_wait(r->comm, e)))
        return rc;
    double sq = 0; /* this rank's reduced gradients: its slices of the buckets */
    if (ds->world > 1) {
        for (int k = 0; k < ds->nb; k++)
            sq += ds->cnt[k] ? df_op_sumsq(r->be, ds_gslice(ds, k), ds->gdt, ds->cnt[k]) : 0.0;
    } else {
        sq = df_op_sumsq(r->be, ds->grad, ds->gdt, r->total);
    }
    /* sumsq waited for the stream: the rows' uploads and argmax are done */
    for (int q = 0; q < r->nrows && denom > 0; q++) {
        const df_batch_row *br = df_batch_get_row(sl->rows[q]);
        if (!(br->weight_sum > 0))
            continue;
        df_drafter_row dr = {.blocks = br->blocks, .labels = br->labels, .weights = br->weights};
        df_drafter_row_metrics(r->d, &dr, sl->argmax[q], &m);
    }
    double flops = sl->flops;
    r->after = sl->after;
    memcpy(r->rng_after, sl->rng_after, sizeof r->rng_after);
    feeder_release(&r->fd, sl);
    if (r->world > 1 &&
        (rc = step_figures_reduce(r->comm, r->world, r->rank, r->c.block_size, wait_s, r->figs, &sq,
                                  &m, &tokens, &flops, &wait_max_s, e)))
        return rc;
    r->acc_flops += flops;
    r->acc_data_max_s += wait_max_s;
    double loss = denom > 0 ? m.loss_sum / denom : 0.0;
    double gnorm = sqrt(sq);
    if (!isfinite(loss) || !isfinite(gnorm))
        return df_errf(e, -ERANGE, "step %" PRId64 ": loss %g, gradient norm %g: not finite "
                       "(rows of epoch %" PRIu64 " before position %" PRIu64 ")", step, loss,
                       gnorm, r->after.epoch, r->after.pos);
    double lr = df_lr_at(&r->sched, step);
    float gscale = gnorm > o->clip && o->clip > 0 ? (float)(o->clip / gnorm) : 1.0f;
    if (denom > 0 && (rc = dev_state_adamw(r->be, ds, (float)lr, step + 1, gscale, e))) {
        df_err_wrap(e, "step %" PRId64, step);
        return rc;
    }
    /* metrics over the logging interval */
    r->acc_loss += loss;
    r->acc_gnorm += gnorm;
    r->acc_n++;
    r->acc_tokens += tokens;
    r->acc.blocks += m.blocks;
    r->acc.accepted += m.accepted;
    for (int k = 0; k < DF_DRAFTER_MAX_BLOCK; k++) {
        r->acc.correct[k] += m.correct[k];
        r->acc.counted[k] += m.counted[k];
    }
    r->dp.tokens += tokens;
    return 0;
}

/* The logging interval that ends with step done - 1: one log line (the
 * lead's), the sums cleared. */
static int run_log(run *r, int64_t done, df_err *e)
{
    const df_train_opts *o = r->o;
    double now = df_now(), dt = now - r->t_prev;
    int64_t used = df_backend_mem_used(r->be);
    double lr = df_lr_at(&r->sched, done - 1);
    df_step_perf pf = {.tok_s = r->acc_tokens / dt, .step_s = dt / r->acc_n,
                       .data_wait = r->acc_data_s / dt, .data_wait_max = r->acc_data_max_s / dt,
                       .tflops = r->acc_flops / dt / 1e12,
                       .mfu = r->peak > 0 ? r->acc_flops / dt / (r->peak * r->world) : 0,
                       .mem_gib = used >= 0 ? (double)used / (1 << 30) : -1,
                       .mem_base_gib = r->mem_base >= 0 ? (double)r->mem_base / (1 << 30) : -1,
                       .persistent_gib = r->persistent_gib,
                       .feed_build_s = r->acc_build_s / r->acc_n, .feed_read_s = r->acc_read_s / r->acc_n,
                       .eta_s = (now - r->t_run0) / (double)(done - r->step0) * (double)(o->steps - done)};
    int rc = df_runlog_step(r->logf, r->logpath, o->quiet || !r->lead, done, o->steps,
                            r->acc_loss / r->acc_n, lr, r->acc_gnorm / r->acc_n, &r->acc,
                            r->c.block_size, &pf, r->dp.tokens, r->after.epoch, e);
    r->t_prev = now;
    r->acc_data_s = r->acc_data_max_s = r->acc_flops = r->acc_build_s = r->acc_read_s = 0;
    memset(&r->acc, 0, sizeof r->acc);
    r->acc_loss = r->acc_gnorm = 0;
    r->acc_n = 0;
    r->acc_tokens = 0;
    return rc;
}

/* After step done - 1: the log line, the evaluation (RUN/best), the
 * checkpoint, each when it is due. */
static int run_after_step(run *r, int64_t done, df_err *e)
{
    const df_train_opts *o = r->o;
    int rc;
    if (done - 1 == r->step0)
        df_backend_profile_reset(r->be); /* the op profile leaves out the warm-up step */
    if ((done % (o->log_every > 0 ? o->log_every : 1) == 0 || done == o->steps) &&
        (rc = run_log(r, done, e)))
        return rc;
    if (r->ev.cache && r->lead && ((o->eval_every > 0 && done % o->eval_every == 0) || done == o->steps)) {
        double t_ev = df_now();
        if (r->ds.overlap && (rc = df_backend_sync(r->be))) /* the optimizer's side stream */
            return rc;
        df_best b;
        if ((rc = run_eval(&r->ev, r->d, r->ds.w, r->n_feat, done, r->logf, r->logpath, o->quiet,
                           r->c.block_size, &b, e)) ||
            (r->bst.on &&
             (rc = best_update(&r->bst, &b, o, r->be, &r->ds, &r->c, r->ps, r->ck.master, &r->basis, e))))
            return rc;
        r->t_prev += df_now() - t_ev; /* the next interval's throughput leaves it out */
    }
    int save = !o->no_ckpt && ((o->ckpt_every > 0 && done % o->ckpt_every == 0) || done == o->steps);
    /* the state comes back for a checkpoint, and at the end for the export */
    if ((save || done == o->steps) &&
        ((r->ds.overlap && (rc = df_backend_sync(r->be))) || (rc = dev_state_fetch(r->be, &r->ds, &r->ck, e))))
        return rc;
    if (save) {
        r->dp.epoch = r->after.epoch;
        r->dp.pos = r->after.pos;
        if ((rc = save_ckpt(o, r->comm, r->world, r->lead, done, &r->c, r->total, r->rng_after, &r->dp,
                            r->ckpt_rs, r->ckpt_dps, &r->ck, e)))
            return rc;
    }
    return 0;
}

/* RUN/export (the lead's): the drafter, merged with the basis on a projected cache. */
static int run_export(run *r, df_err *e)
{
    const df_train_opts *o = r->o;
    if (!r->lead)
        return 0;
    char exp[4200];
    snprintf(exp, sizeof exp, "%s/export", o->run_dir);
    int rc = r->c.feature_dim ? df_export_drafter_projected(exp, &r->c, r->ps, r->ck.master, &r->basis, e)
                              : df_export_drafter(exp, &r->c, r->ps, r->ck.master, e);
    if (!rc && !o->quiet)
        printf("exported the drafter to %s (config.json + model.safetensors)\n", exp);
    return rc;
}

/* Everything run holds, in dependency order; rc != 0 aborts the other ranks first. */
static void run_close(run *r, int rc)
{
    if (rc && r->comm)
        df_comm_abort(r->comm); /* the other ranks fail fast instead of waiting */
    feeder_close(&r->fd); /* before the source it reads */
    source_close(&r->src);
    if (r->logf)
        fclose(r->logf);
    eval_close(&r->ev);
    dev_state_free(r->be, &r->ds);
    df_comm_close(r->comm);
    df_backend_free(r->be, r->dev_embed);
    df_backend_free(r->be, r->dev_head);
    free(r->grad);
    free(r->figs);
    free(r->ckpt_rs);
    free(r->ckpt_dps);
    /* ck's blobs: NULL, or a resumed checkpoint's (an error before they were taken): freed */
    df_ckpt_state_free(&r->ck);
    df_drafter_close(r->d);
    df_backend_close(r->be);
    df_st_close(r->tst);
    df_basis_free(&r->basis);
    df_cache_close(r->cache);
    if (r->lock_fd >= 0)
        close(r->lock_fd); /* last: the run's files are all closed */
}

int df_train_run(const df_train_opts *o, df_err *e)
{
    int world = o->world > 1 ? o->world : 1, rank = world > 1 ? o->rank : 0;
    int rc = run_check_opts(o, rank, world, e);
    if (rc)
        return rc;
    run *r = calloc(1, sizeof *r);
    if (!r)
        return df_errf(e, -ENOMEM, "out of memory");
    r->opts = *o;
    r->o = o = &r->opts;
    r->world = world, r->rank = rank, r->lead = rank == 0;
    r->nrows = o->rows_per_step > 0 ? o->rows_per_step : 1;
    r->lock_fd = -1;
    if ((rc = run_open_inputs(r, e)) || (rc = run_open_model(r, e)))
        goto out;
    if (r->step0 > 0 && r->step0 >= o->steps) { /* (a fresh --steps 0 run goes on: eval, export) */
        if (!o->quiet && r->lead)
            printf("%s: already trained for %" PRId64 " steps\n", o->run_dir, r->step0);
        rc = run_export(r, e);
        goto out;
    }
    if ((rc = run_open_steps(r, e)))
        goto out;
    for (int64_t step = r->step0; step < o->steps; step++) {
        if ((rc = run_step(r, step, e)) || (rc = run_after_step(r, step + 1, e)))
            goto out;
        if (o->stop_after > 0 && step + 1 - r->step0 >= o->stop_after)
            goto out; /* as if killed (tests of resume) */
    }
    /* no step ran (--init-from ... --steps 0): the host master is the start's,
     * unless RUN/best's write used it as scratch; all ranks fetch it again */
    if (r->step0 == o->steps && (rc = dev_state_fetch(r->be, &r->ds, &r->ck, e)))
        goto out;
    rc = run_export(r, e);
out:
    run_close(r, rc);
    free(r);
    return rc;
}
