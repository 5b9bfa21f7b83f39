/* sync_ring: the trainer's all-reduce backend (--sync-mode allreduce).
 *
 * Tensor fusion. At open the tensors are packed, in the order backward
 * produces them (last layer first), into buckets of at most fusion_bytes
 * (Horovod's fusion buffers); a tensor larger than that is a bucket of its
 * own and is reduced in place in its gradient buffer, without a copy. Small
 * layers thus share one round trip. grad_ready copies a gradient into its
 * bucket and, the moment a bucket is full, queues its all-reduce (mean over
 * the ranks) on the collective's worker thread (or the NCCL stream), so
 * communication of late layers overlaps backward of early ones.
 *
 * Optimizer. Every rank applies the same update to the same averaged
 * gradient: SGD with momentum in torch.optim.SGD semantics (v = mu*v + g;
 * p -= lr*v; mu = 0 is plain SGD; the learning rate optionally annealed
 * like the shards' --lr-decay-steps), in fetch, after waiting for each bucket
 * in order. The parameters therefore stay identical on all ranks; rank 0's
 * initial values are broadcast at open so even different seeds agree.
 *
 * Sharded optimizer state (shard_state, ps-worker --shard-optimizer-state;
 * DeepSpeed's ZeRO stage 1): each bucket is cut in W equal chunks; its
 * gradient is reduce-scattered (rank r gets the mean of chunk r), rank r
 * updates chunk r of the parameters with the velocity of chunk r only (1/W
 * of the optimizer state per rank) and the updated chunks are all-gathered.
 * The arithmetic per element is the same as with the all-reduce; only the
 * order of the W-term sums can differ (W >= 3), so W = 2 gives the same
 * parameters bit for bit. The buckets (and pieces) are the all-reduce's,
 * each copied into its padded buffer. TCP ring only; no worker checkpoints
 * yet. */
#ifndef PS_SYNC_RING_H
#define PS_SYNC_RING_H

#include <stddef.h>
#include <stdint.h>

#include "collective.h"
#include "collective_nccl.h"
#include "model.h"
#include "trainer.h"
#include "worker_ckpt.h"

struct sync_ring_opts {
  double lr; /* double, as the shards keep it, so the schedule rounds alike */
  float momentum;
  uint64_t lr_decay_steps; /* cosine annealing of lr to 0 over this many steps; 0 = constant */
  size_t fusion_bytes;     /* 0 = one bucket per tensor */
  bool shard_state;        /* ZeRO-1 (above); needs nccl NULL and no ckpt_dir */
  /* checkpoints (worker_ckpt.h): every ckpt_every steps into ckpt_dir
   * (NULL or 0 = none; prepared by worker_ckpt_prepare), as ckpt_id; a write
   * failing ckpt_max_failures times in a row stops training (fetch fails
   * naming it; 0 = log each failure and keep training) */
  const char *ckpt_dir;
  uint64_t ckpt_every;
  uint32_t ckpt_max_failures;
  struct worker_ckpt_id ckpt_id;
};

struct sync_ring;

/* Builds the buckets and broadcasts rank 0's parameters of m. nccl may be
 * NULL (all-reduce over c's TCP ring); else gradients go through NCCL and c
 * serves only as bootstrap and watchdog. Takes no ownership of c or nccl. */
int sync_ring_open(ps_coll *c, struct ps_nccl *nccl, const struct sync_ring_opts *o, struct mlp *m,
                   struct sync_ring **out);
void sync_ring_close(struct sync_ring *s);
/* After open, on every rank, with ckpt_dir set: the ranks agree on the
 * newest step every rank holds a valid checkpoint of (each reads its files
 * whole and says which load, over the ring) and load it; *step is where
 * training goes on (0: none in common, the fresh start). Falling back (a
 * rank's newer file does not load, or a rank holds newer steps than the
 * others) and a fresh start while checkpoint files exist are warnings on
 * every rank naming the rank, the file and why. 0 or a negative errno
 * (logged). */
int sync_ring_resume(struct sync_ring *s, struct mlp *m, uint64_t *step);
/* Fills t with the backend's callbacks. */
void sync_ring_bind(struct sync_ring *s, struct trainer_sync *t);
/* Bytes of optimizer state (velocity) this rank holds. */
size_t sync_ring_state_bytes(const struct sync_ring *s);
/* The learning rate for the gradients of step `step`: the shards' schedule
 * (ps-server/optimizer.c opt_lr_at), so both modes anneal alike; the 3D
 * trainer's update (sync3d) uses it too. */
float sync_ring_lr(const struct sync_ring_opts *o, uint64_t step);
/* Number of buckets and their sizes in bytes, for the start-up log line. */
int sync_ring_buckets(const struct sync_ring *s, size_t *bytes, int max);

#endif
