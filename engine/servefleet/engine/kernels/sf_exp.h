/* exp(x) for x <= 0, shared by the C kernels (softmax after subtracting the running max,
 * sigmoid from exp(-|x|)): Cephes-style polynomial after range reduction, relative error
 * ~2e-7, results below exp(-87) flush to zero. Branch-free, so loops over it vectorise. */
#ifndef SF_EXP_H
#define SF_EXP_H
#include <stdint.h>

static inline float sf_exp_nonpos(float x) {
    x = x < -87.0f ? -87.0f : x;
    const float log2e = 1.44269504088896341f;
    float n = __builtin_floorf(x * log2e + 0.5f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    union { float f; int32_t i; } bits;
    bits.i = ((int32_t)n + 127) << 23;
    return p * bits.f;
}
#endif
