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
 * Algorithm: one work item is (sequence, split): all query heads of one sequence over one range of
 * its context. The range goes in chunks of up to CHUNK tokens, each in three phases:
 *  1. scores of every query head for the chunk's tokens, tile by tile (a tile: consecutive tokens
 *     inside one block), every KV head of a tile before the next tile, so a block's rows are read
 *     front to back. The G query heads that share a KV head are scored together (grouped-query
 *     attention without repeating K/V), 16 tokens' dot products reduced at once with AVX-512,
 *     straight from bf16 K with VDPBF16PS where the CPU and dtypes allow;
 *  2. per head, one update of the running max, sum of exponentials and fp32 output accumulator:
 *     the single-pass "online softmax" of Milakov & Gimelshein, "Online normalizer calculation
 *     for softmax" (2018), as FlashAttention and FlashDecoding use it, here once per chunk;
 *  3. the weighted sum of V, tile by tile, with G x 4 vector accumulators per KV head; for bf16
 *     V on a CPU with AVX512_BF16, two tokens per VDPBF16PS against the probabilities rounded to
 *     bf16 (values_dp_blocks).
 * head_dim 64 is also compiled as a constant (fully unrolled loops); other sizes take the
 * general code.
 * While one chunk is computed, the next one (of this sequence, or the next item's first) is
 * prefetched into L2, its K rows under phase 0 and its V rows under phase 1, spread evenly over
 * the chunk's tiles and KV heads; a sequence's chunks are of even length so each prefetch has
 * a chunk of about its own size to hide under.
 * On a CPU with AMX, bf16 queries on bf16 K/V take attend_range_amx instead (both matmuls on the
 * tile unit; see there).
 * With more than one split per sequence (FlashDecoding's split-K, for few sequences and many
 * threads) each split's partial (max, sum, accumulator) is merged at the end by rescaling with
 * exp(max_split - max_total).
 *
 * Measured on a 2-core AMD EPYC (Zen 4, avx512_bf16), SmolLM2-135M's shapes (9 query / 3 KV
 * heads, head_dim 64, blocks of 16), batch 16 x 300 tokens, one thread, bf16: 0.21 ms a layer
 * with the KV in cache, 0.50 ms from DRAM, against 0.33 / 1.0 ms for the previous per-KV-head,
 * per-tile-softmax kernel (bench/cpu_attention.py; docs/benchmarks.md). Batch 16 x 320 tokens:
 * from DRAM 0.47-0.48 ms a layer with the chunk-ahead prefetch and even chunks, against 0.555-0.564
 * ms with the earlier prefetch (this tile's V, and the next chunk's K tile by tile at the same
 * place only), in one interleaved run (session 13). The VDPBF16PS values pass and the constant
 * head_dim 64 (session 14), interleaved against the code before: in cache 0.223 vs 0.280 ms a
 * layer at 320 tokens, 0.669 vs 0.776 at 1000; from DRAM 0.456 vs 0.528 and 1.302 vs 1.493.
 * The prefetches split over KV heads (session 14), against the code before, from DRAM: bf16
 * 0.326 vs 0.466 ms (320 tokens), 0.884 vs 1.123 (1000); fp32 0.632 vs 0.926, 2.188 vs 2.796;
 * in cache unchanged.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../cpu_kernels/vec_math.h"
#if defined(__AVX__) || defined(__F16C__)
#include <immintrin.h>
#endif

#define TILE 32   /* tokens per tile (within one block) */
#define CHUNK 256 /* tokens per online-softmax update */

typedef uint16_t vu16 __attribute__((vector_size(VW * 2)));

/* dtype codes: the caller's three, and PD_BF16_DP (see dot_lanes), the kernel's own */
enum { PD_F32 = 0, PD_BF16 = 1, PD_F16 = 2, PD_BF16_DP = 3 };

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


/* ---- one work item ---------------------------------------------------------------------------- */

#define GMAX 8 /* query heads per KV head handled in one pass (more: several passes) */

typedef struct {
    const char *k, *v;              /* layer caches [num_blocks, block_size, kv_heads, D] */
    int64_t blk_stride, tok_stride; /* elements */
    int kv_dtype, kv_heads, head_dim, block_size;
} Cache;

/* Prefetches spread over a tile's compute: runs of bytes (each a contiguous part of a block) to
 * bring into L2, issued a few lines at a time from inside the scores and values loops instead of
 * in one burst before them. */
#define PF_RUNS 6
typedef struct {
    const char *p[PF_RUNS];
    int64_t n[PF_RUNS]; /* bytes left in each run */
    int k, nr;          /* the run being issued, runs held */
    int rate;           /* lines to issue a token of compute */
} Pf;

/* Issue up to `lines` prefetches (64-byte lines) from pf, in order: a run's share in one tight
 * loop, its bookkeeping once per run rather than once per line. Session 34 measured this on the
 * attention alone (bench/cpu_attention.py: faster in cache, no faster or slower with every layer
 * cold) and reverted it; session 35 measured whole decode steps, where a layer's KV arrives
 * partly ahead of use (14 sequences at context 350, compiled SmolLM2, one thread, no helper,
 * three alternated rounds, a /tmp loop over bench/prefill_thread_overlap.py's build()): bf16
 * 14.7-16.0 ms against 15.8-17.3, fp32 27.3-27.5 against 26.7-28.0; served (disaggregated bf16
 * main workload, two alternated pairs) 570.5 / 571.9 tok/s against 556.1 / 533.1, p99 TPOT
 * 23.8-24.1 ms against 25.5-28.0. */
ALWAYS_INLINE void pf_issue(Pf *pf, int lines) {
    while (lines > 0 && pf->k < pf->nr) {
        const int k = pf->k;
        const char *p = pf->p[k];
        const int64_t left = (pf->n[k] + 63) >> 6;
        const int take = left < lines ? (int)left : lines;
        for (int i = 0; i < take; i++) __builtin_prefetch(p + 64 * i, 0, 2);
        pf->p[k] = p + 64 * take;
        if ((pf->n[k] -= 64 * (int64_t)take) <= 0) pf->k++;
        lines -= take;
    }
}

/* ---- scores -------------------------------------------------------------------------------- */

/* The KV dtype codes of the tile code: the three storage dtypes, plus PD_BF16_DP, bf16 K/V with
 * bf16 queries on a CPU with AVX512_BF16, whose scores take VDPBF16PS (bf16 pair dot products
 * summed in fp32; head_dim a multiple of 32) straight from the stored bf16 instead of widening
 * K to fp32 first. */
#if VW == 16 && defined(__AVX512BF16__) && defined(__AVX512BW__)
#define PD_HAVE_DP 1
#else
#define PD_HAVE_DP 0
#endif

/* AMX tiles (bf16): the decode (attend_range_amx) and prefill (prefill_item_amx) paths, each
 * with a process-wide switch (pd_set_decode_amx, pd_set_prefill_amx; on by default) */
#if PD_HAVE_DP && defined(__AMX_TILE__) && defined(__AMX_BF16__)
#define PD_HAVE_AMX 1
#include "../../cpu_kernels/amx_tiles.h"
#else
#define PD_HAVE_AMX 0
#endif
static int pd_decode_amx_enabled = 1, pd_prefill_amx_enabled = 1;

/* Sets one AMX path's switch (*enabled) to on; returns whether that path will run: 0 where the
 * build (no AMX at -march=native) or the OS (no tile data permission) rules it out. */
static int amx_switch(int *enabled, int on) {
    *enabled = on != 0;
#if PD_HAVE_AMX
    return *enabled && amx_permitted();
#else
    return 0;
#endif
}

/* Lane-wise partial dot products of one query head with one K row: sum over the lanes of the
 * result = q . k over d < DV (DV a multiple of VW; for PD_BF16_DP, D a multiple of 32 and qb the
 * query in bf16). */
ALWAYS_INLINE vf dot_lanes(const int dtype, int DV, const float *qf, const uint16_t *qb,
                           const char *kj) {
    vf a = {0};
#if PD_HAVE_DP
    if (dtype == PD_BF16_DP) {
        __m512 acc = _mm512_setzero_ps();
        for (int d = 0; d < DV; d += 32)
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512((const void *)(qb + d)),
                                   (__m512bh)_mm512_loadu_si512((const void *)(kj + 2 * d)));
        return (vf)acc;
    }
#endif
    (void)qb;
    const int es = elem_size(dtype == PD_BF16_DP ? PD_BF16 : dtype);
    for (int d = 0; d < DV; d += VW) a += load_vec(qf + d, PD_F32) * load_vec(kj + d * es, dtype);
    return a;
}

#if VW == 16
/* Reductions of many vectors at once ("transpose and add"): each level halves the number of
 * vectors and doubles the number of sequences each one holds partial sums for; after four levels
 * one vector holds the complete lane sums of 16 vectors, in order, for 45 shuffles and adds
 * instead of 16 separate horizontal sums. pair_sum: per 128-bit lane, x's and y's partial sums
 * interleaved [x, y, x, y]; quad_sum: of two pair_sums, per 128-bit lane [x, y, u, w]; oct_sum:
 * of two quad_sums (or of two oct_sums), combining 128-bit lanes. */
ALWAYS_INLINE vf pair_sum(vf x, vf y) {
    return (vf)_mm512_add_ps(_mm512_unpacklo_ps((__m512)x, (__m512)y),
                             _mm512_unpackhi_ps((__m512)x, (__m512)y));
}

ALWAYS_INLINE vf quad_sum(vf xy, vf uw) {
    const __m512d a = _mm512_castps_pd((__m512)xy), b = _mm512_castps_pd((__m512)uw);
    return (vf)_mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
}

ALWAYS_INLINE vf oct_sum(vf a, vf b) {
    return (vf)_mm512_add_ps(_mm512_shuffle_f32x4((__m512)a, (__m512)b, 0x88),
                             _mm512_shuffle_f32x4((__m512)a, (__m512)b, 0xdd));
}

/* Transposes the 16 x 16 floats of r in place (r[i][j] <-> r[j][i]): pairs of rows interleaved,
 * then quads within each 128-bit lane, then the 128-bit lanes across the four row groups. */
static inline void transpose16(__m512 r[16]) {
    __m512 t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    /* u[4g + k], 128-bit lane L: column 4L + k of rows 4g .. 4g + 3 */
    for (int g = 0; g < 16; g += 4) {
        u[g] = _mm512_shuffle_ps(t[g], t[g + 2], 0x44);
        u[g + 1] = _mm512_shuffle_ps(t[g], t[g + 2], 0xee);
        u[g + 2] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0x44);
        u[g + 3] = _mm512_shuffle_ps(t[g + 1], t[g + 3], 0xee);
    }
    for (int k = 0; k < 4; k++) {
        const __m512 a = _mm512_shuffle_f32x4(u[k], u[4 + k], 0x88); /* lanes 0, 2 */
        const __m512 b = _mm512_shuffle_f32x4(u[k], u[4 + k], 0xdd); /* lanes 1, 3 */
        const __m512 c = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0x88);
        const __m512 e = _mm512_shuffle_f32x4(u[8 + k], u[12 + k], 0xdd);
        r[k] = _mm512_shuffle_f32x4(a, c, 0x88);
        r[8 + k] = _mm512_shuffle_f32x4(a, c, 0xdd);
        r[4 + k] = _mm512_shuffle_f32x4(b, e, 0x88);
        r[12 + k] = _mm512_shuffle_f32x4(b, e, 0xdd);
    }
}
#endif

/* s[g * ss + j] = sscale * (q_g . k_j) for the `cnt` tokens of a tile (K rows at kp, `step`
 * bytes apart), G query heads; lanes past cnt (up to the next multiple of VW) get junk that the
 * caller overwrites or masks. With 16-float vectors the scores of 16 tokens are reduced
 * together (pair_sum, quad_sum, oct_sum); with AVX2 blocks of 4 tokens x 3 heads (fp32, batch 16
 * x 336 tokens, SmolLM2's heads, one Zen 1 core: 1.62 against 1.70 ms a layer with one horizontal
 * sum per score; the scores phase alone 0.73 against 1.23 ms); otherwise one horizontal sum per
 * score. */
ALWAYS_INLINE void tile_scores(const int G, const int dtype, const int D, const char *kp,
                               int64_t step, int cnt, const float *qf, const uint16_t *qb,
                               float sscale, float *s, int64_t ss, Pf *pf) {
    const int DV = dtype == PD_BF16_DP ? D : D - D % VW;
    const int sd = dtype == PD_BF16_DP ? PD_BF16 : dtype;
#if VW == 16
    for (int j0 = 0; j0 < cnt; j0 += 16) {
        vf quads[GMAX][4];
#pragma GCC unroll 4
        for (int qd = 0; qd < 4; qd++) {
            if (pf) pf_issue(pf, 4 * pf->rate);
            vf a[GMAX][4];
#pragma GCC unroll 4
            for (int t = 0; t < 4; t++) {
                const int j = j0 + qd * 4 + t;
                const char *kj = kp + (j < cnt ? j : 0) * step; /* past cnt: junk, masked */
#pragma GCC unroll 8
                for (int g = 0; g < G; g++)
                    a[g][t] = dot_lanes(dtype, DV, qf + g * D, qb + g * D, kj);
            }
#pragma GCC unroll 8
            for (int g = 0; g < G; g++)
                quads[g][qd] = quad_sum(pair_sum(a[g][0], a[g][1]), pair_sum(a[g][2], a[g][3]));
        }
#pragma GCC unroll 8
        for (int g = 0; g < G; g++) {
            const vf r = oct_sum(oct_sum(quads[g][0], quads[g][1]),
                                 oct_sum(quads[g][2], quads[g][3])) * sscale;
            memcpy(s + g * ss + j0, &r, sizeof r);
        }
    }
#elif VW == 8 && defined(__AVX2__) && defined(__FMA__)
    /* 8-float vectors (AVX2): blocks of 4 tokens x up to 3 query heads, head_dim outermost, so
     * each K vector loaded feeds 3 FMAs and each query vector 4, with 12 independent accumulator
     * chains (one head's dot product alone waits on its chain's FMA latency); the 4 tokens' lane
     * sums of a head reduced together by three horizontal adds */
    const int es = elem_size(sd);
#pragma GCC unroll 3
    for (int g0 = 0; g0 < G; g0 += 3) {
        const int gn = G - g0 < 3 ? G - g0 : 3;
        for (int j0 = 0; j0 < cnt; j0 += 4) {
            if (pf && g0 == 0) pf_issue(pf, 4 * pf->rate);
            const char *kj[4];
            for (int t = 0; t < 4; t++) kj[t] = kp + (j0 + t < cnt ? j0 + t : 0) * step;
            __m256 a[3][4];
            for (int g = 0; g < 3; g++)
                for (int t = 0; t < 4; t++) a[g][t] = _mm256_setzero_ps();
            for (int d = 0; d < DV; d += 8) {
                __m256 qv[3];
                for (int g = 0; g < gn; g++) qv[g] = _mm256_loadu_ps(qf + (g0 + g) * D + d);
#pragma GCC unroll 4
                for (int t = 0; t < 4; t++) {
                    const __m256 kv = (__m256)load_vec(kj[t] + (int64_t)d * es, dtype);
#pragma GCC unroll 3
                    for (int g = 0; g < gn; g++) a[g][t] = _mm256_fmadd_ps(qv[g], kv, a[g][t]);
                }
            }
#pragma GCC unroll 3
            for (int g = 0; g < gn; g++) {
                const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a[g][0], a[g][1]),
                                                _mm256_hadd_ps(a[g][2], a[g][3]));
                const __m128 r = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(h),
                                                       _mm256_extractf128_ps(h, 1)),
                                            _mm_set1_ps(sscale));
                _mm_storeu_ps(s + (g0 + g) * ss + j0, r);
            }
        }
    }
#else
    for (int j = 0; j < cnt; j++) {
        const char *kj = kp + j * step;
        if (pf) pf_issue(pf, pf->rate);
        for (int g = 0; g < G; g++)
            s[g * ss + j] = sscale * hsum(dot_lanes(dtype, DV, qf + g * D, qb + g * D, kj));
    }
#endif
    for (int d = DV; d < D; d++) /* head_dim past the last full vector */
        for (int j = 0; j < cnt; j++) {
            const float x = load_one(kp + j * step, d, sd);
            for (int g = 0; g < G; g++) s[g * ss + j] += qf[g * D + d] * x;
        }
}

/* ---- values ------------------------------------------------------------------------------- */

/* acc [G, D] += sum_j p[g * ps + j] * v_j over the `cnt` tokens of a tile (V rows at vp, `step`
 * bytes apart), NC head_dim chunks at a time: G * NC independent accumulators in registers keep
 * the FMA units busy (one chunk at a time leaves them waiting on each accumulator's previous
 * FMA). */
ALWAYS_INLINE void tile_values(const int G, const int sd, const int D, const char *vp,
                               int64_t step, int cnt, const float *p, int64_t ps, float *acc,
                               Pf *pf) {
    enum { NC = 4 }; /* the most chunks at a time */
    const int nc = G <= 4 ? 4 : 2, DV = D - D % VW, es = elem_size(sd);
    int d = 0;
    for (; d + nc * VW <= DV; d += nc * VW) {
        vf a[GMAX][NC];
        for (int g = 0; g < G; g++)
            for (int c = 0; c < nc; c++) a[g][c] = load_vec(acc + g * D + d + c * VW, PD_F32);
        for (int j = 0; j < cnt; j++) {
            if (pf) pf_issue(pf, pf->rate);
            const char *vj = vp + j * step + (int64_t)d * es;
            vf vv[NC];
            for (int c = 0; c < nc; c++) vv[c] = load_vec(vj + c * VW * es, sd);
            for (int g = 0; g < G; g++) {
                const float pj = p[g * ps + j];
                for (int c = 0; c < nc; c++) a[g][c] += pj * vv[c];
            }
        }
        for (int g = 0; g < G; g++)
            for (int c = 0; c < nc; c++) memcpy(acc + g * D + d + c * VW, &a[g][c], sizeof(vf));
    }
    for (; d < DV; d += VW) {
        vf a[GMAX];
        for (int g = 0; g < G; g++) a[g] = load_vec(acc + g * D + d, PD_F32);
        for (int j = 0; j < cnt; j++) {
            const vf vv = load_vec(vp + (j * step + (int64_t)d * es), sd);
            for (int g = 0; g < G; g++) a[g] += p[g * ps + j] * vv;
        }
        for (int g = 0; g < G; g++) memcpy(acc + g * D + d, &a[g], sizeof a[g]);
    }
    for (; d < D; d++)
        for (int j = 0; j < cnt; j++) {
            const float x = load_one(vp + j * step, d, sd);
            for (int g = 0; g < G; g++) acc[g * D + d] += p[g * ps + j] * x;
        }
}

#if PD_HAVE_DP
/* The values pass of PD_BF16_DP: acc += sum_j p_j * v_j over the `cnt` tokens of a tile, two
 * tokens per VDPBF16PS. pb: the G heads' probabilities already rounded to bf16 (row stride ps);
 * V rows at vp, `step` bytes apart, head_dim D a multiple of 32. The rows of tokens j and j + 1
 * are interleaved word by word (vpunpck{l,h}wd), so each 32-bit lane holds (v_j[d], v_j+1[d])
 * and one VDPBF16PS against the broadcast pair (p_j, p_j+1) adds both products into an fp32
 * lane: half the multiply-adds of the fp32 path, and no widening of V. The unpacks work within
 * 128-bit lanes, so acc is kept in that permuted order: per 32 values of d, the first 16 floats
 * hold d = 8L + {0..3} and the next 16 d = 8L + {4..7} for L = 0..3 (dp_unpermute restores it).
 * Rounding the probabilities to bf16 before the weighted sum is what FlashAttention-2 does on
 * GPUs (P is cast to the input dtype for its PV matmul); the softmax sum l stays fp32. */
ALWAYS_INLINE void values_dp_blocks(const int G, const int NB, const char *vp, int64_t step,
                                    int cnt, const uint16_t *pb, int64_t ps, float *acc,
                                    const int D, int d, Pf *pf) {
    __m512 a[GMAX][4]; /* [head][2 * block + half], NB <= 2 */
    for (int g = 0; g < G; g++)
        for (int x = 0; x < 2 * NB; x++) a[g][x] = _mm512_loadu_ps(acc + g * D + d + 16 * x);
    for (int j = 0; j < cnt; j += 2) {
        if (pf) pf_issue(pf, 2 * pf->rate);
        const char *r = vp + j * step + (int64_t)d * 2;
        const int pair = j + 1 < cnt;
        __m512i lo[2], hi[2];
        for (int b = 0; b < NB; b++) {
            const __m512i x = _mm512_loadu_si512((const void *)(r + 64 * b));
            /* past the tile: a zero row (the row there may be another sequence's, or NaN) */
            const __m512i y = pair ? _mm512_loadu_si512((const void *)(r + step + 64 * b))
                                   : _mm512_setzero_si512();
            lo[b] = _mm512_unpacklo_epi16(x, y);
            hi[b] = _mm512_unpackhi_epi16(x, y);
        }
        for (int g = 0; g < G; g++) {
            uint32_t pp;
            memcpy(&pp, pb + g * ps + j, sizeof pp);
            if (!pair) pp &= 0xffffu; /* the word past the tile may be unset */
            const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)pp);
            for (int b = 0; b < NB; b++) {
                a[g][2 * b] = _mm512_dpbf16_ps(a[g][2 * b], pv, (__m512bh)lo[b]);
                a[g][2 * b + 1] = _mm512_dpbf16_ps(a[g][2 * b + 1], pv, (__m512bh)hi[b]);
            }
        }
    }
    for (int g = 0; g < G; g++)
        for (int x = 0; x < 2 * NB; x++) _mm512_storeu_ps(acc + g * D + d + 16 * x, a[g][x]);
}

/* tile_values for PD_BF16_DP (see values_dp_blocks): two 32-value blocks of d at a time while
 * the 4G accumulators fit the 32 vector registers, else one. */
ALWAYS_INLINE void tile_values_dp(const int G, const int D, const char *vp, int64_t step,
                                  int cnt, const uint16_t *pb, int64_t ps, float *acc, Pf *pf) {
    int d = 0;
    if (G <= 6)
        for (; d + 64 <= D; d += 64) values_dp_blocks(G, 2, vp, step, cnt, pb, ps, acc, D, d, pf);
    for (; d < D; d += 32) values_dp_blocks(G, 1, vp, step, cnt, pb, ps, acc, D, d, pf);
}

/* Probabilities [n] (fp32, n padded to VW with zeros) -> bf16, round to nearest even */
static void probs_to_bf16(const float *s, int64_t n, uint16_t *pb) {
    for (int64_t j = 0; j < n; j += 16) {
        const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(s + j));
        memcpy(pb + j, &h, sizeof h);
    }
}

/* acc [heads, D] from the permuted order of values_dp_blocks back to d order */
static void dp_unpermute(float *acc, int heads, int D) {
    float t[32];
    for (int i = 0; i < heads * D; i += 32) {
        for (int x = 0; x < 32; x++) {
            const int q = x & 15, half = x >> 4;
            t[8 * (q >> 2) + 4 * half + (q & 3)] = acc[i + x];
        }
        memcpy(acc + i, t, sizeof t);
    }
}
#endif

/* tile_scores (phase 0) or tile_values (phase 1) with G (1..GMAX) and the KV dtype code as
 * compile-time constants, so the per-head loops unroll and the accumulators live in registers.
 * See those two for the arguments (p: the scores row, ps its stride; kvp: K or V rows; pb: for
 * PD_BF16_DP's values, the probabilities in bf16, stride ps). */
static void tile_phase(int phase, int G, int dtype, int D, const char *kvp, int64_t step, int cnt,
                       const float *qf, const uint16_t *qb, float sscale, float *p, int64_t ps,
                       const uint16_t *pb, float *acc, Pf *pf) {
#define PD_TILE_D(NG, DT, DC)                                                                    \
    do {                                                                                         \
        if (phase == 0)                                                                          \
            tile_scores(NG, DT, DC, kvp, step, cnt, qf, qb, sscale, p, ps, pf);                    \
        else                                                                                     \
            tile_values(NG, DT, DC, kvp, step, cnt, p, ps, acc, pf);                               \
    } while (0)
/* head_dim 64 (SmolLM2, Llama-3.2-1B, ...) as a constant too: its loops then unroll fully */
#define PD_TILE(NG, DT)                                                                          \
    do {                                                                                         \
        if (D == 64)                                                                             \
            PD_TILE_D(NG, DT, 64);                                                               \
        else                                                                                     \
            PD_TILE_D(NG, DT, D);                                                                \
    } while (0)
#if PD_HAVE_DP
#define PD_TILE_DP_D(NG, DC)                                                                     \
    do {                                                                                         \
        if (phase == 0)                                                                          \
            tile_scores(NG, PD_BF16_DP, DC, kvp, step, cnt, qf, qb, sscale, p, ps, pf);            \
        else                                                                                     \
            tile_values_dp(NG, DC, kvp, step, cnt, pb, ps, acc, pf);                               \
    } while (0)
#define PD_DP_CASE(NG)                                                                           \
    else if (dtype == PD_BF16_DP) {                                                              \
        if (D == 64)                                                                             \
            PD_TILE_DP_D(NG, 64);                                                                \
        else                                                                                     \
            PD_TILE_DP_D(NG, D);                                                                 \
    }
#else
#define PD_DP_CASE(NG)
#endif
#define PD_CASE(NG)                                                                              \
    case NG:                                                                                     \
        if (dtype == PD_F32)                                                                     \
            PD_TILE(NG, PD_F32);                                                                 \
        else if (dtype == PD_BF16)                                                               \
            PD_TILE(NG, PD_BF16);                                                                \
        PD_DP_CASE(NG)                                                                           \
        else PD_TILE(NG, PD_F16);                                                                \
        break;
    switch (G) {
        PD_CASE(1) PD_CASE(2) PD_CASE(3) PD_CASE(4) PD_CASE(5) PD_CASE(6) PD_CASE(7) PD_CASE(8)
    }
#undef PD_CASE
#undef PD_DP_CASE
#undef PD_TILE_DP_D
#undef PD_TILE
#undef PD_TILE_D
}

/* ---- softmax -------------------------------------------------------------------------------- */

ALWAYS_INLINE float hmax(vf v) {
#if VW == 16
    return _mm512_reduce_max_ps((__m512)v);
#elif VW == 8
    __m128 x = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
    x = _mm_max_ps(x, _mm_movehl_ps(x, x));
    x = _mm_max_ss(x, _mm_movehdup_ps(x));
    return _mm_cvtss_f32(x);
#else
    float x = v[0];
    for (int i = 1; i < VW; i++) x = v[i] > x ? v[i] : x;
    return x;
#endif
}

/* The online-softmax update of one query head by a chunk of n scores s [n] (the buffer holds at
 * least n rounded up to VW): m, l and acc [D] are rescaled to the new max (exp(m_old - m_new)),
 * the scores become their weights exp(s - m_new), lanes past n become 0, and l grows by their
 * sum. */
static void softmax_chunk(float *s, int64_t n, int D, float *m, float *l, float *acc) {
    const int64_t padded = (n + VW - 1) / VW * VW;
    for (int64_t j = n; j < padded; j++) s[j] = -INFINITY;
    vf mv = (vf){0} + *m;
    for (int64_t j = 0; j < padded; j += VW) {
        const vf x = load_vec(s + j, PD_F32);
        mv = vselect((vu32)(x > mv), x, mv);
    }
    const float mt = hmax(mv);
    const float alpha = expf(*m - mt); /* 0 on the first chunk (m = -inf) */
    if (alpha != 1.0f)
        for (int d = 0; d < D; d++) acc[d] *= alpha;
    vf sum = {0};
    for (int64_t j = 0; j < padded; j += VW) {
        const vf p = exp_nonpos_v(load_vec(s + j, PD_F32) - mt);
        memcpy(s + j, &p, sizeof p);
    }
    for (int64_t j = n; j < padded; j++) s[j] = 0.0f;
    for (int64_t j = 0; j < padded; j += VW) sum += load_vec(s + j, PD_F32);
    *l = *l * alpha + hsum(sum);
    *m = mt;
}

/* Tokens [t0, t0 + cnt) of a sequence, one tile: within one block, at most TILE long */
static inline int tile_len(const Cache *c, int64_t t0, int64_t t_end) {
    int cnt = c->block_size - (int)(t0 % c->block_size);
    if (cnt > TILE) cnt = TILE;
    if (cnt > t_end - t0) cnt = (int)(t_end - t0);
    return cnt;
}

/* Byte offset of token t's row (all KV heads) in a layer cache, through the block table */
static inline int64_t row_offset(const Cache *c, const int32_t *table, int64_t t) {
    const int64_t blk = table[t / c->block_size];
    return (blk * c->blk_stride + (t % c->block_size) * c->tok_stride) * elem_size(c->kv_dtype);
}

/* Prefetch into L2 the rows (all KV heads) of tokens [t_begin, t_end) of one cache (kv: c->k or
 * c->v) through block table `table`, block by block. */
static inline void prefetch_rows(const Cache *c, const char *kv, const int32_t *table,
                                 int64_t t_begin, int64_t t_end, Pf *pf) {
    const int64_t step = c->tok_stride * elem_size(c->kv_dtype);
    for (int64_t t = t_begin; t < t_end;) {
        int64_t n = c->block_size - t % c->block_size;
        if (n > t_end - t) n = t_end - t;
        const char *p = kv + row_offset(c, table, t);
        if (pf->nr < PF_RUNS) {
            pf->p[pf->nr] = p;
            pf->n[pf->nr++] = n * step;
        } else
            for (int64_t b = 0; b < n * step; b += 64) __builtin_prefetch(p + b, 0, 2);
        t += n;
    }
}

/* Tokens per chunk for a range of n tokens: at most CHUNK, the chunks as even as they can be (a
 * 320-token context goes as 160 + 160, not 256 + 64), so the prefetch of each next chunk spreads
 * over a chunk of about its own length. */
static inline int64_t chunk_len(int64_t n) {
    const int64_t chunks = (n + CHUNK - 1) / CHUNK;
    return chunks > 1 ? (n + chunks - 1) / chunks : n;
}

/* Attend all query heads of one sequence (queries as for tile_scores: qf [heads, D], qb,
 * sscale; head h * G + g belongs to KV head h) to its tokens [t_begin, t_end) through block table
 * `table`. On return m [heads], l [heads] and acc [heads, D] hold each head's softmax state: the
 * max score, the sum of exp(score - m) and the unnormalised sum of exp(score - m) * v.
 *
 * The tokens go in chunks of up to CHUNK: the scores of the whole chunk for every head first
 * (tile by tile, every KV head of a tile before the next, so each block's rows are read front to
 * back), then one online-softmax update per head and chunk (softmax_chunk), then the values, tile
 * by tile. Updating the softmax state once per chunk instead of once per tile keeps its
 * reductions and rescaling off the per-token cost; scores [heads, CHUNK + VW] floats live on the
 * stack. */
static void attend_range(const Cache *c, int G, int dtype, const int32_t *table, const float *qf,
                         const uint16_t *qb, float sscale, int64_t t_begin, int64_t t_end,
                         float *m, float *l, float *acc, const int32_t *next_table,
                         int64_t next_begin, int64_t next_end, int prefetched) {
    const int D = c->head_dim, es = elem_size(c->kv_dtype), heads = G * c->kv_heads;
    const int64_t step = c->tok_stride * es, ss = CHUNK + TILE; /* scores row stride */
    float s[heads * ss];
#if PD_HAVE_DP
    uint16_t pb[dtype == PD_BF16_DP ? heads * ss : 1]; /* the probabilities in bf16 */
#else
    uint16_t *pb = NULL;
#endif
    for (int i = 0; i < heads; i++) {
        m[i] = -INFINITY;
        l[i] = 0.0f;
    }
    memset(acc, 0, sizeof(float) * (size_t)heads * (size_t)D);
    const int64_t clen = chunk_len(t_end - t_begin);
    for (int64_t c0 = t_begin; c0 < t_end;) {
        const int64_t c1 = c0 + clen < t_end ? c0 + clen : t_end;
        const int first = c0 == t_begin && !prefetched;
        const int32_t *pf_table = table; /* the next chunk: tokens [pf_begin, pf_end) */
        int64_t pf_begin = c1, pf_end = c1 + clen < t_end ? c1 + clen : t_end;
        if (c1 == t_end) {
            pf_table = next_table;
            pf_begin = next_begin;
            pf_end = next_begin + chunk_len(next_end - next_begin);
        }
        if (!pf_table || pf_begin >= pf_end) pf_table = NULL;
        for (int phase = 0; phase < 2; phase++) {
            if (phase == 1)
                for (int i = 0; i < heads; i++) {
                    softmax_chunk(s + i * ss, c1 - c0, D, m + i, l + i, acc + (int64_t)i * D);
#if PD_HAVE_DP
                    if (dtype == PD_BF16_DP) probs_to_bf16(s + i * ss, c1 - c0, pb + i * ss);
#endif
                }
            for (int64_t t0 = c0; t0 < c1;) {
                const int cnt = tile_len(c, t0, c1);
                const int64_t base = row_offset(c, table, t0);
                const char *kvp = phase == 0 ? c->k : c->v;
                /* prefetch into L2 the chunk after this one (the rest of this sequence, or the
                 * next item's first chunk): in phase 0 its K rows, in phase 1 its V rows, a share
                 * of its tokens proportional to this tile's share of this chunk, split again
                 * over the tile's KV heads, each part issued a few lines a token from inside
                 * that head's scores or values loop (Pf; session 22: from DRAM 0.523 vs 0.593
                 * ms a layer, bf16 16 x 384, 0.929 vs 1.022 fp32, against the whole part in one
                 * burst before the loop, bench/cpu_attention.py --baseline-rev). The
                 * loads then flow evenly under both phases' compute, a chunk ahead of their use
                 * (two chunks of SmolLM2's K/V: ~400 KB of L2), in bursts small enough for the
                 * core's outstanding-miss slots (one burst per tile, ~100 lines for SmolLM2,
                 * ran 1.3-1.5x slower from DRAM, session 14). The first chunk of a call had
                 * nothing ahead of it: there phase 0 also fetches this tile's own V rows. */
                const int64_t len = c1 - c0, pn = pf_end - pf_begin;
                const int64_t pf_lo = pf_begin + (t0 - c0) * pn / len;
                const int64_t pf_n = pf_begin + (t0 + cnt - c0) * pn / len - pf_lo;
                for (int h = 0; h < c->kv_heads; h++) {
                    const int64_t a = (int64_t)h * cnt / c->kv_heads;
                    const int64_t b = (int64_t)(h + 1) * cnt / c->kv_heads;
                    Pf pf = {.k = 0, .nr = 0};
                    if (first && phase == 0) prefetch_rows(c, c->v, table, t0 + a, t0 + b, &pf);
                    if (pf_table)
                        prefetch_rows(c, phase == 0 ? c->k : c->v, pf_table,
                                      pf_lo + h * pf_n / c->kv_heads,
                                      pf_lo + (h + 1) * pf_n / c->kv_heads, &pf);
                    int64_t lines = 0;
                    for (int r = 0; r < pf.nr; r++) lines += (pf.n[r] + 63) / 64;
                    pf.rate = (int)((lines + cnt - 1) / cnt);
                    for (int g0 = 0; g0 < G; g0 += GMAX) { /* query heads in passes of <= GMAX */
                        const int i = h * G + g0;
                        tile_phase(phase, G - g0 < GMAX ? G - g0 : GMAX, dtype, D,
                                   kvp + base + (int64_t)h * D * es, step, cnt,
                                   qf + (int64_t)i * D, qb + (int64_t)i * D, sscale,
                                   s + i * ss + (t0 - c0), ss,
                                   dtype == PD_BF16_DP ? pb + i * ss + (t0 - c0) : NULL,
                                   acc + (int64_t)i * D, pf.nr ? &pf : NULL);
                    }
                    pf_issue(&pf, 1 << 30); /* what the loops left */
                }
                t0 += cnt;
            }
        }
        c0 = c1;
    }
#if PD_HAVE_DP
    if (dtype == PD_BF16_DP) dp_unpermute(acc, heads, D);
#endif
}

/* ---- decode on AMX tiles ------------------------------------------------------------------ */

#if PD_HAVE_AMX

#define AMX_LANES 16    /* query heads in one pass: the columns of a scores tile */
#define AMX_MAX_D 256   /* the largest head_dim attend_range_amx takes */
#define AMX_CHUNK 256   /* tokens per online-softmax update (a multiple of 16) */

/* Whether attend_range_amx takes these shapes: G query heads a KV head (at most 16), head_dim a
 * multiple of 32 up to AMX_MAX_D, KV blocks a multiple of 16 tokens (a tile of 16 rows then
 * never crosses a block). */
static inline int decode_amx_fits(int G, int D, int block_size) {
    return G >= 1 && G <= AMX_LANES && D % 32 == 0 && D <= AMX_MAX_D && block_size % 16 == 0;
}

/* attend_range for bf16 queries and K/V on a CPU with AMX: both matmuls of a decode token on the
 * tile unit, the query heads of up to 16 / G KV heads at once (one pass; more KV heads, more
 * passes). Same arguments and results as attend_range (qb the queries in bf16, unscaled; m, l
 * and acc the softmax state of every query head), the tokens in chunks of up to AMX_CHUNK:
 *  1. scores, 16 tokens (one tile of K rows, straight from their block) at a time, transposed:
 *     S^T [16 tokens][16 heads] = sum over 32-dim slices of the pass's K row part of K_slice
 *     Q_slice^T, Q^T holding each head's query in the slices of its own KV head and zeros in
 *     the others', so one 16 x 16 result holds every head of the pass;
 *  2. the online softmax (Milakov & Gimelshein, 2018) down the tokens, one head a vector lane;
 *     the probabilities rounded to bf16 (as the VDPBF16PS path and FlashAttention-2 do) and
 *     transposed to one row a head;
 *  3. values, per KV head: O [16 heads][32 dims] += P V_slice for each 32-dim slice of V,
 *     with V's rows loaded as they lie in the block. TDPBF16PS pairs the K dimension (tokens)
 *     two by two against pairs of B's columns, so a raw V row (32 dims) makes B columns of
 *     (dim 2j, dim 2j + 1); two products against the probabilities interleaved with zeros,
 *     (p, 0) and (0, p), give the even and the odd dims apart, one token a pair.
 * Rows past the context in the last tile are masked: their scores -inf, their V rows read from
 * a zeroed copy (the pool's rows there may hold another sequence's data, or NaN). The thread's
 * tiles are configured on entry and released on exit. Only this tile's V rows are prefetched
 * (under its scores, so the values read them from L2): prefetching K as well, the next tile's
 * or the next chunk's, was slower in every arrangement tried (session 22).
 * Measured on a 2-core AMX Xeon, SmolLM2's shapes, batch 16, one thread, bf16
 * (bench/cpu_attention.py --baseline-rev, against the VDPBF16PS path): 0.319 vs 0.359 ms a layer
 * at 384 tokens with the KV in cache, 0.827 vs 1.018 at 1000; from DRAM the same (0.538 vs
 * 0.535, 1.558 vs 1.560): there both are bound by the memory stream. Served (the bf16
 * disaggregated main workload, three alternated pairs): 429.3 / 422.5 / 434.7 output tok/s
 * against 409.8 / 408.7 / 423.4. */
static void attend_range_amx(const Cache *c, int G, const int32_t *table, const uint16_t *qb,
                             float scale, int64_t t_begin, int64_t t_end, float *m, float *l,
                             float *acc) {
    const int D = c->head_dim, kvh = c->kv_heads, per_pass = AMX_LANES / G;
    const int64_t step = c->tok_stride * 2; /* bytes from one token's row to the next */
    float st[AMX_CHUNK * 16] __attribute__((aligned(64)));             /* S^T */
    uint32_t ab[AMX_CHUNK / 16][2][256] __attribute__((aligned(64))); /* P as (p, 0), (0, p) */
    uint32_t qt[per_pass * D / 32 * 256] __attribute__((aligned(64))); /* Q^T pairs a slice */
    float cb[4][256] __attribute__((aligned(64)));
    char vtail[16 * step] __attribute__((aligned(64)));
    amx_configure_16x64(8);
    for (int h0 = 0; h0 < kvh; h0 += per_pass) {
        const int nh = kvh - h0 < per_pass ? kvh - h0 : per_pass, nq = nh * G;
        const int nkd = nh * D / 32; /* 32-dim slices of the pass's part of a row */
        const int64_t hoff = (int64_t)h0 * D * 2;
        /* Q^T in pairs: qt[kd][r][n] = (q_n[2r], q_n[2r + 1]) of slice kd for the heads n of
         * the slice's KV head, 0 for the others */
        memset(qt, 0, sizeof(uint32_t) * 256 * (size_t)nkd);
        for (int kd = 0; kd < nkd; kd++) {
            const int hh = kd * 32 / D, d0 = kd * 32 % D;
            for (int g = 0; g < G; g++) {
                const int n = hh * G + g;
                const uint16_t *qr = qb + (int64_t)(h0 * G + n) * D + d0;
                for (int r = 0; r < 16; r++)
                    qt[kd * 256 + r * 16 + n] = qr[2 * r] | (uint32_t)qr[2 * r + 1] << 16;
            }
        }
        float *mp = m + h0 * G, *lp = l + h0 * G, *ap = acc + (int64_t)h0 * G * D;
        for (int n = 0; n < nq; n++) {
            mp[n] = -INFINITY;
            lp[n] = 0.0f;
        }
        memset(ap, 0, sizeof(float) * (size_t)nq * (size_t)D);
        __m512 mv = _mm512_set1_ps(-INFINITY), lv = _mm512_setzero_ps();
        for (int64_t c0 = t_begin; c0 < t_end; c0 += AMX_CHUNK) {
            const int64_t c1 = c0 + AMX_CHUNK < t_end ? c0 + AMX_CHUNK : t_end;
            const int n = (int)(c1 - c0), ntile = (n + 15) / 16;
            /* 1. S^T, 16 tokens a tile */
            for (int i = 0; i < ntile; i++) {
                const char *kp = c->k + row_offset(c, table, c0 + 16 * i) + hoff;
                /* prefetch into L2 this tile's V rows (all KV heads; the first pass only), spread
                 * over the tile's slices: the values below then read them from L2 */
                Pf pf = {.k = 0, .nr = 0};
                if (h0 == 0) {
                    const int64_t rows = n - 16 * i < 16 ? n - 16 * i : 16;
                    pf.p[0] = c->v + row_offset(c, table, c0 + 16 * i);
                    pf.n[0] = rows * step;
                    pf.nr = 1;
                }
                const int per_kd = (int)((pf.nr ? (pf.n[0] + 63) / 64 : 0) + nkd - 1) / nkd;
                _tile_zero(0);
                for (int kd = 0; kd < nkd; kd++) {
                    pf_issue(&pf, per_kd);
                    _tile_loadd(1, kp + kd * 64, step);
                    _tile_loadd(2, qt + kd * 256, 64);
                    _tile_dpbf16ps(0, 1, 2);
                }
                _tile_stored(0, st + i * 256, 64);
            }
            /* 2. softmax down the tokens, one head a lane */
            const __m512 sc = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
            for (int j = n; j < ntile * 16; j++) _mm512_store_ps(st + j * 16, ninf);
            __m512 mx = mv;
            for (int j = 0; j < n; j++) {
                const __m512 x = _mm512_mul_ps(_mm512_load_ps(st + j * 16), sc);
                _mm512_store_ps(st + j * 16, x);
                mx = _mm512_max_ps(mx, x);
            }
            const __m512 alpha = (__m512)exp_nonpos_v((vf)_mm512_sub_ps(mv, mx));
            __m512 sum = _mm512_setzero_ps();
            for (int i = 0; i < ntile; i++) {
                __m512 r[16];
                for (int j = 0; j < 16; j++) {
                    const __m512 x = _mm512_load_ps(st + (i * 16 + j) * 16);
                    r[j] = (__m512)exp_nonpos_v((vf)_mm512_sub_ps(x, mx));
                    sum = _mm512_add_ps(sum, r[j]);
                }
                transpose16(r); /* r[head]: its 16 tokens' probabilities */
                for (int q = 0; q < 16; q++) {
                    const __m512i e = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(r[q]));
                    _mm512_store_si512(ab[i][0] + q * 16, e);
                    _mm512_store_si512(ab[i][1] + q * 16, _mm512_slli_epi32(e, 16));
                }
            }
            lv = _mm512_add_ps(_mm512_mul_ps(lv, alpha), sum);
            mv = mx;
            float al[16];
            _mm512_storeu_ps(al, alpha);
            for (int q = 0; q < nq; q++)
                for (int d = 0; d < D; d++) ap[q * D + d] *= al[q];
            /* the last tile's V rows past the context: a zeroed copy */
            const int tail = n % 16;
            if (tail) {
                memset(vtail, 0, (size_t)(16 * step));
                const char *vr = c->v + row_offset(c, table, c0 + 16 * (ntile - 1));
                memcpy(vtail, vr, (size_t)(tail * step));
            }
            /* 3. O += P V, per KV head, two 32-dim slices (four result tiles) at a time */
            for (int hh = 0; hh < nh; hh++) {
                const int64_t voff = hoff + (int64_t)hh * D * 2;
                for (int s0 = 0; s0 < D / 32; s0 += 2) {
                    const int two = s0 + 1 < D / 32;
                    _tile_zero(0);
                    _tile_zero(1);
                    _tile_zero(2);
                    _tile_zero(3);
                    for (int i = 0; i < ntile; i++) {
                        const char *vp = tail && i == ntile - 1
                                             ? vtail + voff
                                             : c->v + row_offset(c, table, c0 + 16 * i) + voff;
                        _tile_loadd(4, ab[i][0], 64);
                        _tile_loadd(5, ab[i][1], 64);
                        _tile_loadd(6, vp + s0 * 64, step);
                        _tile_dpbf16ps(0, 4, 6);
                        _tile_dpbf16ps(1, 5, 6);
                        if (two) {
                            _tile_loadd(7, vp + (s0 + 1) * 64, step);
                            _tile_dpbf16ps(2, 4, 7);
                            _tile_dpbf16ps(3, 5, 7);
                        }
                    }
                    _tile_stored(0, cb[0], 64);
                    _tile_stored(1, cb[1], 64);
                    if (two) {
                        _tile_stored(2, cb[2], 64);
                        _tile_stored(3, cb[3], 64);
                    }
                    /* cb[2s + e][head][j]: dim 32 (s0 + s) + 2j + e */
                    for (int g = 0; g < G; g++) {
                        const int q = hh * G + g;
                        for (int s = 0; s <= two; s++)
                            for (int j = 0; j < 16; j++) {
                                float *o = ap + (int64_t)q * D + 32 * (s0 + s) + 2 * j;
                                o[0] += cb[2 * s][q * 16 + j];
                                o[1] += cb[2 * s + 1][q * 16 + j];
                            }
                    }
                }
            }
        }
        float mf[16], lf[16];
        _mm512_storeu_ps(mf, mv);
        _mm512_storeu_ps(lf, lv);
        for (int q = 0; q < nq; q++) {
            mp[q] = mf[q];
            lp[q] = lf[q];
        }
    }
    _tile_release();
}
#endif

/* Whether pd_paged_decode may run bf16 decode on AMX tiles (1, the default) or not (0); returns
 * whether it will: 0 where the build (no AMX at -march=native) or the OS (no tile data
 * permission) rules it out. For benchmarks and tests of the other path. */
int pd_set_decode_amx(int on) { return amx_switch(&pd_decode_amx_enabled, on); }

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
    const int64_t items = (int64_t)num_decodes * S, per_item = (int64_t)heads * (D + 2);
    /* bf16 queries on bf16 K: scores by VDPBF16PS where the CPU has it */
    const int dp = PD_HAVE_DP && kv_dtype == PD_BF16 && q_dtype == PD_BF16 && D % 32 == 0;
#if PD_HAVE_AMX
    const int amx = dp && pd_decode_amx_enabled && decode_amx_fits(G, D, block_size) &&
                    amx_permitted();
#else
    const int amx = 0;
#endif
    /* split-K partials: per item m [heads], l [heads], acc [heads, D] */
    float *part = NULL;
    if (S > 1) {
        part = (float *)malloc(sizeof(float) * (size_t)items * (size_t)per_item);
        if (!part) return -1;
    }
    (void)num_threads;

#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t it = 0; it < items; it++) {
        const int64_t i = it / S;
        const int split = (int)(it % S);
        const int64_t n = seq_lens[i], row = rows ? rows[i] : i;
        /* split boundaries on whole blocks */
        const int64_t nblk = (n + block_size - 1) / block_size;
        const int64_t per = (nblk + S - 1) / S;
        int64_t t_begin = split * per * block_size, t_end = t_begin + per * block_size;
        if (t_end > n) t_end = n;
        if (t_begin > n) t_begin = n;

        float qf[heads * D], mloc[heads], lloc[heads], accloc[heads * D];
        uint16_t qb[dp ? heads * D : 1];
        const char *qrow = (const char *)q + row * q_tok_stride * elem_size(q_dtype);
        for (int hq = 0; hq < heads; hq++)
            for (int d = 0; d < D; d++) {
                const int64_t e = (int64_t)hq * q_head_stride + d;
                if (!amx) qf[hq * D + d] = scale * load_one(qrow, e, q_dtype);
                if (dp) qb[hq * D + d] = ((const uint16_t *)qrow)[e];
            }
        float *m = mloc, *l = lloc, *acc = accloc;
        if (S > 1) {
            m = part + it * per_item;
            l = m + heads;
            acc = l + heads;
        }
        /* the next item (on one thread, the one this thread runs next), for prefetching */
        const int32_t *next_table = NULL;
        int64_t nb = 0, ne = 0;
        if (it + 1 < items) {
            const int64_t i2 = (it + 1) / S, n2 = seq_lens[i2];
            const int64_t per2 = ((n2 + block_size - 1) / block_size + S - 1) / S;
            nb = ((it + 1) % S) * per2 * block_size;
            ne = nb + per2 * block_size;
            if (ne > n2) ne = n2;
            if (nb > n2) nb = n2;
            next_table = tables + i2 * table_stride;
        }
#if PD_HAVE_AMX
        if (amx)
            attend_range_amx(&c, G, tables + i * table_stride, qb, scale, t_begin, t_end, m, l,
                             acc);
        else
#endif
            attend_range(&c, G, dp ? PD_BF16_DP : kv_dtype, tables + i * table_stride, qf, qb,
                         dp ? scale : 1.0f, t_begin, t_end, m, l, acc, next_table, nb, ne,
                         /* on one thread, item it - 1 prefetched this item's first chunk */
                         num_threads <= 1 && it > 0);
        if (S == 1) {
            char *orow = (char *)out + row * o_tok_stride * elem_size(q_dtype);
            for (int hq = 0; hq < heads; hq++) {
                const float inv = 1.0f / l[hq];
                for (int d = 0; d < D; d++)
                    store_one(orow, (int64_t)hq * o_head_stride + d, acc[hq * D + d] * inv,
                              q_dtype);
            }
        }
    }
    if (S == 1) return 0;

    /* merge the splits of each (sequence, query head) */
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1)
    for (int64_t pair = 0; pair < (int64_t)num_decodes * heads; pair++) {
        const int64_t i = pair / heads;
        const int hq = (int)(pair % heads);
        const int64_t row = rows ? rows[i] : i;
        char *orow = (char *)out + row * o_tok_stride * elem_size(q_dtype);
        const float *first = part + i * S * per_item;
        float mt = -INFINITY;
        for (int s = 0; s < S; s++) {
            const float ms = first[s * per_item + hq];
            mt = ms > mt ? ms : mt;
        }
        float o[D], lt = 0.0f;
        for (int d = 0; d < D; d++) o[d] = 0.0f;
        for (int s = 0; s < S; s++) {
            const float *p = first + s * per_item;
            if (p[heads + hq] == 0.0f) continue; /* an empty split */
            const float w = expf(p[hq] - mt);
            lt += w * p[heads + hq];
            for (int d = 0; d < D; d++) o[d] += w * p[2 * heads + hq * D + d];
        }
        const float inv = 1.0f / lt;
        for (int d = 0; d < D; d++)
            store_one(orow, (int64_t)hq * o_head_stride + d, o[d] * inv, q_dtype);
    }
    free(part);
    return 0;
}

/* ==== KV write ================================================================================ */

/* Stores the new K and V rows of n tokens at their slots of one layer's caches.
 * k, v:   [n, kv_heads, head_dim] (token and head strides in elements, head_dim contiguous), in
 *         the caches' dtype (elem_bytes bytes an element).
 * slots:  int64 [n]: slot s is row s % block_size of block s / block_size.
 * caches: [num_blocks, block_size, kv_heads, head_dim], each block contiguous, blocks blk_stride
 *         elements apart.
 * Returns 0; -1 when a slot lies outside [0, num_blocks * block_size), before anything is
 * written. (torch's index_copy_ took ~42 us a call for a 280-token bf16 chunk of SmolLM2, this
 * loop of row copies a few.) */
int pd_write_kv(const void *k, int64_t k_tok, int64_t k_head, const void *v, int64_t v_tok,
                int64_t v_head, void *k_cache, void *v_cache, int64_t blk_stride,
                const int64_t *slots, int64_t n, int kv_heads, int head_dim, int block_size,
                int64_t num_blocks, int elem_bytes) {
    for (int64_t i = 0; i < n; i++)
        if (slots[i] < 0 || slots[i] >= num_blocks * block_size) return -1;
    const size_t row = (size_t)head_dim * (size_t)elem_bytes;
    for (int64_t i = 0; i < n; i++) {
        const int64_t dst = (slots[i] / block_size * blk_stride +
                             slots[i] % block_size * (int64_t)kv_heads * head_dim) * elem_bytes;
        for (int h = 0; h < kv_heads; h++) {
            const int64_t hd = (int64_t)h * head_dim * elem_bytes;
            const char *ks = (const char *)k + (i * k_tok + h * k_head) * elem_bytes;
            const char *vs = (const char *)v + (i * v_tok + h * v_head) * elem_bytes;
            memcpy((char *)k_cache + dst + hd, ks, row);
            memcpy((char *)v_cache + dst + hd, vs, row);
        }
    }
    return 0;
}

/* ==== paged prefill attention ================================================================
 *
 * Causal attention of prefill chunks (many query tokens per sequence), K/V read from the pool
 * through each chunk's block table (in place; the AMX path gathers each span's first), so a chunk
 * after cached tokens (prefix-cache hit, chunked prefill) and a chunk from position 0 take the same
 * path. The FlashAttention loop (Dao et al., "FlashAttention", 2022, Algorithm 1) on one core: a
 * work item is (chunk, KV head, PQ query rows), i.e. the G query heads sharing that KV head for PQ
 * consecutive positions (G x PQ query vectors, kept in fp32, pre-scaled); keys go in tiles of PK
 * tokens up to the item's last position. Per tile, K is transposed into [D][PK] floats once, so
 * each query vector's PK scores are D vector multiply-adds with no horizontal sums (four query
 * vectors at a time, for independent chains); then one online-softmax update per query vector (keys
 * past its position get weight 0) and the weighted sum of the tile's V rows into its fp32
 * accumulator.
 *
 * With bf16 queries and K/V on a CPU with AVX512_BF16, both matmuls take VDPBF16PS instead, in
 * tiles of 64 keys (prefill_item_dp); on a CPU with AMX, the tile unit (prefill_item_amx).
 *
 * With 16-float vectors each tile's K^T is built 16 x 16 floats at a time (transpose16): fp32,
 * 280-token prompt, one thread, AMX Xeon: 1.65 vs 1.82 ms a layer, bit-equal; and tiles of 64
 * keys instead of 16 (one online-softmax update per 64 keys), four query vectors at a time:
 * 1.35-1.43 vs 1.50-1.62 ms (256 after 256 cached: 2.95-3.01 vs 3.40-3.51), outputs within
 * rounding of the 16-key tiles' (2.4e-7 at most in bench/prefill_attention.py's cases). Session 20.
 *
 * With 8-float vectors (AVX2) the tiles are 64 keys too, K^T built 8 x 8 floats at a time
 * (transpose8), the scores of four query vectors computed 16 keys at a time (PF_SUBV: the 16 AVX
 * registers hold no more accumulators) and only up to the last key a row of the block sees; the
 * weighted sum of V runs two query vectors at once (pv_tile2), and a work item holds 32 query
 * rows. Each K^T and V load there is held in a register for all its multiply-adds: folded into
 * each one, the loads outnumbered the multiply-adds the core issued beside them. fp32, one
 * thread, Zen 3 EPYC (AVX2 only), SmolLM2 shapes, alternated in one process against the
 * 16-key tiles with a scalar transpose: 1500-token prompt 45.1 vs 88.6 ms a layer, 256 after
 * 256 cached 3.9 vs 7.2 ms (each step: 64-key tiles and transpose8 1.40x at 1500 tokens, 32
 * rows 1.04x, loads held 1.16x, pv_tile2 1.18x); docs/benchmarks.md, session 40.
 *
 * With head_dim 64 and 16-float vectors the weighted sum of V runs for four query vectors at
 * once (pv_tile4_d64; in prefill_item_dp the same for its VDPBF16PS pairs): each V vector loaded
 * feeds four multiply-adds into 16 independent accumulators, where one query vector at a time
 * kept four dependent chains and loaded a V vector per multiply-add. Bit-equal outputs; one
 * layer, one thread, Zen 5 EPYC, 286-token prompt (bench/prefill_attention.py --baseline-rev,
 * session 35): fp32 0.830-0.842 vs 1.046-1.059 ms, bf16 0.600 vs 0.714; 256 after 256 cached
 * fp32 1.763 vs 2.269, bf16 1.202 vs 1.479; whole forwards (--forward, six rounds) bf16 173-180
 * vs 175-187 ms, fp32 283-299 vs 290-305.
 *
 * Measured (one thread, Zen 4, SmolLM2-135M shapes: 9 query / 3 KV heads, head_dim 64, one
 * 270-token prompt, bf16): see docs/benchmarks.md (session 11) against torch's SDPA; the bf16
 * path (session 15, bench/prefill_attention.py) against the fp32 one: docs/benchmarks.md.
 */

#define PQ (VW == 8 ? 32 : 16) /* query rows per work item */
#define PK (VW >= 8 ? 64 : 16) /* keys per tile (a multiple of 16) */
#define PKV (PK / VW)         /* vectors per tile row of scores */
#define PF_MAX_D 128          /* largest head_dim */
#define PF_MAX_NQ (8 * PQ)    /* largest G x PQ (G <= 8) */
#define PF_QB 4 /* query vectors scored together (independent chains) */
#define PF_SUBV (VW == 8 ? 2 : PKV) /* score vectors a query keeps in registers at once */

typedef struct {
    int64_t span, kvh, t0;
} PrefillItem;

/* a [D] += sum over the tile's first `see` keys of p[j] * V[j] [D]: the D / VW accumulators stay in
 * registers (D a constant where inlined) as independent chains over the keys */
ALWAYS_INLINE void pv_tile(float *a, const float *p, const float *V, int see, const int D) {
    vf o[PF_MAX_D / VW];
    for (int x = 0; x < D / VW; x++) memcpy(&o[x], a + x * VW, sizeof(vf));
    for (int jj = 0; jj < see; jj++) {
        const float pj = p[jj];
        for (int x = 0; x < D / VW; x++) {
            vf vv;
            memcpy(&vv, V + jj * D + x * VW, sizeof vv);
            o[x] += pj * vv;
        }
    }
    for (int x = 0; x < D / VW; x++) memcpy(a + x * VW, &o[x], sizeof(vf));
}

#if VW == 16
/* pv_tile for PF_QB query vectors at once, head_dim 64: a[b] [64] = a[b] * alpha[b] + sum over
 * the tile's first `see` keys of p[b][j] * V[j] (p[b] zero past each query's own keys, so one
 * loop serves them all). Each V row's four vectors feed 4 x PF_QB multiply-adds in 16
 * independent accumulators, where pv_tile's one query keeps four chains waiting on the
 * multiply-add latency and loads a V vector per multiply-add. */
ALWAYS_INLINE void pv_tile4_d64(float *const a[PF_QB], const float alpha[PF_QB],
                                const float p[PF_QB][PK], const float *V, int see) {
    __m512 o[PF_QB][4];
    for (int b = 0; b < PF_QB; b++) {
        const __m512 al = _mm512_set1_ps(alpha[b]);
        for (int x = 0; x < 4; x++) o[b][x] = _mm512_mul_ps(_mm512_load_ps(a[b] + 16 * x), al);
    }
    for (int jj = 0; jj < see; jj++) {
        __m512 vv[4];
        for (int x = 0; x < 4; x++) vv[x] = _mm512_load_ps(V + jj * 64 + 16 * x);
        for (int b = 0; b < PF_QB; b++) {
            const __m512 pj = _mm512_set1_ps(p[b][jj]);
            for (int x = 0; x < 4; x++) o[b][x] = _mm512_fmadd_ps(pj, vv[x], o[b][x]);
        }
    }
    for (int b = 0; b < PF_QB; b++)
        for (int x = 0; x < 4; x++) _mm512_store_ps(a[b] + 16 * x, o[b][x]);
}
#endif

#if VW == 8
/* Transposes the 8 x 8 floats of r in place (r[i][j] <-> r[j][i]): pairs of rows interleaved,
 * then quads within each 128-bit lane, then the 128-bit lanes swapped across row halves. */
static inline void transpose8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int g = 0; g < 8; g += 4) { /* u[g + k], 128-bit lane L: column 4L + k of rows g..g+3 */
        u[g] = _mm256_shuffle_ps(t[g], t[g + 2], 0x44);
        u[g + 1] = _mm256_shuffle_ps(t[g], t[g + 2], 0xee);
        u[g + 2] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0x44);
        u[g + 3] = _mm256_shuffle_ps(t[g + 1], t[g + 3], 0xee);
    }
    for (int k = 0; k < 4; k++) {
        r[k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x20);
        r[4 + k] = _mm256_permute2f128_ps(u[k], u[4 + k], 0x31);
    }
}
#endif

#if VW == 8 && defined(__FMA__)
/* pv_tile for two query vectors at once: a0, a1 [D] += sum over the tile's first `see` keys of
 * p0[j] * V[j], p1[j] * V[j] (p zero past each query's own keys), 32 values of head_dim at a
 * time, so each V vector loaded feeds two multiply-adds (8 accumulators, 4 V vectors held). */
ALWAYS_INLINE void pv_tile2(float *a0, float *a1, const float *p0, const float *p1,
                            const float *V, int see, const int D) {
    for (int d0 = 0; d0 < D; d0 += 32) {
        __m256 o0[4], o1[4];
        for (int x = 0; x < 4; x++) {
            o0[x] = _mm256_loadu_ps(a0 + d0 + 8 * x);
            o1[x] = _mm256_loadu_ps(a1 + d0 + 8 * x);
        }
        for (int jj = 0; jj < see; jj++) {
            const __m256 w0 = _mm256_broadcast_ss(p0 + jj), w1 = _mm256_broadcast_ss(p1 + jj);
            for (int x = 0; x < 4; x++) {
                __m256 vv = _mm256_loadu_ps(V + jj * D + d0 + 8 * x);
                __asm__("" : "+x"(vv)); /* loaded once for both (else folded into each) */
                o0[x] = _mm256_fmadd_ps(w0, vv, o0[x]);
                o1[x] = _mm256_fmadd_ps(w1, vv, o1[x]);
            }
        }
        for (int x = 0; x < 4; x++) {
            _mm256_storeu_ps(a0 + d0 + 8 * x, o0[x]);
            _mm256_storeu_ps(a1 + d0 + 8 * x, o1[x]);
        }
    }
}
#endif

/* One work item: query rows [t0, t0 + nr) of a chunk whose first row sits at position `first`
 * (tokens already in the pool before it), KV head kvh. */
static void prefill_item(const Cache *c, int G, int D, const int32_t *table, const char *q,
                         int64_t q_tok, int64_t q_head, int q_dtype, int64_t first, int64_t t0,
                         int nr, int kvh, float scale, char *out, int64_t o_tok, int64_t o_head) {
    float Q[PF_MAX_NQ * PF_MAX_D] __attribute__((aligned(64)));
    float acc[PF_MAX_NQ * PF_MAX_D] __attribute__((aligned(64)));
    float Kt[PF_MAX_D * PK] __attribute__((aligned(64)));
    float V[PK * PF_MAX_D] __attribute__((aligned(64)));
    float m[PF_MAX_NQ], l[PF_MAX_NQ];
    int64_t pos[PF_MAX_NQ];
    const int nq = G * nr, qes = elem_size(q_dtype), kes = elem_size(c->kv_dtype);
    /* query vector iq = r * G + g: row t0 + r, head kvh * G + g */
    for (int iq = 0; iq < nq; iq++) {
        const int r = iq / G, g = iq % G;
        const char *src = q + ((t0 + r) * q_tok + (int64_t)(kvh * G + g) * q_head) * qes;
        for (int d = 0; d < D; d++) Q[iq * D + d] = scale * load_one(src, d, q_dtype);
        for (int d = 0; d < D; d++) acc[iq * D + d] = 0.0f;
        m[iq] = -INFINITY;
        l[iq] = 0.0f;
        pos[iq] = first + t0 + r;
    }
    const int64_t last = first + t0 + nr - 1; /* the item's last position: keys 0 .. last */
    for (int64_t j0 = 0; j0 <= last; j0 += PK) {
        const int nk = last + 1 - j0 < PK ? (int)(last + 1 - j0) : PK;
#if VW == 16
        /* K^T 16 keys x 16 dims at a time (transpose16; PK a multiple of 16), V rows as they are */
        int64_t offs[PK];
        for (int jj = 0; jj < PK; jj++)
            offs[jj] = jj < nk ? row_offset(c, table, j0 + jj) / kes + (int64_t)kvh * D : -1;
        for (int j1 = 0; j1 < PK; j1 += 16)
            for (int d = 0; d < D; d += VW) {
                __m512 r[16];
                for (int x = 0; x < 16; x++) {
                    const int64_t o = offs[j1 + x];
                    const vf kx = o >= 0 ? load_vec(c->k + (o + d) * kes, c->kv_dtype) : (vf){0};
                    const vf vx = o >= 0 ? load_vec(c->v + (o + d) * kes, c->kv_dtype) : (vf){0};
                    r[x] = (__m512)kx;
                    memcpy(V + (j1 + x) * D + d, &vx, sizeof vx);
                }
                transpose16(r);
                for (int e = 0; e < VW; e++) _mm512_store_ps(Kt + (d + e) * PK + j1, r[e]);
            }
#elif VW == 8
        /* K^T 8 keys x 8 dims at a time (transpose8), V rows as they are */
        for (int j1 = 0; j1 < PK; j1 += 8) {
            int64_t offs[8];
            for (int x = 0; x < 8; x++)
                offs[x] = j1 + x < nk ? row_offset(c, table, j0 + j1 + x) / kes + (int64_t)kvh * D
                                      : -1;
            for (int d = 0; d < D; d += 8) {
                __m256 r[8];
                for (int x = 0; x < 8; x++) {
                    const int64_t o = offs[x];
                    const vf kx = o >= 0 ? load_vec(c->k + (o + d) * kes, c->kv_dtype) : (vf){0};
                    const vf vx = o >= 0 ? load_vec(c->v + (o + d) * kes, c->kv_dtype) : (vf){0};
                    r[x] = (__m256)kx;
                    memcpy(V + (j1 + x) * D + d, &vx, sizeof vx);
                }
                transpose8(r);
                for (int e = 0; e < 8; e++) _mm256_store_ps(Kt + (d + e) * PK + j1, r[e]);
            }
        }
#else
        for (int jj = 0; jj < PK; jj++) {
            if (jj < nk) {
                const int64_t off = row_offset(c, table, j0 + jj) / kes + (int64_t)kvh * D;
                for (int d = 0; d < D; d += VW) {
                    const vf kx = load_vec(c->k + (off + d) * kes, c->kv_dtype);
                    for (int e = 0; e < VW; e++) Kt[(d + e) * PK + jj] = kx[e];
                    const vf vx = load_vec(c->v + (off + d) * kes, c->kv_dtype);
                    memcpy(V + jj * D + d, &vx, sizeof vx);
                }
            } else {
                for (int d = 0; d < D; d++) Kt[d * PK + jj] = 0.0f;
                for (int d = 0; d < D; d++) V[jj * D + d] = 0.0f;
            }
        }
#endif
        for (int i0 = 0; i0 < nq; i0 += PF_QB) {
            const int nb = nq - i0 < PF_QB ? nq - i0 : PF_QB;
            if (pos[i0 + nb - 1] < j0) continue; /* positions grow with iq: all masked */
            vf s[PF_QB][PKV];
            const float *qrow[PF_QB];
            for (int b = 0; b < PF_QB; b++) {
                qrow[b] = Q + (i0 + (b < nb ? b : 0)) * D; /* rows past nb repeat row 0 */
                for (int kv = 0; kv < PKV; kv++) s[b][kv] = (vf){0};
            }
            /* PF_SUBV score vectors a query at a time (those of keys no row here sees stay 0) */
            const int64_t reach = pos[i0 + nb - 1] - j0 + 1; /* the keys the last row sees */
            for (int kv0 = 0; kv0 < PKV; kv0 += PF_SUBV) {
                if (kv0 * VW >= nk || kv0 * VW >= reach) break;
                vf a[PF_QB][PF_SUBV];
                for (int b = 0; b < PF_QB; b++)
                    for (int kv = 0; kv < PF_SUBV; kv++) a[b][kv] = (vf){0};
                for (int d = 0; d < D; d++)
                    for (int kv = 0; kv < PF_SUBV; kv++) {
                        vf kt;
                        memcpy(&kt, Kt + d * PK + (kv0 + kv) * VW, sizeof kt);
#if VW == 8
                        /* one load for the PF_QB multiply-adds: folded into each, the loads
                         * would outnumber what the core issues beside them */
                        __asm__("" : "+x"(kt));
#endif
                        for (int b = 0; b < PF_QB; b++) a[b][kv] += qrow[b][d] * kt;
                    }
                for (int b = 0; b < PF_QB; b++)
                    for (int kv = 0; kv < PF_SUBV; kv++) s[b][kv0 + kv] = a[b][kv];
            }
            /* each query vector's online-softmax update for this tile first (its weights in
             * pb[b], zero past its own keys; alb[b] rescales its accumulator; seeb[b] its keys
             * here, 0 for rows past nb or masked out of the whole tile), then the weighted sums */
            float pb[PF_QB][PK] __attribute__((aligned(64)));
            float alb[PF_QB];
            int seeb[PF_QB], see_max = 0;
            for (int b = 0; b < PF_QB; b++) {
                const int iq = i0 + b;
                alb[b] = 1.0f;
                seeb[b] = 0;
                if (b >= nb || pos[iq] < j0) {
                    memset(pb[b], 0, sizeof pb[b]);
                    continue;
                }
                /* lanes of keys past this query's position (or past the tile) get weight 0 */
                const int64_t see = pos[iq] - j0 + 1 < nk ? pos[iq] - j0 + 1 : nk;
                vf mv = (vf){0} - INFINITY;
                vu32 live[PKV];
                for (int kv = 0; kv < PKV; kv++) {
                    vu32 lane;
                    for (int e = 0; e < VW; e++) lane[e] = (uint32_t)(kv * VW + e);
                    live[kv] = (vu32)(lane < (uint32_t)see);
                    s[b][kv] = vselect(live[kv], s[b][kv], (vf){0} - INFINITY);
                    mv = vselect((vu32)(s[b][kv] > mv), s[b][kv], mv);
                }
                const float mt = hmax(mv) > m[iq] ? hmax(mv) : m[iq];
                alb[b] = expf(m[iq] - mt); /* 0 on the first tile */
                vf sum = (vf){0};
                for (int kv = 0; kv < PKV; kv++) {
                    const vf w = vselect(live[kv], exp_nonpos_v(s[b][kv] - mt), (vf){0});
                    sum += w;
                    memcpy(pb[b] + kv * VW, &w, sizeof w);
                }
                l[iq] = l[iq] * alb[b] + hsum(sum);
                m[iq] = mt;
                seeb[b] = (int)see;
                if (see > see_max) see_max = (int)see;
            }
#if VW == 16
            if (D == 64) { /* all PF_QB in one pass; idle rows add weight 0 into a scratch row */
                float scratch[64] __attribute__((aligned(64)));
                float *ab[PF_QB];
                memset(scratch, 0, sizeof scratch);
                for (int b = 0; b < PF_QB; b++) ab[b] = seeb[b] ? acc + (i0 + b) * D : scratch;
                pv_tile4_d64(ab, alb, (const float(*)[PK])pb, V, see_max);
                continue;
            }
#endif
            for (int b = 0; b < nb; b++) {
                if (!seeb[b]) continue;
                float *a = acc + (i0 + b) * D;
                if (alb[b] != 1.0f)
                    for (int d = 0; d < D; d++) a[d] *= alb[b];
#if VW == 8 && defined(__FMA__)
                if (D % 32 == 0 && b + 1 < nb && seeb[b + 1]) { /* this query and the next */
                    float *a1 = acc + (i0 + b + 1) * D;
                    if (alb[b + 1] != 1.0f)
                        for (int d = 0; d < D; d++) a1[d] *= alb[b + 1];
                    const int see = seeb[b] > seeb[b + 1] ? seeb[b] : seeb[b + 1];
                    if (D == 64)
                        pv_tile2(a, a1, pb[b], pb[b + 1], V, see, 64);
                    else
                        pv_tile2(a, a1, pb[b], pb[b + 1], V, see, D);
                    b++;
                    continue;
                }
#endif
                if (D == 64)
                    pv_tile(a, pb[b], V, seeb[b], 64);
                else
                    pv_tile(a, pb[b], V, seeb[b], D);
            }
        }
    }
    for (int iq = 0; iq < nq; iq++) {
        const int r = iq / G, g = iq % G;
        char *dst = out + ((t0 + r) * o_tok + (int64_t)(kvh * G + g) * o_head) * qes;
        const float inv = 1.0f / l[iq];
        for (int d = 0; d < D; d++) store_one(dst, d, acc[iq * D + d] * inv, q_dtype);
    }
}

#if PD_HAVE_DP
#define PKD 64             /* keys per tile of prefill_item_dp */
#define PKDV (PKD / 16)    /* score vectors per query and tile */
#define QBD (PKDV <= 2 ? 8 : 4) /* query vectors scored together (their scores in registers) */

/* prefill_item for bf16 queries and bf16 K/V on a CPU with AVX512_BF16 (head_dim D a multiple of
 * 32, 16-float vectors), by VDPBF16PS in both matmuls. The queries stay bf16 (as stored: no
 * rounding) and are read as pairs (q[2i], q[2i + 1]); per tile, K is transposed into [D / 2][PKD]
 * 32-bit pairs, so one VDPBF16PS against the broadcast query pair i adds pair i's two products
 * of 16 keys into one vector of scores (half the multiply-adds of the fp32 path, no widening of
 * K), scaled by `scale` in fp32 after. The weighted sum of V is the decode kernel's
 * (values_dp_blocks): the probabilities rounded to bf16 (the softmax sum stays fp32), the V
 * rows of keys j, j + 1 interleaved word by word, once per tile, so one VDPBF16PS against the
 * broadcast pair (p_j, p_j+1) adds both keys' products; the accumulators are kept in the
 * unpacks' permuted order and restored once at the end (dp_unpermute). Keys past the tile read
 * as zero rows (never the pool's rows past the context). Tiles of 64 keys (PKD): the per-tile
 * softmax update of each query vector is shared by 4x the keys of the fp32 path's tiles. One
 * layer, one thread, SmolLM2 shapes (bench/prefill_attention.py, interleaved): tiles of 64 keys
 * 1.04 vs 1.36 ms (270-token prompt) and 2.50 vs 3.59 (256 after 256 cached) against tiles of
 * 16; 32 keys gave about half that gain, 128 keys lost on the short prompt. */
ALWAYS_INLINE void prefill_item_dp_body(const Cache *c, int G, const int D, const int32_t *table,
                                        const char *q, int64_t q_tok, int64_t q_head,
                                        int64_t first, int64_t t0, int nr, int kvh, float scale,
                                        char *out, int64_t o_tok, int64_t o_head) {
    uint32_t Qp[PF_MAX_NQ * PF_MAX_D / 2] __attribute__((aligned(64)));
    float acc[PF_MAX_NQ * PF_MAX_D] __attribute__((aligned(64)));
    uint32_t Kp[PF_MAX_D / 2 * PKD] __attribute__((aligned(64)));
    uint32_t Vp[PKD / 2 * PF_MAX_D] __attribute__((aligned(64)));
    float m[PF_MAX_NQ], l[PF_MAX_NQ];
    int64_t pos[PF_MAX_NQ];
    const int nq = G * nr, H = D / 2;
    for (int iq = 0; iq < nq; iq++) {
        const int r = iq / G, g = iq % G;
        memcpy(Qp + iq * H, q + ((t0 + r) * q_tok + (int64_t)(kvh * G + g) * q_head) * 2,
               (size_t)D * 2);
        for (int d = 0; d < D; d++) acc[iq * D + d] = 0.0f;
        m[iq] = -INFINITY;
        l[iq] = 0.0f;
        pos[iq] = first + t0 + r;
    }
    const int64_t last = first + t0 + nr - 1; /* the item's last position: keys 0 .. last */
    const int64_t head_off = (int64_t)kvh * D * 2;
    for (int64_t j0 = 0; j0 <= last; j0 += PKD) {
        const int nk = last + 1 - j0 < PKD ? (int)(last + 1 - j0) : PKD;
        const char *kr[PKD], *vr[PKD];
        for (int jj = 0; jj < nk; jj++) {
            const int64_t off = row_offset(c, table, j0 + jj) + head_off;
            kr[jj] = c->k + off;
            vr[jj] = c->v + off;
        }
        for (int jj = 0; jj < PKD; jj++) {
            if (jj < nk) {
                const uint32_t *row = (const uint32_t *)kr[jj];
                for (int i = 0; i < H; i++) Kp[i * PKD + jj] = row[i];
            } else {
                for (int i = 0; i < H; i++) Kp[i * PKD + jj] = 0;
            }
        }
        for (int jp = 0; jp < (nk + 1) / 2; jp++) {
            const int j = 2 * jp;
            for (int b = 0; b < D / 32; b++) {
                const __m512i x = _mm512_loadu_si512((const void *)(vr[j] + 64 * b));
                const __m512i y = j + 1 < nk
                                      ? _mm512_loadu_si512((const void *)(vr[j + 1] + 64 * b))
                                      : _mm512_setzero_si512();
                _mm512_store_si512((void *)(Vp + jp * D + 32 * b), _mm512_unpacklo_epi16(x, y));
                _mm512_store_si512((void *)(Vp + jp * D + 32 * b + 16),
                                   _mm512_unpackhi_epi16(x, y));
            }
        }
        for (int i0 = 0; i0 < nq; i0 += QBD) {
            const int nb = nq - i0 < QBD ? nq - i0 : QBD;
            if (pos[i0 + nb - 1] < j0) continue; /* positions grow with iq: all masked */
            __m512 sc[QBD][PKDV];
            const uint32_t *qrow[QBD];
            for (int b = 0; b < QBD; b++) {
                qrow[b] = Qp + (i0 + (b < nb ? b : 0)) * H; /* rows past nb repeat row 0 */
                for (int u = 0; u < PKDV; u++) sc[b][u] = _mm512_setzero_ps();
            }
            for (int i = 0; i < H; i++) {
                __m512bh kv[PKDV];
                for (int u = 0; u < PKDV; u++)
                    kv[u] = (__m512bh)_mm512_load_si512((const void *)(Kp + i * PKD + 16 * u));
                for (int b = 0; b < QBD; b++) {
                    const __m512bh qp = (__m512bh)_mm512_set1_epi32((int)qrow[b][i]);
                    for (int u = 0; u < PKDV; u++) sc[b][u] = _mm512_dpbf16_ps(sc[b][u], qp, kv[u]);
                }
            }
            /* each query vector's online-softmax update for this tile first (its weights as
             * bf16 pairs in ppb[b], zero past its own keys; alb[b] rescales its accumulator;
             * seeb[b] its keys here, 0 for rows past nb or masked out of the whole tile), then
             * the weighted sums */
            uint32_t ppb[QBD][PKD / 2] __attribute__((aligned(64)));
            float alb[QBD];
            int seeb[QBD], see_max = 0;
            for (int b = 0; b < QBD; b++) {
                const int iq = i0 + b;
                alb[b] = 1.0f;
                seeb[b] = 0;
                if (b >= nb || pos[iq] < j0) {
                    memset(ppb[b], 0, sizeof ppb[b]);
                    continue;
                }
                /* lanes of keys past this query's position (or past the tile) get weight 0 */
                const int64_t see = pos[iq] - j0 + 1 < nk ? pos[iq] - j0 + 1 : nk;
                vu32 live[PKDV];
                vf sv[PKDV], mv = (vf){0} - INFINITY;
                for (int u = 0; u < PKDV; u++) {
                    vu32 lane;
                    for (int e = 0; e < VW; e++) lane[e] = (uint32_t)(16 * u + e);
                    live[u] = (vu32)(lane < (uint32_t)see);
                    sv[u] = vselect(live[u], (vf)sc[b][u] * scale, (vf){0} - INFINITY);
                    mv = vselect((vu32)(sv[u] > mv), sv[u], mv);
                }
                const float tmax = hmax(mv), mt = tmax > m[iq] ? tmax : m[iq];
                alb[b] = expf(m[iq] - mt); /* 0 on the first tile */
                vf wsum = (vf){0};
                for (int u = 0; u < PKDV; u++) {
                    const vf w = vselect(live[u], exp_nonpos_v(sv[u] - mt), (vf){0});
                    wsum += w;
                    const __m256bh h = _mm512_cvtneps_pbh((__m512)w);
                    memcpy(ppb[b] + 8 * u, &h, sizeof h);
                }
                l[iq] = l[iq] * alb[b] + hsum(wsum);
                m[iq] = mt;
                seeb[b] = (int)see;
                if (see > see_max) see_max = (int)see;
            }
            if (D == 64 && QBD == 4) {
                /* all four in one pass: each interleaved V pair row feeds 4 x 4 VDPBF16PS into
                 * 16 independent accumulators (one query at a time keeps four chains waiting
                 * on the instruction's latency); idle rows add weight 0 into a scratch row */
                float scratch[64] __attribute__((aligned(64)));
                float *ab[QBD];
                memset(scratch, 0, sizeof scratch);
                __m512 o[QBD][4];
                for (int b = 0; b < QBD; b++) {
                    ab[b] = seeb[b] ? acc + (i0 + b) * D : scratch;
                    const __m512 al = _mm512_set1_ps(alb[b]);
                    for (int x = 0; x < 4; x++)
                        o[b][x] = _mm512_mul_ps(_mm512_load_ps(ab[b] + 16 * x), al);
                }
                for (int jp = 0; jp < (see_max + 1) / 2; jp++) {
                    const uint32_t *vrow = Vp + jp * 64;
                    __m512bh vv[4];
                    for (int x = 0; x < 4; x++)
                        vv[x] = (__m512bh)_mm512_load_si512((const void *)(vrow + 16 * x));
                    for (int b = 0; b < QBD; b++) {
                        const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)ppb[b][jp]);
                        for (int x = 0; x < 4; x++) o[b][x] = _mm512_dpbf16_ps(o[b][x], pv, vv[x]);
                    }
                }
                for (int b = 0; b < QBD; b++)
                    for (int x = 0; x < 4; x++) _mm512_store_ps(ab[b] + 16 * x, o[b][x]);
                continue;
            }
            for (int b = 0; b < nb; b++) {
                if (!seeb[b]) continue;
                float *a = acc + (i0 + b) * D;
                __m512 o[PF_MAX_D / 16];
                const __m512 al = _mm512_set1_ps(alb[b]);
                for (int x = 0; x < D / 16; x++)
                    o[x] = _mm512_mul_ps(_mm512_load_ps(a + 16 * x), al);
                for (int jp = 0; jp < (seeb[b] + 1) / 2; jp++) {
                    const __m512bh pv = (__m512bh)_mm512_set1_epi32((int)ppb[b][jp]);
                    const uint32_t *vrow = Vp + jp * D;
                    for (int x = 0; x < D / 16; x++)
                        o[x] = _mm512_dpbf16_ps(
                            o[x], pv, (__m512bh)_mm512_load_si512((const void *)(vrow + 16 * x)));
                }
                for (int x = 0; x < D / 16; x++) _mm512_store_ps(a + 16 * x, o[x]);
            }
        }
    }
    dp_unpermute(acc, nq, D);
    for (int iq = 0; iq < nq; iq++) {
        const int r = iq / G, g = iq % G;
        char *dst = out + ((t0 + r) * o_tok + (int64_t)(kvh * G + g) * o_head) * 2;
        const float inv = 1.0f / l[iq];
        for (int d = 0; d < D; d++) store_one(dst, d, acc[iq * D + d] * inv, PD_BF16);
    }
}

static void prefill_item_dp(const Cache *c, int G, int D, const int32_t *table, const char *q,
                            int64_t q_tok, int64_t q_head, int64_t first, int64_t t0, int nr,
                            int kvh, float scale, char *out, int64_t o_tok, int64_t o_head) {
    if (D == 64)
        prefill_item_dp_body(c, G, 64, table, q, q_tok, q_head, first, t0, nr, kvh, scale, out,
                             o_tok, o_head);
    else
        prefill_item_dp_body(c, G, D, table, q, q_tok, q_head, first, t0, nr, kvh, scale, out,
                             o_tok, o_head);
}
#endif

#if PD_HAVE_AMX
typedef int32_t vi32 __attribute__((vector_size(VW * 4)));

#define AKT 64 /* keys per tile of prefill_item_amx */
#define AMX_MIN_ROWS 8 /* query rows from which a span takes prefill_item_amx */


/* One span's K and V of one KV head, laid out for the tile loads of prefill_item_amx: kc [n][D]
 * (rows of keys 0 .. n-1 gathered from the pages) and vt [D][n] (V transposed), n the span's
 * context rounded up to AKT, the rows past its context zero (never the pool's rows there). */
static void amx_gather(const Cache *c, const int32_t *table, int64_t ctx, int64_t n, int kvh,
                       uint16_t *kc, uint16_t *vt) {
    const int D = c->head_dim;
    const int64_t head_off = (int64_t)kvh * D * 2;
    for (int64_t j = 0; j < n; j++) {
        if (j < ctx)
            memcpy(kc + j * D, c->k + row_offset(c, table, j) + head_off, (size_t)D * 2);
        else
            memset(kc + j * D, 0, (size_t)D * 2);
    }
    /* V^T, 32 keys x 16 dims at a time (n is a multiple of AKT): keys 2p and 2p + 1 side by side
     * in 32-bit lane d of r[p] (low and high half, i.e. their order in vt's rows), then the 16 x 16
     * transpose leaves in r[d] the 32 keys' values of dim d0 + d: one 64-byte store each */
    for (int64_t j0 = 0; j0 < n; j0 += 32) {
        const uint16_t *rows[32];
        for (int i = 0; i < 32; i++)
            rows[i] = j0 + i < ctx
                          ? (const uint16_t *)(c->v + row_offset(c, table, j0 + i) + head_off)
                          : NULL;
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 r[16];
            for (int p = 0; p < 16; p++) {
                const __m512i lo = rows[2 * p] ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                                     (const __m256i *)(rows[2 * p] + d0)))
                                               : _mm512_setzero_si512();
                const __m512i hi = rows[2 * p + 1]
                                       ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(
                                             (const __m256i *)(rows[2 * p + 1] + d0)))
                                       : _mm512_setzero_si512();
                r[p] = _mm512_castsi512_ps(_mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
            }
            transpose16(r);
            for (int d = 0; d < 16; d++)
                _mm512_storeu_ps((float *)(vt + (d0 + d) * n + j0), r[d]);
        }
    }
}

/* prefill_item for bf16 queries and K/V on a CPU with AMX (head_dim D a multiple of 32, at most
 * PF_MAX_D), both matmuls on the tile unit, in the transposed form: per block of 16 query vectors
 * and tile of AKT keys, the scores S^T [keys][16 queries] = K Q^T (K rows straight from kc, Q^T
 * in pairs built once per item), so the online softmax runs down the columns with one query per
 * vector lane (no horizontal reductions), and the output O^T [D][16 queries] accumulates
 * V^T P^T (V^T from vt, the probabilities rounded to bf16 and interleaved in key pairs, the
 * softmax sum kept in fp32 as the other paths do). kc, vt: amx_gather's layout for this item's
 * span and KV head, n keys each. The tile unit is configured on entry and released on exit (the
 * thread may run oneDNN's AMX kernels in between, which configure their own). One layer, one
 * thread, SmolLM2 shapes, on a 2-core AMX Xeon (bench/prefill_attention.py --baseline-rev, the
 * VDPBF16PS path): 0.566 vs 1.349 ms (270-token prompt), 1.020 vs 3.092 (256 after 256 cached);
 * a whole 256-token prefill forward 101 vs 117 ms (docs/benchmarks.md, session 16). The output's
 * transpose and amx_gather's V^T in 16 x 16 blocks of 32-bit lanes (session 20) instead of one
 * element at a time: 0.53 vs 0.73 ms a layer (280-token prompt), 0.93 vs 1.31 (256 after 256),
 * bit-equal outputs. */
static void prefill_item_amx(int G, const int D, const uint16_t *kc, const uint16_t *vt,
                             int64_t n, const char *q, int64_t q_tok, int64_t q_head,
                             int64_t first, int64_t t0, int nr, int kvh, float scale, char *out,
                             int64_t o_tok, int64_t o_head) {
    uint32_t qt[PF_MAX_NQ / 16][PF_MAX_D / 32][16 * 16] __attribute__((aligned(64)));
    float ot[PF_MAX_NQ / 16][PF_MAX_D * 16] __attribute__((aligned(64)));
    float st[AKT * 16] __attribute__((aligned(64)));
    uint32_t pb[AKT / 2 * 16] __attribute__((aligned(64)));
    const int nq = G * nr, nrb = (nq + 15) / 16, H = D / 2;
    vf m[PF_MAX_NQ / 16], l[PF_MAX_NQ / 16];
    vi32 posv[PF_MAX_NQ / 16];
    /* query vector iq = r * G + g (row t0 + r, head kvh * G + g): lane iq % 16 of block iq / 16 */
    memset(qt, 0, sizeof(qt[0]) * (size_t)nrb);
    for (int iq = 0; iq < nrb * 16; iq++) {
        const int rb = iq / 16, lane = iq % 16;
        posv[rb][lane] = iq < nq ? (int32_t)(first + t0 + iq / G) : -1;
        if (iq >= nq) continue;
        const uint32_t *src = (const uint32_t *)(q + ((t0 + iq / G) * q_tok +
                                                      (int64_t)(kvh * G + iq % G) * q_head) * 2);
        for (int i = 0; i < H; i++) qt[rb][i / 16][(i % 16) * 16 + lane] = src[i];
    }
    for (int rb = 0; rb < nrb; rb++) {
        m[rb] = (vf){0} - INFINITY;
        l[rb] = (vf){0};
        memset(ot[rb], 0, sizeof(float) * (size_t)D * 16);
    }
    /* interleaves the bf16 of two 16-lane rows: [a0, b0, a1, b1, ...] */
    const __m512i ilv = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9,
                                         24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1,
                                         16, 0);
    const int64_t last = first + t0 + nr - 1; /* the item's last position: keys 0 .. last */
    amx_configure_16x64(8);
    for (int64_t j0 = 0; j0 <= last; j0 += AKT) {
        for (int rb = 0; rb < nrb; rb++) {
            const int hi = rb * 16 + 15 < nq - 1 ? rb * 16 + 15 : nq - 1;
            if (first + t0 + hi / G < j0) continue; /* every query of the block before the tile */
            /* S^T: tmm0..3 = keys j0 + 16u .. + 15 against the block's 16 queries */
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            for (int b = 0; b < D / 32; b++) {
                _tile_loadd(5, qt[rb][b], 64);
                const uint16_t *kb = kc + j0 * D + 32 * b;
                _tile_loadd(4, kb, D * 2);
                _tile_dpbf16ps(0, 4, 5);
                _tile_loadd(4, kb + 16 * D, D * 2);
                _tile_dpbf16ps(1, 4, 5);
                _tile_loadd(4, kb + 32 * D, D * 2);
                _tile_dpbf16ps(2, 4, 5);
                _tile_loadd(4, kb + 48 * D, D * 2);
                _tile_dpbf16ps(3, 4, 5);
            }
            _tile_stored(0, st, 64);
            _tile_stored(1, st + 256, 64);
            _tile_stored(2, st + 512, 64);
            _tile_stored(3, st + 768, 64);
            /* online softmax down the columns: key j0 + jj is live for lanes at or past it */
            vf s[AKT];
            vf mx = (vf){0} - INFINITY;
            for (int jj = 0; jj < AKT; jj++) {
                vf x;
                memcpy(&x, st + 16 * jj, sizeof x);
                const vu32 live = (vu32)(posv[rb] >= (int32_t)(j0 + jj));
                s[jj] = vselect(live, x * scale, (vf){0} - INFINITY);
                mx = vselect((vu32)(s[jj] > mx), s[jj], mx);
            }
            const vf mt = vselect((vu32)(mx > m[rb]), mx, m[rb]);
            /* lanes with no live key yet (padding lanes) keep alpha 1 and weights 0 */
            const vu32 any = (vu32)(mt > -INFINITY);
            const vf mt0 = vselect(any, mt, (vf){0});
            const vf alpha = vselect(any, exp_nonpos_v(vselect(any, m[rb], (vf){0}) - mt0),
                                     (vf){0} + 1.0f);
            vf wsum = (vf){0};
            for (int jj = 0; jj < AKT; jj += 2) {
                const vu32 l0 = (vu32)(s[jj] > -INFINITY), l1 = (vu32)(s[jj + 1] > -INFINITY);
                const vf w0 = vselect(l0, exp_nonpos_v(s[jj] - mt0), (vf){0});
                const vf w1 = vselect(l1, exp_nonpos_v(s[jj + 1] - mt0), (vf){0});
                wsum += w0 + w1;
                const __m512i pr = (__m512i)_mm512_cvtne2ps_pbh((__m512)w1, (__m512)w0);
                _mm512_store_si512((void *)(pb + jj / 2 * 16), _mm512_permutexvar_epi16(ilv, pr));
            }
            l[rb] = l[rb] * alpha + wsum;
            m[rb] = mt;
            /* O^T = alpha * O^T + V^T P^T, 4 tiles of 16 dims at a time */
            float *o = ot[rb];
            for (int d = 0; d < D; d++) {
                vf x;
                memcpy(&x, o + 16 * d, sizeof x);
                x *= alpha;
                memcpy(o + 16 * d, &x, sizeof x);
            }
            for (int d0 = 0; d0 < D; d0 += 64) {
                const int nt = (D - d0) / 16 < 4 ? (D - d0) / 16 : 4;
                _tile_loadd(0, o + 16 * d0, 64);
                if (nt > 1) _tile_loadd(1, o + 16 * (d0 + 16), 64);
                if (nt > 2) _tile_loadd(2, o + 16 * (d0 + 32), 64);
                if (nt > 3) _tile_loadd(3, o + 16 * (d0 + 48), 64);
                for (int kh = 0; kh < AKT / 32; kh++) {
                    _tile_loadd(5, pb + kh * 256, 64);
                    const uint16_t *vb = vt + (int64_t)d0 * n + j0 + 32 * kh;
                    _tile_loadd(4, vb, n * 2);
                    _tile_dpbf16ps(0, 4, 5);
                    if (nt > 1) {
                        _tile_loadd(4, vb + 16 * n, n * 2);
                        _tile_dpbf16ps(1, 4, 5);
                    }
                    if (nt > 2) {
                        _tile_loadd(4, vb + 32 * n, n * 2);
                        _tile_dpbf16ps(2, 4, 5);
                    }
                    if (nt > 3) {
                        _tile_loadd(4, vb + 48 * n, n * 2);
                        _tile_dpbf16ps(3, 4, 5);
                    }
                }
                _tile_stored(0, o + 16 * d0, 64);
                if (nt > 1) _tile_stored(1, o + 16 * (d0 + 16), 64);
                if (nt > 2) _tile_stored(2, o + 16 * (d0 + 32), 64);
                if (nt > 3) _tile_stored(3, o + 16 * (d0 + 48), 64);
            }
        }
    }
    _tile_release();
    /* O = O^T transposed, each query's row divided by its softmax sum and rounded to bf16, 16
     * dims x 16 queries at a time (transpose16 / cvtneps2bf16: round to nearest even, as
     * store_one; the instruction flushes fp32 denormals to zero, which store_one keeps) */
    for (int rb = 0; rb < nrb; rb++) {
        const vf inv = 1.0f / vselect((vu32)(l[rb] > 0.0f), l[rb], (vf){0} + 1.0f);
        for (int d0 = 0; d0 < D; d0 += 16) {
            __m512 r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_load_ps(ot[rb] + 16 * (d0 + i));
            transpose16(r);
            for (int lane = 0; lane < 16 && rb * 16 + lane < nq; lane++) {
                const int iq = rb * 16 + lane;
                char *dst = out + ((t0 + iq / G) * o_tok + (int64_t)(kvh * G + iq % G) * o_head +
                                   d0) * 2;
                const __m512 x = _mm512_mul_ps(r[lane], _mm512_set1_ps(inv[lane]));
                const __m256bh h = _mm512_cvtneps_pbh(x);
                memcpy(dst, &h, sizeof h);
            }
        }
    }
}
#endif

/* Whether pd_paged_prefill may run its bf16 prefills on AMX tiles (1, the default) or not (0);
 * returns whether it will: 0 where the build (no AMX at -march=native) or the OS (no tile data
 * permission) rules it out. For benchmarks and tests of the other path. */
int pd_set_prefill_amx(int on) { return amx_switch(&pd_prefill_amx_enabled, on); }

/* Whether pd_paged_prefill takes these shapes: 1 when it does, else 0 (the caller falls back). */
int pd_paged_prefill_fits(int heads, int kv_heads, int head_dim) {
    return kv_heads > 0 && heads % kv_heads == 0 && heads / kv_heads * PQ <= PF_MAX_NQ &&
           head_dim % 16 == 0 && head_dim <= PF_MAX_D;
}

/* Causal prefill attention of num_spans chunks in one call.
 * q, out: [rows, heads, head_dim] (token and head strides in elements, head_dim contiguous), of
 * q_dtype. Chunk i has query rows [starts[i], starts[i] + q_lens[i]) at positions
 * computed[i] + 0, 1, ...; it attends keys 0 .. its position, read from k, v ([blocks,
 * block_size, kv_heads, head_dim], kv_dtype, block stride blk_stride elements) through table row
 * i (tables + i * table_stride, int32 block ids), which must already hold the chunk's own K/V.
 * Shapes must satisfy pd_paged_prefill_fits. Returns 0, -1 when scratch memory ran out, -2 for
 * shapes it does not take. */
int pd_paged_prefill(const void *q, int64_t q_tok_stride, int64_t q_head_stride, int q_dtype,
                     const void *k, const void *v, int64_t blk_stride, int kv_dtype,
                     const int32_t *tables, int64_t table_stride, const int64_t *starts,
                     const int64_t *q_lens, const int64_t *computed, int64_t num_spans,
                     void *out, int64_t o_tok_stride, int64_t o_head_stride, int heads,
                     int kv_heads, int head_dim, int block_size, float scale, int num_threads) {
    if (!pd_paged_prefill_fits(heads, kv_heads, head_dim)) return -2;
    const Cache c = {(const char *)k, (const char *)v, blk_stride, (int64_t)kv_heads * head_dim,
                     kv_dtype, kv_heads, head_dim, block_size};
    const int G = heads / kv_heads;
    int64_t n_items = 0;
    for (int64_t i = 0; i < num_spans; i++) n_items += (q_lens[i] + PQ - 1) / PQ * kv_heads;
    PrefillItem *items = malloc(sizeof(PrefillItem) * (size_t)(n_items ? n_items : 1));
    if (!items) return -1;
    int64_t n = 0;
    /* longest-first: the last rows of a chunk see the most keys */
    for (int64_t i = 0; i < num_spans; i++)
        for (int64_t t0 = (q_lens[i] - 1) / PQ * PQ; t0 >= 0; t0 -= PQ)
            for (int64_t h = 0; h < kv_heads; h++) items[n++] = (PrefillItem){i, h, t0};
    (void)num_threads;
    /* bf16 queries and K/V where the CPU has VDPBF16PS: prefill_item_dp; with AMX (and the
     * kernel's permission to use it), prefill_item_amx over K and V gathered per span and KV
     * head first (amx_gather) */
    const int dp = PD_HAVE_DP && q_dtype == PD_BF16 && kv_dtype == PD_BF16 && head_dim % 32 == 0;
    (void)dp;
#if PD_HAVE_AMX
    /* spans of at least AMX_MIN_ROWS rows take the AMX path; their K/V are gathered first (a
     * span's gather reads its whole context, which a few rows after a long prefix do not repay:
     * 1 row after 8000 cached, SmolLM2 shapes, one thread, 1.77 ms on AMX vs 0.83 ms; 16 rows
     * 2.16 vs 3.98). Where the scratch cannot be allocated every span takes the other path. */
    int64_t *kv_off = NULL;
    uint16_t *kc = NULL, *vt = NULL;
    if (dp && pd_prefill_amx_enabled && amx_permitted()) {
        kv_off = malloc(sizeof(int64_t) * (size_t)(num_spans + 1));
        if (kv_off) {
            kv_off[0] = 0;
            for (int64_t i = 0; i < num_spans; i++)
                kv_off[i + 1] = kv_off[i] + (q_lens[i] >= AMX_MIN_ROWS
                                                 ? (computed[i] + q_lens[i] + AKT - 1) / AKT * AKT
                                                 : 0);
            const size_t elems = (size_t)kv_off[num_spans] * (size_t)kv_heads * (size_t)head_dim;
            if (elems > 0) {
                kc = malloc(elems * 2);
                vt = malloc(elems * 2);
            }
            if (!kc || !vt) {
                free(kc);
                free(vt);
                kc = vt = NULL;
            }
        }
    }
    if (kc) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
        for (int64_t sh = 0; sh < num_spans * kv_heads; sh++) {
            const int64_t i = sh / kv_heads, n = kv_off[i + 1] - kv_off[i];
            const int h = (int)(sh % kv_heads);
            const int64_t base = (kv_off[i] * kv_heads + (int64_t)h * n) * head_dim;
            if (n > 0)
                amx_gather(&c, tables + i * table_stride, computed[i] + q_lens[i], n, h,
                           kc + base, vt + base);
        }
    }
#endif
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads) if (num_threads > 1)
    for (int64_t it = 0; it < n_items; it++) {
        const PrefillItem w = items[it];
        const int64_t start = starts[w.span], left = q_lens[w.span] - w.t0;
        const char *qs = (const char *)q + start * q_tok_stride * elem_size(q_dtype);
        char *os = (char *)out + start * o_tok_stride * elem_size(q_dtype);
        const int nr = left < PQ ? (int)left : PQ;
#if PD_HAVE_AMX
        const int64_t n = kc ? kv_off[w.span + 1] - kv_off[w.span] : 0;
        if (n > 0) {
            const int64_t base = (kv_off[w.span] * kv_heads + w.kvh * n) * head_dim;
            prefill_item_amx(G, head_dim, kc + base, vt + base, n, qs, q_tok_stride,
                             q_head_stride, computed[w.span], w.t0, nr, (int)w.kvh, scale, os,
                             o_tok_stride, o_head_stride);
            continue;
        }
#endif
#if PD_HAVE_DP
        if (dp) {
            prefill_item_dp(&c, G, head_dim, tables + w.span * table_stride, qs, q_tok_stride,
                            q_head_stride, computed[w.span], w.t0, nr, (int)w.kvh, scale, os,
                            o_tok_stride, o_head_stride);
            continue;
        }
#endif
        prefill_item(&c, G, head_dim, tables + w.span * table_stride, qs, q_tok_stride,
                     q_head_stride, q_dtype, computed[w.span], w.t0, nr, (int)w.kvh, scale, os,
                     o_tok_stride, o_head_stride);
    }
#if PD_HAVE_AMX
    free(kc);
    free(vt);
    free(kv_off);
#endif
    free(items);
    return 0;
}
