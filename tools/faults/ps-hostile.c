/* ps-hostile: a hostile client for one shard (issue 8): many connections,
 * mutated frames, slow and idle connections, and what became of each.
 *
 * Threat model. The attacker reaches the shard's port and may hold the
 * job's token (a stolen Secret: it authenticates and claims a rank a real
 * worker uses). It must not change the job's result, crash the shard, grow
 * its memory without bound or hold its resources past the deadlines. A
 * worker that sends valid but wrong gradients for its own rank is outside
 * the model, so with the token this tool sends only frames the shard must
 * refuse: every push it tags holds NaN or Inf (and may also claim another
 * rank, size or key), and it never sends a valid pull, barrier, rollback,
 * layout or a SHUTDOWN as rank 0. What it sends:
 *   before authentication: garbage, bad magic/version, header lengths 0,
 *   max+1 and 65535, payload lengths 1, max-1, max, max+1, 2^32-1, 2^64-1,
 *   truncated frames, invalid protobuf, unknown fields, data frames before
 *   hello and before the proof, bad nonces, wrong and reflected proofs, a
 *   replayed handshake, bit flips in HELLO and AUTH, impossible ranks;
 *   after it: NaN/Inf pushes and inits, replays on the same and on another
 *   connection, bit flips anywhere in a tagged frame, forged and missing
 *   tags, wrong payload sizes, unknown keys and types, pushes as another
 *   rank, a second hello, bad layouts, oversized headers, truncated frames
 *   and a SHUTDOWN from a rank other than 0; with --reply-flood, requests
 *   whose replies are never read (the shard's output queue limit).
 * It first finds the shard's keys (pushes of 4 NaN bytes to keys (t, c):
 * the refusal names the key's size, or says the shard holds no such key),
 * so that NaN pushes have the right size and reach the NaN check.
 *
 * A probe is a small script on its own connection(s): setup frames (hello,
 * authentication, a valid STATS to replay) and mutated frames, each judged
 * against an expectation by the engine (hostile.h): the codes that are a
 * correct refusal, those that mean a check was skipped, whether a silent
 * drop is the refusal and whether a normal reply is harmless (a bit flip
 * may leave a HELLO valid). --threads threads run every probe once, then
 * random ones, until --frames or --seconds; at most --connections of their
 * connections are open at once. The --slowloris, --idle and --reply-flood
 * connections are opened first and held by the engine's reaper until the
 * shard drops them. The probes live in probe_preauth.c (before
 * authentication) and probe_authed.c (after it), their shared helpers in
 * probe.c; this file holds the options, the probe table, the search for
 * keys, the held connections and the threads.
 *
 * With --transport ucx the shard's --listen port is UCX's connection
 * manager, which no ps frame reaches: the probes are then random bytes
 * (left open, half-closed or closed at once) and a ps HELLO (a TCP client
 * at a UCX port), each to be dropped without a reply, plus the held
 * slowloris and idle connections; no token, no keys.
 *
 * Output: per-probe counts on stderr, then one line on stdout:
 *   hostile frames=N rejected=N dropped=N tolerated=N accepted=N
 *   unexpected=N closed=N stuck=N connections=N silent_closes=N keys=N
 *   setup_failures=N bad_reply_tags=N slowloris=N slowloris_dropped=N
 *   slowloris_max_s=S (and the same for auth_slowloris, idle, auth_idle,
 *   reply_flood) reply_flood_requests=N seconds=S errors_by_code=kind:n,...
 * preceded with --transport ucx by "hostile-ucx abandoned=N" (connections
 * closed by us at once: only the shard's fds say what became of them).
 * errors_by_code counts every error frame received, by the kind label of
 * the shard's ps_server_errors_total; silent_closes counts the connections
 * the shard closed without one (its deadline drops, kind "limit"), so both
 * compare with the shard's /metrics. SIGINT or SIGTERM ends the attack the
 * same way as --seconds. Exit 0; 1 if a frame was accepted or a
 * connection stuck or never dropped; 2 on bad usage; 3 if the shard could
 * not be reached. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "auth.h"
#include "clock.h"
#include "config.h"
#include "frame.h"
#include "hostile.h"
#include "net.h"
#include "probe.h"

/* ---- configuration ------------------------------------------------------ */

struct hostile_config {
  char server[512];
  char auth_token_file[4096];
  char transport[8];
  int64_t rank, world_size, connections, threads, frames, slowloris, idle, reply_flood, seed;
  double seconds, drain_seconds;
  uint64_t max_frame_bytes;
};

static int check_server(const char *v, char *err, size_t errlen) {
  struct net_addr a;
  if (!v[0]) return 0; /* required: main says so */
  return net_parse_addr(v, &a, 0, err, errlen) < 0 ? -EINVAL : 0;
}

static int check_transport(const char *v, char *err, size_t errlen) {
  if (!strcmp(v, "tcp") || !strcmp(v, "ucx")) return 0;
  snprintf(err, errlen, "\"%s\": tcp or ucx", v);
  return -EINVAL;
}

#define CONFIG_STRUCT struct hostile_config
static const struct config_option hostile_options[] = {
    CONFIG_CHOICE("server", server, "", check_server, "the shard to attack (host:port)"),
    CONFIG_OPT(
        "auth-token-file", CONFIG_STRING, auth_token_file, "", 0, 0,
        "the job's token: also attack as an authenticated worker of rank --rank (without it, "
        "only unauthenticated frames)"),
    CONFIG_CHOICE(
        "transport", transport, "tcp", check_transport,
        "the shard's --transport: tcp (frames), or ucx (its --listen port is UCX's connection "
        "manager: every connection is a peer that does not speak UCX, refused by the shard's "
        "guard; no frames, no token)"),
    CONFIG_OPT("rank", CONFIG_INT, rank, "0", 0, 65535,
               "rank the authenticated connections claim (one a real worker uses)"),
    CONFIG_OPT("world-size", CONFIG_INT, world_size, "1", 1, 65536, "the shard's --num-workers"),
    CONFIG_OPT("connections", CONFIG_INT, connections, "32", 1, 900,
               "connections of the probes open at once (keep below the shard's --max-connections)"),
    CONFIG_OPT("threads", CONFIG_INT, threads, "4", 1, 64, "threads running probes"),
    CONFIG_OPT("frames", CONFIG_INT, frames, "2000", 0, 1e9, "mutated frames to send"),
    CONFIG_OPT("seconds", CONFIG_DOUBLE, seconds, "10", 0, 86400,
               "stop starting probes after this long even if --frames are not all sent (as on "
               "SIGINT/SIGTERM; the outcomes in flight are still collected and reported)"),
    CONFIG_OPT(
        "drain-seconds", CONFIG_DOUBLE, drain_seconds, "15", 0.1, 3600,
        "a connection still open and silent this long after its last mutated frame (or after "
        "a held connection started) is stuck: the shard should have answered or dropped it"),
    CONFIG_OPT(
        "slowloris", CONFIG_INT, slowloris, "4", 0, 400,
        "connections that send a frame one byte a second (half of them after authenticating)"),
    CONFIG_OPT("idle", CONFIG_INT, idle, "4", 0, 400,
               "connections that send nothing (half of them after authenticating)"),
    CONFIG_OPT(
        "reply-flood", CONFIG_INT, reply_flood, "0", 0, 400,
        "authenticated connections that send STATS requests as fast as the shard takes them "
        "while the attack lasts and never read the replies (needs the token): the shard must "
        "stop reading from them and drop them without its memory growing past "
        "--max-output-queue-bytes"),
    CONFIG_OPT("seed", CONFIG_INT, seed, "1", 0, 9.2e18, "seed of the mutations"),
    CONFIG_OPT("max-frame-bytes", CONFIG_SIZE, max_frame_bytes, "64MiB", 4, 4294967295.0,
               "the shard's --max-frame-bytes: payload lengths max-1, max and max+1 are sent"),
};

static const struct config_spec hostile_spec = {
    "ps-hostile",
    "a hostile client: mutated frames, slow and idle connections against one shard, each "
    "outcome classified",
    hostile_options, sizeof(hostile_options) / sizeof(hostile_options[0]), NULL};

/* SIGINT/SIGTERM: start no more probes; the outcomes in flight are still
 * collected and reported (tools/bench/bench-hostile attacks for as long as a
 * benchmark runs). */
static atomic_bool stop_requested; /* lock-free: safe in a handler, read by every thread */

static void on_stop(int sig) {
  (void)sig;
  atomic_store(&stop_requested, true);
}

/* ---- probes of a UCX shard's port ------------------------------------------ */

/* --transport ucx: the --listen port is UCX's TCP connection manager, whose
 * first message is {size_t length; u8 status; private data}. Anything else
 * (random bytes, a ps frame meant for a TCP shard) must be dropped by the
 * shard (common/ucx_guard.c: reset after 0.3 s unread or half-closed, 10 s
 * silent) without a byte in reply; the held slowloris and idle connections
 * test the silent case. */
static bool ucx_mode;
static atomic_uint_fast64_t abandoned; /* closed by us at once: the shard's fds tell */

static void ucx_random(struct probe_ctx *p, size_t n) {
  for (size_t i = 0; i < n; i++) p->fb[i] = (uint8_t)probe_rnd(p);
}

/* Random bytes (16 B to 4 KiB), then: wait for the drop, half-close and
 * wait, or close at once. */
static void probe_ucx_garbage(struct probe_ctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  size_t n = 16 + probe_rnd(p) % 4081;
  unsigned how = (unsigned)(probe_rnd(p) % 3);
  ucx_random(p, n);
  hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
  if (how == 2) {
    atomic_fetch_add(&abandoned, 1);
    probe_close(p, c);
    return;
  }
  if (how == 1) hostile_conn_shutdown_write(c);
  snprintf(p->variant, sizeof(p->variant), "%zu random bytes%s", n,
           how == 1 ? ", then half-closed" : "");
  probe_judge(p, &c, probe_expect(0, 0, HOSTILE_DROP));
  probe_close(p, c);
}

/* A ps HELLO, as a worker with --transport tcp would send it. */
static void probe_ucx_ps_hello(struct probe_ctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  size_t n = probe_enc_hello(p, p->A->rank, p->A->world, AUTH_NONCE_BYTES);
  snprintf(p->variant, sizeof(p->variant), "a ps HELLO of %zu bytes", n);
  hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
  probe_judge(p, &c, probe_expect(0, 0, HOSTILE_DROP));
  probe_close(p, c);
}

/* ---- the probe table ----------------------------------------------------- */

struct probe {
  const char *name;
  void (*fn)(struct probe_ctx *p); /* NULL: not run by the probe threads */
  unsigned needs;
};
enum { N_TOKEN = 1, N_KEYS = 2, N_LAYOUT = 4, N_NONZERO_RANK = 8, N_NEVER = 16, N_UCX = 32 };

static const struct probe probes[] = {
    {"garbage", probe_garbage, 0},
    {"bad-preamble", probe_bad_preamble, 0},
    {"truncated-hello", probe_truncated_hello, 0},
    {"bad-header", probe_bad_header, 0},
    {"unknown-fields-hello", probe_unknown_fields_hello, 0},
    {"data-before-hello", probe_data_before_hello, 0},
    {"data-after-hello", probe_data_after_hello, N_TOKEN},
    {"bad-nonce", probe_bad_nonce, 0},
    {"wrong-proof", probe_wrong_proof, N_TOKEN},
    {"replay-handshake", probe_replay_handshake, N_TOKEN},
    {"flip-hello", probe_flip_hello, 0},
    {"flip-auth", probe_flip_auth, N_TOKEN},
    {"bad-rank-hello", probe_bad_rank_hello, N_TOKEN},
    {"nan", probe_nan, N_TOKEN | N_KEYS},
    {"replay-other-conn", probe_replay_other, N_TOKEN | N_KEYS},
    {"replay-stats", probe_replay_stats, N_TOKEN},
    {"flip-authed", probe_flip_authed, N_TOKEN},
    {"forged-tag", probe_forged_tag, N_TOKEN},
    {"wrong-size", probe_wrong_size, N_TOKEN | N_KEYS},
    {"unknown-key", probe_unknown_key, N_TOKEN | N_LAYOUT},
    {"other-rank", probe_other_rank, N_TOKEN | N_KEYS},
    {"unknown-type", probe_unknown_type, N_TOKEN},
    {"handshake-again", probe_handshake_again, N_TOKEN},
    {"bad-layout", probe_bad_layout, N_TOKEN | N_LAYOUT},
    {"lengths-authed", probe_lengths_authed, N_TOKEN},
    {"truncated-authed", probe_truncated_authed, N_TOKEN | N_KEYS},
    {"shutdown-not-rank-0", probe_shutdown, N_TOKEN | N_NONZERO_RANK},
    {"ucx-garbage", probe_ucx_garbage, N_UCX},
    {"ucx-ps-hello", probe_ucx_ps_hello, N_UCX},
    {"find-keys", NULL, N_NEVER}, /* find_keys' frames */
};
static const int num_probes = (int)(sizeof(probes) / sizeof(probes[0]));

/* ---- finding keys ----------------------------------------------------------- */

/* Pushes of 4 NaN bytes to keys (tensor t, chunk c) for small t and c: the
 * shard's refusal says whether it holds the key (BAD_SIZE names its size,
 * NONFINITE means it is 4 bytes) or not (BAD_KEY), or that no layout is
 * registered yet (NO_LAYOUT: tried again until --seconds). Each is a
 * mutated frame (a wrong size or an unknown key) and counted as one. */
static void find_keys(struct probe_ctx *p) {
  struct attack *A = p->A;
  p->probe = num_probes - 1;
  for (;;) {
    bool no_layout = false;
    for (uint64_t t = 0; t < 8; t++) {
      for (uint64_t ch = 0; ch < 2; ch++) {
        struct hostile_conn *c = probe_open_authed(p);
        if (!c) continue;
        uint64_t key = t << 32 | ch;
        probe_fill_nonfinite(p, 1, 0);
        size_t n = probe_enc_data(p, PS__MSG_TYPE__MSG_PUSH, A->rank, key, 4);
        uint8_t tag[AUTH_TAG_BYTES];
        snprintf(p->variant, sizeof(p->variant), "4-byte push to key %016" PRIx64 " (finding keys)",
                 key);
        hostile_conn_send_sealed(c, p->fb, n, p->pay, 4, tag);
        struct hostile_reply rep;
        int o = probe_judge_for(
            p, &c, probe_expect(C(BAD_SIZE) | C(BAD_KEY) | C(NO_LAYOUT) | C(NONFINITE), 0, 0),
            PROBE_SETUP_MS, &rep);
        probe_close(p, c);
        if (o != HOSTILE_REJECTED) continue;
        uint64_t count = 0;
        const char *e = strstr(rep.msg, "expected ");
        if (rep.code == PS__ERROR_CODE__ERR_BAD_SIZE && e) count = strtoull(e + 9, NULL, 10) / 4;
        if (rep.code == PS__ERROR_CODE__ERR_NONFINITE) count = 1;
        if (rep.code == PS__ERROR_CODE__ERR_NO_LAYOUT)
          no_layout = true;
        else
          A->have_layout = true;
        if (count > 0 && A->num_keys < PROBE_MAX_KEYS) {
          A->keys[A->num_keys++] = (struct key_info){key, count};
          if (count * 4 > A->max_key_bytes) A->max_key_bytes = count * 4;
        }
      }
      if (no_layout) break;
    }
    if (!no_layout || clock_now_ns() >= A->end_ns || atomic_load(&stop_requested)) return;
    clock_sleep_ms(200);
  }
}

/* ---- held connections -------------------------------------------------------- */

static void hold(struct probe_ctx *p, enum hostile_holder kind) {
  struct attack *A = p->A;
  struct hostile_conn *c = hostile_conn_open(A->h, false);
  if (!c) return;
  bool authed = kind == HOSTILE_SLOW_AUTH || kind == HOSTILE_IDLE_AUTH || kind == HOSTILE_FLOOD;
  if (authed && hostile_handshake(A->h, c, &p->arena) < 0) {
    hostile_conn_close(A->h, c);
    return;
  }
  if (kind == HOSTILE_SLOW || kind == HOSTILE_SLOW_AUTH) { /* a 200-byte header, 1 byte a second */
    frame_preamble_encode(p->fb, 200, 0);
    hostile_conn_write(c, p->fb, FRAME_PREAMBLE_BYTES, NULL, 0, NULL, 0);
  }
  hostile_hold(A->h, c, kind);
}

/* ---- running it ----------------------------------------------------------- */

/* Runs every available probe once, then random ones, until --frames or
 * --seconds. */
static void *prober_main(void *arg) {
  struct probe_ctx *p = arg;
  struct attack *A = p->A;
  if (A->num_avail == 0) return NULL;
  while (hostile_sent(A->h) < (uint64_t)A->cfg->frames && clock_now_ns() < A->end_ns &&
         !atomic_load(&stop_requested)) {
    uint64_t i = atomic_fetch_add(&A->next_probe, 1);
    p->probe = A->avail[i < (uint64_t)A->num_avail ? i : probe_rnd(p) % (uint64_t)A->num_avail];
    p->variant[0] = 0;
    probes[p->probe].fn(p);
  }
  return NULL;
}

/* The held connections first (timed from their start), then the keys (the
 * probe threads' payload buffers are sized to them), then the probe
 * threads; returns when every outcome is in. */
static int attack_run(struct attack *A) {
  const struct hostile_config *cfg = A->cfg;
  struct probe_ctx main_ctx;
  int ret = -ENOMEM;
  if (probe_ctx_init(&main_ctx, A, (uint64_t)cfg->seed) < 0) goto out;
  for (int64_t i = 0; i < cfg->slowloris; i++)
    hold(&main_ctx, A->token && i % 2 ? HOSTILE_SLOW_AUTH : HOSTILE_SLOW);
  for (int64_t i = 0; i < cfg->idle; i++)
    hold(&main_ctx, A->token && i % 2 ? HOSTILE_IDLE_AUTH : HOSTILE_IDLE);
  for (int64_t i = 0; A->token && i < cfg->reply_flood; i++) hold(&main_ctx, HOSTILE_FLOOD);
  if (A->token) find_keys(&main_ctx);
  for (int i = 0; i < num_probes; i++) {
    unsigned needs = probes[i].needs;
    if ((needs & N_NEVER) || !(needs & N_UCX) != !ucx_mode || ((needs & N_TOKEN) && !A->token) ||
        ((needs & N_KEYS) && A->num_keys == 0) || ((needs & N_LAYOUT) && !A->have_layout) ||
        ((needs & N_NONZERO_RANK) && A->rank == 0))
      continue;
    A->avail[A->num_avail++] = i;
  }
  int nthreads = (int)cfg->threads, started = 0;
  struct probe_ctx *ctx = calloc((size_t)nthreads, sizeof(*ctx));
  pthread_t *th = calloc((size_t)nthreads, sizeof(*th));
  for (int i = 0; ctx && th && i < nthreads; i++) {
    if (probe_ctx_init(&ctx[i], A, (uint64_t)cfg->seed + 1 + (uint64_t)i) < 0 ||
        pthread_create(&th[i], NULL, prober_main, &ctx[i]) != 0)
      break;
    started++;
  }
  for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
  while (cfg->reply_flood > 0 && A->token && clock_now_ns() < A->end_ns &&
         !atomic_load(&stop_requested)) { /* a flood lasts --seconds, frames or not */
    clock_sleep_ms(50);
  }
  for (int i = 0; ctx && i < nthreads; i++) probe_ctx_deinit(&ctx[i]);
  free(ctx);
  free(th);
  ret = started > 0 ? 0 : -EAGAIN;
out:
  probe_ctx_deinit(&main_ctx);
  return ret;
}

int main(int argc, char **argv) {
  static struct hostile_config cfg;
  int r = config_parse(&hostile_spec, &cfg, argc, argv, NULL, stderr);
  if (r == CONFIG_HELP || r == CONFIG_VERSION) return 0;
  if (r < 0) return 2;
  ucx_mode = !strcmp(cfg.transport, "ucx");
  if (ucx_mode && (cfg.auth_token_file[0] || cfg.reply_flood)) {
    fprintf(stderr,
            "ps-hostile: options --auth-token-file and --reply-flood: not with "
            "--transport ucx (no frame reaches a UCX shard before UCX's handshake)\n");
    return 2;
  }
  if (!cfg.server[0]) {
    fprintf(stderr, "ps-hostile: option --server is required\n");
    return 2;
  }
  if (cfg.rank >= cfg.world_size) {
    fprintf(stderr,
            "ps-hostile: option --rank: %" PRId64 " is not below --world-size %" PRId64 "\n",
            cfg.rank, cfg.world_size);
    return 2;
  }
  char err[600];
  struct auth_token *token = NULL;
  if (auth_token_option("ps-hostile", cfg.auth_token_file, &token) < 0) return 2;
  signal(SIGPIPE, SIG_IGN);
  struct sigaction sa = {.sa_handler = on_stop}; /* no SA_RESTART: a wait ends early */
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  static const char *names[sizeof(probes) / sizeof(probes[0])];
  for (int i = 0; i < num_probes; i++) names[i] = probes[i].name;
  struct hostile_opts ho = {.token = token,
                            .rank = (uint32_t)cfg.rank,
                            .world = (uint32_t)cfg.world_size,
                            .connections = (int)cfg.connections,
                            .drain_seconds = cfg.drain_seconds,
                            .probe_names = names,
                            .num_probes = num_probes};
  net_parse_addr(cfg.server, &ho.addr, 0, err, sizeof(err));
  static struct attack A;
  A.cfg = &cfg;
  A.token = token;
  A.rank = ho.rank;
  A.world = ho.world;
  A.max_frame = cfg.max_frame_bytes;
  uint64_t start = clock_now_ns();
  A.end_ns = start + (uint64_t)(cfg.seconds * 1e9);

  int ret = 3;
  char cerr[256];
  struct net_backoff bo = {50, 500, 5000};
  int fd = net_connect(&ho.addr, &bo, cerr, sizeof(cerr)); /* is the shard there at all? */
  if (fd < 0) {
    fprintf(stderr, "ps-hostile: cannot reach %s: %s\n", cfg.server, cerr);
    goto out;
  }
  close(fd);
  if (hostile_new(&ho, &A.h) < 0) goto out;
  r = attack_run(&A);
  hostile_finish(A.h);
  if (ucx_mode) /* before the summary line, which readers take as the end */
    printf("hostile-ucx abandoned=%" PRIu64 "\n", (uint64_t)atomic_load(&abandoned));
  hostile_report(A.h, stdout, stderr, A.num_keys, (double)(clock_now_ns() - start) / 1e9);
  ret = r < 0 ? 3 : hostile_findings(A.h) ? 1 : 0;
  hostile_free(A.h);
out:
  auth_token_free(token);
  return ret;
}
