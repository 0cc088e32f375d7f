/* cffi declarations (API mode: "..." lets the compiler fill in layouts and values). Only the subset
 * of librdmacm/libibverbs that rdmaio uses is declared; see rdma_cm(7), ibv_create_cq(3) etc. */

typedef int... socklen_t;
typedef int... sa_family_t;
struct sockaddr { sa_family_t sa_family; ...; };
struct sockaddr_storage { sa_family_t ss_family; ...; };
#define AF_INET ...
#define AF_INET6 ...

/* ---- libibverbs ---------------------------------------------------------------------------- */
struct ibv_device { ...; };
struct ibv_context { struct ibv_device *device; int cmd_fd; int async_fd; int num_comp_vectors; ...; };
struct ibv_pd { struct ibv_context *context; uint32_t handle; ...; };
struct ibv_mr { struct ibv_context *context; struct ibv_pd *pd; void *addr; size_t length;
                uint32_t handle; uint32_t lkey; uint32_t rkey; ...; };
struct ibv_comp_channel { struct ibv_context *context; int fd; int refcnt; ...; };
struct ibv_cq { struct ibv_context *context; struct ibv_comp_channel *channel; void *cq_context;
                int cqe; ...; };
struct ibv_srq { ...; };
struct ibv_qp { struct ibv_context *context; void *qp_context; struct ibv_pd *pd;
                struct ibv_cq *send_cq; struct ibv_cq *recv_cq; uint32_t handle; uint32_t qp_num;
                int state; int qp_type; ...; };

enum ibv_qp_type { IBV_QPT_RC, IBV_QPT_UC, IBV_QPT_UD, ... };
struct ibv_qp_cap { uint32_t max_send_wr; uint32_t max_recv_wr; uint32_t max_send_sge;
                    uint32_t max_recv_sge; uint32_t max_inline_data; };
struct ibv_qp_init_attr { void *qp_context; struct ibv_cq *send_cq; struct ibv_cq *recv_cq;
                          struct ibv_srq *srq; struct ibv_qp_cap cap; enum ibv_qp_type qp_type;
                          int sq_sig_all; ...; };
struct ibv_qp_attr { int qp_state; int cur_qp_state; int path_mtu; uint32_t qp_access_flags;
                     struct ibv_qp_cap cap; uint8_t timeout; uint8_t retry_cnt; uint8_t rnr_retry;
                     uint8_t min_rnr_timer; uint8_t max_rd_atomic; uint8_t max_dest_rd_atomic; ...; };
#define IBV_QP_STATE ...
#define IBV_QP_CAP ...
#define IBV_QP_PATH_MTU ...
#define IBV_QP_TIMEOUT ...
#define IBV_QP_RETRY_CNT ...
#define IBV_QP_RNR_RETRY ...
#define IBV_QPS_ERR ...
#define IBV_QPS_RTS ...
int ibv_query_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask,
                 struct ibv_qp_init_attr *init_attr);
int ibv_modify_qp(struct ibv_qp *qp, struct ibv_qp_attr *attr, int attr_mask);

/* shared receive queues (rdmaio/verbs/srq.py) */
struct ibv_srq_attr { uint32_t max_wr; uint32_t max_sge; uint32_t srq_limit; };
struct ibv_srq_init_attr { void *srq_context; struct ibv_srq_attr attr; };
#define IBV_SRQ_MAX_WR ...
#define IBV_SRQ_LIMIT ...
struct ibv_srq *ibv_create_srq(struct ibv_pd *pd, struct ibv_srq_init_attr *srq_init_attr);
int ibv_modify_srq(struct ibv_srq *srq, struct ibv_srq_attr *srq_attr, int srq_attr_mask);
int ibv_query_srq(struct ibv_srq *srq, struct ibv_srq_attr *srq_attr);
int ibv_destroy_srq(struct ibv_srq *srq);

struct ibv_device_attr { char fw_ver[64]; uint64_t max_mr_size; uint32_t vendor_id;
                         uint32_t vendor_part_id; int max_qp; int max_qp_wr; int max_sge; int max_cq;
                         int max_cqe; int max_mr; int max_pd; int max_srq; int max_srq_wr;
                         int max_srq_sge; uint8_t phys_port_cnt; ...; };
struct ibv_port_attr { int state; int max_mtu; int active_mtu; int gid_tbl_len; uint32_t max_msg_sz;
                       uint8_t link_layer; uint8_t active_width; uint8_t active_speed; ...; };
#define IBV_PORT_ACTIVE ...
#define IBV_LINK_LAYER_ETHERNET ...
#define IBV_LINK_LAYER_INFINIBAND ...

struct ibv_device **ibv_get_device_list(int *num_devices);
void ibv_free_device_list(struct ibv_device **list);
const char *ibv_get_device_name(struct ibv_device *device);
struct ibv_context *ibv_open_device(struct ibv_device *device);
int ibv_close_device(struct ibv_context *context);
int ibv_query_device(struct ibv_context *context, struct ibv_device_attr *device_attr);
int ibv_query_port(struct ibv_context *context, uint8_t port_num, struct ibv_port_attr *port_attr);

struct ibv_pd *ibv_alloc_pd(struct ibv_context *context);
int ibv_dealloc_pd(struct ibv_pd *pd);

enum ibv_access_flags { IBV_ACCESS_LOCAL_WRITE, IBV_ACCESS_REMOTE_WRITE, IBV_ACCESS_REMOTE_READ, ... };
struct ibv_mr *ibv_reg_mr(struct ibv_pd *pd, void *addr, size_t length, int access);
int ibv_dereg_mr(struct ibv_mr *mr);

struct ibv_comp_channel *ibv_create_comp_channel(struct ibv_context *context);
int ibv_destroy_comp_channel(struct ibv_comp_channel *channel);
struct ibv_cq *ibv_create_cq(struct ibv_context *context, int cqe, void *cq_context,
                             struct ibv_comp_channel *channel, int comp_vector);
int ibv_destroy_cq(struct ibv_cq *cq);
int ibv_get_cq_event(struct ibv_comp_channel *channel, struct ibv_cq **cq, void **cq_context);
void ibv_ack_cq_events(struct ibv_cq *cq, unsigned int nevents);
int ibv_req_notify_cq(struct ibv_cq *cq, int solicited_only);   /* static inline: API mode only */

enum ibv_wc_status { IBV_WC_SUCCESS, IBV_WC_LOC_LEN_ERR, IBV_WC_LOC_QP_OP_ERR, IBV_WC_LOC_PROT_ERR,
                     IBV_WC_WR_FLUSH_ERR, IBV_WC_RNR_RETRY_EXC_ERR, IBV_WC_RETRY_EXC_ERR,
                     IBV_WC_REM_ACCESS_ERR, IBV_WC_REM_OP_ERR, IBV_WC_REM_INV_REQ_ERR, ... };
enum ibv_wc_opcode { IBV_WC_SEND, IBV_WC_RDMA_WRITE, IBV_WC_RDMA_READ, IBV_WC_RECV,
                     IBV_WC_RECV_RDMA_WITH_IMM, ... };
enum ibv_wc_flags { IBV_WC_WITH_IMM, ... };
struct ibv_wc { uint64_t wr_id; enum ibv_wc_status status; enum ibv_wc_opcode opcode;
                uint32_t vendor_err; uint32_t byte_len; uint32_t imm_data; uint32_t qp_num;
                unsigned int wc_flags; ...; };
int ibv_poll_cq(struct ibv_cq *cq, int num_entries, struct ibv_wc *wc);   /* static inline */
const char *ibv_wc_status_str(enum ibv_wc_status status);

enum ibv_wr_opcode { IBV_WR_RDMA_WRITE, IBV_WR_RDMA_WRITE_WITH_IMM, IBV_WR_SEND,
                     IBV_WR_SEND_WITH_IMM, IBV_WR_RDMA_READ, ... };
enum ibv_send_flags { IBV_SEND_FENCE, IBV_SEND_SIGNALED, IBV_SEND_SOLICITED, IBV_SEND_INLINE, ... };
struct ibv_sge { uint64_t addr; uint32_t length; uint32_t lkey; };
struct ibv_recv_wr { uint64_t wr_id; struct ibv_recv_wr *next; struct ibv_sge *sg_list; int num_sge; };
struct ibv_send_wr { uint64_t wr_id; struct ibv_send_wr *next; struct ibv_sge *sg_list; int num_sge;
                     enum ibv_wr_opcode opcode; unsigned int send_flags; uint32_t imm_data; ...; };
int ibv_post_send(struct ibv_qp *qp, struct ibv_send_wr *wr, struct ibv_send_wr **bad_wr);  /* inline */
int ibv_post_recv(struct ibv_qp *qp, struct ibv_recv_wr *wr, struct ibv_recv_wr **bad_wr);  /* inline */

enum ibv_event_type { IBV_EVENT_CQ_ERR, IBV_EVENT_QP_FATAL, IBV_EVENT_QP_REQ_ERR,
                      IBV_EVENT_QP_ACCESS_ERR, IBV_EVENT_COMM_EST, IBV_EVENT_PORT_ACTIVE,
                      IBV_EVENT_PORT_ERR, IBV_EVENT_DEVICE_FATAL, IBV_EVENT_SRQ_ERR,
                      IBV_EVENT_SRQ_LIMIT_REACHED, IBV_EVENT_QP_LAST_WQE_REACHED, ... };
const char *ibv_event_type_str(enum ibv_event_type event);

/* ---- librdmacm ------------------------------------------------------------------------------ */
struct rdma_event_channel { int fd; ...; };
enum rdma_port_space { RDMA_PS_TCP, RDMA_PS_UDP, RDMA_PS_IB, ... };
struct rdma_cm_id { struct ibv_context *verbs; struct rdma_event_channel *channel; void *context;
                    struct ibv_qp *qp; enum rdma_port_space ps; uint8_t port_num;
                    struct ibv_pd *pd; ...; };
enum rdma_cm_event_type {
    RDMA_CM_EVENT_ADDR_RESOLVED, RDMA_CM_EVENT_ADDR_ERROR, RDMA_CM_EVENT_ROUTE_RESOLVED,
    RDMA_CM_EVENT_ROUTE_ERROR, RDMA_CM_EVENT_CONNECT_REQUEST, RDMA_CM_EVENT_CONNECT_RESPONSE,
    RDMA_CM_EVENT_CONNECT_ERROR, RDMA_CM_EVENT_UNREACHABLE, RDMA_CM_EVENT_REJECTED,
    RDMA_CM_EVENT_ESTABLISHED, RDMA_CM_EVENT_DISCONNECTED, RDMA_CM_EVENT_DEVICE_REMOVAL,
    RDMA_CM_EVENT_MULTICAST_JOIN, RDMA_CM_EVENT_MULTICAST_ERROR, RDMA_CM_EVENT_ADDR_CHANGE,
    RDMA_CM_EVENT_TIMEWAIT_EXIT, ... };
struct rdma_conn_param { const void *private_data; uint8_t private_data_len;
                         uint8_t responder_resources; uint8_t initiator_depth; uint8_t flow_control;
                         uint8_t retry_count; uint8_t rnr_retry_count; uint8_t srq; uint32_t qp_num; };
struct rdma_cm_event { struct rdma_cm_id *id; struct rdma_cm_id *listen_id;
                       enum rdma_cm_event_type event; int status; ...; };

#define RDMA_OPTION_ID ...
#define RDMA_OPTION_ID_REUSEADDR ...
#define RDMA_OPTION_ID_AFONLY ...
#define RDMA_OPTION_ID_ACK_TIMEOUT ...

struct rdma_event_channel *rdma_create_event_channel(void);
void rdma_destroy_event_channel(struct rdma_event_channel *channel);
int rdma_create_id(struct rdma_event_channel *channel, struct rdma_cm_id **id, void *context,
                   enum rdma_port_space ps);
int rdma_destroy_id(struct rdma_cm_id *id);
struct ibv_context **rdma_get_devices(int *num_devices);
void rdma_free_devices(struct ibv_context **list);
int rdma_bind_addr(struct rdma_cm_id *id, struct sockaddr *addr);
int rdma_resolve_addr(struct rdma_cm_id *id, struct sockaddr *src_addr, struct sockaddr *dst_addr,
                      int timeout_ms);
int rdma_resolve_route(struct rdma_cm_id *id, int timeout_ms);
int rdma_create_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_qp_init_attr *qp_init_attr);
void rdma_destroy_qp(struct rdma_cm_id *id);
int rdma_connect(struct rdma_cm_id *id, struct rdma_conn_param *conn_param);
int rdma_listen(struct rdma_cm_id *id, int backlog);
int rdma_accept(struct rdma_cm_id *id, struct rdma_conn_param *conn_param);
int rdma_reject(struct rdma_cm_id *id, const void *private_data, uint8_t private_data_len);
int rdma_disconnect(struct rdma_cm_id *id);
int rdma_get_cm_event(struct rdma_event_channel *channel, struct rdma_cm_event **event);
int rdma_ack_cm_event(struct rdma_cm_event *event);
int rdma_set_option(struct rdma_cm_id *id, int level, int optname, void *optval, size_t optlen);
struct sockaddr *rdma_get_local_addr(struct rdma_cm_id *id);
struct sockaddr *rdma_get_peer_addr(struct rdma_cm_id *id);
const char *rdma_event_str(enum rdma_cm_event_type event);

/* ---- rdmaio helper (helper.c) --------------------------------------------------------------- */
struct rdmaio_wc { uint64_t wr_id; uint32_t status; uint32_t opcode; uint32_t byte_len;
                   uint32_t imm_data; uint32_t flags; uint32_t vendor_err; uint32_t qp_num; };
struct rdmaio_wc_group { uint64_t key; uint32_t start; uint32_t count; };
#define RDMAIO_MAX_POLL ...
struct rdmaio_send { uint64_t wr_id; uint64_t addr; uint32_t length; uint32_t lkey; uint32_t imm_data;
                     uint32_t opcode; uint32_t send_flags; uint32_t rkey; uint64_t remote_addr; };
#define RDMAIO_MAX_PRIVATE_DATA ...
struct rdmaio_cm_event { int event; int status; struct rdma_cm_id *id; struct rdma_cm_id *listen_id;
                         uint32_t qp_num; uint8_t responder_resources; uint8_t initiator_depth;
                         uint8_t retry_count; uint8_t rnr_retry_count; uint8_t srq;
                         uint8_t private_data_len; uint8_t private_data[256]; };

int rdmaio_drain_cq(struct ibv_comp_channel *channel, struct ibv_cq *cq, struct rdmaio_wc *out,
                    int max_wc, unsigned int *events_out);
int rdmaio_poll_cq(struct ibv_cq *cq, struct rdmaio_wc *out, int max_wc);
int rdmaio_drain_channel(struct ibv_comp_channel *channel, struct ibv_cq **fired, int max_fired,
                         unsigned int *events_out, int *err_out);
int rdmaio_poll_grouped(struct ibv_cq *cq, struct rdmaio_wc *scratch, struct rdmaio_wc *out, int max_wc,
                        struct rdmaio_wc_group *groups, int *ngroups_out);
int rdmaio_req_notify(struct ibv_cq *cq);
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

/* ---- one-sided operations (helper.c's last section) ---------------------------------------------- */
static const int IBV_ACCESS_REMOTE_ATOMIC;
static const int IBV_ACCESS_MW_BIND;
static const int IBV_WR_ATOMIC_CMP_AND_SWP;
static const int IBV_WR_ATOMIC_FETCH_AND_ADD;
static const int IBV_WC_COMP_SWAP;
static const int IBV_WC_FETCH_ADD;
static const int IBV_ATOMIC_NONE;
static const int IBV_ATOMIC_HCA;
static const int IBV_ATOMIC_GLOB;
static const int IBV_DEVICE_MEM_WINDOW;
static const int IBV_DEVICE_MEM_WINDOW_TYPE_2A;
static const int IBV_DEVICE_MEM_WINDOW_TYPE_2B;
struct rdmaio_rdma_op { uint64_t wr_id; uint64_t local_addr; uint32_t length; uint32_t lkey;
                        uint32_t opcode; uint32_t send_flags; uint32_t imm_data; uint32_t rkey;
                        uint64_t remote_addr; uint64_t compare_add; uint64_t swap; };
struct rdmaio_onesided_caps { int atomic_cap; int max_qp_rd_atom; int max_qp_init_rd_atom; int max_mw;
                              uint64_t device_cap_flags; };
int rdmaio_post_rdma(struct ibv_qp *qp, const struct rdmaio_rdma_op *ops, int count, int *bad_index);
struct rdmaio_batch { uint64_t wr_id; uint64_t local_addr; uint32_t lkey; uint32_t opcode; uint32_t rkey;
                      int count; const uint64_t *remote_addr; const uint32_t *length;
                      const uint64_t *local_offset; const uint64_t *compare_add; const uint64_t *swap; };
int rdmaio_post_batch(struct ibv_qp *qp, const struct rdmaio_batch *b, int *bad_index);
int rdmaio_query_onesided_caps(struct ibv_context *context, struct rdmaio_onesided_caps *out);
int rdmaio_probe_mw(struct ibv_pd *pd, int type);
int rdmaio_qp_access(struct ibv_qp *qp, int *access_flags, int *max_rd_atomic, int *max_dest_rd_atomic);
struct ibv_mw { struct ibv_context *context; struct ibv_pd *pd; uint32_t rkey; uint32_t handle; ...; };
/* memory windows: grants scoped to one connection (rdmaio.verbs.MemoryWindow) */
int rdmaio_alloc_mw(struct ibv_pd *pd, struct ibv_mw **out);
int rdmaio_post_bind_mw(struct ibv_qp *qp, struct ibv_mw *mw, struct ibv_mr *mr, uint64_t addr,
                        uint64_t length, unsigned int access, uint64_t wr_id, uint32_t *rkey);
int rdmaio_dealloc_mw(struct ibv_mw *mw);
static const int IBV_WR_BIND_MW;
static const int IBV_WC_BIND_MW;
/* memory-window probe (tools/probe_onesided.py) */
int rdmaio_probe_bind_mw(struct ibv_qp *qp, struct ibv_pd *pd, struct ibv_mr *mr, uint64_t addr,
                         uint64_t length, int access, uint64_t wr_id, struct ibv_mw **out, uint32_t *rkey);
int rdmaio_probe_local_inv(struct ibv_qp *qp, uint32_t rkey, uint64_t wr_id);
int rdmaio_probe_dealloc_mw(struct ibv_mw *mw);
/* a serial one-sided request: fill, post and poll in one call (onesided.c) */
struct rdmaio_onesided_port { struct ibv_qp *qp; struct ibv_cq *cq; uint64_t wr_base; uint32_t max_inline;
                              int poll_errno; uint64_t posted; uint64_t polled; struct rdmaio_wc record;
                              struct rdmaio_wc_group group; };
#define RDMAIO_POSTED ...
#define RDMAIO_POSTED_DONE ...
#define RDMAIO_POSTED_OTHER ...
#define RDMAIO_POSTED_POLL_FAILED ...
int rdmaio_onesided_post_poll(struct rdmaio_onesided_port *port, uint32_t index, uint64_t local_addr,
                              uint32_t lkey, uint32_t length, uint32_t opcode, uint64_t remote_addr,
                              uint32_t rkey, uint64_t compare_add, uint64_t swap);
int rdmaio_onesided_post_batch_poll(struct rdmaio_onesided_port *port, const struct rdmaio_batch *b);

/* ---- session rules (session.c; the Python Session in rdmaio/protocol/session.py is their model) -------- */
struct rdmaio_session {
    int64_t batch_frames_received; int64_t batch_frames_sent; int64_t batch_pending;
    int64_t batched_messages_received; int64_t batched_messages_sent; int64_t batching;
    int64_t bytes_received; int64_t bytes_sent; int64_t credit_frames_received; int64_t credit_frames_sent;
    int64_t default_threshold; int64_t eof_due; int64_t eof_sent; int64_t fast; int64_t frames_received;
    int64_t frames_sent; int64_t grown; int64_t local_max; int64_t max_fragment; int64_t messages_received;
    int64_t messages_sent; int64_t min_send_credits; int64_t onesided_received; int64_t onesided_sent;
    int64_t peer_depth; int64_t peer_eof; int64_t peer_max; int64_t posted; int64_t recv_depth;
    int64_t recv_in_message; int64_t recv_max; int64_t recv_message_bytes; int64_t rndv; int64_t send_credits;
    int64_t send_in_message; int64_t send_message_bytes; int64_t slot_size; int64_t threshold;
    int64_t ungranted; int64_t ungranted_ctl; int64_t wire_down;
};
#define RDMAIO_RX_DONE ...
#define RDMAIO_RX_DEFER ...
#define RDMAIO_RX_MORE ...
int rdmaio_session_on_frame(struct rdmaio_session *s, uint32_t imm, uint32_t byte_len);
int64_t rdmaio_session_take_data(struct rdmaio_session *s, int last, int64_t nbytes);
int64_t rdmaio_session_take_batch(struct rdmaio_session *s, int64_t nbytes, int64_t messages);
int64_t rdmaio_session_take_credit(struct rdmaio_session *s);
int rdmaio_session_credit_frame_due(const struct rdmaio_session *s);
int rdmaio_session_can_send_data(const struct rdmaio_session *s);
int rdmaio_session_eof_pending(const struct rdmaio_session *s);
int rdmaio_session_control_frame_due(const struct rdmaio_session *s);
int rdmaio_session_reposted(struct rdmaio_session *s, int64_t n);
int rdmaio_session_grow(struct rdmaio_session *s, int64_t n);
int rdmaio_session_take_slot(struct rdmaio_session *s);
#define RDMAIO_RX_KIND_SHIFT ...
#define RDMAIO_RX_SLOT_MAX ...
#define RDMAIO_RX_RUN_MAX_OUT ...
#define RDMAIO_RX_RUN_MAX ...
#define RDMAIO_RX_CONSUMED_SHIFT ...
#define RDMAIO_RX_STOP_SHIFT ...
int rdmaio_rx_run(struct rdmaio_session *s, const struct rdmaio_wc *records, int start, int count,
                  uint32_t *packed, int max_out);
/* ---- DATA_BATCH payloads (session.c rdmaio_session_on_batch; rdmaio.protocol.frames.unpack_batch is the model) */
#define RDMAIO_BATCH_SHORT ...
#define RDMAIO_BATCH_TRUNCATED ...
#define RDMAIO_BATCH_OVERRUN ...
#define RDMAIO_BATCH_TOO_LARGE ...
int64_t rdmaio_session_on_batch(struct rdmaio_session *s, const uint8_t *ring, uint64_t ring_len, uint64_t off,
                                uint32_t len, char *fmt, uint32_t fmt_cap);
/* ---- the send ring (txring.c, txring.h): slots, send-queue entries and work requests of one sender ---- */
#define RDMAIO_TX_SLOTLESS ...
#define RDMAIO_TX_SEQ_MASK ...
#define RDMAIO_TX_NO_SQ ...
#define RDMAIO_TX_NO_SLOT ...
#define RDMAIO_TX_BAD_INDEX ...
#define RDMAIO_TX_TOO_LONG ...
#define RDMAIO_TX_NO_SCRATCH ...
#define RDMAIO_TX_BAD_ARG ...
#define RDMAIO_TX_SESSION ...
#define RDMAIO_TX_EOF ...
struct rdmaio_txring { struct rdmaio_send *sends; uint32_t send_len; uint32_t slot_size; uint8_t *base;
                       const uint32_t *lkeys; uint32_t slots; uint32_t max_slots; uint32_t *free_stack;
                       uint32_t nfree; uint32_t *inflight; uint32_t inflight_head; uint32_t inflight_count;
                       uint32_t sq_depth; uint32_t unsignaled; uint32_t signal_interval; uint32_t interval;
                       uint32_t sq_interval; uint64_t wr_id_base; uint32_t seq; uint32_t max_inline;
                       uint8_t *scratch; uint32_t scratch_entries; uint32_t eof_staged; uint32_t eof_index;
                       uint32_t header; };
int rdmaio_txring_set_header(struct rdmaio_txring *r, uint32_t header);
int rdmaio_txring_init(struct rdmaio_txring *r, struct rdmaio_send *sends, uint32_t send_len,
                       uint32_t *free_stack, uint32_t max_slots, uint32_t *inflight, uint32_t sq_depth,
                       uint32_t slot_size, uint32_t max_inline, uint32_t signal_interval, uint64_t wr_id_base);
int rdmaio_txring_set_scratch(struct rdmaio_txring *r, uint8_t *scratch, uint32_t entries);
int rdmaio_txring_add_slots(struct rdmaio_txring *r, uintptr_t base, const uint32_t *lkeys, uint32_t first,
                            uint32_t count);
int rdmaio_txring_room(const struct rdmaio_txring *r, uint64_t length);
int rdmaio_txring_stage(struct rdmaio_txring *r, uint32_t i, const uint8_t *data, uint64_t length, uint32_t imm);
int rdmaio_txring_stage_frame(struct rdmaio_txring *r, struct rdmaio_session *s, int index, const void *data,
                              uint32_t length, int kind);
int rdmaio_txring_send_now(struct rdmaio_txring *r, struct rdmaio_session *s, const void *data, uint32_t length);
int rdmaio_txring_stage_empty(struct rdmaio_txring *r, uint32_t i, uint32_t imm, uint32_t flags);
int rdmaio_txring_finish(struct rdmaio_txring *r, uint32_t count);
int rdmaio_txring_complete(struct rdmaio_txring *r, uint32_t index);
int rdmaio_txring_inflight_at(const struct rdmaio_txring *r, uint32_t k, uint32_t *out);
/* ---- the path of a connection (path.c; rdmaio.verbs.cm.CMId.query_path) -------------------------- */
struct rdmaio_path { uint8_t sgid[16]; uint8_t dgid[16]; int32_t sgid_index; int32_t gid_type;
                     int32_t active_mtu; int32_t path_mtu; int32_t link_layer; int32_t transport_type;
                     int32_t port_num; int32_t is_global; };
int rdmaio_query_path(struct rdma_cm_id *id, struct rdmaio_path *out);
static const int IBV_GID_TYPE_IB;
static const int IBV_GID_TYPE_ROCE_V1;
static const int IBV_GID_TYPE_ROCE_V2;
static const int IBV_TRANSPORT_IB;
static const int IBV_TRANSPORT_IWARP;

/* ---- connection setup (setup.c, setup.h): the verbs steps of setting up a connection, one call each ---- */
#define RDMAIO_SETUP_STEP_ARGS ...
#define RDMAIO_SETUP_STEP_ACK_TIMEOUT ...
#define RDMAIO_SETUP_STEP_CREATE_QP ...
#define RDMAIO_SETUP_STEP_CREATE_QP_NO_ERRNO ...
#define RDMAIO_SETUP_NO_ACK_TIMEOUT ...
#define RDMAIO_SETUP_MAX_ACK_TIMEOUT ...
#define RDMAIO_SETUP_MAX_PRIVATE_DATA ...
int rdmaio_setup_qp(struct rdma_cm_id *id, struct ibv_pd *pd, struct ibv_cq *send_cq,
                    struct ibv_cq *recv_cq, struct ibv_srq *srq,
                    uint32_t max_send_wr, uint32_t max_recv_wr, uint32_t max_inline, int fit_inline,
                    int ack_timeout, struct ibv_qp_cap *cap_out, int *step_out);
int rdmaio_setup_connect(struct rdma_cm_id *id, const uint8_t *private_data, uint32_t len,
                         uint8_t retry_count, uint8_t rnr_retry_count, uint8_t responder_resources,
                         uint8_t initiator_depth);
int rdmaio_setup_accept(struct rdma_cm_id *id, const uint8_t *private_data, uint32_t len,
                        uint8_t rnr_retry_count, uint8_t responder_resources, uint8_t initiator_depth);

/* ---- the header framing (session.c rdmaio_rx_unframe, helper.c rdmaio_query_framing_caps) ---------- */
#define RDMAIO_FRAME_HEADER ...
#define RDMAIO_CONTROL_KIND ...
#define RDMAIO_CONTROL_WORD ...
int rdmaio_rx_unframe(struct rdmaio_wc *records, int start, int count, uint8_t *ring, uint64_t ring_len,
                      uint32_t slot_size);
struct rdmaio_framing_caps { int transport_type; int atomic_cap; int max_mw; int max_sge_rd; };
int rdmaio_query_framing_caps(struct ibv_context *context, struct rdmaio_framing_caps *out);
