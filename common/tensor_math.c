/* tensor_math: simple loops the compiler vectorises; restrict and
 * target_clones do the rest (docs/ARCHITECTURE.md, Pitfalls: ~15 GB/s at -O2 scalar against
 * ~55 GB/s vectorised in cache). */
#include "tensor_math.h"

#include <math.h>

#include "clones.h"

CLONES void tm_add(float *restrict dst, const float *restrict src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] += src[i];
}

/* NaN wins, as in torch.maximum and NCCL's max: a NaN anywhere is not hidden */
CLONES void tm_max(float *restrict dst, const float *restrict src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = src[i] > dst[i] || src[i] != src[i] ? src[i] : dst[i];
}

CLONES void tm_min(float *restrict dst, const float *restrict src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = src[i] < dst[i] || src[i] != src[i] ? src[i] : dst[i];
}

CLONES void tm_axpy(float *restrict dst, float a, const float *restrict src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] += a * src[i];
}

CLONES void tm_scale(float *dst, float a, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] *= a;
}

/* The update rounds like torch's kernels and the shard's optimizer (ps-server/
 * optimizer.c): buf.mul_(mu).add_(g) in two roundings, p.add_(buf, alpha=-lr)
 * as one fused multiply-add, so allreduce and PS modes agree to the bit. The
 * x86-64-v3/v4 clones have FMA; the default one calls libm's fmaf. */
FMA_CLONES void tm_sgd_momentum(float *restrict p, float *restrict v, const float *restrict g,
                                float lr, float mu, size_t n) {
  if (mu == 0.0f) {
    for (size_t i = 0; i < n; i++) p[i] = fmaf(-lr, g[i], p[i]);
    return;
  }
  for (size_t i = 0; i < n; i++) {
    float vi = v[i] * mu + g[i];
    v[i] = vi;
    p[i] = fmaf(-lr, vi, p[i]);
  }
}

CLONES void tm_unit_from_bytes(float *restrict dst, const uint8_t *restrict src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] = (float)src[i] / 255.0f;
}

CLONES void tm_relu(float *x, size_t n) {
  for (size_t i = 0; i < n; i++) x[i] = x[i] < 0.0f ? 0.0f : x[i];
}

CLONES void tm_relu_backward(float *restrict d, const float *restrict a, size_t n) {
  for (size_t i = 0; i < n; i++) d[i] = a[i] > 0.0f ? d[i] : 0.0f;
}

CLONES size_t tm_count_nonfinite(const float *x, size_t n) {
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += !isfinite(x[i]);
  return bad;
}
