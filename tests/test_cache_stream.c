/* test_cache_stream - the streaming reader: every sample in the requested
 * order (sequential, a per-epoch shuffle, a subset with repeats), layer
 * subsets, caller-owned slots, tiny prefetch budgets, both I/O backends,
 * holding several samples at once, and a corrupt block reported in order. */
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache.h"
#include "cache_stream.h"
#include "cache_writer.h"
#include "test.h"

#define HID 80
#define NL 2
#define NS 64

static uint32_t lens[NS];
static uint16_t *layer_data[NS][NL];
static uint32_t *ids_data[NS];

static void make_cache(const char *dir)
{
    df_cache_params p = {0};
    strcpy(p.model_type, "qwen3");
    strcpy(p.config_sha256, "ab");
    strcpy(p.corpus_fingerprint, "cd");
    p.hidden_size = HID;
    p.num_target_layers = 4;
    p.vocab_size = 1000;
    p.n_layers = NL;
    p.layer_ids[0] = 0;
    p.layer_ids[1] = 2;
    p.dtype = DF_DTYPE_BF16;
    p.codec = DF_CODEC_SPLIT_ZSTD;
    p.rows_per_block = 24;
    p.shard_bytes = 128 * 1024;
    df_cache_writer_opts o = {.threads = 2};
    df_err e = {0};
    df_cache_writer *w = df_cache_writer_open(dir, &p, &o, &e);
    CHECK_OK(w ? 0 : e.code, &e);
    if (!w)
        exit(1);
    uint64_t rng = 7;
    for (int i = 0; i < NS; i++) {
        uint32_t n = i % 17 == 5 ? 0 : (uint32_t)(1 + test_rand(&rng) % 90);
        lens[i] = n;
        ids_data[i] = malloc((n + 1) * 4);
        for (uint32_t t = 0; t < n; t++)
            ids_data[i][t] = (uint32_t)(test_rand(&rng) % 1000);
        const void *ly[NL];
        for (int l = 0; l < NL; l++) {
            layer_data[i][l] = malloc(((size_t)n + 1) * HID * 2);
            for (size_t x = 0; x < (size_t)n * HID; x++)
                layer_data[i][l][x] = df_f32_to_bf16(test_randn(&rng) * (float)(1 + x % 7));
            ly[l] = layer_data[i][l];
        }
        df_cache_sample s = {.id = (uint64_t)i, .n_tokens = n, .ids = ids_data[i], .layers = ly};
        CHECK_OK(df_cache_writer_put(w, &s, &e), &e);
    }
    CHECK_OK(df_cache_writer_close(w, &e), &e);
}

static void check_item(const df_cache_item *it, uint64_t mask)
{
    int i = (int)it->id;
    CHECK(i >= 0 && i < NS);
    CHECK_EQ(it->n_tokens, lens[i]);
    CHECK(memcmp(it->ids, ids_data[i], (size_t)lens[i] * 4) == 0);
    for (uint32_t t = 0; t < lens[i]; t++)
        CHECK_EQ(it->loss_mask[t], 1);
    for (int l = 0; l < NL; l++) {
        if (mask >> l & 1)
            CHECK(it->layers[l] && memcmp(it->layers[l], layer_data[i][l],
                                          (size_t)lens[i] * HID * 2) == 0);
        else
            CHECK(it->layers[l] == NULL);
    }
}

static void run(df_cache *c, const uint64_t *order, size_t n, uint64_t mask,
                df_cache_stream_opts o, int hold)
{
    o.order = order;
    o.n = n;
    o.layer_mask = mask;
    df_err e = {0};
    df_cache_stream *s = df_cache_stream_open(c, &o, &e);
    CHECK_OK(s ? 0 : e.code, &e);
    if (!s)
        return;
    df_cache_item held[8];
    int nheld = 0;
    size_t got = 0;
    df_cache_item it;
    int rc;
    while ((rc = df_cache_stream_next(s, &it, &e)) == 1) {
        size_t want = order ? order[got] : got;
        CHECK_EQ(it.pos, want);
        CHECK_EQ(it.seq, got);
        check_item(&it, mask ? mask : 3);
        got++;
        held[nheld++] = it;
        if (nheld > hold) { /* release the oldest-but-one first: out of order */
            df_cache_stream_release(s, &held[nheld > 1 ? 1 : 0]);
            held[nheld > 1 ? 1 : 0] = held[nheld - 1];
            nheld--;
        }
    }
    CHECK_OK(rc, &e);
    CHECK_EQ(got, order ? n : df_cache_count(c));
    for (int i = 0; i < nheld; i++)
        df_cache_stream_release(s, &held[i]);
    df_cache_stream_stats st;
    df_cache_stream_get_stats(s, &st);
    CHECK_EQ(st.samples, got);
    df_cache_stream_close(s);
}

int main(void)
{
    const char *base = test_tmpdir("cache-stream");
    char dir[4096];
    snprintf(dir, sizeof dir, "%s/c", base);
    make_cache(dir);
    df_err e = {0};
    df_cache *c = df_cache_open(dir, &e);
    CHECK_OK(c ? 0 : e.code, &e);
    if (!c)
        return test_main_end();

    for (int fb = 0; fb < 2; fb++) {
        df_cache_stream_opts o = {.threads = 2, .force_fallback_io = fb};
        run(c, NULL, 0, 0, o, 0);                         /* sequential, all layers */
        uint64_t order[NS];
        df_cache_shuffle(1234, 3, order, NS);
        run(c, order, NS, 1u << 1, o, 3);                  /* shuffled, one layer, held */
        uint64_t again[NS];
        df_cache_shuffle(1234, 3, again, NS);
        CHECK(memcmp(order, again, sizeof order) == 0);    /* same seed + epoch: same order */
        df_cache_shuffle(1234, 4, again, NS);
        CHECK(memcmp(order, again, sizeof order) != 0);    /* next epoch: another */
        uint64_t sub[10] = {5, 5, 63, 0, 1, 2, 40, 40, 40, 7};
        df_cache_stream_opts tiny = o;
        tiny.max_prefetch_bytes = 1;                       /* one record at a time */
        tiny.n_slots = 2;
        run(c, sub, 10, 0, tiny, 1);
    }

    /* The default read-ahead admits a record per decoder plus one (~140 MB
     * records of 4096-token rows would otherwise leave decoders idle); an
     * explicit budget is kept as given. */
    CHECK_EQ(df_cache_stream_default_prefetch(1000, 4), (size_t)256 << 20);
    CHECK_EQ(df_cache_stream_default_prefetch((size_t)140 << 20, 4), (size_t)700 << 20);
    CHECK_EQ(df_cache_stream_default_prefetch((size_t)140 << 20, 0), (size_t)280 << 20);
    CHECK_EQ(df_cache_stream_default_prefetch(SIZE_MAX / 2, 4), SIZE_MAX);
    {
        df_cache_stream_opts d = {.threads = 2};
        df_cache_stream *ds = df_cache_stream_open(c, &d, &e);
        CHECK_OK(ds ? 0 : e.code, &e);
        df_cache_stream_stats st;
        df_cache_stream_get_stats(ds, &st);
        CHECK_EQ(st.prefetch_budget, (size_t)256 << 20);
        df_cache_stream_close(ds);
        d.max_prefetch_bytes = 12345;
        ds = df_cache_stream_open(c, &d, &e);
        CHECK_OK(ds ? 0 : e.code, &e);
        df_cache_stream_get_stats(ds, &st);
        CHECK_EQ(st.prefetch_budget, 12345);
        df_cache_stream_close(ds);
    }

    /* Caller-owned slots (as pinned memory will be). */
    size_t sb = df_cache_stream_slot_bytes(c, 3);
    void *slots[3];
    for (int i = 0; i < 3; i++)
        slots[i] = aligned_alloc(4096, (sb + 4095) / 4096 * 4096);
    df_cache_stream_opts own = {.threads = 1, .n_slots = 3, .slots = slots, .slot_bytes = sb};
    run(c, NULL, 0, 3, own, 2);
    /* Slots too small: a clear error naming the sample. */
    own.slot_bytes = 64;
    df_cache_stream *s = df_cache_stream_open(c, &own, &e);
    df_cache_item it;
    int rc = 0;
    while (s && (rc = df_cache_stream_next(s, &it, &e)) == 1)
        df_cache_stream_release(s, &it);
    CHECK_ERR(rc, -ENOSPC, &e, "needs");
    df_cache_stream_close(s);
    for (int i = 0; i < 3; i++)
        free(slots[i]);

    /* Out-of-range order entries are refused up front. */
    uint64_t bad[1] = {NS};
    df_cache_stream_opts o = {.order = bad, .n = 1};
    CHECK(df_cache_stream_open(c, &o, &e) == NULL);
    CHECK_ERR(e.code, -EINVAL, &e, "out of range");

    /* A corrupt block: every sample before it arrives, then its error. */
    const df_cache_entry *t = df_cache_entry_at(c, 20);
    int fd = open(df_cache_shard_path(c, t->shard), O_RDWR);
    uint8_t b;
    uint64_t off = t->offset + t->record_bytes - 4096;
    while (pread(fd, &b, 1, (off_t)off) == 1 && b == 0)
        off--;
    b ^= 1;
    CHECK(pwrite(fd, &b, 1, (off_t)off) == 1);
    close(fd);
    df_cache_stream_opts o2 = {.threads = 3};
    s = df_cache_stream_open(c, &o2, &e);
    size_t got = 0;
    while (s && (rc = df_cache_stream_next(s, &it, &e)) == 1) {
        got++;
        df_cache_stream_release(s, &it);
    }
    CHECK_EQ(got, 20);
    CHECK_ERR(rc, -DF_ECORRUPT, &e, "sample 20");
    df_cache_stream_close(s);
    df_cache_close(c);
    return test_main_end();
}
