/* The reductions on every element type (ps_coll_*_typed, collective.h) in
 * W = 1..4 real processes on 127.0.0.1: all-reduce through both of its
 * algorithms, reduce-scatter (out of place and in place) and reduce to every
 * root, with sum, mean, max and min, for counts 0, 1, odd, not divisible by
 * W and spanning many slices; with the library's defaults, with tiny slices
 * (chunk and slice edges inside every type's runs) and with a token; then
 * the all-reduce again through the node-first algorithm (2 nodes of 2).
 * Each rank checks every result against a reference it computes itself in
 * the type's own arithmetic (integers wrap, the mean of integers truncates;
 * dtype.h), and the all-reduces' bits must be equal on every rank. Inputs:
 * random bits for the integers (sums wrap, both signs), whole numbers for
 * the floating types (exact in any order, so the reference need not follow
 * the ring's) and a NaN from the last rank, which sum, max and min must all
 * keep. Then a rank calling with another type than the others makes every
 * rank fail with PS_ERR_STATE, naming both types; an unknown type is
 * refused on the caller's side. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "clock.h"
#include "coll_child.h"
#include "collective.h"
#include "dtype.h"
#include "harness.h"
#include "ring_workers.h"

#define MAX_W 4
enum scenario { GOOD, GOOD_TINY, NODE_FIRST, MISMATCH };

struct scene {
  enum scenario scenario;
  const ps_token *token;
};

struct child_arg {
  int rank, world, result_fd;
};

static bool is_float(int t) {
  return t <= DTYPE_BFLOAT16;
}
static bool is_signed(int t) {
  return t == DTYPE_INT8 || t == DTYPE_INT32 || t == DTYPE_INT64;
}

static uint64_t mix(uint64_t x) { /* splitmix64's finaliser */
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

/* ---- elements of any type, as double (floats) or 64-bit patterns (ints) ---- */

static double getf(int t, const void *p, size_t i) {
  if (t == DTYPE_FLOAT32) return ((const float *)p)[i];
  if (t == DTYPE_FLOAT64) return ((const double *)p)[i];
  uint16_t h = ((const uint16_t *)p)[i];
  return t == DTYPE_FLOAT16 ? dtype_half_to_float(h) : dtype_bf16_to_float(h);
}
static void putf(int t, void *p, size_t i, double v) {
  if (t == DTYPE_FLOAT32)
    ((float *)p)[i] = (float)v;
  else if (t == DTYPE_FLOAT64)
    ((double *)p)[i] = v;
  else
    ((uint16_t *)p)[i] =
        t == DTYPE_FLOAT16 ? dtype_float_to_half((float)v) : dtype_float_to_bf16((float)v);
}
static uint64_t geti(int t, const void *p, size_t i) {
  size_t z = dtype_size(t);
  uint64_t v = 0;
  memcpy(&v, (const char *)p + i * z, z);
  if (is_signed(t) && z < 8 && (v >> (8 * z - 1)) & 1) v |= ~0ull << (8 * z);
  return v;
}
static void puti(int t, void *p, size_t i, uint64_t v) {
  memcpy((char *)p + i * dtype_size(t), &v, dtype_size(t));
}

/* Rank r's element i (the global index, for reduce-scatter's chunks) */
static void put_input(int t, void *p, size_t at, size_t i, int r, int W) {
  if (!is_float(t)) {
    puti(t, p, at, mix(i * 0x9e3779b97f4a7c15ull + (uint64_t)r * 1000003u + (uint64_t)t));
    return;
  }
  double v = (double)((int)((131u * (uint64_t)i + 17u * (uint64_t)r * (uint64_t)r) % 61u) - 30);
  putf(t, p, at, i == 3 && r == W - 1 ? NAN : v);
}

/* The reference of element i over the W ranks, into out[at] */
static void put_want(int t, enum ps_redop op, void *out, size_t at, size_t i, int W) {
  unsigned char x[8];
  if (is_float(t)) {
    double acc = 0;
    for (int q = 0; q < W; q++) {
      put_input(t, x, 0, i, q, W);
      double v = getf(t, x, 0);
      if (q == 0 || isnan(v))
        acc = v;
      else if (isnan(acc))
        continue; /* a NaN wins whatever comes */
      else if (op == PS_REDOP_MAX)
        acc = fmax(acc, v);
      else if (op == PS_REDOP_MIN)
        acc = fmin(acc, v);
      else
        acc += v;
    }
    if (op == PS_REDOP_AVG)
      acc = t == DTYPE_FLOAT64 ? acc * (1.0 / W) : (double)((float)acc * (1.0f / (float)W));
    putf(t, out, at, acc);
    return;
  }
  uint64_t acc = 0;
  for (int q = 0; q < W; q++) {
    put_input(t, x, 0, i, q, W);
    uint64_t v = geti(t, x, 0);
    bool more = is_signed(t) ? (int64_t)v > (int64_t)acc : v > acc;
    if (q == 0 || (op == PS_REDOP_MAX && more) || (op == PS_REDOP_MIN && !more && v != acc))
      acc = v;
    else if (op == PS_REDOP_SUM || op == PS_REDOP_AVG)
      acc += v;
  }
  if (op == PS_REDOP_AVG) { /* of the wrapped sum, as the type holds it */
    puti(t, x, 0, acc);
    acc = geti(t, x, 0);
    acc = is_signed(t) ? (uint64_t)((int64_t)acc / W) : acc / (uint64_t)W;
  }
  puti(t, out, at, acc);
}

static bool same(int t, const void *a, const void *b, size_t i) {
  size_t z = dtype_size(t);
  return memcmp((const char *)a + i * z, (const char *)b + i * z, z) == 0 ||
         (is_float(t) && isnan(getf(t, a, i)) && isnan(getf(t, b, i)));
}

static const char *const op_name[] = {"sum", "avg", "max", "min"};

#define EXPECT COLL_EXPECT
#define OK COLL_OK

/* Reports "ok <hash of every all-reduce result>" so the parent compares the bits. */
static int script(struct child_arg *a, ps_coll *c, bool all_reduce_only) {
  const int W = a->world, r = a->rank;
  enum { MAXN = 300007 };
  static unsigned char in[MAX_W * MAXN * 8], out[MAX_W * MAXN * 8], want[MAXN * 8];
  char msg[512];
  uint64_t hash = 1469598103934665603u;
  for (int t = 0; t < DTYPE_COUNT; t++) {
    const size_t z = dtype_size(t);
    const char *tn = dtype_name(t);
    /* up to 1000 elements the all-reduce takes its small algorithm; the
     * last count is just past its threshold (256 KiB over W-1 ranks), the
     * ring's pipeline, several slices to a chunk */
    const size_t big = W > 1 ? ((256u << 10) / (size_t)(W - 1) + 4099) / z : 4099;
    const size_t counts[] = {0, 1, 7, 1000, (size_t)W * 3333 + 1, big};
    for (size_t k = 0; k < sizeof(counts) / sizeof(counts[0]); k++)
      for (int op = 0; op < 4; op++) {
        size_t n = counts[k];
        for (size_t i = 0; i < n; i++) put_want(t, (enum ps_redop)op, want, i, i, W);
        for (size_t i = 0; i < n; i++) put_input(t, in, i, i, r, W);
        OK(ps_coll_allreduce_typed(c, in, n, (ps_dtype)t, (enum ps_redop)op),
           "allreduce %s %s of %zu", tn, op_name[op], n);
        for (size_t i = 0; i < n; i++)
          EXPECT(same(t, in, want, i), "allreduce %s %s of %zu: element %zu differs", tn,
                 op_name[op], n, i);
        for (size_t i = 0; i < n * z; i++) hash = (hash ^ in[i]) * 1099511628211u;
        if (all_reduce_only) continue;

        /* reduce-scatter: chunk r of W, out of place and in place */
        for (int in_place = 0; in_place < 2; in_place++) {
          for (size_t i = 0; i < (size_t)W * n; i++) put_input(t, in, i, i, r, W);
          unsigned char *dst = in_place ? in + (size_t)r * n * z : out;
          OK(ps_coll_reduce_scatter_typed(c, in, dst, n, (ps_dtype)t, (enum ps_redop)op),
             "reduce_scatter %s %s of %zu%s", tn, op_name[op], n, in_place ? " in place" : "");
          for (size_t i = 0; i < n; i++) {
            put_want(t, (enum ps_redop)op, out + MAXN * 8, 0, (size_t)r * n + i, W);
            EXPECT(same(t, dst + i * z, out + MAXN * 8, 0),
                   "reduce_scatter %s %s of %zu: element %zu differs", tn, op_name[op], n, i);
          }
        }

        /* reduce to every root (the others' buffers untouched) */
        for (int root = 0; root < W && (n <= 1000 || op == PS_REDOP_SUM); root++) {
          for (size_t i = 0; i < n; i++) put_input(t, in, i, i, r, W);
          OK(ps_coll_reduce_typed(c, in, n, (ps_dtype)t, (enum ps_redop)op, root),
             "reduce %s %s of %zu to %d", tn, op_name[op], n, root);
          for (size_t i = 0; i < n; i++) {
            if (r != root) put_input(t, out, i, i, r, W);
            EXPECT(same(t, in, r == root ? want : out, i),
                   "reduce %s %s of %zu to %d: element %zu differs", tn, op_name[op], n, root, i);
          }
        }
      }
  }
  /* queued, of two types, waited in order */
  static double d[5000];
  static int8_t b[5000];
  for (size_t i = 0; i < 5000; i++) put_input(DTYPE_FLOAT64, d, i, i, r, W);
  for (size_t i = 0; i < 5000; i++) put_input(DTYPE_INT8, b, i, i, r, W);
  ps_coll_request *q[2];
  OK(ps_coll_allreduce_typed_async(c, d, 5000, PS_DTYPE_FLOAT64, PS_REDOP_SUM, &q[0]), "%s",
     "queue");
  OK(ps_coll_reduce_typed_async(c, b, 5000, PS_DTYPE_INT8, PS_REDOP_MIN, 0, &q[1]), "%s", "queue");
  for (int k = 0; k < 2; k++) OK(ps_coll_wait(q[k]), "queued operation %d", k);
  for (size_t i = 0; i < 5000; i++) {
    put_want(DTYPE_FLOAT64, PS_REDOP_SUM, want, i, i, W);
    EXPECT(same(DTYPE_FLOAT64, d, want, i), "queued float64 allreduce: element %zu", i);
    if (r == 0) put_want(DTYPE_INT8, PS_REDOP_MIN, want, i, i, W);
    if (r != 0) put_input(DTYPE_INT8, want, i, i, r, W);
    EXPECT(same(DTYPE_INT8, b, want, i), "queued int8 reduce: element %zu", i);
  }
  EXPECT(ps_coll_allreduce_typed(c, d, 1, (ps_dtype)DTYPE_COUNT, PS_REDOP_SUM) == PS_ERR_INVALID,
         "%s", "an unknown dtype must be refused");
  EXPECT(ps_coll_reduce_typed(c, d, 1, (ps_dtype)-1, PS_REDOP_SUM, 0) == PS_ERR_INVALID, "%s",
         "a negative dtype must be refused");
  OK(ps_coll_barrier(c), "%s", "barrier after the refusals");
  dprintf(a->result_fd, "ok %016llx", (unsigned long long)hash);
  return 0;
}

static int child(void *ctx, struct ring_ports *g, int rank, int fd) {
  const struct scene *sc = ctx;
  struct child_arg arg = {rank, g->world, fd};
  struct ps_coll_opts o = coll_child_opts(g, rank, "dtypes", sc->token);
  if (sc->scenario == GOOD_TINY) {
    o.slice_bytes = 192;
    o.small_bytes = 1;
    o.round_bytes = 1000;
  }
  if (sc->scenario == NODE_FIRST) {
    o.node_first = 1;
    o.node = rank < g->world / 2 ? "a" : "b";
  }
  ps_coll *c = coll_child_open(&o, fd);
  if (!c) return 1;
  int ret = 0;
  if (sc->scenario == MISMATCH) {
    static char x[800];
    char err[512];
    ps_status st = ps_coll_allreduce_typed(
        c, x, 100, rank == 1 ? PS_DTYPE_FLOAT64 : PS_DTYPE_FLOAT32, PS_REDOP_SUM);
    dprintf(fd, "%d %s", (int)st, ps_coll_errmsg(c, err, sizeof(err)));
  } else {
    ret = script(&arg, c, sc->scenario == NODE_FIRST);
  }
  ps_coll_close(c);
  return ret;
}

int main(void) {
  harness_dir();
  char out[MAX_W][700];
  int status[MAX_W];
  ps_token *token = NULL;
  REQUIRE(ps_token_from_bytes("test_dtypes' token of the job ....", 34, &token) == PS_OK, "token");
  REQUIRE(strcmp(ps_dtype_name(PS_DTYPE_BFLOAT16), "bfloat16") == 0 &&
              ps_dtype_size(PS_DTYPE_UINT64) == 8 && ps_dtype_name((ps_dtype)10) == NULL &&
              ps_dtype_size((ps_dtype)10) == 0,
          "ps_dtype_name and ps_dtype_size");
  struct {
    int world;
    struct scene sc;
    const char *what;
  } groups[] = {
      {1, {GOOD, NULL}, "defaults"},
      {2, {GOOD, NULL}, "defaults"},
      {3, {GOOD, NULL}, "defaults"},
      {4, {GOOD, NULL}, "defaults"},
      {3, {GOOD_TINY, NULL}, "tiny slices"},
      {2, {GOOD, NULL}, "with a token"},
      {4, {NODE_FIRST, NULL}, "node-first, 2 nodes"},
  };
  groups[5].sc.token = token;
  for (size_t k = 0; k < sizeof(groups) / sizeof(groups[0]); k++) {
    int W = groups[k].world;
    double t0 = clock_now_s();
    ring_children_run(W, child, &groups[k].sc, 170000, out[0], sizeof(out[0]), status);
    for (int r = 0; r < W; r++) {
      REQUIRE(ring_exited(status[r], 0) && strncmp(out[r], "ok ", 3) == 0,
              "W=%d %s: rank %d failed (status %d): %s", W, groups[k].what, r, status[r], out[r]);
      REQUIRE(strcmp(out[r], out[0]) == 0, "W=%d %s: rank %d's all-reduce bits differ (%s, %s)", W,
              groups[k].what, r, out[r], out[0]);
    }
    printf("W=%d %-20s every type and op as the reference, the same bits, %.2f s\n", W,
           groups[k].what, clock_now_s() - t0);
  }

  struct scene sc = {MISMATCH, token};
  ring_children_run(3, child, &sc, 30000, out[0], sizeof(out[0]), status);
  for (int r = 0; r < 3; r++) {
    printf("mismatch: rank %d: %s\n", r, out[r]);
    REQUIRE(ring_exited(status[r], 0) && atoi(out[r]) != PS_OK, "mismatch: rank %d (status %d): %s",
            r, status[r], out[r]);
  }
  REQUIRE(atoi(out[1]) == PS_ERR_STATE && strstr(out[1], "ranks disagree") &&
              strstr(out[1], "float64") && strstr(out[1], "float32"),
          "rank 1 should name both types: %s", out[1]);
  ps_token_free(token);
  return harness_status();
}
