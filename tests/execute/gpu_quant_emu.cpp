// gpu_quant.cu's kernels on the host (gpu_quant_simt.h), launched as gpu_quant.py launches them:
// stdin = tables, g_block, mode; mode 0: qt, rows, cols, n, rb, W, X -> Y (n, rows);
// mode 1 / 2: qt_g, qt_u, qt_d, E, ffn, hidden, T, rb x 3, weights, W, X -> the one-token output
// (hidden) / every token through every expert (E * T, hidden); mode 3: mode 1 with 4 down rows per
// block (mode 1: 2) and gate/up's _w tiles; modes 4 .. 11: mode 2 by the int8 variants _q8, _q8m2, _q8m1, _q8s2, _q8s1, _q8p, _q8p2, _q8px
// (inputs through qx8).
// Build with -DGPU_QUANT_CU='"path"'.
#include "gpu_quant_simt.h"
#include <cstdio>
#include <cstdlib>
#include GPU_QUANT_CU
uint32_t h_iq2xxs[512], h_iq2xs[1024], h_iq2s[2048], h_iq3xxs[256], h_iq3s[512], h_iq1p[4096], h_iq1n[4096], h_iq4nl[4];
uint8_t h_ksigns[128];
static void rd(void* p, size_t n) { if (fread(p, 1, n, stdin) != n) { fprintf(stderr, "short input\n"); exit(2); } }
template <class T> T get() { T v; rd(&v, sizeof v); return v; }
int main() {
    rd(h_iq2xxs, sizeof h_iq2xxs); rd(h_iq2xs, sizeof h_iq2xs); rd(h_iq2s, sizeof h_iq2s); rd(h_iq3xxs, sizeof h_iq3xxs);
    rd(h_iq3s, sizeof h_iq3s); rd(h_iq1p, sizeof h_iq1p); rd(h_iq1n, sizeof h_iq1n); rd(h_iq4nl, sizeof h_iq4nl); rd(h_ksigns, 128);
    rd(g_block, sizeof g_block);
    int mode = get<int>();
    if (mode == 0) {
        int qt = get<int>(), rows = get<int>(), cols = get<int>(), n = get<int>();
        long long rb = get<long long>();
        std::vector<uint8_t> W(rows * rb); rd(W.data(), W.size());
        std::vector<float> X((size_t)n * cols), Y((size_t)n * rows, NAN); rd(X.data(), X.size() * 4);
        const uint8_t* w = W.data(); const float* x = X.data(); float* y = Y.data();
        if (qt == 0 || qt == 1 || qt == 30) launch({(unsigned)(rows + 3) / 4, 1, 1}, 128, [=] { qmatmul_f(w, qt, rows, cols, rb, x, n, y); });
        else if (n == 1) launch({(unsigned)(rows + 7) / 8, 1, 1}, 128, [=] { qmatmul_q1(w, qt, rows, cols, rb, x, n, y); });
        else launch({(unsigned)(rows + 7) / 8, (unsigned)(n + 7) / 8, 1}, 128, [=] { qmatmul_q(w, qt, rows, cols, rb, x, n, y); });
        fwrite(Y.data(), 4, Y.size(), stdout);
        return 0;
    }
    int qg = get<int>(), qu = get<int>(), qd = get<int>(), E = get<int>(), ffn = get<int>(), hidden = get<int>(), T = get<int>();
    long long rg = get<long long>(), ru = get<long long>(), rdn = get<long long>();
    long long off_u = ffn * rg, off_d = off_u + ffn * ru, eb = off_d + hidden * rdn;
    std::vector<float> wts(E); rd(wts.data(), 4 * E);
    std::vector<uint8_t> W(E * eb); rd(W.data(), W.size());
    std::vector<float> X((size_t)T * hidden); rd(X.data(), X.size() * 4);
    std::vector<unsigned long long> base(E);
    for (int e = 0; e < E; e++) base[e] = (unsigned long long)(W.data() + e * eb);
    const float* x = X.data();
    if (mode == 1 || mode == 3) {
        Experts1 ex; memset(&ex, 0, sizeof ex);
        for (int e = 0; e < E; e++) { ex.base[e] = base[e]; ex.weight[e] = wts[e]; ex.pick[e] = e; }
        std::vector<float> h((size_t)E * ffn, NAN), out(hidden, NAN);
        float* hp = h.data(); float* op = out.data();
        unsigned gu = (unsigned)(ffn + 7) / 8;
        int rpb = mode == 1 ? 2 : 4;
        auto gate_up = mode == 1 ? qmoe1_gate_up : qmoe1_gate_up_w;
        launch({gu, (unsigned)E, 1}, 128, [=] { gate_up(ex, x, hp, ffn, hidden, 2, 0, qg, rg, off_u, qu, ru, 0, 0); });
        launch({(unsigned)(hidden + rpb - 1) / rpb, 1, 1}, 32 * E, [=] { qmoe1_down_combine(ex, hp, op, E, ffn, hidden, rpb, off_d, qd, rdn, 0); });
        fwrite(out.data(), 4, out.size(), stdout);
        return 0;
    }
    std::vector<int> gstart(E + 1), order(E * T), xrow(E * T);
    for (int e = 0; e <= E; e++) gstart[e] = e * T;
    for (int p = 0; p < E * T; p++) { order[p] = p; xrow[p] = p % T; }
    std::vector<float> h((size_t)E * T * ffn, NAN), y((size_t)E * T * hidden, NAN);
    const unsigned long long* bp = base.data(); const int *gs = gstart.data(), *od = order.data(), *xr = xrow.data();
    float* hp = h.data(); float* yp = y.data();
    if (mode >= 4) {
        int mt = mode == 4 || mode == 9 ? 4 : mode == 5 || mode == 7 || mode == 10 || mode == 11 ? 2 : 1;
        int threads = mode >= 9 ? 256 : 128;
        int md = mode == 11 ? 4 : mt;  // down's m-tiles
        std::vector<uint8_t> x8((size_t)T * hidden * 19 / 8), h8((size_t)E * T * ffn * 19 / 8);
        uint8_t* x8p = x8.data(); uint8_t* h8p = h8.data();
        launch({(unsigned)((T * hidden / 32 + 15) / 16), 1, 1}, 128, [=] { qx8(x, hidden, T, hidden, x8p); });
        Dim3 g1 = {(unsigned)((ffn + 8 * mt - 1) / (8 * mt)), (unsigned)E, 1}, g2 = {(unsigned)((hidden + 16 * md - 1) / (16 * md)), (unsigned)E, 1};
        auto gate_up = mode == 4 ? qmoe_gate_up_q8 : mode == 5 ? qmoe_gate_up_q8m2 : mode == 6 ? qmoe_gate_up_q8m1
                     : mode == 7 ? qmoe_gate_up_q8s2 : mode == 8 ? qmoe_gate_up_q8s1
                     : mode == 9 ? qmoe_gate_up_q8p : mode == 10 ? qmoe_gate_up_q8p2 : qmoe_gate_up_q8px;
        auto down = mode == 4 ? qmoe_down_q8 : mode == 5 ? qmoe_down_q8m2 : mode == 6 ? qmoe_down_q8m1
                  : mode == 7 ? qmoe_down_q8s2 : mode == 8 ? qmoe_down_q8s1
                  : mode == 9 ? qmoe_down_q8p : mode == 10 ? qmoe_down_q8p2 : qmoe_down_q8px;
        launch(g1, threads, [=] { gate_up(bp, gs, od, xr, x8p, T, hp, ffn, hidden, 2 * mt, 0, qg, rg, off_u, qu, ru, 0, 0); });
        launch({(unsigned)((E * T * ffn / 32 + 15) / 16), 1, 1}, 128, [=] { qx8(hp, ffn, E * T, ffn, h8p); });
        launch(g2, threads, [=] { down(bp, gs, od, h8p, E * T, yp, ffn, hidden, 4 * md, off_d, qd, rdn, 0); });
        fwrite(y.data(), 4, y.size(), stdout);
        return 0;
    }
    launch({(unsigned)(ffn + 7) / 8, (unsigned)E, 1}, 128, [=] { qmoe_gate_up(bp, gs, od, xr, x, hidden, hp, ffn, hidden, 2, 0, qg, rg, off_u, qu, ru, 0, 0); });
    launch({(unsigned)(hidden + 7) / 8, (unsigned)E, 1}, 128, [=] { qmoe_down(bp, gs, od, hp, yp, ffn, hidden, 2, off_d, qd, rdn, 0); });
    fwrite(y.data(), 4, y.size(), stdout);
    return 0;
}
