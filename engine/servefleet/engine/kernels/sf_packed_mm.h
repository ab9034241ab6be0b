/*
 * Packed weights for cpu_small_gemm.c (included there, after its dense tiles, which the
 * AVX2 path reuses): W [K, N] as a quantized checkpoint stored it.
 *
 * K % 32 == 0. Columns come in groups of 16 and K in blocks of 32; a group's blocks are
 * contiguous ([K/32][block]) and every group has its own format, so a fused projection
 * whose parts were stored differently (Q4_K q/k with a Q6_K v) is still one weight.
 * `formats[g]` and `offsets[g]` (bytes from the start) locate group g. Formats:
 *   Q4 (GGUF Q4_0, Q4_1, Q4_K): float scale[16], float min[16], uint8 nib[16][16]
 *      (byte nib[j][c]: k = 2j in its low nibble, k = 2j + 1 in its high one);
 *      w = scale × q + min, q 0..15.
 *   Q5 (Q5_0, Q5_1, Q5_K): Q4's block, then uint32 high[16] (bit k = bit 4 of q[k][c]);
 *      w = scale × q + min, q 0..31.
 *   Q6 (Q6_K): float scale[2][16] (k 0..15, k 16..31), nib[16][16] (q's low 4 bits),
 *      uint32 high[2][16] (bits 2(k mod 16)..+1 = q's bits 4-5); w = scale × (q - 32).
 *   Q8 (Q8_0): float scale[16], int8 q[32][16]; w = scale × q.
 * Padded columns have scale = min = 0. scale × q is exact in float32 for every format
 * (≤ 18-bit scales times ≤ 6-bit q), so scale × q + min rounds once, as the GGUF
 * reference does: w is bitwise the checkpoint's dequantized float32 weight, and every
 * output is summed over k in ascending order, so a packed call returns bitwise what
 * sf_small_mm returns on the dequantized weights.
 */
#define SF_QK 32
#define SF_QCOLS 16
enum { SF_FMT_Q4 = 0, SF_FMT_Q8 = 1, SF_FMT_Q5 = 2, SF_FMT_Q6 = 3, SF_NUM_FMTS = 4 };
#define SF_SCALES_BYTES (SF_QCOLS * 4)
#define SF_NIB_BYTES (SF_QK / 2 * SF_QCOLS)

SF_AI int64_t sf_format_bytes(const int fmt) {
    switch (fmt) {
    case SF_FMT_Q4: return 2 * SF_SCALES_BYTES + SF_NIB_BYTES;
    case SF_FMT_Q8: return SF_SCALES_BYTES + SF_QK * SF_QCOLS;
    case SF_FMT_Q5: return 3 * SF_SCALES_BYTES + SF_NIB_BYTES;
    case SF_FMT_Q6: return 4 * SF_SCALES_BYTES + SF_NIB_BYTES;
    default: return -1;
    }
}

/* Bytes of one 32 × 16 block of `format`, -1 for an unknown one (the Python side checks
 * its table against this). */
int sf_packed_block_bytes(int format) { return (int)sf_format_bytes(format); }

/* One block (32 k × 16 columns) into dst rows of stride ld floats; with `fmt` a constant
 * the column loops vectorise. Fused or not, scale × q + min rounds once. */
SF_AI void sf_dequant_fmt(const int fmt, const uint8_t *restrict block, float *restrict dst,
                          int64_t ld) {
    float scale[2][SF_QCOLS], second[SF_QCOLS];
    uint32_t high[2][SF_QCOLS];
    memcpy(scale[0], block, sizeof scale[0]);
    if (fmt == SF_FMT_Q8) {
        const int8_t *restrict q = (const int8_t *)(block + SF_SCALES_BYTES);
        for (int k = 0; k < SF_QK; k++)
            for (int c = 0; c < SF_QCOLS; c++)
                dst[k * ld + c] = scale[0][c] * (float)q[k * SF_QCOLS + c];
        return;
    }
    memcpy(second, block + SF_SCALES_BYTES, sizeof second); /* min, or Q6's second scale */
    const uint8_t *restrict nib = block + 2 * SF_SCALES_BYTES;
    if (fmt == SF_FMT_Q5) memcpy(high[0], nib + SF_NIB_BYTES, sizeof high[0]);
    if (fmt == SF_FMT_Q6) memcpy(high, nib + SF_NIB_BYTES, sizeof high);
    for (int k = 0; k < SF_QK; k++) {
        const uint8_t *restrict bytes = nib + (k / 2) * SF_QCOLS;
        const int shift = (k & 1) * 4;
        float *restrict row = dst + k * ld;
        for (int c = 0; c < SF_QCOLS; c++) {
            int q = (bytes[c] >> shift) & 15;
            if (fmt == SF_FMT_Q4) {
                row[c] = scale[0][c] * (float)q + second[c];
            } else if (fmt == SF_FMT_Q5) {
                q |= (int)((high[0][c] >> k) & 1u) << 4;
                row[c] = scale[0][c] * (float)q + second[c];
            } else {
                q |= (int)((high[k / 16][c] >> (2 * (k % 16))) & 3u) << 4;
                row[c] = (k < 16 ? scale[0][c] : second[c]) * (float)(q - 32);
            }
        }
    }
}

static void sf_dequant_block(const int fmt, const uint8_t *restrict block, float *restrict dst,
                             int64_t ld) {
    switch (fmt) {
    case SF_FMT_Q4: sf_dequant_fmt(SF_FMT_Q4, block, dst, ld); break;
    case SF_FMT_Q8: sf_dequant_fmt(SF_FMT_Q8, block, dst, ld); break;
    case SF_FMT_Q5: sf_dequant_fmt(SF_FMT_Q5, block, dst, ld); break;
    default: sf_dequant_fmt(SF_FMT_Q6, block, dst, ld); break;
    }
}

#if SF_ISA == 3
/* AVX-512: one group is one vector of columns, dequantized in registers at each k and
 * used by up to SF_PACKED_MB rows of x. The accumulators stay in registers over all of
 * K, summed over k in ascending order — the order of sf_mm_tile, hence its bits.
 * Above SF_PACKED_DIRECT_MB rows, x arrives transposed (xt[k][SF_PACKED_MB], row
 * stride 1, k stride 16): the broadcasts of a k then address one pointer, where 16 row
 * pointers would not fit in the general registers and reloading them from the stack
 * took the load ports the broadcasts need. Up to 8 rows read x in place (row stride K,
 * k stride 1), which saves the transpose where it cost more than it gained. */
#define SF_PACKED_MB 16
#define SF_PACKED_DIRECT_MB 8

/* Weights of k = 2j and 2j + 1 for the nibble formats. `high` holds the remaining high
 * bits of this block (Q5: 2 per pair, Q6: 4 per pair), consumed from the bottom. */
SF_AI void sf_decode_pair(const int fmt, const uint8_t *nib, const int j, __m512 scale,
                          __m512 second, __m512i *high, __m512 *even, __m512 *odd) {
    const __m512i low4 = _mm512_set1_epi32(15);
    const __m512i bytes =
        _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(nib + j * SF_QCOLS)));
    __m512i lo = _mm512_and_si512(bytes, low4), hi = _mm512_srli_epi32(bytes, 4);
    if (fmt == SF_FMT_Q5) {
        lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(*high, _mm512_set1_epi32(1)), 4));
        hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(*high, _mm512_set1_epi32(2)), 3));
        *high = _mm512_srli_epi32(*high, 2);
    } else if (fmt == SF_FMT_Q6) {
        lo = _mm512_or_si512(lo, _mm512_slli_epi32(_mm512_and_si512(*high, _mm512_set1_epi32(3)), 4));
        hi = _mm512_or_si512(hi, _mm512_slli_epi32(_mm512_and_si512(*high, _mm512_set1_epi32(12)), 2));
        *high = _mm512_srli_epi32(*high, 4);
    }
    if (fmt == SF_FMT_Q6) {
        const __m512i offset = _mm512_set1_epi32(32);
        const __m512 s = j < SF_QK / 4 ? scale : second;
        *even = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_sub_epi32(lo, offset)));
        *odd = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_sub_epi32(hi, offset)));
    } else {
        *even = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(lo), second);
        *odd = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(hi), second);
    }
}

SF_AI void sf_packed_tile(const int fmt, const int MB, const int transposed,
                          const float *restrict xt, const uint8_t *restrict wq, int64_t K,
                          float *restrict out, int64_t ldo, __mmask16 mask) {
    const int64_t row_step = transposed ? 1 : K, k_step = transposed ? SF_PACKED_MB : 1;
    __m512 acc[SF_PACKED_MB];
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();
    const int64_t block_bytes = sf_format_bytes(fmt);
    for (int64_t b = 0; b < K / SF_QK; b++) {
        const uint8_t *block = wq + b * block_bytes;
        const float *xb = xt + b * SF_QK * k_step;
        const __m512 scale = _mm512_loadu_ps((const float *)block);
        if (fmt == SF_FMT_Q8) {
            const int8_t *q = (const int8_t *)(block + SF_SCALES_BYTES);
            for (int k = 0; k < SF_QK; k++) {
                const __m512 w = _mm512_mul_ps(
                    scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
                               _mm_loadu_si128((const __m128i *)(q + k * SF_QCOLS)))));
#pragma GCC unroll 16
                for (int m = 0; m < MB; m++)
                    acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xb[k * k_step + m * row_step]), w,
                                             acc[m]);
            }
            continue;
        }
        const __m512 second = _mm512_loadu_ps((const float *)(block + SF_SCALES_BYTES));
        const uint8_t *nib = block + 2 * SF_SCALES_BYTES;
        const __m512i *high_words = (const __m512i *)(nib + SF_NIB_BYTES);
        __m512i high = fmt == SF_FMT_Q4 ? _mm512_setzero_si512() : _mm512_loadu_si512(high_words);
        for (int j = 0; j < SF_QK / 2; j++) {
            if (fmt == SF_FMT_Q6 && j == SF_QK / 4) high = _mm512_loadu_si512(high_words + 1);
            __m512 even, odd;
            sf_decode_pair(fmt, nib, j, scale, second, &high, &even, &odd);
#pragma GCC unroll 16
            for (int m = 0; m < MB; m++)
                acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xb[2 * j * k_step + m * row_step]), even,
                                         acc[m]);
#pragma GCC unroll 16
            for (int m = 0; m < MB; m++)
                acc[m] = _mm512_fmadd_ps(_mm512_set1_ps(xb[(2 * j + 1) * k_step + m * row_step]),
                                         odd, acc[m]);
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++) _mm512_mask_storeu_ps(out + m * ldo, mask, acc[m]);
}

#define SF_PACKED_ARGS                                                                      \
    const float *restrict xt, const uint8_t *restrict wq, int64_t K, float *restrict out, \
        int64_t ldo, __mmask16 mask
typedef void (*sf_packed_fn)(SF_PACKED_ARGS);
/* sf_p<F>_<MB>: tiles that read x in place up to 8 rows, transposed above; sf_pt<F>_<MB>:
 * 1..8 rows in the transposed layout (the tail tile after transposed ones). */
#define SF_PACKED_FN(F_, MB_)                                                              \
    static void sf_p##F_##_##MB_(SF_PACKED_ARGS) {                                         \
        sf_packed_tile(F_, MB_, MB_ > SF_PACKED_DIRECT_MB, xt, wq, K, out, ldo, mask);     \
    }
#define SF_PACKED_TAIL_FN(F_, MB_)                                                         \
    static void sf_pt##F_##_##MB_(SF_PACKED_ARGS) {                                        \
        sf_packed_tile(F_, MB_, 1, xt, wq, K, out, ldo, mask);                             \
    }
#define SF_PACKED_FNS(F_)                                                                  \
    SF_PACKED_FN(F_, 1) SF_PACKED_FN(F_, 2) SF_PACKED_FN(F_, 3) SF_PACKED_FN(F_, 4)        \
    SF_PACKED_FN(F_, 5) SF_PACKED_FN(F_, 6) SF_PACKED_FN(F_, 7) SF_PACKED_FN(F_, 8)        \
    SF_PACKED_FN(F_, 9) SF_PACKED_FN(F_, 10) SF_PACKED_FN(F_, 11) SF_PACKED_FN(F_, 12)     \
    SF_PACKED_FN(F_, 13) SF_PACKED_FN(F_, 14) SF_PACKED_FN(F_, 15) SF_PACKED_FN(F_, 16)    \
    SF_PACKED_TAIL_FN(F_, 1) SF_PACKED_TAIL_FN(F_, 2) SF_PACKED_TAIL_FN(F_, 3)             \
    SF_PACKED_TAIL_FN(F_, 4) SF_PACKED_TAIL_FN(F_, 5) SF_PACKED_TAIL_FN(F_, 6)             \
    SF_PACKED_TAIL_FN(F_, 7) SF_PACKED_TAIL_FN(F_, 8)
SF_PACKED_FNS(0)
SF_PACKED_FNS(1)
SF_PACKED_FNS(2)
SF_PACKED_FNS(3)
#define SF_PACKED_ENTRY(F_)                                                                \
    {sf_p##F_##_1,  sf_p##F_##_2,  sf_p##F_##_3,  sf_p##F_##_4,  sf_p##F_##_5,  sf_p##F_##_6, \
     sf_p##F_##_7,  sf_p##F_##_8,  sf_p##F_##_9,  sf_p##F_##_10, sf_p##F_##_11,             \
     sf_p##F_##_12, sf_p##F_##_13, sf_p##F_##_14, sf_p##F_##_15, sf_p##F_##_16}
#define SF_PACKED_TAIL_ENTRY(F_)                                                           \
    {sf_pt##F_##_1, sf_pt##F_##_2, sf_pt##F_##_3, sf_pt##F_##_4,                           \
     sf_pt##F_##_5, sf_pt##F_##_6, sf_pt##F_##_7, sf_pt##F_##_8}
static const sf_packed_fn sf_packed_table[SF_NUM_FMTS][SF_PACKED_MB] = {
    SF_PACKED_ENTRY(0), SF_PACKED_ENTRY(1), SF_PACKED_ENTRY(2), SF_PACKED_ENTRY(3)};
static const sf_packed_fn sf_packed_tail[SF_NUM_FMTS][SF_PACKED_DIRECT_MB] = {
    SF_PACKED_TAIL_ENTRY(0), SF_PACKED_TAIL_ENTRY(1), SF_PACKED_TAIL_ENTRY(2),
    SF_PACKED_TAIL_ENTRY(3)};

/* xt[tile][K][SF_PACKED_MB] = x[tile·16 + m][k] for k in [k0, k1): each tile of 16 rows
 * transposed (M > SF_PACKED_DIRECT_MB only); threads split K. */
static void sf_transpose_rows(const float *restrict x, float *restrict xt, int64_t M, int64_t K,
                              int64_t k0, int64_t k1) {
    for (int64_t m0 = 0; m0 < M; m0 += SF_PACKED_MB) {
        const int64_t mb = M - m0 < SF_PACKED_MB ? M - m0 : SF_PACKED_MB;
        float *restrict tile = xt + m0 * K;
        for (int64_t m = 0; m < mb; m++) {
            const float *restrict row = x + (m0 + m) * K;
            for (int64_t k = k0; k < k1; k++) tile[k * SF_PACKED_MB + m] = row[k];
        }
    }
}

/* Groups [g0, g1) of out's columns for every row (x transposed by sf_transpose_rows
 * when M > SF_PACKED_DIRECT_MB). A group's packed weights (a few KiB) stay in L1/L2
 * while the row tiles after the first re-read them. */
static void sf_packed_range(const float *xt, const uint8_t *wq, const uint8_t *formats,
                            const int64_t *offsets, float *out, int64_t M, int64_t K,
                            int64_t N, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        const __mmask16 mask = sf_mask_first(N - g * SF_QCOLS);
        const int fmt = formats[g];
        for (int64_t m0 = 0; m0 < M; m0 += SF_PACKED_MB) {
            const int mb = (int)(M - m0 < SF_PACKED_MB ? M - m0 : SF_PACKED_MB);
            /* A tail tile of <= 8 rows after transposed ones is transposed too: its rows
             * are in xt; it reads them with the transposed layout's strides. */
            const sf_packed_fn tile = M > SF_PACKED_DIRECT_MB && mb <= SF_PACKED_DIRECT_MB
                                          ? sf_packed_tail[fmt][mb - 1]
                                          : sf_packed_table[fmt][mb - 1];
            tile(xt + m0 * K, wq + offsets[g], K, out + m0 * N + g * SF_QCOLS, N, mask);
        }
    }
}

#elif SF_ISA == 2
#include "sf_packed_avx2.h" /* AVX2: weights dequantized in registers too */

#else /* plain C: the summation order of the plain dense path */

static void sf_packed_range(const float *x, const uint8_t *wq, const uint8_t *formats,
                            const int64_t *offsets, float *out, int64_t M, int64_t K,
                            int64_t N, int64_t g0, int64_t g1) {
    float scratch[SF_QK * SF_QCOLS];
    const int64_t c0 = g0 * SF_QCOLS, c1 = g1 * SF_QCOLS < N ? g1 * SF_QCOLS : N;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = c0; n < c1; n++) out[m * N + n] = 0.0f;
    for (int64_t b = 0; b < K / SF_QK; b++)
        for (int64_t g = g0; g < g1; g++) {
            sf_dequant_block(formats[g], wq + offsets[g] + b * sf_format_bytes(formats[g]),
                             scratch, SF_QCOLS);
            const int64_t cols = N - g * SF_QCOLS < SF_QCOLS ? N - g * SF_QCOLS : SF_QCOLS;
            for (int64_t m = 0; m < M; m++) {
                float *restrict o = out + m * N + g * SF_QCOLS;
                for (int64_t k = 0; k < SF_QK; k++) {
                    const float xv = x[m * K + b * SF_QK + k];
                    for (int64_t c = 0; c < cols; c++) o[c] += xv * scratch[k * SF_QCOLS + c];
                }
            }
        }
}
#endif

/* 0 when K is a multiple of 32 and every group's format is known, else 3. */
static int sf_packed_check(const uint8_t *formats, int64_t K, int64_t groups) {
    if (K % SF_QK != 0) return 3;
    for (int64_t g = 0; g < groups; g++)
        if (formats[g] >= SF_NUM_FMTS) return 3;
    return 0;
}

/* What every packed entry point does first: -1 to go on (with *num_threads clamped to
 * 1..groups), else the status to return (3: see sf_packed_check; 0: nothing to compute). */
static int sf_packed_begin(const uint8_t *formats, float *out, int64_t M, int64_t K, int64_t N,
                           int *num_threads) {
    const int64_t groups = (N + SF_QCOLS - 1) / SF_QCOLS;
    if (sf_packed_check(formats, K, groups)) return 3;
    if (M <= 0 || N <= 0) return 0;
    if (K == 0) {
        memset(out, 0, (size_t)(M * N) * sizeof(float));
        return 0;
    }
    if (*num_threads < 1) *num_threads = 1;
    if (*num_threads > groups) *num_threads = (int)groups;
    return -1;
}

/* out[M,N] = x[M,K] @ W[K,N], W packed (see the top of this file). Returns 0; 3 when K
 * is not a multiple of 32 or a group's format is unknown; 4 when scratch memory cannot
 * be had. */
int sf_packed_mm(const float *x, const uint8_t *wq, const uint8_t *formats,
                 const int64_t *offsets, float *out, int64_t M, int64_t K, int64_t N,
                 int num_threads) {
    const int begun = sf_packed_begin(formats, out, M, K, N, &num_threads);
    if (begun >= 0) return begun;
    const int64_t groups = (N + SF_QCOLS - 1) / SF_QCOLS;
#if SF_ISA == 3
    float *xt = NULL;
    if (M > SF_PACKED_DIRECT_MB) {
        const int64_t tiles = (M + SF_PACKED_MB - 1) / SF_PACKED_MB;
        xt = aligned_alloc(64, (size_t)(tiles * K * SF_PACKED_MB) * sizeof(float));
        if (xt == NULL) return 4;
    }
    const float *xin = xt != NULL ? xt : x;
#else
    const float *xin = x;
#endif
#if SF_THREADING == 2
#pragma omp parallel num_threads(num_threads)
    {
        int64_t lo, hi;
#if SF_ISA == 3
        if (xt != NULL) { /* every thread transposes a share of K, then all read all of it */
            sf_share(K, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
            sf_transpose_rows(x, xt, M, K, lo, hi);
#pragma omp barrier
        }
#endif
        sf_share(groups, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        sf_packed_range(xin, wq, formats, offsets, out, M, K, N, lo, hi);
    }
#else
#if SF_ISA == 3
    if (xt != NULL) sf_transpose_rows(x, xt, M, K, 0, K);
#endif
    sf_packed_range(xin, wq, formats, offsets, out, M, K, N, 0, groups);
#endif
#if SF_ISA == 3
    free(xt);
#endif
    return 0;
}

#include "sf_packed_unpack.h" /* W as float32 or bfloat16, for many-row calls */
#include "sf_packed_bf16.h" /* bfloat16 products on AVX512_BF16 */
