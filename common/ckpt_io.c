/* ckpt_io: backend choice and the retry loop shared by both backends. The
 * backends only do one operation each (which may be short); the loop here
 * turns that into "all or an error". */
#include "ckpt_io.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int ckpt_io_open(enum ckpt_io_kind kind, struct ckpt_io **out) {
  struct ckpt_io *io = calloc(1, sizeof(*io));
  if (!io) return -ENOMEM;
  int r = -EINVAL;
  if (kind == CKPT_IO_URING || kind == CKPT_IO_AUTO) {
    r = ckpt_io_uring_open(io);
    if (r < 0 && kind == CKPT_IO_AUTO) {
      snprintf(io->fallback_why, sizeof(io->fallback_why), "io_uring unavailable: %s",
               strerror(-r));
      r = ckpt_io_sync_open(io);
    }
  } else if (kind == CKPT_IO_SYNC) {
    r = ckpt_io_sync_open(io);
  }
  if (r < 0) {
    free(io);
    return r;
  }
  *out = io;
  return 0;
}

void ckpt_io_close(struct ckpt_io *io) {
  if (!io) return;
  if (io->ops && io->ops->close) io->ops->close(io);
  free(io);
}

const char *ckpt_io_name(const struct ckpt_io *io) {
  return io->ops->name;
}

int ckpt_io_pwrite_all(struct ckpt_io *io, int fd, const void *buf, size_t n, uint64_t off) {
  const char *p = buf;
  while (n > 0) {
    size_t want = n;
    if (io->max_write && want > io->max_write) want = io->max_write;
    if (want > (1u << 30)) want = 1u << 30; /* one operation's result must fit an int */
    size_t done = 0;
    int r = io->ops->pwrite_some(io, fd, p, want, off, &done);
    if (r == -EINTR || r == -EAGAIN) continue;
    if (r < 0) return r;
    if (done == 0) return -EIO; /* no progress: never loop forever */
    p += done;
    off += done;
    n -= done;
  }
  return 0;
}

int ckpt_io_fsync(struct ckpt_io *io, int fd) {
  int r;
  do r = io->ops->fsync(io, fd);
  while (r == -EINTR);
  return r;
}
