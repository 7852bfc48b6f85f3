/* opt.h - numeric command-line option values, parsed once, checked against a range.
 *
 * Every CLI command parses its numbers through these, so "--steps 2.5", "--seed -1",
 * "--gamma nan", "--threads 100000" or "--lr 1e-3x" are refused the same way: a
 * negative errno-style code and a df_err message naming the option, the value and
 * the allowed range ("--steps '2.5': want an integer in 1..9223372036854775807").
 * The caller (a command's option loop) prints it and exits with the usage status 2.
 */
#ifndef DF_OPT_H
#define DF_OPT_H

#include <stdint.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

/* An integer in [min, max]: decimal digits with an optional sign, or a number in
 * floating-point notation that is exactly an integer ("1e6", "4096.0"); anything
 * else (trailing junk, "2.5", nan, out of range) is -EINVAL. *out is untouched on error. */
int df_opt_i64(const char *name, const char *text, int64_t min, int64_t max, int64_t *out,
               df_err *e);
int df_opt_int(const char *name, const char *text, int min, int max, int *out, df_err *e);
/* The same for unsigned 64-bit values (seeds): the whole of 0..UINT64_MAX reachable. */
int df_opt_u64(const char *name, const char *text, uint64_t min, uint64_t max, uint64_t *out,
               df_err *e);
/* A finite real number in [min, max] (nan and inf are always refused). */
int df_opt_double(const char *name, const char *text, double min, double max, double *out,
                  df_err *e);
/* df_opt_i64 (integer != 0; the value as a double) or df_opt_double over [min, max]. */
int df_opt_number(const char *name, const char *text, double min, double max, int integer,
                  double *out, df_err *e);

#ifdef __cplusplus
}
#endif
#endif
