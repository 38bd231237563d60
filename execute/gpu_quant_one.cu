// gpu_quant.cu, part 4 of 4: the one-token expert kernels (qmoe1_gate_up, qmoe1_down_combine: weights
// read from global memory directly; their _s twins: rows copied to shared memory first).
struct Experts1 {  // gpu_kernels.cu's one-token pair table, passed by value
    unsigned long long base[MAXK];
    float weight[MAXK];
    int pick[MAXK];
};

// as moe1_gate_up: h[j, r] = act(gate_j x + bg_j, up_j x + bu_j) for j = pick[blockIdx.y], rows
// blockIdx.x WARPS rows_per_warp .. + WARPS rows_per_warp in groups of 2 WARPS (gemv1).
// grid (ceil(ffn / (WARPS * rows_per_warp)), pairs picked), block 32 * WARPS.
extern "C" __global__ void __launch_bounds__(128, 6) qmoe1_gate_up_s(const Experts1 ex, const float* __restrict__ x, float* __restrict__ h,
                                         int ffn, int hidden, int rows_per_warp, long long off_g, int qt_g,
                                         long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias) {
    __shared__ __align__(16) uint4 wbuf[W1_BYTES / 16];
    __shared__ __align__(16) uint4 xbuf[X1_WORDS];
    int j = ex.pick[blockIdx.y], warp = threadIdx.x >> 5;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(ex.base[j]);
    int q0 = blockIdx.x * WARPS * rows_per_warp, q1 = min(q0 + WARPS * rows_per_warp, ffn);
    for (int g0 = q0; g0 < q1; g0 += 2 * WARPS) {  // uniform over the block
        float res[4];
        gemv1(e + off_g + g0 * rb_g, rb_g, qt_g, e + off_u + g0 * rb_u, rb_u, qt_u, min(2 * WARPS, q1 - g0), hidden, x,
              wbuf, xbuf, res);
        int r = g0 + 2 * warp;
        if ((threadIdx.x & 31) == 0)
            for (int m = 0; m < 2; m++)
                if (r + m < q1) {
                    float bg = bias ? reinterpret_cast<const float*>(e)[r + m] : 0.f;
                    float bu = bias ? reinterpret_cast<const float*>(e)[ffn + r + m] : 0.f;
                    h[(long long)j * ffn + r + m] = q_act(act, res[m] + bg, res[2 + m] + bu);
                }
    }
}

// as moe1_down_combine: out[r] = sum_j weight[j] * (down_j h[j] + bd_j)[r], j in order. Warp j
// copies its expert's rows, 2 at a time, to its D1_BYTES / k bytes of shared memory (column tiles
// when they do not fit) and dots them with float32 h (dot_f), lanes over (row, chunk) pairs.
// grid ceil(hidden / rows_per_block), block 32 * k; rows_per_block <= 32.
// a warp's rows i, i + 1 (nm of them) of one expert's down projection: the lanes' partial sums
// reduced, (bias rows ``bd``, or none) added, written to ``y`` by lane 0
__device__ __forceinline__ void down1_rows(float* y, int i, int nm, float a0, float a1, const float* bd, int lane) {
    for (int o = 16; o; o >>= 1) {
        a0 += __shfl_xor_sync(0xffffffffu, a0, o);
        a1 += __shfl_xor_sync(0xffffffffu, a1, o);
    }
    if (lane == 0) {
        y[i] = bd ? a0 + bd[i] : a0;
        if (nm > 1) y[i + 1] = bd ? a1 + bd[i + 1] : a1;
    }
}

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

extern "C" __global__ void __launch_bounds__(1024) qmoe1_down_combine_s(const Experts1 ex, const float* __restrict__ h, float* __restrict__ out,
                                              int k, int ffn, int hidden, int rows_per_block, long long off_d,
                                              int qt_d, long long rb_d, int bias) {
    __shared__ __align__(16) uint4 wbuf[D1_BYTES / 16];
    __shared__ float ys[MAXK][32];
    int j = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * rows_per_block;
    int rows = min(rows_per_block, hidden - r0), budget = (D1_BYTES / k) & ~15;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(ex.base[j]);
    const float* bd = reinterpret_cast<const float*>(e) + 2 * ffn;
    const float* hj = h + (long long)j * ffn;
    uint8_t* my = reinterpret_cast<uint8_t*>(wbuf) + j * budget;
    int bw = g_block[qt_d][0], bb = g_block[qt_d][1];
    int kt = fit_cols(ffn, ffn, bw, qt_d, -1, 2, budget), sl = slot_bytes(qt_d, kt);
    for (int i = 0; i < rows; i += 2) {
        int nm = min(2, rows - i);
        const uint8_t* row = e + off_d + (long long)(r0 + i) * rb_d;
        float a0 = 0.f, a1 = 0.f;
        for (int k0 = 0; k0 < ffn; k0 += kt) {
            int n = min(kt, ffn - k0), nbytes = (n / bw) * bb;
            long long o = (long long)(k0 / bw) * bb;
            __syncwarp();  // the previous tile is consumed
            const uint8_t* s0 = stage_row(my, row + o, nbytes, lane);
            const uint8_t* s1 = nm > 1 ? stage_row(my + sl, row + rb_d + o, nbytes, lane) : s0;
            cp_wait();
            __syncwarp();
            float2 v = {0.f, 0.f};
            DISPATCH_R(v, qt_d, down1_tile, s0, s1, nm, hj + k0, n / 32)
            a0 += v.x;
            a1 += v.y;
        }
        down1_rows(ys[j], i, nm, a0, a1, bias ? bd + r0 : nullptr, lane);
    }
    down1_combine(ex, ys, k, rows, out + r0);
}

// ---------------------------------------------------------------------------------------------
// One-token kernels, direct (qmoe1_gate_up, qmoe1_down_combine; the arguments and grids of their
// staged _s twins above): the lanes decode their chunks straight from global memory (a warp's
// rows first prefetched to L2 while the input is staged), no weight copies in shared memory and
// no wait on them; the type is dispatched once at the kernel's entry to a body compiled for it
// (no calls inside: gate and up of one type; other pairs of types take the per-matrix calls).
__device__ __forceinline__ void prefetch_rows(const uint8_t* p, long long rb, int nm, long long nbytes, int lane) {
    for (int m = 0; m < nm; m++)
        for (long long o = 128 * lane; o < nbytes + 128; o += 32 * 128) PREFETCH_L2(p + m * rb + min(o, nbytes - 1));
}

// acc[m] += row m . staged input over the tile's nch chunks (lanes lane, lane + 32, ..); rows pg,
// pg + rbg (gate), pu, pu + rbu (up); nm rows of each (1 or 2)
template <int QT> __device__ __forceinline__ void rows4_g(const uint8_t* pg, long long rbg, const uint8_t* pu, long long rbu,
                                                          int nm, const uint4* xb, int nch, float* acc) {
    constexpr int SUB = qbw(QT) / 32, BB = qbb(QT);
    const uint4* q1 = xb;
    const uint4* q2 = xb + X1_COLS / 16;
    const float* dxs = reinterpret_cast<const float*>(xb + X1_COLS / 8);
    const float2* s16 = reinterpret_cast<const float2*>(dxs + X1_COLS / 32);
    const uint8_t* p[4] = {pg, pu, pg + rbg, pu + rbu};
    #pragma unroll 1
    for (int c = threadIdx.x & 31; c < nch; c += 32) {
        Dec d[4];
        long long o = (long long)(c / SUB) * BB;
        #pragma unroll
        for (int m = 0; m < 4; m++)
            if (m < 2 || nm > 1) dec32<QT>(p[m] + o, c % SUB, d[m]);
        uint4 a0 = q1[2 * c], a1 = q1[2 * c + 1], b0 = q2[2 * c], b1 = q2[2 * c + 1];
        uint32_t x1[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w}, x2[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
        float2 sv = s16[c];
        float ss[2] = {sv.x, sv.y}, ds = dxs[c];
        #pragma unroll
        for (int m = 0; m < 4; m++)
            if (m < 2 || nm > 1) acc[m] += dot_staged<QT>(d[m], x1, x2, ds, ss);
    }
}

// the rows' sums of one group of 2 WARPS rows: acc (gate row r, up row r, gate r + 1, up r + 1),
// QT >= 0: gate and up of type QT; QT < 0: any types (a call per matrix)
template <int QT> __device__ __forceinline__ void gate_up1_g(const uint8_t* pg, long long rbg, int qg, const uint8_t* pu,
                                                             long long rbu, int qu, int nm, int hidden, const float* __restrict__ x,
                                                             uint4* xbuf, float* acc) {
    int tok[1] = {0};
    for (int k0 = 0; k0 < hidden; k0 += X1_COLS) {
        int n = min(X1_COLS, hidden - k0);
        __syncthreads();
        stage<1, X1_COLS>(xbuf, x, 0, tok, 1, k0, n);
        __syncthreads();
        if (nm) {
            const uint8_t* a = pg + (long long)(k0 / g_block[qg][0]) * g_block[qg][1];
            const uint8_t* b = pu + (long long)(k0 / g_block[qu][0]) * g_block[qu][1];
            if (QT >= 0) {
                rows4_g<(QT < 0 ? 8 : QT)>(a, rbg, b, rbu, nm, xbuf, n / 32, acc);
            } else {
                float2 v = {0.f, 0.f}, u = {0.f, 0.f};
                DISPATCH_R(v, qg, rows1_tile, a, a + rbg, nm, xbuf, 0, n / 32)
                DISPATCH_R(u, qu, rows1_tile, b, b + rbu, nm, xbuf, 0, n / 32)
                acc[0] += v.x; acc[2] += v.y; acc[1] += u.x; acc[3] += u.y;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(128, 4) qmoe1_gate_up(const Experts1 ex, const float* __restrict__ x, float* __restrict__ h,
                                         int ffn, int hidden, int rows_per_warp, long long off_g, int qt_g,
                                         long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias) {
    __shared__ __align__(16) uint4 xbuf[X1_WORDS];
    int j = ex.pick[blockIdx.y], warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(ex.base[j]);
    int q0 = blockIdx.x * WARPS * rows_per_warp, q1 = min(q0 + WARPS * rows_per_warp, ffn);
    long long bg = (long long)(hidden / g_block[qt_g][0]) * g_block[qt_g][1], bu = (long long)(hidden / g_block[qt_u][0]) * g_block[qt_u][1];
    for (int g0 = q0; g0 < q1; g0 += 2 * WARPS) {  // uniform over the block
        int r = g0 + 2 * warp, nm = max(0, min(2, q1 - r));
        const uint8_t *pg = e + off_g + (long long)r * rb_g, *pu = e + off_u + (long long)r * rb_u;
        prefetch_rows(pg, rb_g, nm, bg, lane);
        prefetch_rows(pu, rb_u, nm, bu, lane);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (qt_g == qt_u) {
            DISPATCH(qt_g, gate_up1_g, pg, rb_g, qt_g, pu, rb_u, qt_u, nm, hidden, x, xbuf, acc)
        } else {
            gate_up1_g<-1>(pg, rb_g, qt_g, pu, rb_u, qt_u, nm, hidden, x, xbuf, acc);
        }
        for (int m = 0; m < 4; m++)
            for (int o = 16; o; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
        if (lane == 0)
            for (int m = 0; m < nm; m++) {
                float vg = bias ? reinterpret_cast<const float*>(e)[r + m] : 0.f;
                float vu = bias ? reinterpret_cast<const float*>(e)[ffn + r + m] : 0.f;
                h[(long long)j * ffn + r + m] = q_act(act, acc[2 * m] + vg, acc[2 * m + 1] + vu);
            }
    }
}

// one warp's rows i, i + 1 (nm of them) of its expert's down projection into ys (a body per type)
template <int QT> __device__ __forceinline__ void down1_g(const uint8_t* row, long long rb, int nm, const float* hj, int ffn,
                                                          float* a) {
    constexpr int SUB = qbw(QT) / 32, BB = qbb(QT);
    int nch = ffn / 32;
    #pragma unroll 2
    for (int t = threadIdx.x & 31; t < nm * nch; t += 32) {
        int m = t >= nch, c = t - m * nch;
        Dec d;
        dec32<QT>(row + m * rb + (long long)(c / SUB) * BB, c % SUB, d);
        float v = dot_f<QT>(d, hj + 32 * c);
        a[m] += v;
    }
}

extern "C" __global__ void __launch_bounds__(1024) qmoe1_down_combine(const Experts1 ex, const float* __restrict__ h, float* __restrict__ out,
                                              int k, int ffn, int hidden, int rows_per_block, long long off_d,
                                              int qt_d, long long rb_d, int bias) {
    __shared__ float ys[MAXK][32];
    int j = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * rows_per_block;
    int rows = min(rows_per_block, hidden - r0);
    const uint8_t* e = reinterpret_cast<const uint8_t*>(ex.base[j]);
    const float* bd = reinterpret_cast<const float*>(e) + 2 * ffn;
    const float* hj = h + (long long)j * ffn;
    for (int i = 0; i < rows; i += 2) {
        int nm = min(2, rows - i);
        float a[2] = {0.f, 0.f};
        DISPATCH(qt_d, down1_g, e + off_d + (long long)(r0 + i) * rb_d, rb_d, nm, hj, ffn, a)
        down1_rows(ys[j], i, nm, a[0], a[1], bias ? bd + r0 : nullptr, lane);
    }
    down1_combine(ex, ys, k, rows, out + r0);
}
