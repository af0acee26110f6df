/* AMX helpers shared by the CPU kernels (paged_decode.c's prefill, skinny_gemm.c's bf16 path).
 * Include only where the target has AMX (__AMX_TILE__ and __AMX_BF16__). */
#ifndef PDSERVE_AMX_TILES_H
#define PDSERVE_AMX_TILES_H

#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

/* Whether this process may use AMX tile data: Linux grants it on request (arch_prctl
 * ARCH_REQ_XCOMP_PERM = 0x1023 for XFEATURE_XTILEDATA = 18, numbers from the kernel's uapi
 * headers). Asked once per library; 1 when granted. */
static inline int amx_permitted(void) {
    static int state = -1; /* a benign race: every thread asks the same and stores the same */
    if (state < 0) state = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return state;
}

/* The tile configuration (palette 1) of the Intel SDM, LDTILECFG's 64-byte memory operand */
typedef struct {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((aligned(64))) AmxTileConfig;

/* Configures this thread's tiles 0 .. ntiles - 1 as 16 rows of 64 bytes each (what TDPBF16PS
 * takes for 16 x 32 bf16 operands and 16 x 16 fp32 sums). Pair with _tile_release(). */
static inline void amx_configure_16x64(int ntiles) {
    AmxTileConfig cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    for (int t = 0; t < ntiles; t++) {
        cfg.colsb[t] = 64;
        cfg.rows[t] = 16;
    }
    _tile_loadconfig(&cfg);
}

#endif
