/*
 * Many-row (prefill) matmuls, included at the end of cpu_small_gemm.c: any M, with the
 * few-row kernels' bits.
 *
 *   sf_big_mm         W [K, N] float32
 *   sf_big_packed_mm  W [K, N] packed (sf_packed_mm.h)
 *   sf_big_linear     W [N, K] float32 (the lm_head)
 *
 * A prompt chunk reuses every weight M times, so streaming it once per call (the few-row
 * kernels) is no longer the cost; the multiply-adds are. The [K, N] kernels are a blocked
 * GEMM: each thread takes strips of SF_BIG_NB columns and, per strip, unpacks one panel
 * of SF_BIG_KP k × SF_BIG_NB columns of W (packed blocks dequantized, float32 rows
 * copied) into its own float32 buffer, L2-sized, then runs ALL M rows through that panel
 * in the few-row kernel's register tiles (sf_mm_tile: rows of x broadcast × 2 vectors of
 * columns). The accumulators go to the output between k-panels and come back for the
 * next, so the whole weight is never written out in float32 and is unpacked once per
 * call whatever M is.
 *
 * Bits: each output element is one accumulator, zero, then one FMA per k in ascending
 * order (plain C: a multiply then an add), with x and the exactly dequantized weights:
 * the sequence sf_small_mm and sf_packed_mm run for that element. Panels, strips, row
 * tiles and threads only decide when an accumulator passes through memory (exact), so
 * a row's result is bitwise what the few-row kernels return for it alone: it depends on
 * that row only. sf_big_linear keeps sf_small_linear's fixed lanes over k and its
 * reduction tree (the same tiles, W walked in L2-sized strips of rows).
 */

/* Columns per panel: 4 packed groups, a whole number of 2-vector tiles for AVX-512 (32
 * columns) and AVX2 (16). */
#define SF_BIG_NB 64
/* k per panel: a multiple of the 32-k packed block. 256 × 64 floats = 64 KiB per thread
 * stays in L2 while every row tile reads it. */
#define SF_BIG_KP 256
/* W rows per strip of sf_big_linear (a multiple of the tiles' 3 and 2 rows). */
#define SF_BIG_LIN_NB 48

/* Where panels come from: dense rows (w) or packed groups (wq, formats, offsets). */
typedef struct {
    const float *w;
    const uint8_t *wq;
    const uint8_t *formats;
    const int64_t *offsets;
} sf_big_src;

/* panel[k][c] = W[k0 + k][c0 + c] for k < kn and the strip's columns (ld SF_BIG_NB). */
static void sf_big_fill(const sf_big_src *src, float *restrict panel, int64_t K, int64_t N,
                        int64_t k0, int64_t kn, int64_t c0) {
    const int64_t cols = N - c0 < SF_BIG_NB ? N - c0 : SF_BIG_NB;
    if (src->w != NULL) {
        for (int64_t k = 0; k < kn; k++)
            memcpy(panel + k * SF_BIG_NB, src->w + (k0 + k) * N + c0, (size_t)cols * sizeof(float));
        return;
    }
    (void)K;
    for (int64_t g = c0 / SF_QCOLS; g * SF_QCOLS < c0 + cols; g++) {
        const int fmt = src->formats[g];
        const int64_t bytes = sf_format_bytes(fmt);
        for (int64_t b = k0 / SF_QK; b < (k0 + kn) / SF_QK; b++)
            sf_dequant_block(fmt, src->wq + src->offsets[g] + b * bytes,
                             panel + (b * SF_QK - k0) * SF_BIG_NB + (g * SF_QCOLS - c0), SF_BIG_NB);
    }
}

/* Every row of x through one panel (k0 .. k0 + kn, columns c0 ..): out += x · panel. */
static void sf_big_rows(const float *x, const float *panel, float *out, int64_t M, int64_t K,
                        int64_t N, int64_t k0, int64_t kn, int64_t c0) {
    const int64_t cols = N - c0 < SF_BIG_NB ? N - c0 : SF_BIG_NB;
#if SF_ISA >= 2
    const int64_t nv = (cols + SF_VL - 1) / SF_VL;
    sf_vmask masks[SF_BIG_NB / SF_VL];
    for (int64_t v = 0; v < nv; v++) masks[v] = sf_mask_first(cols - v * SF_VL);
    for (int64_t m0 = 0; m0 < M; m0 += SF_MM_MB) {
        const int mb = (int)(M - m0 < SF_MM_MB ? M - m0 : SF_MM_MB);
        for (int64_t v = 0; v < nv; v += SF_NC) {
            const int nc = (int)(nv - v < SF_NC ? nv - v : SF_NC);
            sf_mm_table[mb - 1][nc - 1](x + m0 * K + k0, K, panel + v * SF_VL, SF_BIG_NB,
                                        out + m0 * N + c0 + v * SF_VL, N, kn, masks + v,
                                        k0 == 0, NULL);
        }
    }
#else
    for (int64_t m = 0; m < M; m++) {
        float *restrict o = out + m * N + c0;
        if (k0 == 0)
            for (int64_t c = 0; c < cols; c++) o[c] = 0.0f;
        for (int64_t k = 0; k < kn; k++) {
            const float xv = x[m * K + k0 + k];
            const float *restrict wr = panel + k * SF_BIG_NB;
            for (int64_t c = 0; c < cols; c++) o[c] += xv * wr[c];
        }
    }
#endif
}

/* Strip s (columns s·SF_BIG_NB ..) of out, panel by panel. */
static void sf_big_strip(const sf_big_src *src, const float *x, float *panel, float *out,
                         int64_t M, int64_t K, int64_t N, int64_t s) {
    const int64_t c0 = s * SF_BIG_NB;
    for (int64_t k0 = 0; k0 < K; k0 += SF_BIG_KP) {
        const int64_t kn = K - k0 < SF_BIG_KP ? K - k0 : SF_BIG_KP;
        sf_big_fill(src, panel, K, N, k0, kn, c0);
        sf_big_rows(x, panel, out, M, K, N, k0, kn, c0);
    }
}

/* The [K, N] driver: strips handed to threads as they free up (which thread computes a
 * strip changes no bit). Returns 0, or 4 when the panels' memory cannot be had. */
static int sf_big_run(const sf_big_src *src, const float *x, float *out, int64_t M, int64_t K,
                      int64_t N, int num_threads) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0) {
        memset(out, 0, (size_t)(M * N) * sizeof(float));
        return 0;
    }
    const int64_t strips = (N + SF_BIG_NB - 1) / SF_BIG_NB;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > strips) num_threads = (int)strips;
    const size_t panel_floats = (size_t)SF_BIG_KP * SF_BIG_NB;
    float *panels = aligned_alloc(64, (size_t)num_threads * panel_floats * sizeof(float));
    if (panels == NULL) return 4;
#if SF_THREADING == 2
#pragma omp parallel num_threads(num_threads)
    {
        float *panel = panels + (size_t)omp_get_thread_num() * panel_floats;
#pragma omp for schedule(dynamic, 1)
        for (int64_t s = 0; s < strips; s++) sf_big_strip(src, x, panel, out, M, K, N, s);
    }
#else
    for (int64_t s = 0; s < strips; s++) sf_big_strip(src, x, panels, out, M, K, N, s);
#endif
    free(panels);
    return 0;
}

/* out[M,N] = x[M,K] @ w[K,N], any M; bitwise sf_small_mm's rows. Returns 0 or 4. */
int sf_big_mm(const float *x, const float *w, float *out, int64_t M, int64_t K, int64_t N,
              int num_threads) {
    const sf_big_src src = {w, NULL, NULL, NULL};
    return sf_big_run(&src, x, out, M, K, N, num_threads);
}

/* out[M,N] = x[M,K] @ W[K,N], W packed, any M; bitwise sf_packed_mm's rows. Returns 0,
 * 3 (see sf_packed_check) or 4 (no memory). */
int sf_big_packed_mm(const float *x, const uint8_t *wq, const uint8_t *formats,
                     const int64_t *offsets, float *out, int64_t M, int64_t K, int64_t N,
                     int num_threads) {
    if (sf_packed_check(formats, K, (N + SF_QCOLS - 1) / SF_QCOLS)) return 3;
    const sf_big_src src = {NULL, wq, formats, offsets};
    return sf_big_run(&src, x, out, M, K, N, num_threads);
}

/* out[M,N] = x[M,K] @ w[N,K]^T, any M; bitwise sf_small_linear's rows. Each strip of
 * SF_BIG_LIN_NB rows of W stays in L2 while every row tile of x passes it. */
void sf_big_linear(const float *x, const float *w, float *out, int64_t M, int64_t K, int64_t N,
                   int num_threads) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        memset(out, 0, (size_t)(M * N) * sizeof(float));
        return;
    }
    const int64_t strips = (N + SF_BIG_LIN_NB - 1) / SF_BIG_LIN_NB;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > strips) num_threads = (int)strips;
#if SF_THREADING == 2
#pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1)
#endif
    for (int64_t s = 0; s < strips; s++) {
        const int64_t n1 = (s + 1) * SF_BIG_LIN_NB < N ? (s + 1) * SF_BIG_LIN_NB : N;
        sf_lin_range(x, w, out, M, K, N, s * SF_BIG_LIN_NB, n1);
    }
}
