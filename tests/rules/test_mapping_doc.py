"""docs/mapping.md is the rule table rendered: it cannot drift from the code."""

from helpers.repo_files import ROOT

from glmconv.rules.doc import render


def test_docs_mapping_md_is_the_rendered_rule_table() -> None:
    assert (ROOT / "docs" / "mapping.md").read_text() == render(), "run: python -m glmconv.rules.doc > docs/mapping.md"


def test_every_rule_has_a_row() -> None:
    from glmconv.rules import RULES

    assert render().count("\n| `") == len(RULES)
