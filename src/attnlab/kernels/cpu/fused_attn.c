/* The attention of fused.c's decode step (#included by it, after qmatmul.c and qattn.c): one new token's query heads
 * over a layer's cached rows, dense float32 or a QuantizedCache's per-token rows, and the new rows' writes.
 *
 * Shapes. A query head is `kd` values; the cache holds per token and KV head a key of `kd` values and a value of `vd`
 * values (query head h reads KV head h / group). mha: kd = vd = head_dim; decoupled: kd = d_sem + d_geo per head,
 * vd its V width; MLA's absorbed decode: one KV "head", key [latent | k_rope], value the latent (the row's first vd).
 * A quantized cache stores the key as one or two parts (mha's k; decoupled's k_sem, k_geo; MLA's latent, k_rope),
 * each a row over all KV heads in its own format, and the value as one part (or the first key part: MLA).
 */

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

/* y (n) += p x (n) */
static inline void axpy(float p, const float *x, float *restrict y, int64_t n) {
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    const __m256 pp = _mm256_set1_ps(p);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(pp, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += p * x[i];
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
/* s[g n + t] = scale q_g . K[t] for the `group` queries q (group, kd) of one KV head, keys `ks` floats apart, 4 rows
 * of K at a time (one horizontal reduction per 4 dot products); kd % 8 == 0. */
static inline __attribute__((always_inline)) void scores_by4(const int group, const float *q, const float *keys,
                                                              int64_t kd, int64_t ks, int64_t n, float scale,
                                                              float *s) {
    int64_t t = 0;
    for (; t + 4 <= n; t += 4) {
        const float *k = keys + t * ks;
        for (int g = 0; g < group; g++) {
            __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
            for (int64_t c = 0; c < kd; c += 8) {
                const __m256 qv = _mm256_loadu_ps(q + g * kd + c);
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(k + c), qv, a0);
                a1 = _mm256_fmadd_ps(_mm256_loadu_ps(k + ks + c), qv, a1);
                a2 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 2 * ks + c), qv, a2);
                a3 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 3 * ks + c), qv, a3);
            }
            const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3)); /* rows 0..3, twice */
            const __m128 sums = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
            _mm_storeu_ps(s + g * n + t, _mm_mul_ps(sums, _mm_set1_ps(scale)));
        }
    }
    for (; t < n; t++)
        for (int g = 0; g < group; g++) s[g * n + t] = dot(q + g * kd, keys + t * ks, kd) * scale;
}

/* y (group, vd) = sum over t < n of p[g n + t] V[t] (rows `vs` floats apart), 32 values of each row at a time (then
 * 8 at a time for the rest), the group's sums in registers (each row's 32 values are one pass's); vd % 8 == 0,
 * group <= 4. */
static inline __attribute__((always_inline)) void wsum_by32(const int group, const float *p, const float *values,
                                                             int64_t vd, int64_t vs, int64_t n, float *y) {
    int64_t c = 0;
    for (; c + 32 <= vd; c += 32) {
        __m256 acc[4][4];
        for (int g = 0; g < group; g++)
            for (int j = 0; j < 4; j++) acc[g][j] = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const float *v = values + t * vs + c;
            const __m256 v0 = _mm256_loadu_ps(v), v1 = _mm256_loadu_ps(v + 8), v2 = _mm256_loadu_ps(v + 16);
            const __m256 v3 = _mm256_loadu_ps(v + 24);
            for (int g = 0; g < group; g++) {
                const __m256 w = _mm256_broadcast_ss(p + g * n + t);
                acc[g][0] = _mm256_fmadd_ps(w, v0, acc[g][0]), acc[g][1] = _mm256_fmadd_ps(w, v1, acc[g][1]);
                acc[g][2] = _mm256_fmadd_ps(w, v2, acc[g][2]), acc[g][3] = _mm256_fmadd_ps(w, v3, acc[g][3]);
            }
        }
        for (int g = 0; g < group; g++)
            for (int j = 0; j < 4; j++) _mm256_storeu_ps(y + g * vd + c + 8 * j, acc[g][j]);
    }
    for (; c < vd; c += 8) { /* MLA's latent, e.g. 168 = 5 x 32 + 8 */
        __m256 acc[4];
        for (int g = 0; g < group; g++) acc[g] = _mm256_setzero_ps();
        for (int64_t t = 0; t < n; t++) {
            const __m256 v = _mm256_loadu_ps(values + t * vs + c);
            for (int g = 0; g < group; g++) acc[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * n + t), v, acc[g]);
        }
        for (int g = 0; g < group; g++) _mm256_storeu_ps(y + g * vd + c, acc[g]);
    }
}
#endif

/* A dense layer's rows: key row t of KV head j at k + j * k_head + t * k_row (kd values), its value at
 * v + j * v_head + t * v_row (vd values). */
typedef struct {
    const float *k, *v;
    int64_t k_head, k_row, v_head, v_row;
} dense_t;

/* The attention of one KV head's `group` query heads q (group, kd) over rows 0..n-1 of its keys and values:
 * y (group, vd); s: group x n floats of workspace. */
static inline __attribute__((always_inline)) void attend_kv(const int group, const float *q, const float *keys,
                                                             const float *values, dense_t c, int64_t kd, int64_t vd,
                                                             int64_t n, float scale, float *s, float *y) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (group <= 4 && kd % 8 == 0)
        scores_by4(group, q, keys, kd, c.k_row, n, scale, s);
    else
#endif
        for (int64_t t = 0; t < n; t++)
            for (int g = 0; g < group; g++) s[g * n + t] = dot(q + g * kd, keys + t * c.k_row, kd) * scale;
    for (int g = 0; g < group; g++) softmax_row(s + g * n, n);
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    if (group <= 4 && vd % 8 == 0) {
        wsum_by32(group, s, values, vd, c.v_row, n, y);
        return;
    }
#endif
    memset(y, 0, sizeof(float) * (size_t)(group * vd));
    for (int64_t t = 0; t < n; t++)
        for (int g = 0; g < group; g++) axpy(s[g * n + t], values + t * c.v_row, y + g * vd, vd);
}

/* y (heads, vd) = softmax(scale q K^T) V over rows 0..n-1 of a dense layer's K and V, query head h (kd values of q)
 * reading KV head h / group; scores: heads x n floats of workspace. The query heads of a KV head read its rows
 * together, up to 4 at a time (attend_kv, compiled for 1..4 apart: their sums stay in registers; MLA's 9 heads of one
 * KV "head": 4 + 4 + 1). */
static void attend(const float *q, dense_t c, int64_t heads, int64_t kv_heads, int64_t kd, int64_t vd, int64_t n,
                   float scale, float *scores, float *y) {
    const int64_t group = heads / kv_heads, parts = (group + 3) / 4; /* sub-groups of up to 4 query heads */
#pragma omp parallel for schedule(static) if (n * heads >= 4096)
    for (int64_t i = 0; i < kv_heads * parts; i++) {
        const int64_t j = i / parts, first = j * group + (i % parts) * 4, rest = (j + 1) * group - first;
        const float *qk = q + first * kd, *keys = c.k + j * c.k_head, *values = c.v + j * c.v_head;
        float *s = scores + first * n, *out = y + first * vd;
        switch (rest < 4 ? rest : 4) {
        case 1: attend_kv(1, qk, keys, values, c, kd, vd, n, scale, s, out); break;
        case 2: attend_kv(2, qk, keys, values, c, kd, vd, n, scale, s, out); break;
        case 3: attend_kv(3, qk, keys, values, c, kd, vd, n, scale, s, out); break;
        default: attend_kv(4, qk, keys, values, c, kd, vd, n, scale, s, out);
        }
    }
}

/* A quantized cache's part: token rows of `width` values (all KV heads, `dim` each) in format fmt (qattn.c's codes),
 * tokens 0..stored-1 in quants / scales (scales: block formats only), the newer ones in the float32 ring; a key part
 * lies at `off` in each query head's kd values. */
typedef struct {
    int fmt;
    uint8_t *quants, *scales;
    float *ring;
    int64_t width, dim, off;
} kv_part_t;

typedef struct {
    int64_t seen, stored, ring_slots; /* the cache's counters before this token, its ring */
} kv_state_t;

/* Row t of a part as floats: t < stored decoded from its blocks into buf (qattn.c's row_values: the values
 * attnlab.quant.dequantize gives), t < seen read in the ring (slot t % ring_slots), t == seen the new token's row. */
static inline const float *held_row(const kv_part_t *part, kv_state_t st, int64_t t, const float *new_row,
                                    float *buf) {
    if (t < st.stored) return row_values(part->fmt, part->quants, part->scales, t, part->width, buf);
    if (t < st.seen) return part->ring + (t % st.ring_slots) * part->width;
    return new_row;
}

/* s[h s_stride + j] (+)= scale q_h . row_j[h / group] for a tile of `count` rows (pointers) and every query head h
 * (q_h: `dim` values, heads q_stride apart); 4 rows at a time (one horizontal reduction per 4 dot products) where
 * dim % 8 == 0. `add`: added to s (a second key part), else written. */
static void tile_scores_rows(const float *const *rows, int64_t count, const float *q, int64_t q_stride, int64_t heads,
                             int64_t group, int64_t dim, float scale, float *s, int64_t s_stride, int add) {
    for (int64_t h = 0; h < heads; h++) {
        const float *qh = q + h * q_stride;
        const int64_t offset = (h / group) * dim;
        float *sh = s + h * s_stride;
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
                __m128 sums = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1)),
                                         _mm_set1_ps(scale));
                if (add) sums = _mm_add_ps(sums, _mm_loadu_ps(sh + j));
                _mm_storeu_ps(sh + j, sums);
            }
#endif
        for (; j < count; j++) sh[j] = dot(qh, rows[j] + offset, dim) * scale + (add ? sh[j] : 0.0f);
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

/* y (heads, vd) = softmax(scale q K^T) V over a quantized layer's tokens 0..seen (stored blocks, the ring, then the
 * new token's rows k_new[i] of each key part and v_new), TILE rows decoded at a time into a buffer that stays in L1
 * (each row read and decoded once for all query heads); the key parts' scores summed (then scaled, as qattn.c's
 * attnlab_attend does); scores: heads x (seen + 1) floats of workspace. Returns 0, or -2 (no memory). */
static int attend_quantized(const float *q, int64_t kd, const kv_part_t *K, int n_keys, const float *const *k_new,
                            const kv_part_t *V, const float *v_new, kv_state_t st, int64_t heads, int64_t kv_heads,
                            float scale, float *scores, float *y) {
    const int64_t n = st.seen + 1, group = heads / kv_heads, tiles = (n + TILE - 1) / TILE, vd = V->dim;
    int64_t widest = V->width;
    for (int i = 0; i < n_keys; i++) widest = K[i].width > widest ? K[i].width : widest;
    const int parallel = n * widest >= PARALLEL_MIN;
    const float part_scale = n_keys == 1 ? scale : 1.0f;
    int failed = 0;
    memset(y, 0, sizeof(float) * (size_t)(heads * vd));
#pragma omp parallel if (parallel) reduction(| : failed)
    {
        float *buf = malloc(sizeof(float) * (size_t)(TILE * widest));
        const float *rows[TILE];
        failed = buf == NULL;
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            if (failed) continue;
            const int64_t t0 = tile * TILE, count = n - t0 < TILE ? n - t0 : TILE;
            for (int i = 0; i < n_keys; i++) {
                for (int64_t j = 0; j < count; j++) rows[j] = held_row(&K[i], st, t0 + j, k_new[i], buf + j * widest);
                tile_scores_rows(rows, count, q + K[i].off, kd, heads, group, K[i].dim, part_scale, scores + t0, n,
                                 i > 0);
            }
        }
        free(buf);
    }
    if (failed) return -2;
#pragma omp parallel for schedule(static) if (parallel)
    for (int64_t h = 0; h < heads; h++) {
        if (n_keys > 1)
            for (int64_t t = 0; t < n; t++) scores[h * n + t] *= scale;
        softmax_row(scores + h * n, n);
    }
#pragma omp parallel if (parallel) reduction(| : failed)
    {
        /* Each thread sums its tiles into its own accumulator, then adds it to y. */
        float *buf = malloc(sizeof(float) * (size_t)(TILE * V->width)), *acc = calloc((size_t)(heads * vd), 4);
        const float *rows[TILE];
        failed = buf == NULL || acc == NULL;
#pragma omp for schedule(static)
        for (int64_t tile = 0; tile < tiles; tile++) {
            if (failed) continue;
            const int64_t t0 = tile * TILE, count = n - t0 < TILE ? n - t0 : TILE;
            for (int64_t j = 0; j < count; j++) rows[j] = held_row(V, st, t0 + j, v_new, buf + j * V->width);
            tile_wsum_rows(rows, count, scores + t0, n, heads, group, vd, acc);
        }
#pragma omp critical
        if (!failed)
            for (int64_t i = 0; i < heads * vd; i++) y[i] += acc[i];
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

/* Row x (the part's width) stored as token t of a part, the bytes Codec.encode_into writes: qattn.c's attnlab_quantize
 * for the block formats (nf4: its tables `nf4`); fp16 / bf16 rounded to nearest even (torch's .to, fp16.h). Returns 0,
 * or -3 for a value the format cannot store (block formats: not finite, or a block scale beyond fp16; fp16: a finite
 * value beyond 65504). */
static int store_row(const kv_part_t *part, int64_t t, const float *x, const void *const *nf4) {
    const int64_t width = part->width, nb = width / 32;
    if (part->fmt == 0) {
        memcpy(part->quants + t * width * 4, x, sizeof(float) * (size_t)width);
        return 0;
    }
    if (part->fmt == 1 || part->fmt == 2) {
        uint16_t *row = (uint16_t *)(part->quants + t * width * 2);
        int overflow = 0; /* fp16: a finite value that became inf (beyond 65504) */
        for (int64_t i = 0; i < width; i++) {
            row[i] = part->fmt == 1 ? float_to_half(x[i]) : float_to_bf16(x[i]);
            overflow |= part->fmt == 1 && (row[i] & 0x7fff) == 0x7c00 && isfinite(x[i]);
        }
        return overflow ? -3 : 0;
    }
    const int64_t quant_bytes = part->fmt == 3 ? 32 : 16;
    const uint8_t *below = nf4[0];
    const float *inside = nf4[1];
    const int status = attnlab_quantize(part->fmt, x, 1, 1, width, 0, 0, part->quants + t * nb * quant_bytes, 0, 0,
                                        part->scales + t * nb * 2, 0, 0, below, inside);
    return status ? -3 : 0;
}

/* The tokens [stored, leave) that leave the residual window when a token is written at position seen: whole flushes
 * of the tokens beyond the newest resid (KernelPlan.write's `leave`). */
static inline int64_t leaving(int64_t resid, int64_t flush, int64_t seen, int64_t stored) {
    const int64_t ready = seen + 1 - resid - stored;
    return stored + (ready > 0 ? ready / flush : 0) * flush;
}

/* The new token's rows (one per part) written as KernelPlan.write writes one token at position seen: the tokens
 * leaving the window stored (from the ring, or the new rows when the token itself leaves), else the new rows kept in
 * the ring; the counters [seen, stored] advanced. Returns 0, or -3 (store_row). */
static int store_token(const kv_part_t *parts, int n_parts, const float *const *new_rows, kv_state_t st,
                       int64_t leave, int64_t *counters, const void *const *nf4) {
    for (int i = 0; i < n_parts; i++) {
        const int64_t width = parts[i].width;
        for (int64_t t = st.stored; t < leave; t++) {
            const float *row = t < st.seen ? parts[i].ring + (t % st.ring_slots) * width : new_rows[i];
            if (store_row(&parts[i], t, row, nf4)) return -3;
        }
        if (leave <= st.seen)
            memcpy(parts[i].ring + (st.seen % st.ring_slots) * width, new_rows[i], sizeof(float) * (size_t)width);
    }
    counters[1] = leave, counters[0] = st.seen + 1;
    return 0;
}
