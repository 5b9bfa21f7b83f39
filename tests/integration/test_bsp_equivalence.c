/* BSP with W workers equals single-process SGD on the W-times-larger batch.
 *
 * Two shards (plain SGD) and two ps-worker processes with batch 32 each run
 * 25 steps and dump the final parameters; this test replays the same 25 steps
 * in one process with the same initial weights and data order on batch 64
 * (data.h's sharding convention makes the two global batches identical) and
 * compares every parameter. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "data.h"
#include "harness.h"
#include "model.h"

#define STEPS 25
#define B 32
#define W 2

int main(void) {
  char dump[512];
  snprintf(dump, sizeof(dump), "%s/params.bin", harness_dir());
  const char *server_args[] = {"--optimizer", "sgd", "--lr", "0.1", NULL};
  const char *worker_args[] = {"--epochs", "1", "--batch-size",  "32", "--max-steps",   "25",
                               "--seed",   "5", "--dump-params", dump, "--chunk-bytes", "64KiB",
                               NULL};
  REQUIRE(harness_train(2, W, server_args, worker_args, NULL, 120000) == 0, "training failed");

  struct dataset ds;
  char err[512];
  REQUIRE(dataset_load(HARNESS_DATA_DIR, "train", &ds, err, sizeof(err)) == 0, "%s", err);
  int sizes[] = {784, 256, 10};
  struct mlp *m = mlp_new(sizes, 3, B * W);
  mlp_init_params(m, 5);
  uint32_t *perm = malloc(ds.n * sizeof(uint32_t));
  float *x = malloc((size_t)B * W * 784 * sizeof(float));
  uint8_t y[B * W];
  dataset_epoch_order(5, 0, ds.n, perm);
  for (int t = 0; t < STEPS; t++) {
    dataset_gather(&ds, perm + (size_t)t * B * W, B * W, x, y);
    mlp_forward_backward(m, x, y, B * W, NULL, NULL);
    mlp_sgd_step(m, 0.1f);
  }
  FILE *f = fopen(dump, "rb");
  REQUIRE(f, "no parameter dump");
  double diff2 = 0, ref2 = 0, maxrel = 0;
  size_t n = 0;
  for (int t = 0; t < mlp_num_tensors(m); t++) {
    size_t cnt = mlp_tensor_count(m, t);
    float *got = malloc(cnt * sizeof(float));
    REQUIRE(fread(got, sizeof(float), cnt, f) == cnt, "dump too short at tensor %d", t);
    const float *ref = mlp_param(m, t);
    for (size_t i = 0; i < cnt; i++) {
      double d = (double)got[i] - ref[i];
      diff2 += d * d;
      ref2 += (double)ref[i] * ref[i];
      double rel = fabs(d) / fmax(fabs(ref[i]), 1e-3);
      if (rel > maxrel) maxrel = rel;
    }
    n += cnt;
    free(got);
  }
  fclose(f);
  double rel_l2 = sqrt(diff2 / ref2);
  printf("%zu parameters after %d steps: relative L2 difference %.3g, max element %.3g\n", n, STEPS,
         rel_l2, maxrel);
  REQUIRE(rel_l2 < 1e-5, "BSP differs from single-process SGD: relative L2 %.3g", rel_l2);
  REQUIRE(maxrel < 1e-4, "an element differs by %.3g relative", maxrel);
  free(perm);
  free(x);
  mlp_free(m);
  dataset_free(&ds);
  return 0;
}
