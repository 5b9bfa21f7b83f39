/* auth: token files, proofs (both roles, wrong token, reflection), session
 * tags (round trip, replay, reorder, bit flips, wrong direction) and the
 * frame decoder collecting a tag after the payload. */
#include "auth.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "frame.h"
#include "handshake.h"
#include "wire.h"
#include "check.h"

static int write_file(const char *path, const char *data, size_t n, int mode) {
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  fwrite(data, 1, n, f);
  fclose(f);
  return chmod(path, (mode_t)mode);
}

static void test_token_files(void) {
  char dir[] = "/tmp/ps-test-auth-XXXXXX";
  if (!mkdtemp(dir)) {
    perror("mkdtemp");
    failures++;
    return;
  }
  char path[256], err[512], warn[512];
  struct auth_token *t = NULL;
  snprintf(path, sizeof(path), "%s/token", dir);

  int r = auth_token_load(path, &t, err, sizeof(err), warn, sizeof(warn));
  CHECK(r == -ENOENT && strstr(err, path), "missing file: r=%d err=%s", r, err);

  write_file(path, "short\n", 6, 0600);
  r = auth_token_load(path, &t, err, sizeof(err), warn, sizeof(warn));
  CHECK(r == -EINVAL && strstr(err, "5 bytes") && strstr(err, "at least 16"), "short: %s", err);

  write_file(path, "0123456789abcdef0123\n", 21, 0644);
  r = auth_token_load(path, &t, err, sizeof(err), warn, sizeof(warn));
  CHECK(r == 0 && t, "good token: %s", err);
  CHECK(strstr(warn, "readable by every user") != NULL, "0644 warns: '%s'", warn);
  auth_token_free(t);
  t = NULL;

  write_file(path, "0123456789abcdef0123", 20, 0440); /* a Kubernetes Secret with fsGroup */
  r = auth_token_load(path, &t, err, sizeof(err), warn, sizeof(warn));
  CHECK(r == 0 && warn[0] == 0, "0440 no warning: r=%d warn='%s'", r, warn);
  /* the trailing newline is not part of the token: both files give the same proofs */
  struct auth_token *t2 = NULL;
  write_file(path, "0123456789abcdef0123\r\n", 22, 0600);
  r = auth_token_load(path, &t2, err, sizeof(err), warn, sizeof(warn));
  uint8_t th[AUTH_HASH_BYTES] = {1}, nonce[AUTH_NONCE_BYTES] = {2}, p1[32], p2[32];
  auth_proof(t, AUTH_INITIATOR, th, nonce, p1);
  if (r == 0) auth_proof(t2, AUTH_INITIATOR, th, nonce, p2);
  CHECK(r == 0 && memcmp(p1, p2, 32) == 0, "CRLF stripped");
  auth_token_free(t);
  auth_token_free(t2);

  char *big = malloc(AUTH_TOKEN_MAX_BYTES + 10);
  memset(big, 'x', AUTH_TOKEN_MAX_BYTES + 10);
  write_file(path, big, AUTH_TOKEN_MAX_BYTES + 10, 0600);
  free(big);
  r = auth_token_load(path, &t, err, sizeof(err), warn, sizeof(warn));
  CHECK(r == -EINVAL && strstr(err, "larger than"), "too large: %s", err);

  r = auth_token_load(dir, &t, err, sizeof(err), warn, sizeof(warn));
  CHECK(r < 0 && strstr(err, "not a regular file"), "directory: %s", err);

  /* the option form: "" is no token, a bad file is an error (printed) */
  t = (struct auth_token *)&r; /* must be overwritten */
  CHECK(auth_token_option("test", "", &t) == 0 && t == NULL, "empty path: no token");
  CHECK(auth_token_option("test", dir, &t) < 0 && t == NULL, "bad file refused");
  write_file(path, "0123456789abcdef0123", 20, 0600);
  CHECK(auth_token_option("test", path, &t) == 0 && t != NULL, "good file loaded");
  auth_token_free(t);
  unlink(path);
  rmdir(dir);
}

static void test_proofs(void) {
  struct auth_token *a = NULL, *b = NULL;
  auth_token_from_bytes("the-shared-token-of-the-job", 27, &a);
  struct auth_token *shorty = NULL;
  CHECK(auth_token_from_bytes("too-short", 9, &shorty) == -EINVAL && !shorty,
        "short token from bytes");
  auth_token_from_bytes("the-shared-token-of-the-jox", 27, &b);
  uint8_t hello[40], th[AUTH_HASH_BYTES], na[AUTH_NONCE_BYTES], na2[AUTH_NONCE_BYTES];
  CHECK(auth_random(hello, sizeof(hello)) == 0, "random");
  auth_random(na, sizeof(na));
  auth_random(na2, sizeof(na2));
  CHECK(memcmp(na, na2, sizeof(na)) != 0, "two nonces differ");
  auth_transcript(hello, sizeof(hello), th);

  uint8_t pa[AUTH_PROOF_BYTES], pi[AUTH_PROOF_BYTES];
  auth_proof(a, AUTH_ACCEPTOR, th, na, pa);
  auth_proof(a, AUTH_INITIATOR, th, na, pi);
  CHECK(auth_proof_check(a, AUTH_ACCEPTOR, th, na, pa, sizeof(pa)), "acceptor proof verifies");
  CHECK(auth_proof_check(a, AUTH_INITIATOR, th, na, pi, sizeof(pi)), "initiator proof verifies");
  CHECK(!auth_proof_check(a, AUTH_INITIATOR, th, na, pa, sizeof(pa)), "reflected proof fails");
  CHECK(!auth_proof_check(b, AUTH_ACCEPTOR, th, na, pa, sizeof(pa)), "other token fails");
  CHECK(!auth_proof_check(a, AUTH_ACCEPTOR, th, na2, pa, sizeof(pa)), "other nonce fails");
  CHECK(!auth_proof_check(a, AUTH_ACCEPTOR, th, na, pa, sizeof(pa) - 1), "short proof fails");
  CHECK(!auth_proof_check(a, AUTH_ACCEPTOR, th, na, NULL, 0), "empty proof fails");
  hello[3] ^= 1; /* a changed hello (rank, nonce) changes th */
  uint8_t th2[AUTH_HASH_BYTES];
  auth_transcript(hello, sizeof(hello), th2);
  CHECK(!auth_proof_check(a, AUTH_ACCEPTOR, th2, na, pa, sizeof(pa)), "other transcript fails");

  /* sessions: the initiator's seal opens on the acceptor and vice versa */
  struct auth_session *si = NULL, *sa = NULL, *sb = NULL;
  CHECK(auth_session_new(a, AUTH_INITIATOR, th, na, &si) == 0, "session i");
  CHECK(auth_session_new(a, AUTH_ACCEPTOR, th, na, &sa) == 0, "session a");
  CHECK(auth_session_new(b, AUTH_ACCEPTOR, th, na, &sb) == 0, "session b");
  uint8_t f1[100], f2[5000], t1[AUTH_TAG_BYTES], t2[AUTH_TAG_BYTES], t3[AUTH_TAG_BYTES];
  auth_random(f1, sizeof(f1));
  auth_random(f2, sizeof(f2));
  struct iovec v1[2] = {{f1, 40}, {f1 + 40, 60}}, v1w[1] = {{f1, 100}}, v2[1] = {{f2, 5000}};
  auth_seal(si, v1, 2, t1);
  auth_seal(si, v2, 1, t2);
  CHECK(auth_session_sent(si) == 2, "two sealed");
  CHECK(auth_open(sb, v1w, 1, t1) == -EBADMSG, "other token's session rejects");
  CHECK(auth_open(sa, v2, 1, t2) == -EBADMSG, "reordered frame rejected");
  CHECK(auth_open(sa, v1w, 1, t1) == 0, "first frame opens (iov split differently)");
  CHECK(auth_open(sa, v1w, 1, t1) == -EBADMSG, "replayed frame rejected");
  f2[4321] ^= 0x10;
  CHECK(auth_open(sa, v2, 1, t2) == -EBADMSG, "flipped bit rejected");
  f2[4321] ^= 0x10;
  CHECK(auth_open(sa, v2, 1, t2) == 0, "second frame opens");
  CHECK(auth_session_received(sa) == 2, "two opened");
  /* the other direction has its own key: a frame sealed by the acceptor
   * does not open as if it were the initiator's */
  auth_seal(sa, v1w, 1, t3);
  struct auth_session *si2 = NULL;
  auth_session_new(a, AUTH_ACCEPTOR, th, na, &si2); /* wrong role for receiving a2i */
  CHECK(auth_open(si2, v1w, 1, t3) == -EBADMSG, "direction keys differ");
  CHECK(auth_open(si, v1w, 1, t3) == 0, "initiator opens the acceptor's frame");
  /* the streaming form gives the same tags as the one-shot form */
  uint8_t t4[AUTH_TAG_BYTES], t5[AUTH_TAG_BYTES];
  auth_seal(si, v2, 1, t4);
  auth_rx_begin(sa);
  auth_rx_update(sa, f2, 1000);
  auth_rx_update(sa, f2 + 1000, 4000);
  CHECK(auth_rx_finish(sa, t4) == 0, "streamed open of a one-shot seal");
  auth_tx_begin(sa);
  auth_tx_update(sa, f1, 7);
  auth_tx_update(sa, f1 + 7, 93);
  auth_tx_finish(sa, t5);
  CHECK(auth_open(si, v1w, 1, t5) == 0, "one-shot open of a streamed seal");
  auth_rx_begin(sa);
  auth_rx_update(sa, f2, 5000);
  CHECK(auth_rx_finish(sa, t4) == -EBADMSG, "streamed replay rejected");
  auth_session_free(si);
  auth_session_free(si2);
  auth_session_free(sa);
  auth_session_free(sb);
  auth_session_free(NULL);
  auth_token_free(a);
  auth_token_free(b);
  auth_token_free(NULL);
}

/* The decoder collects the tag after the payload, at every split point. */
static void test_decoder_tag(void) {
  uint8_t buf[512], payload[64];
  for (size_t i = 0; i < sizeof(payload); i++) payload[i] = (uint8_t)i;
  Ps__Header h = PS__HEADER__INIT;
  h.type = PS__MSG_TYPE__MSG_PUSH;
  h.key = 5;
  int n = wire_frame_encode(&h, sizeof(payload), buf, sizeof(buf));
  memcpy(buf + n, payload, sizeof(payload));
  size_t len = (size_t)n + sizeof(payload);
  for (int i = 0; i < AUTH_TAG_BYTES; i++) buf[len + (size_t)i] = (uint8_t)(0xa0 + i);
  len += AUTH_TAG_BYTES;
  struct frame_limits lim = {256, 1024};
  for (size_t split = 1; split < len; split++) {
    struct frame_decoder d;
    uint8_t dst[64];
    frame_decoder_init(&d, &lim);
    frame_decoder_set_tag_len(&d, AUTH_TAG_BYTES);
    int done = 0;
    size_t off = 0;
    while (off < len && !done) {
      size_t chunk = off < split ? split - off : len - off, used = 0;
      int r = frame_decoder_feed(&d, buf + off, chunk, &used);
      off += used;
      if (r == FRAME_HEADER) r = frame_decoder_set_payload(&d, dst);
      if (r == FRAME_DONE) done = 1;
      CHECK(r >= 0, "split %zu: error %d", split, r);
      if (r < 0) break;
    }
    CHECK(done && off == len, "split %zu: done=%d off=%zu", split, done, off);
    CHECK(memcmp(frame_decoder_tag(&d), buf + len - AUTH_TAG_BYTES, AUTH_TAG_BYTES) == 0 &&
              memcmp(dst, payload, sizeof(payload)) == 0,
          "split %zu: tag and payload", split);
    frame_decoder_deinit(&d);
  }
  /* a zero-payload frame also waits for its tag */
  struct frame_decoder d;
  frame_decoder_init(&d, &lim);
  frame_decoder_set_tag_len(&d, AUTH_TAG_BYTES);
  n = wire_frame_encode(&h, 0, buf, sizeof(buf));
  size_t used = 0;
  int r = frame_decoder_feed(&d, buf, (size_t)n, &used);
  CHECK(r == FRAME_HEADER, "header");
  CHECK(frame_decoder_set_payload(&d, NULL) == FRAME_NEED_MORE, "waits for the tag");
  r = frame_decoder_feed(&d, buf, AUTH_TAG_BYTES, &used);
  CHECK(r == FRAME_DONE && used == AUTH_TAG_BYTES, "tag completes the frame");
  /* raising the header limit grows the buffer */
  struct frame_limits big = {FRAME_MAX_HEADER, 0};
  CHECK(frame_decoder_set_limits(&d, &big) == 0 && d.header_cap == FRAME_MAX_HEADER, "grow");
  frame_decoder_deinit(&d);
}

/* Runs the handshake between an initiator with token ti and an acceptor
 * with token ta through real encoded frames. Returns the acceptor's result
 * (0 done/open), and the initiator's in *ir; err gets the failing side's reason. */
static int run_handshake(struct auth_token *ti, struct auth_token *ta, int *ir, char *err,
                         size_t errlen, struct hs *out_i, struct hs *out_a) {
  struct hs *i = out_i, *a = out_a;
  hs_init(i, AUTH_INITIATOR, ti);
  hs_init(a, AUTH_ACCEPTOR, ta);
  struct wire_arena arena;
  wire_arena_init(&arena, WIRE_DEFAULT_BUDGET);
  uint8_t buf[2048];
  Ps__Header h = PS__HEADER__INIT;
  Ps__Hello hello = PS__HELLO__INIT;
  hello.rank = 1;
  hello.world_size = 2;
  hs_initiator_hello(i, &hello);
  h.type = PS__MSG_TYPE__MSG_HELLO;
  h.body_case = PS__HEADER__BODY_HELLO;
  h.hello = &hello;
  int n = wire_frame_encode(&h, 0, buf, sizeof(buf));
  hs_initiator_sent(i, buf + FRAME_PREAMBLE_BYTES, (size_t)n - FRAME_PREAMBLE_BYTES);
  wire_header *got = NULL;
  wire_header_unpack(&arena, buf + FRAME_PREAMBLE_BYTES, (size_t)n - FRAME_PREAMBLE_BYTES, &got);
  Ps__Auth auth;
  *ir = 0;
  int ar = hs_acceptor_on_hello(a, buf + FRAME_PREAMBLE_BYTES, (size_t)n - FRAME_PREAMBLE_BYTES,
                                got, &auth, err, errlen);
  Ps__Header rep = PS__HEADER__INIT;
  if (ar < 0) {
    wire_arena_deinit(&arena);
    return ar;
  }
  rep.type = ar == 1 ? PS__MSG_TYPE__MSG_AUTH : PS__MSG_TYPE__MSG_ACK;
  if (ar == 1) {
    rep.body_case = PS__HEADER__BODY_AUTH;
    rep.auth = &auth;
  }
  n = wire_frame_encode(&rep, 0, buf, sizeof(buf));
  wire_header_unpack(&arena, buf + FRAME_PREAMBLE_BYTES, (size_t)n - FRAME_PREAMBLE_BYTES, &got);
  Ps__Auth iauth;
  *ir = hs_initiator_on_reply(i, got, &iauth, err, errlen);
  if (*ir == 1) {
    Ps__Header ah = PS__HEADER__INIT;
    ah.type = PS__MSG_TYPE__MSG_AUTH;
    ah.body_case = PS__HEADER__BODY_AUTH;
    ah.auth = &iauth;
    n = wire_frame_encode(&ah, 0, buf, sizeof(buf));
    wire_header_unpack(&arena, buf + FRAME_PREAMBLE_BYTES, (size_t)n - FRAME_PREAMBLE_BYTES, &got);
    ar = hs_acceptor_on_auth(a, got, err, errlen);
    if (ar == 0) {
      Ps__Header ack = PS__HEADER__INIT;
      ack.type = PS__MSG_TYPE__MSG_ACK;
      *ir = hs_initiator_on_ack(i, &ack, err, errlen);
    }
  }
  wire_arena_deinit(&arena);
  return ar;
}

static void test_handshake(void) {
  struct auth_token *a = NULL, *b = NULL;
  auth_token_from_bytes("the-shared-token-of-the-job", 27, &a);
  auth_token_from_bytes("a-different-token-entirely", 26, &b);
  struct hs i, s;
  char err[512] = "";
  int ir;
  int ar = run_handshake(a, a, &ir, err, sizeof(err), &i, &s);
  CHECK(ar == 0 && ir == 0 && i.state == HS_DONE && s.state == HS_DONE, "same token: %s", err);
  struct auth_session *si = hs_take_session(&i), *sa = hs_take_session(&s);
  uint8_t msg[33] = "frame bytes of the first message", tag[AUTH_TAG_BYTES];
  struct iovec v = {msg, sizeof(msg)};
  CHECK(si && sa && auth_seal(si, &v, 1, tag) == 0 && auth_open(sa, &v, 1, tag) == 0,
        "sessions agree");
  auth_session_free(si);
  auth_session_free(sa);
  hs_deinit(&i);
  hs_deinit(&s);

  ar = run_handshake(b, a, &ir, err, sizeof(err), &i, &s);
  CHECK(ir == -EACCES && strstr(err, "differs") && i.state == HS_FAILED,
        "initiator rejects the acceptor's proof under another token: ir=%d %s", ir, err);
  hs_deinit(&i);
  hs_deinit(&s);

  ar = run_handshake(NULL, a, &ir, err, sizeof(err), &i, &s);
  CHECK(ar == -EACCES && strstr(err, "authentication required"), "no token refused: %s", err);
  hs_deinit(&i);
  hs_deinit(&s);

  ar = run_handshake(a, NULL, &ir, err, sizeof(err), &i, &s);
  CHECK(ar == 0 && ir == -EACCES && strstr(err, "does not authenticate"),
        "initiator with a token refuses an open acceptor: %s", err);
  hs_deinit(&i);
  hs_deinit(&s);

  ar = run_handshake(NULL, NULL, &ir, err, sizeof(err), &i, &s);
  CHECK(ar == 0 && ir == 0 && i.state == HS_OPEN && s.state == HS_OPEN, "both open");

  /* an acceptor waiting for a proof refuses any other message */
  hs_init(&s, AUTH_ACCEPTOR, a);
  s.state = HS_WAIT_PROOF;
  Ps__Header push = PS__HEADER__INIT;
  push.type = PS__MSG_TYPE__MSG_PUSH;
  CHECK(hs_acceptor_on_auth(&s, &push, err, sizeof(err)) == -EACCES &&
            strstr(err, "before authentication"),
        "push before auth: %s", err);
  auth_token_free(a);
  auth_token_free(b);
}

int main(void) {
  test_handshake();
  test_token_files();
  test_proofs();
  test_decoder_tag();
  if (failures) {
    fprintf(stderr, "%d check(s) failed\n", failures);
    return 1;
  }
  printf("auth: all checks passed\n");
  return 0;
}
