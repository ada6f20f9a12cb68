/* DMC append/merge of one token per (sequence, KV head) into the paged cache, on the CPU, with a
 * merge window (Algorithm 1 lines 4-10, Eq. 9 with hard alpha); the decode writes of DMS and of
 * DMC with delayed merging, which move a token out of a window ring.
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
 * window, head_dim] float32 or bfloat16 (the dtype of a bfloat16 model's keys, which it holds
 * exactly; the mean is taken in float32); open_omega [..., window] float32; open_count
 * [max_seqs, layers, kv_heads] int32; per token: k, v [batch, kv_heads, head_dim] float32,
 * omega [batch, kv_heads] float32, append [batch, kv_heads] int8, slots [batch, kv_heads]
 * int64, seq_slots and positions [batch] int64; the cosines and sines of each token's RoPE
 * angles, cos, sin [batch, head_dim / 2] float32 (dmc.ops.rope.rope_angles), computed once per
 * position for all its heads (per head, cosf and sinf took about a quarter of the write's time
 * at head_dim 16 and 64).
 */
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

static inline void load(const void *pool, int64_t index, float *row, int64_t n, int bf16) {
    if (bf16)
        for (int64_t d = 0; d < n; ++d) {
            const uint32_t bits = (uint32_t)((const uint16_t *)pool)[index + d] << 16;
            memcpy(row + d, &bits, sizeof bits);
        }
    else
        memcpy(row, (const float *)pool + index, sizeof(float) * n);
}

/* rotate-half RoPE of x [head_dim] into out, by the angles of cosines cos and sines sin [head_dim
 * / 2]; sign -1 rotates back by them (the sines of the negated angles) */
static inline void rope(const float *x, float *out, const float *cos, const float *sin,
                        float sign, int64_t half) {
    for (int64_t d = 0; d < half; ++d) {
        const float c = cos[d], s = sign * sin[d];
        out[d] = x[d] * c - x[d + half] * s;
        out[d + half] = x[d + half] * c + x[d] * s;
    }
}

/* The page of the head's block-table row `table` holding `slot`, or -1 when the entry is not a
 * page of the pool (a page the caller did not reserve: the write must not go through it). */
static inline int64_t page_of(const int32_t *table, int64_t slot, int64_t max_pages,
                              int64_t page_size, int64_t num_pages) {
    if (slot < 0 || slot / page_size >= max_pages) return -1;
    const int64_t page = table[slot / page_size];
    return page >= 0 && page < num_pages ? page : -1;
}

/* Row `row` of a ring (float32, or bfloat16 when ring_bf16) as float32: in place, or converted
 * into `scratch`. */
static inline const float *ring_row(const void *ring, int64_t row, int64_t head_dim,
                                    int ring_bf16, float *scratch) {
    if (!ring_bf16) return (const float *)ring + row * head_dim;
    load(ring, row * head_dim, scratch, head_dim, 1);
    return scratch;
}

/* Algorithm 1 for one token of head `state` (k, v pre-RoPE, weight omega): `count` tokens merged
 * before it (0 = append), its ring row, the slot's weighted mean rotated by the angles of cos,
 * sin [head_dim / 2] (the token's position), written at `slot` of the head's pages. Returns 0,
 * nothing changed, when that slot's page is not one of the pool's `num_pages`; else 1. */
static int merge_token(void *k_pages, void *v_pages, const int32_t *tables, void *open_k,
                        void *open_v, float *open_omega, int32_t *open_count,
                        const float *cos, const float *sin, int64_t window, int64_t state,
                        int64_t count, const float *k, const float *v, float omega,
                        int64_t slot, int64_t max_pages, int64_t head_dim, int64_t page_size,
                        int64_t num_pages, int bf16, int ring_bf16) {
    const int64_t page = page_of(tables + state * max_pages, slot, max_pages, page_size,
                                 num_pages);
    if (page < 0) return 0;
    const int64_t first = state * window;  /* the head's first ring row */
    float *ring_omega = open_omega + first;
    const int64_t put = count % window;
    store(open_k, (first + put) * head_dim, k, head_dim, ring_bf16);
    store(open_v, (first + put) * head_dim, v, head_dim, ring_bf16);
    ring_omega[put] = omega;
    open_count[state] = (int32_t)(count + 1);
    const int64_t filled = count + 1 < window ? count + 1 : window;
    float mean_k[MAX_HEAD], mean_v[MAX_HEAD], rotated[MAX_HEAD], row_k[MAX_HEAD],
        row_v[MAX_HEAD], total = 0.0f;
    memset(mean_k, 0, sizeof(float) * head_dim);
    memset(mean_v, 0, sizeof(float) * head_dim);
    for (int64_t r = 0; r < filled; ++r) {
        const float weight = ring_omega[r];
        const float *key = ring_row(open_k, first + r, head_dim, ring_bf16, row_k);
        const float *value = ring_row(open_v, first + r, head_dim, ring_bf16, row_v);
        total += weight;
        for (int64_t d = 0; d < head_dim; ++d) {
            mean_k[d] += weight * key[d];
            mean_v[d] += weight * value[d];
        }
    }
    for (int64_t d = 0; d < head_dim; ++d) {
        mean_k[d] /= total;
        mean_v[d] /= total;
    }
    rope(mean_k, rotated, cos, sin, 1.0f, head_dim / 2);
    const int64_t index = (page * page_size + slot % page_size) * head_dim;
    store(k_pages, index, rotated, head_dim, bf16);
    store(v_pages, index, mean_v, head_dim, bf16);
    return 1;
}

/* A row whose write found no page (see page_of): counted, and one such row kept in *bad_row. */
static inline int64_t refused(int64_t row, int64_t *bad_row) {
#pragma omp atomic write
    *bad_row = row;
    return 1;
}

/* Each of the writes below returns the number of (sequence, KV head) rows left unwritten because
 * their slot's page is not one of the pool's `num_pages` (an unreserved page: -1 in the block
 * table), one of them in *bad_row; the caller raises. */
int64_t dmc_write_window(void *k_pages, void *v_pages, const int32_t *tables, void *open_k,
                         void *open_v, float *open_omega, int32_t *open_count, const float *cos,
                         const float *sin, int64_t window, int64_t layer, const int64_t *seq_slots,
                         const int64_t *slots, const int8_t *append, const float *k,
                         const float *v, const float *omega, int64_t batch, int64_t kv_heads,
                         int64_t layers, int64_t max_pages, int64_t head_dim, int64_t page_size,
                         int64_t num_pages, int64_t is_bf16, int64_t ring_bf16,
                         int64_t threads, int64_t *bad_row) {
    int64_t bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : bad)
    for (int64_t row = 0; row < batch * kv_heads; ++row) {
        const int64_t b = row / kv_heads, h = row % kv_heads;
        const int64_t state = (seq_slots[b] * layers + layer) * kv_heads + h;
        const int64_t count = append[row] ? 0 : open_count[state];
        if (!merge_token(k_pages, v_pages, tables, open_k, open_v, open_omega, open_count,
                         cos + b * (head_dim / 2), sin + b * (head_dim / 2), window, state,
                         count, k + row * head_dim, v + row * head_dim, omega[row], slots[row],
                         max_pages, head_dim, page_size, num_pages, (int)is_bf16,
                         (int)ring_bf16))
            bad += refused(row, bad_row);
    }
    return bad;
}

/* Decode write of DMC with delayed merging (dmc.merge_delay = R - 1; semantics of
 * DelayedMergeCache.write's PyTorch path, which stays the oracle) of one token per (sequence,
 * KV head) at position p: when p >= R, token t = p - R leaves ring row p mod R: its key rotated
 * back by t, it goes through Algorithm 1 with its own decisions (append when alpha <= 0.5 or
 * the head holds no slot; the slot's page reserved by the caller) and `length` grows by its
 * append; then token p takes that ring row, its key rotated at p. Rings ring_k, ring_v
 * [max_seqs, layers, kv_heads, R, head_dim] and pools in the cache dtype, ring_alpha,
 * ring_omega [..., R] float32, lengths int32; keys (pre-RoPE), values [batch, kv_heads,
 * head_dim], alpha, omega [batch, kv_heads] float32; the merge state as dmc_write_window's;
 * the cosines and sines of the RoPE angles [batch, head_dim / 2] at p (cos_now, sin_now) and at
 * p - R (cos_out, sin_out). */
int64_t delayed_write_token(void *k_pages, void *v_pages, const int32_t *tables, int32_t *lengths,
                            float *open_k, float *open_v, float *open_omega, int32_t *open_count,
                            const float *cos_now, const float *sin_now, const float *cos_out,
                            const float *sin_out, void *ring_k, void *ring_v, float *ring_alpha,
                            float *ring_omega, const float *keys, const float *values,
                            const float *alpha, const float *omega, const int64_t *seq_slots,
                            const int64_t *positions, int64_t window, int64_t layer, int64_t batch,
                            int64_t kv_heads, int64_t layers, int64_t max_pages, int64_t ring_size,
                            int64_t head_dim, int64_t page_size, int64_t num_pages,
                            int64_t is_bf16, int64_t threads, int64_t *bad_row) {
    const int64_t half = head_dim / 2;
    int64_t bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : bad)
    for (int64_t row = 0; row < batch * kv_heads; ++row) {
        const int64_t b = row / kv_heads, h = row % kv_heads, p = positions[b];
        const int64_t state = (seq_slots[b] * layers + layer) * kv_heads + h;
        const int64_t ring_row = state * ring_size + p % ring_size;
        const int64_t at = b * half;
        float key[MAX_HEAD], pre[MAX_HEAD], value[MAX_HEAD];
        if (p >= ring_size) {
            load(ring_k, ring_row * head_dim, key, head_dim, (int)is_bf16);
            load(ring_v, ring_row * head_dim, value, head_dim, (int)is_bf16);
            rope(key, pre, cos_out + at, sin_out + at, -1.0f, half);
            const int64_t length = lengths[state];
            const int append = ring_alpha[ring_row] <= 0.5f || length == 0;
            if (!merge_token(k_pages, v_pages, tables, open_k, open_v, open_omega, open_count,
                             cos_out + at, sin_out + at, window, state,
                             append ? 0 : open_count[state], pre, value, ring_omega[ring_row],
                             append ? length : length - 1, max_pages, head_dim, page_size,
                             num_pages, (int)is_bf16, 0)) {
                bad += refused(row, bad_row);
                continue;
            }
            lengths[state] = (int32_t)(length + append);
        }
        rope(keys + row * head_dim, key, cos_now + at, sin_now + at, 1.0f, half);
        store(ring_k, ring_row * head_dim, key, head_dim, (int)is_bf16);
        store(ring_v, ring_row * head_dim, values + row * head_dim, head_dim, (int)is_bf16);
        ring_alpha[ring_row] = alpha[row];
        ring_omega[ring_row] = omega[row];
    }
    return bad;
}

/* DMS decode write of one token per (sequence, KV head) (delayed eviction, DMS paper Sec. 3;
 * semantics of DMSPagedCache.decode_write's PyTorch path, which stays the oracle): at position
 * p, token p - 1's ring row takes the decision `evict` (row (p - 1) mod (w + 1); p = 0 writes 0);
 * when p >= w + 1 token p - w - 1 leaves its ring row p mod (w + 1) for slot `length` of its
 * head's pages (page reserved by the caller), and `length` grows by one unless it was evicted;
 * then token p takes that ring row with its flag cleared. Rings [max_seqs, layers, kv_heads,
 * w + 1, head_dim] and pools in the cache dtype, ring_evict [..., w + 1] bytes, lengths int32;
 * keys, values [batch, kv_heads, head_dim] float32 (rotated), evict [batch, kv_heads] int8. */
int64_t dms_write_token(void *k_pages, void *v_pages, const int32_t *tables, int32_t *lengths,
                        void *ring_k, void *ring_v, uint8_t *ring_evict, const float *keys,
                        const float *values, const int8_t *evict, const int64_t *seq_slots,
                        const int64_t *positions, int64_t layer, int64_t batch, int64_t kv_heads,
                        int64_t layers, int64_t max_pages, int64_t ring_size, int64_t head_dim,
                        int64_t page_size, int64_t num_pages, int64_t is_bf16, int64_t threads,
                        int64_t *bad_row) {
    const int64_t element = is_bf16 ? 2 : 4, row_bytes = head_dim * element;
    int64_t bad = 0;
#pragma omp parallel for schedule(static) num_threads(threads) reduction(+ : bad)
    for (int64_t row = 0; row < batch * kv_heads; ++row) {
        const int64_t b = row / kv_heads, h = row % kv_heads, p = positions[b];
        const int64_t state = (seq_slots[b] * layers + layer) * kv_heads + h;
        uint8_t *flags = ring_evict + state * ring_size;
        flags[((p - 1) % ring_size + ring_size) % ring_size] = p > 0 && evict[row];
        const int64_t ring_row = (state * ring_size + p % ring_size) * head_dim;
        if (p >= ring_size) {
            const int keep = !flags[p % ring_size];
            const int64_t length = lengths[state];
            const int64_t page = page_of(tables + state * max_pages, length, max_pages,
                                         page_size, num_pages);
            if (page < 0) {
                bad += refused(row, bad_row);
                continue;
            }
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
    return bad;
}
