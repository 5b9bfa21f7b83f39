/* worker_ckpt: see worker_ckpt.h. */
#include "worker_ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "crc32c.h"
#include "le.h"
#include "log.h"

#define MAGIC 0x4b575350u     /* "PSWK" */
#define END_MAGIC 0x5053574bu /* "KWSP" */
#define VERSION 1u
#define HEAD_BYTES 48u

static void path_of(char *out, size_t len, const char *dir, uint32_t rank, uint64_t step,
                    const char *ext) {
  snprintf(out, len, "%s/worker-%04" PRIu32 "-step-%016" PRIu64 ".ckpt%s", dir, rank, step, ext);
}

/* The file's size for m (with or without velocity). */
static size_t file_bytes(const struct mlp *m, bool velocity) {
  size_t n = HEAD_BYTES + 8u * (size_t)mlp_num_tensors(m) + 8;
  return n + mlp_num_params(m) * sizeof(float) * (velocity ? 2 : 1);
}

static int cmp_desc(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? 1 : x > y ? -1 : 0;
}

/* The steps of this rank's checkpoint files in dir (by name), newest
 * first, in *out (malloc'd; free it). Returns how many (0: none). */
static size_t file_steps(const char *dir, uint32_t rank, uint64_t **out) {
  *out = NULL;
  DIR *d = opendir(dir);
  if (!d) return 0;
  size_t n = 0, cap = 16;
  uint64_t *all = malloc(cap * sizeof(uint64_t));
  char prefix[32];
  snprintf(prefix, sizeof(prefix), "worker-%04" PRIu32 "-step-", rank);
  struct dirent *e;
  while (all && (e = readdir(d))) {
    uint64_t s;
    char tail[16];
    if (strncmp(e->d_name, prefix, strlen(prefix)) != 0 ||
        sscanf(e->d_name + strlen(prefix), "%" SCNu64 "%15s", &s, tail) != 2 ||
        strcmp(tail, ".ckpt") != 0)
      continue;
    if (n == cap) {
      uint64_t *more = realloc(all, 2 * cap * sizeof(uint64_t));
      if (!more) break;
      all = more;
      cap *= 2;
    }
    all[n++] = s;
  }
  closedir(d);
  if (all) qsort(all, n, sizeof(uint64_t), cmp_desc);
  *out = all;
  return all ? n : 0;
}

int worker_ckpt_save(const char *dir, const struct worker_ckpt_id *id, uint64_t step, struct mlp *m,
                     float *const *velocity, char *err, size_t errlen) {
  int nt = mlp_num_tensors(m);
  bool vel = velocity && velocity[0];
  size_t bytes = file_bytes(m, vel);
  uint8_t *buf = malloc(bytes);
  if (!buf) {
    snprintf(err, errlen, "out of memory for a %zu-byte checkpoint", bytes);
    return -ENOMEM;
  }
  le_put32(buf, MAGIC);
  le_put32(buf + 4, VERSION);
  le_put32(buf + 8, id->rank);
  le_put32(buf + 12, id->world);
  le_put64(buf + 16, step);
  le_put64(buf + 24, id->seed);
  le_put32(buf + 32, id->batch);
  le_put32(buf + 36, (uint32_t)nt);
  le_put32(buf + 40, vel);
  le_put32(buf + 44, 0);
  size_t off = HEAD_BYTES;
  for (int t = 0; t < nt; t++, off += 8) le_put64(buf + off, mlp_tensor_count(m, t));
  for (int pass = 0; pass < (vel ? 2 : 1); pass++)
    for (int t = 0; t < nt; t++) {
      size_t n = mlp_tensor_count(m, t) * sizeof(float);
      memcpy(buf + off, pass ? velocity[t] : mlp_param(m, t), n); /* little-endian floats */
      off += n;
    }
  le_put32(buf + off, crc32c_update(0, buf, off));
  le_put32(buf + off + 4, END_MAGIC);
  char tmp[4200], final[4200];
  path_of(tmp, sizeof(tmp), dir, id->rank, step, ".tmp");
  path_of(final, sizeof(final), dir, id->rank, step, "");
  int r = 0;
  const char *what = "create";
  if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
    r = -errno;
    what = "create the directory";
  }
  int fd = r ? -1 : open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (!r && fd < 0) r = -errno;
  for (size_t done = 0; !r && done < bytes;) {
    ssize_t w = write(fd, buf + done, bytes - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      r = w < 0 ? -errno : -EIO;
      what = "write";
    }
    done += w > 0 ? (size_t)w : 0;
  }
  if (!r && fsync(fd) != 0) {
    r = -errno;
    what = "fsync";
  }
  if (fd >= 0 && close(fd) != 0 && !r) r = -errno;
  if (!r && rename(tmp, final) != 0) {
    r = -errno;
    what = "rename";
  }
  free(buf);
  if (r) {
    unlink(tmp);
    snprintf(err, errlen, "cannot %s %s: %s", what, tmp, strerror(-r));
    return r;
  }
  int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)fsync(dfd); /* the rename is durable */
    close(dfd);
  }
  /* keep this one and the previous: remove this rank's older ones */
  uint64_t keep[2], *all;
  int n = worker_ckpt_list(dir, id, m, vel, keep, 2);
  size_t nf = file_steps(dir, id->rank, &all);
  for (size_t i = 0; i < nf && n == 2; i++) {
    if (all[i] >= keep[1]) continue;
    char old[4200];
    path_of(old, sizeof(old), dir, id->rank, all[i], "");
    unlink(old);
  }
  free(all);
  return 0;
}

/* Reads and checks step's file whole; on success *out holds it. */
static int read_checked(const char *dir, const struct worker_ckpt_id *id, uint64_t step,
                        const struct mlp *m, bool velocity, uint8_t **out, char *err,
                        size_t errlen) {
  char path[4200];
  path_of(path, sizeof(path), dir, id->rank, step, "");
  *out = NULL;
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(err, errlen, "%s: %s", path, strerror(errno));
    return -errno;
  }
  size_t want = file_bytes(m, velocity);
  uint8_t *buf = malloc(want + 1);
  size_t got = buf ? fread(buf, 1, want + 1, f) : 0;
  fclose(f);
  const char *why = NULL;
  char detail[200] = "";
  if (!buf)
    why = "out of memory";
  else if (got < HEAD_BYTES || le_get32(buf) != MAGIC)
    why = "not a ps-worker checkpoint (magic)";
  else if (le_get32(buf + 4) != VERSION)
    snprintf(detail, sizeof(detail), "format version %" PRIu32 ", this ps-worker reads %u",
             le_get32(buf + 4), VERSION);
  else if (got != want)
    snprintf(detail, sizeof(detail),
             "%zu bytes, the model and optimizer need %zu (truncated, "
             "or another model)",
             got, want);
  else if (le_get32(buf + want - 4) != END_MAGIC ||
           le_get32(buf + want - 8) != crc32c_update(0, buf, want - 8))
    why = "CRC32C mismatch (corrupt)";
  else if (le_get32(buf + 8) != id->rank || le_get64(buf + 16) != step)
    why = "rank or step differs from its name";
  else if (le_get32(buf + 12) != id->world)
    snprintf(detail, sizeof(detail),
             "written by a ring of %" PRIu32 " ranks, this one has %" PRIu32, le_get32(buf + 12),
             id->world);
  else if (le_get32(buf + 32) != id->batch || le_get64(buf + 24) != id->seed)
    snprintf(detail, sizeof(detail),
             "written with --batch-size %" PRIu32 " --seed %" PRIu64 ", this run has %" PRIu32
             " and %" PRIu64 " (the data position would not match)",
             le_get32(buf + 32), le_get64(buf + 24), id->batch, id->seed);
  else if (le_get32(buf + 36) != (uint32_t)mlp_num_tensors(m) || le_get32(buf + 40) != velocity)
    why = "another model or optimizer (tensors or momentum state)";
  for (int t = 0; !why && !detail[0] && t < mlp_num_tensors(m); t++)
    if (le_get64(buf + HEAD_BYTES + 8u * (size_t)t) != mlp_tensor_count(m, t))
      snprintf(detail, sizeof(detail), "tensor %s has %" PRIu64 " elements here %zu",
               mlp_tensor_name(m, t), le_get64(buf + HEAD_BYTES + 8u * (size_t)t),
               mlp_tensor_count(m, t));
  if (why || detail[0]) {
    snprintf(err, errlen, "%s: %s", path, why ? why : detail);
    free(buf);
    return -EINVAL;
  }
  *out = buf;
  return 0;
}

int worker_ckpt_list(const char *dir, const struct worker_ckpt_id *id, const struct mlp *m,
                     bool velocity, uint64_t *steps, int max) {
  uint64_t *all;
  size_t n = file_steps(dir, id->rank, &all);
  int found = 0;
  for (size_t i = 0; i < n && found < max; i++) {
    uint8_t *buf;
    char err[600];
    if (read_checked(dir, id, all[i], m, velocity, &buf, err, sizeof(err)) < 0) {
      log_warn("skipping a checkpoint that does not load", "error=\"%s\"", err);
      continue;
    }
    free(buf);
    steps[found++] = all[i];
  }
  free(all);
  return found;
}

int worker_ckpt_load(const char *dir, const struct worker_ckpt_id *id, uint64_t step, struct mlp *m,
                     float *const *velocity, char *err, size_t errlen) {
  bool vel = velocity && velocity[0];
  uint8_t *buf;
  int r = read_checked(dir, id, step, m, vel, &buf, err, errlen);
  if (r < 0) return r;
  size_t off = HEAD_BYTES + 8u * (size_t)mlp_num_tensors(m);
  for (int pass = 0; pass < (vel ? 2 : 1); pass++)
    for (int t = 0; t < mlp_num_tensors(m); t++) {
      size_t n = mlp_tensor_count(m, t) * sizeof(float);
      memcpy(pass ? velocity[t] : mlp_param(m, t), buf + off, n);
      off += n;
    }
  free(buf);
  return 0;
}
