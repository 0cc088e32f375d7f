/* The hot rules of rdmaio.protocol.session.Session in C (see session.h). Each function is an exact port of
 * the Python method's accept path: same checks, same order of updates. Any check that fails returns the
 * defer value before anything is written. No Python C-API: cffi releases the GIL around these calls. */
#include <arpa/inet.h>
#include <limits.h>
#include <string.h>

#include "session.h"

#define KIND_SHIFT 28
#define CREDIT_MASK 0xFFFFu
#define BAD_IMM_BITS 0x0FFF0000u  /* reserved bits: only RETURN (deferred) may carry them */
#define MAX_CREDITS 0xFFFF
#define BATCH_RECORD_HEADER 4
#define WC_RECV_FLAG 0x80u       /* IBV_WC_RECV bit of a completion opcode */

/* Take up to MAX_CREDITS owed credits for a frame about to be posted (Session._grant_owed). */
static inline int64_t grant_owed(struct rdmaio_session *s)
{
    int64_t grant = s->ungranted;
    if (grant > MAX_CREDITS)
        grant = MAX_CREDITS;
    s->ungranted -= grant;
    if (s->ungranted_ctl > s->ungranted)  /* even when nothing is granted, as the Python method does */
        s->ungranted_ctl = s->ungranted;
    return grant;
}

static inline void spend_credit(struct rdmaio_session *s, int64_t send_credits)
{
    s->send_credits = send_credits;
    if (send_credits < s->min_send_credits)
        s->min_send_credits = send_credits;
    s->frames_sent += 1;
}

int rdmaio_session_on_frame(struct rdmaio_session *s, uint32_t imm, uint32_t byte_len)
{
    int64_t send_credits, size;
    int kind;

    if (!s->fast || (imm & BAD_IMM_BITS))
        return 0;
    send_credits = s->send_credits + (int64_t)(imm & CREDIT_MASK);
    /* posted - ungranted = the peer's credits + frames in flight: this frame must be one of them. */
    if (s->posted <= s->ungranted || send_credits > s->peer_depth || (int64_t)byte_len > s->slot_size)
        return 0;
    kind = (int)(imm >> KIND_SHIFT);
    switch (kind) {
    case RDMAIO_FRAME_END:
        if (s->peer_eof || s->recv_message_bytes + (int64_t)byte_len > s->local_max)
            return 0;
        s->bytes_received += byte_len;
        s->messages_received += 1;
        if (s->recv_in_message) {
            s->recv_in_message = 0;
            s->recv_message_bytes = 0;
        }
        break;
    case RDMAIO_FRAME_MORE:
        size = s->recv_message_bytes + (int64_t)byte_len;
        if (s->peer_eof || size > s->local_max)
            return 0;
        s->bytes_received += byte_len;
        s->recv_in_message = 1;
        s->recv_message_bytes = size;
        break;
    case RDMAIO_FRAME_CREDIT:
        if (byte_len)
            return 0;
        s->credit_frames_received += 1;
        s->ungranted_ctl += 1;
        break;
    case RDMAIO_FRAME_BATCH:
        if (!s->batching || s->peer_eof || s->recv_in_message || byte_len < BATCH_RECORD_HEADER)
            return 0;
        s->batch_frames_received += 1;
        s->batch_pending = byte_len;
        break;
    default:  /* EOF, RNDV, RECLAIM, RETURN, unknown kinds: the Python Session's */
        return 0;
    }
    s->posted -= 1;
    s->send_credits = send_credits;
    s->frames_received += 1;
    return kind;
}

int64_t rdmaio_session_take_data(struct rdmaio_session *s, int last, int64_t nbytes)
{
    int64_t send_credits = s->send_credits - 1, message_bytes, grant;

    if (!s->fast || s->wire_down || s->eof_sent || send_credits < 1 || nbytes < 0 || nbytes > s->max_fragment)
        return -1;
    message_bytes = s->send_message_bytes + nbytes;
    if (message_bytes > s->peer_max)
        return -1;
    /* Every frame piggybacks everything we owe (take_data_frame clamps ungranted_ctl only if it grants). */
    grant = s->ungranted;
    if (grant) {
        if (grant > CREDIT_MASK)
            grant = CREDIT_MASK;
        s->ungranted -= grant;
        if (s->ungranted_ctl > s->ungranted)
            s->ungranted_ctl = s->ungranted;
    }
    spend_credit(s, send_credits);
    s->bytes_sent += nbytes;
    if (last) {
        s->messages_sent += 1;
        if (s->send_in_message) {
            s->send_in_message = 0;
            s->send_message_bytes = 0;
        }
        return ((int64_t)RDMAIO_FRAME_END << KIND_SHIFT) | grant;
    }
    s->send_in_message = 1;
    s->send_message_bytes = message_bytes;
    return ((int64_t)RDMAIO_FRAME_MORE << KIND_SHIFT) | grant;
}

int64_t rdmaio_session_take_batch(struct rdmaio_session *s, int64_t nbytes, int64_t messages)
{
    /* nbytes >= BATCH_RECORD_HEADER first: then nbytes / 4 is Python's nbytes // 4. */
    if (!s->fast || s->wire_down || s->eof_sent || !s->batching || s->send_in_message
        || nbytes < BATCH_RECORD_HEADER || messages < 1 || messages > nbytes / BATCH_RECORD_HEADER
        || nbytes > s->max_fragment || s->send_credits < 2)
        return -1;
    s->batch_frames_sent += 1;
    s->batched_messages_sent += messages;
    s->messages_sent += messages;
    s->bytes_sent += nbytes - BATCH_RECORD_HEADER * messages;
    int64_t grant = grant_owed(s);
    spend_credit(s, s->send_credits - 1);
    return ((int64_t)RDMAIO_FRAME_BATCH << KIND_SHIFT) | grant;
}

int64_t rdmaio_session_take_credit(struct rdmaio_session *s)
{
    int64_t send_credits = s->send_credits - 1, grant;

    if (!s->fast || s->wire_down || send_credits < 0 || s->ungranted < 1)
        return -1;
    grant = grant_owed(s);
    spend_credit(s, send_credits);
    s->credit_frames_sent += 1;
    return ((int64_t)RDMAIO_FRAME_CREDIT << KIND_SHIFT) | grant;
}

int rdmaio_session_credit_frame_due(const struct rdmaio_session *s)
{
    int64_t owed = s->ungranted;

    if (!s->fast)
        return -1;
    return (owed - s->ungranted_ctl >= s->threshold || owed >= s->recv_depth - 1) && s->send_credits >= 1
           && !s->wire_down;
}

int rdmaio_session_can_send_data(const struct rdmaio_session *s)
{
    if (!s->fast)
        return -1;
    return s->send_credits >= 2 && !(s->eof_sent || s->wire_down);
}

int rdmaio_session_eof_pending(const struct rdmaio_session *s)
{
    if (!s->fast)
        return -1;
    return s->eof_due && !s->wire_down;
}

int rdmaio_session_control_frame_due(const struct rdmaio_session *s)
{
    int64_t owed = s->ungranted;

    if (!s->fast)
        return -1;
    if (s->wire_down)
        return 0;
    if (s->eof_due)
        return 1;
    return (owed - s->ungranted_ctl >= s->threshold || owed >= s->recv_depth - 1) && s->send_credits >= 1;
}

int rdmaio_session_reposted(struct rdmaio_session *s, int64_t n)
{
    if (!s->fast || n < 0 || s->posted + n > s->recv_depth)
        return -1;
    s->posted += n;
    s->ungranted += n;
    return 0;
}

int rdmaio_session_grow(struct rdmaio_session *s, int64_t n)
{
    if (!s->fast || n <= 0 || n > s->recv_max - s->recv_depth)
        return -1;
    s->recv_depth += n;
    s->posted += n;
    s->ungranted += n;
    s->grown += n;
    if (s->default_threshold)
        s->threshold = s->recv_depth / 2;  /* recv_depth > 0: C's division is Python's // */
    return 0;
}

int rdmaio_session_take_slot(struct rdmaio_session *s)
{
    if (!s->fast || s->wire_down || s->send_credits < 2)
        return -1;
    s->send_credits -= 1;
    s->onesided_sent += 1;
    if (s->send_credits < s->min_send_credits)
        s->min_send_credits = s->send_credits;
    return 0;
}

/* rdmaio_rx_run()'s rules: frame k goes to packed[2k] and packed[2k + 1]. */
static int rx_apply(struct rdmaio_session *s, const struct rdmaio_wc *records, int start, int count,
                    uint32_t *packed, int max_out, int *consumed, int *stop)
{
    int i, n = 0, kind;

    *consumed = 0;
    *stop = RDMAIO_RX_DONE;
    if (start < 0 || count <= 0 || start > INT_MAX - count)
        return 0;
    for (i = 0; i < count; i++) {
        const struct rdmaio_wc *wc = &records[start + i];
        if (wc->status || !(wc->opcode & WC_RECV_FLAG))
            continue;  /* the connection's (failed, or a send/one-sided completion) */
        if (wc->opcode == IBV_WC_RECV_RDMA_WITH_IMM || !(wc->flags & IBV_WC_WITH_IMM)) {
            *stop = RDMAIO_RX_DEFER;  /* one-sided: a write notice or a control message */
            break;
        }
        if (n >= max_out) {
            *stop = RDMAIO_RX_MORE;
            break;
        }
        uint32_t slot = (uint32_t)(wc->wr_id & 0xffffffffu);
        if (slot > RDMAIO_RX_SLOT_MAX) {
            *stop = RDMAIO_RX_DEFER;  /* does not fit the packed word: the Python rules take it */
            break;
        }
        kind = rdmaio_session_on_frame(s, wc->imm_data, wc->byte_len);
        if (!kind) {
            *stop = RDMAIO_RX_DEFER;
            break;
        }
        packed[2 * n] = (uint32_t)kind << RDMAIO_RX_KIND_SHIFT | slot;
        packed[2 * n + 1] = wc->byte_len;
        n++;
        if (kind == RDMAIO_FRAME_BATCH) {
            i++;
            if (i < count)
                *stop = RDMAIO_RX_MORE;
            break;
        }
    }
    *consumed = i;
    return n;
}

int rdmaio_rx_run(struct rdmaio_session *s, const struct rdmaio_wc *records, int start, int count,
                  uint32_t *packed, int max_out)
{
    int consumed, stop, n;

    if (!s || !records || !packed || max_out < 0 || max_out > RDMAIO_RX_RUN_MAX_OUT)
        return -1;
    if (count > RDMAIO_RX_RUN_MAX)
        count = RDMAIO_RX_RUN_MAX;  /* the rest is the caller's next call */
    n = rx_apply(s, records, start, count, packed, max_out, &consumed, &stop);
    return n | consumed << RDMAIO_RX_CONSUMED_SHIFT | stop << RDMAIO_RX_STOP_SHIFT;
}

static void unframe_reject(struct rdmaio_wc *wc)
{
    wc->imm_data = 0;
    wc->flags |= IBV_WC_WITH_IMM;
    wc->byte_len = 0;
}

int rdmaio_rx_unframe(struct rdmaio_wc *records, int start, int count, uint8_t *ring, uint64_t ring_len,
                      uint32_t slot_size)
{
    int i, changed = 0;

    if (start < 0 || count < 0 || !records || !ring || !slot_size)
        return -1;
    for (i = start; i < start + count; i++) {
        struct rdmaio_wc *wc = &records[i];
        uint64_t slot, off;
        uint32_t word, n;

        if (wc->status || wc->opcode != IBV_WC_RECV)
            continue;  /* failed, a send's, or a write notice (RECV_RDMA_WITH_IMM): as they are */
        changed++;
        slot = wc->wr_id & 0xffffffffu;
        off = slot * (uint64_t)slot_size;
        if ((wc->flags & IBV_WC_WITH_IMM) || wc->byte_len < RDMAIO_FRAME_HEADER || wc->byte_len > slot_size
            || off + slot_size > ring_len) {
            unframe_reject(wc);
            continue;
        }
        memcpy(&word, ring + off, 4);
        word = ntohl(word);
        n = wc->byte_len - RDMAIO_FRAME_HEADER;
        if ((word >> KIND_SHIFT) == RDMAIO_CONTROL_KIND) {
            if (word != RDMAIO_CONTROL_WORD) {
                unframe_reject(wc);
                continue;
            }
            wc->imm_data = 0;
        } else {
            wc->imm_data = word;
            wc->flags |= IBV_WC_WITH_IMM;
        }
        memmove(ring + off, ring + off + RDMAIO_FRAME_HEADER, n);
        wc->byte_len = n;
    }
    return changed;
}

/* ---- DATA_BATCH payloads: Session.on_batch's accept path, and the split as a struct format ------------- */

/* Writes "4x<n>s" at fmt[pos..]; returns the new position, or -1 if it does not fit with the final NUL. */
static int64_t batch_fmt_record(char *fmt, int64_t pos, uint32_t cap, uint32_t n)
{
    char digits[10];
    int k = 0;

    do {
        digits[k++] = (char)('0' + n % 10);
        n /= 10;
    } while (n);
    if (pos + 3 + k >= (int64_t)cap)  /* '4', 'x', the digits, 's', and room for the NUL */
        return -1;
    fmt[pos++] = '4';
    fmt[pos++] = 'x';
    while (k)
        fmt[pos++] = digits[--k];
    fmt[pos++] = 's';
    return pos;
}

int64_t rdmaio_session_on_batch(struct rdmaio_session *s, const uint8_t *ring, uint64_t ring_len, uint64_t off,
                                uint32_t len, char *fmt, uint32_t fmt_cap)
{
    const uint8_t *data;
    uint64_t pos = 0, start, end = len;
    uint32_t n;
    int64_t count = 0, fpos = 0;
    int defer = 0;

    if (!s || !ring || !fmt || !s->fast || s->batch_pending < 0 || s->batch_pending != (int64_t)len
        || off > ring_len || len > ring_len - off)
        return 0;
    data = ring + off;
    /* unpack_batch's checks, in its order: the payload, then record by record the header, the declared
     * length, the size limit. The first violation is returned even when the format no longer fits. */
    if (end < BATCH_RECORD_HEADER)
        return RDMAIO_BATCH_SHORT;
    while (pos < end) {
        start = pos + BATCH_RECORD_HEADER;
        if (start > end)
            return RDMAIO_BATCH_TRUNCATED;
        n = (uint32_t)data[pos] | (uint32_t)data[pos + 1] << 8 | (uint32_t)data[pos + 2] << 16
            | (uint32_t)data[pos + 3] << 24;
        pos = start + n;
        if (pos > end)
            return RDMAIO_BATCH_OVERRUN;
        if ((int64_t)n > s->local_max)
            return RDMAIO_BATCH_TOO_LARGE;
        if (!defer && (fpos = batch_fmt_record(fmt, fpos, fmt_cap, n)) < 0)
            defer = 1;  /* valid so far, but too many records for the format: the Python rule splits it */
        count++;
    }
    if (defer)
        return 0;
    fmt[fpos] = '\0';
    s->batch_pending = -1;
    s->messages_received += count;
    s->batched_messages_received += count;
    s->bytes_received += (int64_t)len - BATCH_RECORD_HEADER * count;
    return count;
}
