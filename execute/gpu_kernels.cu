// moelab GPU expert kernels (compiled at run time by CuPy/NVRTC; see execute/gpu_experts.py).
//
// Weights are read in their GGML block type straight from a slot or scratch buffer. A row of
// `cols` weights is split into units of 32 consecutive weights; a warp covers 4 units per
// iteration, each lane dequantizing 4 consecutive weights (lane / 8 = unit, lane % 8 = quad).
// A warp computes one output row for every token of one expert group (tokens in chunks of TB,
// so each weight is read once per chunk); blocks are 4 warps over consecutive rows of a group.
//
// An expert in memory: [float32 biases: gate (ffn) | up (ffn) | down (hidden)] when the layer has
// them (`bias` != 0), then gate | up | down at byte offsets off_g, off_u, off_d from its base.

#define TB 4
#define WARPS 4

enum { F32 = 0, F16 = 1, Q4_0 = 2, Q8_0 = 8, Q4_K = 12, Q6_K = 14, BF16 = 30, MXFP4 = 39 };

__device__ __forceinline__ float h2f(unsigned short h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ unsigned short ld16(const unsigned char* p) {
    return *reinterpret_cast<const unsigned short*>(p);  // every 16-bit field is 2-aligned
}

__device__ __forceinline__ unsigned int ld32(const unsigned char* p) {  // 2-aligned 4 bytes
    return (unsigned int)ld16(p) | ((unsigned int)ld16(p + 2) << 16);
}

// Q4_K: 6-bit scale and min of sub-block s (0..7); sc points at the 12 packed bytes
__device__ __forceinline__ void q4k_scale_min(const unsigned char* sc, int s, int* d, int* m) {
    if (s < 4) {
        *d = sc[s] & 63;
        *m = sc[s + 4] & 63;
    } else {
        *d = (sc[s + 4] & 15) | ((sc[s - 4] >> 6) << 4);
        *m = (sc[s + 4] >> 4) | ((sc[s] >> 6) << 4);
    }
}

// weights 32*unit + 4*quad .. +3 of the row starting at `row` -> w[0..3]
__device__ __forceinline__ void dequant4(int qt, const unsigned char* row, int unit, int quad, float* w) {
    if (qt == Q8_0) {  // block 34: f16 d, i8 qs[32]
        const unsigned char* b = row + unit * 34;
        float d = h2f(ld16(b));
        unsigned int q = ld32(b + 2 + 4 * quad);
        #pragma unroll
        for (int i = 0; i < 4; i++) w[i] = d * (float)(signed char)(q >> (8 * i));
    } else if (qt == Q4_0) {  // block 18: f16 d, u8 qs[16]; weights 0..15 low nibbles, 16..31 high
        const unsigned char* b = row + unit * 18;
        float d = h2f(ld16(b));
        unsigned int q = ld32(b + 2 + 4 * (quad & 3));
        int sh = quad < 4 ? 0 : 4;
        #pragma unroll
        for (int i = 0; i < 4; i++) w[i] = d * (float)((int)((q >> (8 * i + sh)) & 15) - 8);
    } else if (qt == Q4_K) {  // block 144: f16 d, f16 dmin, scales[12], qs[128]; unit = sub-block
        const unsigned char* b = row + (unit >> 3) * 144;
        int s = unit & 7, sc, mn;
        q4k_scale_min(b + 4, s, &sc, &mn);
        float d = h2f(ld16(b)) * sc, m = h2f(ld16(b + 2)) * mn;
        unsigned int q = ld32(b + 16 + 32 * (s >> 1) + 4 * quad);
        int sh = (s & 1) * 4;
        #pragma unroll
        for (int i = 0; i < 4; i++) w[i] = d * (float)((q >> (8 * i + sh)) & 15) - m;
    } else if (qt == Q6_K) {  // block 210: ql[128], qh[64], i8 scales[16], f16 d
        const unsigned char* b = row + (unit >> 3) * 210;
        int s = unit & 7, half = s >> 2, qq = s & 3, l = 4 * quad;
        float d = h2f(ld16(b + 208)) * (float)(signed char)b[192 + 8 * half + 2 * qq + (l >> 4)];
        unsigned int lo = ld32(b + 64 * half + 32 * (qq & 1) + l);
        unsigned int hi = ld32(b + 128 + 32 * half + l);
        int lsh = (qq >> 1) * 4, hsh = 2 * qq;
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            int v = ((lo >> (8 * i + lsh)) & 15) | (((hi >> (8 * i + hsh)) & 3) << 4);
            w[i] = d * (float)(v - 32);
        }
    } else if (qt == MXFP4) {  // block 17: u8 e (E8M0), u8 qs[16]; weights 0..15 low nibbles, 16..31 high
        const unsigned char* b = row + unit * 17;  // odd blocks: byte loads only
        unsigned int e = b[0];
        float d = __uint_as_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);  // 2^(e - 128), exact
        const unsigned char* q = b + 1 + 4 * (quad & 3);
        int sh = quad < 4 ? 0 : 4;
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            int n = (q[i] >> sh) & 15;  // E2M1 code: bit 3 sign, magnitude (doubled) 0 1 2 3 4 6 8 12
            float v = (float)(__byte_perm(0x03020100u, 0x0C080604u, n & 7) & 0xff);
            w[i] = d * (n & 8 ? -v : v);
        }
    } else if (qt == F32) {
        const float* p = reinterpret_cast<const float*>(row) + unit * 32 + 4 * quad;
        #pragma unroll
        for (int i = 0; i < 4; i++) w[i] = p[i];
    } else if (qt == F16) {
        const unsigned short* p = reinterpret_cast<const unsigned short*>(row) + unit * 32 + 4 * quad;
        #pragma unroll
        for (int i = 0; i < 4; i++) w[i] = h2f(p[i]);
    } else {  // BF16
        const unsigned short* p = reinterpret_cast<const unsigned short*>(row) + unit * 32 + 4 * quad;
        #pragma unroll
        for (int i = 0; i < 4; i++) w[i] = __uint_as_float((unsigned int)p[i] << 16);
    }
}

// the expert nonlinearity on gate a and up b (biases added): ACT_SILU silu(a) * b; ACT_OAI
// gpt-oss's clamped SwiGLU: a = min(a, 7), b = clip(b, -7, 7), a * sigmoid(1.702 a) * (b + 1)
enum { ACT_SILU = 0, ACT_OAI = 1 };

__device__ __forceinline__ float expert_act(int act, float a, float b) {
    if (act == ACT_OAI) {
        a = fminf(a, 7.f);
        b = fminf(fmaxf(b, -7.f), 7.f);
        return a / (1.f + __expf(-1.702f * a)) * (b + 1.f);
    }
    return a / (1.f + __expf(-a)) * b;
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// acc[t] += row . x[xrow[order[p0 + t]]] for t < nt (lane partial sums)
__device__ __forceinline__ void row_dot(int qt, const unsigned char* row, int cols, const float* x, long long ldx,
                                        const int* tok, int nt, float* acc) {
    int lane = threadIdx.x & 31, quad = lane & 7, units = cols >> 5;
    for (int u = lane >> 3; u < units; u += 4) {
        float w[4];
        dequant4(qt, row, u, quad, w);
        int c = u * 32 + 4 * quad;
        #pragma unroll
        for (int t = 0; t < TB; t++) {
            if (t < nt) {
                float4 xv = *reinterpret_cast<const float4*>(x + tok[t] * ldx + c);
                acc[t] += w[0] * xv.x + w[1] * xv.y + w[2] * xv.z + w[3] * xv.w;
            }
        }
    }
}

// h[pair, r] = act(gate_e x[xrow[pair]] + bg_e, up_e x[xrow[pair]] + bu_e) for every pair of every group.
// grid (ceil(ffn / (WARPS * rows_per_warp)), groups), block 32 * WARPS.
extern "C" __global__ void moe_gate_up(const unsigned long long* __restrict__ base,  // (G,) expert base
                                       const int* __restrict__ gstart,  // (G + 1,)
                                       const int* __restrict__ order,   // (P,) pair ids by group
                                       const int* __restrict__ xrow,    // (P,) row of x per pair
                                       const float* __restrict__ x, long long ldx,  // (T, hidden)
                                       float* __restrict__ h,           // (P, ffn)
                                       int ffn, int hidden, int rows_per_warp, long long off_g,
                                       int qt_g, long long rb_g, long long off_u, int qt_u, long long rb_u,
                                       int act, int bias) {
    int g = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned char* e = reinterpret_cast<const unsigned char*>(base[g]);
    int r0 = (blockIdx.x * WARPS + warp) * rows_per_warp;
    for (int r = r0; r < min(r0 + rows_per_warp, ffn); r++) {
        float bg = bias ? reinterpret_cast<const float*>(e)[r] : 0.f;
        float bu = bias ? reinterpret_cast<const float*>(e)[ffn + r] : 0.f;
        for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += TB) {
            int nt = min(TB, gstart[g + 1] - p0), tok[TB];
            #pragma unroll
            for (int t = 0; t < TB; t++) tok[t] = t < nt ? xrow[order[p0 + t]] : 0;
            float ag[TB] = {0.f, 0.f, 0.f, 0.f}, au[TB] = {0.f, 0.f, 0.f, 0.f};
            row_dot(qt_g, e + off_g + r * rb_g, hidden, x, ldx, tok, nt, ag);
            row_dot(qt_u, e + off_u + r * rb_u, hidden, x, ldx, tok, nt, au);
            #pragma unroll
            for (int t = 0; t < TB; t++) {
                float a = warp_sum(ag[t]) + bg, b = warp_sum(au[t]) + bu;
                if (lane == 0 && t < nt) h[(long long)order[p0 + t] * ffn + r] = expert_act(act, a, b);
            }
        }
    }
}

// y[pair, r] = down_e h[pair] + bd_e for every pair of every group. grid (ceil(hidden / (WARPS * rows_per_warp)), G).
extern "C" __global__ void moe_down(const unsigned long long* __restrict__ base,
                                    const int* __restrict__ gstart,
                                    const int* __restrict__ order,
                                    const float* __restrict__ h,  // (P, ffn)
                                    float* __restrict__ y,        // (P, hidden)
                                    int ffn, int hidden, int rows_per_warp,
                                    long long off_d, int qt_d, long long rb_d, int bias) {
    int g = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const float* bd = reinterpret_cast<const float*>(base[g]) + 2 * ffn;
    const unsigned char* e = reinterpret_cast<const unsigned char*>(base[g]) + off_d;
    int r0 = (blockIdx.x * WARPS + warp) * rows_per_warp;
    for (int r = r0; r < min(r0 + rows_per_warp, hidden); r++) {
        float b = bias ? bd[r] : 0.f;
        for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += TB) {
            int nt = min(TB, gstart[g + 1] - p0), tok[TB];
            #pragma unroll
            for (int t = 0; t < TB; t++) tok[t] = t < nt ? order[p0 + t] : 0;
            float a[TB] = {0.f, 0.f, 0.f, 0.f};
            row_dot(qt_d, e + r * rb_d, ffn, h, ffn, tok, nt, a);
            #pragma unroll
            for (int t = 0; t < TB; t++) {
                float s = warp_sum(a[t]) + b;
                if (lane == 0 && t < nt) y[(long long)tok[t] * hidden + r] = s;
            }
        }
    }
}

// out[t] = sum_j weight[t, j] * y[pair_of[t, j]] in j order (pair_of < 0: skipped). grid T, block 256.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const int* __restrict__ pair_of,
                                       const float* __restrict__ weight, float* __restrict__ out,
                                       int k, int hidden) {
    int t = blockIdx.x;
    for (int c = threadIdx.x; c < hidden; c += blockDim.x) {
        float s = 0.f;
        for (int j = 0; j < k; j++) {
            int p = pair_of[t * k + j];
            if (p >= 0) s += weight[t * k + j] * y[(long long)p * hidden + c];
        }
        out[(long long)t * hidden + c] = s;
    }
}

// One-token layer (decode), metadata by value: no copy precedes these kernels. Pair j is the
// token's j-th routed expert (rank order); `base[j]` its address (slot or scratch), `weight[j]`
// its router weight, and `pick` lists the pairs a moe1_gate_up launch covers (blockIdx.y -> j),
// so the hits can start before the uploads of the same step have landed.
#define MAXK 32

struct Experts1 {
    unsigned long long base[MAXK];
    float weight[MAXK];
    int pick[MAXK];
};

// h[j, r] = act(gate_j x + bg_j, up_j x + bu_j) for the rows of this block's warps; e: pair j's expert.
__device__ __forceinline__ void gate_up1_rows(const unsigned char* e, int j, const float* __restrict__ x,
                                              float* __restrict__ h, int ffn, int hidden, int rows_per_warp,
                                              long long off_g, int qt_g, long long rb_g, long long off_u, int qt_u,
                                              long long rb_u, int act, int bias) {
    int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    int r0 = (blockIdx.x * WARPS + warp) * rows_per_warp, tok[TB] = {0, 0, 0, 0};
    for (int r = r0; r < min(r0 + rows_per_warp, ffn); r++) {
        float ag[TB] = {0.f, 0.f, 0.f, 0.f}, au[TB] = {0.f, 0.f, 0.f, 0.f};
        row_dot(qt_g, e + off_g + r * rb_g, hidden, x, 0, tok, 1, ag);
        row_dot(qt_u, e + off_u + r * rb_u, hidden, x, 0, tok, 1, au);
        float a = warp_sum(ag[0]), b = warp_sum(au[0]);
        if (bias) {
            a += reinterpret_cast<const float*>(e)[r];
            b += reinterpret_cast<const float*>(e)[ffn + r];
        }
        if (lane == 0) h[(long long)j * ffn + r] = expert_act(act, a, b);
    }
}

// h[j, r] = act(gate_j x + bg_j, up_j x + bu_j) for j = pick[blockIdx.y]; x (hidden,), h (k, ffn).
// grid (ceil(ffn / (WARPS * rows_per_warp)), pairs picked), block 32 * WARPS.
extern "C" __global__ void moe1_gate_up(const Experts1 ex, const float* __restrict__ x, float* __restrict__ h,
                                        int ffn, int hidden, int rows_per_warp, long long off_g, int qt_g,
                                        long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias) {
    int j = ex.pick[blockIdx.y];
    gate_up1_rows(reinterpret_cast<const unsigned char*>(ex.base[j]), j, x, h, ffn, hidden, rows_per_warp,
                  off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias);
}

// moe1_gate_up for a step begun before its decision, over every routed pair: a pair with
// ex.base[j] != 0 is resident (as moe1_gate_up); for the others thread 0 waits until late[j]
// (device memory, one 8-byte word: the slot address, 256-byte aligned, with the step's tag
// seq % 255 + 1 in its low byte) carries this step's tag, written by the copy stream after the
// step's uploads (or by a release: address 0, nothing written). Tag and address in one aligned
// word are seen together. A wait past timeout_ns writes err[1] = the word last seen, err[2] = j,
// then err[0] = seq (mapped host memory), and computes nothing.
extern "C" __global__ void moe1_gate_up_late(const Experts1 ex, const unsigned long long* late, long long seq,
                                             long long timeout_ns, long long* err, const float* __restrict__ x,
                                             float* __restrict__ h, int ffn, int hidden, int rows_per_warp,
                                             long long off_g, int qt_g, long long rb_g, long long off_u, int qt_u,
                                             long long rb_u, int act, int bias) {
    __shared__ unsigned long long got;
    int j = ex.pick[blockIdx.y];
    unsigned long long b = ex.base[j];
    if (!b) {
        if (threadIdx.x == 0) {
            unsigned long long t0, t, w, tag = (unsigned long long)(seq % 255 + 1);
            asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
            for (;;) {
                asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(w) : "l"(late + j) : "memory");
                if ((w & 0xffull) == tag) {
                    w &= ~0xffull;
                    break;
                }
                asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
                if ((long long)(t - t0) > timeout_ns) {
                    volatile long long* e = err;  // (mapped memory: plain stores, no atomic over the link)
                    e[1] = (long long)w;
                    e[2] = j;
                    __threadfence_system();
                    e[0] = seq;
                    __threadfence_system();
                    w = 0;
                    break;
                }
                __nanosleep(100);
            }
            __threadfence();
            got = w;
        }
        __syncthreads();
        b = got;
        if (!b) return;
    }
    gate_up1_rows(reinterpret_cast<const unsigned char*>(b), j, x, h, ffn, hidden, rows_per_warp,
                  off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias);
}

// Rows r0 .. r0 + rows_per_block - 1 (those below hidden) of pair j's down projection of h[j] (plus
// its bias), by the calling warp: lane 0 writes row r0 + i to out[i].
__device__ __forceinline__ void down1_rows(const unsigned char* e, int j, const float* __restrict__ h, int ffn,
                                           int hidden, int r0, int rows_per_block, long long off_d, int qt_d,
                                           long long rb_d, int bias, float* out) {
    int lane = threadIdx.x & 31, tok[TB] = {0, 0, 0, 0};
    const float* bd = reinterpret_cast<const float*>(e) + 2 * ffn;
    for (int i = 0; i < rows_per_block && r0 + i < hidden; i++) {
        int r = r0 + i;
        float a[TB] = {0.f, 0.f, 0.f, 0.f};
        row_dot(qt_d, e + off_d + r * rb_d, ffn, h + (long long)j * ffn, 0, tok, 1, a);
        float s = warp_sum(a[0]);
        if (lane == 0) out[i] = bias ? s + bd[r] : s;
    }
}

// out[r] = sum_j weight[j] * (down_j h[j] + bd_j)[r], j = 0 .. k - 1 in order (warp j computes
// pair j's rows into shared memory, then one thread per row sums them: the order of moe_combine).
// grid ceil(hidden / rows_per_block), block 32 * k; rows_per_block <= 32.
extern "C" __global__ void moe1_down_combine(const Experts1 ex, const float* __restrict__ h, float* __restrict__ out,
                                             int k, int ffn, int hidden, int rows_per_block, long long off_d,
                                             int qt_d, long long rb_d, int bias) {
    __shared__ float ys[MAXK][32];
    int j = threadIdx.x >> 5, r0 = blockIdx.x * rows_per_block;
    down1_rows(reinterpret_cast<const unsigned char*>(ex.base[j]), j, h, ffn, hidden, r0, rows_per_block, off_d, qt_d,
               rb_d, bias, ys[j]);
    __syncthreads();
    int i = threadIdx.x;
    if (i < rows_per_block && r0 + i < hidden) {
        float s = 0.f;
        for (int jj = 0; jj < k; jj++) s += ex.weight[jj] * ys[jj][i];
        out[r0 + i] = s;
    }
}

// One-token layer inside a token's CUDA graph: the pairs come from device memory, not from the
// host. route: the router kernel's output (ids as int bits [0, k), weights [k, 2k)); table: the
// layer's row of the slot table (expert -> device address, 0 when not resident); halt: the first
// layer of the token whose routed experts were not all resident (the token's number of layers
// when none). moe1r_gate_up checks the k routed experts first: when one is missing it lowers halt
// to this layer and writes nothing; neither kernel runs once halt <= layer (an earlier miss
// included). Otherwise they compute exactly what moe1_gate_up / moe1_down_combine compute.
__device__ __forceinline__ unsigned long long route_base(const float* route, const unsigned long long* table, int j) {
    return table[__float_as_int(route[j])];
}

// grid (ceil(ffn / (WARPS * rows_per_warp)), k), block 32 * WARPS.
extern "C" __global__ void moe1r_gate_up(const float* __restrict__ route, const unsigned long long* __restrict__ table,
                                         int* halt, int layer, int k, const float* __restrict__ x, float* __restrict__ h,
                                         int ffn, int hidden, int rows_per_warp, long long off_g, int qt_g,
                                         long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias) {
    __shared__ int missing;
    if (*(volatile int*)halt < layer) return;
    if (threadIdx.x == 0) {
        int miss = 0;
        for (int jj = 0; jj < k; jj++) miss |= route_base(route, table, jj) == 0ull;
        missing = miss;
    }
    __syncthreads();
    if (missing) {
        if (threadIdx.x == 0) atomicMin(halt, layer);
        return;
    }
    int j = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned char* e = reinterpret_cast<const unsigned char*>(route_base(route, table, j));
    int r0 = (blockIdx.x * WARPS + warp) * rows_per_warp, tok[TB] = {0, 0, 0, 0};
    for (int r = r0; r < min(r0 + rows_per_warp, ffn); r++) {
        float ag[TB] = {0.f, 0.f, 0.f, 0.f}, au[TB] = {0.f, 0.f, 0.f, 0.f};
        row_dot(qt_g, e + off_g + r * rb_g, hidden, x, 0, tok, 1, ag);
        row_dot(qt_u, e + off_u + r * rb_u, hidden, x, 0, tok, 1, au);
        float a = warp_sum(ag[0]), b = warp_sum(au[0]);
        if (bias) {
            a += reinterpret_cast<const float*>(e)[r];
            b += reinterpret_cast<const float*>(e)[ffn + r];
        }
        if (lane == 0) h[(long long)j * ffn + r] = expert_act(act, a, b);
    }
}

// grid ceil(hidden / rows_per_block), block 32 * k; rows_per_block <= 32.
extern "C" __global__ void moe1r_down_combine(const float* __restrict__ route, const unsigned long long* __restrict__ table,
                                              const int* halt, int layer, const float* __restrict__ h,
                                              float* __restrict__ out, int k, int ffn, int hidden, int rows_per_block,
                                              long long off_d, int qt_d, long long rb_d, int bias) {
    __shared__ float ys[MAXK][32];
    if (*(volatile const int*)halt <= layer) return;
    int j = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * rows_per_block, tok[TB] = {0, 0, 0, 0};
    const unsigned char* e = reinterpret_cast<const unsigned char*>(route_base(route, table, j));
    const float* bd = reinterpret_cast<const float*>(e) + 2 * ffn;
    for (int i = 0; i < rows_per_block && r0 + i < hidden; i++) {
        int r = r0 + i;
        float a[TB] = {0.f, 0.f, 0.f, 0.f};
        row_dot(qt_d, e + off_d + r * rb_d, ffn, h + (long long)j * ffn, 0, tok, 1, a);
        float s = warp_sum(a[0]);
        if (lane == 0) ys[j][i] = bias ? s + bd[r] : s;
    }
    __syncthreads();
    int i = threadIdx.x;
    if (i < rows_per_block && r0 + i < hidden) {
        float s = 0.f;
        for (int jj = 0; jj < k; jj++) s += route[k + jj] * ys[jj][i];
        out[r0 + i] = s;
    }
}

// ---- v2 one-token kernels of the token graph (MOELAB_DECODE_KERNELS=v2, v3) ------------------
// moe1r_gate_up_v2 / moe1r_down_combine_v2 take the arguments, grid and block of moe1r_gate_up /
// moe1r_down_combine and compute the same sums in the same order per lane (so the same values up
// to the compiler's fused multiply-adds). What differs is how the loads are issued: the weight
// type is resolved once per launch (a template per type) instead of once per 4 weights, and a
// row's units are read in batches of V2_IT iterations unrolled at compile time (loads guarded,
// not branched), so a lane has all of a batch's loads in flight before its first use; gate and up
// share each x load; moe1r_down_combine_v2 reads its block's two rows in the same batch; the
// residency check is one warp's vote instead of one thread's loop.
#define V2_IT 8

// Programmatic dependent launch: wait for the grids this one depends on; let the next grid (a
// dense kernel v3 launches with it) start its blocks early. No-ops for a plain launch, or below sm_90.
__device__ __forceinline__ void pdl_wait_trigger() {
#if __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// rows_dot_v2 (below) for Q8_0 in two phases: every weight load of the batch (scale and the lane's 4
// quants, as 16-bit loads: a block is 34 bytes, so only 2-byte aligned), then x and the sums.
template <int NR>
__device__ __forceinline__ void rows_dot_q8_v2(const unsigned char* const* rows, int nr, int cols, const float* x,
                                               float* acc) {
    int lane = threadIdx.x & 31, quad = lane & 7, units = cols >> 5;
    for (int ub = 0; ub < units; ub += 4 * V2_IT) {
        unsigned short dq[V2_IT][NR], lo[V2_IT][NR], hi[V2_IT][NR];
        #pragma unroll
        for (int it = 0; it < V2_IT; it++) {
            int u = min(ub + (lane >> 3) + 4 * it, units - 1);
            #pragma unroll
            for (int i = 0; i < NR; i++) {
                const unsigned char* b = rows[i] + u * 34;
                dq[it][i] = __ldg(reinterpret_cast<const unsigned short*>(b));
                lo[it][i] = __ldg(reinterpret_cast<const unsigned short*>(b + 2 + 4 * quad));
                hi[it][i] = __ldg(reinterpret_cast<const unsigned short*>(b + 4 + 4 * quad));
            }
        }
        #pragma unroll
        for (int it = 0; it < V2_IT; it++) {
            int u = ub + (lane >> 3) + 4 * it;
            bool on = u < units;
            float4 xv = *reinterpret_cast<const float4*>(x + min(u, units - 1) * 32 + 4 * quad);
            #pragma unroll
            for (int i = 0; i < NR; i++) {
                float d = h2f(dq[it][i]), w[4];
                unsigned int q = (unsigned int)lo[it][i] | ((unsigned int)hi[it][i] << 16);
                #pragma unroll
                for (int n = 0; n < 4; n++) w[n] = d * (float)(signed char)(q >> (8 * n));
                float v = w[0] * xv.x + w[1] * xv.y + w[2] * xv.z + w[3] * xv.w;
                if (on && i < nr) acc[i] += v;
            }
        }
    }
}

// acc[i] += row_i . x over units u = lane / 8 + 4 * it, for rows i < nr (NR >= nr; rows[i] valid
// for every i < NR), in row_dot's order. The batch is branch-free: a lane past the row's units
// loads its last unit again and adds nothing, so every load of a batch is issued before a use.
template <int QT, int NR>
__device__ __forceinline__ void rows_dot_v2(const unsigned char* const* rows, int nr, int cols, const float* x,
                                            float* acc) {
    if (QT == Q8_0) {
        rows_dot_q8_v2<NR>(rows, nr, cols, x, acc);
        return;
    }
    int lane = threadIdx.x & 31, quad = lane & 7, units = cols >> 5;
    for (int ub = 0; ub < units; ub += 4 * V2_IT) {
        #pragma unroll
        for (int it = 0; it < V2_IT; it++) {
            int u = ub + (lane >> 3) + 4 * it;
            bool on = u < units;
            int uc = on ? u : units - 1, c = uc * 32 + 4 * quad;
            float4 xv = *reinterpret_cast<const float4*>(x + c);
            #pragma unroll
            for (int i = 0; i < NR; i++) {
                float w[4];
                dequant4(QT, rows[i], uc, quad, w);
                float v = w[0] * xv.x + w[1] * xv.y + w[2] * xv.z + w[3] * xv.w;
                if (on && i < nr) acc[i] += v;
            }
        }
    }
}

// the weight type as a template argument: f<QT>() for the eight types dequant4 reads
#define V2_DISPATCH(qt, CALL)                              \
    switch (qt) {                                          \
        case Q8_0: CALL(Q8_0); break;                      \
        case Q4_0: CALL(Q4_0); break;                      \
        case Q4_K: CALL(Q4_K); break;                      \
        case Q6_K: CALL(Q6_K); break;                      \
        case MXFP4: CALL(MXFP4); break;                    \
        case F32: CALL(F32); break;                        \
        case F16: CALL(F16); break;                        \
        default: CALL(BF16); break;                        \
    }

// the first missing routed expert of this block's layer (warp 0 votes; k <= 32): nonzero when any
__device__ __forceinline__ int routes_missing(const float* route, const unsigned long long* table, int k) {
    __shared__ int missing;
    if (threadIdx.x < 32) {
        int lane = threadIdx.x;
        bool miss = lane < k && route_base(route, table, lane) == 0ull;
        unsigned int any = __ballot_sync(0xffffffffu, miss);
        if (lane == 0) missing = any != 0u;
    }
    __syncthreads();
    return missing;
}

// this warp's gate/up rows r0 .. r0 + rows_per_warp - 1 of pair j (expert e), v2's loads (any types)
__device__ __forceinline__ void gate_up_rows_v2(const unsigned char* e, int j, int r0, int ffn, int hidden,
                                                int rows_per_warp, long long off_g, int qt_g, long long rb_g,
                                                long long off_u, int qt_u, long long rb_u, int act, int bias,
                                                const float* x, float* h, int lane) {
    for (int r = r0; r < min(r0 + rows_per_warp, ffn); r++) {
        float ag[1] = {0.f}, au[1] = {0.f};
        const unsigned char* rg[1] = {e + off_g + r * rb_g};
        const unsigned char* ru[1] = {e + off_u + r * rb_u};
        if (qt_g == qt_u) {
            const unsigned char* both[2] = {rg[0], ru[0]};
            float a2[2] = {0.f, 0.f};
#define V2_GU(T) rows_dot_v2<T, 2>(both, 2, hidden, x, a2)
            V2_DISPATCH(qt_g, V2_GU)
#undef V2_GU
            ag[0] = a2[0];
            au[0] = a2[1];
        } else {
#define V2_G(T) rows_dot_v2<T, 1>(rg, 1, hidden, x, ag)
#define V2_U(T) rows_dot_v2<T, 1>(ru, 1, hidden, x, au)
            V2_DISPATCH(qt_g, V2_G)
            V2_DISPATCH(qt_u, V2_U)
#undef V2_G
#undef V2_U
        }
        float a = warp_sum(ag[0]), b = warp_sum(au[0]);
        if (bias) {
            a += reinterpret_cast<const float*>(e)[r];
            b += reinterpret_cast<const float*>(e)[ffn + r];
        }
        if (lane == 0) h[(long long)j * ffn + r] = expert_act(act, a, b);
    }
}

// grid (ceil(ffn / (WARPS * rows_per_warp)), k), block 32 * WARPS (as moe1r_gate_up).
extern "C" __global__ void __launch_bounds__(32 * WARPS) moe1r_gate_up_v2(
        const float* __restrict__ route, const unsigned long long* __restrict__ table, int* halt, int layer, int k,
        const float* __restrict__ x, float* __restrict__ h, int ffn, int hidden, int rows_per_warp, long long off_g,
        int qt_g, long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias) {
    pdl_wait_trigger();
    if (*(volatile int*)halt < layer) return;
    if (routes_missing(route, table, k)) {
        if (threadIdx.x == 0) atomicMin(halt, layer);
        return;
    }
    int j = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const unsigned char* e = reinterpret_cast<const unsigned char*>(route_base(route, table, j));
    gate_up_rows_v2(e, j, (blockIdx.x * WARPS + warp) * rows_per_warp, ffn, hidden, rows_per_warp, off_g, qt_g, rb_g,
                    off_u, qt_u, rb_u, act, bias, x, h, lane);
}

// grid ceil(hidden / rows_per_block), block 32 * k; rows_per_block <= 32 (as moe1r_down_combine).
extern "C" __global__ void __launch_bounds__(32 * MAXK) moe1r_down_combine_v2(
        const float* __restrict__ route, const unsigned long long* __restrict__ table, const int* halt, int layer,
        const float* __restrict__ h, float* __restrict__ out, int k, int ffn, int hidden, int rows_per_block,
        long long off_d, int qt_d, long long rb_d, int bias) {
    __shared__ float ys[MAXK][32];
    pdl_wait_trigger();
    if (*(volatile const int*)halt <= layer) return;
    int j = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * rows_per_block;
    const unsigned char* e = reinterpret_cast<const unsigned char*>(route_base(route, table, j));
    const float* bd = reinterpret_cast<const float*>(e) + 2 * ffn;
    const float* hj = h + (long long)j * ffn;
    for (int i = 0; i < rows_per_block && r0 + i < hidden; i += 2) {  // two rows per batch
        int r = r0 + i, nr = min(2, min(rows_per_block - i, hidden - r));
        const unsigned char* rows[2] = {e + off_d + r * rb_d, e + off_d + (r + nr - 1) * rb_d};
        float a[2] = {0.f, 0.f};
#define V2_D(T) rows_dot_v2<T, 2>(rows, nr, ffn, hj, a)
        V2_DISPATCH(qt_d, V2_D)
#undef V2_D
        float s0 = warp_sum(a[0]), s1 = warp_sum(a[1]);
        if (lane == 0) {
            ys[j][i] = bias ? s0 + bd[r] : s0;
            if (nr > 1) ys[j][i + 1] = bias ? s1 + bd[r + 1] : s1;
        }
    }
    __syncthreads();
    int i = threadIdx.x;
    if (i < rows_per_block && r0 + i < hidden) {
        float s = 0.f;
        for (int jj = 0; jj < k; jj++) s += route[k + jj] * ys[jj][i];
        out[r0 + i] = s;
    }
}
