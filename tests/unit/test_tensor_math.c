/* tensor_math kernels against plain loops, at lengths around vector widths
 * (max and min: a NaN on either side is the result). */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "tensor_math.h"

int main(void) {
  int failures = 0;
  for (size_t n = 0; n < 200; n++) {
    float *a = malloc((n + 1) * sizeof(float)), *b = malloc((n + 1) * sizeof(float));
    float *ref = malloc((n + 1) * sizeof(float));
    for (size_t i = 0; i < n; i++) {
      a[i] = (float)i * 0.5f - 3;
      b[i] = (float)(i % 13) - 6;
    }
    for (size_t i = 0; i < n; i++) ref[i] = a[i] + b[i];
    tm_add(a, b, n);
    for (size_t i = 0; i < n; i++) failures += a[i] != ref[i];
    for (size_t i = 0; i < n; i++) ref[i] = a[i] + 0.25f * b[i];
    tm_axpy(a, 0.25f, b, n);
    for (size_t i = 0; i < n; i++)
      failures += fabsf(a[i] - ref[i]) > 1e-6f * fmaxf(1, fabsf(ref[i]));
    for (size_t i = 0; i < n; i++) ref[i] = a[i] * -2.0f;
    tm_scale(a, -2.0f, n);
    for (size_t i = 0; i < n; i++) failures += a[i] != ref[i];
    /* SGD with momentum against the torch.optim.SGD recurrence, two steps. */
    float *p = malloc((n + 1) * sizeof(float)), *v = calloc(n + 1, sizeof(float));
    float *rp = malloc((n + 1) * sizeof(float)), *rv = calloc(n + 1, sizeof(float));
    for (size_t i = 0; i < n; i++) p[i] = rp[i] = (float)i * 0.01f;
    for (int step = 0; step < 2; step++) {
      tm_sgd_momentum(p, v, b, 0.1f, 0.9f, n);
      for (size_t i = 0; i < n; i++) {
        rv[i] = rv[i] * 0.9f + b[i];
        rp[i] = fmaf(-0.1f, rv[i], rp[i]);
      }
    }
    for (size_t i = 0; i < n; i++) failures += p[i] != rp[i] || v[i] != rv[i];
    tm_sgd_momentum(p, NULL, b, 0.5f, 0.0f, n); /* plain SGD: v untouched, may be NULL */
    for (size_t i = 0; i < n; i++) failures += p[i] != fmaf(-0.5f, b[i], rp[i]);
    free(p);
    free(v);
    free(rp);
    free(rv);
    /* Pixels: a true division for every byte value, at every offset. */
    uint8_t *px = malloc(n + 1);
    for (size_t i = 0; i < n; i++) px[i] = (uint8_t)(i * 37 + n);
    tm_unit_from_bytes(ref, px, n);
    for (size_t i = 0; i < n; i++) failures += ref[i] != (float)px[i] / 255.0f;
    free(px);
    /* ReLU keeps a NaN (divergence must show) and its backward masks by the output. */
    for (size_t i = 0; i < n; i++) ref[i] = a[i];
    if (n > 2) ref[2] = NAN;
    tm_relu(ref, n);
    for (size_t i = 0; i < n; i++) {
      if (i == 2)
        failures += !isnan(ref[i]);
      else
        failures += ref[i] != (a[i] < 0.0f ? 0.0f : a[i]);
    }
    for (size_t i = 0; i < n; i++) b[i] = (float)i + 1.0f;
    tm_relu_backward(b, ref, n); /* the NaN output is not > 0: its error stops */
    for (size_t i = 0; i < n; i++) failures += b[i] != (ref[i] > 0.0f ? (float)i + 1.0f : 0.0f);
    /* max and min against fmaxf/fminf, except that a NaN on either side wins */
    float *m = malloc((n + 1) * sizeof(float)), *x = malloc((n + 1) * sizeof(float));
    for (int which = 0; which < 2; which++) {
      for (size_t i = 0; i < n; i++) {
        m[i] = x[i] = (float)((i * 7) % 11) - 5;
        b[i] = (float)((i * 3) % 11) - 5;
      }
      if (n > 5) {
        m[4] = x[4] = NAN; /* NaN already there */
        b[5] = NAN;        /* NaN arriving */
      }
      (which ? tm_min : tm_max)(m, b, n);
      for (size_t i = 0; i < n; i++) {
        bool nan = isnan(x[i]) || isnan(b[i]);
        float w = which ? fminf(x[i], b[i]) : fmaxf(x[i], b[i]);
        failures += nan ? !isnan(m[i]) : m[i] != w;
      }
    }
    free(m);
    free(x);
    if (n > 3) {
      a[1] = NAN;
      a[n - 1] = INFINITY;
      failures += tm_count_nonfinite(a, n) != 2;
    }
    free(a);
    free(b);
    free(ref);
  }
  if (failures) fprintf(stderr, "%d mismatches\n", failures);
  return failures ? 1 : 0;
}
