"""The tools are not installed: make this checkout's tools/ importable as `tools` without
putting the source tree (and its uninstalled tpsample/) first on sys.path."""
import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
if "tools" not in sys.modules:
    spec = importlib.util.spec_from_file_location(
        "tools", ROOT / "tools" / "__init__.py", submodule_search_locations=[str(ROOT / "tools")])
    module = importlib.util.module_from_spec(spec)
    sys.modules["tools"] = module
    spec.loader.exec_module(module)
