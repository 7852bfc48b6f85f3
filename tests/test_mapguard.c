/* test_mapguard - an input file truncated under its read-only mapping: with
 * the guard installed, a read past the file's new end ends the process with
 * status 1 and a message naming the file and the byte (mapguard.h); a
 * mapping that was never registered, or was removed, keeps the default
 * SIGBUS action. Each case runs in a forked child. Under AddressSanitizer
 * (its own SIGBUS handler) the cases are skipped. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "mapguard.h"
#include "test.h"

#if defined(__SANITIZE_ADDRESS__)
#define UNDER_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define UNDER_ASAN 1
#endif
#endif

#ifndef UNDER_ASAN
/* child: map path (2 pages), register it (reg) and maybe remove it again
 * (unreg), truncate the file, read the second page */
static void child(const char *path, int reg, int unreg)
{
    long pg = sysconf(_SC_PAGESIZE);
    int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0600);
    if (fd < 0 || ftruncate(fd, 2 * pg) != 0)
        _exit(3);
    volatile unsigned char *m = mmap(NULL, (size_t)(2 * pg), PROT_READ, MAP_PRIVATE, fd, 0);
    if (m == MAP_FAILED)
        _exit(4);
    if (df_mapguard_install() != 0)
        _exit(5);
    if (reg && df_mapguard_add((const void *)m, (size_t)(2 * pg), path) != 0)
        _exit(6);
    if (unreg)
        df_mapguard_remove((const void *)m);
    if (ftruncate(fd, 0) != 0)
        _exit(7);
    unsigned char v = m[pg + 5]; /* SIGBUS */
    _exit(v == 0 ? 8 : 9);
}

/* runs a case; returns its wait status and its stderr in err */
static int run(const char *path, int reg, int unreg, char *err, size_t n)
{
    int pfd[2];
    CHECK_EQ(pipe(pfd), 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(pfd[0]);
        dup2(pfd[1], 2);
        signal(SIGBUS, SIG_DFL);
        child(path, reg, unreg);
    }
    close(pfd[1]);
    size_t got = 0;
    ssize_t r;
    while (got + 1 < n && (r = read(pfd[0], err + got, n - 1 - got)) > 0)
        got += (size_t)r;
    err[got] = 0;
    close(pfd[0]);
    int st = 0;
    CHECK_EQ(waitpid(pid, &st, 0), pid);
    return st;
}

#endif

int main(void)
{
#ifdef UNDER_ASAN
    printf("mapguard: skipped under AddressSanitizer (it owns SIGBUS)\n");
    return test_main_end();
#else
    char path[512], err[2048], want[600];
    snprintf(path, sizeof path, "%s/input.dtok", test_tmpdir("mapguard"));
    long pg = sysconf(_SC_PAGESIZE);
    /* registered: status 1, the file and the byte named */
    int st = run(path, 1, 0, err, sizeof err);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1);
    snprintf(want, sizeof want, "dflash: %s: read at byte %ld of a mapping the file no longer covers", path,
             pg + 5);
    CHECK(strstr(err, want) != NULL);
    printf("registered: exit 1, \"%s\"\n", strtok(err, "\n"));
    /* never registered, or removed: the default action (killed by SIGBUS) */
    st = run(path, 0, 0, err, sizeof err);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGBUS);
    st = run(path, 1, 1, err, sizeof err);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGBUS);
    /* the slots: all taken -> -ENOSPC (unguarded), freed again -> usable */
    static char dummy[DF_MAPGUARD_SLOTS + 1];
    for (int i = 0; i < DF_MAPGUARD_SLOTS; i++)
        CHECK_EQ(df_mapguard_add(dummy + i, 1, "x"), 0);
    CHECK_EQ(df_mapguard_add(dummy + DF_MAPGUARD_SLOTS, 1, "x"), -ENOSPC);
    df_mapguard_remove(dummy + 3);
    CHECK_EQ(df_mapguard_add(dummy + DF_MAPGUARD_SLOTS, 1, "x"), 0);
    for (int i = 0; i <= DF_MAPGUARD_SLOTS; i++)
        df_mapguard_remove(dummy + i);
    unlink(path);
    return test_main_end();
#endif
}
