/* comm_nccl.c - the NCCL transport of comm.h (a CUDA backend, world > 1).
 * Plain C over the CUDA runtime API and NCCL; comm.c checks arguments and
 * dispatches here.
 *
 * Rendezvous: rank 0 makes the ncclUniqueId and writes
 * RDV/.dflash-comm-<run_id>.nccl-id (magic, world, id; tmp + rename, so a
 * reader sees all of it or nothing); the others poll for it. With a master
 * address and port (df_comm_opts) rank 0 sends the id to every rank over TCP
 * instead (common/rdv_tcp.h: torchrun's MASTER_ADDR/MASTER_PORT, no shared
 * disk needed), and every rank then knows that all have it. Each rank then
 * leaves RDV/.dflash-comm-<run_id>.joined-<rank>, so a rank that times out
 * inside NCCL's init can name the ranks that never read the id. Once the
 * init is done (it completes only when every rank has connected) each rank
 * removes its marker and rank 0 the id file.
 *
 * The NCCL communicator is nonblocking (config.blocking = 0), so no NCCL
 * call can hang the host: every wait (the init, a call that answers
 * ncclInProgress, the host-blocking collectives, finalize) is a poll loop
 * bounded by the timeout that also watches NCCL's async error and the abort
 * marker RDV/.dflash-comm-<run_id>.abort (a file: it reaches the ranks that
 * share RDV; across nodes without a shared disk NCCL's async error, from the
 * connections a peer's ncclCommAbort breaks, and the timeout do that
 * work). The price: NCCL launches each
 * collective of a nonblocking communicator from a thread of its own, some
 * tens of microseconds per call, which the few calls of a step can afford;
 * a blocking communicator could hang for good in its init or in the lazy
 * connection setup of a first collective when a peer dies. On any failure this rank leaves
 * that marker (with its reason, so the peers' host waits fail fast and say
 * why) and aborts its communicator at once: ncclCommAbort stops kernels that
 * would otherwise wait forever for a dead peer and hold up the backend's
 * stream behind them.
 *
 * Streams: collectives run on our own non-blocking stream, created with the
 * highest priority so that they are scheduled promptly between the
 * backward's kernels; each waits for an event recorded on the backend's
 * stream, and df_comm_wait makes the backend's stream wait for an event on
 * ours. Every NCCL call goes on that one stream, so they run in the order
 * they were called, which is the same order on every rank.
 *
 * Host sums (allreduce_host_f64): every rank's doubles are all-gathered
 * through a small device buffer and added on the host in rank order: every
 * rank gets the same bits, and the same bits as the shared-memory transport.
 */
#define DF_COMM_INTERNAL
#include "comm.h"

#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cuda_runtime_api.h>
#include <nccl.h>

#include "fsutil.h"
#include "log.h"
#include "rdv_tcp.h"

#define PATHN 4096
#define ID_MAGIC "DFNCCL1\n"
#define F64_CAP0 4096 /* doubles per rank the host-sum buffers start with */

typedef struct id_file {
    char magic[8];
    int32_t world;
    int32_t zero;
    ncclUniqueId id;
} id_file;

struct df_comm_nccl {
    int rank, world, device, timeout_s;
    ncclComm_t comm; /* NULL once aborted */
    df_backend *be;  /* collectives order against its current stream (its side
                      * stream in side mode: df_backend_side_begin) */
    cudaStream_t stream;
    cudaEvent_t ev_fork, ev_join, ev_host;
    double *dbuf, *hbuf; /* device / pinned host: world * cap doubles */
    size_t cap;
    char abort_path[PATHN];
    char prefix[PATHN]; /* RDV/.dflash-comm-<run_id> */
    int tcp;            /* the id came over TCP: every rank has it */
};

static void sleep_ns(long ns)
{
    struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
    nanosleep(&ts, NULL);
}

/* Leaves the abort marker (first rank wins: link() is atomic and fails on an
 * existing name) and aborts this rank's NCCL communicator. */
static void abort_now(df_comm_nccl *n, const char *reason)
{
    char tmp[PATHN + 32];
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", n->abort_path, n->rank);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) {
        char line[600];
        int len = snprintf(line, sizeof line, "rank %d: %.500s\n", n->rank, reason ? reason : "");
        if (len > 0 && write(fd, line, (size_t)len) < 0)
            df_log(DF_LOG_DEBUG, "comm: %s: %s", tmp, strerror(errno));
        close(fd);
        if (link(tmp, n->abort_path) != 0 && errno != EEXIST)
            df_log(DF_LOG_WARN, "comm: rank %d: cannot leave %s: %s", n->rank, n->abort_path,
                   strerror(errno));
        unlink(tmp);
    }
    if (n->comm) {
        (void)cudaSetDevice(n->device);
        (void)ncclCommAbort(n->comm);
        n->comm = NULL;
    }
}

/* After a failure (e filled): abort, tell the peers, return rc. */
static int fail(df_comm_nccl *n, int rc, const df_err *e)
{
    abort_now(n, e ? e->msg : "a collective failed");
    return rc;
}

static int cu(df_comm_nccl *n, cudaError_t err, const char *call, const char *what, df_err *e)
{
    if (err == cudaSuccess)
        return 0;
    (void)cudaGetLastError();
    df_errf(e, -EIO, "comm: rank %d: %s: %s failed on device %d: %s", n->rank, what, call,
            n->device, cudaGetErrorString(err));
    return fail(n, -EIO, e);
}

static int nccl_failed(df_comm_nccl *n, ncclResult_t r, const char *call, const char *what,
                       df_err *e)
{
    const char *last = n->comm ? ncclGetLastError(n->comm) : NULL;
    df_errf(e, -EIO, "comm: rank %d: %s: %s failed: %s%s%.300s", n->rank, what, call,
            ncclGetErrorString(r), last && *last ? ": " : "", last ? last : "");
    return fail(n, -EIO, e);
}

/* 1 when some rank has left the abort marker; its text goes to out. */
static int marker(const df_comm_nccl *n, char *out, size_t len)
{
    int fd = open(n->abort_path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 0;
    ssize_t got = read(fd, out, len - 1);
    close(fd);
    out[got > 0 ? got : 0] = 0;
    char *nl = strchr(out, '\n');
    if (nl)
        *nl = 0;
    return 1;
}

/* Ranks with no joined-<r> marker: "1, 3" (the first 16, then a count). */
static void not_joined(const df_comm_nccl *n, char *out, size_t len)
{
    size_t used = 0;
    int listed = 0, missing = 0;
    out[0] = 0;
    for (int r = 0; r < n->world; r++) {
        char p[PATHN + 32];
        snprintf(p, sizeof p, "%s.joined-%d", n->prefix, r);
        if (access(p, F_OK) == 0)
            continue;
        missing++;
        if (listed < 16 && used < len) {
            used += (size_t)snprintf(out + used, len - used, "%s%d", listed ? ", " : "", r);
            listed++;
        }
    }
    if (missing > listed && used < len)
        snprintf(out + used, len - used, " and %d more", missing - listed);
}

/* Polls until NCCL has settled (ev == NULL: no call in progress) or ev has
 * completed, watching NCCL's async error, the abort marker and the deadline.
 * Spins a little first: a collective that is nearly done costs no sleep. */
static int wait_loop(df_comm_nccl *n, cudaEvent_t ev, double deadline, const char *what,
                     df_err *e)
{
    if (!n->comm)
        return df_errf(e, -ECONNABORTED, "comm: rank %d: %s: communicator aborted", n->rank,
                       what);
    const double t0 = df_now();
    double next_marker = t0 + 0.05;
    for (unsigned it = 0;; it++) {
        ncclResult_t st = ncclSuccess;
        ncclResult_t r = ncclCommGetAsyncError(n->comm, &st);
        if (r != ncclSuccess)
            return nccl_failed(n, r, "ncclCommGetAsyncError", what, e);
        if (st != ncclSuccess && st != ncclInProgress)
            return nccl_failed(n, st, "an asynchronous NCCL operation", what, e);
        if (!ev && st == ncclSuccess)
            return 0;
        if (ev) {
            cudaError_t q = cudaEventQuery(ev);
            if (q == cudaSuccess)
                return 0;
            if (q != cudaErrorNotReady)
                return cu(n, q, "cudaEventQuery", what, e);
        }
        double now = df_now();
        char why[600];
        if (now >= next_marker) {
            next_marker = now + 0.1;
            if (marker(n, why, sizeof why)) {
                df_errf(e, -ECONNABORTED, "comm: rank %d: %s: a peer gave up (%.500s)",
                        n->rank, what, why);
                return fail(n, -ECONNABORTED, e);
            }
        }
        if (now >= deadline) {
            if (!strcmp(what, "open") && n->tcp) {
                df_errf(e, -ETIMEDOUT, "comm: rank %d: open: timed out after %.0f s in NCCL's "
                                       "init; every rank got the NCCL id over TCP, so one "
                                       "stalled inside the init (NCCL_DEBUG=WARN says more)",
                        n->rank, now - t0);
            } else if (!strcmp(what, "open")) {
                char list[256];
                not_joined(n, list, sizeof list);
                df_errf(e, -ETIMEDOUT, "comm: rank %d: open: timed out after %.0f s in NCCL's "
                                       "init; %s%s", n->rank, now - t0,
                        *list ? "rank(s) missing: " : "every rank read the NCCL id, so one "
                                                      "stalled inside the init",
                        list);
            } else {
                df_errf(e, -ETIMEDOUT, "comm: rank %d: %s: no completion after %.0f s (a peer "
                                       "rank died, stalled or called other collectives); "
                                       "communicator aborted", n->rank, what, now - t0);
            }
            return fail(n, -ETIMEDOUT, e);
        }
        /* NCCL's launch thread or a kernel about to finish: yield for the
         * first 2 ms; a peer seconds behind: sleep, 0.1 ms then 1 ms */
        if (it >= 64) {
            double waited = now - t0;
            if (waited < 0.002)
                sched_yield();
            else
                sleep_ns(waited < 0.1 ? 100000L : 1000000L);
        }
    }
}

/* An NCCL call's result: ncclInProgress means wait until it has settled. */
static int nc(df_comm_nccl *n, ncclResult_t r, const char *call, const char *what, df_err *e)
{
    if (r == ncclSuccess)
        return 0;
    if (r != ncclInProgress)
        return nccl_failed(n, r, call, what, e);
    return wait_loop(n, NULL, df_now() + n->timeout_s, what, e);
}

#define CU(x, call)                                 \
    do {                                            \
        int rc_ = cu(n, (x), call, what, e);        \
        if (rc_)                                    \
            return rc_;                             \
    } while (0)
#define NC(x, call)                                 \
    do {                                            \
        int rc_ = nc(n, (x), call, what, e);        \
        if (rc_)                                    \
            return rc_;                             \
    } while (0)

/* Over TCP: rank 0 makes the id and sends it to every rank; the others
 * receive it. */
static int exchange_id_tcp(df_comm_nccl *n, const df_comm_opts *o, ncclUniqueId *id,
                           double deadline, df_err *e)
{
    double left = deadline - df_now();
    df_rdv_opts ro = {.master_addr = o->master_addr, .master_port = o->master_port,
                      .rank = n->rank, .world = n->world, .run_id = o->run_id,
                      .timeout_ms = left > 1e-3 ? (int)(left * 1000) : 1};
    size_t len = sizeof *id;
    /* the file rendezvous's rank 0 refuses a run_id whose abort marker exists;
     * here every rank looks (the marker may be on this node only) */
    char why[600];
    if (marker(n, why, sizeof why))
        return df_errf(e, -EEXIST, "comm: rank %d: open: %s exists (%.200s): a rank of this "
                                   "launch gave up already, or an older launch used this run_id "
                                   "(give every launch its own)", n->rank, n->abort_path, why);
    if (n->rank == 0) {
        ncclResult_t r = ncclGetUniqueId(id);
        if (r != ncclSuccess)
            return df_errf(e, -EIO, "comm: rank 0: ncclGetUniqueId failed: %s",
                           ncclGetErrorString(r));
    }
    int rc = df_rdv_tcp(&ro, id, &len, sizeof *id, e);
    if (rc) {
        df_err_wrap(e, "comm: open");
        return rc;
    }
    if (len != sizeof *id)
        return df_errf(e, -DF_EMISMATCH, "comm: rank %d: rank 0 sent a %zu-byte NCCL id, this "
                                         "build's is %zu (NCCL versions differ?)", n->rank, len,
                       sizeof *id);
    n->tcp = 1;
    return 0;
}

/* Rank 0 publishes the id; the others poll for it until the deadline. */
static int exchange_id(df_comm_nccl *n, const df_comm_opts *o, ncclUniqueId *id,
                       double deadline, df_err *e)
{
    if (o->master_addr && *o->master_addr && o->master_port > 0)
        return exchange_id_tcp(n, o, id, deadline, e);
    char path[PATHN + 32];
    snprintf(path, sizeof path, "%s.nccl-id", n->prefix);
    if (n->rank == 0) {
        id_file f;
        memset(&f, 0, sizeof f);
        memcpy(f.magic, ID_MAGIC, 8);
        f.world = n->world;
        ncclResult_t r = ncclGetUniqueId(&f.id);
        if (r != ncclSuccess)
            return df_errf(e, -EIO, "comm: rank 0: ncclGetUniqueId failed: %s",
                           ncclGetErrorString(r));
        /* Both go once a launch has joined (the id) or never (the abort
         * marker): either one here means this run_id was used before. */
        const char *stale = access(path, F_OK) == 0              ? path
                            : access(n->abort_path, F_OK) == 0 ? n->abort_path
                                                                : NULL;
        if (stale)
            return df_errf(e, -EEXIST, "comm: rank 0: %s already exists: another launch used "
                                       "this run_id, or two processes have rank 0", stale);
        int rc = df_file_write_atomic(path, &f, sizeof f, e);
        if (rc)
            return rc;
        *id = f.id;
        return 0;
    }
    for (unsigned it = 0;; it++) {
        char *buf = NULL;
        size_t len = 0;
        df_err ignore;
        int rc = df_file_read_all(path, 4096, &buf, &len, &ignore);
        if (rc == 0) {
            id_file f;
            int ok = len == sizeof f;
            if (ok)
                memcpy(&f, buf, sizeof f);
            free(buf);
            if (!ok || memcmp(f.magic, ID_MAGIC, 8))
                return df_errf(e, -DF_ECORRUPT, "comm: rank %d: %s is not an NCCL id file of "
                                                "this build", n->rank, path);
            if (f.world != n->world)
                return df_errf(e, -DF_EMISMATCH, "comm: rank %d: %s was made for world %d, this "
                                                 "rank was started with world %d", n->rank, path,
                               f.world, n->world);
            *id = f.id;
            return 0;
        }
        if (rc != -ENOENT)
            return df_errf(e, rc, "comm: rank %d: %s", n->rank, ignore.msg);
        char why[600];
        if (it % 10 == 9 && marker(n, why, sizeof why))
            return df_errf(e, -ECONNABORTED, "comm: rank %d: open: a peer gave up (%.500s)",
                           n->rank, why);
        if (df_now() >= deadline)
            return df_errf(e, -ETIMEDOUT, "comm: rank %d: open: timed out after %d s waiting "
                                          "for rank(s) 0 to publish the NCCL id (%s)",
                           n->rank, n->timeout_s, path);
        sleep_ns(it < 10 ? 1000000L : 10000000L);
    }
}

static int open_(df_comm_nccl *n, const df_comm_opts *o, double deadline, df_err *e)
{
    const char *what = "open";
    CU(cudaSetDevice(n->device), "cudaSetDevice");
    int lo = 0, hi = 0;
    CU(cudaDeviceGetStreamPriorityRange(&lo, &hi), "cudaDeviceGetStreamPriorityRange");
    CU(cudaStreamCreateWithPriority(&n->stream, cudaStreamNonBlocking, hi),
       "cudaStreamCreateWithPriority");
    CU(cudaEventCreateWithFlags(&n->ev_fork, cudaEventDisableTiming), "cudaEventCreate");
    CU(cudaEventCreateWithFlags(&n->ev_join, cudaEventDisableTiming), "cudaEventCreate");
    CU(cudaEventCreateWithFlags(&n->ev_host, cudaEventDisableTiming), "cudaEventCreate");
    n->cap = F64_CAP0;
    CU(cudaMalloc((void **)&n->dbuf, (size_t)n->world * n->cap * sizeof(double)), "cudaMalloc");
    CU(cudaMallocHost((void **)&n->hbuf, (size_t)n->world * n->cap * sizeof(double)),
       "cudaMallocHost");

    ncclUniqueId id;
    int rc = exchange_id(n, o, &id, deadline, e);
    if (rc)
        return rc;
    char mark[PATHN + 32];
    snprintf(mark, sizeof mark, "%s.joined-%d", n->prefix, n->rank);
    int fd = open(mark, O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
    if (fd >= 0)
        close(fd);

    ncclConfig_t cfg = NCCL_CONFIG_INITIALIZER;
    cfg.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&n->comm, n->world, id, n->rank, &cfg);
    if (r != ncclSuccess && r != ncclInProgress) {
        n->comm = NULL; /* nothing to abort: NCCL cleaned up */
        return nccl_failed(n, r, "ncclCommInitRankConfig", what, e);
    }
    rc = wait_loop(n, NULL, deadline, what, e);
    if (rc)
        return rc;
    unlink(mark);
    if (n->rank == 0 && !n->tcp) {
        char path[PATHN + 32];
        snprintf(path, sizeof path, "%s.nccl-id", n->prefix);
        unlink(path);
    }
    return 0;
}

static void free_(df_comm_nccl *n)
{
    (void)cudaSetDevice(n->device);
    if (n->ev_fork)
        (void)cudaEventDestroy(n->ev_fork);
    if (n->ev_join)
        (void)cudaEventDestroy(n->ev_join);
    if (n->ev_host)
        (void)cudaEventDestroy(n->ev_host);
    if (n->stream)
        (void)cudaStreamDestroy(n->stream);
    if (n->dbuf)
        (void)cudaFree(n->dbuf);
    if (n->hbuf)
        (void)cudaFreeHost(n->hbuf);
    (void)cudaGetLastError();
    free(n);
}

int df_comm_nccl_open(df_backend *be, const df_comm_opts *o, int timeout_s,
                      const char *abort_path, df_comm_nccl **out, df_err *e)
{
    *out = NULL;
    const double deadline = df_now() + timeout_s;
    int dev = df_backend_cuda_device(be);
    void *stream = df_backend_cuda_stream(be);
    if (dev < 0 || !stream)
        return df_errf(e, -EINVAL, "comm: rank %d: the %s backend is neither host memory nor "
                                   "CUDA", o->rank, df_backend_name(be));
    df_comm_nccl *n = calloc(1, sizeof *n);
    if (!n)
        return df_errf(e, -ENOMEM, "comm: out of memory");
    n->rank = o->rank;
    n->world = o->world;
    n->device = dev;
    n->timeout_s = timeout_s;
    n->be = be;
    snprintf(n->abort_path, sizeof n->abort_path, "%s", abort_path);
    int len = snprintf(n->prefix, sizeof n->prefix, "%s/.dflash-comm-%s", o->rdv_dir, o->run_id);
    int rc = len < 0 || (size_t)len >= sizeof n->prefix - 32
                 ? df_errf(e, -ENAMETOOLONG, "comm: %s: path too long", o->rdv_dir)
                 : open_(n, o, deadline, e);
    if (rc) {
        /* the peers waiting for this rank in the init hear of it at once */
        abort_now(n, e ? e->msg : "its open failed");
        free_(n);
        return rc;
    }
    int ver = 0;
    (void)ncclGetVersion(&ver);
    df_log(DF_LOG_DEBUG, "comm: rank %d of %d joined (NCCL %d, device %d)", n->rank, n->world,
           ver, n->device);
    *out = n;
    return 0;
}

void df_comm_nccl_abort(df_comm_nccl *n)
{
    if (n)
        abort_now(n, "it called df_comm_abort");
}

void df_comm_nccl_close(df_comm_nccl *n, int abort)
{
    if (!n)
        return;
    (void)cudaSetDevice(n->device);
    if (n->comm && abort) {
        abort_now(n, "it closed its communicator after an error");
    } else if (n->comm) {
        /* Finalize flushes what is still queued and waits (bounded: a dead
         * peer means an abort, not a hang) until the peers are quiescent. */
        df_err e = {0};
        if (nc(n, ncclCommFinalize(n->comm), "ncclCommFinalize", "close", &e) == 0) {
            (void)ncclCommDestroy(n->comm);
            n->comm = NULL;
        } else {
            df_log(DF_LOG_WARN, "%s", e.msg);
        }
    }
    free_(n);
}

static int ensure_cap(df_comm_nccl *n, size_t per_rank, const char *what, df_err *e)
{
    if (per_rank <= n->cap)
        return 0;
    size_t cap = n->cap;
    while (cap < per_rank)
        cap *= 2;
    /* cudaFree waits for the whole device: first let what is queued on our
     * stream finish under the timeout, so a dead peer cannot hang it.
     * Growth is rare (a bigger host sum than any before). */
    CU(cudaEventRecord(n->ev_host, n->stream), "cudaEventRecord");
    int rc = wait_loop(n, n->ev_host, df_now() + n->timeout_s, what, e);
    if (rc)
        return rc;
    CU(cudaFree(n->dbuf), "cudaFree");
    n->dbuf = NULL;
    CU(cudaFreeHost(n->hbuf), "cudaFreeHost");
    n->hbuf = NULL;
    CU(cudaMalloc((void **)&n->dbuf, (size_t)n->world * cap * sizeof(double)), "cudaMalloc");
    CU(cudaMallocHost((void **)&n->hbuf, (size_t)n->world * cap * sizeof(double)),
       "cudaMallocHost");
    n->cap = cap;
    return 0;
}

int df_comm_nccl_allreduce_host_f64(df_comm_nccl *n, double *v, int n_vals, df_err *e)
{
    const char *what = "allreduce_host_f64";
    const size_t k = (size_t)n_vals;
    CU(cudaSetDevice(n->device), "cudaSetDevice");
    int rc = ensure_cap(n, k, what, e);
    if (rc)
        return rc;
    double *mine_h = n->hbuf + (size_t)n->rank * k, *mine_d = n->dbuf + (size_t)n->rank * k;
    memcpy(mine_h, v, k * sizeof *v);
    CU(cudaMemcpyAsync(mine_d, mine_h, k * sizeof *v, cudaMemcpyHostToDevice, n->stream),
       "cudaMemcpyAsync");
    NC(ncclAllGather(mine_d, n->dbuf, k, ncclFloat64, n->comm, n->stream), "ncclAllGather");
    CU(cudaMemcpyAsync(n->hbuf, n->dbuf, (size_t)n->world * k * sizeof *v,
                       cudaMemcpyDeviceToHost, n->stream), "cudaMemcpyAsync");
    CU(cudaEventRecord(n->ev_host, n->stream), "cudaEventRecord");
    rc = wait_loop(n, n->ev_host, df_now() + n->timeout_s, what, e);
    if (rc)
        return rc;
    /* rank order: ((s0 + s1) + s2) + ..., as the shared-memory transport */
    memcpy(v, n->hbuf, k * sizeof *v);
    for (int r = 1; r < n->world; r++) {
        const double *s = n->hbuf + (size_t)r * k;
        for (size_t i = 0; i < k; i++)
            v[i] += s[i];
    }
    return 0;
}

/* The comm stream starts after the backend's work enqueued so far. */
static int fork_(df_comm_nccl *n, const char *what, df_err *e)
{
    CU(cudaSetDevice(n->device), "cudaSetDevice");
    CU(cudaEventRecord(n->ev_fork, (cudaStream_t)df_backend_cuda_stream(n->be)),
       "cudaEventRecord");
    CU(cudaStreamWaitEvent(n->stream, n->ev_fork, 0), "cudaStreamWaitEvent");
    return 0;
}

int df_comm_nccl_reduce_scatter(df_comm_nccl *n, const void *send, void *recv, size_t count,
                                df_dtype dtype, df_err *e)
{
    const char *what = "reduce_scatter";
    int rc = fork_(n, what, e);
    if (rc)
        return rc;
    ncclDataType_t t = dtype == DF_DTYPE_BF16 ? ncclBfloat16 : ncclFloat32;
    NC(ncclReduceScatter(send, recv, count, t, ncclSum, n->comm, n->stream),
       "ncclReduceScatter");
    return 0;
}

int df_comm_nccl_all_gather(df_comm_nccl *n, const void *send, void *recv, size_t bytes,
                            df_err *e)
{
    const char *what = "all_gather";
    int rc = fork_(n, what, e);
    if (rc)
        return rc;
    NC(ncclAllGather(send, recv, bytes, ncclUint8, n->comm, n->stream), "ncclAllGather");
    return 0;
}

int df_comm_nccl_wait(df_comm_nccl *n, df_err *e)
{
    const char *what = "wait";
    CU(cudaSetDevice(n->device), "cudaSetDevice");
    CU(cudaEventRecord(n->ev_join, n->stream), "cudaEventRecord");
    CU(cudaStreamWaitEvent((cudaStream_t)df_backend_cuda_stream(n->be), n->ev_join, 0),
       "cudaStreamWaitEvent");
    return 0;
}

int df_comm_nccl_barrier(df_comm_nccl *n, df_err *e)
{
    const char *what = "barrier";
    CU(cudaSetDevice(n->device), "cudaSetDevice");
    NC(ncclAllReduce(n->dbuf, n->dbuf, 1, ncclFloat64, ncclSum, n->comm, n->stream),
       "ncclAllReduce");
    CU(cudaEventRecord(n->ev_host, n->stream), "cudaEventRecord");
    return wait_loop(n, n->ev_host, df_now() + n->timeout_s, what, e);
}
