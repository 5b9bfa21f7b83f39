/* ckpt_dir: names, listing, ownership and pruning of a shard's checkpoint
 * files (see ckpt_dir.h). Ownership is read from each file's header and
 * JOB record (ckpt_peek: two small preads), never from the whole file, so
 * pruning after every write costs a few hundred bytes per file. Nothing here
 * deletes a file that is not this job's. */
#include "ckpt_dir.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "crc32c.h"
#include "durable.h"
#include "log.h"

static bool job_named(const char *job) {
  return job && job[0];
}

int ckpt_job_id_check(const char *value, char *err, size_t errlen) {
  size_t n = strlen(value);
  if (n > CKPT_JOB_MAX) {
    snprintf(err, errlen, "longer than %u bytes", CKPT_JOB_MAX);
    return -EINVAL;
  }
  for (size_t i = 0; i < n; i++) {
    unsigned char c = (unsigned char)value[i];
    if (c < 0x20 || c > 0x7e) {
      snprintf(err, errlen, "byte %zu is not printable ASCII (0x%02x)", i, c);
      return -EINVAL;
    }
  }
  return 0;
}

/* Whether path is a directory this process may create files in. */
static int writable_dir(const char *path, char *err, size_t errlen) {
  struct stat st;
  if (stat(path, &st) != 0) {
    int e = -errno;
    snprintf(err, errlen, "%s: %s", path, strerror(-e));
    return e;
  }
  if (!S_ISDIR(st.st_mode)) {
    snprintf(err, errlen, "%s is not a directory", path);
    return -ENOTDIR;
  }
  if (access(path, W_OK | X_OK) != 0) {
    int e = -errno;
    snprintf(err, errlen, "%s is not writable: %s", path, strerror(-e));
    return e;
  }
  return 0;
}

int ckpt_dir_check(const char *value, char *err, size_t errlen) {
  if (!value[0]) return 0;
  char p[1100];
  if (strlen(value) >= sizeof(p)) {
    snprintf(err, errlen, "path too long");
    return -EINVAL;
  }
  snprintf(p, sizeof(p), "%s", value);
  /* the nearest existing ancestor decides whether the rest can be made */
  for (;;) {
    struct stat st;
    if (stat(p, &st) == 0 || errno != ENOENT) break;
    char *slash = strrchr(p, '/');
    while (slash && slash > p && slash[1] == 0) { /* trailing slashes */
      *slash = 0;
      slash = strrchr(p, '/');
    }
    if (!slash) {
      snprintf(p, sizeof(p), ".");
      break;
    }
    if (slash == p) {
      p[1] = 0; /* "/" */
      break;
    }
    *slash = 0;
  }
  char why[1200];
  if (writable_dir(p, why, sizeof(why)) < 0) {
    if (strcmp(p, value) == 0)
      snprintf(err, errlen, "%s", why);
    else
      snprintf(err, errlen, "cannot be created: %s", why);
    return -EINVAL;
  }
  return 0;
}

int ckpt_dir_create(const char *dir, char *err, size_t errlen) {
  char p[1100];
  snprintf(p, sizeof(p), "%s", dir);
  for (char *s = p + 1; *s; s++) {
    if (*s != '/') continue;
    *s = 0;
    if (mkdir(p, 0755) != 0 && errno != EEXIST) {
      int e = -errno;
      snprintf(err, errlen, "mkdir %s: %s", p, strerror(-e));
      return e;
    }
    *s = '/';
  }
  if (mkdir(p, 0755) != 0 && errno != EEXIST) {
    int e = -errno;
    snprintf(err, errlen, "mkdir %s: %s", p, strerror(-e));
    return e;
  }
  return writable_dir(p, err, errlen);
}

static uint32_t job_hash(const char *job) {
  return crc32c_update(0, job, strlen(job));
}

void ckpt_file_name(char *buf, size_t len, const char *dir, uint32_t shard, const char *job,
                    uint64_t clock, bool tmp) {
  char suffix[16] = "";
  if (job_named(job)) snprintf(suffix, sizeof(suffix), "-j%08" PRIx32, job_hash(job));
  snprintf(buf, len, "%s/%sshard-%04" PRIu32 "-v%020" PRIu64 "%s.ckpt%s", dir, tmp ? "." : "",
           shard, clock, suffix, tmp ? ".tmp" : "");
}

int ckpt_dir_list(const char *dir, uint32_t shard, const char *job, struct ckpt_file **out,
                  size_t *n_out) {
  *out = NULL;
  *n_out = 0;
  DIR *d = opendir(dir);
  if (!d) return -errno;
  struct ckpt_file *v = NULL;
  size_t n = 0, cap = 0;
  char prefix[32], mine[16] = ".ckpt";
  snprintf(prefix, sizeof(prefix), "shard-%04" PRIu32 "-v", shard);
  if (job_named(job)) snprintf(mine, sizeof(mine), "-j%08" PRIx32 ".ckpt", job_hash(job));
  size_t pl = strlen(prefix);
  struct dirent *e;
  while ((e = readdir(d))) {
    if (strncmp(e->d_name, prefix, pl) != 0) continue;
    const char *p = e->d_name + pl;
    char *end;
    errno = 0;
    unsigned long long c = strtoull(p, &end, 10);
    if (errno || end != p + 20) continue;
    bool plain = strcmp(end, ".ckpt") == 0;
    bool hashed = strlen(end) == 15 && strncmp(end, "-j", 2) == 0 && strcmp(end + 10, ".ckpt") == 0;
    if (!plain && !hashed) continue;
    if (n == cap) {
      cap = cap ? cap * 2 : 8;
      struct ckpt_file *nv = realloc(v, cap * sizeof(*nv));
      if (!nv) {
        free(v);
        closedir(d);
        return -ENOMEM;
      }
      v = nv;
    }
    v[n].clock = c;
    snprintf(v[n].path, sizeof(v[n].path), "%s/%s", dir, e->d_name);
    v[n].name_mine = strcmp(end, mine) == 0;
    n++;
  }
  closedir(d);
  for (size_t i = 1; i < n; i++) /* insertion sort, descending: few files */
    for (size_t j = i; j > 0 && v[j - 1].clock < v[j].clock; j--) {
      struct ckpt_file t = v[j];
      v[j] = v[j - 1];
      v[j - 1] = t;
    }
  *out = v;
  *n_out = n;
  return 0;
}

/* 1 mine, 0 another job's; *readable says whether the header read back. */
static int owner(const struct ckpt_file *f, const char *job, uint64_t layout_hash, bool *readable) {
  struct ckpt_info info;
  char why[300];
  *readable = ckpt_peek(f->path, &info, why, sizeof(why)) == 0;
  if (!*readable) return f->name_mine;
  if (strcmp(info.job, job ? job : "") != 0) return 0;
  return layout_hash == 0 || info.layout_hash == layout_hash;
}

bool ckpt_file_mine(const struct ckpt_file *f, const char *job, uint64_t layout_hash) {
  bool readable;
  return owner(f, job, layout_hash, &readable) == 1;
}

/* The series ckpt_prune hands durable_keep_newest: this job's files older
 * than the one just written; another job's are OTHER, an unreadable one of
 * this job INVALID (deleted: the fallback must load). */
struct prune_series {
  const struct ckpt_file *v;
  const char *job;
  uint64_t layout_hash;
};

static int prune_file(void *arg, size_t i, bool check, char *path, size_t len) {
  const struct prune_series *ps = arg;
  bool readable;
  (void)check; /* the header read tells ownership and readability at once */
  snprintf(path, len, "%s", ps->v[i].path);
  if (owner(&ps->v[i], ps->job, ps->layout_hash, &readable) != 1) return DURABLE_OTHER;
  return readable ? DURABLE_VALID : DURABLE_INVALID;
}

void ckpt_prune(const char *dir, uint32_t shard, const char *job, uint64_t layout_hash,
                uint64_t clock) {
  struct ckpt_file *v;
  size_t n, older = 0;
  if (ckpt_dir_list(dir, shard, job, &v, &n) < 0) return;
  while (older < n && v[older].clock >= clock) older++; /* newest first */
  struct prune_series ps = {.v = v + older, .job = job, .layout_hash = layout_hash};
  struct durable_series s = {
      .count = n - older, .keep = 1, .drop_invalid = true, .file = prune_file, .arg = &ps};
  durable_keep_newest(&s);
  free(v);
}

void ckpt_remove_after(const char *dir, uint32_t shard, const char *job, uint64_t clock) {
  struct ckpt_file *v;
  size_t n;
  if (ckpt_dir_list(dir, shard, job, &v, &n) < 0) return;
  for (size_t i = 0; i < n; i++) {
    if (v[i].clock <= clock || !ckpt_file_mine(&v[i], job, 0)) continue;
    log_warn("removing a checkpoint of the abandoned timeline", "path=%s", v[i].path);
    unlink(v[i].path);
  }
  free(v);
}

void ckpt_remove_temps(const char *dir, uint32_t shard, const char *job) {
  DIR *d = opendir(dir);
  if (!d) return;
  char prefix[32], suffix[32] = ".ckpt.tmp";
  snprintf(prefix, sizeof(prefix), ".shard-%04" PRIu32 "-v", shard);
  if (job_named(job)) snprintf(suffix, sizeof(suffix), "-j%08" PRIx32 ".ckpt.tmp", job_hash(job));
  size_t pl = strlen(prefix), sl = strlen(suffix);
  struct dirent *e;
  while ((e = readdir(d))) {
    size_t nl = strlen(e->d_name);
    /* prefix, 20 digits, this job's suffix */
    if (nl != pl + 20 + sl || strncmp(e->d_name, prefix, pl) != 0 ||
        strcmp(e->d_name + pl + 20, suffix) != 0)
      continue;
    char p[1400];
    snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
    log_warn("removing an unfinished checkpoint", "path=%s", p);
    unlink(p);
  }
  closedir(d);
}

size_t ckpt_report_foreign(const char *dir, uint32_t shard, const char *job) {
  struct ckpt_file *v;
  size_t n, found = 0;
  if (ckpt_dir_list(dir, shard, job, &v, &n) < 0) return 0;
  char list[1500] = "";
  size_t used = 0, shown = 0;
  for (size_t i = 0; i < n; i++) {
    struct ckpt_info info;
    char why[300];
    bool readable = ckpt_peek(v[i].path, &info, why, sizeof(why)) == 0;
    if (readable ? strcmp(info.job, job ? job : "") == 0 : v[i].name_mine) continue;
    found++;
    const char *base = strrchr(v[i].path, '/');
    base = base ? base + 1 : v[i].path;
    char one[1500];
    if (!readable)
      snprintf(one, sizeof(one), "%s (job unknown: %s)", base, why);
    else if (info.format_version == 1)
      snprintf(one, sizeof(one), "%s (format 1: the unnamed job)", base);
    else
      snprintf(one, sizeof(one), "%s (job \"%s\")", base, info.job);
    if (used + strlen(one) + 3 >= sizeof(list)) continue;
    used += (size_t)snprintf(list + used, sizeof(list) - used, "%s%s", used ? ", " : "", one);
    shown++;
  }
  free(v);
  if (found)
    log_warn("checkpoints of another job in --checkpoint-dir: never loaded, never deleted",
             "dir=%s job=\"%s\" files=%zu list=\"%s%s\"", dir, job ? job : "", found, list,
             shown < found ? ", ..." : "");
  return found;
}
