/* rdmaio one-sided helpers: device and QP queries that call exported libibverbs functions.
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
        return rdmaio_neg_errno(rc);
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
        return rdmaio_neg_errno(rc);
    *access_flags = attr.qp_access_flags;
    *max_rd_atomic = attr.max_rd_atomic;
    *max_dest_rd_atomic = attr.max_dest_rd_atomic;
    return 0;
}

/* Memory-window probe (tools/probe_onesided.py only; grants allocate and bind their windows through
 * rdmaio.verbs.MemoryWindow). Allocates a type 2 window and binds it to [addr, addr + length) of `mr`
 * (registered with IBV_ACCESS_MW_BIND) with `access`, on `qp`, signalled with `wr_id` (its completion tells
 * whether the bind worked), by the helper's rdmaio_post_bind_mw. On success *out is the window and *rkey
 * the rkey the peer must use. 0 or -errno. */
int rdmaio_probe_bind_mw(struct ibv_qp *qp, struct ibv_pd *pd, struct ibv_mr *mr, uint64_t addr,
                         uint64_t length, int access, uint64_t wr_id, struct ibv_mw **out, uint32_t *rkey)
{
    struct ibv_mw *mw = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
    if (!mw)
        return -(errno ? errno : EOPNOTSUPP);
    int rc = rdmaio_post_bind_mw(qp, mw, mr, addr, length, (unsigned int)access, wr_id, rkey);
    if (rc) {
        ibv_dealloc_mw(mw);
        return rc;
    }
    *out = mw;
    return 0;
}

/* Post IBV_WR_LOCAL_INV of `rkey` (a bound type 2 window) on `qp`, signalled with `wr_id`. 0 or -errno. */
int rdmaio_probe_local_inv(struct ibv_qp *qp, uint32_t rkey, uint64_t wr_id)
{
    struct ibv_send_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = wr_id;
    wr.opcode = IBV_WR_LOCAL_INV;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.invalidate_rkey = rkey;
    int rc = ibv_post_send(qp, &wr, &bad);
    return rc ? rdmaio_neg_errno(rc) : 0;
}

int rdmaio_probe_dealloc_mw(struct ibv_mw *mw)
{
    int rc = ibv_dealloc_mw(mw);
    return rc ? rdmaio_neg_errno(rc) : 0;
}
