/* Token sampling on the CPU straight from the LM head's logits (fp32 or bf16), one pass per row:
 * the two-level exponential race of pdserve/sampling.py and the first-maximum argmax.
 *
 * Compiled on first use by pdserve/attention/cpu_build.py (cc -O3 -march=native -fopenmp, with
 * fallbacks) and called through ctypes by pdserve/sampling_cpu.py. Plain C with GCC vector
 * extensions: any x86-64 (or other) target builds it, at its own vector width.
 *
 * Why: the torch path converts a [rows, vocab] bf16 tensor to fp32, then runs a logsumexp per
 * 256-token block and two argmaxes, each a separate pass over memory (16 x 49152 logits: ~4 ms a
 * decode step in the serving profile, 8% of the step). Here each row is read once, in 256-token
 * blocks that stay in L1.
 *
 * Race (Gumbel-max in two levels; see pdserve/sampling.py for the derivation and sources): for
 * row r with temperature t (logits divided by t, as the torch path does) and noise g [nb + B]
 * (B = block, nb = ceil(vocab / B)): key_b = logsumexp(x[bB .. bB + B) / t) + g[b] picks block b
 * (the first maximal key; a block whose logits are all -inf never wins), then
 * argmax_j x[bB + j] / t + g[nb + j] over that block's tokens picks the token. Positions past
 * the vocabulary in the last block count as -inf. logsumexp = m + log(sum exp(v - m)), m the
 * block's max, exp by vec_math.h's polynomial (relative error ~2e-7): the keys differ from torch's
 * by rounding only, so a seeded draw can differ from the torch path's only where two keys tie
 * to within that rounding.
 *
 * Argmax: the first index of the row's maximum, NaN counting as maximal (torch's convention).
 */
#include "vec_math.h"

#define MAX_BLOCK 4096 /* largest race block (floats of a row kept on the stack) */

enum { PD_F32 = 0, PD_BF16 = 1 };

/* n logits of one row from src (fp32 or bf16 bits), divided by t, into dst; dst[n .. to) = -inf */
static void load_row(const void *src, int dtype, int64_t n, int64_t to, float t, float *dst) {
    if (dtype == PD_BF16) {
        const uint16_t *h = src;
        for (int64_t j = 0; j < n; j++) {
            const uint32_t w = (uint32_t)h[j] << 16;
            float f;
            memcpy(&f, &w, 4);
            dst[j] = f / t;
        }
    } else {
        const float *f = src;
        for (int64_t j = 0; j < n; j++) dst[j] = f[j] / t;
    }
    for (int64_t j = n; j < to; j++) dst[j] = -INFINITY;
}

/* lane-wise max; a NaN lane of a loses (NaN is handled apart where it matters) */
static inline vf vmax(vf a, vf b) { return vselect((vu32)(a > b), a, b); }

/* log(sum(exp(v))) over v[0 .. len), len a multiple of VW; -inf when every v is -inf */
static float block_lse(const float *v, int64_t len) {
    vf m = (vf){0} - INFINITY;
    for (int64_t j = 0; j < len; j += VW) {
        vf a;
        memcpy(&a, v + j, sizeof a);
        m = vmax(m, a);
    }
    float mx = m[0];
    for (int l = 1; l < VW; l++) mx = m[l] > mx ? m[l] : mx;
    if (mx == -INFINITY) return -INFINITY;
    vf s = (vf){0};
    for (int64_t j = 0; j < len; j += VW) {
        vf a;
        memcpy(&a, v + j, sizeof a);
        s += exp_nonpos_v(a - mx);
    }
    float sum = 0.0f;
    for (int l = 0; l < VW; l++) sum += s[l];
    return mx + logf(sum);
}

/* the first index of the maximum of v[0 .. n), NaN maximal; 0 for n == 0 */
static int64_t first_argmax(const float *v, int64_t n) {
    int64_t best = 0;
    for (int64_t j = 1; j < n; j++) {
        if (v[best] != v[best]) break; /* a NaN already wins */
        if (v[j] > v[best] || v[j] != v[j]) best = j;
    }
    return best;
}

/* Race for rows [0, rows) of x (row stride ldx elements; dtype PD_F32 or PD_BF16) over vocab
 * tokens: temps [rows] (> 0), noise [rows][ldn] fp32 (ldn >= nb + block), block a multiple of
 * the vector width in [VW, MAX_BLOCK]; token ids into out [rows]. Returns 0, or -1 for a bad
 * block or dtype. Rows are split over num_threads OpenMP threads. */
int pd_race(const void *x, int dtype, int64_t rows, int64_t vocab, int64_t ldx,
            const float *temps, const float *noise, int64_t ldn, int64_t block, int64_t *out,
            int num_threads) {
    if (block < VW || block > MAX_BLOCK || block % VW || (dtype != PD_F32 && dtype != PD_BF16))
        return -1;
    const int64_t es = dtype == PD_BF16 ? 2 : 4, nb = (vocab + block - 1) / block;
    (void)num_threads;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        float v[MAX_BLOCK] __attribute__((aligned(64)));
        const char *row = (const char *)x + r * ldx * es;
        const float *g = noise + r * ldn;
        float best_key = -INFINITY;
        int64_t best = -1;
        for (int64_t b = 0; b < nb; b++) {
            const int64_t n = vocab - b * block < block ? vocab - b * block : block;
            load_row(row + b * block * es, dtype, n, block, temps[r], v);
            const float lse = block_lse(v, block);
            const float key = lse + g[b];
            if (lse != -INFINITY && (best < 0 || key > best_key)) {
                best_key = key;
                best = b;
            }
        }
        if (best < 0) best = 0; /* no finite logit (the caller's contract excludes it) */
        const int64_t n = vocab - best * block < block ? vocab - best * block : block;
        load_row(row + best * block * es, dtype, n, n, temps[r], v);
        for (int64_t j = 0; j < n; j++) v[j] += g[nb + j];
        out[r] = best * block + first_argmax(v, n);
    }
    return 0;
}

/* argmax of each row of x (row stride ldx; PD_F32 or PD_BF16) over its first cols entries into
 * out [rows]: the first maximal index, NaN maximal. Returns 0, or -1 for a bad dtype. */
int pd_argmax(const void *x, int dtype, int64_t rows, int64_t cols, int64_t ldx, int64_t *out,
              int num_threads) {
    if (dtype != PD_F32 && dtype != PD_BF16) return -1;
    const int64_t es = dtype == PD_BF16 ? 2 : 4;
    (void)num_threads;
#pragma omp parallel for schedule(static) num_threads(num_threads) if (num_threads > 1 && rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        float v[1024] __attribute__((aligned(64)));
        const char *row = (const char *)x + r * ldx * es;
        int64_t best = -1;
        float best_v = -INFINITY;
        for (int64_t c0 = 0; c0 < cols; c0 += 1024) {
            const int64_t n = cols - c0 < 1024 ? cols - c0 : 1024;
            load_row(row + c0 * es, dtype, n, (n + VW - 1) / VW * VW, 1.0f, v);
            /* the chunk's max by vectors (NaN lanes ignored), and whether it holds a NaN */
            vf m = (vf){0} - INFINITY;
            int nan = 0;
            vu32 nans = (vu32){0};
            for (int64_t j = 0; j < n; j += VW) {
                vf a;
                memcpy(&a, v + j, sizeof a);
                m = vmax(m, a);
                nans |= (vu32)(a != a);
            }
            for (int l = 0; l < VW; l++) nan |= nans[l] != 0;
            float mx = m[0];
            for (int l = 1; l < VW; l++) mx = m[l] > mx ? m[l] : mx;
            if (nan) { /* the first NaN wins the row */
                for (int64_t j = 0; j < n; j++)
                    if (v[j] != v[j]) {
                        best = c0 + j;
                        break;
                    }
                break;
            }
            if (best < 0 || mx > best_v) {
                int64_t j = 0;
                while (v[j] != mx) j++;
                best = c0 + j;
                best_v = mx;
            }
        }
        out[r] = best < 0 ? 0 : best;
    }
    return 0;
}
