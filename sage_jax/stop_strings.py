"""Text-level stop strings inside the jitted decode loop: a token-level automaton per string.

A completion stops right after the token that completes a stop string in its decoded text (the string is
kept, with whatever else that token holds), wherever the tokenizer happened to split it: `</SOLUTION>`
may arrive as `</` `SOL` `UTION` `>` or with its `>` merged into `>\\n\\n`. This is what transformers'
`stop_strings` and vLLM's `stop` (with `include_stop_str_in_output`) give, and what a match of the
string's own token ids misses.

For each string S (m bytes) the Knuth-Morris-Pratt automaton over bytes has states 0..m (m = matched,
absorbing). Feeding a token's bytes from state s lands in `table[s, token]`, so the loop carries one
int per row and string and takes one gather per step. Tables are built once on the host, vectorised
over the vocabulary; [K, m + 1, V] int32 is about 7 MB for one 11-byte string and a 152k vocabulary.
"""

from __future__ import annotations

import hashlib
from typing import Sequence

import numpy as np


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character map (the alphabet of byte-level BPE token strings)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def token_bytes(tokenizer, vocab_size: int) -> list[bytes]:
    """The bytes each token id contributes to decoded text (b"" for ids the tokenizer does not have).

    Byte-level BPE tokens (GPT-2, Qwen, Llama 3) map back through the byte alphabet; added / special tokens
    are their literal text; any other tokenizer falls back to decoding the id alone.
    """
    decoder = {c: b for b, c in _bytes_to_unicode().items()}
    added = {int(i): t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    pieces = tokenizer.convert_ids_to_tokens(list(range(min(vocab_size, len(tokenizer)))))
    byte_level = all(p is None or all(ch in decoder for ch in p) for i, p in enumerate(pieces) if i not in added)
    out = []
    for i in range(vocab_size):
        if i >= len(pieces) or pieces[i] is None:
            out.append(b"")
        elif i in added:
            out.append(added[i].encode("utf-8"))
        elif byte_level:
            out.append(bytes(decoder[ch] for ch in pieces[i]))
        else:
            out.append(tokenizer.decode([i]).encode("utf-8"))
    return out


def _kmp_delta(s: bytes) -> np.ndarray:
    """[m + 1, 256] byte transitions of the KMP automaton of `s`; state m (matched) is absorbing."""
    m = len(s)
    fail = [0] * m
    k = 0
    for i in range(1, m):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        k += s[i] == s[k]
        fail[i] = k
    delta = np.zeros((m + 1, 256), np.int32)
    for q in range(m):
        for c in range(256):
            if c == s[q]:
                delta[q, c] = q + 1
            else:
                delta[q, c] = delta[fail[q - 1], c] if q else 0
    delta[m, :] = m
    return delta


class StopStrings:
    """Stop strings compiled against one vocabulary; hashable, so it can sit in a static SamplingConfig."""

    def __init__(self, strings: Sequence[str], tokens: Sequence[bytes]):
        self.strings = tuple(strings)
        if not self.strings or any(not s for s in self.strings):
            raise ValueError(f"stop strings must be non-empty, got {self.strings!r}")
        encoded = [s.encode("utf-8") for s in self.strings]
        m_max = max(len(e) for e in encoded)
        V = len(tokens)
        L = max(1, max(len(t) for t in tokens))
        tok_bytes = np.full((V, L), -1, np.int32)
        for i, t in enumerate(tokens):
            tok_bytes[i, : len(t)] = np.frombuffer(t, np.uint8)
        table = np.zeros((len(encoded), m_max + 1, V), np.int32)
        self.matched = np.array([len(e) for e in encoded], np.int32)  # [K] the accepting state of each string
        for k, e in enumerate(encoded):
            m = len(e)
            delta = _kmp_delta(e)
            state = np.broadcast_to(np.arange(m + 1, dtype=np.int32)[:, None], (m + 1, V)).copy()
            for j in range(L):  # feed every token's j-th byte from every start state at once
                b = tok_bytes[:, j]
                state = np.where(b[None, :] >= 0, delta[state, np.maximum(b, 0)[None, :]], state)
            table[k, : m + 1] = state
            table[k, m + 1:] = m  # states beyond this string's length are never reached
        self.table = table  # [K, m_max + 1, V]
        self._key = (self.strings, hashlib.sha1(table.tobytes()).hexdigest())

    @classmethod
    def for_tokenizer(cls, strings: Sequence[str], tokenizer, vocab_size: int) -> "StopStrings":
        return cls(strings, token_bytes(tokenizer, vocab_size))

    def min_tokens(self) -> list[int | None]:
        """Per string, the fewest tokens whose text completes it (a breadth-first search of its automaton from the
        start state); None when no sequence of this vocabulary's tokens can write it."""
        out = []
        for k, m in enumerate(self.matched):
            dist, frontier, d = {0: 0}, [0], 0
            while frontier and m not in dist:
                d += 1
                nxt = np.unique(self.table[k, frontier])
                frontier = [int(x) for x in nxt if int(x) not in dist]
                dist.update((x, d) for x in frontier)
            out.append(dist.get(int(m)))
        return out

    def check_reachable(self, max_new_tokens: int, field: str) -> None:
        """Refuses a string that can never fire: no token sequence writes it, or it needs more tokens than
        `max_new_tokens` (one line naming `field`)."""
        for s, n in zip(self.strings, self.min_tokens()):
            if n is None:
                raise ValueError(f"{field}: {s!r} can never be written by this tokenizer's tokens, so it would never "
                                 "stop a completion; remove it")
            if n > max_new_tokens:
                raise ValueError(f"{field}: {s!r} needs at least {n} tokens, more than the {max_new_tokens} of the "
                                 "completion budget, so it would never fire")

    def __hash__(self):
        return hash(self._key)

    def __eq__(self, other):
        return isinstance(other, StopStrings) and self._key == other._key

    def __repr__(self):
        return f"StopStrings({list(self.strings)!r})"

    def start(self, rows: int):
        """The automaton state of `rows` fresh completions: [B, K] zeros."""
        import jax.numpy as jnp
        return jnp.zeros((rows, len(self.strings)), jnp.int32)

    def advance(self, state_BxK, tok_B):
        """(new state, stopped_B): feed each row's new token; stopped where any string is now matched."""
        import jax.numpy as jnp
        K = len(self.strings)
        new = jnp.asarray(self.table)[jnp.arange(K)[None, :], state_BxK, tok_B[:, None]]
        return new, jnp.any(new == jnp.asarray(self.matched)[None, :], axis=-1)
