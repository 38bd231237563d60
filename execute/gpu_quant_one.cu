// gpu_quant.cu, part 4 of 4: the one-token expert kernels (qmoe1_gate_up, qmoe1_down_combine: rows
// copied to shared memory, a lane per row and slice of chunks) and their probes (_p, _n).
struct Experts1 {  // gpu_kernels.cu's one-token pair table, passed by value
    unsigned long long base[MAXK];
    float weight[MAXK];
    int pick[MAXK];
};

// the block's rows of the weighted sum over its k experts' outputs ``ys`` (after every warp's rows)
__device__ __forceinline__ void down1_combine(const Experts1& ex, const float (*ys)[32], int k, int rows, float* out) {
    __syncthreads();
    int i = threadIdx.x;
    if (i < rows) {
        float s = 0.f;
        for (int jj = 0; jj < k; jj++) s += ex.weight[jj] * ys[jj][i];
        out[i] = s;
    }
}

// ---------------------------------------------------------------------------------------------
// One-token kernels (qmoe1_gate_up, qmoe1_down_combine: the arguments of moe1_gate_up and
// moe1_down_combine in gpu_kernels.cu; grids (ceil(ffn / (WARPS rows_per_warp)), pairs picked) and
// ceil(hidden / rows_per_block), rows_per_block <= 32; blocks 32 WARPS and 32 k). A warp copies its
// rows' tiles to shared memory first (16-byte cp.async words, coalesced, any row alignment), then a
// lane dots one row over every 8th (down: every (32 / G)-th) chunk, so the lanes of a warp read one
// or two input chunks at a time (broadcasts) and rows whose slots lie an odd number of 16-byte
// words apart (bank quads apart). (Lanes over the chunks of one row, decoding from global memory,
// spread each load over as many lines as lanes and took 1.5-1.8x longer: docs/perf/gpu_quant_h200.)
// The slices' sums are reduced by shuffles (and, for gate and up, through shared memory in warp
// order): deterministic. Their probes (timing only, no results): _p runs the same copies, staging
// and reductions with the dots left out (probe_row), _n leaves out the weight copies too.
// Launched with programmatic dependent launch (gpu_quant.ONE_VARIANTS' _d), a kernel issues its first
// weight copies, then waits for the grid before it (whose output it reads) and lets the next one
// start, so down copies its rows while gate/up drains and gate/up while the grid before drains.
__device__ __forceinline__ void pdl_wait_trigger() {  // nothing for a plain launch or on the host
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#define R1_BYTES 24576  // gate/up: a block's weight tiles (8 rows of gate, 8 of up)
#define R1W_BYTES 40960  // _w: the same, wide enough for a Q8_0 or Q6_K row of 2048 columns in one tile
#define D1R_BYTES 32768  // down: the weight tiles of a block's warps, split between them

// bytes per row slot for kt columns of qt: the covering 16-byte words, an odd number of them
__device__ __forceinline__ int slot_odd(int qt, int kt) {
    int s = slot_bytes(qt, kt);
    return (s / 16) % 2 ? s : s + 16;
}

// this thread's row (its tile at s) . the staged input over chunks c0, c0 + cs, .. < nch
template <int QT> __device__ __forceinline__ float row_dot_x(const uint8_t* s, int c0, int cs, int nch, const uint4* xb) {
    constexpr int SUB = qbw(QT) / 32, BB = qbb(QT);
    const uint4* q1 = xb;
    const uint4* q2 = xb + X1_COLS / 16;
    const float* dxs = reinterpret_cast<const float*>(xb + X1_COLS / 8);
    const float2* s16 = reinterpret_cast<const float2*>(dxs + X1_COLS / 32);
    float acc = 0.f;
    #pragma unroll 2
    for (int c = c0; c < nch; c += cs) {
        Dec d;
        dec32<QT>(s + (c / SUB) * BB, c % SUB, d);
        uint4 a0 = q1[2 * c], a1 = q1[2 * c + 1], b0 = q2[2 * c], b1 = q2[2 * c + 1];
        uint32_t x1[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w}, x2[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
        float2 sv = s16[c];
        float ss[2] = {sv.x, sv.y};
        acc += dot_staged<QT>(d, x1, x2, dxs[c], ss);
    }
    return acc;
}

// grid (ceil(ffn / (WARPS * rows_per_warp)), pairs picked), block 32 * WARPS: the block's rows in
// groups of 8 (gate rows 0-7 and up rows 8-15 of a group); thread (row m = lane % 16, slice s = 2
// warp + lane / 16) dots row m over chunks s, s + 8, ..; columns in tiles whose 16 rows fit R1_BYTES.
#define GATE_UP1_ARGS const Experts1 ex, const float* __restrict__ x, float* __restrict__ h, int ffn, int hidden, \
    int rows_per_warp, long long off_g, int qt_g, long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias
#define DOWN1_ARGS const Experts1 ex, const float* __restrict__ h, float* __restrict__ out, int k, int ffn, int hidden, \
    int rows_per_block, long long off_d, int qt_d, long long rb_d, int bias

// a probe's stand-in for a tile's dots (qmoe1_*_p): this thread reads every cs-th 16-byte word of
// its row's nbytes in shared memory from word c0 (no decode, no input): what is left of a kernel
// without its arithmetic (copies, input staging, barriers, reductions)
__device__ __forceinline__ float probe_row(const uint8_t* s, int nbytes, int c0, int cs) {
    const uint4* w = reinterpret_cast<const uint4*>((u64)s & ~15ull);
    uint32_t v = 0;
    for (int i = c0; i < nbytes / 16; i += cs) v ^= w[i].x ^ w[i].y ^ w[i].z ^ w[i].w;
    return (float)(v & 1u);
}

template <int PROBE, int R1 = R1_BYTES> __device__ __forceinline__ void gate_up1(GATE_UP1_ARGS) {
    __shared__ __align__(16) uint4 wbuf[R1 / 16];
    __shared__ __align__(16) uint4 xbuf[X1_WORDS];
    __shared__ float part[WARPS][16];
    int j = ex.pick[blockIdx.y], lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int m = lane & 15, s = 2 * warp + (lane >> 4), mat = m >> 3, tok[1] = {0};
    const uint8_t* e = reinterpret_cast<const uint8_t*>(ex.base[j]);
    int step = max(g_block[qt_g][0], g_block[qt_u][0]), kt = min(hidden, X1_COLS) / step * step;
    while (kt > step && 8 * (slot_odd(qt_g, kt) + slot_odd(qt_u, kt)) > R1) kt -= step;
    int sg = slot_odd(qt_g, kt), su = slot_odd(qt_u, kt), qt = mat ? qt_u : qt_g;
    uint8_t* wb = reinterpret_cast<uint8_t*>(wbuf);
    int q0 = blockIdx.x * WARPS * rows_per_warp, q1 = min(q0 + WARPS * rows_per_warp, ffn);
    for (int g0 = q0; g0 < q1; g0 += 8) {  // uniform over the block
        int ng = min(8, q1 - g0);
        float acc = 0.f;
        for (int k0 = 0; k0 < hidden; k0 += kt) {
            int n = min(kt, hidden - k0);
            __syncthreads();  // the previous tile is consumed
            const uint8_t* mine = wb;
            #pragma unroll
            for (int i = 0; i < 4; i++) {  // warp w copies rows 4 w .. 4 w + 3 of the 16
                int mm = 4 * warp + i, mt = mm >> 3, qq = mt ? qt_u : qt_g;
                const uint8_t* p = e + (mt ? off_u : off_g) + (long long)(g0 + (mm & 7)) * (mt ? rb_u : rb_g)
                                   + (long long)(k0 / g_block[qq][0]) * g_block[qq][1];
                uint8_t* d = wb + (mt ? 8 * sg + (mm & 7) * su : mm * sg);
                if ((mm & 7) < ng && PROBE < 2) stage_row(d, p, (n / g_block[qq][0]) * g_block[qq][1], lane);
            }
            {  // where this thread's row lies in its slot
                int qq = qt;
                const uint8_t* p = e + (mat ? off_u : off_g) + (long long)(g0 + (m & 7)) * (mat ? rb_u : rb_g)
                                   + (long long)(k0 / g_block[qq][0]) * g_block[qq][1];
                mine = wb + (mat ? 8 * sg + (m & 7) * su : m * sg) + ((u64)p & 15);
            }
            pdl_wait_trigger();  // the weights are in flight; x comes from an earlier grid
            stage<1, X1_COLS>(xbuf, x, 0, tok, 1, k0, n);
            cp_wait();
            __syncthreads();
            if ((m & 7) < ng) {
                float v = 0.f;
                if (PROBE) {
                    v = probe_row(mine, (n / g_block[qt][0]) * g_block[qt][1], s, 8);
                } else {
                    DISPATCH_R(v, qt, row_dot_x, mine, s, 8, n / 32, xbuf)
                }
                acc += v;
            }
        }
        acc += __shfl_xor_sync(0xffffffffu, acc, 16);
        if (lane < 16) part[warp][m] = acc;
        __syncthreads();
        int r = threadIdx.x;
        if (r < ng) {
            float vg = ((part[0][r] + part[1][r]) + part[2][r]) + part[3][r];
            float vu = ((part[0][8 + r] + part[1][8 + r]) + part[2][8 + r]) + part[3][8 + r];
            if (bias) {
                vg += reinterpret_cast<const float*>(e)[g0 + r];
                vu += reinterpret_cast<const float*>(e)[ffn + g0 + r];
            }
            h[(long long)j * ffn + g0 + r] = q_act(act, vg, vu);
        }
    }
}
extern "C" __global__ void __launch_bounds__(128, 6) qmoe1_gate_up(GATE_UP1_ARGS) {
    gate_up1<0>(ex, x, h, ffn, hidden, rows_per_warp, off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias);
}
extern "C" __global__ void __launch_bounds__(128, 6) qmoe1_gate_up_p(GATE_UP1_ARGS) {
    gate_up1<1>(ex, x, h, ffn, hidden, rows_per_warp, off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias);
}
extern "C" __global__ void __launch_bounds__(128, 6) qmoe1_gate_up_n(GATE_UP1_ARGS) {
    gate_up1<2>(ex, x, h, ffn, hidden, rows_per_warp, off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias);
}
// _w (gpu_quant.ONE_VARIANTS): tiles of R1W_BYTES, 4 blocks per SM (fewer, longer tiles for the widest types)
extern "C" __global__ void __launch_bounds__(128, 4) qmoe1_gate_up_w(GATE_UP1_ARGS) {
    gate_up1<0, R1W_BYTES>(ex, x, h, ffn, hidden, rows_per_warp, off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias);
}

// this thread's down row (its tile at s) . float32 h over chunks c0, c0 + cs, .. < nch
template <int QT> __device__ __forceinline__ float row_dot_h(const uint8_t* s, int c0, int cs, int nch, const float* hx) {
    constexpr int SUB = qbw(QT) / 32, BB = qbb(QT);
    float acc = 0.f;
    #pragma unroll 2
    for (int c = c0; c < nch; c += cs) {
        Dec d;
        dec32<QT>(s + (c / SUB) * BB, c % SUB, d);
        acc += dot_f<QT>(d, hx + 32 * c);
    }
    return acc;
}

// grid ceil(hidden / rows_per_block), block 32 * k (rows_per_block <= 32): warp j (expert j) takes
// its rows in groups of G (the most, a power of 2 <= 8, whose slots fit its D1R_BYTES / k); lane
// (row lane % G, slice lane / G) dots its row over every (32 / G)-th chunk.
template <int PROBE> __device__ __forceinline__ void down1(DOWN1_ARGS) {
    __shared__ __align__(16) uint4 wbuf[D1R_BYTES / 16];
    __shared__ float ys[MAXK][32];
    int j = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * rows_per_block;
    int rows = min(rows_per_block, hidden - r0), budget = (D1R_BYTES / k) & ~15;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(ex.base[j]);
    const float* bd = reinterpret_cast<const float*>(e) + 2 * ffn;
    const float* hj = h + (long long)j * ffn;
    uint8_t* my = reinterpret_cast<uint8_t*>(wbuf) + j * budget;
    int bw = g_block[qt_d][0], bb = g_block[qt_d][1], G = 8;
    while (G > 1 && (G > rows || G * slot_odd(qt_d, bw) > budget)) G >>= 1;
    int kt = ffn / bw * bw;
    while (kt > bw && G * slot_odd(qt_d, kt) > budget) kt -= bw;
    int sl = slot_odd(qt_d, kt), ri = lane % G, cs = 32 / G;
    for (int i0 = 0; i0 < rows; i0 += G) {
        int ng = min(G, rows - i0);
        float a = 0.f;
        for (int k0 = 0; k0 < ffn; k0 += kt) {
            int n = min(kt, ffn - k0);
            long long o = (long long)(k0 / bw) * bb;
            __syncwarp();  // the previous tile is consumed
            for (int i = 0; i < ng && PROBE < 2; i++)
                stage_row(my + i * sl, e + off_d + (long long)(r0 + i0 + i) * rb_d + o, (n / bw) * bb, lane);
            const uint8_t* mine = my + ri * sl + ((u64)(e + off_d + (long long)(r0 + i0 + ri) * rb_d + o) & 15);
            pdl_wait_trigger();  // the rows are in flight; h comes from qmoe1_gate_up
            cp_wait();
            __syncwarp();
            if (ri < ng) {
                float v = 0.f;
                if (PROBE) {
                    v = probe_row(mine, (n / bw) * bb, lane / G, cs);
                } else {
                    DISPATCH_R(v, qt_d, row_dot_h, mine, lane / G, cs, n / 32, hj + k0)
                }
                a += v;
            }
        }
        for (int o = G; o < 32; o <<= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        if (lane < ng) ys[j][i0 + lane] = bias ? a + bd[r0 + i0 + lane] : a;
    }
    down1_combine(ex, ys, k, rows, out + r0);
}
extern "C" __global__ void __launch_bounds__(1024) qmoe1_down_combine(DOWN1_ARGS) {
    down1<0>(ex, h, out, k, ffn, hidden, rows_per_block, off_d, qt_d, rb_d, bias);
}
extern "C" __global__ void __launch_bounds__(1024) qmoe1_down_combine_p(DOWN1_ARGS) {
    down1<1>(ex, h, out, k, ffn, hidden, rows_per_block, off_d, qt_d, rb_d, bias);
}
extern "C" __global__ void __launch_bounds__(1024) qmoe1_down_combine_n(DOWN1_ARGS) {
    down1<2>(ex, h, out, k, ffn, hidden, rows_per_block, off_d, qt_d, rb_d, bias);
}
