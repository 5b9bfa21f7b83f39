/* auth: token, proofs and per-frame tags through OpenSSL's libcrypto (see
 * auth.h for the protocol).
 *
 * The only file that includes OpenSSL headers. Key material lives in
 * heap blocks that are wiped with OPENSSL_cleanse before they are freed and
 * locked (mlock) so they are not swapped out where the system allows it. One
 * EVP_CIPHER_CTX per direction is keyed once; each frame only sets its nonce. */
#include "auth.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "log.h"

struct auth_token {
  size_t len;
  uint8_t key[AUTH_TOKEN_MAX_BYTES];
};

struct auth_dir {
  EVP_CIPHER_CTX *ctx;
  uint64_t seq;
};

struct auth_session {
  struct auth_dir tx, rx;
};

static const char LABEL_ACCEPTOR[] = "ps-auth-v1 acceptor";
static const char LABEL_INITIATOR[] = "ps-auth-v1 initiator";
static const char LABEL_SESSION[] = "ps-auth-v1 session";

int auth_token_from_bytes(const void *buf, size_t len, struct auth_token **out) {
  *out = NULL;
  if (len < AUTH_TOKEN_MIN_BYTES || len > AUTH_TOKEN_MAX_BYTES) return -EINVAL;
  struct auth_token *t = calloc(1, sizeof(*t));
  if (!t) return -ENOMEM;
  (void)mlock(t, sizeof(*t)); /* best effort: RLIMIT_MEMLOCK may refuse */
  memcpy(t->key, buf, len);
  t->len = len;
  *out = t;
  return 0;
}

void auth_token_free(struct auth_token *t) {
  if (!t) return;
  OPENSSL_cleanse(t, sizeof(*t));
  munlock(t, sizeof(*t));
  free(t);
}

int auth_token_load(const char *path, struct auth_token **out, char *err, size_t errlen, char *warn,
                    size_t warnlen) {
  *out = NULL;
  if (warn && warnlen) warn[0] = 0;
  int fd = open(path, O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int e = errno;
    snprintf(err, errlen, "cannot open auth token file %s: %s", path, strerror(e));
    return -e;
  }
  struct stat st;
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    snprintf(err, errlen, "auth token file %s is not a regular file", path);
    close(fd);
    return -EINVAL;
  }
  /* group-readable is how Kubernetes hands a Secret to a non-root user
   * (defaultMode 0440 with fsGroup); readable by everyone is a mistake */
  if ((st.st_mode & 007) && warn)
    snprintf(warn, warnlen, "auth token file %s is readable by every user (mode %03o)", path,
             (unsigned)(st.st_mode & 0777));
  uint8_t buf[AUTH_TOKEN_MAX_BYTES + 3];
  size_t n = 0;
  for (;;) {
    ssize_t r = read(fd, buf + n, sizeof(buf) - n);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      int e = errno;
      snprintf(err, errlen, "cannot read auth token file %s: %s", path, strerror(e));
      close(fd);
      OPENSSL_cleanse(buf, sizeof(buf));
      return -e;
    }
    if (r == 0 || (n += (size_t)r) == sizeof(buf)) break;
  }
  close(fd);
  if (n > 0 && buf[n - 1] == '\n') n--;
  if (n > 0 && buf[n - 1] == '\r') n--;
  int ret = 0;
  if (n > AUTH_TOKEN_MAX_BYTES) {
    snprintf(err, errlen, "auth token file %s is larger than %d bytes", path, AUTH_TOKEN_MAX_BYTES);
    ret = -EINVAL;
  } else if (n < AUTH_TOKEN_MIN_BYTES) {
    snprintf(err, errlen,
             "auth token in %s is %zu bytes, need at least %d (e.g. head -c 32 /dev/urandom | "
             "base64 > %s)",
             path, n, AUTH_TOKEN_MIN_BYTES, path);
    ret = -EINVAL;
  } else {
    ret = auth_token_from_bytes(buf, n, out);
    if (ret < 0) snprintf(err, errlen, "out of memory reading %s", path);
  }
  OPENSSL_cleanse(buf, sizeof(buf));
  return ret;
}

int auth_token_option(const char *prog, const char *path, struct auth_token **out) {
  *out = NULL;
  if (!path || !path[0]) return 0;
  char err[600], warn[300];
  int r = auth_token_load(path, out, err, sizeof(err), warn, sizeof(warn));
  if (r < 0) {
    fprintf(stderr, "%s: option --auth-token-file: %s\n", prog, err);
    return r;
  }
  if (warn[0]) log_warn("auth token file permissions", "detail=\"%s\"", warn);
  return 0;
}

int auth_random(void *buf, size_t n) {
  return RAND_bytes(buf, (int)n) == 1 ? 0 : -EIO;
}

void auth_transcript(const void *hello, size_t len, uint8_t th[AUTH_HASH_BYTES]) {
  unsigned int outl = 0;
  if (EVP_Digest(hello, len, th, &outl, EVP_sha256(), NULL) != 1) memset(th, 0, AUTH_HASH_BYTES);
}

/* HMAC-SHA256(key, label || a || b); the label's terminating NUL is
 * included so no label is a prefix of another's input. */
static void hmac3(const uint8_t *key, size_t keylen, const char *label, const uint8_t *a,
                  size_t alen, const uint8_t *b, size_t blen, uint8_t out[AUTH_PROOF_BYTES]) {
  uint8_t msg[64 + 2 * AUTH_HASH_BYTES];
  size_t ll = strlen(label) + 1, n = 0;
  memcpy(msg, label, ll);
  n += ll;
  if (alen) memcpy(msg + n, a, alen);
  n += alen;
  if (blen) memcpy(msg + n, b, blen);
  n += blen;
  unsigned int outl = AUTH_PROOF_BYTES;
  if (!HMAC(EVP_sha256(), key, (int)keylen, msg, n, out, &outl)) memset(out, 0, AUTH_PROOF_BYTES);
  OPENSSL_cleanse(msg, sizeof(msg));
}

void auth_proof(const struct auth_token *t, enum auth_role role, const uint8_t th[AUTH_HASH_BYTES],
                const uint8_t nonce[AUTH_NONCE_BYTES], uint8_t out[AUTH_PROOF_BYTES]) {
  hmac3(t->key, t->len, role == AUTH_ACCEPTOR ? LABEL_ACCEPTOR : LABEL_INITIATOR, th,
        AUTH_HASH_BYTES, nonce, AUTH_NONCE_BYTES, out);
}

bool auth_proof_check(const struct auth_token *t, enum auth_role role,
                      const uint8_t th[AUTH_HASH_BYTES], const uint8_t nonce[AUTH_NONCE_BYTES],
                      const uint8_t *proof, size_t len) {
  uint8_t want[AUTH_PROOF_BYTES];
  auth_proof(t, role, th, nonce, want);
  bool ok = len == AUTH_PROOF_BYTES && proof && CRYPTO_memcmp(want, proof, AUTH_PROOF_BYTES) == 0;
  OPENSSL_cleanse(want, sizeof(want));
  return ok;
}

static int dir_init(struct auth_dir *d, const uint8_t key[32]) {
  d->seq = 0;
  d->ctx = EVP_CIPHER_CTX_new();
  if (!d->ctx) return -ENOMEM;
  if (EVP_EncryptInit_ex(d->ctx, EVP_chacha20_poly1305(), NULL, key, NULL) != 1) return -EIO;
  return 0;
}

int auth_session_new(const struct auth_token *t, enum auth_role self,
                     const uint8_t th[AUTH_HASH_BYTES], const uint8_t nonce[AUTH_NONCE_BYTES],
                     struct auth_session **out) {
  *out = NULL;
  struct auth_session *s = calloc(1, sizeof(*s));
  if (!s) return -ENOMEM;
  uint8_t master[AUTH_PROOF_BYTES], i2a[AUTH_PROOF_BYTES], a2i[AUTH_PROOF_BYTES];
  hmac3(t->key, t->len, LABEL_SESSION, th, AUTH_HASH_BYTES, nonce, AUTH_NONCE_BYTES, master);
  hmac3(master, sizeof(master), "i2a", NULL, 0, NULL, 0, i2a);
  hmac3(master, sizeof(master), "a2i", NULL, 0, NULL, 0, a2i);
  int r = dir_init(&s->tx, self == AUTH_INITIATOR ? i2a : a2i);
  if (r == 0) r = dir_init(&s->rx, self == AUTH_INITIATOR ? a2i : i2a);
  OPENSSL_cleanse(master, sizeof(master));
  OPENSSL_cleanse(i2a, sizeof(i2a));
  OPENSSL_cleanse(a2i, sizeof(a2i));
  if (r < 0) {
    auth_session_free(s);
    return r;
  }
  *out = s;
  return 0;
}

void auth_session_free(struct auth_session *s) {
  if (!s) return;
  EVP_CIPHER_CTX_free(s->tx.ctx); /* cleanses its key */
  EVP_CIPHER_CTX_free(s->rx.ctx);
  free(s);
}

/* The Poly1305 tag of ChaCha20-Poly1305 with no plaintext (the bytes are
 * associated data) under d's key with nonce = d->seq, in three steps. */
static int mac_begin(struct auth_dir *d) {
  uint8_t iv[12] = {0};
  for (int i = 0; i < 8; i++) iv[4 + i] = (uint8_t)(d->seq >> (8 * i));
  return EVP_EncryptInit_ex(d->ctx, NULL, NULL, NULL, iv) == 1 ? 0 : -EIO;
}

static int mac_update(struct auth_dir *d, const void *buf, size_t len) {
  const uint8_t *p = buf;
  int outl = 0;
  while (len > 0) {
    int n = len > (size_t)(INT_MAX / 2) ? INT_MAX / 2 : (int)len;
    if (EVP_EncryptUpdate(d->ctx, NULL, &outl, p, n) != 1) return -EIO;
    p += n;
    len -= (size_t)n;
  }
  return 0;
}

static int mac_finish(struct auth_dir *d, uint8_t tag[AUTH_TAG_BYTES]) {
  uint8_t none[16];
  int outl = 0;
  if (EVP_EncryptFinal_ex(d->ctx, none, &outl) != 1) return -EIO;
  if (EVP_CIPHER_CTX_ctrl(d->ctx, EVP_CTRL_AEAD_GET_TAG, AUTH_TAG_BYTES, tag) != 1) return -EIO;
  return 0;
}

static int frame_tag(struct auth_dir *d, const struct iovec *iov, int iovcnt,
                     uint8_t tag[AUTH_TAG_BYTES]) {
  int r = mac_begin(d);
  for (int i = 0; r == 0 && i < iovcnt; i++) r = mac_update(d, iov[i].iov_base, iov[i].iov_len);
  return r == 0 ? mac_finish(d, tag) : r;
}

int auth_seal(struct auth_session *s, const struct iovec *iov, int iovcnt,
              uint8_t tag[AUTH_TAG_BYTES]) {
  int r = frame_tag(&s->tx, iov, iovcnt, tag);
  if (r == 0) s->tx.seq++;
  return r;
}

int auth_open(struct auth_session *s, const struct iovec *iov, int iovcnt,
              const uint8_t tag[AUTH_TAG_BYTES]) {
  uint8_t want[AUTH_TAG_BYTES];
  int r = frame_tag(&s->rx, iov, iovcnt, want);
  if (r < 0) return r;
  if (CRYPTO_memcmp(want, tag, AUTH_TAG_BYTES) != 0) return -EBADMSG;
  s->rx.seq++;
  return 0;
}

int auth_tx_begin(struct auth_session *s) {
  return mac_begin(&s->tx);
}
int auth_tx_update(struct auth_session *s, const void *p, size_t n) {
  return mac_update(&s->tx, p, n);
}
int auth_tx_finish(struct auth_session *s, uint8_t tag[AUTH_TAG_BYTES]) {
  int r = mac_finish(&s->tx, tag);
  if (r == 0) s->tx.seq++;
  return r;
}
int auth_rx_begin(struct auth_session *s) {
  return mac_begin(&s->rx);
}
int auth_rx_update(struct auth_session *s, const void *p, size_t n) {
  return mac_update(&s->rx, p, n);
}
int auth_rx_finish(struct auth_session *s, const uint8_t tag[AUTH_TAG_BYTES]) {
  uint8_t want[AUTH_TAG_BYTES];
  int r = mac_finish(&s->rx, want);
  if (r < 0) return r;
  if (CRYPTO_memcmp(want, tag, AUTH_TAG_BYTES) != 0) return -EBADMSG;
  s->rx.seq++;
  return 0;
}

uint64_t auth_session_sent(const struct auth_session *s) {
  return s->tx.seq;
}
uint64_t auth_session_received(const struct auth_session *s) {
  return s->rx.seq;
}
