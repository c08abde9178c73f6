"""The package installs with pip into a venv that shares Debian's torch, grpcio and protobuf, with
no package index and no C++ build, and works from there."""

import os
import re
import shutil
import subprocess

import pytest

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


def _files(top):
    return {os.path.relpath(os.path.join(d, f), top) for d, _, fs in os.walk(top) for f in fs}


@pytest.mark.parametrize("readme", [os.path.join(PACKAGE, "README.md"),
                                    os.path.join(ROOT, "README.md")], ids=["package", "repository"])
def test_readme_install_into_a_venv(tmp_path, server, readme):
    """The README's install commands, run in a copy of the checkout: they install a working
    package and leave nothing (build/, *.egg-info) in the checkout."""
    with open(readme, encoding="utf-8") as f:
        blocks = [b for b in re.findall(r"```sh\n(.*?)```", f.read(), re.S) if "pip install" in b]
    assert blocks, "no install command"
    checkout = tmp_path / "checkout"
    package = checkout / "client" / "python"
    package.mkdir(parents=True)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(PACKAGE, name), package / name)
    shutil.copytree(os.path.join(PACKAGE, "gradwire"), package / "gradwire",
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = _files(checkout)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["TMPDIR"] = str(tmp_path)
    out = subprocess.run(["bash", "-e", "-c", blocks[0]], cwd=str(checkout), capture_output=True,
                         text=True, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    left = {f for f in _files(checkout) - before if not f.startswith("venv" + os.sep)}
    assert not left, f"the install left files in the checkout: {sorted(left)[:5]}"
    py = str(checkout / "venv" / "bin" / "python")
    # From anywhere but the source tree, with no PYTHONPATH: the installed copy and its stubs.
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
