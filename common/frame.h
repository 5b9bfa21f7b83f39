/* frame: the wire framing every message uses, and a streaming decoder.
 *
 * A frame is a fixed 16-byte little-endian preamble, a protobuf-encoded Header
 * (proto/ps.proto) of header_len bytes, then payload_len bytes of raw tensor
 * data:
 *
 *   offset 0  u32 magic   0x31305350 ("PS01" on the wire)
 *          4  u16 version FRAME_VERSION
 *          6  u16 header_len   (1..limits.max_header)
 *          8  u64 payload_len  (0..limits.max_payload)
 *
 * The decoder checks every limit on the preamble before anything is allocated
 * and accepts input split at any byte boundary. It owns no payload memory: when
 * a header is complete it stops (FRAME_HEADER) so the caller can decode the
 * header and name where the payload goes (frame_decoder_set_payload), which
 * lets a pull reply land directly in the user's tensor and a push in the
 * shard's scratch buffer. Callers with a socket can read large payload
 * remainders straight into that destination (frame_decoder_payload_window).
 *
 * On an authenticated connection (common/auth.h) every frame is followed by
 * a tag of frame_decoder_set_tag_len() bytes; the decoder collects it after
 * the payload and reports FRAME_DONE only once it is complete. The caller
 * checks it over the preamble (frame_decoder_preamble), the header and the
 * payload before using the frame. */
#ifndef PS_FRAME_H
#define PS_FRAME_H

#include <stddef.h>
#include <stdint.h>

#define FRAME_MAGIC 0x31305350u /* "PS01" little-endian */
#define FRAME_VERSION 1
#define FRAME_PREAMBLE_BYTES 16
#define FRAME_MAX_HEADER 65535u
#define FRAME_MAX_TAG 32u

struct frame_limits {
  uint32_t max_header;  /* <= FRAME_MAX_HEADER */
  uint64_t max_payload; /* --max-frame-bytes */
};

struct frame_preamble {
  uint32_t magic;
  uint16_t version;
  uint16_t header_len;
  uint64_t payload_len;
};

void frame_preamble_encode(uint8_t out[FRAME_PREAMBLE_BYTES], uint16_t header_len,
                           uint64_t payload_len);
/* Decodes and validates; returns 0 or a negative FRAME_E* code. */
int frame_preamble_decode(const uint8_t in[FRAME_PREAMBLE_BYTES], const struct frame_limits *lim,
                          struct frame_preamble *out);

/* Decoder errors (negative); the stream is out of sync after any of them
 * except FRAME_EDISCARD, which is not an error. */
enum {
  FRAME_EMAGIC = -1001,   /* not a ps frame (wrong magic) */
  FRAME_EVERSION = -1002, /* unsupported version */
  FRAME_EHEADER = -1003,  /* header length 0 or above the limit */
  FRAME_EPAYLOAD = -1004, /* payload length above the limit */
  FRAME_ESTATE = -1005,   /* API misuse: set_payload not called after FRAME_HEADER */
};
const char *frame_strerror(int err);

enum frame_event {
  FRAME_NEED_MORE = 0, /* all input consumed, frame not complete */
  FRAME_HEADER = 1,    /* header complete: call frame_decoder_set_payload */
  FRAME_DONE = 2,      /* whole frame complete: use it, then frame_decoder_reset */
};

enum frame_state { FD_PREAMBLE, FD_HEADER, FD_WAIT_DST, FD_PAYLOAD, FD_TAG, FD_DONE };

struct frame_decoder {
  struct frame_limits lim;
  enum frame_state state;
  struct frame_preamble pre;
  uint8_t pre_buf[FRAME_PREAMBLE_BYTES];
  size_t got;      /* bytes of the current stage received */
  uint8_t *header; /* header_cap bytes, owned */
  uint32_t header_cap;
  uint8_t *payload; /* destination set by the caller; NULL = discard */
  uint64_t frames;  /* frames completed (stats) */
  uint32_t tag_len; /* bytes of tag after each frame; 0 = none */
  uint32_t tag_got;
  uint8_t tag[FRAME_MAX_TAG];
};

/* The header buffer is sized to lim->max_header; raising the limit later
 * grows it (frame_decoder_set_limits returns -ENOMEM if it cannot). */
int frame_decoder_init(struct frame_decoder *d, const struct frame_limits *lim);
void frame_decoder_deinit(struct frame_decoder *d);
int frame_decoder_set_limits(struct frame_decoder *d, const struct frame_limits *lim);
/* Every frame from the next one on carries a tag of n <= FRAME_MAX_TAG bytes.
 * Call between frames (after frame_decoder_reset). */
void frame_decoder_set_tag_len(struct frame_decoder *d, uint32_t n);

/* Consumes bytes from p[0..n) until an event; *consumed says how many.
 * Returns enum frame_event or a negative FRAME_E* error. */
int frame_decoder_feed(struct frame_decoder *d, const uint8_t *p, size_t n, size_t *consumed);

/* After FRAME_HEADER: the payload goes to dst (payload_len bytes, may be NULL
 * to discard it). Returns FRAME_DONE if the frame is already complete
 * (payload_len == 0), else FRAME_NEED_MORE. */
int frame_decoder_set_payload(struct frame_decoder *d, void *dst);

/* While in the payload stage with a destination: where the next payload bytes
 * go and how many are still missing (0 otherwise). After writing n bytes
 * there yourself, call frame_decoder_advance(d, n). */
size_t frame_decoder_payload_window(struct frame_decoder *d, uint8_t **dst);
int frame_decoder_advance(struct frame_decoder *d, size_t n);

void frame_decoder_reset(struct frame_decoder *d); /* ready for the next frame */

static inline const uint8_t *frame_decoder_header(const struct frame_decoder *d) {
  return d->header;
}
static inline size_t frame_decoder_header_len(const struct frame_decoder *d) {
  return d->pre.header_len;
}
static inline uint64_t frame_decoder_payload_len(const struct frame_decoder *d) {
  return d->pre.payload_len;
}
static inline const uint8_t *frame_decoder_preamble(const struct frame_decoder *d) {
  return d->pre_buf;
}
static inline const uint8_t *frame_decoder_tag(const struct frame_decoder *d) {
  return d->tag;
}
/* True between frames (nothing of the next one received yet). */
static inline int frame_decoder_idle(const struct frame_decoder *d) {
  return d->state == FD_PREAMBLE && d->got == 0;
}

#endif
