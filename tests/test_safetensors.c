/* Tests of formats/safetensors: writer -> reader round trips (all dtypes, odd
 * shapes, scalar, empty tensor, metadata), sharded checkpoints with an index,
 * every kind of malformed file giving a specific code and a message naming
 * the file, and the real qwen3-code-8m checkpoint when it is present. */
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "fsutil.h"
#include "le.h"
#include "safetensors.h"
#include "test.h"

#define MODEL_8M "/work/shared/models/qwen3-code-8m"

static const char *tmp;
static char pbuf[8][4096];
static int pnext;

/* tmp/name in a small ring of buffers, so a few can be alive at once. */
static const char *P(const char *name)
{
    char *b = pbuf[pnext++ % 8];
    snprintf(b, 4096, "%s/%s", tmp, name);
    return b;
}

static void fill(void *buf, size_t n, uint64_t seed)
{
    uint8_t *p = buf;
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(test_rand(&seed) >> 24);
}

typedef struct spec {
    const char *name;
    df_dtype dtype;
    int ndim;
    int64_t shape[DF_ST_MAX_DIMS];
    uint8_t *data;
    size_t nbytes;
} spec;

static void spec_alloc(spec *s, uint64_t seed)
{
    size_t n = df_dtype_size(s->dtype);
    for (int i = 0; i < s->ndim; i++)
        n *= (size_t)s->shape[i];
    s->nbytes = n;
    s->data = malloc(n ? n : 1);
    fill(s->data, n, seed);
}

static void test_roundtrip(void)
{
    spec t[] = {
        {"model.embed_tokens.weight", DF_DTYPE_BF16, 2, {3, 5}, 0, 0},
        {"f32.vec", DF_DTYPE_F32, 1, {7}, 0, 0},
        {"f16.cube", DF_DTYPE_F16, 3, {2, 3, 4}, 0, 0},
        {"i64", DF_DTYPE_I64, 1, {3}, 0, 0},
        {"i32.eight_dims", DF_DTYPE_I32, 8, {1, 2, 1, 1, 3, 1, 1, 1}, 0, 0},
        {"u8.odd", DF_DTYPE_U8, 1, {13}, 0, 0},
        {"fp8", DF_DTYPE_F8_E4M3, 2, {5, 1}, 0, 0},
        {"scalar", DF_DTYPE_F32, 0, {0}, 0, 0},
        {"empty", DF_DTYPE_BF16, 2, {0, 4}, 0, 0},
        {"we\"ird\\name\x01", DF_DTYPE_BF16, 1, {1}, 0, 0},
    };
    const int n = (int)(sizeof t / sizeof t[0]);
    for (int i = 0; i < n; i++)
        spec_alloc(&t[i], 100 + (uint64_t)i);

    df_err e = {0};
    df_st_writer *w;
    const char *path = P("rt.safetensors");
    CHECK_OK(df_st_writer_open(path, &w, &e), &e);
    for (int i = 0; i < n; i++)
        CHECK_OK(df_st_writer_add(w, t[i].name, t[i].dtype, t[i].ndim, t[i].shape, t[i].data, &e), &e);
    CHECK_OK(df_st_writer_set_metadata(w, "format", "pt", &e), &e);
    CHECK_OK(df_st_writer_set_metadata(w, "note", "old", &e), &e);
    CHECK_OK(df_st_writer_set_metadata(w, "note", "a \"quoted\"\n value", &e), &e);
    /* Writer refusals. */
    CHECK_ERR(df_st_writer_add(w, "i64", DF_DTYPE_I64, 1, t[3].shape, t[3].data, &e), -EEXIST, &e,
              "i64");
    int64_t neg[1] = {-2};
    CHECK_ERR(df_st_writer_add(w, "neg", DF_DTYPE_F32, 1, neg, t[1].data, &e), -EINVAL, &e, "neg");
    CHECK_ERR(df_st_writer_add(w, "__metadata__", DF_DTYPE_F32, 0, NULL, t[1].data, &e), -EINVAL,
              &e, "__metadata__");
    CHECK_ERR(df_st_writer_add(w, "bad", DF_DTYPE_INVALID, 0, NULL, t[1].data, &e), -EINVAL, &e,
              "bad");
    CHECK_OK(df_st_writer_finish(w, &e), &e);
    df_st_writer_free(w);
    CHECK(access(P("rt.safetensors.tmp"), F_OK) != 0);

    /* On-disk shape of the file: header length a multiple of 8. */
    char *raw;
    size_t rawlen;
    CHECK_OK(df_file_read_all(path, 1 << 20, &raw, &rawlen, &e), &e);
    uint64_t hlen = df_le64(raw);
    CHECK_EQ(hlen % 8, 0);
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += t[i].nbytes;
    CHECK_EQ(rawlen, 8 + hlen + total); /* contiguous, no gaps */

    for (int pass = 0; pass < 2; pass++) {
        df_st *st;
        if (pass == 0)
            CHECK_OK(df_st_open(path, &st, &e), &e);
        else
            CHECK_OK(df_st_open_mem(raw, rawlen, "mem", &st, &e), &e);
        if (!st)
            continue;
        CHECK_EQ(df_st_count(st), n);
        CHECK_EQ(df_st_file_count(st), 1);
        for (size_t i = 1; i < df_st_count(st); i++)
            CHECK(strcmp(df_st_at(st, i - 1)->name, df_st_at(st, i)->name) < 0);
        CHECK(df_st_at(st, (size_t)n) == NULL);
        for (int i = 0; i < n; i++) {
            const df_st_tensor *x = df_st_find(st, t[i].name);
            CHECK(x != NULL);
            if (!x)
                continue;
            CHECK_EQ(x->dtype, t[i].dtype);
            CHECK_EQ(x->ndim, t[i].ndim);
            for (int d = 0; d < t[i].ndim; d++)
                CHECK_EQ(x->shape[d], t[i].shape[d]);
            CHECK_EQ(x->nbytes, t[i].nbytes);
            CHECK(memcmp(x->data, t[i].data, t[i].nbytes) == 0);
            CHECK_EQ((uintptr_t)x->data % df_dtype_size(x->dtype), 0);
            CHECK(!strcmp(x->file, pass ? "mem" : path));
            CHECK_OK(df_st_check(x, t[i].dtype, t[i].ndim, t[i].shape, &e), &e);
        }
        const df_st_tensor *sc = df_st_find(st, "scalar");
        CHECK(sc && sc->ndim == 0 && sc->numel == 1 && sc->nbytes == 4);
        const df_st_tensor *em = df_st_find(st, "empty");
        CHECK(em && em->numel == 0 && em->nbytes == 0);
        CHECK(df_st_find(st, "nope") == NULL);
        CHECK(!strcmp(df_st_metadata(st, "format"), "pt"));
        CHECK(!strcmp(df_st_metadata(st, "note"), "a \"quoted\"\n value"));
        CHECK(df_st_metadata(st, "absent") == NULL);
        CHECK_EQ(df_st_metadata_count(st), 2);
        const char *k, *v;
        CHECK_OK(df_st_metadata_at(st, 0, &k, &v), NULL);
        CHECK_EQ(df_st_metadata_at(st, 2, &k, &v), -ERANGE);

        /* Lookups that fail say what and where. */
        const df_st_tensor *x;
        CHECK_ERR(df_st_get(st, "missing.weight", &x, &e), -ENOENT, &e, "missing.weight");
        int64_t want[2] = {3, 6};
        CHECK_ERR(df_st_expect(st, "model.embed_tokens.weight", DF_DTYPE_BF16, 2, want, &x, &e),
                  -DF_EMISMATCH, &e, "model.embed_tokens.weight: shape [3,5], expected [3,6]");
        want[1] = 5;
        CHECK_ERR(df_st_expect(st, "model.embed_tokens.weight", DF_DTYPE_F32, 2, want, &x, &e),
                  -DF_EMISMATCH, &e, "dtype BF16, expected F32");
        CHECK_OK(df_st_expect(st, "model.embed_tokens.weight", DF_DTYPE_INVALID, 2, want, &x, &e),
                 &e);
        CHECK_ERR(df_st_expect(st, "model.embed_tokens.weight", DF_DTYPE_BF16, 1, want, &x, &e),
                  -DF_EMISMATCH, &e, "shape [3,5], expected [3]");
        df_st_close(st);
    }
    free(raw);

    /* An empty checkpoint is valid too. */
    CHECK_OK(df_st_writer_open(P("none.safetensors"), &w, &e), &e);
    CHECK_OK(df_st_writer_finish(w, &e), &e);
    df_st_writer_free(w);
    df_st *st;
    CHECK_OK(df_st_open(P("none.safetensors"), &st, &e), &e);
    if (st) {
        CHECK_EQ(df_st_count(st), 0);
        df_st_close(st);
    }
    /* Writing into a missing folder fails naming the temp file. */
    CHECK_OK(df_st_writer_open(P("no/such/dir/x.safetensors"), &w, &e), &e);
    CHECK_ERR(df_st_writer_finish(w, &e), -ENOENT, &e, "x.safetensors.tmp");
    df_st_writer_free(w);
    /* A FIFO where a file belongs (the file itself, or the writer's temp file): refused
     * by name, never waited on (a plain open of a FIFO blocks until a peer comes). */
    CHECK(mkfifo(P("fifo.safetensors"), 0644) == 0);
    st = NULL;
    CHECK_ERR(df_st_open(P("fifo.safetensors"), &st, &e), -EINVAL, &e, "fifo.safetensors: a FIFO");
    CHECK(mkfifo(P("y.safetensors.tmp"), 0644) == 0);
    CHECK_OK(df_st_writer_open(P("y.safetensors"), &w, &e), &e);
    CHECK_ERR(df_st_writer_finish(w, &e), -EINVAL, &e, "y.safetensors.tmp: a FIFO");
    df_st_writer_free(w);

    for (int i = 0; i < n; i++)
        free(t[i].data);
}

/* Writes one shard with tensors named prefix.{0..n-1}, shape [i+1, 3] F32. */
static void write_shard(const char *path, const char *prefix, int n, uint64_t seed)
{
    df_err e = {0};
    df_st_writer *w;
    CHECK_OK(df_st_writer_open(path, &w, &e), &e);
    float *bufs[8];
    for (int i = 0; i < n; i++) {
        char name[64];
        snprintf(name, sizeof name, "%s.%d", prefix, i);
        int64_t shape[2] = {i + 1, 3};
        bufs[i] = malloc((size_t)(i + 1) * 3 * sizeof(float));
        for (int k = 0; k < (i + 1) * 3; k++)
            bufs[i][k] = test_randn(&seed);
        CHECK_OK(df_st_writer_add(w, name, DF_DTYPE_F32, 2, shape, bufs[i], &e), &e);
    }
    CHECK_OK(df_st_writer_set_metadata(w, "format", "pt", &e), &e);
    CHECK_OK(df_st_writer_finish(w, &e), &e);
    df_st_writer_free(w);
    for (int i = 0; i < n; i++)
        free(bufs[i]);
}

static void write_text(const char *path, const char *s)
{
    df_err e = {0};
    CHECK_OK(df_file_write_atomic(path, s, strlen(s), &e), &e);
}

static void test_sharded(void)
{
    df_err e = {0};
    tmp = test_tmpdir("st_sharded");
    write_shard(P("a-00001.safetensors"), "model.a", 3, 1);
    write_shard(P("b-00002.safetensors"), "model.b", 2, 2);
    write_text(P("model.safetensors.index.json"),
               "{\"metadata\": {\"total_size\": 96}, \"weight_map\": {"
               "\"model.a.0\": \"a-00001.safetensors\", \"model.a.1\": \"a-00001.safetensors\","
               "\"model.a.2\": \"a-00001.safetensors\", \"model.b.0\": \"b-00002.safetensors\","
               "\"model.b.1\": \"b-00002.safetensors\"}}");
    df_st *st;
    for (int pass = 0; pass < 2; pass++) {
        CHECK_OK(df_st_open(pass ? P("model.safetensors.index.json") : tmp, &st, &e), &e);
        if (!st)
            continue;
        CHECK_EQ(df_st_count(st), 5);
        CHECK_EQ(df_st_file_count(st), 2);
        const df_st_tensor *x = df_st_find(st, "model.b.1");
        CHECK(x && strstr(x->file, "b-00002.safetensors"));
        CHECK(x && x->shape[0] == 2 && x->shape[1] == 3 && x->nbytes == 24);
        x = df_st_find(st, "model.a.2");
        CHECK(x && strstr(x->file, "a-00001.safetensors"));
        /* Data from the shard: a re-derivation of what was written. */
        uint64_t seed = 1;
        float want[3 * 3];
        for (int i = 0; i < 3; i++)
            for (int k = 0; k < (i + 1) * 3; k++) {
                float v = test_randn(&seed);
                if (i == 2)
                    want[k] = v;
            }
        CHECK(x && memcmp(x->data, want, sizeof want) == 0);
        CHECK(!strcmp(df_st_metadata(st, "format"), "pt"));
        df_st_close(st);
    }

    /* Index naming a missing shard. */
    write_text(P("model.safetensors.index.json"),
               "{\"weight_map\": {\"model.a.0\": \"a-00001.safetensors\","
               "\"model.c.0\": \"missing-00003.safetensors\"}}");
    CHECK_ERR(df_st_open(tmp, &st, &e), -ENOENT, &e, "missing-00003.safetensors");
    CHECK(strstr(e.msg, "model.safetensors.index.json") != NULL);
    /* Index placing a tensor in the wrong shard, or one no shard holds. */
    write_text(P("model.safetensors.index.json"),
               "{\"weight_map\": {\"model.a.0\": \"b-00002.safetensors\","
               "\"model.b.0\": \"b-00002.safetensors\"}}");
    CHECK_ERR(df_st_open(tmp, &st, &e), -DF_ECORRUPT, &e, "model.a.0");
    write_text(P("model.safetensors.index.json"),
               "{\"weight_map\": {\"model.zzz\": \"a-00001.safetensors\"}}");
    CHECK_ERR(df_st_open(tmp, &st, &e), -DF_ECORRUPT, &e, "model.zzz");
    /* Escaping the folder, no weight_map, empty weight_map, not JSON. */
    write_text(P("model.safetensors.index.json"),
               "{\"weight_map\": {\"model.a.0\": \"../a-00001.safetensors\"}}");
    CHECK_ERR(df_st_open(tmp, &st, &e), -DF_ECORRUPT, &e, "inside the model folder");
    write_text(P("model.safetensors.index.json"), "{\"metadata\": {}}");
    CHECK_ERR(df_st_open(tmp, &st, &e), -DF_ECORRUPT, &e, "weight_map");
    write_text(P("model.safetensors.index.json"), "{\"weight_map\": {}}");
    CHECK_ERR(df_st_open(tmp, &st, &e), -DF_ECORRUPT, &e, "empty");
    write_text(P("model.safetensors.index.json"), "{\"weight_map\": ");
    CHECK_ERR(df_st_open(tmp, &st, &e), -DF_ECORRUPT, &e, "model.safetensors.index.json");

    /* The same tensor in two shards. */
    write_shard(P("dup-00003.safetensors"), "model.a", 1, 3);
    write_text(P("model.safetensors.index.json"),
               "{\"weight_map\": {\"model.a.0\": \"a-00001.safetensors\","
               "\"model.a.1\": \"a-00001.safetensors\", \"model.a.2\": \"a-00001.safetensors\","
               "\"model.x\": \"dup-00003.safetensors\"}}");
    CHECK_ERR(df_st_open(tmp, &st, &e), -DF_ECORRUPT, &e, "'model.a.0' is in two shards");
    CHECK(strstr(e.msg, "dup-00003.safetensors") != NULL);

    /* A corrupt shard: the error names that shard. */
    write_text(P("b-00002.safetensors"), "garbage!garbage!");
    write_text(P("model.safetensors.index.json"),
               "{\"weight_map\": {\"model.a.0\": \"a-00001.safetensors\","
               "\"model.b.0\": \"b-00002.safetensors\"}}");
    CHECK_ERR(df_st_open(tmp, &st, &e), -DF_ECORRUPT, &e, "b-00002.safetensors");

    /* A folder with a single model.safetensors; an empty folder. */
    tmp = test_tmpdir("st_single_dir");
    write_shard(P("model.safetensors"), "w", 2, 4);
    CHECK_OK(df_st_open(tmp, &st, &e), &e);
    if (st) {
        CHECK_EQ(df_st_count(st), 2);
        df_st_close(st);
    }
    tmp = test_tmpdir("st_empty_dir");
    CHECK_ERR(df_st_open(tmp, &st, &e), -ENOENT, &e, "st_empty_dir");
    CHECK_ERR(df_st_open(P("does-not-exist.safetensors"), &st, &e), -ENOENT, &e,
              "does-not-exist.safetensors");
}

/* A file made of a u64 header length, the header text and n data bytes
 * (non-zero pattern). hlen_override != 0 replaces the length field. */
static const char *make_file(const char *name, const char *hdr, size_t ndata, uint64_t hlen_override)
{
    const char *path = P(name);
    size_t hl = strlen(hdr);
    size_t n = 8 + hl + ndata;
    uint8_t *b = malloc(n);
    df_put64(b, hlen_override ? hlen_override : hl);
    memcpy(b + 8, hdr, hl);
    fill(b + 8 + hl, ndata, 7);
    df_err e = {0};
    CHECK_OK(df_file_write_atomic(path, b, n, &e), &e);
    free(b);
    return path;
}

/* Both entry points must refuse the file with code and a message naming the
 * file and containing phrase. */
static void expect_bad(const char *path, int code, const char *phrase)
{
    df_err e = {0};
    df_st *st = (df_st *)1;
    int rc = df_st_open(path, &st, &e);
    CHECK_ERR(rc, code, &e, path);
    CHECK(st == NULL);
    if (phrase && !strstr(e.msg, phrase)) {
        fprintf(stderr, "expect_bad(%s): message lacks \"%s\": %s\n", path, phrase, e.msg);
        df_test_failures++;
    }
    char *raw;
    size_t len;
    if (df_file_read_all(path, 1 << 20, &raw, &len, &e) < 0)
        return;
    rc = df_st_open_mem(raw, len, "memfile", &st, &e);
    CHECK_ERR(rc, code, &e, "memfile");
    free(raw);
}

#define T_F32_2(off0, off1) "{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[" #off0 "," #off1 "]}"

static void test_bad_files(void)
{
    tmp = test_tmpdir("st_bad");
    const char *good_hdr = "{\"a\":" T_F32_2(0, 8) ",\"b\":" T_F32_2(8, 16) "}";
    const char *good = make_file("good.safetensors", good_hdr, 16, 0);
    df_err e = {0};
    df_st *st;
    CHECK_OK(df_st_open(good, &st, &e), &e); /* the base of the mutations is valid */
    if (st)
        df_st_close(st);

    /* Truncations: inside the length field, inside the header, inside the data. */
    char *raw;
    size_t len;
    CHECK_OK(df_file_read_all(good, 1 << 20, &raw, &len, &e), &e);
    CHECK_OK(df_file_write_atomic(P("trunc5.safetensors"), raw, 5, &e), &e);
    expect_bad(P("trunc5.safetensors"), -DF_ECORRUPT, "too short");
    CHECK_OK(df_file_write_atomic(P("trunc_hdr.safetensors"), raw, 20, &e), &e);
    expect_bad(P("trunc_hdr.safetensors"), -DF_ECORRUPT, "runs past the end");
    CHECK_OK(df_file_write_atomic(P("trunc_data.safetensors"), raw, len - 3, &e), &e);
    expect_bad(P("trunc_data.safetensors"), -DF_ECORRUPT, "'b': data_offsets [8,16] outside");
    CHECK_OK(df_file_write_atomic(P("empty.safetensors"), raw, 0, &e), &e);
    expect_bad(P("empty.safetensors"), -DF_ECORRUPT, "too short");
    free(raw);

    expect_bad(make_file("hlen_big.safetensors", good_hdr, 16, 100000), -DF_ECORRUPT,
               "header length 100000");
    expect_bad(make_file("hlen_huge.safetensors", good_hdr, 16, UINT64_MAX), -DF_ECORRUPT,
               "runs past the end");
    /* A header length past the sane limit, in a (sparse) file big enough. */
    {
        const char *p = P("hlen_limit.safetensors");
        int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        uint8_t lb[8];
        df_put64(lb, (uint64_t)DF_ST_MAX_HEADER + 8);
        CHECK(write(fd, lb, 8) == 8);
        CHECK(ftruncate(fd, (off_t)DF_ST_MAX_HEADER + 64) == 0);
        close(fd);
        df_st *s2;
        CHECK_ERR(df_st_open(p, &s2, &e), -DF_ECORRUPT, &e, "limit");
        unlink(p);
    }
    expect_bad(make_file("notjson.safetensors", "{\"a\": nope}", 0, 0), -DF_ECORRUPT,
               "not valid JSON");
    expect_bad(make_file("array.safetensors", "[1,2,3] ", 0, 0), -DF_ECORRUPT, "not an object");
    expect_bad(make_file("garbage.safetensors", "{}  x     ", 0, 0), -DF_ECORRUPT,
               "trailing garbage");
    expect_bad(make_file("range.safetensors", "{\"a\":" T_F32_2(0, 8) ",\"b\":" T_F32_2(8, 1000) "}",
                         16, 0),
               -DF_ECORRUPT, "'b': data_offsets [8,1000] outside the data section");
    expect_bad(make_file("reversed.safetensors", "{\"a\":" T_F32_2(8, 0) "}", 16, 0), -DF_ECORRUPT,
               "'a': data_offsets [8,0]");
    expect_bad(make_file("size.safetensors", "{\"a\":" T_F32_2(0, 4) "}", 16, 0), -DF_ECORRUPT,
               "'a': data_offsets [0,4] hold 4 bytes, but F32 [2] needs 8");
    expect_bad(make_file("overlap.safetensors", "{\"a\":" T_F32_2(0, 8) ",\"b\":" T_F32_2(4, 12) "}",
                         16, 0),
               -DF_ECORRUPT, "overlap");
    expect_bad(make_file("same.safetensors", "{\"a\":" T_F32_2(0, 8) ",\"b\":" T_F32_2(0, 8) "}", 16,
                         0),
               -DF_ECORRUPT, "overlap");
    expect_bad(make_file("dupname.safetensors", "{\"a\":" T_F32_2(0, 8) ",\"a\":" T_F32_2(8, 16) "}",
                         16, 0),
               -DF_ECORRUPT, "'a' appears twice");
    expect_bad(make_file("dtype.safetensors",
                         "{\"a\":{\"dtype\":\"F64\",\"shape\":[1],\"data_offsets\":[0,8]}}", 8, 0),
               -ENOTSUP, "dtype 'F64' is not supported");
    expect_bad(make_file("negdim.safetensors",
                         "{\"a\":{\"dtype\":\"U8\",\"shape\":[-1],\"data_offsets\":[0,0]}}", 8, 0),
               -DF_ECORRUPT, "'a': shape[0]");
    expect_bad(make_file("fracdim.safetensors",
                         "{\"a\":{\"dtype\":\"U8\",\"shape\":[1.5],\"data_offsets\":[0,1]}}", 8, 0),
               -DF_ECORRUPT, "shape[0]");
    expect_bad(make_file("hugedim.safetensors",
                         "{\"a\":{\"dtype\":\"BF16\",\"shape\":[4294967296,4294967296,4294967296],"
                         "\"data_offsets\":[0,8]}}",
                         8, 0),
               -DF_ECORRUPT, "overflows");
    expect_bad(make_file("dims9.safetensors",
                         "{\"a\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],\"data_offsets\":[0,1]}}",
                         8, 0),
               -DF_ECORRUPT, "9 dimensions");
    expect_bad(make_file("noshape.safetensors", "{\"a\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}",
                         8, 0),
               -DF_ECORRUPT, "'a'");
    expect_bad(make_file("offs3.safetensors",
                         "{\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", 8, 0),
               -DF_ECORRUPT, "data_offsets must be two");
    expect_bad(make_file("entry.safetensors", "{\"a\":7}", 8, 0), -DF_ECORRUPT, "'a'");
    expect_bad(make_file("meta.safetensors", "{\"__metadata__\":{\"k\":1}}", 0, 0), -DF_ECORRUPT,
               "__metadata__ key 'k'");
    expect_bad(make_file("meta2.safetensors", "{\"__metadata__\":[]}", 0, 0), -DF_ECORRUPT,
               "__metadata__");

    /* Valid oddities: spaces as padding, an empty tensor sharing an offset,
     * bytes past the last tensor. */
    const char *ok = make_file("odd_ok.safetensors",
                               "{\"e\":{\"dtype\":\"BF16\",\"shape\":[0],\"data_offsets\":[4,4]},"
                               "\"a\":{\"dtype\":\"U8\",\"shape\":[8],\"data_offsets\":[0,8]}}   ",
                               12, 0);
    CHECK_OK(df_st_open(ok, &st, &e), &e);
    if (st) {
        CHECK_EQ(df_st_count(st), 2);
        df_st_close(st);
    }
}

static void test_model_8m(void)
{
    if (access(MODEL_8M "/model.safetensors.index.json", R_OK) != 0) {
        printf("skipping %s (absent)\n", MODEL_8M);
        return;
    }
    df_err e = {0};
    df_st *st;
    CHECK_OK(df_st_open(MODEL_8M, &st, &e), &e);
    if (!st)
        return;
    CHECK_EQ(df_st_count(st), 69);
    CHECK_EQ(df_st_file_count(st), 2);
    const df_st_tensor *t;
    int64_t lm[2] = {4096, 256};
    CHECK_OK(df_st_expect(st, "lm_head.weight", DF_DTYPE_BF16, 2, lm, &t, &e), &e);
    if (t) {
        CHECK(strstr(t->file, "model-00002-of-00002.safetensors") != NULL);
        const uint16_t *h = t->data;
        int nonzero = 0;
        for (size_t i = 0; i < t->numel; i++)
            nonzero += (h[i] & 0x7fff) != 0;
        CHECK(nonzero > 1000);
    }
    CHECK_OK(df_st_expect(st, "model.embed_tokens.weight", DF_DTYPE_BF16, 2, lm, &t, &e), &e);
    int64_t up[2] = {768, 512};
    CHECK_ERR(df_st_expect(st, "model.layers.3.mlp.up_proj.weight", DF_DTYPE_BF16, 2, up, &t, &e),
              -DF_EMISMATCH, &e, "model.layers.3.mlp.up_proj.weight: shape [768,256], expected [768,512]");
    uint64_t total = 0;
    for (size_t i = 0; i < df_st_count(st); i++)
        total += df_st_at(st, i)->nbytes;
    CHECK_EQ(total, 13638912); /* index metadata total_size */
    df_st_close(st);
}

int main(void)
{
    tmp = test_tmpdir("st_roundtrip");
    test_roundtrip();
    test_sharded();
    test_bad_files();
    test_model_8m();
    return test_main_end();
}
