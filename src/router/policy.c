/*
 * router/policy.c - the five worker-selection policies of policy.h.
 *
 * Everything here runs on the router's event-loop thread, so there is no locking. The
 * state a policy keeps between picks is keyed by worker_id, never by a candidate's
 * index, because the candidate list changes from call to call.
 *
 * cache_aware keeps one approximate radix tree per worker: a character-level trie with
 * compressed edges holding the routing texts sent to that worker. "Approximate" because
 * it only answers "how long a prefix of this text did this worker see", which is all the
 * router needs to guess where a prompt's KV cache is still warm. All nodes of all trees
 * sit on one intrusive LRU list, and a node is always after all of its descendants on it
 * (a pick touches its path from the deepest node up to the root), so the head of the list
 * is always the least recently used leaf. Evicting the head keeps the trees within
 * max_tree_chars at O(1) per evicted node.
 *
 * prefix_hash keeps a consistent-hash ring: virtual_nodes points per worker, each the
 * hash of "<url>#<i>", sorted by hash. A key goes to the first point at or after it
 * (wrapping around), so removing a worker moves only the keys that were on its points.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "router/policy.h"
#include "util/td.h"

/* Hash seeds for ring points and keys: fixed, so that every router process (and every
 * restart) maps a prefix to the same worker. */
#define RING_SEED 0x7264706f6c696379ull
#define KEY_SEED 0x6b65797072656678ull

/* ---------------------------------------------------------------------------------------
 * cache_aware: radix trees
 * ------------------------------------------------------------------------------------- */

typedef struct ca_tree ca_tree;

typedef struct ca_node {
    struct ca_node *parent;    /* NULL for a tree's root */
    struct ca_node **children; /* n_children pointers, distinct first bytes */
    int n_children, cap_children;
    struct ca_node *lru_prev, *lru_next; /* the global LRU list; the root is not on it */
    ca_tree *tree;
    size_t edge_len; /* bytes of edge[]; 0 only for a root */
    char edge[];     /* the label of the edge from parent to this node */
} ca_node;

struct ca_tree {
    uint64_t worker_id;
    size_t chars; /* sum of edge_len over the tree's nodes */
    ca_node *root;
};

/* ---------------------------------------------------------------------------------------
 * prefix_hash: the ring
 * ------------------------------------------------------------------------------------- */

typedef struct ring_point {
    uint64_t hash;
    uint64_t worker_id;
} ring_point;

/* A candidate, sorted by worker_id, so that sets compare and ids map back to indices in
 * O(n log n). */
typedef struct cand_ref {
    uint64_t worker_id;
    int index; /* into the caller's cands[] */
} cand_ref;

struct rt_policy {
    rt_policy_opts o;
    td_rng rng;
    uint64_t rr_next; /* round_robin: picks so far */

    /* cache_aware */
    ca_tree **trees; /* sorted by worker_id */
    int n_trees, cap_trees;
    size_t total_chars;           /* over all trees; <= o.max_tree_chars after a pick */
    ca_node *lru_head, *lru_tail; /* head: least recently used */

    /* prefix_hash */
    ring_point *ring; /* sorted by (hash, worker_id) */
    size_t ring_len, ring_cap;
    uint64_t *ring_ids; /* sorted worker ids the ring was built from */
    int n_ring_ids, cap_ring_ids;
    bool ring_valid;
    cand_ref *refs; /* scratch: this pick's candidates sorted by worker_id */
    int cap_refs;
    char *url_buf; /* scratch: "<url>#<i>" */
    size_t cap_url_buf;
};

/* Grow *buf to hold at least need elements of size elem. 0 or TD_ENOMEM. */
static int grow(void **buf, size_t *cap, size_t need, size_t elem)
{
    if (need <= *cap) return 0;
    size_t c = TD_MAX(*cap * 2, TD_MAX(need, (size_t)8));
    void *b = realloc(*buf, c * elem);
    if (!b) return TD_ENOMEM;
    *buf = b;
    *cap = c;
    return 0;
}

static int grow_int(void **buf, int *cap, int need, size_t elem)
{
    size_t c = (size_t)*cap;
    int rc = grow(buf, &c, (size_t)need, elem);
    if (!rc) *cap = (int)TD_MIN(c, (size_t)1 << 30);
    return rc;
}

/* The load a balance decision looks at: what the router sent plus what the worker last
 * said it runs and queues (unknown counts as 0). */
static long long cand_load(const rt_candidate *c)
{
    return (long long)c->in_flight + TD_MAX(c->reported_load, 0);
}

/* ---------------------------------------------------------------------------------------
 * Names and options
 * ------------------------------------------------------------------------------------- */

static const char *const POLICY_NAMES[] = {"random", "round_robin", "power_of_two", "cache_aware",
                                           "prefix_hash"};

int rt_policy_parse(const char *name, rt_policy_kind *out)
{
    if (!name) return -1;
    for (size_t i = 0; i < TD_ARRAY_LEN(POLICY_NAMES); i++)
        if (!strcmp(name, POLICY_NAMES[i])) {
            if (out) *out = (rt_policy_kind)i;
            return 0;
        }
    return -1;
}

const char *rt_policy_name(rt_policy_kind k)
{
    if ((unsigned)k >= TD_ARRAY_LEN(POLICY_NAMES)) return "unknown";
    return POLICY_NAMES[k];
}

void rt_policy_opts_default(rt_policy_opts *o, rt_policy_kind kind)
{
    *o = (rt_policy_opts){.kind = kind,
                          .seed = 0,
                          .cache_threshold = 0.5,
                          .balance_abs_threshold = 32,
                          .balance_rel_threshold = 1.1,
                          .max_tree_chars = (size_t)1 << 24,
                          .prefix_bytes = 256,
                          .virtual_nodes = 160};
}

int rt_policy_create(rt_policy **out, const rt_policy_opts *o)
{
    if (!out) return TD_EINVAL;
    *out = NULL;
    if (!o || (unsigned)o->kind > RT_POLICY_PREFIX_HASH) return TD_EINVAL;
    if (!isfinite(o->cache_threshold) || o->cache_threshold < 0) return TD_EINVAL;
    if (!isfinite(o->balance_rel_threshold) || o->balance_rel_threshold < 1) return TD_EINVAL;
    if (o->balance_abs_threshold < 0) return TD_EINVAL;
    if (o->virtual_nodes < 1 || o->virtual_nodes > 4096) return TD_EINVAL;
    if (o->prefix_bytes < 1 || o->max_tree_chars < 1) return TD_EINVAL;
    rt_policy *p = calloc(1, sizeof(*p));
    if (!p) return TD_ENOMEM;
    p->o = *o;
    td_rng_seed(&p->rng, o->seed);
    *out = p;
    return 0;
}

/* ---------------------------------------------------------------------------------------
 * Radix trees
 * ------------------------------------------------------------------------------------- */

static void lru_unlink(rt_policy *p, ca_node *x)
{
    if (x->lru_prev)
        x->lru_prev->lru_next = x->lru_next;
    else
        p->lru_head = x->lru_next;
    if (x->lru_next)
        x->lru_next->lru_prev = x->lru_prev;
    else
        p->lru_tail = x->lru_prev;
    x->lru_prev = x->lru_next = NULL;
}

static void lru_push_tail(rt_policy *p, ca_node *x)
{
    x->lru_prev = p->lru_tail;
    x->lru_next = NULL;
    if (p->lru_tail)
        p->lru_tail->lru_next = x;
    else
        p->lru_head = x;
    p->lru_tail = x;
}

/* Put y right after x on the LRU list (x is on it). */
static void lru_insert_after(rt_policy *p, ca_node *x, ca_node *y)
{
    y->lru_prev = x;
    y->lru_next = x->lru_next;
    if (x->lru_next)
        x->lru_next->lru_prev = y;
    else
        p->lru_tail = y;
    x->lru_next = y;
}

static ca_node *node_new(ca_tree *t, ca_node *parent, const char *edge, size_t len)
{
    ca_node *x = calloc(1, sizeof(*x) + len);
    if (!x) return NULL;
    x->tree = t;
    x->parent = parent;
    x->edge_len = len;
    if (len) memcpy(x->edge, edge, len);
    return x;
}

static int node_child_index(const ca_node *x, unsigned char first)
{
    for (int i = 0; i < x->n_children; i++)
        if ((unsigned char)x->children[i]->edge[0] == first) return i;
    return -1;
}

static int node_add_child(ca_node *x, ca_node *child)
{
    if (grow_int((void **)&x->children, &x->cap_children, x->n_children + 1, sizeof(ca_node *)))
        return TD_ENOMEM;
    x->children[x->n_children++] = child;
    return 0;
}

static size_t common_prefix(const char *a, size_t alen, const char *b, size_t blen)
{
    size_t n = TD_MIN(alen, blen), i = 0;
    while (i < n && a[i] == b[i])
        i++;
    return i;
}

static int tree_find(const rt_policy *p, uint64_t worker_id)
{
    int lo = 0, hi = p->n_trees;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (p->trees[mid]->worker_id < worker_id)
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static ca_tree *tree_get(const rt_policy *p, uint64_t worker_id)
{
    int i = tree_find(p, worker_id);
    return i < p->n_trees && p->trees[i]->worker_id == worker_id ? p->trees[i] : NULL;
}

static ca_tree *tree_get_or_add(rt_policy *p, uint64_t worker_id)
{
    int i = tree_find(p, worker_id);
    if (i < p->n_trees && p->trees[i]->worker_id == worker_id) return p->trees[i];
    if (grow_int((void **)&p->trees, &p->cap_trees, p->n_trees + 1, sizeof(ca_tree *))) return NULL;
    ca_tree *t = calloc(1, sizeof(*t));
    if (!t) return NULL;
    t->worker_id = worker_id;
    t->root = node_new(t, NULL, NULL, 0);
    if (!t->root) {
        free(t);
        return NULL;
    }
    memmove(p->trees + i + 1, p->trees + i, (size_t)(p->n_trees - i) * sizeof(ca_tree *));
    p->trees[i] = t;
    p->n_trees++;
    return t;
}

/* Free top and everything under it, taking the nodes off the LRU list. Iterative, through
 * the parent pointers: a tree grown by ever longer prefixes of one text can be as deep as
 * it has nodes, which is too deep for the stack. */
static void node_free_subtree(rt_policy *p, ca_node *top)
{
    ca_node *x = top;
    for (;;) {
        if (x->n_children > 0) {
            x = x->children[--x->n_children];
            continue;
        }
        ca_node *parent = x->parent;
        bool last = x == top;
        if (parent) {
            lru_unlink(p, x);
            x->tree->chars -= x->edge_len;
            p->total_chars -= x->edge_len;
        }
        free(x->children);
        free(x);
        if (last) return;
        x = parent;
    }
}

static void tree_remove_at(rt_policy *p, int i)
{
    ca_tree *t = p->trees[i];
    node_free_subtree(p, t->root);
    free(t);
    memmove(p->trees + i, p->trees + i + 1, (size_t)(p->n_trees - i - 1) * sizeof(ca_tree *));
    p->n_trees--;
}

/* Bytes of text[0 .. len) that tree t has seen as a prefix. */
static size_t tree_match(const ca_tree *t, const char *text, size_t len)
{
    const ca_node *x = t->root;
    size_t pos = 0;
    while (pos < len) {
        int ci = node_child_index(x, (unsigned char)text[pos]);
        if (ci < 0) break;
        const ca_node *c = x->children[ci];
        size_t m = common_prefix(c->edge, c->edge_len, text + pos, len - pos);
        pos += m;
        if (m < c->edge_len) break;
        x = c;
    }
    return pos;
}

/* Evict least recently used leaves until all trees together fit max_tree_chars. */
static void trees_evict(rt_policy *p)
{
    while (p->total_chars > p->o.max_tree_chars && p->lru_head) {
        ca_node *x = p->lru_head;
        /* The list order puts every node after its descendants, so the head is a leaf. */
        TD_ASSERT(x->n_children == 0);
        ca_node *parent = x->parent;
        ca_tree *t = x->tree;
        int ci = node_child_index(parent, (unsigned char)x->edge[0]);
        TD_ASSERT(ci >= 0 && parent->children[ci] == x);
        parent->children[ci] = parent->children[--parent->n_children];
        node_free_subtree(p, x);
        /* A parent left with one child keeps its own edge rather than merging with the
         * child: matches stay exact, and the next split or eviction tidies it. */
        if (t->chars == 0) tree_remove_at(p, tree_find(p, t->worker_id));
    }
}

/*
 * Teach worker_id's tree text[0 .. len): walk down, split the edge where the text leaves
 * it, hang the rest as a new leaf, then mark the whole path most recently used (deepest
 * first, so that parents stay behind their children on the LRU list). Allocation failure
 * only means the tree learns less.
 */
static void tree_learn(rt_policy *p, uint64_t worker_id, const char *text, size_t len)
{
    /* A text longer than the whole budget would only evict itself. */
    len = TD_MIN(len, p->o.max_tree_chars);
    if (len == 0) return;
    ca_tree *t = tree_get_or_add(p, worker_id);
    if (!t) return;
    ca_node *x = t->root;
    size_t pos = 0;
    while (pos < len) {
        int ci = node_child_index(x, (unsigned char)text[pos]);
        if (ci < 0) {
            ca_node *leaf = node_new(t, x, text + pos, len - pos);
            if (!leaf) break;
            if (node_add_child(x, leaf)) {
                free(leaf);
                break;
            }
            lru_push_tail(p, leaf);
            t->chars += len - pos;
            p->total_chars += len - pos;
            x = leaf;
            break;
        }
        ca_node *c = x->children[ci];
        size_t m = common_prefix(c->edge, c->edge_len, text + pos, len - pos);
        if (m < c->edge_len) {
            /* Split c's edge at m: x -> mid (edge[0 .. m)) -> c (edge[m ..)). */
            ca_node *mid = node_new(t, x, c->edge, m);
            if (!mid) break;
            if (node_add_child(mid, c)) {
                free(mid);
                break;
            }
            x->children[ci] = mid;
            memmove(c->edge, c->edge + m, c->edge_len - m);
            c->edge_len -= m;
            c->parent = mid;
            lru_insert_after(p, c, mid); /* behind its only child */
        }
        x = x->children[ci];
        pos += m;
    }
    for (ca_node *y = x; y->parent; y = y->parent) {
        lru_unlink(p, y);
        lru_push_tail(p, y);
    }
    trees_evict(p);
}

/* ---------------------------------------------------------------------------------------
 * The policies
 * ------------------------------------------------------------------------------------- */

static int pick_random(rt_policy *p, int n)
{
    return (int)(td_rng_next(&p->rng) % (uint64_t)n);
}

static int pick_round_robin(rt_policy *p, int n)
{
    return (int)(p->rr_next++ % (uint64_t)n);
}

/* Lighter by load, then fewer in flight; a tie keeps a. */
static int lighter(const rt_candidate *cands, int a, int b)
{
    long long la = cand_load(&cands[a]), lb = cand_load(&cands[b]);
    if (lb != la) return lb < la ? b : a;
    return cands[b].in_flight < cands[a].in_flight ? b : a;
}

static int pick_power_of_two(rt_policy *p, const rt_candidate *cands, int n)
{
    if (n == 1) return 0;
    int a = (int)(td_rng_next(&p->rng) % (uint64_t)n);
    int b = (int)(td_rng_next(&p->rng) % (uint64_t)(n - 1));
    if (b >= a) b++;
    return lighter(cands, a, b);
}

static int pick_cache_aware(rt_policy *p, const rt_candidate *cands, int n, const char *text,
                            size_t len)
{
    int least = 0;
    long long min_load = cand_load(&cands[0]), max_load = min_load;
    for (int i = 1; i < n; i++) {
        long long l = cand_load(&cands[i]);
        max_load = TD_MAX(max_load, l);
        min_load = TD_MIN(min_load, l);
        least = lighter(cands, least, i);
    }
    int pick;
    if (max_load - min_load > p->o.balance_abs_threshold &&
        (double)max_load > p->o.balance_rel_threshold * (double)min_load) {
        pick = least;
    } else {
        int best = 0, smallest = 0;
        size_t best_match = 0, smallest_chars = SIZE_MAX;
        for (int i = 0; i < n; i++) {
            const ca_tree *t = tree_get(p, cands[i].worker_id);
            size_t m = t ? tree_match(t, text, len) : 0;
            size_t chars = t ? t->chars : 0;
            if (m > best_match) best_match = m, best = i;
            if (chars < smallest_chars) smallest_chars = chars, smallest = i;
        }
        double rate = len ? (double)best_match / (double)len : 0.0;
        pick = rate > p->o.cache_threshold ? best : smallest;
    }
    tree_learn(p, cands[pick].worker_id, text, len);
    return pick;
}

static int cmp_ref(const void *a, const void *b)
{
    const cand_ref *x = a, *y = b;
    if (x->worker_id != y->worker_id) return x->worker_id < y->worker_id ? -1 : 1;
    return x->index < y->index ? -1 : x->index > y->index;
}

static int cmp_point(const void *a, const void *b)
{
    const ring_point *x = a, *y = b;
    if (x->hash != y->hash) return x->hash < y->hash ? -1 : 1;
    return x->worker_id < y->worker_id ? -1 : x->worker_id > y->worker_id;
}

/* Rebuild the ring from the candidates in p->refs[0 .. n) (sorted, duplicates skipped). */
static int ring_rebuild(rt_policy *p, const rt_candidate *cands, int n)
{
    p->ring_valid = false;
    int vn = p->o.virtual_nodes;
    if (grow((void **)&p->ring, &p->ring_cap, (size_t)n * (size_t)vn, sizeof(ring_point)) ||
        grow_int((void **)&p->ring_ids, &p->cap_ring_ids, n, sizeof(uint64_t)))
        return TD_ENOMEM;
    p->ring_len = 0;
    p->n_ring_ids = 0;
    for (int k = 0; k < n; k++) {
        const cand_ref *r = &p->refs[k];
        if (k > 0 && r->worker_id == p->refs[k - 1].worker_id) continue;
        const char *url = cands[r->index].url ? cands[r->index].url : "";
        size_t ulen = strlen(url);
        if (grow((void **)&p->url_buf, &p->cap_url_buf, ulen + 16, 1)) return TD_ENOMEM;
        memcpy(p->url_buf, url, ulen);
        for (int i = 0; i < vn; i++) {
            int w = snprintf(p->url_buf + ulen, 16, "#%d", i);
            uint64_t h = td_hash64(p->url_buf, ulen + (size_t)w, RING_SEED);
            p->ring[p->ring_len++] = (ring_point){.hash = h, .worker_id = r->worker_id};
        }
        p->ring_ids[p->n_ring_ids++] = r->worker_id;
    }
    qsort(p->ring, p->ring_len, sizeof(ring_point), cmp_point);
    p->ring_valid = true;
    return 0;
}

static int pick_prefix_hash(rt_policy *p, const rt_candidate *cands, int n, const char *text,
                            size_t len)
{
    uint64_t key = td_hash64(text, TD_MIN(len, p->o.prefix_bytes), KEY_SEED);
    if (grow_int((void **)&p->refs, &p->cap_refs, n, sizeof(cand_ref)))
        return (int)(key % (uint64_t)n);
    for (int i = 0; i < n; i++)
        p->refs[i] = (cand_ref){.worker_id = cands[i].worker_id, .index = i};
    qsort(p->refs, (size_t)n, sizeof(cand_ref), cmp_ref);

    /* Same set of workers as last time? Then the ring still holds. */
    bool same = p->ring_valid;
    int u = 0;
    for (int k = 0; k < n && same; k++) {
        if (k > 0 && p->refs[k].worker_id == p->refs[k - 1].worker_id) continue;
        same = u < p->n_ring_ids && p->ring_ids[u] == p->refs[k].worker_id;
        u++;
    }
    same = same && u == p->n_ring_ids;
    if (!same && ring_rebuild(p, cands, n)) return (int)(key % (uint64_t)n);

    /* The first point at or after key, wrapping around. */
    size_t lo = 0, hi = p->ring_len;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        if (p->ring[mid].hash < key)
            lo = mid + 1;
        else
            hi = mid;
    }
    uint64_t id = p->ring[lo == p->ring_len ? 0 : lo].worker_id;

    /* Back to an index: the first candidate with that id. */
    int a = 0, b = n;
    while (a < b) {
        int mid = a + (b - a) / 2;
        if (p->refs[mid].worker_id < id)
            a = mid + 1;
        else
            b = mid;
    }
    TD_ASSERT(a < n && p->refs[a].worker_id == id);
    return p->refs[a].index;
}

int rt_policy_pick(rt_policy *p, const rt_candidate *cands, int n, const char *text, size_t len)
{
    if (!p || !cands || n < 1) return TD_EINVAL;
    if (!text) len = 0;
    if (len == 0) text = "";
    switch (p->o.kind) {
    case RT_POLICY_RANDOM:
        return pick_random(p, n);
    case RT_POLICY_ROUND_ROBIN:
        return pick_round_robin(p, n);
    case RT_POLICY_POWER_OF_TWO:
        return pick_power_of_two(p, cands, n);
    case RT_POLICY_CACHE_AWARE:
        return pick_cache_aware(p, cands, n, text, len);
    case RT_POLICY_PREFIX_HASH:
        return pick_prefix_hash(p, cands, n, text, len);
    }
    return 0;
}

void rt_policy_forget(rt_policy *p, uint64_t worker_id)
{
    if (!p) return;
    int i = tree_find(p, worker_id);
    if (i < p->n_trees && p->trees[i]->worker_id == worker_id) tree_remove_at(p, i);
    /* The ring is rebuilt on the next pick: dropping one worker's points from the sorted
     * ring in place would cost as much. */
    for (int k = 0; k < p->n_ring_ids; k++)
        if (p->ring_ids[k] == worker_id) p->ring_valid = false;
}

void rt_policy_free(rt_policy *p)
{
    if (!p) return;
    while (p->n_trees > 0)
        tree_remove_at(p, p->n_trees - 1);
    free(p->trees);
    free(p->ring);
    free(p->ring_ids);
    free(p->refs);
    free(p->url_buf);
    free(p);
}
