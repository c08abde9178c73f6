# Source this on the GPU machine, from the repo root, with .device-deps/ carried along. Unpacks
# the Debian packages into /opt/gwdeps (never into /: that can break the machine's own tools) and
# points CMake, pkg-config and the loader at them and at the libtorch inside python3's torch.
if [ ! -d /opt/gwdeps/usr ]; then
  for f in .device-deps/*.deb; do dpkg -x "$f" /opt/gwdeps; done
  # Debian's symlinks for shared objects point at absolute /usr paths in some packages.
  find /opt/gwdeps -xtype l | while read -r l; do
    t=$(readlink "$l")
    case "$t" in /usr/*) ln -sf "/opt/gwdeps$t" "$l" ;; esac
  done
fi
# pkg-config files name /usr in prefix, libdir, includedir and flags: point them at the unpacked
# tree (idempotent: an already rewritten path no longer matches).
find /opt/gwdeps/usr/lib/x86_64-linux-gnu/pkgconfig /opt/gwdeps/usr/share/pkgconfig -name '*.pc' \
  -exec sed -i 's#=/usr\(/\|$\)#=/opt/gwdeps/usr\1#; s#-L/usr/#-L/opt/gwdeps/usr/#g; s#-I/usr/#-I/opt/gwdeps/usr/#g' {} + 2>/dev/null
export GWDEPS=/opt/gwdeps/usr
export PATH="$GWDEPS/bin:/usr/local/cuda/bin:$PATH"
# cuBLASLt: the toolkit's, else the one inside the Python wheels.
_gw_lt=$(ls -d /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib 2>/dev/null | head -1)
export LD_LIBRARY_PATH="$GWDEPS/lib/x86_64-linux-gnu${_gw_lt:+:$_gw_lt}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PKG_CONFIG_PATH="$GWDEPS/lib/x86_64-linux-gnu/pkgconfig:$GWDEPS/share/pkgconfig"
TORCH_PREFIX=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null)
export TORCH_PREFIX
export CMAKE_PREFIX_PATH="$GWDEPS;$GWDEPS/lib/x86_64-linux-gnu/cmake${TORCH_PREFIX:+;$TORCH_PREFIX}"
echo "device env: deps at $GWDEPS, torch cmake prefix ${TORCH_PREFIX:-none}, $(nvcc --version | tail -1)"
