/* faulty_io: a ckpt_io backend (common/ckpt_io.h) for tests whose writes or
 * fsyncs fail on demand: with faulty_write every pwrite returns -ENOSPC,
 * with faulty_file / faulty_dir every fsync of a regular file / directory
 * returns -EIO; otherwise plain pwrite and fsync. Use as
 * `struct ckpt_io io = {.ops = &faulty_ops};`. Include once per test
 * executable (the tests of the checkpoint commit: durable, the crash tests). */
#ifndef PS_TEST_FAULTY_IO_H
#define PS_TEST_FAULTY_IO_H

#include <errno.h>
#include <stdbool.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_io.h"

static bool faulty_write, faulty_file, faulty_dir;

static int faulty_pwrite(struct ckpt_io *io, int fd, const void *buf, size_t n, uint64_t off,
                         size_t *written) {
  (void)io;
  if (faulty_write) return -ENOSPC;
  ssize_t w = pwrite(fd, buf, n, (off_t)off);
  if (w < 0) return -errno;
  *written = (size_t)w;
  return 0;
}

static int faulty_fsync(struct ckpt_io *io, int fd) {
  (void)io;
  struct stat st;
  if (fstat(fd, &st) != 0) return -errno;
  if (S_ISDIR(st.st_mode) ? faulty_dir : faulty_file) return -EIO;
  return fsync(fd) == 0 ? 0 : -errno;
}

static const struct ckpt_io_ops faulty_ops = {"faulty", faulty_pwrite, faulty_fsync, NULL};

#endif
