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
 * rank holds (sync_ring_resume agrees on it over the ring).
 *
 * File DIR/worker-RRRR-step-SSSSSSSSSSSSSSSS.ckpt (decimal), written to a
 * .tmp beside it, fsynced, renamed over, and the directory fsynced, so a
 * crash leaves the old one or the new one, never half of one; the newest two
 * are kept (a corrupt newest falls back to the previous). Layout, all
 * little-endian:
 *
 *   u32 magic "PSWK", u32 version 1, u32 rank, u32 world, u64 step,
 *   u64 seed, u32 batch, u32 num_tensors, u32 has_velocity, u32 reserved,
 *   per tensor u64 count; then per tensor the parameters (count floats) and,
 *   with velocity, per tensor the velocity; then u32 CRC32C of all before
 *   it and u32 magic "KWSP".
 *
 * A file that fails any check (size, magics, CRC, the settings) is refused
 * by name with what differs; such a file is never half-loaded. */
#ifndef PS_WORKER_CKPT_H
#define PS_WORKER_CKPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model.h"

struct worker_ckpt_id {
  uint32_t rank, world, batch;
  uint64_t seed;
};

/* The checkpoint steps this rank holds in dir that load (newest first): up
 * to max, their count returned (0: none; a missing dir is none). Files that
 * do not load are logged and skipped. */
int worker_ckpt_list(const char *dir, const struct worker_ckpt_id *id, const struct mlp *m,
                     bool velocity, uint64_t *steps, int max);

/* Loads step's checkpoint into m's parameters and velocity (per tensor;
 * NULL when has no velocity). 0, or a negative errno with err naming the
 * file and what is wrong. */
int worker_ckpt_load(const char *dir, const struct worker_ckpt_id *id, uint64_t step, struct mlp *m,
                     float *const *velocity, char *err, size_t errlen);

/* Writes step's checkpoint (crash-safe) and removes this rank's older ones
 * but the previous. 0, or a negative errno with err saying why. */
int worker_ckpt_save(const char *dir, const struct worker_ckpt_id *id, uint64_t step, struct mlp *m,
                     float *const *velocity, char *err, size_t errlen);

#endif
