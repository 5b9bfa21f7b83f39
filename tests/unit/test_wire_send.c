/* wire_send: frames written by wire_send_frame on one end of a socketpair
 * read back on the other as a decoder would: the preamble and header as
 * encoded (the caller's buffer still holds them), the payload byte for byte,
 * and with a session a tag that the peer's session accepts, in order; the
 * byte count returned; a header larger than the buffer refused before
 * anything is written; a closed peer as a negative errno, without SIGPIPE;
 * a sealed payload large enough to be tagged and written in pieces (not a
 * multiple of the piece) opens with the same tag as sealed whole. */
#include "wire_send.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include "auth.h"
#include "frame.h"
#include "net.h"
#include "wire.h"
#include "check.h"

/* Reads one frame from fd: checks the preamble against what was sent and
 * returns the header length and payload (into payload) read; the tag, if
 * tag_len, into tag. */
static int read_frame(int fd, const uint8_t *sent, size_t sent_len, uint8_t *payload, size_t plen,
                      uint8_t *tag, size_t tag_len, struct frame_preamble *p) {
  uint8_t hdr[FRAME_PREAMBLE_BYTES + 1024];
  struct frame_limits lim = {.max_header = 1024, .max_payload = 1u << 20};
  if (net_read_all(fd, hdr, FRAME_PREAMBLE_BYTES) < 0) return -1;
  if (frame_preamble_decode(hdr, &lim, p) < 0) return -1;
  if (p->header_len > 1024 || net_read_all(fd, hdr + FRAME_PREAMBLE_BYTES, p->header_len) < 0)
    return -1;
  CHECK(
      (size_t)FRAME_PREAMBLE_BYTES + p->header_len == sent_len && memcmp(hdr, sent, sent_len) == 0,
      "the preamble and header on the wire are the ones left in the caller's buffer");
  if (p->payload_len != plen || (plen && net_read_all(fd, payload, plen) < 0)) return -1;
  if (tag_len && net_read_all(fd, tag, tag_len) < 0) return -1;
  return 0;
}

static void test_plain(int a, int b) {
  wire_header h = PS__HEADER__INIT;
  h.type = PS__MSG_TYPE__MSG_PUSH;
  h.request_id = 42;
  h.key = 7;
  uint8_t buf[256], got[1000];
  float payload[250];
  for (int i = 0; i < 250; i++) payload[i] = (float)i * 0.5f;
  int64_t n = wire_send_frame(a, &h, payload, sizeof(payload), NULL, buf, sizeof(buf));
  struct frame_preamble p;
  size_t hlen = (size_t)(n - (int64_t)sizeof(payload));
  CHECK(n > (int64_t)sizeof(payload), "plain frame written: %lld", (long long)n);
  CHECK(read_frame(b, buf, hlen, got, sizeof(payload), NULL, 0, &p) == 0, "plain frame read");
  CHECK(memcmp(got, payload, sizeof(payload)) == 0, "payload byte for byte");
  struct wire_arena arena;
  wire_header *d = NULL;
  CHECK(wire_arena_init(&arena, 1 << 16) == 0, "arena");
  CHECK(wire_header_unpack(&arena, buf + FRAME_PREAMBLE_BYTES, p.header_len, &d) == 0 && d &&
            d->type == PS__MSG_TYPE__MSG_PUSH && d->request_id == 42 && d->key == 7,
        "header decodes to what was sent");
  wire_arena_deinit(&arena);

  /* header only */
  n = wire_send_frame(a, &h, NULL, 0, NULL, buf, sizeof(buf));
  CHECK(n > FRAME_PREAMBLE_BYTES && read_frame(b, buf, (size_t)n, NULL, 0, NULL, 0, &p) == 0 &&
            p.payload_len == 0,
        "header-only frame");
}

static void test_sealed(int a, int b) {
  struct auth_token *t = NULL;
  struct auth_session *tx = NULL, *rx = NULL;
  uint8_t th[AUTH_HASH_BYTES] = {3}, nonce[AUTH_NONCE_BYTES] = {4};
  CHECK(auth_token_from_bytes("0123456789abcdef0123", 20, &t) == 0, "token");
  CHECK(auth_session_new(t, AUTH_INITIATOR, th, nonce, &tx) == 0 &&
            auth_session_new(t, AUTH_ACCEPTOR, th, nonce, &rx) == 0,
        "sessions");
  if (!tx || !rx) goto out;
  wire_header h = PS__HEADER__INIT;
  h.type = PS__MSG_TYPE__MSG_PULL;
  uint8_t buf[256], payload[300], got[300], tag[AUTH_TAG_BYTES];
  memset(payload, 0xab, sizeof(payload));
  for (int frame = 0; frame < 3; frame++) { /* each under the next counter */
    size_t plen = frame == 1 ? 0 : sizeof(payload);
    int64_t n = wire_send_frame(a, &h, plen ? payload : NULL, plen, tx, buf, sizeof(buf));
    size_t hlen = (size_t)n - plen - AUTH_TAG_BYTES;
    struct frame_preamble p;
    CHECK(n > 0 && read_frame(b, buf, hlen, got, plen, tag, AUTH_TAG_BYTES, &p) == 0,
          "sealed frame %d read", frame);
    struct iovec v[2] = {{buf, hlen}, {got, plen}};
    CHECK(auth_open(rx, v, plen ? 2 : 1, tag) == 0, "tag of frame %d accepted by the peer", frame);
  }
  /* a header that does not fit the buffer: refused, nothing written, the
   * session's counter untouched (the next frame still opens) */
  h.body_case = PS__HEADER__BODY_ERROR;
  Ps__Error e = PS__ERROR__INIT;
  char msg[400];
  memset(msg, 'x', sizeof(msg) - 1);
  msg[sizeof(msg) - 1] = 0;
  e.message = msg;
  h.error = &e;
  CHECK(wire_send_frame(a, &h, NULL, 0, tx, buf, 64) == -EMSGSIZE, "oversized header refused");
  h.body_case = PS__HEADER__BODY__NOT_SET;
  h.error = NULL;
  int64_t n = wire_send_frame(a, &h, NULL, 0, tx, buf, sizeof(buf));
  struct frame_preamble p;
  CHECK(n > 0 &&
            read_frame(b, buf, (size_t)n - AUTH_TAG_BYTES, NULL, 0, tag, AUTH_TAG_BYTES, &p) == 0,
        "frame after the refusal read");
  struct iovec v = {buf, (size_t)n - AUTH_TAG_BYTES};
  CHECK(auth_open(rx, &v, 1, tag) == 0, "the refused frame consumed no counter");
out:
  auth_session_free(tx);
  auth_session_free(rx);
  auth_token_free(t);
}

static void test_sealed_pieces(int a, int b) {
  enum { PLEN = 3 * 128 * 1024 + 12 };
  struct auth_token *t = NULL;
  struct auth_session *tx = NULL, *rx = NULL;
  uint8_t th[AUTH_HASH_BYTES] = {5}, nonce[AUTH_NONCE_BYTES] = {6};
  uint8_t *payload = malloc(PLEN), *got = malloc(PLEN), hdr[256], tag[AUTH_TAG_BYTES];
  CHECK(payload && got && auth_token_from_bytes("0123456789abcdef0123", 20, &t) == 0 &&
            auth_session_new(t, AUTH_INITIATOR, th, nonce, &tx) == 0 &&
            auth_session_new(t, AUTH_ACCEPTOR, th, nonce, &rx) == 0,
        "sessions");
  if (!payload || !got || !tx || !rx) goto out;
  for (size_t i = 0; i < PLEN; i++) payload[i] = (uint8_t)(i * 31 + 7);
  wire_header h = PS__HEADER__INIT;
  h.type = PS__MSG_TYPE__MSG_PUSH;
  h.key = 42;
  int hlen = wire_frame_encode(&h, PLEN, hdr, sizeof(hdr));
  pid_t pid = fork(); /* the writer blocks until the reader drains the socket */
  if (pid == 0) {
    uint8_t buf[256];
    int64_t n = wire_send_frame(a, &h, payload, PLEN, tx, buf, sizeof(buf));
    _exit(n == (int64_t)hlen + PLEN + AUTH_TAG_BYTES ? 0 : 1);
  }
  struct frame_preamble p;
  CHECK(hlen > 0 && read_frame(b, hdr, (size_t)hlen, got, PLEN, tag, AUTH_TAG_BYTES, &p) == 0,
        "frame sealed in pieces read");
  CHECK(memcmp(got, payload, PLEN) == 0, "payload sealed in pieces byte for byte");
  struct iovec v[2] = {{hdr, (size_t)hlen}, {got, PLEN}};
  CHECK(auth_open(rx, v, 2, tag) == 0, "the tag of a payload sealed in pieces opens whole");
  int status = 0;
  CHECK(waitpid(pid, &status, 0) == pid && WIFEXITED(status) && WEXITSTATUS(status) == 0,
        "the writer returned the frame's byte count");
out:
  free(payload);
  free(got);
  auth_session_free(tx);
  auth_session_free(rx);
  auth_token_free(t);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) != 0) {
    perror("socketpair");
    return 1;
  }
  test_plain(sv[0], sv[1]);
  test_sealed(sv[0], sv[1]);
  test_sealed_pieces(sv[0], sv[1]);
  close(sv[1]);
  wire_header h = PS__HEADER__INIT;
  h.type = PS__MSG_TYPE__MSG_HEARTBEAT;
  uint8_t buf[64];
  int64_t r = wire_send_frame(sv[0], &h, NULL, 0, NULL, buf, sizeof(buf));
  CHECK(r < 0 && r != -EMSGSIZE, "a closed peer is an errno, not SIGPIPE: %lld", (long long)r);
  close(sv[0]);
  if (failures) fprintf(stderr, "test_wire_send: %d check(s) failed\n", failures);
  return failures ? 1 : 0;
}
