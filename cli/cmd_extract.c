/* cmd_extract.c - `dflash extract`: the target over a corpus, into a cache. */
#include <errno.h>
#include <time.h>
#include <unistd.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmds.h"
#include "codec.h"
#include "cache.h"
#include "extract.h"
#include "opt.h"
#include "ranks.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: dflash extract --model DIR --data CORPUS --out CACHE [options]\n"
            "Runs the target (HF folder: config.json + safetensors; qwen3 or qwen3_5) once over a\n"
            "tokenized corpus (.dtok or JSONL) and writes the feature layers' hidden states to a\n"
            "cache. Rerun the same command to resume an interrupted extraction.\n"
            "  --layers auto|K|L1,L2,..  feature layers: the DFlash rule (auto = min(5, layers-3)),\n"
            "                            K layers by that rule, or explicit 0-based ids\n"
            "  --codec NAME              stored|lz4|split-lz4|split-zstd (lossless; default\n"
            "                            split-zstd) or the LOSSY fp8-e4m3|fp8-b32|int6-b32|\n"
            "                            int5-b32|int4-b32|int3-b32|int2-b32 (docs/FORMAT-codecs.md)\n"
            "  --level N                 entropy coder level (default: the codec's)\n"
            "  --basis FILE              write a projected cache: z = P x per token with this\n"
            "                            basis of the same layers (dflash cache project of a\n"
            "                            small lossless extraction makes one); LOSSY\n"
            "  --batch-tokens N          tokens per forward pass (default 8192)\n"
            "  --max-len N               longest document accepted (default: the model's\n"
            "                            max_position_embeddings)\n"
            "  --device auto|cpu|cuda    the backend (default auto: the GPU when one is visible)\n"
            "  --gpus N|all              one process per local GPU (one cache); --gpu I: this one\n"
            "  --random-weights CONFIG   benchmarks: random weights of this config.json (--seed S)\n"
            "  --threads N               compression threads (default: all CPUs)\n"
            "  --stats-json FILE         also write this process's figures as JSON (with --gpus,\n"
            "                            each rank writes FILE.rankR)\n"
            "  --rank R --world-size W   this process's share of the corpus (documents i %% W == R)\n"
            "  --fallback-io             pread/pwrite threads instead of io_uring\n"
            "  --buffered                no O_DIRECT\n"
            "  --quiet                   no progress line\n");
}

static int parse_u64(const char *s, uint64_t *v)
{
    char *end;
    errno = 0;
    if (!s || !*s || *s == '-')
        return -1;
    unsigned long long x = strtoull(s, &end, 10);
    if (errno || *end)
        return -1;
    *v = x;
    return 0;
}

/* Per-rank --stats-json FILE.rankR (later options win). */
static int stats_extra(void *ctx, int i, uint32_t rank, char **av, int cap)
{
    static char bufs[64][4200];
    const char *stats_json = ctx;
    if (!stats_json || cap < 2 || i >= 64)
        return 0;
    snprintf(bufs[i], sizeof bufs[i], "%s.rank%u", stats_json, rank);
    av[0] = "--stats-json";
    av[1] = bufs[i];
    return 2;
}

/* One process per local GPU (ranks.h); the ranks write one cache and the
 * last to finish writes its manifest. */
static int spawn_ranks(int argc, char **argv, int n, uint32_t node, uint32_t nodes,
                       const char *out_dir, const char *stats_json)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double t0 = ts.tv_sec + ts.tv_nsec * 1e-9;
    int failed = cli_spawn_ranks("extract", argc, argv, n, node, nodes, stats_extra,
                                 (void *)stats_json);
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double dt = ts.tv_sec + ts.tv_nsec * 1e-9 - t0;
    if (failed)
        return 1;
    df_err e = {0};
    df_cache *c = df_cache_open(out_dir, &e);
    if (c) { /* every rank of every node is done */
        const df_cache_info *ci = df_cache_get_info(c);
        printf("extracted on %d GPUs x %u node(s) in %.2f s: %" PRIu64 " samples, %" PRIu64
               " tokens in the cache (%.0f tok/s if all ran in this call), %.1f MB stored "
               "(ratio %.3f)\n", n, nodes, dt, ci->samples, ci->tokens, ci->tokens / dt,
               ci->stored_bytes / 1e6,
               ci->raw_bytes ? (double)ci->stored_bytes / ci->raw_bytes : 0.0);
        df_cache_close(c);
    } else {
        printf("%d local ranks done in %.2f s; the manifest comes with the last rank of the "
               "other nodes\n", n, dt);
    }
    return 0;
}

int cmd_extract(int argc, char **argv)
{
    df_extract_opts o = {.codec = DF_CODEC_SPLIT_ZSTD, .progress = 1, .world_size = 1};
    const char *layers = "auto", *device = "auto", *gpus = NULL;
    int gpu = -1, rank_given = 0;
    const char *stats_json = NULL;
    int ids[64];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--quiet")) { o.progress = 0; continue; }
        if (!strcmp(a, "--fallback-io")) { o.force_fallback_io = 1; continue; }
        if (!strcmp(a, "--buffered")) { o.buffered = 1; continue; }
        if (!v) {
            fprintf(stderr, "dflash extract: '%s' needs a value (or is unknown)\n", a);
            return 2;
        }
        i++;
        if (!strcmp(a, "--model")) o.model_dir = v;
        else if (!strcmp(a, "--data")) o.data_path = v;
        else if (!strcmp(a, "--out")) o.out_dir = v;
        else if (!strcmp(a, "--layers")) layers = v;
        else if (!strcmp(a, "--device")) device = v;
        else if (!strcmp(a, "--gpus")) gpus = v;
        else if (!strcmp(a, "--stats-json")) stats_json = v;
        else if (!strcmp(a, "--random-weights")) o.random_config = v;
        else if (!strcmp(a, "--basis")) o.basis_path = v;
        else if (!strcmp(a, "--codec")) {
            if ((o.codec = df_codec_from_name(v)) < 0) {
                fprintf(stderr, "dflash extract: unknown codec '%s' (stored, lz4, split-lz4, "
                                "split-zstd, fp8-e4m3, fp8-b32, int6-b32, int5-b32, int4-b32, "
                                "int3-b32, int2-b32)\n", v);
                return 2;
            }
        } else {
            /* the numeric options, with their ranges (common/opt.h): a bad value is a usage
             * error naming the option, the value and the range */
            df_err pe = {0};
            int rc = 1, k = 0; /* rc 1: not a numeric option */
            if (!strcmp(a, "--seed")) rc = df_opt_u64(a, v, 0, UINT64_MAX, &o.random_seed, &pe);
            else if (!strcmp(a, "--gpu")) rc = df_opt_int(a, v, 0, 1023, &gpu, &pe);
            else if (!strcmp(a, "--level")) rc = df_opt_int(a, v, 0, 1000, &o.codec_level, &pe);
            else if (!strcmp(a, "--batch-tokens")) rc = df_opt_i64(a, v, 1, DF_CACHE_MAX_TOKENS, &o.batch_tokens, &pe);
            else if (!strcmp(a, "--max-len")) rc = df_opt_i64(a, v, 1, DF_CACHE_MAX_TOKENS, &o.max_len, &pe);
            else if (!strcmp(a, "--threads")) rc = df_opt_int(a, v, 0, 4096, &o.threads, &pe);
            else if (!strcmp(a, "--rank")) {
                if (!(rc = df_opt_int(a, v, 0, 1 << 20, &k, &pe))) {
                    o.rank = (uint32_t)k;
                    rank_given = 1;
                }
            } else if (!strcmp(a, "--world-size")) {
                if (!(rc = df_opt_int(a, v, 1, 1 << 20, &k, &pe)))
                    o.world_size = (uint32_t)k;
            }
            if (rc == 1) {
                fprintf(stderr, "dflash extract: unknown option: %s\n", a);
                usage(stderr);
                return 2;
            }
            if (rc) {
                fprintf(stderr, "dflash extract: %s\n", pe.msg);
                return 2;
            }
        }
    }
    if ((!o.model_dir && !o.random_config) || !o.data_path || !o.out_dir) {
        fprintf(stderr, "dflash extract: --model (or --random-weights), --data and --out are "
                        "required\n");
        usage(stderr);
        return 2;
    }
    if (strcmp(device, "auto") && strcmp(device, "cpu") && strcmp(device, "cuda")) {
        fprintf(stderr, "dflash extract: --device '%s': want auto, cpu or cuda\n", device);
        return 2;
    }
    if (strcmp(layers, "auto")) {
        uint64_t k;
        if (!strchr(layers, ',') && !parse_u64(layers, &k) && k >= 1 && k <= 64) {
            o.n_layers = (int)k;
        } else {
            int n = 0;
            const char *p = layers;
            while (*p) {
                char *end;
                errno = 0;
                long v = strtol(p, &end, 10);
                if (end == p || errno || v < 0 || v > 100000 || n == 64 ||
                    (*end && *end != ',')) {
                    fprintf(stderr, "dflash extract: --layers '%s': want auto, K, or ids like "
                                    "1,16,31\n", layers);
                    return 2;
                }
                if (n > 0 && v <= ids[n - 1]) {
                    /* serving engines hand a drafter the target's layers in layer order */
                    fprintf(stderr, "dflash extract: --layers '%s': list each layer once, in "
                                    "increasing order\n", layers);
                    return 2;
                }
                ids[n++] = (int)v;
                p = *end ? end + 1 : end;
            }
            o.layer_ids = ids;
            o.n_layer_ids = n;
        }
    }
    int n_gpu = strcmp(device, "cpu") ? df_backend_cuda_device_count() : 0;
    if (!strcmp(device, "cuda") && n_gpu == 0) {
        fprintf(stderr, "dflash extract: --device cuda: no CUDA device is visible%s\n",
                df_backend_cuda_device_count() < 0 ? " (this build has no CUDA)" : "");
        return 1;
    }
    int use_cuda = n_gpu > 0;
    uint32_t lr_rank, lr_world;
    int lr_local;
    df_err le = {0};
    int launched = gpu < 0 && !rank_given ? cli_launcher_rank(&lr_rank, &lr_world, &lr_local, &le) : 0;
    if (launched < 0) {
        fprintf(stderr, "dflash extract: %s\n", le.msg);
        return 2;
    }
    if (launched) {
        /* torchrun / Slurm: this process is one rank (on the CPU too); its GPU is its local rank */
        o.rank = lr_rank;
        o.world_size = lr_world;
        if (use_cuda)
            gpu = lr_local % n_gpu;
    } else if (use_cuda && gpu < 0 && !rank_given) {
        int n = n_gpu;
        if (gpus && strcmp(gpus, "all")) {
            uint64_t k;
            if (parse_u64(gpus, &k) || k < 1 || k > (uint64_t)n_gpu) {
                fprintf(stderr, "dflash extract: --gpus '%s': want all or 1..%d\n", gpus,
                        n_gpu);
                return 2;
            }
            n = (int)k;
        }
        uint32_t node, nodes;
        cli_node_rank(&node, &nodes);
        if (n > 1 || nodes > 1)
            return spawn_ranks(argc, argv, n, node, nodes, o.out_dir, stats_json);
        gpu = 0;
    }
    if (o.rank >= o.world_size) {
        fprintf(stderr, "dflash extract: --rank %u out of range for --world-size %u\n", o.rank,
                o.world_size);
        return 2;
    }
    if (use_cuda && gpu < 0) /* ranks given by hand on one node: spread over its GPUs */
        gpu = (int)(o.rank % (uint32_t)n_gpu);
    if (use_cuda && gpu >= n_gpu) {
        fprintf(stderr, "dflash extract: --gpu %d: only %d visible\n", gpu, n_gpu);
        return 2;
    }
    df_err e = {0};
    df_backend *be = use_cuda ? df_backend_cuda_open(gpu, &e) : df_backend_cpu_open(0, &e);
    if (!be) {
        fprintf(stderr, "dflash extract: %s\n", e.msg);
        return 1;
    }
    df_extract_stats st;
    int rc = df_extract_run(&o, be, &st, &e);
    df_backend_close(be);
    if (rc) {
        fprintf(stderr, "dflash extract: %s\n", e.msg);
        return 1;
    }
    double steady = st.seconds - st.setup_seconds;
    printf("extracted %s -> %s: %" PRIu64 " docs (%" PRIu64 " already there, %" PRIu64
           " empty skipped), %" PRIu64 " tokens in %.2f s (setup %.2f s; %.0f tok/s after setup; "
           "forward %.2f s = %.0f tok/s; writer-bound %.0f%%), layers",
           o.data_path, o.out_dir, st.docs, st.docs_skipped_resume, st.docs_empty, st.tokens,
           st.seconds, st.setup_seconds, steady > 0 ? st.tokens / steady : 0.0,
           st.forward_seconds, st.forward_seconds > 0 ? st.tokens / st.forward_seconds : 0.0,
           steady > 0 ? 100 * st.writer_wait_seconds / steady : 0.0);
    for (int i = 0; i < st.n_layers; i++)
        printf("%s%d", i ? "," : " ", st.layer_ids[i]);
    printf(", %.1f MB raw -> %.1f MB stored (%.3f), %s\n", st.raw_bytes / 1e6,
           st.stored_bytes / 1e6, st.raw_bytes ? (double)st.stored_bytes / st.raw_bytes : 0.0,
           st.io_backend ? st.io_backend : "-");
    if (st.mem_peak_bytes >= 0)
        printf("device memory in use: %.2f GiB after loading the model, %.2f GiB at most after a batch\n",
               st.mem_setup_bytes / 1073741824.0, st.mem_peak_bytes / 1073741824.0);
    if (stats_json) {
        FILE *f = fopen(stats_json, "w");
        if (!f || fprintf(f, "{\"rank\": %u, \"world_size\": %u, \"device\": \"%s\", \"docs\": %"
                          PRIu64 ", \"tokens\": %" PRIu64 ", \"seconds\": %.4f, \"setup_seconds\": "
                          "%.4f, \"forward_seconds\": %.4f, \"writer_wait_seconds\": %.4f, "
                          "\"raw_bytes\": %" PRIu64 ", \"stored_bytes\": %" PRIu64 ", "
                          "\"mem_setup_bytes\": %" PRId64 ", \"mem_peak_bytes\": %" PRId64 "}\n",
                          o.rank, o.world_size, use_cuda ? "cuda" : "cpu", st.docs, st.tokens,
                          st.seconds, st.setup_seconds, st.forward_seconds,
                          st.writer_wait_seconds, st.raw_bytes, st.stored_bytes, st.mem_setup_bytes,
                          st.mem_peak_bytes) < 0) {
            fprintf(stderr, "dflash extract: cannot write %s\n", stats_json);
            if (f)
                fclose(f);
            return 1;
        }
        fclose(f);
    }
    return 0;
}
