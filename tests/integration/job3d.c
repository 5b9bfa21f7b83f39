/* job3d: see job3d.h. */
#include "job3d.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

void job3d_start_ps(struct ring_workers *rw, const char *servers, const char *steps,
                    const char *dump) {
  const char *args[] = {"--sync-mode",
                        "ps",
                        "--servers",
                        servers,
                        "--epochs",
                        "1",
                        "--max-steps",
                        steps,
                        "--seed",
                        "7",
                        "--batch-size",
                        "32",
                        "--model",
                        "mlp:784-64-10",
                        "--tensor-parallel",
                        "2",
                        "--pipeline-stages",
                        "2",
                        "--micro-batches",
                        "4",
                        "--log-every",
                        "10",
                        "--peer-timeout-ms",
                        "1500",
                        "--dump-params",
                        dump,
                        NULL};
  ring_workers_start(rw, 4, args, NULL);
}

double job3d_dump_diff(const char *a, const char *b, bool *same) {
  FILE *f = fopen(a, "rb"), *g = fopen(b, "rb");
  REQUIRE(f && g, "missing dump %s or %s", a, b);
  double worst = 0, scale = 0;
  size_t n = 0;
  float x, y;
  *same = true;
  while (fread(&x, sizeof(x), 1, f) == 1) {
    REQUIRE(fread(&y, sizeof(y), 1, g) == 1, "%s is longer than %s", a, b);
    *same = *same && memcmp(&x, &y, sizeof(x)) == 0;
    if (fabs((double)x - y) > worst) worst = fabs((double)x - y);
    if (fabs((double)y) > scale) scale = fabs((double)y);
    n++;
  }
  REQUIRE(n > 0 && fread(&y, sizeof(y), 1, g) == 0, "%s and %s differ in length", a, b);
  fclose(f);
  fclose(g);
  return scale > 0 ? worst / scale : worst;
}

long job3d_logged(const char *log, const char *msg, const char *key) {
  FILE *f = fopen(log, "r");
  char line[4096];
  long best = -1;
  while (f && fgets(line, sizeof(line), f)) {
    const char *at = strstr(line, msg);
    const char *v = at ? strstr(at, key) : NULL;
    if (v && strtol(v + strlen(key), NULL, 10) > best) best = strtol(v + strlen(key), NULL, 10);
  }
  if (f) fclose(f);
  return best;
}

long job3d_resumed_step(const struct ring_workers *rw) {
  long at = job3d_logged(rw->log[0], "resumed at the shards' step", " step=");
  for (int r = 1; r < 4; r++)
    REQUIRE(job3d_logged(rw->log[r], "resumed at the shards' step", " step=") == at,
            "rank %d resumed elsewhere than rank 0 (step %ld)", r, at);
  return at;
}
