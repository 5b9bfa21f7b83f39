/* The shard's optimizers against torch.optim. optimizer_vectors.h holds the
 * parameters torch produced after each of several steps of SGD (with weight
 * decay), momentum, Nesterov, Adam (L2) and AdamW from the same inputs; every
 * parameter after every step must agree within 1e-6 relative. Also: a sum of
 * W gradients with gscale 1/W gives the same update as their mean; the sum
 * optimizer stores the mean gradient; the cosine schedule; names. */
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

int main(void) {
  for (int ci = 0; ci < OV_CASES; ci++) {
    double w1 = run_case(ci, 1);
    double w4 = run_case(ci, 4);
    printf("%-14s %d steps x %d params: max relative error %.2g (mean of 4 pushes: %.2g)\n",
           ov_cases[ci].name, OV_STEPS, OV_N, w1, w4);
  }
  test_sum();
  test_schedule();
  test_names();
  if (failures) fprintf(stderr, "%d failures\n", failures);
  return failures ? 1 : 0;
}
