/* Dropout's keep-mask on CPU: counter-based random numbers, drawn on every thread.

Why C: PyTorch draws CPU random numbers one at a time from one Mersenne Twister (its
Bernoulli draw uses MKL's parallel generator on Intel CPUs only), so a small model's
dropout masks cost as much as some of its matmuls. Here element pairs are independent:
pair j's 64 random bits are splitmix64's j-th output from a seed (a 64-bit draw from
PyTorch's generator, so `torch.manual_seed` still fixes the masks), and the threads
split the pairs in any way: the mask does not depend on the thread count.

mask[i] = scale if its 32 random bits >= threshold, else 0, with threshold = p * 2^32
(rounded by the caller): an element is dropped with probability p to within 2^-32.
*/
#include <omp.h>
#include <stdint.h>

static inline uint64_t splitmix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* out[0..n) = scale or 0, 0 where 32 random bits fall below threshold (= p * 2^32). */
int frawd_dropout_mask(float *out, int64_t n, uint64_t seed, uint64_t threshold, float scale, int threads) {
    const int64_t pairs = n / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t j = 0; j < pairs; j++) {
        uint64_t z = splitmix64(seed + (uint64_t)(j + 1) * 0x9E3779B97F4A7C15ull);
        out[2 * j] = (z & 0xFFFFFFFFull) >= threshold ? scale : 0.0f;
        out[2 * j + 1] = (z >> 32) >= threshold ? scale : 0.0f;
    }
    if (n % 2) {
        uint64_t z = splitmix64(seed + (uint64_t)(pairs + 1) * 0x9E3779B97F4A7C15ull);
        out[n - 1] = (z & 0xFFFFFFFFull) >= threshold ? scale : 0.0f;
    }
    return 0;
}
