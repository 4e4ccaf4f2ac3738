"""The supported transformers range is declared once: the package metadata and the hook's version check agree."""

import configparser
import os
import re

from packaging.specifiers import SpecifierSet
from packaging.version import Version

from llm_packing import _compat


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_metadata_minimum_is_the_hooks_minimum():
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    minimum = re.search(r"transformers>=([0-9.]+)", config["options"]["install_requires"]).group(1)
    assert Version(minimum) == Version(_compat.MIN_TRANSFORMERS_VERSION)
    assert Version(_compat.MIN_TRANSFORMERS_VERSION) <= Version(_compat.MAX_TESTED_TRANSFORMERS_VERSION)


def test_metadata_admits_every_tested_release():
    """`pip install -e .` keeps a transformers the hook is tested on: an environment with 5.19 stays on 5.19 (pip's
    resolver, offline, in one with 5.19.0: "Would install llm_packing-0.2.0", no transformers)."""
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    requirements = config["options"]["install_requires"].split()
    requirement = next(line for line in requirements if line.startswith("transformers"))
    specifier = SpecifierSet(requirement.removeprefix("transformers"))
    for release in ("5.18.0", "5.19.0", "5.20.2", "5.21.1", "5.22.2", "5.23.0", "5.24.0"):
        assert specifier.contains(release), (requirement, release)
    assert not specifier.contains("5.17.0") and not specifier.contains("6.0.0")


def test_every_fact_holds_exactly_on_its_releases():
    """Each fact's probe of the installed transformers agrees with the releases the table gives it: run on every
    release of `.ci/transformers-range`, this keeps the table true."""
    wrong = {name: (fact.since, fact.until, fact.probe()) for name, fact in _compat.FACTS.items()
             if fact.probe() != fact.holds()}
    assert not wrong, f"transformers {_compat.TRANSFORMERS_VERSION}: {wrong}"
