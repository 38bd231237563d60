// moelab dense-path kernels of a prefill chunk (T > 1 tokens of one block; compiled at run time by
// CuPy/NVRTC; launched from execute/prefill_dense.py). Each replaces a run of CuPy array
// expressions of execute/model.py with one launch; the arithmetic is the same up to the order of
// the sums (float32 sums by the block's tree instead of CuPy's reductions; routing in float64).

#define NEG_INF __int_as_float(0xff800000u)
#define NEG_INF_D __longlong_as_double(0xfff0000000000000ull)
typedef unsigned long long u64;

// sum of v over the block (every thread gets it); red: >= 32 floats of shared memory
__device__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = 0.f;
    for (int i = 0; i < nw; i++) s += red[i];
    return s;
}

__device__ float block_max(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    float s = red[0];
    for (int i = 1; i < nw; i++) s = fmaxf(s, red[i]);
    return s;
}

// RMSNorm of row r of x (rows, cols): out = x * (1 / sqrt(mean(x^2) + eps)) * w[r % wrows] (w is
// (wrows, cols): one weight row for every row, or one per row of a repeating group such as the
// heads of a token). One block per row.
extern "C" __global__ void pd_rmsnorm(const float* __restrict__ x, const float* __restrict__ w, int wrows, int cols,
                                      float eps, float* __restrict__ out) {
    __shared__ float red[32];
    const long long r = blockIdx.x;
    const float* xr = x + r * cols;
    const float* wr = w + (long long)(r % wrows) * cols;
    float ss = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) ss = __fmaf_rn(xr[c], xr[c], ss);
    ss = block_sum(ss, red);
    const float inv = 1.f / sqrtf(__fadd_rn(ss / (float)cols, eps));
    float* o = out + r * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) o[c] = __fmul_rn(__fmul_rn(xr[c], inv), wr[c]);
}

// y (rows, cols) *= s[row] (the per-row 1 / scale of the activation halves of pf_split)
extern "C" __global__ void pd_scale_rows(float* __restrict__ y, const float* __restrict__ s, long long n, int cols) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] *= s[i / cols];
}

// numpy's sum of n float64 values (pairwise: below 8 in order; up to 128 in 8 running sums, paired,
// then the rest in order; above, the two halves split at a multiple of 8), on one thread; L levels
// of halving (compile-time, no recursion at run time): 4 cover n <= 2048
__device__ __noinline__ double np_sum_leaf(const double* a, int n) {
    if (n < 8) {
        double s = 0.0;
        for (int i = 0; i < n; i++) s += a[i];
        return s;
    }
    double r[8];
    for (int j = 0; j < 8; j++) r[j] = a[j];
    int i = 8;
    for (; i < n - n % 8; i += 8)
        for (int j = 0; j < 8; j++) r[j] += a[i + j];
    double s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
    for (; i < n; i++) s += a[i];
    return s;
}

template <int L>
__device__ __noinline__ double np_sum(const double* a, int n) {
    if (n <= 128) return np_sum_leaf(a, n);
    int n2 = n / 2;
    n2 -= n2 % 8;
    return np_sum<L - 1>(a, n2) + np_sum<L - 1>(a + n2, n - n2);
}

template <>
__device__ __noinline__ double np_sum<0>(const double* a, int n) {
    return np_sum_leaf(a, n);
}

// y (rows, cols) = (sum over b of part[b] in b order) * sr[row] (* sc[col] when sc): the K-slices'
// partial products of a split product (ChunkDense.matmul) summed in float32, times the halves' scales
extern "C" __global__ void pd_sum_parts(const float* __restrict__ part, int parts, long long n, int cols,
                                        const float* __restrict__ sr, const float* __restrict__ sc,
                                        float* __restrict__ y) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        float s = part[i];
        for (int b = 1; b < parts; b++) s += part[(long long)b * n + i];
        s *= sr[i / cols];
        y[i] = sc ? s * sc[i % cols] : s;
    }
}

// y (rows, cols) *= sr[row] * sc[col] (powers of two: the halves' scales of the activation rows and
// of the weight rows, which are y's columns)
extern "C" __global__ void pd_scale_rows_cols(float* __restrict__ y, const float* __restrict__ sr,
                                              const float* __restrict__ sc, long long n, int cols) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        y[i] = y[i] * sr[i / cols] * sc[i % cols];
}

// Routing of T rows of E router logits (one block per row, E <= 2048): l = logits + bias (float64);
// gating 0 softmax: select the top k of p = softmax(l), weights p; gating 1 softmax_topk: select on
// l, weights softmax of the selected l. Ties: the lower id first. Then norm: w / max(sum w, 2^-14);
// scale != 0: w * scale. ids (T, k) int32 and w (T, k) float64 in rank order; a non-finite logit
// sets *bad (the caller routes that chunk on the host).
extern "C" __global__ void pd_route(const float* __restrict__ logits, const float* __restrict__ bias, int E, int k,
                                    int gating, int norm, double scale, int* __restrict__ ids, double* __restrict__ w,
                                    int* __restrict__ bad) {
    extern __shared__ double v[];  // E values, then 32 doubles and 32 ints of reduction space
    double* rv = v + E;
    int* ri = reinterpret_cast<int*>(rv + 32);
    const int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    const float* lr = logits + (long long)r * E;
    int nonfinite = 0;
    for (int j = threadIdx.x; j < E; j += blockDim.x) {
        const float f = lr[j];
        nonfinite |= (__float_as_uint(f) & 0x7f800000u) == 0x7f800000u;  // inf or NaN
        v[j] = (double)f + (bias ? (double)bias[j] : 0.0);
    }
    if (nonfinite) atomicExch(bad, 1);
    __syncthreads();
    double m = NEG_INF_D;
    for (int j = threadIdx.x; j < E; j += blockDim.x) m = fmax(m, v[j]);
    for (int o = 16; o > 0; o >>= 1) m = fmax(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (lane == 0) rv[warp] = m;
    __syncthreads();
    m = rv[0];
    for (int i = 1; i < nw; i++) m = fmax(m, rv[i]);
    __syncthreads();
    if (gating == 0) {  // probabilities: exp(l - max) / sum
        for (int j = threadIdx.x; j < E; j += blockDim.x) v[j] = exp(v[j] - m);
        __syncthreads();
        if (threadIdx.x == 0) rv[0] = np_sum<4>(v, E);
        __syncthreads();
        const double s = rv[0];
        __syncthreads();
        for (int j = threadIdx.x; j < E; j += blockDim.x) v[j] = v[j] / s;
        __syncthreads();
    }
    // k rounds of a block argmax (largest value, then the lowest id); the selected value is
    // replaced by -inf (probabilities are >= 0 and logits finite, so it is never selected again)
    double* sel = rv;
    __shared__ double top[64];  // thread 0's selection (shared memory, not the thread's stack)
    __shared__ int top_id[64];
    for (int i = 0; i < k; i++) {
        double bv = NEG_INF_D;
        int bi = 0x7fffffff;
        for (int j = threadIdx.x; j < E; j += blockDim.x) {
            const double x = v[j];
            if (x > bv || (x == bv && j < bi)) { bv = x; bi = j; }
        }
        for (int o = 16; o > 0; o >>= 1) {
            const double ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (ov > bv || (ov == bv && oi < bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) { sel[warp] = bv; ri[warp] = bi; }
        __syncthreads();
        if (threadIdx.x == 0) {
            for (int q = 1; q < nw; q++)
                if (sel[q] > bv || (sel[q] == bv && ri[q] < bi)) { bv = sel[q]; bi = ri[q]; }
            if (bi < 0 || bi >= E) bi = 0;  // only with NaN (flagged above)
            top[i] = v[bi];
            top_id[i] = bi;
            v[bi] = NEG_INF_D;
        }
        __syncthreads();
    }
    if (threadIdx.x != 0) return;
    if (gating == 1) {  // softmax over the selected logits (the first is their max)
        const double m1 = top[0];
        for (int i = 0; i < k; i++) top[i] = exp(top[i] - m1);
        const double s = np_sum<4>(top, k);
        for (int i = 0; i < k; i++) top[i] = top[i] / s;
    }
    if (norm) {
        const double s = fmax(np_sum<4>(top, k), 6.103515625e-5);
        for (int i = 0; i < k; i++) top[i] = top[i] / s;
    }
    for (int i = 0; i < k; i++) {
        ids[(long long)r * k + i] = top_id[i];
        w[(long long)r * k + i] = scale != 0.0 ? top[i] * scale : top[i];
    }
}

// q/k norm + NeoX RoPE + KV append of a chunk: qkv (T, (nh + 2 nkv) hd) rows of tokens at positions
// pos .. pos + T - 1. Block (head b, token t): q heads b < nh go to q_out in the attention's layout
// (nkv, T, g, hd) (g = nh / nkv, head b = kv head b / g, member b % g), k heads to kc[b - nh][pos + t],
// v heads (raw) to vc. mode 0 no norm, 1 per head (weights (nh + nkv, hd)), 2 over all of q and all
// of k (weights (nh + nkv) hd). cos, sin (n, hd): sin carries the sign of the pair's rotation.
// Block: hd threads rounded up to a multiple of 32, hd <= 1024.
extern "C" __global__ void pd_qk_rope_kv(const float* __restrict__ qkv, int T, int nh, int nkv, int hd,
                                         const float* __restrict__ nw, int mode, float eps,
                                         const float* __restrict__ cos, const float* __restrict__ sin, int pos,
                                         float* __restrict__ q_out, float* __restrict__ kc, float* __restrict__ vc,
                                         int cache_n) {
    __shared__ float red[32];
    __shared__ float v_s[1024];
    const int b = blockIdx.x, t = blockIdx.y, i = threadIdx.x;
    const bool on = i < hd;
    const float* row = qkv + (long long)t * (nh + 2 * nkv) * hd;
    const int p = pos + t;
    if (b >= nh + nkv) {
        const int h = b - nh - nkv;
        if (on) vc[((long long)h * cache_n + p) * hd + i] = row[(long long)(nh + nkv) * hd + h * hd + i];
        return;
    }
    float v = on ? row[b * hd + i] : 0.f;
    if (mode == 1) {
        const float ss = block_sum(on ? __fmul_rn(v, v) : 0.f, red);
        const float r = 1.f / sqrtf(__fadd_rn(ss / (float)hd, eps));
        if (on) v = __fmul_rn(__fmul_rn(v, r), nw[b * hd + i]);
    } else if (mode == 2) {
        const int lo = b < nh ? 0 : nh * hd, n = b < nh ? nh * hd : nkv * hd;
        float ss = 0.f;
        for (int j = i; j < n; j += blockDim.x) ss = __fmaf_rn(row[lo + j], row[lo + j], ss);
        const float r = 1.f / sqrtf(__fadd_rn(block_sum(ss, red) / (float)n, eps));
        if (on) v = __fmul_rn(__fmul_rn(v, r), nw[b * hd + i]);
    }
    if (on) v_s[i] = v;
    __syncthreads();
    if (!on) return;
    const long long at = (long long)p * hd + i;
    const float o = __fadd_rn(__fmul_rn(v, cos[at]), __fmul_rn(v_s[(i + hd / 2) % hd], sin[at]));
    if (b < nh) {
        const int g = nh / nkv;
        q_out[(((long long)(b / g) * T + t) * g + b % g) * hd + i] = o;
    } else {
        kc[((long long)(b - nh) * cache_n + p) * hd + i] = o;
    }
}

// Masked softmax of a chunk's attention scores in place: s (nkv, T g, n_keys) raw q.k products of
// query (t, member) against keys at positions lo .. lo + n_keys - 1; query t sits at pos + t and
// sees key positions <= pos + t (and > pos + t - window when window > 0). Row -> scale * s, masked
// keys -> probability 0, p = exp(v - m) / (sum + exp(sink - m)) with m = max(max v, sink) when sinks
// (per q head, nh = nkv g values) are given. One block per row.
extern "C" __global__ void pd_softmax(float* __restrict__ s, int T, int g, int n_keys, int lo, int pos, int window,
                                      float scale, const float* __restrict__ sinks) {
    __shared__ float red[32];
    const long long r = blockIdx.x;
    const int j = (int)(r / ((long long)T * g)), tg = (int)(r % ((long long)T * g)), t = tg / g, member = tg % g;
    const int qp = pos + t;
    float* row = s + r * n_keys;
    float m = NEG_INF;
    for (int c = threadIdx.x; c < n_keys; c += blockDim.x) {
        const int kp = lo + c;
        const bool ok = kp <= qp && (window <= 0 || kp > qp - window);
        const float x = ok ? __fmul_rn(row[c], scale) : NEG_INF;
        row[c] = x;
        m = fmaxf(m, x);
    }
    m = block_max(m, red);
    float sink = NEG_INF;
    if (sinks) {
        sink = sinks[j * g + member];
        m = fmaxf(m, sink);
    }
    float sum = 0.f;
    for (int c = threadIdx.x; c < n_keys; c += blockDim.x) {
        const float e = row[c] == NEG_INF ? 0.f : expf(__fadd_rn(row[c], -m));
        row[c] = e;
        sum += e;
    }
    sum = block_sum(sum, red);
    if (sinks) sum += expf(__fadd_rn(sink, -m));
    const float inv = 1.f / sum;
    for (int c = threadIdx.x; c < n_keys; c += blockDim.x) row[c] = __fmul_rn(row[c], inv);
}
