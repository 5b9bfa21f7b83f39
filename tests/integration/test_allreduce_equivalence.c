/* Allreduce mode equals BSP PS mode.
 *
 * The same 25 steps of training (seed 5, batch 32 per worker, same data order
 * by data.h's sharding convention) run twice: through 2 shards with BSP and
 * the optimizer on the shards, and through a ring of ps-worker processes with
 * the optimizer on every worker. Rank 0 dumps the final parameters of each;
 * they must agree within float tolerance. Six cases: W=2 with plain SGD,
 * W=2 with momentum 0.9 and a cosine-annealed learning rate (the shards'
 * --lr-decay-steps against the workers'), W=3 with SGD (a world size that
 * does not divide the buffers evenly and makes the mean a true division),
 * W=2 SGD again with no fusion (a bucket per tensor) and with every
 * gradient in one bucket, and W=2 momentum with the first layer's pieces
 * queued only once its whole gradient is computed (--grad-blocks false).
 * For W=2 the two modes round alike (a + b, then the same fused update as
 * torch): today they agree bit for bit, far inside the bound. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "ring_workers.h"

#define STEPS "25"

static double compare(const char *a, const char *b, double *maxrel, size_t *n) {
  FILE *fa = fopen(a, "rb"), *fb = fopen(b, "rb");
  REQUIRE(fa && fb, "missing parameter dump (%s, %s)", a, b);
  double diff2 = 0, ref2 = 0;
  float x, y;
  *maxrel = 0;
  *n = 0;
  while (fread(&x, sizeof(x), 1, fa) == 1) {
    REQUIRE(fread(&y, sizeof(y), 1, fb) == 1, "%s is shorter than %s", b, a);
    double d = (double)x - y;
    diff2 += d * d;
    ref2 += (double)x * x;
    double rel = fabs(d) / fmax(fabs(x), 1e-3);
    if (rel > *maxrel) *maxrel = rel;
    (*n)++;
  }
  REQUIRE(fread(&y, sizeof(y), 1, fb) == 0, "%s is longer than %s", b, a);
  REQUIRE(*n > 0, "empty dump");
  fclose(fa);
  fclose(fb);
  return sqrt(diff2 / ref2);
}

static void one_case(const char *name, int world, const char *momentum, const char *decay,
                     const char *fusion, const char *grad_blocks) {
  char ps_dump[512], ar_dump[512], ws[8];
  snprintf(ps_dump, sizeof(ps_dump), "%s/%s-ps.bin", harness_dir(), name);
  snprintf(ar_dump, sizeof(ar_dump), "%s/%s-allreduce.bin", harness_dir(), name);
  snprintf(ws, sizeof(ws), "%d", world);
  bool mom = strcmp(momentum, "0") != 0;
  /* harness_start_server passes --lr 0.1 */
  const char *server_args[] = {"--optimizer", mom ? "momentum" : "sgd", "--momentum",
                               momentum,      "--lr-decay-steps",       decay,
                               NULL};
  const char *common[] = {"--epochs",    "1",   "--batch-size", "32",
                          "--max-steps", STEPS, "--seed",       "5"};
  const char *ps_args[16], *ar_args[24];
  int n = 0;
  for (int i = 0; i < 8; i++) ps_args[n++] = common[i];
  ps_args[n++] = "--dump-params";
  ps_args[n++] = ps_dump;
  ps_args[n] = NULL;
  REQUIRE(harness_train(2, world, server_args, ps_args, NULL, 120000) == 0, "%s: PS run failed",
          name);
  n = 0;
  for (int i = 0; i < 8; i++) ar_args[n++] = common[i];
  const char *more[] = {"--lr", "0.1",           "--momentum", momentum, "--lr-decay-steps",
                        decay,  "--dump-params", ar_dump};
  for (int i = 0; i < 8; i++) ar_args[n++] = more[i];
  ar_args[n++] = "--fusion-bytes";
  ar_args[n++] = fusion;
  ar_args[n++] = "--grad-blocks";
  ar_args[n++] = grad_blocks;
  ar_args[n] = NULL;
  struct ring_workers rw;
  ring_workers_start(&rw, world, ar_args, NULL);
  REQUIRE(ring_workers_wait(&rw, 120000) == 0, "%s: allreduce run failed", name);
  double maxrel;
  size_t count;
  double rel_l2 = compare(ps_dump, ar_dump, &maxrel, &count);
  printf(
      "%-22s W=%d: %zu parameters after %s steps: relative L2 difference %.3g, max element %.3g\n",
      name, world, count, STEPS, rel_l2, maxrel);
  REQUIRE(rel_l2 < 1e-5, "%s: allreduce differs from BSP: relative L2 %.3g", name, rel_l2);
  REQUIRE(maxrel < 1e-4, "%s: an element differs by %.3g relative", name, maxrel);
}

int main(void) {
  harness_require_dataset();
  /* 256 KiB buckets: fc0.weight (800 KB) goes as 4 pieces, each reduced
   * while backward computes the next rows (--grad-blocks). */
  one_case("sgd", 2, "0", "0", "256KiB", "true");
  one_case("momentum+cosine", 2, "0.9", "25", "256KiB", "true");
  one_case("sgd", 3, "0", "0", "256KiB", "true");
  /* Fusion and pieces change which buffers are reduced together and when,
   * never the result. */
  one_case("sgd, no fusion", 2, "0", "0", "0", "true");
  one_case("sgd, one bucket", 2, "0", "0", "64MiB", "true");
  one_case("momentum, pieces at the end", 2, "0.9", "0", "256KiB", "false");
  return 0;
}
