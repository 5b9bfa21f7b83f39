/* Checkpoints: a store written and loaded back is equal bit for bit
 * (parameters, versions, optimizer state, per-rank clocks) with either I/O
 * backend; an unfinished BSP step is not in the checkpoint (clocks clamped
 * to the version, so the pushes are taken again); truncation at every 4 KiB
 * boundary (and one byte short) and random single-bit flips anywhere are all
 * detected; a corrupt newest checkpoint is reported and skipped for the
 * previous one; only the two newest are kept; checkpoints of another shard
 * count are refused; the inspector's output names the problem. Jobs: a
 * directory holding another job's checkpoints at higher clocks keeps them
 * untouched (also at the same clock) while this job's are kept, loaded and
 * pruned by their own clocks; a format-1 file is the unnamed job's; job ids
 * and --checkpoint-dir values are checked. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "ckpt_dir.h"
#include "crc32c.h"
#include "le.h"
#include "ckpt_fixture.h"
#include "log.h"
#include "check.h"

static char dir[] = "/tmp/test_ckpt.XXXXXX";

static int write_snap(struct ckpt_io *io, struct store *s, struct ckpt_write_result *res) {
  struct ckpt_snapshot *snap = ckpt_snapshot_take(s);
  char err[400] = "";
  int r = snap ? ckpt_write(io, dir, snap, res, err, sizeof(err)) : -ENOMEM;
  CHECK(r == 0, "write: %s", err);
  ckpt_snapshot_free(snap);
  return r;
}

static unsigned char *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (!f) return NULL;
  fseek(f, 0, SEEK_END);
  *n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  unsigned char *b = malloc(*n);
  if (fread(b, 1, *n, f) != *n) *n = 0;
  fclose(f);
  return b;
}

static void spit(const char *path, const unsigned char *b, size_t n) {
  FILE *f = fopen(path, "wb");
  fwrite(b, 1, n, f);
  fclose(f);
}

static void test_roundtrip(enum ckpt_io_kind kind) {
  struct ckpt_io *io;
  if (ckpt_io_open(kind, &io) < 0) {
    fprintf(stderr, "backend %d unavailable: skipped\n", kind);
    return;
  }
  struct store a, b;
  CHECK(store_fixture_init(&a, true) == 0, "fixture");
  CHECK(store_fixture_run(&a, 0, 5, false) == 0, "run");
  struct ckpt_write_result res;
  write_snap(io, &a, &res);
  CHECK(store_fixture_init(&b, false) == 0, "empty store");
  struct ckpt_info info;
  char err[400] = "";
  CHECK(ckpt_load_latest(dir, &b, &info, err, sizeof(err)) == 0, "load: %s", err);
  CHECK(info.clock == 5, "clock %llu", (unsigned long long)info.clock);
  CHECK(store_fixture_equal(&a, &b), "%s: loaded store differs", ckpt_io_name(io));
  /* and both go on identically */
  CHECK(store_fixture_run(&a, 5, 7, false) == 0 && store_fixture_run(&b, 5, 7, false) == 0, "run");
  CHECK(store_fixture_equal(&a, &b), "after more steps");
  store_deinit(&a);
  store_deinit(&b);
  unlink(res.path);
  ckpt_io_close(io);
}

/* asp with the look-ahead: the W velocities and their sum are written and
 * loaded back; a shard that keeps other state (divide: one velocity) refuses
 * the file and says why. */
static void test_lookahead_state(struct ckpt_io *io) {
  struct store a, b, c;
  CHECK(store_fixture_init_mode(&a, true, STORE_ASP, STALENESS_LOOKAHEAD) == 0, "fixture");
  CHECK(store_state_floats(&a) == FIX_WORKERS + 1, "state floats %zu", store_state_floats(&a));
  CHECK(store_fixture_run(&a, 0, 4, true) == 0, "run");
  struct ckpt_write_result res;
  write_snap(io, &a, &res);
  CHECK(store_fixture_init_mode(&b, false, STORE_ASP, STALENESS_LOOKAHEAD) == 0, "empty store");
  struct ckpt_info info;
  char err[400] = "";
  CHECK(ckpt_load_latest(dir, &b, &info, err, sizeof(err)) == 0, "load: %s", err);
  CHECK(store_fixture_equal(&a, &b), "loaded look-ahead store differs");
  /* rank 0's step 4 is in both: a duplicate there, as a resend would be */
  CHECK(store_fixture_run(&a, 4, 7, false) == 0 && store_fixture_run(&b, 4, 7, false) == 0, "run");
  CHECK(store_fixture_equal(&a, &b), "after more pushes");
  CHECK(store_fixture_init_mode(&c, false, STORE_ASP, STALENESS_DIVIDE) == 0, "empty store");
  CHECK(ckpt_load_latest(dir, &c, &info, err, sizeof(err)) == -EBADMSG &&
            strstr(err, "holds 3 floats of optimizer state per parameter, this shard keeps 1"),
        "divide store loading a look-ahead checkpoint: %s", err);
  store_deinit(&a);
  store_deinit(&b);
  store_deinit(&c);
  unlink(res.path);
}

/* Rank 0 pushed step 5 before the checkpoint: after loading, its push of
 * step 5 must be accepted again (not a duplicate), and the result equal to a
 * store that never crashed. */
static void test_unfinished_step(struct ckpt_io *io) {
  struct store a, b, ref;
  store_fixture_init(&a, true);
  store_fixture_init(&ref, true);
  store_fixture_run(&a, 0, 5, true);
  store_fixture_run(&ref, 0, 6, false);
  struct ckpt_write_result res;
  write_snap(io, &a, &res);
  store_fixture_init(&b, false);
  struct ckpt_info info;
  char err[400];
  CHECK(ckpt_load_latest(dir, &b, &info, err, sizeof(err)) == 0, "load: %s", err);
  CHECK(b.keys[0].next_step[0] == 5, "rank 0 clock %llu",
        (unsigned long long)b.keys[0].next_step[0]);
  CHECK(store_fixture_run(&b, 5, 6, false) == 0, "replay of step 5");
  CHECK(store_fixture_equal(&b, &ref), "replayed step differs from the uninterrupted run");
  CHECK(b.stats.duplicates == 0, "%llu duplicates", (unsigned long long)b.stats.duplicates);
  store_deinit(&a);
  store_deinit(&b);
  store_deinit(&ref);
  unlink(res.path);
}

static void test_corruption(struct ckpt_io *io) {
  struct store a;
  store_fixture_init(&a, true);
  store_fixture_run(&a, 0, 3, false);
  struct ckpt_write_result res;
  write_snap(io, &a, &res);
  size_t n = 0;
  unsigned char *orig = slurp(res.path, &n);
  CHECK(orig && n > 3 * 4096, "size %zu", n);
  char bad[1200], err[400];
  snprintf(bad, sizeof(bad), "%s/corrupt.ckpt", dir);
  struct ckpt_info info;
  spit(bad, orig, n);
  CHECK(ckpt_verify(bad, &info, NULL, err, sizeof(err)) == 0, "intact copy: %s", err);
  int missed = 0, tried = 0;
  for (size_t cut = 0; cut < n; cut += 4096) {
    spit(bad, orig, cut);
    tried++;
    if (ckpt_verify(bad, &info, NULL, err, sizeof(err)) == 0) missed++;
  }
  spit(bad, orig, n - 1);
  tried++;
  if (ckpt_verify(bad, &info, NULL, err, sizeof(err)) == 0) missed++;
  CHECK(missed == 0, "%d of %d truncations not detected", missed, tried);
  fprintf(stderr, "truncations: %d tried, %d missed\n", tried, missed);

  srand(11);
  missed = 0;
  int flips = 400;
  for (int i = 0; i < flips; i++) {
    size_t at = (size_t)rand() % n;
    int bit = rand() % 8;
    orig[at] ^= (unsigned char)(1u << bit);
    spit(bad, orig, n);
    if (ckpt_verify(bad, &info, NULL, err, sizeof(err)) == 0) missed++;
    orig[at] ^= (unsigned char)(1u << bit);
  }
  /* every byte of the header and footer too */
  for (size_t at = 0; at < n; at = at < 64 ? at + 1 : at < n - 24 ? n - 24 : at + 1) {
    orig[at] ^= 0x10;
    spit(bad, orig, n);
    if (ckpt_verify(bad, &info, NULL, err, sizeof(err)) == 0) missed++;
    orig[at] ^= 0x10;
    flips++;
  }
  CHECK(missed == 0, "%d of %d bit flips not detected", missed, flips);
  fprintf(stderr, "bit flips: %d tried, %d missed\n", flips, missed);

  /* the inspector's view */
  orig[n / 2] ^= 1;
  spit(bad, orig, n);
  FILE *out = tmpfile();
  CHECK(ckpt_verify(bad, &info, out, err, sizeof(err)) == -EBADMSG, "flipped");
  CHECK(strstr(err, "checksum") != NULL, "error: %s", err);
  unlink(bad);
  fclose(out);
  free(orig);
  store_deinit(&a);
  unlink(res.path);
}

static void test_fallback_and_pruning(struct ckpt_io *io) {
  struct store a, b;
  store_fixture_init(&a, true);
  struct ckpt_write_result r1, r2, r3;
  store_fixture_run(&a, 0, 2, false);
  write_snap(io, &a, &r1);
  store_fixture_run(&a, 2, 4, false);
  write_snap(io, &a, &r2);
  store_fixture_run(&a, 4, 6, false);
  write_snap(io, &a, &r3);
  CHECK(access(r1.path, F_OK) != 0, "oldest not pruned");
  CHECK(access(r2.path, F_OK) == 0 && access(r3.path, F_OK) == 0, "two newest kept");
  /* truncate the newest: the loader says so and takes the previous one */
  CHECK(truncate(r3.path, (off_t)(r3.bytes / 2)) == 0, "truncate");
  store_fixture_init(&b, false);
  struct ckpt_info info;
  char err[400];
  CHECK(ckpt_load_latest(dir, &b, &info, err, sizeof(err)) == 0, "load: %s", err);
  CHECK(info.clock == 4, "fell back to clock %llu", (unsigned long long)info.clock);
  CHECK(strcmp(info.path, r2.path) == 0, "loaded %s", info.path);
  store_deinit(&b);
  /* both corrupt: nothing to load */
  CHECK(truncate(r2.path, 100) == 0, "truncate");
  store_fixture_init(&b, false);
  CHECK(ckpt_load_latest(dir, &b, &info, err, sizeof(err)) == -ENOENT, "nothing valid");
  CHECK(!b.has_layout, "a refused file left state behind");
  store_deinit(&b);
  /* another job's shape is refused by name */
  struct store c;
  struct store_opts o = a.opts;
  o.num_workers = 3;
  store_init(&c, &o, fixture_serve, NULL);
  write_snap(io, &a, &r1);
  CHECK(ckpt_load_latest(dir, &c, &info, err, sizeof(err)) == -ENOENT, "3 workers loaded 2's");
  CHECK(strstr(err, "workers") != NULL, "why: %s", err);
  store_deinit(&c);
  store_deinit(&a);
  unlink(r1.path);
  unlink(r2.path);
  unlink(r3.path);
}

/* A store of job `job` (NULL = unnamed) played to clock `to`. */
static void job_store(struct store *s, const char *job, uint64_t to) {
  CHECK(store_fixture_init(s, true) == 0, "fixture");
  s->opts.job_id = job;
  CHECK(store_fixture_run(s, 0, to, false) == 0, "run");
}

static int count_files(void) {
  DIR *d = opendir(dir);
  int n = 0;
  struct dirent *e;
  while (d && (e = readdir(d)))
    if (e->d_name[0] != '.') n++;
  if (d) closedir(d);
  return n;
}

static uint32_t file_crc(const char *path) {
  size_t n = 0;
  unsigned char *b = slurp(path, &n);
  uint32_t c = b ? crc32c_update(0, b, n) : 0;
  free(b);
  return c;
}

/* The case: an earlier job's checkpoints at clocks 10 and 11 (a
 * reused volume); the new job writes 2, 3, 4 and 11. Its own two newest stay
 * (pruning counts only its files), the old job's are untouched, also at the
 * same clock 11, and each job loads only its own. */
static void test_other_job(struct ckpt_io *io) {
  struct store old, cur, probe;
  struct ckpt_write_result o10, o11, r2, r3, r4, r11;
  job_store(&old, "old", 10);
  write_snap(io, &old, &o10);
  store_fixture_run(&old, 10, 11, false);
  write_snap(io, &old, &o11);
  uint32_t c10 = file_crc(o10.path), c11 = file_crc(o11.path);
  job_store(&cur, "new", 2);
  write_snap(io, &cur, &r2);
  store_fixture_run(&cur, 2, 3, false);
  write_snap(io, &cur, &r3);
  store_fixture_run(&cur, 3, 4, false);
  write_snap(io, &cur, &r4);
  CHECK(access(r3.path, F_OK) == 0 && access(r4.path, F_OK) == 0,
        "this job's two newest were deleted (another job's higher clocks counted)");
  CHECK(access(r2.path, F_OK) != 0, "this job's oldest not pruned");
  CHECK(file_crc(o10.path) == c10 && file_crc(o11.path) == c11, "another job's files touched");
  CHECK(ckpt_report_foreign(dir, 0, "new") == 2, "foreign files not reported");
  CHECK(ckpt_report_foreign(dir, 0, "old") == 2, "the new job's not foreign to the old");
  struct ckpt_info info;
  char err[400] = "";
  CHECK(store_fixture_init(&probe, false) == 0, "empty store");
  probe.opts.job_id = "new";
  CHECK(ckpt_load_latest(dir, &probe, &info, err, sizeof(err)) == 0 && info.clock == 4 &&
            strcmp(info.job, "new") == 0,
        "job new loaded clock %llu of job \"%s\": %s", (unsigned long long)info.clock, info.job,
        err);
  store_deinit(&probe);
  CHECK(store_fixture_init(&probe, false) == 0, "empty store");
  CHECK(ckpt_load_latest(dir, &probe, &info, err, sizeof(err)) == -ENOENT && !probe.has_layout,
        "the unnamed job loaded a named job's checkpoint");
  store_deinit(&probe);
  /* the same clock as the old job's newest: two files, neither replaced */
  store_fixture_run(&cur, 4, 11, false);
  write_snap(io, &cur, &r11);
  CHECK(strcmp(r11.path, o11.path) != 0 && file_crc(o11.path) == c11,
        "a checkpoint of another job at the same clock was replaced");
  CHECK(access(r4.path, F_OK) == 0 && access(r3.path, F_OK) != 0, "fallback after clock 11");
  CHECK(store_fixture_init(&probe, false) == 0, "empty store");
  probe.opts.job_id = "old";
  CHECK(ckpt_load_latest(dir, &probe, &info, err, sizeof(err)) == 0 && info.clock == 11 &&
            strcmp(info.path, o11.path) == 0,
        "job old: %s", err);
  store_deinit(&probe);
  /* a rollback of the new job to 4 removes its 11, never the old job's */
  ckpt_remove_after(dir, 0, "new", 4);
  CHECK(access(r11.path, F_OK) != 0 && file_crc(o11.path) == c11, "rollback removal");
  unlink(r4.path);
  unlink(o10.path);
  unlink(o11.path);
  CHECK(count_files() == 0, "%d files left", count_files());
  store_deinit(&old);
  store_deinit(&cur);
}

/* Rewrites a format-2 file as format 1 (no JOB record), as older builds
 * wrote them. */
static void to_format1(const char *path) {
  size_t n = 0;
  unsigned char *b = slurp(path, &n);
  uint64_t jl = le_get64(b + 64 + 32);
  size_t cut = CKPT_RECORD_HEADER_BYTES + (size_t)jl + 4;
  memmove(b + 64, b + 64 + cut, n - 64 - cut);
  n -= cut;
  le_put32(b + 8, 1);
  le_put32(b + 40, le_get32(b + 40) - 1);
  le_put32(b + 60, crc32c_update(0, b, 60));
  unsigned char *f = b + n - CKPT_FOOTER_BYTES;
  le_put64(f + 8, n);
  le_put32(f + 16, crc32c_update(0, b, n - CKPT_FOOTER_BYTES));
  le_put32(f + 20, le_get32(f + 20) - 1);
  spit(path, b, n);
  free(b);
}

static void test_format1(struct ckpt_io *io) {
  struct store a, b;
  struct ckpt_write_result r;
  job_store(&a, NULL, 3);
  write_snap(io, &a, &r);
  to_format1(r.path);
  struct ckpt_info info;
  char err[400] = "";
  CHECK(ckpt_verify(r.path, &info, NULL, err, sizeof(err)) == 0 && info.format_version == 1,
        "format 1 file: %s", err);
  CHECK(store_fixture_init(&b, false) == 0, "empty store");
  CHECK(ckpt_load_latest(dir, &b, &info, err, sizeof(err)) == 0 && info.job[0] == 0,
        "the unnamed job did not load a format 1 file: %s", err);
  CHECK(store_fixture_equal(&a, &b), "format 1 load differs");
  store_deinit(&b);
  CHECK(store_fixture_init(&b, false) == 0, "empty store");
  b.opts.job_id = "named";
  CHECK(ckpt_load_latest(dir, &b, &info, err, sizeof(err)) == -ENOENT, "a named job loaded it");
  CHECK(ckpt_report_foreign(dir, 0, "named") == 1, "format 1 file not reported");
  store_deinit(&b);
  store_deinit(&a);
  unlink(r.path);
}

static void test_checks(void) {
  char err[300], p[1200];
  CHECK(ckpt_job_id_check("run-2024.05 #3", err, sizeof(err)) == 0, "printable refused");
  CHECK(ckpt_job_id_check("a\tb", err, sizeof(err)) < 0, "tab accepted");
  CHECK(ckpt_job_id_check("a\xc3\xa9", err, sizeof(err)) < 0, "non-ASCII accepted");
  CHECK(ckpt_dir_check("", err, sizeof(err)) == 0, "empty = none");
  snprintf(p, sizeof(p), "%s/x/y/z", dir);
  CHECK(ckpt_dir_check(p, err, sizeof(err)) == 0, "nested, creatable: %s", err);
  CHECK(ckpt_dir_create(p, err, sizeof(err)) == 0, "create nested: %s", err);
  CHECK(ckpt_dir_check(p, err, sizeof(err)) == 0, "existing: %s", err);
  snprintf(p, sizeof(p), "%s/file", dir);
  spit(p, (const unsigned char *)"x", 1);
  CHECK(ckpt_dir_check(p, err, sizeof(err)) < 0 && strstr(err, "not a directory"),
        "a file accepted: %s", err);
  snprintf(p, sizeof(p), "%s/file/sub", dir);
  CHECK(ckpt_dir_check(p, err, sizeof(err)) < 0, "under a file accepted");
  snprintf(p, sizeof(p), "%s/file", dir);
  unlink(p);
  snprintf(p, sizeof(p), "%s/x/y/z", dir);
  rmdir(p);
  snprintf(p, sizeof(p), "%s/x/y", dir);
  rmdir(p);
  snprintf(p, sizeof(p), "%s/x", dir);
  rmdir(p);
}

int main(void) {
  log_setup("test_ckpt", LOG_WARN);
  if (!mkdtemp(dir)) return 1;
  test_roundtrip(CKPT_IO_SYNC);
  test_roundtrip(CKPT_IO_URING);
  struct ckpt_io *io;
  if (ckpt_io_open(CKPT_IO_AUTO, &io) < 0) return 1;
  io->max_write = 1000; /* every write short: must not change a byte */
  test_unfinished_step(io);
  test_corruption(io);
  test_lookahead_state(io);
  io->max_write = 0;
  test_fallback_and_pruning(io);
  test_other_job(io);
  test_format1(io);
  test_checks();
  ckpt_io_close(io);
  rmdir(dir);
  if (failures) fprintf(stderr, "%d failure(s)\n", failures);
  return failures ? 1 : 0;
}
