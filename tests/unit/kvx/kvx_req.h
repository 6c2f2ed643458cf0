/*
 * tests/unit/kvx/kvx_req.h - a read request for blocks of a local producer agent, shared by
 * the kvx transport tests (whose fixtures differ).
 */
#ifndef TD_TESTS_KVX_REQ_H
#define TD_TESTS_KVX_REQ_H

#include "kvx/kvx.h"

static inline kvx_read_req req_for(kvx_agent *agent, const char *tid, const int32_t *src,
                                   const int32_t *dst, int n, uint32_t timeout_ms)
{
    return (kvx_read_req){.host = "127.0.0.1",
                          .port = kvx_agent_port(agent),
                          .engine_id = kvx_agent_engine_id(agent),
                          .transfer_id = tid,
                          .src_blocks = src,
                          .dst_blocks = dst,
                          .n_blocks = n,
                          .timeout_ms = timeout_ms};
}

#endif
