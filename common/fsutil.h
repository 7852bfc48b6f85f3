/* fsutil.h - small, careful file helpers shared by every module. */
#ifndef DF_FSUTIL_H
#define DF_FSUTIL_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"

/* Reads a whole regular file into a malloc'd buffer (NUL-terminated for
 * convenience; *len excludes the NUL). max_len bounds what is accepted. */
int df_file_read_all(const char *path, size_t max_len, char **out, size_t *len, df_err *e);

/* Writes data to path atomically: path.tmp, fsync, rename, fsync of the
 * directory. Readers see the old file or the whole new one, never a part. */
int df_file_write_atomic(const char *path, const void *data, size_t len, df_err *e);

/* fsync() of the directory holding path (or of path when it is a directory). */
int df_fsync_dir(const char *dir, df_err *e);

/* mkdir -p. */
int df_mkdirs(const char *dir, df_err *e);

/* path join into out (size n); returns -ENAMETOOLONG when it does not fit. */
int df_path_join(char *out, size_t n, const char *dir, const char *name);

/* Seconds on a monotonic clock. */
double df_now(void);

#endif
