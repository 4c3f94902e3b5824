/* Matrix products of quantized weights with one or several columns of activations, for ggml graphs (a custom op),
 * giving ggml's own products bit for bit. Weights: Q4_1 (the shipped model's layers), Q8_0 (its LM head, and many
 * models' tied embeddings), Q6_K (a Q4_K_M file's LM head and some of its attn_v and ffn_down) and Q4_0 as ggml
 * repacks it (the commonest 4-bit files' matrices: q4_0x8_rows below).
 *
 * ggml multiplies Q4_1 with B columns by calling its one-row dot product B times per row, unpacking every weight
 * block again for each column (llamafile's tinyBLAS and the repacked layouts take Q4_0, Q8_0, Q4_K and IQ4_NL,
 * not Q4_1), so a batch of 8 sequences costs almost 8 single steps; its Q8_0 products (tinyBLAS) do little better.
 * Here each weight block is loaded once and multiplied with every column, two columns to a 512-bit register.
 *
 * Bit for bit: every output is the float arithmetic of ggml's ggml_vec_dot_q4_1_q8_1 / ggml_vec_dot_q8_0_q8_0
 * (AVX2 builds) over the activations quantized by ggml's own quantizer (its function, passed in): per block, an
 * exact integer dot product of 4-byte groups in 8 lanes, d = d(w) * d(x), lane = fma(d, dot, lane); for Q4_1
 * beside it min = fma(m(w), s(x), min); at the end the 8 lanes added as ggml's hsum_float_8 adds them (plus min).
 * The integer sums are exact and every float operation happens on the same values in the same order; only the
 * order of independent columns changes. The engine checks this against ggml's products when it loads
 * (edgerun.model.kernels) and uses ggml's wherever they differ.
 *
 * No Python API: a plain library loaded with ctypes, built by the install (setup.py). */

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__x86_64__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_KERNEL 1
#else
#define HAVE_KERNEL 0
#endif

#define QK 32
#define QK_K 256
#define MAX_COLS 16 /* columns in one pass over the weights: 8 pairs, each pair one 512-bit register */
#define PREFETCH_ROWS 4
#define Q6_K_COLS 7 /* Q6_K columns in one pass (kernels.py gives the op no more: ggml computes 8 another way) */

enum { W_Q4_1 = 0, W_Q8_0 = 1, W_Q6_K = 2, W_Q4_0X8 = 3 };
#define Q4_0X8_COLS 16 /* Q4_0 columns in one pass over a group of 8 rows (8 pairs, 8 accumulators) */

typedef struct {
    uint16_t d, m;
    uint8_t qs[QK / 2];
} block_q4_1;

typedef struct {
    uint16_t d;
    int8_t qs[QK];
} block_q8_0;

/* ggml's repacked Q4_0 (CPU_REPACK buffers, its q4_0_8x8 layout on x86): the b-th blocks of 8 rows together, their
 * d's, then their 16 bytes of codes 8 at a time (row 0's first 8 bytes, row 1's, ..., row 7's, then each row's last
 * 8), every code XOR 8 (a signed 4-bit value: code - 8). */
typedef struct {
    uint16_t d[8];
    uint8_t qs[128];
} block_q4_0x8;

typedef struct {
    uint16_t d, s;
    int8_t qs[QK];
} block_q8_1;

typedef struct {
    uint8_t ql[QK_K / 2]; /* the low 4 bits of each 6-bit code */
    uint8_t qh[QK_K / 4]; /* the high 2 bits */
    int8_t scales[QK_K / 16];
    uint16_t d;
} block_q6_K;

typedef struct {
    float d;
    int8_t qs[QK_K];
    int16_t bsums[QK_K / 16];
} block_q8_K;

/* The leading fields of ggml's struct ggml_tensor (ggml.h, llama.cpp 11434), up to its data pointer; the engine
 * checks the data pointer's offset against ggml_get_data before it uses this op. */
struct ggml_tensor_head {
    int32_t type;
    void *buffer;
    int64_t ne[4];
    size_t nb[4];
    int32_t op;
    int32_t op_params[16];
    int32_t flags;
    void *src[10];
    void *view_src;
    size_t view_offs;
    void *data;
};

typedef void (*from_float_t)(const float *x, void *y, int64_t k);

/* What the op is given: the weights' type (W_Q4_1, W_Q8_0, W_Q6_K, W_Q4_0X8) and ggml's quantizer of the activations
 * for it (ggml_get_type_traits_cpu(Q8_1, Q8_0 or Q8_K)->from_float). */
struct er_product_params {
    int32_t weights;
    from_float_t quantize;
};

size_t er_tensor_data_offset(void) { return offsetof(struct ggml_tensor_head, data); }

static int avx2_only; /* er_force_avx2 */

/* The AVX2 kernels on a CPU that has AVX-512 as well (on), or each CPU's own again (off): for tests, which check
 * the AVX2 kernels against ggml's products on any x86-64 machine. */
void er_force_avx2(int on) { avx2_only = on; }

static int amx_off; /* er_force_no_amx */

/* Repacked Q4_0 products without the AMX tiles on a CPU that has them (on), or with them again (off): for tests,
 * which check both ways against ggml's products. */
void er_force_no_amx(int on) { amx_off = on; }

#if HAVE_KERNEL
static int has_avx512(void) {
    if (avx2_only)
        return 0;
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl") &&
           __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

static int has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

/* AMX's int8 tiles: the CPU has them (CPUID leaf 7: AMX-TILE, AMX-INT8) and Linux lets this process use their
 * state (asked once: the permission is the process's, for every thread). */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18
static int amx_permitted = -1;

static int has_amx(void) {
    if (amx_off || !has_avx512())
        return 0;
    if (amx_permitted < 0) {
        unsigned a, b, c, d;
        __asm__("cpuid" : "=a"(a), "=b"(b), "=c"(c), "=d"(d) : "a"(7), "c"(0));
        int asked = 0;
#if defined(__linux__)
        if ((d >> 24 & 1) && (d >> 25 & 1))
            asked = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
#endif
        __atomic_store_n(&amx_permitted, asked, __ATOMIC_RELEASE);
    }
    return __atomic_load_n(&amx_permitted, __ATOMIC_ACQUIRE);
}

/* For tests: whether repacked Q4_0 products take the AMX tiles here. */
int er_amx_available(void) { return has_amx(); }
#endif

/* The weight types whose products run on this CPU, bit 1 << W_*: with AVX-512 VNNI all four, with AVX2 (and FMA,
 * F16C) Q4_1, Q8_0 and repacked Q4_0, else none. */
int er_product_types(void) {
#if HAVE_KERNEL
    if (has_avx512())
        return 1 << W_Q4_1 | 1 << W_Q8_0 | 1 << W_Q6_K | 1 << W_Q4_0X8;
    if (has_avx2())
        return 1 << W_Q4_1 | 1 << W_Q8_0 | 1 << W_Q4_0X8;
#endif
    return 0;
}

/* Whether the attention op runs on this CPU (AVX-512 or AVX2, each in the order of adds of ggml's build for it). */
int er_attention_available(void) {
#if HAVE_KERNEL
    return has_avx512() || has_avx2();
#else
    return 0;
#endif
}

#if HAVE_KERNEL
#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")))
/* what both kernels use, and the AVX2 kernel alone: compiled without AVX-512 (no EVEX encodings), so that an AVX2
 * machine runs it */
#define TARGET_AVX2 __attribute__((target("avx2,fma,f16c")))

/* A thread's work space: the columns quantized and laid out for the kernel, grown as needed. */
static __thread void *scratch;
static __thread size_t scratch_size;

static void *work_space(size_t size) {
    if (size > scratch_size) {
        free(scratch);
        scratch = aligned_alloc(64, (size + 63) / 64 * 64);
        scratch_size = scratch ? size : 0;
    }
    return scratch;
}

TARGET_AVX2 static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* Row r + PREFETCH_ROWS (below r1) on its way from memory while row r is computed. */
static inline void prefetch_ahead(const void *w, int r, int r1, size_t row_bytes) {
    if (r + PREFETCH_ROWS < r1) {
        const char *ahead = (const char *)w + (size_t)(r + PREFETCH_ROWS) * row_bytes;
        for (size_t at = 0; at < row_bytes; at += 64)
            _mm_prefetch(ahead + at, _MM_HINT_T0);
    }
}

/* ggml's hsum_float_8: the high half added to the low, then lanes 2,3 to 0,1, then lane 1 to 0. */
TARGET_AVX2 static inline float hsum8(__m256 x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* The columns laid out for the kernel, per block ib and pair p of columns (2p, 2p+1):
 *   pairs[ib][p]   the two columns' 32 quantized values side by side;
 *   scales[ib][p]  their d's, 8 lanes each;
 *   inits[ib][p]   what the integer dot starts from: for Q8_0 -128 times each 4-value group's sum (the weights go
 *                  in as unsigned bytes, w + 128: sum (w + 128) y - 128 sum y = sum w y, exactly), for Q4_1 0
 *                  (read from memory rather than a register copied each time: a load, not an ALU operation);
 *   sums[ib]       Q4_1: every column's s, 16 lanes. */
typedef struct {
    __m512i *pairs;
    __m512 *scales;
    __m512i *inits;
    __m512 *sums;
} layout;

/* Rows [r0, r1) of W (n_blocks blocks each) times `cols` columns (at most MAX_COLS) laid out in `in`:
 * out[c * out_stride + r]. WEIGHTS and N_PAIRS are constants where this is inlined (rows_times), so the
 * accumulators stay in registers and the other type's code goes. */
TARGET static inline __attribute__((always_inline)) void rows_times_pairs(
    const int WEIGHTS, const int N_PAIRS, const void *w, int n_blocks, int r0, int r1, int cols, layout in,
    float *out, size_t out_stride) {
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x80);
    /* Q4_1: the 16 packed bytes in all four 128-bit lanes; lanes 0 and 2 keep their low nibbles, 1 and 3 their
     * high ones: [block | block], the block's 32 values in order (ggml's bytes_from_nibbles_32) for both columns */
    const __m512i shifts = _mm512_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0,
                                            4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    const size_t row_bytes = (size_t)n_blocks * (WEIGHTS == W_Q4_1 ? sizeof(block_q4_1) : sizeof(block_q8_0));
    for (int r = r0; r < r1; r++) {
        prefetch_ahead(w, r, r1, row_bytes);
        __m512 acc[MAX_COLS / 2];
#pragma GCC unroll 8
        for (int p = 0; p < N_PAIRS; p++)
            acc[p] = _mm512_setzero_ps();
        __m512 mins = _mm512_setzero_ps();
        for (int ib = 0; ib < n_blocks; ib++) {
            __m512 d0;
            __m512i qq;
            if (WEIGHTS == W_Q4_1) {
                const block_q4_1 *b = (const block_q4_1 *)w + (size_t)r * n_blocks + ib;
                d0 = _mm512_cvtph_ps(_mm256_set1_epi16((short)b->d));
                mins = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_set1_epi16((short)b->m)), in.sums[ib], mins);
                const __m512i packed = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)b->qs));
                qq = _mm512_and_si512(_mm512_srlv_epi16(packed, shifts), low);
            } else {
                const block_q8_0 *b = (const block_q8_0 *)w + (size_t)r * n_blocks + ib;
                d0 = _mm512_cvtph_ps(_mm256_set1_epi16((short)b->d));
                qq = _mm512_xor_si512(_mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)b->qs)), flip);
            }
            const __m512i *y = in.pairs + (size_t)ib * N_PAIRS;
            const __m512 *dy = in.scales + (size_t)ib * N_PAIRS;
            const __m512i *init = in.inits + (size_t)ib * N_PAIRS;
#pragma GCC unroll 8
            for (int p = 0; p < N_PAIRS; p++) {
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(init[p], qq, y[p]));
                acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(d0, dy[p]), dot, acc[p]);
            }
        }
        float min_lanes[16];
        _mm512_storeu_ps(min_lanes, mins);
        for (int c = 0; c < cols; c++) {
            const __m512 a = acc[c / 2];
            const __m256 half = (c & 1) ? _mm512_extractf32x8_ps(a, 1) : _mm512_castps512_ps256(a);
            out[(size_t)c * out_stride + r] = WEIGHTS == W_Q4_1 ? hsum8(half) + min_lanes[c] : hsum8(half);
        }
    }
}

#define ROWS_TIMES(type, n) \
    case n: rows_times_pairs(type, n, w, n_blocks, r0, r1, cols, in, out, out_stride); break;

TARGET static void rows_times_cols(int weights, const void *w, int n_blocks, int r0, int r1, int cols, layout in,
                                   float *out, size_t out_stride) {
    if (weights == W_Q4_1) {
        switch ((cols + 1) / 2) {
            ROWS_TIMES(W_Q4_1, 1) ROWS_TIMES(W_Q4_1, 2) ROWS_TIMES(W_Q4_1, 3) ROWS_TIMES(W_Q4_1, 4)
            ROWS_TIMES(W_Q4_1, 5) ROWS_TIMES(W_Q4_1, 6) ROWS_TIMES(W_Q4_1, 7) ROWS_TIMES(W_Q4_1, 8)
        }
    } else {
        switch ((cols + 1) / 2) {
            ROWS_TIMES(W_Q8_0, 1) ROWS_TIMES(W_Q8_0, 2) ROWS_TIMES(W_Q8_0, 3) ROWS_TIMES(W_Q8_0, 4)
            ROWS_TIMES(W_Q8_0, 5) ROWS_TIMES(W_Q8_0, 6) ROWS_TIMES(W_Q8_0, 7) ROWS_TIMES(W_Q8_0, 8)
        }
    }
}

/* Several columns take fewer operations with the columns across a register's lanes: set_layout holds 8 columns a
 * set, lane 2c + jj of a set's register g holding column c's group 2g + jj of a block (4 values: group j is the 4-byte
 * piece whose integer dot product is ggml's lane j). One broadcast of 8 weight bytes then serves both groups of a
 * register for all 8 columns, and the block's scale d = d(w) * d(x) is one multiply a set (the column pairs of
 * rows_times_pairs need one a pair: 4 integer products, 4 conversions, 4 multiplies and 4 fmas a block for 8 columns
 * there, 4, 4, 1 and 4 here). The same float operations on the same values as ggml's, per column and lane:
 *   Q4_1's groups 4-7 are its bytes' high nibbles, masked in place: 16 times the values, so each such lane sums 16
 *   times ggml's lane, rounded alike (a power of two scales a float sum's every rounding exactly: d is a product of
 *   two float16 values, no lane comes near a float's range's ends), and is divided by 16 at the row's end;
 *   Q8_0's weights go in as unsigned bytes (w + 128), each lane starting from -128 times its activations' sum. */
typedef struct {
    __m512i *acts;  /* [ib][set][g] the activations' bytes */
    __m512i *inits; /* [ib][set][g] Q8_0: -128 times each lane's 4 activations' sum */
    __m512 *scales; /* [ib][set] each column's d, in both its lanes */
    __m256 *sums;   /* [ib][set] Q4_1: each column's s */
} set_layout;

#define SET_COLS 8
#define MAX_SETS (MAX_COLS / SET_COLS)
#ifndef SET_FROM
#define SET_FROM 7 /* columns from which rows_times_sets takes less time than rows_times_pairs (measured: 6 take as long) */
#endif

TARGET static inline __attribute__((always_inline)) void rows_times_sets(
    const int WEIGHTS, const int N_SETS, const void *w, int n_blocks, int r0, int r1, int cols, set_layout in,
    float *out, size_t out_stride) {
    const __m512i low = _mm512_set1_epi8(0x0F), high = _mm512_set1_epi8((char)0xF0),
                  flip = _mm512_set1_epi8((char)0x80);
    const __m512 sixteenth = _mm512_set1_ps(0.0625f);
    /* lanes 0, 2, ..., 14 (column c's sum is left in lane 2c) to lanes 0-7 */
    const __m512i evens = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 14, 12, 10, 8, 6, 4, 2, 0);
    const size_t row_bytes = (size_t)n_blocks * (WEIGHTS == W_Q4_1 ? sizeof(block_q4_1) : sizeof(block_q8_0));
    for (int r = r0; r < r1; r++) {
        prefetch_ahead(w, r, r1, row_bytes);
        __m512 acc[MAX_SETS][4];
        __m256 mins[MAX_SETS];
#pragma GCC unroll 2
        for (int s = 0; s < N_SETS; s++) {
            mins[s] = _mm256_setzero_ps();
#pragma GCC unroll 4
            for (int g = 0; g < 4; g++)
                acc[s][g] = _mm512_setzero_ps();
        }
        for (int ib = 0; ib < n_blocks; ib++) {
            __m512 dw;
            __m256 mw = _mm256_setzero_ps();
            __m512i q[4];
            if (WEIGHTS == W_Q4_1) {
                const block_q4_1 *b = (const block_q4_1 *)w + (size_t)r * n_blocks + ib;
                dw = _mm512_cvtph_ps(_mm256_set1_epi16((short)b->d));
                mw = _mm256_cvtph_ps(_mm_set1_epi16((short)b->m));
                int64_t lo, hi;
                memcpy(&lo, b->qs, 8);
                memcpy(&hi, b->qs + 8, 8);
                const __m512i first = _mm512_set1_epi64(lo), second = _mm512_set1_epi64(hi);
                /* groups 0,1 and 2,3: low nibbles; 4,5 and 6,7: high nibbles, in place */
                q[0] = _mm512_and_si512(first, low);
                q[1] = _mm512_and_si512(second, low);
                q[2] = _mm512_and_si512(first, high);
                q[3] = _mm512_and_si512(second, high);
            } else {
                const block_q8_0 *b = (const block_q8_0 *)w + (size_t)r * n_blocks + ib;
                dw = _mm512_cvtph_ps(_mm256_set1_epi16((short)b->d));
#pragma GCC unroll 4
                for (int g = 0; g < 4; g++) {
                    int64_t v;
                    memcpy(&v, b->qs + 8 * g, 8);
                    q[g] = _mm512_xor_si512(_mm512_set1_epi64(v), flip);
                }
            }
#pragma GCC unroll 2
            for (int s = 0; s < N_SETS; s++) {
                const size_t at = (size_t)ib * N_SETS + s;
                const __m512 d = _mm512_mul_ps(dw, in.scales[at]);
                if (WEIGHTS == W_Q4_1)
                    mins[s] = _mm256_fmadd_ps(mw, in.sums[at], mins[s]);
                const __m512i *x = in.acts + at * 4;
#pragma GCC unroll 4
                for (int g = 0; g < 4; g++) {
                    const __m512i start = WEIGHTS == W_Q4_1 ? _mm512_setzero_si512() : in.inits[at * 4 + g];
                    const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(start, q[g], x[g]));
                    acc[s][g] = _mm512_fmadd_ps(d, dot, acc[s][g]);
                }
            }
        }
#pragma GCC unroll 2
        for (int s = 0; s < N_SETS; s++) {
            if (WEIGHTS == W_Q4_1) { /* the high nibbles' lanes summed 16 times their values */
                acc[s][2] = _mm512_mul_ps(acc[s][2], sixteenth);
                acc[s][3] = _mm512_mul_ps(acc[s][3], sixteenth);
            }
            /* hsum8 of lanes l0..l7 (l_j in register j / 2, lane 2c + j % 2): l_i + l_(i+4), then (0 + 2, 1 + 3),
             * then their sum, for 8 columns at once */
            const __m512 halves0 = _mm512_add_ps(acc[s][2], acc[s][0]), halves1 = _mm512_add_ps(acc[s][3], acc[s][1]);
            const __m512 quarters = _mm512_add_ps(halves0, halves1);
            const __m512 sum = _mm512_add_ps(quarters, _mm512_shuffle_ps(quarters, quarters, _MM_SHUFFLE(2, 3, 0, 1)));
            __m256 sums = _mm512_castps512_ps256(_mm512_permutexvar_ps(evens, sum));
            if (WEIGHTS == W_Q4_1)
                sums = _mm256_add_ps(sums, mins[s]);
            float lanes[SET_COLS];
            _mm256_storeu_ps(lanes, sums);
            for (int c = 0; c < SET_COLS && s * SET_COLS + c < cols; c++)
                out[(size_t)(s * SET_COLS + c) * out_stride + r] = lanes[c];
        }
    }
}

#define SETS_TIMES(type, n) \
    case n: rows_times_sets(type, n, w, n_blocks, r0, r1, cols, in, out, out_stride); break;

TARGET static void rows_times_set_cols(int weights, const void *w, int n_blocks, int r0, int r1, int cols,
                                       set_layout in, float *out, size_t out_stride) {
    if (weights == W_Q4_1) {
        switch ((cols + SET_COLS - 1) / SET_COLS) { SETS_TIMES(W_Q4_1, 1) SETS_TIMES(W_Q4_1, 2) }
    } else {
        switch ((cols + SET_COLS - 1) / SET_COLS) { SETS_TIMES(W_Q8_0, 1) SETS_TIMES(W_Q8_0, 2) }
    }
}

/* A column's block as the activations' type holds it: its d, its s (Q8_1 only) and its 32 values. */
static inline void column_block(int weights, const char *q, size_t row_size, int c, int ib, uint16_t *d,
                                uint16_t *s, const int8_t **qs) {
    if (weights == W_Q4_1) {
        const block_q8_1 *b = (const block_q8_1 *)(q + (size_t)c * row_size) + ib;
        *d = b->d, *s = b->s, *qs = b->qs;
    } else {
        const block_q8_0 *b = (const block_q8_0 *)(q + (size_t)c * row_size) + ib;
        *d = b->d, *s = 0, *qs = b->qs;
    }
}

/* Columns [c0, c0 + cols) of x (k floats each, x_stride floats apart) quantized by ggml's quantizer into q
 * (row_size bytes a column) and laid out for rows_times_cols. */
TARGET static void lay_out(int weights, const float *x, size_t x_stride, int c0, int cols, int k,
                           from_float_t quantize, char *q, size_t row_size, layout out) {
    const int n_blocks = k / QK, n_pairs = (cols + 1) / 2;
    for (int c = 0; c < cols; c++)
        quantize(x + (size_t)(c0 + c) * x_stride, q + (size_t)c * row_size, k);
    for (int ib = 0; ib < n_blocks; ib++) {
        float s[16] = {0};
        for (int p = 0; p < n_pairs; p++) {
            __m256i values[2] = {_mm256_setzero_si256(), _mm256_setzero_si256()};
            float d[2] = {0.0f, 0.0f};
            int32_t init[16] = {0};
            for (int half = 0; half < 2 && 2 * p + half < cols; half++) {
                uint16_t dh, sh;
                const int8_t *qs;
                column_block(weights, q, row_size, 2 * p + half, ib, &dh, &sh, &qs);
                values[half] = _mm256_loadu_si256((const __m256i *)qs);
                d[half] = half_to_float(dh);
                s[2 * p + half] = half_to_float(sh);
                for (int j = 0; j < QK && weights == W_Q8_0; j++)
                    init[8 * half + j / 4] -= 128 * qs[j];
            }
            const size_t at = (size_t)ib * n_pairs + p;
            out.pairs[at] = _mm512_inserti64x4(_mm512_castsi256_si512(values[0]), values[1], 1);
            out.scales[at] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(d[0])),
                                                _mm256_set1_ps(d[1]), 1);
            out.inits[at] = _mm512_loadu_si512(init);
        }
        out.sums[ib] = _mm512_loadu_ps(s);
    }
}

/* Columns [c0, c0 + cols) of x quantized by ggml's quantizer into q (row_size bytes a column) and laid out for
 * rows_times_set_cols: column c of a set in lanes 2c and 2c + 1; a set's columns past `cols` are zeros. */
TARGET static void lay_out_sets(int weights, const float *x, size_t x_stride, int c0, int cols, int k,
                                from_float_t quantize, char *q, size_t row_size, set_layout out) {
    const int n_blocks = k / QK, n_sets = (cols + SET_COLS - 1) / SET_COLS;
    for (int c = 0; c < cols; c++)
        quantize(x + (size_t)(c0 + c) * x_stride, q + (size_t)c * row_size, k);
    for (int ib = 0; ib < n_blocks; ib++) {
        for (int s = 0; s < n_sets; s++) {
            int64_t acts[4][SET_COLS] = {{0}};
            int32_t init[4][16] = {{0}};
            float d[16] = {0}, sums[SET_COLS] = {0};
            for (int c = 0; c < SET_COLS && s * SET_COLS + c < cols; c++) {
                uint16_t dh, sh;
                const int8_t *qs;
                column_block(weights, q, row_size, s * SET_COLS + c, ib, &dh, &sh, &qs);
                d[2 * c] = d[2 * c + 1] = half_to_float(dh);
                sums[c] = half_to_float(sh);
                for (int g = 0; g < 4; g++) {
                    memcpy(&acts[g][c], qs + 8 * g, 8);
                    for (int j = 0; j < 8 && weights == W_Q8_0; j++)
                        init[g][2 * c + j / 4] -= 128 * qs[8 * g + j];
                }
            }
            const size_t at = (size_t)ib * n_sets + s;
            for (int g = 0; g < 4; g++) {
                out.acts[at * 4 + g] = _mm512_loadu_si512(acts[g]);
                out.inits[at * 4 + g] = _mm512_loadu_si512(init[g]);
            }
            out.scales[at] = _mm512_loadu_ps(d);
            out.sums[at] = _mm256_loadu_ps(sums);
        }
    }
}

/* Rows [r0, r1) of Q6_K weights (n_super blocks of 256 each) times `cols` columns quantized to Q8_K (row_size bytes
 * apart in q): out[c * out_stride + r]. ggml's ggml_vec_dot_q6_K_q8_K (AVX2) sums, per block of 256, 8 integer
 * lanes: lane l takes values 4l..4l+3 of each of the block's eight 32-value chunks, each product times its 16
 * values' scale, less 32 times the scaled sums of values 32l..32l+31 (the codes' offset, from the column's bsums);
 * then lane = fma(d(w) * d(x), lane, lane's float). Here two chunks go in one 512-bit register, so one pair of
 * multiply-adds (bytes to 16-bit pairs, pairs times their scale to 32 bits) gives 16 lanes (chunk 2m's in 0-7, 2m+1's
 * in 8-15), each its 4 products times their scale (integer products: exact), and lane l
 * of the block is lanes l and l + 8 added: the same integers, then the same float operations in the same order.
 * The codes are unpacked once per block for every column. */
TARGET static inline __attribute__((always_inline)) void q6_k_rows_times(
    const int COLS, const void *w, int n_super, int r0, int r1, const char *q, size_t row_size, float *out,
    size_t out_stride) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    /* per 32-byte half of a register: chunks 0 and 1 take bits 0-1 and 2-3 of the high bits, shifted to 4-5;
     * chunks 2 and 3 bits 4-5 and 6-7 */
    const __m512i high01 = _mm512_inserti64x4(_mm512_set1_epi8(3), _mm256_set1_epi8(12), 1);
    const __m512i high23 = _mm512_inserti64x4(_mm512_set1_epi8(48), _mm256_set1_epi8((char)192), 1);
    const __m512i left01 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(2), 1);
    const __m512i right23 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    __m512i spread[4]; /* 16-bit lane i of register m takes scale 4m + i/8 */
    for (int m = 0; m < 4; m++)
        spread[m] = _mm512_add_epi16(_mm512_set1_epi16((short)(4 * m)), _mm512_srli_epi16(_mm512_set_epi16(
            31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
            15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), 3));
    const size_t row_bytes = (size_t)n_super * sizeof(block_q6_K);
    for (int r = r0; r < r1; r++) {
        prefetch_ahead(w, r, r1, row_bytes);
        __m256 acc[MAX_COLS];
#pragma GCC unroll 8
        for (int c = 0; c < COLS; c++)
            acc[c] = _mm256_setzero_ps();
        for (int i = 0; i < n_super; i++) {
            const block_q6_K *b = (const block_q6_K *)w + (size_t)r * n_super + i;
            __m512i codes[4]; /* chunks (0,1), (2,3) of the first 128 values, then of the second */
            for (int j = 0; j < 2; j++) {
                const __m512i lo = _mm512_loadu_si512(b->ql + 64 * j);
                const __m512i hi = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(b->qh + 32 * j)));
                codes[2 * j] = _mm512_or_si512(_mm512_and_si512(lo, low),
                                               _mm512_sllv_epi16(_mm512_and_si512(hi, high01), left01));
                codes[2 * j + 1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), low),
                                                   _mm512_srlv_epi16(_mm512_and_si512(hi, high23), right23));
            }
            const __m256i scales16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)b->scales));
            __m512i scale[4];
            for (int m = 0; m < 4; m++)
                scale[m] = _mm512_permutexvar_epi16(spread[m], _mm512_castsi256_si512(scales16));
            const float dw = half_to_float(b->d);
#pragma GCC unroll 8
            for (int c = 0; c < COLS; c++) {
                const block_q8_K *y = (const block_q8_K *)(q + (size_t)c * row_size) + i;
                __m512i sum = _mm512_setzero_si512();
                for (int m = 0; m < 4; m++) {
                    /* pairs of products (at most 2 * 63 * 128: no saturation), then pairs of pairs, each times
                     * its 16 values' scale: per 32-bit lane, its 4 products times their scale */
                    const __m512i pairs = _mm512_maddubs_epi16(codes[m], _mm512_loadu_si512(y->qs + 64 * m));
                    sum = _mm512_add_epi32(sum, _mm512_madd_epi16(pairs, scale[m]));
                }
                const __m256i offset = _mm256_slli_epi32(
                    _mm256_madd_epi16(_mm256_loadu_si256((const __m256i *)y->bsums), scales16), 5);
                const __m256i lanes = _mm256_sub_epi32(
                    _mm256_add_epi32(_mm512_castsi512_si256(sum), _mm512_extracti64x4_epi64(sum, 1)), offset);
                const float d = y->d * dw;
                acc[c] = _mm256_fmadd_ps(_mm256_set1_ps(d), _mm256_cvtepi32_ps(lanes), acc[c]);
            }
        }
        for (int c = 0; c < COLS; c++)
            out[(size_t)c * out_stride + r] = hsum8(acc[c]);
    }
}

#define Q6_K_TIMES(n) case n: q6_k_rows_times(n, w, n_super, r0, r1, q, row_size, out, out_stride); break;

/* Up to Q6_K_COLS columns at a time. */
TARGET static void q6_k_rows(const void *w, int n_super, int r0, int r1, int cols, const char *q, size_t row_size,
                             float *out, size_t out_stride) {
    switch (cols) {
        Q6_K_TIMES(1) Q6_K_TIMES(2) Q6_K_TIMES(3) Q6_K_TIMES(4) Q6_K_TIMES(5) Q6_K_TIMES(6) Q6_K_TIMES(7)
        default: abort();
    }
}

/* AVX2 machines (no AVX-512 VNNI): the same products in 256-bit registers, one column to a register, at most
 * AVX2_COLS columns a pass (16 registers: the columns' accumulators, the block's weights and its scale). The
 * integer dot is ggml's AVX2 one: bytes times bytes to 16-bit pairs (Q4_1's weights 0..15 times a column's
 * -127..127; Q8_0's as ggml's mul_sum_i8_pairs_float takes them, |w| times y with w's sign), pairs to 32 bits:
 * exact. The float arithmetic is that of the AVX-512 kernel above, and so ggml's. The columns are read where ggml's
 * quantizer put them; their d's (and Q4_1's s's) are converted once, ds[ib][c] and ss[ib][c]. */
#define AVX2_COLS 8

TARGET_AVX2 static inline __attribute__((always_inline)) void rows_times_avx2(
    const int WEIGHTS, const int COLS, const void *w, int n_blocks, int r0, int r1, const char *q, size_t row_size,
    const float *ds, const float *ss, float *out, size_t out_stride) {
    const __m256i low = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const size_t y_offset = WEIGHTS == W_Q4_1 ? offsetof(block_q8_1, qs) : offsetof(block_q8_0, qs);
    const size_t y_size = WEIGHTS == W_Q4_1 ? sizeof(block_q8_1) : sizeof(block_q8_0);
    for (int r = r0; r < r1; r++) {
        __m256 acc[AVX2_COLS];
#pragma GCC unroll 8
        for (int c = 0; c < COLS; c++)
            acc[c] = _mm256_setzero_ps();
        __m256 mins = _mm256_setzero_ps();
        for (int ib = 0; ib < n_blocks; ib++) {
            __m256 d0;
            __m256i qq, sign = _mm256_setzero_si256();
            if (WEIGHTS == W_Q4_1) {
                const block_q4_1 *b = (const block_q4_1 *)w + (size_t)r * n_blocks + ib;
                d0 = _mm256_set1_ps(half_to_float(b->d));
                mins = _mm256_fmadd_ps(_mm256_set1_ps(half_to_float(b->m)), _mm256_loadu_ps(ss + (size_t)ib * AVX2_COLS),
                                       mins);
                const __m128i packed = _mm_loadu_si128((const __m128i *)b->qs); /* ggml's bytes_from_nibbles_32 */
                qq = _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(packed, 4), packed), low);
            } else {
                const block_q8_0 *b = (const block_q8_0 *)w + (size_t)r * n_blocks + ib;
                d0 = _mm256_set1_ps(half_to_float(b->d));
                sign = _mm256_loadu_si256((const __m256i *)b->qs);
                qq = _mm256_sign_epi8(sign, sign);
            }
            const char *y = q + (size_t)ib * y_size + y_offset;
            const float *dy = ds + (size_t)ib * AVX2_COLS;
#pragma GCC unroll 8
            for (int c = 0; c < COLS; c++) {
                __m256i yc = _mm256_loadu_si256((const __m256i *)(y + (size_t)c * row_size));
                if (WEIGHTS == W_Q8_0)
                    yc = _mm256_sign_epi8(yc, sign);
                const __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(qq, yc), ones));
                acc[c] = _mm256_fmadd_ps(_mm256_mul_ps(d0, _mm256_broadcast_ss(dy + c)), dot, acc[c]);
            }
        }
        float min_lanes[AVX2_COLS];
        _mm256_storeu_ps(min_lanes, mins);
        /* unrolled, so the accumulators stay in registers (a loop here makes GCC store them at every block) */
#pragma GCC unroll 8
        for (int c = 0; c < COLS; c++)
            out[(size_t)c * out_stride + r] = WEIGHTS == W_Q4_1 ? hsum8(acc[c]) + min_lanes[c] : hsum8(acc[c]);
    }
}

#define AVX2_TIMES(type, n) \
    case n: rows_times_avx2(type, n, w, n_blocks, r0, r1, q, row_size, ds, ss, out, out_stride); break;

TARGET_AVX2 static void rows_avx2(int weights, const void *w, int n_blocks, int r0, int r1, int cols, const char *q,
                                  size_t row_size, const float *ds, const float *ss, float *out, size_t out_stride) {
    if (weights == W_Q4_1) {
        switch (cols) {
            AVX2_TIMES(W_Q4_1, 1) AVX2_TIMES(W_Q4_1, 2) AVX2_TIMES(W_Q4_1, 3) AVX2_TIMES(W_Q4_1, 4)
            AVX2_TIMES(W_Q4_1, 5) AVX2_TIMES(W_Q4_1, 6) AVX2_TIMES(W_Q4_1, 7) AVX2_TIMES(W_Q4_1, 8)
        }
    } else {
        switch (cols) {
            AVX2_TIMES(W_Q8_0, 1) AVX2_TIMES(W_Q8_0, 2) AVX2_TIMES(W_Q8_0, 3) AVX2_TIMES(W_Q8_0, 4)
            AVX2_TIMES(W_Q8_0, 5) AVX2_TIMES(W_Q8_0, 6) AVX2_TIMES(W_Q8_0, 7) AVX2_TIMES(W_Q8_0, 8)
        }
    }
}

/* The AVX2 op's share: rows [r0, r1) times every column, AVX2_COLS at a time. */
TARGET_AVX2 static void product_avx2(const struct er_product_params *params, const struct ggml_tensor_head *w,
                                     const struct ggml_tensor_head *x, int r0, int r1, float *out, size_t out_stride) {
    const int k = (int)w->ne[0], n_cols = (int)x->ne[1], n_blocks = k / QK;
    const size_t row_size = (size_t)n_blocks * (params->weights == W_Q4_1 ? sizeof(block_q8_1) : sizeof(block_q8_0));
    const size_t scales = (size_t)n_blocks * AVX2_COLS * sizeof(float);
    char *ws = work_space(2 * scales + (size_t)AVX2_COLS * row_size);
    if (!ws)
        abort();
    float *ds = (float *)ws, *ss = (float *)(ws + scales);
    char *q = ws + 2 * scales;
    for (int c0 = 0; c0 < n_cols; c0 += AVX2_COLS) {
        const int cols = n_cols - c0 < AVX2_COLS ? n_cols - c0 : AVX2_COLS;
        for (int c = 0; c < cols; c++) {
            params->quantize((const float *)x->data + (size_t)(c0 + c) * (x->nb[1] / sizeof(float)),
                             q + (size_t)c * row_size, k);
            for (int ib = 0; ib < n_blocks; ib++) {
                uint16_t d, s;
                const int8_t *qs;
                column_block(params->weights, q, row_size, c, ib, &d, &s, &qs);
                ds[(size_t)ib * AVX2_COLS + c] = half_to_float(d);
                ss[(size_t)ib * AVX2_COLS + c] = half_to_float(s);
            }
        }
        rows_avx2(params->weights, w->data, n_blocks, r0, r1, cols, q, row_size, ds, ss, out + c0 * out_stride,
                  out_stride);
    }
}

/* Repacked Q4_0 rows (block_q4_0x8) times up to Q4_0X8_COLS columns quantized to Q8_0, in one pass over each group
 * of 8 rows. ggml's own kernels for this layout (ggml_gemv_ and ggml_gemm_q4_0_8x8_q8_0) take 4 columns (16 where
 * there are 16) a pass, so 8 sequences read every weight twice and unpack it twice.
 *
 * Bit for bit: ggml computes each output as acc = fma(float(dot_b), d(w)_b * d(x)_b, acc) over the blocks b in
 * order, dot_b the exact integer dot product of the block's 32 codes and the column's 32 values; so does this.
 * Here a 512-bit register holds the 8 rows' bytes of a quarter of the block, 4 to a 32-bit lane (lane l: row l / 2,
 * the block's values (l % 2) * 4.. of that quarter); each lane's 4 products (codes as unsigned 0..15, from a start
 * of -8 times the 4 values: sum (c + 8) x - 8 sum x = sum c x) are added by VNNI's dpbusd, four quarters into one
 * register, then lanes 2j and 2j + 1 give row j. Two columns' rows fill the 16 lanes of an accumulator. */
typedef struct {
    const int8_t *qs;   /* per block and column: the column's 32 values (its Q8_0 block) */
    const int64_t *init; /* per block and column: -8 times the sums of the values lanes 0 and 1 meet, as one lane pair */
    const __m512 *scale; /* per block and pair of columns: their d's, 8 lanes each */
    size_t stride;       /* bytes from one block's columns to the next's in `qs` */
} q4_0x8_columns;

TARGET static inline __attribute__((always_inline)) void q4_0x8_pairs(
    const int N_PAIRS, const block_q4_0x8 *w, int n_blocks, int g0, int g1, int cols, q4_0x8_columns in, float *out,
    size_t out_stride) {
    const __m512i low = _mm512_set1_epi8(0x0F), flip = _mm512_set1_epi8((char)0x88);
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    for (int g = g0; g < g1; g++) {
        __m512 acc[Q4_0X8_COLS / 2];
#pragma GCC unroll 8
        for (int p = 0; p < N_PAIRS; p++)
            acc[p] = _mm512_setzero_ps();
        for (int ib = 0; ib < n_blocks; ib++) {
            const block_q4_0x8 *b = w + (size_t)g * n_blocks + ib;
            /* the codes as unsigned nibbles: bytes 0-7 of each row (values 0-7 low, 16-23 high), then 8-15 */
            const __m512i first = _mm512_xor_si512(_mm512_loadu_si512((const void *)b->qs), flip);
            const __m512i second = _mm512_xor_si512(_mm512_loadu_si512((const void *)(b->qs + 64)), flip);
            const __m512i q0 = _mm512_and_si512(first, low), q16 = _mm512_and_si512(_mm512_srli_epi16(first, 4), low);
            const __m512i q8 = _mm512_and_si512(second, low), q24 = _mm512_and_si512(_mm512_srli_epi16(second, 4), low);
            const __m512 dw = _mm512_cvtph_ps(_mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)b->d)));
            const int8_t *x = in.qs + (size_t)ib * in.stride;
            const int64_t *init = in.init + (size_t)ib * Q4_0X8_COLS;
            const __m512 *scale = in.scale + (size_t)ib * (Q4_0X8_COLS / 2);
#pragma GCC unroll 8
            for (int p = 0; p < N_PAIRS; p++) {
                __m512i dot[2];
                for (int h = 0; h < 2; h++) {
                    const int8_t *y = x + (size_t)(2 * p + h) * QK;
                    __m512i d = _mm512_set1_epi64(init[2 * p + h]);
                    d = _mm512_dpbusd_epi32(d, q0, _mm512_set1_epi64(*(const int64_t *)y));
                    d = _mm512_dpbusd_epi32(d, q8, _mm512_set1_epi64(*(const int64_t *)(y + 8)));
                    d = _mm512_dpbusd_epi32(d, q16, _mm512_set1_epi64(*(const int64_t *)(y + 16)));
                    dot[h] = _mm512_dpbusd_epi32(d, q24, _mm512_set1_epi64(*(const int64_t *)(y + 24)));
                }
                const __m512i rows = _mm512_add_epi32(_mm512_permutex2var_epi32(dot[0], even, dot[1]),
                                                      _mm512_permutex2var_epi32(dot[0], odd, dot[1]));
                acc[p] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(rows), _mm512_mul_ps(dw, scale[p]), acc[p]);
            }
        }
        for (int c = 0; c < cols; c++) {
            const __m512 a = acc[c / 2];
            _mm256_storeu_ps(out + (size_t)c * out_stride + (size_t)g * 8,
                             (c & 1) ? _mm512_extractf32x8_ps(a, 1) : _mm512_castps512_ps256(a));
        }
    }
}

#define Q4_0X8_TIMES(n) case n: q4_0x8_pairs(n, w, n_blocks, g0, g1, cols, in, out, out_stride); break;

TARGET static void q4_0x8_rows(const block_q4_0x8 *w, int n_blocks, int g0, int g1, int cols, q4_0x8_columns in,
                               float *out, size_t out_stride) {
    switch ((cols + 1) / 2) {
        Q4_0X8_TIMES(1) Q4_0X8_TIMES(2) Q4_0X8_TIMES(3) Q4_0X8_TIMES(4)
        Q4_0X8_TIMES(5) Q4_0X8_TIMES(6) Q4_0X8_TIMES(7) Q4_0X8_TIMES(8)
    }
}

/* Columns [c0, c0 + cols) of x quantized by ggml's Q8_0 quantizer into q (row_size bytes a column), and laid out
 * for q4_0x8_rows: the values block by block, each pair's d's and each lane pair's start. */
TARGET static void q4_0x8_lay_out(const float *x, size_t x_stride, int c0, int cols, int k, from_float_t quantize,
                                  char *q, size_t row_size, int8_t *qs, int64_t *init, __m512 *scale) {
    const int n_blocks = k / QK;
    for (int c = 0; c < cols; c++)
        quantize(x + (size_t)(c0 + c) * x_stride, q + (size_t)c * row_size, k);
    for (int ib = 0; ib < n_blocks; ib++) {
        float d[Q4_0X8_COLS] = {0};
        for (int c = 0; c < Q4_0X8_COLS; c++) {
            int8_t *to = qs + ((size_t)ib * Q4_0X8_COLS + c) * QK;
            int32_t sums[2] = {0, 0};
            if (c < cols) {
                const block_q8_0 *blk = (const block_q8_0 *)(q + (size_t)c * row_size) + ib;
                memcpy(to, blk->qs, QK);
                d[c] = half_to_float(blk->d);
                for (int j = 0; j < QK; j++) /* value j meets lane (j % 8) / 4 of its quarter */
                    sums[(j % 8) / 4] += blk->qs[j];
            } else {
                memset(to, 0, QK);
            }
            init[(size_t)ib * Q4_0X8_COLS + c] =
                (int64_t)((uint64_t)(uint32_t)(-8 * sums[1]) << 32 | (uint32_t)(-8 * sums[0]));
        }
        for (int p = 0; p < Q4_0X8_COLS / 2; p++)
            scale[(size_t)ib * (Q4_0X8_COLS / 2) + p] =
                _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_set1_ps(d[2 * p])), _mm256_set1_ps(d[2 * p + 1]), 1);
    }
}

/* Repacked Q4_0 times many columns on AMX's int8 tiles: a prompt's chunk, a large batch. The exact integer dot
 * products of a block (32 codes, 32 values) for 16 columns and 16 rows are one tile multiply (TDPBSSD); the floats
 * are ggml's: per output, acc = fma(float(dot_b), d(w)_b * d(x)_b, acc) over the blocks in order (as q4_0x8_pairs).
 * The tile product C (16 columns x 16 rows) = A (16 columns' 32 values, read where ggml's quantizer left them) times
 * B (the 16 rows' codes - 8, 4 to a 32-bit lane: row m's values 4i..4i+3 in lane m of B's row i), so a column's 16
 * outputs lie in one 512-bit row of C and go on with one conversion, one multiply and one fma. A pair of groups of 8
 * rows makes B's 16 lanes (a lone last group: the other 8 lanes zero). */
#define AMX_COLS 16
#define AMX_PASS_COLS 64 /* columns quantized in one pass (their tiles take turns over each pair of groups) */
#ifndef AMX_FROM
#define AMX_FROM 16
#endif
#define TARGET_AMX __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c,amx-tile,amx-int8")))

typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

/* The codes of a pair of groups' blocks (the second NULL: zeros) as B: 8 rows of 64 bytes, lane m of row i holding
 * row m's values 4i..4i+3, minus 8 (signed); and the 16 rows' d's. */
TARGET_AMX static inline void amx_weights(const block_q4_0x8 *first, const block_q4_0x8 *second, int8_t *b,
                                          float *dw) {
    /* codes XOR 8 read as 4-bit signed values are codes - 8: a nibble's table */
    const __m512i signed_nibble = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 2, 3, 4, 5, 6, 7, -8, -7, -6, -5, -4,
                                                                       -3, -2, -1));
    const __m512i low = _mm512_set1_epi8(0x0F);
    /* dwords 0, 2, 4, ... (values 0-3 of each row's 8 bytes) of the two groups, then 1, 3, 5, ... (values 4-7) */
    const __m512i even = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    const __m512i odd = _mm512_set_epi32(31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
    __m512i parts[2][4]; /* per group: values 0-7, 8-15, 16-23, 24-31 of each row (8 bytes a row) */
    for (int h = 0; h < 2; h++) {
        const block_q4_0x8 *blk = h ? second : first;
        if (blk == NULL) {
            for (int i = 0; i < 4; i++)
                parts[h][i] = _mm512_setzero_si512();
            continue;
        }
        const __m512i bytes0 = _mm512_loadu_si512((const void *)blk->qs), bytes1 = _mm512_loadu_si512(
            (const void *)(blk->qs + 64));
        parts[h][0] = _mm512_shuffle_epi8(signed_nibble, _mm512_and_si512(bytes0, low));
        parts[h][1] = _mm512_shuffle_epi8(signed_nibble, _mm512_and_si512(bytes1, low));
        parts[h][2] = _mm512_shuffle_epi8(signed_nibble, _mm512_and_si512(_mm512_srli_epi16(bytes0, 4), low));
        parts[h][3] = _mm512_shuffle_epi8(signed_nibble, _mm512_and_si512(_mm512_srli_epi16(bytes1, 4), low));
    }
    for (int i = 0; i < 4; i++) {
        _mm512_storeu_si512((void *)(b + 128 * i), _mm512_permutex2var_epi32(parts[0][i], even, parts[1][i]));
        _mm512_storeu_si512((void *)(b + 128 * i + 64), _mm512_permutex2var_epi32(parts[0][i], odd, parts[1][i]));
    }
    const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)first->d));
    const __m256 d1 = second ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)second->d)) : _mm256_setzero_ps();
    _mm512_storeu_ps(dw, _mm512_insertf32x8(_mm512_castps256_ps512(d0), d1, 1));
}

/* Row groups [g0, g1) times `cols` columns quantized to Q8_0: their values block by block (per block
 * AMX_PASS_COLS columns' 32 values, one after another: a tile of A is 512 contiguous bytes; zeros past `cols`) and
 * their d's (per block, AMX_PASS_COLS floats). `b` and `dw`: room for every block's B (512 bytes) and 16 d's. */
TARGET_AMX static void q4_0x8_amx(const block_q4_0x8 *w, int n_blocks, int g0, int g1, int cols, const int8_t *values,
                                  const float *dx, int8_t *b, float *dw, float *out, size_t out_stride) {
    /* Blocks take turns between two sets of tiles (C, A, B: tiles 0-2 and 3-5), so that one block's product runs
     * in the tile unit while the other's sums go on into the 16 accumulators (a column's 16 rows each). */
    tile_config config;
    memset(&config, 0, sizeof config);
    config.palette = 1;
    for (int h = 0; h < 2; h++) {
        config.rows[3 * h] = AMX_COLS, config.colsb[3 * h] = 64;     /* C: a column's 16 rows' sums a row */
        config.rows[3 * h + 1] = AMX_COLS, config.colsb[3 * h + 1] = QK; /* A: a column's block a row */
        config.rows[3 * h + 2] = QK / 4, config.colsb[3 * h + 2] = 64;   /* B */
    }
    _tile_loadconfig(&config);
    int32_t sums[2][AMX_COLS][16] __attribute__((aligned(64)));
    for (int g = g0; g < g1; g += 2) {
        const int pair = g + 1 < g1;
        for (int ib = 0; ib < n_blocks; ib++)
            amx_weights(w + (size_t)g * n_blocks + ib, pair ? w + (size_t)(g + 1) * n_blocks + ib : NULL,
                        b + (size_t)ib * 512, dw + (size_t)ib * 16);
        for (int c0 = 0; c0 < cols; c0 += AMX_COLS) {
            __m512 acc[AMX_COLS];
#pragma GCC unroll 16
            for (int c = 0; c < AMX_COLS; c++)
                acc[c] = _mm512_setzero_ps();
            /* Block ib + 1's tile product goes in before block ib's sums come out of their tiles, so that the tile
             * unit multiplies the one while the vector units add the other into the accumulators (issued one
             * after the other, each waited on the other: 8192 x 2048 rows times 256 columns took 21.3-32.8 ms
             * against 19.4-27.9 this way, one thread of a Sapphire Rapids class Xeon). */
#define AMX_BLOCK(C, A, B, ib)                                                                                     \
    do {                                                                                                           \
        _tile_zero(C);                                                                                             \
        _tile_loadd(A, values + ((size_t)(ib) * AMX_PASS_COLS + c0) * QK, QK);                                     \
        _tile_loadd(B, b + (size_t)(ib) * 512, 64);                                                                \
        _tile_dpbssd(C, A, B);                                                                                     \
    } while (0)
#define AMX_ADD(h, ib)                                                                                             \
    do {                                                                                                           \
        const __m512 d_rows = _mm512_loadu_ps(dw + (size_t)(ib) * 16);                                             \
        const float *d_cols = dx + (size_t)(ib) * AMX_PASS_COLS + c0;                                              \
        _Pragma("GCC unroll 16") for (int c = 0; c < AMX_COLS; c++) {                                              \
            const __m512 dot = _mm512_cvtepi32_ps(_mm512_load_si512((const void *)sums[h][c]));                    \
            acc[c] = _mm512_fmadd_ps(dot, _mm512_mul_ps(d_rows, _mm512_set1_ps(d_cols[c])), acc[c]);               \
        }                                                                                                          \
    } while (0)
            AMX_BLOCK(0, 1, 2, 0);
            for (int ib = 0; ib < n_blocks; ib += 2) {
                if (ib + 1 < n_blocks)
                    AMX_BLOCK(3, 4, 5, ib + 1);
                _tile_stored(0, sums[0], 64);
                AMX_ADD(0, ib);
                if (ib + 1 < n_blocks) {
                    if (ib + 2 < n_blocks)
                        AMX_BLOCK(0, 1, 2, ib + 2);
                    _tile_stored(3, sums[1], 64);
                    AMX_ADD(1, ib + 1);
                }
            }
#undef AMX_BLOCK
#undef AMX_ADD
            for (int c = 0; c < AMX_COLS && c0 + c < cols; c++) {
                float *to = out + (size_t)(c0 + c) * out_stride + (size_t)g * 8;
                if (pair)
                    _mm512_storeu_ps(to, acc[c]);
                else
                    _mm256_storeu_ps(to, _mm512_castps512_ps256(acc[c]));
            }
        }
    }
    _tile_release();
}

/* The repacked Q4_0 op's share on AMX: row groups [g0, g1) times every column, AMX_PASS_COLS at a time. */
TARGET_AMX static void product_q4_0x8_amx(const struct er_product_params *params, const struct ggml_tensor_head *w,
                                          const struct ggml_tensor_head *x, int g0, int g1, float *out,
                                          size_t out_stride) {
    const int k = (int)w->ne[0], n_cols = (int)x->ne[1], n_blocks = k / QK;
    const size_t row_size = (size_t)n_blocks * sizeof(block_q8_0);
    const size_t b_size = (size_t)n_blocks * 512, dw_size = (size_t)n_blocks * 16 * sizeof(float);
    const size_t dx_size = (size_t)n_blocks * AMX_PASS_COLS * sizeof(float);
    const size_t values_size = (size_t)n_blocks * AMX_PASS_COLS * QK;
    char *ws = work_space(b_size + dw_size + dx_size + values_size + (size_t)AMX_PASS_COLS * row_size);
    if (!ws)
        abort();
    int8_t *b = (int8_t *)ws, *values = (int8_t *)(ws + b_size + dw_size + dx_size);
    float *dw = (float *)(ws + b_size), *dx = (float *)(ws + b_size + dw_size);
    char *q = ws + b_size + dw_size + dx_size + values_size;
    for (int c0 = 0; c0 < n_cols; c0 += AMX_PASS_COLS) {
        const int cols = n_cols - c0 < AMX_PASS_COLS ? n_cols - c0 : AMX_PASS_COLS;
        for (int c = 0; c < cols; c++)
            params->quantize((const float *)x->data + (size_t)(c0 + c) * (x->nb[1] / sizeof(float)),
                             q + (size_t)c * row_size, k);
        for (int ib = 0; ib < n_blocks; ib++)
            for (int c = 0; c < AMX_PASS_COLS; c++) {
                const block_q8_0 *blk = (const block_q8_0 *)(q + (size_t)c * row_size) + ib;
                int8_t *to = values + ((size_t)ib * AMX_PASS_COLS + c) * QK;
                if (c < cols)
                    memcpy(to, blk->qs, QK);
                else
                    memset(to, 0, QK);
                dx[(size_t)ib * AMX_PASS_COLS + c] = c < cols ? half_to_float(blk->d) : 0.0f;
            }
        q4_0x8_amx((const block_q4_0x8 *)w->data, n_blocks, g0, g1, cols, values, dx, b, dw,
                   out + (size_t)c0 * out_stride, out_stride);
    }
}

/* The repacked Q4_0 op's share: row groups [g0, g1) times every column, Q4_0X8_COLS at a time. */
TARGET static void product_q4_0x8(const struct er_product_params *params, const struct ggml_tensor_head *w,
                                  const struct ggml_tensor_head *x, int ith, int nth, float *out, size_t out_stride) {
    const int k = (int)w->ne[0], n_groups = (int)(w->ne[1] / 8), n_cols = (int)x->ne[1], n_blocks = k / QK;
    const int g0 = (int)((int64_t)n_groups * ith / nth), g1 = (int)((int64_t)n_groups * (ith + 1) / nth);
    if (g0 >= g1)
        return;
    if (n_cols >= AMX_FROM && has_amx()) {
        product_q4_0x8_amx(params, w, x, g0, g1, out, out_stride);
        return;
    }
    const size_t row_size = (size_t)n_blocks * sizeof(block_q8_0);
    const size_t qs_size = (size_t)n_blocks * Q4_0X8_COLS * QK, init_size = (size_t)n_blocks * Q4_0X8_COLS * 8;
    const size_t scale_size = (size_t)n_blocks * (Q4_0X8_COLS / 2) * sizeof(__m512);
    char *ws = work_space(scale_size + qs_size + init_size + (size_t)Q4_0X8_COLS * row_size);
    if (!ws)
        abort();
    q4_0x8_columns in = {(const int8_t *)(ws + scale_size), (const int64_t *)(ws + scale_size + qs_size),
                         (const __m512 *)ws, (size_t)Q4_0X8_COLS * QK};
    for (int c0 = 0; c0 < n_cols; c0 += Q4_0X8_COLS) {
        const int cols = n_cols - c0 < Q4_0X8_COLS ? n_cols - c0 : Q4_0X8_COLS;
        q4_0x8_lay_out((const float *)x->data, x->nb[1] / sizeof(float), c0, cols, k, params->quantize,
                       ws + scale_size + qs_size + init_size, row_size, (int8_t *)in.qs, (int64_t *)in.init,
                       (__m512 *)in.scale);
        q4_0x8_rows((const block_q4_0x8 *)w->data, n_blocks, g0, g1, cols, in, out + c0 * out_stride, out_stride);
    }
}

/* Repacked Q4_0 on AVX2 (no VNNI): q4_0x8_rows's pass in 256-bit registers, a column at a time against the 8 rows'
 * unpacked block. A register holds 4 rows' bytes of a quarter of the block (lane l: row l / 2, values (l % 2) * 4..
 * of the quarter); bytes times bytes to 16-bit pairs (codes 0..15 times values -127..127), four quarters' pairs added
 * (8 products each, under 2^15), pairs to 32 bits, lane pairs to rows; -8 times the column's block sum makes the
 * codes signed. Exact integers, then ggml's fma per block and output, as above. */
#define Q4_0X8_AVX2_COLS 8

TARGET_AVX2 static inline __attribute__((always_inline)) void q4_0x8_avx2_times(
    const int COLS, const block_q4_0x8 *w, int n_blocks, int g0, int g1, const char *q, size_t row_size,
    const float *ds, const int32_t *inits, float *out, size_t out_stride) {
    const __m256i low = _mm256_set1_epi8(0x0F), flip = _mm256_set1_epi8((char)0x88), ones = _mm256_set1_epi16(1);
    const __m256i order = _mm256_setr_epi32(0, 1, 4, 5, 2, 3, 6, 7); /* hadd's rows 0 1 4 5 2 3 6 7, in order */
    for (int g = g0; g < g1; g++) {
        __m256 acc[Q4_0X8_AVX2_COLS];
#pragma GCC unroll 8
        for (int c = 0; c < COLS; c++)
            acc[c] = _mm256_setzero_ps();
        for (int ib = 0; ib < n_blocks; ib++) {
            const block_q4_0x8 *b = w + (size_t)g * n_blocks + ib;
            /* rows 0-3's bytes 0-7 (values 0-7 low, 16-23 high), rows 4-7's, then both's bytes 8-15 */
            const __m256i r03 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)b->qs), flip);
            const __m256i r47 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b->qs + 32)), flip);
            const __m256i s03 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b->qs + 64)), flip);
            const __m256i s47 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(b->qs + 96)), flip);
            const __m256i a0 = _mm256_and_si256(r03, low), a16 = _mm256_and_si256(_mm256_srli_epi16(r03, 4), low);
            const __m256i a8 = _mm256_and_si256(s03, low), a24 = _mm256_and_si256(_mm256_srli_epi16(s03, 4), low);
            const __m256i b0 = _mm256_and_si256(r47, low), b16 = _mm256_and_si256(_mm256_srli_epi16(r47, 4), low);
            const __m256i b8 = _mm256_and_si256(s47, low), b24 = _mm256_and_si256(_mm256_srli_epi16(s47, 4), low);
            const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)b->d));
            const char *y0 = q + (size_t)ib * sizeof(block_q8_0) + offsetof(block_q8_0, qs);
#pragma GCC unroll 8
            for (int c = 0; c < COLS; c++) {
                const char *y = y0 + (size_t)c * row_size;
                const __m256i v0 = _mm256_set1_epi64x(*(const int64_t *)y);
                const __m256i v8 = _mm256_set1_epi64x(*(const int64_t *)(y + 8));
                const __m256i v16 = _mm256_set1_epi64x(*(const int64_t *)(y + 16));
                const __m256i v24 = _mm256_set1_epi64x(*(const int64_t *)(y + 24));
                const __m256i lo = _mm256_add_epi16(
                    _mm256_add_epi16(_mm256_maddubs_epi16(a0, v0), _mm256_maddubs_epi16(a16, v16)),
                    _mm256_add_epi16(_mm256_maddubs_epi16(a8, v8), _mm256_maddubs_epi16(a24, v24)));
                const __m256i hi = _mm256_add_epi16(
                    _mm256_add_epi16(_mm256_maddubs_epi16(b0, v0), _mm256_maddubs_epi16(b16, v16)),
                    _mm256_add_epi16(_mm256_maddubs_epi16(b8, v8), _mm256_maddubs_epi16(b24, v24)));
                __m256i rows = _mm256_permutevar8x32_epi32(
                    _mm256_hadd_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones)), order);
                rows = _mm256_add_epi32(rows, _mm256_set1_epi32(inits[(size_t)ib * Q4_0X8_AVX2_COLS + c]));
                acc[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(rows),
                                         _mm256_mul_ps(dw, _mm256_broadcast_ss(ds + (size_t)ib * Q4_0X8_AVX2_COLS + c)),
                                         acc[c]);
            }
        }
#pragma GCC unroll 8
        for (int c = 0; c < COLS; c++)
            _mm256_storeu_ps(out + (size_t)c * out_stride + (size_t)g * 8, acc[c]);
    }
}

#define Q4_0X8_AVX2_TIMES(n) \
    case n: q4_0x8_avx2_times(n, wb, n_blocks, g0, g1, q, row_size, ds, inits, out, out_stride); break;

/* The AVX2 repacked Q4_0 op's share: row groups [g0, g1) times every column, Q4_0X8_AVX2_COLS at a time. */
TARGET_AVX2 static void product_q4_0x8_avx2(const struct er_product_params *params, const struct ggml_tensor_head *w,
                                            const struct ggml_tensor_head *x, int ith, int nth, float *out_all,
                                            size_t out_stride) {
    const int k = (int)w->ne[0], n_groups = (int)(w->ne[1] / 8), n_cols = (int)x->ne[1], n_blocks = k / QK;
    const int g0 = (int)((int64_t)n_groups * ith / nth), g1 = (int)((int64_t)n_groups * (ith + 1) / nth);
    if (g0 >= g1)
        return;
    const size_t row_size = (size_t)n_blocks * sizeof(block_q8_0);
    const size_t per = (size_t)n_blocks * Q4_0X8_AVX2_COLS;
    char *ws = work_space(per * (sizeof(float) + sizeof(int32_t)) + (size_t)Q4_0X8_AVX2_COLS * row_size);
    if (!ws)
        abort();
    float *ds = (float *)ws;
    int32_t *inits = (int32_t *)(ws + per * sizeof(float));
    char *q = ws + per * (sizeof(float) + sizeof(int32_t));
    const block_q4_0x8 *wb = (const block_q4_0x8 *)w->data;
    for (int c0 = 0; c0 < n_cols; c0 += Q4_0X8_AVX2_COLS) {
        const int cols = n_cols - c0 < Q4_0X8_AVX2_COLS ? n_cols - c0 : Q4_0X8_AVX2_COLS;
        for (int c = 0; c < cols; c++) {
            params->quantize((const float *)x->data + (size_t)(c0 + c) * (x->nb[1] / sizeof(float)),
                             q + (size_t)c * row_size, k);
            for (int ib = 0; ib < n_blocks; ib++) {
                const block_q8_0 *blk = (const block_q8_0 *)(q + (size_t)c * row_size) + ib;
                int32_t sum = 0;
                for (int j = 0; j < QK; j++)
                    sum += blk->qs[j];
                ds[(size_t)ib * Q4_0X8_AVX2_COLS + c] = half_to_float(blk->d);
                inits[(size_t)ib * Q4_0X8_AVX2_COLS + c] = -8 * sum;
            }
        }
        float *out = out_all + (size_t)c0 * out_stride;
        switch (cols) {
            Q4_0X8_AVX2_TIMES(1) Q4_0X8_AVX2_TIMES(2) Q4_0X8_AVX2_TIMES(3) Q4_0X8_AVX2_TIMES(4)
            Q4_0X8_AVX2_TIMES(5) Q4_0X8_AVX2_TIMES(6) Q4_0X8_AVX2_TIMES(7) Q4_0X8_AVX2_TIMES(8)
        }
    }
}

/* The custom op (ggml_custom_op_t): dst (n_rows, n_cols) F32 = src[0] (k, n_rows) Q4_1, Q8_0, Q6_K or repacked Q4_0
 * times src[1] (k, n_cols) F32, rows split among ggml's threads (repacked Q4_0's by groups of 8). Each thread
 * quantizes the columns itself (a few thousand values, less than one row block's work) rather than waiting for one
 * to. */
void er_product(struct ggml_tensor_head *dst, int ith, int nth, void *userdata) {
    const struct er_product_params *params = userdata;
    const struct ggml_tensor_head *w = dst->src[0], *x = dst->src[1];
    const int k = (int)w->ne[0], n_rows = (int)w->ne[1], n_cols = (int)x->ne[1], n_blocks = k / QK;
    const size_t out_stride = dst->nb[1] / sizeof(float);
    if (params->weights == W_Q4_0X8) {
        if (has_avx512())
            product_q4_0x8(params, w, x, ith, nth, (float *)dst->data, out_stride);
        else
            product_q4_0x8_avx2(params, w, x, ith, nth, (float *)dst->data, out_stride);
        return;
    }
    const int r0 = (int)((int64_t)n_rows * ith / nth), r1 = (int)((int64_t)n_rows * (ith + 1) / nth);
    if (r0 >= r1)
        return;
    if (!has_avx512()) { /* Q4_1 and Q8_0 only (er_product_types) */
        product_avx2(params, w, x, r0, r1, (float *)dst->data, out_stride);
        return;
    }
    if (params->weights == W_Q6_K) {
        const int n_super = k / QK_K;
        const size_t q8k_row = (size_t)n_super * sizeof(block_q8_K);
        char *q = work_space((size_t)Q6_K_COLS * q8k_row);
        if (!q)
            abort();
        for (int c0 = 0; c0 < n_cols; c0 += Q6_K_COLS) {
            const int cols = n_cols - c0 < Q6_K_COLS ? n_cols - c0 : Q6_K_COLS;
            for (int c = 0; c < cols; c++)
                params->quantize((const float *)x->data + (size_t)(c0 + c) * (x->nb[1] / sizeof(float)),
                                 q + (size_t)c * q8k_row, k);
            q6_k_rows(w->data, n_super, r0, r1, cols, q, q8k_row, (float *)dst->data + c0 * out_stride, out_stride);
        }
        return;
    }
    const size_t row_size = (size_t)n_blocks * (params->weights == W_Q4_1 ? sizeof(block_q8_1) : sizeof(block_q8_0));
    const size_t per_pair = (size_t)n_blocks * (MAX_COLS / 2);
    const size_t pairs_size = per_pair * (2 * sizeof(__m512i) + sizeof(__m512)) + (size_t)n_blocks * sizeof(__m512);
    const size_t sets_size = (size_t)n_blocks * MAX_SETS * (8 * sizeof(__m512i) + sizeof(__m512) + sizeof(__m256));
    const size_t lay_size = pairs_size > sets_size ? pairs_size : sets_size;
    char *ws = work_space(lay_size + (size_t)MAX_COLS * row_size);
    if (!ws)
        abort();
    for (int c0 = 0; c0 < n_cols; c0 += MAX_COLS) {
        const int cols = n_cols - c0 < MAX_COLS ? n_cols - c0 : MAX_COLS;
        if (cols >= SET_FROM) {
            set_layout in;
            const size_t sets = (size_t)n_blocks * MAX_SETS;
            in.acts = (__m512i *)ws;
            in.inits = in.acts + sets * 4;
            in.scales = (__m512 *)(in.inits + sets * 4);
            in.sums = (__m256 *)(in.scales + sets);
            lay_out_sets(params->weights, (const float *)x->data, x->nb[1] / sizeof(float), c0, cols, k,
                         params->quantize, ws + lay_size, row_size, in);
            rows_times_set_cols(params->weights, w->data, n_blocks, r0, r1, cols, in,
                                (float *)dst->data + c0 * out_stride, out_stride);
            continue;
        }
        layout in;
        in.pairs = (__m512i *)ws;
        in.inits = in.pairs + per_pair;
        in.scales = (__m512 *)(in.inits + per_pair);
        in.sums = in.scales + per_pair;
        lay_out(params->weights, (const float *)x->data, x->nb[1] / sizeof(float), c0, cols, k, params->quantize,
                ws + lay_size, row_size, in);
        rows_times_cols(params->weights, w->data, n_blocks, r0, r1, cols, in, (float *)dst->data + c0 * out_stride,
                        out_stride);
    }
}

/* Attention of decode tokens and short prompt chunks, each token over its own sequence's cache up to its position,
 * giving ggml's flash attention (ggml_flash_attn_ext over an F16 cache, fewer query rows than its 64-row tile:
 * ggml_compute_forward_flash_attn_ext_f16_one_chunk, row by row) bit for bit. ggml computes
 * each query head alone through function pointers and a scalar loop for the value rows (64-value heads are below
 * its AVX512-FP16 step), ~110 ns a cache row and head here; a batch of 8 sequences spent a third of its step in it.
 * Here the query heads that share a key-value head (grouped-query attention) go together, every key and value row
 * converted once for all of them, in registers.
 *
 * The arithmetic is ggml's, in its order:
 * - the query rounded to F16; a score is ggml_vec_dot_f16: four 16-lane fmas (key x query, from zero), lanes
 *   added as its reduce does (0 += 2, 1 += 3, 0 += 1, then _mm512_reduce_add_ps), times the scale, plus the mask's
 *   0 (rows outside the sequence are skipped, as ggml skips its mask's -inf);
 * - online softmax: a new maximum scales the F16 accumulator by expf(old - new) (each value rounded to F16), else
 *   the row's weight is expf(s - max); the accumulator takes value x weight, rounded to F16: one fma, or where
 *   `fused_mad` is 0 a product then a sum (the check at load picks what this machine's ggml does); the sum of
 *   weights S = S * ms + vs likewise (`fused_sum`);
 * - at the end the accumulator times 1/S (0 where S is 0).
 * Heads of 64 values only: ggml's F16 step (64 values, or 128 with AVX512-FP16) decides its order otherwise. */

#define ATTN_MAX_TOKENS 256

struct er_attention_params {
    int32_t n_heads, n_kv_heads;
    float scale;
    int32_t fused_mad, fused_sum, fused_merge;
    /* the rows of each decode token's view of its cache in ggml's graph, which decide ggml's split of them among
     * threads; 0 for a token of a prompt chunk, whose rows ggml never splits */
    int32_t n_kv[ATTN_MAX_TOKENS];
};

#define ATTN_HEAD 64
#define ATTN_MAX_GROUP 8 /* query heads to a key-value head */
#define ATTN_SPLIT_ROWS 512 /* ggml splits the rows of a one-token attention among its threads from here on */

/* A head's 64 values in registers: four 512-bit ones (AVX-512) or eight 256-bit ones (AVX2), with the few
 * operations attend_rows takes, named v512_* and v256_*; attend_rows is written once over them (ATTEND_ROWS). */
TARGET static inline __m512 v512_half(const uint16_t *p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
}
TARGET static inline __m512 v512_round(__m512 x) { /* to the nearest F16 and back: ggml's F16 accumulator */
    return _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
TARGET static inline __m512 v512_load(const float *p) { return _mm512_loadu_ps(p); }
TARGET static inline void v512_store(float *p, __m512 x) { _mm512_storeu_ps(p, x); }
TARGET static inline __m512 v512_set1(float x) { return _mm512_set1_ps(x); }
TARGET static inline __m512 v512_zero(void) { return _mm512_setzero_ps(); }
TARGET static inline __m512 v512_mul(__m512 a, __m512 b) { return _mm512_mul_ps(a, b); }
TARGET static inline __m512 v512_add(__m512 a, __m512 b) { return _mm512_add_ps(a, b); }
TARGET static inline __m512 v512_fmadd(__m512 a, __m512 b, __m512 c) { return _mm512_fmadd_ps(a, b, c); }

/* ggml_vec_dot_f16 of an AVX-512 build: four 16-lane fmas from zero, lanes added 0 += 2, 1 += 3, 0 += 1, then
 * _mm512_reduce_add_ps */
TARGET static inline float v512_score(const __m512 k[4], const __m512 q[4]) {
    const __m512 zero = _mm512_setzero_ps();
    __m512 x0 = _mm512_fmadd_ps(k[0], q[0], zero), x1 = _mm512_fmadd_ps(k[1], q[1], zero);
    const __m512 x2 = _mm512_fmadd_ps(k[2], q[2], zero), x3 = _mm512_fmadd_ps(k[3], q[3], zero);
    x0 = _mm512_add_ps(x0, x2);
    x1 = _mm512_add_ps(x1, x3);
    x0 = _mm512_add_ps(x0, x1);
    return _mm512_reduce_add_ps(x0);
}

TARGET_AVX2 static inline __m256 v256_half(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}
TARGET_AVX2 static inline __m256 v256_round(__m256 x) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}
TARGET_AVX2 static inline __m256 v256_load(const float *p) { return _mm256_loadu_ps(p); }
TARGET_AVX2 static inline void v256_store(float *p, __m256 x) { _mm256_storeu_ps(p, x); }
TARGET_AVX2 static inline __m256 v256_set1(float x) { return _mm256_set1_ps(x); }
TARGET_AVX2 static inline __m256 v256_zero(void) { return _mm256_setzero_ps(); }
TARGET_AVX2 static inline __m256 v256_mul(__m256 a, __m256 b) { return _mm256_mul_ps(a, b); }
TARGET_AVX2 static inline __m256 v256_add(__m256 a, __m256 b) { return _mm256_add_ps(a, b); }
TARGET_AVX2 static inline __m256 v256_fmadd(__m256 a, __m256 b, __m256 c) { return _mm256_fmadd_ps(a, b, c); }

/* ggml_vec_dot_f16 of an AVX2 build (32 values a step in four 8-lane sums): sum j takes values 8j..8j+7 from zero,
 * then 32 + 8j..; sums added 0 += 2, 1 += 3, 0 += 1; the two 128-bit halves added, then two horizontal adds */
TARGET_AVX2 static inline float v256_score(const __m256 k[8], const __m256 q[8]) {
    const __m256 zero = _mm256_setzero_ps();
    __m256 x[4];
    for (int j = 0; j < 4; j++)
        x[j] = _mm256_fmadd_ps(k[4 + j], q[4 + j], _mm256_fmadd_ps(k[j], q[j], zero));
    x[0] = _mm256_add_ps(x[0], x[2]);
    x[1] = _mm256_add_ps(x[1], x[3]);
    x[0] = _mm256_add_ps(x[0], x[1]);
    const __m128 t0 = _mm_add_ps(_mm256_castps256_ps128(x[0]), _mm256_extractf128_ps(x[0], 1));
    const __m128 t1 = _mm_hadd_ps(t0, t0);
    return _mm_cvtss_f32(_mm_hadd_ps(t1, t1));
}

/* What one run over cache rows leaves per query head: the largest score M, the sum of weights S and the
 * unnormalized F16-rounded output (ggml's "partial"). */
typedef struct {
    float M[ATTN_MAX_GROUP], S[ATTN_MAX_GROUP];
    float acc[ATTN_MAX_GROUP][ATTN_HEAD];
} partial;

typedef void (*attend_rows_t)(const struct er_attention_params *p, int group, const float *q, size_t q_stride,
                              const uint16_t *k, const uint16_t *v, size_t row_stride, int r0, int r1,
                              partial *out);

/* One token's query heads j = 0..group-1 of one key-value head (`q` their rows, F32, q_stride floats apart) over
 * cache rows [r0, r1) (k and v the head's first row, F16, row_stride halves apart): attend_rows_v512 and
 * attend_rows_v256, from registers V of N lanes (their operations V_*).
 * The rows go in tiles of ATTN_TILE, each in three passes: every row's scores (independent of one another), then
 * each head's softmax weights in row order (the running maximum, expf, the sum), then the value rows into the
 * accumulators. Each head's arithmetic is the same as row by row, in the same order; what the passes change is
 * that no row's score waits on the last row's accumulator update, and that a tile's rows can be on their way
 * before they are read (prefetch_head). The tiles alone gained little; with the prefetching, a step of 8 of the
 * shipped model's sequences (positions 76-226) took 26.0-31.0 ms against 35.2-38.3 row by row. */
#define ATTN_TILE 32

/* A head's 64 F16 values (two cache lines) on their way: the caches' rows are apart by every head's values, a stride
 * the CPU's own prefetchers follow poorly, and a batch's attention waited on them most of its time. (Reading past
 * the rows a sequence holds is harmless: a prefetch never faults.) */
static inline void prefetch_head(const uint16_t *row) {
    _mm_prefetch((const char *)row, _MM_HINT_T0);
    _mm_prefetch((const char *)row + 64, _MM_HINT_T0);
}
/* The value rows of a tile into the accumulators (pass three), MAD(acc, value, weight) the multiply-add as ggml's
 * compiler left it: inside ATTEND_ROWS. */
#define ATTEND_VALUES(V, VT, N, MAD)                                                                                \
    for (int r = 0; r < n; r++) {                                                                                  \
        const uint16_t *vr = v + (size_t)(t0 + r) * row_stride;                                                    \
        VT vf[R];                                                                                                  \
        _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) vf[i] = V##_half(vr + N * i);                          \
        _Pragma("GCC unroll 8") for (int j = 0; j < G; j++) {                                                      \
            if (ms[j][r] != 1.0f) { /* (times 1 leaves an F16-rounded accumulator as it is) */                     \
                const VT scale = V##_set1(ms[j][r]);                                                               \
                _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) acc[j][i] = V##_round(V##_mul(acc[j][i], scale)); \
            }                                                                                                      \
            const VT weight = V##_set1(vs[j][r]);                                                                  \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) acc[j][i] = V##_round(MAD(acc[j][i], vf[i], weight)); \
        }                                                                                                          \
    }
#define ATTN_FMA(V, a, x, w) V##_fmadd(x, w, a)
#define ATTN_MUL_ADD(V, a, x, w) V##_add(a, V##_mul(x, w))
#define ATTN_FMA_v512(a, x, w) ATTN_FMA(v512, a, x, w)
#define ATTN_MUL_ADD_v512(a, x, w) ATTN_MUL_ADD(v512, a, x, w)
#define ATTN_FMA_v256(a, x, w) ATTN_FMA(v256, a, x, w)
#define ATTN_MUL_ADD_v256(a, x, w) ATTN_MUL_ADD(v256, a, x, w)

/* NAME: attend_rows over registers V of N lanes, for GROUP query heads to a key-value head: a constant (the
 * accumulators then stay in registers: 4 heads' take 16 of AVX-512's 32) or `group` (any count, in memory). */
#define ATTEND_ROWS(V, ATTR, VT, N, NAME, GROUP)                                                                   \
    ATTR static void NAME(const struct er_attention_params *p, int group, const float *q, size_t q_stride,         \
                          const uint16_t *k, const uint16_t *v, size_t row_stride, int r0, int r1, partial *out) { \
        enum { R = ATTN_HEAD / N };                                                                                \
        const int G = (GROUP);                                                                                     \
        (void)group;                                                                                               \
        VT qf[ATTN_MAX_GROUP][R] = {0}, acc[ATTN_MAX_GROUP][R] = {0}; /* (all set below: G heads' are used) */       \
        float M[ATTN_MAX_GROUP], S[ATTN_MAX_GROUP];                                                                \
        float score[ATTN_MAX_GROUP][ATTN_TILE], ms[ATTN_MAX_GROUP][ATTN_TILE], vs[ATTN_MAX_GROUP][ATTN_TILE];      \
        _Pragma("GCC unroll 8") for (int j = 0; j < G; j++) {                                                      \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) {                                                  \
                qf[j][i] = V##_round(V##_load(q + (size_t)j * q_stride + N * i));                                  \
                acc[j][i] = V##_zero();                                                                            \
            }                                                                                                      \
            M[j] = -INFINITY;                                                                                      \
            S[j] = 0.0f;                                                                                           \
        }                                                                                                          \
        for (int t0 = r0; t0 < r1; t0 += ATTN_TILE) {                                                              \
            const int n = r1 - t0 < ATTN_TILE ? r1 - t0 : ATTN_TILE;                                               \
            for (int r = 0; r < n; r++) {                                                                          \
                const uint16_t *kr = k + (size_t)(t0 + r) * row_stride;                                            \
                prefetch_head(kr + ATTN_TILE * row_stride); /* the next tile's keys */                             \
                prefetch_head(v + (size_t)(t0 + r) * row_stride); /* this tile's values, for pass three */         \
                VT kf[R];                                                                                          \
                _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) kf[i] = V##_half(kr + N * i);                  \
                _Pragma("GCC unroll 8") for (int j = 0; j < G; j++)                                                \
                    score[j][r] = V##_score(kf, qf[j]) * p->scale + 0.0f; /* + the mask's 0, as ggml adds it */    \
            }                                                                                                      \
            for (int j = 0; j < G; j++)                                                                            \
                for (int r = 0; r < n; r++) {                                                                      \
                    const float s = score[j][r];                                                                   \
                    if (s > M[j]) { /* a new maximum: the accumulator is scaled, this row weighs 1 */              \
                        ms[j][r] = expf(M[j] - s);                                                                 \
                        vs[j][r] = 1.0f;                                                                           \
                        M[j] = s;                                                                                  \
                    } else {                                                                                       \
                        ms[j][r] = 1.0f;                                                                           \
                        vs[j][r] = expf(s - M[j]);                                                                 \
                    }                                                                                              \
                    S[j] = p->fused_sum ? fmaf(S[j], ms[j][r], vs[j][r]) : S[j] * ms[j][r] + vs[j][r];             \
                }                                                                                                  \
            if (p->fused_mad)                                                                                      \
                ATTEND_VALUES(V, VT, N, ATTN_FMA_##V)                                                              \
            else                                                                                                   \
                ATTEND_VALUES(V, VT, N, ATTN_MUL_ADD_##V)                                                          \
        }                                                                                                          \
        _Pragma("GCC unroll 8") for (int j = 0; j < G; j++) {                                                      \
            out->M[j] = M[j];                                                                                      \
            out->S[j] = S[j];                                                                                      \
            _Pragma("GCC unroll 8") for (int i = 0; i < R; i++) V##_store(out->acc[j] + N * i, acc[j][i]);         \
        }                                                                                                          \
    }

ATTEND_ROWS(v512, TARGET, __m512, 16, attend_rows_v512, group)
ATTEND_ROWS(v512, TARGET, __m512, 16, attend_rows_v512_g3, 3)
ATTEND_ROWS(v512, TARGET, __m512, 16, attend_rows_v512_g4, 4)
ATTEND_ROWS(v256, TARGET_AVX2, __m256, 8, attend_rows_v256, group)
ATTEND_ROWS(v256, TARGET_AVX2, __m256, 8, attend_rows_v256_g3, 3)
ATTEND_ROWS(v256, TARGET_AVX2, __m256, 8, attend_rows_v256_g4, 4)

/* a * b + c * d as ggml's compiler left it: two products and a sum, or one product fused into the sum */
static inline float merged(int fused, float a, float b, float c, float d) {
    switch (fused) {
    case 1: return fmaf(a, b, c * d);
    case 2: return fmaf(c, d, a * b);
    default: return a * b + c * d;
    }
}

/* One token's heads of one key-value head over rows 0..position, read in ggml's graph through a view of n_kv rows:
 * out their outputs, 64 floats each. Where ggml splits the token's rows (n_kv >= 512) it runs each of its nth threads' chunk of them alone and merges the
 * chunks (ggml_flash_attn_ext_reduce_partials); so does this, chunk by chunk in the same order. */
TARGET_AVX2 static void attend_token(attend_rows_t attend_rows, const struct er_attention_params *p, int group,
                                     int nth, const float *q, size_t q_stride, const uint16_t *k, const uint16_t *v,
                                     size_t row_stride, int position, int n_kv, float *out) {
    const int rows = position + 1;
    partial part;
    if (n_kv < ATTN_SPLIT_ROWS || nth == 1) { /* (one chunk of every row merges to the same bits as none) */
        attend_rows(p, group, q, q_stride, k, v, row_stride, 0, rows, &part);
        for (int j = 0; j < group; j++) {
            const float inv = part.S[j] == 0.0f ? 0.0f : 1.0f / part.S[j];
            for (int d = 0; d < ATTN_HEAD; d++)
                out[j * ATTN_HEAD + d] = part.acc[j][d] * inv;
        }
        return;
    }
    float M[ATTN_MAX_GROUP], S[ATTN_MAX_GROUP];
    for (int j = 0; j < group; j++) {
        M[j] = -INFINITY;
        S[j] = 0.0f;
        memset(out + j * ATTN_HEAD, 0, ATTN_HEAD * sizeof(float));
    }
    const int chunk = (n_kv + nth - 1) / nth;
    for (int c0 = 0; c0 < n_kv && c0 < rows; c0 += chunk) {
        const int c1 = c0 + chunk < rows ? c0 + chunk : rows;
        attend_rows(p, group, q, q_stride, k, v, row_stride, c0, c1, &part);
        for (int j = 0; j < group; j++) {
            if (part.S[j] == 0.0f)
                continue;
            const float m = fmaxf(M[j], part.M[j]);
            const float old = expf(M[j] - m), new = expf(part.M[j] - m);
            for (int d = 0; d < ATTN_HEAD; d++)
                out[j * ATTN_HEAD + d] = merged(p->fused_merge, out[j * ATTN_HEAD + d], old, part.acc[j][d], new);
            S[j] = merged(p->fused_merge, S[j], old, part.S[j], new);
            M[j] = m;
        }
    }
    for (int j = 0; j < group; j++)
        if (S[j] != 0.0f) {
            const float inv = 1.0f / S[j];
            for (int d = 0; d < ATTN_HEAD; d++)
                out[j * ATTN_HEAD + d] *= inv;
        }
}

/* The custom op: dst (64 * n_heads, n) F32 = attention of src[0], queries (64, n_heads, n) F32, over src[1] and
 * src[2], the key and value caches (64 * n_kv_heads, cache rows) F16 (this step's rows already set: the set_rows
 * results are passed, so ggml orders the op after them). Token t is at position src[3][t] (I32) and wrote cache row
 * src[4][t] (I64), and sees the rows of positions 0..its own: rows src[4][t] - src[3][t] .. src[4][t]. The
 * (token, key-value head) pairs are split among ggml's threads; nth, which decides how ggml would have split a long
 * row range, is the graph's thread count either way. */
void er_attention(struct ggml_tensor_head *dst, int ith, int nth, void *userdata) {
    const struct er_attention_params *p = userdata;
    const struct ggml_tensor_head *q = dst->src[0], *kc = dst->src[1], *vc = dst->src[2], *pos = dst->src[3],
                                  *at = dst->src[4];
    const int n = (int)q->ne[2], group = p->n_heads / p->n_kv_heads;
    const size_t row_stride = kc->nb[1] / sizeof(uint16_t);
    const int wide = has_avx512();
    const attend_rows_t rows_fn = group == 3 ? (wide ? attend_rows_v512_g3 : attend_rows_v256_g3)
                                  : group == 4 ? (wide ? attend_rows_v512_g4 : attend_rows_v256_g4)
                                  : (wide ? attend_rows_v512 : attend_rows_v256);
    for (int u = ith; u < n * p->n_kv_heads; u += nth) {
        const int t = u / p->n_kv_heads, g = u % p->n_kv_heads;
        const int position = ((const int32_t *)pos->data)[t];
        const int64_t first = ((const int64_t *)at->data)[t] - position;
        const size_t offset = (size_t)first * row_stride + (size_t)g * ATTN_HEAD;
        attend_token(rows_fn, p, group, nth, (const float *)((const char *)q->data + (size_t)t * q->nb[2] +
                                                    (size_t)g * group * q->nb[1]),
                     q->nb[1] / sizeof(float), (const uint16_t *)kc->data + offset, (const uint16_t *)vc->data + offset,
                     row_stride, position, p->n_kv[t],
                     (float *)((char *)dst->data + (size_t)t * dst->nb[1]) + (size_t)g * group * ATTN_HEAD);
    }
}
#else
void er_product(struct ggml_tensor_head *dst, int ith, int nth, void *userdata) {
    (void)dst; (void)ith; (void)nth; (void)userdata;
    abort(); /* never given to ggml where er_product_types() is 0 */
}
void er_attention(struct ggml_tensor_head *dst, int ith, int nth, void *userdata) {
    (void)dst; (void)ith; (void)nth; (void)userdata;
    abort(); /* never given to ggml where er_product_types() is 0 */
}
#endif
