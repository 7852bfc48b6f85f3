#include "hfconfig.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "fsutil.h"

#define CONFIG_MAX_BYTES (16u << 20)

/* Where keys are looked up: the text part first (text_config for a
 * multimodal qwen3_5), then the top level. Messages name the key with the
 * path it was (or should have been) found at. */
typedef struct jctx {
    const char *name;    /* file name for messages */
    const cJSON *text;   /* text_config or the root */
    const cJSON *root;
    const char *prefix;  /* "text_config." or "" */
    df_err *e;
} jctx;

static const char *json_type(const cJSON *j)
{
    if (cJSON_IsNull(j)) return "null";
    if (cJSON_IsBool(j)) return "a boolean";
    if (cJSON_IsNumber(j)) return "a number";
    if (cJSON_IsString(j)) return "a string";
    if (cJSON_IsArray(j)) return "an array";
    if (cJSON_IsObject(j)) return "an object";
    return "invalid";
}

/* Looks up key in the text part, then the root. *where gets the prefix to
 * print. Returns NULL when absent (a JSON null counts as absent). */
static const cJSON *find(const jctx *c, const char *key, const char **where)
{
    const cJSON *j = cJSON_GetObjectItemCaseSensitive(c->text, key);
    *where = c->prefix;
    if ((!j || cJSON_IsNull(j)) && c->text != c->root) {
        j = cJSON_GetObjectItemCaseSensitive(c->root, key);
        *where = "";
    }
    if (j && cJSON_IsNull(j))
        j = NULL;
    if (!j)
        *where = c->prefix;
    return j;
}

/* Integer key in [lo, hi]. Returns 1 if found, 0 if absent and not
 * required (out untouched), negative on error. */
static int get_int(const jctx *c, const char *key, int required, int64_t lo, int64_t hi,
                   int64_t *out)
{
    const char *w;
    const cJSON *j = find(c, key, &w);
    if (!j) {
        if (!required)
            return 0;
        return df_errf(c->e, -EINVAL, "%s: missing required key '%s%s'", c->name, w, key);
    }
    if (!cJSON_IsNumber(j))
        return df_errf(c->e, -EINVAL, "%s: %s%s: expected an integer, got %s", c->name, w, key,
                       json_type(j));
    double d = j->valuedouble;
    if (!(d >= (double)lo && d <= (double)hi))
        return df_errf(c->e, -EINVAL, "%s: %s%s: %.15g is out of range [%lld, %lld]", c->name, w, key,
                       d, (long long)lo, (long long)hi);
    if (d != floor(d))
        return df_errf(c->e, -EINVAL, "%s: %s%s: expected an integer, got %.15g", c->name, w, key, d);
    *out = (int64_t)d;
    return 1;
}

static int get_i32(const jctx *c, const char *key, int required, int lo, int hi, int *out)
{
    int64_t v = 0;
    int rc = get_int(c, key, required, lo, hi, &v);
    if (rc == 1)
        *out = (int)v;
    return rc;
}

/* Number key; lo_open: value must be > lo (else >= lo). */
static int get_num(const jctx *c, const char *key, int required, double lo, int lo_open, double hi,
                   double *out)
{
    const char *w;
    const cJSON *j = find(c, key, &w);
    if (!j) {
        if (!required)
            return 0;
        return df_errf(c->e, -EINVAL, "%s: missing required key '%s%s'", c->name, w, key);
    }
    if (!cJSON_IsNumber(j))
        return df_errf(c->e, -EINVAL, "%s: %s%s: expected a number, got %s", c->name, w, key,
                       json_type(j));
    double d = j->valuedouble;
    if (!(lo_open ? d > lo : d >= lo) || !(d <= hi))
        return df_errf(c->e, -EINVAL, "%s: %s%s: %g is out of range %c%g, %g]", c->name, w, key, d,
                       lo_open ? '(' : '[', lo, hi);
    *out = d;
    return 1;
}

static int get_bool(const jctx *c, const char *key, bool *out)
{
    const char *w;
    const cJSON *j = find(c, key, &w);
    if (!j)
        return 0;
    if (!cJSON_IsBool(j))
        return df_errf(c->e, -EINVAL, "%s: %s%s: expected true or false, got %s", c->name, w, key,
                       json_type(j));
    *out = cJSON_IsTrue(j);
    return 1;
}

const char *df_layer_type_name(df_layer_type t)
{
    switch (t) {
    case DF_LAYER_FULL: return "full_attention";
    case DF_LAYER_LINEAR: return "linear_attention";
    case DF_LAYER_SLIDING: return "sliding_attention";
    default: return "invalid";
    }
}

/* layer_types: an explicit array (values limited to the allowed mask:
 * bit t = df_layer_type t), or derived by the caller when absent (returns 0). */
static int get_layer_types(const jctx *c, int nlayers, unsigned allowed, const char *arch,
                           uint8_t *types)
{
    const char *w;
    const cJSON *j = find(c, "layer_types", &w);
    if (!j)
        return 0;
    if (!cJSON_IsArray(j))
        return df_errf(c->e, -EINVAL, "%s: %slayer_types: expected an array, got %s", c->name, w,
                       json_type(j));
    int n = cJSON_GetArraySize(j);
    if (n != nlayers)
        return df_errf(c->e, -EINVAL, "%s: %slayer_types has %d entries, num_hidden_layers is %d",
                       c->name, w, n, nlayers);
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, j)
    {
        int t = -1;
        if (cJSON_IsString(it)) {
            for (int k = 0; k < 3; k++)
                if (!strcmp(it->valuestring, df_layer_type_name((df_layer_type)k)))
                    t = k;
        }
        if (t < 0)
            return df_errf(c->e, -EINVAL,
                           "%s: %slayer_types[%d]: expected \"full_attention\", "
                           "\"linear_attention\" or \"sliding_attention\"",
                           c->name, w, i);
        if (!(allowed & (1u << t)))
            return df_errf(c->e, -EINVAL, "%s: %slayer_types[%d]: '%s' is not supported for %s",
                           c->name, w, i, df_layer_type_name((df_layer_type)t), arch);
        types[i++] = (uint8_t)t;
    }
    return 1;
}

/* Rejects RoPE scaling we do not implement (it would change the numbers).
 * Reads rope_theta / partial_rotary_factor from the object when present. */
static int check_rope_obj(const jctx *c, const char *key, double *theta, int *have_theta,
                          double *prf, int *have_prf)
{
    const char *w;
    const cJSON *j = find(c, key, &w);
    if (!j)
        return 0;
    if (!cJSON_IsObject(j))
        return df_errf(c->e, -EINVAL, "%s: %s%s: expected an object or null, got %s", c->name, w,
                       key, json_type(j));
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(j, "rope_type");
    if (!t)
        t = cJSON_GetObjectItemCaseSensitive(j, "type");
    if (t && !cJSON_IsNull(t)) {
        if (!cJSON_IsString(t))
            return df_errf(c->e, -EINVAL, "%s: %s%s.rope_type: expected a string", c->name, w, key);
        if (strcmp(t->valuestring, "default"))
            return df_errf(c->e, -ENOTSUP,
                           "%s: %s%s.rope_type '%.40s' is not supported (only \"default\")",
                           c->name, w, key, t->valuestring);
    }
    jctx sub = *c;
    sub.text = sub.root = j;
    sub.prefix = "";
    char nm[600];
    snprintf(nm, sizeof nm, "%s: %s%s", c->name, w, key);
    sub.name = nm;
    int rc;
    if (theta && !*have_theta &&
        (rc = get_num(&sub, "rope_theta", 0, 0, 1, 1e15, theta)) != 0) {
        if (rc < 0)
            return rc;
        *have_theta = 1;
    }
    if (prf && !*have_prf &&
        (rc = get_num(&sub, "partial_rotary_factor", 0, 0, 1, 1, prf)) != 0) {
        if (rc < 0)
            return rc;
        *have_prf = 1;
    }
    return 1;
}

#define TRY(x)              \
    do {                    \
        int rc_ = (x);      \
        if (rc_ < 0)        \
            return rc_;     \
    } while (0)

/* The attention shape keys shared by target and drafter configs. */
typedef struct attn_shape {
    int hidden, layers, inter, heads, kv, head_dim;
    int64_t vocab;
    double eps;
} attn_shape;

static int get_attn_shape(const jctx *c, int max_layers, attn_shape *s)
{
    TRY(get_i32(c, "hidden_size", 1, 1, 1 << 20, &s->hidden));
    TRY(get_i32(c, "num_hidden_layers", 1, 1, max_layers, &s->layers));
    TRY(get_int(c, "vocab_size", 1, 1, INT32_MAX, &s->vocab));
    TRY(get_i32(c, "intermediate_size", 1, 1, 1 << 24, &s->inter));
    TRY(get_i32(c, "num_attention_heads", 1, 1, 4096, &s->heads));
    s->kv = s->heads; /* transformers' meaning of an absent key: no GQA */
    TRY(get_i32(c, "num_key_value_heads", 0, 1, 4096, &s->kv));
    if (s->heads % s->kv)
        return df_errf(c->e, -EINVAL,
                       "%s: %snum_key_value_heads: %d does not divide num_attention_heads %d",
                       c->name, c->prefix, s->kv, s->heads);
    TRY(get_i32(c, "head_dim", 1, 2, 4096, &s->head_dim));
    if (s->head_dim % 2)
        return df_errf(c->e, -EINVAL, "%s: %shead_dim: %d is odd (RoPE rotates pairs)", c->name,
                       c->prefix, s->head_dim);
    TRY(get_num(c, "rms_norm_eps", 1, 0, 1, 0.1, &s->eps));
    return 0;
}

/* transformers' Qwen3 rule when layer_types is absent: sliding from layer
 * max_window_layers on, only with use_sliding_window (without it transformers
 * drops sliding_window altogether). */
static int derive_qwen3_layers(const jctx *c, int nlayers, bool use_sw, int sliding_window,
                               uint8_t *types)
{
    int mwl = nlayers;
    if (use_sw)
        TRY(get_i32(c, "max_window_layers", 1, 0, DF_MAX_LAYERS, &mwl));
    for (int i = 0; i < nlayers; i++)
        types[i] = (use_sw && sliding_window > 0 && i >= mwl) ? DF_LAYER_SLIDING : DF_LAYER_FULL;
    return 0;
}

/* Sliding layers need a window, and transformers' Qwen3Config keeps the
 * window only with use_sliding_window: true (else its mask builder fails). */
static int check_sliding(const jctx *c, const uint8_t *types, int n, bool use_sw, int window)
{
    if (use_sw && window <= 0)
        return df_errf(c->e, -EINVAL, "%s: %suse_sliding_window is true but 'sliding_window' is not set",
                       c->name, c->prefix);
    for (int i = 0; i < n; i++)
        if (types[i] == DF_LAYER_SLIDING) {
            if (!use_sw)
                return df_errf(c->e, -EINVAL,
                               "%s: %slayer_types[%d] is sliding_attention but "
                               "use_sliding_window is not true",
                               c->name, c->prefix, i);
            break;
        }
    return 0;
}

static int get_sliding_window(const jctx *c, int *out)
{
    *out = 0; /* null / absent: no window */
    return get_i32(c, "sliding_window", 0, 1, INT32_MAX, out);
}

static int any_layer(const uint8_t *types, int n, int t)
{
    for (int i = 0; i < n; i++)
        if (types[i] == t)
            return 1;
    return 0;
}

static int parse_root(const char *json, size_t len, const char *name, cJSON **root, df_err *e)
{
    const char *end = NULL;
    *root = cJSON_ParseWithLengthOpts(json, len, &end, 0);
    if (!*root) {
        size_t at = end && end >= json && end <= json + len ? (size_t)(end - json) : 0;
        return df_errf(e, -DF_ECORRUPT, "%s: not valid JSON (near byte %zu)", name, at);
    }
    for (const char *p = end; p < json + len; p++)
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r' && *p != 0) {
            cJSON_Delete(*root);
            *root = NULL;
            return df_errf(e, -DF_ECORRUPT, "%s: trailing garbage after the JSON at byte %zu",
                           name, (size_t)(p - json));
        }
    if (!cJSON_IsObject(*root)) {
        cJSON_Delete(*root);
        *root = NULL;
        return df_errf(e, -EINVAL, "%s: top level is not a JSON object", name);
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* target model config                                                  */

static int model_fill(const jctx *c, df_model_config *m)
{
    attn_shape s;
    TRY(get_attn_shape(c, DF_MAX_LAYERS, &s));
    m->hidden_size = s.hidden;
    m->num_hidden_layers = s.layers;
    m->vocab_size = s.vocab;
    m->intermediate_size = s.inter;
    m->num_attention_heads = s.heads;
    m->num_key_value_heads = s.kv;
    m->head_dim = s.head_dim;
    m->rms_norm_eps = s.eps;

    int have_theta = 0, have_prf = 0;
    double theta = 0, prf = 0;
    TRY(check_rope_obj(c, "rope_parameters", &theta, &have_theta, &prf, &have_prf));
    if (!have_theta) {
        int rc = get_num(c, "rope_theta", 0, 0, 1, 1e15, &theta);
        TRY(rc);
        have_theta = rc;
    }
    if (!have_prf) {
        int rc = get_num(c, "partial_rotary_factor", 0, 0, 1, 1, &prf);
        TRY(rc);
        have_prf = rc;
    }
    TRY(check_rope_obj(c, "rope_scaling", &theta, &have_theta, NULL, NULL));
    if (!have_theta)
        return df_errf(c->e, -EINVAL,
                       "%s: missing required key '%srope_parameters.rope_theta' (or '%srope_theta')",
                       c->name, c->prefix, c->prefix);
    m->rope_theta = theta;
    const bool q35 = m->arch == DF_ARCH_QWEN3_5;
    /* transformers' defaults: Qwen3 rotates all dims, Qwen3.5 a quarter. */
    m->partial_rotary_factor = have_prf ? prf : (q35 ? 0.25 : 1.0);
    m->rotary_dim = (int)(m->head_dim * m->partial_rotary_factor); /* int() as in transformers */
    if (m->rotary_dim < 2 || m->rotary_dim % 2)
        return df_errf(c->e, -EINVAL,
                       "%s: %spartial_rotary_factor %g gives %d rotary dims of head_dim %d; "
                       "need an even number >= 2",
                       c->name, c->prefix, m->partial_rotary_factor, m->rotary_dim, m->head_dim);

    m->tie_word_embeddings = false;
    TRY(get_bool(c, "tie_word_embeddings", &m->tie_word_embeddings));
    m->attn_output_gate = q35;
    TRY(get_bool(c, "attn_output_gate", &m->attn_output_gate));
    TRY(get_int(c, "max_position_embeddings", 0, 1, (int64_t)1 << 40, &m->max_position_embeddings));
    TRY(get_sliding_window(c, &m->sliding_window));

    const char *w;
    const cJSON *dt = find(c, "dtype", &w);
    if (!dt)
        dt = find(c, "torch_dtype", &w);
    if (dt && cJSON_IsString(dt)) {
        snprintf(m->torch_dtype, sizeof m->torch_dtype, "%.15s", dt->valuestring);
        if (!strcmp(m->torch_dtype, "bfloat16"))
            m->dtype = DF_DTYPE_BF16;
        else if (!strcmp(m->torch_dtype, "float16"))
            m->dtype = DF_DTYPE_F16;
        else if (!strcmp(m->torch_dtype, "float32"))
            m->dtype = DF_DTYPE_F32;
    }

    unsigned allowed = q35 ? (1u << DF_LAYER_FULL) | (1u << DF_LAYER_LINEAR)
                           : (1u << DF_LAYER_FULL) | (1u << DF_LAYER_SLIDING);
    bool use_sw = false;
    TRY(get_bool(c, "use_sliding_window", &use_sw));
    TRY(get_i32(c, "full_attention_interval", 0, 1, DF_MAX_LAYERS, &m->full_attention_interval));
    int rc = get_layer_types(c, m->num_hidden_layers, allowed, q35 ? "qwen3_5" : "qwen3",
                             m->layer_types);
    TRY(rc);
    if (rc == 0) {
        if (q35) {
            if (!m->full_attention_interval)
                return df_errf(c->e, -EINVAL,
                               "%s: %s: neither 'layer_types' nor 'full_attention_interval' given",
                               c->name, c->prefix[0] ? "text_config" : "config");
            for (int i = 0; i < m->num_hidden_layers; i++)
                m->layer_types[i] = (i + 1) % m->full_attention_interval ? DF_LAYER_LINEAR
                                                                         : DF_LAYER_FULL;
        } else {
            TRY(derive_qwen3_layers(c, m->num_hidden_layers, use_sw, m->sliding_window,
                                    m->layer_types));
        }
    }
    if (!q35) {
        TRY(check_sliding(c, m->layer_types, m->num_hidden_layers, use_sw, m->sliding_window));
        if (!use_sw)
            m->sliding_window = 0; /* as transformers: the window only counts when used */
    }

    if (q35 && any_layer(m->layer_types, m->num_hidden_layers, DF_LAYER_LINEAR)) {
        TRY(get_i32(c, "linear_num_key_heads", 1, 1, 4096, &m->linear_num_key_heads));
        TRY(get_i32(c, "linear_num_value_heads", 1, 1, 4096, &m->linear_num_value_heads));
        TRY(get_i32(c, "linear_key_head_dim", 1, 1, 4096, &m->linear_key_head_dim));
        TRY(get_i32(c, "linear_value_head_dim", 1, 1, 4096, &m->linear_value_head_dim));
        TRY(get_i32(c, "linear_conv_kernel_dim", 1, 1, 64, &m->linear_conv_kernel_dim));
        if (m->linear_num_value_heads % m->linear_num_key_heads)
            return df_errf(c->e, -EINVAL,
                           "%s: %slinear_num_key_heads: %d does not divide linear_num_value_heads %d",
                           c->name, c->prefix, m->linear_num_key_heads, m->linear_num_value_heads);
    }
    return 0;
}

int df_model_config_parse(const char *json, size_t len, const char *name, df_model_config *out,
                          df_err *e)
{
    memset(out, 0, sizeof *out);
    if (!name)
        name = "config.json";
    cJSON *root;
    int rc = parse_root(json, len, name, &root, e);
    if (rc < 0)
        return rc;
    jctx c = {.name = name, .text = root, .root = root, .prefix = "", .e = e};
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    if (!cJSON_IsString(mt)) {
        rc = df_errf(e, -EINVAL, "%s: missing required key 'model_type' (a string)", name);
        goto out;
    }
    snprintf(out->model_type, sizeof out->model_type, "%.31s", mt->valuestring);
    if (!strcmp(mt->valuestring, "qwen3")) {
        out->arch = DF_ARCH_QWEN3;
    } else if (!strcmp(mt->valuestring, "qwen3_5") || !strcmp(mt->valuestring, "qwen3_5_text")) {
        out->arch = DF_ARCH_QWEN3_5;
        const cJSON *tc = cJSON_GetObjectItemCaseSensitive(root, "text_config");
        if (tc && !cJSON_IsNull(tc)) {
            if (!cJSON_IsObject(tc)) {
                rc = df_errf(e, -EINVAL, "%s: text_config: expected an object, got %s", name,
                             json_type(tc));
                goto out;
            }
            const cJSON *tmt = cJSON_GetObjectItemCaseSensitive(tc, "model_type");
            if (tmt && (!cJSON_IsString(tmt) || strcmp(tmt->valuestring, "qwen3_5_text"))) {
                rc = df_errf(e, -ENOTSUP,
                             "%s: text_config.model_type '%.40s' is not supported; expected "
                             "qwen3_5_text",
                             name, cJSON_IsString(tmt) ? tmt->valuestring : json_type(tmt));
                goto out;
            }
            c.text = tc;
            c.prefix = "text_config.";
            out->has_text_config = true;
        }
    } else {
        rc = df_errf(e, -ENOTSUP, "%s: model_type '%.40s' is not supported; supported: qwen3, qwen3_5",
                     name, mt->valuestring);
        goto out;
    }
    rc = model_fill(&c, out);
    if (rc >= 0)
        df_sha256_hex_of(json, len, out->config_sha256);
out:
    cJSON_Delete(root);
    if (rc < 0) {
        memset(out, 0, sizeof *out);
        return rc;
    }
    return 0;
}

/* DIR -> DIR/config.json; a file stays as is. */
static int config_path(const char *p, char *out, size_t n, df_err *e)
{
    struct stat sb;
    if (stat(p, &sb) != 0)
        return df_errf(e, -errno, "%s: %s", p, strerror(errno));
    if (S_ISDIR(sb.st_mode)) {
        if (df_path_join(out, n, p, "config.json") < 0)
            return df_errf(e, -ENAMETOOLONG, "%s: path too long", p);
    } else if (snprintf(out, n, "%s", p) >= (int)n) {
        return df_errf(e, -ENAMETOOLONG, "%s: path too long", p);
    }
    return 0;
}

int df_model_config_load(const char *path, df_model_config *out, df_err *e)
{
    memset(out, 0, sizeof *out);
    char p[4096];
    int rc = config_path(path, p, sizeof p, e);
    if (rc < 0)
        return rc;
    char *txt;
    size_t len;
    if ((rc = df_file_read_all(p, CONFIG_MAX_BYTES, &txt, &len, e)) < 0)
        return rc;
    rc = df_model_config_parse(txt, len, p, out, e);
    free(txt);
    return rc;
}

/* ------------------------------------------------------------------ */
/* target layer ids                                                     */

int df_default_target_layers(int t, int k, int *ids)
{
    if (k < 1 || k > DF_MAX_TARGET_FEATURES || t < 1)
        return -EINVAL;
    if (k == 1) {
        ids[0] = t / 2;
        return 0;
    }
    const int start = 1, end = t - 3, span = end - start;
    for (int i = 0; i < k; i++) {
        /* Same double arithmetic as the reference's Python, and its round():
         * nearest, ties to even (rint in the default rounding mode). */
        double v = (double)start + (double)(i * span) / (double)(k - 1);
        double r = floor(v), f = v - r;
        if (f > 0.5 || (f == 0.5 && fmod(r, 2.0) != 0))
            r += 1;
        ids[i] = (int)r;
        if (ids[i] < 0 || ids[i] >= t || (i && ids[i] <= ids[i - 1]))
            return -EINVAL;
    }
    return 0;
}

/* ------------------------------------------------------------------ */
/* drafter config                                                       */

int df_drafter_config_validate(const df_drafter_config *d, const char *name, df_err *e)
{
    if (!name)
        name = "drafter config";
#define BAD(...) return df_errf(e, -EINVAL, __VA_ARGS__)
    if (d->block_size < 2 || d->block_size > 1024)
        BAD("%s: block_size: %d is out of range [2, 1024]", name, d->block_size);
    if (d->num_target_layers < 1 || d->num_target_layers > DF_MAX_LAYERS)
        BAD("%s: num_target_layers: %d is out of range [1, %d]", name, d->num_target_layers,
            DF_MAX_LAYERS);
    if (d->num_target_features < 1 || d->num_target_features > DF_MAX_TARGET_FEATURES)
        BAD("%s: dflash_config.target_layer_ids: %d entries, need 1..%d", name,
            d->num_target_features, DF_MAX_TARGET_FEATURES);
    for (int i = 0; i < d->num_target_features; i++) {
        if (d->target_layer_ids[i] < 0 || d->target_layer_ids[i] >= d->num_target_layers)
            BAD("%s: dflash_config.target_layer_ids[%d]: %d is outside the target's %d layers", name,
                i, d->target_layer_ids[i], d->num_target_layers);
        for (int k = 0; k < i; k++)
            if (d->target_layer_ids[k] == d->target_layer_ids[i])
                BAD("%s: dflash_config.target_layer_ids: %d appears twice", name,
                    d->target_layer_ids[i]);
    }
    if (d->num_hidden_layers < 1 || d->num_hidden_layers > DF_MAX_LAYERS)
        BAD("%s: num_hidden_layers: %d is out of range [1, %d]", name, d->num_hidden_layers,
            DF_MAX_LAYERS);
    if (d->hidden_size < 1 || d->hidden_size > (1 << 20))
        BAD("%s: hidden_size: %d is out of range", name, d->hidden_size);
    if (d->intermediate_size < 1 || d->intermediate_size > (1 << 24))
        BAD("%s: intermediate_size: %d is out of range", name, d->intermediate_size);
    if (d->num_attention_heads < 1 || d->num_attention_heads > 4096)
        BAD("%s: num_attention_heads: %d is out of range", name, d->num_attention_heads);
    if (d->num_key_value_heads < 1 || d->num_attention_heads % d->num_key_value_heads)
        BAD("%s: num_key_value_heads: %d does not divide num_attention_heads %d", name,
            d->num_key_value_heads, d->num_attention_heads);
    if (d->head_dim < 2 || d->head_dim > 4096 || d->head_dim % 2)
        BAD("%s: head_dim: %d must be even and in [2, 4096]", name, d->head_dim);
    if (!(d->rms_norm_eps > 0 && d->rms_norm_eps <= 0.1))
        BAD("%s: rms_norm_eps: %g is out of range (0, 0.1]", name, d->rms_norm_eps);
    if (!(d->rope_theta > 0 && d->rope_theta <= 1e15))
        BAD("%s: rope_theta: %g is out of range (0, 1e15]", name, d->rope_theta);
    if (d->vocab_size < 1 || d->vocab_size > INT32_MAX)
        BAD("%s: vocab_size: %lld is out of range", name, (long long)d->vocab_size);
    if (d->mask_token_id < 0 || d->mask_token_id >= d->vocab_size)
        BAD("%s: dflash_config.mask_token_id: %lld is outside the vocabulary (%lld)", name,
            (long long)d->mask_token_id, (long long)d->vocab_size);
    if (d->max_position_embeddings < 1 || d->max_position_embeddings > ((int64_t)1 << 40))
        BAD("%s: max_position_embeddings: %lld is out of range", name,
            (long long)d->max_position_embeddings);
    if (d->sliding_window < 0)
        BAD("%s: sliding_window: %d is negative", name, d->sliding_window);
    for (int i = 0; i < d->num_hidden_layers; i++) {
        if (d->layer_types[i] != DF_LAYER_FULL && d->layer_types[i] != DF_LAYER_SLIDING)
            BAD("%s: layer_types[%d]: a drafter layer is full_attention or sliding_attention", name,
                i);
        if (d->layer_types[i] == DF_LAYER_SLIDING && d->sliding_window <= 0)
            BAD("%s: layer_types[%d] is sliding_attention but sliding_window is not set", name, i);
        if (d->layer_types[i] == DF_LAYER_SLIDING && !d->use_sliding_window)
            BAD("%s: layer_types[%d] is sliding_attention but use_sliding_window is false "
                "(transformers would drop the window)", name, i);
    }
#undef BAD
    return 0;
}

/* The keys written for the serving engines (docs/SERVE.md) that restate
 * or pin what the drafter is. Exports made before they were written lack
 * them and still load; when present they must agree with the drafter: a
 * disagreement would make an engine run a different network than the one
 * trained, so it is refused with the key named. Called after target_layer_ids
 * and hidden_size are known. */
static int check_serving_keys(const jctx *c, const jctx *dc, const df_drafter_config *d)
{
    const char *w;
    const cJSON *j;
    if ((j = find(c, "hidden_act", &w)) &&
        !(cJSON_IsString(j) && !strcmp(j->valuestring, "silu")))
        return df_errf(c->e, -EINVAL, "%s: hidden_act: a DFlash drafter's MLP is SwiGLU, "
                       "expected \"silu\"", c->name);
    bool bias = false;
    TRY(get_bool(c, "attention_bias", &bias));
    if (bias)
        return df_errf(c->e, -EINVAL, "%s: attention_bias: a DFlash drafter has no attention "
                       "biases", c->name);
    static const char *const dtype_keys[] = {"torch_dtype", "dtype"};
    for (int k = 0; k < 2; k++) {
        j = find(c, dtype_keys[k], &w);
        if (j && !(cJSON_IsString(j) && (!strcmp(j->valuestring, "bfloat16") ||
                                         !strcmp(j->valuestring, "float16") ||
                                         !strcmp(j->valuestring, "float32"))))
            return df_errf(c->e, -EINVAL, "%s: %s: expected \"bfloat16\", \"float16\" or "
                           "\"float32\"", c->name, dtype_keys[k]);
    }
    int64_t th = 0;
    int rc = get_int(c, "target_hidden_size", 0, 1, 1 << 20, &th);
    TRY(rc);
    if (rc && th != d->hidden_size)
        return df_errf(c->e, -EINVAL, "%s: target_hidden_size %lld differs from hidden_size %d: "
                       "fc reads K x hidden_size target features", c->name, (long long)th,
                       d->hidden_size);
    /* vLLM's id j is the hidden state entering target layer j, DFlash's id i
     * the output of layer i: the same feature is j = i + 1. */
    if ((j = find(c, "eagle_aux_hidden_state_layer_ids", &w))) {
        int ok = cJSON_IsArray(j) && cJSON_GetArraySize(j) == d->num_target_features;
        for (int i = 0; ok && i < d->num_target_features; i++) {
            const cJSON *x = cJSON_GetArrayItem(j, i);
            ok = cJSON_IsNumber(x) && x->valuedouble == d->target_layer_ids[i] + 1;
        }
        if (!ok)
            return df_errf(c->e, -EINVAL, "%s: eagle_aux_hidden_state_layer_ids: expected "
                           "dflash_config.target_layer_ids + 1 (one entry per target layer id)",
                           c->name);
    }
    /* vLLM reads these as overrides of the per-layer causality (full layers
     * bidirectional in the block, sliding layers causal) this drafter has. */
    if (find(c, "is_causal", &w) || find(dc, "causal", &w))
        return df_errf(c->e, -EINVAL, "%s: %s: a causality override; this drafter's full "
                       "layers are bidirectional in the block and its sliding layers causal",
                       c->name, find(c, "is_causal", &w) ? "is_causal" : "dflash_config.causal");
    bool swa = false;
    TRY(get_bool(dc, "use_swa", &swa));
    if (swa)
        return df_errf(c->e, -EINVAL, "%s: dflash_config.use_swa: true would make every layer "
                       "sliding; layer_types says which are", c->name);
    return 0;
}

static int drafter_fill(const jctx *c, df_drafter_config *d)
{
    attn_shape s;
    TRY(get_attn_shape(c, DF_MAX_LAYERS, &s));
    d->hidden_size = s.hidden;
    d->num_hidden_layers = s.layers;
    d->vocab_size = s.vocab;
    d->intermediate_size = s.inter;
    d->num_attention_heads = s.heads;
    d->num_key_value_heads = s.kv;
    d->head_dim = s.head_dim;
    d->rms_norm_eps = s.eps;

    const char *w;
    const cJSON *dc = find(c, "dflash_config", &w);
    if (!cJSON_IsObject(dc))
        return df_errf(c->e, -EINVAL, "%s: missing required object 'dflash_config'", c->name);
    char nm[600];
    snprintf(nm, sizeof nm, "%s", c->name);
    jctx sub = {.name = nm, .text = dc, .root = dc, .prefix = "dflash_config.", .e = c->e};

    int top = 0, inner = 0;
    int rc_top = get_i32(c, "block_size", 0, 2, 1024, &top);
    TRY(rc_top);
    int rc_in = get_i32(&sub, "block_size", 0, 2, 1024, &inner);
    TRY(rc_in);
    if (!rc_top && !rc_in)
        return df_errf(c->e, -EINVAL, "%s: missing required key 'block_size'", c->name);
    if (rc_top && rc_in && top != inner)
        return df_errf(c->e, -EINVAL, "%s: block_size %d and dflash_config.block_size %d differ",
                       c->name, top, inner);
    d->block_size = rc_top ? top : inner;

    TRY(get_int(&sub, "mask_token_id", 1, 0, INT32_MAX, &d->mask_token_id));
    TRY(get_i32(c, "num_target_layers", 1, 1, DF_MAX_LAYERS, &d->num_target_layers));
    const cJSON *ids = cJSON_GetObjectItemCaseSensitive(dc, "target_layer_ids");
    if (!cJSON_IsArray(ids))
        return df_errf(c->e, -EINVAL, "%s: missing required array 'dflash_config.target_layer_ids'",
                       c->name);
    int k = cJSON_GetArraySize(ids);
    if (k < 1 || k > DF_MAX_TARGET_FEATURES)
        return df_errf(c->e, -EINVAL, "%s: dflash_config.target_layer_ids: %d entries, need 1..%d",
                       c->name, k, DF_MAX_TARGET_FEATURES);
    d->num_target_features = k;
    int i = 0;
    const cJSON *it;
    cJSON_ArrayForEach(it, ids)
    {
        double v = cJSON_IsNumber(it) ? it->valuedouble : -1;
        if (!(v >= 0 && v < DF_MAX_LAYERS) || v != floor(v))
            return df_errf(c->e, -EINVAL,
                           "%s: dflash_config.target_layer_ids[%d]: expected a layer index", c->name,
                           i);
        d->target_layer_ids[i++] = (int)v;
    }

    double theta = 0;
    int have_theta = 0, dummy = 0;
    TRY(check_rope_obj(c, "rope_parameters", &theta, &have_theta, NULL, &dummy));
    if (!have_theta) {
        int rc = get_num(c, "rope_theta", 0, 0, 1, 1e15, &theta);
        TRY(rc);
        have_theta = rc;
    }
    TRY(check_rope_obj(c, "rope_scaling", &theta, &have_theta, NULL, &dummy));
    if (!have_theta)
        return df_errf(c->e, -EINVAL, "%s: missing required key 'rope_theta'", c->name);
    d->rope_theta = theta;
    /* Required: serving engines size their RoPE cache from it. */
    TRY(get_int(c, "max_position_embeddings", 1, 1, (int64_t)1 << 40, &d->max_position_embeddings));
    TRY(get_sliding_window(c, &d->sliding_window));
    d->use_sliding_window = false;
    TRY(get_bool(c, "use_sliding_window", &d->use_sliding_window));
    bool tie = false;
    TRY(get_bool(c, "tie_word_embeddings", &tie));
    if (tie)
        return df_errf(c->e, -EINVAL,
                       "%s: tie_word_embeddings: a DFlash drafter has no embedding of its own",
                       c->name);
    int rc = get_layer_types(c, d->num_hidden_layers,
                             (1u << DF_LAYER_FULL) | (1u << DF_LAYER_SLIDING), "a DFlash drafter",
                             d->layer_types);
    TRY(rc);
    if (rc == 0)
        TRY(derive_qwen3_layers(c, d->num_hidden_layers, d->use_sliding_window, d->sliding_window,
                                d->layer_types));
    TRY(check_sliding(c, d->layer_types, d->num_hidden_layers, d->use_sliding_window,
                      d->sliding_window));
    TRY(check_serving_keys(c, &sub, d));
    return df_drafter_config_validate(d, c->name, c->e);
}

int df_drafter_config_parse(const char *json, size_t len, const char *name, df_drafter_config *out,
                            df_err *e)
{
    memset(out, 0, sizeof *out);
    if (!name)
        name = "config.json";
    cJSON *root;
    int rc = parse_root(json, len, name, &root, e);
    if (rc < 0)
        return rc;
    jctx c = {.name = name, .text = root, .root = root, .prefix = "", .e = e};
    rc = drafter_fill(&c, out);
    cJSON_Delete(root);
    if (rc < 0) {
        memset(out, 0, sizeof *out);
        return rc;
    }
    df_sha256_hex_of(json, len, out->config_sha256);
    return 0;
}

int df_drafter_config_load(const char *path, df_drafter_config *out, df_err *e)
{
    memset(out, 0, sizeof *out);
    char p[4096];
    int rc = config_path(path, p, sizeof p, e);
    if (rc < 0)
        return rc;
    char *txt;
    size_t len;
    if ((rc = df_file_read_all(p, CONFIG_MAX_BYTES, &txt, &len, e)) < 0)
        return rc;
    rc = df_drafter_config_parse(txt, len, p, out, e);
    free(txt);
    return rc;
}

char *df_drafter_config_to_json(const df_drafter_config *d, df_err *e)
{
    if (df_drafter_config_validate(d, "drafter config", e) < 0)
        return NULL;
    cJSON *r = cJSON_CreateObject(), *dc = NULL, *a;
    int ok = r != NULL;
    /* cJSON_Add* return NULL on allocation failure; ok collects that. */
#define ADD(x) ok = ok && (x) != NULL
    ADD(a = cJSON_AddArrayToObject(r, "architectures"));
    ok = ok && cJSON_AddItemToArray(a, cJSON_CreateString("DFlashDraftModel"));
    ADD(cJSON_AddStringToObject(r, "model_type", "qwen3"));
    ADD(cJSON_AddNumberToObject(r, "block_size", d->block_size));
    ADD(dc = cJSON_AddObjectToObject(r, "dflash_config"));
    if (ok) {
        ADD(cJSON_AddNumberToObject(dc, "block_size", d->block_size));
        ADD(cJSON_AddNumberToObject(dc, "mask_token_id", (double)d->mask_token_id));
        ADD(a = cJSON_AddArrayToObject(dc, "target_layer_ids"));
        for (int i = 0; ok && i < d->num_target_features; i++)
            ok = cJSON_AddItemToArray(a, cJSON_CreateNumber(d->target_layer_ids[i]));
    }
    ADD(cJSON_AddNumberToObject(r, "num_target_layers", d->num_target_layers));
    ADD(cJSON_AddNumberToObject(r, "num_hidden_layers", d->num_hidden_layers));
    ADD(cJSON_AddNumberToObject(r, "hidden_size", d->hidden_size));
    ADD(cJSON_AddNumberToObject(r, "intermediate_size", d->intermediate_size));
    ADD(cJSON_AddNumberToObject(r, "num_attention_heads", d->num_attention_heads));
    ADD(cJSON_AddNumberToObject(r, "num_key_value_heads", d->num_key_value_heads));
    ADD(cJSON_AddNumberToObject(r, "head_dim", d->head_dim));
    ADD(cJSON_AddNumberToObject(r, "rms_norm_eps", d->rms_norm_eps));
    ADD(cJSON_AddNumberToObject(r, "rope_theta", d->rope_theta));
    ADD(cJSON_AddNullToObject(r, "rope_scaling"));
    ADD(cJSON_AddNumberToObject(r, "max_position_embeddings", (double)d->max_position_embeddings));
    ADD(a = cJSON_AddArrayToObject(r, "layer_types"));
    for (int i = 0; ok && i < d->num_hidden_layers; i++)
        ok = cJSON_AddItemToArray(a, cJSON_CreateString(df_layer_type_name(d->layer_types[i])));
    if (d->sliding_window > 0)
        ADD(cJSON_AddNumberToObject(r, "sliding_window", d->sliding_window));
    else
        ADD(cJSON_AddNullToObject(r, "sliding_window"));
    ADD(cJSON_AddBoolToObject(r, "use_sliding_window", d->use_sliding_window));
    ADD(cJSON_AddNumberToObject(r, "vocab_size", (double)d->vocab_size));
    ADD(cJSON_AddBoolToObject(r, "tie_word_embeddings", 0));
    /* For the serving engines (docs/SERVE.md has each key's reader). */
    ADD(cJSON_AddStringToObject(r, "hidden_act", "silu"));
    ADD(cJSON_AddBoolToObject(r, "attention_bias", 0));
    ADD(cJSON_AddStringToObject(r, "torch_dtype", "bfloat16"));
    ADD(cJSON_AddStringToObject(r, "dtype", "bfloat16"));
    ADD(cJSON_AddNumberToObject(r, "target_hidden_size", d->hidden_size));
    ADD(a = cJSON_AddArrayToObject(r, "eagle_aux_hidden_state_layer_ids"));
    for (int i = 0; ok && i < d->num_target_features; i++)
        ok = cJSON_AddItemToArray(a, cJSON_CreateNumber(d->target_layer_ids[i] + 1));
#undef ADD
    char *txt = ok ? cJSON_Print(r) : NULL;
    cJSON_Delete(r);
    if (!txt) {
        df_errf(e, -ENOMEM, "drafter config: out of memory");
        return NULL;
    }
    /* cJSON's buffer comes from its allocator (malloc by default): hand back
     * a copy from ours with a final newline, so callers just free(). */
    size_t n = strlen(txt);
    char *outp = malloc(n + 2);
    if (outp) {
        memcpy(outp, txt, n);
        outp[n] = '\n';
        outp[n + 1] = 0;
    } else {
        df_errf(e, -ENOMEM, "drafter config: out of memory");
    }
    cJSON_free(txt);
    return outp;
}
