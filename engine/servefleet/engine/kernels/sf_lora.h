/*
 * LoRA deltas for a whole step in one call per projection (Punica's BGMV, grouped):
 * included at the end of cpu_small_gemm.c, so it shares its ISA choice (AVX-512F, AVX2+FMA
 * or plain C, capped by SERVEFLEET_MATMUL_ISA) and its OpenMP threads.
 *
 *   sf_lora_add  out[row] += (x[row] @ A[s]) @ B[s] for every row whose slot s >= 0
 *
 * Each row carries the slot of its adapter in the step (-1: the base model alone). A slot's
 * entry in the table (lora_layout.py, SF_LORA_FIELDS int64 each) says where its A [k, R]
 * (every adapted part's ranks side by side) and each part's B [r, width] (scaling folded
 * in) live, as float32 or bfloat16, and which output columns a part writes; a slot that
 * leaves this projection alone has R = 0. Rows are grouped by slot here, so an adapter's
 * weights are read once for all its rows whatever order the rows come in.
 *
 * Two passes of one register tile (rows × 1-2 vectors of columns, FMAs over k ascending):
 * shrink v[row] = x[row] @ A (one task per slot), then expand out[row, part] += v[row,
 * part ranks] @ B (tasks of SF_LORA_CHUNK columns). bfloat16 weights are widened in
 * registers (a shift); x, v and the sums stay float32. Every element is one accumulator
 * summed in a fixed order, so a row's result depends on that row and its adapter only:
 * neither the other rows, their order, nor the thread count changes a bit.
 */

#define SF_LORA_FIELDS 19 /* per (slot, layer, projection): a, k, R, parts, 3 × (j0, r, c0, w, b) */
#define SF_LORA_PARTS 3
#define SF_LORA_F32 0
#define SF_LORA_BF16 1
#define SF_LORA_CHUNK 128 /* columns per expand task */
#define SF_LORA_SHRINK_ROWS 32 /* rows per shrink task */
#define SF_LORA_SERIAL_FMAS 65536 /* less work than this: no thread team */

int sf_lora_fields(void) { return SF_LORA_FIELDS; }

#if SF_ISA >= 2

#if SF_ISA == 3
#define SF_LORA_MB 8
#define SF_ADD(a, b) _mm512_add_ps((a), (b))
#define SF_LORA_LOADU(p) _mm512_loadu_ps(p)
#define SF_LORA_STOREU(p, v) _mm512_storeu_ps((p), (v))
/* n bfloat16 values (n < 16: the rest zero) widened to float32. */
SF_AI sf_vf sf_lora_bf16(const uint16_t *p, int64_t n) {
    __m256i h;
    if (n >= 16) {
        h = _mm256_loadu_si256((const __m256i *)p);
    } else {
#if defined(__AVX512BW__) && defined(__AVX512VL__)
        h = _mm256_maskz_loadu_epi16((__mmask16)((1u << (n > 0 ? n : 0)) - 1u), p);
#else
        uint16_t t[16] = {0};
        for (int64_t i = 0; i < n; i++) t[i] = p[i];
        h = _mm256_loadu_si256((const __m256i *)t);
#endif
    }
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#else
#define SF_LORA_MB 6
#define SF_ADD(a, b) _mm256_add_ps((a), (b))
#define SF_LORA_LOADU(p) _mm256_loadu_ps(p)
#define SF_LORA_STOREU(p, v) _mm256_storeu_ps((p), (v))
SF_AI sf_vf sf_lora_bf16(const uint16_t *p, int64_t n) {
    __m128i h;
    if (n >= 8) {
        h = _mm_loadu_si128((const __m128i *)p);
    } else {
        uint16_t t[8] = {0};
        for (int64_t i = 0; i < n; i++) t[i] = p[i];
        h = _mm_loadu_si128((const __m128i *)t);
    }
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
#endif

/* MB rows × NC vectors: o[m][c] (+)= sum over k < kn of xr[m][k] · w[k·ldw + c]; columns
 * past ncols are neither read nor written. FULL: all NC vectors are inside ncols, so plain
 * loads and stores do (AVX2's masked ones cost extra micro-ops on every B row). */
SF_AI void sf_lora_tile(const int MB, const int NC, const int BF16, const int FULL,
                        const float *const *xr, int64_t kn, const void *w, int64_t ldw,
                        int64_t ncols, float *const *orow, int add, int64_t pf) {
    const int64_t esize = BF16 ? 2 : 4;
    sf_vf acc[SF_LORA_MB][2];
    const sf_vmask masks[2] = {sf_mask_first(ncols), sf_mask_first(ncols - SF_VL)};
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 2
        for (int c = 0; c < NC; c++) acc[m][c] = SF_ZERO();
    for (int64_t k = 0; k < kn; k++) {
        if (pf) { /* W rows of a later tile: a strided walk the prefetcher does not follow */
            const char *p = (const char *)w + k * ldw * esize + pf;
            _mm_prefetch(p, _MM_HINT_T0);
            if (NC * SF_VL * esize > 64) _mm_prefetch(p + 64, _MM_HINT_T0);
        }
        sf_vf wv[2];
#pragma GCC unroll 2
        for (int c = 0; c < NC; c++)
            wv[c] = BF16   ? sf_lora_bf16((const uint16_t *)w + k * ldw + c * SF_VL,
                                          FULL ? SF_VL : ncols - c * SF_VL)
                    : FULL ? SF_LORA_LOADU((const float *)w + k * ldw + c * SF_VL)
                           : SF_LOAD(masks[c], (const float *)w + k * ldw + c * SF_VL);
#pragma GCC unroll 8
        for (int m = 0; m < MB; m++) {
            const sf_vf xb = SF_SET1(xr[m][k]);
#pragma GCC unroll 2
            for (int c = 0; c < NC; c++) acc[m][c] = SF_FMA(xb, wv[c], acc[m][c]);
        }
    }
#pragma GCC unroll 8
    for (int m = 0; m < MB; m++)
#pragma GCC unroll 2
        for (int c = 0; c < NC; c++) {
            sf_vf r = acc[m][c];
            float *o = orow[m] + c * SF_VL;
            if (FULL) {
                if (add) r = SF_ADD(SF_LORA_LOADU(o), r);
                SF_LORA_STOREU(o, r);
            } else {
                if (add) r = SF_ADD(SF_LOAD(masks[c], o), r);
                SF_STORE(masks[c], o, r);
            }
        }
}

#define SF_LORA_ARGS                                                                     \
    const float *const *xr, int64_t kn, const void *w, int64_t ldw, int64_t ncols, \
        float *const *orow, int add, int64_t pf
#define SF_LORA_FN(B_, M_, N_)                                                      \
    static void sf_lora_##B_##_##M_##_##N_(SF_LORA_ARGS) {                          \
        if (ncols >= N_ * SF_VL)                                                    \
            sf_lora_tile(M_, N_, B_, 1, xr, kn, w, ldw, ncols, orow, add, pf);      \
        else                                                                        \
            sf_lora_tile(M_, N_, B_, 0, xr, kn, w, ldw, ncols, orow, add, pf);      \
    }
#define SF_LORA_ROW(M_) SF_LORA_FN(0, M_, 1) SF_LORA_FN(0, M_, 2) SF_LORA_FN(1, M_, 1) \
    SF_LORA_FN(1, M_, 2)
SF_LORA_ROW(1) SF_LORA_ROW(2) SF_LORA_ROW(3) SF_LORA_ROW(4) SF_LORA_ROW(5) SF_LORA_ROW(6)
#if SF_LORA_MB > 6
SF_LORA_ROW(7) SF_LORA_ROW(8)
#endif
typedef void (*sf_lora_fn)(SF_LORA_ARGS);
#define SF_LORA_ENTRY(B_, M_) {sf_lora_##B_##_##M_##_1, sf_lora_##B_##_##M_##_2}
#define SF_LORA_DTYPE(B_)                                                              \
    {SF_LORA_ENTRY(B_, 1), SF_LORA_ENTRY(B_, 2), SF_LORA_ENTRY(B_, 3), SF_LORA_ENTRY(B_, 4), \
     SF_LORA_ENTRY(B_, 5), SF_LORA_ENTRY(B_, 6) SF_LORA_MORE(B_)}
#if SF_LORA_MB > 6
#define SF_LORA_MORE(B_) , SF_LORA_ENTRY(B_, 7), SF_LORA_ENTRY(B_, 8)
#else
#define SF_LORA_MORE(B_)
#endif
static const sf_lora_fn sf_lora_table[2][SF_LORA_MB][2] = {SF_LORA_DTYPE(0), SF_LORA_DTYPE(1)};

/* o[rows] (+)= x[rows] @ w[:, 0:ncols] for `rows` rows given by pointer, in row tiles and
 * column tiles of at most two vectors. A row tile sweeps all its columns before the next
 * one starts: the out rows of a prompt are far apart (a whole projection's width), and a
 * tile walk down the rows would miss the cache on every row (half as wide a tile, twice
 * the misses, under AVX2); along a row the accesses are sequential and prefetched. */
static void sf_lora_block(int bf16, const float *const *xr, int64_t rows, int64_t kn,
                          const void *w, int64_t ldw, int64_t ncols, float *const *orow,
                          int add) {
    const size_t esize = bf16 ? 2 : 4;
    for (int64_t m0 = 0; m0 < rows; m0 += SF_LORA_MB) {
        const int mb = (int)(rows - m0 < SF_LORA_MB ? rows - m0 : SF_LORA_MB);
        for (int64_t c = 0; c < ncols; c += 2 * SF_VL) {
            const int64_t left = ncols - c;
            const int nc = left > SF_VL ? 2 : 1;
            float *o[SF_LORA_MB];
            for (int m = 0; m < mb; m++) o[m] = orow[m0 + m] + c;
            /* expand: B [r, width] is walked a column tile at a time, r lines apart */
            const int64_t pf = add && m0 == 0 ? 2 * 2 * SF_VL * (int64_t)esize : 0;
            sf_lora_table[bf16][mb - 1][nc - 1](xr + m0, kn, (const char *)w + c * esize, ldw,
                                                 left, o, add, pf);
        }
    }
}

#else /* plain C: the same order of sums per element */

static void sf_lora_block(int bf16, const float *const *xr, int64_t rows, int64_t kn,
                          const void *w, int64_t ldw, int64_t ncols, float *const *orow,
                          int add) {
    for (int64_t m = 0; m < rows; m++)
        for (int64_t c = 0; c < ncols; c++) {
            float acc = 0.0f;
            for (int64_t k = 0; k < kn; k++) {
                float wk;
                if (bf16) {
                    const uint32_t bits = (uint32_t)((const uint16_t *)w)[k * ldw + c] << 16;
                    memcpy(&wk, &bits, sizeof wk);
                } else {
                    wk = ((const float *)w)[k * ldw + c];
                }
                acc += xr[m][k] * wk;
            }
            orow[m][c] = add ? orow[m][c] + acc : acc;
        }
}
#endif

/* A slot's entry for this projection, checked against x's width k and out's width n.
 * Returns its R (0: not adapted), or -1 when it is malformed. */
static int64_t sf_lora_check(const int64_t *e, int64_t k, int64_t n) {
    const int64_t rank_total = e[2], parts = e[3];
    if (rank_total == 0) return 0;
    if (rank_total < 0 || e[0] == 0 || e[1] != k || parts < 1 || parts > SF_LORA_PARTS)
        return -1;
    for (int64_t p = 0; p < parts; p++) {
        const int64_t *q = e + 4 + 5 * p; /* j0, r, c0, width, b */
        if (q[0] < 0 || q[1] < 1 || q[0] + q[1] > rank_total || q[2] < 0 || q[3] < 1 ||
            q[2] + q[3] > n || q[4] == 0)
            return -1;
    }
    return rank_total;
}

#define SF_LORA_PTR(addr) ((const void *)(uintptr_t)(addr))

/* v[i] = x[rows[i]] @ A for `count` rows of one slot (v rows of stride ldv). */
static void sf_lora_shrink(int bf16, const float *x, int64_t k, const int64_t *e,
                           const int64_t *rows, int64_t count, float *v, int64_t ldv) {
    const float *xr[SF_LORA_SHRINK_ROWS];
    float *orow[SF_LORA_SHRINK_ROWS];
    for (int64_t i = 0; i < count; i++) {
        xr[i] = x + rows[i] * k;
        orow[i] = v + i * ldv;
    }
    sf_lora_block(bf16, xr, count, k, SF_LORA_PTR(e[0]), e[2], e[2], orow, 0);
}

/* out[rows[i], c0 + col ..] += v[i, j0 : j0 + r] @ B[:, col ..] for one task's columns. */
static void sf_lora_expand(int bf16, float *out, int64_t n, const int64_t *e, int64_t part,
                           int64_t col, const int64_t *rows, int64_t count, const float *v,
                           int64_t ldv) {
    enum { MAXR = 64 };
    const int64_t *q = e + 4 + 5 * part; /* j0, r, c0, width, b */
    const int64_t width = q[3] - col < SF_LORA_CHUNK ? q[3] - col : SF_LORA_CHUNK;
    const size_t esize = bf16 ? 2 : 4;
    const char *b = (const char *)SF_LORA_PTR(q[4]) + col * esize;
    for (int64_t i0 = 0; i0 < count; i0 += MAXR) {
        const int64_t nr = count - i0 < MAXR ? count - i0 : MAXR;
        const float *xr[MAXR];
        float *orow[MAXR];
        for (int64_t i = 0; i < nr; i++) {
            xr[i] = v + (i0 + i) * ldv + q[0];
            orow[i] = out + rows[i0 + i] * n + q[2] + col;
        }
        sf_lora_block(bf16, xr, nr, q[1], b, q[3], width, orow, 1);
    }
}

/* One call's work: rows sorted by slot (`order`; slot s's are order[first[s] ..
 * first[s + 1]), and so are their v rows), and the tasks of each pass. A shrink task is
 * (slot, i0, count) of at most SF_LORA_SHRINK_ROWS rows; an expand task (slot, part, col)
 * covers all the slot's rows. */
typedef struct {
    int64_t slot, part, col, i0, count;
} sf_lora_task;

typedef struct {
    int64_t *first, *ranks, *order, n_shrink, n_expand, ldv, fmas;
    sf_lora_task *shrink, *expand;
    float *v;
    void *block; /* the one allocation everything above lives in */
} sf_lora_plan;

/* Count rows per slot and check the entries of the slots in use (0, or 1/2 as returned). */
static int sf_lora_count(sf_lora_plan *p, const int32_t *row_slots, int64_t rows,
                         const int64_t *table, int64_t num_slots, int64_t slot_stride,
                         int64_t k, int64_t n) {
    for (int64_t r = 0; r < rows; r++) {
        if (row_slots[r] < -1 || row_slots[r] >= num_slots) return 1;
        if (row_slots[r] >= 0) p->first[row_slots[r] + 1]++;
    }
    for (int64_t s = 0; s < num_slots; s++) {
        const int64_t *e = table + s * slot_stride, count = p->first[s + 1];
        p->ranks[s] = count ? sf_lora_check(e, k, n) : 0;
        if (p->ranks[s] < 0) return 2;
        if (p->ranks[s] > 0) {
            p->ldv = p->ranks[s] > p->ldv ? p->ranks[s] : p->ldv;
            p->n_shrink += (count + SF_LORA_SHRINK_ROWS - 1) / SF_LORA_SHRINK_ROWS;
            p->fmas += count * p->ranks[s] * k;
            for (int64_t i = 0; i < e[3]; i++) {
                const int64_t *q = e + 4 + 5 * i;
                p->n_expand += (q[3] + SF_LORA_CHUNK - 1) / SF_LORA_CHUNK;
                p->fmas += count * q[1] * q[3];
            }
        }
        p->first[s + 1] += p->first[s];
    }
    return 0;
}

static void sf_lora_tasks(sf_lora_plan *p, const int32_t *row_slots, int64_t rows,
                          const int64_t *table, int64_t num_slots, int64_t slot_stride) {
    int64_t *fill = p->ranks + num_slots; /* num_slots scratch slots after ranks */
    memcpy(fill, p->first, (size_t)num_slots * sizeof(int64_t));
    for (int64_t r = 0; r < rows; r++)
        if (row_slots[r] >= 0) p->order[fill[row_slots[r]]++] = r;
    int64_t a = 0, b = 0;
    for (int64_t s = 0; s < num_slots; s++) {
        if (p->ranks[s] <= 0) continue;
        const int64_t *e = table + s * slot_stride, i0 = p->first[s], i1 = p->first[s + 1];
        for (int64_t i = i0; i < i1; i += SF_LORA_SHRINK_ROWS) {
            const int64_t count = i1 - i < SF_LORA_SHRINK_ROWS ? i1 - i : SF_LORA_SHRINK_ROWS;
            p->shrink[a++] = (sf_lora_task){s, 0, 0, i, count};
        }
        for (int64_t part = 0; part < e[3]; part++)
            for (int64_t c = 0; c < e[4 + 5 * part + 3]; c += SF_LORA_CHUNK)
                p->expand[b++] = (sf_lora_task){s, part, c, i0, i1 - i0};
    }
}

/* 0, or 1: a slot out of range; 2: a malformed entry; 4: no memory. */
static int sf_lora_plan_make(sf_lora_plan *p, const int32_t *row_slots, int64_t rows,
                             const int64_t *table, int64_t num_slots, int64_t slot_stride,
                             int64_t k, int64_t n) {
    memset(p, 0, sizeof *p);
    int64_t *counts = calloc((size_t)(3 * num_slots + 1), sizeof(int64_t));
    if (counts == NULL) return 4;
    p->first = counts, p->ranks = counts + num_slots + 1;
    const int status = sf_lora_count(p, row_slots, rows, table, num_slots, slot_stride, k, n);
    const size_t words = (size_t)(rows + 5 * (p->n_shrink + p->n_expand));
    const size_t floats = (size_t)(p->first[num_slots] * p->ldv);
    p->block = status ? NULL : malloc(words * sizeof(int64_t) + floats * sizeof(float) + 64);
    if (p->block == NULL) {
        free(counts);
        return status ? status : 4;
    }
    p->order = p->block;
    p->shrink = (sf_lora_task *)(p->order + rows);
    p->expand = p->shrink + p->n_shrink;
    p->v = (float *)(p->expand + p->n_expand);
    sf_lora_tasks(p, row_slots, rows, table, num_slots, slot_stride);
    return 0;
}

/* x [rows, k], out [rows, n] (float32, row-major); row_slots [rows]: -1 or a slot below
 * num_slots; table: slot s's entry for this layer and projection at table + s·slot_stride;
 * wdtype: SF_LORA_F32 or SF_LORA_BF16. Returns 0; 1: a slot out of range; 2: a malformed
 * entry; 3: an unknown weight dtype; 4: no memory. Nothing is written unless it returns 0. */
int sf_lora_add(const float *x, float *out, int64_t rows, int64_t k, int64_t n,
                const int32_t *row_slots, const int64_t *table, int64_t num_slots,
                int64_t slot_stride, int wdtype, int num_threads) {
    if (wdtype != SF_LORA_F32 && wdtype != SF_LORA_BF16) return 3;
    const int bf16 = wdtype == SF_LORA_BF16;
    sf_lora_plan p;
    const int status = sf_lora_plan_make(&p, row_slots, rows, table, num_slots, slot_stride, k, n);
    if (status) return status;
    if (p.fmas < SF_LORA_SERIAL_FMAS || num_threads < 1) num_threads = 1;
#if SF_THREADING == 2
#pragma omp parallel num_threads(num_threads)
#endif
    {
#if SF_THREADING == 2
#pragma omp for schedule(static)
#endif
        for (int64_t i = 0; i < p.n_shrink; i++) {
            const sf_lora_task *t = p.shrink + i;
            sf_lora_shrink(bf16, x, k, table + t->slot * slot_stride, p.order + t->i0, t->count,
                           p.v + t->i0 * p.ldv, p.ldv);
        }
#if SF_THREADING == 2
#pragma omp for schedule(static)
#endif
        for (int64_t i = 0; i < p.n_expand; i++) {
            const sf_lora_task *t = p.expand + i;
            sf_lora_expand(bf16, out, n, table + t->slot * slot_stride, t->part, t->col,
                           p.order + t->i0, t->count, p.v + t->i0 * p.ldv, p.ldv);
        }
    }
    free(p.block);
    free(p.first);
    return 0;
}
