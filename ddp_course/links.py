"""The course's one table of link speeds: what lecture 2 section 3 prints and lab 1 section 5 compares with.

Bandwidth beta is in bytes per second **per direction** (the README's notation; nccl-tests count one
direction, while NVIDIA quotes NVLink for both together, hence the halving). Latency alpha is an order
of magnitude for one small message, not a measurement: about a microsecond where the hardware moves
the bytes (NVLink, PCIe, InfiniBand with RDMA), tens of microseconds where the operating system's
TCP stack is on the path. With these, a ring all-reduce of S bytes on N ranks takes
2(N-1) alpha + 2(N-1)/N S / beta (lecture 2, section 3).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Link:
    name: str
    beta: float  # bytes/s per direction
    alpha: float  # s per message, order of magnitude
    source: str


# PCIe: lanes x transfers/s x 128/130 (the encoding's payload share) / 8 bits per byte.
PUBLISHED_LINKS = (
    Link("NVLink 4, H100 SXM", 900e9 / 2, 1e-6, "NVIDIA H100 datasheet: 900 GB/s, both directions together"),
    Link("PCIe 5.0 x16", 16 * 32e9 * 128 / 130 / 8, 1e-6, "PCI-SIG PCIe 5.0: 32 GT/s per lane, 128b/130b"),
    Link("PCIe 4.0 x16", 16 * 16e9 * 128 / 130 / 8, 1e-6, "PCI-SIG PCIe 4.0: 16 GT/s per lane, 128b/130b"),
    Link("InfiniBand NDR, one port", 400e9 / 8, 1e-6, "400 Gb/s, NVIDIA ConnectX-7; RDMA, no kernel on the path"),
    Link("InfiniBand HDR, one port", 200e9 / 8, 1e-6, "200 Gb/s, NVIDIA ConnectX-6"),
    Link("Ethernet 100 Gb/s, TCP", 100e9 / 8, 30e-6, "IEEE 802.3; the kernel's TCP stack adds tens of us"),
)


def ring_all_reduce_seconds(n_bytes: float, world_size: int, link: Link) -> float:
    """The alpha-beta time of a ring all-reduce of n_bytes per rank over `link` (lecture 2, section 3)."""
    return 2 * (world_size - 1) * link.alpha + 2 * (world_size - 1) / world_size * n_bytes / link.beta


def link_table(n_bytes: float = 100e6, world_size: int = 8) -> str:
    """The table as text: each link's beta, alpha, a ring all-reduce of n_bytes on world_size ranks, and its source."""
    lines = [f"{'link':<26} {'beta (GB/s)':>11} {'alpha (us)':>10} {f'{n_bytes / 1e6:g} MB, N={world_size} (ms)':>20}  source"]
    for link in PUBLISHED_LINKS:
        milliseconds = ring_all_reduce_seconds(n_bytes, world_size, link) * 1e3
        lines.append(f"{link.name:<26} {link.beta / 1e9:11.1f} {link.alpha * 1e6:10.0f} {milliseconds:20.2f}  {link.source}")
    return "\n".join(lines)
