/* cmd_extract.c - `dflash extract`: the target over a corpus, into a cache. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cmds.h"
#include "codec.h"
#include "extract.h"

static void usage(FILE *f)
{
    fprintf(f,
            "usage: dflash extract --model DIR --data CORPUS --out CACHE [options]\n"
            "Runs the target (HF folder: config.json + safetensors; qwen3 or qwen3_5) once over a\n"
            "tokenized corpus (.dtok or JSONL) and writes the feature layers' hidden states to a\n"
            "cache. Rerun the same command to resume an interrupted extraction.\n"
            "  --layers auto|K|L1,L2,..  feature layers: the DFlash rule (auto = min(5, layers-3)),\n"
            "                            K layers by that rule, or explicit 0-based ids\n"
            "  --codec NAME              stored|lz4|split-lz4|split-zstd|fp8-e4m3 (default split-zstd;\n"
            "                            fp8-e4m3 is LOSSY)\n"
            "  --level N                 entropy coder level (default: the codec's)\n"
            "  --batch-tokens N          tokens per forward pass (default 8192)\n"
            "  --max-len N               longest document accepted (default: the model's\n"
            "                            max_position_embeddings)\n"
            "  --device cpu              the backend (cpu; cuda arrives with the GPU extractor)\n"
            "  --threads N               compression threads (default: all CPUs)\n"
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

int cmd_extract(int argc, char **argv)
{
    df_extract_opts o = {.codec = DF_CODEC_SPLIT_ZSTD, .progress = 1, .world_size = 1};
    const char *layers = "auto", *device = "cpu";
    int ids[64];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        uint64_t x = 0;
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
        else if (!strcmp(a, "--codec")) {
            if ((o.codec = df_codec_from_name(v)) < 0) {
                fprintf(stderr, "dflash extract: unknown codec '%s' (stored, lz4, split-lz4, "
                                "split-zstd, fp8-e4m3)\n", v);
                return 2;
            }
        } else if (!parse_u64(v, &x) && !strcmp(a, "--level")) o.codec_level = (int)x;
        else if (!parse_u64(v, &x) && !strcmp(a, "--batch-tokens")) o.batch_tokens = (int64_t)x;
        else if (!parse_u64(v, &x) && !strcmp(a, "--max-len")) o.max_len = (int64_t)x;
        else if (!parse_u64(v, &x) && !strcmp(a, "--threads")) o.threads = (int)x;
        else if (!parse_u64(v, &x) && !strcmp(a, "--rank")) o.rank = (uint32_t)x;
        else if (!parse_u64(v, &x) && !strcmp(a, "--world-size") && x > 0) o.world_size = (uint32_t)x;
        else {
            fprintf(stderr, "dflash extract: bad option or value: %s %s\n", a, v);
            usage(stderr);
            return 2;
        }
    }
    if (!o.model_dir || !o.data_path || !o.out_dir) {
        fprintf(stderr, "dflash extract: --model, --data and --out are required\n");
        usage(stderr);
        return 2;
    }
    if (strcmp(device, "cpu")) {
        fprintf(stderr, "dflash extract: device '%s' is not built yet (cpu only; the CUDA "
                        "extractor is the next issue)\n", device);
        return 2;
    }
    if (o.rank >= o.world_size) {
        fprintf(stderr, "dflash extract: --rank %u out of range for --world-size %u\n", o.rank,
                o.world_size);
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
                ids[n++] = (int)v;
                p = *end ? end + 1 : end;
            }
            o.layer_ids = ids;
            o.n_layer_ids = n;
        }
    }
    df_err e = {0};
    df_backend *be = df_backend_cpu_open(0, &e);
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
    printf("extracted %s -> %s: %" PRIu64 " docs (%" PRIu64 " already there, %" PRIu64
           " empty skipped), %" PRIu64 " tokens in %.2f s (%.0f tok/s; forward %.2f s), layers",
           o.data_path, o.out_dir, st.docs, st.docs_skipped_resume, st.docs_empty, st.tokens,
           st.seconds, st.seconds > 0 ? st.tokens / st.seconds : 0.0, st.forward_seconds);
    for (int i = 0; i < st.n_layers; i++)
        printf("%s%d", i ? "," : " ", st.layer_ids[i]);
    printf(", %.1f MB raw -> %.1f MB stored (%.3f), %s\n", st.raw_bytes / 1e6,
           st.stored_bytes / 1e6, st.raw_bytes ? (double)st.stored_bytes / st.raw_bytes : 0.0,
           st.io_backend ? st.io_backend : "-");
    return 0;
}
