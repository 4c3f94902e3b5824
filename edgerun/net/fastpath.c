/* The datagram path of a tensor-parallel master in native code: a block's input sent to every node in one system
 * call, and the merge of a block's one-datagram partials (receive, check, authenticate, add) with no interpreter
 * work per datagram. Everything else (fragments, parity rebuilds, Resend, loss models, control) stays in Python
 * (edgerun.net.native compiles this file once per machine and loads it through ctypes: no Python API here).
 *
 * The wire format is edgerun.net.wire's: a 30-byte header, the payload, a 12-byte nonce and the 16-byte GMAC tag
 * (AES-256-GCM over header and payload, nothing encrypted). The tag is checked with the system's OpenSSL
 * (libcrypto.so.3, opened at run time: no headers are needed to build this file), as the cryptography package
 * makes it.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define HEADER 30
#define NONCE 12
#define TAG 16
#define TRAILER (NONCE + TAG)
#define MATCHED 15 /* magic, version, type, session, position, layer, block: what names a block's datagram */
#define MAX_DATAGRAM 65600
#define MAX_ADDRS 256

/* OpenSSL's EVP interface, as far as GMAC needs it (EVP_CIPHER_CTX and EVP_CIPHER are opaque). */
#define EVP_CTRL_GCM_SET_TAG 0x11
typedef void *(*ctx_new_f)(void);
typedef void (*ctx_free_f)(void *);
typedef const void *(*cipher_f)(void);
typedef int (*init_f)(void *, const void *, void *, const unsigned char *, const unsigned char *);
typedef int (*update_f)(void *, unsigned char *, int *, const unsigned char *, int);
typedef int (*final_f)(void *, unsigned char *, int *);
typedef int (*ctrl_f)(void *, int, int, void *);

static struct {
    int loaded;
    ctx_new_f ctx_new;
    ctx_free_f ctx_free;
    cipher_f aes_256_gcm;
    init_f decrypt_init;
    update_f decrypt_update;
    final_f decrypt_final;
    ctrl_f ctrl;
} evp;

static int load_libcrypto(void) {
    if (evp.loaded) return evp.loaded > 0;
    void *lib = dlopen("libcrypto.so.3", RTLD_NOW | RTLD_LOCAL);
    if (!lib) lib = dlopen("libcrypto.so", RTLD_NOW | RTLD_LOCAL);
    evp.loaded = -1;
    if (!lib) return 0;
    evp.ctx_new = (ctx_new_f)dlsym(lib, "EVP_CIPHER_CTX_new");
    evp.ctx_free = (ctx_free_f)dlsym(lib, "EVP_CIPHER_CTX_free");
    evp.aes_256_gcm = (cipher_f)dlsym(lib, "EVP_aes_256_gcm");
    evp.decrypt_init = (init_f)dlsym(lib, "EVP_DecryptInit_ex");
    evp.decrypt_update = (update_f)dlsym(lib, "EVP_DecryptUpdate");
    evp.decrypt_final = (final_f)dlsym(lib, "EVP_DecryptFinal_ex");
    evp.ctrl = (ctrl_f)dlsym(lib, "EVP_CIPHER_CTX_ctrl");
    if (!evp.ctx_new || !evp.ctx_free || !evp.aes_256_gcm || !evp.decrypt_init || !evp.decrypt_update ||
        !evp.decrypt_final || !evp.ctrl)
        return 0;
    evp.loaded = 1;
    return 1;
}

/* One cluster key's cipher (its key schedule made once) and a receive buffer. Used by one thread at a time. */
typedef struct {
    void *open;
    unsigned char buf[MAX_DATAGRAM];
} er_ctx;

void er_free(er_ctx *c) {
    if (!c) return;
    if (c->open) evp.ctx_free(c->open);
    free(c);
}

er_ctx *er_new(const unsigned char *key) {
    if (!load_libcrypto()) return NULL;
    er_ctx *c = calloc(1, sizeof(er_ctx));
    if (!c) return NULL;
    c->open = evp.ctx_new();
    if (!c->open || evp.decrypt_init(c->open, evp.aes_256_gcm(), NULL, key, NULL) != 1) {
        er_free(c);
        return NULL;
    }
    return c;
}

/* 1 if a datagram of `len` bytes carries the tag of its header and payload under its nonce. */
int er_authentic(er_ctx *c, const unsigned char *d, int len) {
    unsigned char none[16];
    int n = 0;
    if (len < HEADER + TRAILER) return 0;
    const unsigned char *nonce = d + len - TRAILER;
    return evp.decrypt_init(c->open, NULL, NULL, NULL, nonce) == 1 &&
           evp.decrypt_update(c->open, NULL, &n, d, len - TRAILER) == 1 &&
           evp.ctrl(c->open, EVP_CTRL_GCM_SET_TAG, TAG, (void *)(d + len - TAG)) == 1 &&
           evp.decrypt_final(c->open, none, &n) > 0;
}

/* One datagram to n addresses (IPv4, network order) in one system call: how many went out (a full socket
 * buffer or an unreachable address ends the batch early; the caller counts the rest as dropped). */
int er_send_many(int fd, const unsigned char *d, int len, const uint32_t *ips, const uint16_t *ports, int n) {
    struct sockaddr_in addrs[MAX_ADDRS];
    struct mmsghdr msgs[MAX_ADDRS];
    struct iovec iov = {(void *)d, (size_t)len};
    if (n > MAX_ADDRS) n = MAX_ADDRS;
    memset(msgs, 0, sizeof(struct mmsghdr) * (size_t)n);
    for (int i = 0; i < n; i++) {
        memset(&addrs[i], 0, sizeof addrs[i]);
        addrs[i].sin_family = AF_INET;
        addrs[i].sin_addr.s_addr = ips[i];
        addrs[i].sin_port = ports[i];
        msgs[i].msg_hdr.msg_name = &addrs[i];
        msgs[i].msg_hdr.msg_namelen = sizeof addrs[i];
        msgs[i].msg_hdr.msg_iov = &iov;
        msgs[i].msg_hdr.msg_iovlen = 1;
    }
    int sent = 0;
    while (sent < n) {
        int r = sendmmsg(fd, msgs + sent, (unsigned)(n - sent), 0);
        if (r < 0) {
            if (errno == EINTR) continue;
            break;
        }
        sent += r;
    }
    return sent;
}

static double now_s(clockid_t clock) {
    struct timespec t;
    clock_gettime(clock, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* One waiting datagram into c->buf: its length (0: none waiting, -1: an error to skip), and when it arrived
 * (monotonic seconds, from the kernel's realtime stamp where the socket gives one). */
static int receive(er_ctx *c, int fd, double clock_offset, double *arrived) {
    char control[64];
    struct iovec iov = {c->buf, MAX_DATAGRAM};
    struct msghdr msg = {0};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control;
    msg.msg_controllen = sizeof control;
    ssize_t r = recvmsg(fd, &msg, MSG_DONTWAIT);
    if (r < 0) return (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) ? 0 : -1;
    *arrived = now_s(CLOCK_MONOTONIC);
    for (struct cmsghdr *h = CMSG_FIRSTHDR(&msg); h; h = CMSG_NXTHDR(&msg, h)) {
        if (h->cmsg_level == SOL_SOCKET && h->cmsg_type == SO_TIMESTAMPNS) {
            struct timespec t;
            memcpy(&t, CMSG_DATA(h), sizeof t);
            double stamped = (double)t.tv_sec + (double)t.tv_nsec * 1e-9 + clock_offset;
            if (stamped < *arrived) *arrived = stamped;
        }
    }
    return (int)(r > MAX_DATAGRAM ? MAX_DATAGRAM : r);
}

static int readable(const int *fds, int n, int timeout_ms) {
    struct pollfd p[16];
    if (n > 16) n = 16;
    for (int i = 0; i < n; i++) p[i] = (struct pollfd){fds[i], POLLIN, 0};
    return n > 0 && poll(p, (nfds_t)n, timeout_ms) > 0;
}

enum { DONE = 0, TIMEOUT = 1, WATCHED = 2, OTHER = 3 };

/* A master's merge of one block: what er_drain reads and writes (edgerun.net.native.Merge mirrors it). */
typedef struct {
    int fd;          /* the UDP socket */
    int n;           /* elements of a partial */
    int nodes;       /* node indices below this one may be awaited */
    int outstanding; /* partials awaited */
    int first;       /* a partial of the block came already */
    int n_watch;
    int other_len;
    int pad;
    double deadline; /* monotonic seconds */
    double lag_bound; /* < 0: none */
    double spin_s;
    double other_at;
    float *total;
    float *parts; /* nodes x n */
    unsigned char *other;
    int other_cap;
    int watch[16];
    unsigned char match[MATCHED + 1];
    unsigned char want[256];
    unsigned char parity[256];
    double arrived[256];
} er_merge;

/* A master's wait for the partials of one block, each a float32 vector of n elements in one datagram (its data or
 * its parity copy). For every node i with want[i] set: its partial's elements are copied to parts + i * n and
 * added into total, want[i] cleared, arrived[i] and parity[i] set, outstanding lowered. Returns
 *   DONE     when outstanding is 0;
 *   TIMEOUT  once the deadline (monotonic seconds) passes: the first partial (with none before: first 0) brings it
 *            to lag_bound after its arrival, where lag_bound >= 0;
 *   WATCHED  as soon as one of the watch descriptors (streams the event loop reads) has data;
 *   OTHER    with any other datagram, copied to other (other_len bytes, arrived at other_at): the caller handles it
 *            as it handles every datagram, and calls again.
 * Datagrams are taken as they come: after one, and at first, the socket is polled without sleeping (and the core
 * yielded between polls) for spin_s; then the wait sleeps in poll() until a datagram, a watched stream or the
 * deadline. The header is checked before the tag, so nothing of another block costs a GMAC here. */
int er_drain(er_ctx *c, er_merge *m) {
    int n_watch = m->n_watch < 16 ? m->n_watch : 16;
    double clock_offset = now_s(CLOCK_MONOTONIC) - now_s(CLOCK_REALTIME);
    double idle_until = now_s(CLOCK_MONOTONIC) + m->spin_s;
    unsigned spins = 0;
    int n = m->n;
    int length = HEADER + n * 4 + TRAILER;
    while (m->outstanding > 0) {
        double at = 0.0;
        int len = receive(c, m->fd, clock_offset, &at);
        if (len < 0) continue;
        if (len > 0) {
            const unsigned char *d = c->buf;
            int node = d[15];
            uint16_t index, count;
            uint32_t offset, plen;
            memcpy(&index, d + 16, 2);
            memcpy(&count, d + 18, 2);
            memcpy(&offset, d + 22, 4);
            memcpy(&plen, d + 26, 4);
            if (len == length && memcmp(d, m->match, MATCHED) == 0 && node < m->nodes && m->want[node] &&
                count == 1 && index <= 1 && d[20] == 0 && d[21] == 1 && offset == 0 && plen == (uint32_t)(n * 4) &&
                er_authentic(c, d, len)) {
                float *part = m->parts + (size_t)node * (size_t)n;
                float *total = m->total;
                memcpy(part, d + HEADER, (size_t)n * 4);
                for (int i = 0; i < n; i++) total[i] += part[i];
                m->want[node] = 0;
                m->arrived[node] = at;
                m->parity[node] = index == 1;
                m->outstanding -= 1;
                if (!m->first && m->lag_bound >= 0) {
                    double bound = now_s(CLOCK_MONOTONIC) + m->lag_bound;
                    if (bound < m->deadline) m->deadline = bound;
                }
                m->first = 1;
                idle_until = now_s(CLOCK_MONOTONIC) + m->spin_s;
                continue;
            }
            if (len == length && memcmp(d, m->match, MATCHED) == 0 && node < m->nodes && !m->want[node] &&
                count == 1 && index == 1)
                continue; /* the parity copy of a partial merged already: expected, and nothing to do */
            if (len > m->other_cap) continue;
            memcpy(m->other, d, (size_t)len);
            m->other_len = len;
            m->other_at = at;
            return OTHER;
        }
        double now = now_s(CLOCK_MONOTONIC);
        if (now >= m->deadline) return TIMEOUT;
        if (now < idle_until) {
            if (++spins % 32 == 0 && readable(m->watch, n_watch, 0)) return WATCHED;
            sched_yield();
            continue;
        }
        double wait = m->deadline - now;
        struct pollfd p[17];
        p[0] = (struct pollfd){m->fd, POLLIN, 0};
        for (int i = 0; i < n_watch; i++) p[i + 1] = (struct pollfd){m->watch[i], POLLIN, 0};
        struct timespec timeout = {(time_t)wait, (long)((wait - (double)(time_t)wait) * 1e9)};
        if (wait > 1.0) timeout = (struct timespec){1, 0};
        if (ppoll(p, (nfds_t)(n_watch + 1), &timeout, NULL) > 0) {
            for (int i = 1; i <= n_watch; i++)
                if (p[i].revents) return WATCHED;
        }
    }
    return DONE;
}
