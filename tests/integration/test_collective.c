/* The ring collectives in W = 1..5 real processes on 127.0.0.1.
 *
 * The parent binds one listening socket per rank on port 0 (no race for
 * ports) and forks W children, each keeping only its own socket and opening
 * the group with it. Every child then runs the same script twice, with the
 * library's defaults and with tiny slices, short rounds and the low-latency
 * algorithm off (so short buffers exercise the pipelined ring, many rounds and
 * slices, and scratch-slot reuse):
 *  - sum and mean of integer patterns whose sum is exact in float32, for
 *    counts 0, 1, 2, W-1, W, W+1, 15..17, 1000, the small-algorithm
 *    threshold +-1, a prime and a buffer larger than all scratch slots;
 *  - random floats (order-dependent sums): every rank must hold the
 *    bit-identical result (its hash is compared with rank 0's);
 *  - broadcast from every root of 0, 1, 7 and 300001 bytes;
 *  - queued asynchronous all-reduces waited in order;
 *  - barriers.
 * Then three failure cases, all of which must end in bounded time:
 *  - ranks that call different collectives fail with PS_ERR_STATE naming
 *    the disagreement (never sum garbage, never hang);
 *  - a rank with another job id, and one with another world size, are
 *    refused during the rendezvous, at once and with a message that says
 *    which, on both sides.
 * The failure cases run again with a token on every rank: the hello's
 * fields are checked after authentication, and the messages must be the
 * same (test_ring_auth covers authentication itself). */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "collective.h"
#include "harness.h"
#include "ring_workers.h"
#include "net.h"

#define MAX_W 5

struct child_arg {
  struct ring_ports *g;
  int rank;
  int scenario;
  const ps_token *token; /* NULL = no authentication */
  int result_fd;         /* the child writes its error message here */
};

enum { SCRIPT_DEFAULT, SCRIPT_TINY, MISMATCH, JOB_ID, WORLD_SIZE };

static float pattern(size_t i, int r) {
  return (float)((int)((131u * (uint64_t)i + 7u * (uint64_t)r) % 61u) - 30);
}

static uint64_t fnv(const void *p, size_t n) {
  const unsigned char *b = p;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

/* Child-side failure: report on the result channel and exit 1. */
#define EXPECT(cond, ...) RING_EXPECT(a->result_fd, a->rank, cond, __VA_ARGS__)

static int script(struct child_arg *a, ps_coll *c) {
  const int W = a->g->world, r = a->rank;
  char msg[512];
  size_t counts[] = {0,
                     1,
                     2,
                     (size_t)W - 1,
                     (size_t)W,
                     (size_t)W + 1,
                     15,
                     16,
                     17,
                     1000,
                     W > 1 ? 65536 / (size_t)(W - 1) : 65536,
                     W > 1 ? 65536 / (size_t)(W - 1) + 1 : 65537,
                     100003,
                     (size_t)1 << 20 | 7};
  size_t maxn = (size_t)1 << 20 | 7;
  float *x = malloc(maxn * sizeof(float));
  EXPECT(x, "out of memory");
  for (size_t k = 0; k < sizeof(counts) / sizeof(counts[0]); k++) {
    size_t n = counts[k];
    for (int op = 0; op < 2; op++) {
      for (size_t i = 0; i < n; i++) x[i] = pattern(i, r);
      ps_status st = ps_coll_allreduce(c, x, n, op ? PS_REDOP_AVG : PS_REDOP_SUM);
      EXPECT(st == PS_OK, "allreduce n=%zu: %s: %s", n, ps_strerror(st),
             ps_coll_errmsg(c, msg, sizeof(msg)));
      size_t bad = 0, first = SIZE_MAX;
      for (size_t i = 0; i < n; i++) {
        float sum = 0;
        for (int q = 0; q < W; q++) sum += pattern(i, q);
        float want = op ? sum * (1.0f / (float)W) : sum;
        bool ok = op ? fabsf(x[i] - want) <= 1e-6f * fabsf(want) : x[i] == want;
        if (!ok && first == SIZE_MAX) first = i;
        bad += !ok;
      }
      EXPECT(bad == 0, "%s of %zu floats: %zu wrong, first at %zu (%g)", op ? "avg" : "sum", n, bad,
             first, first < n ? (double)x[first] : 0.0);
    }
  }
  /* Non-integer values: sums depend on order, but all ranks must agree bit for bit. */
  srand(1000u + (unsigned)r);
  size_t n = 300007;
  for (size_t i = 0; i < n; i++) x[i] = (float)rand() / (float)RAND_MAX - 0.5f;
  EXPECT(ps_coll_allreduce(c, x, n, PS_REDOP_AVG) == PS_OK, "random allreduce");
  uint64_t h = fnv(x, n * sizeof(float)), h0 = h;
  EXPECT(ps_coll_broadcast(c, &h0, sizeof(h0), 0) == PS_OK, "broadcast of the hash");
  EXPECT(h == h0, "result differs from rank 0's (hash %016" PRIx64 " vs %016" PRIx64 ")", h, h0);

  size_t bsizes[] = {0, 1, 7, 300001};
  unsigned char *b = malloc(300001);
  EXPECT(b, "out of memory");
  for (int root = 0; root < W; root++)
    for (size_t k = 0; k < 4; k++) {
      size_t len = bsizes[k];
      for (size_t i = 0; i < len; i++) b[i] = r == root ? (unsigned char)(i * 7 + root) : 0xee;
      ps_status st = ps_coll_broadcast(c, b, len, root);
      EXPECT(st == PS_OK, "broadcast %zu from %d: %s", len, root,
             ps_coll_errmsg(c, msg, sizeof(msg)));
      for (size_t i = 0; i < len; i++)
        EXPECT(b[i] == (unsigned char)(i * 7 + root), "broadcast %zu from %d: byte %zu", len, root,
               i);
    }
  free(b);

  /* Queued operations, waited in order. */
  enum { Q = 6 };
  float *bufs[Q];
  ps_coll_request *req[Q];
  for (int q = 0; q < Q; q++) {
    size_t len = 1000 + (size_t)q * 7777;
    bufs[q] = malloc(len * sizeof(float));
    EXPECT(bufs[q], "out of memory");
    for (size_t i = 0; i < len; i++) bufs[q][i] = pattern(i + (size_t)q, r);
    EXPECT(ps_coll_allreduce_async(c, bufs[q], len, PS_REDOP_SUM, &req[q]) == PS_OK, "async");
  }
  for (int q = 0; q < Q; q++) {
    size_t len = 1000 + (size_t)q * 7777;
    EXPECT(ps_coll_wait(req[q]) == PS_OK, "async %d: %s", q, ps_coll_errmsg(c, msg, sizeof(msg)));
    for (size_t i = 0; i < len; i++) {
      float sum = 0;
      for (int p = 0; p < W; p++) sum += pattern(i + (size_t)q, p);
      EXPECT(bufs[q][i] == sum, "async %d element %zu", q, i);
    }
    free(bufs[q]);
  }
  for (int i = 0; i < 3; i++) EXPECT(ps_coll_barrier(c) == PS_OK, "barrier");
  free(x);
  return 0;
}

struct scene { /* what every rank of a group runs */
  int scenario;
  const ps_token *token;
};

static int child(void *ctx, struct ring_ports *g, int rank, int fd) {
  const struct scene *sc = ctx;
  struct child_arg arg = {g, rank, sc->scenario, sc->token, fd}, *a = &arg;
  struct ps_coll_opts o = {.rank = a->rank,
                           .world_size = g->world,
                           .peers = g->peers,
                           .job_id = "test",
                           .listen_fd = g->lfd[a->rank],
                           .connect_timeout_ms = 10000,
                           .peer_timeout_ms = 3000,
                           .auth_token = a->token};
  if (a->scenario == SCRIPT_TINY) {
    o.slice_bytes = 192;
    o.small_bytes = 1;
    o.round_bytes = 1000; /* rounds of 6 slices per rank */
  }
  if (a->scenario == JOB_ID && a->rank == 1) o.job_id = "another-job";
  const char *peers4[MAX_W + 1];
  if (a->scenario == WORLD_SIZE && a->rank == 0) { /* it believes in one more rank */
    o.world_size = g->world + 1;
    for (int q = 0; q < g->world; q++) peers4[q] = g->peers[q];
    peers4[g->world] = "127.0.0.1:1";
    o.peers = peers4;
  }
  /* a connect timeout far beyond the 15 s the test waits: a refusal that
   * waited it out would be a rank that hangs, not a timing to measure */
  if (a->scenario == JOB_ID || a->scenario == WORLD_SIZE) o.connect_timeout_ms = 600000;
  ps_coll *c;
  char err[512];
  ps_status st = ps_coll_open(&o, &c, err, sizeof(err));
  if (a->scenario == JOB_ID || a->scenario == WORLD_SIZE) {
    dprintf(a->result_fd, "%d %s", (int)st, st == PS_OK ? "" : err);
    if (st == PS_OK) ps_coll_close(c);
    return 0;
  }
  if (st != PS_OK) {
    dprintf(a->result_fd, "rank %d: open: %s: %s\n", a->rank, ps_strerror(st), err);
    return 1;
  }
  int ret;
  if (a->scenario == MISMATCH) {
    float x[11] = {0};
    st = ps_coll_allreduce(c, x, a->rank == 1 ? 10 : 11, PS_REDOP_SUM);
    dprintf(a->result_fd, "%d %s", (int)st, ps_coll_errmsg(c, err, sizeof(err)));
    ret = 0;
  } else {
    ret = script(a, c);
  }
  ps_coll_close(c);
  return ret;
}

/* Runs scenario in W processes; each child's report lands in out[r]. */
static void run_group(int world, int scenario, const ps_token *token, char out[][600],
                      int timeout_ms, int *status) {
  struct scene scene = {scenario, token};
  ring_children_run(world, child, &scene, timeout_ms, out[0], sizeof(out[0]), status);
}

int main(void) {
  harness_dir();
  char out[MAX_W][600];
  int status[MAX_W];
  for (int world = 1; world <= MAX_W; world++) {
    for (int scenario = SCRIPT_DEFAULT; scenario <= SCRIPT_TINY; scenario++) {
      double t0 = clock_now_s();
      run_group(world, scenario, NULL, out, 60000, status);
      for (int r = 0; r < world; r++)
        REQUIRE(status[r] >= 0 && WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0,
                "W=%d %s: rank %d failed (status %d): %s", world,
                scenario == SCRIPT_TINY ? "tiny slices" : "defaults", r, status[r], out[r]);
      printf("W=%d %-11s ok in %.2f s\n", world,
             scenario == SCRIPT_TINY ? "tiny slices" : "defaults", clock_now_s() - t0);
    }
  }

  ps_token *token = NULL;
  REQUIRE(ps_token_from_bytes("test_collective's token of the job", 34, &token) == PS_OK, "token");
  for (int with_token = 0; with_token < 2; with_token++) {
    const ps_token *tok = with_token ? token : NULL;
    double t0;
    /* Different collectives on different ranks: every rank fails, none hangs. */
    t0 = clock_now_s();
    run_group(3, MISMATCH, tok, out, 15000, status);
    for (int r = 0; r < 3; r++) {
      int st = -1;
      REQUIRE(status[r] >= 0 && WIFEXITED(status[r]) && WEXITSTATUS(status[r]) == 0,
              "mismatch: rank %d did not end (status %d)", r, status[r]);
      REQUIRE(sscanf(out[r], "%d", &st) == 1 && st != PS_OK, "mismatch: rank %d succeeded: %s", r,
              out[r]);
      printf("mismatch%s, rank %d: %s\n", tok ? " (token)" : "", r, out[r]);
    }
    REQUIRE(strstr(out[1], "ranks disagree") && strstr(out[1], "count=11") &&
                strstr(out[1], "count=10"),
            "rank 1 should name both operations: %s", out[1]);
    REQUIRE(clock_now_s() - t0 < 10, "mismatch took %.1f s", clock_now_s() - t0);

    /* Strangers at the rendezvous. */
    const char *what[] = {"job id", "world size"};
    for (int k = 0; k < 2; k++) {
      run_group(2, k == 0 ? JOB_ID : WORLD_SIZE, tok, out, 15000, status);
      for (int r = 0; r < 2; r++) {
        int st = -1;
        REQUIRE(status[r] >= 0 && WIFEXITED(status[r]),
                "%s: rank %d hung (waited for its connect timeout instead of the refusal)", what[k],
                r);
        REQUIRE(sscanf(out[r], "%d", &st) == 1 && st == PS_ERR_REMOTE,
                "%s: rank %d should be refused (PS_ERR_REMOTE): %s", what[k], r, out[r]);
        REQUIRE(strstr(out[r], what[k]), "%s: rank %d's message does not say why: %s", what[k], r,
                out[r]);
        printf("%s mismatch%s, rank %d: %s\n", what[k], tok ? " (token)" : "", r, out[r]);
      }
    }
  }
  ps_token_free(token);
  return 0;
}
