/* Paged decode attention on the CPU, reading the page pool in place.
 *
 * Semantics of dmc.inference.kernels.reference.paged_decode_reference (the oracle): one query per
 * (sequence, query head) attends over the slots of its KV head, found through the block table.
 * Layout (dmc/inference/kernels/reference.py): k_pages, v_pages [num_pages, page_size, head_dim];
 * tables [rows, table_stride] int32 page ids; lengths [rows] int32 slots per row, where a row is a
 * (sequence, KV head) and owns `group` query heads (GQA).
 *
 * Each row streams its pages once: the scores of a page's slots for all `group` queries (a key is
 * read once for the whole group), the page's maximum, a rescale of the running sums (the online
 * softmax of FlashAttention / FlashDecoding), then the values. While the keys are scored, the
 * page's values and the next page's keys are prefetched row by row (pages are scattered: the
 * hardware prefetcher stops at each page's end; measured 1.1x over no software prefetch and 1.2x
 * over fetching the next page whole). No key or value is
 * copied: the cost is the bytes of the row's pages. Rows run in parallel (dynamic schedule: DMC rows
 * differ in length). Vectors of 8 floats (GCC vector extensions: AVX with -march=native, SSE pairs
 * otherwise); the row function is inlined with head_dim 64 and 128 as constants, so that the
 * accumulators of a query live in registers. Pools of float32 or bfloat16 (widened on load);
 * queries, outputs and sums float32.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define LANES 8
#define MAX_GROUP 64
#define MAX_PAGE 256
#define MAX_CHUNKS 32 /* head_dim <= 256, a multiple of LANES */

typedef float vfloat __attribute__((vector_size(LANES * sizeof(float))));
typedef float vfloat_u __attribute__((vector_size(LANES * sizeof(float)), aligned(4)));
typedef uint16_t vhalf __attribute__((vector_size(LANES * sizeof(uint16_t))));
typedef uint32_t vword __attribute__((vector_size(LANES * sizeof(uint32_t))));

static inline __attribute__((always_inline)) vfloat load(const void *pool, int64_t index,
                                                         int bf16) {
    if (bf16) { /* bfloat16 is the top half of a float32 */
        vhalf bits;
        memcpy(&bits, (const uint16_t *)pool + index, sizeof bits);
        vword wide = __builtin_convertvector(bits, vword) << 16;
        vfloat out;
        memcpy(&out, &wide, sizeof out);
        return out;
    }
    vfloat out;
    memcpy(&out, (const float *)pool + index, sizeof out);
    return out;
}

static inline float lane_sum(vfloat x) {
    float total = 0.0f;
    for (int i = 0; i < LANES; ++i) total += x[i];
    return total;
}

/* One block of `count` slots (a page, or a DMS window ring) at element `block` of the pools
 * `keys` / `values`, folded into the running softmax of the row's `group` queries: the scores,
 * the block's maximum, the rescale of the sums and outputs, then the values. While a key row is
 * scored, its value row and the row of the next block's keys (`next` in `next_keys`; -1: none)
 * are fetched. */
static inline __attribute__((always_inline)) void attend_block(
    const float *q, const void *keys, const void *values, int64_t block, int64_t count,
    const void *next_keys, int64_t next, float *out, float *running_max, float *running_sum,
    float *scores, int64_t group, const int64_t chunks, const int bf16) {
    const int64_t head_dim = chunks * LANES, element = bf16 ? 2 : 4;
    for (int64_t s = 0; s < count; ++s) {
        vfloat key[MAX_CHUNKS];
        for (int64_t b = 0; b < head_dim * element; b += 64) {
            if (next >= 0)
                __builtin_prefetch((const char *)next_keys + (next + s * head_dim) * element + b);
            __builtin_prefetch((const char *)values + (block + s * head_dim) * element + b);
        }
        for (int64_t c = 0; c < chunks; ++c)
            key[c] = load(keys, block + s * head_dim + c * LANES, bf16);
        for (int64_t g = 0; g < group; ++g) {
            vfloat even = {0}, odd = {0};
            const vfloat_u *qg = (const vfloat_u *)(q + g * head_dim);
            for (int64_t c = 0; c + 1 < chunks; c += 2) {
                even += qg[c] * key[c];
                odd += qg[c + 1] * key[c + 1];
            }
            if (chunks % 2) even += qg[chunks - 1] * key[chunks - 1];
            scores[g * MAX_PAGE + s] = lane_sum(even + odd);
        }
    }
    for (int64_t g = 0; g < group; ++g) {
        float *sg = scores + g * MAX_PAGE;
        float top = running_max[g];
        for (int64_t s = 0; s < count; ++s) top = sg[s] > top ? sg[s] : top;
        const float shrink = expf(running_max[g] - top); /* exp(-inf) = 0 at the start */
        float total = running_sum[g] * shrink;
        for (int64_t s = 0; s < count; ++s) {
            sg[s] = expf(sg[s] - top);
            total += sg[s];
        }
        running_max[g] = top;
        running_sum[g] = total;
        vfloat acc[MAX_CHUNKS];
        vfloat_u *og = (vfloat_u *)(out + g * head_dim);
        for (int64_t c = 0; c < chunks; ++c) acc[c] = og[c] * shrink;
        for (int64_t s = 0; s < count; ++s) {
            const float p = sg[s];
            for (int64_t c = 0; c < chunks; ++c)
                acc[c] += p * load(values, block + s * head_dim + c * LANES, bf16);
        }
        for (int64_t c = 0; c < chunks; ++c) og[c] = acc[c];
    }
}

/* Row `r`: out[group, chunks * LANES] and lse[group] (log-sum-exp of the scaled scores) over the
 * row's `length` paged slots, then its `ring_count` rows at element `ring` of the ring pools
 * (DMS's window; ring_count 0: none). */
static inline __attribute__((always_inline)) void attend_row(
    const float *q, const void *k_pages, const void *v_pages, const int32_t *table,
    int64_t length, const void *ring_k, const void *ring_v, int64_t ring, int64_t ring_count,
    float *out, float *lse, int64_t group, const int64_t chunks, int64_t page_size,
    const int bf16) {
    const int64_t head_dim = chunks * LANES, page_elements = page_size * chunks * LANES;
    float running_max[MAX_GROUP], running_sum[MAX_GROUP], scores[MAX_GROUP * MAX_PAGE];
    for (int64_t g = 0; g < group; ++g) {
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
    }
    memset(out, 0, sizeof(float) * group * head_dim);
    for (int64_t start = 0; start < length; start += page_size) {
        const int64_t page = (int64_t)table[start / page_size] * page_elements;
        const int64_t count = length - start < page_size ? length - start : page_size;
        const int last = start + page_size >= length;
        const int64_t next = !last ? (int64_t)table[start / page_size + 1] * page_elements
                                   : ring_count ? ring : -1;
        attend_block(q, k_pages, v_pages, page, count, last ? ring_k : k_pages, next, out,
                     running_max, running_sum, scores, group, chunks, bf16);
    }
    if (ring_count)
        attend_block(q, ring_k, ring_v, ring, ring_count, ring_k, -1, out, running_max,
                     running_sum, scores, group, chunks, bf16);
    for (int64_t g = 0; g < group; ++g) {
        vfloat_u *og = (vfloat_u *)(out + g * head_dim);
        const float inv = running_sum[g] > 0.0f ? 1.0f / running_sum[g] : 0.0f;
        for (int64_t c = 0; c < chunks; ++c) og[c] *= inv;
        lse[g] = running_sum[g] > 0.0f ? running_max[g] + logf(running_sum[g]) : -INFINITY;
    }
}

/* Limits the caller checks before calling (returned so that Python reads one source of truth):
 * 0: most query heads per KV head, 1: largest page, 2: largest head_dim, 3: head_dim multiple. */
int64_t dmc_paged_limits(int64_t which) {
    const int64_t limits[] = {MAX_GROUP, MAX_PAGE, MAX_CHUNKS * LANES, LANES};
    return limits[which];
}

/* q, out [rows, group, head_dim] float32 (q already scaled); lse [rows, group] float32;
 * is_bf16: the pools hold bfloat16 (else float32). head_dim 64 and 128 run specialised code.
 * ring_offsets [rows] int64 (element of each row's ring in ring_k / ring_v, pools of the pages'
 * dtype) and ring_counts [rows] int32 (rows <= MAX_PAGE to attend after the pages), or NULL. */
void dmc_paged_decode(const float *q, const void *k_pages, const void *v_pages,
                      const int32_t *tables, int64_t table_stride, const int32_t *lengths,
                      const void *ring_k, const void *ring_v, const int64_t *ring_offsets,
                      const int32_t *ring_counts, float *out, float *lse, int64_t rows,
                      int64_t group, int64_t head_dim, int64_t page_size, int64_t is_bf16,
                      int64_t threads) {
    const int64_t chunks = head_dim / LANES;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t r = 0; r < rows; ++r) {
#define ROW(CHUNKS, BF16)                                                                      \
    attend_row(q + r * group * head_dim, k_pages, v_pages, tables + r * table_stride,          \
               lengths[r], ring_k, ring_v, ring_counts ? ring_offsets[r] : 0,                  \
               ring_counts ? ring_counts[r] : 0, out + r * group * head_dim, lse + r * group,  \
               group, CHUNKS, page_size, BF16)
        if (is_bf16) {
            if (chunks == 8) ROW(8, 1);
            else if (chunks == 16) ROW(16, 1);
            else ROW(chunks, 1);
        } else {
            if (chunks == 8) ROW(8, 0);
            else if (chunks == 16) ROW(16, 0);
            else ROW(chunks, 0);
        }
#undef ROW
    }
}
