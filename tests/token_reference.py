"""Brute-force token helpers the tests compare kvbackend against."""


def lcp(a, b) -> int:
    """Length of the longest common prefix of two token sequences, one token at a time."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
