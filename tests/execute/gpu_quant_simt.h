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


static inline void __syncthreads() { pthread_barrier_wait(&g_bar); }
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
