/* The shard's optimizers against torch.optim. optimizer_vectors.h holds the
 * parameters torch produced after each of several steps of SGD (with weight
 * decay), momentum, Nesterov, Adam (L2) and AdamW from the same inputs; every
 * parameter after every step must agree within 1e-6 relative. Also: a sum of
 * W gradients with gscale 1/W gives the same update as their mean; the sum
 * optimizer stores the mean gradient; the cosine schedule; names; and the
 * fused form (the last push added in the update's pass, the parameters
 * written to another buffer) is bit-identical to a separate add and an
 * in-place update, for every rule. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "optimizer.h"
#include "optimizer_vectors.h"
#include "check.h"

#define REL_TOL 1e-6

static struct opt_params params_of(const struct ov_case *c) {
  struct opt_params o = {0};
  CHECK(opt_parse(c->kind, &o.kind) == 0, "kind %s", c->kind);
  o.lr = c->lr;
  o.momentum = c->momentum;
  o.weight_decay = c->weight_decay;
  o.nesterov = c->nesterov != 0;
  o.beta1 = c->beta1;
  o.beta2 = c->beta2;
  o.eps = c->eps;
  return o;
}

/* Runs case ci for OV_STEPS steps; the gradient is fed as `parts` partial
 * sums scaled by 1/parts, as the store feeds the sum of W pushes. Returns the
 * largest relative error seen. */
static double run_case(int ci, int parts) {
  const struct ov_case *c = &ov_cases[ci];
  struct opt_params o = params_of(c);
  float p[OV_N], g[OV_N];
  float *state = calloc(opt_state_floats(o.kind) * OV_N + 1, sizeof(float));
  memcpy(p, ov_init, sizeof(p));
  double worst = 0;
  int bad = 0;
  for (int s = 0; s < OV_STEPS; s++) {
    /* parts equal shares summed: exact for parts = 1, 2, 4 */
    for (int i = 0; i < OV_N; i++) g[i] = ov_grads[s][i] * (float)parts;
    opt_apply(&o, o.lr, (uint64_t)s + 1, 1.0f / (float)parts, p, g, state, OV_N);
    for (int i = 0; i < OV_N; i++) {
      double want = ov_expect[ci][s][i];
      double err = fabs((double)p[i] - want) / fmax(fabs(want), 1e-3);
      if (err > worst) worst = err;
      if (err > REL_TOL && bad++ < 5)
        fprintf(stderr, "%s step %d p[%d] = %.9g, torch %.9g (rel %.3g)\n", c->name, s + 1, i,
                (double)p[i], want, err);
    }
  }
  CHECK(bad == 0, "%s: %d parameters differ from torch.optim by more than %g", c->name, bad,
        REL_TOL);
  free(state);
  return worst;
}

static void test_sum(void) {
  struct opt_params o = {.kind = OPT_SUM, .lr = 0.5};
  float p[5] = {9, 9, 9, 9, 9}, g[5] = {2, 4, -6, 0, 1};
  CHECK(opt_state_floats(OPT_SUM) == 0, "sum keeps no state");
  opt_apply(&o, o.lr, 1, 0.5f, p, g, NULL, 5);
  for (int i = 0; i < 5; i++) CHECK(p[i] == g[i] * 0.5f, "sum: p[%d] = %g", i, (double)p[i]);
}

static void test_schedule(void) {
  struct opt_params o = {.kind = OPT_SGD, .lr = 0.2, .decay_steps = 100};
  CHECK(opt_lr_at(&o, 0) == 0.2, "lr at 0 = %g", opt_lr_at(&o, 0));
  CHECK(fabs(opt_lr_at(&o, 50) - 0.1) < 1e-12, "lr at 50 = %g", opt_lr_at(&o, 50));
  CHECK(fabs(opt_lr_at(&o, 25) - 0.1 * (1 + cos(M_PI / 4))) < 1e-12, "lr at 25");
  CHECK(opt_lr_at(&o, 100) < 1e-12 && opt_lr_at(&o, 1000) < 1e-12, "lr after the end");
  o.decay_steps = 0;
  CHECK(opt_lr_at(&o, 12345) == 0.2, "constant lr");
}

static void test_names(void) {
  const char *names[] = {"sgd", "momentum", "adam", "adamw", "sum"};
  for (int i = 0; i < 5; i++) {
    enum opt_kind k;
    CHECK(opt_parse(names[i], &k) == 0 && strcmp(opt_name(k), names[i]) == 0, "%s", names[i]);
  }
  enum opt_kind k;
  CHECK(opt_parse("adagrad", &k) == -EINVAL, "unknown optimizer accepted");
  CHECK(opt_parse("", &k) == -EINVAL, "empty optimizer accepted");
  CHECK(opt_state_floats(OPT_MOMENTUM) == 1 && opt_state_floats(OPT_ADAM) == 2 &&
            opt_state_floats(OPT_ADAMW) == 2 && opt_state_floats(OPT_SGD) == 0,
        "state sizes");
}

/* opt_apply_fused(dst, p, g, g2) against tm-style sum then opt_apply in
 * place, bit for bit, over a few steps of every case (and of sum). */
static void test_fused(void) {
  enum { N = 1003 }; /* not a multiple of any vector width */
  for (int ci = 0; ci <= OV_CASES; ci++) {
    struct opt_params o = {.kind = OPT_SUM};
    if (ci < OV_CASES) o = params_of(&ov_cases[ci]);
    size_t sf = opt_state_floats(o.kind);
    float *ref = malloc(N * sizeof(float)), *cur = malloc(N * sizeof(float));
    float *next = malloc(N * sizeof(float)), *sum = malloc(N * sizeof(float));
    float *a = malloc(N * sizeof(float)), *b = malloc(N * sizeof(float));
    float *st_ref = calloc(sf * N + 1, sizeof(float)), *st_cur = calloc(sf * N + 1, sizeof(float));
    for (int i = 0; i < N; i++) ref[i] = cur[i] = 0.01f * (float)(i % 97) - 0.3f;
    int bad = 0;
    for (int s = 0; s < 4; s++) {
      for (int i = 0; i < N; i++) {
        a[i] = 0.001f * (float)((i * 7 + s * 13) % 101) - 0.05f;
        b[i] = 0.003f * (float)((i * 11 + s * 5) % 89) - 0.1f;
        sum[i] = a[i] + b[i];
      }
      opt_apply(&o, 0.05, (uint64_t)s + 1, 0.5f, ref, sum, st_ref, N);
      opt_apply_fused(&o, 0.05, (uint64_t)s + 1, 0.5f, next, cur, a, b, st_cur, N);
      float *t = cur;
      cur = next;
      next = t;
      if (memcmp(ref, cur, N * sizeof(float)) != 0 ||
          (sf && memcmp(st_ref, st_cur, sf * N * sizeof(float)) != 0))
        bad++;
    }
    CHECK(bad == 0, "%s: fused update differs from add + update in %d of 4 steps",
          ci < OV_CASES ? ov_cases[ci].name : "sum", bad);
    free(ref), free(cur), free(next), free(sum), free(a), free(b), free(st_ref), free(st_cur);
  }
}

int main(void) {
  for (int ci = 0; ci < OV_CASES; ci++) {
    double w1 = run_case(ci, 1);
    double w4 = run_case(ci, 4);
    printf("%-14s %d steps x %d params: max relative error %.2g (mean of 4 pushes: %.2g)\n",
           ov_cases[ci].name, OV_STEPS, OV_N, w1, w4);
  }
  test_sum();
  test_fused();
  test_schedule();
  test_names();
  if (failures) fprintf(stderr, "%d failures\n", failures);
  return failures ? 1 : 0;
}
