/* ckpt3d: a 3D job's worker checkpoints and resume in allreduce mode
 * (ps-worker --tensor-parallel / --pipeline-stages / --micro-batches with
 * --checkpoint-dir and --checkpoint-every; issue 32).
 *
 * Every rank writes its own slice every N steps: its stage's tensors
 * (mp_stage_param for each of mp_stage_num_tensors) and the momentum
 * velocity sync3d holds for them, as the data-parallel worker does
 * (worker_ckpt.h: same crash-safe path, same file name by job rank), in a
 * version 2 file that carries the layout (t, p, chunks and this rank's
 * tp/pp/dp coordinates) besides the world size, batch, seed and tensor
 * counts. A file of another layout is refused by name at start (exit 2),
 * never half-loaded. On start the ranks agree over the job group on the
 * newest step every rank holds (worker_ckpt_agree.h), load it, set later
 * files aside and the trainer goes on from that step; the data position
 * follows from the step and the seed. Checkpoint of step N = the
 * parameters and velocity after N optimizer steps. */
#ifndef PS_CKPT3D_H
#define PS_CKPT3D_H

#include <stdint.h>

#include "collective.h"
#include "mp_model.h"
#include "worker_ckpt.h"

struct ckpt3d_opts {
  const char *dir; /* prepared by worker_ckpt_prepare */
  uint64_t every;  /* 0: resume only, never write */
  uint32_t max_failures;
  struct worker_ckpt_id id; /* id.layout.t >= 1 */
};

struct ckpt3d;

/* The stage's tensors and velocity (per tensor, NULL without momentum; the
 * arrays stay the caller's and must outlive it). 0 or -ENOMEM. */
int ckpt3d_open(const struct ckpt3d_opts *o, struct mp_stage *st, float *const *velocity,
                struct ckpt3d **out);
/* Every rank of job (NULL: a job of one rank) together: agree, load, *step
 * = the first step to train. 0 or a negative errno, logged (-ECONNRESET: a
 * lost rank). */
int ckpt3d_resume(struct ckpt3d *c, ps_coll *job, uint64_t *step);
/* After the optimizer step that makes `done` steps: writes step `done`'s
 * checkpoint when it is a multiple of every. A failed write is logged and
 * training goes on, unless it is max_failures-th in a row: then -EIO after
 * logging why. */
int ckpt3d_after_step(struct ckpt3d *c, uint64_t done);
/* Accepts NULL. */
void ckpt3d_close(struct ckpt3d *c);

#endif
