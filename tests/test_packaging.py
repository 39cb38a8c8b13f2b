"""The package as users install it: a wheel built from the source tree and installed without ``-e`` into a
fresh folder holds every module of the tree, and the ``tidal`` command and the offline engine run from it."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys

import pytest

import tidal

ROOT = os.path.dirname(os.path.abspath(tidal.__file__))
# Folders of the repository that are not part of the package (the measurement scripts, the maintainer
# tools, the tests, the docs and images), and files at its root that are not modules of it.
NOT_PACKAGE = {"tests", "benchmarks", "tools", "docs", "docker", "build", "dist"}
NOT_MODULES = {"setup.py"}
IGNORE = shutil.ignore_patterns(".venv", ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                ".ruff_cache", ".devkit")


def source_modules() -> list[str]:
    """Every module the source tree holds, as the installed package should name it."""
    out = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        rel = os.path.relpath(dirpath, ROOT)
        top = rel.split(os.sep)[0]
        if rel != "." and (top in NOT_PACKAGE or top.startswith(".") or top.endswith(".egg-info")):
            dirnames[:] = []
            continue
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
        for name in filenames:
            if not name.endswith(".py") or (rel == "." and name in NOT_MODULES):
                continue
            parts = [] if rel == "." else rel.split(os.sep)
            stem = name[:-3]
            out.append(".".join(["tidal", *parts, *([] if stem == "__init__" else [stem])]))
    return sorted(out)


# Runs in the child: only the installed folder may provide ``tidal`` (the editable install's finder of the
# test environment is taken out), and every module of the source tree must import from there.
IMPORT_ALL = r"""
import importlib, json, os, sys
site = sys.argv[1]
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "") and
                    "editable" not in type(f).__module__ and "editable" not in getattr(f, "__name__", "")]
sys.path.insert(0, site)
failed = {}
for name in json.loads(sys.stdin.read()):
    try:
        module = importlib.import_module(name)
        if not os.path.abspath(module.__file__).startswith(site + os.sep):
            failed[name] = f"imported from {module.__file__}, not from the install"
    except Exception as e:
        failed[name] = f"{type(e).__name__}: {e}"
print(json.dumps(failed))
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> str:
    """The folder a wheel of a copy of the source tree was installed into (``pip install --target``)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src, dist, site = tmp / "src", tmp / "dist", tmp / "site"
    shutil.copytree(ROOT, src, ignore=IGNORE)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(pip + ["wheel", "--no-deps", "--no-build-isolation", str(src), "-w", str(dist)],
                   check=True, timeout=300, cwd=tmp)
    (wheel,) = glob.glob(str(dist / "tidal-*.whl"))
    subprocess.run(pip + ["install", "--no-deps", "--target", str(site), wheel], check=True, timeout=300, cwd=tmp)
    return str(site)


def child_env(site: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = site
    return env


def test_every_module_of_the_tree_imports_from_the_wheel(installed):
    modules = source_modules()
    assert "tidal.executor.distributed.shard" in modules and "tidal.runtime.supervisor" in modules
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL, installed], input=json.dumps(modules), text=True,
                         capture_output=True, check=True, timeout=300, cwd=os.path.dirname(installed))
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {}
    assert os.path.exists(os.path.join(installed, "tidal", "frontend", "chat.html"))
    assert not os.path.exists(os.path.join(installed, "tidal", "setup.py"))
    assert not os.path.exists(os.path.join(installed, "tidal", "tests"))


def test_a_subpackage_left_out_is_caught(installed, tmp_path):
    """The check above fails for a tree whose wheel lacks a subpackage: a copy of the install without
    ``tidal/executor/distributed`` is reported."""
    broken = tmp_path / "site"
    shutil.copytree(installed, broken, ignore=shutil.ignore_patterns("distributed"))
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(broken)], input=json.dumps(source_modules()),
                         text=True, capture_output=True, check=True, timeout=300, cwd=tmp_path)
    failed = json.loads(out.stdout.strip().splitlines()[-1])
    assert "tidal.executor.distributed" in failed and "tidal.executor.runner" in failed


def test_the_installed_command_and_engine_run(installed, tiny_checkpoint, tmp_path):
    env = child_env(installed)
    version = subprocess.run([os.path.join(installed, "bin", "tidal"), "--version"], env=env, text=True,
                             capture_output=True, check=True, timeout=120, cwd=tmp_path)
    assert version.stdout.strip() == f"tidal {tidal.__version__}"
    ckpt = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "tidal.cli", "checkpoint", "--preset", "tiny", "--out", str(ckpt)],
                   env=env, check=True, timeout=300, cwd=tmp_path, capture_output=True)
    prompt = [9707, 11, 1879, 0, 576, 374, 264]
    script = ("import json, sys, tidal; from tidal import LLM; "
              "print(json.dumps([tidal.__file__, LLM(sys.argv[1]).generate([json.loads(sys.argv[2])], "
              "max_tokens=6, ignore_eos=True)[0]]))")
    out = subprocess.run([sys.executable, "-c", script, str(ckpt), json.dumps(prompt)], env=env, text=True,
                         capture_output=True, check=True, timeout=300, cwd=tmp_path)
    where, ids = json.loads(out.stdout.strip().splitlines()[-1])
    assert where.startswith(installed + os.sep)
    from tidal import LLM

    # The same seeded preset written and run by the source tree gives the same ids.
    assert ids == LLM(tiny_checkpoint).generate([prompt], max_tokens=6, ignore_eos=True)[0]
