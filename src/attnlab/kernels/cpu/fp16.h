/* fp16 <-> float conversions shared by the CPU kernels (qattn.c, qmatmul.c): F16C where the machine has it,
 * else bit manipulation that rounds as torch's .half() and .float() do. Included by the .c files, which
 * attnlab.kernels.cpu.build compiles (and hashes together with every header of this folder). */
#ifndef ATTNLAB_FP16_H
#define ATTNLAB_FP16_H

#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#if defined(__F16C__)
static inline float half_to_float(uint16_t h) { return _cvtsh_ss(h); }
#else
static inline float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff, bits;
    if (exponent == 0) {
        if (mantissa == 0) {
            bits = sign;
        } else { /* subnormal: normalize */
            exponent = 113;
            while (!(mantissa & 0x400)) {
                mantissa <<= 1;
                exponent--;
            }
            bits = sign | (exponent << 23) | ((mantissa & 0x3ff) << 13);
        }
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
#endif

/* float -> fp16 bits, rounded to nearest even (as torch's .half()). */
static inline uint16_t float_to_half(float f) {
#if defined(__F16C__)
    return _cvtss_sh(f, 0);
#else
    uint32_t x;
    memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000, abs = x & 0x7fffffff;
    if (abs >= 0x7f800000) return sign | 0x7c00 | (abs > 0x7f800000 ? 0x200 : 0); /* inf, nan */
    if (abs >= 0x477ff000) return sign | 0x7c00;                                  /* >= 65520: inf */
    if (abs < 0x38800000) {                                                       /* below 2^-14: subnormal */
        float a;
        memcpy(&a, &abs, 4);
        return sign | (uint16_t)rintf(a * 16777216.0f); /* units of 2^-24, exact scaling, nearest even */
    }
    uint32_t h = ((abs >> 23) - 112) << 10 | (abs & 0x7fffff) >> 13;
    const uint32_t rest = abs & 0x1fff;
    if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h++; /* a carry moves into the exponent, as it should */
    return sign | h;
#endif
}

#endif
