/* ps-mac-bench: GB/s of the frame tag (docs/SECURITY.md) and of the other
 * message authentication primitives this machine's libcrypto offers, on one
 * core, by message size: what the per-frame tag costs next to the copies a
 * loopback socket makes, and whether a faster primitive is available here.
 *
 *   auth_seal     the shard's and libps's tag: ChaCha20-Poly1305 with no
 *                 plaintext (the frame as associated data), per-frame nonce
 *   aes128-gmac   AES-128-GCM with no plaintext (GMAC): GHASH, as fast as
 *                 libcrypto's carry-less-multiply path on this CPU allows
 *   aes256-gmac   the same with a 256-bit key
 *   hmac-sha256   for scale (SHA extensions where the CPU has them)
 *   memcpy        for scale: one copy of the message, as a socket makes
 *
 * Each cell is the median over --reps repetitions of at least --min-ms
 * milliseconds. A benchmark, not a test: run it on a quiet machine. */
#include <errno.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <sys/utsname.h>
#include <time.h>

#include "auth.h"
#include "clock.h"
#include "config.h"

struct mac_config {
  char sizes[256];
  int64_t reps;
  int64_t min_ms;
};

#define CONFIG_STRUCT struct mac_config
static const struct config_option mac_options[] = {
    CONFIG_OPT("sizes", CONFIG_STRING, sizes, "4KiB,64KiB,1MiB,16MiB", 0, 0,
               "message sizes, comma-separated (suffixes KiB, MiB)"),
    CONFIG_OPT("reps", CONFIG_INT, reps, "7", 1, 1000,
               "repetitions per measurement (median shown)"),
    CONFIG_OPT("min-ms", CONFIG_INT, min_ms, "100", 1, 100000,
               "shortest repetition in milliseconds"),
};

static const struct config_spec mac_spec = {
    "ps-mac-bench", "GB/s of the frame tag and of libcrypto's other MACs on one core, by size",
    mac_options, sizeof(mac_options) / sizeof(mac_options[0]), NULL};

enum prim { P_SEAL, P_GMAC128, P_GMAC256, P_HMAC, P_MEMCPY, NUM_PRIMS };
static const char *const prim_names[NUM_PRIMS] = {"auth_seal", "aes128-gmac", "aes256-gmac",
                                                  "hmac-sha256", "memcpy"};

struct bench {
  uint8_t *buf, *dst;
  size_t n;
  struct auth_session *sess;
  EVP_CIPHER_CTX *gcm128, *gcm256;
  uint8_t key[32];
};

/* One message through primitive p; returns 0 or -EIO. */
static int once(struct bench *b, enum prim p) {
  uint8_t tag[32], iv[12] = {0};
  int outl;
  switch (p) {
    case P_SEAL: {
      struct iovec iov = {b->buf, b->n};
      return auth_seal(b->sess, &iov, 1, tag);
    }
    case P_GMAC128:
    case P_GMAC256: {
      EVP_CIPHER_CTX *x = p == P_GMAC128 ? b->gcm128 : b->gcm256;
      if (EVP_EncryptInit_ex(x, NULL, NULL, NULL, iv) != 1 ||
          EVP_EncryptUpdate(x, NULL, &outl, b->buf, (int)b->n) != 1 ||
          EVP_EncryptFinal_ex(x, tag, &outl) != 1 ||
          EVP_CIPHER_CTX_ctrl(x, EVP_CTRL_GCM_GET_TAG, 16, tag) != 1)
        return -EIO;
      return 0;
    }
    case P_HMAC: {
      unsigned len = 0;
      return HMAC(EVP_sha256(), b->key, sizeof(b->key), b->buf, b->n, tag, &len) ? 0 : -EIO;
    }
    case P_MEMCPY:
      memcpy(b->dst, b->buf, b->n);
      return 0;
    case NUM_PRIMS:
      break;
  }
  return -EIO;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* Median GB/s of p over cfg->reps repetitions, or a negative value on error. */
static double measure(struct bench *b, enum prim p, const struct mac_config *cfg) {
  double gbps[1000];
  for (int64_t r = 0; r < cfg->reps; r++) {
    uint64_t t0 = clock_now_ns(), t, iters = 0;
    do {
      if (once(b, p) < 0) return -1;
      iters++;
      t = clock_now_ns();
    } while (t - t0 < (uint64_t)cfg->min_ms * 1000000u);
    gbps[r] = (double)iters * (double)b->n / (double)(t - t0);
  }
  qsort(gbps, (size_t)cfg->reps, sizeof(double), cmp_double);
  return gbps[cfg->reps / 2];
}

static int setup(struct bench *b, size_t max) {
  struct auth_token *t = NULL;
  uint8_t th[AUTH_HASH_BYTES] = {1}, nonce[AUTH_NONCE_BYTES] = {2};
  memset(b->key, 0x5a, sizeof(b->key));
  b->buf = malloc(max);
  b->dst = malloc(max);
  b->gcm128 = EVP_CIPHER_CTX_new();
  b->gcm256 = EVP_CIPHER_CTX_new();
  if (!b->buf || !b->dst || !b->gcm128 || !b->gcm256) return -ENOMEM;
  for (size_t i = 0; i < max; i++) b->buf[i] = (uint8_t)(i * 131 + 7);
  memset(b->dst, 0, max);
  if (auth_token_from_bytes("ps-mac-bench token, 32 bytes...", 32, &t) < 0 ||
      auth_session_new(t, AUTH_INITIATOR, th, nonce, &b->sess) < 0 ||
      EVP_EncryptInit_ex(b->gcm128, EVP_aes_128_gcm(), NULL, b->key, NULL) != 1 ||
      EVP_EncryptInit_ex(b->gcm256, EVP_aes_256_gcm(), NULL, b->key, NULL) != 1) {
    auth_token_free(t);
    return -EIO;
  }
  auth_token_free(t);
  return 0;
}

int main(int argc, char **argv) {
  struct mac_config cfg;
  int r = config_parse(&mac_spec, &cfg, argc, argv, NULL, stderr);
  if (r == CONFIG_HELP || r == CONFIG_VERSION) return 0;
  if (r < 0) return 2;
  uint64_t sizes[16];
  int ns = 0;
  for (char *save = NULL, *tok = strtok_r(cfg.sizes, ",", &save); tok;
       tok = strtok_r(NULL, ",", &save)) {
    uint64_t v;
    if (ns == 16 || config_parse_size(tok, &v) != 0 || v == 0 || v > (1u << 30)) {
      fprintf(stderr,
              "ps-mac-bench: option --sizes: \"%s\" is not a size from 1 byte to 1GiB "
              "(at most 16 sizes)\n",
              tok);
      return 2;
    }
    sizes[ns++] = v;
  }
  uint64_t max = 0;
  for (int i = 0; i < ns; i++) max = sizes[i] > max ? sizes[i] : max;
  struct bench b = {0};
  int ret = 1;
  if (setup(&b, max) < 0) {
    fprintf(stderr, "ps-mac-bench: cannot set up the primitives (out of memory or libcrypto)\n");
    goto out;
  }
  struct utsname u;
  if (uname(&u) != 0) snprintf(u.machine, sizeof(u.machine), "?");
  printf("# ps-mac-bench %s, one core, GB/s (median of %lld x >= %lld ms)\n",
         OpenSSL_version(OPENSSL_VERSION), (long long)cfg.reps, (long long)cfg.min_ms);
  printf("%-10s", "bytes");
  for (int p = 0; p < NUM_PRIMS; p++) printf(" %12s", prim_names[p]);
  printf("\n");
  for (int i = 0; i < ns; i++) {
    b.n = sizes[i];
    printf("%-10llu", (unsigned long long)b.n);
    for (int p = 0; p < NUM_PRIMS; p++) {
      double g = measure(&b, (enum prim)p, &cfg);
      if (g < 0) {
        fprintf(stderr, "ps-mac-bench: %s failed\n", prim_names[p]);
        goto out;
      }
      printf(" %12.2f", g);
    }
    printf("\n");
    fflush(stdout);
  }
  ret = 0;
out:
  auth_session_free(b.sess);
  EVP_CIPHER_CTX_free(b.gcm128);
  EVP_CIPHER_CTX_free(b.gcm256);
  free(b.buf);
  free(b.dst);
  return ret;
}
