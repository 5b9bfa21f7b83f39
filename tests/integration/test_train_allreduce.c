/* The switch end to end: two ps-worker processes in --sync-mode allreduce
 * (ring over TCP, local SGD with momentum, no servers) train one epoch of
 * Fashion-MNIST with ps-local's defaults; rank 0's test accuracy must reach 0.80
 * and both must exit 0. Then the same switch from its two other sources, the
 * environment (PS_SYNC_MODE) and a --config file, on a single worker for a
 * few steps, and a bad value refused with exit 2 and the option named. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "harness.h"
#include "ring_workers.h"

int main(void) {
  harness_require_dataset();
  char out[512];
  snprintf(out, sizeof(out), "%s/rank0.out", harness_dir());
  /* ps-local's defaults: batch 256 per worker, lr 0.2 annealed over the
   * epoch's 117 steps, momentum 0.9 (PS mode reaches 0.8291 with them) */
  const char *args[] = {"--epochs", "1", "--batch-size", "256", "--lr", "0.2", "--lr-decay-steps",
                        "117",      NULL};
  struct ring_workers rw;
  ring_workers_start(&rw, 2, args, out);
  REQUIRE(ring_workers_wait(&rw, 120000) == 0, "allreduce training failed");
  struct harness_summary sum;
  REQUIRE(harness_read_summary(out, &sum) == 0, "no summary line from rank 0 in %s", out);
  REQUIRE(sum.epochs == 1, "rank 0 trained %d epochs, not 1", sum.epochs);
  printf("1 epoch, allreduce W=2: accuracy %.4f, %.0f samples/s\n", sum.accuracy,
         sum.samples_per_s);
  REQUIRE(sum.accuracy >= 0.80, "accuracy %.4f below 0.80", sum.accuracy);
  REQUIRE(harness_grep(rw.log[0], "sync_mode=allreduce") == 1,
          "rank 0 did not train in allreduce mode");

  char bin[512], cfg[512], log[512];
  harness_bin("ps-worker/ps-worker", bin, sizeof(bin));
  snprintf(cfg, sizeof(cfg), "%s/worker.conf", harness_dir());
  FILE *f = fopen(cfg, "w");
  REQUIRE(f, "cannot write %s", cfg);
  fprintf(f, "# the switch in a config file\nsync-mode = allreduce\n");
  fclose(f);
  for (int source = 0; source < 3; source++) {
    const char *argv[] = {bin, "--max-steps", "5", source == 1 ? "--config" : NULL, cfg, NULL};
    snprintf(log, sizeof(log), "%s/single-%d.log", harness_dir(), source);
    if (source == 0) setenv("PS_SYNC_MODE", "allreduce", 1);
    if (source == 2) setenv("PS_SYNC_MODE", "ring", 1);
    pid_t pid = harness_spawn(argv, NULL, log);
    unsetenv("PS_SYNC_MODE");
    int st = harness_wait(pid, 60000);
    if (source < 2) {
      REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "single worker (%s) failed",
              source ? "config file" : "PS_SYNC_MODE");
      REQUIRE(harness_grep(log, "sync_mode=allreduce") == 1, "the %s did not select allreduce",
              source ? "config file" : "environment");
    } else {
      REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 2, "a bad sync mode should exit 2");
      REQUIRE(harness_grep(log, "--sync-mode") > 0 && harness_grep(log, "ring") > 0,
              "the refusal should name the option and the value");
    }
  }
  printf("the switch also works from PS_SYNC_MODE and --config; a bad value exits 2\n");
  return 0;
}
