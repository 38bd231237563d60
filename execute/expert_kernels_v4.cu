// moelab expert kernels, v4 (MOELAB_DECODE_KERNELS=v4): compiled after gpu_kernels.cu as one source
// (execute/gpu_experts.py), whose definitions and helpers they use.

// ---- v4 one-token expert kernels (MOELAB_DECODE_KERNELS=v4) ------------------------------------
// moe1r_gate_up_v4 / moe1r_down_combine_v4 take the v2 kernels' arguments and grids. For Q8_0
// weights (gate and up both Q8_0; down Q8_0) a warp copies its rows into shared memory with 16-byte
// asynchronous copies (cp.async: aligned 16-byte chunks covering the rows, a row's misalignment kept
// as an offset), all of a warp's rows at once where they fit (else windows of W units, W a
// multiple of 4), then every lane reads its units there exactly as row_dot reads them from global
// memory: the same sums in the same order as v1 and v2 (the same bits). The copies of a block's
// first window are issued before its residency checks (down's: before its wait). Any other type:
// the v2 code.
#define V4_GU_STG 2208  // uint4 of staging per gate/up block (4 warps x 552: 4 rows of 2048 Q8_0 weights)
#define V4_DN_STG 1664  // uint4 of staging per down block, shared out over its warps (8 x 208)

// the shared-memory address of p (a pointer into shared memory)
__device__ __forceinline__ unsigned int shared_addr(const void* p) {
    unsigned int a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

// 16 bits at shared-memory address a (2-aligned); volatile: kept after the copies' wait
__device__ __forceinline__ unsigned short lds16(unsigned int a) {
    unsigned short v;
    asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(a));
    return v;
}

// f[n] = (float)(signed char)(q >> 8 n), n < 4, without a conversion instruction (I2F runs at a
// quarter of the FP32 rate or less: the expert kernels' limit): the float of bits 0x4B0000xx is
// 2^23 + xx, xx the byte with its sign bit flipped; minus 2^23 + 128 (exact)
__device__ __forceinline__ void s8x4_to_f32(unsigned int q, float* f) {
    unsigned int u = q ^ 0x80808080u;
    f[0] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7440)) - 8388736.f;
    f[1] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7441)) - 8388736.f;
    f[2] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7442)) - 8388736.f;
    f[3] = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7443)) - 8388736.f;
}

// dst (shared memory) = src (global memory), 16 bytes, both 16-byte aligned; asynchronous from sm_80
__device__ __forceinline__ void cp_async16(uint4* dst, const uint4* src) {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(shared_addr(dst)), "l"(src) : "memory");
#else
    *dst = *src;
#endif
}

__device__ __forceinline__ void cp_async_wait_all() {
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// uint4 per staged row of a w-unit window (its bytes plus up to 15 of misalignment)
__device__ __forceinline__ int q8_stride(int w) { return (w * 34 + 15) / 16 + 1; }

// units per window for nr rows in cap uint4: the most, a multiple of 4, >= 4 (cap >= nr * 10 assumed)
__device__ __forceinline__ int q8_window(int cap, int nr, int units) {
    int w = ((16 * cap / nr - 31) / 34) & ~3;  // nr * q8_stride(w) <= cap; w + 4 may fit too
    if (nr * q8_stride(w + 4) <= cap) w += 4;
    return min(max(w, 4), (units + 3) & ~3);
}

// issue the copies of units [u0, u0 + wn) of rows[0 .. nr) (nr <= NR) into buf (row i at buf + i * stride)
template <int NR>
__device__ __forceinline__ void q8_stage(const unsigned char* const* rows, int nr, int u0, int wn, uint4* buf,
                                         int stride, int lane) {
    #pragma unroll
    for (int i = 0; i < NR; i++) {
        if (i < nr) {
            const unsigned char* s = rows[i] + u0 * 34;
            int mis = (int)((unsigned long long)s & 15), n16 = (mis + wn * 34 + 15) >> 4;
            const uint4* a = reinterpret_cast<const uint4*>(s - mis);
            for (int c = lane; c < n16; c += 32) cp_async16(buf + i * stride + c, a + c);
        }
    }
}

// acc[i] += the window's part of row_i . x for i < nr (NR >= nr), this lane's units in row_dot's order;
// the window's copies issued by this warp (q8_stage) must be waited for and the warp synchronized
template <int NR>
__device__ __forceinline__ void q8_window_dot(const unsigned char* const* rows, int nr, int u0, int wn,
                                              const uint4* buf, int stride, const float* x, float* acc, int lane) {
    int quad = lane & 7;
    unsigned int b[NR];  // shared-memory addresses of the rows' first unit
    #pragma unroll
    for (int i = 0; i < NR; i++)
        b[i] = shared_addr(buf + i * stride) + (unsigned int)((unsigned long long)(rows[i] + u0 * 34) & 15);
    for (int u = lane >> 3; u < wn; u += 4) {
        float4 xv = *reinterpret_cast<const float4*>(x + (u0 + u) * 32 + 4 * quad);
        #pragma unroll
        for (int i = 0; i < NR; i++) {
            if (i < nr) {
                unsigned int p = b[i] + u * 34;
                float d = h2f(lds16(p));
                unsigned int q = (unsigned int)lds16(p + 2 + 4 * quad) | ((unsigned int)lds16(p + 4 + 4 * quad) << 16);
                float w[4];
                s8x4_to_f32(q, w);
                #pragma unroll
                for (int n = 0; n < 4; n++) w[n] = d * w[n];
                acc[i] += w[0] * xv.x + w[1] * xv.y + w[2] * xv.z + w[3] * xv.w;
            }
        }
    }
}

// acc[i] = row_i . x (i < nr <= NR) through buf (cap uint4, this warp's); when staged, the first
// window's copies were issued already (q8_stage with the same window)
template <int NR>
__device__ __forceinline__ void q8_rows_dot(const unsigned char* const* rows, int nr, int cols, const float* x,
                                            uint4* buf, int cap, bool staged, float* acc, int lane) {
    int units = cols >> 5, w = q8_window(cap, NR, units), stride = q8_stride(w);
    for (int u0 = 0; u0 < units; u0 += w) {
        int wn = min(w, units - u0);
        if (!staged || u0 > 0) q8_stage<NR>(rows, nr, u0, wn, buf, stride, lane);
        cp_async_wait_all();
        __syncwarp();
        q8_window_dot<NR>(rows, nr, u0, wn, buf, stride, x, acc, lane);
        __syncwarp();  // the buffer is rewritten by the next window
    }
}

// grid (ceil(ffn / (WARPS * rows_per_warp)), k), block 32 * WARPS (as moe1r_gate_up).
// Q8_0: a warp stages gate and up of two rows at once (4 rows: 8.6 KB at hidden 2048).
extern "C" __global__ void __launch_bounds__(32 * WARPS, 6) moe1r_gate_up_v4(
        const float* __restrict__ route, const unsigned long long* __restrict__ table, int* halt, int layer, int k,
        const float* __restrict__ x, float* __restrict__ h, int ffn, int hidden, int rows_per_warp, long long off_g,
        int qt_g, long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias) {
    __shared__ uint4 stg[V4_GU_STG];
    pdl_wait_trigger();
    int hv = *(volatile int*)halt;
    int j = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned char* e = reinterpret_cast<const unsigned char*>(route_base(route, table, j));
    int r0 = (blockIdx.x * WARPS + warp) * rows_per_warp, r1 = min(r0 + rows_per_warp, ffn);
    bool q8 = qt_g == Q8_0 && qt_u == Q8_0;
    const int cap = V4_GU_STG / WARPS;
    uint4* buf = stg + warp * cap;
    const unsigned char* rows[4];
    int nr = 0;
    if (q8 && r0 < r1) {  // the first pair of rows (gate, up of r0 and of r0 + 1)
        int r2 = min(r0 + 1, r1 - 1);
        nr = r2 > r0 ? 4 : 2;
        rows[0] = e + off_g + r0 * rb_g;
        rows[1] = e + off_u + r0 * rb_u;
        rows[2] = e + off_g + r2 * rb_g;
        rows[3] = e + off_u + r2 * rb_u;
        if (e && hv >= layer) {
            int w = q8_window(cap, 4, hidden >> 5);
            q8_stage<4>(rows, nr, 0, min(w, hidden >> 5), buf, q8_stride(w), lane);
        }
    }
    if (hv < layer || routes_missing(route, table, k)) {
        cp_async_wait_all();  // no copy left in flight at exit
        if (hv >= layer && threadIdx.x == 0) atomicMin(halt, layer);
        return;
    }
    if (!q8) {
        gate_up_rows_v2(e, j, r0, ffn, hidden, rows_per_warp, off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias, x, h,
                        lane);
        return;
    }
    for (int r = r0; r < r1; r += 2) {
        if (r > r0) {
            int r2 = min(r + 1, r1 - 1);
            nr = r2 > r ? 4 : 2;
            rows[0] = e + off_g + r * rb_g;
            rows[1] = e + off_u + r * rb_u;
            rows[2] = e + off_g + r2 * rb_g;
            rows[3] = e + off_u + r2 * rb_u;
        }
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        q8_rows_dot<4>(rows, nr, hidden, x, buf, cap, r == r0, acc, lane);
        #pragma unroll
        for (int p = 0; p < 2; p++) {
            float a = warp_sum(acc[2 * p]), b = warp_sum(acc[2 * p + 1]);
            int rr = r + p;
            if (2 * p < nr) {
                if (bias) {
                    a += reinterpret_cast<const float*>(e)[rr];
                    b += reinterpret_cast<const float*>(e)[ffn + rr];
                }
                if (lane == 0) h[(long long)j * ffn + rr] = expert_act(act, a, b);
            }
        }
    }
}

// grid ceil(hidden / rows_per_block), block 32 * k; rows_per_block <= 32 (as moe1r_down_combine; v4
// launches it with 4 rows per block: 512 blocks at hidden 2048, one wave). Q8_0: warp j stages its
// pair's rows four at a time (3.3 KB at ffn 768) in its share of the buffer, the first four before
// the wait: v4 launches it programmatically after moe1r_gate_up_v4, which lets it start only once
// every block of that one has waited for the router (so the route is final here; h and halt are
// not until the wait).
extern "C" __global__ void __launch_bounds__(32 * MAXK) moe1r_down_combine_v4(
        const float* __restrict__ route, const unsigned long long* __restrict__ table, const int* halt, int layer,
        const float* __restrict__ h, float* __restrict__ out, int k, int ffn, int hidden, int rows_per_block,
        long long off_d, int qt_d, long long rb_d, int bias) {
    __shared__ float ys[MAXK][32];
    __shared__ uint4 stg[V4_DN_STG];
    int j = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * rows_per_block;
    const unsigned char* e = reinterpret_cast<const unsigned char*>(route_base(route, table, j));
    const float* bd = reinterpret_cast<const float*>(e) + 2 * ffn;
    const float* hj = h + (long long)j * ffn;
    int cap = V4_DN_STG / (blockDim.x >> 5), units = ffn >> 5, r1 = min(r0 + rows_per_block, hidden);
    uint4* buf = stg + j * cap;
    bool q8 = qt_d == Q8_0;
    const unsigned char* rows[4];
    if (q8 && r0 < r1 && e) {  // the first four rows' copies, before the wait (a missing expert: none)
        #pragma unroll
        for (int i = 0; i < 4; i++) rows[i] = e + off_d + min(r0 + i, r1 - 1) * rb_d;
        int w = q8_window(cap, 4, units);
        q8_stage<4>(rows, min(4, r1 - r0), 0, min(w, units), buf, q8_stride(w), lane);
    }
    pdl_wait_trigger();  // h and halt come from moe1r_gate_up_v4
    if (*(volatile const int*)halt <= layer) {
        cp_async_wait_all();  // no copy left in flight at exit
        return;
    }
    for (int i = 0; r0 + i < r1; i += 4) {  // four rows per batch
        int r = r0 + i, nr = min(4, r1 - r);
        float a[4] = {0.f, 0.f, 0.f, 0.f};
        if (q8) {
            #pragma unroll
            for (int t = 0; t < 4; t++) rows[t] = e + off_d + min(r + t, r1 - 1) * rb_d;
            q8_rows_dot<4>(rows, nr, ffn, hj, buf, cap, i == 0, a, lane);
        } else {
            #pragma unroll
            for (int t = 0; t < 4; t += 2) {
                if (t < nr) {
                    int n2 = min(2, nr - t);
                    const unsigned char* rs[2] = {e + off_d + (r + t) * rb_d, e + off_d + (r + t + n2 - 1) * rb_d};
#define V2_D(T) rows_dot_v2<T, 2>(rs, n2, ffn, hj, a + t)
                    V2_DISPATCH(qt_d, V2_D)
#undef V2_D
                }
            }
        }
        #pragma unroll
        for (int t = 0; t < 4; t++) {
            float s = warp_sum(a[t]);
            if (lane == 0 && t < nr) ys[j][i + t] = bias ? s + bd[r + t] : s;
        }
    }
    __syncthreads();
    int i = threadIdx.x;
    if (i < r1 - r0) {
        float s = 0.f;
        for (int jj = 0; jj < k; jj++) s += route[k + jj] * ys[jj][i];
        out[r0 + i] = s;
    }
}
