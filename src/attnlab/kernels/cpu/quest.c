/* A quest decode step in one call (attnlab.cache.sparse.QuestCache.attend_one, fp32 buffers): for each KV head,
 * the upper bound of q.k over every complete page from the page's per-channel key extremes (summed over the
 * head's group of query heads), the top K candidate pages, then softmax attention of each query head of the group
 * over the chosen pages' rows, the recent window and the sink tokens, read in place from the cache's buffers.
 * No row is copied and nothing but the chosen rows is read: the PyTorch path sorts the bounds, gathers the rows
 * into new tensors and runs SDPA with a mask (about ten small ops per layer).
 *
 * Selection as attnlab.cache.sparse.top_pages: candidates are the pages holding a token older than the window
 * (page * P <= t - W) that are not all sinks (page * P + P > sinks); the K largest bounds, ties to the earlier
 * page. A chosen page's tokens that are sinks or in the window are read through those instead (once). Bounds are
 * summed in another order than PyTorch's matmuls, so a near-tie between two pages may be broken the other way.
 * Built and loaded by attnlab.kernels.cpu.quest.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>

static float dot(const float *a, const float *b, int64_t n) {
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = 0; i < n; i++) acc += a[i] * b[i];
    return acc;
}

/* q (B, H, dk) contiguous, H = kv_heads * group; k, v: element strides per sequence, KV head and row (the row's
 * values contiguous; v's first dv values are read); key_min, key_max: (pages, dk) rows contiguous per sequence and
 * KV head, at the strides given; t: the query's position (rows 0..t are held); out (B, H, dv) contiguous. Returns
 * 0, or 1 when scratch memory cannot be allocated. */
int attnlab_quest_attend(int64_t batch, int64_t kv_heads, int64_t group, int64_t dk, int64_t dv, const float *q,
                         const float *k, int64_t k_b, int64_t k_h, int64_t k_r, const float *v, int64_t v_b,
                         int64_t v_h, int64_t v_r, const float *key_min, const float *key_max, int64_t e_b,
                         int64_t e_h, int64_t pages, int64_t t, int64_t page_size, int64_t window, int64_t sinks,
                         int64_t top, float scale, float *out) {
    int failed = 0;
    const int64_t most = top * page_size + window + sinks;  /* rows one head reads at most */
#pragma omp parallel for collapse(2) schedule(static) reduction(| : failed)
    for (int64_t b = 0; b < batch; b++) {
        for (int64_t h = 0; h < kv_heads; h++) {
            int64_t *chosen = malloc(sizeof(int64_t) * (size_t)(top > 0 ? top : 1));
            float *best = malloc(sizeof(float) * (size_t)(top > 0 ? top : 1));
            int64_t *rows = malloc(sizeof(int64_t) * (size_t)most);
            float *s = malloc(sizeof(float) * (size_t)most);
            if (!chosen || !best || !rows || !s) {
                failed = 1;
                free(chosen), free(best), free(rows), free(s);
                continue;
            }
            const float *qh = q + (b * kv_heads + h) * group * dk;
            const float *lo = key_min + b * e_b + h * e_h, *hi = key_max + b * e_b + h * e_h;
            /* the top K candidate pages by bound, kept sorted (descending; a later page enters only if greater) */
            int64_t taken = 0;
            for (int64_t j = 0; j < pages; j++) {
                if (!(j * page_size <= t - window && j * page_size + page_size > sinks)) continue;
                float u = 0.0f;
                for (int64_t g = 0; g < group; g++) {
                    const float *qg = qh + g * dk, *mn = lo + j * dk, *mx = hi + j * dk;
                    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
                    for (int64_t i = 0; i < dk; i++) acc += qg[i] > 0.0f ? qg[i] * mx[i] : qg[i] * mn[i];
                    u += acc;
                }
                if (taken == top && !(u > best[top - 1])) continue;
                int64_t at = taken < top ? taken++ : top - 1;
                while (at > 0 && u > best[at - 1]) best[at] = best[at - 1], chosen[at] = chosen[at - 1], at--;
                best[at] = u, chosen[at] = j;
            }
            int64_t n = 0;
            for (int64_t c = 0; c < taken; c++)
                for (int64_t r = chosen[c] * page_size; r < chosen[c] * page_size + page_size; r++)
                    if (r >= sinks && r <= t - window) rows[n++] = r;
            for (int64_t r = t - window + 1; r <= t; r++) rows[n++] = r;
            for (int64_t r = 0; r < sinks; r++) rows[n++] = r;
            const float *kh = k + b * k_b + h * k_h, *vh = v + b * v_b + h * v_h;
            for (int64_t g = 0; g < group; g++) {
                const float *qg = qh + g * dk;
                float top_score = -INFINITY;
                for (int64_t i = 0; i < n; i++) {
                    s[i] = dot(qg, kh + rows[i] * k_r, dk) * scale;
                    if (s[i] > top_score) top_score = s[i];
                }
                float total = 0.0f;
                for (int64_t i = 0; i < n; i++) total += s[i] = expf(s[i] - top_score);
                float *o = out + ((b * kv_heads + h) * group + g) * dv;
                for (int64_t d = 0; d < dv; d++) o[d] = 0.0f;
                for (int64_t i = 0; i < n; i++) {
                    const float p = s[i] / total, *row = vh + rows[i] * v_r;
#pragma omp simd
                    for (int64_t d = 0; d < dv; d++) o[d] += p * row[d];
                }
            }
            free(chosen), free(best), free(rows), free(s);
        }
    }
    return failed;
}
