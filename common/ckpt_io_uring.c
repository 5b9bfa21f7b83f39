/* ckpt_io_uring: the io_uring backend (liburing). One small ring per handle
 * (the writer thread's); each operation is one SQE submitted and waited for.
 * Opening creates the ring and so is the probe: io_uring_queue_init fails
 * with -ENOSYS on kernels without io_uring and -EPERM where a seccomp profile
 * refuses it, and ckpt_io_open then falls back to ckpt_io_sync.c. A write
 * completion may be short (res < n): the caller's loop continues it. */
#include <errno.h>
#include <liburing.h>
#include <stdbool.h>
#include <stdlib.h>

#include "ckpt_io.h"
#include "envknob.h"

struct uring_priv {
  struct io_uring ring;
};

static int uring_run(struct uring_priv *u, int *res) {
  int r = io_uring_submit(&u->ring);
  if (r < 0) return r;
  struct io_uring_cqe *cqe;
  do r = io_uring_wait_cqe(&u->ring, &cqe);
  while (r == -EINTR);
  if (r < 0) return r;
  *res = cqe->res;
  io_uring_cqe_seen(&u->ring, cqe);
  return 0;
}

static int uring_pwrite_some(struct ckpt_io *io, int fd, const void *buf, size_t n, uint64_t off,
                             size_t *written) {
  struct uring_priv *u = io->priv;
  struct io_uring_sqe *sqe = io_uring_get_sqe(&u->ring);
  if (!sqe) return -EBUSY;
  io_uring_prep_write(sqe, fd, buf, (unsigned)n, off);
  int res;
  int r = uring_run(u, &res);
  if (r < 0) return r;
  if (res < 0) return res;
  *written = (size_t)res;
  return 0;
}

static int uring_fsync(struct ckpt_io *io, int fd) {
  struct uring_priv *u = io->priv;
  struct io_uring_sqe *sqe = io_uring_get_sqe(&u->ring);
  if (!sqe) return -EBUSY;
  io_uring_prep_fsync(sqe, fd, 0);
  int res;
  int r = uring_run(u, &res);
  return r < 0 ? r : res < 0 ? res : 0;
}

static void uring_close(struct ckpt_io *io) {
  struct uring_priv *u = io->priv;
  if (!u) return;
  io_uring_queue_exit(&u->ring);
  free(u);
  io->priv = NULL;
}

static const struct ckpt_io_ops uring_ops = {"io_uring", uring_pwrite_some, uring_fsync,
                                             uring_close};

int ckpt_io_uring_open(struct ckpt_io *io) {
  /* PS_DISABLE_IO_URING=1 acts like a refusing seccomp profile; a value that
   * is not a boolean (the binaries refuse it at start) keeps io_uring off. */
  bool off;
  char why[160];
  if (envknob_bool("PS_DISABLE_IO_URING", &off, why, sizeof(why)) < 0) return -EINVAL;
  if (off) return -EPERM;
  struct uring_priv *u = calloc(1, sizeof(*u));
  if (!u) return -ENOMEM;
  int r = io_uring_queue_init(8, &u->ring, 0);
  if (r < 0) {
    free(u);
    return r;
  }
  io->ops = &uring_ops;
  io->priv = u;
  return 0;
}
