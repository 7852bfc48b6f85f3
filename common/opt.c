/* opt.c - numeric option values with ranges (opt.h). */
#include "opt.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* strtod over the whole of s, finite; 0 on success. Leading blanks (which strtod
 * skips) are refused too, so that " 5" is not silently accepted, and hexadecimal
 * ("0x10", which strtod reads) since no option is meant to take it. */
static int whole_double(const char *s, double *v)
{
    char *end;
    if (!s || !*s || *s == ' ' || *s == '\t' || *s == '\n' || strpbrk(s, "xX"))
        return -1;
    errno = 0;
    double x = strtod(s, &end);
    if (end == s || *end || !isfinite(x))
        return -1;
    *v = x;
    return 0;
}

/* The integer in s (decimal, or a float notation that is an exact integer below 2^63
 * in magnitude); 0 on success, -ERANGE when it is an integer out of int64's range. */
static int whole_i64(const char *s, int64_t *v)
{
    char *end;
    if (!s || !*s || *s == ' ' || *s == '\t' || *s == '\n')
        return -EINVAL;
    errno = 0;
    long long x = strtoll(s, &end, 10);
    if (end != s && !*end) {
        if (errno == ERANGE)
            return -ERANGE;
        *v = x;
        return 0;
    }
    double d;
    if (whole_double(s, &d) || d != floor(d))
        return -EINVAL;
    if (d >= 9223372036854775808.0 || d < -9223372036854775808.0)
        return -ERANGE;
    *v = (int64_t)d;
    return 0;
}

int df_opt_i64(const char *name, const char *text, int64_t min, int64_t max, int64_t *out,
               df_err *e)
{
    int64_t v = 0;
    if (whole_i64(text, &v) || v < min || v > max)
        return df_errf(e, -EINVAL, "%s '%s': want an integer in %" PRId64 "..%" PRId64, name,
                       text ? text : "", min, max);
    *out = v;
    return 0;
}

int df_opt_int(const char *name, const char *text, int min, int max, int *out, df_err *e)
{
    int64_t v = 0;
    int rc = df_opt_i64(name, text, min, max, &v, e);
    if (rc)
        return rc;
    *out = (int)v;
    return 0;
}

int df_opt_u64(const char *name, const char *text, uint64_t min, uint64_t max, uint64_t *out,
               df_err *e)
{
    char *end;
    uint64_t v = 0;
    int ok = 0;
    if (text && *text >= '0' && *text <= '9') {
        errno = 0;
        unsigned long long x = strtoull(text, &end, 10);
        if (!*end && errno != ERANGE) {
            v = x;
            ok = 1;
        } else if (*end) { /* "1e6": float notation of an exact integer */
            double d;
            if (!whole_double(text, &d) && d == floor(d) && d >= 0 && d < 18446744073709551616.0) {
                v = (uint64_t)d;
                ok = 1;
            }
        }
    }
    if (!ok || v < min || v > max)
        return df_errf(e, -EINVAL, "%s '%s': want an integer in %" PRIu64 "..%" PRIu64, name,
                       text ? text : "", min, max);
    *out = v;
    return 0;
}

int df_opt_double(const char *name, const char *text, double min, double max, double *out,
                  df_err *e)
{
    double v = 0;
    if (whole_double(text, &v) || !(v >= min && v <= max))
        return df_errf(e, -EINVAL, "%s '%s': want a finite number in [%g, %g]", name,
                       text ? text : "", min, max);
    *out = v;
    return 0;
}

int df_opt_number(const char *name, const char *text, double min, double max, int integer,
                  double *out, df_err *e)
{
    int64_t i = 0;
    if (!integer)
        return df_opt_double(name, text, min, max, out, e);
    int rc = df_opt_i64(name, text, (int64_t)min, (int64_t)max, &i, e);
    if (!rc)
        *out = (double)i;
    return rc;
}
