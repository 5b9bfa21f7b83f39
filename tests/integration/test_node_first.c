/* The node-first all-reduce (ps_coll_opts.node_first, hier.c) in real
 * processes on 127.0.0.1, each rank told a node name as if it ran there:
 * ranks placed in node order (a a b b), alternating (a b a b), uneven
 * nodes (x x x y z), and the cases that fall back to the flat ring (one
 * node; a rank that does not know its node). For each, all-reduces of 0, 1,
 * odd and large counts with sum, mean, max and min against a reference,
 * with and without a token, the result's bits equal on every rank, and a
 * barrier. Then the failure semantics: a rank calling another collective
 * fails every rank with PS_ERR_STATE naming the node-first all-reduce, and a
 * rank that dies in a loop of them makes the others fail naming it. What
 * crosses between real (namespaced, shaped) hosts is
 * test_node_first_netns.sh's. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
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

#define MAX_W 5
enum scenario { GOOD, MISMATCH, DIES };

struct scene {
  enum scenario scenario;
  const char *nodes[MAX_W];
  const ps_token *token;
};

struct child_arg {
  int rank, world, result_fd;
};

static float val(size_t i, int r) {
  return (float)((int)((131u * (uint64_t)i + 17u * (uint64_t)r * (uint64_t)r) % 61u) - 30);
}

static float want(int op, size_t i, int W) {
  float x = val(i, 0);
  for (int q = 1; q < W; q++) {
    float y = val(i, q);
    x = op == PS_REDOP_MAX ? (x > y ? x : y) : op == PS_REDOP_MIN ? (x < y ? x : y) : x + y;
  }
  return op == PS_REDOP_AVG ? x / (float)W : x;
}

#define EXPECT COLL_EXPECT

static const char *const op_name[] = {"sum", "avg", "max", "min"};

/* Reports "ok <hash of every result>" so the parent compares the bits. */
static int script(struct child_arg *a, ps_coll *c) {
  enum { MAXN = 300007 };
  static float f[MAXN];
  char msg[512];
  uint64_t hash = 1469598103934665603u;
  size_t counts[] = {0, 1, 7, 1000, 4099, MAXN};
  for (size_t k = 0; k < sizeof(counts) / sizeof(counts[0]); k++)
    for (int op = 0; op < 4; op++) {
      size_t n = counts[k];
      for (size_t i = 0; i < n; i++) f[i] = val(i, a->rank);
      ps_status st = ps_coll_allreduce(c, f, n, (enum ps_redop)op);
      EXPECT(st == PS_OK, "allreduce %s of %zu: %s: %s", op_name[op], n, ps_strerror(st),
             ps_coll_errmsg(c, msg, sizeof(msg)));
      for (size_t i = 0; i < n; i++) {
        float w = want(op, i, a->world);
        bool ok = op == PS_REDOP_AVG ? fabsf(f[i] - w) <= 1e-6f * fabsf(w) + 1e-7f : f[i] == w;
        EXPECT(ok, "allreduce %s of %zu: [%zu] = %g, not %g", op_name[op], n, i, (double)f[i],
               (double)w);
        uint32_t bits;
        memcpy(&bits, &f[i], sizeof(bits));
        hash = (hash ^ bits) * 1099511628211u;
      }
    }
  ps_status st = ps_coll_barrier(c);
  EXPECT(st == PS_OK, "barrier: %s", ps_strerror(st));
  dprintf(a->result_fd, "ok %016llx", (unsigned long long)hash);
  return 0;
}

static int child(void *ctx, struct ring_ports *g, int rank, int fd) {
  const struct scene *sc = ctx;
  struct child_arg arg = {rank, g->world, fd}, *a = &arg;
  struct ps_coll_opts o = coll_child_opts(g, rank, "node-first", sc->token);
  o.node_first = 1;
  o.node = sc->nodes[rank];
  ps_coll *c = coll_child_open(&o, fd);
  if (!c) return 1;
  char err[512];
  ps_status st = PS_OK;
  int ret = 0;
  static float x[4 * 1000], y[1000];
  if (sc->scenario == MISMATCH) {
    st = rank == 1 ? ps_coll_allgather(c, y, x, sizeof(y)) : ps_coll_allreduce(c, y, 1000, 0);
    dprintf(fd, "%d %s", (int)st, ps_coll_errmsg(c, err, sizeof(err)));
  } else if (sc->scenario == DIES) {
    for (int it = 0; it < 500 && st == PS_OK; it++) {
      if (rank == g->world - 1 && it == 7) _exit(3);
      st = ps_coll_allreduce(c, x, sizeof(x) / sizeof(x[0]), PS_REDOP_SUM);
    }
    coll_child_report(c, st, fd);
  } else {
    ret = script(a, c);
  }
  ps_coll_close(c);
  return ret;
}

int main(void) {
  harness_dir();
  char out[MAX_W][700];
  int status[MAX_W];
  ps_token *token = NULL;
  REQUIRE(ps_token_from_bytes("test_node_first's token of the job", 34, &token) == PS_OK, "token");
  struct {
    int world;
    const char *nodes[MAX_W];
    const char *what;
  } layouts[] = {
      {4, {"a", "a", "b", "b"}, "2 nodes, ranks in node order"},
      {4, {"a", "b", "a", "b"}, "2 nodes, ranks alternating"},
      {5, {"x", "x", "x", "y", "z"}, "3 uneven nodes"},
      {2, {"a", "a"}, "one node (flat ring)"},
      {3, {"a", "", "a"}, "a rank without a node (flat ring)"},
  };
  for (size_t l = 0; l < sizeof(layouts) / sizeof(layouts[0]); l++)
    for (int v = 0; v < 2; v++) {
      struct scene sc = {GOOD, {NULL}, v ? token : NULL};
      memcpy(sc.nodes, layouts[l].nodes, sizeof(sc.nodes));
      int W = layouts[l].world;
      double t0 = clock_now_s();
      ring_children_run(W, child, &sc, 90000, out[0], sizeof(out[0]), status);
      for (int r = 0; r < W; r++) {
        REQUIRE(ring_exited(status[r], 0) && strncmp(out[r], "ok ", 3) == 0,
                "%s%s: rank %d failed (status %d): %s", layouts[l].what, v ? ", token" : "", r,
                status[r], out[r]);
        REQUIRE(strcmp(out[r], out[0]) == 0, "%s: rank %d's results differ from rank 0's (%s, %s)",
                layouts[l].what, r, out[r], out[0]);
      }
      printf("W=%d %-36s%s every all-reduce as the reference, same bits, %.2f s\n", W,
             layouts[l].what, v ? " (token)" : "", clock_now_s() - t0);
    }

  struct scene sc = {MISMATCH, {"a", "a", "b", "b"}, token};
  ring_children_run(4, child, &sc, 30000, out[0], sizeof(out[0]), status);
  /* A rank other than rank 1 may still be finishing open's exchange of node
   * names (its last piece in flight) when the others have failed the group
   * over the mismatch: its open fails, naming the mismatch. */
  for (int r = 0; r < 4; r++)
    REQUIRE((ring_exited(status[r], 0) && atoi(out[r]) != PS_OK) ||
                (r != 1 && ring_exited(status[r], 1) && strstr(out[r], "open: ") &&
                 strstr(out[r], "ranks disagree")),
            "mismatch: rank %d (status %d): %s", r, status[r], out[r]);
  REQUIRE(atoi(out[1]) == PS_ERR_STATE && strstr(out[1], "ranks disagree") &&
              strstr(out[1], "node-first allreduce") && strstr(out[1], "allgather"),
          "rank 1 should name both operations: %s", out[1]);
  for (int r = 0; r < 4; r++) printf("mismatch: rank %d: %s\n", r, out[r]);

  double t0 = clock_now_s();
  sc = (struct scene){DIES, {"a", "a", "b", "b"}, token};
  ring_children_run(4, child, &sc, 30000, out[0], sizeof(out[0]), status);
  coll_expect_lost("node-first", 4, 3, out[0], sizeof(out[0]), status, t0);
  ps_token_free(token);
  return harness_status();
}
