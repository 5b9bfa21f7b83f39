/* ckpt_io: the few I/O operations a checkpoint commit needs (write a whole
 * buffer at an offset, fsync a file or a directory), behind an ops table so
 * the backend is chosen at run time. Two backends, one file each (STYLE 11):
 * ckpt_io_uring.c submits the operations through io_uring (liburing), and
 * ckpt_io_sync.c uses pwrite/fsync. meson builds ckpt_io_uring.c when
 * liburing is found and ckpt_io_uring_none.c (which refuses with -ENOSYS)
 * otherwise. ckpt_io_open(CKPT_IO_AUTO) probes io_uring and falls back to the
 * syscalls when the ring cannot be created (no liburing, ENOSYS on old
 * kernels, EPERM under container seccomp profiles); the handle says which
 * backend it is and, after a fallback, why.
 *
 * Invariant: a write either writes every byte or fails. Short writes (which
 * both pwrite and io_uring may return) are retried from where they stopped,
 * never taken for success; a write that makes no progress is -EIO.
 * A handle belongs to one thread at a time. */
#ifndef PS_CKPT_IO_H
#define PS_CKPT_IO_H

#include <stddef.h>
#include <stdint.h>

enum ckpt_io_kind { CKPT_IO_AUTO = 0, CKPT_IO_URING = 1, CKPT_IO_SYNC = 2 };

struct ckpt_io;

struct ckpt_io_ops {
  const char *name;
  int (*pwrite_some)(struct ckpt_io *io, int fd, const void *buf, size_t n, uint64_t off,
                     size_t *written);
  int (*fsync)(struct ckpt_io *io, int fd);
  void (*close)(struct ckpt_io *io);
};

struct ckpt_io {
  const struct ckpt_io_ops *ops;
  void *priv;
  size_t max_write;      /* >0: no single operation writes more (tests: forces short writes) */
  char fallback_why[96]; /* AUTO fell back to sync: why io_uring was not used */
};

/* Opens a backend. AUTO tries io_uring then the syscalls. Returns 0 or a
 * negative errno (URING where io_uring cannot be used: its error). */
int ckpt_io_open(enum ckpt_io_kind kind, struct ckpt_io **out);
void ckpt_io_close(struct ckpt_io *io);
const char *ckpt_io_name(const struct ckpt_io *io);

/* Writes all n bytes of buf at off, retrying short writes. 0 or -errno. */
int ckpt_io_pwrite_all(struct ckpt_io *io, int fd, const void *buf, size_t n, uint64_t off);
/* fsync(2) of a file or directory descriptor. 0 or -errno. */
int ckpt_io_fsync(struct ckpt_io *io, int fd);

/* Backend constructors (ckpt_io_uring.c / ckpt_io_uring_none.c, ckpt_io_sync.c). */
int ckpt_io_uring_open(struct ckpt_io *io);
int ckpt_io_sync_open(struct ckpt_io *io);

#endif
