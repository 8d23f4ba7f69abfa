/* One decode step of a Llama-style block stack in one call (attnlab.model.fused): batch 1, one new token.
 *
 *   x = embed[token]
 *   for each block:  h = rms_norm(x) attn_norm;  q, k, v = qkv(h) (+ bias);  q, k rotated by RoPE at `pos`
 *                    K[pos], V[pos] = k, v (the dense cache's buffers, slot = position); slot_positions[pos] = pos
 *                    y = softmax(scale q K[0..pos]^T) V[0..pos] per query head (head h reads KV head h / G)
 *                    (or a quantized cache: see attend_quantized and store_token below)
 *                    x += out(y);  x += down(silu(gate) * up), gate | up = gate_up(rms_norm(x) mlp_norm)
 *   logits = lm_head(rms_norm(x) norm), and their argmax over the first vocab_size
 *
 * A linear layer is a QuantizedLinear with 8-bit activations over packed rows (qmatmul.c's attnlab_qmatmul_q8p):
 * its input quantized by quantize_row_q8 and each group of 16 rows multiplied by group_q8, the same functions, so
 * a layer given the same input gives the same bits; or float32 / fp16 rows with float32 activations (matvec_float). The rest (RMSNorm, RoPE, softmax, SiLU) is float32 arithmetic
 * as attnlab's PyTorch ops do it, summed in another order (RoPE: the same products and differences, rounded alike:
 * this file is built with -ffp-contract=off).
 *
 * A block's cache is either the dense float32 one (L_QUANTIZED 0: L_K, L_V (kv_heads, slots, dim) and slot positions)
 * or a QuantizedCache of per-token rows (attnlab.cache.quantized, L_QUANTIZED 1): a token's K (V) row over all KV
 * heads stored in its part's format (qattn.c's codes: fp32, fp16, bf16, q8_0, q4_0, nf4) once it has left the
 * full-precision residual ring, read by qattn.c's row_values and written by qattn.c's attnlab_quantize (the
 * quantizer of the cache's own writes), so the stored bytes are what the cache's eager or compiled step stores.
 *
 * The model arrives as a plan, int64 values (attnlab.model.fused builds it once per cache; pointers as integers):
 * PLAN_HEADER values, then PLAN_LAYER values per block, in the orders of the enums below. Formats are qmatmul.c's
 * (ggml's type ids); the embedding's 0 means a float32 table.
 */
#include "qmatmul.c"
#include "qattn.c"

enum {
    P_LAYERS, P_D_MODEL, P_HEADS, P_KV_HEADS, P_HEAD_DIM, P_HIDDEN, P_SLOTS, P_ROPE_LEN, P_INTERLEAVED, P_VOCAB_ROWS,
    P_VOCAB_SIZE, P_EMBED_FMT, P_EMBED, P_EMBED_ROWS, P_NORM, P_HEAD_FMT, P_HEAD, P_HEAD_BIAS, P_NF4_BELOW,
    P_NF4_INSIDE, PLAN_HEADER
};
/* A quantized cache's layer: L_K, L_V its stored rows (quants or float rows), L_SLOT_POSITIONS its counters [seen,
 * stored, max_len] (advanced here), then the fields after L_QUANTIZED (KernelPlan's). */
enum {
    L_ATTN_NORM, L_QKV_FMT, L_QKV, L_QKV_BIAS, L_OUT_FMT, L_OUT, L_OUT_BIAS, L_MLP_NORM, L_GATE_UP_FMT, L_GATE_UP,
    L_GATE_UP_BIAS, L_DOWN_FMT, L_DOWN, L_DOWN_BIAS, L_K, L_V, L_SLOT_POSITIONS, L_COS, L_SIN, L_QUANTIZED, L_K_FMT,
    L_K_SCALES, L_K_RING, L_V_FMT, L_V_SCALES, L_V_RING, L_RING_SLOTS, L_RESID, L_FLUSH, L_STORE_SLOTS, PLAN_LAYER
};

#define AT(type, value) ((type)(intptr_t)(value))

/* Buffers of one step: x's 8-bit codes, their scales and sums (the widest input), and the float rows between. */
typedef struct {
    int8_t *xq;
    float *xd;
    int32_t *xs;
} codes_t;

#define F32 0 /* ggml's type id of float32 rows (qmatmul.c numbers F16 and the block formats) */

/* y (n) = x (k) W^T + bias for W float32 rows (fmt F32, an nn.Linear's weight) or fp16 rows (F16, a QuantizedLinear's
 * blocks), x float32 as it is (no 8-bit codes): each weight read once, 4 rows at a time (4 independent FMA chains,
 * one horizontal sum per 4 rows), groups of rows shared among threads. Float32 in another order than F.linear. */
static void matvec_float(int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x, float *y,
                         const float *bias) {
    const int64_t groups = (n + 3) / 4;
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN)
    for (int64_t g = 0; g < groups; g++) {
        const int64_t r0 = g * 4, rows = n - r0 < 4 ? n - r0 : 4;
        float sums[4] = {0.0f, 0.0f, 0.0f, 0.0f};
        int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        if (rows == 4) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            if (fmt == F32) {
                const float *w0 = (const float *)w + r0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
                for (; c + 8 <= k; c += 8) {
                    const __m256 xv = _mm256_loadu_ps(x + c);
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + c), xv, a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w1 + c), xv, a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w2 + c), xv, a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w3 + c), xv, a3);
                }
            } else {
                const uint16_t *w0 = (const uint16_t *)w + r0 * k, *w1 = w0 + k, *w2 = w1 + k, *w3 = w2 + k;
#define HALVES(row) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((row) + c)))
                for (; c + 8 <= k; c += 8) {
                    const __m256 xv = _mm256_loadu_ps(x + c);
                    a0 = _mm256_fmadd_ps(HALVES(w0), xv, a0), a1 = _mm256_fmadd_ps(HALVES(w1), xv, a1);
                    a2 = _mm256_fmadd_ps(HALVES(w2), xv, a2), a3 = _mm256_fmadd_ps(HALVES(w3), xv, a3);
                }
#undef HALVES
            }
            const __m256 sum = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3)); /* rows 0..3, twice */
            _mm_storeu_ps(sums, _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1)));
        }
#endif
        for (int64_t r = 0; r < rows; r++) {
            float total = sums[r];
            for (int64_t i = rows == 4 ? c : 0; i < k; i++) {
                const float weight = fmt == F32 ? ((const float *)w)[(r0 + r) * k + i]
                                                : half_to_float(((const uint16_t *)w)[(r0 + r) * k + i]);
                total += weight * x[i];
            }
            y[r0 + r] = bias ? total + bias[r0 + r] : total;
        }
    }
}

/* y (n) = x (k) W^T + bias, W packed by attnlab_pack_q8 (fmt Q4_0, Q4_1 or Q8_0): attnlab_qmatmul_q8p for one row,
 * with the codes in `c` rather than freshly allocated; or float rows (F32, F16: matvec_float). */
static void matvec(int fmt, const uint8_t *w, int64_t n, int64_t k, const float *x, codes_t c, float *y,
                   const float *bias) {
    if (fmt == F32 || fmt == F16) {
        matvec_float(fmt, w, n, k, x, y, bias);
        return;
    }
    quantize_row_q8(x, k, c.xq, c.xd, c.xs);
    const int64_t nb = k / 32, group_bytes = PACK * nb * block_bytes(fmt), groups = n / PACK;
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *group = w + g * group_bytes;
        const float *b = bias ? bias + g * PACK : NULL;
        switch (fmt) {
        case Q4_0: group_q8(Q4_0, group, nb, c.xq, c.xd, c.xs, y + g * PACK, b); break;
        case Q4_1: group_q8(Q4_1, group, nb, c.xq, c.xd, c.xs, y + g * PACK, b); break;
        default: group_q8(Q8_0, group, nb, c.xq, c.xd, c.xs, y + g * PACK, b);
        }
    }
}

/* out = x / sqrt(mean(x^2) + eps) * weight, as RMSNorm (the mean of squares summed in double). */
static void rms_norm(const float *x, const float *weight, int64_t n, float eps, float *out) {
    double squares = 0.0;
    for (int64_t i = 0; i < n; i++) squares += (double)x[i] * (double)x[i];
    const float rstd = 1.0f / sqrtf((float)(squares / (double)n) + eps);
    for (int64_t i = 0; i < n; i++) out[i] = (x[i] * rstd) * weight[i];
}

/* x (dim) rotated in place by the angles of one position (cos, sin: dim / 2 each), as attnlab.ops.rope.rotate:
 * pairs (i, i + dim / 2), or (2i, 2i + 1) when interleaved. */
static void rotate(float *x, const float *cos, const float *sin, int64_t dim, int interleaved) {
    const int64_t half = dim / 2;
    for (int64_t i = 0; i < half; i++) {
        float *a = interleaved ? x + 2 * i : x + i, *b = interleaved ? x + 2 * i + 1 : x + i + half;
        const float first = *a, second = *b;
        *a = first * cos[i] - second * sin[i];
        *b = interleaved ? first * sin[i] + second * cos[i] : second * cos[i] + first * sin[i];
    }
}

static inline float dot(const float *a, const float *b, int64_t n) {
    int64_t i = 0;
    float sum = 0.0f;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    for (; i + 8 <= n; i += 8) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc0);
    sum = sum8(_mm256_add_ps(acc0, acc1));
#endif
    for (; i < n; i++) sum += a[i] * b[i];
    return sum;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* exp of 8 floats, within 2 ulps (Cephes' expf, as avx_mathfun's exp256_ps): 2^n exp(r), r = x - n ln 2 in two
 * parts, exp(r) by its polynomial; below -87.3 gives 0 (expf: a denormal), above 88.4 exp(88.4) (expf: inf). */
static inline __m256 exp8(__m256 x) {
    const __m256 given = x, nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q); /* NaN stays NaN */
    const __m256 low = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.33654f)), _mm256_set1_ps(88.37626f));
    const __m256 n = _mm256_floor_ps(_mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_blendv_ps(_mm256_andnot_ps(low, _mm256_mul_ps(y, _mm256_castsi256_ps(e))), given, nan);
}
#endif

/* p (n) = exp(p - top); returns their sum. */
static float exp_shifted(float *p, int64_t n, float top) {
    int64_t t = 0;
    float total = 0.0f;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    __m256 sum = _mm256_setzero_ps();
    for (; t + 8 <= n; t += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + t), _mm256_set1_ps(top)));
        _mm256_storeu_ps(p + t, e);
        sum = _mm256_add_ps(sum, e);
    }
    total = sum8(sum);
#endif
    for (; t < n; t++) total += p[t] = expf(p[t] - top);
    return total;
}

/* p (n) = softmax(p), in place. */
static void softmax_row(float *p, int64_t n) {
    float top = p[0];
    for (int64_t t = 1; t < n; t++) top = p[t] > top ? p[t] : top;
    const float inverse = 1.0f / exp_shifted(p, n, top);
    for (int64_t t = 0; t < n; t++) p[t] *= inverse;
}

/* gate (n) = silu(gate) up = gate / (1 + exp(-gate)) up, as F.silu(gate) * up. */
static void silu_mul(float *gate, const float *up, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; i + 8 <= n; i += 8) {
        const __m256 g = _mm256_loadu_ps(gate + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
    }
#endif
    for (; i < n; i++) gate[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
}

/* y (n) += p x (n) */
static inline void axpy(float p, const float *x, float *restrict y, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    const __m256 pp = _mm256_set1_ps(p);
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pp, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += p * x[i];
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* s[g n + t] = scale q_g . K[t] for the `group` queries q (group, dim) of one KV head, 4 rows of K at a time (one
 * horizontal reduction per 4 dot products); dim % 8 == 0. */
static inline __attribute__((always_inline)) void scores_by4(const int group, const float *q, const float *keys,
                                                              int64_t dim, int64_t n, float scale, float *s) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        const float *k = keys + t * dim;
        for (int g = 0; g < group; g++) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t c = 0; c < dim; c += 8) {
                const __m256 qv = _mm256_loadu_ps(q + g * dim + c);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(k + c), qv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(k + dim + c), qv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 2 * dim + c), qv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 3 * dim + c), qv, a3);
            }
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3)); /* rows 0..3, twice */
            const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(s + g * n + t, _mm_mul_ps(sums, _mm_set1_ps(scale)));
        }
    }
    for (; t < n; t++)
        for (int g = 0; g < group; g++) s[g * n + t] = dot(q + g * dim, keys + t * dim, dim) * scale;
}

/* y (group, dim) = sum over t < n of p[g n + t] V[t], 32 values of each row at a time, the group's 4 x group sums in
 * registers (each row's 32 values are one pass's: every line of V is read once); dim % 32 == 0, group <= 4. */
static inline __attribute__((always_inline)) void wsum_by32(const int group, const float *p, const float *values,
                                                             int64_t dim, int64_t n, float *y) {
    for (int64_t c = 0; c < dim; c += 32) {
        __m256 acc[4][4];
        for (int g = 0; g < group; g++)
            for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const float *v = values + t * dim + c;
            const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16);
            const __m256 v3 = _mm256_loadu_ps(v + 24);
            for (int g = 0; g < group; g++) {
                const __m256 w = _mm256_broadcast_ss(p + g * n + t);
                acc[g][0] = _mm256_fmadd_ps(w, v0, acc[g][0]), acc[g][1] = _mm256_fmadd_ps(w, v1, acc[g][1]);
                acc[g][2] = _mm256_fmadd_ps(w, v2, acc[g][2]), acc[g][3] = _mm256_fmadd_ps(w, v3, acc[g][3]);
            }
        }
        for (int g = 0; g < group; g++)
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(y + g * dim + c + 8 * j, acc[g][j]);
    }
}
#endif

/* The attention of one KV head's `group` query heads q (group, dim) over rows 0..n-1 of its keys and values (slots,
 * dim): y (group, dim); s: group x n floats of workspace. */
static inline __attribute__((always_inline)) void attend_kv(const int group, const float *q, const float *keys,
                                                             const float *values, int64_t dim, int64_t n, float scale,
                                                             float *s, float *y) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    const int blocked = group <= 4 && dim % 32 == 0;
    if (blocked)
        scores_by4(group, q, keys, dim, n, scale, s);
    else
#endif
        for (int64_t t = 0; t < n; t++)
            for (int g = 0; g < group; g++) s[g * n + t] = dot(q + g * dim, keys + t * dim, dim) * scale;
    for (int g = 0; g < group; g++) softmax_row(s + g * n, n);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (blocked) {
        wsum_by32(group, s, values, dim, n, y);
        return;
    }
#endif
    memset(y, 0, sizeof(float) * (size_t)(group * dim));
    for (int64_t t = 0; t < n; t++)
        for (int g = 0; g < group; g++) axpy(s[g * n + t], values + t * dim, y + g * dim, dim);
}

/* y (heads, dim) = softmax(scale q K^T) V over rows 0..n-1 of K and V (kv_heads, slots, dim), query head h reading
 * KV head h / group; scores: heads x n floats of workspace. The G query heads of a KV head read its rows together
 * (attend_kv, compiled for G = 1..4 apart: their sums stay in registers). */
static void attend(const float *q, const float *K, const float *V, int64_t heads, int64_t kv_heads, int64_t slots,
                   int64_t dim, int64_t n, float scale, float *scores, float *y) {
    const int64_t group = heads / kv_heads;
#pragma omp parallel for schedule(static) if (n * heads >= 4096)
    for (int64_t kv = 0; kv < kv_heads; kv++) {
        const float *qk = q + kv * group * dim, *keys = K + kv * slots * dim, *values = V + kv * slots * dim;
        float *s = scores + kv * group * n, *out = y + kv * group * dim;
        switch (group) {
        case 1: attend_kv(1, qk, keys, values, dim, n, scale, s, out); break;
        case 2: attend_kv(2, qk, keys, values, dim, n, scale, s, out); break;
        case 3: attend_kv(3, qk, keys, values, dim, n, scale, s, out); break;
        case 4: attend_kv(4, qk, keys, values, dim, n, scale, s, out); break;
        default: attend_kv((int)group, qk, keys, values, dim, n, scale, s, out);
        }
    }
}

/* A quantized cache's K or V in one block: token rows of `width` values (all KV heads) in format fmt (qattn.c's codes),
 * tokens 0..stored-1 in quants / scales (scales: block formats only), the newer ones in the float32 ring. */
typedef struct {
    int fmt;
    uint8_t *quants, *scales;
    float *ring;
} kv_part_t;

typedef struct {
    int64_t seen, stored, ring_slots, width; /* the cache's counters before this token, its ring, its row width */
} kv_state_t;

/* Row t of a part as floats: t < stored decoded from its blocks into buf (qattn.c's row_values: the values
 * attnlab.quant.dequantize gives), t < seen read in the ring (slot t % ring_slots), t == seen the new token's row. */
static inline const float *held_row(const kv_part_t *part, kv_state_t st, int64_t t, const float *new_row,
                                    float *buf) {
    if (t < st.stored) return row_values(part->fmt, part->quants, part->scales, t, st.width, buf);
    if (t < st.seen) return part->ring + (t % st.ring_slots) * st.width;
    return new_row;
}

/* s[h s_stride + j] = scale q_h . row_j[h / group] for a tile of `count` rows (pointers) and every query head h;
 * 4 rows at a time (one horizontal reduction per 4 dot products) where dim % 8 == 0. */
static void tile_scores_rows(const float *const *rows, int64_t count, const float *q, int64_t heads, int64_t group,
                             int64_t dim, float scale, float *s, int64_t s_stride) {
    for (int64_t h = 0; h < heads; h++) {
        const float *qh = q + h * dim;
        const int64_t offset = (h / group) * dim;
        int64_t j = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        if (dim % 8 == 0)
            for (; j + 4 <= count; j += 4) {
                const float *k0 = rows[j] + offset, *k1 = rows[j + 1] + offset, *k2 = rows[j + 2] + offset;
                const float *k3 = rows[j + 3] + offset;
                __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
                for (int64_t c = 0; c < dim; c += 8) {
                    const __m256 qv = _mm256_loadu_ps(qh + c);
                    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(k0 + c), qv, a0);
                    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(k1 + c), qv, a1);
                    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(k2 + c), qv, a2);
                    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(k3 + c), qv, a3);
                }
                const __m256 sum = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3)); /* rows, twice */
                const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
                _mm_storeu_ps(s + h * s_stride + j, _mm_mul_ps(sums, _mm_set1_ps(scale)));
            }
#endif
        for (; j < count; j++) s[h * s_stride + j] = dot(qh, rows[j] + offset, dim) * scale;
    }
}

/* acc (heads, dim) += sum over a tile's `count` rows j of p[h p_stride + j] row_j[h / group], 32 values at a time in
 * registers where the head has them. */
static void tile_wsum_rows(const float *const *rows, int64_t count, const float *p, int64_t p_stride, int64_t heads,
                           int64_t group, int64_t dim, float *acc) {
    for (int64_t h = 0; h < heads; h++) {
        const float *ph = p + h * p_stride;
        const int64_t offset = (h / group) * dim;
        float *a = acc + h * dim;
        int64_t c = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
        for (; c + 32 <= dim; c += 32) {
            __m256 a0 = _mm256_loadu_ps(a + c), a1 = _mm256_loadu_ps(a + c + 8), a2 = _mm256_loadu_ps(a + c + 16);
            __m256 a3 = _mm256_loadu_ps(a + c + 24);
            for (int64_t j = 0; j < count; j++) {
                const float *v = rows[j] + offset + c;
                const __m256 w = _mm256_broadcast_ss(ph + j);
                a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v), a0), a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 8), a1);
                a2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 16), a2);
                a3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(v + 24), a3);
            }
            _mm256_storeu_ps(a + c, a0), _mm256_storeu_ps(a + c + 8, a1);
            _mm256_storeu_ps(a + c + 16, a2), _mm256_storeu_ps(a + c + 24, a3);
        }
#endif
        for (int64_t j = 0; j < count && c < dim; j++) axpy(ph[j], rows[j] + offset + c, a + c, dim - c);
    }
}

/* y (heads, dim) = softmax(scale q K^T) V over a quantized layer's tokens 0..seen (stored blocks, the ring, then the
 * new token's rows k_new and v_new), TILE rows decoded at a time into a buffer that stays in L1 (each row read and
 * decoded once for all query heads); scores: heads x (seen + 1) floats of workspace. Returns 0, or -2 (no memory). */
static int attend_quantized(const float *q, const kv_part_t *K, const kv_part_t *V, kv_state_t st, const float *k_new,
                            const float *v_new, int64_t heads, int64_t kv_heads, int64_t dim, float scale,
                            float *scores, float *y) {
    const int64_t n = st.seen + 1, group = heads / kv_heads, tiles = (n + TILE - 1) / TILE;
    const int parallel = n * st.width >= PARALLEL_MIN;
    int failed = 0;
    memset(y, 0, sizeof(float) * (size_t)(heads * dim));
#pragma omp parallel if (parallel) reduction(| : failed)
    {
        float *buf = malloc(sizeof(float) * (size_t)(TILE * st.width));
        const float *rows[TILE];
        failed = buf == NULL;
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            if (failed) continue;
            const int64_t t0 = tile * TILE, count = n - t0 < TILE ? n - t0 : TILE;
            for (int64_t j = 0; j < count; j++) rows[j] = held_row(K, st, t0 + j, k_new, buf + j * st.width);
            tile_scores_rows(rows, count, q, heads, group, dim, scale, scores + t0, n);
        }
        free(buf);
    }
    if (failed) return -2;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t h = 0; h < heads; h++) softmax_row(scores + h * n, n);
#pragma omp parallel if (parallel) reduction(| : failed)
    {
        /* Each thread sums its tiles into its own accumulator, then adds it to y. */
        float *buf = malloc(sizeof(float) * (size_t)(TILE * st.width)), *acc = calloc((size_t)(heads * dim), 4);
        const float *rows[TILE];
        failed = buf == NULL || acc == NULL;
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            if (failed) continue;
            const int64_t t0 = tile * TILE, count = n - t0 < TILE ? n - t0 : TILE;
            for (int64_t j = 0; j < count; j++) rows[j] = held_row(V, st, t0 + j, v_new, buf + j * st.width);
            tile_wsum_rows(rows, count, scores + t0, n, heads, group, dim, acc);
        }
#pragma omp critical
        if (!failed)
            for (int64_t i = 0; i < heads * dim; i++) y[i] += acc[i];
        free(buf), free(acc);
    }
    return failed ? -2 : 0;
}

/* float -> bf16 bits as torch rounds (to nearest even; NaN -> 0x7fc0), as ops.cpp's quantized_attend stores them. */
static inline uint16_t float_to_bf16(float f) {
    if (isnan(f)) return 0x7fc0;
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return (uint16_t)((bits + (((bits >> 16) & 1) + 0x7fffu)) >> 16);
}

/* Row x (width floats) stored as token t of a part, the bytes Codec.encode_into writes: qattn.c's attnlab_quantize for
 * the block formats; fp16 / bf16 rounded to nearest even (torch's .to, fp16.h). Returns 0, or -3 for a value the block
 * formats cannot store (not finite, or a block scale beyond fp16). */
static int store_row(const kv_part_t *part, int64_t width, int64_t t, const float *x, const int64_t *plan) {
    const int64_t nb = width / 32;
    if (part->fmt == 0) {
        memcpy(part->quants + t * width * 4, x, sizeof(float) * (size_t)width);
        return 0;
    }
    if (part->fmt == 1 || part->fmt == 2) {
        uint16_t *row = (uint16_t *)(part->quants + t * width * 2);
        for (int64_t i = 0; i < width; i++) row[i] = part->fmt == 1 ? float_to_half(x[i]) : float_to_bf16(x[i]);
        return 0;
    }
    const int64_t quant_bytes = part->fmt == 3 ? 32 : 16;
    const int status = attnlab_quantize(part->fmt, x, 1, 1, width, 0, 0, part->quants + t * nb * quant_bytes, 0, 0,
                                        part->scales + t * nb * 2, 0, 0, AT(const uint8_t *, plan[P_NF4_BELOW]),
                                        AT(const float *, plan[P_NF4_INSIDE]));
    return status ? -3 : 0;
}

/* The tokens [stored, leave) that leave the residual window when a token is written at position seen: whole flushes
 * of the tokens beyond the newest resid (KernelPlan.write's `leave`). */
static inline int64_t leaving(const int64_t *p, int64_t seen, int64_t stored) {
    const int64_t ready = seen + 1 - p[L_RESID] - stored;
    return stored + (ready > 0 ? ready / p[L_FLUSH] : 0) * p[L_FLUSH];
}

/* The new token's rows (K, V) written as KernelPlan.write writes one token at position seen: the tokens leaving the
 * window stored (from the ring, or the new rows when the token itself leaves), else the new rows kept in the ring;
 * the counters [seen, stored] advanced. Returns 0, or -3 (store_row). */
static int store_token(const kv_part_t *parts, const float *const *new_rows, kv_state_t st, const int64_t *p,
                       int64_t *counters, const int64_t *plan) {
    const int64_t leave = leaving(p, st.seen, st.stored);
    for (int i = 0; i < 2; i++) {
        for (int64_t t = st.stored; t < leave; t++) {
            const float *row = t < st.seen ? parts[i].ring + (t % st.ring_slots) * st.width : new_rows[i];
            if (store_row(&parts[i], st.width, t, row, plan)) return -3;
        }
        if (leave <= st.seen)
            memcpy(parts[i].ring + (st.seen % st.ring_slots) * st.width, new_rows[i], sizeof(float) * (size_t)st.width);
    }
    counters[1] = leave, counters[0] = st.seen + 1;
    return 0;
}

static int64_t max3(int64_t a, int64_t b, int64_t c) { return a > b ? (a > c ? a : c) : (b > c ? b : c); }

/* One decode step (see the top of this file): `token` at position `pos` through the plan's blocks; logits
 * (vocab_rows) written, *argmax the index of the largest of the first vocab_size (the first one; NaN counts as the
 * largest, as torch.argmax). Returns 0, -1 when pos or token is out of the plan's range (or a quantized cache's
 * counters are not at pos, or it has no room), -2 when out of memory, -3 when a block format cannot store a K or V
 * value (not finite: the layers before it have then written this token). */
int attnlab_fused_decode(const int64_t *plan, float eps, float scale, int64_t token, int64_t pos, float *logits,
                         int64_t *argmax) {
    const int64_t layers = plan[P_LAYERS], d = plan[P_D_MODEL], heads = plan[P_HEADS], kv_heads = plan[P_KV_HEADS];
    const int64_t dim = plan[P_HEAD_DIM], hidden = plan[P_HIDDEN], slots = plan[P_SLOTS];
    if (pos < 0 || pos >= slots || pos >= plan[P_ROPE_LEN] || token < 0 || token >= plan[P_EMBED_ROWS]) return -1;
    for (int64_t l = 0; l < layers; l++) { /* checked before anything is written */
        const int64_t *p = plan + PLAN_HEADER + l * PLAN_LAYER, *counters = AT(const int64_t *, p[L_SLOT_POSITIONS]);
        if (p[L_QUANTIZED] && (counters[0] != pos || pos >= counters[2] ||
                               leaving(p, pos, counters[1]) > p[L_STORE_SLOTS]))
            return -1;
    }
    const int64_t q_width = heads * dim, kv_width = kv_heads * dim, widest = max3(d, q_width, hidden);
    const int64_t floats = 2 * d + q_width + 2 * kv_width + q_width + 2 * hidden + heads * (pos + 1) + widest / 32;
    float *buffer = malloc(sizeof(float) * (size_t)floats);
    codes_t c = {malloc((size_t)widest), NULL, malloc(sizeof(int32_t) * (size_t)(widest / 32))};
    if (!buffer || !c.xq || !c.xs) {
        free(buffer), free(c.xq), free(c.xs);
        return -2;
    }
    float *x = buffer, *h = x + d, *qkv = h + d, *y = qkv + q_width + 2 * kv_width, *gate_up = y + q_width;
    float *scores = gate_up + 2 * hidden;
    c.xd = scores + heads * (pos + 1);

    const int embed_fmt = (int)plan[P_EMBED_FMT];
    if (embed_fmt == 0)
        memcpy(x, AT(const float *, plan[P_EMBED]) + token * d, sizeof(float) * (size_t)d);
    else
        attnlab_dequantize(embed_fmt, AT(const uint8_t *, plan[P_EMBED]) + token * (d / 32) * block_bytes(embed_fmt),
                           1, d, x);

    for (int64_t l = 0; l < layers; l++) {
        const int64_t *p = plan + PLAN_HEADER + l * PLAN_LAYER;
        rms_norm(x, AT(const float *, p[L_ATTN_NORM]), d, eps, h);
        matvec((int)p[L_QKV_FMT], AT(const uint8_t *, p[L_QKV]), q_width + 2 * kv_width, d, h, c, qkv,
               AT(const float *, p[L_QKV_BIAS]));
        const float *cos = AT(const float *, p[L_COS]) + pos * (dim / 2), *sin = AT(const float *, p[L_SIN]) + pos * (dim / 2);
        for (int64_t head = 0; head < heads + kv_heads; head++) rotate(qkv + head * dim, cos, sin, dim, (int)plan[P_INTERLEAVED]);
        if (p[L_QUANTIZED]) { /* a token's K and V rows are qkv's (kv_heads, dim) after q's heads */
            int64_t *counters = AT(int64_t *, p[L_SLOT_POSITIONS]);
            const kv_part_t parts[2] = {
                {(int)p[L_K_FMT], AT(uint8_t *, p[L_K]), AT(uint8_t *, p[L_K_SCALES]), AT(float *, p[L_K_RING])},
                {(int)p[L_V_FMT], AT(uint8_t *, p[L_V]), AT(uint8_t *, p[L_V_SCALES]), AT(float *, p[L_V_RING])}};
            const kv_state_t st = {pos, counters[1], p[L_RING_SLOTS], kv_width};
            const float *new_rows[2] = {qkv + q_width, qkv + q_width + kv_width};
            int status = attend_quantized(qkv, &parts[0], &parts[1], st, new_rows[0], new_rows[1], heads, kv_heads,
                                          dim, scale, scores, y);
            if (!status) status = store_token(parts, new_rows, st, p, counters, plan);
            if (status) {
                free(buffer), free(c.xq), free(c.xs);
                return status;
            }
        } else {
            float *K = AT(float *, p[L_K]), *V = AT(float *, p[L_V]);
            for (int64_t kv = 0; kv < kv_heads; kv++) {
                memcpy(K + (kv * slots + pos) * dim, qkv + q_width + kv * dim, sizeof(float) * (size_t)dim);
                memcpy(V + (kv * slots + pos) * dim, qkv + q_width + kv_width + kv * dim, sizeof(float) * (size_t)dim);
            }
            AT(int64_t *, p[L_SLOT_POSITIONS])[pos] = pos;
            attend(qkv, K, V, heads, kv_heads, slots, dim, pos + 1, scale, scores, y);
        }
        matvec((int)p[L_OUT_FMT], AT(const uint8_t *, p[L_OUT]), d, q_width, y, c, h, AT(const float *, p[L_OUT_BIAS]));
        for (int64_t i = 0; i < d; i++) x[i] += h[i];

        rms_norm(x, AT(const float *, p[L_MLP_NORM]), d, eps, h);
        matvec((int)p[L_GATE_UP_FMT], AT(const uint8_t *, p[L_GATE_UP]), 2 * hidden, d, h, c, gate_up,
               AT(const float *, p[L_GATE_UP_BIAS]));
        silu_mul(gate_up, gate_up + hidden, hidden); /* into gate's half */
        matvec((int)p[L_DOWN_FMT], AT(const uint8_t *, p[L_DOWN]), d, hidden, gate_up, c, h,
               AT(const float *, p[L_DOWN_BIAS]));
        for (int64_t i = 0; i < d; i++) x[i] += h[i];
    }

    rms_norm(x, AT(const float *, plan[P_NORM]), d, eps, h);
    matvec((int)plan[P_HEAD_FMT], AT(const uint8_t *, plan[P_HEAD]), plan[P_VOCAB_ROWS], d, h, c, logits,
           AT(const float *, plan[P_HEAD_BIAS]));
    int64_t best = 0;
    for (int64_t i = 1; i < plan[P_VOCAB_SIZE] && !isnan(logits[best]); i++)
        if (logits[i] > logits[best] || isnan(logits[i])) best = i;
    *argmax = best;
    free(buffer), free(c.xq), free(c.xs);
    return 0;
}
