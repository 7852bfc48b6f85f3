/* cmd_dump_summary.c - `dflash dump CACHE_DIR` and `--samples`: the two views
 * made from the cache's index and meta alone (no record is read), as text or
 * --json. The summary also reads a projected cache's basis file for the
 * energy it keeps. Kept apart from the record-reading modes (--sample,
 * --verify) and from the command's option parsing (cmd_dump.c).
 */
#include <cjson/cJSON.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "basis.h"
#include "cache.h"
#include "codec.h"
#include "dtype.h"
#include "dump_internal.h"
#include "err.h"

/* ------------------------------------------------------------------ */
/* formatting helpers                                                  */

/* 12345678 -> "12,345,678" */
static const char *grouped(char *buf, size_t n, uint64_t v)
{
    char tmp[32];
    int len = snprintf(tmp, sizeof tmp, "%" PRIu64, v);
    size_t o = 0;
    for (int i = 0; i < len && o + 2 < n; i++) {
        if (i && (len - i) % 3 == 0)
            buf[o++] = ',';
        buf[o++] = tmp[i];
    }
    buf[o] = 0;
    return buf;
}

static const char *ratio_str(char *buf, size_t n, double num, double den)
{
    if (den > 0)
        snprintf(buf, n, "%.3f", num / den);
    else
        snprintf(buf, n, "-");
    return buf;
}

static void json_add_ratio(cJSON *o, const char *k, double num, double den)
{
    if (den > 0)
        cJSON_AddNumberToObject(o, k, num / den);
    else
        cJSON_AddNullToObject(o, k);
}

static void hex(char *out, const uint8_t *b, size_t n)
{
    static const char d[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = d[b[i] >> 4];
        out[2 * i + 1] = d[b[i] & 15];
    }
    out[2 * n] = 0;
}

/* Bytes of one token's hidden states over all stored layers. */
static uint64_t raw_bytes_per_token(const df_cache_params *p)
{
    return (uint64_t)p->n_layers * p->hidden_size * df_dtype_size(p->dtype);
}

/* ------------------------------------------------------------------ */
/* summary                                                             */

/* What a projected cache's basis file says of itself (dump --verify checks it). */
typedef struct basis_facts {
    int K, kind;
    int32_t layer_ids[DF_BASIS_MAX_LAYERS];
    double kept, layer_kept[DF_BASIS_MAX_LAYERS];
} basis_facts;

static int read_basis_facts(const char *dir, basis_facts *f)
{
    char path[4200];
    df_basis b = {0};
    df_err e = {0};
    snprintf(path, sizeof path, "%s/%s", dir, DF_CACHE_BASIS_FILE);
    if (df_basis_read(path, &b, &e))
        return -1;
    f->K = b.K;
    f->kind = b.kind;
    f->kept = b.kept;
    memcpy(f->layer_ids, b.layer_ids, sizeof f->layer_ids);
    memcpy(f->layer_kept, b.layer_kept, sizeof f->layer_kept);
    df_basis_free(&b);
    return 0;
}

int dump_summary(df_cache *c, const opts *o)
{
    const df_cache_info *inf = df_cache_get_info(c);
    const df_cache_params *p = &inf->params;
    uint64_t rpt = raw_bytes_per_token(p);
    double tok = (double)inf->tokens;

    if (o->json) {
        cJSON *r = cJSON_CreateObject(), *t, *a, *cd, *sh, *bpt, *corp;
        char uuid[33];
        hex(uuid, p->uuid, 16);
        cJSON_AddStringToObject(r, "dir", df_cache_dir(c));
        cJSON_AddStringToObject(r, "created_by", inf->created_by);
        cJSON_AddNumberToObject(r, "format_version",
                                p->proj_rank ? DF_CACHE_VERSION_PROJECTED : DF_CACHE_VERSION);
        cJSON_AddStringToObject(r, "uuid", uuid);
        cJSON_AddItemToObject(r, "target", t = cJSON_CreateObject());
        cJSON_AddStringToObject(t, "model_type", p->model_type);
        cJSON_AddStringToObject(t, "target_name", p->target_name);
        cJSON_AddStringToObject(t, "config_sha256", p->config_sha256);
        cJSON_AddNumberToObject(t, "hidden_size", df_cache_target_hidden(p));
        cJSON_AddNumberToObject(t, "num_layers", p->num_target_layers);
        cJSON_AddNumberToObject(t, "vocab_size", (double)p->vocab_size);
        cJSON_AddItemToObject(r, "layer_ids", a = cJSON_CreateArray());
        for (uint32_t i = 0; i < p->n_layers && i < DF_CACHE_MAX_LAYERS; i++)
            cJSON_AddItemToArray(a, cJSON_CreateNumber(p->layer_ids[i]));
        cJSON_AddStringToObject(r, "dtype", df_dtype_name(p->dtype));
        cJSON_AddItemToObject(r, "codec", cd = cJSON_CreateObject());
        cJSON_AddNumberToObject(cd, "id", p->codec);
        cJSON_AddStringToObject(cd, "name", df_codec_name(p->codec));
        cJSON_AddNumberToObject(cd, "level", p->codec_level);
        cJSON_AddBoolToObject(cd, "lossy", df_codec_is_lossy(p->codec) ? 1 : 0);
        if (p->proj_rank) {
            cJSON *pj = cJSON_AddObjectToObject(r, "projection");
            cJSON_AddNumberToObject(pj, "rank", p->proj_rank);
            cJSON_AddItemToObject(pj, "source_layer_ids", a = cJSON_CreateArray());
            for (uint32_t i = 0; i < p->src_n_layers; i++)
                cJSON_AddItemToArray(a, cJSON_CreateNumber(p->src_layer_ids[i]));
            cJSON_AddNumberToObject(pj, "source_hidden_size", p->src_hidden);
            cJSON_AddStringToObject(pj, "basis_sha256", p->basis_sha256);
            double src_raw = (double)p->src_n_layers * p->src_hidden * df_dtype_size(p->dtype);
            json_add_ratio(pj, "ratio_of_source", (double)inf->stored_bytes, src_raw * tok);
            basis_facts bf;
            if (!read_basis_facts(df_cache_dir(c), &bf)) {
                cJSON_AddNumberToObject(pj, "kept_energy", bf.kept);
                cJSON_AddItemToObject(pj, "kept_energy_per_layer", a = cJSON_CreateArray());
                for (int k = 0; k < bf.K; k++)
                    cJSON_AddItemToArray(a, cJSON_CreateNumber(bf.layer_kept[k]));
                cJSON_AddStringToObject(pj, "basis_kind", bf.kind == DF_BASIS_KIND_ROWS
                                                              ? "rows" : "moment");
            }
        }
        cJSON_AddNumberToObject(r, "rows_per_block", p->rows_per_block);
        cJSON_AddNumberToObject(r, "world_size", p->world_size);
        cJSON_AddItemToObject(r, "shards", sh = cJSON_CreateObject());
        cJSON_AddNumberToObject(sh, "count", inf->n_shards);
        cJSON_AddNumberToObject(sh, "file_bytes", (double)inf->file_bytes);
        cJSON_AddItemToObject(sh, "list", a = cJSON_CreateArray());
        for (uint32_t s = 0; s < inf->n_shards && inf->shards; s++) {
            const df_cache_shard_info *si = &inf->shards[s];
            cJSON *x = cJSON_CreateObject();
            cJSON_AddStringToObject(x, "data", si->data);
            cJSON_AddStringToObject(x, "index", si->index);
            cJSON_AddNumberToObject(x, "rank", si->rank);
            cJSON_AddNumberToObject(x, "seq", si->seq);
            cJSON_AddNumberToObject(x, "samples", (double)si->samples);
            cJSON_AddNumberToObject(x, "tokens", (double)si->tokens);
            cJSON_AddNumberToObject(x, "bytes", (double)si->bytes);
            cJSON_AddItemToArray(a, x);
        }
        cJSON_AddNumberToObject(r, "samples", (double)inf->samples);
        cJSON_AddNumberToObject(r, "tokens", (double)inf->tokens);
        cJSON_AddNumberToObject(r, "loss_tokens", (double)inf->loss_tokens);
        cJSON_AddNumberToObject(r, "raw_bytes", (double)inf->raw_bytes);
        cJSON_AddNumberToObject(r, "stored_bytes", (double)inf->stored_bytes);
        cJSON_AddItemToObject(r, "bytes_per_token", bpt = cJSON_CreateObject());
        json_add_ratio(bpt, "stored", (double)inf->stored_bytes, tok);
        json_add_ratio(bpt, "file", (double)inf->file_bytes, tok);
        cJSON_AddNumberToObject(bpt, "raw", (double)rpt);
        json_add_ratio(r, "ratio", (double)inf->stored_bytes, (double)inf->raw_bytes);
        json_add_ratio(r, "file_ratio", (double)inf->file_bytes, (double)rpt * tok);
        cJSON_AddItemToObject(r, "layers", a = cJSON_CreateArray());
        for (uint32_t i = 0; i < p->n_layers && i < DF_CACHE_MAX_LAYERS; i++) {
            cJSON *x = cJSON_CreateObject();
            cJSON_AddNumberToObject(x, "layer", p->layer_ids[i]);
            cJSON_AddNumberToObject(x, "raw_bytes", (double)inf->layer_raw[i]);
            cJSON_AddNumberToObject(x, "stored_bytes", (double)inf->layer_stored[i]);
            json_add_ratio(x, "ratio", (double)inf->layer_stored[i], (double)inf->layer_raw[i]);
            cJSON_AddItemToArray(a, x);
        }
        cJSON_AddItemToObject(r, "corpus", corp = cJSON_CreateObject());
        cJSON_AddStringToObject(corp, "fingerprint", p->corpus_fingerprint);
        cJSON_AddNumberToObject(corp, "docs", (double)p->corpus_docs);
        return dump_json_emit(r) ? EXIT_DATA : EXIT_OK;
    }

    char b1[32], b2[32], b3[32], b4[32];
    printf("cache        %s\n", df_cache_dir(c));
    printf("created by   %s\n", inf->created_by[0] ? inf->created_by : "?");
    printf("target       %s '%s'  config sha256 %.12s  hidden %" PRIu32 "  layers %" PRIu32
           "  vocab %" PRId64 "\n",
           p->model_type, p->target_name, p->config_sha256, df_cache_target_hidden(p),
           p->num_target_layers, p->vocab_size);
    if (p->proj_rank) {
        printf("features     PROJECTED: z = P x, rank %" PRIu32 " of %" PRIu32 " x %" PRIu32
               " (layers", p->proj_rank, p->src_n_layers, p->src_hidden);
        for (uint32_t i = 0; i < p->src_n_layers; i++)
            printf(" %" PRId32, p->src_layer_ids[i]);
        printf("), basis %s sha256 %.12s\n", DF_CACHE_BASIS_FILE, p->basis_sha256);
        basis_facts bf;
        if (read_basis_facts(df_cache_dir(c), &bf))
            printf("basis        unreadable (dflash dump --verify says why)\n");
        else {
            printf("basis        %s, keeps %.2f%% of the features' energy; per layer:",
                   bf.kind == DF_BASIS_KIND_ROWS ? "a drafter's fc rows" : "top eigenvectors",
                   100 * bf.kept);
            for (int k = 0; k < bf.K; k++)
                printf(" %d: %.2f%%", bf.layer_ids[k], 100 * bf.layer_kept[k]);
            printf("\n");
        }
        double src_raw = (double)p->src_n_layers * p->src_hidden * df_dtype_size(p->dtype);
        if (inf->tokens)
            printf("of source    stored %s of the raw features' %s per token (%s)\n",
                   dump_human_bytes(b1, sizeof b1, (double)inf->stored_bytes / tok),
                   dump_human_bytes(b2, sizeof b2, src_raw),
                   ratio_str(b3, sizeof b3, (double)inf->stored_bytes, src_raw * tok));
    } else {
        printf("features     %" PRIu32 " layer%s:", p->n_layers, p->n_layers == 1 ? "" : "s");
        for (uint32_t i = 0; i < p->n_layers && i < DF_CACHE_MAX_LAYERS; i++)
            printf(" %" PRId32, p->layer_ids[i]);
        printf("\n");
    }
    printf("dtype        %s\n", df_dtype_name(p->dtype));
    if (p->codec_level)
        snprintf(b1, sizeof b1, "level %d", p->codec_level);
    else
        snprintf(b1, sizeof b1, "default level");
    printf("codec        %s (%s), %s\n", df_codec_name(p->codec), b1,
           df_codec_is_lossy(p->codec) ? "LOSSY" : p->proj_rank ? "lossless (of z)" : "lossless");
    printf("block        %" PRIu32 " rows\n", p->rows_per_block);
    printf("shards       %" PRIu32 " (%" PRIu32 " writer rank%s), %s\n", inf->n_shards,
           p->world_size, p->world_size == 1 ? "" : "s",
           dump_human_bytes(b1, sizeof b1, (double)inf->file_bytes));
    printf("samples      %s\n", grouped(b1, sizeof b1, inf->samples));
    printf("tokens       %s, loss tokens %s (%s%%)\n", grouped(b1, sizeof b1, inf->tokens),
           grouped(b2, sizeof b2, inf->loss_tokens),
           inf->tokens ? (snprintf(b3, sizeof b3, "%.1f",
                                   100.0 * (double)inf->loss_tokens / tok), b3) : "-");
    if (inf->tokens)
        printf("bytes/token  raw %s, stored %s (hidden states), file %s (with headers, "
               "tokens, padding)\n",
               dump_human_bytes(b1, sizeof b1, (double)rpt),
               dump_human_bytes(b2, sizeof b2, (double)inf->stored_bytes / tok),
               dump_human_bytes(b3, sizeof b3, (double)inf->file_bytes / tok));
    else
        printf("bytes/token  raw %s, stored -, file -\n",
               dump_human_bytes(b1, sizeof b1, (double)rpt));
    printf("ratio        %s stored/raw, %s file/raw (%s raw hidden states -> %s stored)\n",
           ratio_str(b1, sizeof b1, (double)inf->stored_bytes, (double)inf->raw_bytes),
           ratio_str(b2, sizeof b2, (double)inf->file_bytes, (double)rpt * tok),
           dump_human_bytes(b3, sizeof b3, (double)inf->raw_bytes),
           dump_human_bytes(b4, sizeof b4, (double)inf->stored_bytes));
    printf("  %-6s %12s %12s %7s\n", "layer", "raw", "stored", "ratio");
    for (uint32_t i = 0; i < p->n_layers && i < DF_CACHE_MAX_LAYERS; i++)
        printf("  %-6s %12s %12s %7s\n", p->proj_rank ? "z" : (snprintf(b4, sizeof b4, "%" PRId32,
                                                                       p->layer_ids[i]), b4),
               dump_human_bytes(b1, sizeof b1, (double)inf->layer_raw[i]),
               dump_human_bytes(b2, sizeof b2, (double)inf->layer_stored[i]),
               ratio_str(b3, sizeof b3, (double)inf->layer_stored[i], (double)inf->layer_raw[i]));
    printf("corpus       fingerprint %.16s  docs %s\n",
           p->corpus_fingerprint[0] ? p->corpus_fingerprint : "-",
           grouped(b1, sizeof b1, p->corpus_docs));
    return EXIT_OK;
}

/* ------------------------------------------------------------------ */
/* sample listing                                                      */

int dump_samples(df_cache *c, const opts *o)
{
    const df_cache_info *inf = df_cache_get_info(c);
    uint64_t rpt = raw_bytes_per_token(&inf->params);
    size_t total = df_cache_count(c);
    uint64_t first = o->offset < total ? o->offset : total;
    uint64_t last = o->limit == 0 || total - first < o->limit ? total : first + o->limit;

    if (o->json) {
        cJSON *r = cJSON_CreateObject(), *a;
        cJSON_AddNumberToObject(r, "total", (double)total);
        cJSON_AddNumberToObject(r, "offset", (double)o->offset);
        cJSON_AddNumberToObject(r, "limit", (double)o->limit);
        cJSON_AddItemToObject(r, "samples", a = cJSON_CreateArray());
        for (uint64_t k = first; k < last; k++) {
            const df_cache_entry *en = df_cache_entry_at(c, (size_t)k);
            cJSON *x = cJSON_CreateObject();
            cJSON_AddNumberToObject(x, "id", (double)en->id);
            cJSON_AddNumberToObject(x, "n_tokens", en->n_tokens);
            cJSON_AddNumberToObject(x, "n_loss", en->n_loss);
            cJSON_AddStringToObject(x, "shard", dump_shard_name(inf, en->shard));
            cJSON_AddNumberToObject(x, "offset", (double)en->offset);
            cJSON_AddNumberToObject(x, "record_bytes", (double)en->record_bytes);
            cJSON_AddNumberToObject(x, "stored_bytes", (double)en->stored_bytes);
            json_add_ratio(x, "ratio", (double)en->stored_bytes, (double)rpt * en->n_tokens);
            cJSON_AddItemToArray(a, x);
        }
        return dump_json_emit(r) ? EXIT_DATA : EXIT_OK;
    }

    char b1[32], b2[32], b3[32];
    if (first == last)
        printf("%s samples; none at --offset %" PRIu64 "\n", grouped(b1, sizeof b1, total),
               o->offset);
    else
        printf("%s samples; showing positions %" PRIu64 "..%" PRIu64 "%s\n",
               grouped(b1, sizeof b1, total), first, last - 1,
               last < total ? " (--offset/--limit for more)" : "");
    if (first == last)
        return EXIT_OK;
    printf("%12s %8s %8s  %-24s %14s %10s %10s %6s\n", "id", "tokens", "loss", "shard", "offset",
           "record", "stored", "ratio");
    for (uint64_t k = first; k < last; k++) {
        const df_cache_entry *en = df_cache_entry_at(c, (size_t)k);
        printf("%12" PRIu64 " %8" PRIu32 " %8" PRIu32 "  %-24s %14" PRIu64 " %10s %10s %6s\n",
               en->id, en->n_tokens, en->n_loss, dump_shard_name(inf, en->shard), en->offset,
               dump_human_bytes(b1, sizeof b1, (double)en->record_bytes),
               dump_human_bytes(b2, sizeof b2, (double)en->stored_bytes),
               ratio_str(b3, sizeof b3, (double)en->stored_bytes, (double)rpt * en->n_tokens));
    }
    return EXIT_OK;
}
