"""The data glmconv reads at run time: the repository's top-level `fixtures/`, installed as `glmconv_fixtures`.

One copy of each file: an editable install reads the repository's folder, a wheel the copy it installed.
"""

from __future__ import annotations

from importlib import resources

from glmconv.errors import GlmconvError

DATA_PACKAGE = "glmconv_fixtures"  # setup.py: package_dir {"glmconv_fixtures": "fixtures"}
REAL_CONFIG_FILE = "glm-5.3-flash.config.json"  # the release's config.json (the real-cut presets)
DEFECTS_FILE = "defects.json"  # the planted-defect catalog (glmconv.compare.catalog)


def read_text(name: str) -> str:
    """One data file's text, wherever the install put it; a GlmconvError (not a traceback) when it is missing."""
    try:
        return resources.files(DATA_PACKAGE).joinpath(name).read_text(encoding="utf-8")
    except (ModuleNotFoundError, FileNotFoundError) as e:
        raise GlmconvError(f"glmconv's data file {name} is missing from the {DATA_PACKAGE} package: "
                           "reinstall glmconv") from e
