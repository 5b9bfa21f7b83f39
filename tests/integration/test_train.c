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
  CHECK(harness_train(2, 2, server_args, worker_args, out, 120000) == 0, "training failed");
  FILE *f = fopen(out, "r");
  CHECK(f, "no rank 0 output");
  char line[256] = "";
  double acc = -1, wall = 0, sps = 0;
  int epochs = 0;
  while (fgets(line, sizeof(line), f))
    if (sscanf(line, "summary accuracy=%lf epochs=%d wall_s=%lf samples_per_s=%lf", &acc, &epochs,
               &wall, &sps) == 4)
      break;
  fclose(f);
  CHECK(epochs == 1, "no summary line from rank 0");
  printf("1 epoch, S=2 W=2: accuracy %.4f, %.0f samples/s\n", acc, sps);
  CHECK(acc >= 0.80, "accuracy %.4f below 0.80", acc);
  return 0;
}
