/* --first-worker-timeout (issue 35): the worker timeout counts from the
 * layout, so a shard that no worker ever reaches (the workers' Job failed
 * before the shards' Job restarted it) would wait forever. With the option,
 * such a shard exits 1 (permanent) with an error line saying so.
 *
 * never: a shard with --first-worker-timeout 1 that nobody connects to exits
 * 1 within 30 s (the bound; the timer fires at 1 s), logging "no worker sent
 * a layout within --first-worker-timeout".
 *
 * in time: a shard with --first-worker-timeout 2 that a worker reaches at
 * once trains as usual: rank 0 pushes and pulls a step, then stays idle past
 * the timeout (the shard must still serve it: a layout disarmed the timer),
 * pulls again, ends the training, and the shard exits 0 with no such line.
 *
 * checkpoint: a shard restarted with its checkpoint directory holds the
 * layout it loaded: --first-worker-timeout 1 does not apply to it (its
 * workers' absence is --worker-timeout's business); still running 1.5 s
 * after it listens, SIGTERM exits 0.
 *
 * default: without the option (0 = forever) the untouched shard is still
 * running after the 1 s the first part needed; SIGTERM stops it with 0. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "ps.h"

#define N 1000
#define LINE "no worker sent a layout within --first-worker-timeout"

/* The job's one worker on shard s, its tensor "w" of N floats declared. */
static ps_client *connect_worker(const struct test_server *s) {
  const char *addrs[1] = {s->addr};
  static const char *names[] = {"w"};
  static const uint64_t counts[] = {N};
  struct ps_client_opts o = {
      .servers = addrs, .num_servers = 1, .rank = 0, .world_size = 1, .chunk_bytes = 4096};
  ps_client *c;
  char err[256];
  REQUIRE(ps_client_new(&o, &c, err, sizeof(err)) == PS_OK, "connect: %s", err);
  REQUIRE(ps_declare(c, 1, names, counts) == PS_OK, "declare");
  return c;
}

static void never(void) {
  struct test_server s;
  const char *extra[] = {"--first-worker-timeout", "1", NULL};
  harness_start_server(&s, 0, 1, 2, 0.5, extra);
  int st = harness_wait(s.pid, 30000);
  REQUIRE(st != -1, "the shard no worker reached is still running after 30 s");
  REQUIRE(WIFEXITED(st) && WEXITSTATUS(st) == 1, "exit status %d, expected exit 1", st);
  REQUIRE(harness_grep(s.log, LINE) == 1, "no line \"%s\" in %s", LINE, s.log);
  REQUIRE(harness_grep(s.log, "timeout_s=1.0") == 1, "the line does not name the timeout");
  printf("never: exit 1 with \"%s\"\n", LINE);
}

static void in_time(void) {
  struct test_server s;
  const char *extra[] = {"--first-worker-timeout", "2", NULL};
  harness_start_server(&s, 0, 1, 1, 1.0, extra);
  ps_client *c = connect_worker(&s);
  static float g[N], v[N];
  for (int i = 0; i < N; i++) g[i] = 1.0f;
  uint64_t version;
  REQUIRE(ps_init(c, 0, v) == PS_OK, "init to 0");
  REQUIRE(ps_push(c, 0, 0, g) == PS_OK, "push step 0");
  REQUIRE(ps_pull(c, 0, 1, v, &version) == PS_OK && version == 1, "pull version 1");
  /* idle past the timeout: the armed timer must find the layout and let be */
  usleep(2500 * 1000);
  REQUIRE(harness_wait(s.pid, 0) == -1, "the shard exited although a layout came in time");
  REQUIRE(ps_push(c, 0, 1, g) == PS_OK, "push step 1");
  REQUIRE(ps_pull(c, 0, 2, v, &version) == PS_OK && version == 2, "pull version 2");
  REQUIRE(v[0] == -2.0f, "w[0] = %g after two steps of lr 1, expected -2", v[0]);
  REQUIRE(ps_shutdown_servers(c) == PS_OK, "shutdown");
  ps_client_free(c);
  int st = harness_wait(s.pid, 30000);
  REQUIRE(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "exit status %d, expected 0", st);
  REQUIRE(harness_grep(s.log, LINE) == 0, "\"%s\" although a layout came in time", LINE);
  printf("in time: trained, exit 0\n");
}

static void checkpoint(void) {
  char dir[600];
  snprintf(dir, sizeof(dir), "%s/ckpt", harness_dir());
  const char *first[] = {"--checkpoint-dir", dir, NULL};
  struct test_server s;
  harness_start_server(&s, 0, 1, 1, 1.0, first);
  static float v[N];
  ps_client *c = connect_worker(&s);
  REQUIRE(ps_init(c, 0, v) == PS_OK, "init to 0");
  ps_client_free(c);
  int st = harness_stop(s.pid, SIGTERM, 30000);
  REQUIRE(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "first shard: status %d", st);
  const char *again[] = {"--checkpoint-dir", dir, "--first-worker-timeout", "1", NULL};
  harness_start_server(&s, 0, 1, 1, 1.0, again);
  usleep(1500 * 1000);
  REQUIRE(harness_wait(s.pid, 0) == -1, "the shard that loaded a layout exited");
  st = harness_stop(s.pid, SIGTERM, 30000);
  REQUIRE(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "SIGTERM: status %d", st);
  REQUIRE(harness_grep(s.log, LINE) == 0, "\"%s\" after a checkpoint's layout", LINE);
  printf("checkpoint: the loaded layout counts, SIGTERM exits 0\n");
}

static void by_default(void) {
  struct test_server s;
  harness_start_server(&s, 0, 1, 2, 0.5, NULL);
  usleep(1500 * 1000);
  REQUIRE(harness_wait(s.pid, 0) == -1, "the shard exited without --first-worker-timeout");
  int st = harness_stop(s.pid, SIGTERM, 30000);
  REQUIRE(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0, "SIGTERM: status %d", st);
  REQUIRE(harness_grep(s.log, LINE) == 0, "\"%s\" without the option", LINE);
  printf("default: waits, SIGTERM exits 0\n");
}

int main(void) {
  never();
  in_time();
  checkpoint();
  by_default();
  return harness_status();
}
