/* settings.h - the settings that define a training run, kept in its checkpoints'
 * hparams.json and compared when the run resumes.
 *
 * hparams.json is a JSON object; besides --init-from's keys (init_from.h) it holds
 * "settings": {"--lr": 0.003, "--seed": "1", ...}, one entry per option (named as on
 * the command line) whose value changes what the run computes: the optimizer and its
 * schedule, the data (cache identity, row and anchor sizes, seeds, gamma, noise), the
 * drafter's shape, --steps. Seeds are strings (64-bit integers, exactly). Options that
 * do not change the math (threads, devices' overlap and recompute, log and checkpoint
 * cadence, evaluation, --quiet) are not in it.
 *
 * On resume every stored setting must equal this command's: a difference is refused
 * naming each setting with both values, except a larger --steps (the run is extended:
 * the schedule is recomputed over the new total; said in the log). A checkpoint
 * without "settings" (written before they were recorded) resumes with a warning.
 */
#ifndef DF_SETTINGS_H
#define DF_SETTINGS_H

#include "cache.h"
#include "err.h"
#include "hfconfig.h"
#include "train.h"

/* The hparams.json text of a run: base's keys (a stored hparams.json or --init-from's,
 * NULL or "" = none) with "settings" set to those of o (its effective drafter config c
 * and training cache cp). malloc'd (free()), NULL when out of memory. */
char *df_run_settings_json(const char *base, const df_train_opts *o, const df_drafter_config *c,
                           const df_cache_params *cp);

/* Compares the settings of a checkpoint's hparams.json (had) with this command's (now,
 * from df_run_settings_json). 0 when they agree (*extended_from = the stored --steps when
 * --steps grew, else 0; *unchecked = 1 when had holds no settings); -DF_EMISMATCH naming
 * every differing setting with both values (ckpt_dir: the checkpoint, for the message). */
int df_run_settings_check(const char *ckpt_dir, const char *had, const char *now,
                          int64_t *extended_from, int *unchecked, df_err *e);

#endif
