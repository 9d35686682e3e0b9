"""The public surface: every name in the `__all__` of tfbig's public modules imports, the docs'
Python API page documents each of them, and every module that moved keeps its old name for one
release with a DeprecationWarning naming the new place (tfbig.compat.MOVED)."""
import importlib
import os
import subprocess
import sys

import pytest

from tfbig.compat import MOVED

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PUBLIC = ["tfbig", "tfbig.api", "tfbig.tasks.user", "tfbig.data", "tfbig.models",
          "tfbig.distribute.horovod_keras"]


@pytest.mark.parametrize("name", PUBLIC)
def test_every_public_name_imports(name):
    module = importlib.import_module(name)
    assert module.__all__ and len(set(module.__all__)) == len(module.__all__)
    for public in module.__all__:
        assert getattr(module, public) is not None, f"{name}.{public}"
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        module.not_a_name  # noqa: B018


def test_the_package_reexports_the_api_without_importing_it_first():
    """`import tfbig` imports nothing: the public names come from tfbig.api when first read."""
    import tfbig
    from tfbig import api

    for name in api.__all__:
        assert getattr(tfbig, name) is getattr(api, name)
    assert set(api.__all__) <= set(tfbig.__all__) and set(api.__all__) <= set(dir(tfbig))


def test_the_python_api_page_documents_the_public_api():
    page = open(os.path.join(ROOT, "docs", "reference", "python-api.md")).read()
    for name in ("tfbig.api", "tfbig.tasks.user.Task", "tfbig.tasks.user.DataShard"):
        assert f"::: {name}" in page, name
    from tfbig import api

    members = page[page.index("::: tfbig.api"):].split("members: [", 1)[1].split("]", 1)[0]
    documented = {name.strip() for name in members.split(",")}
    # Task and DataShard are tfbig.tasks.user's, documented there
    assert set(api.__all__) - {"Task", "DataShard"} <= documented, documented


# tfbig-prep defines its absl flags at import, as other tools in this process do: its old name
# is run as a command below instead
@pytest.mark.parametrize("old, new", sorted((old, new) for old, new in MOVED.items()
                                            if not old.endswith(".__main__")
                                            and old != "data_prep.prep"))
def test_a_moved_module_keeps_its_old_name_with_a_warning(old, new):
    sys.modules.pop(old, None)
    parent, _, child = old.rpartition(".")
    vars(importlib.import_module(parent)).pop(child, None)  # a submodule attribute, not the package's own
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}: import it from there"):
        shim = importlib.import_module(old)
    assert shim is importlib.import_module(new)
    # the old name imported is the package's attribute: drop it, as a process that never
    # imported it has none (tfbig.train is also the API function)
    sys.modules.pop(old)
    vars(sys.modules[parent]).pop(child)


@pytest.mark.parametrize("old, expected", [
    ("tfbig.plan", "tfbig-plan"),  # a package's __main__, now tfbig.commands.plan
    # a process each (~8 s): the rest take the same compatibility map (slow)
    pytest.param("tfbig.consolidate", "usage: python -m tfbig.commands.consolidate",
                 marks=pytest.mark.slow),
    pytest.param("tfbig.squad.cli", "tfbig-squad", marks=pytest.mark.slow),
    pytest.param("data_prep.prep", "tfbig-prep", marks=pytest.mark.slow),
    pytest.param("launch.local", "tfbig-launch", marks=pytest.mark.slow)])
def test_python_dash_m_of_an_old_name_runs_its_command(old, expected):
    done = subprocess.run([sys.executable, "-m", old, "--help"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert expected in done.stdout + done.stderr, (done.stdout + done.stderr)[-2000:]


def test_the_train_command_leaves_tfbig_train_the_api_function():
    """tfbig-train's entry point (and `python -m tfbig.train`) import the command as
    tfbig.commands.train: a module imported as tfbig.train would become the package's attribute
    and hide tfbig.train, the API function, in that process."""
    code = ("import tfbig.commands.train, tfbig, tfbig.api; "
            "assert tfbig.train is tfbig.api.train, tfbig.train")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    entry = [line for line in open(os.path.join(ROOT, "setup.py")) if "tfbig-train=" in line]
    assert entry and "tfbig.commands.train:run" in entry[0]


def test_the_post_recipe_import_of_the_previous_release_still_works():
    sys.modules.pop("tfbig.manifest", None)
    with pytest.warns(DeprecationWarning, match="tfbig.data.manifest"):
        from tfbig.manifest import load_manifest
    from tfbig.data import load_manifest as new

    assert load_manifest is new
