/* ckpt.h - training checkpoints (exact resume) and the serving export.
 *
 * ---- A run's checkpoints ----------------------------------------------------
 * RUN/
 *   ckpt-0000001200/          one complete checkpoint per saved step (%010lld)
 *     config.json             the drafter config (df_drafter_config_to_json)
 *     hparams.json            the caller's hyperparameter JSON text, verbatim (train: the
 *                             run's settings, train/settings.h, and --init-from's start)
 *     state.safetensors       F32 "master.<param>", "adam_m.<param>", "adam_v.<param>"
 *                             for every entry of the params table (docs/DRAFTER.md names,
 *                             their shapes); U8 "rng_state" [n], "data_position" [n]
 *                             (the caller's opaque blobs); __metadata__ format/step
 *     manifest.json           format "dflash-ckpt", version, step, params_total,
 *                             params_count, sha256 of config.json and hparams.json,
 *                             blob sizes, CRC-32C of each flat array (master, adam_m,
 *                             adam_v: over params.total floats in table order) and
 *                             of each blob
 *     COMPLETE                the marker, written last: "dflash-ckpt 1\nstep S\n
 *                             manifest.json sha256 HEX\n"
 *   ckpt-0000001200.tmp/      a save in progress (or killed): never read; removed by
 *                             the next save
 *   ckpt-0000000800.deleting/ a pruned checkpoint being removed: never read
 *   latest                    "ckpt-0000001200\n": the newest complete checkpoint, for
 *                             tools and people (replaced atomically after each save)
 *   .ckpt.lock                flock()ed during a save: one writer per run directory
 *   .lock                     flock()ed by `train` for the whole run, holding its pid (train.c)
 *   export/, best/            not checkpoints: the serving export at the end, and that of
 *                             the best evaluation (train/best.h)
 *
 * Save: every file is written into ckpt-S.tmp/ (file.tmp, fsync, rename, fsync of
 * the directory), COMPLETE last; then ckpt-S.tmp/ is renamed to ckpt-S/ and RUN is
 * fsynced, then `latest` is replaced, then older checkpoints are pruned (renamed to
 * .deleting, RUN fsynced, files removed). A crash at any point leaves every earlier
 * checkpoint untouched, and a ckpt-S/ name exists only for a checkpoint whose files
 * are all durable.
 *
 * Load: the newest ckpt-S/ (highest S) is the one resumed; it is validated fully
 * (COMPLETE vs manifest.json sha256, format version, config.json and hparams.json
 * sha256, the params table rebuilt from config.json vs manifest and every tensor's
 * dtype/shape, no extra tensors, CRC-32C of the three arrays and the blobs). Any
 * failure is an error naming the file; there is NO silent fall-back to an older
 * checkpoint: df_ckpt_list() + df_ckpt_load() let the caller choose one explicitly.
 * If `latest` names a checkpoint newer than any present, that is an error too.
 *
 * Errors: -ENOENT (no checkpoint), -DF_ECORRUPT (damaged/incomplete/lying files),
 * -DF_EVERSION (another format version), -DF_EMISMATCH (arrays vs config on save),
 * -EEXIST (that step is already saved), -EBUSY (another save holds the lock),
 * -EINVAL, -ENOMEM, or the errno of a failed system call (-ENOSPC: disk full; the
 * half-written ckpt-S.tmp/ is removed and earlier checkpoints stay intact).
 */
#ifndef DF_CKPT_H
#define DF_CKPT_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"
#include "hfconfig.h"
#include "params.h"

#define DF_CKPT_VERSION 1
#define DF_CKPT_MAX_BLOB (1u << 20)        /* bytes of rng_state / data_position */
#define DF_CKPT_MAX_HPARAMS (16u << 20)    /* bytes of hyperparameter JSON */

/* Everything an exact resume needs. For df_ckpt_save the pointers are the
 * caller's (read only); after a load they are malloc'd and owned by the state
 * (df_ckpt_state_free). */
typedef struct df_ckpt_state {
    int64_t step;                 /* >= 0: optimizer steps done */
    df_drafter_config config;
    int64_t n_floats;             /* params.total of config (checked on save) */
    float *master;                /* fp32 master weights, n_floats, params-table layout */
    float *adam_m;                /* AdamW first moment, n_floats */
    float *adam_v;                /* AdamW second moment, n_floats */
    void *rng_state;              /* opaque, rng_len <= DF_CKPT_MAX_BLOB bytes */
    size_t rng_len;
    void *data_position;          /* opaque (epoch, position in the order, ...) */
    size_t data_position_len;
    char *hparams_json;           /* JSON text (NUL-terminated) or NULL = none */
    char loaded_from[1024];       /* set by loads: the checkpoint directory */
} df_ckpt_state;

/* Saves st as RUN/ckpt-<step>/ (see above), creating run_dir when needed, then
 * keeps only the keep_last newest checkpoints (keep_last <= 0: keep all). */
int df_ckpt_save(const char *run_dir, const df_ckpt_state *st, int keep_last, df_err *e);

/* Loads the newest checkpoint of run_dir into *out (zeroed first; arrays
 * allocated). -ENOENT with a message when the run has none. */
int df_ckpt_load_latest(const char *run_dir, df_ckpt_state *out, df_err *e);

/* Loads one checkpoint directory (e.g. RUN/ckpt-0000001200). */
int df_ckpt_load(const char *ckpt_dir, df_ckpt_state *out, df_err *e);

void df_ckpt_state_free(df_ckpt_state *st);

typedef struct df_ckpt_info {
    int64_t step;
    char name[32];               /* "ckpt-0000001200" */
    int complete;                /* has its COMPLETE marker (not validated further) */
} df_ckpt_info;

/* The ckpt-<step> directories of run_dir, ascending by step (*out malloc'd,
 * free() it; *n may be 0). .tmp/.deleting directories are not listed. */
int df_ckpt_list(const char *run_dir, df_ckpt_info **out, int *n, df_err *e);

/* Removes all but the keep_last newest checkpoints (never the newest one). */
int df_ckpt_prune(const char *run_dir, int keep_last, df_err *e);

/* ---- Export for serving engines (docs/DRAFTER.md "Export") -------------------
 * OUT/config.json (df_drafter_config_to_json) and OUT/model.safetensors (every
 * params-table tensor, BF16 = round-to-nearest-even of master, no name prefix).
 * Written into OUT.dflash-export.tmp/ and moved into place as a whole: a new
 * OUT by rename(), an existing OUT (which must hold nothing but those two
 * files: other files are refused with -EEXIST rather than dropped) by an atomic
 * exchange (renameat2 RENAME_EXCHANGE), then the old files are removed; where the
 * file system lacks it, OUT is first renamed to OUT.dflash-export.old (a crash
 * then leaves OUT missing and the old export there, never a mix of the two).
 * Non-finite weights are refused (-EINVAL naming the tensor and index). */
int df_export_drafter(const char *out_dir, const df_drafter_config *c, const df_params *ps,
                      const float *master, df_err *e);

/* The same with one more small file in OUT (e.g. RUN/best's best.json), written
 * into the same temporary directory, so OUT holds the weights and that file of
 * one save or of the one before, never a mix; an existing OUT may hold that file
 * too. name: a plain file name other than the export's two. */
typedef struct df_export_extra {
    const char *name;
    const char *text;            /* NUL-terminated */
} df_export_extra;
int df_export_drafter_with(const char *out_dir, const df_drafter_config *c, const df_params *ps,
                           const float *master, const df_export_extra *extra, df_err *e);

/* Reads an export back (train/export_load.c): DIR/config.json (df_drafter_config_load:
 * the DFlash keys required, the serving keys checked where present) into *c, its
 * parameter table into *ps, and DIR/model.safetensors (or a sharded index) into
 * *master (malloc'd, ps->total floats, table layout; BF16/F16/F32 widened exactly).
 * Ours or a released DFlash drafter of the same names (SpecForge / z-lab). Every
 * tensor the config implies must be there with exactly its shape, and nothing else:
 * -DF_EMISMATCH naming the missing or extra tensor, or the tensor and both shapes;
 * -EINVAL for a non-finite weight (tensor and index); -ENOTSUP for another dtype;
 * the config's and the reader's errors otherwise. On error nothing is allocated. */
int df_export_load(const char *dir, df_drafter_config *c, df_params *ps, float **master,
                   df_err *e);

#endif
