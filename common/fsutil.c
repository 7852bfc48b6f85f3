#include "fsutil.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "knobs.h"
#include "log.h"

static const char *kind_of(mode_t m)
{
    return S_ISFIFO(m) ? "a FIFO" : S_ISDIR(m) ? "a directory" : S_ISCHR(m) ? "a character device"
         : S_ISBLK(m) ? "a block device" : S_ISSOCK(m) ? "a socket" : "not a regular file";
}

int df_open_regular(const char *path, int flags, int mode, df_err *e)
{
    int fd = open(path, flags | O_NONBLOCK | O_CLOEXEC, mode);
    if (fd < 0) {
        int err = errno;
        if (err == ENXIO) /* O_WRONLY|O_NONBLOCK on a FIFO without a reader */
            return df_errf(e, -EINVAL, "%s: a FIFO, not a regular file; refusing it", path);
        return df_errf(e, -err, "%s: cannot open: %s", path, strerror(err));
    }
    struct stat st;
    if (fstat(fd, &st) != 0) {
        int err = errno;
        close(fd);
        return df_errf(e, -err, "%s: cannot stat: %s", path, strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return df_errf(e, -EINVAL, "%s: %s, not a regular file; refusing it", path,
                       kind_of(st.st_mode));
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0) {
        int err = errno;
        close(fd);
        return df_errf(e, -err, "%s: fcntl failed: %s", path, strerror(err));
    }
    return fd;
}

/* DFLASH_FAULT, parsed once: at most 8 point=ERRNO items; an item not of
 * that form, and any after the eighth, is ignored with a warning. */
static struct {
    char point[8][48];
    int err[8];
    int n;
} g_fault;
static pthread_once_t g_fault_once = PTHREAD_ONCE_INIT;

static void fault_init(void)
{
    static const char *const points[] = {"cache-final-dirsync", "log-write", "cache-shard-write"};
    const char *v = df_knob_str(DF_KNOB_FAULT);
    char buf[512];
    if (!v)
        return;
    if (snprintf(buf, sizeof buf, "%s", v) >= (int)sizeof buf) {
        df_log(DF_LOG_WARN, "DFLASH_FAULT: %zu characters, more than the %zu read: ignored", strlen(v),
               sizeof buf - 1);
        return;
    }
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (g_fault.n == 8) {
            df_log(DF_LOG_WARN, "DFLASH_FAULT: '%s' and any items after it ignored (at most 8)", t);
            break;
        }
        char *eq = strchr(t, '=');
        int err = !eq ? 0 : !strcmp(eq + 1, "EIO") ? EIO : !strcmp(eq + 1, "ENOSPC") ? ENOSPC : 0;
        if (!err || (size_t)(eq - t) >= sizeof g_fault.point[0]) {
            df_log(DF_LOG_WARN, "DFLASH_FAULT: item '%s' ignored: want POINT=EIO or POINT=ENOSPC", t);
            continue;
        }
        *eq = 0;
        size_t k = 0;
        while (k < sizeof points / sizeof points[0] && strcmp(t, points[k]))
            k++;
        if (k == sizeof points / sizeof points[0])
            df_log(DF_LOG_WARN, "DFLASH_FAULT: '%s' is no fault point (cache-final-dirsync, log-write, "
                                "cache-shard-write): it never fires", t);
        snprintf(g_fault.point[g_fault.n], sizeof g_fault.point[0], "%s", t);
        g_fault.err[g_fault.n++] = err;
    }
}

int df_fault(const char *point)
{
    pthread_once(&g_fault_once, fault_init);
    for (int i = 0; i < g_fault.n; i++)
        if (!strcmp(g_fault.point[i], point))
            return g_fault.err[i];
    return 0;
}

int df_file_read_all(const char *path, size_t max_len, char **out, size_t *len, df_err *e)
{
    *out = NULL;
    *len = 0;
    int fd = df_open_regular(path, O_RDONLY, 0, e);
    if (fd < 0)
        return fd;
    struct stat st;
    if (fstat(fd, &st) != 0) {
        close(fd);
        return df_errf(e, -EINVAL, "%s: cannot stat", path);
    }
    if ((uint64_t)st.st_size > max_len) {
        close(fd);
        return df_errf(e, -EFBIG, "%s: %lld bytes, more than the %zu accepted", path,
                       (long long)st.st_size, max_len);
    }
    size_t n = (size_t)st.st_size;
    char *buf = malloc(n + 1);
    if (!buf) {
        close(fd);
        return df_errf(e, -ENOMEM, "%s: out of memory for %zu bytes", path, n);
    }
    size_t got = 0;
    while (got < n) {
        ssize_t r = read(fd, buf + got, n - got);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0) {
            int err = r < 0 ? -errno : -EIO;
            free(buf);
            close(fd);
            return df_errf(e, err, "%s: read failed at offset %zu", path, got);
        }
        got += (size_t)r;
    }
    close(fd);
    buf[n] = 0;
    *out = buf;
    *len = n;
    return 0;
}

int df_fsync_dir(const char *dir, df_err *e)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return df_errf(e, -errno, "%s: cannot open directory: %s", dir, strerror(errno));
    int rc = fsync(fd) == 0 ? 0 : -errno;
    close(fd);
    if (rc && rc != -EINVAL) /* some file systems do not fsync directories */
        return df_errf(e, rc, "%s: fsync of directory failed: %s", dir, strerror(-rc));
    return 0;
}

static int write_atomic(const char *path, const void *data, size_t len, const char *fault,
                        df_err *e);

int df_file_write_atomic(const char *path, const void *data, size_t len, df_err *e)
{
    return write_atomic(path, data, len, NULL, e);
}

int df_file_publish(const char *path, const void *data, size_t len, const char *fault, df_err *e)
{
    return write_atomic(path, data, len, fault ? fault : "", e);
}

/* fault: NULL for df_file_write_atomic (a failed directory fsync is
 * reported, the renamed file stays); else the file is removed again when the
 * directory fsync fails, and df_fault(fault) can fake that failure. */
static int write_atomic(const char *path, const void *data, size_t len, const char *fault,
                        df_err *e)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp)
        return df_errf(e, -ENAMETOOLONG, "%s: path too long", path);
    int fd = df_open_regular(tmp, O_WRONLY | O_CREAT | O_TRUNC, 0644, e);
    if (fd < 0)
        return fd;
    const char *p = data;
    size_t done = 0;
    while (done < len) {
        ssize_t w = write(fd, p + done, len - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            int err = w < 0 ? -errno : -EIO;
            close(fd);
            unlink(tmp);
            return df_errf(e, err, "%s: write failed at offset %zu: %s", tmp, done,
                           strerror(-err));
        }
        done += (size_t)w;
    }
    if (fsync(fd) != 0) {
        int err = -errno;
        close(fd);
        unlink(tmp);
        return df_errf(e, err, "%s: fsync failed: %s", tmp, strerror(-err));
    }
    close(fd);
    if (rename(tmp, path) != 0) {
        int err = -errno;
        unlink(tmp);
        return df_errf(e, err, "%s: rename to %s failed: %s", tmp, path, strerror(-err));
    }
    char dcopy[4096];
    snprintf(dcopy, sizeof dcopy, "%s", path);
    const char *dir = dirname(dcopy);
    int err = fault && *fault ? df_fault(fault) : 0;
    int rc = err ? df_errf(e, -err, "%s: fsync of directory failed: %s", dir, strerror(err))
                 : df_fsync_dir(dir, e);
    if (rc && fault) {
        /* Not durable: a crash could keep the name without what it stands
         * for. Take it back so nothing reads it as published. */
        unlink(path);
        df_fsync_dir(dir, NULL);
        df_err_wrap(e, "%s not published (removed again)", path);
    }
    return rc;
}

int df_mkdirs(const char *dir, df_err *e)
{
    char buf[4096];
    if (snprintf(buf, sizeof buf, "%s", dir) >= (int)sizeof buf)
        return df_errf(e, -ENAMETOOLONG, "%s: path too long", dir);
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = 0;
        if (mkdir(buf, 0755) != 0 && errno != EEXIST)
            return df_errf(e, -errno, "%s: mkdir failed: %s", buf, strerror(errno));
        *p = '/';
    }
    if (mkdir(buf, 0755) != 0 && errno != EEXIST)
        return df_errf(e, -errno, "%s: mkdir failed: %s", buf, strerror(errno));
    struct stat st;
    if (stat(buf, &st) != 0 || !S_ISDIR(st.st_mode))
        return df_errf(e, -ENOTDIR, "%s: exists and is not a directory", buf);
    return 0;
}

int df_path_join(char *out, size_t n, const char *dir, const char *name)
{
    int w = snprintf(out, n, "%s/%s", dir, name);
    return (w < 0 || (size_t)w >= n) ? -ENAMETOOLONG : 0;
}

double df_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}
