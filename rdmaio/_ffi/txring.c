/* rdmaio send ring: slot and send-queue bookkeeping and the per-frame fill of send work requests (see
 * txring.h). One struct per connection, driven by rdmaio.core.send.Sender:
 *
 *   stage / stage_empty  per frame: check its bounds, take a slot (or the entry's inline scratch area),
 *                        copy the bytes, fill send-array entry i, put it in flight
 *   finish               per chain, before the post: the signalling rule for the chain's last request
 *   complete             per signalled send completion: release everything up to it (RC order)
 *   add_slots            after the ring grew
 *
 * Staging is split in two steps, txring_check() (every bound, no change) and txring_put() (cannot fail), so
 * that a caller that must account the frame between them (the session's credit take, which gives the
 * frame's immediate value) does so only once the frame is sure to be staged. */
#include <arpa/inet.h>
#include <string.h>

#include <infiniband/verbs.h>

#include "txring.h"

static uint32_t min_u32(uint32_t a, uint32_t b)
{
    return a < b ? a : b;
}

/* The signal interval for n entries: signal_interval, but at most half of them (and at least 1). A ring
 * smaller than the interval would otherwise be "short of slots" on every post. */
static uint32_t interval_for(uint32_t signal_interval, uint32_t n)
{
    uint32_t half = n / 2;
    return min_u32(signal_interval, half ? half : 1);
}

int rdmaio_txring_init(struct rdmaio_txring *r, struct rdmaio_send *sends, uint32_t send_len,
                       uint32_t *free_stack, uint32_t max_slots, uint32_t *inflight, uint32_t sq_depth,
                       uint32_t slot_size, uint32_t max_inline, uint32_t signal_interval, uint64_t wr_id_base)
{
    if (!r || !sends || !free_stack || !inflight || !send_len || !max_slots || !sq_depth || !slot_size ||
        !signal_interval || max_slots > RDMAIO_TX_SLOTLESS || sq_depth > RDMAIO_TX_SLOTLESS ||
        (wr_id_base & 0xffffffffu))
        return RDMAIO_TX_BAD_ARG;
    memset(r, 0, sizeof(*r));
    r->sends = sends;
    r->send_len = send_len;
    r->free_stack = free_stack;
    r->max_slots = max_slots;
    r->inflight = inflight;
    r->sq_depth = sq_depth;
    r->slot_size = slot_size;
    r->max_inline = max_inline;
    r->signal_interval = signal_interval;
    r->interval = interval_for(signal_interval, 0);
    r->sq_interval = interval_for(signal_interval, sq_depth);
    r->wr_id_base = wr_id_base;
    return 0;
}

int rdmaio_txring_set_header(struct rdmaio_txring *r, uint32_t header)
{
    if (header != 0 && header != 4)
        return RDMAIO_TX_BAD_ARG;
    if (r->inflight_count || r->seq)
        return RDMAIO_TX_BAD_ARG; /* a frame was staged already: the framing is fixed */
    r->header = header;
    return 0;
}

/* The inline frames' scratch area: entries * max_inline bytes, entry i's at i * max_inline. */
int rdmaio_txring_set_scratch(struct rdmaio_txring *r, uint8_t *scratch, uint32_t entries)
{
    if (!scratch || !entries || (uint64_t)entries * r->max_inline > SIZE_MAX)
        return RDMAIO_TX_BAD_ARG;
    r->scratch = scratch;
    r->scratch_entries = entries;
    return 0;
}

/* Slots [first, first + count) were registered (first must be the current count): they become free, the
 * lowest index on top of the stack. base and lkeys are the ring's (they may move only while it has no
 * slot: a ring gets its memory with its first slots). */
int rdmaio_txring_add_slots(struct rdmaio_txring *r, uintptr_t base, const uint32_t *lkeys, uint32_t first,
                            uint32_t count)
{
    if (first != r->slots || count > r->max_slots - first || count > r->max_slots - r->nfree || !base ||
        !lkeys || (r->slots && ((uint8_t *)base != r->base || lkeys != r->lkeys)))
        return RDMAIO_TX_BAD_ARG;
    r->base = (uint8_t *)base;
    r->lkeys = lkeys;
    for (uint32_t k = count; k-- > 0;)
        r->free_stack[r->nfree++] = first + k;
    r->slots = first + count;
    r->interval = interval_for(r->signal_interval, r->slots);
    return 0;
}

/* Whether a frame of `length` bytes could be staged now as far as send-queue entries and free slots go. */
int rdmaio_txring_room(const struct rdmaio_txring *r, uint64_t length)
{
    if (r->inflight_count >= r->sq_depth)
        return 0;
    length += r->header;
    return length <= r->max_inline || r->nfree > 0;
}

static void track(struct rdmaio_txring *r, uint32_t index)
{
    /* txring_check() made sure inflight_count < sq_depth. */
    r->inflight[(r->inflight_head + r->inflight_count) % r->sq_depth] = index;
    r->inflight_count++;
}

static void fill(struct rdmaio_txring *r, struct rdmaio_send *wr, uint32_t index, uint64_t addr,
                 uint32_t length, uint32_t lkey, uint32_t imm, uint32_t flags)
{
    wr->wr_id = r->wr_id_base | index;
    wr->addr = addr;
    wr->length = length;
    wr->lkey = lkey;
    /* The header framing carries imm in the payload's header (written by the caller): a plain SEND. */
    wr->imm_data = r->header ? 0 : imm;
    wr->opcode = r->header ? IBV_WR_SEND : IBV_WR_SEND_WITH_IMM;
    wr->rkey = 0;
    wr->remote_addr = 0;
    /* Signalled every interval requests: the ring's for a frame in a slot, the send queue's otherwise. */
    r->unsignaled++;
    if (r->unsignaled >= ((index & RDMAIO_TX_SLOTLESS) ? r->sq_interval : r->interval)) {
        flags |= IBV_SEND_SIGNALED;
        r->unsignaled = 0;
    }
    wr->send_flags = flags;
}

static uint32_t next_slotless(struct rdmaio_txring *r)
{
    uint32_t index = RDMAIO_TX_SLOTLESS | r->seq;
    r->seq = (r->seq + 1) & RDMAIO_TX_SEQ_MASK;
    return index;
}

/* Every bound a frame of `length` bytes into entry i must meet; changes nothing. */
static int txring_check(const struct rdmaio_txring *r, uint32_t i, uint64_t length)
{
    if (i >= r->send_len)
        return RDMAIO_TX_BAD_INDEX;
    if (r->inflight_count >= r->sq_depth)
        return RDMAIO_TX_NO_SQ;
    if (length > UINT32_MAX - 4)
        return RDMAIO_TX_TOO_LONG;
    length += r->header; /* what travels: the header framing's header, then the frame */
    if (length > r->max_inline) {
        if (length > r->slot_size)
            return RDMAIO_TX_TOO_LONG;
        if (!r->nfree)
            return RDMAIO_TX_NO_SLOT;
        /* The stack holds registered slots only (add_slots, complete): a corrupt one is refused. */
        if (r->free_stack[r->nfree - 1] >= r->slots || !r->base || !r->lkeys)
            return RDMAIO_TX_BAD_INDEX;
    } else if (length && (!r->scratch || i >= r->scratch_entries)) {
        return RDMAIO_TX_NO_SCRATCH;
    }
    return 0;
}

/* Copy a frame into dest: the header framing's header (imm, network order), then the frame's bytes. */
static void copy_frame(const struct rdmaio_txring *r, uint8_t *dest, const uint8_t *data, uint32_t length,
                       uint32_t imm)
{
    if (r->header) {
        uint32_t word = htonl(imm);
        memcpy(dest, &word, 4);
        dest += 4;
    }
    if (length)
        memcpy(dest, data, length);
}

/* Stage a checked frame: 1 if it took a slot, 0 if it went inline (or empty). */
static int txring_put(struct rdmaio_txring *r, uint32_t i, const uint8_t *data, uint32_t length, uint32_t imm)
{
    struct rdmaio_send *wr = &r->sends[i];
    uint32_t wire = length + r->header; /* txring_check() bounded it */
    if (wire > r->max_inline) {
        uint32_t slot = r->free_stack[--r->nfree];
        uint8_t *dest = r->base + (size_t)slot * r->slot_size;
        copy_frame(r, dest, data, length, imm);
        fill(r, wr, slot, (uint64_t)(uintptr_t)dest, wire, r->lkeys[slot], imm, 0);
        track(r, slot);
        return 1;
    }
    uint32_t index = next_slotless(r);
    if (wire) {
        uint8_t *dest = r->scratch + (size_t)i * r->max_inline;
        copy_frame(r, dest, data, length, imm);
        fill(r, wr, index, (uint64_t)(uintptr_t)dest, wire, 0, imm, IBV_SEND_INLINE);
    } else {
        fill(r, wr, index, 0, 0, 0, imm, 0);
    }
    track(r, index);
    return 0;
}

/* Stage one frame of `length` bytes at `data` into send-array entry i with immediate value imm: 1 if it
 * took a slot, 0 if it went inline or is empty, or a negative RDMAIO_TX_* code (nothing changed).
 *
 * When the session's frame rules are C (a struct the caller passes), the same call can take the frame
 * too: txring_check(), then the session's credit check and take (the immediate value), then txring_put(). */
int rdmaio_txring_stage(struct rdmaio_txring *r, uint32_t i, const uint8_t *data, uint64_t length, uint32_t imm)
{
    int rc = txring_check(r, i, length);
    if (rc)
        return rc;
    if (length && !data)
        return RDMAIO_TX_BAD_ARG;
    return txring_put(r, i, data, (uint32_t)length, imm);
}

int rdmaio_txring_stage_frame(struct rdmaio_txring *r, struct rdmaio_session *s, int index, const void *data,
                              uint32_t length, int kind)
{
    int64_t imm;
    int rc;

    if (index < 0)
        return RDMAIO_TX_BAD_INDEX;
    if (kind > 1 || (length && !data))
        return RDMAIO_TX_BAD_ARG; /* RNDV and other kinds are taken by the Python Session */
    rc = txring_check(r, (uint32_t)index, length);
    if (rc)
        return rc;
    /* The session's take changes nothing when it refuses (-1): neither has anything changed here. */
    if (kind >= 0)
        imm = rdmaio_session_take_data(s, kind, (int64_t)length);
    else
        imm = rdmaio_session_take_batch(s, (int64_t)length, -(int64_t)kind);
    if (imm < 0)
        return RDMAIO_TX_SESSION;
    return txring_put(r, (uint32_t)index, (const uint8_t *)data, length, (uint32_t)imm);
}

/* A message sent at once by an idle sender (nothing queued, nothing staged): the ring's room and the
 * session's credit, the take, the copy and the work request of entry 0, then the chain's signalling rule.
 * 1: staged and finished (post one entry); 2: staged, and a control frame (EOF or CREDIT) is due after it
 * (the caller stages it and finishes the chain); 0: no room or no credit now (nothing changed: the caller
 * queues the message); or a negative RDMAIO_TX_* refusal (nothing changed). */
int rdmaio_txring_send_now(struct rdmaio_txring *r, struct rdmaio_session *s, const void *data, uint32_t length)
{
    int rc;

    if (!rdmaio_txring_room(r, length) || rdmaio_session_can_send_data(s) <= 0)
        return 0;
    rc = rdmaio_txring_stage_frame(r, s, 0, data, length, 1);
    if (rc < 0)
        return rc;
    if (rdmaio_session_control_frame_due(s))
        return 2;
    rc = rdmaio_txring_finish(r, 1);
    return rc < 0 ? rc : 1;
}

/* Stage an empty frame (EOF, CREDIT, RETURN, RECLAIM) into entry i: no slot, no SGE. With RDMAIO_TX_EOF it
 * is signalled and its completion is reported by rdmaio_txring_complete(). Returns 0 or a refusal. */
int rdmaio_txring_stage_empty(struct rdmaio_txring *r, uint32_t i, uint32_t imm, uint32_t flags)
{
    int rc = txring_check(r, i, 0);
    if (rc)
        return rc;
    struct rdmaio_send *wr = &r->sends[i];
    uint32_t index;
    if (r->header) {
        /* The header framing: the frame is its 4-byte header, inline or in a slot (txring_check chose). */
        txring_put(r, i, NULL, 0, imm);
        index = (uint32_t)(wr->wr_id & 0xffffffffu);
        if (flags & RDMAIO_TX_EOF) {
            wr->send_flags |= IBV_SEND_SIGNALED;
            r->unsignaled = 0;
            r->eof_staged = 1;
            r->eof_index = index;
        }
        return 0;
    }
    index = next_slotless(r);
    fill(r, wr, index, 0, 0, 0, imm, 0);
    if (flags & RDMAIO_TX_EOF) {
        wr->send_flags = IBV_SEND_SIGNALED;
        r->unsignaled = 0;
        r->eof_staged = 1;
        r->eof_index = index;
    }
    track(r, index);
    return 0;
}

/* Before posting entries [0, count): whatever runs short of send slots or send-queue entries must get a
 * completion to release them, so the chain's last request is signalled then (slots count only while some
 * are in flight: a completion releases no slot otherwise). 1 if it was signalled here, 0 if not. */
int rdmaio_txring_finish(struct rdmaio_txring *r, uint32_t count)
{
    if (!count || count > r->send_len)
        return RDMAIO_TX_BAD_INDEX;
    if ((r->nfree < r->interval && r->nfree < r->slots) || r->sq_depth - r->inflight_count < r->sq_interval) {
        r->sends[count - 1].send_flags |= IBV_SEND_SIGNALED;
        r->unsignaled = 0;
        return 1;
    }
    return 0;
}

/* A signalled send with wr index `index` completed: RC completes in order, so every entry posted up to it
 * (inclusive) is released, its slot (if any) back on the free stack. 1 if it was the EOF frame. */
int rdmaio_txring_complete(struct rdmaio_txring *r, uint32_t index)
{
    while (r->inflight_count) {
        uint32_t done = r->inflight[r->inflight_head];
        r->inflight_head = (r->inflight_head + 1) % r->sq_depth;
        r->inflight_count--;
        /* A slot goes back only if it is registered and the stack has room (always, unless the state is
         * corrupt: then it is dropped rather than written out of bounds). */
        if (!(done & RDMAIO_TX_SLOTLESS) && done < r->slots && r->nfree < r->max_slots)
            r->free_stack[r->nfree++] = done;
        if (done == index)
            break;
    }
    return r->eof_staged && index == r->eof_index;
}

/* The k-th oldest entry in flight (for inspection): 0 and *out, or RDMAIO_TX_BAD_INDEX past the last. */
int rdmaio_txring_inflight_at(const struct rdmaio_txring *r, uint32_t k, uint32_t *out)
{
    if (k >= r->inflight_count)
        return RDMAIO_TX_BAD_INDEX;
    *out = r->inflight[(r->inflight_head + k) % r->sq_depth];
    return 0;
}
