/* init_from.h - `dflash train --init-from DIR`: a run that starts from a drafter
 * export (ours, or a released DFlash drafter with the same tensor names:
 * SpecForge / z-lab) instead of drawn weights, to fine-tune it.
 *
 * The pieces train.c calls, in order:
 *  - df_init_config_check: the drafter being built against DIR's config.json,
 *    key by key (the error names the key, both values and the option that sets
 *    ours), before anything large is read;
 *  - df_init_weights: at a fresh start, DIR's weights into the master (every
 *    tensor checked by df_export_load); on a projected cache fc_r = fc P^T;
 *  - df_init_hparams / df_init_resume_check: what a checkpoint records of the
 *    start (DIR and the sha256 of its config.json, in hparams.json), and the
 *    rule on resume: a run resumes only with the --init-from it started with
 *    (none with none), so the weights a rerun continues from are never a
 *    silent mix of two starts.
 * The optimizer starts fresh in every case (step 0, zero moments, the warmup
 * as configured): DIR holds no optimizer state.
 */
#ifndef DF_INIT_FROM_H
#define DF_INIT_FROM_H

#include "basis.h"
#include "err.h"
#include "hfconfig.h"
#include "params.h"

/* c: the drafter being built (sizes from the options, the target and the
 * cache); ic: DIR's config. Every key that shapes a tensor or changes what the
 * drafter computes must agree: hidden_size, vocab_size and num_target_layers
 * (the target's), num_hidden_layers, layer_types, sliding_window (when a layer
 * slides), num_attention_heads, num_key_value_heads, head_dim,
 * intermediate_size, block_size, dflash_config.mask_token_id and
 * target_layer_ids. -DF_EMISMATCH naming the first that differs. rms_norm_eps
 * and rope_theta come from the target: a difference is a warning (the drafter
 * trains on the target's), printed when verbose. */
int df_init_config_check(const char *dir, const df_drafter_config *c,
                         const df_drafter_config *ic, int projected, int verbose, df_err *e);

/* Fills master (ps, c's table) with DIR's weights. b: the basis of a
 * projected cache (c->feature_dim = b->R), or NULL: fc_r = fc P^T (the
 * released fc restricted to the basis: exact on features in its span), over
 * threads CPU threads (0: all). verbose: say what was done on stdout. */
int df_init_weights(const char *dir, const df_drafter_config *c, const df_params *ps,
                    const df_basis *b, int threads, float *master, int verbose, df_err *e);

/* The hparams.json text a run started from DIR (config ic) saves with its
 * checkpoints (malloc'd; NULL when out of memory). */
char *df_init_hparams(const char *dir, const df_drafter_config *ic);

/* On resume: hparams (the checkpoint's hparams.json text, NULL or "" for a
 * run started from drawn weights) against this command's --init-from (dir
 * NULL: none; ic its config). 0 when they agree, else -DF_EMISMATCH naming
 * the run, the checkpoint and both starts. */
int df_init_resume_check(const char *ckpt_dir, const char *hparams, const char *dir,
                         const df_drafter_config *ic, df_err *e);

#endif
