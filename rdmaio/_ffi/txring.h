/* rdmaio send ring (txring.c): the bookkeeping of one connection's send slots and send-queue entries, and the
 * per-frame fill of its send work requests (what rdmaio.core.send.Sender stages before one chained post).
 *
 * Every frame takes one send-queue entry until a signalled completion at or after it comes back (an RC queue
 * completes in order). A frame longer than max_inline also takes a send slot of the registered ring (its
 * bytes are copied there); a shorter one is "slotless": empty (no SGE) or inline from the scratch area of
 * its send-array entry, copied into the work request by ibv_post_send. The in-flight ring lists, in posting
 * order, each entry's slot or RDMAIO_TX_SLOTLESS | sequence; that value is also the index part of its wr_id.
 *
 * The caller owns every array the struct points to (cffi allocations kept alive by the Sender, the ring's
 * memory by its SlotRing) and sizes them as rdmaio_txring_init() is told. No function changes anything
 * when it refuses (a negative RDMAIO_TX_* code). Nothing here calls Python: cffi releases the GIL. */
#ifndef RDMAIO_TXRING_H
#define RDMAIO_TXRING_H

#include <stdint.h>

#include "helper.h"
#include "session.h"

#define RDMAIO_TX_SLOTLESS 0x80000000u /* wr index bit of a frame that holds no slot (inline or empty) */
#define RDMAIO_TX_SEQ_MASK 0x7fffffffu /* the sequence part of a slotless frame's wr index */

/* Refusals (negative returns). */
#define RDMAIO_TX_NO_SQ (-1)      /* every send-queue entry of the sender is in flight */
#define RDMAIO_TX_NO_SLOT (-2)    /* the frame needs a slot and none is free */
#define RDMAIO_TX_BAD_INDEX (-3)  /* a send-array entry, chain length or slot index out of its bound */
#define RDMAIO_TX_TOO_LONG (-4)   /* the frame is longer than a slot */
#define RDMAIO_TX_NO_SCRATCH (-5) /* an inline frame and no scratch area for its entry */
#define RDMAIO_TX_BAD_ARG (-6)    /* init/add_slots/set_scratch: an argument out of range */
#define RDMAIO_TX_SESSION (-7)    /* stage_frame: the session does not take the frame (the Python take raises) */

/* Flags of rdmaio_txring_stage_empty(). */
#define RDMAIO_TX_EOF 1u /* the EOF frame: always signalled; its completion is reported */

struct rdmaio_txring {
    struct rdmaio_send *sends; /* the queue pair's send array: entries [0, send_len) */
    uint32_t send_len;
    uint32_t slot_size;
    uint8_t *base;          /* slot 0 of the ring (NULL until its first slots are added) */
    const uint32_t *lkeys;  /* lkeys[slot]: the local key of each registered slot */
    uint32_t slots;         /* registered slots: valid slot indices are [0, slots) */
    uint32_t max_slots;     /* the ring's size: capacity of free_stack */
    uint32_t *free_stack;   /* free slots; the top (free_stack[nfree - 1]) is taken first */
    uint32_t nfree;
    uint32_t *inflight;     /* ring buffer of sq_depth entries: slot, or RDMAIO_TX_SLOTLESS | sequence */
    uint32_t inflight_head; /* the oldest entry in flight */
    uint32_t inflight_count;
    uint32_t sq_depth;      /* send-queue entries the sender may have in flight */
    uint32_t unsignaled;    /* requests filled since the last signalled one */
    uint32_t signal_interval; /* the configured interval */
    uint32_t interval;      /* for slot frames: signal_interval, at most half the registered ring */
    uint32_t sq_interval;   /* for slotless frames: signal_interval, at most half the send queue */
    uint64_t wr_id_base;    /* make_wr_id(WR_KIND_SEND, tag, 0): | the wr index */
    uint32_t seq;           /* the next slotless frame's sequence */
    uint32_t max_inline;    /* frames up to this length take no slot */
    uint8_t *scratch;       /* scratch_entries areas of max_inline bytes, one per send-array entry */
    uint32_t scratch_entries;
    uint32_t eof_staged;    /* the EOF frame was staged: eof_index is its wr index */
    uint32_t eof_index;
    uint32_t header;        /* 0: SEND with immediate data; 4: the header framing (plain SEND, the frame
                             * word in network order in the payload's first 4 bytes, the frame after it) */
};

int rdmaio_txring_init(struct rdmaio_txring *r, struct rdmaio_send *sends, uint32_t send_len,
                       uint32_t *free_stack, uint32_t max_slots, uint32_t *inflight, uint32_t sq_depth,
                       uint32_t slot_size, uint32_t max_inline, uint32_t signal_interval, uint64_t wr_id_base);
/* The header framing (header 4) or the immediate framing (0, the default): before the first frame only. */
int rdmaio_txring_set_header(struct rdmaio_txring *r, uint32_t header);
int rdmaio_txring_set_scratch(struct rdmaio_txring *r, uint8_t *scratch, uint32_t entries);
int rdmaio_txring_add_slots(struct rdmaio_txring *r, uintptr_t base, const uint32_t *lkeys, uint32_t first,
                            uint32_t count);
int rdmaio_txring_room(const struct rdmaio_txring *r, uint64_t length);
int rdmaio_txring_stage(struct rdmaio_txring *r, uint32_t i, const uint8_t *data, uint64_t length, uint32_t imm);
/* Take and stage one data frame in one call: txring_check(), then the session's credit check and take
 * (rdmaio_session_take_data for kind 1 DATA_END / 0 DATA_MORE, rdmaio_session_take_batch for kind -n, a
 * DATA_BATCH frame of n messages), then txring_put(). Returns as rdmaio_txring_stage(), or a refusal with
 * nothing changed: RDMAIO_TX_SESSION if the session does not take it (not fast, no credits, ...). */
int rdmaio_txring_stage_frame(struct rdmaio_txring *r, struct rdmaio_session *s, int index, const void *data,
                              uint32_t length, int kind);
/* A message sent at once by an idle sender: room, credit, take, copy and work request of entry 0, and the
 * chain's signalling. 1: finished (post one entry); 2: staged, a control frame is due after it (stage it,
 * then finish); 0: no room or no credit (nothing changed); or a negative refusal (nothing changed). */
int rdmaio_txring_send_now(struct rdmaio_txring *r, struct rdmaio_session *s, const void *data, uint32_t length);
int rdmaio_txring_stage_empty(struct rdmaio_txring *r, uint32_t i, uint32_t imm, uint32_t flags);
int rdmaio_txring_finish(struct rdmaio_txring *r, uint32_t count);
int rdmaio_txring_complete(struct rdmaio_txring *r, uint32_t index);
int rdmaio_txring_inflight_at(const struct rdmaio_txring *r, uint32_t k, uint32_t *out);

#endif
