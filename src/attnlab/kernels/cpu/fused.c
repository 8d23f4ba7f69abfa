/* One decode step of a Llama-style block stack in one call (attnlab.model.fused): batch 1, one new token.
 *
 *   x = embed[token]
 *   for each block:  h = rms_norm(x) attn_norm;  q (heads, kd), the new token's K (kv_heads, kd) and V rows
 *                    (kv_heads, vd) from h by the block's attention kind (project below), RoPE at `pos`
 *                    K[pos], V[pos] = k, v (the dense cache's buffers, slot = position); slot_positions[pos] = pos
 *                    y = softmax(scale q K[0..pos]^T) V[0..pos] per query head (head h reads KV head h / G)
 *                    (or a quantized cache: fused_attn.c's attend_quantized and store_token)
 *                    x += out(y);  x += down(silu(gate) * up), gate | up = gate_up(rms_norm(x) mlp_norm)
 *   logits = lm_head(rms_norm(x) norm), and their argmax over the first vocab_size
 *
 * Attention kinds (P_KIND): mha (GQA: qkv = [q | k | v], RoPE on every head, kd = vd = head_dim); decoupled (DBA:
 * proj = [q_sem (absent if tied: q_sem = k_sem) | q_geo | k_sem | k_geo | v], q = [q_sem s_sem | q_geo s_geo] with
 * per-head factors L_Q_SCALES (the gate's 2g and 2(1 - g) in them), k = [k_sem | k_geo], RoPE on the geo parts only,
 * score scale 1, kd = sem + geo, vd = the V width); MLA's absorbed decode (q_proj -> per head [q_nope | q_rope],
 * kv_down -> [latent (L_KV_NORM's RMSNorm if given) | k_rope], RoPE on q_rope and k_rope; the query on the latent
 * q_lat = W_uk,h^T q_nope; one cached row [latent | k_rope] read by every head as K, its latent as V (vd = d_latent);
 * then y_h = W_uv,h y_h; W_uk, W_uv float32 rows).
 *
 * A linear layer is a QuantizedLinear with 8-bit activations over packed rows (qmatmul.c's attnlab_qmatmul_q8p):
 * its input quantized by quantize_row_q8 and each group of 16 rows multiplied by group_q8, the same functions, so
 * a layer given the same input gives the same bits; or float32 / fp16 rows with float32 activations (matvec_float).
 * The rest (RMSNorm, RoPE, softmax, SiLU) is float32 arithmetic as attnlab's PyTorch ops do it, summed in another
 * order (RoPE: the same products and differences, rounded alike: this file is built with -ffp-contract=off).
 *
 * A block's cache is either the dense float32 one (L_QUANTIZED 0: L_K, L_V (kv_heads, slots, kd | vd), MLA's one
 * buffer (slots, kd) in both, and slot positions) or a QuantizedCache of per-token rows (attnlab.cache.quantized,
 * L_QUANTIZED 1): a token's row of each part over all KV heads stored in its part's format (qattn.c's codes: fp32,
 * fp16, bf16, q8_0, q4_0, nf4) once it has left the full-precision residual ring, read by qattn.c's row_values and
 * written by qattn.c's attnlab_quantize (the quantizer of the cache's own writes), so the stored bytes are what the
 * cache's eager or compiled step stores.
 *
 * The model arrives as a plan, int64 values (attnlab.model.fused builds it once per cache; pointers as integers):
 * PLAN_HEADER values, then PLAN_LAYER values per block, in the orders of the enums below. Formats are qmatmul.c's
 * (ggml's type ids); the embedding's 0 means a float32 table.
 */
#include "qmatmul.c"
#include "qattn.c"
#include "fused_attn.c"

enum {
    P_LAYERS, P_D_MODEL, P_HEADS, P_KV_HEADS, P_KIND, P_KEY_DIM, P_VALUE_DIM, P_OUT_DIM, P_SEM_DIM, P_ROPE_DIM,
    P_TIED, P_HIDDEN, P_SLOTS, P_ROPE_LEN, P_INTERLEAVED, P_VOCAB_ROWS, P_VOCAB_SIZE, P_EMBED_FMT, P_EMBED,
    P_EMBED_ROWS, P_NORM, P_HEAD_FMT, P_HEAD, P_HEAD_BIAS, P_NF4_BELOW, P_NF4_INSIDE, PLAN_HEADER
};
/* P_SEM_DIM: decoupled's per-head d_sem, MLA's head_dim (q_nope); P_ROPE_DIM: the rotated width at the end of a key
 * head (mha: head_dim; decoupled: d_geo, or 0 without RoPE; MLA: d_rope); P_OUT_DIM: a head's width into `out`. */
enum { KIND_MHA, KIND_DECOUPLED, KIND_MLA };
/* L_QKV: mha's qkv, decoupled's proj, MLA's q_proj (L_KV: MLA's kv_down). A quantized cache's layer: L_SLOT_POSITIONS
 * its counters [seen, stored, max_len] (advanced here), then 3 parts of PART_VALUES (K0, K1 (format -1: none), V
 * (format -1: the first vd values of K0's rows, MLA)) and KernelPlan's ring, resid, flush and store slots. */
enum { PART_FMT, PART_QUANTS, PART_SCALES, PART_RING, PART_DIM, PART_VALUES };
enum {
    L_ATTN_NORM, L_QKV_FMT, L_QKV, L_QKV_BIAS, L_KV_FMT, L_KV, L_KV_BIAS, L_OUT_FMT, L_OUT, L_OUT_BIAS, L_MLP_NORM,
    L_GATE_UP_FMT, L_GATE_UP, L_GATE_UP_BIAS, L_DOWN_FMT, L_DOWN, L_DOWN_BIAS, L_Q_SCALES, L_KV_NORM, L_UK, L_UV,
    L_COS, L_SIN, L_K, L_V, L_SLOT_POSITIONS, L_QUANTIZED, L_PARTS, L_RING_SLOTS = L_PARTS + 3 * PART_VALUES, L_RESID,
    L_FLUSH, L_STORE_SLOTS, PLAN_LAYER
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

/* Rows of the attention's input projections: mha's qkv, decoupled's proj, MLA's q_proj + kv_down. */
static int64_t projected(const int64_t *plan) {
    const int64_t heads = plan[P_HEADS], kv = plan[P_KV_HEADS], kd = plan[P_KEY_DIM], vd = plan[P_VALUE_DIM];
    const int64_t sem = plan[P_SEM_DIM], rd = plan[P_ROPE_DIM];
    switch (plan[P_KIND]) {
    case KIND_DECOUPLED: return (plan[P_TIED] ? 0 : heads * sem) + heads * (kd - sem) + kv * (kd + vd);
    case KIND_MLA: return heads * (sem + rd) + kd;
    default: return (heads + 2 * kv) * kd;
    }
}

/* The new token's queries q (heads, kd) and rows rows[0..2] (its key parts K0, K1 (NULL: none) and V (NULL: K0's
 * rows), each over all KV heads) from h through the block's projections into proj (`projected` floats). */
static void project(const int64_t *plan, const int64_t *p, const float *h, codes_t c, int64_t pos, float eps,
                    float *proj, float *q, const float **rows) {
    const int64_t d = plan[P_D_MODEL], heads = plan[P_HEADS], kv = plan[P_KV_HEADS], kd = plan[P_KEY_DIM];
    const int64_t rd = plan[P_ROPE_DIM], sem = plan[P_SEM_DIM], kind = plan[P_KIND];
    const int interleaved = (int)plan[P_INTERLEAVED];
    const float *cos = AT(const float *, p[L_COS]) + pos * (rd / 2);
    const float *sin = AT(const float *, p[L_SIN]) + pos * (rd / 2);
    const int64_t q_rows = kind == KIND_MLA ? heads * (sem + rd) : projected(plan);
    matvec((int)p[L_QKV_FMT], AT(const uint8_t *, p[L_QKV]), q_rows, d, h, c, proj, AT(const float *, p[L_QKV_BIAS]));
    if (kind == KIND_MHA) {
        for (int64_t head = 0; head < heads + kv; head++) rotate(proj + head * kd, cos, sin, kd, interleaved);
        memcpy(q, proj, sizeof(float) * (size_t)(heads * kd));
        rows[0] = proj + heads * kd, rows[1] = NULL, rows[2] = proj + (heads + kv) * kd;
    } else if (kind == KIND_DECOUPLED) {
        const int64_t geo = kd - sem;
        float *q_geo = proj + (plan[P_TIED] ? 0 : heads * sem), *k_sem = q_geo + heads * geo, *k_geo = k_sem + kv * sem;
        const float *q_sem = plan[P_TIED] ? k_sem : proj, *scales = AT(const float *, p[L_Q_SCALES]); /* (heads, 2) */
        for (int64_t head = 0; rd && head < heads + kv; head++)
            rotate(head < heads ? q_geo + head * geo : k_geo + (head - heads) * geo, cos, sin, geo, interleaved);
        for (int64_t head = 0; head < heads; head++) {
            float *qh = q + head * kd;
            for (int64_t i = 0; i < sem; i++) qh[i] = q_sem[head * sem + i] * scales[2 * head];
            for (int64_t i = 0; i < geo; i++) qh[sem + i] = q_geo[head * geo + i] * scales[2 * head + 1];
        }
        rows[0] = k_sem, rows[1] = k_geo, rows[2] = k_geo + kv * geo;
    } else {
        const int64_t latent = kd - rd, width = sem + rd;
        float *row = proj + heads * width; /* [latent | k_rope] */
        matvec((int)p[L_KV_FMT], AT(const uint8_t *, p[L_KV]), kd, d, h, c, row, AT(const float *, p[L_KV_BIAS]));
        if (p[L_KV_NORM]) rms_norm(row, AT(const float *, p[L_KV_NORM]), latent, eps, row);
        rotate(row + latent, cos, sin, rd, interleaved);
        const float *uk = AT(const float *, p[L_UK]); /* (heads, sem, latent) */
        for (int64_t head = 0; head < heads; head++) {
            float *qh = q + head * kd, *q_nope = proj + head * width;
            rotate(q_nope + sem, cos, sin, rd, interleaved);
            memset(qh, 0, sizeof(float) * (size_t)latent);
            for (int64_t i = 0; i < sem; i++) axpy(q_nope[i], uk + (head * sem + i) * latent, qh, latent);
            memcpy(qh + latent, q_nope + sem, sizeof(float) * (size_t)rd);
        }
        rows[0] = row, rows[1] = row + latent, rows[2] = NULL;
    }
}

/* A quantized layer's part i (plan values at L_PARTS + i PART_VALUES), its key offset `off`. */
static kv_part_t part_of(const int64_t *p, int i, int64_t kv_heads, int64_t off) {
    const int64_t *v = p + L_PARTS + i * PART_VALUES;
    kv_part_t part = {(int)v[PART_FMT], AT(uint8_t *, v[PART_QUANTS]), AT(uint8_t *, v[PART_SCALES]),
                      AT(float *, v[PART_RING]), kv_heads * v[PART_DIM], v[PART_DIM], off};
    return part;
}

/* y (heads, vd) = the attention of q over the layer's cache after the new token's rows are written into it.
 * Returns 0, or -2 / -3 (attend_quantized, store_token). */
static int attention(const int64_t *plan, const int64_t *p, const float *q, const float *const *rows, int64_t pos,
                     float scale, float *scores, float *y) {
    const int64_t heads = plan[P_HEADS], kv = plan[P_KV_HEADS], kd = plan[P_KEY_DIM], vd = plan[P_VALUE_DIM];
    const int64_t slots = plan[P_SLOTS];
    if (p[L_QUANTIZED]) {
        int64_t *counters = AT(int64_t *, p[L_SLOT_POSITIONS]);
        kv_part_t parts[3] = {part_of(p, 0, kv, 0), {0}, part_of(p, 2, kv, 0)};
        parts[1] = part_of(p, 1, kv, parts[0].dim);
        const int n_keys = parts[1].fmt >= 0 ? 2 : 1, own_v = parts[2].fmt >= 0;
        const kv_state_t st = {pos, counters[1], p[L_RING_SLOTS]};
        int status = attend_quantized(q, kd, parts, n_keys, rows, own_v ? &parts[2] : &parts[0],
                                      own_v ? rows[2] : rows[0], st, heads, kv, scale, scores, y);
        if (status) return status;
        kv_part_t written[3];
        const float *new_rows[3];
        int n = 0;
        for (int i = 0; i < 3; i++)
            if (parts[i].fmt >= 0) written[n] = parts[i], new_rows[n++] = rows[i];
        const void *nf4[2] = {AT(const void *, plan[P_NF4_BELOW]), AT(const void *, plan[P_NF4_INSIDE])};
        const int64_t leave = leaving(p[L_RESID], p[L_FLUSH], pos, counters[1]);
        return store_token(written, n, new_rows, st, leave, counters, nf4);
    }
    float *K = AT(float *, p[L_K]), *V = AT(float *, p[L_V]);
    if (plan[P_KIND] == KIND_MLA) { /* one row [latent | k_rope] per token: K, its first vd values V */
        memcpy(K + pos * kd, rows[0], sizeof(float) * (size_t)kd);
        const dense_t c = {K, K, 0, kd, 0, kd};
        AT(int64_t *, p[L_SLOT_POSITIONS])[pos] = pos;
        attend(q, c, heads, kv, kd, vd, pos + 1, scale, scores, y);
        return 0;
    }
    const int64_t first = rows[1] ? plan[P_SEM_DIM] : kd; /* K0's width per head (decoupled: d_sem) */
    for (int64_t j = 0; j < kv; j++) {
        float *k = K + (j * slots + pos) * kd;
        memcpy(k, rows[0] + j * first, sizeof(float) * (size_t)first);
        if (rows[1]) memcpy(k + first, rows[1] + j * (kd - first), sizeof(float) * (size_t)(kd - first));
        memcpy(V + (j * slots + pos) * vd, rows[2] + j * vd, sizeof(float) * (size_t)vd);
    }
    AT(int64_t *, p[L_SLOT_POSITIONS])[pos] = pos;
    const dense_t c = {K, V, slots * kd, kd, slots * vd, vd};
    attend(q, c, heads, kv, kd, vd, pos + 1, scale, scores, y);
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
    const int64_t layers = plan[P_LAYERS], d = plan[P_D_MODEL], heads = plan[P_HEADS], hidden = plan[P_HIDDEN];
    const int64_t kd = plan[P_KEY_DIM], vd = plan[P_VALUE_DIM], od = plan[P_OUT_DIM], slots = plan[P_SLOTS];
    if (pos < 0 || pos >= slots || pos >= plan[P_ROPE_LEN] || token < 0 || token >= plan[P_EMBED_ROWS]) return -1;
    for (int64_t l = 0; l < layers; l++) { /* checked before anything is written */
        const int64_t *p = plan + PLAN_HEADER + l * PLAN_LAYER, *counters = AT(const int64_t *, p[L_SLOT_POSITIONS]);
        if (p[L_QUANTIZED] && (counters[0] != pos || pos >= counters[2] ||
                               leaving(p[L_RESID], p[L_FLUSH], pos, counters[1]) > p[L_STORE_SLOTS]))
            return -1;
    }
    const int64_t widest = max3(d, heads * od, hidden), mla = plan[P_KIND] == KIND_MLA;
    const int64_t floats =
        2 * d + projected(plan) + heads * (kd + vd + od) + 2 * hidden + heads * (pos + 1) + widest / 32;
    float *buffer = malloc(sizeof(float) * (size_t)floats);
    codes_t c = {malloc((size_t)widest), NULL, malloc(sizeof(int32_t) * (size_t)(widest / 32))};
    if (!buffer || !c.xq || !c.xs) {
        free(buffer), free(c.xq), free(c.xs);
        return -2;
    }
    float *x = buffer, *h = x + d, *proj = h + d, *q = proj + projected(plan), *attended = q + heads * kd;
    float *y = attended + heads * vd, *gate_up = y + heads * od, *scores = gate_up + 2 * hidden;
    c.xd = scores + heads * (pos + 1);

    const int embed_fmt = (int)plan[P_EMBED_FMT];
    if (embed_fmt == 0)
        memcpy(x, AT(const float *, plan[P_EMBED]) + token * d, sizeof(float) * (size_t)d);
    else
        attnlab_dequantize(embed_fmt, AT(const uint8_t *, plan[P_EMBED]) + token * (d / 32) * block_bytes(embed_fmt),
                           1, d, x);

    for (int64_t l = 0; l < layers; l++) {
        const int64_t *p = plan + PLAN_HEADER + l * PLAN_LAYER;
        const float *rows[3];
        rms_norm(x, AT(const float *, p[L_ATTN_NORM]), d, eps, h);
        project(plan, p, h, c, pos, eps, proj, q, rows);
        const int status = attention(plan, p, q, rows, pos, scale, scores, mla ? attended : y);
        if (status) {
            free(buffer), free(c.xq), free(c.xs);
            return status;
        }
        for (int64_t head = 0; mla && head < heads; head++) /* y_h = W_uv,h (the attended latent) */
            matvec_float(F32, AT(const uint8_t *, p[L_UV]) + sizeof(float) * (size_t)(head * od * vd), od, vd,
                         attended + head * vd, y + head * od, NULL);
        matvec((int)p[L_OUT_FMT], AT(const uint8_t *, p[L_OUT]), d, heads * od, y, c, h,
               AT(const float *, p[L_OUT_BIAS]));
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
