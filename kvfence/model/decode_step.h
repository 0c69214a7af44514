/* A decode step's layers in one call, shared by decode_gemm.c and decode_avx2.c (included at their end, after the
 * kernels it calls), and the layout of its two structs, which kernels.py compares with its ctypes copies at load.
 *
 * A step of decode rows only (every chunk one token), with int8 block weights and no q/k/v extras, calls the same
 * kernels in the same order as ``Model._forward_c`` does from Python, so the same bits, without ~9 ctypes calls
 * per layer. It starts after layer 0's attention norm and ends before the last layer's residual add, which the
 * caller makes. */
#pragma once
#include <stddef.h>
#include <stdint.h>

typedef struct { /* one layer: DecodeBlocks and their formats, norms, the pool's layer */
    const uint8_t *qkv, *o, *gate_up, *down;
    int64_t qkv_fmt, o_fmt, gate_up_fmt, down_fmt;
    const uint16_t *attn_norm, *mlp_norm;
    uint16_t *kv;
} decode_layer;

typedef struct { /* the step: sizes, buffers ([T] rows of unit stride), rotary tables and slots */
    int64_t T, H, KV, D, hidden, F2, slot_stride;
    int64_t threads, light; /* the matmuls' and attention's threads; the element-wise kernels' */
    float eps, scale;
    uint16_t *x, *h, *proj, *qkv, *attn, *gate_up, *act;
    const uint16_t *cos, *sin;
    const int64_t *write, *read, *starts;
} decode_step;

/* Every field of both structs, in declaration order: kvf_layout reports their offsets, sizes and names. */
#define LAYOUT(X)                                                                                                \
    X(decode_layer, qkv) X(decode_layer, o) X(decode_layer, gate_up) X(decode_layer, down)                       \
    X(decode_layer, qkv_fmt) X(decode_layer, o_fmt) X(decode_layer, gate_up_fmt) X(decode_layer, down_fmt)       \
    X(decode_layer, attn_norm) X(decode_layer, mlp_norm) X(decode_layer, kv)                                     \
    X(decode_step, T) X(decode_step, H) X(decode_step, KV) X(decode_step, D) X(decode_step, hidden)              \
    X(decode_step, F2) X(decode_step, slot_stride) X(decode_step, threads) X(decode_step, light)                 \
    X(decode_step, eps) X(decode_step, scale) X(decode_step, x) X(decode_step, h) X(decode_step, proj)           \
    X(decode_step, qkv) X(decode_step, attn) X(decode_step, gate_up) X(decode_step, act) X(decode_step, cos)     \
    X(decode_step, sin) X(decode_step, write) X(decode_step, read) X(decode_step, starts)
#define OFFSET(T, f) (int64_t) offsetof(T, f), (int64_t) sizeof(((T *)0)->f),
#define NAME(T, f) #T "." #f ","

/* Writes every field's offset and size, then sizeof(decode_layer) and sizeof(decode_step), to out (unless NULL);
 * returns how many values that is. ``*names`` (unless NULL) gets the fields' names ("struct.field") and then
 * "sizeof.decode_layer" and "sizeof.decode_step", comma-separated, in the same order. */
int64_t kvf_layout(int64_t *out, const char **names) {
    const int64_t v[] = {LAYOUT(OFFSET)(int64_t) sizeof(decode_layer), (int64_t) sizeof(decode_step)};
    const int64_t n = sizeof v / sizeof v[0];
    if (out)
        for (int64_t i = 0; i < n; i++) out[i] = v[i];
    if (names) *names = LAYOUT(NAME) "sizeof.decode_layer,sizeof.decode_step";
    return n;
}
#undef OFFSET
#undef NAME

void kvf_decode_layers(const decode_step *s, const decode_layer *layers, int64_t n) {
    const int64_t T = s->T, hidden = s->hidden, F = s->F2 / 2, width = (s->H + 2 * s->KV) * s->D;
    const int th = (int)s->threads, light = (int)s->light;
    for (int64_t i = 0; i < n; i++) {
        const decode_layer *L = layers + i;
        kvf_gemm_q8(s->h, hidden, L->qkv, (int)L->qkv_fmt, s->qkv, width, T, width, hidden, th);
        kvf_rope_write(s->qkv, width, s->H, s->KV, s->D, s->cos, s->sin, T, L->kv, s->slot_stride, s->write, light);
        kvf_decode_attention(s->qkv, width, L->kv, s->slot_stride, s->read, s->starts, T, s->H, s->KV, s->D,
                             s->scale, s->attn, s->H * s->D, th);
        kvf_gemm_q8(s->attn, s->H * s->D, L->o, (int)L->o_fmt, s->proj, hidden, T, hidden, s->H * s->D, th);
        kvf_add_rms_norm(s->x, hidden, s->proj, hidden, L->mlp_norm, s->h, hidden, T, hidden, s->eps, light);
        kvf_gemm_q8(s->h, hidden, L->gate_up, (int)L->gate_up_fmt, s->gate_up, s->F2, T, s->F2, hidden, th);
        kvf_silu_mul(s->gate_up, s->F2, s->act, F, T, F, light);
        kvf_gemm_q8(s->act, F, L->down, (int)L->down_fmt, s->proj, hidden, T, hidden, F, th);
        if (i + 1 < n)
            kvf_add_rms_norm(s->x, hidden, s->proj, hidden, layers[i + 1].attn_norm, s->h, hidden, T, hidden, s->eps,
                             light);
    }
}
