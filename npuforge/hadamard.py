"""Orthogonal matrices for exact rotations: Hadamard matrices where the size allows one,
seeded random orthogonal matrices elsewhere.

A Hadamard matrix H of order n has entries +-1 and H H^T = n I, so H / sqrt(n) is
orthogonal and spreads every input channel evenly over every output channel: an outlier
channel of a rotated tensor is shared by all of them. Its entries all have one
magnitude, so a weight quantizer keeps the rotation itself without loss.

Orders built here (n a multiple of 4, or 1 or 2):

* Sylvester: 2, and Kronecker products (H_a kron H_b is a Hadamard matrix of order ab);
* Paley I: q + 1 for a prime q = 3 (mod 4) (12, 20, 24, 32, 44, 48, 60, ...);
* Paley II: 2 (q + 1) for a prime q = 1 (mod 4) (12, 28, 36, 60, 76, ...);

and every product of those orders (576 = 12 * 48, 1536 = 12 * 128, 896 = 28 * 32, 4864 =
76 * 64). Paley's constructions over prime powers that are not primes are left out.
"""

import functools
import math

import numpy as np

from npuforge.errors import NpuforgeError


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    return all(n % d for d in range(2, math.isqrt(n) + 1))


def _jacobsthal(q: int) -> np.ndarray:
    """Q[i, j] = chi(j - i) over the integers mod prime q (chi: the quadratic character)."""
    squares = np.zeros(q, dtype=np.int64)
    squares[[(x * x) % q for x in range(1, q)]] = 1
    chi = np.where(squares == 1, 1, -1)
    chi[0] = 0
    index = (np.arange(q)[None, :] - np.arange(q)[:, None]) % q
    return chi[index]


def _paley_one(q: int) -> np.ndarray:
    """Order q + 1 for a prime q = 3 (mod 4): I + [[0, 1^T], [-1, Q]] (Q antisymmetric)."""
    n = q + 1
    s = np.zeros((n, n), dtype=np.int64)
    s[0, 1:], s[1:, 0] = 1, -1
    s[1:, 1:] = _jacobsthal(q)
    return np.eye(n, dtype=np.int64) + s


def _paley_two(q: int) -> np.ndarray:
    """Order 2 (q + 1) for a prime q = 1 (mod 4), from the symmetric conference matrix
    C = [[0, 1^T], [1, Q]]: each 0 becomes [[1, -1], [-1, -1]], each +-1 +-[[1, 1], [1, -1]]."""
    n = q + 1
    c = np.zeros((n, n), dtype=np.int64)
    c[0, 1:], c[1:, 0] = 1, 1
    c[1:, 1:] = _jacobsthal(q)
    zero = np.array([[1, -1], [-1, -1]])
    unit = np.array([[1, 1], [1, -1]])
    return np.kron(c, unit) + np.kron(np.eye(n, dtype=np.int64), zero)


def _base(n: int):
    """A Hadamard matrix of order n from one construction, else None."""
    if n == 1:
        return np.ones((1, 1), dtype=np.int64)
    if n == 2:
        return np.array([[1, 1], [1, -1]], dtype=np.int64)
    if n % 4:
        return None
    if _is_prime(n - 1) and (n - 1) % 4 == 3:
        return _paley_one(n - 1)
    if _is_prime(n // 2 - 1) and (n // 2 - 1) % 4 == 1:
        return _paley_two(n // 2 - 1)
    return None


@functools.cache
def _factors(n: int):
    """Orders with a base construction whose product is n, else None."""
    if _base(n) is not None:
        return (n,)
    for d in range(2, math.isqrt(n) + 1):
        if n % d:
            continue
        for first, second in ((d, n // d), (n // d, d)):
            if _base(first) is not None:
                rest = _factors(second)
                if rest is not None:
                    return (first, *rest)
    return None


def has_hadamard(n: int) -> bool:
    return n >= 1 and _factors(n) is not None


def hadamard(n: int) -> np.ndarray:
    """A Hadamard matrix of order n (int64 entries +-1), or a one-line error."""
    factors = _factors(n) if n >= 1 else None
    if factors is None:
        raise NpuforgeError(
            f"no Hadamard matrix of order {n} is built here (orders 1, 2 and products of "
            "Paley orders and 2); use a random orthogonal matrix"
        )
    matrix = np.ones((1, 1), dtype=np.int64)
    for order in factors:
        matrix = np.kron(matrix, _base(order))
    return matrix


def random_orthogonal(n: int, rng) -> np.ndarray:
    """A Haar-random orthogonal matrix (float64) from ``rng`` (numpy Generator)."""
    q, r = np.linalg.qr(rng.standard_normal((n, n)))
    return q * np.where(np.diag(r) < 0, -1.0, 1.0)[None, :]


def orthogonal(n: int, rng) -> tuple[np.ndarray, str]:
    """(matrix, kind): a random Hadamard matrix diag(s) H / sqrt(n) (signs s from ``rng``)
    where order n has one, else a random orthogonal matrix; both float64, orthogonal."""
    if has_hadamard(n):
        signs = rng.choice([-1.0, 1.0], size=n)
        return signs[:, None] * hadamard(n) / math.sqrt(n), "hadamard"
    return random_orthogonal(n, rng), "random orthogonal"


def kronecker_split(n: int) -> tuple[int, int]:
    """(a, b), a * b = n, a <= b, the least a + b with a Hadamard matrix of each order if
    n has such a split, else the least a + b: x (A kron B) then costs (a + b) n products
    instead of n * n."""
    pairs = [(a, n // a) for a in range(1, math.isqrt(n) + 1) if n % a == 0]
    both = [p for p in pairs if has_hadamard(p[0]) and has_hadamard(p[1])]
    return min(both or pairs, key=sum)
