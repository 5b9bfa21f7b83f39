/* collective_impl: what the files of the ring collectives share. Internal to
 * libps: it is not in include/ and nothing outside this folder includes it.
 *
 * Who owns what:
 *   collective.c  the public ps_coll_* API (collective.h); struct ps_coll from
 *                 ps_coll_open to ps_coll_close; the failure state (coll_fail,
 *                 coll_fail_auth); the request queue and its worker thread.
 *   rendezvous.c  forming the group (rendezvous_run): the listening socket, the
 *                 connections to rank+1 and rank 0, the accepted ones, each
 *                 through its handshake; a finished connection's socket and
 *                 session go to ps_coll (prev_fd/prev_auth, next_fd/next_auth,
 *                 ctrl[].fd/.auth).
 *   watchdog.c    the heartbeat thread on the control connections
 *                 (watchdog_start, watchdog_stop) and the header-only frames
 *                 the group sends (watchdog_send_frame, watchdog_send_error),
 *                 which the rendezvous also uses for its AUTH, ACK and refusals.
 *   ring.c        the data path (ring.h), built on the two ring connections.
 *   hier.c        the node-first all-reduce (ps_coll_opts.node_first) over
 *                 p2p.c, planned once at open (hier_new).
 *   p2p.c         send and receive between two ranks (p2p_run) over the
 *                 point-to-point connections (ps_coll_opts.p2p), and their
 *                 state (p2p[]) from ps_coll_open's p2p_setup to coll_free's
 *                 p2p_deinit.
 *   group.c       the groups of ps_coll_split: a group is a ps_coll with
 *                 `job` set (the job group, which owns every socket, the
 *                 failure state, the queue and its worker thread); its
 *                 operations run on the job group's thread rules over p2p.c
 *                 with its own group id.
 *
 * Who calls whom:
 *   ps_coll_open  -> rendezvous_run -> watchdog_send_frame / watchdog_send_error
 *                 -> ring_new -> watchdog_start
 *   ps_coll_close -> watchdog_stop (joins the thread, then SHUTDOWN to every peer)
 *   the watchdog thread, and operations whose ring call failed
 *                 -> coll_fail / coll_fail_auth
 *
 * Threads: until watchdog_start only the thread in ps_coll_open touches a
 * ps_coll. From then on the watchdog thread alone uses ctrl[] (sockets,
 * sessions, decoders) until watchdog_stop has joined it; the failure state
 * and the queue are under mu, except `aborted`, which anyone may read. */
#ifndef PS_COLLECTIVE_IMPL_H
#define PS_COLLECTIVE_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "auth.h"
#include "collective.h"
#include "frame.h"
#include "wire.h"

struct ring; /* ring.h */

enum {
  GRACE_MS = 200,   /* failure paths: how long to wait for explanations */
  FRAME_BUF = 1024, /* an encoded header-only frame (control, handshake) */
  P2P_HDR = 24,     /* p2p.c: magic, sequence, length, group id */
};

/* One control connection: rank 0 has one per other rank, the others one to
 * rank 0. The rendezvous fills in fd and auth; the watchdog owns the rest. */
struct ctrl_peer {
  int fd, rank;
  struct auth_session *auth; /* NULL without a token */
  bool left;
  uint64_t last_ns;
  struct frame_decoder dec;
  /* whole frames the socket has not taken yet (watchdog.c: ctrl_queue) */
  uint8_t *out;
  size_t out_len;
};

/* One point-to-point connection (ps_coll_opts.p2p): one per pair of ranks,
 * the higher rank connecting. The rendezvous fills in fd and auth; p2p.c
 * owns the rest, and only the thread running an operation touches it. */
struct p2p_msg; /* p2p.c: a message that arrived before its receive */
struct p2p_peer {
  int fd;
  struct auth_session *auth; /* NULL without a token */
  bool gone;                 /* it closed the connection (left, or lost) */
  uint32_t seq_out, seq_in;  /* messages sent to it, received from it */
  /* the message being received: part 0 header, 1 payload, 2 tag */
  int part;
  size_t got, len;
  uint8_t hdr[P2P_HDR], tag[AUTH_TAG_BYTES];
  char *dst;                   /* the payload's destination: a receive's buffer or msg */
  struct p2p_msg *msg;         /* NULL when dst is a receive's buffer */
  struct p2p_msg *head, *tail; /* complete, not received yet */
};

struct ps_coll {
  int rank, world; /* a group's: its rank (-1: not a member) and size */
  /* Groups (group.c). The job group: job_group NULL, gid 0, members NULL.
   * A group: job_group is the job's ps_coll (failure state, queue, sockets),
   * members[i] the job rank of group rank i. */
  ps_coll *job_group;
  int *members;
  uint64_t gid;
  uint32_t op_seq; /* the group's collectives so far (checked between members) */
  uint32_t splits; /* ps_coll_split calls on this group so far */
  /* The job group: its groups not yet closed (under mu), and whether
   * ps_coll_close ran while some were open: then the last group's close
   * frees it, and their operations fail with PS_ERR_STATE meanwhile. */
  int open_groups;
  bool closed;
  bool has_p2p; /* the job group was opened with p2p connections */
  char job[256];
  char node[256]; /* ps_coll_opts.node, "" = none (grid.c gathers them) */
  int peer_timeout_ms;
  int prev_fd, next_fd;
  struct auth_session *prev_auth, *next_auth; /* the ring connections' sessions (or NULL) */
  const struct auth_token *token;             /* borrowed; NULL = no authentication */
  struct ring *ring;
  struct ctrl_peer *ctrl; /* rank 0: ranks 1..W-1; others: rank 0 */
  int nctrl;
  struct p2p_peer *p2p; /* ps_coll_opts.p2p: world entries (ours unused), else NULL */
  uint64_t spin_ns;     /* p2p.c: spin this long before sleeping in poll */
  struct hier *hier;    /* hier.c: the node-first all-reduce, or NULL (flat ring) */

  pthread_mutex_t mu; /* failure state and the request queue */
  atomic_int aborted;
  int abort_efd, stop_efd;
  bool failed;
  ps_status fail_status;
  Ps__ErrorCode fail_code; /* what the watchdog passes on (coll_fail, coll_fail_auth) */
  int lost;
  char msg[640];

  pthread_t watchdog;
  bool watchdog_started;

  pthread_t worker;
  bool worker_started, stopping;
  pthread_cond_t queued, completed;
  struct ps_coll_request *head, *tail;
};

/* ---- collective.c ---- */

/* Records the group's first failure (later ones are dropped) with status st
 * and the rank it blames (lost, -1 for none), logs it once, sets `aborted`
 * and writes abort_efd, which wakes the data path and the watchdog. The
 * watchdog passes it on as ERR_PEER_LOST (the blamed rank is gone and nobody
 * tells it), or as ERR_PROTOCOL when st is PS_ERR_STATE (the ranks
 * disagree), which the other ranks fail with too. Any thread. */
void coll_fail(ps_coll *c, ps_status st, int lost, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));

/* coll_fail for something rank `culprit` sent that failed authentication
 * (status PS_ERR_IO), passed on as ERR_AUTH: the culprit is alive and is told
 * too. Any thread. */
void coll_fail_auth(ps_coll *c, int culprit, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

/* ---- rendezvous.c ---- */

/* Forms the group of c, world size > 1: listens (or takes over
 * o->listen_fd), connects to rank+1 and, on ranks > 0, to rank 0, accepts
 * rank-1 and, on rank 0, every control connection, and runs every handshake
 * until all are done, a peer refuses us or o's connect timeout passes. On
 * PS_OK the group's sockets and sessions are set (still blocking); on failure
 * err says why and whoever was still in a handshake with us has been told.
 * The listening socket is closed either way. */
ps_status rendezvous_run(ps_coll *c, const struct ps_coll_opts *o, char *err, size_t errlen);

/* ---- p2p.c ---- */

/* Allocates c->p2p (world entries, no connection yet). Returns 0 or -ENOMEM. */
int p2p_init(ps_coll *c);
/* The rendezvous is done: makes the connections non-blocking, with the
 * group's peer timeout. */
void p2p_setup(ps_coll *c);
/* Closes the connections and frees what is queued. Accepts c->p2p NULL. */
void p2p_deinit(ps_coll *c);

/* Sends send_bytes of send to rank dst and receives recv_bytes into recv
 * from rank src, at the same time (dst or src -1: that half is not done).
 * On failure the group fails (coll_fail: a closed connection names the
 * rank, a length that differs is PS_ERR_STATE naming both) and its status is
 * returned. */
ps_status p2p_run(ps_coll *c, const void *send, size_t send_bytes, int dst, void *recv,
                  size_t recv_bytes, int src);
/* The same for group gid (0: the job group): messages are matched by (rank,
 * group), so another group's wait in the queue. Ranks are job ranks. */
ps_status p2p_run_gid(ps_coll *c, uint64_t gid, const void *send, size_t send_bytes, int dst,
                      void *recv, size_t recv_bytes, int src);

/* All-to-all as W-1 pairwise exchanges (step k: send to rank+k, receive
 * from rank-k), each link carrying one block each way, against the ring's
 * W(W-1)/2. The caller has run ring_agree. */
ps_status p2p_alltoall(ps_coll *c, const void *send, void *recv, size_t bytes);

/* ---- group.c ---- */

enum req_kind {
  REQ_ALLREDUCE,
  REQ_BROADCAST,
  REQ_BARRIER,
  REQ_ALLGATHER,
  REQ_REDUCE_SCATTER,
  REQ_REDUCE,
  REQ_ALLTOALL,
  REQ_SENDRECV,
};

/* One collective as the caller gave it (the buffers are the caller's). */
struct coll_op {
  enum req_kind kind;
  void *buf;       /* in place, or the output */
  const void *src; /* the input, where it is apart */
  size_t count;    /* elements of dtype (reductions), or bytes (the others) */
  int dtype;       /* enum dtype of a reduction */
  int redop, root; /* send/receive: root is the rank sent to (-1: none) */
  size_t rcount;   /* send/receive: bytes received into buf from rank `from` (-1: none) */
  int from;
  ps_coll *group; /* a group of ps_coll_split (run by group_run), or NULL: the job group */
};

/* The job group of c: c itself, or the one a group was split from. */
static inline ps_coll *coll_job(ps_coll *c) {
  return c->job_group ? c->job_group : c;
}

/* Frees a group of ps_coll_split (not the job group). */
void group_free(ps_coll *g);

/* "job rank R is not in this group ...": what the operations on a group
 * this rank did not join fail with (PS_ERR_STATE). */
void not_member_msg(const ps_coll *g, char *buf, size_t len);

/* A ring over some of the job's ranks (a group's members, the node-first
 * all-reduce's leaders), on the p2p connections under group id gid:
 * members[i] is the job rank of ring position i, me this rank's position;
 * scratch holds a chunk (ceil(count / n) elements of dt). */
struct gring {
  ps_coll *job;
  uint64_t gid;
  const int *members;
  int n, me;
  void *scratch;
};

/* buf (count elements of dt) becomes the combination (op; RING_AVG sums)
 * over the ring: a reduce-scatter then an all-gather of n chunks, each
 * chunk combined in one order at one rank, so every rank gets the same
 * bits. Returns PS_OK or the job group's failure. */
ps_status gring_allreduce(const struct gring *g, void *buf, size_t count, int dt, int op);

/* Runs o on group g (g->job_group set, g->rank >= 0) over the job group's
 * p2p connections, on the thread that runs the job group's operations.
 * Returns PS_OK or the job group's failure (a mismatch between the members
 * fails the job group with PS_ERR_STATE). */
ps_status group_run(ps_coll *g, const struct coll_op *o);

/* ---- watchdog.c ---- */

/* Starts the watchdog thread on c's control connections once the rendezvous
 * is done (ps_coll_open has made them non-blocking, so a peer that stops
 * reading cannot stall a heartbeat). Returns 0 or a negative errno. */
int watchdog_start(ps_coll *c);

/* Stops and joins the watchdog thread, if it was started (a failure it has
 * not passed on yet still goes out first), then tells every control peer
 * this rank leaves (SHUTDOWN). */
void watchdog_stop(ps_coll *c);

/* Sends h (header only), followed by its tag under s when s is set. Returns
 * 0 or a negative errno (wire_send_frame's). */
int watchdog_send_frame(int fd, const wire_header *h, struct auth_session *s);

/* Sends an ERROR frame with code and message naming rank (-1: nobody in
 * particular), tagged under s when s is set. Returns 0 or a negative errno. */
int watchdog_send_error(int fd, Ps__ErrorCode code, int rank, const char *msg,
                        struct auth_session *s);

#endif
