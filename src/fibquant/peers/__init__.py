"""The KV quantizers users would pick instead of FibQuant, run from their own packages.

Spec strings (one module per family, listed in `base.REGISTRY`; `b` bits, `q` lattice range):

    quanto-rt:b=2|4       transformers QuantizedCache's quanto layer (optimum-quanto) as a round trip: groups of 64
    hqq-rt:b=1|2|3|4|8    transformers QuantizedCache's HQQ layer (hqq) as a round trip: groups of 64 along axis 0
    (`quanto:b=B` / `hqq:b=B` name transformers' QuantizedCache itself: `PeerFamily.native`)
    kakeya-e8:q=Q         kakeyalattice 1.5 V15KakeyaZamirE8GPU (E8 nested lattice), range Q
    kakeya-d4:q=Q         kakeyalattice 1.4 V14KakeyaZamirLatticeGPU (D4 nested lattice), range Q
    nexus:b=2|3|4         nexusquant-kv E8QuantizedCache: inverse RoPE (keys), Hadamard, E8 VQ with 2^b levels

Absent packages: `unavailable_reason(spec)` says why (install `pip install 'fibquant[peers]'`).
"""
from fibquant.peers.base import (PEERS, REGISTRY, PeerFamily, PeerQuantizer, PeerSpec, build_peer,
                                 family_unavailable_reason, is_peer, native_families, one_of, package_versions,
                                 parse_peer, peer_families, peer_specs, unavailable_reason)

__all__ = ["PEERS", "REGISTRY", "PeerFamily", "PeerQuantizer", "PeerSpec", "build_peer", "family_unavailable_reason",
           "is_peer", "native_families", "one_of", "package_versions", "parse_peer", "peer_families", "peer_specs",
           "unavailable_reason"]
