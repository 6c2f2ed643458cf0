/*
 * bench/bench_crc32c.c - throughput of the CRC32C implementations that kvx checksums KV
 * blocks with (util/crc32c.c), on the block size the transfer benchmarks use.
 *
 *   bench_crc32c [block-bytes (8192)] [MiB (1)]
 *
 * For each implementation this CPU has (1 the crc32 instruction, 2 the pclmulqdq fold, 3
 * the four-lane vpclmulqdq fold), prints GB/s of td_crc32c_blocks (checksum only) and of
 * td_crc32c_copy_blocks (copy and checksum in one pass, the shm consumer's), best of 50
 * passes over the same buffer (so it is in the caches when it fits: 1 MiB is about the
 * L2), and which one start-up picked.
 */
#include <stdio.h>
#include <stdlib.h>

#include "util/crc32c.h"
#include "util/td.h"

int main(int argc, char **argv)
{
    size_t block = argc > 1 ? strtoul(argv[1], NULL, 10) : 8192;
    size_t mib = argc > 2 ? strtoul(argv[2], NULL, 10) : 1;
    if (block < 1 || block > (64u << 20) || mib < 1 || mib > 4096) {
        fprintf(stderr, "usage: bench_crc32c [block-bytes 1..64M] [MiB 1..4096]\n");
        return 2;
    }
    size_t count = (mib << 20) / block, n = count * block;
    if (count == 0) count = 1, n = block;
    uint8_t *src = malloc(n), *dst = malloc(n);
    uint32_t *out = malloc(count * sizeof(*out));
    if (!src || !dst || !out) {
        fprintf(stderr, "bench_crc32c: out of memory\n");
        return 1;
    }
    for (size_t i = 0; i < n; i++)
        src[i] = (uint8_t)(i * 2654435761u >> 13);
    const int picked = td_crc32c_use(0);
    static const char *const names[] = {"portable", "crc32 instruction", "pclmulqdq fold",
                                        "vpclmulqdq fold (AVX-512)"};
    printf("%zu blocks of %zu bytes; start-up picked %d (%s)\n", count, block, picked,
           names[picked]);
    printf("%-28s %14s %16s\n", "implementation", "crc GB/s", "copy+crc GB/s");
    for (int impl = 0; impl <= 3; impl++) {
        if (td_crc32c_use(impl) < 0) continue;
        double best[2] = {1e30, 1e30};
        for (int copy = 0; copy < 2; copy++)
            for (int t = 0; t < 50; t++) {
                uint64_t t0 = td_now_ns();
                if (copy)
                    td_crc32c_copy_blocks(dst, src, block, (uint32_t)count, out);
                else
                    td_crc32c_blocks(src, block, (uint32_t)count, out);
                double s = (double)(td_now_ns() - t0) / 1e9;
                if (s < best[copy]) best[copy] = s;
            }
        printf("%d %-26s %14.1f %16.1f\n", impl, names[impl], (double)n / best[0] / 1e9,
               (double)n / best[1] / 1e9);
    }
    td_crc32c_use(picked);
    free(src);
    free(dst);
    free(out);
    return 0;
}
