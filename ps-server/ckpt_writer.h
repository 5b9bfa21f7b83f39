/* ckpt_writer: writes a shard's checkpoints on a thread of its own, so the
 * event loop never waits for the disk (STYLE 6). The loop hands over one
 * complete snapshot at a time (ckpt_writer_submit); the thread writes it
 * with ckpt_write through the I/O backend chosen at start (io_uring, or
 * syscalls where it is refused; logged), and reports back through a
 * uv_async_t, on whose callback the loop releases the snapshot (its
 * parameter references belong to the loop thread) and logs the result. A
 * snapshot submitted while another is being written is refused (-EBUSY):
 * the caller drops it and takes the next one (counted as skipped, which is
 * not a failure).
 *
 * Failures are loud: each is logged with the directory and the errno, and
 * once max_failures writes failed in a row (ckpt_writer_on_failures) the
 * owner's callback runs, once, on the loop thread: the shard stops the job
 * rather than train on without checkpoints.
 *
 * ckpt_writer_finish waits for the write in progress and then writes a last
 * snapshot on the calling thread (the final checkpoint at SIGTERM, when the
 * loop has nothing else to do). */
#ifndef PS_CKPT_WRITER_H
#define PS_CKPT_WRITER_H

#include <stdbool.h>
#include <stdint.h>
#include <uv.h>

#include "ckpt.h"

struct ckpt_writer;

struct ckpt_writer_stats {
  uint64_t written, failed, skipped;
  uint32_t failed_in_a_row; /* since the last success */
  uint64_t last_clock, last_bytes;
  double last_seconds;
  double last_done_s; /* clock_now_s() when the newest one was committed */
  double last_unix_s; /* the same, as wall-clock seconds since the epoch */
};

/* Starts the thread and registers the async handle on loop. Returns 0 or a
 * negative errno. */
int ckpt_writer_start(uv_loop_t *loop, const char *dir, uint32_t shard, struct ckpt_writer **out);

/* Called on the loop thread, once, when max_failures writes failed in a
 * row; err is the last one's negative errno, msg says which step and path. */
typedef void (*ckpt_writer_fail_fn)(void *arg, int err, const char *msg, uint32_t failures);
/* max_failures 0 = never (failures are still logged and counted). */
void ckpt_writer_on_failures(struct ckpt_writer *w, uint32_t max_failures, ckpt_writer_fail_fn fn,
                             void *arg);

/* Takes ownership of snap: 0 (queued), or -EBUSY (a write is in progress;
 * snap is freed and counted as skipped). Loop thread. */
int ckpt_writer_submit(struct ckpt_writer *w, struct ckpt_snapshot *snap);

bool ckpt_writer_busy(struct ckpt_writer *w);

/* Waits until no write is queued or in progress, and releases what was
 * written (a rollback reads the files next). Loop thread. */
void ckpt_writer_wait_idle(struct ckpt_writer *w);

/* Waits for the write in progress, stops the thread, writes snap (if not
 * NULL; freed after) on this thread and closes the async handle. Returns the
 * result of that last write (0 if none). Loop thread, once. */
int ckpt_writer_finish(struct ckpt_writer *w, struct ckpt_snapshot *snap,
                       struct ckpt_write_result *res);

/* Frees the writer (after ckpt_writer_finish and after the loop has run the
 * async handle's close callback). Accepts NULL. */
void ckpt_writer_free(struct ckpt_writer *w);

struct ckpt_writer_stats ckpt_writer_stats(const struct ckpt_writer *w);

#endif
