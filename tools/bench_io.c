/* bench_io - sequential write and read throughput of one file through the
 * I/O engine (storage/io.h), on io_uring and/or the thread pool.
 *
 *   bench_io --file PATH [--size 4G] [--bs 4M] [--qd 16] [--repeats 3]
 *            [--backend uring|threads|both] [--mode write|read|both]
 *            [--no-register] [--keep] [--json]
 *
 * Each repeat writes the whole file (O_DIRECT, O_TRUNC like dd, the final
 * fsync inside the timing), then reads it back (O_DIRECT, so from the disk,
 * not the page cache) and checks a block stamp at the start of every block.
 * Prints the median GB/s (1e9 bytes/s) of the repeats; --json adds one line
 * per backend. Data: non-zero pseudorandom bytes, made once (a disk or
 * virtual disk may special-case zeros).
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fsutil.h"
#include "io.h"
#include "knobs.h"

typedef struct cfg {
    const char *file;
    uint64_t size;
    size_t bs;
    unsigned qd;
    int repeats;
    int do_write, do_read;
    int reg;
    int keep;
    int json;
} cfg;

static void usage(void)
{
    fprintf(stderr,
            "usage: bench_io --file PATH [--size 4G] [--bs 4M] [--qd 16] [--repeats 3]\n"
            "                [--backend uring|threads|both] [--mode write|read|both]\n"
            "                [--no-register] [--keep] [--json]\n");
}

/* "4G", "4MiB", "65536": binary suffixes. 0 on a malformed value. */
static uint64_t parse_size(const char *s)
{
    char *end;
    unsigned long long v = strtoull(s, &end, 10);
    if (end == s)
        return 0;
    int sh = 0;
    switch (*end) {
    case 'k': case 'K': sh = 10; end++; break;
    case 'm': case 'M': sh = 20; end++; break;
    case 'g': case 'G': sh = 30; end++; break;
    case 't': case 'T': sh = 40; end++; break;
    default: break;
    }
    if (sh && (!strcmp(end, "iB") || !strcmp(end, "B")))
        end += strlen(end);
    if (*end || (sh && v > (~0ull >> sh)))
        return 0;
    return (uint64_t)v << sh;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

/* One sequential pass over the file: writes (then fsync) or reads, keeping
 * qd requests in flight. Returns seconds, or < 0 after printing why. */
static double pass(df_io *io, const cfg *c, uint8_t **bufs, int writing, int *direct_out)
{
    df_err e = {0};
    int direct = 0;
    int flags = writing ? O_WRONLY | O_CREAT | O_TRUNC : O_RDONLY;
    int fd = df_io_open_file(c->file, flags, 0644, 1, &direct, &e);
    if (fd < 0) {
        fprintf(stderr, "bench_io: %s\n", e.msg);
        return -1;
    }
    *direct_out = direct;
    uint64_t nblocks = (c->size + c->bs - 1) / c->bs;
    uint64_t *slot_block = calloc(c->qd, sizeof *slot_block);
    unsigned *free_slots = calloc(c->qd, sizeof *free_slots);
    df_io_cqe *cq = calloc(c->qd, sizeof *cq);
    if (!slot_block || !free_slots || !cq) {
        fprintf(stderr, "bench_io: out of memory\n");
        close(fd);
        free(slot_block);
        free(free_slots);
        free(cq);
        return -1;
    }
    unsigned nfree = c->qd;
    for (unsigned i = 0; i < c->qd; i++)
        free_slots[i] = c->qd - 1 - i;

    double t0 = df_now(), secs = -1;
    uint64_t next = 0, done = 0;
    while (done < nblocks) {
        while (next < nblocks && nfree > 0) {
            unsigned s = free_slots[--nfree];
            uint64_t off = next * c->bs;
            size_t len = c->size - off < c->bs ? (size_t)(c->size - off) : c->bs;
            int rc;
            if (writing) {
                memcpy(bufs[s], &next, sizeof next); /* stamp: the block index */
                rc = df_io_write(io, fd, bufs[s], len, off, s, c->reg ? (int)s : -1);
            } else {
                rc = df_io_read(io, fd, bufs[s], len, off, s, c->reg ? (int)s : -1);
            }
            if (rc < 0) {
                fprintf(stderr, "bench_io: submit at offset %llu of %s: %s\n",
                        (unsigned long long)off, c->file, df_strerror(rc));
                goto out;
            }
            slot_block[s] = next++;
        }
        int got = df_io_wait(io, cq, c->qd, 1);
        if (got < 0) {
            fprintf(stderr, "bench_io: wait: %s\n", df_strerror(got));
            goto out;
        }
        for (int i = 0; i < got; i++) {
            unsigned s = (unsigned)cq[i].tag;
            uint64_t b = slot_block[s], off = b * c->bs;
            int64_t want = (int64_t)(c->size - off < c->bs ? c->size - off : c->bs);
            if (cq[i].res != want) {
                fprintf(stderr, "bench_io: %s at offset %llu of %s: %s\n",
                        writing ? "write" : "read", (unsigned long long)off, c->file,
                        cq[i].res < 0 ? df_strerror((int)cq[i].res) : "short transfer");
                goto out;
            }
            uint64_t stamp;
            memcpy(&stamp, bufs[s], sizeof stamp);
            if (!writing && stamp != b) {
                fprintf(stderr, "bench_io: block %llu of %s holds block %llu's stamp\n",
                        (unsigned long long)b, c->file, (unsigned long long)stamp);
                goto out;
            }
            free_slots[nfree++] = s;
            done++;
        }
    }
    if (writing) {
        /* The data is on disk only after fsync: count it, as dd conv=fsync. */
        int rc = df_io_fsync(io, fd, 0);
        int got = rc < 0 ? rc : df_io_wait(io, cq, 1, 1);
        if (got != 1 || cq[0].res < 0) {
            fprintf(stderr, "bench_io: fsync of %s: %s\n", c->file,
                    df_strerror(got < 0 ? got : (int)cq[0].res));
            goto out;
        }
    }
    secs = df_now() - t0;
    if (!direct) /* best effort: keep the next read honest */
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
out:
    if (secs < 0) {
        df_io_cqe drain[1];
        while (df_io_inflight(io) > 0 && df_io_wait(io, drain, 1, 1) > 0) {
        }
    }
    close(fd);
    free(slot_block);
    free(free_slots);
    free(cq);
    return secs;
}

static int run_backend(const cfg *c, int threads, uint8_t **bufs)
{
    df_err e = {0};
    /* The DFLASH_IO knob decides how a forced backend fails: an io_uring run
     * that cannot get io_uring is an error here, not a silent fallback. */
    df_knob_set(DF_KNOB_IO, threads ? "threads" : "uring");
    df_io_opts o = {.queue_depth = c->qd};
    df_io *io = df_io_open(&o, &e);
    if (!io) {
        fprintf(stderr, "bench_io: %s\n", e.msg);
        return 1;
    }
    struct iovec *iov = calloc(c->qd, sizeof *iov);
    int registered = 0;
    if (c->reg && iov) {
        for (unsigned i = 0; i < c->qd; i++)
            iov[i] = (struct iovec){bufs[i], c->bs};
        registered = df_io_register_buffers(io, iov, c->qd) == 1;
    }
    free(iov);

    double *w = calloc((size_t)c->repeats, sizeof *w), *r = calloc((size_t)c->repeats, sizeof *r);
    int direct = 0, rc = 0;
    if (!w || !r) {
        rc = 1;
        goto out;
    }
    for (int k = 0; k < c->repeats; k++) {
        if (c->do_write) {
            double s = pass(io, c, bufs, 1, &direct);
            if (s < 0) {
                rc = 1;
                goto out;
            }
            w[k] = (double)c->size / s / 1e9;
        }
        if (c->do_read) {
            double s = pass(io, c, bufs, 0, &direct);
            if (s < 0) {
                rc = 1;
                goto out;
            }
            r[k] = (double)c->size / s / 1e9;
        }
    }
    const char *name = df_io_backend(io);
    char wruns[256] = "", rruns[256] = "";
    for (int k = 0, nw = 0, nr = 0; k < c->repeats; k++) {
        nw += snprintf(wruns + nw, sizeof wruns - (size_t)nw, "%s%.3f", k ? "," : "", w[k]);
        nr += snprintf(rruns + nr, sizeof rruns - (size_t)nr, "%s%.3f", k ? "," : "", r[k]);
        if (nw >= (int)sizeof wruns - 16 || nr >= (int)sizeof rruns - 16)
            break;
    }
    double wm = c->do_write ? median(w, c->repeats) : 0, rm = c->do_read ? median(r, c->repeats) : 0;
    printf("%-8s  size %.2f GiB  bs %zu KiB  qd %u  %s  %s\n", name,
           (double)c->size / (1 << 30), c->bs >> 10, c->qd, direct ? "O_DIRECT" : "buffered",
           registered ? "registered buffers" : "plain buffers");
    if (c->do_write)
        printf("  write+fsync  %6.3f GB/s  (median of %d: %s)\n", wm, c->repeats, wruns);
    if (c->do_read)
        printf("  read         %6.3f GB/s  (median of %d: %s)\n", rm, c->repeats, rruns);
    if (c->json)
        printf("{\"tool\":\"bench_io\",\"backend\":\"%s\",\"size\":%llu,\"bs\":%zu,\"qd\":%u,"
               "\"repeats\":%d,\"direct\":%s,\"registered\":%s,\"write_gbps\":%.4f,"
               "\"read_gbps\":%.4f,\"write_runs\":[%s],\"read_runs\":[%s]}\n",
               name, (unsigned long long)c->size, c->bs, c->qd, c->repeats,
               direct ? "true" : "false", registered ? "true" : "false", wm, rm, wruns, rruns);
    fflush(stdout);
out:
    free(w);
    free(r);
    df_io_close(io);
    return rc;
}

int main(int argc, char **argv)
{
    cfg c = {.size = 4ull << 30, .bs = 4u << 20, .qd = 16, .repeats = 3, .do_write = 1,
             .do_read = 1, .reg = 1};
    int want_uring = 1, want_threads = 1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--json")) c.json = 1;
        else if (!strcmp(a, "--keep")) c.keep = 1;
        else if (!strcmp(a, "--no-register")) c.reg = 0;
        else if (!strcmp(a, "-h") || !strcmp(a, "--help")) { usage(); return 0; }
        else if (!v) { usage(); return 2; }
        else {
            i++;
            if (!strcmp(a, "--file")) c.file = v;
            else if (!strcmp(a, "--size")) c.size = parse_size(v);
            else if (!strcmp(a, "--bs")) c.bs = (size_t)parse_size(v);
            else if (!strcmp(a, "--qd")) c.qd = (unsigned)atoi(v);
            else if (!strcmp(a, "--repeats")) c.repeats = atoi(v);
            else if (!strcmp(a, "--backend")) {
                want_uring = !strcmp(v, "uring") || !strcmp(v, "io_uring") || !strcmp(v, "both");
                want_threads = !strcmp(v, "threads") || !strcmp(v, "both");
                if (!want_uring && !want_threads) { usage(); return 2; }
            } else if (!strcmp(a, "--mode")) {
                c.do_write = !strcmp(v, "write") || !strcmp(v, "both");
                c.do_read = !strcmp(v, "read") || !strcmp(v, "both");
                if (!c.do_write && !c.do_read) { usage(); return 2; }
            } else { usage(); return 2; }
        }
    }
    /* O_DIRECT wants whole 4 KiB units; a bad number is refused, not bent. */
    if (!c.file || c.size == 0 || c.size % 4096 || c.bs == 0 || c.bs % 4096 ||
        c.bs > (1u << 30) || c.qd == 0 || c.qd > 1024 || c.repeats < 1 || c.repeats > 25) {
        fprintf(stderr, "bench_io: need --file; size and bs positive multiples of 4096 "
                        "(bs <= 1G), 1 <= qd <= 1024, 1 <= repeats <= 25\n");
        return 2;
    }
    if (!c.do_write && access(c.file, R_OK) != 0) {
        fprintf(stderr, "bench_io: --mode read needs an existing %s\n", c.file);
        return 2;
    }

    uint8_t **bufs = calloc(c.qd, sizeof *bufs);
    if (!bufs)
        return 1;
    uint64_t s = 0x243F6A8885A308D3ull; /* xorshift64: fast, never zero */
    for (unsigned i = 0; i < c.qd; i++) {
        bufs[i] = df_io_alloc(c.bs);
        if (!bufs[i]) {
            fprintf(stderr, "bench_io: cannot allocate %u x %zu bytes\n", c.qd, c.bs);
            return 1;
        }
        for (size_t k = 0; k < c.bs; k += 8) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            uint64_t v = s | 0x0101010101010101ull; /* no zero byte */
            memcpy(bufs[i] + k, &v, 8);
        }
    }
    int rc = 0;
    if (want_uring)
        rc |= run_backend(&c, 0, bufs);
    if (want_threads)
        rc |= run_backend(&c, 1, bufs);
    if (!c.keep && c.do_write)
        unlink(c.file);
    for (unsigned i = 0; i < c.qd; i++)
        free(bufs[i]);
    free(bufs);
    return rc;
}
