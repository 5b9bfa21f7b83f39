/* test_hostile: hostile clients against a training job (issue 8, item 5).
 *
 * Two shards (S=2) with a token and short deadlines (--handshake-timeout 2,
 * --frame-timeout 2, --idle-timeout 2) and two ps-worker processes (W=2, BSP, SGD) train STEPS
 * steps twice: once clean, once while one ps-hostile per shard sends it mutated frames on many
 * connections for ATTACK_SECONDS, before and after authenticating (shard i's attacker holds the
 * token and claims rank i, a rank its worker uses), and holds slowloris and idle connections. Then:
 *   - neither shard crashed: both serve until the training ends and exit 0;
 *   - every bad frame was rejected and counted: ps-hostile saw no frame
 *     accepted, no unexpected refusal, no connection left open, and its
 *     error frames by code equal the shard's ps_server_errors_total{kind}
 *     (kind "limit" also counts the connections the shard dropped at its
 *     deadlines, which ps-hostile saw close without a reply), and its
 *     totals equal the stop line's rejected_frames, auth_failures,
 *     rejected_nonfinite and dropped_connections;
 *   - every slowloris and idle connection was dropped, by the deadline
 *     that applies to it (the reason in the shard's log);
 *   - each shard's peak RSS (VmHWM, read after the attack) stays under
 *     RSS_CAP_MB: the job's parameters are 0.8 MB and one connection costs
 *     the shard at most ~1.2 MB (64 KiB read buffer, 256 KiB decode arena,
 *     64 KiB header buffer, a scratch buffer of the largest key, 0.8 MB), so
 *     ~60 attacker connections fit in ~80 MB (~22 MB measured); 200 MB
 *     leaves margin without hiding growth with the number of frames. Under
 *     AddressSanitizer (shadow memory, quarantine) it is RSS_CAP_ASAN_MB;
 *   - the attacked run's final parameters (rank 0's --dump-params) are
 *     byte-identical to the clean run's: BSP with W=2 is deterministic.
 * The attack must end before the training does (the counts are compared
 * while the shards still serve); the test says so if it did not.
 *
 * Not here: ps-hostile --reply-flood (requests whose replies are never
 * read). It took a shard to ~2 GB until queued replies were counted by the
 * memory they hold; that bound is test_limits' case now. Here, on two
 * cores, the flood starves the attacker's own other probes (15 frames
 * instead of >1,000 in a trial), so the counts above would mean nothing;
 * tools/bench/bench-hostile measures it on its own. */
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "scrape.h"
#include "wire.h"

#define S 2
#define W 2
#define STEPS "--max-steps=6000" /* batch 4: within one epoch, and outlasts the attack */
#define BATCH "--batch-size=4"
#define ATTACK_SECONDS "--seconds=3"
#define RSS_CAP_MB 200
#define RSS_CAP_ASAN_MB 1024

#define NUM_KINDS 32
#define LINE_BYTES 4096 /* a log line, whole */

/* What one run leaves behind. */
struct run {
  double seconds;      /* start of the workers to their end */
  long peak_rss_kb[S]; /* attacked runs: after the attack */
  uint64_t frames, conns, silent, rejected;
  char stop_line[S][LINE_BYTES];
};

/* The value of " name=" in line (the first field may follow "hostile "). */
static double field(const char *line, const char *name) {
  char key[96];
  snprintf(key, sizeof(key), " %s=", name);
  const char *p = strstr(line, key);
  REQUIRE(p, "no %s in \"%s\"", name, line);
  return strtod(p + strlen(key), NULL);
}

/* errors_by_code=kind:n,... of a ps-hostile line. */
static double errors_of(const char *line, const char *kind) {
  const char *p = strstr(line, " errors_by_code=");
  REQUIRE(p, "no errors_by_code in \"%s\"", line);
  p += strlen(" errors_by_code=");
  size_t klen = strlen(kind);
  while (*p && *p != ' ' && *p != '\n') {
    if (strncmp(p, kind, klen) == 0 && p[klen] == ':') return strtod(p + klen + 1, NULL);
    p += strcspn(p, ", \n");
    if (*p == ',') p++;
  }
  return 0;
}

/* The metric label of an error code: ERR_BAD_FRAME -> bad_frame. */
static const char *kind_name(size_t i, char *buf, size_t len) {
  const char *s = ps__error_code__descriptor.values[i].name;
  if (strncmp(s, "ERR_", 4) == 0) s += 4;
  size_t j = 0;
  for (; s[j] && j + 1 < len; j++) buf[j] = (char)(s[j] >= 'A' && s[j] <= 'Z' ? s[j] + 32 : s[j]);
  buf[j] = 0;
  return buf;
}

/* Whether the shard counts a refusal of this kind as a rejected frame: the
 * refusals that keep the connection (a non-finite value, a push before INIT)
 * are counted apart. */
static bool rejects_frame(const char *kind) {
  return strcmp(kind, "nonfinite") != 0 && strcmp(kind, "not_initialised") != 0;
}

static long vm_hwm_kb(pid_t pid) {
  char path[64], line[256];
  snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
  FILE *f = fopen(path, "r");
  long kb = -1;
  while (f && fgets(line, sizeof(line), f))
    if (strncmp(line, "VmHWM:", 6) == 0) kb = atol(line + 6);
  if (f) fclose(f);
  return kb;
}

/* The last line of path holding needle, into out (LINE_BYTES, as long as
 * the lines read: a stop line is never cut short of the counters it ends
 * with). */
static void read_line(const char *path, const char *needle, char out[LINE_BYTES]) {
  FILE *f = fopen(path, "r");
  char line[LINE_BYTES];
  out[0] = 0;
  while (f && fgets(line, sizeof(line), f))
    if (strstr(line, needle)) memcpy(out, line, strlen(line) + 1);
  if (f) fclose(f);
}

static double metric(const char *text, const char *series) {
  double v = scrape_value(text, series);
  return v < 0 ? 0 : v;
}

/* Both attackers are done; every count of theirs must match shard i's. */
static void check_counts(int i, const char *hline, const char *metrics, const char *log,
                         struct run *r) {
  REQUIRE(field(hline, "accepted") == 0, "shard %d accepted mutated frames: %s", i, hline);
  REQUIRE(field(hline, "stuck") == 0, "shard %d left connections open: %s", i, hline);
  REQUIRE(field(hline, "unexpected") == 0, "shard %d refused with unexpected codes: %s", i, hline);
  REQUIRE(field(hline, "closed") == 0, "shard %d closed without an error frame: %s", i, hline);
  /* a handshake of the attacker's own that a loaded shard (ASan) did not
   * finish by its deadline is dropped, as it should be: a few */
  REQUIRE(field(hline, "setup_failures") <= field(hline, "connections") / 50 + 1,
          "ps-hostile could not set up: %s", hline);
  REQUIRE(field(hline, "bad_reply_tags") == 0, "shard %d sent replies with bad tags: %s", i, hline);
  REQUIRE(field(hline, "frames") >= 100, "too few frames to mean anything: %s", hline);
  REQUIRE(field(hline, "keys") >= 1 && errors_of(hline, "nonfinite") >= 1,
          "no key found for NaN pushes: %s", hline);
  /* each held connection was dropped (the event ps-hostile waits for, up to
   * its --drain-seconds) and by the deadline that applies to it: the
   * shard's log names the reason of each drop */
  static const struct {
    const char *name, *reason;
  } held[] = {{"slowloris", "handshake not finished within --handshake-timeout"},
              {"auth_slowloris", "frame not completed within --frame-timeout"},
              {"idle", "handshake not finished within --handshake-timeout"},
              {"auth_idle", "idle for longer than --idle-timeout"}};
  for (size_t h = 0; h < sizeof(held) / sizeof(held[0]); h++) {
    char n[64], d[64];
    snprintf(n, sizeof(n), "%s", held[h].name);
    snprintf(d, sizeof(d), "%s_dropped", held[h].name);
    REQUIRE(field(hline, n) >= 1 && field(hline, d) == field(hline, n),
            "shard %d: not every %s connection was dropped: %s", i, held[h].name, hline);
    double want = 0; /* the held kinds that share this reason */
    for (size_t k = 0; k < sizeof(held) / sizeof(held[0]); k++)
      if (!strcmp(held[k].reason, held[h].reason)) want += field(hline, held[k].name);
    REQUIRE(harness_grep(log, held[h].reason) >= want,
            "shard %d: %d drops saying \"%s\", fewer than the %.0f %s-like connections held", i,
            harness_grep(log, held[h].reason), held[h].reason, want, held[h].name);
  }
  double silent = field(hline, "silent_closes"), rejected = 0;
  for (size_t k = 0; k < ps__error_code__descriptor.n_values; k++) {
    char kind[48], series[128];
    kind_name(k, kind, sizeof(kind));
    if (strcmp(kind, "none") == 0) continue;
    snprintf(series, sizeof(series), "ps_server_errors_total{kind=\"%s\"}", kind);
    double want = errors_of(hline, kind) + (strcmp(kind, "limit") == 0 ? silent : 0);
    REQUIRE(metric(metrics, series) == want, "shard %d counted %.0f %s errors, ps-hostile saw %.0f",
            i, metric(metrics, series), kind, want);
    if (rejects_frame(kind)) rejected += errors_of(hline, kind);
  }
  REQUIRE(metric(metrics, "ps_server_errors_total{kind=\"other\"}") == 0, "shard %d: other errors",
          i);
  REQUIRE(metric(metrics, "ps_server_rejected_frames_total") == rejected,
          "shard %d: %.0f rejected frames, ps-hostile got %.0f refusals", i,
          metric(metrics, "ps_server_rejected_frames_total"), rejected);
  r->frames += (uint64_t)field(hline, "frames");
  r->conns += (uint64_t)field(hline, "connections");
  r->silent += (uint64_t)silent;
  r->rejected += (uint64_t)field(hline, "rejected");
}

/* Starts S shards and W workers (rank 0 dumps its parameters to dump);
 * attacked: one ps-hostile per shard once the layout is registered. */
static void run_job(bool attacked, const char *token, const char *dump, struct run *r) {
  const char *server_args[] = {"--auth-token-file",     token,
                               "--handshake-timeout=2", "--frame-timeout=2",
                               "--idle-timeout=2",      NULL};
  struct test_server srv[S];
  char servers[256] = "", http[S][64];
  for (int i = 0; i < S; i++) {
    harness_start_server(&srv[i], i, S, W, 0.1, server_args);
    REQUIRE(scrape_http_addr(srv[i].log, http[i], sizeof(http[i]), 5000) == 0, "no http address");
    snprintf(servers + strlen(servers), sizeof(servers) - strlen(servers), "%s%s", i ? "," : "",
             srv[i].addr);
  }
  char bin[512], rank[W][8], log[W][512];
  harness_bin("ps-worker/ps-worker", bin, sizeof(bin));
  pid_t workers[W];
  double t0 = clock_now_s();
  for (int w = 0; w < W; w++) {
    snprintf(rank[w], sizeof(rank[w]), "%d", w);
    snprintf(log[w], sizeof(log[w]), "%s/%s-worker-%d.log", harness_dir(),
             attacked ? "attacked" : "clean", w);
    const char *dump_to = w == 0 ? dump : ""; /* rank 0 dumps its parameters */
    const char *argv[] = {bin,
                          "--servers",
                          servers,
                          "--rank",
                          rank[w],
                          "--auth-token-file",
                          token,
                          "--dump-params",
                          dump_to,
                          "--world-size=2",
                          "--epochs=1",
                          BATCH,
                          STEPS,
                          "--seed=11",
                          "--log-every=1000",
                          NULL};
    workers[w] = harness_spawn(argv, NULL, log[w]);
  }
  char hout[S][512], hlog[S][512];
  static char text[1 << 18];
  if (attacked) {
    /* key discovery needs the layout: wait until both shards hold keys */
    for (int i = 0; i < S; i++) {
      double deadline = clock_now_s() + 30;
      while (scrape_get(http[i], "/metrics", text, sizeof(text)) != 200 ||
             metric(text, "ps_server_keys") < 1) {
        REQUIRE(clock_now_s() < deadline, "shard %d never got the layout", i);
        clock_sleep_ms(20);
      }
    }
    char hbin[512];
    harness_bin("tools/ps-hostile", hbin, sizeof(hbin));
    pid_t hostile[S];
    char hrank[S][8];
    for (int i = 0; i < S; i++) {
      char seed[16];
      snprintf(hrank[i], sizeof(hrank[i]), "%d", i);
      snprintf(seed, sizeof(seed), "%d", 100 + i);
      snprintf(hout[i], sizeof(hout[i]), "%s/hostile-%d.out", harness_dir(), i);
      snprintf(hlog[i], sizeof(hlog[i]), "%s/hostile-%d.log", harness_dir(), i);
      const char *argv[] = {hbin,
                            "--server",
                            srv[i].addr,
                            "--auth-token-file",
                            token,
                            "--rank",
                            hrank[i],
                            "--seed",
                            seed,
                            "--world-size=2",
                            "--connections=24",
                            "--threads=4",
                            "--frames=100000",
                            ATTACK_SECONDS,
                            "--drain-seconds=20", /* 10x the 2 s deadlines */
                            "--slowloris=4",
                            "--idle=4",
                            NULL};
      hostile[i] = harness_spawn(argv, hout[i], hlog[i]);
    }
    for (int i = 0; i < S; i++) {
      int st = harness_wait(hostile[i], 60000);
      REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "ps-hostile %d: status %d", i, st);
    }
    for (int w = 0; w < W; w++) {
      int st;
      REQUIRE(waitpid(workers[w], &st, WNOHANG) == 0,
              "worker %d finished before the attack did: raise STEPS (the counts are compared "
              "while the shards serve)",
              w);
    }
    for (int i = 0; i < S; i++) {
      int st;
      REQUIRE(waitpid(srv[i].pid, &st, WNOHANG) == 0, "shard %d died during the attack (status %d)",
              i, st);
      r->peak_rss_kb[i] = vm_hwm_kb(srv[i].pid);
      REQUIRE(scrape_get(http[i], "/metrics", text, sizeof(text)) == 200, "GET /metrics");
      char hline[LINE_BYTES];
      read_line(hout[i], "hostile frames=", hline);
      REQUIRE(hline[0], "no summary from ps-hostile %d", i);
      check_counts(i, hline, text, srv[i].log, r);
    }
  }
  for (int w = 0; w < W; w++) {
    int st = harness_wait(workers[w], 120000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "%s worker %d: status %d",
            attacked ? "attacked" : "clean", w, st);
  }
  r->seconds = clock_now_s() - t0;
  for (int i = 0; i < S; i++) {
    int st = harness_wait(srv[i].pid, 15000);
    REQUIRE(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "shard %d: status %d", i, st);
    read_line(srv[i].log, "msg=\"stopping\"", r->stop_line[i]);
    REQUIRE(r->stop_line[i][0], "shard %d logged no stop line", i);
    REQUIRE(field(r->stop_line[i], "refused_connections") == 0, "refused: %s", r->stop_line[i]);
    if (!attacked) {
      REQUIRE(field(r->stop_line[i], "rejected_frames") == 0 &&
                  field(r->stop_line[i], "dropped_connections") == 0 &&
                  field(r->stop_line[i], "rejected_nonfinite") == 0,
              "the clean run had errors: %s", r->stop_line[i]);
      continue;
    }
    char hline[LINE_BYTES];
    read_line(hout[i], "hostile frames=", hline);
    double silent = field(hline, "silent_closes"), rejected = 0;
    for (size_t k = 0; k < ps__error_code__descriptor.n_values; k++) {
      char kind[48];
      kind_name(k, kind, sizeof(kind));
      if (rejects_frame(kind)) rejected += errors_of(hline, kind);
    }
    REQUIRE(field(r->stop_line[i], "rejected_frames") == rejected &&
                field(r->stop_line[i], "auth_failures") == errors_of(hline, "auth") &&
                field(r->stop_line[i], "rejected_nonfinite") == errors_of(hline, "nonfinite") &&
                field(r->stop_line[i], "dropped_connections") == silent,
            "shard %d's stop line differs from what ps-hostile saw:\n%s%s", i, r->stop_line[i],
            hline);
  }
}

static size_t read_all(const char *path, char **out) {
  FILE *f = fopen(path, "rb");
  REQUIRE(f, "no parameter dump %s", path);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  *out = malloc((size_t)n + 1);
  REQUIRE(*out && fread(*out, 1, (size_t)n, f) == (size_t)n, "read %s", path);
  fclose(f);
  return (size_t)n;
}

int main(void) {
  harness_require_dataset();
  char token[512], clean[512], attacked[512];
  harness_token_file("token", token, sizeof(token));
  snprintf(clean, sizeof(clean), "%s/clean.bin", harness_dir());
  snprintf(attacked, sizeof(attacked), "%s/attacked.bin", harness_dir());

  static struct run rc, ra;
  run_job(false, token, clean, &rc);
  run_job(true, token, attacked, &ra);

  char *a, *b;
  size_t na = read_all(clean, &a), nb = read_all(attacked, &b);
  REQUIRE(na == nb && na > 0 && memcmp(a, b, na) == 0,
          "the attacked run's parameters differ from the clean run's (%zu vs %zu bytes)", na, nb);
  free(a);
  free(b);
  long cap_kb = (long)(HARNESS_UNDER_ASAN ? RSS_CAP_ASAN_MB : RSS_CAP_MB) * 1024;
  for (int i = 0; i < S; i++)
    REQUIRE(ra.peak_rss_kb[i] > 0 && ra.peak_rss_kb[i] <= cap_kb,
            "shard %d peaked at %ld kB, above the %ld kB cap", i, ra.peak_rss_kb[i], cap_kb);
  printf(
      "hostile: %llu mutated frames on %llu connections, %llu rejected with an error frame, "
      "%llu connections dropped at deadlines; shard peak RSS %.1f / %.1f MB (cap %d); "
      "parameters identical to the clean run (%.1f s clean, %.1f s attacked)\n",
      (unsigned long long)ra.frames, (unsigned long long)ra.conns, (unsigned long long)ra.rejected,
      (unsigned long long)ra.silent, ra.peak_rss_kb[0] / 1024.0, ra.peak_rss_kb[1] / 1024.0,
      HARNESS_UNDER_ASAN ? RSS_CAP_ASAN_MB : RSS_CAP_MB, rc.seconds, ra.seconds);
  return 0;
}
