/* test_gpu_comm - the NCCL transport of train/comm.h: 2 forked ranks, each
 * on its own GPU through df_backend_cuda_open(rank). Skips (77) in a build
 * without NCCL or with fewer than 2 visible GPUs; the parent never touches
 * CUDA (a CUDA context does not survive fork), each child counts devices.
 *
 * Each rank makes its inputs on the host, uploads them to a staging buffer and
 * copies that into the send buffer on the backend's stream, immediately
 * followed by the collective, no sync between (this checks that the
 * collective waits for the backend's work), and, after
 * df_comm_wait, copies the result on the backend's stream before reading it
 * back (this checks that the backend's stream waits for the collective).
 * Every rank makes both ranks' inputs (the CPU backend's fill_uniform; the
 * CUDA one is not bit-equal to it for F32) and checks the results:
 * reduce_scatter bit-exact (a sum of two floats is the same in any order),
 * all_gather out of place and in place, allreduce_host_f64 bit-exact against
 * a rank-order sum, barrier, sizes odd and large; and that the failure paths
 * work: a rank that aborts makes the other's host wait fail fast. Then the
 * ranks meet once more over TCP (common/rdv_tcp.h, a free loopback port the
 * parent picked) instead of the id file, and run a few collectives.
 *
 * `test_gpu_comm --bench`: also times reduce_scatter and all_gather of
 * 256 MiB per rank (median of 10 after 3 warm-ups) and prints the bus
 * bandwidth as nccl-tests define it. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "comm.h"
#include "dtype.h"
#include "fsutil.h"
#include "ops.h"
#include "test.h"

#define WORLD 2

static df_backend *cpu;

/* The values df_backend_fill_uniform gives, made on the CPU backend. */
static void host_uniform(void *dst, df_dtype dt, int64_t n, uint64_t seed, float lo, float hi)
{
    CHECK_OK(df_backend_fill_uniform(cpu, dst, dt, n, seed, lo, hi), NULL);
}

static uint64_t seed_of(int rank, int salt)
{
    return 1000003ull * (uint64_t)salt + (uint64_t)rank;
}

/* BF16 (the trainer's gradients on a GPU): with two ranks NCCL adds the two
 * widened values in fp32 and rounds once. in_place: into the rank's own piece
 * of send (as the trainer does). */
static void t_reduce_scatter_bf16(df_backend *be, df_comm *c, int rank, size_t count, int salt,
                                  int in_place)
{
    const size_t all = WORLD * count;
    uint16_t *send = df_backend_alloc(be, all * 2), *recv = df_backend_alloc(be, count * 2);
    uint16_t *h = malloc(all * 2), *h1 = malloc(all * 2), *got = malloc(count * 2);
    CHECK(send && recv && h && h1 && got);
    if (!send || !recv || !h || !h1 || !got)
        return;
    df_err e = {0};
    host_uniform(h, DF_DTYPE_BF16, (int64_t)all, seed_of(0, salt), -3, 3);
    host_uniform(h1, DF_DTYPE_BF16, (int64_t)all, seed_of(1, salt), -3, 3);
    CHECK_OK(df_backend_upload(be, send, rank ? h1 : h, all * 2), NULL);
    uint16_t *out = in_place ? send + (size_t)rank * count : recv;
    CHECK_OK(df_comm_reduce_scatter(c, send, out, count, DF_DTYPE_BF16, &e), &e);
    CHECK_OK(df_comm_wait(c, &e), &e);
    CHECK_OK(df_backend_download(be, got, out, count * 2), NULL);
    size_t bad = 0;
    for (size_t i = 0; i < count; i++) {
        size_t j = (size_t)rank * count + i;
        uint16_t want = df_f32_to_bf16(df_bf16_to_f32(h[j]) + df_bf16_to_f32(h1[j]));
        if (want != got[i] && bad++ < 3)
            fprintf(stderr, "rank %d reduce_scatter bf16%s count %zu [%zu]: %04x, want %04x\n",
                    rank, in_place ? " in place" : "", count, i, got[i], want);
    }
    CHECK_EQ(bad, 0);
    df_backend_free(be, send);
    df_backend_free(be, recv);
    free(h);
    free(h1);
    free(got);
}

static void t_reduce_scatter(df_backend *be, df_comm *c, int rank, size_t count, int salt)
{
    const size_t all = WORLD * count;
    float *send = df_backend_alloc(be, all * 4), *recv = df_backend_alloc(be, count * 4),
          *copy = df_backend_alloc(be, count * 4);
    float *h = malloc(all * 4), *h1 = malloc(all * 4), *got = malloc(count * 4);
    CHECK(send && recv && copy && h && h1 && got);
    if (!send || !recv || !copy || !h || !h1 || !got)
        return;
    df_err e = {0};
    /* every rank's input made on the host (the CPU backend's generator), so each
     * rank knows the others' */
    host_uniform(h, DF_DTYPE_F32, (int64_t)all, seed_of(0, salt), -3, 3);
    host_uniform(h1, DF_DTYPE_F32, (int64_t)all, seed_of(1, salt), -3, 3);
    /* uploaded to a staging buffer, then copied into send on the backend's stream right
     * before the collective: it must wait for that copy (send starts zeroed) */
    float *stage = df_backend_alloc(be, all * 4);
    CHECK(stage != NULL);
    CHECK_OK(df_backend_zero(be, send, all * 4), NULL);
    CHECK_OK(df_backend_upload(be, stage, rank ? h1 : h, all * 4), NULL);
    CHECK_OK(df_backend_copy(be, send, stage, all * 4), NULL);
    CHECK_OK(df_comm_reduce_scatter_f32(c, send, recv, count, &e), &e);
    CHECK_OK(df_comm_wait(c, &e), &e);
    CHECK_OK(df_backend_copy(be, copy, recv, count * 4), NULL);
    CHECK_OK(df_backend_download(be, got, copy, count * 4), NULL);
    size_t bad = 0;
    for (size_t i = 0; i < count; i++) {
        float want = h[(size_t)rank * count + i] + h1[(size_t)rank * count + i];
        if (memcmp(&want, &got[i], 4) && bad++ < 3)
            fprintf(stderr, "rank %d reduce_scatter count %zu [%zu]: %.9g, want %.9g\n", rank,
                    count, i, got[i], want);
    }
    CHECK_EQ(bad, 0);
    df_backend_free(be, stage);
    df_backend_free(be, send);
    df_backend_free(be, recv);
    df_backend_free(be, copy);
    free(h);
    free(h1);
    free(got);
}

static void t_all_gather(df_backend *be, df_comm *c, int rank, size_t bytes, int in_place,
                         int salt)
{
    const size_t all = WORLD * bytes;
    /* bytes as BF16 pairs from fill_uniform (any bit pattern will do) */
    const size_t n16 = (bytes + 1) / 2;
    unsigned char *recv = df_backend_alloc(be, all + 2), *send = df_backend_alloc(be, n16 * 2);
    unsigned char *want = malloc(WORLD * n16 * 2), *got = malloc(all);
    CHECK(recv && send && want && got);
    if (!recv || !send || !want || !got)
        return;
    df_err e = {0};
    CHECK_OK(df_backend_zero(be, recv, all), NULL);
    for (int r = 0; r < WORLD; r++) /* every rank's part, made on the host */
        host_uniform(want + (size_t)r * n16 * 2, DF_DTYPE_BF16, (int64_t)n16, seed_of(r, salt),
                     -100, 100);
    /* through a staging buffer and a copy on the backend's stream (see reduce_scatter) */
    unsigned char *stage = df_backend_alloc(be, n16 * 2);
    CHECK(stage != NULL);
    CHECK_OK(df_backend_zero(be, send, n16 * 2), NULL);
    CHECK_OK(df_backend_upload(be, stage, want + (size_t)rank * n16 * 2, n16 * 2), NULL);
    CHECK_OK(df_backend_copy(be, send, stage, n16 * 2), NULL);
    const void *src = send;
    if (in_place) {
        CHECK_OK(df_backend_copy(be, recv + (size_t)rank * bytes, send, bytes), NULL);
        src = recv + (size_t)rank * bytes;
    }
    CHECK_OK(df_comm_all_gather(c, src, recv, bytes, &e), &e);
    CHECK_OK(df_comm_wait(c, &e), &e);
    CHECK_OK(df_backend_download(be, got, recv, all), NULL);
    for (int r = 0; r < WORLD; r++)
        if (memcmp(got + (size_t)r * bytes, want + (size_t)r * n16 * 2, bytes)) {
            fprintf(stderr, "rank %d all_gather %zu bytes%s: rank %d's part is wrong\n", rank,
                    bytes, in_place ? " in place" : "", r);
            df_test_failures++;
        }
    df_backend_free(be, recv);
    df_backend_free(be, send);
    df_backend_free(be, stage);
    free(want);
    free(got);
}

static void t_allreduce(df_comm *c, int rank, int n, int salt)
{
    double *v = malloc((size_t)n * 8), *want = malloc((size_t)n * 8);
    for (int i = 0; i < n; i++) {
        uint64_t s = seed_of(0, salt) + (uint64_t)i * 7919;
        double a = (double)(test_rand(&s) >> 11) * 0x1p-40, b;
        want[i] = a;
        s = seed_of(1, salt) + (uint64_t)i * 7919;
        b = (double)(test_rand(&s) >> 11) * 0x1p-20;
        want[i] = a + b;
        v[i] = rank == 0 ? a : b;
    }
    df_err e = {0};
    CHECK_OK(df_comm_allreduce_host_f64(c, v, n, &e), &e);
    CHECK(memcmp(v, want, (size_t)n * 8) == 0);
    free(v);
    free(want);
}

static double median(double *t, int n)
{
    for (int i = 1; i < n; i++)
        for (int j = i; j > 0 && t[j] < t[j - 1]; j--) {
            double x = t[j];
            t[j] = t[j - 1];
            t[j - 1] = x;
        }
    return t[n / 2];
}

static void bench(df_backend *be, df_comm *c, int rank)
{
    const size_t bytes = (size_t)256 << 20, count = bytes / 4;
    float *send = df_backend_alloc(be, WORLD * bytes), *recv = df_backend_alloc(be, WORLD * bytes);
    if (!send || !recv)
        return;
    df_err e = {0};
    df_backend_zero(be, send, WORLD * bytes);
    double trs[10], tag[10];
    for (int it = -3; it < 10; it++) {
        df_comm_barrier(c, &e);
        double t0 = df_now();
        df_comm_reduce_scatter_f32(c, send, recv, count, &e);
        df_comm_wait(c, &e);
        df_backend_sync(be);
        double t1 = df_now();
        df_comm_barrier(c, &e);
        double t2 = df_now();
        df_comm_all_gather(c, recv, send, bytes, &e);
        df_comm_wait(c, &e);
        df_backend_sync(be);
        double t3 = df_now();
        if (it >= 0) {
            trs[it] = t1 - t0;
            tag[it] = t3 - t2;
        }
    }
    /* bus bandwidth (nccl-tests): bytes per rank * (world-1)/world / time,
     * "bytes per rank" being the output of all_gather, the input of reduce_scatter */
    double f = (double)(WORLD - 1) / WORLD, total = (double)WORLD * bytes;
    if (rank == 0)
        printf("bench: reduce_scatter_f32 %zu MiB/rank out: %.2f ms (bus %.0f GB/s); "
               "all_gather: %.2f ms (bus %.0f GB/s)\n", bytes >> 20, median(trs, 10) * 1e3,
               total * f / median(trs, 10) / 1e9, median(tag, 10) * 1e3,
               total * f / median(tag, 10) / 1e9);
    df_backend_free(be, send);
    df_backend_free(be, recv);
}

static int child(int rank, const char *dir, int do_bench, int port)
{
    int n = df_backend_cuda_device_count();
    if (n < WORLD) {
        if (rank == 0)
            printf("skip: %d CUDA device(s) visible, need %d\n", n < 0 ? 0 : n, WORLD);
        return 77;
    }
    df_err e = {0};
    cpu = df_backend_cpu_open(1, &e);
    df_backend *be = df_backend_cuda_open(rank, &e);
    if (!cpu || !be) {
        fprintf(stderr, "rank %d: %s\n", rank, e.msg);
        return 1;
    }
    df_comm_opts o = {.rank = rank, .world = WORLD, .rdv_dir = dir, .run_id = "gpu-comm.1",
                      .timeout_s = 60};
    df_comm *c = NULL;
    double t0 = df_now();
    CHECK_OK(df_comm_open(be, &o, &c, &e), &e);
    if (!c)
        return 1;
    if (rank == 0)
        printf("open: %.2f s (%s)\n", df_now() - t0, df_comm_transport(c));
    CHECK(!strcmp(df_comm_transport(c), "nccl"));

    const size_t counts[] = {1, 7, 1000, 65537, (size_t)3 << 20};
    for (size_t i = 0; i < sizeof counts / sizeof *counts; i++) {
        t_reduce_scatter(be, c, rank, counts[i], 1 + (int)i);
        t_reduce_scatter_bf16(be, c, rank, counts[i], 50 + (int)i, 0);
        t_reduce_scatter_bf16(be, c, rank, counts[i], 70 + (int)i, 1);
    }
    const size_t sizes[] = {1, 3, 4097, 1000001, (size_t)9 << 20};
    for (size_t i = 0; i < sizeof sizes / sizeof *sizes; i++) {
        t_all_gather(be, c, rank, sizes[i], 0, 20 + (int)i);
        t_all_gather(be, c, rank, sizes[i], 1, 40 + (int)i);
    }
    t_allreduce(c, rank, 1, 60);
    t_allreduce(c, rank, 5000, 61); /* more than the first host-sum buffer */
    t_allreduce(c, rank, 3, 62);
    for (int i = 0; i < 5; i++)
        CHECK_OK(df_comm_barrier(c, &e), &e);
    /* several collectives in flight before one wait */
    t0 = df_now();
    for (int i = 0; i < 20; i++)
        t_reduce_scatter(be, c, rank, 4099, 100 + i);
    if (rank == 0)
        printf("20 checked reduce_scatters of 4099 floats: %.2f ms each\n", (df_now() - t0) * 50);
    if (do_bench)
        bench(be, c, rank);
    CHECK_OK(df_comm_barrier(c, &e), &e);
    df_comm_close(c);

    /* the id over TCP: no .nccl-id file, the same collectives */
    df_comm_opts ot = o;
    ot.run_id = "gpu-comm.tcp";
    ot.master_addr = "127.0.0.1";
    ot.master_port = port;
    c = NULL;
    t0 = df_now();
    CHECK_OK(df_comm_open(be, &ot, &c, &e), &e);
    if (c) {
        if (rank == 0)
            printf("open over TCP (port %d): %.2f s\n", port, df_now() - t0);
        char idf[4200];
        snprintf(idf, sizeof idf, "%s/.dflash-comm-gpu-comm.tcp.nccl-id", dir);
        CHECK(access(idf, F_OK) != 0);
        t_reduce_scatter(be, c, rank, 65537, 200);
        t_all_gather(be, c, rank, 4097, 0, 201);
        t_allreduce(c, rank, 5, 202);
        CHECK_OK(df_comm_barrier(c, &e), &e);
        df_comm_close(c);
    }

    /* abort: rank 1 gives up, rank 0's host wait fails fast (not after 60 s) */
    o.run_id = "gpu-comm.abort";
    c = NULL;
    CHECK_OK(df_comm_open(be, &o, &c, &e), &e);
    if (c) {
        if (rank == 1) {
            usleep(200000);
            df_comm_abort(c);
            df_comm_close(c);
        } else {
            t0 = df_now();
            double v = 1;
            CHECK_ERR(df_comm_allreduce_host_f64(c, &v, 1, &e), -ECONNABORTED, &e, "gave up");
            CHECK(df_now() - t0 < 10);
            printf("abort seen after %.2f s: %s\n", df_now() - t0, e.msg);
            df_comm_close(c);
        }
    }
    df_backend_close(be);
    df_backend_close(cpu);
    return df_test_failures ? 1 : 0;
}

int main(int argc, char **argv)
{
#ifndef DFLASH_HAVE_NCCL
    printf("skip: built without NCCL\n");
    return 77;
#endif
    int do_bench = argc > 1 && !strcmp(argv[1], "--bench");
    const char *dir = test_tmpdir("gpu_comm");
    /* a free loopback port for the TCP rendezvous: bound to port 0, read, released */
    int port = 0, sfd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    socklen_t al = sizeof a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (sfd >= 0 && bind(sfd, (struct sockaddr *)&a, sizeof a) == 0 &&
        getsockname(sfd, (struct sockaddr *)&a, &al) == 0)
        port = ntohs(a.sin_port);
    if (sfd >= 0)
        close(sfd);
    if (!port) {
        perror("picking a port");
        return 1;
    }
    pid_t pids[WORLD];
    fflush(NULL);
    for (int r = 0; r < WORLD; r++) {
        pids[r] = fork();
        if (pids[r] < 0) {
            perror("fork");
            return 1;
        }
        if (pids[r] == 0) {
            int rc = child(r, dir, do_bench, port);
            fflush(NULL);
            _exit(rc);
        }
    }
    int skipped = 0;
    for (int r = 0; r < WORLD; r++) {
        int st = 0;
        waitpid(pids[r], &st, 0);
        int code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
        if (code == 77)
            skipped++;
        else if (code != 0) {
            fprintf(stderr, "rank %d exited %d\n", r, code);
            df_test_failures++;
        }
    }
    if (skipped == WORLD)
        return 77;
    CHECK_EQ(skipped, 0);
    return test_main_end();
}
