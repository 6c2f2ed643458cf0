/*
 * util/crc32c.h - CRC32C (Castagnoli), the checksum of KV blocks.
 */
#ifndef TD_UTIL_CRC32C_H
#define TD_UTIL_CRC32C_H

#include <stddef.h>
#include <stdint.h>

/** CRC32C (Castagnoli) of n bytes, continuing from crc (start with 0). */
uint32_t td_crc32c(uint32_t crc, const void *data, size_t n);
/** The portable version (used where SSE4.2 is missing, and by tests to cross-check). */
uint32_t td_crc32c_portable(uint32_t crc, const void *data, size_t n);
/** CRC32C of `count` consecutive blocks of `block_bytes` each at p: one CRC per block. */
void td_crc32c_blocks(const uint8_t *p, uint64_t block_bytes, uint32_t count, uint32_t *out);
/**
 * Copy `count` blocks of `block_bytes` from src to dst (not overlapping) and checksum them
 * as td_crc32c_blocks(dst) would; with the pclmulqdq fold, in one pass over src.
 */
void td_crc32c_copy_blocks(uint8_t *dst, const uint8_t *src, uint64_t block_bytes, uint32_t count,
                           uint32_t *out);

/*
 * Use CRC32C implementation impl (0 portable, 1 the crc32 instruction, 2 pclmulqdq
 * folding, 3 the same folding four lanes at a time with AVX-512) from now on; returns the one used
 * before, or -1 if this CPU lacks impl. For tests, with no checksum running.
 */
int td_crc32c_use(int impl);

#endif
