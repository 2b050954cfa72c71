"""The fractal archive: lossless iterated-map storage of symbol streams with append,
random access and suffix search in place (see docs/archive-format.md).

Modules: `payload` (the `PayloadCoder` protocol every variant implements), `exact` (radix
form of the map, the default), `floatmap` (the paper's 2-D float map with verified
segments), `format` (file layout, errors, recovery rule), `writer` (one writer per store:
the writer lock, atomic create and overwrite), `metadata` (JSON files with per-field checksums),
`archive` (the `Archive` file object), `search` (suffix search over keys / points), `codes` (archiving the codes of any
codec with a [norm][packed indices] `CodeLayout`, e.g. FibQuant and TurboQuant).
"""
from ..codecs.layout import CodeLayout
from .archive import PAYLOAD_CODERS, Archive, make_coder
from .codes import CodeArchive
from .exact import RadixCoder
from .floatmap import FloatMapCoder, r_disc, r_star
from .format import ArchiveCorruptError, ArchiveError, ArchiveVersionError, RecoveryWarning
from .payload import PayloadCoder, as_symbols
from .search import brute_force_search
from .writer import StoreLockedError

__all__ = [
    "Archive", "ArchiveCorruptError", "ArchiveError", "ArchiveVersionError", "CodeArchive", "CodeLayout",
    "FloatMapCoder", "PAYLOAD_CODERS", "PayloadCoder", "RadixCoder", "RecoveryWarning", "StoreLockedError", "as_symbols",
    "brute_force_search", "make_coder", "r_disc", "r_star",
]
