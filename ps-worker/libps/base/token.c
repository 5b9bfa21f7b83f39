/* token: the public ps_token (ps.h), a box around common/auth's auth_token so
 * that no public header names an internal type. The secret itself stays in
 * the auth_token (locked in memory where the system allows it, wiped when
 * freed); this file only translates errors into ps_status and reports a
 * token file's permission warning in the log, as the binaries' option
 * loading does (auth_token_option). */
#include "ps.h"

#include <errno.h>
#include <stdlib.h>

#include "auth.h"
#include "errbuf.h"
#include "log.h"
#include "token_impl.h"

struct ps_token {
  struct auth_token *auth;
};

/* Takes ownership of a, even on failure. */
static ps_status token_box(struct auth_token *a, ps_token **out) {
  ps_token *t = malloc(sizeof(*t));
  if (!t) {
    auth_token_free(a);
    return PS_ERR_NOMEM;
  }
  t->auth = a;
  *out = t;
  return PS_OK;
}

ps_status ps_token_load(const char *path, ps_token **out, char *err, size_t errlen) {
  if (!out) return PS_ERR_INVALID;
  *out = NULL;
  if (!path || !path[0]) {
    errbuf_set(0, err, errlen, "no auth token file given");
    return PS_ERR_INVALID;
  }
  char why[600], warn[300];
  struct auth_token *a = NULL;
  int r = auth_token_load(path, &a, why, sizeof(why), warn, sizeof(warn));
  if (r < 0) {
    errbuf_set(0, err, errlen, "%s", why);
    return r == -ENOMEM ? PS_ERR_NOMEM : PS_ERR_INVALID;
  }
  if (warn[0]) log_warn("auth token file permissions", "detail=\"%s\"", warn);
  ps_status st = token_box(a, out);
  if (st != PS_OK) errbuf_set(0, err, errlen, "out of memory reading %s", path);
  return st;
}

ps_status ps_token_from_bytes(const void *buf, size_t len, ps_token **out) {
  if (!out) return PS_ERR_INVALID;
  *out = NULL;
  if (!buf) return PS_ERR_INVALID;
  struct auth_token *a = NULL;
  int r = auth_token_from_bytes(buf, len, &a);
  if (r < 0) return r == -ENOMEM ? PS_ERR_NOMEM : PS_ERR_INVALID;
  return token_box(a, out);
}

void ps_token_free(ps_token *t) {
  if (!t) return;
  auth_token_free(t->auth);
  free(t);
}

const struct auth_token *token_auth(const ps_token *t) {
  return t ? t->auth : NULL;
}
