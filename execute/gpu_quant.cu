// Dequantize-and-multiply for every GGUF layout of execute/quant.py: Y[t][r] = sum_c W[r][c] * X[t][c].
//
// W: rows of raw GGUF blocks (rb bytes per row, any alignment: 32-bit words are read at the aligned
// address below and funnel-shifted, f16 and scale fields by bytes); X: float32 (n, cols).
//
// Quantized types. A lane decodes 32 consecutive weights of a row at a time (dec32: one "chunk",
// the 32 weights of an activation block) into 8 words of 4 int8 values q and, per 16 weights, a
// scale a and an offset b: w = a q + b. Every layout fits: K- and legacy types give their
// quants (unsigned, the offset -8 d / -16 d / -32 a / -4 a / -dmin m through b), the i-quants their
// signed grid bytes (IQ2/IQ3: grid byte with its sign; IQ1: 8 g +- 1 from two 8x tables, a = dl / 8),
// IQ4_NL / IQ4_XS / MXFP4 their levels through a 16-entry byte table (__byte_perm).
// Inputs are staged per thread block in shared memory as two int8 levels per 32 values (as the CPU
// pool): d = max|x| / 127, q1 = round(x / d), q2 = round((x - d q1) 256 / d), so x = d / 256 (256 q1
// + q2) within d / 512; the float sum of the staged values per 16 serves the offsets. A chunk's dot
// is then 4 x 2 dp4a per level and token, exact in int32, scaled once per 16 weights (pass). Up to 8 tokens
// share each decoded chunk; a warp decodes up to 4 rows (2 rows of gate and up) per chunk, issuing
// their loads together.
// The one-token down projection (qmoe1_down_combine: each warp its own input row) multiplies the
// decoded quants with float32 inputs instead (dot_f), as exact as float32 allows.
// Float types (F32, F16, BF16) keep the weight-by-weight path (qw, qmatmul_f).
// Tables of the i-quants come from execute/iq_grids.py, uploaded once by execute/gpu_quant.py into
// global memory (read through the L1 cache: lanes index them at different rows).
typedef unsigned char uint8_t;
typedef signed char int8_t;
typedef unsigned int uint32_t;
typedef unsigned long long u64;

#ifdef __CUDA_ARCH__
#define QD __device__ __forceinline__
#define LDG(p) __ldg(p)
#define PREFETCH_L2(p) asm volatile("prefetch.global.L2 [%0];" ::"l"(p))
#else  // host builds of the decoders and kernels (development checks without a GPU)
#define QD inline
#define LDG(p) (*(p))
#define PREFETCH_L2(p) ((void)(p))
#endif

__device__ uint32_t g_iq2xxs[256 * 2];  // grid rows of 8 (IQ2) or 4 (IQ3) bytes, as words
__device__ uint32_t g_iq2xs[512 * 2];
__device__ uint32_t g_iq2s[1024 * 2];
__device__ uint32_t g_iq3xxs[256];
__device__ uint32_t g_iq3s[512];
__device__ uint32_t g_iq1p[2048 * 2];  // IQ1 grid g in {-1, 0, 1} as bytes 8 g + 1
__device__ uint32_t g_iq1n[2048 * 2];  // ... and 8 g - 1
__device__ uint8_t g_ksigns[128];
__constant__ uint32_t g_iq4nl[4];  // the 16 IQ4 levels as int8 bytes
__constant__ int g_block[64][2];   // (weights, bytes) of a block of type qt

#ifndef __CUDA_ARCH__
#define g_iq2xxs h_iq2xxs
#define g_iq2xs h_iq2xs
#define g_iq2s h_iq2s
#define g_iq3xxs h_iq3xxs
#define g_iq3s h_iq3s
#define g_iq1p h_iq1p
#define g_iq1n h_iq1n
#define g_ksigns h_ksigns
#define g_iq4nl h_iq4nl
extern uint32_t h_iq2xxs[], h_iq2xs[], h_iq2s[], h_iq3xxs[], h_iq3s[], h_iq1p[], h_iq1n[], h_iq4nl[];
extern uint8_t h_ksigns[];
#endif

QD float h2f(uint32_t h) {
#ifdef __CUDA_ARCH__
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
#else
    uint32_t s = (h >> 15) << 31, e = (h >> 10) & 31, m = h & 1023, u;
    if (e == 0) {
        float f = (float)m * (1.0f / 16777216.0f);
        return (h >> 15) ? -f : f;
    }
    u = e == 31 ? (s | 0x7f800000u | (m << 13)) : (s | ((e + 112) << 23) | (m << 13));
    float f;
    __builtin_memcpy(&f, &u, 4);
    return f;
#endif
}
QD uint32_t fshr(uint32_t lo, uint32_t hi, uint32_t s) {  // bits s .. s + 31 of hi:lo, s < 32
#ifdef __CUDA_ARCH__
    return __funnelshift_r(lo, hi, s);
#else
    return s ? (lo >> s) | (hi << (32 - s)) : lo;
#endif
}
QD uint32_t perm(uint32_t x, uint32_t y, uint32_t s) {  // __byte_perm, selectors < 8
#ifdef __CUDA_ARCH__
    return __byte_perm(x, y, s);
#else
    u64 v = ((u64)y << 32) | x;
    uint32_t r = 0;
    for (int i = 0; i < 4; i++) r |= (uint32_t)((v >> (8 * ((s >> (4 * i)) & 7))) & 255) << (8 * i);
    return r;
#endif
}
QD int dp4a(uint32_t a, uint32_t b, int c) {
#ifdef __CUDA_ARCH__
    return __dp4a((int)a, (int)b, c);
#else
    for (int i = 0; i < 4; i++) c += (int)(int8_t)(a >> (8 * i)) * (int)(int8_t)(b >> (8 * i));
    return c;
#endif
}
QD float small_f(int i) {  // float(i) for |i| < 2^22 through the bits of 1.5 * 2^23 + i (no conversion)
    uint32_t u = (uint32_t)(i + 0x4b400000);
    float f;
#ifdef __CUDA_ARCH__
    f = __uint_as_float(u);
#else
    __builtin_memcpy(&f, &u, 4);
#endif
    return f - 12582912.0f;
}
QD uint32_t u8(const uint8_t* p) { return *p; }  // weight bytes: plain loads (global or shared memory)
QD uint32_t u16(const uint8_t* p) { return p[0] | (p[1] << 8); }
QD float f16(const uint8_t* p) { return h2f(u16(p)); }
// N words of the 4 N bytes at p (any alignment): N + 1 aligned loads, funnel-shifted
template <int N> QD void ldw(const uint8_t* p, uint32_t* w) {
    u64 a = (u64)p;
    const uint32_t* q = (const uint32_t*)(a & ~3ull);
    uint32_t s = (uint32_t)(a & 3) * 8, v[N + 1];
    for (int i = 0; i < N; i++) v[i] = q[i];
    v[N] = s ? q[N] : 0u;  // only when the bytes reach into that word
    for (int i = 0; i < N; i++) w[i] = fshr(v[i], v[i + 1], s);
}
QD uint32_t ld1(const uint8_t* p) {
    uint32_t w[1];
    ldw<1>(p, w);
    return w[0];
}
QD uint32_t spread4(uint32_t v) { return ((v & 15u) * 0x00204081u) & 0x01010101u; }  // bit i -> byte i
QD uint32_t sign8(uint32_t g, uint32_t bits) {  // bytes g (all nonzero) negated where bits (4) are set
    uint32_t m = spread4(bits) * 255u;
    return (g ^ m) + (m & 0x01010101u);  // ~g + 1 per negated byte: no carry, as g != 0
}
QD uint32_t lut16(uint32_t v, uint32_t t0, uint32_t t1, uint32_t t2, uint32_t t3) {  // bytes v (< 16) -> table bytes
    uint32_t s = v & 0x07070707u;
    s |= s >> 4;
    s = (s & 0xffu) | ((s >> 8) & 0xff00u);
    uint32_t lo = perm(t0, t1, s), hi = perm(t2, t3, s), m = ((v >> 3) & 0x01010101u) * 255u;
    return (lo & ~m) | (hi & m);
}

// 32 weights of a block: weight 4 k + i = a * (int8)(q[k] >> 8 i) + b, (a, b) = (a0, b0) for the first 16
struct Dec {
    uint32_t q[8];
    float a0, a1, b0, b1;
};

// block weights and bytes; scales per 16 weights (split); an offset b (min)
__host__ __device__ constexpr int qbw(int qt) { return qt == 2 || qt == 3 || qt == 6 || qt == 7 || qt == 8 || qt == 20 || qt == 39 ? 32 : 256; }
__host__ __device__ constexpr int qbb(int qt) {
    return qt == 2 ? 18 : qt == 3 ? 20 : qt == 6 ? 22 : qt == 7 ? 24 : qt == 8 ? 34 : qt == 10 ? 84 : qt == 11 ? 110 :
           qt == 12 ? 144 : qt == 13 ? 176 : qt == 14 ? 210 : qt == 16 ? 66 : qt == 17 ? 74 : qt == 18 ? 98 :
           qt == 19 ? 50 : qt == 20 ? 18 : qt == 21 ? 110 : qt == 22 ? 82 : qt == 23 ? 136 : qt == 29 ? 56 : 17;
}
__host__ __device__ constexpr bool qsplit(int qt) { return qt == 10 || qt == 11 || qt == 14 || qt == 17 || qt == 22 || qt == 29; }
__host__ __device__ constexpr bool qmin(int qt) { return (qt >= 2 && qt <= 7) || (qt >= 10 && qt <= 14); }

QD void nib8(const uint32_t* w, int sh, uint32_t* q) {  // 8 words of 4-bit values at bit sh of w
    for (int k = 0; k < 8; k++) q[k] = (w[k] >> sh) & 0x0f0f0f0fu;
}
QD void nib16(const uint32_t* w, uint32_t* q) {  // 16 bytes -> low nibbles (weights 0-15), high (16-31)
    for (int k = 0; k < 4; k++) {
        q[k] = w[k] & 0x0f0f0f0fu;
        q[k + 4] = (w[k] >> 4) & 0x0f0f0f0fu;
    }
}
QD void k_scale_min(const uint8_t* sc, int s, float& d, float& m) {  // Q4_K / Q5_K 6-bit scale, min of sub-block s
    if (s < 4) { d = (float)(u8(sc + s) & 63); m = (float)(u8(sc + s + 4) & 63); }
    else { d = (float)((u8(sc + s + 4) & 15) | ((u8(sc + s - 4) >> 6) << 4)); m = (float)((u8(sc + s + 4) >> 4) | ((u8(sc + s) >> 6) << 4)); }
}

// chunk j (32 weights from weight 32 j) of the block at b
template <int QT> QD void dec32(const uint8_t* b, int j, Dec& r) {
    uint32_t w[8], h[8];
    if (QT == 2 || QT == 3 || QT == 20 || QT == 39) {  // Q4_0, Q4_1, IQ4_NL, MXFP4: 16 bytes of nibbles
        int o = QT == 2 || QT == 20 ? 2 : QT == 3 ? 4 : 1;
        ldw<4>(b + o, w);
        nib16(w, r.q);
        float d = QT == 39 ? ldexpf(1.0f, (int)u8(b) - 128) : f16(b);
        r.a0 = r.a1 = d;
        r.b0 = r.b1 = QT == 2 ? -8.0f * d : QT == 3 ? f16(b + 2) : 0.0f;
        if (QT == 20) for (int k = 0; k < 8; k++) r.q[k] = lut16(r.q[k], g_iq4nl[0], g_iq4nl[1], g_iq4nl[2], g_iq4nl[3]);
        if (QT == 39) for (int k = 0; k < 8; k++) r.q[k] = lut16(r.q[k], 0x03020100u, 0x0c080604u, 0xfdfeff00u, 0xf4f8fafcu);
    } else if (QT == 6 || QT == 7) {  // Q5_0, Q5_1: fifth bits in a word
        int o = QT == 6 ? 2 : 4;
        uint32_t qh = ld1(b + o);
        ldw<4>(b + o + 4, w);
        nib16(w, r.q);
        for (int k = 0; k < 4; k++) {
            r.q[k] |= spread4(qh >> (4 * k)) << 4;
            r.q[k + 4] |= spread4(qh >> (16 + 4 * k)) << 4;
        }
        float d = f16(b);
        r.a0 = r.a1 = d;
        r.b0 = r.b1 = QT == 6 ? -16.0f * d : f16(b + 2);
    } else if (QT == 8) {  // Q8_0
        ldw<8>(b + 2, r.q);
        r.a0 = r.a1 = f16(b);
        r.b0 = r.b1 = 0.0f;
    } else if (QT == 10) {  // Q2_K: 2-bit q, 4-bit scale and min per 16
        ldw<8>(b + 16 + 32 * (j / 4), w);
        for (int k = 0; k < 8; k++) r.q[k] = (w[k] >> (2 * (j % 4))) & 0x03030303u;
        float d = f16(b + 80), dm = f16(b + 82);
        uint32_t s0 = u8(b + 2 * j), s1 = u8(b + 2 * j + 1);
        r.a0 = d * (float)(s0 & 15); r.b0 = -dm * (float)(s0 >> 4);
        r.a1 = d * (float)(s1 & 15); r.b1 = -dm * (float)(s1 >> 4);
    } else if (QT == 11) {  // Q3_K: 2 low bits + high bit mask (q - 4 when clear), 6-bit signed scales per 16
        ldw<8>(b + 32 + 32 * (j / 4), w);
        ldw<8>(b, h);
        for (int k = 0; k < 8; k++) r.q[k] = ((w[k] >> (2 * (j % 4))) & 0x03030303u) | (((h[k] >> j) & 0x01010101u) << 2);
        float d = f16(b + 108);
        int k0 = 2 * j, k1 = 2 * j + 1;
        int s0 = (int)(((u8(b + 96 + k0 % 8) >> (4 * (k0 / 8))) & 15) | (((u8(b + 104 + k0 % 4) >> (2 * (k0 / 4))) & 3) << 4)) - 32;
        int s1 = (int)(((u8(b + 96 + k1 % 8) >> (4 * (k1 / 8))) & 15) | (((u8(b + 104 + k1 % 4) >> (2 * (k1 / 4))) & 3) << 4)) - 32;
        r.a0 = d * (float)s0; r.b0 = -4.0f * r.a0;
        r.a1 = d * (float)s1; r.b1 = -4.0f * r.a1;
    } else if (QT == 12 || QT == 13) {  // Q4_K, Q5_K: 6-bit scale and min per 32
        ldw<8>(b + (QT == 12 ? 16 : 48) + 32 * (j / 2), w);
        nib8(w, 4 * (j % 2), r.q);
        if (QT == 13) {
            ldw<8>(b + 16, h);
            for (int k = 0; k < 8; k++) r.q[k] |= ((h[k] >> j) & 0x01010101u) << 4;
        }
        float sc, m;
        k_scale_min(b + 4, j, sc, m);
        r.a0 = r.a1 = f16(b) * sc;
        r.b0 = r.b1 = -f16(b + 2) * m;
    } else if (QT == 14) {  // Q6_K: 4 low bits + 2 high bits, q - 32, int8 scales per 16
        int hh = j / 4, g = j % 4;
        ldw<8>(b + 64 * hh + 32 * (g % 2), w);
        ldw<8>(b + 128 + 32 * hh, h);
        for (int k = 0; k < 8; k++) r.q[k] = ((w[k] >> (4 * (g / 2))) & 0x0f0f0f0fu) | (((h[k] >> (2 * g)) & 0x03030303u) << 4);
        float d = f16(b + 208);
        r.a0 = d * (float)(int8_t)u8(b + 192 + 2 * j); r.b0 = -32.0f * r.a0;
        r.a1 = d * (float)(int8_t)u8(b + 193 + 2 * j); r.b1 = -32.0f * r.a1;
    } else if (QT == 16) {  // IQ2_XXS: 4 grid rows of 8, 7-bit sign indices, 4-bit scale per 32
        ldw<2>(b + 2 + 8 * j, w);
        for (int l = 0; l < 4; l++) {
            uint32_t i = (w[0] >> (8 * l)) & 255, sg = g_ksigns[(w[1] >> (7 * l)) & 127];
            r.q[2 * l] = sign8(LDG(g_iq2xxs + 2 * i), sg);
            r.q[2 * l + 1] = sign8(LDG(g_iq2xxs + 2 * i + 1), sg >> 4);
        }
        r.a0 = r.a1 = f16(b) * (0.5f + (float)(w[1] >> 28)) * 0.25f;
        r.b0 = r.b1 = 0.0f;
    } else if (QT == 17) {  // IQ2_XS: 9-bit grid index + 7-bit sign index per 8, 4-bit scales per 16
        ldw<2>(b + 2 + 8 * j, w);
        for (int l = 0; l < 4; l++) {
            uint32_t v = (w[l / 2] >> (16 * (l % 2))) & 0xffff, sg = g_ksigns[v >> 9];
            r.q[2 * l] = sign8(LDG(g_iq2xs + 2 * (v & 511)), sg);
            r.q[2 * l + 1] = sign8(LDG(g_iq2xs + 2 * (v & 511) + 1), sg >> 4);
        }
        uint32_t s = u8(b + 66 + j);
        float d = f16(b) * 0.25f;
        r.a0 = d * (0.5f + (float)(s & 15)); r.a1 = d * (0.5f + (float)(s >> 4));
        r.b0 = r.b1 = 0.0f;
    } else if (QT == 22) {  // IQ2_S: 10-bit grid index, explicit sign bytes, 4-bit scales per 16
        uint32_t idx = ld1(b + 2 + 4 * j), sg = ld1(b + 34 + 4 * j), qh = u8(b + 66 + j), s = u8(b + 74 + j);
        for (int l = 0; l < 4; l++) {
            uint32_t i = ((idx >> (8 * l)) & 255) | (((qh >> (2 * l)) & 3) << 8), sl = sg >> (8 * l);
            r.q[2 * l] = sign8(LDG(g_iq2s + 2 * i), sl);
            r.q[2 * l + 1] = sign8(LDG(g_iq2s + 2 * i + 1), sl >> 4);
        }
        float d = f16(b) * 0.25f;
        r.a0 = d * (0.5f + (float)(s & 15)); r.a1 = d * (0.5f + (float)(s >> 4));
        r.b0 = r.b1 = 0.0f;
    } else if (QT == 18) {  // IQ3_XXS: 8 grid rows of 4, 7-bit sign indices, 4-bit scale per 32
        ldw<2>(b + 2 + 8 * j, w);
        uint32_t s = ld1(b + 66 + 4 * j);
        for (int l = 0; l < 4; l++) {
            uint32_t sg = g_ksigns[(s >> (7 * l)) & 127];
            r.q[2 * l] = sign8(LDG(g_iq3xxs + ((w[l / 2] >> (16 * (l % 2))) & 255)), sg);
            r.q[2 * l + 1] = sign8(LDG(g_iq3xxs + ((w[l / 2] >> (16 * (l % 2) + 8)) & 255)), sg >> 4);
        }
        r.a0 = r.a1 = f16(b) * (0.5f + (float)(s >> 28)) * 0.5f;
        r.b0 = r.b1 = 0.0f;
    } else if (QT == 21) {  // IQ3_S: 9-bit grid index, explicit sign bytes, odd 4-bit scale per 32
        ldw<2>(b + 2 + 8 * j, w);
        uint32_t qh = u8(b + 66 + j), sg = ld1(b + 74 + 4 * j);
        for (int m = 0; m < 8; m++) {
            uint32_t i = ((w[m / 4] >> (8 * (m % 4))) & 255) | (((qh >> m) & 1) << 8);
            r.q[m] = sign8(LDG(g_iq3s + i), sg >> (4 * m));
        }
        r.a0 = r.a1 = f16(b) * (float)(1 + 2 * ((u8(b + 106 + j / 2) >> (4 * (j % 2))) & 15));
        r.b0 = r.b1 = 0.0f;
    } else if (QT == 19) {  // IQ1_S: 11-bit grid index per 8, scale and delta sign per 32
        uint32_t idx = ld1(b + 2 + 4 * j), qh = u16(b + 34 + 2 * j);
        const uint32_t* t = (qh & 0x8000) ? g_iq1n : g_iq1p;
        for (int l = 0; l < 4; l++) {
            uint32_t i = ((idx >> (8 * l)) & 255) | (((qh >> (3 * l)) & 7) << 8);
            r.q[2 * l] = LDG(t + 2 * i);
            r.q[2 * l + 1] = LDG(t + 2 * i + 1);
        }
        r.a0 = r.a1 = f16(b) * (float)(2 * ((qh >> 12) & 7) + 1) * 0.125f;
        r.b0 = r.b1 = 0.0f;
    } else if (QT == 29) {  // IQ1_M: 11-bit grid index and delta sign per 8, 3-bit scales per 16, d in the scales' top nibbles
        uint32_t idx = ld1(b + 4 * j), qh = u16(b + 32 + 2 * j), sc = u16(b + 48 + 2 * (j / 2));
        for (int l = 0; l < 4; l++) {
            uint32_t nib = (qh >> (4 * l)) & 15, i = ((idx >> (8 * l)) & 255) | ((nib & 7) << 8);
            const uint32_t* t = (nib & 8) ? g_iq1n : g_iq1p;
            r.q[2 * l] = LDG(t + 2 * i);
            r.q[2 * l + 1] = LDG(t + 2 * i + 1);
        }
        uint32_t dh = (u16(b + 48) >> 12) | ((u16(b + 50) >> 12) << 4) | ((u16(b + 52) >> 12) << 8) | ((u16(b + 54) >> 12) << 12);
        float d = h2f(dh) * 0.125f;
        int g0 = 2 * (j % 2);
        r.a0 = d * (float)(2 * ((sc >> (3 * g0)) & 7) + 1);
        r.a1 = d * (float)(2 * ((sc >> (3 * g0 + 3)) & 7) + 1);
        r.b0 = r.b1 = 0.0f;
    } else if (QT == 23) {  // IQ4_XS: 6-bit scale per 32, IQ4 levels
        ldw<4>(b + 8 + 16 * j, w);
        nib16(w, r.q);
        for (int k = 0; k < 8; k++) r.q[k] = lut16(r.q[k], g_iq4nl[0], g_iq4nl[1], g_iq4nl[2], g_iq4nl[3]);
        int ls = (int)(((u8(b + 4 + j / 2) >> (4 * (j % 2))) & 15) | (((u16(b + 2) >> (2 * j)) & 3) << 4));
        r.a0 = r.a1 = f16(b) * (float)(ls - 32);
        r.b0 = r.b1 = 0.0f;
    }
}

// the chunk's dot with staged token inputs: x1, x2 its 8 + 8 words, dxs = d / 256, s16 the 2 sums
template <int QT> QD float dot_staged(const Dec& d, const uint32_t* x1, const uint32_t* x2, float dxs, const float* s16) {
    float v;
    if (qsplit(QT)) {
        int a = 0, b = 0, c = 0, e = 0;
        for (int k = 0; k < 4; k++) { a = dp4a(d.q[k], x1[k], a); b = dp4a(d.q[k], x2[k], b); }
        for (int k = 4; k < 8; k++) { c = dp4a(d.q[k], x1[k], c); e = dp4a(d.q[k], x2[k], e); }
        v = dxs * (d.a0 * fmaf(small_f(a), 256.f, small_f(b)) + d.a1 * fmaf(small_f(c), 256.f, small_f(e)));
    } else {  // level sums |a|, |b| <= 32 * 128 * 127 < 2^22
        int a = 0, b = 0;
        for (int k = 0; k < 8; k++) { a = dp4a(d.q[k], x1[k], a); b = dp4a(d.q[k], x2[k], b); }
        v = dxs * d.a0 * fmaf(small_f(a), 256.f, small_f(b));
    }
    if (qmin(QT)) v += d.b0 * s16[0] + d.b1 * s16[1];
    return v;
}

// the chunk's dot with 32 float32 inputs at x (16-byte aligned)
template <int QT> QD float dot_f(const Dec& d, const float* x) {
    float lo = 0.f, hi = 0.f, sl = 0.f, sh = 0.f;
    #pragma unroll
    for (int k = 0; k < 8; k++) {
        uint32_t u = d.q[k] ^ 0x80808080u;  // q + 128 as unsigned bytes
#ifdef __CUDA_ARCH__
        float4 x4 = __ldg(reinterpret_cast<const float4*>(x) + k);
        float xs[4] = {x4.x, x4.y, x4.z, x4.w};
#else
        const float* xs = x + 4 * k;
#endif
        #pragma unroll
        for (int i = 0; i < 4; i++) {
            float xv = xs[i];
            uint32_t bits = perm(u, 0x4b000000u, 0x7540u + i);  // 2^23 + q + 128 as a float
            float q;
#ifdef __CUDA_ARCH__
            q = __int_as_float((int)bits) - 8388736.0f;
#else
            __builtin_memcpy(&q, &bits, 4);
            q -= 8388736.0f;
#endif
            if (k < 4) { lo += q * xv; sl += xv; } else { hi += q * xv; sh += xv; }
        }
    }
    float v = d.a0 * lo + d.a1 * hi;
    if (qmin(QT)) v += d.b0 * sl + d.b1 * sh;
    return v;
}

#define DISPATCH(qt, F, ...)                                                                               \
    switch (qt) {                                                                                          \
    case 2: F<2>(__VA_ARGS__); break; case 3: F<3>(__VA_ARGS__); break; case 6: F<6>(__VA_ARGS__); break;  \
    case 7: F<7>(__VA_ARGS__); break; case 8: F<8>(__VA_ARGS__); break; case 10: F<10>(__VA_ARGS__); break; \
    case 11: F<11>(__VA_ARGS__); break; case 12: F<12>(__VA_ARGS__); break; case 13: F<13>(__VA_ARGS__); break; \
    case 14: F<14>(__VA_ARGS__); break; case 16: F<16>(__VA_ARGS__); break; case 17: F<17>(__VA_ARGS__); break; \
    case 18: F<18>(__VA_ARGS__); break; case 19: F<19>(__VA_ARGS__); break; case 20: F<20>(__VA_ARGS__); break; \
    case 21: F<21>(__VA_ARGS__); break; case 22: F<22>(__VA_ARGS__); break; case 23: F<23>(__VA_ARGS__); break; \
    case 29: F<29>(__VA_ARGS__); break; case 39: F<39>(__VA_ARGS__); break;                                \
    }

#define DISPATCH_R(r, qt, F, ...)                                                                                 \
    switch (qt) {                                                                                                 \
    case 2: r = F<2>(__VA_ARGS__); break; case 3: r = F<3>(__VA_ARGS__); break; case 6: r = F<6>(__VA_ARGS__); break; \
    case 7: r = F<7>(__VA_ARGS__); break; case 8: r = F<8>(__VA_ARGS__); break; case 10: r = F<10>(__VA_ARGS__); break; \
    case 11: r = F<11>(__VA_ARGS__); break; case 12: r = F<12>(__VA_ARGS__); break; case 13: r = F<13>(__VA_ARGS__); break; \
    case 14: r = F<14>(__VA_ARGS__); break; case 16: r = F<16>(__VA_ARGS__); break; case 17: r = F<17>(__VA_ARGS__); break; \
    case 18: r = F<18>(__VA_ARGS__); break; case 19: r = F<19>(__VA_ARGS__); break; case 20: r = F<20>(__VA_ARGS__); break; \
    case 21: r = F<21>(__VA_ARGS__); break; case 22: r = F<22>(__VA_ARGS__); break; case 23: r = F<23>(__VA_ARGS__); break; \
    case 29: r = F<29>(__VA_ARGS__); break; case 39: r = F<39>(__VA_ARGS__); break;                                  \
    }

#ifdef GQ_ONLY  // (-D: a module reading one quantized type alone: the dispatch's cost measured apart)
#undef DISPATCH
#undef DISPATCH_R
#define DISPATCH(qt, F, ...) if ((qt) == GQ_ONLY) F<GQ_ONLY>(__VA_ARGS__);
#define DISPATCH_R(r, qt, F, ...) if ((qt) == GQ_ONLY) r = F<GQ_ONLY>(__VA_ARGS__);
#endif

#ifndef MOELAB_HOST_CHECK  // the kernels (the host check builds the decoders alone)
// ---------------------------------------------------------------------------------------------
// Staged inputs: up to NT tokens x KT = 8192 / NT columns of a block's shared buffer (XS_WORDS
// uint4): q1 bytes [t][c], q2 bytes [t][c], dxs [t][c / 32], s16 [t][c / 16]. NT is 1 (one-token
// kernels: fewer registers, more blocks in flight) or TB (batches).
#define TB 8
#define XS_WORDS (8192 * 19 / 8 / 16)
#define WARPS 4
#define MAXK 32

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
        float v[4] = {0.f, 0.f, 0.f, 0.f};
        if (on) {
            const float* p = x + (long long)tok[t] * ldx + k0 + 32 * c + 4 * l8;
            for (int i = 0; i < 4; i++) v[i] = p[i];
        }
        float m = fmaxf(fmaxf(fabsf(v[0]), fabsf(v[1])), fmaxf(fabsf(v[2]), fabsf(v[3])));
        for (int o = 1; o < 8; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        float d = m / 127.f, inv = m > 0.f ? 127.f / m : 0.f, s = 0.f;
        uint32_t w1 = 0, w2 = 0;
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
        if (on) {
            int wi = (t * KT + 32 * c) / 4 + l8;
            q1[wi] = w1;
            q2[wi] = w2;
            if (l8 == 0) dxs[t * (KT / 32) + c] = d * (1.f / 256.f);
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
// One-token kernels (qmatmul_q1, qmoe1_gate_up, qmoe1_down_combine). Weight rows are copied to
// shared memory first, in the 16-byte words that cover them (cp.async: every copy of a tile issued
// at once, 16 bytes per lane, coalesced, any row alignment), then decoded there by dec32; the
// inputs are staged meanwhile. Gate/up and matmul: a warp owns 2 rows (of each matrix), a
// block of 4 warps stages one input tile of X1_COLS columns for them all (stage), the lanes split
// the tile's 32-weight chunks and dot them with dp4a (dot_staged), one shuffle reduction per row
// at the end. Tiles shrink below X1_COLS when a warp's rows would not fit its W1_BYTES / 4.
#define W1_BYTES 28672
#define X1_COLS 2048
#define X1_WORDS (X1_COLS * 19 / 8 / 16)
#define D1_BYTES 16384  // the one-token down projection's weight tiles, split between its warps

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

// down rows of one expert (per warp): acc0/acc1 += rows 0/1 (shared memory s0, s1) . h (float32), tasks (row, chunk) by lane
template <int QT> __device__ __noinline__ float2 down1_tile(const uint8_t* s0, const uint8_t* s1, int nm, const float* hx, int nch) {
    constexpr int SUB = qbw(QT) / 32, BB = qbb(QT);
    float2 acc = {0.f, 0.f};
    for (int t = threadIdx.x & 31; t < nm * nch; t += 32) {
        int m = t >= nch, c = t - m * nch;
        Dec d;
        dec32<QT>((m ? s1 : s0) + (c / SUB) * BB, c % SUB, d);
        float v = dot_f<QT>(d, hx + 32 * c);
        if (m) acc.y += v; else acc.x += v;
    }
    return acc;
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

// ---------------------------------------------------------------------------------------------
// Batched expert kernels (qmoe_gate_up, qmoe_down) on tensor cores. The weights of a K tile of
// KB columns are decoded once per pass of up to NB tokens into shared memory as exact f16 quants
// (pairs in k order) beside their scales and offsets per 16 (a0, a1, b0, b1); the tokens' inputs
// are staged as two f16 halves, hi = f16(x s) and lo = f16(x s - hi), s = 2^-e per 32 values (|x s|
// < 1, so lo keeps x to ~22 bits), beside 1 / s and the sums of x per 16. mma.m16n8k16 (f32
// accumulation) multiplies 16 rows by 8 tokens per 16 weights, hi and lo into one accumulator, and
// each 32-weight chunk's two sums are scaled once: acc += (a0 C0 + a1 C1) / s + b0 S0 + b1 S1. A
// block covers 16 MT rows (gate_up: 8 MT rows of gate and the same of up, an m-tile = 8 of each,
// so a lane holds a row's gate and up sums together); the grid's other blocks return. Warp w
// computes n-tiles w, w + 4, .. (8 tokens each) of every m-tile. qmoe_gate_up / qmoe_down take
// (MT, NB) = (QMOE_MT, QMOE_NB); the _m<MT>n<NB> variants the others (same arguments; measured side
// by side by experiments/gpu_quant_check.py).
#define KB 128
#define XROW (KB + 4)  // words per staged token: KB / 2 hi and lo pair words per 32, padded (banks)
#ifndef QMOE_MT  // (-D: host checks of the other tilings)
#define QMOE_MT 2
#define QMOE_NB 64
#endif

#ifdef __CUDA_ARCH__
__device__ __forceinline__ void mma16816(float* c, const uint32_t* a, const uint32_t* b) {  // c += A (16 x 16 f16) B (16 x 8 f16)
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
__device__ __forceinline__ uint32_t f2h2(float lo, float hi) {  // f16 pair (lo in the low half), round to nearest
    uint32_t r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}
__device__ __forceinline__ uint32_t q2h2(uint32_t w, int i) {  // int8 bytes 2 i, 2 i + 1 of w as an f16 pair (exact)
    uint32_t u = __byte_perm(w ^ 0x80808080u, 0x64646464u, i ? 0x4342u : 0x4140u), r;  // 1024 + q + 128
    asm("sub.f16x2 %0, %1, %2;" : "=r"(r) : "r"(u), "r"(0x64806480u));
    return r;
}
#else
void mma16816(float* c, const uint32_t* a, const uint32_t* b);  // the host emulation's (tests)
uint32_t f2h(float f);
inline uint32_t f2h2(float lo, float hi) { return f2h(lo) | (f2h(hi) << 16); }
inline uint32_t q2h2(uint32_t w, int i) {
    return f2h((float)(int8_t)(w >> (16 * i))) | (f2h((float)(int8_t)(w >> (16 * i + 8))) << 16);
}
#endif
__device__ __forceinline__ float h2lo(uint32_t p) { return h2f(p & 0xffffu); }
__device__ __forceinline__ float h2hi(uint32_t p) { return h2f(p >> 16); }

// decodes chunk c of row m (pointer p, type qt) into the A tile record (16 pair words, a0 a1 b0 b1)
template <int QT> __device__ __noinline__ void dec_rec(const uint8_t* row, int c, uint32_t* rec) {
    constexpr int SUB = qbw(QT) / 32, BB = qbb(QT);
    Dec d;
    dec32<QT>(row + (long long)(c / SUB) * BB, c % SUB, d);
    #pragma unroll
    for (int k = 0; k < 8; k++) {
        rec[2 * k] = q2h2(d.q[k], 0);
        rec[2 * k + 1] = q2h2(d.q[k], 1);
    }
    float* f = reinterpret_cast<float*>(rec + 16);
    f[0] = d.a0; f[1] = d.a1;
    f[2] = qmin(QT) ? d.b0 : 0.f; f[3] = qmin(QT) ? d.b1 : 0.f;
}

// stages the inputs of tokens t < nt (rows xr[t] of x, ldx apart; columns k0 .. k0 + n) for the mma:
// 8 lanes per 32 values, every load of the thread issued before the first use
template <int NB> __device__ __forceinline__ void stage_h(uint32_t* xs, float* dsc, float* s16, const float* __restrict__ x,
                                                         long long ldx, const int* xr, int nt, int k0, int n) {
    constexpr int IT = NB * (KB / 32) / (4 * WARPS);  // chunks per warp, 4 at a time
    int lane = threadIdx.x & 31, l8 = lane & 7;
    float v[IT][4];
    #pragma unroll
    for (int it = 0; it < IT; it++) {
        int ch = (it * WARPS + (threadIdx.x >> 5)) * 4 + (lane >> 3), t = ch / (KB / 32), c = ch % (KB / 32);
        for (int i = 0; i < 4; i++) v[it][i] = 0.f;
        if (t < nt && 32 * c < n) {
            float4 f = *reinterpret_cast<const float4*>(x + (long long)xr[t] * ldx + k0 + 32 * c + 4 * l8);
            v[it][0] = f.x; v[it][1] = f.y; v[it][2] = f.z; v[it][3] = f.w;
        }
    }
    #pragma unroll
    for (int it = 0; it < IT; it++) {
        int ch = (it * WARPS + (threadIdx.x >> 5)) * 4 + (lane >> 3), t = ch / (KB / 32), c = ch % (KB / 32);
        float m = fmaxf(fmaxf(fabsf(v[it][0]), fabsf(v[it][1])), fmaxf(fabsf(v[it][2]), fabsf(v[it][3])));
        for (int o = 1; o < 8; o <<= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
        // s = 2^-e with m s in [0.5, 1) (m < 2^-120 or inf/nan: s = 1)
        int e = (int)((__float_as_int(m) >> 23) & 255) - 126;
        if (e < -120 || e > 120) e = 0;
        float s = __int_as_float((127 - e) << 23), hi[4], lo[4];
        for (int i = 0; i < 4; i++) {
            hi[i] = h2lo(f2h2(v[it][i] * s, 0.f));
            lo[i] = v[it][i] * s - hi[i];
        }
        float sum = (v[it][0] + v[it][1]) + (v[it][2] + v[it][3]);
        for (int o = 1; o < 4; o <<= 1) sum += __shfl_xor_sync(0xffffffffu, sum, o);
        uint32_t* w = xs + t * XROW + 32 * c;  // lane l8 holds k pairs 2 l8, 2 l8 + 1 of the chunk
        w[2 * l8] = f2h2(hi[0], hi[1]);
        w[2 * l8 + 1] = f2h2(hi[2], hi[3]);
        w[16 + 2 * l8] = f2h2(lo[0], lo[1]);
        w[16 + 2 * l8 + 1] = f2h2(lo[2], lo[3]);
        if (l8 == 0) dsc[t * (KB / 32) + c] = __int_as_float((127 + e) << 23);
        if ((l8 & 3) == 0) s16[t * (KB / 16) + 2 * c + (l8 >> 2)] = sum;
    }
}

// Rows of a block: gate_up (two matrices): row m < 16 MT = m-tile m / 16, within it m % 16 < 8 the
// gate row r0 + 8 (m / 16) + m % 16, else the up row r0 + 8 (m / 16) + m % 16 - 8; down: row r0 + m.
struct Rows {
    const uint8_t* p[2];  // first row of the block in each matrix
    long long rb[2];
    int qt[2], two, nrows;  // rows of each matrix in the block (<= 8 MT with two, else <= 16 MT)
};

// acc[j][mt][i]: n-tile w + 4 j of every m-tile, for the pass's nt tokens (xr: their input rows); K = cols
template <int MT, int NB>
__device__ void mma_pass(const Rows& R, int cols, const float* __restrict__ x, long long ldx, const int* xr, int nt,
                         uint32_t* As, uint32_t* xs, float* dsc, float* s16, float (*acc)[MT][4]) {
    constexpr int MB = 16 * MT, NJ = NB / (8 * WARPS);
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, q = lane & 3;
    for (int mat = 0; mat <= R.two; mat++) {  // the block's rows towards L2: the tiles' decodes then read L2
        long long nbytes = R.nrows * R.rb[mat];
        for (long long o = 128 * threadIdx.x; o < nbytes; o += 128 * blockDim.x) PREFETCH_L2(R.p[mat] + o);
    }
    for (int j = 0; j < NJ; j++)
        for (int mt = 0; mt < MT; mt++)
            for (int i = 0; i < 4; i++) acc[j][mt][i] = 0.f;
    for (int k0 = 0; k0 < cols; k0 += KB) {
        int n = min(KB, cols - k0);
        __syncthreads();  // the previous tile is consumed
        for (int task = threadIdx.x; task < MB * (KB / 32); task += blockDim.x) {
            int m = task / (KB / 32), c = task % (KB / 32), mat = 0, r = m;  // a row's chunks on adjacent lanes
            if (R.two) { mat = (m & 15) >= 8; r = 8 * (m >> 4) + (m & 7); }
            uint32_t* rec = As + (c * MB + m) * 20;
            if (r < R.nrows && 32 * c < n) {
                const uint8_t* row = R.p[mat] + r * R.rb[mat];
                int cc = k0 / 32 + c;
                DISPATCH(R.qt[mat], dec_rec, row, cc, rec)
            } else {
                for (int i = 0; i < 20; i++) rec[i] = 0u;
            }
        }
        stage_h<NB>(xs, dsc, s16, x, ldx, xr, nt, k0, n);
        __syncthreads();
        #pragma unroll
        for (int j = 0; j < NJ; j++) {
            int t0 = 8 * (warp + WARPS * j);
            if (t0 >= nt) continue;
            for (int c = 0; c < n / 32; c++) {
                uint32_t bh[2][2], bl[2][2];
                const uint32_t* xw = xs + (t0 + g) * XROW + 32 * c + q;
                for (int h = 0; h < 2; h++) {
                    bh[h][0] = xw[8 * h]; bh[h][1] = xw[8 * h + 4];
                    bl[h][0] = xw[16 + 8 * h]; bl[h][1] = xw[16 + 8 * h + 4];
                }
                int tn = t0 + 2 * q;  // this lane's two tokens (columns of C)
                float d0 = dsc[tn * (KB / 32) + c], d1 = dsc[(tn + 1) * (KB / 32) + c];
                float2 s0 = reinterpret_cast<const float2*>(s16)[tn * (KB / 32) + c];
                float2 s1 = reinterpret_cast<const float2*>(s16)[(tn + 1) * (KB / 32) + c];
                #pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    const uint32_t* ra = As + (c * MB + 16 * mt + g) * 20;  // row g; row g + 8 at + 160
                    float c0[4] = {0.f, 0.f, 0.f, 0.f}, c1[4] = {0.f, 0.f, 0.f, 0.f};
                    uint32_t a[4];
                    a[0] = ra[q]; a[1] = ra[160 + q]; a[2] = ra[q + 4]; a[3] = ra[164 + q];
                    mma16816(c0, a, bh[0]);
                    mma16816(c0, a, bl[0]);
                    a[0] = ra[q + 8]; a[1] = ra[168 + q]; a[2] = ra[q + 12]; a[3] = ra[172 + q];
                    mma16816(c1, a, bh[1]);
                    mma16816(c1, a, bl[1]);
                    float4 sa = reinterpret_cast<const float4*>(ra + 16)[0], sb = reinterpret_cast<const float4*>(ra + 176)[0];
                    float* ac = acc[j][mt];
                    ac[0] += d0 * (sa.x * c0[0] + sa.y * c1[0]) + sa.z * s0.x + sa.w * s0.y;
                    ac[1] += d1 * (sa.x * c0[1] + sa.y * c1[1]) + sa.z * s1.x + sa.w * s1.y;
                    ac[2] += d0 * (sb.x * c0[2] + sb.y * c1[2]) + sb.z * s0.x + sb.w * s0.y;
                    ac[3] += d1 * (sb.x * c0[3] + sb.y * c1[3]) + sb.z * s1.x + sb.w * s1.y;
                }
            }
        }
    }
}

// as moe_gate_up: h[pair, r] = act(gate_e x[xrow[pair]] + bg_e, up_e x[xrow[pair]] + bu_e).
// grid (ceil(ffn / (WARPS * rows_per_warp)), groups), block 32 * WARPS: the block whose rows hold
// row s (s a multiple of 8 MT) computes rows s .. s + 8 MT - 1 (mma_pass), the others return.
#define GATE_UP_ARGS const unsigned long long* __restrict__ base, const int* __restrict__ gstart, const int* __restrict__ order, \
    const int* __restrict__ xrow, const float* __restrict__ x, long long ldx, float* __restrict__ h, int ffn, int hidden,        \
    int rows_per_warp, long long off_g, int qt_g, long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias
#define DOWN_ARGS const unsigned long long* __restrict__ base, const int* __restrict__ gstart, const int* __restrict__ order, \
    const float* __restrict__ h, float* __restrict__ y, int ffn, int hidden, int rows_per_warp, long long off_d, int qt_d,   \
    long long rb_d, int bias
#define SMEM_MMA(MT, NB)                                        \
    __shared__ __align__(16) uint32_t As[(KB / 32) * 16 * MT * 20]; \
    __shared__ __align__(16) uint32_t xs[NB * XROW];            \
    __shared__ __align__(16) float dsc[NB * KB / 32], s16[NB * KB / 16];

template <int MT, int NB> __device__ void gate_up_mma(GATE_UP_ARGS, uint32_t* As, uint32_t* xs, float* dsc, float* s16) {
    constexpr int RB = 8 * MT, NJ = NB / (8 * WARPS);
    int g = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rl = WARPS * rows_per_warp;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(base[g]);
    for (int s = (blockIdx.x * rl + RB - 1) / RB * RB; s < (blockIdx.x + 1) * rl && s < ffn; s += RB) {
        Rows R = {{e + off_g + s * rb_g, e + off_u + s * rb_u}, {rb_g, rb_u}, {qt_g, qt_u}, 1, min(RB, ffn - s)};
        for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += NB) {
            int nt = min(NB, gstart[g + 1] - p0), xr[NB];
            for (int t = 0; t < NB; t++) xr[t] = xrow[order[p0 + (t < nt ? t : 0)]];
            float acc[NJ][MT][4];
            mma_pass<MT, NB>(R, hidden, x, ldx, xr, nt, As, xs, dsc, s16, acc);
            for (int j = 0; j < NJ; j++) {
                int tn = 8 * (warp + WARPS * j) + 2 * (lane & 3);
                for (int mt = 0; mt < MT; mt++) {
                    int r = s + 8 * mt + (lane >> 2);
                    if (r >= ffn) continue;
                    float bg = bias ? reinterpret_cast<const float*>(e)[r] : 0.f, bu = bias ? reinterpret_cast<const float*>(e)[ffn + r] : 0.f;
                    for (int i = 0; i < 2; i++)
                        if (tn + i < nt) h[(long long)order[p0 + tn + i] * ffn + r] = q_act(act, acc[j][mt][i] + bg, acc[j][mt][2 + i] + bu);
                }
            }
        }
    }
}

// as moe_down: y[pair, r] = down_e h[pair] + bd_e. grid (ceil(hidden / (WARPS * rows_per_warp)), groups):
// the block whose rows hold row s (a multiple of 16 MT) computes rows s .. s + 16 MT - 1, the others return.
template <int MT, int NB> __device__ void down_mma(DOWN_ARGS, uint32_t* As, uint32_t* xs, float* dsc, float* s16) {
    constexpr int RB = 16 * MT, NJ = NB / (8 * WARPS);
    int g = blockIdx.y, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, rl = WARPS * rows_per_warp;
    const float* bd = reinterpret_cast<const float*>(base[g]) + 2 * ffn;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(base[g]) + off_d;
    for (int s = (blockIdx.x * rl + RB - 1) / RB * RB; s < (blockIdx.x + 1) * rl && s < hidden; s += RB) {
        Rows R = {{e + s * rb_d, e + s * rb_d}, {rb_d, rb_d}, {qt_d, qt_d}, 0, min(RB, hidden - s)};
        for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += NB) {
            int nt = min(NB, gstart[g + 1] - p0), xr[NB];
            for (int t = 0; t < NB; t++) xr[t] = order[p0 + (t < nt ? t : 0)];
            float acc[NJ][MT][4];
            mma_pass<MT, NB>(R, ffn, h, ffn, xr, nt, As, xs, dsc, s16, acc);
            for (int j = 0; j < NJ; j++) {
                int tn = 8 * (warp + WARPS * j) + 2 * (lane & 3);
                for (int mt = 0; mt < MT; mt++)
                    for (int hf = 0; hf < 2; hf++) {
                        int r = s + 16 * mt + (lane >> 2) + 8 * hf;
                        if (r >= hidden) continue;
                        for (int i = 0; i < 2; i++)
                            if (tn + i < nt) y[(long long)xr[tn + i] * hidden + r] = acc[j][mt][2 * hf + i] + (bias ? bd[r] : 0.f);
                    }
            }
        }
    }
}

#define QMOE_MMA(SUFFIX, MT, NB)                                                                                   \
    extern "C" __global__ void __launch_bounds__(128) qmoe_gate_up##SUFFIX(GATE_UP_ARGS) {                         \
        SMEM_MMA(MT, NB)                                                                                           \
        gate_up_mma<MT, NB>(base, gstart, order, xrow, x, ldx, h, ffn, hidden, rows_per_warp, off_g, qt_g, rb_g,   \
                            off_u, qt_u, rb_u, act, bias, As, xs, dsc, s16);                                       \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(128) qmoe_down##SUFFIX(DOWN_ARGS) {                               \
        SMEM_MMA(MT, NB)                                                                                           \
        down_mma<MT, NB>(base, gstart, order, h, y, ffn, hidden, rows_per_warp, off_d, qt_d, rb_d, bias, As, xs, dsc, s16); \
    }
QMOE_MMA(, QMOE_MT, QMOE_NB)
QMOE_MMA(_m1n32, 1, 32)
QMOE_MMA(_m2n32, 2, 32)
QMOE_MMA(_m4n32, 4, 32)

struct Experts1 {  // gpu_kernels.cu's one-token pair table, passed by value
    unsigned long long base[MAXK];
    float weight[MAXK];
    int pick[MAXK];
};

// as moe1_gate_up: h[j, r] = act(gate_j x + bg_j, up_j x + bu_j) for j = pick[blockIdx.y], rows
// blockIdx.x WARPS rows_per_warp .. + WARPS rows_per_warp in groups of 2 WARPS (gemv1).
// grid (ceil(ffn / (WARPS * rows_per_warp)), pairs picked), block 32 * WARPS.
extern "C" __global__ void __launch_bounds__(128, 6) qmoe1_gate_up(const Experts1 ex, const float* __restrict__ x, float* __restrict__ h,
                                         int ffn, int hidden, int rows_per_warp, long long off_g, int qt_g,
                                         long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias) {
    __shared__ __align__(16) uint4 wbuf[W1_BYTES / 16];
    __shared__ __align__(16) uint4 xbuf[X1_WORDS];
    int j = ex.pick[blockIdx.y], warp = threadIdx.x >> 5;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(ex.base[j]);
    int q0 = blockIdx.x * WARPS * rows_per_warp, q1 = min(q0 + WARPS * rows_per_warp, ffn);
    for (int g0 = q0; g0 < q1; g0 += 2 * WARPS) {  // uniform over the block
        float res[4];
        gemv1(e + off_g + g0 * rb_g, rb_g, qt_g, e + off_u + g0 * rb_u, rb_u, qt_u, min(2 * WARPS, q1 - g0), hidden, x,
              wbuf, xbuf, res);
        int r = g0 + 2 * warp;
        if ((threadIdx.x & 31) == 0)
            for (int m = 0; m < 2; m++)
                if (r + m < q1) {
                    float bg = bias ? reinterpret_cast<const float*>(e)[r + m] : 0.f;
                    float bu = bias ? reinterpret_cast<const float*>(e)[ffn + r + m] : 0.f;
                    h[(long long)j * ffn + r + m] = q_act(act, res[m] + bg, res[2 + m] + bu);
                }
    }
}

// as moe1_down_combine: out[r] = sum_j weight[j] * (down_j h[j] + bd_j)[r], j in order. Warp j
// copies its expert's rows, 2 at a time, to its D1_BYTES / k bytes of shared memory (column tiles
// when they do not fit) and dots them with float32 h (dot_f), lanes over (row, chunk) pairs.
// grid ceil(hidden / rows_per_block), block 32 * k; rows_per_block <= 32.
extern "C" __global__ void __launch_bounds__(1024) qmoe1_down_combine(const Experts1 ex, const float* __restrict__ h, float* __restrict__ out,
                                              int k, int ffn, int hidden, int rows_per_block, long long off_d,
                                              int qt_d, long long rb_d, int bias) {
    __shared__ __align__(16) uint4 wbuf[D1_BYTES / 16];
    __shared__ float ys[MAXK][32];
    int j = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * rows_per_block;
    int rows = min(rows_per_block, hidden - r0), budget = (D1_BYTES / k) & ~15;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(ex.base[j]);
    const float* bd = reinterpret_cast<const float*>(e) + 2 * ffn;
    const float* hj = h + (long long)j * ffn;
    uint8_t* my = reinterpret_cast<uint8_t*>(wbuf) + j * budget;
    int bw = g_block[qt_d][0], bb = g_block[qt_d][1];
    int kt = fit_cols(ffn, ffn, bw, qt_d, -1, 2, budget), sl = slot_bytes(qt_d, kt);
    for (int i = 0; i < rows; i += 2) {
        int nm = min(2, rows - i);
        const uint8_t* row = e + off_d + (long long)(r0 + i) * rb_d;
        float a0 = 0.f, a1 = 0.f;
        for (int k0 = 0; k0 < ffn; k0 += kt) {
            int n = min(kt, ffn - k0), nbytes = (n / bw) * bb;
            long long o = (long long)(k0 / bw) * bb;
            __syncwarp();  // the previous tile is consumed
            const uint8_t* s0 = stage_row(my, row + o, nbytes, lane);
            const uint8_t* s1 = nm > 1 ? stage_row(my + sl, row + rb_d + o, nbytes, lane) : s0;
            cp_wait();
            __syncwarp();
            float2 v = {0.f, 0.f};
            DISPATCH_R(v, qt_d, down1_tile, s0, s1, nm, hj + k0, n / 32)
            a0 += v.x;
            a1 += v.y;
        }
        for (int o = 16; o; o >>= 1) {
            a0 += __shfl_xor_sync(0xffffffffu, a0, o);
            a1 += __shfl_xor_sync(0xffffffffu, a1, o);
        }
        if (lane == 0) {
            ys[j][i] = bias ? a0 + bd[r0 + i] : a0;
            if (nm > 1) ys[j][i + 1] = bias ? a1 + bd[r0 + i + 1] : a1;
        }
    }
    __syncthreads();
    int i = threadIdx.x;
    if (i < rows) {
        float s = 0.f;
        for (int jj = 0; jj < k; jj++) s += ex.weight[jj] * ys[jj][i];
        out[r0 + i] = s;
    }
}

// ---------------------------------------------------------------------------------------------
// One-token kernels, direct (the _g variants: same arguments and grids as qmoe1_gate_up /
// qmoe1_down_combine): the lanes decode their chunks straight from global memory (a warp's rows
// first prefetched to L2 while the input is staged), no weight copies in shared memory and no wait
// on them; the type is dispatched once at the kernel's entry to a body compiled for it (no calls
// inside: gate and up of one type; other pairs of types take the per-matrix calls).
__device__ __forceinline__ void prefetch_rows(const uint8_t* p, long long rb, int nm, long long nbytes, int lane) {
    for (int m = 0; m < nm; m++)
        for (long long o = 128 * lane; o < nbytes + 128; o += 32 * 128) PREFETCH_L2(p + m * rb + min(o, nbytes - 1));
}

// acc[m] += row m . staged input over the tile's nch chunks (lanes lane, lane + 32, ..); rows pg,
// pg + rbg (gate), pu, pu + rbu (up); nm rows of each (1 or 2)
template <int QT> __device__ __forceinline__ void rows4_g(const uint8_t* pg, long long rbg, const uint8_t* pu, long long rbu,
                                                          int nm, const uint4* xb, int nch, float* acc) {
    constexpr int SUB = qbw(QT) / 32, BB = qbb(QT);
    const uint4* q1 = xb;
    const uint4* q2 = xb + X1_COLS / 16;
    const float* dxs = reinterpret_cast<const float*>(xb + X1_COLS / 8);
    const float2* s16 = reinterpret_cast<const float2*>(dxs + X1_COLS / 32);
    const uint8_t* p[4] = {pg, pu, pg + rbg, pu + rbu};
    #pragma unroll 1
    for (int c = threadIdx.x & 31; c < nch; c += 32) {
        Dec d[4];
        long long o = (long long)(c / SUB) * BB;
        #pragma unroll
        for (int m = 0; m < 4; m++)
            if (m < 2 || nm > 1) dec32<QT>(p[m] + o, c % SUB, d[m]);
        uint4 a0 = q1[2 * c], a1 = q1[2 * c + 1], b0 = q2[2 * c], b1 = q2[2 * c + 1];
        uint32_t x1[8] = {a0.x, a0.y, a0.z, a0.w, a1.x, a1.y, a1.z, a1.w}, x2[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
        float2 sv = s16[c];
        float ss[2] = {sv.x, sv.y}, ds = dxs[c];
        #pragma unroll
        for (int m = 0; m < 4; m++)
            if (m < 2 || nm > 1) acc[m] += dot_staged<QT>(d[m], x1, x2, ds, ss);
    }
}

// the rows' sums of one group of 2 WARPS rows: acc (gate row r, up row r, gate r + 1, up r + 1),
// QT >= 0: gate and up of type QT; QT < 0: any types (a call per matrix)
template <int QT> __device__ __forceinline__ void gate_up1_g(const uint8_t* pg, long long rbg, int qg, const uint8_t* pu,
                                                             long long rbu, int qu, int nm, int hidden, const float* __restrict__ x,
                                                             uint4* xbuf, float* acc) {
    int tok[1] = {0};
    for (int k0 = 0; k0 < hidden; k0 += X1_COLS) {
        int n = min(X1_COLS, hidden - k0);
        __syncthreads();
        stage<1, X1_COLS>(xbuf, x, 0, tok, 1, k0, n);
        __syncthreads();
        if (nm) {
            const uint8_t* a = pg + (long long)(k0 / g_block[qg][0]) * g_block[qg][1];
            const uint8_t* b = pu + (long long)(k0 / g_block[qu][0]) * g_block[qu][1];
            if (QT >= 0) {
                rows4_g<(QT < 0 ? 8 : QT)>(a, rbg, b, rbu, nm, xbuf, n / 32, acc);
            } else {
                float2 v = {0.f, 0.f}, u = {0.f, 0.f};
                DISPATCH_R(v, qg, rows1_tile, a, a + rbg, nm, xbuf, 0, n / 32)
                DISPATCH_R(u, qu, rows1_tile, b, b + rbu, nm, xbuf, 0, n / 32)
                acc[0] += v.x; acc[2] += v.y; acc[1] += u.x; acc[3] += u.y;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(128, 4) qmoe1_gate_up_g(const Experts1 ex, const float* __restrict__ x, float* __restrict__ h,
                                         int ffn, int hidden, int rows_per_warp, long long off_g, int qt_g,
                                         long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias) {
    __shared__ __align__(16) uint4 xbuf[X1_WORDS];
    int j = ex.pick[blockIdx.y], warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(ex.base[j]);
    int q0 = blockIdx.x * WARPS * rows_per_warp, q1 = min(q0 + WARPS * rows_per_warp, ffn);
    long long bg = (long long)(hidden / g_block[qt_g][0]) * g_block[qt_g][1], bu = (long long)(hidden / g_block[qt_u][0]) * g_block[qt_u][1];
    for (int g0 = q0; g0 < q1; g0 += 2 * WARPS) {  // uniform over the block
        int r = g0 + 2 * warp, nm = max(0, min(2, q1 - r));
        const uint8_t *pg = e + off_g + (long long)r * rb_g, *pu = e + off_u + (long long)r * rb_u;
        prefetch_rows(pg, rb_g, nm, bg, lane);
        prefetch_rows(pu, rb_u, nm, bu, lane);
        float acc[4] = {0.f, 0.f, 0.f, 0.f};
        if (qt_g == qt_u) {
            DISPATCH(qt_g, gate_up1_g, pg, rb_g, qt_g, pu, rb_u, qt_u, nm, hidden, x, xbuf, acc)
        } else {
            gate_up1_g<-1>(pg, rb_g, qt_g, pu, rb_u, qt_u, nm, hidden, x, xbuf, acc);
        }
        for (int m = 0; m < 4; m++)
            for (int o = 16; o; o >>= 1) acc[m] += __shfl_xor_sync(0xffffffffu, acc[m], o);
        if (lane == 0)
            for (int m = 0; m < nm; m++) {
                float vg = bias ? reinterpret_cast<const float*>(e)[r + m] : 0.f;
                float vu = bias ? reinterpret_cast<const float*>(e)[ffn + r + m] : 0.f;
                h[(long long)j * ffn + r + m] = q_act(act, acc[2 * m] + vg, acc[2 * m + 1] + vu);
            }
    }
}

// one warp's rows i, i + 1 (nm of them) of its expert's down projection into ys (a body per type)
template <int QT> __device__ __forceinline__ void down1_g(const uint8_t* row, long long rb, int nm, const float* hj, int ffn,
                                                          float* a) {
    constexpr int SUB = qbw(QT) / 32, BB = qbb(QT);
    int nch = ffn / 32;
    #pragma unroll 2
    for (int t = threadIdx.x & 31; t < nm * nch; t += 32) {
        int m = t >= nch, c = t - m * nch;
        Dec d;
        dec32<QT>(row + m * rb + (long long)(c / SUB) * BB, c % SUB, d);
        float v = dot_f<QT>(d, hj + 32 * c);
        a[m] += v;
    }
}

extern "C" __global__ void __launch_bounds__(1024) qmoe1_down_combine_g(const Experts1 ex, const float* __restrict__ h, float* __restrict__ out,
                                              int k, int ffn, int hidden, int rows_per_block, long long off_d,
                                              int qt_d, long long rb_d, int bias) {
    __shared__ float ys[MAXK][32];
    int j = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * rows_per_block;
    int rows = min(rows_per_block, hidden - r0);
    const uint8_t* e = reinterpret_cast<const uint8_t*>(ex.base[j]);
    const float* bd = reinterpret_cast<const float*>(e) + 2 * ffn;
    const float* hj = h + (long long)j * ffn;
    for (int i = 0; i < rows; i += 2) {
        int nm = min(2, rows - i);
        float a[2] = {0.f, 0.f};
        DISPATCH(qt_d, down1_g, e + off_d + (long long)(r0 + i) * rb_d, rb_d, nm, hj, ffn, a)
        for (int o = 16; o; o >>= 1) {
            a[0] += __shfl_xor_sync(0xffffffffu, a[0], o);
            a[1] += __shfl_xor_sync(0xffffffffu, a[1], o);
        }
        if (lane == 0) {
            ys[j][i] = bias ? a[0] + bd[r0 + i] : a[0];
            if (nm > 1) ys[j][i + 1] = bias ? a[1] + bd[r0 + i + 1] : a[1];
        }
    }
    __syncthreads();
    int i = threadIdx.x;
    if (i < rows) {
        float s = 0.f;
        for (int jj = 0; jj < k; jj++) s += ex.weight[jj] * ys[jj][i];
        out[r0 + i] = s;
    }
}
#endif
