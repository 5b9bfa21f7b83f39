/* replay: runs a fuzz harness's LLVMFuzzerTestOneInput over files, without
 * libFuzzer, so the seed corpus is a regression test in every build (gcc or
 * clang, with or without sanitizers).
 *
 *   fuzz_<name>_replay FILE|DIR...
 *
 * A directory stands for the regular files directly in it, in name order.
 * Each file is read whole into a buffer of exactly its size (so ASan sees
 * any read past the input) and handed to the harness once. The harness
 * abort()s on a finding; this program exits 1 if an argument cannot be read
 * or nothing at all was replayed (a wrong corpus path must not pass). */
#include <dirent.h>
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int replay_file(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    fprintf(stderr, "replay: %s: %s\n", path, strerror(errno));
    return -1;
  }
  int r = -1;
  uint8_t *buf = NULL;
  struct stat st;
  if (fstat(fileno(f), &st) != 0) goto out;
  size_t n = (size_t)st.st_size;
  buf = malloc(n ? n : 1);
  if (!buf || fread(buf, 1, n, f) != n) goto out;
  /* an empty input is passed with a valid pointer, as libFuzzer does */
  LLVMFuzzerTestOneInput(buf, n);
  r = 0;
out:
  if (r < 0) fprintf(stderr, "replay: cannot read %s\n", path);
  free(buf);
  fclose(f);
  return r;
}

static int by_name(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Replays every regular file in dir; returns the count or -1. */
static long replay_dir(const char *dir) {
  DIR *d = opendir(dir);
  if (!d) {
    fprintf(stderr, "replay: %s: %s\n", dir, strerror(errno));
    return -1;
  }
  char **paths = NULL;
  size_t n = 0, cap = 0;
  long r = 0;
  struct dirent *e;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    size_t len = strlen(dir) + strlen(e->d_name) + 2;
    char *p = malloc(len);
    if (!p) {
      r = -1;
      break;
    }
    snprintf(p, len, "%s/%s", dir, e->d_name);
    struct stat st;
    if (stat(p, &st) != 0 || !S_ISREG(st.st_mode)) {
      free(p);
      continue;
    }
    if (n == cap) {
      cap = cap ? cap * 2 : 64;
      char **np = realloc(paths, cap * sizeof(*np));
      if (!np) {
        free(p);
        r = -1;
        break;
      }
      paths = np;
    }
    paths[n++] = p;
  }
  closedir(d);
  if (n > 1) qsort(paths, n, sizeof(*paths), by_name);
  for (size_t i = 0; i < n; i++) {
    if (r >= 0) r = replay_file(paths[i]) < 0 ? -1 : r + 1;
    free(paths[i]);
  }
  free(paths);
  return r;
}

int main(int argc, char **argv) {
  if (argc < 2) {
    fprintf(stderr, "usage: %s FILE|DIR...\n", argv[0]);
    return 2;
  }
  long total = 0;
  for (int i = 1; i < argc; i++) {
    struct stat st;
    if (stat(argv[i], &st) != 0) {
      fprintf(stderr, "replay: %s: %s\n", argv[i], strerror(errno));
      return 1;
    }
    long n = S_ISDIR(st.st_mode) ? replay_dir(argv[i]) : (replay_file(argv[i]) < 0 ? -1 : 1);
    if (n < 0) return 1;
    total += n;
  }
  if (total == 0) {
    fprintf(stderr, "replay: no input files\n");
    return 1;
  }
  printf("replayed %ld inputs\n", total);
  return 0;
}
