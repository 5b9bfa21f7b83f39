/* worker_ckpt: a worker's checkpoints in all-reduce mode (ps-worker
 * --checkpoint-dir, --checkpoint-every; issue 18).
 *
 * In all-reduce mode there are no shards: every rank holds the whole model
 * and its optimizer state, identical on all ranks, and a lost rank stops the
 * ring. So each rank writes, every N steps, what it needs to go on from
 * there: the step (the data position follows from it and the seed: the
 * trainer's epoch order), the parameters and the momentum velocity, and the
 * settings that must match on resume (world size, rank, batch, seed, the
 * model's tensor sizes). A restarted ring resumes from the newest step every
 * rank holds a valid checkpoint of (sync_ring_resume agrees on it over the
 * ring).
 *
 * File DIR/worker-RRRR-step-SSSSSSSSSSSSSSSS.ckpt (decimal), written to a
 * .tmp beside it through ckpt_io (common/ckpt_io.h), fsynced, renamed over,
 * and the directory fsynced (common/durable.h, the shard's protocol too), so a crash leaves the old
 * one or the new one, never half of one. A write counts only when every step of that succeeded, the
 * directory's fsync included. The newest WORKER_CKPT_KEEP valid ones are kept: ranks of a ring can
 * be one checkpoint apart (a rank lost between its peers' writes of step N and its own), so the
 * rank behind holds N-E and N while the one ahead holds N and N+E; with three kept, a corrupt N on
 * either still leaves N-E on both. Layout, all little-endian:
 *
 *   u32 magic "PSWK", u32 version 1, u32 rank, u32 world, u64 step,
 *   u64 seed, u32 batch, u32 num_tensors, u32 has_velocity, u32 reserved,
 *   per tensor u64 count; then per tensor the parameters (count floats) and,
 *   with velocity, per tensor the velocity; then u32 CRC32C of all before
 *   it and u32 magic "KWSP".
 *
 * A 3D job's rank (--tensor-parallel, --pipeline-stages; ckpt3d.h) writes
 * version 2: the same, with a layout block of 8 u32 after the first 48
 * bytes: t, p, chunks, tp_rank, pp_rank, dp_rank, 0, 0, and its tensors
 * are its stage's slices. A plain data-parallel worker writes version 1.
 *
 * A file that fails any check (size, magics, CRC, the settings) is refused
 * by name with what differs; such a file is never half-loaded. */
#ifndef PS_WORKER_CKPT_H
#define PS_WORKER_CKPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt_io.h"
#include "model.h"

#define WORKER_CKPT_KEEP 3     /* valid checkpoints kept per rank (see above) */
#define WORKER_CKPT_SCAN_MAX 8 /* valid steps a scan reports */

/* A 3D job's layout and this rank's place in it; t = 0: a data-parallel
 * worker (version 1 files). */
struct worker_ckpt_layout {
  uint32_t t, p, chunks, tp_rank, pp_rank, dp_rank;
};

struct worker_ckpt_id {
  uint32_t rank, world, batch;
  uint64_t seed;
  struct worker_ckpt_layout layout;
};

/* What a checkpoint holds: n tensors of count[i] floats, their parameters
 * and (velocity non-NULL with velocity[0] non-NULL) their momentum
 * velocity; names for the messages. The pointers stay the caller's. */
struct worker_ckpt_tensors {
  int n;
  float *const *param;
  float *const *velocity;
  const size_t *count;
  const char *const *name;
};

/* What a rank holds in its checkpoint directory. */
struct worker_ckpt_scan {
  int n; /* valid checkpoints, newest first, in steps */
  uint64_t steps[WORKER_CKPT_SCAN_MAX];
  int files;            /* this rank's checkpoint files by name */
  uint64_t newest_file; /* the newest one's step (files > 0) */
  int skipped;          /* files read before steps[n-1] that do not load */
  uint64_t skip_step;   /* the newest of those (skipped > 0) */
  char skip_why[480];   /* its path and why it does not load */
};

/* At start, before anything else uses dir: creates it with its parents
 * (mkdir -p, mode 0755), proves it writable (a probe file written, fsynced,
 * removed) and removes this rank's unfinished .tmp files a crash left.
 * 0, or a negative errno with err naming the path, the operation and the
 * errno. */
int worker_ckpt_prepare(const char *dir, uint32_t rank, char *err, size_t errlen);

/* Reads this rank's checkpoint files in dir, newest first, each whole
 * (size, magics, CRC, settings), until WORKER_CKPT_SCAN_MAX load; every
 * file that does not is logged (warning: the rank, the file, why) and
 * skipped. A missing dir holds none. */
void worker_ckpt_scan(const char *dir, const struct worker_ckpt_id *id, const struct mlp *m,
                      bool velocity, struct worker_ckpt_scan *out);
void worker_ckpt_scan_tensors(const char *dir, const struct worker_ckpt_id *id,
                              const struct worker_ckpt_tensors *t, struct worker_ckpt_scan *out);

/* Whether this rank's files in dir were written by the same layout (and
 * world size): 0, or -EINVAL with err naming the newest file of another
 * one, its layout and this run's. A restart with another --tensor-parallel
 * or --pipeline-stages is a wrong setting, not a reason to start over. */
int worker_ckpt_check_layout(const char *dir, const struct worker_ckpt_id *id, char *err,
                             size_t errlen);

/* Once the ring agreed to go on from step (0: a fresh start): renames this
 * rank's files of later steps to NAME.stale (warning about each), so a
 * file of the abandoned timeline is never taken for the new one's step
 * (a rank lost before overwriting it would otherwise resume from other
 * parameters than its peers) nor kept in place of a newer one; .stale
 * files are kept for inspection, and never read. */
void worker_ckpt_set_aside_after(const char *dir, uint32_t rank, uint64_t step);

/* Loads step's checkpoint into m's parameters and velocity (per tensor;
 * NULL when has no velocity). 0, or a negative errno with err naming the
 * file and what is wrong. */
int worker_ckpt_load(const char *dir, const struct worker_ckpt_id *id, uint64_t step, struct mlp *m,
                     float *const *velocity, char *err, size_t errlen);
int worker_ckpt_load_tensors(const char *dir, const struct worker_ckpt_id *id, uint64_t step,
                             const struct worker_ckpt_tensors *t, char *err, size_t errlen);

/* Writes step's checkpoint through io (crash-safe, above) and then removes
 * this rank's files older than the newest WORKER_CKPT_KEEP valid ones. 0, or
 * a negative errno with err naming the operation, the path and the error
 * (a failed fsync of the file or of the directory included: then the
 * checkpoint is not written, whatever is on disk). */
int worker_ckpt_save(struct ckpt_io *io, const char *dir, const struct worker_ckpt_id *id,
                     uint64_t step, struct mlp *m, float *const *velocity, char *err,
                     size_t errlen);
int worker_ckpt_save_tensors(struct ckpt_io *io, const char *dir, const struct worker_ckpt_id *id,
                             uint64_t step, const struct worker_ckpt_tensors *t, char *err,
                             size_t errlen);

/* The tensors of m (and velocity, may be NULL) as a worker_ckpt_tensors,
 * in the caller's arrays of MLP_MAX_SIZES * 2 entries. */
void worker_ckpt_tensors_of_mlp(const struct mlp *m, float *const *velocity, float **param,
                                size_t *count, const char **name, struct worker_ckpt_tensors *t);

#endif
