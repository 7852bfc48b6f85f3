/* best.h - RUN/best/: the export of the step with the best evaluation.
 *
 * When `dflash train` evaluates (--eval-cache), rank 0 compares each
 * evaluation's score with the best so far and, when it is strictly higher,
 * writes RUN/best/ as one export (df_export_drafter_with: a temporary
 * directory, fsynced files, then a rename or an atomic exchange, fsync of RUN):
 *
 *   RUN/best/config.json, model.safetensors   the export of that step (what
 *                                             RUN/export would have held then)
 *   RUN/best/best.json                        {"format": "dflash-best",
 *       "version": 1, "step", "metric" ("eval_tau_walk", or "eval_tau_hat" with
 *       --no-eval-walk), "value", "eval_tau_walk" (when walked), "eval_tau_hat",
 *       "eval_loss", "eval_rows", "eval_blocks", "eval_cache" (the path given)}
 *
 * The score is the one of the evaluation's metric; ties keep the earlier step.
 * best.json is the record of the best so far: a resumed run reads it back
 * (values are written with 17 significant digits, so a re-evaluation of the
 * same weights ties exactly) and only a higher score replaces it. A best of
 * another evaluation (another metric, eval cache path or row count) is not
 * comparable: the run says so and its next evaluation replaces it.
 * `dflash export --run RUN --best --out DIR` exports it (cli/cmd_export.c).
 */
#ifndef DF_BEST_H
#define DF_BEST_H

#include <stdint.h>

#include "err.h"

#define DF_BEST_DIR "best"
#define DF_BEST_JSON "best.json"

typedef struct df_best {
    int64_t step;
    char metric[32];          /* "eval_tau_walk" or "eval_tau_hat" */
    double value;             /* that metric's value */
    int walked;               /* tau_walk was measured */
    double tau_walk, tau_hat, loss;
    int rows;
    uint64_t blocks;
    char eval_cache[1024];
} df_best;

/* RUN/best/best.json into *b: 0, -ENOENT when the run has none (a message
 * naming RUN), -DF_ECORRUPT naming the file and the key when it is not one
 * we wrote, or the read's error. */
int df_best_load(const char *run_dir, df_best *b, df_err *e);

/* best.json's text (malloc'd, NUL-terminated), NULL when out of memory. */
char *df_best_json(const df_best *b);

#endif
