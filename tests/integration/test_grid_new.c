/* ps_grid_new (grid.h) in real processes on 127.0.0.1: W = 8 ranks as
 * t = 2, p = 2, d = 2, each told a node name. Every rank's coordinates are
 * Megatron's, each of its three groups holds the job ranks
 * ps_grid_group_ranks names, in that order (an all-gather of the job ranks
 * over the group), and all-reduces over exactly them (the sum of the members' job ranks); with
 * nodes of 2 ranks no tensor-parallel group spans nodes, with the ranks' nodes alternating every
 * one does (4 groups); a grid that does not divide the world is refused with PS_ERR_INVALID on
 * every rank, issuing nothing; ranks that ask for different grids (rank 5 t = 4, p = 1) are
 * refused on every rank, naming rank 5, and the job group still works after. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "coll_child.h"
#include "collective.h"
#include "grid.h"
#include "harness.h"
#include "ring_workers.h"

#define W 8

struct scene {
  const char *nodes[W];
  int spanning;
};

struct child_arg {
  int rank, world, result_fd;
};

static int script(struct child_arg *a, ps_coll *c, const struct scene *sc) {
  char msg[512], err[512];
  ps_grid *g = NULL;
  ps_status st = ps_grid_new(c, 3, 1, &g, err, sizeof(err));
  COLL_EXPECT(st == PS_ERR_INVALID && g == NULL && strstr(err, "not divisible"),
              "t=3 on W=8: %d %s", (int)st, err);
  /* rank 5 asks for another valid grid: every rank refuses, naming it */
  int t5 = a->rank == 5 ? 4 : 2, p5 = a->rank == 5 ? 1 : 2;
  st = ps_grid_new(c, t5, p5, &g, err, sizeof(err));
  COLL_EXPECT(st == PS_ERR_INVALID && g == NULL &&
                  strstr(err, "the ranks disagree on the grid: job rank 5 asked for "
                              "tensor-parallel 4 x pipeline 1, job rank 0 for 2 x 2"),
              "rank 5 with t=4 p=1: %d %s", (int)st, err);
  st = ps_grid_new(c, 2, 2, &g, err, sizeof(err));
  COLL_EXPECT(st == PS_OK, "ps_grid_new: %s", err);
  struct ps_grid_coords want, got = ps_grid_coords(g);
  ps_grid_coords_of(W, 2, 2, a->rank, &want);
  COLL_EXPECT(got.tp == want.tp && got.dp == want.dp && got.pp == want.pp, "coordinates");
  const char axes[3] = {'t', 'd', 'p'};
  for (int i = 0; i < 3; i++) {
    int ranks[W], n = ps_grid_group_ranks(W, 2, 2, a->rank, axes[i], ranks);
    ps_coll *grp = ps_grid_group(g, axes[i]);
    COLL_EXPECT(grp && ps_grid_size(g, axes[i]) == n && ps_coll_world_size(grp) == n,
                "axis %c: size", axes[i]);
    /* the members' job ranks, gathered over the group itself, in group order */
    int me = a->rank, seen[W];
    float sum = (float)a->rank, members = 0;
    COLL_OK(ps_coll_allgather(grp, &me, seen, sizeof(me)), "axis %c all-gather", axes[i]);
    for (int r = 0; r < n; r++) {
      COLL_EXPECT(seen[r] == ranks[r], "axis %c: group rank %d is job rank %d, want %d", axes[i], r,
                  seen[r], ranks[r]);
      members += (float)ranks[r];
    }
    COLL_OK(ps_coll_allreduce(grp, &sum, 1, PS_REDOP_SUM), "axis %c all-reduce", axes[i]);
    COLL_EXPECT(sum == members, "axis %c: sum %g, want %g", axes[i], sum, members);
  }
  COLL_EXPECT(ps_grid_tp_groups_spanning_nodes(g) == sc->spanning, "spanning %d, want %d",
              ps_grid_tp_groups_spanning_nodes(g), sc->spanning);
  ps_grid_free(g);
  COLL_OK(ps_coll_barrier(c), "barrier after %s", "ps_grid_free");
  dprintf(a->result_fd, "ok");
  return 0;
}

static int child(void *ctx, struct ring_ports *g, int rank, int fd) {
  const struct scene *sc = ctx;
  struct child_arg a = {rank, g->world, fd};
  struct ps_coll_opts o = coll_child_opts(g, rank, "grid", NULL);
  o.p2p = 1;
  o.node = sc->nodes[rank];
  ps_coll *c = coll_child_open(&o, fd);
  if (!c) return 1;
  int ret = script(&a, c, sc);
  ps_coll_close(c);
  return ret;
}

int main(void) {
  harness_dir();
  char out[W][700];
  int status[W];
  struct scene scenes[] = {
      {{"n0", "n0", "n1", "n1", "n2", "n2", "n3", "n3"}, 0},
      {{"a", "b", "a", "b", "a", "b", "a", "b"}, 4},
  };
  for (size_t i = 0; i < sizeof(scenes) / sizeof(scenes[0]); i++) {
    ring_children_run(W, child, &scenes[i], 90000, out[0], sizeof(out[0]), status);
    for (int r = 0; r < W; r++) {
      REQUIRE(ring_exited(status[r], 0) && strcmp(out[r], "ok") == 0,
              "scene %zu: rank %d (status %d): %s", i, r, status[r], out[r]);
    }
    printf("scene %zu: every rank's groups as Megatron's, %d tensor-parallel groups span nodes\n",
           i, scenes[i].spanning);
  }
  return harness_status();
}
