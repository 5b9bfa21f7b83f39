/* client: libps's push/pull client (see ps.h for the contract): the
 * public API, the model layout and requests. The connections to the shards,
 * their receiver threads and reconnection are shard.c; client_impl.h says
 * what the two share and who calls whom.
 *
 * A tensor operation is cut into one op per chunk of the tensor (placement.h:
 * the same chunks and shards on every worker), each submitted to the shard
 * that holds its key; shard-wide operations (layout, barrier, stats,
 * rollback, shutdown) send one op to each shard or to one. The request
 * completes when its last op does, with the first error among them and, for
 * a pull, the lowest version any chunk had. The layout is kept once declared
 * so every reconnection declares it again before anything is resent. */
#include "ps.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "auth.h"
#include "client_impl.h"
#include "clock.h"
#include "config.h"
#include "envknob.h"
#include "log.h"
#include "placement.h"
#include "wire.h"

struct ps_request {
  ps_client *c;
  int remaining;
  bool done;
  bool user_waits;
  bool waiting; /* ps_wait sleeps on it: its completion wakes the waiters */
  ps_status status;
  uint64_t version; /* lowest version among a pull's chunks */
  ps_done_fn cb;
  void *arg;
  struct ps_shard_stats *stats_out;
  uint64_t *clocks_out; /* n_clocks entries */
  int n_clocks;
  bool *lost_out; /* world_size entries: set for each rank in a reply's lost_ranks */
};

const char *ps_strerror(ps_status s) {
  switch (s) {
    case PS_OK:
      return "ok";
    case PS_ERR_INVALID:
      return "invalid argument";
    case PS_ERR_CONNECT:
      return "cannot connect to a shard";
    case PS_ERR_IO:
      return "connection to a shard lost, or the job stopped (retryable)";
    case PS_ERR_LAYOUT_MISMATCH:
      return "layout mismatch";
    case PS_ERR_REMOTE:
      return "request refused by a shard";
    case PS_ERR_NOMEM:
      return "out of memory";
    case PS_ERR_STATE:
      return "call out of order, or the ranks disagree (a different number of steps)";
    case PS_ERR_CLOSED:
      return "client closed";
    case PS_ERR_ROLLBACK:
      return "a shard restarted from an older checkpoint (roll back)";
    case PS_ERR_STATE_LOST:
      return "the job's state is lost and it cannot continue as it is";
  }
  return "unknown status";
}

ps_status ps_sync_mode_parse(const char *s, ps_sync_mode *out, char *err, size_t errlen) {
  static const char *const names[] = {[PS_SYNC_PS] = "ps", [PS_SYNC_ALLREDUCE] = "allreduce"};
  int i = config_choice(s, names, sizeof(names) / sizeof(names[0]), err, errlen);
  if (i < 0) return PS_ERR_INVALID;
  *out = (ps_sync_mode)i;
  return PS_OK;
}

void client_set_err(ps_client *c, const char *fmt, ...) {
  if (atomic_load(&c->lost_said)) return; /* nothing says more than why the job is lost */
  char buf[sizeof(c->errmsg)];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof(buf), fmt, ap);
  va_end(ap);
  pthread_mutex_lock(&c->mu);
  memcpy(c->errmsg, buf, sizeof(buf));
  pthread_mutex_unlock(&c->mu);
}

const char *ps_errmsg(ps_client *c, char *buf, size_t len) {
  if (!c || !len) return "";
  pthread_mutex_lock(&c->mu);
  snprintf(buf, len, "%s", c->errmsg);
  pthread_mutex_unlock(&c->mu);
  return buf;
}

/* ---- requests ----------------------------------------------------------- */

static struct ps_request *req_new(ps_client *c, int ops, ps_done_fn cb, void *arg,
                                  bool user_waits) {
  struct ps_request *r = calloc(1, sizeof(*r));
  if (!r) return NULL;
  r->c = c;
  r->remaining = ops;
  r->cb = cb;
  r->arg = arg;
  r->user_waits = user_waits;
  r->version = UINT64_MAX;
  return r;
}

void client_req_done(ps_client *c, struct ps_request *r, ps_status st, uint64_t version) {
  pthread_mutex_lock(&c->mu);
  if (st != PS_OK && r->status == PS_OK) r->status = st;
  if (version < r->version) r->version = version;
  bool last = --r->remaining == 0;
  if (!last) {
    pthread_mutex_unlock(&c->mu);
    return;
  }
  ps_done_fn cb = r->cb;
  void *arg = r->arg;
  ps_status status = r->status;
  if (!r->user_waits) { /* the callback form: nobody else holds r */
    pthread_mutex_unlock(&c->mu);
    if (cb) cb(status, arg);
    free(r);
    return;
  }
  /* Both forms: the callback has run when ps_wait returns. Only a request
   * someone sleeps on wakes the waiters (one condition variable serves all
   * requests: broadcasting every completion woke a thread waiting for the
   * first of 64 requests 64 times). */
  if (cb) {
    pthread_mutex_unlock(&c->mu);
    cb(status, arg);
    pthread_mutex_lock(&c->mu);
  }
  r->done = true;
  if (r->waiting) pthread_cond_broadcast(&c->cv);
  pthread_mutex_unlock(&c->mu);
}

ps_status ps_wait(ps_request *r, uint64_t *version) {
  if (!r) return PS_ERR_INVALID;
  ps_client *c = r->c;
  pthread_mutex_lock(&c->mu);
  r->waiting = true;
  while (!r->done) pthread_cond_wait(&c->cv, &c->mu);
  pthread_mutex_unlock(&c->mu);
  ps_status st = r->status;
  if (version) *version = r->version;
  free(r);
  if (st == PS_ERR_STATE_LOST) client_relay_lost(c);
  return st;
}

void client_req_stats(struct ps_request *r, const Ps__Stats *s) {
  if (r->stats_out) {
    struct ps_shard_stats *out = r->stats_out;
    out->pushes = s->pushes;
    out->pulls = s->pulls;
    out->updates = s->updates;
    out->duplicates = s->duplicates;
    out->rejected_frames = s->rejected_frames;
    out->bytes_in = s->bytes_in;
    out->bytes_out = s->bytes_out;
    out->param_bytes = s->param_bytes;
    out->min_version = s->min_version;
    out->max_version = s->max_version;
    out->connected_workers = s->connected_workers;
    out->num_keys = s->num_keys;
    out->live_workers = s->live_workers;
    snprintf(out->optimizer, sizeof(out->optimizer), "%s", s->optimizer ? s->optimizer : "");
    snprintf(out->consistency, sizeof(out->consistency), "%s",
             s->consistency ? s->consistency : "");
  }
  if (r->clocks_out)
    for (int i = 0; i < r->n_clocks; i++)
      r->clocks_out[i] = (size_t)i < s->n_worker_clocks ? s->worker_clocks[i] : UINT64_MAX;
  if (r->lost_out) { /* every shard's reply lands here, each on its receiver thread */
    pthread_mutex_lock(&r->c->mu);
    for (size_t i = 0; i < s->n_lost_ranks; i++)
      if (s->lost_ranks[i] < (uint32_t)r->c->opts.world_size) r->lost_out[s->lost_ranks[i]] = true;
    pthread_mutex_unlock(&r->c->mu);
  }
}

/* ---- the layout ---------------------------------------------------------- */

int client_layout_init(ps_client *c, struct client_layout *l) {
  *l = (struct client_layout){.msg = PS__LAYOUT__INIT};
  l->tensors = calloc((size_t)c->num_tensors, sizeof(*l->tensors));
  l->ptrs = calloc((size_t)c->num_tensors, sizeof(*l->ptrs));
  l->shapes = calloc((size_t)c->num_tensors, sizeof(*l->shapes));
  if (!l->tensors || !l->ptrs || !l->shapes) return -ENOMEM;
  for (int i = 0; i < c->num_tensors; i++) {
    ps__tensor__init(&l->tensors[i]);
    l->tensors[i].name = c->names[i];
    l->tensors[i].dtype = 0;
    l->shapes[i] = c->counts[i];
    l->tensors[i].n_shape = 1;
    l->tensors[i].shape = &l->shapes[i];
    if (c->num_owners) { /* empty for a tensor of every rank: what older shards read */
      l->tensors[i].n_owners = c->num_owners[i];
      l->tensors[i].owners = c->owners[i];
    }
    l->ptrs[i] = &l->tensors[i];
  }
  l->msg.n_tensors = (size_t)c->num_tensors;
  l->msg.tensors = l->ptrs;
  l->msg.chunk_bytes = c->chunk_bytes;
  l->msg.num_shards = (uint32_t)c->num_shards;
  l->msg.hash = c->layout_hash;
  return 0;
}

void client_layout_deinit(struct client_layout *l) {
  free(l->tensors);
  free(l->ptrs);
  free(l->shapes);
}

/* ---- public API ----------------------------------------------------------- */

static void layout_clear(ps_client *c) {
  if (c->names)
    for (int i = 0; i < c->num_tensors; i++) free(c->names[i]);
  free(c->names);
  free(c->counts);
  for (int i = 0; c->owners && i < c->num_tensors; i++) free(c->owners[i]);
  free(c->owners);
  free(c->num_owners);
  free(c->mine);
  c->owners = NULL;
  c->num_owners = NULL;
  c->mine = NULL;
  placement_free(&c->placement);
  free(c->pulled);
  c->pulled = NULL;
  c->names = NULL;
  c->counts = NULL;
  c->num_tensors = 0;
}

/* Heartbeats: every beat_ms each shard connection that sent nothing for
 * that long gets a HEARTBEAT, so a shard tells a worker that stopped (SIGSTOP,
 * a hung host, a partition) from one that computes or waits: ps-server's
 * --worker-timeout counts from a beating connection's last frame. */

static void *beat_main(void *arg) {
  ps_client *c = arg;
  pthread_mutex_lock(&c->mu);
  while (!c->closing) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    uint64_t ns = (uint64_t)until.tv_nsec + (uint64_t)c->beat_ms * 1000000u;
    until.tv_sec += (time_t)(ns / 1000000000u);
    until.tv_nsec = (long)(ns % 1000000000u);
    pthread_cond_timedwait(&c->beat_cv, &c->mu, &until);
    if (c->closing) break;
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < c->num_shards; i++)
      shard_beat(&c->shards[i], (uint64_t)c->beat_ms * 1000000u);
    pthread_mutex_lock(&c->mu);
  }
  pthread_mutex_unlock(&c->mu);
  return NULL;
}

/* PS_HEARTBEAT_MS: 0 turns heartbeats off (a test's old client); -1 = bad,
 * with the message naming the variable in errbuf. Read with the option
 * tables' syntax (no space, sign or suffix: strtol took " 500"); default and
 * range in common/envknob.c. */
static int beat_interval(char *errbuf, size_t errlen) {
  int64_t ms;
  char why[160];
  if (envknob_int("PS_HEARTBEAT_MS", &ms, why, sizeof(why)) < 0) {
    snprintf(errbuf, errlen, "%s (milliseconds between heartbeats; 0 = off)", why);
    return -1;
  }
  return (int)ms;
}

ps_status ps_client_new(const struct ps_client_opts *opts, ps_client **out, char *errbuf,
                        size_t errlen) {
  char tmp[512];
  if (!errbuf || !errlen) {
    errbuf = tmp;
    errlen = sizeof(tmp);
  }
  errbuf[0] = 0;
  *out = NULL;
  if (!opts || opts->num_servers < 1 || !opts->servers || opts->world_size < 1 || opts->rank < 0 ||
      opts->rank >= opts->world_size) {
    snprintf(errbuf, errlen, "need >= 1 server, world_size >= 1 and 0 <= rank < world_size");
    return PS_ERR_INVALID;
  }
  const char *tr = opts->transport;
  char why[160];
  if (!tr && envknob_str("PS_TRANSPORT", &tr, errbuf, errlen) < 0) return PS_ERR_INVALID;
  const struct shard_transport_ops *tp = shard_transport_find(tr, why, sizeof(why));
  if (!tp) {
    if (opts->transport)
      snprintf(errbuf, errlen, "transport \"%.20s\": %s", tr, why);
    else
      snprintf(errbuf, errlen, "PS_TRANSPORT=\"%.20s\": %s", tr, why);
    return PS_ERR_INVALID;
  }
  int beat_ms = beat_interval(errbuf, errlen);
  if (beat_ms < 0) return PS_ERR_INVALID;
  ps_client *c = calloc(1, sizeof(*c));
  if (!c) return PS_ERR_NOMEM;
  c->beat_ms = beat_ms;
  pthread_cond_init(&c->beat_cv, NULL);
  atomic_init(&c->rollback_clock, UINT64_MAX);
  c->opts = *opts;
  c->opts.transport = tp->name;
  c->num_shards = opts->num_servers;
  c->chunk_bytes = opts->chunk_bytes ? opts->chunk_bytes : PLACEMENT_DEFAULT_CHUNK_BYTES;
  pthread_mutex_init(&c->mu, NULL);
  pthread_cond_init(&c->cv, NULL);
  if (auth_random(&c->incarnation, sizeof(c->incarnation)) < 0 || c->incarnation == 0)
    c->incarnation = clock_now_ns() ^ ((uint64_t)getpid() << 32) ^ (uintptr_t)c;
  ps_status st = PS_ERR_NOMEM;
  c->shards = calloc((size_t)c->num_shards, sizeof(*c->shards));
  if (!c->shards) goto fail;
  for (int i = 0; i < c->num_shards; i++) {
    int r = shard_init(&c->shards[i], c, i, opts->servers[i], errbuf, errlen);
    if (r < 0) {
      /* Shards after i were never initialised (zeroed: fd 0, no client):
       * ps_client_free must not touch them. */
      c->num_shards = i + 1;
      st = r == -ENOMEM ? PS_ERR_NOMEM : PS_ERR_INVALID;
      goto fail;
    }
  }
  int timeout = opts->connect_timeout_ms == 0 ? 30000 : opts->connect_timeout_ms;
  for (int i = 0; i < c->num_shards; i++)
    if (shard_open(&c->shards[i], timeout, errbuf, errlen, &st) < 0) goto fail;
  atomic_store(&c->shards_up, c->num_shards);
  for (int i = 0; i < c->num_shards; i++)
    if (shard_start(&c->shards[i]) < 0) goto fail;
  if (c->beat_ms) {
    if (pthread_create(&c->beat, NULL, beat_main, c) != 0) goto fail;
    c->beat_started = true;
  }
  *out = c;
  return PS_OK;
fail:
  if (!errbuf[0]) snprintf(errbuf, errlen, "%s", ps_strerror(st));
  ps_client_free(c);
  return st;
}

void ps_client_free(ps_client *c) {
  if (!c) return;
  pthread_mutex_lock(&c->mu);
  c->closing = true;
  for (int i = 0; c->shards && i < c->num_shards; i++) shard_shutdown(&c->shards[i]);
  pthread_cond_broadcast(&c->beat_cv);
  pthread_mutex_unlock(&c->mu);
  if (c->beat_started) pthread_join(c->beat, NULL);
  for (int i = 0; c->shards && i < c->num_shards; i++) {
    shard_stop(&c->shards[i]);
    shard_deinit(&c->shards[i]);
  }
  free(c->shards);
  layout_clear(c);
  pthread_cond_destroy(&c->cv);
  pthread_cond_destroy(&c->beat_cv);
  pthread_mutex_destroy(&c->mu);
  free(c);
}

/* A shard-wide request: one op per shard, or only to shard `only` >= 0,
 * with these header fields; a STATS reply fills the outputs given. */
struct shard_call {
  Ps__MsgType type;
  int only;
  uint64_t version, rollback_id; /* MSG_ROLLBACK's clock and id */
  uint32_t flags;                /* MSG_LEAVE's kind */
  const char *text;              /* MSG_ABORT's reason */
  struct ps_shard_stats *stats_out;
  uint64_t *clocks_out; /* n_clocks entries */
  int n_clocks;
  bool *lost_out; /* world_size entries */
};

/* Runs call's ops and waits for them all. */
static ps_status run_on_shards(ps_client *c, const struct shard_call *call) {
  int n = call->only >= 0 ? 1 : c->num_shards;
  struct ps_request *r = req_new(c, n, NULL, NULL, true);
  if (!r) return PS_ERR_NOMEM;
  r->stats_out = call->stats_out;
  r->clocks_out = call->clocks_out;
  r->n_clocks = call->n_clocks;
  r->lost_out = call->lost_out;
  struct op **ops = calloc((size_t)n, sizeof(*ops));
  for (int i = 0; ops && i < n; i++) {
    ops[i] = calloc(1, sizeof(struct op));
    if (!ops[i]) break;
  }
  bool ok = ops != NULL;
  for (int i = 0; ok && i < n; i++) ok = ops[i] != NULL;
  if (!ok) {
    for (int i = 0; ops && i < n; i++) free(ops[i]);
    free(ops);
    free(r);
    return PS_ERR_NOMEM;
  }
  for (int i = 0; i < n; i++) {
    ops[i]->type = call->type;
    ops[i]->version = call->version;
    ops[i]->rollback_id = call->rollback_id;
    ops[i]->flags = call->flags;
    ops[i]->text = call->text;
    ops[i]->req = r;
    shard_submit(&c->shards[call->only >= 0 ? call->only : i], ops[i]);
  }
  free(ops);
  return ps_wait(r, NULL);
}

/* A shard found the job's state lost (PS_ERR_STATE_LOST): every other
 * shard is told, once, with the same message (MSG_ABORT), so that every
 * rank and every shard stop with it rather than wait on each other. Best
 * effort: a shard being reconnected (its send mutex held) is skipped, and
 * ps_errmsg keeps the shard's message. */
void client_relay_lost(ps_client *c) {
  if (atomic_exchange(&c->lost_relayed, true)) return;
  char msg[sizeof(c->errmsg)];
  pthread_mutex_lock(&c->mu);
  snprintf(msg, sizeof(msg), "%s", c->errmsg);
  pthread_mutex_unlock(&c->mu);
  for (int i = 0; i < c->num_shards; i++) {
    if (pthread_mutex_trylock(&c->shards[i].send_mu) != 0) continue;
    pthread_mutex_unlock(&c->shards[i].send_mu);
    (void)run_on_shards(
        c, &(struct shard_call){.type = PS__MSG_TYPE__MSG_ABORT, .only = i, .text = msg});
  }
  pthread_mutex_lock(&c->mu);
  snprintf(c->errmsg, sizeof(c->errmsg), "%s", msg);
  pthread_mutex_unlock(&c->mu);
  atomic_store(&c->lost_said, true);
}

/* The owners ps_declare_owned was given: ranks of the job, each once. */
static ps_status check_owners(ps_client *c, int num_tensors, const char *const *names,
                              const int *const *owners, const int *num_owners) {
  int w = c->opts.world_size;
  for (int i = 0; num_owners && i < num_tensors; i++) {
    int n = num_owners[i];
    if (n < 0 || n > w || (n > 0 && (!owners || !owners[i]))) {
      client_set_err(c,
                     "tensor %d (%s): %d owners given (0 = every rank, at most world_size %d, "
                     "with their ranks)",
                     i, names[i], n, w);
      return PS_ERR_INVALID;
    }
    for (int j = 0; j < n; j++) {
      int r = owners[i][j];
      if (r < 0 || r >= w) {
        client_set_err(c, "tensor %d (%s): owner rank %d is outside [0, %d) (world_size)", i,
                       names[i], r, w);
        return PS_ERR_INVALID;
      }
      for (int q = 0; q < j; q++) {
        if (owners[i][q] == r) {
          client_set_err(c, "tensor %d (%s): owner rank %d is named twice", i, names[i], r);
          return PS_ERR_INVALID;
        }
      }
    }
  }
  return PS_OK;
}

/* Copies the checked owners into c (nothing when no tensor names any). */
static int copy_owners(ps_client *c, const int *const *owners, const int *num_owners) {
  int n = c->num_tensors;
  if (!(c->mine = calloc((size_t)n, sizeof(bool)))) return -ENOMEM;
  bool any = false;
  for (int i = 0; num_owners && i < n; i++) any = any || num_owners[i] > 0;
  for (int i = 0; i < n; i++) c->mine[i] = true;
  if (!any) return 0;
  c->num_owners = calloc((size_t)n, sizeof(uint32_t));
  c->owners = calloc((size_t)n, sizeof(uint32_t *));
  if (!c->num_owners || !c->owners) return -ENOMEM;
  for (int i = 0; i < n; i++) {
    if (num_owners[i] == 0) continue;
    if (!(c->owners[i] = calloc((size_t)num_owners[i], sizeof(uint32_t)))) return -ENOMEM;
    c->num_owners[i] = (uint32_t)num_owners[i];
    c->mine[i] = false;
    for (int j = 0; j < num_owners[i]; j++) {
      c->owners[i][j] = (uint32_t)owners[i][j];
      if (owners[i][j] == c->opts.rank) c->mine[i] = true;
    }
  }
  return 0;
}

ps_status ps_declare(ps_client *c, int num_tensors, const char *const *names,
                     const uint64_t *counts) {
  return ps_declare_owned(c, num_tensors, names, counts, NULL, NULL);
}

ps_status ps_declare_owned(ps_client *c, int num_tensors, const char *const *names,
                           const uint64_t *counts, const int *const *owners,
                           const int *num_owners) {
  if (!c || num_tensors < 1 || !names || !counts) return PS_ERR_INVALID;
  for (int i = 0; i < num_tensors; i++) {
    if (!names[i] || !counts[i]) {
      client_set_err(c, "tensor %d has no name or no elements", i);
      return PS_ERR_INVALID;
    }
  }
  ps_status ost = check_owners(c, num_tensors, names, owners, num_owners);
  if (ost != PS_OK) return ost;
  if (c->declared) {
    client_set_err(c, "the layout was already declared");
    return PS_ERR_STATE;
  }
  layout_clear(c);
  c->names = calloc((size_t)num_tensors, sizeof(char *));
  c->counts = calloc((size_t)num_tensors, sizeof(uint64_t));
  if (!c->names || !c->counts) goto nomem;
  c->num_tensors = num_tensors;
  for (int i = 0; i < num_tensors; i++) {
    if (!(c->names[i] = strdup(names[i]))) goto nomem;
    c->counts[i] = counts[i];
  }
  if (copy_owners(c, owners, num_owners) < 0) goto nomem;
  if (placement_build(c->counts, (uint32_t)num_tensors, c->chunk_bytes, (uint32_t)c->num_shards,
                      &c->placement) < 0)
    goto nomem;
  if (!(c->pulled =
            calloc(c->placement.num_chunks ? c->placement.num_chunks : 1, sizeof(*c->pulled))))
    goto nomem;
  c->layout_hash =
      placement_layout_hash((const char *const *)c->names, c->counts, (uint32_t)num_tensors,
                            c->chunk_bytes, (uint32_t)c->num_shards);
  ps_status st =
      run_on_shards(c, &(struct shard_call){.type = PS__MSG_TYPE__MSG_LAYOUT, .only = -1});
  if (st != PS_OK) {
    layout_clear(c);
    return st;
  }
  c->declared = true; /* from now on a reconnect re-declares it */
  return PS_OK;
nomem:
  layout_clear(c);
  return PS_ERR_NOMEM;
}

ps_status ps_shard_bytes(ps_client *c, uint64_t *bytes_per_shard) {
  if (!c || !bytes_per_shard) return PS_ERR_INVALID;
  if (!c->declared) return PS_ERR_STATE;
  memcpy(bytes_per_shard, c->placement.shard_bytes, (size_t)c->num_shards * sizeof(uint64_t));
  return PS_OK;
}

/* Fans a tensor operation out to its chunks. */
static ps_status tensor_op(ps_client *c, Ps__MsgType type, int tensor, uint64_t step,
                           uint64_t version, const float *src, float *dst, ps_done_fn cb, void *arg,
                           ps_request **req) {
  if (!c || (!cb && !req) || (!src && !dst)) return PS_ERR_INVALID;
  if (!c->declared) {
    client_set_err(c, "%s before ps_declare", wire_type_name(type));
    return PS_ERR_STATE;
  }
  if (tensor < 0 || tensor >= c->num_tensors) {
    client_set_err(c, "tensor index %d outside [0, %d)", tensor, c->num_tensors);
    return PS_ERR_INVALID;
  }
  if (type != PS__MSG_TYPE__MSG_INIT && !c->mine[tensor]) {
    client_set_err(c,
                   "%s of tensor %d (%s) by rank %d, which does not own it (ps_declare_owned): "
                   "only its owners push and pull it",
                   wire_type_name(type), tensor, c->names[tensor], c->opts.rank);
    return PS_ERR_INVALID;
  }
  size_t first = c->placement.first_chunk[tensor], end = c->placement.first_chunk[tensor + 1];
  int n = (int)(end - first);
  struct ps_request *r = req_new(c, n, cb, arg, req != NULL);
  /* ops are freed one by one as they complete, so each is its own allocation */
  struct op **v = calloc((size_t)n, sizeof(*v));
  bool ok = r && v;
  for (int i = 0; ok && i < n; i++) ok = (v[i] = calloc(1, sizeof(struct op))) != NULL;
  if (!ok) {
    for (int i = 0; v && i < n; i++) free(v[i]);
    free(v);
    free(r);
    return PS_ERR_NOMEM;
  }
  for (int i = 0; i < n; i++) {
    const struct placement_chunk *ch = &c->placement.chunks[first + (size_t)i];
    struct op *o = v[i];
    o->type = type;
    o->key = ch->key;
    o->step = step;
    o->version = version;
    o->chunk = first + (size_t)i;
    uint64_t base = type == PS__MSG_TYPE__MSG_PUSH ? atomic_load(&c->pulled[o->chunk]) : 0;
    if (base) { /* the gradient was computed on the chunk's last pull */
      o->version = base - 1;
      o->flags = WIRE_PUSH_BASE;
    }
    o->bytes = ch->count * sizeof(float);
    o->send_buf = src ? src + ch->offset : NULL;
    o->recv_buf = dst ? dst + ch->offset : NULL;
    o->req = r;
  }
  if (type == PS__MSG_TYPE__MSG_PUSH) {
    atomic_store(&c->started, true);
    uint64_t now = atomic_load(&c->clock);
    while (step + 1 > now && !atomic_compare_exchange_weak(&c->clock, &now, step + 1)) {
    }
  }
  if (req) *req = r;
  /* after the last submit r may already be freed (callback form) */
  for (int i = 0; i < n; i++)
    shard_submit(&c->shards[c->placement.chunks[first + (size_t)i].shard], v[i]);
  free(v);
  return PS_OK;
}

ps_status ps_init_async(ps_client *c, int tensor, const float *values, ps_done_fn cb, void *arg,
                        ps_request **req) {
  return tensor_op(c, PS__MSG_TYPE__MSG_INIT, tensor, 0, 0, values, NULL, cb, arg, req);
}

ps_status ps_push_async(ps_client *c, int tensor, uint64_t step, const float *grad, ps_done_fn cb,
                        void *arg, ps_request **req) {
  return tensor_op(c, PS__MSG_TYPE__MSG_PUSH, tensor, step, 0, grad, NULL, cb, arg, req);
}

ps_status ps_pull_async(ps_client *c, int tensor, uint64_t min_version, float *out, ps_done_fn cb,
                        void *arg, ps_request **req) {
  return tensor_op(c, PS__MSG_TYPE__MSG_PULL, tensor, 0, min_version, NULL, out, cb, arg, req);
}

ps_status ps_batch_begin(ps_client *c) {
  if (!c) return PS_ERR_INVALID;
  if (atomic_fetch_add(&c->batch_depth, 1) == 0)
    for (int i = 0; i < c->num_shards; i++) shard_cork(&c->shards[i], true);
  return PS_OK;
}

ps_status ps_batch_end(ps_client *c) {
  if (!c) return PS_ERR_INVALID;
  int d = atomic_load(&c->batch_depth);
  do {
    if (d == 0) {
      client_set_err(c, "ps_batch_end without ps_batch_begin");
      return PS_ERR_INVALID;
    }
  } while (!atomic_compare_exchange_weak(&c->batch_depth, &d, d - 1));
  if (d == 1)
    for (int i = 0; i < c->num_shards; i++) shard_cork(&c->shards[i], false);
  return PS_OK;
}

ps_status ps_init(ps_client *c, int tensor, const float *values) {
  ps_request *r;
  ps_status st = ps_init_async(c, tensor, values, NULL, NULL, &r);
  return st != PS_OK ? st : ps_wait(r, NULL);
}

ps_status ps_push(ps_client *c, int tensor, uint64_t step, const float *grad) {
  ps_request *r;
  ps_status st = ps_push_async(c, tensor, step, grad, NULL, NULL, &r);
  return st != PS_OK ? st : ps_wait(r, NULL);
}

ps_status ps_pull(ps_client *c, int tensor, uint64_t min_version, float *out, uint64_t *version) {
  ps_request *r;
  ps_status st = ps_pull_async(c, tensor, min_version, out, NULL, NULL, &r);
  return st != PS_OK ? st : ps_wait(r, version);
}

ps_status ps_barrier(ps_client *c) {
  if (!c) return PS_ERR_INVALID;
  if (!c->declared) return PS_ERR_STATE;
  return run_on_shards(c, &(struct shard_call){.type = PS__MSG_TYPE__MSG_BARRIER, .only = 0});
}

ps_status ps_stats(ps_client *c, int shard, struct ps_shard_stats *out) {
  if (!c || !out || shard < 0 || shard >= c->num_shards) return PS_ERR_INVALID;
  memset(out, 0, sizeof(*out));
  return run_on_shards(
      c, &(struct shard_call){.type = PS__MSG_TYPE__MSG_STATS, .only = shard, .stats_out = out});
}

ps_status ps_worker_clocks(ps_client *c, int shard, uint64_t *clocks, int n) {
  if (!c || !clocks || n < 0 || n > c->opts.world_size || shard < 0 || shard >= c->num_shards)
    return PS_ERR_INVALID;
  return run_on_shards(
      c, &(struct shard_call){
             .type = PS__MSG_TYPE__MSG_STATS, .only = shard, .clocks_out = clocks, .n_clocks = n});
}

uint64_t ps_rollback_clock(ps_client *c) {
  return c ? atomic_load(&c->rollback_clock) : UINT64_MAX;
}

ps_status ps_rollback(ps_client *c, uint64_t clock) {
  if (!c) return PS_ERR_INVALID;
  if (!c->declared) return PS_ERR_STATE;
  /* The id names the job rollback the refusal belonged to: every shard
   * rolls back once per id, however many ranks ask (docs/RELIABILITY.md). */
  uint64_t id = atomic_load(&c->rollback_clock) == clock ? atomic_load(&c->rollback_id) : 0;
  /* The shards forget this rank's ps_leave with it: it replays its steps.
   * Forgotten first, so a reconnect meanwhile does not say it again. */
  atomic_store(&c->leave, 0);
  ps_status st = run_on_shards(
      c, &(struct shard_call){
             .type = PS__MSG_TYPE__MSG_ROLLBACK, .only = -1, .version = clock, .rollback_id = id});
  if (st == PS_OK) atomic_store(&c->rollback_clock, UINT64_MAX);
  return st;
}

ps_status ps_leave(ps_client *c, ps_leave_kind kind) {
  if (!c) return PS_ERR_INVALID;
  if (kind != PS_LEAVE_JOINED && kind != PS_LEAVE_FINISHED) {
    client_set_err(c, "ps_leave: kind %d is neither PS_LEAVE_JOINED nor PS_LEAVE_FINISHED",
                   (int)kind);
    return PS_ERR_INVALID;
  }
  if (!c->declared) {
    client_set_err(c, "ps_leave before ps_declare");
    return PS_ERR_STATE;
  }
  /* Set before sending: a reconnect meanwhile says it in its handshake.
   * FINISHED after JOINED keeps JOINED. */
  int now = atomic_load(&c->leave) == PS_LEAVE_JOINED ? PS_LEAVE_JOINED : (int)kind;
  atomic_store(&c->leave, now);
  return run_on_shards(
      c, &(struct shard_call){.type = PS__MSG_TYPE__MSG_LEAVE, .only = -1, .flags = (uint32_t)now});
}

ps_status ps_rejoin(ps_client *c, uint64_t *step) {
  if (!c || !step) return PS_ERR_INVALID;
  if (atomic_load(&c->leave) != PS_LEAVE_JOINED) {
    client_set_err(c, "ps_rejoin without ps_leave(PS_LEAVE_JOINED) first");
    return PS_ERR_STATE;
  }
  /* Forgotten first, so a reconnect meanwhile does not say it again. */
  atomic_store(&c->leave, 0);
  ps_status st = run_on_shards(
      c, &(struct shard_call){.type = PS__MSG_TYPE__MSG_LEAVE, .only = -1, .flags = 0});
  return st == PS_OK ? ps_resume_step(c, step) : st;
}

ps_status ps_lost_workers(ps_client *c, int *ranks, int max, int *count) {
  if (!c || !count || max < 0 || (max > 0 && !ranks)) return PS_ERR_INVALID;
  bool *lost = calloc((size_t)c->opts.world_size, sizeof(bool));
  if (!lost) return PS_ERR_NOMEM;
  ps_status st = run_on_shards(
      c, &(struct shard_call){.type = PS__MSG_TYPE__MSG_STATS, .only = -1, .lost_out = lost});
  int n = 0;
  for (int i = 0; st == PS_OK && i < c->opts.world_size; i++) {
    if (!lost[i]) continue;
    if (n < max) ranks[n] = i;
    n++;
  }
  free(lost);
  if (st == PS_OK) *count = n;
  return st;
}

ps_status ps_resume_step(ps_client *c, uint64_t *step) {
  if (!c || !step) return PS_ERR_INVALID;
  if (!c->declared) {
    client_set_err(c, "ps_resume_step before ps_declare");
    return PS_ERR_STATE;
  }
  int me = c->opts.rank;
  uint64_t lowest = UINT64_MAX;
  uint64_t *clocks = calloc((size_t)me + 1, sizeof(uint64_t));
  if (!clocks) return PS_ERR_NOMEM;
  for (int i = 0; i < c->num_shards; i++) {
    ps_status st = ps_worker_clocks(c, i, clocks, me + 1);
    if (st != PS_OK) {
      free(clocks);
      return st;
    }
    if (clocks[me] < lowest) lowest = clocks[me];
  }
  free(clocks);
  *step = lowest == UINT64_MAX ? 0 : lowest; /* no shard holds a key: nothing pushed */
  return PS_OK;
}

void ps_client_counters(ps_client *c, struct ps_client_counters *out) {
  memset(out, 0, sizeof(*out));
  if (!c) return;
  out->pushes = atomic_load_explicit(&c->n_pushes, memory_order_relaxed);
  out->pulls = atomic_load_explicit(&c->n_pulls, memory_order_relaxed);
  out->bytes_sent = atomic_load_explicit(&c->bytes_sent, memory_order_relaxed);
  out->bytes_received = atomic_load_explicit(&c->bytes_received, memory_order_relaxed);
  out->reconnects = atomic_load_explicit(&c->n_reconnects, memory_order_relaxed);
  int up = atomic_load(&c->shards_up);
  out->connected_shards = up < 0 ? 0 : up;
  out->num_shards = c->num_shards;
}

ps_status ps_shutdown_servers(ps_client *c) {
  if (!c) return PS_ERR_INVALID;
  if (c->opts.rank != 0) {
    client_set_err(c, "only rank 0 may shut the shards down");
    return PS_ERR_STATE;
  }
  pthread_mutex_lock(&c->mu);
  c->shutting_down = true; /* the shards will close: do not reconnect */
  pthread_mutex_unlock(&c->mu);
  return run_on_shards(c, &(struct shard_call){.type = PS__MSG_TYPE__MSG_SHUTDOWN, .only = -1});
}
