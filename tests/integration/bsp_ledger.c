/* bsp_ledger: see bsp_ledger.h. */
#include "bsp_ledger.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "harness.h"

float bsp_init_value(int t, uint64_t i) {
  return (float)(0.5 * sin(0.1 * (double)i + t));
}

float bsp_grad_value(int r, uint64_t s, uint64_t i, float p) {
  return 0.1f * (float)(r + 1) * p + 0.01f * (float)((i + s + (uint64_t)r) % 7);
}

int bsp_replay_compare(int rank, const char *name, int t, uint64_t count, int world, uint64_t steps,
                       float lr, const float *got) {
  float *exp = malloc(count * sizeof(float));
  if (!exp) return (int)count;
  for (uint64_t i = 0; i < count; i++) exp[i] = bsp_init_value(t, i);
  for (uint64_t s = 0; s < steps; s++)
    for (uint64_t i = 0; i < count; i++) {
      float sum = 0;
      for (int r = 0; r < world; r++) sum += bsp_grad_value(r, s, i, exp[i]);
      exp[i] -= lr * sum / (float)world;
    }
  int bad = 0;
  for (uint64_t i = 0; i < count; i++) {
    float tol = 1e-5f * fmaxf(1.0f, fabsf(exp[i]));
    if (fabsf(got[i] - exp[i]) > tol && bad++ < 5)
      fprintf(stderr, "rank %d %s[%llu] = %.9g, replay %.9g\n", rank, name, (unsigned long long)i,
              got[i], exp[i]);
  }
  free(exp);
  return bad;
}

void bsp_ledger_tensors(ps_client *c, int rank, int nt, const uint64_t *counts, float **p,
                        float **g) {
  for (int t = 0; t < nt; t++) {
    p[t] = malloc(counts[t] * sizeof(float));
    g[t] = malloc(counts[t] * sizeof(float));
    REQUIRE(p[t] && g[t], "out of memory for tensor %d", t);
    if (rank == 0) {
      for (uint64_t i = 0; i < counts[t]; i++) p[t][i] = bsp_init_value(t, i);
      REQUIRE(ps_init(c, t, p[t]) == PS_OK, "init of tensor %d", t);
    }
  }
}

void bsp_ledger_tensors_free(int nt, float **p, float **g) {
  for (int t = 0; t < nt; t++) {
    free(p[t]);
    free(g[t]);
  }
}
