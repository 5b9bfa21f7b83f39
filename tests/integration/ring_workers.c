/* ring_workers: see ring_workers.h. */
#include "ring_workers.h"

#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "harness.h"
#include "net.h"

void ring_ports_open(struct ring_ports *p, int world) {
  REQUIRE(world >= 1 && world <= RING_MAX_WORKERS, "bad world size %d", world);
  p->world = world;
  for (int r = 0; r < world; r++) {
    struct net_addr a = {.host = "127.0.0.1", .port = 0};
    char err[256];
    p->lfd[r] = net_listen(&a, 64, err, sizeof(err));
    REQUIRE(p->lfd[r] > 2, "%s", err);
    snprintf(p->addr[r], sizeof(p->addr[r]), "127.0.0.1:%d", net_bound_port(p->lfd[r]));
    p->peers[r] = p->addr[r];
  }
}

void ring_ports_close(struct ring_ports *p) {
  for (int r = 0; r < p->world; r++) close(p->lfd[r]);
}

struct ring_child {
  ring_child_fn fn;
  void *ctx;
  struct ring_ports *g;
  int rank, fd;
};

static int ring_child_main(void *p) {
  struct ring_child *a = p;
  for (int q = 0; q < a->g->world; q++)
    if (q != a->rank) close(a->g->lfd[q]);
  return a->fn(a->ctx, a->g, a->rank, a->fd);
}

void ring_children_run(int world, ring_child_fn fn, void *ctx, int timeout_ms, char *out,
                       size_t out_len, int *status) {
  struct ring_ports g;
  ring_ports_open(&g, world);
  pid_t pid[RING_MAX_WORKERS];
  int rfd[RING_MAX_WORKERS];
  struct ring_child args[RING_MAX_WORKERS];
  for (int r = 0; r < world; r++) {
    int pfd[2];
    REQUIRE(pipe(pfd) == 0, "pipe");
    args[r] = (struct ring_child){.fn = fn, .ctx = ctx, .g = &g, .rank = r, .fd = pfd[1]};
    pid[r] = harness_fork(ring_child_main, &args[r]);
    close(pfd[1]);
    rfd[r] = pfd[0];
  }
  ring_ports_close(&g);
  for (int r = 0; r < world; r++) {
    status[r] = harness_wait(pid[r], timeout_ms);
    /* a rank still running is killed (its status stays -1: hung), or the
     * read below would wait for ever on the pipe it holds open */
    if (status[r] < 0) harness_stop(pid[r], SIGKILL, 5000);
    ssize_t n = read(rfd[r], out + (size_t)r * out_len, out_len - 1);
    out[(size_t)r * out_len + (size_t)(n > 0 ? n : 0)] = 0;
    close(rfd[r]);
  }
}

void ring_workers_start(struct ring_workers *rw, int world, const char *const *extra,
                        const char *out0) {
  const char *const *each[RING_MAX_WORKERS];
  for (int r = 0; r < RING_MAX_WORKERS; r++) each[r] = extra;
  ring_workers_start_ranks(rw, world, each, out0);
}

void ring_workers_start_ranks(struct ring_workers *rw, int world, const char *const *const *extra,
                              const char *out0) {
  REQUIRE(world >= 1 && world <= RING_MAX_WORKERS, "bad world size %d", world);
  memset(rw, 0, sizeof(*rw));
  rw->world = world;
  struct ring_ports ports;
  ring_ports_open(&ports, world);
  int *lfd = ports.lfd;
  char peers[RING_MAX_WORKERS * 24] = "";
  for (int r = 0; r < world; r++)
    snprintf(peers + strlen(peers), sizeof(peers) - strlen(peers), "%s%s", r ? "," : "",
             ports.addr[r]);
  static int seq;
  seq++;
  char bin[512], ws[16], rank[16], fd[16];
  harness_bin("ps-worker/ps-worker", bin, sizeof(bin));
  snprintf(ws, sizeof(ws), "%d", world);
  for (int r = 0; r < world; r++) {
    /* Only rank r's socket survives its exec. */
    for (int q = 0; q < world; q++) fcntl(lfd[q], F_SETFD, q == r ? 0 : FD_CLOEXEC);
    snprintf(rank, sizeof(rank), "%d", r);
    snprintf(fd, sizeof(fd), "%d", lfd[r]);
    const char *argv[80] = {bin,  "--sync-mode", "allreduce", "--world-size",     ws, "--rank",
                            rank, "--peers",     peers,       "--peer-listen-fd", fd};
    int n = 11;
    for (int i = 0; extra[r] && extra[r][i] && n < 78; i++) argv[n++] = extra[r][i];
    argv[n] = NULL;
    snprintf(rw->log[r], sizeof(rw->log[r]), "%s/ring%d-worker-%d.log", harness_dir(), seq, r);
    rw->pid[r] = harness_spawn(argv, r == 0 ? out0 : NULL, rw->log[r]);
  }
  ring_ports_close(&ports);
}

int ring_workers_wait(struct ring_workers *rw, int timeout_ms) {
  int failed = 0;
  for (int r = 0; r < rw->world; r++) {
    int st = harness_wait(rw->pid[r], timeout_ms);
    if (st < 0 || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
      fprintf(stderr, "allreduce worker %d failed (status %d)\n", r, st);
      failed = 1;
    }
  }
  if (failed) harness_dump_logs();
  return failed;
}

bool ring_exited(int status, int code) {
  return status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == code;
}
