/* Skinny GEMM on the CPU: y[M, N] = x[M, K] @ W[N, K]^T (+ bias) for few rows M (a decode
 * step's batch), with W pre-packed into column panels.
 *
 * Compiled on first use by pdserve/attention/cpu_build.py (cc -O3 -march=native -fopenmp) and
 * called through ctypes by pdserve/model/cpu_linear.py. The kernel exists only where the target
 * has AVX-512F, or AVX2 with FMA for fp32 (pd_skinny_available() says so); elsewhere the caller
 * keeps oneDNN. On AVX2 (a Zen 1 EPYC, one thread, SmolLM2-135M's 30 layers and LM head, fp32)
 * 16 rows take 137.5 ms against oneDNN's 182.3 ms, ~31 GFLOP/s: the FMA units' rate, not DRAM's,
 * bounds a 16-row call there (8 flops per weight byte).
 *
 * Why: with a handful of rows a linear layer is a stream over its weight (each weight element is
 * used M times), so its speed is the rate at which one core pulls the weight from DRAM. oneDNN's
 * fp32 kernels reach 5-7 GB/s there on an AMX Xeon (one thread, SmolLM2 shapes, M = 16), about
 * half of what the core can stream. This kernel keeps one 16-column panel of W in flight per
 * step: the panel is stored k-major ([K][16] floats, one 64-byte line per k), so the weight is
 * read as one sequential stream, each line feeding 16 rows' fused multiply-adds held in 16
 * AVX-512 accumulators, with a software prefetch into L2 PF lines ahead (the hardware prefetcher
 * alone leaves the stream latency-bound). This is the register-blocked "outer product" micro-kernel
 * of Goto & van de Geijn, "Anatomy of high-performance matrix multiplication" (ACM TOMS 2008),
 * shaped for M <= 16 rows; rows beyond 16 re-read each panel from L1/L2, not from DRAM. The
 * block is compiled once per row count 1 .. 16, so a batch of 12 issues 12 multiply-adds per line
 * rather than 16 with 4 thrown away (bf16, SmolLM2-135M, Zen 4, one thread: 12 rows 24.8 -> 17.8
 * ms for the 30 layers and the LM head; 4 rows 24.5 -> 12.2 ms).
 *
 * x is first copied interleaved (pd_skinny_prepare, pack_rows), so that the 16 rows' operands of
 * one k step are adjacent and reached from one pointer: reading each row through its own pointer
 * spilled those pointers out of the general registers at 16 rows (bf16, the 30 layers and LM
 * head, one thread, in one interleaved run: 16 rows 25.5-26.3 -> 22.9-23.8 ms, 14 rows 21.8-22.2
 * -> 20.0-20.2 ms, fp32 16 rows 48.6 -> 42.1 ms; 8 rows and fewer unchanged, bound by DRAM).
 *
 * Packed layout (built by skinny_pack in pdserve/model/cpu_linear.py): panel p holds columns
 * [16p, 16p + 16) of y, as panel[p][k][j] = W[16p + j][k], zero for 16p + j >= N; panels are
 * consecutive. Sums run over k in order in fp32 (results differ from oneDNN's by rounding only,
 * ~1e-6 relative). fp32 weights that are GGUF-style integer codes may instead be packed as those
 * codes (SK_Q4, SK_Q8: see panel_block_codes), rebuilt bit for bit: the same sums and results.
 *
 * bf16 (pd_skinny_gemm_bf16, only where the target has AVX512_BF16): the same stream, with the
 * weight at half the bytes. VDPBF16PS multiplies pairs of bf16 and adds both products to one fp32
 * lane, so a panel line holds 16 columns x 2 consecutive k: panel[p][kk][j][t] = W[16p + j][2kk +
 * t] (K even), and row r's pair (x[r][2kk], x[r][2kk + 1]) is broadcast as one 32-bit word. Sums
 * are fp32 (bias added in fp32 first), rounded to bf16 once at the end (round to nearest even),
 * as oneDNN does; the order of the sum differs, so an output may differ from oneDNN's by a bf16
 * rounding step. VDPBF16PS treats bf16 denormal inputs as zero (Intel SDM, VDPBF16PS).
 *
 * bf16 on AMX (where the target has AMX-BF16 and the OS grants tile data): 2 to 16 rows with K a
 * multiple of 32 go to panels_amx instead, since a bf16 panel is already TDPBF16PS's B operand.
 * SmolLM2's four decoder linears, 120 weights each (past the caches), 16 rows, one thread, a
 * 2-core AMX Xeon: 12.1 GB/s against oneDNN's 9.5 (the VDPBF16PS blocks: 6.5); a whole decode
 * step of 16 (bf16, compiled): 39.2 / 40.8 ms against 47.5 / 47.3 with oneDNN past 4 rows
 * (docs/benchmarks.md, session 16).
 */
#include <stdint.h>
#include <stdlib.h>
#include <pthread.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define PANEL 16  /* output columns per panel (one AVX-512 register of floats, two AVX ones) */
/* weight formats (the "dtype" of the entry points below): x, bias and y are fp32 for all but
 * SK_BF16 (bf16 throughout) */
#define SK_F32 0
#define SK_BF16 1
#define SK_Q4 2 /* fp32 weights as 4-bit codes, a scale and an offset per 32 k (see QGROUP) */
#define SK_Q8 3 /* fp32 weights as 8-bit codes and a scale per 32 k */
/* fp32 on a target with AVX2 and FMA but no AVX-512F (the AVX2 blocks below) */
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define SKINNY_AVX2 1
#else
#define SKINNY_AVX2 0
#endif
/* rows per register block: 16 AVX-512 accumulators, or 6 rows x 2 AVX halves of a panel (12 of
 * the 16 AVX registers, the other 4 for the panel line and a row's broadcast operand) */
#if SKINNY_AVX2
#define MR 6
#else
#define MR 16
#endif
/* Software prefetch distance, in 64-byte lines of the panel stream (a k step of fp32, two of
 * bf16). The AVX-512 blocks spend ~8 cycles of multiply-adds on a line at 16 rows, so 64 lines
 * ahead covered only ~130 ns, about one DRAM latency on the Zen 5 EPYC of session 35; 160 lines
 * (10 KB, far below any L2) cover it with room. SmolLM2-135M's 30 layers and LM head, one
 * thread, best of 5, three alternated rounds (bench/skinny_gemm.py --threads 1): fp32 16 rows
 * 20.3-21.3 ms at 160 lines against 24.4-24.9 at 64, 8 rows 14.5-16.2 against 18.2-18.6, 1 row
 * 13.3-14.8 against 14.4-14.6; bf16 16 rows 11.1-11.5 against 12.2-12.5, 8 rows 8.1-8.3
 * against 9.2-10.1, 1 row 6.8-7.4 against 7.9-8.1 (128 and 192 lines read about as 160; 256
 * no better). A whole decode step of 16 at context 320 (bench/decode_throughput.py --compile,
 * one thread, no helper, alternated twice): fp32 29.9-31.3 ms against 35.2-36.8, bf16
 * 17.9-18.5 against 19.5-20.6. The AVX2 and AMX blocks keep the 64 lines they were measured
 * with (not re-measured on those CPUs). */
#if defined(__AVX512F__)
#define PF_LINES 160
#else
#define PF_LINES 64
#endif
#define PF_LINES_AMX 64
#define SKINNY_AMX_MIN_ROWS 2 /* rows from which bf16 takes the AMX path where there is one */

int pd_skinny_available(void) {
#if defined(__AVX512F__) || SKINNY_AVX2
    return 1;
#else
    return 0;
#endif
}

int pd_skinny_bf16_available(void) {
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    return 1;
#else
    return 0;
#endif
}

#if defined(__AVX512F__) || SKINNY_AVX2
#include <immintrin.h>

#define REP16(X) \
    X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define REP6(X) X(0) X(1) X(2) X(3) X(4) X(5)

/* One register block of a fixed row count mr: rows [0, mr) of x times one panel -> the panel's
 * ncols columns of y (row stride ldy); bias: the panel's ncols entries or NULL. x comes
 * interleaved by pd_skinny_prepare (see pack_rows): xt[s][r] is row r's 4-byte word of k step s
 * (an fp32 element, or a bf16 pair), so every row's operand of a step sits at a constant offset
 * from one pointer: each multiply-add takes it as an embedded broadcast, with no per-row pointer
 * to keep in a register (16 of them spilled, and cost ~25% of the kernel's time on Zen 4). Each
 * dtype has one block per mr in 1 .. MR (a table indexed by mr - 1), so one driver serves both. */
typedef void (*block_fn)(const void *xt, const void *panel, int64_t k, const void *bias, void *y,
                         int64_t ldy, int ncols);

#if defined(__AVX512F__)
/* fp32: panel [k][16] floats. Inlined with mr a constant (the MR_BLOCKS table below), so each
 * row count keeps only its own accumulators: a batch of 12 does 12 FMAs per weight line, not 16. */
static inline __attribute__((always_inline)) void panel_block_n(
    const void *xv, const int mr, const void *pv, int64_t k, const void *bv, void *yv,
    int64_t ldy, int ncols) {
    const float *xt = xv, *panel = pv, *bias = bv;
    float *y = yv;
    const __mmask16 cols = (__mmask16)((1u << ncols) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(cols, bias) : _mm512_setzero_ps();
    /* accumulators past mr are never used: the constant mr drops them */
#define DECL(r) __m512 acc##r = b;
    REP16(DECL)
#undef DECL
    for (int64_t kk = 0; kk < k; kk++) {
        const __m512 w = _mm512_loadu_ps(panel + kk * PANEL);
        _mm_prefetch((const char *)(panel + (kk + PF_LINES) * PANEL), _MM_HINT_T1);
#define FMA(r) if (r < mr) acc##r = _mm512_fmadd_ps(_mm512_set1_ps(xt[kk * mr + r]), w, acc##r);
        REP16(FMA)
#undef FMA
    }
#define STORE(r) if (r < mr) _mm512_mask_storeu_ps(y + (int64_t)(r) * ldy, cols, acc##r);
    REP16(STORE)
#undef STORE
}
#else
/* fp32 on AVX2 + FMA: the same stream, each panel line [16] floats taken as two 8-float halves,
 * so a row needs two accumulators and a block holds MR = 6 rows (12 accumulators, the two halves
 * of the line and one broadcast row operand: 15 of the 16 registers). Rows past 6 re-read the
 * panel from L2 (a panel is K x 64 bytes: 36 KB for K = 576, 96 KB for K = 1536). Bias and the
 * last panel's ncols < 16 columns go through masked loads and stores. from_y (a constant once
 * inlined): the accumulators start from y's rows instead of the bias, so a panel's k range can be
 * run in chunks with each multiply-add applied in the same order (codes_panels_avx2). */
static inline __attribute__((always_inline)) void panel_block_avx2(
    const void *xv, const int mr, const void *pv, int64_t k, const void *bv, void *yv,
    int64_t ldy, int ncols, const int from_y) {
    const float *xt = xv, *panel = pv, *bias = bv;
    float *y = yv;
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(ncols), lane);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(ncols - 8), lane);
    /* VMASKMOVPS is slow on AMD CPUs (a masked store per row and half at each call's end cost
     * codes_panels_avx2 ~15% at 16 rows, Zen 3): full panels take plain loads and stores */
    const int full = ncols == PANEL;
    const __m256 b0 = bias && !from_y ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();
    const __m256 b1 = bias && !from_y ? _mm256_maskload_ps(bias + 8, m1) : _mm256_setzero_ps();
#define DECL(r)                                                                               \
    __m256 lo##r = b0, hi##r = b1;                                                            \
    if (from_y && r < mr) {                                                                   \
        lo##r = full ? _mm256_loadu_ps(y + (int64_t)(r) * ldy)                                \
                     : _mm256_maskload_ps(y + (int64_t)(r) * ldy, m0);                        \
        hi##r = full ? _mm256_loadu_ps(y + (int64_t)(r) * ldy + 8)                            \
                     : _mm256_maskload_ps(y + (int64_t)(r) * ldy + 8, m1);                    \
    }
    REP6(DECL)
#undef DECL
    /* 4 k steps an iteration: rolled, a block of 4 rows took ~8 cycles a k step where its 8
     * multiply-adds need 4, ~5 unrolled (Zen 3 EPYC, one thread, weights in L3). SmolLM2-135M's
     * coded layers and LM head, the two builds alternated in one process 12 times: 16 rows
     * (6 + 6 + 4) 56.6 ms against 63.4 (best), 59.4 against 71.7 (median); 8 rows 1.04-1.09x;
     * 1 and 32 rows unchanged. */
#pragma GCC unroll 4
    for (int64_t kk = 0; kk < k; kk++) {
        const __m256 w0 = _mm256_loadu_ps(panel + kk * PANEL);
        const __m256 w1 = _mm256_loadu_ps(panel + kk * PANEL + 8);
        if (!from_y) _mm_prefetch((const char *)(panel + (kk + PF_LINES) * PANEL), _MM_HINT_T1);
#define FMA(r)                                                                                \
    if (r < mr) {                                                                             \
        const __m256 xb = _mm256_broadcast_ss(xt + kk * mr + r);                              \
        lo##r = _mm256_fmadd_ps(xb, w0, lo##r);                                               \
        hi##r = _mm256_fmadd_ps(xb, w1, hi##r);                                               \
    }
        REP6(FMA)
#undef FMA
    }
#define STORE(r)                                                                              \
    if (r < mr) {                                                                             \
        if (full) {                                                                           \
            _mm256_storeu_ps(y + (int64_t)(r) * ldy, lo##r);                                  \
            _mm256_storeu_ps(y + (int64_t)(r) * ldy + 8, hi##r);                              \
        } else {                                                                              \
            _mm256_maskstore_ps(y + (int64_t)(r) * ldy, m0, lo##r);                           \
            _mm256_maskstore_ps(y + (int64_t)(r) * ldy + 8, m1, hi##r);                       \
        }                                                                                     \
    }
    REP6(STORE)
#undef STORE
}

static inline __attribute__((always_inline)) void panel_block_n(
    const void *xv, const int mr, const void *pv, int64_t k, const void *bv, void *yv,
    int64_t ldy, int ncols) {
    panel_block_avx2(xv, mr, pv, k, bv, yv, ldy, ncols, 0);
}

static inline __attribute__((always_inline)) void panel_block_acc_n(
    const void *xv, const int mr, const void *pv, int64_t k, const void *bv, void *yv,
    int64_t ldy, int ncols) {
    panel_block_avx2(xv, mr, pv, k, bv, yv, ldy, ncols, 1);
}
#endif

/* BLOCKS(name, impl): impl (an inlined block taking mr) for mr = 1 .. MR, one function each, and
 * the table `name` of them that vector_panels picks from */
#define BLOCK_N(impl, r)                                                                      \
    static void impl##_##r(const void *xt, const void *p, int64_t k, const void *b, void *y,  \
                           int64_t ldy, int ncols) {                                          \
        impl(xt, r + 1, p, k, b, y, ldy, ncols);                                              \
    }
#if MR == 16
#define BLOCKS(name, impl)                                                                    \
    BLOCK_N(impl, 0) BLOCK_N(impl, 1) BLOCK_N(impl, 2) BLOCK_N(impl, 3) BLOCK_N(impl, 4)      \
    BLOCK_N(impl, 5) BLOCK_N(impl, 6) BLOCK_N(impl, 7) BLOCK_N(impl, 8) BLOCK_N(impl, 9)      \
    BLOCK_N(impl, 10) BLOCK_N(impl, 11) BLOCK_N(impl, 12) BLOCK_N(impl, 13) BLOCK_N(impl, 14) \
    BLOCK_N(impl, 15)                                                                         \
    static const block_fn name[MR] = {impl##_0,  impl##_1,  impl##_2,  impl##_3,             \
                                      impl##_4,  impl##_5,  impl##_6,  impl##_7,             \
                                      impl##_8,  impl##_9,  impl##_10, impl##_11,            \
                                      impl##_12, impl##_13, impl##_14, impl##_15};
#else
#define BLOCKS(name, impl)                                                                    \
    BLOCK_N(impl, 0) BLOCK_N(impl, 1) BLOCK_N(impl, 2) BLOCK_N(impl, 3) BLOCK_N(impl, 4)      \
    BLOCK_N(impl, 5)                                                                          \
    static const block_fn name[MR] = {impl##_0, impl##_1, impl##_2,                           \
                                      impl##_3, impl##_4, impl##_5};
#endif

BLOCKS(F32_BLOCKS, panel_block_n)
#if SKINNY_AVX2
BLOCKS(F32_ACC_BLOCKS, panel_block_acc_n)
#endif

#define QGROUP 32
#define Q4_GROUP_BYTES (2 * 64 + QGROUP / 2 * PANEL) /* 384: d, m, 16 pairs x 16 columns */
#define Q8_GROUP_BYTES (64 + QGROUP * PANEL)         /* 576: d, 32 steps x 16 columns */
#define Q_PF_BYTES (PF_LINES * 64)

#if defined(__AVX512F__)
/* fp32 weights held as small integer codes (SK_Q4, SK_Q8; built by skinny_pack_codes in
 * pdserve/model/cpu_linear.py only where every weight is reproduced exactly). A panel is cut into
 * groups of QGROUP k steps; a group holds its 16 columns' scales d[16] (fp32), for SK_Q4 their
 * offsets m[16] (fp32), then the codes: SK_Q4 one byte per column per pair of k steps (the first
 * step in the low nibble), w = q * d + m with q in [0, 15]; SK_Q8 one signed byte per column per
 * step, w = q * d. Each d has few enough significant bits that q * d is exact in fp32, so the
 * fused multiply-add below rounds once where the dequantiser rounded once (its sum), and the
 * weights the multiply-adds see are the fp32 weights bit for bit: sums, their order and results
 * equal panel_block_n's. A group is 3/16 (SK_Q4) or 9/32 (SK_Q8) of its fp32 bytes, which is
 * what a decode step's GEMM streams from DRAM; the price is a multiply-add per 16 weights to
 * rebuild them (SK_Q4 turns a 4-bit code into a float with one permute from a 16-entry table;
 * a mask and a conversion instead read ~10% slower at 16 rows on Zen 5). SmolLM2-135M's 30
 * layers and LM head (Q4_1 and Q8_0 in its GGUF file), one thread, Zen 5 EPYC
 * (bench/skinny_gemm.py --gguf-codes --threads 1, interleaved): 1 row 9.2 ms against 15.3 with
 * fp32 panels, 8 rows 12.7 against 17.3, 16 rows 20.7 against 20.1, 32 rows 39.6 against 38.6:
 * from ~14 rows the fp32 panels are bound by the multiply-adds too. */

/* One register block of coded panels (q4: SK_Q4, else SK_Q8; a constant once inlined), as
 * panel_block_n: two k steps an iteration, each rebuilt as its 16 fp32 weights, then the rows'
 * multiply-adds in k order. */
static inline __attribute__((always_inline)) void panel_block_codes(
    const void *xv, const int mr, const void *pv, int64_t k, const void *bv, void *yv,
    int64_t ldy, int ncols, const int q4) {
    const float *xt = xv, *bias = bv;
    const char *panel = pv;
    float *y = yv;
    const __mmask16 cols = (__mmask16)((1u << ncols) - 1u);
    const __m512 b = bias ? _mm512_maskz_loadu_ps(cols, bias) : _mm512_setzero_ps();
    const __m512 nib = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const int64_t group_bytes = q4 ? Q4_GROUP_BYTES : Q8_GROUP_BYTES;
#define DECL(r) __m512 acc##r = b;
    REP16(DECL)
#undef DECL
    for (int64_t g = 0; g < k / QGROUP; g++) {
        const char *grp = panel + g * group_bytes;
        for (int l = 0; l < group_bytes / 64; l++)
            _mm_prefetch(grp + Q_PF_BYTES + 64 * l, _MM_HINT_T1);
        const __m512 d = _mm512_loadu_ps(grp);
        const __m512 m = q4 ? _mm512_loadu_ps(grp + 64) : _mm512_setzero_ps();
        const __m128i *q = (const __m128i *)(grp + (q4 ? 128 : 64));
        const float *xg = xt + g * QGROUP * mr;
        for (int s = 0; s < QGROUP / 2; s++) {
            __m512 w0, w1;
            if (q4) {
                /* one byte a column holds both steps' codes; the permute reads each lane's low 4
                 * bits: the low nibble as it is, the high one shifted down */
                const __m512i qq = _mm512_cvtepu8_epi32(_mm_loadu_si128(q + s));
                w0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(qq, nib), d, m);
                w1 = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(qq, 4), nib), d, m);
            } else {
                const __m512i q0 = _mm512_cvtepi8_epi32(_mm_loadu_si128(q + 2 * s));
                const __m512i q1 = _mm512_cvtepi8_epi32(_mm_loadu_si128(q + 2 * s + 1));
                w0 = _mm512_mul_ps(_mm512_cvtepi32_ps(q0), d);
                w1 = _mm512_mul_ps(_mm512_cvtepi32_ps(q1), d);
            }
            const float *x0 = xg + 2 * s * mr, *x1 = x0 + mr;
#define FMA(r)                                                                                \
    if (r < mr) {                                                                             \
        acc##r = _mm512_fmadd_ps(_mm512_set1_ps(x0[r]), w0, acc##r);                          \
        acc##r = _mm512_fmadd_ps(_mm512_set1_ps(x1[r]), w1, acc##r);                          \
    }
            REP16(FMA)
#undef FMA
        }
    }
#define STORE(r) if (r < mr) _mm512_mask_storeu_ps(y + (int64_t)(r) * ldy, cols, acc##r);
    REP16(STORE)
#undef STORE
}

static inline __attribute__((always_inline)) void panel_block_q4_n(
    const void *xv, const int mr, const void *pv, int64_t k, const void *bv, void *yv,
    int64_t ldy, int ncols) {
    panel_block_codes(xv, mr, pv, k, bv, yv, ldy, ncols, 1);
}

static inline __attribute__((always_inline)) void panel_block_q8_n(
    const void *xv, const int mr, const void *pv, int64_t k, const void *bv, void *yv,
    int64_t ldy, int ncols) {
    panel_block_codes(xv, mr, pv, k, bv, yv, ldy, ncols, 0);
}

BLOCKS(Q4_BLOCKS, panel_block_q4_n)
BLOCKS(Q8_BLOCKS, panel_block_q8_n)
#define SKINNY_HAVE_CODES 1
#elif SKINNY_AVX2
/* The codes on AVX2 + FMA: with 16 registers a block cannot hold its rows' accumulators beside a
 * group's scales and offsets and the rebuilt weights, so a panel is first rebuilt as fp32 panel
 * lines into a buffer and the fp32 blocks run over it: CODE_CHUNK k steps at a time on the stack
 * (8 KB, in L1) for up to CODE_WHOLE_FROM rows, the whole panel at once (k * 64 bytes, in L2, a
 * buffer per thread) for more. Every row block then reads the rebuilt weights from L1 or L2, as
 * the fp32 panels' blocks past the first read theirs from L2. A chunk's blocks start from the sums
 * the previous chunk stored in y (panel_block_acc_n), so each output's multiply-adds happen in the
 * same order on the same fp32 weights as with fp32 panels: the same results bit for bit. A weight
 * is rebuilt once per call whatever the row count, as in panel_block_codes: q * d + m in one
 * multiply-add (SK_Q4), q * d (SK_Q8). SmolLM2-135M's 30 layers and LM head (Q4_1, Q8_0), one
 * thread, Zen 3 EPYC (bench/skinny_gemm.py --gguf-codes --threads 1): against fp32 panels 1.61x
 * at 1 row, 1.11x at 8, 1.04-1.06x at 16 and 1.02-1.06x at 32 (the multiply-adds bound both
 * there); 256 rows (a prefill's, through the shared helper) 1.01x with the whole panel, 0.86x
 * with 128-step chunks (each row block's slice of x then starts a new stream). */
#define CODE_CHUNK 128
#define CODE_WHOLE_FROM 16

/* Group g of a coded panel (q4: SK_Q4, else SK_Q8) rebuilt as fp32 panel lines out[32][16]. */
static inline __attribute__((always_inline)) void rebuild_group(const char *grp, float *out,
                                                                const int q4) {
    const int64_t group_bytes = q4 ? Q4_GROUP_BYTES : Q8_GROUP_BYTES;
    for (int l = 0; l < group_bytes / 64; l++) _mm_prefetch(grp + Q_PF_BYTES + 64 * l, _MM_HINT_T0);
    const __m256 d0 = _mm256_loadu_ps((const float *)grp);
    const __m256 d1 = _mm256_loadu_ps((const float *)grp + 8);
    if (q4) {
        const __m256 m0 = _mm256_loadu_ps((const float *)(grp + 64));
        const __m256 m1 = _mm256_loadu_ps((const float *)(grp + 64) + 8);
        const __m128i *q = (const __m128i *)(grp + 128);
        const __m256i low = _mm256_set1_epi32(15);
        for (int s = 0; s < QGROUP / 2; s++) {
            /* byte j: column j's codes of steps 2s (low nibble) and 2s + 1 (high nibble) */
            const __m128i b = _mm_loadu_si128(q + s);
            const __m256i c0 = _mm256_cvtepu8_epi32(b);
            const __m256i c1 = _mm256_cvtepu8_epi32(_mm_unpackhi_epi64(b, b));
            float *o = out + 2 * s * PANEL;
            _mm256_store_ps(o, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c0, low)), d0, m0));
            _mm256_store_ps(o + 8,
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(c1, low)), d1, m1));
            _mm256_store_ps(o + PANEL,
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c0, 4)), d0, m0));
            _mm256_store_ps(o + PANEL + 8,
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(c1, 4)), d1, m1));
        }
    } else {
        const __m128i *q = (const __m128i *)(grp + 64);
        for (int s = 0; s < QGROUP; s++) {
            const __m128i b = _mm_loadu_si128(q + s);
            float *o = out + s * PANEL;
            _mm256_store_ps(o, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), d0));
            _mm256_store_ps(o + 8, _mm256_mul_ps(
                _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_unpackhi_epi64(b, b))), d1));
        }
    }
}

static pthread_key_t code_panel_key;
static pthread_once_t code_panel_once = PTHREAD_ONCE_INIT;
static void code_panel_key_init(void) { pthread_key_create(&code_panel_key, free); }

/* This thread's buffer for a whole rebuilt panel of k steps (k * 64 bytes, grown as needed and
 * freed when the thread exits), or NULL when it cannot be allocated. */
static float *code_panel(int64_t k) {
    static __thread int64_t cap;
    pthread_once(&code_panel_once, code_panel_key_init);
    float *buf = pthread_getspecific(code_panel_key);
    if (buf && cap >= k) return buf;
    float *grown = aligned_alloc(64, (size_t)k * PANEL * sizeof(float));
    if (!grown || pthread_setspecific(code_panel_key, grown)) {
        free(grown);
        return NULL;
    }
    free(buf);
    cap = k;
    return grown;
}

/* vector_panels for coded panels (fmt SK_Q4 or SK_Q8) on AVX2: see CODE_CHUNK. */
static void codes_panels_avx2(int fmt, const uint32_t *xt, int64_t m, int64_t k,
                              const char *packed, int64_t n, const float *bias, float *y,
                              int64_t ldy, int64_t p0, int64_t p1) {
    const int q4 = fmt == SK_Q4;
    const int64_t group_bytes = q4 ? Q4_GROUP_BYTES : Q8_GROUP_BYTES;
    float stack_chunk[CODE_CHUNK * PANEL] __attribute__((aligned(64)));
    float *chunk = stack_chunk;
    int64_t chunk_k = CODE_CHUNK;
    if (m > CODE_WHOLE_FROM) {
        float *whole = code_panel(k);
        if (whole) chunk = whole, chunk_k = k;
    }
    for (int64_t p = p0; p < p1; p++) {
        const int64_t left = n - p * PANEL;
        const int ncols = left < PANEL ? (int)left : PANEL;
        const char *panel = packed + p * (k / QGROUP) * group_bytes;
        const float *pb = bias ? bias + p * PANEL : NULL;
        for (int64_t c0 = 0; c0 < k; c0 += chunk_k) {
            const int64_t kc = k - c0 < chunk_k ? k - c0 : chunk_k;
            for (int64_t g = 0; g < kc / QGROUP; g++) {
                const char *grp = panel + (c0 / QGROUP + g) * group_bytes;
                if (q4)
                    rebuild_group(grp, chunk + g * QGROUP * PANEL, 1);
                else
                    rebuild_group(grp, chunk + g * QGROUP * PANEL, 0);
            }
            const block_fn *blocks = c0 ? F32_ACC_BLOCKS : F32_BLOCKS;
            for (int64_t m0 = 0; m0 < m; m0 += MR) {
                const int mr = m - m0 < MR ? (int)(m - m0) : MR;
                blocks[mr - 1](xt + m0 * k + c0 * mr, chunk, kc, pb, y + m0 * ldy + p * PANEL,
                               ldy, ncols);
            }
        }
    }
}
#define SKINNY_HAVE_CODES 1
#else
#define SKINNY_HAVE_CODES 0
#endif

/* xt = x's rows [m0, m0 + mr) interleaved by k step: xt[s * mr + r] = row m0 + r's 4-byte word
 * s (x row stride ldx in elements of es bytes; steps = k * es / 4 words a row). */
static void pack_rows(const char *x, int64_t ldx, int64_t es, int64_t m0, int mr, int64_t steps,
                      uint32_t *xt) {
    for (int r = 0; r < mr; r++) {
        const char *row = x + (m0 + r) * ldx * es;
        for (int64_t s = 0; s < steps; s++) memcpy(xt + s * mr + r, row + 4 * s, 4);
    }
}

/* Panels [p0, p1) times every 16-row block of x, through blocks[mr - 1]; xt: x interleaved
 * by pack_rows, one 16-row block after another; es: bytes per element of x, bias and y;
 * panel_bytes: bytes from one panel to the next (k * PANEL elements of fp32 or bf16 panels, k /
 * QGROUP groups of coded ones). */
static void vector_panels(const block_fn *blocks, int64_t es, int64_t panel_bytes,
                          const uint32_t *xt, int64_t m, int64_t k, const char *packed, int64_t n,
                          const char *bias, char *y, int64_t ldy, int64_t p0, int64_t p1) {
    const int64_t steps = k * es / 4;
    for (int64_t p = p0; p < p1; p++) {
        const int64_t left = n - p * PANEL;
        const int ncols = left < PANEL ? (int)left : PANEL;
        const char *panel = packed + p * panel_bytes;
        const char *pb = bias ? bias + p * PANEL * es : NULL;
        for (int64_t m0 = 0; m0 < m; m0 += MR) {
            const int mr = m - m0 < MR ? (int)(m - m0) : MR;
            blocks[mr - 1](xt + m0 * steps, panel, k, pb, y + (m0 * ldy + p * PANEL) * es, ldy,
                           ncols);
        }
    }
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
/* bf16 [16] (masked to ncols) -> fp32 lanes: a bf16 is the top half of an fp32 */
static inline __m512 bf16_to_f32(__mmask16 cols, const uint16_t *src) {
    const __m256i h = _mm256_maskz_loadu_epi16(cols, src);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

/* the bf16 twin of panel_block_n: panel [k / 2][16][2] bf16, k / 2 pair steps */
static inline __attribute__((always_inline)) void panel_block_bf16_n(
    const void *xv, const int mr, const void *pv, int64_t k, const void *bv, void *yv,
    int64_t ldy, int ncols) {
    const int32_t *xt = xv;
    const uint16_t *panel = pv, *bias = bv;
    uint16_t *y = yv;
    const int64_t k2 = k / 2;
    const __mmask16 cols = (__mmask16)((1u << ncols) - 1u);
    const __m512 b = bias ? bf16_to_f32(cols, bias) : _mm512_setzero_ps();
#define DECL(r) __m512 acc##r = b;
    REP16(DECL)
#undef DECL
    for (int64_t kk = 0; kk < k2; kk++) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512((const void *)(panel + kk * 2 * PANEL));
        _mm_prefetch((const char *)(panel + (kk + PF_LINES) * 2 * PANEL), _MM_HINT_T1);
#define DOT(r)                                                                                \
    if (r < mr)                                                                               \
        acc##r = _mm512_dpbf16_ps(acc##r, (__m512bh)_mm512_set1_epi32(xt[kk * mr + r]), w);
        REP16(DOT)
#undef DOT
    }
#define STORE(r)                                                                              \
    if (r < mr)                                                                               \
        _mm256_mask_storeu_epi16(y + (int64_t)(r) * ldy, cols, (__m256i)_mm512_cvtneps_pbh(acc##r));
    REP16(STORE)
#undef STORE
}

BLOCKS(BF16_BLOCKS, panel_block_bf16_n)
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512BW__) && defined(__AVX512VL__)
#define SKINNY_HAVE_AMX 1
#include "../../cpu_kernels/amx_tiles.h"

/* 0 turns the AMX path off (pd_skinny_set_amx) */
static int skinny_amx_enabled = 1;

/* The bf16 panels on AMX tiles, k a multiple of 32: the panel layout [k / 2][16][2] is exactly a
 * TDPBF16PS B operand (16 pair rows of 16 columns, 1 KB per 32 k), so each 1 KB of the stream is
 * one tile load and one tile multiply against 16 rows of x (zero rows padding m to 16), with the
 * software prefetch PF_LINES_AMX lines ahead. tmm0: the 16 x 16 fp32 sums,
 * tmm1: x rows, tmm2: the panel. One thread's share of the panels; configures the tile unit on
 * entry and releases it on exit (oneDNN configures its own). */
static void panels_amx(const uint16_t *xpad, int64_t m, int64_t k, const uint16_t *packed,
                       int64_t n, const uint16_t *bias, uint16_t *y, int64_t ldy, int64_t p0,
                       int64_t p1) {
    amx_configure_16x64(3);
    float c[16 * 16] __attribute__((aligned(64)));
    for (int64_t p = p0; p < p1; p++) {
        const uint16_t *panel = packed + p * k * PANEL;
        const int64_t left = n - p * PANEL;
        const int ncols = left < PANEL ? (int)left : PANEL;
        const __mmask16 cols = (__mmask16)((1u << ncols) - 1u);
        _tile_zero(0);
        for (int64_t kb = 0; kb < k; kb += 32) {
            const uint16_t *w = panel + kb * PANEL; /* 16 pair rows of 32 bf16 */
            for (int l = 0; l < 16; l++)
                _mm_prefetch((const char *)(w + (PF_LINES_AMX + l) * 2 * PANEL), _MM_HINT_T1);
            _tile_loadd(1, xpad + kb, k * 2);
            _tile_loadd(2, w, 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, c, 64);
        const __m512 b = bias ? bf16_to_f32(cols, bias + p * PANEL) : _mm512_setzero_ps();
        for (int64_t r = 0; r < m; r++) {
            const __m512 v = _mm512_add_ps(_mm512_load_ps(c + 16 * r), b);
            _mm256_mask_storeu_epi16(y + r * ldy + p * PANEL, cols,
                                     (__m256i)_mm512_cvtneps_pbh(v));
        }
    }
    _tile_release();
}

#else
#define SKINNY_HAVE_AMX 0
#endif

/* Whether pd_skinny_gemm_bf16 may run on AMX tiles (1, the default) or not (0); returns whether
 * it will: 0 where the build (no AMX at -march=native) or the OS (no tile data) rules it out. */
int pd_skinny_set_amx(int on) {
#if SKINNY_HAVE_AMX
    skinny_amx_enabled = on != 0;
    return skinny_amx_enabled && amx_permitted();
#else
    (void)on;
    return 0;
#endif
}

/* ---- entry points -------------------------------------------------------------------------- */

#ifndef SKINNY_HAVE_CODES
#define SKINNY_HAVE_CODES 0
#endif

#define PATH_VECTOR 0
#define PATH_AMX 1

#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SKINNY_HAVE_BF16 1
#else
#define SKINNY_HAVE_BF16 0
#endif

/* Bytes of the operand copy pd_skinny_prepare writes for m rows of k (either dtype and path). */
int64_t pd_skinny_prep_bytes(int64_t m, int64_t k) {
    return ((m > 16 ? m : 16) * k * 4 + 63) / 64 * 64;
}

/* The first half of a GEMM split for many callers: x [m, k] (row stride ldx; dtype the weight
 * format: x is bf16 for SK_BF16, else fp32) copied into prep (pd_skinny_prep_bytes(m, k) bytes,
 * 64-byte aligned) in the layout of the path that takes these shapes. Returns the path
 * (PATH_VECTOR, or PATH_AMX: bf16, 2 to 16 rows, k a multiple of 32, where the build and the OS
 * allow), or -1 where the kernel is not built for the format, a bf16 k is odd or a coded
 * format's k is not a multiple of 32. */
int pd_skinny_prepare(int dtype, const void *x, int64_t m, int64_t k, int64_t ldx, void *prep) {
#if defined(__AVX512F__) || SKINNY_AVX2
    if (dtype < SK_F32 || dtype > SK_Q8) return -1;
    if (dtype == SK_BF16 && (!SKINNY_HAVE_BF16 || k % 2)) return -1;
    if (dtype >= SK_Q4 && (!SKINNY_HAVE_CODES || k % 32)) return -1;
#if SKINNY_HAVE_AMX
    if (dtype == SK_BF16 && m >= SKINNY_AMX_MIN_ROWS && m <= 16 && k % 32 == 0 &&
        skinny_amx_enabled && amx_permitted()) {
        uint16_t *xpad = prep;
        memset(xpad, 0, (size_t)(16 * k * 2));
        for (int64_t r = 0; r < m; r++)
            memcpy(xpad + r * k, (const uint16_t *)x + r * ldx, (size_t)k * 2);
        return PATH_AMX;
    }
#endif
    const int64_t es = dtype == SK_BF16 ? 2 : 4, steps = k * es / 4;
    for (int64_t m0 = 0; m0 < m; m0 += MR)
        pack_rows(x, ldx, es, m0, m - m0 < MR ? (int)(m - m0) : MR, steps,
                  (uint32_t *)prep + m0 * steps);
    return PATH_VECTOR;
#else
    (void)dtype; (void)x; (void)m; (void)k; (void)ldx; (void)prep;
    return -1;
#endif
}

/* The second half: panels [p0, p1) of y[m, n] (row stride ldy) = x @ W^T + bias from the copy
 * pd_skinny_prepare made and the path it returned, on the calling thread. Callers may run
 * disjoint panel ranges of one GEMM at once. Returns 0, or -1 for a path not built here. */
int pd_skinny_panels(int dtype, int path, const void *prep, int64_t m, int64_t k,
                     const void *packed, int64_t n, const void *bias, void *y, int64_t ldy,
                     int64_t p0, int64_t p1) {
#if SKINNY_HAVE_AMX
    if (path == PATH_AMX) {
        panels_amx(prep, m, k, packed, n, bias, y, ldy, p0, p1);
        return 0;
    }
#endif
#if defined(__AVX512F__) || SKINNY_AVX2
    if (path != PATH_VECTOR) return -1;
    if (dtype == SK_F32) {
        vector_panels(F32_BLOCKS, 4, k * PANEL * 4, prep, m, k, packed, n, bias, y, ldy, p0, p1);
        return 0;
    }
#if SKINNY_HAVE_CODES
    if (dtype == SK_Q4 || dtype == SK_Q8) {
        if (k % QGROUP) return -1;
#if SKINNY_AVX2
        codes_panels_avx2(dtype, prep, m, k, packed, n, bias, y, ldy, p0, p1);
#else
        vector_panels(dtype == SK_Q4 ? Q4_BLOCKS : Q8_BLOCKS, 4,
                      k / QGROUP * (dtype == SK_Q4 ? Q4_GROUP_BYTES : Q8_GROUP_BYTES), prep, m, k,
                      packed, n, bias, y, ldy, p0, p1);
#endif
        return 0;
    }
#endif
#if SKINNY_HAVE_BF16
    if (dtype == SK_BF16) {
        vector_panels(BF16_BLOCKS, 2, k * PANEL * 2, prep, m, k, packed, n, bias, y, ldy, p0, p1);
        return 0;
    }
#endif
#endif
    (void)dtype; (void)path; (void)prep; (void)m; (void)k; (void)packed; (void)n; (void)bias;
    (void)y; (void)ldy; (void)p0; (void)p1;
    return -1;
}

/* The whole GEMM: prepare, then the panels split over num_threads OpenMP threads in contiguous
 * ranges. Returns 0, -1 where the kernel is not built for the dtype (or a bf16 k is odd), -2 when
 * the operand copy cannot be allocated. */
static int skinny_gemm(int dtype, const void *x, int64_t m, int64_t k, int64_t ldx,
                       const void *packed, int64_t n, const void *bias, void *y, int64_t ldy,
                       int num_threads) {
    void *prep = aligned_alloc(64, (size_t)pd_skinny_prep_bytes(m, k));
    if (!prep) return -2;
    const int path = pd_skinny_prepare(dtype, x, m, k, ldx, prep);
    const int64_t panels = (n + PANEL - 1) / PANEL;
    int rc = path < 0 ? -1 : 0;
    (void)num_threads;
#pragma omp parallel num_threads(num_threads) if (num_threads > 1 && path >= 0)
    {
#ifdef _OPENMP
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
#else
        const int64_t t = 0, nt = 1;
#endif
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        if (path >= 0 && p0 < p1)
            pd_skinny_panels(dtype, path, prep, m, k, packed, n, bias, y, ldy, p0, p1);
    }
    free(prep);
    return rc;
}

/* y[m, n] (row stride ldy) = x[m, k] (row stride ldx) @ W^T + bias, W packed as above;
 * bias: [n] floats or NULL. num_threads: OpenMP threads splitting the panels.
 * Returns 0, -1 where the kernel is not built (neither AVX-512F nor AVX2 with FMA), -2 out of
 * memory. */
int pd_skinny_gemm_f32(const float *x, int64_t m, int64_t k, int64_t ldx, const float *packed,
                       int64_t n, const float *bias, float *y, int64_t ldy, int num_threads) {
    return skinny_gemm(SK_F32, x, m, k, ldx, packed, n, bias, y, ldy, num_threads);
}

/* pd_skinny_gemm_f32 for fp32 weights held as codes (fmt SK_Q4 or SK_Q8, packed as described at
 * panel_block_codes; k a multiple of 32), or any format by its code: x, bias and y fp32 (bf16 for
 * SK_BF16). Returns 0, -1 where the kernel is not built for the format (the codes need AVX-512F,
 * or AVX2 with FMA) or k does not fit it, -2 out of memory. */
int pd_skinny_gemm(int fmt, const void *x, int64_t m, int64_t k, int64_t ldx, const void *packed,
                   int64_t n, const void *bias, void *y, int64_t ldy, int num_threads) {
    return skinny_gemm(fmt, x, m, k, ldx, packed, n, bias, y, ldy, num_threads);
}

/* Whether the fp32 weight codes (SK_Q4, SK_Q8) are built here (AVX-512F, or AVX2 with FMA). */
int pd_skinny_codes_available(void) { return SKINNY_HAVE_CODES; }

/* The bf16 twin of pd_skinny_gemm_f32: x, packed, bias and y hold bf16 (as uint16_t); k even,
 * packed as described at the top. Returns 0, -1 where the kernel is not built (no AVX512_BF16)
 * or k is odd, -2 out of memory. */
int pd_skinny_gemm_bf16(const uint16_t *x, int64_t m, int64_t k, int64_t ldx,
                        const uint16_t *packed, int64_t n, const uint16_t *bias, uint16_t *y,
                        int64_t ldy, int num_threads) {
    return skinny_gemm(SK_BF16, x, m, k, ldx, packed, n, bias, y, ldy, num_threads);
}
