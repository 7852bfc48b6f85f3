/* schedule.c - linear warmup + cosine decay (see schedule.h). */
#include "schedule.h"

#include <errno.h>
#include <math.h>

int64_t df_lr_warmup_steps(int64_t total_steps, double warmup_frac)
{
    if (total_steps <= 0 || !(warmup_frac > 0))
        return 0;
    if (warmup_frac >= 1)
        return total_steps;
    double w = ceil(warmup_frac * (double)total_steps - 1e-9);
    if (w < 0)
        w = 0;
    return w > (double)total_steps ? total_steps : (int64_t)w;
}

int df_lr_schedule_validate(const df_lr_schedule *s, df_err *e)
{
    if (!(s->peak_lr > 0) || !isfinite(s->peak_lr))
        return df_errf(e, -EINVAL, "lr schedule: peak lr %g must be finite and > 0", s->peak_lr);
    if (!(s->min_lr >= 0) || s->min_lr > s->peak_lr)
        return df_errf(e, -EINVAL, "lr schedule: min lr %g must be in [0, peak %g]", s->min_lr,
                       s->peak_lr);
    if (s->total_steps < 1)
        return df_errf(e, -EINVAL, "lr schedule: total steps %lld must be >= 1",
                       (long long)s->total_steps);
    if (s->warmup_steps < 0 || s->warmup_steps > s->total_steps)
        return df_errf(e, -EINVAL, "lr schedule: warmup steps %lld outside [0, total %lld]",
                       (long long)s->warmup_steps, (long long)s->total_steps);
    return 0;
}

int df_lr_schedule_init(df_lr_schedule *s, double peak_lr, double min_lr, int64_t total_steps,
                        double warmup_frac, df_err *e)
{
    if (!(warmup_frac >= 0 && warmup_frac <= 1))
        return df_errf(e, -EINVAL, "lr schedule: warmup fraction %g outside [0, 1]", warmup_frac);
    s->peak_lr = peak_lr;
    s->min_lr = min_lr;
    s->total_steps = total_steps;
    s->warmup_steps = df_lr_warmup_steps(total_steps, warmup_frac);
    return df_lr_schedule_validate(s, e);
}

double df_lr_at(const df_lr_schedule *s, int64_t step)
{
    if (step < 0)
        return 0.0;
    if (step < s->warmup_steps)
        return s->peak_lr * (double)(step + 1) / (double)s->warmup_steps;
    if (step >= s->total_steps)
        return s->min_lr;
    double progress = (double)(step - s->warmup_steps) / (double)(s->total_steps - s->warmup_steps);
    return s->min_lr + (s->peak_lr - s->min_lr) * 0.5 * (1.0 + cos(3.14159265358979323846 * progress));
}
