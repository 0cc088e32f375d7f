/* rdmaio C helper: the few hot paths that must not pay for one Python call per completion.
 * Everything here runs with the GIL released (cffi API mode releases it around every call). */
#ifndef RDMAIO_HELPER_H
#define RDMAIO_HELPER_H

#include <stdint.h>
#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

/* One completion, compact and with imm_data already in host byte order. */
struct rdmaio_wc {
    uint64_t wr_id;
    uint32_t status;     /* enum ibv_wc_status */
    uint32_t opcode;     /* enum ibv_wc_opcode */
    uint32_t byte_len;
    uint32_t imm_data;   /* host order; valid when flags & IBV_WC_WITH_IMM */
    uint32_t flags;      /* wc_flags */
    uint32_t vendor_err;
    uint32_t qp_num;     /* the QP the work request was posted on (valid for every status) */
};

/* wr_id layout shared by every work request rdmaio posts (rdmaio.verbs has the Python side):
 * bits 56..63 operation kind, bits 32..55 the connection tag the Domain assigned, bits 0..31 the index
 * (slot number, op number). A completion is dispatched by the key (qp_num << 24) | tag. */
#define RDMAIO_WR_TAG_SHIFT 32
#define RDMAIO_WR_TAG_MASK 0xffffffu
#define RDMAIO_KEY_TAG_BITS 24

/* One run of completions with the same dispatch key in rdmaio_poll_grouped()'s output. */
struct rdmaio_wc_group {
    uint64_t key;        /* (qp_num << 24) | tag */
    uint32_t start;      /* index of the first record of the group */
    uint32_t count;      /* records in the group, consecutive, in CQ order */
};

/* The most records one rdmaio_poll_grouped() call takes (its key table lives on the stack). */
#define RDMAIO_MAX_POLL 1024

/* One send work request for rdmaio_post_sends(). */
struct rdmaio_send {
    uint64_t wr_id;
    uint64_t addr;        /* local buffer (or the data itself when inline) */
    uint32_t length;
    uint32_t lkey;
    uint32_t imm_data;    /* host order */
    uint32_t opcode;      /* enum ibv_wr_opcode */
    uint32_t send_flags;  /* IBV_SEND_* */
    uint32_t rkey;        /* RDMA WRITE/READ only */
    uint64_t remote_addr; /* RDMA WRITE/READ only */
};

/* One rdma_cm event, copied out of librdmacm's buffer before the ack frees it. */
#define RDMAIO_MAX_PRIVATE_DATA 256
struct rdmaio_cm_event {
    int event;                      /* enum rdma_cm_event_type */
    int status;
    struct rdma_cm_id *id;
    struct rdma_cm_id *listen_id;
    uint32_t qp_num;
    uint8_t responder_resources;
    uint8_t initiator_depth;
    uint8_t retry_count;
    uint8_t rnr_retry_count;
    uint8_t srq;
    uint8_t private_data_len;
    uint8_t private_data[RDMAIO_MAX_PRIVATE_DATA];
};

/* The -errno of a failed verbs call's non-zero return value `rc`. libibverbs documents a positive errno;
 * providers also return a negative one (rxe and siw return -EINVAL for a work request they refuse, e.g. an
 * opcode siw lacks): both are reported as they are, never replaced by EIO. */
static inline int rdmaio_neg_errno(int rc)
{
    return rc > 0 ? -rc : rc;
}

int rdmaio_drain_cq(struct ibv_comp_channel *channel, struct ibv_cq *cq,
                    struct rdmaio_wc *out, int max_wc, unsigned int *events_out);
int rdmaio_poll_cq(struct ibv_cq *cq, struct rdmaio_wc *out, int max_wc);
int rdmaio_drain_channel(struct ibv_comp_channel *channel, struct ibv_cq **fired, int max_fired,
                         unsigned int *events_out, int *err_out);
int rdmaio_poll_grouped(struct ibv_cq *cq, struct rdmaio_wc *scratch, struct rdmaio_wc *out, int max_wc,
                        struct rdmaio_wc_group *groups, int *ngroups_out);
int rdmaio_post_recv_slots(struct ibv_qp *qp, uint32_t lkey, uint64_t base, uint32_t slot_size,
                           uint64_t wr_id_base, const uint32_t *slots, int count);
int rdmaio_post_recv_ring(struct ibv_qp *qp, const uint32_t *lkeys, uint64_t base, uint32_t slot_size,
                          uint64_t wr_id_base, const uint32_t *slots, int count);
int rdmaio_post_srq_recv_ring(struct ibv_srq *srq, const uint32_t *lkeys, uint64_t base,
                              uint32_t slot_size, uint64_t wr_id_base, const uint32_t *slots, int count);
int rdmaio_post_sends(struct ibv_qp *qp, const struct rdmaio_send *sends, int count, int *bad_index);
int rdmaio_get_cm_event(struct rdma_event_channel *channel, struct rdmaio_cm_event *out);
int rdmaio_get_async_event(struct ibv_context *context, int *event_type, uint32_t *element,
                           uintptr_t *object);
int rdmaio_sockaddr_from_string(const char *ip, uint16_t port, struct sockaddr_storage *out);
int rdmaio_sockaddr_to_string(const struct sockaddr *addr, char *buf, int buflen, uint16_t *port);
int rdmaio_req_notify(struct ibv_cq *cq);

/* ---- one-sided operations -----------------------------------------------------------------------
 * Kept apart from the SEND path above: one-sided work requests have their own scratch array in Python
 * (so they never clobber frames the send engine has staged but not yet posted) and carry the fields
 * only READ/WRITE/atomics need. */

/* One one-sided work request for rdmaio_post_rdma(). */
struct rdmaio_rdma_op {
    uint64_t wr_id;
    uint64_t local_addr;  /* local buffer (or the data itself when inline) */
    uint32_t length;      /* 8 for atomics */
    uint32_t lkey;
    uint32_t opcode;      /* IBV_WR_RDMA_READ / _WRITE / _WRITE_WITH_IMM / SEND / ATOMIC_* */
    uint32_t send_flags;  /* IBV_SEND_* */
    uint32_t imm_data;    /* host order; WRITE_WITH_IMM only */
    uint32_t rkey;
    uint64_t remote_addr;
    uint64_t compare_add; /* atomics: the value to add, or the expected value of a compare-and-swap */
    uint64_t swap;        /* compare-and-swap: the value stored on a match */
};

/* What one-sided operations need to know of a device (ibv_query_device). */
struct rdmaio_onesided_caps {
    int atomic_cap;             /* enum ibv_atomic_cap: 0 none, 1 HCA, 2 global */
    int max_qp_rd_atom;         /* outstanding READ/atomic requests a QP can answer */
    int max_qp_init_rd_atom;    /* outstanding READ/atomic requests a QP can issue */
    int max_mw;
    uint64_t device_cap_flags;  /* IBV_DEVICE_MEM_WINDOW, _TYPE_2A, _TYPE_2B */
};

/* A batch of one-sided requests of one kind on one remote key (fetch_add_many, rdma_read_many): request
 * i reads or updates remote_addr[i]; its local memory is local_addr + local_offset[i] (8 * i when
 * local_offset is NULL) for length[i] bytes (8 when length is NULL); compare_add/swap are the atomic
 * operands (NULL: 0). All carry wr_id; only the last is signalled. */
struct rdmaio_batch {
    uint64_t wr_id;
    uint64_t local_addr;
    uint32_t lkey;
    uint32_t opcode;
    uint32_t rkey;
    int count;
    const uint64_t *remote_addr;
    const uint32_t *length;
    const uint64_t *local_offset;
    const uint64_t *compare_add;
    const uint64_t *swap;
};

int rdmaio_post_rdma(struct ibv_qp *qp, const struct rdmaio_rdma_op *ops, int count, int *bad_index);
int rdmaio_post_batch(struct ibv_qp *qp, const struct rdmaio_batch *b, int *bad_index);
int rdmaio_query_onesided_caps(struct ibv_context *context, struct rdmaio_onesided_caps *out);
int rdmaio_probe_mw(struct ibv_pd *pd, int type);
int rdmaio_alloc_mw(struct ibv_pd *pd, struct ibv_mw **out);
int rdmaio_post_bind_mw(struct ibv_qp *qp, struct ibv_mw *mw, struct ibv_mr *mr, uint64_t addr,
                        uint64_t length, unsigned int access, uint64_t wr_id, uint32_t *rkey);
int rdmaio_dealloc_mw(struct ibv_mw *mw);
int rdmaio_qp_access(struct ibv_qp *qp, int *access_flags, int *max_rd_atomic, int *max_dest_rd_atomic);

/* ---- a serial one-sided request in one call (onesided.c: rdmaio_onesided_post_poll) -------------------
 * A connection's port: its QP and CQ (NULLed when the QP is destroyed or the process forked), the wr_id
 * base (kind and tag), the inline limit, and room for the one record the call may take from the CQ. */
struct rdmaio_onesided_port {
    struct ibv_qp *qp;
    struct ibv_cq *cq;
    uint64_t wr_base;
    uint32_t max_inline;
    int poll_errno;              /* RDMAIO_POSTED_POLL_FAILED: the poll's errno */
    uint64_t posted;             /* requests posted through the port */
    uint64_t polled;             /* records taken from the CQ */
    struct rdmaio_wc record;     /* RDMAIO_POSTED_OTHER: the record taken (not the request's own success) */
    struct rdmaio_wc_group group; /* ... and its dispatch group (start 0, count 1) */
};
/* Results of rdmaio_onesided_post_poll (a negative value is the post's -errno: nothing was posted). */
#define RDMAIO_POSTED 0              /* posted; the CQ was empty */
#define RDMAIO_POSTED_DONE 1         /* posted; its own successful completion was taken from the CQ */
#define RDMAIO_POSTED_OTHER 2        /* posted; another record was taken: port->record, to dispatch */
#define RDMAIO_POSTED_POLL_FAILED 3  /* posted; the poll failed (port->poll_errno) */
int rdmaio_onesided_post_poll(struct rdmaio_onesided_port *port, uint32_t index, uint64_t local_addr,
                              uint32_t lkey, uint32_t length, uint32_t opcode, uint64_t remote_addr,
                              uint32_t rkey, uint64_t compare_add, uint64_t swap);
int rdmaio_onesided_post_batch_poll(struct rdmaio_onesided_port *port, const struct rdmaio_batch *b);

#endif
