/* Paged decode attention on the CPU, reading the page pool in place.
 *
 * Semantics of dmc.inference.kernels.reference.paged_decode_reference (the oracle): one query per
 * (sequence, query head) attends over the slots of its KV head, found through the block table.
 * Layout (dmc/inference/kernels/reference.py): k_pages, v_pages [num_pages, page_size, head_dim];
 * tables [rows, table_stride] int32 page ids; lengths [rows] int32 slots per row, where a row is a
 * (sequence, KV head) and owns `group` query heads (GQA).
 *
 * Each row streams its pages once (then, for DMS, its window ring): for each page the scores of
 * its slots for all `group` queries, eight slots at a time (eight dot-product vectors summed lane
 * by lane by one shuffle tree), the page's maximum, a rescale of the running sums (the online
 * softmax of FlashAttention / FlashDecoding), the weights by a vectorised exp (a degree-7
 * polynomial after range reduction, relative error ~1e-7 like libm's expf; tested against the
 * float64 log-sum-exp), then the values. While the keys are scored, the page's values and the
 * next page's keys are prefetched row by row (pages are scattered: the hardware prefetcher stops
 * at each page's end; measured 1.1x over no software prefetch, 1.2x over fetching the next page
 * whole). No key or value is copied: the cost is the bytes of the row's pages. Rows run in
 * parallel (dynamic schedule: DMC rows differ in length). Vectors of 8 floats (GCC / clang
 * vector extensions: AVX with -march=native, SSE pairs otherwise); the row function is inlined
 * with head_dim 64 and 128 as constants, so that a query's accumulators live in registers. Pools
 * of float32 or bfloat16 (widened on load); queries, outputs and sums float32.
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

typedef int32_t vint __attribute__((vector_size(LANES * sizeof(int32_t))));

#if defined(__clang__)
#define SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (vint){__VA_ARGS__})
#endif

/* Lane i of the result: the sum of the lanes of parts[i] (a transpose-and-add tree: 3 levels of
 * shuffles instead of 8 horizontal sums). */
static inline vfloat lane_sums(const vfloat *parts) {
    vfloat pairs[4], quads[2];
    for (int i = 0; i < 4; ++i)
        pairs[i] = SHUFFLE(parts[2 * i], parts[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14)
                 + SHUFFLE(parts[2 * i], parts[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
    for (int i = 0; i < 2; ++i)
        quads[i] = SHUFFLE(pairs[2 * i], pairs[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13)
                 + SHUFFLE(pairs[2 * i], pairs[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
    return SHUFFLE(quads[0], quads[1], 0, 1, 2, 3, 8, 9, 10, 11)
         + SHUFFLE(quads[0], quads[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

/* exp(x) for x <= 0 lane by lane (-inf and x < -87 give 0): x = n ln2 + r with n the nearest
 * integer (the 1.5 * 2^23 rounding trick), |r| <= ln2 / 2, e^r by its Taylor polynomial of
 * degree 7 (relative error below 1e-8 there, under float32 rounding), 2^n built in the
 * exponent bits. */
static inline vfloat exp_nonpositive(vfloat x) {
    const vint alive = x > -87.0f;
    x = (vfloat)((vint)x & alive); /* dead lanes: 0, zeroed at the end */
    const vfloat shifter = x * 1.44269504f + 12582912.0f;
    const vfloat n = shifter - 12582912.0f;
    const vfloat r = (x - n * 0.693145752f) - n * 1.42860677e-6f;
    vfloat p = r * (1.0f / 5040) + (1.0f / 720);
    p = p * r + (1.0f / 120);
    p = p * r + (1.0f / 24);
    p = p * r + (1.0f / 6);
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const vint scale = (__builtin_convertvector(n, vint) + 127) << 23;
    return (vfloat)((vint)(p * (vfloat)scale) & alive);
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
    for (int64_t first = 0; first < count; first += LANES) { /* LANES slots at a time */
        const int64_t slots = count - first < LANES ? count - first : LANES;
        for (int64_t g = 0; g < group; ++g) {
            const vfloat_u *qg = (const vfloat_u *)(q + g * head_dim);
            vfloat parts[LANES] = {{0}};
            for (int64_t j = 0; j < slots; ++j) {
                const int64_t s = first + j;
                if (g == 0)
                    for (int64_t b = 0; b < head_dim * element; b += 64) {
                        if (next >= 0)
                            __builtin_prefetch((const char *)next_keys
                                               + (next + s * head_dim) * element + b);
                        __builtin_prefetch((const char *)values + (block + s * head_dim) * element
                                           + b);
                    }
                vfloat even = {0}, odd = {0};
                for (int64_t c = 0; c + 1 < chunks; c += 2) {
                    even += qg[c] * load(keys, block + s * head_dim + c * LANES, bf16);
                    odd += qg[c + 1] * load(keys, block + s * head_dim + (c + 1) * LANES, bf16);
                }
                if (chunks % 2)
                    even += qg[chunks - 1] * load(keys, block + s * head_dim + head_dim - LANES,
                                                  bf16);
                parts[j] = even + odd;
            }
            vfloat sums = lane_sums(parts);
            for (int64_t j = slots; j < LANES; ++j) sums[j] = -INFINITY;
            memcpy(scores + g * MAX_PAGE + first, &sums, sizeof sums);
        }
    }
    const int64_t padded = (count + LANES - 1) / LANES * LANES;
    for (int64_t g = 0; g < group; ++g) {
        float *sg = scores + g * MAX_PAGE;
        vfloat tops;
        memcpy(&tops, sg, sizeof tops);
        for (int64_t s = LANES; s < padded; s += LANES) {
            vfloat more;
            memcpy(&more, sg + s, sizeof more);
            const vint larger = more > tops;
            tops = (vfloat)(((vint)more & larger) | ((vint)tops & ~larger));
        }
        float top = running_max[g];
        for (int i = 0; i < LANES; ++i) top = tops[i] > top ? tops[i] : top;
        const float shrink = expf(running_max[g] - top); /* exp(-inf) = 0 at the start */
        vfloat totals = {0};
        for (int64_t s = 0; s < padded; s += LANES) {
            vfloat weights;
            memcpy(&weights, sg + s, sizeof weights);
            weights = exp_nonpositive(weights - top); /* padding: exp(-inf) = 0 */
            memcpy(sg + s, &weights, sizeof weights);
            totals += weights;
        }
        float total = running_sum[g] * shrink;
        for (int i = 0; i < LANES; ++i) total += totals[i];
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
    float running_max[MAX_GROUP], running_sum[MAX_GROUP], scores[MAX_GROUP * MAX_PAGE + LANES];
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

/* Whether the `length` slots of a row lie on pages of the pool: every entry of its block-table
 * row `table` (of `stride` entries) they use is in [0, num_pages). */
static int row_pages_valid(const int32_t *table, int64_t stride, int64_t length,
                           int64_t page_size, int64_t num_pages) {
    const int64_t used = (length + page_size - 1) / page_size;
    if (length < 0 || used > stride) return 0;
    for (int64_t i = 0; i < used; ++i)
        if (table[i] < 0 || table[i] >= num_pages) return 0;
    return 1;
}

/* q, out [rows, group, head_dim] float32 (q already scaled); lse [rows, group] float32;
 * is_bf16: the pools hold bfloat16 (else float32). head_dim 64 and 128 run specialised code.
 * ring_offsets [rows] int64 (element of each row's ring in ring_k / ring_v, pools of the pages'
 * dtype) and ring_counts [rows] int32 (rows <= MAX_PAGE to attend after the pages), or NULL.
 * Returns the number of rows whose slots are not all on the pool's `num_pages` pages (an entry
 * of -1: a page never reserved), left unread (out 0, lse -inf), one of them in *bad_row. */
int64_t dmc_paged_decode(const float *q, const void *k_pages, const void *v_pages,
                         const int32_t *tables, int64_t table_stride, const int32_t *lengths,
                         const void *ring_k, const void *ring_v, const int64_t *ring_offsets,
                         const int32_t *ring_counts, float *out, float *lse, int64_t rows,
                         int64_t group, int64_t head_dim, int64_t page_size, int64_t num_pages,
                         int64_t is_bf16, int64_t threads, int64_t *bad_row) {
    const int64_t chunks = head_dim / LANES;
    int64_t bad = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads) reduction(+ : bad)
    for (int64_t r = 0; r < rows; ++r) {
        if (!row_pages_valid(tables + r * table_stride, table_stride, lengths[r], page_size,
                             num_pages)) {
            memset(out + r * group * head_dim, 0, sizeof(float) * group * head_dim);
            for (int64_t g = 0; g < group; ++g) lse[r * group + g] = -INFINITY;
#pragma omp atomic write
            *bad_row = r;
            ++bad;
            continue;
        }
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
    return bad;
}
