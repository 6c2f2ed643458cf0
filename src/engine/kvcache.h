/*
 * engine/kvcache.h - the paged KV cache: a pool of fixed-size blocks, their
 * reference counts, and the prefix-cache index.
 *
 * Memory layout (designed for transfer): one contiguous region per layer,
 *
 *   base + layer * layer_bytes + block * block_bytes
 *        -> K[block_size][kv_dim] then V[block_size][kv_dim]   (elements of `dtype`)
 *
 * so the blocks of a request with consecutive ids form one contiguous byte range
 * per layer, and a transfer engine can move a request as a few (offset, length)
 * ranges per layer without knowing anything about models.
 *
 * Block states: referenced (ref > 0), or free (ref == 0) and then on the free
 * queue. Free blocks that still hold a registered prefix-cache hash keep their
 * contents and stay findable until they are reused; the queue hands out
 * never-cached blocks first and cached ones in least-recently-freed order.
 */
#ifndef TD_ENGINE_KVCACHE_H
#define TD_ENGINE_KVCACHE_H

#include "model/types.h"
#include "util/td.h"

typedef struct kv_pool {
    int n_layers, kv_dim, block_size, n_blocks;
    td_type dtype;
    size_t token_bytes; /* one token's K (or V) row: kv_dim elements */
    size_t block_bytes; /* 2 * block_size * token_bytes */
    size_t layer_bytes; /* n_blocks * block_bytes */
    uint8_t *base;      /* n_layers * layer_bytes, 64-byte aligned */
    size_t total_bytes;
    int fd;             /* the memfd holding the pool when shareable, else -1 */

    int32_t *ref;       /* [n_blocks] */
    uint64_t *hash;     /* [n_blocks], 0 = not in the prefix index */
    int32_t *prev, *next; /* free queue links, -1 terminated */
    int32_t head, tail;
    int n_free;
    int n_cached;       /* blocks registered in the index */

    /* Block checksums (kv_pool_keep_checksums; NULL otherwise): CRC32C of every full
     * block's bytes in every layer, [layer * n_blocks + block], valid where crc_ok is 1.
     * Computed by the forward pass when a block's last slot is written, cleared when the
     * block is handed out again, so a transfer need not read the block twice. */
    uint32_t *crc;
    uint8_t *crc_ok;

    uint64_t *tab_key;  /* prefix index: open addressing, key 0 = empty, 1 = tombstone */
    int32_t *tab_val;
    size_t tab_cap;     /* power of two */
} kv_pool;

/** Bytes that a pool of n_blocks needs (for memory planning). */
size_t kv_pool_bytes(int n_layers, int kv_dim, int block_size, td_type dtype, int64_t n_blocks);

/**
 * shareable: put the pool in a memfd (p->fd) so that a same-host transfer peer can map
 * it; otherwise it is private anonymous memory.
 */
int kv_pool_init(kv_pool *p, int n_layers, int kv_dim, int block_size, td_type dtype,
                 int n_blocks, bool shareable, td_err *err);

/**
 * Commit every page of the pool now (MADV_POPULATE_WRITE; contents untouched), so that
 * nothing pays first-touch page faults later: a KV consumer receives whole prompts into
 * fresh blocks, and faulting them in during the copy cost about 3x its time. Best effort.
 */
void kv_pool_prefault(kv_pool *p);
void kv_pool_free(kv_pool *p);
/** Keep block checksums from now on (see kv_pool.crc). TD_ENOMEM, or 0. */
int kv_pool_keep_checksums(kv_pool *p, td_err *err);

/** Take a free block (ref becomes 1), evicting its cached hash if it had one; -1 if none. */
int kv_alloc(kv_pool *p);
/** Add a reference to a block (prefix sharing). */
void kv_ref(kv_pool *p, int block);
/** Drop a reference; at zero the block goes to the free queue (keeping its hash). */
void kv_release(kv_pool *p, int block);

/** Chain hash of a full block: depends on the parent block's hash and the tokens. */
uint64_t kv_block_hash(uint64_t parent, const int32_t *tokens, int n);
/** Find a cached block by hash; on a hit its reference count is incremented. -1 on miss. */
int kv_lookup(kv_pool *p, uint64_t hash);
/** Register a full block under its hash (no-op if the hash is already indexed). */
void kv_register(kv_pool *p, int block, uint64_t hash);
/** Forget every cached hash (e.g. when prefix caching is off). */
void kv_reset_index(kv_pool *p);

static inline uint8_t *kv_k(const kv_pool *p, int layer, int block)
{
    return p->base + (size_t)layer * p->layer_bytes + (size_t)block * p->block_bytes;
}

static inline uint8_t *kv_v(const kv_pool *p, int layer, int block)
{
    return kv_k(p, layer, block) + (size_t)p->block_size * p->token_bytes;
}

#endif
