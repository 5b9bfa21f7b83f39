/* durable: the one way a file is made durable (both checkpoints: the shard's
 * ps-server/ckpt.c and the worker's ps-worker/train/worker_ckpt.c).
 *
 * Commit protocol: the caller's bytes go to a temp file (durable_open,
 * durable_write) through a ckpt_io backend (io_uring or the syscalls, so a
 * refusing seccomp profile changes nothing here); durable_commit then
 * fsyncs it, closes it, renames it over the final name, fsyncs the directory
 * and lets the caller prune (durable_keep_newest). A crash at any step leaves
 * the previous file, the new one, or both; the temp file is never the final
 * name, so it is never loaded. A commit succeeds only when every step did: a
 * failed fsync of the file or of the directory is an error (after the
 * directory's, the file may be on disk, but nothing says the rename is).
 *
 * Failpoints (failpoint.h, test builds only): with the caller's prefix P
 * ("ckpt", "wckpt"), "P-open" after the temp file is created, "P-written"
 * after every byte went out, "P-fsync", "P-rename", "P-dirsync" after each
 * of those steps and "P-pruned" after the prune; the caller may put its own
 * between the writes. The crash tests stop the process at each of them.
 *
 * Errors name the step, the path, the errno and the backend: "cannot fsync
 * the directory DIR: Input/output error (errno 5, io_uring backend)".
 * A struct durable belongs to one thread. */
#ifndef PS_DURABLE_H
#define PS_DURABLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt_io.h"

struct durable {
  struct ckpt_io *io;
  const char *dir, *tmp, *final; /* the caller's; they live until commit or abort */
  const char *failpoints;        /* the failpoints' prefix */
  int fd;
  uint64_t off; /* bytes written so far */
  int err;      /* the first write's error: later writes do nothing */
};

/* Creates (truncates) the temp file tmp in dir, to become final (both full
 * paths, in dir) on commit. 0, or a negative errno with err naming the path;
 * then d needs no abort. */
int durable_open(struct durable *d, struct ckpt_io *io, const char *dir, const char *tmp,
                 const char *final, const char *failpoints, char *err, size_t errlen);

/* Appends n bytes of buf, retrying short writes. 0, or the negative errno of
 * the first failed write (kept: durable_commit reports it). */
int durable_write(struct durable *d, const void *buf, size_t n);

/* Called after the directory's fsync (durable_keep_newest, usually). */
typedef void (*durable_prune_fn)(void *arg);

/* fsync, close, rename, directory fsync, then prune(arg) if not NULL. Ends d
 * whatever happens: on a failure before the rename the temp file is removed.
 * 0, or a negative errno with err naming the step, the path and the backend. */
int durable_commit(struct durable *d, durable_prune_fn prune, void *arg, char *err, size_t errlen);

/* Gives up an open d: closes and removes the temp file. */
void durable_abort(struct durable *d);

enum { DURABLE_VALID = 0, DURABLE_INVALID = 1, DURABLE_OTHER = 2 };

/* A series of files of one owner, newest first, as the caller lists them. */
struct durable_series {
  size_t count;      /* files */
  size_t keep;       /* the newest this many valid ones stay */
  bool drop_invalid; /* files that do not load go even among the kept ones */
  /* Writes file i's path into path; returns DURABLE_VALID, DURABLE_INVALID,
   * or DURABLE_OTHER (another owner's: never counted, never deleted). With
   * check false only whether it is OTHER matters (the rest is deleted
   * anyway), so a costly validity check can be left out. */
  int (*file)(void *arg, size_t i, bool check, char *path, size_t len);
  void *arg;
};

/* Keeps the newest s->keep valid files of the series and deletes every file
 * older than the last of them; with drop_invalid, also the invalid ones
 * newer than it. Fewer valid files than keep: only (with drop_invalid) the
 * invalid ones go. Returns how many files were deleted; a failed unlink is
 * logged. */
size_t durable_keep_newest(const struct durable_series *s);

#endif
