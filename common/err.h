/* err.h - the project's error convention.
 *
 * Library functions never exit(). They return a negative errno-style code
 * (-EINVAL, -EIO, -ENOMEM, ...) and, when the caller passes a df_err, fill it
 * with a one-line message that names the file, the offset and/or the sample
 * involved. Only main() decides what to do with an error.
 */
#ifndef DF_ERR_H
#define DF_ERR_H

#include <errno.h>
#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Extra codes beyond errno, kept negative and out of errno's range. */
enum {
    DF_ECORRUPT = 1001, /* checksum mismatch, bad magic, lying size */
    DF_EVERSION = 1002, /* unknown format version */
    DF_EMISMATCH = 1003 /* cache/config/layers do not match what was asked */
};

typedef struct df_err {
    int code;       /* negative, as returned */
    char msg[512];  /* human-readable, names file/offset/sample */
} df_err;

/* Sets e->code = code and formats e->msg (printf-style). Returns code, so
 * `return df_errf(e, -EINVAL, "...")` is the idiom. e may be NULL. */
int df_errf(df_err *e, int code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* Prefixes an existing message with more context ("reading X: " + msg). */
int df_err_wrap(df_err *e, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));

/* Short name of a code: strerror() for errno values, our names otherwise. */
const char *df_strerror(int code);

#ifdef __cplusplus
}
#endif
#endif
