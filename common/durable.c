/* durable: temp file, write, fsync, rename, directory fsync, keep the newest
 * N (see durable.h). Every step goes through the ckpt_io backend except
 * open, close, rename and unlink, which neither backend offers. The temp file
 * is removed on a failure before the rename; after it the new file stays
 * (complete, but only as durable as the directory's fsync made it). */
#include "durable.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "failpoint.h"
#include "log.h"

static void fail_msg(const struct durable *d, const char *what, const char *path, int r, char *err,
                     size_t errlen) {
  snprintf(err, errlen, "cannot %s %s: %s (errno %d, %s backend)", what, path, strerror(-r), -r,
           ckpt_io_name(d->io));
}

int durable_open(struct durable *d, struct ckpt_io *io, const char *dir, const char *tmp,
                 const char *final, const char *failpoints, char *err, size_t errlen) {
  *d = (struct durable){
      .io = io, .dir = dir, .tmp = tmp, .final = final, .failpoints = failpoints, .fd = -1};
  d->fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (d->fd < 0) {
    int r = -errno;
    fail_msg(d, "create", tmp, r, err, errlen);
    return r;
  }
  FAILPOINT_STEP(failpoints, "open");
  return 0;
}

int durable_write(struct durable *d, const void *buf, size_t n) {
  if (d->err) return d->err;
  d->err = ckpt_io_pwrite_all(d->io, d->fd, buf, n, d->off);
  d->off += n;
  return d->err;
}

void durable_abort(struct durable *d) {
  if (d->fd >= 0) close(d->fd);
  d->fd = -1;
  if (d->tmp) unlink(d->tmp);
}

int durable_commit(struct durable *d, durable_prune_fn prune, void *arg, char *err, size_t errlen) {
  const char *what = "write";
  int r = d->err;
  if (r < 0) goto out_unlink;
  FAILPOINT_STEP(d->failpoints, "written");
  what = "fsync";
  if ((r = ckpt_io_fsync(d->io, d->fd)) < 0) goto out_unlink;
  FAILPOINT_STEP(d->failpoints, "fsync");
  what = "close";
  r = close(d->fd) == 0 ? 0 : -errno;
  d->fd = -1;
  if (r < 0) goto out_unlink;
  what = "rename";
  if (rename(d->tmp, d->final) != 0) {
    r = -errno;
    goto out_unlink;
  }
  FAILPOINT_STEP(d->failpoints, "rename");
  /* Until the directory is on disk the rename may not be: not committed. */
  int dfd = open(d->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  r = dfd < 0 ? -errno : ckpt_io_fsync(d->io, dfd);
  if (dfd >= 0) close(dfd);
  if (r < 0) {
    fail_msg(d, "fsync the directory", d->dir, r, err, errlen);
    return r;
  }
  FAILPOINT_STEP(d->failpoints, "dirsync");
  if (prune) prune(arg);
  FAILPOINT_STEP(d->failpoints, "pruned");
  return 0;
out_unlink:
  fail_msg(d, what, d->tmp, r, err, errlen);
  durable_abort(d);
  return r;
}

size_t durable_keep_newest(const struct durable_series *s) {
  size_t kept = 0, deleted = 0;
  char path[4200];
  for (size_t i = 0; i < s->count; i++) {
    bool full = kept == s->keep; /* everything of the series from here on goes */
    int kind = s->file(s->arg, i, !full, path, sizeof(path));
    if (kind == DURABLE_OTHER) continue;
    if (!full && kind == DURABLE_VALID) {
      kept++;
      continue;
    }
    if (!full && !s->drop_invalid) continue;
    if (unlink(path) == 0)
      deleted++;
    else
      log_warn("cannot remove an old checkpoint", "path=%s error=\"%s\"", path, strerror(errno));
  }
  return deleted;
}
