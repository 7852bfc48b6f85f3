/* safetensors.h - reader (mmap, single file or sharded) and writer of the
 * safetensors format used by Hugging Face checkpoints.
 *
 * File layout: u64 LE header length N, N bytes of JSON (an object; may be
 * padded with trailing spaces), then the data section. Each JSON key is a
 * tensor name mapping to {"dtype": "BF16", "shape": [..], "data_offsets":
 * [begin, end]} with offsets relative to the data section; the optional key
 * "__metadata__" maps to an object of string -> string.
 *
 * Reader contract:
 *  - df_st_open() accepts a directory holding model.safetensors.index.json
 *    (sharded: {"weight_map": {name: shard file}}) or model.safetensors, a
 *    *.index.json file, or one .safetensors file. Files are mapped read-only;
 *    tensor views point into the mappings and live until df_st_close().
 *  - Everything read is bounds-checked before use: the header length fits the
 *    file and DF_ST_MAX_HEADER, the header is a JSON object, every tensor's
 *    offsets lie in the data section, end-begin == prod(shape)*dtype size
 *    (overflow-checked), dims are non-negative integers, tensors do not
 *    overlap, names are unique (also across shards), every index entry names
 *    an existing shard that holds that tensor. A file that passes can be read
 *    through the views without going out of bounds, whatever its content.
 *  - Errors: -DF_ECORRUPT (malformed/lying file), -ENOTSUP (a dtype we do not
 *    handle), -ENOENT (missing file/shard/tensor), -DF_EMISMATCH (a tensor has
 *    another dtype/shape than expected), -ENOMEM, or the errno of a failed
 *    open/mmap. The message names the file and the byte offset or tensor.
 *  - Data pointers are NOT guaranteed to be aligned to the element size (the
 *    format does not require it); files from our writer and from the
 *    safetensors library are aligned in practice. Check or memcpy.
 *  - A df_st is read-only after open: concurrent lookups from many threads
 *    are safe.
 *
 * Writer contract: entries are collected (the writer keeps the caller's data
 * pointers, it does not copy: they must stay valid until
 * df_st_writer_finish) and written by df_st_writer_finish atomically (to
 * path.tmp, fsync, rename, fsync of the directory). Tensors are laid out
 * contiguously, largest element size first then by name, so with the header
 * padded with spaces to a multiple of 8 every tensor starts aligned to its
 * element size, and the file passes the strict (no gap) check of the
 * reference safetensors library.
 */
#ifndef DF_SAFETENSORS_H
#define DF_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "dtype.h"
#include "err.h"

#define DF_ST_MAX_DIMS 8
#define DF_ST_MAX_HEADER (100u << 20) /* bytes of JSON header accepted */

typedef struct df_st_tensor {
    const char *name;
    df_dtype dtype;
    int ndim;                       /* 0 for a scalar */
    int64_t shape[DF_ST_MAX_DIMS];  /* shape[i] >= 0; unused entries 0 */
    uint64_t numel;                 /* prod(shape); 1 for a scalar */
    const void *data;               /* nbytes readable bytes (may be unaligned) */
    uint64_t nbytes;
    const char *file;               /* path of the file holding it */
    uint64_t file_offset;           /* absolute byte offset of data in that file */
} df_st_tensor;

typedef struct df_st df_st;

/* Opens a checkpoint (see the contract above). On success *out is set. */
int df_st_open(const char *path, df_st **out, df_err *e);

/* Parses an in-memory safetensors file (the fuzz entry point, and for data
 * already in memory). buf is not copied: it must outlive the df_st. name is
 * used in error messages and as each tensor's .file. */
int df_st_open_mem(const void *buf, size_t len, const char *name, df_st **out, df_err *e);

void df_st_close(df_st *st);

/* Tensors, sorted by name (so iteration order does not depend on shards). */
size_t df_st_count(const df_st *st);
const df_st_tensor *df_st_at(const df_st *st, size_t i);

/* Lookup by exact name; NULL when absent. */
const df_st_tensor *df_st_find(const df_st *st, const char *name);

/* Lookup that fails with -ENOENT and a message naming the checkpoint. */
int df_st_get(const df_st *st, const char *name, const df_st_tensor **out, df_err *e);

/* Checks a tensor's dtype (DF_DTYPE_INVALID = any) and shape; on mismatch
 * returns -DF_EMISMATCH with e.g.
 * "model.layers.3.mlp.up_proj.weight: shape [768,256], expected [768,512]". */
int df_st_check(const df_st_tensor *t, df_dtype dtype, int ndim, const int64_t *shape,
                df_err *e);

/* df_st_get + df_st_check. */
int df_st_expect(const df_st *st, const char *name, df_dtype dtype, int ndim,
                 const int64_t *shape, const df_st_tensor **out, df_err *e);

/* "__metadata__" strings. For a sharded checkpoint, the union over shards
 * (the first shard wins on a repeated key). NULL when absent. */
const char *df_st_metadata(const df_st *st, const char *key);
size_t df_st_metadata_count(const df_st *st);
/* i-th metadata entry; returns 0, or -ERANGE when i is out of range. */
int df_st_metadata_at(const df_st *st, size_t i, const char **key, const char **value);

/* What was opened (the path given), and how many files it spans. */
const char *df_st_path(const df_st *st);
size_t df_st_file_count(const df_st *st);

/* Formats a shape as "[768,512]" into out (size n); returns out. */
char *df_st_shape_str(char *out, size_t n, int ndim, const int64_t *shape);

/* ---- writer ---- */
typedef struct df_st_writer df_st_writer;

int df_st_writer_open(const char *path, df_st_writer **out, df_err *e);

/* Adds a tensor; data holds prod(shape)*df_dtype_size(dtype) bytes and is
 * referenced, not copied. Names must be unique, non-empty and not
 * "__metadata__"; ndim in [0, DF_ST_MAX_DIMS]; dims >= 0. */
int df_st_writer_add(df_st_writer *w, const char *name, df_dtype dtype, int ndim,
                     const int64_t *shape, const void *data, df_err *e);

/* Adds (or replaces) a "__metadata__" string entry. */
int df_st_writer_set_metadata(df_st_writer *w, const char *key, const char *value, df_err *e);

/* Writes the file atomically. The writer stays owned by the caller. */
int df_st_writer_finish(df_st_writer *w, df_err *e);

void df_st_writer_free(df_st_writer *w);

#endif
