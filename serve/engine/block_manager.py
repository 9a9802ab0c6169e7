"""Paged KV-cache blocks with reference counts and prefix caching.

A block holds `block_size` tokens' K/V. A full block is identified by a chained hash of its tokens and
its parent block's hash, so equal hashes mean equal prefixes (the tokens are compared too, against
collisions). When a sequence arrives, its prompt's leading full blocks that are already cached are
shared instead of recomputed — an agent's next request repeats its previous prompt, so time to first
token tracks the new tokens only. Freed blocks keep their contents and hash, and are reused
least-recently-freed first once the never-used blocks run out.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from serve.engine.sequence import Sequence


@dataclass
class Block:
    id: int
    ref_count: int = 0
    hash: int | None = None
    tokens: tuple[int, ...] = ()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_plain: deque[int] = deque(range(num_blocks))
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # least recently freed first
        self.by_hash: dict[int, int] = {}
        self.seq_hashes: dict[int, list[int]] = {}
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def num_free(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / len(self.blocks)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        if self.free_plain:
            bid = self.free_plain.popleft()
        else:
            bid, _ = self.free_cached.popitem(last=False)
            b = self.blocks[bid]
            if b.hash is not None and self.by_hash.get(b.hash) == bid:
                del self.by_hash[b.hash]
            b.hash, b.tokens = None, ()
        self.blocks[bid].ref_count = 1
        return bid

    def _ref(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.ref_count == 0:
            self.free_cached.pop(bid, None)
        b.ref_count += 1

    def allocate(self, seq: Sequence) -> bool:
        """Blocks for the whole current sequence, sharing cached prefix blocks. False if memory is short."""
        tokens, bs = seq.token_ids, self.block_size
        shared, hashes, parent = [], [], None
        if self.prefix_caching:
            for b in range(len(tokens) // bs):
                chunk = tuple(tokens[b * bs : (b + 1) * bs])
                h = hash((parent, chunk))
                bid = self.by_hash.get(h)
                if bid is None or self.blocks[bid].tokens != chunk:
                    break
                shared.append(bid)
                hashes.append(h)
                parent = h
            if len(shared) * bs == len(tokens):  # the last token must be computed to get logits
                shared.pop()
                hashes.pop()
        need = self.blocks_for(len(tokens)) - len(shared)
        reclaimed = sum(1 for bid in shared if self.blocks[bid].ref_count == 0)
        if need > self.num_free - reclaimed:
            return False
        for bid in shared:
            self._ref(bid)
        seq.block_table = shared + [self._take() for _ in range(need)]
        seq.num_computed = seq.num_cached = len(shared) * bs
        self.seq_hashes[seq.id] = hashes
        self.query_tokens += len(tokens)
        self.hit_tokens += seq.num_cached
        return True

    def ensure(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow the block table to hold `num_tokens`; False if memory is short."""
        need = self.blocks_for(num_tokens) - len(seq.block_table)
        if need > self.num_free:
            return False
        seq.block_table += [self._take() for _ in range(need)]
        return True

    def register(self, seq: Sequence) -> None:
        """Publish the sequence's newly completed blocks to the prefix cache."""
        if not self.prefix_caching:
            return
        hashes = self.seq_hashes.setdefault(seq.id, [])
        bs = self.block_size
        for b in range(len(hashes), seq.num_computed // bs):
            chunk = tuple(seq.token_ids[b * bs : (b + 1) * bs])
            h = hash((hashes[-1] if hashes else None, chunk))
            hashes.append(h)
            block = self.blocks[seq.block_table[b]]
            if block.hash is None:
                block.hash, block.tokens = h, chunk
                self.by_hash.setdefault(h, block.id)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: after a weight swap the K/V in the blocks came from the old weights.
        Only with no sequence holding blocks (a running one would go on publishing blocks whose K/V
        mixes both weights)."""
        if any(b.ref_count for b in self.blocks):
            raise RuntimeError("reset_prefix_cache needs all sequences finished")
        for b in self.blocks:
            b.hash, b.tokens = None, ()
        self.free_plain.extend(self.free_cached)
        self.free_cached.clear()
        self.by_hash.clear()

    def free(self, seq: Sequence) -> None:
        for bid in reversed(seq.block_table):
            b = self.blocks[bid]
            b.ref_count -= 1
            if b.ref_count == 0:
                if b.hash is not None and self.by_hash.get(b.hash) == bid:
                    self.free_cached[bid] = None
                else:
                    b.hash, b.tokens = None, ()
                    self.free_plain.append(bid)
        seq.block_table = []
        self.seq_hashes.pop(seq.id, None)
