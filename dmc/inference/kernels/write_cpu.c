/* DMC append/merge of one token per (sequence, KV head) into the paged cache, on the CPU, with a
 * merge window (Algorithm 1 lines 4-10, Eq. 9 with hard alpha).
 *
 * Semantics of dmc.inference.kernels.reference.dmc_write_reference (the oracle, which goes
 * through dmc.ops.algorithm1.merge_into_open_slot): append restarts the open slot with the token
 * alone; a merge puts the token into ring row (count mod window); either way the slot becomes the
 * omega-weighted mean of the ring's filled rows, rotated (rotate-half RoPE) at the new token's
 * position and written over the slot's page row. One pass per head over its ring of `window`
 * rows; the Python version runs a dozen batched torch calls of a few KiB each per layer.
 *
 * Layout: pools [num_pages, page_size, head_dim] float32 or bfloat16 (rounded to nearest even);
 * tables [max_seqs, layers, kv_heads, max_pages] int32; open_k, open_v [max_seqs, layers, kv_heads,
 * window, head_dim] float32; open_omega [..., window] float32; open_count [max_seqs, layers,
 * kv_heads] int32; per token: k, v [batch, kv_heads, head_dim] float32, omega [batch, kv_heads]
 * float32, append [batch, kv_heads] int8, slots [batch, kv_heads] int64, seq_slots and positions
 * [batch] int64; inv_freq [head_dim / 2] float32.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_HEAD 1024

static inline uint16_t f32_to_bf16(float x) { /* round to nearest even, NaN kept quiet */
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

static inline void store(void *pool, int64_t index, const float *row, int64_t n, int bf16) {
    if (bf16)
        for (int64_t d = 0; d < n; ++d) ((uint16_t *)pool)[index + d] = f32_to_bf16(row[d]);
    else
        memcpy((float *)pool + index, row, sizeof(float) * n);
}

void dmc_write_window(void *k_pages, void *v_pages, const int32_t *tables, float *open_k,
                      float *open_v, float *open_omega, int32_t *open_count,
                      const float *inv_freq, int64_t window, int64_t layer,
                      const int64_t *seq_slots, const int64_t *slots, const int8_t *append,
                      const float *k, const float *v, const float *omega,
                      const int64_t *positions, int64_t batch, int64_t kv_heads,
                      int64_t layers, int64_t max_pages, int64_t head_dim, int64_t page_size,
                      int64_t is_bf16, int64_t threads) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t row = 0; row < batch * kv_heads; ++row) {
        const int64_t b = row / kv_heads, h = row % kv_heads;
        const int64_t state = (seq_slots[b] * layers + layer) * kv_heads + h;
        float *ring_k = open_k + state * window * head_dim;
        float *ring_v = open_v + state * window * head_dim;
        float *ring_omega = open_omega + state * window;
        const int64_t count = append[row] ? 0 : open_count[state];
        const int64_t put = count % window;
        memcpy(ring_k + put * head_dim, k + row * head_dim, sizeof(float) * head_dim);
        memcpy(ring_v + put * head_dim, v + row * head_dim, sizeof(float) * head_dim);
        ring_omega[put] = omega[row];
        open_count[state] = (int32_t)(count + 1);
        const int64_t filled = count + 1 < window ? count + 1 : window;
        float mean_k[MAX_HEAD], mean_v[MAX_HEAD], rotated[MAX_HEAD], total = 0.0f;
        memset(mean_k, 0, sizeof(float) * head_dim);
        memset(mean_v, 0, sizeof(float) * head_dim);
        for (int64_t r = 0; r < filled; ++r) {
            const float weight = ring_omega[r];
            total += weight;
            for (int64_t d = 0; d < head_dim; ++d) {
                mean_k[d] += weight * ring_k[r * head_dim + d];
                mean_v[d] += weight * ring_v[r * head_dim + d];
            }
        }
        for (int64_t d = 0; d < head_dim; ++d) {
            mean_k[d] /= total;
            mean_v[d] /= total;
        }
        const float position = (float)positions[b];
        for (int64_t d = 0; d < half; ++d) {
            const float angle = position * inv_freq[d];
            const float c = cosf(angle), s = sinf(angle);
            rotated[d] = mean_k[d] * c - mean_k[d + half] * s;
            rotated[d + half] = mean_k[d + half] * c + mean_k[d] * s;
        }
        const int64_t slot = slots[row];
        const int64_t page = tables[state * max_pages + slot / page_size];
        const int64_t index = (page * page_size + slot % page_size) * head_dim;
        store(k_pages, index, rotated, head_dim, (int)is_bf16);
        store(v_pages, index, mean_v, head_dim, (int)is_bf16);
    }
}

/* DMS decode write of one token per (sequence, KV head) (delayed eviction, DMS paper Sec. 3;
 * semantics of DMSPagedCache.decode_write's PyTorch path, which stays the oracle): at position
 * p, token p - 1's ring row takes the decision `evict` (row (p - 1) mod (w + 1); p = 0 writes 0);
 * when p >= w + 1 token p - w - 1 leaves its ring row p mod (w + 1) for slot `length` of its
 * head's pages (page reserved by the caller), and `length` grows by one unless it was evicted;
 * then token p takes that ring row with its flag cleared. Rings [max_seqs, layers, kv_heads,
 * w + 1, head_dim] and pools in the cache dtype, ring_evict [..., w + 1] bytes, lengths int32;
 * keys, values [batch, kv_heads, head_dim] float32 (rotated), evict [batch, kv_heads] int8. */
void dms_write_token(void *k_pages, void *v_pages, const int32_t *tables, int32_t *lengths,
                     void *ring_k, void *ring_v, uint8_t *ring_evict, const float *keys,
                     const float *values, const int8_t *evict, const int64_t *seq_slots,
                     const int64_t *positions, int64_t layer, int64_t batch, int64_t kv_heads,
                     int64_t layers, int64_t max_pages, int64_t ring_size, int64_t head_dim,
                     int64_t page_size, int64_t is_bf16, int64_t threads) {
    const int64_t element = is_bf16 ? 2 : 4, row_bytes = head_dim * element;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t row = 0; row < batch * kv_heads; ++row) {
        const int64_t b = row / kv_heads, h = row % kv_heads, p = positions[b];
        const int64_t state = (seq_slots[b] * layers + layer) * kv_heads + h;
        uint8_t *flags = ring_evict + state * ring_size;
        flags[((p - 1) % ring_size + ring_size) % ring_size] = p > 0 && evict[row];
        const int64_t ring_row = (state * ring_size + p % ring_size) * head_dim;
        if (p >= ring_size) {
            const int keep = !flags[p % ring_size];
            const int64_t length = lengths[state];
            const int64_t page = tables[state * max_pages + length / page_size];
            const int64_t slot = (page * page_size + length % page_size) * head_dim;
            memcpy((char *)k_pages + slot * element, (char *)ring_k + ring_row * element,
                   row_bytes);
            memcpy((char *)v_pages + slot * element, (char *)ring_v + ring_row * element,
                   row_bytes);
            lengths[state] = (int32_t)(length + keep);
        }
        store(ring_k, ring_row, keys + row * head_dim, head_dim, (int)is_bf16);
        store(ring_v, ring_row, values + row * head_dim, head_dim, (int)is_bf16);
        flags[p % ring_size] = 0;
    }
}
