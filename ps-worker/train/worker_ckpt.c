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
#include "durable.h"
#include "failpoint.h"
#include "le.h"
#include "log.h"

#define MAGIC 0x4b575350u     /* "PSWK" */
#define END_MAGIC 0x5053574bu /* "KWSP" */
#define VERSION 1u            /* a data-parallel worker's */
#define VERSION_LAYOUT 2u     /* a 3D job rank's: with the layout block */
#define HEAD_BYTES 48u
#define LAYOUT_BYTES 32u

static void path_of(char *out, size_t len, const char *dir, uint32_t rank, uint64_t step,
                    const char *ext) {
  snprintf(out, len, "%s/worker-%04" PRIu32 "-step-%016" PRIu64 ".ckpt%s", dir, rank, step, ext);
}

static bool has_layout(const struct worker_ckpt_id *id) {
  return id->layout.t != 0;
}

/* Bytes before the per-tensor counts. */
static size_t head_bytes(const struct worker_ckpt_id *id) {
  return HEAD_BYTES + (has_layout(id) ? LAYOUT_BYTES : 0);
}

static bool has_velocity(const struct worker_ckpt_tensors *t) {
  return t->velocity && t->n > 0 && t->velocity[0];
}

/* The file's size for t (with or without velocity). */
static size_t file_bytes(const struct worker_ckpt_id *id, const struct worker_ckpt_tensors *t,
                         bool velocity) {
  size_t n = head_bytes(id) + 8u * (size_t)t->n + 8, floats = 0;
  for (int i = 0; i < t->n; i++) floats += t->count[i];
  return n + floats * sizeof(float) * (velocity ? 2 : 1);
}

void worker_ckpt_tensors_of_mlp(const struct mlp *m, float *const *velocity, float **param,
                                size_t *count, const char **name, struct worker_ckpt_tensors *t) {
  struct mlp *mm = (struct mlp *)m; /* mlp_param's pointers; read-only users never write them */
  t->n = mlp_num_tensors(m);
  for (int i = 0; i < t->n; i++) {
    param[i] = mlp_param(mm, i);
    count[i] = mlp_tensor_count(m, i);
    name[i] = mlp_tensor_name(m, i);
  }
  t->param = param;
  t->velocity = velocity;
  t->count = count;
  t->name = name;
}

/* "t=2 p=2 chunks=1 tp_rank=0 pp_rank=1 dp_rank=0 world=4", or the plain
 * worker's "data-parallel world=4". */
static void layout_str(char *buf, size_t len, bool layout, const struct worker_ckpt_layout *l,
                       uint32_t world) {
  if (!layout)
    snprintf(buf, len, "data-parallel (no --tensor-parallel/--pipeline-stages) world=%" PRIu32,
             world);
  else
    snprintf(buf, len,
             "t=%" PRIu32 " p=%" PRIu32 " chunks=%" PRIu32 " tp_rank=%" PRIu32 " pp_rank=%" PRIu32
             " dp_rank=%" PRIu32 " world=%" PRIu32,
             l->t, l->p, l->chunks, l->tp_rank, l->pp_rank, l->dp_rank, world);
}

/* The layout a file's first bytes say (got of them); false when they are
 * too short or not a checkpoint. */
static bool layout_of(const uint8_t *buf, size_t got, bool *layout, struct worker_ckpt_layout *l,
                      uint32_t *world) {
  if (got < HEAD_BYTES || le_get32(buf) != MAGIC) return false;
  *world = le_get32(buf + 12);
  *layout = le_get32(buf + 4) == VERSION_LAYOUT;
  memset(l, 0, sizeof(*l));
  if (!*layout) return le_get32(buf + 4) == VERSION;
  if (got < HEAD_BYTES + LAYOUT_BYTES) return false;
  const uint8_t *b = buf + HEAD_BYTES;
  *l = (struct worker_ckpt_layout){le_get32(b),      le_get32(b + 4),  le_get32(b + 8),
                                   le_get32(b + 12), le_get32(b + 16), le_get32(b + 20)};
  return true;
}

/* Whether a file's layout (layout_of) is id's. */
static bool same_layout(const struct worker_ckpt_id *id, bool layout,
                        const struct worker_ckpt_layout *l, uint32_t world) {
  return layout == has_layout(id) && world == id->world &&
         (!layout || memcmp(l, &id->layout, sizeof(*l)) == 0);
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

/* Reads and checks step's file whole; on success *out holds it. */
static int read_checked(const char *dir, const struct worker_ckpt_id *id, uint64_t step,
                        const struct worker_ckpt_tensors *t, bool velocity, uint8_t **out,
                        char *err, size_t errlen);

/* The series a save prunes: this rank's files by name, newest first. */
struct prune_arg {
  const char *dir;
  const struct worker_ckpt_id *id;
  const struct worker_ckpt_tensors *t;
  bool velocity;
  uint64_t *steps;
  size_t n;
};

static int prune_file(void *arg, size_t i, bool check, char *path, size_t len) {
  const struct prune_arg *pa = arg;
  path_of(path, len, pa->dir, pa->id->rank, pa->steps[i], "");
  if (!check) return DURABLE_INVALID;
  uint8_t *buf;
  char err[600];
  if (read_checked(pa->dir, pa->id, pa->steps[i], pa->t, pa->velocity, &buf, err, sizeof(err)) < 0)
    return DURABLE_INVALID;
  free(buf);
  return DURABLE_VALID;
}

/* durable_prune_fn: removes this rank's files older than the newest
 * WORKER_CKPT_KEEP valid ones (a file that does not load but is newer stays:
 * the scan names it). */
static void prune(void *arg) {
  struct prune_arg *pa = arg;
  pa->n = file_steps(pa->dir, pa->id->rank, &pa->steps);
  struct durable_series s = {
      .count = pa->n, .keep = WORKER_CKPT_KEEP, .file = prune_file, .arg = pa};
  durable_keep_newest(&s);
  free(pa->steps);
}

/* The file's bytes for step (see the header for the layout). */
static void encode(uint8_t *buf, const struct worker_ckpt_id *id, uint64_t step,
                   const struct worker_ckpt_tensors *t, bool vel) {
  int nt = t->n;
  le_put32(buf, MAGIC);
  le_put32(buf + 4, has_layout(id) ? VERSION_LAYOUT : VERSION);
  le_put32(buf + 8, id->rank);
  le_put32(buf + 12, id->world);
  le_put64(buf + 16, step);
  le_put64(buf + 24, id->seed);
  le_put32(buf + 32, id->batch);
  le_put32(buf + 36, (uint32_t)nt);
  le_put32(buf + 40, vel);
  le_put32(buf + 44, 0);
  size_t off = HEAD_BYTES;
  if (has_layout(id)) {
    const struct worker_ckpt_layout *l = &id->layout;
    uint32_t v[8] = {l->t, l->p, l->chunks, l->tp_rank, l->pp_rank, l->dp_rank, 0, 0};
    for (int i = 0; i < 8; i++, off += 4) le_put32(buf + off, v[i]);
  }
  for (int i = 0; i < nt; i++, off += 8) le_put64(buf + off, t->count[i]);
  for (int pass = 0; pass < (vel ? 2 : 1); pass++)
    for (int i = 0; i < nt; i++) {
      size_t n = t->count[i] * sizeof(float);
      memcpy(buf + off, pass ? t->velocity[i] : t->param[i], n); /* little-endian floats */
      off += n;
    }
  le_put32(buf + off, crc32c_update(0, buf, off));
  le_put32(buf + off + 4, END_MAGIC);
}

int worker_ckpt_save_tensors(struct ckpt_io *io, const char *dir, const struct worker_ckpt_id *id,
                             uint64_t step, const struct worker_ckpt_tensors *t, char *err,
                             size_t errlen) {
  bool vel = has_velocity(t);
  size_t bytes = file_bytes(id, t, vel);
  uint8_t *buf = malloc(bytes);
  if (!buf) {
    snprintf(err, errlen, "out of memory for a %zu-byte checkpoint", bytes);
    return -ENOMEM;
  }
  encode(buf, id, step, t, vel);
  char tmp[4200], final[4200];
  path_of(tmp, sizeof(tmp), dir, id->rank, step, ".tmp");
  path_of(final, sizeof(final), dir, id->rank, step, "");
  struct durable d;
  int r = durable_open(&d, io, dir, tmp, final, "wckpt", err, errlen);
  if (r < 0) goto out;
  durable_write(&d, buf, bytes / 2);
  FAILPOINT("wckpt-half");
  durable_write(&d, buf + bytes / 2, bytes - bytes / 2);
  struct prune_arg pa = {.dir = dir, .id = id, .t = t, .velocity = vel};
  r = durable_commit(&d, prune, &pa, err, errlen);
out:
  free(buf);
  return r;
}

int worker_ckpt_save(struct ckpt_io *io, const char *dir, const struct worker_ckpt_id *id,
                     uint64_t step, struct mlp *m, float *const *velocity, char *err,
                     size_t errlen) {
  float *param[2 * MLP_MAX_SIZES];
  size_t count[2 * MLP_MAX_SIZES];
  const char *name[2 * MLP_MAX_SIZES];
  struct worker_ckpt_tensors t;
  worker_ckpt_tensors_of_mlp(m, velocity, param, count, name, &t);
  return worker_ckpt_save_tensors(io, dir, id, step, &t, err, errlen);
}

/* Reads and checks step's file whole; on success *out holds it. */
static int read_checked(const char *dir, const struct worker_ckpt_id *id, uint64_t step,
                        const struct worker_ckpt_tensors *t, bool velocity, uint8_t **out,
                        char *err, size_t errlen) {
  char path[4200];
  path_of(path, sizeof(path), dir, id->rank, step, "");
  *out = NULL;
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(err, errlen, "%s: %s", path, strerror(errno));
    return -errno;
  }
  size_t want = file_bytes(id, t, velocity);
  uint8_t *buf = malloc(want + 1);
  size_t got = buf ? fread(buf, 1, want + 1, f) : 0;
  fclose(f);
  const char *why = NULL;
  char detail[400] = "", mine[160], theirs[160];
  bool layout;
  struct worker_ckpt_layout l;
  uint32_t world;
  if (!buf)
    why = "out of memory";
  else if (got < HEAD_BYTES || le_get32(buf) != MAGIC)
    why = "not a ps-worker checkpoint (magic)";
  else if (le_get32(buf + 4) != VERSION && le_get32(buf + 4) != VERSION_LAYOUT)
    snprintf(detail, sizeof(detail), "format version %" PRIu32 ", this ps-worker reads %u and %u",
             le_get32(buf + 4), VERSION, VERSION_LAYOUT);
  else if (!layout_of(buf, got, &layout, &l, &world))
    why = "truncated in its header";
  else if (!same_layout(id, layout, &l, world)) {
    layout_str(theirs, sizeof(theirs), layout, &l, world);
    layout_str(mine, sizeof(mine), has_layout(id), &id->layout, id->world);
    snprintf(detail, sizeof(detail), "written by layout %s, this run is %s", theirs, mine);
  } else if (got != want)
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
  else if (le_get32(buf + 36) != (uint32_t)t->n || le_get32(buf + 40) != velocity)
    why = "another model or optimizer (tensors or momentum state)";
  size_t counts = head_bytes(id);
  for (int i = 0; !why && !detail[0] && i < t->n; i++)
    if (le_get64(buf + counts + 8u * (size_t)i) != t->count[i])
      snprintf(detail, sizeof(detail), "tensor %s has %" PRIu64 " elements here %zu", t->name[i],
               le_get64(buf + counts + 8u * (size_t)i), t->count[i]);
  if (why || detail[0]) {
    snprintf(err, errlen, "%s: %s", path, why ? why : detail);
    free(buf);
    return -EINVAL;
  }
  *out = buf;
  return 0;
}

void worker_ckpt_scan(const char *dir, const struct worker_ckpt_id *id, const struct mlp *m,
                      bool velocity, struct worker_ckpt_scan *out) {
  float *param[2 * MLP_MAX_SIZES], *vel[1];
  size_t count[2 * MLP_MAX_SIZES];
  const char *name[2 * MLP_MAX_SIZES];
  struct worker_ckpt_tensors t;
  worker_ckpt_tensors_of_mlp(m, NULL, param, count, name, &t);
  vel[0] = velocity ? param[0] : NULL; /* only whether there is one is read */
  t.velocity = vel;
  worker_ckpt_scan_tensors(dir, id, &t, out);
}

void worker_ckpt_scan_tensors(const char *dir, const struct worker_ckpt_id *id,
                              const struct worker_ckpt_tensors *t, struct worker_ckpt_scan *out) {
  bool velocity = has_velocity(t);
  memset(out, 0, sizeof(*out));
  uint64_t *all;
  size_t n = file_steps(dir, id->rank, &all);
  out->files = (int)n;
  out->newest_file = n ? all[0] : 0;
  for (size_t i = 0; i < n && out->n < WORKER_CKPT_SCAN_MAX; i++) {
    uint8_t *buf;
    char err[600];
    if (read_checked(dir, id, all[i], t, velocity, &buf, err, sizeof(err)) < 0) {
      log_warn("a checkpoint does not load: skipped",
               "rank=%" PRIu32 " step=%" PRIu64 " error=\"%s\"", id->rank, all[i], err);
      if (out->skipped++ == 0) {
        out->skip_step = all[i];
        snprintf(out->skip_why, sizeof(out->skip_why), "%.470s", err);
      }
      continue;
    }
    free(buf);
    out->steps[out->n++] = all[i];
  }
  free(all);
}

void worker_ckpt_set_aside_after(const char *dir, uint32_t rank, uint64_t step) {
  uint64_t *all;
  size_t n = file_steps(dir, rank, &all);
  for (size_t i = 0; i < n && all[i] > step; i++) {
    char from[4200], to[4200];
    path_of(from, sizeof(from), dir, rank, all[i], "");
    path_of(to, sizeof(to), dir, rank, all[i], ".stale");
    if (rename(from, to) == 0)
      log_warn("set aside a checkpoint newer than the step the ring goes on from",
               "rank=%" PRIu32 " step=%" PRIu64 " path=%s resume_step=%" PRIu64, rank, all[i], to,
               step);
    else
      log_warn("cannot set aside a checkpoint newer than the step the ring goes on from",
               "rank=%" PRIu32 " path=%s error=\"%s\"", rank, from, strerror(errno));
  }
  free(all);
}

/* mkdir -p path (mode 0755); *created says whether any was made. */
static int mkdir_p(const char *dir, bool *created, char *err, size_t errlen) {
  char p[4096];
  if (snprintf(p, sizeof(p), "%s", dir) >= (int)sizeof(p)) {
    snprintf(err, errlen, "cannot create %.200s...: path too long", dir);
    return -ENAMETOOLONG;
  }
  *created = false;
  for (char *c = p + 1;; c++) {
    if (*c != '/' && *c != '\0') continue;
    char was = *c;
    *c = '\0';
    if (mkdir(p, 0755) == 0) {
      *created = true;
    } else if (errno != EEXIST) {
      int e = errno;
      snprintf(err, errlen, "cannot create directory %s: %s (errno %d)", p, strerror(e), e);
      return -e;
    }
    *c = was;
    if (!was) break;
  }
  struct stat st;
  int e = stat(p, &st) != 0 ? errno : S_ISDIR(st.st_mode) ? 0 : ENOTDIR;
  if (e) {
    snprintf(err, errlen, "cannot use %s as the checkpoint directory: %s (errno %d)", p,
             strerror(e), e);
    return -e;
  }
  return 0;
}

int worker_ckpt_prepare(const char *dir, uint32_t rank, char *err, size_t errlen) {
  bool created;
  int r = mkdir_p(dir, &created, err, errlen);
  if (r < 0) return r;
  /* writable? The same operations a checkpoint does, on a probe file. */
  char probe[4200];
  snprintf(probe, sizeof(probe), "%s/.worker-%04" PRIu32 "-probe-%ld.tmp", dir, rank,
           (long)getpid());
  const char *what = "create";
  int fd = open(probe, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) r = -errno;
  if (!r) {
    ssize_t w = write(fd, "ps", 2);
    what = "write";
    if (w != 2) r = w < 0 ? -errno : -EIO;
  }
  if (!r) {
    what = "fsync";
    if (fsync(fd) != 0) r = -errno;
  }
  if (fd >= 0) {
    close(fd);
    if (unlink(probe) != 0 && !r) {
      what = "remove";
      r = -errno;
    }
  }
  if (r < 0) {
    snprintf(err, errlen, "cannot %s %s (the directory must be writable): %s (errno %d)", what,
             probe, strerror(-r), -r);
    return r;
  }
  if (created) log_info("created the checkpoint directory", "rank=%" PRIu32 " dir=%s", rank, dir);
  /* a crash mid-write leaves a .tmp: never loaded (the name), removed here */
  DIR *d = opendir(dir);
  char prefix[32];
  snprintf(prefix, sizeof(prefix), "worker-%04" PRIu32 "-step-", rank);
  struct dirent *e;
  while (d && (e = readdir(d))) {
    size_t nl = strlen(e->d_name);
    if (strncmp(e->d_name, prefix, strlen(prefix)) != 0 || nl < 9 ||
        strcmp(e->d_name + nl - 9, ".ckpt.tmp") != 0)
      continue;
    char p[4400];
    snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
    if (unlink(p) == 0)
      log_warn("removed an unfinished checkpoint", "rank=%" PRIu32 " path=%s", rank, p);
    else
      log_warn("cannot remove an unfinished checkpoint", "rank=%" PRIu32 " path=%s error=\"%s\"",
               rank, p, strerror(errno));
  }
  if (d) closedir(d);
  return 0;
}

int worker_ckpt_load_tensors(const char *dir, const struct worker_ckpt_id *id, uint64_t step,
                             const struct worker_ckpt_tensors *t, char *err, size_t errlen) {
  bool vel = has_velocity(t);
  uint8_t *buf;
  int r = read_checked(dir, id, step, t, vel, &buf, err, errlen);
  if (r < 0) return r;
  size_t off = head_bytes(id) + 8u * (size_t)t->n;
  for (int pass = 0; pass < (vel ? 2 : 1); pass++)
    for (int i = 0; i < t->n; i++) {
      size_t n = t->count[i] * sizeof(float);
      memcpy(pass ? t->velocity[i] : t->param[i], buf + off, n);
      off += n;
    }
  free(buf);
  return 0;
}

int worker_ckpt_load(const char *dir, const struct worker_ckpt_id *id, uint64_t step, struct mlp *m,
                     float *const *velocity, char *err, size_t errlen) {
  float *param[2 * MLP_MAX_SIZES];
  size_t count[2 * MLP_MAX_SIZES];
  const char *name[2 * MLP_MAX_SIZES];
  struct worker_ckpt_tensors t;
  worker_ckpt_tensors_of_mlp(m, velocity, param, count, name, &t);
  return worker_ckpt_load_tensors(dir, id, step, &t, err, errlen);
}

int worker_ckpt_check_layout(const char *dir, const struct worker_ckpt_id *id, char *err,
                             size_t errlen) {
  uint64_t *all;
  size_t n = file_steps(dir, id->rank, &all);
  int r = 0;
  for (size_t i = 0; i < n && r == 0; i++) {
    char path[4200];
    path_of(path, sizeof(path), dir, id->rank, all[i], "");
    uint8_t head[HEAD_BYTES + LAYOUT_BYTES];
    FILE *f = fopen(path, "rb");
    size_t got = f ? fread(head, 1, sizeof(head), f) : 0;
    if (f) fclose(f);
    bool layout;
    struct worker_ckpt_layout l;
    uint32_t world;
    if (!layout_of(head, got, &layout, &l, &world) || same_layout(id, layout, &l, world))
      continue; /* unreadable ones: the scan names them */
    char mine[160], theirs[160];
    layout_str(theirs, sizeof(theirs), layout, &l, world);
    layout_str(mine, sizeof(mine), has_layout(id), &id->layout, id->world);
    snprintf(err, errlen,
             "%s was written by layout %s, this run is %s: restart with the layout that wrote "
             "it, or use another directory",
             path, theirs, mine);
    r = -EINVAL;
  }
  free(all);
  return r;
}
