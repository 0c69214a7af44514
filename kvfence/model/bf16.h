/* Scalar bf16 steps shared by decode_gemm.c and decode_avx2.c: the conversions, rounded as torch rounds, and the
 * rotary of a head element by element (the path for heads whose size the vector loops do not take). */
#pragma once
#include <stdint.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) { /* round to nearest even, as torch does */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Rotary on the D values of head v in place, from tmp (a copy of them): HF rotate_half with sin's sign folded in,
 * each product and the sum rounded to bf16, as torch's ops do. */
static inline void rope_head_scalar(uint16_t *v, const uint16_t *tmp, const uint16_t *c, const uint16_t *s,
                                    int64_t D) {
    for (int64_t e = 0; e < D; e++) {
        const uint16_t a = f32_to_bf16(bf16_to_f32(tmp[e]) * bf16_to_f32(c[e]));
        const uint16_t b = f32_to_bf16(bf16_to_f32(tmp[(e + D / 2) % D]) * bf16_to_f32(s[e]));
        v[e] = f32_to_bf16(bf16_to_f32(a) + bf16_to_f32(b));
    }
}
