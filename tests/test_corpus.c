/* test_corpus.c - JSONL line parser, .dtok writer/reader, importer, corruption. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "corpus.h"
#include "crc32c.h"
#include "jsonl.h"
#include "le.h"
#include "sha256.h"
#include "test.h"

static const char *TMP;

static char *path_of(const char *name)
{
    static char buf[8][1024];
    static int k;
    char *p = buf[k++ % 8];
    snprintf(p, 1024, "%s/%s", TMP, name);
    return p;
}

static void write_file(const char *path, const void *data, size_t n)
{
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(data, 1, n, f) != n) {
        fprintf(stderr, "cannot write %s\n", path);
        exit(2);
    }
    fclose(f);
}

static uint8_t *read_file(const char *path, size_t *n)
{
    FILE *f = fopen(path, "rb");
    if (!f)
        return NULL;
    fseek(f, 0, SEEK_END);
    *n = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *b = malloc(*n ? *n : 1);
    if (fread(b, 1, *n, f) != *n)
        exit(2);
    fclose(f);
    return b;
}

static int file_exists(const char *p)
{
    struct stat st;
    return stat(p, &st) == 0;
}

/* ------------------------------------------------------------ a test corpus */

typedef struct {
    size_t n;
    uint64_t *len;
    uint32_t **ids;
    uint8_t **mask; /* NULL entries: no mask */
} docs_t;

static void docs_free(docs_t *d)
{
    for (size_t i = 0; i < d->n; i++) {
        free(d->ids[i]);
        free(d->mask[i]);
    }
    free(d->len);
    free(d->ids);
    free(d->mask);
}

/* Random documents: lengths in [min_len, max_len], ids below id_max (full u32
 * range when id_max = 0, biased to the top so values near 2^32-1 appear). */
static docs_t docs_random(uint64_t seed, size_t n, uint64_t min_len, uint64_t max_len,
                          uint64_t id_max, int mask_mode /* 0 none, 1 random, 2 mixed */)
{
    docs_t d = {n, calloc(n, 8), calloc(n, sizeof(uint32_t *)), calloc(n, sizeof(uint8_t *))};
    uint64_t s = seed;
    for (size_t i = 0; i < n; i++) {
        uint64_t l = min_len + test_rand(&s) % (max_len - min_len + 1);
        d.len[i] = l;
        d.ids[i] = malloc(l * 4 + 4);
        for (uint64_t t = 0; t < l; t++) {
            uint64_t r = test_rand(&s);
            uint32_t v = id_max ? (uint32_t)(r % id_max)
                         : (r & 1) ? 0xFFFFFFFFu - (uint32_t)((r >> 8) % 1000)
                                   : (uint32_t)(r >> 32);
            d.ids[i][t] = v;
        }
        if (mask_mode == 1 || (mask_mode == 2 && (test_rand(&s) & 1))) {
            d.mask[i] = malloc(l + 1);
            uint64_t prompt = l ? test_rand(&s) % l : 0; /* prompt zeros, completion ones */
            for (uint64_t t = 0; t < l; t++)
                d.mask[i][t] = t >= prompt;
        }
    }
    return d;
}

static int write_dtok(const char *path, const docs_t *d, df_err *e)
{
    df_corpus_writer *w;
    int rc = df_corpus_writer_open(path, &w, e);
    if (rc < 0)
        return rc;
    for (size_t i = 0; i < d->n; i++)
        if ((rc = df_corpus_writer_add(w, d->ids[i], d->mask[i], d->len[i], e)) < 0) {
            df_corpus_writer_abort(w);
            return rc;
        }
    return df_corpus_writer_finish(w, NULL, e);
}

/* JSONL text of d (empty docs kept; style varies with the doc index). */
static char *docs_jsonl(const docs_t *d, size_t *n_out)
{
    size_t cap = 1 << 16, n = 0;
    char *s = malloc(cap);
    for (size_t i = 0; i < d->n; i++) {
        size_t need = n + d->len[i] * 16 + 256;
        if (need > cap) {
            while (cap < need)
                cap *= 2;
            s = realloc(s, cap);
        }
        int style = (int)(i % 4);
        if (style == 1 && d->mask[i]) { /* mask first, booleans, spaces */
            n += (size_t)sprintf(s + n, "{ \"loss_mask\" : [ ");
            for (uint64_t t = 0; t < d->len[i]; t++)
                n += (size_t)sprintf(s + n, "%s%s", t ? " , " : "", d->mask[i][t] ? "true" : "false");
            n += (size_t)sprintf(s + n, " ] , \"meta\": {\"src\": \"x\\\"y\", \"n\": [1.5e3, null]}, \"input_ids\" : [ ");
            for (uint64_t t = 0; t < d->len[i]; t++)
                n += (size_t)sprintf(s + n, "%s%u", t ? " , " : "", d->ids[i][t]);
            n += (size_t)sprintf(s + n, " ] }");
        } else {
            n += (size_t)sprintf(s + n, "{\"input_ids\":[");
            for (uint64_t t = 0; t < d->len[i]; t++)
                n += (size_t)sprintf(s + n, "%s%u", t ? "," : "", d->ids[i][t]);
            n += (size_t)sprintf(s + n, "]");
            if (d->mask[i]) {
                n += (size_t)sprintf(s + n, ",\"loss_mask\":[");
                for (uint64_t t = 0; t < d->len[i]; t++)
                    n += (size_t)sprintf(s + n, "%s%u", t ? "," : "", d->mask[i][t]);
                n += (size_t)sprintf(s + n, "]");
            } else if (style == 2) {
                n += (size_t)sprintf(s + n, ",\"loss_mask\":null");
            }
            n += (size_t)sprintf(s + n, "}");
        }
        n += (size_t)sprintf(s + n, style == 3 ? "\r\n" : "\n");
    }
    *n_out = n;
    return s;
}

/* c must hold exactly the docs of d with non-zero length when skip_empty. */
static void check_docs(const df_corpus *c, const docs_t *d, int skip_empty)
{
    uint64_t j = 0;
    for (size_t i = 0; i < d->n; i++) {
        if (skip_empty && d->len[i] == 0)
            continue;
        const uint32_t *ids;
        const uint8_t *mask;
        uint64_t len;
        int rc = df_corpus_doc(c, j, &ids, &mask, &len);
        CHECK_EQ(rc, 0);
        if (rc < 0)
            return;
        CHECK_EQ(len, d->len[i]);
        if (len != d->len[i])
            return;
        CHECK(len == 0 || memcmp(ids, d->ids[i], len * 4) == 0);
        for (uint64_t t = 0; t < len; t++) {
            uint8_t want = d->mask[i] ? d->mask[i][t] : 1;
            uint8_t got = mask ? mask[t] : 1;
            if (want != got) {
                CHECK_EQ(got, want);
                break;
            }
        }
        j++;
    }
    CHECK_EQ(df_corpus_n_docs(c), j);
}

/* --------------------------------------------------------------- JSONL */

static int parse(const char *s, uint64_t limit, df_jsonl_doc *d, df_err *e)
{
    return df_jsonl_parse_line(s, strlen(s), "f.jsonl", 7, limit, d, e);
}

static void test_jsonl_ok(void)
{
    df_jsonl_doc d;
    df_jsonl_doc_init(&d);
    df_err e = {0};
    struct {
        const char *line;
        size_t len;
        int has_mask;
        uint32_t ids[4];
        uint8_t mask[4];
    } cases[] = {
        {"{\"input_ids\":[5,17,4242]}", 3, 0, {5, 17, 4242}, {0}},
        {"  {  \"input_ids\" :\t[ 5 ,17,\t4242 ] }  \r", 3, 0, {5, 17, 4242}, {0}},
        {"{\"loss_mask\":[0,1,1],\"input_ids\":[9,8,7]}", 3, 1, {9, 8, 7}, {0, 1, 1}},
        {"{\"input_ids\":[9,8,7],\"loss_mask\":[false,true,true]}", 3, 1, {9, 8, 7}, {0, 1, 1}},
        {"{\"input_ids\":[9,8],\"loss_mask\":null}", 2, 0, {9, 8}, {0}},
        {"{\"id\":\"a\\\"b\\\\c\\u00e9\",\"input_ids\":[4294967295, 0],\"x\":{\"a\":[1,{\"b\":[]}],\"c\":-1.5e-3},"
         "\"y\":true,\"z\":null,\"w\":[]}",
         2, 0, {4294967295u, 0}, {0}},
        {"{\"input\\u005fids\":[3]}", 1, 0, {3}, {0}},
        {"{\"input_ids\":[]}", 0, 0, {0}, {0}},
        {"{\"input_ids\":[],\"loss_mask\":[]}", 0, 1, {0}, {0}},
        {"{\"input_ids\":[123456789],\"loss_mask\":[1],\"text\":\"caf\xc3\xa9 \\n\\t\\/\"}", 1, 1,
         {123456789}, {1}},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        int rc = parse(cases[k].line, 0, &d, &e);
        CHECK_OK(rc, &e);
        if (rc != 0) {
            fprintf(stderr, "  line: %s\n", cases[k].line);
            continue;
        }
        CHECK_EQ(d.len, cases[k].len);
        CHECK_EQ(d.has_mask, cases[k].has_mask);
        for (size_t i = 0; i < d.len && i < 4; i++) {
            CHECK_EQ(d.ids[i], cases[k].ids[i]);
            if (d.has_mask)
                CHECK_EQ(d.mask[i], cases[k].mask[i]);
        }
    }
    /* blank lines */
    CHECK_EQ(parse("", 0, &d, &e), 1);
    CHECK_EQ(parse(" \t\r", 0, &d, &e), 1);
    /* the line need not be NUL-terminated: parse a prefix of a longer buffer */
    const char *two = "{\"input_ids\":[1,2]}{\"junk\"";
    CHECK_EQ(df_jsonl_parse_line(two, 19, "f", 1, 0, &d, &e), 0);
    CHECK_EQ(d.len, 2);
    /* vocab limit: ids below pass */
    CHECK_EQ(parse("{\"input_ids\":[9,0]}", 10, &d, &e), 0);
    df_jsonl_doc_free(&d);
}

static void test_jsonl_errors(void)
{
    df_jsonl_doc d;
    df_jsonl_doc_init(&d);
    struct {
        const char *line;
        int code;
        const char *needle;
    } cases[] = {
        {"{\"input_ids\":[1,-2]}", -DF_ECORRUPT, "f.jsonl:7:17: input_ids[1]: negative"},
        {"{\"input_ids\":[1.5]}", -DF_ECORRUPT, "input_ids[0]: not an integer"},
        {"{\"input_ids\":[1,2e3]}", -DF_ECORRUPT, "input_ids[1]: not an integer"},
        {"{\"input_ids\":[4294967296]}", -DF_ECORRUPT, "32 bits"},
        {"{\"input_ids\":[99999999999999999999999]}", -DF_ECORRUPT, "32 bits"},
        {"{\"input_ids\":[01]}", -DF_ECORRUPT, "leading zero"},
        {"{\"input_ids\":[\"5\"]}", -DF_ECORRUPT, "input_ids[0]: not an integer"},
        {"{\"input_ids\":[1,]}", -DF_ECORRUPT, "input_ids[1]: token id expected"},
        {"{\"input_ids\":[1 2]}", -DF_ECORRUPT, "',' or ']' expected"},
        {"{\"input_ids\":[1,2]", -DF_ECORRUPT, "',' or '}' expected, found end of line"},
        {"{\"input_ids\":[1,2", -DF_ECORRUPT, "f.jsonl:7:"},
        {"{\"input_ids\":null}", -DF_ECORRUPT, "input_ids: array expected"},
        {"{\"input_ids\":[1,2],\"loss_mask\":[1,2]}", -DF_ECORRUPT, "loss_mask[1]: only 0, 1"},
        {"{\"input_ids\":[1,2],\"loss_mask\":[1,0.0]}", -DF_ECORRUPT, "loss_mask[1]"},
        {"{\"input_ids\":[1,2],\"loss_mask\":[1]}", -DF_ECORRUPT,
         "loss_mask has 1 values but input_ids has 2"},
        {"{\"input_ids\":[1,2],\"loss_mask\":\"11\"}", -DF_ECORRUPT, "loss_mask: array"},
        {"{\"input_ids\":[1],\"input_ids\":[1]}", -DF_ECORRUPT, "f.jsonl:7:18: duplicate key input_ids"},
        {"{\"loss_mask\":[1],\"input_ids\":[1],\"loss_mask\":[1]}", -DF_ECORRUPT, "duplicate key loss_mask"},
        {"{\"loss_mask\":[1]}", -DF_ECORRUPT, "missing key input_ids"},
        {"{}", -DF_ECORRUPT, "missing key input_ids"},
        {"[1,2,3]", -DF_ECORRUPT, "f.jsonl:7:1: '{' expected"},
        {"{\"input_ids\":[1]} x", -DF_ECORRUPT, "f.jsonl:7:19: unexpected 'x'"},
        {"{\"input_ids\":[1]}{\"input_ids\":[1]}", -DF_ECORRUPT, "unexpected"},
        {"{\"input_ids\":[1],}", -DF_ECORRUPT, "object key"},
        {"{input_ids:[1]}", -DF_ECORRUPT, "object key"},
        {"{\"input_ids\" [1]}", -DF_ECORRUPT, "':' expected"},
        {"{\"a\":tru,\"input_ids\":[1]}", -DF_ECORRUPT, "bad literal"},
        {"{\"a\":\"x\\q\",\"input_ids\":[1]}", -DF_ECORRUPT, "bad escape"},
        {"{\"a\":\"x\\u12G4\",\"input_ids\":[1]}", -DF_ECORRUPT, "\\u escape"},
        {"{\"a\":\"x\ty\",\"input_ids\":[1]}", -DF_ECORRUPT, "control character"},
        {"{\"a\":\"xy,\"input_ids\":[1]}", -DF_ECORRUPT, "f.jsonl:7:"},
        {"{\"a\":01,\"input_ids\":[1]}", -DF_ECORRUPT, "',' or '}' expected"},
        {"{\"a\":1.,\"input_ids\":[1]}", -DF_ECORRUPT, "malformed number"},
        {"{\"a\":-,\"input_ids\":[1]}", -DF_ECORRUPT, "malformed number"},
        {"{\"a\":[1,2,,\"input_ids\":[1]}", -DF_ECORRUPT, "value expected"},
        {"{\"a\":{\"b\" 1},\"input_ids\":[1]}", -DF_ECORRUPT, "':' expected"},
        {"{\"input_ids\":[1],\"a\":}", -DF_ECORRUPT, "value expected"},
        {"{\"input_ids\":[1]\x01}", -DF_ECORRUPT, "byte 0x01"},
        {"{\"input_ids\":[1],\"loss_mask\":[truex]}", -DF_ECORRUPT, "loss_mask: ',' or ']'"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        df_err e = {0};
        int rc = parse(cases[k].line, 0, &d, &e);
        CHECK_ERR(rc, cases[k].code, &e, cases[k].needle);
        if (rc != cases[k].code || !strstr(e.msg, cases[k].needle))
            fprintf(stderr, "  (case %zu: %s)\n", k, cases[k].line);
    }
    /* the vocabulary limit, named with position and value */
    df_err e = {0};
    CHECK_ERR(parse("{\"input_ids\":[3, 10]}", 10, &d, &e), -DF_EMISMATCH,
              &e, "f.jsonl:7:18: input_ids[1]: id 10 >= vocab size 10");
    /* nesting of skipped values is bounded */
    char deep[400];
    int n = sprintf(deep, "{\"a\":");
    for (int i = 0; i < 100; i++)
        deep[n++] = '[';
    for (int i = 0; i < 100; i++)
        deep[n++] = ']';
    sprintf(deep + n, ",\"input_ids\":[1]}");
    CHECK_ERR(parse(deep, 0, &d, &e), -DF_ECORRUPT, &e, "nesting deeper");
    n = sprintf(deep, "{\"a\":");
    for (int i = 0; i < 60; i++)
        deep[n++] = '[';
    for (int i = 0; i < 60; i++)
        deep[n++] = ']';
    sprintf(deep + n, ",\"input_ids\":[1]}");
    CHECK_EQ(parse(deep, 0, &d, &e), 0);
    /* a NUL byte inside the line is not whitespace */
    const char nul[] = "{\"input_ids\":[1]}\0";
    CHECK_ERR(df_jsonl_parse_line(nul, sizeof nul - 1, "f", 2, 0, &d, &e), -DF_ECORRUPT, &e,
              "f:2:18: unexpected byte 0x00");
    df_jsonl_doc_free(&d);
}

static void test_jsonl_reader(void)
{
    const char *text = "{\"input_ids\":[1]}\r\n\n   \n{\"input_ids\":[2,3]}\n{\"input_ids\":[4]}";
    df_err e = {0};
    df_jsonl_reader *r;
    CHECK_OK(df_jsonl_reader_open_mem(text, strlen(text), "m.jsonl", NULL, &r, &e), &e);
    const char *line;
    size_t len;
    uint64_t ln;
    uint64_t want_ln[] = {1, 2, 3, 4, 5};
    size_t want_len[] = {18, 0, 3, 19, 17};
    int k = 0;
    int rc;
    while ((rc = df_jsonl_reader_next(r, &line, &len, &ln, &e)) > 0 && k < 5) {
        CHECK_EQ(ln, want_ln[k]);
        CHECK_EQ(len, want_len[k]);
        k++;
    }
    CHECK_EQ(rc, 0);
    CHECK_EQ(k, 5);
    CHECK_EQ(df_jsonl_reader_bytes(r), strlen(text));
    df_jsonl_reader_close(r);

    /* a file whose one line (~9 MB) is longer than the reader's first buffer */
    uint64_t s = 77;
    size_t n_tok = 1000003, cap = n_tok * 12 + 64, n = 0;
    char *big = malloc(cap);
    uint32_t *ids = malloc(n_tok * 4);
    n += (size_t)sprintf(big, "{\"input_ids\": [");
    for (size_t i = 0; i < n_tok; i++) {
        ids[i] = (uint32_t)(test_rand(&s) % 100000000u);
        n += (size_t)sprintf(big + n, "%s%u", i ? "," : "", ids[i]);
    }
    n += (size_t)sprintf(big + n, "]}\n{\"input_ids\":[8]}\n");
    const char *p = path_of("big.jsonl");
    write_file(p, big, n);
    CHECK_OK(df_jsonl_reader_open(p, NULL, &r, &e), &e);
    df_jsonl_doc d;
    df_jsonl_doc_init(&d);
    CHECK_EQ(df_jsonl_reader_next(r, &line, &len, &ln, &e), 1);
    CHECK_EQ(df_jsonl_parse_line(line, len, p, ln, 0, &d, &e), 0);
    CHECK_EQ(d.len, n_tok);
    CHECK(d.len == n_tok && memcmp(d.ids, ids, n_tok * 4) == 0);
    CHECK_EQ(df_jsonl_reader_next(r, &line, &len, &ln, &e), 1);
    CHECK_EQ(ln, 2);
    CHECK_EQ(df_jsonl_reader_next(r, &line, &len, &ln, &e), 0);
    df_jsonl_reader_close(r);
    df_jsonl_doc_free(&d);
    free(big);
    free(ids);

    CHECK_ERR(df_jsonl_reader_open(path_of("nope.jsonl"), NULL, &r, &e), -ENOENT, &e, "nope.jsonl");
}

/* ------------------------------------------------------------- .dtok */

static void roundtrip(const char *name, docs_t *d)
{
    df_err e = {0};
    const char *p = path_of(name);
    CHECK_OK(write_dtok(p, d, &e), &e);
    char tmpname[1100];
    snprintf(tmpname, sizeof tmpname, "%s.tmp", p);
    CHECK(!file_exists(tmpname));
    df_corpus *c;
    int rc = df_corpus_open(p, NULL, &c, &e);
    CHECK_OK(rc, &e);
    if (rc < 0)
        return;
    check_docs(c, d, 0);
    df_corpus_stats st;
    df_corpus_stats_get(c, &st);
    uint64_t tok = 0, loss = 0, mx = 0, ml = 0, empty = 0;
    for (size_t i = 0; i < d->n; i++) {
        tok += d->len[i];
        ml = d->len[i] > ml ? d->len[i] : ml;
        empty += d->len[i] == 0;
        for (uint64_t t = 0; t < d->len[i]; t++) {
            loss += d->mask[i] ? d->mask[i][t] : 1;
            mx = d->ids[i][t] > mx ? d->ids[i][t] : mx;
        }
    }
    CHECK_EQ(st.format, DF_CORPUS_DTOK);
    CHECK_EQ(st.n_docs, d->n);
    CHECK_EQ(st.n_tokens, tok);
    CHECK_EQ(st.n_loss_tokens, loss);
    CHECK_EQ(st.max_id, mx);
    CHECK_EQ(st.max_doc_len, ml);
    CHECK_EQ(st.n_empty_docs, empty);
    CHECK_EQ(st.has_mask, loss != tok);
    uint8_t fp[32];
    df_corpus_fingerprint_compute(c, fp);
    CHECK(memcmp(fp, st.content_sha256, 32) == 0);
    const uint32_t *ids;
    const uint8_t *mask;
    uint64_t len;
    CHECK_EQ(df_corpus_doc(c, d->n, &ids, &mask, &len), -EINVAL);
    /* size: header + tokens + (mask) + offsets, nothing else */
    size_t fsz;
    uint8_t *img = read_file(p, &fsz);
    size_t want = 256 + ((tok * 4 + 7) & ~7ull) + (loss != tok ? ((tok + 7) & ~7ull) : 0) +
                  8 * (d->n + 1);
    CHECK_EQ(fsz, want);
    /* the same bytes from memory, at an odd address (copied to align) */
    uint8_t *odd = malloc(fsz + 1);
    memcpy(odd + 1, img, fsz);
    df_corpus *c2;
    rc = df_corpus_open_mem(odd + 1, fsz, name, NULL, &c2, &e);
    CHECK_OK(rc, &e);
    if (rc >= 0) {
        check_docs(c2, d, 0);
        df_corpus_close(c2);
    }
    free(odd);
    free(img);
    df_corpus_close(c);
}

static void test_roundtrips(void)
{
    /* random, full u32 range (values near 2^32-1), mixed masks, empties */
    docs_t d = docs_random(1, 3001, 0, 97, 0, 2);
    roundtrip("rand.dtok", &d);
    /* the JSONL form of the same documents gives the same corpus and fingerprint
     * once empties are gone (the JSONL opener skips them) */
    docs_t ne = docs_random(2, 777, 1, 300, 0, 2);
    roundtrip("ne.dtok", &ne);
    size_t jn;
    char *j = docs_jsonl(&ne, &jn);
    write_file(path_of("ne.jsonl"), j, jn);
    df_err e = {0};
    df_corpus *a, *b;
    CHECK_OK(df_corpus_open(path_of("ne.jsonl"), NULL, &a, &e), &e);
    CHECK_OK(df_corpus_open(path_of("ne.dtok"), NULL, &b, &e), &e);
    if (a && b) {
        check_docs(a, &ne, 1);
        char fa[65], fb[65];
        df_corpus_fingerprint(a, fa);
        df_corpus_fingerprint(b, fb);
        CHECK(!strcmp(fa, fb));
        CHECK_EQ(df_corpus_doc_line(a, 5), 6);
        CHECK_EQ(df_corpus_doc_line(b, 5), 0);
        df_corpus_close(a);
        df_corpus_close(b);
    }
    free(j);
    docs_free(&ne);
    docs_free(&d);

    /* structured / odd sizes */
    d = docs_random(3, 0, 1, 1, 0, 0); /* no documents at all */
    roundtrip("zero.dtok", &d);
    docs_free(&d);
    d = docs_random(4, 1, 1, 1, 50000, 0); /* one document of one token */
    roundtrip("one.dtok", &d);
    docs_free(&d);
    d = docs_random(5, 5000, 1, 1, 151936, 1); /* many 1-token docs, masks 0/1 */
    roundtrip("ones.dtok", &d);
    docs_free(&d);
    d = docs_random(6, 7, 0, 0, 0, 0); /* only empty documents */
    roundtrip("empties.dtok", &d);
    docs_free(&d);
    d = docs_random(7, 13, 1000, 5001, 0, 0); /* long docs, no mask: no mask section */
    roundtrip("nomask.dtok", &d);
    docs_free(&d);
    d = docs_random(8, 33, 1, 9, 17, 1); /* odd token counts -> padding */
    roundtrip("odd.dtok", &d);

    /* an explicit all-ones mask is the same corpus as no mask */
    docs_t d1 = docs_random(8, 33, 1, 9, 17, 0);
    for (size_t i = 0; i < d1.n; i++) {
        d1.mask[i] = malloc(d1.len[i]);
        memset(d1.mask[i], 1, d1.len[i]);
    }
    CHECK_OK(write_dtok(path_of("ones1.dtok"), &d1, &e), &e);
    for (size_t i = 0; i < d1.n; i++) {
        free(d1.mask[i]);
        d1.mask[i] = NULL;
    }
    CHECK_OK(write_dtok(path_of("ones2.dtok"), &d1, &e), &e);
    size_t n1, n2;
    uint8_t *i1 = read_file(path_of("ones1.dtok"), &n1), *i2 = read_file(path_of("ones2.dtok"), &n2);
    CHECK(n1 == n2 && memcmp(i1, i2, n1) == 0);
    free(i1);
    free(i2);
    docs_free(&d1);

    /* the writer rejects mask values other than 0/1 and leaves nothing behind */
    df_corpus_writer *w;
    CHECK_OK(df_corpus_writer_open(path_of("bad.dtok"), &w, &e), &e);
    uint8_t badmask[9] = {0, 1, 1, 2, 1, 1, 1, 1, 1};
    CHECK_ERR(df_corpus_writer_add(w, d.ids[0], badmask, d.len[0] < 9 ? d.len[0] : 9, &e),
              d.len[0] >= 4 ? -EINVAL : 0, &e, "loss mask value 2 at token 3");
    df_corpus_writer_abort(w);
    CHECK(!file_exists(path_of("bad.dtok")));
    CHECK(!file_exists(path_of("bad.dtok.tmp")));
    docs_free(&d);
}

/* ------------------------------------------------------- corrupt .dtok */

/* Recomputes every CRC of a .dtok image from its own header fields (to make
 * a file that lies consistently, so the structural checks are what trips). */
static void refix(uint8_t *b, size_t n)
{
    uint64_t n_docs = df_le64(b + 24), n_tok = df_le64(b + 32);
    uint64_t mask_off = df_le64(b + 80), offs_off = df_le64(b + 88);
    int has_mask = df_le32(b + 16) & 1;
    if (256 + n_tok * 4 <= n)
        df_put32(b + 104, df_crc32c(0, b + 256, n_tok * 4));
    if (has_mask && mask_off + n_tok <= n)
        df_put32(b + 108, df_crc32c(0, b + mask_off, n_tok));
    if (offs_off + 8 * (n_docs + 1) <= n)
        df_put32(b + 112, df_crc32c(0, b + offs_off, 8 * (n_docs + 1)));
    df_put32(b + 252, df_crc32c(0, b, 252));
}

static int open_img(const uint8_t *img, size_t n, const df_corpus_opts *o, df_err *e)
{
    const char *p = path_of("c.dtok");
    write_file(p, img, n);
    df_corpus *c = NULL;
    int rc = df_corpus_open(p, o, &c, e);
    df_corpus_close(c);
    return rc;
}

static void test_corrupt(void)
{
    docs_t d = docs_random(11, 9, 0, 7, 1000, 1);
    d.len[0] = 5; /* make doc 0 non-empty, the rest random */
    df_err e = {0};
    const char *good = path_of("good.dtok");
    CHECK_OK(write_dtok(good, &d, &e), &e);
    size_t n;
    uint8_t *img = read_file(good, &n), *b = malloc(n);
    CHECK_OK(open_img(img, n, NULL, &e), &e);
    CHECK_EQ(df_le32(img + 16) & 1, 1); /* has a mask section */

    /* truncation anywhere */
    size_t cuts[] = {0, 7, 100, 255, 256, n / 2, n - 8, n - 1};
    for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
        int rc = open_img(img, cuts[k], NULL, &e);
        CHECK_ERR(rc, -DF_ECORRUPT, &e, "c.dtok: ");
        CHECK(strstr(e.msg, "truncated") != NULL);
    }
    /* trailing bytes */
    memcpy(b, img, n);
    uint8_t *longer = malloc(n + 8);
    memcpy(longer, img, n);
    memset(longer + n, 0x5a, 8);
    CHECK_ERR(open_img(longer, n + 8, NULL, &e), -DF_ECORRUPT, &e, "trailing bytes");
    free(longer);

    /* every single flipped bit pattern in every byte is caught, by a CRC or a check */
    int missed = 0;
    for (size_t i = 0; i < n; i++) {
        memcpy(b, img, n);
        b[i] ^= (uint8_t)(1u << (i % 8));
        df_corpus *c = NULL;
        int rc = df_corpus_open_mem(b, n, "flip.dtok", NULL, &c, &e);
        if (rc >= 0) {
            missed++;
            df_corpus_close(c);
        } else if (!strstr(e.msg, "flip.dtok")) {
            CHECK(strstr(e.msg, "flip.dtok") != NULL);
        }
        /* without CRCs the structural checks still keep access safe */
        df_corpus_opts nocrc = {.skip_crc = 1};
        if (df_corpus_open_mem(b, n, "flip.dtok", &nocrc, &c, &e) >= 0) {
            for (uint64_t j = 0; j < df_corpus_n_docs(c); j++) {
                const uint32_t *ids;
                const uint8_t *mask;
                uint64_t len;
                df_corpus_doc(c, j, &ids, &mask, &len);
                volatile uint32_t sink = 0;
                for (uint64_t t = 0; t < len; t++)
                    sink += ids[t] + (mask ? mask[t] : 1);
                (void)sink;
            }
            df_corpus_close(c);
        }
    }
    CHECK_EQ(missed, 0);
    /* a data byte flip names the section */
    memcpy(b, img, n);
    b[256 + 5] ^= 0x40;
    CHECK_ERR(open_img(b, n, NULL, &e), -DF_ECORRUPT, &e, "tokens section (bytes 256-");
    CHECK(strstr(e.msg, "checksum mismatch") != NULL);

    /* wrong magic: named as such, also under a .dtok name */
    memcpy(b, img, n);
    b[0] = 'X';
    CHECK_ERR(open_img(b, n, NULL, &e), -DF_ECORRUPT, &e, "c.dtok: not a .dtok file (bad magic");
    /* wrong version (CRC made right): DF_EVERSION */
    memcpy(b, img, n);
    df_put32(b + 8, 2);
    refix(b, n);
    CHECK_ERR(open_img(b, n, NULL, &e), -DF_EVERSION, &e, "c.dtok: .dtok version 2");
    /* lying counts, CRCs made right so the structure checks must catch them */
    memcpy(b, img, n);
    df_put64(b + 24, df_le64(b + 24) + 1); /* n_docs */
    refix(b, n);
    CHECK_ERR(open_img(b, n, NULL, &e), -DF_ECORRUPT, &e, "disagrees with the counts");
    memcpy(b, img, n);
    df_put64(b + 24, 1ull << 60);
    refix(b, n);
    CHECK_ERR(open_img(b, n, NULL, &e), -DF_ECORRUPT, &e, "do not fit");
    memcpy(b, img, n);
    df_put64(b + 32, df_le64(b + 32) - 2); /* n_tokens, and the layout fields to match */
    {
        uint64_t nt = df_le64(b + 32), nd = df_le64(b + 24);
        uint64_t mo = 256 + ((nt * 4 + 7) & ~7ull), oo = mo + ((nt + 7) & ~7ull);
        df_put64(b + 80, mo);
        df_put64(b + 88, oo);
        df_put64(b + 96, oo + 8 * (nd + 1));
    }
    refix(b, n);
    CHECK_ERR(open_img(b, n, NULL, &e), -DF_ECORRUPT, &e, "c.dtok: ");
    /* offsets: not monotone (doc 1 ends before it starts) */
    uint64_t oo = df_le64(img + 88);
    memcpy(b, img, n);
    CHECK(df_le64(img + oo + 16) < df_le64(img + 32)); /* docs after doc 1 hold tokens */
    df_put64(b + oo + 8, df_le64(img + oo + 16) + 1);
    refix(b, n);
    CHECK_ERR(open_img(b, n, NULL, &e), -DF_ECORRUPT, &e, "c.dtok: doc 1: end offset");
    CHECK(strstr(e.msg, "before its start") != NULL);
    /* offsets: past the end */
    memcpy(b, img, n);
    df_put64(b + oo + 8, df_le64(img + 32) + 5);
    refix(b, n);
    CHECK_ERR(open_img(b, n, NULL, &e), -DF_ECORRUPT, &e, "past the last token");
    /* first offset not 0 */
    memcpy(b, img, n);
    df_put64(b + oo, 1);
    refix(b, n);
    CHECK_ERR(open_img(b, n, NULL, &e), -DF_ECORRUPT, &e, "first offset 1");
    /* max id lies */
    memcpy(b, img, n);
    df_put32(b + 20, df_le32(img + 20) + 1);
    refix(b, n);
    CHECK_ERR(open_img(b, n, NULL, &e), -DF_ECORRUPT, &e, "max id");
    /* loss count lies */
    memcpy(b, img, n);
    df_put64(b + 40, df_le64(img + 40) - 1);
    refix(b, n);
    CHECK_ERR(open_img(b, n, NULL, &e), -DF_ECORRUPT, &e, "loss-token count");
    /* a mask byte that is not 0/1 (doc 0, token 2) */
    memcpy(b, img, n);
    b[df_le64(img + 80) + 2] = 7;
    refix(b, n);
    CHECK_ERR(open_img(b, n, NULL, &e), -DF_ECORRUPT, &e, "doc 0: loss mask value 7 at token 2");
    /* unknown flags, reserved bytes, padding */
    memcpy(b, img, n);
    df_put32(b + 16, df_le32(img + 16) | 0x80);
    refix(b, n);
    CHECK_ERR(open_img(b, n, NULL, &e), -DF_ECORRUPT, &e, "unknown flags");
    memcpy(b, img, n);
    b[200] = 1;
    refix(b, n);
    CHECK_ERR(open_img(b, n, NULL, &e), -DF_ECORRUPT, &e, "reserved header byte 200");
    uint64_t nt = df_le64(img + 32);
    if ((nt * 4) % 8) {
        memcpy(b, img, n);
        b[256 + nt * 4] = 1;
        refix(b, n);
        CHECK_ERR(open_img(b, n, NULL, &e), -DF_ECORRUPT, &e, "padding byte");
    }

    /* opts: vocab and max_len name the document and the token */
    uint64_t bad_doc = 0, bad_tok = 0, mx = 0;
    for (size_t i = 0; i < d.n; i++)
        for (uint64_t t = 0; t < d.len[i]; t++)
            if (d.ids[i][t] > mx) {
                mx = d.ids[i][t];
                bad_doc = i;
                bad_tok = t;
            }
    df_corpus_opts o = {.vocab = mx};
    char needle[128];
    /* first offending token: the first one equal to mx */
    for (size_t i = 0, found = 0; i < d.n && !found; i++)
        for (uint64_t t = 0; t < d.len[i]; t++)
            if (d.ids[i][t] >= mx) {
                bad_doc = i;
                bad_tok = t;
                found = 1;
                break;
            }
    snprintf(needle, sizeof needle, "c.dtok: doc %llu: token %llu = %llu >= vocab size %llu",
             (unsigned long long)bad_doc, (unsigned long long)bad_tok, (unsigned long long)mx,
             (unsigned long long)mx);
    CHECK_ERR(open_img(img, n, &o, &e), -DF_EMISMATCH, &e, needle);
    o.vocab = mx + 1;
    CHECK_OK(open_img(img, n, &o, &e), &e);
    o = (df_corpus_opts){.max_len = 4};
    CHECK_ERR(open_img(img, n, &o, &e), -E2BIG, &e, "c.dtok: doc 0: 5 tokens, more than max_len 4");
    free(b);
    free(img);
    docs_free(&d);
}

/* -------------------------------------------------------------- import */

static void test_import(void)
{
    df_err e = {0};
    /* CRLF, blank lines, empty docs, extra keys, a last line without newline */
    const char *a =
        "{\"input_ids\": [11, 12, 13], \"loss_mask\": [0, 1, 1]}\r\n"
        "\n"
        "{\"input_ids\": []}\n"
        "{\"meta\": {\"k\": [1, 2]}, \"input_ids\": [21], \"loss_mask\": [true]}\n"
        "   \t\n"
        "{\"input_ids\": [], \"loss_mask\": []}\n"
        "{\"input_ids\": [31, 32]}";
    const char *bsrc = "{\"input_ids\": [41, 42, 43, 44], \"loss_mask\": [1, 0, 1, 0]}\n";
    write_file(path_of("a.jsonl"), a, strlen(a));
    write_file(path_of("b.jsonl"), bsrc, strlen(bsrc));
    const char *in[] = {path_of("a.jsonl"), path_of("b.jsonl")};
    const char *out = path_of("ab.dtok");
    df_corpus_stats st;
    int rc = df_corpus_import(in, 2, out, NULL, &st, &e);
    CHECK_OK(rc, &e);
    CHECK_EQ(st.n_docs, 4);
    CHECK_EQ(st.n_tokens, 10);
    CHECK_EQ(st.n_loss_tokens, 7);
    CHECK_EQ(st.n_empty_skipped, 2);
    CHECK_EQ(st.empty_lines[0], 3);
    CHECK_EQ(st.empty_lines[1], 6);
    CHECK_EQ(st.n_blank_lines, 2);
    CHECK_EQ(st.max_id, 44);
    CHECK_EQ(st.bytes_in, strlen(a) + strlen(bsrc));
    CHECK_EQ(st.has_source_sha, 1);
    df_corpus *c;
    CHECK_OK(df_corpus_open(out, NULL, &c, &e), &e);
    if (c) {
        df_corpus_stats s2;
        df_corpus_stats_get(c, &s2);
        CHECK_EQ(s2.n_empty_skipped, 2);
        CHECK_EQ(s2.n_empty_docs, 0);
        CHECK(memcmp(s2.content_sha256, st.content_sha256, 32) == 0);
        CHECK(memcmp(s2.source_sha256, st.source_sha256, 32) == 0);
        const uint32_t *ids;
        const uint8_t *mask;
        uint64_t len;
        CHECK_EQ(df_corpus_doc(c, 3, &ids, &mask, &len), 0);
        CHECK_EQ(len, 4);
        CHECK_EQ(ids[3], 44);
        CHECK(mask && mask[0] == 1 && mask[1] == 0);
        CHECK_EQ(df_corpus_doc(c, 2, &ids, &mask, &len), 0);
        CHECK(len == 2 && ids[1] == 32 && mask && mask[0] == 1 && mask[1] == 1);
        df_corpus_close(c);
    }
    /* the JSONL opener sees the same corpus */
    CHECK_OK(df_corpus_open(path_of("a.jsonl"), NULL, &c, &e), &e);
    if (c) {
        df_corpus_stats s3;
        df_corpus_stats_get(c, &s3);
        CHECK_EQ(s3.format, DF_CORPUS_JSONL);
        CHECK_EQ(s3.n_docs, 3);
        CHECK_EQ(s3.n_empty_skipped, 2);
        CHECK_EQ(df_corpus_doc_line(c, 2), 7);
        df_corpus_close(c);
    }
    /* source fingerprint = SHA-256 of the input bytes in order */
    {
        size_t la = strlen(a), lb = strlen(bsrc);
        char *cat = malloc(la + lb);
        memcpy(cat, a, la);
        memcpy(cat + lb * 0 + la, bsrc, lb);
        uint8_t want[32];
        df_sha256(cat, la + lb, want);
        CHECK(memcmp(want, st.source_sha256, 32) == 0);
        free(cat);
    }

    /* strict empties, vocab, max_len, malformed: errors name file:line and doc;
     * no output and no temporary file is left */
    const char *bad = path_of("bad.dtok");
    df_corpus_opts o = {.strict_empty = 1};
    CHECK_ERR(df_corpus_import(in, 2, bad, &o, NULL, &e), -DF_ECORRUPT, &e, "a.jsonl:3: empty document");
    CHECK(strstr(e.msg, "[doc 1]") != NULL);
    o = (df_corpus_opts){.vocab = 44};
    CHECK_ERR(df_corpus_import(in, 2, bad, &o, NULL, &e), -DF_EMISMATCH, &e,
              "b.jsonl:1:28: input_ids[3]: id 44 >= vocab size 44 [doc 3]");
    o = (df_corpus_opts){.max_len = 3};
    CHECK_ERR(df_corpus_import(in, 2, bad, &o, NULL, &e), -E2BIG, &e,
              "b.jsonl:1: document has 4 tokens, more than max_len 3 [doc 3]");
    write_file(path_of("m.jsonl"), "{\"input_ids\":[1]}\n{\"input_ids\":[1,2],\"loss_mask\":[1]}\n", 55);
    const char *in2[] = {path_of("m.jsonl")};
    CHECK_ERR(df_corpus_import(in2, 1, bad, NULL, NULL, &e), -DF_ECORRUPT, &e,
              "m.jsonl:2:20: loss_mask has 1 values but input_ids has 2 [doc 1]");
    CHECK_ERR(df_corpus_open(path_of("m.jsonl"), NULL, &c, &e), -DF_ECORRUPT, &e, "m.jsonl:2:");
    write_file(path_of("g.jsonl"), "{\"input_ids\":[1]}\n\x89PNG garbage\n", 30);
    in2[0] = path_of("g.jsonl");
    CHECK_ERR(df_corpus_import(in2, 1, bad, NULL, NULL, &e), -DF_ECORRUPT, &e,
              "g.jsonl:2:1: '{' expected");
    in2[0] = path_of("missing.jsonl");
    CHECK_ERR(df_corpus_import(in2, 1, bad, NULL, NULL, &e), -ENOENT, &e, "missing.jsonl");
    CHECK(!file_exists(bad));
    CHECK(!file_exists(path_of("bad.dtok.tmp")));
    /* opts on the JSONL opener too */
    o = (df_corpus_opts){.vocab = 30};
    CHECK_ERR(df_corpus_open(path_of("a.jsonl"), &o, &c, &e), -DF_EMISMATCH, &e,
              "a.jsonl:7:16: input_ids[0]: id 31 >= vocab size 30 [doc 2]");
    /* and an import into a missing directory fails cleanly */
    CHECK_ERR(df_corpus_import(in, 2, path_of("no/such/dir.dtok"), NULL, NULL, &e), -ENOENT, &e,
              "dir.dtok.tmp");
}

int main(void)
{
    TMP = strdup(test_tmpdir("corpus"));
    test_jsonl_ok();
    test_jsonl_errors();
    test_jsonl_reader();
    test_roundtrips();
    test_corrupt();
    test_import();
    free((void *)TMP);
    return test_main_end();
}
