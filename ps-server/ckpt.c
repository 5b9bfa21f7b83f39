/* ckpt: snapshot, write (commit protocol) and load of a shard's checkpoints;
 * the format is in ckpt.h. Writing streams the file once: small fields go
 * through a 1 MiB buffer, parameter and state arrays are written straight
 * from the snapshot, and the record and whole-file CRC32Cs are computed as
 * the bytes go out. Reading maps the file and checks the header CRC, the
 * footer (magic, length, whole-file CRC), then every record's CRC and bounds,
 * before anything is applied; so a file truncated anywhere, or with any bit
 * flipped, is refused. The commit itself (temp, fsync, rename, directory
 * fsync, prune) is common/durable.c's, with its failpoints ckpt-open,
 * -written, -fsync, -rename, -dirsync, -pruned; the FAILPOINT()s here stop
 * a write mid-body (ckpt-header, ckpt-records) for the crash tests
 * (failpoint.h; nothing in production builds). */
#include "ckpt.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt_dir.h"
#include "clock.h"
#include "crc32c.h"
#include "durable.h"
#include "failpoint.h"
#include "le.h"
#include "log.h"

static const char header_magic[8] = {'P', 'S', 'C', 'K', 'P', 'T', '0', '1'};
static const char footer_magic[8] = {'P', 'S', 'C', 'K', 'E', 'N', 'D', '1'};

enum { REC_LAYOUT = 1, REC_KEY = 2, REC_JOB = 3 };
#define REC_HAS_STATE 1u  /* KEY: the optimizer state is present */
#define REC_HAS_OWNERS 2u /* LAYOUT: the owners follow the tensors */

/* ---- snapshots (loop thread) ------------------------------------------- */

struct ckpt_snapshot *ckpt_snapshot_new(const struct store *s, uint64_t clock) {
  struct ckpt_snapshot *snap = calloc(1, sizeof(*snap));
  if (!snap) return NULL;
  snprintf(snap->job, sizeof(snap->job), "%s", s->opts.job_id ? s->opts.job_id : "");
  snap->shard = s->opts.shard;
  snap->num_shards = s->opts.num_shards;
  snap->num_workers = s->opts.num_workers;
  snap->clock = clock;
  snap->opt_kind = (uint32_t)s->opts.opt.kind;
  snap->consistency = (uint32_t)s->opts.consistency;
  snap->staleness = s->opts.staleness;
  snap->state_floats = (uint32_t)store_state_floats(s);
  snap->num_keys = s->num_keys;
  snap->keys = calloc(s->num_keys ? s->num_keys : 1, sizeof(*snap->keys));
  if (!snap->keys || store_layout_copy(&snap->layout, &s->layout) < 0) {
    ckpt_snapshot_free(snap);
    return NULL;
  }
  return snap;
}

int ckpt_snapshot_add(struct ckpt_snapshot *snap, const struct store *s, size_t i) {
  const struct store_key *k = &s->keys[i];
  struct ckpt_key_snap *ks = &snap->keys[i];
  if (ks->params || !k->params) return 0;
  ks->next_step = malloc(s->opts.num_workers * sizeof(uint64_t));
  if (!ks->next_step) return -ENOMEM;
  if (k->opt_state && snap->state_floats) {
    size_t n = snap->state_floats * k->count * sizeof(float);
    if (!(ks->opt_state = malloc(n))) {
      free(ks->next_step);
      ks->next_step = NULL;
      return -ENOMEM;
    }
    memcpy(ks->opt_state, k->opt_state, n);
  }
  for (uint32_t r = 0; r < s->opts.num_workers; r++) {
    uint64_t c = k->next_step[r];
    if (s->opts.consistency == STORE_BSP && c > k->version) c = k->version;
    ks->next_step[r] = c;
  }
  ks->key = k->key;
  ks->count = k->count;
  ks->version = k->version;
  ks->params = vbuf_ref(k->params);
  snap->filled++;
  return 0;
}

struct ckpt_snapshot *ckpt_snapshot_take(const struct store *s) {
  uint64_t clock = UINT64_MAX;
  for (size_t i = 0; i < s->num_keys; i++)
    if (s->keys[i].params && s->keys[i].version < clock) clock = s->keys[i].version;
  if (clock == UINT64_MAX) clock = 0;
  struct ckpt_snapshot *snap = ckpt_snapshot_new(s, clock);
  if (!snap) return NULL;
  for (size_t i = 0; i < s->num_keys; i++) {
    if (ckpt_snapshot_add(snap, s, i) < 0) {
      ckpt_snapshot_free(snap);
      return NULL;
    }
  }
  /* Keys never initialised are not saved: move the captured ones together
   * (in order), since any of them may be missing, not only the last ones. */
  size_t m = 0;
  for (size_t i = 0; i < snap->num_keys; i++)
    if (snap->keys[i].params) snap->keys[m++] = snap->keys[i];
  snap->num_keys = m;
  return snap;
}

void ckpt_snapshot_free(struct ckpt_snapshot *snap) {
  if (!snap) return;
  for (size_t i = 0; snap->keys && i < snap->num_keys; i++) {
    vbuf_unref(snap->keys[i].params);
    free(snap->keys[i].opt_state);
    free(snap->keys[i].next_step);
  }
  free(snap->keys);
  store_layout_free(&snap->layout);
  free(snap);
}

/* ---- writing ------------------------------------------------------------- */

#define WBUF_BYTES (1u << 20)

struct writer {
  struct durable *d;
  uint64_t off;      /* file offset of buf[0] */
  uint32_t file_crc; /* of everything put so far */
  uint32_t rec_crc;  /* of the current record so far */
  size_t len;
  uint8_t *buf;
  int err;
};

static void w_flush(struct writer *w) {
  if (w->err || w->len == 0) return;
  w->err = durable_write(w->d, w->buf, w->len);
  w->off += w->len;
  w->len = 0;
}

static void w_put(struct writer *w, const void *p, size_t n) {
  if (w->err) return;
  w->file_crc = crc32c_update(w->file_crc, p, n);
  w->rec_crc = crc32c_update(w->rec_crc, p, n);
  if (n >= WBUF_BYTES / 2) { /* large arrays go out straight from the snapshot */
    w_flush(w);
    if (w->err) return;
    w->err = durable_write(w->d, p, n);
    w->off += n;
    return;
  }
  if (w->len + n > WBUF_BYTES) w_flush(w);
  memcpy(w->buf + w->len, p, n);
  w->len += n;
}

static void w_zeros(struct writer *w, size_t n) {
  static const uint8_t zero[4096];
  while (n > 0) {
    size_t c = n < sizeof(zero) ? n : sizeof(zero);
    w_put(w, zero, c);
    n -= c;
  }
}

static void w_record_begin(struct writer *w, uint32_t type, uint32_t flags, uint64_t key,
                           uint64_t count, uint64_t version, uint64_t payload) {
  uint8_t h[CKPT_RECORD_HEADER_BYTES];
  le_put32(h, type);
  le_put32(h + 4, flags);
  le_put64(h + 8, key);
  le_put64(h + 16, count);
  le_put64(h + 24, version);
  le_put64(h + 32, payload);
  w->rec_crc = 0;
  w_put(w, h, sizeof(h));
}

static void w_record_end(struct writer *w) {
  uint8_t c[4];
  le_put32(c, w->rec_crc);
  w_put(w, c, 4);
}

/* Whether some tensor of l names its owners (the LAYOUT record then says
 * them; without, it is byte for byte the record of older versions). */
static bool layout_has_owners(const struct store_layout *l) {
  for (uint32_t i = 0; l->num_owners && i < l->num_tensors; i++)
    if (l->num_owners[i]) return true;
  return false;
}

static uint64_t layout_payload_bytes(const struct store_layout *l) {
  uint64_t n = 16;
  for (uint32_t i = 0; i < l->num_tensors; i++) n += 12 + strlen(l->names[i]);
  if (layout_has_owners(l))
    for (uint32_t i = 0; i < l->num_tensors; i++) n += 4 + 4ull * l->num_owners[i];
  return n;
}

static void write_body(struct writer *w, const struct ckpt_snapshot *snap) {
  uint8_t h[CKPT_HEADER_BYTES] = {0};
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  memcpy(h, header_magic, 8);
  le_put32(h + 8, CKPT_FORMAT_VERSION);
  le_put32(h + 12, snap->shard);
  le_put32(h + 16, snap->num_shards);
  le_put32(h + 20, snap->num_workers);
  le_put64(h + 24, snap->layout.hash);
  le_put64(h + 32, snap->clock);
  le_put32(h + 40, (uint32_t)(2 + snap->num_keys));
  le_put32(h + 44, snap->opt_kind);
  le_put32(h + 48, snap->consistency);
  le_put32(h + 52, snap->staleness);
  le_put32(h + 56, (uint32_t)ts.tv_sec);
  le_put32(h + 60, crc32c_update(0, h, 60));
  w_put(w, h, sizeof(h));
  FAILPOINT("ckpt-header");

  size_t jl = strlen(snap->job);
  w_record_begin(w, REC_JOB, 0, 0, jl, 0, jl);
  w_put(w, snap->job, jl);
  w_record_end(w);

  const struct store_layout *l = &snap->layout;
  bool owners = layout_has_owners(l);
  w_record_begin(w, REC_LAYOUT, owners ? REC_HAS_OWNERS : 0, 0, l->num_tensors, 0,
                 layout_payload_bytes(l));
  uint8_t b[16];
  le_put64(b, l->chunk_bytes);
  le_put32(b + 8, l->num_shards);
  le_put32(b + 12, l->num_tensors);
  w_put(w, b, 16);
  for (uint32_t i = 0; i < l->num_tensors; i++) {
    uint32_t nl = (uint32_t)strlen(l->names[i]);
    le_put64(b, l->counts[i]);
    le_put32(b + 8, nl);
    w_put(w, b, 12);
    w_put(w, l->names[i], nl);
  }
  for (uint32_t i = 0; owners && i < l->num_tensors; i++) {
    le_put32(b, l->num_owners[i]);
    w_put(w, b, 4);
    for (uint32_t j = 0; j < l->num_owners[i]; j++) {
      le_put32(b, l->owners[i][j]);
      w_put(w, b, 4);
    }
  }
  w_record_end(w);

  for (size_t i = 0; i < snap->num_keys; i++) {
    const struct ckpt_key_snap *k = &snap->keys[i];
    uint64_t state_bytes = (uint64_t)snap->state_floats * k->count * sizeof(float);
    uint64_t payload = k->count * sizeof(float) + state_bytes + snap->num_workers * 8ull;
    w_record_begin(w, REC_KEY, k->opt_state ? REC_HAS_STATE : 0, k->key, k->count, k->version,
                   payload);
    w_put(w, k->params->data, k->count * sizeof(float));
    if (k->opt_state)
      w_put(w, k->opt_state, state_bytes);
    else
      w_zeros(w, state_bytes);
    for (uint32_t r = 0; r < snap->num_workers; r++) {
      le_put64(b, k->next_step[r]);
      w_put(w, b, 8);
    }
    w_record_end(w);
    if (i == snap->num_keys / 2) FAILPOINT("ckpt-records");
  }
  uint8_t f[CKPT_FOOTER_BYTES];
  memcpy(f, footer_magic, 8);
  uint64_t total = w->off + w->len + CKPT_FOOTER_BYTES;
  le_put64(f + 8, total);
  le_put32(f + 16, w->file_crc);
  le_put32(f + 20, (uint32_t)(2 + snap->num_keys));
  w_put(w, f, sizeof(f));
  w_flush(w);
}

struct prune_arg {
  const char *dir;
  const struct ckpt_snapshot *snap;
};

/* durable_prune_fn: this one and, of this job's older ones, the newest as a
 * fallback (ckpt_prune). */
static void prune(void *arg) {
  const struct prune_arg *pa = arg;
  ckpt_prune(pa->dir, pa->snap->shard, pa->snap->job, pa->snap->layout.hash, pa->snap->clock);
}

int ckpt_write(struct ckpt_io *io, const char *dir, const struct ckpt_snapshot *snap,
               struct ckpt_write_result *res, char *err, size_t errlen) {
  double t0 = clock_now_s();
  char tmp[1100], final[1100];
  ckpt_file_name(tmp, sizeof(tmp), dir, snap->shard, snap->job, snap->clock, true);
  ckpt_file_name(final, sizeof(final), dir, snap->shard, snap->job, snap->clock, false);
  struct durable d;
  struct writer w = {.d = &d};
  int r;
  w.buf = malloc(WBUF_BYTES);
  if (!w.buf) {
    snprintf(err, errlen, "out of memory");
    return -ENOMEM;
  }
  if ((r = durable_open(&d, io, dir, tmp, final, "ckpt", err, errlen)) < 0) goto out;
  write_body(&w, snap);
  struct prune_arg pa = {.dir = dir, .snap = snap};
  if ((r = durable_commit(&d, prune, &pa, err, errlen)) < 0) goto out;
  if (res) {
    snprintf(res->path, sizeof(res->path), "%s", final);
    res->bytes = w.off;
    res->seconds = clock_now_s() - t0;
  }
out:
  free(w.buf);
  return r;
}

/* ---- reading ------------------------------------------------------------- */

struct mapped {
  const uint8_t *p;
  size_t n;
};

static int map_file(const char *path, struct mapped *m, char *err, size_t errlen) {
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = -errno;
    snprintf(err, errlen, "open: %s", strerror(-e));
    return e;
  }
  struct stat st;
  if (fstat(fd, &st) != 0) {
    int e = -errno;
    close(fd);
    snprintf(err, errlen, "stat: %s", strerror(-e));
    return e;
  }
  m->n = (size_t)st.st_size;
  m->p = NULL;
  if (m->n > 0) {
    void *p = mmap(NULL, m->n, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int e = -errno;
      close(fd);
      snprintf(err, errlen, "mmap: %s", strerror(-e));
      return e;
    }
    m->p = p;
  }
  close(fd);
  return 0;
}

static void unmap_file(struct mapped *m) {
  if (m->p) munmap((void *)m->p, m->n);
  m->p = NULL;
}

/* Called for each verified record; payload points into the mapping. */
typedef int (*record_fn)(void *arg, uint32_t type, uint32_t flags, uint64_t key, uint64_t count,
                         uint64_t version, const uint8_t *payload, uint64_t bytes, uint32_t crc,
                         char *err, size_t errlen);

/* Checks and decodes the 64-byte header at p into info. */
static int parse_header(const uint8_t *p, struct ckpt_info *info, char *err, size_t errlen) {
  if (memcmp(p, header_magic, 8) != 0) {
    snprintf(err, errlen, "not a checkpoint (bad magic)");
    return -EBADMSG;
  }
  if (le_get32(p + 60) != crc32c_update(0, p, 60)) {
    snprintf(err, errlen, "header checksum mismatch");
    return -EBADMSG;
  }
  info->format_version = le_get32(p + 8);
  info->shard = le_get32(p + 12);
  info->num_shards = le_get32(p + 16);
  info->num_workers = le_get32(p + 20);
  info->layout_hash = le_get64(p + 24);
  info->clock = le_get64(p + 32);
  info->records = le_get32(p + 40);
  info->opt_kind = le_get32(p + 44);
  info->consistency = le_get32(p + 48);
  info->staleness = le_get32(p + 52);
  info->unix_s = le_get32(p + 56);
  if (info->format_version < 1 || info->format_version > CKPT_FORMAT_VERSION) {
    snprintf(err, errlen, "format version %" PRIu32 ", this build reads 1 to %u",
             info->format_version, CKPT_FORMAT_VERSION);
    return -EBADMSG;
  }
  return 0;
}

/* The JOB record's payload: at most CKPT_JOB_MAX printable bytes. */
static int decode_job(const uint8_t *p, uint64_t bytes, struct ckpt_info *info, char *err,
                      size_t errlen) {
  char job[CKPT_JOB_MAX + 1];
  if (bytes > CKPT_JOB_MAX) {
    snprintf(err, errlen, "job id of %" PRIu64 " bytes, at most %u", bytes, CKPT_JOB_MAX);
    return -EBADMSG;
  }
  memcpy(job, p, bytes);
  job[bytes] = 0;
  if (strlen(job) != bytes || ckpt_job_id_check(job, err, errlen) < 0) {
    snprintf(err, errlen, "malformed job record");
    return -EBADMSG;
  }
  memcpy(info->job, job, bytes + 1);
  return 0;
}

static int parse(const struct mapped *m, struct ckpt_info *info, record_fn fn, void *arg, char *err,
                 size_t errlen) {
  const uint8_t *p = m->p;
  size_t n = m->n;
  info->bytes = n;
  if (n < CKPT_HEADER_BYTES + CKPT_FOOTER_BYTES) {
    snprintf(err, errlen, "truncated: %zu bytes, shorter than a header and a footer", n);
    return -EBADMSG;
  }
  int hr = parse_header(p, info, err, errlen);
  if (hr < 0) return hr;
  const uint8_t *f = p + n - CKPT_FOOTER_BYTES;
  if (memcmp(f, footer_magic, 8) != 0 || le_get64(f + 8) != n) {
    snprintf(err, errlen, "truncated or incomplete: no footer at the end of its %zu bytes", n);
    return -EBADMSG;
  }
  info->file_crc = le_get32(f + 16);
  uint32_t crc = crc32c_update(0, p, n - CKPT_FOOTER_BYTES);
  if (crc != info->file_crc) {
    snprintf(err, errlen, "file checksum mismatch: footer says %08" PRIx32 ", contents %08" PRIx32,
             info->file_crc, crc);
    return -EBADMSG;
  }
  if (le_get32(f + 20) != info->records) {
    snprintf(err, errlen, "footer and header disagree on the record count");
    return -EBADMSG;
  }
  size_t off = CKPT_HEADER_BYTES, end = n - CKPT_FOOTER_BYTES;
  for (uint32_t i = 0; i < info->records; i++) {
    if (end - off < CKPT_RECORD_HEADER_BYTES + 4) {
      snprintf(err, errlen, "record %" PRIu32 " truncated", i);
      return -EBADMSG;
    }
    const uint8_t *h = p + off;
    uint64_t bytes = le_get64(h + 32);
    if (bytes > end - off - CKPT_RECORD_HEADER_BYTES - 4) {
      snprintf(err, errlen, "record %" PRIu32 " runs past the end of the file", i);
      return -EBADMSG;
    }
    size_t rl = CKPT_RECORD_HEADER_BYTES + (size_t)bytes;
    uint32_t rc = crc32c_update(0, h, rl);
    if (rc != le_get32(h + rl)) {
      snprintf(err, errlen, "record %" PRIu32 " checksum mismatch", i);
      return -EBADMSG;
    }
    uint32_t type = le_get32(h);
    /* version 1: LAYOUT, KEY...; version 2: JOB, LAYOUT, KEY... */
    uint32_t layout_at = info->format_version >= 2 ? 1 : 0;
    if ((i == layout_at) != (type == REC_LAYOUT) || (layout_at && (i == 0) != (type == REC_JOB)) ||
        (type != REC_LAYOUT && type != REC_KEY && type != REC_JOB)) {
      snprintf(err, errlen, "record %" PRIu32 " has unexpected type %" PRIu32, i, type);
      return -EBADMSG;
    }
    if (type == REC_JOB) {
      int r = decode_job(h + CKPT_RECORD_HEADER_BYTES, bytes, info, err, errlen);
      if (r < 0) return r;
    } else if (fn) {
      int r = fn(arg, type, le_get32(h + 4), le_get64(h + 8), le_get64(h + 16), le_get64(h + 24),
                 h + CKPT_RECORD_HEADER_BYTES, bytes, rc, err, errlen);
      if (r < 0) return r;
    }
    off += rl + 4;
  }
  if (off != end) {
    snprintf(err, errlen, "%zu unexpected bytes after the last record", end - off);
    return -EBADMSG;
  }
  return 0;
}

/* Decodes a LAYOUT payload into l (names point into a fresh allocation). */
/* The owners part of a LAYOUT payload (REC_HAS_OWNERS), from p + *off. */
static int decode_owners(const uint8_t *p, uint64_t bytes, uint64_t *off, struct store_layout *l) {
  l->num_owners = calloc(l->num_tensors ? l->num_tensors : 1, sizeof(uint32_t));
  l->owners = calloc(l->num_tensors ? l->num_tensors : 1, sizeof(uint32_t *));
  if (!l->num_owners || !l->owners) return -ENOMEM;
  for (uint32_t i = 0; i < l->num_tensors; i++) {
    if (bytes - *off < 4) return -EBADMSG;
    uint32_t n = le_get32(p + *off);
    *off += 4;
    if (n > (bytes - *off) / 4) return -EBADMSG;
    if (n && !(l->owners[i] = malloc(n * sizeof(uint32_t)))) return -ENOMEM;
    for (uint32_t j = 0; j < n; j++) l->owners[i][j] = le_get32(p + *off + 4ull * j);
    l->num_owners[i] = n;
    *off += 4ull * n;
  }
  return 0;
}

static int decode_layout(const uint8_t *p, uint64_t bytes, uint64_t hash, uint32_t flags,
                         struct store_layout *l, char *err, size_t errlen) {
  memset(l, 0, sizeof(*l));
  if (bytes < 16) goto bad;
  l->chunk_bytes = le_get64(p);
  l->num_shards = le_get32(p + 8);
  l->num_tensors = le_get32(p + 12);
  l->hash = hash;
  if (l->num_tensors > bytes / 12) goto bad;
  l->names = calloc(l->num_tensors ? l->num_tensors : 1, sizeof(char *));
  l->counts = calloc(l->num_tensors ? l->num_tensors : 1, sizeof(uint64_t));
  if (!l->names || !l->counts) {
    snprintf(err, errlen, "out of memory");
    return -ENOMEM;
  }
  uint64_t off = 16;
  for (uint32_t i = 0; i < l->num_tensors; i++) {
    if (bytes - off < 12) goto bad;
    l->counts[i] = le_get64(p + off);
    uint32_t nl = le_get32(p + off + 8);
    off += 12;
    if (bytes - off < nl) goto bad;
    if (!(l->names[i] = strndup((const char *)p + off, nl))) {
      snprintf(err, errlen, "out of memory");
      return -ENOMEM;
    }
    off += nl;
  }
  if (flags & REC_HAS_OWNERS) {
    int r = decode_owners(p, bytes, &off, l);
    if (r == -ENOMEM) {
      snprintf(err, errlen, "out of memory");
      return r;
    }
    if (r < 0) goto bad;
  }
  if (off != bytes) goto bad;
  return 0;
bad:
  snprintf(err, errlen, "malformed layout record");
  return -EBADMSG;
}

struct print_ctx {
  FILE *out;
  const struct ckpt_info *info;
};

static int print_record(void *arg, uint32_t type, uint32_t flags, uint64_t key, uint64_t count,
                        uint64_t version, const uint8_t *payload, uint64_t bytes, uint32_t crc,
                        char *err, size_t errlen) {
  struct print_ctx *pc = arg;
  if (type == REC_LAYOUT) {
    struct store_layout l;
    int r = decode_layout(payload, bytes, pc->info->layout_hash, flags, &l, err, errlen);
    if (r == 0) {
      fprintf(pc->out, "layout: %" PRIu32 " tensors, chunk_bytes %" PRIu64 ", %" PRIu32 " shards\n",
              l.num_tensors, l.chunk_bytes, l.num_shards);
      for (uint32_t i = 0; i < l.num_tensors; i++) {
        fprintf(pc->out, "  tensor %-3" PRIu32 " %-24s %12" PRIu64 " floats", i, l.names[i],
                l.counts[i]);
        for (uint32_t j = 0; l.num_owners && j < l.num_owners[i]; j++)
          fprintf(pc->out, "%s%" PRIu32, j ? "," : "  owners ", l.owners[i][j]);
        fputc('\n', pc->out);
      }
      fprintf(pc->out, "keys:\n");
    }
    store_layout_free(&l);
    return r;
  }
  fprintf(pc->out,
          "  key %016" PRIx64 " version %-8" PRIu64 " floats %-10" PRIu64
          " opt_state %-3s bytes %-10" PRIu64 " crc32c %08" PRIx32 "\n",
          key, version, count, (flags & REC_HAS_STATE) ? "yes" : "no", bytes, crc);
  return 0;
}

int ckpt_verify(const char *path, struct ckpt_info *info, FILE *out, char *err, size_t errlen) {
  struct ckpt_info dummy;
  if (!info) info = &dummy;
  memset(info, 0, sizeof(*info));
  snprintf(info->path, sizeof(info->path), "%s", path);
  struct mapped m;
  int r = map_file(path, &m, err, errlen);
  if (r < 0) return r;
  struct print_ctx pc = {out, info};
  r = parse(&m, info, out ? print_record : NULL, &pc, err, errlen);
  unmap_file(&m);
  return r;
}

int ckpt_peek(const char *path, struct ckpt_info *info, char *err, size_t errlen) {
  memset(info, 0, sizeof(*info));
  snprintf(info->path, sizeof(info->path), "%s", path);
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = -errno;
    snprintf(err, errlen, "open: %s", strerror(-e));
    return e;
  }
  uint8_t b[CKPT_HEADER_BYTES + CKPT_RECORD_HEADER_BYTES + CKPT_JOB_MAX + 4];
  ssize_t got = pread(fd, b, sizeof(b), 0);
  close(fd);
  if (got < (ssize_t)CKPT_HEADER_BYTES) {
    snprintf(err, errlen, "truncated: no header");
    return -EBADMSG;
  }
  int r = parse_header(b, info, err, errlen);
  if (r < 0 || info->format_version < 2) return r; /* version 1: the unnamed job */
  const uint8_t *h = b + CKPT_HEADER_BYTES;
  uint64_t bytes = got >= (ssize_t)(CKPT_HEADER_BYTES + CKPT_RECORD_HEADER_BYTES) ? le_get64(h + 32)
                                                                                  : UINT64_MAX;
  if (bytes > CKPT_JOB_MAX ||
      (size_t)got < CKPT_HEADER_BYTES + CKPT_RECORD_HEADER_BYTES + bytes + 4 ||
      le_get32(h) != REC_JOB) {
    snprintf(err, errlen, "no readable job record");
    return -EBADMSG;
  }
  size_t rl = CKPT_RECORD_HEADER_BYTES + (size_t)bytes;
  if (crc32c_update(0, h, rl) != le_get32(h + rl)) {
    snprintf(err, errlen, "job record checksum mismatch");
    return -EBADMSG;
  }
  return decode_job(h + CKPT_RECORD_HEADER_BYTES, bytes, info, err, errlen);
}

struct load_ctx {
  struct store *s;
  const struct ckpt_info *info;
  size_t restored;
};

static int load_record(void *arg, uint32_t type, uint32_t flags, uint64_t key, uint64_t count,
                       uint64_t version, const uint8_t *payload, uint64_t bytes, uint32_t crc,
                       char *err, size_t errlen) {
  struct load_ctx *lc = arg;
  struct store *s = lc->s;
  (void)crc;
  if (type == REC_LAYOUT) {
    struct store_layout l;
    int r = decode_layout(payload, bytes, lc->info->layout_hash, flags, &l, err, errlen);
    if (r == 0) r = store_set_layout(s, &l, err, errlen);
    store_layout_free(&l);
    return r;
  }
  struct store_key *k = store_find(s, key);
  size_t state = store_state_floats(s);
  uint64_t want = count * 4 + state * count * 4 + s->opts.num_workers * 8ull;
  if (!k || k->count != count) {
    snprintf(err, errlen, "key %016" PRIx64 " does not belong to this shard's layout", key);
    return -EBADMSG;
  }
  if (bytes != want) { /* the layout fits: the optimizer state does not */
    uint64_t rest = count * 4 + s->opts.num_workers * 8ull;
    snprintf(err, errlen,
             "key %016" PRIx64
             " holds %.4g floats of optimizer state per parameter, this shard "
             "keeps %zu (--consistency and --staleness-method decide it: the look-ahead keeps "
             "one velocity per worker and their sum)",
             key, count && bytes > rest ? (double)(bytes - rest) / (double)(count * 4) : 0.0,
             state);
    return -EBADMSG;
  }
  /* the mapping may not be float-aligned for every record: copy through
   * aligned buffers */
  float *params = malloc(count * 4);
  float *st = (flags & REC_HAS_STATE) && state ? malloc(state * count * 4) : NULL;
  uint64_t *ns = malloc(s->opts.num_workers * 8ull);
  int r = -ENOMEM;
  if (!params || !ns || ((flags & REC_HAS_STATE) && state && !st)) goto out;
  memcpy(params, payload, count * 4);
  if (st) memcpy(st, payload + count * 4, state * count * 4);
  const uint8_t *q = payload + count * 4 + state * count * 4;
  for (uint32_t w = 0; w < s->opts.num_workers; w++) ns[w] = le_get64(q + 8ull * w);
  r = store_restore_key(s, k, version, params, st, ns);
  if (r == 0) lc->restored++;
out:
  if (r == -ENOMEM) snprintf(err, errlen, "out of memory");
  free(params);
  free(st);
  free(ns);
  return r;
}

static int load_from(const char *dir, struct store *s, uint64_t only, struct ckpt_info *info,
                     char *err, size_t errlen) {
  struct ckpt_file *files = NULL;
  size_t n = 0;
  const char *job = s->opts.job_id ? s->opts.job_id : "";
  int r = ckpt_dir_list(dir, s->opts.shard, job, &files, &n);
  if (r < 0) {
    snprintf(err, errlen, "cannot read %s: %s", dir, strerror(-r));
    return r == -ENOENT ? -ENOENT : r;
  }
  /* only this job's (another job's are reported once at start, not here),
   * and with `only`, that clock */
  size_t kept = 0;
  for (size_t i = 0; i < n; i++)
    if ((only == UINT64_MAX || files[i].clock == only) &&
        ckpt_file_mine(&files[i], job, s->has_layout ? s->layout.hash : 0))
      files[kept++] = files[i];
  n = kept;
  r = -ENOENT;
  snprintf(err, errlen, "no checkpoint of shard %" PRIu32 " of job \"%s\" in %s", s->opts.shard,
           job, dir);
  for (size_t i = 0; i < n; i++) {
    char path[1100], why[400] = "";
    snprintf(path, sizeof(path), "%s", files[i].path);
    memset(info, 0, sizeof(*info));
    snprintf(info->path, sizeof(info->path), "%s", path);
    struct mapped m;
    int v = map_file(path, &m, why, sizeof(why));
    if (v == 0) {
      v = parse(&m, info, NULL, NULL, why, sizeof(why));
      if (v == 0 && (info->shard != s->opts.shard || info->num_shards != s->opts.num_shards ||
                     info->num_workers != s->opts.num_workers)) {
        snprintf(why, sizeof(why),
                 "written by shard %" PRIu32 " of %" PRIu32 " with %" PRIu32
                 " workers, this is shard %" PRIu32 " of %" PRIu32 " with %" PRIu32,
                 info->shard, info->num_shards, info->num_workers, s->opts.shard,
                 s->opts.num_shards, s->opts.num_workers);
        v = -EBADMSG;
      }
      if (v == 0 && info->opt_kind != (uint32_t)s->opts.opt.kind) {
        snprintf(why, sizeof(why), "written with optimizer %s, this shard runs %s",
                 opt_name((enum opt_kind)info->opt_kind), opt_name(s->opts.opt.kind));
        v = -EBADMSG;
      }
      if (v == 0) {
        struct load_ctx lc = {s, info, 0};
        v = parse(&m, info, load_record, &lc, why, sizeof(why));
        unmap_file(&m);
        if (v < 0) { /* valid file the store refused: nothing older would fit better */
          snprintf(err, errlen, "%s: %s", path, why);
          r = v;
          break;
        }
        r = 0;
        break;
      }
      unmap_file(&m);
    }
    log_warn("skipping checkpoint", "path=%s error=\"%s\"", path, why);
    if (i == 0) /* report the newest one's problem */
      snprintf(err, errlen, "no usable checkpoint (%zu skipped; newest %s: %s)", n, path, why);
  }
  free(files);
  return r;
}

int ckpt_load_latest(const char *dir, struct store *s, struct ckpt_info *info, char *err,
                     size_t errlen) {
  return load_from(dir, s, UINT64_MAX, info, err, errlen);
}

int ckpt_load_clock(const char *dir, struct store *s, uint64_t clock, struct ckpt_info *info,
                    char *err, size_t errlen) {
  return load_from(dir, s, clock, info, err, errlen);
}
