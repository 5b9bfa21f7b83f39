/* handshake: the authentication exchange over wire headers (auth.h), as a
 * pure state machine with no I/O, shared by the shard (acceptor), libps
 * (initiator) and the ring's rendezvous (both), and fuzzed on its own.
 *
 *   initiator: hs_initiator_hello -> send HELLO -> hs_initiator_sent ->
 *              reply: hs_initiator_on_reply (AUTH: send the AUTH it fills in,
 *              then expect ACK + tag; ACK: the acceptor runs without auth)
 *   acceptor:  HELLO -> hs_acceptor_on_hello (AUTH to send, or open) ->
 *              AUTH -> hs_acceptor_on_auth -> reply ACK with a tag
 *
 * With a token, nothing but HELLO and AUTH is accepted before HS_DONE, and a
 * side with a token never talks to a side without one (either way it fails
 * with a message that says which side lacks the token). Without a token on
 * both sides the handshake is HS_OPEN: no tags, anyone can connect. */
#ifndef PS_HANDSHAKE_H
#define PS_HANDSHAKE_H

#include <stddef.h>
#include <stdint.h>

#include "auth.h"
#include "wire.h"

enum hs_state {
  HS_START = 0,
  HS_WAIT_PROOF, /* initiator: HELLO sent, waits for AUTH; acceptor: AUTH sent, waits for AUTH */
  HS_WAIT_ACK,   /* initiator: its proof sent, waits for the tagged ACK */
  HS_DONE,       /* authenticated: every frame from now on carries a tag */
  HS_OPEN,       /* no token on either side: no authentication */
  HS_FAILED,
};

/* Largest header any handshake frame needs (HELLO with a job id, AUTH). The
 * acceptor accepts no larger header and no payload before HS_DONE/HS_OPEN. */
#define HS_MAX_HEADER 1024u

struct hs {
  enum auth_role role;
  const struct auth_token *token; /* NULL = this side has no token */
  enum hs_state state;
  uint8_t th[AUTH_HASH_BYTES];
  uint8_t nonce_i[AUTH_NONCE_BYTES]; /* initiator's, sent in HELLO */
  uint8_t nonce_a[AUTH_NONCE_BYTES]; /* acceptor's, sent in AUTH */
  uint8_t proof[AUTH_PROOF_BYTES];   /* this side's proof, referenced by the AUTH it sends */
  struct auth_session *session;      /* after HS_DONE, until hs_take_session */
};

void hs_init(struct hs *s, enum auth_role role, const struct auth_token *token);
void hs_deinit(struct hs *s); /* frees a session not taken */

/* Initiator: fills hello->nonce (pointing into s) when it has a token. */
int hs_initiator_hello(struct hs *s, Ps__Hello *hello);
/* Initiator: the HELLO header bytes exactly as sent (after the preamble). */
void hs_initiator_sent(struct hs *s, const uint8_t *hello_hdr, size_t len);
/* Initiator: the reply to HELLO. Returns 1 if *auth_out (pointing into s)
 * must be sent as the body of an AUTH frame (then expect a tagged ACK:
 * hs_initiator_on_ack), 0 if the handshake is complete (HS_OPEN), or -EACCES
 * / -EPROTO with the reason in err. An ERROR reply is returned as -EACCES
 * with its message. */
int hs_initiator_on_reply(struct hs *s, const wire_header *h, Ps__Auth *auth_out, char *err,
                          size_t errlen);
/* Initiator: the reply to AUTH (an ACK's tag already checked with the
 * session): ACK completes (HS_DONE); ERROR fails with -EACCES and its
 * message, anything else with -EPROTO. */
int hs_initiator_on_ack(struct hs *s, const wire_header *h, char *err, size_t errlen);

/* Acceptor: a HELLO arrived (hdr = its header bytes as received). Returns 1
 * if *auth_out (pointing into s) must be sent as the body of an AUTH frame, 0
 * if the connection is open without authentication (HS_OPEN), or -EACCES /
 * -EPROTO with the reason in err. */
int hs_acceptor_on_hello(struct hs *s, const uint8_t *hello_hdr, size_t len, const wire_header *h,
                         Ps__Auth *auth_out, char *err, size_t errlen);
/* Acceptor: the initiator's AUTH. Returns 0 (HS_DONE: reply ACK with a tag)
 * or -EACCES / -EPROTO with the reason in err. */
int hs_acceptor_on_auth(struct hs *s, const wire_header *h, char *err, size_t errlen);

/* The session after HS_DONE; the caller owns it from now on. */
struct auth_session *hs_take_session(struct hs *s);

#endif
