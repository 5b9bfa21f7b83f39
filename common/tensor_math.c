/* tensor_math: simple loops the compiler vectorises; restrict and
 * target_clones do the rest (see DESIGN.md §9: ~15 GB/s at -O2 scalar against
 * ~55 GB/s vectorised in cache). */
#include "tensor_math.h"

#include <math.h>

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define TM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#elif defined(__x86_64__) && defined(__clang__)
#define TM_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define TM_CLONES
#endif

TM_CLONES void tm_add(float *restrict dst, const float *restrict src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] += src[i];
}

TM_CLONES void tm_axpy(float *restrict dst, float a, const float *restrict src, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] += a * src[i];
}

TM_CLONES void tm_scale(float *dst, float a, size_t n) {
  for (size_t i = 0; i < n; i++) dst[i] *= a;
}

TM_CLONES void tm_sgd_momentum(float *restrict p, float *restrict v, const float *restrict g,
                               float lr, float mu, size_t n) {
  if (mu == 0.0f) {
    for (size_t i = 0; i < n; i++) p[i] -= lr * g[i];
    return;
  }
  for (size_t i = 0; i < n; i++) {
    v[i] = mu * v[i] + g[i];
    p[i] -= lr * v[i];
  }
}

TM_CLONES size_t tm_count_nonfinite(const float *x, size_t n) {
  size_t bad = 0;
  for (size_t i = 0; i < n; i++) bad += !isfinite(x[i]);
  return bad;
}
