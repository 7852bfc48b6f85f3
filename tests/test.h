/* test.h - the assertions every test binary uses.
 * A failed CHECK prints file:line and the expression, counts the failure and
 * goes on; test_main_end() exits 1 if anything failed. CHECK_OK also prints
 * the df_err message, so a failing test says what the library said. */
#ifndef DF_TEST_H
#define DF_TEST_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "err.h"

extern int df_test_failures;

#define CHECK(cond)                                                                  \
    do {                                                                             \
        if (!(cond)) {                                                               \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
            df_test_failures++;                                                      \
        }                                                                            \
    } while (0)

#define CHECK_EQ(a, b)                                                                   \
    do {                                                                                 \
        long long va_ = (long long)(a), vb_ = (long long)(b);                            \
        if (va_ != vb_) {                                                                \
            fprintf(stderr, "%s:%d: CHECK_EQ failed: %s == %s (%lld vs %lld)\n", __FILE__, \
                    __LINE__, #a, #b, va_, vb_);                                         \
            df_test_failures++;                                                          \
        }                                                                                \
    } while (0)

/* rc must be >= 0; on failure print the error struct's message. */
#define CHECK_OK(rc, err) df_check_ok_((long long)(rc), (err), __FILE__, __LINE__, #rc)

void df_check_ok_(long long rc, const df_err *e, const char *file, int line, const char *expr);

/* rc must be the negative code want, and the message must contain needle. */
#define CHECK_ERR(rc, want, err, needle) \
    df_check_err_((long long)(rc), (want), (err), (needle), __FILE__, __LINE__, #rc)

void df_check_err_(long long rc, int want, const df_err *e, const char *needle,
                   const char *file, int line, const char *expr);

/* A fresh, empty directory for this test: $DFLASH_TEST_TMP/<name>. */
const char *test_tmpdir(const char *name);

/* Deterministic random numbers for test data (splitmix64). */
uint64_t test_rand(uint64_t *state);
/* A float from N(0,1) approx (sum of uniforms), deterministic. */
float test_randn(uint64_t *state);

/* bf16 comparisons: the distance of two bf16 values in units in the last
 * place (counting across zero), and the bf16 spacing at |d|: 2^(e-8) for
 * |d| in [2^(e-1), 2^e), 0 at 0. */
int test_bf16_dist(uint16_t a, uint16_t b);
double test_bf16_ulp(double d);

/* Returns 1 if any check failed, else 0 — use as `return test_main_end();`. */
int test_main_end(void);

#endif
