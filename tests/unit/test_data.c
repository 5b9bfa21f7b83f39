/* test_data: IDX loading (raw and gzip), its error reporting, the epoch order
 * and batch gathering.
 *
 * Small IDX files are written into a fresh mkdtemp directory, one directory per
 * case, and removed at the end. Every error case must fail with a message that
 * names the offending file. The epoch-order values hard-coded below were
 * computed once by a plain Python transcription of the algorithm in data.h; they
 * lock the C code and tools/bench/ps-torch-ref together. If the Fashion-MNIST package
 * is installed the real files are loaded too. Exit 0 pass, 1 fail. */
#include "data.h"

#include <errno.h>
#include <ftw.h>
#include <limits.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>
#include "check.h"

#define FASHION_DIR "/usr/share/datasets/fashion-mnist"

static char tmpdir[] = "/tmp/test_data.XXXXXX";

static void put_be32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)(v >> 24);
  p[1] = (uint8_t)(v >> 16);
  p[2] = (uint8_t)(v >> 8);
  p[3] = (uint8_t)v;
}

/* Writes an IDX file: header (magic, ndim dims) then data, then cut to `keep`
 * bytes in total when keep >= 0. gz selects gzip output. Returns 0 or -1. */
static int write_idx(const char *path, uint32_t magic, int ndim, const uint32_t *dims,
                     const uint8_t *data, size_t len, long keep, int gz) {
  size_t hlen = 4 + 4 * (size_t)ndim, total = hlen + len;
  uint8_t *buf = malloc(total);
  int rc = -1;

  if (buf == NULL) return -1;
  put_be32(buf, magic);
  for (int k = 0; k < ndim; k++) put_be32(buf + 4 + 4 * k, dims[k]);
  memcpy(buf + hlen, data, len);
  if (keep >= 0 && (size_t)keep < total) total = (size_t)keep;
  if (gz) {
    gzFile f = gzopen(path, "wb");
    if (f != NULL) {
      if (total == 0 || gzwrite(f, buf, (unsigned)total) == (int)total) rc = 0;
      if (gzclose(f) != Z_OK) rc = -1;
    }
  } else {
    FILE *f = fopen(path, "wb");
    if (f != NULL) {
      if (fwrite(buf, 1, total, f) == total) rc = 0;
      if (fclose(f) != 0) rc = -1;
    }
  }
  free(buf);
  return rc;
}

/* A tiny set: n images of 3x4 whose pixel k of image i is (i * 12 + k) * 3. */
enum { ROWS = 3, COLS = 4, PIX = ROWS * COLS, MAXN = 8 };
static uint8_t pixels[MAXN * PIX];
static uint8_t labels[MAXN];

static void fill_sample_data(void) {
  for (int i = 0; i < MAXN * PIX; i++) pixels[i] = (uint8_t)(i * 3);
  for (int i = 0; i < MAXN; i++) labels[i] = (uint8_t)((i * 7) % 10);
}

struct case_opts {
  uint32_t img_magic, lab_magic;
  uint32_t img_n, lab_n;
  long img_keep, lab_keep; /* -1: whole file */
  int img_gz, lab_gz;
  int bad_label;
  int trailing;
  int absurd;
};

static void default_opts(struct case_opts *o) {
  memset(o, 0, sizeof(*o));
  o->img_magic = IDX_MAGIC_IMAGES;
  o->lab_magic = IDX_MAGIC_LABELS;
  o->img_n = o->lab_n = 5;
  o->img_keep = o->lab_keep = -1;
}

/* Makes <tmpdir>/<name>/ holding <split>-images/labels files per o; writes the
 * directory path into dir. */
static int make_case(const char *name, const char *split, const struct case_opts *o, char *dir,
                     size_t dirlen) {
  char ipath[PATH_MAX], lpath[PATH_MAX];
  uint32_t idims[3] = {o->img_n, ROWS, COLS}, ldims[1] = {o->lab_n};
  uint8_t lab[MAXN + 1] = {0}, pix[(MAXN + 1) * PIX] = {0};
  size_t ilen = (size_t)o->img_n * PIX, llen = o->lab_n;

  snprintf(dir, dirlen, "%s/%s", tmpdir, name);
  if (mkdir(dir, 0700) != 0) return -1;
  memcpy(lab, labels, sizeof(labels));
  memcpy(pix, pixels, sizeof(pixels));
  if (o->bad_label) lab[o->lab_n - 1] = 10;
  if (o->absurd) idims[0] = idims[1] = idims[2] = 0xffffffffu;
  if (o->trailing) ilen += 1; /* one byte more than the header announces */
  snprintf(ipath, sizeof(ipath), "%s/%s-images-idx3-ubyte%s", dir, split, o->img_gz ? ".gz" : "");
  snprintf(lpath, sizeof(lpath), "%s/%s-labels-idx1-ubyte%s", dir, split, o->lab_gz ? ".gz" : "");
  if (write_idx(ipath, o->img_magic, 3, idims, pix, ilen, o->img_keep, o->img_gz) != 0) return -1;
  if (write_idx(lpath, o->lab_magic, 1, ldims, lab, llen, o->lab_keep, o->lab_gz) != 0) return -1;
  return 0;
}

static void check_loaded(const char *what, const struct dataset *ds, uint32_t n) {
  CHECK(ds->n == n && ds->rows == ROWS && ds->cols == COLS, "%s: shape %u x %u x %u", what, ds->n,
        ds->rows, ds->cols);
  if (ds->n != n || ds->pixels == NULL || ds->labels == NULL) return;
  for (uint32_t i = 0; i < n * PIX; i++) {
    if (ds->pixels[i] != pixels[i]) {
      CHECK(0, "%s: pixel %u is %u, want %u", what, i, ds->pixels[i], pixels[i]);
      break;
    }
  }
  for (uint32_t i = 0; i < n; i++)
    CHECK(ds->labels[i] == labels[i], "%s: label %u is %u, want %u", what, i, ds->labels[i],
          labels[i]);
}

static void test_good(void) {
  struct case_opts o;
  struct dataset ds;
  char dir[PATH_MAX], err[512] = "";
  int rc;

  default_opts(&o);
  CHECK(make_case("raw", "train", &o, dir, sizeof(dir)) == 0, "setup raw");
  rc = dataset_load(dir, "train", &ds, err, sizeof(err));
  CHECK(rc == 0, "raw load: %d %s", rc, err);
  if (rc == 0) check_loaded("raw", &ds, 5);
  dataset_free(&ds);
  CHECK(ds.pixels == NULL && ds.labels == NULL && ds.n == 0, "dataset_free zeroes");
  dataset_free(&ds); /* twice is harmless */

  default_opts(&o);
  o.img_gz = o.lab_gz = 1;
  o.img_n = o.lab_n = MAXN;
  CHECK(make_case("gz", "t10k", &o, dir, sizeof(dir)) == 0, "setup gz");
  rc = dataset_load(dir, "t10k", &ds, err, sizeof(err));
  CHECK(rc == 0, "gz load: %d %s", rc, err);
  if (rc == 0) check_loaded("gz", &ds, MAXN);
  dataset_free(&ds);

  default_opts(&o);
  o.img_gz = 1; /* gzip images next to raw labels */
  CHECK(make_case("mixed", "train", &o, dir, sizeof(dir)) == 0, "setup mixed");
  rc = dataset_load(dir, "train", &ds, err, sizeof(err));
  CHECK(rc == 0, "mixed load: %d %s", rc, err);
  if (rc == 0) check_loaded("mixed", &ds, 5);
  dataset_free(&ds);
  dataset_free(NULL);
}

/* Runs dataset_load on a case expected to fail and checks the code and that
 * the message names `file`. */
static void expect_fail(const char *name, const struct case_opts *o, int want_rc,
                        const char *file) {
  struct dataset ds;
  char dir[PATH_MAX], err[512] = "";
  int rc;

  if (o != NULL) {
    if (make_case(name, "train", o, dir, sizeof(dir)) != 0) {
      CHECK(0, "%s: setup failed", name);
      return;
    }
  } else {
    snprintf(dir, sizeof(dir), "%s/%s", tmpdir, name);
    CHECK(mkdir(dir, 0700) == 0, "%s: mkdir", name);
  }
  memset(&ds, 0xa5, sizeof(ds));
  rc = dataset_load(dir, "train", &ds, err, sizeof(err));
  CHECK(rc == want_rc, "%s: rc %d (%s), want %d", name, rc, strerror(-rc), want_rc);
  CHECK(strstr(err, file) != NULL, "%s: message \"%s\" does not name %s", name, err, file);
  CHECK(ds.pixels == NULL && ds.labels == NULL && ds.n == 0, "%s: *out not zeroed", name);
  printf("ok %-16s %s\n", name, err);
  dataset_free(&ds);
}

static void test_errors(void) {
  static const char *img = "train-images-idx3-ubyte", *lab = "train-labels-idx1-ubyte";
  struct case_opts o;
  char dir[PATH_MAX];

  expect_fail("missing", NULL, -ENOENT, img);
  /* Images present, labels missing. */
  default_opts(&o);
  CHECK(make_case("missing-labels", "train", &o, dir, sizeof(dir)) == 0, "setup");
  {
    char lpath[PATH_MAX + 64], err[512] = "";
    struct dataset ds;
    snprintf(lpath, sizeof(lpath), "%s/%s", dir, lab);
    CHECK(unlink(lpath) == 0, "unlink %s", lpath);
    CHECK(dataset_load(dir, "train", &ds, err, sizeof(err)) == -ENOENT, "missing labels rc");
    CHECK(strstr(err, lab) != NULL, "missing labels message \"%s\"", err);
  }

  default_opts(&o);
  o.img_magic = 0x00000801;
  expect_fail("bad-magic-img", &o, -EBADMSG, img);
  default_opts(&o);
  o.lab_magic = 0x00000803;
  expect_fail("bad-magic-lab", &o, -EBADMSG, lab);
  default_opts(&o);
  o.img_magic = 0x1f8b0803; /* not even IDX */
  o.img_gz = 1;
  expect_fail("bad-magic-gz", &o, -EBADMSG, img);

  default_opts(&o);
  o.img_keep = 16 + 5 * PIX - 3;
  expect_fail("trunc-img", &o, -EBADMSG, img);
  default_opts(&o);
  o.img_keep = 16 + 5 * PIX - 3;
  o.img_gz = 1;
  expect_fail("trunc-img-gz", &o, -EBADMSG, img);
  default_opts(&o);
  o.img_keep = 10; /* inside the header */
  expect_fail("trunc-img-hdr", &o, -EBADMSG, img);
  default_opts(&o);
  o.lab_keep = 8 + 2;
  expect_fail("trunc-lab", &o, -EBADMSG, lab);
  default_opts(&o);
  o.lab_keep = 8 + 2;
  o.lab_gz = 1;
  expect_fail("trunc-lab-gz", &o, -EBADMSG, lab);

  default_opts(&o);
  o.lab_n = 4;
  expect_fail("count-mismatch", &o, -EBADMSG, lab);
  default_opts(&o);
  o.lab_n = 6;
  expect_fail("count-mismatch2", &o, -EBADMSG, lab);
  default_opts(&o);
  o.bad_label = 1;
  expect_fail("bad-label", &o, -EBADMSG, lab);
  default_opts(&o);
  o.trailing = 1;
  expect_fail("trailing", &o, -EBADMSG, img);
  default_opts(&o);
  o.absurd = 1;
  expect_fail("absurd-dims", &o, -EFBIG, img);
}

/* A gzip stream cut in the middle (not a short but well-formed stream). */
static void test_cut_gzip(void) {
  char path[PATH_MAX], err[512] = "";
  uint8_t big[4096];
  uint32_t dims[3] = {64, 8, 8};
  struct idx_file f;
  struct stat st;
  int rc;

  for (size_t i = 0; i < sizeof(big); i++)
    big[i] = (uint8_t)(i * 2654435761u >> 13); /* poorly compressible */
  snprintf(path, sizeof(path), "%s/cut.gz", tmpdir);
  CHECK(write_idx(path, IDX_MAGIC_IMAGES, 3, dims, big, sizeof(big), -1, 1) == 0, "write");
  CHECK(stat(path, &st) == 0 && st.st_size > 100, "stat");
  CHECK(truncate(path, st.st_size / 2) == 0, "truncate");
  rc = idx_load_file(path, IDX_MAGIC_IMAGES, &f, err, sizeof(err));
  CHECK(rc == -EBADMSG, "cut gzip: rc %d", rc);
  CHECK(strstr(err, "cut.gz") != NULL, "cut gzip message \"%s\"", err);
  CHECK(f.data == NULL && f.size == 0, "cut gzip: out not zeroed");
  printf("ok %-16s %s\n", "cut-gzip", err);
  idx_file_free(&f);
  idx_file_free(NULL);
}

static int is_permutation(const uint32_t *p, uint32_t n) {
  uint8_t *seen = calloc(n ? n : 1, 1);
  int ok = seen != NULL;

  for (uint32_t i = 0; ok && i < n; i++) {
    if (p[i] >= n || seen[p[i]])
      ok = 0;
    else
      seen[p[i]] = 1;
  }
  free(seen);
  return ok;
}

static void test_epoch_order(void) {
  /* From a Python transcription of data.h's algorithm (see tools/bench/ps-torch-ref). */
  static const uint32_t want_e0[10] = {0, 9, 5, 8, 6, 4, 7, 2, 1, 3};
  static const uint32_t want_e1[10] = {2, 3, 9, 7, 5, 8, 6, 4, 0, 1};
  static const uint32_t want_dead[8] = {896, 583, 704, 246, 845, 472, 591, 978};
  uint32_t a[10], b[10], *big = malloc(60000 * sizeof(uint32_t)),
                         *big2 = malloc(60000 * sizeof(uint32_t));

  if (big == NULL || big2 == NULL) {
    CHECK(0, "out of memory");
    goto cleanup;
  }
  dataset_epoch_order(42, 0, 10, a);
  CHECK(memcmp(a, want_e0, sizeof(a)) == 0, "seed 42 epoch 0 differs from the Python values");
  dataset_epoch_order(42, 1, 10, b);
  CHECK(memcmp(b, want_e1, sizeof(b)) == 0, "seed 42 epoch 1 differs from the Python values");
  dataset_epoch_order(0xDEADBEEF, 3, 1000, big);
  CHECK(memcmp(big, want_dead, sizeof(want_dead)) == 0, "seed 0xDEADBEEF epoch 3 head differs");
  CHECK(big[997] == 311 && big[998] == 588 && big[999] == 624, "seed 0xDEADBEEF epoch 3 tail");

  dataset_epoch_order(7, 5, 60000, big);
  CHECK(big[0] == 38775 && big[1] == 4057 && big[30000] == 58001 && big[59999] == 54436,
        "seed 7 epoch 5 n 60000: %u %u %u %u", big[0], big[1], big[30000], big[59999]);
  CHECK(is_permutation(big, 60000), "not a permutation");
  dataset_epoch_order(7, 5, 60000, big2);
  CHECK(memcmp(big, big2, 60000 * sizeof(uint32_t)) == 0, "not deterministic");
  dataset_epoch_order(7, 6, 60000, big2);
  CHECK(memcmp(big, big2, 60000 * sizeof(uint32_t)) != 0, "epochs 5 and 6 give the same order");
  dataset_epoch_order(8, 5, 60000, big2);
  CHECK(memcmp(big, big2, 60000 * sizeof(uint32_t)) != 0, "seeds 7 and 8 give the same order");
  dataset_epoch_order(1, 0, 1, a);
  CHECK(a[0] == 0, "n = 1");
  dataset_epoch_order(1, 0, 0, a); /* must not touch anything */

  CHECK(dataset_steps_per_epoch(60000, 64, 2) == 468, "steps 60000/128");
  CHECK(dataset_steps_per_epoch(60000, 128, 1) == 468, "steps 60000/128");
  CHECK(dataset_steps_per_epoch(100, 0, 2) == 0, "steps with batch 0");
  CHECK(dataset_steps_per_epoch(100, 101, 1) == 0, "steps with batch > n");

cleanup:
  free(big);
  free(big2);
}

static void test_gather(void) {
  struct case_opts o;
  struct dataset ds;
  char dir[PATH_MAX], err[512] = "";
  uint32_t idx[3] = {4, 0, 2};
  float x[3 * PIX];
  uint8_t y[3];

  default_opts(&o);
  if (make_case("gather", "train", &o, dir, sizeof(dir)) != 0 ||
      dataset_load(dir, "train", &ds, err, sizeof(err)) != 0) {
    CHECK(0, "gather setup: %s", err);
    return;
  }
  dataset_gather(&ds, idx, 3, x, y);
  for (int k = 0; k < 3; k++) {
    CHECK(y[k] == labels[idx[k]], "gather label %d", k);
    for (int i = 0; i < PIX; i++)
      CHECK(x[k * PIX + i] == (float)ds.pixels[idx[k] * PIX + i] / 255.0f, "gather image %d px %d",
            k, i);
  }
  dataset_free(&ds);
}

/* Returns false, having said why, when the dataset is not installed: the
 * test is then reported skipped (77), not passed. */
static bool test_fashion_mnist(void) {
  struct dataset ds;
  char err[512] = "";
  uint32_t count[DATASET_NUM_CLASSES] = {0};
  float lo = 1.0f, hi = 0.0f;
  int rc;

  if (access(FASHION_DIR, R_OK) != 0) {
    printf("SKIP: the Fashion-MNIST part: %s is not installed (dataset-fashion-mnist)\n",
           FASHION_DIR);
    return false;
  }
  rc = dataset_load(FASHION_DIR, "train", &ds, err, sizeof(err));
  CHECK(rc == 0, "fashion train: %s", err);
  if (rc == 0) {
    CHECK(ds.n == 60000 && ds.rows == 28 && ds.cols == 28, "train shape %u x %u x %u", ds.n,
          ds.rows, ds.cols);
    for (uint32_t i = 0; i < ds.n; i++)
      count[ds.labels[i]]++; /* labels < 10 is guaranteed by the loader */
    for (int c = 0; c < DATASET_NUM_CLASSES; c++)
      CHECK(count[c] == 6000, "train class %d has %u samples", c, count[c]);
    float *x = malloc(784 * sizeof(float));
    uint8_t y;
    for (uint32_t k = 0; k < ds.n; k++) {
      dataset_gather(&ds, &k, 1, x, &y);
      for (size_t i = 0; i < 784; i++) {
        lo = x[i] < lo ? x[i] : lo;
        hi = x[i] > hi ? x[i] : hi;
      }
    }
    free(x);
    CHECK(lo == 0.0f && hi == 1.0f, "pixel range %g..%g", lo, hi);
  }
  dataset_free(&ds);
  rc = dataset_load(FASHION_DIR, "t10k", &ds, err, sizeof(err));
  CHECK(rc == 0, "fashion t10k: %s", err);
  if (rc == 0)
    CHECK(ds.n == 10000 && ds.rows == 28 && ds.cols == 28, "t10k shape %u x %u x %u", ds.n, ds.rows,
          ds.cols);
  dataset_free(&ds);
  return true;
}

static int rm_entry(const char *path, const struct stat *st, int flag, struct FTW *ftw) {
  return remove(path);
}

int main(void) {
  if (mkdtemp(tmpdir) == NULL) {
    perror("mkdtemp");
    return 1;
  }
  fill_sample_data();
  test_good();
  test_errors();
  test_cut_gzip();
  test_epoch_order();
  test_gather();
  bool complete = test_fashion_mnist();
  nftw(tmpdir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
  if (failures) {
    fprintf(stderr, "test_data: %d check(s) failed\n", failures);
    return 1;
  }
  printf("test_data: all checks %s\n", complete ? "passed" : "that could run passed");
  return complete ? 0 : 77;
}
