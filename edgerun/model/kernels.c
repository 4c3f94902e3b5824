/* A matrix product of Q4_1 weights with several columns of activations, for ggml graphs (a custom op), giving
 * ggml's own product bit for bit.
 *
 * ggml has no batched kernel for Q4_1 on x86 (llamafile's tinyBLAS and the repacked layouts take Q4_0, Q8_0,
 * Q4_K and IQ4_NL): a product with B columns calls its one-row dot product B times per row, unpacking every weight
 * block again for each column, so a batch of 8 sequences costs almost 8 single steps. Here each weight block is
 * unpacked once and multiplied with every column, two columns to a 512-bit register.
 *
 * Bit for bit: every output is the float arithmetic of ggml's ggml_vec_dot_q4_1_q8_1 (AVX2 build) over the
 * activations quantized by ggml's own Q8_1 quantizer (its function, passed in): per block, an exact integer dot
 * product of 4-byte groups in 8 lanes, d = d(w) * d(x), lane = fma(d, dot, lane); beside it min = fma(m(w), s(x),
 * min); at the end the 8 lanes added as ggml's hsum_float_8 adds them, plus min. The integer sums are exact and
 * every float operation happens on the same values in the same order, so only the order of independent columns
 * changes. The engine checks this against ggml's product when it loads (edgerun.model.kernels) and uses ggml's
 * where they differ.
 *
 * No Python API: a plain library loaded with ctypes, built by the install (setup.py). */

#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define HAVE_KERNEL 1
#else
#define HAVE_KERNEL 0
#endif

#define QK 32
#define MAX_COLS 16 /* columns in one pass over the weights: 8 pairs, each pair one 512-bit register */

typedef struct {
    uint16_t d, m;
    uint8_t qs[QK / 2];
} block_q4_1;

typedef struct {
    uint16_t d, s;
    int8_t qs[QK];
} block_q8_1;

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

/* What the op is given: ggml's Q8_1 quantizer (ggml_get_type_traits_cpu(Q8_1)->from_float). */
struct er_q4_1_params {
    from_float_t quantize;
};

size_t er_tensor_data_offset(void) { return offsetof(struct ggml_tensor_head, data); }

int er_q4_1_available(void) {
#if HAVE_KERNEL
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni") &&
           __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
    return 0;
#endif
}

#if HAVE_KERNEL
#define TARGET __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni,fma,f16c")))

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

TARGET static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }

/* ggml's hsum_float_8: the high half added to the low, then lanes 2,3 to 0,1, then lane 1 to 0. */
TARGET static inline float hsum8(__m256 x) {
    __m128 r = _mm_add_ps(_mm256_extractf128_ps(x, 1), _mm256_castps256_ps128(x));
    r = _mm_add_ps(r, _mm_movehl_ps(r, r));
    r = _mm_add_ss(r, _mm_movehdup_ps(r));
    return _mm_cvtss_f32(r);
}

/* Rows [r0, r1) of W (n_blocks blocks each) times `cols` columns (at most MAX_COLS) laid out by the caller:
 * pairs[ib][p] the 32 bytes of columns 2p and 2p+1 side by side, scales[ib][p] their d's (8 lanes each), sums[ib]
 * every column's s (16 lanes). out[c * out_stride + r]. N_PAIRS is a constant where it is inlined (rows_times), so
 * the accumulators stay in registers. */
TARGET static inline __attribute__((always_inline)) void rows_times_pairs(
    const int N_PAIRS, const block_q4_1 *w, int n_blocks, int r0, int r1, int cols, const __m512i *pairs,
    const __m512 *scales, const __m512 *sums, float *out, size_t out_stride) {
    const __m512i low = _mm512_set1_epi8(0x0F);
    /* the 16 packed bytes in all four 128-bit lanes; lanes 0 and 2 keep their low nibbles, 1 and 3 their high
     * ones: [block | block], the block's 32 values in order (ggml's bytes_from_nibbles_32) for both columns */
    const __m512i shifts = _mm512_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0,
                                            4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0);
    for (int r = r0; r < r1; r++) {
        const block_q4_1 *row = w + (size_t)r * n_blocks;
        __m512 acc[MAX_COLS / 2];
#pragma GCC unroll 8
        for (int p = 0; p < N_PAIRS; p++)
            acc[p] = _mm512_setzero_ps();
        __m512 mins = _mm512_setzero_ps();
        for (int ib = 0; ib < n_blocks; ib++) {
            const __m512 d0 = _mm512_cvtph_ps(_mm256_set1_epi16((short)row[ib].d));
            mins = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_set1_epi16((short)row[ib].m)), sums[ib], mins);
            const __m512i packed = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)row[ib].qs));
            const __m512i qq = _mm512_and_si512(_mm512_srlv_epi16(packed, shifts), low);
            const __m512i *y = pairs + (size_t)ib * N_PAIRS;
            const __m512 *dy = scales + (size_t)ib * N_PAIRS;
#pragma GCC unroll 8
            for (int p = 0; p < N_PAIRS; p++) {
                const __m512 dot = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), qq, y[p]));
                acc[p] = _mm512_fmadd_ps(_mm512_mul_ps(d0, dy[p]), dot, acc[p]);
            }
        }
        float min_lanes[16];
        _mm512_storeu_ps(min_lanes, mins);
        for (int c = 0; c < cols; c++) {
            const __m512 a = acc[c / 2];
            const __m256 half = (c & 1) ? _mm512_extractf32x8_ps(a, 1) : _mm512_castps512_ps256(a);
            out[(size_t)c * out_stride + r] = hsum8(half) + min_lanes[c];
        }
    }
}

#define ROWS_TIMES(n) \
    case n: rows_times_pairs(n, w, n_blocks, r0, r1, cols, pairs, scales, sums, out, out_stride); break;

TARGET static void rows_times_cols(const block_q4_1 *w, int n_blocks, int r0, int r1, int cols,
                                   const __m512i *pairs, const __m512 *scales, const __m512 *sums, float *out,
                                   size_t out_stride) {
    switch ((cols + 1) / 2) {
        ROWS_TIMES(1) ROWS_TIMES(2) ROWS_TIMES(3) ROWS_TIMES(4) ROWS_TIMES(5) ROWS_TIMES(6) ROWS_TIMES(7)
        ROWS_TIMES(8)
    }
}

/* Columns [c0, c0 + cols) of x (k floats each, x_stride floats apart) quantized by ggml's quantizer and laid out
 * for rows_times_cols in ws. */
TARGET static void lay_out(const float *x, size_t x_stride, int c0, int cols, int k, from_float_t quantize,
                           block_q8_1 *q, __m512i *pairs, __m512 *scales, __m512 *sums) {
    const int n_blocks = k / QK, n_pairs = (cols + 1) / 2;
    for (int c = 0; c < cols; c++)
        quantize(x + (size_t)(c0 + c) * x_stride, q + (size_t)c * n_blocks, k);
    for (int ib = 0; ib < n_blocks; ib++) {
        float s[16] = {0};
        for (int p = 0; p < n_pairs; p++) {
            const block_q8_1 *a = q + (size_t)(2 * p) * n_blocks + ib;
            const int second = 2 * p + 1 < cols;
            const block_q8_1 *b = second ? q + (size_t)(2 * p + 1) * n_blocks + ib : NULL;
            __m256i lo = _mm256_loadu_si256((const __m256i *)a->qs);
            __m256i hi = b ? _mm256_loadu_si256((const __m256i *)b->qs) : _mm256_setzero_si256();
            pairs[(size_t)ib * n_pairs + p] = _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
            __m256 da = _mm256_set1_ps(half_to_float(a->d));
            __m256 db = _mm256_set1_ps(b ? half_to_float(b->d) : 0.0f);
            scales[(size_t)ib * n_pairs + p] =
                _mm512_insertf32x8(_mm512_castps256_ps512(da), db, 1);
            s[2 * p] = half_to_float(a->s);
            if (b)
                s[2 * p + 1] = half_to_float(b->s);
        }
        sums[ib] = _mm512_loadu_ps(s);
    }
}

/* The custom op (ggml_custom_op_t): dst (n_rows, n_cols) F32 = src[0] (k, n_rows) Q4_1 times src[1] (k, n_cols)
 * F32, rows split among ggml's threads. Each thread quantizes the columns itself (a few thousand values, less
 * than one row block's work) rather than waiting for one to. */
void er_q4_1_matmul(struct ggml_tensor_head *dst, int ith, int nth, void *userdata) {
    const struct er_q4_1_params *params = userdata;
    const struct ggml_tensor_head *w = dst->src[0], *x = dst->src[1];
    const int k = (int)w->ne[0], n_rows = (int)w->ne[1], n_cols = (int)x->ne[1], n_blocks = k / QK;
    const int r0 = (int)((int64_t)n_rows * ith / nth), r1 = (int)((int64_t)n_rows * (ith + 1) / nth);
    if (r0 >= r1)
        return;
    const size_t q_size = (size_t)MAX_COLS * n_blocks * sizeof(block_q8_1);
    const size_t lay_size = (size_t)n_blocks * (MAX_COLS / 2) * (sizeof(__m512i) + sizeof(__m512)) +
                            (size_t)n_blocks * sizeof(__m512);
    char *ws = work_space(lay_size + (q_size + 63) / 64 * 64);
    if (!ws)
        abort();
    for (int c0 = 0; c0 < n_cols; c0 += MAX_COLS) {
        const int cols = n_cols - c0 < MAX_COLS ? n_cols - c0 : MAX_COLS, n_pairs = (cols + 1) / 2;
        __m512i *pairs = (__m512i *)ws;
        __m512 *scales = (__m512 *)(pairs + (size_t)n_blocks * n_pairs);
        __m512 *sums = scales + (size_t)n_blocks * n_pairs;
        block_q8_1 *q = (block_q8_1 *)(ws + lay_size);
        lay_out((const float *)x->data, x->nb[1] / sizeof(float), c0, cols, k, params->quantize, q, pairs, scales,
                sums);
        rows_times_cols((const block_q4_1 *)w->data, n_blocks, r0, r1, cols, pairs, scales, sums,
                        (float *)dst->data + (size_t)c0 * (dst->nb[1] / sizeof(float)), dst->nb[1] / sizeof(float));
    }
}
#else
void er_q4_1_matmul(struct ggml_tensor_head *dst, int ith, int nth, void *userdata) {
    (void)dst; (void)ith; (void)nth; (void)userdata;
    abort(); /* never given to ggml where er_q4_1_available() is 0 */
}
#endif
