/*
 * Packed matmul in bfloat16 for CPUs with AVX512_BF16, included at the end of
 * sf_packed_mm.h: x and the dequantized weights rounded to bfloat16 (nearest even), the
 * products summed in float32 by VDPBF16PS, two k at a time — twice the multiply-adds per
 * instruction of the float32 tiles, which decode steps of many rows are bound by. Not the
 * float32 bits (the rounding is the point), but each row's result depends on that row only
 * (same instruction sequence whatever M, tile or thread), so a step stays batch-invariant.
 * x becomes k-pairs in the transposed tile layout: xp[tile][K/2][16] (one dword a pair).
 */

#if SF_ISA == 3 && defined(__AVX512BF16__)
#define SF_PACKED_BF16 1

SF_AI __m512 sf_dot_pairs(__m512 acc, uint32_t x_pair, __m512i w_pairs) {
    return _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32((int)x_pair), (__m512bh)w_pairs);
}

/* even, odd (16 columns of k = 2j, 2j + 1) -> one dword per column: (even, odd) in bf16. */
SF_AI __m512i sf_pair_weights(__m512 even, __m512 odd) {
    const __m512i interleave = _mm512_set_epi16(
        31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8,
        23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(odd, even));
}

SF_AI void sf_packed_tile_bf16(const int fmt, const int MB, const uint32_t *restrict xp,
                               const uint8_t *restrict wq, int64_t K, float *restrict out,
                               int64_t ldo, __mmask16 mask) {
    __m512 acc[SF_PACKED_MB];
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++) acc[m] = _mm512_setzero_ps();
    const int64_t block_bytes = sf_format_bytes(fmt);
    for (int64_t b = 0; b < K / SF_QK; b++) {
        const uint8_t *block = wq + b * block_bytes;
        const uint32_t *xb = xp + b * (SF_QK / 2) * SF_PACKED_MB;
        const __m512 scale = _mm512_loadu_ps((const float *)block);
        const __m512 second = _mm512_loadu_ps((const float *)(block + SF_SCALES_BYTES));
        const uint8_t *nib = block + 2 * SF_SCALES_BYTES;
        const int8_t *q8 = (const int8_t *)(block + SF_SCALES_BYTES);
        const __m512i *high_words = (const __m512i *)(nib + SF_NIB_BYTES);
        __m512i high = fmt == SF_FMT_Q4 || fmt == SF_FMT_Q8 ? _mm512_setzero_si512()
                                                             : _mm512_loadu_si512(high_words);
        for (int j = 0; j < SF_QK / 2; j++) {
            __m512 even, odd;
            if (fmt == SF_FMT_Q8) {
                const __m128i *row = (const __m128i *)(q8 + 2 * j * SF_QCOLS);
                even = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row))));
                odd = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1))));
            } else {
                if (fmt == SF_FMT_Q6 && j == SF_QK / 4) high = _mm512_loadu_si512(high_words + 1);
                sf_decode_pair(fmt, nib, j, scale, second, &high, &even, &odd);
            }
            const __m512i w = sf_pair_weights(even, odd);
#pragma GCC unroll 16
            for (int m = 0; m < MB; m++) acc[m] = sf_dot_pairs(acc[m], xb[j * SF_PACKED_MB + m], w);
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++) _mm512_mask_storeu_ps(out + m * ldo, mask, acc[m]);
}

typedef void (*sf_packed_bf16_fn)(const uint32_t *restrict xp, const uint8_t *restrict wq,
                                  int64_t K, float *restrict out, int64_t ldo, __mmask16 mask);
#define SF_BF16_FN(F_, MB_)                                                               \
    static void sf_pb##F_##_##MB_(const uint32_t *restrict xp, const uint8_t *restrict wq, \
                                  int64_t K, float *restrict out, int64_t ldo,            \
                                  __mmask16 mask) {                                       \
        sf_packed_tile_bf16(F_, MB_, xp, wq, K, out, ldo, mask);                          \
    }
#define SF_BF16_FNS(F_)                                                                   \
    SF_BF16_FN(F_, 1) SF_BF16_FN(F_, 2) SF_BF16_FN(F_, 3) SF_BF16_FN(F_, 4)               \
    SF_BF16_FN(F_, 5) SF_BF16_FN(F_, 6) SF_BF16_FN(F_, 7) SF_BF16_FN(F_, 8)               \
    SF_BF16_FN(F_, 9) SF_BF16_FN(F_, 10) SF_BF16_FN(F_, 11) SF_BF16_FN(F_, 12)            \
    SF_BF16_FN(F_, 13) SF_BF16_FN(F_, 14) SF_BF16_FN(F_, 15) SF_BF16_FN(F_, 16)
SF_BF16_FNS(0)
SF_BF16_FNS(1)
SF_BF16_FNS(2)
SF_BF16_FNS(3)
#define SF_BF16_ENTRY(F_)                                                                  \
    {sf_pb##F_##_1,  sf_pb##F_##_2,  sf_pb##F_##_3,  sf_pb##F_##_4,  sf_pb##F_##_5,        \
     sf_pb##F_##_6,  sf_pb##F_##_7,  sf_pb##F_##_8,  sf_pb##F_##_9,  sf_pb##F_##_10,       \
     sf_pb##F_##_11, sf_pb##F_##_12, sf_pb##F_##_13, sf_pb##F_##_14, sf_pb##F_##_15,       \
     sf_pb##F_##_16}
static const sf_packed_bf16_fn sf_packed_bf16_table[SF_NUM_FMTS][SF_PACKED_MB] = {
    SF_BF16_ENTRY(0), SF_BF16_ENTRY(1), SF_BF16_ENTRY(2), SF_BF16_ENTRY(3)};

/* xp[tile][j][m] = (bf16(x[tile·16 + m][2j]), bf16(x[..][2j + 1])) for pairs [j0, j1). */
static void sf_pair_rows(const float *restrict x, uint32_t *restrict xp, int64_t M, int64_t K,
                         int64_t j0, int64_t j1) {
    for (int64_t m0 = 0; m0 < M; m0 += SF_PACKED_MB) {
        const int64_t mb = M - m0 < SF_PACKED_MB ? M - m0 : SF_PACKED_MB;
        uint32_t *restrict tile = xp + m0 * (K / 2);
        for (int64_t m = 0; m < mb; m++) {
            const float *restrict row = x + (m0 + m) * K;
            for (int64_t j = j0; j < j1; j++)
                tile[j * SF_PACKED_MB + m] =
                    (uint32_t)sf_to_bf16(row[2 * j]) | (uint32_t)sf_to_bf16(row[2 * j + 1]) << 16;
        }
    }
}

static void sf_packed_range_bf16(const uint32_t *xp, const uint8_t *wq, const uint8_t *formats,
                                 const int64_t *offsets, float *out, int64_t M, int64_t K,
                                 int64_t N, int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; g++) {
        const __mmask16 mask = sf_mask_first(N - g * SF_QCOLS);
        for (int64_t m0 = 0; m0 < M; m0 += SF_PACKED_MB) {
            const int mb = (int)(M - m0 < SF_PACKED_MB ? M - m0 : SF_PACKED_MB);
            sf_packed_bf16_table[formats[g]][mb - 1](xp + m0 * (K / 2), wq + offsets[g], K,
                                                     out + m0 * N + g * SF_QCOLS, N, mask);
        }
    }
}
#endif

/* 1 when sf_packed_mm_bf16 runs on this build (AVX-512 with AVX512_BF16), else 0. */
int sf_packed_bf16_available(void) {
#ifdef SF_PACKED_BF16
    return 1;
#else
    return 0;
#endif
}

/* out[M,N] ≈ x[M,K] @ W[K,N] in bfloat16 products (see the top of this file); the
 * arguments and return codes of sf_packed_mm, plus 5 when this build cannot run it. */
int sf_packed_mm_bf16(const float *x, const uint8_t *wq, const uint8_t *formats,
                      const int64_t *offsets, float *out, int64_t M, int64_t K, int64_t N,
                      int num_threads) {
#ifndef SF_PACKED_BF16
    (void)x, (void)wq, (void)formats, (void)offsets, (void)out, (void)M, (void)K, (void)N;
    (void)num_threads;
    return 5;
#else
    const int begun = sf_packed_begin(formats, out, M, K, N, &num_threads);
    if (begun >= 0) return begun;
    const int64_t groups = (N + SF_QCOLS - 1) / SF_QCOLS;
    const int64_t tiles = (M + SF_PACKED_MB - 1) / SF_PACKED_MB;
    uint32_t *xp = aligned_alloc(64, (size_t)(tiles * (K / 2) * SF_PACKED_MB) * sizeof(uint32_t));
    if (xp == NULL) return 4;
#if SF_THREADING == 2
#pragma omp parallel num_threads(num_threads)
    {
        int64_t lo, hi;
        sf_share(K / 2, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        sf_pair_rows(x, xp, M, K, lo, hi);
#pragma omp barrier
        sf_share(groups, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        sf_packed_range_bf16(xp, wq, formats, offsets, out, M, K, N, lo, hi);
    }
#else
    sf_pair_rows(x, xp, M, K, 0, K / 2);
    sf_packed_range_bf16(xp, wq, formats, offsets, out, M, K, N, 0, groups);
#endif
    free(xp);
    return 0;
#endif
}
