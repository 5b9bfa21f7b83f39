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
 * shard drops them.
 *
 * Output: per-probe counts on stderr, then one line on stdout:
 *   hostile frames=N rejected=N dropped=N tolerated=N accepted=N
 *   unexpected=N closed=N stuck=N connections=N silent_closes=N keys=N
 *   setup_failures=N bad_reply_tags=N slowloris=N slowloris_dropped=N
 *   slowloris_max_s=S (and the same for auth_slowloris, idle, auth_idle,
 *   reply_flood) reply_flood_requests=N seconds=S errors_by_code=kind:n,...
 * errors_by_code counts every error frame received, by the kind label of
 * the shard's ps_server_errors_total; silent_closes counts the connections
 * the shard closed without one (its deadline drops, kind "limit"), so both
 * compare with the shard's /metrics. SIGINT or SIGTERM ends the attack the
 * same way as --seconds. Exit 0; 1 if a frame was accepted or a
 * connection stuck or never dropped; 2 on bad usage; 3 if the shard could
 * not be reached. */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "auth.h"
#include "clock.h"
#include "config.h"
#include "frame.h"
#include "handshake.h"
#include "hostile.h"
#include "net.h"
#include "wire.h"

enum {
  FB_BYTES = 70000,           /* preamble + the largest header */
  FULL_FRAME_MAX = 60 * 1024, /* larger wrong-size frames: preamble and header only */
  SYNC_MS = 200,              /* then the engine's reaper waits for the outcome */
  FOLLOW_MS = 2000,           /* the same where a reply leads to a next frame */
  SETUP_MS = 5000,            /* NaN pushes: their refusal leads to the next frame */
  MAX_KEYS = 64,
};

#define C(x) HOSTILE_CODE(x)

/* ---- configuration ------------------------------------------------------ */

struct hostile_config {
  char server[512];
  char auth_token_file[4096];
  int64_t rank, world_size, connections, threads, frames, slowloris, idle, reply_flood, seed;
  double seconds, drain_seconds;
  uint64_t max_frame_bytes;
};

static int check_server(const char *v, char *err, size_t errlen) {
  struct net_addr a;
  if (!v[0]) return 0; /* required: main says so */
  return net_parse_addr(v, &a, 0, err, errlen) < 0 ? -EINVAL : 0;
}

#define OPT(...) CONFIG_OPTION(struct hostile_config, __VA_ARGS__)

static const struct config_option hostile_options[] = {
    OPT("server", CONFIG_STRING, server, "", 0, 0, check_server, "the shard to attack (host:port)"),
    OPT("auth-token-file", CONFIG_STRING, auth_token_file, "", 0, 0, NULL,
        "the job's token: also attack as an authenticated worker of rank --rank (without it, "
        "only unauthenticated frames)"),
    OPT("rank", CONFIG_INT, rank, "0", 0, 65535, NULL,
        "rank the authenticated connections claim (one a real worker uses)"),
    OPT("world-size", CONFIG_INT, world_size, "1", 1, 65536, NULL, "the shard's --num-workers"),
    OPT("connections", CONFIG_INT, connections, "32", 1, 900, NULL,
        "connections of the probes open at once (keep below the shard's --max-connections)"),
    OPT("threads", CONFIG_INT, threads, "4", 1, 64, NULL, "threads running probes"),
    OPT("frames", CONFIG_INT, frames, "2000", 0, 1e9, NULL, "mutated frames to send"),
    OPT("seconds", CONFIG_DOUBLE, seconds, "10", 0, 86400, NULL,
        "stop starting probes after this long even if --frames are not all sent (as on "
        "SIGINT/SIGTERM; the outcomes in flight are still collected and reported)"),
    OPT("drain-seconds", CONFIG_DOUBLE, drain_seconds, "15", 0.1, 3600, NULL,
        "a connection still open and silent this long after its last mutated frame (or after "
        "a held connection started) is stuck: the shard should have answered or dropped it"),
    OPT("slowloris", CONFIG_INT, slowloris, "4", 0, 400, NULL,
        "connections that send a frame one byte a second (half of them after authenticating)"),
    OPT("idle", CONFIG_INT, idle, "4", 0, 400, NULL,
        "connections that send nothing (half of them after authenticating)"),
    OPT("reply-flood", CONFIG_INT, reply_flood, "0", 0, 400, NULL,
        "authenticated connections that send STATS requests as fast as the shard takes them "
        "while the attack lasts and never read the replies (needs the token): the shard must "
        "stop reading from them and drop them without its memory growing past "
        "--max-output-queue-bytes"),
    OPT("seed", CONFIG_INT, seed, "1", 0, 9.2e18, NULL, "seed of the mutations"),
    OPT("max-frame-bytes", CONFIG_SIZE, max_frame_bytes, "64MiB", 4, 4294967295.0, NULL,
        "the shard's --max-frame-bytes: payload lengths max-1, max and max+1 are sent"),
};

static const struct config_spec hostile_spec = {
    "ps-hostile",
    "a hostile client: mutated frames, slow and idle connections against one shard, each "
    "outcome classified",
    hostile_options, sizeof(hostile_options) / sizeof(hostile_options[0])};

/* ---- the attack ----------------------------------------------------------- */

struct key_info {
  uint64_t key, count;
};

/* What the probes know about the shard; written by main before the probe
 * threads start, read-only afterwards. */
struct attack {
  const struct hostile_config *cfg;
  struct hostile *h;
  const struct auth_token *token;
  uint32_t rank, world;
  uint64_t max_frame;
  uint64_t end_ns;
  struct key_info keys[MAX_KEYS]; /* keys found on the shard: the only ones pushed to */
  int num_keys;
  bool have_layout;
  uint64_t max_key_bytes;
  int avail[64], num_avail; /* probes whose needs are met */
  atomic_uint_fast64_t next_probe;
};

/* Per probe thread. */
struct pctx {
  struct attack *A;
  uint64_t rng;
  struct wire_arena arena;
  uint8_t *fb;  /* FB_BYTES: preamble + header being built */
  uint8_t *pay; /* payload being built (largest key, at least FULL_FRAME_MAX) */
  size_t pay_cap;
  uint64_t rid;
  int probe;
  char variant[96];
};

struct probe {
  const char *name;
  void (*fn)(struct pctx *p); /* NULL: not run by the probe threads */
  unsigned needs;
};
enum { N_TOKEN = 1, N_KEYS = 2, N_LAYOUT = 4, N_NONZERO_RANK = 8, N_NEVER = 16 };

/* SIGINT/SIGTERM: start no more probes; the outcomes in flight are still
 * collected and reported (tools/bench-hostile attacks for as long as a
 * benchmark runs). */
static atomic_bool stop_requested; /* lock-free: safe in a handler, read by every thread */

static void on_stop(int sig) {
  (void)sig;
  atomic_store(&stop_requested, true);
}

static uint64_t rnd(struct pctx *p) { /* xorshift64* */
  p->rng ^= p->rng >> 12;
  p->rng ^= p->rng << 25;
  p->rng ^= p->rng >> 27;
  return p->rng * 2685821657736338717ull;
}

static void put16(uint8_t *b, uint16_t v) {
  b[0] = (uint8_t)v;
  b[1] = (uint8_t)(v >> 8);
}

static uint32_t get32(const uint8_t *b) {
  return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

/* Appends a varint; returns the bytes written. */
static size_t varint(uint8_t *b, uint64_t v) {
  size_t n = 0;
  do {
    b[n++] = (uint8_t)((v & 0x7f) | (v >= 0x80 ? 0x80 : 0));
    v >>= 7;
  } while (v);
  return n;
}

static struct hostile_expect ex(uint32_t ok, uint32_t bad, unsigned flags) {
  return (struct hostile_expect){ok, bad, flags};
}

/* The outcome of the mutated frame just sent (hostile_judge), waiting up to
 * ms. */
static int judge_for(struct pctx *p, struct hostile_conn **cp, struct hostile_expect e, int ms,
                     struct hostile_reply *rep) {
  return hostile_judge(p->A->h, cp, &p->arena, e, ms, p->probe, p->variant, rep);
}

/* A refusal that is a silent drop takes the shard's deadline: the reaper
 * waits for it at once. A tolerated reply leads to a next frame: worth
 * waiting for. */
static int judge(struct pctx *p, struct hostile_conn **cp, struct hostile_expect e) {
  int ms = e.ok == 0 && (e.flags & HOSTILE_DROP) ? 0
           : (e.flags & HOSTILE_TOLERATE)        ? FOLLOW_MS
                                                 : SYNC_MS;
  return judge_for(p, cp, e, ms, NULL);
}

/* ---- frames ------------------------------------------------------------- */

static size_t enc(struct pctx *p, const wire_header *h, uint64_t plen) {
  int n = wire_frame_encode(h, plen, p->fb, FB_BYTES);
  return n > 0 ? (size_t)n : 0;
}

/* A HELLO with a fresh random nonce of nonce_len bytes. */
static size_t enc_hello(struct pctx *p, uint32_t rank, uint32_t world, size_t nonce_len) {
  uint8_t nonce[64];
  for (size_t i = 0; i < sizeof(nonce); i++) nonce[i] = (uint8_t)rnd(p);
  Ps__Header h = PS__HEADER__INIT;
  Ps__Hello hello = PS__HELLO__INIT;
  hello.rank = rank;
  hello.world_size = world;
  hello.job_id = "ps-hostile";
  hello.client = "ps-hostile";
  hello.nonce.data = nonce;
  hello.nonce.len = nonce_len;
  h.type = PS__MSG_TYPE__MSG_HELLO;
  h.rank = rank;
  h.body_case = PS__HEADER__BODY_HELLO;
  h.hello = &hello;
  return enc(p, &h, 0);
}

static size_t enc_data(struct pctx *p, int type, uint32_t rank, uint64_t key, uint64_t plen) {
  Ps__Header h = PS__HEADER__INIT;
  h.type = (Ps__MsgType)type;
  h.request_id = ++p->rid;
  h.rank = rank;
  h.key = key;
  return enc(p, &h, plen);
}

/* Appends unknown fields (numbers the schema does not use) to the header
 * in p->fb of n bytes, up to limit bytes of header, and fixes the preamble.
 * Returns the new frame length. */
static size_t add_unknown_fields(struct pctx *p, size_t n, uint64_t plen, size_t limit) {
  size_t hlen = n - FRAME_PREAMBLE_BYTES;
  uint8_t *b = p->fb + FRAME_PREAMBLE_BYTES;
  while (hlen + 16 <= limit) {
    switch (rnd(p) % 3) {
      case 0: /* varint field 1000 */
        hlen += varint(b + hlen, (1000u << 3) | 0);
        hlen += varint(b + hlen, rnd(p) >> (rnd(p) % 64));
        break;
      case 1: /* length-delimited field 21..29 */
        hlen += varint(b + hlen, ((21u + rnd(p) % 9) << 3) | 2);
        b[hlen++] = 5;
        for (int i = 0; i < 5; i++) b[hlen++] = (uint8_t)rnd(p);
        break;
      default: /* fixed32 field 30 */
        hlen += varint(b + hlen, (30u << 3) | 5);
        for (int i = 0; i < 4; i++) b[hlen++] = (uint8_t)rnd(p);
        break;
    }
    if (rnd(p) % 4 == 0) break;
  }
  frame_preamble_encode(p->fb, (uint16_t)hlen, plen);
  return FRAME_PREAMBLE_BYTES + hlen;
}

/* Writes count floats of NaN or Inf to p->pay (mode 0 NaN, 1 +Inf, 2 -Inf,
 * 3 zeros but one NaN). */
static void fill_nonfinite(struct pctx *p, uint64_t count, int mode) {
  float *f = (float *)p->pay;
  float v = mode == 0 ? NAN : mode == 1 ? INFINITY : mode == 2 ? -INFINITY : 0.0f;
  for (uint64_t i = 0; i < count; i++) f[i] = v;
  if (mode == 3) f[rnd(p) % count] = NAN;
}

static const struct key_info *pick_key(struct pctx *p) {
  return &p->A->keys[rnd(p) % (uint64_t)p->A->num_keys];
}

static size_t enc_auth(struct pctx *p, const uint8_t *proof, size_t len) {
  return hostile_enc_auth(p->fb, FB_BYTES, proof, len);
}

/* ---- handshakes ------------------------------------------------------------ */

/* A valid HELLO as (rank, world) and the shard's AUTH (hostile_hello). */
static int hello_phase(struct pctx *p, struct hostile_conn *c, struct hs *hs, uint32_t rank,
                       uint32_t world, uint8_t pa[AUTH_PROOF_BYTES]) {
  size_t len;
  return hostile_hello(p->A->h, c, &p->arena, hs, rank, world, p->fb, FB_BYTES, &len, pa);
}

/* An authenticated connection as the configured rank, or NULL. */
static struct hostile_conn *open_authed(struct pctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (c && hostile_handshake(p->A->h, c, &p->arena) < 0) {
    hostile_conn_close(p->A->h, c);
    return NULL;
  }
  return c;
}

/* After a HELLO the shard took (tolerated): a wrong proof must end it. */
static void wrong_proof(struct pctx *p, struct hostile_conn **cp) {
  uint8_t proof[AUTH_PROOF_BYTES];
  for (size_t i = 0; i < sizeof(proof); i++) proof[i] = (uint8_t)rnd(p);
  size_t n = enc_auth(p, proof, sizeof(proof));
  hostile_conn_write(*cp, p->fb, n, NULL, 0, NULL, 0);
  snprintf(p->variant, sizeof(p->variant), "random proof after that hello");
  judge(p, cp, ex(C(AUTH), 0, 0));
}

static void done(struct pctx *p, struct hostile_conn *c) {
  hostile_conn_close(p->A->h, c);
}

/* ---- probes before authentication ---------------------------------------- */

static void probe_garbage(struct pctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  size_t n = 16 + rnd(p) % 497;
  for (size_t i = 0; i < n; i++) p->fb[i] = (uint8_t)rnd(p);
  if (get32(p->fb) == FRAME_MAGIC) p->fb[0] ^= 1;
  snprintf(p->variant, sizeof(p->variant), "%zu random bytes", n);
  hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
  judge(p, &c, ex(C(BAD_FRAME), 0, 0));
  done(p, c);
}

/* Bad magic or version, header lengths 0 / above the handshake limit /
 * 65535, payload lengths 1 / max-1 / max / max+1 / 2^32-1 / 2^64-1: only
 * the preamble of a HELLO (the shard refuses it on the preamble alone). */
static void probe_bad_preamble(struct pctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *c = hostile_conn_open(A->h, true);
  if (!c) return;
  size_t n = enc_hello(p, A->rank, A->world, AUTH_NONCE_BYTES);
  uint16_t hlen = (uint16_t)(n - FRAME_PREAMBLE_BYTES);
  struct hostile_expect e = ex(C(TOO_LARGE), 0, 0);
  switch (rnd(p) % 5) {
    case 0:
      p->fb[rnd(p) % 4] ^= (uint8_t)(1u << (rnd(p) % 8));
      snprintf(p->variant, sizeof(p->variant), "bad magic");
      e = ex(C(BAD_FRAME), 0, 0);
      break;
    case 1: {
      static const uint16_t versions[] = {0, 2, 0xffff};
      uint16_t v = versions[rnd(p) % 3];
      put16(p->fb + 4, v);
      snprintf(p->variant, sizeof(p->variant), "version %u", v);
      e = ex(C(BAD_FRAME), 0, 0);
      break;
    }
    case 2:
      frame_preamble_encode(p->fb, 0, 0);
      snprintf(p->variant, sizeof(p->variant), "header length 0");
      n = FRAME_PREAMBLE_BYTES;
      break;
    case 3: {
      static const uint16_t lens[] = {HS_MAX_HEADER + 1, 65534, 65535};
      uint16_t v = lens[rnd(p) % 3];
      frame_preamble_encode(p->fb, v, 0);
      snprintf(p->variant, sizeof(p->variant), "header length %u before authentication", v);
      n = FRAME_PREAMBLE_BYTES;
      break;
    }
    default: {
      const uint64_t lens[] = {
          1, A->max_frame - 1, A->max_frame, A->max_frame + 1, 0xffffffffull, UINT64_MAX};
      uint64_t v = lens[rnd(p) % 6];
      frame_preamble_encode(p->fb, hlen, v);
      snprintf(p->variant, sizeof(p->variant), "hello with payload length %" PRIu64, v);
      n = FRAME_PREAMBLE_BYTES;
      break;
    }
  }
  hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
  judge(p, &c, e);
  done(p, c);
}

/* A HELLO cut short and then nothing: the handshake deadline drops it. */
static void probe_truncated_hello(struct pctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  size_t n = enc_hello(p, p->A->rank, p->A->world, AUTH_NONCE_BYTES);
  size_t cut = 1 + rnd(p) % (n - 1);
  snprintf(p->variant, sizeof(p->variant), "%zu of %zu bytes of a hello", cut, n);
  hostile_conn_write(c, p->fb, cut, NULL, 0, NULL, 0);
  judge(p, &c, ex(0, 0, HOSTILE_DROP));
  done(p, c);
}

/* Headers that are not protobuf, random bytes, or a hello buried in more
 * unknown fields than the pre-authentication decode budget allows. */
static void probe_bad_header(struct pctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  uint8_t *b = p->fb + FRAME_PREAMBLE_BYTES;
  size_t hlen = 1 + rnd(p) % 200;
  struct hostile_expect e = ex(C(BAD_FRAME), 0, 0);
  switch (rnd(p) % 3) {
    case 0: /* wire type 7 does not exist */
      memset(b, 0xff, hlen);
      snprintf(p->variant, sizeof(p->variant), "%zu bytes 0xff", hlen);
      break;
    case 1:
      for (size_t i = 0; i < hlen; i++) b[i] = (uint8_t)rnd(p);
      snprintf(p->variant, sizeof(p->variant), "%zu random header bytes", hlen);
      e = ex(HOSTILE_ANY_CODE, 0, HOSTILE_TOLERATE);
      break;
    default:
      hlen = 0;
      b[hlen++] = 0x08; /* type = HELLO, no hello body */
      b[hlen++] = 0x01;
      while (hlen + 2 <= HS_MAX_HEADER) {
        b[hlen++] = (uint8_t)((8 + rnd(p) % 8) << 3); /* varint fields 8..15 */
        b[hlen++] = (uint8_t)(rnd(p) & 0x7f);
      }
      snprintf(p->variant, sizeof(p->variant), "hello type and %zu unknown fields", hlen / 2 - 1);
      e = ex(C(TOO_LARGE) | C(PROTOCOL), 0, 0);
      break;
  }
  frame_preamble_encode(p->fb, (uint16_t)hlen, 0);
  hostile_conn_write(c, p->fb, FRAME_PREAMBLE_BYTES + hlen, NULL, 0, NULL, 0);
  if (judge(p, &c, e) == HOSTILE_TOLERATED) wrong_proof(p, &c);
  done(p, c);
}

/* A valid hello with unknown fields (harmless: proto3 skips them), then a
 * wrong proof. */
static void probe_unknown_fields_hello(struct pctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  size_t n = enc_hello(p, p->A->rank, p->A->world, AUTH_NONCE_BYTES);
  n = add_unknown_fields(p, n, 0, HS_MAX_HEADER);
  snprintf(p->variant, sizeof(p->variant), "hello with unknown fields (%zu-byte header)",
           n - FRAME_PREAMBLE_BYTES);
  hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
  if (judge(p, &c, ex(0, 0, HOSTILE_TOLERATE)) == HOSTILE_TOLERATED) wrong_proof(p, &c);
  done(p, c);
}

static const int data_types[] = {
    PS__MSG_TYPE__MSG_LAYOUT,   PS__MSG_TYPE__MSG_INIT,     PS__MSG_TYPE__MSG_PUSH,
    PS__MSG_TYPE__MSG_PULL,     PS__MSG_TYPE__MSG_BARRIER,  PS__MSG_TYPE__MSG_STATS,
    PS__MSG_TYPE__MSG_SHUTDOWN, PS__MSG_TYPE__MSG_ROLLBACK, PS__MSG_TYPE__MSG_AUTH};
#define NUM_DATA_TYPES (sizeof(data_types) / sizeof(data_types[0]))

/* Data frames before hello (and, with a payload, larger than anything
 * allowed before authentication). */
static void probe_data_before_hello(struct pctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  int type = data_types[rnd(p) % NUM_DATA_TYPES];
  uint64_t plen = rnd(p) % 4 == 0 ? 4 * (1 + rnd(p) % 256) : 0;
  size_t n = enc_data(p, type, p->A->rank, p->A->num_keys ? p->A->keys[0].key : 0, plen);
  memset(p->pay, 0, plen);
  snprintf(p->variant, sizeof(p->variant), "%s with %" PRIu64 " payload bytes before hello",
           wire_type_name(type), plen);
  hostile_conn_write(c, p->fb, n, p->pay, plen, NULL, 0);
  judge(p, &c, ex(plen ? C(TOO_LARGE) : C(AUTH), 0, 0));
  done(p, c);
}

/* A valid hello, then a data frame (or another hello) instead of the proof. */
static void probe_data_after_hello(struct pctx *p) {
  struct attack *A = p->A;
  if (!A->token) return;
  struct hostile_conn *c = hostile_conn_open(A->h, true);
  if (!c) return;
  struct hs hs;
  hs_init(&hs, AUTH_INITIATOR, A->token);
  if (hello_phase(p, c, &hs, A->rank, A->world, NULL) == 0) {
    int type = rnd(p) % 5 == 0 ? PS__MSG_TYPE__MSG_HELLO
                               : data_types[rnd(p) % (NUM_DATA_TYPES - 1)]; /* not AUTH */
    size_t n = enc_data(p, type, A->rank, 0, 0);
    snprintf(p->variant, sizeof(p->variant), "%s instead of the proof", wire_type_name(type));
    hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
    judge(p, &c, ex(C(AUTH), 0, 0));
  }
  hs_deinit(&hs);
  done(p, c);
}

static void probe_bad_nonce(struct pctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  static const size_t lens[] = {0, 1, 31, 33, 64};
  size_t len = lens[rnd(p) % 5];
  size_t n = enc_hello(p, p->A->rank, p->A->world, len);
  snprintf(p->variant, sizeof(p->variant), "hello with a %zu-byte nonce", len);
  hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
  /* without a token the shard takes a hello with no nonce (and refuses the rest) */
  judge(p, &c, ex(C(AUTH), 0, p->A->token ? 0 : HOSTILE_TOLERATE));
  done(p, c);
}

/* Proofs that must fail: random, empty, short, long, or the shard's own
 * proof sent back (reflection). */
static void probe_wrong_proof(struct pctx *p) {
  struct attack *A = p->A;
  if (!A->token) return;
  struct hostile_conn *c = hostile_conn_open(A->h, true);
  if (!c) return;
  struct hs hs;
  hs_init(&hs, AUTH_INITIATOR, A->token);
  uint8_t pa[AUTH_PROOF_BYTES] = {0}, proof[64];
  if (hello_phase(p, c, &hs, A->rank, A->world, pa) == 0) {
    static const size_t lens[] = {AUTH_PROOF_BYTES, 0, 31, 33, 64, AUTH_PROOF_BYTES};
    int v = (int)(rnd(p) % 6);
    for (size_t i = 0; i < sizeof(proof); i++) proof[i] = (uint8_t)rnd(p);
    if (v == 5) memcpy(proof, pa, AUTH_PROOF_BYTES);
    snprintf(p->variant, sizeof(p->variant),
             v == 5 ? "the shard's proof reflected" : "%zu-byte wrong proof", lens[v]);
    size_t n = enc_auth(p, proof, lens[v]);
    hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
    judge(p, &c, ex(C(AUTH), 0, 0));
  }
  hs_deinit(&hs);
  done(p, c);
}

/* A whole earlier handshake replayed: its hello is a valid hello (the shard
 * answers with a fresh nonce), its proof is then wrong. */
static void probe_replay_handshake(struct pctx *p) {
  struct attack *A = p->A;
  uint8_t hello[HOSTILE_CAPTURE_BYTES], auth[HOSTILE_CAPTURE_BYTES];
  size_t hl, al;
  bool have = hostile_captured(A->h, hello, &hl, auth, &al);
  if (!have) return;
  struct hostile_conn *c = hostile_conn_open(A->h, true);
  if (!c) return;
  snprintf(p->variant, sizeof(p->variant), "replayed hello");
  hostile_conn_write(c, hello, hl, NULL, 0, NULL, 0);
  if (judge(p, &c, ex(0, 0, HOSTILE_TOLERATE)) == HOSTILE_TOLERATED) {
    snprintf(p->variant, sizeof(p->variant), "replayed proof");
    hostile_conn_write(c, auth, al, NULL, 0, NULL, 0);
    judge(p, &c, ex(C(AUTH), 0, 0));
  }
  done(p, c);
}

/* One bit of a valid hello flipped: refused, dropped at the deadline (a
 * longer header never completes) or, where the bit does not matter, a
 * hello the shard answers (then a wrong proof ends it). */
static void probe_flip_hello(struct pctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  size_t n = enc_hello(p, p->A->rank, p->A->world, AUTH_NONCE_BYTES);
  size_t bit = rnd(p) % (n * 8);
  p->fb[bit / 8] ^= (uint8_t)(1u << (bit % 8));
  snprintf(p->variant, sizeof(p->variant), "hello with bit %zu of %zu flipped", bit, n * 8);
  hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
  if (judge(p, &c, ex(HOSTILE_ANY_CODE, 0, HOSTILE_DROP | HOSTILE_TOLERATE)) == HOSTILE_TOLERATED)
    wrong_proof(p, &c);
  done(p, c);
}

/* One bit of a valid proof frame flipped: never an ACK. */
static void probe_flip_auth(struct pctx *p) {
  struct attack *A = p->A;
  if (!A->token) return;
  struct hostile_conn *c = hostile_conn_open(A->h, true);
  if (!c) return;
  struct hs hs;
  hs_init(&hs, AUTH_INITIATOR, A->token);
  if (hello_phase(p, c, &hs, A->rank, A->world, NULL) == 0) {
    size_t n = enc_auth(p, hs.proof, AUTH_PROOF_BYTES);
    size_t bit = rnd(p) % (n * 8);
    p->fb[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    snprintf(p->variant, sizeof(p->variant), "proof frame with bit %zu of %zu flipped", bit, n * 8);
    hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
    /* to check the tag of an ACK, should one come */
    hostile_conn_set_session(c, hs_take_session(&hs), HOSTILE_TAG_NOT_ON_ERROR);
    judge(p, &c, ex(HOSTILE_ANY_CODE, 0, HOSTILE_DROP));
  }
  hs_deinit(&hs);
  done(p, c);
}

/* Authenticated, but as a rank or world size the shard does not have. */
static void probe_bad_rank_hello(struct pctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *c = hostile_conn_open(A->h, true);
  if (!c) return;
  uint32_t rank = A->rank, world = A->world;
  switch (rnd(p) % 4) {
    case 0:
      rank = A->world;
      break;
    case 1:
      rank = UINT32_MAX;
      break;
    case 2:
      world = A->world + 1;
      break;
    default:
      world = 0;
      break;
  }
  snprintf(p->variant, sizeof(p->variant), "authenticated hello as rank %" PRIu32 " of %" PRIu32,
           rank, world);
  struct hs hs;
  hs_init(&hs, AUTH_INITIATOR, A->token);
  if (hello_phase(p, c, &hs, rank, world, NULL) == 0) {
    size_t n = enc_auth(p, hs.proof, AUTH_PROOF_BYTES);
    hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
    hostile_conn_set_session(c, hs_take_session(&hs), HOSTILE_TAG_NOT_ON_ERROR);
    judge(p, &c, ex(C(BAD_RANK), 0, 0));
  }
  hs_deinit(&hs);
  done(p, c);
}

/* ---- probes after authentication ------------------------------------------ */

/* Pushes (and inits) of NaN or Inf for a real key as our rank: each refused
 * with the connection kept; then the last one's exact bytes, tag included,
 * again (a replay on the same connection). */
static void probe_nan(struct pctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *c = open_authed(p);
  if (!c) return;
  const struct key_info *k = pick_key(p);
  int rounds = 1 + (int)(rnd(p) % 3), o = HOSTILE_REJECTED;
  size_t n = 0;
  uint8_t tag[AUTH_TAG_BYTES];
  for (int i = 0; i < rounds && (o == HOSTILE_REJECTED || o == HOSTILE_TOLERATED); i++) {
    int mode = (int)(rnd(p) % 6);
    static const char *const what[] = {"NaN",     "+Inf", "-Inf", "one NaN", "NaN, unknown fields",
                                       "NaN init"};
    int type = mode == 5 ? PS__MSG_TYPE__MSG_INIT : PS__MSG_TYPE__MSG_PUSH;
    fill_nonfinite(p, k->count, mode <= 3 ? mode : 0);
    n = enc_data(p, type, A->rank, k->key, k->count * 4);
    if (mode == 4) n = add_unknown_fields(p, n, k->count * 4, 2000);
    snprintf(p->variant, sizeof(p->variant), "%s %s of key %016" PRIx64, what[mode],
             wire_type_name(type), k->key);
    hostile_conn_send_sealed(c, p->fb, n, p->pay, k->count * 4, tag);
    /* an init of a key that has its values is ignored (ACK flagged duplicate) */
    o = judge_for(p, &c,
                  ex(C(NONFINITE), 0, type == PS__MSG_TYPE__MSG_INIT ? HOSTILE_TOLERATE_DUP : 0),
                  SETUP_MS, NULL);
  }
  if (c && (o == HOSTILE_REJECTED || o == HOSTILE_TOLERATED)) {
    snprintf(p->variant, sizeof(p->variant), "replay of the last frame on its connection");
    hostile_conn_write(c, p->fb, n, p->pay, k->count * 4, tag, AUTH_TAG_BYTES);
    judge(p, &c, ex(C(AUTH), C(NONFINITE), 0));
  }
  done(p, c);
}

/* A tagged frame of one connection sent on another (other session keys). */
static void probe_replay_other(struct pctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *a = open_authed(p);
  if (!a) return;
  const struct key_info *k = pick_key(p);
  fill_nonfinite(p, k->count, 0);
  uint8_t hdr[256], tag[AUTH_TAG_BYTES];
  size_t n = enc_data(p, PS__MSG_TYPE__MSG_PUSH, A->rank, k->key, k->count * 4);
  memcpy(hdr, p->fb, n);
  snprintf(p->variant, sizeof(p->variant), "NaN push of key %016" PRIx64, k->key);
  hostile_conn_send_sealed(a, hdr, n, p->pay, k->count * 4, tag);
  int o = judge_for(p, &a, ex(C(NONFINITE), 0, 0), SETUP_MS, NULL);
  done(p, a);
  if (o != HOSTILE_REJECTED) return;
  struct hostile_conn *b = open_authed(p);
  if (!b) return;
  snprintf(p->variant, sizeof(p->variant), "replay of another connection's frame");
  hostile_conn_write(b, hdr, n, p->pay, k->count * 4, tag, AUTH_TAG_BYTES);
  judge(p, &b, ex(C(AUTH), C(NONFINITE), 0));
  done(p, b);
}

/* A valid STATS, answered; then its exact bytes again. */
static void probe_replay_stats(struct pctx *p) {
  struct hostile_conn *c = open_authed(p);
  if (!c) return;
  uint8_t tag[AUTH_TAG_BYTES];
  size_t n = enc_data(p, PS__MSG_TYPE__MSG_STATS, p->A->rank, 0, 0);
  hostile_conn_send_sealed(c, p->fb, n, NULL, 0, tag);
  struct hostile_reply rep;
  if (hostile_read_setup(p->A->h, c, &p->arena, "stats", &rep, NULL) == 0 &&
      rep.type == PS__MSG_TYPE__MSG_STATS) {
    snprintf(p->variant, sizeof(p->variant), "replayed stats request");
    hostile_conn_write(c, p->fb, n, NULL, 0, tag, AUTH_TAG_BYTES);
    judge(p, &c, ex(C(AUTH), 0, 0));
  }
  done(p, c);
}

/* A tagged STATS or NaN push (header, payload and tag built in place);
 * returns the frame's length without payload and tag. */
static size_t tagged_base(struct pctx *p, struct hostile_conn *c, bool push,
                          const struct key_info **kp, uint8_t tag[AUTH_TAG_BYTES]) {
  const struct key_info *k = push ? pick_key(p) : NULL;
  uint64_t plen = k ? k->count * 4 : 0;
  if (k) fill_nonfinite(p, k->count, 0);
  size_t n = enc_data(p, k ? PS__MSG_TYPE__MSG_PUSH : PS__MSG_TYPE__MSG_STATS, p->A->rank,
                      k ? k->key : 0, plen);
  hostile_conn_seal(c, p->fb, n, p->pay, (size_t)plen, tag);
  *kp = k;
  return n;
}

/* One bit flipped anywhere in a tagged frame: preamble, header, payload or
 * tag. Refused or dropped, never answered, and never handled (NONFINITE
 * would mean the NaN check ran before the tag check). */
static void probe_flip_authed(struct pctx *p) {
  struct hostile_conn *c = open_authed(p);
  if (!c) return;
  const struct key_info *k;
  uint8_t tag[AUTH_TAG_BYTES];
  size_t n = tagged_base(p, c, p->A->num_keys > 0 && rnd(p) % 2, &k, tag);
  size_t plen = k ? (size_t)k->count * 4 : 0;
  static const char *const where[] = {"preamble", "header", "tag", "payload"};
  int region = (int)(rnd(p) % (plen ? 4 : 3));
  uint8_t *base = region == 0   ? p->fb
                  : region == 1 ? p->fb + FRAME_PREAMBLE_BYTES
                  : region == 2 ? tag
                                : p->pay;
  size_t len = region == 0   ? FRAME_PREAMBLE_BYTES
               : region == 1 ? n - FRAME_PREAMBLE_BYTES
               : region == 2 ? AUTH_TAG_BYTES
                             : plen;
  size_t bit = rnd(p) % (len * 8);
  base[bit / 8] ^= (uint8_t)(1u << (bit % 8));
  snprintf(p->variant, sizeof(p->variant), "%s with bit %zu of its %s flipped",
           k ? "NaN push" : "stats", bit, where[region]);
  hostile_conn_write(c, p->fb, n, p->pay, plen, tag, AUTH_TAG_BYTES);
  judge(p, &c, ex(HOSTILE_ANY_CODE & ~C(NONFINITE), C(NONFINITE), HOSTILE_DROP));
  done(p, c);
}

/* Tags that were never computed: zero, random, or missing altogether (then
 * the shard waits for the tag until its frame deadline). */
static void probe_forged_tag(struct pctx *p) {
  struct hostile_conn *c = open_authed(p);
  if (!c) return;
  const struct key_info *k;
  uint8_t tag[AUTH_TAG_BYTES];
  size_t n = tagged_base(p, c, p->A->num_keys > 0 && rnd(p) % 2, &k, tag);
  size_t plen = k ? (size_t)k->count * 4 : 0;
  int v = (int)(rnd(p) % 3);
  if (v == 0) memset(tag, 0, sizeof(tag));
  for (size_t i = 0; v == 1 && i < sizeof(tag); i++) tag[i] = (uint8_t)rnd(p);
  snprintf(p->variant, sizeof(p->variant), "%s with %s tag", k ? "NaN push" : "stats",
           v == 0   ? "a zero"
           : v == 1 ? "a random"
                    : "no");
  hostile_conn_write(c, p->fb, n, p->pay, plen, tag, v == 2 ? 0 : AUTH_TAG_BYTES);
  judge(p, &c, v == 2 ? ex(0, 0, HOSTILE_DROP) : ex(C(AUTH), C(NONFINITE), 0));
  done(p, c);
}

/* Pushes whose payload length does not match the key: whole frames (NaN)
 * while small, else preamble and header only. */
static void probe_wrong_size(struct pctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *c = open_authed(p);
  if (!c) return;
  const struct key_info *k = pick_key(p);
  uint64_t want = k->count * 4;
  const uint64_t lens[] = {0,
                           4,
                           want - 4,
                           want + 4,
                           want * 2,
                           A->max_frame - 1,
                           A->max_frame,
                           A->max_frame + 1,
                           0xffffffffull,
                           UINT64_MAX};
  uint64_t plen;
  do plen = lens[rnd(p) % (sizeof(lens) / sizeof(lens[0]))];
  while (plen == want);
  size_t n = enc_data(p, PS__MSG_TYPE__MSG_PUSH, A->rank, k->key, plen);
  struct hostile_expect e = ex(plen > A->max_frame ? C(TOO_LARGE) : C(BAD_SIZE), C(NONFINITE), 0);
  snprintf(p->variant, sizeof(p->variant), "push of %" PRIu64 " bytes to a %" PRIu64 "-byte key",
           plen, want);
  if (plen <= FULL_FRAME_MAX && n + plen + AUTH_TAG_BYTES <= FULL_FRAME_MAX) {
    uint8_t tag[AUTH_TAG_BYTES];
    fill_nonfinite(p, plen / 4 + 1, 0);
    hostile_conn_send_sealed(c, p->fb, n, p->pay, (size_t)plen, tag);
  } else {
    e.flags |= HOSTILE_HDR_ONLY;
    hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
  }
  judge(p, &c, e);
  done(p, c);
}

static void probe_unknown_key(struct pctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *c = open_authed(p);
  if (!c) return;
  uint64_t key;
  bool known;
  do {
    key = rnd(p) % 2 ? rnd(p) : ((8 + rnd(p) % 1000) << 32 | (rnd(p) % 4));
    known = false;
    for (int i = 0; i < A->num_keys; i++) known |= A->keys[i].key == key;
  } while (known);
  uint64_t plen = 4 * (1 + rnd(p) % 64);
  fill_nonfinite(p, plen / 4, 0);
  size_t n = enc_data(p, PS__MSG_TYPE__MSG_PUSH, A->rank, key, plen);
  uint8_t tag[AUTH_TAG_BYTES];
  snprintf(p->variant, sizeof(p->variant), "push to key %016" PRIx64, key);
  hostile_conn_send_sealed(c, p->fb, n, p->pay, (size_t)plen, tag);
  judge(p, &c, ex(C(BAD_KEY), C(NONFINITE), 0));
  done(p, c);
}

/* A push that claims another rank than the connection authenticated as. */
static void probe_other_rank(struct pctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *c = open_authed(p);
  if (!c) return;
  const struct key_info *k = pick_key(p);
  uint32_t rank = A->world > 1 && rnd(p) % 2
                      ? (uint32_t)((A->rank + 1 + rnd(p) % (A->world - 1)) % A->world)
                      : A->world + (uint32_t)(rnd(p) % 1000);
  fill_nonfinite(p, k->count, 0);
  size_t n = enc_data(p, PS__MSG_TYPE__MSG_PUSH, rank, k->key, k->count * 4);
  uint8_t tag[AUTH_TAG_BYTES];
  snprintf(p->variant, sizeof(p->variant),
           "push as rank %" PRIu32 " on rank %" PRIu32 "'s connection", rank, A->rank);
  hostile_conn_send_sealed(c, p->fb, n, p->pay, k->count * 4, tag);
  judge(p, &c, ex(C(BAD_RANK), C(NONFINITE), 0));
  done(p, c);
}

static void probe_unknown_type(struct pctx *p) {
  struct hostile_conn *c = open_authed(p);
  if (!c) return;
  static const int types[] = {PS__MSG_TYPE__MSG_UNKNOWN,
                              PS__MSG_TYPE__MSG_PULL_REPLY,
                              PS__MSG_TYPE__MSG_ERROR,
                              PS__MSG_TYPE__MSG_ACK,
                              PS__MSG_TYPE__MSG_HEARTBEAT,
                              15,
                              99,
                              1000000};
  int type = types[rnd(p) % (sizeof(types) / sizeof(types[0]))];
  size_t n = enc_data(p, type, p->A->rank, 0, 0);
  uint8_t tag[AUTH_TAG_BYTES];
  snprintf(p->variant, sizeof(p->variant), "message type %d", type);
  hostile_conn_send_sealed(c, p->fb, n, NULL, 0, tag);
  judge(p, &c, ex(C(UNKNOWN_TYPE), 0, 0));
  done(p, c);
}

/* A second hello or proof on an authenticated connection (correctly tagged). */
static void probe_handshake_again(struct pctx *p) {
  struct hostile_conn *c = open_authed(p);
  if (!c) return;
  bool hello = rnd(p) % 2;
  uint8_t proof[AUTH_PROOF_BYTES] = {0};
  size_t n = hello ? enc_hello(p, p->A->rank, p->A->world, AUTH_NONCE_BYTES)
                   : enc_auth(p, proof, sizeof(proof));
  uint8_t tag[AUTH_TAG_BYTES];
  snprintf(p->variant, sizeof(p->variant), "tagged %s after authentication",
           hello ? "hello" : "auth");
  hostile_conn_send_sealed(c, p->fb, n, NULL, 0, tag);
  judge(p, &c, ex(C(PROTOCOL), 0, 0));
  done(p, c);
}

/* Layouts the shard must refuse once it holds one: a different model,
 * dtype 1, a shape whose size overflows, no tensors. */
static void probe_bad_layout(struct pctx *p) {
  struct hostile_conn *c = open_authed(p);
  if (!c) return;
  Ps__Header h = PS__HEADER__INIT;
  Ps__Layout l = PS__LAYOUT__INIT;
  Ps__Tensor t = PS__TENSOR__INIT;
  Ps__Tensor *tp = &t;
  uint64_t shape[2] = {7, 1};
  static const char *const what[] = {"another model", "dtype 1", "overflowing shape", "no tensors"};
  int v = (int)(rnd(p) % 4);
  t.name = "hostile";
  t.shape = shape;
  t.n_shape = 1;
  if (v == 1) t.dtype = 1;
  if (v == 2) {
    shape[0] = shape[1] = 1ull << 40;
    t.n_shape = 2;
  }
  l.n_tensors = v == 3 ? 0 : 1;
  l.tensors = &tp;
  l.chunk_bytes = 4u << 20;
  l.num_shards = 1 + (uint32_t)(rnd(p) % 4);
  l.hash = rnd(p);
  h.type = PS__MSG_TYPE__MSG_LAYOUT;
  h.request_id = ++p->rid;
  h.rank = p->A->rank;
  h.body_case = PS__HEADER__BODY_LAYOUT;
  h.layout = &l;
  size_t n = enc(p, &h, 0);
  uint8_t tag[AUTH_TAG_BYTES];
  snprintf(p->variant, sizeof(p->variant), "layout: %s", what[v]);
  hostile_conn_send_sealed(c, p->fb, n, NULL, 0, tag);
  judge(p, &c, ex(C(LAYOUT_MISMATCH) | C(BAD_FRAME), 0, 0));
  done(p, c);
}

/* Lengths after authentication: header length 0, headers of up to 65535
 * bytes of unknown fields (beyond the decode budget), payload lengths
 * max-1 / max (wrong size for a STATS) and max+1 / 2^32-1 / 2^64-1. */
static void probe_lengths_authed(struct pctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *c = open_authed(p);
  if (!c) return;
  uint8_t tag[AUTH_TAG_BYTES];
  int v = (int)(rnd(p) % 3);
  if (v == 0) {
    frame_preamble_encode(p->fb, 0, 0);
    snprintf(p->variant, sizeof(p->variant), "header length 0 after authentication");
    hostile_conn_write(c, p->fb, FRAME_PREAMBLE_BYTES, NULL, 0, NULL, 0);
    judge(p, &c, ex(C(TOO_LARGE), 0, 0));
  } else if (v == 1) {
    static const size_t lens[] = {65535, 65534, 40000};
    size_t hlen = lens[rnd(p) % 3];
    uint8_t *b = p->fb + FRAME_PREAMBLE_BYTES;
    size_t i = 0;
    b[i++] = 0x08; /* type = STATS */
    b[i++] = PS__MSG_TYPE__MSG_STATS;
    while (i + 2 <= hlen) {
      b[i++] = (uint8_t)((8 + rnd(p) % 8) << 3);
      b[i++] = (uint8_t)(rnd(p) & 0x7f);
    }
    if (i < hlen) b[i++] = 0; /* odd length: one more byte makes it invalid at worst */
    frame_preamble_encode(p->fb, (uint16_t)hlen, 0);
    snprintf(p->variant, sizeof(p->variant), "stats with a %zu-byte header of unknown fields",
             hlen);
    hostile_conn_send_sealed(c, p->fb, FRAME_PREAMBLE_BYTES + hlen, NULL, 0, tag);
    judge(p, &c, ex(C(TOO_LARGE) | C(BAD_FRAME), 0, HOSTILE_TOLERATE));
  } else {
    const uint64_t lens[] = {A->max_frame - 1, A->max_frame, A->max_frame + 1, 0xffffffffull,
                             UINT64_MAX};
    uint64_t plen = lens[rnd(p) % 5];
    size_t n = enc_data(p, PS__MSG_TYPE__MSG_STATS, A->rank, 0, plen);
    snprintf(p->variant, sizeof(p->variant), "stats with payload length %" PRIu64, plen);
    hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
    judge(p, &c, ex(plen > A->max_frame ? C(TOO_LARGE) : C(BAD_SIZE), 0, HOSTILE_HDR_ONLY));
  }
  done(p, c);
}

/* A tagged NaN push cut short anywhere and then nothing: the frame
 * deadline drops it. */
static void probe_truncated_authed(struct pctx *p) {
  struct hostile_conn *c = open_authed(p);
  if (!c) return;
  const struct key_info *k;
  uint8_t tag[AUTH_TAG_BYTES];
  size_t n = tagged_base(p, c, true, &k, tag);
  size_t plen = (size_t)k->count * 4, total = n + plen + AUTH_TAG_BYTES;
  size_t cut = 1 + rnd(p) % (total - 1);
  snprintf(p->variant, sizeof(p->variant), "%zu of %zu bytes of a tagged push", cut, total);
  size_t a = cut < n ? cut : n, b = cut > n ? (cut - n < plen ? cut - n : plen) : 0;
  size_t t = cut > n + plen ? cut - n - plen : 0;
  hostile_conn_write(c, p->fb, a, p->pay, b, tag, t);
  judge(p, &c, ex(0, 0, HOSTILE_DROP));
  done(p, c);
}

/* SHUTDOWN from a rank that is not 0: refused (only rank 0 ends a job). */
static void probe_shutdown(struct pctx *p) {
  struct hostile_conn *c = open_authed(p);
  if (!c) return;
  size_t n = enc_data(p, PS__MSG_TYPE__MSG_SHUTDOWN, p->A->rank, 0, 0);
  uint8_t tag[AUTH_TAG_BYTES];
  snprintf(p->variant, sizeof(p->variant), "shutdown as rank %" PRIu32, p->A->rank);
  hostile_conn_send_sealed(c, p->fb, n, NULL, 0, tag);
  judge(p, &c, ex(C(BAD_RANK), 0, 0));
  done(p, c);
}

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
    {"find-keys", NULL, N_NEVER}, /* find_keys' frames */
};
static const int num_probes = (int)(sizeof(probes) / sizeof(probes[0]));

/* ---- finding keys ----------------------------------------------------------- */

/* Pushes of 4 NaN bytes to keys (tensor t, chunk c) for small t and c: the
 * shard's refusal says whether it holds the key (BAD_SIZE names its size,
 * NONFINITE means it is 4 bytes) or not (BAD_KEY), or that no layout is
 * registered yet (NO_LAYOUT: tried again until --seconds). Each is a
 * mutated frame (a wrong size or an unknown key) and counted as one. */
static void find_keys(struct pctx *p) {
  struct attack *A = p->A;
  p->probe = num_probes - 1;
  for (;;) {
    bool no_layout = false;
    for (uint64_t t = 0; t < 8; t++) {
      for (uint64_t ch = 0; ch < 2; ch++) {
        struct hostile_conn *c = open_authed(p);
        if (!c) continue;
        uint64_t key = t << 32 | ch;
        fill_nonfinite(p, 1, 0);
        size_t n = enc_data(p, PS__MSG_TYPE__MSG_PUSH, A->rank, key, 4);
        uint8_t tag[AUTH_TAG_BYTES];
        snprintf(p->variant, sizeof(p->variant), "4-byte push to key %016" PRIx64 " (finding keys)",
                 key);
        hostile_conn_send_sealed(c, p->fb, n, p->pay, 4, tag);
        struct hostile_reply rep;
        int o = judge_for(p, &c, ex(C(BAD_SIZE) | C(BAD_KEY) | C(NO_LAYOUT) | C(NONFINITE), 0, 0),
                          SETUP_MS, &rep);
        done(p, c);
        if (o != HOSTILE_REJECTED) continue;
        uint64_t count = 0;
        const char *e = strstr(rep.msg, "expected ");
        if (rep.code == PS__ERROR_CODE__ERR_BAD_SIZE && e) count = strtoull(e + 9, NULL, 10) / 4;
        if (rep.code == PS__ERROR_CODE__ERR_NONFINITE) count = 1;
        if (rep.code == PS__ERROR_CODE__ERR_NO_LAYOUT)
          no_layout = true;
        else
          A->have_layout = true;
        if (count > 0 && A->num_keys < MAX_KEYS) {
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

static void hold(struct pctx *p, enum hostile_holder kind) {
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

static int pctx_init(struct pctx *p, struct attack *A, uint64_t seed) {
  memset(p, 0, sizeof(*p));
  p->A = A;
  p->rng = seed * 0x9e3779b97f4a7c15ull + 0x2545f4914f6cdd1dull;
  if (!p->rng) p->rng = 1;
  p->pay_cap = A->max_key_bytes + 64 > FULL_FRAME_MAX ? A->max_key_bytes + 64 : FULL_FRAME_MAX;
  p->fb = malloc(FB_BYTES);
  p->pay = malloc(p->pay_cap);
  if (!p->fb || !p->pay || wire_arena_init(&p->arena, 64 * 1024) < 0) return -ENOMEM;
  return 0;
}

static void pctx_deinit(struct pctx *p) {
  free(p->fb);
  free(p->pay);
  wire_arena_deinit(&p->arena);
  p->fb = p->pay = NULL;
}

/* Runs every available probe once, then random ones, until --frames or
 * --seconds. */
static void *prober_main(void *arg) {
  struct pctx *p = arg;
  struct attack *A = p->A;
  if (A->num_avail == 0) return NULL;
  while (hostile_sent(A->h) < (uint64_t)A->cfg->frames && clock_now_ns() < A->end_ns &&
         !atomic_load(&stop_requested)) {
    uint64_t i = atomic_fetch_add(&A->next_probe, 1);
    p->probe = A->avail[i < (uint64_t)A->num_avail ? i : rnd(p) % (uint64_t)A->num_avail];
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
  struct pctx main_ctx;
  int ret = -ENOMEM;
  if (pctx_init(&main_ctx, A, (uint64_t)cfg->seed) < 0) goto out;
  for (int64_t i = 0; i < cfg->slowloris; i++)
    hold(&main_ctx, A->token && i % 2 ? HOSTILE_SLOW_AUTH : HOSTILE_SLOW);
  for (int64_t i = 0; i < cfg->idle; i++)
    hold(&main_ctx, A->token && i % 2 ? HOSTILE_IDLE_AUTH : HOSTILE_IDLE);
  for (int64_t i = 0; A->token && i < cfg->reply_flood; i++) hold(&main_ctx, HOSTILE_FLOOD);
  if (A->token) find_keys(&main_ctx);
  for (int i = 0; i < num_probes; i++) {
    unsigned needs = probes[i].needs;
    if ((needs & N_NEVER) || ((needs & N_TOKEN) && !A->token) ||
        ((needs & N_KEYS) && A->num_keys == 0) || ((needs & N_LAYOUT) && !A->have_layout) ||
        ((needs & N_NONZERO_RANK) && A->rank == 0))
      continue;
    A->avail[A->num_avail++] = i;
  }
  int nthreads = (int)cfg->threads, started = 0;
  struct pctx *ctx = calloc((size_t)nthreads, sizeof(*ctx));
  pthread_t *th = calloc((size_t)nthreads, sizeof(*th));
  for (int i = 0; ctx && th && i < nthreads; i++) {
    if (pctx_init(&ctx[i], A, (uint64_t)cfg->seed + 1 + (uint64_t)i) < 0 ||
        pthread_create(&th[i], NULL, prober_main, &ctx[i]) != 0)
      break;
    started++;
  }
  for (int i = 0; i < started; i++) pthread_join(th[i], NULL);
  while (cfg->reply_flood > 0 && A->token && clock_now_ns() < A->end_ns &&
         !atomic_load(&stop_requested)) { /* a flood lasts --seconds, frames or not */
    clock_sleep_ms(50);
  }
  for (int i = 0; ctx && i < nthreads; i++) pctx_deinit(&ctx[i]);
  free(ctx);
  free(th);
  ret = started > 0 ? 0 : -EAGAIN;
out:
  pctx_deinit(&main_ctx);
  return ret;
}

int main(int argc, char **argv) {
  static struct hostile_config cfg;
  int r = config_parse(&hostile_spec, &cfg, argc, argv, NULL, stderr);
  if (r == CONFIG_HELP || r == CONFIG_VERSION) return 0;
  if (r < 0) return 2;
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
  hostile_report(A.h, stdout, stderr, A.num_keys, (double)(clock_now_ns() - start) / 1e9);
  ret = r < 0 ? 3 : hostile_findings(A.h) ? 1 : 0;
  hostile_free(A.h);
out:
  auth_token_free(token);
  return ret;
}
