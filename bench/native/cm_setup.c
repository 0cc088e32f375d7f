/*
 * cm_setup: the native floor of the benchmark's "setup" workload.
 *
 * A minimal rdma_cm client/server pair: each connection is rdma_cm connect (resolve address, resolve
 * route, create QP, connect), one 16-byte SEND from client to server (optionally echoed back), and
 * disconnect + destroy, then the next connection; sequential, like the rdmaio setup loop it is compared
 * with (which does not wait for the peer's disconnect reply either).
 *
 *   cm_setup server ADDR PORT            serve connections until killed
 *   cm_setup client ADDR PORT COUNT SECS [echo]
 *                                        COUNT connections, stopping after SECS seconds; with "echo"
 *                                        the server sends the 16 bytes back and the client waits for them
 *
 * The client prints one line: "cm_setup connections N seconds S rate R echo E".
 *
 * Resources that are per device, not per connection, are created once and reused (protection domain,
 * completion channel, CQ, memory region): that is what a careful native program does, and it makes
 * this the floor that per-connection costs are measured against. Waits block in the kernel (event
 * channel and completion channel), no busy polling, like an event loop that sleeps in epoll.
 *
 * Built by the benchmark at run time: gcc -O2 cm_setup.c -lrdmacm -libverbs.
 */
#include <errno.h>
#include <netdb.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <infiniband/verbs.h>
#include <rdma/rdma_cma.h>

#define MSG_SIZE 16
#define CQ_DEPTH 16

static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "cm_setup: ");
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, " (errno %d: %s)\n", errno, strerror(errno));
    va_end(ap);
    exit(1);
}

struct shared {
    struct ibv_context *verbs;
    struct ibv_pd *pd;
    struct ibv_comp_channel *comp;
    struct ibv_cq *cq;
    struct ibv_mr *mr;
    char buf[2 * MSG_SIZE]; /* [0, 16): receive, [16, 32): send */
};

static void shared_init(struct shared *s, struct ibv_context *verbs) {
    if (s->verbs == verbs)
        return;
    if (s->verbs != NULL)
        die("a second device showed up");
    s->verbs = verbs;
    if (!(s->pd = ibv_alloc_pd(verbs)))
        die("ibv_alloc_pd");
    if (!(s->comp = ibv_create_comp_channel(verbs)))
        die("ibv_create_comp_channel");
    if (!(s->cq = ibv_create_cq(verbs, CQ_DEPTH, NULL, s->comp, 0)))
        die("ibv_create_cq");
    if (ibv_req_notify_cq(s->cq, 0))
        die("ibv_req_notify_cq");
    if (!(s->mr = ibv_reg_mr(s->pd, s->buf, sizeof s->buf, IBV_ACCESS_LOCAL_WRITE)))
        die("ibv_reg_mr");
}

static struct rdma_cm_event *expect(struct rdma_event_channel *ch, enum rdma_cm_event_type want) {
    struct rdma_cm_event *ev;
    if (rdma_get_cm_event(ch, &ev))
        die("rdma_get_cm_event");
    if (ev->event != want) {
        errno = ev->status < 0 ? -ev->status : 0;
        die("expected %s, got %s (status %d)", rdma_event_str(want), rdma_event_str(ev->event), ev->status);
    }
    return ev;
}

/* Block until the completions of the `count` work requests in `want` have arrived, in any order.
 * Completions of earlier connections' work requests are skipped whatever their status: the server
 * does not wait for its echo's send completion (see server()), so one may still arrive, successful
 * or not, after that QP is gone. */
static void wait_completions(struct shared *s, const uint64_t *want, int count, const char *what) {
    struct ibv_wc wc;
    int seen = 0;
    while (seen < count) {
        int n = ibv_poll_cq(s->cq, 1, &wc);
        if (n < 0)
            die("ibv_poll_cq");
        if (n == 1) {
            int wanted = 0;
            for (int i = 0; i < count; i++)
                wanted |= wc.wr_id == want[i];
            if (!wanted)
                continue;
            if (wc.status != IBV_WC_SUCCESS) {
                errno = 0;
                die("%s completion: %s", what, ibv_wc_status_str(wc.status));
            }
            seen++;
            continue;
        }
        struct ibv_cq *cq;
        void *ctx;
        if (ibv_get_cq_event(s->comp, &cq, &ctx))
            die("ibv_get_cq_event");
        ibv_ack_cq_events(cq, 1);
        if (ibv_req_notify_cq(cq, 0))
            die("ibv_req_notify_cq");
    }
}

static void wait_completion(struct shared *s, uint64_t want, const char *what) {
    wait_completions(s, &want, 1, what);
}

static void create_qp(struct shared *s, struct rdma_cm_id *id) {
    struct ibv_qp_init_attr attr;
    memset(&attr, 0, sizeof attr);
    attr.send_cq = s->cq;
    attr.recv_cq = s->cq;
    attr.qp_type = IBV_QPT_RC;
    attr.cap.max_send_wr = 2;
    attr.cap.max_recv_wr = 2;
    attr.cap.max_send_sge = 1;
    attr.cap.max_recv_sge = 1;
    if (rdma_create_qp(id, s->pd, &attr))
        die("rdma_create_qp");
}

/* wr_id: (connection number << 1) | 1 for a send, | 0 for a receive. */
static uint64_t recv_id(long conn) { return (uint64_t)conn << 1; }
static uint64_t send_id(long conn) { return ((uint64_t)conn << 1) | 1; }

static void post_recv(struct shared *s, struct rdma_cm_id *id, long conn) {
    struct ibv_sge sge = {(uintptr_t)s->buf, MSG_SIZE, s->mr->lkey};
    struct ibv_recv_wr wr, *bad;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = recv_id(conn);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    if (ibv_post_recv(id->qp, &wr, &bad))
        die("ibv_post_recv");
}

static void post_send(struct shared *s, struct rdma_cm_id *id, long conn) {
    struct ibv_sge sge = {(uintptr_t)(s->buf + MSG_SIZE), MSG_SIZE, s->mr->lkey};
    struct ibv_send_wr wr, *bad;
    memset(&wr, 0, sizeof wr);
    wr.wr_id = send_id(conn);
    wr.sg_list = &sge;
    wr.num_sge = 1;
    wr.opcode = IBV_WR_SEND;
    wr.send_flags = IBV_SEND_SIGNALED;
    if (ibv_post_send(id->qp, &wr, &bad))
        die("ibv_post_send");
}

static struct sockaddr_storage resolve(const char *addr, const char *port) {
    struct addrinfo hints, *res;
    struct sockaddr_storage out;
    memset(&hints, 0, sizeof hints);
    hints.ai_flags = AI_NUMERICHOST;
    hints.ai_socktype = SOCK_STREAM;
    if (getaddrinfo(addr, port, &hints, &res))
        die("bad address %s port %s", addr, port);
    memset(&out, 0, sizeof out);
    memcpy(&out, res->ai_addr, res->ai_addrlen);
    freeaddrinfo(res);
    return out;
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

static int server(const char *addr, const char *port, int echo) {
    struct shared s;
    memset(&s, 0, sizeof s);
    struct sockaddr_storage sa = resolve(addr, port);
    struct rdma_event_channel *ch = rdma_create_event_channel();
    struct rdma_cm_id *listener;
    if (!ch || rdma_create_id(ch, &listener, NULL, RDMA_PS_TCP))
        die("rdma_create_id");
    if (rdma_bind_addr(listener, (struct sockaddr *)&sa) || rdma_listen(listener, 16))
        die("rdma_bind_addr/rdma_listen");
    printf("cm_setup server listening on %s port %s\n", addr, port);
    fflush(stdout);
    for (long conn = 0;; conn++) {
        struct rdma_cm_event *ev = expect(ch, RDMA_CM_EVENT_CONNECT_REQUEST);
        struct rdma_cm_id *id = ev->id;
        rdma_ack_cm_event(ev);
        shared_init(&s, id->verbs);
        create_qp(&s, id);
        post_recv(&s, id, conn);
        struct rdma_conn_param param;
        memset(&param, 0, sizeof param);
        param.responder_resources = 1;
        param.initiator_depth = 1;
        param.rnr_retry_count = 1;
        if (rdma_accept(id, &param))
            die("rdma_accept");
        /* The QP can receive once accepted; the client sends as soon as it is established. */
        wait_completion(&s, recv_id(conn), "receive");
        if (echo) {
            /* Not waiting for this send's completion is deliberate: rxe reports the client's receive
             * before it sends the ACK, and the client destroys its QP as soon as it has the reply, so
             * the ACK can be lost; this send then retries until "transport retry counter exceeded",
             * blocking a server that waits for it for seconds while the next clients' connects time
             * out (REJECTED, status 28). The client has its reply; the QP is destroyed on DISCONNECTED
             * below, and a late completion is skipped by wait_completion. */
            memcpy(s.buf + MSG_SIZE, s.buf, MSG_SIZE);
            post_send(&s, id, conn);
        }
        /* ESTABLISHED normally comes first, but the RTU that triggers it can be overtaken by the data
         * and the client's DREQ (seen under emulation): then only DISCONNECTED comes. */
        for (;;) {
            struct rdma_cm_event *ev2;
            if (rdma_get_cm_event(ch, &ev2))
                die("rdma_get_cm_event");
            enum rdma_cm_event_type type = ev2->event;
            int status = ev2->status;
            rdma_ack_cm_event(ev2);
            if (type == RDMA_CM_EVENT_DISCONNECTED)
                break;
            if (type != RDMA_CM_EVENT_ESTABLISHED && type != RDMA_CM_EVENT_TIMEWAIT_EXIT) {
                errno = 0;
                die("server: unexpected %s (status %d)", rdma_event_str(type), status);
            }
        }
        rdma_destroy_qp(id);
        rdma_destroy_id(id);
    }
    return 0;
}

static int client(const char *addr, const char *port, long count, double secs, int echo) {
    struct shared s;
    memset(&s, 0, sizeof s);
    struct sockaddr_storage sa = resolve(addr, port);
    struct rdma_event_channel *ch = rdma_create_event_channel();
    if (!ch)
        die("rdma_create_event_channel");
    memset(s.buf + MSG_SIZE, 'x', MSG_SIZE);
    double start = 0, end = 0;
    long done = -1; /* the first connection warms up (device opened, PD/CQ/MR created): not counted */
    while (done < count) {
        struct rdma_cm_id *id;
        if (rdma_create_id(ch, &id, NULL, RDMA_PS_TCP))
            die("rdma_create_id");
        if (rdma_resolve_addr(id, NULL, (struct sockaddr *)&sa, 2000))
            die("rdma_resolve_addr");
        rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ADDR_RESOLVED));
        if (rdma_resolve_route(id, 2000))
            die("rdma_resolve_route");
        rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ROUTE_RESOLVED));
        shared_init(&s, id->verbs);
        create_qp(&s, id);
        if (echo)
            post_recv(&s, id, done + 1);
        struct rdma_conn_param param;
        memset(&param, 0, sizeof param);
        param.responder_resources = 1;
        param.initiator_depth = 1;
        param.retry_count = 5;
        param.rnr_retry_count = 1;
        if (rdma_connect(id, &param))
            die("rdma_connect");
        rdma_ack_cm_event(expect(ch, RDMA_CM_EVENT_ESTABLISHED));
        post_send(&s, id, done + 1);
        /* With echo: the send's and the reply's completions, in either order. */
        uint64_t ids[2] = {send_id(done + 1), recv_id(done + 1)};
        wait_completions(&s, ids, echo ? 2 : 1, "send/receive");
        /* Like rdmaio's close: disconnect and destroy at once, without waiting for the peer's DREP
         * (the DISCONNECTED event); the kernel finishes the exchange, and rdma_destroy_id drops the
         * id's events that were not reported yet. */
        if (rdma_disconnect(id))
            die("rdma_disconnect");
        rdma_destroy_qp(id);
        rdma_destroy_id(id);
        done++;
        end = now();
        if (done == 0)
            start = end;
        else if (end - start >= secs)
            break;
    }
    double elapsed = end - start;
    printf("cm_setup connections %ld seconds %.6f rate %.3f echo %d\n", done, elapsed,
           elapsed > 0 ? done / elapsed : 0.0, echo);
    return 0;
}

int main(int argc, char **argv) {
    if (argc >= 4 && strcmp(argv[1], "server") == 0)
        return server(argv[2], argv[3], argc >= 5 && strcmp(argv[4], "echo") == 0);
    if (argc >= 6 && strcmp(argv[1], "client") == 0)
        return client(argv[2], argv[3], atol(argv[4]), atof(argv[5]), argc >= 7 && strcmp(argv[6], "echo") == 0);
    fprintf(stderr, "usage: cm_setup server ADDR PORT [echo] | cm_setup client ADDR PORT COUNT SECS [echo]\n");
    return 2;
}
