/* The main job end to end: 2 real shards and 2 real ps-worker processes train
 * one epoch of Fashion-MNIST with the defaults; rank 0's test accuracy must
 * reach 0.80, and every process must exit 0 (the shards by the end-of-
 * training shutdown, not by a signal). */
#include <stdio.h>
#include <string.h>

#include "harness.h"

int main(void) {
  char out[512];
  snprintf(out, sizeof(out), "%s/rank0.out", harness_dir());
  const char *server_args[] = {"--optimizer", "momentum", "--lr", "0.1", "--momentum", "0.9", NULL};
  const char *worker_args[] = {"--epochs", "1", "--batch-size", "128", "--chunk-bytes",
                               "512KiB",   NULL};
  REQUIRE(harness_train(2, 2, server_args, worker_args, out, 120000) == 0, "training failed");
  struct harness_summary sum;
  REQUIRE(harness_read_summary(out, &sum) == 0, "no summary line from rank 0 in %s", out);
  REQUIRE(sum.epochs == 1, "rank 0 trained %d epochs, not 1", sum.epochs);
  printf("1 epoch, S=2 W=2: accuracy %.4f, %.0f samples/s\n", sum.accuracy, sum.samples_per_s);
  REQUIRE(sum.accuracy >= 0.80, "accuracy %.4f below 0.80", sum.accuracy);
  return 0;
}
