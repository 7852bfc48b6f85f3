/* rdv_tcp.h - a one-shot TCP rendezvous: rank 0 hands an opaque blob (the
 * NCCL unique id) to every other rank of a launch, through MASTER_ADDR and
 * MASTER_PORT as torchrun and Slurm users set them, with no shared disk.
 *
 * Roles:
 *   rank 0   listens on MASTER_PORT of every local interface (IPv6 any with
 *            IPv4 mapped, or IPv4 INADDR_ANY where IPv6 is off; not only the
 *            address MASTER_ADDR resolves to, which on many hosts is a
 *            loopback alias of the host name), with SO_REUSEADDR, and accepts
 *            until world - 1 distinct peers have said hello. Then it sends
 *            each the blob and returns. The listener is closed on return.
 *   rank > 0 resolves MASTER_ADDR (getaddrinfo: a name, IPv4 or IPv6) and
 *            connects, retrying until the deadline (rank 0 may start later,
 *            its name may not resolve yet), sends its hello and waits for
 *            rank 0's reply.
 *
 * Wire format, every integer little-endian, one 92-byte frame each way:
 *   0   magic[8]   "DFRDVHI\n" (hello, peer -> rank 0) or "DFRDVID\n" (reply)
 *   8   u32 version    DF_RDV_VERSION
 *   12  u32 code       hello: the sender's rank; reply: 0 (the payload is
 *                      the blob) or a positive errno-style code (the payload
 *                      is rank 0's refusal, text without a NUL)
 *   16  u32 world
 *   20  u32 len        payload bytes after the frame: 0 in a hello, at most
 *                      DF_RDV_MAX_PAYLOAD in a reply
 *   24  run_id[64]     the launch's token, NUL-padded (64 bytes: no NUL)
 *   88  u32 crc        CRC32C of bytes 0..87 followed by the payload
 * A frame is valid only when every field is: magic, version, len in range,
 * run_id 1..64 bytes of [A-Za-z0-9._-] then NULs only, and the crc.
 *
 * What rank 0 checks in a hello, and what it does:
 *   not a frame (garbage, a port scanner, a client that closes or stalls
 *   before 92 bytes)   closed and ignored; a connection silent for
 *                      DF_RDV_HELLO_S seconds is dropped, so stalled
 *                      clients cannot hold rank 0's slots
 *   another run_id     a stranger (an older launch on the same port): it is
 *                      refused (-DF_EMISMATCH in its reply), rank 0 goes on
 *                      and names it if it times out
 *   another world, a rank out of range, a rank that has already joined (or
 *   rank 0)            this launch is misconfigured: the sender and every
 *                      peer joined so far get the refusal and rank 0 fails
 *                      at once (-DF_EMISMATCH, -EINVAL, -EEXIST)
 *   a joined peer whose connection closes before the blob is sent is
 *   forgotten (it may come back: a restarted peer rejoins).
 * A peer checks rank 0's reply the same way (frame, world, run_id, len <=
 * its buffer) and fails with rank 0's message when refused.
 *
 * Waiting: every socket is non-blocking and every wait is a poll() bounded
 * by the deadline, so no slow or silent party can hold a rank past it.
 * No threads, no signals (sends use MSG_NOSIGNAL).
 *
 * Errors (negative, message in e): -ETIMEDOUT (rank 0: names the ranks that
 * never joined and any stranger refused; a peer: names MASTER_ADDR:PORT and
 * whether it waited to connect or for the blob), -EADDRINUSE (rank 0 cannot
 * listen: the port is taken), -DF_EMISMATCH / -EINVAL / -EEXIST (as above,
 * on rank 0 and on the refused peers), -ECONNABORTED (rank 0 gave up and
 * said why: its message is quoted), -DF_ECORRUPT (a peer got a reply that
 * is not a valid frame), -EMSGSIZE (the blob is larger than the peer's
 * buffer), -EINVAL (bad options), -EMFILE and other errnos of failed system
 * calls, naming the call. Never exits.
 *
 * Limits: rank 0 keeps one connection per peer until the end, so it needs
 * world + a few file descriptors (ulimit -n). The rendezvous has no
 * authentication: it trusts the network it runs on, as torchrun's store
 * does; the run_id keeps two launches on one port from mixing.
 */
#ifndef DF_RDV_TCP_H
#define DF_RDV_TCP_H

#include <stddef.h>
#include <stdint.h>

#include "err.h"

#ifdef __cplusplus
extern "C" {
#endif

#define DF_RDV_VERSION 1u
#define DF_RDV_FRAME 92
#define DF_RDV_RUN_ID_MAX 64
#define DF_RDV_MAX_PAYLOAD 4096
#define DF_RDV_MAX_WORLD 65536
#define DF_RDV_HELLO_S 10 /* seconds a fresh connection may take to send its hello */

typedef struct df_rdv_opts {
    const char *master_addr; /* where rank 0 listens: a host name or address (peers
                                connect there; rank 0 only uses it in messages) */
    int master_port;         /* 1..65535 */
    int rank, world;         /* 0 <= rank < world, 2 <= world <= DF_RDV_MAX_WORLD */
    const char *run_id;      /* 1..64 of [A-Za-z0-9._-], the same in every rank */
    int timeout_ms;          /* > 0: the whole rendezvous, from the call */
} df_rdv_opts;

/* Rank 0: sends blob[0..*len) (*len <= DF_RDV_MAX_PAYLOAD) to every peer once
 * all have joined; cap is unused. A peer: receives rank 0's blob into
 * blob[0..cap) and sets *len. Returns 0 or a negative code (see above). */
int df_rdv_tcp(const df_rdv_opts *o, void *blob, size_t *len, size_t cap, df_err *e);

/* ---- the frame, exposed for tests and the fuzz target ---- */
typedef struct df_rdv_frame {
    int hello;     /* 1: "DFRDVHI\n", 0: "DFRDVID\n" */
    uint32_t code; /* hello: rank; reply: 0 or a positive errno-style code */
    uint32_t world;
    uint32_t len;  /* payload bytes that follow */
    char run_id[DF_RDV_RUN_ID_MAX + 1];
} df_rdv_frame;

/* Writes f (with payload[0..f->len), which the crc covers) to out. f->run_id
 * must be valid and f->len <= DF_RDV_MAX_PAYLOAD (-EINVAL otherwise). */
int df_rdv_frame_encode(const df_rdv_frame *f, const void *payload,
                        uint8_t out[DF_RDV_FRAME], df_err *e);
/* Parses and checks a frame's 92 bytes, all but the crc (which also covers
 * the payload that follows: df_rdv_frame_check_crc once it is read).
 * -DF_ECORRUPT with a message naming the bad field. */
int df_rdv_frame_decode(const uint8_t buf[DF_RDV_FRAME], df_rdv_frame *f, df_err *e);
/* 0 when the frame's crc is the CRC32C of its first 88 bytes then
 * payload[0..payload_n); -DF_ECORRUPT otherwise. */
int df_rdv_frame_check_crc(const uint8_t frame[DF_RDV_FRAME], const void *payload,
                           size_t payload_n, df_err *e);

#ifdef __cplusplus
}
#endif
#endif
