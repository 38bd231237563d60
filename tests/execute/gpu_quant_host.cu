// host build of gpu_quant.cu's decoders (tests/execute/test_gpu_quant.py): stdin = qt, nblocks, tables,
// blocks, per chunk 32 inputs and their staged levels; stdout = per chunk 32 weights, dot_f, dot_staged
#define MOELAB_HOST_CHECK
#include <cmath>
#include <cstdio>
#include "GPU_QUANT_CU"
uint32_t h_iq2xxs[512], h_iq2xs[1024], h_iq2s[2048], h_iq3xxs[256], h_iq3s[512], h_iq1p[4096], h_iq1n[4096], h_iq4nl[4];
uint8_t h_ksigns[128];
static void rd(void* p, size_t n) { if (fread(p, 1, n, stdin) != n) { fprintf(stderr, "short input\n"); std::exit(2); } }
template <int QT> void run(int nb) {
    constexpr int SUB = qbw(QT) / 32, BB = qbb(QT);
    uint8_t* w = new uint8_t[(size_t)nb * BB + 1];
    rd(w + 1, (size_t)nb * BB);  // one byte off: rows start at odd addresses
    for (int c = 0; c < nb * SUB; c++) {
        float x[32], dxs, s16[2];
        uint32_t x1[8], x2[8];
        rd(x, 128); rd(x1, 32); rd(x2, 32); rd(&dxs, 4); rd(s16, 8);
        Dec d;
        dec32<QT>(w + 1 + (size_t)(c / SUB) * BB, c % SUB, d);
        float out[34];
        for (int i = 0; i < 32; i++) out[i] = (i < 16 ? d.a0 : d.a1) * (float)(int8_t)(d.q[i / 4] >> (8 * (i % 4))) + (i < 16 ? d.b0 : d.b1);
        out[32] = dot_f<QT>(d, x);
        out[33] = dot_staged<QT>(d, x1, x2, dxs, s16);
        fwrite(out, 4, 34, stdout);
    }
}
int main() {
    int qt, nb;
    rd(&qt, 4); rd(&nb, 4);
    rd(h_iq2xxs, sizeof h_iq2xxs); rd(h_iq2xs, sizeof h_iq2xs); rd(h_iq2s, sizeof h_iq2s); rd(h_iq3xxs, sizeof h_iq3xxs);
    rd(h_iq3s, sizeof h_iq3s); rd(h_iq1p, sizeof h_iq1p); rd(h_iq1n, sizeof h_iq1n); rd(h_iq4nl, sizeof h_iq4nl); rd(h_ksigns, 128);
#define C(Q) case Q: run<Q>(nb); break;
    switch (qt) { C(2) C(3) C(6) C(7) C(8) C(10) C(11) C(12) C(13) C(14) C(16) C(17) C(18) C(19) C(20) C(21) C(22) C(23) C(29) C(39) default: return 3; }
    return 0;
}
