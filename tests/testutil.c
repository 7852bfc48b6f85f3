#include "test.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int df_test_failures = 0;

void df_check_err_(long long rc, int want, const df_err *e, const char *needle,
                   const char *file, int line, const char *expr)
{
    if (rc != want) {
        fprintf(stderr, "%s:%d: CHECK_ERR failed: %s = %lld, want %d (%s)\n", file, line, expr,
                rc, want, e ? e->msg : "");
        df_test_failures++;
        return;
    }
    if (needle && e && !strstr(e->msg, needle)) {
        fprintf(stderr, "%s:%d: CHECK_ERR: message of %s lacks \"%s\": %s\n", file, line, expr,
                needle, e->msg);
        df_test_failures++;
    }
}

void df_check_ok_(long long rc, const df_err *e, const char *file, int line, const char *expr)
{
    if (rc < 0) {
        fprintf(stderr, "%s:%d: CHECK_OK failed: %s = %lld (%s)\n", file, line, expr, rc,
                e ? e->msg : "");
        df_test_failures++;
    }
}

const char *test_tmpdir(const char *name)
{
    static char path[PATH_MAX];
    const char *base = getenv("DFLASH_TEST_TMP");
    if (!base)
        base = "/tmp";
    snprintf(path, sizeof path, "%s/%s", base, name);
    char cmd[PATH_MAX + 32];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s'", path, path);
    if (system(cmd) != 0) {
        fprintf(stderr, "cannot make %s\n", path);
        exit(2);
    }
    return path;
}

uint64_t test_rand(uint64_t *s)
{
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

float test_randn(uint64_t *s)
{
    float acc = 0;
    for (int i = 0; i < 4; i++)
        acc += (float)(test_rand(s) >> 40) / (float)(1ull << 24);
    return (acc - 2.0f) * 1.7320508f; /* var of sum of 4 U(0,1) = 1/3 */
}

int test_main_end(void)
{
    if (df_test_failures) {
        fprintf(stderr, "FAILED: %d check(s)\n", df_test_failures);
        return 1;
    }
    printf("ok\n");
    return 0;
}

int test_bf16_dist(uint16_t a, uint16_t b)
{
    int ia = (a & 0x8000) ? -(int)(a & 0x7fff) : (int)a;
    int ib = (b & 0x8000) ? -(int)(b & 0x7fff) : (int)b;
    return ia > ib ? ia - ib : ib - ia;
}

double test_bf16_ulp(double d)
{
    int e;
    frexp(d, &e);
    return d != 0 ? ldexp(1.0, e - 8) : 0;
}
