/* util/cpuboard.c - see cpuboard.h. */
#include "util/cpuboard.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define BOARD_MAGIC "TDCPUBD2"
#define BOARD_SLOTS CPU_SETSIZE

typedef struct {
    char magic[8];
    uint32_t n_slots;
    uint32_t slot_bytes;
    uint8_t pad[48];
} board_hdr;

/*
 * Owners and borrowers are named by a board user id: the process's pid in the high 32
 * bits (to find a dead one) and the open's number within the process in the low ones, so
 * that the engines of one process (data-parallel ranks) are told apart: by pid alone, two
 * ranks took one idle rank's CPU together, and an owner took its own process's guest for
 * itself and never waited for it.
 */
typedef struct {
    _Atomic uint32_t busy; /* the owner has work */
    uint32_t pad0;
    _Atomic uint64_t owner;    /* the user whose home CPU this is; 0: none */
    _Atomic uint64_t borrower; /* the user running a guest here; 0: none */
    uint8_t pad[40];
} board_slot;

_Static_assert(sizeof(board_hdr) == 64 && sizeof(board_slot) == 64, "board layout");
_Static_assert(ATOMIC_LONG_LOCK_FREE == 2 && sizeof(long) == 8,
               "the board's 64-bit ids are shared between processes: lock-free atomics only");

#define BOARD_BYTES (sizeof(board_hdr) + BOARD_SLOTS * sizeof(board_slot))

struct td_cpuboard {
    board_hdr *hdr;
    board_slot *slot;
    uint64_t id; /* pid << 32 | the open's number in this process */
    cpu_set_t home;
    cpu_set_t held; /* CPUs this user borrowed */
};

static _Atomic uint32_t n_opens;

static uint32_t id_pid(uint64_t id)
{
    return (uint32_t)(id >> 32);
}

/* Whether the process of a board user id is gone (its slots are then free). */
static bool id_gone(uint64_t id)
{
    return id != 0 && kill((pid_t)id_pid(id), 0) != 0 && errno == ESRCH;
}

int td_cpuboard_open(td_cpuboard **out, const char *path, const cpu_set_t *home, td_err *err)
{
    *out = NULL;
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0600);
    if (fd < 0) return td_err_set(err, TD_EIO, "CPU board %s: %s", path, strerror(errno));
    /* One process at a time sizes and stamps a new board. */
    if (flock(fd, LOCK_EX) != 0) {
        int e = errno;
        close(fd);
        return td_err_set(err, TD_EIO, "CPU board %s: lock: %s", path, strerror(e));
    }
    struct stat st;
    int rc = 0;
    if (fstat(fd, &st) != 0) {
        rc = td_err_set(err, TD_EIO, "CPU board %s: %s", path, strerror(errno));
    } else if (st.st_size == 0) {
        board_hdr h = {.n_slots = BOARD_SLOTS, .slot_bytes = sizeof(board_slot)};
        memcpy(h.magic, BOARD_MAGIC, 8);
        if (ftruncate(fd, (off_t)BOARD_BYTES) != 0 || pwrite(fd, &h, sizeof(h), 0) != sizeof(h))
            rc =
                td_err_set(err, TD_EIO, "CPU board %s: cannot write it: %s", path, strerror(errno));
    } else if ((size_t)st.st_size != BOARD_BYTES) {
        rc = td_err_set(err, TD_EFORMAT,
                        "CPU board %s: not a tandem CPU board (%lld bytes, "
                        "expected %zu)",
                        path, (long long)st.st_size, BOARD_BYTES);
    }
    void *map = MAP_FAILED;
    if (rc == 0) {
        map = mmap(NULL, BOARD_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        if (map == MAP_FAILED)
            rc = td_err_set(err, TD_EIO, "CPU board %s: mmap: %s", path, strerror(errno));
    }
    if (rc == 0) {
        const board_hdr *h = map;
        if (memcmp(h->magic, BOARD_MAGIC, 8) || h->n_slots != BOARD_SLOTS ||
            h->slot_bytes != sizeof(board_slot))
            rc = td_err_set(err, TD_EFORMAT, "CPU board %s: not a tandem CPU board (bad header)",
                            path);
    }
    /* A home CPU another live engine owns on this board (of another process, or another
     * rank of this one): the two would mark it idle and busy over each other, and lend it
     * out while one still computes on it. (Checked under the lock, so two engines starting
     * together cannot both take it.) */
    uint64_t id = (uint64_t)getpid() << 32 | (atomic_fetch_add(&n_opens, 1) + 1);
    for (int c = 0; rc == 0 && c < BOARD_SLOTS; c++) {
        if (!CPU_ISSET(c, home)) continue;
        uint64_t owner = atomic_load(&((board_slot *)((char *)map + sizeof(board_hdr)))[c].owner);
        if (owner && !id_gone(owner))
            rc = td_err_set(err, TD_EINVAL,
                            "CPU board %s: CPU %d is already the home of pid %u%s (engines "
                            "that share a board need CPU sets of their own: --cpus)",
                            path, c, id_pid(owner),
                            id_pid(owner) == id_pid(id) ? ", this process" : "");
    }
    if (rc == 0) { /* claimed while the lock is held */
        board_slot *slot = (board_slot *)((char *)map + sizeof(board_hdr));
        for (int c = 0; c < BOARD_SLOTS; c++)
            if (CPU_ISSET(c, home)) atomic_store(&slot[c].owner, id);
    }
    flock(fd, LOCK_UN);
    close(fd);
    if (rc) {
        if (map != MAP_FAILED) munmap(map, BOARD_BYTES);
        return rc;
    }
    td_cpuboard *b = td_xcalloc(1, sizeof(*b));
    b->hdr = map;
    b->slot = (board_slot *)((char *)map + sizeof(board_hdr));
    b->id = id;
    b->home = *home;
    CPU_ZERO(&b->held);
    for (int c = 0; c < BOARD_SLOTS; c++)
        if (CPU_ISSET(c, home)) atomic_store(&b->slot[c].busy, 0);
    *out = b;
    return 0;
}

void td_cpuboard_close(td_cpuboard *b)
{
    if (!b) return;
    for (int c = 0; c < BOARD_SLOTS; c++) {
        if (CPU_ISSET(c, &b->held)) td_cpuboard_give_back(b, c);
        if (!CPU_ISSET(c, &b->home)) continue;
        uint64_t me = b->id;
        atomic_compare_exchange_strong(&b->slot[c].owner, &me, 0);
        atomic_store(&b->slot[c].busy, 0);
    }
    munmap(b->hdr, BOARD_BYTES);
    free(b);
}

uint64_t td_cpuboard_set_busy(td_cpuboard *b, bool busy)
{
    for (int c = 0; c < BOARD_SLOTS; c++)
        if (CPU_ISSET(c, &b->home)) atomic_store(&b->slot[c].busy, busy ? 1u : 0u);
    if (!busy) return 0;
    /* Wait for guests to leave: a borrower gives a CPU back before its next parallel run. */
    uint64_t t0 = 0, now = 0;
    for (int c = 0; c < BOARD_SLOTS; c++) {
        if (!CPU_ISSET(c, &b->home)) continue;
        for (;;) {
            uint64_t who = atomic_load(&b->slot[c].borrower);
            if (who == 0 || who == b->id) break;
            if (id_gone(who)) { /* died holding it */
                atomic_compare_exchange_strong(&b->slot[c].borrower, &who, 0);
                continue;
            }
            now = td_now_ns();
            if (!t0) t0 = now;
            if (now - t0 > TD_CPUBOARD_WAIT_NS) {
                TD_DEBUG("CPU board: cpu %d still borrowed by pid %u after %llu ms; running "
                         "beside it",
                         c, id_pid(who), (unsigned long long)(TD_CPUBOARD_WAIT_NS / 1000000));
                return now - t0;
            }
            /* The borrower's thread runs on this very CPU: leave it the core. */
            struct timespec ts = {0, 20000};
            nanosleep(&ts, NULL);
        }
    }
    return t0 ? td_now_ns() - t0 : 0;
}

bool td_cpuboard_borrow(td_cpuboard *b, int cpu)
{
    if (cpu < 0 || cpu >= BOARD_SLOTS || CPU_ISSET(cpu, &b->home)) return false;
    board_slot *s = &b->slot[cpu];
    if (atomic_load(&s->busy)) return false;
    uint64_t none = 0;
    if (!atomic_compare_exchange_strong(&s->borrower, &none, b->id)) {
        if (none != b->id && !id_gone(none)) return false;
        /* ours already, or left by a dead borrower: take it over */
        if (none != b->id && !atomic_compare_exchange_strong(&s->borrower, &none, b->id))
            return false;
    }
    if (atomic_load(&s->busy)) { /* the owner started meanwhile */
        atomic_store(&s->borrower, 0);
        return false;
    }
    CPU_SET(cpu, &b->held);
    return true;
}

bool td_cpuboard_wanted(const td_cpuboard *b, int cpu)
{
    return atomic_load_explicit(&b->slot[cpu].busy, memory_order_relaxed) != 0;
}

void td_cpuboard_give_back(td_cpuboard *b, int cpu)
{
    if (cpu < 0 || cpu >= BOARD_SLOTS || !CPU_ISSET(cpu, &b->held)) return;
    uint64_t me = b->id;
    atomic_compare_exchange_strong(&b->slot[cpu].borrower, &me, 0);
    CPU_CLR(cpu, &b->held);
}
