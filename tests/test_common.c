/* test_common - CRC32C (known vectors, hardware = software, streaming),
 * BF16 / F16 conversions (BF16 widened in place), the thread pool (every
 * index once, first error wins), atomic file writes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "crc32c.h"
#include "dtype.h"
#include "fsutil.h"
#include "opt.h"
#include "pool.h"
#include "test.h"

static int count_fn(void *arg, size_t i)
{
    int *hits = arg;
    __atomic_add_fetch(&hits[i], 1, __ATOMIC_RELAXED);
    return (i == 77 || i == 500) ? -(int)(i + 1) : 0;
}

int main(void)
{
    /* CRC-32C check value (RFC 3720 / iSCSI): "123456789" -> 0xE3069283. */
    CHECK_EQ(df_crc32c(0, "123456789", 9), 0xE3069283u);
    CHECK_EQ(df_crc32c_sw(0, "123456789", 9), 0xE3069283u);
    uint8_t zeros[32] = {0}, ones[32];
    memset(ones, 0xff, sizeof ones);
    CHECK_EQ(df_crc32c(0, zeros, 32), 0x8A9136AAu); /* RFC 3720 B.4 */
    CHECK_EQ(df_crc32c(0, ones, 32), 0x62A8AB43u);
    uint64_t rng = 1;
    static uint8_t buf[100003];
    for (size_t i = 0; i < sizeof buf; i++)
        buf[i] = (uint8_t)test_rand(&rng);
    for (size_t off = 0; off < 9; off++)
        for (size_t len = 0; len < 300; len += 7)
            CHECK_EQ(df_crc32c(0, buf + off, len), df_crc32c_sw(0, buf + off, len));
    uint32_t whole = df_crc32c(0, buf, sizeof buf);
    CHECK_EQ(df_crc32c(df_crc32c(0, buf, 4099), buf + 4099, sizeof buf - 4099), whole);
    buf[50000] ^= 4;
    CHECK(df_crc32c(0, buf, sizeof buf) != whole);

    /* bf16 round trip and rounding to nearest even. */
    CHECK_EQ(df_f32_to_bf16(1.0f), 0x3f80);
    CHECK_EQ(df_f32_to_bf16(-2.5f), 0xc020);
    CHECK(df_bf16_to_f32(df_f32_to_bf16(3.140625f)) == 3.140625f);
    CHECK_EQ(df_f32_to_bf16(1.00390625f), 0x3f80);   /* tie -> even */
    CHECK_EQ(df_f32_to_bf16(1.01171875f), 0x3f82);   /* tie -> even (up) */

    /* BF16 widened in place: each element equals its BF16's value, at odd and even n. */
    for (int64_t n = 1; n <= 9; n++) {
        float x[9];
        uint16_t h[9];
        for (int64_t j = 0; j < n; j++)
            h[j] = (uint16_t)(0x3f80 + 37 * j + (j & 1 ? 0x8000 : 0)); /* 1.0, then +-others */
        memcpy(x, h, (size_t)n * 2);
        df_bf16_widen_inplace(x, n);
        for (int64_t j = 0; j < n; j++)
            CHECK(x[j] == df_bf16_to_f32(h[j]));
    }

    /* f16: every finite/inf half survives f16 -> f32 -> f16; NaN stays NaN;
     * values are the IEEE ones (spot checks, incl. subnormals). */
    int f16_bad = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float f = df_f16_to_f32((uint16_t)h);
        int nan = (h & 0x7c00) == 0x7c00 && (h & 0x3ff);
        if (nan ? f == f : df_f32_to_f16(f) != h)
            f16_bad++;
    }
    CHECK_EQ(f16_bad, 0);
    CHECK(df_f16_to_f32(0x3c00) == 1.0f && df_f16_to_f32(0xc000) == -2.0f);
    CHECK(df_f16_to_f32(0x0001) == 0x1p-24f && df_f16_to_f32(0x7bff) == 65504.0f);
    CHECK_EQ(df_f32_to_f16(65520.0f), 0x7c00);      /* rounds to inf */
    CHECK_EQ(df_f32_to_f16(1.0f + 0x1p-11f), 0x3c00); /* tie -> even */

    /* Pool: every index runs exactly once; the lowest failing index's code wins. */
    for (int threads = 1; threads <= 4; threads++) {
        df_pool *p = df_pool_open(threads);
        CHECK(p != NULL);
        CHECK_EQ(df_pool_size(p), threads);
        for (int rep = 0; rep < 20; rep++) {
            static int hits[1000];
            memset(hits, 0, sizeof hits);
            CHECK_EQ(df_pool_for(p, 1000, count_fn, hits), -78);
            int bad = 0;
            for (int i = 0; i < 1000; i++)
                bad += hits[i] != 1;
            CHECK_EQ(bad, 0);
        }
        df_pool_close(p);
    }

    /* Atomic write: content lands whole; errors name the path. */
    const char *dir = test_tmpdir("common");
    char path[4200];
    snprintf(path, sizeof path, "%s/a/b/file.json", dir);
    df_err e = {0};
    char sub[4200];
    snprintf(sub, sizeof sub, "%s/a/b", dir);
    CHECK_OK(df_mkdirs(sub, &e), &e);
    CHECK_OK(df_file_write_atomic(path, "{\"x\":1}", 7, &e), &e);
    char *data;
    size_t len;
    CHECK_OK(df_file_read_all(path, 100, &data, &len, &e), &e);
    CHECK(len == 7 && !memcmp(data, "{\"x\":1}", 7));
    free(data);
    CHECK_ERR(df_file_read_all(path, 3, &data, &len, &e), -EFBIG, &e, "file.json");
    snprintf(path, sizeof path, "%s/missing/file", dir);
    CHECK_ERR(df_file_read_all(path, 100, &data, &len, &e), -ENOENT, &e, "missing/file");
    /* Numeric options (opt.h): integers, ranges, junk, nan/inf; the message names the
     * option, the value and the range. */
    {
        df_err oe = {0};
        int iv = 7;
        int64_t lv = 0;
        uint64_t uv = 0;
        double dv = 0;
        CHECK_OK(df_opt_int("--steps", "12", 1, 100, &iv, &oe), &oe);
        CHECK_EQ(iv, 12);
        CHECK_OK(df_opt_int("--steps", "1e1", 1, 100, &iv, &oe), &oe);
        CHECK_EQ(iv, 10);
        CHECK_ERR(df_opt_int("--steps", "2.5", 1, 100, &iv, &oe), -EINVAL, &oe, "--steps '2.5': want an integer in 1..100");
        CHECK_EQ(iv, 10);
        CHECK_ERR(df_opt_int("--steps", "1e30", 1, 100, &iv, &oe), -EINVAL, &oe, "1..100");
        CHECK_ERR(df_opt_int("--steps", "12x", 1, 100, &iv, &oe), -EINVAL, &oe, "12x");
        CHECK_ERR(df_opt_int("--steps", "", 1, 100, &iv, &oe), -EINVAL, &oe, "--steps");
        CHECK_ERR(df_opt_int("--steps", " 5", 1, 100, &iv, &oe), -EINVAL, &oe, "--steps");
        CHECK_ERR(df_opt_int("--steps", "nan", 1, 100, &iv, &oe), -EINVAL, &oe, "nan");
        CHECK_ERR(df_opt_int("--steps", "0x10", 1, 100, &iv, &oe), -EINVAL, &oe, "0x10");
        CHECK_ERR(df_opt_u64("--seed", "0x10", 0, UINT64_MAX, &uv, &oe), -EINVAL, &oe, "0x10");
        CHECK_ERR(df_opt_int("--keep-last", "-1", 0, 100, &iv, &oe), -EINVAL, &oe, "0..100");
        CHECK_ERR(df_opt_i64("--steps", "99999999999999999999", 0, INT64_MAX, &lv, &oe), -EINVAL, &oe, "--steps");
        CHECK_OK(df_opt_i64("--steps", "-3", -5, 5, &lv, &oe), &oe);
        CHECK_EQ(lv, -3);
        CHECK_OK(df_opt_u64("--seed", "18446744073709551615", 0, UINT64_MAX, &uv, &oe), &oe);
        CHECK(uv == UINT64_MAX);
        CHECK_ERR(df_opt_u64("--seed", "-1", 0, UINT64_MAX, &uv, &oe), -EINVAL, &oe, "--seed '-1'");
        CHECK_ERR(df_opt_u64("--seed", "nan", 0, UINT64_MAX, &uv, &oe), -EINVAL, &oe, "--seed 'nan'");
        CHECK_ERR(df_opt_u64("--seed", "18446744073709551616", 0, UINT64_MAX, &uv, &oe), -EINVAL, &oe, "--seed");
        CHECK_OK(df_opt_u64("--seed", "1e3", 0, UINT64_MAX, &uv, &oe), &oe);
        CHECK(uv == 1000);
        CHECK_OK(df_opt_double("--lr", "6e-4", 0, 1, &dv, &oe), &oe);
        CHECK(dv == 6e-4);
        CHECK_ERR(df_opt_double("--gamma", "nan", 0, 1e6, &dv, &oe), -EINVAL, &oe, "--gamma 'nan': want a finite number");
        CHECK_ERR(df_opt_double("--clip", "inf", 0, 1e30, &dv, &oe), -EINVAL, &oe, "--clip 'inf'");
        CHECK_ERR(df_opt_double("--lr", "-1", 0, 1, &dv, &oe), -EINVAL, &oe, "[0, 1]");
        CHECK_ERR(df_opt_double("--lr", "1e-3x", 0, 1, &dv, &oe), -EINVAL, &oe, "1e-3x");
    }

    return test_main_end();
}
