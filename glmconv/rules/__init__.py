"""The mapping rules: one declarative, reversible table and the only code that spells tensor names."""

from glmconv.rules.table import RULES, Rule

__all__ = ["RULES", "Rule"]
