/* fuzz_rdv_frame - the TCP rendezvous's frame parser (common/rdv_tcp.h) on
 * arbitrary bytes: the first byte selects a mode, the next 92 are the frame,
 * the rest its payload. With the mode byte odd the frame's crc is first set
 * to the right one, so the fuzzer gets past the checksum. Nothing may crash
 * or read out of bounds, and a frame that passes must encode back to exactly
 * the same bytes. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "crc32c.h"
#include "le.h"
#include "rdv_tcp.h"

int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n)
{
    if (n < 1 + DF_RDV_FRAME)
        return 0;
    uint8_t fr[DF_RDV_FRAME];
    memcpy(fr, d + 1, sizeof fr);
    const uint8_t *pay = d + 1 + DF_RDV_FRAME;
    size_t pn = n - 1 - DF_RDV_FRAME;
    if (d[0] & 1)
        df_put32(fr + 88, df_crc32c(df_crc32c(0, fr, 88), pay, pn));
    df_rdv_frame f;
    df_err e;
    if (df_rdv_frame_decode(fr, &f, &e) != 0)
        return 0;
    if (f.len > DF_RDV_MAX_PAYLOAD || strlen(f.run_id) > DF_RDV_RUN_ID_MAX || (f.hello && f.len))
        abort();
    if (f.len != pn || df_rdv_frame_check_crc(fr, pay, pn, &e) != 0)
        return 0;
    uint8_t out[DF_RDV_FRAME];
    if (df_rdv_frame_encode(&f, pay, out, &e) != 0 || memcmp(out, fr, sizeof out))
        abort();
    return 0;
}
