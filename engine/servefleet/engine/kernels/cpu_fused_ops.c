/*
 * The small per-layer operations of a decoder step, fused, for float32 on the CPU.
 *
 * A decode step of 16 sequences spends more time dispatching PyTorch's elementwise ops
 * (rms_norm alone is six of them, ~50 µs per call) than computing them; one C call per
 * fused operation does the same arithmetic in a few microseconds.
 *
 *   sf_add_rms_norm  hidden += delta (optional); out = rms_norm(hidden) * weight
 *   sf_silu_mul      out = silu(gate) * up, from the fused gate_up projection's output
 *   sf_rope_kv       rotate q and k in place (rotate_half convention), then write the
 *                    rotated k and the v of every token into its KV-cache slot
 *                    (float32, float16 rounded to nearest even as torch does, or int8
 *                    rows quantized with their scale inline, as kv_quant.py does)
 *
 * Every row is computed on its own, in a fixed order, so a row's result does not
 * depend on the other rows of the batch.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef SF_THREADING
#define SF_THREADING 0
#endif

int sf_threading_mode(void) { return SF_THREADING; }

/* hidden[rows, dim] += delta (when not NULL); out = hidden / sqrt(mean(hidden²) + eps) * weight.
 * The sum of squares uses 16 fixed lanes then a fixed pairwise reduction: vectorisable
 * without -fassociative-math, and the same for every row whatever the batch. */
void sf_add_rms_norm(float *restrict hidden, const float *restrict delta,
                     const float *restrict weight, float *restrict out, int64_t rows,
                     int64_t dim, float eps) {
    enum { LANES = 16 };
    for (int64_t r = 0; r < rows; r++) {
        float *restrict h = hidden + r * dim;
        if (delta != NULL) {
            const float *restrict d = delta + r * dim;
            for (int64_t i = 0; i < dim; i++) h[i] += d[i];
        }
        float lanes[LANES] = {0};
        int64_t i = 0;
        for (; i + LANES <= dim; i += LANES)
            for (int l = 0; l < LANES; l++) lanes[l] += h[i + l] * h[i + l];
        for (int l = 0; i < dim; i++, l++) lanes[l] += h[i] * h[i];
        for (int width = LANES / 2; width > 0; width /= 2)
            for (int l = 0; l < width; l++) lanes[l] += lanes[l + width];
        const float inv = 1.0f / sqrtf(lanes[0] / (float)dim + eps);
        float *restrict o = out + r * dim;
        for (int64_t j = 0; j < dim; j++) o[j] = h[j] * inv * weight[j];
    }
}

#include "sf_exp.h" /* sf_exp_nonpos */

/* gate_up[rows, 2·inter] = [gate | up]; out[rows, inter] = gate·sigmoid(gate)·up, with
 * sigmoid from exp(-|gate|) so the exponential never overflows. */
void sf_silu_mul(const float *restrict gate_up, float *restrict out, int64_t rows,
                 int64_t inter) {
    for (int64_t r = 0; r < rows; r++) {
        const float *restrict gate = gate_up + r * 2 * inter;
        const float *restrict up = gate + inter;
        float *restrict o = out + r * inter;
        for (int64_t i = 0; i < inter; i++) {
            const float x = gate[i];
            const float e = sf_exp_nonpos(x < 0.0f ? x : -x);
            const float sigmoid = (x < 0.0f ? e : 1.0f) / (1.0f + e);
            o[i] = x * sigmoid * up[i];
        }
    }
}

/* float -> IEEE half, round to nearest even (what torch's .to(float16) gives). */
static inline uint16_t sf_float_to_half(float f) {
#if defined(__FLT16_MAX__) && !defined(SF_NO_FLOAT16) /* -DSF_NO_FLOAT16: the bit path */
    const _Float16 h = (_Float16)f;
    uint16_t bits;
    memcpy(&bits, &h, sizeof bits);
    return bits;
#else
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    const uint32_t sign = (x >> 16) & 0x8000u;
    const uint32_t abs = x & 0x7FFFFFFFu;
    if (abs >= 0x7F800000u) return (uint16_t)(sign | 0x7C00u | (abs > 0x7F800000u ? 0x200u : 0u));
    if (abs >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* rounds past 65504 */
    if (abs < 0x38800000u) { /* half subnormal or zero: scale to integer units of 2^-24 */
        float scaled;
        const uint32_t a = abs;
        memcpy(&scaled, &a, sizeof scaled);
        scaled *= 16777216.0f; /* exact; nearbyint rounds half to even */
        return (uint16_t)(sign | (uint32_t)__builtin_nearbyintf(scaled));
    }
    const uint32_t mant_odd = (abs >> 13) & 1u;
    const uint32_t rounded = abs + 0xFFFu + mant_odd;
    return (uint16_t)(sign | ((rounded - 0x38000000u) >> 13));
#endif
}

/* Cache kinds: the attention kernel's codes (cpu_paged_decode.c), so the one-call step
 * hands the same value to both. */
#define SF_KV_F32 0
#define SF_KV_F16 2
#define SF_KV_I8 3
#define SF_I8_SCALE_BYTES 4

/* q rounded half to even, without libm: adding then subtracting 1.5·2^23 leaves the
 * nearest integer in the default rounding mode (exact for |q| < 2^22; anything larger is
 * clamped to ±127 by the caller anyway). No -fassociative-math here, so it stays. */
static inline float sf_round_even(float q) {
    const float magic = 12582912.0f;
    return (q + magic) - magic;
}

/* x[hd] -> hd int8 values, then the row's float32 scale: kv_quant.quantize_rows bit for
 * bit (scale = max|x| / 127, q = x / scale rounded half to even, clamped to ±127; an
 * all-zero row divides by 1). A NaN makes the scale NaN, as torch's amax does. */
static inline void sf_quantize_row(const float *restrict x, int64_t hd, int8_t *restrict out) {
    float amax = 0.0f;
    for (int64_t i = 0; i < hd; i++) {
        const float a = fabsf(x[i]);
        amax = (a > amax || a != a) ? a : amax;
    }
    const float scale = amax / 127.0f;
    const float safe = scale > 0.0f ? scale : 1.0f;
    for (int64_t i = 0; i < hd; i++) {
        float q = sf_round_even(x[i] / safe);
        q = q > 127.0f ? 127.0f : q;
        q = q < -127.0f ? -127.0f : q;
        out[i] = q == q ? (int8_t)q : 0;
    }
    memcpy(out + hd, &scale, sizeof scale);
}

/* One token's k and v (kv_heads × hd floats each) into cache slot `slot`. */
static inline void sf_store_kv(const float *restrict k, const float *restrict v,
                               void *restrict k_cache, void *restrict v_cache, int cache_kind,
                               int64_t slot, int64_t kv_heads, int64_t head_dim) {
    const int64_t kv_width = kv_heads * head_dim;
    if (cache_kind == SF_KV_I8) {
        const int64_t row = head_dim + SF_I8_SCALE_BYTES;
        int8_t *restrict kd = (int8_t *)k_cache + slot * kv_heads * row;
        int8_t *restrict vd = (int8_t *)v_cache + slot * kv_heads * row;
        for (int64_t h = 0; h < kv_heads; h++) {
            sf_quantize_row(k + h * head_dim, head_dim, kd + h * row);
            sf_quantize_row(v + h * head_dim, head_dim, vd + h * row);
        }
    } else if (cache_kind == SF_KV_F16) {
        uint16_t *restrict kd = (uint16_t *)k_cache + slot * kv_width;
        uint16_t *restrict vd = (uint16_t *)v_cache + slot * kv_width;
        for (int64_t i = 0; i < kv_width; i++) {
            kd[i] = sf_float_to_half(k[i]);
            vd[i] = sf_float_to_half(v[i]);
        }
    } else {
        float *restrict kd = (float *)k_cache + slot * kv_width;
        float *restrict vd = (float *)v_cache + slot * kv_width;
        memcpy(kd, k, (size_t)kv_width * sizeof(float));
        memcpy(vd, v, (size_t)kv_width * sizeof(float));
    }
}

/* qkv[tokens, row_stride]: q heads, then k heads, then v heads (head_dim each).
 * cos/sin[table_rows, head_dim]; caches [num_slots, kv_heads, row] of `cache_kind`
 * (SF_KV_*; row = head_dim, or head_dim + 4 for int8); slots[tokens]. Returns 0, 1 when
 * a position is outside the table, 2 when a slot is outside the cache, 3 for an unknown
 * cache kind. */
int sf_rope_kv(float *restrict qkv, int64_t tokens, int64_t row_stride, int64_t heads,
               int64_t kv_heads, int64_t head_dim, const int64_t *restrict positions,
               const float *restrict cos_table, const float *restrict sin_table,
               int64_t table_rows, void *restrict k_cache, void *restrict v_cache,
               int cache_kind, const int64_t *restrict slots, int64_t num_slots) {
    const int64_t half = head_dim / 2, kv_width = kv_heads * head_dim;
    if (cache_kind != SF_KV_F32 && cache_kind != SF_KV_F16 && cache_kind != SF_KV_I8) return 3;
    for (int64_t t = 0; t < tokens; t++) {
        if (positions[t] < 0 || positions[t] >= table_rows) return 1;
        if (slots[t] < 0 || slots[t] >= num_slots) return 2;
    }
    for (int64_t t = 0; t < tokens; t++) {
        float *restrict row = qkv + t * row_stride;
        const float *restrict c = cos_table + positions[t] * head_dim;
        const float *restrict s = sin_table + positions[t] * head_dim;
        for (int64_t h = 0; h < heads + kv_heads; h++) {
            float *restrict x = row + h * head_dim;
            for (int64_t i = 0; i < half; i++) {
                const float a = x[i], b = x[i + half];
                x[i] = a * c[i] - b * s[i];
                x[i + half] = b * c[i + half] + a * s[i + half];
            }
        }
        const float *restrict k = row + heads * head_dim;
        sf_store_kv(k, k + kv_width, k_cache, v_cache, cache_kind, slots[t], kv_heads,
                    head_dim);
    }
    return 0;
}

/* ---- A whole decode step's layers in one call ----
 *
 * Once the per-layer kernels are fast, a 16-sequence decode step spends a tenth of its
 * time in Python calling them (~270 calls). This runs the same kernels in the same
 * order as the model's Python path (LlamaForCausalLM.forward with fused ops), so the
 * result is bitwise the same; the projection matmuls (packed weights) and the paged
 * attention live in their own libraries and come in as function pointers. */

typedef int (*sf_packed_mm_fn)(const float *, const uint8_t *, const uint8_t *,
                               const int64_t *, float *, int64_t, int64_t, int64_t, int);
typedef int (*sf_paged_decode_fn)(const float *, const void *, const void *, int,
                                  const int32_t *, const int32_t *, float *, int64_t, int64_t,
                                  int64_t, int64_t, int64_t, int64_t, int64_t, float, int);

/* A packed W [in, out]: its bytes and each column group's format and offset. */
typedef struct {
    const uint8_t *data, *formats;
    const int64_t *offsets;
} sf_packed;

typedef struct {
    const float *input_norm, *post_norm;
    sf_packed qkv, o, gate_up, down;
    const float *qkv_bias, *o_bias; /* NULL when the model has none */
    void *k_cache, *v_cache;        /* [num_blocks, block_size, kv_heads, head_dim] */
} sf_layer;

#define SF_PACKED_MM(m, x, w, out, rows, k, n, threads) \
    (m)->packed_mm((x), (w).data, (w).formats, (w).offsets, (out), (rows), (k), (n), (threads))

/* The step's LoRA adapters (sf_lora_add of the matmul library, sf_lora.h): each row's slot
 * (-1: none) and the slots' table [slots, layers, 4 projections, fields]. */
typedef int (*sf_lora_add_fn)(const float *, float *, int64_t, int64_t, int64_t,
                              const int32_t *, const int64_t *, int64_t, int64_t, int, int);
typedef struct {
    sf_lora_add_fn add;
    const int32_t *row_slots;
    const int64_t *table;
    int64_t num_slots, fields;
    int32_t wdtype;
} sf_lora_step;

/* out += the adapters' deltas for projection `proj` (0 qkv, 1 o, 2 gate_up, 3 down) of layer l:
 * after the matmul and its bias, as the Python path adds them (DecoderLayer._mm). */
#define SF_LORA(lora, l, proj, x, out, rows, k, n, num_layers, threads)                    \
    ((lora) == NULL ? 0                                                                   \
                    : (lora)->add((x), (out), (rows), (k), (n), (lora)->row_slots,       \
                                  (lora)->table + ((l) * 4 + (proj)) * (lora)->fields,    \
                                  (lora)->num_slots, (num_layers) * 4 * (lora)->fields,   \
                                  (lora)->wdtype, (threads)))

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, inter;
    int64_t block_size, num_blocks, table_rows;
    const float *cos, *sin, *final_norm;
    sf_packed_mm_fn packed_mm;
    sf_paged_decode_fn paged_decode;
    float eps, scale;
    int32_t cache_kind; /* SF_KV_*: float32, float16 or int8 caches */
} sf_model;

/* hidden [D, hidden] (the token embeddings; updated in place as the residual stream),
 * out [D, hidden] = the final-normed hidden states; lora: the step's adapters, or NULL.
 * Returns 0; 1/2/3: rope_kv's errors; 10 + c: a packed matmul's error c; 20 + c: the
 * attention kernel's error c; 30: no memory; 40 + c: the LoRA kernel's error c. */
int sf_decode_layers(const sf_model *m, const sf_layer *layers, float *hidden, float *out,
                     int64_t rows, const int64_t *positions, const int64_t *slots,
                     const int32_t *block_tables, const int32_t *context_lens,
                     int64_t max_blocks, int num_threads, const sf_lora_step *lora) {
    const int64_t NL = m->num_layers;
    const int64_t H = m->hidden, hd = m->head_dim, qkv_width = (m->heads + 2 * m->kv_heads) * hd;
    const int64_t q_width = m->heads * hd, I = m->inter;
    const size_t floats = (size_t)(rows * (H + qkv_width + 2 * q_width + H + 2 * I + I + H));
    float *work = malloc(floats * sizeof(float));
    if (work == NULL) return 30;
    float *x = work, *qkv = x + rows * H, *q = qkv + rows * qkv_width, *attn = q + rows * q_width;
    float *attn_out = attn + rows * q_width, *gate_up = attn_out + rows * H;
    float *act = gate_up + rows * 2 * I, *delta = act + rows * I;
    const int64_t num_slots = m->num_blocks * m->block_size;
    int status = 0;
    for (int64_t l = 0; l < m->num_layers && status == 0; l++) {
        const sf_layer *L = layers + l;
        sf_add_rms_norm(hidden, l == 0 ? NULL : delta, L->input_norm, x, rows, H, m->eps);
        status = SF_PACKED_MM(m, x, L->qkv, qkv, rows, H, qkv_width, num_threads);
        if (status) { status += 10; break; }
        if (L->qkv_bias != NULL)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < qkv_width; c++) qkv[r * qkv_width + c] += L->qkv_bias[c];
        status = SF_LORA(lora, l, 0, x, qkv, rows, H, qkv_width, NL, num_threads);
        if (status) { status += 40; break; }
        status = sf_rope_kv(qkv, rows, qkv_width, m->heads, m->kv_heads, hd, positions, m->cos,
                            m->sin, m->table_rows, L->k_cache, L->v_cache, m->cache_kind, slots,
                            num_slots);
        if (status) break;
        for (int64_t r = 0; r < rows; r++)
            memcpy(q + r * q_width, qkv + r * qkv_width, (size_t)q_width * sizeof(float));
        status = m->paged_decode(q, L->k_cache, L->v_cache, m->cache_kind, block_tables,
                                 context_lens, attn, rows, m->heads, m->kv_heads, hd,
                                 m->block_size, m->num_blocks, max_blocks, m->scale, num_threads);
        if (status) { status += 20; break; }
        status = SF_PACKED_MM(m, attn, L->o, attn_out, rows, q_width, H, num_threads);
        if (status) { status += 10; break; }
        if (L->o_bias != NULL)
            for (int64_t r = 0; r < rows; r++)
                for (int64_t c = 0; c < H; c++) attn_out[r * H + c] += L->o_bias[c];
        status = SF_LORA(lora, l, 1, attn, attn_out, rows, q_width, H, NL, num_threads);
        if (status) { status += 40; break; }
        sf_add_rms_norm(hidden, attn_out, L->post_norm, x, rows, H, m->eps);
        status = SF_PACKED_MM(m, x, L->gate_up, gate_up, rows, H, 2 * I, num_threads);
        if (status) { status += 10; break; }
        status = SF_LORA(lora, l, 2, x, gate_up, rows, H, 2 * I, NL, num_threads);
        if (status) { status += 40; break; }
        sf_silu_mul(gate_up, act, rows, I);
        status = SF_PACKED_MM(m, act, L->down, delta, rows, I, H, num_threads);
        if (status) { status += 10; break; }
        status = SF_LORA(lora, l, 3, act, delta, rows, I, H, NL, num_threads);
        if (status) { status += 40; break; }
    }
    if (status == 0)
        sf_add_rms_norm(hidden, m->num_layers > 0 ? delta : NULL, m->final_norm, out, rows, H,
                        m->eps);
    free(work);
    return status;
}
