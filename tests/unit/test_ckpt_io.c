/* Checkpoint I/O backends: io_uring (skipped where the kernel or a seccomp
 * profile refuses it) and syscalls write exactly what they were given, also
 * when every operation is cut short (max_write), and fsync files and
 * directories; AUTO falls back to syscalls, saying why, when io_uring is
 * refused (PS_DISABLE_IO_URING stands in for seccomp). */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt_io.h"
#include "check.h"

static void check_backend(struct ckpt_io *io, const char *dir, size_t max_write) {
  char path[512];
  snprintf(path, sizeof(path), "%s/f", dir);
  size_t n = 3 * 1000 * 1000 + 7;
  unsigned char *src = malloc(n), *back = malloc(n);
  for (size_t i = 0; i < n; i++) src[i] = (unsigned char)(i * 131 + 7);
  int fd = open(path, O_RDWR | O_CREAT | O_TRUNC, 0644);
  io->max_write = max_write;
  CHECK(ckpt_io_pwrite_all(io, fd, src, 100, 0) == 0, "%s head", ckpt_io_name(io));
  CHECK(ckpt_io_pwrite_all(io, fd, src + 100, n - 100, 100) == 0, "%s rest", ckpt_io_name(io));
  CHECK(ckpt_io_fsync(io, fd) == 0, "%s fsync", ckpt_io_name(io));
  CHECK(pread(fd, back, n, 0) == (ssize_t)n, "read back");
  CHECK(memcmp(src, back, n) == 0, "%s: bytes differ (max_write %zu)", ckpt_io_name(io), max_write);
  CHECK(lseek(fd, 0, SEEK_END) == (off_t)n, "size");
  int dfd = open(dir, O_RDONLY | O_DIRECTORY);
  CHECK(ckpt_io_fsync(io, dfd) == 0, "%s directory fsync", ckpt_io_name(io));
  /* a bad descriptor is an error, not a success */
  CHECK(ckpt_io_pwrite_all(io, -1, src, 10, 0) < 0, "%s write to fd -1", ckpt_io_name(io));
  close(dfd);
  close(fd);
  unlink(path);
  free(src);
  free(back);
}

int main(void) {
  char dir[] = "/tmp/test_ckpt_io.XXXXXX";
  if (!mkdtemp(dir)) return 1;
  struct ckpt_io *io = NULL;
  CHECK(ckpt_io_open(CKPT_IO_SYNC, &io) == 0, "sync");
  check_backend(io, dir, 0);
  check_backend(io, dir, 4093); /* every write short */
  ckpt_io_close(io);

  int r = ckpt_io_open(CKPT_IO_URING, &io);
  if (r == 0) {
    CHECK(strcmp(ckpt_io_name(io), "io_uring") == 0, "name");
    check_backend(io, dir, 0);
    check_backend(io, dir, 65537);
    ckpt_io_close(io);
  } else {
    fprintf(stderr, "io_uring unavailable here (%s): only the fallback is tested\n", strerror(-r));
  }
  CHECK(ckpt_io_open(CKPT_IO_AUTO, &io) == 0, "auto");
  CHECK(strcmp(ckpt_io_name(io), r == 0 ? "io_uring" : "sync") == 0, "auto picked %s",
        ckpt_io_name(io));
  ckpt_io_close(io);

  setenv("PS_DISABLE_IO_URING", "1", 1);
  CHECK(ckpt_io_open(CKPT_IO_URING, &io) == -EPERM, "refused io_uring is an error");
  CHECK(ckpt_io_open(CKPT_IO_AUTO, &io) == 0, "auto with io_uring refused");
  CHECK(strcmp(ckpt_io_name(io), "sync") == 0, "fell back to %s", ckpt_io_name(io));
  CHECK(strstr(io->fallback_why, "io_uring") != NULL, "why: %s", io->fallback_why);
  ckpt_io_close(io);
  rmdir(dir);
  if (failures) fprintf(stderr, "%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
