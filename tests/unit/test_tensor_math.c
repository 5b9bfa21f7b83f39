/* tensor_math kernels against plain loops, at lengths around vector widths. */
#include <math.h>
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
    for (size_t i = 0; i < n; i++) failures += fabsf(a[i] - ref[i]) > 1e-6f * fmaxf(1, fabsf(ref[i]));
    for (size_t i = 0; i < n; i++) ref[i] = a[i] * -2.0f;
    tm_scale(a, -2.0f, n);
    for (size_t i = 0; i < n; i++) failures += a[i] != ref[i];
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
