/* rdv_tcp.c - the TCP rendezvous of rdv_tcp.h: rank 0 a poll() loop over
 * its listener and one non-blocking connection per peer, the peers a
 * connect-retry loop; every wait bounded by the one deadline. */
#include "rdv_tcp.h"

#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "crc32c.h"
#include "fsutil.h"
#include "le.h"
#include "log.h"

#define MAGIC_HELLO "DFRDVHI\n"
#define MAGIC_REPLY "DFRDVID\n"
#define OFF_RUN_ID 24
#define OFF_CRC 88
#define SPARE_SLOTS 16 /* connections beyond world - 1 that may be mid-hello at once */

/* ---- the frame ---- */

/* The length of a valid run_id, or -1. */
static int run_id_len(const char *id)
{
    if (!id)
        return -1;
    int n = 0;
    for (; id[n]; n++) {
        char ch = id[n];
        int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') ||
                 ch == '.' || ch == '_' || ch == '-';
        if (!ok || n >= DF_RDV_RUN_ID_MAX)
            return -1;
    }
    return n ? n : -1;
}

static uint32_t frame_crc(const uint8_t *frame, const void *payload, size_t n)
{
    uint32_t c = df_crc32c(0, frame, OFF_CRC);
    return n ? df_crc32c(c, payload, n) : c;
}

int df_rdv_frame_encode(const df_rdv_frame *f, const void *payload, uint8_t out[DF_RDV_FRAME],
                        df_err *e)
{
    int idn = run_id_len(f->run_id);
    if (idn < 0)
        return df_errf(e, -EINVAL, "rdv: run_id '%.80s': want 1..%d of [A-Za-z0-9._-]",
                       f->run_id, DF_RDV_RUN_ID_MAX);
    if (f->len > DF_RDV_MAX_PAYLOAD || (f->len && !payload))
        return df_errf(e, -EINVAL, "rdv: payload of %u bytes (at most %d)", f->len,
                       DF_RDV_MAX_PAYLOAD);
    memset(out, 0, DF_RDV_FRAME);
    memcpy(out, f->hello ? MAGIC_HELLO : MAGIC_REPLY, 8);
    df_put32(out + 8, DF_RDV_VERSION);
    df_put32(out + 12, f->code);
    df_put32(out + 16, f->world);
    df_put32(out + 20, f->len);
    memcpy(out + OFF_RUN_ID, f->run_id, (size_t)idn);
    df_put32(out + OFF_CRC, frame_crc(out, payload, f->len));
    return 0;
}

int df_rdv_frame_decode(const uint8_t buf[DF_RDV_FRAME], df_rdv_frame *f, df_err *e)
{
    memset(f, 0, sizeof *f);
    if (!memcmp(buf, MAGIC_HELLO, 8))
        f->hello = 1;
    else if (memcmp(buf, MAGIC_REPLY, 8))
        return df_errf(e, -DF_ECORRUPT, "rdv: bad magic");
    uint32_t ver = df_le32(buf + 8);
    if (ver != DF_RDV_VERSION)
        return df_errf(e, -DF_ECORRUPT, "rdv: protocol version %u, this build speaks %u", ver,
                       DF_RDV_VERSION);
    f->code = df_le32(buf + 12);
    f->world = df_le32(buf + 16);
    f->len = df_le32(buf + 20);
    if (f->len > DF_RDV_MAX_PAYLOAD || (f->hello && f->len))
        return df_errf(e, -DF_ECORRUPT, "rdv: payload length %u out of range", f->len);
    const uint8_t *id = buf + OFF_RUN_ID;
    int n = 0;
    while (n < DF_RDV_RUN_ID_MAX && id[n])
        n++;
    for (int i = n; i < DF_RDV_RUN_ID_MAX; i++)
        if (id[i])
            return df_errf(e, -DF_ECORRUPT, "rdv: run_id not NUL-padded");
    memcpy(f->run_id, id, (size_t)n);
    f->run_id[n] = 0;
    if (run_id_len(f->run_id) != n)
        return df_errf(e, -DF_ECORRUPT, "rdv: run_id empty or not [A-Za-z0-9._-]");
    return 0;
}

int df_rdv_frame_check_crc(const uint8_t frame[DF_RDV_FRAME], const void *payload,
                           size_t payload_n, df_err *e)
{
    if (df_le32(frame + OFF_CRC) != frame_crc(frame, payload, payload_n))
        return df_errf(e, -DF_ECORRUPT, "rdv: crc mismatch");
    return 0;
}

/* ---- sockets ---- */

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* Milliseconds to the deadline, 0 at or past it, at most cap. */
static int ms_left(double deadline, int cap)
{
    double ms = (deadline - df_now()) * 1000.0;
    return ms <= 0 ? 0 : ms >= cap ? cap : (int)ms + 1;
}

/* Sends all of buf on a non-blocking socket by the deadline. */
static int send_all(int fd, const void *buf, size_t n, double deadline)
{
    const uint8_t *p = buf;
    while (n) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return -errno;
        int ms = ms_left(deadline, 1000);
        if (!ms)
            return -ETIMEDOUT;
        struct pollfd pf = {fd, POLLOUT, 0};
        if (poll(&pf, 1, ms) < 0 && errno != EINTR)
            return -errno;
    }
    return 0;
}

/* Receives exactly n bytes by the deadline; -ECONNRESET on an early EOF. */
static int recv_all(int fd, void *buf, size_t n, double deadline)
{
    uint8_t *p = buf;
    while (n) {
        ssize_t k = recv(fd, p, n, 0);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
            continue;
        }
        if (k == 0)
            return -ECONNRESET;
        if (errno == EINTR)
            continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK)
            return -errno;
        int ms = ms_left(deadline, 1000);
        if (!ms)
            return -ETIMEDOUT;
        struct pollfd pf = {fd, POLLIN, 0};
        if (poll(&pf, 1, ms) < 0 && errno != EINTR)
            return -errno;
    }
    return 0;
}

/* "host:port", with brackets around an IPv6 literal. */
static void host_port(const df_rdv_opts *o, char *out, size_t cap)
{
    const char *h = o->master_addr && *o->master_addr ? o->master_addr : "*";
    snprintf(out, cap, strchr(h, ':') ? "[%.200s]:%d" : "%.200s:%d", h, o->master_port);
}

/* ---- rank 0 ---- */

typedef struct conn {
    int fd;      /* -1: free slot */
    int rank;    /* -1 until its hello was accepted */
    size_t got;  /* hello bytes so far */
    double t0;   /* accepted at */
    uint8_t buf[DF_RDV_FRAME];
} conn;

static int listen_on(const df_rdv_opts *o, int *out, df_err *e)
{
    int backlog = o->world < 4096 ? o->world + SPARE_SLOTS : 4096;
    int one = 1, zero = 0, err = 0;
    /* IPv6 any with IPv4 mapped takes both families; IPv4 where there is no IPv6 */
    for (int v6 = 1; v6 >= 0; v6--) {
        int fd = socket(v6 ? AF_INET6 : AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
        if (fd < 0) {
            err = errno;
            continue;
        }
        struct sockaddr_in6 a6;
        struct sockaddr_in a4;
        memset(&a6, 0, sizeof a6);
        memset(&a4, 0, sizeof a4);
        a6.sin6_family = AF_INET6;
        a6.sin6_addr = in6addr_any;
        a6.sin6_port = htons((uint16_t)o->master_port);
        a4.sin_family = AF_INET;
        a4.sin_addr.s_addr = htonl(INADDR_ANY);
        a4.sin_port = htons((uint16_t)o->master_port);
        int ok = setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) == 0 &&
                 (!v6 || setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero) == 0) &&
                 (v6 ? bind(fd, (struct sockaddr *)&a6, sizeof a6)
                     : bind(fd, (struct sockaddr *)&a4, sizeof a4)) == 0 &&
                 listen(fd, backlog) == 0;
        if (ok) {
            *out = fd;
            return 0;
        }
        err = errno;
        close(fd);
        if (err == EADDRINUSE)
            break;
    }
    if (err == EADDRINUSE)
        return df_errf(e, -EADDRINUSE, "rdv: rank 0: cannot listen on port %d: %s (another "
                                       "process holds it, e.g. torchrun's own store or an older "
                                       "launch: give another --master-port)",
                       o->master_port, strerror(err));
    return df_errf(e, -err, "rdv: rank 0: cannot listen on port %d: %s", o->master_port,
                   strerror(err));
}

/* Best effort, never blocks: a reply carrying code and a text instead of the
 * blob, so the peer fails at once saying why. */
static void refuse(int fd, const df_rdv_opts *o, int code, const char *msg)
{
    uint8_t out[DF_RDV_FRAME + 512];
    size_t n = strlen(msg);
    if (n > 511)
        n = 511;
    df_rdv_frame f = {.hello = 0, .code = (uint32_t)code, .world = (uint32_t)o->world,
                      .len = (uint32_t)n};
    snprintf(f.run_id, sizeof f.run_id, "%s", o->run_id);
    memcpy(out + DF_RDV_FRAME, msg, n);
    if (df_rdv_frame_encode(&f, out + DF_RDV_FRAME, out, NULL) == 0 &&
        send(fd, out, DF_RDV_FRAME + n, MSG_NOSIGNAL | MSG_DONTWAIT) < 0)
        df_log(DF_LOG_DEBUG, "rdv: rank 0: refusal not sent: %s", strerror(errno));
}

static void drop(conn *c)
{
    if (c->fd >= 0)
        close(c->fd);
    c->fd = -1;
    c->rank = -1;
    c->got = 0;
}

/* "1, 3" (the first 16 ranks that never joined, then a count). */
static void missing_list(const conn *cs, const int *joined, int world, char *out, size_t cap)
{
    size_t used = 0;
    int listed = 0, missing = 0;
    out[0] = 0;
    for (int r = 1; r < world; r++) {
        if (joined[r] >= 0 && cs[joined[r]].fd >= 0)
            continue;
        missing++;
        if (listed < 16 && used < cap) {
            int k = snprintf(out + used, cap - used, "%s%d", listed ? ", " : "", r);
            used += k > 0 ? (size_t)k : 0;
            listed++;
        }
    }
    if (missing > listed && used < cap)
        snprintf(out + used, cap - used, " and %d more", missing - listed);
}

typedef struct server {
    const df_rdv_opts *o;
    conn *cs;
    int nslot, *joined, njoined;
    int junk;            /* connections closed as not a dflash peer */
    char stranger[200];  /* the last hello of another run_id */
    int strangers;
    int fatal;           /* code of a misconfiguration: rank 0 gives up */
    char why[300];
} server;

/* A complete hello arrived on slot i. */
static void on_hello(server *s, int i)
{
    const df_rdv_opts *o = s->o;
    conn *c = &s->cs[i];
    df_rdv_frame f;
    df_err pe;
    if (df_rdv_frame_decode(c->buf, &f, &pe) || df_rdv_frame_check_crc(c->buf, NULL, 0, &pe) ||
        !f.hello) {
        df_log(DF_LOG_DEBUG, "rdv: rank 0: closed a connection that is not a dflash peer (%s)",
               f.hello ? pe.msg : "not a hello");
        s->junk++;
        drop(c);
        return;
    }
    char msg[300];
    if (strcmp(f.run_id, o->run_id)) {
        snprintf(msg, sizeof msg, "rank 0 on port %d serves run_id '%s', not '%s'",
                 o->master_port, o->run_id, f.run_id);
        refuse(c->fd, o, DF_EMISMATCH, msg);
        snprintf(s->stranger, sizeof s->stranger, "rank %u of run_id '%s'", f.code, f.run_id);
        s->strangers++;
        drop(c);
        return;
    }
    int code = 0;
    if (f.world != (uint32_t)o->world) {
        code = DF_EMISMATCH;
        snprintf(msg, sizeof msg, "rank %u was started with world %u, rank 0 with world %d",
                 f.code, f.world, o->world);
    } else if (f.code == 0) {
        code = EEXIST;
        snprintf(msg, sizeof msg, "a second process says it is rank 0");
    } else if (f.code >= (uint32_t)o->world) {
        code = EINVAL;
        snprintf(msg, sizeof msg, "rank %u is out of range for world %d", f.code, o->world);
    } else if (s->joined[f.code] >= 0) {
        code = EEXIST;
        snprintf(msg, sizeof msg, "rank %u joined twice (two processes were given that rank)",
                 f.code);
    }
    if (code) {
        refuse(c->fd, o, code, msg);
        drop(c);
        s->fatal = code;
        snprintf(s->why, sizeof s->why, "%s", msg);
        return;
    }
    c->rank = (int)f.code;
    s->joined[f.code] = i;
    s->njoined++;
}

/* Accepts what is queued on the listener; 0 or a fatal negative errno. */
static int accept_all(server *s, int lfd)
{
    for (;;) {
        int fd = accept4(lfd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EMFILE || errno == ENFILE)
                return -errno;
            return 0; /* EAGAIN, or a connection that died in the queue */
        }
        int i = 0;
        while (i < s->nslot && s->cs[i].fd >= 0)
            i++;
        if (i == s->nslot) { /* all slots mid-hello or joined: the peer retries */
            close(fd);
            s->junk++;
            continue;
        }
        s->cs[i] = (conn){.fd = fd, .rank = -1, .got = 0, .t0 = df_now()};
    }
}

/* Reads what slot i has to say. */
static void on_readable(server *s, int i)
{
    conn *c = &s->cs[i];
    if (c->rank >= 0) { /* a joined peer says nothing more: EOF (it died) or junk */
        s->joined[c->rank] = -1;
        s->njoined--;
        df_log(DF_LOG_DEBUG, "rdv: rank 0: rank %d left before the id was sent", c->rank);
        drop(c);
        return;
    }
    ssize_t k = recv(c->fd, c->buf + c->got, DF_RDV_FRAME - c->got, 0);
    if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR))
        return;
    if (k <= 0) {
        s->junk++;
        drop(c);
        return;
    }
    c->got += (size_t)k;
    if (c->got == DF_RDV_FRAME)
        on_hello(s, i);
}

static int serve(const df_rdv_opts *o, const void *blob, size_t len, double deadline,
                 df_err *e)
{
    const double t0 = df_now();
    int lfd = -1;
    int rc = listen_on(o, &lfd, e);
    if (rc)
        return rc;
    server s = {.o = o, .nslot = o->world - 1 + SPARE_SLOTS};
    s.cs = calloc((size_t)s.nslot, sizeof *s.cs);
    s.joined = malloc((size_t)o->world * sizeof *s.joined);
    struct pollfd *pf = calloc((size_t)s.nslot + 1, sizeof *pf);
    int *slot_of = calloc((size_t)s.nslot + 1, sizeof *slot_of);
    if (!s.cs || !s.joined || !pf || !slot_of) {
        rc = df_errf(e, -ENOMEM, "rdv: rank 0: out of memory for world %d", o->world);
        goto out;
    }
    for (int i = 0; i < s.nslot; i++)
        s.cs[i].fd = -1, s.cs[i].rank = -1;
    for (int r = 0; r < o->world; r++)
        s.joined[r] = -1;
    while (s.njoined < o->world - 1 && !s.fatal) {
        double now = df_now();
        if (now >= deadline)
            break;
        int k = 0;
        pf[k++] = (struct pollfd){lfd, POLLIN, 0};
        for (int i = 0; i < s.nslot; i++) {
            conn *c = &s.cs[i];
            if (c->fd < 0)
                continue;
            if (c->rank < 0 && now - c->t0 > DF_RDV_HELLO_S) { /* silent: free the slot */
                s.junk++;
                drop(c);
                continue;
            }
            slot_of[k] = i;
            pf[k++] = (struct pollfd){c->fd, POLLIN, 0};
        }
        int pr = poll(pf, (nfds_t)k, ms_left(deadline, 250));
        if (pr < 0 && errno != EINTR) {
            rc = df_errf(e, -errno, "rdv: rank 0: poll: %s", strerror(errno));
            goto out;
        }
        if (pr <= 0)
            continue;
        if (pf[0].revents & POLLIN) {
            int ar = accept_all(&s, lfd);
            if (ar) {
                rc = df_errf(e, ar, "rdv: rank 0: accept: %s (world %d needs about %d open "
                                    "files: raise ulimit -n)", strerror(-ar), o->world,
                             o->world + SPARE_SLOTS + 16);
                goto out;
            }
        }
        for (int j = 1; j < k && !s.fatal; j++)
            if (pf[j].revents && s.cs[slot_of[j]].fd == pf[j].fd)
                on_readable(&s, slot_of[j]);
    }
    char hp[300];
    host_port(o, hp, sizeof hp);
    if (s.fatal) {
        rc = df_errf(e, s.fatal == DF_EMISMATCH ? -DF_EMISMATCH : -s.fatal,
                     "rdv: rank 0 (%s, run_id '%s'): %s", hp, o->run_id, s.why);
    } else if (s.njoined < o->world - 1) {
        char list[256], extra[300] = "";
        missing_list(s.cs, s.joined, o->world, list, sizeof list);
        if (s.strangers)
            snprintf(extra, sizeof extra, "; refused %d connection(s) of another launch (last: "
                                          "%s)", s.strangers, s.stranger);
        rc = df_errf(e, -ETIMEDOUT, "rdv: rank 0 (%s, run_id '%s'): timed out after %.1f s "
                                    "waiting for world %d: rank(s) %s never joined%s",
                     hp, o->run_id, df_now() - t0, o->world, list, extra);
    }
    if (rc) { /* the joined peers fail at once, with rank 0's reason */
        char msg[600];
        snprintf(msg, sizeof msg, "%.500s", e ? e->msg : "rank 0 failed");
        for (int i = 0; i < s.nslot; i++)
            if (s.cs[i].fd >= 0 && s.cs[i].rank >= 0)
                refuse(s.cs[i].fd, o, ECONNABORTED, msg);
        goto out;
    }
    /* everyone is here: the blob to each */
    uint8_t *out = malloc(DF_RDV_FRAME + len);
    df_rdv_frame f = {.hello = 0, .code = 0, .world = (uint32_t)o->world, .len = (uint32_t)len};
    snprintf(f.run_id, sizeof f.run_id, "%s", o->run_id);
    if (!out) {
        rc = df_errf(e, -ENOMEM, "rdv: rank 0: out of memory");
        goto out;
    }
    memcpy(out + DF_RDV_FRAME, blob, len);
    rc = df_rdv_frame_encode(&f, blob, out, e);
    for (int r = 1; r < o->world && !rc; r++) {
        int sr = send_all(s.cs[s.joined[r]].fd, out, DF_RDV_FRAME + len, deadline);
        if (sr)
            rc = df_errf(e, sr, "rdv: rank 0 (%s): sending the id to rank %d: %s", hp, r,
                         strerror(-sr));
    }
    free(out);
out:
    if (s.cs)
        for (int i = 0; i < s.nslot; i++)
            drop(&s.cs[i]);
    close(lfd);
    free(s.cs);
    free(s.joined);
    free(pf);
    free(slot_of);
    return rc;
}

/* ---- the other ranks ---- */

/* Connects to one address by the limit: the fd, or -1 with the reason in why. */
static int connect_one(const struct addrinfo *ai, double limit, char *why, size_t cap)
{
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
    if (fd < 0) {
        snprintf(why, cap, "socket: %s", strerror(errno));
        return -1;
    }
    int err = 0;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0) {
        err = errno;
        while (err == EINPROGRESS || err == EINTR) {
            int ms = ms_left(limit, 1000);
            if (!ms) {
                err = ETIMEDOUT;
                break;
            }
            struct pollfd pf = {fd, POLLOUT, 0};
            int pr = poll(&pf, 1, ms);
            if (pr < 0 && errno != EINTR) {
                err = errno;
                break;
            }
            if (pr > 0) {
                socklen_t sl = sizeof err;
                if (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &sl) != 0)
                    err = errno;
                break;
            }
        }
    }
    if (!err) {
        /* a connect to a free local port can meet itself (TCP simultaneous
         * open) when the ephemeral port equals it: not rank 0 */
        struct sockaddr_storage a, b;
        socklen_t la = sizeof a, lb = sizeof b;
        if (getsockname(fd, (struct sockaddr *)&a, &la) == 0 &&
            getpeername(fd, (struct sockaddr *)&b, &lb) == 0 && la == lb && !memcmp(&a, &b, la))
            err = ECONNREFUSED;
    }
    if (err) {
        snprintf(why, cap, "%s", strerror(err));
        close(fd);
        return -1;
    }
    return fd;
}

/* Talks to rank 0 over a connected fd. 1: try again (rank 0 closed the
 * connection without a word), 0: done, < 0: failed (e filled). */
static int ask(const df_rdv_opts *o, int fd, const uint8_t hello[DF_RDV_FRAME], void *blob,
               size_t *len, size_t cap, double deadline, const char *hp, char *why,
               size_t whycap, df_err *e)
{
    int rc = send_all(fd, hello, DF_RDV_FRAME, deadline);
    uint8_t fr[DF_RDV_FRAME];
    if (!rc)
        rc = recv_all(fd, fr, sizeof fr, deadline);
    if (rc == -ECONNRESET || rc == -EPIPE) {
        snprintf(why, whycap, "rank 0 closed the connection before answering");
        return 1;
    }
    if (rc == -ETIMEDOUT)
        return df_errf(e, -ETIMEDOUT, "rdv: rank %d: connected to rank 0 at %s but no id came "
                                      "within the timeout (rank 0 waits until all %d ranks "
                                      "have joined: some never started, or were started with "
                                      "another MASTER_ADDR/PORT)", o->rank, hp, o->world);
    if (rc)
        return df_errf(e, rc, "rdv: rank %d: talking to rank 0 at %s: %s", o->rank, hp,
                       strerror(-rc));
    df_rdv_frame f;
    df_err pe;
    if (df_rdv_frame_decode(fr, &f, &pe) || f.hello)
        return df_errf(e, -DF_ECORRUPT, "rdv: rank %d: %s answered with something that is not "
                                        "a dflash rendezvous reply (%s)", o->rank, hp,
                       f.hello ? "a hello" : pe.msg);
    uint8_t pay[DF_RDV_MAX_PAYLOAD + 1];
    rc = recv_all(fd, pay, f.len, deadline);
    if (rc)
        return df_errf(e, rc == -ECONNRESET ? -DF_ECORRUPT : rc, "rdv: rank %d: reading rank "
                                                                 "0's reply from %s: %s",
                       o->rank, hp, rc == -ECONNRESET ? "cut short" : strerror(-rc));
    if (df_rdv_frame_check_crc(fr, pay, f.len, &pe))
        return df_errf(e, -DF_ECORRUPT, "rdv: rank %d: rank 0's reply from %s: %s", o->rank,
                       hp, pe.msg);
    if (f.code) {
        pay[f.len] = 0;
        for (uint32_t i = 0; i < f.len; i++)
            if (pay[i] < 32 || pay[i] > 126)
                pay[i] = '?';
        int code = f.code == DF_EMISMATCH || f.code < 1000 ? -(int)f.code : -EPROTO;
        return df_errf(e, code, "rdv: rank %d: rank 0 at %s %s: %.400s", o->rank, hp,
                       f.code == ECONNABORTED ? "gave up" : "refused this rank", (char *)pay);
    }
    if (f.world != (uint32_t)o->world || strcmp(f.run_id, o->run_id))
        return df_errf(e, -DF_EMISMATCH, "rdv: rank %d: rank 0 at %s answered for run_id '%s' "
                                         "world %u, this rank has '%s' world %d", o->rank, hp,
                       f.run_id, f.world, o->run_id, o->world);
    if (f.len > cap)
        return df_errf(e, -EMSGSIZE, "rdv: rank %d: rank 0's blob is %u bytes, room for %zu",
                       o->rank, f.len, cap);
    memcpy(blob, pay, f.len);
    *len = f.len;
    return 0;
}

static int join(const df_rdv_opts *o, void *blob, size_t *len, size_t cap, double deadline,
                df_err *e)
{
    const double t0 = df_now();
    char hp[300], port[16], why[300] = "nothing tried yet";
    host_port(o, hp, sizeof hp);
    snprintf(port, sizeof port, "%d", o->master_port);
    uint8_t hello[DF_RDV_FRAME];
    df_rdv_frame f = {.hello = 1, .code = (uint32_t)o->rank, .world = (uint32_t)o->world};
    snprintf(f.run_id, sizeof f.run_id, "%s", o->run_id);
    int rc = df_rdv_frame_encode(&f, NULL, hello, e);
    if (rc)
        return rc;
    int pause_ms = 10;
    while (df_now() < deadline) {
        struct addrinfo hints, *res = NULL;
        memset(&hints, 0, sizeof hints);
        hints.ai_family = AF_UNSPEC;
        hints.ai_socktype = SOCK_STREAM;
        hints.ai_flags = AI_NUMERICSERV;
        int g = getaddrinfo(o->master_addr, port, &hints, &res);
        if (g) {
            snprintf(why, sizeof why, "cannot resolve '%.200s': %s", o->master_addr,
                     g == EAI_SYSTEM ? strerror(errno) : gai_strerror(g));
        } else {
            for (const struct addrinfo *ai = res; ai; ai = ai->ai_next) {
                /* one address may not hold the whole wait: others may answer */
                double limit = df_now() + 2.0 < deadline ? df_now() + 2.0 : deadline;
                int fd = connect_one(ai, limit, why, sizeof why);
                if (fd < 0)
                    continue;
                rc = ask(o, fd, hello, blob, len, cap, deadline, hp, why, sizeof why, e);
                close(fd);
                if (rc <= 0) {
                    freeaddrinfo(res);
                    return rc;
                }
            }
            freeaddrinfo(res);
        }
        int ms = ms_left(deadline, pause_ms);
        sleep_ms(ms);
        pause_ms = pause_ms < 250 ? pause_ms * 2 : 250;
    }
    return df_errf(e, -ETIMEDOUT, "rdv: rank %d: timed out after %.1f s trying to connect to "
                                  "rank 0 at %s (MASTER_ADDR:MASTER_PORT) for the id; last "
                                  "try: %s", o->rank, df_now() - t0, hp, why);
}

int df_rdv_tcp(const df_rdv_opts *o, void *blob, size_t *len, size_t cap, df_err *e)
{
    const double deadline = df_now() + o->timeout_ms / 1000.0;
    if (o->master_port < 1 || o->master_port > 65535)
        return df_errf(e, -EINVAL, "rdv: port %d: want 1..65535", o->master_port);
    if (o->world < 2 || o->world > DF_RDV_MAX_WORLD || o->rank < 0 || o->rank >= o->world)
        return df_errf(e, -EINVAL, "rdv: rank %d of world %d: want 0 <= rank < world, world in "
                                   "2..%d", o->rank, o->world, DF_RDV_MAX_WORLD);
    if (run_id_len(o->run_id) < 0)
        return df_errf(e, -EINVAL, "rdv: run_id '%.80s': want 1..%d of [A-Za-z0-9._-]",
                       o->run_id ? o->run_id : "(null)", DF_RDV_RUN_ID_MAX);
    if (o->timeout_ms <= 0)
        return df_errf(e, -EINVAL, "rdv: timeout %d ms: want > 0", o->timeout_ms);
    if (o->rank == 0) {
        if (*len > DF_RDV_MAX_PAYLOAD || (*len && !blob))
            return df_errf(e, -EINVAL, "rdv: blob of %zu bytes (at most %d)", *len,
                           DF_RDV_MAX_PAYLOAD);
        return serve(o, blob, *len, deadline, e);
    }
    if (!o->master_addr || !*o->master_addr)
        return df_errf(e, -EINVAL, "rdv: rank %d: no master address (MASTER_ADDR)", o->rank);
    return join(o, blob, len, cap, deadline, e);
}
