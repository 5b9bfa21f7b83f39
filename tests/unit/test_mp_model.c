/* test_mp_model: the tensor- and pipeline-parallel MLP (mp_model.h) against
 * the single-worker one (model.h).
 *
 * All ranks run in this process: the tp ranks of a run are threads joined by
 * an in-process mp_tp_comm (a barrier and a shared buffer; sums in rank order,
 * so every rank gets the same bits), and each thread runs every pipeline
 * stage of its tp rank in order (GPipe: all forwards, then all backwards).
 * The ranks' gradients are assembled into one whole model by swapping them
 * into the parameters and calling mp_stage_store_full, then compared with
 * mlp_forward_backward on the same data: bit for bit with tp = 1 and one
 * micro-batch, within 1e-5 relative L2 per tensor otherwise.
 * Exit 0 pass, 1 fail. */
#include "mp_model.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "check.h"

#define MAX_TP 4
#define MAX_PP 4
#define MAX_M 8

static uint64_t rng_state = 777;

static double rng_uniform(void) { /* [-1, 1) */
  rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
  return (double)(rng_state >> 11) * 0x1p-53 * 2.0 - 1.0;
}

/* ---- the in-process tp group ---- */

struct group {
  int tp;
  pthread_barrier_t barrier;
  const float *ptr[MAX_TP];
  float *shared;
  size_t cap;
};

struct member {
  struct group *g;
  int rank;
};

static int group_allreduce(void *ctx, float *buf, size_t n) {
  struct member *me = ctx;
  struct group *g = me->g;

  if (n > g->cap) return -EMSGSIZE;
  g->ptr[me->rank] = buf;
  pthread_barrier_wait(&g->barrier);
  if (me->rank == 0)
    for (size_t i = 0; i < n; i++) {
      float sum = g->ptr[0][i];
      for (int r = 1; r < g->tp; r++) sum += g->ptr[r][i];
      g->shared[i] = sum;
    }
  pthread_barrier_wait(&g->barrier);
  memcpy(buf, g->shared, sizeof(float) * n);
  return 0;
}

static int group_allgather(void *ctx, const float *send, float *recv, size_t n) {
  struct member *me = ctx;
  struct group *g = me->g;

  g->ptr[me->rank] = send;
  pthread_barrier_wait(&g->barrier);
  for (int r = 0; r < g->tp; r++) memcpy(recv + (size_t)r * n, g->ptr[r], sizeof(float) * n);
  pthread_barrier_wait(&g->barrier); /* nobody's send is reused before all read it */
  return 0;
}

/* ---- one run: tp threads x pp stages ---- */

struct run {
  const int *sizes;
  int num_sizes, tp, pp, chunks, m, n;
  bool zb;                /* backward_input for every micro-batch, then backward_weight */
  const struct mlp *full; /* the parameters */
  const float *x;         /* m * n samples */
  const uint8_t *y;
  /* results */
  struct mp_plan plan;
  struct mp_stage *stages[MAX_TP][MAX_PP];
  float loss[MAX_M];
  int rc;
};

struct worker {
  struct run *run;
  struct member me;
  struct group *g;
};

static void *worker_main(void *arg) {
  struct worker *wk = arg;
  struct run *r = wk->run;
  const struct mp_plan *p = &r->plan;
  int t = wk->me.rank, V = p->vstages, in0 = r->sizes[0], widest = 0, rc = 0;
  struct mp_tp_comm comm = {&wk->me, group_allreduce, group_allgather};
  float *act[MAX_M][2 * MAX_PP + 1], *grad[MAX_M][2 * MAX_PP + 1];

  for (int i = 0; i < r->num_sizes; i++)
    if (r->sizes[i] > widest) widest = r->sizes[i];
  for (int j = 0; j < r->m; j++)
    for (int k = 0; k <= V; k++) {
      act[j][k] = calloc((size_t)r->n * (size_t)widest, sizeof(float));
      grad[j][k] = calloc((size_t)r->n * (size_t)widest, sizeof(float));
    }
  for (int s = 0; s < r->pp; s++) {
    r->stages[t][s] = mp_stage_new(p, s, t, r->n, r->m, &comm);
    if (r->stages[t][s] == NULL || mp_stage_load_full(r->stages[t][s], r->full) != 0) rc = -ENOMEM;
  }
  for (int j = 0; j < r->m && rc == 0; j++)
    for (int k = 0; k < V && rc == 0; k++) {
      struct mp_stage *st = r->stages[t][k % r->pp];
      const float *in = k == 0 ? r->x + (size_t)j * (size_t)r->n * (size_t)in0 : act[j][k];
      rc = mp_stage_forward(st, k / r->pp, j, r->n, in, act[j][k + 1],
                            r->y + (size_t)j * (size_t)r->n, &r->loss[j]);
    }
  for (int j = 0; j < r->m && rc == 0; j++)
    for (int k = V - 1; k >= 0 && rc == 0; k--) {
      struct mp_stage *st = r->stages[t][k % r->pp];
      const float *go = k == V - 1 ? NULL : grad[j][k + 1];
      float *gi = k == 0 ? NULL : grad[j][k];
      rc = r->zb ? mp_stage_backward_input(st, k / r->pp, j, r->m, go, gi)
                 : mp_stage_backward(st, k / r->pp, j, r->m, go, gi);
    }
  for (int j = 0; j < r->m && rc == 0 && r->zb; j++)
    for (int k = V - 1; k >= 0 && rc == 0; k--)
      rc = mp_stage_backward_weight(r->stages[t][k % r->pp], k / r->pp, j);
  for (int j = 0; j < r->m; j++)
    for (int k = 0; k <= V; k++) {
      free(act[j][k]);
      free(grad[j][k]);
    }
  if (rc != 0) r->rc = rc;
  return NULL;
}

static void swap_grads(struct mp_stage *st) {
  for (int i = 0; i < mp_stage_num_tensors(st); i++) {
    float *a = mp_stage_param(st, i), *b = mp_stage_grad(st, i);
    for (size_t k = 0; k < mp_stage_tensor_count(st, i); k++) {
      float v = a[k];
      a[k] = b[k];
      b[k] = v;
    }
  }
}

/* The ranks' gradients as one whole model (grads in its parameters): each
 * rank's swapped into its parameters, stored, swapped back. */
static void assemble_grads(struct run *r, struct mlp *out) {
  for (int t = 0; t < r->tp; t++)
    for (int s = 0; s < r->pp; s++) {
      swap_grads(r->stages[t][s]);
      CHECK(mp_stage_store_full(r->stages[t][s], out) == 0);
      swap_grads(r->stages[t][s]);
    }
}

static int run_start(struct run *r) {
  struct group g = {.tp = r->tp};
  struct worker wk[MAX_TP];
  pthread_t th[MAX_TP];
  char err[256];
  int rc = mp_plan_new(r->sizes, r->num_sizes, r->tp, r->pp, r->chunks, &r->plan, err, sizeof(err));

  if (rc != 0) {
    fprintf(stderr, "plan: %s\n", err);
    return rc;
  }
  g.cap = (size_t)r->n * 65536;
  g.shared = calloc(g.cap, sizeof(float));
  pthread_barrier_init(&g.barrier, NULL, (unsigned)r->tp);
  r->rc = 0;
  for (int t = 0; t < r->tp; t++) {
    wk[t] = (struct worker){r, {&g, t}, &g};
    pthread_create(&th[t], NULL, worker_main, &wk[t]);
  }
  for (int t = 0; t < r->tp; t++) pthread_join(th[t], NULL);
  pthread_barrier_destroy(&g.barrier);
  free(g.shared);
  return r->rc;
}

static void run_free(struct run *r) {
  for (int t = 0; t < r->tp; t++)
    for (int s = 0; s < r->pp; s++) {
      mp_stage_free(r->stages[t][s]);
      r->stages[t][s] = NULL;
    }
}

/* ---- data and comparisons ---- */

static const int sizes5[] = {20, 16, 12, 8, 16, 8}; /* 5 layers, outputs divisible by 4 */

struct fixture {
  struct mlp *full, *ref, *got;
  float *x;
  uint8_t *y;
};

static void fixture_new(struct fixture *f, const int *sizes, int ns, int samples) {
  f->full = mlp_new(sizes, ns, samples);
  f->ref = mlp_new(sizes, ns, samples);
  f->got = mlp_new(sizes, ns, samples);
  mlp_init_params(f->full, 42);
  mlp_init_params(f->ref, 42);
  f->x = malloc(sizeof(float) * (size_t)samples * (size_t)sizes[0]);
  f->y = malloc((size_t)samples);
  for (size_t i = 0; i < (size_t)samples * (size_t)sizes[0]; i++) f->x[i] = (float)rng_uniform();
  for (int i = 0; i < samples; i++)
    f->y[i] = (uint8_t)((rng_uniform() + 1.0) * 0.5 * sizes[ns - 1]) % sizes[ns - 1];
}

static struct run run_cfg(const struct fixture *f, int tp, int pp, int chunks, int m, int n,
                          bool zb) {
  return (struct run){.sizes = sizes5,
                      .num_sizes = 6,
                      .tp = tp,
                      .pp = pp,
                      .chunks = chunks,
                      .m = m,
                      .n = n,
                      .zb = zb,
                      .full = f->full,
                      .x = f->x,
                      .y = f->y};
}

static void fixture_free(struct fixture *f) {
  mlp_free(f->full);
  mlp_free(f->ref);
  mlp_free(f->got);
  free(f->x);
  free(f->y);
}

/* Worst relative L2 error over the tensors of got against want's grads. */
static double worst_rel(struct mlp *got, struct mlp *want, const char *what) {
  double worst = 0.0;

  for (int i = 0; i < mlp_num_tensors(want); i++) {
    const float *a = mlp_param(got, i), *b = mlp_grad(want, i);
    double num = 0.0, den = 0.0, rel;
    for (size_t k = 0; k < mlp_tensor_count(want, i); k++) {
      num += ((double)a[k] - b[k]) * ((double)a[k] - b[k]);
      den += (double)b[k] * b[k];
    }
    rel = sqrt(num) / (sqrt(den) + 1e-30);
    if (rel > worst) worst = rel;
    if (rel > 1e-5)
      fprintf(stderr, "%s: %s relative L2 %.3g\n", what, mlp_tensor_name(want, i), rel);
  }
  return worst;
}

static bool bit_identical(struct mlp *got, struct mlp *want) {
  for (int i = 0; i < mlp_num_tensors(want); i++)
    if (memcmp(mlp_param(got, i), mlp_grad(want, i), sizeof(float) * mlp_tensor_count(want, i)))
      return false;
  return true;
}

/* ---- the plan ---- */

static void test_plan(void) {
  static const int big[] = {784, 256, 256, 256, 10}, small[] = {784, 256, 10};
  struct mp_plan p;
  char err[256];
  int rc;

  /* Layer costs (in x out): 200704, 65536, 65536, 2560. Over 2 stages the
   * min-max split is {fc0} {fc1 fc2 fc3} (max 200704; by layer count {fc0
   * fc1} {fc2 fc3} would cost 266240). Over 3 stages both {fc0} {fc1} {fc2
   * fc3} and {fc0} {fc1 fc2} {fc3} reach 200704: the more even one (least
   * sum of squares) wins. Over 4, one layer each. */
  rc = mp_plan_new(big, 5, 1, 2, 1, &p, err, sizeof(err));
  CHECK(rc == 0 && p.vstages == 2 && p.first_layer[0] == 0 && p.first_layer[1] == 1 &&
            p.first_layer[2] == 4,
        "pp 2: rc %d split %d %d %d", rc, p.first_layer[0], p.first_layer[1], p.first_layer[2]);
  rc = mp_plan_new(big, 5, 1, 3, 1, &p, err, sizeof(err));
  CHECK(rc == 0 && p.first_layer[1] == 1 && p.first_layer[2] == 2 && p.first_layer[3] == 4,
        "pp 3: rc %d split %d %d", rc, p.first_layer[1], p.first_layer[2]);
  rc = mp_plan_new(big, 5, 1, 4, 1, &p, err, sizeof(err));
  CHECK(rc == 0 && p.first_layer[1] == 1 && p.first_layer[2] == 2 && p.first_layer[3] == 3 &&
            p.first_layer[4] == 4,
        "pp 4: rc %d", rc);
  /* interleaved: pp 2 x 2 chunks = 4 virtual stages, stage 0 holds 0 and 2 */
  rc = mp_plan_new(big, 5, 1, 2, 2, &p, err, sizeof(err));
  CHECK(rc == 0 && p.vstages == 4 && p.first_layer[2] == 2, "pp 2 chunks 2: rc %d", rc);
  for (int l = 0; l < 4; l++) CHECK(p.kind[l] == MP_WHOLE, "tp 1: fc%d kind %d", l, p.kind[l]);

  /* tp 2: pairs inside a stage, an odd layer at a stage's end gathered */
  rc = mp_plan_new(big, 5, 2, 1, 1, &p, err, sizeof(err));
  CHECK(rc == 0 && p.kind[0] == MP_COLUMN && p.kind[1] == MP_ROW && p.kind[2] == MP_COLUMN &&
            p.kind[3] == MP_ROW,
        "tp 2 pp 1: rc %d", rc);
  CHECK(mp_plan_rank_params(&p, 0) * 2 == mp_plan_total_params(&p) + 256 + 10,
        "tp 2 pp 1: rank params %zu of %zu", mp_plan_rank_params(&p, 0), mp_plan_total_params(&p));
  rc = mp_plan_new(big, 5, 2, 2, 1, &p, err, sizeof(err));
  CHECK(rc == 0 && p.kind[0] == MP_COLUMN_GATHER && p.kind[1] == MP_COLUMN && p.kind[2] == MP_ROW &&
            p.kind[3] == MP_COLUMN_GATHER,
        "tp 2 pp 2: rc %d kinds %d %d %d %d", rc, p.kind[0], p.kind[1], p.kind[2], p.kind[3]);
  /* rank params: 1/(t p) of the model plus the replicated biases */
  CHECK(mp_plan_rank_params(&p, 0) == 784 * 128 + 128, "stage 0: %zu", mp_plan_rank_params(&p, 0));
  CHECK(mp_plan_rank_params(&p, 1) == 256 * 128 + 128 + 128 * 256 + 256 + 256 * 5 + 5,
        "stage 1: %zu", mp_plan_rank_params(&p, 1));
  CHECK((mp_plan_rank_params(&p, 0) + mp_plan_rank_params(&p, 1)) * 2 ==
            mp_plan_total_params(&p) + 256,
        "tp 2 pp 2 sums to the model plus fc2.bias once more");
  CHECK(mp_plan_total_params(&p) == 784 * 256 + 256 + 2 * (256 * 256 + 256) + 256 * 10 + 10,
        "total %zu", mp_plan_total_params(&p));
  rc = mp_plan_new(big, 5, 1, 4, 1, &p, err, sizeof(err));
  CHECK(mp_plan_rank_params(&p, 3) == 256 * 10 + 10 && mp_plan_rank_params(&p, 4) == 0,
        "tp 1 pp 4 last stage %zu", mp_plan_rank_params(&p, 3));

  /* refusals, with what is wrong named */
  rc = mp_plan_new(small, 3, 1, 4, 1, &p, err, sizeof(err));
  CHECK(rc == -EINVAL && strstr(err, "2 layers cannot fill 4 pipeline stages"), "rc %d \"%s\"", rc,
        err);
  rc = mp_plan_new(big, 5, 1, 3, 2, &p, err, sizeof(err));
  CHECK(rc == -EINVAL && strstr(err, "4 layers cannot fill 6 pipeline stages"), "rc %d \"%s\"", rc,
        err);
  rc = mp_plan_new(big, 5, 4, 2, 1, &p, err, sizeof(err));
  CHECK(rc == -EINVAL && strstr(err, "fc3 has 10 outputs, not divisible by --tensor-parallel 4"),
        "rc %d \"%s\"", rc, err);
  rc = mp_plan_new(small, 3, 3, 1, 1, &p, err, sizeof(err));
  CHECK(rc == -EINVAL && strstr(err, "fc0 has 256 outputs, not divisible by --tensor-parallel 3"),
        "rc %d \"%s\"", rc, err);
  rc = mp_plan_new(small, 3, 0, 1, 1, &p, err, sizeof(err));
  CHECK(rc == -EINVAL && strstr(err, "--tensor-parallel 0"), "rc %d \"%s\"", rc, err);
  rc = mp_plan_new(small, 3, 1, 1, 0, &p, err, sizeof(err));
  CHECK(rc == -EINVAL && strstr(err, "chunks"), "rc %d \"%s\"", rc, err);
}

/* ---- tp = 1: model.c's arithmetic ---- */

static void test_whole_exact(void) {
  const int m = 4, n = 5;
  struct fixture f;

  fixture_new(&f, sizes5, 6, m * n);
  for (int pp = 1; pp <= 3; pp++) { /* one micro-batch: bit for bit, even across stages */
    struct run r = run_cfg(&f, 1, pp, 1, 1, n, false);
    float want = mlp_forward_backward(f.ref, f.x, f.y, n, NULL, NULL);
    CHECK(run_start(&r) == 0, "pp %d m 1: rc %d", pp, r.rc);
    assemble_grads(&r, f.got);
    CHECK(bit_identical(f.got, f.ref), "pp %d m 1: gradients differ from mlp_forward_backward", pp);
    CHECK(r.loss[0] == want, "pp %d m 1: loss %.9g, want %.9g", pp, r.loss[0], want);
    run_free(&r);
  }
  for (int pp = 1; pp <= 3; pp += 2) {
    struct run r = run_cfg(&f, 1, pp, 1, m, n, false);
    struct mlp *sum = mlp_new(sizes5, 6, n);
    double rel, mean_loss = 0.0;
    bool exact = true;
    float want;

    CHECK(run_start(&r) == 0, "pp %d m %d: rc %d", pp, m, r.rc);
    assemble_grads(&r, f.got);
    /* the mean of m single-model calls, summed in micro-batch order */
    for (int j = 0; j < m; j++) {
      mlp_forward_backward(f.ref, f.x + (size_t)j * n * sizes5[0], f.y + j * n, n, NULL, NULL);
      for (int i = 0; i < mlp_num_tensors(sum); i++)
        for (size_t k = 0; k < mlp_tensor_count(sum, i); k++)
          mlp_grad(sum, i)[k] =
              j == 0 ? mlp_grad(f.ref, i)[k] : mlp_grad(sum, i)[k] + mlp_grad(f.ref, i)[k];
    }
    for (int i = 0; i < mlp_num_tensors(sum); i++)
      for (size_t k = 0; k < mlp_tensor_count(sum, i); k++) {
        mlp_grad(sum, i)[k] /= (float)m;
        exact = exact && mlp_grad(sum, i)[k] == mlp_param(f.got, i)[k];
      }
    CHECK(exact, "pp %d m %d: not the exact mean of %d mlp_forward_backward calls", pp, m, m);
    CHECK(worst_rel(f.got, sum, "mean of calls") < 1e-6, "pp %d: far from the mean of calls", pp);
    want = mlp_forward_backward(f.ref, f.x, f.y, m * n, NULL, NULL);
    rel = worst_rel(f.got, f.ref, "full batch");
    CHECK(rel < 1e-6, "pp %d m %d: %.3g relative to the full batch", pp, m, rel);
    for (int j = 0; j < m; j++) mean_loss += r.loss[j] / m;
    CHECK(fabs(mean_loss - want) < 1e-6 * fabs(want), "pp %d: loss %.9g want %.9g", pp, mean_loss,
          want);
    printf("tp 1 pp %d m %d: exact mean of calls %s, full batch worst rel L2 %.3g\n", pp, m,
           exact ? "yes" : "no", rel);
    mlp_free(sum);
    run_free(&r);
  }
  fixture_free(&f);
}

/* ---- tp > 1 ---- */

/* The collectives stage s of run r must have made, from the plan's kinds:
 * a row-parallel layer all-reduces forward, a column-parallel one backward
 * (not fc0, whose input needs no gradient), a gathered one gathers forward. */
static void expected_collectives(const struct run *r, int s, struct mp_counters *want) {
  const struct mp_plan *p = &r->plan;

  memset(want, 0, sizeof(*want));
  for (int k = s; k < p->vstages; k += p->pp)
    for (int l = p->first_layer[k]; l < p->first_layer[k + 1]; l++) {
      if (p->kind[l] == MP_ROW) want->tp_allreduce_fwd += (uint64_t)r->m;
      if (p->kind[l] == MP_COLUMN_GATHER) want->tp_allgather += (uint64_t)r->m;
      if ((p->kind[l] == MP_COLUMN || p->kind[l] == MP_COLUMN_GATHER) && l > 0)
        want->tp_allreduce_bwd += (uint64_t)r->m;
    }
}

static void test_tensor_parallel(void) {
  static const int cfg[][3] = {{2, 1, 1}, {2, 2, 1}, {2, 3, 1}, {4, 1, 1},
                               {4, 2, 1}, {4, 3, 1}, {2, 2, 2}, {4, 2, 2}};
  const int m = 4, n = 5;
  struct fixture f;
  float want_loss;

  fixture_new(&f, sizes5, 6, m * n);
  want_loss = mlp_forward_backward(f.ref, f.x, f.y, m * n, NULL, NULL);
  for (size_t c = 0; c < sizeof(cfg) / sizeof(cfg[0]); c++) {
    struct run r = run_cfg(&f, cfg[c][0], cfg[c][1], cfg[c][2], m, n, false);
    char what[64];
    double rel, loss = 0.0;

    snprintf(what, sizeof(what), "tp %d pp %d chunks %d", r.tp, r.pp, r.chunks);
    CHECK(run_start(&r) == 0, "%s: rc %d", what, r.rc);
    assemble_grads(&r, f.got);
    rel = worst_rel(f.got, f.ref, what);
    CHECK(rel < 1e-5, "%s: worst relative L2 %.3g", what, rel);
    for (int j = 0; j < m; j++) loss += r.loss[j] / m;
    CHECK(fabs(loss - want_loss) < 1e-5 * fabs(want_loss), "%s: loss %.9g want %.9g", what, loss,
          want_loss);
    for (int s = 0; s < r.pp; s++) {
      struct mp_counters got, want;
      expected_collectives(&r, s, &want);
      for (int t = 0; t < r.tp; t++) {
        mp_stage_counters(r.stages[t][s], &got);
        CHECK(got.tp_allreduce_fwd == want.tp_allreduce_fwd &&
                  got.tp_allreduce_bwd == want.tp_allreduce_bwd &&
                  got.tp_allgather == want.tp_allgather,
              "%s stage %d rank %d: all-reduces %llu/%llu gathers %llu, want %llu/%llu %llu", what,
              s, t, (unsigned long long)got.tp_allreduce_fwd,
              (unsigned long long)got.tp_allreduce_bwd, (unsigned long long)got.tp_allgather,
              (unsigned long long)want.tp_allreduce_fwd, (unsigned long long)want.tp_allreduce_bwd,
              (unsigned long long)want.tp_allgather);
      }
      /* replicated tensors: the same bits on every tp rank */
      for (int i = 0; i < mp_stage_num_tensors(r.stages[0][s]); i++) {
        if (!mp_stage_tensor_replicated(r.stages[0][s], i)) continue;
        for (int t = 1; t < r.tp; t++)
          CHECK(!memcmp(mp_stage_grad(r.stages[0][s], i), mp_stage_grad(r.stages[t][s], i),
                        sizeof(float) * mp_stage_tensor_count(r.stages[0][s], i)),
                "%s: %s differs on tp rank %d", what, mp_stage_tensor_name(r.stages[0][s], i), t);
      }
    }
    if (r.tp == 2 && r.pp == 1) {
      struct mp_counters got;
      /* fc0/fc1 and fc2/fc3 pairs, fc4 gathered: one forward all-reduce per
       * pair, one backward for fc2/fc3 and fc4 (fc0's input has no gradient) */
      mp_stage_counters(r.stages[0][0], &got);
      CHECK(got.tp_allreduce_fwd == 2 * (uint64_t)m && got.tp_allreduce_bwd == 2 * (uint64_t)m &&
                got.tp_allgather == (uint64_t)m,
            "tp 2 pp 1 counts %llu %llu %llu", (unsigned long long)got.tp_allreduce_fwd,
            (unsigned long long)got.tp_allreduce_bwd, (unsigned long long)got.tp_allgather);
      CHECK(!strcmp(mp_stage_tensor_name(r.stages[1][0], 0), "fc0.weight.tp1of2") &&
                !strcmp(mp_stage_tensor_name(r.stages[1][0], 3), "fc1.bias") &&
                mp_stage_tensor_replicated(r.stages[1][0], 3) &&
                !mp_stage_tensor_replicated(r.stages[1][0], 1) &&
                mp_stage_tensor_count(r.stages[1][0], 2) == 12 * 8,
            "tp 2 names %s %s", mp_stage_tensor_name(r.stages[1][0], 0),
            mp_stage_tensor_name(r.stages[1][0], 3));
    }
    printf("%s m %d: worst relative L2 %.3g\n", what, m, rel);
    run_free(&r);
  }
  fixture_free(&f);
}

/* ZB-H1: backward_input for every micro-batch, then backward_weight. */
static void test_zero_bubble_split(void) {
  const int m = 4, n = 3;
  struct fixture f;
  struct mlp *plain = mlp_new(sizes5, 6, 1);

  fixture_new(&f, sizes5, 6, m * n);
  for (int tp = 1; tp <= 2; tp++) {
    struct run a = run_cfg(&f, tp, 2, 1, m, n, false), b = run_cfg(&f, tp, 2, 1, m, n, true);
    CHECK(run_start(&a) == 0 && run_start(&b) == 0, "tp %d: rc %d %d", tp, a.rc, b.rc);
    assemble_grads(&a, plain);
    assemble_grads(&b, f.got);
    for (int i = 0; i < mlp_num_tensors(plain); i++)
      CHECK(!memcmp(mlp_param(plain, i), mlp_param(f.got, i),
                    sizeof(float) * mlp_tensor_count(plain, i)),
            "tp %d: %s differs with the split backward", tp, mlp_tensor_name(plain, i));
    run_free(&a);
    run_free(&b);
  }
  mlp_free(plain);
  fixture_free(&f);
}

/* Bytes stage st's chunk 0 holds for one micro-batch of n (tp = 1): its
 * input and every layer's output. */
static uint64_t micro_bytes(const struct mp_plan *p, int s, int n) {
  uint64_t floats = (uint64_t)p->sizes[p->first_layer[s]];

  for (int l = p->first_layer[s]; l < p->first_layer[s + 1]; l++)
    floats += (uint64_t)p->sizes[l + 1];
  return floats * (uint64_t)n * sizeof(float);
}

/* Peak activations: GPipe holds m on every stage; 1F1B (the caller's order)
 * holds p - s on stage s. */
static void test_peak_activations(void) {
  enum { P = 3, M = 6, N = 2 };
  struct fixture f;
  struct run g;
  struct mp_stage *st[P];
  float *act[M][P + 1], *grad[M][P + 1], loss;
  int ops[P][2 * M], len[P], pc[P] = {0}, fdone[P][M] = {{0}}, bdone[P][M] = {{0}}, rounds = 0;

  fixture_new(&f, sizes5, 6, M * N);
  g = run_cfg(&f, 1, P, 1, M, N, false);
  CHECK(run_start(&g) == 0, "gpipe: rc %d", g.rc);
  for (int s = 0; s < P; s++) {
    struct mp_counters c;
    mp_stage_counters(g.stages[0][s], &c);
    CHECK(c.peak_acts == M && c.peak_act_bytes == M * micro_bytes(&g.plan, s, N),
          "gpipe stage %d: peak %llu micro-batches %llu bytes, want %d, %llu", s,
          (unsigned long long)c.peak_acts, (unsigned long long)c.peak_act_bytes, M,
          (unsigned long long)(M * micro_bytes(&g.plan, s, N)));
    if (s == 0)
      printf("gpipe p %d m %d: stage 0 peak %llu micro-batches, %llu bytes\n", P, M,
             (unsigned long long)c.peak_acts, (unsigned long long)c.peak_act_bytes);
  }

  /* 1F1B lists per stage: p - s - 1 warm-up forwards, then F/B pairs, then
   * the remaining backwards; run round-robin as their inputs become ready.
   * Each stage gets room for m so that the counter, not -ENOBUFS, measures. */
  for (int s = 0; s < P; s++) {
    int warm = P - s - 1 < M ? P - s - 1 : M, k = 0;
    for (int j = 0; j < warm; j++) ops[s][k++] = j + 1;
    for (int j = warm; j < M; j++) {
      ops[s][k++] = j + 1;
      ops[s][k++] = -(j - warm + 1);
    }
    for (int j = M - warm; j < M; j++) ops[s][k++] = -(j + 1);
    len[s] = k;
    st[s] = mp_stage_new(&g.plan, s, 0, N, M, NULL);
    CHECK(st[s] && mp_stage_load_full(st[s], f.full) == 0, "stage %d", s);
  }
  for (int j = 0; j < M; j++)
    for (int k = 0; k <= P; k++) {
      act[j][k] = calloc(N * 32, sizeof(float));
      grad[j][k] = calloc(N * 32, sizeof(float));
    }
  for (bool progress = true; progress && rounds < 1000; rounds++) {
    progress = false;
    for (int s = 0; s < P; s++) {
      int op, j, rc;
      if (pc[s] == len[s]) continue;
      op = ops[s][pc[s]];
      j = (op > 0 ? op : -op) - 1;
      if (op > 0 && (s == 0 || fdone[s - 1][j])) {
        rc = mp_stage_forward(st[s], 0, j, N, s == 0 ? f.x + j * N * sizes5[0] : act[j][s],
                              act[j][s + 1], f.y + j * N, &loss);
        fdone[s][j] = 1;
      } else if (op < 0 && (s == P - 1 ? fdone[s][j] : bdone[s + 1][j])) {
        rc = mp_stage_backward(st[s], 0, j, M, s == P - 1 ? NULL : grad[j][s + 1],
                               s == 0 ? NULL : grad[j][s]);
        bdone[s][j] = 1;
      } else {
        continue;
      }
      CHECK(rc == 0, "1f1b stage %d op %d: rc %d", s, op, rc);
      pc[s]++;
      progress = true;
    }
  }
  for (int s = 0; s < P; s++) {
    struct mp_counters c;
    CHECK(pc[s] == len[s], "1f1b stage %d stuck at %d of %d", s, pc[s], len[s]);
    mp_stage_counters(st[s], &c);
    CHECK(c.peak_acts == (uint64_t)(P - s) &&
              c.peak_act_bytes == (uint64_t)(P - s) * micro_bytes(&g.plan, s, N),
          "1f1b stage %d: peak %llu micro-batches %llu bytes, want %d", s,
          (unsigned long long)c.peak_acts, (unsigned long long)c.peak_act_bytes, P - s);
    printf("1f1b p %d m %d: stage %d peak %llu micro-batches, %llu bytes\n", P, M, s,
           (unsigned long long)c.peak_acts, (unsigned long long)c.peak_act_bytes);
    mp_stage_free(st[s]);
  }
  for (int j = 0; j < M; j++)
    for (int k = 0; k <= P; k++) {
      free(act[j][k]);
      free(grad[j][k]);
    }
  run_free(&g);
  fixture_free(&f);
}

/* Misuse answers with an error, never with garbage. */
static void test_errors(void) {
  struct mp_plan p;
  struct mp_stage *s;
  struct fixture f;
  float out[4 * 16], gin[4 * 20], loss;
  char err[128];

  fixture_new(&f, sizes5, 6, 4);
  CHECK(mp_plan_new(sizes5, 6, 1, 2, 1, &p, err, sizeof(err)) == 0, "%s", err);
  s = mp_stage_new(&p, 0, 0, 2, 1, NULL);
  CHECK(s != NULL);
  CHECK(mp_stage_forward(s, 0, 0, 3, f.x, out, NULL, NULL) == -EINVAL, "n > micro_batch");
  CHECK(mp_stage_forward(s, 1, 0, 2, f.x, out, NULL, NULL) == -EINVAL, "chunk 1 of 1");
  CHECK(mp_stage_forward(s, 0, 0, 2, f.x, NULL, NULL, NULL) == -EINVAL, "no out");
  CHECK(mp_stage_forward(s, 0, 0, 2, f.x, out, NULL, NULL) == 0);
  CHECK(mp_stage_forward(s, 0, 0, 2, f.x, out, NULL, NULL) == -EEXIST, "micro 0 twice");
  CHECK(mp_stage_forward(s, 0, 1, 2, f.x, out, NULL, NULL) == -ENOBUFS, "beyond max_inflight");
  CHECK(mp_stage_backward_weight(s, 0, 0) == -ENOENT, "weight before input");
  CHECK(mp_stage_backward(s, 0, 1, 1, out, NULL) == -ENOENT, "micro 1 never forwarded");
  CHECK(mp_stage_backward(s, 0, 0, 1, NULL, NULL) == -EINVAL, "no grad_out");
  CHECK(mp_stage_backward(s, 0, 0, 1, out, NULL) == 0);
  CHECK(mp_stage_forward(s, 0, 1, 2, f.x, out, NULL, NULL) == 0, "slot recycled");
  mp_stage_free(s);
  s = mp_stage_new(&p, 1, 0, 2, 1, NULL);
  CHECK(mp_stage_forward(s, 0, 0, 2, out, NULL, f.y, NULL) == -EINVAL, "no loss");
  CHECK(mp_stage_forward(s, 0, 0, 2, out, NULL, (const uint8_t *)"\x08\x00", &loss) == -EINVAL,
        "label 8 of 8 classes");
  CHECK(mp_stage_forward(s, 0, 0, 2, out, NULL, f.y, &loss) == 0);
  CHECK(mp_stage_backward(s, 0, 0, 1, NULL, NULL) == -EINVAL, "no grad_in off the first stage");
  CHECK(mp_stage_backward(s, 0, 0, 1, NULL, gin) == 0);
  mp_stage_free(s);
  CHECK(mp_stage_new(&p, 2, 0, 2, 1, NULL) == NULL && errno == EINVAL, "pp rank 2 of 2");
  CHECK(mp_plan_new(sizes5, 6, 2, 1, 1, &p, err, sizeof(err)) == 0);
  CHECK(mp_stage_new(&p, 0, 0, 2, 1, NULL) == NULL && errno == EINVAL, "tp 2 without comm");
  fixture_free(&f);
}

int main(void) {
  test_plan();
  test_whole_exact();
  test_tensor_parallel();
  test_zero_bubble_split();
  test_peak_activations();
  test_errors();
  if (failures) fprintf(stderr, "%d check(s) failed\n", failures);
  return failures ? 1 : 0;
}
