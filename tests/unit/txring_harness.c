/* Random operations against the send ring under AddressSanitizer and UBSan, with its invariants checked
 * after each: every slot either free or in flight (never both, never lost), refusals change nothing,
 * filled requests carry the frame's bytes, completions in RC order release exactly what was posted up to
 * them, and a sender that runs out of slots or entries always has a signalled request posted (no stall). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <infiniband/verbs.h>
#include "txring.h"

#define DEPTH 16
#define SENDS 20
#define SLOT 48
#define INLINE 12
#define BASE (7ull << 32)
#define FAIL(...) do { printf("FAIL line %d: ", __LINE__); printf(__VA_ARGS__); printf("\n"); exit(1); } while (0)

static struct rdmaio_send sends[SENDS];
static uint32_t free_stack[DEPTH], inflight[DEPTH], lkeys[DEPTH];
static uint8_t *memory, scratch[SENDS * INLINE];
static struct rdmaio_txring ring;
static struct { uint32_t index; int signalled; } posted[4096];
static int nposted;
static unsigned seed = 12345;

static unsigned rnd(unsigned n) { seed = seed * 1103515245u + 12345u; return (seed >> 8) % n; }

static void check(void)
{
    int state[DEPTH] = {0}; /* 1 free, 2 in flight */
    if (ring.nfree > ring.slots || ring.inflight_count > ring.sq_depth) FAIL("counts");
    for (uint32_t k = 0; k < ring.nfree; k++) {
        uint32_t s = free_stack[k];
        if (s >= ring.slots || state[s]) FAIL("free slot %u", s);
        state[s] = 1;
    }
    for (uint32_t k = 0; k < ring.inflight_count; k++) {
        uint32_t out;
        if (rdmaio_txring_inflight_at(&ring, k, &out)) FAIL("inflight_at");
        if (out & RDMAIO_TX_SLOTLESS) continue;
        if (out >= ring.slots || state[out]) FAIL("in-flight slot %u", out);
        state[out] = 2;
    }
    for (uint32_t s = 0; s < ring.slots; s++)
        if (!state[s]) FAIL("slot %u lost", s);
}

int main(void)
{
    memory = calloc(DEPTH, SLOT);
    for (int s = 0; s < DEPTH; s++) lkeys[s] = 100 + s;
    if (rdmaio_txring_init(&ring, sends, SENDS, free_stack, DEPTH, inflight, DEPTH, SLOT, INLINE, 4, BASE))
        FAIL("init");
    if (rdmaio_txring_set_scratch(&ring, scratch, SENDS)) FAIL("scratch");
    uint32_t staged = 0;
    long staged_total = 0, refused = 0, completed = 0, stalls_checked = 0;
    for (int step = 0; step < 200000; step++) {
        unsigned op = rnd(10);
        if (op < 6) {
            uint8_t data[SLOT + 2];
            uint64_t length = rnd(SLOT + 3);
            for (uint64_t b = 0; b < length; b++) data[b] = (uint8_t)rnd(256);
            uint32_t i = rnd(50) ? staged : SENDS + rnd(5);
            struct rdmaio_txring before = ring;
            uint8_t sends_before[sizeof(sends)];
            memcpy(sends_before, sends, sizeof(sends));
            int rc = op == 5 ? rdmaio_txring_stage_empty(&ring, i, step, 0)
                             : rdmaio_txring_stage(&ring, i, data, length, step);
            if (rc < 0) {
                if (memcmp(&before, &ring, sizeof(ring)) || memcmp(sends_before, sends, sizeof(sends)))
                    FAIL("refusal %d changed the ring", rc);
                refused++;
                if (i >= SENDS && rc != RDMAIO_TX_BAD_INDEX) FAIL("index %u not refused: %d", i, rc);
                if (rc == RDMAIO_TX_NO_SLOT && ring.slots < DEPTH) {
                    uint32_t add = ring.slots ? ring.slots : 4;
                    if (add > DEPTH - ring.slots) add = DEPTH - ring.slots;
                    if (rdmaio_txring_add_slots(&ring, (uintptr_t)memory, lkeys, ring.slots, add)) FAIL("add");
                }
                if ((rc == RDMAIO_TX_NO_SQ || rc == RDMAIO_TX_NO_SLOT) && !staged && ring.slots == DEPTH) {
                    /* Out of entries or slots with everything posted: something posted must be signalled. */
                    int any = 0;
                    for (int p = 0; p < nposted; p++) any |= posted[p].signalled;
                    if (!any) FAIL("stall: %u in flight, %u free, nothing signalled", ring.inflight_count, ring.nfree);
                    stalls_checked++;
                }
            } else {
                if (op == 5) length = 0;
                struct rdmaio_send *wr = &sends[i];
                if (wr->imm_data != (uint32_t)step || wr->length != length || wr->opcode != IBV_WR_SEND_WITH_IMM)
                    FAIL("fill");
                if ((wr->wr_id & ~0xffffffffull) != BASE) FAIL("wr_id base");
                if (length && memcmp((void *)(uintptr_t)wr->addr, data, length)) FAIL("bytes");
                if ((rc == 1) != (length > INLINE)) FAIL("slot choice");
                if (rc == 1 && wr->lkey != lkeys[wr->wr_id & 0xffffffffu]) FAIL("lkey");
                if (length && length <= INLINE && !(wr->send_flags & IBV_SEND_INLINE)) FAIL("inline flag");
                staged++;
                staged_total++;
            }
        } else if (op < 8) {
            if (staged) {
                if (rdmaio_txring_finish(&ring, staged) < 0) FAIL("finish");
                for (uint32_t k = 0; k < staged; k++) {
                    if (nposted >= 4096) FAIL("posted overflow");
                    posted[nposted].index = (uint32_t)(sends[k].wr_id & 0xffffffffu);
                    posted[nposted++].signalled = !!(sends[k].send_flags & IBV_SEND_SIGNALED);
                }
                staged = 0;
            }
        } else {
            int p = 0;
            while (p < nposted && !posted[p].signalled) p++;
            if (p < nposted) {
                uint32_t count_before = ring.inflight_count;
                rdmaio_txring_complete(&ring, posted[p].index);
                if (count_before - ring.inflight_count != (uint32_t)p + 1) FAIL("released %u, not %d", count_before - ring.inflight_count, p + 1);
                memmove(posted, posted + p + 1, sizeof(posted[0]) * (nposted - p - 1));
                nposted -= p + 1;
                completed++;
            }
        }
        check();
    }
    printf("ok staged=%ld refused=%ld completed=%ld stalls_checked=%ld\n", staged_total, refused, completed, stalls_checked);
    return 0;
}
