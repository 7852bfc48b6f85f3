/* cmd_cache.c - `dflash cache synth|read`: write a cache of synthetic hidden
 * states (tests, demos and storage benchmarks, before a target runs) and
 * stream a cache through the reader pipeline, measuring it. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cache.h"
#include "cache_stream.h"
#include "cache_writer.h"
#include "cmds.h"
#include "corpus.h"
#include "fsutil.h"
#include "opt.h"
#include "synth.h"

static void synth_usage(FILE *f)
{
    fprintf(f,
            "usage: dflash cache synth --out DIR [options]\n"
            "Writes a cache of synthetic hidden-state-like bf16 data (cache/synth.h says how it\n"
            "is made) through the real writer pipeline: for tests, demos and storage benchmarks.\n"
            "  --samples N          samples (default 64; with --corpus: its documents, at most N)\n"
            "  --min-tokens N       shortest sample (default 16)\n"
            "  --max-tokens N       longest sample (default 512)\n"
            "  --corpus FILE        take token ids + loss masks from a corpus (.dtok or JSONL)\n"
            "  --hidden N           hidden size (default 256)\n"
            "  --target-layers N    layers of the pretend target (default 6)\n"
            "  --layers K           feature layers, picked by the DFlash rule (default 3)\n"
            "  --codec NAME         stored|lz4|split-lz4|split-zstd (default), or the lossy\n"
            "                       fp8-e4m3|fp8-b32|int6-b32|int5-b32|int4-b32|int3-b32|int2-b32\n"
            "  --level N            entropy coder level (default: the codec's)\n"
            "  --rows-per-block N   rows per block (default: about 1 MiB)\n"
            "  --shard-mb N         shard size in MiB (default 4096)\n"
            "  --threads N          encoder threads (default: all CPUs)\n"
            "  --seed N             data seed (default 1)\n"
            "  --fallback-io        use the pread/pwrite pool instead of io_uring\n"
            "  --buffered           no O_DIRECT\n"
            "  --json               one JSON line of results on stdout\n");
}

static int cmd_synth(int argc, char **argv)
{
    const char *out = NULL, *corpus_path = NULL, *codec = "split-zstd";
    uint64_t samples = 64, tmin = 16, tmax = 512, hidden = 256, tl = 6, k = 3, level = 0,
             rpb = 0, shard_mb = 4096, threads = 0, seed = 1;
    int fallback = 0, buffered = 0, json = 0, have_level = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t *num = NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            synth_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--out")) { out = v; i++; continue; }
        else if (!strcmp(a, "--corpus")) { corpus_path = v; i++; continue; }
        else if (!strcmp(a, "--codec")) { codec = v; i++; continue; }
        else if (!strcmp(a, "--fallback-io")) { fallback = 1; continue; }
        else if (!strcmp(a, "--buffered")) { buffered = 1; continue; }
        else if (!strcmp(a, "--json")) { json = 1; continue; }
        else if (!strcmp(a, "--samples")) num = &samples;
        else if (!strcmp(a, "--min-tokens")) num = &tmin;
        else if (!strcmp(a, "--max-tokens")) num = &tmax;
        else if (!strcmp(a, "--hidden")) num = &hidden;
        else if (!strcmp(a, "--target-layers")) num = &tl;
        else if (!strcmp(a, "--layers")) num = &k;
        else if (!strcmp(a, "--level")) { num = &level; have_level = 1; }
        else if (!strcmp(a, "--rows-per-block")) num = &rpb;
        else if (!strcmp(a, "--shard-mb")) num = &shard_mb;
        else if (!strcmp(a, "--threads")) num = &threads;
        else if (!strcmp(a, "--seed")) num = &seed;
        if (!num) {
            fprintf(stderr, "dflash cache synth: unknown option '%s'\n", a);
            synth_usage(stderr);
            return 2;
        }
        /* common/opt.h: the option, the value and the range in the message; the sizes'
         * relations are checked below */
        df_err pe = {0};
        if (df_opt_u64(a, v, 0, num == &threads ? 4096 : UINT64_MAX, num, &pe)) {
            fprintf(stderr, "dflash cache synth: %s\n", pe.msg);
            return 2;
        }
        i++;
    }
    if (!out || !codec || tmin > tmax || tmax == 0 || hidden == 0 || k == 0 || k > tl ||
        k > DF_CACHE_MAX_LAYERS || shard_mb == 0) {
        fprintf(stderr, "dflash cache synth: need --out, and sane sizes (1 <= --layers <= "
                        "--target-layers, --min-tokens <= --max-tokens)\n");
        return 2;
    }
    int cid = df_codec_from_name(codec);
    if (cid < 0) {
        fprintf(stderr, "dflash cache synth: unknown codec '%s' (stored, lz4, split-lz4, "
                        "split-zstd, fp8-e4m3, fp8-b32, int6-b32, int5-b32, int4-b32, int3-b32, "
                        "int2-b32)\n", codec);
        return 2;
    }
    df_err e = {0};
    df_corpus *corpus = NULL;
    if (corpus_path) {
        df_corpus_opts co = {0};
        if (df_corpus_open(corpus_path, &co, &corpus, &e)) {
            fprintf(stderr, "dflash cache synth: %s\n", e.msg);
            return 1;
        }
        if (df_corpus_n_docs(corpus) < samples)
            samples = df_corpus_n_docs(corpus);
    }
    df_cache_params p = {0};
    snprintf(p.model_type, sizeof p.model_type, "synthetic");
    snprintf(p.target_name, sizeof p.target_name, "synth-h%" PRIu64, hidden);
    snprintf(p.config_sha256, sizeof p.config_sha256, "synthetic-seed-%" PRIu64, seed);
    if (corpus)
        df_corpus_fingerprint(corpus, p.corpus_fingerprint);
    else
        snprintf(p.corpus_fingerprint, sizeof p.corpus_fingerprint, "synthetic");
    p.corpus_docs = samples;
    p.hidden_size = (uint32_t)hidden;
    p.num_target_layers = (uint32_t)tl;
    p.vocab_size = 151936;
    p.n_layers = (uint32_t)k;
    /* The DFlash rule (docs/DRAFTER.md): one layer -> T/2, else 1..T-3 evenly. */
    for (uint32_t i = 0; i < k; i++)
        p.layer_ids[i] = k == 1 ? (int32_t)(tl / 2)
                                : (int32_t)(1 + (double)i * (double)(tl - 4) / (double)(k - 1) + 0.5);
    p.dtype = DF_DTYPE_BF16;
    p.codec = cid;
    p.codec_level = have_level ? (int)level : 0;
    p.rows_per_block = (uint32_t)rpb;
    p.shard_bytes = shard_mb << 20;
    df_cache_writer_opts wo = {.threads = (int)threads, .force_fallback_io = fallback,
                               .buffered = buffered};
    /* Generating the data costs more than compressing it, so a pool of POOL
     * generated sequences per layer is made once and samples are cut from it
     * (at varying offsets). Blocks are compressed independently, so reuse
     * does not flatter the ratio. */
    enum { POOL = 4 };
    uint16_t *data[DF_CACHE_MAX_LAYERS] = {0};
    uint32_t *ids = malloc(tmax * 4 + 4);
    uint8_t *mask = malloc(tmax + 1);
    for (uint32_t l = 0; l < k; l++) {
        data[l] = malloc((POOL + 1) * tmax * hidden * 2 + 2);
        if (data[l])
            df_synth_bf16(data[l], (POOL + 1) * tmax, hidden, seed * 1000003 + l * 7777, NULL);
    }
    double t0 = df_now();
    df_cache_writer *w = df_cache_writer_open(out, &p, &wo, &e);
    if (!w) {
        fprintf(stderr, "dflash cache synth: %s\n", e.msg);
        for (uint32_t l = 0; l < k; l++)
            free(data[l]);
        free(ids);
        free(mask);
        df_corpus_close(corpus);
        return 1;
    }
    int rc = 0;
    for (uint64_t s = 0; s < samples && !rc; s++) {
        if (df_cache_writer_has(w, s))
            continue;
        /* Sample s is a function of (seed, s) alone, so a resumed run writes
         * exactly what an uninterrupted one would. */
        uint64_t rng = (seed + 1) * 0x9E3779B97F4A7C15ull ^ (s + 1) * 0xBF58476D1CE4E5B9ull;
        rng ^= rng >> 31;
        rng *= 0x94D049BB133111EBull;
        rng ^= rng >> 29;
        uint32_t n = (uint32_t)(tmin + (rng >> 33) % (tmax - tmin + 1));
        const uint32_t *sid = ids;
        const uint8_t *smask = mask;
        if (corpus) {
            const uint32_t *cid_;
            const uint8_t *cm;
            uint64_t len;
            if ((rc = df_corpus_doc(corpus, s, &cid_, &cm, &len))) {
                df_errf(&e, rc, "%s: document %" PRIu64 " unreadable", corpus_path, s);
                break;
            }
            n = len < tmax ? (uint32_t)len : (uint32_t)tmax;
            sid = cid_;
            smask = cm;
        } else {
            for (uint32_t t = 0; t < n; t++) {
                ids[t] = (uint32_t)((s * 7919 + t * 104729) % 151936);
                mask[t] = t >= n / 4;
            }
        }
        const void *layers[DF_CACHE_MAX_LAYERS];
        size_t start = (size_t)((rng >> 17) % (POOL * tmax));
        for (uint32_t l = 0; l < k; l++)
            layers[l] = data[l] + start * hidden;
        df_cache_sample smp = {.id = s, .n_tokens = n, .ids = sid, .loss_mask = smask,
                               .layers = layers};
        rc = df_cache_writer_put(w, &smp, &e);
    }
    if (!rc)
        rc = df_cache_writer_flush(w, &e);
    df_cache_writer_stats st;
    df_cache_writer_get_stats(w, &st);
    if (!rc)
        rc = df_cache_writer_close(w, &e);
    else
        df_cache_writer_abandon(w);
    double dt = df_now() - t0;
    for (uint32_t l = 0; l < k; l++)
        free(data[l]);
    free(ids);
    free(mask);
    df_corpus_close(corpus);
    if (rc) {
        fprintf(stderr, "dflash cache synth: %s\n", e.msg);
        return 1;
    }
    double ratio = st.raw_bytes ? (double)st.stored_bytes / (double)st.raw_bytes : 0;
    if (json)
        printf("{\"samples\":%" PRIu64 ",\"resumed\":%" PRIu64 ",\"tokens\":%" PRIu64
               ",\"raw_bytes\":%" PRIu64 ",\"stored_bytes\":%" PRIu64 ",\"file_bytes\":%" PRIu64
               ",\"seconds\":%.4f,\"ratio\":%.4f,\"io\":\"%s\"}\n",
               st.samples, st.resumed_samples, st.tokens, st.raw_bytes, st.stored_bytes,
               st.file_bytes, dt, ratio, st.io_backend);
    else
        printf("wrote %s: %" PRIu64 " samples (%" PRIu64 " resumed), %" PRIu64
               " tokens, %.1f MB raw -> %.1f MB stored (%.3f), %.2f s, %.0f MB/s raw, %s\n",
               out, st.samples, st.resumed_samples, st.tokens, st.raw_bytes / 1e6,
               st.stored_bytes / 1e6, ratio, dt, st.raw_bytes / 1e6 / (dt > 0 ? dt : 1),
               st.io_backend);
    return 0;
}

static void read_usage(FILE *f)
{
    fprintf(f,
            "usage: dflash cache read DIR [options]\n"
            "Streams every sample through the reader pipeline (io_uring, CRC checks, decode)\n"
            "and reports the rate, as training will read it.\n"
            "  --threads N       decoder threads (default: all CPUs)\n"
            "  --shuffle SEED    a shuffled epoch order instead of id order\n"
            "  --prefetch-mb N   compressed bytes read ahead (default: 256, or a record per\n"
            "                    decoder thread plus one where records are larger)\n"
            "  --fallback-io     the pread/pwrite pool instead of io_uring\n"
            "  --buffered        no O_DIRECT (page cache)\n"
            "  --json            one JSON line of results on stdout\n");
}

static int cmd_read(int argc, char **argv)
{
    const char *dir = NULL;
    uint64_t threads = 0, seed = 0, prefetch = 0;
    int shuffle = 0, fallback = 0, buffered = 0, json = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            read_usage(stdout);
            return 0;
        } else if (!strcmp(a, "--threads") || !strcmp(a, "--shuffle") ||
                   !strcmp(a, "--prefetch-mb")) {
            /* common/opt.h: the option, the value and the range in the message */
            df_err pe = {0};
            int sh = !strcmp(a, "--shuffle");
            uint64_t *dst = sh ? &seed : !strcmp(a, "--threads") ? &threads : &prefetch;
            uint64_t max = sh ? UINT64_MAX : dst == &threads ? 4096 : 1u << 20;
            if (df_opt_u64(a, v, 0, max, dst, &pe)) {
                fprintf(stderr, "dflash cache read: %s\n", pe.msg);
                return 2;
            }
            shuffle |= sh;
            i++;
        } else if (!strcmp(a, "--fallback-io")) fallback = 1;
        else if (!strcmp(a, "--buffered")) buffered = 1;
        else if (!strcmp(a, "--json")) json = 1;
        else if (a[0] != '-' && !dir) dir = a;
        else {
            fprintf(stderr, "dflash cache read: bad argument '%s'\n", a);
            read_usage(stderr);
            return 2;
        }
    }
    if (!dir) {
        read_usage(stderr);
        return 2;
    }
    df_err e = {0};
    df_cache *c = df_cache_open(dir, &e);
    if (!c) {
        fprintf(stderr, "dflash cache read: %s\n", e.msg);
        return 1;
    }
    size_t n = df_cache_count(c);
    uint64_t *order = NULL;
    if (shuffle) {
        order = malloc((n ? n : 1) * sizeof *order);
        df_cache_shuffle(seed, 0, order, n);
    }
    df_cache_stream_opts o = {.order = order, .n = n, .threads = (int)threads,
                              .max_prefetch_bytes = prefetch << 20,
                              .force_fallback_io = fallback, .buffered = buffered};
    double t0 = df_now();
    df_cache_stream *s = df_cache_stream_open(c, &o, &e);
    int rc = s ? 0 : e.code;
    df_cache_item it;
    uint64_t raw = 0, sum = 0;
    size_t row = (size_t)df_cache_get_info(c)->params.hidden_size *
                 df_dtype_size(df_cache_get_info(c)->params.dtype);
    while (s && (rc = df_cache_stream_next(s, &it, &e)) == 1) {
        raw += (uint64_t)it.n_tokens * row * df_cache_get_info(c)->params.n_layers;
        sum += it.n_tokens ? it.ids[it.n_tokens - 1] : 0; /* touch the data */
        df_cache_stream_release(s, &it);
    }
    double dt = df_now() - t0;
    df_cache_stream_stats st = {0};
    if (s)
        df_cache_stream_get_stats(s, &st);
    df_cache_stream_close(s);
    free(order);
    df_cache_close(c);
    if (rc < 0) {
        fprintf(stderr, "dflash cache read: %s\n", e.msg);
        return 1;
    }
    if (json)
        printf("{\"samples\":%" PRIu64 ",\"tokens\":%" PRIu64 ",\"file_bytes\":%" PRIu64
               ",\"raw_bytes\":%" PRIu64 ",\"seconds\":%.4f,\"file_GBps\":%.4f,"
               "\"raw_GBps\":%.4f,\"consumer_wait_s\":%.4f,\"prefetch_mb\":%.1f,\"io\":\"%s\","
               "\"check\":%" PRIu64 "}\n",
               st.samples, st.tokens, st.bytes_read, raw, dt, st.bytes_read / 1e9 / dt,
               raw / 1e9 / dt, st.consumer_wait_s, st.prefetch_budget / 1048576.0, st.io_backend,
               sum);
    else
        printf("read %s: %" PRIu64 " samples, %" PRIu64 " tokens, %.1f MB from disk (%.2f GB/s), "
               "%.1f MB decoded (%.2f GB/s), %.2f s, %s\n",
               dir, st.samples, st.tokens, st.bytes_read / 1e6, st.bytes_read / 1e9 / dt,
               raw / 1e6, raw / 1e9 / dt, dt, st.io_backend);
    return 0;
}

int cmd_cache(int argc, char **argv)
{
    if (argc >= 2 && !strcmp(argv[1], "synth"))
        return cmd_synth(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "read"))
        return cmd_read(argc - 1, argv + 1);
    if (argc >= 2 && !strcmp(argv[1], "project"))
        return cmd_cache_project(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "plan"))
        return cmd_cache_plan(argc, argv);
    if (argc >= 2 && !strcmp(argv[1], "diff"))
        return cmd_cache_diff(argc - 1, argv + 1);
    FILE *f = argc >= 2 && (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) ? stdout : stderr;
    fprintf(f, "usage: dflash cache synth|read|diff|project|plan ...   (dflash cache synth --help)\n"
               "  synth   write a cache of synthetic hidden states (tests, demos, benchmarks)\n"
               "  read    stream a cache through the reader pipeline and report its rate\n"
               "  diff    compare two caches sample by sample\n"
               "  project derive a projected (smaller) cache from a finished one\n"
               "  plan    a cache's bytes per token and total size, before it is made\n");
    return f == stdout ? 0 : 2;
}
