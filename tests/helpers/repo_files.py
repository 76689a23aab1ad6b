"""Reference data the repository keeps (tests read nothing outside it): the top-level `fixtures/` folder."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "fixtures"  # data only; installed as the `glmconv_fixtures` package (glmconv/data_files.py)
REAL_CONFIG = FIXTURES / "glm-5.3-flash.config.json"  # the release's config.json
DEFECTS = FIXTURES / "defects.json"  # the planted-defect catalog's definitions (glmconv/compare/catalog.py)
RELEASE_TENSORS = FIXTURES / "release-tensors.json"  # every tensor of the FP8 release (glmconv/fixtures/golden.py)
GOLDEN = FIXTURES / "golden"  # expected outputs of deterministic renderings (tests/helpers/goldens.py)
