/* conn_transports: the shard's transports by name (--transport). The one
 * list of them is conn_transports.c; everything else holds the name the
 * user gave and asks here for its table of operations (server_impl.h's
 * struct conn_transport_ops), its checks and the metric's labels. */
#ifndef PS_CONN_TRANSPORTS_H
#define PS_CONN_TRANSPORTS_H

#include <stddef.h>

struct conn_transport_ops;

/* The table of the transport named name; NULL or "" = the default (the
 * first listed); NULL for a name not listed. */
const struct conn_transport_ops *conn_transport_find(const char *name);
/* --transport's check (a config_check_fn): a listed name that this build
 * can use. 0, or -EINVAL with err ("expected a or b", or why this build
 * cannot). */
int conn_transport_check(const char *value, char *err, size_t errlen);
/* The named transport's environment-only settings, checked before anything
 * starts so that a bad one exits 2 like a bad option: 0, or -EINVAL with
 * err naming the variable. A transport without such settings: 0. */
int conn_transport_check_env(const char *name, char *err, size_t errlen);
/* The listed transports, in order: how many, the i-th's name, and the
 * position of a name (-1 when not listed; NULL or "" = 0). */
size_t conn_transport_count(void);
const char *conn_transport_name(size_t i);
int conn_transport_index(const char *name);

#endif
