/* The row kernels of decode_gemm.c for x86-64 CPUs with AVX2, FMA and F16C but no AVX512-BF16 (AMD before Zen 4,
 * Zen 4 guests whose hypervisor hides AVX-512, Intel before Cooper Lake). Same entry points, same contracts, same layouts; 8 fp32 lanes
 * instead of 16 and no AMX, so its bits are its own: every kernel here is row- (or sequence-) independent by
 * construction on its own terms, which is what batch invariance needs on one machine.
 *
 * gemm: y[m, n] = sum_k x[m, k] w[n, k], w bf16 or GGUF blocks (expanded exactly as decode_gemm.c expands them).
 * x and each task's weight rows are first widened to fp32 (K rounded up to 8 with zeros); then each output
 * accumulates k in 8 lanes (k mod 8), ascending, one FMA per slice, then one fixed-order lane sum (``sum8``) and
 * a round to bf16 (nearest even). Which register block (4 x 3, 1 x 8 or 1 x 1) or thread computes an element
 * changes nothing of that sequence. Threads split N in blocks of 24 weight rows.
 * Built by kernels.py with -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fopenmp.
 */
#include <immintrin.h>
#include <float.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"
#include "blocks.h"
#include "decode_chunks.h"

int kvf_amx_init(void) { return 0; } /* no tiles here: kernels.py then never asks for AMX entry points */

static inline __m256 load8(const uint16_t *p) { /* 8 bf16 -> fp32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

static inline __m256 load_tail(const uint16_t *p, int64_t n) { /* the first n < 8 of 8, the rest 0 */
    uint16_t tmp[8] = {0};
    memcpy(tmp, p, n * sizeof(uint16_t));
    return load8(tmp);
}

/* 8 fp32 -> 8 bf16, nearest even (f32_to_bf16 lane by lane, NaN kept quiet). */
static inline __m128i to_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40)), nan);
    return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

static inline void store8(uint16_t *p, __m256 v) { _mm_storeu_si128((__m128i *)p, to_bf16(v)); }

static inline __m256 round_bf16(__m256 v) { /* to the nearest bf16, kept as fp32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(to_bf16(v)), 16));
}

/* Slot l of the result = the 8 lanes of v[l] summed as ((0 + 1) + (2 + 3)) + ((4 + 5) + (6 + 7)), whatever l. */
static inline __m256 sum8(const __m256 *v) {
    const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

static inline float sum1(__m256 v) { /* the same order as one slot of sum8 */
    const __m128 t = _mm_hadd_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1)); /* 0+1 2+3 4+5 6+7 */
    const __m128 u = _mm_hadd_ps(t, t);
    return _mm_cvtss_f32(_mm_add_ss(u, _mm_movehdup_ps(u)));
}

/* ---- gemm ---------------------------------------------------------------------------------------------------- */

/* acc[i * NB + j] = x row i . w row j: rows of K8 fp32 (zero past K), x rows K8 apart, w rows K8 apart. */
#define UNROLL _Pragma("GCC unroll 16")
#define DOT(MB, NB)                                                                                              \
    static inline void dot_##MB##x##NB(const float *xf, const float *wf, int64_t K8, __m256 *out) {             \
        __m256 acc[MB * NB];                                                                                     \
        UNROLL for (int i = 0; i < MB * NB; i++) acc[i] = _mm256_setzero_ps();                                   \
        for (int64_t k = 0; k < K8; k += 8) {                                                                    \
            __m256 wv[NB];                                                                                       \
            UNROLL for (int j = 0; j < NB; j++) wv[j] = _mm256_loadu_ps(wf + j * K8 + k);                        \
            UNROLL for (int i = 0; i < MB; i++) {                                                                \
                const __m256 xv = _mm256_loadu_ps(xf + i * K8 + k);                                              \
                UNROLL for (int j = 0; j < NB; j++) acc[i * NB + j] = _mm256_fmadd_ps(xv, wv[j], acc[i * NB + j]); \
            }                                                                                                    \
        }                                                                                                        \
        UNROLL for (int i = 0; i < MB * NB; i++) out[i] = acc[i];                                                \
    }

DOT(4, 3)
DOT(1, 8)
DOT(1, 1)

/* Results r[0 .. n) (n <= 8) rounded to bf16 at y[0 .. n). */
static inline void store_n(__m256 r, int n, uint16_t *y) {
    uint16_t tmp[8];
    _mm_storeu_si128((__m128i *)tmp, to_bf16(r));
    memcpy(y, tmp, n * sizeof(uint16_t));
}

/* This thread's fp32 buffer ``slot`` (0: the caller's x, 1: a task's weight rows, 2: quantized x, 3: the decode
 * attention's tasks and partials, 4: a decode attention task's scratch) of at least n values. */
static float *f32_buffer(int slot, int64_t n) {
    static __thread float *buf[5];
    static __thread int64_t cap[5];
    if (n > cap[slot]) {
        free(buf[slot]);
        cap[slot] = n + n / 2;
        buf[slot] = aligned_alloc(64, (cap[slot] * sizeof(float) + 63) / 64 * 64);
    }
    return buf[slot];
}

/* GGUF weight blocks (blocks.py): rows of K / 32 blocks, a row's fields gathered (every fp16 d, for Q4_1 every
 * fp16 m, then the values; Q4_1 values paired: byte j of a pair holds block a's weight j in its low nibble and
 * block b's in its high one, an odd last block in the GGUF's order); K-quant rows of GGUF super-blocks (blocks.h).
 */

static inline __m256 round_finite(__m256 v) { /* to the nearest bf16 (even on ties) as to_bf16, v not NaN */
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff)));
    return _mm256_castsi256_ps(_mm256_and_si256(r, _mm256_set1_epi32((int)0xffff0000u)));
}

static inline __m256 nibbles(__m256i v, int high) { /* 8 4-bit values of 8 bytes (widened to 32 bits) */
    return _mm256_cvtepi32_ps(high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(0x0f)));
}

/* One Q8_0 block (fp16 scale d, 32 int8 at qs) -> its 32 weights as fp32 holding bf16(d q). */
static inline void widen_q8_block(const int8_t *qs, uint16_t d, __m256 v[4]) {
    const __m256 dv = _mm256_set1_ps(_cvtsh_ss(d));
    for (int j = 0; j < 4; j++) {
        const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * j)));
        v[j] = round_finite(_mm256_mul_ps(dv, _mm256_cvtepi32_ps(q)));
    }
}

/* Blocks b, b + 1 (b even) of a row of nb Q4_1 or Q8_0 blocks -> their 64 weights in k order, as fp32 holding
 * bf16(d q + m) (Q8_0: bf16(d q)): what gguf's dequantize then a cast to bf16 give (d q is exact in fp32, so the
 * FMA rounds as a multiply then an add do). */
static inline void widen_pair(const uint8_t *row, int fmt, int64_t nb, int64_t b, __m256 v[8]) {
    const uint16_t *d = (const uint16_t *)row;
    if (fmt == FMT_Q8_0) {
        const int8_t *qs = (const int8_t *)(row + 2 * nb) + 32 * b;
        widen_q8_block(qs, d[b], v);
        widen_q8_block(qs + 32, d[b + 1], v + 4);
        return;
    }
    const uint16_t *m = d + nb;
    const uint8_t *qs = row + 4 * nb + 16 * b;
    const __m256 da = _mm256_set1_ps(_cvtsh_ss(d[b])), ma = _mm256_set1_ps(_cvtsh_ss(m[b]));
    const __m256 db = _mm256_set1_ps(_cvtsh_ss(d[b + 1])), mb = _mm256_set1_ps(_cvtsh_ss(m[b + 1]));
    for (int j = 0; j < 4; j++) { /* byte i of a pair: block b's weight i (low nibble), b + 1's (high) */
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * j)));
        v[j] = round_finite(_mm256_fmadd_ps(da, nibbles(q, 0), ma));
        v[4 + j] = round_finite(_mm256_fmadd_ps(db, nibbles(q, 1), mb));
    }
}

/* A K-quant row of K weights (K % 256 == 0) -> K fp32 at out holding bf16(fp32(D q - M)) (blocks.h). */
static void widen_kquant_row(const uint8_t *row, int fmt, int64_t K, float *out) {
    int8_t q[QK_K];
    float D[16], M[16];
    for (int64_t s = 0; s < K / QK_K; s++, out += QK_K) {
        kquant_unpack(row + s * BLOCK_BYTES[fmt], fmt, q, D, M);
        for (int i = 0; i < QK_K; i += 8) {
            const __m256 v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(q + i))));
            _mm256_storeu_ps(out + i, round_finite(_mm256_fmsub_ps(_mm256_set1_ps(D[i / 16]), v,
                                                                   _mm256_set1_ps(M[i / 16]))));
        }
    }
}

/* Weight row -> K fp32 at out, zero up to K8: bf16 widened, or blocks expanded as widen_pair (K-quants:
 * widen_kquant_row) does. So a model that keeps its blocks computes the bits of its dequantized bf16 copy. */
static void widen_row(const uint8_t *row, int fmt, int64_t K, int64_t K8, float *out) {
    if (is_kquant(fmt)) { /* K % 256 == 0: K8 == K */
        widen_kquant_row(row, fmt, K, out);
        return;
    }
    if (fmt == FMT_BF16) {
        const uint16_t *w = (const uint16_t *)row;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(out + k, load8(w + k));
        for (; k < K8; k++) out[k] = k < K ? bf16_to_f32(w[k]) : 0.0f;
        return;
    }
    const int64_t nb = K / 32, b = nb / 2 * 2;
    for (int64_t p = 0; p < b; p += 2) {
        __m256 v[8];
        widen_pair(row, fmt, nb, p, v);
        for (int j = 0; j < 8; j++) _mm256_storeu_ps(out + 32 * p + 8 * j, v[j]);
    }
    if (b == nb) return;
    const uint16_t *d = (const uint16_t *)row;
    if (fmt == FMT_Q8_0) {
        __m256 v[4];
        widen_q8_block((const int8_t *)(row + 2 * nb) + 32 * b, d[b], v);
        for (int j = 0; j < 4; j++) _mm256_storeu_ps(out + 32 * b + 8 * j, v[j]);
        return;
    }
    const __m256 db = _mm256_set1_ps(_cvtsh_ss(d[b])), mb = _mm256_set1_ps(_cvtsh_ss(d[nb + b]));
    const uint8_t *qs = row + 4 * nb + 16 * b;
    for (int j = 0; j < 16; j += 8) { /* an odd last block in the GGUF's order: byte i holds weights i and i + 16 */
        const __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + j)));
        _mm256_storeu_ps(out + 32 * b + j, round_finite(_mm256_fmadd_ps(db, nibbles(q, 0), mb)));
        _mm256_storeu_ps(out + 32 * b + 16 + j, round_finite(_mm256_fmadd_ps(db, nibbles(q, 1), mb)));
    }
}

/* acc[j] = x . weight row j for ``rows`` block rows at w (row_bytes apart): the FMAs of dot_1x8 / dot_1x1 over
 * their widened rows in the same order, with each pair of blocks expanded into registers instead of a buffer
 * (one x row uses each weight once). Rows go two at a time, two independent chains. Needs K % 64 == 0. */
static void dot_block_rows(const float *xf, const uint8_t *w, int fmt, int64_t row_bytes, int64_t K, int rows,
                           __m256 *acc) {
    const int64_t nb = K / 32;
    for (int j = 0; j < rows; j += 2) {
        const int n = j + 1 < rows ? 2 : 1;
        __m256 a[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
        for (int64_t b = 0; b < nb; b += 2)
            for (int r = 0; r < n; r++) {
                __m256 v[8];
                widen_pair(w + (j + r) * row_bytes, fmt, nb, b, v);
                for (int i = 0; i < 8; i++) a[r] = _mm256_fmadd_ps(_mm256_loadu_ps(xf + 32 * b + 8 * i), v[i], a[r]);
            }
        for (int r = 0; r < n; r++) acc[j + r] = a[r];
    }
}

/* Rows ``rows[0 .. n)`` of a block matrix -> bf16 (the embedding's gather). */
void kvf_expand_rows(const uint8_t *w, int fmt, const int64_t *rows, int64_t n, int64_t K, uint16_t *out) {
    float *row = f32_buffer(0, K);
    for (int64_t i = 0; i < n; i++) {
        widen_row(w + rows[i] * row_bytes_of(fmt, K), fmt, K, K, row);
        for (int64_t k = 0; k < K; k += 8) store8(out + i * K + k, _mm256_loadu_ps(row + k));
    }
}

#define NBLOCK 24 /* weight rows per task: 8 x 3 or 3 x 8 */

/* w: N rows of format fmt, ``row_bytes`` apart. A task widens its NBLOCK weight rows to fp32 once, then every x
 * row passes over them. */
static void gemm(const uint16_t *x, int64_t ldx, const uint8_t *w, int fmt, int64_t row_bytes, uint16_t *y,
                 int64_t ldy, int64_t M, int64_t N, int64_t K, int nthreads) {
    const int64_t K8 = (K + 7) / 8 * 8, tasks = (N + NBLOCK - 1) / NBLOCK;
    float *xf = f32_buffer(0, M * K8);
    for (int64_t m = 0; m < M; m++) widen_row((const uint8_t *)(x + m * ldx), FMT_BF16, K, K8, xf + m * K8);
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t n0 = task * NBLOCK, n1 = n0 + NBLOCK < N ? n0 + NBLOCK : N;
        float *wf = f32_buffer(1, NBLOCK * K8), r[16];
        __m256 acc[16];
        if (M == 1 && (fmt == FMT_Q4_1 || fmt == FMT_Q8_0) && K % 64 == 0) { /* one row: no buffer, 1.07-1.37x */
            int64_t n = n0;
            for (; n + 8 <= n1; n += 8) {
                dot_block_rows(xf, w + n * row_bytes, fmt, row_bytes, K, 8, acc);
                store_n(sum8(acc), 8, y + n);
            }
            for (; n < n1; n++) {
                dot_block_rows(xf, w + n * row_bytes, fmt, row_bytes, K, 1, acc);
                y[n] = f32_to_bf16(sum1(acc[0]));
            }
            continue;
        }
        for (int64_t n = n0; n < n1; n++) widen_row(w + n * row_bytes, fmt, K, K8, wf + (n - n0) * K8);
        for (int i = 12; i < 16; i++) acc[i] = _mm256_setzero_ps();
        int64_t m = 0;
        if (n1 - n0 == NBLOCK)
            for (; m + 4 <= M; m += 4)
                for (int64_t n = n0; n < n1; n += 3) {
                    dot_4x3(xf + m * K8, wf + (n - n0) * K8, K8, acc); /* acc[i * 3 + j]: row m + i, col n + j */
                    _mm256_storeu_ps(r, sum8(acc));
                    _mm256_storeu_ps(r + 8, sum8(acc + 8));
                    for (int i = 0; i < 12; i++) y[(m + i / 3) * ldy + n + i % 3] = f32_to_bf16(r[i]);
                }
        for (; m < M; m++) {
            int64_t n = n0;
            for (; n + 8 <= n1; n += 8) {
                dot_1x8(xf + m * K8, wf + (n - n0) * K8, K8, acc);
                store_n(sum8(acc), 8, y + m * ldy + n);
            }
            for (; n < n1; n++) {
                dot_1x1(xf + m * K8, wf + (n - n0) * K8, K8, acc);
                y[m * ldy + n] = f32_to_bf16(sum1(acc[0]));
            }
        }
    }
}

void kvf_gemm_bf16(const uint16_t *x, int64_t ldx, const uint16_t *w, int64_t ldw, uint16_t *y, int64_t ldy,
                   int64_t M, int64_t N, int64_t K, int nthreads) {
    gemm(x, ldx, (const uint8_t *)w, FMT_BF16, ldw * 2, y, ldy, M, N, K, nthreads);
}

/* The same product with w as N rows of blocks of format fmt (FMT_Q4_1 .. FMT_Q6_K, blocks.h). */
void kvf_gemm_blocks(const uint16_t *x, int64_t ldx, const uint8_t *w, int fmt, uint16_t *y, int64_t ldy,
                     int64_t M, int64_t N, int64_t K, int nthreads) {
    gemm(x, ldx, w, fmt, row_bytes_of(fmt, K), y, ldy, M, N, K, nthreads);
}

/* ---- rows on int8: decode_gemm.c's int8 contract, bit for bit ------------------------------------------------
 *
 * The same quantization of x per block of 32, the same exact integer block sums and the same fma sequence per
 * block in each lane, on ``DecodeBlocks`` (blocks.py): so the bits of decode_gemm.c's kvf_gemm_q8, 8 weight rows
 * per vector instead of 16. The sums use vpmaddubsw, which cannot saturate here: Q4_1 takes unsigned 4-bit
 * weights against x (a 16-bit lane is at most 2 x 15 x 127, and eight of them 30,480), Q8_0 takes |w| <= 128
 * against x with w's sign (at most 2 x 128 x 127 = 32,512 per lane, widened before the next is added).
 */
static inline float max8(__m256 v) {
    const __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    const __m128 n = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(n, _mm_movehdup_ps(n)));
}

static inline int32_t sum8i(__m256i v) {
    const __m128i m = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    const __m128i n = _mm_add_epi32(m, _mm_unpackhi_epi64(m, m));
    return _mm_cvtsi128_si32(_mm_add_epi32(n, _mm_shuffle_epi32(n, 1)));
}

/* x rows -> qx (int8 [M][K]), dx and sx ([M][K / 32]): decode_gemm.c's quantize_rows. */
static void quantize_rows(const uint16_t *x, int64_t ldx, int64_t M, int64_t K, int8_t *qx, float *dx, float *sx) {
    const int64_t nb = K / 32;
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            __m256 v[4];
            __m256i q[4];
            for (int i = 0; i < 4; i++) v[i] = load8(x + m * ldx + 32 * b + 8 * i);
            const float amax = max8(_mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
                                                  _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs))));
            const __m256 scale = _mm256_set1_ps(amax > 0 ? 127.0f / amax : 0.0f);
            for (int i = 0; i < 4; i++) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], scale)); /* nearest even */
            const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
            _mm256_storeu_si256((__m256i *)(qx + m * K + 32 * b),
                                _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
            dx[m * nb + b] = amax / 127.0f;
            const int32_t total = sum8i(_mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
            sx[m * nb + b] = dx[m * nb + b] * (float)total;
        }
}

/* One block's weights for rows 8 hf .. 8 hf + 7 of a group as vpmaddubsw operands: w[j] holds weights 4j .. 4j + 3
 * of each row (Q4_1: the 4-bit values; Q8_0: |w|, with the signed weights in s[j]). */
static inline void block_weights(const uint8_t *gb, int fmt, int hf, __m256i w[8], __m256i s[8]) {
    if (fmt == FMT_Q4_1) {
        const __m256i low = _mm256_set1_epi8(0x0f);
        for (int p = 0; p < 4; p++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(gb + 64 + 64 * p + 32 * hf));
            w[2 * p] = _mm256_and_si256(v, low);
            w[2 * p + 1] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
        }
        return;
    }
    for (int j = 0; j < 8; j++) {
        s[j] = _mm256_loadu_si256((const __m256i *)(gb + 64 + 64 * j + 32 * hf));
        w[j] = _mm256_abs_epi8(s[j]);
    }
}

/* The integer sums of one x block (8 quads xq) against block_weights' operands: 8 lanes, one per weight row. */
static inline __m256i block_isum(const __m256i w[8], const __m256i s[8], int fmt, const int32_t *xq) {
    const __m256i ones = _mm256_set1_epi16(1);
    if (fmt == FMT_Q4_1) {
        __m256i s16 = _mm256_setzero_si256();
        for (int j = 0; j < 8; j++) s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(w[j], _mm256_set1_epi32(xq[j])));
        return _mm256_madd_epi16(s16, ones);
    }
    __m256i s32 = _mm256_setzero_si256();
    for (int j = 0; j < 8; j++) { /* |w| against x with w's sign (0 where w is 0) */
        const __m256i xs = _mm256_sign_epi8(_mm256_set1_epi32(xq[j]), s[j]);
        s32 = _mm256_add_epi32(s32, _mm256_madd_epi16(_mm256_maddubs_epi16(w[j], xs), ones));
    }
    return s32;
}

/* 8 fp16 at p -> fp32 (a block's scales d or minimums m for 8 weight rows). */
static inline __m256 half8(const uint8_t *p) { return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p)); }

/* One block's step of the int8 contract, lane by lane: acc = fma(isum, d dx, acc), then (Q4_1) fma(m, sx, acc). */
static inline __m256 block_fma(__m256 acc, __m256i isum, __m256 d, __m256 mn, float dx, float sx, const int FMT) {
    acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum), _mm256_mul_ps(d, _mm256_set1_ps(dx)), acc);
    return FMT == FMT_Q4_1 ? _mm256_fmadd_ps(mn, _mm256_set1_ps(sx), acc) : acc;
}

/* Rows [m0, m0 + R) of x (quantized: qx, dx, sx) against rows 8 hf .. 8 hf + 7 of one group -> acc; R and FMT are
 * constants at each call, so the loops unroll and acc stays in registers. */
static inline __attribute__((always_inline)) void q8_rows(const uint8_t *wg, const int FMT, int64_t nb, int hf,
                                                          const int8_t *qx, const float *dx, const float *sx, int64_t K,
                                                          int64_t m0, const int R, __m256 *acc) {
    const int64_t bbytes = FMT == FMT_Q4_1 ? Q41_GROUP_BLOCK : Q80_GROUP_BLOCK;
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = wg + b * bbytes;
        if (m0 == 0 && hf == 0) /* the first pass over a group streams the next group's block in */
            for (int64_t l = 0; l < bbytes; l += 64) _mm_prefetch((const char *)gb + nb * bbytes + l, _MM_HINT_T2);
        const __m256 d = half8(gb + 16 * hf), mn = FMT == FMT_Q4_1 ? half8(gb + 32 + 16 * hf) : _mm256_setzero_ps();
        __m256i wv[8], sv[8];
        block_weights(gb, FMT, hf, wv, sv);
        UNROLL for (int r = 0; r < R; r++) {
            const int64_t m = m0 + r;
            const __m256i isum = block_isum(wv, sv, FMT, (const int32_t *)(qx + m * K + 32 * b));
            acc[r] = block_fma(acc[r], isum, d, mn, dx[m * nb + b], sx[m * nb + b], FMT);
        }
    }
}

/* One row m of x against all 16 rows of one group, both halves in one pass: each x quad is broadcast once for the
 * 16 rows, and the two accumulators stay in registers. The same integer sums and the same block_fma per lane as
 * q8_rows, so the same bits. */
static inline __attribute__((always_inline)) void q8_row16(const uint8_t *wg, const int FMT, int64_t nb,
                                                           const int8_t *qx, const float *dx, const float *sx, int64_t m,
                                                           int64_t K, uint16_t *y) {
    const int64_t bbytes = FMT == FMT_Q4_1 ? Q41_GROUP_BLOCK : Q80_GROUP_BLOCK;
    const __m256i low = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *gb = wg + b * bbytes;
        const int32_t *xq = (const int32_t *)(qx + m * K + 32 * b);
        if (m == 0) /* the first pass over a group streams the next group's block in */
            for (int64_t l = 0; l < bbytes; l += 64) _mm_prefetch((const char *)gb + nb * bbytes + l, _MM_HINT_T2);
        __m256i s0, s1;
        if (FMT == FMT_Q4_1) { /* 16-bit sums: at most 8 x 2 x 15 x 127 = 30,480 */
            s0 = s1 = _mm256_setzero_si256();
            UNROLL for (int p = 0; p < 4; p++) {
                const __m256i v0 = _mm256_loadu_si256((const __m256i *)(gb + 64 + 64 * p));
                const __m256i v1 = _mm256_loadu_si256((const __m256i *)(gb + 96 + 64 * p));
                const __m256i lo = _mm256_set1_epi32(xq[2 * p]), hi = _mm256_set1_epi32(xq[2 * p + 1]);
                s0 = _mm256_add_epi16(s0, _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v0, low), lo),
                    _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v0, 4), low), hi)));
                s1 = _mm256_add_epi16(s1, _mm256_add_epi16(_mm256_maddubs_epi16(_mm256_and_si256(v1, low), lo),
                    _mm256_maddubs_epi16(_mm256_and_si256(_mm256_srli_epi16(v1, 4), low), hi)));
            }
            s0 = _mm256_madd_epi16(s0, ones), s1 = _mm256_madd_epi16(s1, ones);
        } else { /* |w| against x with w's sign, widened to 32 bits quad by quad */
            s0 = s1 = _mm256_setzero_si256();
            UNROLL for (int j = 0; j < 8; j++) {
                const __m256i w0 = _mm256_loadu_si256((const __m256i *)(gb + 64 + 64 * j));
                const __m256i w1 = _mm256_loadu_si256((const __m256i *)(gb + 96 + 64 * j));
                const __m256i xj = _mm256_set1_epi32(xq[j]);
                s0 = _mm256_add_epi32(s0, _mm256_madd_epi16(
                    _mm256_maddubs_epi16(_mm256_abs_epi8(w0), _mm256_sign_epi8(xj, w0)), ones));
                s1 = _mm256_add_epi32(s1, _mm256_madd_epi16(
                    _mm256_maddubs_epi16(_mm256_abs_epi8(w1), _mm256_sign_epi8(xj, w1)), ones));
            }
        }
        acc0 = block_fma(acc0, s0, half8(gb), FMT == FMT_Q4_1 ? half8(gb + 32) : _mm256_setzero_ps(),
                         dx[m * nb + b], sx[m * nb + b], FMT);
        acc1 = block_fma(acc1, s1, half8(gb + 16), FMT == FMT_Q4_1 ? half8(gb + 48) : _mm256_setzero_ps(),
                         dx[m * nb + b], sx[m * nb + b], FMT);
    }
    store8(y, acc0);
    store8(y + 8, acc1);
}

#define Q8_FMT(F, R) q8_rows(wg, F, nb, hf, qx, dx, sx, K, m0, R, acc)
#define Q8_R(R) do { if (fmt == FMT_Q4_1) Q8_FMT(FMT_Q4_1, R); else Q8_FMT(FMT_Q8_0, R); } while (0)

/* y = x w^T for w as N / 16 groups of K / 32 blocks (FMT_Q4_1 or FMT_Q8_0): decode_gemm.c's kvf_gemm_q8. N % 16
 * == 0 and K % 32 == 0 (the caller checks). Threads split the groups. Fewer than ROW16_BELOW rows take q8_row16
 * (the decode of a few sequences, which streams the weights); more, q8_rows, which unpacks a half group's weights
 * once for 4 rows. */
enum { ROW16_BELOW = 4 };
void kvf_gemm_q8(const uint16_t *x, int64_t ldx, const uint8_t *w, int fmt, uint16_t *y, int64_t ldy, int64_t M,
                 int64_t N, int64_t K, int nthreads) {
    const int64_t nb = K / 32, groups = N / 16, bbytes = fmt == FMT_Q4_1 ? Q41_GROUP_BLOCK : Q80_GROUP_BLOCK;
    int8_t *qx = (int8_t *)f32_buffer(2, (M * K + 3) / 4 + 2 * M * nb);
    float *dx = (float *)qx + (M * K + 3) / 4, *sx = dx + M * nb;
    quantize_rows(x, ldx, M, K, qx, dx, sx);
    if (M < ROW16_BELOW) {
#pragma omp parallel for schedule(static) num_threads(nthreads)
        for (int64_t g = 0; g < groups; g++)
            for (int64_t m = 0; m < M; m++) {
                if (fmt == FMT_Q4_1) q8_row16(w + g * nb * bbytes, FMT_Q4_1, nb, qx, dx, sx, m, K, y + m * ldy + 16 * g);
                else q8_row16(w + g * nb * bbytes, FMT_Q8_0, nb, qx, dx, sx, m, K, y + m * ldy + 16 * g);
            }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t g = 0; g < groups; g++) {
        const uint8_t *wg = w + g * nb * bbytes;
        for (int hf = 0; hf < 2; hf++)
            for (int64_t m0 = 0; m0 < M; m0 += 4) {
                const int rows = M - m0 < 4 ? (int)(M - m0) : 4;
                __m256 acc[4];
                switch (rows) {
                case 1: Q8_R(1); break;
                case 2: Q8_R(2); break;
                case 3: Q8_R(3); break;
                default: Q8_R(4); break;
                }
                for (int r = 0; r < rows; r++) store8(y + (m0 + r) * ldy + 16 * g + 8 * hf, acc[r]);
            }
    }
}

/* ---- attention ------------------------------------------------------------------------------------------ */

/* e^x for x <= 0 (Cody-Waite reduction, degree-7 polynomial): about 1 ulp, and the same on every call. */
static inline __m256 exp_ps(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    /* times 2^n, n in [-126, 0]: n + 127 into the exponent field */
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* ---- prefill attention: one task per query head, all in fp32 -------------------------------------------------
 *
 * A task packs its K/V head for the sequence's S positions (K per 8 positions, d-major: [S / 8][D][8]; V [S][D]),
 * then its queries go 4 at a time: each score is its own fma chain over d (ascending), a float32 softmax over the
 * positions the row sees (row i of the chunk sees S - n + i + 1), and the row's weighted sum of V position by
 * position, ascending, then times 1 / the weights' sum. A row's steps depend on nothing but its own query and its
 * sequence, so a chunk's result is the same in any batch and on any thread count. D is 32 or 64. */
#define ATTN_MAX_D 64

/* Scores of 4 query rows (fp32, ATTN_MAX_D apart) against NB blocks of 8 packed positions from j0, into sc (rows
 * ld apart): 4 NB independent chains, each its own sum over d, ascending. */
#define SCORES(NB)                                                                                               \
    static inline void scores_##NB(const float *qf, int64_t D, const float *kt, int64_t j0, float *sc, int64_t ld) { \
        __m256 acc[4 * NB];                                                                                      \
        UNROLL for (int i = 0; i < 4 * NB; i++) acc[i] = _mm256_setzero_ps();                                    \
        for (int64_t d = 0; d < D; d++) {                                                                        \
            __m256 k[NB];                                                                                        \
            UNROLL for (int b = 0; b < NB; b++) k[b] = _mm256_load_ps(kt + ((j0 / 8 + b) * D + d) * 8);         \
            UNROLL for (int r = 0; r < 4; r++) {                                                                 \
                const __m256 qv = _mm256_broadcast_ss(qf + r * ATTN_MAX_D + d);                                  \
                UNROLL for (int b = 0; b < NB; b++) acc[r * NB + b] = _mm256_fmadd_ps(qv, k[b], acc[r * NB + b]); \
            }                                                                                                    \
        }                                                                                                        \
        UNROLL for (int r = 0; r < 4; r++)                                                                       \
            UNROLL for (int b = 0; b < NB; b++) _mm256_storeu_ps(sc + r * ld + j0 + 8 * b, acc[r * NB + b]);     \
    }
SCORES(2)
SCORES(1)

/* o = sum over positions j < seen of w[j] V[j] (V fp32 rows of D = 8 DV), ascending, DV independent chains. */
#define WEIGH_V(DV)                                                                                              \
    static inline void weigh_v_##DV(const float *w, const float *vf, int64_t seen, __m256 *out) {                \
        __m256 o[DV];                                                                                            \
        UNROLL for (int c = 0; c < DV; c++) o[c] = _mm256_setzero_ps();                                          \
        for (int64_t j = 0; j < seen; j++) {                                                                     \
            const __m256 pj = _mm256_broadcast_ss(w + j);                                                        \
            UNROLL for (int c = 0; c < DV; c++) o[c] = _mm256_fmadd_ps(pj, _mm256_load_ps(vf + j * 8 * DV + 8 * c), o[c]); \
        }                                                                                                        \
        UNROLL for (int c = 0; c < DV; c++) out[c] = o[c];                                                       \
    }
WEIGH_V(8)
WEIGH_V(4)

/* The softmax weights of a score row over the ``seen`` positions it sees: exp(scale s - m) in place, m the scaled
 * scores' max (to *max), zero past seen up to the next multiple of 8; returns their sum (8 lanes, then sum1). */
static inline float softmax_row(float *row, int64_t seen, float scale, float *max) {
    const __m256 sv = _mm256_set1_ps(scale), iota = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 mx = _mm256_set1_ps(-FLT_MAX), sum = _mm256_setzero_ps();
    for (int64_t j = 0; j < seen; j += 8) {
        const __m256 live = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps((float)j), iota), _mm256_set1_ps((float)seen),
                                          _CMP_LT_OQ);
        mx = _mm256_max_ps(mx, _mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), _mm256_mul_ps(_mm256_loadu_ps(row + j), sv), live));
    }
    *max = max8(mx);
    const __m256 mv = _mm256_set1_ps(*max);
    for (int64_t j = 0; j < seen; j += 8) {
        const __m256 live = _mm256_cmp_ps(_mm256_add_ps(_mm256_set1_ps((float)j), iota), _mm256_set1_ps((float)seen),
                                          _CMP_LT_OQ);
        const __m256 e = _mm256_and_ps(exp_ps(_mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(row + j), sv), mv)), live);
        _mm256_storeu_ps(row + j, e);
        sum = _mm256_add_ps(sum, e);
    }
    return sum1(sum);
}

void kvf_prefill_attention(const uint16_t *q, int64_t ldq, const uint16_t *kv, int64_t slot_stride,
                           const int64_t *slots, int64_t n, int64_t S, int64_t H, int64_t KV, int64_t D, float scale,
                           uint16_t *out, int64_t ldo, int nthreads) {
    const int64_t G = H / KV, S8 = (S + 7) / 8 * 8, DV = D / 8;
#pragma omp parallel num_threads(nthreads)
    {
        float *kt = aligned_alloc(64, S8 * D * 4), *vf = aligned_alloc(64, S * D * 4 + 64);
        float *sc = aligned_alloc(64, 4 * S8 * 4);
        float qf[4 * ATTN_MAX_D] __attribute__((aligned(32)));
#pragma omp for schedule(static)
        for (int64_t h = 0; h < H; h++) {
            const int64_t hk = h / G;
            for (int64_t j = 0; j < S8; j++)
                for (int64_t d = 0; d < D; d++)
                    kt[(j / 8 * D + d) * 8 + j % 8] = j < S ? bf16_to_f32(kv[slots[j] * slot_stride + hk * D + d]) : 0.0f;
            for (int64_t j = 0; j < S; j++)
                for (int64_t d = 0; d < D; d += 8)
                    _mm256_store_ps(vf + j * D + d, load8(kv + slots[j] * slot_stride + (KV + hk) * D + d));
            for (int64_t i0 = 0; i0 < n; i0 += 4) {
                const int64_t rows = n - i0 < 4 ? n - i0 : 4, keys8 = (S - n + i0 + rows + 7) / 8 * 8;
                memset(qf, 0, sizeof qf); /* rows past ``rows``: zero queries, scores unused */
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t d = 0; d < D; d++) qf[r * ATTN_MAX_D + d] = bf16_to_f32(q[(i0 + r) * ldq + h * D + d]);
                int64_t j0 = 0;
                for (; j0 + 16 <= keys8; j0 += 16) scores_2(qf, D, kt, j0, sc, S8);
                for (; j0 < keys8; j0 += 8) scores_1(qf, D, kt, j0, sc, S8);
                for (int64_t r = 0; r < rows; r++) {
                    const int64_t seen = S - n + i0 + r + 1;
                    float row_max;
                    const __m256 inv = _mm256_set1_ps(1.0f / softmax_row(sc + r * S8, seen, scale, &row_max));
                    __m256 o[ATTN_MAX_D / 8];
                    if (DV == 8) weigh_v_8(sc + r * S8, vf, seen, o);
                    else weigh_v_4(sc + r * S8, vf, seen, o);
                    for (int64_t c = 0; c < DV; c++) store8(out + (i0 + r) * ldo + h * D + 8 * c, _mm256_mul_ps(o[c], inv));
                }
            }
        }
        free(kt), free(vf), free(sc);
    }
}

/* ---- decode attention straight from the pool: chunks of a sequence's positions, merged ------------------------
 *
 * The split of decode_chunks.h. A task reads its slots once, whole (every K and V head of a position is one
 * contiguous run), into fp32; then per K/V head, for each of its query heads, the scores (8 positions at a time,
 * each an ascending fma chain over d in 8 lanes, the lanes summed by sum8), the weights exp(scale s - m) with m the
 * chunk's max and their sum l (softmax_row), and o = the weighted sum of V, position by position ascending. Each
 * (sequence, query head) then merges its chunks in ascending order: M = max m, o = sum exp(m - M) o, l = sum
 * exp(m - M) l, out = bf16(o / l). Tasks are dealt in equal contiguous shares, so one sequence's chunks spread
 * over every thread. */

/* The lines of [p, p + bytes) into L1 (slots scattered by page: a pattern the hardware prefetchers miss), for the
 * slot SLOTS_AHEAD positions on. */
enum { SLOTS_AHEAD = 4 };
static inline void prefetch_slot(const void *p, int64_t bytes) {
    for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

/* Unscaled scores of the query qf (fp32, D = 8 DV) against the K rows kf[0 .. n) (fp32, D apart, zero up to the
 * next multiple of 8) into sc. */
static inline __attribute__((always_inline)) void chunk_scores(const float *qf, const float *kf, int64_t n,
                                                               const int64_t DV, float *sc) {
    __m256 qv[32];
    UNROLL for (int64_t v = 0; v < DV; v++) qv[v] = _mm256_loadu_ps(qf + 8 * v);
    for (int64_t j0 = 0; j0 < n; j0 += 8) {
        __m256 acc[8];
        UNROLL for (int j = 0; j < 8; j++) {
            const float *k = kf + (j0 + j) * 8 * DV;
            __m256 a = _mm256_mul_ps(qv[0], _mm256_load_ps(k));
            UNROLL for (int64_t v = 1; v < DV; v++) a = _mm256_fmadd_ps(qv[v], _mm256_load_ps(k + 8 * v), a);
            acc[j] = a;
        }
        _mm256_storeu_ps(sc + j0, sum8(acc));
    }
}

/* For query heads g < GB (weights w + g ld) and value slices c < VB: out + g ostride + 8 c = the sum over the n
 * positions of weight times V (fp32 rows vf + p D + 8 c), ascending. */
static inline __attribute__((always_inline)) void chunk_values(const float *vf, int64_t D, int64_t n, const float *w,
                                                               int64_t ld, const int GB, const int VB, float *out,
                                                               int64_t ostride) {
    __m256 o[12];
    UNROLL for (int i = 0; i < GB * VB; i++) o[i] = _mm256_setzero_ps();
    for (int64_t p = 0; p < n; p++) {
        __m256 wb[3];
        UNROLL for (int g = 0; g < GB; g++) wb[g] = _mm256_broadcast_ss(w + g * ld + p);
        UNROLL for (int c = 0; c < VB; c++) {
            const __m256 v = _mm256_load_ps(vf + p * D + 8 * c);
            UNROLL for (int g = 0; g < GB; g++) o[g * VB + c] = _mm256_fmadd_ps(wb[g], v, o[g * VB + c]);
        }
    }
    UNROLL for (int g = 0; g < GB; g++) UNROLL for (int c = 0; c < VB; c++)
        _mm256_storeu_ps(out + g * ostride + 8 * c, o[g * VB + c]);
}

#define CHUNK_VALUES(GB, VB) chunk_values(vh + 8 * c, D, n, w, ld, GB, VB, dst + 8 * c, D + 2)

/* One task: positions pos[0 .. n) of the sequence whose query row is q. part gets, per query head, o (D floats),
 * then m and l. kf, vf: KV x ld rows of D floats (ld >= n rounded up to 8); sc: G rows of ld floats; qf: D floats.
 * The chunk's slots are read once, whole (every K and V head of a position: one contiguous run), into kf and vf. */
static void attend_chunk(const uint16_t *q, const uint16_t *kv, int64_t slot_stride, const int64_t *pos, int64_t n,
                         int64_t KV, int64_t G, int64_t D, float scale, float *kf, float *vf, float *sc, int64_t ld,
                         float *qf, float *part) {
    const int64_t DV = D / 8, n8 = (n + 7) / 8 * 8;
    for (int64_t p = 0; p < SLOTS_AHEAD && p < n; p++) prefetch_slot(kv + pos[p] * slot_stride, 4 * KV * D);
    for (int64_t p = 0; p < n; p++) {
        if (p + SLOTS_AHEAD < n) prefetch_slot(kv + pos[p + SLOTS_AHEAD] * slot_stride, 4 * KV * D);
        const uint16_t *slot = kv + pos[p] * slot_stride;
        for (int64_t kh = 0; kh < KV; kh++)
            for (int64_t c = 0; c < DV; c++) {
                _mm256_store_ps(kf + (kh * ld + p) * D + 8 * c, load8(slot + kh * D + 8 * c));
                _mm256_store_ps(vf + (kh * ld + p) * D + 8 * c, load8(slot + (KV + kh) * D + 8 * c));
            }
    }
    for (int64_t kh = 0; kh < KV; kh++) {
        const float *kh_f = kf + kh * ld * D, *vh = vf + kh * ld * D;
        memset(kf + (kh * ld + n) * D, 0, sizeof(float) * (n8 - n) * D);
        for (int64_t g = 0; g < G; g++) {
            const int64_t h = kh * G + g;
            widen_row((const uint8_t *)(q + h * D), FMT_BF16, D, D, qf);
            if (DV == 8) chunk_scores(qf, kh_f, n, 8, sc + g * ld);
            else if (DV == 4) chunk_scores(qf, kh_f, n, 4, sc + g * ld);
            else chunk_scores(qf, kh_f, n, DV, sc + g * ld);
            float *ml = part + h * (D + 2) + D;
            ml[1] = softmax_row(sc + g * ld, n, scale, ml);
        }
        for (int64_t g0 = 0; g0 < G; g0 += 3) {
            const float *w = sc + g0 * ld;
            float *dst = part + (kh * G + g0) * (D + 2);
            for (int64_t c = 0; c < DV; c += DV % 4 ? 2 : 4) {
                if (G - g0 >= 3) { if (DV % 4) CHUNK_VALUES(3, 2); else CHUNK_VALUES(3, 4); }
                else if (G - g0 == 2) { if (DV % 4) CHUNK_VALUES(2, 2); else CHUNK_VALUES(2, 4); }
                else { if (DV % 4) CHUNK_VALUES(1, 2); else CHUNK_VALUES(1, 4); }
            }
        }
    }
}

/* Query head h of one sequence from its chunks' partials (ascending), to bf16 at out. */
static void merge_chunks(const float *parts, int64_t chunks, int64_t H, int64_t h, int64_t D, uint16_t *out) {
    const int64_t stride = H * (D + 2);
    float M = -FLT_MAX, l = 0.0f;
    for (int64_t c = 0; c < chunks; c++) M = fmaxf(M, parts[c * stride + h * (D + 2) + D]);
    __m256 o[32];
    for (int64_t v = 0; v < D / 8; v++) o[v] = _mm256_setzero_ps();
    for (int64_t c = 0; c < chunks; c++) {
        const float *p = parts + c * stride + h * (D + 2);
        const __m256 f = exp_ps(_mm256_set1_ps(p[D] - M));
        l += _mm256_cvtss_f32(f) * p[D + 1];
        for (int64_t v = 0; v < D / 8; v++) o[v] = _mm256_fmadd_ps(f, _mm256_loadu_ps(p + 8 * v), o[v]);
    }
    const __m256 inv = _mm256_set1_ps(1.0f / l);
    for (int64_t v = 0; v < D / 8; v++) store8(out + h * D + 8 * v, _mm256_mul_ps(o[v], inv));
}

/* As decode_gemm.c's: q row i at q + i * ldq (H heads of D); slot s's K heads at kv + s * slot_stride, V heads
 * KV * D after; sequence i's positions slots[starts[i] .. starts[i + 1]); out row i at out + i * ldo. Needs
 * D % 16 == 0, D <= 256 (the caller checks). */
void kvf_decode_attention(const uint16_t *q, int64_t ldq, const uint16_t *kv, int64_t slot_stride,
                          const int64_t *slots, const int64_t *starts, int64_t n, int64_t H, int64_t KV, int64_t D,
                          float scale, uint16_t *out, int64_t ldo, int nthreads) {
    const int64_t G = H / KV, stride = H * (D + 2);
    int64_t longest;
    const int64_t tasks = chunk_tasks(starts, n, &longest);
    /* chunk_table's table and first, then the tasks' partials */
    int64_t *table = (int64_t *)f32_buffer(3, 2 * (2 * tasks + n + 1) + stride * tasks), *first = table + 2 * tasks;
    float *parts = (float *)(first + n + 1);
    chunk_table(starts, n, table, first);
    const int64_t ld = chunk_positions(longest); /* a multiple of 32: room for any chunk rounded up to 8 */
#pragma omp parallel num_threads(nthreads)
    {
        const int64_t t = omp_get_thread_num(), nt = omp_get_num_threads();
        float *kf = f32_buffer(4, 2 * KV * ld * D + G * ld + D), *vf = kf + KV * ld * D, *sc = vf + KV * ld * D;
        float *qf = sc + G * ld;
        for (int64_t k = tasks * t / nt; k < tasks * (t + 1) / nt; k++) {
            const int64_t i = table[2 * k], p = table[2 * k + 1], S = starts[i + 1] - starts[i];
            const int64_t C = chunk_positions(S), m = S - p < C ? S - p : C;
            attend_chunk(q + i * ldq, kv, slot_stride, slots + starts[i] + p, m, KV, G, D, scale, kf, vf, sc, ld,
                         qf, parts + k * stride);
        }
#pragma omp barrier
        for (int64_t r = n * H * t / nt; r < n * H * (t + 1) / nt; r++) {
            const int64_t i = r / H;
            merge_chunks(parts + first[i] * stride, first[i + 1] - first[i], H, r % H, D, out + i * ldo);
        }
    }
}

/* ---- row-wise steps around the matmuls (bf16, one row at a time, same order for every row) --------------------- */

/* x[t] = bf16(x[t] + y[t]) when y is given; then h[t] = bf16(w * bf16(x[t] / sqrt(mean(x[t]^2) + eps))) (HF
 * LlamaRMSNorm in bf16). The sum of squares runs over 8 fp32 lanes then one fixed-order lane sum. */
void kvf_add_rms_norm(uint16_t *x, int64_t ldx, const uint16_t *y, int64_t ldy, const uint16_t *w, uint16_t *h,
                      int64_t ldh, int64_t T, int64_t N, float eps, int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 64)
    for (int64_t t = 0; t < T; t++) {
        uint16_t *xr = x + t * ldx, *hr = h + t * ldh;
        const int64_t N8 = N / 8 * 8;
        int64_t j;
        if (y) {
            const uint16_t *yr = y + t * ldy;
            for (j = 0; j < N8; j += 8) store8(xr + j, _mm256_add_ps(load8(xr + j), load8(yr + j)));
            for (; j < N; j++) xr[j] = f32_to_bf16(bf16_to_f32(xr[j]) + bf16_to_f32(yr[j]));
        }
        __m256 acc = _mm256_setzero_ps();
        for (j = 0; j < N8; j += 8) {
            const __m256 v = load8(xr + j);
            acc = _mm256_fmadd_ps(v, v, acc);
        }
        float ss = sum1(acc);
        for (j = N8; j < N; j++) ss += bf16_to_f32(xr[j]) * bf16_to_f32(xr[j]);
        const float r = 1.0f / sqrtf(ss / (float)N + eps);
        const __m256 rv = _mm256_set1_ps(r);
        for (j = 0; j < N8; j += 8)
            store8(hr + j, _mm256_mul_ps(load8(w + j), round_bf16(_mm256_mul_ps(load8(xr + j), rv))));
        for (; j < N; j++) hr[j] = f32_to_bf16(bf16_to_f32(w[j]) * bf16_to_f32(f32_to_bf16(bf16_to_f32(xr[j]) * r)));
    }
}

/* Rotary embedding in place on the H + KV query and key heads of each row of qkv, then that row's K and V heads
 * copied to pool slot slots[t]: as decode_gemm.c's, bit for bit what the torch ops compute. */
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
            if (D % 16 == 0) { /* 8 at a time: element e's partner e + D / 2 lies in the chunk half a head on */
                for (int64_t e = 0; e < D; e += 8) {
                    const __m256 a = round_bf16(_mm256_mul_ps(load8(tmp + e), load8(c + e)));
                    const __m256 b = round_bf16(_mm256_mul_ps(load8(tmp + (e + D / 2) % D), load8(s + e)));
                    store8(v + e, _mm256_add_ps(a, b));
                }
                continue;
            }
            rope_head_scalar(v, tmp, c, s, D);
        }
        memcpy(kv + slots[t] * slot_stride, qkv + t * ldq + H * D, 2 * KV * D * sizeof(uint16_t));
    }
}

/* out[t] = bf16(bf16(silu(g)) * u) for g, u the two halves of row t of gate_up ([T, 2 F], gate first): as
 * decode_gemm.c's. */
void kvf_silu_mul(const uint16_t *gate_up, int64_t ldg, uint16_t *out, int64_t ldo, int64_t T, int64_t F,
                  int nthreads) {
#pragma omp parallel for schedule(static) num_threads(nthreads) if (T >= 16)
    for (int64_t t = 0; t < T; t++) {
        const uint16_t *g = gate_up + t * ldg, *u = g + F;
        uint16_t *o = out + t * ldo;
        for (int64_t j = 0; j < F; j += 8) {
            const int64_t n = F - j < 8 ? F - j : 8;
            const __m256 gv = n == 8 ? load8(g + j) : load_tail(g + j, n);
            const __m256 uv = n == 8 ? load8(u + j) : load_tail(u + j, n);
            const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
            const __m256 abs = _mm256_andnot_ps(_mm256_set1_ps(-0.0f), gv);
            const __m256 e = exp_ps(_mm256_sub_ps(zero, abs)); /* e^-|g| */
            const __m256 neg = _mm256_cmp_ps(gv, zero, _CMP_LT_OQ);
            const __m256 sig = _mm256_div_ps(_mm256_blendv_ps(one, e, neg), _mm256_add_ps(one, e));
            const __m256 silu = round_bf16(_mm256_mul_ps(gv, sig));
            store_n(_mm256_mul_ps(silu, uv), (int)n, o + j);
        }
    }
}

#include "decode_step.h"
