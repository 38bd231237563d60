// gpu_quant.cu, part 2 of 4: staged inputs, the dp4a row tiles, the matmul kernels, the
// one-token row copies (gemv1) and the activation of the expert kernels.
// ---------------------------------------------------------------------------------------------
// Staged inputs: up to NT tokens x KT = 8192 / NT columns of a block's shared buffer (XS_WORDS
// uint4): q1 bytes [t][c], q2 bytes [t][c], dxs [t][c / 32], s16 [t][c / 16]. NT is 1 (one-token
// kernels: fewer registers, more blocks in flight) or TB (batches).
#define TB 8
#define XS_WORDS (8192 * 19 / 8 / 16)
#define WARPS 4
#define MAXK 32

// two int8 levels of 32 values held 4 per lane by 8 lanes (l8 = lane % 8; every lane of the warp
// calls): d = max|x| / 127, q1 = round(x / d), q2 = round((x - d q1) 256 / d); w1, w2 this lane's
// bytes of q1, q2; dxs = d / 256; s the staged values' sum over the lane's 4 lanes (16 values)
__device__ __forceinline__ void quant32(const float* v, uint32_t& w1, uint32_t& w2, float& dxs, float& s) {
    float m = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
    for (int o = 1; o < 8; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    float d = m / 127.f, inv = m > 0.f ? 127.f / m : 0.f;
    s = 0.f;
    w1 = w2 = 0;
    for (int i = 0; i < 4; i++) {  // rounding by adding 1.5 * 2^23 (|values| <= 128): no conversions
        float ra = fmaf(v[i], inv, 12582912.f);
        int a = __float_as_int(ra) - 0x4b400000;
        float rb = fmaf(fmaf(-d, ra - 12582912.f, v[i]), inv * 256.f, 12582912.f);
        int b = max(-127, min(127, __float_as_int(rb) - 0x4b400000));
        w1 |= (uint32_t)(a & 255) << (8 * i);
        w2 |= (uint32_t)(b & 255) << (8 * i);
        // the sums serve the offsets b of w = a q + b: summing the staged values (not x) keeps a
        // dot's error that of the weights w, not of the unsigned q
        s += d * ((ra - 12582912.f) + fminf(fmaxf(rb - 12582912.f, -127.f), 127.f) * (1.f / 256.f));
    }
    for (int o = 1; o < 4; o <<= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
    dxs = d * (1.f / 256.f);
}

// stage x[tok[t] * ldx + k0 .. + kt] for t < nt (all threads of the block; 8 lanes per 32 values)
template <int NT, int KT = 8192 / NT> __device__ void stage(uint4* buf, const float* __restrict__ x, long long ldx, const int* tok, int nt, int k0, int kt) {
    uint32_t* q1 = reinterpret_cast<uint32_t*>(buf);
    uint32_t* q2 = q1 + NT * KT / 4;
    float* dxs = reinterpret_cast<float*>(q2 + NT * KT / 4);
    float* s16 = dxs + NT * KT / 32;
    int lane = threadIdx.x & 31, l8 = lane & 7, nch = kt / 32, total = nt * nch;
    #pragma unroll 4
    for (int c0 = (threadIdx.x >> 5) * 4; c0 < total; c0 += (blockDim.x >> 5) * 4) {
        int ch = c0 + (lane >> 3), t = ch / nch, c = ch % nch;
        bool on = ch < total;
        float v[4] = {0.f, 0.f, 0.f, 0.f}, ds, s;
        if (on) {
            const float* p = x + (long long)tok[t] * ldx + k0 + 32 * c + 4 * l8;
            for (int i = 0; i < 4; i++) v[i] = p[i];
        }
        uint32_t w1, w2;
        quant32(v, w1, w2, ds, s);
        if (on) {
            int wi = (t * KT + 32 * c) / 4 + l8;
            q1[wi] = w1;
            q2[wi] = w2;
            if (l8 == 0) dxs[t * (KT / 32) + c] = ds;
            if ((l8 & 3) == 0) s16[t * (KT / 16) + 2 * c + (l8 >> 2)] = s;
        }
    }
}

// acc[m][t] += row m . staged token t over the tile's chunks (rows[m] null: skipped)
template <int QT, int NT> __device__ __forceinline__ void rows_tile(const uint8_t* const* rows, const uint4* buf, int c0,
                                                                    int nch, int nt, float (*acc)[NT]) {
    constexpr int KT = 8192 / NT;
    const uint32_t* q1 = reinterpret_cast<const uint32_t*>(buf);
    const uint32_t* q2 = q1 + NT * KT / 4;
    const float* dxs = reinterpret_cast<const float*>(q2 + NT * KT / 4);
    const float* s16 = dxs + NT * KT / 32;
    constexpr int SUB = qbw(QT) / 32, BB = qbb(QT);
    for (int i = threadIdx.x & 31; i < nch; i += 32) {
        int c = c0 + i;
        Dec d[4];
        #pragma unroll
        for (int m = 0; m < 4; m++)
            if (rows[m]) dec32<QT>(rows[m] + (long long)(c / SUB) * BB, c % SUB, d[m]);
        #pragma unroll
        for (int t = 0; t < NT; t++) {
            if (t >= nt) break;
            uint4 a0 = reinterpret_cast<const uint4*>(q1)[(t * KT + 32 * i) / 16], a1 = reinterpret_cast<const uint4*>(q1)[(t * KT + 32 * i) / 16 + 1];
            uint4 b0 = reinterpret_cast<const uint4*>(q2)[(t * KT + 32 * i) / 16], b1 = reinterpret_cast<const uint4*>(q2)[(t * KT + 32 * i) / 16 + 1];
            uint32_t x1[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w}, x2[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
            float ds = dxs[t * (KT / 32) + i];
            float2 s = reinterpret_cast<const float2*>(s16)[t * (KT / 32) + i];
            float ss[2] = {s.x, s.y};
            #pragma unroll
            for (int m = 0; m < 4; m++)
                if (rows[m]) acc[m][t] += dot_staged<QT>(d[m], x1, x2, ds, ss);
        }
    }
}

// One pass of nt <= TB tokens (inputs x[tok[t] * ldx ..], cols wide) over up to 4 rows of one type
// (rows[m], null when absent): res[m][t] = the full dot, in every lane. All threads of the block
// call it together (it stages the inputs and synchronizes).
template <int NT>
__device__ __noinline__ void pass(const uint8_t* r0, const uint8_t* r1, const uint8_t* r2, const uint8_t* r3, int qt,
                                  int cols, const float* __restrict__ x, long long ldx, const int* tok, int nt,
                                  uint4* buf, float (*res)[TB]) {
    constexpr int KT = 8192 / NT;
    const uint8_t* rows[4] = {r0, r1, r2, r3};
    long long nbytes = (long long)(cols / g_block[qt][0]) * g_block[qt][1];
    for (int m = 0; m < 4; m++)  // the rows' bytes towards L2 while the inputs are staged
        if (rows[m])
            for (long long o = 128 * (threadIdx.x & 31); o < nbytes; o += 32 * 128)
                PREFETCH_L2(rows[m] + o);
    float acc[4][NT];
    #pragma unroll
    for (int m = 0; m < 4; m++)
        #pragma unroll
        for (int t = 0; t < NT; t++) acc[m][t] = 0.f;
    for (int k0 = 0; k0 < cols; k0 += KT) {
        int kt = min(KT, cols - k0);
        __syncthreads();
        stage<NT>(buf, x, ldx, tok, nt, k0, kt);
        __syncthreads();
#ifdef GQ_ONLY
        if (qt == GQ_ONLY) rows_tile<GQ_ONLY, NT>(rows, buf, k0 / 32, kt / 32, nt, acc);
#else
        switch (qt) {
#define C(Q) case Q: rows_tile<Q, NT>(rows, buf, k0 / 32, kt / 32, nt, acc); break;
        C(2) C(3) C(6) C(7) C(8) C(10) C(11) C(12) C(13) C(14) C(16) C(17) C(18) C(19) C(20) C(21) C(22) C(23) C(29) C(39)
#undef C
        }
#endif
    }
    #pragma unroll
    for (int m = 0; m < 4; m++)
        #pragma unroll
        for (int t = 0; t < NT; t++) {
            float v = acc[m][t];
            if (t < nt)
                for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
            res[m][t] = v;
        }
}

// ---------------------------------------------------------------------------------------------
// One-token matmul (qmatmul_q1). Weight rows are copied to shared memory first, in the 16-byte
// words that cover them (cp.async: every copy of a tile issued at once, 16 bytes per lane,
// coalesced, any row alignment), then decoded there by dec32; the inputs are staged meanwhile. A
// warp owns 2 rows (of each matrix given), a block of 4 warps stages one input tile of X1_COLS columns for them all (stage), the lanes split
// the tile's 32-weight chunks and dot them with dp4a (dot_staged), one shuffle reduction per row
// at the end. Tiles shrink below X1_COLS when a warp's rows would not fit its W1_BYTES / 4.
#define W1_BYTES 28672
#define X1_COLS 2048
#define X1_WORDS (X1_COLS * 19 / 8 / 16)

__device__ __forceinline__ void cp16(void* s, const void* g) {  // 16 bytes global -> shared, asynchronously
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"((unsigned)__cvta_generic_to_shared(s)), "l"(g));
#else
    __builtin_memcpy(s, g, 16);
#endif
}
__device__ __forceinline__ void cp_wait() {
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}
__device__ __forceinline__ void cp_commit() {  // closes a group of copies
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}
__device__ __forceinline__ void cp_wait_but_one() {  // every group but the last closed one is done
#ifdef __CUDA_ARCH__
    asm volatile("cp.async.wait_group 1;" ::: "memory");
#endif
}
// the 16-byte words covering [p, p + n), counted from p's aligned word
__device__ __forceinline__ int cover_words(const uint8_t* p, int n) { return (int)(((u64)p + n + 15 - ((u64)p & ~15ull)) >> 4); }
// copies words w0 .. w1 - 1 of those from p's aligned word to s (lanes lane, lane + 32, ..)
__device__ __forceinline__ void stage_words(uint8_t* s, const uint8_t* p, int w0, int w1, int lane) {
    const uint8_t* a = reinterpret_cast<const uint8_t*>((u64)p & ~15ull);
    for (int i = w0 + lane; i < w1; i += 32) cp16(s + 16 * i, a + 16 * i);
}
// bytes of the shared slot for the cover of kt columns of a qt row: n bytes at any offset mod 16
__device__ __forceinline__ int slot_bytes(int qt, int kt) { return ((kt / g_block[qt][0]) * g_block[qt][1] + 31) & ~15; }
// copies the 16-byte words covering [p, p + n) to s (16-byte aligned) by lanes lane, lane + 32, ...;
// returns where p's bytes lie in s
__device__ __forceinline__ const uint8_t* stage_row(uint8_t* s, const uint8_t* p, int n, int lane) {
    const uint8_t* a = reinterpret_cast<const uint8_t*>((u64)p & ~15ull);
    int words = (int)(((u64)p + n + 15 - (u64)a) >> 4);
    for (int i = lane; i < words; i += 32) cp16(s + 16 * i, a + 16 * i);
    return s + ((u64)p & 15);
}
// the largest tile (<= cap, a multiple of step, at least step) whose nrows slots of qa (and of qb) fit budget
__device__ __forceinline__ int fit_cols(int cols, int cap, int step, int qa, int qb, int nrows, int budget) {
    int kt = min(cols, cap) / step * step;
    while (kt > step && nrows * (slot_bytes(qa, kt) + (qb >= 0 ? slot_bytes(qb, kt) : 0)) > budget) kt -= step;
    return max(kt, step);
}

// row m . staged input over chunks c0 + lane, c0 + lane + 32, .. < nch (row m in shared memory at s_m, m < nm)
// (a call per type and tile: each type's registers allocated apart, no spills across the dispatch)
template <int QT> __device__ __noinline__ float2 rows1_tile(const uint8_t* s0, const uint8_t* s1, int nm, const uint4* xb, int c0, int nch) {
    constexpr int SUB = qbw(QT) / 32, BB = qbb(QT);
    const uint4* q1 = xb;
    const uint4* q2 = xb + X1_COLS / 16;
    const float* dxs = reinterpret_cast<const float*>(xb + X1_COLS / 8);
    const float2* s16 = reinterpret_cast<const float2*>(dxs + X1_COLS / 32);
    float2 acc = {0.f, 0.f};
    for (int c = c0 + (threadIdx.x & 31); c < nch; c += 32) {
        Dec d0, d1;
        dec32<QT>(s0 + (c / SUB) * BB, c % SUB, d0);
        if (nm > 1) dec32<QT>(s1 + (c / SUB) * BB, c % SUB, d1);
        uint4 a0 = q1[2 * c], a1 = q1[2 * c + 1], b0 = q2[2 * c], b1 = q2[2 * c + 1];
        uint32_t x1[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w}, x2[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
        float2 sv = s16[c];
        float ss[2] = {sv.x, sv.y}, ds = dxs[c];
        acc.x += dot_staged<QT>(d0, x1, x2, ds, ss);
        if (nm > 1) acc.y += dot_staged<QT>(d1, x1, x2, ds, ss);
    }
    return acc;
}

// One token through nr <= 2 WARPS rows of matrix a (and the same rows of b when qb >= 0): rows
// start at pa + r rb_a (pb + r rb_b), r < nr; warp w takes rows 2 w, 2 w + 1. Returns in every lane
// of warp w: res[0..1] = rows of a, res[2..3] = rows of b. All threads of the block call it.
__device__ void gemv1(const uint8_t* pa, long long rba, int qa, const uint8_t* pb, long long rbb, int qb, int nr,
                      int cols, const float* __restrict__ x, uint4* wbuf, uint4* xbuf, float* res) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, w0 = 2 * warp, mine = max(0, min(2, nr - w0));
    int step = max(g_block[qa][0], qb >= 0 ? g_block[qb][0] : 1);
    int kt = fit_cols(cols, X1_COLS, step, qa, qb, 2, W1_BYTES / WARPS);
    int sa = slot_bytes(qa, kt), sb = qb >= 0 ? slot_bytes(qb, kt) : 0;
    uint8_t* my = reinterpret_cast<uint8_t*>(wbuf) + warp * (W1_BYTES / WARPS);
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    int tok[1] = {0};
    for (int k0 = 0; k0 < cols; k0 += kt) {
        int n = min(kt, cols - k0), nh = n / 2 / step * step;  // copied in two groups: columns < nh, the rest
        long long oa = (long long)(k0 / g_block[qa][0]) * g_block[qa][1];
        long long ob = qb >= 0 ? (long long)(k0 / g_block[qb][0]) * g_block[qb][1] : 0;
        int na = (n / g_block[qa][0]) * g_block[qa][1], nb = qb >= 0 ? (n / g_block[qb][0]) * g_block[qb][1] : 0;
        int ha = (nh / g_block[qa][0]) * g_block[qa][1], hb = qb >= 0 ? (nh / g_block[qb][0]) * g_block[qb][1] : 0;
        const uint8_t* r[4] = {pa + w0 * rba + oa, pa + (w0 + 1) * rba + oa, pb + w0 * rbb + ob, pb + (w0 + 1) * rbb + ob};
        uint8_t* d[4] = {my, my + sa, my + 2 * sa, my + 2 * sa + sb};
        __syncthreads();  // the previous tile is consumed
        #pragma unroll
        for (int part = 0; part < 2; part++) {
            #pragma unroll
            for (int m = 0; m < 4; m++)
                if (m % 2 < mine && (m < 2 || qb >= 0)) {
                    int h = m < 2 ? ha : hb, all = m < 2 ? na : nb;
                    stage_words(d[m], r[m], part ? cover_words(r[m], h) : 0, cover_words(r[m], part ? all : h), lane);
                }
            cp_commit();
        }
        const uint8_t *s0 = my + ((u64)r[0] & 15), *s1 = my + sa + ((u64)r[1] & 15);
        const uint8_t *s2 = my + 2 * sa + ((u64)r[2] & 15), *s3 = my + 2 * sa + sb + ((u64)r[3] & 15);
        stage<1, X1_COLS>(xbuf, x, 0, tok, 1, k0, n);
        cp_wait_but_one();
        __syncthreads();
        #pragma unroll
        for (int part = 0; part < 2; part++) {
            if (part) {  // the rest of the warp's own rows
                cp_wait();
                __syncwarp();
            }
            if (mine) {
                int c0 = part ? nh / 32 : 0, c1 = part ? n / 32 : nh / 32;
                float2 v = {0.f, 0.f}, u = {0.f, 0.f};
                DISPATCH_R(v, qa, rows1_tile, s0, s1, mine, xbuf, c0, c1)
                if (qb >= 0) DISPATCH_R(u, qb, rows1_tile, s2, s3, mine, xbuf, c0, c1)
                acc[0] += v.x; acc[1] += v.y; acc[2] += u.x; acc[3] += u.y;
            }
        }
    }
    for (int m = 0; m < 4; m++) {
        float v = acc[m];
        for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
        res[m] = v;
    }
}

extern "C" __global__ void __launch_bounds__(128, 6) qmatmul_q1(const uint8_t* __restrict__ W, int qt, int rows, int cols, long long rb,
                                                               const float* __restrict__ X, int n, float* __restrict__ Y) {
    __shared__ __align__(16) uint4 wbuf[W1_BYTES / 16];
    __shared__ __align__(16) uint4 xbuf[X1_WORDS];
    int r0 = blockIdx.x * 2 * WARPS, r = r0 + 2 * (threadIdx.x >> 5);
    float res[4];
    gemv1(W + (long long)r0 * rb, rb, qt, 0, 0, -1, min(2 * WARPS, rows - r0), cols, X, wbuf, xbuf, res);
    if ((threadIdx.x & 31) == 0)
        for (int m = 0; m < 2; m++)
            if (r + m < rows) Y[r + m] = res[m];
}

// Y[t][r] = W[r] . X[t], quantized W: grid (ceil(rows / 8), ceil(n / NT)), block 128
template <int NT> __device__ void matmul_rows(const uint8_t* __restrict__ W, int qt, int rows, int cols, long long rb,
                                              const float* __restrict__ X, int n, float* __restrict__ Y, uint4* buf) {
    int warp = threadIdx.x >> 5, r = (blockIdx.x * WARPS + warp) * 2, t0 = blockIdx.y * NT, nt = min(NT, n - t0);
    int tok[TB];
    for (int t = 0; t < TB; t++) tok[t] = t0 + (t < nt ? t : 0);
    float res[4][TB];
    pass<NT>(r < rows ? W + (long long)r * rb : 0, r + 1 < rows ? W + (long long)(r + 1) * rb : 0, 0, 0, qt, cols, X, cols,
          tok, nt, buf, res);
    if ((threadIdx.x & 31) == 0)
        for (int m = 0; m < 2; m++)
            for (int t = 0; t < nt; t++)
                if (r + m < rows) Y[(long long)(t0 + t) * rows + r + m] = res[m][t];
}

extern "C" __global__ void qmatmul_q(const uint8_t* __restrict__ W, int qt, int rows, int cols, long long rb,
                                     const float* __restrict__ X, int n, float* __restrict__ Y) {
    __shared__ uint4 buf[XS_WORDS];
    matmul_rows<TB>(W, qt, rows, cols, rb, X, n, Y, buf);
}

// ---------------------------------------------------------------------------------------------
// float types: weight i of the block at b (F32, F16, BF16: blocks of one weight)
__device__ __forceinline__ float qw(int qt, const uint8_t* b) {
    switch (qt) {
    case 0: return __int_as_float((int)(b[0] | (b[1] << 8) | (b[2] << 16) | ((uint32_t)b[3] << 24)));
    case 1: return h2f(b[0] | (b[1] << 8));
    case 30: return __int_as_float((int)((b[0] | (b[1] << 8)) << 16));
    }
    return 0.0f;
}

// Y[t][r] = W[r] . X[t] for the float types: one warp per row, 4 rows per 128-thread block
extern "C" __global__ void qmatmul_f(const uint8_t* __restrict__ W, int qt, int rows, int cols, long long rb,
                                     const float* __restrict__ X, int n, float* __restrict__ Y) {
    int lane = threadIdx.x & 31, r = blockIdx.x * 4 + (threadIdx.x >> 5), es = g_block[qt][1];
    if (r >= rows) return;
    const uint8_t* row = W + (long long)r * rb;
    for (int t0 = 0; t0 < n; t0 += TB) {
        float acc[TB];
        for (int t = 0; t < TB; t++) acc[t] = 0.0f;
        for (int c = lane; c < cols; c += 32) {
            float w = qw(qt, row + (long long)c * es);
            for (int t = 0; t < TB; t++)
                if (t0 + t < n) acc[t] += w * X[(long long)(t0 + t) * cols + c];
        }
        for (int t = 0; t < TB; t++) {
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
// expert's base; rows of rb_* bytes), any quantized layout per projection. A warp computes 2 rows
// at a time (gate and up together when their types agree) for up to 8 tokens (pass).
__device__ __forceinline__ float q_act(int act, float a, float b) {  // gpu_kernels.cu's expert_act
    if (act == 1) {
        a = fminf(a, 7.f);
        b = fminf(fmaxf(b, -7.f), 7.f);
        return a / (1.f + __expf(-1.702f * a)) * (b + 1.f);
    }
    return a / (1.f + __expf(-a)) * b;
}

