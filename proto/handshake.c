/* handshake: see handshake.h. Every received field is checked for presence
 * and exact length before use; a failure moves to HS_FAILED for good. */
#include "handshake.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

static int fail(struct hs *s, int err, char *buf, size_t len, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static int fail(struct hs *s, int err, char *buf, size_t len, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  if (buf && len) vsnprintf(buf, len, fmt, ap);
  va_end(ap);
  s->state = HS_FAILED;
  return err;
}

void hs_init(struct hs *s, enum auth_role role, const struct auth_token *token) {
  memset(s, 0, sizeof(*s));
  s->role = role;
  s->token = token;
}

void hs_deinit(struct hs *s) {
  if (!s) return;
  auth_session_free(s->session);
  s->session = NULL;
}

struct auth_session *hs_take_session(struct hs *s) {
  struct auth_session *r = s->session;
  s->session = NULL;
  return r;
}

int hs_initiator_hello(struct hs *s, Ps__Hello *hello) {
  hello->nonce.len = 0;
  hello->nonce.data = NULL;
  if (!s->token) return 0;
  if (auth_random(s->nonce_i, sizeof(s->nonce_i)) < 0) return -EIO;
  hello->nonce.data = s->nonce_i;
  hello->nonce.len = sizeof(s->nonce_i);
  return 0;
}

void hs_initiator_sent(struct hs *s, const uint8_t *hello_hdr, size_t len) {
  auth_transcript(hello_hdr, len, s->th);
  s->state = HS_WAIT_PROOF;
}

int hs_initiator_on_reply(struct hs *s, const wire_header *h, Ps__Auth *auth_out, char *err,
                          size_t errlen) {
  if (s->state != HS_WAIT_PROOF)
    return fail(s, -EPROTO, err, errlen, "handshake reply out of order");
  if (h->type == PS__MSG_TYPE__MSG_ERROR) {
    const char *m = h->body_case == PS__HEADER__BODY_ERROR && h->error->message ? h->error->message
                                                                                : "no reason given";
    return fail(s, -EACCES, err, errlen, "%s", m);
  }
  if (h->type == PS__MSG_TYPE__MSG_ACK) {
    if (s->token)
      return fail(s, -EACCES, err, errlen,
                  "the peer does not authenticate (started without --auth-token-file) while this "
                  "process has a token: refusing to talk to it");
    s->state = HS_OPEN;
    return 0;
  }
  if (h->type != PS__MSG_TYPE__MSG_AUTH || h->body_case != PS__HEADER__BODY_AUTH)
    return fail(s, -EPROTO, err, errlen, "unexpected %s during the handshake",
                wire_type_name(h->type));
  if (!s->token)
    return fail(s, -EACCES, err, errlen,
                "the peer requires authentication: start this process with --auth-token-file "
                "(the job's token)");
  const Ps__Auth *a = h->auth;
  if (a->nonce.len != AUTH_NONCE_BYTES)
    return fail(s, -EPROTO, err, errlen, "peer's nonce is %zu bytes, not %d", a->nonce.len,
                AUTH_NONCE_BYTES);
  memcpy(s->nonce_a, a->nonce.data, AUTH_NONCE_BYTES);
  if (!auth_proof_check(s->token, AUTH_ACCEPTOR, s->th, s->nonce_a, a->proof.data, a->proof.len))
    return fail(s, -EACCES, err, errlen,
                "the peer failed authentication: its --auth-token-file differs from ours");
  if (auth_session_new(s->token, AUTH_INITIATOR, s->th, s->nonce_a, &s->session) < 0)
    return fail(s, -ENOMEM, err, errlen, "out of memory deriving the session keys");
  auth_proof(s->token, AUTH_INITIATOR, s->th, s->nonce_a, s->proof);
  *auth_out = (Ps__Auth)PS__AUTH__INIT;
  auth_out->proof.data = s->proof;
  auth_out->proof.len = sizeof(s->proof);
  s->state = HS_WAIT_ACK;
  return 1;
}

int hs_initiator_on_ack(struct hs *s, const wire_header *h, char *err, size_t errlen) {
  if (s->state != HS_WAIT_ACK) return fail(s, -EPROTO, err, errlen, "handshake ack out of order");
  if (h->type == PS__MSG_TYPE__MSG_ERROR)
    return fail(s, -EACCES, err, errlen, "%s",
                h->body_case == PS__HEADER__BODY_ERROR && h->error->message ? h->error->message
                                                                            : "no reason given");
  if (h->type != PS__MSG_TYPE__MSG_ACK)
    return fail(s, -EPROTO, err, errlen, "expected the handshake ACK, got %s",
                wire_type_name(h->type));
  s->state = HS_DONE;
  return 0;
}

int hs_acceptor_on_hello(struct hs *s, const uint8_t *hello_hdr, size_t len, const wire_header *h,
                         Ps__Auth *auth_out, char *err, size_t errlen) {
  if (s->state != HS_START) return fail(s, -EPROTO, err, errlen, "hello twice on one connection");
  if (h->type != PS__MSG_TYPE__MSG_HELLO || h->body_case != PS__HEADER__BODY_HELLO)
    return fail(s, -EPROTO, err, errlen, "%s before hello", wire_type_name(h->type));
  const Ps__Hello *hello = h->hello;
  if (!s->token) {
    /* An initiator with a token refuses the plain ACK itself (mutual). */
    s->state = HS_OPEN;
    return 0;
  }
  if (hello->nonce.len == 0)
    return fail(s, -EACCES, err, errlen,
                "authentication required: this process was started with --auth-token-file; "
                "start the client with the job's token");
  if (hello->nonce.len != AUTH_NONCE_BYTES)
    return fail(s, -EPROTO, err, errlen, "hello nonce is %zu bytes, not %d", hello->nonce.len,
                AUTH_NONCE_BYTES);
  memcpy(s->nonce_i, hello->nonce.data, AUTH_NONCE_BYTES);
  auth_transcript(hello_hdr, len, s->th);
  if (auth_random(s->nonce_a, sizeof(s->nonce_a)) < 0)
    return fail(s, -EIO, err, errlen, "no randomness for the nonce");
  auth_proof(s->token, AUTH_ACCEPTOR, s->th, s->nonce_a, s->proof);
  *auth_out = (Ps__Auth)PS__AUTH__INIT;
  auth_out->nonce.data = s->nonce_a;
  auth_out->nonce.len = sizeof(s->nonce_a);
  auth_out->proof.data = s->proof;
  auth_out->proof.len = sizeof(s->proof);
  s->state = HS_WAIT_PROOF;
  return 1;
}

int hs_acceptor_on_auth(struct hs *s, const wire_header *h, char *err, size_t errlen) {
  if (s->state != HS_WAIT_PROOF)
    return fail(s, -EPROTO, err, errlen, "%s before hello", wire_type_name(h->type));
  if (h->type != PS__MSG_TYPE__MSG_AUTH || h->body_case != PS__HEADER__BODY_AUTH)
    return fail(s, -EACCES, err, errlen, "%s before authentication completed",
                wire_type_name(h->type));
  const Ps__Auth *a = h->auth;
  if (!auth_proof_check(s->token, AUTH_INITIATOR, s->th, s->nonce_a, a->proof.data, a->proof.len))
    return fail(s, -EACCES, err, errlen, "authentication failed: wrong token");
  if (auth_session_new(s->token, AUTH_ACCEPTOR, s->th, s->nonce_a, &s->session) < 0)
    return fail(s, -ENOMEM, err, errlen, "out of memory deriving the session keys");
  s->state = HS_DONE;
  return 0;
}
