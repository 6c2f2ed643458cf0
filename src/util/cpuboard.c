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

#define BOARD_MAGIC "TDCPUBD1"
#define BOARD_SLOTS CPU_SETSIZE

typedef struct {
    char magic[8];
    uint32_t n_slots;
    uint32_t slot_bytes;
    uint8_t pad[48];
} board_hdr;

typedef struct {
    _Atomic uint32_t busy;     /* the owner has work */
    _Atomic uint32_t owner;    /* pid of the process whose home CPU this is; 0: none */
    _Atomic uint32_t borrower; /* pid of the process running a guest here; 0: none */
    uint8_t pad[52];
} board_slot;

_Static_assert(sizeof(board_hdr) == 64 && sizeof(board_slot) == 64, "board layout");

#define BOARD_BYTES (sizeof(board_hdr) + BOARD_SLOTS * sizeof(board_slot))

struct td_cpuboard {
    board_hdr *hdr;
    board_slot *slot;
    uint32_t pid;
    cpu_set_t home;
    cpu_set_t held; /* CPUs this process borrowed */
};

static bool pid_gone(uint32_t pid)
{
    return pid != 0 && kill((pid_t)pid, 0) != 0 && errno == ESRCH;
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
    /* A home CPU another live process owns on this board: the two would mark it idle and
     * busy over each other, and lend it out while one still computes on it. (Checked under
     * the lock, so two engines starting together cannot both take it.) */
    for (int c = 0; rc == 0 && c < BOARD_SLOTS; c++) {
        if (!CPU_ISSET(c, home)) continue;
        uint32_t owner = atomic_load(&((board_slot *)((char *)map + sizeof(board_hdr)))[c].owner);
        if (owner && owner != (uint32_t)getpid() && !pid_gone(owner))
            rc = td_err_set(err, TD_EINVAL,
                            "CPU board %s: CPU %d is already the home of pid %u (engines that "
                            "share a board need CPU sets of their own: --cpus)",
                            path, c, owner);
    }
    if (rc == 0) { /* claimed while the lock is held */
        board_slot *slot = (board_slot *)((char *)map + sizeof(board_hdr));
        for (int c = 0; c < BOARD_SLOTS; c++)
            if (CPU_ISSET(c, home)) atomic_store(&slot[c].owner, (uint32_t)getpid());
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
    b->pid = (uint32_t)getpid();
    b->home = *home;
    CPU_ZERO(&b->held);
    for (int c = 0; c < BOARD_SLOTS; c++) {
        if (!CPU_ISSET(c, home)) continue;
        atomic_store(&b->slot[c].busy, 0);
        atomic_store(&b->slot[c].owner, b->pid);
    }
    *out = b;
    return 0;
}

void td_cpuboard_close(td_cpuboard *b)
{
    if (!b) return;
    for (int c = 0; c < BOARD_SLOTS; c++) {
        if (CPU_ISSET(c, &b->held)) td_cpuboard_give_back(b, c);
        if (!CPU_ISSET(c, &b->home)) continue;
        uint32_t me = b->pid;
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
            uint32_t who = atomic_load(&b->slot[c].borrower);
            if (who == 0 || who == b->pid) break;
            if (pid_gone(who)) { /* died holding it */
                atomic_compare_exchange_strong(&b->slot[c].borrower, &who, 0);
                continue;
            }
            now = td_now_ns();
            if (!t0) t0 = now;
            if (now - t0 > TD_CPUBOARD_WAIT_NS) {
                TD_DEBUG("CPU board: cpu %d still borrowed by pid %u after %llu ms; running "
                         "beside it",
                         c, who, (unsigned long long)(TD_CPUBOARD_WAIT_NS / 1000000));
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
    uint32_t none = 0;
    if (!atomic_compare_exchange_strong(&s->borrower, &none, b->pid)) {
        if (none != b->pid && !pid_gone(none)) return false;
        /* ours already, or left by a dead borrower: take it over */
        if (none != b->pid && !atomic_compare_exchange_strong(&s->borrower, &none, b->pid))
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
    uint32_t me = b->pid;
    atomic_compare_exchange_strong(&b->slot[cpu].borrower, &me, 0);
    CPU_CLR(cpu, &b->held);
}
