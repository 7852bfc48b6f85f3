/* test_rdv_tcp - the TCP rendezvous (common/rdv_tcp.h) over loopback, one
 * forked process per rank, each case on a port of its own (picked by binding
 * port 0 on 127.0.0.1, all at once so that no two cases share one, then
 * released).
 *
 * Cases: world 4, every peer gets rank 0's exact blob; peers started before
 * rank 0 (their connects are refused and retried); a rank that never comes
 * (rank 0 names it, the joined peer hears rank 0 gave up); another world
 * size; another run_id (refused as a stranger, rank 0 goes on and names it
 * when it times out); a rank given twice; junk clients (random bytes, a
 * connect-and-close, a stalled half hello, a hello with a bad crc, a flood
 * of bytes) while the real ranks join; no rank 0 at all (the peers' error
 * names the address). Then the frame codec and bad options, in-process.
 * Timeouts are 1-3 s; the whole test takes a few seconds. Every child sets
 * alarm(10), so a hang fails instead of blocking ctest. */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "rdv_tcp.h"
#include "test.h"

#define BLOB 128 /* the size of an ncclUniqueId */
#define MAXP 8

enum { RANK, JUNK_RANDOM, JUNK_CLOSE, JUNK_STALL, JUNK_BADCRC, JUNK_FLOOD };

typedef struct spec {
    int kind, rank, world;
    const char *run_id;
    int delay_ms, timeout_ms;
} spec;

typedef struct result {
    int rc;
    uint32_t len;
    uint8_t blob[BLOB];
    char msg[512];
} result;

static void msleep(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void make_blob(uint8_t *b, int port)
{
    uint64_t s = (uint64_t)port * 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < BLOB; i++)
        b[i] = (uint8_t)(test_rand(&s) >> 56);
}

static int connect_lo(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a;
    memset(&a, 0, sizeof a);
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)port);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    for (int i = 0; i < 200; i++) { /* until rank 0 listens */
        if (connect(fd, (struct sockaddr *)&a, sizeof a) == 0)
            return fd;
        close(fd);
        msleep(10);
        fd = socket(AF_INET, SOCK_STREAM, 0);
    }
    close(fd);
    return -1;
}

static void junk(int kind, int port)
{
    int fd = connect_lo(port);
    if (fd < 0)
        return;
    uint8_t b[4096];
    uint64_t s = (uint64_t)kind * 77 + 1;
    for (size_t i = 0; i < sizeof b; i++)
        b[i] = (uint8_t)(test_rand(&s) >> 56);
    if (kind == JUNK_RANDOM) {
        (void)!write(fd, b, DF_RDV_FRAME);
        msleep(300);
    } else if (kind == JUNK_STALL) {
        (void)!write(fd, "DFRDVHI\n\1\0", 10);
        msleep(1500);
    } else if (kind == JUNK_BADCRC) {
        df_rdv_frame f = {.hello = 1, .code = 1, .world = 3};
        snprintf(f.run_id, sizeof f.run_id, "t");
        uint8_t fr[DF_RDV_FRAME];
        if (df_rdv_frame_encode(&f, NULL, fr, NULL) == 0) {
            fr[DF_RDV_FRAME - 1] ^= 0x40;
            (void)!write(fd, fr, sizeof fr);
        }
        msleep(300);
    } else if (kind == JUNK_FLOOD) {
        (void)!write(fd, b, sizeof b);
        msleep(300);
    }
    close(fd);
}

/* Runs the processes of one case and collects each rank's result. */
static void run_case(int port, const spec *sp, int n, result *res)
{
    pid_t pid[MAXP];
    int rd[MAXP];
    for (int i = 0; i < n; i++) {
        int p[2];
        if (pipe(p) != 0) {
            perror("pipe");
            exit(1);
        }
        pid[i] = fork();
        if (pid[i] == 0) {
            alarm(10);
            close(p[0]);
            msleep(sp[i].delay_ms);
            result r;
            memset(&r, 0, sizeof r);
            if (sp[i].kind != RANK) {
                junk(sp[i].kind, port);
            } else {
                df_rdv_opts o = {.master_addr = "127.0.0.1", .master_port = port,
                                 .rank = sp[i].rank, .world = sp[i].world,
                                 .run_id = sp[i].run_id, .timeout_ms = sp[i].timeout_ms};
                df_err e = {0};
                size_t len = BLOB;
                if (sp[i].rank == 0)
                    make_blob(r.blob, port);
                r.rc = df_rdv_tcp(&o, r.blob, &len, sizeof r.blob, &e);
                r.len = (uint32_t)len;
                snprintf(r.msg, sizeof r.msg, "%s", r.rc ? e.msg : "");
            }
            (void)!write(p[1], &r, sizeof r);
            _exit(0);
        }
        close(p[1]);
        rd[i] = p[0];
    }
    for (int i = 0; i < n; i++) {
        memset(&res[i], 0, sizeof res[i]);
        res[i].rc = 12345; /* no answer */
        size_t got = 0;
        while (got < sizeof res[i]) {
            ssize_t k = read(rd[i], (char *)&res[i] + got, sizeof res[i] - got);
            if (k <= 0)
                break;
            got += (size_t)k;
        }
        close(rd[i]);
        int st = 0;
        waitpid(pid[i], &st, 0);
        if (!WIFEXITED(st) || WEXITSTATUS(st)) {
            fprintf(stderr, "port %d: process %d died (status %d)\n", port, i, st);
            df_test_failures++;
        }
    }
}

static void check_ok(const result *r, int port, const char *what)
{
    uint8_t want[BLOB];
    make_blob(want, port);
    if (r->rc) {
        fprintf(stderr, "%s: rc %d: %s\n", what, r->rc, r->msg);
        df_test_failures++;
        return;
    }
    CHECK_EQ(r->len, BLOB);
    CHECK(!memcmp(r->blob, want, BLOB));
}

static void check_fail(const result *r, int code, const char *needle, const char *what)
{
    if (r->rc != code || !strstr(r->msg, needle)) {
        fprintf(stderr, "%s: want rc %d with '%s', got rc %d: %s\n", what, code, needle, r->rc,
                r->msg);
        df_test_failures++;
    } else {
        printf("  %s: %s\n", what, r->msg);
    }
}

/* n distinct free loopback ports, held until all are picked. */
static void free_ports(int *ports, int n)
{
    int fds[16];
    for (int i = 0; i < n; i++) {
        fds[i] = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a;
        memset(&a, 0, sizeof a);
        a.sin_family = AF_INET;
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        socklen_t l = sizeof a;
        if (bind(fds[i], (struct sockaddr *)&a, sizeof a) || listen(fds[i], 1) ||
            getsockname(fds[i], (struct sockaddr *)&a, &l)) {
            perror("picking a port");
            exit(1);
        }
        ports[i] = ntohs(a.sin_port);
    }
    for (int i = 0; i < n; i++)
        close(fds[i]);
}

static void test_codec(void)
{
    df_rdv_frame f = {.hello = 0, .code = 0, .world = 7, .len = 5}, g;
    snprintf(f.run_id, sizeof f.run_id, "run-1.a_B");
    uint8_t fr[DF_RDV_FRAME];
    df_err e;
    CHECK_OK(df_rdv_frame_encode(&f, "hello", fr, &e), &e);
    CHECK_OK(df_rdv_frame_decode(fr, &g, &e), &e);
    CHECK_OK(df_rdv_frame_check_crc(fr, "hello", 5, &e), &e);
    CHECK(!g.hello && g.world == 7 && g.len == 5 && !strcmp(g.run_id, "run-1.a_B"));
    CHECK_ERR(df_rdv_frame_check_crc(fr, "hellO", 5, &e), -DF_ECORRUPT, &e, "crc");
    /* every single-byte change is caught by the decoder or the crc */
    for (int i = 0; i < DF_RDV_FRAME; i++) {
        uint8_t b[DF_RDV_FRAME];
        memcpy(b, fr, sizeof b);
        b[i] ^= 0x01;
        int bad = df_rdv_frame_decode(b, &g, &e) || df_rdv_frame_check_crc(b, "hello", 5, &e);
        if (!bad) {
            fprintf(stderr, "byte %d flipped went through\n", i);
            df_test_failures++;
        }
    }
    uint8_t b[DF_RDV_FRAME];
    memcpy(b, fr, sizeof b);
    b[8] = 2;
    CHECK_ERR(df_rdv_frame_decode(b, &g, &e), -DF_ECORRUPT, &e, "version");
    snprintf(f.run_id, sizeof f.run_id, "bad id");
    CHECK_ERR(df_rdv_frame_encode(&f, "hello", fr, &e), -EINVAL, &e, "run_id");
    snprintf(f.run_id, sizeof f.run_id, "x");
    f.len = DF_RDV_MAX_PAYLOAD + 1;
    CHECK_ERR(df_rdv_frame_encode(&f, "hello", fr, &e), -EINVAL, &e, "payload");
    /* a 64-character run_id fills the field with no NUL */
    memset(f.run_id, 'a', DF_RDV_RUN_ID_MAX);
    f.run_id[DF_RDV_RUN_ID_MAX] = 0;
    f.len = 0;
    CHECK_OK(df_rdv_frame_encode(&f, NULL, fr, &e), &e);
    CHECK_OK(df_rdv_frame_decode(fr, &g, &e), &e);
    CHECK(!strcmp(g.run_id, f.run_id));

    uint8_t blob[8];
    size_t len = 8;
    df_rdv_opts o = {.master_addr = "127.0.0.1", .master_port = 0, .rank = 0, .world = 2,
                     .run_id = "r", .timeout_ms = 100};
    CHECK_ERR(df_rdv_tcp(&o, blob, &len, 8, &e), -EINVAL, &e, "port");
    o.master_port = 65536;
    CHECK_ERR(df_rdv_tcp(&o, blob, &len, 8, &e), -EINVAL, &e, "port");
    o.master_port = 1000;
    o.rank = 2;
    CHECK_ERR(df_rdv_tcp(&o, blob, &len, 8, &e), -EINVAL, &e, "rank 2 of world 2");
    o.rank = 1;
    o.run_id = "a/b";
    CHECK_ERR(df_rdv_tcp(&o, blob, &len, 8, &e), -EINVAL, &e, "run_id");
    o.run_id = "r";
    o.master_addr = NULL;
    CHECK_ERR(df_rdv_tcp(&o, blob, &len, 8, &e), -EINVAL, &e, "MASTER_ADDR");
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN); /* a failing library would still not kill the parent */
    test_codec();
    int port[8];
    free_ports(port, 8);
    result r[MAXP];

    { /* world 4: everyone at once */
        spec s[] = {{RANK, 0, 4, "ok4", 0, 3000}, {RANK, 1, 4, "ok4", 0, 3000},
                    {RANK, 2, 4, "ok4", 0, 3000}, {RANK, 3, 4, "ok4", 0, 3000}};
        run_case(port[0], s, 4, r);
        for (int i = 0; i < 4; i++)
            check_ok(&r[i], port[0], "world 4");
    }
    { /* the peers first: refused connects are retried */
        spec s[] = {{RANK, 1, 3, "late0", 0, 3000}, {RANK, 2, 3, "late0", 0, 3000},
                    {RANK, 0, 3, "late0", 400, 3000}};
        run_case(port[1], s, 3, r);
        for (int i = 0; i < 3; i++)
            check_ok(&r[i], port[1], "rank 0 late");
    }
    { /* rank 2 never comes */
        spec s[] = {{RANK, 0, 3, "miss", 0, 1000}, {RANK, 1, 3, "miss", 0, 3000}};
        run_case(port[2], s, 2, r);
        check_fail(&r[0], -ETIMEDOUT, "rank(s) 2 never joined", "missing rank, rank 0");
        check_fail(&r[1], -ECONNABORTED, "gave up: rdv: rank 0", "missing rank, rank 1");
    }
    { /* rank 2 was given another world size */
        spec s[] = {{RANK, 0, 3, "wm", 0, 3000}, {RANK, 1, 3, "wm", 0, 3000},
                    {RANK, 2, 4, "wm", 800, 3000}}; /* after rank 1 has joined */
        run_case(port[3], s, 3, r);
        check_fail(&r[0], -DF_EMISMATCH, "rank 2 was started with world 4", "world, rank 0");
        check_fail(&r[1], -ECONNABORTED, "world 4", "world, rank 1");
        check_fail(&r[2], -DF_EMISMATCH, "refused this rank", "world, rank 2");
    }
    { /* another launch's rank on this port */
        spec s[] = {{RANK, 0, 2, "runA", 0, 1000}, {RANK, 1, 2, "runB", 0, 1000}};
        run_case(port[4], s, 2, r);
        check_fail(&r[0], -ETIMEDOUT, "rank 1 of run_id 'runB'", "run_id, rank 0");
        check_fail(&r[1], -DF_EMISMATCH, "serves run_id 'runA', not 'runB'", "run_id, rank 1");
    }
    { /* rank 1 twice */
        spec s[] = {{RANK, 0, 3, "dup", 0, 3000}, {RANK, 1, 3, "dup", 0, 3000},
                    {RANK, 1, 3, "dup", 800, 3000}}; /* after the first has joined */
        run_case(port[5], s, 3, r);
        check_fail(&r[0], -EEXIST, "rank 1 joined twice", "duplicate, rank 0");
        check_fail(&r[1], -ECONNABORTED, "joined twice", "duplicate, first rank 1");
        check_fail(&r[2], -EEXIST, "joined twice", "duplicate, second rank 1");
    }
    { /* junk before and among the real ranks */
        spec s[] = {{RANK, 0, 3, "t", 0, 3000},         {JUNK_RANDOM, 0, 0, NULL, 0, 0},
                    {JUNK_CLOSE, 0, 0, NULL, 0, 0},     {JUNK_STALL, 0, 0, NULL, 0, 0},
                    {JUNK_BADCRC, 0, 0, NULL, 0, 0},    {JUNK_FLOOD, 0, 0, NULL, 0, 0},
                    {RANK, 1, 3, "t", 200, 3000},       {RANK, 2, 3, "t", 250, 3000}};
        run_case(port[6], s, 8, r);
        check_ok(&r[0], port[6], "junk, rank 0");
        check_ok(&r[6], port[6], "junk, rank 1");
        check_ok(&r[7], port[6], "junk, rank 2");
    }
    { /* no rank 0 */
        spec s[] = {{RANK, 1, 3, "none", 0, 1000}, {RANK, 2, 3, "none", 0, 1000}};
        run_case(port[7], s, 2, r);
        char hp[64];
        snprintf(hp, sizeof hp, "rank 0 at 127.0.0.1:%d (MASTER_ADDR:MASTER_PORT)", port[7]);
        check_fail(&r[0], -ETIMEDOUT, hp, "no rank 0, rank 1");
        check_fail(&r[1], -ETIMEDOUT, hp, "no rank 0, rank 2");
    }
    return test_main_end();
}
