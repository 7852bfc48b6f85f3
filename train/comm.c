/* comm.c - collectives among the ranks of a run (see comm.h): argument
 * checks, the trivial (world 1) and shared-memory transports, and the
 * dispatch to NCCL (comm_nccl.c).
 *
 * ---- The shared-memory transport ------------------------------------------
 * RDV/.dflash-comm-<run_id>.shm, created by rank 0 (O_EXCL: a second rank 0
 * or a reused run_id is an error, never a silent share), mapped by every
 * rank, unlinked by rank 0 as soon as every rank has joined (the mappings
 * live on, so a crash later leaves no file behind). Layout:
 *   [0, 4096)            shm_head: magic (stored last, release), version,
 *                        world, slot_bytes, file_bytes, run_id, rank 0's host,
 *                        and `gone` (who left or gave up first, and why)
 *   [4096, +world*512)   one shm_rank line per rank: seq (barriers entered),
 *                        pid (the process that joined as that rank), reason
 *                        (why it gave up, written before it sets `gone`)
 *   page aligned         world slots of slot_bytes, each split in two halves
 * Everything but the head's fixed fields starts as the zeros of a new file.
 *
 * Barrier k (the k-th sync of this communicator): a rank stores its seq = k
 * (release) and waits until every seq >= k (acquire). Per-rank counters
 * rather than one arrival counter: they never need resetting, and a timeout
 * can name exactly the ranks that did not arrive. Waiting spins briefly,
 * then yields, then sleeps (backing off to 0.5 ms), checking the deadline
 * and `gone`. `gone` is read before the seqs in each check, so a rank that
 * left after passing barrier k (it saw every seq >= k first) never fails a
 * peer still waiting in barrier k: that peer then sees the seqs too.
 *
 * Data moves in rounds, one sync each: a rank copies its part of the round
 * into its slot's half (round & 1), syncs, then reads every rank's half and
 * combines them in rank order. The halves alternate, and the round counter
 * runs on across collectives, so a rank writing round r (after sync r-1,
 * which every rank entered only after reading round r-2) never overwrites a
 * half a slower peer still reads: one sync per round, none after the last.
 */
#define DF_COMM_INTERNAL
#include "comm.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <sched.h>
#include <stdalign.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/utsname.h>
#include <time.h>
#include <unistd.h>

#include "dtype.h"
#include "fsutil.h"
#include "log.h"

#define PATHN 4096
#define DEFAULT_TIMEOUT_S 600
#define DEFAULT_SLOT (16u << 20)
#define MAX_SLOT ((size_t)1 << 30)
#define RUN_ID_MAX 64

#define SHM_MAGIC 0x314d4d4f43464444ull /* "DDFCOMM1" little-endian */
#define SHM_VERSION 1
#define HEAD_BYTES 4096
#define RANK_LINE 512

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2 && ATOMIC_INT_LOCK_FREE == 2,
               "the shared-memory transport needs lock-free atomics (they work across processes)");

typedef struct shm_head {
    _Atomic uint64_t magic;
    uint32_t version;
    int32_t world;
    uint64_t slot_bytes;
    uint64_t file_bytes;
    char run_id[RUN_ID_MAX + 8];
    char host[72];
    /* (why << 32) | (rank + 1) of the first rank that left; 0 = none. Its own
     * cache lines: read in every wait loop, written once. */
    alignas(128) _Atomic uint64_t gone;
} shm_head;
_Static_assert(sizeof(shm_head) <= HEAD_BYTES, "shm head too big");

typedef struct shm_rank {
    _Atomic uint64_t seq;
    _Atomic int32_t pid;
    char reason[RANK_LINE - 128];
    char pad[128 - 12];
} shm_rank;
_Static_assert(sizeof(shm_rank) == RANK_LINE, "shm rank line size");

enum { GONE_ABORT = 1, GONE_CLOSED = 2, GONE_BAD_JOIN = 3 };
enum { T_SELF, T_SHM, T_NCCL };

struct df_comm {
    int rank, world, timeout_s, kind;
    int broken; /* an error or an abort: every later collective is refused */
    df_backend *be;
    char path[PATHN];       /* the shm file */
    char abort_path[PATHN]; /* NCCL: the marker df_comm_abort leaves */
    /* shm */
    unsigned char *map;
    size_t map_bytes, slot_bytes, half, slots_off;
    shm_head *head;
    uint64_t seq, round;
    int joined;   /* this process owns rank_line(rank) */
    int unlinked; /* rank 0 has removed the file's name */
    int told;     /* this rank has marked itself gone */
    /* nccl */
    df_comm_nccl *nccl;
};

/* ---- small helpers ---- */

static int check_run_id(const char *id, df_err *e)
{
    size_t n = id ? strlen(id) : 0;
    if (n == 0 || n > RUN_ID_MAX)
        return df_errf(e, -EINVAL, "comm: run_id must be 1..%d characters", RUN_ID_MAX);
    for (size_t i = 0; i < n; i++) {
        char ch = id[i];
        if (!((ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
              ch == '.' || ch == '_' || ch == '-'))
            return df_errf(e, -EINVAL, "comm: run_id '%s': only letters, digits, '.', '_', '-' "
                                       "(it becomes part of file names)", id);
    }
    return 0;
}

static void cpu_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

static void sleep_ns(long ns)
{
    struct timespec ts = {ns / 1000000000L, ns % 1000000000L};
    nanosleep(&ts, NULL);
}

/* Spin, then yield, then sleep with back-off: a peer a few microseconds
 * behind costs no syscall; one that is seconds behind costs no CPU. */
static void backoff(unsigned it)
{
    if (it < 256) {
        cpu_relax();
    } else if (it < 320) {
        sched_yield();
    } else {
        unsigned k = it - 320;
        sleep_ns(k >= 8 ? 500000L : 2000L << k);
    }
}

static int overlaps(const void *a, size_t an, const void *b, size_t bn)
{
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return an && bn && x < y + bn && y < x + an;
}

static int refuse_broken(const df_comm *c, const char *what, df_err *e)
{
    return df_errf(e, -ECONNABORTED, "comm: rank %d: %s: the communicator failed or was aborted "
                                     "earlier; close it", c->rank, what);
}

/* ---- shared memory ---- */

static shm_rank *rank_line(const df_comm *c, int r)
{
    return (shm_rank *)(c->map + HEAD_BYTES + (size_t)r * RANK_LINE);
}

static unsigned char *slot_half(const df_comm *c, int r, uint64_t round)
{
    return c->map + c->slots_off + (size_t)r * c->slot_bytes + (size_t)(round & 1) * c->half;
}

/* Tells the peers this rank is gone (first writer wins; the reason goes into
 * this rank's own line first, so whoever reads `gone` can read it). */
static void shm_mark_gone(df_comm *c, int why, const char *reason)
{
    /* once: the first reason (say, a timeout) is the one worth keeping */
    if (!c->head || c->told)
        return;
    c->told = 1;
    if (c->joined && reason) {
        shm_rank *me = rank_line(c, c->rank);
        snprintf(me->reason, sizeof me->reason, "%s", reason);
    }
    uint64_t expect = 0, v = ((uint64_t)why << 32) | (uint32_t)(c->rank + 1);
    atomic_compare_exchange_strong_explicit(&c->head->gone, &expect, v, memory_order_acq_rel,
                                            memory_order_acquire);
}

static int shm_gone_err(const df_comm *c, uint64_t gone, const char *what, df_err *e)
{
    int who = (int)(uint32_t)gone - 1, why = (int)(gone >> 32);
    if (why == GONE_CLOSED)
        return df_errf(e, -ECONNABORTED, "comm: rank %d: %s: rank %d closed its communicator "
                                         "while this rank waited for it", c->rank, what, who);
    if (why == GONE_BAD_JOIN)
        return df_errf(e, -ECONNABORTED, "comm: rank %d: %s: a process joining as rank %d does "
                                         "not belong to this launch (see its error)",
                       c->rank, what, who);
    const char *reason = who >= 0 && who < c->world ? rank_line(c, who)->reason : "";
    return df_errf(e, -ECONNABORTED, "comm: rank %d: %s: rank %d gave up%s%.300s", c->rank,
                   what, who, *reason ? ": " : "", reason);
}

/* "1, 4, 7" (the first 16, then a count): the ranks whose seq is below k. */
static void missing_ranks(const df_comm *c, uint64_t k, char *out, size_t n)
{
    size_t used = 0;
    int listed = 0, missing = 0;
    out[0] = 0;
    for (int r = 0; r < c->world; r++) {
        if (atomic_load_explicit(&rank_line(c, r)->seq, memory_order_acquire) >= k)
            continue;
        missing++;
        if (listed < 16 && used < n) {
            used += (size_t)snprintf(out + used, n - used, "%s%d", listed ? ", " : "", r);
            listed++;
        }
    }
    if (missing > listed && used < n)
        snprintf(out + used, n - used, " and %d more", missing - listed);
}

/* Barrier: see the top of the file. */
static int shm_sync(df_comm *c, const char *what, df_err *e)
{
    const uint64_t k = ++c->seq;
    atomic_store_explicit(&rank_line(c, c->rank)->seq, k, memory_order_release);
    const double t0 = df_now(), deadline = t0 + c->timeout_s;
    int first = 0; /* ranks below this one are known to have arrived */
    for (unsigned it = 0;; it++) {
        uint64_t gone = atomic_load_explicit(&c->head->gone, memory_order_acquire);
        while (first < c->world &&
               atomic_load_explicit(&rank_line(c, first)->seq, memory_order_acquire) >= k)
            first++;
        if (first == c->world)
            return 0;
        if (gone)
            return shm_gone_err(c, gone, what, e);
        if (it >= 256 && (it & 15) == 0 && df_now() >= deadline) {
            char list[256];
            missing_ranks(c, k, list, sizeof list);
            return df_errf(e, -ETIMEDOUT, "comm: rank %d: %s: timed out after %.0f s waiting for "
                                          "rank(s) %s%s", c->rank, what, df_now() - t0, list,
                           k == 1 ? " to join (shared-memory rendezvous)" : "");
        }
        backoff(it < 320 ? it : 320 + (it - 320) / 4);
    }
}

/* After a failed collective: refuse the rest, and let the peers fail fast. */
static int shm_fail(df_comm *c, int rc, const df_err *e)
{
    c->broken = 1;
    shm_mark_gone(c, GONE_ABORT, e ? e->msg : "a collective failed");
    return rc;
}

static size_t slot_size(const df_comm_opts *o)
{
    size_t s = o->shm_slot_bytes ? o->shm_slot_bytes : DEFAULT_SLOT;
    s &= ~(size_t)127;
    if (s < 4096)
        s = 4096;
    /* reduce_scatter stages world pieces per half: at least 32 floats each */
    if (s < (size_t)256 * (size_t)o->world)
        s = (size_t)256 * (size_t)o->world;
    return s;
}

static void host_name(char *out, size_t n)
{
    struct utsname u;
    snprintf(out, n, "%s", uname(&u) == 0 ? u.nodename : "?");
}

/* Rank 0: creates the file, sizes it, writes the head, magic last. */
static int shm_create(df_comm *c, const char *run_id, size_t file_bytes, df_err *e)
{
    int fd = open(c->path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
    if (fd < 0) {
        if (errno == EEXIST)
            return df_errf(e, -EEXIST, "comm: rank 0: %s already exists: another launch used "
                                       "this run_id, or two processes have rank 0 (remove it "
                                       "if no launch is running)", c->path);
        return df_errf(e, -errno, "comm: rank 0: cannot create %s: %s", c->path,
                       strerror(errno));
    }
    /* Blocks now, so a full disk is ENOSPC here rather than SIGBUS when a
     * page of the mapping is first touched; ftruncate where unsupported. */
    int rc = posix_fallocate(fd, 0, (off_t)file_bytes);
    if (rc == EOPNOTSUPP || rc == EINVAL)
        rc = ftruncate(fd, (off_t)file_bytes) == 0 ? 0 : errno;
    void *m = MAP_FAILED;
    if (!rc) {
        m = mmap(NULL, file_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (m == MAP_FAILED)
            rc = errno;
    }
    close(fd);
    if (rc) {
        unlink(c->path);
        return df_errf(e, -rc, "comm: rank 0: cannot make %s (%zu bytes): %s", c->path,
                       file_bytes, strerror(rc));
    }
    c->map = m;
    c->map_bytes = file_bytes;
    c->head = m;
    c->head->version = SHM_VERSION;
    c->head->world = c->world;
    c->head->slot_bytes = c->slot_bytes;
    c->head->file_bytes = file_bytes;
    snprintf(c->head->run_id, sizeof c->head->run_id, "%s", run_id);
    host_name(c->head->host, sizeof c->head->host);
    atomic_store_explicit(&c->head->magic, SHM_MAGIC, memory_order_release);
    return 0;
}

/* Ranks > 0: waits for rank 0's file, checks its head, maps all of it. */
static int shm_attach(df_comm *c, const char *run_id, size_t file_bytes, double deadline,
                      df_err *e)
{
    int fd = -1;
    shm_head *h = MAP_FAILED;
    int rc = 0;
    for (unsigned it = 0;; it++) {
        if (fd < 0) {
            fd = open(c->path, O_RDWR | O_CLOEXEC);
            if (fd < 0 && errno != ENOENT) {
                rc = df_errf(e, -errno, "comm: rank %d: cannot open %s: %s", c->rank, c->path,
                             strerror(errno));
                goto out;
            }
        }
        if (fd >= 0 && h == MAP_FAILED) {
            struct stat st;
            if (fstat(fd, &st) != 0) {
                rc = df_errf(e, -errno, "comm: rank %d: %s: %s", c->rank, c->path,
                             strerror(errno));
                goto out;
            }
            if (st.st_size >= HEAD_BYTES) {
                h = mmap(NULL, HEAD_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
                if (h == MAP_FAILED) {
                    rc = df_errf(e, -errno, "comm: rank %d: cannot map %s: %s", c->rank, c->path,
                                 strerror(errno));
                    goto out;
                }
            }
        }
        if (h != MAP_FAILED && atomic_load_explicit(&h->magic, memory_order_acquire) == SHM_MAGIC)
            break;
        if (df_now() >= deadline) {
            rc = df_errf(e, -ETIMEDOUT, "comm: rank %d: timed out after %d s waiting for rank(s) "
                                        "0 to %s %s", c->rank, c->timeout_s,
                         fd < 0 ? "create" : "finish", c->path);
            goto out;
        }
        sleep_ns(it < 10 ? 1000000L : 10000000L);
    }
    /* Whoever does not belong here marks the file so that rank 0 and the
     * others fail now rather than at their timeout. */
    char host[72];
    host_name(host, sizeof host);
    const char *bad = NULL;
    if (h->version != SHM_VERSION) {
        rc = df_errf(e, -DF_EVERSION, "comm: rank %d: %s has layout version %u, this build %d "
                                      "(ranks from different builds)", c->rank, c->path,
                     h->version, SHM_VERSION);
        bad = "version";
    } else if (h->world != c->world) {
        rc = df_errf(e, -DF_EMISMATCH, "comm: rank %d: %s was made for world %d, this rank was "
                                       "started with world %d", c->rank, c->path, h->world,
                     c->world);
        bad = "world";
    } else if (strcmp(h->run_id, run_id)) {
        rc = df_errf(e, -DF_EMISMATCH, "comm: rank %d: %s belongs to run '%.*s', not '%s'",
                     c->rank, c->path, RUN_ID_MAX, h->run_id, run_id);
        bad = "run";
    } else if (h->slot_bytes != c->slot_bytes || h->file_bytes != file_bytes) {
        rc = df_errf(e, -DF_EMISMATCH, "comm: rank %d: %s has %llu-byte slots, this rank wants "
                                       "%zu (every rank must pass the same shm_slot_bytes)",
                     c->rank, c->path, (unsigned long long)h->slot_bytes, c->slot_bytes);
        bad = "slots";
    } else if (strcmp(h->host, host)) {
        rc = df_errf(e, -EINVAL, "comm: rank %d runs on host '%s' but rank 0 on '%.72s': the "
                                 "CPU backend's shared-memory transport needs every rank on one "
                                 "machine", c->rank, host, h->host);
        bad = "host";
    }
    if (bad) {
        uint64_t expect = 0, v = ((uint64_t)GONE_BAD_JOIN << 32) | (uint32_t)(c->rank + 1);
        atomic_compare_exchange_strong(&h->gone, &expect, v);
        goto out;
    }
    struct stat st;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != file_bytes) {
        rc = df_errf(e, -DF_ECORRUPT, "comm: rank %d: %s is not %zu bytes long", c->rank, c->path,
                     file_bytes);
        goto out;
    }
    void *m = mmap(NULL, file_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (m == MAP_FAILED) {
        rc = df_errf(e, -errno, "comm: rank %d: cannot map %s (%zu bytes): %s", c->rank, c->path,
                     file_bytes, strerror(errno));
        goto out;
    }
    c->map = m;
    c->map_bytes = file_bytes;
    c->head = m;
out:
    if (h != MAP_FAILED)
        munmap(h, HEAD_BYTES);
    if (fd >= 0)
        close(fd);
    return rc;
}

static int shm_open_(df_comm *c, const df_comm_opts *o, df_err *e)
{
    const double deadline = df_now() + c->timeout_s;
    c->slot_bytes = slot_size(o);
    if (c->slot_bytes > MAX_SLOT)
        return df_errf(e, -EINVAL, "comm: shm_slot_bytes %zu: at most %zu", o->shm_slot_bytes,
                       MAX_SLOT);
    c->half = c->slot_bytes / 2;
    c->slots_off = ((size_t)HEAD_BYTES + (size_t)c->world * RANK_LINE + 4095) & ~(size_t)4095;
    const size_t file_bytes = c->slots_off + (size_t)c->world * c->slot_bytes;
    int n = snprintf(c->path, sizeof c->path, "%s/.dflash-comm-%s.shm", o->rdv_dir, o->run_id);
    if (n < 0 || (size_t)n >= sizeof c->path)
        return df_errf(e, -ENAMETOOLONG, "comm: %s: path too long", o->rdv_dir);
    int rc = c->rank == 0 ? shm_create(c, o->run_id, file_bytes, e)
                          : shm_attach(c, o->run_id, file_bytes, deadline, e);
    if (rc)
        return rc;

    /* Join: claim this rank's line (a second process with the same rank is
     * an error for both launches' sake), then the first barrier. */
    shm_rank *me = rank_line(c, c->rank);
    int32_t none = 0;
    if (!atomic_compare_exchange_strong(&me->pid, &none, (int32_t)getpid())) {
        rc = df_errf(e, -EEXIST, "comm: rank %d joined twice (pid %d and pid %d): two processes "
                                 "were given the same rank", c->rank, (int)none, (int)getpid());
        uint64_t expect = 0, v = ((uint64_t)GONE_BAD_JOIN << 32) | (uint32_t)(c->rank + 1);
        atomic_compare_exchange_strong(&c->head->gone, &expect, v);
        return rc;
    }
    c->joined = 1;
    /* The join waits until the open's deadline, not a fresh timeout. */
    int saved = c->timeout_s;
    double left = deadline - df_now();
    c->timeout_s = left > 0 ? (int)(left + 0.999) : 0;
    rc = shm_sync(c, "open", e);
    c->timeout_s = saved;
    if (rc)
        return rc;
    if (c->rank == 0) {
        /* Every rank has it mapped: the name is no longer needed. */
        if (unlink(c->path) != 0)
            df_log(DF_LOG_WARN, "comm: cannot remove %s: %s", c->path, strerror(errno));
        c->unlinked = 1;
    }
    df_log(DF_LOG_DEBUG, "comm: rank %d of %d joined (shared memory, %zu-byte slots)", c->rank,
           c->world, c->slot_bytes);
    return 0;
}

static void shm_close(df_comm *c)
{
    if (c->head) {
        /* Completed barriers stay completed (see the top), so this only fails
         * peers that wait for this rank in vain. */
        if (c->broken)
            shm_mark_gone(c, GONE_ABORT, "it aborted");
        else
            shm_mark_gone(c, GONE_CLOSED, NULL);
    }
    if (c->rank == 0 && !c->unlinked && c->map)
        unlink(c->path);
    if (c->map)
        munmap(c->map, c->map_bytes);
    c->map = NULL;
    c->head = NULL;
}

static void add_f64(double *restrict d, const double *restrict s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        d[i] += s[i];
}

static void add_f32(float *restrict d, const float *restrict s, size_t n)
{
    for (size_t i = 0; i < n; i++)
        d[i] += s[i];
}

static int shm_allreduce_f64(df_comm *c, double *v, size_t n, df_err *e)
{
    const size_t per = c->half / sizeof(double);
    for (size_t off = 0; off < n; off += per, c->round++) {
        size_t len = n - off < per ? n - off : per;
        memcpy(slot_half(c, c->rank, c->round), v + off, len * sizeof *v);
        int rc = shm_sync(c, "allreduce_host_f64", e);
        if (rc)
            return shm_fail(c, rc, e);
        /* rank order: ((s0 + s1) + s2) + ..., the same on every rank */
        memcpy(v + off, slot_half(c, 0, c->round), len * sizeof *v);
        for (int r = 1; r < c->world; r++)
            add_f64(v + off, (const double *)slot_half(c, r, c->round), len);
    }
    return 0;
}

/* BF16 pieces: widened, added in fp32 in rank order, rounded once. */
static void sum_bf16(uint16_t *restrict d, df_comm *c, size_t at, size_t len)
{
    for (size_t i = 0; i < len; i++) {
        float acc = df_bf16_to_f32(((const uint16_t *)slot_half(c, 0, c->round))[at + i]);
        for (int r = 1; r < c->world; r++)
            acc += df_bf16_to_f32(((const uint16_t *)slot_half(c, r, c->round))[at + i]);
        d[i] = df_f32_to_bf16(acc);
    }
}

static int shm_reduce_scatter(df_comm *c, const void *send, void *recv, size_t count,
                              size_t es, df_err *e)
{
    const int W = c->world;
    const size_t per = c->half / (es * (size_t)W);
    const unsigned char *snd = send;
    unsigned char *rcv = recv;
    for (size_t off = 0; off < count; off += per, c->round++) {
        size_t len = count - off < per ? count - off : per;
        /* piece j of this round: send[j*count + off, +len), for rank j */
        unsigned char *mine = slot_half(c, c->rank, c->round);
        for (int j = 0; j < W; j++)
            memcpy(mine + (size_t)j * len * es, snd + ((size_t)j * count + off) * es, len * es);
        int rc = shm_sync(c, "reduce_scatter", e);
        if (rc)
            return shm_fail(c, rc, e);
        const size_t at = (size_t)c->rank * len;
        if (es == 2) {
            sum_bf16((uint16_t *)rcv + off, c, at, len);
            continue;
        }
        float *out = (float *)rcv + off;
        memcpy(out, (const float *)slot_half(c, 0, c->round) + at, len * sizeof *out);
        for (int r = 1; r < W; r++)
            add_f32(out, (const float *)slot_half(c, r, c->round) + at, len);
    }
    return 0;
}

static int shm_all_gather(df_comm *c, const void *send, void *recv, size_t bytes, df_err *e)
{
    const int in_place = send == (const unsigned char *)recv + (size_t)c->rank * bytes;
    for (size_t off = 0; off < bytes; off += c->half, c->round++) {
        size_t len = bytes - off < c->half ? bytes - off : c->half;
        memcpy(slot_half(c, c->rank, c->round), (const unsigned char *)send + off, len);
        int rc = shm_sync(c, "all_gather", e);
        if (rc)
            return shm_fail(c, rc, e);
        for (int r = 0; r < c->world; r++)
            if (!(in_place && r == c->rank)) /* in place: our own part is already there */
                memcpy((unsigned char *)recv + (size_t)r * bytes + off,
                       slot_half(c, r, c->round), len);
    }
    return 0;
}

/* ---- the public interface ---- */

int df_comm_open(df_backend *be, const df_comm_opts *o, df_comm **out, df_err *e)
{
    if (out)
        *out = NULL;
    if (!be || !o || !out)
        return df_errf(e, -EINVAL, "comm: open needs a backend, options and an output");
    if (o->world < 1 || o->world > DF_COMM_MAX_WORLD)
        return df_errf(e, -EINVAL, "comm: world %d outside 1..%d", o->world, DF_COMM_MAX_WORLD);
    if (o->rank < 0 || o->rank >= o->world)
        return df_errf(e, -EINVAL, "comm: rank %d out of range for world %d", o->rank, o->world);
    if (o->timeout_s < 0)
        return df_errf(e, -EINVAL, "comm: timeout_s %d < 0", o->timeout_s);
    df_comm *c = calloc(1, sizeof *c);
    if (!c)
        return df_errf(e, -ENOMEM, "comm: out of memory");
    c->rank = o->rank;
    c->world = o->world;
    c->timeout_s = o->timeout_s ? o->timeout_s : DEFAULT_TIMEOUT_S;
    c->be = be;
    c->kind = T_SELF;
    if (o->world == 1) {
        *out = c;
        return 0;
    }
    int rc = 0;
    if (!o->rdv_dir || !*o->rdv_dir)
        rc = df_errf(e, -EINVAL, "comm: world %d needs a rendezvous directory", o->world);
    if (!rc)
        rc = check_run_id(o->run_id, e);
    if (!rc && o->master_addr && *o->master_addr && (o->master_port < 1 || o->master_port > 65535))
        rc = df_errf(e, -EINVAL, "comm: master port %d: want 1..65535", o->master_port);
    if (!rc && df_backend_host_addressable(be)) {
        c->kind = T_SHM;
        rc = shm_open_(c, o, e);
    } else if (!rc) {
        c->kind = T_NCCL;
#ifdef DFLASH_HAVE_NCCL
        int n = snprintf(c->abort_path, sizeof c->abort_path, "%s/.dflash-comm-%s.abort",
                         o->rdv_dir, o->run_id);
        if (n < 0 || (size_t)n >= sizeof c->abort_path)
            rc = df_errf(e, -ENAMETOOLONG, "comm: %s: path too long", o->rdv_dir);
        else
            rc = df_comm_nccl_open(be, o, c->timeout_s, c->abort_path, &c->nccl, e);
#else
        rc = df_errf(e, -ENOTSUP, "comm: rank %d: %s backend with world %d needs NCCL, and this "
                                  "build has none (configure with CUDA and NCCL present)",
                     o->rank, df_backend_name(be), o->world);
#endif
    }
    if (rc) {
        /* Peers waiting to join hear of it at once (shm; NCCL peers time out). */
        c->broken = 1;
        df_comm_close(c);
        return rc;
    }
    *out = c;
    return 0;
}

void df_comm_abort(df_comm *c)
{
    if (!c || c->kind == T_SELF)
        return;
    c->broken = 1;
    if (c->kind == T_SHM)
        shm_mark_gone(c, GONE_ABORT, "it called df_comm_abort");
#ifdef DFLASH_HAVE_NCCL
    if (c->kind == T_NCCL && c->nccl)
        df_comm_nccl_abort(c->nccl);
#endif
}

void df_comm_close(df_comm *c)
{
    if (!c)
        return;
    if (c->kind == T_SHM)
        shm_close(c);
#ifdef DFLASH_HAVE_NCCL
    if (c->kind == T_NCCL && c->nccl)
        df_comm_nccl_close(c->nccl, c->broken);
#endif
    free(c);
}

int df_comm_rank(const df_comm *c)
{
    return c ? c->rank : -1;
}

int df_comm_world(const df_comm *c)
{
    return c ? c->world : -1;
}

const char *df_comm_transport(const df_comm *c)
{
    if (!c)
        return "none";
    return c->kind == T_SELF ? "self" : c->kind == T_SHM ? "shm" : "nccl";
}

#ifdef DFLASH_HAVE_NCCL
/* After a transport error: the NCCL side has aborted itself already. */
static int failed(df_comm *c, int rc)
{
    if (rc < 0)
        c->broken = 1;
    return rc;
}
#else
/* No NCCL: no communicator has that transport (open refuses it). */
static int no_nccl(const char *what, df_err *e)
{
    return df_errf(e, -ENOTSUP, "comm: %s: this build has no NCCL", what);
}
#endif

int df_comm_allgather_host(df_comm *c, const void *mine, size_t bytes, void *all, df_err *e)
{
    if (!c || (bytes && (!mine || !all)))
        return df_errf(e, -EINVAL, "comm: allgather_host: bad arguments");
    int world = c->world, rank = c->rank;
    if (bytes == 0)
        return 0;
    size_t words = (bytes + 3) / 4, n = words * (size_t)world;
    if (n > INT_MAX)
        return df_errf(e, -EINVAL, "comm: allgather_host: %zu bytes x %d ranks is too much", bytes, world);
    double *v = calloc(n, sizeof *v);
    if (!v)
        return df_errf(e, -ENOMEM, "comm: allgather_host: out of memory");
    for (size_t i = 0; i < words; i++) { /* this rank's slot: its words; the others' zeros */
        uint32_t w = 0;
        memcpy(&w, (const uint8_t *)mine + 4 * i, bytes - 4 * i < 4 ? bytes - 4 * i : 4);
        v[(size_t)rank * words + i] = (double)w;
    }
    int rc = df_comm_allreduce_host_f64(c, v, (int)n, e);
    for (int r = 0; !rc && r < world; r++)
        for (size_t i = 0; i < words; i++) {
            uint32_t w = (uint32_t)v[(size_t)r * words + i];
            memcpy((uint8_t *)all + (size_t)r * bytes + 4 * i, &w, bytes - 4 * i < 4 ? bytes - 4 * i : 4);
        }
    free(v);
    return rc;
}

int df_comm_allreduce_host_f64(df_comm *c, double *v, int n, df_err *e)
{
    if (!c || n < 0 || (n > 0 && !v))
        return df_errf(e, -EINVAL, "comm: allreduce_host_f64: bad arguments (n %d)", n);
    if (c->broken)
        return refuse_broken(c, "allreduce_host_f64", e);
    if (n == 0 || c->kind == T_SELF)
        return 0;
    if (c->kind == T_SHM)
        return shm_allreduce_f64(c, v, (size_t)n, e);
#ifdef DFLASH_HAVE_NCCL
    return failed(c, df_comm_nccl_allreduce_host_f64(c->nccl, v, n, e));
#else
    return no_nccl("allreduce_host_f64", e);
#endif
}

int df_comm_reduce_scatter(df_comm *c, const void *send, void *recv, size_t count,
                           df_dtype dtype, df_err *e)
{
    if (!c)
        return df_errf(e, -EINVAL, "comm: reduce_scatter: no communicator");
    if (dtype != DF_DTYPE_F32 && dtype != DF_DTYPE_BF16)
        return df_errf(e, -EINVAL, "comm: reduce_scatter: dtype %s (F32 or BF16)",
                       df_dtype_name(dtype));
    const size_t es = df_dtype_size(dtype);
    if (count > SIZE_MAX / es / (size_t)c->world)
        return df_errf(e, -EINVAL, "comm: reduce_scatter: count %zu too large", count);
    if (count && (!send || !recv))
        return df_errf(e, -EINVAL, "comm: reduce_scatter: NULL buffer");
    const int in_place = count && recv == (const unsigned char *)send + (size_t)c->rank * count * es;
    if (!in_place && overlaps(send, (size_t)c->world * count * es, recv, count * es))
        return df_errf(e, -EINVAL, "comm: reduce_scatter: recv overlaps send (in place needs "
                                   "recv == send + rank*count)");
    if (c->broken)
        return refuse_broken(c, "reduce_scatter", e);
    if (count == 0 || (c->kind == T_SELF && in_place))
        return 0;
    if (c->kind == T_SELF) {
        int rc = df_backend_copy(c->be, recv, send, count * es);
        return rc ? df_errf(e, rc, "comm: reduce_scatter: backend copy failed") : 0;
    }
    if (c->kind == T_SHM)
        return shm_reduce_scatter(c, send, recv, count, es, e);
#ifdef DFLASH_HAVE_NCCL
    return failed(c, df_comm_nccl_reduce_scatter(c->nccl, send, recv, count, dtype, e));
#else
    return no_nccl("reduce_scatter", e);
#endif
}

int df_comm_reduce_scatter_f32(df_comm *c, const float *send, float *recv, size_t count,
                               df_err *e)
{
    return df_comm_reduce_scatter(c, send, recv, count, DF_DTYPE_F32, e);
}

int df_comm_all_gather(df_comm *c, const void *send, void *recv, size_t bytes, df_err *e)
{
    if (!c)
        return df_errf(e, -EINVAL, "comm: all_gather: no communicator");
    if (bytes > SIZE_MAX / (size_t)c->world)
        return df_errf(e, -EINVAL, "comm: all_gather: %zu bytes too large", bytes);
    if (bytes && (!send || !recv))
        return df_errf(e, -EINVAL, "comm: all_gather: NULL buffer");
    const int in_place = bytes && send == (const unsigned char *)recv + (size_t)c->rank * bytes;
    if (!in_place && overlaps(send, bytes, recv, (size_t)c->world * bytes))
        return df_errf(e, -EINVAL, "comm: all_gather: send overlaps recv (in place needs send "
                                   "== recv + rank*bytes)");
    if (c->broken)
        return refuse_broken(c, "all_gather", e);
    if (bytes == 0 || (c->kind == T_SELF && in_place))
        return 0;
    if (c->kind == T_SELF) {
        int rc = df_backend_copy(c->be, recv, send, bytes);
        return rc ? df_errf(e, rc, "comm: all_gather: backend copy failed") : 0;
    }
    if (c->kind == T_SHM)
        return shm_all_gather(c, send, recv, bytes, e);
#ifdef DFLASH_HAVE_NCCL
    return failed(c, df_comm_nccl_all_gather(c->nccl, send, recv, bytes, e));
#else
    return no_nccl("all_gather", e);
#endif
}

int df_comm_wait(df_comm *c, df_err *e)
{
    if (!c)
        return df_errf(e, -EINVAL, "comm: wait: no communicator");
    if (c->broken)
        return refuse_broken(c, "wait", e);
#ifdef DFLASH_HAVE_NCCL
    if (c->kind == T_NCCL)
        return failed(c, df_comm_nccl_wait(c->nccl, e));
#endif
    return 0;
}

int df_comm_barrier(df_comm *c, df_err *e)
{
    if (!c)
        return df_errf(e, -EINVAL, "comm: barrier: no communicator");
    if (c->broken)
        return refuse_broken(c, "barrier", e);
    if (c->kind == T_SHM) {
        int rc = shm_sync(c, "barrier", e);
        return rc ? shm_fail(c, rc, e) : 0;
    }
#ifdef DFLASH_HAVE_NCCL
    if (c->kind == T_NCCL)
        return failed(c, df_comm_nccl_barrier(c->nccl, e));
#endif
    return 0;
}
