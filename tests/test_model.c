/* test_model - the CPU target forward against HF transformers' own hidden
 * states (tests/fixtures, made by scripts/make_fixtures.py on the GPU
 * machine): qwen3 (dense) and qwen3_5 (Gated DeltaNet + gated attention),
 * four documents of lengths 37, 150, 1, 70 run PACKED in one forward here
 * and one by one in HF, so packing leaks nothing across documents. Every
 * hidden state 0..L is compared with both references:
 *
 *  - hs_fp32: HF computing in fp32 from the same bf16 weights. Our CPU
 *    backend computes in fp32 too, so only summation order differs:
 *    relative L2 error per layer <= 1e-4 (observed ~1e-6..1e-5).
 *  - hs_bf16: HF computing in bf16, the real reference. Rounding every op's
 *    output to bf16 puts it at some distance d from the fp32 run; by the
 *    rule of KERNELS.md we must be within 2x that: ||ours - bf16|| <=
 *    2 ||fp32 - bf16|| (+ 1e-6 ||bf16|| for layers where d is ~0).
 *
 * Then bad input: a missing tensor, a wrong shape, an unsupported
 * model_type, token ids >= vocab — each a clear error naming what. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fsutil.h"
#include "model.h"
#include "ops.h"
#include "safetensors.h"
#include "test.h"

static double l2(const float *a, const float *b, size_t n)
{
    double s = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (b ? (double)b[i] : 0.0);
        s += d * d;
    }
    return sqrt(s);
}

static void check_model(const char *name)
{
    char dir[4096], exp[4200];
    snprintf(dir, sizeof dir, "%s/%s", DFLASH_FIXTURES, name);
    snprintf(exp, sizeof exp, "%s/expected.safetensors", dir);
    struct stat sb;
    if (stat(exp, &sb) != 0) {
        fprintf(stderr, "%s: fixture missing\n", exp);
        df_test_failures++;
        return;
    }
    df_err e = {0};
    df_backend *be = df_backend_cpu_open(2, &e);
    df_model *m = NULL;
    CHECK_OK(df_model_open(dir, be, &m, &e), &e);
    df_st *ref = NULL;
    CHECK_OK(df_st_open(exp, &ref, &e), &e);
    if (!m || !ref) {
        df_model_close(m);
        df_st_close(ref);
        df_backend_close(be);
        return;
    }
    const df_model_config *c = df_model_get_config(m);
    const df_st_tensor *tid = df_st_find(ref, "input_ids"), *tcu = df_st_find(ref, "cu_seqlens");
    CHECK(tid && tcu);
    int64_t T = tid->shape[0];
    int n_seq = (int)tcu->shape[0] - 1;
    uint32_t *ids = malloc((size_t)T * 4);
    for (int64_t t = 0; t < T; t++)
        ids[t] = (uint32_t)((const int32_t *)tid->data)[t];
    int L = c->num_hidden_layers;
    int hs[65];
    void *out[65];
    for (int i = 0; i <= L; i++) {
        hs[i] = i;
        out[i] = malloc((size_t)T * c->hidden_size * sizeof(float));
        for (size_t x = 0; x < (size_t)T * c->hidden_size; x++)
            ((float *)out[i])[x] = NAN; /* poison */
    }
    int rc = df_model_forward(m, ids, tcu->data, n_seq, T, hs, L + 1, DF_DTYPE_F32, out, &e);
    CHECK_OK(rc, &e);
    size_t n = (size_t)T * c->hidden_size;
    for (int i = 0; i <= L && !rc; i++) {
        char k32[64], k16[64];
        snprintf(k32, sizeof k32, "hs_fp32.%d", i);
        snprintf(k16, sizeof k16, "hs_bf16.%d", i);
        const df_st_tensor *r32 = df_st_find(ref, k32), *r16 = df_st_find(ref, k16);
        CHECK(r32 && r16 && (size_t)r32->numel == n);
        if (!r32 || !r16)
            continue;
        const float *o = out[i], *a = r32->data, *b = r16->data;
        double norm = l2(a, NULL, n), e32 = l2(o, a, n), e16 = l2(o, b, n), d = l2(a, b, n);
        int nan = 0;
        for (size_t x = 0; x < n; x++)
            nan += isnan(o[x]) || isinf(o[x]);
        printf("%s hs[%d]: |ref| %.4g  rel err vs fp32 %.2e  vs bf16 %.2e  (HF bf16 vs fp32 %.2e)\n",
               name, i, norm, e32 / norm, e16 / norm, d / norm);
        CHECK_EQ(nan, 0);
        if (!(e32 <= 1e-4 * norm) || !(e16 <= 2 * d + 1e-6 * norm)) {
            fprintf(stderr, "%s hs[%d] out of tolerance\n", name, i);
            df_test_failures++;
        }
    }
    /* BF16 output equals the F32 output rounded. */
    uint16_t *bf = malloc(n * 2);
    int hs1[1] = {1};
    void *ob[1] = {bf};
    CHECK_OK(df_model_forward(m, ids, tcu->data, n_seq, T, hs1, 1, DF_DTYPE_BF16, ob, &e), &e);
    int mism = 0;
    for (size_t x = 0; x < n; x++)
        mism += bf[x] != df_f32_to_bf16(((float *)out[1])[x]);
    CHECK_EQ(mism, 0);
    /* Token ids >= vocab are refused, naming the token. */
    ids[5] = (uint32_t)c->vocab_size;
    CHECK_ERR(df_model_forward(m, ids, tcu->data, n_seq, T, hs1, 1, DF_DTYPE_BF16, ob, &e),
              -EINVAL, &e, "token 5");
    free(bf);
    for (int i = 0; i <= L; i++)
        free(out[i]);
    free(ids);
    df_st_close(ref);
    df_model_close(m);
    df_backend_close(be);
}

/* A copy of a fixture model with one change, for the bad-input cases. */
static void copy_model(const char *name, const char *dst, const char *sed_config)
{
    char cmd[9000];
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && mkdir -p '%s' && cp '%s/%s/config.json' '%s/%s/model.safetensors' '%s/'",
             dst, dst, DFLASH_FIXTURES, name, DFLASH_FIXTURES, name, dst);
    CHECK(system(cmd) == 0);
    if (sed_config) {
        snprintf(cmd, sizeof cmd, "sed -i '%s' '%s/config.json'", sed_config, dst);
        CHECK(system(cmd) == 0);
    }
}

/* A copy of fixture model `name` in dst whose tensors matching any of the
 * '|'-separated substrings in `which` are stored as dtype t instead. */
static int rewrite_model(const char *name, const char *dst, const char *which, df_dtype t)
{
    copy_model(name, dst, NULL);
    char src[4200], out[4200];
    snprintf(src, sizeof src, "%s/%s/model.safetensors", DFLASH_FIXTURES, name);
    snprintf(out, sizeof out, "%s/model.safetensors", dst);
    df_err e = {0};
    df_st *st = NULL;
    df_st_writer *w = NULL;
    if (df_st_open(src, &st, &e) || df_st_writer_open(out, &w, &e))
        return -1;
    void *bufs[256];
    int nb = 0, rc = 0;
    for (size_t i = 0; i < df_st_count(st) && !rc; i++) {
        const df_st_tensor *x = df_st_at(st, i);
        int match = 0;
        char pat[256];
        snprintf(pat, sizeof pat, "%s", which);
        for (char *tok = strtok(pat, "|"); tok; tok = strtok(NULL, "|"))
            match |= strstr(x->name, tok) != NULL;
        const void *data = x->data;
        df_dtype dt = x->dtype;
        if (match && x->dtype == DF_DTYPE_BF16 && nb < 256) {
            void *b = malloc(x->numel * 4 + 4);
            for (uint64_t k = 0; k < x->numel; k++) {
                float f = df_bf16_to_f32(((const uint16_t *)x->data)[k]);
                if (t == DF_DTYPE_F32)
                    ((float *)b)[k] = f;
                else
                    ((int32_t *)b)[k] = (int32_t)(f * 1000);
            }
            bufs[nb++] = b;
            data = b;
            dt = t;
        }
        rc = df_st_writer_add(w, x->name, dt, x->ndim, x->shape, data, &e);
    }
    if (!rc)
        rc = df_st_writer_finish(w, &e);
    df_st_writer_free(w);
    df_st_close(st);
    for (int i = 0; i < nb; i++)
        free(bufs[i]);
    return rc;
}

static void check_bad_input(void)
{
    const char *base = test_tmpdir("model-bad");
    char dir[4096];
    df_err e = {0};
    df_backend *be = df_backend_cpu_open(1, &e);
    df_model *m = NULL;

    snprintf(dir, sizeof dir, "%s/llama", base);
    copy_model("qwen3-tiny", dir, "s/\"qwen3\"/\"llama\"/");
    CHECK(df_model_open(dir, be, &m, &e) < 0);
    CHECK(strstr(e.msg, "llama") && strstr(e.msg, "qwen3"));

    snprintf(dir, sizeof dir, "%s/shape", base);
    copy_model("qwen3-tiny", dir, "s/\"intermediate_size\": *[0-9]*/\"intermediate_size\": 96/");
    CHECK_ERR(df_model_open(dir, be, &m, &e), -DF_EMISMATCH, &e, "mlp");

    /* Drop one tensor: rewrite the checkpoint without it. */
    snprintf(dir, sizeof dir, "%s/missing", base);
    copy_model("qwen3-tiny", dir, NULL);
    char src[4200], dst[4200];
    snprintf(src, sizeof src, "%s/qwen3-tiny/model.safetensors", DFLASH_FIXTURES);
    snprintf(dst, sizeof dst, "%s/model.safetensors", dir);
    df_st *st = NULL;
    CHECK_OK(df_st_open(src, &st, &e), &e);
    df_st_writer *w = NULL;
    CHECK_OK(df_st_writer_open(dst, &w, &e), &e);
    for (size_t i = 0; st && w && i < df_st_count(st); i++) {
        const df_st_tensor *t = df_st_at(st, i);
        if (strcmp(t->name, "model.layers.2.self_attn.k_norm.weight"))
            CHECK_OK(df_st_writer_add(w, t->name, t->dtype, t->ndim, t->shape, t->data, &e), &e);
    }
    CHECK_OK(df_st_writer_finish(w, &e), &e);
    df_st_writer_free(w);
    df_st_close(st);
    CHECK_ERR(df_model_open(dir, be, &m, &e), -ENOENT, &e, "model.layers.2.self_attn.k_norm.weight");

    /* Dtype surprises: an integer weight is refused by name; F32 weights where
     * the checkpoint had BF16 (real Qwen3.5 checkpoints keep A_log in F32)
     * load and give bit-identical states (bf16 -> f32 is exact). */
    snprintf(dir, sizeof dir, "%s/i32", base);
    CHECK(rewrite_model("qwen3-tiny", dir, "model.layers.1.mlp.up_proj.weight", DF_DTYPE_I32) == 0);
    CHECK_ERR(df_model_open(dir, be, &m, &e), -DF_EMISMATCH, &e, "model.layers.1.mlp.up_proj.weight");
    snprintf(dir, sizeof dir, "%s/f32", base);
    CHECK(rewrite_model("qwen3_5-tiny", dir, "A_log|norm.weight|conv1d", DF_DTYPE_F32) == 0);
    char ref_dir[4096];
    snprintf(ref_dir, sizeof ref_dir, "%s/qwen3_5-tiny", DFLASH_FIXTURES);
    df_model *a = NULL, *b = NULL;
    CHECK_OK(df_model_open(ref_dir, be, &a, &e), &e);
    CHECK_OK(df_model_open(dir, be, &b, &e), &e);
    if (a && b) {
        uint32_t ids[40];
        uint64_t r = 3;
        for (int i = 0; i < 40; i++)
            ids[i] = 3 + (uint32_t)(test_rand(&r) % 500);
        int32_t cu[3] = {0, 17, 40};
        int hs[1] = {3};
        static float oa[40 * 64], ob[40 * 64];
        void *pa[1] = {oa}, *pb[1] = {ob};
        CHECK_OK(df_model_forward(a, ids, cu, 2, 40, hs, 1, DF_DTYPE_F32, pa, &e), &e);
        CHECK_OK(df_model_forward(b, ids, cu, 2, 40, hs, 1, DF_DTYPE_F32, pb, &e), &e);
        CHECK(memcmp(oa, ob, sizeof oa) == 0);
    }
    df_model_close(a);
    df_model_close(b);
    df_backend_close(be);
}

int main(void)
{
    check_model("qwen3-tiny");
    check_model("qwen3_5-tiny");
    check_bad_input();
    return test_main_end();
}
