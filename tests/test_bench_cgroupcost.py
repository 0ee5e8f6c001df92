"""bench/cgroupcost.py: finding the cgroup2 mount and its favordynmods in mountinfo."""

from bench.cgroupcost import Cgroup2, cgroup2_mount, describe_cgroup_cost

HYBRID = (
    "30 25 0:27 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd\n"
    "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n"
)
UNIFIED = (
    "25 1 0:22 / / rw shared:1 - ext4 /dev/vda1 rw\n"
    "32 24 0:28 / /sys/fs/cgroup rw,nosuid,nodev shared:9 - cgroup2 cgroup2 "
    "rw,nsdelegate,favordynmods,memory_recursiveprot\n"
)


def test_the_cgroup2_mount_and_its_superblock_options_are_found() -> None:
    assert cgroup2_mount(HYBRID) == Cgroup2("/sys/fs/cgroup/unified", False)
    assert cgroup2_mount(UNIFIED) == Cgroup2("/sys/fs/cgroup", True)


def test_no_cgroup2_or_a_line_cut_short_is_none() -> None:
    assert cgroup2_mount(HYBRID.splitlines()[0]) is None
    assert cgroup2_mount("41 31 0:38 / /x rw - cgroup2") is None
    assert cgroup2_mount("cgroup2 - cgroup2 cgroup2 rw,favordynmods") is None
    assert cgroup2_mount("") is None


def test_the_header_says_the_cost_or_that_it_was_not_measured() -> None:
    host = {"cgroup2": "/sys/fs/cgroup", "favordynmods": True, "cgroup_move_ms": 0.31}
    assert "0.31 ms after an idle gap; cgroup2 favordynmods on" in describe_cgroup_cost(host)
    assert "not measured" in describe_cgroup_cost({"cgroup_move_ms": None})
