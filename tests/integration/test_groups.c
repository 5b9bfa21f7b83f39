/* Groups of libps's collectives (ps_coll_split, group.c) in W = 4 real
 * processes on 127.0.0.1, with and without a token:
 *  - a split into two groups by color (even, odd job ranks) with reversed
 *    keys: ranks ordered by key, job ranks translated, ids equal inside a
 *    group and different between groups;
 *  - on those groups: all-reduce (every op, float32 and int32), all-gather,
 *    broadcast, reduce-scatter, reduce, all-to-all and send/recv against
 *    values computed here;
 *  - a group of all four ranks (a ring of 4): a large and a small all-reduce whose bits
 *    are equal on every member, then a group of that group;
 *  - two groups over the same pair of ranks: one rank sends on the first
 *    then the second, the other receives on the second first (same
 *    lengths, so only the group id keeps them apart), and queued operations
 *    of both groups and the job interleaved;
 *  - groups of one rank (local copies), a rank that joins no group
 *    (PS_COLL_UNDEFINED: size 0, rank -1, PS_ERR_STATE naming its job rank);
 *  - the asynchronous forms on groups.
 * Then: a split of a job opened without p2p (PS_ERR_STATE), a mismatch
 * inside a group (PS_ERR_STATE on the group's members), ps_coll_abort on a
 * group (every rank of the job fails, naming the job rank), and a rank that
 * dies while every group works: every other rank's group operation fails
 * with PS_ERR_IO naming the dead rank by its JOB rank, in bounded time; and
 * the job group closed before its group: the group's operations are
 * PS_ERR_STATE, and its close frees both (AddressSanitizer sees a leak or a
 * use after free otherwise). */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "clock.h"
#include "coll_child.h"
#include "collective.h"
#include "harness.h"
#include "ring_workers.h"

enum scenario { GOOD, NO_P2P, MISMATCH, ABORT, DIES, CLOSE_FIRST };

struct scene {
  enum scenario scenario;
  const ps_token *token;
};

struct child_arg {
  struct ring_ports *g;
  int rank, result_fd;
};

#define EXPECT COLL_EXPECT
#define OK COLL_OK
#define W 4
#define BIG 100003

static float fbuf[W * BIG], fref[W * BIG];

static float fabsf_(float x) {
  return x < 0 ? -x : x;
}

/* Value i of job rank j's input. */
static float val(int j, size_t i) {
  return (float)((int)((i * 7 + (size_t)j * 13) % 29) - 14) * 0.375f + (float)j * 0.0625f;
}

/* The split into even and odd job ranks, keys reversed: group {2, 0} and
 * {3, 1}. Checks the group's shape. */
static int pairs(struct child_arg *a, ps_coll *c, ps_coll **out) {
  const int r = a->rank;
  char msg[512];
  ps_coll *g;
  OK(ps_coll_split(c, r % 2, -r, &g), "%s", "split by parity");
  *out = g;
  EXPECT(ps_coll_world_size(g) == 2 && ps_coll_rank(g) == (r < 2 ? 1 : 0),
         "group of job rank %d: size %d rank %d", r, ps_coll_world_size(g), ps_coll_rank(g));
  EXPECT(ps_coll_job_rank(g, 0) == 2 + r % 2 && ps_coll_job_rank(g, 1) == r % 2 &&
             ps_coll_job_rank(g, 2) == -1 && ps_coll_job_rank(c, 3) == 3,
         "job ranks %d %d", ps_coll_job_rank(g, 0), ps_coll_job_rank(g, 1));
  uint64_t ids[W], id = ps_coll_group_id(g);
  OK(ps_coll_allgather(c, &id, ids, sizeof(id)), "%s", "gather the ids");
  EXPECT(id != 0 && ps_coll_group_id(c) == 0 && ids[(r + 2) % W] == id && ids[(r + 1) % W] != id,
         "ids %llx %llx %llx %llx", (unsigned long long)ids[0], (unsigned long long)ids[1],
         (unsigned long long)ids[2], (unsigned long long)ids[3]);
  return 0;
}

/* The collectives on a pair group g = {m0, m1} (job ranks). */
static int on_pair(struct child_arg *a, ps_coll *c, ps_coll *g) {
  const int r = a->rank, me = ps_coll_rank(g);
  const int m[2] = {ps_coll_job_rank(g, 0), ps_coll_job_rank(g, 1)};
  char msg[512];
  (void)c;
  const enum ps_redop ops[] = {PS_REDOP_SUM, PS_REDOP_AVG, PS_REDOP_MAX, PS_REDOP_MIN};
  for (int k = 0; k < 4; k++) {
    size_t n = 1001;
    for (size_t i = 0; i < n; i++) fbuf[i] = val(r, i);
    OK(ps_coll_allreduce(g, fbuf, n, ops[k]), "allreduce op %d", k);
    for (size_t i = 0; i < n; i++) {
      float x = val(m[0], i), y = val(m[1], i);
      float e = k == 0   ? x + y
                : k == 1 ? (x + y) * 0.5f
                : k == 2 ? (x > y ? x : y)
                         : (x < y ? x : y);
      EXPECT(fbuf[i] == e, "allreduce op %d [%zu]: %g, expected %g", k, i, (double)fbuf[i],
             (double)e);
    }
  }
  int32_t iv[3] = {r * 100 + 1, -r, 7};
  OK(ps_coll_allreduce_typed(g, iv, 3, PS_DTYPE_INT32, PS_REDOP_SUM), "%s", "int32 allreduce");
  EXPECT(iv[0] == m[0] * 100 + m[1] * 100 + 2 && iv[1] == -(m[0] + m[1]) && iv[2] == 14,
         "int32 allreduce: %d %d %d", iv[0], iv[1], iv[2]);

  int32_t mine[2] = {r, r * r}, all[4];
  OK(ps_coll_allgather(g, mine, all, sizeof(mine)), "%s", "allgather");
  EXPECT(all[0] == m[0] && all[1] == m[0] * m[0] && all[2] == m[1] && all[3] == m[1] * m[1],
         "allgather: %d %d %d %d", all[0], all[1], all[2], all[3]);

  char text[64];
  snprintf(text, sizeof(text), "from job rank %d", r);
  OK(ps_coll_broadcast(g, text, sizeof(text), 1), "%s", "broadcast from group rank 1");
  char want[64];
  snprintf(want, sizeof(want), "from job rank %d", m[1]);
  EXPECT(!strcmp(text, want), "broadcast: \"%s\"", text);

  float rs[2 * 5], rout[5];
  for (int i = 0; i < 10; i++) rs[i] = (float)(r * 10 + i);
  OK(ps_coll_reduce_scatter(g, rs, rout, 5, PS_REDOP_SUM), "%s", "reduce_scatter");
  for (int i = 0; i < 5; i++)
    EXPECT(rout[i] == (float)((m[0] + m[1]) * 10 + 2 * (me * 5 + i)), "reduce_scatter [%d]: %g", i,
           (double)rout[i]);

  float red[3] = {(float)r, 1, (float)-r};
  OK(ps_coll_reduce(g, red, 3, PS_REDOP_MAX, 0), "%s", "reduce to group rank 0");
  if (me == 0)
    EXPECT(red[0] == (float)(m[0] > m[1] ? m[0] : m[1]) &&
               red[2] == (float)-(m[0] < m[1] ? m[0] : m[1]),
           "reduce: %g %g", (double)red[0], (double)red[2]);
  else
    EXPECT(red[0] == (float)r, "%s", "reduce changed a non-root's buffer");

  int32_t a2a_in[2] = {r * 10 + 0, r * 10 + 1}, a2a_out[2];
  OK(ps_coll_alltoall(g, a2a_in, a2a_out, sizeof(int32_t)), "%s", "alltoall");
  EXPECT(a2a_out[0] == m[0] * 10 + me && a2a_out[1] == m[1] * 10 + me, "alltoall: %d %d",
         a2a_out[0], a2a_out[1]);

  int32_t token = r;
  if (me == 0) {
    OK(ps_coll_send(g, &token, sizeof(token), 1), "%s", "send to group rank 1");
  } else {
    OK(ps_coll_recv(g, &token, sizeof(token), 0), "%s", "recv from group rank 0");
    EXPECT(token == m[0], "recv: %d, expected job rank %d's", token, m[0]);
  }
  EXPECT(ps_coll_send(g, &token, 4, 2) == PS_ERR_INVALID &&
             ps_coll_recv(g, &token, 4, me) == PS_ERR_INVALID,
         "%s", "send to group rank 2 / from itself should be PS_ERR_INVALID");
  OK(ps_coll_barrier(g), "%s", "barrier");
  return 0;
}

/* A group of all four (keys reversed: group rank 3 - r), a large all-reduce
 * with the same bits on every rank, then a group of that group. */
static int on_all(struct child_arg *a, ps_coll *c) {
  const int r = a->rank;
  char msg[512];
  ps_coll *g, *gg;
  OK(ps_coll_split(c, 5, W - r, &g), "%s", "split of all");
  EXPECT(ps_coll_rank(g) == W - 1 - r && ps_coll_job_rank(g, 0) == 3, "rank %d", ps_coll_rank(g));
  for (size_t i = 0; i < BIG; i++) fbuf[i] = val(r, i) * 1.1f;
  OK(ps_coll_allreduce(g, fbuf, BIG, PS_REDOP_SUM), "%s", "allreduce of 100003");
  for (size_t i = 0; i < BIG; i++) {
    float e = 0;
    for (int j = 0; j < W; j++) e += val(j, i) * 1.1f;
    EXPECT(fabsf_(fbuf[i] - e) <= 1e-4f, "allreduce [%zu]: %g, expected %g", i, (double)fbuf[i],
           (double)e);
  }
  OK(ps_coll_allgather(c, fbuf, fref, BIG * sizeof(float)), "%s", "gather the results");
  for (int j = 0; j < W; j++)
    EXPECT(!memcmp(fref + (size_t)j * BIG, fbuf, BIG * sizeof(float)),
           "job rank %d's all-reduce has other bits than job rank %d's", j, r);
  /* a small one (gathered, combined on each member): the same bits too */
  for (size_t i = 0; i < 5000; i++) fbuf[i] = val(r, i) * (r % 2 ? 1e-7f : 1.3f) + 0.1f * (float)r;
  OK(ps_coll_allreduce(g, fbuf, 5000, PS_REDOP_SUM), "%s", "allreduce of 5000");
  OK(ps_coll_allgather(c, fbuf, fref, 5000 * sizeof(float)), "%s", "gather the results");
  for (int j = 0; j < W; j++)
    EXPECT(!memcmp(fref + (size_t)j * 5000, fbuf, 5000 * sizeof(float)),
           "job rank %d's small all-reduce has other bits than job rank %d's", j, r);
  /* reduce_scatter on 4 ranks: chunk i of the sum at group rank i */
  for (size_t i = 0; i < W * 1000; i++) fref[i] = (float)(r + 1) * (float)i;
  OK(ps_coll_reduce_scatter(g, fref, fbuf, 1000, PS_REDOP_SUM), "%s", "reduce_scatter of 4");
  for (size_t i = 0; i < 1000; i++) {
    size_t at = (size_t)ps_coll_rank(g) * 1000 + i;
    EXPECT(fbuf[i] == 10.0f * (float)at, "reduce_scatter [%zu]: %g", i, (double)fbuf[i]);
  }
  /* a group of a group: g's ranks 0, 2 (job 3, 1) and 1, 3 (job 2, 0) */
  OK(ps_coll_split(g, ps_coll_rank(g) % 2, ps_coll_rank(g), &gg), "%s", "split of the group");
  EXPECT(ps_coll_world_size(gg) == 2 && ps_coll_job_rank(gg, 0) == 2 + r % 2 &&
             ps_coll_job_rank(gg, 1) == r % 2 && ps_coll_group_id(gg) != ps_coll_group_id(g),
         "group of a group: %d %d", ps_coll_job_rank(gg, 0), ps_coll_job_rank(gg, 1));
  float s = (float)r;
  OK(ps_coll_allreduce(gg, &s, 1, PS_REDOP_SUM), "%s", "allreduce in the group of a group");
  EXPECT(s == (float)(r % 2 ? 4 : 2), "group of a group's sum: %g", (double)s);
  ps_coll_close(gg);
  /* Figures, not checks: all-reduces of 1 float and of 1 MiB on the group of
   * four (over p2p, a descriptor round first) against the job's ring. */
  double t[4];
  for (int k = 0; k < 4; k++) {
    ps_coll *on = k % 2 ? c : g;
    int reps = k >= 2 ? 20 : 300;
    size_t n = k >= 2 ? 262144 : 1;
    OK(ps_coll_barrier(c), "%s", "barrier before timing");
    double t0 = clock_now_s();
    for (int i = 0; i < reps; i++) OK(ps_coll_allreduce(on, fbuf, n, PS_REDOP_MAX), "rep %d", i);
    t[k] = (clock_now_s() - t0) / reps * 1e6;
  }
  if (r == 0)
    dprintf(a->result_fd,
            "all-reduce of 1 float: %.0f us on the group of 4, %.0f us on the job's ring; "
            "1 MiB: %.0f us on the group, %.0f us on the ring",
            t[0], t[1], t[2], t[3]);
  ps_coll_close(g);
  return 0;
}

/* Two groups over the same pair; job ranks r and r^1. */
static int same_pair(struct child_arg *a, ps_coll *c) {
  const int r = a->rank;
  char msg[512];
  ps_coll *g1, *g2;
  OK(ps_coll_split(c, r / 2, r, &g1), "%s", "first pair split");
  OK(ps_coll_split(c, r / 2, r, &g2), "%s", "second pair split");
  EXPECT(ps_coll_group_id(g1) != ps_coll_group_id(g2), "%s", "two splits gave one id");
  int32_t m1[64], m2[64], in[64];
  for (int i = 0; i < 64; i++) m1[i] = 1000 + i, m2[i] = 2000 + i;
  if (r % 2 == 0) {
    OK(ps_coll_send(g1, m1, sizeof(m1), 1), "%s", "send on the first");
    OK(ps_coll_send(g2, m2, sizeof(m2), 1), "%s", "send on the second");
  } else {
    OK(ps_coll_recv(g2, in, sizeof(in), 0), "%s", "recv on the second");
    EXPECT(!memcmp(in, m2, sizeof(in)), "the second group received %d (the first's?)", in[0]);
    OK(ps_coll_recv(g1, in, sizeof(in), 0), "%s", "recv on the first");
    EXPECT(!memcmp(in, m1, sizeof(in)), "the first group received %d", in[0]);
  }
  /* queued, interleaved: both groups and the job */
  float x1[300], x2[300], xj = 1;
  for (int i = 0; i < 300; i++) x1[i] = (float)(r + i), x2[i] = (float)(r * i);
  ps_coll_request *q[3];
  OK(ps_coll_allreduce_async(g1, x1, 300, PS_REDOP_SUM, &q[0]), "%s", "queue on the first");
  OK(ps_coll_allreduce_async(c, &xj, 1, PS_REDOP_SUM, &q[1]), "%s", "queue on the job");
  OK(ps_coll_allreduce_async(g2, x2, 300, PS_REDOP_MAX, &q[2]), "%s", "queue on the second");
  for (int k = 0; k < 3; k++) OK(ps_coll_wait(q[k]), "queued %d", k);
  int lo = r & ~1, hi = lo + 1;
  for (int i = 0; i < 300; i++) {
    EXPECT(x1[i] == (float)(lo + hi + 2 * i), "first group's sum [%d]: %g", i, (double)x1[i]);
    EXPECT(x2[i] == (float)(hi * i), "second group's max [%d]: %g", i, (double)x2[i]);
  }
  EXPECT(xj == (float)W, "the job's sum: %g", (double)xj);
  /* async broadcast and allgather on a group, a blocking call behind them */
  int32_t b = r, gat[2], one = r;
  OK(ps_coll_broadcast_async(g2, &b, sizeof(b), 1, &q[0]), "%s", "queue a broadcast");
  OK(ps_coll_allgather_async(g1, &one, gat, sizeof(one), &q[1]), "%s", "queue an allgather");
  OK(ps_coll_barrier(g2), "%s", "barrier behind the queue");
  OK(ps_coll_wait(q[0]), "%s", "broadcast");
  OK(ps_coll_wait(q[1]), "%s", "allgather");
  EXPECT(b == hi && gat[0] == lo && gat[1] == hi, "async: %d %d %d", b, gat[0], gat[1]);
  ps_coll_close(g2);
  ps_coll_close(g1);
  return 0;
}

/* Groups of one, and a rank in no group. */
static int odd_groups(struct child_arg *a, ps_coll *c) {
  const int r = a->rank;
  char msg[512];
  ps_coll *g;
  OK(ps_coll_split(c, r, 0, &g), "%s", "split into singles");
  float f[4] = {1, 2, 3, 4}, all[4];
  OK(ps_coll_allreduce(g, f, 4, PS_REDOP_AVG), "%s", "allreduce alone");
  OK(ps_coll_allgather(g, f, all, sizeof(f)), "%s", "allgather alone");
  OK(ps_coll_barrier(g), "%s", "barrier alone");
  EXPECT(f[3] == 4 && !memcmp(all, f, sizeof(f)) && ps_coll_world_size(g) == 1, "%s",
         "a group of one changed its data");
  ps_coll_close(g);

  OK(ps_coll_split(c, r == 3 ? PS_COLL_UNDEFINED : 1, r, &g), "%s", "split with one out");
  if (r == 3) {
    EXPECT(ps_coll_world_size(g) == 0 && ps_coll_rank(g) == -1, "out: size %d rank %d",
           ps_coll_world_size(g), ps_coll_rank(g));
    ps_coll_request *q = NULL;
    EXPECT(ps_coll_allreduce(g, f, 4, PS_REDOP_SUM) == PS_ERR_STATE &&
               ps_coll_broadcast(g, f, 4, 0) == PS_ERR_STATE &&
               ps_coll_send(g, f, 4, 0) == PS_ERR_STATE && ps_coll_barrier(g) == PS_ERR_STATE &&
               ps_coll_allgather_async(g, f, all, 4, &q) == PS_ERR_STATE && !q,
           "%s", "an operation on a group this rank is not in should be PS_ERR_STATE");
    ps_coll *sub;
    EXPECT(ps_coll_split(g, 0, 0, &sub) == PS_ERR_STATE, "%s", "split of a group not joined");
    ps_coll_errmsg(g, msg, sizeof(msg));
    EXPECT(strstr(msg, "job rank 3 is not in this group"), "errmsg: %s", msg);
  } else {
    float s = 1;
    OK(ps_coll_allreduce(g, &s, 1, PS_REDOP_SUM), "%s", "allreduce of three");
    EXPECT(s == 3 && ps_coll_world_size(g) == 3, "sum of three: %g", (double)s);
  }
  ps_coll_close(g);
  EXPECT(ps_coll_split(c, -2, 0, &g) == PS_ERR_INVALID &&
             ps_coll_split(NULL, 0, 0, &g) == PS_ERR_INVALID,
         "%s", "bad splits should be PS_ERR_INVALID");
  return 0;
}

static int script(struct child_arg *a, ps_coll *c) {
  char msg[512];
  ps_coll *g = NULL;
  int ret = pairs(a, c, &g);
  if (!ret) ret = on_pair(a, c, g);
  ps_coll_close(g);
  if (!ret) ret = on_all(a, c);
  if (!ret) ret = same_pair(a, c);
  if (!ret) ret = odd_groups(a, c);
  if (!ret) OK(ps_coll_barrier(c), "%s", "the job's barrier at the end");
  return ret;
}

/* DIES: pairs {2, 0} and {3, 1} and a group of all; job rank 3 (group rank
 * 0 of its pair) dies while every rank runs operations on its pair. */
static int dies(struct child_arg *a, ps_coll *c) {
  const int r = a->rank;
  ps_coll *g = NULL, *all = NULL;
  ps_status st = ps_coll_split(c, r % 2, -r, &g);
  if (st == PS_OK) st = ps_coll_split(c, 0, r, &all);
  if (st == PS_OK && r == 3) {
    float f[100] = {0};
    for (int k = 0; k < 20; k++) ps_coll_allreduce(g, f, 100, PS_REDOP_SUM);
    _exit(3); /* as kill -9, without ps_coll_close */
  }
  double t0 = clock_now_s();
  for (int k = 0; st == PS_OK && clock_now_s() - t0 < 20; k++) {
    float f[100] = {0};
    st = ps_coll_allreduce(g, f, 100, PS_REDOP_SUM);
  }
  if (st != PS_OK) {
    float f = 0;
    ps_status st2 = ps_coll_allreduce(all, &f, 1, PS_REDOP_SUM); /* the other group fails too */
    if (st2 != st) dprintf(a->result_fd, "the group of all said %d after %d: ", st2, st);
  }
  coll_child_report(g ? g : c, st, a->result_fd);
  ps_coll_close(all);
  ps_coll_close(g);
  return 0;
}

static int child(void *ctx, struct ring_ports *gp, int rank, int fd) {
  const struct scene *sc = ctx;
  struct child_arg arg = {gp, rank, fd}, *a = &arg;
  struct ps_coll_opts o = coll_child_opts(gp, rank, "groups", sc->token);
  o.p2p = sc->scenario != NO_P2P;
  ps_coll *c = coll_child_open(&o, fd);
  if (!c) return 1;
  int ret = 0;
  if (sc->scenario == NO_P2P) {
    ps_coll *g = NULL;
    dprintf(fd, "%d", (int)ps_coll_split(c, 0, rank, &g));
  } else if (sc->scenario == MISMATCH) {
    ps_coll *g = NULL;
    char err[512];
    ps_status st = ps_coll_split(c, rank / 2, rank, &g);
    float f[11] = {0};
    if (st == PS_OK) st = ps_coll_allreduce(g, f, rank == 1 ? 11 : 10, PS_REDOP_SUM);
    if (st == PS_OK) st = ps_coll_barrier(c);
    dprintf(fd, "%d %s", (int)st, ps_coll_errmsg(g ? g : c, err, sizeof(err)));
    ps_coll_close(g);
  } else if (sc->scenario == ABORT) { /* job rank 2 aborts its pair group {2, 0} */
    ps_coll *g = NULL;
    char err[512];
    ps_status st = ps_coll_split(c, rank % 2, -rank, &g);
    if (st == PS_OK && rank == 2) st = ps_coll_abort(g, "bad batch on purpose");
    if (st == PS_OK) st = ps_coll_barrier(c);
    dprintf(fd, "%d %s", (int)st, ps_coll_errmsg(g ? g : c, err, sizeof(err)));
    ps_coll_close(g);
  } else if (sc->scenario == DIES) {
    ret = dies(a, c);
  } else if (sc->scenario == CLOSE_FIRST) { /* the job group closed before its group */
    ps_coll *g = NULL;
    float f = 1;
    ps_status st = ps_coll_split(c, 0, rank, &g);
    if (st == PS_OK) st = ps_coll_allreduce(g, &f, 1, PS_REDOP_SUM);
    if (st == PS_OK) st = ps_coll_barrier(c);
    ps_coll_close(c);
    c = NULL;
    ps_status after = st == PS_OK ? ps_coll_allreduce(g, &f, 1, PS_REDOP_SUM) : st;
    dprintf(fd, "%d %d %g", (int)st, (int)after, (double)f);
    ps_coll_close(g);
  } else {
    ret = script(a, c);
  }
  ps_coll_close(c);
  return ret;
}

int main(void) {
  harness_dir();
  char out[W][900];
  int status[W];
  ps_token *token = NULL;
  REQUIRE(ps_token_from_bytes("test_groups's token of the job", 30, &token) == PS_OK, "token");
  for (int v = 0; v < 2; v++) {
    double t0 = clock_now_s();
    struct scene sc = {GOOD, v ? token : NULL};
    ring_children_run(W, child, &sc, 90000, out[0], sizeof(out[0]), status);
    for (int r = 0; r < W; r++)
      REQUIRE(ring_exited(status[r], 0), "%s: job rank %d failed (status %d): %s",
              v ? "with a token" : "", r, status[r], out[r]);
    printf("W=4 %-13s every group operation as expected, in %.2f s (%s)\n", v ? "with a token" : "",
           clock_now_s() - t0, out[0]);
  }

  struct scene sc = {NO_P2P, NULL};
  ring_children_run(2, child, &sc, 30000, out[0], sizeof(out[0]), status);
  for (int r = 0; r < 2; r++)
    REQUIRE(ring_exited(status[r], 0) && atoi(out[r]) == PS_ERR_STATE,
            "a split without p2p should be PS_ERR_STATE: rank %d: %s", r, out[r]);
  printf("without p2p: ps_coll_split is PS_ERR_STATE\n");

  double t0 = clock_now_s();
  sc = (struct scene){MISMATCH, token};
  ring_children_run(W, child, &sc, 30000, out[0], sizeof(out[0]), status);
  for (int r = 0; r < 2; r++)
    REQUIRE(ring_exited(status[r], 0) && atoi(out[r]) == PS_ERR_STATE &&
                strstr(out[r], "ranks disagree") && strstr(out[r], "count 11"),
            "mismatch in a group: job rank %d (status %d): %s", r, status[r], out[r]);
  REQUIRE(clock_now_s() - t0 < 10, "mismatch took %.1f s", clock_now_s() - t0);
  printf("mismatch in a group: %s\n", out[1]);

  t0 = clock_now_s();
  sc = (struct scene){ABORT, token};
  ring_children_run(W, child, &sc, 30000, out[0], sizeof(out[0]), status);
  for (int r = 0; r < W; r++)
    REQUIRE(ring_exited(status[r], 0) && atoi(out[r]) == PS_ERR_STATE &&
                strstr(out[r], "rank 2: bad batch on purpose"),
            "abort of a group: job rank %d (status %d): %s", r, status[r], out[r]);
  REQUIRE(clock_now_s() - t0 < 10, "abort took %.1f s", clock_now_s() - t0);
  printf("abort of a group fails the job: %s\n", out[1]);

  t0 = clock_now_s();
  sc = (struct scene){DIES, token};
  ring_children_run(W, child, &sc, 40000, out[0], sizeof(out[0]), status);
  coll_expect_lost("operations on groups", W, 3, out[0], sizeof(out[0]), status, t0);

  sc = (struct scene){CLOSE_FIRST, NULL};
  ring_children_run(2, child, &sc, 30000, out[0], sizeof(out[0]), status);
  for (int r = 0; r < 2; r++) {
    int st = -1, after = -1;
    double f = 0;
    REQUIRE(ring_exited(status[r], 0) && sscanf(out[r], "%d %d %lf", &st, &after, &f) == 3 &&
                st == PS_OK && after == PS_ERR_STATE && f == 2,
            "the job group closed first: rank %d (status %d) said \"%s\", want \"%d %d 2\"", r,
            status[r], out[r], PS_OK, PS_ERR_STATE);
  }
  printf("the job group closed before its group: the group's operations are PS_ERR_STATE\n");
  ps_token_free(token);
  return harness_status();
}
