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
#define _GNU_SOURCE /* SCHED_IDLE */
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__linux__)
#include <linux/futex.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#else
#define CPU_RELAX() ((void)0)
#endif

#include "../../cpu_kernels/vec_math.h"

enum { DL_F32 = 0, DL_BF16 = 1 };

typedef uint16_t vh __attribute__((vector_size(VW * 2)));

/* the skinny GEMM (pd_skinny_gemm): y[m, n] = x[m, k] @ W^T + bias, W in weight format fmt (the
 * kernel's SK_* codes: 0 fp32 panels, 1 bf16 panels, 2 and 3 fp32 weights held as codes; x, bias
 * and y are bf16 for 1, else fp32) */
typedef int (*linear_fn)(int fmt, const void *x, int64_t m, int64_t k, int64_t ldx,
                         const void *packed, int64_t n, const void *bias, void *y, int64_t ldy,
                         int num_threads);
/* the same GEMM in two halves (pd_skinny_prepare, pd_skinny_panels): x copied once, then any
 * caller computes any range of 16-column panels from the copy */
typedef int (*prepare_fn)(int dtype, const void *x, int64_t m, int64_t k, int64_t ldx,
                          void *prep);
typedef int (*panels_fn)(int dtype, int path, const void *prep, int64_t m, int64_t k,
                         const void *packed, int64_t n, const void *bias, void *y, int64_t ldy,
                         int64_t p0, int64_t p1);
typedef int64_t (*prep_bytes_fn)(int64_t m, int64_t k);
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
    int qkv_fmt, o_fmt, gate_up_fmt, down_fmt; /* each linear's weight format (see linear_fn) */
} DlLayer;

/* The model's shapes and the two kernels. */
typedef struct {
    int dtype; /* DL_F32 or DL_BF16: activations, weights and KV caches */
    int hidden, heads, kv_heads, head_dim, intermediate, block_size, num_layers;
    int64_t blk_stride; /* elements from one cache block to the next */
    float eps, scale;
    linear_fn linear;
    prepare_fn prepare;
    panels_fn panels;
    prep_bytes_fn prep_bytes;
    attend_fn attend;
    const DlLayer *layers;
    const void *final_norm; /* [hidden] */
    const void *lm_head;    /* panels of [vocab, hidden], or NULL (the caller computes logits) */
    int vocab;
    int lm_head_fmt;
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

/* ---- the idle-core helper -------------------------------------------------------------------
 *
 * A decode step of a small model streams its weights and KV once per step, at the rate one core
 * pulls from memory (~14 GB/s on the AMX Xeon of docs/benchmarks.md); two cores pull twice that
 * (two decode processes at once each ran within 7% of one alone, session 18). A served worker's
 * step runs on one thread, while the machine's other CPUs run the prefill worker, the router and
 * the clients, idle for part of every second (~0.56 of the second CPU during the main workload,
 * session 18). So the step hands each matmul's 16-column panel ranges and the attention's
 * sequences out as chunks that the step's own thread and one helper thread claim in turn (a
 * shared counter), the helper at SCHED_IDLE priority: Linux runs it only on a CPU that nothing
 * else wants, and preempts it the moment something does.
 *
 * The step never waits on the helper beyond a chunk's time. The helper computes a chunk into a
 * private mirror of the output and publishes it done; the step copies done chunks over, and
 * takes back (recomputes itself) any chunk the helper claimed but has not finished within about
 * twice the time the step's own chunks took. Each chunk's state carries the op's sequence number,
 * so a helper that was preempted in an older op can neither claim nor publish into a newer one;
 * everything it may still read or write (the operand copies, queries, block tables and the mirror)
 * lives in the context (DlContext) for the context's whole life, and freeing a context waits until
 * the helper has left every op of it. This is work sharing with takeover, the "work-first"
 * discipline of Cilk (Frigo, Leiserson, Randall, PLDI 1998) turned so the owner never blocks on
 * the thief. */

enum { JOB_LINEAR = 1, JOB_ATTEND = 2 };
enum { CH_FREE = 0, CH_MAIN = 1, CH_HELPER = 2, CH_DONE = 3 }; /* low 2 bits of a chunk state */
#define MAX_CHUNKS 1024
#define CHUNK_BYTES (96 * 1024) /* weight bytes per matmul chunk: ~7 us at 14 GB/s */
#define HELPER_SPIN_NS 300000   /* an idle helper spins this long before it sleeps */
/* A step shares an op only when the helper ran this recently (its beat_ns): longer than a chunk
 * takes (~5-30 us), far shorter than a time slice the helper waits for when another thread has
 * its CPU (see helper_on_cpu) */
#define HELPER_FRESH_NS 100000
#define HELPER_THREAD_NAME "pdserve-helper"
#define TAG(seq, st) ((seq) << 2 | (uint64_t)(st))

/* One op split in chunks: a matmul's panel ranges or the attention's sequence ranges. */
typedef struct {
    int kind, nchunks, dtype, path;
    int64_t per, es;
    /* JOB_LINEAR: y[m, n] (row stride ldy) = prep's x @ W^T + bias in chunks of rows_per rows
     * (a multiple of the skinny kernel's row block, or all m) by per panels: chunk c is panel
     * group c % groups of row block c / groups */
    const void *prep, *packed, *bias;
    int64_t m, k, n, ldy, rows_per, groups;
    panels_fn panels;
    /* JOB_ATTEND: decodes [c per, (c+1) per) of q [B, heads, D] -> out rows */
    const void *q, *k_cache, *v_cache;
    const int32_t *tables, *seq_lens;
    int64_t table_stride;
    const DlModel *model;
    void *y;      /* the output (the step's thread writes here) */
    void *mirror; /* the helper's copy of the output, same offsets */
} Job;

typedef struct {
    pthread_mutex_t lock; /* held by the step using the helper (others run without it) */
    _Atomic int started;  /* 1: the helper runs; -1: it could not be started; 0: not yet */
    _Atomic uint64_t seq; /* seqlock over job: odd while the step writes it */
    Job job;
    _Atomic int next;     /* the next chunk to claim */
    _Atomic uint64_t state[MAX_CHUNKS];
    _Atomic int64_t claim_ns[MAX_CHUNKS];
    _Atomic uint64_t in_op;   /* the seq of the op the helper is inside, 0 outside any */
    _Atomic int active;       /* a step is running: spin, do not sleep */
    _Atomic uint32_t wake;    /* futex word, bumped when a step starts */
    _Atomic int64_t beat_ns;  /* when the helper last ran: spinning for work, or a chunk done */
    _Atomic uint64_t chunks_helper, chunks_taken_back; /* counters (pd_decode_helper_stats) */
    _Atomic uint64_t ops_shared, ops_alone; /* a step's ops by share_op (pd_decode_helper_ops) */
    _Atomic int64_t delay_ns; /* tests: the helper naps this long after each claim */
} Pool;

static Pool pool = {.lock = PTHREAD_MUTEX_INITIALIZER};
static pthread_mutex_t pool_start_lock = PTHREAD_MUTEX_INITIALIZER;

static inline int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static void helper_sleep(uint32_t seen) {
#if defined(__linux__)
    const struct timespec limit = {0, 50000000}; /* re-check now and then regardless */
    syscall(SYS_futex, &pool.wake, FUTEX_WAIT_PRIVATE, seen, &limit, NULL, 0);
#else
    (void)seen;
    const struct timespec t = {0, 200000};
    nanosleep(&t, NULL);
#endif
}

static void helper_wake(void) {
    atomic_fetch_add(&pool.wake, 1);
#if defined(__linux__)
    syscall(SYS_futex, &pool.wake, FUTEX_WAKE_PRIVATE, 1, NULL, NULL, 0);
#endif
}

/* Chunk c of job j into dst (j->y or j->mirror). Returns 0, or a kernel's nonzero code. */
static int run_chunk(const Job *j, int c, char *dst) {
    if (j->kind == JOB_LINEAR) {
        const int64_t r0 = c / j->groups * j->rows_per, lo = c % j->groups * j->per;
        const int64_t rows = j->m - r0 < j->rows_per ? j->m - r0 : j->rows_per;
        const int64_t panels = (j->n + 15) / 16, hi = lo + j->per < panels ? lo + j->per : panels;
        /* the operand copy keeps row blocks whole and in order: rows from r0 start r0 k elements
         * in */
        return j->panels(j->dtype, j->path, (const char *)j->prep + r0 * j->k * j->es, rows, j->k,
                         j->packed, j->n, j->bias, dst + r0 * j->ldy * j->es, j->ldy, lo, hi);
    }
    const int64_t lo = c * j->per;
    const DlModel *m = j->model;
    const int64_t hi = lo + j->per < j->m ? lo + j->per : j->m;
    const int64_t q_n = (int64_t)m->heads * m->head_dim;
    return m->attend((const char *)j->q + lo * q_n * j->es, q_n, m->head_dim, j->dtype, j->k_cache,
                     j->v_cache, m->blk_stride, j->dtype, j->tables + lo * j->table_stride,
                     j->table_stride, j->seq_lens + lo, NULL, dst + lo * q_n * j->es, q_n,
                     m->head_dim, (int)(hi - lo), m->heads, m->kv_heads, m->head_dim,
                     m->block_size, m->scale, 1, 1);
}

/* Chunk c's outputs from the helper's mirror into the output. */
static void copy_chunk(const Job *j, int c) {
    if (j->kind == JOB_LINEAR) {
        const int64_t r0 = c / j->groups * j->rows_per, lo = c % j->groups * j->per;
        const int64_t r1 = r0 + j->rows_per < j->m ? r0 + j->rows_per : j->m;
        const int64_t c0 = lo * 16, c1 = (lo + j->per) * 16 < j->n ? (lo + j->per) * 16 : j->n;
        for (int64_t r = r0; r < r1; r++) {
            const int64_t at = (r * j->ldy + c0) * j->es;
            memcpy((char *)j->y + at, (const char *)j->mirror + at, (size_t)((c1 - c0) * j->es));
        }
        return;
    }
    const int64_t lo = c * j->per, hi = lo + j->per < j->m ? lo + j->per : j->m;
    const int64_t row = (int64_t)j->model->heads * j->model->head_dim * j->es;
    memcpy((char *)j->y + lo * row, (const char *)j->mirror + lo * row, (size_t)((hi - lo) * row));
}

/* The helper's scheduling: -1 (the default) SCHED_IDLE, else SCHED_OTHER at this niceness
 * (pd_helper_set_nice). */
static _Atomic int helper_nice = -1;

/* The calling thread (the helper) to scheduling `nice` (as helper_nice); best effort. */
static void apply_priority(int nice) {
#if defined(__linux__) && defined(SCHED_IDLE)
    struct sched_param none = {0};
    if (nice < 0) {
        pthread_setschedparam(pthread_self(), SCHED_IDLE, &none);
        return;
    }
    pthread_setschedparam(pthread_self(), SCHED_OTHER, &none);
    setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), nice);
#else
    (void)nice;
#endif
}

static void *helper_main(void *arg) {
    (void)arg;
#if defined(__linux__)
    pthread_setname_np(pthread_self(), HELPER_THREAD_NAME); /* pdserve/engine/actor.py skips it */
#endif
    int nice = atomic_load(&helper_nice);
    apply_priority(nice);
    uint64_t seen = 0;
    int64_t idle_since = now_ns();
    for (;;) {
        const int want = atomic_load(&helper_nice);
        if (want != nice) apply_priority(nice = want);
        const uint32_t w = atomic_load(&pool.wake);
        const uint64_t s = atomic_load(&pool.seq);
        if (s == seen || (s & 1)) {
            if (atomic_load(&pool.active)) {
                idle_since = now_ns();
                atomic_store_explicit(&pool.beat_ns, idle_since, memory_order_relaxed);
            } else if (nice >= 0 || now_ns() - idle_since > HELPER_SPIN_NS) {
                /* a helper that competes for its CPU (nice >= 0) spins only inside an op: its
                 * spinning would take time from the threads it shares the CPU with */
                helper_sleep(w);
                idle_since = now_ns();
                continue;
            }
            CPU_RELAX();
            continue;
        }
        /* enter op s: announce it first, then read the job and check it is still op s, so a
         * context free (which bumps seq, then waits for in_op to leave older ops) cannot miss
         * us (both sides sequentially consistent) */
        atomic_store(&pool.in_op, s);
        Job j;
        memcpy(&j, &pool.job, sizeof j);
        atomic_thread_fence(memory_order_acquire); /* the job's bytes before the re-check */
        if (atomic_load(&pool.seq) != s) {
            atomic_store(&pool.in_op, 0);
            continue;
        }
        seen = s;
        while (j.kind && atomic_load(&pool.seq) == s) {
            const int c = atomic_fetch_add(&pool.next, 1);
            if (c >= j.nchunks) break;
            atomic_store(&pool.claim_ns[c], now_ns());
            uint64_t want = TAG(s, CH_FREE);
            if (!atomic_compare_exchange_strong(&pool.state[c], &want, TAG(s, CH_HELPER)))
                continue;
            const int64_t nap = atomic_load(&pool.delay_ns);
            if (nap > 0) {
                const struct timespec t = {nap / 1000000000, nap % 1000000000};
                nanosleep(&t, NULL);
            }
            const int rc = run_chunk(&j, c, j.mirror);
            want = TAG(s, CH_HELPER);
            /* done, or (a kernel failed) back to free so the step runs it and sees the error */
            if (atomic_compare_exchange_strong(&pool.state[c], &want,
                                               TAG(s, rc == 0 ? CH_DONE : CH_FREE)) &&
                rc == 0)
                atomic_fetch_add(&pool.chunks_helper, 1);
            atomic_store_explicit(&pool.beat_ns, now_ns(), memory_order_relaxed);
        }
        atomic_store(&pool.in_op, 0);
        idle_since = now_ns();
    }
    return NULL;
}

/* In a child of fork(): the helper thread was not copied, and a lock may have been copied held.
 * Start over (a new helper on the child's first step). */
static void pool_after_fork(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool_start_lock, NULL);
    atomic_store(&pool.in_op, 0);
    atomic_store(&pool.active, 0);
    atomic_store(&pool.started, 0);
}

/* Start the helper once per process. Returns 1 when it runs. */
static int pool_start(void) {
    if (atomic_load(&pool.started) != 0) return atomic_load(&pool.started) == 1;
    pthread_mutex_lock(&pool_start_lock);
    static int atfork_registered = 0;
    if (!atfork_registered) atfork_registered = pthread_atfork(NULL, NULL, pool_after_fork) == 0;
    if (atomic_load(&pool.started) == 0) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        /* no signals for the helper: they go to the process's own threads */
        sigset_t all, old;
        sigfillset(&all);
        pthread_sigmask(SIG_SETMASK, &all, &old);
        atomic_store(&pool.started, pthread_create(&t, &attr, helper_main, NULL) == 0 ? 1 : -1);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        pthread_attr_destroy(&attr);
    }
    pthread_mutex_unlock(&pool_start_lock);
    return atomic_load(&pool.started) == 1;
}

/* Whether the helper is running on a CPU now (it ran within HELPER_FRESH_NS). A step shares an
 * op only then: sharing costs the step's own thread even when the helper takes no chunk (the
 * operand copy for chunk calls, chunks that restart the weight prefetch, the attention one
 * sequence a call without the next one's prefetch), and a SCHED_IDLE helper beside a busy CPU
 * gets a slice now and then, claims a chunk and is preempted inside it. Measured: a decode step of
 * 16 at context 300 (SmolLM2 bf16, one thread, Zen 5 EPYC) beside a prefill process on the other
 * CPU took 22.3-23.1 ms sharing every op against 20.5 ms without the helper, the helper computing
 * ~22 of ~1700 chunks a step (docs/benchmarks.md, session 33). */
static inline int helper_on_cpu(void) {
    return now_ns() - atomic_load_explicit(&pool.beat_ns, memory_order_relaxed) < HELPER_FRESH_NS;
}

/* Publish job j (the step holds pool.lock). Returns its seq. */
static uint64_t publish(const Job *j) {
    const uint64_t s = atomic_load(&pool.seq);
    atomic_store(&pool.seq, s + 1);
    atomic_thread_fence(memory_order_release); /* the odd seq before the job's bytes */
    memcpy(&pool.job, j, sizeof *j);
    /* relaxed: the even seq below releases them all */
    for (int c = 0; c < j->nchunks; c++)
        atomic_store_explicit(&pool.state[c], TAG(s + 2, CH_FREE), memory_order_relaxed);
    atomic_store_explicit(&pool.next, 0, memory_order_relaxed);
    atomic_store(&pool.seq, s + 2);
    return s + 2;
}

/* Run job j with the helper: claim chunks until none is left, then settle each chunk the
 * helper holds (copy it when done, take it back when it is late). Returns 0 or a kernel's
 * code. */
static int run_shared(const Job *j) {
    if (j->nchunks <= 1) return j->nchunks ? run_chunk(j, 0, j->y) : 0; /* nothing to share */
    const uint64_t s = publish(j);
    int rc = 0, own = 0;
    int64_t own_ns = 0;
    for (;;) {
        const int c = atomic_fetch_add(&pool.next, 1);
        if (c >= j->nchunks) break;
        uint64_t want = TAG(s, CH_FREE);
        if (!atomic_compare_exchange_strong(&pool.state[c], &want, TAG(s, CH_MAIN))) continue;
        const int64_t t0 = now_ns();
        rc |= run_chunk(j, c, j->y);
        own_ns += now_ns() - t0;
        own++;
    }
    /* a helper chunk is late after twice the mean of ours (or 50 us when we ran none) */
    const int64_t late = own ? 2 * own_ns / own + 2000 : 50000;
    for (int c = 0; c < j->nchunks; c++) {
        for (;;) {
            uint64_t st = atomic_load(&pool.state[c]);
            const int k = (int)(st & 3);
            if (k == CH_MAIN) break;
            if (k == CH_DONE) {
                copy_chunk(j, c);
                break;
            }
            if (k == CH_HELPER && now_ns() - atomic_load(&pool.claim_ns[c]) < late) {
                CPU_RELAX();
                continue;
            }
            /* free (claimed by a preempted helper's counter, or handed back), or late */
            if (atomic_compare_exchange_strong(&pool.state[c], &st, TAG(s, CH_MAIN))) {
                if (k == CH_HELPER) atomic_fetch_add(&pool.chunks_taken_back, 1);
                rc |= run_chunk(j, c, j->y);
                break;
            }
        }
    }
    return rc;
}

/* ---- a prefill matmul shared with the helper --------------------------------------------------
 *
 * A prefill's matmuls (hundreds to thousands of rows) run on the same protocol: chunks of
 * SHARED_ROW_BLOCK rows by a few panels, sized to ~SHARED_CHUNK_FLOPS (~0.25 ms at the ~30 GFLOP/s
 * one AVX2 core does), the row block kept in cache while its chunks sweep the panels. The
 * operand copy and the helper's mirror live in shared_bufs, used under pool.lock; they only grow,
 * and an outgrown buffer is kept (a preempted helper may still read or write it), so what they
 * hold is bounded by twice the largest call's needs. */

#define SHARED_ROW_BLOCK 96 /* a multiple of the skinny kernel's row block (6 with AVX2, 16) */
#define SHARED_CHUNK_FLOPS 8000000
#define MAX_RETIRED 64

static struct {
    char *prep, *mirror;
    int64_t prep_cap, mirror_cap;
    void *retired[MAX_RETIRED];
    int num_retired;
} shared_bufs;

/* *buf (of *cap bytes) at least want bytes. Returns 0, or -1 when memory runs out. */
static int grow_buf(char **buf, int64_t *cap, int64_t want) {
    if (want <= *cap) return 0;
    if (*buf && shared_bufs.num_retired == MAX_RETIRED) return -1;
    int64_t size = *cap ? *cap : 1 << 20;
    while (size < want) size *= 2;
    char *fresh = aligned_alloc(64, (size_t)((size + 63) / 64 * 64));
    if (!fresh) return -1;
    if (*buf) shared_bufs.retired[shared_bufs.num_retired++] = *buf;
    *buf = fresh;
    *cap = size;
    return 0;
}

/* y[m, n] (row stride ldy) = x[m, k] (row stride ldx) @ W^T + bias with the skinny kernel's
 * panels (packed), the helper computing chunks while the calling thread computes others, for
 * matmuls with more rows than a decode step's (m > 16). prepare, panels, prep_bytes: the kernel's
 * split entry points (pd_skinny_prepare, pd_skinny_panels, pd_skinny_prep_bytes); dtype: the
 * weight format (see linear_fn). Returns 0; 1 when the call was not run because the helper is
 * busy with another caller's op (a decode step, or another thread's matmul) or cannot be started:
 * the caller runs the matmul itself; -1 when the kernel does not take these shapes; -2 out of
 * memory. */
int pd_shared_linear(int dtype, prepare_fn prepare, panels_fn panels, prep_bytes_fn prep_bytes,
                     const void *x, int64_t m, int64_t k, int64_t ldx, const void *packed,
                     int64_t n, const void *bias, void *y, int64_t ldy) {
    if (m <= 16 || !pool_start() || pthread_mutex_trylock(&pool.lock) != 0) return 1;
    const int64_t es = dtype == DL_BF16 ? 2 : 4, npanels = (n + 15) / 16;
    int rc = 0;
    if (grow_buf(&shared_bufs.prep, &shared_bufs.prep_cap, prep_bytes(m, k)) ||
        grow_buf(&shared_bufs.mirror, &shared_bufs.mirror_cap, m * ldy * es)) {
        rc = -2;
    } else {
        const int path = prepare(dtype, x, m, k, ldx, shared_bufs.prep);
        const int64_t rows_per = SHARED_ROW_BLOCK, blocks = (m + rows_per - 1) / rows_per;
        int64_t per = SHARED_CHUNK_FLOPS / (2 * rows_per * 16 * k);
        if (per < 1) per = 1;
        while (blocks * ((npanels + per - 1) / per) > MAX_CHUNKS) per *= 2;
        const int64_t groups = (npanels + per - 1) / per;
        const Job j = {.kind = JOB_LINEAR, .nchunks = (int)(blocks * groups), .dtype = dtype,
                       .path = path, .per = per, .es = es, .prep = shared_bufs.prep,
                       .packed = packed, .bias = bias, .m = m, .k = k, .n = n, .ldy = ldy,
                       .rows_per = rows_per, .groups = groups, .panels = panels, .y = y,
                       .mirror = shared_bufs.mirror};
        if (path < 0) {
            rc = -1;
        } else {
            atomic_store(&pool.active, 1);
            helper_wake();
            rc = run_shared(&j);
            atomic_store(&pool.active, 0);
        }
    }
    pthread_mutex_unlock(&pool.lock);
    return rc;
}

/* The helper's scheduling from now on: nice < 0 SCHED_IDLE (the default: it runs only on a CPU
 * nothing else wants), else SCHED_OTHER at niceness nice (0 to 19), competing for CPU time with
 * the other threads of the machine by weight (Linux gives a thread at niceness n about 1.25^-n
 * the share of one at 0). */
void pd_helper_set_nice(int nice) { atomic_store(&helper_nice, nice < 0 ? -1 : nice > 19 ? 19 : nice); }

/* ---- the step's context: everything the helper may touch, alive until pd_decode_ctx_free ---- */

typedef struct {
    const DlModel *model;
    int64_t max_rows;
    char *scratch;      /* xn, qkv, qr, kr, att, gu: see pd_decode_layers */
    int64_t offs[6];
    char *prep;         /* the operand copy for the matmuls */
    char *mirror;       /* the helper's outputs */
    int32_t *tables;    /* the step's block tables [max_rows, table_cap] (stage_tables) */
    int32_t *seq_lens;  /* [max_rows], paired with tables */
    int64_t table_cap;
    void **retired;     /* outgrown tables, freed with the context (the helper may read them) */
    int num_retired;
    int helper;         /* use the idle-core helper */
    _Atomic int in_use; /* steps inside pd_decode_layers */
    _Atomic int dead;   /* freed: steps refuse to run (the struct itself is kept) */
} DlContext;

static int64_t max3(int64_t a, int64_t b, int64_t c) {
    const int64_t ab = a > b ? a : b;
    return ab > c ? ab : c;
}

/* A context for steps of model m with up to max_rows decodes, the helper on (helper != 0) or
 * off. Returns NULL when memory runs out (or max_rows < 1). */
DlContext *pd_decode_ctx_new(const DlModel *m, int64_t max_rows, int helper) {
    if (max_rows < 1 || max_rows > MAX_CHUNKS) return NULL; /* attention: a chunk a row */
    DlContext *ctx = calloc(1, sizeof *ctx);
    if (!ctx) return NULL;
    const int64_t es = m->dtype == DL_F32 ? 4 : 2, H = m->hidden, I = m->intermediate;
    const int64_t q_n = (int64_t)m->heads * m->head_dim, kv_n = (int64_t)m->kv_heads * m->head_dim;
    const int64_t qkv_n = q_n + 2 * kv_n, wide = H > I ? H : I;
    const int64_t gu_n = 2 * I > H ? 2 * I : H, B = max_rows;
    const int64_t sizes[6] = {B * wide, B * qkv_n, B * q_n, B * kv_n, B * q_n, B * gu_n};
    int64_t total = 0;
    for (int i = 0; i < 6; i++) {
        ctx->offs[i] = total;
        total += (sizes[i] * es + 63) / 64 * 64;
    }
    const int64_t out_n = max3(qkv_n, gu_n, m->lm_head ? m->vocab : 0);
    ctx->model = m;
    ctx->max_rows = B;
    ctx->helper = helper != 0;
    ctx->scratch = aligned_alloc(64, (size_t)total);
    ctx->prep = aligned_alloc(64, (size_t)m->prep_bytes(B, wide > q_n ? wide : q_n));
    ctx->mirror = aligned_alloc(64, (size_t)((B * out_n * es + 63) / 64 * 64));
    if (!ctx->scratch || !ctx->prep || !ctx->mirror) {
        free(ctx->scratch);
        free(ctx->prep);
        free(ctx->mirror);
        free(ctx);
        return NULL;
    }
    return ctx;
}

/* Free a context's buffers once no step runs in it and the helper has left every op that may
 * point into it. The small struct itself stays allocated (a call after the free finds it dead and
 * returns -3 instead of touching freed memory). Blocks for at most a step in flight plus the
 * helper's current chunk. */
void pd_decode_ctx_free(DlContext *ctx) {
    if (!ctx) return;
    const struct timespec nap = {0, 100000};
    if (atomic_exchange(&ctx->dead, 1)) return; /* freed before */
    while (atomic_load(&ctx->in_use)) nanosleep(&nap, NULL); /* a step in flight finishes */
    pthread_mutex_lock(&pool.lock);
    if (atomic_load(&pool.started) == 1) {
        /* a new (empty) op, then wait until the helper is in no older one */
        Job none;
        memset(&none, 0, sizeof none);
        const uint64_t s = publish(&none);
        for (;;) {
            const uint64_t in = atomic_load(&pool.in_op);
            if (in == 0 || in >= s) break;
            nanosleep(&nap, NULL);
        }
    }
    pthread_mutex_unlock(&pool.lock);
    for (int i = 0; i < ctx->num_retired; i++) free(ctx->retired[i]);
    free(ctx->retired);
    free(ctx->tables);
    free(ctx->scratch);
    free(ctx->prep);
    free(ctx->mirror);
    free(ctx->seq_lens);
    ctx->retired = NULL;
    ctx->tables = ctx->seq_lens = NULL;
    ctx->scratch = ctx->prep = ctx->mirror = NULL;
}

/* The helper's counters since the process started: chunks it computed, and chunks it had
 * claimed that the step took back (late). */
void pd_decode_helper_stats(uint64_t *helper_chunks, uint64_t *taken_back) {
    *helper_chunks = atomic_load(&pool.chunks_helper);
    *taken_back = atomic_load(&pool.chunks_taken_back);
}

/* The ops of shared steps since the process started: those shared with the helper, and those
 * run whole because the helper was not on a CPU (share_op). */
void pd_decode_helper_ops(uint64_t *shared, uint64_t *alone) {
    *shared = atomic_load(&pool.ops_shared);
    *alone = atomic_load(&pool.ops_alone);
}

/* Tests: make the helper nap ns nanoseconds after each chunk it claims (0: never), as if the OS
 * had preempted it, so the step takes chunks back. */
void pd_decode_helper_set_delay(int64_t ns) { atomic_store(&pool.delay_ns, ns); }

/* The step's block tables and lengths into the context, where the helper reads them. Every entry
 * of the staged tables is a valid block id at every moment (a sequence's used blocks, zeros past
 * them; the caller checked the used ones), and a tables buffer is only ever paired with its own
 * lengths buffer (both are replaced together when the tables outgrow their width), so a helper
 * still inside an op of an earlier step reads stale but in-bounds data. Returns 0, -1 when memory
 * runs out. */
static int stage_tables(DlContext *ctx, const int32_t *tables, int64_t table_stride,
                        const int32_t *seq_lens, int64_t B) {
    if (table_stride > ctx->table_cap) {
        int64_t cap = ctx->table_cap ? ctx->table_cap : 64;
        while (cap < table_stride) cap *= 2;
        int32_t *t = calloc((size_t)(ctx->max_rows * cap), sizeof(int32_t));
        int32_t *l = calloc((size_t)ctx->max_rows, sizeof(int32_t));
        void **r = realloc(ctx->retired, sizeof(void *) * (size_t)(ctx->num_retired + 2));
        if (r) ctx->retired = r;
        if (!t || !l || !r) {
            free(t);
            free(l);
            return -1;
        }
        if (ctx->tables) {
            ctx->retired[ctx->num_retired++] = ctx->tables;
            ctx->retired[ctx->num_retired++] = ctx->seq_lens;
        }
        ctx->tables = t;
        ctx->seq_lens = l;
        ctx->table_cap = cap;
    }
    const int64_t bs = ctx->model->block_size;
    for (int64_t i = 0; i < B; i++) {
        int32_t *row = ctx->tables + i * ctx->table_cap;
        int64_t used = (seq_lens[i] + bs - 1) / bs; /* <= table_stride (checked); clamped */
        used = used < 0 ? 0 : used > table_stride ? table_stride : used;
        memcpy(row, tables + i * table_stride, sizeof(int32_t) * (size_t)used);
        memset(row + used, 0, sizeof(int32_t) * (size_t)(ctx->table_cap - used));
    }
    memcpy(ctx->seq_lens, seq_lens, sizeof(int32_t) * (size_t)B);
    return 0;
}

/* ---- the ops of a step ---------------------------------------------------------------------- */

typedef struct {
    DlContext *ctx;
    int shared;  /* the helper takes part in this step */
    int threads; /* OpenMP threads for whole-op calls (no helper) */
    int num_splits, attend_threads;
} Step;

/* Whether an op of step st goes to the helper too: in a shared step, while the helper is on a
 * CPU (helper_on_cpu); counted either way. */
static int share_op(const Step *st) {
    if (!st->shared) return 0;
    const int on = helper_on_cpu();
    atomic_fetch_add_explicit(on ? &pool.ops_shared : &pool.ops_alone, 1, memory_order_relaxed);
    return on;
}

/* y[B, n] (row stride ldy) = x[B, k] @ W^T + bias, W in weight format fmt */
static int linear(const Step *st, int fmt, const void *x, int64_t B, int64_t k,
                  const void *packed, int64_t n, const void *bias, void *y, int64_t ldy) {
    const DlModel *m = st->ctx->model;
    if (!share_op(st)) return m->linear(fmt, x, B, k, k, packed, n, bias, y, ldy, st->threads);
    const int path = m->prepare(fmt, x, B, k, k, st->ctx->prep);
    if (path < 0) return -2;
    const int64_t es = m->dtype == DL_F32 ? 4 : 2, panels = (n + 15) / 16;
    int64_t per = CHUNK_BYTES / (k * 16 * es);
    if (per < 1) per = 1;
    if ((panels + per - 1) / per > MAX_CHUNKS) per = (panels + MAX_CHUNKS - 1) / MAX_CHUNKS;
    const int64_t groups = (panels + per - 1) / per;
    const Job j = {.kind = JOB_LINEAR, .nchunks = (int)groups, .dtype = fmt, .path = path,
                   .per = per, .es = es, .prep = st->ctx->prep, .packed = packed, .bias = bias,
                   .m = B, .k = k, .n = n, .ldy = ldy, .rows_per = B, .groups = groups,
                   .panels = m->panels, .model = m, .y = y, .mirror = st->ctx->mirror};
    return run_shared(&j);
}

/* attention of the B decodes' queries q [B, heads * D] into out [B, heads * D] */
static int attend(const Step *st, const DlLayer *L, const void *q, int64_t B, const int32_t *tables,
                  int64_t table_stride, const int32_t *seq_lens, void *out) {
    const DlModel *m = st->ctx->model;
    const int64_t q_n = (int64_t)m->heads * m->head_dim;
    if (!share_op(st))
        return m->attend(q, q_n, m->head_dim, m->dtype, L->k_cache, L->v_cache, m->blk_stride,
                         m->dtype, tables, table_stride, seq_lens, NULL, out, q_n, m->head_dim,
                         (int)B, m->heads, m->kv_heads, m->head_dim, m->block_size, m->scale,
                         st->num_splits, st->attend_threads);
    const Job j = {.kind = JOB_ATTEND, .nchunks = (int)B, .dtype = m->dtype, .per = 1,
                   .es = m->dtype == DL_F32 ? 4 : 2, .m = B, .q = q, .k_cache = L->k_cache,
                   .v_cache = L->v_cache, .tables = st->ctx->tables,
                   .table_stride = st->ctx->table_cap, .seq_lens = st->ctx->seq_lens, .model = m,
                   .y = out, .mirror = st->ctx->mirror};
    return run_shared(&j);
}

/* ---- entry point ---------------------------------------------------------------------------- */

/* Every decoder layer and the final norm (and, when the model has lm_head panels and logits is
 * not NULL, the logits) for B decodes (one token each), in place:
 *
 * ctx:    a context of pd_decode_ctx_new for this model, B <= its max_rows; one step at a time
 *         per context.
 * x:      [B, hidden] in the model dtype: the token embeddings on entry, the final-norm hidden
 *         states on return.
 * rope:   [B, 2, head_dim]: each token's cos row and signed-sin row (RotaryEmbedding's table).
 * slots:  int64 [B] pool slot of each token's new K/V.
 * tables, table_stride, seq_lens: the decode kernel's int32 block tables [B, table_stride] and
 *         context lengths [B] (the new token included).
 * logits: [B, vocab] in the model dtype, or NULL.
 * num_splits, attend_threads: the decode kernel's split-K and threads; threads: the GEMMs'. With
 *         threads == 1 and the context's helper on, the idle-core helper shares the matmuls and
 *         the attention (see above) when no other step holds it; else the kernels run whole on
 *         these threads.
 *
 * Returns 0; -1 when scratch memory cannot be allocated (or B exceeds the context); -3 when the
 * context was freed; -2 when a kernel fails (the skinny GEMM's or the attention's scratch
 * allocation). x is then partly updated and the caches may hold some layers' new K/V for these
 * slots: nothing reads them before a step that computes these tokens again rewrites them.
 */
static int decode_layers(DlContext *ctx, void *x, int64_t B, const void *rope,
                         const int64_t *slots, const int32_t *tables, int64_t table_stride,
                         const int32_t *seq_lens, void *logits, int num_splits,
                         int attend_threads, int threads);

int pd_decode_layers(DlContext *ctx, void *x, int64_t B, const void *rope, const int64_t *slots,
                     const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                     void *logits, int num_splits, int attend_threads, int threads) {
    atomic_fetch_add(&ctx->in_use, 1);
    if (atomic_load(&ctx->dead)) {
        atomic_fetch_sub(&ctx->in_use, 1);
        return -3;
    }
    const int rc = decode_layers(ctx, x, B, rope, slots, tables, table_stride, seq_lens, logits,
                                 num_splits, attend_threads, threads);
    atomic_fetch_sub(&ctx->in_use, 1);
    return rc;
}

static int decode_layers(DlContext *ctx, void *x, int64_t B, const void *rope,
                         const int64_t *slots, const int32_t *tables, int64_t table_stride,
                         const int32_t *seq_lens, void *logits, int num_splits,
                         int attend_threads, int threads) {
    const DlModel *m = ctx->model;
    if (B > ctx->max_rows) return -1;
    const int dt = m->dtype, H = m->hidden, D = m->head_dim, I = m->intermediate;
    const int64_t es = dt == DL_F32 ? 4 : 2;
    const int64_t q_n = (int64_t)m->heads * D, kv_n = (int64_t)m->kv_heads * D;
    const int64_t qkv_n = q_n + 2 * kv_n;
    char *xn = ctx->scratch + ctx->offs[0], *qkv = ctx->scratch + ctx->offs[1];
    char *qr = ctx->scratch + ctx->offs[2], *kr = ctx->scratch + ctx->offs[3];
    char *att = ctx->scratch + ctx->offs[4], *gu = ctx->scratch + ctx->offs[5];
    Step st = {ctx, 0, threads, num_splits, attend_threads};
    if (ctx->helper && threads == 1 && pool_start() && pthread_mutex_trylock(&pool.lock) == 0) {
        if (stage_tables(ctx, tables, table_stride, seq_lens, B) == 0) {
            st.shared = 1;
            atomic_store(&pool.active, 1);
            helper_wake();
        } else {
            pthread_mutex_unlock(&pool.lock);
        }
    }
    int rc = 0;
    for (int li = 0; li < m->num_layers && rc == 0; li++) {
        const DlLayer *L = &m->layers[li];
        /* attention block: x += o_proj(attend(rope(q), rope(k), v)) */
        rms_norm(x, L->input_norm, xn, B, H, m->eps, dt);
        if (linear(&st, L->qkv_fmt, xn, B, H, L->qkv, qkv_n, L->qkv_bias, qkv, qkv_n)) {
            rc = -2;
            break;
        }
        rotate(qkv, qkv_n, qr, q_n, rope, B, m->heads, D, dt);
        rotate(qkv + q_n * es, qkv_n, kr, kv_n, rope, B, m->kv_heads, D, dt);
        write_kv(m, L, kr, kv_n, qkv + (q_n + kv_n) * es, qkv_n, slots, B);
        if (attend(&st, L, qr, B, tables, table_stride, seq_lens, att) ||
            linear(&st, L->o_fmt, att, B, q_n, L->o, H, L->o_bias, xn, H)) {
            rc = -2;
            break;
        }
        add_rows(x, xn, B, H, dt);
        /* MLP block: x += down(silu(gate(n)) * up(n)), n = norm(x) */
        rms_norm(x, L->post_norm, xn, B, H, m->eps, dt);
        if (linear(&st, L->gate_up_fmt, xn, B, H, L->gate_up, 2 * (int64_t)I, NULL, gu,
                   2 * (int64_t)I)) {
            rc = -2;
            break;
        }
        silu_mul(gu, xn, B, I, dt);
        if (linear(&st, L->down_fmt, xn, B, I, L->down, H, NULL, gu, H)) {
            rc = -2;
            break;
        }
        add_rows(x, gu, B, H, dt);
    }
    if (rc == 0) {
        rms_norm(x, m->final_norm, xn, B, H, m->eps, dt);
        memcpy(x, xn, (size_t)(B * H * es));
        if (logits && m->lm_head &&
            linear(&st, m->lm_head_fmt, x, B, H, m->lm_head, m->vocab, NULL, logits, m->vocab))
            rc = -2;
    }
    if (st.shared) {
        atomic_store(&pool.active, 0);
        pthread_mutex_unlock(&pool.lock);
    }
    return rc;
}
