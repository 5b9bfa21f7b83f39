/* ucx_env: checks of UCX_TLS and the PS_UCX_* knobs (see ucx_env.h). UCX
 * itself says only "ucp_init failed: No such device" for a UCX_TLS naming no
 * transport it has, and nothing at all for one that has no transport able to
 * set up a client-server connection (sm,self: the handshake then fails as a
 * reset connection), so both are caught and explained here. */
#include "ucx_env.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <ucp/api/ucp.h>
#include <ucs/type/status.h>

/* Transports (or their prefixes, as rc_x, ud_v, dc_mlx5) that can carry a
 * client-server connection's wireup. */
static const char *const connecting[] = {"tcp", "rc", "ud", "dc", "ib", "all"};

int ucx_env_check_tls(char *err, size_t errlen) {
  const char *tls = getenv("UCX_TLS");
  if (!tls || !*tls || tls[0] == '^') return 0;
  char buf[256];
  snprintf(buf, sizeof(buf), "%s", tls);
  for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
    while (*t == ' ') t++;
    for (size_t i = 0; i < sizeof(connecting) / sizeof(connecting[0]); i++)
      if (!strncmp(t, connecting[i], strlen(connecting[i]))) return 0;
  }
  snprintf(err, errlen,
           "UCX_TLS=%s has no transport that can connect a worker to a shard's --listen "
           "address (UCX's TCP connection manager needs tcp, or rc/ud/dc over RDMA): add tcp, "
           "e.g. UCX_TLS=%s,tcp, or unset UCX_TLS",
           tls, tls);
  return -EINVAL;
}

bool ucx_env_shm_possible(void) {
  const char *tls = getenv("UCX_TLS");
  return !tls || strstr(tls, "sm") || strstr(tls, "posix") || strstr(tls, "sysv") ||
         strstr(tls, "mm") || strstr(tls, "all") || strstr(tls, "cma");
}

void ucx_env_init_error(const char *what, const char *why, char *err, size_t errlen) {
  const char *tls = getenv("UCX_TLS");
  if (tls && *tls)
    snprintf(err, errlen,
             "UCX: %s failed: %s: UCX_TLS=%s names no transport UCX has on this host "
             "(unknown or unavailable; `ucx_info -d` lists them): fix or unset UCX_TLS, "
             "e.g. UCX_TLS=tcp,sm,self",
             what, why, tls);
  else
    snprintf(err, errlen, "UCX: %s failed: %s", what, why);
}

int ucx_env_check(char *err, size_t errlen) {
  uint64_t v;
  int r = envknob_u64("PS_UCX_RNDV_BYTES", &v, err, errlen);
  if (r == 0) r = envknob_u64("PS_UCX_POLL_US", &v, err, errlen);
  if (r == 0) r = ucx_env_check_tls(err, errlen);
  if (r < 0) return r;
  ucp_config_t *cfg = NULL;
  ucs_status_t s = ucp_config_read(NULL, NULL, &cfg);
  if (s == UCS_ERR_INVALID_PARAM || s == UCS_ERR_NO_ELEM) {
    snprintf(err, errlen,
             "UCX: a UCX_* environment variable has a value UCX cannot parse (%s; UCX's own "
             "message above names it): fix or unset it",
             ucs_status_string(s));
    return -EINVAL;
  }
  if (s != UCS_OK) return 0; /* not the settings': the real start reports it */
  const char *tls = getenv("UCX_TLS");
  if (tls && *tls) { /* UCX says an unknown or absent transport only in ucp_init */
    ucp_params_t p = {.field_mask = UCP_PARAM_FIELD_FEATURES,
                      .features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP};
    ucp_context_h ctx = NULL;
    s = ucp_init(&p, cfg, &ctx);
    if (s == UCS_OK) ucp_cleanup(ctx);
  }
  ucp_config_release(cfg);
  if (s == UCS_ERR_NO_DEVICE) {
    ucx_env_init_error("ucp_init", ucs_status_string(s), err, errlen);
    return -EINVAL;
  }
  return 0;
}

int ucx_env_errno(int status) {
  ucs_status_t s = (ucs_status_t)status;
  switch (s) {
    case UCS_OK:
      return 0;
    case UCS_ERR_CANCELED:
      return -ECANCELED;
    case UCS_ERR_NO_MEMORY:
      return -ENOMEM;
    case UCS_ERR_INVALID_PARAM:
      return -EINVAL;
    case UCS_ERR_MESSAGE_TRUNCATED:
      return -EMSGSIZE;
    case UCS_ERR_UNREACHABLE:
      return -EHOSTUNREACH;
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_ENDPOINT_TIMEOUT:
      return -ETIMEDOUT;
    case UCS_ERR_REJECTED:
      return -ECONNREFUSED;
    default:
      return -ECONNRESET;
  }
}
