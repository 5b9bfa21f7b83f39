/* probe: what ps-hostile's probes share: the attack's view of the shard, a
 * probe thread's context, and the frame builders and judging helpers every
 * probe is written with.
 *
 * A probe is a small script on its own connection(s): setup frames (hello,
 * authentication, a valid STATS to replay) and mutated frames, each judged
 * against an expectation by the engine (hostile.h). The probes are split at
 * authentication, the line the shard's limits change at: probe_preauth.c
 * holds what a stranger without the token can send (garbage, preambles,
 * handshakes gone wrong), probe_authed.c what a connection holding the
 * token can (tags, keys, sizes, ranks, layouts). ps-hostile.c lists them in
 * its probe table, finds the shard's keys and runs the probe threads.
 *
 * Threads: struct attack is filled before the probe threads start and only
 * read by them; a probe_ctx belongs to one thread, and every function here
 * touches only its own context, the engine (thread safe) and the attack. */
#ifndef PS_PROBE_H
#define PS_PROBE_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "auth.h"
#include "handshake.h"
#include "hostile.h"
#include "wire.h"

enum {
  PROBE_FB_BYTES = 70000,           /* preamble + the largest header */
  PROBE_FULL_FRAME_MAX = 60 * 1024, /* larger wrong-size frames: preamble and header only */
  PROBE_SETUP_MS = 5000,            /* NaN pushes: their refusal leads to the next frame */
  PROBE_MAX_KEYS = 64,
};

/* The bit of one ErrorCode in an expectation; short, as every probe says it. */
#define C(x) HOSTILE_CODE(x)

struct hostile_config;

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
  struct key_info keys[PROBE_MAX_KEYS]; /* keys found on the shard: the only ones pushed to */
  int num_keys;
  bool have_layout;
  uint64_t max_key_bytes;
  int avail[64], num_avail; /* probes whose needs are met */
  atomic_uint_fast64_t next_probe;
};

/* Per probe thread. */
struct probe_ctx {
  struct attack *A;
  uint64_t rng;
  struct wire_arena arena;
  uint8_t *fb;  /* PROBE_FB_BYTES: preamble + header being built */
  uint8_t *pay; /* payload being built (largest key, at least PROBE_FULL_FRAME_MAX) */
  size_t pay_cap;
  uint64_t rid;
  int probe;
  char variant[96];
};

/* Sets up p for one thread of attack A: its buffers (the payload buffer
 * sized to the largest key found, so A's keys must be known by then) and
 * its random stream from seed. Returns 0 or -ENOMEM; probe_ctx_deinit
 * releases what was allocated either way. */
int probe_ctx_init(struct probe_ctx *p, struct attack *A, uint64_t seed);
void probe_ctx_deinit(struct probe_ctx *p);

/* The next number of p's random stream (xorshift64*): the same seed sends
 * the same mutations. */
uint64_t probe_rnd(struct probe_ctx *p);

/* ERR_NOT_INITIALISED is a right refusal of any frame: a key no INIT has
 * reached yet refuses pushes and keeps the connection (issue 35), and the
 * attack may reach a key before the job's workers initialise it. */
static inline struct hostile_expect probe_expect(uint32_t ok, uint32_t bad, unsigned flags) {
  return (struct hostile_expect){ok | HOSTILE_CODE(NOT_INITIALISED), bad, flags};
}

/* The outcome of the mutated frame just sent (hostile_judge), waiting up to
 * ms; probe_judge picks the wait from the expectation. */
int probe_judge_for(struct probe_ctx *p, struct hostile_conn **cp, struct hostile_expect e, int ms,
                    struct hostile_reply *rep);
int probe_judge(struct probe_ctx *p, struct hostile_conn **cp, struct hostile_expect e);

/* Frames built into p->fb; each returns the length of preamble and header
 * (the payload, if any, is sent from p->pay). */
size_t probe_enc(struct probe_ctx *p, const wire_header *h, uint64_t plen);
size_t probe_enc_hello(struct probe_ctx *p, uint32_t rank, uint32_t world, size_t nonce_len);
size_t probe_enc_data(struct probe_ctx *p, int type, uint32_t rank, uint64_t key, uint64_t plen);
size_t probe_enc_auth(struct probe_ctx *p, const uint8_t *proof, size_t len);
/* Appends unknown fields to the header of the n-byte frame in p->fb, up to
 * limit bytes of header, and fixes the preamble; returns the new length. */
size_t probe_add_unknown_fields(struct probe_ctx *p, size_t n, uint64_t plen, size_t limit);
/* Writes count floats of NaN or Inf to p->pay (mode 0 NaN, 1 +Inf, 2 -Inf,
 * 3 zeros but one NaN). */
void probe_fill_nonfinite(struct probe_ctx *p, uint64_t count, int mode);
/* One of the keys found on the shard, at random (needs A->num_keys > 0). */
const struct key_info *probe_pick_key(struct probe_ctx *p);

/* A valid HELLO as (rank, world) and the shard's AUTH (hostile_hello). */
int probe_hello(struct probe_ctx *p, struct hostile_conn *c, struct hs *hs, uint32_t rank,
                uint32_t world, uint8_t pa[AUTH_PROOF_BYTES]);
/* An authenticated connection as the configured rank, or NULL. */
struct hostile_conn *probe_open_authed(struct probe_ctx *p);
/* Ends a probe's connection (NULL once the engine took it over). */
void probe_close(struct probe_ctx *p, struct hostile_conn *c);

/* The probes before authentication (probe_preauth.c). */
void probe_garbage(struct probe_ctx *p);
void probe_bad_preamble(struct probe_ctx *p);
void probe_truncated_hello(struct probe_ctx *p);
void probe_bad_header(struct probe_ctx *p);
void probe_unknown_fields_hello(struct probe_ctx *p);
void probe_data_before_hello(struct probe_ctx *p);
void probe_data_after_hello(struct probe_ctx *p);
void probe_bad_nonce(struct probe_ctx *p);
void probe_wrong_proof(struct probe_ctx *p);
void probe_replay_handshake(struct probe_ctx *p);
void probe_flip_hello(struct probe_ctx *p);
void probe_flip_auth(struct probe_ctx *p);
void probe_bad_rank_hello(struct probe_ctx *p);

/* The probes after authentication (probe_authed.c). */
void probe_nan(struct probe_ctx *p);
void probe_replay_other(struct probe_ctx *p);
void probe_replay_stats(struct probe_ctx *p);
void probe_flip_authed(struct probe_ctx *p);
void probe_forged_tag(struct probe_ctx *p);
void probe_wrong_size(struct probe_ctx *p);
void probe_unknown_key(struct probe_ctx *p);
void probe_other_rank(struct probe_ctx *p);
void probe_unknown_type(struct probe_ctx *p);
void probe_handshake_again(struct probe_ctx *p);
void probe_bad_layout(struct probe_ctx *p);
void probe_lengths_authed(struct probe_ctx *p);
void probe_truncated_authed(struct probe_ctx *p);
void probe_shutdown(struct probe_ctx *p);

#endif
