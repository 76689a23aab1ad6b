# Sourced by the GPU scripts, which run a tree in place on the device machine (nothing pip-installed there).
# link_packages DIR TREE: the packages setup.py installs under other names (package_dir: glmconv_cli from cli/,
# glmconv_fixtures, the data files, from fixtures/) made importable from DIR, which goes on PYTHONPATH.
link_packages() {
  mkdir -p "$1"
  ln -sfn "$2/cli" "$1/glmconv_cli"
  ln -sfn "$2/fixtures" "$1/glmconv_fixtures"
}
# packages STEP: the GPU machine's extra packages into /tmp/site (tilelang) and /tmp/site-z3 (z3, fla, megatron-core,
# ...), each skipped where already there. sites: .sites/*.tar.xz (scripts/pack-sites.sh: the wheels below unpacked
# and xz'd to 39 MB, so that they and the tree travel in one call); whl | z3: the .whl / .whl-z3 wheels (two calls:
# 64 MiB per call; scripts/stage-wheels.sh). Then what imports, before any run depends on it (2026-12-06: a
# hand-made archive held an empty site-z3 folder, and a check by folder skipped the real one).
packages() {
  local pip=(python3 -m pip install -q --no-index --no-deps --no-compile --target)
  case $1 in
    sites) [ -d /tmp/site/tilelang ] || tar -xJf .sites/sites.tar.xz -C /tmp
           [ -d /tmp/site-z3/fla ] || tar -xJf .sites/z3.tar.xz -C /tmp ;;
    whl) [ -d /tmp/site/tilelang ] || "${pip[@]}" /tmp/site .whl/*.whl ;;
    z3) [ -d /tmp/site-z3/fla ] || "${pip[@]}" /tmp/site-z3 .whl-z3/*.whl ;;
  esac
  [ "$1" = whl ] || PYTHONPATH=/tmp/site:/tmp/site-z3 python3 -c "import fla, tilelang, megatron.core as m, jsonschema, hypothesis; \
print('packages:', fla.__version__, tilelang.__version__, m.__version__)" 2>&1 | tail -n 1
}
# keep_tracebacks RES: the tracebacks glmconv saved for its internal errors (one line on stderr names each) into RES,
# so that `pack` brings them back
keep_tracebacks() { cp "${TMPDIR:-/tmp}"/glmconv-internal-error-*.txt "$1"/ 2>/dev/null || true; }
# kernel_cache: Triton's compiled kernels and its autotuning results kept on disk in $TRITON_CACHE_DIR (default
# /tmp/triton-cache; TRITON_CACHE_AUTOTUNING=1), seeded once from a carried out/gpu/kernel-cache.tar.xz where there is
# one: on a fresh machine tests/gpu's five KDA tests spent 62-70 s each compiling and autotuning (2026-12-07,
# 372 s of the suite's). The kernels are keyed by Triton's version, the target (sm_90: H100 and H200 alike) and
# their source, so a cache from another image or GPU generation is simply not used.
# save_kernel_cache DIR: the cache packed into DIR/kernel-cache.tar.xz, for the next session's out/gpu, where the run
# added to it: a seeded cache left as it was is not packed again (2026-12-07: a tests call took 144 s for 32 s of
# tests; packing its 251 MB with one xz thread takes 75 s), and xz packs on every core.
kernel_cache() {
  export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/tmp/triton-cache} TRITON_CACHE_AUTOTUNING=1
  mkdir -p "$TRITON_CACHE_DIR"
  if [ -f out/gpu/kernel-cache.tar.xz ] && [ ! -e "$TRITON_CACHE_DIR/.seeded" ]; then
    tar -xJf out/gpu/kernel-cache.tar.xz -C "$TRITON_CACHE_DIR" && touch "$TRITON_CACHE_DIR/.seeded"
  fi
}
save_kernel_cache() {
  local seeded="$TRITON_CACHE_DIR/.seeded"
  if [ -e "$seeded" ] && [ -z "$(find "$TRITON_CACHE_DIR" -newer "$seeded" -type f -print -quit)" ]; then
    echo "kernel cache unchanged: out/gpu/kernel-cache.tar.xz holds it"; return 0
  fi
  XZ_OPT=-T0 tar -cJf "$1/kernel-cache.tar.xz" -C "$TRITON_CACHE_DIR" --exclude=./.seeded . && du -h "$1/kernel-cache.tar.xz"
}
