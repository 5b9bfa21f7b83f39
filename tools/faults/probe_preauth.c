/* probe_preauth: the probes before authentication, frames anyone who
 * reaches the shard's port can send (probe.h).
 *
 * Until its ACK a connection may send only a HELLO and an AUTH with small
 * headers and no payload (ARCHITECTURE.md, Wire): every probe here breaks
 * that somewhere (the preamble, the header, the order of the handshake, its
 * nonces, proofs and ranks) and expects the shard's refusal, or a drop at
 * its handshake deadline. A HELLO the shard may take (a bit flip that does
 * not matter, unknown fields) is followed by a wrong proof, so no
 * connection here ever gets past authentication. Without --auth-token-file
 * the probes that need the shard's AUTH (a proof to break) do not run. */
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "frame.h"
#include "probe.h"

static void put16(uint8_t *b, uint16_t v) {
  b[0] = (uint8_t)v;
  b[1] = (uint8_t)(v >> 8);
}

static uint32_t get32(const uint8_t *b) {
  return (uint32_t)b[0] | (uint32_t)b[1] << 8 | (uint32_t)b[2] << 16 | (uint32_t)b[3] << 24;
}

/* After a HELLO the shard took (tolerated): a wrong proof must end it. */
static void wrong_proof(struct probe_ctx *p, struct hostile_conn **cp) {
  uint8_t proof[AUTH_PROOF_BYTES];
  for (size_t i = 0; i < sizeof(proof); i++) proof[i] = (uint8_t)probe_rnd(p);
  size_t n = probe_enc_auth(p, proof, sizeof(proof));
  hostile_conn_write(*cp, p->fb, n, NULL, 0, NULL, 0);
  snprintf(p->variant, sizeof(p->variant), "random proof after that hello");
  probe_judge(p, cp, probe_expect(C(AUTH), 0, 0));
}

void probe_garbage(struct probe_ctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  size_t n = 16 + probe_rnd(p) % 497;
  for (size_t i = 0; i < n; i++) p->fb[i] = (uint8_t)probe_rnd(p);
  if (get32(p->fb) == FRAME_MAGIC) p->fb[0] ^= 1;
  snprintf(p->variant, sizeof(p->variant), "%zu random bytes", n);
  hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
  probe_judge(p, &c, probe_expect(C(BAD_FRAME), 0, 0));
  probe_close(p, c);
}

/* Bad magic or version, header lengths 0 / above the handshake limit /
 * 65535, payload lengths 1 / max-1 / max / max+1 / 2^32-1 / 2^64-1: only
 * the preamble of a HELLO (the shard refuses it on the preamble alone). */
void probe_bad_preamble(struct probe_ctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *c = hostile_conn_open(A->h, true);
  if (!c) return;
  size_t n = probe_enc_hello(p, A->rank, A->world, AUTH_NONCE_BYTES);
  uint16_t hlen = (uint16_t)(n - FRAME_PREAMBLE_BYTES);
  struct hostile_expect e = probe_expect(C(TOO_LARGE), 0, 0);
  switch (probe_rnd(p) % 5) {
    case 0:
      p->fb[probe_rnd(p) % 4] ^= (uint8_t)(1u << (probe_rnd(p) % 8));
      snprintf(p->variant, sizeof(p->variant), "bad magic");
      e = probe_expect(C(BAD_FRAME), 0, 0);
      break;
    case 1: {
      static const uint16_t versions[] = {0, 2, 0xffff};
      uint16_t v = versions[probe_rnd(p) % 3];
      put16(p->fb + 4, v);
      snprintf(p->variant, sizeof(p->variant), "version %u", v);
      e = probe_expect(C(BAD_FRAME), 0, 0);
      break;
    }
    case 2:
      frame_preamble_encode(p->fb, 0, 0);
      snprintf(p->variant, sizeof(p->variant), "header length 0");
      n = FRAME_PREAMBLE_BYTES;
      break;
    case 3: {
      static const uint16_t lens[] = {HS_MAX_HEADER + 1, 65534, 65535};
      uint16_t v = lens[probe_rnd(p) % 3];
      frame_preamble_encode(p->fb, v, 0);
      snprintf(p->variant, sizeof(p->variant), "header length %u before authentication", v);
      n = FRAME_PREAMBLE_BYTES;
      break;
    }
    default: {
      const uint64_t lens[] = {
          1, A->max_frame - 1, A->max_frame, A->max_frame + 1, 0xffffffffull, UINT64_MAX};
      uint64_t v = lens[probe_rnd(p) % 6];
      frame_preamble_encode(p->fb, hlen, v);
      snprintf(p->variant, sizeof(p->variant), "hello with payload length %" PRIu64, v);
      n = FRAME_PREAMBLE_BYTES;
      break;
    }
  }
  hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
  probe_judge(p, &c, e);
  probe_close(p, c);
}

/* A HELLO cut short and then nothing: the handshake deadline drops it. */
void probe_truncated_hello(struct probe_ctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  size_t n = probe_enc_hello(p, p->A->rank, p->A->world, AUTH_NONCE_BYTES);
  size_t cut = 1 + probe_rnd(p) % (n - 1);
  snprintf(p->variant, sizeof(p->variant), "%zu of %zu bytes of a hello", cut, n);
  hostile_conn_write(c, p->fb, cut, NULL, 0, NULL, 0);
  probe_judge(p, &c, probe_expect(0, 0, HOSTILE_DROP));
  probe_close(p, c);
}

/* Headers that are not protobuf, random bytes, or a hello buried in more
 * unknown fields than the pre-authentication decode budget allows. */
void probe_bad_header(struct probe_ctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  uint8_t *b = p->fb + FRAME_PREAMBLE_BYTES;
  size_t hlen = 1 + probe_rnd(p) % 200;
  struct hostile_expect e = probe_expect(C(BAD_FRAME), 0, 0);
  switch (probe_rnd(p) % 3) {
    case 0: /* wire type 7 does not exist */
      memset(b, 0xff, hlen);
      snprintf(p->variant, sizeof(p->variant), "%zu bytes 0xff", hlen);
      break;
    case 1:
      for (size_t i = 0; i < hlen; i++) b[i] = (uint8_t)probe_rnd(p);
      snprintf(p->variant, sizeof(p->variant), "%zu random header bytes", hlen);
      e = probe_expect(HOSTILE_ANY_CODE, 0, HOSTILE_TOLERATE);
      break;
    default:
      hlen = 0;
      b[hlen++] = 0x08; /* type = HELLO, no hello body */
      b[hlen++] = 0x01;
      while (hlen + 2 <= HS_MAX_HEADER) {
        b[hlen++] = (uint8_t)((8 + probe_rnd(p) % 8) << 3); /* varint fields 8..15 */
        b[hlen++] = (uint8_t)(probe_rnd(p) & 0x7f);
      }
      snprintf(p->variant, sizeof(p->variant), "hello type and %zu unknown fields", hlen / 2 - 1);
      e = probe_expect(C(TOO_LARGE) | C(PROTOCOL), 0, 0);
      break;
  }
  frame_preamble_encode(p->fb, (uint16_t)hlen, 0);
  hostile_conn_write(c, p->fb, FRAME_PREAMBLE_BYTES + hlen, NULL, 0, NULL, 0);
  if (probe_judge(p, &c, e) == HOSTILE_TOLERATED) wrong_proof(p, &c);
  probe_close(p, c);
}

/* A valid hello with unknown fields (harmless: proto3 skips them), then a
 * wrong proof. */
void probe_unknown_fields_hello(struct probe_ctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  size_t n = probe_enc_hello(p, p->A->rank, p->A->world, AUTH_NONCE_BYTES);
  n = probe_add_unknown_fields(p, n, 0, HS_MAX_HEADER);
  snprintf(p->variant, sizeof(p->variant), "hello with unknown fields (%zu-byte header)",
           n - FRAME_PREAMBLE_BYTES);
  hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
  if (probe_judge(p, &c, probe_expect(0, 0, HOSTILE_TOLERATE)) == HOSTILE_TOLERATED)
    wrong_proof(p, &c);
  probe_close(p, c);
}

static const int data_types[] = {
    PS__MSG_TYPE__MSG_LAYOUT,   PS__MSG_TYPE__MSG_INIT,     PS__MSG_TYPE__MSG_PUSH,
    PS__MSG_TYPE__MSG_PULL,     PS__MSG_TYPE__MSG_BARRIER,  PS__MSG_TYPE__MSG_STATS,
    PS__MSG_TYPE__MSG_SHUTDOWN, PS__MSG_TYPE__MSG_ROLLBACK, PS__MSG_TYPE__MSG_AUTH};
#define NUM_DATA_TYPES (sizeof(data_types) / sizeof(data_types[0]))

/* Data frames before hello (and, with a payload, larger than anything
 * allowed before authentication). */
void probe_data_before_hello(struct probe_ctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  int type = data_types[probe_rnd(p) % NUM_DATA_TYPES];
  uint64_t plen = probe_rnd(p) % 4 == 0 ? 4 * (1 + probe_rnd(p) % 256) : 0;
  size_t n = probe_enc_data(p, type, p->A->rank, p->A->num_keys ? p->A->keys[0].key : 0, plen);
  memset(p->pay, 0, plen);
  snprintf(p->variant, sizeof(p->variant), "%s with %" PRIu64 " payload bytes before hello",
           wire_type_name(type), plen);
  hostile_conn_write(c, p->fb, n, p->pay, plen, NULL, 0);
  probe_judge(p, &c, probe_expect(plen ? C(TOO_LARGE) : C(AUTH), 0, 0));
  probe_close(p, c);
}

/* A valid hello, then a data frame (or another hello) instead of the proof. */
void probe_data_after_hello(struct probe_ctx *p) {
  struct attack *A = p->A;
  if (!A->token) return;
  struct hostile_conn *c = hostile_conn_open(A->h, true);
  if (!c) return;
  struct hs hs;
  hs_init(&hs, AUTH_INITIATOR, A->token);
  if (probe_hello(p, c, &hs, A->rank, A->world, NULL) == 0) {
    int type = probe_rnd(p) % 5 == 0
                   ? PS__MSG_TYPE__MSG_HELLO
                   : data_types[probe_rnd(p) % (NUM_DATA_TYPES - 1)]; /* not AUTH */
    size_t n = probe_enc_data(p, type, A->rank, 0, 0);
    snprintf(p->variant, sizeof(p->variant), "%s instead of the proof", wire_type_name(type));
    hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
    probe_judge(p, &c, probe_expect(C(AUTH), 0, 0));
  }
  hs_deinit(&hs);
  probe_close(p, c);
}

void probe_bad_nonce(struct probe_ctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  static const size_t lens[] = {0, 1, 31, 33, 64};
  size_t len = lens[probe_rnd(p) % 5];
  size_t n = probe_enc_hello(p, p->A->rank, p->A->world, len);
  snprintf(p->variant, sizeof(p->variant), "hello with a %zu-byte nonce", len);
  hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
  /* without a token the shard takes a hello with no nonce (and refuses the rest) */
  probe_judge(p, &c, probe_expect(C(AUTH), 0, p->A->token ? 0 : HOSTILE_TOLERATE));
  probe_close(p, c);
}

/* Proofs that must fail: random, empty, short, long, or the shard's own
 * proof sent back (reflection). */
void probe_wrong_proof(struct probe_ctx *p) {
  struct attack *A = p->A;
  if (!A->token) return;
  struct hostile_conn *c = hostile_conn_open(A->h, true);
  if (!c) return;
  struct hs hs;
  hs_init(&hs, AUTH_INITIATOR, A->token);
  uint8_t pa[AUTH_PROOF_BYTES] = {0}, proof[64];
  if (probe_hello(p, c, &hs, A->rank, A->world, pa) == 0) {
    static const size_t lens[] = {AUTH_PROOF_BYTES, 0, 31, 33, 64, AUTH_PROOF_BYTES};
    int v = (int)(probe_rnd(p) % 6);
    for (size_t i = 0; i < sizeof(proof); i++) proof[i] = (uint8_t)probe_rnd(p);
    if (v == 5) memcpy(proof, pa, AUTH_PROOF_BYTES);
    snprintf(p->variant, sizeof(p->variant),
             v == 5 ? "the shard's proof reflected" : "%zu-byte wrong proof", lens[v]);
    size_t n = probe_enc_auth(p, proof, lens[v]);
    hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
    probe_judge(p, &c, probe_expect(C(AUTH), 0, 0));
  }
  hs_deinit(&hs);
  probe_close(p, c);
}

/* A whole earlier handshake replayed: its hello is a valid hello (the shard
 * answers with a fresh nonce), its proof is then wrong. */
void probe_replay_handshake(struct probe_ctx *p) {
  struct attack *A = p->A;
  uint8_t hello[HOSTILE_CAPTURE_BYTES], auth[HOSTILE_CAPTURE_BYTES];
  size_t hl, al;
  bool have = hostile_captured(A->h, hello, &hl, auth, &al);
  if (!have) return;
  struct hostile_conn *c = hostile_conn_open(A->h, true);
  if (!c) return;
  snprintf(p->variant, sizeof(p->variant), "replayed hello");
  hostile_conn_write(c, hello, hl, NULL, 0, NULL, 0);
  if (probe_judge(p, &c, probe_expect(0, 0, HOSTILE_TOLERATE)) == HOSTILE_TOLERATED) {
    snprintf(p->variant, sizeof(p->variant), "replayed proof");
    hostile_conn_write(c, auth, al, NULL, 0, NULL, 0);
    probe_judge(p, &c, probe_expect(C(AUTH), 0, 0));
  }
  probe_close(p, c);
}

/* One bit of a valid hello flipped: refused, dropped at the deadline (a
 * longer header never completes) or, where the bit does not matter, a
 * hello the shard answers (then a wrong proof ends it). */
void probe_flip_hello(struct probe_ctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (!c) return;
  size_t n = probe_enc_hello(p, p->A->rank, p->A->world, AUTH_NONCE_BYTES);
  size_t bit = probe_rnd(p) % (n * 8);
  p->fb[bit / 8] ^= (uint8_t)(1u << (bit % 8));
  snprintf(p->variant, sizeof(p->variant), "hello with bit %zu of %zu flipped", bit, n * 8);
  hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
  if (probe_judge(p, &c, probe_expect(HOSTILE_ANY_CODE, 0, HOSTILE_DROP | HOSTILE_TOLERATE)) ==
      HOSTILE_TOLERATED)
    wrong_proof(p, &c);
  probe_close(p, c);
}

/* One bit of a valid proof frame flipped: never an ACK. */
void probe_flip_auth(struct probe_ctx *p) {
  struct attack *A = p->A;
  if (!A->token) return;
  struct hostile_conn *c = hostile_conn_open(A->h, true);
  if (!c) return;
  struct hs hs;
  hs_init(&hs, AUTH_INITIATOR, A->token);
  if (probe_hello(p, c, &hs, A->rank, A->world, NULL) == 0) {
    size_t n = probe_enc_auth(p, hs.proof, AUTH_PROOF_BYTES);
    size_t bit = probe_rnd(p) % (n * 8);
    p->fb[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    snprintf(p->variant, sizeof(p->variant), "proof frame with bit %zu of %zu flipped", bit, n * 8);
    hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
    /* to check the tag of an ACK, should one come */
    hostile_conn_set_session(c, hs_take_session(&hs), HOSTILE_TAG_NOT_ON_ERROR);
    probe_judge(p, &c, probe_expect(HOSTILE_ANY_CODE, 0, HOSTILE_DROP));
  }
  hs_deinit(&hs);
  probe_close(p, c);
}

/* Authenticated, but as a rank or world size the shard does not have. */
void probe_bad_rank_hello(struct probe_ctx *p) {
  struct attack *A = p->A;
  struct hostile_conn *c = hostile_conn_open(A->h, true);
  if (!c) return;
  uint32_t rank = A->rank, world = A->world;
  switch (probe_rnd(p) % 4) {
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
  if (probe_hello(p, c, &hs, rank, world, NULL) == 0) {
    size_t n = probe_enc_auth(p, hs.proof, AUTH_PROOF_BYTES);
    hostile_conn_write(c, p->fb, n, NULL, 0, NULL, 0);
    hostile_conn_set_session(c, hs_take_session(&hs), HOSTILE_TAG_NOT_ON_ERROR);
    probe_judge(p, &c, probe_expect(C(BAD_RANK), 0, 0));
  }
  hs_deinit(&hs);
  probe_close(p, c);
}
