/* fuzz_frame: the streaming frame decoder (common/frame.c) and the header
 * codec (proto/wire.c) against a byte stream from the fuzzer.
 *
 * Input: byte 0 configures the run, byte 1 = n, then the stream, then n
 * bytes of chunk sizes (used in turn, cycling; 0 = everything left). So the
 * fuzzer chooses both the bytes and where the stream is split. Config bits:
 *   0-1  header limit: 1024, 65535, 24, or 0 (the decoder's default, 65535)
 *   2-3  payload limit: 0, 64, 4096, 1 MiB
 *   4    payload through frame_decoder_payload_window/advance (the socket path)
 *   5    every other frame's payload is discarded (destination NULL)
 *   6    limits raised to 65535 / 1 MiB after the first frame (as after auth)
 *   7    a 512-byte decode budget for headers (the -ENOMEM path)
 * The whole stream is decoded twice: without a tag and with a 16-byte tag.
 *
 * Oracle: a reference parser written here from the format in frame.h says
 * where each frame's header, payload and tag lie, or which error its
 * preamble has. The decoder must agree on every event and byte position,
 * never consume more than it is given, deliver exactly the header, payload
 * and tag bytes of the stream, and never write past a payload buffer of
 * payload_len bytes (guard bytes after it, besides ASan). Every complete
 * header is decoded; one that decodes must re-encode (wire_frame_encode) to
 * a valid frame which, if it decodes again (see check_header), re-encodes to
 * the same bytes. Any disagreement is an abort(). */
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "frame.h"
#include "wire.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

#define GUARD_BYTES 16
#define GUARD 0xa5
#define TAG_BYTES 16

#define CHECK(c)                                                                 \
  do {                                                                           \
    if (!(c)) {                                                                  \
      fprintf(stderr, "fuzz_frame: %s:%d: CHECK(%s)\n", __FILE__, __LINE__, #c); \
      abort();                                                                   \
    }                                                                            \
  } while (0)

struct input {
  uint8_t cfg;
  const uint8_t *s; /* the stream */
  size_t len;
  const uint8_t *sizes; /* chunk sizes */
  size_t nsizes;
};

/* What the stream holds from `off` on, by the format alone. */
enum ref_kind { REF_SHORT_PREAMBLE, REF_ERROR, REF_SHORT_HEADER, REF_HEADER };
struct ref {
  enum ref_kind kind;
  int err;
  uint16_t header_len;
  uint64_t payload_len;
  size_t header_off; /* off + 16 */
  size_t payload_off;
  uint64_t end; /* of payload and tag: may lie beyond the stream */
};

static uint64_t le(const uint8_t *p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
  return v;
}

static void ref_parse(const uint8_t *s, size_t len, size_t off, const struct frame_limits *lim,
                      uint32_t tag_len, struct ref *r) {
  memset(r, 0, sizeof(*r));
  if (len - off < FRAME_PREAMBLE_BYTES) {
    r->kind = REF_SHORT_PREAMBLE;
    return;
  }
  const uint8_t *p = s + off;
  uint32_t max_header = lim->max_header;
  if (max_header == 0 || max_header > FRAME_MAX_HEADER) max_header = FRAME_MAX_HEADER;
  r->header_len = (uint16_t)le(p + 6, 2);
  r->payload_len = le(p + 8, 8);
  r->kind = REF_ERROR;
  if (memcmp(p, "PS01", 4) != 0)
    r->err = FRAME_EMAGIC;
  else if (le(p + 4, 2) != FRAME_VERSION)
    r->err = FRAME_EVERSION;
  else if (r->header_len == 0 || r->header_len > max_header)
    r->err = FRAME_EHEADER;
  else if (r->payload_len > lim->max_payload)
    r->err = FRAME_EPAYLOAD;
  else
    r->kind = REF_HEADER;
  if (r->kind == REF_ERROR) return;
  r->header_off = off + FRAME_PREAMBLE_BYTES;
  if (len - r->header_off < r->header_len) {
    r->kind = REF_SHORT_HEADER;
    return;
  }
  r->payload_off = r->header_off + r->header_len;
  r->end = r->payload_off + r->payload_len + tag_len;
}

/* A decoded header must survive a round trip through wire_frame_encode. */
static void check_header(const uint8_t *hdr, size_t len, uint64_t payload_len, size_t budget) {
  struct wire_arena a1, a2;
  if (wire_arena_init(&a1, budget) < 0) abort();
  if (wire_arena_init(&a2, WIRE_DEFAULT_BUDGET) < 0) abort();
  wire_header *h = NULL;
  int r = wire_header_unpack(&a1, hdr, len, &h);
  CHECK(r == 0 || r == -EBADMSG || r == -ENOMEM); /* ENOMEM: the budget, even the default */
  if (r == 0) {
    CHECK(wire_type_name(h->type) != NULL);
    size_t cap = FRAME_PREAMBLE_BYTES + FRAME_MAX_HEADER;
    uint8_t *f1 = malloc(cap), *f2 = malloc(cap);
    if (!f1 || !f2) abort();
    int n1 = wire_frame_encode(h, payload_len, f1, cap);
    CHECK(n1 > 0 || n1 == -EMSGSIZE);
    if (n1 > 0) {
      struct frame_limits all = {FRAME_MAX_HEADER, UINT64_MAX};
      struct frame_preamble pre;
      CHECK(frame_preamble_decode(f1, &all, &pre) == 0);
      CHECK(pre.payload_len == payload_len && pre.header_len == (size_t)n1 - FRAME_PREAMBLE_BYTES);
      /* protobuf-c 1.4 reads field number 0 when its tag is an overlong
       * varint (0x82 0x00), keeps it as an unknown field, writes it back as
       * 0x02 and then refuses that: so the second decode may fail, harmlessly
       * (unknown fields are ignored). What decodes must encode the same. */
      wire_header *h2 = NULL;
      r = wire_header_unpack(&a2, f1 + FRAME_PREAMBLE_BYTES, pre.header_len, &h2);
      CHECK(r == 0 || r == -EBADMSG || r == -ENOMEM);
      if (r == 0) {
        CHECK(h2->type == h->type && h2->request_id == h->request_id && h2->key == h->key &&
              h2->body_case == h->body_case);
        int n2 = wire_frame_encode(h2, payload_len, f2, cap);
        CHECK(n2 == n1 && memcmp(f1, f2, (size_t)n1) == 0);
      }
    }
    free(f1);
    free(f2);
  }
  wire_arena_deinit(&a1);
  wire_arena_deinit(&a2);
}

struct run {
  const struct input *in;
  uint32_t tag_len;
  struct frame_decoder d;
  struct frame_limits lim;
  size_t budget;
  size_t pos;   /* bytes of the stream consumed */
  size_t start; /* where the current frame starts */
  struct ref ref;
  uint8_t *payload; /* payload_len + GUARD_BYTES, or NULL (discarded) */
  uint64_t frames;
};

static void frame_begin(struct run *r) {
  r->start = r->pos;
  ref_parse(r->in->s, r->in->len, r->start, &r->lim, r->tag_len, &r->ref);
}

/* FRAME_HEADER: the header is exactly the stream's bytes; names the payload's
 * destination and returns what frame_decoder_set_payload said. */
static int on_header(struct run *r) {
  const struct ref *f = &r->ref;
  CHECK(f->kind == REF_HEADER);
  CHECK(r->pos == f->payload_off);
  CHECK(frame_decoder_header_len(&r->d) == f->header_len);
  CHECK(frame_decoder_payload_len(&r->d) == f->payload_len);
  CHECK(memcmp(frame_decoder_header(&r->d), r->in->s + f->header_off, f->header_len) == 0);
  CHECK(memcmp(frame_decoder_preamble(&r->d), r->in->s + r->start, FRAME_PREAMBLE_BYTES) == 0);
  check_header(frame_decoder_header(&r->d), f->header_len, f->payload_len, r->budget);
  bool discard = (r->in->cfg & 0x20) && (r->frames & 1);
  r->payload = NULL;
  if (!discard) {
    /* the payload limit keeps this small (<= 1 MiB) */
    r->payload = malloc((size_t)f->payload_len + GUARD_BYTES);
    if (!r->payload) abort();
    memset(r->payload + f->payload_len, GUARD, GUARD_BYTES);
  }
  uint8_t *win = NULL;
  CHECK(frame_decoder_payload_window(&r->d, &win) == 0); /* no destination yet */
  int ev = frame_decoder_set_payload(&r->d, r->payload);
  CHECK(ev == ((f->payload_len == 0 && r->tag_len == 0) ? FRAME_DONE : FRAME_NEED_MORE));
  CHECK(frame_decoder_set_payload(&r->d, r->payload) == FRAME_ESTATE); /* only once */
  return ev;
}

static void frame_end(struct run *r) {
  const struct ref *f = &r->ref;
  CHECK(f->kind == REF_HEADER && r->pos == f->end);
  if (r->payload) {
    CHECK(memcmp(r->payload, r->in->s + f->payload_off, (size_t)f->payload_len) == 0);
    for (size_t i = 0; i < GUARD_BYTES; i++) CHECK(r->payload[f->payload_len + i] == GUARD);
  }
  if (r->tag_len)
    CHECK(memcmp(frame_decoder_tag(&r->d), r->in->s + f->end - r->tag_len, r->tag_len) == 0);
  free(r->payload);
  r->payload = NULL;
  r->frames++;
  frame_decoder_reset(&r->d);
  CHECK(frame_decoder_idle(&r->d));
  if ((r->in->cfg & 0x40) && r->frames == 1) {
    struct frame_limits big = {FRAME_MAX_HEADER, 1u << 20};
    CHECK(frame_decoder_set_limits(&r->d, &big) == 0);
    r->lim = big;
  }
  frame_begin(r);
}

/* Decodes the whole stream once. */
static void decode(const struct input *in, uint32_t tag_len) {
  static const uint32_t max_header[4] = {1024, FRAME_MAX_HEADER, 24, 0};
  static const uint64_t max_payload[4] = {0, 64, 4096, 1u << 20};
  struct run r = {.in = in, .tag_len = tag_len};
  r.lim.max_header = max_header[in->cfg & 3];
  r.lim.max_payload = max_payload[(in->cfg >> 2) & 3];
  r.budget = (in->cfg & 0x80) ? 512 : WIRE_DEFAULT_BUDGET;
  if (frame_decoder_init(&r.d, &r.lim) < 0) abort();
  frame_decoder_set_tag_len(&r.d, tag_len);
  CHECK(frame_decoder_idle(&r.d));
  frame_begin(&r);
  bool failed = false;
  size_t k = 0;
  while (r.pos < in->len && !failed) {
    size_t left = in->len - r.pos, chunk = left;
    if (in->nsizes) {
      size_t c = in->sizes[k++ % in->nsizes];
      if (c && c < left) chunk = c;
    }
    size_t end = r.pos + chunk;
    while (r.pos < end && !failed) {
      size_t given = end - r.pos, used = 0;
      uint8_t *win = NULL;
      size_t w = (in->cfg & 0x10) ? frame_decoder_payload_window(&r.d, &win) : 0;
      int ev;
      if (w > 0) {
        /* the socket path: the caller writes into the payload itself */
        CHECK(r.payload && win >= r.payload && w <= r.ref.payload_len &&
              (size_t)(win - r.payload) + w == r.ref.payload_len);
        used = w < given ? w : given;
        memcpy(win, in->s + r.pos, used);
        CHECK(frame_decoder_advance(&r.d, w + 1) == FRAME_ESTATE); /* past the end */
        ev = frame_decoder_advance(&r.d, used);
      } else {
        ev = frame_decoder_feed(&r.d, in->s + r.pos, given, &used);
      }
      CHECK(used <= given);
      r.pos += used;
      switch (ev) {
        case FRAME_NEED_MORE:
          CHECK(w > 0 || used == given);
          break;
        case FRAME_HEADER:
          if (on_header(&r) == FRAME_DONE) frame_end(&r);
          break;
        case FRAME_DONE:
          frame_end(&r);
          break;
        default:
          CHECK(ev < 0 && frame_strerror(ev) != NULL);
          CHECK(r.ref.kind == REF_ERROR && ev == r.ref.err);
          CHECK(r.pos == r.start + FRAME_PREAMBLE_BYTES);
          failed = true;
          break;
      }
    }
  }
  if (!failed) {
    /* input exhausted in the middle of a frame, or between frames */
    CHECK(r.pos == in->len);
    if (r.pos == r.start) {
      CHECK(frame_decoder_idle(&r.d));
    } else {
      CHECK(!frame_decoder_idle(&r.d));
      CHECK(r.ref.kind == REF_SHORT_PREAMBLE || r.ref.kind == REF_SHORT_HEADER ||
            (r.ref.kind == REF_HEADER && r.ref.end > in->len));
    }
    uint8_t probe = 0;
    size_t used = 1;
    CHECK(frame_decoder_feed(&r.d, &probe, 0, &used) == FRAME_NEED_MORE && used == 0);
  }
  free(r.payload);
  frame_decoder_deinit(&r.d);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 2) return 0;
  struct input in = {.cfg = data[0]};
  size_t n = data[1];
  if (n > size - 2) n = size - 2;
  in.s = data + 2;
  in.len = size - 2 - n;
  in.sizes = data + size - n;
  in.nsizes = n;
  decode(&in, 0);
  decode(&in, TAG_BYTES);
  return 0;
}
