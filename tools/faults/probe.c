/* probe: the frame builders and judging helpers of ps-hostile's probes, and
 * a probe thread's context (probe.h says what lives where).
 *
 * Every frame is built in the context's buffers (p->fb for preamble and
 * header, p->pay for the payload), so a probe thread allocates nothing per
 * frame; the random stream is the context's own, so a seed fixes a
 * thread's mutations. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "probe.h"

enum {
  SYNC_MS = 200,    /* then the engine's reaper waits for the outcome */
  FOLLOW_MS = 2000, /* the same where a reply leads to a next frame */
};

/* ---- the context --------------------------------------------------------- */

int probe_ctx_init(struct probe_ctx *p, struct attack *A, uint64_t seed) {
  memset(p, 0, sizeof(*p));
  p->A = A;
  p->rng = seed * 0x9e3779b97f4a7c15ull + 0x2545f4914f6cdd1dull;
  if (!p->rng) p->rng = 1;
  p->pay_cap =
      A->max_key_bytes + 64 > PROBE_FULL_FRAME_MAX ? A->max_key_bytes + 64 : PROBE_FULL_FRAME_MAX;
  p->fb = malloc(PROBE_FB_BYTES);
  p->pay = malloc(p->pay_cap);
  if (!p->fb || !p->pay || wire_arena_init(&p->arena, 64 * 1024) < 0) return -ENOMEM;
  return 0;
}

void probe_ctx_deinit(struct probe_ctx *p) {
  if (!p) return;
  free(p->fb);
  free(p->pay);
  wire_arena_deinit(&p->arena);
  p->fb = p->pay = NULL;
}

uint64_t probe_rnd(struct probe_ctx *p) { /* xorshift64* */
  p->rng ^= p->rng >> 12;
  p->rng ^= p->rng << 25;
  p->rng ^= p->rng >> 27;
  return p->rng * 2685821657736338717ull;
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

/* The outcome of the mutated frame just sent (hostile_judge), waiting up to
 * ms. */
int probe_judge_for(struct probe_ctx *p, struct hostile_conn **cp, struct hostile_expect e, int ms,
                    struct hostile_reply *rep) {
  return hostile_judge(p->A->h, cp, &p->arena, e, ms, p->probe, p->variant, rep);
}

/* A refusal that is a silent drop takes the shard's deadline: the reaper
 * waits for it at once. A tolerated reply leads to a next frame: worth
 * waiting for. */
int probe_judge(struct probe_ctx *p, struct hostile_conn **cp, struct hostile_expect e) {
  int ms = e.ok == 0 && (e.flags & HOSTILE_DROP) ? 0
           : (e.flags & HOSTILE_TOLERATE)        ? FOLLOW_MS
                                                 : SYNC_MS;
  return probe_judge_for(p, cp, e, ms, NULL);
}

/* ---- frames ------------------------------------------------------------- */

size_t probe_enc(struct probe_ctx *p, const wire_header *h, uint64_t plen) {
  int n = wire_frame_encode(h, plen, p->fb, PROBE_FB_BYTES);
  return n > 0 ? (size_t)n : 0;
}

/* A HELLO with a fresh random nonce of nonce_len bytes. */
size_t probe_enc_hello(struct probe_ctx *p, uint32_t rank, uint32_t world, size_t nonce_len) {
  uint8_t nonce[64];
  for (size_t i = 0; i < sizeof(nonce); i++) nonce[i] = (uint8_t)probe_rnd(p);
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
  return probe_enc(p, &h, 0);
}

size_t probe_enc_data(struct probe_ctx *p, int type, uint32_t rank, uint64_t key, uint64_t plen) {
  Ps__Header h = PS__HEADER__INIT;
  h.type = (Ps__MsgType)type;
  h.request_id = ++p->rid;
  h.rank = rank;
  h.key = key;
  return probe_enc(p, &h, plen);
}

/* Appends unknown fields (numbers the schema does not use) to the header
 * in p->fb of n bytes, up to limit bytes of header, and fixes the preamble.
 * Returns the new frame length. */
size_t probe_add_unknown_fields(struct probe_ctx *p, size_t n, uint64_t plen, size_t limit) {
  size_t hlen = n - FRAME_PREAMBLE_BYTES;
  uint8_t *b = p->fb + FRAME_PREAMBLE_BYTES;
  while (hlen + 16 <= limit) {
    switch (probe_rnd(p) % 3) {
      case 0: /* varint field 1000 */
        hlen += varint(b + hlen, (1000u << 3) | 0);
        hlen += varint(b + hlen, probe_rnd(p) >> (probe_rnd(p) % 64));
        break;
      case 1: /* length-delimited field 21..29 */
        hlen += varint(b + hlen, ((21u + probe_rnd(p) % 9) << 3) | 2);
        b[hlen++] = 5;
        for (int i = 0; i < 5; i++) b[hlen++] = (uint8_t)probe_rnd(p);
        break;
      default: /* fixed32 field 30 */
        hlen += varint(b + hlen, (30u << 3) | 5);
        for (int i = 0; i < 4; i++) b[hlen++] = (uint8_t)probe_rnd(p);
        break;
    }
    if (probe_rnd(p) % 4 == 0) break;
  }
  frame_preamble_encode(p->fb, (uint16_t)hlen, plen);
  return FRAME_PREAMBLE_BYTES + hlen;
}

/* Writes count floats of NaN or Inf to p->pay (mode 0 NaN, 1 +Inf, 2 -Inf,
 * 3 zeros but one NaN). */
void probe_fill_nonfinite(struct probe_ctx *p, uint64_t count, int mode) {
  float *f = (float *)p->pay;
  float v = mode == 0 ? NAN : mode == 1 ? INFINITY : mode == 2 ? -INFINITY : 0.0f;
  for (uint64_t i = 0; i < count; i++) f[i] = v;
  if (mode == 3) f[probe_rnd(p) % count] = NAN;
}

const struct key_info *probe_pick_key(struct probe_ctx *p) {
  return &p->A->keys[probe_rnd(p) % (uint64_t)p->A->num_keys];
}

size_t probe_enc_auth(struct probe_ctx *p, const uint8_t *proof, size_t len) {
  return hostile_enc_auth(p->fb, PROBE_FB_BYTES, proof, len);
}

/* ---- handshakes ------------------------------------------------------------ */

/* A valid HELLO as (rank, world) and the shard's AUTH (hostile_hello). */
int probe_hello(struct probe_ctx *p, struct hostile_conn *c, struct hs *hs, uint32_t rank,
                uint32_t world, uint8_t pa[AUTH_PROOF_BYTES]) {
  size_t len;
  return hostile_hello(p->A->h, c, &p->arena, hs, rank, world, p->fb, PROBE_FB_BYTES, &len, pa);
}

/* An authenticated connection as the configured rank, or NULL. */
struct hostile_conn *probe_open_authed(struct probe_ctx *p) {
  struct hostile_conn *c = hostile_conn_open(p->A->h, true);
  if (c && hostile_handshake(p->A->h, c, &p->arena) < 0) {
    hostile_conn_close(p->A->h, c);
    return NULL;
  }
  return c;
}

void probe_close(struct probe_ctx *p, struct hostile_conn *c) {
  hostile_conn_close(p->A->h, c);
}
