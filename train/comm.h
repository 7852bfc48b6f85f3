/* comm.h - collective communication among the ranks of a training run.
 *
 * Data-parallel training with ZeRO-1 runs one process per GPU (or per CPU
 * rank); this module gives those processes the few collectives they need:
 * a reduce-scatter of fp32 gradient buckets, an all-gather of the updated
 * parameter shards, a sum of a few host doubles (loss, token counts, squared
 * gradient norms) and a barrier.
 *
 * Transports, chosen at open from the backend and the world size:
 *   world == 1      trivial: no files; each collective is a copy or nothing.
 *   CPU backend     (df_backend_host_addressable) shared memory: a file in
 *                   rdv_dir that rank 0 creates and every rank mmaps, so all
 *                   ranks must run on one machine. Sums are taken in rank
 *                   order 0..world-1 (((s0 + s1) + s2) + ...), in the element
 *                   type (fp32 adds for reduce_scatter, fp64 for the host
 *                   sums): every rank gets the same bits, and so does a rerun.
 *   CUDA backend    NCCL (builds that found it; -ENOTSUP otherwise). Rank 0
 *                   makes the ncclUniqueId and publishes it as a file in
 *                   rdv_dir, the others poll for it; or, given master_addr
 *                   and master_port, rank 0 sends it to each over TCP
 *                   (common/rdv_tcp.h). Reduce-scatter sums are
 *                   NCCL's (fp32, its own order: exact for 2 ranks, within
 *                   rounding otherwise); the host f64 sums are gathered and
 *                   added on the host in rank order, as on the CPU.
 *
 * Every rank must call the same collectives with the same sizes in the same
 * order (as with MPI/NCCL); a rank that calls something else deadlocks the
 * others until their timeout.
 *
 * Rendezvous files: RDV/.dflash-comm-<run_id>.* (hidden). Shared memory:
 * .shm, removed as soon as every rank has joined. NCCL: .nccl-id and
 * .joined-<rank>, removed once NCCL's init is done, and .abort, left by a
 * rank that gave up (it stays, as a record; a later launch must use another
 * run_id anyway).
 *
 * Failures: a peer that does not arrive within timeout_s gives -ETIMEDOUT
 * with a message naming the missing rank(s) where they can be known (open;
 * every shared-memory collective); NCCL collectives say only that no
 * completion came. A rank that fails or gives up tells the others, which
 * then fail fast with -ECONNABORTED naming it and its reason instead of
 * waiting for their timeout: on shared memory through a flag in the mapping
 * (also set by df_comm_close, see there), on NCCL through the .abort marker,
 * which the peers' host waits (open, allreduce_host_f64, barrier, close)
 * look for every 0.1 s. A rank that dies without a word (SIGKILL) is only
 * seen by the timeout. The .abort and .joined markers are files in rdv_dir:
 * with the TCP rendezvous and no shared disk they reach only the ranks of the
 * same machine; ranks on other nodes learn of a failure from NCCL's async
 * error (a peer's aborted communicator breaks its connections) or, at
 * worst, the timeout. After a collective has failed, or df_comm_abort, the
 * communicator refuses everything with -ECONNABORTED: close it. Argument
 * errors (-EINVAL) are refused with nothing done and break nothing, but the
 * peers will wait for this rank's part.
 *
 * Other errors: -EINVAL (bad arguments, rank >= world, overlapping buffers,
 * ranks of one shared-memory run on different hosts), -DF_EMISMATCH (a
 * peer's rendezvous says another world size, run or slot size), -EEXIST (a
 * rendezvous file of this run_id already exists: run_id reused, or two
 * processes given rank 0; or a rank joined twice), -ENOTSUP (a GPU backend
 * with world > 1 in a build without NCCL), -EIO (a CUDA or NCCL call failed:
 * the message names the call and CUDA's/NCCL's error string), or the errno
 * of a failed system call (-ENOSPC: no room for the shared-memory file).
 *
 * Threads: a communicator is used by one thread at a time.
 */
#ifndef DF_COMM_H
#define DF_COMM_H

#include <stddef.h>

#include "err.h"
#include "ops.h"

/* The most ranks a communicator takes: a sanity bound on the option (more
 * GPUs than this are not planned; shared memory is one machine's ranks). */
#define DF_COMM_MAX_WORLD 1024

typedef struct df_comm df_comm;

typedef struct df_comm_opts {
    int rank, world;      /* this process's rank, number of ranks (1..DF_COMM_MAX_WORLD) */
    const char *rdv_dir;  /* a directory all ranks see (the run directory): rendezvous
                             files live here (unused when world == 1) */
    const char *run_id;   /* a token unique to this launch, [A-Za-z0-9._-]{1,64}: it names
                             the rendezvous files, so stale files of older launches are
                             never read */
    int timeout_s;        /* give up after this long waiting for peers; 0 = 600 */
    const char *master_addr; /* NCCL only: with master_port > 0, the ranks meet over TCP
                             at rank 0's MASTER_ADDR:MASTER_PORT (common/rdv_tcp.h)
                             instead of through rdv_dir's id file, so nodes need no
                             shared disk; NULL = the file. The CPU (shared-memory)
                             transport ignores it: its ranks share one machine */
    int master_port;      /* 1..65535 with master_addr; 0 = unset */
    size_t shm_slot_bytes;/* shared-memory transport: the file holds a slot of this many
                             bytes per rank, and larger buffers go through in rounds of
                             half a slot; 0 = 16 MiB. Rounded down to a multiple of 128,
                             at least 4096 and 256*world. All ranks must pass the same
                             value (checked). Tests use small slots to get many rounds. */
} df_comm_opts;

/* Opens this rank's end of the communicator; blocks until every rank has
 * joined (or timeout_s passes). be must outlive the communicator. On CUDA,
 * device df_backend_cuda_device(be) (one GPU per rank). */
int df_comm_open(df_backend *be, const df_comm_opts *o, df_comm **out, df_err *e);
/* Frees the communicator (NULL is fine). After a failure or df_comm_abort it
 * aborts (no waiting for peers). Otherwise NCCL is finalized, which flushes
 * what is queued and may wait for the peers to close too (bounded by the
 * timeout, then it aborts). On shared memory it also tells the peers that
 * this rank is gone, so a peer still waiting for it fails fast; a peer
 * waiting at a point this rank had passed is never failed by this. */
void df_comm_close(df_comm *c);
/* This rank gives up: the peers waiting for it fail fast (see above) and the
 * communicator refuses further collectives. Call it on an error path before
 * df_comm_close. Idempotent; never blocks for long. */
void df_comm_abort(df_comm *c);

int df_comm_rank(const df_comm *c);
int df_comm_world(const df_comm *c);
/* "self", "shm" or "nccl". */
const char *df_comm_transport(const df_comm *c);

/* Sum of n host doubles over the ranks, in place, blocking; the same bits
 * on every rank (added in rank order on every transport). */
int df_comm_allreduce_host_f64(df_comm *c, double *v, int n, df_err *e);

/* Every rank's bytes bytes of host memory (mine) into all, world x bytes,
 * rank r's at all + r * bytes, blocking, on every rank; any world size (the
 * carrier is allreduce_host_f64 over 32-bit words: exact). mine and all may
 * not overlap. -ENOMEM, or allreduce_host_f64's errors. */
int df_comm_allgather_host(df_comm *c, const void *mine, size_t bytes, void *all, df_err *e);

/* send: world*count elements of dtype (F32 or BF16) in backend memory; recv
 * (count elements, backend memory) gets the sum over ranks of
 * send[rank*count .. +count). In place is allowed when recv == send + rank*count
 * (the rank's own piece; shared memory reads each round's pieces before it
 * writes that round's sums, NCCL supports it); any other overlap is -EINVAL. F32: added in rank
 * order on shared memory (NCCL: its own order). BF16: on shared memory the
 * ranks' values are added in fp32 in rank order and rounded once (RNE);
 * NCCL adds in fp32 per step and rounds after each (once for two ranks, so
 * both transports agree there).
 *
 * Ordering (this and df_comm_all_gather): the collective reads send after the
 * work enqueued so far on the backend's stream (its current one: the side
 * stream in side mode, df_backend_side_begin; df_comm_wait joins into the
 * current one too). On CUDA it runs on the
 * communicator's own stream, so compute goes on meanwhile (gradient buckets
 * are reduce-scattered while the backward of earlier layers still runs):
 * until df_comm_wait, the backend's work must neither write send/recv nor
 * read recv, and neither may be freed. On the CPU it is done on return. */
int df_comm_reduce_scatter(df_comm *c, const void *send, void *recv, size_t count,
                           df_dtype dtype, df_err *e);
/* df_comm_reduce_scatter on F32. */
int df_comm_reduce_scatter_f32(df_comm *c, const float *send, float *recv, size_t count,
                               df_err *e);

/* recv: world*bytes of backend memory gets every rank's `bytes` from send,
 * rank-major. In place is allowed when send == recv + rank*bytes; any other
 * overlap is -EINVAL. Ordering as above. */
int df_comm_all_gather(df_comm *c, const void *send, void *recv, size_t bytes, df_err *e);

/* The backend's stream waits (on the GPU; the host does not block) for all
 * collectives enqueued so far. Nothing to do on the CPU. */
int df_comm_wait(df_comm *c, df_err *e);

/* All ranks reach this point (host, blocking; on CUDA it does not wait for
 * the backend's stream). */
int df_comm_barrier(df_comm *c, df_err *e);

/* ---- internal: between comm.c and comm_nccl.c, not for other modules ---- */
#ifdef DF_COMM_INTERNAL
typedef struct df_comm_nccl df_comm_nccl;
/* abort_path: the marker a rank that gives up leaves, and host waits look
 * for. The arguments are checked by comm.c. */
int df_comm_nccl_open(df_backend *be, const df_comm_opts *o, int timeout_s,
                      const char *abort_path, df_comm_nccl **out, df_err *e);
/* abort != 0: ncclCommAbort, no waiting; else finalize (bounded) + destroy. */
void df_comm_nccl_close(df_comm_nccl *n, int abort);
void df_comm_nccl_abort(df_comm_nccl *n);
int df_comm_nccl_allreduce_host_f64(df_comm_nccl *n, double *v, int n_vals, df_err *e);
int df_comm_nccl_reduce_scatter(df_comm_nccl *n, const void *send, void *recv, size_t count,
                                df_dtype dtype, df_err *e);
int df_comm_nccl_all_gather(df_comm_nccl *n, const void *send, void *recv, size_t bytes,
                            df_err *e);
int df_comm_nccl_wait(df_comm_nccl *n, df_err *e);
int df_comm_nccl_barrier(df_comm_nccl *n, df_err *e);
#endif

#endif
