/* ckpt: a shard's checkpoints, one file per checkpoint.
 *
 * File format (little endian throughout):
 *   header  (64 bytes)  magic "PSCKPT01", u32 format version (2; 1 is still
 *                       read, as a file of the unnamed job), u32 shard,
 *                       u32 num_shards, u32 num_workers, u64 layout hash,
 *                       u64 clock, u32 records, u32 optimizer kind,
 *                       u32 consistency, u32 staleness, u32 unix time (s),
 *                       u32 CRC32C of the 60 bytes before it
 *   records, each       u32 type, u32 flags, u64 key, u64 count, u64 version,
 *                       u64 payload bytes, payload, u32 CRC32C of the record
 *                       header and payload
 *     JOB (type 3, first in version 2): count = length, payload = the job id
 *                       (--job-id, at most 64 printable bytes; empty = the
 *                       unnamed job)
 *     LAYOUT (type 1, first in version 1, second in 2): u64 chunk_bytes, u32 num_shards, u32
 * tensors, then per tensor u64 count, u32 name length, name; with flags bit 1
 * (the layout names owners, ps_declare_owned) then per tensor u32 n and its n
 * owner ranks (u32); without it the record is that of older files, so they
 * load unchanged. KEY (type 2):     params (count
 * floats), optimizer state (count * the kind's state floats; flags bit 0 = present, else all zero),
 * then next_step (num_workers u64): per rank, the step it pushes next on this key = its last
 * applied step + 1 footer  (24 bytes)  magic "PSCKEND1", u64 file length, u32 CRC32C of every byte
 * before the footer, u32 records The clock is the version every key had when the snapshot was taken
 * (periodic checkpoints are taken at a step boundary: each key is captured as
 * it reaches version clock); a final checkpoint (SIGTERM) takes the keys as
 * they are, and its clock is their lowest version.
 *
 * Commit protocol (ckpt_write, through common/durable.h, which the worker's
 * checkpoints share): write ".NAME.tmp", fsync it, rename it to
 * NAME (ckpt_dir.h: "shard-S-vCLOCK.ckpt", with "-jHASH" for a named job),
 * fsync the directory, then prune (ckpt_prune): of this job's checkpoints
 * older than the new one only the newest stays, as a fallback. A crash at
 * any step leaves the previous complete checkpoint, the new one, or both; a
 * temp file is never loaded.
 *
 * Jobs. The store's job id (store_opts.job_id) is written into every file;
 * files of another job id (version 1 files are the unnamed job's) are never
 * loaded, never pruned and never count for pruning: a directory reused by a
 * new job (a PersistentVolumeClaim) keeps the old job's files untouched.
 *
 * Loading (ckpt_load_latest) tries this job's checkpoints of this shard
 * newest first; one that is truncated, has a bad checksum, or does not fit
 * (shard id, shard or worker count, optimizer) is reported by name and
 * skipped for the previous one. Files are read through mmap and fully
 * verified before the store is touched.
 *
 * Threads: a snapshot is taken on the shard's loop thread, written by any
 * thread (it only reads the snapshot; parameter buffers are referenced, not
 * copied, because the store copies a buffer on write while it is
 * referenced), and freed on the loop thread again. */
#ifndef PS_CKPT_H
#define PS_CKPT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ckpt_dir.h"
#include "ckpt_io.h"
#include "store.h"

#define CKPT_FORMAT_VERSION 2u

#define CKPT_HEADER_BYTES 64u
#define CKPT_FOOTER_BYTES 24u
#define CKPT_RECORD_HEADER_BYTES 40u

struct ckpt_key_snap {
  uint64_t key, count, version;
  struct vbuf *params; /* a reference (loop thread releases it) */
  float *opt_state;    /* a copy, or NULL (no update yet) */
  uint64_t *next_step; /* a copy, num_workers entries */
};

struct ckpt_snapshot {
  char job[CKPT_JOB_MAX + 1]; /* the store's job id ("" = unnamed) */
  uint32_t shard, num_shards, num_workers;
  uint64_t clock;
  uint32_t opt_kind, consistency, staleness;
  uint32_t state_floats;
  struct store_layout layout; /* a copy */
  size_t num_keys, filled;
  struct ckpt_key_snap *keys; /* in the store's key order */
};

/* A snapshot to be filled key by key (ckpt_snapshot_add) as keys reach
 * version `clock`. NULL if out of memory. Loop thread. */
struct ckpt_snapshot *ckpt_snapshot_new(const struct store *s, uint64_t clock);
/* Captures key number i of the store (k == &s->keys[i]). In BSP a rank's
 * next_step is clamped to the key's version: a push in the current,
 * unfinished step is not in the checkpoint, so it must be taken again after
 * a restart. Returns 0 or -ENOMEM. Loop thread. */
int ckpt_snapshot_add(struct ckpt_snapshot *snap, const struct store *s, size_t i);
/* Every key as it is now (the final checkpoint); clock = lowest version. */
struct ckpt_snapshot *ckpt_snapshot_take(const struct store *s);
static inline bool ckpt_snapshot_complete(const struct ckpt_snapshot *snap) {
  return snap->filled == snap->num_keys;
}
/* Releases the parameter references. Loop thread. Accepts NULL. */
void ckpt_snapshot_free(struct ckpt_snapshot *snap);

struct ckpt_write_result {
  char path[1100];
  uint64_t bytes;
  double seconds;
};

/* Writes snap into dir with the commit protocol above. Returns 0 or a
 * negative errno with err saying which step failed. Any thread. */
int ckpt_write(struct ckpt_io *io, const char *dir, const struct ckpt_snapshot *snap,
               struct ckpt_write_result *res, char *err, size_t errlen);

struct ckpt_info {
  char path[1100];
  uint32_t format_version, shard, num_shards, num_workers, records, opt_kind, consistency,
      staleness;
  uint64_t layout_hash, clock, unix_s, bytes;
  uint32_t file_crc;
  char job[CKPT_JOB_MAX + 1]; /* "" = the unnamed job (and every version 1 file) */
};

/* Checks path completely (header, every record's CRC, footer, whole-file
 * CRC). Returns 0 if valid, else a negative errno and err names the problem.
 * info is filled as far as the file could be read. If out is not NULL, the
 * header, the layout and one line per key (version, count, CRC) are printed
 * there (the inspector). */
int ckpt_verify(const char *path, struct ckpt_info *info, FILE *out, char *err, size_t errlen);

/* Loads the newest valid checkpoint of s's shard in dir into s (which must
 * have no layout yet). Skipped files are logged by name. Returns 0 (info
 * says which file), -ENOENT if there is none usable, or another negative
 * errno (err says why) if a valid one could not be applied. */
int ckpt_load_latest(const char *dir, struct store *s, struct ckpt_info *info, char *err,
                     size_t errlen);

/* As ckpt_load_latest, but only the checkpoint of exactly `clock` (a job
 * rolling back to it). -ENOENT if it is missing or invalid. */
int ckpt_load_clock(const char *dir, struct store *s, uint64_t clock, struct ckpt_info *info,
                    char *err, size_t errlen);

/* Reads only the header and (version 2) the JOB record of path, checking
 * their CRCs: which job and layout a file belongs to, cheaply (pruning after
 * every write, sorting out other jobs' files before loading). Returns 0, or a
 * negative errno with err saying why. Fills shard, clock, layout_hash,
 * format_version and job of info. */
int ckpt_peek(const char *path, struct ckpt_info *info, char *err, size_t errlen);

#endif
