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
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

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

/* This thread's fp32 buffer ``slot`` (0: the caller's x, 1: a task's weight rows) of at least n values. */
static float *f32_buffer(int slot, int64_t n) {
    static __thread float *buf[2];
    static __thread int64_t cap[2];
    if (n > cap[slot]) {
        free(buf[slot]);
        cap[slot] = n + n / 2;
        buf[slot] = aligned_alloc(64, (cap[slot] * sizeof(float) + 63) / 64 * 64);
    }
    return buf[slot];
}

/* GGUF weight blocks (blocks.py): rows of K / 32 blocks, a row's fields gathered (every fp16 d, for Q4_1 every
 * fp16 m, then the values; Q4_1 values paired: byte j of a pair holds block a's weight j in its low nibble and
 * block b's in its high one, an odd last block in the GGUF's order). */
enum { FMT_BF16 = 0, FMT_Q4_1 = 1, FMT_Q8_0 = 2 };
static const int64_t BLOCK_BYTES[] = {0, 20, 34};

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

/* Weight row -> K fp32 at out, zero up to K8: bf16 widened, or blocks expanded as widen_pair does. So a model that
 * keeps its blocks computes the bits of its dequantized bf16 copy. */
static void widen_row(const uint8_t *row, int fmt, int64_t K, int64_t K8, float *out) {
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
        widen_row(w + rows[i] * (K / 32 * BLOCK_BYTES[fmt]), fmt, K, K, row);
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
        if (M == 1 && fmt != FMT_BF16 && K % 64 == 0) { /* one row: no buffer, 1.07-1.37x */
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

/* The same product with w as N rows of K / 32 blocks of format fmt (FMT_Q4_1 or FMT_Q8_0). */
void kvf_gemm_blocks(const uint16_t *x, int64_t ldx, const uint8_t *w, int fmt, uint16_t *y, int64_t ldy,
                     int64_t M, int64_t N, int64_t K, int nthreads) {
    gemm(x, ldx, w, fmt, K / 32 * BLOCK_BYTES[fmt], y, ldy, M, N, K, nthreads);
}

/* ---- decode attention straight from the pool: one task per (sequence, KV head), as in decode_gemm.c ---------- */

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

static inline void prefetch_head(const uint16_t *p, int64_t D) {
    for (int64_t b = 0; b < D * 2; b += 64) _mm_prefetch((const char *)p + b, _MM_HINT_T0);
}

#define MAX_G 16
#define MAX_DV 32 /* D <= 256 */

/* As decode_gemm.c's: q row i at q + i * ldq (H heads of D); slot s's K heads at kv + s * slot_stride, V heads
 * KV * D after; sequence i's positions slots[starts[i] .. starts[i + 1]); out row i at out + i * ldo. Needs
 * D % 16 == 0, D <= 256, H / KV <= 16 (the caller checks). */
void kvf_decode_attention(const uint16_t *q, int64_t ldq, const uint16_t *kv, int64_t slot_stride,
                          const int64_t *slots, const int64_t *starts, int64_t n, int64_t H, int64_t KV, int64_t D,
                          float scale, uint16_t *out, int64_t ldo, int nthreads) {
    const int64_t G = H / KV, DV = D / 8;
#pragma omp parallel for schedule(static) num_threads(nthreads)
    for (int64_t task = 0; task < n * KV; task++) {
        const int64_t i = task / KV, h = task % KV, S = starts[i + 1] - starts[i], stride = S + 8;
        const int64_t *pos = slots + starts[i];
        float *sc = malloc(sizeof(float) * G * stride);
        __m256 qf[MAX_G][MAX_DV], o[MAX_G][MAX_DV];
        float mx[MAX_G], inv[MAX_G];
        for (int64_t g = 0; g < G; g++) {
            mx[g] = -FLT_MAX;
            for (int64_t v = 0; v < DV; v++) qf[g][v] = load8(q + i * ldq + (h * G + g) * D + v * 8);
        }
        for (int64_t p = 0; p < S; p++) { /* scores */
            const uint16_t *k = kv + pos[p] * slot_stride + h * D;
            if (p + 8 < S) prefetch_head(kv + pos[p + 8] * slot_stride + h * D, D);
            __m256 kf[MAX_DV];
            for (int64_t v = 0; v < DV; v++) kf[v] = load8(k + v * 8);
            for (int64_t g = 0; g < G; g++) {
                __m256 acc = _mm256_mul_ps(qf[g][0], kf[0]);
                for (int64_t v = 1; v < DV; v++) acc = _mm256_fmadd_ps(qf[g][v], kf[v], acc);
                const float s = sum1(acc) * scale;
                sc[g * stride + p] = s;
                mx[g] = s > mx[g] ? s : mx[g];
            }
        }
        for (int64_t g = 0; g < G; g++) { /* softmax weights, unnormalised (zero past S); 1 / their sum */
            float *row = sc + g * stride;
            for (int64_t p = S; p < (S + 7) / 8 * 8; p++) row[p] = -INFINITY;
            __m256 sum = _mm256_setzero_ps();
            const __m256 m = _mm256_set1_ps(mx[g]);
            for (int64_t p = 0; p < S; p += 8) {
                const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(row + p), m));
                const __m256 valid = _mm256_cmp_ps(_mm256_loadu_ps(row + p), _mm256_set1_ps(-INFINITY), _CMP_NEQ_OQ);
                const __m256 ev = _mm256_and_ps(e, valid);
                _mm256_storeu_ps(row + p, ev);
                sum = _mm256_add_ps(sum, ev);
            }
            inv[g] = 1.0f / sum1(sum);
            for (int64_t v = 0; v < DV; v++) o[g][v] = _mm256_setzero_ps();
        }
        for (int64_t p = 0; p < S; p++) { /* weighted sum of V, position by position */
            const uint16_t *vp = kv + pos[p] * slot_stride + (KV + h) * D;
            if (p + 8 < S) prefetch_head(kv + pos[p + 8] * slot_stride + (KV + h) * D, D);
            for (int64_t v = 0; v < DV; v++) {
                const __m256 vf = load8(vp + v * 8);
                for (int64_t g = 0; g < G; g++) o[g][v] = _mm256_fmadd_ps(_mm256_set1_ps(sc[g * stride + p]), vf, o[g][v]);
            }
        }
        for (int64_t g = 0; g < G; g++)
            for (int64_t v = 0; v < DV; v++)
                store8(out + i * ldo + (h * G + g) * D + v * 8, _mm256_mul_ps(o[g][v], _mm256_set1_ps(inv[g])));
        free(sc);
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
