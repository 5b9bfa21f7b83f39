/* data: IDX loading, the per-epoch sample order and batch gathering.
 *
 * Files are read through zlib's gzopen/gzread, which pass raw files through
 * unchanged, so one code path serves both "x-idx3-ubyte" and "x-idx3-ubyte.gz".
 * Every size announced by a header is checked for overflow and against
 * IDX_MAX_BYTES before it is allocated; a raw file's real size is compared with
 * the header before allocating, and a gzip stream (whose size is unknown up
 * front) must deliver exactly the announced bytes. Errors are reported once,
 * into the caller's err buffer, always starting with the file's path.
 *
 * The epoch order is a Fisher-Yates shuffle driven by splitmix64, specified
 * exactly in data.h because tools/bench/ps-torch-ref reproduces it in Python. */
#include "data.h"

#include <errno.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "errbuf.h"
#include "tensor_math.h"

/* gzread takes an unsigned int length; stay well inside it. */
#define GZ_CHUNK ((size_t)1 << 30)

static uint32_t be32(const uint8_t *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

/* Reads up to len bytes; *got tells how many arrived before end of file. A
 * gzip stream cut short is reported by zlib as Z_BUF_ERROR: that is a
 * truncated file (-EBADMSG), not an I/O failure. */
static const char *gz_why(gzFile gz, const char *path, int *zerr) {
  const char *msg = gzerror(gz, zerr);
  size_t n = strlen(path);

  /* zlib prefixes its messages with the path, which our messages already lead with. */
  if (strncmp(msg, path, n) == 0 && msg[n] == ':' && msg[n + 1] == ' ') msg += n + 2;
  return msg;
}

static int gz_read_full(gzFile gz, const char *path, void *buf, size_t len, size_t *got,
                        const char **why) {
  uint8_t *p = buf;
  size_t done = 0;
  int zerr;

  *why = NULL;
  while (done < len) {
    size_t want = len - done < GZ_CHUNK ? len - done : GZ_CHUNK;
    int n = gzread(gz, p + done, (unsigned)want);
    if (n < 0) {
      *got = done;
      *why = gz_why(gz, path, &zerr);
      return zerr == Z_BUF_ERROR ? -EBADMSG : -EIO;
    }
    if (n == 0) break;
    done += (size_t)n;
  }
  *got = done;
  /* zlib reports a truncated gzip member only at the end, as an error with a
   * short count; surface it even when the short count came back as 0. */
  if (done < len) {
    *why = gz_why(gz, path, &zerr);
    if (zerr == Z_BUF_ERROR) return -EBADMSG;
    if (zerr != Z_OK && zerr != Z_STREAM_END) return -EIO;
    *why = NULL;
  }
  return 0;
}

int idx_load_file(const char *path, uint32_t want_magic, struct idx_file *out, char *err,
                  size_t errlen) {
  gzFile gz = NULL;
  uint8_t hdr[4 + 4 * 3];
  uint8_t extra;
  uint32_t ndim = want_magic & 0xff;
  size_t hdr_len, size = 1, got;
  const char *why;
  struct stat st;
  int rc;

  memset(out, 0, sizeof(*out));
  if ((want_magic & 0xffffff00u) != 0x00000800u || ndim < 1 || ndim > 3) {
    errbuf_set(0, err, errlen, "%s: internal error: bad expected magic 0x%08x", path, want_magic);
    return -EINVAL;
  }
  hdr_len = 4 + 4 * (size_t)ndim;

  errno = 0;
  gz = gzopen(path, "rb");
  if (gz == NULL) {
    rc = errno ? -errno : -ENOMEM;
    errbuf_set(0, err, errlen, "%s: cannot open: %s", path, strerror(-rc));
    goto cleanup;
  }
  gzbuffer(gz, 1u << 17); /* fewer syscalls and inflate calls on a 47 MB file */

  rc = gz_read_full(gz, path, hdr, 4, &got, &why);
  if (rc == 0 && got < 4) rc = -EBADMSG;
  if (rc < 0) {
    errbuf_set(0, err, errlen, "%s: truncated or unreadable IDX header (%zu of 4 bytes)%s%s", path,
               got, why ? ": " : "", why ? why : "");
    goto cleanup;
  }
  out->magic = be32(hdr);
  if (out->magic != want_magic) {
    rc = -EBADMSG;
    errbuf_set(0, err, errlen, "%s: bad IDX magic 0x%08x, expected 0x%08x (%s)", path, out->magic,
               want_magic,
               want_magic == IDX_MAGIC_IMAGES   ? "ubyte images, 3 dimensions"
               : want_magic == IDX_MAGIC_LABELS ? "ubyte labels, 1 dimension"
                                                : "ubyte");
    goto cleanup;
  }
  rc = gz_read_full(gz, path, hdr + 4, hdr_len - 4, &got, &why);
  if (rc == 0 && got < hdr_len - 4) rc = -EBADMSG;
  if (rc < 0) {
    errbuf_set(0, err, errlen, "%s: truncated IDX header (%zu of %zu bytes)%s%s", path, 4 + got,
               hdr_len, why ? ": " : "", why ? why : "");
    goto cleanup;
  }
  out->ndim = ndim;
  for (uint32_t k = 0; k < ndim; k++) out->dims[k] = be32(hdr + 4 + 4 * k);
  for (uint32_t k = 0; k < ndim; k++) {
    if (out->dims[k] == 0) {
      rc = -EBADMSG;
      errbuf_set(0, err, errlen, "%s: dimension %u is 0", path, k);
      goto cleanup;
    }
    /* Overflow is checked on every factor so a hostile header cannot wrap the
     * product back into a small, plausible size. */
    if (__builtin_mul_overflow(size, (size_t)out->dims[k], &size) || size > IDX_MAX_BYTES) {
      rc = -EFBIG;
      errbuf_set(0, err, errlen, "%s: absurd dimensions %u x %u x %u (limit %zu bytes)", path,
                 out->dims[0], out->dims[1], out->dims[2], (size_t)IDX_MAX_BYTES);
      goto cleanup;
    }
  }
  /* A raw file's size is known: refuse a truncated one before allocating. */
  if (gzdirect(gz) && stat(path, &st) == 0 && S_ISREG(st.st_mode) &&
      (uint64_t)st.st_size < hdr_len + size) {
    rc = -EBADMSG;
    errbuf_set(0, err, errlen, "%s: truncated: header announces %zu data bytes, file holds %llu",
               path, size, (unsigned long long)(st.st_size - (off_t)hdr_len));
    goto cleanup;
  }

  out->data = malloc(size);
  if (out->data == NULL) {
    rc = -ENOMEM;
    errbuf_set(0, err, errlen, "%s: cannot allocate %zu bytes", path, size);
    goto cleanup;
  }
  out->size = size;
  rc = gz_read_full(gz, path, out->data, size, &got, &why);
  if (rc == 0 && got < size) rc = -EBADMSG;
  if (rc < 0) {
    errbuf_set(0, err, errlen, "%s: %s: header announces %zu data bytes, read %zu%s%s", path,
               rc == -EBADMSG ? "truncated" : "read error", size, got, why ? ": " : "",
               why ? why : "");
    goto cleanup;
  }
  /* Trailing bytes mean the header does not describe the file: most likely the
   * wrong file or a corrupt header, so refuse rather than guess. */
  rc = gz_read_full(gz, path, &extra, 1, &got, &why);
  if (rc == 0 && got != 0) rc = -EBADMSG;
  if (rc < 0) {
    errbuf_set(0, err, errlen, "%s: %s after the %zu data bytes the header announces%s%s", path,
               got ? "trailing bytes" : "bad data", size, why ? ": " : "", why ? why : "");
    goto cleanup;
  }
  rc = 0;

cleanup:
  if (gz != NULL) gzclose(gz);
  if (rc < 0) idx_file_free(out);
  return rc;
}

void idx_file_free(struct idx_file *f) {
  if (f == NULL) return;
  free(f->data);
  memset(f, 0, sizeof(*f));
}

/* Picks <dir>/<split>-<kind>, or the same with ".gz" when the raw file is absent. */
static int dataset_path(const char *dir, const char *split, const char *kind, char *path,
                        size_t len, char *err, size_t errlen) {
  int n = snprintf(path, len, "%s/%s-%s", dir, split, kind);

  if (n < 0 || (size_t)n + 3 >= len) {
    errbuf_set(0, err, errlen, "%s/%s-%s: path too long", dir, split, kind);
    return -ENAMETOOLONG;
  }
  if (access(path, F_OK) == 0) return 0;
  strcat(path, ".gz");
  if (access(path, F_OK) == 0) return 0;
  path[n] = '\0';
  errbuf_set(0, err, errlen, "%s: no such file (nor %s.gz)", path, path);
  return -ENOENT;
}

int dataset_load(const char *dir, const char *split, struct dataset *out, char *err,
                 size_t errlen) {
  char ipath[PATH_MAX], lpath[PATH_MAX];
  struct idx_file img = {0}, lab = {0};
  int rc;

  memset(out, 0, sizeof(*out));
  rc = dataset_path(dir, split, "images-idx3-ubyte", ipath, sizeof(ipath), err, errlen);
  if (rc < 0) goto cleanup;
  rc = dataset_path(dir, split, "labels-idx1-ubyte", lpath, sizeof(lpath), err, errlen);
  if (rc < 0) goto cleanup;
  rc = idx_load_file(ipath, IDX_MAGIC_IMAGES, &img, err, errlen);
  if (rc < 0) goto cleanup;
  rc = idx_load_file(lpath, IDX_MAGIC_LABELS, &lab, err, errlen);
  if (rc < 0) goto cleanup;
  if (lab.dims[0] != img.dims[0]) {
    rc = -EBADMSG;
    errbuf_set(0, err, errlen, "%s holds %u labels but %s holds %u images", lpath, lab.dims[0],
               ipath, img.dims[0]);
    goto cleanup;
  }
  for (uint32_t i = 0; i < lab.dims[0]; i++) {
    if (lab.data[i] >= DATASET_NUM_CLASSES) {
      rc = -EBADMSG;
      errbuf_set(0, err, errlen, "%s: label %u at index %u is outside 0..%d", lpath, lab.data[i], i,
                 DATASET_NUM_CLASSES - 1);
      goto cleanup;
    }
  }

  out->n = img.dims[0];
  out->rows = img.dims[1];
  out->cols = img.dims[2];
  out->pixels = img.data; /* ownership moves to *out */
  img.data = NULL;
  out->labels = lab.data;
  lab.data = NULL;
  rc = 0;

cleanup:
  idx_file_free(&lab);
  idx_file_free(&img);
  if (rc < 0) dataset_free(out);
  return rc;
}

void dataset_free(struct dataset *ds) {
  if (ds == NULL) return;
  free(ds->pixels);
  free(ds->labels);
  memset(ds, 0, sizeof(*ds));
}

static uint64_t splitmix64_next(uint64_t *state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);

  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

void dataset_epoch_order(uint64_t seed, uint32_t epoch, uint32_t n, uint32_t *perm) {
  uint64_t state = seed ^ ((uint64_t)epoch * 0x9E3779B97F4A7C15ull);

  for (uint32_t i = 0; i < n; i++) perm[i] = i;
  for (uint32_t i = n > 0 ? n - 1 : 0; i > 0; i--) {
    uint32_t j = (uint32_t)(splitmix64_next(&state) % ((uint64_t)i + 1));
    uint32_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
}

uint32_t dataset_steps_per_epoch(uint32_t n, uint32_t batch, uint32_t world) {
  uint64_t global = (uint64_t)batch * world;

  return global == 0 ? 0 : (uint32_t)(n / global);
}

void dataset_gather(const struct dataset *ds, const uint32_t *idx, uint32_t count, float *x,
                    uint8_t *y) {
  size_t dim = (size_t)ds->rows * ds->cols;
  /* A true division (tm_unit_from_bytes), vectorised: Python's uint8 / 255.0
   * produces bit-identical inputs. */
  enum { AHEAD = 4 }; /* rows in flight: the samples are random rows of a large array */
  for (uint32_t k = 0; k < count; k++) {
    if (k + AHEAD < count) {
      const uint8_t *next = ds->pixels + (size_t)idx[k + AHEAD] * dim;
      for (size_t off = 0; off < dim; off += 64) __builtin_prefetch(next + off);
    }
    tm_unit_from_bytes(x + (size_t)k * dim, ds->pixels + (size_t)idx[k] * dim, dim);
    y[k] = ds->labels[idx[k]];
  }
}
