"""Incremental detokenization: token ids in, text deltas out, never splitting a character.

Byte-level BPE tokens can end in the middle of a UTF-8 character, and some tokenizers change how a
token decodes depending on its left neighbour. So, as vLLM does, we decode a short window of recent
tokens with and without the newest ones and emit the difference once it no longer ends in the
replacement character. Stop strings are found here too: text up to the stop string is emitted, the
stop string and everything after it are not.

Special tokens are skipped, as `skip_special_tokens` skips them, except those in `keep_special`: tags the
tool-call parser reads that a checkpoint made special tokens (vLLM turns skip_special_tokens off for its
tool parsers for this reason; keeping only the parser's tags leaves every other special token out of the
text, as before).
"""

from __future__ import annotations

from tokenizers import Tokenizer

CONTEXT_TOKENS = 6


class Detokenizer:
    def __init__(self, tokenizer: Tokenizer, stop: list[str] | None = None, skip_ids: set[int] | None = None,
                 prompt_tail: list[int] | None = None, keep_special: frozenset[int] = frozenset()):
        self.tok = tokenizer
        self.skip_ids = set(skip_ids or ())
        # Keeping some special tokens means decoding them all and dropping the others before decoding.
        self.skip_special = not keep_special
        if keep_special:
            self.skip_ids |= {i for i, t in tokenizer.get_added_tokens_decoder().items()
                              if t.special and i not in keep_special}
        # A few prompt tokens give the first generated token its left context.
        self.ids: list[int] = [i for i in prompt_tail or [] if i not in self.skip_ids][-CONTEXT_TOKENS:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.stop = [s for s in (stop or []) if s]
        self.text = ""  # everything emitted so far
        self._held = ""  # decoded text held back because it might begin a stop string
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special)

    def add(self, token_id: int) -> str:
        """Feed one token; return the text it makes certain (possibly empty)."""
        if self.stopped:
            return ""
        if token_id in self.skip_ids:
            return ""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if after.endswith("\ufffd") or len(after) <= len(before):
            return ""
        new = after[len(before):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._emit(new)

    def flush(self) -> str:
        """At the end: text still held back (bytes that never became a whole character, a partial
        stop string that never completed)."""
        if self.stopped:
            return ""
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        self.prefix_offset = self.read_offset = len(self.ids)
        rest = after[len(before):] if len(after) > len(before) else ""
        out = self._emit(rest) if rest else ""
        if self.stopped:
            return out
        held, self._held = self._held, ""
        self.text += held
        return out + held

    def _emit(self, new: str) -> str:
        if not self.stop:
            self.text += new
            return new
        buf = self._held + new
        for s in self.stop:
            i = buf.find(s)
            if i >= 0:
                self.stopped = True
                self._held = ""
                self.text += buf[:i]
                return buf[:i]
        keep = max((n for s in self.stop for n in range(min(len(s) - 1, len(buf)), 0, -1)
                    if buf.endswith(s[:n])), default=0)
        out = buf[: len(buf) - keep]
        self._held = buf[len(buf) - keep :]
        self.text += out
        return out
