# Sourced by the GPU scripts, which run a tree in place on the device machine (nothing pip-installed there).
# link_packages DIR TREE: the packages setup.py installs under other names (package_dir: glmconv_cli from cli/,
# glmconv_fixtures, the data files, from fixtures/) made importable from DIR, which goes on PYTHONPATH.
link_packages() {
  mkdir -p "$1"
  ln -sfn "$2/cli" "$1/glmconv_cli"
  ln -sfn "$2/fixtures" "$1/glmconv_fixtures"
}
# unpack_sites: /tmp/site and /tmp/site-z3 from .sites/*.tar.xz (scripts/pack-sites.sh: the same packages as the
# .whl and .whl-z3 wheels, unpacked and xz'd to 39 MB, so that they and the tree travel in one call).
unpack_sites() {
  [ -d /tmp/site/tilelang ] || tar -xJf .sites/sites.tar.xz -C /tmp
  [ -d /tmp/site-z3/fla ] || tar -xJf .sites/z3.tar.xz -C /tmp
  # what imports, before any run depends on it (2026-12-06: a hand-made archive held an empty site-z3)
  PYTHONPATH=/tmp/site:/tmp/site-z3 python3 -c "import fla, tilelang, megatron.core as m; print('sites:', \
fla.__version__, tilelang.__version__, m.__version__)" 2>&1 | tail -n 1
  ls /tmp/site /tmp/site-z3 | tr '\n' ' ' | head -c 600; echo
}
