// SIMT emulation of the CUDA features gpu_quant.cu's kernels use (tests/execute/test_gpu_quant.py):
// one std::thread per CUDA thread, one block at a time; __syncthreads and warp shuffles through
// pthread barriers, shared memory as statics (one block runs at a time). Checks the kernels'
// indexing, staging and reductions on a host; says nothing of their speed.
#include <pthread.h>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>
struct uint4 { unsigned int x, y, z, w; };
struct float2 { float x, y; };
struct float4 { float x, y, z, w; };
struct Dim3 { unsigned x, y, z; };
thread_local Dim3 threadIdx, blockIdx;
Dim3 blockDim, gridDim;
static pthread_barrier_t g_bar, g_warp_bar[32];
static float g_shfl[1024];
static int g_shfl_i[1024];
#define __global__
#define __device__
#define __constant__
#define __shared__ static
#define __host__
#define __forceinline__
#define __noinline__
#define __restrict__
#define __launch_bounds__(...)
#define __align__(n) __attribute__((aligned(n)))


static inline void __syncthreads() { pthread_barrier_wait(&g_bar); }
static inline void __syncwarp() { pthread_barrier_wait(&g_warp_bar[threadIdx.x >> 5]); }
static inline float __shfl_xor_sync(unsigned, float v, int o) {
    int t = threadIdx.x, w = t >> 5;
    g_shfl[t] = v; pthread_barrier_wait(&g_warp_bar[w]);
    float r = g_shfl[(t & ~31) | ((t & 31) ^ o)]; pthread_barrier_wait(&g_warp_bar[w]);
    return r;
}
static inline int __float_as_int(float f) { int i; memcpy(&i, &f, 4); return i; }
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
static inline float __uint_as_float(unsigned i) { float f; memcpy(&f, &i, 4); return f; }
#define __expf expf
static inline float4 __ldg(const float4* p) { return *p; }
using std::min; using std::max;
template <class K> void launch(Dim3 grid, unsigned threads, K kernel) {
    blockDim = {threads, 1, 1}; gridDim = grid;
    for (unsigned by = 0; by < grid.y; by++)
        for (unsigned bx = 0; bx < grid.x; bx++) {
            pthread_barrier_init(&g_bar, nullptr, threads);
            for (unsigned w = 0; w < threads / 32; w++) pthread_barrier_init(&g_warp_bar[w], nullptr, 32);
            std::vector<std::thread> ts;
            for (unsigned t = 0; t < threads; t++)
                ts.emplace_back([=] { threadIdx = {t, 0, 0}; blockIdx = {bx, by, 0}; kernel(); });
            for (auto& t : ts) t.join();
        }
}

// f16 conversions and mma.m16n8k16 (f16 in, f32 accumulation) for a warp, as PTX lays out fragments
static float simt_h2f(unsigned h) {
    h &= 0xffffu;
    unsigned e = (h >> 10) & 31, m = h & 1023;
    float f = e == 0 ? std::ldexp((float)m, -24) : e == 31 ? INFINITY : std::ldexp((float)(m | 1024), (int)e - 25);
    return (h >> 15) ? -f : f;
}
unsigned f2h(float f) {  // round to nearest even, subnormals included
    unsigned s = std::signbit(f) ? 0x8000u : 0u;
    float a = std::fabs(f);
    if (a == 0.f) return s;
    if (!(a < 65520.f)) return s | 0x7c00u;
    int e;
    std::frexp(a, &e);  // a = m 2^e, m in [0.5, 1)
    int sh = std::max(e - 11, -24);  // ulp 2^sh
    float q = std::nearbyint(std::ldexp(a, -sh));  // to nearest even (default rounding mode)
    if (sh == -24) return s | (unsigned)q;  // subnormal (q <= 1024: 1024 is the smallest normal)
    if (q >= 2048.f) { q /= 2; sh++; }
    return s | ((unsigned)(sh + 25) << 10) | ((unsigned)q - 1024u);
}
static unsigned g_mma_a[1024][4], g_mma_b[1024][2];
void mma16816(float* c, const unsigned* a, const unsigned* b) {
    int t = threadIdx.x, w = t >> 5, l = t & 31;
    for (int i = 0; i < 4; i++) g_mma_a[t][i] = a[i];
    for (int i = 0; i < 2; i++) g_mma_b[t][i] = b[i];
    pthread_barrier_wait(&g_warp_bar[w]);
    float A[16][16], B[16][8];
    for (int L = 0; L < 32; L++) {
        int g = L >> 2, q = L & 3;
        const unsigned* ra = g_mma_a[(t & ~31) | L];
        const unsigned* rb = g_mma_b[(t & ~31) | L];
        for (int h = 0; h < 2; h++) {
            A[g][2 * q + h] = simt_h2f(ra[0] >> (16 * h));
            A[g + 8][2 * q + h] = simt_h2f(ra[1] >> (16 * h));
            A[g][2 * q + 8 + h] = simt_h2f(ra[2] >> (16 * h));
            A[g + 8][2 * q + 8 + h] = simt_h2f(ra[3] >> (16 * h));
            B[2 * q + h][g] = simt_h2f(rb[0] >> (16 * h));
            B[2 * q + 8 + h][g] = simt_h2f(rb[1] >> (16 * h));
        }
    }
    pthread_barrier_wait(&g_warp_bar[w]);
    int g = l >> 2, q = l & 3;
    for (int i = 0; i < 4; i++) {
        int r = g + 8 * (i >> 1), n = 2 * q + (i & 1);
        double s = 0;
        for (int k = 0; k < 16; k++) s += (double)A[r][k] * B[k][n];
        c[i] += (float)s;
    }
}

// mma.m16n8k16 with int8 inputs and int32 sums for a warp, as PTX lays out its fragments
static unsigned g_mma8[1024][3];
void mma_s8k16(int* c, unsigned a0, unsigned a1, unsigned b) {
    int t = threadIdx.x, w = t >> 5, l = t & 31;
    g_mma8[t][0] = a0; g_mma8[t][1] = a1; g_mma8[t][2] = b;
    pthread_barrier_wait(&g_warp_bar[w]);
    int A[16][16], B[16][8];
    for (int L = 0; L < 32; L++) {
        int g = L >> 2, q = L & 3;
        const unsigned* r = g_mma8[(t & ~31) | L];
        for (int i = 0; i < 4; i++) {
            A[g][4 * q + i] = (signed char)(r[0] >> (8 * i));
            A[g + 8][4 * q + i] = (signed char)(r[1] >> (8 * i));
            B[4 * q + i][g] = (signed char)(r[2] >> (8 * i));
        }
    }
    pthread_barrier_wait(&g_warp_bar[w]);
    int g = l >> 2, q = l & 3;
    for (int i = 0; i < 4; i++) {
        int r = g + 8 * (i >> 1), n = 2 * q + (i & 1);
        for (int k = 0; k < 16; k++) c[i] += A[r][k] * B[k][n];
    }
}
