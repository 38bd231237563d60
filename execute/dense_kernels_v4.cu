// moelab dense-path kernels, v4 (MOELAB_DECODE_KERNELS=v4): compiled after dense_kernels.cu and
// dense_kernels_v2.cu as one source (execute/gpu_dense.py), whose definitions and helpers they use.

// ---- v4 one-token kernels (MOELAB_DECODE_KERNELS=v4) -------------------------------------------
// dense_gemv_v4 takes dense_gemv's arguments; its grid and block may be smaller: a warp computes
// rpw = ceil(rows / warps launched) consecutive rows (v4 launches blocks of 4 warps, 2 rows per
// warp when a row holds at most 4 KB), so a whole qkv or wo GEMV is one wave of blocks whose every
// row is in flight (up to 16 16-byte loads per lane, 8 for Q8_0, issued before the launch's
// wait). Each row is summed in row_dot's order (the same bits as dense_gemv). router_topk_v4 takes router_topk's arguments with
// one row per block (grid rows): every thread's share of its row is loaded before the wait; a
// block's sum over its threads, then the last block ranks the logits (one thread per expert
// counts those above it: ties to the lower id, NaN as -inf) and warp 0 takes the softmax.
#define PRE4 16
// stage (dense_kernels.cu) with its loads batched: SB elements per thread (x, add; then the norm)
// issued before any is used, instead of one global latency per element; the same values in the
// same order (the same bits). The norm (a weight) may have been prefetched (prefetch_norm).
template <int SB>
__device__ void stage_v4(const float* x, const float* add, float add_scale, float* x_out, const float* norm,
                         float eps, float* xn_out, int cols, float* xs, float* red) {
    int t = threadIdx.x, nt = blockDim.x;
    bool first = blockIdx.x == 0;
#if __CUDA_ARCH__ >= 800
    unsigned int xa;
    asm("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(xa) : "l"(xs));
    if (!add && !norm && !x_out && ((xa | (unsigned int)(u64)x | cols) & 15) == 0) {  // a plain copy
        for (int c = t; c < cols / 4; c += nt)  // asynchronous 16-byte copies: no register per element
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(xa + 16 * c), "l"(x + 4 * c) : "memory");
        asm volatile("cp.async.wait_all;" ::: "memory");
        __syncthreads();
        return;
    }
#endif
    float ss = 0.f;
    for (int i0 = t; i0 < cols; i0 += SB * nt) {
        float v[SB], a[SB];
        #pragma unroll
        for (int b = 0; b < SB; b++) {
            int i = min(i0 + b * nt, cols - 1);
            v[b] = x[i];
            a[b] = add ? add[i] : 0.f;
        }
        #pragma unroll
        for (int b = 0; b < SB; b++) {
            int i = i0 + b * nt;
            if (i < cols) {
                float u = v[b];
                if (add) u += add_scale * a[b];
                if (first && x_out) x_out[i] = u;
                xs[i] = u;
                ss += u * u;
            }
        }
    }
    if (norm) {
        float r = 1.f / sqrtf(block_sum(ss, red) / (float)cols + eps);
        for (int i0 = t; i0 < cols; i0 += SB * nt) {
            float g[SB];
            #pragma unroll
            for (int b = 0; b < SB; b++) g[b] = __ldg(norm + min(i0 + b * nt, cols - 1));
            #pragma unroll
            for (int b = 0; b < SB; b++) {
                int i = i0 + b * nt;
                if (i < cols) {
                    float u = xs[i] * r * g[b];
                    xs[i] = u;
                    if (first && xn_out) xn_out[i] = u;
                }
            }
        }
    }
    __syncthreads();
}

// the norm's lines into L1 (a weight: before the launch's wait)
__device__ __forceinline__ void prefetch_norm(const float* norm, int cols) {
    if (norm)
        for (int i = 32 * threadIdx.x; i < cols; i += 32 * blockDim.x)
            asm volatile("prefetch.global.L1 [%0];" ::"l"(norm + i));
}

__device__ __forceinline__ float dot4f(uint4 q, const float* x) {  // row_dot's F32 order
    return __uint_as_float(q.x) * x[0] + __uint_as_float(q.y) * x[1] + __uint_as_float(q.z) * x[2] +
           __uint_as_float(q.w) * x[3];
}

__device__ __forceinline__ float chunk_dot(int qt, uint4 q, unsigned short dq, const float* xs, int i) {
    if (qt == Q8_0) return h2f(dq) * dot16q(q, xs + 16 * i);
    if (qt == F32) return dot4f(q, xs + 4 * i);
    return dot8h(q, xs + 8 * i, qt == BF16);
}

// this warp's rows: rpw = ceil(rows / warps launched) from r0; when rpw is 2, both rows' first P / 2
// chunks per lane are loaded before the wait, else the first row's first P (rows after the first
// of rpw > 2: row_dot). QT a type class (F16 for F16 and BF16; Q8_0; F32), qt the type. One call
// site of stage (its barriers) for every warp of the block.
template <int QT, int P>
__device__ __forceinline__ void gemv_v4(const unsigned char* w, const unsigned short* d, int qt, int rows, int cols,
                                        const float* x, const float* add, float add_scale, float* x_out,
                                        const float* norm, float eps, float* xn_out, const float* bias,
                                        const float* resid, float out_scale, float* y, const long long* rec,
                                        float* xs, float* red) {
    int nwb = blockDim.x >> 5, warps = gridDim.x * nwb, rpw = (rows + warps - 1) / warps;
    int lane = threadIdx.x & 31, r0 = (blockIdx.x * nwb + (threadIdx.x >> 5)) * rpw, nr = min(rpw, rows - r0);
    int rb = stored_row_bytes(qt, cols), n = rb / 16;
    bool two = rpw == 2 && nr == 2;
    int qn = two ? P / 2 : P;  // chunks per lane prefetched per row
    uint4 pre[P];
    unsigned short dpre[QT == Q8_0 ? P : 1];
    if (nr > 0) {
        #pragma unroll
        for (int p = 0; p < P; p++) {
            int rl = two && p >= P / 2, i = min(lane + 32 * (p - rl * (P / 2)), n - 1);
            pre[p] = __ldg(reinterpret_cast<const uint4*>(w + (u64)(r0 + rl) * rb) + i);
            if (QT == Q8_0) dpre[p] = __ldg(d + (u64)(r0 + rl) * (cols / 32) + (i >> 1));
        }
    }
    prefetch_norm(norm, cols);
    pdl_trigger();
    pdl_wait();  // the weights are in flight; the input and rec's add come from earlier grids
    if (rec) add = reinterpret_cast<const float*>(rec[REC_ADD]);
    stage_v4<4>(x, add, add_scale, x_out, norm, eps, xn_out, cols, xs, red);  // (registers)
    if (nr <= 0) return;
    float s[2] = {0.f, 0.f};
    #pragma unroll
    for (int p = 0; p < P; p++) {
        int rl = two && p >= P / 2, i = lane + 32 * (p - rl * (P / 2));
        if (i < n && (two || p < qn)) {
            float v = QT == Q8_0 ? h2f(dpre[QT == Q8_0 ? p : 0]) * dot16q(pre[p], xs + 16 * i)
                    : QT == F32  ? dot4f(pre[p], xs + 4 * i)
                                 : dot8h(pre[p], xs + 8 * i, qt == BF16);
            if (rl) s[1] += v;
            else s[0] += v;
        }
    }
    #pragma unroll
    for (int rl = 0; rl < 2; rl++) {
        if (rl == 0 || two) {
            int row = r0 + rl;
            const uint4* r = reinterpret_cast<const uint4*>(w + (u64)row * rb);
            const unsigned short* dr = QT == Q8_0 ? d + (u64)row * (cols / 32) : nullptr;
            float t = s[rl];
            #pragma unroll 4
            for (int i = lane + 32 * qn; i < n; i += 32)
                t += chunk_dot(qt, __ldg(r + i), QT == Q8_0 ? __ldg(dr + (i >> 1)) : (unsigned short)0, xs, i);
            t = warp_sum(t);
            if (lane == 0) {
                float v = t + (bias ? bias[row] : 0.f);
                y[row] = (resid ? resid[row] : 0.f) + out_scale * v;
            }
        }
    }
    for (int rl = two ? 2 : 1; rl < nr; rl++) {
        int row = r0 + rl;
        float t = warp_sum(row_dot(w, d, qt, row, cols, xs, lane));
        if (lane == 0) {
            float v = t + (bias ? bias[row] : 0.f);
            y[row] = (resid ? resid[row] : 0.f) + out_scale * v;
        }
    }
}

// grid (any), block 32 x (1 .. 4) (v4 launches 128), dynamic shared memory 4 * cols bytes; 96
// registers: 5 blocks of 4 warps per SM (qkv at qwen3-30b-a3b: 640 blocks, 2 rows per warp, one wave).
extern "C" __global__ void __launch_bounds__(128, 5) dense_gemv_v4(
        const unsigned char* w, const unsigned short* d, int qt, int rows, int cols,
        const float* x, const float* add, float add_scale, float* x_out, const float* norm, float eps,
        float* xn_out, const float* bias, const float* resid, float out_scale, float* y, const long long* rec) {
    extern __shared__ float xs[];
    __shared__ float red[32];
    if (qt == Q8_0)
        gemv_v4<Q8_0, PRE4 / 2>(w, d, qt, rows, cols, x, add, add_scale, x_out, norm, eps, xn_out, bias, resid,
                                out_scale, y, rec, xs, red);
    else if (qt == F32)
        gemv_v4<F32, PRE4>(w, d, qt, rows, cols, x, add, add_scale, x_out, norm, eps, xn_out, bias, resid, out_scale,
                           y, rec, xs, red);
    else
        gemv_v4<F16, PRE4>(w, d, qt, rows, cols, x, add, add_scale, x_out, norm, eps, xn_out, bias, resid, out_scale,
                           y, rec, xs, red);
}

#define RPRE 4  // 16-byte loads per thread of a router row issued before the wait

// this thread's share (chunks t, t + blockDim, ...) of a row . xs; with pre, its first RPRE chunks
// are pre / dpre. QT: Q8_0, F32, or F16 (bf: BF16)
template <int QT>
__device__ __forceinline__ float thread_row_dot(const uint4* r, const unsigned short* dr, int n, const float* xs,
                                                const uint4* pre, const unsigned short* dpre, bool use_pre,
                                                bool bf = false) {
    int t = threadIdx.x, nt = blockDim.x, i0 = t;
    float s = 0.f;
    if (use_pre) {
        #pragma unroll
        for (int p = 0; p < RPRE; p++) {
            int i = t + nt * p;
            if (i < n) s += QT == Q8_0 ? h2f(dpre[p]) * dot16q(pre[p], xs + 16 * i) : QT == F32 ? dot4f(pre[p], xs + 4 * i)
                                                                                                 : dot8h(pre[p], xs + 8 * i, bf);
        }
        i0 = t + nt * RPRE;
    }
    #pragma unroll 1
    for (int i = i0; i < n; i += nt) {
        uint4 q = __ldg(r + i);
        s += QT == Q8_0 ? h2f(__ldg(dr + (i >> 1))) * dot16q(q, xs + 16 * i) : QT == F32 ? dot4f(q, xs + 4 * i)
                                                                                          : dot8h(q, xs + 8 * i, bf);
    }
    return s;
}

// grid (rows) (any grid works: a block takes ceil(rows / grid) rows), block 32 * WARPS, dynamic
// shared memory 4 * max(cols, rows) bytes (as router_topk).
extern "C" __global__ void __launch_bounds__(32 * WARPS, 2) router_topk_v4(
        const unsigned char* w, const unsigned short* d, int qt, int rows, int cols,
        const float* x, const float* norm, float eps, float* xn_out, const float* bias, float* logits,
        int k, int gating, int norm_topk, float scale, int* counter, float* out) {
    extern __shared__ float xs[];
    __shared__ float red[32];
    __shared__ int last, ids_s[32];
    int t = threadIdx.x, nt = blockDim.x, lane = t & 31, warp = t >> 5, nw = nt >> 5;
    int rpb = (rows + gridDim.x - 1) / gridDim.x, ra = blockIdx.x * rpb, rz = min(ra + rpb, rows);
    int rb = stored_row_bytes(qt, cols), n = rb / 16;
    uint4 pre[RPRE];
    unsigned short dpre[RPRE] = {0, 0, 0, 0};  // Q8_0 rows are read after the wait (routers are F32 in GGUF)
    if (ra < rz && qt != Q8_0) {
        const uint4* r = reinterpret_cast<const uint4*>(w + (u64)ra * rb);
        #pragma unroll
        for (int p = 0; p < RPRE; p++) pre[p] = __ldg(r + min(t + nt * p, n - 1));
    }
    prefetch_norm(norm, cols);
    pdl_trigger();
    pdl_wait();
    stage_v4<8>(x, nullptr, 0.f, nullptr, norm, eps, xn_out, cols, xs, red);
    for (int row = ra; row < rz; row++) {
        const uint4* r = reinterpret_cast<const uint4*>(w + (u64)row * rb);
        const unsigned short* dr = qt == Q8_0 ? d + (u64)row * (cols / 32) : nullptr;
        float s = qt == Q8_0 ? thread_row_dot<Q8_0>(r, dr, n, xs, pre, dpre, false)  // (registers)
                  : qt == F32  ? thread_row_dot<F32>(r, dr, n, xs, pre, dpre, row == ra)
                               : thread_row_dot<F16>(r, dr, n, xs, pre, dpre, row == ra, qt == BF16);
        s = warp_sum(s);
        __syncthreads();  // red is free (stage's block_sum, or the row before)
        if (lane == 0) red[warp] = s;
        __syncthreads();
        if (t == 0) {
            float v = 0.f;
            for (int i = 0; i < nw; i++) v += red[i];
            logits[row] = v + (bias ? bias[row] : 0.f);
        }
    }
    __threadfence();
    __syncthreads();
    if (t == 0) last = atomicAdd(counter, 1) == (int)gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    float* lg = xs;  // the logits
    for (int i = t; i < rows; i += nt) lg[i] = __ldcg(logits + i);
    if (t < 32) ids_s[t] = 0;  // picks past the rows (k > rows): expert 0
    __syncthreads();
    for (int i = t; i < rows; i += nt) {  // rank of logit i: how many come before it
        float v = lg[i];
        v = v != v ? NEG_INF : v;
        int rank = 0;
        #pragma unroll 4
        for (int j = 0; j < rows; j++) {
            float u = lg[j];
            u = u != u ? NEG_INF : u;
            rank += u > v || (u == v && j < i);
        }
        if (rank < k) ids_s[rank] = i;
    }
    __syncthreads();
    if (t >= 32) return;
    int id = lane < k ? ids_s[lane] : 0;
    float picked = lane < k ? lg[id] : 0.f;
    float m = __shfl_sync(0xffffffffu, picked, 0), z;
    float e = lane < k ? expf(picked - m) : 0.f;
    if (gating == 0) {  // softmax over every expert
        float s = 0.f;
        for (int i = lane; i < rows; i += 32) s += expf(lg[i] - m);
        z = warp_sum(s);
    } else {  // softmax over the k picks
        z = warp_sum(e);
    }
    float wv = e / z, wsum = warp_sum(wv);
    float div = norm_topk ? fmaxf(wsum, 6.103515625e-5f) : 1.f;
    if (lane < k) {
        out[lane] = __int_as_float(id);
        out[k + lane] = wv / div * scale;
    }
    if (lane == 0) *counter = 0;
}

// attn_partial_v4: attn_partial_v2's arguments, grid, block and output. Before its wait, a block
// prefetches its keys' and values' lines into L2 (the positions come from rec, copied at the
// token's start; the cache's newest key, written by qk_rope_kv, is only read after the wait, by
// the loads proper); with hd <= 128 a warp reads its 16 keys of a 64-key split in one round
// (attn_partial_v2: two rounds of 8).
template <int J, int KBT>
__device__ __forceinline__ void attn_part_v4(const float* q, const float* kc, const float* vc, int nh, int nkv, int hd,
                                             int cache_n, int lo, int n_keys, float scale, float* part, float (*sm)[258]) {
    int h = blockIdx.x, s = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int kvh = h / (nh / nkv), k0 = lo + s * CHUNK, k1 = min(k0 + CHUNK, lo + n_keys);
    float qr[J], acc[J];
    #pragma unroll
    for (int j = 0; j < J; j++) {
        int c = lane + 32 * j;
        qr[j] = c < hd ? q[h * hd + c] : 0.f;
        acc[j] = 0.f;
    }
    float m = NEG_INF, l = 0.f;
    const float* kb = kc + (u64)kvh * cache_n * hd;
    const float* vb = vc + (u64)kvh * cache_n * hd;
    for (int t0 = k0 + warp; t0 < k1; t0 += 4 * KBT) {  // this warp's keys t0 + 4 b, b < KBT
        float kv[KBT][J], vv[KBT][J], sc[KBT];
        #pragma unroll
        for (int b = 0; b < KBT; b++) {
            int t = min(t0 + 4 * b, k1 - 1);
            #pragma unroll
            for (int j = 0; j < J; j++) {
                int c = lane + 32 * j;
                kv[b][j] = c < hd ? kb[(u64)t * hd + c] : 0.f;
                vv[b][j] = c < hd ? vb[(u64)t * hd + c] : 0.f;
            }
        }
        float mn = m;
        #pragma unroll
        for (int b = 0; b < KBT; b++) {
            float dot = 0.f;
            #pragma unroll
            for (int j = 0; j < J; j++) dot += qr[j] * kv[b][j];
            sc[b] = t0 + 4 * b < k1 ? warp_sum(dot) * scale : NEG_INF;
            mn = fmaxf(mn, sc[b]);
        }
        float cf = expf(m - mn);  // m = -inf before the first round: 0
        l *= cf;
        #pragma unroll
        for (int j = 0; j < J; j++) acc[j] *= cf;
        #pragma unroll
        for (int b = 0; b < KBT; b++) {
            float p = sc[b] == NEG_INF ? 0.f : expf(sc[b] - mn);
            l += p;
            #pragma unroll
            for (int j = 0; j < J; j++) acc[j] += p * vv[b][j];
        }
        m = mn;
    }
    #pragma unroll
    for (int j = 0; j < J; j++) {
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

// grid (nh, S >= ceil(n_keys / CHUNK)), block 128, hd <= 256 (as attn_partial).
extern "C" __global__ void __launch_bounds__(128) attn_partial_v4(
        const float* q, const float* kc, const float* vc, int nh, int nkv, int hd, int cache_n, int lo,
        int n_keys, float scale, float* part, const long long* rec) {
    __shared__ float sm[4][258];
    if (rec) {  // copied before the token's first kernel: final when this grid starts
        lo = (int)rec[REC_LO];
        n_keys = (int)rec[REC_KEYS];
    }
    int s = blockIdx.y;
    if (s * CHUNK < n_keys) {  // this block's keys and values into L2
        int kvh = blockIdx.x / (nh / nkv), k0 = lo + s * CHUNK, nb = (min(CHUNK, n_keys - s * CHUNK) * hd) * 4;
        const char* kb = reinterpret_cast<const char*>(kc + ((u64)kvh * cache_n + k0) * hd);
        const char* vb = reinterpret_cast<const char*>(vc + ((u64)kvh * cache_n + k0) * hd);
        for (int o = 128 * threadIdx.x; o < nb; o += 128 * blockDim.x) {
            asm volatile("prefetch.global.L2 [%0];" ::"l"(kb + o));
            asm volatile("prefetch.global.L2 [%0];" ::"l"(vb + o));
        }
    }
    pdl_trigger();
    pdl_wait();  // q and this position's key come from earlier grids
    if (s * CHUNK >= n_keys) return;  // the whole block: no barrier is skipped
    if (hd <= 128)
        attn_part_v4<4, 16>(q, kc, vc, nh, nkv, hd, cache_n, lo, n_keys, scale, part, sm);
    else
        attn_part_v4<8, 8>(q, kc, vc, nh, nkv, hd, cache_n, lo, n_keys, scale, part, sm);
}
