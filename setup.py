from setuptools import find_packages, setup

# The click front end lives in `cli/` (the design card's layout) and installs as `glmconv_cli`, so that no
# top-level package named `cli` lands in site-packages.
setup(packages=[*find_packages(include=["glmconv", "glmconv.*"]), "glmconv_cli"], package_dir={"glmconv_cli": "cli"})
