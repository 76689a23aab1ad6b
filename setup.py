from setuptools import find_packages, setup

# The click front end lives in `cli/` (the design card's layout) and installs as `glmconv_cli`, so that no
# top-level package named `cli` lands in site-packages; likewise the data in `fixtures/` (the real config, the
# defect catalog) installs as `glmconv_fixtures`, read with importlib.resources (glmconv/data_files.py).
setup(packages=[*find_packages(include=["glmconv", "glmconv.*"]), "glmconv_cli", "glmconv_fixtures"],
      package_dir={"glmconv_cli": "cli", "glmconv_fixtures": "fixtures"})
