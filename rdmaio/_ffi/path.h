/* rdmaio path query: what carries one connection (device port, GIDs, MTUs), read once on request. */
#ifndef RDMAIO_PATH_H
#define RDMAIO_PATH_H

#include <stdint.h>
#include <rdma/rdma_cma.h>

/* The path of a connected rdma_cm id, as the device holds it. Every field is filled (0 or -1 when
 * unknown), so a caller never reads uninitialised memory. */
struct rdmaio_path {
    uint8_t sgid[16];        /* local GID (the QP's source GID entry; the route's when the QP has no GRH) */
    uint8_t dgid[16];        /* remote GID (the QP's address vector; the route's when it has no GRH) */
    int32_t sgid_index;      /* index of the local GID in the port's table; -1 unknown */
    int32_t gid_type;        /* enum ibv_gid_type of that entry; -1 unknown */
    int32_t active_mtu;      /* enum ibv_mtu of the port; 0 unknown */
    int32_t path_mtu;        /* enum ibv_mtu the QP uses; 0 unknown */
    int32_t link_layer;      /* IBV_LINK_LAYER_* of the port */
    int32_t transport_type;  /* enum ibv_transport_type of the device */
    int32_t port_num;        /* the port the id is bound to */
    int32_t is_global;       /* the QP's address vector carries a GRH */
};

/* Fill *out for the connected id (ibv_query_port, ibv_query_qp and ibv_query_gid_ex: system calls, so
 * called once per connection and only when asked). Returns 0, or a negative errno (-EINVAL for an id
 * without a device, the first failing query's errno otherwise; *out then holds what was read before). */
int rdmaio_query_path(struct rdma_cm_id *id, struct rdmaio_path *out);

/* What the framing negotiation needs of a device (ibv_query_device and the device's transport type):
 * 0, or the -errno of ibv_query_device. */
struct rdmaio_framing_caps {
    int transport_type;  /* enum ibv_transport_type: IBV_TRANSPORT_IWARP has no immediate data */
    int atomic_cap;      /* enum ibv_atomic_cap */
    int max_mw;
    int max_sge_rd;      /* scatter entries of one RDMA READ */
};
int rdmaio_query_framing_caps(struct ibv_context *context, struct rdmaio_framing_caps *out);

#endif
