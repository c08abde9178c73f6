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
# libtorch: python3's torch (the GPU machine's, with CUDA), else the system python's, else a
# system libtorch (Debian's libtorch-dev). A prefix counts only if it holds TorchConfig.cmake:
# Debian's python3-torch names a cmake prefix it does not ship. TORCH_PYTHON is the python whose
# torch that is (the PyTorch side of the benchmark), empty when none imports torch.
TORCH_PREFIX="" TORCH_PYTHON=""
for _gw_py in python3 /usr/bin/python3; do
  _gw_p=$("$_gw_py" -c 'import torch; print(torch.utils.cmake_prefix_path)' 2>/dev/null) || continue
  [ -n "$TORCH_PYTHON" ] || TORCH_PYTHON=$_gw_py
  if [ -f "$_gw_p/Torch/TorchConfig.cmake" ]; then
    TORCH_PREFIX=$_gw_p TORCH_PYTHON=$_gw_py
    break
  fi
done
if [ -z "$TORCH_PREFIX" ] && [ -f /usr/lib/x86_64-linux-gnu/cmake/Torch/TorchConfig.cmake ]; then
  TORCH_PREFIX=/usr/lib/x86_64-linux-gnu/cmake
fi
export TORCH_PREFIX TORCH_PYTHON
export CMAKE_PREFIX_PATH="$GWDEPS;$GWDEPS/lib/x86_64-linux-gnu/cmake${TORCH_PREFIX:+;$TORCH_PREFIX}"
echo "device env: deps at $GWDEPS, torch cmake prefix ${TORCH_PREFIX:-none}" \
  "(python ${TORCH_PYTHON:-none}), $(nvcc --version | tail -1)"
