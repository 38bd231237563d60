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
QD uint32_t u8(const uint8_t* p) { return LDG(p); }
QD uint32_t u16(const uint8_t* p) { return LDG(p) | (LDG(p + 1) << 8); }
QD float f16(const uint8_t* p) { return h2f(u16(p)); }
// N words of the 4 N bytes at p (any alignment): N + 1 aligned loads, funnel-shifted
template <int N> QD void ldw(const uint8_t* p, uint32_t* w) {
    u64 a = (u64)p;
    const uint32_t* q = (const uint32_t*)(a & ~3ull);
    uint32_t s = (uint32_t)(a & 3) * 8, v[N + 1];
    for (int i = 0; i < N; i++) v[i] = LDG(q + i);
    v[N] = s ? LDG(q + N) : 0u;  // only when the bytes reach into that word
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
template <int NT> __device__ void stage(uint4* buf, const float* __restrict__ x, long long ldx, const int* tok, int nt, int k0, int kt) {
    constexpr int KT = 8192 / NT;
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
        switch (qt) {
#define C(Q) case Q: rows_tile<Q, NT>(rows, buf, k0 / 32, kt / 32, nt, acc); break;
        C(2) C(3) C(6) C(7) C(8) C(10) C(11) C(12) C(13) C(14) C(16) C(17) C(18) C(19) C(20) C(21) C(22) C(23) C(29) C(39)
#undef C
        }
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

extern "C" __global__ void qmatmul_q1(const uint8_t* __restrict__ W, int qt, int rows, int cols, long long rb,
                                      const float* __restrict__ X, int n, float* __restrict__ Y) {
    __shared__ uint4 buf[XS_WORDS];
    matmul_rows<1>(W, qt, rows, cols, rb, X, n, Y, buf);
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

// h[orow[t], r] = act(gate_e x[tok[t]] + bg, up_e x[tok[t]] + bu) for the warp's rows r0 + 2i, r0 + 2i + 1
template <int NT> __device__ void gate_up_rows(const uint8_t* e, const float* x, long long ldx, const int* tok, const int* orow, int nt,
                             float* h, int ffn, int hidden, int r0, int r1, long long off_g, int qt_g, long long rb_g,
                             long long off_u, int qt_u, long long rb_u, int act, int bias, int rpw, uint4* buf) {
    for (int rr = 0; rr < rpw; rr += 2) {  // uniform over the block: every warp stages together
        int r = r0 + rr;
        const uint8_t* g0 = r < r1 ? e + off_g + (long long)r * rb_g : 0;
        const uint8_t* g1 = r + 1 < r1 && rr + 1 < rpw ? e + off_g + (long long)(r + 1) * rb_g : 0;
        const uint8_t* u0 = g0 ? e + off_u + (long long)r * rb_u : 0;
        const uint8_t* u1 = g1 ? e + off_u + (long long)(r + 1) * rb_u : 0;
        float res[4][TB], ru[4][TB];
        bool same = qt_g == qt_u;  // one pass over gate and up rows, else a pass each
        for (int p = 0; p < (same ? 1 : 2); p++)
            pass<NT>(p ? u0 : g0, p ? u1 : g1, same ? u0 : 0, same ? u1 : 0, p ? qt_u : qt_g, hidden, x, ldx, tok, nt, buf,
                     p ? ru : res);
        if (!same)
            for (int m = 0; m < 2; m++)
                for (int t = 0; t < TB; t++) res[m + 2][t] = ru[m][t];
        if ((threadIdx.x & 31) == 0)
            for (int m = 0; m < 2; m++) {
                const uint8_t* gm = m ? g1 : g0;
                if (!gm) continue;
                float bg = bias ? reinterpret_cast<const float*>(e)[r + m] : 0.f;
                float bu = bias ? reinterpret_cast<const float*>(e)[ffn + r + m] : 0.f;
                for (int t = 0; t < nt; t++) h[(long long)orow[t] * ffn + r + m] = q_act(act, res[m][t] + bg, res[m + 2][t] + bu);
            }
    }
}

// as moe_gate_up: h[pair, r] = act(gate_e x[xrow[pair]] + bg_e, up_e x[xrow[pair]] + bu_e).
// grid (ceil(ffn / (WARPS * rows_per_warp)), groups), block 32 * WARPS.
extern "C" __global__ void __launch_bounds__(128, 4) qmoe_gate_up(const unsigned long long* __restrict__ base, const int* __restrict__ gstart,
                                        const int* __restrict__ order, const int* __restrict__ xrow,
                                        const float* __restrict__ x, long long ldx, float* __restrict__ h,
                                        int ffn, int hidden, int rows_per_warp, long long off_g,
                                        int qt_g, long long rb_g, long long off_u, int qt_u, long long rb_u,
                                        int act, int bias) {
    __shared__ uint4 buf[XS_WORDS];
    int g = blockIdx.y, warp = threadIdx.x >> 5;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(base[g]);
    int r0 = (blockIdx.x * WARPS + warp) * rows_per_warp, r1 = min(r0 + rows_per_warp, ffn);
    for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += TB) {
        int nt = min(TB, gstart[g + 1] - p0), tok[TB], orow[TB];
        for (int t = 0; t < TB; t++) {
            orow[t] = order[p0 + (t < nt ? t : 0)];
            tok[t] = xrow[orow[t]];
        }
        gate_up_rows<TB>(e, x, ldx, tok, orow, nt, h, ffn, hidden, r0, r1, off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias,
                     rows_per_warp, buf);
    }
}

// as moe_down: y[pair, r] = down_e h[pair] + bd_e. grid (ceil(hidden / (WARPS * rows_per_warp)), groups).
extern "C" __global__ void __launch_bounds__(128, 4) qmoe_down(const unsigned long long* __restrict__ base, const int* __restrict__ gstart,
                                     const int* __restrict__ order, const float* __restrict__ h, float* __restrict__ y,
                                     int ffn, int hidden, int rows_per_warp, long long off_d, int qt_d, long long rb_d,
                                     int bias) {
    __shared__ uint4 buf[XS_WORDS];
    int g = blockIdx.y, warp = threadIdx.x >> 5;
    const float* bd = reinterpret_cast<const float*>(base[g]) + 2 * ffn;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(base[g]) + off_d;
    int r0 = (blockIdx.x * WARPS + warp) * rows_per_warp, r1 = min(r0 + rows_per_warp, hidden);
    for (int p0 = gstart[g]; p0 < gstart[g + 1]; p0 += TB) {
        int nt = min(TB, gstart[g + 1] - p0), tok[TB];
        for (int t = 0; t < TB; t++) tok[t] = order[p0 + (t < nt ? t : 0)];
        for (int rr = 0; rr < rows_per_warp; rr += 2) {
            int r = r0 + rr;
            bool two = r + 1 < r1 && rr + 1 < rows_per_warp;
            float res[4][TB];
            pass<TB>(r < r1 ? e + (long long)r * rb_d : 0, two ? e + (long long)(r + 1) * rb_d : 0, 0, 0, qt_d, ffn, h, ffn,
                  tok, nt, buf, res);
            if ((threadIdx.x & 31) == 0)
                for (int m = 0; m < 2; m++)
                    if (r + m < r1 && (m == 0 || two))
                        for (int t = 0; t < nt; t++) y[(long long)tok[t] * hidden + r + m] = res[m][t] + (bias ? bd[r + m] : 0.f);
        }
    }
}

struct Experts1 {  // gpu_kernels.cu's one-token pair table, passed by value
    unsigned long long base[MAXK];
    float weight[MAXK];
    int pick[MAXK];
};

// as moe1_gate_up: h[j, r] = act(gate_j x + bg_j, up_j x + bu_j) for j = pick[blockIdx.y].
// grid (ceil(ffn / (WARPS * rows_per_warp)), pairs picked), block 32 * WARPS.
extern "C" __global__ void __launch_bounds__(128, 5) qmoe1_gate_up(const Experts1 ex, const float* __restrict__ x, float* __restrict__ h,
                                         int ffn, int hidden, int rows_per_warp, long long off_g, int qt_g,
                                         long long rb_g, long long off_u, int qt_u, long long rb_u, int act, int bias) {
    __shared__ uint4 buf[XS_WORDS];
    int j = ex.pick[blockIdx.y], warp = threadIdx.x >> 5;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(ex.base[j]);
    int r0 = (blockIdx.x * WARPS + warp) * rows_per_warp, r1 = min(r0 + rows_per_warp, ffn);
    int tok[TB] = {0, 0, 0, 0, 0, 0, 0, 0}, orow[TB] = {j, j, j, j, j, j, j, j};
    gate_up_rows<1>(e, x, 0, tok, orow, 1, h, ffn, hidden, r0, r1, off_g, qt_g, rb_g, off_u, qt_u, rb_u, act, bias,
                 rows_per_warp, buf);
}

// a lane's share of row . x (float32 inputs), chunks lane, lane + 32, ...
template <int QT> __device__ __forceinline__ void row_dot_f(const uint8_t* row, int cols, const float* x, float& acc) {
    constexpr int SUB = qbw(QT) / 32, BB = qbb(QT);
    for (int c = threadIdx.x & 31; c < cols / 32; c += 32) {
        Dec d;
        dec32<QT>(row + (long long)(c / SUB) * BB, c % SUB, d);
        acc += dot_f<QT>(d, x + 32 * c);
    }
}

// as moe1_down_combine: out[r] = sum_j weight[j] * (down_j h[j] + bd_j)[r], j in order.
// grid ceil(hidden / rows_per_block), block 32 * k; rows_per_block <= 32.
extern "C" __global__ void __launch_bounds__(1024) qmoe1_down_combine(const Experts1 ex, const float* __restrict__ h, float* __restrict__ out,
                                              int k, int ffn, int hidden, int rows_per_block, long long off_d,
                                              int qt_d, long long rb_d, int bias) {
    __shared__ float ys[MAXK][32];
    int j = threadIdx.x >> 5, lane = threadIdx.x & 31, r0 = blockIdx.x * rows_per_block;
    const uint8_t* e = reinterpret_cast<const uint8_t*>(ex.base[j]);
    const float* bd = reinterpret_cast<const float*>(e) + 2 * ffn;
    for (int i = 0; i < rows_per_block && r0 + i < hidden; i++)  // every row's bytes towards L2 first
        for (long long o = 128 * lane; o < rb_d; o += 32 * 128)
            PREFETCH_L2(e + off_d + (long long)(r0 + i) * rb_d + o);
    for (int i = 0; i < rows_per_block && r0 + i < hidden; i++) {
        int r = r0 + i;
        float a = 0.f;
        DISPATCH(qt_d, row_dot_f, e + off_d + (long long)r * rb_d, ffn, h + (long long)j * ffn, a)
        for (int o = 16; o; o >>= 1) a += __shfl_xor_sync(0xffffffffu, a, o);
        if (lane == 0) ys[j][i] = bias ? a + bd[r] : a;
    }
    __syncthreads();
    int i = threadIdx.x;
    if (i < rows_per_block && r0 + i < hidden) {
        float s = 0.f;
        for (int jj = 0; jj < k; jj++) s += ex.weight[jj] * ys[jj][i];
        out[r0 + i] = s;
    }
}
#endif
