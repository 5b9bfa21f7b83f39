/* Training under each consistency model and optimizer: 2 real shards and 2
 * real ps-worker processes train 3 epochs of Fashion-MNIST (model
 * mlp:784-256-10, cosine schedule over the run) and rank 0's test accuracy
 * must reach 0.85. argv[1] names the run:
 *   bsp-momentum   momentum 0.9, lr 0.1, batch 128 per worker
 *   asp-momentum   momentum 0.9, lr 0.05, batch 64
 *   ssp2-momentum  ssp:2, momentum 0.9, lr 0.05, batch 64
 *   bsp-adam       Adam, lr 0.002, batch 128
 * Asynchrony acts like extra momentum (Mitliagkas et al., "Asynchrony begets
 * momentum", 2016): ASP/SSP want a smaller step than BSP, and more of them.
 * The workers are the unchanged BSP trainer: the mode is a shard flag. */
#include <stdio.h>
#include <string.h>

#include "harness.h"

#define EPOCHS 3
#define WORKERS 2
#define TRAIN_SAMPLES 60000

int main(int argc, char **argv) {
  REQUIRE(argc == 2, "usage: test_train_modes bsp-momentum|asp-momentum|ssp2-momentum|bsp-adam");
  const char *mode = argv[1];
  static const struct {
    const char *name, *consistency, *optimizer, *lr;
    int batch;
  } runs[] = {
      {"bsp-momentum", "bsp", "momentum", "0.1", 128},
      {"asp-momentum", "asp", "momentum", "0.05", 64},
      {"ssp2-momentum", "ssp:2", "momentum", "0.05", 64},
      {"bsp-adam", "bsp", "adam", "0.002", 128},
  };
  const char *consistency = NULL, *optimizer = NULL, *lr = NULL;
  int batch = 0;
  for (size_t i = 0; i < sizeof(runs) / sizeof(runs[0]); i++) {
    if (strcmp(mode, runs[i].name) != 0) continue;
    consistency = runs[i].consistency;
    optimizer = runs[i].optimizer;
    lr = runs[i].lr;
    batch = runs[i].batch;
  }
  REQUIRE(consistency, "unknown run \"%s\"", mode);

  char decay[32], a_batch[16];
  snprintf(decay, sizeof(decay), "%d", TRAIN_SAMPLES / (batch * WORKERS) * EPOCHS);
  snprintf(a_batch, sizeof(a_batch), "%d", batch);
  char out[512];
  snprintf(out, sizeof(out), "%s/rank0.out", harness_dir());
  const char *server_args[] = {
      "--consistency", consistency,        "--optimizer", optimizer,     "--lr", lr,  "--momentum",
      "0.9",           "--lr-decay-steps", decay,         "--log-level", "warn", NULL};
  const char *worker_args[] = {"--epochs", "3", "--batch-size", a_batch, "--chunk-bytes",
                               "256KiB",   NULL};
  REQUIRE(harness_train(2, WORKERS, server_args, worker_args, out, 120000) == 0,
          "%s: training failed", mode);
  struct harness_summary sum;
  REQUIRE(harness_read_summary(out, &sum) == 0, "no summary line from rank 0 in %s", out);
  REQUIRE(sum.epochs == EPOCHS, "rank 0 trained %d epochs, not %d", sum.epochs, EPOCHS);
  printf(
      "%s (consistency %s, optimizer %s, lr %s, batch %d): accuracy %.4f after %d epochs, "
      "%.0f samples/s, %.2f s\n",
      mode, consistency, optimizer, lr, batch, sum.accuracy, sum.epochs, sum.samples_per_s,
      sum.wall_s);
  REQUIRE(sum.accuracy >= 0.85, "%s: accuracy %.4f below 0.85", mode, sum.accuracy);
  return 0;
}
