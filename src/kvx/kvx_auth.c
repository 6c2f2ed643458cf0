/*
 * kvx/kvx_auth.c - the session challenge-response on a shared secret.
 *
 * After HELLO (consumer nonce Nc) and HELLO_ACK (producer nonce Np, feature bit "auth
 * required"), the consumer proves that it knows the token with
 *   MAC_c = HMAC-SHA256(token, "tandem-kvx-auth-v1 consumer" | Nc | Np | id_c | id_p)
 * and the producer answers with its own proof ("... producer" instead of "consumer"), so
 * each side knows the other holds the token, and both nonces bind the proofs to this
 * connection: a recorded exchange cannot be replayed. The hash is OpenSSL's.
 */
#include <string.h>

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include "kvx/kvx_internal.h"

void kvx__auth_mac(const char *token, bool producer, const uint8_t nc[KVX_ID_BYTES],
                   const uint8_t np[KVX_ID_BYTES], const uint8_t id_c[KVX_ID_BYTES],
                   const uint8_t id_p[KVX_ID_BYTES], uint8_t out[KVX_AUTH_MAC_BYTES])
{
    static const char label_c[] = "tandem-kvx-auth-v1 consumer";
    static const char label_p[] = "tandem-kvx-auth-v1 producer";
    uint8_t msg[sizeof(label_c) + 4 * KVX_ID_BYTES];
    size_t n = sizeof(label_c); /* both labels have the same length, NUL included */
    memcpy(msg, producer ? label_p : label_c, n);
    memcpy(msg + n, nc, KVX_ID_BYTES);
    memcpy(msg + n + 16, np, KVX_ID_BYTES);
    memcpy(msg + n + 32, id_c, KVX_ID_BYTES);
    memcpy(msg + n + 48, id_p, KVX_ID_BYTES);
    unsigned int len = 0;
    if (!HMAC(EVP_sha256(), token, (int)strlen(token), msg, sizeof(msg), out, &len) ||
        len != KVX_AUTH_MAC_BYTES)
        memset(out, 0, KVX_AUTH_MAC_BYTES); /* cannot happen with SHA-256; never matches a peer */
    OPENSSL_cleanse(msg, sizeof(msg));
}

bool kvx__auth_equal(const uint8_t a[KVX_AUTH_MAC_BYTES], const uint8_t b[KVX_AUTH_MAC_BYTES])
{
    return CRYPTO_memcmp(a, b, KVX_AUTH_MAC_BYTES) == 0;
}

void kvx__auth_wipe(void *p, size_t n)
{
    OPENSSL_cleanse(p, n);
}
