/* grid: the 3D rank grid of grid.h in Megatron-LM's order,
 *
 *   rank = tp_rank + t * (dp_rank + d * pp_rank),
 *
 * and its three groups. The pure functions are arithmetic on that formula:
 * tensor-parallel group g is the t consecutive ranks g t .. g t + t - 1, a
 * data-parallel group strides by t, a pipeline group by t d. ps_grid_new
 * forms the three groups with ps_coll_split in a fixed order (tensor, data,
 * pipeline), each colored by the coordinates the group shares and keyed by
 * the one it varies, so group rank = coordinate on that axis; then it
 * all-gathers every rank's node name (fixed 256-byte slots, on every rank
 * whether or not it has a name, so the ranks always issue the same
 * collectives) and warns, on job rank 0, about tensor-parallel groups that
 * span nodes: their all-reduces run on every layer and would cross the
 * slowest link. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "collective_impl.h"
#include "grid.h"
#include "log.h"

#define ERR(...) (errlen > 0 ? (void)snprintf(err, errlen, __VA_ARGS__) : (void)0)

enum { NODE_BYTES = sizeof(((struct ps_coll *)0)->node) };

struct ps_grid {
  struct ps_grid_coords at;
  int t, d, p;
  ps_coll *tp_group, *dp_group, *pp_group;
  int spanning;
};

ps_status ps_grid_dims(int world, int tp, int pp, int *dp, char *err, size_t errlen) {
  if (world < 1 || tp < 1 || pp < 1) {
    ERR("bad grid: world size %d, tensor-parallel %d, pipeline-parallel %d (each must be >= 1)",
        world, tp, pp);
    return PS_ERR_INVALID;
  }
  if (world % tp != 0 || (world / tp) % pp != 0) {
    ERR("world size %d is not divisible by tensor-parallel %d x pipeline-parallel %d", world, tp,
        pp);
    return PS_ERR_INVALID;
  }
  if (dp) *dp = world / tp / pp;
  return PS_OK;
}

ps_status ps_grid_coords_of(int world, int tp, int pp, int rank, struct ps_grid_coords *out) {
  int d;
  if (ps_grid_dims(world, tp, pp, &d, NULL, 0) != PS_OK || rank < 0 || rank >= world || !out) {
    return PS_ERR_INVALID;
  }
  out->tp = rank % tp;
  out->dp = rank / tp % d;
  out->pp = rank / (tp * d);
  return PS_OK;
}

int ps_grid_rank_of(int world, int tp, int pp, struct ps_grid_coords c) {
  int d;
  if (ps_grid_dims(world, tp, pp, &d, NULL, 0) != PS_OK) return -1;
  if (c.tp < 0 || c.tp >= tp || c.dp < 0 || c.dp >= d || c.pp < 0 || c.pp >= pp) return -1;
  return c.tp + tp * (c.dp + d * c.pp);
}

int ps_grid_group_ranks(int world, int tp, int pp, int rank, char axis, int *ranks) {
  struct ps_grid_coords c;
  int d, len;
  if (!ranks || ps_grid_coords_of(world, tp, pp, rank, &c) != PS_OK) return -1;
  d = world / tp / pp;
  len = axis == 't' ? tp : axis == 'd' ? d : axis == 'p' ? pp : -1;
  for (int i = 0; i < len; i++) {
    struct ps_grid_coords x = c;
    *(axis == 't' ? &x.tp : axis == 'd' ? &x.dp : &x.pp) = i;
    ranks[i] = ps_grid_rank_of(world, tp, pp, x);
  }
  return len;
}

static int known(const char *node) {
  return node && node[0];
}

int ps_grid_tp_spanning(int world, int tp, int pp, const char *const *nodes, char *msg,
                        size_t msglen) {
  int count = 0;
  if (msglen > 0) msg[0] = 0;
  if (!nodes || ps_grid_dims(world, tp, pp, NULL, NULL, 0) != PS_OK) return 0;
  for (int r = 0; r < world; r++) {
    if (!known(nodes[r])) return 0;
  }
  for (int g = 0; g < world / tp; g++) {
    int first = g * tp, spans = 0;
    for (int r = first + 1; r < first + tp; r++) spans |= strcmp(nodes[r], nodes[first]) != 0;
    if (!spans) continue;
    if (count++ == 0 && msglen > 0) {
      size_t used =
          (size_t)snprintf(msg, msglen, "tensor-parallel group %d (ranks %d-%d) spans nodes", g,
                           first, first + tp - 1);
      for (int r = first; r < first + tp && used < msglen; r++) {
        int seen = 0;
        for (int q = first; q < r; q++) seen |= strcmp(nodes[q], nodes[r]) == 0;
        if (!seen) {
          used +=
              (size_t)snprintf(msg + used, msglen - used, "%s %s", r == first ? "" : ",", nodes[r]);
        }
      }
    }
  }
  return count;
}

/* Every rank's node name (ps_coll_opts.node) on every rank: W slots. */
static ps_status gather_nodes(ps_coll *job, char **slots, char *err, size_t errlen) {
  int w = ps_coll_world_size(job), rank = ps_coll_rank(job);
  char *all = calloc((size_t)w, NODE_BYTES);
  if (!all) {
    ERR("out of memory gathering the node names");
    return PS_ERR_NOMEM;
  }
  memcpy(all + (size_t)rank * NODE_BYTES, job->node, NODE_BYTES);
  ps_status st = ps_coll_allgather(job, all + (size_t)rank * NODE_BYTES, all, NODE_BYTES);
  if (st != PS_OK) {
    char why[256];
    ERR("cannot gather the node names: %s", ps_coll_errmsg(job, why, sizeof(why)));
    free(all);
    return st;
  }
  for (int r = 0; r < w; r++) all[(size_t)r * NODE_BYTES + NODE_BYTES - 1] = 0;
  *slots = all;
  return PS_OK;
}

static ps_status node_check(ps_grid *g, ps_coll *job, char *err, size_t errlen) {
  int w = ps_coll_world_size(job);
  char *all = NULL, msg[512];
  const char **names = calloc((size_t)w, sizeof(*names));
  ps_status st = names ? gather_nodes(job, &all, err, errlen) : PS_ERR_NOMEM;
  if (st == PS_ERR_NOMEM && !names) ERR("out of memory gathering the node names");
  if (st == PS_OK) {
    for (int r = 0; r < w; r++) names[r] = all + (size_t)r * NODE_BYTES;
    g->spanning = ps_grid_tp_spanning(w, g->t, g->p, names, msg, sizeof(msg));
    if (g->spanning > 0 && ps_coll_rank(job) == 0) {
      char q[600];
      log_warn(
          "tensor-parallel groups span nodes: their all-reduces cross the network on every "
          "layer; place consecutive ranks on one node",
          "groups=%d first=%s", g->spanning, log_quote(q, sizeof(q), msg));
    }
  }
  free(all);
  free(names);
  return st;
}

/* Every rank must ask for the same grid: ranks that split by different t
 * and p would form groups that do not match (a rank waiting in a group its
 * peers never formed). One all-gather of (t, p) over the job, and every rank
 * refuses the same disagreement, naming a rank that differs from rank 0. */
static ps_status same_grid(ps_coll *job, int tp, int pp, char *err, size_t errlen) {
  int w = ps_coll_world_size(job);
  int32_t mine[2] = {tp, pp}, *all = malloc((size_t)w * sizeof(mine));
  if (!all) {
    ERR("out of memory comparing the ranks' grids");
    return PS_ERR_NOMEM;
  }
  ps_status st = ps_coll_allgather(job, mine, all, sizeof(mine));
  if (st != PS_OK) {
    char why[256];
    ERR("cannot compare the ranks' grids: %s", ps_coll_errmsg(job, why, sizeof(why)));
  }
  for (int r = 1; st == PS_OK && r < w; r++)
    if (all[2 * r] != all[0] || all[2 * r + 1] != all[1]) {
      ERR("ps_grid_new: the ranks disagree on the grid: job rank %d asked for "
          "tensor-parallel %d x pipeline %d, job rank 0 for %d x %d (every rank must pass the "
          "same)",
          r, (int)all[2 * r], (int)all[2 * r + 1], (int)all[0], (int)all[1]);
      st = PS_ERR_INVALID;
    }
  free(all);
  return st;
}

ps_status ps_grid_new(ps_coll *job, int tp, int pp, ps_grid **out, char *err, size_t errlen) {
  ps_grid *g = NULL;
  ps_status st;
  int w, d;
  if (!job || !out) {
    ERR("ps_grid_new: no job group");
    return PS_ERR_INVALID;
  }
  *out = NULL;
  w = ps_coll_world_size(job);
  st = ps_grid_dims(w, tp, pp, &d, err, errlen);
  if (st != PS_OK) return st;
  st = same_grid(job, tp, pp, err, errlen);
  if (st != PS_OK) return st;
  g = calloc(1, sizeof(*g));
  if (!g) {
    ERR("out of memory for the grid");
    return PS_ERR_NOMEM;
  }
  g->t = tp, g->d = d, g->p = pp;
  ps_grid_coords_of(w, tp, pp, ps_coll_rank(job), &g->at);
  struct ps_grid_coords c = g->at;
  /* color: the index of this rank's group on that axis; key: its place in it */
  struct {
    ps_coll **group;
    int color, key;
    const char *name;
  } axes[3] = {
      {&g->tp_group, c.dp + d * c.pp, c.tp, "tensor"},
      {&g->dp_group, c.tp + tp * c.pp, c.dp, "data"},
      {&g->pp_group, c.tp + tp * c.dp, c.pp, "pipeline"},
  };
  for (int i = 0; i < 3; i++) {
    st = ps_coll_split(job, axes[i].color, axes[i].key, axes[i].group);
    if (st != PS_OK) {
      char why[256];
      ERR("cannot form the %s-parallel group: %s", axes[i].name,
          ps_coll_errmsg(job, why, sizeof(why)));
      goto fail;
    }
  }
  st = node_check(g, job, err, errlen);
  if (st != PS_OK) goto fail;
  *out = g;
  return PS_OK;
fail:
  ps_grid_free(g);
  return st;
}

void ps_grid_free(ps_grid *g) {
  if (!g) return;
  ps_coll_close(g->pp_group);
  ps_coll_close(g->dp_group);
  ps_coll_close(g->tp_group);
  free(g);
}

struct ps_grid_coords ps_grid_coords(const ps_grid *g) {
  return g->at;
}

int ps_grid_size(const ps_grid *g, char axis) {
  return axis == 't' ? g->t : axis == 'd' ? g->d : axis == 'p' ? g->p : 0;
}

ps_coll *ps_grid_group(const ps_grid *g, char axis) {
  return axis == 't' ? g->tp_group : axis == 'd' ? g->dp_group : axis == 'p' ? g->pp_group : NULL;
}

int ps_grid_tp_groups_spanning_nodes(const ps_grid *g) {
  return g->spanning;
}
