/*
 * Unpacking a packed weight (included by sf_packed_mm.h): W [K, N] as float32, bitwise the
 * checkpoint's dequantized values, or those values rounded to bfloat16, for the many-row
 * calls that multiply it with MKL / oneDNN.
 */

/* float32 -> bfloat16 bits, rounded to nearest even as torch rounds (weights are finite). */
static inline uint16_t sf_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* Groups [g0, g1) of W [K, N] into out (row stride N): float32, or bfloat16 when bf16. */
static void sf_unpack_range(const uint8_t *wq, const uint8_t *formats, const int64_t *offsets,
                            void *out, int bf16, int64_t K, int64_t N, int64_t g0, int64_t g1) {
    float scratch[SF_QK * SF_QCOLS];
    for (int64_t g = g0; g < g1; g++) {
        const int64_t cols = N - g * SF_QCOLS < SF_QCOLS ? N - g * SF_QCOLS : SF_QCOLS;
        const int64_t block_bytes = sf_format_bytes(formats[g]);
        for (int64_t b = 0; b < K / SF_QK; b++) {
            const uint8_t *block = wq + offsets[g] + b * block_bytes;
            const int64_t at = b * SF_QK * N + g * SF_QCOLS;
            if (!bf16 && cols == SF_QCOLS) {
                sf_dequant_block(formats[g], block, (float *)out + at, N);
                continue;
            }
            sf_dequant_block(formats[g], block, scratch, SF_QCOLS);
            for (int k = 0; k < SF_QK; k++) {
                const float *row = scratch + k * SF_QCOLS;
                if (!bf16) {
                    memcpy((float *)out + at + k * N, row, (size_t)cols * sizeof(float));
                    continue;
                }
                uint16_t *dst = (uint16_t *)out + at + k * N;
                for (int64_t c = 0; c < cols; c++) dst[c] = sf_to_bf16(row[c]);
            }
        }
    }
}

/* out[K, N] = W, the weight a packed one holds: float32 (bitwise the checkpoint's
 * dequantized values), or those values rounded to bfloat16 when bf16 is set. What a
 * many-row call multiplies with MKL / oneDNN. Returns 0 or 3. */
int sf_packed_unpack(const uint8_t *wq, const uint8_t *formats, const int64_t *offsets,
                     void *out, int bf16, int64_t K, int64_t N, int num_threads) {
    const int64_t groups = (N + SF_QCOLS - 1) / SF_QCOLS;
    if (sf_packed_check(formats, K, groups)) return 3;
    if (N <= 0 || K <= 0) return 0;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > groups) num_threads = (int)groups;
#if SF_THREADING == 2
#pragma omp parallel num_threads(num_threads)
    {
        int64_t lo, hi;
        sf_share(groups, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        sf_unpack_range(wq, formats, offsets, out, bf16, K, N, lo, hi);
    }
#else
    sf_unpack_range(wq, formats, offsets, out, bf16, K, N, 0, groups);
#endif
    return 0;
}
