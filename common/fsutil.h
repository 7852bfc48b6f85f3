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

/* df_file_write_atomic for a file whose presence is a promise (a cache's
 * manifest.json: "every file it names is durable"): when the directory fsync
 * after the rename fails the file is unlinked again and the error returned,
 * so a failure never leaves it in place. fault: a df_fault point that fakes
 * that fsync's failure in tests (NULL: none). */
int df_file_publish(const char *path, const void *data, size_t len, const char *fault, df_err *e);

/* fsync() of the directory holding path (or of path when it is a directory). */
int df_fsync_dir(const char *dir, df_err *e);

/* mkdir -p. */
int df_mkdirs(const char *dir, df_err *e);

/* path join into out (size n); returns -ENAMETOOLONG when it does not fit. */
int df_path_join(char *out, size_t n, const char *dir, const char *name);

/* open(2) that refuses anything but a regular file, naming path: a FIFO,
 * device or directory where a data file belongs would block forever (a FIFO
 * open waits for a peer) or read garbage. The open itself is O_NONBLOCK so a
 * FIFO cannot block it; the flag is cleared again before returning. flags as
 * for open (O_CLOEXEC is added); with O_CREAT a new file is regular. Returns
 * the fd, or a negative errno-style code (-EINVAL for a non-regular file). */
int df_open_regular(const char *path, int flags, int mode, df_err *e);

/* Test-only fault injection: the errno to fake at the named point, or 0.
 * DFLASH_FAULT (read once per process) is a comma-separated list of
 * point=ERRNO items, ERRNO one of EIO, ENOSPC (e.g.
 * DFLASH_FAULT=cache-final-dirsync=EIO). Points: cache-final-dirsync (the
 * directory fsync after manifest.json's rename), log-write (train's
 * log.jsonl), cache-shard-write (the cache writer's shard 1: a write failure
 * reported to the drain just before the shard would be published). Unset in normal runs: a cached "nothing". */
int df_fault(const char *point);

/* Seconds on a monotonic clock. */
double df_now(void);

#endif
