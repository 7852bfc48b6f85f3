/* Tests of common/sha256 (known vectors, streaming == one shot), the HF
 * config.json loader (qwen3, qwen3_5 text and multimodal, errors naming the
 * key), the docs/DRAFTER.md target-layer rule and the drafter config round trip. */
#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fsutil.h"
#include "hfconfig.h"
#include "sha256.h"
#include "test.h"
#include "test_drafter27b.h"

#ifndef DFLASH_TEST_DATA
#error "DFLASH_TEST_DATA must point at tests/data"
#endif

#define MODEL_8M "/work/shared/models/qwen3-code-8m"

/* ---------------- sha256 ---------------- */

/* The known vectors, under whichever compression is selected. */
static void test_sha256_vectors(void)
{
    char hex[DF_SHA256_HEX];
    static const struct {
        const char *in;
        const char *want;
    } v[] = {
        {"", "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"},
        {"abc", "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"},
        {"abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq",
         "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1"},
        {"abcdefghbcdefghicdefghijdefghijkefghijklfghijklmghijklmnhijklmnoijklmnopjklmnopqklmnopqrl"
         "mnopqrsmnopqrstnopqrstu",
         "cf5b16a778af8380036ce59e7b0492370b249b11e8f07a51afac45037afee9d1"},
    };
    for (size_t i = 0; i < sizeof v / sizeof v[0]; i++) {
        df_sha256_hex_of(v[i].in, strlen(v[i].in), hex);
        CHECK(!strcmp(hex, v[i].want));
    }

    /* One million 'a' (FIPS 180-2 vector), fed in uneven pieces. */
    static char a[1000];
    memset(a, 'a', sizeof a);
    df_sha256_ctx s;
    df_sha256_init(&s);
    size_t fed = 0, step = 1;
    while (fed < 1000000) {
        size_t n = step < 1000000 - fed ? step : 1000000 - fed;
        if (n > sizeof a)
            n = sizeof a;
        df_sha256_update(&s, a, n);
        fed += n;
        step = step * 7 % 997 + 1;
    }
    uint8_t d[DF_SHA256_LEN];
    df_sha256_final(&s, d);
    df_sha256_hex(d, hex);
    CHECK(!strcmp(hex, "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"));

    /* Lengths around the 55/56/64-byte padding boundaries (values from Python
     * hashlib on bytes (i*7+3)&255), one shot and byte by byte. */
    static const struct {
        size_t n;
        const char *want;
    } p[] = {
        {55, "e7313d333c272e639f790978283f9eb392e843d0f29b7016828bb1daa4aac70b"},
        {56, "4324d65f3c103567f5589c710bc08f8523f929a9272e3af36fc968e52abc6c27"},
        {63, "81c80242132f230c3bd41b3e63bbcff16107339549214a99614ff26664625055"},
        {64, "39e3d7b6b5d075d37d053ad89b24b41bef4f3c29760c84447cab3f3be1882241"},
        {65, "aacca6ff74fdbb296d165a45cecfa04e5127bc008770fbbdd48006f2d2fae95e"},
        {119, "9ce7368e4daf32341631b492e80359dc9f594b48453cd0dd5bf0b19279cc177e"},
        {120, "7836b787757e95e58b3ca5aec90b1b004e8deba1e50e9675af9cabf1a13a04b5"},
        {128, "d2742f1f4ac6bb7ca2b239ee18402ba8b3f9f8e652d2a72973c2b9ba11c08cf6"},
        {1000, "1e9bc38cbf860b9ec31918b065f9b52476c549a782e0e7990bed8ce3868d2371"},
    };
    uint8_t pat[1000];
    for (int i = 0; i < 1000; i++)
        pat[i] = (uint8_t)((i * 7 + 3) & 255);
    for (size_t i = 0; i < sizeof p / sizeof p[0]; i++) {
        df_sha256_hex_of(pat, p[i].n, hex);
        CHECK(!strcmp(hex, p[i].want));
        df_sha256_init(&s);
        for (size_t k = 0; k < p[i].n; k++)
            df_sha256_update(&s, pat + k, 1);
        df_sha256_final(&s, d);
        df_sha256_hex(d, hex);
        CHECK(!strcmp(hex, p[i].want));
    }
}

/* xorshift64: deterministic test bytes */
static uint64_t sha_rng = 0x9e3779b97f4a7c15ull;
static uint8_t sha_byte(void)
{
    sha_rng ^= sha_rng << 13;
    sha_rng ^= sha_rng >> 7;
    sha_rng ^= sha_rng << 17;
    return (uint8_t)(sha_rng >> 24);
}

static void test_sha256(void)
{
    /* the vectors under each compression this CPU has: the portable code,
     * then SHA-NI where present (the default there) */
    const int hw = df_sha256_hw();
    df_sha256_use_hw(0);
    CHECK(df_sha256_hw() == 0);
    test_sha256_vectors();
    df_sha256_use_hw(1);
    CHECK(df_sha256_hw() == hw);
    printf("sha256: SHA-NI %s\n", hw ? "present: both compressions tested" : "absent: portable code only");
    if (hw)
        test_sha256_vectors();

    /* the two compressions agree on random bytes of every length up to 4 KiB
     * and some long ones, one shot and streamed in random pieces */
    static uint8_t buf[1 << 17];
    for (size_t i = 0; i < sizeof buf; i++)
        buf[i] = sha_byte();
    uint8_t d0[DF_SHA256_LEN], d1[DF_SHA256_LEN];
    int bad = 0;
    for (size_t n = 0; n <= sizeof buf; n = n < 4096 ? n + 1 : n * 2 + 4099) {
        size_t len = n < sizeof buf ? n : sizeof buf;
        df_sha256_use_hw(0);
        df_sha256(buf, len, d0);
        df_sha256_use_hw(1);
        df_sha256_ctx s;
        df_sha256_init(&s);
        for (size_t fed = 0; fed < len;) {
            size_t k = (size_t)sha_byte() * 3 % 200;
            if (k > len - fed)
                k = len - fed;
            df_sha256_update(&s, buf + fed, k);
            fed += k;
        }
        df_sha256_final(&s, d1);
        bad += memcmp(d0, d1, sizeof d0) != 0;
        if (len == sizeof buf)
            break;
    }
    CHECK(bad == 0);

    /* File hashing: equal to the in-memory hash; a missing file names itself. */
    char hex[DF_SHA256_HEX];
    uint8_t pat[1000];
    for (int i = 0; i < 1000; i++)
        pat[i] = (uint8_t)((i * 7 + 3) & 255);
    const char *dir = test_tmpdir("hfconfig_sha");
    char path[4096];
    df_err e = {0};
    snprintf(path, sizeof path, "%s/pat.bin", dir);
    CHECK_OK(df_file_write_atomic(path, pat, 1000, &e), &e);
    CHECK_OK(df_sha256_file(path, hex, &e), &e);
    CHECK(!strcmp(hex, "1e9bc38cbf860b9ec31918b065f9b52476c549a782e0e7990bed8ce3868d2371"));
    snprintf(path, sizeof path, "%s/missing.bin", dir);
    CHECK_ERR(df_sha256_file(path, hex, &e), -ENOENT, &e, "missing.bin");
}

/* ---------------- target layer rule ---------------- */

static void test_target_layers(void)
{
    int ids[DF_MAX_TARGET_FEATURES];
    CHECK_OK(df_default_target_layers(64, 5, ids), NULL);
    static const int want64[] = {1, 16, 31, 46, 61};
    for (int i = 0; i < 5; i++)
        CHECK_EQ(ids[i], want64[i]);
    CHECK_OK(df_default_target_layers(36, 5, ids), NULL); /* Qwen3-8B drafter: [1,9,17,25,33] */
    static const int want36[] = {1, 9, 17, 25, 33};
    for (int i = 0; i < 5; i++)
        CHECK_EQ(ids[i], want36[i]);
    CHECK_OK(df_default_target_layers(64, 1, ids), NULL);
    CHECK_EQ(ids[0], 32);
    CHECK_OK(df_default_target_layers(6, 1, ids), NULL);
    CHECK_EQ(ids[0], 3);
    /* 1 + 3/2 = 2.5 rounds to 2 (Python round: half to even), 1 + 3 = 4. */
    CHECK_OK(df_default_target_layers(7, 3, ids), NULL);
    CHECK_EQ(ids[0], 1);
    CHECK_EQ(ids[1], 2);
    CHECK_EQ(ids[2], 4);
    /* 1 + 5/2 = 3.5 rounds to 4. */
    CHECK_OK(df_default_target_layers(9, 3, ids), NULL);
    CHECK_EQ(ids[1], 4);
    CHECK_EQ(df_default_target_layers(64, 0, ids), -EINVAL);
    CHECK_EQ(df_default_target_layers(4, 3, ids), -EINVAL); /* span 0: ids repeat */
    CHECK_EQ(df_default_target_layers(8, 8, ids), -EINVAL); /* more ids than layers in range */
}

/* ---------------- target configs ---------------- */

static char *slurp(const char *path, size_t *len)
{
    char *t = NULL;
    df_err e = {0};
    if (df_file_read_all(path, 1 << 20, &t, len, &e) < 0) {
        fprintf(stderr, "%s\n", e.msg);
        exit(2);
    }
    return t;
}

static void test_qwen3(void)
{
    df_model_config m;
    df_err e = {0};
    CHECK_OK(df_model_config_load(DFLASH_TEST_DATA "/qwen3-code-8m.config.json", &m, &e), &e);
    CHECK_EQ(m.arch, DF_ARCH_QWEN3);
    CHECK(!strcmp(m.model_type, "qwen3"));
    CHECK(!m.has_text_config);
    CHECK_EQ(m.hidden_size, 256);
    CHECK_EQ(m.num_hidden_layers, 6);
    CHECK_EQ(m.vocab_size, 4096);
    CHECK_EQ(m.intermediate_size, 768);
    CHECK_EQ(m.num_attention_heads, 8);
    CHECK_EQ(m.num_key_value_heads, 4);
    CHECK_EQ(m.head_dim, 32);
    CHECK(m.rms_norm_eps == 1e-6);
    CHECK(m.rope_theta == 1e6);
    CHECK(m.partial_rotary_factor == 1.0);
    CHECK_EQ(m.rotary_dim, 32);
    CHECK(!m.tie_word_embeddings);
    CHECK(!m.attn_output_gate);
    CHECK_EQ(m.max_position_embeddings, 2048);
    CHECK_EQ(m.sliding_window, 0);
    CHECK_EQ(m.dtype, DF_DTYPE_BF16);
    CHECK(!strcmp(m.torch_dtype, "bfloat16"));
    for (int i = 0; i < 6; i++)
        CHECK_EQ(m.layer_types[i], DF_LAYER_FULL);
    /* Same bytes as the model's config.json, whose sha256 SHA256SUMS lists. */
    CHECK(!strcmp(m.config_sha256, "80ee5febfd95f696ab3df42fdedea1bc89f716810680cfe1ef16d35c9c275d9d"));

    /* A directory is looked into for config.json. */
    const char *dir = test_tmpdir("hfconfig_dir");
    char p[4096];
    size_t len;
    char *txt = slurp(DFLASH_TEST_DATA "/qwen3-code-8m.config.json", &len);
    snprintf(p, sizeof p, "%s/config.json", dir);
    CHECK_OK(df_file_write_atomic(p, txt, len, &e), &e);
    df_model_config m2;
    CHECK_OK(df_model_config_load(dir, &m2, &e), &e);
    CHECK_EQ(m2.hidden_size, 256);
    CHECK(!strcmp(m2.config_sha256, m.config_sha256));
    free(txt);
    CHECK_ERR(df_model_config_load(test_tmpdir("hfconfig_empty"), &m2, &e), -ENOENT, &e,
              "config.json");

    if (access(MODEL_8M "/config.json", R_OK) == 0) {
        CHECK_OK(df_model_config_load(MODEL_8M, &m2, &e), &e);
        CHECK(!strcmp(m2.config_sha256, m.config_sha256));
    } else {
        printf("skipping %s (absent)\n", MODEL_8M);
    }
}

static void check_27b_text(const df_model_config *m)
{
    CHECK_EQ(m->arch, DF_ARCH_QWEN3_5);
    CHECK_EQ(m->hidden_size, 5120);
    CHECK_EQ(m->num_hidden_layers, 64);
    CHECK_EQ(m->vocab_size, 248320);
    CHECK_EQ(m->intermediate_size, 17408);
    CHECK_EQ(m->num_attention_heads, 24);
    CHECK_EQ(m->num_key_value_heads, 4);
    CHECK_EQ(m->head_dim, 256);
    CHECK(m->rms_norm_eps == 1e-6);
    CHECK(m->rope_theta == 1e7);
    CHECK(m->partial_rotary_factor == 0.25);
    CHECK_EQ(m->rotary_dim, 64);
    CHECK(m->attn_output_gate);
    CHECK(!m->tie_word_embeddings);
    CHECK_EQ(m->max_position_embeddings, 262144);
    CHECK_EQ(m->linear_num_key_heads, 16);
    CHECK_EQ(m->linear_num_value_heads, 48);
    CHECK_EQ(m->linear_key_head_dim, 128);
    CHECK_EQ(m->linear_value_head_dim, 128);
    CHECK_EQ(m->linear_conv_kernel_dim, 4);
    CHECK_EQ(m->full_attention_interval, 4);
    CHECK_EQ(m->dtype, DF_DTYPE_BF16);
    int nfull = 0;
    for (int i = 0; i < 64; i++) {
        CHECK_EQ(m->layer_types[i], (i + 1) % 4 == 0 ? DF_LAYER_FULL : DF_LAYER_LINEAR);
        nfull += m->layer_types[i] == DF_LAYER_FULL;
    }
    CHECK_EQ(nfull, 16);
}

static void test_qwen3_5(void)
{
    df_model_config m;
    df_err e = {0};
    CHECK_OK(df_model_config_load(DFLASH_TEST_DATA "/qwen3_5-27b-text.config.json", &m, &e), &e);
    check_27b_text(&m);
    CHECK(!strcmp(m.model_type, "qwen3_5_text"));
    CHECK(!m.has_text_config);
    /* Multimodal: text under text_config, layer_types derived from
     * full_attention_interval, tie_word_embeddings at the top level. */
    CHECK_OK(df_model_config_load(DFLASH_TEST_DATA "/qwen3_5-27b.config.json", &m, &e), &e);
    check_27b_text(&m);
    CHECK(!strcmp(m.model_type, "qwen3_5"));
    CHECK(m.has_text_config);
    CHECK_EQ(strlen(m.config_sha256), 64);
}

/* Applies one edit to JSON text; path is dotted ("text_config.hidden_size"),
 * value is JSON text or NULL to delete. Returns malloc'd text. */
static char *edit_json(const char *txt, const char *path, const char *value)
{
    cJSON *root = cJSON_Parse(txt);
    CHECK(root != NULL);
    cJSON *obj = root;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", path);
    char *key = buf, *dot;
    while ((dot = strchr(key, '.'))) {
        *dot = 0;
        obj = cJSON_GetObjectItemCaseSensitive(obj, key);
        key = dot + 1;
    }
    cJSON_DeleteItemFromObjectCaseSensitive(obj, key);
    if (value)
        cJSON_AddItemToObject(obj, key, cJSON_Parse(value));
    char *out = cJSON_PrintUnformatted(root);
    cJSON_Delete(root);
    return out;
}

static int parse_edited(const char *base_file, const char *path, const char *value,
                        df_model_config *m, df_err *e)
{
    size_t len;
    char *txt = slurp(base_file, &len);
    char *out = edit_json(txt, path, value);
    free(txt);
    int rc = df_model_config_parse(out, strlen(out), "edited.json", m, e);
    free(out);
    return rc;
}

static void test_model_errors(void)
{
    const char *q3 = DFLASH_TEST_DATA "/qwen3-code-8m.config.json";
    const char *q35 = DFLASH_TEST_DATA "/qwen3_5-27b.config.json";
    const char *q35t = DFLASH_TEST_DATA "/qwen3_5-27b-text.config.json";
    df_model_config m;
    df_err e = {0};

    CHECK_ERR(parse_edited(q3, "model_type", "\"llama\"", &m, &e), -ENOTSUP, &e,
              "model_type 'llama' is not supported; supported: qwen3, qwen3_5");
    CHECK_ERR(parse_edited(q3, "model_type", NULL, &m, &e), -EINVAL, &e, "model_type");
    CHECK_ERR(parse_edited(q3, "hidden_size", NULL, &m, &e), -EINVAL, &e,
              "missing required key 'hidden_size'");
    CHECK(strstr(e.msg, "edited.json") != NULL);
    CHECK_ERR(parse_edited(q3, "hidden_size", "\"256\"", &m, &e), -EINVAL, &e,
              "hidden_size: expected an integer, got a string");
    CHECK_ERR(parse_edited(q3, "hidden_size", "256.5", &m, &e), -EINVAL, &e, "hidden_size");
    CHECK_ERR(parse_edited(q3, "num_attention_heads", "-8", &m, &e), -EINVAL, &e,
              "num_attention_heads");
    CHECK_ERR(parse_edited(q3, "num_attention_heads", "0", &m, &e), -EINVAL, &e,
              "num_attention_heads");
    CHECK_ERR(parse_edited(q3, "num_key_value_heads", "3", &m, &e), -EINVAL, &e,
              "num_key_value_heads: 3 does not divide num_attention_heads 8");
    CHECK_ERR(parse_edited(q3, "num_hidden_layers", "2000000", &m, &e), -EINVAL, &e,
              "num_hidden_layers");
    CHECK_ERR(parse_edited(q3, "vocab_size", "1e300", &m, &e), -EINVAL, &e, "vocab_size");
    CHECK_ERR(parse_edited(q3, "head_dim", "33", &m, &e), -EINVAL, &e, "head_dim");
    CHECK_ERR(parse_edited(q3, "rms_norm_eps", "0", &m, &e), -EINVAL, &e, "rms_norm_eps");
    CHECK_ERR(parse_edited(q3, "layer_types", "[\"full_attention\"]", &m, &e), -EINVAL, &e,
              "layer_types has 1 entries");
    CHECK_ERR(parse_edited(q3, "layer_types",
                           "[\"full_attention\",\"full_attention\",\"full_attention\","
                           "\"full_attention\",\"full_attention\",\"linear_attention\"]",
                           &m, &e),
              -EINVAL, &e, "layer_types[5]: 'linear_attention' is not supported for qwen3");
    CHECK_ERR(parse_edited(q3, "layer_types",
                           "[\"full_attention\",\"full_attention\",\"full_attention\","
                           "\"full_attention\",\"full_attention\",\"sliding_attention\"]",
                           &m, &e),
              -EINVAL, &e, "layer_types[5] is sliding_attention but use_sliding_window is not true");
    CHECK_ERR(parse_edited(q3, "use_sliding_window", "true", &m, &e), -EINVAL, &e,
              "use_sliding_window is true but 'sliding_window' is not set");
    {
        /* transformers' derivation: use_sliding_window + window + max_window_layers. */
        size_t len;
        char *txt = slurp(q3, &len);
        char *t1 = edit_json(txt, "layer_types", NULL);
        char *t2 = edit_json(t1, "use_sliding_window", "true");
        char *t3 = edit_json(t2, "sliding_window", "512");
        char *t4 = edit_json(t3, "max_window_layers", "4");
        CHECK_OK(df_model_config_parse(t4, strlen(t4), "sw.json", &m, &e), &e);
        CHECK_EQ(m.sliding_window, 512);
        for (int i = 0; i < 6; i++)
            CHECK_EQ(m.layer_types[i], i >= 4 ? DF_LAYER_SLIDING : DF_LAYER_FULL);
        /* Without use_sliding_window the window is dropped, as in transformers. */
        char *t5 = edit_json(t4, "use_sliding_window", "false");
        CHECK_OK(df_model_config_parse(t5, strlen(t5), "sw.json", &m, &e), &e);
        CHECK_EQ(m.sliding_window, 0);
        for (int i = 0; i < 6; i++)
            CHECK_EQ(m.layer_types[i], DF_LAYER_FULL);
        free(txt);
        free(t1);
        free(t2);
        free(t3);
        free(t4);
        free(t5);
    }
    /* Theta: both places removed = error; top-level alone suffices. */
    CHECK_OK(parse_edited(q3, "rope_parameters", NULL, &m, &e), &e);
    CHECK(m.rope_theta == 1e6);
    CHECK_ERR(parse_edited(q3, "rope_parameters", "{\"rope_type\":\"yarn\",\"factor\":4}", &m, &e),
              -ENOTSUP, &e, "yarn");
    CHECK_OK(parse_edited(q3, "rope_theta", NULL, &m, &e), &e); /* rope_parameters has it */
    CHECK(m.rope_theta == 1e6);
    {
        /* Neither place: needs a two-step edit. */
        size_t len;
        char *txt = slurp(q3, &len);
        cJSON *r = cJSON_Parse(txt);
        free(txt);
        cJSON_DeleteItemFromObject(r, "rope_theta");
        cJSON_DeleteItemFromObject(r, "rope_parameters");
        char *o = cJSON_PrintUnformatted(r);
        cJSON_Delete(r);
        CHECK_ERR(df_model_config_parse(o, strlen(o), "x.json", &m, &e), -EINVAL, &e, "rope_theta");
        free(o);
    }
    /* Absent num_key_value_heads means no GQA (transformers' meaning). */
    CHECK_OK(parse_edited(q3, "num_key_value_heads", NULL, &m, &e), &e);
    CHECK_EQ(m.num_key_value_heads, 8);

    CHECK_ERR(parse_edited(q35, "text_config.num_key_value_heads", "5", &m, &e), -EINVAL, &e,
              "text_config.num_key_value_heads: 5 does not divide num_attention_heads 24");
    CHECK_ERR(parse_edited(q35, "text_config.linear_num_key_heads", NULL, &m, &e), -EINVAL, &e,
              "missing required key 'text_config.linear_num_key_heads'");
    CHECK_ERR(parse_edited(q35, "text_config.linear_num_key_heads", "7", &m, &e), -EINVAL, &e,
              "linear_num_key_heads: 7 does not divide");
    CHECK_ERR(parse_edited(q35, "text_config.model_type", "\"qwen3_next\"", &m, &e), -ENOTSUP, &e,
              "qwen3_next");
    CHECK_ERR(parse_edited(q35, "text_config.full_attention_interval", NULL, &m, &e), -EINVAL, &e,
              "full_attention_interval");
    CHECK_ERR(parse_edited(q35, "text_config.hidden_size", "[]", &m, &e), -EINVAL, &e,
              "text_config.hidden_size: expected an integer, got an array");
    CHECK_ERR(parse_edited(q35, "text_config", "7", &m, &e), -EINVAL, &e, "text_config");
    CHECK_ERR(parse_edited(q35t, "rope_parameters", "{\"rope_theta\":1e7,\"partial_rotary_factor\":0.26953125}",
                           &m, &e),
              -EINVAL, &e, "partial_rotary_factor");
    /* Not JSON, not an object, trailing junk. */
    CHECK_ERR(df_model_config_parse("{\"model_type\":", 14, "cut.json", &m, &e), -DF_ECORRUPT, &e,
              "cut.json: not valid JSON");
    CHECK_ERR(df_model_config_parse("[1]", 3, "arr.json", &m, &e), -EINVAL, &e, "arr.json");
    CHECK_ERR(df_model_config_parse("{} x", 4, "junk.json", &m, &e), -DF_ECORRUPT, &e, "junk.json");
    CHECK_ERR(df_model_config_parse("", 0, "empty.json", &m, &e), -DF_ECORRUPT, &e, "empty.json");
}

/* ---------------- drafter config ---------------- */


static int drafter_equal(const df_drafter_config *a, const df_drafter_config *b)
{
    int ok = a->block_size == b->block_size && a->mask_token_id == b->mask_token_id &&
             a->num_target_layers == b->num_target_layers &&
             a->num_target_features == b->num_target_features &&
             a->num_hidden_layers == b->num_hidden_layers && a->hidden_size == b->hidden_size &&
             a->intermediate_size == b->intermediate_size &&
             a->num_attention_heads == b->num_attention_heads &&
             a->num_key_value_heads == b->num_key_value_heads && a->head_dim == b->head_dim &&
             a->rms_norm_eps == b->rms_norm_eps && a->rope_theta == b->rope_theta &&
             a->max_position_embeddings == b->max_position_embeddings &&
             a->sliding_window == b->sliding_window &&
             a->use_sliding_window == b->use_sliding_window && a->vocab_size == b->vocab_size;
    for (int i = 0; ok && i < a->num_target_features; i++)
        ok = a->target_layer_ids[i] == b->target_layer_ids[i];
    for (int i = 0; ok && i < a->num_hidden_layers; i++)
        ok = a->layer_types[i] == b->layer_types[i];
    return ok;
}

static void test_drafter(void)
{
    df_drafter_config d, d2;
    df_err e = {0};
    test_drafter_27b(&d);
    CHECK_EQ(d.target_layer_ids[1], 16);
    char *js = df_drafter_config_to_json(&d, &e);
    CHECK(js != NULL);
    if (!js)
        return;

    /* Exactly the docs/DRAFTER.md keys, with the fixed values serving engines expect. */
    cJSON *r = cJSON_Parse(js);
    CHECK(r != NULL);
    static const char *keys[] = {
        "architectures", "model_type", "block_size", "dflash_config", "num_target_layers",
        "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "rope_scaling",
        "max_position_embeddings", "layer_types", "sliding_window", "use_sliding_window",
        "vocab_size", "tie_word_embeddings", "hidden_act", "attention_bias", "torch_dtype",
        "dtype", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"};
    int nkeys = (int)(sizeof keys / sizeof keys[0]);
    CHECK_EQ(cJSON_GetArraySize(r), nkeys);
    for (int i = 0; i < nkeys; i++)
        CHECK(cJSON_GetObjectItemCaseSensitive(r, keys[i]) != NULL);
    cJSON *arch = cJSON_GetObjectItemCaseSensitive(r, "architectures");
    CHECK(cJSON_GetArraySize(arch) == 1 &&
          !strcmp(cJSON_GetArrayItem(arch, 0)->valuestring, "DFlashDraftModel"));
    CHECK(!strcmp(cJSON_GetObjectItemCaseSensitive(r, "model_type")->valuestring, "qwen3"));
    CHECK(cJSON_IsFalse(cJSON_GetObjectItemCaseSensitive(r, "tie_word_embeddings")));
    cJSON *dc = cJSON_GetObjectItemCaseSensitive(r, "dflash_config");
    CHECK_EQ(cJSON_GetObjectItemCaseSensitive(dc, "block_size")->valuedouble, 16);
    CHECK_EQ(cJSON_GetObjectItemCaseSensitive(r, "block_size")->valuedouble, 16);
    CHECK_EQ(cJSON_GetObjectItemCaseSensitive(dc, "mask_token_id")->valuedouble, 248070);
    CHECK_EQ(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(dc, "target_layer_ids")), 5);
    CHECK(!strcmp(cJSON_GetArrayItem(cJSON_GetObjectItemCaseSensitive(r, "layer_types"), 0)->valuestring,
                  "sliding_attention"));
    cJSON_Delete(r);

    /* Round trip through text and through a file. */
    CHECK_OK(df_drafter_config_parse(js, strlen(js), "rt.json", &d2, &e), &e);
    CHECK(drafter_equal(&d, &d2));
    const char *dir = test_tmpdir("hfconfig_drafter");
    char p[4096];
    snprintf(p, sizeof p, "%s/config.json", dir);
    CHECK_OK(df_file_write_atomic(p, js, strlen(js), &e), &e);
    memset(&d2, 0, sizeof d2);
    CHECK_OK(df_drafter_config_load(dir, &d2, &e), &e);
    CHECK(drafter_equal(&d, &d2));
    char want[DF_SHA256_HEX];
    df_sha256_hex_of(js, strlen(js), want);
    CHECK(!strcmp(d2.config_sha256, want));
    /* A target config is not a drafter config. */
    CHECK_ERR(df_drafter_config_load(DFLASH_TEST_DATA "/qwen3-code-8m.config.json", &d2, &e),
              -EINVAL, &e, "dflash_config");

    /* A small all-full drafter without max_position_embeddings / window. */
    df_drafter_config s = d;
    s.num_hidden_layers = 1;
    s.layer_types[0] = DF_LAYER_FULL;
    s.sliding_window = 0;
    s.use_sliding_window = false;
    s.num_target_features = 1;
    s.target_layer_ids[0] = 3;
    char *js2 = df_drafter_config_to_json(&s, &e);
    CHECK(js2 != NULL);
    CHECK_OK(df_drafter_config_parse(js2, strlen(js2), "small.json", &d2, &e), &e);
    CHECK(drafter_equal(&s, &d2));
    free(js2);

    /* Invalid structs are refused by to_json. */
    s = d;
    s.mask_token_id = s.vocab_size;
    CHECK(df_drafter_config_to_json(&s, &e) == NULL);
    CHECK_EQ(e.code, -EINVAL);
    CHECK(strstr(e.msg, "mask_token_id") != NULL);
    s = d;
    s.target_layer_ids[2] = s.target_layer_ids[1];
    CHECK(df_drafter_config_to_json(&s, &e) == NULL);
    CHECK(strstr(e.msg, "appears twice") != NULL);
    s = d;
    s.sliding_window = 0;
    CHECK(df_drafter_config_to_json(&s, &e) == NULL);
    CHECK(strstr(e.msg, "sliding_window") != NULL);
    s = d;
    s.use_sliding_window = false;
    CHECK(df_drafter_config_to_json(&s, &e) == NULL);
    CHECK(strstr(e.msg, "layer_types[0] is sliding_attention but use_sliding_window is false") != NULL);
    s = d;
    s.max_position_embeddings = 0;
    CHECK(df_drafter_config_to_json(&s, &e) == NULL);
    CHECK(strstr(e.msg, "max_position_embeddings") != NULL);

    /* Edits of the emitted text. */
    static const struct {
        const char *path, *value;
        int code;
        const char *needle;
    } ed[] = {
        {"block_size", "8", -EINVAL, "block_size 8 and dflash_config.block_size 16 differ"},
        {"block_size", NULL, 0, NULL}, /* dflash_config.block_size alone suffices */
        {"dflash_config.block_size", NULL, 0, NULL},
        {"dflash_config.mask_token_id", "248320", -EINVAL, "mask_token_id"},
        {"dflash_config.mask_token_id", NULL, -EINVAL, "dflash_config.mask_token_id"},
        {"num_target_layers", "40", -EINVAL,
         "target_layer_ids[3]: 46 is outside the target's 40 layers"},
        {"dflash_config.target_layer_ids", "[1, 2.5]", -EINVAL, "target_layer_ids[1]"},
        {"tie_word_embeddings", "true", -EINVAL, "tie_word_embeddings"},
        {"rope_scaling", "{\"type\": \"linear\", \"factor\": 2}", -ENOTSUP, "linear"},
        {"head_dim", "\"128\"", -EINVAL, "head_dim: expected an integer"},
        {"dflash_config", NULL, -EINVAL, "dflash_config"},
        {"layer_types", "[\"full_attention\"]", -EINVAL, "layer_types has 1 entries"},
        {"sliding_window", "null", -EINVAL, "sliding_window"},
        {"use_sliding_window", "false", -EINVAL, "layer_types[0] is sliding_attention but use_sliding_window"},
        {"max_position_embeddings", NULL, -EINVAL, "missing required key 'max_position_embeddings'"},
        {"layer_types", NULL, -EINVAL, "max_window_layers"}, /* derivation needs it with a window */
        /* The serving keys (docs/SERVE.md): an older export lacks them; present, they agree. */
        {"hidden_act", NULL, 0, NULL},
        {"attention_bias", NULL, 0, NULL},
        {"torch_dtype", NULL, 0, NULL},
        {"dtype", NULL, 0, NULL},
        {"target_hidden_size", NULL, 0, NULL},
        {"eagle_aux_hidden_state_layer_ids", NULL, 0, NULL},
        {"eagle_aux_hidden_state_layer_ids", "null", 0, NULL},
        {"hidden_act", "\"gelu\"", -EINVAL, "hidden_act"},
        {"attention_bias", "true", -EINVAL, "attention_bias"},
        {"torch_dtype", "\"int8\"", -EINVAL, "torch_dtype"},
        {"dtype", "16", -EINVAL, "dtype"},
        {"target_hidden_size", "4096", -EINVAL, "target_hidden_size 4096 differs"},
        {"eagle_aux_hidden_state_layer_ids", "[1, 16, 31, 46, 61]", -EINVAL,
         "eagle_aux_hidden_state_layer_ids"},
        {"eagle_aux_hidden_state_layer_ids", "[2, 17, 32, 47]", -EINVAL,
         "eagle_aux_hidden_state_layer_ids"},
        {"is_causal", "false", -EINVAL, "is_causal"},
        {"dflash_config.causal", "true", -EINVAL, "dflash_config.causal"},
        {"dflash_config.use_swa", "true", -EINVAL, "dflash_config.use_swa"},
        {"dflash_config.use_swa", "false", 0, NULL},
    };
    for (size_t i = 0; i < sizeof ed / sizeof ed[0]; i++) {
        char *m = edit_json(js, ed[i].path, ed[i].value);
        int rc = df_drafter_config_parse(m, strlen(m), "ed.json", &d2, &e);
        if (!ed[i].code) {
            CHECK_OK(rc, &e);
            CHECK(drafter_equal(&d, &d2));
        } else {
            CHECK_ERR(rc, ed[i].code, &e, ed[i].needle);
            CHECK(strstr(e.msg, "ed.json") != NULL);
        }
        free(m);
    }
    free(js);
}

int main(void)
{
    test_sha256();
    test_target_layers();
    test_qwen3();
    test_qwen3_5();
    test_model_errors();
    test_drafter();
    return test_main_end();
}
