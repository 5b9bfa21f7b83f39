/* tensor_math: the float32 kernels on the hot paths of a shard (summing
 * pushed gradients, applying updates) and of the CPU trainer (inputs, ReLU).
 * Built at -O3 with target_clones so the same binary runs AVX-512, AVX2 or
 * plain SSE2 code, whichever the CPU has. */
#ifndef PS_TENSOR_MATH_H
#define PS_TENSOR_MATH_H

#include <stddef.h>
#include <stdint.h>

/* dst[i] += src[i] */
void tm_add(float *restrict dst, const float *restrict src, size_t n);
/* dst[i] = max(dst[i], src[i]) and min: a NaN in either is the result */
void tm_max(float *restrict dst, const float *restrict src, size_t n);
void tm_min(float *restrict dst, const float *restrict src, size_t n);
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
/* dst[i] = src[i] / 255.0f, a true division (bit-identical to numpy's and
 * torch's uint8 / 255.0 cast to float32): the trainer's input pixels. */
void tm_unit_from_bytes(float *restrict dst, const uint8_t *restrict src, size_t n);
/* x[i] = max(x[i], 0), written so a NaN passes through (as torch.relu). */
void tm_relu(float *x, size_t n);
/* d[i] = a[i] > 0 ? d[i] : 0: the error through a ReLU whose output was a. */
void tm_relu_backward(float *restrict d, const float *restrict a, size_t n);
/* Number of elements that are NaN or infinite. */
size_t tm_count_nonfinite(const float *x, size_t n);

#endif
