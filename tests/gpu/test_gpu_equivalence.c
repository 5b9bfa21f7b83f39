/* test_gpu_equivalence: the CUDA model computes what the CPU model computes.
 *
 * For several shapes (the default 784-256-10 at batch 128; odd sizes that
 * straddle warps and blocks; more than 32 classes; batch 1) and for both ways
 * of launching a step (a replayed CUDA graph and kernel by kernel), the same
 * initial parameters and the same batch go through one step on each device:
 *  - loss and every gradient agree within float tolerance (relative L2 per
 *    tensor, and element-wise against the tensor's scale);
 *  - gradients arrive in the host mirror through the callbacks, last layer
 *    first, each already final when its callback runs (a snapshot taken in
 *    the callback equals the value after the step), every element written
 *    (the mirror is poisoned with NaN before);
 *  - a second batch through the same captured graph agrees too;
 *  - a step without callback followed by device SGD and store_params gives
 *    the CPU's parameters after the same step and SGD;
 *  - evaluation over more samples than max_batch agrees;
 *  - a smaller batch (a new graph) agrees.
 * Inputs are random bytes (like pixels) and random labels. Hidden layers get
 * small weights (|w.a| <= 0.45 for any input) and biases of +-1, so no
 * pre-activation comes near 0: otherwise a rounding difference between the
 * devices could flip one ReLU and move one row of a gradient far beyond any
 * float tolerance, a false failure. Every rounding still differs (FP32 sums
 * in different orders); the last layer keeps torch's default init.
 * Exit 77 (skipped) where CUDA cannot be used; 0 pass; 1 fail. */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "data.h"
#include "device.h"
#include "log.h"
#include "model.h"

#define MAX_T (2 * (MLP_MAX_SIZES - 1))

static uint64_t rng = 0x243F6A8885A308D3ull;

static uint32_t rnd(void) {
  rng = rng * 6364136223846793005ull + 1442695040888963407ull;
  return (uint32_t)(rng >> 33);
}

struct rec {
  struct mlp *m;
  int order[MAX_T], count;
  float *snap[MAX_T];
};

static void record(int t, size_t done, void *arg) {
  struct rec *r = arg;
  if (done != mlp_tensor_count(r->m, t)) return; /* whole tensors only: no blocks set here */
  if (r->count < MAX_T) r->order[r->count] = t;
  r->count++;
  if (t >= 0 && t < MAX_T && r->snap[t])
    memcpy(r->snap[t], mlp_grad(r->m, t), mlp_tensor_count(r->m, t) * sizeof(float));
}

/* Relative L2 difference of got against want, and whether every element is
 * within rtol of want plus atol of the tensor's largest magnitude. */
static double compare(const float *got, const float *want, size_t n, double rtol, double atol,
                      size_t *bad) {
  double d2 = 0, w2 = 0, scale = 0;
  for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs(want[i]));
  *bad = 0;
  for (size_t i = 0; i < n; i++) {
    double d = (double)got[i] - want[i];
    d2 += d * d;
    w2 += (double)want[i] * want[i];
    if (!(fabs(d) <= rtol * fabs(want[i]) + atol * scale)) (*bad)++;
  }
  return w2 > 0 ? sqrt(d2 / w2) : sqrt(d2);
}

struct shape {
  const char *name;
  int sizes[6], num_sizes;
  int batch;
};

/* Gradients of the two mirrors; returns the largest relative L2 difference
 * over the tensors. */
static double compare_models(const char *what, struct mlp *gpu, struct mlp *cpu) {
  double worst = 0;
  for (int t = 0; t < mlp_num_tensors(cpu); t++) {
    size_t n = mlp_tensor_count(cpu, t), bad;
    const float *g = mlp_grad(gpu, t), *c = mlp_grad(cpu, t);
    double rel = compare(g, c, n, 1e-3, 1e-5, &bad);
    CHECK(rel < 2e-5 && bad == 0, "%s %s: relative L2 %.3g, %zu of %zu elements out of tolerance",
          what, mlp_tensor_name(cpu, t), rel, bad, n);
    worst = fmax(worst, rel);
  }
  return worst;
}

static int run_shape(const struct shape *s, int eager) {
  struct device_opts co = {.kind = DEVICE_CPU}, go = {.kind = DEVICE_CUDA, .eager = eager != 0};
  struct device_model *cpu = NULL, *gpu = NULL;
  struct rec rec = {0};
  float *p0[MAX_T] = {0};
  char err[512] = "";
  int in = s->sizes[0], classes = s->sizes[s->num_sizes - 1], B = s->batch;
  uint32_t n = (uint32_t)(3 * B + 5);
  struct dataset ds = {.n = n, .rows = 1, .cols = (uint32_t)in};
  uint32_t *idx = malloc(n * sizeof(uint32_t));
  int r, skipped = 0;
  double worst = 0;

  ds.pixels = malloc((size_t)n * in);
  ds.labels = malloc(n);
  if (!idx || !ds.pixels || !ds.labels) {
    CHECK(0, "out of memory");
    goto out;
  }
  for (size_t i = 0; i < (size_t)n * in; i++) ds.pixels[i] = (uint8_t)rnd();
  for (uint32_t i = 0; i < n; i++) ds.labels[i] = (uint8_t)(rnd() % (uint32_t)classes);
  for (uint32_t i = 0; i < n; i++)
    idx[i] = (i * 7919u + 13u) % n; /* a permutation: 7919 is prime */

  r = device_model_open(&go, s->sizes, s->num_sizes, B, &gpu, err, sizeof(err));
  if (r == -ENODEV) {
    printf("SKIP: %s\n", err);
    skipped = 1;
    goto out;
  }
  CHECK(r == 0, "open cuda: %s", err);
  r = device_model_open(&co, s->sizes, s->num_sizes, B, &cpu, err, sizeof(err));
  CHECK(r == 0, "open cpu: %s", err);
  if (!gpu || !cpu) goto out;
  struct mlp *gm = device_model_host(gpu), *cm = device_model_host(cpu);
  int nt = mlp_num_tensors(cm);
  mlp_init_params(cm, 42);
  for (int l = 0; l + 2 < s->num_sizes; l++) { /* hidden layers: see the top */
    float *w = mlp_param(cm, 2 * l), *b = mlp_param(cm, 2 * l + 1);
    /* |w| <= 1/sqrt(in) from the init, inputs in [0, 1.5]: sum |w a| <= 0.45 */
    float shrink = 0.3f / sqrtf((float)s->sizes[l]);
    for (size_t k = 0; k < mlp_tensor_count(cm, 2 * l); k++) w[k] *= shrink;
    for (int j = 0; j < s->sizes[l + 1]; j++) b[j] = j % 3 == 0 ? -1.0f : 1.0f;
  }
  for (int t = 0; t < nt; t++)
    memcpy(mlp_param(gm, t), mlp_param(cm, t), mlp_tensor_count(cm, t) * sizeof(float));
  CHECK(device_model_load_params(gpu) == 0, "load_params: %s", device_model_errmsg(gpu));
  rec.m = gm;
  for (int t = 0; t < nt; t++)
    if (!(rec.snap[t] = malloc(mlp_tensor_count(cm, t) * sizeof(float)))) goto out;

  /* Two batches through the step with callbacks: the second replays the graph. */
  for (int round = 0; round < 2; round++) {
    const uint32_t *bidx = idx + (size_t)round * B;
    float lg = NAN, lc = NAN;
    for (int t = 0; t < nt; t++)
      for (size_t k = 0; k < mlp_tensor_count(gm, t); k++) mlp_grad(gm, t)[k] = NAN;
    rec.count = 0;
    CHECK(device_model_load_batch(gpu, &ds, bidx, B) == 0, "gpu load: %s",
          device_model_errmsg(gpu));
    CHECK(device_model_load_batch(cpu, &ds, bidx, B) == 0, "cpu load");
    r = device_model_step(gpu, record, &rec, &lg);
    CHECK(r == 0, "gpu step: %s", device_model_errmsg(gpu));
    CHECK(device_model_step(cpu, NULL, NULL, &lc) == 0, "cpu step");
    if (r < 0) goto out;
    CHECK(fabsf(lg - lc) <= 1e-5f * (1.0f + fabsf(lc)), "round %d: loss %.8g, cpu %.8g", round, lg,
          lc);
    CHECK(rec.count == nt, "round %d: %d callbacks for %d tensors", round, rec.count, nt);
    for (int i = 0; i < nt && i < rec.count; i++)
      CHECK(rec.order[i] == nt - 1 - i, "callback %d for tensor %d, want %d", i, rec.order[i],
            nt - 1 - i);
    for (int t = 0; t < nt; t++)
      CHECK(memcmp(rec.snap[t], mlp_grad(gm, t), mlp_tensor_count(gm, t) * sizeof(float)) == 0,
            "round %d: %s not final when its callback ran", round, mlp_tensor_name(gm, t));
    worst = fmax(worst, compare_models("gradient", gm, cm));
  }

  /* Without callback, then SGD on the device against SGD on the CPU: the
   * updates (p - p0) / lr are the gradients the no-copy graph computed. */
  {
    const uint32_t *bidx = idx + 2 * (size_t)B;
    float lg = NAN, lc = NAN;
    for (int t = 0; t < nt; t++)
      if (!(p0[t] = malloc(mlp_tensor_count(cm, t) * sizeof(float)))) goto out;
    for (int t = 0; t < nt; t++)
      memcpy(p0[t], mlp_param(cm, t), mlp_tensor_count(cm, t) * sizeof(float));
    CHECK(device_model_load_batch(gpu, &ds, bidx, B) == 0, "gpu load");
    CHECK(device_model_load_batch(cpu, &ds, bidx, B) == 0, "cpu load");
    CHECK(device_model_step(gpu, NULL, NULL, &lg) == 0, "gpu step: %s", device_model_errmsg(gpu));
    CHECK(device_model_step(cpu, NULL, NULL, &lc) == 0, "cpu step");
    CHECK(fabsf(lg - lc) <= 1e-5f * (1.0f + fabsf(lc)), "no-callback loss %.8g, cpu %.8g", lg, lc);
    CHECK(device_model_sgd_step(gpu, 0.5f) == 0, "gpu sgd: %s", device_model_errmsg(gpu));
    CHECK(device_model_sgd_step(cpu, 0.5f) == 0, "cpu sgd");
    CHECK(device_model_store_params(gpu) == 0, "store: %s", device_model_errmsg(gpu));
    for (int t = 0; t < nt; t++) {
      size_t cnt = mlp_tensor_count(cm, t), bad;
      for (size_t k = 0; k < cnt; k++) {
        mlp_param(gm, t)[k] = (mlp_param(gm, t)[k] - p0[t][k]) / 0.5f;
        mlp_param(cm, t)[k] = (mlp_param(cm, t)[k] - p0[t][k]) / 0.5f;
      }
      /* Wider: (p - lr g) - p rounds at p's scale, not at g's. */
      double rel = compare(mlp_param(gm, t), mlp_param(cm, t), cnt, 1e-2, 1e-4, &bad);
      CHECK(rel < 1e-3 && bad == 0,
            "SGD update of %s: relative L2 %.3g, %zu of %zu elements out "
            "of tolerance",
            mlp_tensor_name(cm, t), rel, bad, cnt);
      memcpy(mlp_param(gm, t), p0[t], cnt * sizeof(float));
      memcpy(mlp_param(cm, t), p0[t], cnt * sizeof(float));
    }
    CHECK(device_model_load_params(gpu) == 0, "load_params: %s", device_model_errmsg(gpu));
  }

  /* Evaluation in pieces of max_batch (parameters from before SGD). */
  {
    double lg = -1, lc = -1;
    int hg = -1, hc = -1;
    CHECK(device_model_evaluate(gpu, &ds, idx, (int)n, &lg, &hg) == 0, "gpu evaluate: %s",
          device_model_errmsg(gpu));
    CHECK(device_model_evaluate(cpu, &ds, idx, (int)n, &lc, &hc) == 0, "cpu evaluate");
    CHECK(fabs(lg - lc) <= 1e-5 * (1.0 + fabs(lc)), "evaluate loss sum %.8g, cpu %.8g", lg, lc);
    CHECK(abs(hg - hc) <= 1 + (int)n / 200, "evaluate hits %d, cpu %d", hg, hc);
  }

  /* A smaller batch: a new graph. */
  if (B > 1) {
    int b = B / 2 + 1;
    float lg = NAN, lc = NAN;
    CHECK(device_model_load_batch(gpu, &ds, idx + 1, b) == 0, "gpu load");
    CHECK(device_model_load_batch(cpu, &ds, idx + 1, b) == 0, "cpu load");
    rec.count = 0;
    CHECK(device_model_step(gpu, record, &rec, &lg) == 0, "gpu step: %s", device_model_errmsg(gpu));
    CHECK(device_model_step(cpu, NULL, NULL, &lc) == 0, "cpu step");
    CHECK(fabsf(lg - lc) <= 1e-5f * (1.0f + fabsf(lc)), "batch %d: loss %.8g, cpu %.8g", b, lg, lc);
    worst = fmax(worst, compare_models("gradient (smaller batch)", gm, cm));
  }
  printf("%-28s %-6s %s: worst relative L2 %.2e\n", s->name, eager ? "eager" : "graph",
         device_model_name(gpu), worst);

out:
  for (int t = 0; t < MAX_T; t++) {
    free(rec.snap[t]);
    free(p0[t]);
  }
  device_model_close(gpu);
  device_model_close(cpu);
  free(idx);
  free(ds.pixels);
  free(ds.labels);
  return skipped;
}

int main(void) {
  static const struct shape shapes[] = {
      {"mlp:784-256-10 batch 128", {784, 256, 10}, 3, 128},
      {"mlp:37-33-19-7 batch 33", {37, 33, 19, 7}, 4, 33},
      {"mlp:50-40-100 batch 5", {50, 40, 100}, 3, 5},
      {"mlp:784-512-256-10 batch 64", {784, 512, 256, 10}, 4, 64},
      {"mlp:3-2 batch 1", {3, 2}, 2, 1},
  };

  log_setup("test_gpu_equivalence", LOG_WARN);
  for (size_t i = 0; i < sizeof(shapes) / sizeof(shapes[0]); i++)
    for (int eager = 0; eager < 2; eager++)
      if (run_shape(&shapes[i], eager)) return 77;
  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  return failures ? 1 : 0;
}
