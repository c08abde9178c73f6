"""Setup as the docs give it: the install pins /usr/bin/python3 (the first python3 on PATH may lack
torch), the test command names every variable the suite reads, and venv/ is ignored by git.
(The TLS failure hints are in test_security.py.)"""

import glob
import os
import re
import shutil
import subprocess

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
PACKAGE = os.path.dirname(HERE)
ROOT = os.path.dirname(os.path.dirname(PACKAGE))
READMES = [os.path.join(PACKAGE, "README.md"), os.path.join(ROOT, "README.md")]


def read(path):
    with open(path, encoding="utf-8") as f:
        return f.read()


def variables_the_suite_reads():
    names = set()
    for path in glob.glob(os.path.join(HERE, "*.py")):
        names |= set(re.findall(r'os\.environ(?:\.get\(|\[)\s*"([A-Z_]+)"', read(path)))
    return names


@pytest.mark.parametrize("readme", READMES, ids=["package", "repository"])
def test_install_pins_the_system_python(readme):
    text = read(readme)
    assert "/usr/bin/python3 -m venv --system-site-packages venv" in text
    # No install line that leaves the interpreter to PATH.
    assert not re.search(r"(?<![/\w])python3 -m venv", text)


@pytest.mark.parametrize("readme", READMES, ids=["package", "repository"])
def test_test_command_names_every_variable(readme):
    text = read(readme)
    commands = [c for c in re.findall(r"```sh\n(.*?)```", text, re.S) if "pytest" in c]
    assert commands, "no test command"
    command = commands[0].replace("\\\n", " ")
    wanted = variables_the_suite_reads() | {"PYTHONPATH"}
    assert {"GRADWIRE_SERVER_BIN", "GRADWIRE_CLI_BIN"} <= wanted  # the scan itself works
    for name in sorted(wanted):
        assert f"{name}=" in command, f"{os.path.basename(readme)}'s test command lacks {name}"
    assert "/usr/bin/python3 -m pytest" in command and "client/python/tests" in command


def test_venv_is_ignored():
    if shutil.which("git") is None or not os.path.exists(os.path.join(ROOT, ".git")):
        lines = read(os.path.join(ROOT, ".gitignore")).split()
        assert "venv/" in lines or "/venv/" in lines
        return
    for path in ("venv/", "venv/bin/python", "client/python/venv/"):
        run = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=ROOT)
        assert run.returncode == 0, f"{path} is not ignored"
