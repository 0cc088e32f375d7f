/* rdmaio connection setup: see setup.h. */
#include "setup.h"

#include <errno.h>
#include <string.h>

static int errno_or_eio(void)
{
    return errno ? errno : EIO;
}

int rdmaio_setup_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_cq *send_cq,
                    struct ibv_cq *recv_cq, struct ibv_srq *srq,
                    uint32_t max_send_wr, uint32_t max_recv_wr, uint32_t max_inline, int fit_inline,
                    int ack_timeout, struct ibv_qp_cap *cap_out, int *step_out)
{
    struct ibv_qp_init_attr attr;
    int step_scratch;

    if (!step_out)
        step_out = &step_scratch;
    *step_out = RDMAIO_SETUP_STEP_ARGS;
    if (!id || !pd || !send_cq || !recv_cq || !cap_out)
        return -EINVAL;
    if (ack_timeout != RDMAIO_SETUP_NO_ACK_TIMEOUT &&
        (ack_timeout < 0 || ack_timeout > RDMAIO_SETUP_MAX_ACK_TIMEOUT))
        return -EINVAL;
    cap_out->max_inline_data = max_inline;
    if (ack_timeout != RDMAIO_SETUP_NO_ACK_TIMEOUT) {
        uint8_t exponent = (uint8_t)ack_timeout;

        *step_out = RDMAIO_SETUP_STEP_ACK_TIMEOUT;
        errno = 0;
        if (rdma_set_option(id, RDMA_OPTION_ID, RDMA_OPTION_ID_ACK_TIMEOUT, &exponent, sizeof(exponent)))
            return -errno_or_eio();
    }
    *step_out = RDMAIO_SETUP_STEP_CREATE_QP;
    for (;;) {
        int rc;

        memset(&attr, 0, sizeof(attr));
        attr.send_cq = send_cq;
        attr.recv_cq = recv_cq;
        attr.srq = srq;
        attr.qp_type = IBV_QPT_RC;
        attr.sq_sig_all = 0;
        attr.cap.max_send_wr = max_send_wr;
        attr.cap.max_recv_wr = srq ? 0 : max_recv_wr;
        attr.cap.max_send_sge = 1;
        attr.cap.max_recv_sge = 1;
        attr.cap.max_inline_data = max_inline;
        errno = 0;
        rc = rdma_create_qp(id, pd, &attr);
        if (rc == 0) {
            *cap_out = attr.cap;
            return 0;
        }
        cap_out->max_inline_data = max_inline;
        /* librdmacm returns -1 with errno set; a provider may hand a positive errno through. A provider
         * can also fail without setting errno (libsiw when the kernel hands it a queue key equal to its
         * own invalid-key value): say so instead of making up a reason. */
        if (rc < 0 && errno == 0) {
            *step_out = RDMAIO_SETUP_STEP_CREATE_QP_NO_ERRNO;
            return -EIO;
        }
        rc = rc > 0 ? rc : errno;
        /* Only a refused size (EINVAL) is worth asking again with less inline data: any other reason
         * would be hidden behind the errno of the smaller attempts. */
        if (!fit_inline || max_inline == 0 || rc != EINVAL)
            return -rc;
        max_inline = max_inline > 32 ? max_inline / 2 : 0;
    }
}

static int conn_param(struct rdma_conn_param *param, const uint8_t *private_data, uint32_t len,
                      uint8_t retry_count, uint8_t rnr_retry_count, uint8_t responder_resources,
                      uint8_t initiator_depth)
{
    if (len > RDMAIO_SETUP_MAX_PRIVATE_DATA || (len && !private_data))
        return -EINVAL;
    memset(param, 0, sizeof(*param));
    param->private_data = len ? private_data : NULL;
    param->private_data_len = (uint8_t)len;
    param->responder_resources = responder_resources;
    param->initiator_depth = initiator_depth;
    param->retry_count = retry_count;
    param->rnr_retry_count = rnr_retry_count;
    return 0;
}

int rdmaio_setup_connect(struct rdma_cm_id *id, const uint8_t *private_data, uint32_t len,
                         uint8_t retry_count, uint8_t rnr_retry_count, uint8_t responder_resources,
                         uint8_t initiator_depth)
{
    struct rdma_conn_param param;
    int rc;

    if (!id)
        return -EINVAL;
    rc = conn_param(&param, private_data, len, retry_count, rnr_retry_count, responder_resources,
                    initiator_depth);
    if (rc)
        return rc;
    errno = 0;
    return rdma_connect(id, &param) ? -errno_or_eio() : 0;
}

int rdmaio_setup_accept(struct rdma_cm_id *id, const uint8_t *private_data, uint32_t len,
                        uint8_t rnr_retry_count, uint8_t responder_resources, uint8_t initiator_depth)
{
    struct rdma_conn_param param;
    int rc;

    if (!id)
        return -EINVAL;
    rc = conn_param(&param, private_data, len, 7, rnr_retry_count, responder_resources, initiator_depth);
    if (rc)
        return rc;
    errno = 0;
    return rdma_accept(id, &param) ? -errno_or_eio() : 0;
}
