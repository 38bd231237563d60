// Dequantize-and-multiply for every GGUF layout of execute/quant.py (the K, legacy and i-quant
// types the expert arena's kernels do not read): Y[t][r] = sum_c W[r][c] * X[t][c].
//
// W: rows of raw GGUF blocks (rb bytes per row, any alignment: every field is read by bytes);
// X: (n, cols) float32; Y: (n, rows) float32. One warp per row, 4 rows per 128-thread block; a
// lane decodes weight c + lane of each 32-weight chunk (qw, below) and multiplies it with up to
// TOK tokens at a time, then the warp reduces with shuffles. Tables of the i-quants come from
// execute/iq_grids.py (grid values as bytes, the sign table, the IQ4 levels), uploaded once into
// constant memory by execute/gpu_quant.py. qt is uniform over a launch, so its switch never diverges.
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned int uint32_t;

#define TOK 8

__constant__ uint8_t g_iq2xxs[256 * 8];
__constant__ uint8_t g_iq2xs[512 * 8];
__constant__ uint8_t g_iq2s[1024 * 8];
__constant__ uint8_t g_iq3xxs[256 * 4];
__constant__ uint8_t g_iq3s[512 * 4];
__constant__ int8_t g_iq1s[2048 * 8];
__constant__ uint8_t g_ksigns[128];
__constant__ int8_t g_iq4nl[16];

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ float f16_at(const uint8_t* p) { return h2f((unsigned short)(p[0] | (p[1] << 8))); }
__device__ __forceinline__ uint32_t u16_at(const uint8_t* p) { return p[0] | (p[1] << 8); }
__device__ __forceinline__ uint32_t u32_at(const uint8_t* p) {
    return p[0] | (p[1] << 8) | (p[2] << 16) | ((uint32_t)p[3] << 24);
}
__device__ __forceinline__ float sgn(uint32_t bit) { return bit ? -1.0f : 1.0f; }

// Q4_K / Q5_K: 6-bit scale and min of sub-block s from the 12 scale bytes at sc
__device__ __forceinline__ void k_scale_min(const uint8_t* sc, int s, float& d, float& m) {
    if (s < 4) { d = sc[s] & 63; m = sc[s + 4] & 63; }
    else { d = (sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4); m = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4); }
}

// weight i of the block at b (i < the type's block_weights), as float
__device__ float qw(int qt, const uint8_t* b, int i) {
    switch (qt) {
    case 0: return __int_as_float((int)u32_at(b + 4 * i));
    case 1: return f16_at(b + 2 * i);
    case 30: return __int_as_float((int)(u16_at(b + 2 * i) << 16));
    case 2: return f16_at(b) * (float)((int)((b[2 + i % 16] >> (4 * (i / 16))) & 15) - 8);  // Q4_0
    case 3: return f16_at(b) * (float)((b[4 + i % 16] >> (4 * (i / 16))) & 15) + f16_at(b + 2);  // Q4_1
    case 6: {  // Q5_0
        int q = ((b[6 + i % 16] >> (4 * (i / 16))) & 15) | (((u32_at(b + 2) >> i) & 1) << 4);
        return f16_at(b) * (float)(q - 16);
    }
    case 7: {  // Q5_1
        int q = ((b[8 + i % 16] >> (4 * (i / 16))) & 15) | (((u32_at(b + 4) >> i) & 1) << 4);
        return f16_at(b) * (float)q + f16_at(b + 2);
    }
    case 8: return f16_at(b) * (float)(int8_t)b[2 + i];  // Q8_0
    case 10: {  // Q2_K
        int sc = b[i / 16], q = (b[16 + 32 * (i / 128) + i % 32] >> (2 * ((i % 128) / 32))) & 3;
        return f16_at(b + 80) * (float)(sc & 15) * (float)q - f16_at(b + 82) * (float)(sc >> 4);
    }
    case 11: {  // Q3_K
        int k = i / 16, lo = (b[96 + k % 8] >> (4 * (k / 8))) & 15, hi = (b[104 + k % 4] >> (2 * (k / 4))) & 3;
        int q = ((b[32 + 32 * (i / 128) + i % 32] >> (2 * ((i % 128) / 32))) & 3) - (((b[i % 32] >> (i / 32)) & 1) ? 0 : 4);
        return f16_at(b + 108) * (float)((lo | (hi << 4)) - 32) * (float)q;
    }
    case 12: case 13: {  // Q4_K, Q5_K
        int s = i / 32, qo = qt == 12 ? 16 : 48;
        float sc, m;
        k_scale_min(b + 4, s, sc, m);
        int q = (b[qo + 32 * (s / 2) + i % 32] >> (4 * (s % 2))) & 15;
        if (qt == 13) q |= ((b[16 + i % 32] >> s) & 1) << 4;
        return f16_at(b) * sc * (float)q - f16_at(b + 2) * m;
    }
    case 14: {  // Q6_K
        int h = i / 128, g = (i % 128) / 32, l = i % 32;
        int q = ((b[64 * h + 32 * (g % 2) + l] >> (4 * (g / 2))) & 15) | (((b[128 + 32 * h + l] >> (2 * g)) & 3) << 4);
        return f16_at(b + 208) * (float)(int8_t)b[192 + i / 16] * (float)(q - 32);
    }
    case 16: {  // IQ2_XXS
        const uint8_t* p = b + 2 + 8 * (i / 32);
        uint32_t s = u32_at(p + 4);
        int l = (i % 32) / 8;
        float db = f16_at(b) * (0.5f + (float)(s >> 28)) * 0.25f;
        return db * (float)g_iq2xxs[8 * p[l] + i % 8] * sgn((g_ksigns[(s >> (7 * l)) & 127] >> (i % 8)) & 1);
    }
    case 17: {  // IQ2_XS
        uint32_t q = u16_at(b + 2 + 2 * (i / 8));
        int g = i / 16;
        float db = f16_at(b) * (0.5f + (float)((b[66 + g / 2] >> (4 * (g % 2))) & 15)) * 0.25f;
        return db * (float)g_iq2xs[8 * (q & 511) + i % 8] * sgn((g_ksigns[q >> 9] >> (i % 8)) & 1);
    }
    case 22: {  // IQ2_S
        int k = i / 8, g = i / 16;
        int idx = b[2 + k] | (((b[66 + k / 4] >> (2 * (k % 4))) & 3) << 8);
        float db = f16_at(b) * (0.5f + (float)((b[74 + g / 2] >> (4 * (g % 2))) & 15)) * 0.25f;
        return db * (float)g_iq2s[8 * idx + i % 8] * sgn((b[34 + k] >> (i % 8)) & 1);
    }
    case 18: {  // IQ3_XXS
        uint32_t s = u32_at(b + 66 + 4 * (i / 32));
        float db = f16_at(b) * (0.5f + (float)(s >> 28)) * 0.5f;
        int l = (i % 32) / 8;
        return db * (float)g_iq3xxs[4 * b[2 + i / 4] + i % 4] * sgn((g_ksigns[(s >> (7 * l)) & 127] >> (i % 8)) & 1);
    }
    case 21: {  // IQ3_S
        int k = i / 4, ib = i / 32;
        int idx = b[2 + k] | (((b[66 + k / 8] >> (k % 8)) & 1) << 8);
        float db = f16_at(b) * (float)(1 + 2 * ((b[106 + ib / 2] >> (4 * (ib % 2))) & 15));
        return db * (float)g_iq3s[4 * idx + i % 4] * sgn((b[74 + i / 8] >> (i % 8)) & 1);
    }
    case 19: {  // IQ1_S
        uint32_t qh = u16_at(b + 34 + 2 * (i / 32));
        int l = (i % 32) / 8;
        int idx = b[2 + 4 * (i / 32) + l] | (((qh >> (3 * l)) & 7) << 8);
        float dl = f16_at(b) * (float)(2 * ((qh >> 12) & 7) + 1);
        return dl * ((float)g_iq1s[8 * idx + i % 8] + ((qh & 0x8000) ? -0.125f : 0.125f));
    }
    case 29: {  // IQ1_M
        const uint8_t* sc = b + 48;
        unsigned short dh = (unsigned short)((u16_at(sc) >> 12) | ((u16_at(sc + 2) >> 12) << 4) |
                                             ((u16_at(sc + 4) >> 12) << 8) | ((u16_at(sc + 6) >> 12) << 12));
        int k = i / 8, g = i / 16;
        int nib = (b[32 + k / 2] >> (4 * (k % 2))) & 15;
        int idx = b[k] | ((nib & 7) << 8);
        float dl = h2f(dh) * (float)(2 * ((u16_at(sc + 2 * (g / 4)) >> (3 * (g % 4))) & 7) + 1);
        return dl * ((float)g_iq1s[8 * idx + i % 8] + ((nib & 8) ? -0.125f : 0.125f));
    }
    case 20: return f16_at(b) * (float)g_iq4nl[(b[2 + i % 16] >> (4 * (i / 16))) & 15];  // IQ4_NL
    case 23: {  // IQ4_XS
        int s = i / 32, j = i % 32;
        int ls = ((b[4 + s / 2] >> (4 * (s % 2))) & 15) | (((u16_at(b + 2) >> (2 * s)) & 3) << 4);
        return f16_at(b) * (float)(ls - 32) * (float)g_iq4nl[(b[8 + 16 * s + j % 16] >> (4 * (j / 16))) & 15];
    }
    case 39: {  // MXFP4: E2M1 doubled times 2^(e - 128)
        const float K[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
        return K[(b[1 + i % 16] >> (4 * (i / 16))) & 15] * ldexpf(1.0f, (int)b[0] - 128);
    }
    }
    return 0.0f;
}

// Y[t][r] = W[r] . X[t] for rows r, tokens t < n; bw, bb: weights and bytes of a block
extern "C" __global__ void qmatmul(const uint8_t* __restrict__ W, int qt, int bw, int bb, int rows, int cols,
                                   long long rb, const float* __restrict__ X, int n, float* __restrict__ Y) {
    int lane = threadIdx.x & 31;
    int r = blockIdx.x * 4 + (threadIdx.x >> 5);
    if (r >= rows) return;
    const uint8_t* row = W + (long long)r * rb;
    for (int t0 = 0; t0 < n; t0 += TOK) {
        float acc[TOK];
        for (int t = 0; t < TOK; t++) acc[t] = 0.0f;
        for (int c = lane; c < cols; c += 32) {
            float w = qw(qt, row + (long long)(c / bw) * bb, c % bw);
            for (int t = 0; t < TOK; t++)
                if (t0 + t < n) acc[t] += w * X[(long long)(t0 + t) * cols + c];
        }
        for (int t = 0; t < TOK; t++) {
            float v = acc[t];
            for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            if (lane == 0 && t0 + t < n) Y[(long long)(t0 + t) * rows + r] = v;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Expert kernels for layers with a type the arena's kernels (gpu_kernels.cu) do not read: the
// same launches, arguments and expert layout as moe_gate_up, moe_down, moe1_gate_up and
// moe1_down_combine there ([float32 biases] | gate | up | down at off_g, off_u, off_d of an
// expert's base; rows of rb_* bytes), any layout per projection, each weight decoded by qw.
// A warp computes one output row; lane l takes columns l, l + 32, ... of it (any row length).
// g_block[qt] = (weights, bytes) of a block of type qt, uploaded by execute/gpu_quant.py.
#define TB 4
#define WARPS 4
#define MAXK 32

__constant__ int g_block[64][2];

__device__ __forceinline__ float q_act(int act, float a, float b) {  // gpu_kernels.cu's expert_act
    if (act == 1) {
        a = fminf(a, 7.f);
        b = fminf(fmaxf(b, -7.f), 7.f);
        return a / (1.f + __expf(-1.702f * a)) * (b + 1.f);
    }
    return a / (1.f + __expf(-a)) * b;
}

__device__ __forceinline__ float q_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// acc[t] += row . x[tok[t] * ldx ..] for t < nt (lane partial sums)
__device__ __forceinline__ void q_row_dot(int qt, const uint8_t* row, int cols, const float* x, long long ldx,
                                          const int* tok, int nt, float* acc) {
    int bw = g_block[qt][0], bb = g_block[qt][1];
    for (int c = threadIdx.x & 31; c < cols; c += 32) {
        float w = qw(qt, row + (long long)(c / bw) * bb, c % bw);
        #pragma unroll
        for (int t = 0; t < TB; t++)
            if (t < nt) acc[t] += w * x[(long long)tok[t] * ldx + c];
    }
}

// as moe_gate_up: h[pair, r] = act(gate_e x[xrow[pair]] + bg_e, up_e x[xrow[pair]] + bu_e).
// grid (ceil(ffn / (WARPS * rows_per_warp)), groups), block 32 * WARPS.
extern "C" __global__ void qmoe_gate_up(const unsigned long long* __restrict__ base, const int* __restrict__ gstart,
                                        const int* __restrict__ order, const int* __restrict__ xrow,
                                        const float* __restrict__ x, long long ldx, float* __restrict__ h,
                                        int ffn, int hidden, int rows_per_warp, long long off_g,
                                        int qt_g, long long rb_g, long long off_u, int qt_u, long long rb_u,
                                        int act, int bias) {
    int g = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(base[g]);
    int r0 = (blockIdx.x * WARPS + warp) * rows_per_warp;
    for (int r = r0; r < min(r0 + rows_per_warp, ffn); r++) {
        float bg = bias ? reinterpret_cast<const float*>(e)[r] : 0.f;
        float bu = bias ? reinterpret_cast<const float*>(e)[ffn + r] : 0.f;
        for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += TB) {
            int nt = min(TB, gstart[g + 1] - p0), tok[TB];
            for (int t = 0; t < TB; t++) tok[t] = t < nt ? xrow[order[p0 + t]] : 0;
            float ag[TB] = {0.f, 0.f, 0.f, 0.f}, au[TB] = {0.f, 0.f, 0.f, 0.f};
            q_row_dot(qt_g, e + off_g + (long long)r * rb_g, hidden, x, ldx, tok, nt, ag);
            q_row_dot(qt_u, e + off_u + (long long)r * rb_u, hidden, x, ldx, tok, nt, au);
            for (int t = 0; t < TB; t++) {
                float a = q_sum(ag[t]) + bg, b = q_sum(au[t]) + bu;
                if (lane == 0 && t < nt) h[(long long)order[p0 + t] * ffn + r] = q_act(act, a, b);
            }
        }
    }
}

// as moe_down: y[pair, r] = down_e h[pair] + bd_e. grid (ceil(hidden / (WARPS * rows_per_warp)), groups).
extern "C" __global__ void qmoe_down(const unsigned long long* __restrict__ base, const int* __restrict__ gstart,
                                     const int* __restrict__ order, const float* __restrict__ h, float* __restrict__ y,
                                     int ffn, int hidden, int rows_per_warp, long long off_d, int qt_d, long long rb_d,
                                     int bias) {
    int g = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* bd = reinterpret_cast<const float*>(base[g]) + 2 * ffn;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(base[g]) + off_d;
    int r0 = (blockIdx.x * WARPS + warp) * rows_per_warp;
    for (int r = r0; r < min(r0 + rows_per_warp, hidden); r++) {
        float b = bias ? bd[r] : 0.f;
        for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += TB) {
            int nt = min(TB, gstart[g + 1] - p0), tok[TB];
            for (int t = 0; t < TB; t++) tok[t] = t < nt ? order[p0 + t] : 0;
            float a[TB] = {0.f, 0.f, 0.f, 0.f};
            q_row_dot(qt_d, e + (long long)r * rb_d, ffn, h, ffn, tok, nt, a);
            for (int t = 0; t < TB; t++) {
                float s = q_sum(a[t]) + b;
                if (lane == 0 && t < nt) y[(long long)tok[t] * hidden + r] = s;
            }
        }
    }
}

struct Experts1 {  // gpu_kernels.cu's one-token pair table, passed by value
    unsigned long long base[MAXK];
    float weight[MAXK];
    int pick[MAXK];
};

// as moe1_gate_up: h[j, r] = act(gate_j x + bg_j, up_j x + bu_j) for j = pick[blockIdx.y].
// grid (ceil(ffn / (WARPS * rows_per_warp)), pairs picked), block 32 * WARPS.
extern "C" __global__ void qmoe1_gate_up(const Experts1 ex, const float* __restrict__ x, float* __restrict__ h,
                                         int ffn, int hidden, int rows_per_warp, long long off_g, int qt_g,
                                         long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias) {
    int j = ex.pick[blockIdx.y], warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(ex.base[j]);
    int r0 = (blockIdx.x * WARPS + warp) * rows_per_warp, tok[TB] = {0, 0, 0, 0};
    for (int r = r0; r < min(r0 + rows_per_warp, ffn); r++) {
        float ag[TB] = {0.f, 0.f, 0.f, 0.f}, au[TB] = {0.f, 0.f, 0.f, 0.f};
        q_row_dot(qt_g, e + off_g + (long long)r * rb_g, hidden, x, 0, tok, 1, ag);
        q_row_dot(qt_u, e + off_u + (long long)r * rb_u, hidden, x, 0, tok, 1, au);
        float a = q_sum(ag[0]), b = q_sum(au[0]);
        if (bias) {
            a += reinterpret_cast<const float*>(e)[r];
            b += reinterpret_cast<const float*>(e)[ffn + r];
        }
        if (lane == 0) h[(long long)j * ffn + r] = q_act(act, a, b);
    }
}

// as moe1_down_combine: out[r] = sum_j weight[j] * (down_j h[j] + bd_j)[r], j in order.
// grid ceil(hidden / rows_per_block), block 32 * k; rows_per_block <= 32.
extern "C" __global__ void qmoe1_down_combine(const Experts1 ex, const float* __restrict__ h, float* __restrict__ out,
                                              int k, int ffn, int hidden, int rows_per_block, long long off_d,
                                              int qt_d, long long rb_d, int bias) {
    __shared__ float ys[MAXK][32];
    int j = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * rows_per_block, tok[TB] = {0, 0, 0, 0};
    const uint8_t* e = reinterpret_cast<const uint8_t*>(ex.base[j]);
    const float* bd = reinterpret_cast<const float*>(e) + 2 * ffn;
    for (int i = 0; i < rows_per_block && r0 + i < hidden; i++) {
        int r = r0 + i;
        float a[TB] = {0.f, 0.f, 0.f, 0.f};
        q_row_dot(qt_d, e + off_d + (long long)r * rb_d, ffn, h + (long long)j * ffn, 0, tok, 1, a);
        float s = q_sum(a[0]);
        if (lane == 0) ys[j][i] = bias ? s + bd[r] : s;
    }
    __syncthreads();
    int i = threadIdx.x;
    if (i < rows_per_block && r0 + i < hidden) {
        float s = 0.f;
        for (int jj = 0; jj < k; jj++) s += ex.weight[jj] * ys[jj][i];
        out[r0 + i] = s;
    }
}
