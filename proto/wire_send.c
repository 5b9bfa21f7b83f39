/* wire_send: encode, seal and write one frame (see wire_send.h). The tag is
 * computed over the same bytes that are then written, so what is sealed is
 * exactly what goes out. A large payload on a sealed connection is tagged
 * and written piece by piece: the receiver reads and checks piece i while
 * this side tags piece i+1, and the kernel copies each piece while the tag
 * pass has left it in cache. */
#include "wire_send.h"

#include <errno.h>
#include <sys/uio.h>

#include "net.h"

#define SEAL_PIECE_BYTES (128u * 1024u)

/* Sealed frame with a payload of at least SEAL_PIECE_BYTES. */
static int send_sealed_in_pieces(int fd, uint8_t *hdr, int n, const uint8_t *payload, uint64_t plen,
                                 struct auth_session *s) {
  int r = auth_tx_begin(s);
  if (r == 0) r = auth_tx_update(s, hdr, (size_t)n);
  for (uint64_t off = 0; r == 0 && off < plen; off += SEAL_PIECE_BYTES) {
    size_t len = plen - off < SEAL_PIECE_BYTES ? (size_t)(plen - off) : SEAL_PIECE_BYTES;
    struct iovec iov[2] = {{hdr, (size_t)n}, {(void *)(payload + off), len}};
    if (auth_tx_update(s, payload + off, len) < 0) return -EIO;
    r = off ? net_writev_all(fd, iov + 1, 1) : net_writev_all(fd, iov, 2);
  }
  uint8_t tag[AUTH_TAG_BYTES];
  if (r == 0 && auth_tx_finish(s, tag) < 0) r = -EIO;
  if (r == 0) r = net_write_all(fd, tag, sizeof(tag));
  return r;
}

int64_t wire_send_frame(int fd, const wire_header *h, const void *payload, uint64_t plen,
                        struct auth_session *s, uint8_t *hdr_buf, size_t hdr_cap) {
  int n = wire_frame_encode(h, plen, hdr_buf, hdr_cap);
  if (n < 0) return n;
  int r;
  if (s && plen >= SEAL_PIECE_BYTES) {
    r = send_sealed_in_pieces(fd, hdr_buf, n, payload, plen, s);
  } else {
    uint8_t tag[AUTH_TAG_BYTES];
    struct iovec iov[3] = {{hdr_buf, (size_t)n}, {(void *)payload, (size_t)plen}, {tag, 0}};
    int cnt = plen ? 2 : 1;
    if (s) {
      r = auth_seal(s, iov, cnt, tag);
      if (r < 0) return r;
      iov[cnt++] = (struct iovec){tag, AUTH_TAG_BYTES};
    }
    r = net_writev_all(fd, iov, cnt);
  }
  if (r < 0) return r;
  return (int64_t)n + (int64_t)plen + (s ? AUTH_TAG_BYTES : 0);
}
