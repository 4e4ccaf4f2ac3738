"""The supported transformers range is declared once: the package metadata and the hook's version check agree."""

import configparser
import os
import re

from packaging.version import Version

from llm_packing import _compat


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_metadata_minimum_is_the_hooks_minimum():
    config = configparser.ConfigParser()
    config.read(os.path.join(ROOT, "setup.cfg"))
    minimum = re.search(r"transformers>=([0-9.]+)", config["options"]["install_requires"]).group(1)
    assert Version(minimum) == Version(_compat.MIN_TRANSFORMERS_VERSION)
    assert Version(_compat.MIN_TRANSFORMERS_VERSION) <= Version(_compat.MAX_TESTED_TRANSFORMERS_VERSION)


def test_every_fact_holds_exactly_on_its_releases():
    """Each fact's probe of the installed transformers agrees with the releases the table gives it: run on every
    release of `.ci/transformers-range`, this keeps the table true."""
    wrong = {name: (fact.since, fact.until, fact.probe()) for name, fact in _compat.FACTS.items()
             if fact.probe() != fact.holds()}
    assert not wrong, f"transformers {_compat.TRANSFORMERS_VERSION}: {wrong}"
