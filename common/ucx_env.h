/* ucx_env: the environment ucx_link reads (UCX_TLS and the PS_UCX_* knobs),
 * checked so that a bad setting is named with its fix before UCX starts. */
#ifndef PS_UCX_ENV_H
#define PS_UCX_ENV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* getenv(name) as a whole number 0..max in decimal digits only (no sign,
 * no spaces, no overflow); def when unset or empty. -EINVAL with err
 * naming the variable otherwise. */
int ucx_env_u64(const char *name, uint64_t def, uint64_t max, uint64_t *out, char *err,
                size_t errlen);
/* UCX_TLS can make a client-server connection (has tcp or an RDMA
 * transport, or is unset/"all"/a "^" exclusion list). -EINVAL with err
 * saying what to set otherwise. */
int ucx_env_check_tls(char *err, size_t errlen);
/* Where shared memory may be in use (UCX warns about settings of
 * transports it does not open). */
bool ucx_env_shm_possible(void);
/* The error of a failed ucp_init (what: the UCX call, why: its status
 * text), naming UCX_TLS when it is set. */
void ucx_env_init_error(const char *what, const char *why, char *err, size_t errlen);
/* A ucs_status_t as a negative errno (0 for UCS_OK). */
int ucx_env_errno(int status);

#endif
