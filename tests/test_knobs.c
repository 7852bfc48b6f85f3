/* test_knobs - the DFLASH_* knob table (common/knobs.h): every default
 * parses, valid values give what the readers expect, bad values are refused
 * with a message naming the variable and what it allows; the environment is
 * read once, from any thread, and a bad value warns exactly once (unless
 * DFLASH_LOG=error); df_knob_set switches a knob; DFLASH_FAULT's items. */
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "fsutil.h"
#include "knobs.h"
#include "test.h"

static int parse(df_knob_id id, const char *text)
{
    int v = -99;
    df_err e;
    CHECK_OK(df_knob_parse(id, text, &v, &e), &e);
    return v;
}

static void bad(df_knob_id id, const char *text, const char *needle, int want_default)
{
    int v = -99;
    df_err e = {0};
    CHECK_ERR(df_knob_parse(id, text, &v, &e), -EINVAL, &e, needle);
    CHECK_EQ(v, want_default);
}

static void test_table(void)
{
    for (int i = 0; i < DF_KNOB_COUNT; i++) {
        const df_knob_info *k = df_knob_info_of((df_knob_id)i);
        CHECK(k && k->name && !strncmp(k->name, "DFLASH_", 7) && k->allowed && k->what && *k->what);
        for (int j = 0; j < i; j++)
            CHECK(strcmp(k->name, df_knob_info_of((df_knob_id)j)->name) != 0);
        if (k->def) {
            int v;
            df_err e;
            CHECK_OK(df_knob_parse((df_knob_id)i, k->def, &v, &e), &e);
        }
        CHECK(k->kind != DF_KNOB_INT || (k->lo <= k->hi && k->def));
    }
    CHECK(df_knob_info_of(DF_KNOB_COUNT) == NULL);
    CHECK(!strcmp(df_knob_kind_name(DF_KNOB_CHOICE), "choice"));
    CHECK(!strcmp(df_knob_use_name(DF_KNOB_TEST), "test"));
    char buf[256];
    df_knob_allowed(DF_KNOB_IO, buf, sizeof buf);
    CHECK(!strcmp(buf, "auto, uring (or io_uring), threads"));
    df_knob_allowed(DF_KNOB_CPU_SIMD, buf, sizeof buf);
    CHECK(!strcmp(buf, "0 or 1"));
    df_knob_allowed(DF_KNOB_CE_CHUNK_MIB, buf, sizeof buf);
    CHECK(!strcmp(buf, "64..65536"));
    df_knob_allowed(DF_KNOB_IO, buf, 10); /* cut, terminated */
    CHECK(strlen(buf) == 9);
}

/* The defaults, as the readers had them. */
static void test_defaults(void)
{
    CHECK_EQ(parse(DF_KNOB_LOG, NULL), 2); /* info */
    CHECK_EQ(parse(DF_KNOB_LOG, ""), 2);
    CHECK_EQ(parse(DF_KNOB_IO, NULL), 0); /* auto */
    CHECK_EQ(parse(DF_KNOB_CPU_SIMD, NULL), 1);
    CHECK_EQ(parse(DF_KNOB_PORTABLE, NULL), 0);
    CHECK_EQ(parse(DF_KNOB_CUDA_FALLBACK, NULL), 0);
    CHECK_EQ(parse(DF_KNOB_PROFILE, NULL), 0);
    CHECK_EQ(parse(DF_KNOB_GEMM_TUNE, NULL), 0);
    CHECK_EQ(parse(DF_KNOB_CE_CHUNK_MIB, NULL), 1024);
    CHECK_EQ(parse(DF_KNOB_CE_PRECISE, NULL), 0);
    CHECK_EQ(parse(DF_KNOB_RMSNORM_BWD, NULL), 0); /* onepass */
    CHECK_EQ(parse(DF_KNOB_ATTN_BWD, NULL), -1);   /* the device's */
    CHECK_EQ(parse(DF_KNOB_ATTN_PDL, NULL), 1);
    CHECK_EQ(parse(DF_KNOB_ATTN_DQ_PERSIST, NULL), 1);
    CHECK_EQ(parse(DF_KNOB_FAULT, NULL), 0);
    CHECK_EQ(parse(DF_KNOB_CKPT_TEST_KILL_AT, ""), -1);
    CHECK_EQ(parse(DF_KNOB_TEST_REPLICATE_DATA, NULL), 0);
    CHECK_EQ(parse(DF_KNOB_RUN_ID, NULL), 0);
}

static void test_valid(void)
{
    CHECK_EQ(parse(DF_KNOB_LOG, "error"), 0);
    CHECK_EQ(parse(DF_KNOB_LOG, "warn"), 1);
    CHECK_EQ(parse(DF_KNOB_LOG, "debug"), 3);
    CHECK_EQ(parse(DF_KNOB_IO, "auto"), 0);
    CHECK_EQ(parse(DF_KNOB_IO, "uring"), 1);
    CHECK_EQ(parse(DF_KNOB_IO, "io_uring"), 1);
    CHECK_EQ(parse(DF_KNOB_IO, "threads"), 2);
    CHECK_EQ(parse(DF_KNOB_CPU_SIMD, "0"), 0);
    CHECK_EQ(parse(DF_KNOB_PORTABLE, "1"), 1);
    CHECK_EQ(parse(DF_KNOB_CE_CHUNK_MIB, "64"), 64);
    CHECK_EQ(parse(DF_KNOB_CE_CHUNK_MIB, "65536"), 65536);
    CHECK_EQ(parse(DF_KNOB_CE_CHUNK_MIB, "2048"), 2048);
    CHECK_EQ(parse(DF_KNOB_RMSNORM_BWD, "twopass"), 1);
    CHECK_EQ(parse(DF_KNOB_ATTN_BWD, "simt"), 0);
    CHECK_EQ(parse(DF_KNOB_ATTN_BWD, "wg3"), 4);
    CHECK_EQ(parse(DF_KNOB_ATTN_PDL, "0"), 0);
    CHECK_EQ(parse(DF_KNOB_CKPT_TEST_KILL_AT, "config"), 0);
    CHECK_EQ(parse(DF_KNOB_CKPT_TEST_KILL_AT, "latest"), 5);
    CHECK_EQ(parse(DF_KNOB_FAULT, "log-write=EIO"), 1);
    CHECK_EQ(parse(DF_KNOB_RUN_ID, "job 7"), 1);
}

static void test_bad(void)
{
    bad(DF_KNOB_LOG, "verbose", "DFLASH_LOG=verbose: want one of error, warn, info, debug", 2);
    bad(DF_KNOB_LOG, "Warn", "DFLASH_LOG=Warn", 2);
    bad(DF_KNOB_IO, "bogus", "DFLASH_IO=bogus: want one of auto, uring (or io_uring), threads", 0);
    bad(DF_KNOB_CPU_SIMD, "off", "DFLASH_CPU_SIMD=off: want 0 or 1", 1);
    bad(DF_KNOB_PROFILE, "true", "DFLASH_PROFILE=true: want 0 or 1", 0);
    bad(DF_KNOB_PORTABLE, "10", "want 0 or 1", 0);
    bad(DF_KNOB_CE_CHUNK_MIB, "63", "DFLASH_CE_CHUNK_MIB=63: want an integer in 64..65536", 1024);
    bad(DF_KNOB_CE_CHUNK_MIB, "65537", "64..65536", 1024);
    bad(DF_KNOB_CE_CHUNK_MIB, "100x", "DFLASH_CE_CHUNK_MIB=100x", 1024);
    bad(DF_KNOB_CE_CHUNK_MIB, "-128", "64..65536", 1024);
    bad(DF_KNOB_ATTN_BWD, "mma", "DFLASH_ATTN_BWD=mma: want one of simt, mma4, wg2, wg2f, wg3", -1);
    bad(DF_KNOB_ATTN_BWD, "wg", "DFLASH_ATTN_BWD=wg", -1);
    bad(DF_KNOB_RMSNORM_BWD, "three", "want one of onepass, twopass", 0);
    bad(DF_KNOB_CKPT_TEST_KILL_AT, "nowhere", "config, state, manifest, complete, rename, latest", -1);
    int v;
    df_err e = {0};
    CHECK_ERR(df_knob_parse(DF_KNOB_COUNT, "1", &v, &e), -EINVAL, &e, "no such knob");
}

/* df_knob_set and the accessors after it (in this process the environment
 * was read already: the test's own DFLASH_LOG among it). */
static void test_set(void)
{
    df_err e = {0};
    CHECK_EQ(df_knob_set(DF_KNOB_IO, "io_uring"), 0);
    CHECK_EQ(df_knob_int(DF_KNOB_IO), 1);
    CHECK(!strcmp(df_knob_str(DF_KNOB_IO), "uring"));
    CHECK(!strcmp(df_knob_raw(DF_KNOB_IO), "io_uring"));
    CHECK_EQ(df_knob_check(DF_KNOB_IO, &e), 0);

    CHECK_EQ(df_knob_set(DF_KNOB_IO, "bogus"), -EINVAL);
    CHECK_EQ(df_knob_bad(DF_KNOB_IO), 1);
    CHECK_EQ(df_knob_int(DF_KNOB_IO), 0);
    CHECK_ERR(df_knob_check(DF_KNOB_IO, &e), -EINVAL, &e, "DFLASH_IO=bogus");
    CHECK_EQ(df_knob_set(DF_KNOB_IO, NULL), 0);
    CHECK(df_knob_raw(DF_KNOB_IO) == NULL && !df_knob_bad(DF_KNOB_IO));
    CHECK(!strcmp(df_knob_str(DF_KNOB_IO), "auto"));

    CHECK_EQ(df_knob_set(DF_KNOB_CE_CHUNK_MIB, "2048"), 0);
    CHECK_EQ(df_knob_int(DF_KNOB_CE_CHUNK_MIB), 2048);
    CHECK(!strcmp(df_knob_str(DF_KNOB_CE_CHUNK_MIB), "2048"));
    CHECK_EQ(df_knob_set(DF_KNOB_CE_CHUNK_MIB, "1"), -EINVAL);
    CHECK_EQ(df_knob_int(DF_KNOB_CE_CHUNK_MIB), 1024);
    CHECK_EQ(df_knob_set(DF_KNOB_CE_CHUNK_MIB, NULL), 0);

    CHECK_EQ(df_knob_set(DF_KNOB_ATTN_BWD, NULL), 0);
    CHECK(df_knob_str(DF_KNOB_ATTN_BWD) == NULL && df_knob_int(DF_KNOB_ATTN_BWD) == -1);
    CHECK_EQ(df_knob_set(DF_KNOB_RUN_ID, "r-1"), 0);
    CHECK(!strcmp(df_knob_str(DF_KNOB_RUN_ID), "r-1") && df_knob_int(DF_KNOB_RUN_ID) == 1);
    CHECK_EQ(df_knob_set(DF_KNOB_RUN_ID, ""), 0);
    CHECK(df_knob_str(DF_KNOB_RUN_ID) == NULL && df_knob_int(DF_KNOB_RUN_ID) == 0);
    CHECK_EQ(df_knob_set(DF_KNOB_COUNT, "1"), -EINVAL);
}

static int lines_with(const char *path, const char *needle)
{
    FILE *f = fopen(path, "r");
    int n = 0;
    char line[1024];
    while (f && fgets(line, sizeof line, f))
        n += strstr(line, needle) != NULL;
    if (f)
        fclose(f);
    return n;
}

static int lines_in(const char *path)
{
    return lines_with(path, "");
}

static void *reader(void *arg)
{
    *(int *)arg = df_knob_int(DF_KNOB_CE_CHUNK_MIB) * 10 + df_knob_int(DF_KNOB_RMSNORM_BWD);
    return NULL;
}

/* In a fresh child (nothing read yet) with env set, stderr into log: the
 * values seen from 8 threads at once, then again after the environment
 * changed. Exits 0 when all is as expected. */
static void child(const char *log, const char *const *env)
{
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        if (!freopen(log, "w", stderr))
            _exit(3);
        for (; *env; env += 2)
            setenv(env[0], env[1], 1);
        pthread_t t[8];
        int got[8];
        for (int i = 0; i < 8; i++)
            if (pthread_create(&t[i], NULL, reader, &got[i]))
                _exit(4);
        int ok = 1;
        for (int i = 0; i < 8; i++) {
            pthread_join(t[i], NULL);
            ok &= got[i] == got[0];
        }
        /* read once: a later change of the environment is not seen */
        setenv("DFLASH_RMSNORM_BWD", "onepass", 1);
        setenv("DFLASH_CE_CHUNK_MIB", "4096", 1);
        ok &= reader(&got[1]) == NULL && got[1] == got[0];
        /* the warnings came at the first read, not again */
        for (int i = 0; i < DF_KNOB_COUNT; i++)
            (void)df_knob_int((df_knob_id)i);
        fflush(NULL);
        _exit(ok ? 0 : 5);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

static void test_environment(void)
{
    const char *dir = test_tmpdir("knobs");
    char log[1100];
    snprintf(log, sizeof log, "%s/warn.log", dir);

    /* valid values: read as given, no warning */
    const char *const ok[] = {"DFLASH_LOG", "warn", "DFLASH_CE_CHUNK_MIB", "512", "DFLASH_RMSNORM_BWD",
                              "twopass", NULL};
    child(log, ok);
    CHECK_EQ(lines_in(log), 0);

    /* bad values: one warning each, naming the variable, what it allows and
     * the default; none for DFLASH_IO, whose bad value is an error at use */
    const char *const badv[] = {"DFLASH_LOG", "warn", "DFLASH_CE_CHUNK_MIB", "5", "DFLASH_ATTN_BWD",
                                "mma", "DFLASH_IO", "bogus", "DFLASH_PROFILE", "yes", NULL};
    child(log, badv);
    CHECK_EQ(lines_with(log, "dflash warn: DFLASH_CE_CHUNK_MIB=5: want an integer in 64..65536; "
                             "using the default (1024)"), 1);
    CHECK_EQ(lines_with(log, "dflash warn: DFLASH_ATTN_BWD=mma: want one of simt, mma4, wg2, wg2f, "
                             "wg3; using the default"), 1);
    CHECK_EQ(lines_with(log, "dflash warn: DFLASH_PROFILE=yes: want 0 or 1; using the default (0)"), 1);
    CHECK_EQ(lines_with(log, "DFLASH_IO"), 0);
    CHECK_EQ(lines_in(log), 3);

    /* a bad DFLASH_LOG warns of itself; DFLASH_LOG=error silences the rest */
    const char *const badlog[] = {"DFLASH_LOG", "loud", NULL};
    child(log, badlog);
    CHECK_EQ(lines_with(log, "dflash warn: DFLASH_LOG=loud: want one of error, warn, info, debug; "
                             "using the default (info)"), 1);
    CHECK_EQ(lines_in(log), 1);
    const char *const quiet[] = {"DFLASH_LOG", "error", "DFLASH_CE_CHUNK_MIB", "5", NULL};
    child(log, quiet);
    CHECK_EQ(lines_in(log), 0);
}

/* DFLASH_FAULT: the well-formed items apply, the others are ignored with a
 * warning each (fsutil.c parses it, once). */
static void test_fault(void)
{
    const char *dir = test_tmpdir("knobs_fault");
    char log[1100];
    snprintf(log, sizeof log, "%s/fault.log", dir);
    fflush(NULL);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        if (!freopen(log, "w", stderr))
            _exit(3);
        setenv("DFLASH_LOG", "warn", 1);
        setenv("DFLASH_FAULT", "log-write=ENOSPC,junk,cache-shard-write=EPERM,elsewhere=EIO", 1);
        int ok = df_fault("log-write") == ENOSPC && df_fault("cache-shard-write") == 0 &&
                 df_fault("elsewhere") == EIO && df_fault("cache-final-dirsync") == 0 &&
                 df_fault("log-write") == ENOSPC;
        fflush(NULL);
        _exit(ok ? 0 : 5);
    }
    int status = 0;
    CHECK(waitpid(pid, &status, 0) == pid);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK_EQ(lines_with(log, "DFLASH_FAULT: item 'junk' ignored: want POINT=EIO or POINT=ENOSPC"), 1);
    CHECK_EQ(lines_with(log, "DFLASH_FAULT: item 'cache-shard-write=EPERM' ignored"), 1);
    CHECK_EQ(lines_with(log, "DFLASH_FAULT: 'elsewhere' is no fault point"), 1);
    CHECK_EQ(lines_in(log), 3);
}

int main(void)
{
    /* the children first: each must start with nothing read */
    test_environment();
    test_fault();
    test_table();
    test_defaults();
    test_valid();
    test_bad();
    test_set();
    return test_main_end();
}
