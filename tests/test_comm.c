/* test_comm - the communicator (train/comm.h) on the CPU backend: the trivial
 * transport (world 1) and the shared-memory one (worlds 2 and 3), as forked
 * processes, one per rank, each with its own 1-thread CPU backend (nothing
 * CUDA is touched before a fork).
 *
 * Every collective runs on non-trivial data (random values over many
 * exponents, so the order of the sums shows in the bits) at sizes of 0, 1,
 * odd, and more than a slot (many rounds: small slots; and once with the
 * default 16 MiB slot), out of place and in place, then as a long random mix
 * with ranks skewed by small sleeps. Each rank regenerates every rank's input
 * from the seeds and checks its results bit for bit against sums it takes
 * itself in rank order; the ranks then all-gather a hash of everything they
 * got and check that it is the same everywhere.
 *
 * The failure paths, each in its own directory and run: a peer that never
 * comes (rank 0 alone, rank 1 alone: -ETIMEDOUT naming the missing rank
 * after timeout_s = 1), a peer that dies after joining (-ETIMEDOUT naming
 * it), df_comm_abort (the others get -ECONNABORTED naming it, long before
 * their timeout), a close just after the last barrier (the slower peer still
 * passes it, the next barrier fails fast), another world size, a rank out
 * of range, a rank given twice, a reused run_id, a bad run_id, overlapping
 * buffers. No rendezvous file may be left behind by any run that joined.
 *
 * All runs go at once (about 2 s in all, the timeouts being 1 s); the
 * parent kills everything after 60 s and fails. */
#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "comm.h"
#include "dtype.h"
#include "fsutil.h"
#include "ops.h"
#include "test.h"

#define SMALL_SLOT 8192 /* halves of 4 KiB: a few hundred values per round */

static char base_dir[4096];

/* ---- deterministic data: any rank can make any rank's input ---- */

static uint64_t seed_of(int rank, int salt)
{
    return 0x9e3779b97f4a7c15ull * (uint64_t)(salt + 1) ^
           (uint64_t)(rank + 1) * 0x2545f4914f6cdd1dull;
}

/* One random word per value (the big cases make tens of millions): random
 * sign and mantissa, exponent within 2^-12..2^12 (f32) or 2^-30..2^30 (f64). */
static void fill_f32(float *v, size_t n, int rank, int salt)
{
    uint64_t s = seed_of(rank, salt);
    for (size_t i = 0; i < n; i++) {
        uint64_t x = test_rand(&s);
        uint32_t bits = (uint32_t)(x >> 63) << 31 | (uint32_t)(115 + (x >> 32) % 25) << 23 |
                        (uint32_t)(x & 0x7fffff);
        memcpy(&v[i], &bits, 4);
    }
}

static void fill_f64(double *v, size_t n, int rank, int salt)
{
    uint64_t s = seed_of(rank, salt);
    for (size_t i = 0; i < n; i++) {
        uint64_t x = test_rand(&s);
        uint64_t bits = (x >> 63) << 63 | (uint64_t)(993 + (x >> 52 & 0x3ff) % 61) << 52 |
                        (x & 0xfffffffffffffull);
        memcpy(&v[i], &bits, 8);
    }
}

static void fill_u8(unsigned char *v, size_t n, int rank, int salt)
{
    uint64_t s = seed_of(rank, salt);
    for (size_t i = 0; i < n; i += 8) {
        uint64_t x = test_rand(&s);
        memcpy(v + i, &x, n - i < 8 ? n - i : 8);
    }
}

static uint64_t fnv(uint64_t h, const void *p, size_t n)
{
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++)
        h = (h ^ b[i]) * 0x100000001b3ull;
    return h;
}

/* ---- one rank's checks of each collective ---- */

typedef struct ctx {
    df_comm *c;
    int rank, world;
    uint64_t hash; /* of every result that all ranks share, for the cross-rank check */
} ctx;

static void t_allreduce(ctx *t, size_t n, int salt)
{
    double *v = malloc((n ? n : 1) * sizeof *v), *want = malloc((n ? n : 1) * sizeof *v),
           *tmp = malloc((n ? n : 1) * sizeof *v);
    fill_f64(v, n, t->rank, salt);
    fill_f64(want, n, 0, salt);
    for (int r = 1; r < t->world; r++) {
        fill_f64(tmp, n, r, salt);
        for (size_t i = 0; i < n; i++)
            want[i] += tmp[i];
    }
    df_err e = {0};
    CHECK_OK(df_comm_allreduce_host_f64(t->c, v, (int)n, &e), &e);
    if (memcmp(v, want, n * sizeof *v)) {
        fprintf(stderr, "allreduce_host_f64 n %zu (world %d rank %d): not bit-exact\n", n,
                t->world, t->rank);
        df_test_failures++;
    }
    t->hash = fnv(t->hash, v, n * sizeof *v);
    free(v);
    free(want);
    free(tmp);
}

/* The host all-gather (the trainer's per-rank figures, its checkpoints' RNG
 * states and data positions): every rank's bytes in its slot, on every rank. */
static void t_allgather_host(ctx *t, size_t bytes, int salt)
{
    unsigned char *mine = malloc(bytes ? bytes : 1), *all = malloc(bytes * (size_t)t->world + 1),
                  *want = malloc(bytes ? bytes : 1);
    fill_u8(mine, bytes, t->rank, salt);
    memset(all, 0xa5, bytes * (size_t)t->world + 1);
    df_err e = {0};
    CHECK_OK(df_comm_allgather_host(t->c, mine, bytes, all, &e), &e);
    for (int r = 0; r < t->world; r++) {
        fill_u8(want, bytes, r, salt);
        if (memcmp(all + (size_t)r * bytes, want, bytes)) {
            fprintf(stderr, "allgather_host %zu bytes (world %d rank %d): rank %d's slot differs\n",
                    bytes, t->world, t->rank, r);
            df_test_failures++;
        }
    }
    CHECK(all[bytes * (size_t)t->world] == 0xa5); /* nothing written past the end */
    t->hash = fnv(t->hash, all, bytes * (size_t)t->world);
    free(mine);
    free(all);
    free(want);
}

/* BF16: every rank's values widened, added in fp32 in rank order, rounded
 * once; the same bits on every transport that is not NCCL. */
static void t_reduce_scatter_bf16(ctx *t, size_t count, int salt, int in_place)
{
    const size_t all = (size_t)t->world * count;
    float *tmp = malloc((all ? all : 1) * 4), *acc = malloc((count ? count : 1) * 4);
    uint16_t *send = malloc((all ? all : 1) * 2), *recv = malloc((count + 2) * 2),
             *want = malloc((count ? count : 1) * 2);
    fill_f32(tmp, all, t->rank, salt);
    for (size_t i = 0; i < all; i++)
        send[i] = df_f32_to_bf16(tmp[i]);
    const size_t at = (size_t)t->rank * count;
    for (int r = 0; r < t->world; r++) {
        fill_f32(tmp, all, r, salt);
        for (size_t i = 0; i < count; i++) {
            float x = df_bf16_to_f32(df_f32_to_bf16(tmp[at + i]));
            acc[i] = r == 0 ? x : acc[i] + x;
        }
    }
    for (size_t i = 0; i < count; i++)
        want[i] = df_f32_to_bf16(acc[i]);
    const uint16_t guard = 0x4321;
    recv[0] = recv[count + 1] = guard;
    df_err e = {0};
    if (in_place) { /* into the rank's own piece of send */
        CHECK_OK(df_comm_reduce_scatter(t->c, send, send + at, count, DF_DTYPE_BF16, &e), &e);
        CHECK_OK(df_comm_wait(t->c, &e), &e);
        memcpy(recv + 1, send + at, count * 2);
    } else {
        CHECK_OK(df_comm_reduce_scatter(t->c, send, recv + 1, count, DF_DTYPE_BF16, &e), &e);
        CHECK_OK(df_comm_wait(t->c, &e), &e);
    }
    if (memcmp(recv + 1, want, count * 2)) {
        fprintf(stderr, "reduce_scatter bf16 count %zu (world %d rank %d%s): not bit-exact\n",
                count, t->world, t->rank, in_place ? ", in place" : "");
        df_test_failures++;
    }
    CHECK(recv[0] == guard && recv[count + 1] == guard);
    free(tmp);
    free(acc);
    free(send);
    free(recv);
    free(want);
}

static void t_reduce_scatter(ctx *t, size_t count, int salt, int in_place)
{
    const size_t all = (size_t)t->world * count;
    float *send = malloc((all ? all : 1) * sizeof *send), *tmp = malloc((all ? all : 1) * 4);
    float *recv = malloc((count + 2) * sizeof *recv), *want = malloc((count ? count : 1) * 4);
    fill_f32(send, all, t->rank, salt);
    const size_t at = (size_t)t->rank * count;
    for (int r = 0; r < t->world; r++) {
        fill_f32(tmp, all, r, salt);
        for (size_t i = 0; i < count; i++)
            want[i] = r == 0 ? tmp[at + i] : want[i] + tmp[at + i];
    }
    /* guard values around recv must survive */
    const float guard = -12345.5f;
    recv[0] = recv[count + 1] = guard;
    df_err e = {0};
    if (in_place) { /* into the rank's own piece of send */
        CHECK_OK(df_comm_reduce_scatter_f32(t->c, send, send + at, count, &e), &e);
        CHECK_OK(df_comm_wait(t->c, &e), &e);
        memcpy(recv + 1, send + at, count * sizeof *recv);
    } else {
        CHECK_OK(df_comm_reduce_scatter_f32(t->c, send, recv + 1, count, &e), &e);
        CHECK_OK(df_comm_wait(t->c, &e), &e);
    }
    if (memcmp(recv + 1, want, count * sizeof *want)) {
        fprintf(stderr, "reduce_scatter_f32 count %zu (world %d rank %d%s): not bit-exact\n",
                count, t->world, t->rank, in_place ? ", in place" : "");
        df_test_failures++;
    }
    CHECK(recv[0] == guard && recv[count + 1] == guard);
    /* the input is left as it was, but for the rank's own piece in place */
    fill_f32(tmp, all, t->rank, salt);
    if (in_place)
        memcpy(tmp + at, want, count * sizeof *want);
    CHECK(memcmp(send, tmp, all * sizeof *tmp) == 0);
    free(send);
    free(tmp);
    free(recv);
    free(want);
}

static void t_all_gather(ctx *t, size_t bytes, int salt, int in_place)
{
    const size_t all = (size_t)t->world * bytes;
    unsigned char *recv = malloc(all + 2), *want = malloc(all + 1), *send = malloc(bytes + 1);
    for (int r = 0; r < t->world; r++)
        fill_u8(want + (size_t)r * bytes, bytes, r, salt);
    memset(recv, 0xa5, all + 2);
    fill_u8(send, bytes, t->rank, salt);
    const unsigned char *src = send;
    if (in_place) {
        memcpy(recv + 1 + (size_t)t->rank * bytes, send, bytes);
        src = recv + 1 + (size_t)t->rank * bytes;
    }
    df_err e = {0};
    CHECK_OK(df_comm_all_gather(t->c, src, recv + 1, bytes, &e), &e);
    CHECK_OK(df_comm_wait(t->c, &e), &e);
    if (memcmp(recv + 1, want, all)) {
        fprintf(stderr, "all_gather %zu bytes%s (world %d rank %d): wrong\n", bytes,
                in_place ? " in place" : "", t->world, t->rank);
        df_test_failures++;
    }
    CHECK(recv[0] == 0xa5 && recv[all + 1] == 0xa5);
    t->hash = fnv(t->hash, recv + 1, all);
    free(recv);
    free(want);
    free(send);
}

/* A random mix of everything; the sequence is the same on every rank, the
 * timing is not (sleeps by rank), which exercises the double-buffered rounds. */
static void t_mix(ctx *t, int iters)
{
    uint64_t s = 77;
    for (int it = 0; it < iters; it++) {
        uint64_t x = test_rand(&s);
        size_t n = 1 + (size_t)(x >> 40) % 3000;
        if ((it + t->rank) % 3 == 0)
            usleep((useconds_t)(((unsigned)it * 7u + (unsigned)t->rank * 13u) % 400u));
        switch (x % 4) {
        case 0: t_allreduce(t, n, 1000 + it); break;
        case 1: t_reduce_scatter(t, n, 1000 + it, it & 1); break;
        case 2: t_all_gather(t, n * 3 + 1, 1000 + it, (int)(x >> 8) & 1); break;
        default: {
            df_err e = {0};
            CHECK_OK(df_comm_barrier(t->c, &e), &e);
        }
        }
    }
}

static df_backend *cpu(void)
{
    df_err e = {0};
    df_backend *be = df_backend_cpu_open(1, &e);
    if (!be) {
        fprintf(stderr, "cpu backend: %s\n", e.msg);
        exit(2);
    }
    return be;
}

static df_comm_opts opts(int rank, int world, const char *dir, const char *run_id, int timeout_s,
                         size_t slot)
{
    df_comm_opts o = {.rank = rank, .world = world, .rdv_dir = dir, .run_id = run_id,
                      .timeout_s = timeout_s, .shm_slot_bytes = slot};
    return o;
}

/* ---- scenarios (each runs in one child per rank; the exit code is what
 * the parent checks) ---- */

static int sc_full(int rank, int world, const char *dir, size_t slot, int big)
{
    df_backend *be = cpu();
    df_comm_opts o = opts(rank, world, dir, "full-run.1", 30, slot);
    df_err e = {0};
    df_comm *c = NULL;
    CHECK_OK(df_comm_open(be, &o, &c, &e), &e);
    if (!c)
        return 1;
    CHECK_EQ(df_comm_rank(c), rank);
    CHECK_EQ(df_comm_world(c), world);
    CHECK(!strcmp(df_comm_transport(c), world == 1 ? "self" : "shm"));
    ctx t = {c, rank, world, 0xcbf29ce484222325ull};
    if (big) {
        /* more than one default slot (16 MiB) per call */
        t_reduce_scatter(&t, (size_t)5 << 20 >> 1, 1, 0);
        t_reduce_scatter_bf16(&t, (size_t)5 << 20, 5, 0);
        t_reduce_scatter(&t, (size_t)5 << 20 >> 1, 6, 1);
        t_reduce_scatter_bf16(&t, (size_t)5 << 20, 7, 1);
        t_all_gather(&t, (size_t)20 << 20, 2, 0);
        t_all_gather(&t, ((size_t)17 << 20) + 3, 3, 1);
        t_allreduce(&t, (size_t)3 << 20, 4);
    } else {
        const size_t sizes_f64[] = {0, 1, 7, 511, 512, 513, 4099};
        for (size_t i = 0; i < sizeof sizes_f64 / sizeof *sizes_f64; i++)
            t_allreduce(&t, sizes_f64[i], 10 + (int)i);
        const size_t sizes_f32[] = {0, 1, 13, 341, 342, 343, 1000, 30011};
        for (int ip = 0; ip < 2; ip++) {
            for (size_t i = 0; i < sizeof sizes_f32 / sizeof *sizes_f32; i++)
                t_reduce_scatter(&t, sizes_f32[i], 20 + (int)i, ip);
            for (size_t i = 0; i < sizeof sizes_f32 / sizeof *sizes_f32; i++)
                t_reduce_scatter_bf16(&t, sizes_f32[i], 80 + (int)i, ip);
        }
        const size_t sizes_u8[] = {0, 1, 3, 4095, 4096, 4097, 100003};
        for (size_t i = 0; i < sizeof sizes_u8 / sizeof *sizes_u8; i++) {
            t_all_gather(&t, sizes_u8[i], 40 + (int)i, 0);
            t_all_gather(&t, sizes_u8[i], 60 + (int)i, 1);
        }
        const size_t sizes_host[] = {0, 1, 3, 8, 24, 32, 1001};
        for (size_t i = 0; i < sizeof sizes_host / sizeof *sizes_host; i++)
            t_allgather_host(&t, sizes_host[i], 90 + (int)i);
        t_mix(&t, 150);
    }

    /* argument errors are refused with nothing done; the communicator goes on */
    float buf[64] = {0};
    /* recv inside send but not at the rank's own piece */
    CHECK_ERR(df_comm_reduce_scatter_f32(c, buf, buf + 2 * rank + 1, 2, &e), -EINVAL, &e,
              "overlap");
    CHECK_ERR(df_comm_reduce_scatter(c, buf, buf + 8, 1, DF_DTYPE_F16, &e), -EINVAL, &e,
              "dtype");
    /* 2 bytes into recv: in place for no rank */
    CHECK_ERR(df_comm_all_gather(c, (char *)buf + 2, buf, 4, &e), -EINVAL, &e, "overlap");
    CHECK_ERR(df_comm_allreduce_host_f64(c, NULL, -1, &e), -EINVAL, &e, "allreduce");

    /* every rank holds the same bits (of what all ranks get: the sums, the gathers) */
    uint64_t *hs = calloc((size_t)world, sizeof *hs);
    CHECK_OK(df_comm_all_gather(c, &t.hash, hs, sizeof t.hash, &e), &e);
    for (int r = 0; r < world; r++)
        if (hs[r] != t.hash) {
            fprintf(stderr, "rank %d's results differ from rank %d's\n", r, rank);
            df_test_failures++;
        }
    free(hs);
    CHECK_OK(df_comm_barrier(c, &e), &e);
    df_comm_close(c);
    df_backend_close(be);
    return df_test_failures ? 1 : 0;
}

static int sc_alone(int rank, const char *dir)
{
    df_backend *be = cpu();
    df_comm_opts o = opts(rank, 2, dir, "alone", 1, SMALL_SLOT);
    df_err e = {0};
    df_comm *c = NULL;
    double t0 = df_now();
    CHECK_ERR(df_comm_open(be, &o, &c, &e), -ETIMEDOUT, &e, rank == 0 ? "rank(s) 1" : "rank(s) 0");
    double dt = df_now() - t0;
    CHECK(dt > 0.9 && dt < 4);
    CHECK(c == NULL);
    df_backend_close(be);
    return df_test_failures ? 1 : 0;
}

/* rank 1 joins, then vanishes without closing (as a crash would) */
static int sc_dead(int rank, const char *dir)
{
    df_backend *be = cpu();
    df_comm_opts o = opts(rank, 2, dir, "dead", 1, SMALL_SLOT);
    df_err e = {0};
    df_comm *c = NULL;
    CHECK_OK(df_comm_open(be, &o, &c, &e), &e);
    if (!c)
        return 1;
    CHECK_OK(df_comm_barrier(c, &e), &e);
    if (rank == 1)
        _exit(df_test_failures ? 1 : 0);
    double t0 = df_now();
    double v = 1;
    CHECK_ERR(df_comm_allreduce_host_f64(c, &v, 1, &e), -ETIMEDOUT, &e, "rank(s) 1");
    CHECK(df_now() - t0 < 4);
    CHECK_ERR(df_comm_barrier(c, &e), -ECONNABORTED, &e, "earlier");
    df_comm_close(c);
    df_backend_close(be);
    return df_test_failures ? 1 : 0;
}

/* rank 2 gives up while 0 and 1 wait in a collective */
static int sc_abort(int rank, const char *dir)
{
    df_backend *be = cpu();
    df_comm_opts o = opts(rank, 3, dir, "abort", 30, SMALL_SLOT);
    df_err e = {0};
    df_comm *c = NULL;
    CHECK_OK(df_comm_open(be, &o, &c, &e), &e);
    if (!c)
        return 1;
    if (rank == 2) {
        usleep(100000);
        df_comm_abort(c);
        df_comm_abort(c); /* idempotent */
        CHECK_ERR(df_comm_barrier(c, &e), -ECONNABORTED, &e, "aborted");
        df_comm_close(c);
    } else {
        double t0 = df_now();
        float send[6] = {1, 2, 3, 4, 5, 6}, recv[2];
        CHECK_ERR(df_comm_reduce_scatter_f32(c, send, recv, 2, &e), -ECONNABORTED, &e,
                  "rank 2 gave up");
        CHECK(df_now() - t0 < 5);
        CHECK_ERR(df_comm_reduce_scatter_f32(c, send, recv, 2, &e), -ECONNABORTED, &e, "earlier");
        df_comm_close(c);
    }
    df_backend_close(be);
    return df_test_failures ? 1 : 0;
}

/* rank 1 closes right after the barrier that rank 0 is still sleeping in:
 * rank 0 passes it; its next barrier fails fast, naming rank 1 */
static int sc_close_race(int rank, const char *dir)
{
    df_backend *be = cpu();
    df_comm_opts o = opts(rank, 2, dir, "close-race", 30, SMALL_SLOT);
    df_err e = {0};
    df_comm *c = NULL;
    CHECK_OK(df_comm_open(be, &o, &c, &e), &e);
    if (!c)
        return 1;
    if (rank == 1) {
        usleep(150000);
        CHECK_OK(df_comm_barrier(c, &e), &e);
        df_comm_close(c);
    } else {
        CHECK_OK(df_comm_barrier(c, &e), &e);
        double t0 = df_now();
        CHECK_ERR(df_comm_barrier(c, &e), -ECONNABORTED, &e, "rank 1 closed");
        CHECK(df_now() - t0 < 5);
        df_comm_close(c);
    }
    df_backend_close(be);
    return df_test_failures ? 1 : 0;
}

/* rank 1 was started with world 3 */
static int sc_world_mismatch(int rank, const char *dir)
{
    df_backend *be = cpu();
    df_comm_opts o = opts(rank, rank == 0 ? 2 : 3, dir, "mismatch", 30, SMALL_SLOT);
    df_err e = {0};
    df_comm *c = NULL;
    double t0 = df_now();
    if (rank == 1)
        CHECK_ERR(df_comm_open(be, &o, &c, &e), -DF_EMISMATCH, &e, "made for world 2");
    else
        CHECK_ERR(df_comm_open(be, &o, &c, &e), -ECONNABORTED, &e, "does not belong");
    CHECK(df_now() - t0 < 5);
    df_backend_close(be);
    return df_test_failures ? 1 : 0;
}

/* two processes given rank 1 of world 3 (and no rank 2, so that the join
 * cannot complete before both have come): exactly one of them is told (exit
 * 10); the others fail fast at open (exit 0) */
static int sc_dup(int rank, const char *dir)
{
    df_backend *be = cpu();
    df_comm_opts o = opts(rank, 3, dir, "dup", 30, SMALL_SLOT);
    df_err e = {0};
    df_comm *c = NULL;
    double t0 = df_now();
    int rc = df_comm_open(be, &o, &c, &e);
    int told = 0;
    if (rc == -EEXIST) {
        CHECK(strstr(e.msg, "joined twice") != NULL);
        told = 1;
    } else {
        CHECK_ERR(rc, -ECONNABORTED, &e, "does not belong");
    }
    CHECK(df_now() - t0 < 5);
    df_backend_close(be);
    return df_test_failures ? 1 : told ? 10 : 0;
}

/* one process: checks that need no peer */
static int sc_single(const char *dir)
{
    df_backend *be = cpu();
    df_err e = {0};
    df_comm *c = (df_comm *)&e;
    df_comm_opts o = opts(3, 3, dir, "single", 1, 0);
    CHECK_ERR(df_comm_open(be, &o, &c, &e), -EINVAL, &e, "rank 3 out of range for world 3");
    CHECK(c == NULL);
    o = opts(-1, 2, dir, "single", 1, 0);
    CHECK_ERR(df_comm_open(be, &o, &c, &e), -EINVAL, &e, "out of range");
    o = opts(0, 2, dir, "a/b", 1, 0);
    CHECK_ERR(df_comm_open(be, &o, &c, &e), -EINVAL, &e, "run_id");
    o = opts(0, 2, NULL, "x", 1, 0);
    CHECK_ERR(df_comm_open(be, &o, &c, &e), -EINVAL, &e, "rendezvous directory");
    o = opts(0, 0, dir, "x", 1, 0);
    CHECK_ERR(df_comm_open(be, &o, &c, &e), -EINVAL, &e, "world 0");

    /* a rendezvous file of this run_id already there: never shared */
    char p[4200];
    snprintf(p, sizeof p, "%s/.dflash-comm-reused.shm", dir);
    FILE *f = fopen(p, "w");
    CHECK(f != NULL);
    if (f)
        fclose(f);
    o = opts(0, 2, dir, "reused", 1, 0);
    CHECK_ERR(df_comm_open(be, &o, &c, &e), -EEXIST, &e, "another launch used this run_id");
    unlink(p);

    /* world 1 needs no directory and copies */
    o = opts(0, 1, NULL, NULL, 0, 0);
    CHECK_OK(df_comm_open(be, &o, &c, &e), &e);
    if (c) {
        float s[5] = {1.5f, -2, 3, 4, 5}, r[5] = {0};
        CHECK_OK(df_comm_reduce_scatter_f32(c, s, r, 5, &e), &e);
        CHECK(!memcmp(s, r, sizeof s));
        double v[2] = {0.1, -7};
        CHECK_OK(df_comm_allreduce_host_f64(c, v, 2, &e), &e);
        CHECK(v[0] == 0.1 && v[1] == -7);
        unsigned char g[3] = {9, 8, 7}, h[3] = {0};
        CHECK_OK(df_comm_all_gather(c, g, h, 3, &e), &e);
        CHECK(!memcmp(g, h, 3));
        CHECK_OK(df_comm_all_gather(c, h, h, 3, &e), &e); /* in place */
        CHECK_OK(df_comm_wait(c, &e), &e);
        CHECK_OK(df_comm_barrier(c, &e), &e);
        df_comm_abort(c); /* nothing to abort with no peers */
        df_comm_close(c);
    }
    df_comm_close(NULL);
    df_backend_close(be);
    return df_test_failures ? 1 : 0;
}

/* ---- the parent ---- */

enum { FULL1, FULL2, FULL3, BIG2, ALONE0, ALONE1, DEAD, ABORT, RACE, MISMATCH, DUP, SINGLE, NSC };
static const char *const NAMES[NSC] = {"full1", "full2", "full3", "big2", "alone0", "alone1",
                                       "dead", "abort", "close-race", "mismatch", "dup",
                                       "single"};

typedef struct child {
    pid_t pid;
    int sc, rank, status, done;
    double end; /* seconds after the start */
} child;

static const char *sc_dir(int sc)
{
    static char p[NSC][4200];
    snprintf(p[sc], sizeof p[sc], "%s/%s", base_dir, NAMES[sc]);
    return p[sc];
}

static int run_child(int sc, int rank)
{
    const char *d = sc_dir(sc);
    switch (sc) {
    case FULL1: return sc_full(rank, 1, d, SMALL_SLOT, 0);
    case FULL2: return sc_full(rank, 2, d, SMALL_SLOT, 0);
    case FULL3: return sc_full(rank, 3, d, SMALL_SLOT, 0);
    case BIG2: return sc_full(rank, 2, d, 0, 1);
    case ALONE0: return sc_alone(0, d);
    case ALONE1: return sc_alone(1, d);
    case DEAD: return sc_dead(rank, d);
    case ABORT: return sc_abort(rank, d);
    case RACE: return sc_close_race(rank, d);
    case MISMATCH: return sc_world_mismatch(rank, d);
    case DUP: return sc_dup(rank < 2 ? rank : 1, d);
    default: return sc_single(d);
    }
}

int main(void)
{
    snprintf(base_dir, sizeof base_dir, "%s", test_tmpdir("comm"));
    static const int ranks[NSC] = {1, 2, 3, 2, 1, 1, 2, 3, 2, 2, 3, 1};
    child ch[64];
    int nch = 0;
    const double t0 = df_now();
    for (int sc = 0; sc < NSC; sc++) {
        df_err e = {0};
        if (df_mkdirs(sc_dir(sc), &e)) {
            fprintf(stderr, "%s\n", e.msg);
            return 1;
        }
        for (int r = 0; r < ranks[sc]; r++) {
            fflush(NULL);
            pid_t pid = fork();
            if (pid < 0) {
                perror("fork");
                return 1;
            }
            if (pid == 0) {
                int rc = run_child(sc, r);
                if (rc != 0 && rc != 10)
                    fprintf(stderr, "[%s rank %d] %d check(s) failed\n", NAMES[sc], r,
                            df_test_failures);
                fflush(NULL);
                _exit(rc);
            }
            ch[nch++] = (child){pid, sc, r, 0, 0, 0};
        }
    }
    int left = nch;
    while (left > 0) {
        int st;
        pid_t pid = waitpid(-1, &st, WNOHANG);
        if (pid > 0) {
            for (int i = 0; i < nch; i++)
                if (ch[i].pid == pid) {
                    ch[i].status = st;
                    ch[i].done = 1;
                    ch[i].end = df_now() - t0;
                    left--;
                }
            continue;
        }
        if (df_now() - t0 > 60) {
            for (int i = 0; i < nch; i++)
                if (!ch[i].done) {
                    fprintf(stderr, "[%s rank %d] still running after 60 s: killed\n",
                            NAMES[ch[i].sc], ch[i].rank);
                    kill(ch[i].pid, SIGKILL);
                    waitpid(ch[i].pid, &st, 0);
                    ch[i].done = 1;
                    ch[i].status = -1;
                    df_test_failures++;
                }
            break;
        }
        usleep(2000);
    }
    int told = 0;
    for (int i = 0; i < nch; i++) {
        int st = ch[i].status;
        if (st == -1)
            continue;
        int code = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        if (ch[i].sc == DUP && code == 10) {
            told++;
            continue;
        }
        if (code != 0) {
            fprintf(stderr, "[%s rank %d] exited %s %d\n", NAMES[ch[i].sc], ch[i].rank,
                    WIFEXITED(st) ? "with" : "by signal", WIFEXITED(st) ? code : WTERMSIG(st));
            df_test_failures++;
        }
    }
    CHECK_EQ(told, 1);

    /* no rendezvous file outlives a run */
    for (int sc = 0; sc < NSC; sc++) {
        DIR *d = opendir(sc_dir(sc));
        struct dirent *de;
        while (d && (de = readdir(d)))
            if (!strncmp(de->d_name, ".dflash-comm-", 13)) {
                fprintf(stderr, "[%s] left behind: %s\n", NAMES[sc], de->d_name);
                df_test_failures++;
            }
        if (d)
            closedir(d);
    }
    for (int sc = 0; sc < NSC; sc++) {
        double end = 0;
        for (int i = 0; i < nch; i++)
            if (ch[i].sc == sc && ch[i].end > end)
                end = ch[i].end;
        printf("%s%s %.2f s", sc ? ", " : "", NAMES[sc], end);
    }
    printf("\ntest_comm: %d processes, %.2f s\n", nch, df_now() - t0);
    return test_main_end();
}
