/* tensor_math: the float32 kernels on the hot path of a shard (summing pushed
 * gradients, applying updates). Built at -O3 with target_clones so the same
 * binary runs AVX-512, AVX2 or plain SSE2 code, whichever the CPU has. */
#ifndef PS_TENSOR_MATH_H
#define PS_TENSOR_MATH_H

#include <stddef.h>

/* dst[i] += src[i] */
void tm_add(float *restrict dst, const float *restrict src, size_t n);
/* dst[i] += a * src[i] */
void tm_axpy(float *restrict dst, float a, const float *restrict src, size_t n);
/* dst[i] *= a */
void tm_scale(float *dst, float a, size_t n);
/* SGD with momentum, torch.optim.SGD semantics (dampening 0, no Nesterov):
 * v[i] = mu * v[i] + g[i]; p[i] -= lr * v[i] (one fused multiply-add, as
 * torch and the shard round it). With mu == 0, v is not touched (may be
 * NULL) and p[i] -= lr * g[i]. */
void tm_sgd_momentum(float *restrict p, float *restrict v, const float *restrict g, float lr,
                     float mu, size_t n);
/* Number of elements that are NaN or infinite. */
size_t tm_count_nonfinite(const float *x, size_t n);

#endif
