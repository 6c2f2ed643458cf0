/*
 * router/policy.h - choosing a worker for a request, per role (prefill, decode, or a
 * plain worker). Pure: no I/O, no threads, no clocks; the router's event loop calls it
 * on one thread. Randomness comes from the policy's own seeded PRNG, so tests are
 * deterministic.
 *
 * Policies (names as atomesh and sgl-router spell them):
 *  - random;
 *  - round_robin: candidates in the order given, one step per pick;
 *  - power_of_two: two distinct candidates drawn at random, the lighter one by
 *    in_flight + max(reported_load, 0) (ties: fewer in_flight, then the first drawn);
 *  - cache_aware: sgl-router's approximate prefix tree per worker. If the load is
 *    imbalanced (max - min > balance_abs_threshold and max > balance_rel_threshold * min,
 *    over in_flight + reported load), the least loaded candidate; otherwise the candidate
 *    whose tree matches the longest prefix of the text, if the match covers more than
 *    cache_threshold of the text, else the candidate with the smallest tree. The chosen
 *    worker's tree then learns the text. Trees are bounded by max_tree_chars in all
 *    (least recently used leaves are evicted first);
 *  - prefix_hash: consistent hashing (a ring of virtual nodes per worker, keyed by its
 *    URL) of the first prefix_bytes bytes of the text, so the same prefix goes to the
 *    same worker, and adding or removing a worker moves only its share of the keys.
 */
#ifndef TD_ROUTER_POLICY_H
#define TD_ROUTER_POLICY_H

#include <stddef.h>
#include <stdint.h>

typedef enum rt_policy_kind {
    RT_POLICY_RANDOM = 0,
    RT_POLICY_ROUND_ROBIN,
    RT_POLICY_POWER_OF_TWO,
    RT_POLICY_CACHE_AWARE,
    RT_POLICY_PREFIX_HASH,
} rt_policy_kind;

/** "random", "round_robin", "power_of_two", "cache_aware", "prefix_hash": 0, else -1. */
int rt_policy_parse(const char *name, rt_policy_kind *out);
const char *rt_policy_name(rt_policy_kind k);

/** One eligible worker (healthy, breaker not open), as the router sees it now. */
typedef struct rt_candidate {
    uint64_t worker_id; /* stable while the worker is registered; never reused */
    const char *url;    /* base URL, e.g. "http://127.0.0.1:8010" (the hashing key) */
    int in_flight;      /* requests the router has in flight there */
    int reported_load;  /* running + waiting from the worker's last report, less the
                         * requests this router had in flight there then (those are in
                         * in_flight already); -1 unknown */
} rt_candidate;

typedef struct rt_policy_opts {
    rt_policy_kind kind;
    uint64_t seed;                /* PRNG seed (0 is a valid seed) */
    double cache_threshold;       /* cache_aware: 0.5 */
    int balance_abs_threshold;    /* cache_aware: 32 */
    double balance_rel_threshold; /* cache_aware: 1.1 */
    size_t max_tree_chars;        /* cache_aware: all trees together; 1 << 24 */
    size_t prefix_bytes;          /* prefix_hash: 256 */
    int virtual_nodes;            /* prefix_hash: ring points per worker; 160 */
} rt_policy_opts;

/** Defaults as documented above for kind. */
void rt_policy_opts_default(rt_policy_opts *o, rt_policy_kind kind);

typedef struct rt_policy rt_policy;

/** 0, or TD_EINVAL (bad thresholds) / TD_ENOMEM. */
int rt_policy_create(rt_policy **out, const rt_policy_opts *o);
void rt_policy_free(rt_policy *p);

/**
 * Pick one of cands[0 .. n) (n >= 1) for a request whose routing text is text[0 .. len)
 * (the prompt as sent: a string, or the chat messages' contents joined; len may be 0).
 * Returns an index in [0, n). Candidates may differ from call to call (workers come,
 * go, trip their breakers); state is keyed by worker_id.
 */
int rt_policy_pick(rt_policy *p, const rt_candidate *cands, int n, const char *text, size_t len);

/** A worker left the registry: drop what the policy keeps for it (tree, ring points). */
void rt_policy_forget(rt_policy *p, uint64_t worker_id);

#endif
