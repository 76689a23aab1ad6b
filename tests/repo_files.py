"""Reference data the repository keeps (tests read nothing outside it)."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
REAL_CONFIG = ROOT / "glmconv" / "fixtures" / "glm-5.3-flash.config.json"  # the release's config.json (package data)
