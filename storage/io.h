/* io.h - the asynchronous I/O engine under the cache writer and reader.
 *
 * Two backends behind one interface:
 *   - io_uring (liburing): registered buffers when given, many requests in
 *     flight, no SQPOLL/IOPOLL (virtio disks gain nothing from them);
 *   - a pread/pwrite thread pool, used when io_uring cannot be set up for ANY
 *     reason (EPERM under Docker seccomp or io_uring_disabled, ENOSYS, ENOMEM,
 *     a kernel without the opcodes we use, ...), or when forced by
 *     opts->force_fallback or DFLASH_IO=threads. io_uring is probed once per
 *     process and the verdict cached; the switch is logged once (warn).
 *     DFLASH_IO=uring forces io_uring: its setup failure is then an error.
 *     DFLASH_IO unset, "" or "auto": probe. Any other value: -EINVAL. The
 *     knob is read once per process (knobs.h; df_knob_set switches it).
 *     opts->force_fallback beats DFLASH_IO=uring (the code asked explicitly).
 *
 * Completion semantics, identical on both backends:
 *   - every request completes fully: short reads/writes are reissued for the
 *     remainder; a read that hits end of file completes with the bytes read
 *     (0 at or past EOF). A short O_DIRECT read ending at an unaligned EOF is
 *     recognised as EOF (fstat), not reissued at an unaligned offset;
 *   - EINTR/EAGAIN are retried (EAGAIN after waiting for readiness: no spin);
 *   - on io_uring a request failing with EOPNOTSUPP/EINVAL is retried once
 *     with plain pread/pwrite/fsync, synchronously inside df_io_wait;
 *   - any other error completes the request with res = -errno, even when
 *     part of it was transferred (a write that hits RLIMIT_FSIZE midway gives
 *     -EFBIG; what reached the file is unspecified);
 *   - a write the kernel accepts with 0 bytes (len > 0) completes with -EIO
 *     rather than looping;
 *   - an unaligned O_DIRECT request is NOT bounce-buffered: it completes with
 *     the kernel's verdict (-EINVAL on ext4/xfs; some file systems such as
 *     btrfs quietly fall back to buffered I/O and succeed);
 *   - a bad fd gives a completion with -EBADF, not a submit error.
 * Requests are unordered: an fsync covers only writes that had completed
 * (been reaped) before it was queued. Wait for the writes, then fsync.
 *
 * io_uring batches: requests are handed to the kernel by df_io_submit() or
 * df_io_wait(), not by df_io_read/write/fsync. The thread pool may start a
 * request as soon as it is queued.
 *
 * An engine belongs to one thread: submit and wait from the same thread.
 * Buffers and offsets of O_DIRECT files must be aligned (df_io_align()).
 * Buffers must stay valid until their completion has been reaped.
 */
#ifndef DF_IO_H
#define DF_IO_H

#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "err.h"

typedef struct df_io df_io;

typedef struct df_io_opts {
    unsigned queue_depth; /* max requests in flight; 0 = 32; at most 32768 */
    int force_fallback;   /* 1: use the thread pool even if io_uring works */
    int nthreads;         /* fallback pool threads; 0 = queue_depth capped at 16 */
} df_io_opts;

typedef struct df_io_cqe {
    uint64_t tag; /* the caller's tag from submit */
    int64_t res;  /* bytes transferred (whole request unless EOF), or -errno */
} df_io_cqe;

/* opts may be NULL (defaults). Returns NULL with e filled on failure. */
df_io *df_io_open(const df_io_opts *opts, df_err *e);
/* Waits for requests in flight (submitting queued ones), drops unreaped
 * completions, frees the engine. NULL is a no-op. */
void df_io_close(df_io *io);

/* "io_uring" or "threads". */
const char *df_io_backend(const df_io *io);

/* Registers buffers for fixed-buffer I/O (io_uring); a no-op for the thread
 * pool. buf_index in submit calls refers to this table (-1: not registered).
 * A registration failure is not an error: requests then use plain buffers.
 * Replaces any earlier table; n = 0 clears it. Returns 1 when the kernel
 * took the buffers, 0 when requests will use plain buffers (thread pool,
 * RLIMIT_MEMLOCK, ...), -EBUSY while requests are in flight (the kernel
 * cannot swap the table under them), -EINVAL for iov == NULL with n > 0,
 * -ENOMEM. The table is kept on both backends, so indices stay valid. */
int df_io_register_buffers(df_io *io, const struct iovec *iov, unsigned n);

/* Queue a request. Returns 0, -EBUSY when queue_depth requests are already in
 * flight (completed but not yet reaped ones count: reap with df_io_wait
 * first), -EINVAL for a NULL buffer, an offset + len beyond INT64_MAX, or a
 * buf_index >= the registered count. buf_index >= 0 uses READ_FIXED/
 * WRITE_FIXED when [buf, buf+len) lies inside that registered buffer, else
 * a plain read/write. len == 0 completes at once with res 0. Errors of the
 * I/O itself (EBADF, EIO, ...) arrive in the completion, never here. */
int df_io_read(df_io *io, int fd, void *buf, size_t len, uint64_t off, uint64_t tag, int buf_index);
int df_io_write(df_io *io, int fd, const void *buf, size_t len, uint64_t off, uint64_t tag,
                int buf_index);
int df_io_fsync(df_io *io, int fd, uint64_t tag);

/* Submits what is queued and reaps completions: waits until at least min
 * (capped at the number in flight and at max) are done, returns how many were
 * written to out (at most max), or a negative code. Completions beyond max
 * stay for the next call. min = 0 submits and collects what is ready without
 * blocking. Blocks in the kernel or on a condvar, never spins. */
int df_io_wait(df_io *io, df_io_cqe *out, unsigned max, unsigned min);

/* Hands queued requests to the kernel now, without waiting (df_io_wait does
 * this too). Call it before long CPU work so the I/O overlaps that work.
 * Returns how many were handed over (0 on the thread pool, which needs no
 * submit), or a negative code. */
int df_io_submit(df_io *io);

/* Largest single read/write the engine issues (default and maximum 1 GiB;
 * io_uring lengths are 32-bit and the kernel caps one transfer near 2 GiB).
 * Larger requests go out in pieces, through the same path as a short
 * transfer, so tests set a small value to exercise it. Keep it a multiple of
 * df_io_align() on O_DIRECT files. 0 restores the default. Applies to
 * requests queued after the call. */
void df_io_set_max_op(df_io *io, size_t bytes);

/* Requests queued and not yet reaped (in the kernel, in the pool, or done
 * and waiting for df_io_wait); and the queue_depth in use. */
unsigned df_io_inflight(const df_io *io);
unsigned df_io_depth(const df_io *io);

/* Opens path with O_DIRECT when asked and the file system allows it; falls
 * back to buffered I/O (logged once per process, info) when open refuses
 * O_DIRECT with EINVAL. *direct (may be NULL) tells which. flags as for
 * open(2), without O_DIRECT (stripped if given); O_CLOEXEC is always added.
 * Returns the fd, or a negative code with a message naming path. */
int df_io_open_file(const char *path, int flags, int mode, int want_direct, int *direct,
                    df_err *e);

/* Alignment O_DIRECT needs for buffers, offsets and sizes on fd: the larger
 * of statx STATX_DIOALIGN's memory and offset alignments where the kernel
 * reports them (6.1+, file systems that support direct I/O), else 4096. */
size_t df_io_align(int fd);

/* Page-aligned allocation (4096) of at least len bytes; free with free(). */
void *df_io_alloc(size_t len);

#endif
