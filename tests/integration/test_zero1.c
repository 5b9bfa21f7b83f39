/* ps-worker --shard-optimizer-state (ZeRO-1) against the plain all-reduce:
 * the same 20 steps (momentum 0.9, cosine-annealed lr, seed 5, batch 32 per
 * worker) through a ring of real ps-worker processes, once each way; rank 0
 * dumps the final parameters. W=2: equal bit for bit (both sum a + b, then
 * the same update per element). W=3 and W=4: the W-term sums may run in
 * another order, so within 1e-6 relative (L2). Each rank's optimizer state
 * (its log line's optimizer_state_bytes) is 1/W of the plain run's, to the
 * padding of the chunks. And the option is refused, naming why, in ps mode,
 * with the NCCL backend and with worker checkpoints. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "harness.h"
#include "ring_workers.h"

static unsigned char *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  REQUIRE(f, "missing %s", path);
  fseek(f, 0, SEEK_END);
  *n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc(*n + 1);
  REQUIRE(b && fread(b, 1, *n, f) == *n, "read %s", path);
  b[*n] = 0;
  fclose(f);
  return b;
}

/* optimizer_state_bytes=N of a worker's "training" line */
static size_t state_bytes(const char *log) {
  size_t n;
  char *text = (char *)slurp(log, &n);
  const char *p = strstr(text, "optimizer_state_bytes=");
  REQUIRE(p, "%s has no optimizer_state_bytes", log);
  size_t v = strtoull(p + strlen("optimizer_state_bytes="), NULL, 10);
  free(text);
  return v;
}

/* Trains W ranks; rank 0 dumps into dump; *bytes is rank 0's state. */
static void train(int world, bool sharded, const char *dump, size_t *bytes) {
  const char *args[] = {"--epochs",
                        "1",
                        "--batch-size",
                        "32",
                        "--max-steps",
                        "20",
                        "--seed",
                        "5",
                        "--lr",
                        "0.1",
                        "--momentum",
                        "0.9",
                        "--lr-decay-steps",
                        "20",
                        "--dump-params",
                        dump,
                        "--shard-optimizer-state",
                        sharded ? "true" : "false",
                        NULL};
  struct ring_workers rw;
  ring_workers_start(&rw, world, args, NULL);
  REQUIRE(ring_workers_wait(&rw, 120000) == 0, "W=%d%s: training failed", world,
          sharded ? " sharded" : "");
  *bytes = state_bytes(rw.log[0]);
}

static void one_case(int world) {
  char plain[512], sharded[512];
  snprintf(plain, sizeof(plain), "%s/w%d-plain.bin", harness_dir(), world);
  snprintf(sharded, sizeof(sharded), "%s/w%d-sharded.bin", harness_dir(), world);
  size_t full, part, na, nb;
  train(world, false, plain, &full);
  train(world, true, sharded, &part);
  unsigned char *a = slurp(plain, &na), *b = slurp(sharded, &nb);
  REQUIRE(na == nb && na > 0 && na % 4 == 0, "dumps of %zu and %zu bytes", na, nb);
  const float *x = (const float *)a, *y = (const float *)b;
  double diff2 = 0, ref2 = 0;
  size_t differ = 0;
  for (size_t i = 0; i < na / 4; i++) {
    double d = (double)x[i] - y[i];
    diff2 += d * d;
    ref2 += (double)x[i] * x[i];
    differ += x[i] != y[i];
  }
  double rel = sqrt(diff2 / ref2);
  if (world == 2)
    REQUIRE(differ == 0, "W=2: %zu of %zu parameters differ (relative L2 %.3g)", differ, na / 4,
            rel);
  REQUIRE(rel < 1e-6, "W=%d: relative L2 difference %.3g", world, rel);
  /* 1/W of the velocity, plus at most 16 floats of padding per bucket and rank */
  REQUIRE(part * (size_t)world >= full && part <= full / (size_t)world + 64 * 16 * 4,
          "W=%d: optimizer state %zu bytes per rank sharded, %zu plain", world, part, full);
  printf(
      "W=%d: %zu parameters after 20 steps, %zu differ, relative L2 %.3g; optimizer state "
      "per rank %zu bytes sharded, %zu plain (%.2fx)\n",
      world, na / 4, differ, rel, part, full, (double)full / (double)part);
  free(a);
  free(b);
}

static void refused(const char *what, const char *const *extra, const char *needle) {
  char bin[512], log[512];
  harness_bin("ps-worker/ps-worker", bin, sizeof(bin));
  snprintf(log, sizeof(log), "%s/refused-%s.log", harness_dir(), what);
  const char *argv[24] = {bin, "--shard-optimizer-state", "true"};
  int n = 3;
  for (int i = 0; extra[i]; i++) argv[n++] = extra[i];
  argv[n] = NULL;
  int st = harness_wait(harness_spawn(argv, NULL, log), 20000);
  REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 2, "%s: exit status %d, expected 2", what,
          st);
  REQUIRE(harness_grep(log, needle) > 0, "%s: the message does not say \"%s\"", what, needle);
  printf("refused %s: says \"%s\"\n", what, needle);
}

int main(void) {
  harness_require_dataset();
  for (int world = 2; world <= 4; world++) one_case(world);
  refused("in ps mode", (const char *[]){"--sync-mode", "ps", "--servers", "127.0.0.1:1", NULL},
          "allreduce only");
  refused("with nccl",
          (const char *[]){"--sync-mode", "allreduce", "--allreduce-backend", "nccl", "--peers",
                           "127.0.0.1:1", NULL},
          "not with --allreduce-backend nccl");
  refused("with checkpoints",
          (const char *[]){"--sync-mode", "allreduce", "--checkpoint-dir", "/tmp", "--peers",
                           "127.0.0.1:1", NULL},
          "not with --checkpoint-dir");
  return harness_status();
}
