/* test_optim.c - the optimizer ops of the CPU reference backend (train_ops.h): AdamW with F32
 * and BF16 moments (df_op_adamw, df_op_adamw_m16) and the sum of squares of the gradient norm
 * (df_op_sumsq). Every op runs on a 1-thread and a 3-thread backend with bitwise equal
 * results; bad arguments return -EINVAL with nothing written. BF16 inputs (gradients) must give
 * the bits F32 inputs of the same values give. */
#include "bf16_sr.h"
#include "uf16.h"
#include "train_test_util.h"

/* ---- AdamW ---- */

/* Several steps against the formula in double, state carried in double.
 * Per step the fp32 update is off by a few u relative in m, v and the ratio
 * m^/(sqrt(v^)+eps) (|ratio| <= ~3 with these gradients) and by u |p| from
 * storing p: after S steps |p - p_ref| <= S (2u|p| + 1e-5 lr) with margin;
 * m within 1e-5 of the magnitude of its terms (successive gradients of
 * opposite sign cancel: ma = the same average of |g|), v of its value. */
static void check_adamw(int64_t n, float lr, float wd, float gs, int with_bf16)
{
    char what[96];
    snprintf(what, sizeof what, "adamw n=%lld lr=%g wd=%g gs=%g", (long long)n, lr, wd, gs);
    const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
    const int S = 5;
    float *p[2], *m[2], *v[2];
    uint16_t *o[2];
    float *g = fbuf(n);
    double *pd = dbuf(n), *md = dbuf(n), *vd = dbuf(n), *ma = dbuf(n);
    for (int b = 0; b < 2; b++) {
        p[b] = fbuf(n), m[b] = fbuf(n), v[b] = fbuf(n);
        o[b] = xmalloc((size_t)(n + 1) * 2);
    }
    fill(p[0], n, 1.0f);
    for (int64_t i = 0; i < n; i++)
        pd[i] = p[0][i];
    memcpy(p[1], p[0], (size_t)n * 4);
    for (int b = 0; b < 2; b++) {
        memset(m[b], 0, (size_t)n * 4), memset(v[b], 0, (size_t)n * 4);
        memset(o[b], 0xee, (size_t)(n + 1) * 2);
    }
    for (int s = 1; s <= S; s++) {
        fill(g, n, 0.1f);
        for (int b = 0; b < 2; b++)
            CHECK_EQ(df_op_adamw(bes[b], p[b], g, DF_DTYPE_F32, m[b], v[b], n, lr, b1, b2, eps,
                                 wd, s, gs, with_bf16 ? o[b] : NULL),
                     0);
        double bc1 = 1 - pow((double)b1, s), bc2 = 1 - pow((double)b2, s);
        for (int64_t i = 0; i < n; i++) {
            double gg = (double)g[i] * gs;
            ma[i] = (double)b1 * ma[i] + (1 - (double)b1) * fabs(gg);
            md[i] = (double)b1 * md[i] + (1 - (double)b1) * gg;
            vd[i] = (double)b2 * vd[i] + (1 - (double)b2) * gg * gg;
            pd[i] -= (double)lr * (md[i] / bc1 / (sqrt(vd[i] / bc2) + eps) + (double)wd * pd[i]);
        }
    }
    CHECK(bitwise_equal(p[0], p[1], n * 4) && bitwise_equal(m[0], m[1], n * 4) &&
          bitwise_equal(v[0], v[1], n * 4) && bitwise_equal(o[0], o[1], (n + 1) * 2));
    for (int64_t i = 0; i < n; i++) {
        expect_close(what, p[0][i], pd[i], S * (2 * U * fabs(pd[i]) + 1e-5 * lr), i);
        expect_close(what, m[0][i], md[i], 1e-5 * ma[i], i);
        expect_close(what, v[0][i], vd[i], 1e-5 * fabs(vd[i]) + 1e-14, i);
        if (with_bf16 && !is_bf16_rne(p[0][i], o[0][i])) {
            if (n_miss++ < 12)
                fprintf(stderr, "%s: bf16 of %.9g is %04x\n", what, p[0][i], o[0][i]);
            df_test_failures++;
        }
    }
    if (with_bf16)
        CHECK_EQ(o[0][n], 0xeeee);
    free(g), free(pd), free(md), free(vd), free(ma);
    for (int b = 0; b < 2; b++)
        free(p[b]), free(m[b]), free(v[b]), free(o[b]);
}

/* BF16 gradients: S steps with bf16 gradients on one state (1 thread) and
 * another (3 threads), and with the same values widened to F32 on a third
 * (1 thread): master, m, v and out_bf16 bitwise equal among all three (a
 * bf16 widens exactly; the arithmetic after that is the same). The
 * gradient array starts one element in (unaligned). */
static void check_adamw_bf16_grad(int64_t n, float lr, float wd, float gs, int with_out)
{
    const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f;
    const int S = 5;
    float *p[3], *m[3], *v[3], *gf = fbuf(n);
    uint16_t *o[3], *gb = xmalloc((size_t)(n + 1) * 2);
    for (int c = 0; c < 3; c++) {
        p[c] = fbuf(n), m[c] = fbuf(n), v[c] = fbuf(n);
        o[c] = xmalloc((size_t)(n + 1) * 2);
        memset(m[c], 0, (size_t)n * 4), memset(v[c], 0, (size_t)n * 4);
        memset(o[c], 0xee, (size_t)(n + 1) * 2);
    }
    fill(p[0], n, 1.0f);
    memcpy(p[1], p[0], (size_t)n * 4), memcpy(p[2], p[0], (size_t)n * 4);
    for (int s = 1; s <= S; s++) {
        for (int64_t i = 0; i < n; i++) {
            float g = test_randn(&rng) * 0.1f;
            gb[1 + i] = df_f32_to_bf16(fabsf(g) < 1e-3f ? 1e-3f : g);
            gf[i] = bf_val(gb[1 + i]);
        }
        for (int c = 0; c < 3; c++)
            CHECK_EQ(df_op_adamw(bes[c == 1], p[c], c < 2 ? (const void *)(gb + 1) : gf,
                                 c < 2 ? DF_DTYPE_BF16 : DF_DTYPE_F32, m[c], v[c], n, lr, b1, b2,
                                 eps, wd, s, gs, with_out ? o[c] : NULL),
                     0);
    }
    for (int c = 1; c < 3; c++)
        CHECK(bitwise_equal(p[0], p[c], n * 4) && bitwise_equal(m[0], m[c], n * 4) &&
              bitwise_equal(v[0], v[c], n * 4) && bitwise_equal(o[0], o[c], (n + 1) * 2));
    if (with_out)
        for (int64_t i = 0; i < n; i++)
            CHECK(is_bf16_rne(p[0][i], o[0][i]));
    CHECK_EQ(o[0][n], 0xeeee);
    CHECK(!bitwise_equal(p[0], m[0], n * 4)); /* it did move */
    free(gf), free(gb);
    for (int c = 0; c < 3; c++)
        free(p[c]), free(m[c]), free(v[c]), free(o[c]);
}

/* AdamW with BF16 moments (df_op_adamw_m16), v in BF16, UF16 or F32:
 *  - p and out bitwise those of df_op_adamw given the widened moments (the update takes the
 *    fp32 moments before their rounding), and the stored moments bitwise the stochastic
 *    rounding of that call's fp32 m / v with df_sr_bits(key, index0 + i) (an F32 v: bitwise
 *    df_op_adamw's v);
 *  - the same bits on 1 and 3 threads, and in one call or in two with index0 offsets;
 *  - m's bits do not depend on v's dtype (a twin run with the other one);
 *  - unbiased: v with b2 = 0.999 under a constant gradient, where round-to-nearest stalls
 *    (its step is 0.1% of v, under half of bf16's 0.78% spacing), tracks the fp32 EMA. */
/* a stored 16-bit v widened (UF16 or BF16), and the rule that stores it */
static float v16_get(df_dtype vdt, uint16_t h)
{
    return vdt == DF_DTYPE_UF16 ? df_uf16_to_f32(h) : df_bf16_to_f32(h);
}
static uint16_t v16_sr(df_dtype vdt, uint32_t u, uint32_t r)
{
    return vdt == DF_DTYPE_UF16 ? df_uf16_sr(u, r) : df_bf16_sr(u, r);
}

static void check_adamw_m16(int64_t n, int bf16_grad, df_dtype vdt)
{
    const float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, lr = 1e-3f, wd = 0.01f, gs = 0.5f;
    const uint64_t key = 0x5eed0001ull;
    const int64_t i0 = 12345;
    const int v32 = vdt == DF_DTYPE_F32;
    const size_t ves = v32 ? 4 : 2;
    float *p = fbuf(n), *pr = fbuf(n), *pt = fbuf(n), *pw = fbuf(n), *g = fbuf(n), *mr = fbuf(n),
          *vr = fbuf(n);
    uint16_t *gb = xmalloc((size_t)n * 2), *m16 = xmalloc((size_t)n * 2),
             *mt = xmalloc((size_t)n * 2), *mw = xmalloc((size_t)n * 2),
             *o = xmalloc((size_t)n * 2), *orf = xmalloc((size_t)n * 2), *ot = xmalloc((size_t)n * 2);
    /* v in its dtype (v, vt), and the twin's v in the other dtype (vw) */
    void *v = xmalloc((size_t)n * ves), *vt = xmalloc((size_t)n * ves),
         *vw = xmalloc((size_t)n * (6 - ves));
    fill(p, n, 1.0f);
    memcpy(pt, p, (size_t)n * 4), memcpy(pw, p, (size_t)n * 4);
    memset(m16, 0, (size_t)n * 2), memset(mt, 0, (size_t)n * 2), memset(mw, 0, (size_t)n * 2);
    memset(v, 0, (size_t)n * ves), memset(vt, 0, (size_t)n * ves), memset(vw, 0, (size_t)n * (6 - ves));
    int64_t bad_m = 0, bad_p = 0, bad_t = 0, bad_w = 0;
    for (int s = 1; s <= 4; s++) {
        fill(g, n, 0.1f);
        for (int64_t i = 0; i < n; i++)
            gb[i] = df_f32_to_bf16(g[i]), g[i] = bf16_grad ? df_bf16_to_f32(gb[i]) : g[i];
        const void *gp = bf16_grad ? (const void *)gb : g;
        df_dtype gdt = bf16_grad ? DF_DTYPE_BF16 : DF_DTYPE_F32;
        /* the reference: the F32 op on the widened moments */
        memcpy(pr, p, (size_t)n * 4);
        for (int64_t i = 0; i < n; i++)
            mr[i] = df_bf16_to_f32(m16[i]),
            vr[i] = v32 ? ((float *)v)[i] : v16_get(vdt, ((uint16_t *)v)[i]);
        CHECK_EQ(df_op_adamw(bes[0], pr, gp, gdt, mr, vr, n, lr, b1, b2, eps, wd, s, gs, orf), 0);
        CHECK_EQ(df_op_adamw_m16(bes[0], p, gp, gdt, m16, v, vdt, n, lr, b1, b2, eps, wd, s, gs,
                                 key + (uint64_t)s, i0, o),
                 0);
        for (int64_t i = 0; i < n; i++) {
            uint32_t um, uv;
            memcpy(&um, &mr[i], 4), memcpy(&uv, &vr[i], 4);
            uint64_t r = df_sr_bits(key + (uint64_t)s, (uint64_t)(i0 + i));
            bad_m += m16[i] != df_bf16_sr(um, (uint32_t)r) ||
                     (v32 ? memcmp(&((float *)v)[i], &vr[i], 4) != 0
                          : ((uint16_t *)v)[i] != v16_sr(vdt, uv, (uint32_t)(r >> 16)));
        }
        bad_p += !bitwise_equal(p, pr, (size_t)n * 4) || !bitwise_equal(o, orf, (size_t)n * 2);
        /* 3 threads, in two calls split at n / 3 */
        int64_t h = n / 3;
        CHECK_EQ(df_op_adamw_m16(bes[1], pt, gp, gdt, mt, vt, vdt, h, lr, b1, b2, eps, wd, s, gs,
                                 key + (uint64_t)s, i0, ot),
                 0);
        CHECK_EQ(df_op_adamw_m16(bes[1], pt + h, bf16_grad ? (const void *)(gb + h) : g + h, gdt,
                                 mt + h, (char *)vt + (size_t)h * ves, vdt, n - h, lr, b1, b2, eps,
                                 wd, s, gs, key + (uint64_t)s, i0 + h, ot + h),
                 0);
        bad_t += !bitwise_equal(pt, p, (size_t)n * 4) || !bitwise_equal(mt, m16, (size_t)n * 2) ||
                 !bitwise_equal(vt, v, (size_t)n * ves) || !bitwise_equal(ot, o, (size_t)n * 2);
        /* the twin, v in the other dtype: the same m */
        CHECK_EQ(df_op_adamw_m16(bes[0], pw, gp, gdt, mw, vw, v32 ? DF_DTYPE_BF16 : DF_DTYPE_F32,
                                 n, lr, b1, b2, eps, wd, s, gs, key + (uint64_t)s, i0, NULL),
                 0);
        bad_w += !bitwise_equal(mw, m16, (size_t)n * 2);
    }
    if (bad_m || bad_p || bad_t || bad_w)
        fprintf(stderr, "adamw_m16 n=%lld v %s: %lld moments off the rounding rule, %lld steps' "
                        "p/out off the F32 op's, %lld split / threaded runs differ, %lld steps' m "
                        "depend on v's dtype\n",
                (long long)n, df_dtype_name(vdt), (long long)bad_m, (long long)bad_p,
                (long long)bad_t, (long long)bad_w);
    CHECK(bad_m == 0 && bad_p == 0 && bad_t == 0 && bad_w == 0);
    free(p), free(pr), free(pt), free(pw), free(g), free(mr), free(vr);
    free(gb), free(m16), free(mt), free(mw), free(o), free(orf), free(ot), free(v), free(vt),
        free(vw);
}

/* UF16 (common/uf16.h) on its own: every code's value, increasing, coming back exactly from
 * round-to-nearest and from stochastic rounding with any bits; ties to even; stochastic
 * rounding exactly unbiased over its 8192 bit patterns (v >= 2^-57) and to 2^-13 of a step
 * below; the edges (0, negatives, 64 and past, Inf, NaN). */
static void check_uf16(void)
{
    int64_t bad = 0;
    float prev = -1.0f;
    for (uint32_t c = 0; c <= 0xffffu; c++) {
        float f = df_uf16_to_f32((uint16_t)c);
        uint32_t u;
        memcpy(&u, &f, 4);
        bad += !(f > prev) || df_f32_to_uf16(f) != c || df_uf16_sr(u, 0) != c ||
               df_uf16_sr(u, 0x1fffu) != c;
        if (c < 0xffffu) { /* the midpoint to the next code: ties to even; either side */
            double mid = ((double)f + df_uf16_to_f32((uint16_t)(c + 1))) / 2;
            /* (below 2^-57 the rounding sees 2^-13 of a step: hi that far above) */
            float fm = (float)mid, lo = nextafterf(fm, 0.0f),
                  hi = c < 1024 ? fm + 0x1p-80f : nextafterf(fm, 1e30f);
            bad += (double)fm != mid || df_f32_to_uf16(fm) != (c & 1u ? c + 1 : c) ||
                   df_f32_to_uf16(lo) != c || df_f32_to_uf16(hi) != c + 1;
        }
        prev = f;
    }
    CHECK_EQ(bad, 0);
    CHECK(df_uf16_to_f32(1) == ldexpf(1.0f, -67) && df_uf16_to_f32(1024) == ldexpf(1.0f, -57));
    CHECK(df_uf16_to_f32(0xffff) == ldexpf(2.0f - ldexpf(1.0f, -10), 5));
    /* stochastic rounding: the mean over all 8192 bit patterns */
    uint64_t r64 = 99;
    int64_t biased = 0;
    double worst_sub = 0;
    for (int k = 0; k < 400; k++) {
        float x = ldexpf(1.0f + (float)(test_rand(&r64) % (1u << 23)) * 0x1p-23f,
                         (int)(test_rand(&r64) % 66) - 62); /* 2^-62 .. 2^4 */
        uint32_t u;
        memcpy(&u, &x, 4);
        double sum = 0;
        for (uint32_t r = 0; r < 8192; r++)
            sum += df_uf16_to_f32(df_uf16_sr(u, r));
        double err = fabs(sum / 8192 - (double)x);
        if (x >= ldexpf(1.0f, -57))
            biased += err != 0;
        else if (err / ldexp(1.0, -67) > worst_sub)
            worst_sub = err / ldexp(1.0, -67);
    }
    CHECK_EQ(biased, 0);
    CHECK(worst_sub <= ldexp(1.0, -13));
    /* edges */
    const float nan = nanf(""), inf = INFINITY;
    const float edge[] = {0.0f, -0.0f, -1.0f, -inf, 64.0f, 1e30f, inf, nan, 63.99f};
    const uint16_t want[] = {0, 0, 0, 0, 0xffff, 0xffff, 0xffff, 0xffff, 0xffff};
    for (size_t i = 0; i < sizeof edge / sizeof edge[0]; i++) {
        uint32_t u;
        memcpy(&u, &edge[i], 4);
        CHECK_EQ(df_f32_to_uf16(edge[i]), want[i]);
        CHECK_EQ(df_uf16_sr(u, 0x1234u), want[i]);
    }
}

static void check_adamw_m16_unbiased(df_dtype vdt)
{
    /* v from 1, gradient 0 after a first step: v decays by b2 = 0.999 per step (0.1%).
     * 4096 elements x 400 steps: the mean of v (SR) within 0.2% of the fp32 EMA's,
     * and round-to-nearest would have kept it at its first value. */
    enum { N = 4096, STEPS = 400 };
    static float p[N], g[N];
    static uint16_t m[N], v[N];
    for (int i = 0; i < N; i++) /* v = 1 */
        p[i] = 1.0f, g[i] = 0.0f, m[i] = 0, v[i] = vdt == DF_DTYPE_UF16 ? df_f32_to_uf16(1.0f) : 0x3f80;
    double ref = 1.0;
    for (int s = 1; s <= STEPS; s++) {
        CHECK_EQ(df_op_adamw_m16(bes[1], p, g, DF_DTYPE_F32, m, v, vdt, N, 0.0f, 0.9f,
                                 0.999f, 1e-8f, 0.0f, s, 1.0f, 77u + (uint64_t)s * 0x10001ull, 0,
                                 NULL),
                 0);
        ref *= 0.999;
    }
    double mean = 0;
    for (int i = 0; i < N; i++)
        mean += v16_get(vdt, v[i]);
    mean /= N;
    printf("adamw_m16: %s v after %d decays of 0.1%%: mean %.5f, fp32 EMA %.5f\n",
           df_dtype_name(vdt), STEPS, mean, ref);
    CHECK(fabs(mean / ref - 1) < 2e-3);
    if (vdt == DF_DTYPE_UF16)
        return;
    /* NaN and Inf moments stay what they are (a quiet NaN; Inf) */
    uint32_t inf = 0x7f800000u, nan = 0x7fa00000u;
    CHECK(df_bf16_sr(inf, 0xffffu) == 0x7f80 && df_bf16_sr(inf | 0x80000000u, 0xffffu) == 0xff80);
    CHECK((df_bf16_sr(nan, 0xffffu) & 0x7fc0) == 0x7fc0);
    CHECK(df_bf16_sr(0x3f800000u, 0xffffu) == 0x3f80);       /* exact values stay */
    CHECK(df_bf16_sr(0x3f808000u, 0x7fffu) == 0x3f80);       /* half way: by the bits */
    CHECK(df_bf16_sr(0x3f808000u, 0x8000u) == 0x3f81);
}

static void test_adamw(void)
{
    check_adamw_m16(100003, 1, DF_DTYPE_BF16);
    check_adamw_m16(4099, 0, DF_DTYPE_BF16);
    check_adamw_m16(3, 1, DF_DTYPE_BF16);
    check_adamw_m16(100003, 1, DF_DTYPE_F32);
    check_adamw_m16(4099, 0, DF_DTYPE_F32);
    check_adamw_m16(3, 0, DF_DTYPE_F32);
    check_adamw_m16(100003, 1, DF_DTYPE_UF16);
    check_adamw_m16(4099, 0, DF_DTYPE_UF16);
    check_adamw_m16(3, 1, DF_DTYPE_UF16);
    check_adamw_m16_unbiased(DF_DTYPE_BF16);
    check_adamw_m16_unbiased(DF_DTYPE_UF16);
    check_uf16();
    {   /* index0 < 0 and moments overlapping: refused, nothing written */
        float p1[4] = {1, 2, 3, 4}, g1[4] = {1, 1, 1, 1};
        uint16_t mv[8] = {0};
        CHECK_EQ(df_op_adamw_m16(bes[0], p1, g1, DF_DTYPE_F32, mv, mv + 4, DF_DTYPE_BF16, 4, 1e-3f,
                                 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f, 1, -1, NULL),
                 -EINVAL);
        CHECK_EQ(df_op_adamw_m16(bes[0], p1, g1, DF_DTYPE_F32, mv, mv + 2, DF_DTYPE_BF16, 4, 1e-3f,
                                 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f, 1, 0, NULL),
                 -EINVAL);
        /* an F32 v spans twice the bytes: mv + 4 would overlap m's 4 bf16 + v's 8 bytes */
        CHECK_EQ(df_op_adamw_m16(bes[0], p1, g1, DF_DTYPE_F32, mv + 4, mv, DF_DTYPE_F32, 4, 1e-3f,
                                 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f, 1, 0, NULL),
                 -EINVAL);
        CHECK_EQ(df_op_adamw_m16(bes[0], p1, g1, DF_DTYPE_F32, mv, mv + 4, DF_DTYPE_F16, 4, 1e-3f,
                                 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f, 1, 0, NULL),
                 -EINVAL);
        CHECK(p1[0] == 1 && mv[0] == 0 && mv[4] == 0);
    }
    CHECK(is_bf16_rne(1.0f, 0x3f80) && !is_bf16_rne(1.0f, 0x3f81));
    CHECK(is_bf16_rne(1.00390625f, 0x3f80)); /* exactly halfway: to even */
    CHECK(is_bf16_rne(1.01171875f, 0x3f82)); /* halfway, odd below: up */
    check_adamw(100003, 1e-2f, 0.1f, 0.5f, 1); /* crosses the 32K pieces */
    check_adamw(1000, 6e-4f, 0.0f, 1.0f, 0);
    check_adamw(7, 1e-3f, 0.01f, 0.25f, 1);
    check_adamw_bf16_grad(100003, 1e-2f, 0.1f, 0.5f, 1);
    check_adamw_bf16_grad(1000, 6e-4f, 0.0f, 1.0f, 0);
    check_adamw_bf16_grad(7, 1e-3f, 0.01f, 0.25f, 1);
    /* the RNE itself on ties: p values exactly between two bf16 */
    {
        float p[4] = {1.00390625f, 1.01171875f, -1.00390625f, 3.0f}, g[4] = {0}, m[4] = {0},
              v[4] = {0};
        uint16_t o[4];
        CHECK_EQ(df_op_adamw(bes[0], p, g, DF_DTYPE_F32, m, v, 4, 0.0f, 0.9f, 0.999f, 1e-8f, 0.0f,
                             1, 1.0f, o),
                 0);
        CHECK(o[0] == 0x3f80 && o[1] == 0x3f82 && o[2] == 0xbf80 && o[3] == 0x4040);
    }
    CHECK_EQ(df_op_adamw(bes[0], NULL, NULL, DF_DTYPE_F32, NULL, NULL, 0, 1e-3f, 0.9f, 0.999f,
                         1e-8f, 0.0f, 1, 1.0f, NULL),
             0);

    /* Bad arguments: nothing written. */
    float p[8], g[8], m[8], v[8], pc[8];
    uint16_t o[8];
    fill(p, 8, 1.0f), fill(g, 8, 1.0f), memset(m, 0, sizeof m), memset(v, 0, sizeof v);
    memcpy(pc, p, sizeof p);
    memset(o, 0x55, sizeof o);
#define ADAM(p_, g_, ...) df_op_adamw(bes[0], p_, g_, DF_DTYPE_F32, __VA_ARGS__)
    CHECK_EQ(ADAM(p, g, m, v, 8, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 0, 1.0f, o), -EINVAL); /* step */
    CHECK_EQ(ADAM(p, g, m, v, 8, 1e-3f, 1.0f, 0.999f, 1e-8f, 0.0f, 1, 1.0f, o), -EINVAL);
    CHECK_EQ(ADAM(p, g, m, v, 8, 1e-3f, 0.9f, -0.1f, 1e-8f, 0.0f, 1, 1.0f, o), -EINVAL);
    CHECK_EQ(ADAM(p, g, m, v, 8, NAN, 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f, o), -EINVAL);
    CHECK_EQ(ADAM(p, g, m, v, 8, 1e-3f, 0.9f, 0.999f, 0.0f, 0.0f, 1, 1.0f, o), -EINVAL);
    CHECK_EQ(ADAM(p, g, m, v, 8, 1e-3f, 0.9f, 0.999f, 1e-8f, -1.0f, 1, 1.0f, o), -EINVAL);
    CHECK_EQ(ADAM(p, g, m, v, 8, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1, INFINITY, o), -EINVAL);
    CHECK_EQ(ADAM(p, g, m, v, -1, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f, o), -EINVAL);
    CHECK_EQ(ADAM(p, NULL, m, v, 8, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f, o), -EINVAL);
    CHECK_EQ(ADAM(p, g, p + 2, v, 4, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f, o), -EINVAL);
    CHECK_EQ(ADAM(p, g, m, v, 8, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f, (uint16_t *)(v + 7)),
             -EINVAL);
    CHECK_EQ(ADAM(p, m, m, v, 8, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1, 1.0f, o), -EINVAL);
    CHECK_EQ(df_op_adamw(NULL, p, g, DF_DTYPE_F32, m, v, 8, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1,
                         1.0f, o),
             -EINVAL);
#undef ADAM
    /* grad dtypes other than F32 / BF16 */
    static const df_dtype bad[] = {DF_DTYPE_F16, DF_DTYPE_I32, DF_DTYPE_U8, DF_DTYPE_INVALID,
                                   (df_dtype)99};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK_EQ(df_op_adamw(bes[0], p, g, bad[i], m, v, 8, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.0f, 1,
                             1.0f, o),
                 -EINVAL);
    CHECK(bitwise_equal(p, pc, sizeof p));
    for (int i = 0; i < 8; i++)
        CHECK(m[i] == 0.0f && v[i] == 0.0f && o[i] == 0x5555);

    /* The overlap check spans grad by its own element size: 8 bf16 are 16
     * bytes, so a BF16 grad ending where m starts is fine, the same
     * pointer as 8 F32 (32 bytes) overlaps m, and 8 bf16 from m's last
     * element overlap it. */
    float buf[20], bufc[20];
    for (int i = 0; i < 20; i++)
        buf[i] = 0.5f + 0.01f * (float)i; /* grads and states, never zero */
    memcpy(bufc, buf, sizeof buf);
    float *mm = buf + 4, *vv = buf + 12; /* m [4, 12), v [12, 20) */
    CHECK_EQ(df_op_adamw(bes[0], p, buf, DF_DTYPE_F32, mm, vv, 8, 1e-3f, 0.9f, 0.999f, 1e-8f,
                         0.0f, 1, 1.0f, o),
             -EINVAL);
    CHECK_EQ(df_op_adamw(bes[0], p, mm + 7, DF_DTYPE_BF16, mm, vv, 8, 1e-3f, 0.9f, 0.999f, 1e-8f,
                         0.0f, 1, 1.0f, o),
             -EINVAL);
    CHECK(bitwise_equal(buf, bufc, sizeof buf) && bitwise_equal(p, pc, sizeof p));
    for (int i = 0; i < 8; i++)
        CHECK(o[i] == 0x5555);
    CHECK_EQ(df_op_adamw(bes[0], p, buf, DF_DTYPE_BF16, mm, vv, 8, 1e-3f, 0.9f, 0.999f, 1e-8f,
                         0.0f, 1, 1.0f, o),
             0);
    CHECK(bitwise_equal(buf, bufc, 4 * sizeof(float))); /* the grad is read, not written */
    CHECK(!bitwise_equal(p, pc, sizeof p));
}

/* ---- sum of squares ---- */

static void test_sumsq(void)
{
    const int64_t n = 200003; /* 4 pieces of 64K */
    float *x = fbuf(n);
    fill(x, n, 3.0f);
    double ref = 0;
    for (int64_t i = 0; i < n; i++)
        ref += (double)x[i] * x[i];
    double a = df_op_sumsq(bes[0], x, DF_DTYPE_F32, n);
    double b = df_op_sumsq(bes[1], x, DF_DTYPE_F32, n);
    CHECK(bitwise_equal(&a, &b, 8));
    /* double sums of 2e5 positive terms: ~n u_d relative at worst, 1e-13 */
    expect_close("sumsq", a, ref, 1e-12 * ref, 0);
    CHECK(df_op_sumsq(bes[0], x, DF_DTYPE_F32, 1) == (double)x[0] * x[0]);
    CHECK(df_op_sumsq(bes[0], x, DF_DTYPE_F32, 0) == 0.0);
    CHECK(df_op_sumsq(bes[0], NULL, DF_DTYPE_F32, 0) == 0.0);
    x[n - 1] = NAN;
    CHECK(isnan(df_op_sumsq(bes[1], x, DF_DTYPE_F32, n)));
    x[n - 1] = 1e30f; /* f32 square would overflow; double does not */
    CHECK(isfinite(df_op_sumsq(bes[1], x, DF_DTYPE_F32, n)) &&
          df_op_sumsq(bes[1], x, DF_DTYPE_F32, n) > 9e59);
    CHECK(df_op_sumsq(bes[0], NULL, DF_DTYPE_F32, 5) == -EINVAL);
    CHECK(df_op_sumsq(bes[0], x, DF_DTYPE_F32, -1) == -EINVAL);
    CHECK(df_op_sumsq(NULL, x, DF_DTYPE_F32, 5) == -EINVAL);

    /* BF16: the bits of the F32 array of the widened values, on 1 and 3
     * threads, at an aligned and an odd element offset (same order). */
    uint16_t *xb = xmalloc((size_t)(n + 1) * 2);
    for (int64_t i = 0; i < n; i++) {
        float f = test_randn(&rng) * 3.0f;
        xb[i] = df_f32_to_bf16(fabsf(f) < 0.05f ? 0.05f : f);
        x[i] = bf_val(xb[i]);
    }
    double f32 = df_op_sumsq(bes[0], x, DF_DTYPE_F32, n);
    double b1 = df_op_sumsq(bes[0], xb, DF_DTYPE_BF16, n);
    double b3 = df_op_sumsq(bes[1], xb, DF_DTYPE_BF16, n);
    CHECK(f32 > 0 && bitwise_equal(&f32, &b1, 8) && bitwise_equal(&f32, &b3, 8));
    f32 = df_op_sumsq(bes[0], x + 1, DF_DTYPE_F32, n - 1);
    b3 = df_op_sumsq(bes[1], xb + 1, DF_DTYPE_BF16, n - 1);
    CHECK(f32 > 0 && bitwise_equal(&f32, &b3, 8));
    CHECK(df_op_sumsq(bes[0], xb, DF_DTYPE_BF16, 1) == (double)x[0] * x[0]);
    CHECK(df_op_sumsq(bes[0], NULL, DF_DTYPE_BF16, 0) == 0.0);
    xb[n - 1] = 0x7f7f; /* the largest bf16, ~3.4e38: its square only fits a double */
    CHECK(isfinite(df_op_sumsq(bes[1], xb, DF_DTYPE_BF16, n)) &&
          df_op_sumsq(bes[1], xb, DF_DTYPE_BF16, n) > 1e76);
    xb[n - 1] = 0xffc0; /* NaN */
    CHECK(isnan(df_op_sumsq(bes[1], xb, DF_DTYPE_BF16, n)));
    CHECK(df_op_sumsq(bes[0], NULL, DF_DTYPE_BF16, 5) == -EINVAL);
    static const df_dtype bad[] = {DF_DTYPE_F16, DF_DTYPE_I32, DF_DTYPE_I64, DF_DTYPE_INVALID,
                                   (df_dtype)99};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
        CHECK(df_op_sumsq(bes[0], x, bad[i], n) == -EINVAL);
    free(xb);
    free(x);
}

int main(void)
{
    if (open_backends())
        return 1;
    test_adamw();
    test_sumsq();
    close_backends();
    return test_main_end();
}
