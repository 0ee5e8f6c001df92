"""gpuslice/envsafety.py's bracket expressions, the Environment= names a template's word may
be, and the words of a refusal for %f, at their exact edges: an escaped `]` that ends the
pattern, a class whose own `]` follows at once, the first `.]` after a class's `[.` (not one
before it, not the last), a known specifier beside one not known, and %f's `after a /`."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from gpuslice import envsafety
from gpuslice.envsafety import FIX_INSTANCE, _names_it_may_be
from tests.test_envsafety import ETC, GATE, errors, install
from tests.test_envsafety import reaches_up as reaches_up  # a fixture
from tests.test_envsafety import root as root  # a fixture


@pytest.mark.parametrize(
    "part",
    [
        # `\]` is one of its characters, and the next `]` ends it: none after that one
        pytest.param("[.\\]]", id="escaped-close-last"),
        # `[.].]` is one class (the collating symbol `]`): the `]` after it ends the bracket
        pytest.param("[.[.].]]", id="dot-class"),
        pytest.param("[.[.]x.]]", id="dot-class-not-before"),
        pytest.param("[.[..]]", id="class-close-at-once"),
        # once a dot matched, `[:A` is no class: its `[` is itself, and `:]` ends the bracket
        pytest.param("[.[:Alpha:]", id="skipped-no-class"),
        pytest.param("[!a]", id="not-a"),
    ],
)
def test_a_bracket_is_read_on_from_the_end_glibc_gives_it(
    part: str, reaches_up: Callable[[str], bool]
) -> None:
    """A dot, then a bracket that glibc's own glob(3) reads as a dot ending where the part
    ends: `..` maybe, whichever `]` glibc ends it at."""
    assert reaches_up(f".{part}")
    assert envsafety._may_be_up(f".{part}")
    assert not envsafety._may_be_up(f".{part}x")


def test_names_a_word_may_be_with_a_known_specifier() -> None:
    """LD_TRACE@.service's %p is known (LD_TRACE), its %i is not: %p_L%i can only be
    LD_TRACE_LOADED_OBJECTS, each character after a specifier read once; %p%i either name
    that begins LD_TRACE (not LD_DEBUG or SHELLOPTS)."""
    unit = "LD_TRACE@.service"
    assert _names_it_may_be(unit, "%p_L%i") == ["LD_TRACE_LOADED_OBJECTS"]
    assert _names_it_may_be(unit, "%p%i") == ["LD_TRACE_LOADED_OBJECTS", "LD_TRACE_PRELINKING"]


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_unescaped_instance_after_a_slash(root: Path) -> None:
    """/etc/job/%f of a root template: %f is said as the name unescaped after a `/`; %I
    without those words."""
    install(root, "ff@.service", "EnvironmentFile=/etc/job/%f")
    install(root, "fi@.service", "EnvironmentFile=/etc/job/%I")
    tail = (
        "chooses: a `-` in it is a `/` ({0}@..-..-home-x.service: ../../home/x), so it can "
        "name any file; {1} {0}@.service {2}"
    )
    assert errors(root, "ff@.service") == [
        f"{ETC}/ff@.service:4: [Service] EnvironmentFile: /etc/job/%f cannot be checked: %f "
        "is the instance's name unescaped after a `/`, which whoever starts an instance of "
        "ff@.service " + tail.format("ff", GATE, FIX_INSTANCE)
    ]
    assert errors(root, "fi@.service") == [
        f"{ETC}/fi@.service:4: [Service] EnvironmentFile: /etc/job/%I cannot be checked: %I "
        "is the instance's name unescaped, which whoever starts an instance of fi@.service "
        + tail.format("fi", GATE, FIX_INSTANCE)
    ]
