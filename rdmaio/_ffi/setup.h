/* rdmaio connection setup (setup.c): the verbs steps of setting up one connection that the core makes in
 * one go, each one C call instead of a chain of Python calls around single verbs calls.
 *
 * rdmaio_setup_qp():      the ack timeout option of the cm id, then its RC queue pair (retrying with less
 *                         inline data when the device refuses the size asked);
 * rdmaio_setup_connect(): the connection parameters with the handshake as private data, then rdma_connect;
 * rdmaio_setup_accept():  the same, then rdma_accept.
 *
 * Every function checks its arguments against their bounds (a NULL pointer, private data longer than the
 * 8-bit length field, an ack timeout exponent above 31) and returns -EINVAL without calling the library then;
 * otherwise 0, or -errno of the library call that failed (*step_out says which one for rdmaio_setup_qp).
 * Nothing here calls Python: cffi releases the GIL around every call. */
#ifndef RDMAIO_SETUP_H
#define RDMAIO_SETUP_H

#include <stdint.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

/* Which step of rdmaio_setup_qp() failed (*step_out). */
#define RDMAIO_SETUP_STEP_ARGS 0        /* an argument out of its bound: nothing was called */
#define RDMAIO_SETUP_STEP_ACK_TIMEOUT 1 /* rdma_set_option(RDMA_OPTION_ID_ACK_TIMEOUT) */
#define RDMAIO_SETUP_STEP_CREATE_QP 2   /* rdma_create_qp (with every inline size tried) */
#define RDMAIO_SETUP_STEP_CREATE_QP_NO_ERRNO 3 /* rdma_create_qp failed and left errno 0 (returns -EIO) */

#define RDMAIO_SETUP_NO_ACK_TIMEOUT (-1) /* ack_timeout: leave the cm id's default */
#define RDMAIO_SETUP_MAX_ACK_TIMEOUT 31
#define RDMAIO_SETUP_MAX_PRIVATE_DATA 255 /* rdma_conn_param.private_data_len is 8 bits */

/* Set the ack timeout (4.096 us * 2**ack_timeout; RDMAIO_SETUP_NO_ACK_TIMEOUT: unchanged; rdma_cm applies
 * it at RTS, so before connect/accept), then create the RC queue pair of id on pd, its completions going
 * to send_cq and recv_cq (srq: receives from it, and no receive queue of its own; NULL: max_recv_wr
 * receives), one SGE per work request, sends unsignalled unless asked. When fit_inline is non-zero and
 * the creation fails, it is retried with half the inline data (above 32 bytes) or none, as devices cap
 * inline data differently. On success cap_out holds the capabilities granted; on failure its
 * max_inline_data holds the inline size of the last attempt. Only EINVAL (a refused size) is retried: any
 * other errno is returned at once, and a failure that left errno 0 returns -EIO with *step_out
 * RDMAIO_SETUP_STEP_CREATE_QP_NO_ERRNO. */
int rdmaio_setup_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_cq *send_cq,
                    struct ibv_cq *recv_cq, struct ibv_srq *srq,
                    uint32_t max_send_wr, uint32_t max_recv_wr, uint32_t max_inline, int fit_inline,
                    int ack_timeout, struct ibv_qp_cap *cap_out, int *step_out);

/* rdma_connect with private_data[0..len) and the given connection parameters. */
int rdmaio_setup_connect(struct rdma_cm_id *id, const uint8_t *private_data, uint32_t len,
                         uint8_t retry_count, uint8_t rnr_retry_count, uint8_t responder_resources,
                         uint8_t initiator_depth);

/* rdma_accept with private_data[0..len) and the given connection parameters (retry_count 7, which the
 * passive side ignores). */
int rdmaio_setup_accept(struct rdma_cm_id *id, const uint8_t *private_data, uint32_t len,
                        uint8_t rnr_retry_count, uint8_t responder_resources, uint8_t initiator_depth);

#endif
