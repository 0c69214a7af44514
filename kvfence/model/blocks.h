/* GGUF weight formats shared by decode_gemm.c and decode_avx2.c (``blocks.py`` says how each row is laid out):
 * the format ids kernels.py passes, a row's size in bytes, the scalar unpacking of a K-quant super-block, and the
 * gather of rows from a matrix regrouped for the int8 kernel (``kvf_expand_group_rows``).
 *
 * K-quants (Q4_K, Q5_K, Q6_K) keep the GGUF's own super-blocks of 256 weights, row after row. A super-block
 * unpacks (``kquant_unpack``) to 256 integers q and, per group of 16 weights g, an fp32 scale D[g] and minimum
 * M[g]; a weight is then fl32(D q - M), what gguf's dequantize computes (it rounds d * sc, dmin * m, then
 * (d sc) q - dmin m in float32; d sc q is exact in float32 (at most 11 + 8 + 6 bits), so one fused multiply-
 * subtract rounds as that multiply then subtract do). The kernels widen q, apply D and M 16 lanes (or 8) at a time
 * and round to bf16.
 */
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "bf16.h"

enum { FMT_BF16 = 0, FMT_Q4_1 = 1, FMT_Q8_0 = 2, FMT_Q4_K = 3, FMT_Q5_K = 4, FMT_Q6_K = 5 };
/* per format: weights per block, bytes per block */
static const int64_t BLOCK_WEIGHTS[] = {1, 32, 32, 256, 256, 256};
static const int64_t BLOCK_BYTES[] = {2, 20, 34, 144, 176, 210};
enum { QK_K = 256 };
/* bytes of one block of a group of 16 rows regrouped for the int8 kernel (``blocks.py: DecodeBlocks``) */
enum { Q41_GROUP_BLOCK = 320, Q80_GROUP_BLOCK = 576 };

static inline int is_kquant(int fmt) { return fmt >= FMT_Q4_K; }

/* Bytes of one row of K weights of format fmt. */
static inline int64_t row_bytes_of(int fmt, int64_t K) { return K / BLOCK_WEIGHTS[fmt] * BLOCK_BYTES[fmt]; }

static inline float half_to_f32(const uint8_t *p) { /* an fp16 at p (any alignment), exactly (F16C) */
    return _cvtsh_ss((uint16_t)(p[0] | p[1] << 8));
}

/* Q4_K / Q5_K: the 6-bit scale and minimum of sub-block j (of 8) from the 12 packed bytes s (gguf's
 * get_scale_min). */
static inline void kquant_scale_min(const uint8_t *s, int j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63, *m = s[j + 4] & 63;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0x0f) | (s[j - 4] >> 6) << 4);
        *m = (uint8_t)((s[j + 4] >> 4) | (s[j] >> 6) << 4);
    }
}

/* Super-block sb of format fmt -> per group of 16 weights its scale D and minimum M (fp32, rounded as gguf's). */
static inline void kquant_scales(const uint8_t *sb, int fmt, float D[16], float M[16]) {
    if (fmt == FMT_Q6_K) { /* int8 scales[16] at 192, fp16 d at 208 */
        const int8_t *scales = (const int8_t *)(sb + 192);
        const float d = half_to_f32(sb + 208);
        for (int g = 0; g < 16; g++) D[g] = d * (float)scales[g], M[g] = 0.0f;
        return;
    }
    const float d = half_to_f32(sb), dmin = half_to_f32(sb + 2);
    for (int j = 0; j < 8; j++) {
        uint8_t sc, m;
        kquant_scale_min(sb + 4, j, &sc, &m);
        D[2 * j] = D[2 * j + 1] = d * (float)sc;
        M[2 * j] = M[2 * j + 1] = dmin * (float)m;
    }
}

/* One super-block sb of format fmt -> its 256 integers q (in weight order) and per group of 16 weights D and M. */
static inline void kquant_unpack(const uint8_t *sb, int fmt, int8_t q[QK_K], float D[16], float M[16]) {
    kquant_scales(sb, fmt, D, M);
    if (fmt == FMT_Q6_K) { /* ql[128], qh[64], int8 scales[16], fp16 d */
        const uint8_t *ql = sb, *qh = sb + 128;
        for (int h = 0; h < 2; h++) /* 128 weights: 4 runs of 32 from 64 bytes of ql and 32 of qh */
            for (int l = 0; l < 32; l++) {
                const uint8_t a = ql[64 * h + l], b = ql[64 * h + 32 + l], c = qh[32 * h + l];
                int8_t *o = q + 128 * h + l;
                o[0] = (int8_t)(((a & 15) | (c & 3) << 4) - 32);
                o[32] = (int8_t)(((b & 15) | (c >> 2 & 3) << 4) - 32);
                o[64] = (int8_t)(((a >> 4) | (c >> 4 & 3) << 4) - 32);
                o[96] = (int8_t)(((b >> 4) | (c >> 6 & 3) << 4) - 32);
            }
        return;
    }
    /* Q4_K: fp16 d, fp16 dmin, scales[12], qs[128]; Q5_K: the same, then qh[32] before qs */
    const uint8_t *qh = sb + 16, *qs = sb + (fmt == FMT_Q5_K ? 48 : 16);
    for (int c = 0; c < 4; c++) /* 32 bytes: sub-block 2c in the low nibbles, 2c + 1 in the high ones */
        for (int l = 0; l < 32; l++) {
            q[64 * c + l] = (int8_t)(qs[32 * c + l] & 15);
            q[64 * c + 32 + l] = (int8_t)(qs[32 * c + l] >> 4);
        }
    if (fmt == FMT_Q5_K) /* bit j of qh[l]: the fifth bit of sub-block j's weight l */
        for (int j = 0; j < 8; j++)
            for (int l = 0; l < 32; l++) q[32 * j + l] = (int8_t)(q[32 * j + l] | (qh[l] >> j & 1) << 4);
}

/* Rows ``rows[0 .. n)`` of a matrix regrouped 16 rows at a time for the int8 kernel (``blocks.py: DecodeBlocks``,
 * Q4_1 or Q8_0) -> bf16 rows of K at out: the embedding's gather where a tied head keeps only that copy. The same
 * bits as kvf_expand_rows on the blocks it was made from: bf16(fp32(d q + m)) (Q4_1) or bf16(fp32(d q)), with d q
 * exact in float32 (11 + 8 bits). Scalar: a step gathers a few rows. Both flavours export it. */
void kvf_expand_group_rows(const uint8_t *w, int fmt, const int64_t *rows, int64_t n, int64_t K, uint16_t *out) {
    const int64_t nb = K / 32, block = fmt == FMT_Q4_1 ? Q41_GROUP_BLOCK : Q80_GROUP_BLOCK;
    for (int64_t i = 0; i < n; i++) {
        const int64_t r = rows[i] % 16;
        const uint8_t *group = w + rows[i] / 16 * nb * block;
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = group + b * block;
            const float d = half_to_f32(blk + 2 * r);
            uint16_t *o = out + i * K + 32 * b;
            if (fmt == FMT_Q4_1) { /* vector p, lane r, byte j: weight 8p + j (low nibble) and 8p + 4 + j (high) */
                const float m = half_to_f32(blk + 32 + 2 * r);
                for (int p = 0; p < 4; p++)
                    for (int j = 0; j < 4; j++) {
                        const uint8_t v = blk[64 + 64 * p + 4 * r + j];
                        o[8 * p + j] = f32_to_bf16(d * (float)(v & 15) + m);
                        o[8 * p + 4 + j] = f32_to_bf16(d * (float)(v >> 4) + m);
                    }
            } else /* vector j, lane r, byte k: weight 4j + k */
                for (int j = 0; j < 8; j++)
                    for (int k = 0; k < 4; k++)
                        o[4 * j + k] = f32_to_bf16(d * (float)(int8_t)blk[64 + 64 * j + 4 * r + k]);
        }
    }
}
