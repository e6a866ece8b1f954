/* Attention's two products under model.attn_products: aten, without their temporaries (engine/ckernels.py).
 *
 * engine.attention computes Q·Kᵀ as (q * k).sum(-1) and weights·V as (w * v).sum(-2): ATen's float32 multiply into a
 * temporary, then ATen's sum (aten/src/ATen/native/cpu/SumKernel.cpp, cascade_sum) under ATEN_CPU_CAPABILITY=avx2,
 * whose order of additions is fixed by the shapes and by its 8-lane vectors. This file performs, for each output,
 * the same multiplications and the same additions in the same order, reading q, k, w and v where they lie:
 *
 * scores (the sum over d, contiguous: vectorized_inner_sum with 8-lane vectors): the d products as V = d/8 vectors
 * P0..P(V-1); four accumulators a_k = sum over i < V/4 of P(4i+k), each from +0 (then ATen adds multi_row_sum's
 * empty upper levels, +0 three times: an identity on such a sum); the vectors past 4*(V/4) added to a_0;
 * a_0 + a_1, + a_2, + a_3; then a scalar from +0 adds the 8 lanes in order; the output, filled with 0 first, adds it.
 *
 * mix (the sum over n, a stride of d floats: vectorized_outer_sum): lanes of d in whole groups of 32 take
 * multi_row_sum over the n rows (a running sum a level, carried up every 16 rows: 16, 256, 4096), the lanes past
 * them row_sum (four interleaved such sums over rows 4i + k, the rows past 4*(n/4) added to the first, then the four
 * added in order); the output, filled with 0, adds the result.
 *
 * Every addition and multiplication is one IEEE-754 operation rounded once, never fused (-ffp-contract=off), so the
 * results do not depend on how many lanes compute them. The check at load compares them with ATen's, byte for byte.
 */
#include <stdint.h>
#include <string.h>

#define LEVELS 4
#define STEP 16 /* multi_row_sum's level_step: 1 << max(4, CeilLog2(size) / 4), 16 below 2^20 rows */

/* ---- Q·Kᵀ ---- */

#define MAXD 512

__attribute__((always_inline)) static inline float dot8(const float *q, const float *k, int d) {
    float p[MAXD];
    for (int i = 0; i < d; i++) p[i] = q[i] * k[i];
    const int V = d / 8, ilp = V / 4;
    float a[4][8];
    for (int c = 0; c < 4; c++)
        for (int l = 0; l < 8; l++) a[c][l] = 0.0f;
    for (int i = 0; i < ilp; i++)
        for (int c = 0; c < 4; c++)
            for (int l = 0; l < 8; l++) a[c][l] += p[(4 * i + c) * 8 + l];
    /* (ATen adds the empty upper levels here, +0 each: an identity, since an accumulator that starts at +0 is never
     * -0 after an addition in round-to-nearest, and a NaN stays the same NaN) */
    for (int i = ilp * 4; i < V; i++)
        for (int l = 0; l < 8; l++) a[0][l] += p[i * 8 + l];
    for (int c = 1; c < 4; c++)
        for (int l = 0; l < 8; l++) a[0][l] += a[c][l];
    float f = 0.0f;
    for (int i = V * 8; i < d; i++) f += p[i];
    for (int l = 0; l < 8; l++) f += a[0][l];
    return 0.0f + f;
}

/* The same for KB keys at once, their lanes side by side: every operation is the one dot8 performs, lane by lane,
 * so the compiler may vectorize across keys and lanes alike; the 8 lanes' final sum runs across keys. */
#define KB 8
__attribute__((always_inline)) static inline void dot8_keys(const float *q, const float *k, long kn, int d,
                                                           float *out) {
    const int V = d / 8, ilp = V / 4;
    float a[4][KB][8];
    for (int c = 0; c < 4; c++)
        for (int j = 0; j < KB; j++)
            for (int l = 0; l < 8; l++) a[c][j][l] = 0.0f;
    for (int i = 0; i < ilp; i++)
        for (int c = 0; c < 4; c++) {
            const int o = (4 * i + c) * 8;
            for (int j = 0; j < KB; j++)
                for (int l = 0; l < 8; l++) a[c][j][l] += q[o + l] * k[j * kn + o + l];
        }
    /* (the empty upper levels' +0: an identity, as in dot8) */
    for (int i = ilp * 4; i < V; i++)
        for (int j = 0; j < KB; j++)
            for (int l = 0; l < 8; l++) a[0][j][l] += q[i * 8 + l] * k[j * kn + i * 8 + l];
    for (int c = 1; c < 4; c++)
        for (int j = 0; j < KB; j++)
            for (int l = 0; l < 8; l++) a[0][j][l] += a[c][j][l];
    float t[8][KB], f[KB];
    for (int j = 0; j < KB; j++)
        for (int l = 0; l < 8; l++) t[l][j] = a[0][j][l];
    for (int j = 0; j < KB; j++) f[j] = 0.0f;
    for (int l = 0; l < 8; l++)
        for (int j = 0; j < KB; j++) f[j] += t[l][j];
    for (int j = 0; j < KB; j++) out[j] = 0.0f + f[j];
}

#define SCORES_BODY                                                                                                 \
    for (long u = 0; u < (long)B * H * M; u++) {                                                                    \
        long b = u / ((long)H * M), h = (u / M) % H, m = u % M;                                                     \
        const float *qr = q + b * qb + h * qh + m * qm;                                                             \
        const float *kh_ = k + b * kb + h * kh;                                                                     \
        float *o = out + u * N;                                                                                     \
        int j = 0;                                                                                                  \
        for (; j + KB <= N; j += KB) dot8_keys(qr, kh_ + (long)j * kn, kn, D, o + j);                              \
        for (; j < N; j++) o[j] = dot8(qr, kh_ + (long)j * kn, D);                                                 \
    }

__attribute__((target("avx512f,fma"))) static void scores512(const float *q, const float *k, float *out, int B,
                                                              int H, int M, int N, int D, long qb, long qh, long qm,
                                                              long kb, long kh, long kn, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    SCORES_BODY
}

__attribute__((target("avx2,fma"))) static void scores256(const float *q, const float *k, float *out, int B, int H,
                                                           int M, int N, int D, long qb, long qh, long qm, long kb,
                                                           long kh, long kn, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    SCORES_BODY
}

/* out [B, H, M, N] contiguous = q [B, H, M, D] . k [B, H, N, D]ᵀ (element strides; the last dimension contiguous) */
int kvg_scores(const float *q, const float *k, float *out, int B, int H, int M, int N, int D, long qb, long qh,
               long qm, long kb, long kh, long kn, int isa, int threads) {
    if (D % 8 || D < 8 || D > MAXD) return -1;
    if (isa == 512)
        scores512(q, k, out, B, H, M, N, D, qb, qh, qm, kb, kh, kn, threads);
    else
        scores256(q, k, out, B, H, M, N, D, qb, qh, qm, kb, kh, kn, threads);
    return 0;
}

/* ---- weights·V ---- */

/* multi_row_sum over rows r0, r0 + step, ... (count rows) of lanes [0, L): acc += w[r] * v[r][lane] */
__attribute__((always_inline)) static inline void cascade(const float *w, const float *v, long vn, int r0, int step,
                                                          int count, int L, float *out) {
    float acc[LEVELS][MAXD];
    for (int lev = 0; lev < LEVELS; lev++)
        for (int l = 0; l < L; l++) acc[lev][l] = 0.0f;
    int i = 0;
    while (i + STEP <= count) {
        for (int j = 0; j < STEP; j++, i++) {
            const int r = r0 + i * step;
            const float wr = w[r];
            const float *vr = v + (long)r * vn;
            for (int l = 0; l < L; l++) acc[0][l] += wr * vr[l];
        }
        for (int lev = 1; lev < LEVELS; lev++) {
            for (int l = 0; l < L; l++) {
                acc[lev][l] += acc[lev - 1][l];
                acc[lev - 1][l] = 0.0f;
            }
            if ((i & ((STEP - 1) << (lev * 4))) != 0) break;
        }
    }
    for (; i < count; i++) {
        const int r = r0 + i * step;
        const float wr = w[r];
        const float *vr = v + (long)r * vn;
        for (int l = 0; l < L; l++) acc[0][l] += wr * vr[l];
    }
    for (int lev = 1; lev < LEVELS; lev++)
        for (int l = 0; l < L; l++) acc[0][l] += acc[lev][l];
    for (int l = 0; l < L; l++) out[l] = acc[0][l];
}

__attribute__((always_inline)) static inline void mix_row(const float *w, const float *v, long vn, int N, int D,
                                                          float *o) {
    const int main = D / 32 * 32;
    float s[MAXD];
    if (main) {
        cascade(w, v, vn, 0, 1, N, main, s);
        for (int l = 0; l < main; l++) o[l] = 0.0f + s[l];
    }
    if (main < D) { /* row_sum: four interleaved cascades over rows 4i + c, the rest into the first */
        const int L = D - main, quarter = N / 4;
        float part[4][MAXD];
        for (int c = 0; c < 4; c++) cascade(w, v + main, vn, c, 4, quarter, L, part[c]);
        for (int r = quarter * 4; r < N; r++)
            for (int l = 0; l < L; l++) part[0][l] += w[r] * v[(long)r * vn + main + l];
        for (int c = 1; c < 4; c++)
            for (int l = 0; l < L; l++) part[0][l] += part[c][l];
        for (int l = 0; l < L; l++) o[main + l] = 0.0f + part[0][l];
    }
}

#define MIX_BODY                                                                                                    \
    for (long u = 0; u < (long)B * H * M; u++) {                                                                    \
        long b = u / ((long)H * M), h = (u / M) % H, m = u % M;                                                     \
        mix_row(w + b * wb + h * wh + m * wm, v + b * vb + h * vh, vn, N, D, out + u * D);                         \
    }

__attribute__((target("avx512f,fma"))) static void mix512(const float *w, const float *v, float *out, int B, int H,
                                                           int M, int N, int D, long wb, long wh, long wm, long vb,
                                                           long vh, long vn, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    MIX_BODY
}

__attribute__((target("avx2,fma"))) static void mix256(const float *w, const float *v, float *out, int B, int H,
                                                        int M, int N, int D, long wb, long wh, long wm, long vb,
                                                        long vh, long vn, int threads) {
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    MIX_BODY
}

/* out [B, H, M, D] contiguous = w [B, H, M, N] . v [B, H, N, D] (element strides; the last dimension contiguous) */
int kvg_mix(const float *w, const float *v, float *out, int B, int H, int M, int N, int D, long wb, long wh, long wm,
            long vb, long vh, long vn, int isa, int threads) {
    if (D % 8 || D < 8 || D > MAXD || N < 1) return -1;
    if (isa == 512)
        mix512(w, v, out, B, H, M, N, D, wb, wh, wm, vb, vh, vn, threads);
    else
        mix256(w, v, out, B, H, M, N, D, wb, wh, wm, vb, vh, vn, threads);
    return 0;
}
