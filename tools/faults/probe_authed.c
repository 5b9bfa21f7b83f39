/* probe_authed: the probes after authentication, frames of a connection
 * that holds the job's token (probe.h).
 *
 * The attacker is a worker with a stolen token: it authenticates as --rank
 * and then sends only what the shard must refuse (ps-hostile.c, threat
 * model). Every push holds NaN or Inf, which the shard refuses even from a
 * real worker; where another check must come first (the tag, the rank, the
 * size), a NONFINITE refusal says that check was skipped. Tags are
 * replayed, flipped, forged or left out; sizes, keys, ranks, types and
 * layouts are wrong; headers and payload lengths break the limits of an
 * authenticated connection. Pushes go to the keys ps-hostile found on the
 * shard, so that the NaN check is reached at all. */
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "frame.h"
#include "probe.h"

/* Pushes (and inits) of NaN or Inf for a real key as our rank: each refused
 * with the connection kept; then the last one's exact bytes, tag included,
 * again (a replay on the same connection). */
void probe_nan(struct probe_ctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *c = probe_open_authed(p);
  if (!c) return;
  const struct key_info *k = probe_pick_key(p);
  int rounds = 1 + (int)(probe_rnd(p) % 3), o = HOSTILE_REJECTED;
  size_t n = 0;
  uint8_t tag[AUTH_TAG_BYTES];
  for (int i = 0; i < rounds && (o == HOSTILE_REJECTED || o == HOSTILE_TOLERATED); i++) {
    int mode = (int)(probe_rnd(p) % 6);
    static const char *const what[] = {"NaN",     "+Inf", "-Inf", "one NaN", "NaN, unknown fields",
                                       "NaN init"};
    int type = mode == 5 ? PS__MSG_TYPE__MSG_INIT : PS__MSG_TYPE__MSG_PUSH;
    probe_fill_nonfinite(p, k->count, mode <= 3 ? mode : 0);
    n = probe_enc_data(p, type, A->rank, k->key, k->count * 4);
    if (mode == 4) n = probe_add_unknown_fields(p, n, k->count * 4, 2000);
    snprintf(p->variant, sizeof(p->variant), "%s %s of key %016" PRIx64, what[mode],
             wire_type_name(type), k->key);
    hostile_conn_send_sealed(c, p->fb, n, p->pay, k->count * 4, tag);
    /* an init of a key that has its values is ignored (ACK flagged duplicate) */
    o = probe_judge_for(
        p, &c,
        probe_expect(C(NONFINITE), 0, type == PS__MSG_TYPE__MSG_INIT ? HOSTILE_TOLERATE_DUP : 0),
        PROBE_SETUP_MS, NULL);
  }
  if (c && (o == HOSTILE_REJECTED || o == HOSTILE_TOLERATED)) {
    snprintf(p->variant, sizeof(p->variant), "replay of the last frame on its connection");
    hostile_conn_write(c, p->fb, n, p->pay, k->count * 4, tag, AUTH_TAG_BYTES);
    probe_judge(p, &c, probe_expect(C(AUTH), C(NONFINITE), 0));
  }
  probe_close(p, c);
}

/* A tagged frame of one connection sent on another (other session keys). */
void probe_replay_other(struct probe_ctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *a = probe_open_authed(p);
  if (!a) return;
  const struct key_info *k = probe_pick_key(p);
  probe_fill_nonfinite(p, k->count, 0);
  uint8_t hdr[256], tag[AUTH_TAG_BYTES];
  size_t n = probe_enc_data(p, PS__MSG_TYPE__MSG_PUSH, A->rank, k->key, k->count * 4);
  memcpy(hdr, p->fb, n);
  snprintf(p->variant, sizeof(p->variant), "NaN push of key %016" PRIx64, k->key);
  hostile_conn_send_sealed(a, hdr, n, p->pay, k->count * 4, tag);
  int o = probe_judge_for(p, &a, probe_expect(C(NONFINITE), 0, 0), PROBE_SETUP_MS, NULL);
  probe_close(p, a);
  if (o != HOSTILE_REJECTED) return;
  struct hostile_conn *b = probe_open_authed(p);
  if (!b) return;
  snprintf(p->variant, sizeof(p->variant), "replay of another connection's frame");
  hostile_conn_write(b, hdr, n, p->pay, k->count * 4, tag, AUTH_TAG_BYTES);
  probe_judge(p, &b, probe_expect(C(AUTH), C(NONFINITE), 0));
  probe_close(p, b);
}

/* A valid STATS, answered; then its exact bytes again. */
void probe_replay_stats(struct probe_ctx *p) {
  struct hostile_conn *c = probe_open_authed(p);
  if (!c) return;
  uint8_t tag[AUTH_TAG_BYTES];
  size_t n = probe_enc_data(p, PS__MSG_TYPE__MSG_STATS, p->A->rank, 0, 0);
  hostile_conn_send_sealed(c, p->fb, n, NULL, 0, tag);
  struct hostile_reply rep;
  if (hostile_read_setup(p->A->h, c, &p->arena, "stats", &rep, NULL) == 0 &&
      rep.type == PS__MSG_TYPE__MSG_STATS) {
    snprintf(p->variant, sizeof(p->variant), "replayed stats request");
    hostile_conn_write(c, p->fb, n, NULL, 0, tag, AUTH_TAG_BYTES);
    probe_judge(p, &c, probe_expect(C(AUTH), 0, 0));
  }
  probe_close(p, c);
}

/* A tagged STATS or NaN push (header, payload and tag built in place);
 * returns the frame's length without payload and tag. */
static size_t tagged_base(struct probe_ctx *p, struct hostile_conn *c, bool push,
                          const struct key_info **kp, uint8_t tag[AUTH_TAG_BYTES]) {
  const struct key_info *k = push ? probe_pick_key(p) : NULL;
  uint64_t plen = k ? k->count * 4 : 0;
  if (k) probe_fill_nonfinite(p, k->count, 0);
  size_t n = probe_enc_data(p, k ? PS__MSG_TYPE__MSG_PUSH : PS__MSG_TYPE__MSG_STATS, p->A->rank,
                            k ? k->key : 0, plen);
  hostile_conn_seal(c, p->fb, n, p->pay, (size_t)plen, tag);
  *kp = k;
  return n;
}

/* One bit flipped anywhere in a tagged frame: preamble, header, payload or
 * tag. Refused or dropped, never answered, and never handled (NONFINITE
 * would mean the NaN check ran before the tag check). */
void probe_flip_authed(struct probe_ctx *p) {
  struct hostile_conn *c = probe_open_authed(p);
  if (!c) return;
  const struct key_info *k;
  uint8_t tag[AUTH_TAG_BYTES];
  size_t n = tagged_base(p, c, p->A->num_keys > 0 && probe_rnd(p) % 2, &k, tag);
  size_t plen = k ? (size_t)k->count * 4 : 0;
  static const char *const where[] = {"preamble", "header", "tag", "payload"};
  int region = (int)(probe_rnd(p) % (plen ? 4 : 3));
  uint8_t *base = region == 0   ? p->fb
                  : region == 1 ? p->fb + FRAME_PREAMBLE_BYTES
                  : region == 2 ? tag
                                : p->pay;
  size_t len = region == 0   ? FRAME_PREAMBLE_BYTES
               : region == 1 ? n - FRAME_PREAMBLE_BYTES
               : region == 2 ? AUTH_TAG_BYTES
                             : plen;
  size_t bit = probe_rnd(p) % (len * 8);
  base[bit / 8] ^= (uint8_t)(1u << (bit % 8));
  snprintf(p->variant, sizeof(p->variant), "%s with bit %zu of its %s flipped",
           k ? "NaN push" : "stats", bit, where[region]);
  hostile_conn_write(c, p->fb, n, p->pay, plen, tag, AUTH_TAG_BYTES);
  probe_judge(p, &c, probe_expect(HOSTILE_ANY_CODE & ~C(NONFINITE), C(NONFINITE), HOSTILE_DROP));
  probe_close(p, c);
}

/* Tags that were never computed: zero, random, or missing altogether (then
 * the shard waits for the tag until its frame deadline). */
void probe_forged_tag(struct probe_ctx *p) {
  struct hostile_conn *c = probe_open_authed(p);
  if (!c) return;
  const struct key_info *k;
  uint8_t tag[AUTH_TAG_BYTES];
  size_t n = tagged_base(p, c, p->A->num_keys > 0 && probe_rnd(p) % 2, &k, tag);
  size_t plen = k ? (size_t)k->count * 4 : 0;
  int v = (int)(probe_rnd(p) % 3);
  if (v == 0) memset(tag, 0, sizeof(tag));
  for (size_t i = 0; v == 1 && i < sizeof(tag); i++) tag[i] = (uint8_t)probe_rnd(p);
  snprintf(p->variant, sizeof(p->variant), "%s with %s tag", k ? "NaN push" : "stats",
           v == 0   ? "a zero"
           : v == 1 ? "a random"
                    : "no");
  hostile_conn_write(c, p->fb, n, p->pay, plen, tag, v == 2 ? 0 : AUTH_TAG_BYTES);
  probe_judge(p, &c,
              v == 2 ? probe_expect(0, 0, HOSTILE_DROP) : probe_expect(C(AUTH), C(NONFINITE), 0));
  probe_close(p, c);
}

/* Pushes whose payload length does not match the key: whole frames (NaN)
 * while small, else preamble and header only. */
void probe_wrong_size(struct probe_ctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *c = probe_open_authed(p);
  if (!c) return;
  const struct key_info *k = probe_pick_key(p);
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
  do plen = lens[probe_rnd(p) % (sizeof(lens) / sizeof(lens[0]))];
  while (plen == want);
  size_t n = probe_enc_data(p, PS__MSG_TYPE__MSG_PUSH, A->rank, k->key, plen);
  struct hostile_expect e =
      probe_expect(plen > A->max_frame ? C(TOO_LARGE) : C(BAD_SIZE), C(NONFINITE), 0);
  snprintf(p->variant, sizeof(p->variant), "push of %" PRIu64 " bytes to a %" PRIu64 "-byte key",
           plen, want);
  if (plen <= PROBE_FULL_FRAME_MAX && n + plen + AUTH_TAG_BYTES <= PROBE_FULL_FRAME_MAX) {
    uint8_t tag[AUTH_TAG_BYTES];
    probe_fill_nonfinite(p, plen / 4 + 1, 0);
    hostile_conn_send_sealed(c, p->fb, n, p->pay, (size_t)plen, tag);
  } else {
    e.flags |= HOSTILE_HDR_ONLY;
    hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
  }
  probe_judge(p, &c, e);
  probe_close(p, c);
}

void probe_unknown_key(struct probe_ctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *c = probe_open_authed(p);
  if (!c) return;
  uint64_t key;
  bool known;
  do {
    key = probe_rnd(p) % 2 ? probe_rnd(p) : ((8 + probe_rnd(p) % 1000) << 32 | (probe_rnd(p) % 4));
    known = false;
    for (int i = 0; i < A->num_keys; i++) known |= A->keys[i].key == key;
  } while (known);
  uint64_t plen = 4 * (1 + probe_rnd(p) % 64);
  probe_fill_nonfinite(p, plen / 4, 0);
  size_t n = probe_enc_data(p, PS__MSG_TYPE__MSG_PUSH, A->rank, key, plen);
  uint8_t tag[AUTH_TAG_BYTES];
  snprintf(p->variant, sizeof(p->variant), "push to key %016" PRIx64, key);
  hostile_conn_send_sealed(c, p->fb, n, p->pay, (size_t)plen, tag);
  probe_judge(p, &c, probe_expect(C(BAD_KEY), C(NONFINITE), 0));
  probe_close(p, c);
}

/* A push that claims another rank than the connection authenticated as. */
void probe_other_rank(struct probe_ctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *c = probe_open_authed(p);
  if (!c) return;
  const struct key_info *k = probe_pick_key(p);
  uint32_t rank = A->world > 1 && probe_rnd(p) % 2
                      ? (uint32_t)((A->rank + 1 + probe_rnd(p) % (A->world - 1)) % A->world)
                      : A->world + (uint32_t)(probe_rnd(p) % 1000);
  probe_fill_nonfinite(p, k->count, 0);
  size_t n = probe_enc_data(p, PS__MSG_TYPE__MSG_PUSH, rank, k->key, k->count * 4);
  uint8_t tag[AUTH_TAG_BYTES];
  snprintf(p->variant, sizeof(p->variant),
           "push as rank %" PRIu32 " on rank %" PRIu32 "'s connection", rank, A->rank);
  hostile_conn_send_sealed(c, p->fb, n, p->pay, k->count * 4, tag);
  probe_judge(p, &c, probe_expect(C(BAD_RANK), C(NONFINITE), 0));
  probe_close(p, c);
}

void probe_unknown_type(struct probe_ctx *p) {
  struct hostile_conn *c = probe_open_authed(p);
  if (!c) return;
  static const int types[] = {PS__MSG_TYPE__MSG_UNKNOWN,
                              PS__MSG_TYPE__MSG_PULL_REPLY,
                              PS__MSG_TYPE__MSG_ERROR,
                              PS__MSG_TYPE__MSG_ACK,
                              PS__MSG_TYPE__MSG_ABORT + 1, /* the first number past the known */
                              99,
                              1000000};
  int type = types[probe_rnd(p) % (sizeof(types) / sizeof(types[0]))];
  size_t n = probe_enc_data(p, type, p->A->rank, 0, 0);
  uint8_t tag[AUTH_TAG_BYTES];
  snprintf(p->variant, sizeof(p->variant), "message type %d", type);
  hostile_conn_send_sealed(c, p->fb, n, NULL, 0, tag);
  probe_judge(p, &c, probe_expect(C(UNKNOWN_TYPE), 0, 0));
  probe_close(p, c);
}

/* A second hello or proof on an authenticated connection (correctly tagged). */
void probe_handshake_again(struct probe_ctx *p) {
  struct hostile_conn *c = probe_open_authed(p);
  if (!c) return;
  bool hello = probe_rnd(p) % 2;
  uint8_t proof[AUTH_PROOF_BYTES] = {0};
  size_t n = hello ? probe_enc_hello(p, p->A->rank, p->A->world, AUTH_NONCE_BYTES)
                   : probe_enc_auth(p, proof, sizeof(proof));
  uint8_t tag[AUTH_TAG_BYTES];
  snprintf(p->variant, sizeof(p->variant), "tagged %s after authentication",
           hello ? "hello" : "auth");
  hostile_conn_send_sealed(c, p->fb, n, NULL, 0, tag);
  probe_judge(p, &c, probe_expect(C(PROTOCOL), 0, 0));
  probe_close(p, c);
}

/* Layouts the shard must refuse once it holds one: a different model,
 * dtype 1, a shape whose size overflows, no tensors. */
void probe_bad_layout(struct probe_ctx *p) {
  struct hostile_conn *c = probe_open_authed(p);
  if (!c) return;
  Ps__Header h = PS__HEADER__INIT;
  Ps__Layout l = PS__LAYOUT__INIT;
  Ps__Tensor t = PS__TENSOR__INIT;
  Ps__Tensor *tp = &t;
  uint64_t shape[2] = {7, 1};
  static const char *const what[] = {"another model", "dtype 1", "overflowing shape", "no tensors"};
  int v = (int)(probe_rnd(p) % 4);
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
  l.num_shards = 1 + (uint32_t)(probe_rnd(p) % 4);
  l.hash = probe_rnd(p);
  h.type = PS__MSG_TYPE__MSG_LAYOUT;
  h.request_id = ++p->rid;
  h.rank = p->A->rank;
  h.body_case = PS__HEADER__BODY_LAYOUT;
  h.layout = &l;
  size_t n = probe_enc(p, &h, 0);
  uint8_t tag[AUTH_TAG_BYTES];
  snprintf(p->variant, sizeof(p->variant), "layout: %s", what[v]);
  hostile_conn_send_sealed(c, p->fb, n, NULL, 0, tag);
  probe_judge(p, &c, probe_expect(C(LAYOUT_MISMATCH) | C(BAD_FRAME), 0, 0));
  probe_close(p, c);
}

/* Lengths after authentication: header length 0, headers of up to 65535
 * bytes of unknown fields (beyond the decode budget), payload lengths
 * max-1 / max (wrong size for a STATS) and max+1 / 2^32-1 / 2^64-1. */
void probe_lengths_authed(struct probe_ctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *c = probe_open_authed(p);
  if (!c) return;
  uint8_t tag[AUTH_TAG_BYTES];
  int v = (int)(probe_rnd(p) % 3);
  if (v == 0) {
    frame_preamble_encode(p->fb, 0, 0);
    snprintf(p->variant, sizeof(p->variant), "header length 0 after authentication");
    hostile_conn_write(c, p->fb, FRAME_PREAMBLE_BYTES, NULL, 0, NULL, 0);
    probe_judge(p, &c, probe_expect(C(TOO_LARGE), 0, 0));
  } else if (v == 1) {
    static const size_t lens[] = {65535, 65534, 40000};
    size_t hlen = lens[probe_rnd(p) % 3];
    uint8_t *b = p->fb + FRAME_PREAMBLE_BYTES;
    size_t i = 0;
    b[i++] = 0x08; /* type = STATS */
    b[i++] = PS__MSG_TYPE__MSG_STATS;
    while (i + 2 <= hlen) {
      b[i++] = (uint8_t)((8 + probe_rnd(p) % 8) << 3);
      b[i++] = (uint8_t)(probe_rnd(p) & 0x7f);
    }
    if (i < hlen) b[i++] = 0; /* odd length: one more byte makes it invalid at worst */
    frame_preamble_encode(p->fb, (uint16_t)hlen, 0);
    snprintf(p->variant, sizeof(p->variant), "stats with a %zu-byte header of unknown fields",
             hlen);
    hostile_conn_send_sealed(c, p->fb, FRAME_PREAMBLE_BYTES + hlen, NULL, 0, tag);
    probe_judge(p, &c, probe_expect(C(TOO_LARGE) | C(BAD_FRAME), 0, HOSTILE_TOLERATE));
  } else {
    const uint64_t lens[] = {A->max_frame - 1, A->max_frame, A->max_frame + 1, 0xffffffffull,
                             UINT64_MAX};
    uint64_t plen = lens[probe_rnd(p) % 5];
    size_t n = probe_enc_data(p, PS__MSG_TYPE__MSG_STATS, A->rank, 0, plen);
    snprintf(p->variant, sizeof(p->variant), "stats with payload length %" PRIu64, plen);
    hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
    probe_judge(
        p, &c, probe_expect(plen > A->max_frame ? C(TOO_LARGE) : C(BAD_SIZE), 0, HOSTILE_HDR_ONLY));
  }
  probe_close(p, c);
}

/* A tagged NaN push cut short anywhere and then nothing: the frame
 * deadline drops it. */
void probe_truncated_authed(struct probe_ctx *p) {
  struct hostile_conn *c = probe_open_authed(p);
  if (!c) return;
  const struct key_info *k;
  uint8_t tag[AUTH_TAG_BYTES];
  size_t n = tagged_base(p, c, true, &k, tag);
  size_t plen = (size_t)k->count * 4, total = n + plen + AUTH_TAG_BYTES;
  size_t cut = 1 + probe_rnd(p) % (total - 1);
  snprintf(p->variant, sizeof(p->variant), "%zu of %zu bytes of a tagged push", cut, total);
  size_t a = cut < n ? cut : n, b = cut > n ? (cut - n < plen ? cut - n : plen) : 0;
  size_t t = cut > n + plen ? cut - n - plen : 0;
  hostile_conn_write(c, p->fb, a, p->pay, b, tag, t);
  probe_judge(p, &c, probe_expect(0, 0, HOSTILE_DROP));
  probe_close(p, c);
}

/* SHUTDOWN from a rank that is not 0: refused (only rank 0 ends a job). */
void probe_shutdown(struct probe_ctx *p) {
  struct hostile_conn *c = probe_open_authed(p);
  if (!c) return;
  size_t n = probe_enc_data(p, PS__MSG_TYPE__MSG_SHUTDOWN, p->A->rank, 0, 0);
  uint8_t tag[AUTH_TAG_BYTES];
  snprintf(p->variant, sizeof(p->variant), "shutdown as rank %" PRIu32, p->A->rank);
  hostile_conn_send_sealed(c, p->fb, n, NULL, 0, tag);
  probe_judge(p, &c, probe_expect(C(BAD_RANK), 0, 0));
  probe_close(p, c);
}
