/* cache_meta.c - meta.json (parameters), rank-RRRR.json (one writer's
 * finished shards) and manifest.json (the finished cache), all via cJSON. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cache.h"
#include "cache_internal.h"
#include "crc32c.h"
#include "fsutil.h"

#ifndef DFLASH_VERSION
#define DFLASH_VERSION "0.1.0"
#endif

static void hex16(const uint8_t *u, char out[33])
{
    for (int i = 0; i < 16; i++)
        snprintf(out + 2 * i, 3, "%02x", u[i]);
}

static int unhex16(const char *s, uint8_t *u)
{
    if (strlen(s) != 32)
        return -1;
    for (int i = 0; i < 16; i++) {
        unsigned v;
        if (sscanf(s + 2 * i, "%2x", &v) != 1)
            return -1;
        u[i] = (uint8_t)v;
    }
    return 0;
}

/* ---- checksums over canonical values ----
 * Each parameter a reader relies on has a name (its JSON path) and a
 * canonical text made from the parsed value, not from the JSON text, so
 * whitespace, number spelling and key order do not matter. "checksums" in
 * meta.json and manifest.json maps each name to the CRC-32C of "name=text"
 * as 8 hex digits: an edit of a value (a bit flip in "layers", a vocab, a
 * codec level, a corpus fingerprint) is an error naming the file and field. */
#define CANON_MAX 4096 /* DF_CACHE_MAX_LAYERS ids of up to 7 digits and a comma */
#define CANON_FIELDS 19 /* canon_field's count: the manifest's part fields follow */

/* Field i of p: its name and canonical text; 0 past the last field. */
static int canon_field(const df_cache_params *p, int i, const char **name, char *v, size_t n)
{
    const int32_t *ids;
    uint32_t nids = df_cache_target_layers(p, &ids);
    char uuid[33];
    switch (i) {
    case 0: *name = "version"; snprintf(v, n, "%d", p->proj_rank ? DF_CACHE_VERSION_PROJECTED : DF_CACHE_VERSION); return 1;
    case 1: *name = "uuid"; hex16(p->uuid, uuid); snprintf(v, n, "%s", uuid); return 1;
    case 2: *name = "target.model_type"; snprintf(v, n, "%s", p->model_type); return 1;
    case 3: *name = "target.name"; snprintf(v, n, "%s", p->target_name); return 1;
    case 4: *name = "target.config_sha256"; snprintf(v, n, "%s", p->config_sha256); return 1;
    case 5: *name = "target.hidden_size"; snprintf(v, n, "%u", df_cache_target_hidden(p)); return 1;
    case 6: *name = "target.num_hidden_layers"; snprintf(v, n, "%u", p->num_target_layers); return 1;
    case 7: *name = "target.vocab_size"; snprintf(v, n, "%" PRId64, p->vocab_size); return 1;
    case 8: {
        *name = "layers";
        size_t o = 0;
        v[0] = 0;
        for (uint32_t k = 0; k < nids && o < n; k++)
            o += (size_t)snprintf(v + o, n - o, "%s%d", k ? "," : "", ids[k]);
        return 1;
    }
    case 9: *name = "projection.rank"; snprintf(v, n, "%u", p->proj_rank); return 1;
    case 10: *name = "projection.basis_sha256"; snprintf(v, n, "%s", p->proj_rank ? p->basis_sha256 : ""); return 1;
    case 11: *name = "dtype"; snprintf(v, n, "%s", df_dtype_name(p->dtype)); return 1;
    case 12: *name = "codec"; snprintf(v, n, "%s", df_codec_name(p->codec)); return 1;
    case 13: *name = "codec_level"; snprintf(v, n, "%d", p->codec_level); return 1;
    case 14: *name = "rows_per_block"; snprintf(v, n, "%u", p->rows_per_block); return 1;
    case 15: *name = "shard_bytes"; snprintf(v, n, "%" PRIu64, p->shard_bytes); return 1;
    case 16: *name = "corpus.fingerprint"; snprintf(v, n, "%s", p->corpus_fingerprint); return 1;
    case 17: *name = "corpus.docs"; snprintf(v, n, "%" PRIu64, p->corpus_docs); return 1;
    case 18: *name = "world_size"; snprintf(v, n, "%u", p->world_size); return 1;
    default: return 0;
    }
}

static uint32_t field_crc(const char *name, const char *v)
{
    uint32_t c = df_crc32c(0, name, strlen(name));
    c = df_crc32c(c, "=", 1);
    return df_crc32c(c, v, strlen(v));
}

uint32_t df_cache_params_crc(const df_cache_params *p)
{
    char v[CANON_MAX];
    const char *name;
    uint32_t c = 0;
    for (int i = 0; canon_field(p, i, &name, v, sizeof v); i++) {
        c = df_crc32c(c, name, strlen(name));
        c = df_crc32c(c, "=", 1);
        c = df_crc32c(c, v, strlen(v));
        c = df_crc32c(c, "\n", 1);
    }
    return c ? c : 1; /* 0 is "none" in a shard header */
}

static void add_crc(cJSON *cs, const char *name, uint32_t crc)
{
    char hex[9];
    snprintf(hex, sizeof hex, "%08x", crc);
    cJSON_AddStringToObject(cs, name, hex);
}

/* Canonical text of a manifest's shards, totals or layer_bytes (which = 0, 1,
 * 2) into a malloc'd string. */
static char *canon_part(const df_cache_part *a, int which)
{
    size_t cap = 256 + (which == 0 ? (size_t)a->n_shards * 200 : which == 2 ? (size_t)a->n_layers * 48 : 0);
    char *v = malloc(cap);
    if (!v)
        return NULL;
    size_t o = 0;
    v[0] = 0;
    if (which == 0) {
        for (uint32_t i = 0; i < a->n_shards && o < cap; i++) {
            const df_cache_shard_info *x = &a->shards[i];
            o += (size_t)snprintf(v + o, cap - o, "%s,%s,%u,%u,%" PRIu64 ",%" PRIu64 ",%" PRIu64 ";",
                                  x->data, x->index, x->rank, x->seq, x->samples, x->tokens, x->bytes);
        }
    } else if (which == 1) {
        snprintf(v, cap, "%" PRIu64 ",%" PRIu64 ",%" PRIu64 ",%" PRIu64 ",%" PRIu64, a->samples,
                 a->tokens, a->loss_tokens, a->raw_bytes, a->stored_bytes);
    } else {
        for (uint32_t l = 0; l < a->n_layers && o < cap; l++)
            o += (size_t)snprintf(v + o, cap - o, "%" PRIu64 ",%" PRIu64 ";", a->layer_raw[l],
                                  a->layer_stored[l]);
    }
    return v;
}

static const char *const part_fields[3] = {"shards", "totals", "layer_bytes"};

void df_cache_part_checksums(cJSON *o, const df_cache_part *all)
{
    cJSON *cs = cJSON_GetObjectItemCaseSensitive(o, "checksums");
    for (int w = 0; cs && w < 3; w++) {
        char *v = canon_part(all, w);
        if (v)
            add_crc(cs, part_fields[w], field_crc(part_fields[w], v));
        free(v);
    }
}

/* "checksums" of o against p (and all, for a manifest: NULL for meta.json).
 * A file without "checksums" was written before them: accepted as it is
 * (its shards' headers still cross-check the parameters, see
 * df_cache_shard_header_check). */
static int check_checksums(const cJSON *o, const df_cache_params *p, const df_cache_part *all,
                           const char *path, df_err *e)
{
    const cJSON *cs = cJSON_GetObjectItemCaseSensitive(o, "checksums");
    if (!cs)
        return 0;
    if (!cJSON_IsObject(cs))
        return df_errf(e, -DF_ECORRUPT, "%s: \"checksums\" is not an object", path);
    char v[CANON_MAX];
    const char *name;
    int n = all ? 3 : 0;
    for (int i = 0; ; i++) {
        char *pv = NULL;
        if (canon_field(p, i, &name, v, sizeof v)) {
            /* projection fields only in a projected cache */
            if (!p->proj_rank && !strncmp(name, "projection.", 11))
                continue;
        } else if (i - CANON_FIELDS < n) {
            name = part_fields[i - CANON_FIELDS];
            if (!(pv = canon_part(all, i - CANON_FIELDS)))
                return df_errf(e, -ENOMEM, "out of memory");
        } else {
            break;
        }
        const cJSON *x = cJSON_GetObjectItemCaseSensitive(cs, name);
        char hex[9];
        snprintf(hex, sizeof hex, "%08x", field_crc(name, pv ? pv : v));
        free(pv);
        if (!cJSON_IsString(x))
            return df_errf(e, -DF_ECORRUPT, "%s: \"checksums\" lacks \"%s\"", path, name);
        if (strcmp(x->valuestring, hex))
            return df_errf(e, -DF_ECORRUPT, "%s: \"%s\" does not match its checksum (%s in "
                           "\"checksums\", the value gives %s): the file was edited or corrupted",
                           path, name, x->valuestring, hex);
    }
    return 0;
}

cJSON *df_cache_params_json(const df_cache_params *p)
{
    cJSON *o = cJSON_CreateObject();
    char uuid[33];
    hex16(p->uuid, uuid);
    cJSON_AddStringToObject(o, "format", "dflash-hidden-state-cache");
    cJSON_AddNumberToObject(o, "version",
                            p->proj_rank ? DF_CACHE_VERSION_PROJECTED : DF_CACHE_VERSION);
    cJSON_AddStringToObject(o, "uuid", uuid);
    cJSON *t = cJSON_AddObjectToObject(o, "target");
    cJSON_AddStringToObject(t, "model_type", p->model_type);
    cJSON_AddStringToObject(t, "name", p->target_name);
    cJSON_AddStringToObject(t, "config_sha256", p->config_sha256);
    cJSON_AddNumberToObject(t, "hidden_size", df_cache_target_hidden(p));
    cJSON_AddNumberToObject(t, "num_hidden_layers", p->num_target_layers);
    cJSON_AddNumberToObject(t, "vocab_size", (double)p->vocab_size);
    cJSON *ly = cJSON_AddArrayToObject(o, "layers");
    const int32_t *ids;
    uint32_t nids = df_cache_target_layers(p, &ids);
    for (uint32_t i = 0; i < nids; i++)
        cJSON_AddItemToArray(ly, cJSON_CreateNumber(ids[i]));
    if (p->proj_rank) {
        cJSON *pj = cJSON_AddObjectToObject(o, "projection");
        cJSON_AddNumberToObject(pj, "rank", p->proj_rank);
        cJSON_AddStringToObject(pj, "basis", DF_CACHE_BASIS_FILE);
        cJSON_AddStringToObject(pj, "basis_sha256", p->basis_sha256);
    }
    cJSON_AddStringToObject(o, "dtype", df_dtype_name(p->dtype));
    cJSON_AddStringToObject(o, "codec", df_codec_name(p->codec));
    cJSON_AddNumberToObject(o, "codec_level", p->codec_level);
    cJSON_AddBoolToObject(o, "lossy", df_codec_is_lossy(p->codec) || p->proj_rank); /* z drops what P does not span */
    cJSON_AddNumberToObject(o, "rows_per_block", p->rows_per_block);
    cJSON_AddNumberToObject(o, "shard_bytes", (double)p->shard_bytes);
    cJSON_AddStringToObject(o, "checksum", "crc32c");
    cJSON_AddNumberToObject(o, "alignment", DF_CACHE_ALIGN);
    cJSON *c = cJSON_AddObjectToObject(o, "corpus");
    cJSON_AddStringToObject(c, "fingerprint", p->corpus_fingerprint);
    cJSON_AddNumberToObject(c, "docs", (double)p->corpus_docs);
    cJSON_AddNumberToObject(o, "world_size", p->world_size);
    cJSON *cs = cJSON_AddObjectToObject(o, "checksums");
    char v[CANON_MAX];
    const char *name;
    for (int i = 0; canon_field(p, i, &name, v, sizeof v); i++)
        if (p->proj_rank || strncmp(name, "projection.", 11))
            add_crc(cs, name, field_crc(name, v));
    return o;
}

char *df_cache_params_to_json(const df_cache_params *p)
{
    cJSON *o = df_cache_params_json(p);
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    return s;
}

/* Field getters that fail with the key's name. */
static int get_num(const cJSON *o, const char *k, double lo, double hi, double *v,
                   const char *path, df_err *e)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, k);
    if (!cJSON_IsNumber(x))
        return df_errf(e, -DF_ECORRUPT, "%s: \"%s\" missing or not a number", path, k);
    if (!(x->valuedouble >= lo && x->valuedouble <= hi) || x->valuedouble != (double)(int64_t)x->valuedouble)
        return df_errf(e, -DF_ECORRUPT, "%s: \"%s\" = %g out of range", path, k, x->valuedouble);
    *v = x->valuedouble;
    return 0;
}

static int get_str(const cJSON *o, const char *k, char *dst, size_t n, const char *path,
                   df_err *e)
{
    const cJSON *x = cJSON_GetObjectItemCaseSensitive(o, k);
    if (!cJSON_IsString(x) || strlen(x->valuestring) >= n)
        return df_errf(e, -DF_ECORRUPT, "%s: \"%s\" missing, not a string or too long", path, k);
    memcpy(dst, x->valuestring, strlen(x->valuestring) + 1);
    return 0;
}

int df_cache_params_from_cjson(const cJSON *o, const char *path, df_cache_params *p, df_err *e)
{
    memset(p, 0, sizeof *p);
    char s[64];
    double v = 0;
    int rc;
    if (!cJSON_IsObject(o))
        return df_errf(e, -DF_ECORRUPT, "%s: not a JSON object", path);
    if ((rc = get_str(o, "format", s, sizeof s, path, e)))
        return rc;
    if (strcmp(s, "dflash-hidden-state-cache"))
        return df_errf(e, -DF_ECORRUPT, "%s: format \"%s\" is not a dflash cache", path, s);
    if ((rc = get_num(o, "version", 0, 1e9, &v, path, e)))
        return rc;
    if (v != DF_CACHE_VERSION && v != DF_CACHE_VERSION_PROJECTED)
        return df_errf(e, -DF_EVERSION, "%s: cache version %g; this build reads versions %d and %d",
                       path, v, DF_CACHE_VERSION, DF_CACHE_VERSION_PROJECTED);
    const cJSON *pj = cJSON_GetObjectItemCaseSensitive(o, "projection");
    if ((v == DF_CACHE_VERSION_PROJECTED) != (pj != NULL))
        return df_errf(e, -DF_ECORRUPT, "%s: version %g %s a \"projection\" object", path, v,
                       pj ? "with" : "without");
    char uuid[40];
    if ((rc = get_str(o, "uuid", uuid, sizeof uuid, path, e)))
        return rc;
    if (unhex16(uuid, p->uuid))
        return df_errf(e, -DF_ECORRUPT, "%s: bad uuid \"%s\"", path, uuid);
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "target");
    if (!cJSON_IsObject(t))
        return df_errf(e, -DF_ECORRUPT, "%s: \"target\" missing", path);
    if ((rc = get_str(t, "model_type", p->model_type, sizeof p->model_type, path, e)) ||
        (rc = get_str(t, "name", p->target_name, sizeof p->target_name, path, e)) ||
        (rc = get_str(t, "config_sha256", p->config_sha256, sizeof p->config_sha256, path, e)))
        return rc;
    if ((rc = get_num(t, "hidden_size", 1, DF_CACHE_MAX_HIDDEN, &v, path, e)))
        return rc;
    p->hidden_size = (uint32_t)v;
    if ((rc = get_num(t, "num_hidden_layers", 0, 1e6, &v, path, e)))
        return rc;
    p->num_target_layers = (uint32_t)v;
    if ((rc = get_num(t, "vocab_size", 0, 1e12, &v, path, e)))
        return rc;
    p->vocab_size = (int64_t)v;
    const cJSON *ly = cJSON_GetObjectItemCaseSensitive(o, "layers");
    int nl = cJSON_GetArraySize(ly);
    if (!cJSON_IsArray(ly) || nl < 1 || nl > DF_CACHE_MAX_LAYERS)
        return df_errf(e, -DF_ECORRUPT, "%s: \"layers\" must list 1..%d layer ids", path,
                       DF_CACHE_MAX_LAYERS);
    p->n_layers = (uint32_t)nl;
    for (int i = 0; i < nl; i++) {
        const cJSON *x = cJSON_GetArrayItem(ly, i);
        if (!cJSON_IsNumber(x) || x->valuedouble < 0 || x->valuedouble > 1e6)
            return df_errf(e, -DF_ECORRUPT, "%s: layers[%d] is not a layer id", path, i);
        p->layer_ids[i] = (int32_t)x->valuedouble;
    }
    if (pj) { /* the stored rows are z: one "layer" of rank values (cache.h) */
        if (!cJSON_IsObject(pj))
            return df_errf(e, -DF_ECORRUPT, "%s: \"projection\" is not an object", path);
        if ((rc = get_num(pj, "rank", 1, DF_CACHE_MAX_HIDDEN, &v, path, e)) ||
            (rc = get_str(pj, "basis_sha256", p->basis_sha256, sizeof p->basis_sha256, path, e)) ||
            (rc = get_str(pj, "basis", s, sizeof s, path, e)))
            return rc;
        if (strcmp(s, DF_CACHE_BASIS_FILE))
            return df_errf(e, -DF_ECORRUPT, "%s: projection basis \"%s\", want \"%s\"", path, s,
                           DF_CACHE_BASIS_FILE);
        p->proj_rank = (uint32_t)v;
        p->src_hidden = p->hidden_size;
        p->src_n_layers = p->n_layers;
        memcpy(p->src_layer_ids, p->layer_ids, sizeof p->layer_ids);
        p->hidden_size = p->proj_rank;
        p->n_layers = 1;
        memset(p->layer_ids, 0, sizeof p->layer_ids);
        p->layer_ids[0] = DF_CACHE_PROJECTED_LAYER;
    }
    if ((rc = get_str(o, "dtype", s, sizeof s, path, e)))
        return rc;
    p->dtype = df_dtype_from_name(s);
    if ((rc = get_str(o, "codec", s, sizeof s, path, e)))
        return rc;
    p->codec = df_codec_from_name(s);
    if (p->codec < 0)
        return df_errf(e, -DF_ECORRUPT,
                       "%s: unknown codec \"%s\" (not one of this dflash's; a newer one wrote it?)",
                       path, s);
    if ((rc = get_num(o, "codec_level", -1000, 1000, &v, path, e)))
        return rc;
    p->codec_level = (int)v;
    if ((rc = get_num(o, "rows_per_block", 1, DF_CACHE_MAX_TOKENS, &v, path, e)))
        return rc;
    p->rows_per_block = (uint32_t)v;
    if ((rc = get_num(o, "shard_bytes", DF_CACHE_ALIGN, 1e15, &v, path, e)))
        return rc;
    p->shard_bytes = (uint64_t)v;
    const cJSON *c = cJSON_GetObjectItemCaseSensitive(o, "corpus");
    if (!cJSON_IsObject(c))
        return df_errf(e, -DF_ECORRUPT, "%s: \"corpus\" missing", path);
    if ((rc = get_str(c, "fingerprint", p->corpus_fingerprint, sizeof p->corpus_fingerprint,
                      path, e)))
        return rc;
    if ((rc = get_num(c, "docs", 0, 1e15, &v, path, e)))
        return rc;
    p->corpus_docs = (uint64_t)v;
    if ((rc = get_num(o, "world_size", 1, 1e6, &v, path, e)))
        return rc;
    p->world_size = (uint32_t)v;
    rc = df_cache_params_finish(p, e);
    if (rc)
        return df_err_wrap(e, "%s", path);
    return check_checksums(o, p, NULL, path, e);
}

int df_cache_params_from_json(const char *json, size_t len, const char *path, df_cache_params *p,
                              df_err *e)
{
    cJSON *o = cJSON_ParseWithLength(json, len);
    if (!o)
        return df_errf(e, -DF_ECORRUPT, "%s: not valid JSON", path);
    int rc = df_cache_params_from_cjson(o, path, p, e);
    cJSON_Delete(o);
    return rc;
}

/* ---- rank parts and the manifest ---- */

cJSON *df_cache_part_json(const df_cache_part *part)
{
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "rank", part->rank);
    if (part->has_uuid) { /* which cache the shards belong to: the merge checks it */
        char uuid[33];
        hex16(part->uuid, uuid);
        cJSON_AddStringToObject(o, "uuid", uuid);
    }
    cJSON *sh = cJSON_AddArrayToObject(o, "shards");
    for (uint32_t i = 0; i < part->n_shards; i++) {
        const df_cache_shard_info *s = &part->shards[i];
        cJSON *x = cJSON_CreateObject();
        cJSON_AddStringToObject(x, "data", s->data);
        cJSON_AddStringToObject(x, "index", s->index);
        cJSON_AddNumberToObject(x, "rank", s->rank);
        cJSON_AddNumberToObject(x, "seq", s->seq);
        cJSON_AddNumberToObject(x, "samples", (double)s->samples);
        cJSON_AddNumberToObject(x, "tokens", (double)s->tokens);
        cJSON_AddNumberToObject(x, "bytes", (double)s->bytes);
        cJSON_AddItemToArray(sh, x);
    }
    cJSON *t = cJSON_AddObjectToObject(o, "totals");
    cJSON_AddNumberToObject(t, "samples", (double)part->samples);
    cJSON_AddNumberToObject(t, "tokens", (double)part->tokens);
    cJSON_AddNumberToObject(t, "loss_tokens", (double)part->loss_tokens);
    cJSON_AddNumberToObject(t, "raw_bytes", (double)part->raw_bytes);
    cJSON_AddNumberToObject(t, "stored_bytes", (double)part->stored_bytes);
    cJSON *ls = cJSON_AddArrayToObject(o, "layer_bytes");
    for (uint32_t l = 0; l < part->n_layers; l++) {
        cJSON *x = cJSON_CreateObject();
        cJSON_AddNumberToObject(x, "raw", (double)part->layer_raw[l]);
        cJSON_AddNumberToObject(x, "stored", (double)part->layer_stored[l]);
        cJSON_AddItemToArray(ls, x);
    }
    return o;
}

static int part_from_cjson(const cJSON *o, uint32_t n_layers, const char *path,
                           df_cache_part *part, df_err *e)
{
    memset(part, 0, sizeof *part);
    double v = 0;
    int rc;
    if ((rc = get_num(o, "rank", 0, 1e6, &v, path, e)))
        return rc;
    part->rank = (uint32_t)v;
    part->n_layers = n_layers;
    const cJSON *sh = cJSON_GetObjectItemCaseSensitive(o, "shards");
    if (!cJSON_IsArray(sh))
        return df_errf(e, -DF_ECORRUPT, "%s: \"shards\" missing", path);
    int n = cJSON_GetArraySize(sh);
    part->shards = calloc((size_t)(n > 0 ? n : 1), sizeof *part->shards);
    if (!part->shards)
        return df_errf(e, -ENOMEM, "%s: out of memory", path);
    part->n_shards = (uint32_t)n;
    for (int i = 0; i < n; i++) {
        const cJSON *x = cJSON_GetArrayItem(sh, i);
        df_cache_shard_info *s = &part->shards[i];
        if ((rc = get_str(x, "data", s->data, sizeof s->data, path, e)) ||
            (rc = get_str(x, "index", s->index, sizeof s->index, path, e)))
            return rc;
        if (strchr(s->data, '/') || strchr(s->index, '/'))
            return df_errf(e, -DF_ECORRUPT, "%s: shard names must be plain file names", path);
        if ((rc = get_num(x, "rank", 0, 1e6, &v, path, e)))
            return rc;
        s->rank = (uint32_t)v;
        if ((rc = get_num(x, "seq", 0, 1e9, &v, path, e)))
            return rc;
        s->seq = (uint32_t)v;
        if ((rc = get_num(x, "samples", 0, 1e15, &v, path, e)))
            return rc;
        s->samples = (uint64_t)v;
        if ((rc = get_num(x, "tokens", 0, 1e16, &v, path, e)))
            return rc;
        s->tokens = (uint64_t)v;
        if ((rc = get_num(x, "bytes", 0, 1e18, &v, path, e)))
            return rc;
        s->bytes = (uint64_t)v;
    }
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "totals");
    if (!cJSON_IsObject(t))
        return df_errf(e, -DF_ECORRUPT, "%s: \"totals\" missing", path);
    uint64_t *dst[] = {&part->samples, &part->tokens, &part->loss_tokens, &part->raw_bytes,
                       &part->stored_bytes};
    const char *keys[] = {"samples", "tokens", "loss_tokens", "raw_bytes", "stored_bytes"};
    for (int i = 0; i < 5; i++) {
        if ((rc = get_num(t, keys[i], 0, 1e18, &v, path, e)))
            return rc;
        *dst[i] = (uint64_t)v;
    }
    const cJSON *ls = cJSON_GetObjectItemCaseSensitive(o, "layer_bytes");
    if (!cJSON_IsArray(ls) || cJSON_GetArraySize(ls) != (int)n_layers)
        return df_errf(e, -DF_ECORRUPT, "%s: \"layer_bytes\" must have %u entries", path,
                       n_layers);
    for (uint32_t l = 0; l < n_layers; l++) {
        const cJSON *x = cJSON_GetArrayItem(ls, (int)l);
        if ((rc = get_num(x, "raw", 0, 1e18, &v, path, e)))
            return rc;
        part->layer_raw[l] = (uint64_t)v;
        if ((rc = get_num(x, "stored", 0, 1e18, &v, path, e)))
            return rc;
        part->layer_stored[l] = (uint64_t)v;
    }
    return 0;
}

void df_cache_part_free(df_cache_part *part)
{
    free(part->shards);
    part->shards = NULL;
}

int df_cache_part_write(const char *dir, const df_cache_part *part, df_err *e)
{
    char name[64], path[4096];
    snprintf(name, sizeof name, "rank-%04u.json", part->rank);
    if (df_path_join(path, sizeof path, dir, name))
        return df_errf(e, -ENAMETOOLONG, "%s: path too long", dir);
    cJSON *o = df_cache_part_json(part);
    char *s = cJSON_Print(o);
    cJSON_Delete(o);
    if (!s)
        return df_errf(e, -ENOMEM, "out of memory");
    int rc = df_file_write_atomic(path, s, strlen(s), e);
    free(s);
    return rc;
}

#define MAX_JSON (256u << 20)

int df_cache_meta_read(const char *dir, df_cache_params *p, df_err *e)
{
    char path[4096];
    if (df_path_join(path, sizeof path, dir, "meta.json"))
        return df_errf(e, -ENAMETOOLONG, "%s: path too long", dir);
    char *buf;
    size_t len;
    int rc = df_file_read_all(path, MAX_JSON, &buf, &len, e);
    if (rc)
        return rc;
    rc = df_cache_params_from_json(buf, len, path, p, e);
    free(buf);
    return rc;
}

int df_cache_manifest_read(const char *dir, df_cache_params *p, df_cache_part *all,
                           char *created_by, size_t cb_len, df_err *e)
{
    char path[4096];
    if (df_path_join(path, sizeof path, dir, "manifest.json"))
        return df_errf(e, -ENAMETOOLONG, "%s: path too long", dir);
    char *buf;
    size_t len;
    df_err tmp;
    int rc = df_file_read_all(path, MAX_JSON, &buf, &len, &tmp);
    if (rc == -ENOENT) {
        char meta[4096];
        df_path_join(meta, sizeof meta, dir, "meta.json");
        struct stat sb;
        if (stat(meta, &sb) == 0) {
            return df_errf(e, -ENOENT,
                           "%s: unfinished cache (meta.json but no manifest.json): its writer did "
                           "not finish; rerun the extraction to resume it",
                           dir);
        }
        return df_errf(e, -ENOENT, "%s: not a dflash cache (no manifest.json)", dir);
    }
    if (rc) {
        if (e)
            *e = tmp;
        return rc;
    }
    cJSON *o = cJSON_ParseWithLength(buf, len);
    free(buf);
    if (!o)
        return df_errf(e, -DF_ECORRUPT, "%s: not valid JSON", path);
    rc = df_cache_params_from_cjson(o, path, p, e);
    if (!rc) {
        const cJSON *done = cJSON_GetObjectItemCaseSensitive(o, "complete");
        if (!cJSON_IsTrue(done))
            rc = df_errf(e, -DF_ECORRUPT, "%s: \"complete\" is not true", path);
    }
    if (!rc)
        rc = part_from_cjson(o, p->n_layers, path, all, e);
    if (!rc)
        rc = check_checksums(o, p, all, path, e);
    if (!rc && created_by) {
        const cJSON *cb = cJSON_GetObjectItemCaseSensitive(o, "created_by");
        snprintf(created_by, cb_len, "%s", cJSON_IsString(cb) ? cb->valuestring : "?");
    }
    cJSON_Delete(o);
    return rc;
}

/* One listed shard against the files on disk: a regular data file of the
 * listed size whose header is this cache's (uuid, rank, seq, layout), and an
 * index whose entries add up to the listed samples, tokens and size. The
 * merge runs this for every shard so a manifest never lists what a reader
 * would refuse (a rank of an older cache, a deleted or replaced shard). */
static int check_shard(const char *dir, const df_cache_params *p, const df_cache_shard_info *si,
                       const char *part_path, df_err *e)
{
    char want[64], path[4200];
    df_cache_shard_name(want, sizeof want, si->rank, si->seq, ".dfc");
    if (strcmp(want, si->data))
        return df_errf(e, -DF_ECORRUPT, "%s: shard \"%s\" is not named for rank %u seq %u", part_path,
                       si->data, si->rank, si->seq);
    snprintf(path, sizeof path, "%s/%s", dir, si->data);
    int fd = df_open_regular(path, O_RDONLY, 0, e);
    if (fd < 0)
        return df_err_wrap(e, "%s lists it", part_path);
    struct stat st;
    uint8_t hdr[DF_CACHE_SHARD_HEADER];
    int rc = 0;
    if (fstat(fd, &st) != 0 || (uint64_t)st.st_size != si->bytes)
        rc = df_errf(e, -DF_ECORRUPT, "%s: %lld bytes, %s says %" PRIu64, path,
                     (long long)st.st_size, part_path, si->bytes);
    else if (pread(fd, hdr, sizeof hdr, 0) != (ssize_t)sizeof hdr)
        rc = df_errf(e, -DF_ECORRUPT, "%s: offset 0: cannot read the shard header", path);
    else
        rc = df_cache_shard_header_check(p, hdr, sizeof hdr, si->rank, si->seq, path, e);
    close(fd);
    if (rc)
        return rc;
    df_cache_shard_name(want, sizeof want, si->rank, si->seq, ".dfi");
    if (strcmp(want, si->index))
        return df_errf(e, -DF_ECORRUPT, "%s: index \"%s\" is not named for rank %u seq %u", part_path,
                       si->index, si->rank, si->seq);
    snprintf(path, sizeof path, "%s/%s", dir, si->index);
    char *buf;
    size_t len;
    if ((rc = df_file_read_all(path, (size_t)1 << 40, &buf, &len, e)))
        return rc;
    df_cache_entry *ents;
    size_t n;
    rc = df_cache_index_parse(p, (uint8_t *)buf, len, 0, path, &ents, &n, NULL, NULL, e);
    free(buf);
    if (rc)
        return rc;
    uint64_t end = n ? ents[n - 1].offset + ents[n - 1].record_bytes : DF_CACHE_SHARD_HEADER;
    uint64_t toks = 0;
    for (size_t i = 0; i < n; i++)
        toks += ents[i].n_tokens;
    free(ents);
    if (n != si->samples || toks != si->tokens || end != si->bytes)
        return df_errf(e, -DF_ECORRUPT, "%s: index (%zu samples, %" PRIu64 " tokens, %" PRIu64
                       " bytes) disagrees with %s (%" PRIu64 ", %" PRIu64 ", %" PRIu64 ")",
                       path, n, toks, end, part_path, si->samples, si->tokens, si->bytes);
    return 0;
}

static int finalize_locked(const char *dir, df_err *e)
{
    df_cache_params p;
    int rc = df_cache_meta_read(dir, &p, e);
    if (rc)
        return rc;
    df_cache_part all = {.n_layers = p.n_layers};
    size_t cap = 0;
    for (uint32_t r = 0; r < p.world_size && !rc; r++) {
        char name[64], path[4096];
        snprintf(name, sizeof name, "rank-%04u.json", r);
        df_path_join(path, sizeof path, dir, name);
        char *buf;
        size_t len;
        rc = df_file_read_all(path, MAX_JSON, &buf, &len, e);
        if (rc == -ENOENT) {
            rc = df_errf(e, -EAGAIN, "%s: rank %u of %u has not finished (no %s)", dir, r,
                         p.world_size, name);
            break;
        }
        if (rc)
            break;
        cJSON *o = cJSON_ParseWithLength(buf, len);
        free(buf);
        df_cache_part part;
        if (!o) {
            rc = df_errf(e, -DF_ECORRUPT, "%s: not valid JSON", path);
            break;
        }
        rc = part_from_cjson(o, p.n_layers, path, &part, e);
        /* The part must be this cache's: a rank file left from an earlier
         * cache in the same directory (its meta.json deleted and recreated)
         * has another uuid. Files without "uuid" (before it was written) are
         * still checked shard by shard below. */
        const cJSON *u = cJSON_GetObjectItemCaseSensitive(o, "uuid");
        if (!rc && u) {
            char want[33];
            hex16(p.uuid, want);
            if (!cJSON_IsString(u) || strcmp(u->valuestring, want))
                rc = df_errf(e, -DF_EMISMATCH, "%s: \"uuid\" %s is not this cache's (meta.json "
                             "says %s): the rank belongs to another cache; remove it and "
                             "rerun that rank", path, cJSON_IsString(u) ? u->valuestring : "?",
                             want);
        }
        cJSON_Delete(o);
        if (!rc && part.rank != r)
            rc = df_errf(e, -DF_ECORRUPT, "%s: says rank %u", path, part.rank);
        for (uint32_t i = 0; !rc && i < part.n_shards; i++) {
            if (part.shards[i].rank != r || part.shards[i].seq != i)
                rc = df_errf(e, -DF_ECORRUPT, "%s: shards[%u] is rank %u seq %u, want rank %u "
                             "seq %u", path, i, part.shards[i].rank, part.shards[i].seq, r, i);
            else
                rc = check_shard(dir, &p, &part.shards[i], path, e);
        }
        if (rc && rc != -ENOMEM)
            df_err_wrap(e, "%s: cannot merge rank %u into manifest.json", dir, r);
        if (!rc) {
            if (all.n_shards + part.n_shards > cap) {
                cap = (all.n_shards + part.n_shards) * 2;
                df_cache_shard_info *ns = realloc(all.shards, cap * sizeof *ns);
                if (!ns)
                    rc = df_errf(e, -ENOMEM, "out of memory");
                else
                    all.shards = ns;
            }
        }
        if (!rc) {
            if (part.n_shards) /* an empty corpus: no shards, all.shards may be NULL */
                memcpy(all.shards + all.n_shards, part.shards, part.n_shards * sizeof *part.shards);
            all.n_shards += part.n_shards;
            all.samples += part.samples;
            all.tokens += part.tokens;
            all.loss_tokens += part.loss_tokens;
            all.raw_bytes += part.raw_bytes;
            all.stored_bytes += part.stored_bytes;
            for (uint32_t l = 0; l < p.n_layers; l++) {
                all.layer_raw[l] += part.layer_raw[l];
                all.layer_stored[l] += part.layer_stored[l];
            }
        }
        df_cache_part_free(&part);
    }
    if (!rc) {
        cJSON *o = df_cache_params_json(&p);
        cJSON_AddBoolToObject(o, "complete", 1);
        cJSON_AddStringToObject(o, "created_by", "dflash " DFLASH_VERSION);
        cJSON *pj = df_cache_part_json(&all);
        /* Move the part's arrays into the manifest object (rank is meaningless here). */
        cJSON_AddItemToObject(o, "shards", cJSON_DetachItemFromObject(pj, "shards"));
        cJSON_AddItemToObject(o, "totals", cJSON_DetachItemFromObject(pj, "totals"));
        cJSON_AddItemToObject(o, "layer_bytes", cJSON_DetachItemFromObject(pj, "layer_bytes"));
        cJSON_AddNumberToObject(o, "rank", 0);
        cJSON_Delete(pj);
        df_cache_part_checksums(o, &all);
        char *s = cJSON_Print(o);
        cJSON_Delete(o);
        char path[4096];
        df_path_join(path, sizeof path, dir, "manifest.json");
        /* Everything the manifest names is durable before it exists (each
         * shard and rank file was fsynced with its directory; once more for
         * all of them), and it is removed again if its own directory fsync
         * fails: a cache with manifest.json is complete. */
        rc = s ? df_fsync_dir(dir, e) : df_errf(e, -ENOMEM, "out of memory");
        if (!rc)
            rc = df_file_publish(path, s, strlen(s), "cache-final-dirsync", e);
        free(s);
    }
    free(all.shards);
    return rc;
}

/* Ranks that finish together may both see every part: they take turns on an
 * flock of the cache directory, and the later one finds the manifest written
 * (both would write the same one, but through the same temporary name: one
 * rename would find the other's file gone). */
int df_cache_dir_lock(const char *dir, df_err *e)
{
    int fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0)
        return df_errf(e, -errno, "%s: cannot open: %s", dir, strerror(errno));
    int rc;
    while ((rc = flock(fd, LOCK_EX)) != 0 && errno == EINTR)
        ;
    /* a filesystem without flock: go on unlocked, as before the lock (the
     * race needs two ranks finishing within the same milliseconds) */
    if (rc != 0 && errno != ENOLCK && errno != EOPNOTSUPP && errno != EINVAL) {
        int err = -errno;
        close(fd);
        return df_errf(e, err, "%s: cannot lock: %s", dir, strerror(-err));
    }
    return fd;
}

int df_cache_finalize(const char *dir, df_err *e)
{
    int fd = df_cache_dir_lock(dir, e);
    if (fd < 0)
        return fd;
    char path[4096];
    df_path_join(path, sizeof path, dir, "manifest.json");
    int rc = access(path, F_OK) == 0 ? 0 : finalize_locked(dir, e);
    close(fd); /* and the lock with it */
    return rc;
}
