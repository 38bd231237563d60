// moelab dense-path kernels, v2 (MOELAB_DECODE_KERNELS=v2, v3): compiled after dense_kernels.cu as
// one source (execute/gpu_dense.py), whose definitions and helpers they use.

// ---- v2 one-token kernels (MOELAB_DECODE_KERNELS=v2, v3) ---------------------------------------
// dense_gemv_v2 takes dense_gemv's arguments and launch shape and computes the same sums in the
// same order; each warp issues its row's first PRE 16-byte loads per lane (and their Q8_0 scales)
// before the block stages its input, so the prologue (x + add, the RMS norm, two barriers)
// overlaps the weights' latency instead of preceding it. attn_partial_v2 takes attn_partial's
// arguments, grid and output: each warp reads KB keys (and their values) per round before
// reducing any of them, and updates its online softmax once per round (the sums' order, not the
// math, differs from attn_partial's one key at a time).
#define PRE 8
#define KB 8

// Programmatic dependent launch (v3 launches these kernels with it): wait for the grids this one
// depends on (their writes visible), and let the next grid start its blocks (its prologue) early.
// Both do nothing for a plain launch, or below sm_90.
__device__ __forceinline__ void pdl_wait() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ void pdl_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// bytes of one stored row of cols weights (Q8_0: its int8 quants; the scales are apart)
__device__ __forceinline__ int stored_row_bytes(int qt, int cols) {
    return qt == Q8_0 ? cols : qt == F32 ? 4 * cols : 2 * cols;
}

// (float)(signed char)(q >> 8 j) for j < 4 without a conversion instruction (I2F runs at a quarter
// of the FP32 rate or less): the float of bits 0x4B0000xx is 2^23 + xx, xx the byte with its sign
// bit flipped; minus 2^23 + 128 (exact: the same values)
__device__ __forceinline__ float q8_byte(unsigned int flipped, int j) {
    return __uint_as_float(__byte_perm(flipped, 0x4B000000u, 0x7440 + j)) - 8388736.f;
}

// 16 int8 quants . x[0..15], in row_dot's order
__device__ __forceinline__ float dot16q(uint4 q, const float* x) {
    unsigned int u[4] = {q.x ^ 0x80808080u, q.y ^ 0x80808080u, q.z ^ 0x80808080u, q.w ^ 0x80808080u};
    float t = 0.f;
    #pragma unroll
    for (int j = 0; j < 16; j++) t += q8_byte(u[j >> 2], j & 3) * x[j];
    return t;
}

// row_dot's sum for this lane, the first PRE loads (16 bytes at lane + 32 p) given in pre / dpre
__device__ __forceinline__ float row_dot_pre(const unsigned char* w, const unsigned short* d, int qt, int row,
                                             int cols, const float* xs, int lane, const uint4* pre,
                                             const unsigned short* dpre) {
    int rb = stored_row_bytes(qt, cols), n = rb / 16;
    const uint4* r = reinterpret_cast<const uint4*>(w + (u64)row * rb);
    float s = 0.f;
    if (qt == F16 || qt == BF16) {
        bool bf = qt == BF16;
        #pragma unroll
        for (int p = 0; p < PRE; p++) {
            int i = lane + 32 * p;
            if (i < n) s += dot8h(pre[p], xs + 8 * i, bf);
        }
        #pragma unroll 4
        for (int i = lane + 32 * PRE; i < n; i += 32) s += dot8h(__ldg(r + i), xs + 8 * i, bf);
    } else if (qt == Q8_0) {
        const unsigned short* dr = d + (u64)row * (cols / 32);
        #pragma unroll
        for (int p = 0; p < PRE; p++) {
            int i = lane + 32 * p;
            if (i < n) s += h2f(dpre[p]) * dot16q(pre[p], xs + 16 * i);
        }
        #pragma unroll 4
        for (int i = lane + 32 * PRE; i < n; i += 32) s += h2f(__ldg(dr + (i >> 1))) * dot16q(__ldg(r + i), xs + 16 * i);
    } else {
        #pragma unroll
        for (int p = 0; p < PRE; p++) {
            int i = lane + 32 * p;
            if (i < n) {
                const float* x = xs + 4 * i;
                s += __uint_as_float(pre[p].x) * x[0] + __uint_as_float(pre[p].y) * x[1] +
                     __uint_as_float(pre[p].z) * x[2] + __uint_as_float(pre[p].w) * x[3];
            }
        }
        const float4* r4 = reinterpret_cast<const float4*>(r);
        #pragma unroll 4
        for (int i = lane + 32 * PRE; i < n; i += 32) {
            float4 q = __ldg(r4 + i);
            s += q.x * xs[4 * i] + q.y * xs[4 * i + 1] + q.z * xs[4 * i + 2] + q.w * xs[4 * i + 3];
        }
    }
    return s;
}

// grid (ceil(rows / WARPS)), block 32 * WARPS, dynamic shared memory 4 * cols bytes (as dense_gemv).
extern "C" __global__ void __launch_bounds__(32 * WARPS, 4) dense_gemv_v2(
        const unsigned char* w, const unsigned short* d, int qt, int rows, int cols,
        const float* x, const float* add, float add_scale, float* x_out, const float* norm, float eps,
        float* xn_out, const float* bias, const float* resid, float out_scale, float* y, const long long* rec) {
    extern __shared__ float xs[];
    __shared__ float red[32];
    int lane = threadIdx.x & 31, row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    bool live = row < rows;
    uint4 pre[PRE];
    unsigned short dpre[PRE];
    if (live) {
        int rb = stored_row_bytes(qt, cols), n = rb / 16;
        const uint4* r = reinterpret_cast<const uint4*>(w + (u64)row * rb);
        const unsigned short* dr = qt == Q8_0 ? d + (u64)row * (cols / 32) : nullptr;
        #pragma unroll
        for (int p = 0; p < PRE; p++) {
            int i = min(lane + 32 * p, n - 1);
            pre[p] = __ldg(r + i);
            dpre[p] = dr ? __ldg(dr + (i >> 1)) : (unsigned short)0;
        }
    }
    pdl_trigger();
    pdl_wait();  // the weights are in flight; the input and rec's add come from earlier grids
    if (rec) add = reinterpret_cast<const float*>(rec[REC_ADD]);
    stage(x, add, add_scale, x_out, norm, eps, xn_out, cols, xs, red);
    if (!live) return;
    float s = warp_sum(row_dot_pre(w, d, qt, row, cols, xs, lane, pre, dpre));
    if (lane == 0) {
        float v = s + (bias ? bias[row] : 0.f);
        y[row] = (resid ? resid[row] : 0.f) + out_scale * v;
    }
}

// grid (nh, S >= ceil(n_keys / CHUNK)), block 128, hd <= 256 (as attn_partial).
extern "C" __global__ void __launch_bounds__(128) attn_partial_v2(
        const float* q, const float* kc, const float* vc, int nh, int nkv, int hd, int cache_n, int lo,
        int n_keys, float scale, float* part, const long long* rec) {
    __shared__ float sm[4][258];
    int h = blockIdx.x, s = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    pdl_trigger();
    pdl_wait();  // q and this position's key come from earlier grids
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
    for (int t0 = k0 + warp; t0 < k1; t0 += 4 * KB) {  // this warp's keys t0 + 4 b, b < KB
        float kv[KB][8], vv[KB][8], sc[KB];
        #pragma unroll
        for (int b = 0; b < KB; b++) {
            int t = min(t0 + 4 * b, k1 - 1);
            #pragma unroll
            for (int j = 0; j < 8; j++) {
                int c = lane + 32 * j;
                kv[b][j] = c < hd ? kb[(u64)t * hd + c] : 0.f;
                vv[b][j] = c < hd ? vb[(u64)t * hd + c] : 0.f;
            }
        }
        float mn = m;
        #pragma unroll
        for (int b = 0; b < KB; b++) {
            float dot = 0.f;
            #pragma unroll
            for (int j = 0; j < 8; j++) dot += qr[j] * kv[b][j];
            sc[b] = t0 + 4 * b < k1 ? warp_sum(dot) * scale : NEG_INF;
            mn = fmaxf(mn, sc[b]);
        }
        float cf = expf(m - mn);  // m = -inf before the first round: 0
        l *= cf;
        #pragma unroll
        for (int j = 0; j < 8; j++) acc[j] *= cf;
        #pragma unroll
        for (int b = 0; b < KB; b++) {
            float p = sc[b] == NEG_INF ? 0.f : expf(sc[b] - mn);
            l += p;
            #pragma unroll
            for (int j = 0; j < 8; j++) acc[j] += p * vv[b][j];
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

// router_topk's arguments, launch shape and ids; its weights' softmax sums may round otherwise.
// The GEMV is dense_gemv_v2's (weights prefetched before the prologue); the last block's top k is
// picked by warp 0 alone (k argmax rounds over the logits in shared memory, shuffles, no block
// barriers; ties: lower id, as router_topk), and the softmax denominator over every expert is
// warp 0's sum too.
extern "C" __global__ void __launch_bounds__(32 * WARPS, 4) router_topk_v2(
        const unsigned char* w, const unsigned short* d, int qt, int rows, int cols,
        const float* x, const float* norm, float eps, float* xn_out, const float* bias, float* logits,
        int k, int gating, int norm_topk, float scale, int* counter, float* out) {
    extern __shared__ float xs[];
    __shared__ float red[32];
    __shared__ int last;
    int lane = threadIdx.x & 31, row = blockIdx.x * WARPS + (threadIdx.x >> 5);
    bool live = row < rows;
    uint4 pre[PRE];
    unsigned short dpre[PRE];
    if (live) {
        int rb = stored_row_bytes(qt, cols), n = rb / 16;
        const uint4* r = reinterpret_cast<const uint4*>(w + (u64)row * rb);
        const unsigned short* dr = qt == Q8_0 ? d + (u64)row * (cols / 32) : nullptr;
        #pragma unroll
        for (int p = 0; p < PRE; p++) {
            int i = min(lane + 32 * p, n - 1);
            pre[p] = __ldg(r + i);
            dpre[p] = dr ? __ldg(dr + (i >> 1)) : (unsigned short)0;
        }
    }
    pdl_trigger();
    pdl_wait();
    stage(x, nullptr, 0.f, nullptr, norm, eps, xn_out, cols, xs, red);
    if (live) {
        float s = warp_sum(row_dot_pre(w, d, qt, row, cols, xs, lane, pre, dpre));
        if (lane == 0) logits[row] = s + (bias ? bias[row] : 0.f);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    float* lg = xs;  // rows logits, picked ones set to -inf
    for (int i = threadIdx.x; i < rows; i += blockDim.x) lg[i] = __ldcg(logits + i);
    __syncthreads();
    if (threadIdx.x >= 32) return;
    int ids = 0;          // lane j < k: the j-th pick
    float picked = 0.f;   // its logit
    for (int j = 0; j < k; j++) {
        float bv = NEG_INF;
        int bi = 0x7fffffff;
        for (int i = lane; i < rows; i += 32) {
            float v = lg[i];
            if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
        }
        #pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (bi < 0 || bi >= rows) bi = 0;  // every logit -inf or NaN: take expert 0
        if (lane == j) {
            ids = bi;
            picked = __ldcg(logits + bi);
        }
        __syncwarp();
        if (lane == 0) lg[bi] = NEG_INF;
        __syncwarp();
    }
    float m = __shfl_sync(0xffffffffu, picked, 0), z;
    float e = lane < k ? expf(picked - m) : 0.f;
    if (gating == 0) {  // softmax over every expert
        float s = 0.f;
        for (int i = lane; i < rows; i += 32) s += expf(__ldcg(logits + i) - m);
        z = warp_sum(s);
    } else {  // softmax over the k picks
        z = warp_sum(e);
    }
    float wv = e / z, wsum = warp_sum(wv);
    float div = norm_topk ? fmaxf(wsum, 6.103515625e-5f) : 1.f;
    if (lane < k) {
        out[lane] = __int_as_float(ids);
        out[k + lane] = wv / div * scale;
    }
    if (lane == 0) *counter = 0;
}

// qk_rope_kv and attn_reduce as they are, waiting for their inputs first (v3 launches them with
// programmatic dependent launch too, so no node of the dense chain is a full barrier).
extern "C" __global__ void qk_rope_kv_v2(const float* qkv, int nh, int nkv, int hd, const float* nw, int mode,
                                         float eps, const float* cos, const float* sin, int pos, float* q_out,
                                         float* kc, float* vc, int cache_n, const long long* rec) {
    __shared__ float red[32];
    __shared__ float v_s[1024];
    pdl_trigger();
    pdl_wait();
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

extern "C" __global__ void attn_reduce_v2(const float* part, int nh, int hd, int S, const float* sinks, float* o,
                                          const long long* rec) {
    pdl_trigger();
    pdl_wait();
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
