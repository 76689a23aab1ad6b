# Sourced by the GPU scripts, which run a tree in place on the device machine (nothing pip-installed there).
# link_packages DIR TREE: the packages setup.py installs under other names (package_dir: glmconv_cli from cli/,
# glmconv_fixtures, the data files, from fixtures/) made importable from DIR, which goes on PYTHONPATH.
link_packages() {
  mkdir -p "$1"
  ln -sfn "$2/cli" "$1/glmconv_cli"
  ln -sfn "$2/fixtures" "$1/glmconv_fixtures"
}
