"""The package installs with pip into a venv that shares Debian's torch, grpcio and protobuf, with
no package index and no C++ build, and works from there."""

import os
import re
import subprocess
import sys

import gradwire

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(HERE)
ROOT = os.path.dirname(os.path.dirname(PACKAGE))


def test_version_is_the_project_version():
    with open(os.path.join(ROOT, "CMakeLists.txt")) as f:
        project = re.search(r"project\(gradwire VERSION (\S+)", f.read()).group(1)
    assert gradwire.__version__ == project


def test_public_api_is_typed_and_documented():
    import inspect
    for name in gradwire.__all__:
        if name == "__version__":
            continue
        obj = getattr(gradwire, name)
        assert inspect.getdoc(obj), f"{name} has no docstring"
    for method in ("forward", "backward", "get_weights", "set_weights", "apply_gradients"):
        sig = inspect.signature(getattr(gradwire.Client, method))
        assert sig.return_annotation is not inspect.Signature.empty, method


def test_pip_install_into_a_venv(tmp_path, server):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)],
                   check=True)
    py = str(venv / "bin" / "python")
    build = tmp_path / "build"
    out = subprocess.run([py, "-m", "pip", "install", "--no-build-isolation", "--no-index",
                          "--quiet", PACKAGE],
                         capture_output=True, text=True,
                         env={**os.environ, "PIP_BUILD": str(build)})
    assert out.returncode == 0, out.stdout + out.stderr
    # From anywhere but the source tree, with no PYTHONPATH: the installed copy and its stubs.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    code = ("import gradwire, torch, os; "
            "assert 'site-packages' in gradwire.__file__, gradwire.__file__; "
            "assert os.path.isfile(os.path.join(os.path.dirname(gradwire.__file__), "
            "'py.typed')); "
            f"c = gradwire.Client({server!r}); "
            "m = gradwire.RemoteLinear(c, 4, 2); "
            "print(gradwire.__version__, tuple(m(torch.randn(3, 4)).shape)); "
            "c.close()")
    run = subprocess.run([py, "-c", code], capture_output=True, text=True, cwd=str(tmp_path),
                         env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == [gradwire.__version__, "(3,", "2)"]
