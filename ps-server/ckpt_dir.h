/* ckpt_dir: a shard's checkpoint files in --checkpoint-dir, and which job
 * each belongs to.
 *
 * Names: "shard-SSSS-vCLOCK.ckpt" (CLOCK: 20 digits) for the unnamed job
 * (empty --job-id; every version 1 file has such a name), and
 * "shard-SSSS-vCLOCK-jHHHHHHHH.ckpt" for job id J, H = CRC32C of J in hex.
 * The name keeps two jobs' checkpoints of the same clock apart (a rename
 * would otherwise replace the other job's file); the JOB record inside the
 * file (ckpt.h) is what decides, the name only serves when the header cannot
 * be read.
 *
 * A file is this job's ("mine") when its header and JOB record read back
 * (ckpt_peek) with this job id and, once the layout is known, this layout
 * hash; or, when they cannot be read, when its name carries this job's hash.
 * Anything else is another job's: never loaded, never deleted, and never
 * counted by the pruning, which keeps of this job's files older than the
 * one just written only the newest readable one (the fallback). Files of
 * this job newer than the one just written (a timeline the loader skipped:
 * invalid, or of another shape) are left as they are too. */
#ifndef PS_CKPT_DIR_H
#define PS_CKPT_DIR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define CKPT_JOB_MAX 64u /* bytes of a job id (--job-id) */

struct ckpt_file {
  uint64_t clock;
  char path[1100];
  bool name_mine; /* the name carries this job's hash (or none, for the unnamed job) */
};

/* config_check_fn for --job-id: at most CKPT_JOB_MAX printable ASCII
 * bytes (the table's field size enforces the length). */
int ckpt_job_id_check(const char *value, char *err, size_t errlen);

/* config_check_fn for --checkpoint-dir: "" (none), an existing writable
 * directory, or a path whose nearest existing ancestor is a writable
 * directory (ckpt_dir_create makes the rest). Creates nothing. */
int ckpt_dir_check(const char *value, char *err, size_t errlen);

/* mkdir -p dir (0755), then checks it is a writable directory. Returns 0 or
 * a negative errno with err naming the path. */
int ckpt_dir_create(const char *dir, char *err, size_t errlen);

/* The path of shard's checkpoint of clock for job ("" or NULL = unnamed). */
void ckpt_file_name(char *buf, size_t len, const char *dir, uint32_t shard, const char *job,
                    uint64_t clock, bool tmp);

/* Every checkpoint file of shard in dir, of any job, newest (highest clock)
 * first; *out is malloc'ed (free it). Returns 0 or a negative errno. */
int ckpt_dir_list(const char *dir, uint32_t shard, const char *job, struct ckpt_file **out,
                  size_t *n);

/* Whether f is job's (see above); layout_hash 0 = not known yet. */
bool ckpt_file_mine(const struct ckpt_file *f, const char *job, uint64_t layout_hash);

/* After clock was committed: deletes this job's files older than clock but
 * the newest readable one. */
void ckpt_prune(const char *dir, uint32_t shard, const char *job, uint64_t layout_hash,
                uint64_t clock);

/* Deletes this job's checkpoints of shard newer than clock (after a rollback
 * to clock they belong to a timeline the job abandoned). */
void ckpt_remove_after(const char *dir, uint32_t shard, const char *job, uint64_t clock);

/* Removes this job's leftover temp files of shard (a crash during a commit). */
void ckpt_remove_temps(const char *dir, uint32_t shard, const char *job);

/* Logs one warning naming the checkpoint files of shard in dir that belong
 * to another job (and their job ids), if there are any; returns how many. */
size_t ckpt_report_foreign(const char *dir, uint32_t shard, const char *job);

#endif
