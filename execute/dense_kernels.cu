// moelab dense-path kernels for one decode token (T = 1) of a GQA block (compiled at run time by
// CuPy/NVRTC; launched from execute/gpu_dense.py).
//
// Matrices are read in their stored type (qt): F32, F16, BF16 rows as stored; Q8_0 repacked at
// load into int8 quants qs (rows, cols) and one f16 scale per 32 weights d (rows, cols / 32), so
// every row starts 16-byte aligned. cols is a multiple of 32. A warp computes one output row; a
// block of WARPS warps first stages its input vector (optionally x + add_scale * add, optionally
// RMS-normed) in shared memory, so every block recomputes the norm instead of a separate launch.
//
// A CUDA graph replays a block's launches with the arguments it captured; what changes per token
// is read from the block's decode record rec (int64, device memory, copied from the host by the
// graph's first node): rec[REC_POS] the position, rec[REC_LO] the first key, rec[REC_KEYS] the
// number of keys, rec[REC_ADD] the address of the previous block's expert output (0: none). The
// kernels that take rec use it when it is not null and their plain arguments otherwise.

#define WARPS 8
#define CHUNK 64  // keys per block of decode attention
#define NEG_INF __int_as_float(0xff800000u)
#define REC_POS 0
#define REC_LO 1
#define REC_KEYS 2
#define REC_ADD 3

typedef unsigned long long u64;
enum { F32 = 0, F16 = 1, Q8_0 = 8, BF16 = 30 };

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ float bf2f(unsigned short h) { return __uint_as_float((unsigned int)h << 16); }

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// sum of v over the block (every thread gets it); red: >= 32 floats of shared memory
__device__ float block_sum(float v, float* red) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int i = 0; i < nw; i++) s += red[i];
    return s;
}

// 8 packed 16-bit floats . xs[0..7]
__device__ __forceinline__ float dot8h(uint4 q, const float* xs, bool bf) {
    unsigned int u[4] = {q.x, q.y, q.z, q.w};
    float s = 0.f;
    #pragma unroll
    for (int i = 0; i < 4; i++) {
        unsigned short lo = (unsigned short)(u[i] & 0xffffu), hi = (unsigned short)(u[i] >> 16);
        s += (bf ? bf2f(lo) : h2f(lo)) * xs[2 * i] + (bf ? bf2f(hi) : h2f(hi)) * xs[2 * i + 1];
    }
    return s;
}

// this lane's share of row . xs (the caller sums over the warp)
__device__ __forceinline__ float row_dot(const unsigned char* w, const unsigned short* d, int qt, int row,
                                         int cols, const float* xs, int lane) {
    float s = 0.f;
    if (qt == F16 || qt == BF16) {  // 8 weights per 16-byte load
        const uint4* r = reinterpret_cast<const uint4*>(w + (u64)row * cols * 2);
        bool bf = qt == BF16;
        #pragma unroll 4
        for (int i = lane; i < cols / 8; i += 32) s += dot8h(__ldg(r + i), xs + 8 * i, bf);
    } else if (qt == Q8_0) {  // 16 int8 quants per load, one scale per 32
        const uint4* r = reinterpret_cast<const uint4*>(w + (u64)row * cols);
        const unsigned short* dr = d + (u64)row * (cols / 32);
        #pragma unroll 4
        for (int i = lane; i < cols / 16; i += 32) {
            uint4 q = __ldg(r + i);
            unsigned int u[4] = {q.x, q.y, q.z, q.w};
            const float* x = xs + 16 * i;
            float t = 0.f;
            #pragma unroll
            for (int j = 0; j < 16; j++) t += (float)(signed char)(u[j >> 2] >> (8 * (j & 3))) * x[j];
            s += h2f(__ldg(dr + (i >> 1))) * t;
        }
    } else {  // F32: 4 weights per load
        const float4* r = reinterpret_cast<const float4*>(w + (u64)row * cols * 4);
        #pragma unroll 4
        for (int i = lane; i < cols / 4; i += 32) {
            float4 q = __ldg(r + i);
            s += q.x * xs[4 * i] + q.y * xs[4 * i + 1] + q.z * xs[4 * i + 2] + q.w * xs[4 * i + 3];
        }
    }
    return s;
}

// Stage the input in xs[cols]: v = x (+ add_scale * add); block 0 writes v to x_out when given;
// with norm: xs = v * (1 / sqrt(mean(v^2) + eps)) * norm, block 0 writes it to xn_out when given.
__device__ void stage(const float* x, const float* add, float add_scale, float* x_out, const float* norm,
                      float eps, float* xn_out, int cols, float* xs, float* red) {
    float ss = 0.f;
    bool first = blockIdx.x == 0;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        float v = x[i];
        if (add) v += add_scale * add[i];
        if (first && x_out) x_out[i] = v;
        xs[i] = v;
        ss += v * v;
    }
    if (norm) {
        float r = 1.f / sqrtf(block_sum(ss, red) / (float)cols + eps);
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            float v = xs[i] * r * norm[i];
            xs[i] = v;
            if (first && xn_out) xn_out[i] = v;
        }
    }
    __syncthreads();
}

// y[r] = (resid ? resid[r] : 0) + out_scale * (W[r] . xs + (bias ? bias[r] : 0)); resid may be y
__device__ void gemv_rows(const unsigned char* w, const unsigned short* d, int qt, int rows, int cols,
                          const float* xs, const float* bias, const float* resid, float out_scale, float* y) {
    int lane = threadIdx.x & 31, row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (row >= rows) return;
    float s = warp_sum(row_dot(w, d, qt, row, cols, xs, lane));
    if (lane == 0) {
        float v = s + (bias ? bias[row] : 0.f);
        y[row] = (resid ? resid[row] : 0.f) + out_scale * v;
    }
}

// One matrix-vector product with the fused prologue (stage) and epilogue (gemv_rows); with rec,
// add is rec[REC_ADD]. grid (ceil(rows / WARPS)), block 32 * WARPS, dynamic shared memory 4 * cols bytes.
extern "C" __global__ void __launch_bounds__(32 * WARPS) dense_gemv(
        const unsigned char* w, const unsigned short* d, int qt, int rows, int cols,
        const float* x, const float* add, float add_scale, float* x_out, const float* norm, float eps,
        float* xn_out, const float* bias, const float* resid, float out_scale, float* y, const long long* rec) {
    extern __shared__ float xs[];
    __shared__ float red[32];
    if (rec) add = reinterpret_cast<const float*>(rec[REC_ADD]);
    stage(x, add, add_scale, x_out, norm, eps, xn_out, cols, xs, red);
    gemv_rows(w, d, qt, rows, cols, xs, bias, resid, out_scale, y);
}

// Router: logits = W . rmsnorm(x) + bias (dense_gemv), then the last block to finish picks the
// top k on the logits (ties: lower id) and writes out[0..k) = ids (int bits), out[k..2k) =
// weights: gating 0 softmax (probability of each pick over all experts), 1 softmax_topk (softmax
// over the k picked logits); then renormalised to sum 1 (floor 2^-14) when norm_topk, times scale.
// counter: one int, 0 before the launch, 0 again after it. Shared memory 4 * max(cols, rows).
extern "C" __global__ void __launch_bounds__(32 * WARPS) router_topk(
        const unsigned char* w, const unsigned short* d, int qt, int rows, int cols,
        const float* x, const float* norm, float eps, float* xn_out, const float* bias, float* logits,
        int k, int gating, int norm_topk, float scale, int* counter, float* out) {
    extern __shared__ float xs[];
    __shared__ float red[32];
    __shared__ int redi[32];
    __shared__ int last;
    __shared__ float best_v[32];
    stage(x, nullptr, 0.f, nullptr, norm, eps, xn_out, cols, xs, red);
    gemv_rows(w, d, qt, rows, cols, xs, bias, nullptr, 1.f, logits);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    float* lg = xs;  // rows logits, picked ones set to -inf
    for (int i = threadIdx.x; i < rows; i += blockDim.x) lg[i] = __ldcg(logits + i);
    __syncthreads();
    float* picked = best_v;  // k <= 32: logits of the picks, in rank order
    __shared__ int ids[32];
    for (int j = 0; j < k; j++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int i = threadIdx.x; i < rows; i += blockDim.x) {
            float v = lg[i];
            if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { red[warp] = bv; redi[warp] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int i = 1; i < nw; i++)
                if (red[i] > bv || (red[i] == bv && redi[i] < bi)) { bv = red[i]; bi = redi[i]; }
            if (bi < 0 || bi >= rows) bi = 0;  // every logit -inf or NaN: take expert 0
            ids[j] = bi;
            picked[j] = __ldcg(logits + bi);
            lg[bi] = NEG_INF;
        }
        __syncthreads();
    }
    float m = picked[0];
    float z = 0.f;  // softmax denominator over every expert
    if (gating == 0) {
        float s = 0.f;
        for (int i = threadIdx.x; i < rows; i += blockDim.x) s += expf(__ldcg(logits + i) - m);
        z = block_sum(s, red);
    }
    if (threadIdx.x == 0) {
        float wsum = 0.f, wv[32];
        if (gating == 1) {
            for (int j = 0; j < k; j++) z += expf(picked[j] - m);
        }
        for (int j = 0; j < k; j++) {
            wv[j] = expf(picked[j] - m) / z;
            wsum += wv[j];
        }
        float div = norm_topk ? fmaxf(wsum, 6.103515625e-5f) : 1.f;
        for (int j = 0; j < k; j++) {
            out[j] = __int_as_float(ids[j]);
            out[k + j] = wv[j] / div * scale;
        }
        *counter = 0;
    }
}

// q/k norm (mode 0 none, 1 per head over hd, 2 full: over all of q or all of k), NeoX RoPE at pos
// (tables cos, sin (n, hd); out[i] = v[i] cos[i] + v[(i + hd/2) % hd] sin[i]), then q to q_out
// (nh, hd) and k, v appended at pos of the caches (nkv, cache_n, hd). qkv: q (nh*hd) | k | v.
// nw: (nh + nkv) * hd norm weights; with rec, pos is rec[REC_POS].
// grid (nh + 2 nkv), block hd rounded up to whole warps (<= 1024).
extern "C" __global__ void qk_rope_kv(const float* qkv, int nh, int nkv, int hd, const float* nw, int mode,
                                      float eps, const float* cos, const float* sin, int pos, float* q_out,
                                      float* kc, float* vc, int cache_n, const long long* rec) {
    __shared__ float red[32];
    __shared__ float v_s[1024];
    if (rec) pos = (int)rec[REC_POS];
    int b = blockIdx.x, i = threadIdx.x;
    bool on = i < hd;
    if (b >= nh + nkv) {
        int h = b - nh - nkv;
        if (on) vc[((u64)h * cache_n + pos) * hd + i] = qkv[(u64)(nh + nkv) * hd + h * hd + i];
        return;
    }
    float v = on ? qkv[b * hd + i] : 0.f;
    if (mode == 1) {
        float r = 1.f / sqrtf(block_sum(v * v, red) / (float)hd + eps);
        if (on) v = v * r * nw[b * hd + i];
    } else if (mode == 2) {
        int lo = b < nh ? 0 : nh * hd, n = b < nh ? nh * hd : nkv * hd;
        float ss = 0.f;
        for (int j = i; j < n; j += blockDim.x) {
            float u = qkv[lo + j];
            ss += u * u;
        }
        float r = 1.f / sqrtf(block_sum(ss, red) / (float)n + eps);
        if (on) v = v * r * nw[b * hd + i];
    }
    if (on) v_s[i] = v;
    __syncthreads();
    if (!on) return;
    float o = v * cos[(u64)pos * hd + i] + v_s[(i + hd / 2) % hd] * sin[(u64)pos * hd + i];
    if (b < nh) q_out[b * hd + i] = o;
    else kc[((u64)(b - nh) * cache_n + pos) * hd + i] = o;
}

// Decode attention, split over the keys: block (h, s) covers keys lo + s*CHUNK .. of q head h
// (kv head h / (nh / nkv)), online softmax per warp (one key per warp at a time, lane holds dims
// lane + 32 j), then the warps merged; part[(h * S + s) * (hd + 2)] = max, sum, acc[hd].
// grid (nh, S >= ceil(n_keys / CHUNK)), block 128, hd <= 256; blocks past the keys write nothing
// (a graph launches the S of the longest range and reads lo and n_keys from rec).
extern "C" __global__ void __launch_bounds__(128) attn_partial(
        const float* q, const float* kc, const float* vc, int nh, int nkv, int hd, int cache_n, int lo,
        int n_keys, float scale, float* part, const long long* rec) {
    __shared__ float sm[4][258];
    int h = blockIdx.x, s = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (rec) {
        lo = (int)rec[REC_LO];
        n_keys = (int)rec[REC_KEYS];
    }
    if (s * CHUNK >= n_keys) return;  // the whole block: no barrier is skipped
    int kvh = h / (nh / nkv), k0 = lo + s * CHUNK, k1 = min(k0 + CHUNK, lo + n_keys);
    float qr[8], acc[8];
    #pragma unroll
    for (int j = 0; j < 8; j++) {
        int c = lane + 32 * j;
        qr[j] = c < hd ? q[h * hd + c] : 0.f;
        acc[j] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    const float* kb = kc + (u64)kvh * cache_n * hd;
    const float* vb = vc + (u64)kvh * cache_n * hd;
    for (int t = k0 + warp; t < k1; t += 4) {
        float dot = 0.f;
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            int c = lane + 32 * j;
            if (c < hd) dot += qr[j] * kb[(u64)t * hd + c];
        }
        float sc = warp_sum(dot) * scale;
        float mn = fmaxf(m, sc), cf = expf(m - mn), p = expf(sc - mn);
        l = l * cf + p;
        #pragma unroll
        for (int j = 0; j < 8; j++) {
            int c = lane + 32 * j;
            if (c < hd) acc[j] = acc[j] * cf + p * vb[(u64)t * hd + c];
        }
        m = mn;
    }
    #pragma unroll
    for (int j = 0; j < 8; j++) {
        int c = lane + 32 * j;
        if (c < hd) sm[warp][2 + c] = acc[j];
    }
    if (lane == 0) { sm[warp][0] = m; sm[warp][1] = l; }
    __syncthreads();
    float M = fmaxf(fmaxf(sm[0][0], sm[1][0]), fmaxf(sm[2][0], sm[3][0]));
    float* out = part + ((u64)h * gridDim.y + s) * (hd + 2);
    for (int c = threadIdx.x; c < hd + 2; c += blockDim.x) {
        float v = 0.f;
        for (int w = 0; w < 4; w++) {
            float f = sm[w][0] == NEG_INF ? 0.f : expf(sm[w][0] - M);
            v += (c == 1 ? sm[w][1] : sm[w][c]) * f;
        }
        out[c] = c == 0 ? M : v;
    }
}

// Merge the partial results of each head (+ the head's sink logit in the denominator when
// sinks != 0): o[h * hd + c]. S partials per head in part; the first S are merged, or with rec the
// first ceil(rec[REC_KEYS] / CHUNK). grid (nh), block hd.
extern "C" __global__ void attn_reduce(const float* part, int nh, int hd, int S, const float* sinks, float* o,
                                       const long long* rec) {
    int h = blockIdx.x, c = threadIdx.x;
    const float* p = part + (u64)h * S * (hd + 2);
    int used = rec ? (int)((rec[REC_KEYS] + CHUNK - 1) / CHUNK) : S;
    float M = sinks ? sinks[h] : NEG_INF;
    for (int s = 0; s < used; s++) M = fmaxf(M, p[s * (hd + 2)]);
    float L = sinks ? expf(sinks[h] - M) : 0.f, acc = 0.f;
    for (int s = 0; s < used; s++) {
        float m = p[s * (hd + 2)];
        float f = m == NEG_INF ? 0.f : expf(m - M);
        L += p[s * (hd + 2) + 1] * f;
        acc += p[s * (hd + 2) + 2 + c] * f;
    }
    o[h * hd + c] = acc / L;
}

// out (rows, cols) float32 = the matrix rows r0 .. r0 + rows - 1 dequantized (chunks of T > 1).
extern "C" __global__ void dequant_rows(const unsigned char* w, const unsigned short* d, int qt, int r0, int rows,
                                        int cols, float* out) {
    u64 n = (u64)rows * cols;
    for (u64 e = (u64)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x) {
        u64 r = r0 + e / cols, c = e % cols, at = r * cols + c;
        float v;
        if (qt == F16) v = h2f(reinterpret_cast<const unsigned short*>(w)[at]);
        else if (qt == BF16) v = bf2f(reinterpret_cast<const unsigned short*>(w)[at]);
        else if (qt == Q8_0) v = h2f(d[r * (cols / 32) + c / 32]) * (float)(signed char)w[at];
        else v = reinterpret_cast<const float*>(w)[at];
        out[e] = v;
    }
}
