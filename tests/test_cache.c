/* test_cache - the hidden-state cache end to end: writer pipeline (both I/O
 * backends, every codec), reader, layer subsets, shard rotation, empty
 * samples, resume after a SIGKILL and after a torn tail, and corrupt files
 * giving clear errors that name the file and the sample. */
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cache.h"
#include "cache_writer.h"
#include "test.h"

#define HID 96
#define NL 3
#define NS 40

typedef struct sample_data {
    uint32_t n;
    uint32_t *ids;
    uint8_t *mask;
    uint16_t *layers[NL];
} sample_data;

static sample_data S[NS];

/* Sample i: length varies (0, 1, odd, several blocks); values like hidden
 * states: per-channel scale, a big channel, per-token noise. */
static void make_samples(void)
{
    uint64_t rng = 42;
    for (int i = 0; i < NS; i++) {
        uint32_t n = i == 3 ? 0 : i == 4 ? 1 : (uint32_t)(5 + test_rand(&rng) % 60);
        S[i].n = n;
        S[i].ids = malloc((n + 1) * 4);
        S[i].mask = i % 5 == 2 ? NULL : malloc(n + 1);
        for (uint32_t t = 0; t < n; t++) {
            S[i].ids[t] = (uint32_t)(test_rand(&rng) % 151936);
            if (S[i].mask)
                S[i].mask[t] = t > n / 3;
        }
        for (int l = 0; l < NL; l++) {
            S[i].layers[l] = malloc((size_t)(n + 1) * HID * 2);
            for (uint32_t t = 0; t < n; t++)
                for (int c = 0; c < HID; c++) {
                    float scale = (c == 7 ? 40.0f : 1.0f) * (0.2f + 0.05f * (float)(c % 13));
                    S[i].layers[l][(size_t)t * HID + c] =
                        df_f32_to_bf16(scale * test_randn(&rng) * (1.0f + (float)l));
                }
        }
    }
}

static void make_params(df_cache_params *p, int codec)
{
    memset(p, 0, sizeof *p);
    strcpy(p->model_type, "qwen3");
    strcpy(p->target_name, "test-target");
    strcpy(p->config_sha256, "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef");
    strcpy(p->corpus_fingerprint, "feedface");
    p->hidden_size = HID;
    p->num_target_layers = 8;
    p->vocab_size = 151936;
    p->n_layers = NL;
    p->layer_ids[0] = 1;
    p->layer_ids[1] = 3;
    p->layer_ids[2] = 5;
    p->dtype = DF_DTYPE_BF16;
    p->codec = codec;
    p->rows_per_block = 16;      /* several blocks per layer */
    p->shard_bytes = 96 * 1024;  /* several shards */
    p->corpus_docs = NS;
}

static int put_range(df_cache_writer *w, int from, int to)
{
    for (int i = from; i < to; i++) {
        if (df_cache_writer_has(w, (uint64_t)i * 3))
            continue;
        const void *layers[NL] = {S[i].layers[0], S[i].layers[1], S[i].layers[2]};
        df_cache_sample s = {.id = (uint64_t)i * 3, .n_tokens = S[i].n, .ids = S[i].ids,
                             .loss_mask = S[i].mask, .layers = layers};
        df_err e = {0};
        int rc = df_cache_writer_put(w, &s, &e);
        CHECK_OK(rc, &e);
        if (rc)
            return rc;
    }
    return 0;
}

static int write_cache(const char *dir, int codec, int fallback)
{
    df_cache_params p;
    make_params(&p, codec);
    df_cache_writer_opts o = {.threads = 3, .force_fallback_io = fallback,
                              .max_inflight_bytes = 64 * 1024};
    df_err e = {0};
    df_cache_writer *w = df_cache_writer_open(dir, &p, &o, &e);
    CHECK_OK(w ? 0 : e.code, &e);
    if (!w)
        return -1;
    put_range(w, 0, NS);
    int rc = df_cache_writer_close(w, &e);
    CHECK_OK(rc, &e);
    return rc;
}

/* Largest |x| of the 32-element block (of its row) that element x is in. */
static float block_absmax(const uint16_t *layer, size_t x)
{
    size_t row = x / HID * HID, k0 = row + (x % HID) / 32 * 32, k1 = k0 + 32 < row + HID ? k0 + 32 : row + HID;
    float m = 0;
    for (size_t k = k0; k < k1; k++) {
        float v = df_bf16_to_f32(layer[k]);
        m = v > m ? v : -v > m ? -v : m;
    }
    return m;
}

/* Reads every sample back and compares (exactly for lossless codecs; for a
 * lossy codec, id in `lossy`, within its error bound). */
static void check_cache(const char *dir, int lossy)
{
    df_err e = {0};
    df_cache *c = df_cache_open(dir, &e);
    CHECK_OK(c ? 0 : e.code, &e);
    if (!c)
        return;
    CHECK_EQ(df_cache_count(c), NS);
    const df_cache_info *in = df_cache_get_info(c);
    CHECK(in->n_shards > 1);
    uint64_t toks = 0;
    for (int i = 0; i < NS; i++)
        toks += S[i].n;
    CHECK_EQ(in->tokens, toks);
    df_pool *pool = df_pool_open(3);
    uint32_t ids[128];
    uint8_t mask[128];
    static uint16_t out[NL][128 * HID];
    for (int i = 0; i < NS; i++) {
        int64_t k = df_cache_find(c, (uint64_t)i * 3);
        CHECK_EQ(k, i);
        if (k < 0)
            continue;
        memset(out, 0xA5, sizeof out); /* poison */
        df_cache_out o = {.ids = ids, .loss_mask = mask, .layers = {out[0], out[1], out[2]}};
        int rc = df_cache_read(c, (size_t)k, ~0ull, &o, pool, &e);
        CHECK_OK(rc, &e);
        CHECK(memcmp(ids, S[i].ids, S[i].n * 4) == 0);
        for (uint32_t t = 0; t < S[i].n; t++)
            CHECK_EQ(mask[t], S[i].mask ? S[i].mask[t] : 1);
        for (int l = 0; l < NL; l++) {
            if (!lossy) {
                CHECK(memcmp(out[l], S[i].layers[l], (size_t)S[i].n * HID * 2) == 0);
                continue;
            }
            for (size_t x = 0; x < (size_t)S[i].n * HID; x++) {
                float a = df_bf16_to_f32(S[i].layers[l][x]), b = df_bf16_to_f32(out[l][x]);
                float tol = 0.07f * (a < 0 ? -a : a) + 0.02f * (float)(1 + l) * 40.0f / 16;
                if (lossy >= DF_CODEC_INT4_B32) { /* half a step of the block's scale */
                    int bits = lossy == DF_CODEC_INT3_B32   ? 3
                             : lossy == DF_CODEC_INT2_B32   ? 2
                                                            : lossy - DF_CODEC_INT4_B32 + 4;
                    int qmax = (1 << (bits - 1)) - 1;
                    tol = block_absmax(S[i].layers[l], x) / (2.0f * (float)qmax) * 1.01f +
                          (b < 0 ? -b : b) / 256;
                }
                if ((a - b > tol || b - a > tol) && df_test_failures < 5) {
                    fprintf(stderr, "lossy sample %d layer %d [%zu]: %g vs %g\n", i, l, x, a, b);
                    df_test_failures++;
                }
            }
        }
    }
    /* A layer subset reads only those layers and leaves the others alone. */
    memset(out, 0x5A, sizeof out);
    df_cache_out o = {.ids = NULL, .loss_mask = NULL, .layers = {NULL, out[1], NULL}};
    CHECK_OK(df_cache_read(c, 10, 1u << 1, &o, NULL, &e), &e);
    if (!lossy)
        CHECK(memcmp(out[1], S[10].layers[1], (size_t)S[10].n * HID * 2) == 0);
    CHECK(out[0][0] == 0x5A5A && out[2][0] == 0x5A5A);
    uint64_t bad = 99;
    CHECK_OK(df_cache_verify(c, pool, NULL, NULL, &bad, &e), &e);
    CHECK_EQ(bad, 0);
    df_pool_close(pool);
    df_cache_close(c);
}

static void test_round_trips(void)
{
    char dir[4096];
    for (int codec = 0; codec < DF_CODEC_COUNT; codec++)
        for (int fb = 0; fb < 2; fb++) {
            snprintf(dir, sizeof dir, "%s/c%d-%d", test_tmpdir("cache-rt"), codec, fb);
            if (write_cache(dir, codec, fb) == 0)
                check_cache(dir, df_codec_is_lossy(codec) ? codec : 0);
        }
}

static void read_file(const char *path, uint8_t **buf, size_t *len)
{
    FILE *f = fopen(path, "rb");
    fseek(f, 0, SEEK_END);
    *len = (size_t)ftell(f);
    fseek(f, 0, SEEK_SET);
    *buf = malloc(*len + 1);
    if (fread(*buf, 1, *len, f) != *len)
        abort();
    fclose(f);
}

static void flip_byte(const char *path, long off)
{
    int fd = open(path, O_RDWR);
    unsigned char b;
    if (pread(fd, &b, 1, off) != 1)
        abort();
    b ^= 0x10;
    if (pwrite(fd, &b, 1, off) != 1)
        abort();
    close(fd);
}

/* Every sample of two caches is identical, and so is its place on disk. */
static void check_same(const char *a, const char *b)
{
    df_err e = {0};
    df_cache *x = df_cache_open(a, &e), *y = df_cache_open(b, &e);
    CHECK_OK(x && y ? 0 : e.code, &e);
    if (x && y) {
        CHECK_EQ(df_cache_count(x), df_cache_count(y));
        for (size_t k = 0; k < df_cache_count(x) && k < df_cache_count(y); k++) {
            const df_cache_entry *s = df_cache_entry_at(x, k), *t = df_cache_entry_at(y, k);
            CHECK(s->id == t->id && s->offset == t->offset && s->shard == t->shard &&
                  s->record_bytes == t->record_bytes && s->header_crc == t->header_crc);
        }
        CHECK_EQ(df_cache_get_info(x)->stored_bytes, df_cache_get_info(y)->stored_bytes);
    }
    df_cache_close(x);
    df_cache_close(y);
}

static void test_resume(void)
{
    const char *base = test_tmpdir("cache-resume");
    char ref[4096], dir[4096], dir2[4096];
    snprintf(ref, sizeof ref, "%s/ref", base);
    snprintf(dir, sizeof dir, "%s/killed", base);
    snprintf(dir2, sizeof dir2, "%s/torn", base);
    write_cache(ref, DF_CODEC_SPLIT_ZSTD, 0);

    /* A child writes part of the cache and is killed with writes in flight. */
    pid_t pid = fork();
    if (pid == 0) {
        df_cache_params p;
        make_params(&p, DF_CODEC_SPLIT_ZSTD);
        df_cache_writer_opts o = {.threads = 2};
        df_err e;
        df_cache_writer *w = df_cache_writer_open(dir, &p, &o, &e);
        if (!w)
            _exit(3);
        put_range(w, 0, 27);
        usleep(200 * 1000);
        kill(getpid(), SIGKILL);
        _exit(4);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL);

    /* Unfinished: the reader refuses it and says why. */
    df_err e = {0};
    df_cache *c = df_cache_open(dir, &e);
    CHECK(c == NULL);
    CHECK_ERR(e.code, -ENOENT, &e, "unfinished");

    df_cache_params p;
    make_params(&p, DF_CODEC_SPLIT_ZSTD);
    df_cache_writer_opts o = {.threads = 2};
    df_cache_writer *w = df_cache_writer_open(dir, &p, &o, &e);
    CHECK_OK(w ? 0 : e.code, &e);
    if (w) { /* a second writer of the same rank is refused while this one lives */
        df_cache_params p2;
        make_params(&p2, DF_CODEC_SPLIT_ZSTD);
        df_err e2 = {0};
        df_cache_writer *w2 = df_cache_writer_open(dir, &p2, &o, &e2);
        CHECK(w2 == NULL);
        CHECK_ERR(e2.code, -EBUSY, &e2, "another process is writing rank 0");
        if (w2)
            df_cache_writer_abandon(w2);
    }
    if (w) {
        int have = 0;
        for (int i = 0; i < NS; i++)
            have += df_cache_writer_has(w, (uint64_t)i * 3);
        CHECK(have > 0 && have <= 27);
        for (int i = 0; i < have; i++) /* a prefix */
            CHECK(df_cache_writer_has(w, (uint64_t)i * 3));
        df_cache_writer_stats st;
        df_cache_writer_get_stats(w, &st);
        CHECK_EQ(st.resumed_samples, have);
        put_range(w, 0, NS);
        CHECK_OK(df_cache_writer_close(w, &e), &e);
        check_same(ref, dir);
        check_cache(dir, 0);
    }

    /* A torn tail: the partial shard ends inside a record. */
    make_params(&p, DF_CODEC_SPLIT_ZSTD);
    w = df_cache_writer_open(dir2, &p, &o, &e);
    CHECK_OK(w ? 0 : e.code, &e);
    put_range(w, 0, 20);
    CHECK_OK(df_cache_writer_flush(w, &e), &e);
    df_cache_writer_abandon(w);
    char part[4200] = "";
    struct stat st;
    for (int seq = 0; seq < 50 && !part[0]; seq++) {
        snprintf(part, sizeof part, "%s/shard-r0000-%05d.dfc.partial", dir2, seq);
        if (stat(part, &st) != 0)
            part[0] = 0;
    }
    CHECK(part[0] != 0);
    CHECK(truncate(part, st.st_size - 3000) == 0); /* cut into the last record */
    w = df_cache_writer_open(dir2, &p, &o, &e);
    CHECK_OK(w ? 0 : e.code, &e);
    if (w) {
        CHECK(!df_cache_writer_has(w, 19 * 3));
        CHECK(df_cache_writer_has(w, 0));
        put_range(w, 0, NS);
        CHECK_OK(df_cache_writer_close(w, &e), &e);
        check_same(ref, dir2);
    }

    /* Resuming with other parameters is refused, naming the difference. */
    char dir3[4096];
    snprintf(dir3, sizeof dir3, "%s/mismatch", base);
    make_params(&p, DF_CODEC_SPLIT_ZSTD);
    w = df_cache_writer_open(dir3, &p, &o, &e);
    put_range(w, 0, 3);
    df_cache_writer_abandon(w);
    make_params(&p, DF_CODEC_LZ4);
    w = df_cache_writer_open(dir3, &p, &o, &e);
    CHECK(w == NULL);
    CHECK_ERR(e.code, -DF_EMISMATCH, &e, "codec");
    make_params(&p, DF_CODEC_SPLIT_ZSTD);
    p.layer_ids[2] = 6;
    w = df_cache_writer_open(dir3, &p, &o, &e);
    CHECK(w == NULL);
    CHECK_ERR(e.code, -DF_EMISMATCH, &e, "layers");

    /* A finished cache is not reopened for writing. */
    make_params(&p, DF_CODEC_SPLIT_ZSTD);
    w = df_cache_writer_open(ref, &p, &o, &e);
    CHECK(w == NULL);
    CHECK_ERR(e.code, -EEXIST, &e, "complete");
}

static void test_bad_input(void)
{
    const char *base = test_tmpdir("cache-bad");
    char ref[4096], cmd[8400], dir[4096], path[4400];
    snprintf(ref, sizeof ref, "%s/ref", base);
    write_cache(ref, DF_CODEC_SPLIT_ZSTD, 0);
    df_err e = {0};

    /* Ids must increase within a rank. */
    df_cache_params p;
    make_params(&p, DF_CODEC_STORED);
    snprintf(dir, sizeof dir, "%s/order", base);
    df_cache_writer_opts o = {.threads = 1};
    df_cache_writer *w = df_cache_writer_open(dir, &p, &o, &e);
    const void *layers[NL] = {S[5].layers[0], S[5].layers[1], S[5].layers[2]};
    df_cache_sample s = {.id = 10, .n_tokens = S[5].n, .ids = S[5].ids, .layers = layers};
    CHECK_OK(df_cache_writer_put(w, &s, &e), &e);
    CHECK_ERR(df_cache_writer_put(w, &s, &e), -EINVAL, &e, "increase");
    df_cache_writer_abandon(w);

#define FRESH(name)                                                                  \
    snprintf(dir, sizeof dir, "%s/%s", base, name);                                  \
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s'", dir, ref, dir);      \
    CHECK(system(cmd) == 0)

    /* A flipped bit in a block: reading that sample fails naming shard and
     * sample; verify counts exactly one bad sample; others still read. */
    FRESH("flip-block");
    df_cache *c = df_cache_open(dir, &e);
    CHECK_OK(c ? 0 : e.code, &e);
    const df_cache_entry *t = df_cache_entry_at(c, 7);
    snprintf(path, sizeof path, "%s", df_cache_shard_path(c, t->shard));
    long off = (long)(t->offset + t->record_bytes - 4096 - 200);
    while (off > (long)t->offset + 1024) { /* a byte inside a block, not padding */
        uint8_t *buf; size_t len;
        read_file(path, &buf, &len);
        int nz = buf[off] != 0;
        free(buf);
        if (nz) break;
        off -= 64;
    }
    df_cache_close(c);
    flip_byte(path, off);
    c = df_cache_open(dir, &e);
    CHECK_OK(c ? 0 : e.code, &e);
    if (c) {
        static uint16_t out[NL][128 * HID];
        df_cache_out o2 = {.layers = {out[0], out[1], out[2]}};
        char want[64];
        snprintf(want, sizeof want, "sample %d", 7 * 3);
        CHECK_ERR(df_cache_read(c, 7, ~0ull, &o2, NULL, &e), -DF_ECORRUPT, &e, want);
        CHECK(strstr(e.msg, "shard-r0000-") != NULL);
        CHECK_OK(df_cache_read(c, 8, ~0ull, &o2, NULL, &e), &e);
        uint64_t bad = 0;
        CHECK_ERR(df_cache_verify(c, NULL, NULL, NULL, &bad, &e), -DF_ECORRUPT, &e, "CRC");
        CHECK_EQ(bad, 1);
        df_cache_close(c);
    }

    /* A flipped bit in a record header, in the tokens. */
    FRESH("flip-header");
    c = df_cache_open(dir, &e);
    t = df_cache_entry_at(c, 5);
    snprintf(path, sizeof path, "%s", df_cache_shard_path(c, t->shard));
    uint64_t toff = t->offset;
    df_cache_close(c);
    flip_byte(path, (long)toff + 24); /* n_tokens */
    c = df_cache_open(dir, &e);
    uint64_t bad = 0;
    CHECK_ERR(df_cache_verify(c, NULL, NULL, NULL, &bad, &e), -DF_ECORRUPT, &e, "header CRC");
    CHECK(strstr(e.msg, path) != NULL);
    df_cache_close(c);

    /* A truncated shard: open fails naming it and both sizes. */
    FRESH("truncated");
    snprintf(path, sizeof path, "%s/shard-r0000-00000.dfc", dir);
    struct stat st;
    stat(path, &st);
    CHECK(truncate(path, st.st_size - 4096) == 0);
    CHECK(df_cache_open(dir, &e) == NULL);
    CHECK_ERR(e.code, -DF_ECORRUPT, &e, "shard-r0000-00000.dfc");

    /* A flipped index entry. */
    FRESH("flip-index");
    snprintf(path, sizeof path, "%s/shard-r0000-00001.dfi", dir);
    flip_byte(path, 64 + 48 + 9);
    CHECK(df_cache_open(dir, &e) == NULL);
    CHECK_ERR(e.code, -DF_ECORRUPT, &e, "shard-r0000-00001.dfi");

    /* Wrong shard magic. */
    FRESH("magic");
    snprintf(path, sizeof path, "%s/shard-r0000-00001.dfc", dir);
    flip_byte(path, 0);
    CHECK(df_cache_open(dir, &e) == NULL);
    CHECK_ERR(e.code, -DF_ECORRUPT, &e, "magic");

    /* A future version in the manifest is refused clearly. */
    FRESH("version");
    snprintf(cmd, sizeof cmd, "sed -i 's/\"version\":\\t1,/\"version\":\\t3,/' '%s/manifest.json'", dir);
    CHECK(system(cmd) == 0);
    CHECK(df_cache_open(dir, &e) == NULL);
    CHECK_ERR(e.code, -DF_EVERSION, &e, "version 3");

    /* Version 2 is a projected cache: one without its "projection" object is refused. */
    FRESH("version2");
    snprintf(cmd, sizeof cmd, "sed -i 's/\"version\":\\t1,/\"version\":\\t2,/' '%s/manifest.json'", dir);
    CHECK(system(cmd) == 0);
    CHECK(df_cache_open(dir, &e) == NULL);
    CHECK_ERR(e.code, -DF_ECORRUPT, &e, "without a \"projection\"");

    /* A codec this reader does not know (as int3-b32 is to one from before it):
     * refused at open, naming it. */
    FRESH("codec");
    snprintf(cmd, sizeof cmd, "sed -i 's/\"split-zstd\"/\"int9-b32\"/' '%s/meta.json' '%s/manifest.json'",
             dir, dir);
    CHECK(system(cmd) == 0);
    CHECK(df_cache_open(dir, &e) == NULL);
    CHECK_ERR(e.code, -DF_ECORRUPT, &e, "unknown codec \"int9-b32\"");

    /* A manifest that lies about a shard's size. */
    FRESH("lying");
    snprintf(cmd, sizeof cmd, "sed -i '0,/\"samples\":/s/\"samples\":\\t\\([0-9]*\\)/\"samples\":\\t99\\1/' '%s/manifest.json'", dir);
    CHECK(system(cmd) == 0);
    CHECK(df_cache_open(dir, &e) == NULL);
    CHECK_ERR(e.code, -DF_ECORRUPT, &e, "manifest");

    /* Not a cache at all. */
    CHECK(df_cache_open(base, &e) == NULL);
    CHECK_ERR(e.code, -ENOENT, &e, "not a dflash cache");
}

/* Ranks that finish at once all try to write the manifest (extraction on 4
 * GPUs failed so on an H200 machine): every one must succeed, and the cache
 * must open. */
#define NFIN 8
static pthread_barrier_t fin_bar;
static const char *fin_dir;
static int fin_rc[NFIN];

static void *fin_main(void *arg)
{
    int i = (int)(intptr_t)arg;
    df_err e = {0};
    pthread_barrier_wait(&fin_bar);
    fin_rc[i] = df_cache_finalize(fin_dir, &e);
    if (fin_rc[i])
        fprintf(stderr, "finalize %d: %s\n", i, e.msg);
    return NULL;
}

static void test_finalize_race(void)
{
    const char *base = test_tmpdir("cache-finalize");
    char dir[4096], man[4200];
    snprintf(dir, sizeof dir, "%s/c", base);
    snprintf(man, sizeof man, "%s/manifest.json", dir);
    const int W = 4;
    for (int r = 0; r < W; r++) {
        df_cache_params p;
        make_params(&p, DF_CODEC_LZ4);
        p.world_size = (uint32_t)W;
        df_cache_writer_opts o = {.threads = 1, .rank = (uint32_t)r};
        df_err e = {0};
        df_cache_writer *w = df_cache_writer_open(dir, &p, &o, &e);
        CHECK_OK(w ? 0 : e.code, &e);
        if (!w)
            return;
        put_range(w, r * NS / W, (r + 1) * NS / W);
        CHECK_OK(df_cache_writer_close(w, &e), &e);
    }
    CHECK(access(man, F_OK) == 0); /* the last writer wrote it */
    fin_dir = dir;
    for (int round = 0; round < 20; round++) {
        CHECK(unlink(man) == 0);
        pthread_t th[NFIN];
        pthread_barrier_init(&fin_bar, NULL, NFIN);
        for (int i = 0; i < NFIN; i++)
            pthread_create(&th[i], NULL, fin_main, (void *)(intptr_t)i);
        for (int i = 0; i < NFIN; i++)
            pthread_join(th[i], NULL);
        pthread_barrier_destroy(&fin_bar);
        for (int i = 0; i < NFIN; i++)
            CHECK_EQ(fin_rc[i], 0);
    }
    df_err e = {0};
    df_cache *c = df_cache_open(dir, &e);
    CHECK_OK(c ? 0 : e.code, &e);
    if (c) {
        CHECK_EQ(df_cache_count(c), NS);
        df_cache_close(c);
    }
}

int main(void)
{
    make_samples();
    test_round_trips();
    test_resume();
    test_bad_input();
    test_finalize_race();
    return test_main_end();
}
