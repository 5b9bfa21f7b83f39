/* shard_transports: the registry of libps's push/pull transports (see
 * client_impl.h): a name (ps_client_opts.transport, PS_TRANSPORT) to its
 * table of operations. Adding a transport is a file defining its struct
 * shard_transport_ops and one line in the list below. */
#include <stddef.h>
#include <string.h>

#include "client_impl.h"
#include "config.h"

extern const struct shard_transport_ops shard_tcp_ops, shard_ucx_ops;

/* The first is the default (NULL or ""). */
static const struct shard_transport_ops *const transports[] = {&shard_tcp_ops, &shard_ucx_ops};
#define N_TRANSPORTS (sizeof(transports) / sizeof(transports[0]))

const struct shard_transport_ops *shard_transport_find(const char *name, char *err, size_t errlen) {
  if (!name || !name[0]) return transports[0];
  const char *names[N_TRANSPORTS];
  for (size_t i = 0; i < N_TRANSPORTS; i++) names[i] = transports[i]->name;
  int i = config_choice(name, names, N_TRANSPORTS, err, errlen);
  if (i < 0) return NULL;
  const struct shard_transport_ops *tp = transports[i];
  if (tp->check_build && tp->check_build(name, err, errlen) < 0) return NULL;
  return tp;
}
