/* test_io.c - the I/O engine, on both backends.
 *
 * The same suite runs on io_uring (when this machine has it) and on the
 * thread pool (forced through opts, then through DFLASH_IO=threads): an
 * O_DIRECT round trip of random data with more requests than queue_depth,
 * registered and plain buffers, small max_op pieces (the short-transfer
 * path), EOF (aligned and unaligned), a real short write (RLIMIT_FSIZE),
 * fsync, and error completions. A forked child with no free file
 * descriptors checks the automatic fallback and its single log line.
 */
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "io.h"
#include "knobs.h"
#include "log.h"
#include "test.h"

#define DEPTH 8u

static char g_dir[1024];

static void fill_random(uint8_t *p, size_t n, uint64_t *s)
{
    for (size_t i = 0; i < n; i += 8) {
        uint64_t v = test_rand(s);
        for (size_t j = 0; j < 8 && i + j < n; j++) {
            uint8_t b = (uint8_t)(v >> (8 * j));
            p[i + j] = b ? b : 0x5a; /* non-zero: a zeroed buffer never matches by luck */
        }
    }
}

static df_io *open_engine(int fallback, unsigned depth)
{
    df_err e_ = {0}, *e = &e_;
    df_io_opts o = {.queue_depth = depth, .force_fallback = fallback, .nthreads = 0};
    df_io *io = df_io_open(&o, e);
    CHECK_OK(io ? 0 : -1, e);
    if (io && fallback)
        CHECK(!strcmp(df_io_backend(io), "threads"));
    if (io)
        CHECK_EQ(df_io_depth(io), depth);
    return io;
}

typedef struct job {
    int op; /* 0 read, 1 write, 2 fsync */
    int fd;
    uint8_t *buf;
    size_t len;
    uint64_t off;
    int bi;
    int64_t res;
    int seen;
} job;

/* Submits every job in the given order, reaping whenever the engine says
 * -EBUSY, and collects each result by tag. Reaps with a small max so that
 * completions are left over between calls. Returns how many -EBUSY it saw. */
static int run_jobs(df_io *io, job *jobs, const unsigned *order, unsigned n)
{
    int busy = 0;
    unsigned reaped = 0;
    df_io_cqe cq[3];
    for (unsigned k = 0; k < n;) {
        job *j = &jobs[order ? order[k] : k];
        int rc = j->op == 0   ? df_io_read(io, j->fd, j->buf, j->len, j->off, order ? order[k] : k, j->bi)
                 : j->op == 1 ? df_io_write(io, j->fd, j->buf, j->len, j->off, order ? order[k] : k, j->bi)
                              : df_io_fsync(io, j->fd, order ? order[k] : k);
        if (rc == -EBUSY) {
            busy++;
            CHECK_EQ(df_io_inflight(io), df_io_depth(io));
            int got = df_io_wait(io, cq, 3, 1);
            CHECK(got >= 1);
            for (int i = 0; i < got; i++) {
                CHECK(cq[i].tag < n && !jobs[cq[i].tag].seen);
                jobs[cq[i].tag].res = cq[i].res;
                jobs[cq[i].tag].seen = 1;
            }
            reaped += got > 0 ? (unsigned)got : 0;
            if (got <= 0)
                return busy;
            continue;
        }
        CHECK_EQ(rc, 0);
        if (rc != 0)
            return busy;
        k++;
    }
    while (reaped < n) {
        int got = df_io_wait(io, cq, 3, 3);
        CHECK(got >= 1);
        if (got <= 0)
            break;
        for (int i = 0; i < got; i++) {
            CHECK(cq[i].tag < n && !jobs[cq[i].tag].seen);
            jobs[cq[i].tag].res = cq[i].res;
            jobs[cq[i].tag].seen = 1;
        }
        reaped += (unsigned)got;
    }
    CHECK_EQ(df_io_inflight(io), 0);
    return busy;
}

/* One job, waited for; returns its res. */
static int64_t one(df_io *io, int op, int fd, void *buf, size_t len, uint64_t off, int bi)
{
    job j = {.op = op, .fd = fd, .buf = buf, .len = len, .off = off, .bi = bi};
    run_jobs(io, &j, NULL, 1);
    CHECK(j.seen);
    return j.res;
}

/* Writes T bytes of random data in random-sized, randomly ordered O_DIRECT
 * pieces (some through registered buffers, some crossing a registered
 * buffer's end, some plain), fsyncs, reads back in other pieces, compares. */
static void roundtrip(df_io *io, const char *name, size_t max_op, uint64_t seed)
{
    df_err e_ = {0}, *e = &e_;
    char path[1200];
    snprintf(path, sizeof path, "%s/%s", g_dir, name);
    const size_t T = (6u << 20) + 3 * 4096;
    uint8_t *src = df_io_alloc(T), *dst = df_io_alloc(T);
    CHECK(src && dst && ((uintptr_t)src & 4095) == 0 && ((uintptr_t)dst & 4095) == 0);
    if (!src || !dst)
        goto out;
    uint64_t s = seed;
    fill_random(src, T, &s);
    memset(dst, 0, T);
    df_io_set_max_op(io, max_op);

    int direct = 0;
    int fd = df_io_open_file(path, O_RDWR | O_CREAT | O_TRUNC, 0644, 1, &direct, e);
    CHECK_OK(fd, e);
    if (fd < 0)
        goto out;
    if (!direct)
        fprintf(stderr, "note: %s is not on an O_DIRECT file system\n", g_dir);
    size_t al = df_io_align(fd);
    CHECK(al >= 1 && al <= 4096 && (al & (al - 1)) == 0);

    const size_t half = (T / 2) & ~(size_t)4095;
    struct iovec iov[2] = {{src, half}, {src + half, T - half}};
    /* 1 on io_uring unless RLIMIT_MEMLOCK is tiny (non-root); 0 on the pool. */
    int uring = !strcmp(df_io_backend(io), "io_uring");
    int reg = df_io_register_buffers(io, iov, 2);
    CHECK(uring ? (reg == 0 || reg == 1) : reg == 0);
    if (uring && reg == 0)
        fprintf(stderr, "note: buffer registration refused; fixed-buffer path untested\n");

    enum { MAXJ = 256 };
    job jobs[MAXJ];
    unsigned order[MAXJ], n = 0;
    for (size_t off = 0; off < T && n < MAXJ; n++) {
        size_t len = 4096 * (1 + test_rand(&s) % 64);
        if (len > T - off)
            len = T - off;
        int bi = n % 3 == 0 ? -1 : (off < half ? 0 : 1);
        jobs[n] = (job){.op = 1, .fd = fd, .buf = src + off, .len = len, .off = off, .bi = bi};
        off += len;
    }
    for (unsigned i = 0; i < n; i++)
        order[i] = i;
    for (unsigned i = n - 1; i > 0; i--) {
        unsigned k = (unsigned)(test_rand(&s) % (i + 1)), t = order[i];
        order[i] = order[k];
        order[k] = t;
    }
    CHECK(n > 2 * DEPTH);
    int busy = run_jobs(io, jobs, order, n);
    CHECK(busy > 0);
    for (unsigned i = 0; i < n; i++) {
        CHECK(jobs[i].seen);
        CHECK_EQ(jobs[i].res, (int64_t)jobs[i].len);
    }
    CHECK_EQ(one(io, 2, fd, NULL, 0, 0, -1), 0);
    struct stat st;
    CHECK(fstat(fd, &st) == 0 && (size_t)st.st_size == T);

    /* Read back in fixed 192 KiB pieces into registered dst halves. */
    struct iovec iov2[2] = {{dst, half}, {dst + half, T - half}};
    CHECK(df_io_register_buffers(io, iov2, 2) == reg);
    n = 0;
    for (size_t off = 0; off < T; off += 192 << 10, n++) {
        size_t len = T - off < (192u << 10) ? T - off : 192u << 10;
        jobs[n] = (job){.op = 0, .fd = fd, .buf = dst + off, .len = len, .off = off,
                        .bi = n % 2 ? -1 : (off < half ? 0 : 1)};
    }
    run_jobs(io, jobs, NULL, n);
    for (unsigned i = 0; i < n; i++)
        CHECK_EQ(jobs[i].res, (int64_t)jobs[i].len);
    CHECK(memcmp(src, dst, T) == 0);

    /* EOF: a read crossing the end completes short; at or past it, 0. */
    memset(dst, 0, 65536);
    CHECK_EQ(one(io, 0, fd, dst, 65536, T - 4096, -1), 4096);
    CHECK(memcmp(dst, src + T - 4096, 4096) == 0);
    CHECK_EQ(one(io, 0, fd, dst, 4096, T, 0), 0);
    CHECK_EQ(one(io, 0, fd, dst, 4096, T + (1u << 20), -1), 0);

    /* Registered-buffer indices: out of range is a submit error, never I/O. */
    CHECK_EQ(df_io_read(io, fd, dst, 4096, 0, 0, 7), -EINVAL);
    CHECK_EQ(df_io_register_buffers(io, NULL, 0), 0);
    CHECK_EQ(df_io_read(io, fd, dst, 4096, 0, 0, 0), -EINVAL);
    CHECK_EQ(df_io_inflight(io), 0);
    close(fd);
    unlink(path);

    /* An O_DIRECT read stopping at an unaligned EOF (10000 bytes) must be
     * seen as EOF, not reissued at offset 10000 (which O_DIRECT refuses). */
    snprintf(path, sizeof path, "%s/%s.odd", g_dir, name);
    fd = df_io_open_file(path, O_RDWR | O_CREAT | O_TRUNC, 0644, 0, NULL, e);
    CHECK_OK(fd, e);
    CHECK_EQ(pwrite(fd, src, 10000, 0), 10000);
    close(fd);
    fd = df_io_open_file(path, O_RDONLY, 0, 1, NULL, e);
    CHECK_OK(fd, e);
    memset(dst, 0, 16384);
    CHECK_EQ(one(io, 0, fd, dst, 16384, 0, -1), 10000);
    CHECK(memcmp(dst, src, 10000) == 0);
    close(fd);
    unlink(path);
out:
    df_io_set_max_op(io, 0);
    free(src);
    free(dst);
}

/* A real short write: the file size limit cuts the first write short, the
 * engine reissues the remainder, which the kernel refuses with EFBIG. */
static void short_write(df_io *io, const char *name)
{
    df_err e_ = {0}, *e = &e_;
    char path[1200];
    snprintf(path, sizeof path, "%s/%s.fsize", g_dir, name);
    int fd = df_io_open_file(path, O_RDWR | O_CREAT | O_TRUNC, 0644, 0, NULL, e);
    CHECK_OK(fd, e);
    if (fd < 0)
        return;
    uint8_t *buf = df_io_alloc(256 << 10);
    uint64_t s = 77;
    fill_random(buf, 256 << 10, &s);
    struct rlimit old, lim;
    CHECK(getrlimit(RLIMIT_FSIZE, &old) == 0);
    lim = old;
    lim.rlim_cur = 100000;
    void (*prev)(int) = signal(SIGXFSZ, SIG_IGN);
    CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0);
    int64_t res = one(io, 1, fd, buf, 256 << 10, 0, -1);
    CHECK(setrlimit(RLIMIT_FSIZE, &old) == 0);
    signal(SIGXFSZ, prev);
    CHECK_EQ(res, -EFBIG);
    struct stat st;
    CHECK(fstat(fd, &st) == 0);
    CHECK_EQ(st.st_size, 100000);
    /* The bytes that went in are the right ones. */
    uint8_t *back = malloc(100000);
    CHECK(back && pread(fd, back, 100000, 0) == 100000 && !memcmp(back, buf, 100000));
    free(back);
    free(buf);
    close(fd);
    unlink(path);
}

static void errors(df_io *io, const char *name)
{
    df_err e_ = {0}, *e = &e_;
    uint8_t *buf = df_io_alloc(8192);
    memset(buf, 0x33, 8192);

    /* Bad descriptors complete with -EBADF; nothing crashes. */
    CHECK_EQ(one(io, 0, 987654, buf, 4096, 0, -1), -EBADF);
    CHECK_EQ(one(io, 1, -1, buf, 4096, 0, -1), -EBADF);
    CHECK_EQ(one(io, 2, 987654, NULL, 0, 0, -1), -EBADF);

    /* Submit-time errors. */
    CHECK_EQ(df_io_read(io, 0, NULL, 4096, 0, 0, -1), -EINVAL);
    CHECK_EQ(df_io_write(io, 0, buf, 4096, UINT64_MAX - 10, 0, -1), -EINVAL);
    CHECK_EQ(df_io_wait(io, NULL, 1, 1), -EINVAL);
    CHECK_EQ(df_io_inflight(io), 0);

    /* Empty requests complete at once; waiting for more than is in flight
     * returns what there is. */
    CHECK_EQ(df_io_read(io, 0, buf, 0, 0, 42, -1), 0);
    df_io_cqe cq[4];
    CHECK_EQ(df_io_wait(io, cq, 4, 4), 1);
    CHECK(cq[0].tag == 42 && cq[0].res == 0);
    CHECK_EQ(df_io_wait(io, cq, 4, 4), 0);
    CHECK_EQ(df_io_submit(io) >= 0, 1);

    /* Unaligned O_DIRECT: not bounce-buffered; the kernel's verdict comes
     * back (-EINVAL on ext4/xfs, success where the fs goes buffered). */
    char path[1200];
    snprintf(path, sizeof path, "%s/%s.unal", g_dir, name);
    int direct = 0;
    int fd = df_io_open_file(path, O_RDWR | O_CREAT | O_TRUNC, 0644, 1, &direct, e);
    CHECK_OK(fd, e);
    CHECK_EQ(one(io, 1, fd, buf, 8192, 0, -1), 8192);
    int64_t r1 = one(io, 0, fd, buf, 4096, 1, -1);
    int64_t r2 = one(io, 1, fd, buf + 1, 4096, 0, -1);
    int64_t r3 = one(io, 0, fd, buf, 100, 0, -1);
    if (direct)
        fprintf(stderr, "%s: unaligned O_DIRECT results: %lld %lld %lld\n", name, (long long)r1,
                (long long)r2, (long long)r3);
    CHECK(r1 == -EINVAL || r1 == 4096);
    CHECK(r2 == -EINVAL || r2 == 4096);
    CHECK(r3 == -EINVAL || r3 == 100);
    if (!direct)
        CHECK(r1 == 4096 && r2 == 4096 && r3 == 100);

    close(fd);
    unlink(path);
    free(buf);
}

static void suite(int fallback, const char *name)
{
    df_io *io = open_engine(fallback, DEPTH);
    if (!io)
        return;
    fprintf(stderr, "%s: backend %s\n", name, df_io_backend(io));
    char nm[64];
    snprintf(nm, sizeof nm, "%s-a", name);
    roundtrip(io, nm, 0, 0x5eed0001);
    snprintf(nm, sizeof nm, "%s-b", name);
    roundtrip(io, nm, 12288, 0x5eed0002); /* 12 KiB pieces: the remainder path */
    short_write(io, name);
    errors(io, name);

    /* Closing with requests in flight waits for them (the buffer and fd
     * must outlive the close: the kernel or a worker may still use them). */
    char path[1200];
    snprintf(path, sizeof path, "%s/%s.close", g_dir, name);
    df_err e_ = {0}, *e = &e_;
    int fd = df_io_open_file(path, O_RDWR | O_CREAT | O_TRUNC, 0644, 1, NULL, e);
    CHECK_OK(fd, e);
    uint8_t *buf = df_io_alloc(4 * 65536);
    memset(buf, 0x44, 4 * 65536);
    for (int i = 0; i < 4; i++)
        CHECK_EQ(df_io_write(io, fd, buf + i * 65536, 65536, (uint64_t)i * 65536, (uint64_t)i, -1), 0);
    CHECK_EQ(df_io_inflight(io), 4);
    df_io_close(io);
    struct stat st;
    CHECK(fstat(fd, &st) == 0);
    CHECK_EQ(st.st_size, 4 * 65536);
    close(fd);
    unlink(path);
    free(buf);
}

static void files(void)
{
    df_err e_ = {0}, *e = &e_;
    char path[1200];
    snprintf(path, sizeof path, "%s/no/such/dir/file.bin", g_dir);
    int fd = df_io_open_file(path, O_WRONLY | O_CREAT, 0644, 1, NULL, e);
    CHECK_ERR(fd, -ENOENT, e, path);
    fd = df_io_open_file(path, O_RDONLY, 0, 0, NULL, e);
    CHECK_ERR(fd, -ENOENT, e, "no/such/dir/file.bin");
    void *p = df_io_alloc(1);
    CHECK(p && ((uintptr_t)p & 4095) == 0);
    free(p);
    /* A pipe has no O_DIRECT alignment to report. */
    int pf[2];
    CHECK(pipe(pf) == 0);
    CHECK_EQ(df_io_align(pf[0]), 4096);
    close(pf[0]);
    close(pf[1]);
}

/* The DFLASH_IO knob, switched between opens (df_knob_set: the environment is read once). */
static void env_path(int have_uring)
{
    df_err e_ = {0}, *e = &e_;
    df_io_opts o = {.queue_depth = 4};
    df_knob_set(DF_KNOB_IO, "threads");
    df_io *io = df_io_open(&o, e);
    CHECK(io && !strcmp(df_io_backend(io), "threads"));
    df_io_close(io);

    df_knob_set(DF_KNOB_IO, "uring");
    io = df_io_open(&o, e);
    if (have_uring)
        CHECK(io && !strcmp(df_io_backend(io), "io_uring"));
    else
        CHECK_ERR(io ? 0 : e->code, e->code, e, "DFLASH_IO=uring");
    df_io_close(io);
    o.force_fallback = 1; /* the code's explicit choice wins */
    io = df_io_open(&o, e);
    CHECK(io && !strcmp(df_io_backend(io), "threads"));
    df_io_close(io);
    o.force_fallback = 0;

    df_knob_set(DF_KNOB_IO, "bogus");
    io = df_io_open(&o, e);
    CHECK(io == NULL);
    CHECK_ERR(io ? 0 : e->code, -EINVAL, e, "DFLASH_IO=bogus");
    df_io_close(io);

    /* The whole suite once more, the pool chosen by the knob. */
    df_knob_set(DF_KNOB_IO, "threads");
    suite(0, "env-threads");
    df_knob_set(DF_KNOB_IO, NULL);
}

/* In a child with no free descriptor, io_uring setup fails (EMFILE): auto
 * mode must fall back with exactly one log line, and DFLASH_IO=uring must
 * fail clearly. Runs before anything in this process probes io_uring. */
static void fallback_child(void)
{
    char logpath[1200];
    snprintf(logpath, sizeof logpath, "%s/child.log", g_dir);
    fflush(stderr);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        int lfd = open(logpath, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (lfd < 0 || dup2(lfd, 2) < 0)
            _exit(3);
        close(lfd);
        int probe = dup(0);
        if (probe < 0)
            _exit(3);
        close(probe);
        struct rlimit lim = {.rlim_cur = (rlim_t)probe, .rlim_max = (rlim_t)probe + 64};
        struct rlimit cur;
        getrlimit(RLIMIT_NOFILE, &cur);
        lim.rlim_max = cur.rlim_max;
        if (setrlimit(RLIMIT_NOFILE, &lim) != 0)
            _exit(3);
        df_knob_set(DF_KNOB_IO, NULL);
        df_err e_ = {0}, *e = &e_;
        df_io_opts o = {.queue_depth = 4};
        for (int i = 0; i < 2; i++) {
            df_io *io = df_io_open(&o, e);
            CHECK(io && !strcmp(df_io_backend(io), "threads"));
            /* The pool works without new descriptors: a pipe-free check. */
            df_io_cqe cq;
            CHECK(io && df_io_fsync(io, 987654, 5) == 0 && df_io_wait(io, &cq, 1, 1) == 1 &&
                  cq.res == -EBADF);
            df_io_close(io);
        }
        df_knob_set(DF_KNOB_IO, "uring");
        df_io *io = df_io_open(&o, e);
        CHECK(io == NULL);
        CHECK_ERR(io ? 0 : e->code, -EMFILE, e, "DFLASH_IO=uring");
        df_io_close(io);
        fflush(stderr);
        _exit(df_test_failures ? 1 : 0);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    FILE *f = fopen(logpath, "r");
    CHECK(f != NULL);
    int lines = 0;
    if (f) {
        char line[1024];
        while (fgets(line, sizeof line, f)) {
            if (strstr(line, "io_uring unavailable"))
                lines++;
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
                fprintf(stderr, "child: %s", line);
        }
        fclose(f);
    }
    CHECK_EQ(lines, df_log_enabled(DF_LOG_WARN) ? 1 : 0);
}

int main(void)
{
    snprintf(g_dir, sizeof g_dir, "%s", test_tmpdir("io"));
    fallback_child();
    files();

    df_io *probe = open_engine(0, DEPTH);
    int have_uring = probe && !strcmp(df_io_backend(probe), "io_uring");
    df_io_close(probe);
    if (!have_uring)
        fprintf(stderr, "note: io_uring is not available here; testing the pool twice\n");

    suite(0, "auto");
    suite(1, "opts-threads");
    env_path(have_uring);
    return test_main_end();
}
