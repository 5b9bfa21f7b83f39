/* A shard of a 3D job in ps mode killed (kill -9) and restarted from its
 * checkpoint while the workers run (issue 32, Deliver 7; issue 30's
 * all-or-nothing rollback): two shards (SGD, --checkpoint-every 10) and
 * four ps-worker processes, t=2 p=2 d=1, every (stage, slice) its own keys
 * with owners.
 * - Uninterrupted: STEPS steps against fresh shards; rank 0 dumps the model.
 * - Faulted: once shard 0 wrote a checkpoint of clock >= 20, it gets kill -9
 *   and is started again on its address from its checkpoint directory. The
 *   restarted shard is behind the job: a worker's request fails with
 *   PS_ERR_ROLLBACK. A pipeline cannot be rolled back in place (its stages
 *   are mid-step, on other steps' activations), so the worker takes every
 *   shard back to the checkpoint's clock (ps_rollback: all or nothing), says
 *   so and exits 129; the others exit 129 too (the rollback, or the lost
 *   rank). All four start again with the same command, resume at that
 *   clock (the shards' step) and finish; the dump equals the uninterrupted
 *   run's bit for bit. */
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "clock.h"
#include "harness.h"
#include "ring_workers.h"

#define STEPS "400"

static void start(struct ring_workers *rw, const char *servers, const char *dump) {
  const char *args[] = {"--sync-mode",
                        "ps",
                        "--servers",
                        servers,
                        "--epochs",
                        "1",
                        "--max-steps",
                        STEPS,
                        "--seed",
                        "7",
                        "--batch-size",
                        "32",
                        "--model",
                        "mlp:784-64-10",
                        "--tensor-parallel",
                        "2",
                        "--pipeline-stages",
                        "2",
                        "--micro-batches",
                        "4",
                        "--log-every",
                        "10",
                        "--peer-timeout-ms",
                        "1500",
                        "--dump-params",
                        dump,
                        NULL};
  ring_workers_start(rw, 4, args, NULL);
}

static void shard(struct test_server *s, int i, const char *dir, const char *listen) {
  const char *sargs[] = {"--optimizer",
                         "sgd",
                         "--checkpoint-dir",
                         dir,
                         "--checkpoint-every",
                         "10",
                         listen ? "--listen" : NULL,
                         listen,
                         NULL};
  harness_start_server(s, i, 2, 4, 0.1, sargs);
}

static bool same_file(const char *a, const char *b) {
  FILE *f = fopen(a, "rb"), *g = fopen(b, "rb");
  REQUIRE(f && g, "missing dump %s or %s", a, b);
  bool same = true;
  size_t bytes = 0;
  for (int x, y; same;) {
    x = fgetc(f);
    y = fgetc(g);
    same = x == y;
    if (x == EOF) break;
    bytes++;
  }
  fclose(f);
  fclose(g);
  REQUIRE(bytes > 0, "empty dump %s", a);
  return same;
}

/* The newest clock of the checkpoints the shard logging to file wrote, or
 * -1 if none. */
static long newest_checkpoint(const char *file) {
  FILE *f = fopen(file, "r");
  long newest = -1;
  char line[4096];
  while (f && fgets(line, sizeof(line), f)) {
    const char *at = strstr(line, "msg=\"checkpoint written\"");
    const char *clock = at ? strstr(at, " clock=") : NULL;
    if (clock && atol(clock + 7) > newest) newest = atol(clock + 7);
  }
  if (f) fclose(f);
  return newest;
}

/* The step of the "resumed at the shards' step" line of log, or -1. */
static long resumed_at(const char *log) {
  FILE *f = fopen(log, "r");
  char line[4096];
  long step = -1;
  while (f && fgets(line, sizeof(line), f)) {
    const char *s = strstr(line, "resumed at the shards' step");
    if (s && (s = strstr(s, "step="))) step = strtol(s + 5, NULL, 10);
  }
  if (f) fclose(f);
  return step;
}

int main(void) {
  harness_require_dataset();
  char ref[600], got[600], servers[160], dir[2][600];
  snprintf(ref, sizeof(ref), "%s/uninterrupted.bin", harness_dir());
  snprintf(got, sizeof(got), "%s/resumed.bin", harness_dir());
  struct test_server s[2];
  struct ring_workers rw;
  for (int i = 0; i < 2; i++) {
    snprintf(dir[i], sizeof(dir[i]), "%s/ref-shard-%d", harness_dir(), i);
    shard(&s[i], i, dir[i], NULL);
  }
  snprintf(servers, sizeof(servers), "%s,%s", s[0].addr, s[1].addr);
  start(&rw, servers, ref);
  REQUIRE(ring_workers_wait(&rw, 60000) == 0, "the uninterrupted run failed");
  for (int i = 0; i < 2; i++) harness_stop(s[i].pid, SIGTERM, 10000);

  for (int i = 0; i < 2; i++) {
    snprintf(dir[i], sizeof(dir[i]), "%s/shard-%d", harness_dir(), i);
    shard(&s[i], i, dir[i], NULL);
  }
  snprintf(servers, sizeof(servers), "%s,%s", s[0].addr, s[1].addr);
  start(&rw, servers, got);
  double t0 = clock_now_s();
  while (newest_checkpoint(s[0].log) < 20) {
    REQUIRE(clock_now_s() - t0 < 60, "shard 0 wrote no checkpoint of clock >= 20 within 60 s");
    clock_sleep_ms(5);
  }
  long ck = newest_checkpoint(s[0].log);
  char addr[64];
  snprintf(addr, sizeof(addr), "%s", s[0].addr);
  harness_stop(s[0].pid, SIGKILL, 5000);
  shard(&s[0], 0, dir[0], addr);
  REQUIRE(harness_grep(s[0].log, "checkpoint loaded") == 1, "the restarted shard loaded nothing");
  for (int r = 0; r < 4; r++) {
    int st = harness_wait(rw.pid[r], 30000);
    if (ring_exited(st, 0)) {
      harness_skip("rank %d finished before the shard's kill took effect", r);
      return harness_status();
    }
    REQUIRE(ring_exited(st, 129), "rank %d should exit 129 after the shard's rollback, got 0x%x", r,
            st);
  }
  int said = 0;
  for (int r = 0; r < 4; r++) said += harness_grep(rw.log[r], "rolled the shards back") > 0;
  REQUIRE(said > 0, "no rank says it rolled the shards back");

  start(&rw, servers, got);
  REQUIRE(ring_workers_wait(&rw, 60000) == 0, "the restarted job failed");
  long at = resumed_at(rw.log[0]);
  for (int r = 1; r < 4; r++)
    REQUIRE(resumed_at(rw.log[r]) == at, "rank %d resumed at %ld, rank 0 at %ld", r,
            resumed_at(rw.log[r]), at);
  bool same = same_file(got, ref);
  printf(
      "kill -9 shard 0 after its checkpoint of clock %ld, restart it: %d ranks rolled the "
      "shards back and exited 129; restarted, all 4 resumed at step %ld; final parameters %s "
      "the uninterrupted run's\n",
      ck, said, at, same ? "equal" : "DIFFER from");
  REQUIRE(same, "the parameters differ from the uninterrupted run's");
  for (int i = 0; i < 2; i++) harness_stop(s[i].pid, SIGTERM, 10000);
  return harness_status();
}
