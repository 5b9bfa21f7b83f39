/* frame: preamble codec and the streaming frame decoder.
 *
 * The decoder is a small state machine: PREAMBLE (16 bytes) -> HEADER
 * (header_len bytes into its own buffer) -> WAIT_DST (the caller decodes the
 * header and names the payload destination) -> PAYLOAD -> DONE. Limits are
 * checked as soon as the preamble is complete, before the header or payload
 * is stored anywhere, so a hostile length never makes us allocate. The only
 * allocation is the header buffer, sized to the header limit (small before a
 * connection is authenticated). With a tag length set, TAG (tag_len bytes)
 * follows PAYLOAD before DONE. */
#include "frame.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static void put_u16(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)v;
  p[1] = (uint8_t)(v >> 8);
}
static void put_u32(uint8_t *p, uint32_t v) {
  for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
  for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint16_t get_u16(const uint8_t *p) {
  return (uint16_t)(p[0] | (p[1] << 8));
}
static uint32_t get_u32(const uint8_t *p) {
  uint32_t v = 0;
  for (int i = 3; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}
static uint64_t get_u64(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

void frame_preamble_encode(uint8_t out[FRAME_PREAMBLE_BYTES], uint16_t header_len,
                           uint64_t payload_len) {
  put_u32(out, FRAME_MAGIC);
  put_u16(out + 4, FRAME_VERSION);
  put_u16(out + 6, header_len);
  put_u64(out + 8, payload_len);
}

int frame_preamble_decode(const uint8_t in[FRAME_PREAMBLE_BYTES], const struct frame_limits *lim,
                          struct frame_preamble *out) {
  out->magic = get_u32(in);
  out->version = get_u16(in + 4);
  out->header_len = get_u16(in + 6);
  out->payload_len = get_u64(in + 8);
  if (out->magic != FRAME_MAGIC) return FRAME_EMAGIC;
  if (out->version != FRAME_VERSION) return FRAME_EVERSION;
  if (out->header_len == 0 || out->header_len > lim->max_header) return FRAME_EHEADER;
  if (out->payload_len > lim->max_payload) return FRAME_EPAYLOAD;
  return 0;
}

const char *frame_strerror(int err) {
  switch (err) {
    case FRAME_EMAGIC:
      return "bad magic (not a ps frame)";
    case FRAME_EVERSION:
      return "unsupported frame version";
    case FRAME_EHEADER:
      return "header length is zero or above the limit";
    case FRAME_EPAYLOAD:
      return "payload length above --max-frame-bytes";
    case FRAME_ESTATE:
      return "frame decoder misuse";
    default:
      return "unknown frame error";
  }
}

int frame_decoder_init(struct frame_decoder *d, const struct frame_limits *lim) {
  memset(d, 0, sizeof(*d));
  d->state = FD_PREAMBLE;
  return frame_decoder_set_limits(d, lim);
}

void frame_decoder_deinit(struct frame_decoder *d) {
  if (!d) return;
  free(d->header);
  d->header = NULL;
  d->header_cap = 0;
}

int frame_decoder_set_limits(struct frame_decoder *d, const struct frame_limits *lim) {
  struct frame_limits l = *lim;
  if (l.max_header > FRAME_MAX_HEADER || l.max_header == 0) l.max_header = FRAME_MAX_HEADER;
  if (l.max_header > d->header_cap) {
    uint8_t *h = realloc(d->header, l.max_header);
    if (!h) return -ENOMEM;
    d->header = h;
    d->header_cap = l.max_header;
  }
  d->lim = l;
  return 0;
}

void frame_decoder_set_tag_len(struct frame_decoder *d, uint32_t n) {
  d->tag_len = n > FRAME_MAX_TAG ? FRAME_MAX_TAG : n;
}

/* The payload is complete: the tag follows, or the frame is done. */
static int payload_complete(struct frame_decoder *d) {
  if (d->tag_len > 0) {
    d->state = FD_TAG;
    d->tag_got = 0;
    return FRAME_NEED_MORE;
  }
  d->state = FD_DONE;
  d->frames++;
  return FRAME_DONE;
}

void frame_decoder_reset(struct frame_decoder *d) {
  d->state = FD_PREAMBLE;
  d->got = 0;
  d->tag_got = 0;
  d->payload = NULL;
  memset(&d->pre, 0, sizeof(d->pre));
}

int frame_decoder_feed(struct frame_decoder *d, const uint8_t *p, size_t n, size_t *consumed) {
  size_t used = 0;
  int ret = FRAME_NEED_MORE;
  while (ret == FRAME_NEED_MORE && used < n) {
    size_t avail = n - used;
    switch (d->state) {
      case FD_PREAMBLE: {
        size_t take = FRAME_PREAMBLE_BYTES - d->got;
        if (take > avail) take = avail;
        memcpy(d->pre_buf + d->got, p + used, take);
        d->got += take;
        used += take;
        if (d->got < FRAME_PREAMBLE_BYTES) break;
        int r = frame_preamble_decode(d->pre_buf, &d->lim, &d->pre);
        if (r < 0) {
          ret = r;
          break;
        }
        d->state = FD_HEADER;
        d->got = 0;
        break;
      }
      case FD_HEADER: {
        size_t take = d->pre.header_len - d->got;
        if (take > avail) take = avail;
        memcpy(d->header + d->got, p + used, take);
        d->got += take;
        used += take;
        if (d->got < d->pre.header_len) break;
        d->state = FD_WAIT_DST;
        d->got = 0;
        ret = FRAME_HEADER;
        break;
      }
      case FD_PAYLOAD: {
        uint64_t left = d->pre.payload_len - d->got;
        size_t take = left < avail ? (size_t)left : avail;
        if (d->payload) memcpy(d->payload + d->got, p + used, take);
        d->got += take;
        used += take;
        if (d->got == d->pre.payload_len) ret = payload_complete(d);
        break;
      }
      case FD_TAG: {
        size_t take = d->tag_len - d->tag_got;
        if (take > avail) take = avail;
        memcpy(d->tag + d->tag_got, p + used, take);
        d->tag_got += (uint32_t)take;
        used += take;
        if (d->tag_got == d->tag_len) {
          d->state = FD_DONE;
          d->frames++;
          ret = FRAME_DONE;
        }
        break;
      }
      case FD_WAIT_DST:
      case FD_DONE:
        ret = FRAME_ESTATE;
        break;
    }
  }
  *consumed = used;
  return ret;
}

int frame_decoder_set_payload(struct frame_decoder *d, void *dst) {
  if (d->state != FD_WAIT_DST) return FRAME_ESTATE;
  d->payload = dst;
  d->got = 0;
  if (d->pre.payload_len == 0) return payload_complete(d);
  d->state = FD_PAYLOAD;
  return FRAME_NEED_MORE;
}

size_t frame_decoder_payload_window(struct frame_decoder *d, uint8_t **dst) {
  if (d->state != FD_PAYLOAD || !d->payload) return 0;
  *dst = d->payload + d->got;
  return (size_t)(d->pre.payload_len - d->got);
}

int frame_decoder_advance(struct frame_decoder *d, size_t n) {
  if (d->state != FD_PAYLOAD || n > d->pre.payload_len - d->got) return FRAME_ESTATE;
  d->got += n;
  if (d->got < d->pre.payload_len) return FRAME_NEED_MORE;
  return payload_complete(d);
}
