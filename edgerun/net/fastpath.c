/* The tensor-parallel block exchange's per-datagram work in C: seal and send a vector to every node of
 * a block, and take a block's partials off the socket (check, decode, stamp) until the block is whole,
 * its deadline passes or something else arrives, then add them up in the participants' order.
 *
 * The wire format is edgerun.net.wire's (its docstring is the reference): a 30-byte little-endian header, the
 * payload, a 12-byte nonce and a 16-byte AES-256-GCM tag over header and payload with nothing encrypted (GMAC).
 * The GMAC is OpenSSL's, from the libcrypto the process has loaded already (Python's hashlib and ssl link it),
 * found by path at run time: nothing to link against at build time, and the same instructions as the Python path.
 *
 * A vector longer than its link's datagrams (a lossy link's at a 1500-byte MTU) is cut as wire.fragment cuts it, with
 * net.erasure's parity fragments, and joined again (lost fragments rebuilt) on the other side.
 *
 * No Python API: edgerun.native loads this library with ctypes, which releases the GIL for each call. Anything this
 * code does not handle (a vector of more fragments than it joins, a stray packet, a datagram that fails its check,
 * which the Python side then counts by its reason) goes back to the caller whole, so the exchange's semantics stay
 * in Python.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <poll.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>

#define HEADER_SIZE 30
#define NONCE_SIZE 12
#define MAC_SIZE 16
#define TRAILER (NONCE_SIZE + MAC_SIZE)
#define MAX_DATAGRAM 65536
#define VERSION 5
#define Q8_BLOCK 32
#define Q8_BLOCK_BYTES 34
#define MAX_PARITY 4 /* parity fragments a vector may have (wire.MAX_PARITY) */
#define MAX_COPIES (1 + MAX_PARITY) /* a one-datagram vector and its parity copies */
/* A vector longer than one datagram of its link (a lossy link's: wire.fragment cuts it, each fragment decoded on its
 * own) is cut and joined here too, up to MAX_FRAGS data fragments of at most MAX_FRAG_PAYLOAD bytes each (paths of
 * up to about 4 KB MTU: Ethernet's 1500 bytes cut a float32 vector of 2048 elements into 6), for up to FRAG_SLOTS
 * participants of a block at once. */
#define MAX_FRAGS 16
#define MAX_FRAG_PAYLOAD 4096
#define FRAG_SLOTS 32

enum codec { F32 = 0, F16 = 1, Q8 = 2 };
enum msg_type { ACTIVATION = 1, PARTIAL = 2 };
enum block_kind { ATTN = 0, MLP = 1, HEAD = 2 };
enum gather_end { WHOLE = 0, TIME = 1, STREAM = 2, OTHER = 3, INCOMPLETE = 4, DONE = 5, IDLE = 6, MIRRORED = 7,
                  MIRROR_WAIT = 8 };

/* ---- OpenSSL's EVP interface, resolved with dlsym (the few calls a GMAC needs) ---------------------------- */
typedef void EVP_CIPHER_CTX;
typedef void EVP_CIPHER;
#define EVP_CTRL_GCM_GET_TAG 0x10
#define EVP_CTRL_GCM_SET_TAG 0x11

typedef struct crypto {
    EVP_CIPHER_CTX *(*ctx_new)(void);
    void (*ctx_free)(EVP_CIPHER_CTX *);
    const EVP_CIPHER *(*aes_256_gcm)(void);
    int (*encrypt_init)(EVP_CIPHER_CTX *, const EVP_CIPHER *, void *, const uint8_t *, const uint8_t *);
    int (*encrypt_update)(EVP_CIPHER_CTX *, uint8_t *, int *, const uint8_t *, int);
    int (*encrypt_final)(EVP_CIPHER_CTX *, uint8_t *, int *);
    int (*decrypt_init)(EVP_CIPHER_CTX *, const EVP_CIPHER *, void *, const uint8_t *, const uint8_t *);
    int (*decrypt_update)(EVP_CIPHER_CTX *, uint8_t *, int *, const uint8_t *, int);
    int (*decrypt_final)(EVP_CIPHER_CTX *, uint8_t *, int *);
    int (*ctrl)(EVP_CIPHER_CTX *, int, int, void *);
} crypto;

typedef struct er_ctx {
    crypto c;
    void *lib;
    EVP_CIPHER_CTX *sealer, *opener; /* keyed once: each message only sets its nonce */
    uint8_t nonce[NONCE_SIZE];       /* counts up, little-endian, from a random start (as wire._nonce) */
    uint8_t out[MAX_COPIES][MAX_DATAGRAM];
} er_ctx;

static int resolve(void *lib, void **slot, const char *name) {
    *slot = dlsym(lib, name);
    return *slot != NULL;
}

void er_free(er_ctx *ctx) {
    if (ctx == NULL) return;
    if (ctx->sealer) ctx->c.ctx_free(ctx->sealer);
    if (ctx->opener) ctx->c.ctx_free(ctx->opener);
    free(ctx);
}

/* A context for one cluster key; NULL where libcrypto cannot be loaded or keyed. `nonce` is the random start. */
static void gf_init(void);

er_ctx *er_new(const char *libcrypto, const uint8_t key[32], const uint8_t nonce[NONCE_SIZE]) {
    gf_init();
    void *lib = dlopen(libcrypto, RTLD_NOW | RTLD_LOCAL);
    if (lib == NULL) return NULL;
    er_ctx *ctx = calloc(1, sizeof(er_ctx));
    if (ctx == NULL) return NULL;
    crypto *c = &ctx->c;
    int ok = resolve(lib, (void **)&c->ctx_new, "EVP_CIPHER_CTX_new") &&
             resolve(lib, (void **)&c->ctx_free, "EVP_CIPHER_CTX_free") &&
             resolve(lib, (void **)&c->aes_256_gcm, "EVP_aes_256_gcm") &&
             resolve(lib, (void **)&c->encrypt_init, "EVP_EncryptInit_ex") &&
             resolve(lib, (void **)&c->encrypt_update, "EVP_EncryptUpdate") &&
             resolve(lib, (void **)&c->encrypt_final, "EVP_EncryptFinal_ex") &&
             resolve(lib, (void **)&c->decrypt_init, "EVP_DecryptInit_ex") &&
             resolve(lib, (void **)&c->decrypt_update, "EVP_DecryptUpdate") &&
             resolve(lib, (void **)&c->decrypt_final, "EVP_DecryptFinal_ex") &&
             resolve(lib, (void **)&c->ctrl, "EVP_CIPHER_CTX_ctrl");
    ctx->lib = lib;
    if (ok) {
        ctx->sealer = c->ctx_new();
        ctx->opener = c->ctx_new();
        ok = ctx->sealer && ctx->opener && c->encrypt_init(ctx->sealer, c->aes_256_gcm(), NULL, key, NULL) == 1 &&
             c->decrypt_init(ctx->opener, c->aes_256_gcm(), NULL, key, NULL) == 1;
    }
    if (!ok) {
        er_free(ctx);
        return NULL;
    }
    memcpy(ctx->nonce, nonce, NONCE_SIZE);
    return ctx;
}

static void next_nonce(er_ctx *ctx, uint8_t *into) {
    memcpy(into, ctx->nonce, NONCE_SIZE);
    for (int i = 0; i < NONCE_SIZE && ++ctx->nonce[i] == 0; i++) {
    }
}

/* Append a fresh nonce and the tag of data[0:len] after it; the sealed length. */
int er_seal(er_ctx *ctx, uint8_t *data, int len) {
    crypto *c = &ctx->c;
    uint8_t *nonce = data + len, scratch[16];
    int n;
    next_nonce(ctx, nonce);
    if (c->encrypt_init(ctx->sealer, NULL, NULL, NULL, nonce) != 1 ||
        c->encrypt_update(ctx->sealer, NULL, &n, data, len) != 1 || c->encrypt_final(ctx->sealer, scratch, &n) != 1 ||
        c->ctrl(ctx->sealer, EVP_CTRL_GCM_GET_TAG, MAC_SIZE, data + len + NONCE_SIZE) != 1)
        return -1;
    return len + TRAILER;
}

/* 1 where the datagram's tag is right. */
int er_verify(er_ctx *ctx, const uint8_t *data, int len) {
    crypto *c = &ctx->c;
    uint8_t scratch[16];
    int n, body = len - TRAILER;
    if (body < 0) return 0;
    return c->decrypt_init(ctx->opener, NULL, NULL, NULL, data + body) == 1 &&
           c->decrypt_update(ctx->opener, NULL, &n, data, body) == 1 &&
           c->ctrl(ctx->opener, EVP_CTRL_GCM_SET_TAG, MAC_SIZE, (void *)(data + body + NONCE_SIZE)) == 1 &&
           c->decrypt_final(ctx->opener, scratch, &n) > 0;
}

/* ---- codecs: the same bits as wire.encode_vector / decode_vector --------------------------------------- */
static uint16_t f16_bits(float value) {
    /* float32 to IEEE half, rounding to nearest even (numpy's astype("<f2")) */
    uint32_t x;
    memcpy(&x, &value, 4);
    uint32_t sign = (x >> 16) & 0x8000, mant = x & 0x7fffff;
    int exp = (int)((x >> 23) & 0xff);
    if (exp == 0xff) return (uint16_t)(sign | 0x7c00 | (mant ? 0x200 | (mant >> 13) : 0));
    int e = exp - 127 + 15;
    if (e >= 0x1f) return (uint16_t)(sign | 0x7c00);
    if (e <= 0) {
        if (e < -10) return (uint16_t)sign;
        mant |= 0x800000;
        int shift = 14 - e;
        uint32_t half = mant >> shift, rest = mant & ((1u << shift) - 1), mid = 1u << (shift - 1);
        if (rest > mid || (rest == mid && (half & 1))) half++;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)e << 10) | (mant >> 13), rest = mant & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (half & 1))) half++; /* may carry into the exponent: still right */
    return (uint16_t)(sign | half);
}

static float f16_value(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ff, x;
    if (exp == 0x1f) {
        x = sign | 0x7f800000 | (mant << 13);
    } else if (exp == 0) {
        if (mant == 0) {
            x = sign;
        } else {
            int e = -1;
            do {
                e++;
                mant <<= 1;
            } while (!(mant & 0x400));
            x = sign | ((uint32_t)(127 - 15 - e) << 23) | ((mant & 0x3ff) << 13);
        }
    } else {
        x = sign | ((exp - 15 + 127) << 23) | (mant << 13);
    }
    float f;
    memcpy(&f, &x, 4);
    return f;
}

int er_payload_bytes(int codec, int n) {
    if (codec == Q8) return (n + Q8_BLOCK - 1) / Q8_BLOCK * Q8_BLOCK_BYTES;
    return n * (codec == F32 ? 4 : 2);
}

/* x's n elements in a codec; the bytes written. */
int er_encode(int codec, const float *x, int n, uint8_t *out) {
    if (codec == F32) {
        memcpy(out, x, (size_t)n * 4);
    } else if (codec == F16) {
        for (int i = 0; i < n; i++) {
            uint16_t h = f16_bits(x[i]);
            memcpy(out + 2 * i, &h, 2);
        }
    } else {
        for (int b = 0; b * Q8_BLOCK < n; b++) {
            float block[Q8_BLOCK] = {0}, top = 0.0f;
            int m = n - b * Q8_BLOCK < Q8_BLOCK ? n - b * Q8_BLOCK : Q8_BLOCK;
            memcpy(block, x + b * Q8_BLOCK, (size_t)m * 4);
            for (int i = 0; i < Q8_BLOCK; i++) top = fmaxf(top, fabsf(block[i]));
            /* ggml's quantizer of a product's activations, as wire.encode_vector: the scale top / 127 as f16, each
             * value times 127 / top rounded to the nearest, ties to even */
            uint16_t bits = f16_bits(top / 127.0f);
            float inverse = top != 0.0f ? 127.0f / top : 0.0f;
            uint8_t *o = out + b * Q8_BLOCK_BYTES;
            memcpy(o, &bits, 2);
            for (int i = 0; i < Q8_BLOCK; i++) {
                float q = nearbyintf(block[i] * inverse);
                q = q < -127.0f ? -127.0f : (q > 127.0f ? 127.0f : q);
                o[2 + i] = (uint8_t)(int8_t)q;
            }
        }
    }
    return er_payload_bytes(codec, n);
}

void er_decode(int codec, const uint8_t *in, int n, float *out) {
    if (codec == F32) {
        memcpy(out, in, (size_t)n * 4);
    } else if (codec == F16) {
        for (int i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, in + 2 * i, 2);
            out[i] = f16_value(h);
        }
    } else {
        for (int i = 0; i < n; i++) {
            const uint8_t *block = in + (i / Q8_BLOCK) * Q8_BLOCK_BYTES;
            uint16_t bits;
            memcpy(&bits, block, 2);
            out[i] = (float)(int8_t)block[2 + i % Q8_BLOCK] * f16_value(bits);
        }
    }
}

/* ---- the header ----------------------------------------------------------------------------------------- */
typedef struct er_head { /* wire.Header's fields but the fragment's, which are those of a one-datagram vector */
    uint32_t session, position;
    uint16_t layer;
    uint8_t type, block, node, codec, tokens;
} er_head;

static void put16(uint8_t *p, uint16_t v) { memcpy(p, &v, 2); }
static void put32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static uint16_t get16(const uint8_t *p) {
    uint16_t v;
    memcpy(&v, p, 2);
    return v;
}
static uint32_t get32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static void pack_header(uint8_t *p, const er_head *h, uint16_t index, uint16_t count, uint32_t offset,
                        uint32_t length) {
    p[0] = 'E';
    p[1] = 'R';
    p[2] = VERSION;
    p[3] = h->type;
    put32(p + 4, h->session);
    put32(p + 8, h->position);
    put16(p + 12, h->layer);
    p[14] = h->block;
    p[15] = h->node;
    put16(p + 16, index);
    put16(p + 18, count);
    p[20] = h->codec;
    p[21] = h->tokens;
    put32(p + 22, offset); /* the fragment's first element */
    put32(p + 26, length);
}

/* ---- fragments: wire.fragment's cut and net.erasure's code ------------------------------------------------------
 * GF(2^8) with the polynomial x^8 + x^4 + x^3 + x^2 + 1 and generator 2: parity fragment j of data fragments D_i is
 * the sum over i of g^(j*i) * D_i, each zero-padded to the first (longest) fragment's length. */
static uint8_t gf_exp[510], gf_log[256];
#if defined(__x86_64__)
#include <immintrin.h>
static int gf_avx2; /* the CPU has AVX2 (gf_init asks) */
#endif

static void gf_init(void) {
    int value = 1;
    for (int power = 0; power < 255; power++) {
        gf_exp[power] = (uint8_t)value;
        gf_log[value] = (uint8_t)power;
        value <<= 1;
        if (value & 0x100) value ^= 0x11D;
    }
    for (int power = 255; power < 510; power++) gf_exp[power] = gf_exp[power - 255];
#if defined(__x86_64__)
    __builtin_cpu_init();
    gf_avx2 = __builtin_cpu_supports("avx2");
#endif
}

static uint8_t gf_mul(uint8_t a, uint8_t b) { return a && b ? gf_exp[gf_log[a] + gf_log[b]] : 0; }
static uint8_t gf_coefficient(int check, int index) { return gf_exp[(check * index) % 255]; }

#if defined(__x86_64__)

/* gf_mul_add 32 bytes at a time: c * b is c * (b's low nibble) ^ c * (b's high nibble), each a 16-entry table
 * lookup that one byte shuffle does for 32 bytes (the parity of a 1B model's float32 vector cut at a 1500-byte MTU
 * is 4 x 8 KB of products for every input and partial: a byte at a time, 60-100 µs a block on the master). */
__attribute__((target("avx2"))) static void gf_mul_add_avx2(uint8_t *out, const uint8_t *in, int n, uint8_t c) {
    uint8_t low[16], high[16];
    for (int b = 0; b < 16; b++) {
        low[b] = gf_mul(c, (uint8_t)b);
        high[b] = gf_mul(c, (uint8_t)(b << 4));
    }
    __m256i lows = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)low));
    __m256i highs = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)high));
    __m256i nibble = _mm256_set1_epi8(0x0f);
    int i = 0;
    for (; i + 32 <= n; i += 32) {
        __m256i v = _mm256_loadu_si256((const __m256i *)(in + i));
        __m256i product = _mm256_xor_si256(_mm256_shuffle_epi8(lows, _mm256_and_si256(v, nibble)),
                                           _mm256_shuffle_epi8(highs, _mm256_and_si256(_mm256_srli_epi64(v, 4),
                                                                                       nibble)));
        __m256i o = _mm256_loadu_si256((const __m256i *)(out + i));
        _mm256_storeu_si256((__m256i *)(out + i), _mm256_xor_si256(o, product));
    }
    for (; i < n; i++) out[i] ^= gf_mul(c, in[i]);
}
#endif

/* out[i] ^= c * in[i] for n bytes */
static void gf_mul_add(uint8_t *out, const uint8_t *in, int n, uint8_t c) {
    if (c == 0) return;
#if defined(__x86_64__)
    if (gf_avx2) {
        gf_mul_add_avx2(out, in, n, c);
        return;
    }
#endif
    if (c == 1) {
        for (int i = 0; i < n; i++) out[i] ^= in[i];
        return;
    }
    uint8_t row[256];
    for (int b = 0; b < 256; b++) row[b] = gf_mul(c, (uint8_t)b);
    for (int i = 0; i < n; i++) out[i] ^= row[in[i]];
}

/* For tests: gf_mul_add by the byte-at-a-time code (simd 0) or as this CPU runs it (1). */
void er_gf_mul_add(uint8_t *out, const uint8_t *in, int n, int c, int simd) {
#if defined(__x86_64__)
    int had = gf_avx2;
    gf_avx2 = simd && had;
    gf_mul_add(out, in, n, (uint8_t)c);
    gf_avx2 = had;
#else
    (void)simd;
    gf_mul_add(out, in, n, (uint8_t)c);
#endif
}

static void gf_scale(uint8_t *buf, int n, uint8_t c) {
    uint8_t row[256];
    for (int b = 0; b < 256; b++) row[b] = gf_mul(c, (uint8_t)b);
    for (int i = 0; i < n; i++) buf[i] = row[buf[i]];
}

/* wire.parity_fragments: the parity fragments after a vector of `count` data fragments on a link of `parity` */
static int parity_fragments(int parity, int count) {
    int n = parity + count / 2;
    return parity <= 0 ? 0 : n < MAX_PARITY ? n : MAX_PARITY;
}

/* wire.elements_per_fragment: the most elements one datagram of `mtu` bytes carries after `prefix` bytes, a whole
 * number of codec blocks. */
int er_elements_per_fragment(int codec, int mtu, int prefix) {
    int room = mtu - HEADER_SIZE - TRAILER - prefix;
    if (codec == Q8) return (room / Q8_BLOCK_BYTES < 1 ? 1 : room / Q8_BLOCK_BYTES) * Q8_BLOCK;
    int per = room / (codec == F32 ? 4 : 2);
    return per < 1 ? 1 : per;
}

/* The elements of a data fragment whose payload is `length` bytes (no prefix), starting `room` elements before its
 * vector's end; -1 where no count of them encodes to exactly that length. */
static int fragment_elements(int codec, int length, int room) {
    int n;
    if (codec == Q8) {
        if (length % Q8_BLOCK_BYTES) return -1;
        n = length / Q8_BLOCK_BYTES * Q8_BLOCK;
        n = n < room ? n : room;
    } else {
        n = length / (codec == F32 ? 4 : 2);
    }
    return n >= 1 && n <= room && er_payload_bytes(codec, n) == length ? n : -1;
}

/* A vector being joined from its fragments: which came (data and parity, a bit each) and their payloads, kept for a
 * rebuild. One per participant slot of the master's gather, one for the node's input. */
typedef struct joined {
    uint32_t session, position;
    uint16_t layer;
    uint8_t block, node;
    int32_t count, per; /* its data fragments, and the elements of each but the last (0: not known yet) */
    uint32_t data, checks;
    int32_t len[MAX_FRAGS + MAX_PARITY];
    uint8_t payload[MAX_FRAGS + MAX_PARITY][MAX_FRAG_PAYLOAD];
} joined;

static int bits(uint32_t v) { return __builtin_popcount(v); }

/* The missing data fragments from the parity that came (net.erasure.solve: Gaussian elimination over GF(2^8), every
 * parity fragment an equation), into their payload slots, `size` bytes each; 0 where the equations do not
 * determine them (the vector then stays incomplete, as if more were lost). */
static int rebuild(joined *j, int size, const int *missing, int m) {
    static uint8_t side_room[MAX_PARITY][MAX_FRAG_PAYLOAD];
    uint8_t rows[MAX_PARITY][MAX_PARITY];
    uint8_t *sides[MAX_PARITY];
    int n = 0;
    for (int c = 0; c < MAX_PARITY; c++) {
        if (!(j->checks >> c & 1)) continue;
        uint8_t *side = side_room[n];
        memset(side, 0, (size_t)size);
        memcpy(side, j->payload[j->count + c], (size_t)j->len[j->count + c]);
        for (int i = 0; i < j->count; i++)
            if (j->data >> i & 1) gf_mul_add(side, j->payload[i], j->len[i], gf_coefficient(c, i));
        for (int t = 0; t < m; t++) rows[n][t] = gf_coefficient(c, missing[t]);
        sides[n++] = side;
    }
    for (int col = 0; col < m; col++) {
        int pivot = -1;
        for (int r = col; r < n && pivot < 0; r++)
            if (rows[r][col]) pivot = r;
        if (pivot < 0) return 0;
        for (int t = 0; t < m; t++) {
            uint8_t v = rows[col][t];
            rows[col][t] = rows[pivot][t];
            rows[pivot][t] = v;
        }
        uint8_t *side = sides[col];
        sides[col] = sides[pivot];
        sides[pivot] = side;
        uint8_t inverse = gf_exp[255 - gf_log[rows[col][col]]];
        for (int t = 0; t < m; t++) rows[col][t] = gf_mul(inverse, rows[col][t]);
        gf_scale(sides[col], size, inverse);
        for (int r = 0; r < n; r++) {
            uint8_t factor = rows[r][col];
            if (r == col || !factor) continue;
            for (int t = 0; t < m; t++) rows[r][t] ^= gf_mul(factor, rows[col][t]);
            gf_mul_add(sides[r], sides[col], size, factor);
        }
    }
    for (int t = 0; t < m; t++) memcpy(j->payload[missing[t]], sides[t], (size_t)size);
    return 1;
}

/* Take a checked fragment (count > 1; no prefix) of a `total`-element vector into `j` (reset where it belongs to
 * another vector) and decode a data fragment's elements into `out` at its offset: -1 a misfit, 0 kept (or a
 * duplicate), 1 the vector is whole now, 2 whole with fragments rebuilt from its parity (decoded into `out` too). */
static int join(joined *j, const uint8_t *d, int total, float *out) {
    uint32_t session = get32(d + 4), position = get32(d + 8);
    int layer = get16(d + 12), block = d[14], node = d[15], index = get16(d + 16), count = get16(d + 18);
    int codec = d[20], length = (int)get32(d + 26);
    uint32_t offset = get32(d + 22);
    if (j->session != session || j->position != position || j->layer != layer || j->block != block ||
        j->node != node || j->count == 0) {
        j->session = session, j->position = position, j->layer = (uint16_t)layer, j->block = (uint8_t)block;
        j->node = (uint8_t)node, j->count = count, j->per = 0, j->data = j->checks = 0;
    }
    if (count != j->count || count < 2 || count > MAX_FRAGS || index >= count + MAX_PARITY || length < 1 ||
        length > MAX_FRAG_PAYLOAD)
        return -1;
    /* The cut (the elements of every data fragment but the shorter last) as this fragment tells it: the first data
     * fragment and the parity by their length, the others by their offset. Every fragment of a vector that
     * wire.fragment cut tells the same, and gets the same verdict: joined here, or all handed back. */
    int per = index == 0 || index >= count ? (offset == 0 ? fragment_elements(codec, length, total) : -1)
                                           : (offset % (uint32_t)index ? -1 : (int)(offset / (uint32_t)index));
    if (per < 1 || (codec == Q8 && per % Q8_BLOCK) || er_payload_bytes(codec, per) > MAX_FRAG_PAYLOAD ||
        (count - 1) * per >= total || count * per < total || (j->per && j->per != per))
        return -1;
    j->per = per;
    int first = er_payload_bytes(codec, per); /* the first (longest) data fragment's payload, and each parity's */
    if (index < count) {
        int room = total - index * per, n = room < per ? room : per;
        if (er_payload_bytes(codec, n) != length) return -1;
        if (j->data >> index & 1) return 0;
        er_decode(codec, d + HEADER_SIZE, n, out + (size_t)index * per);
        j->data |= 1u << index;
    } else {
        if (length != first) return -1;
        if (j->checks >> (index - count) & 1) return 0;
        j->checks |= 1u << (index - count);
    }
    memcpy(j->payload[index], d + HEADER_SIZE, (size_t)length);
    j->len[index] = length;
    uint32_t all = (1u << count) - 1;
    if (j->data == all) return 1;
    int m = count - bits(j->data);
    if (m > bits(j->checks)) return 0;
    int missing[MAX_PARITY], lengths[MAX_PARITY];
    for (int i = 0, t = 0; i < count; i++) {
        if (j->data >> i & 1) continue;
        int room = total - i * per;
        missing[t] = i;
        lengths[t++] = er_payload_bytes(codec, room < per ? room : per);
    }
    if (!rebuild(j, first, missing, m)) return 0;
    for (int t = 0; t < m; t++) {
        int i = missing[t], room = total - i * per;
        er_decode(codec, j->payload[i], room < per ? room : per, out + (size_t)i * per);
        j->len[i] = lengths[t];
        j->data |= 1u << i;
    }
    return 2;
}

typedef struct er_addr { /* where a datagram goes: IPv4 address and port, both in network order */
    uint32_t ip;
    uint16_t port;
} er_addr;

/* The queued datagrams sent (one that cannot go, to a node gone, is skipped: its loss is seen); the queue emptied. */
static int send_batch(int fd, struct mmsghdr *msgs, int *queued) {
    int sent = 0;
    for (int from = 0; from < *queued;) {
        int done = sendmmsg(fd, msgs + from, (unsigned)(*queued - from), 0);
        if (done <= 0) {
            from++;
            continue;
        }
        sent += done;
        from += done;
    }
    *queued = 0;
    return sent;
}

/* A vector sealed as datagrams and sent to every address. Where it fits one datagram of `mtu` bytes (mtu 0: any
 * length up to IPv4's longest), that datagram and copies - 1 parity fragments, which for a one-fragment vector are
 * copies of it with indices 1, 2, ...; else its data fragments, cut at `mtu` as wire.fragment cuts them, and the
 * parity fragments of net.erasure's code that a link of copies - 1 takes for them (parity_fragments). To address a
 * only the data and the parity a link of per[a] - 1 takes where `per` is given (a link without parity takes the
 * data alone). Where `group` is given, the datagrams go once to
 * that multicast group instead of to each address a with grouped[a]: as many parity fragments as the most any of
 * those takes (a member that takes fewer skips the parity it does not need; on the testbed at 8 devices and 5% loss,
 * each node's own two parity copies were 14 more datagrams a block for the master to send, ~8 µs each through veth
 * and nftables). The group's datagrams of each round go first. Every address's data goes before any parity. Each
 * payload starts with `prefix`. The datagrams sent, or -1 (a vector too long, a failed seal). */
int er_send_group(er_ctx *ctx, int fd, const er_head *h, const uint8_t *prefix, int prefix_len, const float *x,
                  int n, const er_addr *addrs, int naddrs, int copies, const uint8_t *per, const er_addr *group,
                  const uint8_t *grouped, int mtu) {
    int cut = mtu > 0 ? er_elements_per_fragment(h->codec, mtu, prefix_len) : n;
    int count = cut >= n ? 1 : (n + cut - 1) / cut;
    if (count == 1) cut = n;
    int first = prefix_len + er_payload_bytes(h->codec, cut), stride = (HEADER_SIZE + first + TRAILER + 7) & ~7;
    int checks = parity_fragments(copies - 1, count), buffers = count + checks; /* data fragments, then parity */
    if (copies < 1 || copies > MAX_COPIES || HEADER_SIZE + first + TRAILER > MAX_DATAGRAM || count > MAX_FRAGS ||
        (size_t)buffers * (size_t)stride > sizeof ctx->out)
        return -1;
    uint8_t *arena = &ctx->out[0][0];
    int lengths[MAX_FRAGS + MAX_PARITY];
    for (int i = 0; i < count; i++) {
        uint8_t *d = arena + (size_t)i * stride;
        int elements = n - i * cut < cut ? n - i * cut : cut;
        if (prefix_len) memcpy(d + HEADER_SIZE, prefix, (size_t)prefix_len);
        lengths[i] = prefix_len + er_encode(h->codec, x + (size_t)i * cut, elements, d + HEADER_SIZE + prefix_len);
    }
    for (int c = 1; c <= checks; c++) {
        uint8_t *d = arena + (size_t)(count - 1 + c) * stride;
        if (count == 1) {
            memcpy(d + HEADER_SIZE, arena + HEADER_SIZE, (size_t)first);
        } else {
            memset(d + HEADER_SIZE, 0, (size_t)first);
            for (int i = 0; i < count; i++)
                gf_mul_add(d + HEADER_SIZE, arena + (size_t)i * stride + HEADER_SIZE, lengths[i],
                           gf_coefficient(c - 1, i));
        }
        lengths[count - 1 + c] = first;
    }
    struct iovec iov[MAX_FRAGS + MAX_PARITY];
    for (int b = 0; b < buffers; b++) {
        uint8_t *d = arena + (size_t)b * stride;
        int parity = b >= count;
        pack_header(d, h, (uint16_t)b, (uint16_t)count,
                    parity ? 0 : (uint32_t)(b * cut), (uint32_t)lengths[b]);
        if (er_seal(ctx, d, HEADER_SIZE + lengths[b]) < 0) return -1;
        iov[b] = (struct iovec){.iov_base = d, .iov_len = (size_t)(HEADER_SIZE + lengths[b] + TRAILER)};
    }
    /* every address's datagrams in as few system calls as the batch allows */
    enum { BATCH = 64 };
    struct mmsghdr msgs[BATCH];
    struct sockaddr_in to[BATCH];
    int sent = 0, queued = 0, to_group = 0, group_copies = 0;
    if (group != NULL)
        for (int a = 0; a < naddrs; a++)
            if (grouped[a]) {
                int takes = 1 + (per == NULL ? checks : parity_fragments(per[a] - 1, count));
                to_group = 1;
                group_copies = takes > group_copies ? takes : group_copies;
            }
    for (int c = 0; c <= checks; c++) { /* round 0: the data; round c: parity fragment c - 1 */
        int from = c == 0 ? 0 : count - 1 + c, until = c == 0 ? count : count + c;
        for (int a = -(to_group && c < group_copies); a < naddrs; a++) { /* a = -1: the group's datagrams */
            if (!(a < 0 || ((per == NULL || c <= parity_fragments(per[a] - 1, count)) && !(to_group && grouped[a]))))
                continue;
            const er_addr *at = a < 0 ? group : &addrs[a];
            for (int b = from; b < until; b++) {
                to[queued] = (struct sockaddr_in){.sin_family = AF_INET, .sin_port = at->port,
                                                  .sin_addr.s_addr = at->ip};
                msgs[queued] = (struct mmsghdr){.msg_hdr = {.msg_name = &to[queued], .msg_namelen = sizeof to[queued],
                                                            .msg_iov = &iov[b], .msg_iovlen = 1}};
                if (++queued == BATCH) sent += send_batch(fd, msgs, &queued);
            }
        }
    }
    return sent + send_batch(fd, msgs, &queued);
}

int er_send_vector(er_ctx *ctx, int fd, const er_head *h, const uint8_t *prefix, int prefix_len, const float *x,
                   int n, const er_addr *addrs, int naddrs, int copies, int mtu) {
    return er_send_group(ctx, fd, h, prefix, prefix_len, x, n, addrs, naddrs, copies, NULL, NULL, NULL, mtu);
}

/* ---- a block's partials ---------------------------------------------------------------------------------- */
static double monotonic_s(void) { /* perf_counter's clock */
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static double realtime_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_REALTIME, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

typedef struct er_gather {
    /* the block (in) */
    uint32_t session, position;
    uint16_t layer;
    uint8_t block, pad;
    int32_t n;                /* participants */
    const uint8_t *nodes;     /* their node indices */
    const int32_t *sizes;     /* elements of each one's partial */
    float *const *parts;      /* where each one's partial is decoded */
    double *arrived;          /* in/out: perf_counter time its partial came (the kernel's stamp); NAN until then */
    int32_t outstanding;      /* in/out: participants whose partial has not come */
    int32_t from_parity;      /* out: partials that came as a parity copy (their data datagram was lost) */
    double deadline;          /* in/out: perf_counter time to give up (INFINITY: none); moved by the first arrival */
    double lag_bound;         /* how long after the first partial the others may come (< 0: no bound) */
    double spin_s;            /* poll without sleeping this long after the last datagram */
    const int32_t *watch;     /* descriptors whose data ends the wait (TCP streams the event loop reads) */
    int32_t nwatch;
    int32_t skipped;          /* out: parity copies of partials already in, left unread */
    /* a datagram this code does not take, for the caller (out) */
    uint8_t *other;
    int32_t other_cap, other_len;
    double other_at;
    uint32_t other_ip;
    uint16_t other_port;
    /* in: parity copies of other blocks' partials are left unread (the block before is whole: nothing of it is
     * awaited, as needless() judges); 0 hands them back */
    int32_t skip_old_parity;
    /* in: 1 where partials cut into fragments (a lossy link's at a path's MTU) are joined here (the runner's lossy
     * blocks); 0 hands every fragment back */
    int32_t join;
    int32_t fresh; /* in: 1 for a gather's first run (what was joined for an earlier one is forgotten); then 0 */
    joined *joins; /* room for FRAG_SLOTS participants' partials being joined (er_joined_bytes each; NULL: none) */
} er_gather;

/* The bytes of one vector's joining state, for the caller to give each gather and node server room for. */
int er_joined_bytes(void) { return (int)sizeof(joined); }

typedef struct received {
    int len;
    double at;
    struct sockaddr_in from;
} received;

/* One datagram off the socket without blocking: its length, or 0 (none waiting), its kernel stamp in perf_counter
 * time (now if it has none). */
static int receive(int fd, uint8_t *buf, int cap, received *r, double clock_offset) {
    char control[CMSG_SPACE(sizeof(struct timespec))];
    struct iovec iov = {.iov_base = buf, .iov_len = (size_t)cap};
    struct msghdr msg = {.msg_name = &r->from, .msg_namelen = sizeof r->from, .msg_iov = &iov, .msg_iovlen = 1,
                         .msg_control = control, .msg_controllen = sizeof control};
    for (;;) {
        ssize_t got = recvmsg(fd, &msg, MSG_DONTWAIT);
        if (got >= 0) {
            r->len = (int)got;
            r->at = monotonic_s();
            for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c != NULL; c = CMSG_NXTHDR(&msg, c)) {
                if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_TIMESTAMPNS) {
                    struct timespec t;
                    memcpy(&t, CMSG_DATA(c), sizeof t);
                    double stamped = (double)t.tv_sec + (double)t.tv_nsec * 1e-9 + clock_offset;
                    r->at = stamped < r->at ? stamped : r->at;
                }
            }
            return 1;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) return 0;
        /* an ICMP error from an earlier send to a node that left: read on */
        msg.msg_namelen = sizeof r->from;
        msg.msg_controllen = sizeof control;
    }
}

static int find(const er_gather *g, int node) {
    for (int i = 0; i < g->n; i++)
        if (g->nodes[i] == node) return i;
    return -1;
}

/* Take it if it is a partial of the block (whole, or a fragment of one: joined) from a participant still awaited:
 * 1 taken or left as needless, 0 not for this code. */
static int take(er_ctx *ctx, er_gather *g, const uint8_t *d, const received *r, int *first) {
    if (r->len < HEADER_SIZE + TRAILER || d[0] != 'E' || d[1] != 'R' || d[2] != VERSION || d[3] != PARTIAL)
        return 0;
    int index = get16(d + 16), count = get16(d + 18), codec = d[20];
    if (count < 1 || (count == 1 && get32(d + 22) != 0)) return 0;
    if (get32(d + 4) != g->session || get32(d + 8) != g->position || get16(d + 12) != g->layer ||
        d[14] != g->block) {
        if (g->skip_old_parity && index >= count) { /* a parity fragment of an earlier block's partial */
            g->skipped++;
            return 1;
        }
        return 0;
    }
    int i = find(g, d[15]);
    if (i < 0 || codec > Q8) return 0;
    if (!isnan(g->arrived[i])) {
        if ((index >= count || (count > 1 && g->join)) && index < count + MAX_PARITY) {
            /* parity, or a fragment, of a partial in already (joined, or rebuilt): unread, as needless() */
            g->skipped++;
            return 1;
        }
        return 0;
    }
    int length = (int)get32(d + 26), rebuilt;
    if (HEADER_SIZE + length + TRAILER != r->len || index >= count + MAX_PARITY) return 0;
    if (count == 1) {
        if (length != er_payload_bytes(codec, g->sizes[i]) || !er_verify(ctx, d, r->len)) return 0;
        er_decode(codec, d + HEADER_SIZE, g->sizes[i], g->parts[i]);
        rebuilt = index >= 1;
    } else {
        if (!g->join || g->joins == NULL || i >= FRAG_SLOTS || !er_verify(ctx, d, r->len)) return 0;
        int joined_now = join(&g->joins[i], d, g->sizes[i], g->parts[i]);
        if (joined_now <= 0) return joined_now == 0;
        rebuilt = joined_now == 2;
    }
    g->arrived[i] = r->at;
    g->outstanding--;
    g->from_parity += rebuilt;
    if (*first && g->lag_bound >= 0) {
        double bound = monotonic_s() + g->lag_bound;
        g->deadline = bound < g->deadline ? bound : g->deadline;
    }
    *first = 0;
    return 1;
}

/* Whether one of the watched descriptors (TCP streams the event loop reads) has data, without waiting. */
static int watched_has_data(const int32_t *watch, int nwatch) {
    if (nwatch <= 0) return 0;
    struct pollfd fds[64];
    int n = nwatch < 64 ? nwatch : 64;
    for (int i = 0; i < n; i++) fds[i] = (struct pollfd){.fd = watch[i], .events = POLLIN};
    return poll(fds, (nfds_t)n, 0) > 0;
}

/* A datagram for the caller, with when it arrived and where from (the other_* fields of er_gather and er_node);
 * 0 where it is larger than any datagram edgerun sends (dropped). */
static int hand_back(const uint8_t *buf, const received *r, uint8_t *other, int32_t cap, int32_t *len, double *at,
                     uint32_t *ip, uint16_t *port) {
    if (r->len > cap) return 0;
    memcpy(other, buf, (size_t)r->len);
    *len = r->len;
    *at = r->at;
    *ip = r->from.sin_addr.s_addr;
    *port = r->from.sin_port;
    return 1;
}

/* Read the block's partials until every one is in (WHOLE), the deadline passes (TIME), a watched stream has data
 * (STREAM), or a datagram comes that this code does not take (OTHER: in g->other, for the caller). What waits on the
 * socket already is read first, deadline or not. */
int er_gather_run(er_ctx *ctx, int fd, er_gather *g) {
    static uint8_t buf[MAX_DATAGRAM];
    if (g->fresh) { /* a new block (or the same one of a new request): nothing joined yet */
        for (int i = 0; i < FRAG_SLOTS && g->joins != NULL; i++) g->joins[i].count = 0;
        g->fresh = 0;
    }
    double clock_offset = monotonic_s() - realtime_s();
    int first = 1;
    for (int i = 0; i < g->n; i++) first &= isnan(g->arrived[i]);
    double idle_until = monotonic_s() + g->spin_s;
    int spins = 0;
    received r;
    for (;;) {
        if (g->outstanding == 0) return WHOLE;
        if (receive(fd, buf, sizeof buf, &r, clock_offset)) {
            if (!take(ctx, g, buf, &r, &first)) {
                if (hand_back(buf, &r, g->other, g->other_cap, &g->other_len, &g->other_at, &g->other_ip,
                              &g->other_port))
                    return OTHER;
                continue;
            }
            idle_until = monotonic_s() + g->spin_s;
            continue;
        }
        double now = monotonic_s();
        if (now >= g->deadline) return TIME;
        if (now < idle_until) { /* spin: a sleeping thread takes hundreds of microseconds to wake on a VM */
            if (++spins % 32 == 0 && watched_has_data(g->watch, g->nwatch)) return STREAM;
            sched_yield();
            continue;
        }
        struct pollfd fds[65];
        int n = 1;
        fds[0] = (struct pollfd){.fd = fd, .events = POLLIN};
        for (int i = 0; i < g->nwatch && n < 65; i++) fds[n++] = (struct pollfd){.fd = g->watch[i], .events = POLLIN};
        double wait = g->deadline - now;
        int ms = wait > 1.0 ? 1000 : (int)ceil(wait * 1000);
        if (poll(fds, (nfds_t)n, ms) > 0) {
            for (int i = 1; i < n; i++)
                if (fds[i].revents) return STREAM;
        }
    }
}

/* ---- a step's lossy blocks, run one after another ------------------------------------------------------------
 * For a one-token step, the master's layers (the first too where its links are clean): for each block, the hidden
 * state's RMS norm (the block's input), that input to the block's nodes, the master's own share (its ggml graph,
 * computed here), the partials gathered until whole or the deadline, and their sum added to the hidden state. The
 * runner returns to the caller, to resume where it stopped, when a datagram comes that it does not take (OTHER), a
 * watched stream has data (STREAM), a block ended without every partial (INCOMPLETE: the caller notes the loss
 * before going on) or a mirrored block (the first layer's: float32 both ways, never merged without a partial) is
 * missing one at its deadline (MIRROR_WAIT: the caller gets it, asking again, and tells the gather before going on);
 * DONE after the last block. Each block's record (its input, times, arrivals) is left for the caller's accounts. */
typedef int (*graph_compute)(void *backend, void *graph);

typedef struct er_block {
    uint16_t layer;
    uint8_t block, mirrored; /* mirrored: its input and partials go as float32, and it waits for every partial */
    const float *norm;     /* the RMS norm's weight that makes this block's input from the hidden state */
    void *graph;           /* the master's share of the block (NULL: it holds none of it) */
    float *graph_in;       /* the graph's input, in its memory */
    const float *graph_out;
    int32_t *pos;          /* attention: the graph's position, cache row and mask (NULL for an MLP) */
    int64_t *rows;
    uint16_t *mask;        /* float16, n_kv: 0 for the rows up to the position, minus infinity after (NULL where
                            * the graph reads none: kernels.c's attention takes the position alone) */
    int32_t n_kv;
    int32_t first, count;  /* its participants: the runner's slots [first, first + count) */
    double after_send;     /* its deadline, this long after its inputs are sent */
    double lag_bound;      /* how long after the first partial the others may come (< 0: no bound) */
    /* out */
    float *input;          /* its input, kept (the caller's, hidden floats) */
    double *arrived;       /* per participant: when its partial came (perf_counter), NAN: it did not */
    double sent, computed, merged, own_s;
    int32_t outstanding, from_parity, skipped, done;
} er_block;

typedef struct er_runner {
    int32_t hidden, nblocks, next, phase; /* next block to run; phase 1: its partials are being gathered */
    float eps;
    float *x;                              /* the hidden state, (hidden,) */
    er_block *blocks;
    const er_addr *addrs;                  /* per slot: the participant's address, node index and copies sent */
    const uint8_t *node_index;
    const uint8_t *copies;                 /* (1 + its link's parity fragments) */
    uint32_t session, position;
    uint8_t codec, pad[3];
    int32_t send_fd, recv_fd;
    void *backend;
    graph_compute compute;
    float *parts;                          /* room for a block's partials: the most participants x hidden */
    float *sum;                            /* the block's output before it is added (hidden floats) */
    int32_t skip_first;                    /* the first block's skip_old_parity (the caller's block before) */
    er_gather g;                           /* the block being gathered (its other buffer set by the caller) */
    er_addr group;                         /* the multicast group of the inputs (port 0: none) */
    const uint8_t *grouped;                /* per slot: 1 where the participant takes its input from the group */
    /* the LM head's input, sent as the last block is merged so its nodes start at once (head_count 0: not here):
     * the hidden state's RMS norm by head_norm into head_input, float32, to slots [head_first, + head_count) */
    const float *head_norm;
    float *head_input;
    int32_t head_first, head_count;
    double head_sent;                      /* out: when it was sent (perf_counter time) */
    int32_t mtu;                           /* the participants' path (datagram bytes): a lossy link's inputs' cut */
} er_runner;

/* The RMS norm of x times w, into out: the sum of squares in double (one rounding), the scale as a float. */
static void rms_norm(const float *x, const float *w, float *out, int n, float eps) {
    double squares = 0.0;
    for (int i = 0; i < n; i++) squares += (double)x[i] * (double)x[i];
    float scale = (float)(1.0 / sqrt(squares / n + (double)eps));
    for (int i = 0; i < n; i++) out[i] = x[i] * (w[i] * scale);
}

void er_rms_norm(const float *x, const float *w, float *out, int n, float eps) { rms_norm(x, w, out, n, eps); }

/* The hidden state's RMS norm by `norm` into `input`, sent as the step's input of (layer, block) to the participant
 * slots [first, first + count): to the group for those that take it there, each with its copies. When it went. */
static double send_input(er_ctx *ctx, er_runner *r, const float *norm, float *input, int layer, int block, int codec,
                         int first, int count, int mtu) {
    rms_norm(r->x, norm, input, r->hidden, r->eps);
    er_head h = {.session = r->session, .position = r->position, .layer = (uint16_t)layer, .type = ACTIVATION,
                 .block = (uint8_t)block, .node = 0, .codec = (uint8_t)codec, .tokens = 1};
    double sent = monotonic_s();
    if (count) {
        int most = 1;
        for (int i = 0; i < count; i++) most = r->copies[first + i] > most ? r->copies[first + i] : most;
        /* cut at the path's MTU where a link has parity (wire.fragment's cut); a clean link's goes whole */
        er_send_group(ctx, r->send_fd, &h, NULL, 0, input, r->hidden, r->addrs + first, count, most, r->copies + first,
                      r->group.port ? &r->group : NULL, r->grouped + first, most > 1 ? mtu : 0);
    }
    return sent;
}

static int start_block(er_ctx *ctx, er_runner *r, er_block *b) {
    int n = r->hidden;
    b->sent = send_input(ctx, r, b->norm, b->input, b->layer, b->block, b->mirrored ? F32 : r->codec, b->first,
                         b->count, r->mtu);
    double began = monotonic_s();
    if (b->graph != NULL) {
        memcpy(b->graph_in, b->input, (size_t)n * 4);
        if (b->pos != NULL) {
            *b->pos = (int32_t)r->position;
            *b->rows = (int64_t)r->position;
            for (int k = 0; b->mask != NULL && k < b->n_kv; k++) b->mask[k] = k <= (int)r->position ? 0 : 0xfc00;
        }
        if (r->compute(r->backend, b->graph) != 0) return -1;
    }
    b->computed = monotonic_s();
    b->own_s = b->computed - began;
    /* the gather of its partials */
    static float *slots[256];
    er_gather *g = &r->g;
    g->session = r->session;
    g->position = r->position;
    g->layer = b->layer;
    g->block = b->block;
    g->n = b->count;
    g->nodes = r->node_index + b->first;
    g->arrived = b->arrived;
    for (int i = 0; i < b->count; i++) {
        slots[i] = r->parts + (size_t)i * n;
        b->arrived[i] = NAN;
    }
    g->parts = slots;
    g->outstanding = b->count;
    g->from_parity = g->skipped = 0;
    g->deadline = b->sent + b->after_send;
    g->lag_bound = b->lag_bound;
    g->skip_old_parity = r->next == 0 ? r->skip_first : r->blocks[r->next - 1].outstanding == 0;
    g->join = 1;
    g->fresh = 1;
    return 0;
}

static void finish_block(er_runner *r, er_block *b) {
    int n = r->hidden;
    float *sum = r->sum;
    if (b->graph != NULL)
        memcpy(sum, b->graph_out, (size_t)n * 4);
    else
        memset(sum, 0, (size_t)n * 4);
    for (int i = 0; i < b->count; i++) { /* in the participants' order, the same every run */
        if (isnan(b->arrived[i])) continue;
        const float *part = r->parts + (size_t)i * n;
        for (int k = 0; k < n; k++) sum[k] += part[k];
    }
    for (int k = 0; k < n; k++) r->x[k] += sum[k];
    b->merged = monotonic_s();
    b->outstanding = r->g.outstanding;
    b->from_parity = r->g.from_parity;
    b->skipped = r->g.skipped;
    b->done = 1;
}

int er_run_blocks(er_ctx *ctx, er_runner *r) {
    static int32_t sizes[256];
    er_gather *g = &r->g;
    for (int i = 0; i < 256; i++) sizes[i] = r->hidden;
    g->sizes = sizes;
    while (r->next < r->nblocks) {
        er_block *b = &r->blocks[r->next];
        if (r->phase == 0) {
            if (start_block(ctx, r, b) < 0) return -1;
            r->phase = 1;
        }
        int end = g->outstanding ? er_gather_run(ctx, r->recv_fd, g) : WHOLE;
        if (end == OTHER || end == STREAM) return end;
        if (end == TIME && b->mirrored) return MIRROR_WAIT;
        finish_block(r, b);
        r->phase = 0;
        r->next++;
        if (r->next == r->nblocks && r->head_count > 0)
            r->head_sent = send_input(ctx, r, r->head_norm, r->head_input, 0, HEAD, F32, r->head_first, r->head_count,
                                      r->mtu);
        if (end == TIME) return INCOMPLETE;
    }
    return DONE;
}

/* ---- a node's one-token blocks, computed as their inputs come -------------------------------------------------
 * A node's lossy blocks (the layers after the first, by datagram) without Python: the input's datagram checked and
 * decoded into the block's graph, the graph computed (attention: at the next position of its layer's cache), the
 * partial sealed and sent to the master. It comes back to the caller for anything else (OTHER: the datagram, which
 * the Python path handles), when a watched stream has data (STREAM), when nothing came for spin_s (IDLE) and at
 * least every max_s (TIME), so the event loop runs its timers. */
typedef struct er_share_block {
    void *graph;            /* NULL: the Python path computes it (no unit of it here, or its graph is not ready) */
    float *graph_in;
    const float *graph_out;
    int32_t *pos;           /* attention: position, cache row and mask (n_kv float16) */
    int64_t *rows;
    uint16_t *mask;         /* NULL where the graph reads none */
    int32_t n_kv;
    double bytes;           /* its weight bytes, for the kernels' fit */
} er_share_block;

typedef struct er_node {
    uint32_t session;
    uint8_t index, codec, copies, pad;  /* this node's index, its partials' codec, 1 + its link's parity */
    int32_t hidden, n_layers;
    er_share_block *blocks;             /* per layer: attention, then MLP */
    const uint8_t *datagram;            /* per layer: 1 where its blocks travel by datagram */
    int32_t *lengths;                   /* in/out: each layer's cached positions */
    const int32_t *attn_layers;         /* the layers holding attention units */
    int32_t n_attn;
    int32_t *mlp_taken;                 /* per layer: the position of the last MLP input computed (-1: none) */
    int32_t latest[3];                  /* in/out: (position, layer, block) of the newest input seen */
    er_addr master;
    int32_t send_fd, recv_fd, group_fd; /* group_fd: the socket of the master's multicast group (-1: none) */
    void *backend;
    graph_compute compute;
    double spin_s, max_s;
    const int32_t *watch;
    int32_t nwatch;
    /* out: what it computed */
    int32_t computed;
    int32_t skipped;
    double seconds, bytes, bytes_sq, cross; /* the kernels' sums (KernelFit) */
    /* a datagram handed back */
    uint8_t *other;
    int32_t other_cap, other_len;
    double other_at;
    uint32_t other_ip;
    uint16_t other_port;
    /* a trace (NULL: none): per served block 7 doubles, position, layer, block and the perf_counter moments its
     * input reached the socket, was taken, computed and its partial sent (tp.trace's node events) */
    double *trace;
    int32_t trace_cap, trace_len;
    /* per layer: 1 where its one-token blocks are mirrored (the first layer: reliable, datagram first). Such a
     * block's partial goes as float32; then the server returns MIRRORED with the block in `served` (position,
     * layer, block) for the caller to keep its partial (Resend) and send its stream copy where the link wants one */
    const uint8_t *mirrored;
    int32_t served[3];
    int32_t mtu; /* its path to the master (datagram bytes): where its link has parity, its vectors are cut there
                  * (-1: they are longer than this code cuts, and such a link's blocks go to the caller) */
    struct joined *input; /* room for an input being joined from its fragments (er_joined_bytes; NULL: none) */
} er_node;

static int order_after(const int32_t *a, int p, int l, int b) { /* (p, l, b) > a, lexicographically */
    if (p != a[0]) return p > a[0];
    if (l != a[1]) return l > a[1];
    return b > a[2];
}

/* Whether the master has gone past an attention input this node still needs (it is fetched by the Python path). */
static int behind(const er_node *s, int p, int l, int b) {
    for (int i = 0; i < s->n_attn; i++) {
        int layer = s->attn_layers[i], q = s->lengths[layer];
        if (q > p || (q == p && (layer > l || (layer == l && b == 0)))) continue;
        return 1;
    }
    return 0;
}

/* The block's input is in its graph: computed (attention: at position p of its layer's cache) and its partial sent
 * to the master. 1, or 2 for a mirrored block (for the caller to keep), 0 where the graph failed. */
static int answer(er_ctx *ctx, er_node *s, er_share_block *blk, int p, int l, int b, double at, double began) {
    if (b == 0) {
        *blk->pos = p;
        *blk->rows = p;
        for (int k = 0; blk->mask != NULL && k < blk->n_kv; k++) blk->mask[k] = k <= p ? 0 : 0xfc00;
    }
    if (s->compute(s->backend, blk->graph) != 0) return 0;
    double took = monotonic_s() - began;
    if (order_after(s->latest, p, l, b)) {
        s->latest[0] = p;
        s->latest[1] = l;
        s->latest[2] = b;
    }
    if (b == 0)
        s->lengths[l] = p + 1;
    else
        s->mlp_taken[l] = p;
    int mirrored = s->mirrored[l];
    er_head h = {.session = s->session, .position = (uint32_t)p, .layer = (uint16_t)l, .type = PARTIAL,
                 .block = (uint8_t)b, .node = s->index, .codec = mirrored ? F32 : s->codec, .tokens = 1};
    /* a lossy link's partials are cut at its path (a clean one's go whole) */
    er_send_vector(ctx, s->send_fd, &h, NULL, 0, blk->graph_out, s->hidden, &s->master, 1, s->copies,
                   s->copies <= 1 ? 0 : s->mtu);
    if (s->trace != NULL && s->trace_len < s->trace_cap) {
        double *t = s->trace + 7 * s->trace_len++;
        t[0] = p, t[1] = l, t[2] = b, t[3] = at, t[4] = began, t[5] = began + took, t[6] = monotonic_s();
    }
    s->computed++;
    s->seconds += took;
    s->bytes += blk->bytes;
    s->bytes_sq += blk->bytes * blk->bytes;
    s->cross += blk->bytes * took;
    if (mirrored) {
        s->served[0] = p, s->served[1] = l, s->served[2] = b;
        return 2;
    }
    return 1;
}

/* 1: taken (computed and answered, a fragment kept for its input, or a parity copy of what was), 2: a mirrored block
 * computed and answered (for the caller to keep), 0: for the caller. An input of several fragments (a lossy link's
 * at a path's MTU) is joined, its missing fragments rebuilt from its parity; one that stays incomplete is lost as a
 * lost datagram is (a newer input's fragment starts over). */
static int serve_one(er_ctx *ctx, er_node *s, const uint8_t *d, int len, double at) {
    if (len < HEADER_SIZE + TRAILER || d[0] != 'E' || d[1] != 'R' || d[2] != VERSION || d[3] != ACTIVATION ||
        get32(d + 4) != s->session || d[21] != 1)
        return 0;
    int p = (int)get32(d + 8), l = get16(d + 12), b = d[14], index = get16(d + 16), codec = d[20];
    int count = get16(d + 18);
    if (count < 1 || (count == 1 && get32(d + 22) != 0) || l >= s->n_layers || b > 1 || codec > Q8 ||
        index >= count + MAX_PARITY || !(s->datagram[l] || s->mirrored[l]))
        return 0;
    er_share_block *blk = &s->blocks[2 * l + b];
    if (b == 0 ? p < s->lengths[l] : p == s->mlp_taken[l]) { /* a copy of what is computed (parity, a resend) */
        s->skipped++;
        return 1;
    }
    if (blk->graph == NULL || (b == 0 && (p != s->lengths[l] || p + 1 > blk->n_kv)) || (b == 1 && p < s->latest[0]) ||
        (s->copies > 1 && s->mtu < 0)) /* a lossy link whose partials this code cannot cut: the Python path's */
        return 0;
    int length = (int)get32(d + 26);
    if ((count == 1 && length != er_payload_bytes(codec, s->hidden)) || HEADER_SIZE + length + TRAILER != len)
        return 0;
    if (order_after(s->latest, p, l, b) && behind(s, p, l, b)) return 0; /* the Python path fetches what is missing */
    if (!er_verify(ctx, d, len)) return 0;
    double began = monotonic_s();
    if (count == 1) {
        er_decode(codec, d + HEADER_SIZE, s->hidden, blk->graph_in);
    } else {
        if (s->input == NULL) return 0;
        int joined_now = join(s->input, d, s->hidden, blk->graph_in);
        if (joined_now <= 0) return joined_now == 0;
        s->input->count = 0; /* answered: a later input of the same block (a new request's) starts over */
        began = monotonic_s();
    }
    return answer(ctx, s, blk, p, l, b, at, began);
}

int er_node_serve(er_ctx *ctx, er_node *s) {
    static uint8_t buf[MAX_DATAGRAM];
    double clock_offset = monotonic_s() - realtime_s(), started = monotonic_s();
    double idle_until = started + s->spin_s;
    int spins = 0;
    received r;
    for (;;) {
        if (receive(s->recv_fd, buf, sizeof buf, &r, clock_offset) ||
            (s->group_fd >= 0 && receive(s->group_fd, buf, sizeof buf, &r, clock_offset))) {
            int served = serve_one(ctx, s, buf, r.len, r.at);
            if (!served) {
                if (hand_back(buf, &r, s->other, s->other_cap, &s->other_len, &s->other_at, &s->other_ip,
                              &s->other_port))
                    return OTHER;
                continue;
            }
            if (served == 2) return MIRRORED;
            idle_until = monotonic_s() + s->spin_s;
            continue;
        }
        double now = monotonic_s();
        if (now >= idle_until) return IDLE;
        if (now - started >= s->max_s) return TIME;
        if (++spins % 32 == 0 && watched_has_data(s->watch, s->nwatch)) return STREAM;
        sched_yield();
    }
}
