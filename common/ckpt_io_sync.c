/* ckpt_io_sync: the plain-syscall backend (pwrite, fsync). Always built; the
 * one in use where io_uring is missing or refused. */
#include <errno.h>
#include <unistd.h>

#include "ckpt_io.h"

static int sync_pwrite_some(struct ckpt_io *io, int fd, const void *buf, size_t n, uint64_t off,
                            size_t *written) {
  (void)io;
  ssize_t w = pwrite(fd, buf, n, (off_t)off);
  if (w < 0) return -errno;
  *written = (size_t)w;
  return 0;
}

static int sync_fsync(struct ckpt_io *io, int fd) {
  (void)io;
  return fsync(fd) == 0 ? 0 : -errno;
}

static const struct ckpt_io_ops sync_ops = {"sync", sync_pwrite_some, sync_fsync, NULL};

int ckpt_io_sync_open(struct ckpt_io *io) {
  io->ops = &sync_ops;
  io->priv = NULL;
  return 0;
}
