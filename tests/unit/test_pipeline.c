/* test_pipeline: the schedules of pipeline.h. Every schedule validates
 * (matching sends and receives, dependencies, no deadlock with blocking
 * sends) for p 1..8 and m 1..64; the simulated bubble equals the published
 * fractions; the peak activations are GPipe's m and 1F1B's p - s; and
 * schedules broken on purpose are caught with a message naming the stage
 * and the action. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "pipeline.h"
#include "pipeline_impl.h"

#include "check.h"

static const struct ps_pipe_costs fb = {1, 2, 1, 1, 0}; /* F = 1, B = 2 (ZB: B = W = 1) */

static void test_parse(void) {
  char err[256];
  ps_pipe_schedule k;
  const char *names[] = {"gpipe", "1f1b", "interleaved", "zb-h1"};
  for (int i = 0; i < 4; i++) {
    CHECK(ps_pipe_schedule_parse(names[i], &k, err, sizeof(err)) == PS_OK && (int)k == i);
    CHECK(strcmp(ps_pipe_schedule_name(k), names[i]) == 0);
  }
  CHECK(ps_pipe_schedule_parse("zb", &k, err, sizeof(err)) == PS_ERR_INVALID);
  CHECK(strstr(err, "expected gpipe, 1f1b, interleaved or zb-h1") && strstr(err, "'zb'"), "%s",
        err);
}

static void test_check(void) {
  char err[256];
  struct ps_pipe_shape bad[] = {
      {PS_PIPE_1F1B, 0, 4, 1},        {PS_PIPE_1F1B, 257, 4, 1},
      {PS_PIPE_1F1B, 4, 0, 1},        {PS_PIPE_1F1B, 4, 4097, 1},
      {PS_PIPE_1F1B, 4, 8, 2},        {PS_PIPE_INTERLEAVED, 4, 6, 2},
      {PS_PIPE_INTERLEAVED, 4, 8, 1}, {PS_PIPE_INTERLEAVED, 4, 8, 17},
      {(ps_pipe_schedule)7, 4, 8, 1},
  };
  for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
    err[0] = 0;
    CHECK(ps_pipe_check(&bad[i], err, sizeof(err)) == PS_ERR_INVALID && err[0], "case %zu", i);
  }
  struct ps_pipe_shape sh = {PS_PIPE_INTERLEAVED, 4, 6, 2};
  ps_pipe_check(&sh, err, sizeof(err));
  CHECK(strstr(err, "not a multiple"), "%s", err);
  struct ps_pipe_action *a;
  size_t n;
  sh = (struct ps_pipe_shape){PS_PIPE_1F1B, 4, 8, 1};
  CHECK(ps_pipe_actions(&sh, 4, &a, &n, err, sizeof(err)) == PS_ERR_INVALID);
}

/* Every schedule for p 1..8, m 1..64 validates; the lists end with the
 * reduction and the optimizer step. */
static void test_all_validate(void) {
  char err[512];
  for (int kind = 0; kind < 4; kind++) {
    for (int v = 1; v <= 3; v++) {
      if ((kind == PS_PIPE_INTERLEAVED) != (v > 1)) continue;
      for (int p = 1; p <= 8; p++) {
        for (int m = 1; m <= 64; m++) {
          if (kind == PS_PIPE_INTERLEAVED && m % p) continue;
          struct ps_pipe_shape sh = {(ps_pipe_schedule)kind, p, m, v};
          err[0] = 0;
          ps_status rc = ps_pipe_validate(&sh, err, sizeof(err));
          CHECK(rc == PS_OK, "%s p=%d m=%d v=%d: %s", ps_pipe_schedule_name(sh.kind), p, m, v, err);
        }
      }
    }
  }
  struct ps_pipe_shape sh = {PS_PIPE_1F1B, 4, 8, 1};
  struct ps_pipe_action *a = NULL;
  size_t n = 0;
  CHECK(ps_pipe_actions(&sh, 2, &a, &n, err, sizeof(err)) == PS_OK && n > 2);
  CHECK(a[n - 2].op == PS_PIPE_REDUCE_GRADS && a[n - 1].op == PS_PIPE_OPTIMIZER_STEP);
  free(a);
}

static int near(double a, double b) {
  return fabs(a - b) <= 1e-9 * (1 + fabs(b));
}

/* The bubble with F = 1, B = 2 (ZB-H1: F = B = W = 1), no transfer time. */
static void test_bubbles(void) {
  char err[256];
  for (int p = 1; p <= 8; p++) {
    for (int m = 1; m <= 64; m++) {
      for (int kind = PS_PIPE_GPIPE; kind <= PS_PIPE_1F1B; kind++) {
        struct ps_pipe_shape sh = {(ps_pipe_schedule)kind, p, m, 1};
        struct ps_pipe_sim sim;
        CHECK(ps_pipe_simulate(&sh, &fb, &sim, err, sizeof(err)) == PS_OK, "%s", err);
        double want = (double)(p - 1) / (m + p - 1);
        CHECK(near(sim.bubble, want), "%s p=%d m=%d: bubble %g, published (p-1)/(m+p-1) = %g",
              ps_pipe_schedule_name(sh.kind), p, m, sim.bubble, want);
        CHECK(near(sim.ideal_time, 3.0 * m));
        for (int s = 0; s < p; s++) {
          int acts = kind == PS_PIPE_GPIPE ? m : (p - s < m ? p - s : m);
          CHECK(sim.peak_acts[s] == acts, "%s p=%d m=%d stage %d: peak %d activations, want %d",
                ps_pipe_schedule_name(sh.kind), p, m, s, sim.peak_acts[s], acts);
        }
      }
      /* ZB-H1 (Qi et al.): bubble time (p-1)(F+B-W) = (p-1)/(3m) of the
       * ideal when F = B = W and m >= p (exact here); memory: no stage holds
       * more than 1F1B's most, p (stage 0's), as the paper's H1. */
      struct ps_pipe_shape zb = {PS_PIPE_ZBH1, p, m, 1};
      struct ps_pipe_sim sim;
      CHECK(ps_pipe_simulate(&zb, &fb, &sim, err, sizeof(err)) == PS_OK, "%s", err);
      if (m >= p) {
        double rate = (sim.step_time - sim.ideal_time) / sim.ideal_time;
        CHECK(near(rate, (p - 1) / (3.0 * m)), "zb-h1 p=%d m=%d: bubble %g of the ideal, want %g",
              p, m, rate, (p - 1) / (3.0 * m));
      }
      for (int s = 0; s < p; s++) {
        CHECK(sim.peak_acts[s] <= p, "zb-h1 p=%d m=%d stage %d: peak %d", p, m, s,
              sim.peak_acts[s]);
      }
      /* Interleaved: the bubble 1/v of 1F1B's, in units of the ideal. */
      for (int v = 2; v <= 3 && m % p == 0; v++) {
        struct ps_pipe_shape il = {PS_PIPE_INTERLEAVED, p, m, v};
        CHECK(ps_pipe_simulate(&il, &fb, &sim, err, sizeof(err)) == PS_OK, "%s", err);
        double rate = (sim.step_time - sim.ideal_time) / sim.ideal_time;
        double want = (p - 1) / ((double)v * m);
        CHECK(near(rate, want), "interleaved p=%d m=%d v=%d: bubble %g of the ideal, want %g", p, m,
              v, rate, want);
      }
    }
  }
}

static struct pipe_lists lists_of(struct ps_pipe_shape sh) {
  struct pipe_lists l;
  char err[256];
  ps_status rc = pipe_lists_new(&sh, &l, err, sizeof(err));
  CHECK(rc == PS_OK, "%s", err);
  return l;
}

static size_t find(const struct pipe_lists *l, int s, ps_pipe_op op, int micro) {
  for (size_t i = 0; i < l->n[s]; i++) {
    if (l->a[s][i].op == op && l->a[s][i].micro == micro) return i;
  }
  return (size_t)-1;
}

/* Schedules broken on purpose: the validator names the stage and action. */
static void test_broken(void) {
  char err[512];
  struct ps_pipe_shape sh = {PS_PIPE_1F1B, 2, 4, 1};

  /* drop stage 1's receive of micro-batch 2's activations */
  struct pipe_lists l = lists_of(sh);
  size_t i = find(&l, 1, PS_PIPE_RECV_ACT, 2);
  CHECK(i != (size_t)-1);
  memmove(&l.a[1][i], &l.a[1][i + 1], (l.n[1] - i - 1) * sizeof(l.a[1][0]));
  l.n[1]--;
  CHECK(pipe_validate_lists(&sh, &l, err, sizeof(err)) == PS_ERR_STATE);
  CHECK(strstr(err, "stage 1 action") && strstr(err, "forward micro 2") &&
            strstr(err, "before its activations were received"),
        "%s", err);
  printf("dropped receive: %s\n", err);
  pipe_lists_free(&l);

  /* stage 1 sends micro 0's gradient before it receives micro 1's
   * activations, while stage 0 sends those first: both block in send */
  l = lists_of(sh);
  size_t sg = find(&l, 1, PS_PIPE_SEND_GRAD, 0), ra = find(&l, 1, PS_PIPE_RECV_ACT, 1);
  CHECK(sg != (size_t)-1 && ra != (size_t)-1);
  if (sg != (size_t)-1 && ra != (size_t)-1 && ra < sg) {
    /* move the receive after the send (the receive stays before its forward) */
    struct ps_pipe_action r = l.a[1][ra];
    memmove(&l.a[1][ra], &l.a[1][ra + 1], (sg - ra) * sizeof(r));
    l.a[1][sg] = r;
  }
  err[0] = 0;
  CHECK(pipe_validate_lists(&sh, &l, err, sizeof(err)) == PS_ERR_STATE);
  CHECK(strstr(err, "deadlock") && strstr(err, "stage 0 action") && strstr(err, "send_act") &&
            strstr(err, "stage 1 action") && strstr(err, "send_grad"),
        "%s", err);
  printf("crossing sends: %s\n", err);
  pipe_lists_free(&l);

  /* GPipe: stage 0 sends micro 3's activations before micro 2's (both
   * computed): stage 1 would take them for each other */
  struct ps_pipe_shape gp = {PS_PIPE_GPIPE, 2, 4, 1};
  l = lists_of(gp);
  size_t s2 = find(&l, 0, PS_PIPE_SEND_ACT, 2), s3 = find(&l, 0, PS_PIPE_SEND_ACT, 3);
  CHECK(s2 != (size_t)-1 && s3 != (size_t)-1 && s2 < s3);
  if (s2 != (size_t)-1 && s3 != (size_t)-1 && s2 < s3) {
    struct ps_pipe_action t = l.a[0][s2];
    memmove(&l.a[0][s2], &l.a[0][s2 + 1], (s3 - s2) * sizeof(t));
    l.a[0][s3] = t;
  }
  err[0] = 0;
  CHECK(pipe_validate_lists(&gp, &l, err, sizeof(err)) == PS_ERR_STATE);
  CHECK(strstr(err, "stage 0 action") && strstr(err, "send_act micro 3") &&
            strstr(err, "is received by stage 1 action") && strstr(err, "recv_act micro 2"),
        "%s", err);
  printf("swapped sends: %s\n", err);
  pipe_lists_free(&l);
}

int main(void) {
  test_parse();
  test_check();
  test_all_validate();
  test_bubbles();
  test_broken();
  if (failures) fprintf(stderr, "%d checks failed\n", failures);
  return failures ? 1 : 0;
}
