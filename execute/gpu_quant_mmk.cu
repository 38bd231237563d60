// gpu_quant.cu, part 6: the int8 batched variants beside part 5's (same tiles, shared memory, qx8 planes
// and launch arguments; part 5's kernels, GENERIC_BATCH's among them, stay as they were measured):
// _q8a2 a pass's idle warps on the tiles' other chunks, _q8k2 / _q8k4 the same on 8 warps, _q8m2c /
// _q8k2c the int32 sums converted without I2F (the same bits as _q8m2 / _q8k2).

// q8_tile over the tile's chunks c0, c0 + cs, ..; CV = 1: each level's sums apart, their accumulators
// started at 2^23 + 2^22 (float bits 0x4B400000; |C| < 2^22), so two float subtractions and one fma give
// 256 C1 + C2 rounded once, as the int32 sum's conversion (I2F, the slower conversion pipe) rounds it:
// the same bits, the two mma chains apart.
template <int MB, int MW, int CV>
__device__ __forceinline__ void q8k_tile(bool SPLIT, bool OFFS, const uint8_t* xq, const float* xd, const float* xs,
                                        const uint8_t* aq, const float4* asc, int nch, int t0, int m0, float (*acc)[2][4],
                                        int c0 = 0, int cs = 1) {
    int lane = threadIdx.x & 31, g = lane >> 2, q = lane & 3;
    #pragma unroll
    for (int c = 0; c < QKB / 32; c++) {
        if (c >= nch) break;
        if (c % cs != c0) continue;
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
                constexpr int M0 = 0x4B400000;
                constexpr float MF = 12582912.f;  // 2^23 + 2^22
                if (CV && SPLIT) {
                    int l1[4] = {M0, M0, M0, M0}, l2[4] = {M0, M0, M0, M0}, h1[4] = {M0, M0, M0, M0}, h2[4] = {M0, M0, M0, M0};
                    mma_s8k16(l1, a[0], a[1], b[j][0][0]);
                    mma_s8k16(h1, a[2], a[3], b[j][0][1]);
                    mma_s8k16(l2, a[0], a[1], b[j][1][0]);
                    mma_s8k16(h2, a[2], a[3], b[j][1][1]);
                    #pragma unroll
                    for (int e = 0; e < 4; e++) {
                        float4 s = e < 2 ? sa : sb;
                        float lo = fmaf(256.f, __int_as_float(l1[e]) - MF, __int_as_float(l2[e]) - MF);
                        float hi = fmaf(256.f, __int_as_float(h1[e]) - MF, __int_as_float(h2[e]) - MF);
                        v[e] = fmaf(s.x, lo, s.y * hi);
                    }
                } else if (CV) {
                    int c1[4] = {M0, M0, M0, M0}, c2[4] = {M0, M0, M0, M0};
                    mma_s8k32(c1, a, b[j][0][0], b[j][0][1]);
                    mma_s8k32(c2, a, b[j][1][0], b[j][1][1]);
                    #pragma unroll
                    for (int e = 0; e < 4; e++)
                        v[e] = (e < 2 ? sa : sb).x * fmaf(256.f, __int_as_float(c1[e]) - MF, __int_as_float(c2[e]) - MF);
                } else if (SPLIT) {  // a scale per 16 weights: the two halves' sums apart
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

// q8_pass's sums with q8k_tile, the token group g returned (-1: this warp holds no sums): acc[mt][j][i] =
// rows of m-tile mt . tokens 16 g + 8 j over K = cols. KS = 0: warp w takes tokens 16 w .. 16 w + 15
// (4 warps). KS > 0 (4 KS warps): the pass's G = ceil(nt / 16) token groups (<= 4) each get W / G
// warps (<= 4), which take the tile's chunks in turn, their sums added to the first's in warp order at
// the end (through S.xq): a pass of 4 tokens keeps every warp multiplying, and 8 warps keep twice the
// warps in flight.
template <int MT, int KS, int CV>
__device__ int q8k_pass(const Rows& R, int cols, const uint8_t* __restrict__ x8, long long nx, int nt, const SmemQ8& S,
                       float (*acc)[2][4]) {
    constexpr int MB = 16 * MT;
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int ng = KS ? min(4, (nt + 15) / 16) : 4, nks = KS ? min(QKB / 32, 4 * KS / ng) : 1;  // token groups, chunk slices
    int tw = warp % ng, kh = warp / ng;  // this warp's token group and chunk slice
    bool on = kh < nks && 16 * tw < nt;
    const long long rc = nx * cols;
    const float* pd = reinterpret_cast<const float*>(x8 + 2 * rc);
    const float* ps = pd + nx * (cols / 32);
    bool split = qsplit(R.qt[0]) || qsplit(R.qt[1]), offs = qmin(R.qt[0]) || qmin(R.qt[1]);  // (q8k_tile)
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
        cp_commit();
        for (int task = threadIdx.x; task < MB * (QKB / 32); task += blockDim.x) {  // a row's chunks on adjacent lanes
            int m = task / (QKB / 32), c = task % (QKB / 32), mat = 0, r = m;
            if (R.two) { mat = (m & 15) >= 8; r = 8 * (m >> 4) + (m & 7); }
            uint32_t* qd = reinterpret_cast<uint32_t*>(S.aq + m * QROW + 32 * c);
            if (r < R.nrows && c < nch) {
                const uint8_t* row = R.p[mat] + r * R.rb[mat];
                DISPATCH(R.qt[mat], dec_q8, row, k0 / 32 + c, qd, S.asc + c * MB + m)
            } else {
                for (int i = 0; i < 8; i++) qd[i] = 0u;
                S.asc[c * MB + m] = {0.f, 0.f, 0.f, 0.f};
            }
        }
        cp_wait();
        __syncthreads();
        if (!on) continue;
        q8k_tile<16 * MT, MT, CV>(split, offs, S.xq, S.xd, S.xs, S.aq, S.asc, nch, 16 * tw, 0, acc, kh, nks);
    }
    float* red = reinterpret_cast<float*>(S.xq);  // [ng][MT * 8][32]: one slice's sums (<= MT * 4 KB <= xq's 18 KB)
    for (int r = 1; r < nks; r++) {  // (uniform: nt is the block's)
        __syncthreads();  // the last tile (or the previous slice's sums) consumed
        #pragma unroll
        for (int i = 0; i < MT * 8; i++)
            if (kh == r && on) red[(tw * MT * 8 + i) * 32 + lane] = (&acc[0][0][0])[i];
        __syncthreads();
        #pragma unroll
        for (int i = 0; i < MT * 8; i++)
            if (kh == 0 && on) (&acc[0][0][0])[i] += red[(tw * MT * 8 + i) * 32 + lane];
    }
    return on && kh == 0 ? tw : -1;
}

template <int MT, int KS, int CV> __device__ void gate_up_q8k(GATE_UP_Q8_ARGS, const SmemQ8& S) {
    constexpr int RB = 8 * MT;
    int g = blockIdx.y, lane = threadIdx.x & 31, rl = WARPS * rows_per_warp;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(base[g]);
    for (int s = (blockIdx.x * rl + RB - 1) / RB * RB; s < (blockIdx.x + 1) * rl && s < ffn; s += RB) {
        Rows R = {{e + off_g + s * rb_g, e + off_u + s * rb_u}, {rb_g, rb_u}, {qt_g, qt_u}, 1, min(RB, ffn - s)};
        for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += QNB) {
            int nt = min(QNB, gstart[g + 1] - p0);
            __syncthreads();  // the previous pass's rows are read
            for (int t = threadIdx.x; t < QNB; t += blockDim.x) S.xr[t] = xrow[order[p0 + (t < nt ? t : 0)]];
            float acc[MT][2][4];
            int tg = q8k_pass<MT, KS, CV>(R, hidden, x8, nx, nt, S, acc);
            for (int j = 0; j < 2 && tg >= 0; j++) {
                int tn = 16 * tg + 8 * j + 2 * (lane & 3);
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

template <int MT, int KS, int CV> __device__ void down_q8k(DOWN_Q8_ARGS, const SmemQ8& S) {
    constexpr int RB = 16 * MT;
    int g = blockIdx.y, lane = threadIdx.x & 31, rl = WARPS * rows_per_warp;
    const float* bd = reinterpret_cast<const float*>(base[g]) + 2 * ffn;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(base[g]) + off_d;
    for (int s = (blockIdx.x * rl + RB - 1) / RB * RB; s < (blockIdx.x + 1) * rl && s < hidden; s += RB) {
        Rows R = {{e + s * rb_d, e + s * rb_d}, {rb_d, rb_d}, {qt_d, qt_d}, 0, min(RB, hidden - s)};
        for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += QNB) {
            int nt = min(QNB, gstart[g + 1] - p0);
            __syncthreads();
            for (int t = threadIdx.x; t < QNB; t += blockDim.x) S.xr[t] = order[p0 + (t < nt ? t : 0)];
            float acc[MT][2][4];
            int tg = q8k_pass<MT, KS, CV>(R, ffn, h8, nh, nt, S, acc);
            for (int j = 0; j < 2 && tg >= 0; j++) {
                int tn = 16 * tg + 8 * j + 2 * (lane & 3);
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

// _q8a2: _q8m2 with the token groups' warps over the tiles' chunks (KS = 1: a pass of 4 tokens keeps 4 warps
// multiplying); _q8k2, _q8k4: 2 and 4 m-tiles, 8 warps (KS = 2: at 64 tokens each half of the chunks);
// _q8m2c, _q8k2c: _q8m2's and _q8k2's sums converted by CV = 1. MINB: resident blocks per SM the
// registers must allow (qwen3-30b-a3b's 8 experts: 384 and 192 blocks of gate/up at 2 and 4 m-tiles)
#define QMOE_Q8K(SUFFIX, MT, KS, CV, MINB)                                                                                      \
    extern "C" __global__ void __launch_bounds__(KS ? 128 * KS : 128, MINB) qmoe_gate_up##SUFFIX(GATE_UP_Q8_ARGS) {                      \
        SMEM_Q8(MT, 0)                                                                                             \
        gate_up_q8k<MT, KS, CV>(base, gstart, order, xrow, x8, nx, h, ffn, hidden, rows_per_warp, off_g, qt_g, rb_g, off_u, \
                             qt_u, rb_u, act, bias, S);                                                            \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(KS ? 128 * KS : 128, MINB) qmoe_down##SUFFIX(DOWN_Q8_ARGS) {                            \
        SMEM_Q8(MT, 0)                                                                                             \
        down_q8k<MT, KS, CV>(base, gstart, order, h8, nh, y, ffn, hidden, rows_per_warp, off_d, qt_d, rb_d, bias, S);       \
    }
QMOE_Q8K(_q8k2, 2, 2, 0, 3)
QMOE_Q8K(_q8k4, 4, 2, 0, 2)
QMOE_Q8K(_q8m2c, 2, 0, 1, 1)
QMOE_Q8K(_q8a2, 2, 1, 0, 1)
QMOE_Q8K(_q8k2c, 2, 2, 1, 3)
