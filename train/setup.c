/* setup.c - a training run's setup (setup.h): the run lock, the drafter
 * config, the memory its rows need, the frozen embedding and head, the
 * start (a checkpoint or fresh weights), the gradients' wiring, the log and
 * the data. */
#include "setup.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <unistd.h>

#include "fsutil.h"
#include "init_from.h"
#include "log.h"
#include "runlog.h"
#include "settings.h"

/* RUN/.lock, flock()ed for the whole run by its lead rank, holding that process's
 * pid: a second `train` into the same RUN (which would interleave checkpoints and
 * log lines with the first) is refused naming the holder. The lock goes with the
 * process (a killed run leaves none behind). Returns the descriptor (>= 0) to keep
 * open, or a negative code: -EBUSY when another process holds it. */
int train_run_lock(const char *run_dir, df_err *e)
{
    char p[4200];
    snprintf(p, sizeof p, "%s/.lock", run_dir);
    int fd = open(p, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return df_errf(e, -errno, "%s: %s", p, strerror(errno));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int err = errno;
        char pid[32] = "";
        ssize_t n = err == EWOULDBLOCK ? pread(fd, pid, sizeof pid - 1, 0) : -1;
        close(fd);
        if (err != EWOULDBLOCK)
            return df_errf(e, -err, "%s: flock failed: %s", p, strerror(err));
        pid[n > 0 ? n : 0] = 0;
        pid[strcspn(pid, "\n")] = 0;
        return df_errf(e, -EBUSY, "%s is in use by another train (pid %s, holding %s); wait for "
                       "it to end or use another --out", run_dir, *pid ? pid : "unknown", p);
    }
    char pid[32];
    int len = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, pid, (size_t)len, 0) != len) {
        int err = errno ? errno : EIO;
        close(fd);
        return df_errf(e, -err, "%s: cannot write the pid: %s", p, strerror(err));
    }
    return fd;
}

/* The target's frozen embedding and head. The head is lm_head.weight; the embedding
 * stands in for it only where config.json says they are tied: without that, a missing
 * lm_head.weight is an error (a head silently replaced by the embedding trains a
 * drafter against the wrong logits). */
int train_load_target_head(df_st **st, const char *dir, int64_t V, int H, int tied,
                           df_tensor *embed, df_tensor *head, df_err *e)
{
    int rc = df_st_open(dir, st, e);
    if (rc)
        return rc;
    const char *en = df_st_find(*st, "model.language_model.embed_tokens.weight")
                         ? "model.language_model.embed_tokens.weight"
                         : "model.embed_tokens.weight";
    const df_st_tensor *te, *th;
    int64_t shape[2] = {V, H};
    if ((rc = df_st_expect(*st, en, DF_DTYPE_INVALID, 2, shape, &te, e)))
        return rc;
    th = df_st_find(*st, "lm_head.weight");
    if (!th && !tied)
        return df_errf(e, -DF_EMISMATCH, "%s: tensor lm_head.weight is missing and config.json "
                       "has tie_word_embeddings false (a tied target says true)", dir);
    if (!th)
        th = te; /* tied embeddings */
    else if ((rc = df_st_check(th, DF_DTYPE_INVALID, 2, shape, e)))
        return rc;
    *embed = df_tensor_2d((void *)te->data, te->dtype, V, H);
    *head = df_tensor_2d((void *)th->data, th->dtype, V, H);
    return 0;
}

static int parse_layer_types(const df_train_opts *o, df_drafter_config *c, df_err *e)
{
    int n = c->num_hidden_layers;
    const char *s = o->layer_types;
    if (n < 1 || n > DF_MAX_LAYERS) /* c->layer_types holds DF_MAX_LAYERS */
        return df_errf(e, -EINVAL, "drafter layers %d: want 1..%d", n, DF_MAX_LAYERS);
    if (!s || !*s) {
        for (int i = 0; i < n; i++)
            c->layer_types[i] = i == n - 1 ? DF_LAYER_FULL : DF_LAYER_SLIDING;
        return 0;
    }
    if (!strcmp(s, "full") || !strcmp(s, "sliding")) {
        for (int i = 0; i < n; i++)
            c->layer_types[i] = !strcmp(s, "full") ? DF_LAYER_FULL : DF_LAYER_SLIDING;
        return 0;
    }
    int i = 0;
    const char *p = s;
    while (*p && i < n) {
        size_t len = strcspn(p, ",");
        if (len == 4 && !strncmp(p, "full", 4))
            c->layer_types[i++] = DF_LAYER_FULL;
        else if (len == 7 && !strncmp(p, "sliding", 7))
            c->layer_types[i++] = DF_LAYER_SLIDING;
        else
            break;
        p += len + (p[len] == ',');
    }
    if (i != n || *p)
        return df_errf(e, -EINVAL, "--layer-types '%s': want full, sliding, or %d of them "
                       "separated by commas", s, n);
    return 0;
}

/* A [V, H] host weight as a BF16 tensor in device memory (*owned). */
static int device_bf16(df_backend *be, df_tensor *t, void **owned, df_err *e)
{
    int64_t n = df_tensor_numel(t);
    uint16_t *tmp = malloc((size_t)n * 2), *dev = df_backend_alloc(be, (size_t)n * 2);
    if (!tmp || !dev) {
        free(tmp);
        df_backend_free(be, dev);
        return df_errf(e, -ENOMEM, "out of memory placing a [%lld x %lld] weight on %s",
                       (long long)t->shape[0], (long long)t->shape[1], df_backend_name(be));
    }
    size_t es = df_dtype_size(t->dtype);
    for (int64_t i = 0; i < n; i++)
        tmp[i] = t->dtype == DF_DTYPE_BF16
                     ? ((const uint16_t *)t->data)[i]
                     : df_f32_to_bf16(df_elem_to_f32((const uint8_t *)t->data + i * es, t->dtype));
    int rc = df_backend_upload(be, dev, tmp, (size_t)n * 2);
    free(tmp);
    if (rc) {
        df_backend_free(be, dev);
        return df_errf(e, rc, "upload to %s failed", df_backend_name(be));
    }
    *owned = dev;
    *t = df_tensor_2d(dev, DF_DTYPE_BF16, t->shape[0], t->shape[1]);
    return 0;
}

/* The drafter config: docs/DRAFTER.md shapes; what is not given comes from
 * --init-from's config (icp, may be NULL), else from the target (tc; the
 * feature layers: the cache's, n_src ids src_ids, or the cache's projection).
 * *from_init: the feature layer ids came from icp. Not yet validated. */
int train_resolve_config(const df_train_opts *o, const df_drafter_config *icp,
                         const df_model_config *tc, const df_cache_params *cp, uint32_t n_src,
                         const int32_t *src_ids, df_drafter_config *c, int *from_init, df_err *e)
{
    int rc = 0;
    memset(c, 0, sizeof *c);
    c->block_size = o->block_size ? o->block_size : icp ? icp->block_size : 16;
    c->mask_token_id = o->mask_token_id >= 0 ? o->mask_token_id : icp ? icp->mask_token_id : -1;
    /* a projected cache holds all of its layers jointly: those are the drafter's */
    const int ids_from_init = *from_init = icp && !o->target_layers && !cp->proj_rank;
    c->num_target_features = o->target_layers ? o->n_target_layers
                            : ids_from_init  ? icp->num_target_features
                                             : (int)n_src;
    for (int i = 0; i < c->num_target_features; i++)
        c->target_layer_ids[i] = o->target_layers ? o->target_layers[i]
                                : ids_from_init  ? icp->target_layer_ids[i]
                                                 : src_ids[i];
    c->feature_dim = (int)cp->proj_rank;
    c->num_target_layers = tc->num_hidden_layers;
    c->num_hidden_layers = o->layers ? o->layers : icp ? icp->num_hidden_layers : 1;
    c->hidden_size = tc->hidden_size;
    c->intermediate_size = o->intermediate ? o->intermediate
                          : icp           ? icp->intermediate_size
                                          : tc->intermediate_size;
    c->num_attention_heads = o->heads ? o->heads : icp ? icp->num_attention_heads
                                                      : tc->num_attention_heads;
    c->num_key_value_heads = o->kv_heads ? o->kv_heads : icp ? icp->num_key_value_heads
                                                            : tc->num_key_value_heads;
    c->head_dim = o->head_dim ? o->head_dim : icp ? icp->head_dim : tc->head_dim;
    c->rms_norm_eps = tc->rms_norm_eps;
    c->rope_theta = tc->rope_theta;
    c->max_position_embeddings = tc->max_position_embeddings ? tc->max_position_embeddings : 32768;
    c->vocab_size = tc->vocab_size;
    if (!o->layer_types && icp && icp->num_hidden_layers == c->num_hidden_layers)
        memcpy(c->layer_types, icp->layer_types, (size_t)c->num_hidden_layers);
    else if ((rc = parse_layer_types(o, c, e)))
        return rc;
    for (int i = 0; i < c->num_hidden_layers; i++)
        if (c->layer_types[i] == DF_LAYER_SLIDING) {
            c->sliding_window = o->sliding_window             ? o->sliding_window
                               : icp && icp->sliding_window > 0 ? icp->sliding_window
                                                                : 2048;
            c->use_sliding_window = true;
        }
    return rc;
}

/* The feeder's rows (FEED_SLOTS steps of nrows rows, allocated lazily, so too
 * many would only fail mid-run) must fit in this machine's memory: -ENOMEM
 * naming the option to lower, checked before anything is written. */
int train_check_row_memory(const df_train_opts *o, const df_drafter_config *c, int n_feat,
                           const df_cache_params *cp, int nrows, df_err *e)
{
    long pages = sysconf(_SC_PHYS_PAGES), psz = sysconf(_SC_PAGESIZE);
    double phys = pages > 0 && psz > 0 ? (double)pages * (double)psz : 0;
    double width = (double)n_feat * (double)cp->hidden_size;
    double row = (double)o->max_tokens * (width * 4 + 40) +
                 (double)o->max_anchors * c->block_size * 16; /* features + per-token arrays */
    double need = (double)FEED_SLOTS * nrows * row;
    if (!(phys > 0 && need > phys))
        return 0;
    long fit = (long)(phys / ((double)FEED_SLOTS * row));
    if (fit >= 1)
        return df_errf(e, -ENOMEM, "--rows-per-step %d: the rows' buffers need %.1f GiB, "
                       "more than this machine's %.1f GiB; give --rows-per-step %ld or less",
                       nrows, need / 1073741824.0, phys / 1073741824.0, fit);
    return df_errf(e, -ENOMEM, "--max-tokens %d: one row's buffers need %.1f GiB, "
                   "more than this machine's %.1f GiB; give --max-tokens %ld or less",
                   o->max_tokens, FEED_SLOTS * row / 1073741824.0, phys / 1073741824.0,
                   (long)(phys / ((double)FEED_SLOTS * (width * 4 + 40))));
}

/* The run's start: the latest checkpoint in RUN (settings and shape checked
 * against this command's, this rank's RNG state and data position), or a
 * fresh one (weights from --init-from or drawn; the run's settings). */
int train_start_state(const df_train_opts *o, const df_drafter_config *c,
                      const df_drafter_config *icp, const df_cache_params *cp, const df_params *ps,
                      int64_t total, df_basis *basis, int world, int rank, int lead,
                      df_ckpt_state *ck, df_rng *rng, data_pos *dp, int64_t *step0, df_err *e)
{
    int rc;
    rc = df_ckpt_load_latest(o->run_dir, ck, e);
    if (rc == 0) {
        /* the start it was made from first: without it the shape options default otherwise */
        if ((rc = df_init_resume_check(ck->loaded_from, ck->hparams_json, o->init_from, icp, e)))
            return rc;
        /* the settings that define the run: this command's must be the run's (settings.h) */
        char *now = df_run_settings_json(ck->hparams_json, o, c, cp);
        int64_t ext = 0;
        int unchecked = 0;
        if (!now) {
            rc = df_errf(e, -ENOMEM, "out of memory");
            return rc;
        }
        if ((rc = df_run_settings_check(ck->loaded_from, ck->hparams_json, now, &ext, &unchecked,
                                        e))) {
            free(now);
            return rc;
        }
        if (unchecked && lead)
            df_log(DF_LOG_WARN, "%s: written before runs recorded their settings (hparams.json): "
                   "resuming without checking this command's against the run's",
                   ck->loaded_from);
        if (ext && lead && !o->quiet)
            printf("%s: --steps extended from %" PRId64 " to %" PRId64 " (the LR schedule now "
                   "runs over %" PRId64 " steps)\n", o->run_dir, ext, o->steps, o->steps);
        free(ck->hparams_json); /* the next checkpoints record this command's (--steps as grown) */
        ck->hparams_json = now;
        if (ck->n_floats != total || memcmp(ck->config.target_layer_ids, &c->target_layer_ids,
                                           sizeof c->target_layer_ids) ||
            ck->config.num_hidden_layers != c->num_hidden_layers ||
            ck->config.hidden_size != c->hidden_size || ck->config.block_size != c->block_size) {
            rc = df_errf(e, -DF_EMISMATCH, "%s holds a run of another drafter shape; use another "
                         "--out", o->run_dir);
            return rc;
        }
        /* one RNG state and data position per rank */
        if (ck->rng_len % 32 || ck->data_position_len != ck->rng_len / 32 * sizeof *dp) {
            rc = df_errf(e, -DF_ECORRUPT, "%s: checkpoint state blobs have the wrong size",
                         ck->loaded_from);
            return rc;
        }
        if (ck->rng_len != 32 * (size_t)world) {
            rc = df_errf(e, -DF_EMISMATCH, "%s was written by a run of %zu rank(s); resume it "
                         "with the same number (this run has %d)", ck->loaded_from,
                         ck->rng_len / 32, world);
            return rc;
        }
        if ((rc = df_rng_load(rng, (const uint8_t *)ck->rng_state + 32 * rank, e)))
            return rc;
        memcpy(dp, (const uint8_t *)ck->data_position + sizeof *dp * rank, sizeof *dp);
        free(ck->rng_state);
        free(ck->data_position);
        ck->rng_state = ck->data_position = NULL;
        *step0 = ck->step;
        if (!o->quiet && lead)
            printf("resuming %s at step %" PRId64 " (epoch %" PRIu64 ", position %" PRIu64 ")\n",
                   ck->loaded_from, *step0, dp->epoch, dp->pos);
    } else if (rc == -ENOENT) {
        rc = 0;
        ck->master = malloc((size_t)total * sizeof(float));
        ck->adam_m = calloc((size_t)total, sizeof(float));
        ck->adam_v = calloc((size_t)total, sizeof(float));
        if (!ck->master || !ck->adam_m || !ck->adam_v) {
            rc = df_errf(e, -ENOMEM, "out of memory for %" PRId64 " parameters", total);
            return rc;
        }
        if (o->init_from) { /* every weight from the export; its start goes with the checkpoints */
            if ((rc = df_init_weights(o->init_from, c, ps, cp->proj_rank ? basis : NULL,
                                      o->threads, ck->master, lead && !o->quiet, e)))
                return rc;
            if (!(ck->hparams_json = df_init_hparams(o->init_from, icp))) {
                rc = df_errf(e, -ENOMEM, "out of memory");
                return rc;
            }
        } else {
            df_params_init(ps, ck->master, (float)o->init_std,
                           o->init_seed ? o->init_seed : o->seed);
            if (!o->fc_init_random)
                df_params_init_fc_mean(ps, c, cp->proj_rank ? basis : NULL, ck->master);
            if (o->init_seed_for &&
                (rc = df_params_init_overrides(ps, ck->master, (float)o->init_std,
                                               o->init_seed_for, e)))
                return rc;
        }
        char *hp = df_run_settings_json(ck->hparams_json, o, c, cp); /* + --init-from's keys */
        if (!hp) {
            rc = df_errf(e, -ENOMEM, "out of memory");
            return rc;
        }
        free(ck->hparams_json);
        ck->hparams_json = hp;
        df_rng_seed(rng, o->seed, /* rank 0: as one rank */
                    1 + 0x10000ull * (uint64_t)(o->replicate_data ? 0 : rank));
        if ((rc = df_mkdirs(o->run_dir, e)))
            return rc;
    } else {
        return rc;
    }
    return rc;
}


/* The frozen embedding and head where the backend computes: random ones for
 * benchmarks (--random-target), else the target's as bf16 on a device
 * (dev_embed, dev_head: backend memory to free), else as loaded. */
int train_frozen_on_backend(const df_train_opts *o, df_backend *be, const df_model_config *tc,
                            df_tensor *embed, df_tensor *head, void **dev_embed, void **dev_head,
                            df_err *e)
{
    int rc = 0;
    if (o->random_target) { /* benchmarks: a random frozen embedding and head on the backend */
        df_dtype dt = df_backend_act_dtype(be);
        size_t nb = (size_t)tc->vocab_size * (size_t)tc->hidden_size * df_dtype_size(dt);
        *dev_embed = df_backend_alloc(be, nb);
        *dev_head = df_backend_alloc(be, nb);
        if (!*dev_embed || !*dev_head) {
            rc = df_errf(e, -ENOMEM, "out of memory for a random [%lld x %d] embedding and head",
                         (long long)tc->vocab_size, tc->hidden_size);
            return rc;
        }
        int64_t n = tc->vocab_size * (int64_t)tc->hidden_size;
        if ((rc = df_backend_fill_uniform(be, *dev_embed, dt, n, o->seed + 11, -0.035f, 0.035f)) ||
            (rc = df_backend_fill_uniform(be, *dev_head, dt, n, o->seed + 12, -0.035f, 0.035f)))
            return rc;
        *embed = df_tensor_2d(*dev_embed, dt, tc->vocab_size, tc->hidden_size);
        *head = df_tensor_2d(*dev_head, dt, tc->vocab_size, tc->hidden_size);
    } else if (!df_backend_host_addressable(be)) { /* the frozen embedding and head, bf16 on the device */
        if ((rc = device_bf16(be, embed, dev_embed, e)) ||
            (rc = device_bf16(be, head, dev_head, e)))
            return rc;
    }
    return rc;
}

/* How the gradients meet the drafter: the optimizer overlapping the next
 * forward (--overlap-optimizer; by default where the buckets fit the
 * backend's marks), their dtype, and with one row per step the layers'
 * activations living in them until their backward (ds's alias ranges). */
int train_wire_grads(const df_train_opts *o, df_drafter *d, const df_params *ps, int nl, int nrows,
                     dev_state *ds, df_err *e)
{
    int rc = 0;
    if (o->overlap_opt < 0 && ds->nb > DF_BACKEND_MARKS) {
        df_log(DF_LOG_INFO, "train: %d gradient buckets, more than %d: the optimizer does not "
                            "overlap the forward", ds->nb, DF_BACKEND_MARKS);
    } else if (o->overlap_opt) {
        if (ds->nb > DF_BACKEND_MARKS) {
            rc = df_errf(e, -ENOTSUP, "--overlap-optimizer: %d gradient buckets, at most %d",
                         ds->nb, DF_BACKEND_MARKS);
            return rc;
        }
        ds->overlap = 1;
        ds_part_marks(ds, ps, nl);
    }
    if ((rc = df_drafter_set_grad_dtype(d, ds->gdt))) {
        df_errf(e, rc, "gradient dtype %s", df_dtype_name(ds->gdt));
        return rc;
    }
    /* one row per step: the gradients are consumed before the next forward,
     * so layers' activations may live in them until their backward */
    if (!o->no_grad_alias && nrows == 1) {
        if ((rc = df_drafter_set_grad_alias(d, ds->grad))) {
            df_errf(e, rc, "gradient aliasing");
            return rc;
        }
    }
    return rc;
}

/* RUN/log.jsonl for appending (its lines past step0 dropped, a resume's),
 * with the run line of this start (runlog.h). */
int train_open_log(const df_train_opts *o, const char *logpath, int64_t step0, const char *backend,
                   int world, const char *settings_json, FILE **logf, df_err *e)
{
    int rc;
    if ((rc = df_runlog_trim(logpath, step0, e)))
        return rc;
    /* a run without its log is not what was asked for; a FIFO would block */
    int lfd = df_open_regular(logpath, O_WRONLY | O_CREAT | O_APPEND, 0644, e);
    if (lfd < 0) {
        rc = lfd;
        return rc;
    }
    if (!(*logf = fdopen(lfd, "a"))) {
        rc = df_errf(e, -errno, "%s: cannot open for appending: %s", logpath, strerror(errno));
        close(lfd);
        return rc;
    }
    df_runlog_meta rm = {.event = step0 > 0 ? "resume" : "start",
                         .backend = backend, .world = world,
                         .cache = o->cache_dir, .eval_cache = o->eval_cache,
                         .target = o->target_dir, .init_from = o->init_from,
                         .run_dir = o->run_dir, .steps = o->steps,
                         .settings_json = settings_json};
    if ((rc = df_runlog_run(*logf, logpath, step0, &rm, e)))
        return rc;
    return 0;
}

/* This rank's samples of the cache from data position dp (its share of each
 * epoch's order), and the feeder thread that builds each step's rows from
 * them ahead of the step, until --stop-after or --steps. */
int train_open_data(const df_train_opts *o, df_backend *be, df_cache *cache, uint64_t layer_mask,
                    int rank, int world, const data_pos *dp, df_rng *rng, const df_drafter_config *c,
                    int n_feat, const int *cache_index, int nrows, const df_batch_config *bc,
                    int64_t step0, source *src, feeder *fd, df_err *e)
{
    int rc;
    src->cache = cache;
    src->layer_mask = layer_mask;
    src->threads = 4; /* decompression: a 4096-token row of 5 x 5120 bf16 features is ~200 MB */
    src->seed = o->seed;
    src->n_all = df_cache_count(cache);
    src->rank = o->replicate_data ? 0 : rank;
    src->world = o->replicate_data ? 1 : world;
    src->buffered = o->buffered_io;
    src->ahead = 1;
    src->order = malloc((src->n_all ? src->n_all : 1) * sizeof *src->order);
    if (!src->order) {
        return df_errf(e, -ENOMEM, "out of memory");
    }
    if (src->n_all < (size_t)src->world) {
        return df_errf(e, -ENODATA, "%s: the cache has %zu samples, fewer than the %d ranks",
                       o->cache_dir, src->n_all, world);
    }
    if ((rc = source_open_at(src, dp->epoch, dp->pos, e)))
        return rc;
    fd->be = be;
    fd->src = src;
    fd->rng = rng;
    fd->c = c;
    fd->n_feat = n_feat;
    fd->cache_index = cache_index;
    fd->cache_dir = o->cache_dir;
    fd->nrows = nrows;
    if ((rc = feeder_open(fd, bc, step0, o->stop_after > 0 && step0 + o->stop_after < o->steps
                                                ? step0 + o->stop_after : o->steps, e)))
        return rc;

    return 0;
}
