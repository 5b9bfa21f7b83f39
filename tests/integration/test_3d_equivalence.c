/* A 3D job (tensor x pipeline x data parallelism) trains the parameters of
 * one worker (issue 32, Deliver 5).
 *
 * Each layout runs 20 steps of real ps-worker processes (seed 5, batch B per
 * data-parallel replica cut into M micro-batches, plain SGD at lr 0.1) and
 * dumps the assembled model; the reference is ONE worker (t = p = 1) on the
 * same global batch B*D with M*D micro-batches accumulated through the same
 * 3D code path, and one worker on the plain path (no micro-batches). Every
 * tensor must agree within 1e-5 relative L2. GPipe and 1F1B accumulate the
 * micro-batches in the same order: their dumps must be bit-identical.
 *
 * Default suite (4 ranks): t=2 p=2 d=1 in allreduce mode with 1F1B and
 * GPipe, and in ps mode (2 shards, owners per slice) with 1F1B; interleaved
 * (2 chunks) and ZB-H1 on a 4-layer model; t=1 p=2 d=2 and t=2 p=1 d=2;
 * ZeRO-1 (--shard-optimizer-state, momentum 0.9) on t=2 p=1 d=2 and on
 * t=1 p=1 d=3 (M=2: chunks padded), see check_zero1.
 * With -Dslow_tests=true (PS_SLOW_TESTS=1): every W=8 layout, t, p, d in
 * {1, 2}, in both modes, and ZeRO-1 on each allreduce layout with d = 2. */
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "harness.h"
#include "ring_workers.h"

#define STEPS "20"
#define MODEL2 "mlp:784-64-10"       /* two layers: one per stage with p = 2 */
#define MODEL4 "mlp:784-64-32-32-10" /* four: two chunks of two stages */

static int nseq;

/* Per-tensor sizes of an mlp spec, in dump order (weight, bias per layer). */
static int tensor_sizes(const char *model, size_t *sz) {
  int sizes[16], n = 0;
  const char *p = model + 4;
  while (*p) {
    sizes[n++] = (int)strtol(p, (char **)&p, 10);
    if (*p == '-') p++;
  }
  int k = 0;
  for (int l = 0; l + 1 < n; l++) {
    sz[k++] = (size_t)sizes[l] * (size_t)sizes[l + 1];
    sz[k++] = (size_t)sizes[l + 1];
  }
  return k;
}

/* A file whole, NUL-terminated; *bytes: its length. */
static char *slurp(const char *path, size_t *bytes) {
  FILE *f = fopen(path, "rb");
  REQUIRE(f, "missing %s", path);
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *v = malloc((size_t)len + 1);
  REQUIRE(v && fread(v, 1, (size_t)len, f) == (size_t)len, "cannot read %s", path);
  fclose(f);
  v[len] = '\0';
  *bytes = (size_t)len;
  return v;
}

static float *load(const char *path, size_t *n) {
  float *v = (float *)slurp(path, n);
  *n /= sizeof(float);
  return v;
}

/* Worst per-tensor relative L2 difference of two dumps of model; *same:
 * bit-identical. */
static double compare(const char *model, const char *a, const char *b, bool *same) {
  size_t sz[32], na, nb;
  int nt = tensor_sizes(model, sz);
  float *x = load(a, &na), *y = load(b, &nb);
  REQUIRE(na == nb, "%s has %zu floats, %s %zu", a, na, b, nb);
  *same = memcmp(x, y, na * sizeof(float)) == 0;
  double worst = 0;
  size_t off = 0;
  for (int t = 0; t < nt; t++) {
    double d2 = 0, r2 = 0;
    for (size_t i = off; i < off + sz[t]; i++) {
      double d = (double)x[i] - y[i];
      d2 += d * d;
      r2 += (double)y[i] * y[i];
    }
    double rel = sqrt(d2 / (r2 > 0 ? r2 : 1e-30));
    if (rel > worst) worst = rel;
    off += sz[t];
  }
  REQUIRE(off == na, "%s: %zu floats, the model has %zu", a, na, off);
  free(x);
  free(y);
  return worst;
}

struct layout {
  const char *mode; /* "allreduce" or "ps" */
  int t, p, d, m;   /* m: micro-batches per replica */
  const char *schedule, *model;
  int batch;            /* per replica */
  const char *momentum; /* NULL: 0 */
  bool shard;           /* --shard-optimizer-state (ZeRO-1 over the data-parallel group) */
};

/* The largest optimizer_state_floats=N of the ranks' start lines. */
static size_t state_floats(const struct ring_workers *rw) {
  size_t most = 0;
  for (int r = 0; r < rw->world; r++) {
    size_t n;
    char *text = slurp(rw->log[r], &n), *at;
    REQUIRE(at = strstr(text, "optimizer_state_floats="), "%s: no optimizer_state_floats",
            rw->log[r]);
    size_t v = strtoull(at + strlen("optimizer_state_floats="), NULL, 10);
    if (v > most) most = v;
    free(text);
  }
  return most;
}

/* Runs one layout (or the one-worker reference: t = p = d = 1) and writes its
 * dump to path; *state (may be NULL): the most optimizer state of a rank. */
static void run(const struct layout *l, const char *path, size_t *state) {
  char t[8], p[8], m[8], b[8];
  snprintf(t, sizeof(t), "%d", l->t);
  snprintf(p, sizeof(p), "%d", l->p);
  snprintf(m, sizeof(m), "%d", l->m);
  snprintf(b, sizeof(b), "%d", l->batch);
  int w = l->t * l->p * l->d;
  const char *args[40] = {"--epochs",
                          "1",
                          "--max-steps",
                          STEPS,
                          "--seed",
                          "5",
                          "--batch-size",
                          b,
                          "--model",
                          l->model,
                          "--tensor-parallel",
                          t,
                          "--pipeline-stages",
                          p,
                          "--micro-batches",
                          m,
                          "--pipeline-schedule",
                          l->schedule,
                          "--dump-params",
                          path,
                          "--lr",
                          "0.1",
                          "--momentum",
                          l->momentum ? l->momentum : "0",
                          "--log-every",
                          "5",
                          "--shard-optimizer-state",
                          l->shard ? "true" : "false"};
  int n = 28;
  struct test_server s[2];
  char servers[160];
  if (!strcmp(l->mode, "ps")) {
    char ws[8];
    snprintf(ws, sizeof(ws), "%d", w);
    const char *sargs[] = {"--optimizer", "sgd", NULL};
    for (int i = 0; i < 2; i++) harness_start_server(&s[i], i, 2, w, 0.1, sargs);
    snprintf(servers, sizeof(servers), "%s,%s", s[0].addr, s[1].addr);
    const char *more[] = {"--sync-mode", "ps", "--servers", servers};
    for (int i = 0; i < 4; i++) args[n++] = more[i];
  }
  args[n] = NULL;
  struct ring_workers rw;
  char out0[600];
  snprintf(out0, sizeof(out0), "%s.out", path); /* rank 0's summary line */
  ring_workers_start(&rw, w, args, out0);
  REQUIRE(ring_workers_wait(&rw, 180000) == 0, "%s t=%d p=%d d=%d %s: a rank failed", l->mode, l->t,
          l->p, l->d, l->schedule);
  if (state) *state = state_floats(&rw);
  if (!strcmp(l->mode, "ps"))
    for (int i = 0; i < 2; i++) harness_stop(s[i].pid, SIGTERM, 10000);
}

/* The layout against its one-worker references; returns its dump path and
 * (state, may be NULL) the most optimizer state of one of its ranks. */
static void check(const struct layout *l, char *dump, size_t len, size_t *state) {
  char ref3d[512], plain[512];
  snprintf(dump, len, "%s/3d-%d.bin", harness_dir(), ++nseq);
  snprintf(ref3d, sizeof(ref3d), "%s/ref3d-%d.bin", harness_dir(), nseq);
  snprintf(plain, sizeof(plain), "%s/plain-%d.bin", harness_dir(), nseq);
  run(l, dump, state);
  struct layout one = {"allreduce",     1,           1,    1, l->m * l->d, "1f1b", l->model,
                       l->batch * l->d, l->momentum, false};
  run(&one, ref3d, NULL);
  struct layout flat = one;
  flat.m = 1;
  run(&flat, plain, NULL);
  bool same;
  double rel3d = compare(l->model, dump, ref3d, &same);
  double relplain = compare(l->model, dump, plain, &same);
  printf(
      "%-9s t=%d p=%d d=%d M=%d %-11s %s%s: relative L2 (worst tensor) vs one worker with %d "
      "micro-batches %.3g, vs the plain path %.3g\n",
      l->mode, l->t, l->p, l->d, l->m, l->schedule, l->model, l->shard ? " zero-1" : "",
      l->m * l->d, rel3d, relplain);
  REQUIRE(rel3d < 1e-5, "%s t=%d p=%d d=%d %s: differs from one worker by %.3g", l->mode, l->t,
          l->p, l->d, l->schedule, rel3d);
  REQUIRE(relplain < 1e-5, "%s t=%d p=%d d=%d %s: differs from the plain path by %.3g", l->mode,
          l->t, l->p, l->d, l->schedule, relplain);
}

/* ZeRO-1 (--shard-optimizer-state) on layout l with momentum 0.9: within
 * 1e-5 of one worker like every layout; each rank's optimizer state 1/D of
 * the non-sharded run's, to the chunks' padding (at most 15 floats per
 * tensor); against the non-sharded run of the same layout, bit for bit with
 * D = 2 (both compute (a + b) / 2, then the same update per element),
 * within 1e-6 beyond (the ring may sum D terms in another order). */
static void check_zero1(struct layout l) {
  char zero[512], whole[512];
  size_t part, full, sz[32];
  int nt = tensor_sizes(l.model, sz);
  l.momentum = "0.9";
  l.shard = true;
  check(&l, zero, sizeof(zero), &part);
  snprintf(whole, sizeof(whole), "%s/whole-%d.bin", harness_dir(), nseq);
  l.shard = false;
  run(&l, whole, &full);
  bool same;
  double rel = compare(l.model, zero, whole, &same);
  printf(
      "allreduce t=%d p=%d d=%d zero-1: %s the non-sharded run (relative L2 %.3g); optimizer "
      "state per rank %zu floats sharded, %zu not (%.3f)\n",
      l.t, l.p, l.d, same ? "bit-identical to" : "differs from", rel, part, full,
      full ? (double)part / (double)full : 0.0);
  REQUIRE(l.d != 2 || same, "t=%d p=%d d=2 zero-1: differs from the non-sharded run by %.3g", l.t,
          l.p, rel);
  REQUIRE(rel < 1e-6, "t=%d p=%d d=%d zero-1: differs from the non-sharded run by %.3g", l.t, l.p,
          l.d, rel);
  REQUIRE(full > 0 && part * (size_t)l.d >= full && part <= full / (size_t)l.d + 16 * (size_t)nt,
          "t=%d p=%d d=%d zero-1: optimizer state %zu floats per rank, %zu without it", l.t, l.p,
          l.d, part, full);
}

int main(void) {
  harness_require_dataset();
  char d1f1b[512], dgpipe[512], other[512];
  struct layout l = {"allreduce", 2, 2, 1, 4, "1f1b", MODEL2, 32, NULL, false};
  check(&l, d1f1b, sizeof(d1f1b), NULL);
  l.schedule = "gpipe";
  check(&l, dgpipe, sizeof(dgpipe), NULL);
  bool same;
  compare(MODEL2, d1f1b, dgpipe, &same);
  REQUIRE(same, "GPipe and 1F1B dumps differ (they must be bit-identical)");
  printf("allreduce t=2 p=2: GPipe and 1F1B dumps are bit-identical\n");
  struct layout ps = {"ps", 2, 2, 1, 4, "1f1b", MODEL2, 32, NULL, false};
  check(&ps, other, sizeof(other), NULL);
  struct layout inter = {"allreduce", 2, 2, 1, 4, "interleaved", MODEL4, 32, NULL, false};
  check(&inter, other, sizeof(other), NULL);
  struct layout zb = {"allreduce", 2, 2, 1, 4, "zb-h1", MODEL4, 32, NULL, false};
  check(&zb, other, sizeof(other), NULL);
  struct layout pd = {"allreduce", 1, 2, 2, 2, "1f1b", MODEL2, 32, NULL, false};
  check(&pd, other, sizeof(other), NULL);
  struct layout td = {"allreduce", 2, 1, 2, 2, "1f1b", MODEL2, 32, NULL, false};
  check(&td, other, sizeof(other), NULL);
  struct layout tdz = {"allreduce", 2, 1, 2, 2, "1f1b", MODEL2, 32, NULL, false};
  check_zero1(tdz);
  struct layout dz = {"allreduce", 1, 1, 3, 2, "1f1b", MODEL2, 32, NULL, false}; /* padded chunks */
  check_zero1(dz);
  const char *slow = getenv("PS_SLOW_TESTS");
  if (!slow || strcmp(slow, "1")) {
    printf("W=8 layouts: under -Dslow_tests=true\n");
    return 0;
  }
  static const char *const modes[] = {"allreduce", "ps"};
  for (int k = 0; k < 2; k++)
    for (int t = 1; t <= 2; t++)
      for (int p = 1; p <= 2; p++)
        for (int d = 1; d <= 2; d++) {
          if (t * p * d == 1) continue;
          struct layout x = {modes[k], t, p, d, 2, "1f1b", MODEL2, 32, NULL, false};
          check(&x, other, sizeof(other), NULL);
          if (k == 0 && d == 2) check_zero1(x);
        }
  return 0;
}
