/* ucx_env: the environment ucx_link reads (UCX_TLS, and the PS_UCX_* knobs of
 * envknob.c's table), checked so that a bad setting is named with its fix before UCX starts. */
#ifndef PS_UCX_ENV_H
#define PS_UCX_ENV_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "envknob.h" /* the PS_UCX_* knobs: envknob_u64 */

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
/* Every UCX setting a process with --transport ucx reads, checked before it
 * starts anything (ps-server and ps-worker call it after their options, so
 * that a bad one exits 2 like a bad option): PS_UCX_RNDV_BYTES,
 * PS_UCX_POLL_US, UCX_TLS (a transport that can connect, and one UCX has
 * here: a trial ucp_init when it is set) and UCX_* values UCX cannot parse.
 * 0, or -EINVAL with err naming the variable and its fix. A failure that
 * is not the settings' (out of memory, a device that fails) is left to the
 * real start, which reports it as a runtime error. */
int ucx_env_check(char *err, size_t errlen);
/* A ucs_status_t as a negative errno (0 for UCS_OK). */
int ucx_env_errno(int status);

#endif
