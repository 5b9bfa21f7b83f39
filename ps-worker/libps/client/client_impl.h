/* client_impl: what the files of libps's push/pull client share. Internal
 * to libps's client/ room: it is not in include/ and nothing outside this
 * folder includes it (coll/ neither).
 *
 * Who owns what:
 *   client.c  the public ps_* API (ps.h); struct ps_client from ps_client_new
 *             to ps_client_free; the layout (declared once, sent again on
 *             every reconnect); requests (struct ps_request, private to it)
 *             and the ops they are cut into, one per chunk.
 *   initialised.c
 *             ps_wait_initialised, on top of ps_pull_async: version 0 of
 *             each of the rank's tensors, pulled and discarded, with a
 *             deadline.
 *   shard.c   one shard's connection (struct shard), whatever carries it:
 *             connect and reconnect with capped backoff, the synchronous
 *             hello, authentication and layout exchange, writing ops, the
 *             pending list, decoding replies and completing ops, and the
 *             receiver thread. An op belongs to shard.c from shard_submit
 *             until it completes.
 *   shard_*.c (the transport files)
 *             one transport each: a struct shard_transport_ops (below) and
 *             the transport's own fields (private to its file, at sh->tp).
 *             Only they touch sockets or their transport's library; shard.c
 *             never asks which transport it has.
 *   shard_transports.c
 *             the registry: the transports' names (ps_client_opts.transport,
 *             PS_TRANSPORT) to their tables, the one list of them.
 *
 * Who calls whom:
 *   ps_client_new  -> shard_init, shard_open, shard_start
 *   tensor and shard-wide requests -> shard_submit
 *   ps_client_free -> shard_shutdown (all shards), then shard_stop, shard_deinit
 *   shard.c, from callers' threads and receiver threads
 *                  -> client_req_done, client_req_stats, client_set_err,
 *                     client_layout_init / client_layout_deinit
 *
 * Locks: sh->send_mu serialises everything written on a shard's connection
 * and the replacement of its connection and session; c->mu guards the
 * pending lists, op ids, request state, the error message, closing,
 * shutting_down, sh->dead and the publication of a new connection by the
 * transport (ps_client_free shuts it down). send_mu is
 * taken before c->mu, and c->mu is never held across I/O. The counters are
 * atomics, updated from any thread without a lock. */
#ifndef PS_CLIENT_IMPL_H
#define PS_CLIENT_IMPL_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "auth.h"
#include "frame.h"
#include "net.h"
#include "placement.h"
#include "ps.h"
#include "wire.h"

/* The receive buffer (sh->rbuf) and the encoded preamble+header (sh->sbuf). */
#define SHARD_RX_BUF_BYTES (64u * 1024u)
#define SHARD_HDR_BUF_BYTES (FRAME_PREAMBLE_BYTES + FRAME_MAX_HEADER)

/* One request to one shard about one key (or, for shard-wide requests such
 * as the layout, barrier or stats, about none). */
struct op {
  struct op *prev, *next;
  uint64_t id;
  Ps__MsgType type;
  uint64_t key, step, version;
  uint32_t flags;       /* Header.flags (PUSH: WIRE_PUSH_BASE when version is its base) */
  size_t chunk;         /* init/push/pull: index in placement.chunks */
  uint64_t rollback_id; /* MSG_ROLLBACK */
  const char *text;     /* MSG_ABORT: the reason (the caller's, until the op is done) */
  const void *send_buf; /* init/push payload */
  void *recv_buf;       /* pull destination */
  uint64_t bytes;
  struct ps_request *req;
};

struct shard_transport_ops;

struct shard {
  ps_client *c;
  const struct shard_transport_ops *ops; /* the transport, chosen at shard_init */
  void *tp;                              /* its own state (private to the transport file) */
  int idx;
  struct net_addr addr;
  pthread_mutex_t send_mu;
  pthread_t rx;
  bool rx_started;
  bool dead;              /* reconnection failed: new ops fail at once */
  bool lost;              /* ...because it found the job's state lost (PS_ERR_STATE_LOST) */
  struct op *head, *tail; /* pending, in send order; under c->mu */
  struct frame_decoder dec;
  struct wire_arena arena;    /* receiver thread's */
  struct wire_arena hs_arena; /* handshakes (under send_mu) */
  uint8_t *rbuf;
  uint8_t *sbuf;             /* encoded preamble+header; under send_mu */
  struct auth_session *sess; /* this connection's; replaced only under send_mu by the rx thread */
  uint64_t mac_done;         /* payload bytes of the reply being read already fed to its tag */
  Ps__Header *rx_h;          /* the reply being read: its header and op (receiver thread) */
  struct op *rx_o;
  _Atomic uint64_t last_send_ns; /* when a frame last left (heartbeats fill the gaps) */
};

struct ps_client {
  struct ps_client_opts opts;
  int num_shards;
  struct shard *shards;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  uint64_t next_id;
  bool closing;
  bool shutting_down;
  /* heartbeats (client.c): one thread; beat_ms 0 = none (PS_HEARTBEAT_MS) */
  pthread_t beat;
  bool beat_started;
  pthread_cond_t beat_cv; /* signalled (under mu) when closing */
  int beat_ms;
  char errmsg[1024];
  _Atomic uint64_t rollback_clock; /* UINT64_MAX = none seen */
  _Atomic uint64_t rollback_id;    /* the id that came with it (ps_rollback sends it back) */
  atomic_int leave;                /* ps_leave's kind, 0 = none: said again after every reconnect */
  /* The job as this process knows it, said in every LAYOUT after a
   * reconnect: a shard holding nothing of a started job lost it. started:
   * the keys were initialised (an INIT acked, a pull answered, a push
   * sent); clock: 1 + the highest step pushed. incarnation: drawn once,
   * in every LAYOUT: a shard tells a restarted process from a reconnect. */
  atomic_bool started;
  _Atomic uint64_t clock;
  atomic_bool lost_relayed; /* PS_ERR_STATE_LOST seen and told to every shard (MSG_ABORT) */
  atomic_bool lost_said;    /* errmsg holds why the job is lost: later errors keep it */
  uint64_t incarnation;
  /* layout (after declare) */
  bool declared;
  int num_tensors;
  char **names;
  uint64_t *counts;
  uint64_t chunk_bytes;
  uint64_t layout_hash;
  /* ps_declare_owned: per tensor its owners (num_owners[i] == 0: every
   * rank; both NULL when no tensor names owners) and whether this rank is
   * one (mine[i]): only those tensors are pushed and pulled */
  uint32_t *num_owners;
  uint32_t **owners;
  bool *mine;
  struct placement placement;
  /* per chunk: 1 + the version its last pull got (0: none yet); a push of
   * the chunk says it was computed on that version (the shard's staleness) */
  _Atomic uint64_t *pulled;
  /* ps_client_counters: updated without locks from any thread */
  atomic_uint_fast64_t n_pushes, n_pulls, bytes_sent, bytes_received, n_reconnects;
  atomic_int shards_up;
  atomic_int batch_depth; /* ps_batch_begin calls not yet ended */
};

/* The declared layout as the body of a LAYOUT header, in arrays of its own. */
struct client_layout {
  Ps__Layout msg;
  Ps__Tensor *tensors, **ptrs;
  uint64_t *shapes;
};

/* ---- client.c ---- */

/* Sets the message ps_errmsg returns (takes c->mu). */
void client_set_err(ps_client *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* One op of r finished with st (and, for a pull, the version it got, else
 * UINT64_MAX); the last one completes r: wakes ps_wait, runs its callback and,
 * when nobody waits, frees r. Takes c->mu; call it without. */
void client_req_done(ps_client *c, struct ps_request *r, ps_status st, uint64_t version);

/* A shard found the job's state lost (PS_ERR_STATE_LOST): tells every
 * other shard, once (MSG_ABORT). Whoever sees that status from a request
 * calls it (ps_wait does). */
void client_relay_lost(ps_client *c);

/* A STATS reply for r: fills the stats and worker clocks r asked for. */
void client_req_stats(struct ps_request *r, const Ps__Stats *s);

/* Builds c's declared layout into *l. Returns 0 or -ENOMEM;
 * client_layout_deinit must follow either way. */
int client_layout_init(ps_client *c, struct client_layout *l);
void client_layout_deinit(struct client_layout *l);

/* ---- shard.c ---- */

/* Prepares shard idx of c at addr ("host:port"), not yet connected. Returns
 * 0, -ENOMEM, or -EINVAL for a bad address (err says why). */
int shard_init(struct shard *sh, ps_client *c, int idx, const char *addr, char *err, size_t errlen);
void shard_deinit(struct shard *sh);

/* The first connection: connects and handshakes with capped exponential
 * backoff until timeout_ms (-1 = forever) or the client closes. Returns 0,
 * or a negative errno with err and *st saying why; a refusal by the shard
 * (an ERROR answering the hello, the proof or the layout) ends it at once. */
int shard_open(struct shard *sh, int timeout_ms, char *err, size_t errlen, ps_status *st);

/* Starts sh's receiver thread, which from now on reads replies, reconnects
 * and resends. Returns 0 or a negative errno. */
int shard_start(struct shard *sh);

/* Wakes sh's receiver thread out of its read for good. The caller holds
 * c->mu and has set c->closing. */
void shard_shutdown(struct shard *sh);

/* Joins sh's receiver thread, if it was started (after shard_shutdown), and
 * fails whatever is still pending with PS_ERR_CLOSED. */
void shard_stop(struct shard *sh);

/* Queues o (taking ownership) on sh and writes it; its reply completes it.
 * On a shard given up, or a closing client, o fails at once. */
void shard_submit(struct shard *sh, struct op *o);
/* A HEARTBEAT to sh unless a frame left within idle_ns or another thread is
 * sending or reconnecting (the connection then shows life anyway). */
void shard_beat(struct shard *sh, uint64_t idle_ns);
/* ps_batch_begin / ps_batch_end: corks or uncorks sh's socket. */
void shard_cork(struct shard *sh, bool on);
/* Feeds n received bytes to sh's decoder, completing the replies in them
 * (the receiver thread, both transports). Returns 0 or a negative errno:
 * the connection must be dropped. */
int shard_rx_feed(struct shard *sh, const uint8_t *p, size_t n);
/* After n bytes were written into the decoder's payload window. */
int shard_rx_advance(struct shard *sh, size_t n);

/* ---- a transport (the shard_*.c transport files) ---- */

/* Flags of read_sync. */
enum {
  SHARD_SYNC_FIRST = 1, /* the first bytes of a new reply */
  SHARD_SYNC_LAST = 2,  /* the last bytes of the reply: nothing may follow them */
};

/* What shard.c asks of a transport (Redis's ConnectionType). One
 * connection at a time per shard; every operation but init, deinit,
 * connected and shutdown runs with send_mu held, or in the receiver
 * thread, which holds send_mu while it reconnects. */
struct shard_transport_ops {
  const char *name; /* its ps_client_opts.transport / PS_TRANSPORT value */
  /* Whether this build can use it (optional; a config_check_fn on its
   * name): 0, or -EINVAL with err. */
  int (*check_build)(const char *name, char *err, size_t errlen);
  /* Sets up sh->tp (at shard_init): 0, or a negative errno with err. On
   * failure sh->tp stays NULL. */
  int (*init)(struct shard *sh, char *err, size_t errlen);
  /* Closes any connection and frees sh->tp (sh->tp not NULL). */
  void (*deinit)(struct shard *sh);
  /* One attempt at a new connection to sh->addr, published under c->mu
   * (for shutdown): 0, or a negative errno with err (nothing is left open). */
  int (*connect)(struct shard *sh, char *err, size_t errlen);
  /* Drops the connection and whatever it delivered. */
  void (*disconnect)(struct shard *sh);
  /* Whether a connection is up (caller holds c->mu). */
  bool (*connected)(const struct shard *sh);
  /* One frame out, tagged with sh->sess when there is one; preamble and
   * header stay in sh->sbuf. The bytes sent or a negative errno. */
  int64_t (*send)(struct shard *sh, const Ps__Header *h, const void *payload, uint64_t plen);
  /* The next len bytes of a handshake reply (no payload) into buf, blocking
   * (bounded). flags: SHARD_SYNC_*; a transport that keeps message bounds
   * answers -EPROTO when the reply ends before len bytes, or after LAST
   * while bytes remain. 0 or a negative errno. */
  int (*read_sync)(struct shard *sh, void *buf, size_t len, unsigned flags);
  /* The receiver loop: feeds replies to shard_rx_feed / shard_rx_advance
   * (the decoder is reset) until the connection fails or shutdown; returns
   * the negative errno. */
  int (*rx_run)(struct shard *sh);
  /* Wakes the receiver thread out of rx_run for good (ps_client_free;
   * caller holds c->mu). */
  void (*shutdown)(struct shard *sh);
  /* ps_batch_begin / ps_batch_end: holds back (on) or releases partial
   * frames, where the transport can. */
  void (*cork)(struct shard *sh, bool on);
};

/* shard_transports.c: the table of the transport named name (NULL or "" =
 * the default, the first listed), or NULL with err saying why ("expected a
 * or b", or why this build cannot use it). */
const struct shard_transport_ops *shard_transport_find(const char *name, char *err, size_t errlen);

#endif
