// moelab batched MoE product, second version (compiled at run time by CuPy/NVRTC; execute/prefill_mm2.py).
//
// pf_mm2 takes pf_mm's arguments, grid and block (execute/prefill_kernels.cu) and computes the same
// values in the same order (the same mma.sync m16n8k16 sequence per fragment, the same f32 block-scale
// accumulation), for Q8_0 weights only. What changes is how a k-step's operands reach shared memory:
// - a weight row's two Q8_0 blocks of the step (68 bytes: scale | 32 quants, twice) are copied as they
//   are stored, seventeen 4-byte cp.async per row (zero-filled past K and past the last row), instead
//   of 128 x 64 single-byte loads each converted on the way;
// - the activation rows (hi and lo f16 halves) as 16-byte cp.async;
// - two stages: step k + 1's copies are in flight while step k's products run;
// - a B fragment's two quants are turned into f16 in registers (prmt with 0x64 exponent bytes, then
//   minus 1152: exact for int8).
// Rows of a tile beyond tile_n and weight rows beyond nout are zero, as in pf_mm.

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define BM 32         // pair rows per tile
#define BN 128        // weight rows per tile (mode 0: 64 of gate, the same 64 of up)
#define BK 64         // k per step: two Q8_0 blocks
#define WB 68         // bytes of one row's step: 2 x (2 + 32)
#define WP 68         // shared row pitch of the weights in bytes (17 words: conflict-free fragment reads)
#define LDS (BK + 8)  // shared row stride of the activations in halves (16-byte aligned rows)

__device__ __forceinline__ void mma16816(float* c, const u32* a, const u32* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ u32 smem_addr(const void* p) {
    return static_cast<u32>(__cvta_generic_to_shared(p));
}

// n bytes (0..size) from src to shared dst, the rest of size zero-filled; size 4 or 16
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int n) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(n));
}

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int n) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(n));
}

__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;"); }

template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

__device__ __forceinline__ float h2f(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

// two int8 quants (little-endian in the low 16 bits of w) -> two f16 (low half: the first), exactly
__device__ __forceinline__ u32 q2h2(u32 w) {
    u32 r, m;
    asm("prmt.b32 %0, %1, %2, 0x4140;" : "=r"(r) : "r"(w ^ 0x8080u), "r"(0x64646464u));  // 1024 + (q + 128)
    asm("sub.f16x2 %0, %1, %2;" : "=r"(m) : "r"(r), "r"(0x64806480u));  // - 1152
    return m;
}

// the step at k0 into stage buffers (w, h, l) (one commit group): weight rows n0 .. (mode 0: 64 of
// off_a, the same 64 of off_b), activation rows row0 .. row0 + nr - 1; zeros elsewhere
__device__ __forceinline__ void load_step(unsigned char* w, u16 (*h)[LDS], u16 (*l)[LDS], const unsigned char* e,
                                          const u16* __restrict__ ahi, const u16* __restrict__ alo, int k0, int K,
                                          int n0, int nout, long long off_a, long long off_b, long long row_bytes,
                                          int mode, int row0, int nr) {
    const int wbytes = min(2, (K - k0) >> 5) * 34;  // the row's bytes of this step: 68, or 34 at K's end
    for (int i = threadIdx.x; i < BN * 17; i += 128) {
        const int r = i / 17, c = i - 17 * r, n = n0 + (mode == 0 ? (r & 63) : r);
        const unsigned char* row = e + (mode == 0 && r >= 64 ? off_b : off_a) + (long long)n * row_bytes;
        const int have = n < nout ? max(0, min(4, wbytes - 4 * c)) : 0;
        cp_async4(w + r * WP + 4 * c, have ? row + (k0 >> 5) * 34 + 4 * c : e, have);
    }
    const int chunks = min(BK, K - k0) >> 3;  // 16-byte chunks of a row's step (8 halves each)
    for (int i = threadIdx.x; i < BM * 8; i += 128) {
        const int r = i >> 3, c = i & 7;
        const bool ok = r < nr && c < chunks;
        const long long at = ok ? (long long)(row0 + r) * K + k0 + 8 * c : 0;
        cp_async16(&h[r][8 * c], ahi + at, ok ? 16 : 0);
        cp_async16(&l[r][8 * c], alo + at, ok ? 16 : 0);
    }
    cp_commit();
}

extern "C" __global__ void __launch_bounds__(128)
pf_mm2(const u64* __restrict__ base, const int* __restrict__ tile_row, const int* __restrict__ tile_n,
       const int* __restrict__ tile_g, const u16* __restrict__ ahi, const u16* __restrict__ alo,
       const float* __restrict__ inv, int K, int nout, long long off_a, long long off_b, long long row_bytes,
       int qt, int mode, float* __restrict__ out) {
    __shared__ __align__(16) unsigned char Ws[2][BN * WP];
    __shared__ __align__(16) u16 Ah[2][BM][LDS];
    __shared__ __align__(16) u16 Al[2][BM][LDS];

    const int t = blockIdx.y, row0 = tile_row[t], nr = tile_n[t];
    if (nr <= 0) return;  // a fixed-shape launch's unused tile (pf_group)
    const unsigned char* e = reinterpret_cast<const unsigned char*>(base[tile_g[t]]);
    const int half_n = mode == 0 ? 64 : 128;
    const int n0 = blockIdx.x * half_n;
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, tg = lane & 3;

    int fr[4];
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

    load_step(Ws[0], Ah[0], Al[0], e, ahi, alo, 0, K, n0, nout, off_a, off_b, row_bytes, mode, row0, nr);
    int s = 0;
    for (int k0 = 0; k0 < K; k0 += BK, s ^= 1) {
        if (k0 + BK < K) {
            load_step(Ws[s ^ 1], Ah[s ^ 1], Al[s ^ 1], e, ahi, alo, k0 + BK, K, n0, nout, off_a, off_b, row_bytes, mode,
                      row0, nr);
            cp_wait<1>();
        } else {
            cp_wait<0>();
        }
        __syncthreads();
        const unsigned char* W = Ws[s];
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
                    ah[a][0] = *reinterpret_cast<const u32*>(&Ah[s][r][kc]);
                    ah[a][1] = *reinterpret_cast<const u32*>(&Ah[s][r + 8][kc]);
                    ah[a][2] = *reinterpret_cast<const u32*>(&Ah[s][r][kc + 8]);
                    ah[a][3] = *reinterpret_cast<const u32*>(&Ah[s][r + 8][kc + 8]);
                    al[a][0] = *reinterpret_cast<const u32*>(&Al[s][r][kc]);
                    al[a][1] = *reinterpret_cast<const u32*>(&Al[s][r + 8][kc]);
                    al[a][2] = *reinterpret_cast<const u32*>(&Al[s][r][kc + 8]);
                    al[a][3] = *reinterpret_cast<const u32*>(&Al[s][r + 8][kc + 8]);
                }
                const int qb = blk * 34 + 2 + ks * 16 + 2 * tg;  // byte of quant kc in a row's step
                #pragma unroll
                for (int j = 0; j < 4; j++) {
                    const unsigned char* wr = W + (fr[j] + g) * WP + qb;
                    u32 b[2];
                    b[0] = q2h2(*reinterpret_cast<const u16*>(wr));
                    b[1] = q2h2(*reinterpret_cast<const u16*>(wr + 8));
                    #pragma unroll
                    for (int a = 0; a < 2; a++) {
                        mma16816(tmp[a][j], ah[a], b);
                        mma16816(tmp[a][j], al[a], b);
                    }
                }
            }
            #pragma unroll
            for (int j = 0; j < 4; j++) {
                const int r = fr[j] + 2 * tg;
                // a zero-filled block (past K) has scale 0, as pf_mm's
                const float s0 = h2f(*reinterpret_cast<const u16*>(W + r * WP + blk * 34));
                const float s1 = h2f(*reinterpret_cast<const u16*>(W + (r + 1) * WP + blk * 34));
                #pragma unroll
                for (int a = 0; a < 2; a++) {
                    acc[a][j][0] += tmp[a][j][0] * s0;
                    acc[a][j][1] += tmp[a][j][1] * s1;
                    acc[a][j][2] += tmp[a][j][2] * s0;
                    acc[a][j][3] += tmp[a][j][3] * s1;
                }
            }
        }
        __syncthreads();  // stage s is refilled by the next step's load
    }

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
