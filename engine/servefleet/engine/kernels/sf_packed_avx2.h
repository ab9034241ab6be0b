/*
 * AVX2 packed matmul, included by sf_packed_mm.h: the AVX-512 scheme on ymm registers. A
 * group's weights are dequantized in registers at each k, 8 columns at a time, and used by
 * a tile of up to SF_PACKED2_MB rows of x; they are never stored. (The path this replaced
 * wrote each dequantized block into L1 and read it back through the dense tiles: 3.5x
 * slower at 1 row, 1.6x at 16, on SmolLM2's Q4_1 shapes.) Each output is one accumulator
 * summed over k in ascending order with the dense tile's FMA, so the bits are
 * sf_small_mm's on the dequantized weights, as for every packed path.
 */

/* Rows per tile: 8 accumulators + scale, min, the two weight vectors and the high bits
 * fit the 16 ymm registers. */
#define SF_PACKED2_MB 8

/* Weights of k = 2j and 2j + 1 for 8 columns (one half of a group) of the nibble formats;
 * `high` as in sf_decode_pair, for these 8 columns. */
SF_AI void sf_decode_pair8(const int fmt, const uint8_t *nib8, const int j, __m256 scale,
                           __m256 second, __m256i *high, __m256 *even, __m256 *odd) {
    const __m256i low4 = _mm256_set1_epi32(15);
    const __m256i bytes =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(nib8 + j * SF_QCOLS)));
    __m256i lo = _mm256_and_si256(bytes, low4), hi = _mm256_srli_epi32(bytes, 4);
    if (fmt == SF_FMT_Q5) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(*high, _mm256_set1_epi32(1)), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(*high, _mm256_set1_epi32(2)), 3));
        *high = _mm256_srli_epi32(*high, 2);
    } else if (fmt == SF_FMT_Q6) {
        lo = _mm256_or_si256(lo, _mm256_slli_epi32(_mm256_and_si256(*high, _mm256_set1_epi32(3)), 4));
        hi = _mm256_or_si256(hi, _mm256_slli_epi32(_mm256_and_si256(*high, _mm256_set1_epi32(12)), 2));
        *high = _mm256_srli_epi32(*high, 4);
    }
    if (fmt == SF_FMT_Q6) {
        const __m256i offset = _mm256_set1_epi32(32);
        const __m256 s = j < SF_QK / 4 ? scale : second;
        *even = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(lo, offset)));
        *odd = _mm256_mul_ps(s, _mm256_cvtepi32_ps(_mm256_sub_epi32(hi, offset)));
    } else {
        *even = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(lo), second);
        *odd = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(hi), second);
    }
}

/* One 8-column half h of a group over all of K for MB rows of x (row stride K). */
SF_AI void sf_packed_half8(const int fmt, const int MB, const float *restrict x, int64_t K,
                           const uint8_t *restrict wq, const int h, float *restrict out,
                           int64_t ldo, sf_vmask mask) {
    __m256 acc[SF_PACKED2_MB];
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++) acc[m] = _mm256_setzero_ps();
    const int64_t block_bytes = sf_format_bytes(fmt);
    for (int64_t b = 0; b < K / SF_QK; b++) {
        const uint8_t *block = wq + b * block_bytes;
        const float *xb = x + b * SF_QK;
        const __m256 scale = _mm256_loadu_ps((const float *)block + 8 * h);
        if (fmt == SF_FMT_Q8) {
            const int8_t *q = (const int8_t *)(block + SF_SCALES_BYTES) + 8 * h;
            for (int k = 0; k < SF_QK; k++) {
                const __m256 w = _mm256_mul_ps(
                    scale, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
                               _mm_loadl_epi64((const __m128i *)(q + k * SF_QCOLS)))));
#pragma GCC unroll 8
                for (int m = 0; m < MB; m++)
                    acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(xb[m * K + k]), w, acc[m]);
            }
            continue;
        }
        const __m256 second = _mm256_loadu_ps((const float *)(block + SF_SCALES_BYTES) + 8 * h);
        const uint8_t *nib = block + 2 * SF_SCALES_BYTES;
        const uint32_t *high_words = (const uint32_t *)(nib + SF_NIB_BYTES) + 8 * h;
        __m256i high = fmt == SF_FMT_Q4 ? _mm256_setzero_si256()
                                         : _mm256_loadu_si256((const __m256i *)high_words);
        for (int j = 0; j < SF_QK / 2; j++) {
            if (fmt == SF_FMT_Q6 && j == SF_QK / 4)
                high = _mm256_loadu_si256((const __m256i *)(high_words + SF_QCOLS));
            __m256 even, odd;
            sf_decode_pair8(fmt, nib + 8 * h, j, scale, second, &high, &even, &odd);
#pragma GCC unroll 8
            for (int m = 0; m < MB; m++)
                acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(xb[m * K + 2 * j]), even, acc[m]);
#pragma GCC unroll 8
            for (int m = 0; m < MB; m++)
                acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(xb[m * K + 2 * j + 1]), odd, acc[m]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++) _mm256_maskstore_ps(out + m * ldo, mask, acc[m]);
}

#define SF_P2_ARGS                                                                        \
    const float *restrict x, int64_t K, const uint8_t *restrict wq, float *restrict out, \
        int64_t ldo, const sf_vmask *masks
typedef void (*sf_packed2_fn)(SF_P2_ARGS);
/* sf_p2_<F>_<MB>: both halves of a group (the second only where it has columns). */
#define SF_PACKED2_FN(F_, MB_)                                                         \
    static void sf_p2_##F_##_##MB_(SF_P2_ARGS) {                                          \
        sf_packed_half8(F_, MB_, x, K, wq, 0, out, ldo, masks[0]);                        \
        if (_mm256_movemask_ps(_mm256_castsi256_ps(masks[1])))                            \
            sf_packed_half8(F_, MB_, x, K, wq, 1, out + 8, ldo, masks[1]);                \
    }
#define SF_PACKED2_FNS(F_)                                                             \
    SF_PACKED2_FN(F_, 1) SF_PACKED2_FN(F_, 2) SF_PACKED2_FN(F_, 3)               \
    SF_PACKED2_FN(F_, 4) SF_PACKED2_FN(F_, 5) SF_PACKED2_FN(F_, 6)               \
    SF_PACKED2_FN(F_, 7) SF_PACKED2_FN(F_, 8)
SF_PACKED2_FNS(0)
SF_PACKED2_FNS(1)
SF_PACKED2_FNS(2)
SF_PACKED2_FNS(3)
#define SF_PACKED2_ENTRY(F_)                                                           \
    {sf_p2_##F_##_1, sf_p2_##F_##_2, sf_p2_##F_##_3, sf_p2_##F_##_4,                          \
     sf_p2_##F_##_5, sf_p2_##F_##_6, sf_p2_##F_##_7, sf_p2_##F_##_8}
static const sf_packed2_fn sf_packed2_table[SF_NUM_FMTS][SF_PACKED2_MB] = {
    SF_PACKED2_ENTRY(0), SF_PACKED2_ENTRY(1), SF_PACKED2_ENTRY(2),
    SF_PACKED2_ENTRY(3)};

/* Groups [g0, g1) of out's columns for every row. A group's packed weights (a few KiB)
 * stay in L1/L2 while the row tiles after the first re-read them. */
static void sf_packed_range(const float *x, const uint8_t *wq, const uint8_t *formats,
                            const int64_t *offsets, float *out, int64_t M, int64_t K,
                            int64_t N, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        const sf_vmask masks[2] = {sf_mask_first(N - g * SF_QCOLS),
                                   sf_mask_first(N - g * SF_QCOLS - 8)};
        for (int64_t m0 = 0; m0 < M; m0 += SF_PACKED2_MB) {
            const int mb = (int)(M - m0 < SF_PACKED2_MB ? M - m0 : SF_PACKED2_MB);
            sf_packed2_table[formats[g]][mb - 1](x + m0 * K, K, wq + offsets[g],
                                                 out + m0 * N + g * SF_QCOLS, N, masks);
        }
    }
}
