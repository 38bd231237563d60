// gpu_quant.cu, part 3 of 4: the batched expert kernels on tensor cores (qmoe_gate_up, qmoe_down).
// ---------------------------------------------------------------------------------------------
// Batched expert kernels (qmoe_gate_up, qmoe_down) on tensor cores. The weights of a K tile of
// KB columns are decoded once per pass of up to NB tokens into shared memory as exact f16 quants
// (pairs in k order) beside their scales and offsets per 16 (a0, a1, b0, b1); the tokens' inputs
// are staged as two f16 halves, hi = f16(x s) and lo = f16(x s - hi), s = 2^-e per 32 values (|x s|
// < 1, so lo keeps x to ~22 bits), beside 1 / s and the sums of x per 16. mma.m16n8k16 (f32
// accumulation) multiplies 16 rows by 8 tokens per 16 weights, hi and lo into one accumulator, and
// each 32-weight chunk's two sums are scaled once: acc += (a0 C0 + a1 C1) / s + b0 S0 + b1 S1. A
// block covers 16 MT rows (gate_up: 8 MT rows of gate and the same of up, an m-tile = 8 of each,
// so a lane holds a row's gate and up sums together); the grid's other blocks return. Warp w
// computes n-tiles w, w + 4, .. (8 tokens each) of every m-tile. qmoe_gate_up / qmoe_down take
// (MT, NB) = (QMOE_MT, QMOE_NB); a tile's chunks are unrolled, so a warp's mma chains interleave
// (1.05-1.11x the rolled loop at 64 tokens, every type: docs/perf/gpu_quant_h200).
#define KB 128
#define XROW (KB + 4)  // words per staged token: KB / 2 hi and lo pair words per 32, padded (banks)
#ifndef QMOE_MT  // (-D: host checks of the other tilings)
#define QMOE_MT 2
#define QMOE_NB 64
#endif

#ifdef __CUDA_ARCH__
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, const uint32_t* b) {  // c += A (16 x 16 f16) B (16 x 8 f16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ uint32_t f2h2(float lo, float hi) {  // f16 pair (lo in the low half), round to nearest
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ uint32_t q2h2(uint32_t w, int i) {  // int8 bytes 2 i, 2 i + 1 of w as an f16 pair (exact)
    uint32_t u = __byte_perm(w ^ 0x80808080u, 0x64646464u, i ? 0x4342u : 0x4140u), r;  // 1024 + q + 128
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(u), "r"(0x64806480u));
    return r;
}
#else
void mma16816(float* c, const uint32_t* a, const uint32_t* b);  // the host emulation's (tests)
uint32_t f2h(float f);
inline uint32_t f2h2(float lo, float hi) { return f2h(lo) | (f2h(hi) << 16); }
inline uint32_t q2h2(uint32_t w, int i) {
    return f2h((float)(int8_t)(w >> (16 * i))) | (f2h((float)(int8_t)(w >> (16 * i + 8))) << 16);
}
#endif
__device__ __forceinline__ float h2lo(uint32_t p) { return h2f(p & 0xffffu); }
__device__ __forceinline__ float h2hi(uint32_t p) { return h2f(p >> 16); }

// decodes chunk c of row m (pointer p, type qt) into the A tile record (16 pair words, a0 a1 b0 b1)
template <int QT> __device__ __noinline__ void dec_rec(const uint8_t* row, int c, uint32_t* rec) {
    constexpr int SUB = qbw(QT) / 32, BB = qbb(QT);
    Dec d;
    dec32<QT>(row + (long long)(c / SUB) * BB, c % SUB, d);
    #pragma unroll
    for (int k = 0; k < 8; k++) {
        rec[2 * k] = q2h2(d.q[k], 0);
        rec[2 * k + 1] = q2h2(d.q[k], 1);
    }
    float* f = reinterpret_cast<float*>(rec + 16);
    f[0] = d.a0; f[1] = d.a1;
    f[2] = qmin(QT) ? d.b0 : 0.f; f[3] = qmin(QT) ? d.b1 : 0.f;
}

// stages the inputs of tokens t < nt (rows xr[t] of x, ldx apart; columns k0 .. k0 + n) for the mma:
// 8 lanes per 32 values, every load of the thread issued before the first use
template <int NB> __device__ __forceinline__ void stage_h(uint32_t* xs, float* dsc, float* s16, const float* __restrict__ x,
                                                         long long ldx, const int* xr, int nt, int k0, int n) {
    constexpr int IT = NB * (KB / 32) / (4 * WARPS);  // chunks per warp, 4 at a time
    int lane = threadIdx.x & 31, l8 = lane & 7;
    float v[IT][4];
    #pragma unroll
    for (int it = 0; it < IT; it++) {
        int ch = (it * WARPS + (threadIdx.x >> 5)) * 4 + (lane >> 3), t = ch / (KB / 32), c = ch % (KB / 32);
        for (int i = 0; i < 4; i++) v[it][i] = 0.f;
        if (t < nt && 32 * c < n) {
            float4 f = *reinterpret_cast<const float4*>(x + (long long)xr[t] * ldx + k0 + 32 * c + 4 * l8);
            v[it][0] = f.x; v[it][1] = f.y; v[it][2] = f.z; v[it][3] = f.w;
        }
    }
    #pragma unroll
    for (int it = 0; it < IT; it++) {
        int ch = (it * WARPS + (threadIdx.x >> 5)) * 4 + (lane >> 3), t = ch / (KB / 32), c = ch % (KB / 32);
        float m = fmaxf(fmaxf(fabsf(v[it][0]), fabsf(v[it][1])), fmaxf(fabsf(v[it][2]), fabsf(v[it][3])));
        for (int o = 1; o < 8; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        // s = 2^-e with m s in [0.5, 1) (m < 2^-120 or inf/nan: s = 1)
        int e = (int)((__float_as_int(m) >> 23) & 255) - 126;
        if (e < -120 || e > 120) e = 0;
        float s = __int_as_float((127 - e) << 23), hi[4], lo[4];
        for (int i = 0; i < 4; i++) {
            hi[i] = h2lo(f2h2(v[it][i] * s, 0.f));
            lo[i] = v[it][i] * s - hi[i];
        }
        float sum = (v[it][0] + v[it][1]) + (v[it][2] + v[it][3]);
        for (int o = 1; o < 4; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        uint32_t* w = xs + t * XROW + 32 * c;  // lane l8 holds k pairs 2 l8, 2 l8 + 1 of the chunk
        w[2 * l8] = f2h2(hi[0], hi[1]);
        w[2 * l8 + 1] = f2h2(hi[2], hi[3]);
        w[16 + 2 * l8] = f2h2(lo[0], lo[1]);
        w[16 + 2 * l8 + 1] = f2h2(lo[2], lo[3]);
        if (l8 == 0) dsc[t * (KB / 32) + c] = __int_as_float((127 + e) << 23);
        if ((l8 & 3) == 0) s16[t * (KB / 16) + 2 * c + (l8 >> 2)] = sum;
    }
}

// Rows of a block: gate_up (two matrices): row m < 16 MT = m-tile m / 16, within it m % 16 < 8 the
// gate row r0 + 8 (m / 16) + m % 16, else the up row r0 + 8 (m / 16) + m % 16 - 8; down: row r0 + m.
struct Rows {
    const uint8_t* p[2];  // first row of the block in each matrix
    long long rb[2];
    int qt[2], two, nrows;  // rows of each matrix in the block (<= 8 MT with two, else <= 16 MT)
};

// acc[mt] += chunk c of the tile (rows of every m-tile) . tokens t0 .. t0 + 7 (this lane's fragments)
template <int MT> __device__ __forceinline__ void chunk_mma(const uint32_t* As, const uint32_t* xs, const float* dsc,
                                                            const float* s16, int t0, int c, int g, int q, float (*acc)[4]) {
    constexpr int MB = 16 * MT;
    uint32_t bh[2][2], bl[2][2];
    const uint32_t* xw = xs + (t0 + g) * XROW + 32 * c + q;
    for (int h = 0; h < 2; h++) {
        bh[h][0] = xw[8 * h]; bh[h][1] = xw[8 * h + 4];
        bl[h][0] = xw[16 + 8 * h]; bl[h][1] = xw[16 + 8 * h + 4];
    }
    int tn = t0 + 2 * q;  // this lane's two tokens (columns of C)
    float d0 = dsc[tn * (KB / 32) + c], d1 = dsc[(tn + 1) * (KB / 32) + c];
    float2 s0 = reinterpret_cast<const float2*>(s16)[tn * (KB / 32) + c];
    float2 s1 = reinterpret_cast<const float2*>(s16)[(tn + 1) * (KB / 32) + c];
    #pragma unroll
    for (int mt = 0; mt < MT; mt++) {
        const uint32_t* ra = As + (c * MB + 16 * mt + g) * 20;  // row g; row g + 8 at + 160
        float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
        uint32_t a[4];
        a[0] = ra[q]; a[1] = ra[160 + q]; a[2] = ra[q + 4]; a[3] = ra[164 + q];
        mma16816(c0, a, bh[0]);
        mma16816(c0, a, bl[0]);
        a[0] = ra[q + 8]; a[1] = ra[168 + q]; a[2] = ra[q + 12]; a[3] = ra[172 + q];
        mma16816(c1, a, bh[1]);
        mma16816(c1, a, bl[1]);
        float4 sa = reinterpret_cast<const float4*>(ra + 16)[0], sb = reinterpret_cast<const float4*>(ra + 176)[0];
        float* ac = acc[mt];
        ac[0] += d0 * (sa.x * c0[0] + sa.y * c1[0]) + sa.z * s0.x + sa.w * s0.y;
        ac[1] += d1 * (sa.x * c0[1] + sa.y * c1[1]) + sa.z * s1.x + sa.w * s1.y;
        ac[2] += d0 * (sb.x * c0[2] + sb.y * c1[2]) + sb.z * s0.x + sb.w * s0.y;
        ac[3] += d1 * (sb.x * c0[3] + sb.y * c1[3]) + sb.z * s1.x + sb.w * s1.y;
    }
}

// acc[j][mt][i]: n-tile w + 4 j of every m-tile, for the pass's nt tokens (xr: their input rows); K = cols
template <int MT, int NB>
__device__ void mma_pass(const Rows& R, int cols, const float* __restrict__ x, long long ldx, const int* xr, int nt,
                         uint32_t* As, uint32_t* xs, float* dsc, float* s16, float (*acc)[MT][4]) {
    constexpr int MB = 16 * MT, NJ = NB / (8 * WARPS);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    for (int mat = 0; mat <= R.two; mat++) {  // the block's rows towards L2: the tiles' decodes then read L2
        long long nbytes = R.nrows * R.rb[mat];
        for (long long o = 128 * threadIdx.x; o < nbytes; o += 128 * blockDim.x) PREFETCH_L2(R.p[mat] + o);
    }
    for (int j = 0; j < NJ; j++)
        for (int mt = 0; mt < MT; mt++)
            for (int i = 0; i < 4; i++) acc[j][mt][i] = 0.f;
    for (int k0 = 0; k0 < cols; k0 += KB) {
        int n = min(KB, cols - k0);
        __syncthreads();  // the previous tile is consumed
        for (int task = threadIdx.x; task < MB * (KB / 32); task += blockDim.x) {
            int m = task / (KB / 32), c = task % (KB / 32), mat = 0, r = m;  // a row's chunks on adjacent lanes
            if (R.two) { mat = (m & 15) >= 8; r = 8 * (m >> 4) + (m & 7); }
            uint32_t* rec = As + (c * MB + m) * 20;
            if (r < R.nrows && 32 * c < n) {
                const uint8_t* row = R.p[mat] + r * R.rb[mat];
                int cc = k0 / 32 + c;
                DISPATCH(R.qt[mat], dec_rec, row, cc, rec)
            } else {
                for (int i = 0; i < 20; i++) rec[i] = 0u;
            }
        }
        stage_h<NB>(xs, dsc, s16, x, ldx, xr, nt, k0, n);
        __syncthreads();
        #pragma unroll
        for (int j = 0; j < NJ; j++) {
            int t0 = 8 * (warp + WARPS * j);
            if (t0 >= nt) continue;
            #pragma unroll
            for (int c = 0; c < KB / 32; c++)  // unrolled: the chunks' shared loads and mma chains interleave
                if (c < n / 32) chunk_mma<MT>(As, xs, dsc, s16, t0, c, g, q, acc[j]);
        }
    }
}

// as moe_gate_up: h[pair, r] = act(gate_e x[xrow[pair]] + bg_e, up_e x[xrow[pair]] + bu_e).
// grid (ceil(ffn / (WARPS * rows_per_warp)), groups), block 32 * WARPS: the block whose rows hold
// row s (s a multiple of 8 MT) computes rows s .. s + 8 MT - 1 (mma_pass), the others return.
#define GATE_UP_ARGS const unsigned long long* __restrict__ base, const int* __restrict__ gstart, const int* __restrict__ order, \
    const int* __restrict__ xrow, const float* __restrict__ x, long long ldx, float* __restrict__ h, int ffn, int hidden,        \
    int rows_per_warp, long long off_g, int qt_g, long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias
#define DOWN_ARGS const unsigned long long* __restrict__ base, const int* __restrict__ gstart, const int* __restrict__ order, \
    const float* __restrict__ h, float* __restrict__ y, int ffn, int hidden, int rows_per_warp, long long off_d, int qt_d,   \
    long long rb_d, int bias
#define SMEM_MMA(MT, NB)                                        \
    __shared__ __align__(16) uint32_t As[(KB / 32) * 16 * MT * 20]; \
    __shared__ __align__(16) uint32_t xs[NB * XROW];            \
    __shared__ __align__(16) float dsc[NB * KB / 32], s16[NB * KB / 16];

template <int MT, int NB> __device__ void gate_up_mma(GATE_UP_ARGS, uint32_t* As, uint32_t* xs, float* dsc, float* s16) {
    constexpr int RB = 8 * MT, NJ = NB / (8 * WARPS);
    int g = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rl = WARPS * rows_per_warp;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(base[g]);
    for (int s = (blockIdx.x * rl + RB - 1) / RB * RB; s < (blockIdx.x + 1) * rl && s < ffn; s += RB) {
        Rows R = {{e + off_g + s * rb_g, e + off_u + s * rb_u}, {rb_g, rb_u}, {qt_g, qt_u}, 1, min(RB, ffn - s)};
        for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += NB) {
            int nt = min(NB, gstart[g + 1] - p0), xr[NB];
            for (int t = 0; t < NB; t++) xr[t] = xrow[order[p0 + (t < nt ? t : 0)]];
            float acc[NJ][MT][4];
            mma_pass<MT, NB>(R, hidden, x, ldx, xr, nt, As, xs, dsc, s16, acc);
            for (int j = 0; j < NJ; j++) {
                int tn = 8 * (warp + WARPS * j) + 2 * (lane & 3);
                for (int mt = 0; mt < MT; mt++) {
                    int r = s + 8 * mt + (lane >> 2);
                    if (r >= ffn) continue;
                    float bg = bias ? reinterpret_cast<const float*>(e)[r] : 0.f, bu = bias ? reinterpret_cast<const float*>(e)[ffn + r] : 0.f;
                    for (int i = 0; i < 2; i++)
                        if (tn + i < nt) h[(long long)order[p0 + tn + i] * ffn + r] = q_act(act, acc[j][mt][i] + bg, acc[j][mt][2 + i] + bu);
                }
            }
        }
    }
}

// as moe_down: y[pair, r] = down_e h[pair] + bd_e. grid (ceil(hidden / (WARPS * rows_per_warp)), groups):
// the block whose rows hold row s (a multiple of 16 MT) computes rows s .. s + 16 MT - 1, the others return.
template <int MT, int NB> __device__ void down_mma(DOWN_ARGS, uint32_t* As, uint32_t* xs, float* dsc, float* s16) {
    constexpr int RB = 16 * MT, NJ = NB / (8 * WARPS);
    int g = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rl = WARPS * rows_per_warp;
    const float* bd = reinterpret_cast<const float*>(base[g]) + 2 * ffn;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(base[g]) + off_d;
    for (int s = (blockIdx.x * rl + RB - 1) / RB * RB; s < (blockIdx.x + 1) * rl && s < hidden; s += RB) {
        Rows R = {{e + s * rb_d, e + s * rb_d}, {rb_d, rb_d}, {qt_d, qt_d}, 0, min(RB, hidden - s)};
        for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += NB) {
            int nt = min(NB, gstart[g + 1] - p0), xr[NB];
            for (int t = 0; t < NB; t++) xr[t] = order[p0 + (t < nt ? t : 0)];
            float acc[NJ][MT][4];
            mma_pass<MT, NB>(R, ffn, h, ffn, xr, nt, As, xs, dsc, s16, acc);
            for (int j = 0; j < NJ; j++) {
                int tn = 8 * (warp + WARPS * j) + 2 * (lane & 3);
                for (int mt = 0; mt < MT; mt++)
                    for (int hf = 0; hf < 2; hf++) {
                        int r = s + 16 * mt + (lane >> 2) + 8 * hf;
                        if (r >= hidden) continue;
                        for (int i = 0; i < 2; i++)
                            if (tn + i < nt) y[(long long)xr[tn + i] * hidden + r] = acc[j][mt][2 * hf + i] + (bias ? bd[r] : 0.f);
                    }
            }
        }
    }
}

#define QMOE_MMA(SUFFIX, MT, NB)                                                                                   \
    extern "C" __global__ void __launch_bounds__(128) qmoe_gate_up##SUFFIX(GATE_UP_ARGS) {                         \
        SMEM_MMA(MT, NB)                                                                                           \
        gate_up_mma<MT, NB>(base, gstart, order, xrow, x, ldx, h, ffn, hidden, rows_per_warp, off_g, qt_g, rb_g,   \
                            off_u, qt_u, rb_u, act, bias, As, xs, dsc, s16);                                       \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(128) qmoe_down##SUFFIX(DOWN_ARGS) {                               \
        SMEM_MMA(MT, NB)                                                                                           \
        down_mma<MT, NB>(base, gstart, order, h, y, ffn, hidden, rows_per_warp, off_d, qt_d, rb_d, bias, As, xs,       \
                         dsc, s16);                                                                                \
    }
QMOE_MMA(, QMOE_MT, QMOE_NB)

