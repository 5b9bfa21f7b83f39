/* ckpt_writer: one thread, one slot. `job` is set by the loop under mu and
 * cleared by the thread once written; `done` carries the finished snapshot
 * back to the loop (released in on_done, on the loop thread). */
#include "ckpt_writer.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "clock.h"
#include "container_of.h"
#include "log.h"

struct ckpt_writer {
  uv_async_t async; /* loop side: a write finished */
  pthread_t thread;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  struct ckpt_io *io;
  char *dir;
  uint32_t shard;
  struct ckpt_snapshot *job;  /* to write (thread takes it) */
  struct ckpt_snapshot *done; /* written, to release on the loop */
  bool writing, stop;
  int last_err;
  char last_msg[512];
  struct ckpt_write_result last;
  struct ckpt_writer_stats stats;
  uint32_t max_failures;
  ckpt_writer_fail_fn on_fail;
  void *on_fail_arg;
  bool fail_said; /* on_fail ran */
};

static void *writer_main(void *arg) {
  struct ckpt_writer *w = arg;
  pthread_mutex_lock(&w->mu);
  for (;;) {
    while (!w->job && !w->stop) pthread_cond_wait(&w->cv, &w->mu);
    if (!w->job) break;
    struct ckpt_snapshot *snap = w->job;
    w->writing = true;
    pthread_mutex_unlock(&w->mu);
    struct ckpt_write_result res = {0};
    char msg[512] = "";
    int r = ckpt_write(w->io, w->dir, snap, &res, msg, sizeof(msg));
    pthread_mutex_lock(&w->mu);
    w->job = NULL;
    w->done = snap;
    w->writing = false;
    w->last_err = r;
    w->last = res;
    snprintf(w->last_msg, sizeof(w->last_msg), "%s", msg);
    pthread_cond_broadcast(&w->cv);
    uv_async_send(&w->async);
  }
  pthread_mutex_unlock(&w->mu);
  return NULL;
}

static void report(struct ckpt_writer *w, const struct ckpt_snapshot *snap, int r,
                   const struct ckpt_write_result *res, const char *msg) {
  if (r == 0) {
    w->stats.written++;
    w->stats.last_clock = snap->clock;
    w->stats.last_bytes = res->bytes;
    w->stats.last_seconds = res->seconds;
    w->stats.last_done_s = clock_now_s();
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    w->stats.last_unix_s = (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
    w->stats.failed_in_a_row = 0;
    log_info("checkpoint written",
             "path=%s clock=%" PRIu64 " bytes=%" PRIu64 " seconds=%.3f backend=%s", res->path,
             snap->clock, res->bytes, res->seconds, ckpt_io_name(w->io));
  } else {
    w->stats.failed++;
    w->stats.failed_in_a_row++;
    log_error("checkpoint failed",
              "dir=%s clock=%" PRIu64 " errno=%s failures_in_a_row=%" PRIu32
              " max_failures=%" PRIu32 " error=\"%s\"",
              w->dir, snap->clock, strerrorname_np(-r) ? strerrorname_np(-r) : "?",
              w->stats.failed_in_a_row, w->max_failures, msg);
    if (w->max_failures && w->stats.failed_in_a_row >= w->max_failures && !w->fail_said &&
        w->on_fail) {
      w->fail_said = true;
      w->on_fail(w->on_fail_arg, r, msg, w->stats.failed_in_a_row);
    }
  }
}

/* Loop thread: release what the thread finished. */
static void on_done(uv_async_t *a) {
  struct ckpt_writer *w = container_of(a, struct ckpt_writer, async);
  pthread_mutex_lock(&w->mu);
  struct ckpt_snapshot *snap = w->done;
  w->done = NULL;
  int r = w->last_err;
  struct ckpt_write_result res = w->last;
  char msg[512];
  snprintf(msg, sizeof(msg), "%s", w->last_msg);
  pthread_mutex_unlock(&w->mu);
  if (!snap) return;
  report(w, snap, r, &res, msg);
  ckpt_snapshot_free(snap);
}

int ckpt_writer_start(uv_loop_t *loop, const char *dir, uint32_t shard, struct ckpt_writer **out) {
  struct ckpt_writer *w = calloc(1, sizeof(*w));
  if (!w) return -ENOMEM;
  w->shard = shard;
  w->dir = strdup(dir);
  int r = w->dir ? ckpt_io_open(CKPT_IO_AUTO, &w->io) : -ENOMEM;
  if (r < 0) goto fail;
  if (w->io->fallback_why[0])
    log_warn("checkpoint I/O through plain syscalls", "backend=sync reason=\"%s\"",
             w->io->fallback_why);
  else
    log_info("checkpoint I/O", "backend=%s dir=%s", ckpt_io_name(w->io), dir);
  pthread_mutex_init(&w->mu, NULL);
  pthread_cond_init(&w->cv, NULL);
  r = uv_async_init(loop, &w->async, on_done);
  if (r < 0) goto fail;
  r = -pthread_create(&w->thread, NULL, writer_main, w);
  if (r < 0) {
    /* the async handle is registered on the loop: w must outlive it, so it
     * is left to the process, which stops on this error */
    uv_close((uv_handle_t *)&w->async, NULL);
    *out = NULL;
    return r;
  }
  *out = w;
  return 0;
fail:
  ckpt_io_close(w->io);
  free(w->dir);
  free(w);
  return r;
}

void ckpt_writer_on_failures(struct ckpt_writer *w, uint32_t max_failures, ckpt_writer_fail_fn fn,
                             void *arg) {
  w->max_failures = max_failures;
  w->on_fail = fn;
  w->on_fail_arg = arg;
}

bool ckpt_writer_busy(struct ckpt_writer *w) {
  pthread_mutex_lock(&w->mu);
  bool busy = w->job || w->writing || w->done;
  pthread_mutex_unlock(&w->mu);
  return busy;
}

void ckpt_writer_wait_idle(struct ckpt_writer *w) {
  pthread_mutex_lock(&w->mu);
  while (w->job || w->writing) pthread_cond_wait(&w->cv, &w->mu);
  pthread_mutex_unlock(&w->mu);
  on_done(&w->async);
}

int ckpt_writer_submit(struct ckpt_writer *w, struct ckpt_snapshot *snap) {
  pthread_mutex_lock(&w->mu);
  if (w->job || w->writing || w->done) {
    pthread_mutex_unlock(&w->mu);
    w->stats.skipped++;
    log_warn("checkpoint skipped: the previous one is still being written", "clock=%" PRIu64,
             snap->clock);
    ckpt_snapshot_free(snap);
    return -EBUSY;
  }
  w->job = snap;
  pthread_cond_signal(&w->cv);
  pthread_mutex_unlock(&w->mu);
  return 0;
}

int ckpt_writer_finish(struct ckpt_writer *w, struct ckpt_snapshot *snap,
                       struct ckpt_write_result *res) {
  pthread_mutex_lock(&w->mu);
  w->stop = true;
  pthread_cond_broadcast(&w->cv);
  pthread_mutex_unlock(&w->mu);
  pthread_join(w->thread, NULL);
  on_done(&w->async); /* a write that finished after the last async callback */
  int r = 0;
  if (snap) {
    struct ckpt_write_result local = {0};
    if (!res) res = &local;
    char msg[512] = "";
    r = ckpt_write(w->io, w->dir, snap, res, msg, sizeof(msg));
    report(w, snap, r, res, msg);
    ckpt_snapshot_free(snap);
  }
  uv_close((uv_handle_t *)&w->async, NULL);
  return r;
}

void ckpt_writer_free(struct ckpt_writer *w) {
  if (!w) return;
  ckpt_io_close(w->io);
  pthread_mutex_destroy(&w->mu);
  pthread_cond_destroy(&w->cv);
  free(w->dir);
  free(w);
}

struct ckpt_writer_stats ckpt_writer_stats(const struct ckpt_writer *w) {
  return w->stats;
}
