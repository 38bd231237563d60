// moelab batched MoE kernels (compiled at run time by CuPy/NVRTC; see execute/prefill.py).
//
// A layer's (expert, token) pairs sorted by expert are the rows of the activations; a tile is up to
// BM consecutive rows of one expert (its `base` address) times BN rows of a weight matrix, over all
// of k. Products run on tensor cores (mma.sync m16n8k16, f16 inputs, f32 accumulators) with:
// - weights as their exact integer quants (Q8_0: q, Q4_0: nibble - 8; F16: the value) in f16, the
//   block scale applied in f32 to the product of each 32-weight block;
// - activations as two f16 halves: a row scaled by a power of two s (max |x s| < 2^15) split into
//   hi = f16(x s) and lo = f16(x s - hi); hi + lo carries ~22 bits of x s; outputs are times 1/s.
// So a product equals the float32 product up to the activations' ~22-bit split and the tensor
// cores' f32 accumulation.
//
// An expert in memory: gate | up | down at byte offsets from its base (execute/gpu_experts.py).

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

enum { F16 = 1, Q4_0 = 2, Q8_0 = 8 };

#define BM 32         // pair rows per tile (two m16 fragments)
#define BN 128        // weight rows per tile (gate_up: 64 of gate, the same 64 of up)
#define BK 64         // k per step: two 32-weight blocks
#define LDS (BK + 8)  // shared row stride in halves (conflict-free fragment loads)

__device__ __forceinline__ u16 f2h(float f) {
    u16 h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// c (16x8 f32) += a (16x16 f16, row-major fragment) * b (16x8 f16, column fragment)
__device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// weight k of a row as its integer quant (f16 bits); block scale of block blk
__device__ __forceinline__ u16 quant_at(int qt, const unsigned char* row, int k) {
    if (qt == Q8_0) return f2h((float)*reinterpret_cast<const signed char*>(row + (k >> 5) * 34 + 2 + (k & 31)));
    if (qt == Q4_0) {
        unsigned char b = row[(k >> 5) * 18 + 2 + (k & 15)];
        return f2h((float)((int)((k & 31) < 16 ? (b & 15) : (b >> 4)) - 8));
    }
    return reinterpret_cast<const u16*>(row)[k];  // F16
}

__device__ __forceinline__ float scale_at(int qt, const unsigned char* row, int blk) {
    if (qt == Q8_0) return h2f(*reinterpret_cast<const u16*>(row + blk * 34));
    if (qt == Q4_0) return h2f(*reinterpret_cast<const u16*>(row + blk * 18));
    return 1.f;
}

// Row i of the output = row rows[i] of x (rows null: row i), scaled and split into hi/lo halves;
// inv[i] = 1 / s. One block (a multiple of 32 threads, <= 1024) per row.
extern "C" __global__ void pf_split(const float* __restrict__ x, const int* __restrict__ rows, int cols,
                                    u16* __restrict__ hi, u16* __restrict__ lo, float* __restrict__ inv) {
    __shared__ float red[32];
    int i = blockIdx.x;
    const float* src = x + (long long)(rows ? rows[i] : i) * cols;
    float m = 0.f;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) m = fmaxf(m, fabsf(src[c]));
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = m;
    __syncthreads();
    if (threadIdx.x < 32) {
        m = threadIdx.x < (blockDim.x >> 5) ? red[threadIdx.x] : 0.f;
        for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        if (threadIdx.x == 0) red[0] = m;
    }
    __syncthreads();
    m = red[0];
    int p = 0;  // s = 2^p with m * s < 2^15 (m < 2^e, e from the exponent bits)
    if (m > 0.f && m <= 3.0e38f) {
        int e = ((__float_as_int(m) >> 23) & 255) - 126;
        p = min(126, max(-126, 15 - e));
    }
    float s = __int_as_float((p + 127) << 23);
    u16* oh = hi + (long long)i * cols;
    u16* ol = lo + (long long)i * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = src[c] * s;
        u16 h = f2h(v);
        oh[c] = h;
        ol[c] = f2h(v - h2f(h));
    }
    if (threadIdx.x == 0) inv[i] = __int_as_float((127 - p) << 23);
}

// One tile per block (128 threads, 4 warps): blockIdx.y = tile (rows tile_row .. + tile_n of the
// activations, all of expert base[tile_g]); blockIdx.x = a group of output columns.
// mode 0 (gate and up): columns n0 .. n0 + 63 of gate (at off_a) and up (at off_b);
//   out[row][n] = silu(g) * u, g and u the products times inv[row].
// mode 1 (down): columns n0 .. n0 + 127 of the matrix at off_a; out[row][n] = product * inv[row].
// Weight matrices are (nout, K) in type qt, rows of row_bytes; a (hi, lo) row has K halves.
extern "C" __global__ void __launch_bounds__(128)
pf_mm(const u64* __restrict__ base, const int* __restrict__ tile_row, const int* __restrict__ tile_n,
      const int* __restrict__ tile_g, const u16* __restrict__ ahi, const u16* __restrict__ alo,
      const float* __restrict__ inv, int K, int nout, long long off_a, long long off_b, long long row_bytes,
      int qt, int mode, float* __restrict__ out) {
    __shared__ __align__(16) u16 Ws[BN][LDS];
    __shared__ __align__(16) u16 Ah[BM][LDS];
    __shared__ __align__(16) u16 Al[BM][LDS];
    __shared__ float Sd[BN][2];

    const int t = blockIdx.y, row0 = tile_row[t], nr = tile_n[t];
    if (nr <= 0) return;  // a fixed-shape launch's unused tile (pf_group)
    const unsigned char* e = reinterpret_cast<const unsigned char*>(base[tile_g[t]]);
    const int half_n = mode == 0 ? 64 : 128;
    const int n0 = blockIdx.x * half_n;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;

    int fr[4];  // tile row of each of the warp's four n8 fragments
    #pragma unroll
    for (int j = 0; j < 4; j++)
        fr[j] = mode == 0 ? (j < 2 ? 16 * warp + 8 * j : 64 + 16 * warp + 8 * (j - 2)) : 32 * warp + 8 * j;

    float acc[2][4][4];
    #pragma unroll
    for (int a = 0; a < 2; a++)
        #pragma unroll
        for (int j = 0; j < 4; j++)
            #pragma unroll
            for (int c = 0; c < 4; c++) acc[a][j][c] = 0.f;

    for (int k0 = 0; k0 < K; k0 += BK) {
        for (int i = threadIdx.x; i < BN * BK; i += 128) {
            int r = i >> 6, kk = i & 63, k = k0 + kk, n = n0 + (mode == 0 ? (r & 63) : r);
            u16 v = 0;
            if (n < nout && k < K) {
                const unsigned char* row = e + (mode == 0 && r >= 64 ? off_b : off_a) + (long long)n * row_bytes;
                v = quant_at(qt, row, k);
            }
            Ws[r][kk] = v;
        }
        {
            int r = threadIdx.x, n = n0 + (mode == 0 ? (r & 63) : r);
            const unsigned char* row = e + (mode == 0 && r >= 64 ? off_b : off_a) + (long long)n * row_bytes;
            #pragma unroll
            for (int b = 0; b < 2; b++)
                Sd[r][b] = (n < nout && k0 + 32 * b < K) ? scale_at(qt, row, (k0 >> 5) + b) : 0.f;
        }
        for (int i = threadIdx.x; i < BM * BK; i += 128) {
            int r = i >> 6, kk = i & 63, k = k0 + kk;
            u16 h = 0, l = 0;
            if (r < nr && k < K) {
                long long at = (long long)(row0 + r) * K + k;
                h = ahi[at];
                l = alo[at];
            }
            Ah[r][kk] = h;
            Al[r][kk] = l;
        }
        __syncthreads();
        #pragma unroll
        for (int blk = 0; blk < 2; blk++) {
            float tmp[2][4][4];
            #pragma unroll
            for (int a = 0; a < 2; a++)
                #pragma unroll
                for (int j = 0; j < 4; j++)
                    #pragma unroll
                    for (int c = 0; c < 4; c++) tmp[a][j][c] = 0.f;
            #pragma unroll
            for (int ks = 0; ks < 2; ks++) {
                const int kc = blk * 32 + ks * 16 + 2 * tg;
                u32 ah[2][4], al[2][4];
                #pragma unroll
                for (int a = 0; a < 2; a++) {
                    const int r = 16 * a + g;
                    ah[a][0] = *reinterpret_cast<const u32*>(&Ah[r][kc]);
                    ah[a][1] = *reinterpret_cast<const u32*>(&Ah[r + 8][kc]);
                    ah[a][2] = *reinterpret_cast<const u32*>(&Ah[r][kc + 8]);
                    ah[a][3] = *reinterpret_cast<const u32*>(&Ah[r + 8][kc + 8]);
                    al[a][0] = *reinterpret_cast<const u32*>(&Al[r][kc]);
                    al[a][1] = *reinterpret_cast<const u32*>(&Al[r + 8][kc]);
                    al[a][2] = *reinterpret_cast<const u32*>(&Al[r][kc + 8]);
                    al[a][3] = *reinterpret_cast<const u32*>(&Al[r + 8][kc + 8]);
                }
                #pragma unroll
                for (int j = 0; j < 4; j++) {
                    u32 b[2];
                    b[0] = *reinterpret_cast<const u32*>(&Ws[fr[j] + g][kc]);
                    b[1] = *reinterpret_cast<const u32*>(&Ws[fr[j] + g][kc + 8]);
                    #pragma unroll
                    for (int a = 0; a < 2; a++) {
                        mma16816(tmp[a][j], ah[a], b);
                        mma16816(tmp[a][j], al[a], b);
                    }
                }
            }
            #pragma unroll
            for (int j = 0; j < 4; j++) {
                const float s0 = Sd[fr[j] + 2 * tg][blk], s1 = Sd[fr[j] + 2 * tg + 1][blk];
                #pragma unroll
                for (int a = 0; a < 2; a++) {
                    acc[a][j][0] += tmp[a][j][0] * s0;
                    acc[a][j][1] += tmp[a][j][1] * s1;
                    acc[a][j][2] += tmp[a][j][2] * s0;
                    acc[a][j][3] += tmp[a][j][3] * s1;
                }
            }
        }
        __syncthreads();
    }

    // c0, c1: row g, columns 2 tg, 2 tg + 1; c2, c3: row g + 8
    #pragma unroll
    for (int a = 0; a < 2; a++) {
        #pragma unroll
        for (int c = 0; c < 4; c++) {
            const int r = 16 * a + g + (c >= 2 ? 8 : 0);
            if (r >= nr) continue;
            const long long orow = (long long)(row0 + r) * nout;
            const float iv = inv[row0 + r];
            if (mode == 0) {
                #pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int n = n0 + 16 * warp + 8 * j + 2 * tg + (c & 1);
                    if (n >= nout) continue;
                    const float gv = acc[a][j][c] * iv, uv = acc[a][j + 2][c] * iv;
                    out[orow + n] = gv / (1.f + expf(-gv)) * uv;
                }
            } else {
                #pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int n = n0 + 32 * warp + 8 * j + 2 * tg + (c & 1);
                    if (n < nout) out[orow + n] = acc[a][j][c] * iv;
                }
            }
        }
    }
}

// A layer's pairs grouped by expert on the device (execute/prefill_device.py), for a chunk whose
// every routed expert is resident: ids (pairs = T k, int32 in 0 .. E - 1, token-major) and their
// router weights (float64) as pd_route wrote them. Rows are the pairs sorted by expert, tokens
// ascending within one (the order stable_order gives on the host); writes tok[row] (the pair's
// token), pair_of[p] (pair p's row), w32[p] = (float) weights[p], and the tiles of up to BM rows of
// each expert (tile_g = the expert id, an index into the layer's slot table); tiles from the last
// to max_tiles get tile_n = 0 (pf_mm / pf_mm2 blocks of those return at once), so the products'
// launches have a fixed shape. One block of 1024 threads; E <= GROUP_E.
#define GROUP_E 2048
extern "C" __global__ void __launch_bounds__(1024)
pf_group(const int* __restrict__ ids, const double* __restrict__ weights, int pairs, int k, int E, int max_tiles,
         int* __restrict__ tok, int* __restrict__ pair_of, float* __restrict__ w32, int* __restrict__ tile_row,
         int* __restrict__ tile_n, int* __restrict__ tile_g) {
    __shared__ int cnt[GROUP_E], start[GROUP_E], tstart[GROUP_E];
    __shared__ int ntiles;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nwarp = blockDim.x >> 5;
    for (int e = tid; e < E; e += blockDim.x) cnt[e] = 0;
    __syncthreads();
    for (int p = tid; p < pairs; p += blockDim.x) {
        atomicAdd(&cnt[ids[p]], 1);
        w32[p] = __double2float_rn(weights[p]);
    }
    __syncthreads();
    if (warp == 0) {  // exclusive scans of the rows and of the tiles of each expert
        int run = 0, trun = 0;
        for (int b = 0; b < E; b += 32) {
            const int e = b + lane, c = e < E ? cnt[e] : 0, tc = (c + BM - 1) / BM;
            int v = c, tv = tc;
            for (int o = 1; o < 32; o <<= 1) {
                const int n = __shfl_up_sync(0xffffffffu, v, o), tn = __shfl_up_sync(0xffffffffu, tv, o);
                if (lane >= o) { v += n; tv += tn; }
            }
            if (e < E) { start[e] = run + v - c; tstart[e] = trun + tv - tc; }
            run += __shfl_sync(0xffffffffu, v, 31);
            trun += __shfl_sync(0xffffffffu, tv, 31);
        }
        if (lane == 0) ntiles = trun;
    }
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x) {
        const int c = cnt[e];
        for (int j = 0; j * BM < c; j++) {
            const int t = tstart[e] + j;
            if (t < max_tiles) {
                tile_row[t] = start[e] + j * BM;
                tile_n[t] = min(BM, c - j * BM);
                tile_g[t] = e;
            }
        }
    }
    for (int t = ntiles + tid; t < max_tiles; t += blockDim.x) { tile_row[t] = 0; tile_n[t] = 0; tile_g[t] = 0; }
    __syncthreads();
    for (int e = tid; e < E; e += blockDim.x) cnt[e] = start[e];  // the next free row of each expert
    __syncthreads();
    // pairs in rounds of blockDim.x in pair order; within a round the warps take rows in turn and
    // a warp's lanes of one expert in lane order: rows of an expert follow pair (token) order
    for (int p0 = 0; p0 < pairs; p0 += blockDim.x) {
        const int p = p0 + tid, e = p < pairs ? ids[p] : -1 - lane;  // distinct negatives: no group
        const unsigned same = __match_any_sync(0xffffffffu, e);
        const int leader = __ffs(same) - 1, before = __popc(same & ((1u << lane) - 1));
        for (int w = 0; w < nwarp; w++) {
            if (warp == w) {
                int base = 0;
                if (e >= 0 && lane == leader) {
                    base = cnt[e];
                    cnt[e] = base + __popc(same);
                }
                base = __shfl_sync(0xffffffffu, base, leader);
                if (e >= 0) {
                    const int row = base + before;
                    tok[row] = p / k;
                    pair_of[p] = row;
                }
            }
            __syncthreads();
        }
    }
}
