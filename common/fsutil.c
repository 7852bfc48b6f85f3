#include "fsutil.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

int df_file_read_all(const char *path, size_t max_len, char **out, size_t *len, df_err *e)
{
    *out = NULL;
    *len = 0;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return df_errf(e, -errno, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        close(fd);
        return df_errf(e, -EINVAL, "%s: not a regular file", path);
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

int df_file_write_atomic(const char *path, const void *data, size_t len, df_err *e)
{
    char tmp[4096];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp)
        return df_errf(e, -ENAMETOOLONG, "%s: path too long", path);
    int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd < 0)
        return df_errf(e, -errno, "%s: cannot create: %s", tmp, strerror(errno));
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
    return df_fsync_dir(dirname(dcopy), e);
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
