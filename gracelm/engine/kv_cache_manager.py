"""Paged KV-cache bookkeeping: which fixed-size blocks each request holds, and a prefix cache over them.

Only block ids are managed here; the tensors live with the model runner. A block that is full and
computed is registered under the chained content hash of its tokens, so a later request with the same
prefix reuses it instead of recomputing it. Cached blocks nobody references stay cached until a fresh
block is needed, then the least recently released is evicted.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Sequence

from gracelm.arith import cdiv
from gracelm.engine.request import Request

# Seeds the chain; a change of the hashing scheme must change it, so that prefix caches saved to disk by
# an older version can never match.
BLOCK_HASH_ROOT = b"gracelm-kv-block-v1"


def hash_block(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """sha256 over the previous block's hash and this block's token ids: a block's hash names its whole
    prefix, and it is the same in every process and across restarts (unlike Python's `hash()`)."""
    tokens = struct.pack(f"<{len(token_ids)}I", *token_ids)
    return hashlib.sha256((parent_hash or BLOCK_HASH_ROOT) + tokens).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks} and {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._block_hash: list[bytes | None] = [None] * num_blocks
        self._cached: dict[bytes, int] = {}  # hash -> block holding those tokens
        self._free: deque[int] = deque(range(num_blocks))  # unreferenced, holding nothing worth keeping
        self._evictable: OrderedDict[int, None] = OrderedDict()  # unreferenced cached blocks, LRU first
        self._num_registered: dict[str, int] = {}  # request id -> its leading blocks already in the cache
        self.prefix_cache_queries = 0  # tokens looked up, counted once per admission
        self.prefix_cache_hits = 0  # of those, tokens found in the cache
        self._restored: set[int] = set()  # cached blocks whose contents came from a snapshot on disk
        self.num_restored_blocks = 0
        self.restored_block_hits = 0  # admissions' prefix blocks that were restored ones

    @property
    def num_total_blocks(self) -> int:
        return self._num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new allocation can take: free ones plus unreferenced cached ones (evictable)."""
        return len(self._free) + len(self._evictable)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self._num_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """The longest cached prefix of the request: its blocks and its length in tokens. Changes nothing.

        At most `num_tokens - 1` tokens, rounded down to whole blocks: the last token must still be run
        through the model, since its logits give the next token.
        """
        if not self.enable_prefix_caching:
            return [], 0
        num_blocks = (request.num_tokens - 1) // self.block_size
        self._extend_hashes(request, num_blocks)
        blocks = []
        for block_hash in request.block_hashes[:num_blocks]:
            block = self._cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def allocate_slots(
        self, request: Request, num_new_tokens: int, computed_blocks: Sequence[int] = ()
    ) -> bool:
        """Makes room for `num_new_tokens` tokens after the request's computed ones; False, with nothing
        changed, when there are not enough free blocks.

        `computed_blocks` is the cached prefix from `get_computed_blocks`, given when a request that holds no
        blocks is admitted; the new tokens then follow that prefix. The caller advances
        `request.num_computed_tokens` past the prefix once this succeeds.
        """
        if computed_blocks and request.block_ids:
            raise ValueError(f"request {request.request_id} already holds blocks; it cannot take a prefix")
        num_tokens = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_needed = cdiv(num_tokens, self.block_size) - len(request.block_ids) - len(computed_blocks)
        # Cached blocks nobody holds count as free; reusing them as the prefix takes them out of the pool.
        num_reused_free = sum(1 for block in computed_blocks if self._ref_counts[block] == 0)
        if num_needed > self.num_free_blocks - num_reused_free:
            return False
        if not request.block_ids and self.enable_prefix_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed_blocks) * self.block_size
            self.restored_block_hits += sum(1 for block in computed_blocks if block in self._restored)
        for block in computed_blocks:
            if self._ref_counts[block] == 0:
                del self._evictable[block]
            self._ref_counts[block] += 1
        request.block_ids.extend(computed_blocks)
        if computed_blocks:
            self._num_registered[request.request_id] = len(computed_blocks)
        for _ in range(num_needed):
            block = self._take_block()
            self._ref_counts[block] = 1
            request.block_ids.append(block)
        return True

    def cache_full_blocks(self, request: Request) -> None:
        """Registers the request's blocks that are now full and computed, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        start = self._num_registered.get(request.request_id, 0)
        if num_full <= start:
            return
        self._extend_hashes(request, num_full)
        for index in range(start, num_full):
            block, block_hash = request.block_ids[index], request.block_hashes[index]
            # Two requests admitted together may both compute the same prefix; the first one registered
            # stays the cached copy, the other block is released as plain free space when its request ends.
            if block_hash not in self._cached:
                self._cached[block_hash] = block
                self._block_hash[block] = block_hash
        self._num_registered[request.request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> None:
        """Frees the request's blocks past those its first `num_tokens` tokens take: the blocks that held
        only rejected draft positions (`speculation.py`). Taken in this step, they are the request's alone
        and hold nothing registered (only blocks full of computed tokens are). They go back to the head of
        the free list, in the order they were taken: the next blocks taken are the ones plain decoding
        would have taken, and a sequence's blocks stay as close together in memory."""
        keep = cdiv(num_tokens, self.block_size)
        while len(request.block_ids) > keep:
            block = request.block_ids.pop()
            assert self._ref_counts[block] == 1 and self._block_hash[block] is None
            self._ref_counts[block] = 0
            self._free.appendleft(block)

    def free(self, request: Request) -> None:
        """Drops the request's references; its cached blocks stay reusable until evicted."""
        # Released tail first, so that eviction (least recently released first) takes a sequence's last
        # blocks before its first ones, which are the likeliest to be shared by another request.
        for block in reversed(request.block_ids):
            self._ref_counts[block] -= 1
            if self._ref_counts[block] == 0:
                if self._block_hash[block] is None:
                    self._free.append(block)
                else:
                    self._evictable[block] = None
        request.block_ids = []
        self._num_registered.pop(request.request_id, None)

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block; blocks in use stay with their requests, simply no longer shared."""
        for block in self._cached.values():
            self._block_hash[block] = None
        self._cached.clear()
        self._restored.clear()
        self._free.extend(self._evictable)
        self._evictable.clear()

    def _take_block(self) -> int:
        if self._free:
            return self._free.popleft()
        block, _ = self._evictable.popitem(last=False)
        del self._cached[self._block_hash[block]]
        self._block_hash[block] = None
        self._restored.discard(block)
        return block

    def _extend_hashes(self, request: Request, num_blocks: int) -> None:
        """Extends the request's hash chain to cover (at least) its first `num_blocks` blocks."""
        hashes, tokens, size = request.block_hashes, request.all_token_ids, self.block_size
        while len(hashes) < num_blocks:
            start = len(hashes) * size
            hashes.append(hash_block(hashes[-1] if hashes else None, tokens[start:start + size]))

    # -- persistence across restarts (`kv_persistence.py`) -------------------------------------------

    def cached_blocks_by_recency(self) -> list[tuple[bytes, int]]:
        """(hash, block) of every cached block, most recently used first: blocks held by requests count as
        the most recent, then the evictable ones from the last released to the least recently used."""
        held = [(h, b) for h, b in self._cached.items() if self._ref_counts[b] > 0]
        released = [(self._block_hash[b] or b"", b) for b in reversed(self._evictable)]
        return held + released

    def holds(self, block: int, block_hash: bytes) -> bool:
        """Whether the block still holds the tokens of that hash (it may have been evicted and reused)."""
        return self._block_hash[block] == block_hash

    def restore_block(self, block_hash: bytes) -> int | None:
        """Registers a block read from a snapshot as cached and evictable, behind every block registered so
        far (restoring most recent first rebuilds the LRU order); its id, for the caller to fill, or None
        when the hash is cached already or no free block is left (restored blocks never evict)."""
        if not self.enable_prefix_caching or block_hash in self._cached or not self._free:
            return None
        block = self._free.popleft()
        self._cached[block_hash] = block
        self._block_hash[block] = block_hash
        self._evictable[block] = None
        self._evictable.move_to_end(block, last=False)
        self._restored.add(block)
        self.num_restored_blocks += 1
        return block

    def forget_restored(self, block: int) -> None:
        """Takes back a block `restore_block` placed (another rank could not fill it): free again, cached
        no more. Only before any request runs, so nothing holds it."""
        assert block in self._restored and self._ref_counts[block] == 0
        block_hash = self._block_hash[block]
        assert block_hash is not None
        del self._cached[block_hash]
        del self._evictable[block]
        self._block_hash[block] = None
        self._restored.discard(block)
        self._free.append(block)
        self.num_restored_blocks -= 1
