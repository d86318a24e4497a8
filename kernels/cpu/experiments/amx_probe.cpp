// AMX probe (issue 29, item 2 on AMX CPUs): what a batch-invariant block kernel on AMX tiles
// could rely on. Built and run by `pdserve bench amx-probe` (loadtest/experiments/amx_probe.py).
//
// It answers three questions on the CPU it runs on:
//   1. Is a row's TDPBF16PS result independent of how many rows the tile holds (M = 1 vs 16)?
//      (A decode step of one row and a prefill tile of 16 would then give the same bits.)
//   2. Can a register loop reproduce those bits: VDPBF16PS over broadcast activation pairs and
//      VNNI-packed weights (lane n = output n, pairs in k order), or scalar float32 models?
//      (If not, decode must run on the tiles too to stay bit-identical to prefill.)
//   3. Throughput of (load B tile, load A tile, TDPBF16PS) at M = 1 and M = 16, in FLOP/cycle
//      of the time-stamp counter.
// Tile shapes: A [M rows x 32 bf16], B [16 pairs x 16 columns x 2 bf16] (VNNI), C [M x 16 fp32];
// K = 768 (24 tile steps); values random bf16 with spread magnitudes. Intel SDM vol. 2,
// TDPBF16PS / VDPBF16PS; Linux needs arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>

namespace {
constexpr int N = 16, K = 32 * 24, MAXM = 16;
uint16_t A[MAXM][K];
uint16_t B[K / 2][N][2];

uint16_t to_bf16(float x) {  // to nearest even (finite inputs)
    uint32_t u;
    std::memcpy(&u, &x, 4);
    u += 0x7fff + ((u >> 16) & 1);
    return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t h) {
    uint32_t u = uint32_t(h) << 16;
    float x;
    std::memcpy(&x, &u, 4);
    return x;
}
struct alignas(64) TileConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};
void configure(int m) {
    // static: GCC's _tile_loadconfig passes only the address to its asm, so the stores into a
    // local struct can be dropped as dead (seen: palette alone stored, then SIGILL)
    static TileConfig c;
    std::memset(&c, 0, sizeof c);
    c.palette = 1;
    c.rows[0] = m, c.colsb[0] = N * 4;   // C: m x 16 fp32
    c.rows[1] = m, c.colsb[1] = 64;      // A: m x 32 bf16
    c.rows[2] = 16, c.colsb[2] = N * 4;  // B: 16 pairs x 16 columns
    asm volatile("" ::: "memory");
    _tile_loadconfig(&c);
}
void amx(int m, float (*C)[N]) {
    configure(m);
    std::memset(C, 0, sizeof(float) * m * N);
    _tile_loadd(0, C, N * 4);
    for (int k = 0; k < K; k += 32) {
        _tile_loadd(1, &A[0][k], K * 2);
        _tile_loadd(2, &B[k / 2][0][0], N * 4);
        _tile_dpbf16ps(0, 1, 2);
    }
    _tile_stored(0, C, N * 4);
    _tile_release();
}
}  // namespace

int main() {
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
        std::puts("amx: the kernel refused tile data permission");
        return 1;
    }
    std::mt19937 gen(1);
    std::normal_distribution<float> dist(0, 1);
    for (int m = 0; m < MAXM; m++)
        for (int k = 0; k < K; k++) A[m][k] = to_bf16(dist(gen) * float(1 + k % 7));
    for (int p = 0; p < K / 2; p++)
        for (int n = 0; n < N; n++) B[p][n][0] = to_bf16(dist(gen) * 0.01f), B[p][n][1] = to_bf16(dist(gen) * 0.03f);

    static float C16[MAXM][N], C1[1][N];
    amx(16, C16);
    amx(1, C1);
    std::printf("1. row 0 alone (M=1) vs in a tile of 16: %s\n",
                std::memcmp(C16[0], C1[0], sizeof C1[0]) ? "DIFFERENT bits" : "the same bits");

    int reg = 0, pair_exact = 0, op_exact = 0, total = MAXM * N;
    for (int m = 0; m < MAXM; m++) {
        __m512 acc = _mm512_setzero_ps();
        for (int p = 0; p < K / 2; p++) {
            const uint32_t pair = A[m][2 * p] | (uint32_t(A[m][2 * p + 1]) << 16);
            acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(int(pair)),
                                   (__m512bh)_mm512_loadu_si512(&B[p][0][0]));
        }
        float r[N];
        _mm512_storeu_ps(r, acc);
        for (int n = 0; n < N; n++) {
            reg += !std::memcmp(&r[n], &C16[m][n], 4);
            float t1 = 0, t2 = 0;
            for (int k = 0; k < K; k += 32) {
                double op = 0;
                for (int p = k / 2; p < k / 2 + 16; p++) {
                    const double prod = double(from_bf16(A[m][2 * p])) * from_bf16(B[p][n][0]) +
                                        double(from_bf16(A[m][2 * p + 1])) * from_bf16(B[p][n][1]);
                    t1 = float(double(t1) + prod);
                    op += prod;
                }
                t2 = float(double(t2) + op);
            }
            pair_exact += !std::memcmp(&t1, &C16[m][n], 4);
            op_exact += !std::memcmp(&t2, &C16[m][n], 4);
        }
    }
    std::printf("2. outputs bit-identical to the tiles' (of %d): vdpbf16ps chain %d; float32 model, each pair "
                "exact then rounded %d; each 32-wide tile step exact then rounded %d\n", total, reg, pair_exact, op_exact);

    for (int m : {1, 16}) {
        configure(m);
        _tile_zero(0);
        constexpr int R = 200000;
        const uint64_t t0 = __rdtsc();
        for (int i = 0; i < R; i++) {
            _tile_loadd(2, &B[(i % 24) * 16][0][0], N * 4);
            _tile_loadd(1, &A[0][(i % 24) * 32], K * 2);
            _tile_dpbf16ps(0, 1, 2);
        }
        const double cycles = double(__rdtsc() - t0) / R;
        _tile_release();
        std::printf("3. M=%2d: %.1f TSC cycles per (load B, load A, TDPBF16PS) = %.0f FLOP/cycle\n", m, cycles,
                    2.0 * m * N * 32 / cycles);
    }
    return 0;
}
