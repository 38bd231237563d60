// gpu_quant.cu, part 1 of 4 (included by gpu_quant.cu): types, tables, the decoders of 32-weight
// chunks and their dots, the type dispatch.
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
    // each sum in two chains of dp4a (exact int32 sums: the same values, half the dependent latency)
    int a[4] = {0, 0, 0, 0}, b[4] = {0, 0, 0, 0};
    #pragma unroll
    for (int k = 0; k < 8; k++) {
        a[(k >> 2) * 2 + (k & 1)] = dp4a(d.q[k], x1[k], a[(k >> 2) * 2 + (k & 1)]);
        b[(k >> 2) * 2 + (k & 1)] = dp4a(d.q[k], x2[k], b[(k >> 2) * 2 + (k & 1)]);
    }
    if (qsplit(QT)) {
        v = dxs * (d.a0 * fmaf(small_f(a[0] + a[1]), 256.f, small_f(b[0] + b[1]))
                   + d.a1 * fmaf(small_f(a[2] + a[3]), 256.f, small_f(b[2] + b[3])));
    } else {  // level sums |a|, |b| <= 32 * 128 * 127 < 2^22
        v = dxs * d.a0 * fmaf(small_f((a[0] + a[1]) + (a[2] + a[3])), 256.f, small_f((b[0] + b[1]) + (b[2] + b[3])));
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

