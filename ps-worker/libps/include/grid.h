/* grid: the 3D rank grid of tensor (t), pipeline (p) and data (d) parallelism
 * over a job group of W = t * p * d ranks, in Megatron-LM's rank order:
 *
 *   rank = tp_rank + t * (dp_rank + d * pp_rank)
 *
 * tensor-parallel ranks adjacent (so a launcher or Kubernetes that places
 * consecutive ranks on one node keeps each tensor-parallel group inside a
 * node), then data-parallel, then pipeline (DeepSpeed's
 * PipeModelDataParallelTopology is the same order). The pure functions below
 * need no group; ps_grid_new forms the three groups with ps_coll_split. */
#ifndef PS_GRID_H
#define PS_GRID_H

#include <stddef.h>

#include "collective.h"
#include "ps.h"

#ifdef __cplusplus
extern "C" {
#endif

struct ps_grid_coords {
  int tp, dp, pp; /* this rank's place on each axis */
};

/* Checks that world = tp * pp * d for a whole d >= 1 (tp, pp >= 1) and
 * writes d; else PS_ERR_INVALID with a message naming the numbers in err. */
ps_status ps_grid_dims(int world, int tp, int pp, int *dp, char *err, size_t errlen);
/* rank -> coordinates, and back; -1 / PS_ERR_INVALID out of range. */
ps_status ps_grid_coords_of(int world, int tp, int pp, int rank, struct ps_grid_coords *out);
int ps_grid_rank_of(int world, int tp, int pp, struct ps_grid_coords c);
/* The job ranks of the group of `axis` ('t', 'd' or 'p') that holds rank, in
 * group-rank order, into ranks (size: that axis's length); returns how many,
 * or -1 for bad arguments. */
int ps_grid_group_ranks(int world, int tp, int pp, int rank, char axis, int *ranks);
/* With each rank's node name (nodes[W]; NULL or "" = unknown): how many
 * tensor-parallel groups span more than one node; the first such group is
 * described in msg ("tensor-parallel group 1 (ranks 4-7) spans nodes a, b").
 * 0 when every group is inside one node or a name is unknown. */
int ps_grid_tp_spanning(int world, int tp, int pp, const char *const *nodes, char *msg,
                        size_t msglen);

typedef struct ps_grid ps_grid;

/* Collective over job (every rank calls it): forms the tensor-, data- and
 * pipeline-parallel groups of this rank (three ps_coll_split calls) and, when
 * job was opened with a node name (ps_coll_opts.node), gathers every rank's
 * node and logs a warning naming a tensor-parallel group that spans nodes.
 * Errors: ps_grid_dims's (PS_ERR_INVALID, refused before anything is issued);
 * ranks that passed different tp or pp: PS_ERR_INVALID on every rank, naming
 * one that differs from rank 0 (one all-gather compares them); ps_coll_split's. */
ps_status ps_grid_new(ps_coll *job, int tp, int pp, ps_grid **out, char *err, size_t errlen);
/* Closes the three groups (not the job group). Accepts NULL. */
void ps_grid_free(ps_grid *g);
struct ps_grid_coords ps_grid_coords(const ps_grid *g);
int ps_grid_size(const ps_grid *g, char axis); /* t, d or p; 0 for another letter */
/* The group of one axis ('t', 'd', 'p'), owned by the grid; NULL for another letter. */
ps_coll *ps_grid_group(const ps_grid *g, char axis);
/* ps_grid_tp_spanning's count for this job (0 without node names). */
int ps_grid_tp_groups_spanning_nodes(const ps_grid *g);

#ifdef __cplusplus
}
#endif
#endif
