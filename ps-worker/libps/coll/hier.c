/* hier: the node-first all-reduce (ps_coll_opts.node_first), Horovod's
 * hierarchical all-reduce on libps's own connections. Ranks that share a
 * node (the same ps_coll_opts.node, exchanged once at open) reduce to their
 * node's leader, its lowest rank; the leaders all-reduce among themselves,
 * one per node, in a ring of reduce-scatter then all-gather steps; each
 * leader sends the result back to the ranks of its node. So the links
 * between nodes carry 2(N-1)/N of the buffer per leader, N nodes, instead
 * of the flat ring's 2(W-1)/W per rank with every rank's traffic crossing
 * wherever the ring crosses: with W = 4 ranks on 2 nodes, 1 buffer each way
 * across instead of 1.5 (ranks placed in node order) or 3 (alternating).
 *
 * Everything moves over the point-to-point connections (p2p.c), which
 * node_first turns on; within a node they go over loopback (shared memory
 * once a transport that has it carries them). Each call starts with ring_agree,
 * so a rank that called something else fails with PS_ERR_STATE naming both,
 * and every failure of p2p_run (a lost rank, named) is the group's.
 *
 * Every rank ends with the same bits: each chunk's final sum is formed at
 * one leader (in a fixed order) and only copied from there. */
#include "hier.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "collective_impl.h"
#include "log.h"
#include "ring.h"
#include "ring_impl.h" /* ring_combine */

enum { NODE_NAME_MAX = 256 };

struct hier {
  int nlocal, *local;   /* this node's ranks, ascending: local[0] leads */
  int nnodes, *leaders; /* each node's leader, ascending */
  int me;               /* this rank's index in leaders, or -1 */
  char *scratch;        /* what a peer sent, before it is combined */
  size_t scratch_cap;   /* bytes */
};

void hier_free(struct hier *h) {
  if (!h) return;
  free(h->local);
  free(h->leaders);
  free(h->scratch);
  free(h);
}

int hier_new(ps_coll *c, const char *node, struct hier **out) {
  *out = NULL;
  const int W = c->world;
  char *names = calloc((size_t)W, NODE_NAME_MAX);
  if (!names) return -ENOMEM;
  char mine[NODE_NAME_MAX] = "";
  snprintf(mine, sizeof(mine), "%s", node ? node : "");
  int r = ring_allgather(c->ring, mine, names, NODE_NAME_MAX);
  if (r < 0) {
    free(names);
    return r;
  }
  /* node[q]: the lowest rank with q's name (its leader); "" on any rank: no
   * node-first anywhere (every rank sees the same names) */
  int *lead = calloc((size_t)W, sizeof(int));
  struct hier *h = calloc(1, sizeof(*h));
  int ret = -ENOMEM;
  if (!lead || !h) goto out;
  bool unknown = false;
  for (int q = 0; q < W; q++) {
    const char *nq = names + (size_t)q * NODE_NAME_MAX;
    unknown = unknown || !nq[0];
    lead[q] = q;
    for (int p = 0; p < q; p++)
      if (strncmp(names + (size_t)p * NODE_NAME_MAX, nq, NODE_NAME_MAX) == 0) {
        lead[q] = p;
        break;
      }
  }
  h->local = calloc((size_t)W, sizeof(int));
  h->leaders = calloc((size_t)W, sizeof(int));
  if (!h->local || !h->leaders) goto out;
  h->me = -1;
  for (int q = 0; q < W; q++) {
    if (lead[q] == lead[c->rank]) h->local[h->nlocal++] = q;
    if (lead[q] == q) {
      if (q == c->rank) h->me = h->nnodes;
      h->leaders[h->nnodes++] = q;
    }
  }
  ret = 0;
  if (unknown || h->nnodes == 1 || h->nnodes == W) {
    log_info("node-first all-reduce not used", "rank=%d nodes=%d ranks=%d reason=\"%s\"", c->rank,
             h->nnodes, W,
             unknown          ? "a rank does not know its node"
             : h->nnodes == 1 ? "every rank is on one node"
                              : "no two ranks share a node");
    goto out;
  }
  log_info("node-first all-reduce", "rank=%d node=\"%s\" nodes=%d leader=%d local_ranks=%d",
           c->rank, mine, h->nnodes, h->local[0], h->nlocal);
  *out = h;
  h = NULL;
out:
  hier_free(h);
  free(lead);
  free(names);
  return ret;
}

/* The leaders' ring over buf (count elements of dt): group.c's ring, on the
 * job group's id. */
static ps_status leaders_allreduce(ps_coll *c, struct hier *h, char *buf, size_t count,
                                   enum dtype dt, enum ring_redop op) {
  struct gring ring = {c, 0, h->leaders, h->nnodes, h->me, h->scratch};
  return gring_allreduce(&ring, buf, count, (int)dt, (int)op);
}

ps_status hier_allreduce(ps_coll *c, struct hier *h, void *data, size_t count, enum dtype dt,
                         enum ring_redop op) {
  if (count == 0) return PS_OK;
  char *buf = data;
  const size_t z = dtype_size(dt), bytes = count * z;
  const bool leads = h->me >= 0;
  if (leads && bytes > h->scratch_cap) {
    char *p = realloc(h->scratch, bytes);
    if (!p) {
      coll_fail(c, PS_ERR_NOMEM, -1, "no memory for a node-first all-reduce of %zu %s", count,
                dtype_name(dt));
      return ps_coll_status(c);
    }
    h->scratch = p;
    h->scratch_cap = bytes;
  }
  ps_status st = PS_OK;
  if (!leads) { /* to the leader, and the result back from it */
    st = p2p_run(c, buf, bytes, h->local[0], NULL, 0, -1);
    return st == PS_OK ? p2p_run(c, NULL, 0, -1, buf, bytes, h->local[0]) : st;
  }
  for (int k = 1; k < h->nlocal && st == PS_OK; k++) { /* this node's sum, in rank order */
    st = p2p_run(c, NULL, 0, -1, h->scratch, bytes, h->local[k]);
    if (st == PS_OK) ring_combine(dt, op, buf, h->scratch, count);
  }
  if (st == PS_OK) st = leaders_allreduce(c, h, buf, count, dt, op);
  if (st != PS_OK) return st;
  if (op == RING_AVG) dtype_divide(dt, buf, count, c->world);
  for (int k = 1; k < h->nlocal && st == PS_OK; k++)
    st = p2p_run(c, buf, bytes, h->local[k], NULL, 0, -1);
  return st;
}
