/* trainer3d: the training loop of a 3D job (issue 32): tensor parallelism
 * inside a stage (mp_model.h), pipeline parallelism between stages
 * (pipeline.h's action lists) and data parallelism over replicas of the
 * whole pipeline (sync3d below), on the rank grid of grid.h.
 *
 * --batch-size B is per data-parallel replica: the global batch is B * D
 * (D = W / (T * P)); replica d takes slice d of it (data.h's sharding
 * convention with world = D, rank = d) and cuts it into M micro-batches of
 * B / M samples. Each step every rank zeroes its gradients and runs its
 * stage's action list in order: forwards and backwards through
 * mp_stage_*, activations and their gradients sent and received on the
 * pipeline group straight from and into the micro-batch's own buffer (no
 * staging copy), the data-parallel reduction at REDUCE_GRADS and the update
 * at OPTIMIZER_STEP. So one worker with M * D micro-batches computes the
 * same sums in another order: the equivalence tests hold every layout to
 * 1e-5 of it.
 *
 * After each epoch (and at the end) job rank 0 assembles the whole model:
 * replica 0 of every (stage, tensor rank) sends its slices over the job
 * group's point-to-point connections (replicated tensors from tensor rank 0
 * only) and rank 0 evaluates it with mlp_evaluate; --dump-params writes it
 * in the one-worker format.
 *
 * Failures: a libps failure on any group (a lost rank) is -ECONNRESET after
 * logging the group's message, which names the lost job rank (exit 129). */
#ifndef PS_TRAINER3D_H
#define PS_TRAINER3D_H

#include <stdbool.h>
#include <stdint.h>

#include "collective.h"
#include "data.h"
#include "grid.h"
#include "model.h"
#include "mp_model.h"
#include "pipeline.h"
#include "ps.h"
#include "sync_ring.h"

/* ---- sync3d: the data-parallel axis ---- */
struct sync3d;

/* allreduce mode: the mean of each gradient over dp (NULL: one replica),
 * then torch.optim.SGD's momentum update (tm_sgd_momentum, sync_ring's
 * learning-rate schedule, o's lr, momentum and lr_decay_steps) on this
 * rank's slices. */
int sync3d_open_ring(ps_coll *dp, const struct sync_ring_opts *o, struct mp_stage *st,
                     struct sync3d **out);
/* o->shard_state with dp of D > 1 ranks (ZeRO-1, sync3d_zero.c): each rank
 * keeps the velocity of its 1/D chunk of every tensor of its stage only;
 * sync3d_open_ring hands the data-parallel axis to these. The gradients are
 * reduce-scattered (mean), each rank updates its chunk (the update above)
 * and the parameters are all-gathered: equal to the non-sharded run bit for
 * bit with D = 2, within float rounding of the sums' order beyond. */
struct sync3d_zero;
int sync3d_zero_open(ps_coll *dp, const struct sync_ring_opts *o, struct mp_stage *st,
                     struct sync3d_zero **out);
ps_status sync3d_zero_reduce(struct sync3d_zero *z);
ps_status sync3d_zero_update(struct sync3d_zero *z, uint64_t step);
size_t sync3d_zero_state_floats(const struct sync3d_zero *z); /* 1/D, plus padding */
void sync3d_zero_close(struct sync3d_zero *z);
/* ps mode: declares the whole model's (stage, slice) tensors with their
 * owners (ps_declare_owned, the same list on every rank), job rank 0
 * initialises every key from full (NULL elsewhere) unless the shards hold
 * steps of it already (a restarted job: ps_resume_step > 0), and every
 * rank pulls the current version of its own. The shards run the optimizer; a step pushes this
 * rank's gradients at version v and pulls v + 1. */
int sync3d_open_ps(ps_client *c, const struct mp_plan *plan, int world, int job_rank,
                   struct mp_stage *st, const struct mlp *full, struct sync3d **out);
/* ps mode, after open on every rank of job (NULL: ps mode with T = P = 1,
 * where each rank goes on by itself): the step the job goes on from, the
 * lowest first step not pushed (ps_resume_step) over the ranks, 0 in a new
 * job. When some slices hold that step already (a rank was lost while the
 * step's pushes were under way), a warning on every rank names the ranks
 * ahead: the step is redone, its duplicate pushes ignored, but on slices of
 * mixed versions. 0, or -ECONNRESET/-EPROTO after logging why. */
int sync3d_resume_ps(struct sync3d *s, ps_coll *job, int world, int job_rank, uint64_t *step);
/* REDUCE_GRADS of step `step`: starts the reduction (all-reduce or push). */
int sync3d_reduce(struct sync3d *s, uint64_t step);
/* OPTIMIZER_STEP: waits for it and leaves the parameters of version step+1. */
int sync3d_update(struct sync3d *s, uint64_t step);
/* After the last step: ps mode leaves the shards (finished), waits for
 * every worker, and job rank 0 shuts the shards down, as sync_ps does. */
int sync3d_finish(struct sync3d *s, int job_rank);
/* Why the last call failed. */
const char *sync3d_errmsg(struct sync3d *s, char *buf, size_t len);
/* allreduce mode: the momentum velocity per tensor of the stage (entries
 * NULL without momentum), what a checkpoint holds besides the parameters. */
float *const *sync3d_velocity(const struct sync3d *s);
/* Optimizer state (floats) this rank holds. */
size_t sync3d_state_floats(const struct sync3d *s);
/* Waits for what is in flight; accepts NULL. */
void sync3d_close(struct sync3d *s);

/* The (stage, tensor rank) part of the whole model, as every rank names
 * it: a stage of plan with parameters (micro-batches of one sample, no
 * communication), for declaring layouts and assembling the model. */
struct mp_stage *trainer3d_shadow_stage(const struct mp_plan *plan, int pp, int tp);

/* ---- the loop ---- */
struct trainer3d_opts {
  const struct dataset *train;
  const struct dataset *test; /* job rank 0 */
  ps_coll *job;               /* NULL: one rank, or ps mode with T = P = 1 */
  const ps_grid *grid;        /* NULL with job NULL */
  int job_rank, world;
  const struct mp_plan *plan;
  struct ps_pipe_shape shape;
  struct mp_stage *stage;
  struct sync3d *sync;
  struct mlp *full; /* job rank 0: the assembled model (evaluated, dumped), else NULL */
  int batch;        /* per replica */
  int epochs;
  uint64_t seed, max_steps;
  uint64_t start_step; /* resumed (a checkpoint, the shards' step): the first step to train */
  int log_every;
  /* after each step (may be NULL): the stage's counters for /metrics */
  void (*on_step)(void *arg, const struct mp_stage *st, uint64_t step);
  void *on_step_arg;
  /* after each step's update (may be NULL): `done` steps are trained; a
   * negative return stops training with it (a checkpoint that cannot be
   * written, ckpt3d.h) */
  int (*after_step)(void *arg, uint64_t done);
  void *after_step_arg;
};

/* The most micro-batches a stage's list holds activations of at once
 * (forwards not yet backwarded, ZB-H1: not yet weight-backwarded). */
int trainer3d_max_inflight(const struct ps_pipe_action *a, size_t n);

/* Trains; on return (0) job rank 0's full holds the final parameters. A
 * negative errno after logging what failed: -ECONNRESET for a lost rank. */
int trainer3d_run(const struct trainer3d_opts *o, struct trainer_result *res);

#endif
