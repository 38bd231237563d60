// A fused fp16 GEMV, optionally RMSNorm-scaled and with a residual, for the dense stand-ins of
// experiments/bench_executor.py and execute/calibrate.py (read as text by both; no cupy needed to
// read it). The expert kernels are in gpu_kernels.cu.
#define DW 4  // warps per block
#define DR 2  // rows per warp

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float wsum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// 8 fp16 weights (q) . 8 floats (a, b)
__device__ __forceinline__ float dot8(uint4 q, float4 a, float4 b) {
    return h2f(q.x & 0xffff) * a.x + h2f(q.x >> 16) * a.y + h2f(q.y & 0xffff) * a.z + h2f(q.y >> 16) * a.w
         + h2f(q.z & 0xffff) * b.x + h2f(q.z >> 16) * b.y + h2f(q.w & 0xffff) * b.z + h2f(q.w >> 16) * b.w;
}

// y[t, r] = s_t * (w[r] . x[t, :k]) (+ res[t, r]); s_t = rsqrt(mean(x[t, :k]^2) + eps) when norm, else 1.
// w (n_rows, k) fp16 row-major, k % 8 == 0; x rows ldx floats apart (ldx % 4 == 0); y, res (T, n_rows).
// grid (ceil(n_rows / (DW * DR)), T), block 32 * DW.
extern "C" __global__ void gemv_f16(const unsigned short* __restrict__ w, const float* __restrict__ x, long long ldx,
                                    const float* __restrict__ res, float* __restrict__ y, int n_rows, int k,
                                    int norm, float eps) {
    __shared__ float part[DW];
    int t = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* xt = x + t * ldx;
    float s = 1.f;
    if (norm) {
        float q = 0.f;
        for (int c = threadIdx.x; c < k; c += 32 * DW) q += xt[c] * xt[c];
        q = wsum(q);
        if (lane == 0) part[warp] = q;
        __syncthreads();
        q = 0.f;
        for (int i = 0; i < DW; i++) q += part[i];
        s = rsqrtf(q / k + eps);
    }
    const float4* x4 = reinterpret_cast<const float4*>(xt);
    int r0 = (blockIdx.x * DW + warp) * DR;
    for (int r = r0; r < min(r0 + DR, n_rows); r++) {
        const uint4* w8 = reinterpret_cast<const uint4*>(w + (long long)r * k);
        float acc = 0.f;
        #pragma unroll 4
        for (int c = lane; c < k / 8; c += 32) acc += dot8(w8[c], x4[2 * c], x4[2 * c + 1]);
        acc = wsum(acc);
        if (lane == 0) y[(long long)t * n_rows + r] = acc * s + (res ? res[(long long)t * n_rows + r] : 0.f);
    }
}
