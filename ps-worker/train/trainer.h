/* trainer: the data-parallel training loop of ps-worker, independent of how
 * gradients are synchronised.
 *
 * Each step: gather this rank's slice of the global batch (data.h's sharding
 * convention) into the device model, fetch the parameters of version `step`
 * (sync->fetch) into its host mirror and load them onto the device, run
 * forward/backward, and hand each gradient to sync->grad_ready the moment
 * backward has produced it (last layer first), so communication of layer L
 * overlaps the backward pass of layers < L. The sync backend decides what
 * happens to the gradients: PS mode pushes them to the shards and asks for
 * the next version at once (sync_ps.c). Backends only see the host mirror
 * (device.h), so they work unchanged whether the model computes on the CPU
 * or on a GPU.
 *
 * Rank 0 reports progress on stderr (a live bar on a terminal, a logfmt line
 * every log_every steps otherwise) and evaluates test accuracy after every
 * epoch. */
#ifndef PS_TRAINER_H
#define PS_TRAINER_H

#include <stdbool.h>
#include <stdint.h>

#include "data.h"
#include "device.h"
#include "model.h"

struct trainer_sync {
  void *ctx;
  /* Makes mlp's parameters those of version `step`, waiting as needed. */
  int (*fetch)(void *ctx, struct mlp *m, uint64_t step);
  /* The first `done` elements of mlp_grad(m, t) are final for `step`: send
   * what can go (must not block long). Called with increasing done for a
   * tensor, the last time with done == its count. */
  int (*grad_ready)(void *ctx, struct mlp *m, int t, size_t done, uint64_t step);
  /* Where the backend would like tensor 0's gradient cut (element offsets,
   * at most max): it can send each piece the moment it is computed. Returns
   * how many; NULL or 0 = in one piece. */
  int (*grad_blocks)(void *ctx, struct mlp *m, size_t *ends, int max);
  /* Training is over; the model holds version `step` (called on every rank). */
  int (*finish)(void *ctx, struct mlp *m, uint64_t step);
  /* Last error text of the backend. */
  const char *(*errmsg)(void *ctx, char *buf, size_t len);
  /* After fetch or finish returned -ERESTART (the job rolled back to a
   * checkpoint after a shard was lost): the step to continue from. NULL =
   * the backend never rolls back. */
  uint64_t (*rollback_step)(void *ctx);
};

struct trainer_opts {
  const struct dataset *train;
  const struct dataset *test; /* may be NULL on ranks that do not evaluate */
  int rank, world_size;
  int batch; /* per worker */
  int epochs;
  uint64_t seed;
  uint64_t max_steps;  /* 0 = no limit */
  uint64_t start_step; /* resumed from a checkpoint: the first step to train */
  int log_every;       /* steps between progress lines (no terminal) */
  bool progress;       /* this rank reports progress */
  bool grad_blocks;    /* cut tensor 0's gradient where sync->grad_blocks says */
};

struct trainer_result {
  float accuracy, test_loss, train_loss;
  uint64_t steps;
  int epochs_done;
  double wall_s;        /* training loop, the per-epoch evaluations included */
  double wait_s;        /* of which waiting for parameters (communication not hidden) */
  double eval_s;        /* of which evaluating the test set (rank 0) */
  double samples_per_s; /* global: world_size * batch * steps / (wall_s - eval_s), the
                           training throughput as tools/bench/ps-torch-ref times it */
};

/* Trains dm; the sync callbacks get its host mirror (device_model_host), which
 * holds the final parameters on return. Returns 0, or a negative errno after
 * logging what failed. */
int trainer_run(const struct trainer_opts *o, struct device_model *dm,
                const struct trainer_sync *sync, struct trainer_result *res);

#endif
