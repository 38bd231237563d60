// gpu_quant.cu, part 5 of 6: batched expert kernels on int8 tensor cores (the _q8 variants of
// qmoe_gate_up / qmoe_down: _q8, _q8m2, _q8m1 at 4, 2, 1 m-tiles; _q8s2, _q8s1 at 2, 1 with the
// tile's weight bytes copied to shared memory beside the inputs before the decode) and the input
// pre-pass they read (qx8).
// ---------------------------------------------------------------------------------------------
// The inputs are converted once per launch (qx8), not once per block: every row of x (gate/up) or
// h (down) as the two int8 levels of stage() (x = dxs (256 q1 + q2), dxs = max|x| / (127 * 256)
// per 32 values) beside the staged values' sums per 16, in four planes of an R x C matrix:
// q1 [R][C] bytes | q2 [R][C] bytes | dxs [R][C / 32] floats | s16 [R][C / 16] floats.
// A block then copies its pass's input tiles (QKB columns of up to QNB tokens) to shared memory by
// cp.async while it decodes its weight rows' chunks there as int8 quants (dec32: w = a q + b per
// 16), and multiplies both levels on tensor cores (mma.m16n8k32 / m16n8k16 .s8, int32 sums: exact),
// each 16 weights' sums scaled once: acc += dxs (a0 (256 C1 + C2)_lo + a1 (256 C1 + C2)_hi) + b0 S0
// + b1 S1, the arithmetic of dot_staged (relative error of a product ~2e-5, bound 2e-4). Rows of a
// block as mma_pass (Rows): gate_up 8 MT rows of gate and the same of up (an m-tile = 8 of each, so
// a lane holds a row's gate and up sums together), down 16 MT rows. Warp w computes tokens
// 16 w .. 16 w + 15 (two n-tiles) of every m-tile.
#define QKB 128             // columns per tile
#define QROW (QKB + 16)     // bytes per staged row (36 words: a fragment's 32 lanes on distinct banks)
#define QNB 64              // tokens per pass
#define WSLOT 256           // bytes per weight row of a tile copied to shared memory (_q8s*): the 16-byte
                            // words covering the blocks of QKB columns, at most 240 (Q6_K)

#ifdef __CUDA_ARCH__
__device__ __forceinline__ void mma_s8k16(int* c, uint32_t a0, uint32_t a1, uint32_t b) {  // c += A (16 x 16) B (16 x 8)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3]) : "r"(a0), "r"(a1), "r"(b));
}
__device__ __forceinline__ void mma_s8k32(int* c, const uint32_t* a, uint32_t b0, uint32_t b1) {  // c += A (16 x 32) B (32 x 8)
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#else
void mma_s8k16(int* c, uint32_t a0, uint32_t a1, uint32_t b);  // the host emulation's (tests)
inline void mma_s8k32(int* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    mma_s8k16(c, a[0], a[1], b0);
    mma_s8k16(c, a[2], a[3], b1);
}
#endif

__device__ __forceinline__ void cp4(void* s, const void* g) {  // 4 bytes global -> shared, asynchronously
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"((unsigned)__cvta_generic_to_shared(s)), "l"(g));
#else
    __builtin_memcpy(s, g, 4);
#endif
}

// grid ceil(R C / 32 / 16), block 128: rows of x (ld ldx, C columns, C a multiple of 32) into the
// planes at out (8 lanes per 32 values)
extern "C" __global__ void qx8(const float* __restrict__ x, long long ldx, int R, int C, uint8_t* __restrict__ out) {
    pdl_wait_trigger();  // (a programmatic launch: x comes from the grid before)
    int lane = threadIdx.x & 31, l8 = lane & 7, nch = C / 32;
    long long ch = (long long)blockIdx.x * 16 + (threadIdx.x >> 3), total = (long long)R * nch;
    int r = (int)(ch / nch), c = (int)(ch % nch);
    bool on = ch < total;
    float v[4] = {0.f, 0.f, 0.f, 0.f}, ds, s;
    if (on) {
        float4 f = *reinterpret_cast<const float4*>(x + r * ldx + 32 * c + 4 * l8);
        v[0] = f.x; v[1] = f.y; v[2] = f.z; v[3] = f.w;
    }
    uint32_t w1, w2;
    quant32(v, w1, w2, ds, s);
    if (on) {
        long long rc = (long long)R * C;
        reinterpret_cast<uint32_t*>(out)[(r * (long long)C + 32 * c) / 4 + l8] = w1;
        reinterpret_cast<uint32_t*>(out + rc)[(r * (long long)C + 32 * c) / 4 + l8] = w2;
        float* dxs = reinterpret_cast<float*>(out + 2 * rc);
        if (l8 == 0) dxs[ch] = ds;
        if ((l8 & 3) == 0) (dxs + total)[2 * ch + (l8 >> 2)] = s;
    }
}

// decodes chunk c of row (type QT) into the tile: its 32 quants at q, (a0, a1, b0, b1) at sc
template <int QT> __device__ __noinline__ void dec_q8(const uint8_t* row, int c, uint32_t* q, float4* sc) {
    constexpr int SUB = qbw(QT) / 32, BB = qbb(QT);
    Dec d;
    dec32<QT>(row + (long long)(c / SUB) * BB, c % SUB, d);
    reinterpret_cast<uint4*>(q)[0] = {d.q[0], d.q[1], d.q[2], d.q[3]};
    reinterpret_cast<uint4*>(q)[1] = {d.q[4], d.q[5], d.q[6], d.q[7]};
    *sc = {d.a0, d.a1, qmin(QT) ? d.b0 : 0.f, qmin(QT) ? d.b1 : 0.f};
}

struct SmemQ8 {  // a block's tiles: weights' quants and scales, the pass's inputs (two levels), their scales, rows
    uint8_t* aq;   // [16 MT][QROW]
    float4* asc;   // [QKB / 32][16 MT]
    uint8_t* xq;   // [2][QNB][QROW]
    float* xd;     // [QNB][QKB / 32]
    float* xs;     // [QNB][QKB / 16]
    int* xr;       // [QNB]: the input row of each token of the pass
    uint8_t* wr;   // [16 MT][WSLOT]: the tile's weight bytes (RAW)
};

// acc[i][j][.] += m-tile m0 + i (of the tile's MB rows: quants aq, scales asc) . tokens t0 + 8 j (this lane's
// fragments; inputs xq, their scales xd and sums xs) over the tile's nch chunks; SPLIT: a scale per 16,
// OFFS: offsets. A chunk's two levels are summed in int32 by the tensor cores (the first level's sums
// times 256 as the second's accumulator: |C| <= 32 * 128 * 127 each, exact), then scaled in float32
// once. (The flags as template arguments, a function per case, gained 0-8% at 64 tokens x 8 experts
// on the H200 and doubled the module's compile: docs/perf/gpu_quant_int8_h200.)
template <int MB, int MW>
__device__ __forceinline__ void q8_tile(bool SPLIT, bool OFFS, const uint8_t* xq, const float* xd, const float* xs,
                                        const uint8_t* aq, const float4* asc, int nch, int t0, int m0, float (*acc)[2][4]) {
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    #pragma unroll
    for (int c = 0; c < QKB / 32; c++) {
        if (c >= nch) break;
        uint32_t b[2][2][2];  // [n-tile j][level][k half]
        float dx[2][2], s0[2][2] = {{0.f, 0.f}, {0.f, 0.f}}, s1[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
        #pragma unroll
        for (int j = 0; j < 2; j++) {
            int tb = t0 + 8 * j;
            #pragma unroll
            for (int lv = 0; lv < 2; lv++) {
                const uint32_t* xw = reinterpret_cast<const uint32_t*>(xq + (lv * QNB + tb + g) * QROW + 32 * c);
                b[j][lv][0] = xw[q];
                b[j][lv][1] = xw[4 + q];
            }
            #pragma unroll
            for (int i = 0; i < 2; i++) {
                int t = tb + 2 * q + i;
                dx[j][i] = xd[t * (QKB / 32) + c];
                if (OFFS) {
                    s0[j][i] = xs[2 * (t * (QKB / 32) + c)];
                    s1[j][i] = xs[2 * (t * (QKB / 32) + c) + 1];
                }
            }
        }
        #pragma unroll
        for (int i = 0; i < MW; i++) {
            int mt = m0 + i;
            const uint32_t* ra = reinterpret_cast<const uint32_t*>(aq + (16 * mt + g) * QROW + 32 * c);
            const uint32_t* rb = ra + 8 * QROW / 4;
            uint32_t a[4] = {ra[q], rb[q], ra[4 + q], rb[4 + q]};
            float4 sa = asc[c * MB + 16 * mt + g], sb = asc[c * MB + 16 * mt + g + 8];
            #pragma unroll
            for (int j = 0; j < 2; j++) {
                float v[4];
                if (SPLIT) {  // a scale per 16 weights: the two halves' sums apart
                    int lo[4] = {0, 0, 0, 0}, hi[4] = {0, 0, 0, 0};
                    mma_s8k16(lo, a[0], a[1], b[j][0][0]);
                    mma_s8k16(hi, a[2], a[3], b[j][0][1]);
                    #pragma unroll
                    for (int e = 0; e < 4; e++) { lo[e] *= 256; hi[e] *= 256; }
                    mma_s8k16(lo, a[0], a[1], b[j][1][0]);
                    mma_s8k16(hi, a[2], a[3], b[j][1][1]);
                    #pragma unroll
                    for (int e = 0; e < 4; e++) {
                        float4 s = e < 2 ? sa : sb;
                        v[e] = fmaf(s.x, (float)lo[e], s.y * (float)hi[e]);
                    }
                } else {
                    int cs[4] = {0, 0, 0, 0};
                    mma_s8k32(cs, a, b[j][0][0], b[j][0][1]);
                    #pragma unroll
                    for (int e = 0; e < 4; e++) cs[e] *= 256;
                    mma_s8k32(cs, a, b[j][1][0], b[j][1][1]);
                    #pragma unroll
                    for (int e = 0; e < 4; e++) v[e] = (e < 2 ? sa : sb).x * (float)cs[e];
                }
                float* ac = acc[i][j];
                ac[0] = fmaf(dx[j][0], v[0], ac[0]);
                ac[1] = fmaf(dx[j][1], v[1], ac[1]);
                ac[2] = fmaf(dx[j][0], v[2], ac[2]);
                ac[3] = fmaf(dx[j][1], v[3], ac[3]);
                if (OFFS) {
                    ac[0] += sa.z * s0[j][0] + sa.w * s1[j][0];
                    ac[1] += sa.z * s0[j][1] + sa.w * s1[j][1];
                    ac[2] += sb.z * s0[j][0] + sb.w * s1[j][0];
                    ac[3] += sb.z * s0[j][1] + sb.w * s1[j][1];
                }
            }
        }
    }
}

// acc[mt][j][i] = rows of m-tile mt . tokens 16 warp + 8 j (this lane's fragments) over K = cols;
// x8: the planes of an nx x cols input matrix; S.xr holds the pass's nt input rows
template <int MT, int RAW>
__device__ void q8_pass(const Rows& R, int cols, const uint8_t* __restrict__ x8, long long nx, int nt, const SmemQ8& S,
                        float (*acc)[2][4]) {
    constexpr int MB = 16 * MT;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    const long long rc = nx * cols;
    const float* pd = reinterpret_cast<const float*>(x8 + 2 * rc);
    const float* ps = pd + nx * (cols / 32);
    bool split = qsplit(R.qt[0]) || qsplit(R.qt[1]), offs = qmin(R.qt[0]) || qmin(R.qt[1]);  // (q8_tile)
    for (int mat = 0; mat <= R.two; mat++) {  // the block's rows towards L2: the tiles' decodes then read L2
        long long nbytes = R.nrows * R.rb[mat];
        for (long long o = 128 * threadIdx.x; o < nbytes; o += 128 * blockDim.x) PREFETCH_L2(R.p[mat] + o);
    }
    for (int mt = 0; mt < MT; mt++)
        for (int j = 0; j < 2; j++)
            for (int i = 0; i < 4; i++) acc[mt][j][i] = 0.f;
    for (int k0 = 0; k0 < cols; k0 += QKB) {
        int n = min(QKB, cols - k0), nch = n / 32;
        __syncthreads();  // the previous tile is consumed
        for (int i = threadIdx.x; i < 2 * QNB * (QKB / 16); i += blockDim.x) {  // inputs: 16-byte words in flight
            int lv = i / (QNB * (QKB / 16)), t = (i / (QKB / 16)) % QNB, w = i % (QKB / 16);
            if (t < nt && 16 * w < n)
                cp16(S.xq + (lv * QNB + t) * QROW + 16 * w, x8 + lv * rc + (long long)S.xr[t] * cols + k0 + 16 * w);
        }
        for (int i = threadIdx.x; i < QNB * (QKB / 32); i += blockDim.x) {  // their scales and sums, as well
            int t = i / (QKB / 32), c = i % (QKB / 32);
            if (t < nt && c < nch) {
                long long ch = (long long)S.xr[t] * (cols / 32) + k0 / 32 + c;
                cp4(S.xd + i, pd + ch);
                cp4(S.xs + 2 * i, ps + 2 * ch);
                cp4(S.xs + 2 * i + 1, ps + 2 * ch + 1);
            }
        }
        for (int task = threadIdx.x; RAW && task < MB * (WSLOT / 16); task += blockDim.x) {  // RAW: the rows' words too
            int m = task / (WSLOT / 16), wd = task % (WSLOT / 16), mat = 0, r = m;
            if (R.two) { mat = (m & 15) >= 8; r = 8 * (m >> 4) + (m & 7); }
            int bw = g_block[R.qt[mat]][0], bb = g_block[R.qt[mat]][1];
            const uint8_t* p = R.p[mat] + r * R.rb[mat] + (long long)(k0 / bw) * bb;
            int nb = ((k0 + n - 1) / bw - k0 / bw + 1) * bb;
            if (r < R.nrows && wd < cover_words(p, nb)) cp16(S.wr + m * WSLOT + 16 * wd, reinterpret_cast<const uint8_t*>((u64)p & ~15ull) + 16 * wd);
        }
        cp_commit();
        if (RAW) {  // the decodes read shared memory
            cp_wait();
            __syncthreads();
        }
        for (int task = threadIdx.x; task < MB * (QKB / 32); task += blockDim.x) {  // a row's chunks on adjacent lanes
            int m = task / (QKB / 32), c = task % (QKB / 32), mat = 0, r = m;
            if (R.two) { mat = (m & 15) >= 8; r = 8 * (m >> 4) + (m & 7); }
            uint32_t* qd = reinterpret_cast<uint32_t*>(S.aq + m * QROW + 32 * c);
            if (r < R.nrows && c < nch) {
                const uint8_t* row = R.p[mat] + r * R.rb[mat];
                if (RAW) {  // where block 0 of the row would lie, given where block k0 / bw lies in the slot
                    int bw = g_block[R.qt[mat]][0], bb = g_block[R.qt[mat]][1];
                    u64 o = (u64)(k0 / bw) * bb;
                    row = reinterpret_cast<const uint8_t*>((u64)(S.wr + m * WSLOT) + (((u64)row + o) & 15) - o);
                }
                DISPATCH(R.qt[mat], dec_q8, row, k0 / 32 + c, qd, S.asc + c * MB + m)
            } else {
                for (int i = 0; i < 8; i++) qd[i] = 0u;
                S.asc[c * MB + m] = {0.f, 0.f, 0.f, 0.f};
            }
        }
        cp_wait();
        __syncthreads();
        if (16 * warp >= nt) continue;
        q8_tile<16 * MT, MT>(split, offs, S.xq, S.xd, S.xs, S.aq, S.asc, nch, 16 * warp, 0, acc);
    }
}

// as qmoe_gate_up with the input as x8 (qx8's planes of the nx rows of x) instead of x, ldx
#define GATE_UP_Q8_ARGS const unsigned long long* __restrict__ base, const int* __restrict__ gstart, const int* __restrict__ order, \
    const int* __restrict__ xrow, const uint8_t* __restrict__ x8, long long nx, float* __restrict__ h, int ffn, int hidden,     \
    int rows_per_warp, long long off_g, int qt_g, long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias
// as qmoe_down with the input as h8 (qx8's planes of the nh rows of h)
#define DOWN_Q8_ARGS const unsigned long long* __restrict__ base, const int* __restrict__ gstart, const int* __restrict__ order, \
    const uint8_t* __restrict__ h8, long long nh, float* __restrict__ y, int ffn, int hidden, int rows_per_warp, long long off_d, \
    int qt_d, long long rb_d, int bias
#define SMEM_Q8(MT, RAW)                                                                                 \
    __shared__ __align__(16) uint8_t aq[16 * MT * QROW];                                                 \
    __shared__ __align__(16) uint8_t wr[RAW ? 16 * MT * WSLOT : 16];                                     \
    __shared__ __align__(16) float4 asc[(QKB / 32) * 16 * MT];                                           \
    __shared__ __align__(16) uint8_t xq[2 * QNB * QROW];                                                 \
    __shared__ float xd[QNB * QKB / 32], xs[QNB * QKB / 16];                                             \
    __shared__ int xr[QNB];                                                                              \
    SmemQ8 S = {aq, asc, xq, xd, xs, xr, wr};

template <int MT, int RAW> __device__ void gate_up_q8(GATE_UP_Q8_ARGS, const SmemQ8& S) {
    constexpr int RB = 8 * MT;
    int g = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rl = WARPS * rows_per_warp;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(base[g]);
    for (int s = (blockIdx.x * rl + RB - 1) / RB * RB; s < (blockIdx.x + 1) * rl && s < ffn; s += RB) {
        Rows R = {{e + off_g + s * rb_g, e + off_u + s * rb_u}, {rb_g, rb_u}, {qt_g, qt_u}, 1, min(RB, ffn - s)};
        for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += QNB) {
            int nt = min(QNB, gstart[g + 1] - p0);
            __syncthreads();  // the previous pass's rows are read
            for (int t = threadIdx.x; t < QNB; t += blockDim.x) S.xr[t] = xrow[order[p0 + (t < nt ? t : 0)]];
            float acc[MT][2][4];
            q8_pass<MT, RAW>(R, hidden, x8, nx, nt, S, acc);
            for (int j = 0; j < 2; j++) {
                int tn = 16 * warp + 8 * j + 2 * (lane & 3);
                for (int mt = 0; mt < MT; mt++) {
                    int r = s + 8 * mt + (lane >> 2);
                    if (r >= ffn) continue;
                    float bg = bias ? reinterpret_cast<const float*>(e)[r] : 0.f, bu = bias ? reinterpret_cast<const float*>(e)[ffn + r] : 0.f;
                    for (int i = 0; i < 2; i++)
                        if (tn + i < nt) h[(long long)order[p0 + tn + i] * ffn + r] = q_act(act, acc[mt][j][i] + bg, acc[mt][j][2 + i] + bu);
                }
            }
        }
    }
}

template <int MT, int RAW> __device__ void down_q8(DOWN_Q8_ARGS, const SmemQ8& S) {
    constexpr int RB = 16 * MT;
    int g = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rl = WARPS * rows_per_warp;
    const float* bd = reinterpret_cast<const float*>(base[g]) + 2 * ffn;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(base[g]) + off_d;
    for (int s = (blockIdx.x * rl + RB - 1) / RB * RB; s < (blockIdx.x + 1) * rl && s < hidden; s += RB) {
        Rows R = {{e + s * rb_d, e + s * rb_d}, {rb_d, rb_d}, {qt_d, qt_d}, 0, min(RB, hidden - s)};
        for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += QNB) {
            int nt = min(QNB, gstart[g + 1] - p0);
            __syncthreads();
            for (int t = threadIdx.x; t < QNB; t += blockDim.x) S.xr[t] = order[p0 + (t < nt ? t : 0)];
            float acc[MT][2][4];
            q8_pass<MT, RAW>(R, ffn, h8, nh, nt, S, acc);
            for (int j = 0; j < 2; j++) {
                int tn = 16 * warp + 8 * j + 2 * (lane & 3);
                for (int mt = 0; mt < MT; mt++)
                    for (int hf = 0; hf < 2; hf++) {
                        int r = s + 16 * mt + (lane >> 2) + 8 * hf;
                        if (r >= hidden) continue;
                        for (int i = 0; i < 2; i++)
                            if (tn + i < nt) y[(long long)order[p0 + tn + i] * hidden + r] = acc[mt][j][2 * hf + i] + (bias ? bd[r] : 0.f);
                    }
            }
        }
    }
}

#define QMOE_Q8(SUFFIX, MT, RAW)                                                                                         \
    extern "C" __global__ void __launch_bounds__(128) qmoe_gate_up##SUFFIX(GATE_UP_Q8_ARGS) {                       \
        SMEM_Q8(MT, RAW)                                                                                            \
        gate_up_q8<MT, RAW>(base, gstart, order, xrow, x8, nx, h, ffn, hidden, rows_per_warp, off_g, qt_g, rb_g, off_u,  \
                       qt_u, rb_u, act, bias, S);                                                                   \
    }                                                                                                               \
    extern "C" __global__ void __launch_bounds__(128) qmoe_down##SUFFIX(DOWN_Q8_ARGS) {                             \
        SMEM_Q8(MT, RAW)                                                                                            \
        down_q8<MT, RAW>(base, gstart, order, h8, nh, y, ffn, hidden, rows_per_warp, off_d, qt_d, rb_d, bias, S);       \
    }
QMOE_Q8(_q8, 4, 0)
QMOE_Q8(_q8m2, 2, 0)
QMOE_Q8(_q8m1, 1, 0)
QMOE_Q8(_q8s2, 2, 1)
QMOE_Q8(_q8s1, 1, 1)

// _q8p, _q8p2, _q8px: the pipelined variants (MT = 4, 2 m-tiles, 8 warps, dynamic shared memory of Q8P<MT>::BYTES).
// Two buffers each hold a tile's input planes and its weight rows' bytes (the 16-byte words covering
// them); tile k + 1's are copied by cp.async while tile k is decoded (from shared memory) and
// multiplied, so a block waits for memory once per pass, not once per tile, and its weight reads
// reach HBM a tile ahead of use (the pass's rows are also prefetched towards L2 as above). Warp w
// multiplies tokens 16 (w % 4) .. + 15 of m-tiles (w / 4) MT / 2 .. + MT / 2 - 1: 8 warps on a block's
// 16 MT rows and 64 tokens. A chunk's two levels are summed in int32 by the tensor cores (the first
// level's sums times 256 as the second's accumulator: exact), then scaled in float32 once; the
// offsets' terms only for types that have them (qmin). Launched by programmatic dependent launch
// (_q8pd, _q8pxd), a block reads the launch's tables and sends its rows towards L2 before it waits for
// the grid before it (qx8's planes), and qx8 waits before it reads x or h.
template <int MT> struct Q8P {
    static constexpr int MB = 16 * MT;
    static constexpr int WR = MB * WSLOT, XQ = 2 * QNB * QROW, XD = QNB * (QKB / 32) * 4, XS = QNB * (QKB / 16) * 4;
    static constexpr int BUF = WR + XQ + XD + XS;  // one buffer: weight words | inputs (2 levels) | scales | sums
    static constexpr int AQ = MB * QROW, ASC = (QKB / 32) * MB * 16;
    static constexpr int BYTES = 2 * BUF + AQ + ASC + QNB * 4;  // two buffers | quants | their scales | input rows
};
#define Q8P_WARPS 8

// queues the copies of tile k0 (inputs of the pass's nt tokens, rows xr; the block's weight words) into buf
template <int MT> __device__ void q8p_stage(const Rows& R, int cols, const uint8_t* __restrict__ x8, long long nx, int nt,
                                            int k0, uint8_t* buf, const int* xr) {
    constexpr int MB = 16 * MT;
    const long long rc = nx * cols;
    const float* pd = reinterpret_cast<const float*>(x8 + 2 * rc);
    const float* ps = pd + nx * (cols / 32);
    uint8_t* xq = buf + Q8P<MT>::WR;
    float* xd = reinterpret_cast<float*>(xq + Q8P<MT>::XQ);
    float* xs = xd + QNB * (QKB / 32);
    int n = min(QKB, cols - k0), nch = n / 32;
    for (int i = threadIdx.x; i < 2 * QNB * (QKB / 16); i += blockDim.x) {
        int lv = i / (QNB * (QKB / 16)), t = (i / (QKB / 16)) % QNB, w = i % (QKB / 16);
        if (t < nt && 16 * w < n) cp16(xq + (lv * QNB + t) * QROW + 16 * w, x8 + lv * rc + (long long)xr[t] * cols + k0 + 16 * w);
    }
    for (int i = threadIdx.x; i < QNB * (QKB / 32); i += blockDim.x) {
        int t = i / (QKB / 32), c = i % (QKB / 32);
        if (t < nt && c < nch) {
            long long ch = (long long)xr[t] * (cols / 32) + k0 / 32 + c;
            cp4(xd + i, pd + ch);
            cp4(xs + 2 * i, ps + 2 * ch);
            cp4(xs + 2 * i + 1, ps + 2 * ch + 1);
        }
    }
    for (int task = threadIdx.x; task < MB * (WSLOT / 16); task += blockDim.x) {
        int m = task / (WSLOT / 16), wd = task % (WSLOT / 16), mat = 0, r = m;
        if (R.two) { mat = (m & 15) >= 8; r = 8 * (m >> 4) + (m & 7); }
        int bw = g_block[R.qt[mat]][0], bb = g_block[R.qt[mat]][1];
        const uint8_t* p = R.p[mat] + r * R.rb[mat] + (long long)(k0 / bw) * bb;
        int nb = ((k0 + n - 1) / bw - k0 / bw + 1) * bb;
        if (r < R.nrows && wd < cover_words(p, nb)) cp16(buf + m * WSLOT + 16 * wd, reinterpret_cast<const uint8_t*>((u64)p & ~15ull) + 16 * wd);
    }
    cp_commit();
}

// acc[i][j][.] = rows of m-tile (warp / 4) MT / 2 + i . tokens 16 (warp % 4) + 8 j (this lane's fragments) over K = cols
template <int MT>
__device__ void q8p_pass(const Rows& R, int cols, const uint8_t* __restrict__ x8, long long nx, int nt, uint8_t* sm,
                         float (*acc)[2][4]) {
    constexpr int MB = 16 * MT, MW = MT / 2, BUF = Q8P<MT>::BUF;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3, tw = warp & 3, mh = warp >> 2;
    uint8_t* aq = sm + 2 * BUF;
    float4* asc = reinterpret_cast<float4*>(aq + Q8P<MT>::AQ);
    const int* xr = reinterpret_cast<const int*>(aq + Q8P<MT>::AQ + Q8P<MT>::ASC);
    bool split = qsplit(R.qt[0]) || qsplit(R.qt[1]), offs = qmin(R.qt[0]) || qmin(R.qt[1]);
    for (int mat = 0; mat <= R.two; mat++) {
        long long nbytes = R.nrows * R.rb[mat];
        for (long long o = 128 * threadIdx.x; o < nbytes; o += 128 * blockDim.x) PREFETCH_L2(R.p[mat] + o);
    }
    pdl_wait_trigger();  // (a programmatic launch: the weights are on their way; the input planes come from the grid before)
    for (int i = 0; i < MW; i++)
        for (int j = 0; j < 2; j++)
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
    int ntile = (cols + QKB - 1) / QKB;
    __syncthreads();  // the pass's rows (xr) are written; the previous pass's buffers are consumed
    q8p_stage<MT>(R, cols, x8, nx, nt, 0, sm, xr);
    for (int k = 0; k < ntile; k++) {
        int k0 = k * QKB, n = min(QKB, cols - k0), nch = n / 32;
        uint8_t* buf = sm + (k & 1) * BUF;
        cp_wait();
        __syncthreads();  // tile k's copies have landed; tile k - 1 is consumed (its buffer and the quants are free)
        if (k + 1 < ntile) q8p_stage<MT>(R, cols, x8, nx, nt, k0 + QKB, sm + ((k + 1) & 1) * BUF, xr);
        for (int task = threadIdx.x; task < MB * (QKB / 32); task += blockDim.x) {
            int m = task / (QKB / 32), c = task % (QKB / 32), mat = 0, r = m;
            if (R.two) { mat = (m & 15) >= 8; r = 8 * (m >> 4) + (m & 7); }
            uint32_t* qd = reinterpret_cast<uint32_t*>(aq + m * QROW + 32 * c);
            if (r < R.nrows && c < nch) {  // where block 0 of the row would lie, given where block k0 / bw lies in its words
                int bw = g_block[R.qt[mat]][0], bb = g_block[R.qt[mat]][1];
                u64 o = (u64)(k0 / bw) * bb;
                const uint8_t* row = reinterpret_cast<const uint8_t*>((u64)(buf + m * WSLOT) + (((u64)(R.p[mat] + r * R.rb[mat]) + o) & 15) - o);
                DISPATCH(R.qt[mat], dec_q8, row, k0 / 32 + c, qd, asc + c * MB + m)
            } else {
                for (int i = 0; i < 8; i++) qd[i] = 0u;
                asc[c * MB + m] = {0.f, 0.f, 0.f, 0.f};
            }
        }
        __syncthreads();
        if (16 * tw >= nt) continue;
        const uint8_t* xq = buf + Q8P<MT>::WR;
        const float* xd = reinterpret_cast<const float*>(xq + Q8P<MT>::XQ);
        q8_tile<MB, MW>(split, offs, xq, xd, xd + QNB * (QKB / 32), aq, asc, nch, 16 * tw, mh * MW, acc);
    }
}

#ifdef __CUDA_ARCH__
#define SMEM_Q8P(MT) extern __shared__ __align__(16) uint8_t sm[];
#else
#define SMEM_Q8P(MT) __shared__ __align__(16) uint8_t sm[Q8P<MT>::BYTES];
#endif

template <int MT> __device__ void gate_up_q8p(GATE_UP_Q8_ARGS, uint8_t* sm) {
    constexpr int RB = 8 * MT, MW = MT / 2;
    int g = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rl = WARPS * rows_per_warp;
    int* xr = reinterpret_cast<int*>(sm + 2 * Q8P<MT>::BUF + Q8P<MT>::AQ + Q8P<MT>::ASC);
    const uint8_t* e = reinterpret_cast<const uint8_t*>(base[g]);
    for (int s = (blockIdx.x * rl + RB - 1) / RB * RB; s < (blockIdx.x + 1) * rl && s < ffn; s += RB) {
        Rows R = {{e + off_g + s * rb_g, e + off_u + s * rb_u}, {rb_g, rb_u}, {qt_g, qt_u}, 1, min(RB, ffn - s)};
        for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += QNB) {
            int nt = min(QNB, gstart[g + 1] - p0);
            __syncthreads();  // the previous pass's rows are read
            for (int t = threadIdx.x; t < QNB; t += blockDim.x) xr[t] = xrow[order[p0 + (t < nt ? t : 0)]];
            float acc[MW][2][4];
            q8p_pass<MT>(R, hidden, x8, nx, nt, sm, acc);
            for (int j = 0; j < 2; j++) {
                int tn = 16 * (warp & 3) + 8 * j + 2 * (lane & 3);
                for (int i = 0; i < MW; i++) {
                    int r = s + 8 * ((warp >> 2) * MW + i) + (lane >> 2);
                    if (r >= ffn) continue;
                    float bg = bias ? reinterpret_cast<const float*>(e)[r] : 0.f, bu = bias ? reinterpret_cast<const float*>(e)[ffn + r] : 0.f;
                    for (int k = 0; k < 2; k++)
                        if (tn + k < nt) h[(long long)order[p0 + tn + k] * ffn + r] = q_act(act, acc[i][j][k] + bg, acc[i][j][2 + k] + bu);
                }
            }
        }
    }
}

template <int MT> __device__ void down_q8p(DOWN_Q8_ARGS, uint8_t* sm) {
    constexpr int RB = 16 * MT, MW = MT / 2;
    int g = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rl = WARPS * rows_per_warp;
    int* xr = reinterpret_cast<int*>(sm + 2 * Q8P<MT>::BUF + Q8P<MT>::AQ + Q8P<MT>::ASC);
    const float* bd = reinterpret_cast<const float*>(base[g]) + 2 * ffn;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(base[g]) + off_d;
    for (int s = (blockIdx.x * rl + RB - 1) / RB * RB; s < (blockIdx.x + 1) * rl && s < hidden; s += RB) {
        Rows R = {{e + s * rb_d, e + s * rb_d}, {rb_d, rb_d}, {qt_d, qt_d}, 0, min(RB, hidden - s)};
        for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += QNB) {
            int nt = min(QNB, gstart[g + 1] - p0);
            __syncthreads();
            for (int t = threadIdx.x; t < QNB; t += blockDim.x) xr[t] = order[p0 + (t < nt ? t : 0)];
            float acc[MW][2][4];
            q8p_pass<MT>(R, ffn, h8, nh, nt, sm, acc);
            for (int j = 0; j < 2; j++) {
                int tn = 16 * (warp & 3) + 8 * j + 2 * (lane & 3);
                for (int i = 0; i < MW; i++)
                    for (int hf = 0; hf < 2; hf++) {
                        int r = s + 16 * ((warp >> 2) * MW + i) + (lane >> 2) + 8 * hf;
                        if (r >= hidden) continue;
                        for (int k = 0; k < 2; k++)
                            if (tn + k < nt) y[(long long)order[p0 + tn + k] * hidden + r] = acc[i][j][2 * hf + k] + (bias ? bd[r] : 0.f);
                    }
            }
        }
    }
}

#define QMOE_Q8P(SUFFIX, MT, MINB)  /* MINB: resident blocks per SM the registers must allow */          \
    extern "C" __global__ void __launch_bounds__(32 * Q8P_WARPS, MINB) qmoe_gate_up##SUFFIX(GATE_UP_Q8_ARGS) {  \
        SMEM_Q8P(MT)                                                                                          \
        gate_up_q8p<MT>(base, gstart, order, xrow, x8, nx, h, ffn, hidden, rows_per_warp, off_g, qt_g, rb_g, off_u, \
                        qt_u, rb_u, act, bias, sm);                                                           \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(32 * Q8P_WARPS, MINB) qmoe_down##SUFFIX(DOWN_Q8_ARGS) {        \
        SMEM_Q8P(MT)                                                                                          \
        down_q8p<MT>(base, gstart, order, h8, nh, y, ffn, hidden, rows_per_warp, off_d, qt_d, rb_d, bias, sm);     \
    }
QMOE_Q8P(_q8p, 4, 2)   // 87 KB of shared memory: 2 blocks per SM
QMOE_Q8P(_q8p2, 2, 3)  // 65 KB: 3 blocks per SM (80 registers at most)
// _q8px: _q8p2's gate/up beside _q8p's down (as many blocks as 2 or 3 a SM hold on qwen3-30b-a3b's 8 experts)
extern "C" __global__ void __launch_bounds__(32 * Q8P_WARPS, 3) qmoe_gate_up_q8px(GATE_UP_Q8_ARGS) {
    SMEM_Q8P(2)
    gate_up_q8p<2>(base, gstart, order, xrow, x8, nx, h, ffn, hidden, rows_per_warp, off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias, sm);
}
extern "C" __global__ void __launch_bounds__(32 * Q8P_WARPS, 2) qmoe_down_q8px(DOWN_Q8_ARGS) {
    SMEM_Q8P(4)
    down_q8p<4>(base, gstart, order, h8, nh, y, ffn, hidden, rows_per_warp, off_d, qt_d, rb_d, bias, sm);
}
