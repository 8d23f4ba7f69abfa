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
 *
 * Built by attnlab.kernels.cpu.build with the system C compiler; with OpenMP, the calls share the threads of
 * PyTorch's OpenMP runtime (torch.set_num_threads), sharing the rows of W out among them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fp16.h"

enum { F16 = 1, Q4_0 = 2, Q4_1 = 3, Q8_0 = 8 };

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

#define TILE_CASES(FMT)                                                                                           \
    switch (xrows) {                                                                                              \
    case 1: tile_avx512(FMT, 1, w, row_stride, rows, nb, x, x_stride, y, y_stride, bias); return;                 \
    case 2: tile_avx512(FMT, 2, w, row_stride, rows, nb, x, x_stride, y, y_stride, bias); return;                 \
    case 3: tile_avx512(FMT, 3, w, row_stride, rows, nb, x, x_stride, y, y_stride, bias); return;                 \
    default: tile_avx512(FMT, 4, w, row_stride, rows, nb, x, x_stride, y, y_stride, bias); return;                \
    }

/* tile_avx512 compiled for each format and count of x rows (16 loops with every branch resolved). */
static void tile(int fmt, int xrows, const uint8_t *w, int64_t row_stride, int rows, int64_t nb, const float *x,
                 int64_t x_stride, float *y, int64_t y_stride, const float *bias) {
    switch (fmt) {
    case F16: TILE_CASES(F16)
    case Q4_0: TILE_CASES(Q4_0)
    case Q4_1: TILE_CASES(Q4_1)
    default: TILE_CASES(Q8_0)
    }
}
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
#else
            decode_block_c(fmt, row + b * block_bytes(fmt), o + b * 32);
#endif
        }
    }
    return 0;
}
