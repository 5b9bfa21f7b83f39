/* local_nodes: ps-local across hosts (--nodes N > 1), torchrun's model. Each
 * node starts its own --shards and --workers (per node) as on one host,
 * listening on the address it reaches the rendezvous from; node I's workers
 * are ranks I*K .. I*K+K-1 and its shards I*S .. I*S+S-1. Node 0 serves the
 * rendezvous (rendezvous.c) at --rendezvous HOST:PORT; the job's shards and
 * ring are the table it hands out once every node registered. A child that
 * fails on any node stops every node ("node I (host) failed: what"), and a
 * node that vanishes is noticed within RDZV_LOST_MS. The hooks below are
 * called from local_run.c and do nothing on one node. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "auth.h"
#include "clock.h"
#include "local_run_impl.h"
#include "log.h"
#include "rendezvous.h"

int nodes_start(struct launcher *L) {
  const struct local_config *cfg = L->cfg;
  if (cfg->nodes <= 1) return 0;
  char err[512], warn[256];
  if (L->token[0] &&
      auth_token_load(L->token, &L->rdzv_tok, err, sizeof(err), warn, sizeof(warn)) < 0) {
    fprintf(stderr, "ps-local: option --auth-token-file: %s\n", err);
    return -1;
  }
  int timeout_ms = (int)(cfg->rendezvous_timeout * 1000);
  if (cfg->node_rank == 0 && rdzv_serve(&L->rdzv_srv, cfg->rendezvous, (int)cfg->nodes, timeout_ms,
                                        L->rdzv_tok, err, sizeof(err)) < 0) {
    fprintf(stderr, "ps-local: option --rendezvous: cannot serve it at %s: %s\n", cfg->rendezvous,
            err);
    return -1;
  }
  if (rdzv_connect(&L->rdzv, cfg->rendezvous, (int)cfg->node_rank, (int)cfg->nodes, timeout_ms,
                   L->rdzv_tok, L->host, sizeof(L->host), err, sizeof(err)) < 0) {
    fprintf(stderr, "ps-local: node %lld: %s\n", (long long)cfg->node_rank, err);
    return -1;
  }
  /* One job id on every node: the shards' checkpoints name it. */
  uint32_t h = 2166136261u;
  for (const char *p = cfg->rendezvous; *p; p++) h = (h ^ (uint8_t)*p) * 16777619u;
  snprintf(L->job_id, sizeof(L->job_id), "nodes-%08x", h);
  fprintf(stderr, "ps-local: node %lld of %lld on %s, rendezvous %s (ranks %d..%d of %d)\n",
          (long long)cfg->node_rank, (long long)cfg->nodes, L->host, cfg->rendezvous, L->rank0,
          L->rank0 + (int)cfg->workers - 1, L->world);
  return 0;
}

/* A failure elsewhere: remembered, and our children stopped. */
static void remote_failed(struct launcher *L, const char *why) {
  if (!L->remote_fail[0]) snprintf(L->remote_fail, sizeof(L->remote_fail), "%s", why);
  if (L->phase != PHASE_STOP) local_begin_stop(L);
}

int nodes_exchange(struct launcher *L, char **servers) {
  if (!L->rdzv) return 0;
  char err[512];
  if (rdzv_register(L->rdzv, *servers ? *servers : "", L->peers ? L->peers : "", err, sizeof(err)) <
      0) {
    remote_failed(L, err);
    return -1;
  }
  for (;;) {
    int r = rdzv_poll(L->rdzv, err, sizeof(err));
    if (r < 0) {
      remote_failed(L, err);
      return -1;
    }
    if (r == 1) break;
    local_pump(L, 100); /* a signal, or one of our shards failing meanwhile */
    if (L->phase == PHASE_STOP) return -1;
  }
  const char *sv, *pr;
  rdzv_table(L->rdzv, &sv, &pr);
  char *a = strdup(sv), *b = strdup(pr);
  if (!a || !b) {
    free(a);
    free(b);
    return -1;
  }
  free(*servers);
  *servers = a;
  free(L->peers);
  L->peers = b;
  log_info("table", "servers=%s peers=%s", a, b);
  return 0;
}

/* Tells the rendezvous which of our children failed first, and how. */
static void send_failure(struct launcher *L) {
  struct child *k = L->first_failure;
  char how[160], what[300];
  if (k->why[0])
    snprintf(how, sizeof(how), "%s", k->why);
  else
    procs_describe(k->proc.status, how, sizeof(how));
  snprintf(what, sizeof(what), "%s failed: %s", k->proc.name, how);
  rdzv_fail(L->rdzv, what);
  L->fail_sent = true;
}

/* A worker that exited 129 (it lost a peer) most likely lost it to another
 * node's failure, which the rendezvous relays within a moment: our own
 * failure is reported only if none arrives within 3 s, so that every node
 * names the cause, whichever FAIL reaches the rendezvous first. */
static bool lost_peer(const struct child *k) {
  return !k->why[0] && WIFEXITED(k->proc.status) && WEXITSTATUS(k->proc.status) == EXIT_RETRY;
}

void nodes_poll(struct launcher *L) {
  if (!L->rdzv) return;
  if (L->first_failure && !L->fail_sent && !L->remote_fail[0] && lost_peer(L->first_failure)) {
    uint64_t now = clock_now_ms();
    if (!L->fail_hold_ms) L->fail_hold_ms = now + 3000;
    char err[512];
    if (now < L->fail_hold_ms && L->phase != PHASE_START) {
      if (rdzv_poll(L->rdzv, err, sizeof(err)) < 0) remote_failed(L, err);
      return;
    }
  }
  if (L->first_failure && !L->fail_sent && !L->remote_fail[0]) {
    send_failure(L);
    return;
  }
  if (L->fail_sent || L->phase == PHASE_START) return; /* START: nodes_exchange reads */
  char err[512];
  if (rdzv_poll(L->rdzv, err, sizeof(err)) < 0) remote_failed(L, err);
}

int nodes_finish(struct launcher *L, int code) {
  if (!L->rdzv) return code;
  const struct local_config *cfg = L->cfg;
  /* Our worker that lost a peer (129) most likely lost it to another node's
   * failure: its message, if it comes within 3 s, names the cause. */
  uint64_t until = clock_now_ms() + 3000;
  while (code != 0 && !L->remote_fail[0] && !L->stop_signal && clock_now_ms() < until &&
         !L->fail_sent && L->first_failure && lost_peer(L->first_failure)) {
    char err[512];
    if (rdzv_poll(L->rdzv, err, sizeof(err)) < 0)
      snprintf(L->remote_fail, sizeof(L->remote_fail), "%s", err);
    clock_sleep_ms(100);
  }
  if (L->remote_fail[0]) {
    fprintf(stderr, "ps-local: node %lld (%s): stopped: %s\n", (long long)cfg->node_rank, L->host,
            L->remote_fail);
    return code == EXIT_RETRY ? EXIT_RETRY : 1;
  }
  if (code == 0) rdzv_done(L->rdzv);
  return code;
}

void nodes_end(struct launcher *L) {
  /* a failure nodes_poll did not get to send (or held back: lost_peer) */
  if (L->rdzv && !L->fail_sent && !L->remote_fail[0] && L->first_failure) send_failure(L);
  rdzv_close(L->rdzv);
  L->rdzv = NULL;
  /* node 0 waits for the others to say done or fail, within a bound */
  rdzv_server_stop(L->rdzv_srv, 30000);
  L->rdzv_srv = NULL;
  auth_token_free(L->rdzv_tok);
  L->rdzv_tok = NULL;
}
