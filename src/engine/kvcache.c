/* engine/kvcache.c - block pool, free queue and prefix index (see kvcache.h). */
#include "engine/kvcache.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <errno.h>
#include <unistd.h>

#define TAB_EMPTY 0ull
#define TAB_TOMB 1ull

size_t kv_pool_bytes(int n_layers, int kv_dim, int block_size, td_type dtype, int64_t n_blocks)
{
    size_t token_bytes = td_row_bytes(dtype, kv_dim);
    return (size_t)n_layers * (size_t)n_blocks * 2 * (size_t)block_size * token_bytes;
}

static void queue_unlink(kv_pool *p, int b)
{
    int pv = p->prev[b], nx = p->next[b];
    if (pv >= 0) p->next[pv] = nx; else p->head = nx;
    if (nx >= 0) p->prev[nx] = pv; else p->tail = pv;
    p->prev[b] = p->next[b] = -1;
    p->n_free--;
}

static void queue_push_front(kv_pool *p, int b)
{
    p->prev[b] = -1;
    p->next[b] = p->head;
    if (p->head >= 0) p->prev[p->head] = b; else p->tail = b;
    p->head = b;
    p->n_free++;
}

static void queue_push_back(kv_pool *p, int b)
{
    p->next[b] = -1;
    p->prev[b] = p->tail;
    if (p->tail >= 0) p->next[p->tail] = b; else p->head = b;
    p->tail = b;
    p->n_free++;
}

int kv_pool_init(kv_pool *p, int n_layers, int kv_dim, int block_size, td_type dtype,
                 int n_blocks, bool shareable, td_err *err)
{
    memset(p, 0, sizeof(*p));
    if (n_blocks < 1 || block_size < 1 || n_layers < 1 || kv_dim < 1)
        return td_err_set(err, TD_EINVAL, "kv cache: invalid geometry (%d blocks of %d tokens)",
                          n_blocks, block_size);
    p->token_bytes = td_row_bytes(dtype, kv_dim);
    if (p->token_bytes == 0)
        return td_err_set(err, TD_EUNSUPPORTED, "kv cache: dtype %s unsupported",
                          td_type_name(dtype));
    p->n_layers = n_layers;
    p->kv_dim = kv_dim;
    p->block_size = block_size;
    p->n_blocks = n_blocks;
    p->dtype = dtype;
    p->block_bytes = 2 * (size_t)block_size * p->token_bytes;
    p->layer_bytes = (size_t)n_blocks * p->block_bytes;
    p->total_bytes = (size_t)n_layers * p->layer_bytes;
    /* mmap gives page-aligned, lazily zeroed memory: a big pool costs nothing until used. */
    p->fd = -1;
    void *m;
    if (shareable) {
        /* A memfd is shmem: also lazily committed, and mappable by a peer process that
         * receives the descriptor (the shm transport). */
        p->fd = memfd_create("tandem-kv-pool", MFD_CLOEXEC);
        if (p->fd < 0)
            return td_err_set(err, TD_EIO, "kv cache: memfd_create: %s", strerror(errno));
        if (ftruncate(p->fd, (off_t)p->total_bytes) != 0) {
            int e = errno;
            close(p->fd);
            p->fd = -1;
            return td_err_set(err, TD_ENOMEM, "kv cache: cannot size the shared pool to %zu bytes: %s",
                              p->total_bytes, strerror(e));
        }
        m = mmap(NULL, p->total_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, p->fd, 0);
    } else {
        m = mmap(NULL, p->total_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    }
    if (m == MAP_FAILED) {
        if (p->fd >= 0) close(p->fd);
        p->fd = -1;
        return td_err_set(err, TD_ENOMEM, "kv cache: cannot map %zu bytes", p->total_bytes);
    }
    p->base = m;
    /* Transparent huge pages where the system allows them (advisory; failure is fine).
     * The pool stays lazy, in 2 MiB steps; attention walks many blocks of each layer,
     * and with 4 KiB pages nearly every block costs TLB misses (expensive page walks
     * under virtualization), and every page its first-touch fault. */
#ifdef MADV_HUGEPAGE
    (void)madvise(m, p->total_bytes, MADV_HUGEPAGE);
#endif
    p->ref = calloc((size_t)n_blocks, sizeof(int32_t));
    p->hash = calloc((size_t)n_blocks, sizeof(uint64_t));
    p->prev = malloc((size_t)n_blocks * sizeof(int32_t));
    p->next = malloc((size_t)n_blocks * sizeof(int32_t));
    p->tab_cap = 16;
    while (p->tab_cap < (size_t)n_blocks * 2) p->tab_cap <<= 1;
    p->tab_key = calloc(p->tab_cap, sizeof(uint64_t));
    p->tab_val = calloc(p->tab_cap, sizeof(int32_t));
    if (!p->ref || !p->hash || !p->prev || !p->next || !p->tab_key || !p->tab_val) {
        kv_pool_free(p);
        return td_err_set(err, TD_ENOMEM, "kv cache: out of memory for block metadata");
    }
    /* Ascending ids come out first, so a fresh request gets consecutive blocks. */
    p->head = p->tail = -1;
    for (int b = 0; b < n_blocks; b++) queue_push_back(p, b);
    return 0;
}

int kv_pool_keep_checksums(kv_pool *p, td_err *err)
{
    if (p->crc) return 0;
    size_t n = (size_t)p->n_layers * (size_t)p->n_blocks;
    p->crc = malloc(n * sizeof(uint32_t));
    p->crc_ok = calloc(n, 1);
    if (!p->crc || !p->crc_ok) {
        free(p->crc);
        free(p->crc_ok);
        p->crc = NULL;
        p->crc_ok = NULL;
        return td_err_set(err, TD_ENOMEM, "kv cache: out of memory for block checksums");
    }
    return 0;
}

void kv_pool_prefault(kv_pool *p)
{
    if (!p->base) return;
#ifdef MADV_POPULATE_WRITE
    if (madvise(p->base, p->total_bytes, MADV_POPULATE_WRITE) == 0) return;
#endif
    /* Older kernels: touch one byte per page. Only at start-up, before any block is used,
     * so the writes race with nothing. */
    long page = sysconf(_SC_PAGESIZE);
    for (size_t off = 0; off < p->total_bytes; off += (size_t)(page > 0 ? page : 4096))
        ((volatile uint8_t *)p->base)[off] = 0;
}

void kv_pool_free(kv_pool *p)
{
    if (p->base) {
        munmap(p->base, p->total_bytes);
        if (p->fd >= 0) close(p->fd); /* only a mapped pool owns a descriptor */
    }
    free(p->ref);
    free(p->hash);
    free(p->prev);
    free(p->next);
    free(p->tab_key);
    free(p->tab_val);
    free(p->crc);
    free(p->crc_ok);
    memset(p, 0, sizeof(*p));
    p->fd = -1;
}

static size_t tab_slot(const kv_pool *p, uint64_t key)
{
    return (size_t)(key * 0x9e3779b97f4a7c15ull >> 7) & (p->tab_cap - 1);
}

static int tab_find(const kv_pool *p, uint64_t key, size_t *slot_out)
{
    size_t i = tab_slot(p, key);
    for (size_t n = 0; n < p->tab_cap; n++, i = (i + 1) & (p->tab_cap - 1)) {
        uint64_t k = p->tab_key[i];
        if (k == TAB_EMPTY) return -1;
        if (k == key) {
            if (slot_out) *slot_out = i;
            return p->tab_val[i];
        }
    }
    return -1;
}

/* Remove block's own entry for key (and no other block's: an entry names one block). */
static void tab_remove(kv_pool *p, uint64_t key, int block)
{
    size_t i = tab_slot(p, key);
    for (size_t n = 0; n < p->tab_cap; n++, i = (i + 1) & (p->tab_cap - 1)) {
        uint64_t k = p->tab_key[i];
        if (k == TAB_EMPTY) return;
        if (k == key && p->tab_val[i] == block) {
            p->tab_key[i] = TAB_TOMB;
            p->n_cached--;
            return;
        }
    }
}

static void tab_rebuild(kv_pool *p)
{
    /* Tombstones accumulate under churn; rebuilding from the blocks' own hashes is cheap. */
    memset(p->tab_key, 0, p->tab_cap * sizeof(uint64_t));
    p->n_cached = 0;
    for (int b = 0; b < p->n_blocks; b++) {
        uint64_t h = p->hash[b];
        if (!h) continue;
        if (tab_find(p, h, NULL) >= 0) { /* one block per key: this one is not indexed */
            p->hash[b] = 0;
            continue;
        }
        size_t i = tab_slot(p, h);
        while (p->tab_key[i] != TAB_EMPTY) i = (i + 1) & (p->tab_cap - 1);
        p->tab_key[i] = h;
        p->tab_val[i] = b;
        p->n_cached++;
    }
}

/*
 * Index block under key, unless another block is indexed under it already (0). The whole
 * probe chain is searched for the key before a tombstone is reused: inserting at the first
 * tombstone made a second entry for a key further along, and evicting one of the two blocks
 * could then remove the other's entry and leave its own, pointing at a reused block (wrong
 * KV for the next request with that prefix).
 */
static int tab_insert(kv_pool *p, uint64_t key, int block)
{
    size_t i = tab_slot(p, key), tomb = SIZE_MAX;
    for (size_t n = 0; n < p->tab_cap; n++, i = (i + 1) & (p->tab_cap - 1)) {
        uint64_t k = p->tab_key[i];
        if (k == key) return 0; /* already indexed (by another block) */
        if (k == TAB_TOMB && tomb == SIZE_MAX) tomb = i;
        if (k == TAB_EMPTY) {
            size_t at = tomb != SIZE_MAX ? tomb : i;
            p->tab_key[at] = key;
            p->tab_val[at] = block;
            p->n_cached++;
            return 1;
        }
    }
    if (tomb != SIZE_MAX) { /* no empty slot left, the key is not there: take a tombstone */
        p->tab_key[tomb] = key;
        p->tab_val[tomb] = block;
        p->n_cached++;
        return 1;
    }
    tab_rebuild(p);
    return tab_insert(p, key, block);
}

int kv_alloc(kv_pool *p)
{
    int b = p->head;
    if (b < 0) return -1;
    queue_unlink(p, b);
    if (p->crc_ok) /* its contents are about to change */
        for (int l = 0; l < p->n_layers; l++) p->crc_ok[(size_t)l * p->n_blocks + b] = 0;
    if (p->hash[b]) {
        tab_remove(p, p->hash[b], b);
        p->hash[b] = 0;
    }
    p->ref[b] = 1;
    return b;
}

void kv_ref(kv_pool *p, int block)
{
    TD_ASSERT(block >= 0 && block < p->n_blocks);
    if (p->ref[block] == 0) queue_unlink(p, block);
    p->ref[block]++;
}

void kv_release(kv_pool *p, int block)
{
    TD_ASSERT(block >= 0 && block < p->n_blocks && p->ref[block] > 0);
    if (--p->ref[block] > 0) return;
    /* Uncached blocks are handed out first; cached ones wait at the back for a hit. */
    if (p->hash[block]) queue_push_back(p, block);
    else queue_push_front(p, block);
}

uint64_t kv_block_hash(uint64_t parent, const int32_t *tokens, int n)
{
    uint64_t h = td_hash64(tokens, (size_t)n * sizeof(int32_t), parent);
    return h > TAB_TOMB ? h : h + 2; /* 0 and 1 are reserved by the index */
}

int kv_lookup(kv_pool *p, uint64_t hash)
{
    int b = tab_find(p, hash, NULL);
    if (b >= 0) kv_ref(p, b);
    return b;
}

void kv_register(kv_pool *p, int block, uint64_t hash)
{
    TD_ASSERT(block >= 0 && block < p->n_blocks);
    if (p->hash[block]) return;
    if (tab_insert(p, hash, block)) p->hash[block] = hash;
}

void kv_reset_index(kv_pool *p)
{
    memset(p->hash, 0, (size_t)p->n_blocks * sizeof(uint64_t));
    memset(p->tab_key, 0, p->tab_cap * sizeof(uint64_t));
    p->n_cached = 0;
}
