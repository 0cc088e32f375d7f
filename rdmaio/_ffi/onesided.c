/* rdmaio one-sided helpers (issue 11): device and QP queries that call exported libibverbs functions.
 * Kept out of helper.c so that helper.c links against the few stubs of tests/unit/test_helper_c.py.
 * Return convention as helper.c: 0 success, -errno on failure. */
#include <errno.h>
#include <string.h>

#include "helper.h"

int rdmaio_query_onesided_caps(struct ibv_context *context, struct rdmaio_onesided_caps *out)
{
    struct ibv_device_attr attr;
    int rc = ibv_query_device(context, &attr);
    if (rc)
        return -(rc > 0 ? rc : EIO);
    out->atomic_cap = attr.atomic_cap;
    out->max_qp_rd_atom = attr.max_qp_rd_atom;
    out->max_qp_init_rd_atom = attr.max_qp_init_rd_atom;
    out->max_mw = attr.max_mw;
    out->device_cap_flags = attr.device_cap_flags;
    return 0;
}

/* Can this PD allocate a memory window of `type` (1 or 2)? 0 yes, -errno no. The window is freed. */
int rdmaio_probe_mw(struct ibv_pd *pd, int type)
{
    struct ibv_mw *mw = ibv_alloc_mw(pd, type == 2 ? IBV_MW_TYPE_2 : IBV_MW_TYPE_1);
    if (!mw)
        return -(errno ? errno : EOPNOTSUPP);
    ibv_dealloc_mw(mw);
    return 0;
}

/* The remote access a connected QP grants (rdma_cm sets it from the negotiated conn params). */
int rdmaio_qp_access(struct ibv_qp *qp, int *access_flags, int *max_rd_atomic, int *max_dest_rd_atomic)
{
    struct ibv_qp_attr attr;
    struct ibv_qp_init_attr init;
    int rc = ibv_query_qp(qp, &attr, IBV_QP_ACCESS_FLAGS | IBV_QP_MAX_QP_RD_ATOMIC |
                                     IBV_QP_MAX_DEST_RD_ATOMIC, &init);
    if (rc)
        return -(rc > 0 ? rc : EIO);
    *access_flags = attr.qp_access_flags;
    *max_rd_atomic = attr.max_rd_atomic;
    *max_dest_rd_atomic = attr.max_dest_rd_atomic;
    return 0;
}
