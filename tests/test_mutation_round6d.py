"""gpuslice/envsafety.py's bracket expressions, the Environment= names a template's word may
be, and the words of a refusal for %f, at their exact edges: an escaped `]` that ends the
pattern, a class whose own `]` follows at once, the first `.]` after a class's `[.` (not one
before it, not the last), a known specifier beside one not known, and %f's `after a /`."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuslice.envsafety import FIX_INSTANCE, _bracket_end, _names_it_may_be
from tests.test_envsafety import ETC, GATE, errors, install
from tests.test_envsafety import root as root  # a fixture


@pytest.mark.parametrize(
    ("part", "end"),
    [
        # `\]` is one of its characters, and the next `]` ends it: none after that one
        pytest.param("[\\]]", 4, id="escaped-close-last"),
        # `[.].]` is one class (the collating symbol `]`): the `]` after it ends the bracket
        pytest.param("[[.].]]", 7, id="dot-class"),
        # the class's `.]` is searched for after its `[.`, not from the pattern's start
        pytest.param("[[.]x.]]", 8, id="dot-class-not-before"),
        # the first `.]` after the `[.` closes the class, not the last one
        pytest.param("[[.a.].]]", 8, id="first-class-close"),
        # `[..]`: the class's `.]` may come right after its `[.`
        pytest.param("[[..]]", 6, id="class-close-at-once"),
    ],
)
def test_bracket_end(part: str, end: int) -> None:
    """Where the bracket whose `[` is at 0 ends, past its `]`."""
    assert _bracket_end(part, 1) == end


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
