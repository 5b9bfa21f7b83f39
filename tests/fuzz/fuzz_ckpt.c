/* fuzz_ckpt: the checkpoint reader (ps-server/ckpt.c) against files from the
 * fuzzer.
 *
 * Input: byte 0 holds flags, the rest is the checkpoint file. The harness
 * writes it as this shard's only checkpoint, shard-SSSS-vCLOCK.ckpt (clock
 * from the file's header), in a directory it makes once per process (under
 * /dev/shm where there is one, so the fsyncs of the round trip cost
 * nothing), and runs ckpt_verify (plain, and printing as the inspector does
 * into /dev/null), then ckpt_load_latest or ckpt_load_clock into an empty
 * store, then ckpt_load_clock of a clock that is not there.
 *   bit 0  fix up what a random mutation almost never gets right: the layout
 *          hash, the header CRC, every record's CRC, and the footer (magic,
 *          length, record count, file CRC); so the fuzzer reaches the layout
 *          and key decoding behind them
 *   bit 1  the store's options (shard, shard and worker counts, optimizer,
 *          consistency) come from the file's header where they are in range,
 *          instead of the fixture's (shard 0 of 1, 2 workers, momentum, BSP)
 *   bit 2  ckpt_load_clock of the file's clock instead of ckpt_load_latest
 * Layouts of more than 2^20 floats or 2^16 chunks are skipped (the loader
 * would allocate that much, legitimately: the layout is the model's).
 *
 * Invariants (abort() if broken): the calls return 0 or one of the errors
 * they document; a file the loader accepts verifies; what verify refuses,
 * the inspector's printing run refuses too; and a store that loaded, written
 * back with ckpt_write and loaded into a fresh store, is the same store
 * (parameters, versions, optimizer state, clocks; in BSP a clock ahead of
 * its key's version is saved as that version, as ckpt_snapshot_add says). */
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "ckpt_io.h"
#include "crc32c.h"
#include "log.h"
#include "placement.h"
#include "store.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_FLOATS (1ull << 20)
#define MAX_CHUNKS (1ull << 16)
#define MAX_WORKERS 64u
#define MAX_SHARDS 64u

#define CHECK(c)                                                                \
  do {                                                                          \
    if (!(c)) {                                                                 \
      fprintf(stderr, "fuzz_ckpt: %s:%d: CHECK(%s)\n", __FILE__, __LINE__, #c); \
      abort();                                                                  \
    }                                                                           \
  } while (0)

/* The per-process directory and the inspector's output. */
static char g_dir[256], g_rtdir[300];
static FILE *g_null;

static void cleanup(void) {
  if (g_rtdir[0]) rmdir(g_rtdir);
  if (g_dir[0]) rmdir(g_dir);
  if (g_null) fclose(g_null);
}

static void setup_once(void) {
  if (g_dir[0]) return;
  struct stat st;
  const char *base = getenv("TMPDIR");
  if (stat("/dev/shm", &st) == 0 && S_ISDIR(st.st_mode) && access("/dev/shm", W_OK) == 0)
    base = "/dev/shm";
  if (!base || !*base) base = "/tmp";
  snprintf(g_dir, sizeof(g_dir), "%s/fuzz_ckpt.XXXXXX", base);
  if (!mkdtemp(g_dir)) {
    perror("fuzz_ckpt: mkdtemp");
    abort();
  }
  snprintf(g_rtdir, sizeof(g_rtdir), "%s/rt", g_dir);
  if (mkdir(g_rtdir, 0700) != 0) abort();
  g_null = fopen("/dev/null", "w");
  if (!g_null) abort();
  atexit(cleanup);
  log_setup("fuzz_ckpt", LOG_OFF); /* every skipped file is logged */
}

static uint32_t get32(const uint8_t *p) {
  return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get64(const uint8_t *p) {
  return (uint64_t)get32(p) | (uint64_t)get32(p + 4) << 32;
}
static void put32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* The layout record's payload (record 0, where the loader reads it), if the
 * file is long enough to hold one. */
static bool layout_payload(const uint8_t *f, size_t n, const uint8_t **p, uint64_t *bytes) {
  if (n < CKPT_HEADER_BYTES + CKPT_FOOTER_BYTES + CKPT_RECORD_HEADER_BYTES + 4) return false;
  const uint8_t *h = f + CKPT_HEADER_BYTES;
  size_t room = n - CKPT_FOOTER_BYTES - CKPT_HEADER_BYTES - CKPT_RECORD_HEADER_BYTES - 4;
  *bytes = get64(h + 32);
  if (*bytes > room) return false;
  *p = h + CKPT_RECORD_HEADER_BYTES;
  return true;
}

/* Reads a layout payload the way ckpt.c's decode_layout does: its hash (as
 * placement_layout_hash computes it) and whether it is small enough to load.
 * Returns false if it does not decode (the loader refuses it then too). */
static bool layout_scan(const uint8_t *p, uint64_t bytes, uint64_t *hash, bool *small) {
  if (bytes < 16) return false;
  uint64_t chunk_bytes = get64(p);
  uint32_t num_shards = get32(p + 8), nt = get32(p + 12);
  if (nt > bytes / 12) return false;
  char **names = calloc(nt ? nt : 1, sizeof(char *));
  uint64_t *counts = calloc(nt ? nt : 1, sizeof(uint64_t));
  if (!names || !counts) abort();
  uint64_t off = 16, floats = 0, chunks = 0, elems = chunk_bytes / 4 ? chunk_bytes / 4 : 1;
  bool ok = true;
  uint32_t got = 0;
  for (; got < nt; got++) {
    if (bytes - off < 12) break;
    counts[got] = get64(p + off);
    uint32_t nl = get32(p + off + 8);
    off += 12;
    if (bytes - off < nl) break;
    names[got] = strndup((const char *)p + off, nl);
    if (!names[got]) abort();
    off += nl;
    floats += counts[got] <= MAX_FLOATS ? counts[got] : MAX_FLOATS + 1;
    chunks += counts[got] / elems + 1;
  }
  if (got < nt || off != bytes) ok = false;
  *small = floats <= MAX_FLOATS && chunks <= MAX_CHUNKS;
  if (ok)
    *hash = placement_layout_hash((const char *const *)names, counts, nt, chunk_bytes, num_shards);
  for (uint32_t i = 0; i < got; i++) free(names[i]);
  free(names);
  free(counts);
  return ok;
}

/* Bit 0: makes every hash, checksum and the footer right, walking the
 * records as the loader does. */
static void fix_up(uint8_t *f, size_t n) {
  if (n < CKPT_HEADER_BYTES + CKPT_FOOTER_BYTES) return;
  const uint8_t *lp;
  uint64_t lb, hash;
  bool small;
  if (layout_payload(f, n, &lp, &lb) && layout_scan(lp, lb, &hash, &small)) put64(f + 24, hash);
  put32(f + 60, crc32c_update(0, f, 60));
  uint32_t records = get32(f + 40);
  size_t off = CKPT_HEADER_BYTES, end = n - CKPT_FOOTER_BYTES;
  for (uint32_t i = 0; i < records; i++) {
    if (end - off < CKPT_RECORD_HEADER_BYTES + 4) break;
    uint8_t *h = f + off;
    uint64_t bytes = get64(h + 32);
    if (bytes > end - off - CKPT_RECORD_HEADER_BYTES - 4) break;
    size_t rl = CKPT_RECORD_HEADER_BYTES + (size_t)bytes;
    put32(h + rl, crc32c_update(0, h, rl));
    off += rl + 4;
  }
  uint8_t *foot = f + end;
  memcpy(foot, "PSCKEND1", 8);
  put64(foot + 8, n);
  put32(foot + 16, crc32c_update(0, f, end));
  put32(foot + 20, records);
}

/* The store's options: the fixture's, or (bit 1) the file header's. */
static void store_options(const uint8_t *f, size_t n, bool from_file, struct store_opts *o) {
  *o = (struct store_opts){.shard = 0,
                           .num_shards = 1,
                           .num_workers = 2,
                           .consistency = STORE_BSP,
                           .opt = {.kind = OPT_MOMENTUM, .lr = 0.05, .momentum = 0.9}};
  if (!from_file || n < CKPT_HEADER_BYTES) return;
  uint32_t shard = get32(f + 12), shards = get32(f + 16), workers = get32(f + 20);
  uint32_t kind = get32(f + 44), cons = get32(f + 48), stale = get32(f + 52);
  if (shards == 0 || shards > MAX_SHARDS || shard >= shards || workers == 0 ||
      workers > MAX_WORKERS || kind > OPT_SUM || cons > STORE_SSP || stale > 1000000)
    return;
  o->shard = shard;
  o->num_shards = shards;
  o->num_workers = workers;
  o->opt.kind = (enum opt_kind)kind;
  o->consistency = (enum store_consistency)cons;
  o->staleness = stale;
}

static void serve_none(struct store_key *k, struct store_waiter *w, void *arg) {
  (void)k;
  (void)arg;
  free(w);
}

static bool known_error(int r) {
  return r == -EBADMSG || r == -ENOENT || r == -EINVAL || r == -EEXIST || r == -ENOMEM;
}

static bool same_floats(const float *a, const float *b, uint64_t n) {
  return (!a && !b) || (a && b && memcmp(a, b, n * sizeof(float)) == 0);
}

/* A loaded store survives ckpt_write and a second load unchanged. */
static void round_trip(const struct store *a, const struct store_opts *o) {
  struct ckpt_snapshot *snap = ckpt_snapshot_take(a);
  CHECK(snap != NULL);
  struct ckpt_io *io = NULL;
  CHECK(ckpt_io_open(CKPT_IO_SYNC, &io) == 0);
  struct ckpt_write_result res;
  char err[512] = "";
  int r = ckpt_write(io, g_rtdir, snap, &res, err, sizeof(err));
  if (r < 0) fprintf(stderr, "fuzz_ckpt: round trip: %s\n", err);
  CHECK(r == 0);
  ckpt_snapshot_free(snap);
  ckpt_io_close(io);

  struct store b;
  CHECK(store_init(&b, o, serve_none, NULL) == 0);
  struct ckpt_info info;
  r = ckpt_load_latest(g_rtdir, &b, &info, err, sizeof(err));
  if (r < 0) fprintf(stderr, "fuzz_ckpt: round trip load: %s\n", err);
  CHECK(r == 0);
  CHECK(b.has_layout && b.num_keys == a->num_keys);
  size_t sf = opt_state_floats(o->opt.kind);
  for (size_t i = 0; i < a->num_keys; i++) {
    const struct store_key *x = &a->keys[i], *y = &b.keys[i];
    CHECK(x->key == y->key && x->count == y->count && !x->params == !y->params);
    if (!x->params) continue;
    CHECK(x->version == y->version);
    CHECK(same_floats(x->params->data, y->params->data, x->count));
    CHECK(same_floats(x->opt_state, y->opt_state, sf * x->count));
    for (uint32_t w = 0; w < o->num_workers; w++) {
      uint64_t c = x->next_step[w];
      if (o->consistency == STORE_BSP && c > x->version) c = x->version;
      CHECK(y->next_step[w] == c);
    }
  }
  store_deinit(&b);
  unlink(info.path);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  setup_once();
  uint8_t flags = data[0];
  size_t n = size - 1;
  uint8_t *f = malloc(n ? n : 1);
  if (!f) abort();
  memcpy(f, data + 1, n);
  if (flags & 1) fix_up(f, n);

  /* skip a layout the loader would (rightly) allocate too much for */
  const uint8_t *lp;
  uint64_t lb, hash;
  bool small = true;
  if (layout_payload(f, n, &lp, &lb) && layout_scan(lp, lb, &hash, &small) && !small) {
    free(f);
    return 0;
  }

  struct store_opts o;
  store_options(f, n, flags & 2, &o);
  uint64_t clock = n >= CKPT_HEADER_BYTES ? get64(f + 32) : 0;
  char path[1100];
  snprintf(path, sizeof(path), "%s/shard-%04" PRIu32 "-v%020" PRIu64 ".ckpt", g_dir, o.shard,
           clock);
  FILE *fp = fopen(path, "wb");
  CHECK(fp && fwrite(f, 1, n, fp) == n && fclose(fp) == 0);

  char err[512];
  struct ckpt_info info;
  int plain = ckpt_verify(path, &info, NULL, err, sizeof(err));
  CHECK(plain == 0 || plain == -EBADMSG);
  int printed = ckpt_verify(path, &info, g_null, err, sizeof(err));
  CHECK(printed == 0 || printed == -EBADMSG || printed == -ENOMEM);
  CHECK(plain == 0 || printed < 0);

  struct store s;
  CHECK(store_init(&s, &o, serve_none, NULL) == 0);
  int r = (flags & 4) ? ckpt_load_clock(g_dir, &s, clock, &info, err, sizeof(err))
                      : ckpt_load_latest(g_dir, &s, &info, err, sizeof(err));
  CHECK(r == 0 || known_error(r));
  if (r == 0) {
    CHECK(plain == 0 && info.clock == clock && strcmp(info.path, path) == 0);
    for (uint32_t w = 0; w < o.num_workers; w++) (void)store_worker_clock(&s, w);
    if (s.has_layout) round_trip(&s, &o);
  }
  store_deinit(&s);

  /* a clock that is not there is not loaded, whatever the file holds
   * (not UINT64_MAX: ckpt_load_clock takes that one to mean "the newest") */
  struct store e;
  CHECK(store_init(&e, &o, serve_none, NULL) == 0);
  uint64_t absent = clock ? clock - 1 : 1;
  CHECK(ckpt_load_clock(g_dir, &e, absent, &info, err, sizeof(err)) == -ENOENT);
  CHECK(!e.has_layout);
  store_deinit(&e);

  /* this file is newer than clock - 1: ckpt_remove_after deletes it */
  if (clock > 0) {
    ckpt_remove_after(g_dir, o.shard, o.job_id, clock - 1);
    /* unless its job record names another job: those are never deleted */
    struct ckpt_info pk;
    bool foreign = ckpt_peek(path, &pk, err, sizeof(err)) == 0 && pk.job[0];
    CHECK(foreign || access(path, F_OK) != 0);
    unlink(path);
  } else {
    unlink(path);
  }
  free(f);
  return 0;
}
