# Sourced by the build scripts, from the repository root: ccache keys on paths relative to the
# checkout, so a fresh clone elsewhere (CI's) reuses the compilations of this one (-g builds
# record the build directory, which CCACHE_NOHASHDIR leaves out of the key).
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
export CCACHE_NOHASHDIR="${CCACHE_NOHASHDIR:-1}"
