/* conn_transports: the registry of the shard's transports (see
 * conn_transports.h). Adding a transport is a file defining its struct
 * conn_transport_ops and one line in the list below. */
#include "conn_transports.h"

#include <string.h>

#include "config.h"
#include "server_impl.h"

extern const struct conn_transport_ops conn_tcp_ops, conn_ucx_ops;

/* The first is the default; the order is the metric's label order. */
static const struct conn_transport_ops *const transports[] = {&conn_tcp_ops, &conn_ucx_ops};
#define N_TRANSPORTS (sizeof(transports) / sizeof(transports[0]))

size_t conn_transport_count(void) {
  return N_TRANSPORTS;
}

const char *conn_transport_name(size_t i) {
  return i < N_TRANSPORTS ? transports[i]->name : NULL;
}

int conn_transport_index(const char *name) {
  if (!name || !name[0]) return 0;
  for (size_t i = 0; i < N_TRANSPORTS; i++)
    if (strcmp(name, transports[i]->name) == 0) return (int)i;
  return -1;
}

const struct conn_transport_ops *conn_transport_find(const char *name) {
  int i = conn_transport_index(name);
  return i < 0 ? NULL : transports[i];
}

int conn_transport_check(const char *value, char *err, size_t errlen) {
  const char *names[N_TRANSPORTS];
  for (size_t i = 0; i < N_TRANSPORTS; i++) names[i] = transports[i]->name;
  int i = config_choice(value, names, N_TRANSPORTS, err, errlen);
  if (i < 0) return i;
  return transports[i]->check_build ? transports[i]->check_build(value, err, errlen) : 0;
}

int conn_transport_check_env(const char *name, char *err, size_t errlen) {
  const struct conn_transport_ops *tp = conn_transport_find(name);
  if (!tp) return conn_transport_check(name, err, errlen);
  return tp->check_env ? tp->check_env(err, errlen) : 0;
}
