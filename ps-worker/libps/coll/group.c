/* group: the groups of ps_coll_split (collective.h, "Groups"), MPI_Comm_split
 * over the job's point-to-point connections.
 *
 * A group is a ps_coll whose job_group points at the job's: the job group
 * owns every socket, the failure state, the request queue and its worker
 * thread, and a group's operations are queued and run there (collective.c
 * routes them here, group_run), so one thread at a time touches the p2p
 * state. Ranks inside a group are group ranks; members[] turns them into job
 * ranks for p2p.c, and every message carries the group's id, so a receive
 * takes only its group's messages (another group's wait in the early
 * arrivals' queue).
 *
 * The id: a hash of the parent's id, how many splits the parent has done and
 * the color, so every member computes the same id with no exchange, and the
 * groups of one split (other colors), of other splits and of other parents
 * get other ids (the job group is 0).
 *
 * Every collective starts by passing a descriptor (kind, sizes, type, op,
 * root, the group's operation number) around the members' ring; a member
 * whose predecessor called something else fails the job group with
 * PS_ERR_STATE naming both, which the watchdog passes on to every rank. The
 * reductions are a ring of reduce-scatter then all-gather steps over the
 * members (gring_allreduce, shared with the node-first all-reduce): each
 * chunk is combined in one fixed order at one member and only copied from
 * there, so every member gets the same bits; small ones ((W-1) x bytes up to
 * 256 KiB) gather every member's buffer and combine them in group rank order
 * on each member, W-1 steps instead of 2(W-1). Broadcast is the root sending
 * to each member, all-to-all W-1 pairwise exchanges, the barrier a
 * dissemination barrier (log2 W rounds of empty messages). A group of one
 * rank copies locally and sends nothing. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "collective_impl.h"
#include "dtype.h"
#include "log.h"
#include "ring.h"
#include "ring_impl.h" /* ring_combine */

#define DESC_MAGIC 0x50524750u /* "PGRP" */
/* (W-1) x bytes up to this all-reduce by all-gather (ps_coll_opts.small_bytes' default) */
#define SMALL_BYTES (256u << 10)

/* What every member of a collective must agree on. */
struct desc {
  uint32_t magic, kind, dtype, redop;
  int32_t root, pad;
  uint64_t count;
  uint32_t seq, pad2;
};

static const char *kind_name(int k) {
  static const char *const names[] = {
      [REQ_ALLREDUCE] = "allreduce",
      [REQ_BROADCAST] = "broadcast",
      [REQ_BARRIER] = "barrier",
      [REQ_ALLGATHER] = "allgather",
      [REQ_REDUCE_SCATTER] = "reduce_scatter",
      [REQ_REDUCE] = "reduce",
      [REQ_ALLTOALL] = "alltoall",
      [REQ_SENDRECV] = "send/recv",
  };
  return k >= 0 && k <= REQ_SENDRECV ? names[k] : "?";
}

static int mod(int a, int w) {
  return ((a % w) + w) % w;
}

/* Chunk j of n elements among k parts: equal, the last ones shorter. */
static void chunk(size_t n, int k, int j, size_t *off, size_t *len) {
  size_t per = (n + (size_t)k - 1) / (size_t)k;
  size_t a = (size_t)j * per, b = a + per;
  *off = a < n ? a : n;
  *len = (b < n ? b : n) - *off;
}

/* One exchange with the ring neighbours (positions), under the ring's id. */
static ps_status shift(const struct gring *g, const void *send, size_t sb, void *recv, size_t rb) {
  int next = g->members[mod(g->me + 1, g->n)], prev = g->members[mod(g->me - 1, g->n)];
  return p2p_run_gid(g->job, g->gid, send, sb, next, recv, rb, prev);
}

/* Reduce-scatter over n chunks of total elements (z bytes): at step s this
 * rank sends chunk me-s-k and combines chunk me-s-k-1 with what its
 * predecessor sent; at the end it holds chunk me+1-k combined over all. */
static ps_status gring_rs(const struct gring *g, char *buf, size_t total, enum dtype dt, int op,
                          int k) {
  const size_t z = dtype_size(dt);
  size_t so, sl, ro, rl;
  for (int s = 0; s < g->n - 1; s++) {
    chunk(total, g->n, mod(g->me - s - k, g->n), &so, &sl);
    chunk(total, g->n, mod(g->me - s - k - 1, g->n), &ro, &rl);
    ps_status st = shift(g, buf + so * z, sl * z, g->scratch, rl * z);
    if (st != PS_OK) return st;
    ring_combine(dt, (enum ring_redop)op, buf + ro * z, g->scratch, rl);
  }
  return PS_OK;
}

/* All-gather of the n chunks (z bytes per element) when this rank holds
 * chunk me+1-k. */
static ps_status gring_ag(const struct gring *g, char *buf, size_t total, size_t z, int k) {
  size_t so, sl, ro, rl;
  for (int s = 0; s < g->n - 1; s++) {
    chunk(total, g->n, mod(g->me + 1 - k - s, g->n), &so, &sl);
    chunk(total, g->n, mod(g->me - k - s, g->n), &ro, &rl);
    ps_status st = shift(g, buf + so * z, sl * z, buf + ro * z, rl * z);
    if (st != PS_OK) return st;
  }
  return PS_OK;
}

ps_status gring_allreduce(const struct gring *g, void *buf, size_t count, int dt, int op) {
  ps_status st = gring_rs(g, buf, count, (enum dtype)dt, op, 0);
  return st == PS_OK ? gring_ag(g, buf, count, dtype_size(dt), 0) : st;
}

/* ---- the group's operations ---- */

static ps_status no_memory(ps_coll *g, size_t bytes, const char *what) {
  coll_fail(g->job_group, PS_ERR_NOMEM, -1, "no memory for a %zu-byte %s on group %016llx", bytes,
            what, (unsigned long long)g->gid);
  return ps_coll_status(g->job_group);
}

/* Group rank r to job rank; -1 stays -1 (that half left out). */
static int job_of(const ps_coll *g, int r) {
  return r < 0 ? -1 : g->members[r];
}

/* Every member's call matches its predecessor's (see the top). */
static ps_status agree(ps_coll *g, const struct coll_op *o) {
  struct desc mine = {.magic = DESC_MAGIC,
                      .kind = (uint32_t)o->kind,
                      .dtype = (uint32_t)o->dtype,
                      .redop = (uint32_t)o->redop,
                      .root = o->root,
                      .count = o->count,
                      .seq = g->op_seq++},
              theirs;
  struct gring ring = {g->job_group, g->gid, g->members, g->world, g->rank, NULL};
  ps_status st = shift(&ring, &mine, sizeof(mine), &theirs, sizeof(theirs));
  if (st != PS_OK) return st;
  if (!memcmp(&mine, &theirs, sizeof(mine))) return PS_OK;
  int prev = g->members[mod(g->rank - 1, g->world)];
  coll_fail(g->job_group, PS_ERR_STATE, -1,
            "ranks disagree in group %016llx: job rank %d called %s(count %llu, %s, op %u, root "
            "%d) as the group's operation %u, where job rank %d called %s(count %llu, %s, op %u, "
            "root %d) as its operation %u",
            (unsigned long long)g->gid, g->job_group->rank, kind_name((int)mine.kind),
            (unsigned long long)mine.count, dtype_name((int)mine.dtype), mine.redop, mine.root,
            mine.seq, prev, kind_name((int)theirs.kind), (unsigned long long)theirs.count,
            dtype_name((int)theirs.dtype), theirs.redop, theirs.root, theirs.seq);
  return ps_coll_status(g->job_group);
}

/* A small all-reduce: every member's buffer to every member (an all-gather,
 * W-1 steps instead of the ring's 2(W-1)), then each member combines them
 * in group rank order itself, so all get the same bits. */
static ps_status allreduce_small(ps_coll *g, char *buf, size_t count, enum dtype dt, int op) {
  const size_t bytes = count * dtype_size(dt);
  char *all = malloc(bytes * (size_t)g->world);
  if (!all) return no_memory(g, bytes * (size_t)g->world, "all-reduce");
  memcpy(all + (size_t)g->rank * bytes, buf, bytes);
  struct gring ring = {g->job_group, g->gid, g->members, g->world, g->rank, NULL};
  ps_status st = gring_ag(&ring, all, bytes * (size_t)g->world, 1, 1);
  if (st == PS_OK) {
    memcpy(buf, all, bytes);
    for (int j = 1; j < g->world; j++)
      ring_combine(dt, (enum ring_redop)op, buf, all + (size_t)j * bytes, count);
  }
  free(all);
  return st;
}

/* A reduction of count elements of dt in place (the all-reduce's work). */
static ps_status allreduce(ps_coll *g, void *buf, size_t count, enum dtype dt, int op) {
  size_t z = dtype_size(dt), per = (count + (size_t)g->world - 1) / (size_t)g->world;
  if (count * z * (size_t)(g->world - 1) <= SMALL_BYTES) {
    ps_status st = allreduce_small(g, buf, count, dt, op);
    if (st == PS_OK && op == RING_AVG) dtype_divide(dt, buf, count, g->world);
    return st;
  }
  void *scratch = malloc(per * z + 1);
  if (!scratch) return no_memory(g, per * z, "all-reduce chunk");
  struct gring ring = {g->job_group, g->gid, g->members, g->world, g->rank, scratch};
  ps_status st = gring_allreduce(&ring, buf, count, (int)dt, op);
  free(scratch);
  if (st == PS_OK && op == RING_AVG) dtype_divide(dt, buf, count, g->world);
  return st;
}

static ps_status reduce_scatter(ps_coll *g, const char *send, char *recv, size_t count,
                                enum dtype dt, int op) {
  const size_t z = dtype_size(dt), mine = count * z, all = mine * (size_t)g->world;
  char *work = malloc(all + mine + 1);
  if (!work) return no_memory(g, all + mine, "reduce-scatter");
  memcpy(work, send, all);
  struct gring ring = {g->job_group, g->gid, g->members, g->world, g->rank, work + all};
  ps_status st = gring_rs(&ring, work, count * (size_t)g->world, dt, op, 1);
  if (st == PS_OK) {
    memcpy(recv, work + (size_t)g->rank * mine, mine);
    if (op == RING_AVG) dtype_divide(dt, recv, count, g->world);
  }
  free(work);
  return st;
}

static ps_status reduce(ps_coll *g, void *buf, size_t count, enum dtype dt, int op, int root) {
  const size_t bytes = count * dtype_size(dt);
  char *work = malloc(bytes + 1);
  if (!work) return no_memory(g, bytes, "reduce");
  memcpy(work, buf, bytes);
  ps_status st = allreduce(g, work, count, dt, op);
  if (st == PS_OK && g->rank == root) memcpy(buf, work, bytes);
  free(work);
  return st;
}

static ps_status broadcast(ps_coll *g, void *buf, size_t bytes, int root) {
  if (g->rank != root)
    return p2p_run_gid(g->job_group, g->gid, NULL, 0, -1, buf, bytes, job_of(g, root));
  for (int d = 0; d < g->world; d++) {
    if (d == root) continue;
    ps_status st = p2p_run_gid(g->job_group, g->gid, buf, bytes, job_of(g, d), NULL, 0, -1);
    if (st != PS_OK) return st;
  }
  return PS_OK;
}

static ps_status alltoall(ps_coll *g, const char *send, char *recv, size_t bytes) {
  const int W = g->world, r = g->rank;
  memcpy(recv + (size_t)r * bytes, send + (size_t)r * bytes, bytes);
  for (int k = 1; k < W; k++) {
    int to = (r + k) % W, from = (r + W - k) % W;
    ps_status st = p2p_run_gid(g->job_group, g->gid, send + (size_t)to * bytes, bytes,
                               job_of(g, to), recv + (size_t)from * bytes, bytes, job_of(g, from));
    if (st != PS_OK) return st;
  }
  return PS_OK;
}

static ps_status barrier(ps_coll *g) {
  const int W = g->world, r = g->rank;
  for (int k = 1; k < W; k <<= 1) {
    ps_status st = p2p_run_gid(g->job_group, g->gid, NULL, 0, job_of(g, (r + k) % W), NULL, 0,
                               job_of(g, (r + W - k) % W));
    if (st != PS_OK) return st;
  }
  return PS_OK;
}

/* A group of one: what each collective leaves in its output. */
static ps_status alone(const struct coll_op *o) {
  size_t bytes = o->count * (o->kind == REQ_REDUCE_SCATTER ? dtype_size(o->dtype) : 1);
  if ((o->kind == REQ_ALLGATHER || o->kind == REQ_REDUCE_SCATTER || o->kind == REQ_ALLTOALL) &&
      bytes && o->buf != o->src)
    memmove(o->buf, o->src, bytes);
  return PS_OK;
}

ps_status group_run(ps_coll *g, const struct coll_op *o) {
  if (o->kind == REQ_SENDRECV)
    return p2p_run_gid(g->job_group, g->gid, o->src, o->count, job_of(g, o->root), o->buf,
                       o->rcount, job_of(g, o->from));
  if (g->world == 1) return alone(o);
  ps_status st = agree(g, o);
  if (st != PS_OK || o->count == 0) return st;
  enum dtype dt = (enum dtype)o->dtype;
  switch (o->kind) {
    case REQ_ALLREDUCE:
      return allreduce(g, o->buf, o->count, dt, o->redop);
    case REQ_BROADCAST:
      return broadcast(g, o->buf, o->count, o->root);
    case REQ_ALLGATHER: {
      char *recv = o->buf;
      size_t mine = (size_t)g->rank * o->count;
      if (recv + mine != o->src) memmove(recv + mine, o->src, o->count);
      struct gring ring = {g->job_group, g->gid, g->members, g->world, g->rank, NULL};
      return gring_ag(&ring, recv, o->count * (size_t)g->world, 1, 1);
    }
    case REQ_REDUCE_SCATTER:
      return reduce_scatter(g, o->src, o->buf, o->count, dt, o->redop);
    case REQ_REDUCE:
      return reduce(g, o->buf, o->count, dt, o->redop, o->root);
    case REQ_ALLTOALL:
      return alltoall(g, o->src, o->buf, o->count);
    default:
      return barrier(g);
  }
}

/* ---- split ---- */

static uint64_t mix(uint64_t x) { /* splitmix64's finaliser */
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

void not_member_msg(const ps_coll *g, char *buf, size_t len) {
  snprintf(buf, len,
           "job rank %d is not in this group (it passed PS_COLL_UNDEFINED to ps_coll_split): "
           "it takes part in none of its operations",
           g->job_group->rank);
}

void group_free(ps_coll *g) {
  if (!g) return;
  free(g->members);
  free(g);
}

ps_status ps_coll_split(ps_coll *parent, int color, int key, ps_coll **group) {
  if (!parent || !group || color < PS_COLL_UNDEFINED) return PS_ERR_INVALID;
  *group = NULL;
  ps_coll *job = coll_job(parent);
  if (!job->has_p2p) {
    char why[160];
    snprintf(why, sizeof(why),
             "ps_coll_split needs the job group opened with p2p (job rank %d has none)", job->rank);
    log_error("cannot split a collective group", "error=\"%s\"", why);
    return PS_ERR_STATE;
  }
  ps_status st = ps_coll_status(parent);
  if (st != PS_OK) return st;
  if (parent->rank < 0) return PS_ERR_STATE;
  const int W = parent->world;
  int32_t mine[2] = {color, key}, *all = malloc((size_t)W * sizeof(mine));
  ps_coll *g = calloc(1, sizeof(*g));
  if (g) g->members = malloc((size_t)W * sizeof(int));
  if (!all || !g || !g->members) {
    st = PS_ERR_NOMEM;
    goto out;
  }
  st = ps_coll_allgather(parent, mine, all, sizeof(mine));
  if (st != PS_OK) goto out;
  g->job_group = job;
  g->has_p2p = true;
  g->lost = -1;
  g->rank = -1;
  g->gid = mix(mix(parent->gid ^ mix(parent->splits++)) ^ (uint64_t)(uint32_t)color);
  if (g->gid == 0) g->gid = 1;
  /* members: the parent ranks of this color by (key, parent rank) */
  if (color != PS_COLL_UNDEFINED)
    for (int p = 0; p < W; p++) {
      if (all[2 * p] != color) continue;
      int at = g->world++;
      while (at > 0) {
        int q = g->members[at - 1];
        if (all[2 * q + 1] < all[2 * p + 1] || (all[2 * q + 1] == all[2 * p + 1] && q < p)) break;
        g->members[at] = q;
        at--;
      }
      g->members[at] = p;
    }
  for (int i = 0; i < g->world; i++) {
    if (g->members[i] == parent->rank) g->rank = i;
    g->members[i] = ps_coll_job_rank(parent, g->members[i]);
  }
  log_info("collective group", "job_rank=%d gid=%016llx color=%d rank=%d size=%d", job->rank,
           (unsigned long long)g->gid, color, g->rank, g->world);
  pthread_mutex_lock(&job->mu);
  job->open_groups++;
  pthread_mutex_unlock(&job->mu);
  *group = g;
  g = NULL;
out:
  free(all);
  group_free(g);
  return st;
}

int ps_coll_job_rank(const ps_coll *c, int r) {
  if (!c || r < 0 || r >= c->world) return -1;
  return c->job_group ? c->members[r] : r;
}

uint64_t ps_coll_group_id(const ps_coll *c) {
  return c ? c->gid : 0;
}
