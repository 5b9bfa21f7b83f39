/* The collectives beyond all-reduce (ring_coll.c) in W = 1..4 real processes
 * on 127.0.0.1, each checked against a plain reference the rank computes
 * itself (every rank's input is a known pattern): all-gather (out of place
 * and in place), reduce-scatter (sum, mean, max, min; in place too),
 * reduce to every root (the root's result, the others' buffers untouched),
 * all-to-all, max and min all-reduce through both algorithms, and all of
 * them queued asynchronously and waited in order. Sizes 0, 1, odd ones, ones
 * not divisible by W and ones spanning many slices; the script runs with the
 * library's defaults, with tiny slices (many slices, every scratch slot
 * reused) and with a token (every stream ends in its tag). Then the failure
 * semantics of all-reduce, for these too: ranks calling different
 * collectives all fail with PS_ERR_STATE naming both, and a rank that dies
 * in the middle of a loop of them makes every other rank fail in bounded
 * time with PS_ERR_IO naming it. */
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clock.h"
#include "coll_child.h"
#include "collective.h"
#include "harness.h"
#include "ring_workers.h"

#define MAX_W 4
enum scenario { GOOD, GOOD_TINY, MISMATCH, DIES };

struct child_arg {
  struct ring_ports *g;
  int rank;
  enum scenario scenario;
  const ps_token *token;
  int result_fd;
};

struct scene { /* what every rank of a group runs */
  enum scenario scenario;
  const ps_token *token;
};

/* Rank r's input element i: small integers, so every sum is exact. */
static float val(size_t i, int r) {
  return (float)((int)((131u * (uint64_t)i + 17u * (uint64_t)r * (uint64_t)r) % 61u) - 30);
}
static unsigned char byte(int r, int d, size_t i) {
  return (unsigned char)(i * 7 + (size_t)r * 31 + (size_t)d * 101 + 1);
}

static float combine(enum ps_redop op, float a, float b) {
  switch (op) {
    case PS_REDOP_MAX:
      return a > b ? a : b;
    case PS_REDOP_MIN:
      return a < b ? a : b;
    default:
      return a + b;
  }
}

/* The reference: element i combined over the W ranks' val(base + i, q). */
static float want(enum ps_redop op, size_t i, int W) {
  float x = val(i, 0);
  for (int q = 1; q < W; q++) x = combine(op, x, val(i, q));
  return op == PS_REDOP_AVG ? x * (1.0f / (float)W) : x;
}

static bool close_to(float got, float w, enum ps_redop op) {
  return op == PS_REDOP_AVG ? fabsf(got - w) <= 1e-6f * fabsf(w) + 1e-7f : got == w;
}

static const char *const op_name[] = {"sum", "avg", "max", "min"};

#define EXPECT COLL_EXPECT
#define OK COLL_OK

static int script(struct child_arg *a, ps_coll *c) {
  const int W = a->g->world, r = a->rank;
  char msg[512];
  enum { MAXN = 100003 };
  static float f[MAX_W * MAXN], o[MAX_W * MAXN];
  static unsigned char b[MAX_W * 300001], ob[MAX_W * 300001];

  size_t bsizes[] = {0, 1, 3, 4101, 300001};
  for (size_t k = 0; k < sizeof(bsizes) / sizeof(bsizes[0]); k++) {
    size_t n = bsizes[k];
    for (int in_place = 0; in_place < 2; in_place++) {
      unsigned char *src = in_place ? ob + (size_t)r * n : b;
      memset(ob, 0xee, (size_t)W * n);
      for (size_t i = 0; i < n; i++) src[i] = byte(r, 0, i);
      OK(ps_coll_allgather(c, src, ob, n), "allgather of %zu bytes%s", n,
         in_place ? " in place" : "");
      for (int q = 0; q < W; q++)
        for (size_t i = 0; i < n; i++)
          EXPECT(ob[(size_t)q * n + i] == byte(q, 0, i), "allgather %zu: rank %d's byte %zu", n, q,
                 i);
    }
  }

  size_t counts[] = {0, 1, 2, 17, 1000, (size_t)W * 333 + 1, MAXN};
  for (size_t k = 0; k < sizeof(counts) / sizeof(counts[0]); k++) {
    size_t n = counts[k];
    for (int op = 0; op < 4; op++)
      for (int in_place = 0; in_place < 2; in_place++) {
        for (size_t i = 0; i < (size_t)W * n; i++) f[i] = val(i, r);
        float *dst = in_place ? f + (size_t)r * n : o;
        OK(ps_coll_reduce_scatter(c, f, dst, n, (enum ps_redop)op), "reduce_scatter %s of %zu%s",
           op_name[op], n, in_place ? " in place" : "");
        for (size_t i = 0; i < n; i++) {
          float w = want((enum ps_redop)op, (size_t)r * n + i, W);
          EXPECT(close_to(dst[i], w, (enum ps_redop)op),
                 "reduce_scatter %s of %zu: [%zu] = %g, not %g", op_name[op], n, i, (double)dst[i],
                 (double)w);
        }
      }
  }

  size_t rcounts[] = {0, 1, 1000, MAXN};
  for (size_t k = 0; k < sizeof(rcounts) / sizeof(rcounts[0]); k++)
    for (int root = 0; root < W; root++)
      for (int op = 0; op < 4; op++) {
        size_t n = rcounts[k];
        for (size_t i = 0; i < n; i++) f[i] = val(i, r);
        OK(ps_coll_reduce(c, f, n, (enum ps_redop)op, root), "reduce %s of %zu to %d", op_name[op],
           n, root);
        for (size_t i = 0; i < n; i++) {
          float w = r == root ? want((enum ps_redop)op, i, W) : val(i, r);
          EXPECT(close_to(f[i], w, (enum ps_redop)op), "reduce %s of %zu to %d: [%zu] = %g, not %g",
                 op_name[op], n, root, i, (double)f[i], (double)w);
        }
      }

  size_t asizes[] = {0, 1, 5, 70001};
  for (size_t k = 0; k < sizeof(asizes) / sizeof(asizes[0]); k++) {
    size_t n = asizes[k];
    for (int d = 0; d < W; d++)
      for (size_t i = 0; i < n; i++) b[(size_t)d * n + i] = byte(r, d, i);
    memset(ob, 0xee, (size_t)W * n);
    OK(ps_coll_alltoall(c, b, ob, n), "alltoall of %zu bytes", n);
    for (int s = 0; s < W; s++)
      for (size_t i = 0; i < n; i++)
        EXPECT(ob[(size_t)s * n + i] == byte(s, r, i), "alltoall %zu: from %d, byte %zu", n, s, i);
  }

  size_t mcounts[] = {7, MAXN}; /* the small algorithm, then the pipelined ring */
  for (size_t k = 0; k < 2; k++)
    for (int op = PS_REDOP_MAX; op <= PS_REDOP_MIN; op++) {
      size_t n = mcounts[k];
      for (size_t i = 0; i < n; i++) f[i] = val(i, r);
      OK(ps_coll_allreduce(c, f, n, (enum ps_redop)op), "allreduce %s of %zu", op_name[op], n);
      for (size_t i = 0; i < n; i++)
        EXPECT(f[i] == want((enum ps_redop)op, i, W), "allreduce %s of %zu: [%zu] = %g",
               op_name[op], n, i, (double)f[i]);
    }

  /* Everything queued, then waited in order. */
  enum { AN = 20011 };
  static float ag_in[AN], ag_out[MAX_W * AN], rs_in[MAX_W * AN], rs_out[AN], rd[AN];
  static unsigned char a2a_in[MAX_W * 999], a2a_out[MAX_W * 999], bc[12345];
  for (size_t i = 0; i < AN; i++) ag_in[i] = rd[i] = val(i, r);
  for (size_t i = 0; i < (size_t)W * AN; i++) rs_in[i] = val(i, r);
  for (int d = 0; d < W; d++)
    for (size_t i = 0; i < 999; i++) a2a_in[(size_t)d * 999 + i] = byte(r, d, i);
  for (size_t i = 0; i < sizeof(bc); i++) bc[i] = r == W - 1 ? byte(9, 9, i) : 0;
  ps_coll_request *q[5];
  OK(ps_coll_allgather_async(c, ag_in, ag_out, AN * sizeof(float), &q[0]), "%s", "queue");
  OK(ps_coll_reduce_scatter_async(c, rs_in, rs_out, AN, PS_REDOP_SUM, &q[1]), "%s", "queue");
  OK(ps_coll_reduce_async(c, rd, AN, PS_REDOP_MAX, W - 1, &q[2]), "%s", "queue");
  OK(ps_coll_alltoall_async(c, a2a_in, a2a_out, 999, &q[3]), "%s", "queue");
  OK(ps_coll_broadcast_async(c, bc, sizeof(bc), W - 1, &q[4]), "%s", "queue");
  for (int k = 0; k < 5; k++) OK(ps_coll_wait(q[k]), "queued operation %d", k);
  for (int s = 0; s < W; s++)
    for (size_t i = 0; i < AN; i++)
      EXPECT(ag_out[(size_t)s * AN + i] == val(i, s), "queued allgather");
  for (size_t i = 0; i < AN; i++) {
    EXPECT(rs_out[i] == want(PS_REDOP_SUM, (size_t)r * AN + i, W), "queued reduce_scatter");
    EXPECT(rd[i] == (r == W - 1 ? want(PS_REDOP_MAX, i, W) : val(i, r)), "queued reduce");
  }
  for (int s = 0; s < W; s++)
    for (size_t i = 0; i < 999; i++)
      EXPECT(a2a_out[(size_t)s * 999 + i] == byte(s, r, i), "queued alltoall");
  for (size_t i = 0; i < sizeof(bc); i++) EXPECT(bc[i] == byte(9, 9, i), "queued broadcast");
  OK(ps_coll_barrier(c), "%s", "barrier");
  return 0;
}

/* DIES: a loop of every collective; rank W-1 leaves without a word in the
 * middle. Reports "<status> <lost rank> <message>". */
static int dies(struct child_arg *a, ps_coll *c) {
  const int W = a->g->world;
  enum { N = 1 << 18 };
  static float x[MAX_W * N], y[MAX_W * N];
  ps_status st = PS_OK;
  for (int it = 0; it < 200 && st == PS_OK; it++) {
    if (a->rank == W - 1 && it == 9) _exit(3); /* as kill -9: its sockets close */
    switch (it % 4) {
      case 0:
        st = ps_coll_allgather(c, x, y, N * sizeof(float));
        break;
      case 1:
        st = ps_coll_reduce_scatter(c, y, x, N, PS_REDOP_SUM);
        break;
      case 2:
        st = ps_coll_reduce(c, x, N, PS_REDOP_SUM, 0);
        break;
      default:
        st = ps_coll_alltoall(c, x, y, N * sizeof(float) / (size_t)W);
        break;
    }
  }
  coll_child_report(c, st, a->result_fd);
  return 0;
}

static int child(void *ctx, struct ring_ports *g, int rank, int fd) {
  const struct scene *sc = ctx;
  struct child_arg arg = {g, rank, sc->scenario, sc->token, fd}, *a = &arg;
  struct ps_coll_opts o = coll_child_opts(g, rank, "collectives", a->token);
  if (a->scenario == GOOD_TINY) {
    o.slice_bytes = 192;
    o.small_bytes = 1;
    o.round_bytes = 1000;
  }
  ps_coll *c = coll_child_open(&o, fd);
  if (!c) return 1;
  char err[512];
  ps_status st;
  int ret = 0;
  if (a->scenario == MISMATCH) {
    static float x[3 * 100], y[100];
    st = a->rank == 0 ? ps_coll_allgather(c, x, y, 100)
                      : ps_coll_reduce_scatter(c, x, y, 100, PS_REDOP_SUM);
    dprintf(a->result_fd, "%d %s", (int)st, ps_coll_errmsg(c, err, sizeof(err)));
  } else if (a->scenario == DIES) {
    ret = dies(a, c);
  } else {
    ret = script(a, c);
  }
  ps_coll_close(c);
  return ret;
}

static void run_group(int world, enum scenario sc, const ps_token *token, char out[][700],
                      int *status) {
  struct scene scene = {sc, token};
  ring_children_run(world, child, &scene, 90000, out[0], sizeof(out[0]), status);
}

int main(void) {
  harness_dir();
  char out[MAX_W][700];
  int status[MAX_W];
  ps_token *token = NULL;
  REQUIRE(ps_token_from_bytes("test_collectives' token of the job", 34, &token) == PS_OK, "token");
  const char *names[] = {"defaults", "tiny slices", "with a token"};
  for (int world = 1; world <= MAX_W; world++)
    for (int v = 0; v < 3; v++) {
      double t0 = clock_now_s();
      run_group(world, v == 1 ? GOOD_TINY : GOOD, v == 2 ? token : NULL, out, status);
      for (int r = 0; r < world; r++)
        REQUIRE(ring_exited(status[r], 0), "W=%d %s: rank %d failed (status %d): %s", world,
                names[v], r, status[r], out[r]);
      printf("W=%d %-12s every collective as the reference, in %.2f s\n", world, names[v],
             clock_now_s() - t0);
    }

  double t0 = clock_now_s();
  run_group(3, MISMATCH, token, out, status);
  for (int r = 0; r < 3; r++) {
    int st = -1;
    REQUIRE(ring_exited(status[r], 0) && sscanf(out[r], "%d", &st) == 1 && st != PS_OK,
            "mismatch: rank %d (status %d): %s", r, status[r], out[r]);
  }
  REQUIRE(strstr(out[1], "ranks disagree") && strstr(out[1], "allgather") &&
              strstr(out[1], "reduce_scatter"),
          "rank 1 should name both operations: %s", out[1]);
  REQUIRE(clock_now_s() - t0 < 10, "mismatch took %.1f s", clock_now_s() - t0);
  printf("mismatch: %s\n", out[1]);

  for (int world = 2; world <= 3; world++) {
    t0 = clock_now_s();
    run_group(world, DIES, token, out, status);
    char what[16];
    snprintf(what, sizeof(what), "W=%d", world);
    coll_expect_lost(what, world, world - 1, out[0], sizeof(out[0]), status, t0);
  }
  ps_token_free(token);
  return harness_status();
}
