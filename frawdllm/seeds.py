"""Seeds as torch's CPU generator can tell them apart.

Its Mersenne Twister keeps a seed's low 32 bits: seeds k x 2^32 apart, and -1 beside
2^32 - 1, drew the same numbers, though the project takes any seed in [0, 2^64) (and the
server any int64). `torch_seed` leaves a seed in [0, 2^32) as it is and hashes any other
int into that range, so seeds that differ draw differently (two of them still meet, at
random, with probability 2^-32: the generator has no more streams than that).
"""

from __future__ import annotations

import hashlib

SEED_RANGE = 2**32


def torch_seed(seed: int) -> int:
    """`seed` for `torch.manual_seed` / `Generator.manual_seed` (and numpy's legacy seed)."""
    if 0 <= seed < SEED_RANGE:
        return seed
    raw = seed.to_bytes((seed.bit_length() + 8) // 8, "little", signed=True)
    return int.from_bytes(hashlib.blake2b(raw, digest_size=4, person=b"frawd-seed").digest(), "little")
