/* model.c - qwen3 / qwen3_5 target forward over the op interface. */
#include "model.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "safetensors.h"

/* The input projections of a block are fused into one weight (one GEMM,
 * N large enough to fill the GPU; its output columns are split by views):
 *   attention: w_in = [q ; (gate ;) k ; v] — the gated qwen3_5 q_proj is
 *     reordered at load from the checkpoint's per-head [q_h | gate_h] rows to
 *     all q heads, then all gate heads, so q and gate are contiguous heads;
 *   GDN: w_in = [in_proj_qkv ; in_proj_z ; in_proj_b ; in_proj_a];
 *   MLP: gate_up = [gate_proj ; up_proj]. */
typedef struct layer_w {
    int type; /* df_layer_type */
    df_tensor in_norm, post_norm;
    df_tensor w_in;
    /* attention (full) */
    df_tensor wo, q_norm, k_norm;
    /* Gated DeltaNet */
    df_tensor conv, dt_bias, A_log, gnorm, out;
    /* MLP */
    df_tensor gate_up, down;
} layer_w;

struct df_model {
    df_model_config cfg;
    df_backend *be;
    df_st *st;
    char dir[4096];
    char prefix[64]; /* "model." or "model.language_model." */
    int plus_one;    /* qwen3_5 norms are x_hat * (1 + w) */
    df_tensor embed, final_norm;
    layer_w *layers;
    int random;      /* weights drawn by df_backend_fill_uniform, no checkpoint */
    uint64_t seed;
    df_dtype adt;    /* the backend's activation dtype */
    size_t aes;      /* its size in bytes */
    void **owned;    /* backend allocations holding weights */
    size_t n_owned, cap_owned;
    void **host_owned; /* host buffers holding fused weights (CPU backend) */
    size_t n_host, cap_host;

    /* workspace, for up to cap tokens: activations in adt except gb (F32) */
    int64_t cap;
    void *x, *h, *big1, *big2, *mid, *gb;
    int64_t w_big1, w_big2, w_mid; /* row widths of big1, big2 and mid */
    int32_t *pos;

    /* df_model_set_projection: z = P x on the device. pw [R, 2D] BF16 holds
     * P's high and low BF16 halves; xx [pcap, 2D] the feature layers twice
     * (each token's K layers side by side, then again), so that one GEMM
     * with FP32 accumulation sums x (P_hi + P_lo) and rounds z once. */
    int proj_R, proj_D;
    df_tensor pw;
    void *xx, *z;
    int64_t pcap;
};

/* ------------------------------------------------------------ loading */

static int own(df_model *m, void *p, df_err *e)
{
    if (m->n_owned == m->cap_owned) {
        size_t cap = m->cap_owned ? 2 * m->cap_owned : 256;
        void **o = realloc(m->owned, cap * sizeof *o);
        if (!o) {
            df_backend_free(m->be, p);
            return df_errf(e, -ENOMEM, "out of memory");
        }
        m->owned = o;
        m->cap_owned = cap;
    }
    m->owned[m->n_owned++] = p;
    return 0;
}

static int own_host(df_model *m, void *p, df_err *e)
{
    if (m->n_host == m->cap_host) {
        size_t cap = m->cap_host ? 2 * m->cap_host : 64;
        void **o = realloc(m->host_owned, cap * sizeof *o);
        if (!o) {
            free(p);
            return df_errf(e, -ENOMEM, "out of memory");
        }
        m->host_owned = o;
        m->cap_host = cap;
    }
    m->host_owned[m->n_host++] = p;
    return 0;
}

/* -ENOMEM for a weight that does not fit the device, saying how much is in use. */
static int no_room(df_model *m, const char *name, const char *what, size_t bytes, df_err *e)
{
    int64_t used = df_backend_mem_used(m->be);
    return df_errf(e, -ENOMEM, "%s%s: cannot allocate %zu bytes on %s (%.1f GiB in use): the "
                   "model's weights do not fit this device's memory", name, what, bytes,
                   df_backend_name(m->be), used >= 0 ? (double)used / (1 << 30) : 0.0);
}

/* Puts a host weight where the backend's ops can read it: the CPU reads
 * the mapping itself; other backends get a BF16 copy in their memory. */
static int place(df_model *m, const char *name, df_tensor *t, df_err *e)
{
    if (df_backend_host_addressable(m->be))
        return 0;
    int64_t n = df_tensor_numel(t);
    uint16_t *dev = df_backend_alloc(m->be, (size_t)n * 2);
    if (!dev)
        return no_room(m, name, "", (size_t)n * 2, e);
    int rc = own(m, dev, e);
    if (rc)
        return rc;
    if (t->dtype == DF_DTYPE_BF16) {
        rc = df_backend_upload(m->be, dev, t->data, (size_t)n * 2);
    } else { /* convert in slices so a large F32 checkpoint needs no full copy */
        enum { SLICE = 1 << 20 };
        uint16_t *tmp = malloc(SLICE * sizeof *tmp);
        if (!tmp)
            return df_errf(e, -ENOMEM, "out of memory");
        size_t es = df_dtype_size(t->dtype);
        for (int64_t i = 0; i < n && !rc; i += SLICE) {
            int64_t k = n - i < SLICE ? n - i : SLICE;
            for (int64_t j = 0; j < k; j++)
                tmp[j] = df_f32_to_bf16(
                    df_elem_to_f32((const uint8_t *)t->data + (size_t)(i + j) * es, t->dtype));
            rc = df_backend_upload(m->be, dev + i, tmp, (size_t)k * 2);
        }
        free(tmp);
    }
    if (rc)
        return df_errf(e, rc, "%s: upload to %s failed", name, df_backend_name(m->be));
    t->data = dev;
    t->dtype = DF_DTYPE_BF16;
    return 0;
}

/* Random weights (benchmarks): values in [lo, hi) seeded by the name, so a
 * model is the same on every backend and every run. */
static int random_weight(df_model *m, const char *name, int64_t n, float lo, float hi, void **p,
                         df_dtype *dt, df_err *e)
{
    *dt = df_backend_host_addressable(m->be) ? DF_DTYPE_F32 : DF_DTYPE_BF16;
    *p = df_backend_alloc(m->be, (size_t)n * df_dtype_size(*dt));
    if (!*p)
        return no_room(m, name, "", (size_t)n * df_dtype_size(*dt), e);
    int rc = own(m, *p, e);
    if (rc)
        return rc;
    uint64_t h = m->seed ^ 0xcbf29ce484222325ull; /* FNV-1a of the name */
    for (const char *c = name; *c; c++)
        h = (h ^ (uint8_t)*c) * 0x100000001b3ull;
    if ((rc = df_backend_fill_uniform(m->be, *p, *dt, n, h, lo, hi)))
        return df_errf(e, rc, "%s: fill failed", name);
    return 0;
}

/* The range random weights are drawn from, by the tensor's role. Matrices
 * get std 0.02 (HF's initializer_range); norms sit near their identity; the
 * GDN decay parameters stay in the range real checkpoints use. */
static void random_range(const df_model *m, const char *suffix, int ndim, float *lo, float *hi)
{
    const float a = 0.02f * 1.7320508f; /* uniform with std 0.02 */
    *lo = -a;
    *hi = a;
    if (strstr(suffix, "A_log")) {
        *lo = 0.0f; /* A = exp(A_log) in [1, 16] */
        *hi = 2.77f;
    } else if (strstr(suffix, "dt_bias")) {
        *lo = 0.5f;
        *hi = 1.5f;
    } else if (strstr(suffix, "conv1d")) {
        *lo = -0.5f;
        *hi = 0.5f;
    } else if (ndim == 1) { /* norms: (1 + w) with w ~ 0, or w ~ 1 */
        int plain = strstr(suffix, "linear_attn.norm") != NULL || !m->plus_one;
        *lo = plain ? 0.9f : -0.1f;
        *hi = plain ? 1.1f : 0.1f;
    }
}

static int weight(df_model *m, const char *suffix, int ndim, int64_t d0, int64_t d1, int64_t d2,
                  df_tensor *t, df_err *e)
{
    char name[256];
    snprintf(name, sizeof name, "%s%s", m->prefix, suffix);
    /* 3-D conv weights [C, 1, K] are viewed [C, K]. */
    int64_t rows = d0, cols = ndim == 1 ? 0 : ndim == 3 ? d2 : d1;
    if (m->random) {
        float lo, hi;
        void *p;
        df_dtype dt;
        random_range(m, suffix, ndim, &lo, &hi);
        int rc = random_weight(m, name, ndim == 1 ? rows : rows * cols, lo, hi, &p, &dt, e);
        if (rc)
            return rc;
        *t = ndim == 1 ? df_tensor_1d(p, dt, rows) : df_tensor_2d(p, dt, rows, cols);
        return 0;
    }
    int64_t shape[3] = {d0, d1, d2};
    const df_st_tensor *st;
    int rc = df_st_expect(m->st, name, DF_DTYPE_INVALID, ndim, shape, &st, e);
    if (rc)
        return rc;
    if (st->dtype != DF_DTYPE_BF16 && st->dtype != DF_DTYPE_F16 && st->dtype != DF_DTYPE_F32)
        return df_errf(e, -DF_EMISMATCH, "%s: %s has dtype %s; BF16, F16 or F32 expected",
                       st->file, name, df_dtype_name(st->dtype));
    if (ndim == 1)
        *t = df_tensor_1d((void *)st->data, st->dtype, d0);
    else
        *t = df_tensor_2d((void *)st->data, st->dtype, rows, cols);
    return place(m, name, t, e);
}

/* One part of a fused weight: its checkpoint suffix and rows; reorder_heads
 * > 0 reorders per-head [q_h | gate_h] row pairs of that head size. */
typedef struct part {
    const char *suffix;
    int64_t rows;
    int64_t reorder_heads;
} part;

/* Copies rows [r0, r0 + n) of a checkpoint tensor into dst (dst_dt: the
 * same dtype, or F32 when the parts' dtypes differ). */
static void copy_rows(const df_st_tensor *t, int64_t r0, int64_t n, int64_t cols, df_dtype dst_dt,
                      uint8_t *dst)
{
    size_t es = df_dtype_size(t->dtype), row = (size_t)cols * es;
    const uint8_t *src = (const uint8_t *)t->data + (size_t)r0 * row;
    if (dst_dt == t->dtype) {
        memcpy(dst, src, (size_t)n * row);
        return;
    }
    float *f = (float *)dst;
    for (size_t i = 0; i < (size_t)(n * cols); i++)
        f[i] = df_elem_to_f32(src + i * es, t->dtype);
}

/* A fused [sum rows, cols] weight made of parts (layer li), placed where the
 * backend reads it. Random models fill each part's rows with that part's
 * own values, so fusing never changes a model. On a device the rows are
 * padded with zeros to a multiple of 128: GEMM tiles then divide N (the
 * GDN projection's 16480 rows cost ~4% of the GEMM rate unpadded); the
 * padding columns of the output are never read. */
static int fused_weight(df_model *m, int li, const part *pt, int np, int64_t cols, df_tensor *t,
                        df_err *e)
{
    char name[256], first[256];
    int64_t rows = 0;
    for (int i = 0; i < np; i++)
        rows += pt[i].rows;
    int64_t prows = df_backend_host_addressable(m->be) ? rows : (rows + 127) / 128 * 128;
    snprintf(first, sizeof first, "%slayers.%d.%s", m->prefix, li, pt[0].suffix);
    if (m->random) {
        df_dtype dt = df_backend_host_addressable(m->be) ? DF_DTYPE_F32 : DF_DTYPE_BF16;
        size_t es = df_dtype_size(dt);
        uint8_t *p = df_backend_alloc(m->be, (size_t)(prows * cols) * es);
        if (!p)
            return no_room(m, first, " (fused)", (size_t)(prows * cols) * es, e);
        int rc = own(m, p, e);
        if (!rc && prows > rows)
            rc = df_backend_zero(m->be, p + (size_t)(rows * cols) * es,
                                 (size_t)((prows - rows) * cols) * es);
        int64_t r0 = 0;
        for (int i = 0; i < np && !rc; i++) {
            float lo, hi;
            random_range(m, pt[i].suffix, 2, &lo, &hi);
            snprintf(name, sizeof name, "%slayers.%d.%s", m->prefix, li, pt[i].suffix);
            uint64_t h = m->seed ^ 0xcbf29ce484222325ull;
            for (const char *c = name; *c; c++)
                h = (h ^ (uint8_t)*c) * 0x100000001b3ull;
            rc = df_backend_fill_uniform(m->be, p + (size_t)(r0 * cols) * es, dt,
                                         pt[i].rows * cols, h, lo, hi);
            if (rc)
                rc = df_errf(e, rc, "%s: fill failed", name);
            r0 += pt[i].rows;
        }
        *t = df_tensor_2d(p, dt, prows, cols);
        return rc;
    }
    const df_st_tensor *st[8];
    df_dtype dt = DF_DTYPE_INVALID;
    for (int i = 0; i < np; i++) {
        int64_t shape[2] = {pt[i].rows, cols};
        snprintf(name, sizeof name, "%slayers.%d.%s", m->prefix, li, pt[i].suffix);
        int rc = df_st_expect(m->st, name, DF_DTYPE_INVALID, 2, shape, &st[i], e);
        if (rc)
            return rc;
        if (st[i]->dtype != DF_DTYPE_BF16 && st[i]->dtype != DF_DTYPE_F16 &&
            st[i]->dtype != DF_DTYPE_F32)
            return df_errf(e, -DF_EMISMATCH, "%s: %s has dtype %s; BF16, F16 or F32 expected",
                           st[i]->file, name, df_dtype_name(st[i]->dtype));
        dt = i == 0 || st[i]->dtype == dt ? st[i]->dtype : DF_DTYPE_F32;
    }
    size_t es = df_dtype_size(dt);
    uint8_t *buf = calloc((size_t)(prows * cols), es); /* padding rows stay zero */
    if (!buf)
        return df_errf(e, -ENOMEM, "%s (fused): out of memory", first);
    uint8_t *dst = buf;
    for (int i = 0; i < np; i++) {
        int64_t D = pt[i].reorder_heads;
        if (D > 0) { /* per-head [q_h | gate_h] -> all q heads, then all gate heads */
            int64_t nh = pt[i].rows / (2 * D);
            for (int64_t h = 0; h < nh; h++) {
                copy_rows(st[i], 2 * h * D, D, cols, dt, dst + (size_t)(h * D * cols) * es);
                copy_rows(st[i], (2 * h + 1) * D, D, cols, dt,
                          dst + (size_t)((nh + h) * D * cols) * es);
            }
        } else {
            copy_rows(st[i], 0, pt[i].rows, cols, dt, dst);
        }
        dst += (size_t)(pt[i].rows * cols) * es;
    }
    *t = df_tensor_2d(buf, dt, prows, cols);
    int rc = place(m, first, t, e);
    if (rc || !df_backend_host_addressable(m->be))
        free(buf); /* placed on the device (or failed): the host copy is done */
    else
        rc = own_host(m, buf, e);
    return rc;
}

static int load_attention(df_model *m, int i, layer_w *L, df_err *e)
{
    const df_model_config *c = &m->cfg;
    int64_t H = c->hidden_size, D = c->head_dim, nq = c->num_attention_heads,
            nkv = c->num_key_value_heads;
    char s[128];
    int rc;
    int gated = c->arch == DF_ARCH_QWEN3_5 && c->attn_output_gate;
    part in[3] = {{"self_attn.q_proj.weight", (gated ? 2 : 1) * nq * D, gated ? D : 0},
                  {"self_attn.k_proj.weight", nkv * D, 0},
                  {"self_attn.v_proj.weight", nkv * D, 0}};
    if ((rc = fused_weight(m, i, in, 3, H, &L->w_in, e)))
        return rc;
#define W(suf, nd, a, b, cc, dst)                          \
    snprintf(s, sizeof s, "layers.%d.%s", i, suf);          \
    if ((rc = weight(m, s, nd, a, b, cc, dst, e)))           \
        return rc
    W("self_attn.o_proj.weight", 2, H, nq * D, 0, &L->wo);
    W("self_attn.q_norm.weight", 1, D, 0, 0, &L->q_norm);
    W("self_attn.k_norm.weight", 1, D, 0, 0, &L->k_norm);
#undef W
    return 0;
}

static int load_gdn(df_model *m, int i, layer_w *L, df_err *e)
{
    const df_model_config *c = &m->cfg;
    int64_t H = c->hidden_size, hk = c->linear_num_key_heads, hv = c->linear_num_value_heads,
            dk = c->linear_key_head_dim, dv = c->linear_value_head_dim,
            K = c->linear_conv_kernel_dim, C = 2 * hk * dk + hv * dv;
    char s[128];
    int rc;
    part in[4] = {{"linear_attn.in_proj_qkv.weight", C, 0},
                  {"linear_attn.in_proj_z.weight", hv * dv, 0},
                  {"linear_attn.in_proj_b.weight", hv, 0},
                  {"linear_attn.in_proj_a.weight", hv, 0}};
    if ((rc = fused_weight(m, i, in, 4, H, &L->w_in, e)))
        return rc;
#define W(suf, nd, a, b, cc, dst)                          \
    snprintf(s, sizeof s, "layers.%d.%s", i, suf);          \
    if ((rc = weight(m, s, nd, a, b, cc, dst, e)))           \
        return rc
    W("linear_attn.conv1d.weight", 3, C, 1, K, &L->conv);
    W("linear_attn.dt_bias", 1, hv, 0, 0, &L->dt_bias);
    W("linear_attn.A_log", 1, hv, 0, 0, &L->A_log);
    W("linear_attn.norm.weight", 1, dv, 0, 0, &L->gnorm);
    W("linear_attn.out_proj.weight", 2, H, hv * dv, 0, &L->out);
#undef W
    return 0;
}

static int load_layer(df_model *m, int i, df_err *e)
{
    const df_model_config *c = &m->cfg;
    layer_w *L = &m->layers[i];
    int64_t H = c->hidden_size, F = c->intermediate_size;
    char s[128];
    int rc;
    L->type = c->layer_types[i];
    if (L->type == DF_LAYER_SLIDING)
        return df_errf(e, -ENOTSUP, "%s: layer %d is a sliding-window layer; sliding-window "
                       "targets are not supported yet", m->dir, i);
#define W(suf, nd, a, b, dst)                              \
    snprintf(s, sizeof s, "layers.%d.%s", i, suf);          \
    if ((rc = weight(m, s, nd, a, b, 0, dst, e)))            \
        return rc
    W("input_layernorm.weight", 1, H, 0, &L->in_norm);
    W("post_attention_layernorm.weight", 1, H, 0, &L->post_norm);
    W("mlp.down_proj.weight", 2, H, F, &L->down);
#undef W
    part gu[2] = {{"mlp.gate_proj.weight", F, 0}, {"mlp.up_proj.weight", F, 0}};
    if ((rc = fused_weight(m, i, gu, 2, H, &L->gate_up, e)))
        return rc;
    return L->type == DF_LAYER_LINEAR ? load_gdn(m, i, L, e) : load_attention(m, i, L, e);
}

void df_model_close(df_model *m)
{
    if (!m)
        return;
    free(m->layers);
    for (size_t i = 0; i < m->n_host; i++)
        free(m->host_owned[i]);
    free(m->host_owned);
    void *bufs[] = {m->x, m->h, m->big1, m->big2, m->mid, m->gb, m->xx, m->z};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++)
        df_backend_free(m->be, bufs[i]);
    for (size_t i = 0; i < m->n_owned; i++)
        df_backend_free(m->be, m->owned[i]);
    free(m->owned);
    free(m->pos);
    df_st_close(m->st);
    free(m);
}

static int model_open(const char *dir, df_backend *be, int random, uint64_t seed,
                      df_model **out, df_err *e)
{
    *out = NULL;
    df_model *m = calloc(1, sizeof *m);
    if (!m)
        return df_errf(e, -ENOMEM, "out of memory");
    m->be = be;
    m->random = random;
    m->seed = seed;
    m->adt = df_backend_act_dtype(be);
    m->aes = df_dtype_size(m->adt);
    snprintf(m->dir, sizeof m->dir, "%s", dir);
    int rc = df_model_config_load(dir, &m->cfg, e);
    if (!rc && !random)
        rc = df_st_open(dir, &m->st, e);
    if (rc)
        goto fail;
    const df_model_config *c = &m->cfg;
    m->plus_one = c->arch == DF_ARCH_QWEN3_5;
    /* Text tensors sit under model.language_model. in multimodal qwen3_5
     * checkpoints, under model. otherwise. */
    snprintf(m->prefix, sizeof m->prefix, "%s",
             !random && df_st_find(m->st, "model.language_model.embed_tokens.weight")
                 ? "model.language_model."
                 : "model.");
    if ((rc = weight(m, "embed_tokens.weight", 2, c->vocab_size, c->hidden_size, 0, &m->embed, e)) ||
        (rc = weight(m, "norm.weight", 1, c->hidden_size, 0, 0, &m->final_norm, e)))
        goto fail;
    m->layers = calloc((size_t)c->num_hidden_layers, sizeof *m->layers);
    if (!m->layers) {
        rc = df_errf(e, -ENOMEM, "out of memory");
        goto fail;
    }
    for (int i = 0; i < c->num_hidden_layers; i++)
        if ((rc = load_layer(m, i, e)))
            goto fail;
    *out = m;
    return 0;
fail:
    df_model_close(m);
    return rc;
}

int df_model_open(const char *dir, df_backend *be, df_model **out, df_err *e)
{
    return model_open(dir, be, 0, 0, out, e);
}

int df_model_open_random(const char *config, df_backend *be, uint64_t seed, df_model **out,
                         df_err *e)
{
    return model_open(config, be, 1, seed, out, e);
}

const df_model_config *df_model_get_config(const df_model *m)
{
    return &m->cfg;
}

/* ------------------------------------------------------------ forward */

static int64_t max3(int64_t a, int64_t b, int64_t c)
{
    int64_t m = a > b ? a : b;
    return m > c ? m : c;
}

static int reserve(df_model *m, int64_t T, df_err *e)
{
    if (T <= m->cap)
        return 0;
    const df_model_config *c = &m->cfg;
    int64_t H = c->hidden_size, D = c->head_dim, nq = c->num_attention_heads,
            nkv = c->num_key_value_heads, F = c->intermediate_size;
    int64_t C = 2 * (int64_t)c->linear_num_key_heads * c->linear_key_head_dim +
                (int64_t)c->linear_num_value_heads * c->linear_value_head_dim;
    int64_t VD = (int64_t)c->linear_num_value_heads * c->linear_value_head_dim;
    int64_t hv = c->linear_num_value_heads ? c->linear_num_value_heads : 1;
    m->w_big1 = max3((2 * nq + 2 * nkv) * D, C + VD + 2 * hv, 2 * F) + 127; /* + fused padding */
    m->w_big2 = C;
    m->w_mid = nq * D > VD ? nq * D : VD;
    void **bufs[] = {&m->x, &m->h, &m->big1, &m->big2, &m->mid, &m->gb};
    int64_t widths[] = {H, H, m->w_big1, m->w_big2, m->w_mid, 2 * hv};
    for (size_t i = 0; i < sizeof bufs / sizeof bufs[0]; i++) {
        size_t es = bufs[i] == &m->gb ? sizeof(float) : m->aes; /* g, beta: F32 */
        df_backend_free(m->be, *bufs[i]);
        *bufs[i] = df_backend_alloc(m->be, (size_t)(T * (widths[i] ? widths[i] : 1)) * es);
        if (!*bufs[i]) {
            m->cap = 0;
            int64_t used = df_backend_mem_used(m->be);
            return df_errf(e, -ENOMEM, "out of memory on %s for %lld tokens of activations "
                           "(%.1f GiB in use, the weights included): pass a smaller "
                           "--batch-tokens (a batch holds at least its longest document)",
                           df_backend_name(m->be), (long long)T,
                           used >= 0 ? (double)used / (1 << 30) : 0.0);
        }
    }
    free(m->pos);
    m->pos = malloc((size_t)T * sizeof *m->pos);
    if (!m->pos)
        return df_errf(e, -ENOMEM, "out of memory");
    m->cap = T;
    return 0;
}

/* A [T, cols] contiguous activation view of a workspace buffer. */
static df_tensor act(const df_model *m, void *p, int64_t T, int64_t cols)
{
    return df_tensor_2d(p, m->adt, T, cols);
}

/* [T, heads, D] view of a [T, heads*D] column view (any row stride): the
 * per-head norms run as one op over it. */
static df_tensor heads_view(const df_tensor *t, int64_t heads, int64_t D)
{
    df_tensor r = *t;
    r.ndim = 3;
    r.shape[0] = t->shape[0];
    r.shape[1] = heads;
    r.shape[2] = D;
    r.stride[0] = t->stride[0];
    r.stride[1] = D;
    r.stride[2] = 1;
    return r;
}

#define CK(call)                                                               \
    do {                                                                       \
        int rc_ = (call);                                                      \
        if (rc_)                                                               \
            return op_failed(m, li, #call, rc_, e);                            \
    } while (0)

/* A layer's op failed: its error, and where the device ran out of memory,
 * how much is in use and what to pass instead. */
static int op_failed(df_model *m, int li, const char *call, int rc, df_err *e)
{
    if (rc != -ENOMEM)
        return df_errf(e, rc, "layer %d: %s failed: %s", li, call, df_strerror(rc));
    int64_t used = df_backend_mem_used(m->be);
    return df_errf(e, rc, "layer %d: %s: out of memory on %s for a batch of %lld tokens (%.1f GiB "
                   "in use): pass a smaller --batch-tokens (a batch holds at least its longest "
                   "document)", li, call, df_backend_name(m->be), (long long)m->cap,
                   used >= 0 ? (double)used / (1 << 30) : 0.0);
}

static int attention_block(df_model *m, int li, const int32_t *cu, int n_seq, int64_t T, df_err *e)
{
    const df_model_config *c = &m->cfg;
    const layer_w *L = &m->layers[li];
    df_backend *be = m->be;
    int64_t D = c->head_dim, nq = c->num_attention_heads, nkv = c->num_key_value_heads;
    int gated = c->arch == DF_ARCH_QWEN3_5 && c->attn_output_gate;
    int64_t qw = (gated ? 2 : 1) * nq * D; /* q (and gate) columns, then k, then v */
    df_tensor h = act(m, m->h, T, c->hidden_size);
    df_tensor all = act(m, m->big1, T, L->w_in.shape[0]);
    df_tensor o = act(m, m->mid, T, nq * D);
    CK(df_op_matmul(be, &h, &L->w_in, &all, 0));
    df_tensor q = df_tensor_cols(&all, 0, nq * D);
    df_tensor gate = gated ? df_tensor_cols(&all, nq * D, nq * D) : q;
    df_tensor k = df_tensor_cols(&all, qw, nkv * D), v = df_tensor_cols(&all, qw + nkv * D, nkv * D);
    /* Per-head norms, before RoPE, as one op over [T, heads, D] views of the
     * fused projection's columns. */
    df_tensor qh = heads_view(&q, nq, D), kh = heads_view(&k, nkv, D);
    CK(df_op_rmsnorm(be, &qh, &L->q_norm, (float)c->rms_norm_eps, m->plus_one, &qh));
    CK(df_op_rmsnorm(be, &kh, &L->k_norm, (float)c->rms_norm_eps, m->plus_one, &kh));
    CK(df_op_rope(be, &q, m->pos, (int)nq, (int)D, c->rotary_dim, c->rope_theta));
    CK(df_op_rope(be, &k, m->pos, (int)nkv, (int)D, c->rotary_dim, c->rope_theta));
    CK(df_op_attention(be, &q, &k, &v, cu, n_seq, (int)nq, (int)nkv, (int)D,
                       (float)(1.0 / sqrt((double)D)), gated ? &gate : NULL, &o));
    df_tensor x = act(m, m->x, T, c->hidden_size);
    CK(df_op_matmul(be, &o, &L->wo, &x, 1));
    return 0;
}

static int gdn_block(df_model *m, int li, const int32_t *cu, int n_seq, int64_t T, df_err *e)
{
    const df_model_config *c = &m->cfg;
    const layer_w *L = &m->layers[li];
    df_backend *be = m->be;
    int64_t hk = c->linear_num_key_heads, hv = c->linear_num_value_heads,
            dk = c->linear_key_head_dim, dv = c->linear_value_head_dim;
    int64_t C = 2 * hk * dk + hv * dv, VD = hv * dv;
    df_tensor h = act(m, m->h, T, c->hidden_size);
    df_tensor all = act(m, m->big1, T, L->w_in.shape[0]), conv = act(m, m->big2, T, C);
    df_tensor o = act(m, m->mid, T, VD);
    df_tensor g = df_tensor_2d(m->gb, DF_DTYPE_F32, T, hv);
    df_tensor beta = df_tensor_2d((float *)m->gb + T * hv, DF_DTYPE_F32, T, hv);
    CK(df_op_matmul(be, &h, &L->w_in, &all, 0));
    df_tensor qkv = df_tensor_cols(&all, 0, C), z = df_tensor_cols(&all, C, VD);
    df_tensor b = df_tensor_cols(&all, C + VD, hv), a = df_tensor_cols(&all, C + VD + hv, hv);
    CK(df_op_conv1d_silu(be, &qkv, &L->conv, cu, n_seq, &conv));
    CK(df_op_gdn_gates(be, &a, &b, &L->A_log, &L->dt_bias, &g, &beta));
    df_tensor q = df_tensor_cols(&conv, 0, hk * dk), k = df_tensor_cols(&conv, hk * dk, hk * dk);
    df_tensor v = df_tensor_cols(&conv, 2 * hk * dk, VD);
    df_tensor qh = heads_view(&q, hk, dk), kh = heads_view(&k, hk, dk);
    CK(df_op_l2norm(be, &qh, 1e-6f, (float)(1.0 / sqrt((double)dk))));
    CK(df_op_l2norm(be, &kh, 1e-6f, 1.0f));
    CK(df_op_gdn(be, &q, &k, &v, &g, &beta, cu, n_seq, (int)hk, (int)hv, (int)dk, (int)dv,
                 DF_GDN_CHUNKED, &o));
    df_tensor oh = heads_view(&o, hv, dv), zh = heads_view(&z, hv, dv);
    CK(df_op_rmsnorm_gated(be, &oh, &zh, &L->gnorm, (float)c->rms_norm_eps, &oh));
    df_tensor x = act(m, m->x, T, c->hidden_size);
    CK(df_op_matmul(be, &o, &L->out, &x, 1));
    return 0;
}

static int mlp_block(df_model *m, int li, int64_t T, df_err *e)
{
    const df_model_config *c = &m->cfg;
    const layer_w *L = &m->layers[li];
    df_backend *be = m->be;
    int64_t F = c->intermediate_size;
    df_tensor x = act(m, m->x, T, c->hidden_size), h = act(m, m->h, T, c->hidden_size);
    df_tensor gu = act(m, m->big1, T, L->gate_up.shape[0]); /* 2F (+ device padding) */
    CK(df_op_rmsnorm(be, &x, &L->post_norm, (float)c->rms_norm_eps, m->plus_one, &h));
    CK(df_op_matmul(be, &h, &L->gate_up, &gu, 0));
    df_tensor gate = df_tensor_cols(&gu, 0, F), up = df_tensor_cols(&gu, F, F);
    CK(df_op_swiglu(be, &gate, &up, &gate));
    CK(df_op_matmul(be, &gate, &L->down, &x, 1));
    return 0;
}


/* Writes rows of src ([T, H] activations, backend memory) to host dst as
 * dt. Same dtype: one download. BF16 -> F32: download into the first half
 * of dst, widen in place from the end. F32 -> BF16 (CPU: src is host
 * memory): narrow while copying. */
static int store(df_model *m, const void *src, int64_t T, df_dtype dt, void *dst, df_err *e)
{
    size_t n = (size_t)(T * m->cfg.hidden_size);
    if (dt != DF_DTYPE_BF16 && dt != DF_DTYPE_F32)
        return df_errf(e, -EINVAL, "hidden states can be stored as BF16 or F32, not %s",
                       df_dtype_name(dt));
    int rc = 0;
    if (dt == m->adt) { /* done by the sync that ends the forward */
        rc = df_backend_download_async(m->be, dst, src, n * m->aes);
    } else if (dt == DF_DTYPE_F32) { /* adt BF16 */
        rc = df_backend_download(m->be, dst, src, n * 2);
        const uint16_t *h = dst;
        float *f = dst;
        for (size_t i = n; i-- > 0;)
            f[i] = df_bf16_to_f32(h[i]);
    } else { /* adt F32 on a host backend */
        const float *f = src;
        uint16_t *o = dst;
        for (size_t i = 0; i < n; i++)
            o[i] = df_f32_to_bf16(f[i]);
    }
    return rc ? df_errf(e, rc, "copying hidden states from %s failed", df_backend_name(m->be)) : 0;
}

int df_model_set_projection(df_model *m, const float *P, int R, int D, df_err *e)
{
    const df_model_config *c = &m->cfg;
    if (m->adt != DF_DTYPE_BF16)
        return df_errf(e, -ENOTSUP, "projection in the forward needs a BF16 backend (CUDA); "
                       "%s projects on the host", df_backend_name(m->be));
    if (R < 1 || D < c->hidden_size || D % c->hidden_size || D / c->hidden_size > 64)
        return df_errf(e, -EINVAL, "a basis of %d x %d does not fit a target of hidden size %d",
                       R, D, c->hidden_size);
    if (m->proj_R)
        return df_errf(e, -EBUSY, "the model already projects");
    size_t n = (size_t)R * 2 * (size_t)D;
    uint16_t *w = malloc(n * sizeof *w);
    if (!w)
        return df_errf(e, -ENOMEM, "out of memory for a basis of %d x %d", R, D);
    for (size_t r = 0; r < (size_t)R; r++)
        for (size_t i = 0; i < (size_t)D; i++) {
            float v = P[r * D + i];
            uint16_t hi = df_f32_to_bf16(v);
            w[r * 2 * D + i] = hi;
            w[r * 2 * D + D + i] = df_f32_to_bf16(v - df_bf16_to_f32(hi));
        }
    void *d = df_backend_alloc(m->be, n * 2);
    int rc = d ? own(m, d, e) : df_errf(e, -ENOMEM, "out of device memory for the basis");
    if (!rc && (rc = df_backend_upload(m->be, d, w, n * 2)))
        df_errf(e, rc, "uploading the basis to %s failed", df_backend_name(m->be));
    free(w);
    if (rc)
        return rc;
    m->pw = df_tensor_2d(d, DF_DTYPE_BF16, R, 2 * (int64_t)D);
    m->proj_R = R;
    m->proj_D = D;
    return 0;
}

static int reserve_proj(df_model *m, int64_t T, df_err *e)
{
    if (T <= m->pcap)
        return 0;
    df_backend_free(m->be, m->xx);
    df_backend_free(m->be, m->z);
    m->xx = df_backend_alloc(m->be, (size_t)T * 2 * (size_t)m->proj_D * 2);
    m->z = df_backend_alloc(m->be, (size_t)T * (size_t)m->proj_R * 2);
    m->pcap = m->xx && m->z ? T : 0;
    return m->pcap ? 0 : df_errf(e, -ENOMEM, "out of device memory projecting %lld tokens",
                                 (long long)T);
}

/* Feature layer j's [T, H] rows into columns j H and D + j H of xx (zeroed
 * first: the add is an exact copy). */
static int gather(df_model *m, const void *src, int64_t T, int j, df_err *e)
{
    int64_t H = m->cfg.hidden_size, D = m->proj_D;
    df_tensor x = act(m, (void *)src, T, H), xx = act(m, m->xx, T, 2 * D);
    for (int half = 0; half < 2; half++) {
        df_tensor y = df_tensor_cols(&xx, half * D + (int64_t)j * H, H);
        int rc = df_op_add(m->be, &x, &y);
        if (rc)
            return df_errf(e, rc, "projection: gathering feature %d failed: %s", j,
                           df_strerror(rc));
    }
    return 0;
}

static int forward(df_model *m, const uint32_t *ids, const int32_t *cu, int n_seq, int64_t T,
                   const int *hs_index, int n_out, df_dtype out_dtype, void *const *out,
                   int project, df_err *e)
{
    const df_model_config *c = &m->cfg;
    int L = c->num_hidden_layers, last = -1;
    for (int j = 0; j < n_out; j++) {
        if (hs_index[j] < 0 || hs_index[j] > L)
            return df_errf(e, -EINVAL, "hidden-state index %d out of range 0..%d", hs_index[j], L);
        if (hs_index[j] > last)
            last = hs_index[j];
    }
    if (n_seq < 1 || cu[0] != 0 || cu[n_seq] != T)
        return df_errf(e, -EINVAL, "cu_seqlens must run from 0 to %lld", (long long)T);
    int rc = reserve(m, T, e);
    if (rc)
        return rc;
    if (project) {
        if ((int64_t)n_out * m->cfg.hidden_size != m->proj_D)
            return df_errf(e, -EINVAL, "%d feature layers of %d; the basis takes %d values", n_out,
                           m->cfg.hidden_size, m->proj_D);
        if ((rc = reserve_proj(m, T, e)))
            return rc;
        if ((rc = df_backend_zero(m->be, m->xx, (size_t)T * 2 * (size_t)m->proj_D * 2)))
            return df_errf(e, rc, "%s backend failed", df_backend_name(m->be));
    }
    for (int s = 0; s < n_seq; s++) {
        if (cu[s + 1] < cu[s])
            return df_errf(e, -EINVAL, "cu_seqlens not increasing at %d", s);
        for (int32_t t = cu[s]; t < cu[s + 1]; t++)
            m->pos[t] = t - cu[s];
    }
    for (int64_t t = 0; t < T; t++)
        if (ids[t] >= (uint64_t)c->vocab_size)
            return df_errf(e, -EINVAL, "token %lld: id %u >= vocab size %lld", (long long)t, ids[t],
                           (long long)c->vocab_size);
    df_backend *be = m->be;
    df_tensor x = act(m, m->x, T, c->hidden_size), h = act(m, m->h, T, c->hidden_size);
    int li = -1;
    CK(df_op_embed(be, &m->embed, ids, T, &x));
    for (int idx = 0; idx <= last; idx++) {
        if (idx > 0) {
            li = idx - 1;
            const layer_w *lw = &m->layers[li];
            CK(df_op_rmsnorm(be, &x, &lw->in_norm, (float)c->rms_norm_eps, m->plus_one, &h));
            rc = lw->type == DF_LAYER_LINEAR ? gdn_block(m, li, cu, n_seq, T, e)
                                             : attention_block(m, li, cu, n_seq, T, e);
            if (!rc)
                rc = mlp_block(m, li, T, e);
            if (rc)
                return rc;
        }
        const void *src = m->x;
        if (idx == L) { /* HF's last hidden state is the final-normed one */
            CK(df_op_rmsnorm(be, &x, &m->final_norm, (float)c->rms_norm_eps, m->plus_one, &h));
            src = m->h;
        }
        for (int j = 0; j < n_out; j++)
            if (hs_index[j] == idx &&
                (rc = project ? gather(m, src, T, j, e) : store(m, src, T, out_dtype, out[j], e)))
                return rc;
    }
    if (project) {
        df_tensor xx = act(m, m->xx, T, 2 * (int64_t)m->proj_D), z = act(m, m->z, T, m->proj_R);
        if ((rc = df_op_matmul(be, &xx, &m->pw, &z, 0)))
            return df_errf(e, rc, "projection: z = P x failed: %s", df_strerror(rc));
        if ((rc = df_backend_download_async(be, out[0], m->z, (size_t)T * (size_t)m->proj_R * 2)))
            return df_errf(e, rc, "copying z from %s failed", df_backend_name(be));
    }
    return df_backend_sync(be);
}

int df_model_forward(df_model *m, const uint32_t *ids, const int32_t *cu, int n_seq, int64_t T,
                     const int *hs_index, int n_out, df_dtype out_dtype, void *const *out,
                     df_err *e)
{
    return forward(m, ids, cu, n_seq, T, hs_index, n_out, out_dtype, out, 0, e);
}

int df_model_forward_projected(df_model *m, const uint32_t *ids, const int32_t *cu, int n_seq,
                               int64_t T, const int *hs_index, int n_out, uint16_t *z, df_err *e)
{
    if (!m->proj_R)
        return df_errf(e, -EINVAL, "no projection set (df_model_set_projection)");
    void *out[1] = {z};
    return forward(m, ids, cu, n_seq, T, hs_index, n_out, DF_DTYPE_BF16, out, 1, e);
}
