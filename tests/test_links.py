"""ddp_course.links, the course's one table of link speeds (lecture 2 section 3 prints it, lab 1 section 5 plots it).

Issue 31's notation: beta is a bandwidth in bytes/s. A table that slipped back to seconds per byte
(beta around 1e-11) or to bits per second (eight times too large) would still print; these checks
would not pass.
"""

import math

import pytest

from ddp_course import lecture02_checks
from ddp_course.links import PUBLISHED_LINKS, link_table, ring_all_reduce_seconds


def by_name(name):
    return next(link for link in PUBLISHED_LINKS if link.name == name)


def test_every_beta_is_bytes_per_second_and_every_alpha_seconds():
    for link in PUBLISHED_LINKS:
        assert 1e9 <= link.beta <= 1e12, link  # 1 GB/s .. 1 TB/s per direction: bytes/s, not s/byte or bit/s
        assert 1e-7 <= link.alpha <= 1e-3, link


def test_the_figures_follow_from_their_sources():
    assert by_name("NVLink 4, H100 SXM").beta == 450e9  # 900 GB/s both directions together
    assert by_name("PCIe 5.0 x16").beta == pytest.approx(63.0e9, rel=1e-3)  # 16 lanes x 32 GT/s x 128/130 / 8
    assert by_name("PCIe 5.0 x16").beta == pytest.approx(2 * by_name("PCIe 4.0 x16").beta)
    assert by_name("InfiniBand NDR, one port").beta == 400e9 / 8  # 400 Gb/s
    assert by_name("Ethernet 100 Gb/s, TCP").beta == 12.5e9


def test_the_ring_time_is_lecture_2s_formula():
    for link in PUBLISHED_LINKS:
        for n_bytes, world_size in [(1e3, 2), (100e6, 8), (1e9, 64)]:
            assert ring_all_reduce_seconds(n_bytes, world_size, link) == pytest.approx(
                lecture02_checks.ring_seconds(n_bytes, world_size, link.alpha, link.beta), rel=1e-12
            )


def test_the_table_prints_one_row_per_link_with_its_time():
    lines = link_table(n_bytes=100e6, world_size=8).splitlines()
    assert len(lines) == 1 + len(PUBLISHED_LINKS)
    nvlink = next(line for line in lines if line.startswith("NVLink"))
    expected_ms = (2 * 7 * 1e-6 + 2 * 7 / 8 * 100e6 / 450e9) * 1e3
    assert math.isclose(float(nvlink.split()[6]), round(expected_ms, 2))
