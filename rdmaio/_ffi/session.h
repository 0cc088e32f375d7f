/* rdmaio session rules in C: exact ports of the hot rules of rdmaio.protocol.session.Session (the reference
 * model), applied to the same state the Python Session works on (the core injects this struct as the
 * Session's state object; rdmaio.protocol.sessionstate.SessionState has the same fields, by name).
 *
 * Contract: a function that cannot apply its rule (a check fails, the kind is not one it handles, or the
 * state is not `fast`) returns its "defer" value and changes NOTHING; the caller then calls the Python
 * method, which applies the rule or raises the precise error. So C only ever takes the accept paths. */
#ifndef RDMAIO_SESSION_H
#define RDMAIO_SESSION_H

#include <stdint.h>
#include "helper.h"

/* Fields sorted by name, as SessionState.__slots__ (a unit test compares them). Flags are 0/1. */
struct rdmaio_session {
    int64_t batch_frames_received;
    int64_t batch_frames_sent;
    int64_t batch_pending;        /* payload size of the DATA_BATCH frame awaiting on_batch(), -1 if none */
    int64_t batched_messages_received;
    int64_t batched_messages_sent;
    int64_t batching;
    int64_t bytes_received;
    int64_t bytes_sent;
    int64_t credit_frames_received;
    int64_t credit_frames_sent;
    int64_t default_threshold;
    int64_t eof_due;
    int64_t eof_sent;
    int64_t fast;                 /* 0: every rule goes through the Python Session (C defers everything) */
    int64_t frames_received;
    int64_t frames_sent;
    int64_t grown;
    int64_t local_max;
    int64_t max_fragment;
    int64_t messages_received;
    int64_t messages_sent;
    int64_t min_send_credits;
    int64_t onesided_received;
    int64_t onesided_sent;
    int64_t peer_depth;
    int64_t peer_eof;
    int64_t peer_max;
    int64_t posted;
    int64_t recv_depth;
    int64_t recv_in_message;
    int64_t recv_max;
    int64_t recv_message_bytes;
    int64_t rndv;
    int64_t send_credits;
    int64_t send_in_message;
    int64_t send_message_bytes;
    int64_t slot_size;
    int64_t threshold;
    int64_t ungranted;
    int64_t ungranted_ctl;
    int64_t wire_down;
};

/* Frame kinds (bits 31..28 of the immediate value), as rdmaio.protocol.frames.FrameKind. */
#define RDMAIO_FRAME_MORE 1
#define RDMAIO_FRAME_END 2
#define RDMAIO_FRAME_CREDIT 3
#define RDMAIO_FRAME_EOF 4
#define RDMAIO_FRAME_BATCH 5

/* Why rdmaio_rx_run() returned (its stop field). */
#define RDMAIO_RX_DONE 0   /* every record was consumed */
#define RDMAIO_RX_DEFER 1  /* records[start + *consumed] is a receive C did not apply: the caller handles it */
#define RDMAIO_RX_MORE 2   /* stopped after a DATA_BATCH frame or with `out` full: call again after */

/* Session.on_frame's accept path for DATA_END, DATA_MORE, DATA_BATCH (accounting) and CREDIT: the kind,
 * or 0 (defer). */
int rdmaio_session_on_frame(struct rdmaio_session *s, uint32_t imm, uint32_t byte_len);
/* Session.take_data_frame(last, nbytes): the immediate value, or -1 (defer). */
int64_t rdmaio_session_take_data(struct rdmaio_session *s, int last, int64_t nbytes);
/* Session.take_batch_frame(nbytes, messages): the immediate value, or -1 (defer). */
int64_t rdmaio_session_take_batch(struct rdmaio_session *s, int64_t nbytes, int64_t messages);
/* Session.take_credit_frame(): the immediate value, or -1 (defer). */
int64_t rdmaio_session_take_credit(struct rdmaio_session *s);
/* Session.credit_frame_due() / can_send_data() / eof_pending(): 1 or 0, or -1 (defer: not fast). */
int rdmaio_session_credit_frame_due(const struct rdmaio_session *s);
int rdmaio_session_can_send_data(const struct rdmaio_session *s);
int rdmaio_session_eof_pending(const struct rdmaio_session *s);
/* Session.control_frame_due() (eof_pending() or credit_frame_due()): 1 or 0, or -1 (defer: not fast). */
int rdmaio_session_control_frame_due(const struct rdmaio_session *s);
/* Session.on_recv_reposted(n), grow_receives(n), take_slot(): 0, or -1 (defer). */
int rdmaio_session_reposted(struct rdmaio_session *s, int64_t n);
int rdmaio_session_grow(struct rdmaio_session *s, int64_t n);
int rdmaio_session_take_slot(struct rdmaio_session *s);
/* The frame rules over one connection's completions records[start .. start+count-1], as
 * rdmaio.core.receive.Receiver.on_batch applies them: failed and non-receive records are skipped, each
 * receive's frame is applied (rdmaio_session_on_frame) and described in packed[] (at most max_out frames).
 * Stops at the first receive it does not apply (one-sided: RECV_RDMA_WITH_IMM or no immediate; a frame
 * rdmaio_session_on_frame defers; a slot above RDMAIO_RX_SLOT_MAX) and right after a DATA_BATCH frame (its
 * payload must be unpacked before the next frame). Everything it tells is in small plain integers (below
 * 2**30: one digit of a Python int), so that the receiver reads no struct field: frame k is packed[2k] =
 * kind << RDMAIO_RX_KIND_SHIFT | slot and packed[2k + 1] = length (packed holds 2 * max_out words), and the
 * return value is frames | consumed << RDMAIO_RX_CONSUMED_SHIFT | stop << RDMAIO_RX_STOP_SHIFT (consumed:
 * the records skipped or applied from start; stop: RDMAIO_RX_*); -1 (nothing changed) for no session,
 * records or packed array, or max_out outside [0, RDMAIO_RX_RUN_MAX_OUT]. At most RDMAIO_RX_RUN_MAX
 * records are looked at (the caller calls again for the rest); a negative start or count consumes nothing. */
#define RDMAIO_RX_KIND_SHIFT 24
#define RDMAIO_RX_SLOT_MAX 0xffffffu
#define RDMAIO_RX_RUN_MAX_OUT 511
#define RDMAIO_RX_RUN_MAX 0xffff
#define RDMAIO_RX_CONSUMED_SHIFT 9
#define RDMAIO_RX_STOP_SHIFT 25
int rdmaio_rx_run(struct rdmaio_session *s, const struct rdmaio_wc *records, int start, int count,
                  uint32_t *packed, int max_out);

/* The header framing's receive side (rdmaio.protocol.framing.unframe_receive is its reference model): every
 * successful plain receive (IBV_WC_RECV) among records[start .. start+count-1] is made into what the
 * immediate framing delivers. A frame: the header word (network order, the slot's first 4 bytes) becomes
 * imm_data with IBV_WC_WITH_IMM, the payload moves to the slot's start, byte_len loses the header. A
 * one-sided control message (header exactly RDMAIO_CONTROL_WORD): the same without the immediate. Anything
 * malformed (shorter than the header, longer than a slot, a control header with other bits, a receive
 * WITH immediate data, a slot outside the ring) becomes imm_data 0 (an unknown kind: the frame rules
 * reject it) with IBV_WC_WITH_IMM and byte_len 0. `ring` is the receive ring's memory, `ring_len` its
 * bytes; slot k is at k * slot_size. Returns the records changed, or -1 for a bad argument (nothing
 * changed). */
#define RDMAIO_FRAME_HEADER 4
#define RDMAIO_CONTROL_KIND 9
#define RDMAIO_CONTROL_WORD (9u << 28)
int rdmaio_rx_unframe(struct rdmaio_wc *records, int start, int count, uint8_t *ring, uint64_t ring_len,
                      uint32_t slot_size);

/* ---- DATA_BATCH payloads: Session.on_batch's accept path, and the split as a struct format ------------- */
/* Session.on_batch(payload) for the DATA_BATCH frame rdmaio_session_on_frame accepted (batch_pending ==
 * len), with rdmaio.protocol.frames.unpack_batch's checks (its model) over the payload ring[off .. off+len-1]:
 * every record is checked, in unpack_batch's order, before anything is written. Accepted: the session counts
 * the messages (batch_pending -1, messages_received, batched_messages_received, bytes_received) and fmt
 * holds a NUL-terminated Python struct format that splits the payload, "4x<n1>s4x<n2>s..." (the messages
 * are struct.unpack_from(fmt, ring, off)); returns the count of messages (>= 1). 0: deferred, nothing
 * changed (not fast, no DATA_BATCH frame of this length pending, the payload outside the ring, or valid
 * records that need more than fmt_cap bytes of format): the Python rule applies it. A violation: one of
 * RDMAIO_BATCH_* (negative), nothing changed; the Python rule raises its precise error. */
#define RDMAIO_BATCH_SHORT (-1)      /* shorter than one record header */
#define RDMAIO_BATCH_TRUNCATED (-2)  /* a record header cut short */
#define RDMAIO_BATCH_OVERRUN (-3)    /* a record declares more bytes than follow */
#define RDMAIO_BATCH_TOO_LARGE (-4)  /* a message above local_max (ReceivedMessageTooLargeError) */
int64_t rdmaio_session_on_batch(struct rdmaio_session *s, const uint8_t *ring, uint64_t ring_len, uint64_t off,
                                uint32_t len, char *fmt, uint32_t fmt_cap);

#endif
