/* test_device: the device interface (device.h) on the CPU, and how CUDA is
 * refused where it cannot be used. Runs on every machine.
 *
 * The CPU device must compute exactly what model.h computes on the same
 * gathered batch (bit for bit: it is the same code), call back in the same
 * order, evaluate and step SGD the same, and refuse bad batches before
 * touching the model. Opening CUDA must either work (a GPU machine) or fail
 * with -ENODEV and a message that says why; auto must then pick the CPU.
 * Exit 0 pass, 1 fail. */
#include "device.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "data.h"
#include "log.h"
#include "model.h"
#include "check.h"

enum { N = 40, PIXELS = 12, B = 8 };
static const int sizes[] = {PIXELS, 9, 6, 4};
#define NUM_SIZES 4
#define NT 6

static uint8_t pixels[N * PIXELS], labels[N];
static const struct dataset ds = {.n = N, .rows = 3, .cols = 4, .pixels = pixels, .labels = labels};

struct rec {
  struct mlp *m;
  int order[16], count;
  float *snap[NT];
};

static void record(int t, size_t done, void *arg) {
  struct rec *r = arg;
  if (done != mlp_tensor_count(r->m, t)) return; /* no blocks set here */
  if (r->count < 16) r->order[r->count] = t;
  r->count++;
  if (t >= 0 && t < NT) memcpy(r->snap[t], mlp_grad(r->m, t), mlp_tensor_count(r->m, t) * 4);
}

static void test_kind(void) {
  enum device_kind k = DEVICE_CPU;
  static const char *bad[] = {"", "gpu", "CPU", "cpu ", "cuda0", "auto,cpu"};

  CHECK(device_kind_parse("auto", &k) == 0 && k == DEVICE_AUTO, "auto");
  CHECK(device_kind_parse("cpu", &k) == 0 && k == DEVICE_CPU, "cpu");
  CHECK(device_kind_parse("cuda", &k) == 0 && k == DEVICE_CUDA, "cuda");
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
    CHECK(device_kind_parse(bad[i], &k) == -EINVAL, "\"%s\" accepted", bad[i]);
  CHECK(device_kind_parse(NULL, &k) == -EINVAL, "NULL accepted");
  CHECK(strcmp(device_kind_name(DEVICE_CUDA), "cuda") == 0, "name");
}

/* The CPU device against model.h called directly on the same batch. */
static void test_cpu_matches_model(void) {
  struct device_opts o = {.kind = DEVICE_CPU};
  struct device_model *dm = NULL;
  struct mlp *ref = mlp_new(sizes, NUM_SIZES, B);
  struct rec got = {0}, want = {0};
  float x[B * PIXELS], loss_dm = 0, loss_ref;
  uint8_t y[B];
  uint32_t idx[B] = {3, 17, 0, 39, 8, 8, 21, 5};
  char err[256] = "";
  int r = device_model_open(&o, sizes, NUM_SIZES, B, &dm, err, sizeof(err));

  CHECK(r == 0 && dm != NULL, "open cpu: %d %s", r, err);
  if (dm == NULL || ref == NULL) goto out;
  CHECK(device_model_kind(dm) == DEVICE_CPU && strcmp(device_model_name(dm), "cpu") == 0, "kind");
  struct mlp *m = device_model_host(dm);
  CHECK(mlp_num_tensors(m) == NT, "tensors %d", mlp_num_tensors(m));
  mlp_init_params(m, 7);
  mlp_init_params(ref, 7);
  CHECK(device_model_load_params(dm) == 0, "load_params");
  for (int t = 0; t < NT; t++) {
    got.snap[t] = malloc(mlp_tensor_count(m, t) * 4);
    want.snap[t] = malloc(mlp_tensor_count(m, t) * 4);
    if (!got.snap[t] || !want.snap[t]) goto out;
  }
  got.m = m;
  want.m = ref;

  CHECK(device_model_step(dm, NULL, NULL, &loss_dm) == -EINVAL, "step before any batch");
  CHECK(device_model_load_batch(dm, &ds, idx, B) == 0, "load_batch: %s", device_model_errmsg(dm));
  CHECK(device_model_step(dm, record, &got, &loss_dm) == 0, "step: %s", device_model_errmsg(dm));
  dataset_gather(&ds, idx, B, x, y);
  loss_ref = mlp_forward_backward(ref, x, y, B, record, &want);
  CHECK(memcmp(&loss_dm, &loss_ref, sizeof(float)) == 0, "loss %.9g, model.h %.9g", loss_dm,
        loss_ref);
  CHECK(got.count == NT && want.count == NT, "callbacks %d %d", got.count, want.count);
  for (int i = 0; i < NT && i < got.count; i++)
    CHECK(got.order[i] == want.order[i], "callback %d: tensor %d, model.h %d", i, got.order[i],
          want.order[i]);
  for (int t = 0; t < NT; t++) {
    size_t bytes = mlp_tensor_count(m, t) * 4;
    CHECK(memcmp(mlp_grad(m, t), mlp_grad(ref, t), bytes) == 0, "gradient %d differs", t);
    CHECK(memcmp(got.snap[t], mlp_grad(m, t), bytes) == 0, "gradient %d changed after callback", t);
  }

  /* A smaller batch, then SGD on both. */
  CHECK(device_model_load_batch(dm, &ds, idx + 2, 3) == 0, "load 3");
  CHECK(device_model_step(dm, NULL, NULL, &loss_dm) == 0, "step 3");
  dataset_gather(&ds, idx + 2, 3, x, y);
  loss_ref = mlp_forward_backward(ref, x, y, 3, NULL, NULL);
  CHECK(loss_dm == loss_ref, "batch 3: loss %g vs %g", loss_dm, loss_ref);
  CHECK(device_model_sgd_step(dm, 0.25f) == 0, "sgd");
  mlp_sgd_step(ref, 0.25f);
  CHECK(device_model_store_params(dm) == 0, "store_params");
  for (int t = 0; t < NT; t++)
    CHECK(memcmp(mlp_param(m, t), mlp_param(ref, t), mlp_tensor_count(m, t) * 4) == 0,
          "parameters %d differ after SGD", t);

  /* Evaluation over more samples than max_batch, in pieces. */
  {
    uint32_t all[N];
    float xa[N * PIXELS], l, a;
    uint8_t ya[N];
    double loss_sum = -1;
    int correct = -1;
    struct mlp *big = mlp_new(sizes, NUM_SIZES, N);
    for (int i = 0; i < N; i++) all[i] = (uint32_t)i;
    CHECK(device_model_evaluate(dm, &ds, all, N, &loss_sum, &correct) == 0, "evaluate: %s",
          device_model_errmsg(dm));
    if (big != NULL) {
      for (int t = 0; t < NT; t++)
        memcpy(mlp_param(big, t), mlp_param(ref, t), mlp_tensor_count(ref, t) * 4);
      dataset_gather(&ds, all, N, xa, ya);
      mlp_evaluate(big, xa, ya, N, &l, &a);
      CHECK(fabs(loss_sum / N - l) < 1e-6 * (1 + fabs(l)), "evaluate loss %g, model.h %g",
            loss_sum / N, (double)l);
      CHECK(correct == (int)lround((double)a * N), "evaluate correct %d, model.h %g", correct,
            (double)a * N);
    }
    mlp_free(big);
    CHECK(device_model_step(dm, NULL, NULL, &loss_dm) == -EINVAL, "evaluate left a batch loaded");
  }

  /* Bad input is refused before anything is computed, with a message. */
  {
    uint32_t out_of_range[2] = {1, N};
    uint8_t saved = labels[5];
    struct dataset wrong = ds;
    wrong.cols = 5;
    CHECK(device_model_load_batch(dm, &ds, idx, 0) == -EINVAL, "batch 0");
    CHECK(device_model_load_batch(dm, &ds, idx, B + 1) == -EINVAL, "batch > max");
    CHECK(device_model_load_batch(dm, &ds, out_of_range, 2) == -EINVAL, "index out of range");
    CHECK(strstr(device_model_errmsg(dm), "sample 40") != NULL, "message: %s",
          device_model_errmsg(dm));
    labels[5] = 4; /* 4 outputs: labels 0..3 */
    CHECK(device_model_load_batch(dm, &ds, idx, B) == -EINVAL, "label 4 accepted");
    labels[5] = saved;
    CHECK(device_model_load_batch(dm, &wrong, idx, B) == -EINVAL, "15-pixel images accepted");
    CHECK(device_model_step(dm, NULL, NULL, &loss_dm) == -EINVAL, "a refused batch is loaded");
  }

out:
  for (int t = 0; t < NT; t++) {
    free(got.snap[t]);
    free(want.snap[t]);
  }
  mlp_free(ref);
  device_model_close(dm);
  device_model_close(NULL);
}

/* CUDA opens (a GPU machine with a CUDA build) or says why not; auto follows. */
static void test_cuda_and_auto(void) {
  struct device_opts o = {.kind = DEVICE_CUDA};
  struct device_model *dm = NULL;
  char err[512] = "";
  int r = device_model_open(&o, sizes, NUM_SIZES, B, &dm, err, sizeof(err));

  if (r == 0) {
    CHECK(dm != NULL && device_model_kind(dm) == DEVICE_CUDA, "cuda kind");
    printf("cuda: %s\n", device_model_name(dm));
  } else {
    CHECK(r == -ENODEV, "cuda open: %d (%s), want -ENODEV", r, err);
    CHECK(dm == NULL, "out set on failure");
    CHECK(strstr(err, "CUDA") != NULL, "message does not say CUDA: \"%s\"", err);
    printf("cuda refused as expected: %s\n", err);
  }
  device_model_close(dm);
  dm = NULL;

  int cuda_ok = r == 0;
  o.kind = DEVICE_AUTO;
  r = device_model_open(&o, sizes, NUM_SIZES, B, &dm, err, sizeof(err));
  CHECK(r == 0 && dm != NULL, "auto: %d %s", r, err);
  if (dm != NULL)
    CHECK(device_model_kind(dm) == (cuda_ok ? DEVICE_CUDA : DEVICE_CPU), "auto chose %s",
          device_model_name(dm));
  device_model_close(dm);

  static const int bad[] = {PIXELS};
  dm = NULL;
  o.kind = DEVICE_CPU;
  CHECK(device_model_open(&o, bad, 1, B, &dm, err, sizeof(err)) == -EINVAL && dm == NULL,
        "one layer size accepted");
  CHECK(device_model_open(&o, sizes, NUM_SIZES, 0, &dm, err, sizeof(err)) == -EINVAL,
        "max batch 0 accepted");
}

int main(void) {
  log_setup("test_device", LOG_WARN);
  for (int i = 0; i < N * PIXELS; i++) pixels[i] = (uint8_t)((i * 37 + 11) % 256);
  for (int i = 0; i < N; i++) labels[i] = (uint8_t)((i * 7) % 4);
  test_kind();
  test_cpu_matches_model();
  test_cuda_and_auto();
  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  return failures ? 1 : 0;
}
