"""The checksums of the files ``moment place`` writes: the registry of digest algorithms.

placed.json records, next to each file's digest, the algorithm that took it (``digest_algorithm``,
a key of :data:`DIGESTS`), and ``moment verify`` and the trainer's checks recompute it with that
one, so placements written before keep verifying.

``moment place`` writes xxh3-128 (:data:`PLACED_DIGEST`): the checksums guard against damage (a
flipped byte, a torn or truncated write, a file replaced), not against an adversary, and
XXH3's 128 bits, which pass the SMHasher suite, are enough for that at about 15 GB/s a core,
against SHA-256's 0.8-1.6 GB/s on this project's machines. At 16-dim rows SHA-256 of what place
writes cost about 2 of its 9.5 core-seconds at 20 M vertices (README, Time to first epoch).
SHA-256 (:data:`UNRECORDED_DIGEST`) is what placements written before recorded, and stays where a
contract names it (inference outputs, checkpoints).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import xxhash


class Hasher(Protocol):
    """What a registered algorithm's object does: hashlib's interface."""

    def update(self, data: bytes | memoryview, /) -> None: ...

    def hexdigest(self) -> str: ...


DIGESTS: dict[str, Callable[[], Hasher]] = {
    "sha256": hashlib.sha256,
    "xxh3-128": xxhash.xxh3_128,
}
PLACED_DIGEST = "xxh3-128"  # what `moment place` checksums the files it writes with
UNRECORDED_DIGEST = "sha256"  # of placed.json entries written before they recorded their algorithm


class DigestError(ValueError):
    """An algorithm this moment does not know, or a digest of the wrong length for its algorithm."""


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hasher of a registered algorithm (:class:`DigestError` for any other name)."""
    try:
        return DIGESTS[algorithm]()
    except KeyError:
        raise DigestError(
            f"digest algorithm {algorithm!r} is not one this moment knows ({', '.join(DIGESTS)})"
        ) from None


def check_digest(algorithm: str, digest: str) -> None:
    """``digest`` could be one of ``algorithm``'s: the algorithm is registered and the length is
    its (a manifest edited by hand, or written by a later moment, is refused before any file is read)."""
    size = len(new_hasher(algorithm).hexdigest())
    if len(digest) != size:
        raise DigestError(f"a {algorithm} digest has {size} hex digits, this one {len(digest)}")


def file_digest(path: Path, algorithm: str, block: int = 8 << 20) -> str:
    """Checksum of a whole file (what the manifest records and ``moment verify`` re-checks)."""
    h = new_hasher(algorithm)
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()
