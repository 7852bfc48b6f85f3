/* io.c - the asynchronous I/O engine: io_uring, or a pread/pwrite thread pool.
 *
 * Both backends share the request table and the completion semantics (see
 * io.h). A request lives in one of queue_depth slots from submit until the
 * caller reaps its completion; the slot remembers how much is done, so short
 * transfers, EINTR/EAGAIN and the synchronous EINVAL/EOPNOTSUPP retry all
 * continue from where the kernel stopped.
 */
#include "io.h"

#include <fcntl.h>
#include <limits.h>
#include <liburing.h>
#include <poll.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "knobs.h"
#include "log.h"

/* Older headers lack the direct-I/O alignment query (Linux 6.1). The kernel
 * ABI of struct statx is fixed: the two fields sit at 0x98 and 0x9c. */
#ifndef STATX_DIOALIGN
#define STATX_DIOALIGN 0x00002000U
#define DF_STATX_NO_DIO_FIELDS 1
#endif

enum { OP_READ, OP_WRITE, OP_FSYNC };
enum { SLOT_FREE, SLOT_BUSY, SLOT_DONE };

#define DEFAULT_DEPTH 32u
#define MAX_DEPTH 32768u
#define DEFAULT_MAX_OP ((size_t)1 << 30)
/* A file that keeps answering EAGAIN after this many readiness waits is
 * reported rather than retried forever. */
#define MAX_AGAIN 1000u
/* user_data bit marking a readiness poll (EAGAIN) rather than the I/O. */
#define POLL_BIT ((uint64_t)1 << 32)

typedef struct req {
    int op;
    int fd;
    char *buf;
    size_t len;
    size_t done;  /* bytes transferred so far */
    size_t asked; /* bytes in the piece now in the kernel */
    size_t max_op; /* copied at submit: workers read it without the lock */
    uint64_t off;
    uint64_t tag;
    int buf_index; /* -1, or a registered buffer that holds the whole request */
    int state;
    int sync_tried;
    unsigned again;
    int64_t res;
} req;

struct df_io {
    int uring;
    unsigned depth;
    size_t max_op;
    req *reqs;
    unsigned *freelist; /* owner thread only */
    unsigned nfree;
    unsigned *doneq; /* FIFO of completed slots; under mu on the thread pool */
    unsigned done_head, done_n;
    struct iovec *bufs; /* caller's table, kept for the inside-buffer check */
    unsigned nbufs;
    int bufs_registered;

    struct io_uring ring;

    pthread_t *threads;
    int nthreads;
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    unsigned *workq; /* FIFO of slots for the workers */
    unsigned work_head, work_n;
    unsigned busy; /* slots handed to workers and not yet done (under mu) */
    int stop;
};

/* ---- shared helpers ------------------------------------------------------ */

static size_t piece(const req *r)
{
    size_t n = r->len - r->done;
    return n > r->max_op ? r->max_op : n;
}

/* After a short read: is pos at or past the end of a regular file? An
 * O_DIRECT read stops at an unaligned EOF, and reissuing the remainder there
 * would fail with EINVAL, so a short read is checked before it is reissued. */
static int at_eof(int fd, uint64_t pos)
{
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode))
        return 0;
    return pos >= (uint64_t)st.st_size;
}

/* Waits until fd is ready for r's direction, for EAGAIN from a file opened
 * O_NONBLOCK: a blocking poll instead of a retry loop that would spin. */
static void wait_ready(const req *r)
{
    struct pollfd p = {.fd = r->fd, .events = r->op == OP_READ ? POLLIN : POLLOUT};
    while (poll(&p, 1, -1) < 0 && errno == EINTR) {
    }
}

/* Does the rest of r with plain syscalls; returns the final res. Used by the
 * pool's workers and by io_uring's one synchronous retry. */
static int64_t sync_rw(req *r)
{
    if (r->op == OP_FSYNC) {
        while (fsync(r->fd) != 0) {
            if (errno != EINTR)
                return -errno;
        }
        return 0;
    }
    while (r->done < r->len) {
        size_t n = piece(r);
        off_t pos = (off_t)(r->off + r->done);
        ssize_t k = r->op == OP_READ ? pread(r->fd, r->buf + r->done, n, pos)
                                     : pwrite(r->fd, r->buf + r->done, n, pos);
        if (k < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN && ++r->again <= MAX_AGAIN) {
                wait_ready(r);
                continue;
            }
            return -errno;
        }
        r->again = 0;
        if (k == 0)
            return r->op == OP_READ ? (int64_t)r->done : -EIO;
        r->done += (size_t)k;
        if (r->op == OP_READ && (size_t)k < n && at_eof(r->fd, r->off + r->done))
            break;
    }
    return (int64_t)r->done;
}

/* Puts a finished slot on the completion FIFO (caller holds mu on the pool). */
static void finish(df_io *io, req *r, int64_t res)
{
    r->res = res;
    r->state = SLOT_DONE;
    io->doneq[(io->done_head + io->done_n) % io->depth] = (unsigned)(r - io->reqs);
    io->done_n++;
}

/* ---- backend choice ------------------------------------------------------ */

/* The once-per-process probe: 0 unknown, 1 io_uring works, -1 it does not. */
static pthread_mutex_t g_probe_mu = PTHREAD_MUTEX_INITIALIZER;
static int g_verdict;
static int g_fallback_logged;

static void log_fallback(int rc, const char *what, unsigned nthreads)
{
    pthread_mutex_lock(&g_probe_mu);
    int first = !g_fallback_logged;
    g_fallback_logged = 1;
    pthread_mutex_unlock(&g_probe_mu);
    df_log(first ? DF_LOG_WARN : DF_LOG_DEBUG,
           "io_uring unavailable (%s: %s); using %u pread/pwrite threads", what,
           df_strerror(rc), nthreads);
}

/* Creates io->ring and, the first time, checks the opcodes we rely on (a
 * pre-5.6 kernel sets up rings but lacks IORING_OP_READ/WRITE). *what names
 * the step that failed. */
static int ring_setup(df_io *io, int check_ops, const char **what)
{
    *what = "io_uring_queue_init";
    int rc = io_uring_queue_init(io->depth, &io->ring, 0);
    if (rc < 0)
        return rc;
    if (check_ops) {
        *what = "io_uring probe";
        struct io_uring_probe *p = io_uring_get_probe_ring(&io->ring);
        static const int ops[] = {IORING_OP_READ, IORING_OP_WRITE, IORING_OP_READ_FIXED,
                                  IORING_OP_WRITE_FIXED, IORING_OP_FSYNC, IORING_OP_POLL_ADD};
        rc = p ? 0 : -EOPNOTSUPP;
        for (size_t i = 0; p && i < sizeof ops / sizeof ops[0]; i++)
            if (!io_uring_opcode_supported(p, ops[i]))
                rc = -EOPNOTSUPP;
        if (p)
            io_uring_free_probe(p);
        if (rc < 0) {
            io_uring_queue_exit(&io->ring);
            return rc;
        }
    }
    return 0;
}

static void *worker(void *arg);

static int pool_start(df_io *io, int nthreads, df_err *e)
{
    io->workq = calloc(io->depth, sizeof *io->workq);
    io->threads = calloc((size_t)nthreads, sizeof *io->threads);
    if (!io->workq || !io->threads)
        return df_errf(e, -ENOMEM, "I/O thread pool: out of memory");
    for (int i = 0; i < nthreads; i++) {
        int rc = pthread_create(&io->threads[i], NULL, worker, io);
        if (rc != 0) {
            df_errf(e, -rc, "I/O thread pool: pthread_create: %s", strerror(rc));
            pthread_mutex_lock(&io->mu);
            io->stop = 1;
            pthread_cond_broadcast(&io->work_cv);
            pthread_mutex_unlock(&io->mu);
            for (int j = 0; j < i; j++)
                pthread_join(io->threads[j], NULL);
            return -rc;
        }
        io->nthreads = i + 1;
    }
    return 0;
}

static void io_free(df_io *io)
{
    pthread_mutex_destroy(&io->mu);
    pthread_cond_destroy(&io->work_cv);
    pthread_cond_destroy(&io->done_cv);
    free(io->reqs);
    free(io->freelist);
    free(io->doneq);
    free(io->bufs);
    free(io->workq);
    free(io->threads);
    free(io);
}

df_io *df_io_open(const df_io_opts *opts, df_err *e)
{
    df_io_opts o = {0};
    if (opts)
        o = *opts;
    if (o.queue_depth == 0)
        o.queue_depth = DEFAULT_DEPTH;
    if (o.queue_depth > MAX_DEPTH || o.nthreads < 0) {
        df_errf(e, -EINVAL, "I/O engine: queue_depth %u (max %u) / nthreads %d out of range",
                o.queue_depth, MAX_DEPTH, o.nthreads);
        return NULL;
    }
    int nthreads = o.nthreads ? o.nthreads : (int)(o.queue_depth < 16 ? o.queue_depth : 16);

    /* DFLASH_IO's choices in knobs.h's order; a bad value is this open's
     * error. Tests and tools switch it between engines with df_knob_set. */
    enum { AUTO, URING, THREADS };
    if (df_knob_check(DF_KNOB_IO, e))
        return NULL;
    int mode = df_knob_int(DF_KNOB_IO);
    if (o.force_fallback)
        mode = THREADS;

    df_io *io = calloc(1, sizeof *io);
    if (!io) {
        df_errf(e, -ENOMEM, "I/O engine: out of memory");
        return NULL;
    }
    io->depth = o.queue_depth;
    io->max_op = DEFAULT_MAX_OP;
    pthread_mutex_init(&io->mu, NULL);
    pthread_cond_init(&io->work_cv, NULL);
    pthread_cond_init(&io->done_cv, NULL);
    io->reqs = calloc(io->depth, sizeof *io->reqs);
    io->freelist = calloc(io->depth, sizeof *io->freelist);
    io->doneq = calloc(io->depth, sizeof *io->doneq);
    if (!io->reqs || !io->freelist || !io->doneq) {
        df_errf(e, -ENOMEM, "I/O engine: out of memory for %u slots", io->depth);
        io_free(io);
        return NULL;
    }
    for (unsigned i = 0; i < io->depth; i++)
        io->freelist[i] = io->depth - 1 - i;
    io->nfree = io->depth;

    const char *what = "";
    int rc = 0;
    if (mode == URING) {
        rc = ring_setup(io, 1, &what);
        if (rc < 0) {
            df_errf(e, rc, "DFLASH_IO=uring but io_uring cannot be used (%s: %s)", what,
                    df_strerror(rc));
            io_free(io);
            return NULL;
        }
        io->uring = 1;
    } else if (mode == AUTO) {
        /* The lock makes the first probe happen exactly once even when
         * several threads open engines at the same time. */
        pthread_mutex_lock(&g_probe_mu);
        int verdict = g_verdict;
        if (verdict >= 0) {
            rc = ring_setup(io, verdict == 0, &what);
            if (verdict == 0)
                g_verdict = rc < 0 ? -1 : 1;
        }
        pthread_mutex_unlock(&g_probe_mu);
        if (verdict >= 0 && rc == 0)
            io->uring = 1;
        else if (verdict >= 0)
            log_fallback(rc, what, (unsigned)nthreads);
        /* verdict < 0: an earlier engine found io_uring unusable and said so. */
    } else {
        df_log(DF_LOG_DEBUG, "I/O engine: %u pread/pwrite threads (forced)", (unsigned)nthreads);
    }

    if (!io->uring) {
        rc = pool_start(io, nthreads, e);
        if (rc < 0) {
            io_free(io);
            return NULL;
        }
    }
    return io;
}

const char *df_io_backend(const df_io *io)
{
    return io && io->uring ? "io_uring" : "threads";
}

unsigned df_io_inflight(const df_io *io)
{
    return io ? io->depth - io->nfree : 0;
}

unsigned df_io_depth(const df_io *io)
{
    return io ? io->depth : 0;
}

void df_io_set_max_op(df_io *io, size_t bytes)
{
    /* Capped: an io_uring SQE carries a 32-bit length. */
    if (io)
        io->max_op = bytes && bytes < DEFAULT_MAX_OP ? bytes : DEFAULT_MAX_OP;
}

/* ---- io_uring ------------------------------------------------------------ */

/* Hands the next piece of r (or a readiness poll) to the SQ. The SQ has at
 * least depth entries and each busy slot holds at most one, so there is
 * always room; if there were not, the rest is done synchronously rather
 * than lost. */
static void uring_queue(df_io *io, req *r, int poll_first)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&io->ring);
    if (!sqe) {
        io_uring_submit(&io->ring);
        sqe = io_uring_get_sqe(&io->ring);
    }
    if (!sqe) {
        finish(io, r, sync_rw(r));
        return;
    }
    uint64_t data = (uint64_t)(r - io->reqs);
    if (poll_first) {
        io_uring_prep_poll_add(sqe, r->fd, r->op == OP_READ ? POLLIN : POLLOUT);
        data |= POLL_BIT;
    } else if (r->op == OP_FSYNC) {
        io_uring_prep_fsync(sqe, r->fd, 0);
    } else {
        size_t n = piece(r);
        void *p = r->buf + r->done;
        uint64_t pos = r->off + r->done;
        r->asked = n;
        if (r->op == OP_READ && r->buf_index >= 0)
            io_uring_prep_read_fixed(sqe, r->fd, p, (unsigned)n, pos, r->buf_index);
        else if (r->op == OP_READ)
            io_uring_prep_read(sqe, r->fd, p, (unsigned)n, pos);
        else if (r->buf_index >= 0)
            io_uring_prep_write_fixed(sqe, r->fd, p, (unsigned)n, pos, r->buf_index);
        else
            io_uring_prep_write(sqe, r->fd, p, (unsigned)n, pos);
    }
    io_uring_sqe_set_data64(sqe, data);
}

static void uring_complete(df_io *io, uint64_t data, int res)
{
    req *r = &io->reqs[data & (POLL_BIT - 1)];
    if (data & POLL_BIT) { /* ready (or the poll failed): try the I/O again */
        uring_queue(io, r, 0);
        return;
    }
    if (res == -EINTR) {
        uring_queue(io, r, 0);
        return;
    }
    if (res == -EAGAIN) {
        if (++r->again > MAX_AGAIN)
            finish(io, r, res);
        else
            uring_queue(io, r, 1);
        return;
    }
    r->again = 0;
    if ((res == -EINVAL || res == -EOPNOTSUPP) && !r->sync_tried) {
        /* Some kernels/file systems refuse an opcode or flag that plain
         * syscalls accept; one synchronous retry gives the final word. */
        r->sync_tried = 1;
        finish(io, r, sync_rw(r));
        return;
    }
    if (res < 0) {
        finish(io, r, res);
        return;
    }
    if (r->op == OP_FSYNC) {
        finish(io, r, 0);
        return;
    }
    if (res == 0) {
        finish(io, r, r->op == OP_READ ? (int64_t)r->done : -EIO);
        return;
    }
    r->done += (size_t)res;
    if (r->done >= r->len ||
        (r->op == OP_READ && (size_t)res < r->asked && at_eof(r->fd, r->off + r->done)))
        finish(io, r, (int64_t)r->done);
    else
        uring_queue(io, r, 0); /* short transfer: the remainder */
}

static void uring_reap(df_io *io)
{
    struct io_uring_cqe *cqe;
    while (io_uring_peek_cqe(&io->ring, &cqe) == 0) {
        uint64_t data = io_uring_cqe_get_data64(cqe);
        int res = cqe->res;
        io_uring_cqe_seen(&io->ring, cqe);
        uring_complete(io, data, res);
    }
}

/* Submits what the SQ holds. EAGAIN/EBUSY mean the kernel wants completions
 * reaped first: not an error, the entries stay queued for the next call. */
static int uring_flush(df_io *io)
{
    int total = 0;
    while (io_uring_sq_ready(&io->ring) > 0) {
        int rc = io_uring_submit(&io->ring);
        if (rc == -EINTR)
            continue;
        if (rc == -EAGAIN || rc == -EBUSY)
            break;
        if (rc < 0)
            return rc;
        if (rc == 0)
            break;
        total += rc;
    }
    return total;
}

/* Blocks until the kernel posts a completion, submitting on the way. */
static int uring_block(df_io *io)
{
    int rc = io_uring_submit_and_wait(&io->ring, 1);
    if (rc >= 0 || rc == -EINTR)
        return 0;
    if (rc == -EAGAIN || rc == -EBUSY) {
        /* Submission refused for now (kernel short of memory, or completions
         * to reap first). Wait for what the kernel holds; if it holds
         * nothing, back off briefly instead of blocking forever. */
        unsigned busy = io->depth - io->nfree - io->done_n;
        if (busy <= io_uring_sq_ready(&io->ring)) {
            struct timespec ts = {0, 1000000};
            nanosleep(&ts, NULL);
            return 0;
        }
        struct io_uring_cqe *cqe;
        rc = io_uring_wait_cqe(&io->ring, &cqe);
        if (rc == 0 || rc == -EINTR)
            return 0;
    }
    return rc;
}

/* ---- thread pool --------------------------------------------------------- */

static void *worker(void *arg)
{
    df_io *io = arg;
    pthread_mutex_lock(&io->mu);
    for (;;) {
        while (!io->stop && io->work_n == 0)
            pthread_cond_wait(&io->work_cv, &io->mu);
        if (io->work_n == 0)
            break; /* stop, and nothing left */
        req *r = &io->reqs[io->workq[io->work_head]];
        io->work_head = (io->work_head + 1) % io->depth;
        io->work_n--;
        pthread_mutex_unlock(&io->mu);
        int64_t res = sync_rw(r);
        pthread_mutex_lock(&io->mu);
        finish(io, r, res);
        io->busy--;
        pthread_cond_signal(&io->done_cv);
    }
    pthread_mutex_unlock(&io->mu);
    return NULL;
}

/* ---- the interface --------------------------------------------------------- */

int df_io_register_buffers(df_io *io, const struct iovec *iov, unsigned n)
{
    if (!io || (n > 0 && !iov))
        return -EINVAL;
    if (df_io_inflight(io) > 0)
        return -EBUSY;
    if (io->uring && io->bufs_registered)
        io_uring_unregister_buffers(&io->ring);
    io->bufs_registered = 0;
    free(io->bufs);
    io->bufs = NULL;
    io->nbufs = 0;
    if (n == 0)
        return 0;
    io->bufs = malloc(n * sizeof *iov);
    if (!io->bufs)
        return -ENOMEM;
    memcpy(io->bufs, iov, n * sizeof *iov);
    io->nbufs = n;
    if (!io->uring)
        return 0;
    int rc = io_uring_register_buffers(&io->ring, iov, n);
    if (rc < 0) {
        df_log(DF_LOG_DEBUG, "io_uring: registering %u buffers failed (%s); using plain buffers", n,
               df_strerror(rc));
        return 0;
    }
    io->bufs_registered = 1;
    return 1;
}

static int submit(df_io *io, int op, int fd, void *buf, size_t len, uint64_t off, uint64_t tag,
                  int buf_index)
{
    if (!io)
        return -EINVAL;
    if (op != OP_FSYNC) {
        if (len > 0 && !buf)
            return -EINVAL;
        if (off > (uint64_t)INT64_MAX || len > (uint64_t)INT64_MAX - off)
            return -EINVAL;
        if (buf_index >= 0 && (unsigned)buf_index >= io->nbufs)
            return -EINVAL; /* a caller bug: an index that was never registered */
    }
    if (io->nfree == 0)
        return -EBUSY;
    req *r = &io->reqs[io->freelist[--io->nfree]];
    *r = (req){.op = op, .fd = fd, .buf = buf, .len = len, .off = off, .tag = tag,
               .buf_index = -1, .state = SLOT_BUSY, .max_op = io->max_op};
    if (op != OP_FSYNC && buf_index >= 0 && io->bufs_registered) {
        const struct iovec *b = &io->bufs[buf_index];
        uintptr_t lo = (uintptr_t)b->iov_base, p = (uintptr_t)buf;
        if (p >= lo && len <= b->iov_len && p - lo <= b->iov_len - len)
            r->buf_index = buf_index;
    }
    if (io->uring) {
        if (op != OP_FSYNC && len == 0)
            finish(io, r, 0);
        else
            uring_queue(io, r, 0);
        return 0;
    }
    pthread_mutex_lock(&io->mu);
    if (op != OP_FSYNC && len == 0) {
        finish(io, r, 0);
    } else {
        io->workq[(io->work_head + io->work_n) % io->depth] = (unsigned)(r - io->reqs);
        io->work_n++;
        io->busy++;
        pthread_cond_signal(&io->work_cv);
    }
    pthread_mutex_unlock(&io->mu);
    return 0;
}

int df_io_read(df_io *io, int fd, void *buf, size_t len, uint64_t off, uint64_t tag, int buf_index)
{
    return submit(io, OP_READ, fd, buf, len, off, tag, buf_index);
}

int df_io_write(df_io *io, int fd, const void *buf, size_t len, uint64_t off, uint64_t tag,
                int buf_index)
{
    /* The engine never writes through a write request's buffer. */
    return submit(io, OP_WRITE, fd, (void *)(uintptr_t)buf, len, off, tag, buf_index);
}

int df_io_fsync(df_io *io, int fd, uint64_t tag)
{
    return submit(io, OP_FSYNC, fd, NULL, 0, 0, tag, -1);
}

int df_io_submit(df_io *io)
{
    if (!io)
        return -EINVAL;
    return io->uring ? uring_flush(io) : 0;
}

/* Moves up to max completions to out and frees their slots. On the pool the
 * caller holds mu. */
static unsigned pop_done(df_io *io, df_io_cqe *out, unsigned max)
{
    unsigned k = 0;
    while (k < max && io->done_n > 0) {
        unsigned i = io->doneq[io->done_head];
        io->done_head = (io->done_head + 1) % io->depth;
        io->done_n--;
        req *r = &io->reqs[i];
        out[k].tag = r->tag;
        out[k].res = r->res;
        k++;
        r->state = SLOT_FREE;
        io->freelist[io->nfree++] = i;
    }
    return k;
}

int df_io_wait(df_io *io, df_io_cqe *out, unsigned max, unsigned min)
{
    if (!io || (max > 0 && !out))
        return -EINVAL;
    unsigned target = min;
    if (target > max)
        target = max;
    if (target > df_io_inflight(io))
        target = df_io_inflight(io);

    if (io->uring) {
        for (;;) {
            uring_reap(io);
            if (io->done_n >= target) {
                int rc = uring_flush(io);
                if (rc < 0)
                    return rc;
                break;
            }
            /* target <= inflight, so something is in the kernel to wait for. */
            int rc = uring_block(io);
            if (rc < 0)
                return rc;
        }
        return (int)pop_done(io, out, max);
    }

    pthread_mutex_lock(&io->mu);
    while (io->done_n < target)
        pthread_cond_wait(&io->done_cv, &io->mu);
    unsigned k = pop_done(io, out, max);
    pthread_mutex_unlock(&io->mu);
    return (int)k;
}

void df_io_close(df_io *io)
{
    if (!io)
        return;
    if (io->uring) {
        /* Buffers are the caller's and may be freed right after close, so
         * the kernel must be done with every request first. */
        for (;;) {
            uring_reap(io);
            if (io->depth - io->nfree == io->done_n)
                break;
            if (uring_block(io) < 0)
                break; /* the ring is broken; queue_exit cancels what is left */
        }
        io_uring_queue_exit(&io->ring);
    } else {
        pthread_mutex_lock(&io->mu);
        while (io->busy > 0)
            pthread_cond_wait(&io->done_cv, &io->mu);
        io->stop = 1;
        pthread_cond_broadcast(&io->work_cv);
        pthread_mutex_unlock(&io->mu);
        for (int i = 0; i < io->nthreads; i++)
            pthread_join(io->threads[i], NULL);
    }
    io_free(io);
}

/* ---- files and memory ---------------------------------------------------- */

static int g_direct_logged;

/* Every cache file is a regular file: a FIFO, device or directory in its
 * place is refused by name (a FIFO would block reads forever). Clears the
 * O_NONBLOCK the open used. Returns fd, or a negative code (fd closed). */
static int only_regular(int fd, const char *path, df_err *e)
{
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return df_errf(e, -EINVAL, "%s: not a regular file (FIFO, device or directory); "
                       "refusing it", path);
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        int err = -errno;
        close(fd);
        return df_errf(e, err, "%s: fcntl failed: %s", path, strerror(-err));
    }
    return fd;
}

int df_io_open_file(const char *path, int flags, int mode, int want_direct, int *direct,
                    df_err *e)
{
    if (direct)
        *direct = 0;
    if (!path)
        return df_errf(e, -EINVAL, "df_io_open_file: no path");
    /* O_NONBLOCK: a FIFO in a cache file's place must be refused, not block
     * the open (see only_regular); cleared there for a regular file. */
    flags = (flags & ~O_DIRECT) | O_CLOEXEC | O_NONBLOCK;
    if (want_direct) {
        int fd = open(path, flags | O_DIRECT, mode);
        if (fd >= 0) {
            if (direct)
                *direct = 1;
            return only_regular(fd, path, e);
        }
        if (errno == ENXIO)
            return df_errf(e, -EINVAL, "%s: a FIFO, not a regular file; refusing it", path);
        if (errno != EINVAL)
            return df_errf(e, -errno, "opening %s (O_DIRECT): %s", path, strerror(errno));
        /* The kernel creates the file before it checks O_DIRECT support, so
         * after an O_CREAT|O_EXCL attempt the file is ours: drop O_EXCL or
         * the retry would fail with EEXIST. */
        if ((flags & O_CREAT) && (flags & O_EXCL))
            flags &= ~O_EXCL;
        pthread_mutex_lock(&g_probe_mu);
        int first = !g_direct_logged;
        g_direct_logged = 1;
        pthread_mutex_unlock(&g_probe_mu);
        if (first)
            df_log(DF_LOG_INFO, "O_DIRECT refused for %s; using buffered I/O", path);
    }
    int fd = open(path, flags, mode);
    if (fd < 0 && errno == ENXIO)
        return df_errf(e, -EINVAL, "%s: a FIFO, not a regular file; refusing it", path);
    if (fd < 0)
        return df_errf(e, -errno, "opening %s: %s", path, strerror(errno));
    return only_regular(fd, path, e);
}

size_t df_io_align(int fd)
{
    struct statx stx;
    memset(&stx, 0, sizeof stx);
    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &stx) != 0 || !(stx.stx_mask & STATX_DIOALIGN))
        return 4096;
    uint32_t mem, offs;
#ifdef DF_STATX_NO_DIO_FIELDS
    _Static_assert(sizeof(struct statx) >= 0xa0, "struct statx ABI");
    memcpy(&mem, (const char *)&stx + 0x98, 4);
    memcpy(&offs, (const char *)&stx + 0x9c, 4);
#else
    mem = stx.stx_dio_mem_align;
    offs = stx.stx_dio_offset_align;
#endif
    if (offs == 0) /* the file system does not do direct I/O on this file */
        return 4096;
    return mem > offs ? mem : offs;
}

void *df_io_alloc(size_t len)
{
    /* Rounded up to whole pages so a whole-page O_DIRECT transfer into the
     * tail stays inside the allocation. */
    size_t n = len ? (len + 4095) & ~(size_t)4095 : 4096;
    if (n < len)
        return NULL;
    void *p = NULL;
    return posix_memalign(&p, 4096, n) == 0 ? p : NULL;
}
