"""Integer arithmetic the KV cache, the scheduler and the sharding all need."""


def cdiv(a: int, b: int) -> int:
    """a / b rounded up: how many blocks of `b` hold `a` (for positive `b`)."""
    return -(-a // b)
