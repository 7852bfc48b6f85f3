/* fuzz_basis - the basis file parser (df_basis_parse) on arbitrary bytes.
 * The first byte selects a mode, the rest is the file: with the mode byte
 * odd, the file's last 4 bytes are first replaced by its CRC32C, so the
 * fuzzer gets past the checksum to the content checks. Nothing may crash,
 * leak or read out of bounds, and a file that parses must serialize back to
 * exactly the same bytes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "basis.h"
#include "crc32c.h"
#include "le.h"

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n)
{
    if (n < 1)
        return 0;
    size_t len = n - 1;
    uint8_t *buf = malloc(len ? len : 1);
    memcpy(buf, d + 1, len);
    if ((d[0] & 1) && len >= 4)
        df_put32(buf + len - 4, df_crc32c(0, buf, len - 4));
    df_basis b;
    df_err e;
    if (df_basis_parse(buf, len, "fuzz.dfb", &b, &e) == 0) {
        uint8_t *out;
        size_t olen;
        if (df_basis_serialize(&b, &out, &olen, &e) != 0 || olen != len || memcmp(out, buf, len))
            abort();
        free(out);
        df_basis_free(&b);
    }
    free(buf);
    return 0;
}
