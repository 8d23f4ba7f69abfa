/* y = x W^T + bias with W kept in a GGUF file's weight format, for attnlab.model.qlinear (CPU).
 *
 * W (n, k) is stored as ggml stores it: row after row, each row k / 32 blocks of 32 consecutive values (fp16
 * rows for F16). Formats are numbered as ggml's type ids (gguf.GGMLQuantizationType):
 *   1 F16   2 bytes per value
 *   2 Q4_0  18 bytes: fp16 d, 16 bytes of nibbles           w = d * (q - 8)
 *   3 Q4_1  20 bytes: fp16 d, fp16 m, 16 bytes of nibbles   w = d * q + m
 *   8 Q8_0  34 bytes: fp16 d, 32 int8                       w = d * q
 * Nibbles: byte j holds element j in its low nibble and element j + 16 in its high nibble.
 *
 * The activations stay fp32 (llama.cpp quantizes them to 8 bits; attnlab does not), so y is a fp32 matmul over
 * the dequantized W (ggml's values: d (q - 8) and d q are exact in fp32, d q + m rounded once, as ggml does) up
 * to the order of the sums: Q4_0 and Q8_0 sum each block's codes times x, then scale the sum by d.
 *
 *   attnlab_qmatmul:    y[i, o] = bias[o] + sum_j x[i, j] W[o, j]
 *                       AVX-512: a tile of ROWS rows of W is decoded one block at a time into registers and
 *                       used for up to XROWS rows of x at once (the decode is the cost: the weights are read
 *                       once, from memory, and decoded once per XROWS rows of x); portable C otherwise.
 *   attnlab_dequantize: rows of W -> fp32, for the embedding lookup (its looked-up rows) and for many rows of x
 *                       (attnlab.kernels.cpu.qmatmul hands those to torch's GEMM over dequantized tiles).
 *   attnlab_qmatmul_q8: the same product with x quantized first, as llama.cpp does (an opt-in: not exact against
 *                       the dequantized matmul): each block of 32 values of a row of x to 8-bit codes
 *                       (attnlab_quantize_q8: ggml's Q8_0, d = max|x| / 127, q = round(x / d), halves away from
 *                       zero), then integer dot products of the weights' codes with x's per block, scaled by the
 *                       two scales. Q4_0, Q4_1 and Q8_0 weights (F16 has no codes). AVX-512 VNNI where present
 *                       (vpdpbusd: 32 products of unsigned by signed bytes summed per 4 in one instruction),
 *                       portable C otherwise; both give the same integer sums.
 *
 * Built by attnlab.kernels.cpu.build with the system C compiler; with OpenMP, the calls share the threads of
 * PyTorch's OpenMP runtime (torch.set_num_threads), sharing the rows of W out among them.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp16.h"

enum { F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>

/* The sum of a vector's 8 lanes. */
static inline float sum8(__m256 v) {
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
    return _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
}
#endif

#define ROWS 4             /* rows of W decoded together (independent sums: FMA latency is hidden) */
#define XROWS 4            /* rows of x sharing each decoded block (ROWS * XROWS accumulators in registers) */
#define CHUNK 8            /* tiles a thread takes at a time: shares well when another process holds a core */
#define PARALLEL_MIN 65536 /* weights below which a call stays on one thread */

static int64_t block_bytes(int fmt) {
    switch (fmt) {
    case F16: return 64;
    case Q4_0: return 18;
    case Q4_1: return 20;
    case Q8_0: return 34;
    default: return 0;
    }
}

static inline uint16_t load_u16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2); /* blocks are 18 or 20 bytes: their scales are not 2-byte aligned in general */
    return h;
}

/* One block of 32 weights as floats, portable C. */
static inline void decode_block_c(int fmt, const uint8_t *b, float *restrict out) {
    switch (fmt) {
    case F16:
        for (int i = 0; i < 32; i++) out[i] = half_to_float(load_u16(b + 2 * i));
        break;
    case Q8_0: {
        const float d = half_to_float(load_u16(b));
        for (int i = 0; i < 32; i++) out[i] = d * (float)(int8_t)b[2 + i];
        break;
    }
    case Q4_0: {
        const float d = half_to_float(load_u16(b));
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)((int)(b[2 + i] & 15) - 8);
            out[i + 16] = d * (float)((int)(b[2 + i] >> 4) - 8);
        }
        break;
    }
    default: { /* Q4_1 */
        const float d = half_to_float(load_u16(b)), m = half_to_float(load_u16(b + 2));
        for (int i = 0; i < 16; i++) {
            out[i] = d * (float)(b[4 + i] & 15) + m;
            out[i + 16] = d * (float)(b[4 + i] >> 4) + m;
        }
    }
    }
}

#if defined(__AVX512F__)
static inline __m512 broadcast_half(const uint8_t *p) {
    return _mm512_cvtph_ps(_mm256_set1_epi16((short)load_u16(p)));
}

/* Whether a format's block is decoded to its codes, the scale d applied to each block's dot product (fewer
 * multiplies: the kernel is bound by them), rather than to its weights. */
#define FACTORED(fmt) ((fmt) == Q4_0 || (fmt) == Q8_0)

/* One block as two vectors (elements 0..15, 16..31): for FACTORED formats the codes (q - 8 or q) and their
 * scale *d, else the weights. The 4-bit formats look their values up in a 16-entry table (vpermps reads only
 * the low 4 bits of each index): Q4_0's codes -8..7, Q4_1's weights fma(i, d, m) = d i + m, i = 0..15 (one
 * rounding of the exact d i + m: ggml's value). */
static inline __attribute__((always_inline)) void decode_block(const int fmt, const uint8_t *b, __m512 *lo,
                                                               __m512 *hi, __m512 *d) {
    if (fmt == F16) {
        *lo = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)b));
        *hi = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(b + 32)));
    } else if (fmt == Q8_0) {
        *d = broadcast_half(b);
        *lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 2))));
        *hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(b + 18))));
    } else {
        __m512 table;
        if (fmt == Q4_0) {
            *d = broadcast_half(b);
            table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
        } else {
            const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
            table = _mm512_fmadd_ps(iota, broadcast_half(b), broadcast_half(b + 2));
        }
        const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(b + (fmt == Q4_0 ? 2 : 4))));
        *lo = _mm512_permutexvar_ps(bytes, table);
        *hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), table);
    }
}

/* acc + the block's dot product with x's block (xlo, xhi). */
static inline __attribute__((always_inline)) __m512 block_dot(const int fmt, __m512 lo, __m512 hi, __m512 d,
                                                              __m512 xlo, __m512 xhi, __m512 acc) {
    if (FACTORED(fmt)) return _mm512_fmadd_ps(_mm512_fmadd_ps(hi, xhi, _mm512_mul_ps(lo, xlo)), d, acc);
    return _mm512_fmadd_ps(hi, xhi, _mm512_fmadd_ps(lo, xlo, acc));
}

/* y[i, o] for the rows `rows` (<= ROWS) of W starting at w and xrows (<= XROWS) rows of x: the tile's blocks are
 * decoded once and each used for every row of x. fmt and xrows are constants where this is inlined. */
static inline __attribute__((always_inline)) void tile_avx512(const int fmt, const int xrows, const uint8_t *w,
                                                              int64_t row_stride, int rows, int64_t nb,
                                                              const float *x, int64_t x_stride, float *y,
                                                              int64_t y_stride, const float *bias) {
    const int64_t bb = block_bytes(fmt);
    __m512 acc[ROWS][XROWS];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < XROWS; i++) acc[r][i] = _mm512_setzero_ps();
    if (rows == ROWS) {
        for (int64_t b = 0; b < nb; b++) {
            __m512 xlo[XROWS], xhi[XROWS];
            for (int i = 0; i < xrows; i++) {
                xlo[i] = _mm512_loadu_ps(x + i * x_stride + b * 32);
                xhi[i] = _mm512_loadu_ps(x + i * x_stride + b * 32 + 16);
            }
            for (int r = 0; r < ROWS; r++) {
                /* The same block of the next tile's rows (they follow this tile's): a model's weights stream
                 * from memory (they do not fit in L3), and with the hardware prefetcher alone the loop waits on
                 * them (measured: 1.5-2x slower over a 30-65 MB matrix without this line). */
                _mm_prefetch((const char *)(w + (ROWS + r) * row_stride + b * bb), _MM_HINT_T0);
                __m512 lo, hi, d;
                decode_block(fmt, w + r * row_stride + b * bb, &lo, &hi, &d);
                for (int i = 0; i < xrows; i++) acc[r][i] = block_dot(fmt, lo, hi, d, xlo[i], xhi[i], acc[r][i]);
            }
        }
    } else { /* the last, partial tile */
        for (int r = 0; r < rows; r++)
            for (int64_t b = 0; b < nb; b++) {
                __m512 lo, hi, d;
                decode_block(fmt, w + r * row_stride + b * bb, &lo, &hi, &d);
                for (int i = 0; i < xrows; i++) {
                    const float *xb = x + i * x_stride + b * 32;
                    acc[r][i] = block_dot(fmt, lo, hi, d, _mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16), acc[r][i]);
                }
            }
    }
    for (int i = 0; i < xrows; i++)
        for (int r = 0; r < rows; r++) y[i * y_stride + r] = _mm512_reduce_add_ps(acc[r][i]) + (bias ? bias[r] : 0.0f);
}

#define TILE_VECTOR tile_avx512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2 (no AVX-512: e.g. AMD EPYC before Zen 4): one block as four vectors of 8, decoded from bytes with integer
 * widening and converted, the 4-bit formats' values as fma(q, d, m) (Q4_1: ggml's value, one rounding) or codes
 * scaled per block (Q4_0, Q8_0), as tile_avx512 does with 16 lanes. */

#define FACTORED(fmt) ((fmt) == Q4_0 || (fmt) == Q8_0)

static inline __attribute__((always_inline)) __m256 nibbles8(__m128i bytes) {
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

static inline __attribute__((always_inline)) void decode_block8(const int fmt, const uint8_t *b, __m256 v[4],
                                                                __m256 *d) {
    if (fmt == F16) {
        for (int j = 0; j < 4; j++) v[j] = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + 16 * j)));
    } else if (fmt == Q8_0) {
        *d = _mm256_set1_ps(_cvtsh_ss(load_u16(b)));
        for (int j = 0; j < 4; j++)
            v[j] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(b + 2 + 8 * j))));
    } else {
        const __m128i raw = _mm_loadu_si128((const __m128i *)(b + (fmt == Q4_0 ? 2 : 4)));
        const __m128i low = _mm_and_si128(raw, _mm_set1_epi8(15));
        const __m128i high = _mm_and_si128(_mm_srli_epi16(raw, 4), _mm_set1_epi8(15));
        v[0] = nibbles8(low), v[1] = nibbles8(_mm_srli_si128(low, 8));
        v[2] = nibbles8(high), v[3] = nibbles8(_mm_srli_si128(high, 8));
        if (fmt == Q4_0) {
            *d = _mm256_set1_ps(_cvtsh_ss(load_u16(b)));
            for (int j = 0; j < 4; j++) v[j] = _mm256_sub_ps(v[j], _mm256_set1_ps(8.0f)); /* exact */
        } else {
            const __m256 scale = _mm256_set1_ps(_cvtsh_ss(load_u16(b))), min = _mm256_set1_ps(_cvtsh_ss(load_u16(b + 2)));
            for (int j = 0; j < 4; j++) v[j] = _mm256_fmadd_ps(v[j], scale, min);
        }
    }
}

static inline __attribute__((always_inline)) __m256 block_dot8(const int fmt, const __m256 v[4], __m256 d,
                                                               const float *x, __m256 acc) {
    if (FACTORED(fmt)) {
        __m256 t = _mm256_mul_ps(v[0], _mm256_loadu_ps(x));
        for (int j = 1; j < 4; j++) t = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(x + 8 * j), t);
        return _mm256_fmadd_ps(t, d, acc);
    }
    for (int j = 0; j < 4; j++) acc = _mm256_fmadd_ps(v[j], _mm256_loadu_ps(x + 8 * j), acc);
    return acc;
}

static inline __attribute__((always_inline)) void tile_avx2(const int fmt, const int xrows, const uint8_t *w,
                                                            int64_t row_stride, int rows, int64_t nb, const float *x,
                                                            int64_t x_stride, float *y, int64_t y_stride,
                                                            const float *bias) {
    const int64_t bb = block_bytes(fmt);
    __m256 acc[ROWS][XROWS];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < XROWS; i++) acc[r][i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < rows; r++) {
            _mm_prefetch((const char *)(w + (ROWS + r) * row_stride + b * bb), _MM_HINT_T0); /* see tile_avx512 */
            __m256 v[4], d = _mm256_setzero_ps();
            decode_block8(fmt, w + r * row_stride + b * bb, v, &d);
            for (int i = 0; i < xrows; i++) acc[r][i] = block_dot8(fmt, v, d, x + i * x_stride + b * 32, acc[r][i]);
        }
    for (int i = 0; i < xrows; i++)
        for (int r = 0; r < rows; r++) y[i * y_stride + r] = sum8(acc[r][i]) + (bias ? bias[r] : 0.0f);
}

#define TILE_VECTOR tile_avx2
#else
/* Portable C: each row of W decoded into a buffer that stays in L1, then one dot product per row of x. */
static void tile(int fmt, int xrows, const uint8_t *w, int64_t row_stride, int rows, int64_t nb, const float *x,
                 int64_t x_stride, float *y, int64_t y_stride, const float *bias) {
    const int64_t bb = block_bytes(fmt);
    float values[32];
    for (int r = 0; r < rows; r++) {
        float acc[XROWS][32] = {{0}};
        for (int64_t b = 0; b < nb; b++) {
            __builtin_prefetch(w + (rows + r) * row_stride + b * bb); /* the next tile's rows (see tile_avx512) */
            decode_block_c(fmt, w + r * row_stride + b * bb, values);
            for (int i = 0; i < xrows; i++) {
                const float *xb = x + i * x_stride + b * 32;
#pragma omp simd
                for (int j = 0; j < 32; j++) acc[i][j] += values[j] * xb[j];
            }
        }
        for (int i = 0; i < xrows; i++) {
            float sum = 0.0f;
            for (int j = 0; j < 32; j++) sum += acc[i][j];
            y[i * y_stride + r] = sum + (bias ? bias[r] : 0.0f);
        }
    }
}
#endif

#ifdef TILE_VECTOR
#define TILE_CASES(FMT)                                                                                           \
    switch (xrows) {                                                                                              \
    case 1: TILE_VECTOR(FMT, 1, w, row_stride, rows, nb, x, x_stride, y, y_stride, bias); return;                 \
    case 2: TILE_VECTOR(FMT, 2, w, row_stride, rows, nb, x, x_stride, y, y_stride, bias); return;                 \
    case 3: TILE_VECTOR(FMT, 3, w, row_stride, rows, nb, x, x_stride, y, y_stride, bias); return;                 \
    default: TILE_VECTOR(FMT, 4, w, row_stride, rows, nb, x, x_stride, y, y_stride, bias); return;                \
    }

/* The vector tile (tile_avx512 or tile_avx2) compiled for each format and count of x rows (16 loops with every
 * branch resolved). */
static void tile(int fmt, int xrows, const uint8_t *w, int64_t row_stride, int rows, int64_t nb, const float *x,
                 int64_t x_stride, float *y, int64_t y_stride, const float *bias) {
    switch (fmt) {
    case F16: TILE_CASES(F16)
    case Q4_0: TILE_CASES(Q4_0)
    case Q4_1: TILE_CASES(Q4_1)
    default: TILE_CASES(Q8_0)
    }
}
#endif

/* ---- 8-bit activations ----------------------------------------------------------------------------------------
 * x's row of k values as k / 32 blocks: codes q (int8, -127..127), scale d (fp32: ggml stores it as fp16, attnlab
 * keeps it exact) and the sum of the block's codes (for the 4-bit formats' offsets: Q4_0's -8, Q4_1's m). */
static void quantize_row_q8(const float *x, int64_t k, int8_t *q, float *d, int32_t *sums) {
    for (int64_t b = 0; b < k / 32; b++) {
        const float *xb = x + b * 32;
        float amax = 0.0f;
        for (int j = 0; j < 32; j++) amax = fmaxf(amax, fabsf(xb[j]));
        const float scale = amax / 127.0f;
        float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
        if (isinf(inverse)) inverse = 0.0f; /* a block below ~1e-36: all-zero codes, as attnlab.quant (_inverse) */
        int32_t sum = 0;
        for (int j = 0; j < 32; j++) { /* roundf: halves away from zero, as ggml's reference quantizer */
            const int v = (int)roundf(xb[j] * inverse);
            q[b * 32 + j] = (int8_t)v;
            sum += v;
        }
        d[b] = scale;
        sums[b] = sum;
    }
}

/* x (m, k) quantized row by row (quantize_row_q8) into q (m, k), d (m, k / 32), sums (m, k / 32). Returns 0, or -1
 * when k is not a multiple of 32. */
int attnlab_quantize_q8(const float *x, int64_t m, int64_t k, int8_t *q, float *d, int32_t *sums) {
    if (k % 32) return -1;
    for (int64_t i = 0; i < m; i++) quantize_row_q8(x + i * k, k, q + i * k, d + i * (k / 32), sums + i * (k / 32));
    return 0;
}

/* The integer sum over one block of the weight codes (Q8_0: q; Q4_0: q - 8; Q4_1: q) times x's codes, portable C.
 * Not vectorized by GCC: GCC 12.2 with -march=native on an AVX512-VNNI CPU turns the signed-by-signed byte products
 * of the Q8_0 loop into vpdpbusd, which reads one side as unsigned (wrong sums; seen here and tested). */
#if defined(__GNUC__) && !defined(__clang__)
__attribute__((optimize("no-tree-vectorize")))
#endif
static inline int32_t block_dot_q8_c(int fmt, const uint8_t *b, const int8_t *xq, int32_t xsum) {
    int32_t sum = 0;
    if (fmt == Q8_0) {
        for (int j = 0; j < 32; j++) sum += (int32_t)(int8_t)b[2 + j] * xq[j];
        return sum;
    }
    const uint8_t *nibbles = b + (fmt == Q4_0 ? 2 : 4);
    for (int j = 0; j < 16; j++) sum += (int32_t)(nibbles[j] & 15) * xq[j] + (int32_t)(nibbles[j] >> 4) * xq[j + 16];
    return fmt == Q4_0 ? sum - 8 * xsum : sum;
}

#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
/* A 4-bit block's 32 codes (0..15) as bytes in element order: byte j's low nibble is element j, its high one j + 16. */
static inline __m256i nibbles_q8(const uint8_t *p) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

/* y[i, o] for `rows` (<= ROWS) rows of W and xrows (<= XROWS) rows of x's codes: per block, the weights' bytes are
 * loaded once and each x row's products summed by vpdpbusd (unsigned by signed bytes: signed codes, Q8_0's and
 * Q4_0's q - 8, go in as |w| with x's codes given w's signs, so each lane sums true products: an offset summed
 * apart would cancel only after the lanes are added, and lose their precision), then converted and scaled by
 * d_w d_x into fp32 lanes; Q4_1's m d_x (sum of x's codes) is summed apart (its own term of the bound). */
static inline __attribute__((always_inline)) void tile_q8_avx512(const int fmt, const int xrows, const uint8_t *w,
                                                                 int64_t row_stride, int rows, int64_t nb,
                                                                 const int8_t *xq, const float *xd,
                                                                 const int32_t *xs, int64_t k, float *y,
                                                                 int64_t y_stride, const float *bias) {
    const int64_t bb = block_bytes(fmt);
    __m256 acc[ROWS][XROWS];
    float mins[ROWS][XROWS];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < XROWS; i++) {
            acc[r][i] = _mm256_setzero_ps();
            mins[r][i] = 0.0f;
        }
    for (int64_t b = 0; b < nb; b++) /* block by block over the tile's rows: ROWS independent sums per row of x */
        for (int r = 0; r < (rows == ROWS ? ROWS : rows); r++) {
            const uint8_t *blk = w + r * row_stride + b * bb;
            _mm_prefetch((const char *)(blk + ROWS * row_stride), _MM_HINT_T0); /* the next tile's (tile_avx512) */
            const float dw = half_to_float(load_u16(blk));
            if (fmt != Q4_1) { /* signed codes: Q8_0's, Q4_0's q - 8 */
                const __m256i codes = fmt == Q8_0 ? _mm256_loadu_si256((const __m256i *)(blk + 2))
                                                  : _mm256_sub_epi8(nibbles_q8(blk + 2), _mm256_set1_epi8(8));
                const __m256i magnitude = _mm256_abs_epi8(codes);
                for (int i = 0; i < xrows; i++) {
                    const __m256i x8 = _mm256_loadu_si256((const __m256i *)(xq + i * k + b * 32));
                    const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), magnitude,
                                                            _mm256_sign_epi8(x8, codes));
                    acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * xd[i * nb + b]),
                                                acc[r][i]);
                }
            } else { /* Q4_1: codes 0..15, the block's m d_x (sum of x's codes) summed apart */
                const __m256i codes = nibbles_q8(blk + 4);
                const float mw = half_to_float(load_u16(blk + 2));
                for (int i = 0; i < xrows; i++) {
                    const __m256i x8 = _mm256_loadu_si256((const __m256i *)(xq + i * k + b * 32));
                    const __m256i dot = _mm256_dpbusd_epi32(_mm256_setzero_si256(), codes, x8);
                    acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * xd[i * nb + b]),
                                                acc[r][i]);
                    mins[r][i] += mw * (xd[i * nb + b] * (float)xs[i * nb + b]);
                }
            }
        }
    for (int i = 0; i < xrows; i++)
        for (int r = 0; r < rows; r++) {
            const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc[r][i]), _mm256_extractf128_ps(acc[r][i], 1));
            const __m128 quarter = _mm_add_ps(half, _mm_movehl_ps(half, half));
            const float sum = _mm_cvtss_f32(_mm_add_ss(quarter, _mm_movehdup_ps(quarter)));
            y[i * y_stride + r] = sum + mins[r][i] + (bias ? bias[r] : 0.0f);
        }
}

#define TILE_Q8_VECTOR tile_q8_avx512
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* AVX2: as tile_q8_avx512, the byte products summed by vpmaddubsw (unsigned by signed bytes, pairs to int16: at most
 * 2 x 128 x 127, no saturation) then vpmaddwd by ones (to int32): the same integer sums per block. */
static inline __m256i nibbles_q8(const uint8_t *p) {
    const __m128i raw = _mm_loadu_si128((const __m128i *)p);
    const __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
    return _mm256_and_si256(both, _mm256_set1_epi8(15));
}

static inline __m256i dot_bytes(__m256i unsigned_bytes, __m256i signed_bytes) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(unsigned_bytes, signed_bytes), _mm256_set1_epi16(1));
}

static inline __attribute__((always_inline)) void tile_q8_avx2(const int fmt, const int xrows, const uint8_t *w,
                                                               int64_t row_stride, int rows, int64_t nb,
                                                               const int8_t *xq, const float *xd, const int32_t *xs,
                                                               int64_t k, float *y, int64_t y_stride,
                                                               const float *bias) {
    const int64_t bb = block_bytes(fmt);
    __m256 acc[ROWS][XROWS];
    float mins[ROWS][XROWS];
    for (int r = 0; r < ROWS; r++)
        for (int i = 0; i < XROWS; i++) acc[r][i] = _mm256_setzero_ps(), mins[r][i] = 0.0f;
    for (int64_t b = 0; b < nb; b++)
        for (int r = 0; r < rows; r++) {
            const uint8_t *blk = w + r * row_stride + b * bb;
            _mm_prefetch((const char *)(blk + ROWS * row_stride), _MM_HINT_T0);
            const float dw = _cvtsh_ss(load_u16(blk));
            if (fmt != Q4_1) {
                const __m256i codes = fmt == Q8_0 ? _mm256_loadu_si256((const __m256i *)(blk + 2))
                                                  : _mm256_sub_epi8(nibbles_q8(blk + 2), _mm256_set1_epi8(8));
                const __m256i magnitude = _mm256_abs_epi8(codes);
                for (int i = 0; i < xrows; i++) {
                    const __m256i x8 = _mm256_loadu_si256((const __m256i *)(xq + i * k + b * 32));
                    const __m256i dot = dot_bytes(magnitude, _mm256_sign_epi8(x8, codes));
                    acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(dw * xd[i * nb + b]),
                                                acc[r][i]);
                }
            } else {
                const __m256i codes = nibbles_q8(blk + 4);
                const float mw = _cvtsh_ss(load_u16(blk + 2));
                for (int i = 0; i < xrows; i++) {
                    const __m256i x8 = _mm256_loadu_si256((const __m256i *)(xq + i * k + b * 32));
                    acc[r][i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot_bytes(codes, x8)),
                                                _mm256_set1_ps(dw * xd[i * nb + b]), acc[r][i]);
                    mins[r][i] += mw * (xd[i * nb + b] * (float)xs[i * nb + b]);
                }
            }
        }
    for (int i = 0; i < xrows; i++)
        for (int r = 0; r < rows; r++) y[i * y_stride + r] = sum8(acc[r][i]) + mins[r][i] + (bias ? bias[r] : 0.0f);
}

#define TILE_Q8_VECTOR tile_q8_avx2
#else
/* Portable C: the same integer sums per block, scaled by d_w d_x (and Q4_1's m d_x sum). */
static void tile_q8(int fmt, int xrows, const uint8_t *w, int64_t row_stride, int rows, int64_t nb, const int8_t *xq,
                    const float *xd, const int32_t *xs, int64_t k, float *y, int64_t y_stride, const float *bias) {
    const int64_t bb = block_bytes(fmt);
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < xrows; i++) {
            float sum = 0.0f, mins = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t *blk = w + r * row_stride + b * bb;
                const int32_t dot = block_dot_q8_c(fmt, blk, xq + i * k + b * 32, xs[i * nb + b]);
                sum += (float)dot * (half_to_float(load_u16(blk)) * xd[i * nb + b]);
                if (fmt == Q4_1) mins += half_to_float(load_u16(blk + 2)) * (xd[i * nb + b] * (float)xs[i * nb + b]);
            }
            y[i * y_stride + r] = sum + mins + (bias ? bias[r] : 0.0f);
        }
}
#endif

#ifdef TILE_Q8_VECTOR
#define TILE_Q8_CASES(FMT)                                                                                        \
    switch (xrows) {                                                                                              \
    case 1: TILE_Q8_VECTOR(FMT, 1, w, row_stride, rows, nb, xq, xd, xs, k, y, y_stride, bias); return;            \
    case 2: TILE_Q8_VECTOR(FMT, 2, w, row_stride, rows, nb, xq, xd, xs, k, y, y_stride, bias); return;            \
    case 3: TILE_Q8_VECTOR(FMT, 3, w, row_stride, rows, nb, xq, xd, xs, k, y, y_stride, bias); return;            \
    default: TILE_Q8_VECTOR(FMT, 4, w, row_stride, rows, nb, xq, xd, xs, k, y, y_stride, bias); return;           \
    }

/* The vector q8 tile (tile_q8_avx512 or tile_q8_avx2) compiled for each format and count of x rows. */
static void tile_q8(int fmt, int xrows, const uint8_t *w, int64_t row_stride, int rows, int64_t nb, const int8_t *xq,
                    const float *xd, const int32_t *xs, int64_t k, float *y, int64_t y_stride, const float *bias) {
    switch (fmt) {
    case Q4_0: TILE_Q8_CASES(Q4_0)
    case Q4_1: TILE_Q8_CASES(Q4_1)
    default: TILE_Q8_CASES(Q8_0)
    }
}
#endif

/* The integer sum of one block (block_dot_q8_c), for tests of the vector kernel: W's block `b` of row `r`. */
int32_t attnlab_block_dot_q8(int fmt, const uint8_t *block, const int8_t *xq, int32_t xsum) {
    return block_dot_q8_c(fmt, block, xq, xsum);
}

/* x (m, k) quantized by attnlab_quantize_q8 into buffers the caller frees: 0, or -2 when out of memory. */
static int quantized_x(const float *x, int64_t m, int64_t k, int8_t **xq, float **xd, int32_t **xs) {
    const int64_t nb = k / 32;
    *xq = malloc((size_t)(m * k) + 1);
    *xd = malloc(sizeof(float) * (size_t)(m * nb) + 1);
    *xs = malloc(sizeof(int32_t) * (size_t)(m * nb) + 1);
    if (!*xq || !*xd || !*xs) {
        free(*xq), free(*xd), free(*xs);
        return -2;
    }
    attnlab_quantize_q8(x, m, k, *xq, *xd, *xs);
    return 0;
}

/* y (m, n) = x (m, k) W^T + bias with x quantized to 8 bits first (see the top of this file): Q4_0, Q4_1, Q8_0.
 * Returns 0, -1 for a format without codes (F16) or a k that is not a multiple of 32, -2 when out of memory. */
int attnlab_qmatmul_q8(int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                       const float *bias) {
    if (fmt == F16 || !block_bytes(fmt) || k % 32) return -1;
    const int64_t nb = k / 32, row_stride = nb * block_bytes(fmt), tiles = (n + ROWS - 1) / ROWS;
    int8_t *xq;
    float *xd;
    int32_t *xs;
    if (quantized_x(x, m, k, &xq, &xd, &xs)) return -2;
#pragma omp parallel for schedule(dynamic, CHUNK) if (n * k >= PARALLEL_MIN)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t first = t * ROWS;
        const int rows = (int)(n - first < ROWS ? n - first : ROWS);
        for (int64_t i = 0; i < m; i += XROWS)
            tile_q8(fmt, (int)(m - i < XROWS ? m - i : XROWS), w + first * row_stride, row_stride, rows, nb,
                    xq + i * k, xd + i * nb, xs + i * nb, k, y + i * n + first, n, bias ? bias + first : NULL);
    }
    free(xq), free(xd), free(xs);
    return 0;
}

/* y (m, n) = x (m, k) W^T + bias, W (n, k) in format fmt, k % 32 == 0; x and y contiguous, bias NULL or n floats.
 * (Few arguments: each costs ctypes a conversion, and a decode step makes about 120 calls.) Returns 0, or -1 for an
 * unknown format or a k that is not a multiple of 32. */
int attnlab_qmatmul(int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                    const float *bias) {
    if (!block_bytes(fmt) || k % 32) return -1;
    const int64_t nb = k / 32, row_stride = nb * block_bytes(fmt), tiles = (n + ROWS - 1) / ROWS;
#pragma omp parallel for schedule(dynamic, CHUNK) if (n * k >= PARALLEL_MIN)
    for (int64_t t = 0; t < tiles; t++) {
        const int64_t first = t * ROWS;
        const int rows = (int)(n - first < ROWS ? n - first : ROWS);
        for (int64_t i = 0; i < m; i += XROWS) /* the tile stays in L1 for every row group of x after the first */
            tile(fmt, (int)(m - i < XROWS ? m - i : XROWS), w + first * row_stride, row_stride, rows, nb, x + i * k,
                 k, y + i * n + first, n, bias ? bias + first : NULL);
    }
    return 0;
}

/* out (n, k) = W (n, k) in format fmt as fp32, ggml's values. Returns 0, or -1 as attnlab_qmatmul. */
int attnlab_dequantize(int fmt, const uint8_t *w, int64_t n, int64_t k, float *out) {
    if (!block_bytes(fmt) || k % 32) return -1;
    const int64_t nb = k / 32, row_stride = nb * block_bytes(fmt);
#pragma omp parallel for schedule(static) if (n * k >= 4 * PARALLEL_MIN)
    for (int64_t r = 0; r < n; r++) {
        const uint8_t *row = w + r * row_stride;
        float *o = out + r * k;
        for (int64_t b = 0; b < nb; b++) {
#if defined(__AVX512F__)
            __m512 lo, hi, d = _mm512_set1_ps(1.0f);
            switch (fmt) {
            case F16: decode_block(F16, row + b * 64, &lo, &hi, &d); break;
            case Q4_0: decode_block(Q4_0, row + b * 18, &lo, &hi, &d); break;
            case Q4_1: decode_block(Q4_1, row + b * 20, &lo, &hi, &d); break;
            default: decode_block(Q8_0, row + b * 34, &lo, &hi, &d);
            }
            _mm512_storeu_ps(o + b * 32, _mm512_mul_ps(lo, d)); /* exact: 8 bits of code by 11 of scale */
            _mm512_storeu_ps(o + b * 32 + 16, _mm512_mul_ps(hi, d));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
            __m256 v[4], d = _mm256_set1_ps(1.0f);
            switch (fmt) {
            case F16: decode_block8(F16, row + b * 64, v, &d); break;
            case Q4_0: decode_block8(Q4_0, row + b * 18, v, &d); break;
            case Q4_1: decode_block8(Q4_1, row + b * 20, v, &d); break;
            default: decode_block8(Q8_0, row + b * 34, v, &d);
            }
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(o + b * 32 + 8 * j, _mm256_mul_ps(v[j], d)); /* exact */
#else
            decode_block_c(fmt, row + b * block_bytes(fmt), o + b * 32);
#endif
        }
    }
    return 0;
}

/* ---- 8-bit activations over rows interleaved by 16 ("packed") ----------------------------------------------------
 * attnlab_qmatmul_q8 reads W row by row and decodes each block's codes for one row at a time: about 12 vector
 * instructions per 32 weights, which bind it at 10-13 G weights/s on one core, far below what memory gives. Packed,
 * W's rows go in groups of 16, and each block of a group holds the 16 rows' scales side by side, then their codes
 * interleaved 4 bytes at a time, so that one 64-byte load holds 4 bytes of each of the 16 rows: one vpdpbusd then
 * multiplies 4 codes of every row by the same 4 codes of x (broadcast) and sums them into that row's lane. The
 * products and their integer sums per block are attnlab_qmatmul_q8's; only the float sums over blocks are taken in
 * another order. The packed tensor has the rows' own size (16 rows x bb bytes per block, bb the format's block):
 *   Q4_0  d[16] fp16, then 4 chunks c of 64 bytes: row r's nibble bytes 4c..4c+3 at 64c + 4r   (16 x 18 bytes)
 *   Q4_1  d[16], m[16] fp16, then the same 4 chunks                                              (16 x 20 bytes)
 *   Q8_0  d[16] fp16, then 8 chunks: row r's codes 4c..4c+3 plus 128 (unsigned) at 64c + 4r      (16 x 34 bytes)
 * A nibble byte j holds codes j (low) and j + 16 (high), so chunk c's low nibbles are codes 4c..4c+3 of each row
 * and its high nibbles codes 16 + 4c..16 + 4c + 3. Group g's block b starts at g 16 row_bytes + b 16 bb. */
#define PACK 16
#ifndef PACK_AHEAD
#define PACK_AHEAD 16 /* blocks: 4.6-8.7 KB ahead (one prefetch per line: a block is 4.5-8.5 lines) */
#endif
#ifndef PACK_HINT
#define PACK_HINT _MM_HINT_T0
#endif

/* Whether this build multiplies packed rows with vector instructions (AVX-512 VNNI, or AVX2); the portable loops otherwise
 * (they give the same integer sums, slowly: attnlab packs weights only where this is 1). */
int attnlab_packed_q8_fast(void) {
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
    return 1;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return 1;
#else
    return 0;
#endif
}

/* W (n, k) in fmt (Q4_0, Q4_1, Q8_0), n % 16 == 0, k % 32 == 0 -> out (same bytes) packed as above. Returns 0, or -1
 * for another format or shape. */
int attnlab_pack_q8(int fmt, const uint8_t *w, int64_t n, int64_t k, uint8_t *out) {
    if (fmt == F16 || !block_bytes(fmt) || k % 32 || n % PACK) return -1;
    const int64_t bb = block_bytes(fmt), nb = k / 32, row_stride = nb * bb;
    const int scales = fmt == Q4_1 ? 2 : 1, code_bytes = fmt == Q8_0 ? 32 : 16;
    for (int64_t g = 0; g < n / PACK; g++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t *dst = out + g * PACK * row_stride + b * PACK * bb;
            for (int r = 0; r < PACK; r++) {
                const uint8_t *src = w + (g * PACK + r) * row_stride + b * bb;
                for (int s = 0; s < scales; s++) memcpy(dst + 2 * (s * PACK + r), src + 2 * s, 2);
                const uint8_t *codes = src + 2 * scales;
                uint8_t *chunks = dst + 2 * scales * PACK;
                for (int j = 0; j < code_bytes; j++)
                    chunks[(j / 4) * 64 + 4 * r + j % 4] = fmt == Q8_0 ? (uint8_t)(codes[j] ^ 0x80) : codes[j];
            }
        }
    return 0;
}

/* y[o] for the 16 rows of one packed group and one row of x's codes (xq, with its scales xd and code sums xs per
 * block): y[o] = sum over blocks of d_w d_x (integer dot) (+ Q4_1: m_w d_x (sum of x's codes)). */
static inline __attribute__((always_inline)) void group_q8(const int fmt, const uint8_t *group, int64_t nb,
                                                           const int8_t *xq, const float *xd, const int32_t *xs,
                                                           float *y, const float *bias) {
    const int64_t bb = block_bytes(fmt);
    const int scales = fmt == Q4_1 ? 2 : 1;
#if defined(__AVX512F__) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512 acc = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = group + b * PACK * bb, *chunks = p + 2 * scales * PACK;
        const int32_t *x4 = (const int32_t *)(xq + b * 32); /* x's codes 4 at a time */
        for (int64_t line = 0; line < PACK * bb; line += 64) /* every line of the block PACK_AHEAD blocks on */
            _mm_prefetch((const char *)(p + PACK_AHEAD * PACK * bb + line), PACK_HINT);
        __m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
        int32_t offset;
        if (fmt == Q8_0) {
            for (int c = 0; c < 8; c += 2) {
                s0 = _mm512_dpbusd_epi32(s0, _mm512_loadu_si512(chunks + 64 * c), _mm512_set1_epi32(x4[c]));
                s1 = _mm512_dpbusd_epi32(s1, _mm512_loadu_si512(chunks + 64 * c + 64), _mm512_set1_epi32(x4[c + 1]));
            }
            offset = 128 * xs[b]; /* the codes went in plus 128 */
        } else {
            for (int c = 0; c < 4; c++) {
                const __m512i raw = _mm512_loadu_si512(chunks + 64 * c);
                s0 = _mm512_dpbusd_epi32(s0, _mm512_and_si512(raw, low), _mm512_set1_epi32(x4[c]));
                s1 = _mm512_dpbusd_epi32(s1, _mm512_and_si512(_mm512_srli_epi16(raw, 4), low), _mm512_set1_epi32(x4[4 + c]));
            }
            offset = fmt == Q4_0 ? 8 * xs[b] : 0; /* Q4_0's codes are q - 8 */
        }
        const __m512i dot = _mm512_sub_epi32(_mm512_add_epi32(s0, s1), _mm512_set1_epi32(offset));
        const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_set1_ps(xd[b])), acc);
        if (fmt == Q4_1) {
            const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(p + 2 * PACK)));
            acc = _mm512_fmadd_ps(m, _mm512_set1_ps(xd[b] * (float)xs[b]), acc);
        }
    }
    if (bias) acc = _mm512_add_ps(acc, _mm512_loadu_ps(bias));
    _mm512_storeu_ps(y, acc);
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    /* AVX2 without VNNI: a 64-byte chunk line as two vectors of 8 rows each. vpmaddubsw multiplies 4 codes of 8 rows
     * by x's 4 codes (broadcast) and sums them in pairs to int16, vpmaddwd by ones sums the pairs into the row's
     * int32 lane: the same integer sums per block as the VNNI path. 4-bit codes (0..15) times x's (|q| <= 127): a
     * pair is at most 3,810, so the 8 pairs of a block's 4 chunks (low and high nibbles) sum in int16 (<= 30,480)
     * before one vpmaddwd. Q8_0's codes go back to signed (xor 128) and multiply as |w| by x given w's sign
     * (pairs <= 32,512), each chunk widened to int32 at once. */
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = group + b * PACK * bb, *chunks = p + 2 * scales * PACK;
        const int32_t *x4 = (const int32_t *)(xq + b * 32);
        for (int64_t line = 0; line < PACK * bb; line += 64)
            _mm_prefetch((const char *)(p + PACK_AHEAD * PACK * bb + line), PACK_HINT);
        __m256i s0, s1;
        if (fmt == Q8_0) {
            const __m256i flip = _mm256_set1_epi8((char)0x80);
            s0 = _mm256_setzero_si256(), s1 = _mm256_setzero_si256();
            for (int c = 0; c < 8; c++) {
                const __m256i xb = _mm256_set1_epi32(x4[c]);
                const __m256i w0 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(chunks + 64 * c)), flip);
                const __m256i w1 = _mm256_xor_si256(_mm256_loadu_si256((const __m256i *)(chunks + 64 * c + 32)), flip);
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w0),
                                                                                  _mm256_sign_epi8(xb, w0)), ones));
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(w1),
                                                                                  _mm256_sign_epi8(xb, w1)), ones));
            }
        } else {
            __m256i h0 = _mm256_setzero_si256(), h1 = _mm256_setzero_si256();
            for (int c = 0; c < 4; c++) {
                const __m256i xl = _mm256_set1_epi32(x4[c]), xh = _mm256_set1_epi32(x4[4 + c]);
                const __m256i r0 = _mm256_loadu_si256((const __m256i *)(chunks + 64 * c));
                const __m256i r1 = _mm256_loadu_si256((const __m256i *)(chunks + 64 * c + 32));
                h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(_mm256_and_si256(r0, low), xl));
                h0 = _mm256_add_epi16(h0, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(r0, 4), low), xh));
                h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(_mm256_and_si256(r1, low), xl));
                h1 = _mm256_add_epi16(h1, _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(r1, 4), low), xh));
            }
            s0 = _mm256_madd_epi16(h0, ones), s1 = _mm256_madd_epi16(h1, ones);
            if (fmt == Q4_0) { /* Q4_0's codes are q - 8 */
                const __m256i offset = _mm256_set1_epi32(8 * xs[b]);
                s0 = _mm256_sub_epi32(s0, offset), s1 = _mm256_sub_epi32(s1, offset);
            }
        }
        const __m256 dx = _mm256_set1_ps(xd[b]);
        const __m256 d0 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
        const __m256 d1 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 16)));
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s0), _mm256_mul_ps(d0, dx), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s1), _mm256_mul_ps(d1, dx), acc1);
        if (fmt == Q4_1) {
            const __m256 mx = _mm256_set1_ps(xd[b] * (float)xs[b]);
            acc0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * PACK))), mx, acc0);
            acc1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(p + 2 * PACK + 16))), mx, acc1);
        }
    }
    if (bias) acc0 = _mm256_add_ps(acc0, _mm256_loadu_ps(bias)), acc1 = _mm256_add_ps(acc1, _mm256_loadu_ps(bias + 8));
    _mm256_storeu_ps(y, acc0);
    _mm256_storeu_ps(y + 8, acc1);
#else
    float acc[PACK] = {0};
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *p = group + b * PACK * bb, *chunks = p + 2 * scales * PACK;
        for (int r = 0; r < PACK; r++) {
            int32_t dot = 0;
            if (fmt == Q8_0) {
                for (int j = 0; j < 32; j++) dot += ((int32_t)chunks[(j / 4) * 64 + 4 * r + j % 4] - 128) * xq[b * 32 + j];
            } else {
                for (int j = 0; j < 16; j++) {
                    const uint8_t byte = chunks[(j / 4) * 64 + 4 * r + j % 4];
                    dot += (int32_t)(byte & 15) * xq[b * 32 + j] + (int32_t)(byte >> 4) * xq[b * 32 + j + 16];
                }
                if (fmt == Q4_0) dot -= 8 * xs[b];
            }
            acc[r] += (float)dot * (half_to_float(load_u16(p + 2 * r)) * xd[b]);
            if (fmt == Q4_1) acc[r] += half_to_float(load_u16(p + 2 * (PACK + r))) * (xd[b] * (float)xs[b]);
        }
    }
    for (int r = 0; r < PACK; r++) y[r] = acc[r] + (bias ? bias[r] : 0.0f);
#endif
}

/* y (m, n) = x (m, k) W^T + bias, W packed by attnlab_pack_q8, x quantized to 8 bits first (attnlab_qmatmul_q8's
 * codes). Returns 0, -1 for another format or shape, -2 when out of memory. */
int attnlab_qmatmul_q8p(int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x, int64_t m, float *y,
                        const float *bias) {
    if (fmt == F16 || !block_bytes(fmt) || k % 32 || n % PACK) return -1;
    const int64_t nb = k / 32, group_bytes = PACK * nb * block_bytes(fmt), groups = n / PACK;
    int8_t *xq;
    float *xd;
    int32_t *xs;
    if (quantized_x(x, m, k, &xq, &xd, &xs)) return -2;
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN)
    for (int64_t g = 0; g < groups; g++)
        for (int64_t i = 0; i < m; i++) {
            const uint8_t *group = w + g * group_bytes;
            const int8_t *q = xq + i * k;
            const float *d = xd + i * nb, *b = bias ? bias + g * PACK : NULL;
            const int32_t *s = xs + i * nb;
            float *out = y + i * n + g * PACK;
            switch (fmt) {
            case Q4_0: group_q8(Q4_0, group, nb, q, d, s, out, b); break;
            case Q4_1: group_q8(Q4_1, group, nb, q, d, s, out, b); break;
            default: group_q8(Q8_0, group, nb, q, d, s, out, b);
            }
        }
    free(xq), free(xd), free(xs);
    return 0;
}
