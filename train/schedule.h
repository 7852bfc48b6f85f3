/* schedule.h - the learning-rate schedule: linear warmup, then cosine decay.
 *
 * docs/DRAFTER.md "Training defaults": peak 6e-4, warmup 4% of the steps, cosine to 0.
 * Steps are 0-based optimizer steps (the step whose update uses the LR).
 *
 *   W = warmup_steps, T = total_steps, P = peak_lr, M = min_lr
 *   step < 0            : 0
 *   0 <= step < W       : P * (step + 1) / W        (step 0 already learns; step W-1 is at P)
 *   W <= step < T       : M + (P - M) * 0.5 * (1 + cos(pi * (step - W) / (T - W)))
 *                         (step W is at P; the last step T-1 is just above M)
 *   step >= T           : M
 *
 * The cosine part is HF get_cosine_schedule_with_warmup's (num_cycles 0.5)
 * with a floor M; the warmup starts at P/W instead of 0 so no step is wasted.
 * Pure functions of the struct: the LR of a step does not depend on history,
 * so a resumed run gets exactly the LRs of an uninterrupted one.
 */
#ifndef DF_SCHEDULE_H
#define DF_SCHEDULE_H

#include <stdint.h>

#include "err.h"

typedef struct df_lr_schedule {
    double peak_lr;
    double min_lr;          /* 0 <= min_lr <= peak_lr */
    int64_t warmup_steps;   /* 0 <= warmup_steps <= total_steps */
    int64_t total_steps;    /* >= 1 */
} df_lr_schedule;

/* Warmup steps for a fraction of the run: ceil(frac * total), like HF's
 * warmup_ratio (with a 1e-9 slack so 0.07 * 100 gives 7, not 8). */
int64_t df_lr_warmup_steps(int64_t total_steps, double warmup_frac);

/* Fills s (warmup = df_lr_warmup_steps(total, warmup_frac)) and validates.
 * -EINVAL with a message naming the bad value. */
int df_lr_schedule_init(df_lr_schedule *s, double peak_lr, double min_lr, int64_t total_steps,
                        double warmup_frac, df_err *e);

/* Checks a filled-in struct (peak > 0 and finite, 0 <= min <= peak, ranges). */
int df_lr_schedule_validate(const df_lr_schedule *s, df_err *e);

/* The LR of a step (see the table above). */
double df_lr_at(const df_lr_schedule *s, int64_t step);

#endif
