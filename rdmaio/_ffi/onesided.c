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

/* ---- a serial one-sided request: fill, post and poll in one call --------------------------------------
 * One task calling one request at a time (rdmaio.core.onesided.operations) posts it alone and looks at the
 * CQ once before it sleeps: a device may have completed it inside ibv_post_send (rxe runs a loopback READ
 * or atomic there). At most ONE record is taken from the CQ, so whatever follows it stays there, in
 * order, for the dispatcher; the record is the request's own successful completion in the common case. */
static int is_atomic(uint32_t opcode)
{
    return opcode == IBV_WR_ATOMIC_FETCH_AND_ADD || opcode == IBV_WR_ATOMIC_CMP_AND_SWP;
}

/* After a post of request `wr_id`: one look at the CQ. RDMAIO_POSTED_DONE when the record taken is that
 * request's own successful completion; RDMAIO_POSTED_OTHER when it is any other record (kept in
 * port->record, with its dispatch key in port->group); RDMAIO_POSTED when the CQ was empty. */
static int take_one_record(struct rdmaio_onesided_port *port, uint64_t wr_id)
{
    int n = rdmaio_poll_cq(port->cq, &port->record, 1);
    if (n < 0) {
        port->poll_errno = -n;
        return RDMAIO_POSTED_POLL_FAILED;
    }
    if (n == 0)
        return RDMAIO_POSTED;
    port->polled++;
    if (port->record.wr_id == wr_id && port->record.status == IBV_WC_SUCCESS &&
        port->record.qp_num == port->qp->qp_num)
        return RDMAIO_POSTED_DONE;
    port->group.key = ((uint64_t)port->record.qp_num << RDMAIO_KEY_TAG_BITS) |
                      ((port->record.wr_id >> RDMAIO_WR_TAG_SHIFT) & RDMAIO_WR_TAG_MASK);
    port->group.start = 0;
    port->group.count = 1;
    return RDMAIO_POSTED_OTHER;
}

int rdmaio_onesided_post_poll(struct rdmaio_onesided_port *port, uint32_t index, uint64_t local_addr,
                              uint32_t lkey, uint32_t length, uint32_t opcode, uint64_t remote_addr,
                              uint32_t rkey, uint64_t compare_add, uint64_t swap)
{
    struct ibv_sge sge;
    struct ibv_send_wr wr, *bad = NULL;

    if (!port->qp || !port->cq)
        return -EBADF; /* the queue pair was destroyed (or this is a forked child) */
    if (is_atomic(opcode)) {
        if (length != 8)
            return -EINVAL;
    } else if (opcode != IBV_WR_RDMA_READ && opcode != IBV_WR_RDMA_WRITE) {
        return -EINVAL; /* writes with immediate data and sends take a credit: not posted here */
    }
    memset(&wr, 0, sizeof(wr));
    sge.addr = local_addr;
    sge.length = length;
    sge.lkey = lkey;
    wr.wr_id = port->wr_base | index;
    wr.sg_list = &sge;
    wr.num_sge = length ? 1 : 0;
    wr.opcode = (enum ibv_wr_opcode)opcode;
    wr.send_flags = IBV_SEND_SIGNALED;
    if (is_atomic(opcode)) {
        wr.wr.atomic.remote_addr = remote_addr;
        wr.wr.atomic.rkey = rkey;
        wr.wr.atomic.compare_add = compare_add;
        wr.wr.atomic.swap = swap;
    } else {
        wr.wr.rdma.remote_addr = remote_addr;
        wr.wr.rdma.rkey = rkey;
        if (opcode == IBV_WR_RDMA_WRITE && length && length <= port->max_inline)
            wr.send_flags |= IBV_SEND_INLINE;
    }
    port->posted++;
    int rc = ibv_post_send(port->qp, &wr, &bad);
    if (rc) {
        port->posted--;
        return rdmaio_neg_errno(rc);
    }
    return take_one_record(port, wr.wr_id);
}

/* A wave of a batch (see struct rdmaio_batch; rdmaio_post_batch posts it, only its last request
 * signalled) posted by one task calling serially, then one look at the CQ as rdmaio_onesided_post_poll
 * takes: RDMAIO_POSTED_DONE when the record taken is the wave's own successful completion (RC completes a
 * send queue in order: the last request's success means every request of the wave succeeded). A
 * negative value is the post's -errno (requests before the failing chain may have been posted: the
 * caller fails the connection). */
int rdmaio_onesided_post_batch_poll(struct rdmaio_onesided_port *port, const struct rdmaio_batch *b)
{
    int bad = -1;

    if (!port->qp || !port->cq)
        return -EBADF;
    int rc = rdmaio_post_batch(port->qp, b, &bad);
    if (rc < 0)
        return rc;
    port->posted += (uint64_t)rc;
    return take_one_record(port, b->wr_id);
}
