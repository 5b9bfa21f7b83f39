/* durable (common/durable.c) on its own, where the two checkpoint crash
 * tests do not reach: a write that fails (a backend whose pwrite returns
 * -ENOSPC) fails the commit naming the write, the path and the backend, and
 * leaves neither the temp file nor the final one; an abort removes the temp
 * file; a commit through a backend whose directory fsync fails returns the
 * error and skips the prune; and durable_keep_newest's rule: the newest N
 * valid files stay, every older one goes, another owner's file is never
 * counted nor deleted, an invalid one newer than the last kept stays unless
 * drop_invalid, and with fewer than N valid nothing valid goes. */
#include "durable.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"
#include "check.h"
#include "faulty_io.h"

static bool exists(const char *p) {
  return access(p, F_OK) == 0;
}

static int pruned;
static void count_prune(void *arg) {
  (void)arg;
  pruned++;
}

static void commit_paths(const char *dir) {
  struct ckpt_io io = {.ops = &faulty_ops};
  char tmp[300], final[300], err[600] = "";
  snprintf(tmp, sizeof(tmp), "%s/.f.tmp", dir);
  snprintf(final, sizeof(final), "%s/f", dir);
  struct durable d;

  /* a good commit */
  CHECK(durable_open(&d, &io, dir, tmp, final, "t", err, sizeof(err)) == 0, "%s", err);
  CHECK(durable_write(&d, "hello ", 6) == 0 && durable_write(&d, "world", 5) == 0);
  CHECK(durable_commit(&d, count_prune, NULL, err, sizeof(err)) == 0, "%s", err);
  struct stat st;
  CHECK(stat(final, &st) == 0 && st.st_size == 11 && !exists(tmp) && pruned == 1,
        "a commit: final %lld bytes, tmp %d, pruned %d", (long long)st.st_size, exists(tmp),
        pruned);

  /* a failed write: the error is kept, the commit reports it */
  unlink(final);
  CHECK(durable_open(&d, &io, dir, tmp, final, "t", err, sizeof(err)) == 0, "%s", err);
  faulty_write = true;
  CHECK(durable_write(&d, "x", 1) == -ENOSPC && durable_write(&d, "y", 1) == -ENOSPC);
  faulty_write = false;
  int r = durable_commit(&d, count_prune, NULL, err, sizeof(err));
  CHECK(r == -ENOSPC && strstr(err, "cannot write ") && strstr(err, tmp) &&
            strstr(err, "faulty backend"),
        "a failed write: %d \"%s\"", r, err);
  CHECK(!exists(tmp) && !exists(final) && pruned == 1, "a failed write left a file or pruned");
  fprintf(stderr, "a write fails:                %s\n", err);

  /* an abort */
  CHECK(durable_open(&d, &io, dir, tmp, final, "t", err, sizeof(err)) == 0, "%s", err);
  durable_write(&d, "z", 1);
  durable_abort(&d);
  CHECK(!exists(tmp) && !exists(final), "an abort left a file");

  /* the directory's fsync fails: an error, the file is there, no prune */
  CHECK(durable_open(&d, &io, dir, tmp, final, "t", err, sizeof(err)) == 0, "%s", err);
  durable_write(&d, "z", 1);
  faulty_dir = true;
  r = durable_commit(&d, count_prune, NULL, err, sizeof(err));
  faulty_dir = false;
  CHECK(r == -EIO && strstr(err, "cannot fsync the directory ") && strstr(err, dir),
        "a failed directory fsync: %d \"%s\"", r, err);
  CHECK(exists(final) && !exists(tmp) && pruned == 1, "after a failed directory fsync");
  fprintf(stderr, "the directory's fsync fails:  %s\n", err);

  /* a temp file that cannot be created names it */
  char bad[400];
  snprintf(bad, sizeof(bad), "%s/no/such/dir.tmp", dir);
  r = durable_open(&d, &io, dir, bad, final, "t", err, sizeof(err));
  CHECK(r == -ENOENT && strstr(err, "cannot create ") && strstr(err, bad), "%d \"%s\"", r, err);
}

/* A series described by a string, newest first: 'v' valid, 'i' invalid,
 * 'o' another owner's; deleted files are marked in gone. */
struct series {
  const char *kinds;
  const char *dir;
};

static int series_file(void *arg, size_t i, bool check, char *path, size_t len) {
  struct series *s = arg;
  snprintf(path, len, "%s/%zu", s->dir, i);
  if (s->kinds[i] == 'o') return DURABLE_OTHER;
  if (!check) return DURABLE_INVALID;
  return s->kinds[i] == 'v' ? DURABLE_VALID : DURABLE_INVALID;
}

/* Runs keep_newest over kinds and returns which files are left ("1" left, "0" gone). */
static void keep_case(const char *dir, const char *kinds, size_t keep, bool drop_invalid,
                      const char *want) {
  size_t n = strlen(kinds);
  for (size_t i = 0; i < n; i++) {
    char p[300];
    snprintf(p, sizeof(p), "%s/%zu", dir, i);
    int fd = open(p, O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (fd >= 0) close(fd);
  }
  struct series s = {.kinds = kinds, .dir = dir};
  struct durable_series ds = {
      .count = n, .keep = keep, .drop_invalid = drop_invalid, .file = series_file, .arg = &s};
  size_t deleted = durable_keep_newest(&ds);
  char got[64] = "";
  size_t gone = 0;
  for (size_t i = 0; i < n; i++) {
    char p[300];
    snprintf(p, sizeof(p), "%s/%zu", dir, i);
    got[i] = exists(p) ? '1' : '0';
    gone += got[i] == '0';
    unlink(p);
  }
  CHECK(strcmp(got, want) == 0 && deleted == gone, "%s keep %zu%s: left %s, want %s (%zu deleted)",
        kinds, keep, drop_invalid ? " drop_invalid" : "", got, want, deleted);
}

int main(void) {
  log_setup("test_durable", LOG_ERROR);
  char dir[] = "/tmp/test_durable.XXXXXX";
  if (!mkdtemp(dir)) return 1;
  commit_paths(dir);
  /* the worker's rule: keep 3 valid, an invalid newer one stays */
  keep_case(dir, "vivvvi", 3, false, "111100");
  keep_case(dir, "vvi", 3, false, "111");
  keep_case(dir, "ivvov", 2, false, "11110");
  /* the shard's rule (older files only): keep 1 readable, drop the unreadable */
  keep_case(dir, "iovivo", 1, true, "011001");
  keep_case(dir, "ii", 1, true, "00");
  keep_case(dir, "", 1, true, "");
  char cmd[200];
  snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
  if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", dir);
  if (failures) fprintf(stderr, "%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
