"""The fractal archive: lossless iterated-map storage of symbol streams with append,
random access and suffix search in place (see docs/archive-format.md).

Modules: `exact` (radix form of the map, the default), `floatmap` (the paper's 2-D float
map with verified segments), `format` (file layout, errors, recovery rule), `archive`
(the `Archive` file object), `search` (suffix search over keys / points), `codes`
(archiving FibQuant code streams).
"""
from .archive import Archive, as_symbols
from .codes import CodeArchive, CodeLayout
from .exact import RadixCodec
from .floatmap import FloatMapCodec, r_disc, r_star
from .format import ArchiveCorruptError, ArchiveError, ArchiveVersionError, RecoveryWarning
from .search import brute_force_search

__all__ = [
    "Archive", "ArchiveCorruptError", "ArchiveError", "ArchiveVersionError", "CodeArchive", "CodeLayout",
    "FloatMapCodec", "RadixCodec", "RecoveryWarning", "as_symbols", "brute_force_search", "r_disc", "r_star",
]
