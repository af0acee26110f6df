/* Paged decode attention on the CPU: one query token per sequence, K/V read in place from the
 * paged pool through each sequence's block table (no gathered copy).
 *
 * Compiled on first use by pdserve/attention/cpu_build.py (cc -O3 -march=native -fopenmp) and
 * called through ctypes by pdserve/attention/cpu_paged.py; see pd_paged_decode below for the
 * contract. C11 with GCC/Clang vector extensions (x86 intrinsics only where the target has
 * them): the vector width follows the target ISA (16 floats with AVX-512, 8 with AVX, else 4),
 * so the same source builds on any CPU. The Python side range-checks every block id, length
 * and row before a call; the kernel trusts them.
 *
 * Algorithm: one work item is (sequence, KV head, split). It computes the scores of all G query
 * heads that share the KV head (grouped-query attention without repeating K/V) over tiles of
 * consecutive tokens inside one block, and keeps a running max, a running sum of exponentials and
 * an fp32 output accumulator per query head: the single-pass "online softmax" of Milakov &
 * Gimelshein, "Online normalizer calculation for softmax" (2018), as FlashAttention and
 * FlashDecoding use it. With more than one split per sequence (FlashDecoding's split-K, for few
 * sequences and many threads) each split's partial (max, sum, accumulator) is merged at the end
 * by rescaling with exp(max_split - max_total).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#define VW 16
#elif defined(__AVX__)
#define VW 8
#else
#define VW 4
#endif
#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define ALWAYS_INLINE static inline __attribute__((always_inline))

#define TILE 32 /* tokens per score tile (within one block) */

typedef float vf __attribute__((vector_size(VW * 4)));
typedef uint16_t vu16 __attribute__((vector_size(VW * 2)));
typedef uint32_t vu32 __attribute__((vector_size(VW * 4)));

enum { PD_F32 = 0, PD_BF16 = 1, PD_F16 = 2 };

/* ---- element conversion ------------------------------------------------------------------ */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16;
    float f;
    memcpy(&f, &w, 4);
    return f;
}

/* IEEE half bits -> float, exact for every input (normals, subnormals, zeros, inf, NaN):
 * move exponent and mantissa into place, rebias the exponent by 127 - 15, push inf/NaN to the
 * float maximum exponent and renormalise subnormals by subtracting 2^-14. */
static inline vf f16v_to_f32(vu32 h) {
    const vu32 sign = (h & 0x8000u) << 16;
    vu32 em = (h & 0x7fffu) << 13;
    const vu32 exp = em & (0x7c00u << 13);
    em += (uint32_t)(127 - 15) << 23;
    em += (vu32)(exp == (0x7c00u << 13)) & ((uint32_t)(128 - 16) << 23);
    const vu32 sub = (vu32)(exp == 0);
    em += sub & (1u << 23);
    vf f, magic;
    vu32 fb, mb = (vu32){0} + (113u << 23); /* 2^-14 */
    memcpy(&f, &em, sizeof f);
    memcpy(&magic, &mb, sizeof magic);
    f -= magic;
    memcpy(&fb, &f, sizeof fb);
    em = (sub & fb) | (~sub & em);
    em |= sign;
    memcpy(&f, &em, sizeof f);
    return f;
}

static inline float f16_to_f32(uint16_t h) {
    vu32 v = (vu32){0} + h;
    return f16v_to_f32(v)[0];
}

/* float -> bf16 bits, round to nearest even; NaN stays NaN */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

/* float -> IEEE half bits, round to nearest even; overflow -> inf, NaN stays NaN */
static inline uint16_t f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u);
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (ax < 0x38800000u) {                                   /* below 2^-14: subnormal */
        float a;
        memcpy(&a, &ax, 4);
        return (uint16_t)(sign | (uint32_t)lrintf(a * 16777216.0f)); /* units of 2^-24 */
    }
    uint32_t r = ax - (112u << 23);
    r += 0xfffu + ((r >> 13) & 1u);
    return (uint16_t)(sign | (r >> 13));
}

/* VW elements of type `dtype` at p -> floats (p need not be aligned) */
ALWAYS_INLINE vf load_vec(const void *p, const int dtype) {
    vf f;
    if (dtype == PD_F32) {
        memcpy(&f, p, sizeof f);
    } else if (dtype == PD_BF16) {
#if VW == 16
        f = (vf)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16);
#elif VW == 8 && defined(__AVX2__)
        f = (vf)_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16);
#else
        vu16 h;
        memcpy(&h, p, sizeof h);
        vu32 w = __builtin_convertvector(h, vu32) << 16;
        memcpy(&f, &w, sizeof f);
#endif
    } else {
#if defined(__F16C__) && VW == 16
        f = (vf)_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p));
#elif defined(__F16C__) && VW == 8
        f = (vf)_mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
#else
        vu16 h;
        memcpy(&h, p, sizeof h);
        f = f16v_to_f32(__builtin_convertvector(h, vu32));
#endif
    }
    return f;
}

ALWAYS_INLINE float load_one(const void *p, int64_t i, const int dtype) {
    if (dtype == PD_F32) return ((const float *)p)[i];
    if (dtype == PD_BF16) return bf16_to_f32(((const uint16_t *)p)[i]);
    return f16_to_f32(((const uint16_t *)p)[i]);
}

static inline void store_one(void *p, int64_t i, float x, int dtype) {
    if (dtype == PD_F32)
        ((float *)p)[i] = x;
    else if (dtype == PD_BF16)
        ((uint16_t *)p)[i] = f32_to_bf16(x);
    else
        ((uint16_t *)p)[i] = f32_to_f16(x);
}

static inline int elem_size(int dtype) { return dtype == PD_F32 ? 4 : 2; }

/* ---- math ----------------------------------------------------------------------------------- */

ALWAYS_INLINE float hsum(vf v) {
#if VW == 16
    return _mm512_reduce_add_ps((__m512)v);
#elif VW == 8
    __m128 x = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    x = _mm_add_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
#else
    float s = 0.0f;
    for (int i = 0; i < VW; i++) s += v[i];
    return s;
#endif
}

/* mask ? a : b, lane by lane (mask lanes all ones or all zeros) */
ALWAYS_INLINE vf vselect(vu32 mask, vf a, vf b) {
    vu32 ab, bb;
    memcpy(&ab, &a, sizeof ab);
    memcpy(&bb, &b, sizeof bb);
    ab = (mask & ab) | (~mask & bb);
    memcpy(&a, &ab, sizeof a);
    return a;
}

/* exp(x) lane by lane for x <= 0 (softmax arguments minus their max), relative error ~2e-7:
 * x = n ln2 + r with n = round(x / ln2), |r| <= ln2 / 2; exp(r) by its Taylor series to degree 7
 * (truncation error below 6e-9); 2^n put into the exponent bits. n is rounded by adding
 * 1.5 * 2^23, which leaves n in the low mantissa bits. x below -87 is clamped there
 * (exp ~ 1.6e-38: no denormals, and exp(-inf) * 0 stays 0). */
ALWAYS_INLINE vf exp_nonpos_v(vf x) {
    const vf lo = (vf){0} - 87.0f, shifter = (vf){0} + 12582912.0f;
    x = vselect((vu32)(x < lo), lo, x);
    const vf t = x * 1.44269504088896341f + shifter;
    const vf n = t - shifter;
    vf r = x - n * 0.693145751953125f; /* ln2 split in a short high part (n * it is exact) */
    r = r - n * 1.42860682030941723e-6f; /* ... and the rest */
    vf p = (vf){0} + 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    vu32 bits, sb;
    memcpy(&sb, &shifter, sizeof sb);
    memcpy(&bits, &t, sizeof bits);
    bits = (bits - sb + 127u) << 23; /* 2^n */
    vf two_n;
    memcpy(&two_n, &bits, sizeof two_n);
    return p * two_n;
}

/* ---- one work item ---------------------------------------------------------------------------- */

#define GMAX 8 /* query heads per KV head handled in one pass (more: several passes) */

typedef struct {
    const char *k, *v;              /* layer caches [num_blocks, block_size, kv_heads, D] */
    int64_t blk_stride, tok_stride; /* elements */
    int kv_dtype, kv_heads, head_dim, block_size;
} Cache;

/* Attend G <= GMAX pre-scaled fp32 queries qf [G, D] to tokens [t_begin, t_end) of one
 * sequence (block table `table`) for KV head `h`. On return m [G] holds the max score, l [G] the
 * sum of exp(score - m) and acc [G, D] the sum of exp(score - m) * v (unnormalised).
 * Inlined with constant G and dtype (see attend_range), so the per-head loops unroll and the
 * accumulators live in registers. */
ALWAYS_INLINE void attend_range_impl(const int G, const int dtype, const Cache *c,
                                     const int32_t *table, int h, const float *qf,
                                     int64_t t_begin, int64_t t_end, float *m, float *l,
                                     float *acc) {
    const int D = c->head_dim, DV = D - D % VW, es = elem_size(dtype);
    float s[GMAX * TILE];
    for (int g = 0; g < G; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
        for (int d = 0; d < D; d++) acc[g * D + d] = 0.0f;
    }
    for (int64_t t0 = t_begin; t0 < t_end;) {
        const int64_t blk = table[t0 / c->block_size];
        const int off = (int)(t0 % c->block_size);
        int cnt = c->block_size - off;
        if (cnt > TILE) cnt = TILE;
        if (cnt > t_end - t0) cnt = (int)(t_end - t0);
        const int64_t base = (blk * c->blk_stride + off * c->tok_stride + (int64_t)h * D) * es;
        const char *kp = c->k + base, *vp = c->v + base;
        const int64_t step = c->tok_stride * es;
        if (t0 + cnt < t_end) { /* blocks are scattered: prefetch the next tile's rows */
            const int64_t t1 = t0 + cnt;
            const int off1 = (int)(t1 % c->block_size);
            int cnt1 = c->block_size - off1;
            if (cnt1 > TILE) cnt1 = TILE;
            if (cnt1 > t_end - t1) cnt1 = (int)(t_end - t1);
            const int64_t base1 = (table[t1 / c->block_size] * c->blk_stride +
                                   off1 * c->tok_stride + (int64_t)h * D) * es;
            for (int j = 0; j < cnt1; j++)
                for (int64_t b = 0; b < (int64_t)D * es; b += 64) {
                    __builtin_prefetch(c->k + base1 + j * step + b);
                    __builtin_prefetch(c->v + base1 + j * step + b);
                }
        }

        /* scores s[g][j] = q_g . k_j: each K vector is loaded once for all G heads */
        for (int j = 0; j < cnt; j++) {
            const char *kj = kp + j * step;
            vf a[GMAX];
            for (int g = 0; g < G; g++) a[g] = (vf){0};
            int d = 0;
            for (; d < DV; d += VW) {
                const vf kv = load_vec(kj + (int64_t)d * es, dtype);
                for (int g = 0; g < G; g++) a[g] += load_vec(qf + g * D + d, PD_F32) * kv;
            }
            for (int g = 0; g < G; g++) s[g * TILE + j] = hsum(a[g]);
            for (; d < D; d++) {
                const float x = load_one(kj, d, dtype);
                for (int g = 0; g < G; g++) s[g * TILE + j] += qf[g * D + d] * x;
            }
        }
        /* online softmax update: rescale the old state to the new max, add this tile; lanes
         * [cnt, padded) are -inf for the max and 0 after the exponential */
        const int padded = (cnt + VW - 1) / VW * VW;
        for (int g = 0; g < G; g++) {
            float *sg = s + g * TILE;
            for (int j = cnt; j < padded; j++) sg[j] = -INFINITY;
            vf mv = (vf){0} + m[g];
            for (int j = 0; j < padded; j += VW) {
                const vf x = load_vec(sg + j, PD_F32);
                mv = vselect((vu32)(x > mv), x, mv);
            }
            float mt = mv[0];
            for (int i = 1; i < VW; i++) mt = mv[i] > mt ? mv[i] : mt;
            vf sum = {0};
            for (int j = 0; j < padded; j += VW) {
                const vf p = exp_nonpos_v(load_vec(sg + j, PD_F32) - mt);
                memcpy(sg + j, &p, sizeof p);
            }
            for (int j = cnt; j < padded; j++) sg[j] = 0.0f;
            for (int j = 0; j < padded; j += VW) sum += load_vec(sg + j, PD_F32);
            const float alpha = expf(m[g] - mt); /* 0 on the first tile (m = -inf) */
            if (alpha != 1.0f)
                for (int d = 0; d < D; d++) acc[g * D + d] *= alpha;
            l[g] = l[g] * alpha + hsum(sum);
            m[g] = mt;
        }
        /* acc_g += sum_j p[g][j] * v_j, one head_dim chunk at a time (accumulators in registers) */
        int d = 0;
        for (; d < DV; d += VW) {
            vf a[GMAX];
            for (int g = 0; g < G; g++) a[g] = load_vec(acc + g * D + d, PD_F32);
            for (int j = 0; j < cnt; j++) {
                const vf vv = load_vec(vp + (j * step + (int64_t)d * es), dtype);
                for (int g = 0; g < G; g++) a[g] += s[g * TILE + j] * vv;
            }
            for (int g = 0; g < G; g++) memcpy(acc + g * D + d, &a[g], sizeof a[g]);
        }
        for (; d < D; d++)
            for (int j = 0; j < cnt; j++) {
                const float x = load_one(vp + j * step, d, dtype);
                for (int g = 0; g < G; g++) acc[g * D + d] += s[g * TILE + j] * x;
            }
        t0 += cnt;
    }
}

/* attend_range_impl with G (1..GMAX) and the KV dtype as compile-time constants */
static void attend_range(int G, const Cache *c, const int32_t *table, int h, const float *qf,
                         int64_t t_begin, int64_t t_end, float *m, float *l, float *acc) {
#define PD_CASE(NG)                                                                              \
    case NG:                                                                                     \
        if (c->kv_dtype == PD_F32)                                                               \
            attend_range_impl(NG, PD_F32, c, table, h, qf, t_begin, t_end, m, l, acc);           \
        else if (c->kv_dtype == PD_BF16)                                                         \
            attend_range_impl(NG, PD_BF16, c, table, h, qf, t_begin, t_end, m, l, acc);          \
        else                                                                                     \
            attend_range_impl(NG, PD_F16, c, table, h, qf, t_begin, t_end, m, l, acc);           \
        break;
    switch (G) {
        PD_CASE(1) PD_CASE(2) PD_CASE(3) PD_CASE(4) PD_CASE(5) PD_CASE(6) PD_CASE(7) PD_CASE(8)
    }
#undef PD_CASE
}

/* ---- entry point ------------------------------------------------------------------------------ */

/* Decode attention for num_decodes sequences, one query token each, written into `out`.
 *
 * q:    [*, heads, head_dim] in q_dtype; decode i reads row rows[i] (rows NULL: row i);
 *       strides in elements (q_tok_stride, q_head_stride; head_dim contiguous).
 * out:  same row indexing and dtype as q, strides o_tok_stride, o_head_stride.
 * k, v: one layer's caches [num_blocks, block_size, kv_heads, head_dim] in kv_dtype, each
 *       block contiguous (token stride kv_heads * head_dim), blocks blk_stride elements apart.
 * tables: int32 [num_decodes, table_stride] block ids; seq_lens: int32 [num_decodes] tokens of
 *       context (>= 1, already including the new token's K/V).
 * scale: softmax scale; num_splits >= 1 context partitions per sequence (split-K);
 * num_threads: OpenMP threads for this call.
 * dtypes: 0 float32, 1 bfloat16, 2 float16. Returns 0, or -1 when scratch memory ran out.
 */
int pd_paged_decode(const void *q, int64_t q_tok_stride, int64_t q_head_stride, int q_dtype,
                    const void *k, const void *v, int64_t blk_stride, int kv_dtype,
                    const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                    const int64_t *rows, void *out, int64_t o_tok_stride, int64_t o_head_stride,
                    int num_decodes, int heads, int kv_heads, int head_dim, int block_size,
                    float scale, int num_splits, int num_threads) {
    const Cache c = {(const char *)k, (const char *)v, blk_stride, (int64_t)kv_heads * head_dim,
                     kv_dtype, kv_heads, head_dim, block_size};
    const int G = heads / kv_heads, D = head_dim, S = num_splits < 1 ? 1 : num_splits;
    const int64_t pairs = (int64_t)num_decodes * kv_heads, items = pairs * S;
    /* split-K partials: per item m [G], l [G], acc [G, D] */
    float *part = NULL;
    if (S > 1) {
        part = (float *)malloc(sizeof(float) * (size_t)items * (size_t)G * (size_t)(D + 2));
        if (!part) return -1;
    }
    (void)num_threads;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t pair = it / S;
        const int split = (int)(it % S);
        const int64_t i = pair / kv_heads;
        const int h = (int)(pair % kv_heads);
        const int64_t n = seq_lens[i], row = rows ? rows[i] : i;
        /* split boundaries on whole blocks */
        const int64_t nblk = (n + block_size - 1) / block_size;
        const int64_t per = (nblk + S - 1) / S;
        int64_t t_begin = split * per * block_size, t_end = t_begin + per * block_size;
        if (t_end > n) t_end = n;
        if (t_begin > n) t_begin = n;

        float qf[G * D], mloc[G], lloc[G], accloc[G * D];
        const char *qrow = (const char *)q + row * q_tok_stride * elem_size(q_dtype);
        for (int g = 0; g < G; g++)
            for (int d = 0; d < D; d++)
                qf[g * D + d] =
                    scale * load_one(qrow, (int64_t)(h * G + g) * q_head_stride + d, q_dtype);
        float *m = mloc, *l = lloc, *acc = accloc;
        if (S > 1) {
            m = part + it * G * (D + 2);
            l = m + G;
            acc = l + G;
        }
        for (int g0 = 0; g0 < G; g0 += GMAX) /* query heads in passes of at most GMAX */
            attend_range(G - g0 < GMAX ? G - g0 : GMAX, &c, tables + i * table_stride, h,
                         qf + g0 * D, t_begin, t_end, m + g0, l + g0, acc + g0 * D);
        if (S == 1) {
            char *orow = (char *)out + row * o_tok_stride * elem_size(q_dtype);
            for (int g = 0; g < G; g++) {
                const float inv = 1.0f / l[g];
                for (int d = 0; d < D; d++)
                    store_one(orow, (int64_t)(h * G + g) * o_head_stride + d, acc[g * D + d] * inv,
                              q_dtype);
            }
        }
    }
    if (S == 1) return 0;

    /* merge the splits of each (sequence, KV head) pair */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t pair = 0; pair < pairs; pair++) {
        const int64_t i = pair / kv_heads;
        const int h = (int)(pair % kv_heads);
        const int64_t row = rows ? rows[i] : i;
        char *orow = (char *)out + row * o_tok_stride * elem_size(q_dtype);
        for (int g = 0; g < G; g++) {
            float mt = -INFINITY;
            for (int s = 0; s < S; s++) {
                const float ms = part[(pair * S + s) * G * (D + 2) + g];
                mt = ms > mt ? ms : mt;
            }
            float o[D], lt = 0.0f;
            for (int d = 0; d < D; d++) o[d] = 0.0f;
            for (int s = 0; s < S; s++) {
                const float *p = part + (pair * S + s) * G * (D + 2);
                if (p[G + g] == 0.0f) continue; /* an empty split */
                const float w = expf(p[g] - mt);
                lt += w * p[G + g];
                for (int d = 0; d < D; d++) o[d] += w * p[2 * G + g * D + d];
            }
            const float inv = 1.0f / lt;
            for (int d = 0; d < D; d++)
                store_one(orow, (int64_t)(h * G + g) * o_head_stride + d, o[d] * inv, q_dtype);
        }
    }
    free(part);
    return 0;
}
