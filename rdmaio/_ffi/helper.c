/* rdmaio C helper; see helper.h. Return convention: >= 0 success/count, -errno on failure. */
#include <arpa/inet.h>
#include <errno.h>
#include <string.h>
#include <netinet/in.h>

#include "helper.h"

/* Completions are pulled from the CQ this many at a time (stack buffer). */
#define RDMAIO_POLL_CHUNK 32

static void copy_wc(struct rdmaio_wc *dst, const struct ibv_wc *src)
{
    dst->wr_id = src->wr_id;
    dst->status = src->status;
    dst->opcode = src->opcode;
    dst->byte_len = src->byte_len;
    dst->imm_data = (src->wc_flags & IBV_WC_WITH_IMM) ? ntohl(src->imm_data) : 0;
    dst->flags = src->wc_flags;
    dst->vendor_err = src->vendor_err;
    dst->qp_num = src->qp_num;
}

int rdmaio_poll_cq(struct ibv_cq *cq, struct rdmaio_wc *out, int max_wc)
{
    struct ibv_wc wc[RDMAIO_POLL_CHUNK];
    int total = 0;

    while (total < max_wc) {
        int want = max_wc - total;
        if (want > RDMAIO_POLL_CHUNK)
            want = RDMAIO_POLL_CHUNK;
        int n = ibv_poll_cq(cq, want, wc);
        if (n < 0)
            return total ? total : -EIO;
        for (int i = 0; i < n; i++)
            copy_wc(&out[total + i], &wc[i]);
        total += n;
        if (n < want)
            break; /* CQ is empty */
    }
    return total;
}

/*
 * Drain a CQ whose notifications arrive on a (non-blocking) completion channel:
 *   1. read every pending channel event, 2. ack them in one call, 3. re-arm, 4. poll until empty.
 * Re-arming before the final poll is what makes a completion that lands in between raise a new
 * event instead of being lost. When out[] fills up (return == max_wc) the CQ may hold more: the
 * caller calls again; without new events the CQ stays armed and the poll continues where it left.
 * *events_out receives the number of channel events consumed (0 on a spurious or repeat call).
 */
int rdmaio_drain_cq(struct ibv_comp_channel *channel, struct ibv_cq *cq,
                    struct rdmaio_wc *out, int max_wc, unsigned int *events_out)
{
    unsigned int events = 0;
    struct ibv_cq *ev_cq;
    void *ev_ctx;

    int err = 0;

    errno = 0;
    while (ibv_get_cq_event(channel, &ev_cq, &ev_ctx) == 0) {
        if (ev_cq != cq) {
            /* Not ours (the channel is meant to serve one CQ): ack it on its own CQ. */
            ibv_ack_cq_events(ev_cq, 1);
            continue;
        }
        events++;
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != 0)
        err = errno;
    /* Ack what was read even when the last read failed: ibv_destroy_cq() waits for every event
     * to be acked, so an unacked one would block the loop thread when the CQ is destroyed. */
    if (events)
        ibv_ack_cq_events(cq, events);
    if (err) {
        if (events_out)
            *events_out = events;
        return -err;
    }
    if (events) {
        int rc = ibv_req_notify_cq(cq, 0);
        if (rc)
            return rdmaio_neg_errno(rc);
    }
    if (events_out)
        *events_out = events;
    return rdmaio_poll_cq(cq, out, max_wc);
}

/*
 * One wake-up of a completion channel that serves many CQs (a Domain's pool):
 *   1. read every pending channel event, counting them per CQ,
 *   2. ack each CQ's events in one call (ibv_destroy_cq() waits until every event read is acked, so an
 *      event is acked even when a later read fails),
 *   3. re-arm each CQ that fired, before the caller polls it: a completion that lands after the poll then
 *      raises a new event instead of being lost.
 * fired[] receives each CQ that fired, once, in the order of its first event. Returns how many distinct
 * CQs fired; a value above max_fired means that the ones beyond it were acked and re-armed but not
 * listed (the caller must then poll every CQ). *events_out: events read. *err_out: 0, or the errno of a
 * failed read (other than EAGAIN) or re-arm; what was read before it is acked and listed all the same.
 */
int rdmaio_drain_channel(struct ibv_comp_channel *channel, struct ibv_cq **fired, int max_fired,
                         unsigned int *events_out, int *err_out)
{
    unsigned int counts[64];
    unsigned int events = 0;
    int distinct = 0, err = 0;
    struct ibv_cq *ev_cq;
    void *ev_ctx;

    /* The per-CQ counters live on the stack: at most 64 CQs are counted, the rest are acked one by one. */
    if (max_fired > 64)
        max_fired = 64;
    if (max_fired < 0)
        max_fired = 0;
    errno = 0;
    while (ibv_get_cq_event(channel, &ev_cq, &ev_ctx) == 0) {
        events++;
        int i;
        for (i = 0; i < distinct && i < max_fired; i++)
            if (fired[i] == ev_cq)
                break;
        if (i < distinct && i < max_fired) {
            counts[i]++;
            continue;
        }
        if (distinct < max_fired) {
            fired[distinct] = ev_cq;
            counts[distinct] = 1;
            distinct++;
            continue;
        }
        /* Not listed (no room): ack and re-arm at once; the caller learns it must poll everything. */
        ibv_ack_cq_events(ev_cq, 1);
        int rc = ibv_req_notify_cq(ev_cq, 0);
        if (rc && !err)
            err = -rdmaio_neg_errno(rc);
        if (distinct == max_fired)
            distinct++; /* report "more than max_fired" once */
    }
    if (errno != EAGAIN && errno != EWOULDBLOCK && errno != 0 && !err)
        err = errno;
    int listed = distinct < max_fired ? distinct : max_fired;
    for (int i = 0; i < listed; i++)
        ibv_ack_cq_events(fired[i], counts[i]);
    for (int i = 0; i < listed; i++) {
        int rc = ibv_req_notify_cq(fired[i], 0);
        if (rc && !err)
            err = -rdmaio_neg_errno(rc);
    }
    if (events_out)
        *events_out = events;
    if (err_out)
        *err_out = err;
    return distinct;
}

static inline uint64_t wc_key(const struct rdmaio_wc *wc)
{
    return ((uint64_t)wc->qp_num << RDMAIO_KEY_TAG_BITS) |
           ((wc->wr_id >> RDMAIO_WR_TAG_SHIFT) & RDMAIO_WR_TAG_MASK);
}

/*
 * Poll up to max_wc completions (into scratch[]) and write them to out[] grouped by dispatch key
 * ((qp_num << 24) | tag of the wr_id): groups[g] names a run out[start .. start + count) of one key.
 * The grouping is stable: within a key the records keep their CQ order (an RC queue completes in
 * order, and the send engine frees its slots relying on it); groups come in the order of their first
 * record. Returns the number of records (max_wc means the CQ may hold more: call again), or -errno
 * (-EINVAL when max_wc exceeds RDMAIO_MAX_POLL). *ngroups_out receives the number of groups.
 */
int rdmaio_poll_grouped(struct ibv_cq *cq, struct rdmaio_wc *scratch, struct rdmaio_wc *out, int max_wc,
                        struct rdmaio_wc_group *groups, int *ngroups_out)
{
    /* Open addressing, load <= 1/2: slot -> group index + 1 (0 = empty). */
    uint16_t table[2 * RDMAIO_MAX_POLL];
    const unsigned int mask = 2 * RDMAIO_MAX_POLL - 1;
    int ngroups = 0;

    *ngroups_out = 0;
    if (max_wc < 0 || max_wc > RDMAIO_MAX_POLL)
        return -EINVAL;
    int n = rdmaio_poll_cq(cq, scratch, max_wc);
    if (n <= 0)
        return n;
    memset(table, 0, sizeof(table));
    /* pass 1: find each record's group, count the members */
    for (int i = 0; i < n; i++) {
        uint64_t key = wc_key(&scratch[i]);
        unsigned int h = (unsigned int)((key * 0x9E3779B97F4A7C15ull) >> 40) & mask;
        while (table[h] && groups[table[h] - 1].key != key)
            h = (h + 1) & mask;
        if (!table[h]) {
            groups[ngroups].key = key;
            groups[ngroups].count = 0;
            table[h] = (uint16_t)(++ngroups);
        }
        groups[table[h] - 1].count++;
    }
    /* starts in order of first appearance; count is reset and refilled by pass 2 */
    uint32_t start = 0;
    for (int g = 0; g < ngroups; g++) {
        groups[g].start = start;
        start += groups[g].count;
        groups[g].count = 0;
    }
    /* pass 2: scatter, keeping CQ order within a group */
    for (int i = 0; i < n; i++) {
        uint64_t key = wc_key(&scratch[i]);
        unsigned int h = (unsigned int)((key * 0x9E3779B97F4A7C15ull) >> 40) & mask;
        while (groups[table[h] - 1].key != key)
            h = (h + 1) & mask;
        struct rdmaio_wc_group *grp = &groups[table[h] - 1];
        out[grp->start + grp->count++] = scratch[i];
    }
    *ngroups_out = ngroups;
    return n;
}

int rdmaio_req_notify(struct ibv_cq *cq)
{
    int rc = ibv_req_notify_cq(cq, 0);
    return rc ? rdmaio_neg_errno(rc) : 0;
}

/* Post `count` receives in one chained ibv_post_recv: slot i covers base + slots[i] * slot_size, and
 * its wr_id is wr_id_base | slots[i] (wr_id_base carries the kind and the connection tag, see
 * helper.h), so a completion names the connection and the slot it filled. The local key is
 * lkeys[slot] when lkeys is given (a ring registered chunk by chunk), else lkey. */
/* Post receives on a QP's own receive queue, or (qp NULL) on the shared receive queue srq. */
static int post_recvs_to(struct ibv_qp *qp, struct ibv_srq *srq, const uint32_t *lkeys, uint32_t lkey,
                         uint64_t base, uint32_t slot_size, uint64_t wr_id_base, const uint32_t *slots,
                         int count)
{
    struct ibv_recv_wr wr[64];
    struct ibv_sge sge[64];
    struct ibv_recv_wr *bad;
    int done = 0;

    while (done < count) {
        int n = count - done;
        if (n > 64)
            n = 64;
        for (int i = 0; i < n; i++) {
            uint32_t slot = slots[done + i];
            sge[i].addr = base + (uint64_t)slot * slot_size;
            sge[i].length = slot_size;
            sge[i].lkey = lkeys ? lkeys[slot] : lkey;
            wr[i].wr_id = wr_id_base | slot;
            wr[i].sg_list = &sge[i];
            wr[i].num_sge = 1;
            wr[i].next = (i + 1 < n) ? &wr[i + 1] : NULL;
        }
        int rc = qp ? ibv_post_recv(qp, wr, &bad) : ibv_post_srq_recv(srq, wr, &bad);
        if (rc)
            return rdmaio_neg_errno(rc);
        done += n;
    }
    return done;
}

static int post_recvs(struct ibv_qp *qp, const uint32_t *lkeys, uint32_t lkey, uint64_t base,
                      uint32_t slot_size, uint64_t wr_id_base, const uint32_t *slots, int count)
{
    return post_recvs_to(qp, NULL, lkeys, lkey, base, slot_size, wr_id_base, slots, count);
}

/* Shared receive queue: one receive per slot of a ring registered chunk by chunk
 * (lkeys[slot]); ibv_post_srq_recv is static inline in verbs.h, hence this wrapper. */
int rdmaio_post_srq_recv_ring(struct ibv_srq *srq, const uint32_t *lkeys, uint64_t base,
                              uint32_t slot_size, uint64_t wr_id_base, const uint32_t *slots, int count)
{
    return post_recvs_to(NULL, srq, lkeys, 0, base, slot_size, wr_id_base, slots, count);
}

int rdmaio_post_recv_slots(struct ibv_qp *qp, uint32_t lkey, uint64_t base, uint32_t slot_size,
                           uint64_t wr_id_base, const uint32_t *slots, int count)
{
    return post_recvs(qp, NULL, lkey, base, slot_size, wr_id_base, slots, count);
}

int rdmaio_post_recv_ring(struct ibv_qp *qp, const uint32_t *lkeys, uint64_t base, uint32_t slot_size,
                          uint64_t wr_id_base, const uint32_t *slots, int count)
{
    return post_recvs(qp, lkeys, 0, base, slot_size, wr_id_base, slots, count);
}

/* Post `count` work requests on `qp` in chains of at most POST_BATCH, each built by `fill` from the
 * caller's array. Returns the number posted, or -errno with *bad_index = the first request not posted.
 * The send and one-sided paths share it; only how a request is filled differs. */
#define POST_BATCH 64
typedef void (*fill_wr_fn)(const void *requests, int index, struct ibv_send_wr *wr, struct ibv_sge *sge);

static int post_chains(struct ibv_qp *qp, const void *requests, int count, int *bad_index, fill_wr_fn fill)
{
    struct ibv_send_wr wr[POST_BATCH];
    struct ibv_sge sge[POST_BATCH];
    struct ibv_send_wr *bad = NULL;
    int done = 0;

    *bad_index = -1;
    while (done < count) {
        int n = count - done;
        if (n > POST_BATCH)
            n = POST_BATCH;
        memset(wr, 0, sizeof(wr[0]) * n);
        for (int i = 0; i < n; i++) {
            fill(requests, done + i, &wr[i], &sge[i]);
            wr[i].sg_list = &sge[i];
            wr[i].num_sge = sge[i].length ? 1 : 0;
            wr[i].next = (i + 1 < n) ? &wr[i + 1] : NULL;
        }
        int rc = ibv_post_send(qp, wr, &bad);
        if (rc) {
            *bad_index = done + (bad ? (int)(bad - wr) : 0);
            return rdmaio_neg_errno(rc);
        }
        done += n;
    }
    return done;
}

static void fill_send(const void *requests, int index, struct ibv_send_wr *wr, struct ibv_sge *sge)
{
    const struct rdmaio_send *s = (const struct rdmaio_send *)requests + index;
    sge->addr = s->addr;
    sge->length = s->length;
    sge->lkey = s->lkey;
    wr->wr_id = s->wr_id;
    wr->opcode = s->opcode;
    wr->send_flags = s->send_flags;
    wr->imm_data = htonl(s->imm_data);
    wr->wr.rdma.remote_addr = s->remote_addr;
    wr->wr.rdma.rkey = s->rkey;
}

int rdmaio_post_sends(struct ibv_qp *qp, const struct rdmaio_send *sends, int count, int *bad_index)
{
    return post_chains(qp, sends, count, bad_index, fill_send);
}

/* Fetch one CM event (channel fd must be non-blocking), copy what we need, ack it.
 * The ack frees the event and its private data, which is why the copy happens here. */
int rdmaio_get_cm_event(struct rdma_event_channel *channel, struct rdmaio_cm_event *out)
{
    struct rdma_cm_event *ev;

    if (rdma_get_cm_event(channel, &ev))
        return -errno;
    memset(out, 0, sizeof(*out));
    out->event = ev->event;
    out->status = ev->status;
    out->id = ev->id;
    out->listen_id = ev->listen_id;
    if (ev->event == RDMA_CM_EVENT_CONNECT_REQUEST || ev->event == RDMA_CM_EVENT_ESTABLISHED ||
        ev->event == RDMA_CM_EVENT_REJECTED || ev->event == RDMA_CM_EVENT_CONNECT_RESPONSE) {
        const struct rdma_conn_param *p = &ev->param.conn;
        out->qp_num = p->qp_num;
        out->responder_resources = p->responder_resources;
        out->initiator_depth = p->initiator_depth;
        out->retry_count = p->retry_count;
        out->rnr_retry_count = p->rnr_retry_count;
        out->srq = p->srq;
        if (p->private_data && p->private_data_len) {
            out->private_data_len = p->private_data_len;
            memcpy(out->private_data, p->private_data, p->private_data_len);
        }
    }
    return rdma_ack_cm_event(ev) ? -errno : 0;
}

/* Fetch and ack one device async event (async_fd must be non-blocking). element is the QP
 * number for QP events, the port number for port events, 0 otherwise; object is the address of
 * the QP, CQ or SRQ the event is about (0 for port and device events), so that a CQ error can be
 * routed to the connections of that CQ only. */
int rdmaio_get_async_event(struct ibv_context *context, int *event_type, uint32_t *element,
                           uintptr_t *object)
{
    struct ibv_async_event ev;

    if (ibv_get_async_event(context, &ev))
        return -errno;
    *event_type = ev.event_type;
    *object = 0;
    switch (ev.event_type) {
    case IBV_EVENT_QP_FATAL:
    case IBV_EVENT_QP_REQ_ERR:
    case IBV_EVENT_QP_ACCESS_ERR:
    case IBV_EVENT_COMM_EST:
    case IBV_EVENT_SQ_DRAINED:
    case IBV_EVENT_PATH_MIG:
    case IBV_EVENT_PATH_MIG_ERR:
    case IBV_EVENT_QP_LAST_WQE_REACHED:
        *element = ev.element.qp ? ev.element.qp->qp_num : 0;
        *object = (uintptr_t)ev.element.qp;
        break;
    case IBV_EVENT_CQ_ERR:
        *element = 0;
        *object = (uintptr_t)ev.element.cq;
        break;
    case IBV_EVENT_SRQ_ERR:
    case IBV_EVENT_SRQ_LIMIT_REACHED:
        *element = 0;
        *object = (uintptr_t)ev.element.srq;
        break;
    case IBV_EVENT_PORT_ACTIVE:
    case IBV_EVENT_PORT_ERR:
    case IBV_EVENT_LID_CHANGE:
    case IBV_EVENT_PKEY_CHANGE:
    case IBV_EVENT_SM_CHANGE:
    case IBV_EVENT_CLIENT_REREGISTER:
    case IBV_EVENT_GID_CHANGE:
        *element = (uint32_t)ev.element.port_num;
        break;
    default:
        *element = 0;
    }
    ibv_ack_async_event(&ev);
    return 0;
}

int rdmaio_sockaddr_from_string(const char *ip, uint16_t port, struct sockaddr_storage *out)
{
    memset(out, 0, sizeof(*out));
    struct sockaddr_in *in4 = (struct sockaddr_in *)out;
    struct sockaddr_in6 *in6 = (struct sockaddr_in6 *)out;
    if (inet_pton(AF_INET, ip, &in4->sin_addr) == 1) {
        in4->sin_family = AF_INET;
        in4->sin_port = htons(port);
        return (int)sizeof(*in4);
    }
    if (inet_pton(AF_INET6, ip, &in6->sin6_addr) == 1) {
        in6->sin6_family = AF_INET6;
        in6->sin6_port = htons(port);
        return (int)sizeof(*in6);
    }
    return -EINVAL;
}

int rdmaio_sockaddr_to_string(const struct sockaddr *addr, char *buf, int buflen, uint16_t *port)
{
    if (!addr)
        return -EINVAL;
    if (addr->sa_family == AF_INET) {
        const struct sockaddr_in *in4 = (const struct sockaddr_in *)addr;
        if (!inet_ntop(AF_INET, &in4->sin_addr, buf, (socklen_t)buflen))
            return -errno;
        *port = ntohs(in4->sin_port);
        return AF_INET;
    }
    if (addr->sa_family == AF_INET6) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)addr;
        if (!inet_ntop(AF_INET6, &in6->sin6_addr, buf, (socklen_t)buflen))
            return -errno;
        *port = ntohs(in6->sin6_port);
        return AF_INET6;
    }
    return -EAFNOSUPPORT;
}

/* ---- one-sided operations ----------------------------------------------------------------------- */

static void fill_rdma(const void *requests, int index, struct ibv_send_wr *wr, struct ibv_sge *sge)
{
    const struct rdmaio_rdma_op *o = (const struct rdmaio_rdma_op *)requests + index;
    sge->addr = o->local_addr;
    sge->length = o->length;
    sge->lkey = o->lkey;
    wr->wr_id = o->wr_id;
    wr->opcode = o->opcode;
    wr->send_flags = o->send_flags;
    if (o->opcode == IBV_WR_ATOMIC_FETCH_AND_ADD || o->opcode == IBV_WR_ATOMIC_CMP_AND_SWP) {
        wr->wr.atomic.remote_addr = o->remote_addr;
        wr->wr.atomic.rkey = o->rkey;
        wr->wr.atomic.compare_add = o->compare_add;
        wr->wr.atomic.swap = o->swap;
    } else {
        wr->wr.rdma.remote_addr = o->remote_addr;
        wr->wr.rdma.rkey = o->rkey;
        if (o->opcode == IBV_WR_RDMA_WRITE_WITH_IMM)
            wr->imm_data = htonl(o->imm_data);
    }
}

/* Post `count` one-sided requests in chains. On failure *bad_index is the first request not posted. */
int rdmaio_post_rdma(struct ibv_qp *qp, const struct rdmaio_rdma_op *ops, int count, int *bad_index)
{
    return post_chains(qp, ops, count, bad_index, fill_rdma);
}

/* Request `index` of a batch: the same opcode, keys and wr_id for all; its own remote address, length,
 * local offset and atomic operands; only the last is signalled (RC completes a send queue in order, so
 * the last one's success means all succeeded; a failed one completes with an error of its own). */
static void fill_batch(const void *requests, int index, struct ibv_send_wr *wr, struct ibv_sge *sge)
{
    const struct rdmaio_batch *b = (const struct rdmaio_batch *)requests;
    uint32_t length = b->length ? b->length[index] : 8;
    sge->addr = b->local_addr + (b->local_offset ? b->local_offset[index] : 8 * (uint64_t)index);
    sge->length = length;
    sge->lkey = b->lkey;
    wr->wr_id = b->wr_id;
    wr->opcode = b->opcode;
    wr->send_flags = index == b->count - 1 ? IBV_SEND_SIGNALED : 0;
    if (b->opcode == IBV_WR_ATOMIC_FETCH_AND_ADD || b->opcode == IBV_WR_ATOMIC_CMP_AND_SWP) {
        wr->wr.atomic.remote_addr = b->remote_addr[index];
        wr->wr.atomic.rkey = b->rkey;
        wr->wr.atomic.compare_add = b->compare_add ? b->compare_add[index] : 0;
        wr->wr.atomic.swap = b->swap ? b->swap[index] : 0;
    } else {
        wr->wr.rdma.remote_addr = b->remote_addr[index];
        wr->wr.rdma.rkey = b->rkey;
    }
}

/* Post the `b->count` requests of one batch (see struct rdmaio_batch) in chains. Returns the number
 * posted or -errno with *bad_index the first request not posted. */
int rdmaio_post_batch(struct ibv_qp *qp, const struct rdmaio_batch *b, int *bad_index)
{
    if (b->count < 1 || !b->remote_addr)
        return -EINVAL;
    return post_chains(qp, b, b->count, bad_index, fill_batch);
}

/* ---- memory windows: grants scoped to one connection ------------------------------------------------
 * A type 2 window is bound by a work request on one QP and its rkey then works through that QP only
 * (rdmaio.verbs.MemoryWindow). ibv_alloc_mw, ibv_dealloc_mw and ibv_post_send are static inline in
 * verbs.h, hence these wrappers (they also let tests/unit/test_helper_c.py drive them with fake ops). */

/* Allocate a type 2 window in `pd`: 0 and *out, or -errno (EOPNOTSUPP when the provider has none). */
int rdmaio_alloc_mw(struct ibv_pd *pd, struct ibv_mw **out)
{
    errno = 0;
    struct ibv_mw *mw = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
    if (!mw)
        return -(errno ? errno : EOPNOTSUPP);
    *out = mw;
    return 0;
}

/* Post one signalled IBV_WR_BIND_MW on `qp` binding `mw` to [addr, addr + length) of `mr` (registered
 * with IBV_ACCESS_MW_BIND) with `access` (IBV_ACCESS_REMOTE_*), wr_id `wr_id`. The window gets a fresh
 * key (a type 2 window's low byte is the consumer's): *rkey is the one the peer must use, valid from the
 * moment the NIC executes the bind, in send-queue order. 0 or -errno (the provider's, never EIO). */
int rdmaio_post_bind_mw(struct ibv_qp *qp, struct ibv_mw *mw, struct ibv_mr *mr, uint64_t addr,
                        uint64_t length, unsigned int access, uint64_t wr_id, uint32_t *rkey)
{
    struct ibv_send_wr wr, *bad = NULL;
    memset(&wr, 0, sizeof(wr));
    wr.wr_id = wr_id;
    wr.opcode = IBV_WR_BIND_MW;
    wr.send_flags = IBV_SEND_SIGNALED;
    wr.bind_mw.mw = mw;
    wr.bind_mw.rkey = ibv_inc_rkey(mw->rkey);
    wr.bind_mw.bind_info.mr = mr;
    wr.bind_mw.bind_info.addr = addr;
    wr.bind_mw.bind_info.length = length;
    wr.bind_mw.bind_info.mw_access_flags = access;
    int rc = ibv_post_send(qp, &wr, &bad);
    if (rc)
        return rdmaio_neg_errno(rc);
    *rkey = wr.bind_mw.rkey;
    return 0;
}

/* Free a window (it is invalidated at once: the NIC refuses its rkey from then on). 0 or -errno. */
int rdmaio_dealloc_mw(struct ibv_mw *mw)
{
    int rc = ibv_dealloc_mw(mw);
    return rc ? rdmaio_neg_errno(rc) : 0;
}
