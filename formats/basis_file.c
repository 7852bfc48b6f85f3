/* basis_file.c - the basis file, basis.dfb: size, serialize, write, parse,
 * read and hash (contracts in basis.h, byte layout in docs/FORMAT-basis.md).
 * The writer and the parser run the same checks: the fields (check_fields)
 * and P's orthonormality (df_basis_check_orthonormal, in basis.c). */
#include <fcntl.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "basis_internal.h"
#include "crc32c.h"
#include "fsutil.h"
#include "le.h"

/* Byte offsets of a file's sections (docs/FORMAT-basis.md). */
typedef struct layout {
    uint64_t ids, lenergy, lkept, eig, P, crc, total;
} layout;

static layout basis_layout(int K, int R, int D)
{
    layout l;
    l.ids = DF_BASIS_HEADER_BYTES;
    l.lenergy = l.ids + 8 * (uint64_t)((K + 1) / 2);
    l.lkept = l.lenergy + 8 * (uint64_t)K;
    l.eig = l.lkept + 8 * (uint64_t)K;
    l.P = l.eig + 8 * (uint64_t)R;
    l.crc = l.P + 4 * (uint64_t)R * (uint64_t)D;
    l.total = l.crc + 4;
    return l;
}

uint64_t df_basis_file_bytes(int K, int R, int D)
{
    return basis_layout(K, R, D).total;
}

static double get_f64(const uint8_t *p)
{
    uint64_t u = df_le64(p);
    double d;
    memcpy(&d, &u, 8);
    return d;
}

static void put_f64(uint8_t *p, double d)
{
    uint64_t u;
    memcpy(&u, &d, 8);
    df_put64(p, u);
}

/* Checks everything of a basis but P's orthonormality (code and offsets as
 * a parse of a file with layout l would report them). */
static int check_fields(const df_basis *b, const layout *l, const char *name, int code,
                        df_err *e)
{
    if (b->kind < DF_BASIS_KIND_MOMENT || b->kind > DF_BASIS_KIND_ROWS_EXT)
        return df_errf(e, code, "%s: kind %d (offset 16), must be 1, 2 or 3", name, b->kind);
    if (b->kind == DF_BASIS_KIND_ROWS_EXT ? b->rows_part < 1 || b->rows_part >= b->R
                                          : b->rows_part != 0)
        return df_errf(e, code, "%s: rows kept whole %d (offset 36), must be %s", name,
                       b->rows_part, b->kind == DF_BASIS_KIND_ROWS_EXT ? "in [1, R)" : "0");
    if (b->n_rows < 1)
        return df_errf(e, code, "%s: n_rows %lld (offset 40), must be >= 1", name,
                       (long long)b->n_rows);
    if (!(b->total_energy > 0) || !isfinite(b->total_energy))
        return df_errf(e, code, "%s: total energy %g (offset 48), must be finite and > 0", name,
                       b->total_energy);
    if (!(b->kept >= -1e-6 && b->kept <= 1 + 1e-6))
        return df_errf(e, code, "%s: kept fraction %g (offset 56), must be in [0, 1]", name,
                       b->kept);
    for (int k = 0; k < b->K; k++) {
        if (b->layer_ids[k] < 0)
            return df_errf(e, code, "%s: layer id %d (offset %llu) is negative", name,
                           b->layer_ids[k], (unsigned long long)(l->ids + 4 * (uint64_t)k));
        for (int q = 0; q < k; q++)
            if (b->layer_ids[q] == b->layer_ids[k])
                return df_errf(e, code, "%s: layer id %d (offset %llu) is repeated", name,
                               b->layer_ids[k], (unsigned long long)(l->ids + 4 * (uint64_t)k));
        if (!(b->layer_energy[k] >= 0) || !isfinite(b->layer_energy[k]))
            return df_errf(e, code, "%s: layer %d's energy %g (offset %llu), must be finite and "
                           ">= 0", name, k, b->layer_energy[k],
                           (unsigned long long)(l->lenergy + 8 * (uint64_t)k));
        if (!(b->layer_kept[k] >= -1e-6 && b->layer_kept[k] <= 1 + 1e-6))
            return df_errf(e, code, "%s: layer %d's kept fraction %g (offset %llu), must be in "
                           "[0, 1]", name, k, b->layer_kept[k],
                           (unsigned long long)(l->lkept + 8 * (uint64_t)k));
    }
    for (int r = 0; r < b->R; r++)
        if (!isfinite(b->eigval[r]) ||
            (r > 0 && r != b->rows_part && b->eigval[r] > b->eigval[r - 1]))
            return df_errf(e, code, "%s: eigenvalue %d = %g (offset %llu) is %s", name, r,
                           b->eigval[r], (unsigned long long)(l->eig + 8 * (uint64_t)r),
                           isfinite(b->eigval[r]) ? "above the one before it" : "not finite");
    return 0;
}

int df_basis_serialize(const df_basis *b, uint8_t **buf, size_t *len, df_err *e)
{
    *buf = NULL, *len = 0;
    const char *what = "df_basis_serialize";
    int rc = df_basis_check_shape(b->K, b->H, what, e);
    if (rc)
        return rc;
    if (b->D != b->K * b->H || b->R < 1 || b->R > b->D || !b->P || !b->eigval)
        return df_errf(e, -EINVAL, "%s: D %d, R %d, K %d, H %d: not a basis", what, b->D, b->R,
                       b->K, b->H);
    layout l = basis_layout(b->K, b->R, b->D);
    if ((rc = check_fields(b, &l, what, -EINVAL, e)) < 0 ||
        (rc = df_basis_check_orthonormal(b->P, b->R, b->D, what, l.P, -EINVAL, e)) < 0)
        return rc;
    uint8_t *p = calloc(1, (size_t)l.total);
    if (!p)
        return df_errf(e, -ENOMEM, "%s: out of memory for %llu bytes", what,
                       (unsigned long long)l.total);
    memcpy(p, DF_BASIS_MAGIC, 8);
    df_put32(p + 8, DF_BASIS_VERSION);
    df_put32(p + 12, DF_BASIS_HEADER_BYTES);
    df_put32(p + 16, (uint32_t)b->kind);
    df_put32(p + 20, (uint32_t)b->D);
    df_put32(p + 24, (uint32_t)b->R);
    df_put32(p + 28, (uint32_t)b->K);
    df_put32(p + 32, (uint32_t)b->H);
    df_put32(p + 36, (uint32_t)b->rows_part);
    df_put64(p + 40, (uint64_t)b->n_rows);
    put_f64(p + 48, b->total_energy);
    put_f64(p + 56, b->kept);
    for (int k = 0; k < b->K; k++) {
        df_put32(p + l.ids + 4 * k, (uint32_t)b->layer_ids[k]);
        put_f64(p + l.lenergy + 8 * k, b->layer_energy[k]);
        put_f64(p + l.lkept + 8 * k, b->layer_kept[k]);
    }
    for (int r = 0; r < b->R; r++)
        put_f64(p + l.eig + 8 * (uint64_t)r, b->eigval[r]);
    const size_t np = (size_t)b->R * (size_t)b->D;
    for (size_t i = 0; i < np; i++) {
        uint32_t u;
        memcpy(&u, b->P + i, 4);
        df_put32(p + l.P + 4 * i, u);
    }
    df_put32(p + l.crc, df_crc32c(0, p, (size_t)l.crc));
    *buf = p, *len = (size_t)l.total;
    return 0;
}

int df_basis_write(const df_basis *b, const char *path, df_err *e)
{
    uint8_t *buf;
    size_t len;
    int rc = df_basis_serialize(b, &buf, &len, e);
    if (rc) {
        df_err_wrap(e, "%s", path);
        return rc;
    }
    rc = df_file_write_atomic(path, buf, len, e);
    free(buf);
    return rc;
}

/* The fixed header: magic, version, sizes, and the file length they imply
 * (== len). Fills the shape of *h. */
static int parse_header(const uint8_t *p, uint64_t len, const char *name, df_basis *h,
                        df_err *e)
{
    if (len < DF_BASIS_HEADER_BYTES)
        return df_errf(e, -DF_ECORRUPT, "%s: %llu bytes, shorter than the %u-byte header", name,
                       (unsigned long long)len, DF_BASIS_HEADER_BYTES);
    if (memcmp(p, DF_BASIS_MAGIC, 8))
        return df_errf(e, -DF_ECORRUPT, "%s: bad magic (offset 0): not a basis file", name);
    uint32_t ver = df_le32(p + 8), hb = df_le32(p + 12);
    if (ver != DF_BASIS_VERSION)
        return df_errf(e, -DF_EVERSION, "%s: version %u (offset 8), this reader knows %u", name,
                       ver, DF_BASIS_VERSION);
    if (hb != DF_BASIS_HEADER_BYTES)
        return df_errf(e, -DF_ECORRUPT, "%s: header size %u (offset 12), must be %u", name, hb,
                       DF_BASIS_HEADER_BYTES);
    uint32_t kind = df_le32(p + 16), D = df_le32(p + 20), R = df_le32(p + 24);
    uint32_t K = df_le32(p + 28), H = df_le32(p + 32), res = df_le32(p + 36);
    if (K < 1 || K > DF_BASIS_MAX_LAYERS)
        return df_errf(e, -DF_ECORRUPT, "%s: K = %u (offset 28), must be in [1, %d]", name, K,
                       DF_BASIS_MAX_LAYERS);
    if (H < 1 || (uint64_t)K * H > DF_BASIS_MAX_DIM || D != K * H)
        return df_errf(e, -DF_ECORRUPT, "%s: D = %u, H = %u (offsets 20, 32) with K = %u: need "
                       "D = K*H in [1, %d]", name, D, H, K, DF_BASIS_MAX_DIM);
    if (R < 1 || R > D)
        return df_errf(e, -DF_ECORRUPT, "%s: R = %u (offset 24), must be in [1, %u]", name, R, D);
    if (res > R)
        return df_errf(e, -DF_ECORRUPT, "%s: rows kept whole %u (offset 36), above R = %u", name,
                       res, R);
    uint64_t want = df_basis_file_bytes((int)K, (int)R, (int)D);
    if (len != want)
        return df_errf(e, -DF_ECORRUPT, "%s: %llu bytes, its header (D %u, R %u, K %u) says %llu",
                       name, (unsigned long long)len, D, R, K, (unsigned long long)want);
    memset(h, 0, sizeof *h);
    h->kind = (int)kind, h->D = (int)D, h->R = (int)R, h->K = (int)K, h->H = (int)H;
    h->rows_part = (int)res;
    return 0;
}

int df_basis_parse(const uint8_t *buf, size_t len, const char *name, df_basis *out, df_err *e)
{
    df_basis h;
    memset(out, 0, sizeof *out);
    int rc = parse_header(buf, len, name, &h, e);
    if (rc)
        return rc;
    layout l = basis_layout(h.K, h.R, h.D);
    uint32_t want = df_le32(buf + l.crc), got = df_crc32c(0, buf, (size_t)l.crc);
    if (want != got)
        return df_errf(e, -DF_ECORRUPT, "%s: CRC32C mismatch (offset %llu): stored %08x, computed "
                       "%08x", name, (unsigned long long)l.crc, want, got);
    if (h.K % 2 && df_le32(buf + l.ids + 4 * (uint64_t)h.K))
        return df_errf(e, -DF_ECORRUPT, "%s: padding after the layer ids (offset %llu) is not 0",
                       name, (unsigned long long)(l.ids + 4 * (uint64_t)h.K));
    if ((rc = df_basis_init(out, h.K, h.H, h.R, NULL, e)) < 0)
        return rc;
    out->kind = h.kind;
    out->rows_part = h.rows_part;
    out->n_rows = (int64_t)df_le64(buf + 40);
    out->total_energy = get_f64(buf + 48);
    out->kept = get_f64(buf + 56);
    for (int k = 0; k < h.K; k++) {
        out->layer_ids[k] = (int32_t)df_le32(buf + l.ids + 4 * k);
        out->layer_energy[k] = get_f64(buf + l.lenergy + 8 * k);
        out->layer_kept[k] = get_f64(buf + l.lkept + 8 * k);
    }
    for (int r = 0; r < h.R; r++)
        out->eigval[r] = get_f64(buf + l.eig + 8 * (uint64_t)r);
    const size_t np = (size_t)h.R * (size_t)h.D;
    for (size_t i = 0; i < np; i++) {
        uint32_t u = df_le32(buf + l.P + 4 * i);
        memcpy(out->P + i, &u, 4);
    }
    if ((rc = check_fields(out, &l, name, -DF_ECORRUPT, e)) < 0 ||
        (rc = df_basis_check_orthonormal(out->P, h.R, h.D, name, l.P, -DF_ECORRUPT, e)) < 0)
        df_basis_free(out);
    return rc;
}

static int read_at(int fd, void *buf, size_t n, uint64_t off, const char *path, df_err *e)
{
    size_t got = 0;
    while (got < n) {
        ssize_t r = pread(fd, (uint8_t *)buf + got, n - got, (off_t)(off + got));
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            return df_errf(e, r < 0 ? -errno : -DF_ECORRUPT, "%s: read failed at offset %llu%s",
                           path, (unsigned long long)(off + got), r < 0 ? "" : " (file shrank)");
        got += (size_t)r;
    }
    return 0;
}

int df_basis_read(const char *path, df_basis *out, df_err *e)
{
    memset(out, 0, sizeof *out);
    int fd = df_open_regular(path, O_RDONLY, 0, e);
    if (fd < 0)
        return fd;
    struct stat st;
    uint8_t hdr[DF_BASIS_HEADER_BYTES] = {0}, *buf = NULL;
    int rc = 0;
    if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        rc = df_errf(e, -EINVAL, "%s: not a regular file", path);
        goto out;
    }
    uint64_t len = (uint64_t)st.st_size;
    df_basis h;
    /* The header's sizes must match the file's before anything big is read
     * (a file shorter than the header is reported by parse_header). */
    if ((len >= DF_BASIS_HEADER_BYTES && (rc = read_at(fd, hdr, sizeof hdr, 0, path, e)) < 0) ||
        (rc = parse_header(hdr, len, path, &h, e)) < 0)
        goto out;
    if (!(buf = malloc((size_t)len))) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory for %llu bytes", path, (unsigned long long)len);
        goto out;
    }
    if ((rc = read_at(fd, buf, (size_t)len, 0, path, e)) < 0)
        goto out;
    rc = df_basis_parse(buf, (size_t)len, path, out, e);
out:
    free(buf);
    close(fd);
    return rc;
}

int df_basis_sha256(const char *path, char hex[DF_SHA256_HEX], df_err *e)
{
    return df_sha256_file(path, hex, e);
}

/* ---- orthonormality (file reader, serializer, from_rows) ---- */

/* code with a message when P (R x D at file offset p_off) is not finite with
 * orthonormal rows (basis.h, df_basis_parse). */
int df_basis_check_orthonormal(const float *P, int64_t R, int64_t D, const char *name,
                               uint64_t p_off, int code, df_err *e)
{
    for (int64_t r = 0; r < R; r++) {
        const float *p = P + r * D;
        double s = 0;
        for (int64_t i = 0; i < D; i++) {
            if (!isfinite(p[i]))
                return df_errf(e, code, "%s: P[%lld][%lld] (offset %llu) is not finite", name,
                               (long long)r, (long long)i,
                               (unsigned long long)(p_off + 4 * (uint64_t)(r * D + i)));
            s += (double)p[i] * p[i];
        }
        if (!(fabs(s - 1) <= 1e-4))
            return df_errf(e, code, "%s: P row %lld (offset %llu) has squared norm %.9g, not 1",
                           name, (long long)r, (unsigned long long)(p_off + 4 * (uint64_t)(r * D)),
                           s);
    }
    double *u = malloc(sizeof(double) * (size_t)R), *w = malloc(sizeof(double) * (size_t)D);
    int rc = 0;
    if (!u || !w) {
        rc = df_errf(e, -ENOMEM, "%s: out of memory for the orthonormality check", name);
        goto out;
    }
    for (uint64_t probe = 1; probe <= 2 && !rc; probe++) {
        uint64_t s = probe * 0x9E3779B97F4A7C15ull;
        for (int64_t r = 0; r < R; r++) { /* splitmix64 signs */
            uint64_t z = (s += 0x9E3779B97F4A7C15ull);
            z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
            z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
            u[r] = ((z ^ (z >> 31)) & 1) ? 1.0 : -1.0;
        }
        memset(w, 0, sizeof(double) * (size_t)D);
        for (int64_t r = 0; r < R; r++) /* w = P^T u */
            for (int64_t i = 0; i < D; i++)
                w[i] += u[r] * P[r * D + i];
        double err = 0;
        for (int64_t r = 0; r < R; r++) { /* |P w - u|^2 */
            double v = 0;
            for (int64_t i = 0; i < D; i++)
                v += (double)P[r * D + i] * w[i];
            err += (v - u[r]) * (v - u[r]);
        }
        err = sqrt(err / (double)R);
        if (!(err <= 1e-3))
            rc = df_errf(e, code, "%s: P's rows (offset %llu) are not orthonormal: "
                         "|P P^T u - u| = %.3g |u| for probe %llu", name,
                         (unsigned long long)p_off, err, (unsigned long long)probe);
    }
out:
    free(u);
    free(w);
    return rc;
}
