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
