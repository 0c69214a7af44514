/* Row-independent bf16 matmul for decode rows: y[m, n] = sum_k x[m, k] * w[n, k] (fp32 accumulation, bf16 out).
 *
 * Every output element goes through the same instructions in the same order whatever M, N, the register block it
 * falls in, or the thread that computes it: 16 fp32 lanes accumulate k in slices of 32 (vdpbf16ps, k ascending,
 * the last slice masked), then one fixed-order lane sum (``sum16``), then round to nearest even. So row m of y is a function of
 * row m of x and w only: batch-invariant by construction, not by calibration.
 *
 * Threads split N (contiguous ranges of weight rows, each streamed once); within a range, blocks of 16 weight rows
 * stay in L1/L2 while every x row passes over them (4 x rows by 4 weight rows at a time, then single rows).
 *
 * Built by kernels.py twice over: flavour "amx" with -mamx-tile -mamx-bf16 -mamx-int8 -mavx512vnni (the sections
 * under __AMX_TILE__ / __AMX_BF16__ / __AMX_INT8__: tile products and prefill attention on tiles), and flavour
 * "avx512" without them (vectors only; -mavx512vnni where the CPU has it, for the int8 section); both with -O3
 * -mavx512f -mavx512bw -mavx512vl -mavx512bf16 -mf16c -fopenmp. Sharing torch's libgomp (same soname) keeps one
 * thread pool.
 */
#include <immintrin.h>
#include <stdint.h>
#include <math.h>
#include <string.h>

#include "bf16.h"
#include "blocks.h"
#include "decode_chunks.h"

/* The first min(left, 16) of 16 lanes; none when left <= 0. */
static inline __mmask16 first_lanes(int64_t left) {
    return left >= 16 ? (__mmask16)0xffff : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1u);
}

/* Real rows of a 16-row block with ``left`` rows still to go. */
static inline int block_rows(int64_t left) { return left < 16 ? (int)left : 16; }

static inline __m512bh load_bh(const uint16_t *p, __mmask32 mask) {
    return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

/* r[l] = sum of the 16 lanes of v[l], for 16 accumulators at once. Every v[l] goes through the same additions
 * whatever its slot l: ((c0 + c1) + (c2 + c3)) over its 128-bit chunks, each chunk ((x0 + x2) + (x1 + x3)). */
static inline __m512 sum16(const __m512 *v) {
    __m512 t[8], u[4], w0, w1;
    for (int i = 0; i < 8; i++)
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)
        u[i] = _mm512_add_ps(_mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(t[2 * i], t[2 * i + 1], 0xee));
    w0 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], 0x88), _mm512_shuffle_f32x4(u[0], u[1], 0xdd));
    w1 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], 0x88), _mm512_shuffle_f32x4(u[2], u[3], 0xdd));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w0, w1, 0x88), _mm512_shuffle_f32x4(w0, w1, 0xdd));
}

/* acc[i * NB + j] += x row i . w row j over k in [0, K): slices of 32, ascending, the last one masked. MB and NB
 * are constants at every call site (MB * NB <= 16) and the loops unroll, so acc stays in registers. */
#define UNROLL _Pragma("GCC unroll 16")
#define DOT(MB, NB)                                                                                              \
    static inline void dot_##MB##x##NB(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw,         \
                                       int64_t K, __m512 *out) {                                                 \
        __m512 acc[MB * NB];                                                                                     \
        UNROLL for (int i = 0; i < MB * NB; i++) acc[i] = _mm512_setzero_ps();                                   \
        for (int64_t k = 0; k < K; k += 32) {                                                                    \
            __mmask32 mask = K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);           \
            __m512bh wv[NB];                                                                                     \
            UNROLL for (int j = 0; j < NB; j++) wv[j] = load_bh(w + j * ldw + k, mask);                          \
            UNROLL for (int i = 0; i < MB; i++) {                                                                \
                __m512bh xv = load_bh(x + i * ldx + k, mask);                                                    \
                UNROLL for (int j = 0; j < NB; j++) acc[i * NB + j] = _mm512_dpbf16_ps(acc[i * NB + j], xv, wv[j]); \
            }                                                                                                    \
        }                                                                                                        \
        UNROLL for (int i = 0; i < MB * NB; i++) out[i] = acc[i];                                                \
    }

DOT(4, 4)
DOT(1, 16)
DOT(1, 1)

/* 16 results, rows of ``rows`` values each, to y (row stride ldy), rounded to bf16 (nearest even). */
static inline void store(__m512 r, int rows, int64_t cols, uint16_t *y, int64_t ldy) {
    uint16_t tmp[16];
    _mm256_storeu_si256((__m256i *)tmp, (__m256i)_mm512_cvtneps_pbh(r));
    for (int i = 0; i < rows; i++) memcpy(y + i * ldy, tmp + i * cols, cols * sizeof(uint16_t));
}

/* y[m, 0 .. 16) for every x row m, from 16 weight rows of stride ldw (y points at their first column). */
static void rows16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, uint16_t *y, int64_t ldy,
                   int64_t M, int64_t K) {
    __m512 acc[16];
    int64_t m = 0;
    for (; m + 4 <= M; m += 4)
        for (int j = 0; j < 16; j += 4) {
            dot_4x4(x + m * ldx, ldx, w + j * ldw, ldw, K, acc);
            store(sum16(acc), 4, 4, y + m * ldy + j, ldy);
        }
    for (; m < M; m++) {
        dot_1x16(x + m * ldx, ldx, w, ldw, K, acc);
        store(sum16(acc), 1, 16, y + m * ldy, ldy);
    }
}

void kvf_gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, uint16_t *y, int64_t ldy,
                   int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t nblocks = N / 16;
#pragma omp parallel num_threads(nthreads)
    {
        __m512 acc[16];
#pragma omp for schedule(static) nowait
        for (int64_t nb = 0; nb < nblocks; nb++) /* 16 weight rows, every x row */
            rows16(x, ldx, w + nb * 16 * ldw, ldw, y + nb * 16, ldy, M, K);
#pragma omp single
        for (int64_t n = nblocks * 16; n < N; n++) /* the last N % 16 weight rows, one element at a time */
            for (int64_t m = 0; m < M; m++) {
                for (int i = 1; i < 16; i++) acc[i] = _mm512_setzero_ps();
                dot_1x1(x + m * ldx, ldx, w + n * ldw, ldw, K, acc);
                store(sum16(acc), 1, 1, y + m * ldy + n, ldy);
            }
    }
}

#include <stdlib.h>
#include <sys/syscall.h>
#include <unistd.h>

/* r[i] lane j -> r[j] lane i, for 16 x 16 32-bit values. */
static inline void transpose16(__m512i r[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* u[i + c], 128-bit lane l: rows i .. i + 3 of column 4 l + c */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int c = 0; c < 4; c++) {
        const __m512i even0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), even1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
        const __m512i odd0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd), odd1 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
        r[c] = _mm512_shuffle_i32x4(even0, even1, 0x88);
        r[8 + c] = _mm512_shuffle_i32x4(even0, even1, 0xdd);
        r[4 + c] = _mm512_shuffle_i32x4(odd0, odd1, 0x88);
        r[12 + c] = _mm512_shuffle_i32x4(odd0, odd1, 0xdd);
    }
}

/* ---- AMX: the same product on tiles, for any M at tile speed ------------------------------------------------
 *
 * y^T = w x^T: w's rows are the A tiles as they lie in memory (16 weight rows x 32 k), x^T is packed into the B
 * tile layout (k pairs x 16 columns of x rows, zero-padded to 16). Element (m, n) accumulates its k in slices of 32
 * (one TDPBF16PS each, k ascending) in the C tile, then rounds to bf16: the same steps whatever column m sits in,
 * how many rows are real, or which thread runs it (checked by the tests, bit for bit).
 */
#ifndef PREFETCH
#define PREFETCH 1
#endif

#ifdef __AMX_TILE__
int kvf_amx_init(void) { return syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */) == 0; }

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} tile_config;

static void configure_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64;
    _tile_loadconfig(&cfg);
}

/* C tile (16 weight rows x 16 x rows, fp32) -> y[m][n0 .. n0 + 16] for the ``rows`` real x rows. */
static inline void store_tile(const float *c, int rows, uint16_t *y, int64_t ldy) {
    if (rows < 8) { /* a gather per row costs less than a transpose */
        const __m512i col = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                               _mm512_set1_epi32(16));
        for (int m = 0; m < rows; m++)
            _mm256_storeu_si256((__m256i *)(y + m * ldy), (__m256i)_mm512_cvtneps_pbh(_mm512_i32gather_ps(col, c + m, 4)));
        return;
    }
    __m512i r[16];
    for (int n = 0; n < 16; n++) r[n] = _mm512_load_si512(c + 16 * n);
    transpose16(r);
    for (int m = 0; m < rows; m++)
        _mm256_storeu_si256((__m256i *)(y + m * ldy), (__m256i)_mm512_cvtneps_pbh(_mm512_castsi512_ps(r[m])));
}

/* One x block (16 rows) against NB (4, 2 or 1) weight tiles, C tiles 0 .. NB - 1. */
#define AMX_GROUP(NB)                                                                                            \
    static inline void amx_group_##NB(const uint16_t *xp, const uint16_t *w, int64_t ldw, int64_t K, float *c,   \
                                      const char *pf, int64_t pf_lines) {                                        \
        _tile_zero(0);                                                                                           \
        if (NB > 1) _tile_zero(1);                                                                               \
        if (NB > 2) { _tile_zero(2); _tile_zero(3); }                                                            \
        for (int64_t k = 0; k < K; k += 32) {                                                                    \
            for (int64_t l = 0; l < pf_lines; l++) _mm_prefetch(pf + (k / 32 * pf_lines + l) * 64, _MM_HINT_T0); \
            _tile_loadd(4, xp + k * 16, 64);                                                                     \
            _tile_loadd(5, w + k, ldw * 2);                                                                      \
            _tile_dpbf16ps(0, 5, 4);                                                                             \
            if (NB > 1) {                                                                                        \
                _tile_loadd(6, w + 16 * ldw + k, ldw * 2);                                                       \
                _tile_dpbf16ps(1, 6, 4);                                                                         \
            }                                                                                                    \
            if (NB > 2) {                                                                                        \
                _tile_loadd(5, w + 32 * ldw + k, ldw * 2);                                                       \
                _tile_dpbf16ps(2, 5, 4);                                                                         \
                _tile_loadd(6, w + 48 * ldw + k, ldw * 2);                                                       \
                _tile_dpbf16ps(3, 6, 4);                                                                         \
            }                                                                                                    \
        }                                                                                                        \
        _tile_stored(0, c, 64);                                                                                  \
        if (NB > 1) _tile_stored(1, c + 256, 64);                                                                \
        if (NB > 2) { _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64); }                              \
    }

AMX_GROUP(4)
AMX_GROUP(2)
AMX_GROUP(1)

/* Two x blocks against two weight tiles (2 x 2 C tiles: c holds w0 x0, w0 x1, w1 x0, w1 x1): four loads for four
 * products, where one x block against four weight tiles takes five. Each C tile sees the same products in the
 * same order as in amx_group_4. */
static inline void amx_pair(const uint16_t *xp0, const uint16_t *xp1, const uint16_t *w, int64_t ldw, int64_t K,
                            float *c, const char *pf, int64_t pf_lines) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t k = 0; k < K; k += 32) {
        for (int64_t l = 0; l < pf_lines; l++) _mm_prefetch(pf + (k / 32 * pf_lines + l) * 64, _MM_HINT_T0);
        _tile_loadd(4, xp0 + k * 16, 64);
        _tile_loadd(6, w + k, ldw * 2);
        _tile_loadd(5, xp1 + k * 16, 64);
        _tile_dpbf16ps(0, 6, 4);
        _tile_loadd(7, w + 16 * ldw + k, ldw * 2);
        _tile_dpbf16ps(1, 6, 5);
        _tile_dpbf16ps(2, 7, 4);
        _tile_dpbf16ps(3, 7, 5);
    }
    _tile_stored(0, c, 64); _tile_stored(1, c + 256, 64); _tile_stored(2, c + 512, 64); _tile_stored(3, c + 768, 64);
}
#else
int kvf_amx_init(void) { return 0; } /* built without the tile instructions */
#endif

/* ---- GGUF weight blocks, expanded to bf16 on the fly ----------------------------------------------------------
 *
 * Rows of K weights in blocks of 32, each block's fields gathered by row (``blocks.py``). Q4_1 row: nb = K / 32
 * fp16 scales d, nb fp16 minimums m, then nb x 16 bytes whose low nibbles are a block's weights 0-15 and high
 * nibbles 16-31. Q8_0 row: nb fp16 scales, then nb x 32 int8. A weight becomes bf16(fp32(d q) + m) (Q8_0: bf16(d q)),
 * rounded to nearest even: what gguf's dequantize then a cast to bf16 give, bit for bit (an fp16 d times a 4-bit
 * q is exact in fp32, so one fused multiply-add rounds d q + m as numpy's multiply then add do). So a model that
 * keeps its blocks computes exactly what the one dequantized at load computes, and reads 3.2x (Q4_1) or 1.9x
 * (Q8_0) fewer weight bytes.
 *
 * A Q4_1 block has only 16 distinct values: they are computed once (one vector multiply-add) and the 32
 * nibbles pick from them (vpermw), about 2x cheaper than converting every weight. Blocks go in pairs (their
 * nibbles interleaved at load, blocks.py): one conversion makes both tables and one widening both index sets.
 *
 * K-quant rows (Q4_K, Q5_K, Q6_K: GGUF super-blocks of 256, ``blocks.h``) expand the same way, to bf16(fp32(D q -
 * M)) per weight, gguf's dequantize then a cast to bf16, 32 weights per conversion.
 */

static void halves_to_f32(const uint8_t *p, int64_t n, float *out) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 mask = first_lanes(n - i);
        _mm512_mask_storeu_ps(out + i, mask, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, p + 2 * i)));
    }
}

/* One Q4_K or Q5_K super-block -> its 256 bf16: as Q4_1's pairs, a table of each sub-block's values (16, or 32
 * for Q5_K) made with one multiply-subtract per 16 and one conversion per 32, then vpermw by the widened values. */
static inline void expand_q45k_block(const uint8_t *sb, int fmt, uint16_t *out) {
    float D[16], M[16];
    kquant_scales(sb, fmt, D, M);
    const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512i low = _mm512_set1_epi16(0x0f);
    if (fmt == FMT_Q4_K) {
        const __m512i second_half = _mm512_set1_epi16(0x10);
        for (int c = 0; c < 4; c++) { /* sub-blocks 2c (low nibbles; table's upper half) and 2c + 1 (high) */
            const __m512 va = _mm512_fmsub_ps(_mm512_set1_ps(D[4 * c]), iota, _mm512_set1_ps(M[4 * c]));
            const __m512 vb = _mm512_fmsub_ps(_mm512_set1_ps(D[4 * c + 2]), iota, _mm512_set1_ps(M[4 * c + 2]));
            const __m512i lut = (__m512i)_mm512_cvtne2ps_pbh(va, vb);
            const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(sb + 16 + 32 * c)));
            const __m512i ia = _mm512_ternarylogic_epi32(q, low, second_half, 0xea); /* (q & 0x0f) | 0x10 */
            _mm512_storeu_si512(out + 64 * c, _mm512_permutexvar_epi16(ia, lut));
            _mm512_storeu_si512(out + 64 * c + 32, _mm512_permutexvar_epi16(_mm512_srli_epi16(q, 4), lut));
        }
        return;
    }
    const __m512 iota16 = _mm512_add_ps(iota, _mm512_set1_ps(16.0f));
    const __m512i qh = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(sb + 16)));
    for (int c = 0; c < 4; c++) {
        const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(sb + 48 + 32 * c)));
        for (int h = 0; h < 2; h++) { /* sub-block j = 2c + h: its 4-bit values, bit j of qh as the fifth */
            const int j = 2 * c + h;
            const __m512 dv = _mm512_set1_ps(D[2 * j]), mv = _mm512_set1_ps(M[2 * j]);
            const __m512i lut = (__m512i)_mm512_cvtne2ps_pbh(_mm512_fmsub_ps(dv, iota16, mv), _mm512_fmsub_ps(dv, iota, mv));
            const __m512i nib = h ? _mm512_srli_epi16(q, 4) : _mm512_and_si512(q, low);
            const __m512i fifth = j <= 4 ? _mm512_slli_epi16(qh, 4 - j) : _mm512_srli_epi16(qh, j - 4);
            const __m512i idx = _mm512_ternarylogic_epi32(nib, fifth, _mm512_set1_epi16(0x10), 0xf8); /* n | (f & 0x10) */
            _mm512_storeu_si512(out + 32 * j, _mm512_permutexvar_epi16(idx, lut));
        }
    }
}

/* One Q6_K super-block -> its 256 bf16, bf16(d scale_g (q - 32)) per weight: per half of 128 weights, 32 bytes each
 * of the low nibbles (two runs) and of the high bits are widened to 16-bit lanes, so four runs of 32 6-bit values
 * come out of a few shifts and masks (blocks.h's kquant_unpack, 32 weights at a time). */
static inline void expand_q6k_block(const uint8_t *sb, uint16_t *out) {
    float D[16], M[16];
    kquant_scales(sb, FMT_Q6_K, D, M);
    const __m512i low = _mm512_set1_epi16(0x0f), bits45 = _mm512_set1_epi16(0x30), off = _mm512_set1_epi16(32);
    for (int h = 0; h < 2; h++) {
        const __m512i a = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(sb + 64 * h)));
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(sb + 64 * h + 32)));
        const __m512i c = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(sb + 128 + 32 * h)));
        const __m512i runs[4] = { /* weights 128 h + 32 r + l, l = 0 .. 31: q - 32 */
            _mm512_sub_epi16(_mm512_or_si512(_mm512_and_si512(a, low), _mm512_and_si512(_mm512_slli_epi16(c, 4), bits45)), off),
            _mm512_sub_epi16(_mm512_or_si512(_mm512_and_si512(b, low), _mm512_and_si512(_mm512_slli_epi16(c, 2), bits45)), off),
            _mm512_sub_epi16(_mm512_or_si512(_mm512_srli_epi16(a, 4), _mm512_and_si512(c, bits45)), off),
            _mm512_sub_epi16(_mm512_or_si512(_mm512_srli_epi16(b, 4), _mm512_and_si512(_mm512_srli_epi16(c, 2), bits45)), off),
        };
        for (int r = 0; r < 4; r++) {
            const int g = 8 * h + 2 * r; /* the run's two groups of 16 */
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(runs[r])));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(runs[r], 1)));
            _mm512_storeu_si512(out + 128 * h + 32 * r, (__m512i)_mm512_cvtne2ps_pbh(
                _mm512_mul_ps(_mm512_set1_ps(D[g + 1]), hi), _mm512_mul_ps(_mm512_set1_ps(D[g]), lo)));
        }
    }
}

/* One K-quant row of K weights (K % 256 == 0) -> K bf16 at out. */
static void expand_kquant_row(const uint8_t *row, int fmt, int64_t K, uint16_t *out) {
    for (int64_t s = 0; s < K / QK_K; s++, out += QK_K) {
        if (fmt == FMT_Q6_K) expand_q6k_block(row + s * BLOCK_BYTES[fmt], out);
        else expand_q45k_block(row + s * BLOCK_BYTES[fmt], fmt, out);
    }
}

/* One row of K weights -> K bf16 at out. */
static void expand_row(const uint8_t *row, int fmt, int64_t K, uint16_t *out) {
    if (is_kquant(fmt)) {
        expand_kquant_row(row, fmt, K, out);
        return;
    }
    const int64_t nb = K / 32;
    float d[nb], m[nb];
    halves_to_f32(row, nb, d);
    if (fmt == FMT_Q4_1) {
        halves_to_f32(row + 2 * nb, nb, m);
        const uint8_t *qs = row + 4 * nb;
        const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
        const __m512i low = _mm512_set1_epi16(0x0f), second_half = _mm512_set1_epi16(0x10);
        int64_t b = 0;
        for (; b + 1 < nb; b += 2) { /* a pair: one table of 32 (b + 1's values, then b's), one widening */
            const __m512 va = _mm512_fmadd_ps(_mm512_set1_ps(d[b]), iota, _mm512_set1_ps(m[b]));
            const __m512 vb = _mm512_fmadd_ps(_mm512_set1_ps(d[b + 1]), iota, _mm512_set1_ps(m[b + 1]));
            const __m512i lut = (__m512i)_mm512_cvtne2ps_pbh(va, vb);
            const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(qs + 16 * b)));
            const __m512i ia = _mm512_ternarylogic_epi32(q, low, second_half, 0xea); /* (q & 0x0f) | 0x10 */
            _mm512_storeu_si512(out + 32 * b, _mm512_permutexvar_epi16(ia, lut));
            _mm512_storeu_si512(out + 32 * (b + 1), _mm512_permutexvar_epi16(_mm512_srli_epi16(q, 4), lut));
        }
        if (b < nb) { /* an odd last block, in the GGUF's order */
            const __m512 values = _mm512_fmadd_ps(_mm512_set1_ps(d[b]), iota, _mm512_set1_ps(m[b]));
            const __m512i lut = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));
            const __m128i q = _mm_loadu_si128((const __m128i *)(qs + 16 * b));
            const __m128i nibble = _mm_set1_epi8(0x0f);
            const __m512i idx = _mm512_cvtepu8_epi16(
                _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), nibble), _mm_and_si128(q, nibble)));
            _mm512_storeu_si512(out + 32 * b, _mm512_permutexvar_epi16(idx, lut));
        }
    } else {
        const int8_t *qs = (const int8_t *)(row + 2 * nb);
        for (int64_t b = 0; b < nb; b++) {
            const __m512 dv = _mm512_set1_ps(d[b]);
            const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * b))));
            const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 32 * b + 16))));
            _mm512_storeu_si512(out + 32 * b, (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(dv, hi), _mm512_mul_ps(dv, lo)));
        }
    }
}

/* ``rows`` consecutive rows from w -> bf16 rows of K at out. */
static void expand_rows(const uint8_t *w, int fmt, int64_t rows, int64_t K, uint16_t *out) {
    const int64_t row_bytes = row_bytes_of(fmt, K);
    for (int64_t r = 0; r < rows; r++) expand_row(w + r * row_bytes, fmt, K, out + r * K);
}

/* Rows ``rows[0 .. n)`` of a block matrix -> bf16 (the embedding's gather). */
void kvf_expand_rows(const uint8_t *w, int fmt, const int64_t *rows, int64_t n, int64_t K, uint16_t *out) {
    const int64_t row_bytes = row_bytes_of(fmt, K);
    for (int64_t i = 0; i < n; i++) expand_row(w + rows[i] * row_bytes, fmt, K, out + i * K);
}

/* This thread's buffer ``slot`` of at least n bytes, 64-byte aligned, kept between calls (a fresh large one costs
 * page faults, and a call per matmul adds up). */
enum { BUF_EXPANDED, BUF_QUANTIZED, BUF_UNPACKED, BUF_SCORES, BUF_WEIGHTS, BUF_SLOTS };
static void *thread_buffer(int slot, int64_t n) {
    static __thread void *buf[BUF_SLOTS];
    static __thread int64_t cap[BUF_SLOTS];
    if (n > cap[slot]) {
        free(buf[slot]);
        cap[slot] = (n + 63) / 64 * 64;
        buf[slot] = aligned_alloc(64, cap[slot]);
    }
    return buf[slot];
}

/* This thread's buffer of at least n bytes, 64-byte aligned, kept between calls; a call's OpenMP team shares the
 * calling thread's. */
static void *caller_buffer(int64_t n) {
    static __thread void *buf;
    static __thread int64_t cap;
    if (n > cap) {
        free(buf);
        cap = (n + 63) / 64 * 64;
        buf = aligned_alloc(64, cap);
    }
    return buf;
}

/* The product with w as N rows of blocks of format fmt (FMT_Q4_1 .. FMT_Q6_K, blocks.h) on vectors: a thread expands
 * 16 weight rows into its buffer, then every x row passes over them as in kvf_gemm_bf16, so the same bits as
 * kvf_gemm_bf16 over the dequantized bf16 weights. Needs N % 16 == 0 and whole blocks (the caller checks). */
void kvf_gemm_blocks(const uint16_t *x, int64_t ldx, const uint8_t *w, int fmt, uint16_t *y, int64_t ldy,
                     int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t row_bytes = row_bytes_of(fmt, K);
#pragma omp parallel num_threads(nthreads)
    {
        uint16_t *expanded = thread_buffer(BUF_EXPANDED, 16 * K * 2);
#pragma omp for schedule(static)
        for (int64_t g = 0; g < N / 16; g++) {
            expand_rows(w + g * 16 * row_bytes, fmt, 16, K, expanded);
            rows16(x, ldx, expanded, K, y + 16 * g, ldy, M, K);
        }
    }
}

#ifdef __AMX_TILE__
/* x rows [m0, m0 + 16) (zeros past M) into the tile layout of xp's block m0 / 16: [K / 2 pairs][16 rows]. */
static void pack_x_block(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, int64_t m0, uint32_t *xp) {
    uint32_t *block = xp + m0 / 16 * K * 8;
    if (M - m0 < 8) { /* a few rows: one by one */
        memset(block, 0, K * 32);
        for (int64_t m = m0; m < M; m++)
            for (int64_t p = 0; p < K / 2; p++) block[p * 16 + m - m0] = ((const uint32_t *)(x + m * ldx))[p];
        return;
    }
    for (int64_t p = 0; p < K / 2; p += 16) { /* 16 rows x 16 pairs at a time */
        __m512i r[16];
        for (int64_t i = 0; i < 16; i++)
            r[i] = m0 + i < M ? _mm512_loadu_si512(x + (m0 + i) * ldx + 2 * p) : _mm512_setzero_si512();
        transpose16(r);
        for (int64_t i = 0; i < 16; i++) _mm512_store_si512(block + (p + i) * 16, r[i]);
    }
}

/* w: bf16 rows of stride ldw (fmt FMT_BF16), or rows of blocks. The team first packs x's 16-row blocks,
 * then each thread takes groups of 64 weight rows, or of 32 where 64 would leave threads unevenly loaded (the
 * last group may be smaller): block rows are first expanded into its own buffer, then every x block passes over
 * the group, two at a time. Needs K % 32 == 0 and N % 16 == 0 (the caller checks); x rows may have any stride. */
static void gemm_amx(const uint16_t *x, int64_t ldx, const void *w, int fmt, int64_t ldw, uint16_t *y, int64_t ldy,
                     int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t wide = N / 64 % nthreads == 0 || N / 64 >= 8 * nthreads ? 64 : 32; /* rows per group */
    const int64_t mblocks = (M + 15) / 16, groups = (N + wide - 1) / wide;
    const int64_t row_bytes = fmt == FMT_BF16 ? ldw * 2 : row_bytes_of(fmt, K);
    uint32_t *xp = caller_buffer(mblocks * K * 32); /* per m block: [K / 2 pairs][16 rows] of bf16 pairs */
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t mb = 0; mb < mblocks; mb++) pack_x_block(x, ldx, M, K, mb * 16, xp);
        float c[4 * 256] __attribute__((aligned(64)));
        uint16_t *expanded = fmt == FMT_BF16 ? NULL : thread_buffer(BUF_EXPANDED, wide * K * 2);
        configure_tiles();
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t n0 = g * wide, nb = (N - n0 < wide ? N - n0 : wide) / 16; /* weight tiles: 4 to 1 */
            const char *rows = (const char *)w + n0 * row_bytes;
            const uint16_t *wg = (const uint16_t *)rows;
            int64_t ld = ldw;
            if (expanded) {
                expand_rows((const uint8_t *)rows, fmt, 16 * nb, K, expanded);
                wg = expanded, ld = K;
            }
            /* the first pass over a group streams the next group's weights into cache, K / 32 parts */
            const char *pf = rows + 16 * nb * row_bytes;
            const int64_t pf_lines = g + 1 < groups && PREFETCH ? (wide * row_bytes / 64) / (K / 32) + 1 : 0;
            int64_t mb = 0;
            if (nb % 2 == 0) /* x blocks in pairs while there are two */
                for (; mb + 1 < mblocks; mb += 2) {
                    const uint16_t *xb = (const uint16_t *)(xp + mb * K * 8);
                    const int rows0 = block_rows(M - mb * 16), rows1 = block_rows(M - mb * 16 - 16);
                    for (int64_t j = 0; j < nb; j += 2) {
                        amx_pair(xb, xb + K * 16, wg + j * 16 * ld, ld, K, c, pf, mb == 0 && j == 0 ? pf_lines : 0);
                        uint16_t *y0 = y + mb * 16 * ldy + n0 + 16 * j;
                        store_tile(c, rows0, y0, ldy);
                        store_tile(c + 256, rows1, y0 + 16 * ldy, ldy);
                        store_tile(c + 512, rows0, y0 + 16, ldy);
                        store_tile(c + 768, rows1, y0 + 16 * ldy + 16, ldy);
                    }
                }
            for (; mb < mblocks; mb++) {
                const uint16_t *xb = (const uint16_t *)(xp + mb * K * 8);
                const int64_t lines = mb == 0 ? pf_lines : 0;
                if (nb == 4) amx_group_4(xb, wg, ld, K, c, pf, lines);
                else if (nb == 2) amx_group_2(xb, wg, ld, K, c, pf, lines);
                else for (int64_t j = 0; j < nb; j++) amx_group_1(xb, wg + j * 16 * ld, ld, K, c + j * 256, pf, j ? 0 : lines);
                const int rows_m = block_rows(M - mb * 16);
                for (int j = 0; j < nb; j++) store_tile(c + j * 256, rows_m, y + mb * 16 * ldy + n0 + 16 * j, ldy);
            }
        }
        _tile_release();
    }
}

void kvf_gemm_amx(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, uint16_t *y, int64_t ldy,
                  int64_t M, int64_t N, int64_t K, int nthreads) {
    gemm_amx(x, ldx, w, FMT_BF16, ldw, y, ldy, M, N, K, nthreads);
}

/* The same product with w as N rows of blocks of format fmt (FMT_Q4_1 .. FMT_Q6_K, blocks.h). */
void kvf_gemm_amx_blocks(const uint16_t *x, int64_t ldx, const uint8_t *w, int fmt, uint16_t *y, int64_t ldy,
                         int64_t M, int64_t N, int64_t K, int nthreads) {
    gemm_amx(x, ldx, w, fmt, K, y, ldy, M, N, K, nthreads);
}
#endif

static inline __m512 load_f32(const uint16_t *p) { /* 16 bf16 -> fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

#ifdef __AVX512VNNI__
/* ---- decode rows on int8: GGUF blocks against x quantized per block -------------------------------------------
 *
 * A one-token chunk (a decode row) multiplies block weights without expanding them. Each 32-value block of an x
 * row becomes int8: amax = max |x|, q = round-half-even(x * (127 / amax)), dx = amax / 127, sx = dx * sum(q)
 * (all zero when amax is 0). Per block, isum = sum q_x q_w is an exact integer; then, blocks ascending from 0,
 *     acc = fma(float(isum), d dx, acc)  and for Q4_1  acc = fma(m, sx, acc),
 * and y = bf16(acc). Integer sums are exact in any order, so the vector (VNNI) path below 16 rows and the tile
 * (AMX int8) path from 16 rows give the same bits: a row is a function of its own x and w, as in the bf16 kernel.
 * The arithmetic differs from the bf16 expansion's, so longer chunks (prefill) keep that kernel: a row's kernel
 * follows from its chunk's length, never from the batch.
 *
 * Weights in groups of 16 rows (``blocks.py: DecodeBlocks``); per group, per block, 64-byte aligned:
 *   Q4_1 (320 bytes): 16 fp16 d, 16 fp16 m, then 4 x 64 bytes: vector p, lane r, byte i holds row r's weight
 *                     8p + i in its low nibble and 8p + 4 + i in its high nibble;
 *   Q8_0 (576 bytes): 16 fp16 d, 16 int16 row sums of q, then 8 x 64 bytes: vector j, lane r, byte i = row r's
 *                     weight 4j + i.
 * So vector j (unpacked) holds k = 4j .. 4j + 3 of all 16 rows: one VNNI operand, or one row of an AMX B tile.
 */
enum { Q8_TILE_ROWS = 16 }; /* Q41_GROUP_BLOCK, Q80_GROUP_BLOCK: blocks.h */

/* x rows -> qx (int8 [M][K]), dx and sx ([M][K / 32]), and unless xu is NULL xu = qx + 128 as uint8 (the VNNI
 * operand for Q8_0 weights). */
static void quantize_rows(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, int8_t *qx, uint8_t *xu, float *dx,
                          float *sx) {
    const int64_t nb = K / 32;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const __m512 lo = load_f32(x + m * ldx + 32 * b), hi = load_f32(x + m * ldx + 32 * b + 16);
            const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
            const __m512 scale = _mm512_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
            const __m512i qlo = _mm512_cvtps_epi32(_mm512_mul_ps(lo, scale)); /* nearest even (MXCSR default) */
            const __m512i qhi = _mm512_cvtps_epi32(_mm512_mul_ps(hi, scale));
            const __m256i q = _mm256_set_m128i(_mm512_cvtepi32_epi8(qhi), _mm512_cvtepi32_epi8(qlo));
            _mm256_storeu_si256((__m256i *)(qx + m * K + 32 * b), q);
            if (xu)
                _mm256_storeu_si256((__m256i *)(xu + m * K + 32 * b), _mm256_xor_si256(q, _mm256_set1_epi8((char)0x80)));
            dx[m * nb + b] = amax / 127.0f;
            sx[m * nb + b] = dx[m * nb + b] * (float)_mm512_reduce_add_epi32(_mm512_add_epi32(qlo, qhi));
        }
}

static inline void q41_unpack(const uint8_t *gb, __m512i w[8]) {
    const __m512i low = _mm512_set1_epi8(0x0f);
    for (int p = 0; p < 4; p++) {
        const __m512i v = _mm512_loadu_si512(gb + 64 + 64 * p);
        w[2 * p] = _mm512_and_si512(v, low);
        w[2 * p + 1] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
}

/* isum of 16 weight rows against one x block: 8 quads, in four chains (integer adds: any order is exact). */
static inline __m512i dot_quads(const __m512i w[8], const int32_t *xq, int signed_w) {
    __m512i s[4];
    for (int j = 0; j < 4; j++)
        s[j] = signed_w ? _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi32(xq[j]), w[j])
                        : _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[j], _mm512_set1_epi32(xq[j]));
    for (int j = 4; j < 8; j++)
        s[j - 4] = signed_w ? _mm512_dpbusd_epi32(s[j - 4], _mm512_set1_epi32(xq[j]), w[j])
                            : _mm512_dpbusd_epi32(s[j - 4], w[j], _mm512_set1_epi32(xq[j]));
    return _mm512_add_epi32(_mm512_add_epi32(s[0], s[1]), _mm512_add_epi32(s[2], s[3]));
}

typedef struct {
    const int8_t *qx;
    const uint8_t *xu;
    const float *dx, *sx;
    int64_t K, nb;
} quantized_x;

/* A block's fp32 scales for 16 weight rows: d and (Q4_1) m. */
typedef struct {
    __m512 d, m;
} block_scales;

static inline block_scales load_scales(const uint8_t *gb, int fmt) {
    block_scales s = {_mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)gb)), _mm512_setzero_ps()};
    if (fmt == FMT_Q4_1) s.m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(gb + 32)));
    return s;
}

/* One block's isum (16 lanes: weight rows) of x row m -> acc, in the order of the contract above. */
static inline __m512 scale_block(__m512 acc, __m512i isum, block_scales s, int fmt, const quantized_x *x, int64_t m,
                                 int64_t b) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(s.d, _mm512_set1_ps(x->dx[m * x->nb + b])), acc);
    if (fmt == FMT_Q4_1) acc = _mm512_fmadd_ps(s.m, _mm512_set1_ps(x->sx[m * x->nb + b]), acc);
    return acc;
}

/* Rows [m0, m0 + rows) (rows <= 4) against one group, on vectors. */
static inline __attribute__((always_inline)) void q8_group_vnni(const uint8_t *wg, int fmt, const quantized_x *x,
                                                                int64_t m0, int rows, __m512 *acc) {
    const int64_t gbytes = fmt == FMT_Q4_1 ? Q41_GROUP_BLOCK : Q80_GROUP_BLOCK;
    UNROLL for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < x->nb; b++) {
        const uint8_t *gb = wg + b * gbytes;
        if (m0 == 0) /* the first pass over a group streams the same block of the next group into cache */
            for (int64_t l = 0; l < gbytes; l += 64) _mm_prefetch((const char *)gb + x->nb * gbytes + l, _MM_HINT_T2);
        __m512i w[8];
        if (fmt == FMT_Q4_1) q41_unpack(gb, w);
        else for (int j = 0; j < 8; j++) w[j] = _mm512_loadu_si512(gb + 64 + 64 * j);
        const block_scales scales = load_scales(gb, fmt);
        UNROLL for (int r = 0; r < rows; r++) {
            const int64_t m = m0 + r;
            __m512i isum;
            if (fmt == FMT_Q4_1) isum = dot_quads(w, (const int32_t *)(x->qx + m * x->K + 32 * b), 0);
            else /* (q + 128) . w - 128 sum(w) */
                isum = _mm512_sub_epi32(dot_quads(w, (const int32_t *)(x->xu + m * x->K + 32 * b), 1),
                    _mm512_slli_epi32(_mm512_cvtepi16_epi32(_mm256_loadu_si256((const __m256i *)(gb + 32))), 7));
            acc[r] = scale_block(acc[r], isum, scales, fmt, x, m, b);
        }
    }
}

#ifdef __AMX_INT8__
static void configure_int8_tiles(void) {
    tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 4; t++) cfg.rows[t] = 16, cfg.colsb[t] = 64; /* C: 16 x rows x 16 weight rows, int32 */
    for (int t = 4; t < 6; t++) cfg.rows[t] = 16, cfg.colsb[t] = 32; /* A: 16 x rows x one block of int8 */
    for (int t = 6; t < 8; t++) cfg.rows[t] = 8, cfg.colsb[t] = 64;  /* B: 8 quads x 16 weight rows x 4 bytes */
    _tile_loadconfig(&cfg);
}

/* Block b's isums into C tile TC (A tile TA, B tile TB). */
#define Q8_PRODUCT(TC, TA, TB, b)                                                                                \
    do {                                                                                                         \
        _tile_zero(TC);                                                                                          \
        _tile_loadd(TA, x->qx + m0 * x->K + 32 * (b), x->K);                                                     \
        if (fmt == FMT_Q4_1) {                                                                                   \
            _tile_loadd(TB, unpacked + (b) * 512, 64);                                                           \
            _tile_dpbsud(TC, TA, TB);                                                                            \
        } else {                                                                                                 \
            _tile_loadd(TB, wg + (b) * gbytes + 64, 64);                                                         \
            _tile_dpbssd(TC, TA, TB);                                                                            \
        }                                                                                                        \
    } while (0)

/* Rows [m0, m0 + 16) against one group, on tiles: up to four blocks' isums on the tile unit (tiles 0-3) while the
 * four before them are scaled as above from memory; unpacked: the group's B tiles (Q4_1 unpacked to bytes; Q8_0's
 * are the weights as stored). */
static inline __attribute__((always_inline)) void q8_group_amx(const uint8_t *wg, int fmt, const uint8_t *unpacked,
                                                               const quantized_x *x, int64_t m0, __m512 acc[16]) {
    const int64_t gbytes = fmt == FMT_Q4_1 ? Q41_GROUP_BLOCK : Q80_GROUP_BLOCK, nb = x->nb;
    int32_t c[2][4 * 256] __attribute__((aligned(64)));
    for (int r = 0; r < 16; r++) acc[r] = _mm512_setzero_ps();
    int64_t b = 0;
    int n = nb < 4 ? (int)nb : 4, buf = 0;
    Q8_PRODUCT(0, 4, 6, 0);
    if (n > 1) Q8_PRODUCT(1, 5, 7, 1);
    if (n > 2) Q8_PRODUCT(2, 4, 6, 2);
    if (n > 3) Q8_PRODUCT(3, 5, 7, 3);
    while (n > 0) {
        _tile_stored(0, c[buf], 64);
        if (n > 1) _tile_stored(1, c[buf] + 256, 64);
        if (n > 2) _tile_stored(2, c[buf] + 512, 64);
        if (n > 3) _tile_stored(3, c[buf] + 768, 64);
        const int64_t next = b + n;
        const int n2 = nb - next < 4 ? (int)(nb - next) : 4;
        if (n2 > 0) Q8_PRODUCT(0, 4, 6, next);
        if (n2 > 1) Q8_PRODUCT(1, 5, 7, next + 1);
        if (n2 > 2) Q8_PRODUCT(2, 4, 6, next + 2);
        if (n2 > 3) Q8_PRODUCT(3, 5, 7, next + 3);
        for (int j = 0; j < n; j++) {
            const block_scales scales = load_scales(wg + (b + j) * gbytes, fmt);
            UNROLL for (int r = 0; r < 16; r++)
                acc[r] = scale_block(acc[r], _mm512_load_si512(c[buf] + 256 * j + 16 * r), scales, fmt, x, m0 + r,
                                     b + j);
        }
        b = next, n = n2, buf ^= 1;
    }
}

#endif

static inline void store_row_bf16(__m512 acc, uint16_t *y) {
    _mm256_storeu_si256((__m256i *)y, (__m256i)_mm512_cvtneps_pbh(acc));
}

/* q8_group_vnni compiled for each format and row count (so its loops unroll and acc stays in registers) */
#define VNNI_FMT(F, R) q8_group_vnni(wg, F, &qxs, m0, R, acc)
#define VNNI_R(R) do { if (fmt == FMT_Q4_1) VNNI_FMT(FMT_Q4_1, R); else VNNI_FMT(FMT_Q8_0, R); } while (0)
#define VNNI_ROWS(rows) do { switch (rows) { case 1: VNNI_R(1); break; case 2: VNNI_R(2); break; \
                                             case 3: VNNI_R(3); break; default: VNNI_R(4); } } while (0)

/* y = x w^T for w as N / 16 groups of K / 32 blocks (FMT_Q4_1 or FMT_Q8_0): the contract above. N % 16 == 0 and
 * K % 32 == 0 (the caller checks). Threads split the groups. */
void kvf_gemm_q8(const uint16_t *x, int64_t ldx, const uint8_t *w, int fmt, uint16_t *y, int64_t ldy, int64_t M,
                 int64_t N, int64_t K, int nthreads) {
    const int64_t nb = K / 32, groups = N / 16, gbytes = nb * (fmt == FMT_Q4_1 ? Q41_GROUP_BLOCK : Q80_GROUP_BLOCK);
#ifdef __AMX_INT8__
    const int tiles = M >= Q8_TILE_ROWS;
#else
    const int tiles = 0; /* built without tiles: every row on vectors, the same bits */
#endif
    const int64_t Mp = tiles ? (M + 15) / 16 * 16 : M; /* tile rows past M are zero */
    const int64_t bytes = (Mp * K + 63) / 64 * 64, scales = (Mp * nb * 4 + 63) / 64 * 64;
    int8_t *qx = thread_buffer(BUF_QUANTIZED, 2 * bytes + 2 * scales);
    uint8_t *xu = (uint8_t *)qx + bytes;
    float *dx = (float *)(xu + bytes), *sx = (float *)((char *)dx + scales);
    memset(qx + M * K, 0, (Mp - M) * K);
    memset(dx + M * nb, 0, (Mp - M) * nb * 4), memset(sx + M * nb, 0, (Mp - M) * nb * 4);
    quantize_rows(x, ldx, M, K, qx, fmt == FMT_Q8_0 ? xu : NULL, dx, sx);
    const quantized_x qxs = {qx, xu, dx, sx, K, nb};
#pragma omp parallel num_threads(nthreads)
    {
#ifdef __AMX_INT8__
        uint8_t *unpacked = tiles && fmt == FMT_Q4_1 ? thread_buffer(BUF_UNPACKED, nb * 512) : NULL;
        if (tiles) configure_int8_tiles();
#endif
#pragma omp for schedule(static)
        for (int64_t g = 0; g < groups; g++) {
            const uint8_t *wg = w + g * gbytes;
            __m512 acc[16];
#ifdef __AMX_INT8__
            if (tiles) {
                if (unpacked)
                    for (int64_t b = 0; b < nb; b++) {
                        for (int64_t l = 0; l < Q41_GROUP_BLOCK; l += 64)
                            _mm_prefetch((const char *)wg + gbytes + b * Q41_GROUP_BLOCK + l, _MM_HINT_T2);
                        __m512i v[8];
                        q41_unpack(wg + b * Q41_GROUP_BLOCK, v);
                        for (int j = 0; j < 8; j++) _mm512_store_si512(unpacked + b * 512 + 64 * j, v[j]);
                    }
                for (int64_t m0 = 0; m0 < M; m0 += 16) {
                    if (fmt == FMT_Q4_1) q8_group_amx(wg, FMT_Q4_1, unpacked, &qxs, m0, acc);
                    else q8_group_amx(wg, FMT_Q8_0, unpacked, &qxs, m0, acc);
                    for (int r = 0; r < 16 && m0 + r < M; r++) store_row_bf16(acc[r], y + (m0 + r) * ldy + 16 * g);
                }
            } else
#endif
                for (int64_t m0 = 0; m0 < M; m0 += 4) {
                    const int rows = M - m0 < 4 ? (int)(M - m0) : 4;
                    VNNI_ROWS(rows);
                    for (int r = 0; r < rows; r++) store_row_bf16(acc[r], y + (m0 + r) * ldy + 16 * g);
                }
        }
#ifdef __AMX_INT8__
        if (tiles) _tile_release();
#endif
    }
}
#endif /* __AVX512VNNI__ */

/* ---- decode attention straight from the pool: chunks of a sequence's positions, merged (see below) ---------- */
#include <float.h>
#include <omp.h>

/* e^x for x <= 0 (Cody-Waite reduction, degree-7 polynomial): about 1 ulp, and the same on every call. */
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}


/* 2^x for x <= ~0 where the result is rounded to bf16 next (softmax weights): x = n + r with n an integer and
 * |r| <= 1/2, 2^r by its degree-5 Taylor polynomial (relative error below 4e-6, far under bf16's 2^-9), scaled by
 * 2^n. In base 2 the reduction is one exact subtraction: four operations fewer than exp_ps in the prefill softmax,
 * its hottest loop. */
static inline __m512 exp2_weight_ps(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-126.0f));
    const __m512 n = _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 r = _mm512_sub_ps(x, n);
    __m512 p = _mm512_set1_ps(1.3333558e-3f); /* ln2^k / k!, k = 5 .. 0 */
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(9.6181291e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.5504109e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.24022651f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.69314718f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

#define MAX_DV 16 /* D <= 256 */

/* Decode attention splits its work as decode_chunks.h says. A task (one chunk of one sequence, all its heads)
 * computes for every query head its scores (the bf16 dot products on vdpbf16ps, D / 32 of them, the last one
 * masked; 16 positions' lanes summed at once by sum16; times scale), their max m, the weights exp(score - m) in fp32
 * and their sum l (16 lanes at a time, ascending, then one lane sum), and o = the weighted sum of V in fp32, position
 * by position ascending. Then each (sequence, query head) merges its chunks in ascending order: M = max m, o = sum
 * exp(m - M) o, l = sum exp(m - M) l, out = bf16(o / l). Tasks are dealt to the team in equal contiguous shares, so
 * one sequence's chunks spread over every thread. A task reads whole slots (every K and V head of a position, one
 * contiguous run), fetched two 16-position blocks ahead into L2. (docs/performance-log.md, 2026-12-07, has its
 * measurements.) */

/* The lines of [p, p + bytes) into L2 (slots scattered by page: a pattern the hardware prefetchers miss). */
static inline void prefetch_l2(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T1);
}

/* One task: positions pos[0 .. n) (the chunk; pos[n .. ahead) are fetched ahead) against the query row q. part
 * gets, per query head, o (D floats), then m and l. sc: H x ld floats of scratch, ld >= n rounded up to 16. */
static inline __attribute__((always_inline)) void attend_chunk(
    const uint16_t *q, const uint16_t *kv, int64_t slot_stride, const int64_t *pos, int64_t n, int64_t ahead,
    int64_t KV, const int64_t DV, int64_t G, float scale, float *sc, int64_t ld, float *part) {
    const int64_t D = DV * 16, H = KV * G, GB = DV <= 4 ? 4 : DV <= 8 ? 2 : 1; /* GB * DV <= 16 accumulators */
    for (int64_t p0 = 0; p0 < n; p0 += 16) {
        const int rows = block_rows(n - p0);
        for (int64_t j = p0 + 32; j < p0 + 48 && j < ahead; j++) prefetch_l2(kv + pos[j] * slot_stride, 4 * KV * D);
        for (int64_t h = 0; h < H; h++) {
            const uint16_t *qh = q + h * D;
            __m512 acc[16];
            UNROLL for (int j = 0; j < 16; j++) {
                acc[j] = _mm512_setzero_ps();
                if (j < rows) {
                    const uint16_t *k = kv + pos[p0 + j] * slot_stride + h / G * D;
                    for (int64_t c = 0; c < D; c += 32) {
                        const __mmask32 mask = D - c >= 32 ? (__mmask32)0xffffffffu : (__mmask32)0xffffu;
                        acc[j] = _mm512_dpbf16_ps(acc[j], load_bh(qh + c, mask), load_bh(k + c, mask));
                    }
                }
            }
            _mm512_storeu_ps(sc + h * ld + p0, _mm512_mul_ps(sum16(acc), _mm512_set1_ps(scale)));
        }
    }
    for (int64_t h = 0; h < H; h++) { /* weights, unnormalised (0 past n), their max and sum */
        float *row = sc + h * ld, *m = part + h * (D + 2) + D, mx = -FLT_MAX;
        for (int64_t p = 0; p < n; p += 16)
            mx = fmaxf(mx, _mm512_mask_reduce_max_ps(first_lanes(n - p), _mm512_loadu_ps(row + p)));
        __m512 sum = _mm512_setzero_ps();
        for (int64_t p = 0; p < n; p += 16) {
            const __m512 e = _mm512_maskz_mov_ps(first_lanes(n - p),
                                                 exp_ps(_mm512_sub_ps(_mm512_loadu_ps(row + p), _mm512_set1_ps(mx))));
            _mm512_storeu_ps(row + p, e);
            sum = _mm512_add_ps(sum, e);
        }
        m[0] = mx, m[1] = _mm512_reduce_add_ps(sum);
    }
    for (int64_t h = 0; h < KV; h++)
        for (int64_t g0 = 0; g0 < G; g0 += GB) { /* weighted sum of V, position by position */
            const float *w = sc + (h * G + g0) * ld;
            __m512 o[4][MAX_DV];
            UNROLL for (int g = 0; g < GB; g++) UNROLL for (int v = 0; v < DV; v++) o[g][v] = _mm512_setzero_ps();
            for (int64_t p = 0; p < n; p++) {
                const uint16_t *vp = kv + pos[p] * slot_stride + (KV + h) * D;
                UNROLL for (int v = 0; v < DV; v++) {
                    const __m512 vf = load_f32(vp + v * 16);
                    UNROLL for (int g = 0; g < GB; g++)
                        if (g0 + g < G) o[g][v] = _mm512_fmadd_ps(_mm512_set1_ps(w[g * ld + p]), vf, o[g][v]);
                }
            }
            UNROLL for (int g = 0; g < GB; g++) {
                if (g0 + g >= G) break;
                float *dst = part + (h * G + g0 + g) * (D + 2);
                UNROLL for (int v = 0; v < DV; v++) _mm512_storeu_ps(dst + v * 16, o[g][v]);
            }
        }
}

/* Query head h of one sequence from its chunks' partials (ascending), to bf16 at out. */
static void merge_chunks(const float *parts, int64_t chunks, int64_t H, int64_t h, int64_t D, uint16_t *out) {
    const int64_t stride = H * (D + 2);
    float M = -FLT_MAX;
    for (int64_t c = 0; c < chunks; c++) M = fmaxf(M, parts[c * stride + h * (D + 2) + D]);
    __m512 o[MAX_DV];
    float l = 0.0f;
    for (int64_t v = 0; v < D / 16; v++) o[v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        const float *p = parts + c * stride + h * (D + 2);
        const __m512 f = exp_ps(_mm512_set1_ps(p[D] - M));
        l += _mm512_cvtss_f32(f) * p[D + 1];
        for (int64_t v = 0; v < D / 16; v++) o[v] = _mm512_fmadd_ps(f, _mm512_loadu_ps(p + v * 16), o[v]);
    }
    const __m512 inv = _mm512_set1_ps(1.0f / l);
    for (int64_t v = 0; v < D / 16; v++)
        _mm256_storeu_si256((__m256i *)(out + h * D + v * 16), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(o[v], inv)));
}

/* q: row i at q + i * ldq, H heads of D. kv: slot s holds K heads at kv + s * slot_stride and V heads KV * D after.
 * Sequence i's positions are slots[starts[i] .. starts[i + 1]). out: row i at out + i * ldo, H heads of D.
 * Needs D % 16 == 0, D <= 256, H <= 256 (the caller checks). */
void kvf_decode_attention(const uint16_t *q, int64_t ldq, const uint16_t *kv, int64_t slot_stride,
                          const int64_t *slots, const int64_t *starts, int64_t n, int64_t H, int64_t KV, int64_t D,
                          float scale, uint16_t *out, int64_t ldo, int nthreads) {
    const int64_t G = H / KV, DV = D / 16, stride = H * (D + 2);
    int64_t longest;
    const int64_t tasks = chunk_tasks(starts, n, &longest);
    /* chunk_table's table and first, then the tasks' partials */
    int64_t *table = caller_buffer(8 * (2 * tasks + n + 1) + 4 * stride * tasks + 64), *first = table + 2 * tasks;
    float *parts = (float *)((uintptr_t)(first + n + 1) / 64 * 64 + 64);
    chunk_table(starts, n, table, first);
    const int64_t ld = chunk_positions(longest); /* a multiple of 32: room for any chunk rounded up to 16 */
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *sc = thread_buffer(BUF_SCORES, sizeof(float) * H * ld);
        for (int64_t k = tasks * t / nt; k < tasks * (t + 1) / nt; k++) {
            const int64_t i = table[2 * k], p = table[2 * k + 1], S = starts[i + 1] - starts[i];
            const int64_t C = chunk_positions(S), m = S - p < C ? S - p : C, *pos = slots + starts[i] + p;
            const uint16_t *qi = q + i * ldq;
            float *part = parts + k * stride;
            if (DV == 4) attend_chunk(qi, kv, slot_stride, pos, m, S - p, KV, 4, G, scale, sc, ld, part);
            else if (DV == 8) attend_chunk(qi, kv, slot_stride, pos, m, S - p, KV, 8, G, scale, sc, ld, part);
            else attend_chunk(qi, kv, slot_stride, pos, m, S - p, KV, DV, G, scale, sc, ld, part);
        }
#pragma omp barrier
        for (int64_t r = n * H * t / nt; r < n * H * (t + 1) / nt; r++) {
            const int64_t i = r / H;
            merge_chunks(parts + first[i] * stride, first[i + 1] - first[i], H, r % H, D, out + i * ldo);
        }
    }
}

/* ---- prefill attention, on tiles or (built without them) on vectors -------------------------------------------
 *
 * For one K/V head of one sequence: its S positions are packed once into tile layouts (K transposed in pairs of d,
 * V in pairs of positions; zeros past S), then up to 16 query rows that share the head attend: scores on tiles
 * (fp32), a float32 softmax over the positions each row sees, the weights rounded to bf16 for the product with V
 * on tiles (or vdpbf16ps, below), and that divided by the weights' (fp32) sum. A task is one query head and 16 of
 * its queries, each seeing the positions up to its own; it reads only its own rows and head and runs the same
 * instructions whichever thread runs it, so a chunk's result depends on nothing else in the batch.
 */
#define TILE_MAX_D 64

typedef struct { /* a K/V head's packed positions (shared by a call's threads), and one thread's score buffers */
    const uint32_t *kt, *vp;
    float *sc;
    uint16_t *p;
    int64_t cap;
} attn_scratch;

/* Positions [j0, j1) (j0 a multiple of 32) of K/V head h of slots[0 .. S) into the tile layouts kt (per 16
 * positions, per 32 d: [16 d pairs][16 positions]) and vp (per 32 positions, per 16 d: [16 position pairs][16 d]);
 * zeros past S. */
static void pack_head(const uint16_t *kv, int64_t slot_stride, const int64_t *slots, int64_t S, int64_t j0,
                      int64_t j1, int64_t h, int64_t KV, int64_t D, uint32_t *kt, uint32_t *vp) {
    const int64_t DP = D / 32;
    for (int64_t b = j0; b < j1; b += 16)
        for (int64_t d = 0; d < D; d += 32) {
            __m512i r[16];
            for (int64_t j = 0; j < 16; j++)
                r[j] = b + j < S ? _mm512_loadu_si512(kv + slots[b + j] * slot_stride + h * D + d) : _mm512_setzero_si512();
            transpose16(r);
            for (int64_t i = 0; i < 16; i++) _mm512_store_si512(kt + (b / 16 * DP + d / 32) * 256 + i * 16, r[i]);
        }
    for (int64_t b = j0; b < j1; b += 32)
        for (int64_t i = 0; i < 16; i++) {
            const int64_t a = b + 2 * i, c = a + 1;
            for (int64_t d = 0; d < D; d += 16) {
                const __m256i va = a < S ? _mm256_loadu_si256((const __m256i *)(kv + slots[a] * slot_stride + (KV + h) * D + d))
                                         : _mm256_setzero_si256();
                const __m256i vb = c < S ? _mm256_loadu_si256((const __m256i *)(kv + slots[c] * slot_stride + (KV + h) * D + d))
                                         : _mm256_setzero_si256();
                _mm512_store_si512(vp + (b / 32 * (D / 16) + d / 16) * 256 + i * 16,
                                   _mm512_or_si512(_mm512_cvtepu16_epi32(va), _mm512_slli_epi32(_mm512_cvtepu16_epi32(vb), 16)));
            }
        }
}

/* Each score row r < rows of w->sc's max over the positions [0, seen[r]) it sees. */
static void row_maxes(int64_t rows, const int64_t *seen, const attn_scratch *w, float mx[16]) {
    for (int64_t r = 0; r < rows; r++) {
        const float *row = w->sc + r * w->cap;
        __m512 m = _mm512_set1_ps(-FLT_MAX);
        int64_t j = 0;
        for (; j + 16 <= seen[r]; j += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(row + j));
        if (j < seen[r]) m = _mm512_mask_max_ps(m, first_lanes(seen[r] - j), m, _mm512_loadu_ps(row + j));
        mx[r] = _mm512_reduce_max_ps(m);
    }
}

/* Softmax weights of score rows r < 16 of w->sc (r sees positions [0, seen[r]) when r < rows, none otherwise; mx[r]
 * its max score): 2^(s c - round(max c)) with c = scale log2(e) (one fused multiply-subtract, so at the max it is
 * within half an ulp of 0), unnormalised, rounded to bf16 into w->p, zero past what r sees up to ``keys32``; inv[r] = 1 / their
 * fp32 sum (0 for r >= rows). */
static void softmax_rows(int64_t rows, const int64_t *seen, const float mx[16], int64_t keys32, float scale,
                         attn_scratch *w, float inv[16]) {
    const int64_t ld = w->cap;
    const float scale2 = scale * 1.44269504088896341f; /* e^(s scale) = 2^(s scale log2(e)) */
    const __m512 sv = _mm512_set1_ps(scale2);
    for (int64_t r = 0; r < 16; r++) {
        const float *row = w->sc + r * ld;
        uint16_t *pr = w->p + r * ld;
        const int64_t n = r < rows ? seen[r] : 0;
        const __m512 mv = _mm512_set1_ps(r < rows ? mx[r] * scale2 : 0.0f);
        __m512 sum = _mm512_setzero_ps();
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
            const __m512 e = exp2_weight_ps(_mm512_fmsub_ps(_mm512_loadu_ps(row + j), sv, mv));
            sum = _mm512_add_ps(sum, e);
            _mm256_store_si256((__m256i *)(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
        }
        if (j < n) {
            const __mmask16 m = first_lanes(n - j);
            const __m512 e = _mm512_maskz_mov_ps(m, exp2_weight_ps(_mm512_fmsub_ps(_mm512_maskz_loadu_ps(m, row + j), sv, mv)));
            sum = _mm512_add_ps(sum, e);
            _mm256_store_si256((__m256i *)(pr + j), (__m256i)_mm512_cvtneps_pbh(e));
            j += 16;
        }
        for (; j < keys32; j += 16) _mm256_store_si256((__m256i *)(pr + j), _mm256_setzero_si256());
        inv[r] = r < rows ? 1.0f / _mm512_reduce_add_ps(sum) : 0.0f;
    }
}

#ifdef __AMX_BF16__
/* Rows r < rows of qb ([16][D], zero past rows) over the packed head: row r sees positions [0, seen[r]) and its
 * output goes to dst[r] (D bf16). Needs seen[r] >= 1 and the packed head to hold max(seen) positions. */
static void attend_rows(const uint16_t *qb, int64_t rows, const int64_t *seen, uint16_t *const *dst, int64_t D,
                        float scale, attn_scratch *w) {
    const int64_t DP = D / 32, ld = w->cap;
    int64_t last = 0;
    for (int64_t r = 0; r < rows; r++) last = seen[r] > last ? seen[r] : last;
    const int64_t keys16 = (last + 15) / 16 * 16, keys32 = (last + 31) / 32 * 32;
    _tile_loadd(4, qb, D * 2); /* the rows' d [0, 32), and [32, 64) */
    if (D > 32) _tile_loadd(5, qb + 32, D * 2);
    /* scores: 16 rows x 16 positions per block, two blocks at a time into tiles 0 and 1 (K in 6, 7 and 2, 3), so
     * that one block's products do not wait for the other's store; each score sums d [0, 32) then [32, 64). */
    int64_t j0 = 0;
    for (; j0 + 32 <= keys16; j0 += 32) {
        const uint32_t *ka = w->kt + j0 / 16 * DP * 256, *kb = ka + DP * 256;
        _tile_zero(0);
        _tile_zero(1);
        _tile_loadd(6, ka, 64);
        _tile_loadd(2, kb, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 2);
        if (D > 32) {
            _tile_loadd(7, ka + 256, 64);
            _tile_loadd(3, kb + 256, 64);
            _tile_dpbf16ps(0, 5, 7);
            _tile_dpbf16ps(1, 5, 3);
        }
        _tile_stored(0, w->sc + j0, ld * 4);
        _tile_stored(1, w->sc + j0 + 16, ld * 4);
    }
    if (j0 < keys16) {
        _tile_zero(0);
        _tile_loadd(6, w->kt + j0 / 16 * DP * 256, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (D > 32) {
            _tile_loadd(7, w->kt + (j0 / 16 * DP + 1) * 256, 64);
            _tile_dpbf16ps(0, 5, 7);
        }
        _tile_stored(0, w->sc + j0, ld * 4);
    }
    float inv[16], top[16];
    row_maxes(rows, seen, w, top);
    softmax_rows(rows, seen, top, keys32, scale, w, inv);
    /* weights x V: 16 rows x D into tiles 0-3, 16 d each; the weights alternate between tiles 4 and 5 and V between
     * 6 and 7, so a load need not wait for the product still reading the tile before it */
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t j0 = 0; j0 < keys32; j0 += 64) {
        const uint32_t *va = w->vp + j0 / 32 * (D / 16) * 256, *vb = va + D / 16 * 256;
        const int second = j0 + 32 < keys32;
        _tile_loadd(4, w->p + j0, ld * 2);
        if (second) _tile_loadd(5, w->p + j0 + 32, ld * 2);
        _tile_loadd(6, va, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, va + 256, 64);
        _tile_dpbf16ps(1, 4, 7);
        if (D > 32) {
            _tile_loadd(6, va + 512, 64);
            _tile_dpbf16ps(2, 4, 6);
            _tile_loadd(7, va + 768, 64);
            _tile_dpbf16ps(3, 4, 7);
        }
        if (!second) break;
        _tile_loadd(6, vb, 64);
        _tile_dpbf16ps(0, 5, 6);
        _tile_loadd(7, vb + 256, 64);
        _tile_dpbf16ps(1, 5, 7);
        if (D > 32) {
            _tile_loadd(6, vb + 512, 64);
            _tile_dpbf16ps(2, 5, 6);
            _tile_loadd(7, vb + 768, 64);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
    float o[4 * 256] __attribute__((aligned(64)));
    _tile_stored(0, o, 64);
    if (D > 16) _tile_stored(1, o + 256, 64);
    if (D > 32) _tile_stored(2, o + 512, 64);
    if (D > 48) _tile_stored(3, o + 768, 64);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < D / 16; c++)
            _mm256_storeu_si256((__m256i *)(dst[r] + c * 16), (__m256i)_mm512_cvtneps_pbh(
                _mm512_mul_ps(_mm512_load_ps(o + c * 256 + r * 16), _mm512_set1_ps(inv[r]))));
}

#else
/* Scores of 4 query rows (q32: pairs of d, D / 2 per row) against NB blocks of 16 packed positions from j0, into
 * sc (rows ld apart): 4 NB independent chains, each its own sum over the pairs of d, ascending. */
#define SCORES(NB)                                                                                               \
    static inline void scores_##NB(const uint32_t *q32, int64_t D, const uint32_t *kt, int64_t j0, float *sc,    \
                                   int64_t ld) {                                                                 \
        __m512 acc[4 * NB];                                                                                      \
        UNROLL for (int i = 0; i < 4 * NB; i++) acc[i] = _mm512_setzero_ps();                                    \
        for (int64_t p = 0; p < D / 2; p++) {                                                                    \
            __m512bh kp[NB];                                                                                     \
            UNROLL for (int b = 0; b < NB; b++)                                                                  \
                kp[b] = (__m512bh)_mm512_load_si512(kt + ((j0 / 16 + b) * (D / 32) + p / 16) * 256 + p % 16 * 16); \
            UNROLL for (int r = 0; r < 4; r++) {                                                                 \
                const __m512bh qv = (__m512bh)_mm512_set1_epi32(q32[r * D / 2 + p]);                             \
                UNROLL for (int b = 0; b < NB; b++) acc[r * NB + b] = _mm512_dpbf16_ps(acc[r * NB + b], qv, kp[b]); \
            }                                                                                                    \
        }                                                                                                        \
        UNROLL for (int r = 0; r < 4; r++)                                                                       \
            UNROLL for (int b = 0; b < NB; b++) _mm512_storeu_ps(sc + r * ld + j0 + 16 * b, acc[r * NB + b]);    \
    }
SCORES(4)
SCORES(1)

/* 4 rows' weights (bf16 rows pr, ld apart) times V over position pairs [0, pairs) -> out (4 rows of DV x 16 fp32):
 * 4 DV independent chains over the pairs, ascending. */
#define WEIGH_V(DV)                                                                                              \
    static inline void weigh_v_##DV(const uint16_t *pr, int64_t ld, const uint32_t *vp, int64_t pairs, __m512 *out) { \
        __m512 o[4 * DV];                                                                                        \
        UNROLL for (int i = 0; i < 4 * DV; i++) o[i] = _mm512_setzero_ps();                                      \
        for (int64_t P = 0; P < pairs; P++) {                                                                    \
            __m512bh pw[4];                                                                                      \
            UNROLL for (int r = 0; r < 4; r++) pw[r] = (__m512bh)_mm512_set1_epi32(((const uint32_t *)(pr + r * ld))[P]); \
            UNROLL for (int c = 0; c < DV; c++) {                                                                \
                const __m512bh v = (__m512bh)_mm512_load_si512(vp + (P / 16 * DV + c) * 256 + P % 16 * 16);     \
                UNROLL for (int r = 0; r < 4; r++) o[r * DV + c] = _mm512_dpbf16_ps(o[r * DV + c], pw[r], v);    \
            }                                                                                                    \
        }                                                                                                        \
        UNROLL for (int i = 0; i < 4 * DV; i++) out[i] = o[i];                                                   \
    }
WEIGH_V(4)
WEIGH_V(2)

/* attend_rows on vectors (no tiles; the same packed layouts and the same softmax): scores with vdpbf16ps, 4 rows
 * x 64 positions at a time, then the bf16 weights times V with vdpbf16ps over pairs of positions, ascending, up to
 * the last pair a row of the 4 sees; the weights past what a row sees are zero and add exact zeros, as on tiles.
 * D is 32 or 64. */
static void attend_rows(const uint16_t *qb, int64_t rows, const int64_t *seen, uint16_t *const *dst, int64_t D,
                        float scale, attn_scratch *w) {
    const int64_t ld = w->cap, DV = D / 16;
    int64_t last = 0;
    for (int64_t r = 0; r < rows; r++) last = seen[r] > last ? seen[r] : last;
    const int64_t keys16 = (last + 15) / 16 * 16, keys32 = (last + 31) / 32 * 32;
    for (int64_t r0 = 0; r0 < rows; r0 += 4) { /* rows past ``rows`` are zero queries; their scores go unused */
        const uint32_t *q32 = (const uint32_t *)(qb + r0 * D);
        int64_t j0 = 0;
        for (; j0 + 64 <= keys16; j0 += 64) scores_4(q32, D, w->kt, j0, w->sc + r0 * ld, ld);
        for (; j0 < keys16; j0 += 16) scores_1(q32, D, w->kt, j0, w->sc + r0 * ld, ld);
    }
    float inv[16], top[16];
    row_maxes(rows, seen, w, top);
    softmax_rows(rows, seen, top, keys32, scale, w, inv);
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
        const int64_t nr = rows - r0 < 4 ? rows - r0 : 4;
        int64_t most = 0;
        for (int64_t r = 0; r < nr; r++) most = seen[r0 + r] > most ? seen[r0 + r] : most;
        __m512 o[16];
        if (DV == 4) weigh_v_4(w->p + r0 * ld, ld, w->vp, (most + 1) / 2, o);
        else weigh_v_2(w->p + r0 * ld, ld, w->vp, (most + 1) / 2, o);
        for (int64_t r = 0; r < nr; r++)
            for (int64_t c = 0; c < DV; c++)
                _mm256_storeu_si256((__m256i *)(dst[r0 + r] + c * 16), (__m256i)_mm512_cvtneps_pbh(
                    _mm512_mul_ps(o[r * DV + c], _mm512_set1_ps(inv[r0 + r]))));
    }
}
#endif

/* One chunk of n queries at positions S - n .. S - 1 over its sequence's S positions (slots), causal. q: row i at
 * q + i * ldq, H heads of D; out: row i at out + i * ldo. D is 32 or 64 (the caller checks).
 * First each K/V head is packed once (the team splits the heads' 64-position spans), then the team takes tasks of
 * one query head and 16 query rows, dealt round-robin from the costliest (last rows, most keys), so the threads
 * end together. */
void kvf_prefill_attention(const uint16_t *q, int64_t ldq, const uint16_t *kv, int64_t slot_stride,
                           const int64_t *slots, int64_t n, int64_t S, int64_t H, int64_t KV, int64_t D, float scale,
                           uint16_t *out, int64_t ldo, int nthreads) {
    const int64_t G = H / KV, cap = (S + 63) / 64 * 64, head = cap * D, spans = cap / 64, blocks = (n + 15) / 16;
    uint32_t *packed = caller_buffer(KV * head * 4); /* per K/V head: kt (cap D / 2 words), then vp (as many) */
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t t = 0; t < KV * spans; t++) {
            uint32_t *kt = packed + t / spans * head;
            pack_head(kv, slot_stride, slots, S, t % spans * 64, t % spans * 64 + 64, t / spans, KV, D, kt, kt + head / 2);
        }
        attn_scratch w = {.sc = thread_buffer(BUF_SCORES, 16 * cap * 4), .p = thread_buffer(BUF_WEIGHTS, 16 * cap * 2),
                          .cap = cap};
        uint16_t qb[16 * TILE_MAX_D] __attribute__((aligned(64)));
#ifdef __AMX_BF16__
        configure_tiles();
#endif
#pragma omp for schedule(static, 1)
        for (int64_t t = 0; t < H * blocks; t++) {
            const int64_t h = t % H, i0 = (blocks - 1 - t / H) * 16, rows = block_rows(n - i0);
            w.kt = packed + h / G * head, w.vp = w.kt + head / 2;
            int64_t seen[16];
            uint16_t *dst[16];
            memset(qb, 0, sizeof qb);
            for (int64_t r = 0; r < rows; r++) {
                memcpy(qb + r * D, q + (i0 + r) * ldq + h * D, D * 2);
                seen[r] = S - n + i0 + r + 1, dst[r] = out + (i0 + r) * ldo + h * D;
            }
            attend_rows(qb, rows, seen, dst, D, scale, &w);
        }
#ifdef __AMX_BF16__
        _tile_release();
#endif
    }
}

/* ---- row-wise steps around the matmuls (bf16, one row at a time, same order for every row) --------------------- */

/* x[t] = bf16(x[t] + y[t]) when y is given; then h[t] = bf16(w * bf16(x[t] / sqrt(mean(x[t]^2) + eps))) (HF
 * LlamaRMSNorm in bf16). The sum of squares runs over 16 fp32 lanes then one fixed-order lane sum. */
void kvf_add_rms_norm(uint16_t *x, int64_t ldx, const uint16_t *y, int64_t ldy, const uint16_t *w, uint16_t *h,
                      int64_t ldh, int64_t T, int64_t N, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 64)
    for (int64_t t = 0; t < T; t++) {
        uint16_t *xr = x + t * ldx, *hr = h + t * ldh;
        const int64_t N16 = N / 16 * 16;
        int64_t j;
        if (y) {
            const uint16_t *yr = y + t * ldy;
            for (j = 0; j < N16; j += 16)
                _mm256_storeu_si256((__m256i *)(xr + j),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(load_f32(xr + j), load_f32(yr + j))));
            for (; j < N; j++) xr[j] = f32_to_bf16(bf16_to_f32(xr[j]) + bf16_to_f32(yr[j]));
        }
        __m512 acc = _mm512_setzero_ps();
        for (j = 0; j < N16; j += 16) {
            __m512 v = load_f32(xr + j);
            acc = _mm512_fmadd_ps(v, v, acc);
        }
        float ss = _mm512_reduce_add_ps(acc);
        for (j = N16; j < N; j++) ss += bf16_to_f32(xr[j]) * bf16_to_f32(xr[j]);
        const float r = 1.0f / sqrtf(ss / (float)N + eps);
        const __m512 rv = _mm512_set1_ps(r);
        for (j = 0; j < N16; j += 16) {
            __m256i xn = (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(load_f32(xr + j), rv));
            __m512 xf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(xn), 16));
            _mm256_storeu_si256((__m256i *)(hr + j), (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(load_f32(w + j), xf)));
        }
        for (; j < N; j++) hr[j] = f32_to_bf16(bf16_to_f32(w[j]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[j]) * r)));
    }
}

static inline __m512 round_bf16(__m512 x) { /* to the nearest bf16 (even on ties), kept as fp32 */
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}

/* Rotary embedding in place on the H + KV query and key heads of each row of qkv (HF rotate_half; each product and
 * the sum rounded to bf16, as torch does), then that row's K and V heads (the 2 KV after them, in the pool's
 * [2, KV, D] order) copied to pool slot slots[t]. cos/sin: row t at + t * D; sin has rotate_half's sign folded in. */
void kvf_rope_write(uint16_t *qkv, int64_t ldq, int64_t H, int64_t KV, int64_t D, const uint16_t *cos,
                    const uint16_t *sin, int64_t T, uint16_t *kv, int64_t slot_stride, const int64_t *slots,
                    int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 64)
    for (int64_t t = 0; t < T; t++) {
        uint16_t tmp[512];
        const uint16_t *c = cos + t * D, *s = sin + t * D;
        for (int64_t head = 0; head < H + KV; head++) {
            uint16_t *v = qkv + t * ldq + head * D;
            memcpy(tmp, v, D * sizeof(uint16_t));
            if (D % 32 == 0) { /* 16 at a time: element e's partner e + D / 2 lies in the chunk half a head on */
                for (int64_t e = 0; e < D; e += 16) {
                    const __m512 a = round_bf16(_mm512_mul_ps(load_f32(tmp + e), load_f32(c + e)));
                    const __m512 b = round_bf16(_mm512_mul_ps(load_f32(tmp + (e + D / 2) % D), load_f32(s + e)));
                    _mm256_storeu_si256((__m256i *)(v + e), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(a, b)));
                }
                continue;
            }
            rope_head_scalar(v, tmp, c, s, D);
        }
        memcpy(kv + slots[t] * slot_stride, qkv + t * ldq + H * D, 2 * KV * D * sizeof(uint16_t));
    }
}

/* out[t] = bf16(bf16(silu(g)) * u) for g, u the two halves of row t of gate_up ([T, 2 F], gate first), rounding
 * as torch's bf16 ``silu(gate).mul_(up)`` does; its exp differs from ``exp_ps`` in the last bits of fp32, which
 * the bf16 rounding almost always hides (2 of 313,344 values differed, both below 1e-35). Row by row. */
void kvf_silu_mul(const uint16_t *gate_up, int64_t ldg, uint16_t *out, int64_t ldo, int64_t T, int64_t F,
                  int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * ldg, *u = g + F;
        uint16_t *o = out + t * ldo;
        for (int64_t j = 0; j < F; j += 16) {
            const __mmask16 mask = first_lanes(F - j);
            const __m512 gv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, g + j)), 16));
            const __m512 uv = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, u + j)), 16));
            const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(gv)));  /* e^-|g| */
            const __m512 one = _mm512_set1_ps(1.0f);
            const __mmask16 neg = _mm512_cmp_ps_mask(gv, _mm512_setzero_ps(), _CMP_LT_OQ);
            const __m512 sig = _mm512_div_ps(_mm512_mask_blend_ps(neg, one, e), _mm512_add_ps(one, e));
            const __m512 silu = round_bf16(_mm512_mul_ps(gv, sig));
            _mm256_mask_storeu_epi16(o + j, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, uv)));
        }
    }
}

#ifdef __AVX512VNNI__
#include "decode_step.h"
#endif
