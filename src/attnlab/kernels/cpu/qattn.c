/* Decode attention over quantized KV rows, for attnlab.cache.quantized (CPU, one query per head).
 *
 * Rows are a token's values over all KV heads, H_kv * d, in one of the cache's storage formats:
 *   0 fp32, 1 fp16, 2 bf16 (the row's bytes), 3 q8_0, 4 q4_0, 5 nf4 (ggml blocks of 32 values: quants
 *   (n, nb, 32 | 16) and fp16 scales (n, nb, 2) in two arrays, as the cache stores them).
 * Rows are decoded a few at a time into a small float buffer that stays in L1 and used at once: the cache
 * is read in its stored width and no full-precision copy of it is written.
 *
 *   attnlab_scores: s[b, h, t] (+)= sum_i q[b, h, i] * K[b, t, h / G, i]      (h: query head, G = H / H_kv)
 *   attnlab_wsum:   o[b, h, i]  += sum_t p[b, h, t] * V[b, t, h / G, i]
 *
 *   attnlab_softmax:  s[b, h, :] = softmax(scale * s[b, h, :]), in place
 *   attnlab_attend:   the three above over several runs of rows (stored blocks, the residual window, the new row)
 *   attnlab_quantize: rows of floats -> q8_0 / q4_0 / nf4 blocks, byte for byte what attnlab.quant.quantize
 *                     (and ggml) writes; built with -ffp-contract=off so its two-rounding steps stay two.
 *
 * Decoded values are exactly those of attnlab.quant.dequantize (fp16 scale times the code, in fp32); only the
 * order of the sums differs from a matmul (and with the number of threads). Built by attnlab.kernels.cpu with the
 * system C compiler; with OpenMP, the calls share the threads of PyTorch's OpenMP runtime (torch.set_num_threads).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#define TILE 16        /* rows decoded together */
#define PARALLEL_MIN 65536 /* values read below which a call stays on one thread (OpenMP, when built with it) */

static const float NF4[16] = {
    -1.0f, -0.6961928009986877f, -0.5250730514526367f, -0.39491748809814453f, -0.28444138169288635f,
    -0.18477343022823334f, -0.09105003625154495f, 0.0f, 0.07958029955625534f, 0.16093020141124725f,
    0.24611230194568634f, 0.33791524171829224f, 0.44070982933044434f, 0.5626170039176941f,
    0.7229568362236023f, 1.0f};

#include "fp16.h"

static inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Row t of a segment (width values) as floats: a pointer into the segment for fp32, else decoded into buf
 * (portable C; row_values below uses AVX-512 where the machine has it). */
static inline const float *row_values_c(int fmt, const uint8_t *quants, const uint8_t *scales, int64_t t,
                                      int64_t width, float *restrict buf) {
    const int64_t nb = width / 32;
    switch (fmt) {
    case 0:
        return (const float *)(quants + t * width * 4);
    case 1: {
        const uint16_t *row = (const uint16_t *)(quants + t * width * 2);
        for (int64_t i = 0; i < width; i++) buf[i] = half_to_float(row[i]);
        return buf;
    }
    case 2: {
        const uint16_t *row = (const uint16_t *)(quants + t * width * 2);
#pragma omp simd
        for (int64_t i = 0; i < width; i++) buf[i] = bf16_to_float(row[i]);
        return buf;
    }
    case 3: {
        const int8_t *row = (const int8_t *)(quants + t * nb * 32);
        const uint16_t *scale = (const uint16_t *)(scales + t * nb * 2);
        for (int64_t b = 0; b < nb; b++) {
            const float d = half_to_float(scale[b]);
            const int8_t *qs = row + b * 32;
            float *restrict out = buf + b * 32;
#pragma omp simd
            for (int i = 0; i < 32; i++) out[i] = d * (float)qs[i];
        }
        return buf;
    }
    default: { /* 4 q4_0, 5 nf4: byte j holds element j (low nibble) and j + 16 (high nibble) */
        const uint8_t *row = quants + t * nb * 16;
        const uint16_t *scale = (const uint16_t *)(scales + t * nb * 2);
        for (int64_t b = 0; b < nb; b++) {
            const float d = half_to_float(scale[b]);
            const uint8_t *qs = row + b * 16;
            float *restrict out = buf + b * 32;
            if (fmt == 4) {
                for (int i = 0; i < 16; i++) {
                    out[i] = d * (float)((int)(qs[i] & 15) - 8);
                    out[i + 16] = d * (float)((int)(qs[i] >> 4) - 8);
                }
            } else {
                for (int i = 0; i < 16; i++) {
                    out[i] = d * NF4[qs[i] & 15];
                    out[i + 16] = d * NF4[qs[i] >> 4];
                }
            }
        }
        return buf;
    }
    }
}


#if defined(__AVX512F__)
/* row_values_c with AVX-512 for the block formats and for fp16 / bf16 rows of whole vectors; a ragged fp16 / bf16
 * row goes to the portable code. */
static inline const float *row_values(int fmt, const uint8_t *quants, const uint8_t *scales, int64_t t,
                                      int64_t width, float *restrict buf) {
    const int64_t nb = width / 32;
    switch (fmt) {
    case 0:
        return (const float *)(quants + t * width * 4);
    case 1:
    case 2: {
        if (width % 16) break;
        const uint16_t *row = (const uint16_t *)(quants + t * width * 2);
        for (int64_t i = 0; i < width; i += 16) {
            const __m256i h = _mm256_loadu_si256((const __m256i *)(row + i));
            const __m512 v = fmt == 1 ? _mm512_cvtph_ps(h)
                                      : _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            _mm512_storeu_ps(buf + i, v);
        }
        return buf;
    }
    case 3: {
        const int8_t *row = (const int8_t *)(quants + t * nb * 32);
        const uint16_t *scale = (const uint16_t *)(scales + t * nb * 2);
        for (int64_t b = 0; b < nb; b++) {
            const __m512 d = _mm512_set1_ps(half_to_float(scale[b]));
            const __m256i qs = _mm256_loadu_si256((const __m256i *)(row + b * 32));
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(qs)));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(qs, 1)));
            _mm512_storeu_ps(buf + b * 32, _mm512_mul_ps(d, lo));
            _mm512_storeu_ps(buf + b * 32 + 16, _mm512_mul_ps(d, hi));
        }
        return buf;
    }
    case 4:
    case 5: {
        const uint8_t *row = quants + t * nb * 16;
        const uint16_t *scale = (const uint16_t *)(scales + t * nb * 2);
        const __m512i mask = _mm512_set1_epi32(15), eight = _mm512_set1_epi32(8);
        const __m512 table = _mm512_loadu_ps(NF4);
        for (int64_t b = 0; b < nb; b++) {
            const __m512 d = _mm512_set1_ps(half_to_float(scale[b]));
            const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(row + b * 16)));
            const __m512i lo = _mm512_and_si512(bytes, mask), hi = _mm512_srli_epi32(bytes, 4);
            const __m512 vlo = fmt == 4 ? _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, eight)) : _mm512_permutexvar_ps(lo, table);
            const __m512 vhi = fmt == 4 ? _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, eight)) : _mm512_permutexvar_ps(hi, table);
            _mm512_storeu_ps(buf + b * 32, _mm512_mul_ps(d, vlo));
            _mm512_storeu_ps(buf + b * 32 + 16, _mm512_mul_ps(d, vhi));
        }
        return buf;
    }
    }
    return row_values_c(fmt, quants, scales, t, width, buf);
}
#elif defined(__AVX2__) && defined(__F16C__)
/* row_values_c with AVX2 (vectors of 8) for fp16 / bf16 rows of whole vectors, q8_0 and q4_0; nf4 and a ragged
 * fp16 / bf16 row go to the portable code. The same values: fp16 scale times the code, in fp32. */
static inline const float *row_values(int fmt, const uint8_t *quants, const uint8_t *scales, int64_t t,
                                      int64_t width, float *restrict buf) {
    const int64_t nb = width / 32;
    switch (fmt) {
    case 0:
        return (const float *)(quants + t * width * 4);
    case 1:
    case 2: {
        if (width % 8) break;
        const uint16_t *row = (const uint16_t *)(quants + t * width * 2);
        for (int64_t i = 0; i < width; i += 8) {
            const __m128i h = _mm_loadu_si128((const __m128i *)(row + i));
            const __m256 v = fmt == 1 ? _mm256_cvtph_ps(h)
                                      : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            _mm256_storeu_ps(buf + i, v);
        }
        return buf;
    }
    case 3: {
        const int8_t *row = (const int8_t *)(quants + t * nb * 32);
        const uint16_t *scale = (const uint16_t *)(scales + t * nb * 2);
        for (int64_t b = 0; b < nb; b++) {
            const __m256 d = _mm256_set1_ps(half_to_float(scale[b]));
            for (int k = 0; k < 32; k += 8) {
                const __m128i q8 = _mm_loadl_epi64((const __m128i *)(row + b * 32 + k));
                _mm256_storeu_ps(buf + b * 32 + k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8))));
            }
        }
        return buf;
    }
    case 4: {
        const uint8_t *row = quants + t * nb * 16;
        const uint16_t *scale = (const uint16_t *)(scales + t * nb * 2);
        const __m256i mask = _mm256_set1_epi32(15), eight = _mm256_set1_epi32(8);
        for (int64_t b = 0; b < nb; b++) {
            const __m256 d = _mm256_set1_ps(half_to_float(scale[b]));
            for (int k = 0; k < 16; k += 8) { /* byte j: element j (low nibble) and j + 16 (high) */
                const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(row + b * 16 + k)));
                const __m256i lo = _mm256_sub_epi32(_mm256_and_si256(bytes, mask), eight);
                const __m256i hi = _mm256_sub_epi32(_mm256_srli_epi32(bytes, 4), eight);
                _mm256_storeu_ps(buf + b * 32 + k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(lo)));
                _mm256_storeu_ps(buf + b * 32 + 16 + k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(hi)));
            }
        }
        return buf;
    }
    }
    return row_values_c(fmt, quants, scales, t, width, buf);
}
#else
#define row_values row_values_c
#endif

#if defined(__AVX512F__)
/* The first two levels of a transpose-and-add tree over v[0..15]: b[i]'s 128-bit lane L holds, for v[4i + k]
 * (k = 0..3), the sum of v[4i + k]'s four values in lane L. */
static inline void sum_lanes_by4(const __m512 *v, __m512 *b) {
    __m512 a[8];
    for (int i = 0; i < 8; i++)
        a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) {
        const __m512d x = _mm512_castps_pd(a[2 * i]), y = _mm512_castps_pd(a[2 * i + 1]);
        b[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
    }
}

/* Sums of adjacent 128-bit lanes: [x.L0 + x.L1, x.L2 + x.L3, y.L0 + y.L1, y.L2 + y.L3]. */
static inline __m512 sum_lane_pairs(__m512 x, __m512 y) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(x, y, 0x88), _mm512_shuffle_f32x4(x, y, 0xDD));
}

/* v[0..15] -> one vector whose lane j is the sum of v[j]'s lanes: a transpose-and-add tree, about 3 ops per
 * vector instead of a horizontal reduction each. */
static inline __m512 sum_lanes16(const __m512 *v) {
    __m512 b[4];
    sum_lanes_by4(v, b);
    return sum_lane_pairs(sum_lane_pairs(b[0], b[1]), sum_lane_pairs(b[2], b[3]));
}

/* Stores 16 row scores (masked to count) at o, added to what is there when accumulate. */
static inline void store_scores(float *o, __m512 v, __mmask16 mask, int accumulate) {
    if (accumulate) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(mask, o));
    _mm512_mask_storeu_ps(o, mask, v);
}

/* tile_scores for heads of d = 4 or 8 values, H_kv * d a multiple of 16: each 16 values of a row span 16 / d
 * heads, so the products of a whole row chunk are summed per head by the first levels of the tree. qg: the
 * queries laid out as rows, one per group member g: qg[g][k * d + i] = q[k * G + g][i]. */
static inline void tile_scores_narrow(const float *const *rows, int64_t count, int64_t kv_heads, int64_t group,
                                      int64_t d, const float *qg, float *s, int64_t s_hstride, int accumulate) {
    const int64_t width = kv_heads * d;
    const __mmask16 mask = (__mmask16)((1u << count) - 1u);
    for (int64_t g = 0; g < group; g++)
        for (int64_t c = 0; c < width; c += 16) {
            const __m512 qv = _mm512_loadu_ps(qg + g * width + c);
            __m512 v[TILE], b[4], heads[4];
            for (int64_t j = 0; j < TILE; j++)
                v[j] = j < count ? _mm512_mul_ps(qv, _mm512_loadu_ps(rows[j] + c)) : _mm512_setzero_ps();
            sum_lanes_by4(v, b); /* b[i] lane L: rows 4i..4i+3, the 4 values of lane L */
            int per;
            if (d == 4) { /* a head per 128-bit lane: gather lane L of b[0..3] -> rows 0..15 of head L */
                const __m512 t0 = _mm512_shuffle_f32x4(b[0], b[1], 0x44), t1 = _mm512_shuffle_f32x4(b[0], b[1], 0xEE);
                const __m512 t2 = _mm512_shuffle_f32x4(b[2], b[3], 0x44), t3 = _mm512_shuffle_f32x4(b[2], b[3], 0xEE);
                heads[0] = _mm512_shuffle_f32x4(t0, t2, 0x88);
                heads[1] = _mm512_shuffle_f32x4(t0, t2, 0xDD);
                heads[2] = _mm512_shuffle_f32x4(t1, t3, 0x88);
                heads[3] = _mm512_shuffle_f32x4(t1, t3, 0xDD);
                per = 4;
            } else { /* d == 8: a head per pair of lanes */
                const __m512 c0 = sum_lane_pairs(b[0], b[1]), c1 = sum_lane_pairs(b[2], b[3]);
                heads[0] = _mm512_shuffle_f32x4(c0, c1, 0x88);
                heads[1] = _mm512_shuffle_f32x4(c0, c1, 0xDD);
                per = 2;
            }
            for (int m = 0; m < per; m++) {
                const int64_t h = (c / d + m) * group + g;
                store_scores(s + h * s_hstride, heads[m], mask, accumulate);
            }
        }
}
#endif

/* Scores of a tile of `count` rows (row pointers) for every query head, into s (head stride s_hstride). */
static inline void tile_scores(const float *const *rows, int64_t count, int64_t heads, int64_t group, int64_t d,
                               const float *q, int64_t q_hstride, float *s, int64_t s_hstride, int accumulate) {
#if defined(__AVX512F__)
    if (d % 16 == 0) {
        const __mmask16 mask = (__mmask16)((1u << count) - 1u);
        for (int64_t h = 0; h < heads; h++) {
            const float *qh = q + h * q_hstride;
            const int64_t offset = (h / group) * d;
            __m512 v[TILE];
            for (int64_t j = 0; j < TILE; j++) {
                __m512 acc = _mm512_setzero_ps();
                if (j < count)
                    for (int64_t c = 0; c < d; c += 16)
                        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qh + c), _mm512_loadu_ps(rows[j] + offset + c), acc);
                v[j] = acc;
            }
            store_scores(s + h * s_hstride, sum_lanes16(v), mask, accumulate);
        }
        return;
    }
#endif
    for (int64_t h = 0; h < heads; h++) {
        const float *qh = q + h * q_hstride;
        const int64_t offset = (h / group) * d;
        for (int64_t j = 0; j < count; j++) {
            const float *kh = rows[j] + offset;
            float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
            for (int64_t i = 0; i < d; i++) acc += qh[i] * kh[i];
            s[h * s_hstride + j] = accumulate ? s[h * s_hstride + j] + acc : acc;
        }
    }
}

/* acc[h] += sum over a tile of `count` rows of p[h, j] * row_j[h / G] (p head stride p_hstride). */
static inline void tile_wsum(const float *const *rows, int64_t count, int64_t heads, int64_t group, int64_t d,
                             const float *p, int64_t p_hstride, float *acc) {
    for (int64_t h = 0; h < heads; h++) {
        const float *ph = p + h * p_hstride;
        const int64_t offset = (h / group) * d;
        float *restrict ah = acc + h * d;
#if defined(__AVX512F__)
        if (d % 16 == 0) {
            for (int64_t c = 0; c < d; c += 16) {
                __m512 a = _mm512_loadu_ps(ah + c);
                for (int64_t j = 0; j < count; j++)
                    a = _mm512_fmadd_ps(_mm512_set1_ps(ph[j]), _mm512_loadu_ps(rows[j] + offset + c), a);
                _mm512_storeu_ps(ah + c, a);
            }
            continue;
        }
#endif
        for (int64_t j = 0; j < count; j++) {
            const float w = ph[j], *vh = rows[j] + offset;
#pragma omp simd
            for (int64_t i = 0; i < d; i++) ah[i] += w * vh[i];
        }
    }
}

/* q: (B, H, d) float with element strides (q_bstride, q_hstride, 1); K rows: n rows (B, n, H_kv * d) in format
 * fmt with batch strides in bytes; s: (B, H, >= n) float with strides (s_bstride, s_hstride, 1).
 * accumulate: add to s instead of overwriting it. Returns 0, or -2 out of memory. */
int attnlab_scores(int fmt, const uint8_t *quants, const uint8_t *scales, int64_t quants_bstride,
                   int64_t scales_bstride, int64_t batch, int64_t n, int64_t kv_heads, int64_t d, const float *q,
                   int64_t q_bstride, int64_t q_hstride, int64_t group, float *s, int64_t s_bstride,
                   int64_t s_hstride, int accumulate) {
    const int64_t width = kv_heads * d, heads = kv_heads * group, tiles = (n + TILE - 1) / TILE;
    int failed = 0, narrow = 0;
    float *qg = NULL;
#if defined(__AVX512F__)
    narrow = (d == 4 || d == 8) && width % 16 == 0;
    if (narrow) { /* the queries as rows, one per group member (see tile_scores_narrow) */
        qg = malloc(sizeof(float) * batch * group * width);
        if (qg == NULL) return -2;
        for (int64_t b = 0; b < batch; b++)
            for (int64_t h = 0; h < heads; h++)
                for (int64_t i = 0; i < d; i++)
                    qg[(b * group + h % group) * width + (h / group) * d + i] = q[b * q_bstride + h * q_hstride + i];
    }
#endif
#pragma omp parallel if (n * width >= PARALLEL_MIN) reduction(| : failed)
    {
        float *buf = malloc(sizeof(float) * TILE * width);
        const float *rows[TILE];
        failed = buf == NULL;
#pragma omp for schedule(static)
        for (int64_t job = 0; job < batch * tiles; job++) {
            if (failed) continue;
            const int64_t b = job / tiles, t0 = (job % tiles) * TILE, count = n - t0 < TILE ? n - t0 : TILE;
            const uint8_t *qb = quants + b * quants_bstride, *sb = scales ? scales + b * scales_bstride : 0;
            for (int64_t j = 0; j < count; j++) rows[j] = row_values(fmt, qb, sb, t0 + j, width, buf + j * width);
#if defined(__AVX512F__)
            if (narrow) {
                tile_scores_narrow(rows, count, kv_heads, group, d, qg + b * group * width, s + b * s_bstride + t0,
                                   s_hstride, accumulate);
                continue;
            }
#endif
            tile_scores(rows, count, heads, group, d, q + b * q_bstride, q_hstride, s + b * s_bstride + t0,
                        s_hstride, accumulate);
        }
        free(buf);
    }
    free(qg);
    return failed ? -2 : 0;
}

/* p: (B, H, >= n) float with strides (p_bstride, p_hstride, 1); V rows as in attnlab_scores; o: (B, H, d) float
 * with strides (o_bstride, o_hstride, 1), added to. Returns as attnlab_scores does. */
int attnlab_wsum(int fmt, const uint8_t *quants, const uint8_t *scales, int64_t quants_bstride,
                 int64_t scales_bstride, int64_t batch, int64_t n, int64_t kv_heads, int64_t d, const float *p,
                 int64_t p_bstride, int64_t p_hstride, int64_t group, float *o, int64_t o_bstride,
                 int64_t o_hstride) {
    const int64_t width = kv_heads * d, heads = kv_heads * group, tiles = (n + TILE - 1) / TILE;
    int failed = 0;
#pragma omp parallel if (n * width >= PARALLEL_MIN) reduction(| : failed)
    {
        /* Each thread sums its share of the rows into its own accumulator, then adds it to o. */
        float *buf = malloc(sizeof(float) * TILE * width), *acc = calloc(batch * heads * d, sizeof(float));
        const float *rows[TILE];
        failed = buf == NULL || acc == NULL;
#pragma omp for schedule(static)
        for (int64_t job = 0; job < batch * tiles; job++) {
            if (failed) continue;
            const int64_t b = job / tiles, t0 = (job % tiles) * TILE, count = n - t0 < TILE ? n - t0 : TILE;
            const uint8_t *qb = quants + b * quants_bstride, *sb = scales ? scales + b * scales_bstride : 0;
            for (int64_t j = 0; j < count; j++) rows[j] = row_values(fmt, qb, sb, t0 + j, width, buf + j * width);
            tile_wsum(rows, count, heads, group, d, p + b * p_bstride + t0, p_hstride, acc + b * heads * d);
        }
#pragma omp critical
        if (!failed)
            for (int64_t b = 0; b < batch; b++)
                for (int64_t h = 0; h < heads; h++) {
                    float *restrict oh = o + b * o_bstride + h * o_hstride;
                    const float *ah = acc + (b * heads + h) * d;
                    for (int64_t i = 0; i < d; i++) oh[i] += ah[i];
                }
        free(buf);
        free(acc);
    }
    return failed ? -2 : 0;
}

/* exp(x) for x <= 0 (Cephes' expf: range reduction by ln 2, a degree-5 polynomial; within 2 ulp), 0 below -87. */
static inline float exp_nonpositive(float x) {
    if (x < -87.0f) return 0.0f;
    const float n = rintf(x * 1.44269504088896341f);
    const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    const float e = p * r * r + r + 1.0f;
    const int32_t bits = (int32_t)(n + 127.0f) << 23;
    float two_n;
    memcpy(&two_n, &bits, 4);
    return e * two_n;
}

#if defined(__AVX512F__)
static inline __m512 exp_nonpositive16(__m512 x) {
    const __mmask16 under = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_LT_OQ);
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_sub_ps(x, _mm512_mul_ps(n, _mm512_set1_ps(0.693359375f)));
    r = _mm512_sub_ps(r, _mm512_mul_ps(n, _mm512_set1_ps(-2.12194440e-4f)));
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_add_ps(_mm512_mul_ps(p, r), _mm512_set1_ps(5.0000001201e-1f));
    const __m512 e = _mm512_add_ps(_mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(p, r), r), r), _mm512_set1_ps(1.0f));
    const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_maskz_mul_ps((__mmask16)~under, e, _mm512_castsi512_ps(bits));
}
#endif

/* s: (B, H, n) float with strides (s_bstride, s_hstride, 1) -> softmax(scale * s) over the last axis, in place. */
void attnlab_softmax(float *s, int64_t batch, int64_t heads, int64_t n, int64_t s_bstride, int64_t s_hstride,
                     float scale) {
#pragma omp parallel for schedule(static) if (batch * heads * n >= PARALLEL_MIN / 4)
    for (int64_t row = 0; row < batch * heads; row++) {
        float *x = s + (row / heads) * s_bstride + (row % heads) * s_hstride;
        float max = -INFINITY;
        double sum = 0.0; /* a float running sum over thousands of values drifts by 1e-5 */
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512 vmax = _mm512_set1_ps(-INFINITY);
        __m512d vsum_lo = _mm512_setzero_pd(), vsum_hi = _mm512_setzero_pd(); /* doubles: no drift over long rows */
        const __m512 vscale = _mm512_set1_ps(scale);
        for (; i + 16 <= n; i += 16) {
            const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(x + i), vscale);
            _mm512_storeu_ps(x + i, v);
            vmax = _mm512_max_ps(vmax, v);
        }
        max = _mm512_reduce_max_ps(vmax);
#endif
        for (int64_t j = i; j < n; j++) {
            x[j] *= scale;
            max = x[j] > max ? x[j] : max;
        }
        i = 0;
#if defined(__AVX512F__)
        const __m512 vm = _mm512_set1_ps(max);
        for (; i + 16 <= n; i += 16) {
            const __m512 e = exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(x + i), vm));
            _mm512_storeu_ps(x + i, e);
            vsum_lo = _mm512_add_pd(vsum_lo, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
            vsum_hi = _mm512_add_pd(vsum_hi, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
        }
        sum = _mm512_reduce_add_pd(_mm512_add_pd(vsum_lo, vsum_hi));
#endif
        for (int64_t j = i; j < n; j++) {
            x[j] = exp_nonpositive(x[j] - max);
            sum += x[j];
        }
        const float inv = (float)(1.0 / sum);
        for (int64_t j = 0; j < n; j++) x[j] *= inv;
    }
}

/* rows (batch, n, width) float with strides (x_bstride, x_rstride, 1) -> quants (batch, n, width / 32, 32 | 16)
 * and fp16 scales (batch, n, width / 32, 2) with batch and row strides in bytes (the blocks of a row contiguous).
 * nf4_below / nf4_inside: attnlab.quant's NF4 lookup tables (256 cells). Returns 0, or -1 for a non-finite value
 * or a scale beyond fp16 (nothing is promised about the output then: the caller runs attnlab.quant.quantize,
 * which names the problem). */
int attnlab_quantize(int fmt, const float *x, int64_t batch, int64_t n, int64_t width, int64_t x_bstride,
                     int64_t x_rstride, uint8_t *quants, int64_t q_bstride, int64_t q_rstride, uint8_t *scales,
                     int64_t s_bstride, int64_t s_rstride, const uint8_t *nf4_below, const float *nf4_inside) {
    const int64_t nb = width / 32, qbytes = fmt == 3 ? 32 : 16;
    for (int64_t r = 0; r < batch * n; r++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t i0 = r / n, i1 = r % n;
            const float *v = x + i0 * x_bstride + i1 * x_rstride + b * 32;
            uint8_t *q = quants + i0 * q_bstride + i1 * q_rstride + b * qbytes;
            uint16_t *scale = (uint16_t *)(scales + i0 * s_bstride + i1 * s_rstride + b * 2);
            float amax = fabsf(v[0]), max = v[0];
            for (int i = 0; i < 32; i++) {
                if (!isfinite(v[i])) return -1;
                if (fabsf(v[i]) > amax) { /* the first value of the largest magnitude, as gguf (x[0] if all 0) */
                    amax = fabsf(v[i]);
                    max = v[i];
                }
            }
            if (fmt == 3) { /* q8_0: d = amax / 127, q = round(x / d) half away from zero */
                const float d = amax / 127.0f;
                float id = d != 0.0f ? 1.0f / d : 0.0f;
                if (isinf(id)) id = 0.0f;
                int8_t codes[32];
                for (int i = 0; i < 32; i++) { /* roundf: half away from zero, p + 0.5 exact in double */
                    const float p = v[i] * id;
                    codes[i] = (int8_t)(int32_t)((double)p + (p < 0.0f ? -0.5 : 0.5));
                }
                memcpy(q, codes, 32);
                *scale = float_to_half(d);
            } else if (fmt == 4) { /* q4_0: d = max / -8, q = min(15, trunc(x / d + 8.5)) */
                const float d = max / -8.0f;
                float id = d != 0.0f ? 1.0f / d : 0.0f;
                if (isinf(id)) id = 0.0f;
                uint8_t codes[32];
                for (int i = 0; i < 32; i++) {
                    const float product = v[i] * id, shifted = product + 8.5f;
                    const int code = (int)shifted;
                    codes[i] = (uint8_t)(code < 15 ? code : 15);
                }
                for (int i = 0; i < 16; i++) q[i] = codes[i] | (uint8_t)(codes[i + 16] << 4);
                *scale = float_to_half(d);
            } else { /* nf4: s = amax rounded up to fp16, q = nearest codebook entry to x / s (via the tables) */
                uint16_t h = float_to_half(amax);
                if (half_to_float(h) < amax) h++;
                if ((h & 0x7c00) == 0x7c00) return -1;
                const float divisor = h ? half_to_float(h) : 1.0f, m = 128.0f / divisor;
                uint8_t codes[32];
                for (int i = 0; i < 32; i++) {
                    const float cellv = v[i] * m, shifted = cellv + 128.0f;
                    int64_t cell = (int64_t)shifted;
                    cell = cell < 0 ? 0 : (cell > 255 ? 255 : cell);
                    codes[i] = (uint8_t)(nf4_below[cell] + (cellv > nf4_inside[cell]));
                }
                for (int i = 0; i < 16; i++) q[i] = codes[i] | (uint8_t)(codes[i + 16] << 4);
                *scale = h;
                continue;
            }
            if ((*scale & 0x7c00) == 0x7c00) return -1;
        }
    return 0;
}

/* One decode step's attention over runs of rows in several formats, in one call (the Python side makes one
 * ctypes call per layer, not one per run). segments: n_keys then n_values records of SEGMENT_FIELDS int64:
 *   fmt, quants pointer, scales pointer (0 if none), their batch strides (bytes), rows n, first score column,
 *   lo (the part's first value in a head's q (keys) or o (values) row), d (the part's values per head),
 *   accumulate (keys: add to the scores, for the second part of a row onwards; values: unused).
 * s: (B, H, n_columns) float workspace, left holding the probabilities; o: (B, H, d_v) float, added to. */
#define SEGMENT_FIELDS 10
int attnlab_attend(const int64_t *segments, int64_t n_keys, int64_t n_values, int64_t batch, int64_t kv_heads,
                   int64_t group, const float *q, int64_t q_bstride, int64_t q_hstride, float scale, float *s,
                   int64_t n_columns, float *o, int64_t o_bstride, int64_t o_hstride) {
    const int64_t heads = kv_heads * group;
    for (int64_t i = 0; i < n_keys + n_values; i++) {
        const int64_t *g = segments + i * SEGMENT_FIELDS;
        const int fmt = (int)g[0];
        const uint8_t *quants = (const uint8_t *)(intptr_t)g[1], *scales = (const uint8_t *)(intptr_t)g[2];
        const int64_t n = g[5], column = g[6], lo = g[7], d = g[8];
        if (i == n_keys) attnlab_softmax(s, batch, heads, n_columns, heads * n_columns, n_columns, scale);
        if (n == 0) continue;
        int status;
        if (i < n_keys)
            status = attnlab_scores(fmt, quants, scales, g[3], g[4], batch, n, kv_heads, d, q + lo, q_bstride,
                                    q_hstride, group, s + column, heads * n_columns, n_columns, (int)g[9]);
        else
            status = attnlab_wsum(fmt, quants, scales, g[3], g[4], batch, n, kv_heads, d, s + column,
                                  heads * n_columns, n_columns, group, o + lo, o_bstride, o_hstride);
        if (status) return status;
    }
    if (n_values == 0) attnlab_softmax(s, batch, heads, n_columns, heads * n_columns, n_columns, scale);
    return 0;
}
