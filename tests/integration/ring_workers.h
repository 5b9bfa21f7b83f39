/* ring_workers: starts W real ps-worker processes in --sync-mode allreduce on
 * 127.0.0.1 for the integration tests. The test binds one listening socket
 * per rank on port 0 and hands rank r only its own (--peer-listen-fd), so
 * tests running in parallel never race for ports; the processes are
 * harness_spawn'ed, so every one is killed when the test exits. */
#ifndef PS_TEST_RING_WORKERS_H
#define PS_TEST_RING_WORKERS_H

#include <stdbool.h>
#include <stdio.h>
#include <sys/types.h>

#define RING_MAX_WORKERS 16

struct ring_workers {
  int world;
  pid_t pid[RING_MAX_WORKERS];
  char log[RING_MAX_WORKERS][512];
};

/* One listening socket per rank on 127.0.0.1:0, for rings formed by test
 * processes or by ps-worker (--peer-listen-fd): no port races. */
struct ring_ports {
  int world;
  int lfd[RING_MAX_WORKERS];
  char addr[RING_MAX_WORKERS][64];
  const char *peers[RING_MAX_WORKERS]; /* = addr, as ps_coll's options want them */
};
void ring_ports_open(struct ring_ports *p, int world);
void ring_ports_close(struct ring_ports *p);

/* One forked child per rank of fresh ring_ports: child r runs fn(ctx, g,
 * r, fd) holding only its own listening socket (g->lfd[r]) and reports what
 * it wants the parent to see on fd; its exit status is fn's return. The
 * parent waits for each up to timeout_ms: status[r] (harness_wait's) and
 * out + r * out_len (what child r wrote, NUL-terminated). */
typedef int (*ring_child_fn)(void *ctx, struct ring_ports *g, int rank, int fd);
void ring_children_run(int world, ring_child_fn fn, void *ctx, int timeout_ms, char *out,
                       size_t out_len, int *status);

/* In a child of ring_children_run: unless cond, writes "rank R line L:
 * <message>" to fd and returns 1 from the calling function. */
#define RING_EXPECT(fd, rank, cond, ...)                  \
  do {                                                    \
    if (!(cond)) {                                        \
      dprintf(fd, "rank %d line %d: ", (rank), __LINE__); \
      dprintf(fd, __VA_ARGS__);                           \
      dprintf(fd, "\n");                                  \
      return 1;                                           \
    }                                                     \
  } while (0)

/* status (harness_wait's) is a normal exit with code. */
bool ring_exited(int status, int code);

/* Starts W workers with the extra args (NULL-terminated, may be NULL); rank
 * 0's stdout goes to out0 (may be NULL). */
void ring_workers_start(struct ring_workers *rw, int world, const char *const *extra,
                        const char *out0);
/* The same with each rank's own extra args: extra[r] (NULL-terminated, may
 * be NULL) for rank r. */
void ring_workers_start_ranks(struct ring_workers *rw, int world, const char *const *const *extra,
                              const char *out0);
/* Waits for every worker up to timeout_ms; returns 0 if all exited 0, else
 * prints which did not (and their logs) and returns 1. */
int ring_workers_wait(struct ring_workers *rw, int timeout_ms);

#endif
