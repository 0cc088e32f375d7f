/* rdmaio path query (see path.h). No Python C-API: cffi releases the GIL around the call. */
#include <errno.h>
#include <string.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#include "path.h"

static int negative_errno(int rc)
{
    /* libibverbs returns a positive errno, some providers a negative one, some -1 with errno set */
    if (rc > 0)
        return -rc;
    if (rc == -1 && errno > 0)
        return -errno;
    return rc;
}

int rdmaio_query_path(struct rdma_cm_id *id, struct rdmaio_path *out)
{
    struct ibv_port_attr port_attr;
    struct ibv_qp_attr attr;
    struct ibv_qp_init_attr init;
    struct ibv_gid_entry entry;
    int rc, i;

    if (out == NULL)
        return -EINVAL;
    memset(out, 0, sizeof(*out));
    out->sgid_index = -1;
    out->gid_type = -1;
    if (id == NULL || id->verbs == NULL || id->verbs->device == NULL)
        return -EINVAL;
    out->port_num = id->port_num;
    out->transport_type = id->verbs->device->transport_type;
    /* rdma_cm's route: the GIDs it resolved (IB, RoCE and iWARP alike) */
    memcpy(out->sgid, id->route.addr.addr.ibaddr.sgid.raw, sizeof(out->sgid));
    memcpy(out->dgid, id->route.addr.addr.ibaddr.dgid.raw, sizeof(out->dgid));

    memset(&port_attr, 0, sizeof(port_attr));
    rc = ibv_query_port(id->verbs, id->port_num, &port_attr);
    if (rc != 0)
        return negative_errno(rc);
    out->active_mtu = port_attr.active_mtu;
    out->link_layer = port_attr.link_layer;

    if (id->qp != NULL) {
        memset(&attr, 0, sizeof(attr));
        memset(&init, 0, sizeof(init));
        rc = ibv_query_qp(id->qp, &attr, IBV_QP_AV | IBV_QP_PATH_MTU, &init);
        if (rc != 0)
            return negative_errno(rc);
        out->path_mtu = attr.path_mtu;
        out->is_global = attr.ah_attr.is_global;
        if (attr.ah_attr.is_global) {
            /* what the QP really uses: its source GID entry and destination GID */
            out->sgid_index = attr.ah_attr.grh.sgid_index;
            memcpy(out->dgid, attr.ah_attr.grh.dgid.raw, sizeof(out->dgid));
        }
    }

    if (out->sgid_index >= 0) {
        memset(&entry, 0, sizeof(entry));
        if (ibv_query_gid_ex(id->verbs, id->port_num, (uint32_t)out->sgid_index, &entry, 0) == 0) {
            memcpy(out->sgid, entry.gid.raw, sizeof(out->sgid));
            out->gid_type = (int32_t)entry.gid_type;
        }
        return 0;
    }
    /* no GRH (InfiniBand within a subnet): find the route's source GID in the port's table */
    for (i = 0; i < port_attr.gid_tbl_len && i < 65536; i++) {
        memset(&entry, 0, sizeof(entry));
        if (ibv_query_gid_ex(id->verbs, id->port_num, (uint32_t)i, &entry, 0) != 0)
            continue;  /* an empty entry (ENODATA) */
        if (memcmp(entry.gid.raw, out->sgid, sizeof(out->sgid)) == 0) {
            out->sgid_index = i;
            out->gid_type = (int32_t)entry.gid_type;
            break;
        }
    }
    /* iWARP has no GRH and its rdma_cm route may hold no GID (the active side's is all zeros): the GID
     * such a device uses is its port's one entry, the netdev's MAC-based GID (siw, cxgb4 and irdma have a
     * table of one) */
    if (out->sgid_index < 0 && out->transport_type == IBV_TRANSPORT_IWARP && port_attr.gid_tbl_len > 0) {
        memset(&entry, 0, sizeof(entry));
        if (ibv_query_gid_ex(id->verbs, id->port_num, 0, &entry, 0) == 0) {
            memcpy(out->sgid, entry.gid.raw, sizeof(out->sgid));
            out->sgid_index = 0;
            out->gid_type = (int32_t)entry.gid_type;
        }
    }
    return 0;
}

int rdmaio_query_framing_caps(struct ibv_context *context, struct rdmaio_framing_caps *out)
{
    struct ibv_device_attr attr;
    int rc;

    if (!context || !out)
        return -EINVAL;
    rc = ibv_query_device(context, &attr);
    if (rc)
        return negative_errno(rc);
    out->transport_type = context->device ? (int)context->device->transport_type : -1;
    out->atomic_cap = (int)attr.atomic_cap;
    out->max_mw = attr.max_mw;
    out->max_sge_rd = attr.max_sge_rd;
    return 0;
}
