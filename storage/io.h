/* io.h - the asynchronous I/O engine under the cache writer and reader.
 *
 * Two backends behind one interface:
 *   - io_uring (liburing): registered buffers when given, many requests in
 *     flight, no SQPOLL/IOPOLL (virtio disks gain nothing from them);
 *   - a pread/pwrite thread pool, used when io_uring cannot be set up for ANY
 *     reason (EPERM under Docker seccomp or io_uring_disabled, ENOSYS, ...),
 *     or when forced by opts->force_fallback or DFLASH_IO=threads. The switch
 *     is logged once.
 * Both complete every request fully: short reads/writes are resubmitted for
 * the remainder; a read that hits end of file completes with the bytes read.
 * On io_uring a request failing with EOPNOTSUPP/EINVAL is retried once with
 * plain pread/pwrite.
 *
 * An engine belongs to one thread: submit and wait from the same thread.
 * Buffers and offsets of O_DIRECT files must be aligned (df_io_align()).
 */
#ifndef DF_IO_H
#define DF_IO_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "err.h"

typedef struct df_io df_io;

typedef struct df_io_opts {
    unsigned queue_depth; /* max requests in flight; 0 = 32 */
    int force_fallback;   /* 1: use the thread pool even if io_uring works */
    int nthreads;         /* fallback pool threads; 0 = queue_depth capped at 16 */
} df_io_opts;

typedef struct df_io_cqe {
    uint64_t tag; /* the caller's tag from submit */
    int64_t res;  /* bytes transferred (whole request unless EOF), or -errno */
} df_io_cqe;

df_io *df_io_open(const df_io_opts *opts, df_err *e);
void df_io_close(df_io *io); /* waits for requests in flight */

/* "io_uring" or "threads". */
const char *df_io_backend(const df_io *io);

/* Registers buffers for fixed-buffer I/O (io_uring); a no-op for the thread
 * pool. buf_index in submit calls refers to this table (-1: not registered).
 * A registration failure is not an error: requests then use plain buffers. */
int df_io_register_buffers(df_io *io, const struct iovec *iov, unsigned n);

/* Queue a request. Returns 0, -EBUSY when queue_depth requests are already in
 * flight (reap with df_io_wait first), or another negative code. */
int df_io_read(df_io *io, int fd, void *buf, size_t len, uint64_t off, uint64_t tag, int buf_index);
int df_io_write(df_io *io, int fd, const void *buf, size_t len, uint64_t off, uint64_t tag,
                int buf_index);
int df_io_fsync(df_io *io, int fd, uint64_t tag);

/* Submits what is queued and reaps completions: waits until at least min
 * (capped at the number in flight) are done, returns how many were written
 * to out (at most max), or a negative code. */
int df_io_wait(df_io *io, df_io_cqe *out, unsigned max, unsigned min);

unsigned df_io_inflight(const df_io *io);
unsigned df_io_depth(const df_io *io);

/* Opens path with O_DIRECT when asked and the file system allows it; falls
 * back to buffered I/O (logged once per process) when O_DIRECT is refused.
 * *direct tells which. flags as for open(2), without O_DIRECT. */
int df_io_open_file(const char *path, int flags, int mode, int want_direct, int *direct,
                    df_err *e);

/* Alignment O_DIRECT needs for buffers, offsets and sizes on fd (statx
 * STATX_DIOALIGN where the kernel reports it, else 4096). */
size_t df_io_align(int fd);

/* Page-aligned allocation (4096) of at least len bytes; free with free(). */
void *df_io_alloc(size_t len);

#endif
