/* The int4 product of the avx2 profile, at the width of the CPU it runs on (kvgraft_cli/engine/ckernels.py).
 *
 * C[m, n] = bf16( sum over k, in order, of  a[m, k] * w[n, k] ), with every operation the one ATen's AVX2 kernel
 * (aten._weight_int4pack_mm_for_cpu under ATEN_CPU_CAPABILITY=avx2) performs, in the same order:
 *
 *   z'  = fma(scale, -8, zero)               once per group of 32 along k, per column
 *   w   = fma((float)code, scale, z')        per weight
 *   acc = fma((float)a, w, acc)              k = 0, 1, ..., K-1, from +0
 *   C   = acc rounded to bfloat16 to nearest even (a NaN becomes 0xffff)
 *
 * Each is an IEEE-754 operation rounded once (a fused multiply-add is exact before its one rounding), so the result
 * does not depend on how many lanes compute it: the AVX-512 and AVX2 paths below give ATen's AVX2 bits, column by
 * column, whatever the rows, the tiling or the threads. ATen's own AVX-512 kernel computes w = fma(code - 8, scale,
 * zero), one rounding fewer, which is why its bits are another machine's. Compiled with -ffp-contract=off: no
 * multiply and add is fused but the ones written here.
 *
 * B is ATen's AVX2 packing (what _convert_weight_to_int4pack_for_cpu writes under that capability): columns in blocks
 * of 32, each block K rows of 16 bytes, byte d holding column d in its low nibble and column d + 16 in its high one;
 * a last block of 16 columns holds two columns a byte, the even one low. S is [K / 32, N, 2] bfloat16 (scale, zero).
 */
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#define GROUP 32
#define MAXM 4 /* rows a tile */
#define NT 4   /* 32-column blocks a tile, at most */

static inline float bf16f(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if (f != f) return 0xffff;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* scales and z' of columns [n0, n0 + ncols) for group kb */
static inline void group_sz(const uint16_t *S, int N, int kb, int n0, int ncols, float *s, float *z) {
    const uint16_t *p = S + ((size_t)kb * N + n0) * 2;
    for (int j = 0; j < ncols; j++) {
        float sc = bf16f(p[2 * j]);
        s[j] = sc;
        z[j] = __builtin_fmaf(sc, -8.0f, bf16f(p[2 * j + 1]));
    }
}

static inline void store_rows(const float *acc, int M, int ncols, uint16_t *C, int N, int n0) {
    for (int r = 0; r < M; r++)
        for (int j = 0; j < ncols; j++) C[(size_t)r * N + n0 + j] = f32bf16(acc[r * NT * 32 + j]);
}

/* ---- AVX-512: a 32-column block is two vectors, the low nibbles (columns 0-15) and the high ones (16-31) ---- */
__attribute__((target("avx512f,fma"), always_inline)) static inline void
tile512(const uint16_t *A, int lda, const uint8_t *B, const uint16_t *S, uint16_t *C, int M, int N, int K, int n0,
        int nt) {
    __m512 acc[MAXM][NT][2];
    for (int r = 0; r < MAXM; r++)
        for (int t = 0; t < NT; t++) acc[r][t][0] = acc[r][t][1] = _mm512_setzero_ps();
    const __m512i low = _mm512_set1_epi32(0xF);
    float s[NT * 32] __attribute__((aligned(64))), z[NT * 32] __attribute__((aligned(64)));
    for (int kb = 0; kb < K / GROUP; kb++) {
        for (int t = 0; t < nt; t++) group_sz(S, N, kb, n0 + 32 * t, 32, s + 32 * t, z + 32 * t);
        __m512 vs[NT][2], vz[NT][2];
        for (int t = 0; t < NT; t++)
            if (t < nt) {
                vs[t][0] = _mm512_load_ps(s + 32 * t), vs[t][1] = _mm512_load_ps(s + 32 * t + 16);
                vz[t][0] = _mm512_load_ps(z + 32 * t), vz[t][1] = _mm512_load_ps(z + 32 * t + 16);
            }
        for (int k = kb * GROUP; k < kb * GROUP + GROUP; k++) {
            __m512 w[NT][2];
            for (int t = 0; t < NT; t++)
                if (t < nt) {
                    const uint8_t *b = B + (size_t)(n0 + 32 * t) * K / 2 + (size_t)k * 16;
                    __m512i q = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)b));
                    w[t][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(q, low)), vs[t][0], vz[t][0]);
                    w[t][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4)), vs[t][1], vz[t][1]);
                }
            for (int r = 0; r < MAXM; r++)
                if (r < M) {
                    __m512 a = _mm512_set1_ps(bf16f(A[(size_t)r * lda + k]));
                    for (int t = 0; t < NT; t++)
                        if (t < nt) {
                            acc[r][t][0] = _mm512_fmadd_ps(a, w[t][0], acc[r][t][0]);
                            acc[r][t][1] = _mm512_fmadd_ps(a, w[t][1], acc[r][t][1]);
                        }
                }
        }
    }
    float out[MAXM * NT * 32];
    for (int r = 0; r < MAXM; r++)
        if (r < M)
            for (int t = 0; t < NT; t++)
                if (t < nt) {
                    _mm512_storeu_ps(out + r * NT * 32 + 32 * t, acc[r][t][0]);
                    _mm512_storeu_ps(out + r * NT * 32 + 32 * t + 16, acc[r][t][1]);
                }
    store_rows(out, M, 32 * nt, C, N, n0);
}

/* ---- AVX2: a 32-column block is four vectors: bytes 0-7 low (columns 0-7), bytes 8-15 low (8-15), bytes 0-7 high
 * (16-23), bytes 8-15 high (24-31). Sixteen registers: the scales and z' are read from memory. ---- */
__attribute__((target("avx2,fma"), always_inline)) static inline void
tile256(const uint16_t *A, int lda, const uint8_t *B, const uint16_t *S, uint16_t *C, int M, int N, int K, int n0,
        int nt) {
    __m256 acc[MAXM][NT][4];
    for (int r = 0; r < MAXM; r++)
        for (int t = 0; t < NT; t++)
            for (int v = 0; v < 4; v++) acc[r][t][v] = _mm256_setzero_ps();
    const __m256i low = _mm256_set1_epi32(0xF);
    float s[NT * 32] __attribute__((aligned(32))), z[NT * 32] __attribute__((aligned(32)));
    for (int kb = 0; kb < K / GROUP; kb++) {
        for (int t = 0; t < nt; t++) group_sz(S, N, kb, n0 + 32 * t, 32, s + 32 * t, z + 32 * t);
        for (int k = kb * GROUP; k < kb * GROUP + GROUP; k++) {
            __m256 w[NT][4];
            for (int t = 0; t < NT; t++)
                if (t < nt) {
                    const uint8_t *b = B + (size_t)(n0 + 32 * t) * K / 2 + (size_t)k * 16;
                    __m128i bytes = _mm_loadu_si128((const __m128i *)b);
                    __m256i q0 = _mm256_cvtepu8_epi32(bytes), q1 = _mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8));
                    const float *st = s + 32 * t, *zt = z + 32 * t;
                    w[t][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q0, low)), _mm256_load_ps(st),
                                              _mm256_load_ps(zt));
                    w[t][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(q1, low)), _mm256_load_ps(st + 8),
                                              _mm256_load_ps(zt + 8));
                    w[t][2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q0, 4)), _mm256_load_ps(st + 16),
                                              _mm256_load_ps(zt + 16));
                    w[t][3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(q1, 4)), _mm256_load_ps(st + 24),
                                              _mm256_load_ps(zt + 24));
                }
            for (int r = 0; r < MAXM; r++)
                if (r < M) {
                    __m256 a = _mm256_set1_ps(bf16f(A[(size_t)r * lda + k]));
                    for (int t = 0; t < NT; t++)
                        if (t < nt)
                            for (int v = 0; v < 4; v++) acc[r][t][v] = _mm256_fmadd_ps(a, w[t][v], acc[r][t][v]);
                }
        }
    }
    float out[MAXM * NT * 32];
    for (int r = 0; r < MAXM; r++)
        if (r < M)
            for (int t = 0; t < NT; t++)
                if (t < nt)
                    for (int v = 0; v < 4; v++) _mm256_storeu_ps(out + r * NT * 32 + 32 * t + 8 * v, acc[r][t][v]);
    store_rows(out, M, 32 * nt, C, N, n0);
}

typedef void (*tile_fn)(const uint16_t *, int, const uint8_t *, const uint16_t *, uint16_t *, int, int, int);
#define SPEC(ISA, TGT, MM, TT)                                                                                      \
    __attribute__((target(TGT))) static void t##ISA##_##MM##_##TT(const uint16_t *A, int lda, const uint8_t *B,       \
                                                               const uint16_t *S, uint16_t *C, int N, int K,       \
                                                               int n0) {                                           \
        tile##ISA(A, lda, B, S, C, MM, N, K, n0, TT);                                                               \
    }
#define SPECS(ISA, TGT)                                                                                             \
    SPEC(ISA, TGT, 1, 1) SPEC(ISA, TGT, 1, 2) SPEC(ISA, TGT, 1, 3) SPEC(ISA, TGT, 1, 4) SPEC(ISA, TGT, 2, 1)      \
    SPEC(ISA, TGT, 2, 2) SPEC(ISA, TGT, 2, 3) SPEC(ISA, TGT, 2, 4) SPEC(ISA, TGT, 3, 1) SPEC(ISA, TGT, 3, 2)      \
    SPEC(ISA, TGT, 4, 1) SPEC(ISA, TGT, 4, 2)                                                                       \
    static const tile_fn TILES##ISA[MAXM][NT] = {{t##ISA##_1_1, t##ISA##_1_2, t##ISA##_1_3, t##ISA##_1_4},                     \
                                                 {t##ISA##_2_1, t##ISA##_2_2, t##ISA##_2_3, t##ISA##_2_4},                     \
                                                 {t##ISA##_3_1, t##ISA##_3_2, 0, 0},                                     \
                                                 {t##ISA##_4_1, t##ISA##_4_2, 0, 0}};
SPECS(512, "avx512f,fma")
SPECS(256, "avx2,fma")

/* The last 16 columns (N % 32 == 16), scalar: the same operations one column at a time. */
static void tail16(const uint16_t *A, int lda, const uint8_t *B, const uint16_t *S, uint16_t *C, int M, int N,
                   int K, int n0) {
    float s[16], z[16];
    for (int r = 0; r < M; r++) {
        float acc[16] = {0};
        for (int kb = 0; kb < K / GROUP; kb++) {
            group_sz(S, N, kb, n0, 16, s, z);
            for (int k = kb * GROUP; k < kb * GROUP + GROUP; k++) {
                float a = bf16f(A[(size_t)r * lda + k]);
                const uint8_t *b = B + (size_t)n0 * K / 2 + (size_t)k * 8;
                for (int j = 0; j < 16; j++) {
                    int q = (j & 1) ? (b[j >> 1] >> 4) : (b[j >> 1] & 0xF);
                    acc[j] = __builtin_fmaf(a, __builtin_fmaf((float)q, s[j], z[j]), acc[j]);
                }
            }
        }
        for (int j = 0; j < 16; j++) C[(size_t)r * N + n0 + j] = f32bf16(acc[j]);
    }
}

/* Which vector path this CPU takes: 512 or 256 (0: neither, AVX2 and FMA missing). */
int kvg_int4_isa(void) {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma")) return 512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return 256;
    return 0;
}

/* C [M, N] bf16 = A [M, K] bf16 x B, on `threads` OpenMP threads (torch's own runtime: the library loads after
 * torch and shares its libgomp), with the vector path `isa` (512 or 256; the caller checked the CPU has it).
 * Threads split the columns; a column's arithmetic is the same whichever thread computes it. */
int kvg_int4mm(const uint16_t *A, const uint8_t *B, const uint16_t *S, uint16_t *C, int M, int N, int K, int isa,
               int threads) {
    if (K % GROUP || N % 16 || M < 1) return -1;
    const tile_fn(*tiles)[NT] = isa == 512 ? TILES512 : TILES256;
    const int full = N - N % 32;
    const int wide = isa == 512 ? NT : 2; /* blocks a tile at one or two rows; AVX2 has 16 registers */
    const int per = 32 * wide;
    const int units = (full + per - 1) / per + (full < N);
#pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1)
    for (int u = 0; u < units; u++) {
        int n0 = u * per;
        if (n0 >= full) {
            for (int m0 = 0; m0 < M; m0 += MAXM)
                tail16(A + (size_t)m0 * K, K, B, S, C + (size_t)m0 * N, M - m0 < MAXM ? M - m0 : MAXM, N, K, full);
            continue;
        }
        int blocks = (full - n0) / 32 < wide ? (full - n0) / 32 : wide;
        for (int m0 = 0; m0 < M; m0 += MAXM) {
            int mm = M - m0 < MAXM ? M - m0 : MAXM;
            int most = isa == 512 ? (mm <= 2 ? NT : 2) : (mm == 1 ? 2 : 1);
            for (int b = 0; b < blocks; b += most) {
                int nt = blocks - b < most ? blocks - b : most;
                tiles[mm - 1][nt - 1](A + (size_t)m0 * K, K, B, S, C + (size_t)m0 * N, N, K, n0 + 32 * b);
            }
        }
    }
    return 0;
}
