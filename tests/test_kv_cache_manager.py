"""KVCacheManager alone, without torch: allocation, reference counts, prefix caching, LRU eviction."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gracelm.engine.kv_cache_manager import KVCacheManager, hash_block
from gracelm.engine.request import Request
from gracelm.sampling_params import SamplingParams

BS = 4  # small blocks keep the token lists readable


def make_request(tokens: list[int], request_id: str = "r") -> Request:
    return Request(request_id, list(tokens), SamplingParams())


def admit(kv: KVCacheManager, request: Request) -> int:
    """Admits a request as the scheduler does, computing its whole prompt; returns the cached tokens."""
    blocks, num_cached = kv.get_computed_blocks(request)
    assert kv.allocate_slots(request, request.num_tokens - num_cached, blocks)
    request.num_computed_tokens = request.num_tokens
    kv.cache_full_blocks(request)
    return num_cached


def test_core_modules_do_not_import_torch():
    code = ("import sys; import gracelm.engine.request, gracelm.engine.kv_cache_manager; "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_allocate_and_free_count_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    request = make_request(list(range(10)))  # 10 tokens: 3 blocks
    assert kv.allocate_slots(request, 10)
    assert len(request.block_ids) == 3 and len(set(request.block_ids)) == 3
    assert kv.num_free_blocks == 7 and kv.usage == pytest.approx(0.3)
    request.num_computed_tokens = 10
    assert kv.allocate_slots(request, 2)  # tokens 11 and 12 still fit in the third block
    assert len(request.block_ids) == 3
    assert kv.allocate_slots(request, 3)  # token 13 opens a fourth
    assert len(request.block_ids) == 4
    kv.free(request)
    assert request.block_ids == [] and kv.num_free_blocks == 10 and kv.usage == 0.0


def test_allocation_that_does_not_fit_changes_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    first, second = make_request(list(range(12)), "a"), make_request(list(range(100, 108)), "b")
    assert kv.allocate_slots(first, 12)
    assert not kv.allocate_slots(second, 8)  # needs 2 blocks, 1 left
    assert second.block_ids == [] and kv.num_free_blocks == 1
    assert kv.allocate_slots(second, 4)


def test_prefix_is_shared_and_counted():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "a")
    assert admit(kv, a) == 0
    b = make_request([1, 2, 3, 4, 5, 6, 7, 8, 42, 43, 44], "b")
    blocks, num_cached = kv.get_computed_blocks(b)
    assert blocks == a.block_ids[:2] and num_cached == 8
    assert kv.allocate_slots(b, b.num_tokens - num_cached, blocks)
    assert b.block_ids[:2] == a.block_ids[:2] and b.block_ids[2] not in a.block_ids
    assert kv.num_free_blocks == 10 - 3 - 1  # b took one fresh block for its 3 new tokens
    assert kv.prefix_cache_queries == 10 + 11 and kv.prefix_cache_hits == 8
    kv.free(a)
    assert kv.num_free_blocks == 7  # the shared blocks are still held by b
    kv.free(b)
    assert kv.num_free_blocks == 10


def test_prefix_hit_leaves_at_least_one_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    admit(kv, make_request(list(range(8)), "a"))
    same = make_request(list(range(8)), "b")  # identical 2-block prompt: only the first block may be reused
    assert kv.get_computed_blocks(same)[1] == 4
    longer = make_request(list(range(9)), "c")
    assert kv.get_computed_blocks(longer)[1] == 8


def test_only_full_computed_blocks_are_cached():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    a = make_request(list(range(10)), "a")
    assert kv.allocate_slots(a, 6)  # a chunk: 6 of 10 tokens computed, one block full
    a.num_computed_tokens = 6
    kv.cache_full_blocks(a)
    assert kv.get_computed_blocks(make_request(list(range(10)), "b"))[1] == 4


def test_released_cached_blocks_stay_reusable():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a = make_request(list(range(9)), "a")
    admit(kv, a)
    kept = a.block_ids[:2]
    kv.free(a)
    assert kv.num_free_blocks == 6  # evictable blocks count as free
    b = make_request(list(range(9)), "b")
    assert admit(kv, b) == 8 and b.block_ids[:2] == kept


def test_reused_evictable_blocks_are_not_counted_twice_as_free():
    kv = KVCacheManager(num_blocks=3, block_size=BS)
    a = make_request(list(range(9)), "a")
    admit(kv, a)
    kv.free(a)
    b = make_request([*range(8), 100, 101, 102, 103, 104], "b")  # 2 cached blocks + 2 new ones: 4 > 3
    blocks, num_cached = kv.get_computed_blocks(b)
    assert num_cached == 8
    assert not kv.allocate_slots(b, b.num_tokens - num_cached, blocks)
    assert kv.num_free_blocks == 3 and kv.get_computed_blocks(b)[1] == 8


def test_hash_chain_is_stable_across_processes():
    tokens = list(range(1000, 1012))
    here = make_request(tokens)
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    admit(kv, here)
    code = ("from gracelm.engine.kv_cache_manager import hash_block\n"
            f"h = None\nfor i in range(0, 12, {BS}):\n"
            f"    h = hash_block(h, {tokens}[i:i + {BS}])\n    print(h.hex())\n")
    other = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True)
    assert other.stdout.split() == [h.hex() for h in here.block_hashes]


def test_block_hash_names_the_whole_prefix():
    block = [5, 6, 7, 8]
    parent_a, parent_b = hash_block(None, [1, 2, 3, 4]), hash_block(None, [1, 2, 3, 9])
    assert hash_block(parent_a, block) != hash_block(parent_b, block)
    assert hash_block(None, block) != hash_block(None, [5, 6, 7, 9])
    # Same tokens behind a different prefix are not a hit.
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    admit(kv, make_request([1, 2, 3, 4, 5, 6, 7, 8, 0], "a"))
    assert kv.get_computed_blocks(make_request([9, 9, 9, 9, 5, 6, 7, 8, 0], "b"))[1] == 0


def test_eviction_takes_plain_free_blocks_first_then_least_recently_released():
    kv = KVCacheManager(num_blocks=7, block_size=BS)
    x, y, z = (make_request([tag] * 4 + [0], tag_id) for tag, tag_id in ((1, "x"), (2, "y"), (3, "z")))
    for request in (x, y, z):
        admit(kv, request)  # each: one cached full block + one partial block
    for request in (x, y, z):
        kv.free(request)
    assert kv.num_free_blocks == 7

    def hit(tag: int) -> bool:
        return kv.get_computed_blocks(make_request([tag] * 4 + [0], "probe"))[1] == 4

    # 4 fresh blocks: 1 never used + 3 partial blocks returned uncached; no cached block is touched.
    filler = make_request(list(range(100, 116)), "filler")
    assert kv.allocate_slots(filler, 16)
    assert hit(1) and hit(2) and hit(3)
    # One more block evicts x's, the least recently released; then y's.
    filler.num_computed_tokens = 16
    assert kv.allocate_slots(filler, 4)
    assert not hit(1) and hit(2) and hit(3)
    filler.num_computed_tokens = 20
    assert kv.allocate_slots(filler, 4)
    assert not hit(2) and hit(3)


def test_a_sequence_is_evicted_tail_first():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    a = make_request(list(range(13)), "a")  # 3 full cached blocks + 1 partial
    admit(kv, a)
    kv.free(a)
    b = make_request(list(range(200, 208)), "b")  # 2 blocks: the partial one, then a's last full block
    assert kv.allocate_slots(b, 8)
    assert kv.get_computed_blocks(make_request(list(range(13)), "c"))[1] == 8


def test_reset_prefix_cache_forgets_everything_but_keeps_blocks_in_use():
    kv = KVCacheManager(num_blocks=6, block_size=BS)
    a, b = make_request(list(range(9)), "a"), make_request(list(range(50, 59)), "b")
    admit(kv, a)
    admit(kv, b)
    kv.free(a)
    kv.reset_prefix_cache()
    assert kv.get_computed_blocks(make_request(list(range(9)), "c"))[1] == 0
    assert kv.get_computed_blocks(make_request(list(range(50, 59)), "d"))[1] == 0
    assert kv.num_free_blocks == 3 and len(b.block_ids) == 3
    kv.free(b)
    assert kv.num_free_blocks == 6


def test_prefix_caching_can_be_disabled():
    kv = KVCacheManager(num_blocks=10, block_size=BS, enable_prefix_caching=False)
    admit(kv, make_request(list(range(9)), "a"))
    assert admit(kv, make_request(list(range(9)), "b")) == 0
    assert kv.prefix_cache_queries == 0 and kv.prefix_cache_hits == 0


def test_constructor_rejects_empty_cache():
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheManager(num_blocks=0)
