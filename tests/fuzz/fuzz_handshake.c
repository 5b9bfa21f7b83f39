/* fuzz_handshake: the authentication handshake (proto/handshake.c,
 * common/auth.c) against frames from the fuzzer.
 *
 * The input is a byte stream of frames (common/frame.h), decoded as a
 * connection would: before authentication with the handshake limits
 * (headers <= HS_MAX_HEADER, no payload), then with tags and larger limits.
 * The same stream is played against four ends:
 *   - an acceptor with the token: the first frame goes to
 *     hs_acceptor_on_hello, the second to hs_acceptor_on_auth, and once it
 *     is done every further frame must carry a valid tag (auth_open);
 *   - an initiator with the token that has sent its HELLO: the first frame
 *     goes to hs_initiator_on_reply, the second (tagged) to
 *     hs_initiator_on_ack, then tagged frames as above;
 *   - the same two with a different token than the peer proves with;
 *   - an acceptor and an initiator without a token.
 *
 * Nonces are random, so the fuzzer could never produce a valid proof or tag
 * by itself. Where the input holds a placeholder instead (an AUTH proof of
 * FUZZ_PROOF_PLACEHOLDER, a tag of FUZZ_TAG_PLACEHOLDER), the harness puts in what an
 * honest peer with the token would send, so seeds are real transcripts and
 * the fuzzer gets past the handshake.
 *
 * Invariants (abort() if broken): an end reaches HS_DONE exactly when the
 * proof it received equals auth_proof() of its own token over the transcript
 * and nonce; an end with a token never reaches HS_OPEN, one without never
 * sends or accepts a proof; every proof an end sends is auth_proof() of its
 * token; a tag is accepted exactly when it is the one the peer's session
 * computes (frame counters in step), whether checked whole (auth_open) or in
 * pieces (auth_rx_*); the acceptor's sealed ACK opens on the initiator's
 * side; a failed step leaves HS_FAILED. Everything is freed (LeakSanitizer). */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#include "auth.h"
#include "frame.h"
#include "fuzz_placeholders.h"
#include "handshake.h"
#include "wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define MAX_PAYLOAD (64u * 1024u)

#define CHECK(c)                                                                     \
  do {                                                                               \
    if (!(c)) {                                                                      \
      fprintf(stderr, "fuzz_handshake: %s:%d: CHECK(%s)\n", __FILE__, __LINE__, #c); \
      abort();                                                                       \
    }                                                                                \
  } while (0)

/* One end's view of the stream: its decoder, the frame just read. */
struct reader {
  const uint8_t *s;
  size_t len, pos;
  struct frame_decoder d;
  struct wire_arena arena;
  uint8_t *payload; /* the current frame's, or NULL */
  uint64_t payload_len;
  uint8_t tag[AUTH_TAG_BYTES];
  uint64_t tagged; /* tagged frames checked so far */
};

static void reader_init(struct reader *rd, const uint8_t *s, size_t len) {
  memset(rd, 0, sizeof(*rd));
  rd->s = s;
  rd->len = len;
  struct frame_limits lim = {HS_MAX_HEADER, 0};
  if (frame_decoder_init(&rd->d, &lim) < 0) abort();
  if (wire_arena_init(&rd->arena, WIRE_DEFAULT_BUDGET) < 0) abort();
}

static void reader_deinit(struct reader *rd) {
  free(rd->payload);
  frame_decoder_deinit(&rd->d);
  wire_arena_deinit(&rd->arena);
}

/* Authenticated from the next frame on: tags and the working limits. */
static void reader_authenticated(struct reader *rd) {
  struct frame_limits lim = {FRAME_MAX_HEADER, MAX_PAYLOAD};
  if (frame_decoder_set_limits(&rd->d, &lim) < 0) abort();
  frame_decoder_set_tag_len(&rd->d, AUTH_TAG_BYTES);
}

/* Reads the next whole frame. Returns true, or false at the end of the
 * stream or on a framing error (the connection would be dropped). */
static bool next_frame(struct reader *rd) {
  free(rd->payload);
  rd->payload = NULL;
  rd->payload_len = 0;
  if (!frame_decoder_idle(&rd->d)) frame_decoder_reset(&rd->d);
  while (rd->pos < rd->len) {
    size_t used = 0;
    int ev = frame_decoder_feed(&rd->d, rd->s + rd->pos, rd->len - rd->pos, &used);
    CHECK(used <= rd->len - rd->pos);
    rd->pos += used;
    if (ev == FRAME_HEADER) {
      rd->payload_len = frame_decoder_payload_len(&rd->d);
      CHECK(rd->payload_len <= MAX_PAYLOAD);
      rd->payload = malloc(rd->payload_len ? rd->payload_len : 1);
      if (!rd->payload) abort();
      ev = frame_decoder_set_payload(&rd->d, rd->payload);
    }
    if (ev == FRAME_DONE) {
      memcpy(rd->tag, frame_decoder_tag(&rd->d), AUTH_TAG_BYTES);
      return true;
    }
    if (ev < 0) return false;
  }
  return false;
}

static const uint8_t *hdr_bytes(const struct reader *rd) {
  return frame_decoder_header(&rd->d);
}
static size_t hdr_len(const struct reader *rd) {
  return frame_decoder_header_len(&rd->d);
}

/* The current frame's header, or NULL if it does not decode. */
static wire_header *unpack(struct reader *rd) {
  wire_header *h = NULL;
  int r = wire_header_unpack(&rd->arena, hdr_bytes(rd), hdr_len(rd), &h);
  CHECK(r == 0 || r == -EBADMSG || r == -ENOMEM);
  return r == 0 ? h : NULL;
}

/* A proof field holding the placeholder gets `honest` instead. */
static void fill_placeholder(ProtobufCBinaryData *proof, const uint8_t honest[AUTH_PROOF_BYTES]) {
  if (proof->len == AUTH_PROOF_BYTES &&
      memcmp(proof->data, FUZZ_PROOF_PLACEHOLDER, AUTH_PROOF_BYTES) == 0)
    memcpy(proof->data, honest, AUTH_PROOF_BYTES);
}

static bool proof_is(const ProtobufCBinaryData *proof, const uint8_t want[AUTH_PROOF_BYTES]) {
  return proof->len == AUTH_PROOF_BYTES && memcmp(proof->data, want, AUTH_PROOF_BYTES) == 0;
}

/* Checks the current frame's tag with `self` (the end under test) after
 * sealing the same bytes with `peer` (an honest peer's session, counters in
 * step). A placeholder tag becomes the honest one. Returns whether the tag
 * was accepted, which must be exactly when it is the honest one. */
static bool check_tag(struct reader *rd, struct auth_session *self, struct auth_session *peer) {
  struct iovec iov[3] = {{(void *)frame_decoder_preamble(&rd->d), FRAME_PREAMBLE_BYTES},
                         {(void *)hdr_bytes(rd), hdr_len(rd)},
                         {rd->payload, (size_t)rd->payload_len}};
  uint8_t want[AUTH_TAG_BYTES];
  CHECK(auth_seal(peer, iov, 3, want) == 0);
  if (memcmp(rd->tag, FUZZ_TAG_PLACEHOLDER, AUTH_TAG_BYTES) == 0)
    memcpy(rd->tag, want, sizeof(want));
  bool honest = memcmp(rd->tag, want, AUTH_TAG_BYTES) == 0;
  uint64_t before = auth_session_received(self);
  int r;
  if (rd->tagged++ & 1) {
    /* the streaming form, the payload in two pieces */
    size_t half = (size_t)rd->payload_len / 2;
    r = auth_rx_begin(self);
    for (int i = 0; r == 0 && i < 2; i++) r = auth_rx_update(self, iov[i].iov_base, iov[i].iov_len);
    if (r == 0) r = auth_rx_update(self, rd->payload, half);
    if (r == 0) r = auth_rx_update(self, rd->payload + half, (size_t)rd->payload_len - half);
    if (r == 0) r = auth_rx_finish(self, rd->tag);
  } else {
    r = auth_open(self, iov, 3, rd->tag);
  }
  CHECK(r == 0 || r == -EBADMSG);
  CHECK((r == 0) == honest);
  CHECK(auth_session_received(self) == before + (r == 0));
  return r == 0;
}

/* After the handshake: tagged frames until one fails or the stream ends. */
static void tagged_frames(struct reader *rd, struct auth_session *self, struct auth_session *peer) {
  while (next_frame(rd) && check_tag(rd, self, peer)) (void)unpack(rd);
}

/* An acceptor with token `self` against a peer that proves with `peer`. */
static void run_acceptor(const uint8_t *s, size_t len, const struct auth_token *self,
                         const struct auth_token *peer) {
  struct reader rd;
  reader_init(&rd, s, len);
  struct hs a;
  hs_init(&a, AUTH_ACCEPTOR, self);
  struct auth_session *sess = NULL, *mirror = NULL, *peer_rx = NULL;
  char err[256];
  wire_header *h;
  if (!next_frame(&rd) || !(h = unpack(&rd))) goto out;

  Ps__Auth out = PS__AUTH__INIT;
  int r = hs_acceptor_on_hello(&a, hdr_bytes(&rd), hdr_len(&rd), h, &out, err, sizeof(err));
  bool hello = h->type == PS__MSG_TYPE__MSG_HELLO && h->body_case == PS__HEADER__BODY_HELLO;
  CHECK(r == 1 || r < 0);
  CHECK((r == 1) == (hello && h->hello->nonce.len == AUTH_NONCE_BYTES));
  if (r < 0) {
    CHECK(a.state == HS_FAILED);
    goto out;
  }
  CHECK(a.state == HS_WAIT_PROOF);
  /* what it sends: its nonce and the proof of its token over the HELLO */
  uint8_t th[AUTH_HASH_BYTES], nonce[AUTH_NONCE_BYTES], want[AUTH_PROOF_BYTES];
  auth_transcript(hdr_bytes(&rd), hdr_len(&rd), th);
  CHECK(out.nonce.len == AUTH_NONCE_BYTES && out.proof.len == AUTH_PROOF_BYTES);
  memcpy(nonce, out.nonce.data, AUTH_NONCE_BYTES);
  auth_proof(self, AUTH_ACCEPTOR, th, nonce, want);
  CHECK(memcmp(out.proof.data, want, AUTH_PROOF_BYTES) == 0);

  if (!next_frame(&rd) || !(h = unpack(&rd))) goto out;
  uint8_t honest[AUTH_PROOF_BYTES];
  auth_proof(peer, AUTH_INITIATOR, th, nonce, honest);
  bool is_auth = h->type == PS__MSG_TYPE__MSG_AUTH && h->body_case == PS__HEADER__BODY_AUTH;
  if (is_auth) fill_placeholder(&h->auth->proof, honest);
  auth_proof(self, AUTH_INITIATOR, th, nonce, want);
  r = hs_acceptor_on_auth(&a, h, err, sizeof(err));
  CHECK(r == 0 || r == -EACCES || r == -EPROTO);
  CHECK((r == 0) == (is_auth && proof_is(&h->auth->proof, want)));
  CHECK(a.state == (r == 0 ? HS_DONE : HS_FAILED));
  if (r < 0) goto out;
  CHECK(self == peer);
  sess = hs_take_session(&a);
  CHECK(sess && !hs_take_session(&a));
  CHECK(auth_session_new(peer, AUTH_INITIATOR, th, nonce, &mirror) == 0);

  /* the ACK it sends with a tag opens on the initiator's side */
  uint8_t ack[FRAME_PREAMBLE_BYTES + 64], tag[AUTH_TAG_BYTES];
  Ps__Header ah = PS__HEADER__INIT;
  ah.type = PS__MSG_TYPE__MSG_ACK;
  int n = wire_frame_encode(&ah, 0, ack, sizeof(ack));
  CHECK(n > 0);
  struct iovec iov = {ack, (size_t)n};
  CHECK(auth_seal(sess, &iov, 1, tag) == 0);
  CHECK(auth_open(mirror, &iov, 1, tag) == 0);
  tag[0] ^= 1;
  CHECK(auth_session_new(peer, AUTH_INITIATOR, th, nonce, &peer_rx) == 0);
  CHECK(auth_open(peer_rx, &iov, 1, tag) == -EBADMSG);

  reader_authenticated(&rd);
  tagged_frames(&rd, sess, mirror);
out:
  auth_session_free(peer_rx);
  auth_session_free(mirror);
  auth_session_free(sess);
  hs_deinit(&a);
  reader_deinit(&rd);
}

/* An initiator with token `self` (it has sent its HELLO) against an
 * acceptor that proves with `peer`. */
static void run_initiator(const uint8_t *s, size_t len, const struct auth_token *self,
                          const struct auth_token *peer) {
  struct reader rd;
  reader_init(&rd, s, len);
  struct hs in;
  hs_init(&in, AUTH_INITIATOR, self);
  struct auth_session *sess = NULL, *mirror = NULL;
  char err[256];

  Ps__Hello hello = PS__HELLO__INIT;
  hello.rank = 1;
  hello.world_size = 2;
  hello.job_id = "fuzz";
  hello.client = "fuzz_handshake";
  CHECK(hs_initiator_hello(&in, &hello) == 0);
  CHECK(hello.nonce.len == (self ? AUTH_NONCE_BYTES : 0u));
  Ps__Header hh = PS__HEADER__INIT;
  hh.type = PS__MSG_TYPE__MSG_HELLO;
  hh.body_case = PS__HEADER__BODY_HELLO;
  hh.hello = &hello;
  uint8_t sent[FRAME_PREAMBLE_BYTES + HS_MAX_HEADER];
  int n = wire_frame_encode(&hh, 0, sent, sizeof(sent));
  CHECK(n > FRAME_PREAMBLE_BYTES);
  const uint8_t *hello_hdr = sent + FRAME_PREAMBLE_BYTES;
  size_t hello_len = (size_t)n - FRAME_PREAMBLE_BYTES;
  hs_initiator_sent(&in, hello_hdr, hello_len);
  CHECK(in.state == HS_WAIT_PROOF);
  uint8_t th[AUTH_HASH_BYTES];
  auth_transcript(hello_hdr, hello_len, th);

  wire_header *h;
  if (!next_frame(&rd) || !(h = unpack(&rd))) goto out;
  bool is_auth = h->type == PS__MSG_TYPE__MSG_AUTH && h->body_case == PS__HEADER__BODY_AUTH;
  bool nonce_ok = is_auth && h->auth->nonce.len == AUTH_NONCE_BYTES;
  uint8_t nonce[AUTH_NONCE_BYTES] = {0}, want[AUTH_PROOF_BYTES] = {0};
  if (nonce_ok) {
    memcpy(nonce, h->auth->nonce.data, AUTH_NONCE_BYTES);
    uint8_t honest[AUTH_PROOF_BYTES];
    if (peer) {
      auth_proof(peer, AUTH_ACCEPTOR, th, nonce, honest);
      fill_placeholder(&h->auth->proof, honest);
    }
    if (self) auth_proof(self, AUTH_ACCEPTOR, th, nonce, want);
  }
  Ps__Auth out = PS__AUTH__INIT;
  int r = hs_initiator_on_reply(&in, h, &out, err, sizeof(err));
  CHECK(r == 1 || r == 0 || r == -EACCES || r == -EPROTO);
  if (!self) {
    /* without a token: a plain ACK opens the connection, nothing else does */
    CHECK(r != 1);
    CHECK((r == 0) == (h->type == PS__MSG_TYPE__MSG_ACK));
    CHECK(in.state == (r == 0 ? HS_OPEN : HS_FAILED));
    goto out;
  }
  CHECK(r != 0); /* a token never settles for HS_OPEN */
  CHECK((r == 1) == (nonce_ok && proof_is(&h->auth->proof, want)));
  if (h->type == PS__MSG_TYPE__MSG_ERROR) CHECK(r == -EACCES);
  if (r < 0) {
    CHECK(in.state == HS_FAILED);
    goto out;
  }
  CHECK(in.state == HS_WAIT_ACK && self == peer);
  /* its own proof, over the same transcript and nonce */
  auth_proof(self, AUTH_INITIATOR, th, nonce, want);
  CHECK(out.nonce.len == 0 && proof_is(&out.proof, want));
  sess = hs_take_session(&in);
  CHECK(sess != NULL);
  CHECK(auth_session_new(peer, AUTH_ACCEPTOR, th, nonce, &mirror) == 0);

  /* the ACK: the first tagged frame */
  reader_authenticated(&rd);
  if (!next_frame(&rd) || !check_tag(&rd, sess, mirror)) goto out;
  if (!(h = unpack(&rd))) goto out;
  r = hs_initiator_on_ack(&in, h, err, sizeof(err));
  CHECK((r == 0) == (h->type == PS__MSG_TYPE__MSG_ACK));
  CHECK(in.state == (r == 0 ? HS_DONE : HS_FAILED));
  if (r < 0) goto out;
  tagged_frames(&rd, sess, mirror);
out:
  auth_session_free(mirror);
  auth_session_free(sess);
  hs_deinit(&in);
  reader_deinit(&rd);
}

/* An acceptor without a token: a HELLO opens the connection; nothing makes
 * it authenticate afterwards. */
static void run_open_acceptor(const uint8_t *s, size_t len) {
  struct reader rd;
  reader_init(&rd, s, len);
  struct hs a;
  hs_init(&a, AUTH_ACCEPTOR, NULL);
  char err[256];
  wire_header *h;
  if (next_frame(&rd) && (h = unpack(&rd))) {
    Ps__Auth out = PS__AUTH__INIT;
    int r = hs_acceptor_on_hello(&a, hdr_bytes(&rd), hdr_len(&rd), h, &out, err, sizeof(err));
    bool hello = h->type == PS__MSG_TYPE__MSG_HELLO && h->body_case == PS__HEADER__BODY_HELLO;
    CHECK(r == (hello ? 0 : -EPROTO));
    CHECK(a.state == (hello ? HS_OPEN : HS_FAILED));
    CHECK(out.proof.len == 0 && out.nonce.len == 0);
    if (r == 0 && next_frame(&rd) && (h = unpack(&rd))) {
      CHECK(hs_acceptor_on_auth(&a, h, err, sizeof(err)) < 0);
      CHECK(a.state == HS_FAILED);
    }
  }
  CHECK(hs_take_session(&a) == NULL);
  hs_deinit(&a);
  reader_deinit(&rd);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct auth_token *tok = NULL, *other = NULL;
  if (auth_token_from_bytes(FUZZ_TOKEN, strlen(FUZZ_TOKEN), &tok) < 0 ||
      auth_token_from_bytes(FUZZ_OTHER_TOKEN, strlen(FUZZ_OTHER_TOKEN), &other) < 0)
    abort();
  run_acceptor(data, size, tok, tok);
  run_acceptor(data, size, tok, other);
  run_initiator(data, size, tok, tok);
  run_initiator(data, size, tok, other);
  run_initiator(data, size, NULL, tok);
  run_open_acceptor(data, size);
  auth_token_free(tok);
  auth_token_free(other);
  return 0;
}
