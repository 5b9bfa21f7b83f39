/* ckpt_io_uring_none: built instead of ckpt_io_uring.c when meson finds no
 * liburing; ckpt_io_open(CKPT_IO_AUTO) then uses the syscall backend. */
#include <errno.h>

#include "ckpt_io.h"

int ckpt_io_uring_open(struct ckpt_io *io) {
  (void)io;
  return -ENOSYS;
}
