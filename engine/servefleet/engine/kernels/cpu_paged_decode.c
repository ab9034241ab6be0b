/*
 * Gather-free paged decode attention for the CPU.
 *
 * One task = one (sequence, kv head): the group of query heads that share the kv
 * head is handled together, so every key/value row is read from the block pool
 * exactly once. Softmax is online (flash-decoding style) over chunks of at most
 * SF_CHUNK tokens, which keeps the working set small and needs no buffer sized
 * by the context length.
 *
 * No torch headers: the Python side passes raw data pointers through ctypes, so
 * this compiles in about a second with the system C compiler.
 *
 * Threading is chosen at compile time (SF_THREADING): 0 = caller's thread only,
 * 1 = pthreads started per call, 2 = OpenMP (binds to the libgomp torch already
 * loaded, so both share one thread pool).
 */
#include <float.h>
#include <stdint.h>
#if defined(__AVX512F__) || defined(__F16C__)
#include <immintrin.h>
#endif
#include <stdlib.h>
#include <string.h>

#ifndef SF_THREADING
#define SF_THREADING 0
#endif

#if SF_THREADING == 1
#include <pthread.h>
#elif SF_THREADING == 2
#include <omp.h>
#endif

#define SF_CHUNK 64

#define SF_OK 0
#define SF_ERR_CONTEXT_LEN 1
#define SF_ERR_BLOCK_ID 2
#define SF_ERR_NO_MEMORY 3
#define SF_ERR_CACHE_KIND 4

typedef struct {
    const float *q;             /* [D, H, hd], float32 */
    const void *k_cache;        /* [NB, BS, kvh, hd] float32/bf16/fp16, or int8 [.., hd + 4] */
    const void *v_cache;
    const int32_t *block_tables; /* [D, max_blocks] */
    const int32_t *context_lens; /* [D] */
    float *out;                 /* [D, H, hd], float32 */
    int64_t num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks, max_blocks;
    float scale;
    int cache_kind; /* SF_CACHE_* */
} sf_args;

#define SF_CACHE_F32 0
#define SF_CACHE_BF16 1
#define SF_CACHE_F16 2
#define SF_CACHE_I8 3 /* hd int8 values, then the row's float32 scale (kv_quant.py) */
#define SF_I8_SCALE_BYTES 4

#include "sf_exp.h" /* sf_exp_nonpos */

/* GCC/Clang generic vectors: 16 floats, lowered to whatever the target has
 * (one zmm with AVX-512, two ymm with AVX2, four xmm/NEON registers otherwise). */
typedef float sf_v16 __attribute__((vector_size(64)));

static inline sf_v16 sf_load16(const float *p) {
    sf_v16 v;
    memcpy(&v, p, sizeof v);
    return v;
}

static inline void sf_store16(float *p, sf_v16 v) { memcpy(p, &v, sizeof v); }

static inline float sf_hsum16(sf_v16 v) {
    float s = 0.0f;
    for (int i = 0; i < 16; i++) s += v[i];
    return s;
}

/* Lane i of the result = the sum of v[i]'s 16 lanes: a transpose-and-add tree (15
 * shuffle pairs for 16 vectors) instead of 16 separate horizontal sums. */
static inline sf_v16 sf_hsum16x16(const sf_v16 v[16]) {
    sf_v16 c[8], e[4], g[2];
    for (int i = 0; i < 8; i++) /* lanes 0-7: 8 partials of v[2i], 8-15: of v[2i+1] */
        c[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17,
                                       18, 19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++) /* 4 partials each of 4 vectors */
        e[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17,
                                       18, 19, 24, 25, 26, 27) +
               __builtin_shufflevector(c[2 * i], c[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21,
                                       22, 23, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++) /* 2 partials each of 8 vectors */
        g[i] = __builtin_shufflevector(e[2 * i], e[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17,
                                       20, 21, 24, 25, 28, 29) +
               __builtin_shufflevector(e[2 * i], e[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19,
                                       22, 23, 26, 27, 30, 31);
    return __builtin_shufflevector(g[0], g[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                   28, 30) +
           __builtin_shufflevector(g[0], g[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                   29, 31);
}

/* Widen `n` bf16 rows (stride `stride` elements) to a dense float32 [n][hd] buffer. */
static inline void sf_widen_rows(const uint16_t *src, int64_t stride, int64_t n, int64_t hd,
                                 float *restrict dst) {
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *row = src + t * stride;
        for (int64_t d = 0; d < hd; d++) {
            union { uint32_t u; float f; } bits;
            bits.u = ((uint32_t)row[d]) << 16;
            dst[t * hd + d] = bits.f;
        }
    }
}

/* IEEE half -> float, exactly (normals, subnormals, inf, nan): the compiler's _Float16
 * where it has one, else bit arithmetic (-DSF_NO_FLOAT16 forces that path). */
static inline float sf_half_to_float(uint16_t h) {
#if defined(__FLT16_MAX__) && !defined(SF_NO_FLOAT16)
    _Float16 v;
    memcpy(&v, &h, sizeof v);
    return (float)v;
#else
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exp = (h >> 10) & 0x1Fu, mant = h & 0x3FFu;
    union { uint32_t u; float f; } bits;
    if (exp == 0) { /* zero or subnormal: mant × 2^-24 */
        bits.f = (float)mant * 5.9604644775390625e-8f;
        bits.u |= sign;
    } else if (exp == 31) {
        bits.u = sign | 0x7F800000u | (mant << 13);
    } else {
        bits.u = sign | ((exp + 112u) << 23) | (mant << 13);
    }
    return bits.f;
#endif
}

/* Widen `n` fp16 rows (stride `stride` elements) to a dense float32 [n][hd] buffer,
 * with the conversion instructions where the target has them (exact either way). */
static inline void sf_widen_rows_f16(const uint16_t *src, int64_t stride, int64_t n, int64_t hd,
                                     float *restrict dst) {
    for (int64_t t = 0; t < n; t++) {
        const uint16_t *row = src + t * stride;
        int64_t d = 0;
#if defined(SF_NO_FLOAT16) /* the portable conversion only (tests build it this way too) */
#elif defined(__AVX512F__)
        for (; d + 16 <= hd; d += 16)
            _mm512_storeu_ps(dst + t * hd + d,
                             _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(row + d))));
#elif defined(__F16C__)
        for (; d + 8 <= hd; d += 8)
            _mm256_storeu_ps(dst + t * hd + d,
                             _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(row + d))));
#endif
        for (; d < hd; d++) dst[t * hd + d] = sf_half_to_float(row[d]);
    }
}

/* Widen `n` int8 rows (stride in bytes) to a dense float32 [n][hd] buffer: each row's
 * values times the float32 scale stored right after them. */
static inline void sf_widen_rows_i8(const int8_t *src, int64_t stride, int64_t n, int64_t hd,
                                    float *restrict dst) {
    for (int64_t t = 0; t < n; t++) {
        const int8_t *row = src + t * stride;
        float scale;
        memcpy(&scale, row + hd, sizeof scale);
        for (int64_t d = 0; d < hd; d++) dst[t * hd + d] = (float)row[d] * scale;
    }
}

/* scores[t] = q . k_t for n rows of k (stride in floats). */
static inline __attribute__((always_inline)) void sf_scores(
    const float *restrict q, const float *restrict k, int64_t stride, int64_t n,
    const int64_t hd, float *restrict scores) {
    if (hd % 16 == 0 && hd <= 256) {
        enum { MAXV = 16 };
        const int nv = (int)(hd / 16);
        sf_v16 qv[MAXV];
        for (int j = 0; j < nv; j++) qv[j] = sf_load16(q + 16 * j);
        int64_t t = 0;
        for (; t + 16 <= n; t += 16) { /* a full block: 16 dot products, one reduction */
            sf_v16 acc[16];
            for (int r = 0; r < 16; r++) {
                const float *row = k + (t + r) * stride;
                acc[r] = qv[0] * sf_load16(row);
                for (int j = 1; j < nv; j++) acc[r] += qv[j] * sf_load16(row + 16 * j);
            }
            sf_store16(scores + t, sf_hsum16x16(acc));
        }
        for (; t < n; t++) {
            const float *row = k + t * stride;
            sf_v16 acc = qv[0] * sf_load16(row);
            for (int j = 1; j < nv; j++) acc += qv[j] * sf_load16(row + 16 * j);
            scores[t] = sf_hsum16(acc);
        }
        return;
    }
    for (int64_t t = 0; t < n; t++) {
        const float *row = k + t * stride;
        float dot = 0.0f;
        for (int64_t d = 0; d < hd; d++) dot += q[d] * row[d];
        scores[t] = dot;
    }
}

/* acc = acc * alpha + sum_t p[t] * v_t, with acc held in registers across t. */
static inline __attribute__((always_inline)) void sf_accumulate(
    float *restrict acc, float alpha, const float *restrict p, const float *restrict v,
    int64_t stride, int64_t n, const int64_t hd) {
    if (hd % 16 == 0 && hd <= 256) {
        enum { MAXV = 16 };
        const int nv = (int)(hd / 16);
        sf_v16 av[MAXV];
        for (int j = 0; j < nv; j++) av[j] = sf_load16(acc + 16 * j) * alpha;
        for (int64_t t = 0; t < n; t++) {
            const float *row = v + t * stride;
            const float pt = p[t];
            for (int j = 0; j < nv; j++) av[j] += pt * sf_load16(row + 16 * j);
        }
        for (int j = 0; j < nv; j++) sf_store16(acc + 16 * j, av[j]);
        return;
    }
    for (int64_t d = 0; d < hd; d++) acc[d] *= alpha;
    for (int64_t t = 0; t < n; t++) {
        const float *row = v + t * stride;
        const float pt = p[t];
        for (int64_t d = 0; d < hd; d++) acc[d] += pt * row[d];
    }
}

/* Ask for one block's rows of this kv head ahead of use: blocks are scattered
 * over the pool, so the hardware prefetcher cannot guess the next one. */
static inline void sf_prefetch_block(const char *k, const char *v, int64_t rows,
                                     int64_t row_bytes, int64_t stride_bytes) {
    for (int64_t t = 0; t < rows; t++) {
        for (int64_t b = 0; b < row_bytes; b += 64) {
            __builtin_prefetch(k + t * stride_bytes + b, 0, 3);
            __builtin_prefetch(v + t * stride_bytes + b, 0, 3);
        }
    }
}

/* n rows of k and v (stride in floats) for every query head of the group: scores, the
 * online softmax (alpha rescales what was accumulated when the max grows), then the
 * weighted sum of values. */
static inline __attribute__((always_inline)) void sf_attend_chunk(
    const float *k, const float *v, int64_t stride, int64_t n, int64_t group, const int64_t hd,
    const float *qs, float *acc, float *scores, float *run_max, float *run_sum, float *alpha) {
    /* scores for every query head of the group (rows stay in L1 across heads) */
    for (int64_t g = 0; g < group; g++) {
        sf_scores(qs + g * hd, k, stride, n, hd, scores + g * SF_CHUNK);
    }
    for (int64_t g = 0; g < group; g++) {
        float *sg = scores + g * SF_CHUNK;
        float chunk_max = sg[0];
        for (int64_t t = 1; t < n; t++) chunk_max = sg[t] > chunk_max ? sg[t] : chunk_max;
        const float new_max = chunk_max > run_max[g] ? chunk_max : run_max[g];
        alpha[g] = new_max > run_max[g] ? sf_exp_nonpos(run_max[g] - new_max) : 1.0f;
        run_max[g] = new_max;
        float sum = 0.0f;
        for (int64_t t = 0; t < n; t++) {
            sg[t] = sf_exp_nonpos(sg[t] - new_max);
            sum += sg[t];
        }
        run_sum[g] = run_sum[g] * alpha[g] + sum;
    }
    for (int64_t g = 0; g < group; g++) {
        sf_accumulate(acc + g * hd, alpha[g], scores + g * SF_CHUNK, v, stride, n, hd);
    }
}

/* One (sequence, kv head). `hd` and `kind` are compile-time constants at the
 * specialised call sites below, so the inner loops fully vectorise. */
static inline __attribute__((always_inline)) int sf_attend_one(
    const sf_args *a, int64_t seq, int64_t kv_head, const int64_t hd, const int kind,
    float *work) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    const int64_t bs = a->block_size;
    /* Bytes of one (token, kv head) row, then between tokens of a block, then blocks. */
    const int64_t head_bytes =
        kind == SF_CACHE_I8 ? hd + SF_I8_SCALE_BYTES : hd * (kind == SF_CACHE_F32 ? 4 : 2);
    const int64_t row_bytes = a->num_kv_heads * head_bytes;
    const int64_t block_bytes = bs * row_bytes;
    const int64_t len = a->context_lens[seq];
    if (len < 1 || len > a->max_blocks * bs) return SF_ERR_CONTEXT_LEN;

    float *qs = work;                          /* [group, hd]   scaled queries */
    float *acc = qs + group * hd;              /* [group, hd]   unnormalised output */
    float *scores = acc + group * hd;          /* [group, SF_CHUNK] */
    float *kbuf = scores + group * SF_CHUNK;   /* [SF_CHUNK, hd] widened 16/8-bit keys */
    float *vbuf = kbuf + SF_CHUNK * hd;        /* [SF_CHUNK, hd] widened 16/8-bit values */
    float run_max[group], run_sum[group], alpha[group];

    const float *q = a->q + (seq * a->num_heads + kv_head * group) * hd;
    for (int64_t i = 0; i < group * hd; i++) {
        qs[i] = q[i] * a->scale;
        acc[i] = 0.0f;
    }
    for (int64_t g = 0; g < group; g++) {
        run_max[g] = -FLT_MAX;
        run_sum[g] = 0.0f;
    }

    const int32_t *table = a->block_tables + seq * a->max_blocks;
    const char *kbase = (const char *)a->k_cache + kv_head * head_bytes;
    const char *vbase = (const char *)a->v_cache + kv_head * head_bytes;
    const int64_t num_table_blocks = (len + bs - 1) / bs;

    for (int64_t b = 0; b < num_table_blocks; b++) {
        const int64_t block_id = table[b];
        if (block_id < 0 || block_id >= a->num_blocks) return SF_ERR_BLOCK_ID;
        if (b + 1 < num_table_blocks) {
            const int64_t next = table[b + 1];
            if (next >= 0 && next < a->num_blocks) {
                const int64_t rows = len - (b + 1) * bs < bs ? len - (b + 1) * bs : bs;
                sf_prefetch_block(kbase + next * block_bytes, vbase + next * block_bytes, rows,
                                  head_bytes, row_bytes);
            }
        }
        const int64_t start = b * bs;
        const int64_t in_block = len - start < bs ? len - start : bs;
        const char *kblock = kbase + block_id * block_bytes;
        const char *vblock = vbase + block_id * block_bytes;

        for (int64_t c0 = 0; c0 < in_block; c0 += SF_CHUNK) {
            const int64_t n = in_block - c0 < SF_CHUNK ? in_block - c0 : SF_CHUNK;
            const float *k, *v;
            int64_t stride;
            const char *krows = kblock + c0 * row_bytes, *vrows = vblock + c0 * row_bytes;
            if (kind == SF_CACHE_BF16) {
                sf_widen_rows((const uint16_t *)krows, row_bytes / 2, n, hd, kbuf);
                sf_widen_rows((const uint16_t *)vrows, row_bytes / 2, n, hd, vbuf);
                k = kbuf;
                v = vbuf;
                stride = hd;
            } else if (kind == SF_CACHE_F16) {
                sf_widen_rows_f16((const uint16_t *)krows, row_bytes / 2, n, hd, kbuf);
                sf_widen_rows_f16((const uint16_t *)vrows, row_bytes / 2, n, hd, vbuf);
                k = kbuf;
                v = vbuf;
                stride = hd;
            } else if (kind == SF_CACHE_I8) {
                sf_widen_rows_i8((const int8_t *)krows, row_bytes, n, hd, kbuf);
                sf_widen_rows_i8((const int8_t *)vrows, row_bytes, n, hd, vbuf);
                k = kbuf;
                v = vbuf;
                stride = hd;
            } else {
                k = (const float *)krows;
                v = (const float *)vrows;
                stride = row_bytes / 4;
            }
            sf_attend_chunk(k, v, stride, n, group, hd, qs, acc, scores, run_max, run_sum, alpha);
        }
    }

    float *out = a->out + (seq * a->num_heads + kv_head * group) * hd;
    for (int64_t g = 0; g < group; g++) {
        const float inv = 1.0f / run_sum[g];
        for (int64_t d = 0; d < hd; d++) out[g * hd + d] = acc[g * hd + d] * inv;
    }
    return SF_OK;
}

static int sf_attend_task(const sf_args *a, int64_t task, float *work) {
    const int64_t seq = task / a->num_kv_heads;
    const int64_t kv_head = task % a->num_kv_heads;
    const int64_t hd = a->head_dim;
    if (a->cache_kind == SF_CACHE_BF16) {
        if (hd == 32) return sf_attend_one(a, seq, kv_head, 32, SF_CACHE_BF16, work);
        if (hd == 64) return sf_attend_one(a, seq, kv_head, 64, SF_CACHE_BF16, work);
        if (hd == 128) return sf_attend_one(a, seq, kv_head, 128, SF_CACHE_BF16, work);
        return sf_attend_one(a, seq, kv_head, hd, SF_CACHE_BF16, work);
    }
    if (a->cache_kind == SF_CACHE_F16) {
        if (hd == 32) return sf_attend_one(a, seq, kv_head, 32, SF_CACHE_F16, work);
        if (hd == 64) return sf_attend_one(a, seq, kv_head, 64, SF_CACHE_F16, work);
        if (hd == 128) return sf_attend_one(a, seq, kv_head, 128, SF_CACHE_F16, work);
        return sf_attend_one(a, seq, kv_head, hd, SF_CACHE_F16, work);
    }
    if (a->cache_kind == SF_CACHE_I8) {
        if (hd == 32) return sf_attend_one(a, seq, kv_head, 32, SF_CACHE_I8, work);
        if (hd == 64) return sf_attend_one(a, seq, kv_head, 64, SF_CACHE_I8, work);
        if (hd == 128) return sf_attend_one(a, seq, kv_head, 128, SF_CACHE_I8, work);
        return sf_attend_one(a, seq, kv_head, hd, SF_CACHE_I8, work);
    }
    if (hd == 32) return sf_attend_one(a, seq, kv_head, 32, 0, work);
    if (hd == 64) return sf_attend_one(a, seq, kv_head, 64, 0, work);
    if (hd == 128) return sf_attend_one(a, seq, kv_head, 128, 0, work);
    return sf_attend_one(a, seq, kv_head, hd, 0, work);
}

static size_t sf_work_floats(const sf_args *a) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    return (size_t)(2 * group * a->head_dim + group * SF_CHUNK + 2 * SF_CHUNK * a->head_dim);
}

#if SF_THREADING != 2
/* Runs tasks [first, end) with stride `step`; returns the first error seen. */
static int sf_run_tasks(const sf_args *a, int64_t first, int64_t end, int64_t step) {
    float *work = (float *)malloc(sf_work_floats(a) * sizeof(float));
    if (!work) return SF_ERR_NO_MEMORY;
    int err = SF_OK;
    for (int64_t task = first; task < end; task += step) {
        int rc = sf_attend_task(a, task, work);
        if (rc != SF_OK && err == SF_OK) err = rc;
    }
    free(work);
    return err;
}
#endif

#if SF_THREADING == 1
typedef struct {
    const sf_args *args;
    int64_t first, end, step;
    int rc;
} sf_worker;

static void *sf_worker_main(void *p) {
    sf_worker *w = (sf_worker *)p;
    w->rc = sf_run_tasks(w->args, w->first, w->end, w->step);
    return NULL;
}
#endif

int sf_threading_mode(void) { return SF_THREADING; }

int sf_paged_decode(const float *q, const void *k_cache, const void *v_cache,
                    int cache_kind, const int32_t *block_tables,
                    const int32_t *context_lens, float *out, int64_t num_seqs,
                    int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
                    int64_t block_size, int64_t num_blocks, int64_t max_blocks, float scale,
                    int num_threads) {
    sf_args a = {q, k_cache, v_cache, block_tables, context_lens, out,
                 num_seqs, num_heads, num_kv_heads, head_dim, block_size, num_blocks,
                 max_blocks, scale, cache_kind};
    if (cache_kind < SF_CACHE_F32 || cache_kind > SF_CACHE_I8) return SF_ERR_CACHE_KIND;
    const int64_t num_tasks = num_seqs * num_kv_heads;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > num_tasks) num_threads = (int)(num_tasks > 0 ? num_tasks : 1);

#if SF_THREADING == 2
    int err = SF_OK;
#pragma omp parallel num_threads(num_threads)
    {
        float *work = (float *)malloc(sf_work_floats(&a) * sizeof(float));
        int local = work ? SF_OK : SF_ERR_NO_MEMORY;
#pragma omp for schedule(dynamic, 1) nowait
        for (int64_t task = 0; task < num_tasks; task++) {
            if (!work) continue;
            int rc = sf_attend_task(&a, task, work);
            if (rc != SF_OK && local == SF_OK) local = rc;
        }
        free(work);
        if (local != SF_OK) {
#pragma omp critical
            if (err == SF_OK) err = local;
        }
    }
    return err;
#elif SF_THREADING == 1
    if (num_threads == 1) return sf_run_tasks(&a, 0, num_tasks, 1);
    sf_worker workers[num_threads];
    pthread_t threads[num_threads];
    int started = 0, err = SF_OK;
    /* task i goes to worker i % n: interleaving balances sequences of mixed lengths */
    for (int i = 0; i < num_threads; i++) {
        workers[i] = (sf_worker){&a, i, num_tasks, num_threads, SF_OK};
    }
    for (int i = 1; i < num_threads; i++) {
        if (pthread_create(&threads[i], NULL, sf_worker_main, &workers[i]) != 0) break;
        started = i;
    }
    for (int i = started + 1; i < num_threads; i++) { /* run what could not be started */
        workers[i].rc = sf_run_tasks(&a, i, num_tasks, num_threads);
    }
    sf_worker_main(&workers[0]);
    for (int i = 1; i <= started; i++) pthread_join(threads[i], NULL);
    for (int i = 0; i < num_threads; i++) {
        if (workers[i].rc != SF_OK && err == SF_OK) err = workers[i].rc;
    }
    return err;
#else
    (void)num_threads;
    return sf_run_tasks(&a, 0, num_tasks, 1);
#endif
}
