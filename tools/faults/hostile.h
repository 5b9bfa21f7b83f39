/* hostile: the engine of ps-hostile (its probes are in tools/faults/probe_preauth.c and
 * tools/faults/probe_authed.c, their shared helpers in tools/faults/probe.c).
 *
 * It owns the connections to one shard, reads the shard's replies (checking
 * their tags once authenticated), classifies the outcome of every mutated
 * frame against its expectation, counts everything the shard's /metrics
 * counts (error frames by code, connections closed without one), and runs
 * one reaper thread. A probe waits briefly for an outcome in its own thread
 * (hostile_judge); one that does not come at once (a drop at the shard's
 * deadline, a loaded shard) is handed to the reaper, which polls every such
 * connection, so no probe thread sleeps through a deadline. The reaper also
 * holds the slow, idle and reply-flooding connections (hostile_hold) and
 * times when the shard drops each.
 *
 * Outcome of one mutated frame: rejected (an expected error code), dropped
 * (closed without a reply where that is the refusal), tolerated (a normal
 * reply where that is harmless), accepted (a normal reply, or an error only
 * a handler past a missing check can send: a finding), unexpected (refused
 * with another code), closed (closed without the error frame a refusal
 * carries) or stuck (open and silent after drain_seconds: a finding).
 *
 * Thread safety: every function may be called from any thread; a
 * hostile_conn belongs to one thread at a time (its probe, then the reaper). */
#ifndef PS_HOSTILE_H
#define PS_HOSTILE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "auth.h"
#include "handshake.h"
#include "net.h"
#include "wire.h"

struct hostile;      /* one attack on one shard */
struct hostile_conn; /* one connection to it */

enum hostile_outcome {
  HOSTILE_REJECTED,
  HOSTILE_DROPPED,
  HOSTILE_TOLERATED,
  HOSTILE_ACCEPTED,
  HOSTILE_UNEXPECTED,
  HOSTILE_CLOSED,
  HOSTILE_STUCK,
  HOSTILE_NUM_OUTCOMES,
  HOSTILE_PENDING = -1, /* left to the reaper */
};

/* What a correct refusal of one mutated frame looks like. */
enum {
  HOSTILE_DROP = 1,         /* a close without a reply is the correct refusal */
  HOSTILE_TOLERATE = 2,     /* a normal reply is harmless */
  HOSTILE_TOLERATE_DUP = 4, /* an ACK flagged duplicate (not applied) is harmless */
  HOSTILE_HDR_ONLY = 8,     /* only preamble and header were sent: a drop means the shard took
                               them and waits for the payload (accepted) */
};
struct hostile_expect {
  uint32_t ok;  /* bit per ErrorCode: a correct refusal */
  uint32_t bad; /* codes only a handler behind a skipped check sends */
  unsigned flags;
};
#define HOSTILE_CODE(x) (1u << PS__ERROR_CODE__ERR_##x)
#define HOSTILE_ANY_CODE (~1u) /* every code but ERR_NONE */

/* Connections the reaper holds until the shard drops them. */
enum hostile_holder {
  HOSTILE_SLOW,      /* a frame one byte a second, before authentication */
  HOSTILE_SLOW_AUTH, /* the same after it */
  HOSTILE_IDLE,      /* nothing at all */
  HOSTILE_IDLE_AUTH, /* nothing after authenticating */
  HOSTILE_FLOOD,     /* authenticated: STATS requests as fast as the shard takes them while
                        the attack lasts (until hostile_finish), replies never read; then
                        read until the shard drops it */
  HOSTILE_NUM_HOLDERS,
};

/* Which replies carry a tag (common/auth.h). */
enum hostile_tags { HOSTILE_TAG_NONE, HOSTILE_TAG_ALL, HOSTILE_TAG_NOT_ON_ERROR };

/* One frame of the shard's. */
struct hostile_reply {
  int type; /* Ps__MsgType */
  int code; /* ERROR: its code, else -1 */
  uint32_t flags;
  char msg[160];
};

enum hostile_read { HOSTILE_FRAME, HOSTILE_EOF, HOSTILE_TIMEOUT, HOSTILE_BAD };

struct hostile_opts {
  struct net_addr addr;
  const struct auth_token *token; /* NULL: no authenticated connections */
  uint32_t rank, world;           /* what authenticated connections claim */
  int connections;                /* probe connections open at once */
  double drain_seconds;           /* silent this long after the last frame: stuck */
  const char *const *probe_names; /* per-probe counts, by index */
  int num_probes;
};

/* Starts the reaper. Returns 0 or a negative errno. */
int hostile_new(const struct hostile_opts *o, struct hostile **out);
/* Waits until every parked outcome and held connection is resolved, then
 * stops the reaper; the counts are final afterwards. */
void hostile_finish(struct hostile *h);
void hostile_free(struct hostile *h); /* after hostile_finish; NULL is fine */

/* Mutated frames judged so far (hostile_judge calls). */
uint64_t hostile_sent(struct hostile *h);
/* A frame accepted, a connection stuck or a held one never dropped. */
bool hostile_findings(struct hostile *h);
/* Per-probe table on err, the summary line on out (see ps-hostile.c). */
void hostile_report(struct hostile *h, FILE *out, FILE *err, int keys, double seconds);
/* A setup step (connect, handshake, a setup reply) failed: counted. */
void hostile_setup_failed(struct hostile *h, const char *what);

/* Connects (a slot of --connections when slot; waits for one). NULL after a
 * setup failure. */
struct hostile_conn *hostile_conn_open(struct hostile *h, bool slot);
void hostile_conn_close(struct hostile *h, struct hostile_conn *c); /* NULL is fine */
/* Writes the three parts (any may be empty); a shard that already closed
 * is not an error here: the read that follows says what happened. */
void hostile_conn_write(struct hostile_conn *c, const void *a, size_t alen, const void *b,
                        size_t blen, const void *t, size_t tlen);
/* shutdown(SHUT_WR): the shard sees our end of the stream. */
void hostile_conn_shutdown_write(struct hostile_conn *c);
/* The tag of hdr || payload under the connection's session (zeros without
 * one); the session's counter advances. */
void hostile_conn_seal(struct hostile_conn *c, const uint8_t *hdr, size_t hlen, const void *pay,
                       size_t plen, uint8_t tag[AUTH_TAG_BYTES]);
/* Seals and writes hdr || payload || tag. */
void hostile_conn_send_sealed(struct hostile_conn *c, const uint8_t *hdr, size_t hlen,
                              const void *pay, size_t plen, uint8_t tag[AUTH_TAG_BYTES]);
/* Replies from now on carry tags (mode) under sess (owned by c from now). */
void hostile_conn_set_session(struct hostile_conn *c, struct auth_session *sess,
                              enum hostile_tags mode);

/* Reads one frame of the shard's (or its close) within ms (0: only what has
 * arrived). Counts every error frame by code and a close without one. hp
 * (optional) gets the decoded header, valid until the next read into the
 * same arena. */
enum hostile_read hostile_read(struct hostile *h, struct hostile_conn *c, struct wire_arena *arena,
                               int ms, struct hostile_reply *out, wire_header **hp);
/* A reply to a setup frame within a few seconds; -1 after a setup failure. */
int hostile_read_setup(struct hostile *h, struct hostile_conn *c, struct wire_arena *arena,
                       const char *what, struct hostile_reply *rep, wire_header **hp);

/* The outcome of the mutated frame just sent on *cp for probe (index) and
 * variant (text): waits up to ms, then leaves it to the reaper. Returns the
 * outcome (the connection stays the caller's, perhaps closed by the shard)
 * or HOSTILE_PENDING (*cp is NULL then). rep (optional) gets the reply. */
int hostile_judge(struct hostile *h, struct hostile_conn **cp, struct wire_arena *arena,
                  struct hostile_expect e, int ms, int probe, const char *variant,
                  struct hostile_reply *rep);

/* Sends a valid HELLO as (rank, world) built in buf (cap bytes; its bytes
 * stay there) and reads the shard's AUTH: then hs holds the proof to send
 * (hs->proof) and the session. pa (optional) gets the shard's proof.
 * Returns 0, 1 if the shard refused the hello (counted), -1 after a setup
 * failure. */
int hostile_hello(struct hostile *h, struct hostile_conn *c, struct wire_arena *arena,
                  struct hs *hs, uint32_t rank, uint32_t world, uint8_t *buf, size_t cap,
                  size_t *len, uint8_t pa[AUTH_PROOF_BYTES]);
/* The whole handshake as the configured rank: afterwards every frame both
 * ways carries a tag. The first success is kept for hostile_captured.
 * Returns 0 or -1 (a setup failure). */
int hostile_handshake(struct hostile *h, struct hostile_conn *c, struct wire_arena *arena);
/* Copies the bytes of an earlier successful handshake's HELLO and AUTH
 * frames (caps of HOSTILE_CAPTURE_BYTES). Returns false if none yet. */
#define HOSTILE_CAPTURE_BYTES (HS_MAX_HEADER + FRAME_PREAMBLE_BYTES)
bool hostile_captured(struct hostile *h, uint8_t *hello, size_t *hello_len, uint8_t *auth,
                      size_t *auth_len);
/* An AUTH frame with this proof, into buf. Returns its length (0 if it does
 * not fit). */
size_t hostile_enc_auth(uint8_t *buf, size_t cap, const uint8_t *proof, size_t len);

/* Hands c (after its handshake, if any, and the start of its slow frame)
 * to the reaper, which times its drop; a slowloris gets one byte a second,
 * a flood its requests. */
void hostile_hold(struct hostile *h, struct hostile_conn *c, enum hostile_holder kind);

#endif
