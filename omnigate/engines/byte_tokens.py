"""The byte alphabet of byte-level tokenizers, shared by the shape presets that have no trained tokenizer."""

from __future__ import annotations


def byte_symbols() -> list[str]:
    """The printable stand-in of each byte value, as byte-level BPE tokenizers spell them (GPT-2 layout)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return [symbols[b] for b in range(256)]
