/* A whole decode step's decoder layers in one call: Llama-family layers (RMSNorm, fused q|k|v,
 * RoPE, paged attention, output projection, SwiGLU MLP, residual adds) over a batch of decodes,
 * one token each, then the final norm.
 *
 * Compiled on first use by pdserve/attention/cpu_build.py (cc -O3 -march=native -fopenmp) and
 * called through ctypes by pdserve/model/cpu_decode.py, which checks every shape, pointer and
 * index before the call (the kernel trusts them).
 *
 * Why: a compiled decode step of SmolLM2-135M (30 layers) makes ~150 opaque calls (four linears
 * and the attention per layer) and ~150 generated elementwise loops, each a trip through Python
 * (the dispatcher, argument checks, ctypes, tensor allocation). Served on one core that was
 * ~9 ms of a ~50 ms bf16 step (py-spy of a decode worker under the main workload, session 17,
 * docs/benchmarks.md). Here the same work runs as one C loop: the matmuls go to the skinny GEMM
 * kernel (pdserve/model/cpu_kernels/skinny_gemm.c) and the attention to the paged decode kernel
 * (pdserve/attention/cpu_kernels/paged_decode.c) through function pointers the caller passes,
 * and the small elementwise steps between them are plain loops here.
 *
 * Numerics: those of the eager PyTorch model (pdserve/model/layers.py), which the compiled model
 * also keeps (inductor's emulate_precision_casts): in bf16, every operation rounds its result to
 * bf16 (round to nearest even) where eager rounds, i.e.
 *   RMSNorm:   y = bf16(w * bf16(x * rsqrt(mean(x^2) + eps)))   (statistics in fp32)
 *   RoPE:      y = bf16(bf16(x * cos) + bf16(roll(x, D/2) * sin))   (sin signed, as the table)
 *   SwiGLU:    y = bf16(bf16(silu(g)) * u),  silu(g) = g / (1 + exp(-g)) in fp32
 *   residual:  x = bf16(x + f(x))
 * and fp32 has no roundings at all. Sums run in another order than torch's (the RMSNorm mean),
 * so results match eager's to fp32 rounding, or in bf16 to an occasional one-step difference.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../../cpu_kernels/vec_math.h"

enum { DL_F32 = 0, DL_BF16 = 1 };

typedef uint16_t vh __attribute__((vector_size(VW * 2)));

/* the skinny GEMM (pd_skinny_gemm_f32 / _bf16): y[m, n] = x[m, k] @ W^T + bias */
typedef int (*linear_fn)(const void *x, int64_t m, int64_t k, int64_t ldx, const void *packed,
                         int64_t n, const void *bias, void *y, int64_t ldy, int num_threads);
/* the paged decode attention (pd_paged_decode) */
typedef int (*attend_fn)(const void *q, int64_t q_tok_stride, int64_t q_head_stride, int q_dtype,
                         const void *k, const void *v, int64_t blk_stride, int kv_dtype,
                         const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                         const int64_t *rows, void *out, int64_t o_tok_stride,
                         int64_t o_head_stride, int num_decodes, int heads, int kv_heads,
                         int head_dim, int block_size, float scale, int num_splits,
                         int num_threads);

/* One decoder layer's weights and KV caches (pointers into tensors the caller keeps alive). */
typedef struct {
    const void *input_norm, *post_norm; /* [hidden] */
    const void *qkv, *qkv_bias;         /* panels of [(heads + 2 kv_heads) D, hidden]; bias/NULL */
    const void *o, *o_bias;             /* panels of [hidden, heads D]; bias or NULL */
    const void *gate_up, *down;         /* panels of [2 I, hidden], [hidden, I] */
    void *k_cache, *v_cache;            /* [num_blocks, block_size, kv_heads, D] */
} DlLayer;

/* The model's shapes and the two kernels. */
typedef struct {
    int dtype; /* DL_F32 or DL_BF16: activations, weights and KV caches */
    int hidden, heads, kv_heads, head_dim, intermediate, block_size, num_layers;
    int64_t blk_stride; /* elements from one cache block to the next */
    float eps, scale;
    linear_fn linear;
    attend_fn attend;
    const DlLayer *layers;
    const void *final_norm; /* [hidden] */
} DlModel;

/* ---- element access: fp32 lanes from either dtype, and back with bf16 rounding ------------ */

ALWAYS_INLINE vf load_v(const void *p, int64_t i, int dt) {
    if (dt == DL_F32) {
        vf x;
        memcpy(&x, (const float *)p + i, sizeof x);
        return x;
    }
    vh h;
    memcpy(&h, (const uint16_t *)p + i, sizeof h);
    vu32 w = __builtin_convertvector(h, vu32) << 16;
    vf x;
    memcpy(&x, &w, sizeof x);
    return x;
}

/* fp32 lanes -> bf16 bits, round to nearest even; NaN stays a (quiet) NaN */
ALWAYS_INLINE vu32 bf16_bits(vf x) {
    vu32 u;
    memcpy(&u, &x, sizeof u);
    const vu32 rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    const vu32 nan = (vu32)((u & 0x7fffffffu) > 0x7f800000u);
    return (nan & ((u >> 16) | 0x40u)) | (~nan & rounded);
}

/* x rounded as the dtype holds it (bf16: to the nearest bf16, kept as fp32 lanes) */
ALWAYS_INLINE vf round_v(vf x, int dt) {
    if (dt == DL_F32) return x;
    vu32 w = bf16_bits(x) << 16;
    memcpy(&x, &w, sizeof x);
    return x;
}

ALWAYS_INLINE void store_v(void *p, int64_t i, vf x, int dt) {
    if (dt == DL_F32) {
        memcpy((float *)p + i, &x, sizeof x);
        return;
    }
    const vh h = __builtin_convertvector(bf16_bits(x), vh);
    memcpy((uint16_t *)p + i, &h, sizeof h);
}

/* one element: the scalar twins of load_v, round_v and store_v, for the tails of the loops */
static inline float load1(const void *p, int64_t i, int dt) {
    if (dt == DL_F32) return ((const float *)p)[i];
    const uint32_t w = (uint32_t)((const uint16_t *)p)[i] << 16;
    float x;
    memcpy(&x, &w, sizeof x);
    return x;
}

static inline uint16_t bf16_bits1(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline float round1(float x, int dt) {
    if (dt == DL_F32) return x;
    const uint32_t w = (uint32_t)bf16_bits1(x) << 16;
    memcpy(&x, &w, sizeof x);
    return x;
}

static inline void store1(void *p, int64_t i, float x, int dt) {
    if (dt == DL_F32)
        ((float *)p)[i] = x;
    else
        ((uint16_t *)p)[i] = bf16_bits1(x);
}

/* ---- the elementwise steps: vectors of VW, then one element at a time ---------------------- */

/* out[r] = RMSNorm(x[r]) with weight w, rows of n */
static void rms_norm(const void *x, const void *w, void *out, int64_t rows, int n, float eps,
                     int dt) {
    for (int64_t r = 0; r < rows; r++) {
        const int64_t o = r * n;
        const int nv = n - n % VW;
        vf ss = {0};
        for (int i = 0; i < nv; i += VW) {
            const vf v = load_v(x, o + i, dt);
            ss += v * v;
        }
        float s = 0.0f;
        for (int l = 0; l < VW; l++) s += ss[l];
        for (int i = nv; i < n; i++) s += load1(x, o + i, dt) * load1(x, o + i, dt);
        const float inv = 1.0f / sqrtf(s / (float)n + eps);
        for (int i = 0; i < nv; i += VW) {
            const vf y = round_v(load_v(x, o + i, dt) * inv, dt);
            store_v(out, o + i, load_v(w, i, dt) * y, dt);
        }
        for (int i = nv; i < n; i++)
            store1(out, o + i, load1(w, i, dt) * round1(load1(x, o + i, dt) * inv, dt), dt);
    }
}

/* x[r] += f[r] (the residual add), rows of n */
static void add_rows(void *x, const void *f, int64_t rows, int n, int dt) {
    const int64_t all = rows * n, nv = all - all % VW;
    for (int64_t i = 0; i < nv; i += VW) store_v(x, i, load_v(x, i, dt) + load_v(f, i, dt), dt);
    for (int64_t i = nv; i < all; i++) store1(x, i, load1(x, i, dt) + load1(f, i, dt), dt);
}

/* RoPE in the rotate-half layout of pdserve/model/layers.py: heads of D (even) at src (rows
 * src_ld elements apart) rotated into dst (rows dst_ld apart), row r by
 * rope[r] = [cos (D) | signed sin (D)] */
static void rotate(const void *src, int64_t src_ld, void *dst, int64_t dst_ld, const void *rope,
                   int64_t rows, int heads, int D, int dt) {
    const int half = D / 2;
    for (int64_t r = 0; r < rows; r++)
        for (int h = 0; h < heads; h++) {
            const int64_t s = r * src_ld + (int64_t)h * D, d = r * dst_ld + (int64_t)h * D;
            const int64_t c = r * 2 * (int64_t)D;
            int i = 0;
            if (half % VW == 0) /* no vector straddles the two halves */
                for (; i < D; i += VW) {
                    const int j = i < half ? i + half : i - half; /* roll by D / 2 */
                    const vf a = round_v(load_v(src, s + i, dt) * load_v(rope, c + i, dt), dt);
                    const vf b =
                        round_v(load_v(src, s + j, dt) * load_v(rope, c + D + i, dt), dt);
                    store_v(dst, d + i, a + b, dt);
                }
            for (; i < D; i++) {
                const int j = i < half ? i + half : i - half;
                const float a = round1(load1(src, s + i, dt) * load1(rope, c + i, dt), dt);
                const float b = round1(load1(src, s + j, dt) * load1(rope, c + D + i, dt), dt);
                store1(dst, d + i, a + b, dt);
            }
        }
}

/* out[r] = silu(gu[r, :I]) * gu[r, I:] */
static void silu_mul(const void *gu, void *out, int64_t rows, int I, int dt) {
    const int iv = I - I % VW;
    for (int64_t r = 0; r < rows; r++) {
        for (int i = 0; i < iv; i += VW) {
            const vf g = load_v(gu, r * 2 * I + i, dt);
            const vf a = round_v(g / (1.0f + exp_clamped_v(-g)), dt);
            store_v(out, r * I + i, a * load_v(gu, r * 2 * I + I + i, dt), dt);
        }
        for (int i = iv; i < I; i++) {
            const float g = load1(gu, r * 2 * I + i, dt);
            const float a = round1(g / (1.0f + expf(-g)), dt);
            store1(out, r * I + i, a * load1(gu, r * 2 * I + I + i, dt), dt);
        }
    }
}

/* k, v rows [rows, kv_heads * D] into the caches at their slots (slot = block * block_size +
 * offset) */
static void write_kv(const DlModel *m, const DlLayer *L, const char *k, int64_t k_ld,
                     const char *v, int64_t v_ld, const int64_t *slots, int64_t rows) {
    const int64_t es = m->dtype == DL_F32 ? 4 : 2, row = (int64_t)m->kv_heads * m->head_dim;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t blk = slots[r] / m->block_size, off = slots[r] % m->block_size;
        const int64_t at = (blk * m->blk_stride + off * row) * es;
        memcpy((char *)L->k_cache + at, k + r * k_ld * es, (size_t)(row * es));
        memcpy((char *)L->v_cache + at, v + r * v_ld * es, (size_t)(row * es));
    }
}

/* ---- entry point ---------------------------------------------------------------------------- */

/* Every decoder layer and the final norm for B decodes (one token each), in place:
 *
 * x:      [B, hidden] in the model dtype: the token embeddings on entry, the final-norm hidden
 *         states on return.
 * rope:   [B, 2, head_dim]: each token's cos row and signed-sin row (RotaryEmbedding's table).
 * slots:  int64 [B] pool slot of each token's new K/V.
 * tables, table_stride, seq_lens: the decode kernel's int32 block tables [B, table_stride] and
 *         context lengths [B] (the new token included).
 * num_splits, attend_threads: the decode kernel's split-K and threads; threads: the GEMMs'.
 *
 * Returns 0; -1 when scratch memory cannot be allocated; -2 when a kernel fails (the skinny GEMM's
 * or the attention's scratch allocation). x is then partly updated and the caches may hold some
 * layers' new K/V for these slots: nothing reads them before a step that computes these tokens
 * again rewrites them.
 */
int pd_decode_layers(const DlModel *m, void *x, int64_t B, const void *rope, const int64_t *slots,
                     const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                     int num_splits, int attend_threads, int threads) {
    const int dt = m->dtype, H = m->hidden, D = m->head_dim, I = m->intermediate;
    const int64_t es = dt == DL_F32 ? 4 : 2;
    const int64_t q_n = (int64_t)m->heads * D, kv_n = (int64_t)m->kv_heads * D;
    const int64_t qkv_n = q_n + 2 * kv_n;
    /* scratch: xn [B, max(H, I)], qkv [B, qkv_n], qr [B, q_n], kr [B, kv_n], att [B, q_n],
     * gu [B, max(2 I, H)] (gate|up, then the down projection's output); each 64-byte aligned */
    const int64_t wide = H > I ? H : I, gu_n = 2 * (int64_t)I > H ? 2 * (int64_t)I : H;
    const int64_t sizes[6] = {B * wide, B * qkv_n, B * q_n, B * kv_n, B * q_n, B * gu_n};
    int64_t total = 0, offs[6];
    for (int i = 0; i < 6; i++) {
        offs[i] = total;
        total += (sizes[i] * es + 63) / 64 * 64;
    }
    char *scratch = aligned_alloc(64, (size_t)(total > 0 ? total : 64));
    if (!scratch) return -1;
    char *xn = scratch + offs[0], *qkv = scratch + offs[1], *qr = scratch + offs[2];
    char *kr = scratch + offs[3], *att = scratch + offs[4], *gu = scratch + offs[5];
    int rc = 0;
    for (int li = 0; li < m->num_layers && rc == 0; li++) {
        const DlLayer *L = &m->layers[li];
        /* attention block: x += o_proj(attend(rope(q), rope(k), v)) */
        rms_norm(x, L->input_norm, xn, B, H, m->eps, dt);
        if (m->linear(xn, B, H, H, L->qkv, qkv_n, L->qkv_bias, qkv, qkv_n, threads)) {
            rc = -2;
            break;
        }
        rotate(qkv, qkv_n, qr, q_n, rope, B, m->heads, D, dt);
        rotate(qkv + q_n * es, qkv_n, kr, kv_n, rope, B, m->kv_heads, D, dt);
        write_kv(m, L, kr, kv_n, qkv + (q_n + kv_n) * es, qkv_n, slots, B);
        if (m->attend(qr, q_n, D, dt, L->k_cache, L->v_cache, m->blk_stride, dt, tables,
                      table_stride, seq_lens, NULL, att, q_n, D, (int)B, m->heads, m->kv_heads, D,
                      m->block_size, m->scale, num_splits, attend_threads) ||
            m->linear(att, B, q_n, q_n, L->o, H, L->o_bias, xn, H, threads)) {
            rc = -2;
            break;
        }
        add_rows(x, xn, B, H, dt);
        /* MLP block: x += down(silu(gate(n)) * up(n)), n = norm(x) */
        rms_norm(x, L->post_norm, xn, B, H, m->eps, dt);
        if (m->linear(xn, B, H, H, L->gate_up, 2 * (int64_t)I, NULL, gu, 2 * (int64_t)I,
                      threads)) {
            rc = -2;
            break;
        }
        silu_mul(gu, xn, B, I, dt);
        if (m->linear(xn, B, I, I, L->down, H, NULL, gu, H, threads)) {
            rc = -2;
            break;
        }
        add_rows(x, gu, B, H, dt);
    }
    if (rc == 0) {
        rms_norm(x, m->final_norm, xn, B, H, m->eps, dt);
        memcpy(x, xn, (size_t)(B * H * es));
    }
    free(scratch);
    return rc;
}
