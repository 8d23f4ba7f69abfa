/* The bounded memory's sequential routing decisions (attnlab.cache.banks), in C: the loops over a chunk's
 * candidates that the PyTorch path runs one candidate at a time (about 20 small torch ops each, per layer).
 * Decisions only (slot indices, positions, recency): the values, and their gradients, stay in PyTorch.
 *
 *   attnlab_exact_routing    the exact bank's novelty-filtered LRU (banks.exact_routing), given the cosines the
 *                            PyTorch path computes: the same comparisons on the same floats, so the same result.
 *   attnlab_summary_routing  the summary bank's slot for each candidate (banks.BoundedCache._update_summary):
 *                            the LF-K cosines with the prototypes, which each candidate moves before the next one
 *                            is routed; the prototypes' routing channels are blended here as the PyTorch path
 *                            blends them (b + eta * (x - b), unit-normalised), summed in another order.
 *
 * Every sequence of the batch is independent. Ties go to the lowest slot, as torch.max / argmax / argmin pick
 * them. Built and loaded by attnlab.kernels.cpu.routing.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* to_bank (B, E, M) cosines of each candidate with each slot's token before the chunk, to_candidate (B, E, E)
 * among candidates; positions (E,); passed (B, E); slot_positions, last_used (B, M) updated in place (-1: an
 * empty slot); source (B, M) out: the candidate now in each slot (-1: it kept its token); taken (B, E) out: the
 * slot each candidate took (-1: none). */
int attnlab_exact_routing(int64_t batch, int64_t count, int64_t slots, const float *to_bank,
                          const float *to_candidate, const int64_t *positions, const uint8_t *passed,
                          int64_t *slot_positions, int64_t *last_used, int64_t *source, int64_t *taken,
                          float tau_novel, float tau_match) {
    for (int64_t b = 0; b < batch; b++) {
        int64_t *held = slot_positions + b * slots, *recency = last_used + b * slots, *src = source + b * slots;
        for (int64_t m = 0; m < slots; m++) src[m] = -1;
        for (int64_t j = 0; j < count; j++) {
            const float *bank_row = to_bank + (b * count + j) * slots;
            const float *cand_row = to_candidate + (b * count + j) * count;
            float best = -INFINITY;
            int64_t best_slot = 0, free_slot = -1, victim = -1;
            for (int64_t m = 0; m < slots; m++) {
                if (held[m] < 0) {
                    if (free_slot < 0) free_slot = m;
                    continue;
                }
                float s = src[m] >= 0 ? cand_row[src[m]] : bank_row[m];
                if (s > best) best = s, best_slot = m;
                if (victim < 0 || recency[m] < recency[victim]) victim = m;
            }
            int ok = passed[b * count + j] != 0;
            int novel = ok && best < tau_novel, hit = ok && best >= tau_match;
            int64_t target = novel ? (free_slot >= 0 ? free_slot : victim) : best_slot;
            taken[b * count + j] = novel ? target : -1;
            if (novel) src[target] = j, held[target] = positions[j];
            if (novel || hit) recency[target] = positions[j];
        }
    }
    return 0;
}

static void unit_row(const float *x, float *out, int64_t width) {
    float norm = 0.0f;
    for (int64_t i = 0; i < width; i++) norm += x[i] * x[i];
    norm = sqrtf(norm);
    float inv = 1.0f / (norm > 1e-12f ? norm : 1e-12f);
    for (int64_t i = 0; i < width; i++) out[i] = x[i] * inv;
}

/* units (B, H, E, d): each candidate's unit LF-K vector per KV head; keys (B, H, E, d): the routing channels it
 * blends in; bank (B, H, M, d): the prototypes' routing channels before the chunk, updated in place; rates
 * (B, H, E): eta = sigmoid(eta_logit) * g; passed (B, E); used (B, M) updated in place; argmax: the authors'
 * routing (the best of every slot, an empty one scoring 0), else attnlab's novelty routing; tau_novel is per
 * head times the heads (the cosines are summed over heads). slot (B, E) out: the slot each candidate opened or
 * moved (-1: none); opens (B, E) out: it opened an empty slot (eta = 1). */
int attnlab_summary_routing(int64_t batch, int64_t heads, int64_t count, int64_t slots, int64_t width,
                            const float *units, const float *keys, float *bank, const float *rates,
                            const uint8_t *passed, uint8_t *used, int argmax, float tau_novel, int64_t *slot,
                            uint8_t *opens) {
    float *protos = malloc(sizeof(float) * (size_t)(heads * slots * width));
    float *similarity = malloc(sizeof(float) * (size_t)slots);
    if (!protos || !similarity) {
        free(protos), free(similarity);
        return 1;
    }
    for (int64_t b = 0; b < batch; b++) {
        uint8_t *in_use = used + b * slots;
        for (int64_t h = 0; h < heads; h++)
            for (int64_t m = 0; m < slots; m++)
                unit_row(bank + ((b * heads + h) * slots + m) * width, protos + (h * slots + m) * width, width);
        for (int64_t j = 0; j < count; j++) {
            for (int64_t m = 0; m < slots; m++) similarity[m] = 0.0f;
            for (int64_t h = 0; h < heads; h++) {
                const float *u = units + ((b * heads + h) * count + j) * width;
                for (int64_t m = 0; m < slots; m++) {
                    const float *p = protos + (h * slots + m) * width;
                    float dot = 0.0f;
                    for (int64_t i = 0; i < width; i++) dot += u[i] * p[i];
                    similarity[m] += dot;
                }
            }
            int64_t target = 0, free_slot = -1;
            int open;
            if (argmax) {
                float best = 0.0f;
                for (int64_t m = 0; m < slots; m++) {
                    float s = in_use[m] ? similarity[m] : 0.0f;
                    if (m == 0 || s > best) best = s, target = m;
                }
                open = !in_use[target];
            } else {
                float best = -INFINITY;
                for (int64_t m = 0; m < slots; m++) {
                    if (!in_use[m]) {
                        if (free_slot < 0) free_slot = m;
                    } else if (similarity[m] > best) {
                        best = similarity[m], target = m;
                    }
                }
                open = best < tau_novel && free_slot >= 0;
                if (open) target = free_slot;
            }
            int acts = passed[b * count + j] != 0;
            slot[b * count + j] = acts ? target : -1;
            opens[b * count + j] = (uint8_t)(acts && open);
            if (!acts) continue;
            for (int64_t h = 0; h < heads; h++) {
                float eta = open ? 1.0f : rates[(b * heads + h) * count + j];
                float *row = bank + ((b * heads + h) * slots + target) * width;
                const float *x = keys + ((b * heads + h) * count + j) * width;
                for (int64_t i = 0; i < width; i++) row[i] = row[i] + eta * (x[i] - row[i]);
                unit_row(row, protos + (h * slots + target) * width, width);
            }
            in_use[target] = 1;
        }
    }
    free(protos), free(similarity);
    return 0;
}
