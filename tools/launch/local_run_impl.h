/* local_run_impl: what local_run.c and local_watch.c share (internal to
 * ps-local): the run's state (struct launcher, one struct child per
 * process) and its time limits. local_run.c owns the lifecycle and every
 * field; local_watch.c decides, once a worker finished, which of the others
 * can never finish (local_watch) and has local_run.c stop the job. */
#ifndef PS_LOCAL_RUN_IMPL_H
#define PS_LOCAL_RUN_IMPL_H

#include <stdbool.h>
#include <stdint.h>

#include "local_run.h"
#include "procs.h"

enum {
  PATH_BYTES = LOCAL_PATH_BYTES,
  DIR_BYTES = 1024,         /* our directory; room is left for the file names below it */
  START_TIMEOUT_MS = 15000, /* every shard must write its port file by then */
  SHARD_GRACE_MS = 10000,   /* shards exit by themselves after the workers */
  COMMAND_GRACE_MS = 2000,  /* the same after a command, which may not have stopped them */
  SHARD_TERM_MS = 5000,     /* then SIGTERM, then SIGKILL after this */
  STOP_KILL_MS = 3000,      /* after a failure or signal: SIGTERM, then SIGKILL */
  /* Once a worker exited 0 (watch_finished): a worker stopped this long
   * can never finish (no tool stops a process that long in passing; well
   * under the shards' 60 s --worker-timeout) ... */
  STOPPED_MS = 5000,
  /* ... nor can one still running this long after every shard exited by
   * itself: rank 0 ended the training after a barrier every live worker
   * passed, and ps-worker then only prints and exits (within a second);
   * the shards get as long after the workers (SHARD_GRACE_MS) ... */
  LEFT_BEHIND_MS = 10000,
  /* ... and a command longer: a script may save or evaluate after
   * ps.shutdown(). */
  COMMAND_LEFT_BEHIND_MS = 30000,
  WATCH_MS = 250,    /* how often the other workers are looked at then */
  EXIT_RETRY = 129,  /* a lost peer, shard or worker: retryable (docs/KUBERNETES.md, Exit codes) */
  EXIT_JOB_LOST = 3, /* the job's state is lost: restart all of it (ps-server/lost.c) */
  LOG_TAIL_LINES = 20,
};

enum child_kind { CHILD_SHARD, CHILD_WORKER };

struct child {
  struct procs_child proc; /* pid, name, running, signalled, wait status */
  enum child_kind kind;
  int index;            /* shard id or worker rank */
  bool failed;          /* exited non-zero or by a signal on its own */
  char why[160];        /* a failure that is not an exit status (start-up) */
  bool not_run;         /* why: its exec failed, so it wrote nothing */
  char log[PATH_BYTES]; /* empty for rank 0 (its stderr is ours) */
  uint64_t stopped_ms;  /* watch_finished: when it was first seen stopped; 0 = running */
};

enum phase { PHASE_START, PHASE_TRAIN, PHASE_DRAIN, PHASE_STOP };

struct launcher {
  const struct local_plan *plan;
  const struct local_config *cfg; /* plan->cfg */
  char dir[DIR_BYTES];
  bool keep_dir;
  const char *shard_level, *worker_level;
  int shard_grace_ms; /* DRAIN: how long shards may take to exit by themselves */
  int left_behind_ms; /* TRAIN: how long workers may outlive the shards (watch_finished) */
  int *ring_fd;       /* allreduce, command: rank r's listening socket, handed over at exec */
  char *peers;        /* allreduce, command: the ring's addresses, rank 0 first */
  int master_fd;      /* command: holds MASTER_PORT until the workers start; -1 = none */
  int master_port;
  char token[PATH_BYTES]; /* --auth-token-file for the children; "" = none */
  char job_id[32];        /* --job-id of every shard: random per launch ("local-" hex) */
  bool token_made;        /* we wrote it (and remove it) */

  struct child *kids; /* shards 0..S-1, then workers 0..W-1 */
  int num_kids;
  struct procs procs;

  enum phase phase;
  uint64_t deadline_ms; /* next escalation in DRAIN or STOP; 0 = none */
  int escalation;       /* DRAIN: 0 waiting, 1 SIGTERM sent, 2 SIGKILL sent; STOP: 0/2 */
  int stop_signal;      /* the signal that stopped us, 0 = none */
  struct child *first_failure;
  struct child *first_lost; /* a worker killed as unable to finish (watch_finished) */
  uint64_t shards_gone_ms;  /* TRAIN: when every shard was seen gone by itself; 0 = not yet */

  int out_fd; /* rank 0's stdout, -1 once closed */
  char out_buf[8192];
  size_t out_len;
  char summary[1024];

  /* across hosts (local_nodes.c); rdzv NULL = one node */
  struct rdzv_client *rdzv;
  struct rdzv_server *rdzv_srv;
  struct auth_token *rdzv_tok;
  char host[64];          /* where our shards and ring listen: "127.0.0.1" on one node */
  int rank0, world;       /* our first worker's global rank; all the workers */
  int shard0, num_shards; /* our first shard's global id; all the shards */
  bool fail_sent;
  uint64_t fail_hold_ms; /* a lost-peer (129) failure is sent no earlier (nodes_poll) */
  char remote_fail[512]; /* "node I (host) failed: what" */
};

/* ---- local_run.c ---- */

/* Enters STOP: every child gets SIGTERM now and SIGKILL after STOP_KILL_MS. */
void local_begin_stop(struct launcher *L);
/* Children still running (workers only, or all). */
int local_running_count(const struct launcher *L, bool workers_only);

/* ---- local_nodes.c ---- */

/* Before anything starts: node 0 serves the rendezvous, every node joins it
 * and learns its host. Returns 0 or -1 after saying why. No-op on one node. */
int nodes_start(struct launcher *L);
/* Once our shards are up: registers them and our ring, waits for the table
 * (pumping), then *servers and L->peers are the job's. Returns 0, or -1
 * (stopping). */
int nodes_exchange(struct launcher *L, char **servers);
/* Each round: tells the others of our failure, stops us on theirs. */
void nodes_poll(struct launcher *L);
/* The end: reports another node's failure and adjusts code; tells the
 * others we are done. */
int nodes_finish(struct launcher *L, int code);
void nodes_end(struct launcher *L);
/* One round of local_run.c's loop (signals, output, exits, deadlines). */
void local_pump(struct launcher *L, int timeout_ms);

/* ---- local_watch.c ---- */

/* The first worker that exited 0, or NULL. */
const struct child *local_finished_worker(const struct launcher *L);
/* TRAIN, once a worker exited 0: kills the workers that can never finish
 * and stops the job (see local_watch.c); the caller runs it every WATCH_MS
 * meanwhile. */
void local_watch(struct launcher *L);

#endif
