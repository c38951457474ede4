"""Log-probabilities in the OpenAI shapes, one entry per token with that token's own bytes.

A byte-level BPE token can hold part of a UTF-8 character, so its text alone is not valid
UTF-8. Its entry keeps its exact bytes (`bytes`), and its `token` string is the text when the
bytes decode, else `bytes:\\xe2\\x80` (the form OpenAI's completions use), so no two tokens of
different bytes share a string and none collapse into one `top_logprobs` key."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def _byte_level() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable stand-in character -> byte."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in kept:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    """token id -> its bytes, by the tokenizer's own detokenizer family (mlx-lm's choice):
    byte-level BPE maps its alphabet back to bytes, SentencePiece writes bytes as <0xNN> and
    spaces as U+2581, anything else decodes the token alone."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        kind = type(tokenizer.detokenizer).__name__
        self.kind = "bpe" if "BPE" in kind else "spm" if "SPM" in kind else "naive"
        self._cache: dict[int, bytes] = {}

    def __call__(self, token: int) -> bytes:
        got = self._cache.get(token)
        if got is None:
            got = self._cache[token] = self._bytes(token)
        return got

    def _bytes(self, token: int) -> bytes:
        if self.kind == "naive":
            return self.tokenizer.decode([token]).encode("utf-8", "surrogatepass")
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if piece is None:
            return b""
        if self.kind == "spm":
            if piece.startswith("<0x") and piece.endswith(">") and len(piece) == 6:
                return bytes([int(piece[3:5], 16)])
            return piece.replace("\u2581", " ").encode()
        table = _byte_level()
        return b"".join(bytes([table[c]]) if c in table else c.encode() for c in piece)

    def text(self, token: int) -> str:
        raw = self(token)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def chat_logprobs(tokens: list[dict], as_bytes: TokenBytes) -> dict:
    def entry(token: int, logprob: float) -> dict:
        return {"token": as_bytes.text(token), "logprob": logprob,
                "bytes": list(as_bytes(token))}

    return {"content": [{**entry(t["id"], t["logprob"]),
                         "top_logprobs": [entry(i, lp) for i, lp in t["top"]]}
                        for t in tokens]}


def completion_logprobs(tokens: list[dict], as_bytes: TokenBytes, offset: int = 0) -> dict:
    """`text_offset`: each token's start in the choice's text, in characters (a token that
    ends inside a character advances it by nothing)."""
    offsets, raw = [], b""
    for t in tokens:
        offsets.append(offset + len(raw.decode("utf-8", "ignore")))
        raw += as_bytes(t["id"])
    return {"tokens": [as_bytes.text(t["id"]) for t in tokens],
            "token_logprobs": [t["logprob"] for t in tokens],
            "top_logprobs": [{as_bytes.text(i): lp for i, lp in t["top"]} for t in tokens],
            "text_offset": offsets}
