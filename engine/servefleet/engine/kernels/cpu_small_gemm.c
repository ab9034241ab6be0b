/*
 * Few-row float32 matmuls for CPU decode steps: out[M,N] = x[M,K] @ W.
 *
 *   sf_small_mm     W stored [K, N] (in, out) — the decoder's projections
 *   sf_small_linear W stored [N, K] (out, in) — the lm_head (F.linear layout)
 *   sf_packed_mm    W [K, N] packed from GGUF blocks (Q4_0/1, Q5_0/1, Q8_0, Q4_K, Q5_K,
 *                   Q6_K; sf_packed_mm.h)
 *   sf_lora_add     a step's LoRA deltas, rows grouped by adapter (sf_lora.h)
 *
 * The packed form holds a quantized checkpoint's weights as they were stored (4 to 8
 * bits plus float32 scales); AVX-512 dequantizes them in registers as the FMAs use
 * them, AVX2 and plain C a block at a time into L1 for the float32 tiles. Dequantizing
 * is exact and every output is summed over k in ascending order, so a packed call
 * returns bitwise what sf_small_mm returns on the dequantized weights, while streaming
 * 3.5-5× fewer bytes.
 *
 * With M of 1..64 every weight element is used only M times, so a step is bound
 * by streaming the weights from DRAM. Both kernels read each weight once per
 * call (register tiles of x rows × W columns, W tile reused from L1 across row
 * tiles), prefetch the next W tile themselves (a column strip of [K, N] is a
 * strided walk the hardware prefetcher does not follow), and split N across
 * threads.
 *
 * Batch invariance: every output element is one accumulator summed over k in
 * ascending order (sf_small_mm), or fixed-lane partial sums over k followed by a
 * fixed reduction tree (sf_small_linear). Neither depends on M, on the row tile
 * an element falls in, or on the thread count, so a row's result is bitwise the
 * same whatever else is in the batch. The file is compiled without
 * -fassociative-math so the compiler cannot reorder those sums.
 *
 * Instruction set chosen at compile time: AVX-512F, else AVX2+FMA, else plain C.
 * Threading: SF_THREADING 2 = OpenMP (shares torch's libgomp), 0 = caller's thread.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef SF_THREADING
#define SF_THREADING 0
#endif
#if SF_THREADING == 2
#include <omp.h>
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

/* Rows of W per k-block of sf_small_mm (the W strip a register tile walks stays in L1):
 * SF_KB_FEW for up to SF_FEW_ROWS rows of x, else SF_KB. Measured on the SmolLM2 shapes
 * (30 layers from DRAM, 12x2 tiles): 32 beat 16 and 64 at 1-4 rows; 64 beat 24, 32, 48,
 * 96 and 128 at 8-32 rows. Blocking only decides when accumulators go through memory,
 * which is exact, so it may depend on M without changing any result. */
#define SF_KB 64
#define SF_KB_FEW 32
#define SF_FEW_ROWS 4

/* How many register tiles ahead sf_small_mm prefetches W. 1 measured best: 2 and 4 were
 * no faster, and no software prefetch at all was 30% slower at 16 rows. */
#define SF_PF_DIST 1

#define SF_AI static inline __attribute__((always_inline))

#if defined(__AVX512F__)
#define SF_ISA 3
#define SF_VL 16
/* sf_small_mm register tile: SF_MM_MB rows of x × SF_NC vectors of W (24 accumulators).
 * 12×2 measured 4-8% faster than 8×3 at 8-32 rows; 16×2 (spills) and 16×1 were no better. */
#define SF_MM_MB 12
#define SF_NC 2
/* sf_small_linear register tile: SF_LIN_MB rows of x × SF_NR rows of W. */
#define SF_LIN_MB 8
#define SF_NR 3
typedef __m512 sf_vf;
typedef __mmask16 sf_vmask;
SF_AI sf_vmask sf_mask_first(int64_t n) {
    return n >= 16 ? (sf_vmask)0xFFFF : (sf_vmask)((1u << (n > 0 ? n : 0)) - 1u);
}
#define SF_LOAD(m, p) _mm512_maskz_loadu_ps((m), (p))
#define SF_STORE(m, p, v) _mm512_mask_storeu_ps((p), (m), (v))
#define SF_SET1(s) _mm512_set1_ps(s)
#define SF_FMA(a, b, c) _mm512_fmadd_ps((a), (b), (c))
#define SF_ZERO() _mm512_setzero_ps()
SF_AI float sf_hsum(sf_vf v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define SF_ISA 2
#define SF_VL 8
#define SF_MM_MB 6
#define SF_NC 2
#define SF_LIN_MB 6
#define SF_NR 2
typedef __m256 sf_vf;
typedef __m256i sf_vmask;
SF_AI sf_vmask sf_mask_first(int64_t n) {
    int32_t c = n >= 8 ? 8 : (int32_t)(n > 0 ? n : 0);
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(c), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
#define SF_LOAD(m, p) _mm256_maskload_ps((p), (m))
#define SF_STORE(m, p, v) _mm256_maskstore_ps((p), (m), (v))
#define SF_SET1(s) _mm256_set1_ps(s)
#define SF_FMA(a, b, c) _mm256_fmadd_ps((a), (b), (c))
#define SF_ZERO() _mm256_setzero_ps()
SF_AI float sf_hsum(sf_vf v) {
    __m128 q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    q = _mm_add_ps(q, _mm_movehl_ps(q, q));
    q = _mm_add_ss(q, _mm_movehdup_ps(q));
    return _mm_cvtss_f32(q);
}
#else
#define SF_ISA 1
#endif

int sf_threading_mode(void) { return SF_THREADING; }
int sf_gemm_isa(void) { return SF_ISA; }

/* [lo, hi) of `n` items for thread `t` of `nt`: contiguous, near-equal shares. */
static void sf_share(int64_t n, int t, int nt, int64_t *lo, int64_t *hi) {
    *lo = n * t / nt;
    *hi = n * (t + 1) / nt;
}

#if SF_ISA >= 2

/* ---- W [K, N]: register tile = MB rows of x × NC vectors of W columns ---- */

SF_AI void sf_mm_tile(const int MB, const int NC, const float *restrict x, int64_t ldx,
                      const float *restrict w, int64_t ldw, float *restrict out, int64_t ldo,
                      int64_t kn, const sf_vmask *masks, int first, const float *pf) {
    sf_vf acc[SF_MM_MB][SF_NC];
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++)
            acc[m][c] = first ? SF_ZERO() : SF_LOAD(masks[c], out + m * ldo + c * SF_VL);
    for (int64_t k = 0; k < kn; k++) {
        const float *wr = w + k * ldw;
        if (pf) {
            const char *p = (const char *)(pf + k * ldw);
            _mm_prefetch(p, _MM_HINT_T0);
            _mm_prefetch(p + 64 * NC * SF_VL / 16 - 1, _MM_HINT_T0);
            if (NC * SF_VL >= 32) _mm_prefetch(p + 64, _MM_HINT_T0);
            if (NC * SF_VL >= 48) _mm_prefetch(p + 128, _MM_HINT_T0);
        }
        sf_vf wv[SF_NC];
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) wv[c] = SF_LOAD(masks[c], wr + c * SF_VL);
#pragma GCC unroll 16
        for (int m = 0; m < MB; m++) {
            const sf_vf xb = SF_SET1(x[m * ldx + k]);
#pragma GCC unroll 4
            for (int c = 0; c < NC; c++) acc[m][c] = SF_FMA(xb, wv[c], acc[m][c]);
        }
    }
#pragma GCC unroll 16
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
        for (int c = 0; c < NC; c++) SF_STORE(masks[c], out + m * ldo + c * SF_VL, acc[m][c]);
}

#define SF_MM_ARGS                                                                          \
    const float *restrict x, int64_t ldx, const float *restrict w, int64_t ldw,             \
        float *restrict out, int64_t ldo, int64_t kn, const sf_vmask *masks, int first, \
        const float *pf
#define SF_MM_PASS x, ldx, w, ldw, out, ldo, kn, masks, first, pf

#define SF_MM_FN(MB_, NC_) \
    static void sf_mm_##MB_##_##NC_(SF_MM_ARGS) { sf_mm_tile(MB_, NC_, SF_MM_PASS); }
#define SF_MM_ROW(MB_) SF_MM_FN(MB_, 1) SF_MM_FN(MB_, 2)
SF_MM_ROW(1) SF_MM_ROW(2) SF_MM_ROW(3) SF_MM_ROW(4) SF_MM_ROW(5) SF_MM_ROW(6)
#if SF_MM_MB > 6
SF_MM_ROW(7) SF_MM_ROW(8) SF_MM_ROW(9) SF_MM_ROW(10) SF_MM_ROW(11) SF_MM_ROW(12)
#endif

typedef void (*sf_mm_fn)(SF_MM_ARGS);
#define SF_MM_ENTRY(MB_) {sf_mm_##MB_##_1, sf_mm_##MB_##_2}
static const sf_mm_fn sf_mm_table[SF_MM_MB][SF_NC] = {
    SF_MM_ENTRY(1), SF_MM_ENTRY(2), SF_MM_ENTRY(3), SF_MM_ENTRY(4), SF_MM_ENTRY(5), SF_MM_ENTRY(6),
#if SF_MM_MB > 6
    SF_MM_ENTRY(7), SF_MM_ENTRY(8), SF_MM_ENTRY(9), SF_MM_ENTRY(10), SF_MM_ENTRY(11), SF_MM_ENTRY(12),
#endif
};

/* Columns [v0, v1) (in vectors) of out for every row. */
static void sf_mm_range(const float *x, const float *w, float *out, int64_t M, int64_t K,
                        int64_t N, int64_t v0, int64_t v1) {
    if (v0 >= v1) return;
    const int64_t kb = M <= SF_FEW_ROWS ? SF_KB_FEW : SF_KB;
    for (int64_t k0 = 0; k0 < K; k0 += kb) {
        const int64_t kn = K - k0 < kb ? K - k0 : kb;
        for (int64_t v = v0; v < v1; v += SF_NC) {
            const int nc = (int)(v1 - v < SF_NC ? v1 - v : SF_NC);
            sf_vmask masks[SF_NC];
            for (int c = 0; c < nc; c++) masks[c] = sf_mask_first(N - (v + c) * SF_VL);
            /* Prefetch the tile SF_PF_DIST tiles ahead in this thread's walk (same k
             * rows, next columns; past the last column, the next k-block). */
            const float *pf = NULL;
            const int64_t tiles = (v1 - v0 + SF_NC - 1) / SF_NC;
            const int64_t ahead = (v - v0) / SF_NC + SF_PF_DIST;
            const int64_t pk = k0 + (ahead / tiles) * kb;
            if (pk < K) pf = w + pk * N + (v0 + (ahead % tiles) * SF_NC) * SF_VL;
            for (int64_t m0 = 0; m0 < M; m0 += SF_MM_MB) {
                const int mb = (int)(M - m0 < SF_MM_MB ? M - m0 : SF_MM_MB);
                sf_mm_table[mb - 1][nc - 1](x + m0 * K + k0, K, w + k0 * N + v * SF_VL, N,
                                            out + m0 * N + v * SF_VL, N, kn, masks, k0 == 0,
                                            m0 == 0 ? pf : NULL);
            }
        }
    }
}

/* ---- W [N, K]: register tile = MB rows of x × NR rows of W, dot products over K ---- */

SF_AI void sf_lin_tile(const int MB, const int NR, const float *restrict x, int64_t K,
                       const float *restrict w, float *restrict out, int64_t ldo,
                       const float *pf) {
    sf_vf acc[SF_LIN_MB][3]; /* [3]: sized for every instantiation, unused ones cost nothing */
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) acc[m][r] = SF_ZERO();
    const sf_vmask full = sf_mask_first(SF_VL);
    for (int64_t k = 0; k < K; k += SF_VL) {
        const sf_vmask mk = K - k >= SF_VL ? full : sf_mask_first(K - k);
        if (pf) {
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) _mm_prefetch((const char *)(pf + r * K + k), _MM_HINT_T0);
        }
        sf_vf wv[3];
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) wv[r] = SF_LOAD(mk, w + r * K + k);
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) {
            const sf_vf xv = SF_LOAD(mk, x + m * K + k);
#pragma GCC unroll 4
            for (int r = 0; r < NR; r++) acc[m][r] = SF_FMA(xv, wv[r], acc[m][r]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 4
        for (int r = 0; r < NR; r++) out[m * ldo + r] = sf_hsum(acc[m][r]);
}

#define SF_LIN_ARGS                                                                      \
    const float *restrict x, int64_t K, const float *restrict w, float *restrict out, \
        int64_t ldo, const float *pf
#define SF_LIN_PASS x, K, w, out, ldo, pf
#define SF_LIN_FN(MB_, NR_) \
    static void sf_lin_##MB_##_##NR_(SF_LIN_ARGS) { sf_lin_tile(MB_, NR_, SF_LIN_PASS); }
#define SF_LIN_ROW(MB_) SF_LIN_FN(MB_, 1) SF_LIN_FN(MB_, 2) SF_LIN_FN(MB_, 3)
SF_LIN_ROW(1) SF_LIN_ROW(2) SF_LIN_ROW(3) SF_LIN_ROW(4) SF_LIN_ROW(5) SF_LIN_ROW(6)
#if SF_LIN_MB > 6
SF_LIN_ROW(7) SF_LIN_ROW(8)
#endif

typedef void (*sf_lin_fn)(SF_LIN_ARGS);
#define SF_LIN_ENTRY(MB_) {sf_lin_##MB_##_1, sf_lin_##MB_##_2, sf_lin_##MB_##_3}
static const sf_lin_fn sf_lin_table[SF_LIN_MB][3] = {
    SF_LIN_ENTRY(1), SF_LIN_ENTRY(2), SF_LIN_ENTRY(3),
    SF_LIN_ENTRY(4), SF_LIN_ENTRY(5), SF_LIN_ENTRY(6),
#if SF_LIN_MB > 6
    SF_LIN_ENTRY(7), SF_LIN_ENTRY(8),
#endif
};

/* Output columns [n0, n1) (= rows of W) for every row of x. Cutting K into chunks so that
 * x stays in L1 for 24-32 rows was measured: no faster, so x is walked whole. */
static void sf_lin_range(const float *x, const float *w, float *out, int64_t M, int64_t K,
                         int64_t N, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n += SF_NR) {
        const int nr = (int)(n1 - n < SF_NR ? n1 - n : SF_NR);
        const float *pf = n + nr < n1 ? w + (n + nr) * K : NULL;
        for (int64_t m0 = 0; m0 < M; m0 += SF_LIN_MB) {
            const int mb = (int)(M - m0 < SF_LIN_MB ? M - m0 : SF_LIN_MB);
            sf_lin_table[mb - 1][nr - 1](x + m0 * K, K, w + n * K, out + m0 * N + n, N,
                                         m0 == 0 ? pf : NULL);
        }
    }
}

#else /* plain C: same summation order per element, no vectors of our own */

static void sf_mm_range(const float *x, const float *w, float *out, int64_t M, int64_t K,
                        int64_t N, int64_t v0, int64_t v1) {
    enum { VL = 16, KB = 64 };
    const int64_t c0 = v0 * VL, c1 = v1 * VL < N ? v1 * VL : N;
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = c0; n < c1; n++) out[m * N + n] = 0.0f;
    for (int64_t k0 = 0; k0 < K; k0 += KB) {
        const int64_t k1 = k0 + KB < K ? k0 + KB : K;
        for (int64_t m = 0; m < M; m++) {
            float *restrict o = out + m * N;
            for (int64_t k = k0; k < k1; k++) {
                const float xv = x[m * K + k];
                const float *restrict wr = w + k * N;
                for (int64_t n = c0; n < c1; n++) o[n] += xv * wr[n];
            }
        }
    }
}

static void sf_lin_range(const float *x, const float *w, float *out, int64_t M, int64_t K,
                         int64_t N, int64_t n0, int64_t n1) {
    for (int64_t n = n0; n < n1; n++)
        for (int64_t m = 0; m < M; m++) {
            float s = 0.0f;
            for (int64_t k = 0; k < K; k++) s += x[m * K + k] * w[n * K + k];
            out[m * N + n] = s;
        }
}
#define SF_VL 16
#endif


/* Packed (quantized) weights: sf_packed_mm, sf_packed_unpack. */
#include "sf_packed_mm.h"

/* out[M,N] = x[M,K] @ w[K,N]; all row-major and dense. */
void sf_small_mm(const float *x, const float *w, float *out, int64_t M, int64_t K, int64_t N,
                 int num_threads) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        memset(out, 0, (size_t)(M * N) * sizeof(float));
        return;
    }
    const int64_t nv = (N + SF_VL - 1) / SF_VL;
    if (num_threads < 1) num_threads = 1;
    if (num_threads > nv) num_threads = (int)nv;
#if SF_THREADING == 2
#pragma omp parallel num_threads(num_threads)
    {
        int64_t lo, hi;
        sf_share(nv, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        sf_mm_range(x, w, out, M, K, N, lo, hi);
    }
#else
    (void)sf_share;
    sf_mm_range(x, w, out, M, K, N, 0, nv);
#endif
}

/* out[M,N] = x[M,K] @ w[N,K]^T; all row-major and dense. */
void sf_small_linear(const float *x, const float *w, float *out, int64_t M, int64_t K,
                     int64_t N, int num_threads) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        memset(out, 0, (size_t)(M * N) * sizeof(float));
        return;
    }
    if (num_threads < 1) num_threads = 1;
    if (num_threads > N) num_threads = (int)N;
#if SF_THREADING == 2
#pragma omp parallel num_threads(num_threads)
    {
        int64_t lo, hi;
        sf_share(N, omp_get_thread_num(), omp_get_num_threads(), &lo, &hi);
        sf_lin_range(x, w, out, M, K, N, lo, hi);
    }
#else
    sf_lin_range(x, w, out, M, K, N, 0, N);
#endif
}

/* LoRA deltas of a step, rows grouped by adapter: sf_lora_add. */
#include "sf_lora.h"

/* Many-row matmuls with the few-row kernels' bits: sf_big_mm, sf_big_packed_mm, sf_big_linear. */
#include "sf_big_gemm.h"
